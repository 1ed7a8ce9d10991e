"""The ``peakflat`` command.

    peakflat train CONFIG [section.field=value ...] [--resume] [--run-dir DIR] [--no-progress]
    peakflat plan CONFIG [section.field=value ...] [--context N] [--devices W]
                      [--device-memory GiB] [--host-memory GiB] [--auto] [--json]
    peakflat bench OPERATOR [--preset cpu|gpu|gpu-x8] [--only TEXT]... [--repeats N]
                      [--trace-steps N] [--out-dir DIR] [--json]

CONFIG is a YAML file or the name of a preset in configs/ (tiny, h200-1, ...).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shlex
import sys

BENCHMARKS = {"ring_dtp": "peakflat_jax.bench.ring_dtp",
              "moe_dispatch": "peakflat_jax.bench.moe_dispatch",
              "offload_adamw": "peakflat_jax.bench.offload_adamw",
              "sco": "peakflat_jax.bench.sco"}
# The benchmarks whose cases time one compiled step (harness.measure_compiled), which --trace-steps
# profiles; offload_adamw times a step and host-side baselines its own way.
TRACEABLE = ("moe_dispatch", "ring_dtp", "sco")


def _prepare_environment() -> None:
    """Before jax's backends start: 8 simulated devices where the backend is the CPU (ignored by GPU
    backends), and room for the largest baselines on a GPU (JAX reserves 75% by default)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8".strip()
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def _enable_compilation_cache() -> None:
    """JAX's persistent compilation cache (PEAKFLAT_JAX_CACHE, default
    ~/.cache/peakflat_jax/xla; empty: off): a second run of a config skips XLA's compile."""
    import jax

    directory = os.environ.get("PEAKFLAT_JAX_CACHE",
                               os.path.expanduser("~/.cache/peakflat_jax/xla"))
    if directory:
        jax.config.update("jax_compilation_cache_dir", directory)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)


def _bench(args: argparse.Namespace) -> int:
    module = importlib.import_module(BENCHMARKS[args.operator])
    from peakflat_jax.bench import harness

    presets = module.presets()
    if args.preset not in presets:
        raise SystemExit(f"--preset: {args.operator} has {sorted(presets)}, got {args.preset!r}")
    cases = presets[args.preset]
    if args.only:
        cases = [c for c in cases if any(text in json.dumps(c) for text in args.only)]
    if args.repeats is not None:
        cases = [dict(c, repeats=args.repeats) for c in cases]
    if args.trace_steps is not None:
        if args.trace_steps < 1:
            raise SystemExit(f"--trace-steps: expected a positive int, got {args.trace_steps}")
        if args.operator not in TRACEABLE:
            raise SystemExit(f"--trace-steps: {args.operator} times no single compiled step; "
                             f"expected one of {sorted(TRACEABLE)}")
        cases = [dict(c, trace_steps=args.trace_steps) for c in cases]
    command = shlex.join(["peakflat", *args.argv])
    record = harness.run_suite(BENCHMARKS[args.operator], args.operator, args.preset, cases,
                               command=command, out_dir=args.out_dir)
    print(json.dumps(record, indent=1) if args.json else module.summarize(record))
    print(f"record: {record['path']}", file=sys.stderr)
    return 0 if all("error" not in c or c.get("oom") for c in record["cases"]) else 1


def _train(args: argparse.Namespace) -> int:
    from peakflat_jax.config import ConfigError, load_config

    try:
        config = load_config(args.config, args.overrides)
        from peakflat_jax.train.trainer import DoesNotFit, train

        train(config, resume=args.resume, run_dir=args.run_dir,
              progress=False if args.no_progress else None)
    except (ConfigError, DoesNotFit) as error:
        print(f"peakflat train: {error}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="peakflat", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="train the MoP decoder of a config")
    train.add_argument("config", help="a YAML file, or a preset's name in configs/")
    train.add_argument("overrides", nargs="*", metavar="section.field=value",
                       help="config overrides, e.g. train.steps=10 operators.loss=materialized")
    train.add_argument("--resume", action="store_true",
                       help="continue from the latest complete checkpoint in the run directory")
    train.add_argument("--run-dir", help="where metrics and checkpoints go (default: "
                                         "train.run_dir of the config)")
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    from peakflat_jax import plan_cli

    plan = commands.add_parser("plan", help="the per-device memory of a config, term by term, "
                                            "before launch (and --auto: the knobs chosen)")
    plan_cli.add_arguments(plan)
    bench = commands.add_parser("bench", help="benchmark an operator against its baseline")
    bench.add_argument("operator", choices=sorted(BENCHMARKS))
    bench.add_argument("--preset", default="cpu",
                       help="cpu (small, runs anywhere), gpu (the paper's shapes on the lent "
                            "H200s) or gpu-x8 (eight H200s, where a benchmark has it)")
    bench.add_argument("--only", action="append",
                       help="run only the cases whose JSON contains this text (repeatable: any)")
    bench.add_argument("--repeats", type=int, help="timed repeats per case (default: preset's)")
    bench.add_argument("--trace-steps", type=int,
                       help="also trace N steps of each case and record where the device time "
                            "went (the benchmarks that time one compiled step: moe_dispatch, "
                            "ring_dtp, sco)")
    bench.add_argument("--out-dir", help="where the JSON record goes (default scripts/results)")
    bench.add_argument("--json", action="store_true", help="print the whole record as JSON")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    args.argv = argv
    _prepare_environment()
    if args.command == "train":
        _enable_compilation_cache()
        return _train(args)
    if args.command == "plan":
        return plan_cli.run(args)
    return _bench(args)


if __name__ == "__main__":
    sys.exit(main())
