"""A trace of a few training steps (``train.profile_steps``): ``jax.profiler`` records the steps
after the first (which compiles) into the run directory's ``profile/``, and ``profile.json``
reduces it to what a reader asks first: each device's streams' busy time, the top ops, and how
much of the host copies (the offloaded optimizer's state, SCO's boundaries) ran under compute
(``bench.device_profile.host_copy_overlap``). The trace is written once, after the last traced
step; nothing else in the run changes.
"""

from __future__ import annotations

import glob
import json
import pathlib

import jax

from peakflat_jax.bench import device_profile


class StepProfiler:
    """Traces steps ``first + 1 .. first + count`` (1-based) of a run: call ``before(step)``
    ahead of each step and ``after(step)`` once it is done (its results fetched)."""

    def __init__(self, run_dir: pathlib.Path, first: int, count: int):
        self.directory = run_dir / "profile"
        self.first, self.last = first + 1, first + count
        self.active = False

    def before(self, step: int) -> None:
        """``step``: the step about to run (1-based)."""
        if step == self.first and self.first <= self.last and jax.process_index() == 0:
            jax.profiler.start_trace(str(self.directory))
            self.active = True

    def after(self, step: int) -> str | None:
        """``step``: the step just done (its results fetched). After the last traced one, stops
        the trace and writes ``profile.json``; the line the run prints about it, or None."""
        return self._stop(step) if self.active and step >= self.last else None

    def close(self, step: int) -> str | None:
        """At the end of the run (``step``: the last done): a trace the run stopped inside is
        closed over the steps it holds."""
        return self._stop(step) if self.active else None

    def _stop(self, step: int) -> str:
        jax.profiler.stop_trace()
        self.active = False
        summary = summarize(self.directory, max(1, step - self.first + 1))
        (self.directory.parent / "profile.json").write_text(json.dumps(summary, indent=1))
        return describe(summary, self.directory)


def summarize(directory: pathlib.Path, steps: int) -> dict:
    """``device_profile``'s summary of the trace under ``directory`` over ``steps`` steps, with
    the host copies' overlap per device; ``{"error": ...}`` where the trace holds no device
    planes (a CPU's trace has only host threads)."""
    paths = sorted(glob.glob(f"{directory}/**/*.xplane.pb", recursive=True))
    if not paths:
        return {"steps": steps, "error": "the profiler wrote no .xplane.pb"}
    events = device_profile.trace_events(paths[-1])
    if not events:
        return {"steps": steps, "error": "the trace has no device planes (a CPU run's "
                                         "trace holds host threads only)"}
    summary = device_profile.summarize_events(events, steps=steps, top=40)
    summary["host_copies"] = device_profile.host_copy_overlap(events, steps=steps)
    return summary


def describe(summary: dict, directory: pathlib.Path) -> str:
    """One line: where the trace is and, for the first device, the host copies against the
    compute per step."""
    where = f"profile of {summary['steps']} step(s) in {directory}"
    if "error" in summary:
        return f"{where}: {summary['error']}"
    plane, copies = next(iter(summary["host_copies"].items()))
    return (f"{where}: {plane} computes {copies['compute_ms']:.1f} ms a step, copies to and "
            f"from the host {copies['host_copy_ms']:.1f} ms, {copies['overlapped_ms']:.1f} ms "
            f"of them under compute (profile.json)")
