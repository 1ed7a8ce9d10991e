"""What a plan is for besides the config: the platform and device kind, the data's statistics,
the pinned-host pool's limit and the measured constants. Every input of the closed form is
here or in the config: the planner reads nothing else (no environment, no device, no data)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

from peakflat_jax.plan.measured import Measured, Rates, measured_for

PLATFORMS = ("gpu", "cpu")


def full_causal_pairs(context: int) -> float:
    """T (T + 1) / 2: the causal pairs of a sequence that is one document."""
    return context * (context + 1) / 2


def no_pipeline_bytes(context: int, batch_size: int) -> int:
    """0: the data pipeline's host bytes, where no statistics of the data were given."""
    del context, batch_size
    return 0


@dataclasses.dataclass(frozen=True)
class DataStats:
    """The data's statistics the plan needs, computed by the data layer and passed in
    (``peakflat_jax.train.data.data_stats``). The default knows nothing of the data: full
    causal attention and no pipeline bytes."""

    causal_pairs: Callable[[int], float] = full_causal_pairs
    """The mean causal query-key pairs within documents of one sequence at a context: what
    the step estimate's attention counts."""
    pipeline_host_bytes: Callable[[int, int], int] = no_pipeline_bytes
    """Host bytes the pipeline allocates making a batch, per process, at (context, batch
    size): the ``host.data_pipeline`` term."""
    source: str = "not given: full causal attention, no pipeline bytes"
    """Where the statistics come from, for the report."""


@dataclasses.dataclass(frozen=True)
class Target:
    """The machine and data a plan is for (module doc)."""

    platform: str = "gpu"
    """``gpu`` or ``cpu``: the attention kernel, the grouped matmul and the memory kinds
    follow it (on a CPU the host memory kinds lower to device memory)."""
    device_kind: str | None = None
    """E.g. ``NVIDIA H200``: which measured constants apply (None: the platform's default)."""
    data: DataStats = DataStats()
    pinned_pool_limit_gib: int | None = None
    """XLA's pinned-host pool cap the run will have (``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB``);
    None: the cap a run of the config sets (``device.pinned_host_pool``), planned per
    setting."""
    rates: Rates | None = None
    """The step estimate's rates; None: the measured entry's."""
    jax_version: str | None = None
    """The jax the plan is for, checked against the measured entry's (None: not checked)."""

    def __post_init__(self):
        if self.platform not in PLATFORMS:
            raise ValueError(f"platform: expected one of {PLATFORMS}, got {self.platform!r}")

    @functools.cached_property
    def measured(self) -> Measured:
        return measured_for(self.platform, self.device_kind, self.jax_version)

    @property
    def step_rates(self) -> Rates:
        return self.rates if self.rates is not None else self.measured.rates


GPU = Target()
"""A GPU of the default measured kind, the data unknown: what a plan is for when none is
named."""
