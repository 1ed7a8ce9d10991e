"""A plan of a configuration: ``make_plan``, the largest context that fits by the closed form,
the mesh split and the batch ``--auto`` searches. The search is a few thousand closed-form
evaluations and no compile; the largest context by compiles is ``train.preflight``'s."""

from __future__ import annotations

import dataclasses
import math

import jax

from peakflat_jax.config import Config, to_dict
from peakflat_jax.model.attention import sequence_multiple
from peakflat_jax.plan import host_pool
from peakflat_jax.plan.errors import PlanError
from peakflat_jax.plan.knobs import (
    block_choices,
    choose_knobs,
    chunk_choices,
    fits_with_resident,
    knobs_from_config,
)
from peakflat_jax.plan.operators import (
    capable_variants,
    choose_layer_loop,
    choose_operators,
    with_operators_on,
)
from peakflat_jax.plan.programs import Choice, Plan
from peakflat_jax.plan.rates import step_seconds
from peakflat_jax.plan.target import DataStats, Target
from peakflat_jax.plan.terms import Knobs, baseline_knobs, pinned_allocations, plan_terms

# ----------------------------------------------------------------------------------------------
# Plans.


def make_plan(config: Config, num_devices: int, *, context: int | None = None,
              device_memory: int | None = None, host_memory: int | None = None,
              platform: str = "gpu", device_kind: str | None = None,
              data_stats: DataStats | None = None, pinned_pool_limit_gib: int | None = None,
              auto: bool = False, rates=None, baseline: bool = True,
              search_context: bool = True) -> Plan:
    """The plan of ``config`` on ``num_devices`` devices of ``platform`` (and ``device_kind``:
    which measured constants apply) at ``context`` (default ``data.seq_len``), memories in
    bytes per device (None: unknown). ``data_stats``: the data's statistics
    (``train.data.data_stats``; None: none known). ``pinned_pool_limit_gib``: the pinned-host
    pool's cap the run has (None: the cap its config sets, planned; ``Plan.pinned_pool_cap_gib``
    is the cap to set). ``rates``: the step estimate's (None: the measured entry's). Null
    knobs are filled (and, with ``auto``, every knob is chosen: with ``context`` given, for the
    most tokens per step; without, for the longest context). ``baseline``: also plan the same
    model and mesh with the four operators off. ``search_context``: also find the largest
    context that fits (needs ``device_memory``)."""
    if platform not in ("gpu", "cpu"):
        raise PlanError(f"platform: expected 'gpu' or 'cpu', got {platform!r}")
    for name, value in (("device_memory", device_memory), ("host_memory", host_memory)):
        if value is not None and (isinstance(value, bool) or value <= 0):
            raise PlanError(f"{name}: expected a positive number of bytes, got {value!r}")
    target = Target(platform=platform, device_kind=device_kind,
                    data=DataStats() if data_stats is None else data_stats,
                    pinned_pool_limit_gib=pinned_pool_limit_gib, rates=rates,
                    jax_version=jax.__version__)
    return plan_for(config, num_devices, target, context=context, device_memory=device_memory,
                    host_memory=host_memory, auto=auto, baseline=baseline,
                    search_context=search_context)


def plan_for(config: Config, num_devices: int, target: Target, *, context: int | None = None,
             device_memory: int | None = None, host_memory: int | None = None,
             auto: bool = False, baseline: bool = True, search_context: bool = True) -> Plan:
    """``make_plan`` on a ``Target`` made already."""
    choices: list[Choice] = []
    config_in = config
    lighter: tuple[Config, ...] = ()
    # The largest context is searched with the auto operators on (those that trade the
    # device's memory for the host's at each setting, capable_variants): where the context
    # needs them, auto turns them on.
    capable = with_operators_on(config)
    if auto:  # every knob is searched from the operators on
        config = capable
        config, mesh_choices, context = _auto_layout(config, num_devices, context,
                                                     device_memory, host_memory, target)
        choices += mesh_choices
    else:
        config, operator_choices, lighter = choose_operators(
            config, num_devices, context=context, device_memory=device_memory,
            host_memory=host_memory, target=target)
        choices += operator_choices
    if config.optimizer.resident_groups and config.operators.optimizer_offload is not True:
        choices.append(Choice(
            "optimizer.resident_groups", config.optimizer.resident_groups,
            "no effect: the optimizer is not streamed here (operators.optimizer_offload: "
            f"{config.operators.optimizer_offload}), its whole state is on the device"))
    knobs = knobs_from_config(config, num_devices, context=context, platform=target.platform)
    knobs, knob_choices = choose_knobs(config, knobs, target, device_memory, host_memory,
                                       auto=auto)
    choices += knob_choices
    config, loop_choices = choose_layer_loop(config, knobs, target.platform)
    choices += loop_choices
    terms = tuple(plan_terms(config, knobs, target))
    largest = base = None
    if search_context and device_memory is not None:
        if capable is config or auto:
            largest = largest_context(config, num_devices, target, device_memory=device_memory,
                                      host_memory=host_memory, knobs=knobs, auto=auto)
        else:
            found = [largest_context(variant, num_devices, target, device_memory=device_memory,
                                     host_memory=host_memory)
                     for variant in capable_variants(config_in)]
            largest = max((c for c in found if c is not None), default=None)
    if baseline:
        base_config = config.replace(operators=to_dict(config.operators.all_off))
        base_knobs = baseline_knobs(knobs)
        base_terms = tuple(plan_terms(base_config, base_knobs, target))
        base_largest = None
        if search_context and device_memory is not None:
            base_largest = largest_context(base_config, num_devices, target,
                                           device_memory=device_memory,
                                           host_memory=host_memory, knobs=base_knobs)
        base = Plan(base_config, base_knobs, target, base_terms, device_memory, host_memory,
                    operators_on=False, largest_context=base_largest)
    return Plan(config, knobs, target, terms, device_memory, host_memory, True,
                tuple(choices), base, largest, step_seconds(config, knobs, target),
                pinned_pool_cap(config, knobs, target, terms), lighter)


def pinned_pool_cap(config: Config, knobs: Knobs, target: Target, terms) -> int | None:
    """The pinned-host pool's cap a run of this plan has: the target's where given; else, on
    a GPU whose config caps the pool from its plan (``device.pinned_host_pool: planned``), the
    cap of the plan's pinned arrays (``host_pool.planned_limit_gib``); else None (XLA's
    own)."""
    if target.pinned_pool_limit_gib is not None:
        return target.pinned_pool_limit_gib
    if target.platform != "gpu" or not host_pool.planned_cap_applies(config):
        return None
    pinned = pinned_allocations(knobs, terms)
    return host_pool.planned_limit_gib(pinned) if pinned else None


def largest_context(config: Config, num_devices: int, target: Target, *, device_memory: int,
                    host_memory: int | None = None, knobs: Knobs | None = None,
                    auto: bool = False) -> int | None:
    """The largest context (a multiple of mesh.seq, and of what the attention kernel trains:
    ``model.attention.sequence_multiple``) whose step fits, at the batch size of
    ``knobs`` (default the config's): with the knobs' fixed settings and null knobs at their
    lightest (with ``auto``: every knob at its lightest), and the streamed optimizer's resident
    groups, left null, as many as the device holds (``most_resident``: each one moves its state
    from the host to the device, so none is not the lightest for both; the device's count is
    the host's best too). None when none fits."""
    if knobs is None:
        knobs = knobs_from_config(config, num_devices, platform=target.platform)
    step = knobs.seq * (knobs.num_devices // math.gcd(knobs.num_devices,
                                                      knobs.batch_size * knobs.seq))
    step = math.lcm(step, sequence_multiple(knobs.attention))

    def fits(context: int) -> bool:
        k = knobs_from_config(config, num_devices, context=context,
                              batch_size=knobs.batch_size, platform=target.platform)
        k = dataclasses.replace(k, data=knobs.data, seq=knobs.seq)
        return fits_with_resident(config, _lightest(config, k, auto), target, device_memory,
                                  host_memory)

    return _largest_multiple(fits, step, most=2**40 // step)


def _largest_multiple(fits, unit: int, *, most: int) -> int | None:
    """The largest multiple of ``unit`` that ``fits`` (monotone: a fit implies every smaller
    one fits), by doubling then bisection; None when ``unit`` does not fit. The doubling stops
    once it passes ``most`` multiples and answers the last that fit."""
    if not fits(unit):
        return None
    low, high = 1, 2
    while fits(high * unit):
        low, high = high, high * 2
        if high > most:
            return low * unit
    while high - low > 1:
        middle = (low + high) // 2
        if fits(middle * unit):
            low = middle
        else:
            high = middle
    return low * unit


def _lightest(config: Config, knobs: Knobs, auto: bool) -> Knobs:
    """Every knob that is chosen (null, or all with auto) at its lightest setting."""
    ops, model = config.operators, config.model
    n = knobs.tokens_per_device
    if knobs.moe_dispatch == "pipelined" and (auto or ops.token_budget is None):
        chunks = chunk_choices(n, knobs.max_chunks, auto)[-1]
        knobs = dataclasses.replace(knobs, token_budget=-(-n // chunks),
                                    max_chunks=max(chunks, knobs.max_chunks))
    if knobs.loss == "ring" and (auto or ops.vocab_block is None):
        knobs = dataclasses.replace(knobs, vocab_block=block_choices(config, knobs)[-1])
    if auto:
        knobs = dataclasses.replace(knobs, offload=(True,) * model.num_layers)
        if config.optimizer.update_on != "host_cpu":  # its state is in host memory already
            knobs = dataclasses.replace(knobs, optimizer_offload=True, optimizer_overlap=False,
                                        bucket_params=min(knobs.bucket_params, 1_000_000),
                                        slots=2,
                                        # null: none, the lightest on the device (the
                                        # searches fill it: most_resident); else as set
                                        resident_groups=config.optimizer.resident_groups or 0)
    return knobs


def _auto_layout(config: Config, num_devices: int, context: int | None, device_memory,
                 host_memory, target: Target) -> tuple[Config, list[Choice], int | None]:
    """--auto's mesh split (and, at a given context, the batch size): for each data x seq
    split that divides the model, the longest context (or the most sequences at ``context``)
    whose lightest setting fits; ties go to more data parallelism (fewer Ulysses exchanges).
    Where no batch fits at ``context``, the split with the longest context that fits and the
    config's batch: the plan then says that nothing fits, and the largest context that
    does."""
    model = config.model
    splits = [(d, num_devices // d) for d in range(1, num_devices + 1) if num_devices % d == 0
              and model.num_heads % (num_devices // d) == 0]
    if not splits:
        raise PlanError(f"devices: no data x seq split of {num_devices} devices divides "
                        f"model.num_heads = {model.num_heads}")
    best = None
    for data, seq in splits:
        candidate = config.replace(mesh={"data": data, "seq": seq})
        if context is None:
            batch = -(-config.data.batch_size // data) * data
            candidate = candidate.replace(data={"batch_size": batch})
            if device_memory is None:
                score = (config.data.seq_len, data)
                chosen_context = None
            else:
                knobs = _safe_knobs(candidate, num_devices, None, batch, target.platform)
                if knobs is None:
                    continue
                found = largest_context(candidate, num_devices, target,
                                        device_memory=device_memory, host_memory=host_memory,
                                        knobs=knobs, auto=True)
                if found is None:
                    continue
                score, chosen_context = (found, data), found
        else:
            batch = _largest_batch(candidate, num_devices, context, data, device_memory,
                                   host_memory, target)
            if batch is None:
                continue
            candidate = candidate.replace(data={"batch_size": batch})
            score, chosen_context = (batch, data), context
        if best is None or score > best[0]:
            best = (score, candidate, data, seq, chosen_context)
    if best is None and context is not None:
        chosen, _, _ = _auto_layout(config, num_devices, None, device_memory, host_memory,
                                    target)
        split = f"{chosen.mesh.data} x {chosen.mesh.seq}"
        return chosen, [Choice("mesh.data x mesh.seq", split,
                               f"no split fits a sequence of {context:,} tokens: the split "
                               f"with the longest context that fits")], context
    if best is None:  # the config's own split, which the plan then says does not fit
        split = f"{config.mesh.data} x {config.mesh.seq}"
        return config, [Choice("mesh.data x mesh.seq", split,
                               "no split fits any context, even with every operator at its "
                               "lightest: the config's")], None
    _, chosen, data, seq, chosen_context = best
    why = ("the split with the longest context that fits (ties: more data parallelism, fewer "
           "Ulysses exchanges)" if context is None else
           "the split with the most tokens per step at this context (ties: more data "
           "parallelism)")
    choices = [Choice("mesh.data x mesh.seq", f"{data} x {seq}", why)]
    if context is not None:
        choices.append(Choice("data.batch_size", chosen.data.batch_size,
                              "the most sequences whose lightest setting fits"))
    elif chosen_context is not None:
        choices.append(Choice("data.seq_len", chosen_context, "the longest context that fits"))
    return chosen, choices, chosen_context if context is None else context


def _safe_knobs(config, num_devices, context, batch, platform) -> Knobs | None:
    try:
        return knobs_from_config(config, num_devices, context=context, batch_size=batch,
                                 platform=platform)
    except PlanError:
        return None


def _largest_batch(config, num_devices, context, data, device_memory, host_memory,
                   target: Target) -> int | None:
    """The most sequences (a multiple of data) whose lightest setting fits at ``context`` (its
    resident groups as the plan fills them: ``fits_with_resident``)."""
    def fits(batch):
        knobs = _safe_knobs(config, num_devices, context, batch, target.platform)
        return knobs is not None and (device_memory is None or fits_with_resident(
            config, _lightest(config, knobs, True), target, device_memory, host_memory))

    if device_memory is None:
        batch = -(-config.data.batch_size // data) * data
        return batch if fits(batch) else None
    return _largest_multiple(fits, data, most=2**20)
