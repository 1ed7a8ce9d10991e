"""The plan of the machine a process runs on: its device and host memory, the trainer's
check before compiling (``check_plan``), and the device total a measured peak is held to."""

from __future__ import annotations

import dataclasses
import functools

import jax

from peakflat_jax.config import Config
from peakflat_jax.plan import host_pool
from peakflat_jax.plan.errors import GIB, DoesNotFit
from peakflat_jax.plan.programs import Plan
from peakflat_jax.plan.report import format_table
from peakflat_jax.plan.search import largest_context, make_plan
from peakflat_jax.plan.terms import pinned_allocations

# ----------------------------------------------------------------------------------------------
# For the trainer and the benchmarks.


def read_device_memory(devices=None) -> int | None:
    """The allocator's limit of the first of ``devices`` this process holds (``bytes_limit``);
    None where the backend does not say (CPU)."""
    local = [d for d in (devices if devices is not None else jax.local_devices())
             if d.process_index == jax.process_index()]
    device = local[0]
    stats = device.memory_stats()
    return int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


def read_host_memory() -> int:
    """One device's share of the host memory a new process can get: the kernel's estimate
    (``MemAvailable`` of /proc/meminfo), else the physical memory where there is none. Not the
    total: on an H200 host 125.85 GiB in all, 124.86-124.89 available at a run's start, and a
    run planned to 124.0 was killed (plan.host_pool.OUTSIDE_PER_POOL_BYTE)."""
    import os

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


def check_plan(config: Config, mesh_or_devices, device_memory: int | None = None,
               host_memory: int | None = None) -> Plan:
    """The plan of ``config`` on a mesh (or a device count, or a list of devices) at its
    ``data.seq_len``, null knobs filled (``Plan.knobs``: run with these). Memories in bytes per
    device; None: ``train.device_memory_gib`` (``train.host_memory_gib``), else read from the
    devices (the host: its physical memory over its local devices). Raises DoesNotFit, with
    the table of terms and what to change, when the step does not fit. A CPU does not report
    its devices' memory: they live in the host's, so each is held to its share of the host
    (``cpu_device_memory``); without that, a config a thousand times too large reached
    XLA:CPU's compiler, which died of a division by zero (SIGFPE) emitting the T x T attention
    scores at T = 2^20."""
    devices = None
    if isinstance(mesh_or_devices, int):
        num_devices = mesh_or_devices
    elif hasattr(mesh_or_devices, "devices") and hasattr(mesh_or_devices, "shape"):
        devices = list(mesh_or_devices.devices.flat)
        num_devices = len(devices)
    else:
        devices = list(mesh_or_devices)
        num_devices = len(devices)
    platform = devices[0].platform if devices else jax.devices()[0].platform
    platform = "gpu" if platform in ("gpu", "cuda", "rocm") else "cpu"
    if device_memory is None and config.train.device_memory_gib:
        device_memory = int(config.train.device_memory_gib * GIB)
    if device_memory is None:
        device_memory = read_device_memory(devices)
    if host_memory is None and config.train.host_memory_gib:
        host_memory = int(config.train.host_memory_gib * GIB)
    if host_memory is None:
        host_memory = read_host_memory()
    plan_here = functools.partial(make_plan, config, num_devices, device_memory=device_memory,
                                  host_memory=host_memory, platform=platform, baseline=False,
                                  search_context=False)
    with host_pool.own_cap_unset() as own_cap:
        plan = plan_here()
    if own_cap is not None:
        pinned = pinned_allocations(plan.knobs, plan.terms)
        if not pinned or host_pool.planned_limit_gib(pinned) != own_cap:
            # Another device memory than the config's chose knobs the cap was not planned
            # for: plan them under the cap that is set.
            plan = plan_here()
    if plan.device_memory is None and platform == "cpu":
        # After choosing the knobs: those chosen with the memory unknown (the lightest) stay.
        plan = dataclasses.replace(plan, device_memory=cpu_device_memory(host_memory))
    if plan.fits_device is False or plan.fits_host is False:
        # The table's last line is the largest context that does fit (a closed-form search).
        # The plan's config: its auto operators chosen (the search needs them resolved).
        largest = largest_context(plan.config, num_devices, device_memory=plan.device_memory,
                                  host_memory=host_memory, platform=platform, knobs=plan.knobs)
        plan = dataclasses.replace(plan, largest_context=largest)
        raise DoesNotFit(f"{config.name} does not fit: {plan.reasons()[0]}\n"
                         + format_table(plan))
    return plan


def device_total_bytes(config: Config, num_devices: int, context: int | None = None, *,
                       platform: str | None = None, device_memory: int | None = None) -> int:
    """The plan's device total (the largest program) for ``config`` at ``context`` (default
    ``data.seq_len``), null knobs filled as ``check_plan`` fills them for the trainer (the device
    memory: ``device_memory``, else ``train.device_memory_gib``, else the local device's):
    what a measured peak is held against. ``platform``: default the local devices'."""
    if platform is None:
        platform = "gpu" if jax.devices()[0].platform in ("gpu", "cuda", "rocm") else "cpu"
    if device_memory is None and config.train.device_memory_gib:
        device_memory = int(config.train.device_memory_gib * GIB)
    if device_memory is None:
        device_memory = read_device_memory()
    return make_plan(config, num_devices, context=context, device_memory=device_memory,
                     platform=platform, baseline=False, search_context=False).total_bytes
