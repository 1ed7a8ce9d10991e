"""The host's memory over a run, from a GPU driver's sampler log (scripts/gpu_session.sh's
``sample``: a line a second, ``EPOCH VmHWM: N kB VmRSS: N kB MemAvailable: N kB``, the process's
fields missing before it starts), as the JSON a record's ``--extra`` takes.

    python scripts/host_samples.py LOGS/e2e_8x_mem.log > LOGS/e2e_8x_host.json

``outside_at_max_rss_gib``: what the machine lost beyond the process's resident set at the
sample where that set was largest (available at the start - available then - resident then):
the kernel's and the driver's share of the pinned pages (``pinned_outside_per_pool_byte`` in
peakflat_jax/plan/measured.json)."""

from __future__ import annotations

import json
import re
import sys

FIELD = re.compile(r"(VmHWM|VmRSS|MemAvailable):\s*(\d+)\s*kB")
GIB_KB = 2**20


def summarize(lines) -> dict:
    """The summary of a sampler log's lines (module doc); GiB to 2 decimals."""
    samples = [dict((name, int(kb)) for name, kb in FIELD.findall(line)) for line in lines]
    samples = [s for s in samples if "MemAvailable" in s]
    if not samples:
        raise ValueError("no sample with MemAvailable in the log")
    start = samples[0]["MemAvailable"]
    running = [s for s in samples if "VmRSS" in s]
    summary = {"samples": len(samples), "available_at_start_gib": round(start / GIB_KB, 2),
               "min_mem_available_gib": round(min(s["MemAvailable"] for s in samples) / GIB_KB,
                                              2)}
    if running:
        peak = max(running, key=lambda s: s["VmRSS"])
        summary.update(
            max_vmrss_gib=round(peak["VmRSS"] / GIB_KB, 2),
            max_vmhwm_gib=round(max(s.get("VmHWM", 0) for s in running) / GIB_KB, 2),
            outside_at_max_rss_gib=round(
                (start - peak["MemAvailable"] - peak["VmRSS"]) / GIB_KB, 2))
    return summary


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python scripts/host_samples.py SAMPLER_LOG")
    with open(sys.argv[1]) as log:
        print(json.dumps(summarize(log), indent=1))
