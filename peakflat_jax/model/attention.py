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


def choose_implementation(requested: str, platform: str, dtype) -> str:
    """``auto``: cuDNN on a GPU when the dtype is bf16/f16, else XLA. An explicit ``cudnn`` where
    it cannot run is an error naming why."""
    if requested not in IMPLEMENTATIONS:
        raise ValueError(f"attention: expected one of {IMPLEMENTATIONS}, got {requested!r}")
    cudnn_ok = platform == "gpu" and jnp.dtype(dtype) in CUDNN_DTYPES
    if requested == "auto":
        return "cudnn" if cudnn_ok else "xla"
    if requested == "cudnn" and not cudnn_ok:
        raise ValueError(f"attention: cudnn needs a GPU and bf16/f16 activations, got platform "
                         f"{platform} and {jnp.dtype(dtype)}")
    return requested


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array,
                     segment_ids: jax.Array | None, *, implementation: str,
                     max_segments: int = 1) -> jax.Array:
    """[B, T, Hq, D] attention of one device's whole sequences (module doc).

    ``segment_ids [B, T]`` int (None: one document per sequence); ``max_segments``: the most
    documents in a sequence (static, for the packed cuDNN layout).
    """
    scale = q.shape[-1] ** -0.5
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
                      max_segments: int = 1) -> jax.Array:
    """``causal_attention`` of global q [B, T, Hq, D], k and v [B, T, Hkv, D] (and segment_ids
    [B, T]) split over ``data_axis`` along B and ``seq_axis`` along T: a sequence <-> head
    all-to-all within ``seq_axis`` on each side (module doc). Returns [B, T, Hq, D] split the
    same way."""
    num_heads, num_kv_heads = q.shape[2], k.shape[2]
    seq_size = mesh.shape[seq_axis]
    if num_heads % seq_size:
        raise ValueError(f"q: {num_heads} heads do not split over the {seq_size} devices of "
                         f"mesh axis {seq_axis!r}")
    platform = mesh.devices.flat[0].platform
    implementation = choose_implementation(implementation, platform, q.dtype)
    repeat = 1 if num_kv_heads % seq_size == 0 else num_heads // num_kv_heads

    def local(q, k, v, segment_ids):
        if repeat > 1:  # each kv head once per q head that reads it: MHA, same values
            k, v = (jnp.repeat(a, repeat, axis=2) for a in (k, v))
        if seq_size > 1:
            q, k, v = (lax.all_to_all(a, seq_axis, split_axis=2, concat_axis=1, tiled=True)
                       for a in (q, k, v))
            if segment_ids is not None:
                segment_ids = lax.all_gather(segment_ids, seq_axis, axis=1, tiled=True)
        out = causal_attention(q, k, v, segment_ids, implementation=implementation,
                               max_segments=max_segments)
        if seq_size > 1:
            out = lax.all_to_all(out, seq_axis, split_axis=1, concat_axis=2, tiled=True)
        return out

    split = P(data_axis, seq_axis)
    if segment_ids is None:
        return jax.shard_map(lambda q, k, v: local(q, k, v, None), mesh=mesh,
                             in_specs=(split,) * 3, out_specs=split)(q, k, v)
    return jax.shard_map(local, mesh=mesh, in_specs=(split,) * 4, out_specs=split)(
        q, k, v, segment_ids)
