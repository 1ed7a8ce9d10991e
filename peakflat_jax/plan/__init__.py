"""The planner: the per-device memory of a training step in closed form, before anything is
compiled; whether it fits; the largest context that does; and the launch knobs chosen.

A pure function of its inputs: the config, the device count, the device's and the host's
memory, and a ``Target`` (platform, device kind, the data's statistics, the pinned-host pool's
cap). It reads no environment, no device and no data, and sets nothing; XLA's plan of the
compiled programs is the verdict (``train.preflight``), this the estimate that chooses and
bounds, with its margin measured (``measured.json``).

Modules, each importing only those above it: ``measured`` (the constants only a measurement
gives), ``target`` (what a plan is for), ``host_pool`` (XLA's pinned-host pool),
``optimizer_terms`` (the trainer's own optimizers' memory), ``terms`` (the knobs, the weights
and every term), ``programs`` (terms composed into programs; the ``Plan``), ``rates`` (the step
estimate), ``knobs`` (nulls filled, ``--auto``'s choice), ``operators`` (``operators: auto``),
``search`` (``make_plan``, the largest context), ``report`` (the verdict, the table, JSON).
"""

from peakflat_jax.plan.errors import GIB, DoesNotFit, PlanError
from peakflat_jax.plan.knobs import choose_knobs, knobs_from_config, offload_flags
from peakflat_jax.plan.measured import Measured, Rates, measured_for
from peakflat_jax.plan.operators import describe, with_operators_on
from peakflat_jax.plan.programs import Choice, Plan, fits_in_memory, program_bytes
from peakflat_jax.plan.rates import step_seconds
from peakflat_jax.plan.report import format_table, plan_json, verdict
from peakflat_jax.plan.search import largest_context, make_plan, plan_for
from peakflat_jax.plan.target import DataStats, Target
from peakflat_jax.plan.terms import (
    LIVE_SETS,
    MEMORY_FORMULAS,
    PHASES,
    Knobs,
    Term,
    WeightBytes,
    layer_loop,
    model_weights,
    overlaps_optimizer,
    plan_terms,
    resident_param_count,
)

__all__ = [
    "GIB", "LIVE_SETS", "MEMORY_FORMULAS", "PHASES", "Choice", "DataStats", "DoesNotFit",
    "Knobs", "Measured", "Plan", "PlanError", "Rates", "Target", "Term", "WeightBytes",
    "choose_knobs", "describe", "fits_in_memory", "format_table", "knobs_from_config",
    "largest_context", "layer_loop", "make_plan", "measured_for", "model_weights",
    "offload_flags", "overlaps_optimizer", "plan_for", "plan_json", "plan_terms",
    "program_bytes", "resident_param_count", "step_seconds", "verdict", "with_operators_on",
]
