"""``operators: auto``: which of the four operators a run pays for.

Each operator bounds one peak and costs something where that peak does not bind: PipelinedLLEP
its extra chunks, SCO its boundary copies, OffloadStreamAdamW its host traffic, Ring-DTP a
schedule of strips. So an operator left ``auto`` is turned on only where the run needs it: of
every setting of the ``auto`` switches (``CHOICES``; the forced ones stay as given), the planner
takes those whose step fits the device's and the host's memory at the run's context, and of
them the one with the shortest estimated step (``plan.rates.step_seconds``), ties going to the
fewest operators on. Where the standard stack fits, that is all off: nothing is paid for. Where
none fits, it is the setting with the smallest peak (ties going to the most operators on), and
the reason says so. With the device's memory unknown, nothing binds: all off.

The closed form chooses; the compile confirms. The plan lists the settings lighter than the
chosen one by the closed form, fastest first (``Plan.lighter``): where XLA's plan of the chosen
setting does not fit the device, the trainer compiles the next
(``train.trainer.fitting_trainer``).

The host-CPU optimizer (``optimizer.update_on: host_cpu``, ZeRO-Offload's placement) is not one
of the choices: it is the standard stack's answer to the optimizer's peak, taken only where a
user sets it, and with it the streamed optimizer is off (``resolve_host_cpu``): its state is
already in host memory, updated there.
"""

from __future__ import annotations

import itertools

from peakflat_jax.config import Config
from peakflat_jax.plan.knobs import choose_knobs, knobs_from_config
from peakflat_jax.plan.programs import Choice, Plan
from peakflat_jax.plan.rates import step_seconds
from peakflat_jax.plan.target import Target
from peakflat_jax.plan.terms import layer_loop, plan_terms

CHOICES = {"moe_dispatch": ("ep", "pipelined"), "loss": ("materialized", "ring"),
           "offload": ("none", "all"), "optimizer_offload": (False, True)}
"""Each switch's settings, off first."""

ON = {name: values[1] for name, values in CHOICES.items()}
"""Every operator on: what ``--auto``'s knob search starts from."""


HOST_TRADING = ("offload", "optimizer_offload")
"""The switches that move a peak from the device to the host: on, they cost host memory, so the
lightest setting for the device is not the lightest for the host."""


def capable_variants(config: Config) -> list[Config]:
    """The settings of a config's ``auto`` operators among which its largest context is
    searched: the operators that cost only time on (``ON``), each ``HOST_TRADING`` one at each
    of its settings, and every ``auto`` operator off. Every setting ``choose_operators`` could
    take at a context that fits is at most as light as one of the first on both memories
    (offloading trades the device for the host, so neither end is the lightest for both), or
    is the standard stack, which can be the lightest where the others' extra terms (the
    overlapped step's second copy of the MoE weights) outweigh what they save. The largest
    context of these is the largest at which ``auto`` finds a setting that fits."""
    config, _ = resolve_host_cpu(config)
    auto = config.operators.chosen_by_planner
    on = {name: ON[name] for name in auto if name not in HOST_TRADING}
    trading = [name for name in HOST_TRADING if name in auto]
    variants = [config.replace(operators={**on, **dict(zip(trading, values))})
                for values in itertools.product(*(CHOICES[name] for name in trading))]
    off = config.replace(operators={name: CHOICES[name][0] for name in auto})
    return variants + ([off] if off not in variants else [])


def resolve_host_cpu(config: Config) -> tuple[Config, list[Choice]]:
    """With ``optimizer.update_on: host_cpu``, ``operators.optimizer_offload: auto`` resolved to
    false (the state is in host memory and the host CPU updates it: nothing to stream), and the
    Choice that says so; any other config as it is."""
    if (config.optimizer.update_on != "host_cpu"
            or config.operators.optimizer_offload != "auto"):
        return config, []
    return config.replace(operators={"optimizer_offload": False}), [Choice(
        "operators.optimizer_offload", False,
        "optimizer.update_on: host_cpu: the state is in host memory and the host CPU updates it "
        "(the standard stack's placement), so nothing is streamed")]


def with_operators_on(config: Config) -> Config:
    """The config with its ``auto`` operators on (``ON``; the streamed optimizer off with
    ``optimizer.update_on: host_cpu``, ``resolve_host_cpu``)."""
    config, _ = resolve_host_cpu(config)
    auto = config.operators.chosen_by_planner
    return config.replace(operators={name: ON[name] for name in auto}) if auto else config


def choose_operators(config: Config, num_devices: int, *, context: int | None,
                     device_memory: int | None, host_memory: int | None, target: Target
                     ) -> tuple[Config, list[Choice], tuple[Config, ...]]:
    """The config with its ``auto`` operators chosen (module doc), one Choice per switch
    saying why, and the settings lighter than the chosen one by the closed form, fastest
    first (what to compile next where the chosen one's compiled program does not fit)."""
    config, resolved = resolve_host_cpu(config)
    auto = config.operators.chosen_by_planner
    if not auto:
        return config, resolved, ()
    candidates = []
    for values in itertools.product(*(CHOICES[name] for name in auto)):
        chosen = dict(zip(auto, values))
        candidate = config.replace(operators=chosen)
        knobs = knobs_from_config(candidate, num_devices, context=context,
                                  platform=target.platform)
        knobs, _ = choose_knobs(candidate, knobs, target, device_memory, host_memory,
                                auto=False)
        # Scored with its layer loop as it will be resolved (choose_layer_loop); returned with
        # the loop still auto, for make_plan to name.
        scored, _ = choose_layer_loop(candidate, knobs, target.platform)
        terms = plan_terms(scored, knobs, target)
        plan = Plan(scored, knobs, target, tuple(terms), device_memory, host_memory,
                    step_seconds=step_seconds(scored, knobs, target))
        switched_on = sum(value != CHOICES[name][0] for name, value in chosen.items())
        candidates.append((plan, chosen, switched_on, candidate))
    fitting = [c for c in candidates if c[0].feasible is not False]
    if fitting:
        plan, chosen, _, candidate = min(fitting, key=lambda c: (c[0].step_seconds, c[2]))
    else:
        plan, chosen, _, candidate = min(candidates, key=lambda c: (c[0].total_bytes, -c[2]))
    off = next(c[0] for c in candidates if c[2] == 0)
    on = next(c[0] for c in candidates if c[2] == len(auto))
    lighter = sorted((c for c in candidates if c[0].total_bytes < plan.total_bytes
                      and c[0].fits_host is not False),
                     key=lambda c: (c[0].step_seconds, c[2]))
    return candidate, resolved + [Choice(f"operators.{name}", value,
                                         _why(name, value, plan, off, bool(fitting), on))
                                  for name, value in chosen.items()], tuple(
        c[3] for c in lighter)


def choose_layer_loop(config: Config, knobs, platform: str) -> tuple[Config, list[Choice]]:
    """``operators.layer_loop: auto`` resolved for a config whose operators are chosen
    (``terms.layer_loop``: ``unrolled`` where the offloaded optimizer's update runs inside the
    next step's forward on a GPU, else ``scan``), and the Choice that says why. The loop is
    chosen for time, never for memory. ``knobs``: the plan's."""
    if config.operators.layer_loop != "auto":
        return config, []
    loop = layer_loop(config, knobs.optimizer_overlap, platform)
    why = ("chosen: the offloaded optimizer's stream overlaps the forward only in straight-line "
           "code (compile time grows with depth)" if loop == "unrolled"
           else "chosen: no optimizer stream to overlap here; one layer compiled whatever the "
                "depth")
    return config.replace(operators={"layer_loop": loop}), [Choice("operators.layer_loop",
                                                                   loop, why)]


def describe(choices) -> str | None:
    """One line for a run's banner: the ``auto`` operators' settings and why, or None."""
    chosen = [c for c in choices if c.key.removeprefix("operators.") in CHOICES
              and c.why.startswith("auto: ")]
    if not chosen:
        return None
    settings = ", ".join(f"{c.key.removeprefix('operators.')} {c.value}" for c in chosen)
    return f"operators chosen by the planner: {settings}: {chosen[0].why.split('; ', 1)[1]}"


def _why(name: str, value, plan: Plan, off: Plan, fits: bool, on: Plan) -> str:
    """``auto: on|off; the reason``, the reason shared by every switch of the choice (``off``,
    ``on``: the plans with every ``auto`` operator off, on)."""
    gib = 2**30
    memory = ("" if plan.device_memory is None
              else f" of {plan.device_memory / gib:.1f} GiB")
    state = "off" if value == CHOICES[name][0] else "on"
    if not fits and on is plan:
        reason = (f"no setting fits, so every auto operator is on, the smallest peak "
                  f"({plan.total_bytes / gib:.1f} GiB{memory})")
    elif not fits:
        reason = (f"no setting fits, so the one with the smallest peak is taken "
                  f"({plan.total_bytes / gib:.1f} GiB{memory}; with every auto operator on "
                  f"{on.total_bytes / gib:.1f} GiB)")
    elif off is plan:
        reason = (f"nothing binds (the standard stack's peak {off.total_bytes / gib:.1f} "
                  f"GiB{memory} fits)")
    else:
        reason = (f"the fastest estimated setting that fits ({plan.total_bytes / gib:.1f} "
                  f"GiB{memory}, {plan.step_seconds:.3f} s; the standard stack needs "
                  f"{off.total_bytes / gib:.1f} GiB"
                  f"{'' if off.feasible is not False else ' and does not fit'})")
    return f"auto: {state}; {reason}"
