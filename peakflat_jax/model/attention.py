"""Causal attention over packed documents, and its Ulysses form on the MoP mesh.

``causal_attention(q, k, v, segment_ids)``: softmax attention where token i of a sequence sees
token j iff j <= i and both lie in the same document (equal segment ids; padding, segment 0,
forms its own segment, so no row is ever empty). Grouped-query: q has Hq heads, k and v Hkv
heads, q head h reads kv head h // (Hq / Hkv). Two kernels with the same semantics:

* ``"cudnn"``: cuDNN flash attention (GPU, bf16/f16): no [T, T] array. One document per
  sequence takes ``jax.nn.dot_product_attention(is_causal=True)``; packed documents take cuDNN's
  packed-segment layout (each sequence's runs of equal segment ids as [start, length] lists of
  a static size, ``max_segments + 1``: padding is a run too). The packed layout is reached through
  jax's cuDNN module (``jax._src.cudnn``), which the public function does not expose; jax is
  pinned, and ``scripts/gpu_checks.sh`` compares it with the XLA kernel on a GPU.
* ``"xla"``: ``jax.nn.dot_product_attention(implementation="xla")`` with an explicit [T, T]
  mask: O(B H T^2) memory, for CPUs, tests and short contexts.

gpt-oss's two additions, on the XLA kernel only (cuDNN's fused kernels, as jax reaches them,
take neither a per-layer traced window nor sinks: ``choose_implementation`` refuses them):

* a sliding window (``window``, traced: one scanned layer body serves sliding and full
  layers): token i also needs i - j < window (0: no window);
* attention sinks (``sinks [Hq]``): a logit per head that joins every row's softmax as one
  more column with no value, so a row's weights sum to less than one. Written out
  (``dense_attention``: logits, mask, softmax with the sink column, in fp32), as transformers'
  eager gpt-oss attention is.

``ulysses_attention`` runs it on global arrays split over the mesh's (data, seq) axes: within
``seq``, an all-to-all trades the sequence split for a head split (each device then attends over
the whole sequence for Hq / seq heads), and a second one trades back. The kv heads are repeated
to Hq first when seq does not divide Hkv. Memory per device: q, k, v and the output of
B_local x T x (H / seq) heads, twice during each exchange, plus the kernel's own (cuDNN:
O(B T H / seq) for its softmax statistics).

Legend: B sequences, T sequence length, Hq / Hkv query / kv heads, D head width.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

IMPLEMENTATIONS = ("auto", "cudnn", "xla")
CUDNN_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# jax 0.11.2's cuDNN flash attention trains only sequences of an even length: its training path
# always hands cuDNN a bias operand (an empty one where there is none), and a biased pattern
# needs T % 2 == 0 (``check_is_flash_attention``). Measured on an H200: 634,549 refused with
# NotImplementedError at trace time, 443,720 and 634,496 trained.
CUDNN_SEQUENCE_MULTIPLE = 2


def choose_implementation(requested: str, platform: str, dtype, *,
                          xla_only: tuple[str, ...] = ()) -> str:
    """``auto``: cuDNN on a GPU when the dtype is bf16/f16, else XLA; XLA whenever the model
    needs what only it computes (``xla_only``: the model fields that ask for it, e.g.
    ``model.attention_sinks``). An explicit ``cudnn`` where it cannot run is an error naming
    why."""
    if requested not in IMPLEMENTATIONS:
        raise ValueError(f"attention: expected one of {IMPLEMENTATIONS}, got {requested!r}")
    cudnn_ok = platform == "gpu" and jnp.dtype(dtype) in CUDNN_DTYPES
    if requested == "auto":
        return "cudnn" if cudnn_ok and not xla_only else "xla"
    if requested == "cudnn" and not cudnn_ok:
        raise ValueError(f"attention: cudnn needs a GPU and bf16/f16 activations, got platform "
                         f"{platform} and {jnp.dtype(dtype)}")
    if requested == "cudnn" and xla_only:
        raise ValueError(f"attention: cudnn cannot compute {', '.join(xla_only)} (not done "
                         f"yet: the XLA kernel can, operators.attention: xla)")
    return requested


def sequence_multiple(implementation: str) -> int:
    """The sequence lengths the kernel trains are the multiples of this (cuDNN: even ones,
    ``CUDNN_SEQUENCE_MULTIPLE``; XLA: any)."""
    return CUDNN_SEQUENCE_MULTIPLE if implementation == "cudnn" else 1


def check_sequence_length(implementation: str, seq_len: int) -> None:
    """Raises ValueError where ``implementation`` cannot train sequences of ``seq_len`` tokens
    (before anything is traced: jax's own check fires at trace time, as a traceback)."""
    multiple = sequence_multiple(implementation)
    if seq_len % multiple:
        raise ValueError(f"cuDNN flash attention trains only sequence lengths that are "
                         f"multiples of {multiple}, got {seq_len} (take "
                         f"{seq_len - seq_len % multiple}, or "
                         f"operators.attention: xla)")


def xla_only_fields(model) -> tuple[str, ...]:
    """The fields of a ModelConfig that only the XLA kernel computes (module doc), as
    ``choose_implementation``'s ``xla_only``."""
    return tuple(name for name, on in (("model.attention_sinks", model.attention_sinks),
                                       ("model.sliding_window", model.sliding_window > 0)) if on)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array,
                     segment_ids: jax.Array | None, *, implementation: str,
                     max_segments: int = 1, sinks: jax.Array | None = None,
                     window: jax.Array | None = None) -> jax.Array:
    """[B, T, Hq, D] attention of one device's whole sequences (module doc).

    ``segment_ids [B, T]`` int (None: one document per sequence); ``max_segments``: the most
    documents in a sequence (static, for the packed cuDNN layout); ``sinks [Hq]``: the heads'
    sink logits; ``window``: an int32 scalar, the keys a query sees, itself included (0: all).
    The last two: XLA only.
    """
    scale = q.shape[-1] ** -0.5
    if sinks is not None or window is not None:
        if implementation != "xla":
            raise ValueError("attention: sinks and sliding windows need implementation='xla'")
        return dense_attention(q, k, v, segment_ids, scale=scale, sinks=sinks, window=window)
    if implementation == "xla":
        mask = None
        if segment_ids is not None:
            same = segment_ids[:, :, None] == segment_ids[:, None, :]
            mask = same[:, None]  # [B, 1, T, T], combined with the causal mask
        return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, scale=scale,
                                            implementation="xla")
    if segment_ids is None or max_segments == 1:
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                            implementation="cudnn")
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    offsets, lengths = segment_runs(segment_ids, max_segments + 1)
    return cudnn.dot_product_attention(
        q, k, v, q_seqlen=lengths, kv_seqlen=lengths, q_offsets=offsets, kv_offsets=offsets,
        scale=scale, mask_type=cudnn.MaskType.CAUSAL, qkv_layout="BTNH")


def dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None,
                    *, scale: float, sinks: jax.Array | None = None,
                    window: jax.Array | None = None) -> jax.Array:
    """Causal grouped-query attention written out, ``[B, T, Hq, D]``: fp32 logits [B, Hkv,
    Hq / Hkv, T, T], the mask (causal, same document, within ``window`` unless it is 0), the
    softmax over the visible keys and, with ``sinks``, each head's sink logit as one more
    column whose weight is dropped (transformers' eager gpt-oss attention)."""
    batch, length, num_heads, dim = q.shape
    num_kv_heads = k.shape[2]
    group = num_heads // num_kv_heads
    grouped = q.reshape(batch, length, num_kv_heads, group, dim)
    logits = jnp.einsum("btkgd,bskd->bkgts", grouped, k,
                        preferred_element_type=jnp.float32) * scale
    query, key = jnp.arange(length)[:, None], jnp.arange(length)[None, :]
    visible = key <= query
    if window is not None:
        visible = visible & ((window <= 0) | (query - key < window))
    visible = visible[None, None, None]
    if segment_ids is not None:
        same = segment_ids[:, :, None] == segment_ids[:, None, :]
        visible = visible & same[:, None, None]
    logits = jnp.where(visible, logits, jnp.finfo(jnp.float32).min)
    if sinks is not None:
        column = jnp.broadcast_to(
            sinks.astype(jnp.float32).reshape(1, num_kv_heads, group, 1, 1),
            (*logits.shape[:-1], 1))
        weights = jax.nn.softmax(jnp.concatenate([logits, column], axis=-1), axis=-1)[..., :-1]
    else:
        weights = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("bkgts,bskd->btkgd", weights.astype(v.dtype), v,
                     preferred_element_type=jnp.float32)
    return out.reshape(batch, length, num_heads, dim).astype(q.dtype)


def segment_runs(segment_ids: jax.Array, max_runs: int) -> tuple[jax.Array, jax.Array]:
    """Each sequence's runs of equal segment ids: offsets [B, max_runs + 1] (start of each run,
    -1 past the last) and lengths [B, max_runs] (-1 past the last), cuDNN's packed layout.
    Runs beyond ``max_runs`` would be merged into the last: the data pipeline guarantees
    there are none."""
    batch, length = segment_ids.shape
    starts = jnp.concatenate([jnp.ones((batch, 1), bool),
                              segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    first = jax.vmap(lambda s: jnp.nonzero(s, size=max_runs, fill_value=length)[0])(starts)
    first = first.astype(jnp.int32)  # [B, max_runs]; `length` past the last run
    ends = jnp.concatenate([first[:, 1:], jnp.full((batch, 1), length, jnp.int32)], axis=1)
    exists = jnp.arange(max_runs)[None, :] < starts.sum(axis=1, keepdims=True)
    lengths = jnp.where(exists, ends - first, -1)
    offsets = jnp.concatenate([jnp.where(exists, first, -1),
                               jnp.full((batch, 1), -1, jnp.int32)], axis=1)
    return offsets, lengths


def ulysses_attention(q: jax.Array, k: jax.Array, v: jax.Array,
                      segment_ids: jax.Array | None, *, mesh: Mesh, data_axis: str = "data",
                      seq_axis: str = "seq", implementation: str = "auto",
                      max_segments: int = 1, sinks: jax.Array | None = None,
                      window: jax.Array | None = None) -> jax.Array:
    """``causal_attention`` of global q [B, T, Hq, D], k and v [B, T, Hkv, D] (and segment_ids
    [B, T]) split over ``data_axis`` along B and ``seq_axis`` along T: a sequence <-> head
    all-to-all within ``seq_axis`` on each side (module doc). Returns [B, T, Hq, D] split the
    same way. ``sinks [Hq]`` and ``window`` (an int32 scalar) replicated: each device takes its
    heads' sinks after the exchange."""
    num_heads, num_kv_heads = q.shape[2], k.shape[2]
    seq_size = mesh.shape[seq_axis]
    if num_heads % seq_size:
        raise ValueError(f"q: {num_heads} heads do not split over the {seq_size} devices of "
                         f"mesh axis {seq_axis!r}")
    platform = mesh.devices.flat[0].platform
    xla_only = tuple(name for name, value in (("attention sinks", sinks),
                                              ("sliding windows", window)) if value is not None)
    implementation = choose_implementation(implementation, platform, q.dtype,
                                           xla_only=xla_only)
    repeat = 1 if num_kv_heads % seq_size == 0 else num_heads // num_kv_heads
    local_heads = num_heads // seq_size

    def local(q, k, v, segment_ids, sinks, window):
        if repeat > 1:  # each kv head once per q head that reads it: MHA, same values
            k, v = (jnp.repeat(a, repeat, axis=2) for a in (k, v))
        if seq_size > 1:
            q, k, v = (lax.all_to_all(a, seq_axis, split_axis=2, concat_axis=1, tiled=True)
                       for a in (q, k, v))
            if segment_ids is not None:
                segment_ids = lax.all_gather(segment_ids, seq_axis, axis=1, tiled=True)
            if sinks is not None:  # the exchange gave position r heads r Hq / seq, ...
                sinks = lax.dynamic_slice_in_dim(
                    sinks, lax.axis_index(seq_axis) * local_heads, local_heads)
        out = causal_attention(q, k, v, segment_ids, implementation=implementation,
                               max_segments=max_segments, sinks=sinks, window=window)
        if seq_size > 1:
            out = lax.all_to_all(out, seq_axis, split_axis=1, concat_axis=2, tiled=True)
        return out

    split = P(data_axis, seq_axis)
    operands = {"segment_ids": (segment_ids, split), "sinks": (sinks, P()),
                "window": (window, P())}
    given = [name for name, (value, _) in operands.items() if value is not None]

    def body(q, k, v, *values):
        named = dict(zip(given, values))
        return local(q, k, v, *(named.get(name) for name in operands))

    return jax.shard_map(body, mesh=mesh,
                         in_specs=(split,) * 3 + tuple(operands[n][1] for n in given),
                         out_specs=split)(q, k, v, *(operands[n][0] for n in given))
