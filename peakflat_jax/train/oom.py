"""A run out of device memory: one line that says so, and a run directory that records it.

Where the planner's check is lifted (``train.device_memory_gib`` above the device's memory) or
its bound falls short, XLA's allocator runs out while a step compiles, runs or its result is
fetched, and jax raises ``JaxRuntimeError: RESOURCE_EXHAUSTED: Out of memory while trying to
allocate 37.46GiB with allocator GPU_0_bfc on device 0. ... [executable_name='jit_train_step']``
from wherever it noticed: ``peakflat train`` printed a traceback for a condition the user
caused. ``describe(error)`` reads such an error (None for any other) into what it names: the
program, the size asked for, the device. The trainer raises ``OutOfMemory`` with it, the step
and the plans, after writing a summary.json that says the run failed and why (a failed run
never looks finished); ``peakflat train`` prints it as one line and exits 1 (a run that
failed, not bad input: that is status 2, before anything compiles).
"""

from __future__ import annotations

import re

import jax

_SIZE = re.compile(r"allocat\w*\s+(?:request for\s+)?([0-9][0-9.]*)\s*([KMGT]i?B|bytes|B)\b")
_EXECUTABLE = re.compile(r"executable_name='([^']+)'")
_DEVICE = re.compile(r"on device (?:ordinal )?(\d+)")
_ALLOCATOR = re.compile(r"with allocator (\S+)")
_DEVICE_ALLOCATOR = re.compile(r"(GPU|gpu|cuda)_\d+_bfc")


class OutOfMemory(Exception):
    """A run stopped by an out-of-memory error of XLA; the message is one line (``Trainer.run``
    writes it, with the step and the plans)."""


def describe(error: BaseException) -> str | None:
    """``out of device memory in jit_train_step (XLA tried to allocate 37.46 GiB on device
    0)`` for jax's out-of-memory error, with what its message names of the three; None for any
    other error."""
    message = str(error)
    if not isinstance(error, jax.errors.JaxRuntimeError) or not (
            "RESOURCE_EXHAUSTED" in message or "out of memory" in message.lower()):
        return None
    executable, size, device = (_EXECUTABLE.search(message), _SIZE.search(message),
                                _DEVICE.search(message))
    allocator = _ALLOCATOR.search(message)
    # The device's allocator (XLA:GPU's BFC) or, named apart, any other: the pinned-host pool
    # at its cap, the host CPU's, a runtime's: not the device's memory, nor its advice.
    memory = ("device memory" if allocator and _DEVICE_ALLOCATOR.fullmatch(allocator.group(1))
              else f"memory of allocator {allocator.group(1)}" if allocator else "memory")
    where = f" in {executable.group(1)}" if executable else ""
    asked = [f"XLA tried to allocate {size.group(1)} {size.group(2)}" if size else "",
             f"on device {device.group(1)}" if device else ""]
    details = " ".join(part for part in asked if part)
    return f"out of {memory}{where}" + (f" ({details})" if details else "")
