"""OffloadStreamAdamW: optax.adamw's numbers, host-resident state, a state that carries its
layout, checkpoints through the trainer's orbax CheckpointManager, bad input."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from _helpers import iter_jaxprs
from conftest import make_mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import peakflat_jax as pf

MemorySpace = jax.memory.Space


def make_params(rng, dtype=jnp.bfloat16):
    return {"embed": jnp.asarray(rng.standard_normal((37, 16)), dtype),
            "layers": [{"w": jnp.asarray(rng.standard_normal((16, 24)), dtype),
                        "b": jnp.asarray(rng.standard_normal((24,)), jnp.float32)}
                       for _ in range(2)],
            "scale": jnp.asarray(rng.standard_normal(()), jnp.float32)}


def random_grads(rng, params):
    return jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape), p.dtype), params)


def assert_tree_close(actual, expected, rtol, scale=None):
    """Per leaf ||a - e|| <= rtol * ||s|| (equal up to float reassociation), s = ``scale``'s
    leaf, else e's; rtol=0: bitwise."""
    scales = jax.tree.leaves(expected if scale is None else scale)
    for a, e, s in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), scales):
        a, e, s = (np.asarray(x, np.float64) for x in (a, e, s))
        if rtol == 0:
            np.testing.assert_array_equal(a, e)
        else:
            assert np.linalg.norm(a - e) <= rtol * np.linalg.norm(s), (a, e)


def step_scale(master, updates):
    """|master| + |updates| per element: the size of the operands of the step's last sum, against
    which rounding differences are relative. A leaf that the step takes near zero (a scalar
    drawn small, say) has a tiny norm of its own but not of these."""
    return jax.tree.map(lambda m, u: jnp.abs(m) + jnp.abs(u), master, updates)


@pytest.mark.parametrize("bucket_params, slots", [(10_000, 2), (100, 1), (7, 2), (250, 3)])
@pytest.mark.parametrize("schedule", [False, True])
def test_matches_optax_adamw(rng, bucket_params, slots, schedule):
    params = make_params(rng)
    learning_rate = (optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 6) if schedule
                     else 3e-3)
    hyper = dict(b1=0.8, b2=0.95, eps=1e-6, weight_decay=0.1)
    opt = pf.offload_stream_adamw(learning_rate, bucket_params=bucket_params, slots=slots,
                                  **hyper)
    state = opt.init(params)
    reference = optax.adamw(learning_rate, mu_dtype=jnp.float32, **hyper)
    master = jax.tree.map(lambda p: p.astype(jnp.float32), params)
    reference_state = reference.init(master)
    reference_step = jax.jit(lambda g, s, p: reference.update(g, s, p))
    for _ in range(5):
        grads = random_grads(rng, params)
        params, state = opt.step(grads, state)
        updates, reference_state = reference_step(
            jax.tree.map(lambda g: g.astype(jnp.float32), grads), reference_state, master)
        scale = step_scale(master, updates)
        master = optax.apply_updates(master, updates)
        ours = opt.master_params(state)
        assert_tree_close(ours, master, rtol=1e-6, scale=scale)
        # Working params: exactly our master in the params' dtypes.
        assert jax.tree.map(lambda p: p.dtype, params) == jax.tree.map(
            lambda p: p.dtype, make_params(rng))
        assert_tree_close(params, jax.tree.map(lambda m, p: m.astype(p.dtype), ours, params),
                          rtol=0)


def test_clipping_matches_optax_chain(rng):
    params = make_params(rng, jnp.float32)
    opt = pf.offload_stream_adamw(1e-2, bucket_params=50, max_grad_norm=0.5)
    state = opt.init(params)
    reference = optax.chain(optax.clip_by_global_norm(0.5),
                            optax.adamw(1e-2, weight_decay=0.0, mu_dtype=jnp.float32))
    reference_state = reference.init(params)
    master = params
    for _ in range(3):
        grads = random_grads(rng, params)
        _, state = opt.step(grads, state)
        updates, reference_state = reference.update(grads, reference_state, master)
        scale = step_scale(master, updates)
        master = optax.apply_updates(master, updates)
        assert_tree_close(opt.master_params(state), master, rtol=1e-6, scale=scale)


def test_state_lives_in_host_memory(rng):
    params = make_params(rng)
    opt = pf.offload_stream_adamw(1e-3, bucket_params=300)
    state = opt.init(params)
    params, state = opt.step(random_grads(rng, params), state)
    total = sum(p.size for p in jax.tree.leaves(params))
    assert len(state.master) == -(-total // 300)  # buckets split leaves
    for array in (*state.master, *(a for bucket in state.streamed for a in bucket)):
        assert array.sharding.memory_kind == "pinned_host" and array.dtype == jnp.float32
    for leaf in jax.tree.leaves(params):
        assert leaf.sharding.memory_kind == "device"


def save_checkpoint(directory, step, params, opt, state):
    """What the trainer does: params, optimizer state and its layout in one Composite."""
    with ocp.CheckpointManager(directory) as manager:
        manager.save(step, args=ocp.args.Composite(
            params=ocp.args.StandardSave(params), opt_state=ocp.args.StandardSave(state),
            opt_metadata=ocp.args.JsonSave(opt.state_metadata(state))))
        manager.wait_until_finished()


def restore_checkpoint(directory, step, abstract_params, opt):
    """What a fresh trainer does: the layout is checked first, then params and state are
    restored into the placements of the abstract targets (the state's buckets: pinned_host)."""
    target = opt.abstract_state(abstract_params)
    with ocp.CheckpointManager(directory) as manager:
        metadata = manager.restore(step, args=ocp.args.Composite(
            opt_metadata=ocp.args.JsonRestore()))["opt_metadata"]
        opt.check_metadata(target, metadata)
        restored = manager.restore(step, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(abstract_params),
            opt_state=ocp.args.StandardRestore(target)))
    return restored["params"], restored["opt_state"]


def abstract(tree):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                        tree)


def test_checkpoint_round_trip_continues_bit_for_bit(rng, tmp_path):
    params = make_params(rng)
    schedule = optax.linear_schedule(1e-2, 1e-3, 10)
    grads = [random_grads(rng, params) for _ in range(4)]

    def run(steps, opt, state, params):
        for g in steps:
            params, state = opt.step(g, state)
        return params, state

    opt = pf.offload_stream_adamw(schedule, weight_decay=0.01, bucket_params=100)
    straight_params, straight = run(grads, opt, opt.init(params), params)

    half_params, half = run(grads[:2], opt, opt.init(params), params)
    save_checkpoint(tmp_path / "ckpt", 2, half_params, opt, half)
    fresh = pf.offload_stream_adamw(schedule, weight_decay=0.01, bucket_params=100)
    restored_params, restored = restore_checkpoint(tmp_path / "ckpt", 2, abstract(params), fresh)
    assert all(a.sharding.memory_kind == "pinned_host"
               for a in (*restored.master, *(a for b in restored.streamed for a in b)))
    assert [len(bucket) for bucket in restored.streamed] == [2] * len(restored.master)  # mu, nu
    assert all(a.sharding.memory_kind == "device" for a in restored.shared)  # the count
    resumed_params, resumed = run(grads[2:], fresh, restored, restored_params)
    assert_tree_close(fresh.master_params(resumed), opt.master_params(straight), rtol=0)
    assert_tree_close(resumed_params, straight_params, rtol=0)
    assert [int(count) for count in resumed.shared] == [4, 4]  # adam's and the schedule's


@pytest.mark.parametrize("argument, kwargs", [
    ("learning_rate", dict(learning_rate=-1.0)),
    ("b1", dict(b1=1.0)),
    ("b2", dict(b2=-0.1)),
    ("eps", dict(eps=0.0)),
    ("weight_decay", dict(weight_decay=-1e-3)),
    ("bucket_params", dict(bucket_params=0)),
    ("slots", dict(slots=0)),
    ("slots", dict(slots=True)),
    ("max_grad_norm", dict(max_grad_norm=0.0)),
])
def test_bad_hyperparameters_name_the_argument(argument, kwargs):
    arguments = {"learning_rate": 1e-3, **kwargs}
    with pytest.raises(ValueError, match=argument):
        pf.offload_stream_adamw(**arguments)


def test_grads_that_differ_from_the_params(rng):
    params = make_params(rng)
    opt = pf.offload_stream_adamw(1e-3)
    state = opt.init(params)
    grads = random_grads(rng, params)
    with pytest.raises(ValueError, match="grads"):
        opt.step({**grads, "extra": jnp.zeros(3)}, state)
    wrong_shape = {**grads, "embed": jnp.zeros((36, 16), jnp.bfloat16)}
    with pytest.raises(ValueError, match="grads"):
        opt.step(wrong_shape, state)


@pytest.mark.parametrize("params", [
    {"bias": jnp.ones(8)},                                  # a bucket that is exactly one leaf
    {"a": jnp.ones(3), "empty": jnp.zeros((0, 4)), "c": jnp.ones((2,), jnp.bfloat16)},
])
def test_edge_layouts_match_optax(rng, params):
    params = jax.tree.map(lambda p: p + jnp.asarray(rng.standard_normal(p.shape), p.dtype),
                          params)
    opt = pf.offload_stream_adamw(1e-2, weight_decay=0.1, bucket_params=8)
    state = opt.init(params)
    reference = optax.adamw(1e-2, weight_decay=0.1, mu_dtype=jnp.float32)
    master = jax.tree.map(lambda p: p.astype(jnp.float32), params)
    reference_state = reference.init(master)
    for _ in range(3):
        grads = random_grads(rng, params)
        params, state = opt.step(grads, state)
        updates, reference_state = reference.update(
            jax.tree.map(lambda g: g.astype(jnp.float32), grads), reference_state, master)
        scale = step_scale(master, updates)
        master = optax.apply_updates(master, updates)
        assert_tree_close(opt.master_params(state), master, rtol=1e-6, scale=scale)
    for leaf in jax.tree.leaves(params):
        assert leaf.sharding.memory_kind == "device"


def test_one_optimizer_steps_states_of_different_layouts(rng):
    """The layout is the state's: two inits with other params (and another bucket size) give
    two states that both keep working, interleaved, on one optimizer object, exactly as each
    does on an optimizer of its own."""
    params_a, params_b = make_params(rng), {"w": jnp.asarray(rng.standard_normal((9, 7)))}
    grads = [(random_grads(rng, params_a), random_grads(rng, params_b)) for _ in range(2)]
    shared = pf.offload_stream_adamw(1e-2, bucket_params=50)
    state_a, state_b = shared.init(params_a), shared.init(params_b)
    alone_a = pf.offload_stream_adamw(1e-2, bucket_params=50)
    alone_b = pf.offload_stream_adamw(1e-2, bucket_params=50)
    expected_a, expected_b = alone_a.init(params_a), alone_b.init(params_b)
    for grads_a, grads_b in grads:
        _, state_a = shared.step(grads_a, state_a)
        _, state_b = shared.step(grads_b, state_b)
        _, expected_a = alone_a.step(grads_a, expected_a)
        _, expected_b = alone_b.step(grads_b, expected_b)
    assert_tree_close(shared.master_params(state_a), alone_a.master_params(expected_a), rtol=0)
    assert_tree_close(shared.master_params(state_b), alone_b.master_params(expected_b), rtol=0)


def test_metadata_of_another_layout_is_refused(rng):
    params = make_params(rng)
    opt = pf.offload_stream_adamw(1e-3, bucket_params=100)
    state = opt.init(params)
    metadata = opt.state_metadata(state)
    opt.check_metadata(state, metadata)  # its own: accepted
    other = opt.abstract_state(params)
    opt.check_metadata(other, metadata)  # the abstract state of the same layout: accepted
    for wrong in (pf.offload_stream_adamw(1e-3, bucket_params=101).abstract_state(params),
                  opt.abstract_state({**params, "scale": jnp.zeros((2,))})):
        with pytest.raises(ValueError, match="metadata: .* another layout"):
            opt.check_metadata(wrong, metadata)
    with pytest.raises(ValueError, match="metadata"):
        opt.check_metadata(state, ["not", "a", "dict"])


def test_a_state_whose_arrays_do_not_fit_its_layout_is_refused(rng):
    params = make_params(rng)
    opt = pf.offload_stream_adamw(1e-3, bucket_params=100)
    state = opt.init(params)
    truncated = dataclasses.replace(state, streamed=state.streamed[:-1])
    with pytest.raises(ValueError, match="state: expected .* arrays of shapes"):
        opt.step(random_grads(rng, params), truncated)
    with pytest.raises(ValueError, match="state: expected the OffloadStreamState"):
        opt.master_params({"master": state.master})


def test_numpy_scalars_are_accepted(rng):
    params = make_params(rng)
    grads = random_grads(rng, params)
    results = []
    for scalar, double in ((np.float32, np.float64), (float, float)):
        opt = pf.offload_stream_adamw(scalar(1e-3), b1=double(0.9), eps=scalar(1e-8))
        results.append(opt.step(grads, opt.init(params)))
    assert_tree_close(results[0][0], results[1][0], rtol=0)


# -- FSDP: params sharded over a mesh; each device streams the state of its own shards ----------

FSDP_SPECS = {"embed": P("data", None), "w": P(None, "model"), "both": P(("data", "model")),
              "bias": P(), "scale": P()}


def sharded_params(rng, mesh):
    arrays = {"embed": rng.standard_normal((12, 16)), "w": rng.standard_normal((16, 20)),
              "both": rng.standard_normal((40,)), "bias": rng.standard_normal((24,)),
              "scale": rng.standard_normal(())}
    dtypes = {"embed": jnp.bfloat16, "w": jnp.bfloat16, "both": jnp.float32,
              "bias": jnp.float32, "scale": jnp.float32}
    return {k: jax.device_put(jnp.asarray(a, dtypes[k]), NamedSharding(mesh, FSDP_SPECS[k]))
            for k, a in arrays.items()}


def sharded_grads(rng, params):
    return jax.tree.map(lambda p: jax.device_put(
        jnp.asarray(rng.standard_normal(p.shape), p.dtype), p.sharding), params)


@pytest.mark.parametrize("bucket_params, slots, max_grad_norm", [(1000, 2, None), (7, 1, None),
                                                                 (30, 3, 2.0)])
def test_fsdp_matches_optax_adamw(rng, bucket_params, slots, max_grad_norm):
    mesh = make_mesh(("data", 2), ("model", 4))
    params = sharded_params(rng, mesh)
    hyper = dict(b1=0.8, b2=0.95, eps=1e-6, weight_decay=0.1)
    schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 6)
    opt = pf.offload_stream_adamw(schedule, bucket_params=bucket_params, slots=slots,
                                  max_grad_norm=max_grad_norm, **hyper)
    state = opt.init(params)
    reference = optax.adamw(schedule, mu_dtype=jnp.float32, **hyper)
    if max_grad_norm is not None:
        reference = optax.chain(optax.clip_by_global_norm(max_grad_norm), reference)
    master = jax.tree.map(lambda p: np.asarray(p, np.float32), params)
    reference_state = reference.init(master)
    for _ in range(4):
        grads = sharded_grads(rng, params)
        params, state = opt.step(grads, state)
        updates, reference_state = reference.update(
            jax.tree.map(lambda g: np.asarray(g, np.float32), grads), reference_state, master)
        scale = step_scale(master, updates)
        master = optax.apply_updates(master, updates)
        ours = opt.master_params(state)
        assert_tree_close(ours, master, rtol=1e-6, scale=scale)
        for key, leaf in params.items():  # working params: the master cast, placed as before
            assert leaf.sharding.is_equivalent_to(NamedSharding(mesh, FSDP_SPECS[key]), leaf.ndim)
            np.testing.assert_array_equal(leaf, ours[key].astype(leaf.dtype))
            assert ours[key].sharding.is_equivalent_to(leaf.sharding, leaf.ndim)


def test_fsdp_state_is_one_piece_per_device_and_the_step_moves_nothing_between_them(rng):
    mesh = make_mesh(("data", 2), ("model", 4))
    params = sharded_params(rng, mesh)
    opt = pf.offload_stream_adamw(1e-3, bucket_params=50)
    state = opt.init(params)
    # Per device: 12*16/2 + 16*20/4 + 40/8 + 24 + 1 = 96 + 80 + 5 + 25 = 206 elements.
    assert [a.shape for a in state.master] == [(8 * 50,)] * 4 + [(8 * 6,)]
    for array in (*state.master, *(a for bucket in state.streamed for a in bucket)):
        assert array.sharding.memory_kind == "pinned_host"
        assert {s.data.shape for s in array.addressable_shards} == {(array.shape[0] // 8,)}
    grads = sharded_grads(rng, params)
    text = opt.lower(grads, state).compile().as_text()
    for collective in ("all-gather", "all-to-all", "collective-permute", "all-reduce",
                       "reduce-scatter"):
        assert collective not in text, collective
    # With clipping, the global norm is the one thing the devices share: a scalar all-reduce.
    clipped = pf.offload_stream_adamw(1e-3, bucket_params=50, max_grad_norm=1.0)
    clipped_state = clipped.init(params)
    text = clipped.lower(grads, clipped_state).compile().as_text()
    reduces = [line for line in text.splitlines() if " all-reduce(" in line]
    assert reduces and all("f32[] all-reduce(" in line for line in reduces), reduces
    assert "all-gather" not in text and "all-to-all" not in text


def test_fsdp_checkpoint_round_trip(rng, tmp_path):
    mesh = make_mesh(("data", 2), ("model", 4))
    params = sharded_params(rng, mesh)
    grads = [sharded_grads(rng, params) for _ in range(3)]
    opt = pf.offload_stream_adamw(1e-2, bucket_params=64)
    state = opt.init(params)
    params, state = opt.step(grads[0], state)
    save_checkpoint(tmp_path / "ckpt", 1, params, opt, state)
    straight_params, straight = params, state
    for g in grads[1:]:
        straight_params, straight = opt.step(g, straight)
    fresh = pf.offload_stream_adamw(1e-2, bucket_params=64)
    params, resumed = restore_checkpoint(tmp_path / "ckpt", 1, abstract(params), fresh)
    for restored, expected in zip(resumed.master, straight.master):
        assert restored.sharding.is_equivalent_to(expected.sharding, 1)
        assert restored.sharding.memory_kind == "pinned_host"
    for g in grads[1:]:
        params, resumed = fresh.step(g, resumed)
    assert_tree_close(fresh.master_params(resumed), opt.master_params(straight), rtol=0)
    assert_tree_close(params, straight_params, rtol=0)


def test_grads_placed_otherwise_are_moved_to_the_params_placement(rng):
    mesh = make_mesh(("data", 2), ("model", 4))
    params = sharded_params(rng, mesh)
    grads = sharded_grads(rng, params)
    moved = {**grads, "w": jax.device_put(grads["w"], NamedSharding(mesh, P("model", None)))}
    gathered = jax.tree.map(lambda g: jax.device_put(g, jax.devices()[0]), grads)
    results = []
    for placed in (grads, moved, gathered):
        opt = pf.offload_stream_adamw(1e-3, bucket_params=50)
        new_params, state = opt.step(placed, opt.init(params))
        results.append((new_params, opt.master_params(state)))
    for other in results[1:]:
        assert_tree_close(other, results[0], rtol=0)


def test_params_that_are_not_on_one_device_or_one_mesh_are_refused():
    mesh = make_mesh(("data", 2), ("model", 4))
    opt = pf.offload_stream_adamw(1e-3)
    mixed = {"a": jnp.ones(4), "b": jax.device_put(jnp.ones(8), NamedSharding(mesh, P("data")))}
    with pytest.raises(ValueError, match="params: expected every leaf"):
        opt.init(mixed)
    spread = {"a": jax.device_put(jnp.ones(4), jax.devices()[0]),
              "b": jax.device_put(jnp.ones(4), jax.devices()[1])}
    with pytest.raises(ValueError, match="params: expected every leaf on one device"):
        opt.init(spread)


def test_a_checkpoint_of_another_mesh_layout_is_refused(rng, tmp_path):
    """The same shapes and bucket sizes, but the pieces belong to other shards: restoring it
    would put each device's moments on another device's parameters."""
    values = rng.standard_normal((8,))
    saved_mesh = make_mesh(("data", 2), ("model", 4))
    opt = pf.offload_stream_adamw(1e-3, bucket_params=8)
    params = {"w": jax.device_put(jnp.asarray(values, jnp.float32),
                                  NamedSharding(saved_mesh, P("model")))}
    save_checkpoint(tmp_path / "ckpt", 0, params, opt, opt.init(params))
    other_mesh = make_mesh(("model", 4), ("data", 2))
    other = {"w": jax.device_put(jnp.asarray(values, jnp.float32),
                                 NamedSharding(other_mesh, P("model")))}
    with pytest.raises(ValueError, match="metadata: .* another layout"):
        restore_checkpoint(tmp_path / "ckpt", 0, abstract(other), opt)
    restored_params, restored = restore_checkpoint(tmp_path / "ckpt", 0, abstract(params), opt)
    assert_tree_close(opt.master_params(restored), params, rtol=0)


# -- the slot chain: what bounds the staging on a GPU (on CPU the copies lower to nothing) -------


def copy_dependencies(jaxpr):
    """The step's host -> device copies and device -> host write-backs in program order (one
    device_put per bucket and direction, of all its arrays), and for each copy-in the set of
    write-backs it (transitively) waits on."""
    step = next(j for j in iter_jaxprs(jaxpr) if any(
        e.primitive.name == "optimization_barrier" for e in j.eqns))
    producers, copy_ins, write_backs = {}, [], []
    for eqn in step.eqns:
        for var in eqn.outvars:
            producers[var] = eqn
        if eqn.primitive.name == "device_put":
            source, target = eqn.invars[0].aval.memory_space, eqn.outvars[0].aval.memory_space
            if (source, target) == (MemorySpace.Host, MemorySpace.Device):
                copy_ins.append(eqn)
            elif (source, target) == (MemorySpace.Device, MemorySpace.Host):
                write_backs.append(eqn)

    def ancestors(eqn, seen):
        for var in eqn.invars:
            producer = producers.get(var) if not hasattr(var, "val") else None
            if producer is not None and id(producer) not in seen:
                seen.add(id(producer))
                ancestors(producer, seen)
        return seen

    return copy_ins, write_backs, [ancestors(e, set()) for e in copy_ins]


@pytest.mark.parametrize("slots", [1, 2])
def test_each_bucket_copy_waits_for_the_write_back_slots_buckets_earlier(rng, slots):
    params = make_params(rng)
    opt = pf.offload_stream_adamw(1e-3, bucket_params=200, slots=slots)
    state = opt.init(params)
    num_buckets = len(state.master)
    jaxpr = jax.make_jaxpr(opt.step)(random_grads(rng, params), state).jaxpr
    copy_ins, write_backs, waits = copy_dependencies(jaxpr)
    assert len(copy_ins) == len(write_backs) == num_buckets > slots
    assert all(len(e.invars) == 3 for e in copy_ins + write_backs)  # master, mu, nu
    for b in range(num_buckets):
        # Bucket b's copy-in waits on the write-back of bucket b - slots (and so on those its
        # own chain waited on: b - 2 slots, ...), and on no later bucket's.
        waited = {i for i, w in enumerate(write_backs) if id(w) in waits[b]}
        assert waited == set(range(b - slots, -1, -slots)), (b, waited)
