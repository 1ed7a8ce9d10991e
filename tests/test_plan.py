"""The planner against independent truths: its terms are the operators' own and the model's own
shards; the closed form bounds XLA:CPU's compiled plan of the trainer's programs (the operator
variants of a small config, and every config in configs/ reduced to the tests' sizes), within
the margin it states; it grows with the context; it fills and chooses knobs that fit; it is
pure; and the command refuses bad input by name."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import pathlib

import jax
import jax.numpy as jnp
import pytest

from peakflat_jax import mesh as mop
from peakflat_jax import plan as pl
from peakflat_jax.cli import plan as plan_command
from peakflat_jax.config import ConfigError, load_config
from peakflat_jax.model.sharding import init_model
from peakflat_jax.model.size import parameter_counts
from peakflat_jax.ops import pipelined_moe as moe_module
from peakflat_jax.ops import ring_cross_entropy as ring_module
from peakflat_jax.ops import sco as sco_module
from peakflat_jax.optim import offload_adamw
from peakflat_jax.plan import optimizer_terms
from peakflat_jax.plan.target import Target
from peakflat_jax.plan.terms import resident_param_count
from tests.test_train import ALL_OFF, SMALL

MIB = 2**20
GPU, CPU = Target("gpu"), Target("cpu")
CONFIGS = sorted(path.stem for path in (pathlib.Path(__file__).resolve().parents[1]
                                        / "configs").glob("*.yaml"))


def small(*overrides: str):
    return load_config("tiny", [*SMALL, *overrides])


def knobs_of(config, num_devices=8, **kwargs):
    return pl.knobs_from_config(config, num_devices, **kwargs)


def by_name(terms):
    return {t.name: t for t in terms}


def reduced(name: str, *overrides: str):
    """The config ``name`` of configs/ at the tests' sizes on 8 CPU devices: its structure
    kept (dense and MoE layers, the shared expert, the router, attention's kind, RoPE's
    scaling, the dtype, the data source, the operators and the optimizer's placement as
    configured or left auto), its sizes small."""
    config = load_config(name)
    model, ops = config.model, config.operators
    kv = 2 if model.num_kv_heads < model.num_heads else 4
    return load_config(name, [
        "model.hidden=32", "model.num_layers=2",
        f"model.num_dense_layers={1 if model.num_dense_layers else 0}", "model.dense_ffn=32",
        "model.num_heads=4", f"model.num_kv_heads={kv}", "model.head_dim=8",
        "model.num_experts=8", f"model.top_k={min(model.top_k, 2)}", "model.expert_ffn=16",
        f"model.shared_expert_ffn={16 if model.shared_expert_ffn else 0}",
        f"model.vocab_size={min(model.vocab_size, 1000)}",
        f"model.sliding_window={min(model.sliding_window, 16)}",
        "mesh.data=2", "mesh.seq=4", "data.seq_len=32", "data.batch_size=8",
        f"data.max_segments={min(config.data.max_segments, 4)}",
        *(["operators.token_budget=16"] if ops.token_budget else []),
        "optimizer.bucket_params=20000", "train.steps=1",
        "device.platform=cpu", "device.count=8", "device.memory_gib=null",
        "device.host_memory_gib=null", *overrides])


# ----------------------------------------------------------------------------------------------
# The terms: the model's own shards and the operators' own bounds.


@pytest.mark.parametrize("hidden", [64, 36], ids=["sharded", "some replicated"])
def test_weights_are_the_models_own_shards(hidden):
    """P per device equals the initialized model's local shards (36 is not a multiple of 8:
    the norm scales stay whole on every device, and the planner counts them whole)."""
    config = small(f"model.hidden={hidden}")
    mesh = mop.make_mesh(config.mesh)
    _, state = init_model(config.model, mesh, seed=0)
    local = [leaf.addressable_shards[0].data for leaf in jax.tree.leaves(state)]
    weights = pl.model_weights(config.model, 8)
    trained = sum(a.size * a.dtype.itemsize for a in local) - weights.extras
    assert weights.params == trained
    if hidden == 64:  # every leaf sharded: the counts of model.size over W
        total = parameter_counts(config.model, mop.padded_vocab(config.model.vocab_size, 8))
        assert weights.param_count * 8 == total.total


def test_terms_are_the_operators_own():
    """One source of truth per bound: the plan's operator terms are the operators' functions
    at the plan's sizes, on either platform."""
    config = small("model.num_layers=4")  # three MoE layers: more than SCO restores at a time
    knobs = knobs_of(config)
    n, h, b = knobs.tokens_per_device, config.model.hidden, 4
    terms = by_name(pl.plan_terms(config, knobs, GPU))
    shard = mop.padded_vocab(config.model.vocab_size, 8) // 8
    ring = ring_module.ring_cross_entropy_memory_terms(n, h, shard, 8, hidden_dtype=jnp.float32,
                                                       kernel_dtype=jnp.float32,
                                                       reduction="mean", vocab_size=260)
    assert {k: terms[f"loss.{k}"].bytes for k in ring} == ring
    # fp32 on a GPU: the tiled grouped matmul (the Mosaic kernels take bf16 and f16 only).
    moe = moe_module.pipelined_moe_memory_terms(
        num_tokens=n, hidden=h, ffn=config.model.expert_ffn, top_k=config.model.top_k,
        num_experts=config.model.num_experts, num_devices=8, token_budget=16, max_chunks=10,
        dtype=jnp.float32, grouped_matmul="tiled")
    assert {k: terms[f"moe.{k}"].bytes for k in moe} == moe
    weights = pl.model_weights(config.model, 8)
    step = offload_adamw.offload_stream_adamw_memory_terms(weights.param_count, 20000, 2,
                                                           jnp.float32)
    assert step.pop("resident_state") == 0 and "optimizer.resident_state" not in terms
    assert {k: terms[f"optimizer_step.{k}"].bytes for k in step} == step
    assert terms["host.optimizer_state"].bytes == 12 * weights.param_count
    # offload: all: every boundary in host memory; in the backward of the MoE layer (the
    # largest) as many of its stack's as are restored at a time.
    layers, boundary = config.model.num_layers, n * h * b
    assert terms["kept_boundaries"].bytes == 0
    assert terms["restored_boundaries"].bytes == min(layers - 1, 2) * boundary
    assert terms["host.offloaded_boundaries"].bytes == sco_module.sco_host_bytes(layers,
                                                                                boundary)
    baseline = by_name(pl.plan_terms(config, knobs, GPU, operators_on=False))
    unchunked = moe_module.unchunked_moe_memory_terms(
        num_tokens=n, hidden=h, ffn=config.model.expert_ffn, top_k=config.model.top_k,
        num_experts=config.model.num_experts, num_devices=8, dtype=jnp.float32,
        grouped_matmul="tiled")
    assert {k: baseline[f"moe.{k}"].bytes for k in unchunked} == unchunked
    materialized = ring_module.materialized_memory_terms(n, h, shard, 8,
                                                         vocab_size=config.model.vocab_size)
    assert {k: baseline[f"loss.{k}"].bytes for k in materialized} == materialized
    device = optimizer_terms.on_device_adamw_memory_terms(weights.param_count, jnp.float32)
    assert {k: baseline[k].bytes for k in device} == device
    assert baseline["kept_boundaries"].bytes == layers * boundary
    every = [*pl.plan_terms(config, knobs, CPU), *baseline.values()]
    assert all(t.formula and t.short and t.live in pl.LIVE_SETS and t.bytes >= 0
               for t in every)


@pytest.mark.parametrize("loop", ["unrolled", "scan"])
def test_the_loss_runs_beside_every_kept_boundary(loop):
    """The loss runs after every layer's forward and before any backward, so every kept
    boundary is live beside it; unrolled, a dense peak layer's backward has only the dense
    stack's (each MoE layer's backward has freed its own). A config whose loss binds (a 32K
    vocabulary, the materialized loss) and whose dense layer is the larger."""
    config = small(f"operators.layer_loop={loop}", "operators.offload=none",
                   "operators.loss=materialized", "operators.optimizer_offload=true",
                   "model.vocab_size=32768", "model.dense_ffn=1024", "data.seq_len=1024")
    plan = pl.make_plan(config, 8, platform="cpu", baseline=False, search_context=False)
    terms = by_name(plan.terms)
    model = config.model
    boundary = knobs_of(config).tokens_per_device * model.hidden * 4
    moe_stack = terms.get("kept_boundaries.moe_stack")
    assert (moe_stack is not None) == (loop == "unrolled")
    kept = terms["kept_boundaries"].bytes + (moe_stack.bytes if moe_stack else 0)
    assert kept == model.num_layers * boundary
    assert plan.phases["loss"] > plan.phases["layer"]
    persistent = sum(t.bytes for t in plan.terms if t.live in ("persistent", "backward"))
    assert plan.programs["gradient"] >= (persistent + kept + terms["integer_leaves"].bytes
                                         + plan.phases["loss"])


def test_offload_moves_boundaries_to_the_host():
    """On a GPU offloading all L boundaries frees L - 2 of them on the device (two come back
    in backward) and puts L of them in host memory; on a CPU the memory kinds lower to
    nothing, so the plan keeps them on the device."""
    config = small("model.num_layers=6", "model.num_dense_layers=0")
    knobs = knobs_of(config)
    boundary = knobs.tokens_per_device * config.model.hidden * 4
    none = dataclasses.replace(knobs, offload=(False,) * 6)
    plans = {name: pl.Plan(config, k, GPU, tuple(pl.plan_terms(config, k, GPU)), None, None)
             for name, k in (("all", knobs), ("none", none))}
    assert plans["none"].total_bytes - plans["all"].total_bytes == (6 - 2) * boundary
    hosted = {name: by_name(plan.terms)["host.offloaded_boundaries"].bytes
              for name, plan in plans.items()}
    assert hosted["all"] - hosted["none"] == 6 * boundary
    cpu = by_name(pl.plan_terms(config, knobs, CPU))
    assert cpu["kept_boundaries"].bytes == 6 * boundary
    assert cpu["host.offloaded_boundaries"].bytes == 0


@pytest.mark.parametrize("name", ["tiny", "h200-1", "h200-e2e", "gpt-oss-20b", "paper-120b"])
def test_the_plan_grows_with_the_context(name):
    """Longer sequences hold more: every program's closed form is monotone in the context, the
    knobs held (what the largest-context bisections assume)."""
    config = pl.with_operators_on(load_config(name))
    platform = config.device.platform
    knobs = knobs_of(config, config.device.count or 8, platform=platform)
    target = Target(platform)
    unit = knobs.seq * 2
    previous = None
    for context in (unit, 64 * unit, 1024 * unit, 8192 * unit):
        at = dataclasses.replace(knobs, context=context)
        programs = pl.program_bytes(pl.plan_terms(config, at, target))
        if previous is not None:
            assert all(programs[p] >= previous[p] for p in programs), (context, programs)
        previous = programs


def test_the_planner_is_pure(monkeypatch):
    """No environment read or written: the pinned pool's cap set in the environment changes
    nothing, and a plan leaves the environment as it was; the cap is an input and an
    output."""
    config = load_config("h200-1", ["operators.moe_dispatch=pipelined", "operators.loss=ring",
                                    "operators.offload=all", "operators.optimizer_offload=true",
                                    "optimizer.resident_groups=0"])
    memory = dict(device_memory=int(132.8 * 2**30), host_memory=int(124.8 * 2**30))
    before = dict(os.environ)
    plan = pl.make_plan(config, 1, baseline=False, search_context=False, **memory)
    assert dict(os.environ) == before
    monkeypatch.setenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "3")
    again = pl.make_plan(config, 1, baseline=False, search_context=False, **memory)
    assert again.terms == plan.terms and again.pinned_pool_cap_gib == plan.pinned_pool_cap_gib
    assert plan.pinned_pool_cap_gib is not None  # a GPU config with the pool planned
    given = pl.make_plan(config, 1, baseline=False, search_context=False,
                         pinned_pool_limit_gib=3, **memory)
    assert given.pinned_pool_cap_gib == 3 and given.fits_host is False  # the state needs more
    assert given.pool_shortfall > 0 and "pinned-host pool" in given.reasons()[-1]


# ----------------------------------------------------------------------------------------------
# The bound against XLA:CPU's plan of the trainer's programs.

# Each operator on in two cases and off in two (all off: the reduced configs below that leave
# them auto); the optimizer on the host CPU; the streamed optimizer's first two groups resident
# on the device, its update a program of its own.
VARIANTS = {
    "all_on": [],
    "loss_and_optimizer_off": ["operators.loss=materialized", "operators.optimizer_offload=false"],
    "moe_and_offload_off": ["operators.moe_dispatch=ep", "operators.offload=none"],
    "host_cpu": [*ALL_OFF, "optimizer.update_on=host_cpu"],
    "resident": ["optimizer.resident_groups=2", "operators.optimizer_overlap=false"],
}
ROLES = {"train_step": "gradient", "gradient_step": "gradient", "overlapped_step": "overlapped",
         "optimizer_step": "optimizer_step", "host_cpu_update": "host_update"}


@pytest.fixture(scope="module")
def compiled_programs():
    """XLA's plans of the programs the trainer compiles for each variant's plan
    (``preflight.check``: for the state's shapes, nothing made), by the plan's program each is
    held to; compiled once for the module's tests."""
    from peakflat_jax.train import preflight

    done = {}

    def get(variant):
        if variant not in done:
            plan = pl.make_plan(small(*VARIANTS[variant]), 8, platform="cpu", baseline=False,
                                search_context=False)
            done[variant] = {ROLES[c.name]: c.xla for c in preflight.check(plan)}
        return done[variant]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_plan_bounds_the_trainers_compiled_programs(compiled_programs, variant):
    """Every program's closed form is at least XLA:CPU's plan of what the trainer compiles
    (arguments + temporaries + outputs - aliases, less the host-resident optimizer state that
    XLA:CPU counts as arguments), and within the margin the plan states for a CPU."""
    config = small(*VARIANTS[variant])
    programs = compiled_programs(variant)
    plan = pl.make_plan(config, 8, platform="cpu", baseline=False, search_context=False)
    # On CPU the host state is an ordinary argument: leave it out of the device's share (the
    # resident groups' state is the device's: the plan counts it).
    host_state = 12 * (pl.model_weights(config.model, 8).param_count - resident_param_count(
        config.model, 8, config.optimizer.resident_groups))
    xla = {name: program.total - (host_state if name != "gradient" else 0)
           for name, program in programs.items() if name != "host_update"}
    assert set(xla) <= set(plan.programs)
    low, high = pl.measured_for("cpu").margin["device"]
    for name in xla:
        ratio = xla[name] / plan.programs[name]
        print(f"{variant} {name}: XLA / closed form {ratio:.3f}")
        assert low <= ratio <= high, (name, ratio)


# XLA:CPU adds a table of 8 bytes per buffer to the argument and output sizes.
BOOKKEEPING_BYTES = 512


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["resident", "loss_and_optimizer_off", "host_cpu"],
                         ids=["offloaded", "device", "host_cpu"])
def test_persistent_terms_are_the_programs_arguments(compiled_programs, variant):
    """What the step keeps from one step to the next is exactly the plan's persistent terms:
    the device step's arguments (weights, fp32 state, router bias, batch), or the gradient
    program's arguments and outputs (weights in, gradients out) where the state is in host
    memory (streamed, or updated by the host CPU)."""
    config = small(*VARIANTS[variant])
    state_in_host_memory = (config.operators.optimizer_offload
                            or config.optimizer.update_on == "host_cpu")
    xla = compiled_programs(variant)["gradient"]
    terms = by_name(pl.plan_terms(config, knobs_of(config), CPU))
    extras = terms["router_bias"].bytes // 2  # the term counts it in and out
    arguments = terms["params"].bytes + extras + terms["batch"].bytes
    if state_in_host_memory:
        assert "master" not in terms and "moments" not in terms
    else:
        arguments += terms["master"].bytes + terms["moments"].bytes
    assert 0 <= xla.argument - arguments <= BOOKKEEPING_BYTES
    if state_in_host_memory:
        counts = (config.model.num_layers - config.model.num_dense_layers) * (
            config.model.num_experts * 4)
        outputs = terms["grads"].bytes + extras + counts + 8  # + the loss and gradient norm
        assert 0 <= xla.output - outputs <= BOOKKEEPING_BYTES


@pytest.mark.slow
def test_host_terms_are_the_host_updates_plan(compiled_programs):
    """With the update on the host CPU the plan's host terms of the optimizer (12 P of fp32
    state and the step's transit, per device) add up, over the 8 devices whose shards the one
    host program updates, to XLA:CPU's plan of that program, within its bookkeeping; and the
    device keeps no term of the optimizer."""
    config = small(*VARIANTS["host_cpu"])
    xla = compiled_programs("host_cpu")["host_update"]
    terms = by_name(pl.plan_terms(config, knobs_of(config), CPU))
    host = terms["host.cpu_adamw_state"].bytes + terms["host.cpu_adamw_transit"].bytes
    assert terms["host.cpu_adamw_state"].bytes == 12 * pl.model_weights(config.model,
                                                                         8).param_count
    assert 0 <= xla.total - 8 * host <= 4 * BOOKKEEPING_BYTES
    largest = pl.model_weights(config.model, 8).largest_leaf
    assert 0 <= xla.temp - 4 * largest <= BOOKKEEPING_BYTES
    assert terms["optimizer_update"].bytes == 0
    assert not any(t.name.startswith("optimizer_step.") for t in terms.values())
    # peakflat plan --check holds that program, per device, to the host terms of it.
    from peakflat_jax.train import preflight

    plan = pl.make_plan(config, 8, platform="cpu", baseline=False, search_context=False)
    update = next(c for c in preflight.check(plan) if c.name == "host_cpu_update")
    assert update.bound == sum(by_name(plan.terms)[name].bytes
                               for name in preflight.HOST_UPDATE_TERMS)
    assert update.devices == 8 and update.holds and update.xla_device_bytes > 0.99 * update.bound


@pytest.fixture(scope="module")
def reduced_checks():
    """``preflight.check`` of each config reduced, on this machine's 8 CPU devices (the plan
    the trainer runs with: ``machine.plan_run``), made once; configs that reduce to the same
    config share it."""
    from peakflat_jax.config import to_dict
    from peakflat_jax.train import preflight
    from peakflat_jax.train.machine import plan_run

    done = {}

    def get(name):
        config = reduced(name)
        key = json.dumps({**to_dict(config), "name": None}, sort_keys=True)
        if key not in done:
            plan = plan_run(config, 8)
            done[key] = (plan, preflight.check(plan))
        return done[key]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("name", [name for name in CONFIGS if name != "tiny"])
def test_the_closed_form_bounds_every_config_reduced(reduced_checks, name):
    """Every config in configs/ at the tests' sizes (its structure kept: finetune-h200 without
    its checkpoint, the architecture its default; tiny is the variants above), planned as the
    trainer plans it on 8 CPU devices and compiled as the trainer compiles it: XLA:CPU's plan
    of every program is under the closed form, and within the margin the plan states for a
    CPU."""
    plan, checks = reduced_checks(name)
    low, high = pl.measured_for("cpu").margin["device"]
    assert checks
    for check in checks:
        ratio = check.xla_device_bytes / check.bound
        print(f"{name} {check.name}: XLA / closed form {ratio:.3f}")
        assert check.holds and low <= ratio <= high, (check.name, ratio)


# ----------------------------------------------------------------------------------------------
# Knobs: nulls filled, --auto, the largest context.


def test_a_null_token_budget_takes_the_fewest_chunks_that_fit():
    config = small("operators.token_budget=null", "operators.max_chunks=4")
    n = knobs_of(config).tokens_per_device
    loose = pl.make_plan(config, 8, platform="cpu", device_memory=64 * MIB, baseline=False,
                         search_context=False)
    assert loose.knobs.token_budget == n  # everything fits: one chunk, the fastest
    one_chunk = pl.plan_terms(config, loose.knobs, CPU)
    four = dataclasses.replace(loose.knobs, token_budget=-(-n // 4))
    four_chunks = pl.plan_terms(config, four, CPU)
    # A memory between the two: the chooser must take more than one chunk, and what it takes
    # fits while one chunk fewer does not.
    memory = (max(pl.program_bytes(one_chunk).values())
              + max(pl.program_bytes(four_chunks).values())) // 2
    tight = pl.make_plan(config, 8, platform="cpu", device_memory=memory, baseline=False,
                         search_context=False)
    chunks = -(-n // tight.knobs.token_budget)
    assert 1 < chunks <= 4 and tight.feasible
    fewer = dataclasses.replace(tight.knobs, token_budget=-(-n // (chunks - 1)))
    assert max(pl.program_bytes(pl.plan_terms(config, fewer, CPU)).values()) > memory
    assert any(c.key == "operators.token_budget" for c in tight.choices)
    # Memory unknown: the tightest bound the config allows.
    unknown = pl.make_plan(config, 8, platform="cpu", baseline=False, search_context=False)
    assert unknown.knobs.token_budget == -(-n // 4)


def test_largest_context_is_the_edge_of_feasibility():
    config = small()
    memory = 8 * MIB
    plan = pl.make_plan(config, 8, platform="cpu", device_memory=memory, baseline=False)
    largest = plan.largest_context
    assert largest is not None and largest % plan.knobs.seq == 0
    at = pl.make_plan(config, 8, context=largest, platform="cpu", device_memory=memory,
                      baseline=False, search_context=False)
    assert at.feasible
    beyond = pl.make_plan(config, 8, context=largest + plan.knobs.seq, platform="cpu",
                          device_memory=memory, baseline=False, search_context=False)
    assert not beyond.feasible


def test_a_gpu_plan_s_largest_context_is_a_length_cudnn_trains():
    """On a GPU the attention is cuDNN's, which trains only even lengths (model.attention): the
    search's edge is the even one below where memory runs out, and a plan of an odd length
    says so, naming data.seq_len, before anything compiles; the XLA kernel takes it."""
    config = load_config("h200-1")
    memory = dict(device_memory=int(config.device.memory_gib * 2**30),
                  host_memory=int(config.device.host_memory_gib * 2**30))
    largest = pl.make_plan(config, 1, platform="gpu", baseline=False, **memory).largest_context
    assert largest % 2 == 0
    for context in (largest, largest + 2):
        at = pl.make_plan(config, 1, context=context, platform="gpu", baseline=False,
                          search_context=False, **memory)
        assert at.feasible == (context == largest)
    odd = load_config("h200-1", [f"data.seq_len={largest + 1}"])
    with pytest.raises(pl.PlanError, match=rf"data.seq_len: cuDNN .* got {largest + 1}"):
        pl.make_plan(odd, 1, platform="gpu", baseline=False, search_context=False, **memory)
    xla = odd.replace(operators={"attention": "xla"})
    assert pl.make_plan(xla, 1, platform="gpu", baseline=False, search_context=False,
                        **memory).knobs.attention == "xla"


def test_auto_finds_a_longer_context_and_its_knobs_fit():
    config = small("operators.optimizer_offload=false", "operators.offload=none")
    runtime = pl.measured_for("gpu").constant("host_runtime_bytes_unrolled")
    # 64 MiB for the run's arrays, beside what a GPU trainer process holds anyway.
    memory, host = 8 * MIB, 64 * MIB + runtime
    auto = pl.make_plan(config, 8, platform="gpu", device_memory=memory, host_memory=host,
                        auto=True, baseline=False)
    fixed_gpu = pl.make_plan(config, 8, platform="gpu", device_memory=memory, host_memory=host,
                             baseline=False)
    assert auto.knobs.context >= fixed_gpu.largest_context
    assert auto.feasible and auto.knobs.context == auto.largest_context
    keys = {c.key for c in auto.choices}
    assert {"mesh.data x mesh.seq", "operators.offload", "operators.optimizer_offload",
            "operators.token_budget"} <= keys
    assert all(c.why for c in auto.choices)
    # At a given context, --auto maximises the sequences per step.
    at = pl.make_plan(config, 8, context=256, platform="gpu", device_memory=memory,
                      host_memory=host, auto=True, baseline=False, search_context=False)
    assert at.feasible and at.knobs.context == 256
    # Past every context that fits: the same verdict as without --auto, and where it fits.
    beyond = pl.make_plan(config, 8, context=auto.largest_context * 4, platform="gpu",
                          device_memory=memory, host_memory=host, auto=True, baseline=False)
    assert beyond.feasible is False and beyond.largest_context == auto.largest_context


def test_chosen_knobs_keep_the_optimizer_on_the_device_when_it_fits():
    """Offloading the optimizer costs the link every step, offloading boundaries may: with
    room, the state and the boundaries stay; with less, the choice offloads and still fits."""
    config = small()
    knobs = knobs_of(config, platform="gpu")
    host = 1024 * MIB + pl.measured_for("gpu").constant("host_runtime_bytes_unrolled")
    roomy, choices = pl.choose_knobs(config, knobs, GPU, 1024 * MIB, host, auto=True)
    assert not roomy.optimizer_offload and roomy.num_offloaded == 0
    assert {c.key for c in choices} >= {"operators.offload", "operators.optimizer_offload"}
    from peakflat_jax.plan.search import _lightest

    lightest = _lightest(config, knobs, True)
    light = max(pl.program_bytes(pl.plan_terms(config, lightest, GPU)).values())
    heavy = max(pl.program_bytes(pl.plan_terms(config, roomy, GPU)).values())
    tight, _ = pl.choose_knobs(config, knobs, GPU, (light + heavy) // 2, host, auto=True)
    assert tight != roomy
    assert max(pl.program_bytes(pl.plan_terms(config, tight, GPU)).values()) <= (
        light + heavy) // 2


@pytest.mark.parametrize("resident", [1, 3, 8])
def test_the_resident_state_is_the_layout_s(resident):
    """``optimizer.resident_groups``: the plan's device term for the resident state and its
    host term for the streamed one are the bytes of the state the trainer makes (its abstract
    state on h200-1's one device: the arrays in device memory, those in pinned_host)."""
    from peakflat_jax.model.sharding import abstract_model
    from peakflat_jax.train.optimizer import make_offloaded
    from peakflat_jax.train.trainer import moe_stack_mask, split_model_state

    overrides = ["operators.optimizer_offload=true", "mesh.seq=1"]
    config = load_config("h200-1", overrides + [f"optimizer.resident_groups={resident}"])
    mesh = mop.make_mesh(config.mesh, devices=jax.devices()[:1])
    params, _ = split_model_state(abstract_model(config.model, mesh)[1])
    state = make_offloaded(config.optimizer).abstract_state(
        params, stacked_layers=moe_stack_mask(params), resident_groups=resident)
    held = {"device": 0, "pinned_host": 0}
    for array in jax.tree.leaves((state.master, state.streamed)):
        held[array.sharding.memory_kind] += array.size * array.dtype.itemsize
    plan = pl.make_plan(config, 1, platform="gpu", baseline=False, search_context=False)
    named = {t.name: t.bytes for t in plan.terms}
    assert named["optimizer.resident_state"] == held["device"] > 0
    assert named["host.optimizer_state"] == held["pinned_host"]
    assert (held["pinned_host"] == 0) == (resident == 8)


def test_left_null_the_most_resident_groups_that_fit_are_kept():
    """``optimizer.resident_groups: null`` with the optimizer streamed on a GPU: the planner
    keeps the most groups whose state fits on the device beside the step, one group more does
    not fit, and the trainer's config carries the count; an explicit count is kept; with the
    device's memory unknown, or on a CPU, none is resident."""
    on = ["operators.moe_dispatch=pipelined", "operators.loss=ring", "operators.offload=all",
          "operators.optimizer_offload=true", "operators.layer_loop=unrolled",
          "data.seq_len=262144"]
    memory = dict(device_memory=int(132.8 * 2**30), host_memory=int(124.8 * 2**30))
    config = load_config("h200-1", on)
    assert config.optimizer.resident_groups is None  # the default
    plan = pl.make_plan(config, 1, platform="gpu", baseline=False, search_context=False,
                        **memory)
    chosen = plan.knobs.resident_groups
    groups = 1 + config.model.num_layers - config.model.num_dense_layers
    assert plan.filled_config().optimizer.resident_groups == chosen
    assert any(c.key == "optimizer.resident_groups" and c.value == chosen for c in plan.choices)

    def fits(count: int) -> bool:
        fixed = load_config("h200-1", on + [f"optimizer.resident_groups={count}"])
        return pl.make_plan(fixed, 1, platform="gpu", baseline=False, search_context=False,
                            **memory).feasible

    assert fits(chosen) and (chosen == groups or not fits(chosen + 1))
    explicit = load_config("h200-1", on + ["optimizer.resident_groups=3"])
    assert pl.make_plan(explicit, 1, platform="gpu", baseline=False, search_context=False,
                        **memory).knobs.resident_groups == 3
    assert pl.make_plan(config, 1, platform="gpu", baseline=False,
                        search_context=False).knobs.resident_groups == 0
    assert pl.make_plan(config, 1, platform="cpu", baseline=False, search_context=False,
                        **memory).knobs.resident_groups == 0


# ----------------------------------------------------------------------------------------------
# The command.


def run_plan(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = plan_command.main(list(argv))
    return status, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("preset, devices", [("paper-120b", 16), ("paper-241b", 32),
                                             ("paper-667b", 64)])
def test_paper_presets_fit_at_one_million_tokens_with_the_operators_only(preset, devices):
    """H200s (139 GiB) with a per-device share of the paper's hosts (240 GiB), at the paper's
    device counts: feasible with the operators, not without."""
    status, out, _ = run_plan(preset, "--context", "1048576", "--devices", str(devices),
                              "--device-memory", "139", "--host-memory", "240", "--json")
    result = json.loads(out)
    assert status == 0 and result["feasible"] is True
    assert result["total_bytes"] <= result["device_bytes"] == 139 * 2**30
    assert result["baseline"]["feasible"] is False
    assert result["largest_context"] >= 1048576
    assert result["knobs"]["operators.token_budget"] is not None  # filled by the rule
    assert result["verdict"].startswith(f"{preset} fits")


def test_the_verdict_comes_first_and_the_table_names_every_term():
    status, out, _ = run_plan("tiny", *SMALL, "--device-memory", "1", "--platform", "cpu",
                              "--devices", "8")
    lines = out.splitlines()
    assert status == 0 and lines[0].startswith("peakflat plan tiny fits: ")
    assert "largest context" in lines[0] and "closed form" in lines[0]
    for name in ("params", "kept_boundaries", "moe.dispatch", "loss.strips", "loss.logits",
                 "embedding_table", "host.optimizer_state", "operators on", "baseline"):
        assert name in out
    assert "backward's rows of width H" not in out  # short formulas; --formulas: the long
    assert "backward's rows of width H" in run_plan("tiny", *SMALL, "--device-memory", "1",
                                                    "--devices", "8", "--formulas")[1]


@pytest.mark.parametrize("argv, message", [
    (["--context", "102", "--devices", "8"], "context: 102 tokens do not split over mesh.seq"),
    (["--context", "-4", "--devices", "8"], "--context"),
    (["--devices", "0"], "--devices"),
    (["--device-memory", "-2", "--devices", "8"], "--device-memory"),
    (["--host-memory", "0", "--devices", "8"], "--host-memory"),
    (["--devices", "8", "--platform", "cpu", "--rate", "nope=1"], "--rate"),
    (["--devices", "6"], "there are 6 devices"),
])
def test_bad_input_is_named(argv, message):
    memory = [] if "--device-memory" in argv else ["--device-memory", "1"]
    status, _, err = run_plan("tiny", *argv, *memory)
    assert status == 2 and message in err, err


def test_an_odd_length_for_cudnn_is_named_as_given():
    """The cuDNN length rule names the argument the length came from: --context, or the
    config's data.seq_len."""
    status, _, err = run_plan("h200-1", "--context", "634549")
    assert status == 2 and err.startswith("peakflat plan: context: cuDNN flash attention "
                                          "trains only sequence lengths that are multiples of "
                                          "2, got 634549 (take 634548"), err
    status, _, err = run_plan("h200-1", "data.seq_len=634549")
    assert status == 2 and "data.seq_len: cuDNN flash attention" in err, err


def test_unknown_gpu_memory_on_a_machine_without_a_gpu_is_an_error():
    status, _, err = run_plan("tiny", "--devices", "8", "--platform", "gpu")
    assert status == 2 and "--device-memory" in err and "device.memory_gib" in err, err


def test_bad_sizes_in_the_config_are_named():
    with pytest.raises(ConfigError, match="data.seq_len"):
        small("data.seq_len=-8")
    with pytest.raises(pl.PlanError, match="devices"):
        pl.make_plan(small(), -1, platform="cpu")
    with pytest.raises(pl.PlanError, match="device_memory"):
        pl.make_plan(small(), 8, platform="cpu", device_memory=-5)
    with pytest.raises(ConfigError, match="device.xla_flags"):
        small("device.xla_flags=[not-a-flag]")
