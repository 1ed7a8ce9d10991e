"""The optimizers' memory terms against XLA's CPU plan of their steps.

On CPU the host memory kinds are ordinary buffers and the in-jit copies lower to nothing, so the
plan shows the host state as donated (aliased) arguments, and the step's temporaries are what
the fused updates need: a weak view of the staging (the GPU plan is in docs/offload_adamw.md),
which the slot-chain test in test_offload_adamw.py complements.
"""

import jax
import jax.numpy as jnp
import optax
import pytest

import peakflat_jax as pf
from peakflat_jax import memory
from peakflat_jax.optim import offload_adamw, offload_stream
from peakflat_jax.plan import optimizer_terms

# XLA:CPU adds a pointer table of 8 bytes per output buffer to the output size, and the step
# count (4 bytes) is left out of the terms: the plan may exceed the terms by this little.
BOOKKEEPING_BYTES = 512


@pytest.mark.parametrize("num_leaves, leaf_params, bucket_params, slots", [
    (4, 10_000, 10_000, 1),    # a bucket per leaf
    (4, 10_000, 3_000, 2),     # buckets split leaves
    (4, 10_000, 3_000, 3),
    (4, 10_000, 50_000, 2),    # one bucket holds everything
])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_offload_adamw_terms_bound_the_cpu_plan(num_leaves, leaf_params, bucket_params, slots,
                                                dtype):
    params = [jnp.ones((leaf_params,), dtype) for _ in range(num_leaves)]
    opt = pf.offload_stream_adamw(1e-3, bucket_params=bucket_params, slots=slots)
    state = opt.init(params)
    plan = memory.compiled_memory(opt.lower(params, state).compile())
    num_params = num_leaves * leaf_params
    terms = offload_adamw.offload_stream_adamw_memory_terms(num_params, bucket_params, slots,
                                                            dtype)
    assert set(terms) == set(offload_adamw.MEMORY_FORMULAS)
    host = offload_adamw.offload_stream_adamw_host_bytes(num_params)
    # Measured: temp 0 to 24,196 bytes against a staging bound of 96,000 to 640,000 (at most
    # 25%, one fp32 bucket with everything in one bucket): XLA:CPU updates the donated host
    # buffers in place, so nothing is staged; the bound is the GPU's.
    assert plan.temp <= terms["staging"] + terms["staging_gpu_excess"]
    # The host state is exactly what the step donates and gets back (plus the count).
    assert host <= plan.alias <= host + BOOKKEEPING_BYTES
    assert plan.argument - plan.alias == terms["grads"]
    assert terms["working_params"] <= plan.output - plan.alias <= (
        terms["working_params"] + BOOKKEEPING_BYTES)


# Not Lion: XLA:CPU's plan of its step held 136,352 bytes of temp at beta 3,000 (the bound: 96,000
# at 2 slots), mostly copies of each bucket's momentum made at the slot chain's barriers and
# scheduled early. On CPU the copy-in is no copy, so the barrier's operand is the donated host
# buffer itself, which the update then overwrites in place while Lion reads the old momentum
# twice; on a GPU each copy-in is a fresh device buffer. Lion's GPU plan is not measured yet.
@pytest.mark.parametrize("transformation, state_bytes_per_param", [
    (optax.sgd(1e-3, momentum=0.9), 4), (optax.sgd(1e-3), 0),
    (optax.adam(1e-3, mu_dtype=jnp.bfloat16), 6)])
def test_offload_stream_terms_bound_the_cpu_plan(transformation, state_bytes_per_param):
    num_params, bucket_params, slots = 40_000, 3_000, 2
    params = [jnp.ones((10_000,), jnp.bfloat16) for _ in range(4)]
    opt = offload_stream.offload_stream(transformation, bucket_params=bucket_params, slots=slots)
    assert opt.state_bytes_per_param == state_bytes_per_param
    state = opt.init(params)
    plan = memory.compiled_memory(opt.lower(params, state).compile())
    terms = offload_stream.offload_stream_memory_terms(num_params, bucket_params, slots,
                                                       jnp.bfloat16, state_bytes_per_param)
    assert set(terms) == set(offload_stream.MEMORY_FORMULAS)
    host = offload_stream.offload_stream_host_bytes(num_params, state_bytes_per_param)
    assert plan.temp <= terms["staging"] + terms["staging_gpu_excess"]
    assert host <= plan.alias <= host + BOOKKEEPING_BYTES
    assert plan.argument - plan.alias == terms["grads"]
    assert terms["working_params"] <= plan.output - plan.alias <= (
        terms["working_params"] + BOOKKEEPING_BYTES)


def test_offload_adamw_terms_formulas():
    terms = offload_adamw.offload_stream_adamw_memory_terms(1_000, 300, 2, jnp.bfloat16)
    assert terms == {"resident_state": 0, "staging": 2 * 300 * 16,
                     "staging_gpu_excess": 300 * 8, "working_params": 2_000, "grads": 2_000}
    resident = offload_adamw.offload_stream_adamw_memory_terms(1_000, 300, 2, jnp.bfloat16,
                                                               resident_params=400)
    assert resident == {**terms, "resident_state": 400 * 12}
    assert offload_adamw.offload_stream_adamw_host_bytes(1_000, 400) == 600 * 12
    assert offload_adamw.offload_stream_adamw_link_bytes(1_000, 400) == 600 * 24
    with pytest.raises(ValueError, match="resident_params"):
        offload_adamw.offload_stream_adamw_memory_terms(100, 10, 1, jnp.float32,
                                                        resident_params=101)
    # Fewer buckets than slots: only the buckets there are are staged.
    small = offload_adamw.offload_stream_adamw_memory_terms(100, 300, 2, jnp.float32)
    assert small["staging"] == 100 * 16 and small["staging_gpu_excess"] == 100 * 8
    assert offload_adamw.offload_stream_adamw_host_bytes(1_000) == 12_000
    with pytest.raises(ValueError, match="slots"):
        offload_adamw.offload_stream_adamw_memory_terms(100, 10, 1.5, jnp.float32)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_on_device_adamw_terms_match_the_cpu_plan(dtype):
    """optax.adamw on device: fp32 params are the master; bf16 params need an fp32 master kept
    beside them (optax keeps none), updated and cast each step."""
    num_params = 4 * 25_000
    opt = optax.adamw(1e-3, mu_dtype=jnp.float32)
    master = [jnp.ones((25_000,), jnp.float32) for _ in range(4)]
    grads = [m.astype(dtype) for m in master]
    state = opt.init(master)

    def step(master, grads, state):
        updates, state = opt.update([g.astype(jnp.float32) for g in grads], state, master)
        master = optax.apply_updates(master, updates)
        return [m.astype(dtype) for m in master], master, state

    if dtype == jnp.float32:  # the params are the master: no second copy
        def step(master, grads, state):  # noqa: F811
            updates, state = opt.update(grads, state, master)
            return optax.apply_updates(master, updates), state

    compiled = jax.jit(step, donate_argnums=(0, 2)).lower(master, grads, state).compile()
    plan = memory.compiled_memory(compiled)
    terms = optimizer_terms.on_device_adamw_memory_terms(num_params, dtype)
    assert set(terms) == set(optimizer_terms.ON_DEVICE_FORMULAS)
    assert sum(terms.values()) == 16 * num_params
    # Measured: the plan's total exceeds the terms by 176 (fp32) and 140 (bf16) bytes: the
    # count, scalar temporaries and the output table.
    assert 0 <= plan.total - sum(terms.values()) <= BOOKKEEPING_BYTES
