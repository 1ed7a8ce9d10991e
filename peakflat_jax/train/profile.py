"""A trace of a few training steps (``train.profile_steps``): ``jax.profiler`` records the steps
after the first (which compiles) into the run directory's ``profile/``, and ``profile.json``
reduces it to what a reader asks first: each device's streams' busy time, the top ops, and how
much of the host copies (the offloaded optimizer's state, SCO's boundaries) ran under compute
(``bench.device_profile.host_copy_overlap``) and which ops the rest held back
(``exposed_host_copies``). The trace is written once, after the last traced
step; nothing else in the run changes.
"""

from __future__ import annotations

import glob
import json
import pathlib

import jax

from peakflat_jax.train import device_profile


class StepProfiler:
    """Traces steps ``first + 1 .. first + count`` (1-based) of a run: call ``before(step)``
    ahead of each step and ``after(step, state)`` once it is done. A failure of the trace (or
    of reading it back) is recorded in ``profile.json``, never raised: the run goes on."""

    def __init__(self, run_dir: pathlib.Path, first: int, count: int):
        self.directory = run_dir / "profile"
        self.first, self.last = first + 1, first + count
        self.active = self.done = False

    def before(self, step: int) -> None:
        """``step``: the step about to run (1-based); the trace starts at the first step of
        the window that runs (a step skipped for want of a valid target is not traced)."""
        if (not (self.active or self.done) and self.first <= step <= self.last
                and jax.process_index() == 0):
            self.first = step
            try:
                jax.profiler.start_trace(str(self.directory))
                self.active = True
            except Exception as error:  # noqa: BLE001 (a diagnostic never stops the run)
                self.done = True
                self._write({"steps": 0, "error": f"the profiler did not start: {error}"})

    def after(self, step: int, state=None) -> str | None:
        """``step``: the step just done; ``state``: what it made, waited for before the trace
        stops (the optimizer's own program and its host copies may still run after the loss
        is read). After the last traced step, stops the trace and writes ``profile.json``; the
        line the run prints about it, or None."""
        if not self.active or step < self.last:
            return None
        if state is not None:
            jax.block_until_ready(state)
        return self._stop(step)

    def close(self, step: int) -> str | None:
        """At the end of the run (``step``: the last done), however it ends: a trace the run
        stopped inside is closed over the steps it holds."""
        return self._stop(step) if self.active else None

    def _stop(self, step: int) -> str:
        self.active, self.done = False, True
        try:
            jax.profiler.stop_trace()
            summary = summarize(self.directory, max(1, step - self.first + 1))
        except Exception as error:  # noqa: BLE001 (a diagnostic never stops the run)
            summary = {"steps": max(0, step - self.first + 1),
                       "error": f"the trace could not be read back: {error}"}
        self._write(summary)
        return describe(summary, self.directory)

    def _write(self, summary: dict) -> None:
        self.directory.parent.mkdir(parents=True, exist_ok=True)
        (self.directory.parent / "profile.json").write_text(json.dumps(summary, indent=1))


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
    try:
        summary["host_copies_exposed"] = device_profile.exposed_host_copies(events, steps=steps)
    except Exception as error:  # noqa: BLE001 (the totals above stand without it)
        summary["host_copies_exposed"] = {"error": f"{type(error).__name__}: {error}"}
    return summary


def describe(summary: dict, directory: pathlib.Path) -> str:
    """One line: where the trace is and, for the first device, the host copies against the
    compute per step."""
    where = f"profile of {summary['steps']} step(s) in {directory}"
    if "error" in summary:
        return f"{where}: {summary['error']}"
    plane, copies = next(iter(summary["host_copies"].items()))
    waited = summary.get("host_copies_exposed", {}).get(plane, {}).get("waited_ms", {})
    held = "".join(f", {ms:.1f} ms after the last op" if op == "(none after)" else
                   f", {ms:.1f} ms before {op}" for op, ms in list(waited.items())[:2])
    return (f"{where}: {plane} computes {copies['compute_ms']:.1f} ms a step, copies to and "
            f"from the host {copies['host_copy_ms']:.1f} ms, {copies['overlapped_ms']:.1f} ms "
            f"of them under compute{held} (profile.json)")
