"""The run's optimizer with its hyperparameters as inputs (set from the host schedule before
every step) equals optax's own AdamW whose schedule runs on its internal count, on the device,
offloaded and on the host CPU, and one compiled step serves any schedule. The host-CPU update is
the device update bit for bit, and both are a float64 AdamW's; its state in chunks, it is the
leaf-after-leaf program it replaced bit for bit, and its chunks' loops run side by side."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import load_script, relative_error

from peakflat_jax import reference
from peakflat_jax.config import OptimizerConfig
from peakflat_jax.train.optimizer import (
    MAX_HOST_CHUNKS,
    MIN_HOST_CHUNK_PARAMS,
    DeviceAdamW,
    HostCpuAdamW,
    host_chunk_rows,
    hyperparams_at,
    learning_rate_schedule,
    make_offloaded,
    with_hyperparams,
)

STEPS = 6
CONFIG = OptimizerConfig(learning_rate=1e-2, warmup_steps=2, weight_decay=0.1, b2=0.95,
                         max_grad_norm=1.0, bucket_params=7)


def draw(rng):
    params = {"w": jnp.asarray(rng.standard_normal((4, 5)), jnp.float32),
              "b": jnp.asarray(rng.standard_normal((5,)), jnp.float32)}
    grads = [jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape) * scale,
                                                jnp.float32), params)
             for scale in (3.0, 0.1, 2.0, 0.05, 1.0, 0.3)]  # above and below the clip
    return params, grads


def optax_reference(params, grads):
    """optax.adamw with the schedule on its count, after optax's clip: the independent side."""
    schedule = learning_rate_schedule(CONFIG, STEPS)
    transformation = optax.chain(
        optax.clip_by_global_norm(CONFIG.max_grad_norm),
        optax.adamw(schedule, b1=CONFIG.b1, b2=CONFIG.b2, eps=CONFIG.eps,
                    weight_decay=CONFIG.weight_decay, mu_dtype=jnp.float32))
    state = transformation.init(params)
    history = []
    for g in grads:
        updates, state = transformation.update(g, state, params)
        params = optax.apply_updates(params, updates)
        history.append(params)
    return history


@pytest.mark.parametrize("where", ["device", "offloaded", "host_cpu"])
def test_injected_hyperparameters_equal_optax_schedule(rng, where):
    params, grads = draw(rng)
    schedule = learning_rate_schedule(CONFIG, STEPS)
    expected = optax_reference(params, grads)
    if where == "device":
        optimizer = DeviceAdamW(CONFIG)
        state = optimizer.init(params)
        step = jax.jit(optimizer.update)
    else:
        optimizer = make_offloaded(CONFIG) if where == "offloaded" else HostCpuAdamW(CONFIG)
        state = optimizer.init(params)
    current = params
    for t, g in enumerate(grads):
        state = with_hyperparams(state, hyperparams_at(CONFIG, schedule, t))
        if where == "device":
            current, state = step(g, current, state)
        else:
            current, state = optimizer.step(g, state)
        for name in params:
            assert relative_error(current[name], expected[t][name]) < 1e-6, (t, name)


def test_the_rate_set_is_the_rate_used(rng):
    """A zero rate and no decay leave the weights as they are; the configured peak does not."""
    params, grads = draw(rng)
    optimizer = DeviceAdamW(CONFIG)
    state = optimizer.init(params)
    frozen = with_hyperparams(state, dict(hyperparams_at(CONFIG, lambda _: 0.0, 0),
                                          weight_decay=0.0))
    same, _ = jax.jit(optimizer.update)(grads[0], params, frozen)
    moved, _ = jax.jit(optimizer.update)(grads[0], params, state)
    for name in params:
        np.testing.assert_array_equal(same[name], params[name])
        assert not np.allclose(moved[name], params[name])


def test_one_compiled_step_serves_any_schedule(rng):
    """The step's program has no schedule in it: runs of other lengths or rates reuse it."""
    params, grads = draw(rng)
    optimizer = DeviceAdamW(CONFIG)
    # Committed to a device, as the trainer's arrays are (jit's outputs are).
    params, state = jax.device_put((params, optimizer.init(params)), jax.devices()[0])
    step = jax.jit(optimizer.update)
    for total_steps, peak in ((STEPS, 1e-2), (3 * STEPS, 3e-3)):
        config = OptimizerConfig(**{**CONFIG.__dict__, "learning_rate": peak})
        schedule = learning_rate_schedule(config, total_steps)
        for t in range(2):
            state = with_hyperparams(state, hyperparams_at(config, schedule, t))
            params, state = step(grads[t], params, state)
    assert step._cache_size() == 1


def run_steps(optimizer, params, grads, *, device: bool):
    """(params, master, optax state) after each of ``grads``' steps with the run's schedule,
    from ``DeviceAdamW`` (jitted) or ``HostCpuAdamW`` (its state joined out of its chunks)."""
    schedule = learning_rate_schedule(CONFIG, STEPS)
    state = optimizer.init(params)
    step = jax.jit(optimizer.update) if device else None
    history = []
    for t, g in enumerate(grads):
        state = with_hyperparams(state, hyperparams_at(CONFIG, schedule, t))
        params, state = step(g, params, state) if device else optimizer.step(g, state)
        # Read now: the host update donates its state.
        master, optax_state = state if device else optimizer.standard_state(state, params)
        history.append(jax.device_get((params, params if master is None else master,
                                       optax_state)))
    return history


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_host_cpu_update_is_the_device_update(rng, dtype):
    """optimizer.update_on: host_cpu against the device's AdamW, the same gradients, clipping
    and schedule, on one device: after every step the optax state (moments, counts,
    hyperparameters) bit for bit, the fp32 master to 1e-6 (an ulp or two apart: the two
    programs' bias-corrected steps compile apart), the working params the master cast; the
    state on the host CPU device."""
    params, grads = draw(rng)
    params = jax.tree.map(lambda p: p.astype(dtype), params)
    grads = [jax.tree.map(lambda g: g.astype(dtype), g) for g in grads]
    on_device = run_steps(DeviceAdamW(CONFIG), params, grads, device=True)
    host = HostCpuAdamW(CONFIG)
    on_host = run_steps(host, params, grads, device=False)
    for t, ((_, device_master, device_state), (host_params, host_master, host_state)) in (
            enumerate(zip(on_device, on_host), start=1)):
        chex.assert_trees_all_equal(host_state, device_state)
        for name in device_master:
            assert relative_error(host_master[name], device_master[name]) <= 1e-6, (t, name)
            assert host_master[name].dtype == np.float32
            np.testing.assert_array_equal(host_params[name],
                                          host_master[name].astype(host_params[name].dtype))
            assert host_params[name].dtype == dtype
    state = host.init(params)
    assert {leaf.sharding for leaf in jax.tree.leaves(state)} == {host.host_sharding}
    assert host.host.platform == "cpu"


def test_host_cpu_update_is_a_float64_adamw(rng):
    """Three clipped updates of the host CPU against the float64 oracle (reference.adamw_steps,
    no optax): each step's change of the params to 1e-5 relative, the params to 1e-6."""
    params, grads = draw(rng)
    schedule = learning_rate_schedule(CONFIG, STEPS)
    hyper = [hyperparams_at(CONFIG, schedule, t) for t in range(3)]
    expected = reference.adamw_steps({k: np.asarray(v) for k, v in params.items()},
                                     [{k: np.asarray(v) for k, v in g.items()} for g in grads[:3]],
                                     hyper, max_grad_norm=CONFIG.max_grad_norm)
    optimizer = HostCpuAdamW(CONFIG)
    state, before, before_expected = optimizer.init(params), params, params
    for t in range(3):
        state = with_hyperparams(state, hyper[t])
        current, state = optimizer.step(grads[t], state)
        for name in params:
            change = np.asarray(current[name], np.float64) - np.asarray(before[name], np.float64)
            assert relative_error(change, expected[t][name] - before_expected[name]) < 1e-5
            assert relative_error(current[name], expected[t][name]) < 1e-6
        before, before_expected = current, expected[t]


def test_one_compiled_host_update_serves_any_schedule(rng):
    """The host update's program has no schedule in it (the hyperparameters are its inputs),
    and its donated state is consumed."""
    params, grads = draw(rng)
    optimizer = HostCpuAdamW(CONFIG)
    state = optimizer.init(params)
    for total_steps, peak in ((STEPS, 1e-2), (3 * STEPS, 3e-3)):
        config = OptimizerConfig(**{**CONFIG.__dict__, "learning_rate": peak})
        schedule = learning_rate_schedule(config, total_steps)
        for t in range(2):
            state = with_hyperparams(state, hyperparams_at(config, schedule, t))
            old = state
            params, state = optimizer.step(grads[t], state)
            assert all(leaf.is_deleted() for leaf in jax.tree.leaves(old[0]))
    assert len(optimizer._executables) == 1


@pytest.mark.parametrize("shape", [(), (7,), (4096,), (37, 5), (2048, 1024), (3, 777, 999),
                                   (5, 1000, 1000), (11, 64, 2048, 1536), (9, 2**20)])
def test_host_chunks_are_whole_rows_of_the_leaf(shape):
    """A leaf's chunks: whole rows of its last dimension, consecutive, none below
    MIN_HOST_CHUNK_PARAMS (but a leaf's only one), at most MAX_HOST_CHUNKS, within a row of
    each other; one (the leaf as it is) where the leaf is small or 1-D."""
    rows = host_chunk_rows(shape)
    size = int(np.prod(shape))
    if not rows:
        assert len(shape) <= 1 or size < 2 * MIN_HOST_CHUNK_PARAMS or size == shape[-1]
        return
    assert sum(rows) * shape[-1] == size and 2 <= len(rows) <= MAX_HOST_CHUNKS
    assert max(rows) - min(rows) <= 1 and min(rows) * shape[-1] >= MIN_HOST_CHUNK_PARAMS // 2
    assert len(rows) == min(MAX_HOST_CHUNKS, size // MIN_HOST_CHUNK_PARAMS)


PREVIOUS_SHAPES = {"a": (37, 5), "b": (4096,), "c": (2048, 1024), "d": (3, 777, 999),
                   "e": (5, 1000, 1000)}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_chunked_host_update_is_the_previous_program_bit_for_bit(dtype):
    """HostCpuAdamW (each leaf's state in chunks of whole rows: 1 to 4 here) against the
    leaf-after-leaf program it replaced (``PreviousHostCpuAdamW``, whole leaves), the same
    random gradients above and below the clip, weight decay and a rising rate: after each of
    5 steps the working params, the master and the optax state are the same bits. (A 1-D leaf
    is one chunk; XLA:CPU's loops are not bit-stable under every cut of a 1-D range: on 2 cores
    an odd-length flat chunk changed LLVM's FMA contraction.)"""
    previous_cls = load_script("probes/probe_host_adamw").PreviousHostCpuAdamW
    config = OptimizerConfig(weight_decay=0.1, max_grad_norm=1.0)
    rng = np.random.default_rng(0)
    params = {k: jnp.asarray(rng.standard_normal(s) * 0.02, dtype)
              for k, s in PREVIOUS_SHAPES.items()}
    grads = [{k: jnp.asarray(rng.standard_normal(s) * scale, dtype)
              for k, s in PREVIOUS_SHAPES.items()} for scale in (3.0, 1e-3, 1.0, 1e-4, 30.0)]
    runs = []
    for optimizer in (HostCpuAdamW(config), previous_cls(config)):
        state, history = optimizer.init(params), []
        for t, g in enumerate(grads):
            state = with_hyperparams(state, hyperparams_at(config, lambda s: 1e-3 * (s + 1), t))
            working, state = optimizer.step(g, state)
            history.append(jax.device_get((working, optimizer.standard_state(state, params))))
        runs.append(history)
    chunked_state = HostCpuAdamW(config).init(params)[0]
    assert [len(chunked_state[k]) for k in PREVIOUS_SHAPES] == [1, 1, 2, 2, 4]
    for t, (ours, previous) in enumerate(zip(*runs)):
        for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(previous), strict=True):
            assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), t


def test_host_state_joins_back_into_the_device_state(rng):
    """``standard_state`` of a fresh host state is DeviceAdamW's init, structure and bits, and
    the chunks' bytes are the leaves' (12 bytes a parameter in all)."""
    params = {"w": jnp.asarray(rng.standard_normal((3000, 1024)), jnp.bfloat16),
              "b": jnp.asarray(rng.standard_normal((5,)), jnp.bfloat16)}
    host = HostCpuAdamW(CONFIG)
    state = host.init(params)
    assert len(state[0]["w"]) == 2 and state[0]["w"][0].shape == (1500, 1024)
    chex.assert_trees_all_equal(jax.device_get(host.standard_state(state, params)),
                                jax.device_get(DeviceAdamW(CONFIG).init(params)))
    per_param = sum(a.nbytes for a in jax.tree.leaves(state) if a.ndim)
    assert per_param == 12 * sum(p.size for p in jax.tree.leaves(params))
    abstract = host.abstract_state(params)
    assert jax.tree.structure(abstract) == jax.tree.structure(state)


def test_a_leafs_chunks_run_side_by_side():
    """The compiled host update of one leaf of 8 chunks, as XLA:CPU's thunk executor runs it
    (its graph, logged in a child process): 16 of its loops may run at once (each chunk's two
    moments), where the previous program's one loop per array let 2; each loop cut into the same
    tasks in both, and the same temporaries (the leaf's clipped fp32 gradient, 4 bytes a
    parameter, as its chunks)."""
    probe = load_script("probes/probe_host_adamw")
    shape = (4096, 2048)  # 8.4M parameters: 8 chunks of 512 rows
    assert host_chunk_rows(shape) == (512,) * 8
    ours = probe.loops_side_by_side("chunked", shape)
    previous = probe.loops_side_by_side("previous", shape)
    assert ours["loops_side_by_side"] >= 2 * 8 and previous["loops_side_by_side"] <= 2
    assert ours["tasks_per_loop"] == previous["tasks_per_loop"]
    # 8 chunks x (clipped gradient, mu, nu, master) and the working params joined in one loop.
    assert ours["leaf_loops"] == 4 * 8 + 1 and previous["leaf_loops"] == 5
    optimizer = HostCpuAdamW(CONFIG)
    params = {"w": jax.ShapeDtypeStruct(shape, jnp.bfloat16)}
    compiled = optimizer.lower(params, optimizer.abstract_state(params)).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    # At most the leaf's clipped fp32 gradient (the plan's term); all of it with the chunks side
    # by side, one chunk's where this process's XLA:CPU runs with CPU_SCHEDULER_FLAG (set by a
    # command run in-process before the backend started) and chains them.
    assert 4 * np.prod(shape) // 8 <= temp <= 4 * np.prod(shape) + 1024
