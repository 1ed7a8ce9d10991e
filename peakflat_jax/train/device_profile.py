"""Where a step's device time goes: a ``jax.profiler`` trace of a few calls, read back in the
same process and reduced to a small JSON-able summary (per device and stream: busy time; per
device and HLO op or kernel: time), so that a benchmark record can say what a ratio is made of
without shipping the trace.

    summary = device_profile.profile_call(compiled_step, *args, steps=2)

On a GPU the device planes are ``/device:GPU:<n>``, one per device; each of their lines should
be a stream (compute, memcpy, NCCL), each event a kernel, tagged with its HLO op (``hlo_op``)
when XLA launched it. That layout is the profiler's documented one, not yet seen in a record of
ours: the first GPU run should be read with that in mind. Times are per call (the trace's
totals divided by ``steps``) and per plane (device), never summed over devices. A line's busy
time is the union of its events' intervals.
"""

from __future__ import annotations

import bisect
import collections
import glob
import io
import pathlib
import re
import tarfile
import tempfile
from collections.abc import Callable, Iterable

import jax
from jax.profiler import ProfileData

DEVICE_PLANE_PREFIX = "/device:"


def profile_call(fn: Callable, *args, steps: int = 2, top: int = 40,
                 plane_prefix: str = DEVICE_PLANE_PREFIX, keep_as: pathlib.Path | None = None,
                 hlo_text: str | None = None) -> dict:
    """Traces ``steps`` calls of ``fn(*args)`` (call it once before, to compile) and summarizes
    the planes whose names start with ``plane_prefix``. ``keep_as``: also write the trace (and
    ``hlo_text``, the program's optimized HLO, which names what the trace's ``hlo_op`` tags
    point at) into this .tar.gz."""
    if steps < 1:
        raise ValueError(f"steps: expected a positive int, got {steps!r}")
    with tempfile.TemporaryDirectory() as directory:
        with jax.profiler.trace(directory):
            for _ in range(steps):
                jax.block_until_ready(fn(*args))
        paths = glob.glob(f"{directory}/**/*.xplane.pb", recursive=True)
        if not paths:
            return {"error": "the profiler wrote no .xplane.pb"}
        if keep_as is not None:
            _archive(keep_as, paths[0], hlo_text)
        events = trace_events(paths[0], plane_prefix)
    if not events:
        return {"error": f"no events on planes starting with {plane_prefix!r}"}
    return summarize_events(events, steps=steps, top=top)


def _archive(path: pathlib.Path, trace: str, hlo_text: str | None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w:gz") as archive:
        archive.add(trace, arcname="trace.xplane.pb")
        if hlo_text is not None:
            data = hlo_text.encode()
            info = tarfile.TarInfo("program.hlo.txt")
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))


def trace_events(path: str, plane_prefix: str = DEVICE_PLANE_PREFIX) -> list[tuple]:
    """The events of a saved trace (``.xplane.pb``) on the planes starting with
    ``plane_prefix``, as ``summarize_events`` takes them."""
    return list(_events(ProfileData.from_file(path), plane_prefix))


def _events(data: ProfileData, plane_prefix: str):
    """(plane, line, op, kernel, start_ns, duration_ns) of every event on the chosen planes:
    ``op`` is the HLO op XLA tagged the event with (else the event's name), ``kernel`` the
    event's own name (on a GPU the kernel's, which a command buffer's op tag hides)."""
    for plane in data.planes:
        if not plane.name.startswith(plane_prefix):
            continue
        for line in plane.lines:
            for event in line.events:
                stats = dict(event.stats)
                name = stats.get("hlo_op") or event.name
                yield (plane.name, line.name, str(name), str(event.name), event.start_ns,
                       event.duration_ns)


def summarize_events(events: Iterable[tuple[str, str, str, str, float, float]], *, steps: int,
                     top: int) -> dict:
    """Per plane (device): each line's busy milliseconds per call and event count, the ``top``
    ops by milliseconds per call (the rest summed), and milliseconds per call of each kernel
    family (the kernel's name without a numeric suffix: ``loop_add_fusion_3`` counts as
    ``loop_add_fusion``)."""
    lines = collections.defaultdict(list)
    names = collections.defaultdict(collections.Counter)
    families = collections.defaultdict(collections.Counter)
    for plane, line, name, kernel, start, duration in events:
        lines[plane, line].append((start, start + duration))
        names[plane][name] += duration
        families[plane][re.sub(r"_\d+$", "", kernel)] += duration
    summary = {"steps": steps, "planes": {}}
    for plane in sorted(names):
        ranked = names[plane].most_common()
        summary["planes"][plane] = {
            "lines": {line: {"busy_ms": _union_ns(intervals) / 1e6 / steps,
                             "events": len(intervals) // steps}
                      for (p, line), intervals in sorted(lines.items()) if p == plane},
            "ops_ms": {name: duration / 1e6 / steps for name, duration in ranked[:top]},
            "other_ops_ms": sum(duration for _, duration in ranked[top:]) / 1e6 / steps,
            "kernel_families_ms": {kernel: duration / 1e6 / steps
                                   for kernel, duration in families[plane].most_common(top)}}
    return summary


HOST_COPY = re.compile(r"memcpy.?(h2d|d2h|htod|dtoh)", re.IGNORECASE)
"""An event that moves bytes between host and device memory (CUPTI names them MemcpyH2D and
MemcpyD2H)."""


def host_copy_overlap(events: Iterable[tuple[str, str, str, str, float, float]], *,
                      steps: int) -> dict:
    """Per plane (device), milliseconds per call: ``host_copy_ms``, the union of the host copies
    (``HOST_COPY``, on any stream); ``compute_ms``, the union of every other event; and
    ``overlapped_ms``, the time both ran at once. A copy the step waits for is exposed:
    ``host_copy_ms - overlapped_ms`` of it at most."""
    copies, compute = collections.defaultdict(list), collections.defaultdict(list)
    for plane, _, _, kernel, start, duration in events:
        (copies if HOST_COPY.search(kernel) else compute)[plane].append((start, start + duration))
    result = {}
    for plane in sorted(set(copies) | set(compute)):
        copy_ns, compute_ns = _union_ns(copies[plane]), _union_ns(compute[plane])
        both = copy_ns + compute_ns - _union_ns(copies[plane] + compute[plane])
        result[plane] = {"host_copy_ms": copy_ns / 1e6 / steps,
                         "compute_ms": compute_ns / 1e6 / steps,
                         "overlapped_ms": both / 1e6 / steps}
    return result


def exposed_host_copies(events: Iterable[tuple[str, str, str, str, float, float]], *,
                        steps: int, top: int = 20) -> dict:
    """Per plane (device), where the host copies ran beside no compute: ``exposed_ms`` a call
    (the copies' union less the compute's) and ``waited_ms``, that time by the op that ran next
    on the device once the gap closed (the op the gap held back, by its HLO name: a layer's
    attention, a write-back's command buffer), the ``top`` ops by milliseconds a call;
    ``"(none after)"`` for copies after the last compute. Milliseconds a call, as
    ``host_copy_overlap``'s."""
    copies, compute = collections.defaultdict(list), collections.defaultdict(list)
    for plane, _, op, kernel, start, duration in events:
        if HOST_COPY.search(kernel):
            copies[plane].append((start, start + duration))
        elif duration > 0:  # an instant marker holds nothing back
            compute[plane].append((start, start + duration, op))
    result = {}
    for plane in sorted(copies):
        busy = _merged([(start, end) for start, end, _ in compute[plane]])
        starts = sorted((start, op) for start, _, op in compute[plane])
        waited, total = collections.Counter(), 0.0
        for start, end in _merged(copies[plane]):
            for gap_start, gap_end in _uncovered(start, end, busy):
                total += gap_end - gap_start
                index = bisect.bisect_left(starts, (gap_end, ""))
                waited[starts[index][1] if index < len(starts) else "(none after)"] += (
                    gap_end - gap_start)
        result[plane] = {"exposed_ms": total / 1e6 / steps,
                         "waited_ms": {op: ns / 1e6 / steps for op, ns in waited.most_common(top)}}
    return result


def _merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of ``[start, end)`` intervals as disjoint intervals, in order."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


def _uncovered(start: float, end: float, busy: list[tuple[float, float]]):
    """The parts of ``[start, end)`` outside the disjoint, ordered intervals ``busy``."""
    cursor = start
    for index in range(max(0, bisect.bisect_right(busy, (start, float("inf"))) - 1), len(busy)):
        busy_start, busy_end = busy[index]
        if busy_start >= end:
            break
        if busy_end <= cursor:
            continue
        if busy_start > cursor:
            yield cursor, busy_start
        cursor = max(cursor, busy_end)
    if cursor < end:
        yield cursor, end


def _union_ns(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of ``[start, end)`` intervals."""
    return sum(end - start for start, end in _merged(intervals))
