"""One-pass fused cross-entropy: a sum of per-token losses whose gradients are made in the forward.

A trainer asks for the mean (or sum) of the per-token losses, never for per-token losses under an
arbitrary cotangent. The cotangent of that reduction is one scalar g, so a device that sees the
whole vocabulary for a block of tokens can finish the block in one pass. For each block of T
tokens (a ``lax.fori_loop``, one ``[T, V]`` strip live at a time):

    Y   = X_blk W                                   logits, fp32           (matmul unit 1)
    lse = logsumexp(Y);  loss += sum_t s_t (lse_t - Y[t, target_t])
    dY  = (softmax(Y) - onehot(target)) * s         in the compute dtype
    dX_blk = dY W^T                                 stored in hidden's dtype (matmul unit 2)
    dW    += X_blk^T dY                             fp32 accumulator       (matmul unit 3)

with s_t the token's weight (1/count for a mean, 1 for a sum, 0 for an ignored token, NaN for an
invalid one). The forward returns the weighted sum and keeps (dX, dW) in the input dtypes as its
residuals; the backward only multiplies them by g. Three matmul units of N x H x V against the
four of an exact per-token loss that never holds the logits (which must form every strip twice,
since a strip's softmax needs the log-sum-exp over the whole vocabulary first), and as many as
the materialized loss. Without differentiation only the first unit runs.

``fused_cross_entropy_sum`` is the building block of ``ring_cross_entropy(reduction=...)``: at
P = 1 on the device's kernel, at P >= 2 on the all-gathered kernel (``mode="gather_kernel"``).

Memory (per device, beyond inputs and outputs): one block's strips (T * V * (4 + b)), the fp32
dW accumulator and the stored gradients; no term grows with N * V. ``memory_terms`` gives each
term in bytes, ``MEMORY_FORMULAS`` its formula.

Why it is shaped so: the gradients are computed once, in the forward, because under
``value_and_grad`` the forward runs exactly once; the backward has nothing left to recompute.
The price: inside ``jax.checkpoint`` the forward (all three units) runs again in the replay, so
keep the loss outside rematerialized regions. The dW accumulation is a loop carry so that XLA
can fold it into the matmul (on GPU, a GEMM that accumulates into its output); the dX block is
written in place into the stored dX. A last block that would run past N starts early instead,
and its rows already done are masked (no padded copy of the tokens).

Legend: N tokens on this device, H hidden, V vocab columns of the kernel (padding included),
T tokens per block (``token_block``), s_t a token's weight, g the cotangent of the sum, b_h and
b_k bytes of hidden's and kernel's dtypes, b those of the compute dtype (the wider of the two).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from peakflat_jax._validate import as_int
from peakflat_jax.ops._shard import vary_alike, varying_like

DEFAULT_TOKEN_BLOCK = 2048

MEMORY_FORMULAS: dict[str, str] = {
    "fused_strips": "T * V * (4 + b): one block's fp32 logits and dY in the compute dtype (the "
                    "softmax and the one-hot fuse into them)",
    "kernel_gradient": "H * V * 4, the fp32 dW accumulator (0 where it becomes the output: an "
                       "fp32 kernel whose dW is not reduce-scattered), plus H * V * b_k for its "
                       "cast to kernel's dtype where b_k < 4 and dW is reduce-scattered",
    "hidden_gradient": "N * H * b_h: the stored dX (the backward scales it into the output)",
    "block_partials": "T * H * 4: one block's fresh fp32 dX before it is stored",
    "padding_bias": "T * V * 4 where the kernel has padding columns: the logits with -inf on "
                    "them (XLA:CPU keeps it beside the logits)",
    "cast": "H * V * b if kernel's dtype is narrower than the compute dtype, plus T * H * b if "
            "hidden's is",
}


def memory_terms(num_tokens: int, hidden: int, vocab_width: int, token_block: int | None = None,
                 hidden_dtype=jnp.float32, kernel_dtype=jnp.float32,
                 gradient_is_output: bool = True,
                 vocab_size: int | None = None) -> dict[str, int]:
    """Per-device bytes of each term of the one-pass loss's bound (forward + backward), beyond
    inputs and outputs: N = ``num_tokens``, H = ``hidden``, V = ``vocab_width`` (the kernel's
    columns), T = ``token_block`` (default ``DEFAULT_TOKEN_BLOCK``, at most N).
    ``gradient_is_output``: whether the stored dW is the kernel's gradient itself (P = 1), not
    reduce-scattered into a shard's (``gather_kernel``); ``vocab_size``: the true V when the
    kernel's last columns are padding."""
    n, h, v = (as_int(name, x) for name, x in (("num_tokens", num_tokens), ("hidden", hidden),
                                               ("vocab_width", vocab_width)))
    t = min(n, DEFAULT_TOKEN_BLOCK if token_block is None else as_int("token_block", token_block))
    hidden_size, kernel_size = jnp.dtype(hidden_dtype).itemsize, jnp.dtype(kernel_dtype).itemsize
    compute = jnp.dtype(jnp.result_type(hidden_dtype, kernel_dtype)).itemsize
    accumulator = 0 if gradient_is_output and kernel_size == 4 else h * v * 4
    stored = h * v * kernel_size if not gradient_is_output and kernel_size < 4 else 0
    return {"fused_strips": t * v * (4 + compute),
            "kernel_gradient": accumulator + stored,
            "hidden_gradient": n * h * hidden_size,
            "block_partials": t * h * 4,
            "padding_bias": t * v * 4 if vocab_size is not None and vocab_size < v else 0,
            "cast": (h * v * compute if kernel_size < compute else 0)
            + (t * h * compute if hidden_size < compute else 0)}


@dataclasses.dataclass(frozen=True)
class _Blocks:
    """Static description of one call: hashable, so it can be a nondiff argument."""

    num_tokens: int
    token_block: int
    vocab_size: int
    vocab_width: int

    @property
    def num_blocks(self) -> int:
        return -(-self.num_tokens // self.token_block)

    @property
    def ragged(self) -> bool:
        """Whether the last block starts early and overlaps the one before it."""
        return self.num_tokens % self.token_block != 0


def fused_cross_entropy_sum(hidden: jax.Array, kernel: jax.Array, targets: jax.Array,
                            weights: jax.Array, *, vocab_size: int | None = None,
                            token_block: int | None = None) -> jax.Array:
    """``sum_t weights_t * CE(hidden_t @ kernel, targets_t)`` as a float32 scalar, its
    gradients w.r.t. ``hidden`` and ``kernel`` made in the forward pass.

    Args:
      hidden: ``[N, H]``, bf16, f16 or f32 (the softmax math is fp32).
      kernel: ``[H, V']`` with ``V' >= vocab_size``; columns past ``vocab_size`` never enter the
        softmax but must be finite (zero them first if they may hold anything).
      targets: ``[N]`` int32 column of each token's target; a negative one is no column.
      weights: ``[N]`` float32 weight of each token's loss. A token of weight 0 contributes
        exactly 0 to the value and the gradients, whatever its target; NaN poisons both.
      vocab_size: the true V (default V').
      token_block: T, tokens per block (default ``DEFAULT_TOKEN_BLOCK``, at most N).
    """
    num_tokens, width = hidden.shape[0], kernel.shape[1]
    vocab_size = width if vocab_size is None else as_int("vocab_size", vocab_size)
    token_block = DEFAULT_TOKEN_BLOCK if token_block is None else as_int("token_block",
                                                                         token_block)
    if token_block < 1:
        raise ValueError(f"token_block: expected None or a positive int, got {token_block!r}")
    hidden, kernel, targets, weights = vary_alike(hidden, kernel, targets.astype(jnp.int32),
                                                  weights.astype(jnp.float32))
    if num_tokens == 0:
        return varying_like(jnp.zeros((), jnp.float32), hidden)
    blocks = _Blocks(num_tokens, min(token_block, num_tokens), vocab_size, width)
    return _fused_sum(blocks, hidden, kernel, targets, weights)


def _block_rows(blocks: _Blocks, block):
    """(first row of block ``block``, mask of its rows that this block owns)."""
    start = jnp.minimum(block * blocks.token_block, blocks.num_tokens - blocks.token_block)
    row = start + lax.broadcasted_iota(jnp.int32, (blocks.token_block,), 0)
    return start, row >= block * blocks.token_block


def _block_loss(blocks: _Blocks, hidden, kernel, targets, weights, block):
    """One block: (fp32 logits [T, V'], log-sum-exp [T], the block's weighted loss sum,
    one-hot mask of the targets [T, V'], the block's token weights [T] (0 on rows it does not
    own), its first row, the mask of rows it owns, its tokens [T, H])."""
    start, owned = _block_rows(blocks, block)
    x = lax.dynamic_slice_in_dim(hidden, start, blocks.token_block)
    t = lax.dynamic_slice_in_dim(targets, start, blocks.token_block)
    w = lax.dynamic_slice_in_dim(weights, start, blocks.token_block)
    if blocks.ragged:
        w = jnp.where(owned, w, 0.0)
    logits = jnp.dot(x.astype(kernel.dtype), kernel, preferred_element_type=jnp.float32)
    column = lax.broadcasted_iota(jnp.int32, (1, blocks.vocab_width), 1)
    if blocks.vocab_size < blocks.vocab_width:  # a [1, V'] bias, not a [T, V'] select
        logits = logits + jnp.where(column < blocks.vocab_size, 0.0, -jnp.inf)
    lse = jax.nn.logsumexp(logits, axis=1)
    onehot = column == t[:, None]
    target_logit = jnp.sum(jnp.where(onehot, logits, 0.0), axis=1)
    loss = jnp.sum(jnp.where(w == 0, 0.0, w * (lse - target_logit)))
    return logits, lse, loss, onehot, w, start, owned, x


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused_sum(blocks: _Blocks, hidden, kernel, targets, weights):
    # Without differentiation: one matmul unit, no gradients.
    hidden, kernel = _compute_operands(hidden, kernel)

    def per_block(block, total):
        return total + _block_loss(blocks, hidden, kernel, targets, weights, block)[2]

    return _fold(blocks, per_block, varying_like(jnp.zeros((), jnp.float32), weights))


def _compute_operands(hidden, kernel):
    """The kernel in the compute dtype (whole); hidden is cast block by block."""
    return hidden, kernel.astype(jnp.result_type(hidden.dtype, kernel.dtype))


def _fold(blocks: _Blocks, per_block, init):
    if blocks.num_blocks == 1:
        return per_block(0, init)
    return lax.fori_loop(0, blocks.num_blocks, per_block, init)


def _fused_sum_fwd(blocks: _Blocks, hidden, kernel, targets, weights):
    hidden_dtype, kernel_dtype = hidden.dtype, kernel.dtype
    hidden, kernel = _compute_operands(hidden, kernel)

    def per_block(block, carry):
        total, d_hidden, d_kernel = carry
        logits, lse, loss, onehot, w, start, owned, x = _block_loss(
            blocks, hidden, kernel, targets, weights, block)
        probabilities = jnp.exp(logits - lse[:, None])
        # A weight-0 row contributes exactly 0 (its lse may be anything); NaN poisons its row.
        d_logits = jnp.where(w[:, None] == 0, 0.0, (probabilities - onehot) * w[:, None])
        d_logits = d_logits.astype(kernel.dtype)
        d_block = jnp.dot(d_logits, kernel.T,
                          preferred_element_type=jnp.float32).astype(hidden_dtype)
        if blocks.ragged:  # rows that the previous block owns keep their stored gradient
            d_block = jnp.where(owned[:, None], d_block,
                                lax.dynamic_slice_in_dim(d_hidden, start, blocks.token_block))
        d_hidden = lax.dynamic_update_slice_in_dim(d_hidden, d_block, start, axis=0)
        d_kernel = d_kernel + jnp.dot(x.astype(kernel.dtype).T, d_logits,
                                      preferred_element_type=jnp.float32)
        return total + loss, d_hidden, d_kernel

    init = (varying_like(jnp.zeros((), jnp.float32), weights),
            varying_like(jnp.zeros(hidden.shape, hidden_dtype), hidden),
            varying_like(jnp.zeros(kernel.shape, jnp.float32), kernel))
    total, d_hidden, d_kernel = _fold(blocks, per_block, init)
    return total, (d_hidden, d_kernel.astype(kernel_dtype))


def _fused_sum_bwd(blocks: _Blocks, residuals, g):
    d_hidden, d_kernel = residuals
    g = g.astype(jnp.float32)
    return ((g * d_hidden.astype(jnp.float32)).astype(d_hidden.dtype),
            (g * d_kernel.astype(jnp.float32)).astype(d_kernel.dtype), None, None)


_fused_sum.defvjp(_fused_sum_fwd, _fused_sum_bwd)
