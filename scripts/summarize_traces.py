"""Summaries of kept profiler traces (the .tar.gz archives that ``peakflat bench ...
--trace-steps N`` leaves under ``$PEAKFLAT_ARTIFACTS``), as a JSON record: per device and
stream, busy milliseconds per step; per op and per kernel family, milliseconds per step
(``peakflat_jax.bench.device_profile.summarize_events``). The archives themselves are too large
to keep in the repository; this is what the README's trace figures cite.

    PYTHONPATH=. python3 scripts/summarize_traces.py --steps 2 --commit 70e20c6 \\
        --source moe_dispatch_gpu_20261130-105150.json trace_*.tar.gz
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import shlex
import sys
import tarfile
import tempfile

from peakflat_jax.bench.harness import RESULTS_DIR
from peakflat_jax.train import device_profile


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("archives", nargs="+", help="trace_*.tar.gz from a traced bench run")
    parser.add_argument("--steps", type=int, required=True, help="steps the trace holds")
    parser.add_argument("--commit", required=True, help="the commit the traced run measured")
    parser.add_argument("--source", required=True, help="the bench record of the traced run")
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--out-dir", default=str(RESULTS_DIR))
    args = parser.parse_args(argv)
    now = datetime.datetime.now(datetime.timezone.utc)
    record = {"benchmark": "trace_summary", "command": shlex.join(["python3", *sys.argv]),
              "date": now.isoformat(timespec="seconds"), "commit": args.commit,
              "source_record": args.source, "steps": args.steps, "traces": {}}
    for archive in args.archives:
        with tempfile.TemporaryDirectory() as directory, tarfile.open(archive) as tar:
            tar.extract("trace.xplane.pb", directory, filter="data")
            events = device_profile.trace_events(f"{directory}/trace.xplane.pb")
        record["traces"][pathlib.Path(archive).name] = device_profile.summarize_events(
            events, steps=args.steps, top=args.top)
    path = pathlib.Path(args.out_dir) / f"trace_summary_{args.commit}_{now:%Y%m%d-%H%M%S}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"record: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
