"""Moving rows along a one-to-one map, as a gather both ways.

The MoE layer moves whole rows (7168 bf16 values each) between orders several times per chunk:
into expert order, out of it, into send buckets, back home. Written as scatters
(``zeros.at[order].set(rows)``), each one costs a pass that fills the output, the scatter, and
under autodiff a mask of the output's size. Its transpose is a scatter-add as well. On GPUs
the layer's scatters were the largest kernels after the grouped matmuls. A one-to-one map is a
gather whose transpose is another gather, by the inverse map; ``gather_rows`` states that as a
custom VJP, so neither direction scatters rows.

    y = gather_rows(x, index, inverse, fill)

* ``y[j] = x[index[j]]``, or ``fill`` where ``index[j]`` is outside ``[0, len(x))``;
* the caller promises that ``index`` is one-to-one on its in-range entries and that
  ``inverse[i]`` is the j with ``index[j] == i``, or out of range where no j takes row i. Then
  the cotangent of x is ``dy[inverse]`` (0 where out of range). The promise is not checked (the
  maps are traced). The tests check the rule on random maps against autodiff of the scatter,
  and the layer's maps through its values and gradients against the float64 reference.

The index maps themselves are built with integer scatters over the rows' positions: one int32
per row, not one row (``inverse_map``, ``bucket_positions``). The custom VJP has no forward-mode
rule: ``jax.jvp`` through it raises.

Measured: docs/pipelined_moe.md.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from peakflat_jax.ops._shard import varying_like


def gather_rows(x: jax.Array, index: jax.Array, inverse: jax.Array | None,
                fill=0) -> jax.Array:
    """``[len(index), ...]``: rows of ``x`` picked by the one-to-one ``index`` (module doc).
    ``fill``: a Python scalar (static). ``inverse`` may be None for integer ``x`` (no
    cotangent)."""
    if not jnp.issubdtype(x.dtype, jnp.inexact):  # no cotangent to carry
        return _take(x, index, fill)
    # Inside shard_map, x must vary like the maps: the custom VJP's cotangent for x varies like
    # them (for rows replicated over an axis, the cast's transpose adds the psum).
    return _gather_rows(fill, varying_like(x, index, inverse), index, inverse)


def inverse_map(index: jax.Array, num_rows: int) -> jax.Array:
    """``[num_rows]``: for each row i of the source, the j with ``index[j] == i``, or
    ``len(index)`` (out of range) where none; ``index`` one-to-one on its in-range entries."""
    positions = jnp.arange(index.shape[0], dtype=jnp.int32)
    return jnp.full(num_rows, index.shape[0], jnp.int32).at[index].set(
        positions, mode="drop", wrap_negative_indices=False)


def bucket_positions(bucket: jax.Array, num_buckets: int) -> jax.Array:
    """Each entry's place among the entries of its bucket, in entry order: ``bucket [S]`` in
    ``[0, num_buckets]`` (``num_buckets`` itself is a bucket too, e.g. "not sent")."""
    order = jnp.argsort(bucket, stable=True)
    sorted_bucket = bucket[order]
    counts = jnp.zeros(num_buckets + 1, jnp.int32).at[bucket].add(1)
    starts = jnp.cumsum(counts) - counts
    positions_sorted = jnp.arange(bucket.shape[0]) - starts[sorted_bucket]
    return jnp.zeros_like(bucket).at[order].set(positions_sorted)


def _take(rows, index, fill):
    # A negative index is out of range too (jax would otherwise count it from the end).
    return rows.at[index].get(mode="fill", fill_value=fill, wrap_negative_indices=False)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gather_rows(fill, x, index, inverse):
    del inverse
    return _take(x, index, fill)


def _gather_rows_fwd(fill, x, index, inverse):
    return _take(x, index, fill), inverse


def _gather_rows_bwd(fill, inverse, d_y):
    del fill  # the filled rows are constants: no cotangent flows to x from them
    return _take(d_y, inverse, 0), None, None


_gather_rows.defvjp(_gather_rows_fwd, _gather_rows_bwd)
