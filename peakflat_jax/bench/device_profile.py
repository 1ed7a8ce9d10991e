"""Where a step's device time goes: a ``jax.profiler`` trace of a few calls, read back in the
same process and reduced to a small JSON-able summary (per stream: busy time; per HLO op or
kernel: time), so that a benchmark record can say what a ratio is made of without shipping the
trace.

    summary = device_profile.profile_call(compiled_step, *args, steps=2)

On a GPU the device planes are ``/device:GPU:<n>``; each of their lines is a stream (compute,
memcpy, NCCL), each event a kernel, tagged with its HLO op when XLA launched it. Times are per
call (the trace's totals divided by ``steps``). A stream's busy time is the union of its events'
intervals, so the sum of per-op times can exceed it only where kernels on one stream overlap.
"""

from __future__ import annotations

import collections
import glob
import tempfile
from collections.abc import Callable, Iterable

import jax
from jax.profiler import ProfileData

DEVICE_PLANE_PREFIX = "/device:"


def profile_call(fn: Callable, *args, steps: int = 2, top: int = 40,
                 plane_prefix: str = DEVICE_PLANE_PREFIX) -> dict:
    """Traces ``steps`` calls of ``fn(*args)`` (call it once before, to compile) and summarizes
    the planes whose names start with ``plane_prefix``."""
    if steps < 1:
        raise ValueError(f"steps: expected a positive int, got {steps!r}")
    with tempfile.TemporaryDirectory() as directory:
        with jax.profiler.trace(directory):
            for _ in range(steps):
                jax.block_until_ready(fn(*args))
        paths = glob.glob(f"{directory}/**/*.xplane.pb", recursive=True)
        if not paths:
            return {"error": "the profiler wrote no .xplane.pb"}
        events = list(_events(ProfileData.from_file(paths[0]), plane_prefix))
    if not events:
        return {"error": f"no events on planes starting with {plane_prefix!r}"}
    return summarize_events(events, steps=steps, top=top)


def _events(data: ProfileData, plane_prefix: str):
    """(plane/line, name, start_ns, duration_ns) of every event on the chosen planes; the name is
    the event's HLO op where XLA tagged one, else the event's own name."""
    for plane in data.planes:
        if not plane.name.startswith(plane_prefix):
            continue
        for line in plane.lines:
            for event in line.events:
                stats = dict(event.stats)
                name = stats.get("hlo_op") or event.name
                yield f"{plane.name}/{line.name}", str(name), event.start_ns, event.duration_ns


def summarize_events(events: Iterable[tuple[str, str, float, float]], *, steps: int,
                     top: int) -> dict:
    """Per line (stream): busy milliseconds per call and event count; per name: milliseconds per
    call, the ``top`` largest, and the rest summed."""
    by_line, by_name = collections.defaultdict(list), collections.Counter()
    for line, name, start, duration in events:
        by_line[line].append((start, start + duration))
        by_name[name] += duration
    streams = {line: {"busy_ms": _union_ns(intervals) / 1e6 / steps,
                      "events": len(intervals) // steps}
               for line, intervals in sorted(by_line.items())}
    ranked = by_name.most_common()
    rest = sum(duration for _, duration in ranked[top:])
    return {"steps": steps, "streams": streams,
            "ops_ms": {name: duration / 1e6 / steps for name, duration in ranked[:top]},
            "other_ops_ms": rest / 1e6 / steps}


def _union_ns(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of ``[start, end)`` intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total
