"""What a run says when XLA runs out of memory (``train.oom.describe``), and the step profiler's
promise that a diagnostic never stops a run (``train.profile.StepProfiler``): no trainer
compiled here."""

import json

import jax
import jax.numpy as jnp
import pytest

from peakflat_jax.train import oom, profile

DEVICE = ("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 37.46GiB with allocator "
          "GPU_0_bfc on device 0. [tf-allocator-allocation-error=''] "
          "[executable_name='jit_train_step']")


@pytest.mark.parametrize("message, expected", [
    (DEVICE, "out of device memory in jit_train_step (XLA tried to allocate 37.46 GiB on "
             "device 0)"),
    # Another allocator (a host pool at its cap, say): named, and not called the device's.
    ("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 2.00GiB with allocator "
     "host_memory_bfc [executable_name='jit_overlapped']",
     "out of memory of allocator host_memory_bfc in jit_overlapped (XLA tried to allocate "
     "2.00 GiB)"),
    ("RESOURCE_EXHAUSTED: too many open streams", "out of memory"),
])
def test_what_ran_out_is_named(message, expected):
    assert oom.describe(jax.errors.JaxRuntimeError(message)) == expected


def test_other_errors_are_not_out_of_memory():
    assert oom.describe(jax.errors.JaxRuntimeError("INVALID_ARGUMENT: bad shape")) is None
    assert oom.describe(MemoryError(DEVICE)) is None  # only jax's runtime errors


def test_a_trace_that_cannot_be_read_back_is_recorded_not_raised(tmp_path, monkeypatch):
    def unreadable(directory, steps):
        raise OSError("truncated trace")

    monkeypatch.setattr(profile, "summarize", unreadable)
    profiler = profile.StepProfiler(tmp_path, first=1, count=2)
    square = jax.jit(lambda x: x * x)
    lines = {}
    for step in (1, 2, 3, 4):  # steps 2 and 3 traced
        profiler.before(step)
        result = square(jnp.ones(4))
        lines[step] = profiler.after(step, result)
    assert [step for step, line in lines.items() if line] == [3]
    recorded = json.loads((tmp_path / "profile.json").read_text())
    assert recorded == {"steps": 2, "error": "the trace could not be read back: truncated trace"}
    assert "could not be read back" in lines[3]
    assert profiler.close(4) is None  # nothing left open
