"""``peakflat plan``: the planner's table (or JSON) for a config.

    peakflat plan CONFIG [section.field=value ...] [--context N] [--devices W]
                  [--device-memory GiB] [--host-memory GiB] [--platform gpu|cpu] [--auto]
                  [--rate NAME=VALUE ...] [--check] [--json]

A config names the machine it is meant for (its ``device`` section: platform, device count,
memory per device, host memory per device), so that the plan answers for that machine wherever
it runs; the flags override it. Memories are per device, in GiB (the host's: the share of its
memory one device's process may use). Where neither gives one, the plan reads the local device
(its allocator's limit; a CPU's devices live in the host's memory, so each gets its share of
it) and the host (physical memory over local devices). ``--platform`` is what the plan is for:
the attention kernel and the grouped matmul follow it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from peakflat_jax.config import ConfigError, load_config

# peakflat_jax.plan (and jax) are imported where they are used: `peakflat` adds these
# arguments before it sets up jax's environment (XLA_FLAGS).


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``plan`` subcommand's arguments (cli.py adds them to its subparser)."""
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
                             "physical / local devices)")
    parser.add_argument("--platform", choices=("gpu", "cpu"),
                        help="the devices planned for (default: device.platform)")
    parser.add_argument("--auto", action="store_true",
                        help="choose the token budget, vocab block, offload set, optimizer "
                             "placement, buckets and slots, and the mesh split: the longest "
                             "context (or with --context the most tokens per step) that fits")
    parser.add_argument("--rate", action="append", default=[], metavar="NAME=VALUE",
                        help="override a measured rate (the fields of peakflat_jax.plan.Rates, "
                             "e.g. host_link_bytes=50e9)")
    parser.add_argument("--check", action="store_true",
                        help="also compile the trainer's programs on this machine (no step "
                             "runs) and hold XLA's plan of each to the closed form: exit 1 "
                             "where it is above")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _rate_names() -> list[str]:
    from peakflat_jax.plan.rates import Rates

    return [f.name for f in dataclasses.fields(Rates)]


def parse_rates(pairs: list[str]):
    """``peakflat_jax.plan.rates.Rates`` with the ``NAME=VALUE`` overrides applied."""
    from peakflat_jax.plan.errors import PlanError
    from peakflat_jax.plan.rates import Rates

    values = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or name not in _rate_names():
            raise PlanError(f"--rate: expected NAME=VALUE with NAME one of {_rate_names()}, "
                            f"got {pair!r}")
        try:
            number = float(value)
        except ValueError:
            raise PlanError(f"--rate {name}: expected a number, got {value!r}") from None
        if not number > 0:
            raise PlanError(f"--rate {name}: expected a positive number, got {value!r}")
        values[name] = int(number) if name == "optimizer_bucket_params" else number
    return dataclasses.replace(Rates(), **values)


def _gib_argument(name: str, value: float | None) -> int | None:
    from peakflat_jax.plan.errors import GIB, PlanError

    if value is None:
        return None
    if not value > 0:
        raise PlanError(f"{name}: expected a positive number of GiB, got {value}")
    return int(value * GIB)


def run(args: argparse.Namespace) -> int:
    """Prints the plan; exit status 0 when it fits, 1 when it does not, 2 on bad input."""
    from peakflat_jax.plan.errors import PlanError
    from peakflat_jax.plan.report import format_table, plan_json

    try:
        plan = plan_from_arguments(args)
    except (ConfigError, PlanError) as error:
        print(f"peakflat plan: {error}", file=sys.stderr)
        return 2
    print(json.dumps(plan_json(plan), indent=1) if args.json else format_table(plan))
    if not getattr(args, "check", False):
        return 0 if plan.feasible else 1
    from peakflat_jax.plan.check import check_plan_against_xla, format_checks

    try:
        checks = check_plan_against_xla(plan)
    except (ConfigError, PlanError) as error:
        print(f"peakflat plan: {error}", file=sys.stderr)
        return 2
    print(format_checks(plan, checks))
    return 0 if plan.feasible and all(check.holds for check in checks) else 1


def plan_from_arguments(args: argparse.Namespace):
    """The ``peakflat_jax.plan.Plan`` the arguments ask for: the config's ``device`` section,
    with the flags over it."""
    import jax

    from peakflat_jax.plan import machine, search
    from peakflat_jax.plan.errors import GIB, PlanError

    config = load_config(args.config, args.overrides)
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
    if device_memory is None:
        local = jax.devices()[0].platform
        local = "gpu" if local in ("gpu", "cuda", "rocm") else "cpu"
        if platform == "cpu":
            device_memory = machine.cpu_device_memory(host_memory)
        elif local == "gpu":
            device_memory = machine.read_device_memory()
        if device_memory is None:
            raise PlanError(f"--device-memory: {config.name}'s device.memory_gib is null and "
                            f"this machine has no {platform} device to read it from; give it in "
                            f"GiB per device")
    return search.make_plan(config, devices, context=args.context,
                             device_memory=device_memory, host_memory=host_memory,
                             platform=platform, auto=args.auto, rates=parse_rates(args.rate))


def main(argv: list[str] | None = None) -> int:
    """``peakflat plan``'s exit status for ``argv``, as ``peakflat plan ...`` gives it."""
    from peakflat_jax.cli import ArgumentParser, UsageError, parse_arguments

    parser = ArgumentParser(prog="peakflat plan", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    try:
        args = parse_arguments(parser, sys.argv[1:] if argv is None else list(argv))
    except UsageError as error:
        print(error, file=sys.stderr)
        return 2
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
