"""XLA's pinned-host pool in the plan (``plan.host_pool``): the growth model's properties, the
planned cap as the plan's explicit input and output, and the command and the trainer that set
and read the variable (``train.machine``)."""

import os
from types import SimpleNamespace

import pytest

from peakflat_jax.config import load_config
from peakflat_jax.plan import host_pool, make_plan
from peakflat_jax.plan.target import Target
from peakflat_jax.plan.terms import PINNED_TERMS, pinned_allocations, pool_limit
from peakflat_jax.train import machine

GIB = 2**30
ON = ["operators.moe_dispatch=pipelined", "operators.loss=ring", "operators.offload=all",
      "operators.optimizer_offload=true", "operators.layer_loop=unrolled",
      "optimizer.resident_groups=0"]
"""All four on, the whole optimizer state streamed."""
H200 = dict(device_memory=int(132.8 * GIB), host_memory=int(124.8 * GIB))


@pytest.fixture
def environ(monkeypatch):
    """The environment without the pool's variable: what is set in it goes with the test."""
    monkeypatch.delenv(host_pool.LIMIT_VARIABLE, raising=False)
    return os.environ


def test_the_pool_holds_its_arrays_within_twice_their_bytes():
    """Regions double from 2 MiB: the pool holds every array, wastes less than the arrays
    hold plus the first regions, and a limit below the arrays fails their allocation."""
    for allocations in ([3 * 2**20] * 50, [200 * 2**20] * 30 + [5 * GIB], [GIB] * 7):
        pool = host_pool.pool_bytes(allocations, 1024 * GIB)
        assert sum(allocations) <= pool <= 2 * sum(allocations) + 4 * host_pool.FIRST_REGION
        with pytest.raises(MemoryError):
            host_pool.pool_bytes(allocations, sum(allocations) // 2)


def test_the_planned_cap_counts_the_space_regions_strand():
    """22.4 GiB of buckets, then a 20 GiB block of boundaries: 10% and 2 GiB of margin are not
    enough once the regions' leftovers are counted; the planned cap holds them."""
    allocations = [200 * 2**20] * 115 + [20 * GIB]
    limit = host_pool.planned_limit_gib(allocations)
    assert limit * GIB > sum(allocations) * 1.1 + 2 * GIB
    host_pool.pool_bytes(allocations, limit * GIB)
    with pytest.raises(MemoryError):
        host_pool.pool_bytes(allocations, (limit - 1) * GIB)


def test_the_cap_is_the_plan_s_input_and_output():
    """The plan's cap is its pinned arrays' (``planned_limit_gib``) where the config plans it,
    the one given where given (the pool then modelled under it), and none with XLA's pool."""
    config = load_config("h200-1", ON)
    plan = make_plan(config, 1, platform="gpu", baseline=False, search_context=False, **H200)
    pinned = pinned_allocations(plan.knobs, plan.terms)
    assert plan.pinned_pool_cap_gib == host_pool.planned_limit_gib(pinned)
    terms = {t.name: t.bytes for t in plan.terms}
    assert sum(terms[name] for name in PINNED_TERMS) < (
        sum(terms[name] for name in PINNED_TERMS) + terms["host.pinned_pool_growth"]) <= (
        plan.pinned_pool_cap_gib * GIB)
    wide = make_plan(config, 1, platform="gpu", baseline=False, search_context=False,
                     pinned_pool_limit_gib=plan.pinned_pool_cap_gib + 64, **H200)
    assert wide.pinned_pool_cap_gib == plan.pinned_pool_cap_gib + 64
    assert wide.host_bytes >= plan.host_bytes  # a larger pool grows further, never less
    xla = make_plan(load_config("h200-1", [*ON, "device.pinned_host_pool=xla"]), 1,
                    platform="gpu", baseline=False, search_context=False, **H200)
    assert xla.pinned_pool_cap_gib is None
    assert make_plan(load_config("tiny"), 8, platform="cpu", baseline=False,
                     search_context=False).pinned_pool_cap_gib is None


def test_a_state_past_the_default_pool_does_not_fit_the_host():
    """h200-1 at 16 layers: 66 GiB of streamed state, past XLA's 64 GiB pool: the run cannot
    allocate it with XLA's cap (said), and fits with the planned one."""
    overrides = [*ON, "model.num_layers=16"]
    default = make_plan(load_config("h200-1", [*overrides, "device.pinned_host_pool=xla"]), 1,
                        platform="gpu", host_memory=128 * GIB, baseline=False,
                        search_context=False)
    planned = make_plan(load_config("h200-1", [*overrides, "device.pinned_host_pool=planned"]),
                        1, platform="gpu", host_memory=128 * GIB, baseline=False,
                        search_context=False)
    assert default.fits_host is False and default.pool_shortfall > 0
    assert planned.fits_host is True and planned.pool_shortfall == 0
    assert "device.pinned_host_pool: planned" in default.reasons()[-1]


def test_a_device_count_only_the_machine_knows_leaves_xla_s_pool(environ):
    """No device.count and mesh.seq: -1: before the backend nothing can plan the cap, so the
    run sets none and the plan models XLA's own pool; a config planned for a CPU neither."""
    config = load_config("h200-1", [*ON, "device.count=null", "mesh.seq=-1"])
    assert not host_pool.planned_cap_applies(config)
    assert machine.set_pool_cap(config) is None and host_pool.LIMIT_VARIABLE not in environ
    assert not host_pool.planned_cap_applies(load_config("h200-1", [*ON,
                                                                    "device.platform=cpu"]))
    pinned = [200 * 2**20] * 10
    assert pool_limit(config, Target("gpu"), pinned) == host_pool.XLA_DEFAULT_LIMIT_GIB * GIB


def test_the_command_sets_the_cap_the_plan_names(environ):
    """``peakflat train`` sets the variable to the plan's cap where it is unset, before the
    backend starts; a value already set stays."""
    config = load_config("h200-e2e", ["data.seq_len=131072"])
    plan = make_plan(config, 1, platform="gpu", baseline=False, search_context=False,
                     data_stats=machine.data_stats(config.data), **H200)
    cap = machine.set_pool_cap(config)
    assert cap == plan.pinned_pool_cap_gib and environ[host_pool.LIMIT_VARIABLE] == str(cap)
    environ[host_pool.LIMIT_VARIABLE] = "77"
    assert machine.set_pool_cap(config) is None and environ[host_pool.LIMIT_VARIABLE] == "77"


def test_the_trainer_plans_under_the_cap_that_is_set(environ):
    """The trainer's plan (``machine.plan_run``) is ``peakflat plan``'s where the cap set is
    that plan's own, and is made under the cap set where another is."""
    config = load_config("h200-e2e", ["data.seq_len=262144", "operators.offload=all"])
    gpu = [SimpleNamespace(platform="gpu", device_kind="NVIDIA H200")]
    command = make_plan(config, 1, platform="gpu", baseline=False, search_context=False,
                        data_stats=machine.data_stats(config.data), **H200)
    environ[host_pool.LIMIT_VARIABLE] = str(command.pinned_pool_cap_gib)
    run = machine.plan_run(config, gpu, **H200)
    assert run.knobs == command.knobs and run.terms == command.terms
    environ[host_pool.LIMIT_VARIABLE] = str(command.pinned_pool_cap_gib + 40)
    under = machine.plan_run(config, gpu, **H200)
    assert under.pinned_pool_cap_gib == command.pinned_pool_cap_gib + 40
    environ[host_pool.LIMIT_VARIABLE] = "6.5"
    with pytest.raises(ValueError, match="whole number of GiB"):
        machine.plan_run(config, gpu, **H200)
