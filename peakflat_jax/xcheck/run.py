"""``peakflat xcheck run``: both sides of the cross-check in one command, and a JSON record.

The JAX side runs in a child process (``peakflat xcheck export``), so that the device memory
JAX reserves is given back before PyTorch computes on the same GPU; the PyTorch side then runs
in this process, ``torch_side.py`` imported by its file path (it is a standalone file, not part
of the package's imports). Where this Python has no torch, the command exports and prints the
exact command for the PyTorch side instead, with exit status ``NOT_CHECKED``; or, given
``--torch-python``, runs the PyTorch side in that Python (the CPU machines' ``.venv-torch``).

The record (``<record_dir>/xcheck_<config>_<dtype>_<platform>_<date>.json``, like the
benchmarks' records): command, date, device of each side, jax and torch versions, commit, seed,
and per tensor its relative difference, tolerance, distance of each side from float64, and
pass / fail.
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
import pathlib
import shlex
import subprocess
import sys
import tempfile

TORCH_SIDE = pathlib.Path(__file__).resolve().parent / "torch_side.py"
REPO = pathlib.Path(__file__).resolve().parents[2]
RESULTS_DIR = REPO / "scripts" / "results"
NOT_CHECKED = 3
"""Exit status when the export was written but this Python cannot run the PyTorch side."""


def load_torch_side():
    """``torch_side.py`` as a module, imported by path (it needs torch, not the package)."""
    spec = importlib.util.spec_from_file_location("peakflat_xcheck_torch_side", TORCH_SIDE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def export_in_child(directory: pathlib.Path, *, config: str, overrides: list[str], dtype: str,
                    seed: int) -> None:
    """``peakflat xcheck export`` in a fresh process (its device memory is freed on exit)."""
    # The overrides (positional) go before the options: argparse takes no positionals after them.
    command = [sys.executable, "-m", "peakflat_jax.cli", "xcheck", "export", str(directory),
               *overrides, "--config", config, "--dtype", dtype, "--seed", str(seed)]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    completed = subprocess.run(command, env=env)
    if completed.returncode:
        raise SystemExit(f"peakflat xcheck run: the export failed (exit status "
                         f"{completed.returncode}): {shlex.join(command)}")


def torch_available() -> bool:
    return importlib.util.find_spec("torch") is not None


def check_in_child(python: str, directory: pathlib.Path, device: str | None,
                   reference: str) -> dict:
    """The PyTorch side run by another Python (e.g. .venv-torch/bin/python); its report."""
    with tempfile.TemporaryDirectory() as scratch:
        report_path = pathlib.Path(scratch) / "report.json"
        command = [python, str(TORCH_SIDE), str(directory), "--json", str(report_path),
                   "--reference", reference, *(["--device", device] if device else [])]
        completed = subprocess.run(command)
        if not report_path.exists():
            raise SystemExit(f"peakflat xcheck run: the PyTorch side wrote no report (exit "
                             f"status {completed.returncode}): {shlex.join(command)}")
        return json.loads(report_path.read_text())


def run(*, config: str, overrides: list[str], dtype: str, seed: int, directory: str | None,
        record_dir: str | None, torch_device: str | None, command: str,
        torch_python: str | None = None, reference: str = "float64") -> int:
    """Exports, checks, writes the record; returns the exit status (0 pass, 1 a difference
    beyond tolerance, ``NOT_CHECKED`` without torch). ``torch_python``: run the PyTorch side
    in that Python instead of this one; ``reference``: float64 or none (torch_side's)."""
    directory = pathlib.Path(directory or REPO / "runs" / f"xcheck-{config}-{dtype}-{seed}")
    export_in_child(directory, config=config, overrides=overrides, dtype=dtype, seed=seed)
    if torch_python:
        report = check_in_child(torch_python, directory, torch_device, reference)
        return write_record(report, directory, dtype=dtype, seed=seed, command=command,
                            record_dir=record_dir)
    if not torch_available():
        print(f"peakflat xcheck run: exported to {directory}, but torch is not installed in "
              f"this Python ({sys.executable}). Run the PyTorch side with:\n"
              f"  python {shlex.quote(str(TORCH_SIDE))} {shlex.quote(str(directory))}\n"
              f"in a Python with torch and numpy (bash scripts/xcheck_torch_env.sh makes one: "
              f".venv-torch/bin/python).", file=sys.stderr)
        return NOT_CHECKED
    torch_side = load_torch_side()
    import torch

    device = torch_device or ("cuda" if torch.cuda.is_available() else "cpu")
    report = torch_side.check(directory, device=device, reference=reference,
                              log=lambda line: print(line, flush=True))
    print(torch_side.format_report(report), flush=True)
    return write_record(report, directory, dtype=dtype, seed=seed, command=command,
                        record_dir=record_dir)


def write_record(report: dict, directory: pathlib.Path, *, dtype: str, seed: int, command: str,
                 record_dir: str | None) -> int:
    """Writes the run's record beside the benchmarks'; returns the exit status."""
    manifest = json.loads((directory / "manifest.json").read_text())
    now = datetime.datetime.now(datetime.timezone.utc)
    platform_name = "gpu" if "gpu" in manifest["device"] or "cuda" in manifest["device"] else (
        "cpu")
    record = {
        "benchmark": "xcheck", "command": command,
        "date": now.isoformat(timespec="seconds"), "device": manifest["device"],
        "torch_device": report["torch_device"], "jax": manifest["jax_version"],
        "torch": report["torch_version"], "commit": manifest["commit"],
        "config": manifest["config"], "overrides": manifest["overrides"], "dtype": dtype,
        "seed": seed, "matmul_precision": manifest["matmul_precision"],
        "export_dir": str(directory), "passed": report["passed"],
        "tolerances": report["tolerances"],
        "cases": {name: case["params"] for name, case in manifest["cases"].items()
                  if name != "model"},
        "seconds": report["seconds"], "tensors": report["tensors"],
    }
    out_dir = pathlib.Path(record_dir) if record_dir else RESULTS_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"xcheck_{manifest['config']}_{dtype}_{platform_name}_{now:%Y%m%d-%H%M%S}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"record: {path}", file=sys.stderr)
    return 0 if report["passed"] else 1
