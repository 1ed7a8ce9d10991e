"""``peakflat plan``: the verdict and the table of terms (or JSON) for a config; with
``--check`` or ``--largest``, XLA's plan of the trainer's programs compiled here.

    peakflat plan CONFIG [section.field=value ...] [--context N] [--devices W]
                  [--device-memory GiB] [--host-memory GiB] [--platform gpu|cpu] [--auto]
                  [--rate NAME=VALUE ...] [--check | --largest [--resolution R]]
                  [--formulas | --json]

A config names the machine it is meant for (its ``device`` section: platform, device kind and
count, memory per device, host memory per device), so that the closed form answers for that
machine wherever it runs; the flags override it. Memories are per device, in GiB (the host's:
the share of its memory one device's process may use). Where neither gives one, the plan reads
this machine (a CPU device's memory is its share of the host's). ``--check`` and ``--largest``
compile, so they run on the machine the config targets (8 simulated devices on a CPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from peakflat_jax.cli.args import ArgumentParser, UsageError, parse_arguments
from peakflat_jax.config import ConfigError
from peakflat_jax.hf.config import load_config

# peakflat_jax.plan, peakflat_jax.train (and jax) are imported where they are used: `peakflat`
# adds these arguments before it sets up jax's environment (XLA_FLAGS).


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``plan`` subcommand's arguments (``peakflat`` adds them to its subparser)."""
    parser.add_argument("config", help="a YAML file, or a preset's name in configs/")
    parser.add_argument("overrides", nargs="*", metavar="section.field=value",
                        help="config overrides, e.g. operators.token_budget=4096")
    parser.add_argument("--context", type=int, help="tokens per sequence (default: "
                                                     "data.seq_len)")
    parser.add_argument("--devices", type=int, help="W devices (default: device.count, else "
                                                     "the mesh's data x seq, else the local ones)")
    parser.add_argument("--device-memory", type=float, metavar="GiB",
                        help="memory per device (default: device.memory_gib, else read from "
                             "the local device)")
    parser.add_argument("--host-memory", type=float, metavar="GiB",
                        help="host memory per device (default: device.host_memory_gib, else "
                             "this host's available memory / local devices)")
    parser.add_argument("--platform", choices=("gpu", "cpu"),
                        help="the devices planned for (default: device.platform)")
    parser.add_argument("--auto", action="store_true",
                        help="choose the token budget, vocab block, offload set, optimizer "
                             "placement, buckets and slots, and the mesh split: the longest "
                             "context (or with --context the most tokens per step) that fits")
    parser.add_argument("--rate", action="append", default=[], metavar="NAME=VALUE",
                        help="override a measured rate (the fields of peakflat_jax.plan.Rates, "
                             "e.g. host_link_bytes=50e9)")
    verdicts = parser.add_mutually_exclusive_group()
    verdicts.add_argument("--check", action="store_true",
                          help="also compile the trainer's programs here (nothing is made or "
                               "run) and print XLA's plan of each beside the closed form: exit "
                               "1 where it does not fit the device")
    verdicts.add_argument("--largest", action="store_true",
                          help="find the largest context whose compiled programs fit the "
                               "device, by bisection over compiles from the closed form's")
    parser.add_argument("--resolution", type=float, default=0.02,
                        help="--largest stops within this fraction of the context (default "
                             "0.02)")
    output = parser.add_mutually_exclusive_group()
    output.add_argument("--formulas", action="store_true",
                        help="print each term's formula in full, with what it counts")
    output.add_argument("--json", action="store_true", help="print one JSON object")


def parse_rates(pairs: list[str]):
    """``peakflat_jax.plan.Rates`` with the ``NAME=VALUE`` overrides applied (None: none)."""
    from peakflat_jax.plan import PlanError, Rates, measured_for

    names = [f.name for f in dataclasses.fields(Rates)]
    values = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or name not in names:
            raise PlanError(f"--rate: expected NAME=VALUE with NAME one of {names}, got "
                            f"{pair!r}")
        try:
            number = float(value)
        except ValueError:
            raise PlanError(f"--rate {name}: expected a number, got {value!r}") from None
        if not number > 0:
            raise PlanError(f"--rate {name}: expected a positive number, got {value!r}")
        values[name] = int(number) if name == "optimizer_bucket_params" else number
    return dataclasses.replace(measured_for("gpu").rates, **values) if values else None


def _gib_argument(name: str, value: float | None) -> int | None:
    from peakflat_jax.plan import GIB, PlanError

    if value is None:
        return None
    if not value > 0:
        raise PlanError(f"{name}: expected a positive number of GiB, got {value}")
    return int(value * GIB)


@dataclasses.dataclass(frozen=True)
class Request:
    """What the arguments ask to plan: the config and the machine it is for."""

    config: object
    devices: int
    platform: str
    device_kind: str | None
    device_memory: int
    host_memory: int


def request_of(args: argparse.Namespace) -> Request:
    """The config and machine the arguments ask for: the config's ``device`` section, with
    the flags over it, and this machine for what neither says."""
    import jax

    from peakflat_jax.cli.environment import add_config_flags
    from peakflat_jax.plan import GIB, PlanError
    from peakflat_jax.train import machine

    config = load_config(args.config, args.overrides)
    add_config_flags(config)
    target = config.device
    platform = args.platform or target.platform
    devices = args.devices
    if devices is None:
        devices = target.count
    if devices is None and config.mesh.seq != -1:
        devices = config.mesh.data * config.mesh.seq
    if isinstance(devices, bool) or devices is not None and devices < 1:
        raise PlanError(f"--devices: expected a positive integer, got {devices}")
    if args.context is not None and args.context < 1:
        raise PlanError(f"--context: expected a positive number of tokens, got {args.context}")
    device_memory = _gib_argument("--device-memory", args.device_memory)
    host_memory = _gib_argument("--host-memory", args.host_memory)
    if device_memory is None and target.memory_gib is not None:
        device_memory = int(target.memory_gib * GIB)
    if host_memory is None and target.host_memory_gib is not None:
        host_memory = int(target.host_memory_gib * GIB)
    # Only what neither the flags nor the config say is read from this machine.
    if devices is None:
        devices = len(jax.devices())
    if host_memory is None:
        host_memory = machine.read_host_memory()
    kind = target.kind
    if device_memory is None:
        local = machine.platform_of()
        if platform == "cpu":
            device_memory = machine.cpu_device_memory(host_memory)
        elif local == "gpu":
            device_memory = machine.read_device_memory()
            kind = kind or machine.device_kind_of()
        if device_memory is None:
            raise PlanError(f"--device-memory: {config.name}'s device.memory_gib is null and "
                            f"this machine has no {platform} device to read it from; give it in "
                            f"GiB per device")
    if platform == "cpu":
        kind = "cpu"
    return Request(config, devices, platform, kind, device_memory, host_memory)


def plan_of(request: Request, args: argparse.Namespace):
    """The closed form's ``Plan`` of a request (the data's statistics computed here), under the
    pinned-host pool cap this process's environment sets where it sets one, as ``peakflat
    train`` would run it."""
    from peakflat_jax.plan import PlanError, make_plan
    from peakflat_jax.train import machine
    from peakflat_jax.train.data import data_stats

    try:
        cap = machine.pool_cap_in_environment() if request.platform == "gpu" else None
    except ValueError as error:
        raise PlanError(str(error)) from None
    return make_plan(request.config, request.devices, context=args.context,
                     device_memory=request.device_memory, host_memory=request.host_memory,
                     platform=request.platform, device_kind=request.device_kind,
                     data_stats=data_stats(request.config.data), auto=args.auto,
                     rates=parse_rates(args.rate), pinned_pool_limit_gib=cap)


def run(args: argparse.Namespace) -> int:
    """Prints the plan; exit status 0 when it fits, 1 when it does not, 2 on bad input."""
    from peakflat_jax.plan import PlanError, format_table, plan_json

    try:
        request = request_of(args)
        if args.largest:
            return _largest(request, args)
        plan = plan_of(request, args)
    except (ConfigError, PlanError) as error:
        print(f"peakflat plan: {error}", file=sys.stderr)
        return 2
    print(json.dumps(plan_json(plan), indent=1) if args.json
          else format_table(plan, formulas=args.formulas))
    if not args.check:
        return 0 if plan.feasible else 1
    from peakflat_jax.train import preflight

    try:
        checks = preflight.check(plan)
    except (ConfigError, PlanError) as error:
        print(f"peakflat plan: {error}", file=sys.stderr)
        return 2
    print(preflight.format_checks(plan, checks))
    return 0 if preflight.compiled_fits(checks, plan.device_memory) else 1


def _largest(request: Request, args: argparse.Namespace) -> int:
    """``--largest``: the bisection over compiles, each probe printed as it is done."""
    from peakflat_jax.train import preflight

    if args.context is not None or args.auto:
        raise UsageError("peakflat plan: --largest: searches the context with the config's "
                         "knobs; drop --context and --auto")
    config = request.config
    print(f"peakflat plan {config.name} --largest: compiling {request.devices} "
          f"{request.platform} devices' programs at each context", flush=True)
    answer = preflight.largest(config, request.devices, device_memory=request.device_memory,
                               host_memory=request.host_memory, resolution=args.resolution,
                               log=lambda line: print(line, flush=True))
    print(preflight.format_largest(config, answer))
    return 0 if answer.context is not None else 1


def main(argv: list[str] | None = None) -> int:
    """``peakflat plan``'s exit status for ``argv``, as ``peakflat plan ...`` gives it."""
    parser = ArgumentParser(prog="peakflat plan", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    try:
        args = parse_arguments(parser, sys.argv[1:] if argv is None else list(argv))
        return run(args)
    except UsageError as error:
        print(error, file=sys.stderr)
        return 2
