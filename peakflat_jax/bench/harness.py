"""What every benchmark shares: timing, one case per fresh process, and the results record.

A benchmark module defines ``run_case(case: dict) -> dict`` (runs in the current process) and a
list of cases per preset. ``run_suite`` runs each case in a new process (``python -m MODULE
--case JSON``) so that every peak-memory reading is that case's own, then writes one JSON record
(command, device, date, versions, numbers) under the results directory.
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import platform
import re
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import jax

from peakflat_jax import memory
from peakflat_jax.train import device_profile

RESULTS_DIR = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "results"


def time_call(fn: Callable, *args, warmup: int = 2, repeats: int = 10) -> dict:
    """Median and spread of wall time of ``fn(*args)``, synchronised on its outputs."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        samples.append(time.perf_counter() - start)
    return {"median_s": statistics.median(samples), "min_s": min(samples),
            "max_s": max(samples), "repeats": repeats}


def measure_compiled(compiled, args, devices, case: dict) -> dict:
    """Times a compiled step (warm-up and repeats from ``case``) and reads its memory: the
    fields every benchmark record shares."""
    timing = time_fields(compiled, args, case)
    measured = {**timing, "peak_bytes": peak_bytes_over(devices), **plan_fields(compiled)}
    if case.get("trace_steps"):
        # After the timing, so that the profiler does not slow the timed calls.
        measured["device_profile"] = trace_fields(compiled, args, case)
    return measured


def time_fields(compiled, args, case: dict) -> dict:
    """The median, min and max seconds of ``compiled(*args)`` with ``case``'s warm-up and
    repeats."""
    timing = time_call(compiled, *args, warmup=case.get("warmup", 1),
                       repeats=case.get("repeats", 10))
    return {"time_s": timing["median_s"], "time_min_s": timing["min_s"],
            "time_max_s": timing["max_s"], "repeats": timing["repeats"]}


def plan_fields(compiled) -> dict:
    """XLA's memory plan of a compiled step and its largest array: known before it runs, so
    also recorded for a step whose buffers do not fit."""
    plan = memory.compiled_memory(compiled)
    largest = memory.largest_arrays(compiled, count=1)
    return {"xla_temp_bytes": plan.temp, "xla_argument_bytes": plan.argument,
            "xla_output_bytes": plan.output, "xla_host_temp_bytes": plan.host_temp,
            "largest_array": largest[0][1] if largest else None,
            "largest_array_elements": largest[0][0] if largest else 0}


def trace_fields(compiled, args, case: dict) -> dict:
    """``device_profile`` of ``case["trace_steps"]`` calls. Where ``$PEAKFLAT_ARTIFACTS`` names
    a folder, the trace and the optimized HLO are also kept there (one .tar.gz per case, named
    by ``case["label"]``) for reading offline."""
    keep = os.environ.get("PEAKFLAT_ARTIFACTS")
    if not keep:
        return device_profile.profile_call(compiled, *args, steps=case["trace_steps"])
    label = re.sub(r"[^A-Za-z0-9_.-]+", "_", case.get("label", "case"))
    return device_profile.profile_call(compiled, *args, steps=case["trace_steps"],
                                       keep_as=pathlib.Path(keep) / f"trace_{label}.tar.gz",
                                       hlo_text=compiled.as_text())


def peak_bytes_over(devices) -> int | None:
    """The largest allocator peak over the devices a case used (None on CPU)."""
    peaks = [memory.peak_device_bytes(d) for d in devices]
    return None if any(p is None for p in peaks) else max(peaks)


def describe_device() -> str:
    devices = jax.devices()
    return f"{len(devices)} x {devices[0].device_kind} ({jax.default_backend()})"


def git_commit() -> str:
    """The commit measured: PEAKFLAT_COMMIT where the tree travels without .git (GPU machines)."""
    if os.environ.get("PEAKFLAT_COMMIT"):
        return os.environ["PEAKFLAT_COMMIT"]
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, cwd=RESULTS_DIR.parent.parent).stdout.strip()
    except OSError:
        commit = ""
    return commit or "unknown"


def case_main(run_case: Callable[[dict], dict]) -> None:
    """The ``--case JSON`` entry point of a benchmark module: one case, one JSON line out."""
    case = json.loads(sys.argv[sys.argv.index("--case") + 1])
    try:
        result = run_case(case)
    except Exception as error:  # an OOM is a result, not a crash of the suite
        result = error_fields(error)
    print(json.dumps({**case, **result, "device": describe_device()}))


def error_fields(error: Exception) -> dict:
    """How a case failed: the exception's type, whether it was an out-of-memory, its message."""
    message = str(error)
    return {"error": type(error).__name__,
            "oom": "RESOURCE_EXHAUSTED" in message or "out of memory" in message.lower(),
            "message": message[:2000]}


def run_suite(module: str, name: str, preset: str, cases: list[dict], *, command: str,
              out_dir: pathlib.Path | None = None, timeout: float = 900) -> dict:
    """Runs every case in a fresh process and writes ``<out_dir>/<name>_<preset>_<date>.json``,
    rewritten after each case so that a run cut off by a time limit keeps what it measured."""
    now = datetime.datetime.now(datetime.timezone.utc)
    record = {
        "benchmark": name, "preset": preset, "command": command,
        # The device is named by the cases: the parent must not start a GPU backend, which
        # would hold the memory the cases measure.
        "date": now.isoformat(timespec="seconds"), "device": None,
        "jax": jax.__version__, "python": platform.python_version(), "commit": git_commit(),
        "cases": [],
    }
    out_dir = RESULTS_DIR if out_dir is None else pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}_{preset}_{now:%Y%m%d-%H%M%S}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")  # exists even if no case matched
    for case in cases:
        print(f"[{name}] {json.dumps(case)}", file=sys.stderr, flush=True)
        result = memory.run_in_fresh_process(module, ["--case", json.dumps(case)],
                                             timeout=timeout)
        record["cases"].append({**case, **result})
        record["device"] = record["device"] or result.get("device")
        print(f"[{name}] -> {json.dumps(result)}", file=sys.stderr, flush=True)
        path.write_text(json.dumps(record, indent=1) + "\n")
    record["path"] = str(path)
    return record


def new_record(kind: str, **fields) -> dict:
    """The header every record shares (what, command, device, date, versions, commit) and
    ``fields``: for scripts that measure in their own process."""
    now = datetime.datetime.now(datetime.timezone.utc)
    return {"benchmark": kind, "command": shlex.join([pathlib.Path(sys.argv[0]).name,
                                                      *sys.argv[1:]]),
            "date": now.isoformat(timespec="seconds"), "device": describe_device(),
            "jax": jax.__version__, "python": platform.python_version(),
            "commit": git_commit(), **fields}


def write_record(record: dict, out_dir: pathlib.Path | str | None = None) -> pathlib.Path:
    """Writes ``record`` as ``<out_dir>/<benchmark>_<platform>_<date>.json`` (default
    scripts/results) and returns the path."""
    out_dir = RESULTS_DIR if out_dir is None else pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.fromisoformat(record["date"]).strftime("%Y%m%d-%H%M%S")
    path = out_dir / f"{record['benchmark']}_{jax.default_backend()}_{stamp}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path


def format_bytes(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.3f} GiB"


def format_table(headers: list[str], rows: list[list]) -> str:
    """A markdown table, aligned so that it also reads well in a terminal."""
    widths = [max(len(str(x)) for x in column) for column in zip(headers, *rows)]

    def line(cells):
        return "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"

    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, rows)])
