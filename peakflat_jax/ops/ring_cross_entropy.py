"""Ring-DTP: vocab-parallel cross-entropy on a ppermute ring with an online log-sum-exp.

P ranks form a ring over ``axis_name``. Rank r holds its *own* tokens ``hidden_r [N, H]`` with
targets ``t_r [N]`` and the vocab shard ``kernel_r [H, Vs]`` (global columns r*Vs ... (r+1)*Vs-1).
Over P steps every local batch meets every vocab shard. Each meeting forms strips
``Y = X W[:, block]`` of at most B columns, folds each strip into three fp32 numbers per token
(running max m, rescaled sum z, target logit y_t) and drops it:

    m' = max(m, max_v y_v)      z' = exp(m - m') z + sum_v exp(y_v - m')

and the loss is ``m + log z - y_t``. The N x V logits never exist.

Two schedules move different operands around the ring (one hop = a ppermute to rank r-1):

* ``move_weights``: the kernel shard rotates (H*Vs elements a hop, independent of N); the
  statistics stay home. In backward the shard's fp32 weight gradient travels with it and takes one
  last hop home to its owner.
* ``move_activations``: tokens and targets rotate (N*H a hop, independent of V); the statistics
  travel with them and take one last hop home. In backward the fp32 hidden gradient travels.

For per-token losses ``mode="auto"`` moves weights when N > Vs (the smaller hop). Every hop for
step s+1 is issued before step s's matmuls, and a travelling accumulator's hop is independent of
the step's matmuls, so XLA may overlap both with compute; a step's strips wait for the previous
step's accumulators, so that only one meeting's strips are live.

The backward pass is a custom VJP that keeps only the per-token log-sum-exp (plus the inputs)
and replays the ring strip by strip: ``dY = (softmax(Y) - onehot(t)) * g``, ``dX += dY W^T``,
``dW += X^T dY``. It recomputes each strip: 4 N*H*V matmul-units against the materialized loss's
3. That is the floor for an exact per-token loss that never holds the logits, since the softmax
of a strip needs the log-sum-exp over every shard first.

A trainer wants the mean (or sum) over the valid tokens, whose cotangent is one scalar:
``reduction="mean" | "sum"`` returns it, the same on every rank. Then the loss can be exact in 3
units: ``mode="gather_kernel"`` all-gathers the kernel shards (as FSDP does for any layer), runs
the one-pass loss of ``fused_cross_entropy`` on this rank's tokens (logits, softmax minus one-hot,
dX and dW in the forward, block by block of tokens) and reduce-scatters dW: peak O(H V), whatever
the context. At P = 1 the one-pass path always runs. The ring schedules stay available for a
mean (4 units, O(N V / P)); ``choose_schedule`` holds the rule that ``mode="auto"`` applies.

Memory (per device, beyond inputs and outputs): ``ring_cross_entropy_memory_terms`` gives each
term in bytes and ``MEMORY_FORMULAS`` its formula: one meeting's strips (3 * N * B * 4), the
rotating operands and travelling accumulator (two of each, in and out), the accumulator that
stays home, and a cast copy when hidden and kernel dtypes differ; for ``gather_kernel``, the
gathered kernel, one block's strips and the stored gradients. No term has N * V; ``tests/``
prove that no array of 2 * N * Vs elements exists in the compiled forward+backward program
(also inside ``jax.checkpoint`` with its default policy). ``materialized_memory_terms`` gives
the baseline's terms (the gathered kernel, the N x V logits, log-softmax and their gradient).

Known limit: inside ``jax.checkpoint`` with a policy that saves matmul outputs
(``dots_saveable`` and kin), the checkpoint's replay saves every strip of the forward ring, all
N x V logits; and the one-pass path computes its gradients in the forward, so a checkpoint's
replay runs its three units again. The loss is its own rematerialization: keep it outside
rematerialized regions.

Measured: docs/ring_cross_entropy.md.

Legend: N tokens on this rank, H hidden, P ring size, Vs vocab columns per shard (P * Vs >= V,
the true vocab), B columns per strip (``vocab_block``), T tokens per block of the one-pass path
(``token_block``), g the loss cotangent, b bytes of the compute dtype (the wider of hidden's and
kernel's), b_h and b_k those of hidden and kernel.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from peakflat_jax._validate import as_int
from peakflat_jax.ops import fused_cross_entropy
from peakflat_jax.ops._shard import vary_alike

MODES = ("auto", "move_weights", "move_activations")
REDUCED_MODES = (*MODES, "gather_kernel")
REDUCTIONS = ("none", "mean", "sum")
SUPPORTED_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
# Targets become int32 codes before anything else: the id where it is in the vocabulary, else
# one of these. Comparing in the caller's dtype could wrap (uint8 156 == -100).
IGNORED, INVALID = -1, -2

MEMORY_FORMULAS: dict[str, str] = {
    "strips": "ring: 3 * N * B * 4: one strip's fp32 logits, dY and its cast",
    "gradient_partials": "ring: (N * H + H * B) * 4: one strip's fresh fp32 dX and dW products "
                         "before they are added (XLA folds the add into the matmul on GPU)",
    "token_statistics": "ring: 6 * N * 4: per-token fp32 max, sum, target logit, log-sum-exp, "
                        "scale and the int32 target code",
    "hops": "ring, 0 at P = 1; move_weights: 2 * H * Vs * (b + 4), the shard in use and the "
            "next, fp32 dW in and out; move_activations: 2 * N * H * (b + 4) + 2 * 4 * N * 4, "
            "tokens in use and the next, fp32 dX in and out, four per-token numbers in and out",
    "local": "ring; move_weights: N * H * 4 (fp32 dX); move_activations: H * Vs * 4 (fp32 dW)",
    "cast": "ring: N * H * b if hidden's dtype is narrower than the compute dtype, plus "
            "H * Vs * b if kernel's is; one-pass: H * P * Vs * b, plus T * H * b",
    "gathered_kernel": "gather_kernel at P >= 2: H * P * Vs * b_k, the all-gathered kernel",
    "masked_shard": "gather_kernel: H * Vs * b_k when P * Vs > V (padding columns zeroed)",
    **{name: f"gather_kernel (one pass, V' = P * Vs): {formula}"
       for name, formula in fused_cross_entropy.MEMORY_FORMULAS.items() if name != "cast"},
}

MATERIALIZED_MEMORY_FORMULAS: dict[str, str] = {
    "gathered_kernel": "H * P * Vs * b_k: the all-gathered kernel",
    "logits": "N * V * 4: fp32 logits",
    "log_softmax": "N * V * 4: fp32 log-softmax",
    "logits_gradient": "N * V * 4: its fp32 gradient",
    "kernel_gradient": "H * P * Vs * 4: the gathered kernel's gradient before the reduce-scatter",
}


def _itemsize(dtype) -> int:
    return jnp.dtype(dtype).itemsize


def _sizes(num_tokens, hidden, shard_width, ring_size) -> tuple[int, int, int, int]:
    sizes = (as_int(name, value) for name, value in (
        ("num_tokens", num_tokens), ("hidden", hidden), ("shard_width", shard_width),
        ("ring_size", ring_size)))
    return tuple(sizes)


def ring_cross_entropy_memory_terms(num_tokens: int, hidden: int, shard_width: int,
                                    ring_size: int, vocab_block: int | None = None,
                                    mode: str = "auto", hidden_dtype=jnp.float32,
                                    kernel_dtype=jnp.float32, reduction: str = "none",
                                    token_block: int | None = None,
                                    vocab_size: int | None = None) -> dict[str, int]:
    """Per-device bytes of each term of the loss's bound (forward + backward), beyond inputs
    and outputs, for the schedule that ``ring_cross_entropy`` takes with these arguments:
    N = ``num_tokens`` on this rank, H = ``hidden``, Vs = ``shard_width``, P = ``ring_size``,
    B = ``vocab_block`` (default Vs), T = ``token_block``; ``mode="auto"`` resolves by
    ``choose_schedule``. Every key of ``MEMORY_FORMULAS`` is present; terms of the other
    schedules are 0."""
    n, h, vs, p = _sizes(num_tokens, hidden, shard_width, ring_size)
    schedule = choose_schedule(n, h, vs, p, mode=mode, reduction=reduction,
                               vocab_block=vocab_block, token_block=token_block,
                               hidden_dtype=hidden_dtype, kernel_dtype=kernel_dtype,
                               vocab_size=vocab_size)
    terms = dict.fromkeys(MEMORY_FORMULAS, 0)
    compute = _itemsize(jnp.result_type(hidden_dtype, kernel_dtype))
    if schedule == "gather_kernel":
        kernel_size = _itemsize(kernel_dtype)
        padded = vocab_size is not None and as_int("vocab_size", vocab_size) < p * vs
        fused = fused_cross_entropy.memory_terms(n, h, p * vs, token_block, hidden_dtype,
                                                 kernel_dtype, gradient_is_output=p == 1,
                                                 vocab_size=vocab_size)
        terms.update(fused,
                     gathered_kernel=h * p * vs * kernel_size if p > 1 else 0,
                     masked_shard=h * vs * kernel_size if padded else 0)
        return terms
    block = vs if vocab_block is None else min(as_int("vocab_block", vocab_block), vs)
    move_weights = schedule == "move_weights"
    if p == 1:
        hops = 0
    elif move_weights:
        hops = 2 * h * vs * (compute + 4)
    else:
        hops = 2 * n * h * (compute + 4) + 2 * 4 * n * 4
    terms.update(strips=3 * n * block * 4,
                 gradient_partials=(n * h + h * block) * 4,
                 token_statistics=6 * n * 4,
                 hops=hops,
                 local=n * h * 4 if move_weights else h * vs * 4,
                 cast=(n * h * compute if _itemsize(hidden_dtype) < compute else 0)
                 + (h * vs * compute if _itemsize(kernel_dtype) < compute else 0))
    return terms


def materialized_memory_terms(num_tokens: int, hidden: int, shard_width: int, ring_size: int,
                              vocab_size: int | None = None,
                              kernel_dtype=jnp.float32) -> dict[str, int]:
    """Per-device bytes of each term of the materialized vocab-parallel loss
    (``reference.materialized_cross_entropy``: all-gathered kernel, N x V logits), forward +
    backward, beyond inputs and outputs: the baseline the planner shows beside Ring-DTP.
    Formulas: ``MATERIALIZED_MEMORY_FORMULAS``."""
    n, h, vs, p = _sizes(num_tokens, hidden, shard_width, ring_size)
    vocab = p * vs if vocab_size is None else as_int("vocab_size", vocab_size)
    return {"gathered_kernel": h * p * vs * _itemsize(kernel_dtype),
            "logits": n * vocab * 4,
            "log_softmax": n * vocab * 4,
            "logits_gradient": n * vocab * 4,
            "kernel_gradient": h * p * vs * 4}


def choose_schedule(num_tokens: int, hidden: int, shard_width: int, ring_size: int, *,
                    mode: str = "auto", reduction: str = "none", vocab_block: int | None = None,
                    token_block: int | None = None, hidden_dtype=jnp.float32,
                    kernel_dtype=jnp.float32, vocab_size: int | None = None,
                    device_budget_bytes: int | None = None) -> str:
    """The schedule ``ring_cross_entropy`` runs: ``"move_weights"``, ``"move_activations"`` or
    (with a reduction) ``"gather_kernel"``. An explicit ``mode`` is returned as given, except
    that with a reduction at P = 1 the one-pass path runs (``"gather_kernel"``: gathering over
    one rank moves nothing). The rule of ``mode="auto"``:

    - per-token losses (``reduction="none"``): move the smaller operand, the kernel shard when
      N > Vs (H * Vs elements a hop against N * H);
    - a mean or sum at P >= 2: ``"gather_kernel"`` does 3 matmul units of N * H * V where the
      ring does 4, and moves about as many bytes as a ring that moves weights (the kernel
      gathered, its gradient reduce-scattered), but holds O(H * V) bytes. So it is taken when
      its bound (``ring_cross_entropy_memory_terms``) is no larger than that of the ring
      schedule that auto would take, or, where the planner passes ``device_budget_bytes``,
      when it fits that budget; otherwise that ring schedule.
    """
    n, h, vs, p = _sizes(num_tokens, hidden, shard_width, ring_size)
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction: expected one of {REDUCTIONS}, got {reduction!r}")
    modes = MODES if reduction == "none" else REDUCED_MODES
    if mode not in modes:
        needs = " (gather_kernel needs reduction='mean' or 'sum')" if mode in REDUCED_MODES else ""
        raise ValueError(f"mode: expected one of {modes}{needs}, got {mode!r}")
    if reduction != "none" and p == 1:
        return "gather_kernel"
    if mode != "auto":
        return mode
    ring_schedule = "move_weights" if n > vs else "move_activations"
    if reduction == "none":
        return ring_schedule
    sizes = dict(num_tokens=n, hidden=h, shard_width=vs, ring_size=p, vocab_block=vocab_block,
                 hidden_dtype=hidden_dtype, kernel_dtype=kernel_dtype, reduction=reduction,
                 token_block=token_block, vocab_size=vocab_size)
    gathered = sum(ring_cross_entropy_memory_terms(mode="gather_kernel", **sizes).values())
    if device_budget_bytes is not None:
        return "gather_kernel" if gathered <= device_budget_bytes else ring_schedule
    ring = sum(ring_cross_entropy_memory_terms(mode=ring_schedule, **sizes).values())
    return "gather_kernel" if gathered <= ring else ring_schedule


@dataclasses.dataclass(frozen=True)
class _Ring:
    """Static description of one call: hashable, so it can be a nondiff argument."""

    axis_name: Any
    ring_size: int
    vocab_size: int
    shard_width: int
    block_width: int
    schedule: str

    @property
    def move_weights(self) -> bool:
        return self.schedule == "move_weights"

    @property
    def padded(self) -> bool:
        """Whether some kernel columns lie past the vocabulary (and must not be read)."""
        return self.vocab_size < self.ring_size * self.shard_width

    @property
    def num_blocks(self) -> int:
        return -(-self.shard_width // self.block_width)

    def hop(self, tree):
        """Sends every leaf one step around the ring: rank r -> rank r - 1."""
        perm = [(i, (i - 1) % self.ring_size) for i in range(self.ring_size)]
        return jax.tree.map(lambda a: lax.ppermute(a, self.axis_name, perm), tree)


def ring_cross_entropy(
    hidden: jax.Array,
    kernel: jax.Array,
    targets: jax.Array,
    *,
    axis_name: Any,
    vocab_size: int | None = None,
    mode: str = "auto",
    ignore_index: int = -100,
    reduction: str = "none",
    vocab_block: int | None = None,
    token_block: int | None = None,
) -> jax.Array:
    """Cross-entropy of ``hidden @ full_kernel`` without forming the N x V logits: per token, or
    its mean or sum over the valid tokens of every rank on the ring.

    Call inside ``jax.shard_map``; ``axis_name`` is the ring (the vocab-parallel axis).

    Args:
      hidden: ``[N, H]`` this rank's own tokens, bf16 or f32 (the softmax math is f32).
      kernel: ``[H, Vs]`` this rank's vocab shard; ring position r holds global columns
        ``r*Vs ... (r+1)*Vs - 1``.
      targets: ``[N]`` integer global ids in ``[0, vocab_size)``, or ``ignore_index``.
      axis_name: the mesh axis that forms the ring.
      vocab_size: the true V when the kernel is padded (P * Vs > V); padded columns never enter
        the softmax. Default P * Vs.
      mode: ``"auto"`` (``choose_schedule``), ``"move_weights"`` or ``"move_activations"``; with
        a reduction also ``"gather_kernel"`` (all-gather the kernel shards, one pass on this
        rank's tokens, reduce-scatter dW). With a reduction at P = 1 the one-pass path runs
        whatever the mode.
      ignore_index: targets equal to it get loss 0 and no gradient, and do not count in a mean.
      reduction: ``"none"`` (per-token losses), ``"mean"`` or ``"sum"`` over the tokens of all
        ranks on ``axis_name`` that are not ignored. A mean over no such token is NaN (as
        torch's), with zero gradients: report such a batch rather than step on it.
      vocab_block: at most this many vocab columns per strip of the ring (default: the whole
        shard). With P = 1 and no reduction this is a single-device chunked cross-entropy whose
        strip is ``[N, vocab_block]``.
      token_block: tokens per block of the one-pass path (default
        ``fused_cross_entropy.DEFAULT_TOKEN_BLOCK``); its strip is ``[token_block, P * Vs]``.

    Returns:
      ``reduction="none"``: ``[N]`` float32 loss; 0 where ignored, NaN where a target is outside
      ``[0, vocab_size)`` (never a finite wrong number). Otherwise a float32 scalar, the same on
      every rank (use ``out_specs=P()``), NaN if any counted target is outside the vocabulary.
      Differentiable w.r.t. ``hidden`` and ``kernel``.

    A mean or sum in ``"gather_kernel"`` (and at P = 1) computes its gradients in the forward
    pass (``fused_cross_entropy``): inside ``jax.checkpoint`` they are computed again in the
    replay, so keep the loss outside rematerialized regions.
    """
    ring = _describe_call(hidden, kernel, targets, axis_name, vocab_size, mode, vocab_block,
                          reduction, token_block)
    codes = _target_codes(targets, ring.vocab_size, as_int("ignore_index", ignore_index))
    hidden, kernel, codes = vary_alike(hidden, kernel, codes)
    if reduction == "none":
        return _ring_cross_entropy(ring, hidden, kernel, codes)
    return _reduced_loss(ring, hidden, kernel, codes, reduction, token_block)


def _target_codes(targets, vocab_size: int, ignore_index: int):
    info = jnp.iinfo(targets.dtype)
    if info.min <= ignore_index <= info.max:
        ignored = targets == ignore_index
    else:  # no target of this dtype can equal it
        ignored = jnp.zeros(targets.shape, bool)
    in_vocab = targets >= 0
    if vocab_size <= info.max:
        in_vocab &= targets < vocab_size
    ids = jnp.where(in_vocab, targets, 0).astype(jnp.int32)
    return jnp.where(ignored, IGNORED, jnp.where(in_vocab, ids, INVALID))


def _describe_call(hidden, kernel, targets, axis_name, vocab_size, mode, vocab_block, reduction,
                   token_block) -> _Ring:
    """Checks the arguments at trace time and fixes the static plan of the loss."""
    if hidden.ndim != 2 or hidden.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"hidden: expected a bf16, f16 or f32 [N, H] array (the softmax math "
                         f"is fp32), got {hidden.dtype}{list(hidden.shape)}")
    if kernel.ndim != 2 or kernel.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"kernel: expected a bf16, f16 or f32 [H, Vs] array, got "
                         f"{kernel.dtype}{list(kernel.shape)}")
    if kernel.shape[0] != hidden.shape[1]:
        raise ValueError(f"kernel: expected [H={hidden.shape[1]}, Vs] to match hidden "
                         f"{list(hidden.shape)}, got {list(kernel.shape)}")
    if targets.ndim != 1 or not jnp.issubdtype(targets.dtype, jnp.integer):
        raise ValueError(f"targets: expected an integer [N] array, got {targets.dtype}"
                         f"{list(targets.shape)}")
    if targets.shape[0] != hidden.shape[0]:
        raise ValueError(f"targets: expected [N={hidden.shape[0]}] to match hidden, got "
                         f"{list(targets.shape)}")
    if not isinstance(reduction, str) or reduction not in REDUCTIONS:
        raise ValueError(f"reduction: expected one of {REDUCTIONS}, got {reduction!r}")
    if not isinstance(mode, str):
        raise ValueError(f"mode: expected one of {REDUCED_MODES}, got {mode!r}")
    ring_size = lax.axis_size(axis_name)
    num_tokens, shard_width = hidden.shape[0], kernel.shape[1]
    padded_vocab = ring_size * shard_width
    vocab_size = padded_vocab if vocab_size is None else as_int("vocab_size", vocab_size)
    if not 1 <= vocab_size <= padded_vocab:
        raise ValueError(f"vocab_size: expected an int in [1, P*Vs = {ring_size}*{shard_width} "
                         f"= {padded_vocab}], got {vocab_size!r}")
    vocab_block = shard_width if vocab_block is None else as_int("vocab_block", vocab_block)
    if vocab_block < 1:
        raise ValueError(f"vocab_block: expected None or a positive int, got {vocab_block!r}")
    if token_block is not None and as_int("token_block", token_block) < 1:
        raise ValueError(f"token_block: expected None or a positive int, got {token_block!r}")
    schedule = choose_schedule(num_tokens, hidden.shape[1], shard_width, ring_size, mode=mode,
                               reduction=reduction, vocab_block=vocab_block,
                               token_block=token_block, hidden_dtype=hidden.dtype,
                               kernel_dtype=kernel.dtype, vocab_size=vocab_size)
    return _Ring(axis_name, ring_size, vocab_size, shard_width, min(vocab_block, shard_width),
                 schedule)


# ----------------------------------------------------------------------------------------------
# The reduced loss: a mean or sum over the ring's tokens.


def _reduced_loss(ring: _Ring, hidden, kernel, codes, reduction: str, token_block):
    """The mean or sum over the non-ignored tokens of all ranks: a scalar, the same on each."""
    ignored, in_vocab = _token_validity(codes)
    count = lax.psum(jnp.sum(~ignored, dtype=jnp.float32), ring.axis_name)
    scale = 1.0 / jnp.maximum(count, 1.0) if reduction == "mean" else jnp.float32(1)
    if ring.schedule == "gather_kernel":
        if ring.padded:  # padding columns may hold anything, NaN included: never read them
            column = (lax.axis_index(ring.axis_name) * ring.shard_width
                      + lax.broadcasted_iota(jnp.int32, (1, ring.shard_width), 1))
            kernel = jnp.where(column < ring.vocab_size, kernel, 0)
        if ring.ring_size > 1:
            kernel = lax.all_gather(kernel, ring.axis_name, axis=1, tiled=True)
        weights = jnp.where(ignored, 0.0, jnp.where(in_vocab, scale, jnp.nan))
        local = fused_cross_entropy.fused_cross_entropy_sum(
            hidden, kernel, codes, weights, vocab_size=ring.vocab_size, token_block=token_block)
    else:
        local = jnp.sum(_ring_cross_entropy(ring, hidden, kernel, codes)) * scale
    total = lax.psum(local, ring.axis_name)
    if reduction == "mean":  # torch's mean over no token: NaN
        total = jnp.where(count > 0, total, jnp.nan)
    return total


# ----------------------------------------------------------------------------------------------
# The ring driver, shared by forward and backward of both schedules.


def _drive_ring(ring: _Ring, step: Callable, rotating, local, travelling):
    """Runs ``step(s, rotating, local, travelling) -> (local, travelling)`` for s = 0 .. P-1.

    ``rotating`` (read-only operands) moves one hop before every step after the first; its hop
    for step s+1 is issued at the start of step s. ``travelling`` (an accumulator that rides with
    the rotating operands) arrives by a hop issued at the start of the step that updates it, and
    takes a last hop home after step P-1. ``local`` stays on this rank. The first and last steps
    are peeled so that no hop is wasted; the middle ones are a ``lax.scan``, and each step waits
    for the previous one's accumulators, so that only one step's strips are live at a time.

    Its four uses (the schedules swap which accumulator stays and which travels):

    ==================  ===========================  ==================  ======================
    use                 rotating                     local (stays)       travelling
    ==================  ===========================  ==================  ======================
    forward, weights    kernel shard                 (m, z, y_t) [N]     none
    forward, tokens     hidden, targets              none                (m, z, y_t) [N]
    backward, weights   kernel shard                 fp32 dX [N, H]      fp32 dW [H, Vs]
    backward, tokens    hidden, targets, lse, scale  fp32 dW [H, Vs]     fp32 dX [N, H]
    ==================  ===========================  ==================  ======================
    """
    if ring.ring_size == 1:
        return step(0, rotating, local, travelling)
    incoming = ring.hop(rotating)
    local, travelling = step(0, rotating, local, travelling)

    def middle_step(carry, s):
        rotating, local, travelling = carry
        incoming = ring.hop(rotating)
        rotating, local, travelling = _after_previous_step(rotating, local, travelling)
        local, travelling = step(s, rotating, local, ring.hop(travelling))
        return (incoming, local, travelling), None

    (rotating, local, travelling), _ = lax.scan(
        middle_step, (incoming, local, travelling), jnp.arange(1, ring.ring_size - 1))
    rotating, local, travelling = _after_previous_step(rotating, local, travelling)
    local, travelling = step(ring.ring_size - 1, rotating, local, ring.hop(travelling))
    return local, ring.hop(travelling)


def _after_previous_step(rotating, local, travelling):
    """Ties a step's rotating operands to the previous step's accumulators (before their hop).

    Nothing else orders the meetings: a step's strips depend only on the operands, so in the
    peeled first and last steps (and a middle scan of one step, which XLA unrolls) XLA computed
    several meetings' strips at once (XLA:CPU's plan: five [N, Vs] strips at P = 2 instead of
    three). The hops stay free: the next rotating hop is issued from the untied operands, and
    the travelling accumulator's hop leaves after the tie, under this step's matmuls.
    """
    return lax.optimization_barrier((rotating, local, travelling))


def _shard_at_step(ring: _Ring, s):
    """The vocab shard that rank r holds at step s of move_weights: rank r + s's."""
    return (lax.axis_index(ring.axis_name) + s) % ring.ring_size


# ----------------------------------------------------------------------------------------------
# One meeting of a token batch with a vocab shard, strip by strip.


def _strip_logits(ring: _Ring, hidden, kernel, shard, block):
    """fp32 logits of one strip [N, B], padding and already-seen columns at -inf.

    Returns (logits, first local column of the strip, mask of columns that count, the kernel
    block used). The last block of a shard whose width is not a multiple of B starts early (so
    no copy of the kernel is padded); the columns it shares with the previous block are masked.
    """
    start = jnp.minimum(block * ring.block_width, ring.shard_width - ring.block_width)
    kernel_block = lax.dynamic_slice_in_dim(kernel, start, ring.block_width, axis=1)
    column = start + lax.broadcasted_iota(jnp.int32, (1, ring.block_width), 1)
    in_vocab = shard * ring.shard_width + column < ring.vocab_size
    counts = (column >= block * ring.block_width) & in_vocab
    if ring.padded:  # padding columns may hold anything, NaN included: never read them
        kernel_block = jnp.where(in_vocab, kernel_block, 0)
    logits = jnp.dot(hidden, kernel_block, preferred_element_type=jnp.float32)
    # A [1, B] bias rather than an [N, B] select: under jax.checkpoint the replayed forward
    # saves what the mask is made of per block, and a row is all it should find.
    return logits + jnp.where(counts, 0.0, -jnp.inf), start, counts, kernel_block


def _target_column(ring: _Ring, targets, shard, start, counts):
    """Strip column of each token's target, and whether the target lies in this strip.

    ``targets`` are int32 codes: ids, or negative for ignored and invalid tokens (never in a
    strip)."""
    column = targets - shard * ring.shard_width - start
    in_strip = (targets >= 0) & (column >= 0) & (column < ring.block_width)
    column = jnp.clip(column, 0, ring.block_width - 1)
    in_strip &= jnp.take_along_axis(counts[0], column, axis=0)
    return column, in_strip


def _fold_blocks(ring: _Ring, per_block: Callable, init):
    """Folds ``per_block(block, acc) -> acc`` over the shard's strips, one strip live at a time."""
    if ring.num_blocks == 1:
        return per_block(0, init)
    return lax.fori_loop(0, ring.num_blocks, per_block, init)


def _shard_statistics(ring: _Ring, hidden, kernel, targets, shard):
    """(max, sum of exp, target logit) of the tokens over one vocab shard: [N] fp32 each."""

    def per_block(block, stats):
        logits, start, counts, _ = _strip_logits(ring, hidden, kernel, shard, block)
        column, in_strip = _target_column(ring, targets, shard, start, counts)
        target_logit = jnp.take_along_axis(logits, column[:, None], axis=1)[:, 0]
        strip_max = jnp.max(logits, axis=1)
        strip_sum = jnp.sum(jnp.exp(logits - _finite(strip_max)[:, None]), axis=1)
        return _merge_statistics(stats, (strip_max, strip_sum,
                                         jnp.where(in_strip, target_logit, 0.0)))

    return _fold_blocks(ring, per_block, _empty_statistics(targets))


def _accumulate_shard_gradients(ring: _Ring, grads, hidden, kernel, targets, shard, lse, scale):
    """Adds one meeting's (dX [N, H], dW [H, Vs]) to the fp32 accumulators ``grads``.

    ``lse`` is the final log-sum-exp per token; ``scale`` the loss cotangent per token (0 where
    ignored, NaN where the target is invalid). Accumulating in place, rather than returning a
    fresh partial, saves a whole fp32 shard-sized buffer.
    """
    compute_dtype = hidden.dtype

    def per_block(block, grads):
        d_hidden, d_kernel = grads
        logits, start, counts, kernel_block = _strip_logits(ring, hidden, kernel, shard, block)
        column, in_strip = _target_column(ring, targets, shard, start, counts)
        strip_column = lax.broadcasted_iota(jnp.int32, (1, ring.block_width), 1)
        onehot = (strip_column == column[:, None]) & in_strip[:, None]
        d_logits = ((jnp.exp(logits - lse[:, None]) - onehot) * scale[:, None]).astype(
            compute_dtype)
        d_hidden += jnp.dot(d_logits, kernel_block.T, preferred_element_type=jnp.float32)
        d_block = jnp.dot(hidden.T, d_logits, preferred_element_type=jnp.float32)
        if ring.num_blocks == 1:
            return d_hidden, d_kernel + d_block
        # The overlap with the previous block is masked to zero in d_logits, so adding is exact.
        d_kernel = lax.dynamic_update_slice_in_dim(
            d_kernel, lax.dynamic_slice_in_dim(d_kernel, start, ring.block_width, 1) + d_block,
            start, axis=1)
        return d_hidden, d_kernel

    return _fold_blocks(ring, per_block, grads)


def _empty_statistics(targets):
    negative_infinity = jnp.full_like(targets, -jnp.inf, jnp.float32)
    zero = jnp.zeros_like(targets, jnp.float32)
    return negative_infinity, zero, zero


def _finite(m):
    """A shift for exp(): the running max, or 0 while a row has seen only masked columns."""
    return jnp.where(jnp.isfinite(m), m, 0.0)


def _merge_statistics(a, b):
    """Associative merge of two partial (max, sum, target logit) triples."""
    m = jnp.maximum(a[0], b[0])
    shift = _finite(m)
    z = a[1] * jnp.exp(a[0] - shift) + b[1] * jnp.exp(b[0] - shift)
    return m, z, a[2] + b[2]


# ----------------------------------------------------------------------------------------------
# Forward and backward rings.


def _compute_operands(hidden, kernel):
    dtype = jnp.result_type(hidden.dtype, kernel.dtype)
    return hidden.astype(dtype), kernel.astype(dtype)


def _forward_lse(ring: _Ring, hidden, kernel, targets):
    """Per-token (log-sum-exp, target logit) over the whole vocab, each [N] fp32."""
    hidden, kernel = _compute_operands(hidden, kernel)
    if ring.move_weights:
        def step(s, kernel_shard, stats, _):
            shard = _shard_at_step(ring, s)
            return _merge_statistics(stats, _shard_statistics(
                ring, hidden, kernel_shard, targets, shard)), None

        stats, _ = _drive_ring(ring, step, kernel, _empty_statistics(targets), None)
    else:
        own_shard = lax.axis_index(ring.axis_name)

        def step(s, tokens, _, stats):
            visiting_hidden, visiting_targets = tokens
            return None, _merge_statistics(stats, _shard_statistics(
                ring, visiting_hidden, kernel, visiting_targets, own_shard))

        _, stats = _drive_ring(ring, step, (hidden, targets), None, _empty_statistics(targets))
    m, z, target_logit = stats
    return m + jnp.log(z), target_logit


def _backward_grads(ring: _Ring, hidden, kernel, targets, lse, scale):
    """(dX, dW) in the dtypes of hidden and kernel, replaying the forward ring."""
    hidden_dtype, kernel_dtype = hidden.dtype, kernel.dtype
    hidden, kernel = _compute_operands(hidden, kernel)
    if ring.move_weights:
        def step(s, kernel_shard, d_hidden, d_kernel):
            return _accumulate_shard_gradients(ring, (d_hidden, d_kernel), hidden, kernel_shard,
                                               targets, _shard_at_step(ring, s), lse, scale)

        d_hidden, d_kernel = _drive_ring(ring, step, kernel, jnp.zeros_like(hidden, jnp.float32),
                                         jnp.zeros_like(kernel, jnp.float32))
    else:
        own_shard = lax.axis_index(ring.axis_name)

        def step(s, tokens, d_kernel, d_hidden):
            visiting_hidden, visiting_targets, visiting_lse, visiting_scale = tokens
            d_hidden, d_kernel = _accumulate_shard_gradients(
                ring, (d_hidden, d_kernel), visiting_hidden, kernel, visiting_targets, own_shard,
                visiting_lse, visiting_scale)
            return d_kernel, d_hidden

        d_kernel, d_hidden = _drive_ring(ring, step, (hidden, targets, lse, scale),
                                         jnp.zeros_like(kernel, jnp.float32),
                                         jnp.zeros_like(hidden, jnp.float32))
    return d_hidden.astype(hidden_dtype), d_kernel.astype(kernel_dtype)


def _token_validity(codes):
    return codes == IGNORED, codes >= 0


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring_cross_entropy(ring: _Ring, hidden, kernel, targets):
    return _ring_cross_entropy_fwd(ring, hidden, kernel, targets)[0]


def _ring_cross_entropy_fwd(ring: _Ring, hidden, kernel, targets):
    lse, target_logit = _forward_lse(ring, hidden, kernel, targets)
    ignored, in_vocab = _token_validity(targets)
    loss = jnp.where(ignored, 0.0, jnp.where(in_vocab, lse - target_logit, jnp.nan))
    return loss, (hidden, kernel, targets, lse)


def _ring_cross_entropy_bwd(ring: _Ring, residuals, d_loss):
    hidden, kernel, targets, lse = residuals
    # Without the barrier XLA may prove that backward's strips equal forward's and keep forward's
    # alive instead of recomputing them (all N x V logits, when the ring is short enough to be
    # straight-line code). jax.checkpoint's prevent_cse does the same.
    hidden, kernel = lax.optimization_barrier((hidden, kernel))
    ignored, in_vocab = _token_validity(targets)
    # An invalid target poisons its gradient as it poisons its loss, unless the caller masked
    # that loss out (a zero cotangent), as the materialized loss would allow.
    d_loss = d_loss.astype(jnp.float32)
    scale = jnp.where(ignored, 0.0, jnp.where(in_vocab | (d_loss == 0), d_loss, jnp.nan))
    d_hidden, d_kernel = _backward_grads(ring, hidden, kernel, targets, lse, scale)
    return d_hidden, d_kernel, None


_ring_cross_entropy.defvjp(_ring_cross_entropy_fwd, _ring_cross_entropy_bwd)
