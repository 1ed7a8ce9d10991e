"""Where the time of ``peakflat xcheck run`` goes: per case, the JAX export's seconds (and how
many of them XLA spent compiling, and tracing and lowering), then the PyTorch side's per-case
line (torch, float64 reference, comparisons), each case in its own process, on this machine.

    PYTHONPATH=. python scripts/probes/probe_xcheck_time.py --config h200-1 \\
        --grouped-matmul tiled --torch-python .venv-torch/bin/python \\
        model.num_layers=2 data.seq_len=2048

``--grouped-matmul tiled`` makes the MoE layers (and the planner) take the tiled grouped matmul,
as an fp32 run on a GPU does, where a CPU would take ``lax.ragged_dot`` (whose dense lowering
needs 36 GiB at h200-1's widths, more than these machines have); ``auto`` leaves the choice to
``select_grouped_matmul``. It replaces ``grouped_matmul.select_grouped_matmul`` and
``planned_path`` in this process, so it follows their signatures. One simulated CPU device by
default (``--devices``), the layout of a one-GPU run. Writes
``xcheck_time_<config>_<platform>_<date>.json`` to ``--out-dir`` (default scripts/results):
the command, the load average before and after (the lent CPU machines are shared), the
export's lines and, per case, the PyTorch side's seconds, exit status and failures.
docs/xcheck.md cites the records.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import pathlib
import shlex
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[2]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--config", default="h200-1")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--grouped-matmul", choices=("auto", "xla", "tiled"), default="auto")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--torch-python", help="run the PyTorch side in this Python")
    parser.add_argument("--reference", choices=("float64", "none"), default="float64")
    parser.add_argument("--dir", default=None, help="export directory (default runs/...)")
    parser.add_argument("--out-dir", default=str(REPO / "scripts" / "results"))
    args = parser.parse_args()
    os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""),
                                        f"--xla_force_host_platform_device_count={args.devices}"])
    load_before = os.getloadavg()

    import jax
    from jax import monitoring

    from peakflat_jax.ops import grouped_matmul as gm
    from peakflat_jax.xcheck.export import export

    if args.grouped_matmul != "auto":
        forced, select = args.grouped_matmul, gm.select_grouped_matmul

        def select_forced(device, lhs_dtype, rhs_dtype, k, n, implementation=None):
            if implementation is None:
                return gm.GroupedMatmul(forced)
            return select(device, lhs_dtype, rhs_dtype, k, n, implementation)

        gm.select_grouped_matmul = select_forced
        gm.planned_path = lambda platform, lhs_dtype, rhs_dtype, k, n: forced

    durations: collections.Counter = collections.Counter()
    monitoring.register_event_duration_secs_listener(
        lambda event, seconds, **_: durations.update({event: seconds}))
    seen: collections.Counter = collections.Counter()
    lines = []

    def log(line: str) -> None:
        new = {event: durations[event] - seen[event] for event in durations}
        seen.update(new)
        compile_s = sum(v for k, v in new.items() if k.endswith("backend_compile_duration"))
        lower_s = sum(v for k, v in new.items()
                      if k.endswith(("jaxpr_trace_duration", "jaxpr_to_mlir_module_duration")))
        line = f"{line} (XLA compile {compile_s:.1f} s, trace and lower {lower_s:.1f} s)"
        lines.append(line)
        print(line, flush=True)

    directory = pathlib.Path(args.dir or REPO / "runs" / f"xcheck-time-{args.config}")
    started = time.perf_counter()
    manifest = export(directory, config=args.config, overrides=tuple(args.overrides),
                      dtype=args.dtype, seed=args.seed, log=log)
    export_seconds = time.perf_counter() - started
    print(f"export: {export_seconds:.1f} s in all", flush=True)
    cases = {}
    for name in manifest["cases"] if args.torch_python else ():
        # One process per case, so that a case killed for memory (the model's float64 reference
        # at h200-1's widths needs more than 22 GB on a CPU) leaves the others' reports.
        report_path = directory / f"torch_report_{name}.json"
        report_path.unlink(missing_ok=True)
        started = time.perf_counter()
        completed = subprocess.run(
            [args.torch_python, str(REPO / "peakflat_jax" / "xcheck" / "torch_side.py"),
             str(directory), "--case", name, "--json", str(report_path), "--reference",
             args.reference], capture_output=True, text=True)
        wall = time.perf_counter() - started
        line = next((ln for ln in completed.stdout.splitlines() if ln.startswith("xcheck ")),
                    f"xcheck {name}: no report (exit status {completed.returncode})")
        print(f"{line}; process {wall:.1f} s", flush=True)
        case = {"returncode": completed.returncode, "process_seconds": round(wall, 1),
                "line": line}
        if report_path.exists():
            report = json.loads(report_path.read_text())
            case["seconds"] = report["seconds"][name]
            case["failed"] = [
                f"{r['tensor']}: {r['difference']:.3e} > {r['tolerance']:.0e} (jax~f64 "
                f"{r.get('jax_vs_float64')}, torch~f64 {r.get('torch_vs_float64')})"
                for r in report["tensors"] if not r["passed"]]
        cases[name] = case
    now = datetime.datetime.now(datetime.timezone.utc)
    record = {
        "benchmark": "xcheck_time", "command": shlex.join(sys.argv),
        "date": now.isoformat(timespec="seconds"), "device": manifest["device"],
        "commit": manifest["commit"], "jax": jax.__version__, "config": args.config,
        "overrides": args.overrides, "dtype": args.dtype, "grouped_matmul": args.grouped_matmul,
        "reference": args.reference, "load_average_before": load_before,
        "load_average_after": os.getloadavg(), "export_seconds": round(export_seconds, 1),
        "export_lines": lines, "torch_side": cases,
    }
    out_dir = pathlib.Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    platform = jax.devices()[0].platform
    path = out_dir / f"xcheck_time_{args.config}_{platform}_{now:%Y%m%d-%H%M%S}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"record: {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
