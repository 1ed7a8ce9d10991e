"""Where a run's start-up goes: seconds from the process's start to its first step done, phase
by phase, and how much of each phase was XLA compiling (or loading a program from JAX's
persistent compilation cache).

The phases follow each other without a gap (each runs from the end of the one before it to its
own mark), so they add up to the seconds from the process's start to the end of the first step.
``peakflat train`` marks the first two, the trainer the rest:

- ``imports``: the interpreter, jax, the command and the trainer's modules, the config read;
- ``backend``: the distributed client and jax's backend (on a GPU, CUDA's start);
- ``setup``: the trainer made (mesh, the planner's check, the data pipeline) and the run
  directory checked;
- ``state``: the weights and the optimizer's state, the host-resident one too (a resume:
  restored from its checkpoint);
- ``data``: the metrics files opened and the first batch made and put on the devices;
- ``compile``: the step's programs compiled (or reused) and XLA's plan of each checked;
- ``first step``: the first step run to its loss.

A trainer made without the command (a test, a benchmark) opens its timeline with ``before``
(the process's start to the trainer) instead of the first two.

The process's start comes from Linux's /proc/self/stat (field 22, the start in clock ticks since
boot) against CLOCK_BOOTTIME, the clock of those ticks; elsewhere it is the time this module was
first imported, which the first phase then counts from.

Compiling: every XLA compile that jax reports (``jax.monitoring``'s backend-compile duration,
which includes a read from the persistent cache) is added to the phase it falls in; the
persistent cache's requests and hits likewise, where it has a directory.

Why: the trainer's log lines carry no timestamps, so the wall time of a start beyond its
compile and its steps had no account. One line and one dict, not a profiler: they cost nothing
and come with every run.
"""

from __future__ import annotations

import os
import time

import jax
from jax import monitoring

_IMPORTED = time.perf_counter()
"""The fallback origin where the process's start cannot be read."""
_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
_CACHE_EVENTS = {"/jax/compilation_cache/compile_requests_use_cache": "asked",
                 "/jax/compilation_cache/cache_hits": "hits"}
_TOTALS = {"xla_seconds": 0.0, "asked": 0, "hits": 0}
"""This process's XLA compile seconds and persistent-cache requests and hits since the first
``Timeline``, counted by the listeners below."""
_listening = False


def process_age() -> float | None:
    """Seconds since this process started, or None where /proc does not say (not Linux)."""
    try:
        with open("/proc/self/stat", "rb") as stat:
            # The command's name (field 2) is in parentheses and may hold spaces: split after it.
            fields = stat.read().rsplit(b")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - started
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    return age if age >= 0 else None


def _listen() -> None:
    global _listening
    if _listening:
        return

    def duration(event: str, seconds: float, **_) -> None:
        if event == _BACKEND_COMPILE:
            _TOTALS["xla_seconds"] += seconds

    def count(event: str, **_) -> None:
        if event in _CACHE_EVENTS:
            _TOTALS[_CACHE_EVENTS[event]] += 1

    monitoring.register_event_duration_secs_listener(duration)
    monitoring.register_event_listener(count)
    _listening = True


class Timeline:
    """The start-up's phases: ``mark(phase)`` ends one; ``seconds`` (phase: its seconds),
    ``xla_seconds`` (phase: its XLA compiling), ``cache`` (phase: [hits, requests] of the
    persistent cache, where it was asked), ``elapsed`` (seconds since the process's start at the
    last mark)."""

    def __init__(self):
        _listen()
        age = process_age()
        self.origin = time.perf_counter() - age if age is not None else _IMPORTED
        self.seconds: dict[str, float] = {}
        self.xla_seconds: dict[str, float] = {}
        self.cache: dict[str, list[int]] = {}
        self._last = self.origin
        self._totals = dict(_TOTALS)

    def mark(self, phase: str) -> None:
        """Ends ``phase``: the time since the last mark (or the process's start) is its."""
        now, totals = time.perf_counter(), dict(_TOTALS)
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self._last
        self.xla_seconds[phase] = (self.xla_seconds.get(phase, 0.0) + totals["xla_seconds"]
                                   - self._totals["xla_seconds"])
        asked = totals["asked"] - self._totals["asked"]
        # jax asks its cache for every program, also with no cache directory to read from.
        if asked and jax.config.jax_compilation_cache_dir:
            hits, requests = self.cache.get(phase, [0, 0])
            self.cache[phase] = [hits + totals["hits"] - self._totals["hits"],
                                 requests + asked]
        self._last, self._totals = now, totals

    @property
    def elapsed(self) -> float:
        return self._last - self.origin

    def now(self) -> float:
        """Seconds since the process's start, now."""
        return time.perf_counter() - self.origin

    def line(self) -> str:
        """One line: the total, then each phase with its XLA compiling where there was some and
        the persistent cache's hits where it was asked."""
        def phase(name: str) -> str:
            notes = []
            if self.xla_seconds[name] >= 0.05:
                notes.append(f"XLA {self.xla_seconds[name]:.1f}")
            if name in self.cache:
                hits, requests = self.cache[name]
                notes.append(f"{hits} of {requests} from the cache")
            return f"{name} {self.seconds[name]:.1f}" + (f" ({', '.join(notes)})" if notes
                                                         else "")
        return (f"started in {self.elapsed:.1f} s: "
                + ", ".join(phase(name) for name in self.seconds))

    def summary_fields(self) -> dict:
        """The summary's ``startup_seconds``, ``startup_xla_seconds``, ``startup_cache_hits``
        (phase: [hits, requests]), ``first_step_done_s`` (None before a first step) and
        ``done_s`` (seconds since the process's start now: what a run's wall time has beyond it
        is the process's exit)."""
        return {"startup_seconds": dict(self.seconds),
                "startup_xla_seconds": dict(self.xla_seconds),
                "startup_cache_hits": {k: list(v) for k, v in self.cache.items()},
                "first_step_done_s": self.elapsed if "first step" in self.seconds else None,
                "done_s": self.now()}
