"""The closed form of today's code beside what the GPU records measured: the margin a plan
states (``peakflat_jax/plan/measured.json``).

    python scripts/compare_records.py [--since 2026-12-04T18:44] [--all] [--json]

Reads every session record under scripts/results/ (``*_gpu_*.json`` with ``runs``: each run's
command, the trainer's banner and summary, or a ``peakflat plan --check`` log) and, per run,
plans the command's config and overrides with today's planner on the machine the config names
(the run's resident optimizer groups and pinned-pool cap as its banner and log say), then
prints each measured figure beside the closed form and their ratio (measured / closed form):

* ``xla_plan``: XLA's compiled plan of the largest program (the trainer's summary), against
  the closed form's device total;
* ``peak``: the allocator's peak, against the same;
* ``check:PROGRAM``: XLA's plan of one program from a ``--check`` log, against the closed
  form's program of the same role;
* ``host``: the process's peak resident memory (VmHWM), against the closed form's host terms.

The ranges per device kind are over the records since ``--since`` (default: the first records
of the overlapped step as the trainer builds it today, its MoE weights and gradients written in
place); older records measured programs since changed and are listed with ``--all`` only.
Figures of runs whose trainer ordered the dense FFN's backward (before that switch was
removed) are today's programs but for that order. Nothing here runs on a GPU.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import shlex
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "scripts" / "results"
GIB = 2**30
PLAN_PROGRAM = {"train_step": "gradient", "gradient_step": "gradient",
                "overlapped_step": "overlapped", "optimizer_step": "optimizer_step"}


def command_of(command: str) -> tuple[str, str, list[str]] | None:
    """(subcommand, config, overrides) of a ``peakflat train|plan`` command line, or None."""
    words = shlex.split(command)
    for i, word in enumerate(words):
        if word in ("train", "plan") and i and words[i - 1] in ("peakflat", "peakflat_jax.cli"):
            rest = words[i + 1:]
            config = rest[0]
            overrides = [w for w in rest[1:] if "=" in w and not w.startswith("-")]
            return word, config, overrides
    return None


def resident_groups(banner: str | None) -> int | None:
    """The optimizer groups the trainer kept resident, as its banner says (None: not said)."""
    if not banner or "optimizer offloaded" not in banner:
        return None
    found = re.search(r"offloaded \((\d+) of \d+ groups", banner)
    return int(found.group(1)) if found else 0


def pool_cap(log: list[str]) -> int | None:
    for line in log:
        found = re.search(r"pinned-host pool limit (\d+) GiB", line)
        if found:
            return int(found.group(1))
    return None


def checked_programs(log: list[str]) -> dict[str, float]:
    """XLA's total (GiB) per program of a ``--check`` table in a log."""
    out = {}
    for line in log:
        parts = line.split("|")
        if len(parts) != 3:
            continue
        head = parts[0].split()
        name = next((w for w in head if w in PLAN_PROGRAM), None)
        numbers = parts[1].split()
        if name and numbers:
            try:
                out[name] = float(numbers[-1])
            except ValueError:
                continue
    return out


def closed_form(config_name: str, overrides: list[str], banner: str | None, cap: int | None):
    """Today's plan of a run's config as it ran."""
    from peakflat_jax.hf.config import load_config
    from peakflat_jax.plan import make_plan
    from peakflat_jax.train.data import data_stats

    resident = resident_groups(banner)
    extra = [] if resident is None else [f"optimizer.resident_groups={resident}"]
    config = load_config(config_name, [*overrides, *extra])
    device = config.train.device_memory_gib or config.device.memory_gib
    host = config.train.host_memory_gib or config.device.host_memory_gib
    return make_plan(config, config.device.count or config.mesh.data * config.mesh.seq,
                     platform="gpu", device_kind=config.device.kind,
                     device_memory=int(device * GIB) if device else None,
                     host_memory=int(host * GIB) if host else None,
                     data_stats=data_stats(config.data), pinned_pool_limit_gib=cap,
                     baseline=False, search_context=False)


def figures(record: pathlib.Path) -> list[dict]:
    """Each measured figure of a record's runs beside today's closed form."""
    data = json.loads(record.read_text())
    runs = data.get("runs")
    if not isinstance(runs, dict):
        return []
    device = (data.get("device") or "").split(",")[0].split(" (")[0].removeprefix("1 x ")
    date = str(data.get("date", ""))[:16]
    rows = []
    for name, run in runs.items():
        parsed = command_of(run.get("command", ""))
        if parsed is None:
            continue
        _, config_name, overrides = parsed
        log = run.get("log_tail") or []
        try:
            plan = closed_form(config_name, overrides, run.get("banner"), pool_cap(log))
        except Exception as error:  # a config the planner refuses today: said, not measured
            rows.append(dict(record=record.name, run=name, date=date, device=device,
                             what="error", error=f"{type(error).__name__}: {error}"))
            continue
        measured = []
        for key, what in (("xla_plan_bytes", "xla_plan"), ("peak_device_bytes", "peak")):
            if run.get(key):
                measured.append((what, run[key], plan.total_bytes))
        for program, gib in checked_programs(log).items():
            role = PLAN_PROGRAM[program]
            if role in plan.programs:
                measured.append((f"check:{program}", gib * GIB, plan.programs[role]))
        if run.get("host_peak_bytes"):
            measured.append(("host", run["host_peak_bytes"], plan.host_bytes))
        for what, value, bound in measured:
            rows.append(dict(record=record.name, run=name, date=date, device=device, what=what,
                             measured_gib=value / GIB, closed_gib=bound / GIB,
                             ratio=value / bound, context=plan.knobs.context))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--since", default="2026-12-04T18:44",
                        help="the margin is over records dated at or after this")
    parser.add_argument("--all", action="store_true", help="list older records' figures too")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args(argv)
    rows = []
    for record in sorted(RESULTS.glob("*_gpu_*.json")):
        rows += figures(record)
    recent = [r for r in rows if r["date"] >= args.since]
    shown = rows if args.all else recent
    if args.json:
        print(json.dumps(shown, indent=1))
        return 0
    print(f"{'record':40} {'run':14} {'figure':22} {'context':>9} {'measured':>9} "
          f"{'closed':>9} {'ratio':>6}")
    for r in shown:
        if r["what"] == "error":
            print(f"{r['record']:40} {r['run']:14} {r['error'][:80]}")
            continue
        print(f"{r['record']:40} {r['run']:14} {r['what']:22} {r['context']:>9,} "
              f"{r['measured_gib']:>9.2f} {r['closed_gib']:>9.2f} {r['ratio']:>6.3f}")
    print()
    for label, subset in ((f"since {args.since}", recent), ("all records", rows)):
        for device in sorted({r["device"] for r in subset}):
            for kind, test in (("device", lambda w: w != "host"), ("host", lambda w: w == "host")):
                ratios = [r["ratio"] for r in subset if r["device"] == device
                          and r["what"] != "error" and test(r["what"])]
                if ratios:
                    print(f"{label}, {device}, {kind}: measured / closed form "
                          f"{min(ratios):.3f}-{max(ratios):.3f} over {len(ratios)} figures")
    return 0


if __name__ == "__main__":
    sys.exit(main())
