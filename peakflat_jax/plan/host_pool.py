"""XLA's pinned-host pool on a GPU: what a run's pinned_host arrays cost in resident memory.

On a GPU, XLA serves every ``pinned_host`` buffer (the streamed optimizer's buckets, SCO's
boundaries) from one BFC allocator per device over ``cuMemHostAlloc``
(``xla/pjrt/gpu/gpu_helpers.cc``, ``GetGpuHostAllocator``; ``tsl/framework/bfc_allocator.cc``).
The pool grows by regions: a request that does not fit the free space gets a new region of the
current region size, doubled until it holds the request (the first from 2 MiB), after which
the size doubles again; a region is ``min(size, limit - pool)``; nothing is returned to the
system before the process ends. The limit is ``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB`` (GiB,
default 64), read once when the backend starts. Page-locked memory is resident: the pool, not
the live bytes, is what the host holds.

Measured on an H200 (``scripts/probes/probe_pinned_host_rss.py``, 2026-12-01): 171 fp32
buckets of 5e7 elements (31.9 GiB) grew the process by 69.4 GiB; h200-1 with AdamW's state on
the host (177 such arrays, 33.0 GiB) held 72 GiB. The model below gives 63.75 GiB of pool for
both; the rest is the runtime (``RUNTIME_GPU``, which loads its libraries on first use).

``pool_bytes`` simulates the growth for a list of allocations; ``planned_limit_gib`` is the cap
a run sets from its plan (``device.pinned_host_pool: planned``), so that the pool is the
planned bytes and a margin instead of up to twice them.
"""

from __future__ import annotations

import math

GIB = 2**30
MIB = 2**20
FIRST_REGION = 2 * MIB
"""BFC's first region with growth on."""
XLA_DEFAULT_LIMIT_GIB = 64
"""``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB``'s default without preallocation."""
LIMIT_VARIABLE = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"
RUNTIME_GPU = {"scan": 6 * GIB, "unrolled": 9 * GIB}
"""Resident bytes of a trainer process on a GPU beyond its pinned pool and data (Python, jax,
CUDA, cuDNN, XLA's programs and what their compile kept), by the layer loop. Measured on an
H200 for h200-1: scanned, nothing pinned, 5.49 to 5.98 GiB over six runs; unrolled with the
optimizer's state pinned, 8.3 to 8.7 GiB beyond the modelled pool over three
(h200_1_train_auto_gpu_20261201-140353.json, h200_1_plan_check_gpu_20261201-141839.json)."""
PLANNED_MARGIN = 0.1
PLANNED_EXTRA = 2 * GIB


def pool_bytes(allocations, limit: int = XLA_DEFAULT_LIMIT_GIB * GIB) -> int:
    """Bytes of the pool after ``allocations`` (sizes in bytes, in order, all live): each fills
    the first region with room, else the pool grows (module doc). Raises MemoryError where the
    limit is reached first (XLA would fail the allocation)."""
    regions: list[int] = []  # free bytes of each region
    pool, size = 0, FIRST_REGION
    for request in allocations:
        for i, free in enumerate(regions):
            if free >= request:
                regions[i] -= request
                break
        else:
            while size < request:
                size *= 2
            region = min(size, limit - pool)
            if region < request:
                raise MemoryError(f"the pinned-host pool's limit ({limit / GIB:.1f} GiB) is "
                                  f"reached at {pool / GIB:.2f} GiB")
            size *= 2
            pool += region
            regions.append(region - request)
    return pool


def planned_limit_gib(allocations) -> int:
    """The pool's cap for the planned pinned ``allocations`` (bytes, in order): their sum with
    10% and 2 GiB of margin, in whole GiB (the variable's unit), raised a GiB at a time until
    the pool's growth (``pool_bytes``) holds them: space a region strands counts too."""
    allocations = list(allocations)
    limit = math.ceil((sum(allocations) * (1 + PLANNED_MARGIN) + PLANNED_EXTRA) / GIB)
    while True:
        try:
            pool_bytes(allocations, limit * GIB)
            return limit
        except MemoryError:
            limit += 1


def set_limit_gib() -> int | None:
    """The pool's cap the environment sets (``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB``), or None."""
    import os

    value = os.environ.get(LIMIT_VARIABLE)
    try:
        return int(value) if value else None
    except ValueError:
        return None


def planned_devices(config) -> int | None:
    """The devices ``cap_from_plan`` plans for before any backend starts: ``device.count``,
    else ``mesh.data x mesh.seq`` where both are given; None where only the machine can say
    (``mesh.seq: -1``, the rest of its devices)."""
    if config.device.count:
        return config.device.count
    data, seq = config.mesh.data, config.mesh.seq
    return data * seq if data > 0 and seq > 0 else None


def planned_cap_applies(config) -> bool:
    """Whether a run of ``config`` caps the pool from its plan (``cap_from_plan``): a GPU config
    with ``device.pinned_host_pool: planned`` whose device count is known before the backend
    starts. The planner models the same cap exactly where this holds (``terms.pool_limit``),
    and XLA's own elsewhere."""
    return (config.device.platform == "gpu" and config.device.pinned_host_pool == "planned"
            and planned_devices(config) is not None)


def cap_from_plan(config) -> int | None:
    """Sets ``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB`` for ``config`` and returns it (GiB): on a GPU
    config with ``device.pinned_host_pool: planned`` that can pin something, where the variable
    is unset (a value the user set stays; None is returned then, and elsewhere). Call it before
    the backend starts: XLA reads the variable once. The cap is planned with the config's auto
    operators on (the streamed optimizer, every boundary offloaded): the most the run can pin,
    whatever the trainer's own plan then chooses on the devices it finds (a cap reserves
    nothing). Made without a backend."""
    import os

    from peakflat_jax.plan.operators import with_operators_on
    from peakflat_jax.plan.search import make_plan
    from peakflat_jax.plan.terms import pinned_allocations

    if not planned_cap_applies(config) or LIMIT_VARIABLE in os.environ:
        return None
    plan = make_plan(with_operators_on(config), planned_devices(config), platform="gpu",
                     baseline=False, search_context=False)
    allocations = pinned_allocations(plan.knobs, plan.terms)
    if not allocations:
        return None
    limit = planned_limit_gib(allocations)
    os.environ[LIMIT_VARIABLE] = str(limit)
    return limit
