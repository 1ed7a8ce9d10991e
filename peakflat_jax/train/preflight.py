"""Compile as the verdict: XLA's plan of the trainer's programs, on this machine, beside the
closed form (``check``), and the largest context whose compiled programs fit (``largest``).

The closed form (``peakflat_jax.plan``) is an estimate over static sizes; what a device holds
is what XLA's compiler plans for the programs the trainer compiles, which depends on the
platform, its version and its scheduler. Compiling needs no array: the trainer's programs are
lowered for the state's and the batch's shapes (``Trainer.compiled_programs``), so a check or a
search allocates nothing and runs no step.

``check`` prints, per program, the closed form's persistent and transient bytes beside XLA's
(arguments and outputs less what they alias, and temporaries). On XLA:CPU the host-resident
optimizer state counts among a program's arguments and outputs (the memory kinds lower to
nothing there), so it is left out of the device's share; with the optimizer on the host CPU
its update is a program of the CPU backend, held to the host terms of it
(``HOST_UPDATE_TERMS``), per device.

``largest`` bisects over compiles from the closed form's largest context: each probe plans the
context (its knobs filled by the closed form, as the trainer fills them), compiles its
programs and holds XLA's plan of them to the device's memory; a context the closed form puts
surely past the device (``machine.surely_too_large``) is refused without a compile.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable

import jax

from peakflat_jax.config import Config
from peakflat_jax.memory import CompiledMemory, compiled_memory
from peakflat_jax.model.attention import sequence_multiple
from peakflat_jax.plan import GIB, Plan, PlanError, make_plan
from peakflat_jax.train.data import data_stats
from peakflat_jax.train.machine import device_kind_of, platform_of, surely_too_large
from peakflat_jax.train.trainer import Trainer

PLAN_PROGRAM = {"train_step": "gradient", "gradient_step": "gradient",
                "overlapped_step": "overlapped", "optimizer_step": "optimizer_step",
                "host_cpu_update": "host"}
"""Which of the plan's programs each compiled program is held to."""
HOST_UPDATE_TERMS = ("host.cpu_adamw_state", "host.cpu_adamw_transit", "host.cpu_adamw_scalars")
"""The host terms of the host-CPU update's own program, per device; the one program updates the
shards of the process's W devices: XLA's plan of it is held to W times these."""


@dataclasses.dataclass(frozen=True)
class ProgramCheck:
    """One compiled program against the plan's program it is held to."""

    name: str
    plan_program: str
    bound: int
    """The closed form's bytes of that program (the device's, or for the host-CPU update the
    host's ``HOST_UPDATE_TERMS``)."""
    persistent: int
    """The part of ``bound`` that persists across steps."""
    xla: CompiledMemory
    host_state: int
    """Host-resident state that XLA:CPU counted as arguments and outputs (0 elsewhere)."""
    devices: int = 1
    """The devices whose share one compiled program holds (the host update: the process's)."""

    @property
    def xla_device_bytes(self) -> int:
        """XLA's plan of the program per device."""
        return (self.xla.total - self.host_state) // self.devices

    @property
    def holds(self) -> bool:
        return self.xla_device_bytes <= self.bound


def _check_machine(plan: Plan, flag: str) -> None:
    local, count = platform_of(), len(jax.devices())
    planned = plan.knobs.num_devices
    if plan.platform != local or planned != count:
        raise PlanError(f"{flag}: compiles on this machine ({count} {local} devices), and the "
                        f"plan is for {planned} {plan.platform} devices; run it on the machine "
                        f"the config targets")


def _trainer_of(plan: Plan) -> Trainer:
    """A trainer of the plan's knobs that compiles whatever XLA's plan (its check lifted)."""
    return Trainer(plan.filled_config(), run_dir="unused",
                   plan=dataclasses.replace(plan, device_memory=None))


def _host_state(trainer: Trainer, state) -> int:
    """The host-resident optimizer state one device holds (XLA:CPU counts it as arguments)."""
    if platform_of() != "cpu" or not trainer.offloaded_optimizer:
        return 0
    return sum(math.prod(leaf.sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
               for leaf in jax.tree.leaves(state.opt_state)
               if getattr(leaf.sharding, "memory_kind", None) == "pinned_host")


def check(plan: Plan) -> list[ProgramCheck]:
    """Compiles the trainer's programs for ``plan``'s config on this machine and holds each to
    the plan's program of the same role. Raises PlanError where the plan is for another
    machine (platform or device count)."""
    _check_machine(plan, "--check")
    trainer = _trainer_of(plan)
    compiled = trainer.compiled_programs()
    host_state = _host_state(trainer, trainer.initial_state(abstract=True))
    terms = {term.name: term for term in plan.terms}
    persistent = sum(term.bytes for term in plan.terms if term.live == "persistent")
    programs = {**plan.programs, "host": sum(terms[name].bytes for name in HOST_UPDATE_TERMS
                                             if name in terms)}
    checks = []
    for name, program in compiled.items():
        role = PLAN_PROGRAM[name]
        # The gradient program's arguments and outputs hold no optimizer state; the updates
        # donate it, so their outputs alias their arguments: it counts once.
        held = 0 if name in ("gradient_step", "host_cpu_update") else host_state
        kept = terms["host.cpu_adamw_state"].bytes if role == "host" else persistent
        checks.append(ProgramCheck(name, role, programs[role], kept, compiled_memory(program),
                                   held, jax.local_device_count() if role == "host" else 1))
    return checks


def format_checks(plan: Plan, checks: list[ProgramCheck]) -> str:
    """The table: each program's closed form beside XLA's plan, persistent and transient, and
    whether the closed form bounds it; then whether XLA's plan fits the device."""
    def gib(value: int) -> str:
        return f"{value / GIB:.3f}"

    lines = [f"XLA's plan of {plan.config.name}'s programs on this machine beside the closed "
             f"form (GiB per device):",
             "program          closed form: persistent  rest    total | XLA: "
             "arguments+outputs-aliases  temporaries  total | XLA / closed form"]
    for c in checks:
        xla = c.xla
        kept = (xla.argument + xla.output - xla.alias - c.host_state) // c.devices
        ratio = c.xla_device_bytes / c.bound if c.bound else float("inf")
        lines.append(f"{c.name:<16} {gib(c.persistent):>24} {gib(c.bound - c.persistent):>7} "
                     f"{gib(c.bound):>8} | {gib(kept):>31} {gib(xla.temp // c.devices):>12} "
                     f"{gib(c.xla_device_bytes):>6} | {ratio:.3f} "
                     f"{'bounded' if c.holds else 'ABOVE THE CLOSED FORM'}")
    if any(c.plan_program == "host" for c in checks):
        lines.append("(host_cpu_update: the host-CPU update on the CPU backend, one program for "
                     "the process's devices, per device, against the host's terms of it)")
    if any(c.host_state for c in checks):
        lines.append("(XLA:CPU counts the host-resident optimizer state as arguments and "
                     "outputs: left out above)")
    lines.append("the closed form bounds every program" if all(c.holds for c in checks) else
                 "XLA's plan is above the closed form here")
    device = [c for c in checks if c.plan_program != "host"]
    if plan.device_memory is not None and device:
        worst = max(device, key=lambda c: c.xla_device_bytes)
        fits = worst.xla_device_bytes <= plan.device_memory
        lines.append(f"verdict: {'fits' if fits else 'does NOT fit'}: XLA's plan "
                     f"{gib(worst.xla_device_bytes)} GiB ({worst.name}) of "
                     f"{gib(plan.device_memory)} GiB per device")
    return "\n".join(lines)


def compiled_fits(checks: list[ProgramCheck], device_memory: int | None) -> bool:
    """Whether XLA's plan of every device program fits ``device_memory``."""
    return device_memory is None or all(c.xla_device_bytes <= device_memory for c in checks
                                        if c.plan_program != "host")


@dataclasses.dataclass(frozen=True)
class Probe:
    """One context of ``largest``'s search."""

    context: int
    closed_form: int
    xla: int | None
    """XLA's plan of the largest program, bytes per device (None: not compiled)."""
    fits: bool
    seconds: float

    def line(self, device_memory: int) -> str:
        xla = ("not compiled: the closed form is past the device by more than its margin"
               if self.xla is None else f"XLA's plan {self.xla / GIB:.3f} GiB")
        return (f"context {self.context:>12,}: {xla}, closed form "
                f"{self.closed_form / GIB:.3f}, device {device_memory / GIB:.3f}: "
                f"{'fits' if self.fits else 'does not fit'} ({self.seconds:.1f} s)")


@dataclasses.dataclass(frozen=True)
class Largest:
    """``largest``'s answer."""

    context: int | None
    """The largest context whose compiled programs fit (None: not even the smallest)."""
    closed_form_context: int | None
    resolution: int
    """The answer is within this many tokens of the edge."""
    probes: tuple[Probe, ...]
    seconds: float

    @property
    def compiles(self) -> int:
        return sum(p.xla is not None for p in self.probes)


def largest(config: Config, num_devices: int, *, device_memory: int, host_memory: int,
            resolution: float = 0.02, log: Callable[[str], None] = lambda line: None
            ) -> Largest:
    """The largest context (a multiple of what the mesh and the attention kernel take) whose
    compiled programs fit ``device_memory``, by bisection over compiles, to ``resolution`` of
    it (and at least one unit); each probe is logged. The search starts between the closed
    form's largest context (XLA's plan is under the closed form there, by the margin's high)
    and the context where the closed form times the margin's low passes the device (past it
    nothing is compiled): the margin bounds where the edge can be."""
    started = time.perf_counter()
    platform, kind, stats = platform_of(), device_kind_of(), data_stats(config.data)

    def plan_at(context: int | None, search: bool = False, memory: int = device_memory) -> Plan:
        return make_plan(config, num_devices, context=context, device_memory=memory,
                         host_memory=host_memory, platform=platform, device_kind=kind,
                         data_stats=stats, baseline=False, search_context=search)

    closed = plan_at(None, search=True)
    _check_machine(closed, "--largest")
    low_margin, _ = closed.target.measured.margin.get("device", (1.0, 1.0))
    ceiling = plan_at(None, search=True, memory=int(device_memory / low_margin)).largest_context
    unit = context_unit(closed)
    probes: list[Probe] = []

    def fits(context: int) -> bool:
        began = time.perf_counter()
        plan = plan_at(context)
        if surely_too_large(plan):
            probe = Probe(context, plan.total_bytes, None, False, time.perf_counter() - began)
        else:
            checks = check(plan)
            xla = max(c.xla_device_bytes for c in checks if c.plan_program != "host")
            probe = Probe(context, plan.total_bytes, xla, xla <= device_memory,
                          time.perf_counter() - began)
        probes.append(probe)
        log(probe.line(device_memory))
        return probe.fits

    start = max(unit, (closed.largest_context or unit) // unit * unit)
    low, width = bisect_contexts(fits, start, unit, resolution,
                                 ceiling=None if ceiling is None else max(start, ceiling))
    return Largest(low, closed.largest_context, width, tuple(probes),
                   time.perf_counter() - started)


def bisect_contexts(fits: Callable[[int], bool], start: int, unit: int, resolution: float,
                    ceiling: int | None = None) -> tuple[int | None, int]:
    """(the largest multiple of ``unit`` that ``fits``, the width it is known within) for a
    monotone ``fits``: with a ``ceiling`` (past which nothing fits), bisection between
    ``start`` (taken to fit, checked at the end if the answer is it) and the ceiling; without,
    up from ``start`` by growing steps while it fits; down by quarters from where it does not;
    then bisection until the bracket is within ``resolution`` of the answer (and one unit).
    None where not even ``unit`` fits."""
    def round_down(context: int) -> int:
        return max(unit, context // unit * unit)

    low = high = None
    checked = False
    if ceiling is not None:
        low, high = start, round_down(ceiling) + unit
    elif fits(start):
        low, step, checked = start, start, True
        while high is None:
            step = round_down(step // 4)
            if fits(low + step):
                low += step
                step *= 8  # each fit widens the next step
            else:
                high = low + step
    else:
        high = start
    while True:
        while low is None and high > unit:  # down by quarters to a context that fits
            candidate = round_down(high * 3 // 4)
            if fits(candidate):
                low, checked = candidate, True
            else:
                high = candidate
        if low is None:
            return None, unit
        width = round_down(int(resolution * low))
        while high - low > width:
            middle = round_down((low + high) // 2)
            if middle <= low:
                break
            if fits(middle):
                low, checked = middle, True
            else:
                high = middle
        if checked or fits(low):
            return low, width
        low, high = None, low  # the start taken to fit did not: search below it


def context_unit(plan: Plan) -> int:
    """The step between contexts a plan's mesh and batch take: a multiple of mesh.seq whose
    tokens split over the devices, and of what the attention kernel trains."""
    knobs = plan.knobs
    step = knobs.seq * (knobs.num_devices // math.gcd(knobs.num_devices,
                                                      knobs.batch_size * knobs.seq))
    return math.lcm(step, sequence_multiple(knobs.attention))


def format_largest(config: Config, answer: Largest) -> str:
    """The search's last line: the answer, its resolution, the compiles and their time."""
    found = ("no context fits" if answer.context is None
             else f"{answer.context:,} tokens (within {answer.resolution:,})")
    closed = ("none" if answer.closed_form_context is None
              else f"{answer.closed_form_context:,}")
    return (f"largest context of {config.name} whose compiled programs fit: {found}; the "
            f"closed form's: {closed}; {answer.compiles} compiles in {answer.seconds:.1f} s")

