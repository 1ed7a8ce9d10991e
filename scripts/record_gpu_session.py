"""One record of a GPU driver's runs (scripts/gpu_session.sh), from the logs it brought back.

    python scripts/record_gpu_session.py LOGS --commit SHA --date ISO --note TEXT \
        --run NAME='[XLA_FLAGS=...] peakflat train CONFIG overrides...' [--run ...] \
        [--extra NAME=FILE.json ...]

For each ``--run``: the command, the last lines of ``LOGS/NAME.log``, the trainer's numbers from
``LOGS/NAME_summary.json`` (median step, tokens/s, MFU, the allocator's peak, XLA's plan, the
host's VmHWM, losses) and of ``NAME_profile.json`` (host copies under compute), and what
``peakflat plan`` says of the same command here, at this checkout (platform gpu: the config's
device; its commit goes into the record as ``plan_commit``), so that a record holds the plan it
is held to. A run with no summary (killed, out of memory) keeps its
log. Writes ``scripts/results/<card>_session_gpu_<date>.json`` and prints its path."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import shlex
import subprocess
import sys

from peakflat_jax import cli

GIB = 2**30
RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def train_words(command: str) -> list[str] | None:
    """The arguments of a train command (``peakflat train ...`` or ``python3 -m
    peakflat_jax.cli train ...``, after any ``NAME=value`` environment words), or None."""
    words = shlex.split(command)
    while words and "=" in words[0] and not words[0].startswith("-"):
        words = words[1:]
    for prefix in (["peakflat", "train"], ["python3", "-m", "peakflat_jax.cli", "train"],
                   ["python", "-m", "peakflat_jax.cli", "train"]):
        if words[:len(prefix)] == prefix:
            return words[len(prefix):]
    return None


def plan_gib(command: str) -> dict | None:
    """What ``peakflat plan`` says here of a train command's config and overrides (as
    ``cli.plan_command`` keeps them), in GiB; None for a command that is no train command."""
    words = train_words(command)
    if words is None:
        return None
    args = cli.parse_arguments(cli.make_parser(), ["train", *words])
    plan_words = shlex.split(cli.plan_command(args.config, args.overrides))[2:]
    env = {k: v for k, v in os.environ.items() if k != "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"}
    out = subprocess.run([sys.executable, "-m", "peakflat_jax.cli", "plan", *plan_words,
                          "--json"], capture_output=True, text=True, check=False, env=env)
    try:
        plan = json.loads(out.stdout)
    except json.JSONDecodeError:
        return {"plan_error": (out.stderr or out.stdout).strip().splitlines()[-1:]}
    return {"plan_device_gib": round(plan["total_bytes"] / GIB, 2),
            "plan_host_gib": round(plan["host_bytes"] / GIB, 2),
            "plan_feasible": plan["feasible"]}


def run_record(logs: pathlib.Path, name: str, command: str) -> dict:
    record: dict = {"command": command}
    log = logs / f"{name}.log"
    if log.exists():
        lines = log.read_text().splitlines()
        # The trainer's banner: the knobs it ran with, those the planner filled in included.
        banner = [line for line in lines if " peakflat train " in line][:1]
        if banner:
            record["banner"] = banner[0].split(None, 1)[1]
        record["log_tail"] = lines[-8:]
    summary_path = logs / f"{name}_summary.json"
    if summary_path.exists():
        s = json.loads(summary_path.read_text())
        record.update(
            step_seconds=round(s["median_step_seconds"], 3),
            tokens_per_second=s["tokens_per_second"], mfu=s["mfu"],
            peak_device_bytes=s["peak_device_bytes"], xla_plan_bytes=s["xla_plan_bytes"],
            host_peak_bytes=s["host_peak_bytes"],
            peak_device_gib=round(s["peak_device_bytes"] / GIB, 2),
            host_peak_gib=round(s["host_peak_bytes"] / GIB, 2),
            losses=s["losses"], startup_seconds=s.get("startup_seconds"))
    profile_path = logs / f"{name}_profile.json"
    if profile_path.exists():
        profile = json.loads(profile_path.read_text())
        record["host_copies_ms_per_step"] = {
            device: {k: round(v, 1) for k, v in c.items()}
            for device, c in profile.get("host_copies", {}).items()}
        exposed = profile.get("host_copies_exposed", {})
        if "error" in exposed:  # the profile could not say where: its reason, as it is
            record["host_copies_exposed_ms_per_step"] = exposed
        elif exposed:
            record["host_copies_exposed_ms_per_step"] = {
                device: {"exposed_ms": round(e["exposed_ms"], 1),
                         "waited_ms": {op: round(ms, 1) for op, ms in e["waited_ms"].items()}}
                for device, e in exposed.items()}
    plan = plan_gib(command)
    if plan:
        record.update(plan)
    return record


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("logs", type=pathlib.Path)
    parser.add_argument("--commit", required=True)
    parser.add_argument("--date", required=True, help="the driver's start, ISO 8601")
    parser.add_argument("--note", required=True)
    parser.add_argument("--device", default="1 x NVIDIA H200 (nvidia-h200), 143771 MiB")
    parser.add_argument("--card", default="h200",
                        help="the card the runs had, the record's name: h200_session_gpu_...")
    parser.add_argument("--run", action="append", default=[], metavar="NAME=COMMAND")
    parser.add_argument("--extra", action="append", default=[], metavar="NAME=FILE.json",
                        help="a JSON file of the logs kept whole under runs[NAME]")
    args = parser.parse_args(argv)
    date = datetime.datetime.fromisoformat(args.date)
    runs = {}
    for item in args.run:
        name, _, command = item.partition("=")
        runs[name] = run_record(args.logs, name, command)
    for item in args.extra:
        name, _, path = item.partition("=")
        runs[name] = json.loads((args.logs / path).read_text())
    plan_commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                 text=True, check=False).stdout.strip() or "unknown"
    record = {"benchmark": "train", "date": date.isoformat(), "device": args.device,
              "jax": "0.11.2", "commit": args.commit, "plan_commit": plan_commit,
              "note": args.note, "runs": runs}
    path = RESULTS / f"{args.card}_session_gpu_{date:%Y%m%d-%H%M%S}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
