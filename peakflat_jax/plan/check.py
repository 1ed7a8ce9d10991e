"""``peakflat plan CONFIG --check``: the closed form held to XLA's plan of what the trainer
compiles, on this machine.

The planner's bound is a formula over static sizes; what a device holds is what XLA's compiler
plans for the trainer's programs, and that depends on the platform (XLA:GPU and XLA:CPU plan
the same program differently, docs/plan.md). So on the machine a config targets, ``--check``
builds the trainer, makes its state, compiles every program a step runs (no step is run) and
prints, per program, the closed form beside XLA's plan: what persists (the plan's persistent
terms against XLA's arguments and outputs, less what they alias) and what is transient (the
rest of the terms against XLA's temporaries). It fails when XLA's plan of any program is above
the closed form's: the bound does not hold here, and a run the planner approves may not fit.

On XLA:CPU the host-resident optimizer state counts among a program's arguments and outputs
(the memory kinds lower to nothing there), so it is left out of the device's share, as the
CPU tests do; on a GPU XLA's figures are taken as they are.
"""

from __future__ import annotations

import dataclasses

import jax

from peakflat_jax.memory import CompiledMemory, compiled_memory

# Which of the plan's programs each compiled program is held to.
PLAN_PROGRAM = {"train_step": "gradient", "gradient_step": "gradient",
                "overlapped_step": "overlapped", "optimizer_step": "optimizer_step"}


@dataclasses.dataclass(frozen=True)
class ProgramCheck:
    """One compiled program against the plan's program it is held to."""

    name: str
    plan_program: str
    bound: int
    """The closed form's device bytes of that program."""
    xla: CompiledMemory
    host_state: int
    """Host-resident state that XLA:CPU counted as arguments and outputs (0 elsewhere)."""

    @property
    def xla_device_bytes(self) -> int:
        return self.xla.total - self.host_state

    @property
    def holds(self) -> bool:
        return self.xla_device_bytes <= self.bound


def check_plan_against_xla(plan) -> list[ProgramCheck]:
    """Compiles the trainer's programs for ``plan``'s config on this machine and holds each to
    the plan's program of the same role. Raises PlanError where the plan is for another
    machine (platform or device count)."""
    from peakflat_jax.plan.errors import PlanError
    from peakflat_jax.train.trainer import Trainer

    local = jax.devices()[0].platform
    local = "gpu" if local in ("gpu", "cuda", "rocm") else local
    planned = plan.knobs.data * plan.knobs.seq
    if plan.platform != local or planned != len(jax.devices()):
        raise PlanError(f"--check: compiles on this machine ({len(jax.devices())} {local} "
                        f"devices), and the plan is for {planned} "
                        f"{plan.platform} devices; run it on the machine the config targets")
    trainer = Trainer(plan.filled_config(), run_dir="unused")
    state = trainer.initial_state()
    batch = trainer.global_batch(next(trainer.batches))
    trainer.compile(state, batch)
    compiled = {name: getattr(trainer, "_" + name) for name in
                ("train_step", "gradient_step", "overlapped_step") if hasattr(trainer, "_" + name)}
    if trainer.offloaded_optimizer:
        compiled["optimizer_step"] = trainer.optimizer.lower(state.params,
                                                             state.opt_state).compile()
    host_state = 0
    if local == "cpu" and trainer.offloaded_optimizer:
        host_state = sum(leaf.addressable_shards[0].data.nbytes
                         for leaf in jax.tree.leaves(state.opt_state)
                         if getattr(leaf.sharding, "memory_kind", None) == "pinned_host")
    programs = plan.programs
    checks = []
    for name, program in compiled.items():
        role = PLAN_PROGRAM[name]
        # The gradient program's arguments and outputs hold no optimizer state; the updates
        # donate it, so their outputs alias their arguments: it counts once.
        held = 0 if name == "gradient_step" else host_state
        checks.append(ProgramCheck(name, role, programs[role], compiled_memory(program),
                                   held))
    return checks


def format_checks(plan, checks: list[ProgramCheck]) -> str:
    """The table: each program's closed form beside XLA's plan, persistent and transient."""
    from peakflat_jax.plan.errors import GIB

    by_live: dict[str, int] = {}
    for term in plan.terms:
        by_live[term.live] = by_live.get(term.live, 0) + term.bytes
    persistent = by_live.get("persistent", 0)

    def gib(value: int) -> str:
        return f"{value / GIB:.3f}"

    lines = [f"XLA's plan of {plan.config.name}'s programs on this machine against the closed "
             f"form (GiB per device):",
             "program          plan: persistent  rest    total | XLA: arguments+outputs-aliases"
             "  temporaries  total | ratio"]
    for check in checks:
        xla = check.xla
        kept = xla.argument + xla.output - xla.alias - check.host_state
        ratio = check.xla_device_bytes / check.bound if check.bound else float("inf")
        lines.append(f"{check.name:<16} {gib(persistent):>17} {gib(check.bound - persistent):>7} "
                     f"{gib(check.bound):>8} | {gib(kept):>31} {gib(xla.temp):>12} "
                     f"{gib(check.xla_device_bytes):>6} | {ratio:.3f} "
                     f"{'holds' if check.holds else 'ABOVE THE BOUND'}")
    if any(c.host_state for c in checks):
        lines.append("(XLA:CPU counts the host-resident optimizer state as arguments and "
                     "outputs: left out above)")
    verdict = ("the closed form bounds every program" if all(c.holds for c in checks) else
               "XLA's plan is above the closed form: the bound does not hold on this machine")
    return "\n".join([*lines, verdict])
