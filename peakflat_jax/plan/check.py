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
CPU tests do; on a GPU XLA's figures are taken as they are. With the optimizer on the host CPU
(``optimizer.update_on: host_cpu``) its update is a program of the CPU backend, held to the
host terms XLA plans for it (the state and the update's transit, ``HOST_UPDATE_TERMS``); the
host's other terms (the copy between clients, the runtime) are no program's.
"""

from __future__ import annotations

import dataclasses

import jax

from peakflat_jax.memory import CompiledMemory, compiled_memory

# Which of the plan's programs each compiled program is held to.
PLAN_PROGRAM = {"train_step": "gradient", "gradient_step": "gradient",
                "overlapped_step": "overlapped", "optimizer_step": "optimizer_step",
                "host_cpu_update": "host"}
HOST_UPDATE_TERMS = ("host.cpu_adamw_state", "host.cpu_adamw_transit", "host.cpu_adamw_scalars")
"""The host terms of the host-CPU update's own program, per device: its arguments (state,
gradients), temporaries and scalars, the outputs aliased (``optim.host_cpu_adamw``). The one
program updates the shards of the process's W devices: XLA's plan of it is held to W times
these (``ProgramCheck.devices``)."""


@dataclasses.dataclass(frozen=True)
class ProgramCheck:
    """One compiled program against the plan's program it is held to."""

    name: str
    plan_program: str
    bound: int
    """The closed form's bytes of that program (the device's, or for the host-CPU update the
    host's ``HOST_UPDATE_TERMS``)."""
    persistent: int
    """The part of ``bound`` that persists across steps (the persistent terms; the host
    update's state)."""
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
    if trainer.host_cpu_optimizer:
        compiled["host_cpu_update"] = trainer.optimizer.lower(state.params,
                                                              state.opt_state).compile()
    host_state = 0
    if local == "cpu" and trainer.offloaded_optimizer:
        host_state = sum(leaf.addressable_shards[0].data.nbytes
                         for leaf in jax.tree.leaves(state.opt_state)
                         if getattr(leaf.sharding, "memory_kind", None) == "pinned_host")
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
        kept = (terms["host.cpu_adamw_state"].bytes if role == "host" else persistent)
        checks.append(ProgramCheck(name, role, programs[role], kept, compiled_memory(program),
                                   held, jax.local_device_count() if role == "host" else 1))
    return checks


def format_checks(plan, checks: list[ProgramCheck]) -> str:
    """The table: each program's closed form beside XLA's plan, persistent and transient."""
    from peakflat_jax.plan.errors import GIB

    def gib(value: int) -> str:
        return f"{value / GIB:.3f}"

    lines = [f"XLA's plan of {plan.config.name}'s programs on this machine against the closed "
             f"form (GiB per device):",
             "program          plan: persistent  rest    total | XLA: arguments+outputs-aliases"
             "  temporaries  total | ratio"]
    for check in checks:
        xla = check.xla
        kept = (xla.argument + xla.output - xla.alias - check.host_state) // check.devices
        ratio = check.xla_device_bytes / check.bound if check.bound else float("inf")
        lines.append(f"{check.name:<16} {gib(check.persistent):>17} "
                     f"{gib(check.bound - check.persistent):>7} "
                     f"{gib(check.bound):>8} | {gib(kept):>31} "
                     f"{gib(xla.temp // check.devices):>12} "
                     f"{gib(check.xla_device_bytes):>6} | {ratio:.3f} "
                     f"{'holds' if check.holds else 'ABOVE THE BOUND'}")
    if any(c.plan_program == "host" for c in checks):
        lines.append("(host_cpu_update: the host-CPU update on the CPU backend, one program for "
                     "the process's devices, per device, against the host's terms of it)")
    if any(c.host_state for c in checks):
        lines.append("(XLA:CPU counts the host-resident optimizer state as arguments and "
                     "outputs: left out above)")
    verdict = ("the closed form bounds every program" if all(c.holds for c in checks) else
               "XLA's plan is above the closed form: the bound does not hold on this machine")
    return "\n".join([*lines, verdict])
