"""peakflat_jax: bounded streaming operators for long-context MoE training in JAX.

The public names of shared/API.md; everything else is private to its module.
"""

from peakflat_jax.ops.pipelined_moe import pipelined_moe
from peakflat_jax.ops.ring_cross_entropy import ring_cross_entropy
from peakflat_jax.ops.sco import HostBudget, sco_scan
from peakflat_jax.optim.offload_adamw import offload_stream_adamw

__all__ = [
    "HostBudget", "offload_stream_adamw", "pipelined_moe", "ring_cross_entropy", "sco_scan",
]
