"""peakflat_jax: bounded streaming operators for long-context MoE training in JAX.

The public names of shared/API.md, their global-array forms for jit users, and the streaming
optimizer for any elementwise optax transformation; everything else is private to its module.
"""

from peakflat_jax.model.attention import ulysses_attention
from peakflat_jax.ops.global_forms import (
                                           materialized_cross_entropy_global,
                                           pipelined_moe_global,
                                           ring_cross_entropy_global,
)
from peakflat_jax.ops.pipelined_moe import pipelined_moe
from peakflat_jax.ops.ring_cross_entropy import ring_cross_entropy
from peakflat_jax.ops.sco import HostBudget, PerLayer, sco_scan
from peakflat_jax.optim.offload_adamw import offload_stream_adamw
from peakflat_jax.optim.offload_stream import offload_stream

__all__ = [
    "HostBudget", "PerLayer", "materialized_cross_entropy_global", "offload_stream",
    "offload_stream_adamw", "pipelined_moe", "pipelined_moe_global", "ring_cross_entropy",
    "ring_cross_entropy_global", "sco_scan", "ulysses_attention",
]
