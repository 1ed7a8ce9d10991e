"""XLA:CPU's concurrency-optimized scheduler off for every process that imports the package.

XLA:CPU of jax 0.11.2 can pair two different collectives of one program with each other: its
in-process rendezvous tells collectives apart by kind, devices and channel id, jax gives every
collective of a ``shard_map`` channel 1, and its runtime lets a device start a collective
before one that comes earlier in the program when the earlier one sits in a conditional or loop
whose other work runs on another thread. Devices that start two all-to-alls in different orders
then exchange each other's data: wrong values, with no error (docs/cpu_scheduler.md). The
concurrency-optimized scheduler (XLA:CPU's default) leaves such pairs unordered where the
memory-optimized one did not in the programs measured; ``CPU_SCHEDULER_FLAG`` selects the latter.

XLA reads ``XLA_FLAGS`` once, when jax starts its first backend, so ``protect_cpu_backend`` (run
by ``import peakflat_jax``) adds the flag to ``XLA_FLAGS`` if no backend has started yet, and
warns once otherwise. It leaves the environment alone where ``XLA_FLAGS`` already names the
option, where ``PEAKFLAT_KEEP_CPU_SCHEDULER`` is set (XLA's default kept: this repository's test
suite, whose operator memory tests hold XLA's default plans), and on a machine with NVIDIA GPUs
(there the CPU backend runs only the host-CPU AdamW, which the flag serializes:
``peakflat_jax.cli.CPU_SCHEDULER_FLAG``'s note).
"""

from __future__ import annotations

import glob
import os
import warnings

CPU_SCHEDULER_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"
"""XLA:CPU's memory-optimized scheduler instead of its concurrency-optimized default."""
OPTION = "xla_cpu_enable_concurrency_optimized_scheduler"
KEEP_VARIABLE = "PEAKFLAT_KEEP_CPU_SCHEDULER"
"""Set (to anything but empty) to keep XLA:CPU's default scheduler in a process that imports
the package."""

_warned = False


def has_nvidia_gpus() -> bool:
    """Whether the machine shows an NVIDIA GPU device node (``/dev/nvidia0``, ...): read before
    any backend starts."""
    return bool(glob.glob("/dev/nvidia[0-9]*"))


def protect_cpu_backend() -> str:
    """Adds ``CPU_SCHEDULER_FLAG`` to ``XLA_FLAGS`` where it applies (module doc). Returns what
    it did: ``"set"``, ``"warned"`` (a backend had started: too late to set), or why it left
    the flags as they were: ``"given"``, ``"kept"`` (``KEEP_VARIABLE``), ``"gpu"``."""
    global _warned
    flags = os.environ.get("XLA_FLAGS", "")
    if OPTION in flags:
        return "given"
    if os.environ.get(KEEP_VARIABLE):
        return "kept"
    if has_nvidia_gpus():
        return "gpu"
    from jax._src import xla_bridge

    started = getattr(xla_bridge, "backends_are_initialized", lambda: False)
    if started():
        if not _warned:
            _warned = True
            warnings.warn(
                f"peakflat_jax: jax started its backends before peakflat_jax was imported, so "
                f"XLA:CPU runs with its concurrency-optimized scheduler, under which XLA:CPU "
                f"(jax 0.11.2) can pair two different collectives of a program and give wrong "
                f"values without an error (docs/cpu_scheduler.md). Import peakflat_jax before "
                f"the first jax computation, or start the process with "
                f"XLA_FLAGS={CPU_SCHEDULER_FLAG} ({KEEP_VARIABLE}=1 silences this).",
                RuntimeWarning, stacklevel=2)
        return "warned"
    os.environ["XLA_FLAGS"] = f"{flags} {CPU_SCHEDULER_FLAG}".strip()
    return "set"
