"""The machine a run is on, and the plan of a config on it.

The planner is pure (``peakflat_jax.plan``): this module reads what it needs from the machine
(the devices' platform, kind and memory, the host's available memory, the pinned-host pool's
cap in the environment, the data's statistics) and hands it over. ``plan_run`` is the plan
the trainer runs with; ``pool_cap_for_run`` the cap ``peakflat train`` sets before the backend
starts.
"""

from __future__ import annotations

import dataclasses
import os

import jax

from peakflat_jax.config import Config
from peakflat_jax.plan import GIB, DoesNotFit, Plan, make_plan
from peakflat_jax.plan.host_pool import LIMIT_VARIABLE, planned_cap_applies, planned_devices
from peakflat_jax.train.data import data_stats


def enable_compilation_cache() -> None:
    """JAX's persistent compilation cache on GPUs (PEAKFLAT_JAX_CACHE, default
    ~/.cache/peakflat_jax/xla; empty: off): a second run of a config skips XLA's compile. Not
    on CPUs unless PEAKFLAT_JAX_CACHE is set: multi-device CPU executables read back from it
    crashed in their collectives (jax 0.11.2). Every program is kept, however fast it compiled:
    with jax's usual 1 s floor, the start's small programs (the learning-rate schedule's eager
    ops, the initialisation's helpers, the batch's target count) were compiled again by every
    run, most of what a warm start still compiled (``peakflat_jax.train.startup`` counts it)."""
    directory = os.environ.get("PEAKFLAT_JAX_CACHE")
    if directory is None and jax.default_backend() != "cpu":
        directory = os.path.expanduser("~/.cache/peakflat_jax/xla")
    if directory:
        jax.config.update("jax_compilation_cache_dir", directory)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def platform_of(devices=None) -> str:
    """``gpu`` or ``cpu``: the platform of ``devices`` (default this process's)."""
    device = (list(devices) if devices is not None else jax.devices())[0]
    return "gpu" if device.platform in ("gpu", "cuda", "rocm") else "cpu"


def device_kind_of(devices=None) -> str | None:
    """The devices' kind (``NVIDIA H200``; ``cpu`` on a CPU)."""
    device = (list(devices) if devices is not None else jax.devices())[0]
    return "cpu" if platform_of([device]) == "cpu" else getattr(device, "device_kind", None)


def read_device_memory(devices=None) -> int | None:
    """The allocator's limit of the first of ``devices`` this process holds (``bytes_limit``);
    None where the backend does not say (CPU)."""
    local = [d for d in (devices if devices is not None else jax.local_devices())
             if d.process_index == jax.process_index()]
    stats = local[0].memory_stats()
    return int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


def read_host_memory() -> int:
    """One device's share of the host memory a new process can get: the kernel's estimate
    (``MemAvailable`` of /proc/meminfo), else the physical memory where there is none. Not the
    total: the kernel, the driver and other processes hold some of it."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    memory = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    return memory // max(1, jax.local_device_count())


def cpu_device_memory(host_memory: int) -> int:
    """What one CPU device may hold: its share of the host's memory (``host_memory``, per
    device), the memory its buffers come from. The host terms are held to the same share on
    their own, so a plan can overcommit it by up to twice; it refuses what cannot run."""
    return host_memory


def pool_cap_in_environment() -> int | None:
    """The pinned-host pool's cap XLA will take (``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB``), or
    None where it is unset; a value that is not a whole number of GiB is an error (XLA would
    not take it either)."""
    value = os.environ.get(LIMIT_VARIABLE)
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{LIMIT_VARIABLE}: expected a whole number of GiB, got {value!r}") \
            from None


def pool_cap_for_run(config: Config) -> int | None:
    """The pinned-host pool's cap a run of ``config`` sets before its backend starts (GiB):
    the plan's ``pinned_pool_cap_gib`` on the machine the config names (its device count, the
    device memory it names: ``train.device_memory_gib``, else ``device.memory_gib``; its host
    memory), where the config caps the pool (``device.pinned_host_pool: planned``, on a GPU,
    its device count known) and its plan pins anything; else None (XLA's own)."""
    if not planned_cap_applies(config):
        return None
    memory_gib = config.train.device_memory_gib or config.device.memory_gib
    host_gib = config.device.host_memory_gib
    plan = make_plan(config, planned_devices(config), platform="gpu",
                     device_memory=int(memory_gib * GIB) if memory_gib else None,
                     host_memory=int(host_gib * GIB) if host_gib else None,
                     data_stats=data_stats(config.data), baseline=False,
                     search_context=False)
    return plan.pinned_pool_cap_gib


def set_pool_cap(config: Config) -> int | None:
    """Sets ``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB`` to ``pool_cap_for_run(config)`` where it is
    unset and a cap is planned; returns the cap set (None: none). Call it before the backend
    starts: XLA reads the variable once."""
    if LIMIT_VARIABLE in os.environ or (cap := pool_cap_for_run(config)) is None:
        return None
    os.environ[LIMIT_VARIABLE] = str(cap)
    return cap


def plan_run(config: Config, mesh_or_devices, device_memory: int | None = None,
             host_memory: int | None = None) -> Plan:
    """The plan a run of ``config`` on a mesh (or a device count, or a list of devices) runs
    with: at its ``data.seq_len``, null knobs filled and ``auto`` operators chosen, on the
    memories given (bytes per device), else ``train.device_memory_gib`` and
    ``train.host_memory_gib``, else read here (a CPU device: its share of the host). The pool
    cap is the one in the environment where one is set: the plan ``peakflat plan`` makes where
    its own cap is that one, else the plan under that cap. Raises DoesNotFit, in at most four
    lines, where the closed form puts the step past the device by more than its measured
    margin (XLA's compiled plan has never been that far under it): compiling it would only
    say the same, slower. Otherwise the compile is the verdict (``Trainer.compile``)."""
    devices = None
    if isinstance(mesh_or_devices, int):
        num_devices = mesh_or_devices
    elif hasattr(mesh_or_devices, "devices") and hasattr(mesh_or_devices, "shape"):
        devices = list(mesh_or_devices.devices.flat)
        num_devices = len(devices)
    else:
        devices = list(mesh_or_devices)
        num_devices = len(devices)
    platform = platform_of(devices)
    if host_memory is None and config.train.host_memory_gib:
        host_memory = int(config.train.host_memory_gib * GIB)
    if host_memory is None:
        host_memory = read_host_memory()
    if device_memory is None and config.train.device_memory_gib:
        device_memory = int(config.train.device_memory_gib * GIB)
    if device_memory is None:
        device_memory = (cpu_device_memory(host_memory) if platform == "cpu"
                         else read_device_memory(devices))
    cap = pool_cap_in_environment() if platform == "gpu" else None

    def plan_with(limit: int | None) -> Plan:
        return make_plan(config, num_devices, device_memory=device_memory,
                         host_memory=host_memory, platform=platform,
                         device_kind=device_kind_of(devices), data_stats=data_stats(config.data),
                         pinned_pool_limit_gib=limit, baseline=False, search_context=False)

    plan = plan_with(None)
    if cap is not None and plan.pinned_pool_cap_gib != cap:
        plan = plan_with(cap)  # the cap set is another than this plan's own: plan under it
    if surely_too_large(plan):
        largest = make_plan(plan.config, num_devices, device_memory=device_memory,
                            host_memory=host_memory, platform=platform,
                            device_kind=device_kind_of(devices),
                            data_stats=data_stats(config.data), pinned_pool_limit_gib=cap,
                            baseline=False).largest_context
        raise DoesNotFit(refusal(dataclasses.replace(plan, largest_context=largest)))
    return plan


def surely_too_large(plan: Plan) -> bool:
    """Whether the closed form puts the step past the device by more than the margin it was
    measured with (its lowest measured ratio of XLA's plan to it), or past the host, or the
    pinned pool's cap: no compile would fit it."""
    low, _ = plan.target.measured.margin.get("device", (1.0, 1.0))
    device = plan.device_memory is not None and low * plan.total_bytes > plan.device_memory
    return device or plan.fits_host is False


def refusal(plan: Plan) -> str:
    """At most four lines: the verdict with the largest term, what to change, and the context
    that fits."""
    lines = [f"{plan.config.name} does not fit: {plan.reasons()[0]}"]
    lines += plan.reasons()[1:3]
    context = plan.largest_context
    lines.append("no context fits these settings" if context is None else
                 f"it fits up to data.seq_len={context} (`peakflat plan {plan.config.name} "
                 f"--largest` finds it by compiling)")
    return "\n".join(lines)
