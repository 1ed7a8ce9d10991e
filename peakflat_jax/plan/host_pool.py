"""XLA's pinned-host pool on a GPU: what a run's pinned_host arrays cost in resident memory.

On a GPU, XLA serves every ``pinned_host`` buffer (the streamed optimizer's buckets, SCO's
boundaries) from one BFC allocator per device over ``cuMemHostAlloc``
(``xla/pjrt/gpu/gpu_helpers.cc``, ``GetGpuHostAllocator``; ``tsl/framework/bfc_allocator.cc``).
The pool grows by regions: a request that does not fit the free space gets a new region of the
current region size, doubled until it holds the request (the first from 2 MiB), after which
the size doubles again; a region is ``min(size, limit - pool)``; nothing is returned to the
system before the process ends. The limit is ``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB`` (GiB,
default 64), read once when the backend starts. Page-locked memory is resident: the pool, not
the live bytes, is what the host holds, up to twice them.

``pool_bytes`` simulates the growth for a list of allocations; ``planned_limit_gib`` is the cap
a run sets from its plan (``device.pinned_host_pool: planned``), so that the pool is the
planned bytes and a margin instead of up to twice them. Both are pure: the cap is an input of
a plan (``Target.pinned_pool_limit_gib``) and an output (``Plan.pinned_pool_cap_gib``); only
the command and the trainer set the variable.
"""

from __future__ import annotations

import functools
import math

GIB = 2**30
MIB = 2**20
FIRST_REGION = 2 * MIB
"""BFC's first region with growth on."""
XLA_DEFAULT_LIMIT_GIB = 64
"""``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB``'s default without preallocation."""
LIMIT_VARIABLE = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"
PLANNED_MARGIN = 0.1
PLANNED_EXTRA = 2 * GIB


def pool_bytes(allocations, limit: int = XLA_DEFAULT_LIMIT_GIB * GIB) -> int:
    """Bytes of the pool after ``allocations`` (sizes in bytes, in order, all live): each fills
    the first region with room, else the pool grows (module doc). Raises MemoryError where the
    limit is reached first (XLA would fail the allocation)."""
    pool = _pool_bytes(tuple(allocations), limit)
    if pool is None:
        raise MemoryError(f"the pinned-host pool's limit ({limit / GIB:.1f} GiB) is reached "
                          f"before its {len(allocations)} arrays fit")
    return pool


@functools.lru_cache(maxsize=4096)
def _pool_bytes(allocations: tuple[int, ...], limit: int) -> int | None:
    """``pool_bytes``, None where the limit is reached first. A run of equal requests is
    placed at once: each region with room takes as many as it holds, in order, which is where
    one request after another would go."""
    regions: list[int] = []  # free bytes of each region
    pool, size = 0, FIRST_REGION
    for request, count in _runs(allocations):
        if request == 0:
            continue
        for i, free in enumerate(regions):
            if count == 0:
                break
            taken = min(count, free // request)
            regions[i] -= taken * request
            count -= taken
        while count:
            while size < request:
                size *= 2
            region = min(size, limit - pool)
            if region < request:
                return None
            size *= 2
            pool += region
            taken = min(count, region // request)
            regions.append(region - taken * request)
            count -= taken
    return pool


def _runs(allocations: tuple[int, ...]) -> list[tuple[int, int]]:
    """(size, count) of each run of equal consecutive sizes."""
    runs: list[tuple[int, int]] = []
    for size in allocations:
        if runs and runs[-1][0] == size:
            runs[-1] = (size, runs[-1][1] + 1)
        else:
            runs.append((size, 1))
    return runs


def planned_limit_gib(allocations) -> int:
    """The pool's cap for the planned pinned ``allocations`` (bytes, in order): their sum with
    10% and 2 GiB of margin, in whole GiB (the variable's unit), raised a GiB at a time until
    the pool's growth (``pool_bytes``) holds them: space a region strands counts too."""
    return _planned_limit_gib(tuple(allocations))


@functools.lru_cache(maxsize=4096)
def _planned_limit_gib(allocations: tuple[int, ...]) -> int:
    limit = math.ceil((sum(allocations) * (1 + PLANNED_MARGIN) + PLANNED_EXTRA) / GIB)
    while _pool_bytes(allocations, limit * GIB) is None:
        limit += 1
    return limit


def planned_devices(config) -> int | None:
    """The devices a run of ``config`` has before any backend starts: ``device.count``, else
    ``mesh.data x mesh.seq`` where both are given; None where only the machine can say
    (``mesh.seq: -1``, the rest of its devices)."""
    if config.device.count:
        return config.device.count
    data, seq = config.mesh.data, config.mesh.seq
    return data * seq if data > 0 and seq > 0 else None


def planned_cap_applies(config) -> bool:
    """Whether a run of ``config`` caps the pool from its plan: a GPU config with
    ``device.pinned_host_pool: planned`` whose device count is known before the backend
    starts (the cap must be set before it does)."""
    return (config.device.platform == "gpu" and config.device.pinned_host_pool == "planned"
            and planned_devices(config) is not None)
