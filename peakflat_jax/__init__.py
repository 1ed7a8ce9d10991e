"""peakflat_jax: bounded streaming operators for long-context MoE training in JAX.

The public names of shared/API.md; everything else is private to its module.
"""

from peakflat_jax.ops.ring_cross_entropy import ring_cross_entropy

__all__ = ["ring_cross_entropy"]
