"""The ``peakflat`` command.

    peakflat train CONFIG [section.field=value ...] [--resume | --overwrite] [--run-dir DIR]
                      [--no-progress]
    peakflat plan CONFIG [section.field=value ...] [--context N] [--devices W]
                      [--device-memory GiB] [--host-memory GiB] [--platform gpu|cpu] [--auto]
                      [--check | --largest] [--formulas | --json]
    peakflat bench OPERATOR [--preset cpu|gpu|gpu-x8] [--only TEXT]... [--repeats N]
                      [--trace-steps N] [--out-dir DIR] [--json]
    peakflat export-hf RUN_DIR OUT_DIR     # a run's latest weights as a Hugging Face checkpoint
    peakflat xcheck export DIR [--config CONFIG] [--dtype float32|bfloat16] [--seed S]
                      [section.field=value ...]
    peakflat xcheck run [--config CONFIG] [--dtype D] [--seed S] [--dir DIR]
                      [--record-dir DIR] [--torch-device DEVICE] [--torch-python PYTHON]
                      [--reference float64|none]
                      [section.field=value ...]

CONFIG is a YAML file or the name of a preset in configs/ (tiny, h200-1, ...). Overrides and
flags come in any order, each at most once. Bad input (an unknown key or flag, an ill-typed
value, a flag or key given twice, a missing or unreadable file, a run directory in use by a live
run or that cannot be one, a GPU config without a GPU) is one line on stderr naming what is
wrong and what was expected, exit status 2, before anything is compiled; a step the planner
finds too large, at most five lines. An interrupted run (SIGINT, SIGTERM) saves a checkpoint,
says how to resume it and exits 130 or 143. A run out of device memory (the planner's check
lifted, or its bound short) is one line naming the program, the size XLA asked for and the
plans, exit status 1; its summary.json says that it failed and why.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shlex
import sys

from peakflat_jax.cli import plan as plan_command_line
from peakflat_jax.cli.args import ArgumentParser, UsageError, parse_arguments
from peakflat_jax.cli.environment import (
    CPU_SCHEDULER_FLAG,
    add_config_flags,
    enable_compilation_cache,
    has_nvidia_gpus,
    prepare_environment,
)

__all__ = ["CPU_SCHEDULER_FLAG", "ArgumentParser", "UsageError", "add_config_flags",
           "enable_compilation_cache", "has_nvidia_gpus", "main", "make_parser",
           "parse_arguments", "plan_command", "prepare_environment", "resume_command"]

BENCHMARKS = {"ring_dtp": "peakflat_jax.bench.ring_dtp",
              "moe_dispatch": "peakflat_jax.bench.moe_dispatch",
              "offload_adamw": "peakflat_jax.bench.offload_adamw",
              "sco": "peakflat_jax.bench.sco",
              "train_step": "peakflat_jax.bench.train_step"}
# The benchmarks whose cases time one compiled step (harness.measure_compiled), which --trace-steps
# profiles; offload_adamw times a step and host-side baselines its own way.
TRACEABLE = ("moe_dispatch", "ring_dtp", "sco")


def resume_command(argv: list[str]) -> str:
    """The command that resumes the run ``peakflat train`` was given ``argv`` (without the
    program's name) for: the same words, ``--overwrite`` dropped, ``--resume`` added."""
    words = [word for word in argv if word not in ("--overwrite", "--resume")]
    return shlex.join(["peakflat", *words, "--resume"])


def _bench(args: argparse.Namespace) -> int:
    if args.repeats is not None and args.repeats < 1:
        raise UsageError(f"peakflat bench: --repeats: expected a positive integer, got "
                         f"{args.repeats}")
    if args.trace_steps is not None:
        if args.trace_steps < 1:
            raise UsageError(f"peakflat bench: --trace-steps: expected a positive integer, got "
                             f"{args.trace_steps}")
        if args.operator not in TRACEABLE:
            raise UsageError(f"peakflat bench: --trace-steps: {args.operator} times no single "
                             f"compiled step; expected one of {sorted(TRACEABLE)}")
    module = importlib.import_module(BENCHMARKS[args.operator])
    from peakflat_jax.bench import harness

    presets = module.presets()
    if args.preset not in presets:
        raise UsageError(f"peakflat bench: --preset: {args.operator} has {sorted(presets)}, got "
                         f"{args.preset!r}")
    cases = presets[args.preset]
    if args.only:
        cases = [c for c in cases if any(text in json.dumps(c) for text in args.only)]
        if not cases:
            raise UsageError(f"peakflat bench: --only: no case of {args.operator} "
                             f"--preset {args.preset} contains any of {args.only}")
    if args.repeats is not None:
        cases = [dict(c, repeats=args.repeats) for c in cases]
    if args.trace_steps is not None:
        cases = [dict(c, trace_steps=args.trace_steps) for c in cases]
    command = shlex.join(["peakflat", *args.argv])
    record = harness.run_suite(BENCHMARKS[args.operator], args.operator, args.preset, cases,
                               command=command, out_dir=args.out_dir)
    print(json.dumps(record, indent=1) if args.json else module.summarize(record))
    print(f"record: {record['path']}", file=sys.stderr)
    return 0 if all("error" not in c or c.get("oom") for c in record["cases"]) else 1


def plan_command(config: str, overrides: list[str]) -> str:
    """``peakflat plan`` of the config and overrides of a ``peakflat train``, without
    ``train.device_memory_gib``: the plan held to the config's device."""
    kept = [word for word in overrides if not word.startswith("train.device_memory_gib=")]
    return shlex.join(["peakflat", "plan", config, *kept])


def _train(args: argparse.Namespace) -> int:
    """Exit status 0 when the run finished (or was finished already), 2 for bad input (the
    config, the mesh, the run directory, a step whose compiled programs do not fit the device:
    one line naming XLA's plan and the device's memory), 1 when it ran out
    of device memory (one line: where, the plans and what to do), 128 + the signal's number
    when it was interrupted."""
    from peakflat_jax.config import ConfigError
    from peakflat_jax.hf.config import load_config

    if args.resume and args.overwrite:
        raise UsageError("peakflat train: --resume and --overwrite: expected at most one "
                         "(continue the run in the run directory, or clear it first)")
    from peakflat_jax.train import run_dir as run_dirs
    from peakflat_jax.train import run_lock

    try:
        config = load_config(args.config, args.overrides)
        # One run per directory, from the start: a second run into a live one is refused
        # here, as is a path that cannot be a run directory, in a second, not after jax.
        lock = run_lock.hold(run_dirs.run_dir_of(config, args.run_dir),
                             process_index=run_lock.process_index_of(config.mesh),
                             create=not args.resume)
    except ConfigError as error:
        raise UsageError(f"peakflat train: {error}") from None
    try:
        return _train_holding(args, config)
    finally:
        if lock is not None:
            lock.release()


def condensed(message: str, plan: str, most: int = 5) -> str:
    """A refusal of several lines (the planner's table of terms) in at most ``most``: its
    first line and its ``to change:`` lines, then where the whole table is (``plan``, the
    ``peakflat plan`` command of the run)."""
    lines = message.strip().splitlines()
    if len(lines) <= most:
        return message.strip()
    kept = [lines[0], *[line.strip() for line in lines[1:]
                        if line.strip().startswith("to change:")][: most - 2]]
    return "\n".join([*kept, f"the terms, line by line: `{plan}`"])


def _train_holding(args: argparse.Namespace, config) -> int:
    """``_train`` with the config read and the run directory's lock held."""
    from peakflat_jax.config import ConfigError

    # Said on a terminal before jax is imported (seconds), then the banner once planned
    # (before the state, whose initialisation compiles); piped, the banner comes first, so
    # that bad input refused while planning stays one line.
    if sys.stderr.isatty():
        print(f"peakflat train {config.name}: starting (jax, the plan, the initial state, then "
              f"the compile) ...", file=sys.stderr, flush=True)
    # The trainer only now: a bad config is answered without importing it.
    import jax

    from peakflat_jax import mesh
    from peakflat_jax.plan import DoesNotFit, PlanError
    from peakflat_jax.train.interrupts import Interrupted
    from peakflat_jax.train.machine import set_pool_cap
    from peakflat_jax.train.oom import OutOfMemory
    from peakflat_jax.train.startup import Timeline
    from peakflat_jax.train.trainer import train

    timeline = Timeline()  # where the start-up goes, from the process's start
    timeline.mark("imports")
    add_config_flags(config)
    try:
        set_pool_cap(config)  # XLA reads the pinned-host pool's cap when its backend starts
        mesh.initialize_distributed(config.mesh)  # before anything starts a backend
        enable_compilation_cache()
        devices = jax.devices()  # the backend started here (not inside the trainer's set-up)
        timeline.mark("backend")
        if config.device.platform == "gpu" and jax.default_backend() != "gpu":
            raise UsageError(
                f"peakflat train: {args.config} is a GPU config (device.platform: gpu) and this "
                f"machine has no GPU (jax found {len(devices)} {devices[0].platform} devices); "
                f"`peakflat plan {args.config}` plans it here; to run it here anyway, override "
                f"device.platform=cpu and a mesh of the {len(devices)} devices (mesh.data, "
                f"mesh.seq), which the planner then holds to this machine's memory")
        train(config, resume=args.resume, overwrite=args.overwrite, run_dir=args.run_dir,
              progress=False if args.no_progress else None, timeline=timeline)
    except (ConfigError, PlanError) as error:
        raise UsageError(f"peakflat train: {error}") from None
    except DoesNotFit as error:  # the planner's table of terms: its verdict, what to change
        print(f"peakflat train: {condensed(str(error), plan_command(args.config, args.overrides))}",
              file=sys.stderr)
        return 2
    except Interrupted as stop:
        resume = (f"resume with: {resume_command(args.argv)}" if stop.saved_step is not None
                  else "")
        print(f"peakflat train: {stop}{'; ' if resume else ''}{resume}", file=sys.stderr)
        return stop.exit_status
    except OutOfMemory as failure:  # a run that failed, not bad input: status 1
        lifted = ("drop train.device_memory_gib to have the planner hold the run to the "
                  "device, or " if config.train.device_memory_gib
                  and "out of device memory" in str(failure) else "")
        plan = plan_command(args.config, args.overrides)
        print(f"peakflat train: {failure}; {lifted}see `{plan}` for the terms and what to "
              f"change", file=sys.stderr)
        return 1
    return 0


def _xcheck(args: argparse.Namespace) -> int:
    from peakflat_jax.config import ConfigError
    from peakflat_jax.hf.config import load_config
    from peakflat_jax.plan import PlanError

    try:
        load_config(args.config, args.overrides)  # bad input before any export starts
    except ConfigError as error:
        raise UsageError(f"peakflat xcheck {args.action}: {error}") from None
    if args.action == "run":
        from peakflat_jax.xcheck.run import run

        return run(config=args.config, overrides=args.overrides, dtype=args.dtype,
                   seed=args.seed, directory=args.dir, record_dir=args.record_dir,
                   torch_device=args.torch_device, torch_python=args.torch_python,
                   reference=args.reference,
                   command=shlex.join(["peakflat", *args.argv]))
    enable_compilation_cache()
    from peakflat_jax.xcheck.export import export

    try:
        manifest = export(args.directory, config=args.config, overrides=tuple(args.overrides),
                          dtype=args.dtype, seed=args.seed,
                          log=lambda line: print(line, flush=True))
    except (ConfigError, PlanError) as error:
        raise UsageError(f"peakflat xcheck export: {error}") from None
    print(f"exported {len(manifest['cases'])} cases ({', '.join(manifest['cases'])}) to "
          f"{args.directory}; check them with: python peakflat_jax/xcheck/torch_side.py "
          f"{shlex.quote(str(args.directory))}", file=sys.stderr)
    return 0


def _export_hf(args: argparse.Namespace) -> int:
    from peakflat_jax.config import ConfigError
    from peakflat_jax.train.export_run import export_run

    try:
        directory = export_run(args.run_dir, args.out_dir)
    except ConfigError as error:
        raise UsageError(f"peakflat export-hf: {error}") from None
    print(f"wrote {directory}/config.json and model.safetensors (transformers: "
          f"AutoModelForCausalLM.from_pretrained({str(directory)!r}))", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``peakflat``'s exit status for ``argv`` (default ``sys.argv[1:]``); bad input is one line
    on stderr and status 2."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        return _main(argv)
    except UsageError as error:
        print(error, file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C where no handler of ours was installed (a start-up)
        command = " ".join(["peakflat", *argv[:1]])
        print(f"{command}: SIGINT: stopped before anything ran (no step trained, nothing "
              f"saved)", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `peakflat plan ... | head`: its reader went away, no traceback
        if argv[:1] != ["plan"]:
            raise
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def make_parser() -> argparse.ArgumentParser:
    """The ``peakflat`` command's parser (its subcommands' arguments)."""
    parser = ArgumentParser(prog="peakflat", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="train the MoP decoder of a config")
    train.add_argument("config", help="a YAML file, or a preset's name in configs/")
    train.add_argument("overrides", nargs="*", metavar="section.field=value",
                       help="config overrides, e.g. train.steps=10 operators.loss=materialized")
    train.add_argument("--resume", action="store_true",
                       help="continue from the latest complete checkpoint in the run directory "
                            "(a finished run is left as it is)")
    train.add_argument("--overwrite", action="store_true",
                       help="clear the run directory first (without it, or --resume, a run "
                            "directory that holds a run is refused)")
    train.add_argument("--run-dir", help="where metrics and checkpoints go (default: "
                                         "train.run_dir of the config)")
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    plan = commands.add_parser("plan", help="the per-device memory of a config, term by term, "
                                            "before launch (--auto: the knobs chosen; --check, "
                                            "--largest: by compiling here)")
    plan_command_line.add_arguments(plan)
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
    export_hf = commands.add_parser("export-hf", help="a run's latest weights as a Hugging "
                                                      "Face checkpoint (Mixtral, Qwen3-MoE)")
    export_hf.add_argument("run_dir", help="the directory of a peakflat train run")
    export_hf.add_argument("out_dir", help="where config.json and model.safetensors go")
    xcheck = commands.add_parser("xcheck", help="cross-check the JAX stack against PyTorch")
    actions = xcheck.add_subparsers(dest="action", required=True)
    export = actions.add_parser("export", help="write inputs, JAX outputs and gradients")
    export.add_argument("directory", help="where the .npz files and manifest.json go")
    run = actions.add_parser("run", help="export, then the PyTorch side where torch imports")
    run.add_argument("--dir", help="the export directory (default runs/xcheck-CONFIG-DTYPE-S)")
    run.add_argument("--record-dir", help="where the JSON record goes (default scripts/results)")
    run.add_argument("--torch-device", help="torch device (default cuda where available)")
    run.add_argument("--torch-python", help="run the PyTorch side in this Python instead (e.g. "
                                            ".venv-torch/bin/python from "
                                            "scripts/xcheck_torch_env.sh)")
    run.add_argument("--reference", choices=("float64", "none"), default="float64",
                     help="also compute each case in float64 on the PyTorch side (informative "
                          "columns; none halves its time and memory)")
    for action in (export, run):
        action.add_argument("--config", default="tiny",
                            help="a YAML file, or a preset's name in configs/ (default tiny)")
        action.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
        action.add_argument("--seed", type=int, default=0)
        action.add_argument("overrides", nargs="*", metavar="section.field=value",
                            help="config overrides, e.g. data.seq_len=64")
    return parser


def _main(argv: list[str]) -> int:
    args = parse_arguments(make_parser(), argv)
    args.argv = argv
    prepare_environment()
    if args.command == "train":
        return _train(args)
    if args.command == "plan":
        return plan_command_line.run(args)
    if args.command == "xcheck":
        return _xcheck(args)
    if args.command == "export-hf":
        return _export_hf(args)
    return _bench(args)


if __name__ == "__main__":
    sys.exit(main())
