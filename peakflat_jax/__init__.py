"""peakflat_jax: bounded streaming operators for long-context MoE training in JAX.

The public names of shared/API.md, their global-array forms for jit users, and the streaming
optimizer for any elementwise optax transformation; everything else is private to its module.

Importing the package turns XLA:CPU's concurrency-optimized scheduler off for the process before
jax starts its backends (``peakflat_jax._xla_cpu``): under it, XLA:CPU of jax 0.11.2 can pair two
different collectives of a program and give wrong values (docs/cpu_scheduler.md).
"""

from peakflat_jax._xla_cpu import protect_cpu_backend

protect_cpu_backend()

from peakflat_jax.model.attention import ulysses_attention  # noqa: E402
from peakflat_jax.ops.global_forms import (  # noqa: E402
                                           materialized_cross_entropy_global,
                                           pipelined_moe_global,
                                           ring_cross_entropy_global,
)
from peakflat_jax.ops.pipelined_moe import pipelined_moe  # noqa: E402
from peakflat_jax.ops.ring_cross_entropy import ring_cross_entropy  # noqa: E402
from peakflat_jax.ops.sco import HostBudget, PerLayer, sco_scan  # noqa: E402
from peakflat_jax.optim.offload_adamw import offload_stream_adamw  # noqa: E402
from peakflat_jax.optim.offload_stream import offload_stream  # noqa: E402

__all__ = [
    "HostBudget", "PerLayer", "materialized_cross_entropy_global", "offload_stream",
    "offload_stream_adamw", "pipelined_moe", "pipelined_moe_global", "ring_cross_entropy",
    "ring_cross_entropy_global", "sco_scan", "ulysses_attention",
]
