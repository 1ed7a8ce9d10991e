"""XLA's pinned-host pool in the plan (``plan.host_pool``): the model against what an H200
measured, the planned cap, and a state the default pool cannot hold."""

import json
import os
import pathlib

import pytest

from peakflat_jax.config import load_config
from peakflat_jax.plan import host_pool, make_plan
from peakflat_jax.plan.operators import with_operators_on
from peakflat_jax.plan.terms import PINNED_TERMS, pinned_allocations, pool_limit

RESULTS = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "results"
GIB = 2**30
ON = ["operators.moe_dispatch=pipelined", "operators.loss=ring", "operators.offload=all",
      "operators.optimizer_offload=true", "operators.layer_loop=unrolled",
      "optimizer.resident_groups=0"]
"""All four on, the whole optimizer state streamed (left null, the planner keeps every group
on an H200 at 64K, and nothing of it is pinned)."""


@pytest.fixture
def environ(monkeypatch):
    """A copy of the environment for the test, without the pool's variable: what the planner
    sets in it goes with the test."""
    copy = {k: v for k, v in os.environ.items() if k != host_pool.LIMIT_VARIABLE}
    monkeypatch.setattr(os, "environ", copy)
    monkeypatch.setattr(host_pool, "_OWN_CAP", None)
    return copy


def test_the_pool_model_against_the_probe():
    """The probe's 171 pinned fp32 buckets: the modelled pool is what the process grew by, less
    the runtime it loaded on first use (at most ``RUNTIME_GPU``'s scanned figure)."""
    probe = json.loads((RESULTS / "h200_1_plan_check_gpu_20261201-141839.json").read_text())
    summary = probe["pinned_host_probe"]["summary"]
    bucket_bytes = summary["bucket"] * 4
    pool = host_pool.pool_bytes([bucket_bytes] * summary["arrays"])
    grown = summary["jit_out_pinned_host"]["rss_growth"]
    assert summary["live_bytes"] < pool < grown < pool + host_pool.RUNTIME_GPU["scan"]
    # Capped, the same arrays need no more than the cap; below what they need, it fails.
    assert host_pool.pool_bytes([bucket_bytes] * summary["arrays"], limit=33 * GIB) <= 33 * GIB
    with pytest.raises(MemoryError, match="limit"):
        host_pool.pool_bytes([bucket_bytes] * summary["arrays"], limit=30 * GIB)


def test_the_planned_cap_is_set_before_the_backend(environ):
    config = load_config("h200-1", [*ON, "device.pinned_host_pool=planned"])
    plan = make_plan(config, 1, platform="gpu", baseline=False, search_context=False)
    pinned = sum(t.bytes for t in plan.terms if t.name in PINNED_TERMS)
    limit = host_pool.cap_from_plan(config)
    assert 35 * GIB < pinned < limit * GIB <= pinned * 1.1 + 3 * GIB
    assert int(environ[host_pool.LIMIT_VARIABLE]) == limit
    # With the variable set, the plan's pool is the set one: what it adds to the live bytes is
    # under the margin.
    growth = {t.name: t.bytes for t in make_plan(config, 1, platform="gpu", baseline=False,
                                                  search_context=False).terms}
    assert growth["host.pinned_pool_growth"] <= limit * GIB - pinned
    # Operators left auto: capped for what the trainer's plan chooses on the memory the config
    # names (h200-e2e at 128K: what it pins there, not every operator on); where that pins
    # nothing (h200-1 at 64K on an H200: the standard stack), or the config names no memory,
    # for the most the run may pin (the streamed state and every boundary).
    del environ[host_pool.LIMIT_VARIABLE]
    assert host_pool.cap_from_plan(load_config("h200-1", ["device.pinned_host_pool=planned"])) \
        == limit
    del environ[host_pool.LIMIT_VARIABLE]
    deep = load_config("h200-e2e", ["data.seq_len=131072"])
    deep_plan = make_plan(deep, 1, platform="gpu", device_memory=int(132.8 * GIB),
                          host_memory=125 * GIB, baseline=False, search_context=False)
    deep_pinned = sum(t.bytes for t in deep_plan.terms if t.name in PINNED_TERMS)
    all_on = make_plan(with_operators_on(deep), 1, platform="gpu", baseline=False,
                       search_context=False)
    assert 0 < deep_pinned < sum(t.bytes for t in all_on.terms if t.name in PINNED_TERMS)
    assert deep_pinned < host_pool.cap_from_plan(deep) * GIB <= deep_pinned * 1.1 + 3 * GIB
    del environ[host_pool.LIMIT_VARIABLE]
    assert host_pool.cap_from_plan(load_config("h200-1", ["device.memory_gib=null"])) == limit
    del environ[host_pool.LIMIT_VARIABLE]
    # A value the user set stays; XLA's own pool, and a CPU config, set nothing.
    environ[host_pool.LIMIT_VARIABLE] = "50"
    assert host_pool.cap_from_plan(config) is None
    del environ[host_pool.LIMIT_VARIABLE]
    assert host_pool.cap_from_plan(load_config("h200-1", [*ON, "device.pinned_host_pool=xla"])) \
        is None
    # The optimizer forced onto the device, the boundaries offloaded: only they are pinned.
    boundaries_only = host_pool.cap_from_plan(load_config(
        "h200-1", ["operators.optimizer_offload=false", "operators.offload=all",
                   "device.pinned_host_pool=planned"]))
    assert 0 < boundaries_only < limit
    del environ[host_pool.LIMIT_VARIABLE]
    assert host_pool.cap_from_plan(load_config("tiny", ["device.pinned_host_pool=planned"])) is None


def test_the_planned_cap_counts_the_space_regions_strand():
    """22.4 GiB of buckets, then a 20 GiB block of boundaries: 10% and 2 GiB of margin are not
    enough once the regions' leftovers are counted; the planned cap holds them."""
    allocations = [200 * 2**20] * 115 + [20 * GIB]
    limit = host_pool.planned_limit_gib(allocations)
    assert limit * GIB > sum(allocations) * 1.1 + 2 * GIB
    host_pool.pool_bytes(allocations, limit * GIB)
    with pytest.raises(MemoryError):
        host_pool.pool_bytes(allocations, (limit - 1) * GIB)


def test_a_state_past_the_default_pool_does_not_fit_the_host(environ):
    """h200-1 at 16 layers: 5.9B parameters, 66 GiB of streamed state, past XLA's 64 GiB pool:
    the host does not fit with XLA's cap and does with the planned one (host memory 128 GiB)."""
    overrides = [*ON, "model.num_layers=16"]
    default = make_plan(load_config("h200-1", [*overrides, "device.pinned_host_pool=xla"]), 1,
                        platform="gpu", host_memory=128 * GIB, baseline=False,
                        search_context=False)
    planned = make_plan(load_config("h200-1", [*overrides, "device.pinned_host_pool=planned"]),
                        1, platform="gpu", host_memory=128 * GIB, baseline=False,
                        search_context=False)
    assert default.fits_host is False and planned.fits_host is True
    assert "device.pinned_host_pool: planned" in default.reasons()[-1]


def test_a_device_count_only_the_machine_knows_leaves_xla_s_pool(environ):
    """No device.count and mesh.seq: -1 (the rest of the devices): before the backend nothing
    can plan the cap, so the run sets none and the plan models XLA's own pool, not a cap that
    was never set; a config planned for a CPU neither."""
    config = load_config("h200-1", [*ON, "device.count=null", "mesh.seq=-1"])
    assert not host_pool.planned_cap_applies(config)
    assert host_pool.cap_from_plan(config) is None and host_pool.LIMIT_VARIABLE not in environ
    assert host_pool.planned_cap_applies(load_config("h200-1", ON))
    assert not host_pool.planned_cap_applies(load_config("h200-1", [*ON, "device.platform=cpu"]))
    pinned = [200 * 2**20] * 10
    assert pool_limit(config, pinned) == host_pool.XLA_DEFAULT_LIMIT_GIB * GIB


def test_the_plan_of_an_auto_config_models_the_cap_its_run_sets(environ):
    """``peakflat plan`` of a config whose operators are auto models the pool under the cap its
    run will set, planned from the trainer's own choice. Before they agreed, the run capped for
    every operator on (100 GiB at 128K) and the plan modelled the cap of the 82 GiB it chose to
    pin (93): the H200 measured 109.6 GiB resident against 102.0 planned."""
    config = load_config("h200-e2e", ["data.seq_len=131072"])
    plan = make_plan(config, 1, platform="gpu", device_memory=int(132.8 * GIB),
                     host_memory=125 * GIB, baseline=False, search_context=False)
    terms = {t.name: t.bytes for t in plan.terms}
    pinned = sum(terms.get(name, 0) for name in PINNED_TERMS)
    cap = host_pool.cap_from_plan(config)
    assert cap is not None and int(environ[host_pool.LIMIT_VARIABLE]) == cap
    assert cap == host_pool.planned_limit_gib(pinned_allocations(plan.knobs, plan.terms))
    pool = pinned + terms["host.pinned_pool_growth"]
    assert 0 < pinned < pool <= cap * GIB
    # The run's own plan, with the variable set as the run sets it, models the same pool.
    again_plan = make_plan(config, 1, platform="gpu", device_memory=int(132.8 * GIB),
                           host_memory=125 * GIB, baseline=False, search_context=False)
    again = {t.name: t.bytes for t in again_plan.terms}
    assert again["host.pinned_pool_growth"] == terms["host.pinned_pool_growth"]
    # And under its cap the run chooses what the cap was planned for (the resident groups left
    # null among them: their count must not depend on the cap).
    assert again_plan.knobs == plan.knobs


def test_the_trainer_chooses_what_peakflat_plan_chose_under_the_cap_it_set(environ):
    """A setting the plan rejects under its own pool cap can fit under the cap set from the
    chosen one, and a trainer planning with that cap in its environment took it: the H200 run
    of 2026-12-04 15:30 at 533,994 tokens ran 0 groups resident and 6 MoE chunks (its dump's
    bf16[6, 88999, 2048]) where ``peakflat plan`` had said 1 group and 8 chunks. The trainer's
    plan (``check_plan``) now reads its own cap as unset and chooses what ``peakflat plan``
    chose, whose cap is the one set. Today's terms make the same choice at 650,000 tokens with
    every boundary offloaded: 2 groups resident and 5 chunks (a 111 GiB cap), where under that
    cap the search alone takes 1 group and 4 chunks."""
    from types import SimpleNamespace

    from peakflat_jax.plan.machine import check_plan

    config = load_config("h200-e2e", ["data.seq_len=650000", "operators.offload=all"])
    memory = dict(device_memory=int(132.8 * GIB), host_memory=int(124.8 * GIB))
    before = make_plan(config, 1, platform="gpu", baseline=False, search_context=False, **memory)
    assert (before.knobs.resident_groups, before.knobs.token_budget) == (2, 130_000)
    cap = host_pool.cap_from_plan(config)
    assert cap == 111 and environ[host_pool.LIMIT_VARIABLE] == "111"
    # Under the cap set, the search alone takes the other setting (what the 15:30 run did).
    under_cap = make_plan(config, 1, platform="gpu", baseline=False, search_context=False,
                          **memory)
    assert (under_cap.knobs.resident_groups, under_cap.knobs.token_budget) == (1, 162_500)
    run = check_plan(config, [SimpleNamespace(platform="gpu")], **memory)
    assert (run.knobs.resident_groups, run.knobs.token_budget) == (2, 130_000)
    assert run.knobs == before.knobs and run.total_bytes == before.total_bytes
    assert host_pool.planned_limit_gib(pinned_allocations(run.knobs, run.terms)) == cap
    assert environ[host_pool.LIMIT_VARIABLE] == "111"
