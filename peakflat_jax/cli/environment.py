"""The process's environment for ``peakflat``'s commands: XLA's flags and jax's caches, set
before the backend starts (XLA reads them once). Only the command sets them."""

from __future__ import annotations

import os

from peakflat_jax import _xla_cpu

CPU_SCHEDULER_FLAG = _xla_cpu.CPU_SCHEDULER_FLAG
"""XLA:CPU's concurrency-optimized scheduler off: under it (jax 0.11.2's default) XLA:CPU paired
two different all-to-alls of the trainer's gradient program with PipelinedLLEP, the ring loss
and SCO (a conditional's exchange and an independent one, both keyed by channel 1), and some
executions gave wrong gradients, the loss right (docs/cpu_scheduler.md). XLA reads it once per
process, before its backends start: ``import peakflat_jax`` sets it (``peakflat_jax._xla_cpu``),
and so does every command here, ``PEAKFLAT_KEEP_CPU_SCHEDULER`` notwithstanding; only on a machine
without NVIDIA GPUs (``has_nvidia_gpus``). There the CPU backend runs no model program, only the
host-CPU AdamW's update (``optimizer.update_on: host_cpu``), which the flag serializes: its
schedule then chains a leaf's chunks one after another, 2 loops side by side where 16 may run
(``tests/test_train_optimizer.py::test_a_leafs_chunks_run_side_by_side``)."""

has_nvidia_gpus = _xla_cpu.has_nvidia_gpus


def prepare_environment() -> None:
    """Before jax's backends start: 8 simulated devices where the backend is the CPU (ignored by
    GPU backends), XLA:CPU's concurrency-optimized scheduler off where the machine has no GPU
    (``CPU_SCHEDULER_FLAG``), and room for the largest baselines on a GPU (JAX reserves 75% by
    default). A config's own XLA flags are added by ``add_config_flags``."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        flags = f"{flags} --xla_force_host_platform_device_count=8".strip()
    if "xla_cpu_enable_concurrency_optimized_scheduler" not in flags and not has_nvidia_gpus():
        flags = f"{flags} {CPU_SCHEDULER_FLAG}"
    os.environ["XLA_FLAGS"] = flags
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def add_config_flags(config) -> None:
    """``device.xla_flags`` of ``config`` added to ``XLA_FLAGS`` (a flag set there already
    wins); before the backend starts, which reads them once."""
    flags = os.environ.get("XLA_FLAGS", "")
    for flag in config.device.xla_flags:
        if flag.split("=")[0] not in flags:
            flags = f"{flags} {flag}".strip()
    os.environ["XLA_FLAGS"] = flags


def enable_compilation_cache() -> None:
    """JAX's persistent compilation cache (``train.machine.enable_compilation_cache``)."""
    from peakflat_jax.train.machine import enable_compilation_cache as enable

    enable()
