"""Where a run's start-up goes (``peakflat_jax.train.startup``): the process's age against a child
process's known lifetime, and phases that follow each other and add up. (The trainer's own
timeline, in summary.json, is checked on the runs of test_train.py.)"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import pytest

from peakflat_jax.train import startup

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_process_age_is_the_time_since_the_process_started():
    """A child that sleeps 1 s before it asks is at least 1 s old, and no older than the time
    its parent saw it run."""
    code = ("import time; time.sleep(1.0); from peakflat_jax.train.startup import process_age; "
            "print(process_age())")
    started = time.perf_counter()
    child = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                           text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=120)
    lived = time.perf_counter() - started
    assert child.returncode == 0, child.stderr[-2000:]
    assert 1.0 <= float(child.stdout) <= lived


def test_phases_follow_each_other_and_add_up_to_the_time_since_the_start():
    timeline = startup.Timeline()
    before = timeline.now()  # the process's age when the timeline was opened, at least
    time.sleep(0.05)
    timeline.mark("first")
    jax.jit(lambda x: jnp.sin(x) * 3.25 + 0.125).lower(1.0).compile()  # XLA inside "second"
    time.sleep(0.05)
    timeline.mark("second")
    seconds = timeline.seconds
    assert list(seconds) == ["first", "second"]
    assert seconds["first"] >= before + 0.05 and seconds["second"] >= 0.05
    assert sum(seconds.values()) == pytest.approx(timeline.elapsed, abs=1e-9)
    assert timeline.xla_seconds["first"] == 0
    assert 0 < timeline.xla_seconds["second"] <= seconds["second"]
    line = timeline.line()
    assert line.startswith(f"started in {timeline.elapsed:.1f} s: first ") and ", second " in line
    fields = timeline.summary_fields()
    assert fields["startup_seconds"] == seconds and fields["first_step_done_s"] is None


def test_without_proc_the_timeline_counts_from_the_module_import(monkeypatch):
    def no_sysconf(name):
        raise ValueError(name)

    monkeypatch.setattr(startup.os, "sysconf", no_sysconf)
    assert startup.process_age() is None
    timeline = startup.Timeline()
    assert timeline.origin == startup._IMPORTED and timeline.now() > 0
