"""Composing the terms into the programs a step runs, each program's peak, and a ``Plan``.

A step's peak is not the sum of everything it allocates: it is the largest of its live sets.
The trainer compiles, per step, one of

    gradient program  = persistent + boundaries + backward
                        + max(layer, boundaries.later + max(loss, embedding, update))
    overlapped program = overlap + max(gradient program)
                        (the streamed optimizer's update applied inside the next step)
    optimizer program = optimizer_step  (OffloadStreamAdamW's own program)

and the device's total is the largest program it compiles. Phases (``terms.PHASES``) never
overlap: the backward runs one layer at a time, the loss before it and the embedding's lookup
before that; within a layer, attention's backward and the FFN's (or MoE's) take turns
(``layer/attention``, ``layer/ffn``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from peakflat_jax.config import Config
from peakflat_jax.plan import host_pool
from peakflat_jax.plan.errors import GIB
from peakflat_jax.plan.target import Target
from peakflat_jax.plan.terms import PHASES, Knobs, Term, phase_total, plan_terms


def program_bytes(terms: Sequence[Term]) -> dict[str, int]:
    """The device bytes of each program at its peak (module doc)."""
    by_live: dict[str, int] = {}
    for term in terms:
        by_live[term.live] = by_live.get(term.live, 0) + term.bytes
    phases = phase_bytes(terms)
    kept = (by_live.get("persistent", 0) + by_live.get("boundaries", 0)
            + by_live.get("backward", 0))
    later = by_live.get("boundaries.later", 0)
    others = max(value for phase, value in phases.items() if phase != "layer")
    programs = {"gradient": kept + max(phases["layer"], later + others)}
    if "overlap" in by_live:
        programs["overlapped"] = by_live["overlap"] + programs["gradient"]
    if "optimizer_step" in by_live:
        programs["optimizer_step"] = by_live["optimizer_step"]
    return programs


def phase_bytes(terms: Sequence[Term]) -> dict[str, int]:
    """Each phase's bytes (its sub-phases take turns)."""
    return {phase: phase_total(terms, phase) for phase in PHASES}


def device_and_host_bytes(terms: Sequence[Term]) -> tuple[int, int]:
    """(the largest program's device bytes, the host's bytes) of ``terms``."""
    return (max(program_bytes(terms).values()),
            sum(t.bytes for t in terms if t.live == "host"))


def fits_in_memory(config: Config, knobs: Knobs, target: Target, device_memory: int | None,
                   host_memory: int | None) -> bool:
    """Whether the step of ``knobs`` fits both memories (None: not held); a search's fit is
    the plan's."""
    terms = plan_terms(config, knobs, target)
    device, host = device_and_host_bytes(terms)
    return ((device_memory is None or device <= device_memory)
            and (host_memory is None or host <= host_memory)
            and not any(t.name == "host.pinned_pool_shortfall" for t in terms))


@dataclasses.dataclass(frozen=True)
class Choice:
    """A knob's value and the rule that chose it."""

    key: str
    value: Any
    why: str


@dataclasses.dataclass(frozen=True)
class Plan:
    """The plan of one configuration on one target: its terms, programs and feasibility."""

    config: Config
    knobs: Knobs
    target: Target
    terms: tuple[Term, ...]
    device_memory: int | None
    host_memory: int | None
    operators_on: bool = True
    choices: tuple[Choice, ...] = ()
    baseline: Plan | None = None
    largest_context: int | None = None
    step_seconds: float | None = None
    pinned_pool_cap_gib: int | None = None
    """The pinned-host pool's cap a run of this plan sets (``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB``)
    where its config caps the pool (``device.pinned_host_pool: planned``) or the cap was given;
    None: XLA's own."""
    lighter: tuple[Config, ...] = ()
    """With ``operators: auto``, the other settings whose closed form is lighter than this
    one's, fastest first: where the compiled program does not fit, the next to try."""

    @property
    def platform(self) -> str:
        return self.target.platform

    @property
    def programs(self) -> dict[str, int]:
        return program_bytes(self.terms)

    @property
    def total_bytes(self) -> int:
        """The device bytes at the step's peak: the largest program."""
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
    def pool_shortfall(self) -> int:
        """What the pinned arrays need beyond the pool's cap (0: they fit under it)."""
        return sum(t.bytes for t in self.terms if t.name == "host.pinned_pool_shortfall")

    @property
    def fits_device(self) -> bool | None:
        return None if self.device_memory is None else self.total_bytes <= self.device_memory

    @property
    def fits_host(self) -> bool | None:
        if self.pool_shortfall:
            return False
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

    def largest_term(self) -> Term:
        return max((t for t in self.terms if t.live != "host"), key=lambda t: t.bytes)

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


_REMEDIES = {
    "kept_boundaries": "keep fewer boundaries on the device: operators.offload: all",
    "moe.": "bound the MoE's buffers: operators.moe_dispatch: pipelined with a smaller "
            "operators.token_budget (null: the planner's choice)",
    "loss.": "bound the loss: operators.loss: ring, a smaller operators.vocab_block",
    "master": "move the optimizer's state to host memory: operators.optimizer_offload: true "
              "(or optimizer.update_on: host_cpu)",
    "moments": "move the optimizer's state to host memory: operators.optimizer_offload: true "
               "(or optimizer.update_on: host_cpu)",
    "attention.": "use cuDNN attention (operators.attention: cudnn, a GPU and bf16): the XLA "
                  "kernel materializes T x T scores",
    "params": "spread the weights over more devices",
    "grads": "spread the weights over more devices",
    "embedding_table": "spread the vocabulary over more devices",
    "embedding_gradient": "spread the vocabulary over more devices",
}


def _reasons(plan: Plan) -> list[str]:
    reasons = []
    if plan.fits_device is False:
        largest = sorted((t for t in plan.terms if t.live != "host"), key=lambda t: -t.bytes)[:3]
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
        reasons.append("to change: " + "; ".join(remedies))
    if plan.pool_shortfall:
        pinned = sum(t.bytes for t in plan.terms if t.name in ("host.optimizer_state",
                                                               "host.offloaded_boundaries"))
        cap = plan.target.pinned_pool_limit_gib
        limit = (f"{cap} GiB, given" if cap is not None
                 else f"{host_pool.XLA_DEFAULT_LIMIT_GIB} GiB, XLA's default")
        reasons.append(
            f"the pinned host arrays ({pinned / GIB:.2f} GiB per device) do not fit XLA's "
            f"pinned-host pool ({host_pool.LIMIT_VARIABLE}: {limit}); to change: "
            f"device.pinned_host_pool: planned, offload fewer boundaries (operators.offload), "
            f"or keep the optimizer on the device")
    elif plan.fits_host is False:
        reasons.append(
            f"the host needs {plan.host_bytes / GIB:.2f} GiB per device, it has "
            f"{plan.host_memory / GIB:.2f} GiB; to change: offload fewer boundaries "
            f"(operators.offload), or keep the optimizer on the device")
    return reasons
