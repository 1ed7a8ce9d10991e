"""Probe (GPU, compile only): what XLA's buffer plan holds for the SCO benchmark's step.

Compiles the step of ``peakflat bench sco --preset gpu`` for each ``--offload`` (nothing runs,
nothing is allocated) with XLA's dumps on, and records per case the memory analysis and the
plan's allocations of at least ``--min-gb`` with the values that share each, from XLA's
memory-usage report. It answers which buffers make up the temporaries, e.g. whether backward's
stacked parameter gradients live in the output buffer or in a temporary beside it.

    PYTHONPATH=. python3 scripts/probes/probe_sco_plan.py --offload 12 24 --out-dir DIR
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import pathlib
import subprocess
import sys
import tempfile


def plan_of_case(offload: int, min_bytes: float) -> dict:
    """In this process: compile one case with dumps on and read the plan."""
    import jax
    import jax.numpy as jnp

    from peakflat_jax.bench import harness, sco
    from peakflat_jax.ops.sco import sco_scan

    case = dict(next(c for c in sco.presets()["gpu"] if c["method"] == "scan"),
                method="sco", offload=offload)
    layers, tokens, hidden = case["layers"], case["tokens"], case["hidden"]
    dtype, width = jnp.dtype(case["dtype"]), case["mlp"] * case["hidden"]
    if jax.default_backend() == "cpu":  # a small stand-in, to check the probe itself
        layers, tokens, hidden, width, dtype = 4, 256, 64, 256, jnp.dtype(jnp.float32)
        case.update(attention="xla", heads=4)
    h = jax.ShapeDtypeStruct((tokens, hidden), dtype)
    params = {"qkv": jax.ShapeDtypeStruct((layers, hidden, 3 * hidden), dtype),
              "out": jax.ShapeDtypeStruct((layers, hidden, hidden), dtype),
              "up": jax.ShapeDtypeStruct((layers, hidden, width), dtype),
              "down": jax.ShapeDtypeStruct((layers, width, hidden), dtype)}
    layer = sco.decoder_layer(case)
    step = jax.jit(jax.value_and_grad(
        lambda h, p: jnp.mean(sco_scan(layer, h, p, offload=min(offload, layers))
                              .astype(jnp.float32) ** 2), argnums=(0, 1)))
    compiled = step.lower(h, params).compile()
    analysis = compiled.memory_analysis()
    reports = glob.glob(os.path.join(os.environ["PROBE_DUMP_DIR"], "*memory-usage-report.txt"))
    report = max(reports, key=os.path.getsize) if reports else None
    allocations = []
    for line in open(report).read().splitlines() if report else []:
        cells = [cell.strip() for cell in line.split(";")]
        if len(cells) == 5 and cells[1].endswith("iB"):
            size = _bytes(cells[1])
            if size >= min_bytes:
                allocations.append({"size": cells[1], "values": int(cells[3]),
                                    "shapes": cells[4][:400]})
    return {"offload": offload, "boundary_bytes": tokens * hidden * dtype.itemsize,
            "temp_bytes": analysis.temp_size_in_bytes,
            "output_bytes": analysis.output_size_in_bytes,
            "argument_bytes": analysis.argument_size_in_bytes,
            "host_temp_bytes": getattr(analysis, "host_temp_size_in_bytes", None),
            "report": os.path.basename(report) if report else None,
            "allocations": allocations, "device": harness.describe_device()}


def _bytes(text: str) -> float:
    units = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    for unit in sorted(units, key=len, reverse=True):
        if text.endswith(unit):
            return float(text[: -len(unit)]) * units[unit]
    raise ValueError(f"size: cannot read {text!r}")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--offload", type=int, nargs="+", default=[12, 24])
    parser.add_argument("--min-gb", type=float, default=0.25)
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--case", type=int, help=argparse.SUPPRESS)  # one case, in this process
    args = parser.parse_args()
    if args.case is not None:
        print(json.dumps(plan_of_case(args.case, args.min_gb * 1e9)))
        return 0
    from peakflat_jax.bench import harness

    cases = []
    for offload in args.offload:  # a fresh process each: dumps and plans of one compile
        with tempfile.TemporaryDirectory() as dump:
            env = dict(os.environ, PROBE_DUMP_DIR=dump,
                       XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={dump}")
            done = subprocess.run([sys.executable, __file__, "--case", str(offload),
                                   "--min-gb", str(args.min_gb), "--out-dir", args.out_dir],
                                  env=env, capture_output=True, text=True)
        lines = done.stdout.strip().splitlines()
        cases.append(json.loads(lines[-1]) if done.returncode == 0 and lines else
                     {"offload": offload, "error": done.stderr[-2000:]})
        print(json.dumps(cases[-1])[:1500], flush=True)
    out = pathlib.Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    platform = harness.describe_device().split()[-1].strip("()")
    path = out / f"sco_plan_{platform}_{datetime.datetime.now():%Y%m%d-%H%M%S}.json"
    path.write_text(json.dumps({"command": " ".join(sys.argv), "commit": harness.git_commit(),
                                "date": datetime.datetime.now().isoformat(timespec="seconds"),
                                "cases": cases}, indent=1))
    print(f"record: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
