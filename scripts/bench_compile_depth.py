"""How `peakflat train`'s compile grows with depth: the command at each depth, each run a fresh
process, the compile's seconds as the trainer prints them (wall) and the process's CPU seconds
over the same compile (every thread: on a machine shared with other work the wall time follows
the load, the CPU time much less).

    python scripts/bench_compile_depth.py tiny [more overrides] --layers 4 8 16 32 \
        --repeats 2 --out scripts/results/compile_depth_tiny_cpu.json

Runs ``peakflat train CONFIG model.num_layers=L --no-progress train.steps=1
train.checkpoints=false --overwrite --run-dir DIR`` for each depth, the depths interleaved
repeat by repeat, and writes one JSON record: the command, the commit, the device, the load,
each run's numbers and the ratios of the medians against the shallowest depth.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import subprocess
import sys
import tempfile
import time


def one(argv: list[str]) -> dict:
    """In this process: the command, the compile's wall (the trainer's) and CPU seconds."""
    from peakflat_jax import cli
    from peakflat_jax.train import trainer as trainer_module

    cpu: dict[str, float] = {}
    compiled = trainer_module.Trainer._compiled

    def timed(self, program, compile_it, what):
        started = time.process_time()
        result = compiled(self, program, compile_it, what)
        cpu[what] = cpu.get(what, 0.0) + time.process_time() - started
        return result

    trainer_module.Trainer._compiled = timed
    load_before = os.getloadavg()
    started = time.perf_counter()
    code = cli.main(argv)
    wall = time.perf_counter() - started
    run_dir = pathlib.Path(argv[argv.index("--run-dir") + 1])
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"rc": code, "compile_seconds": summary["compile_seconds"],
            "compile_cpu_seconds": cpu, "process_wall_seconds": wall,
            "load_before": load_before, "load_after": os.getloadavg(),
            "device": summary.get("device_kind"),
            "package": str(pathlib.Path(cli.__file__).parents[1])}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config")
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", required=True)
    parser.add_argument("--label", default="", help="what the code measured is (a record's note)")
    parser.add_argument("--one", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    if args.one is not None:
        print("RESULT " + json.dumps(one(args.one)), flush=True)
        return 0
    runs = []
    with tempfile.TemporaryDirectory() as scratch:
        for repeat in range(args.repeats):
            for layers in args.layers:
                command = ["train", args.config, f"model.num_layers={layers}", "--no-progress",
                           "train.steps=1", "train.checkpoints=false", *args.overrides,
                           "--overwrite", "--run-dir", f"{scratch}/run"]
                out = subprocess.run([sys.executable, __file__, args.config, "--out", args.out,
                                      "--one", *command], capture_output=True, text=True)
                line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
                if line is None:
                    print(out.stdout[-2000:], out.stderr[-4000:], file=sys.stderr)
                    return 1
                run = {"layers": layers, "repeat": repeat, **json.loads(line[len("RESULT "):])}
                runs.append(run)
                print(json.dumps(run), flush=True)
    record = {
        "command": "peakflat " + " ".join(["train", args.config, "model.num_layers=L",
                                           "--no-progress", "train.steps=1",
                                           "train.checkpoints=false", *args.overrides,
                                           "--overwrite", "--run-dir", "DIR"]),
        "driver": " ".join([os.path.basename(__file__), *sys.argv[1:]]),
        "label": args.label,
        "commit": os.environ.get("PEAKFLAT_COMMIT") or _commit(),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "device": runs[0]["device"], "host": platform.node(), "cpus": os.cpu_count(),
        "runs": runs, "medians": _medians(runs, args.layers),
    }
    path = pathlib.Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record["medians"], indent=1))
    return 0


def _medians(runs: list[dict], depths: list[int]) -> dict:
    """Per depth the median compile (wall and CPU seconds, every program), and each against the
    shallowest depth's."""
    def median(values):
        values = sorted(values)
        middle = len(values) // 2
        return values[middle] if len(values) % 2 else (values[middle - 1] + values[middle]) / 2

    medians = {}
    for layers in depths:
        at = [r for r in runs if r["layers"] == layers]
        medians[str(layers)] = {
            "compile_seconds": median([sum(r["compile_seconds"].values()) for r in at]),
            "compile_cpu_seconds": median([sum(r["compile_cpu_seconds"].values()) for r in at])}
    base = medians[str(depths[0])]
    for value in medians.values():
        value["wall_ratio"] = value["compile_seconds"] / base["compile_seconds"]
        value["cpu_ratio"] = value["compile_cpu_seconds"] / base["compile_cpu_seconds"]
    return medians


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True, cwd=pathlib.Path(__file__).parent
                              ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
