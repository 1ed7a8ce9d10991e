"""The knobs: from the config, nulls filled, or all chosen (``--auto``).

A knob left null in a config (``operators.token_budget``, ``operators.vocab_block``,
``optimizer.resident_groups``) is filled by the rule ``--auto`` uses for it: the fewest chunks,
then the largest vocab block, that fit (memory falls and time rises with chunks), and with the
optimizer streamed on a GPU the most groups whose state fits on the device
(``most_resident``); with the device's memory unknown, the tightest setting the config allows.
``--auto`` re-chooses all of them with the offloaded boundaries, the optimizer's placement,
its bucket size and slots: of the settings that fit, the fastest by the step estimate
(``rates.step_seconds``)."""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from peakflat_jax import mesh as mop
from peakflat_jax.config import Config, ConfigError, optimizer_groups
from peakflat_jax.model.attention import (
    check_sequence_length,
    choose_implementation,
    xla_only_fields,
)
from peakflat_jax.ops.sco import HostBudget
from peakflat_jax.plan.errors import PlanError
from peakflat_jax.plan.programs import Choice, fits_in_memory
from peakflat_jax.plan.rates import step_seconds
from peakflat_jax.plan.target import Target
from peakflat_jax.plan.terms import MOST_CHUNKS, SMALLEST_VOCAB_BLOCK, Knobs, overlaps_optimizer


def knobs_from_config(config: Config, num_devices: int, *, context: int | None = None,
                      batch_size: int | None = None, platform: str = "gpu") -> Knobs:
    """The config's knobs on ``num_devices`` devices (nulls not yet filled); raises PlanError
    or ConfigError naming what does not divide."""
    ops, model = config.operators, config.model
    if ops.chosen_by_planner:
        raise PlanError(f"operators: {', '.join(ops.chosen_by_planner)} still auto; "
                        f"plan.make_plan chooses them")
    num_devices = _positive("devices", num_devices)
    context = _positive("context", config.data.seq_len if context is None else context)
    batch_size = _positive("batch_size", config.data.batch_size if batch_size is None
                           else batch_size)
    data, seq = mop.mesh_shape(config.mesh, num_devices)
    _check_divides(config, data, seq, context, batch_size)
    try:
        attention = choose_implementation(ops.attention, platform, model.dtype,
                                          xla_only=xla_only_fields(model))
    except ValueError as error:
        raise ConfigError(f"operators.attention: {error}") from None
    try:
        check_sequence_length(attention, context)
    except ValueError as error:  # named as it was given: the config's, or --context
        given = "data.seq_len" if config.data.seq_len == context else "context"
        raise PlanError(f"{given}: {error}") from None
    knobs = Knobs(data=data, seq=seq, batch_size=batch_size, context=context,
                  moe_dispatch=ops.moe_dispatch, token_budget=ops.token_budget,
                  max_chunks=ops.max_chunks, loss=ops.loss, loss_mode=ops.loss_mode,
                  vocab_block=ops.vocab_block, offload=(False,) * model.num_layers,
                  optimizer_offload=ops.optimizer_offload,
                  optimizer_overlap=overlaps_optimizer(config),
                  bucket_params=config.optimizer.bucket_params, slots=config.optimizer.slots,
                  attention=attention,
                  # null (chosen by choose_knobs): none until then, the lightest on the device
                  resident_groups=(config.optimizer.resident_groups or 0)
                  if ops.optimizer_offload is True else 0)
    return dataclasses.replace(knobs, offload=offload_flags(config, knobs.tokens_per_device))


def offload_flags(config: Config, tokens_per_device: int) -> tuple[bool, ...]:
    """``operators.offload`` as L bools: a host budget (GiB per device) takes as many leading
    boundaries as it holds, N * H * b each."""
    chosen = offload_count(config)
    layers = config.model.num_layers
    if isinstance(chosen, HostBudget):
        boundary = tokens_per_device * config.model.hidden * jnp.dtype(
            config.model.dtype).itemsize
        count = min(layers, chosen.bytes // boundary)
        return tuple(i < count for i in range(layers))
    if isinstance(chosen, tuple):
        return chosen
    return tuple(i < chosen for i in range(layers))


def _positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PlanError(f"{name}: expected a positive integer, got {value!r}")
    return value


def _check_divides(config: Config, data: int, seq: int, context: int, batch_size: int):
    model, width = config.model, data * seq
    if batch_size % data:
        raise PlanError(f"batch size: {batch_size} sequences do not split over mesh.data = "
                        f"{data}")
    if context % seq:
        raise PlanError(f"context: {context} tokens do not split over mesh.seq = {seq} "
                        f"(each device holds context / seq tokens of a sequence)")
    if model.num_heads % seq:
        raise PlanError(f"model.num_heads: {model.num_heads} heads do not split over mesh.seq "
                        f"= {seq} (Ulysses attention gives each device num_heads / seq heads)")
    if model.num_experts % width:
        raise PlanError(f"model.num_experts: {model.num_experts} experts do not split over the "
                        f"{width} devices (expert parallelism over all of them)")


def choose_knobs(config: Config, knobs: Knobs, target: Target, device_memory: int | None,
                 host_memory: int | None, *, auto: bool) -> tuple[Knobs, list[Choice]]:
    """The knobs with nulls (every knob, with ``auto``) chosen: the fastest estimated setting
    that fits; with the device's memory unknown, the lightest setting the config allows. An
    explicit ``optimizer.resident_groups`` stays as given, with ``auto`` too (the rest is
    searched around it); left null it is ``most_resident``'s."""
    ops, model = config.operators, config.model
    rates = target.step_rates
    choices: list[Choice] = []
    n = knobs.tokens_per_device
    pipelined = knobs.moe_dispatch == "pipelined" and model.num_layers > model.num_dense_layers
    ring = knobs.loss == "ring"
    choose_budget = pipelined and (auto or ops.token_budget is None)
    choose_block = ring and (auto or ops.vocab_block is None)
    chunk_options = chunk_choices(n, knobs.max_chunks, auto) if choose_budget else [None]
    block_options = block_choices(config, knobs) if choose_block else [knobs.vocab_block]
    offload_options = (list(range(model.num_layers + 1)) if auto else [knobs.num_offloaded])
    has_moe = model.num_layers > model.num_dense_layers
    # The host-CPU optimizer (optimizer.update_on: host_cpu) keeps its state in host memory: the
    # streamed one is never an option beside it.
    host_cpu = config.optimizer.update_on == "host_cpu"
    may_stream = not host_cpu
    optimizer_options = ([(False, False)] + ([(True, False)] if may_stream else [])
                         + ([(True, True)] if has_moe and may_stream else [])
                         if auto else [(knobs.optimizer_offload, knobs.optimizer_overlap)])

    def with_chunks(k: Knobs, chunks):
        if chunks is None:
            return k
        return dataclasses.replace(k, token_budget=-(-n // chunks),
                                   max_chunks=max(chunks, k.max_chunks if not auto else chunks))

    def with_offload(k: Knobs, count):
        if not auto:
            return k
        return dataclasses.replace(k, offload=tuple(i < count for i in range(model.num_layers)))

    def buckets_for(k: Knobs) -> list[Knobs]:
        """With auto and the optimizer offloaded: the measured fastest bucket, then halves of
        it down to 1e6 parameters, two slots each; else the config's."""
        if not (auto and k.optimizer_offload):
            return [k]
        bucket, options = rates.optimizer_bucket_params, []
        while True:
            options.append(dataclasses.replace(k, bucket_params=bucket, slots=2))
            if bucket <= 1_000_000:
                return options
            bucket //= 2

    def bucket_for(k: Knobs) -> Knobs:
        return buckets_for(k)[-1 if device_memory is None else 0]

    if device_memory is None:  # nothing to fit: the lightest setting allowed
        lightest = with_offload(knobs, model.num_layers if auto else None)
        lightest = with_chunks(lightest, chunk_options[-1])
        lightest = dataclasses.replace(lightest, vocab_block=block_options[-1])
        if auto and may_stream:
            lightest = bucket_for(dataclasses.replace(lightest, optimizer_offload=True,
                                                      optimizer_overlap=False))
        best = lightest
        why = "the device's memory is unknown: the tightest bound the config allows"
    else:
        best, best_time = None, math.inf
        for offloaded, overlap in optimizer_options:
            for count in offload_options:
                candidate = None
                for base in buckets_for(with_offload(dataclasses.replace(
                        knobs, optimizer_offload=offloaded, optimizer_overlap=overlap), count)):
                    candidate = _lightest_fitting(config, base, target, device_memory,
                                                  host_memory, chunk_options, block_options,
                                                  with_chunks)
                    if candidate is not None:  # the largest bucket that fits
                        break
                if candidate is None:
                    continue
                seconds = step_seconds(config, candidate, target)
                if seconds < best_time - 1e-12:
                    best, best_time = candidate, seconds
        why = ("the fastest estimated setting that fits" if auto else
               "the fewest chunks, then the largest block, that fit")
        if best is None:  # nothing fits: report the lightest setting, infeasible
            best = with_chunks(with_offload(knobs, model.num_layers if auto else None),
                               chunk_options[-1])
            best = dataclasses.replace(best, vocab_block=block_options[-1])
            if auto and may_stream:
                best = bucket_for(dataclasses.replace(best, optimizer_offload=True,
                                                      optimizer_overlap=False))
            why = "nothing fits: the lightest setting"
    if best.optimizer_offload and config.optimizer.resident_groups is None:
        # Filled where a setting fits (_lightest_fitting); none in the lightest setting.
        choices.append(Choice("optimizer.resident_groups", best.resident_groups,
                              _resident_reason(config, best, target, device_memory)))
    if choose_budget:
        chunks = -(-n // best.token_budget)
        choices.append(Choice("operators.token_budget", best.token_budget,
                              f"{chunks} chunk(s) of N = {n:,} tokens: {why} (each chunk more "
                              f"costs about {rates.moe_chunk_seconds * 1e3:.1f} ms per MoE "
                              f"layer)"))
        if auto:
            choices.append(Choice("operators.max_chunks", best.max_chunks, "= the chunks"))
    if choose_block:
        choices.append(Choice("operators.vocab_block", best.vocab_block,
                              f"{why} (None: the whole shard of {_shard_width(config, knobs):,}"
                              f" columns; the largest block that fits is taken)"))
    if auto:
        choices.append(Choice("operators.offload", Knobs.as_config(best)["operators.offload"],
                              f"{best.num_offloaded} of {model.num_layers} boundaries; {why} "
                              f"(a copy hides under the layer's compute when the link allows)"))
        choices.append(Choice("operators.optimizer_offload", best.optimizer_offload,
                              "optimizer.update_on: host_cpu: the state stays in host memory, "
                              "updated by the host CPU" if host_cpu else
                              f"{why} (on the device costs 12 bytes/param of device memory; "
                              f"offloaded costs the link: "
                              f"{rates.optimizer_seconds_per_param * 1e9:.2f} s per 1e9 params)"))
        if best.optimizer_offload and has_moe:
            choices.append(Choice("operators.optimizer_overlap", best.optimizer_overlap,
                                  f"{why} (overlapped, the stream hides under the forward and "
                                  f"the step holds the staging and a second copy of the MoE "
                                  f"layers' weights)"))
        if best.optimizer_offload:
            choices.append(Choice("optimizer.bucket_params", best.bucket_params,
                                  "the fastest measured bucket size, halved until the step "
                                  "fits"))
            choices.append(Choice("optimizer.slots", best.slots,
                                  "two: the measured sweep gained nothing from a third"))
    return best, choices


def resident_limit(config: Config, device_memory: int | None) -> int | None:
    """The device memory the resident groups are chosen against: the budget, but never more
    than the device the config names (``device.memory_gib``): a budget lifted past the device
    (``train.device_memory_gib``, to let XLA decide where a run stops) must not fill a
    device it does not have with optimizer state."""
    if device_memory is None or not config.device.memory_gib:
        return device_memory
    return min(device_memory, int(config.device.memory_gib * 2**30))


def most_resident(config: Config, knobs: Knobs, target: Target,
                  device_memory: int | None) -> Knobs:
    """``knobs`` with ``optimizer.resident_groups`` left null filled: where the optimizer is
    streamed, the most groups whose fp32 master and moments fit on the device beside the step
    (against ``resident_limit``); else, or with the device's memory unknown, none. Each group
    resident moves 24 bytes a parameter less over the link a step, so more is never slower
    (docs/offload_adamw.md). The device alone decides: each group more
    holds more of it and less of the host, so the most the device holds is the host's best
    too (with a pinned-host cap set the host fits only from some count up, and a search over
    both would not be monotone). On a CPU none: there the host memory kinds are device memory,
    so keeping state resident saves no link and only skips the stream. An explicit count stays
    as given."""
    if config.optimizer.resident_groups is not None or not knobs.optimizer_offload:
        return knobs
    limit = resident_limit(config, device_memory)
    if limit is None or target.platform == "cpu":
        return dataclasses.replace(knobs, resident_groups=0)
    groups = optimizer_groups(config.model)
    options = list(range(groups, -1, -1))  # the most first: the device fits below some count
    first = _first_true(options, lambda k: fits_in_memory(
        config, dataclasses.replace(knobs, resident_groups=k), target, limit, None))
    return dataclasses.replace(knobs, resident_groups=0 if first is None else options[first])


def fits_with_resident(config: Config, knobs: Knobs, target: Target,
                       device_memory: int | None, host_memory: int | None) -> bool:
    """Whether ``knobs`` fit with their resident groups, left null, filled as the plan fills
    them (``most_resident``). With none resident the device holds the least; if the host fits
    then too, the device's count fits both (the host holds less with each group more), so the
    count is searched only where the host binds."""
    if fits_in_memory(config, knobs, target, device_memory, host_memory):
        return True
    if config.optimizer.resident_groups is not None or not knobs.optimizer_offload:
        return False
    return fits_in_memory(config, most_resident(config, knobs, target, device_memory),
                          target, device_memory, host_memory)


def _resident_reason(config: Config, knobs: Knobs, target: Target,
                     device_memory: int | None) -> str:
    groups = optimizer_groups(config.model)
    limit = resident_limit(config, device_memory)
    if limit is None:
        return "none: the device's memory is unknown"
    if target.platform == "cpu":
        return "none: on a CPU the host state is device memory, nothing to save on a link"
    return (f"{knobs.resident_groups} of {groups}: the most groups whose fp32 master and "
            f"moments fit beside the step in {limit / 2**30:.1f} GiB of device memory (the "
            f"weights outside the MoE stack, then one MoE layer a group; never more than "
            f"device.memory_gib); each moves 24 bytes a parameter less over the host link a "
            f"step")


def _lightest_fitting(config, base: Knobs, target: Target, device_memory, host_memory,
                      chunk_options, block_options, with_chunks) -> Knobs | None:
    """The setting with the fewest chunks and then the largest vocab block that fits (memory
    falls as chunks rise and blocks shrink), or None; each setting with its own resident groups
    where they are left null (``most_resident``: more chunks leave the device room for more,
    so the fit stays monotone)."""
    def fits(k):
        return fits_with_resident(config, k, target, device_memory, host_memory)

    lightest_block = dataclasses.replace(base, vocab_block=block_options[-1])
    chunks = _first_true(chunk_options, lambda c: fits(with_chunks(lightest_block, c)))
    if chunks is None:
        return None
    with_c = with_chunks(base, chunk_options[chunks])
    block = _first_true(block_options, lambda b: fits(dataclasses.replace(with_c,
                                                                          vocab_block=b)))
    return most_resident(config, dataclasses.replace(with_c, vocab_block=block_options[block]),
                         target, device_memory)


def _first_true(options: list, predicate) -> int | None:
    """The first index whose predicate holds, for a predicate monotone over the options."""
    if not options or not predicate(options[-1]):
        return None
    low, high = 0, len(options) - 1
    while low < high:
        middle = (low + high) // 2
        if predicate(options[middle]):
            high = middle
        else:
            low = middle + 1
    return low


def chunk_choices(tokens: int, max_chunks: int, auto: bool) -> list[int]:
    """Effective chunk counts to try, fewest first: up to max_chunks (the config's), or with
    auto up to MOST_CHUNKS (never more than the tokens)."""
    most = min(tokens, max_chunks if not auto else max(MOST_CHUNKS, max_chunks))
    counts = sorted({-(-tokens // -(-tokens // k)) for k in range(1, most + 1)})
    return counts


def _shard_width(config: Config, knobs: Knobs) -> int:
    return mop.padded_vocab(config.model.vocab_size, knobs.num_devices) // knobs.num_devices


def block_choices(config: Config, knobs: Knobs) -> list[int | None]:
    """Vocab blocks to try, largest first: the whole shard, then powers of two down to
    SMALLEST_VOCAB_BLOCK."""
    width = _shard_width(config, knobs)
    options: list[int | None] = [None]
    block = 1 << (width - 1).bit_length() - 1
    while block >= SMALLEST_VOCAB_BLOCK:
        if block < width:
            options.append(block)
        block //= 2
    return options


def offload_count(config: Config) -> int | tuple[bool, ...] | HostBudget:
    """``operators.offload`` in ``pf.sco_scan``'s terms: an int, a tuple of bools, or a
    HostBudget (bytes)."""
    offload = config.operators.offload
    if offload == "auto":
        raise ConfigError("operators.offload: auto is chosen by the planner (plan.operators); "
                          "resolve the config first")
    if offload == "none":
        return 0
    if offload == "all":
        return config.model.num_layers
    if isinstance(offload, float):
        return HostBudget(int(offload * 2**30))
    if isinstance(offload, list):
        return tuple(offload)
    return offload
