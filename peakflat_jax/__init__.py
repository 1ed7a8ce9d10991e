"""peakflat_jax: bounded streaming operators for long-context MoE training in JAX.

The public names of shared/API.md; everything else is private to its module.
"""

from peakflat_jax.ops.pipelined_moe import pipelined_moe
from peakflat_jax.ops.ring_cross_entropy import ring_cross_entropy

__all__ = ["pipelined_moe", "ring_cross_entropy"]
