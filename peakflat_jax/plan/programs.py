"""Composing the terms: each program's bytes at its peak, the phases, and a ``Plan``
(feasibility and what to change)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from peakflat_jax.config import Config
from peakflat_jax.mesh import padded_vocab
from peakflat_jax.plan.errors import GIB
from peakflat_jax.plan.terms import (
    PHASES,
    PINNED_TERMS,
    POOL_EXHAUSTED,
    Knobs,
    Term,
    phase_total,
    plan_terms,
)

# ----------------------------------------------------------------------------------------------
# Composing the terms.


def program_bytes(terms: Sequence[Term]) -> dict[str, int]:
    """The device bytes of each program at its peak: ``gradient`` (or the fused step) =
    persistent + boundaries + backward + the largest phase, the later stack's boundaries
    (``boundaries.later``: unrolled, with a dense peak layer) beside every phase but that
    layer's; ``overlapped``: the gradient
    program's terms and the overlap's, the ``overlap`` terms beside every phase (an upper
    bound: unrolled, XLA:GPU holds the new weights to the step's end) and the
    ``overlap.forward`` ones (scanned: the MoE layers' new weights) beside the largest of the
    dense layer's forward, the loss and the embedding; ``optimizer_step`` (when present)."""
    by_live: dict[str, int] = {}
    for term in terms:
        by_live[term.live] = by_live.get(term.live, 0) + term.bytes
    phases = phase_bytes(terms)
    kept = (by_live.get("persistent", 0) + by_live.get("boundaries", 0)
            + by_live.get("backward", 0))
    later = by_live.get("boundaries.later", 0)
    others = max(value for phase, value in phases.items() if phase != "layer")
    programs = {"gradient": kept + max(phases["layer"], later + others)}
    if "overlap" in by_live or "overlap.forward" in by_live:
        everywhere = by_live.get("overlap", 0)
        forward = max(by_live.get("forward", 0), phases["loss"], phases["embedding"])
        programs["overlapped"] = everywhere + max(
            programs["gradient"], kept + later + by_live.get("overlap.forward", 0) + forward)
    if "optimizer_step" in by_live:
        programs["optimizer_step"] = by_live["optimizer_step"]
    return programs


def step_terms(config: Config, knobs: Knobs, *, platform: str,
               operators_on: bool = True) -> tuple[Term, ...]:
    """``plan_terms`` as XLA:GPU schedules the step: where it is the standard stack's step as
    measured (``_standard_stack_measured``), counted as XLA:GPU's buffer assignments of h200-1
    hold it (``plan_terms``' ``standard_step``): the MoE layer with two [M, H], three [M, F]
    and ``held_through_attention`` through its attention's backward, and none of the dense
    FFN's four ``[N, F_d]`` under the attention's backward. Every dump of today's step, from
    65,536 tokens with 64 segments to 621,208, holds none of the four, and two [M, H] at most
    but at one fusion at 64 segments, which the FFN phase covers (docs/plan.md, the twentieth
    and twenty-first drivers); so counted the plan is 1.014-1.054x every peak measured of
    today's step, 16K-665K. The four ``[N, F_d]`` were held before the scanned backward's
    barrier (2026-12-01: its dumps at 64K and 256K), and the rule that counted them until the
    step so counted passed the device's memory was 1.22x at 443,720."""
    terms = plan_terms(config, knobs, platform=platform, operators_on=operators_on)
    if platform != "gpu" or not _standard_stack_measured(config, knobs, operators_on):
        return tuple(terms)
    standard = plan_terms(config, knobs, platform=platform, operators_on=operators_on,
                          standard_step=True)
    held = next((t.bytes for t in terms if t.name == "ffn.under_attention"), 0)
    if held:
        standard.append(Term("ffn.under_attention", 0, "layer/attention",
                             f"0 of 4 * N * F_d * b = {held / GIB:.2f} GiB: the standard "
                             f"stack's step holds none of them under the attention's backward "
                             f"(plan.programs.step_terms; XLA:GPU's buffer assignments of "
                             f"h200-1 at 65,536-621,208 tokens)"))
    return tuple(standard)


def _standard_stack_measured(config: Config, knobs: Knobs, operators_on: bool) -> bool:
    """Whether the step is of the kind ``step_terms``' rule was measured on: the standard
    stack's (EP, the materialized loss, no boundary offloaded, AdamW on the device; a host
    budget for the boundaries excluded whatever it takes, so that the rule does not switch on
    with the context), with cuDNN attention on one device, dense and MoE layers, and a
    vocabulary no wider than the hidden size: ``held_through_attention`` counts the loss's fp32
    [N, V'], measured with V' = 260 only, where for a real vocabulary it would be most of the
    step; such a stack keeps the general terms (over, not under)."""
    model = config.model
    if padded_vocab(model.vocab_size, knobs.num_devices) > model.hidden:
        return False
    if operators_on:
        ops = knobs
        if (ops.moe_dispatch != "ep" or ops.loss != "materialized" or any(ops.offload)
                or isinstance(config.operators.offload, float) or ops.optimizer_offload):
            return False
    return (config.optimizer.update_on == "device" and knobs.num_devices == 1
            and knobs.attention == "cudnn" and 0 < model.num_dense_layers < model.num_layers)


def pool_limit_gib() -> str:
    """The pinned-host pool's limit as the environment or XLA sets it (for a reason's text)."""
    from peakflat_jax.plan.host_pool import XLA_DEFAULT_LIMIT_GIB, set_limit_gib

    limit = set_limit_gib()
    return f"{limit}, set" if limit is not None else f"{XLA_DEFAULT_LIMIT_GIB}, XLA's default"


def phase_bytes(terms: Sequence[Term]) -> dict[str, int]:
    """Each phase's bytes (its sub-phases, ``layer/attention`` and ``layer/ffn``, take
    turns)."""
    rows = [(t.name, t.bytes, t.live) for t in terms]
    return {phase: phase_total(rows, phase) for phase in PHASES}


@dataclasses.dataclass(frozen=True)
class Choice:
    """A knob's value and the rule that chose it."""

    key: str
    value: Any
    why: str


@dataclasses.dataclass(frozen=True)
class Plan:
    """The plan of one configuration (module doc): terms, totals, feasibility."""

    config: Config
    knobs: Knobs
    platform: str
    terms: tuple[Term, ...]
    device_memory: int | None
    host_memory: int | None
    operators_on: bool = True
    choices: tuple[Choice, ...] = ()
    baseline: Plan | None = None
    largest_context: int | None = None
    step_seconds: float | None = None

    @property
    def programs(self) -> dict[str, int]:
        return program_bytes(self.terms)

    @property
    def total_bytes(self) -> int:
        """The device bytes at the step's peak: the larger program."""
        return max(self.programs.values())

    @property
    def host_bytes(self) -> int:
        return sum(t.bytes for t in self.terms if t.live == "host")

    @property
    def phases(self) -> dict[str, int]:
        return phase_bytes(self.terms)

    @property
    def peak_phase(self) -> str:
        phases = self.phases
        return max(phases, key=phases.get)

    @property
    def fits_device(self) -> bool | None:
        return None if self.device_memory is None else self.total_bytes <= self.device_memory

    @property
    def fits_host(self) -> bool | None:
        return None if self.host_memory is None else self.host_bytes <= self.host_memory

    @property
    def feasible(self) -> bool | None:
        """Whether the step fits both memories; None when the device's memory is unknown."""
        if self.fits_device is None:
            return None
        return bool(self.fits_device and self.fits_host is not False)

    def device_terms(self) -> dict[str, int]:
        return {t.name: t.bytes for t in self.terms if t.live != "host"}

    def host_terms(self) -> dict[str, int]:
        return {t.name: t.bytes for t in self.terms if t.live == "host"}

    def reasons(self) -> list[str]:
        """Why it does not fit, and what to change (empty when it fits)."""
        return _reasons(self)

    def filled_config(self) -> Config:
        """The config with the plan's knobs (null ones filled, or all chosen with --auto):
        what to run. The attention kernel stays as configured (the trainer resolves it)."""
        sections: dict[str, dict] = {}
        for key, value in self.knobs.as_config().items():
            if key == "operators.attention":
                continue
            section, field = key.split(".")
            sections.setdefault(section, {})[field] = value
        return self.config.replace(**sections)


def fits_in_memory(config: Config, knobs: Knobs, platform: str, device_memory: int | None,
                   host_memory: int | None) -> bool:
    """Whether the step fits (a layer loop left ``auto`` counted as it resolves:
    ``plan.terms.auto_layer_loop``), so that a search's fit is the plan's."""
    terms = step_terms(config, knobs, platform=platform)
    device = max(program_bytes(terms).values())
    host = sum(t.bytes for t in terms if t.live == "host")
    return ((device_memory is None or device <= device_memory)
            and (host_memory is None or host <= host_memory))


# ----------------------------------------------------------------------------------------------
# What to change.


_REMEDIES = {
    "kept_boundaries": "keep fewer boundaries on the device: operators.offload: all",
    "moe.": "bound the MoE's buffers: operators.moe_dispatch: pipelined with a smaller "
            "operators.token_budget (null: the planner's choice)",
    "loss.": "bound the loss: operators.loss: ring, a smaller operators.vocab_block",
    "master": "move the optimizer's state to host memory: operators.optimizer_offload: true "
              "(or, the standard stack's way, optimizer.update_on: host_cpu)",
    "moments": "move the optimizer's state to host memory: operators.optimizer_offload: true "
               "(or, the standard stack's way, optimizer.update_on: host_cpu)",
    "attention.scores": "use cuDNN attention (operators.attention: cudnn, a GPU and bf16): the "
                        "XLA kernel materializes T x T scores",
    "params": "spread the weights over more devices",
    "grads": "spread the weights over more devices",
    "embedding_table": "spread the vocabulary over more devices",
    "embedding_gradient": "spread the vocabulary over more devices",
}


REMAT_REACH = 1.05
"""How far past the device a GPU plan may be for the refusal to suggest letting XLA try: XLA:GPU
rematerializes after scheduling where its program is past the device's memory. h200-1 at
940,692 tokens (1.1x the plan's largest context until 2026-12-04) compiled within the device
that way, at 130.1 GiB, and trained 3 steps at 57.2 s a step, MFU 35.9% against 40.8% at the
largest then (docs/plan.md, the tenth and thirteenth drivers); its plan is 1.012x the device's
132.8 GiB today. At 1,026,208 (a plan 1.093x the device today) XLA's plan was 140.86 GiB, past
it (the fourteenth driver). Both were compiled before the overlapped step wrote its MoE weights
and gradients in place, which holds less; between the two, nothing has been compiled."""


def _reasons(plan: Plan) -> list[str]:
    reasons = []
    if plan.fits_device is False:
        terms = [t for t in plan.terms if t.live != "host"]
        largest = sorted(terms, key=lambda t: -t.bytes)[:3]
        reasons.append(
            f"the device needs {plan.total_bytes / GIB:.2f} GiB, it has "
            f"{plan.device_memory / GIB:.2f} GiB; largest terms: "
            + ", ".join(f"{t.name} {t.bytes / GIB:.2f} GiB" for t in largest))
        remedies = []
        for term in largest:
            for prefix, remedy in _REMEDIES.items():
                if term.name.startswith(prefix) and remedy not in remedies:
                    remedies.append(remedy)
        remedies.append("a shorter context (data.seq_len) or fewer sequences (data.batch_size)")
        remedies.append("`peakflat plan CONFIG --auto` to choose the knobs")
        if plan.platform == "gpu" and plan.total_bytes <= REMAT_REACH * plan.device_memory:
            remedies.append(
                "or let XLA try: pin the operators and optimizer.resident_groups this plan "
                "chose (a lifted check plans for the larger budget and may choose others) and "
                f"lift the check with train.device_memory_gib={math.ceil(plan.total_bytes / GIB)}:"
                " past the device XLA:GPU recomputes values to fit where it can, which the plan "
                "does not count, at a cost in time (h200-1 at 1.1x its planned largest trained "
                "at 0.88x the MFU, docs/plan.md)")
        reasons.append("to change: " + "; ".join(remedies))
    if plan.fits_host is False and any(t.name == "host.pinned_pool_growth"
                                       and t.bytes >= POOL_EXHAUSTED for t in plan.terms):
        pinned = sum(t.bytes for t in plan.terms if t.name in PINNED_TERMS)
        cap = ("device.pinned_host_pool: planned (the cap from the plan), "
               if plan.config.device.pinned_host_pool == "xla" else "")
        reasons.append(
            f"the pinned host arrays ({pinned / GIB:.2f} GiB per device) do not fit XLA's "
            f"pinned-host pool (XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB: {pool_limit_gib()} GiB); "
            f"to change: {cap}offload fewer boundaries (operators.offload), or keep the "
            f"optimizer on the device")
    elif plan.fits_host is False:
        reasons.append(
            f"the host needs {plan.host_bytes / GIB:.2f} GiB per device, it has "
            f"{plan.host_memory / GIB:.2f} GiB; to change: offload fewer boundaries "
            f"(operators.offload), or keep the optimizer on the device")
    return reasons
