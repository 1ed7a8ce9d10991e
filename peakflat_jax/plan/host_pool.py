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

import contextlib
import math
import os

GIB = 2**30
MIB = 2**20
FIRST_REGION = 2 * MIB
"""BFC's first region with growth on."""
XLA_DEFAULT_LIMIT_GIB = 64
"""``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB``'s default without preallocation."""
LIMIT_VARIABLE = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"
RUNTIME_GPU = {"scan": 6.25 * GIB, "unrolled": 6.5 * GIB}
"""Resident bytes of a trainer process on a GPU beyond its pinned pool and data (Python, jax,
CUDA, cuDNN, XLA's programs and what their compile kept), by the layer loop, before
``RUNTIME_GPU_PER_POOL_BYTE`` (``runtime_gpu_bytes``). Measured on an H200, scanned with
nothing pinned: 5.49 to 5.98 GiB over six runs of h200-1 and 5.90 to 5.95 over five of
h200-e2e (h200_1_train_auto_gpu_20261201-140353.json, h200_session_gpu_20261201-185430.json),
and 6.06 for h200-1 at 592,826 tokens (the longest context run; 6.04 beside its data:
h200_session_gpu_20261203-103231.json), which the 6.0 GiB held before did not cover."""
RUNTIME_GPU_PER_POOL_BYTE = 0.035
"""What the process holds beyond ``RUNTIME_GPU`` per byte of pinned-host pool. Fitted, not
derived: on an H200, resident memory minus the pool (which in each of these runs grew to its
limit, as the model of its growth says) was 7.0-7.7 GiB with a 41 GiB pool (h200-1, three
runs), 8.0-8.3 with 64 (h200-1, four), 9.57 with 100 and 10.00 with 106 (h200-e2e): it follows
the pool, not the model (h200-1 holds both 41 and 64). 6.5 GiB + 0.035 x pool holds all nine
(7.9, 8.7, 10.0 and 10.2 GiB; records h200_1_train_auto_gpu_20261201-140353.json,
h200_1_session_gpu_20261201-162217.json, h200_session_gpu_20261201-185430.json)."""


def runtime_gpu_bytes(loop: str, pool: int) -> int:
    """``host.runtime_gpu``: ``RUNTIME_GPU[loop]`` plus ``RUNTIME_GPU_PER_POOL_BYTE`` x the
    pinned-host ``pool`` (bytes)."""
    return int(RUNTIME_GPU[loop] + RUNTIME_GPU_PER_POOL_BYTE * pool)


OUTSIDE_PER_POOL_BYTE = 0.018
"""What the machine loses beyond the process's resident set per byte of pinned-host pool: the
kernel's and the driver's bookkeeping of page-locked memory, which no process owns. Measured on
an H200 host (``scripts/probes/probe_pinned_host_rss.py`` with a 110 GiB cap, the machine's
available memory sampled every 2 s; h200_session_gpu_20261202-183240.json, ``pinned_rss``):
available at the start minus the process's resident set minus available now was 0.3 GiB at a
~58 GiB pool, 1.25 at ~108 and 1.73-1.89 at 110, held at the cap; 0.018 x 110 GiB = 1.98 holds
every sample. It is what killed h200-e2e at 427,790 tokens: 123.01 GiB resident of the 124.89
available, and 1.5% of its ~106 GiB pool beside it left nothing."""


def outside_process_bytes(pool: int) -> int:
    """``host.pinned_outside_process``: ``OUTSIDE_PER_POOL_BYTE`` x the pinned-host ``pool``
    (bytes)."""
    return int(OUTSIDE_PER_POOL_BYTE * pool)


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
    """The pool's cap the environment sets (``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB``), or None;
    None too for a cap this process set from its own plan, inside ``own_cap_unset``."""
    value = os.environ.get(LIMIT_VARIABLE)
    try:
        limit = int(value) if value else None
    except ValueError:
        return None
    return None if _OWN_CAP_UNSET and limit is not None and limit == _OWN_CAP else limit


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


_PLANNED_CAPS: dict[str, int | None] = {}


def planned_cap_gib(config) -> int | None:
    """The pool's cap (GiB) for a run of ``config`` (``cap_from_plan``), None where none is
    set (``planned_cap_applies`` fails, or nothing is pinned): ``planned_limit_gib`` of the
    pinned arrays of the run's own plan, its ``auto`` operators chosen as the trainer will
    choose them, on the device memory the config names (``train.device_memory_gib``, else
    ``device.memory_gib``) and the host memory it names (``device.host_memory_gib``). The
    planner models the same cap (``terms.pool_limit``). Where the config names no device
    memory, or its own plan pins nothing, the cap is planned with the auto operators on (the
    streamed optimizer, every boundary offloaded), the most the run can pin: a cap reserves
    nothing, so a run that pins nothing loses nothing, and a trainer that finds less memory
    than the config names and pins after all has room under it (its own plan models the cap
    set in the environment; where its pool outgrows it, its host check refuses the run).
    Planned with the cap variable out of the environment; made without a backend; cached by
    config."""
    if not planned_cap_applies(config):
        return None
    key = repr(config)
    if key not in _PLANNED_CAPS:
        # The run's plan is made without a cap in the environment (the cap is what it decides).
        saved = os.environ.pop(LIMIT_VARIABLE, None)
        try:
            _PLANNED_CAPS[key] = _cap_of_the_run_s_plan(config)
        finally:
            if saved is not None:
                os.environ[LIMIT_VARIABLE] = saved
    return _PLANNED_CAPS[key]


def _cap_of_the_run_s_plan(config) -> int | None:
    """``planned_cap_gib``'s cap, planned (no cache, the environment as it is)."""
    from peakflat_jax.plan.operators import with_operators_on
    from peakflat_jax.plan.search import make_plan
    from peakflat_jax.plan.terms import pinned_allocations

    def pinned(config, memory_gib=None, host_gib=None) -> list[int]:
        plan = make_plan(config, planned_devices(config), platform="gpu",
                         device_memory=int(memory_gib * GIB) if memory_gib else None,
                         host_memory=int(host_gib * GIB) if host_gib else None,
                         baseline=False, search_context=False)
        return pinned_allocations(plan.knobs, plan.terms)

    memory_gib = config.train.device_memory_gib or config.device.memory_gib
    allocations = (pinned(config, memory_gib, config.device.host_memory_gib)
                   if memory_gib else [])
    if not allocations:
        # Nothing pinned by the run's own plan, or no memory to plan it with: the cap of every
        # auto operator on, which costs nothing where nothing is pinned and leaves room where
        # the trainer, on the memory it finds, chooses to pin.
        allocations = pinned(with_operators_on(config))
    return planned_limit_gib(allocations) if allocations else None


def cap_from_plan(config) -> int | None:
    """Sets ``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB`` to ``planned_cap_gib(config)`` and returns
    it, where the variable is unset (a value the user set stays; None is returned then, and
    where no cap is planned). Call it before the backend starts: XLA reads the variable
    once."""
    global _OWN_CAP
    if LIMIT_VARIABLE in os.environ or (limit := planned_cap_gib(config)) is None:
        return None
    os.environ[LIMIT_VARIABLE] = str(limit)
    _OWN_CAP = limit
    return limit


_OWN_CAP: int | None = None
"""The cap ``cap_from_plan`` set in this process's environment (GiB), or None."""
_OWN_CAP_UNSET = False
"""Whether ``set_limit_gib`` reads ``_OWN_CAP`` as unset (``own_cap_unset``: the environment
itself is left alone, read by XLA's threads)."""


@contextlib.contextmanager
def own_cap_unset():
    """Within, a cap this process set from its own plan (``cap_from_plan``) reads as unset,
    and the context's value is that cap (else None; the environment is not touched): a plan
    made here then models each candidate's own cap as ``peakflat plan`` does, before any cap
    is set, and chooses the knobs it chose. (With the cap in the environment, a setting whose
    own cap would not fit the host can fit under the one set: h200-e2e at 533,994 tokens
    trained with no optimizer group resident and 6 MoE chunks, 131.8 GiB planned, where
    ``peakflat plan`` had said 1 group and 8 chunks, 129.3: 2026-12-04.)"""
    global _OWN_CAP_UNSET
    own = _OWN_CAP if _OWN_CAP is not None and set_limit_gib() == _OWN_CAP else None
    saved, _OWN_CAP_UNSET = _OWN_CAP_UNSET, True
    try:
        yield own
    finally:
        _OWN_CAP_UNSET = saved
