"""Grouped matmul for the expert FFN: rows sorted by group, one weight matrix per group.

``grouped_matmul(lhs [M, K], rhs [G, K, Nout], group_sizes [G]) -> [M, Nout]`` fp32: rows
``sum(group_sizes[:g]) ...`` use ``rhs[g]``; rows past ``sum(group_sizes)`` give zeros (padding).

The portable path is ``jax.lax.ragged_dot``. It is exact and differentiable, but XLA lowers it
densely (CPU: [G, M, K] temporaries; H200: a masked matmul at 45 TFLOP/s against 650 for the
Mosaic GPU kernel jax ships, JAX-NOTES.md), so it suits tests and small shapes. The Mosaic GPU
path (forward ``ragged_dot_mgpu``, weight gradient ``transposed_ragged_dot_mgpu``, under a
custom VJP) is not built yet: it needs GPU time to tune and check.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """``[M, Nout]`` fp32 products of row groups with their matrices (see module doc)."""
    return lax.ragged_dot(lhs, rhs, group_sizes.astype(jnp.int32),
                          preferred_element_type=jnp.float32)
