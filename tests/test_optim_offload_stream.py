"""offload_stream: elementwise optax transformations streamed per bucket match the plain
transformation on the tree; transformations that are not elementwise are refused; layer groups
updated one at a time equal the whole step bit for bit."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import iter_jaxprs, optimizer_state_values
from conftest import make_mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_offload_adamw import assert_tree_close, copy_dependencies, step_scale

from peakflat_jax.optim.offload_stream import offload_stream

MemorySpace = jax.memory.Space

SCHEDULE = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 6)

TRANSFORMATIONS = {
    "adamw": lambda: optax.adamw(SCHEDULE, b1=0.8, b2=0.95, eps=1e-6, weight_decay=0.1,
                                 mu_dtype=jnp.float32),
    "adam_bf16_mu": lambda: optax.adam(1e-2, mu_dtype=jnp.bfloat16),
    "lion": lambda: optax.lion(SCHEDULE, b1=0.9, b2=0.98, weight_decay=0.05),
    "sgd_momentum": lambda: optax.sgd(1e-2, momentum=0.9),
    "sgd_nesterov": lambda: optax.sgd(SCHEDULE, momentum=0.8, nesterov=True),
    "sgd": lambda: optax.sgd(1e-2),
    "chain": lambda: optax.chain(optax.scale_by_adam(b1=0.85), optax.add_decayed_weights(0.02),
                                 optax.scale_by_learning_rate(SCHEDULE)),
    "injected": lambda: optax.inject_hyperparams(optax.adamw)(learning_rate=SCHEDULE,
                                                              weight_decay=0.1),
}
STATE_BYTES_PER_PARAM = {"adamw": 8, "adam_bf16_mu": 6, "lion": 4, "sgd_momentum": 4,
                         "sgd_nesterov": 4, "sgd": 0, "chain": 8, "injected": 8}


def make_params(rng):
    return {"embed": jnp.asarray(rng.standard_normal((12, 8)), jnp.bfloat16),
            "layers": {"w": jnp.asarray(rng.standard_normal((2, 8, 8)), jnp.bfloat16),
                       "b": jnp.asarray(rng.standard_normal((2, 8)), jnp.float32)},
            "scale": jnp.asarray(rng.standard_normal(()), jnp.float32)}


def random_grads(rng, params):
    return jax.tree.map(lambda p: jax.device_put(
        jnp.asarray(rng.standard_normal(p.shape), p.dtype), p.sharding), params)


def check_against_optax(rng, opt, reference, params, steps, **init_kwargs):
    """Steps ``opt`` and ``reference`` (on fp32 params and fp32-upcast grads) side by side and
    compares the masters after every step. The reference is jitted, as the step is: XLA may keep
    bf16 intermediates (a bf16 mu) in fp32 inside a fused program, and eager optax would round
    them after every operation instead."""
    state = opt.init(params, **init_kwargs)
    master = jax.tree.map(lambda p: np.asarray(p, np.float32), params)
    reference_state = reference.init(master)
    reference_update = jax.jit(reference.update)
    for _ in range(steps):
        grads = random_grads(rng, params)
        params, state = opt.step(grads, state)
        updates, reference_state = reference_update(
            jax.tree.map(lambda g: np.asarray(g, np.float32), grads), reference_state, master)
        scale = step_scale(master, updates)
        master = optax.apply_updates(master, updates)
        ours = opt.master_params(state)
        assert_tree_close(ours, master, rtol=1e-6, scale=scale)
        assert_tree_close(params, jax.tree.map(lambda m, p: m.astype(p.dtype), ours, params),
                          rtol=0)
    return params, state


@pytest.mark.parametrize("name, bucket_params", [
    *((name, 50) for name in sorted(TRANSFORMATIONS)),  # 50: buckets split every leaf but b
    ("lion", 10_000), ("sgd_nesterov", 10_000)])        # one bucket holds every leaf
def test_matches_the_optax_transformation(rng, name, bucket_params):
    opt = offload_stream(TRANSFORMATIONS[name](), bucket_params=bucket_params, slots=2)
    assert opt.state_bytes_per_param == STATE_BYTES_PER_PARAM[name]
    check_against_optax(rng, opt, TRANSFORMATIONS[name](), make_params(rng), steps=3)


@pytest.mark.parametrize("name", ["chain", "lion"])
def test_clipping_by_the_streamer_matches_clip_by_global_norm_in_a_chain(rng, name):
    opt = offload_stream(TRANSFORMATIONS[name](), bucket_params=40, max_grad_norm=0.5)
    reference = optax.chain(optax.clip_by_global_norm(0.5), TRANSFORMATIONS[name]())
    check_against_optax(rng, opt, reference, make_params(rng), steps=3)


FSDP_SPECS = {"embed": P("data", None), "layers": {"w": P(None, None, "model"), "b": P()},
              "scale": P()}


def sharded_params(rng, mesh):
    return jax.tree.map(lambda p, spec: jax.device_put(p, NamedSharding(mesh, spec)),
                        make_params(rng), FSDP_SPECS)


@pytest.mark.parametrize("name, max_grad_norm", [("sgd_nesterov", None), ("lion", 2.0)])
def test_fsdp_matches_the_optax_transformation(rng, name, max_grad_norm):
    mesh = make_mesh(("data", 2), ("model", 4))
    params = sharded_params(rng, mesh)
    opt = offload_stream(TRANSFORMATIONS[name](), bucket_params=20, slots=2,
                         max_grad_norm=max_grad_norm)
    reference = TRANSFORMATIONS[name]()
    if max_grad_norm is not None:
        reference = optax.chain(optax.clip_by_global_norm(max_grad_norm), reference)
    new_params, _ = check_against_optax(rng, opt, reference, params, steps=3)
    for new, old in zip(jax.tree.leaves(new_params), jax.tree.leaves(params)):
        assert new.sharding.is_equivalent_to(old.sharding, old.ndim)


# -- optax's transformations, one by one --------------------------------------------------------

# Elementwise: each holds to optax's own result on a tree cut across buckets.
OPTAX_ELEMENTWISE = {
    "adam": lambda: optax.adam(1e-2), "adamw": lambda: optax.adamw(SCHEDULE),
    "sgd": lambda: optax.sgd(1e-2), "momentum": lambda: optax.sgd(1e-2, momentum=0.9),
    "nesterov": lambda: optax.sgd(1e-2, momentum=0.9, nesterov=True),
    "rmsprop": lambda: optax.rmsprop(1e-2), "rmsprop_centered": lambda: optax.rmsprop(
        1e-2, centered=True, momentum=0.5),
    "adagrad": lambda: optax.adagrad(1e-2), "adabelief": lambda: optax.adabelief(1e-2),
    "yogi": lambda: optax.yogi(1e-2), "lion": lambda: optax.lion(1e-3),
    "radam": lambda: optax.radam(1e-2), "adamax": lambda: optax.adamax(1e-2),
    "adamaxw": lambda: optax.adamaxw(1e-2), "amsgrad": lambda: optax.amsgrad(1e-2),
    "nadam": lambda: optax.nadam(1e-2), "nadamw": lambda: optax.nadamw(1e-2),
    "adadelta": lambda: optax.adadelta(1e-1), "adan": lambda: optax.adan(1e-2),
    "rprop": lambda: optax.rprop(1e-2), "sign_sgd": lambda: optax.sign_sgd(1e-2),
    "signum": lambda: optax.signum(1e-2), "adopt": lambda: optax.contrib.adopt(1e-2),
    "ademamix": lambda: optax.contrib.ademamix(1e-2),
    "optimistic_gradient_descent": lambda: optax.optimistic_gradient_descent(1e-2),
    "schedule_free_adamw": lambda: optax.contrib.schedule_free_adamw(1e-2),
    "cocob": lambda: optax.contrib.cocob(),
    "decayed_weights_chain": lambda: optax.chain(optax.add_decayed_weights(1e-2),
                                                 optax.scale_by_rms(), optax.scale(-1e-2)),
}

# Not elementwise (coupled elements, per-axis state, the tree's structure, the loss's value):
# each is refused with the reason.
OPTAX_COUPLED = {
    "sm3": (lambda: optax.sm3(1e-2), "per-axis statistics"),
    "adafactor": (lambda: optax.adafactor(1e-2), "reduce_sum"),
    "novograd": (lambda: optax.novograd(1e-2), "reduce_sum"),
    "lamb": (lambda: optax.lamb(1e-2), "reduce_sum"),
    "lars": (lambda: optax.lars(1e-2), "MaskedState"),
    "fromage": (lambda: optax.fromage(1e-2), "reduce_sum"),
    "clip_by_global_norm_chain": (lambda: optax.chain(optax.clip_by_global_norm(1.0),
                                                      optax.adam(1e-2)), "reduce_sum"),
    "clip_by_block_rms": (lambda: optax.chain(optax.clip_by_block_rms(1.0), optax.sgd(1e-2)),
                          "not elementwise"),
    "noisy_sgd": (lambda: optax.noisy_sgd(1e-2, key=0), "position"),
    "lbfgs": (lambda: optax.lbfgs(), "neither per-parameter nor shared"),
    "polyak_sgd": (lambda: optax.polyak_sgd(), "does not run as update"),
    "prodigy": (lambda: optax.contrib.prodigy(), "dot_general"),
    "dowg": (lambda: optax.contrib.dowg(), "not elementwise"),
    "muon": (lambda: optax.contrib.muon(1e-2), "PartitionState"),
}


@pytest.mark.parametrize("name", sorted(OPTAX_ELEMENTWISE))
def test_every_accepted_optax_transformation_matches_optax(rng, name):
    """Bucket 50 cuts the 12 x 8 and 2 x 8 x 8 leaves across buckets; 3 steps, 1e-6."""
    opt = offload_stream(OPTAX_ELEMENTWISE[name](), bucket_params=50, slots=2)
    check_against_optax(rng, opt, OPTAX_ELEMENTWISE[name](), make_params(rng), steps=3)


@pytest.mark.parametrize("name", sorted(OPTAX_COUPLED))
def test_every_optax_transformation_that_couples_elements_is_refused(name):
    make, reason = OPTAX_COUPLED[name]
    with pytest.raises(ValueError, match=f"^transformation: .*{reason}"):
        offload_stream(make())


# -- what is not elementwise is refused -----------------------------------------------------------


@pytest.mark.parametrize("transformation, reason", [
    (optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)), "reduce_sum"),
    (optax.lamb(1e-3), "not elementwise"),              # trust ratio: per-leaf norms
    (optax.adamw(1e-3, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p)), "MaskedState"),
    (optax.multi_transform({"a": optax.sgd(1e-3), "b": optax.adam(1e-3)},
                           lambda p: jax.tree.map(lambda _: "a", p)), "holds a"),
    (optax.add_noise(0.1, 0.5, 0), "position"),         # noise drawn per position
    (optax.adafactor(1e-3), "not elementwise"),         # factored second moments
    (optax.sm3(1e-2), "per-axis statistics"),            # elementwise on a vector only
    ("adam", "expected an optax GradientTransformation"),
])
def test_transformations_that_are_not_elementwise_are_refused(transformation, reason):
    with pytest.raises(ValueError, match=f"transformation: .*{reason}"):
        offload_stream(transformation)


@pytest.mark.parametrize("kwargs", [dict(bucket_params=0), dict(slots=0), dict(slots=2.0),
                                    dict(max_grad_norm=-1.0), dict(max_grad_norm=float("inf"))])
def test_bad_arguments_name_themselves(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        offload_stream(optax.sgd(1e-3), **kwargs)


def test_a_state_of_another_transformation_is_refused(rng):
    params = make_params(rng)
    lion_state = offload_stream(optax.lion(1e-3)).init(params)
    with pytest.raises(ValueError, match="state: made for a transformation"):
        offload_stream(optax.adam(1e-3)).step(random_grads(rng, params), lion_state)


# -- layer groups: the step one group at a time ---------------------------------------------------

STACKED = {"embed": False, "layers": True, "scale": False}


def test_layer_groups_follow_the_layers(rng):
    params = make_params(rng)
    opt = offload_stream(optax.sgd(1e-2, momentum=0.9), bucket_params=20)
    layout = opt.init(params, stacked_layers=STACKED).layout
    assert [g.layer for g in layout.groups] == [None, 0, 1]
    assert [layout.layer_group(layer) for layer in range(2)] == [1, 2]
    # Unstacked: embed (96) + scale (1) = 97 -> 5 buckets; a layer: w (64) + b (8) = 72 -> 4.
    assert [len(g.bucket_sizes) for g in layout.groups] == [5, 4, 4]
    grads = random_grads(rng, params)
    layer_1 = layout.group_leaves(grads, 2)
    np.testing.assert_array_equal(layer_1[0], grads["layers"]["b"][1])
    np.testing.assert_array_equal(layer_1[1], grads["layers"]["w"][1])


@pytest.mark.parametrize("name, max_grad_norm", [("adamw", None), ("lion", 1.0)])
def test_grouped_step_matches_the_ungrouped_step(rng, name, max_grad_norm):
    """The same elementwise arithmetic on other buckets: equal up to XLA:CPU's code for an
    element at another offset of a bucket (its vectorized loop and remainder may round
    differently; seen: 1 element of 144 off by 1 ulp)."""
    params = make_params(rng)
    results = []
    for stacked in (None, STACKED):
        opt = offload_stream(TRANSFORMATIONS[name](), bucket_params=30,
                             max_grad_norm=max_grad_norm)
        state, new_params = opt.init(params, stacked_layers=stacked), params
        step_rng = np.random.default_rng(0)
        for _ in range(3):
            new_params, state = opt.step(random_grads(step_rng, params), state)
        results.append(opt.master_params(state))
    assert_tree_close(results[1], results[0], rtol=1e-6)


def grouped_step(opt, grads, state, write_back=True):
    """What a trainer does inside its own program: every group's update, then the new state;
    without ``write_back`` the groups stay on the device until all are updated, then go back
    after their new leaves (as the trainer writes them back after the forward's loss)."""
    layout = state.layout
    scalars = opt.step_scalars(grads, state)
    leaves, groups = [], []
    for g in range(len(layout.groups)):
        group_leaves, group = opt.update_group(layout.group_leaves(grads, g), state.group(g),
                                               scalars, write_back=write_back)
        leaves.append(group_leaves)
        groups.append(group)
    if not write_back:
        groups = [opt.write_back(group, after=leaves) for group in groups]
    return layout.merge_groups(leaves), opt.new_state(state, groups, scalars)


def streamed_case(rng, mesh_axes, steps: int):
    """AdamW streamed in buckets of 30 (clipped) over ``steps`` random gradients of the test
    params (whole, or sharded over ``mesh_axes``), by the whole step: (params, the optimizer, the
    gradients, the last step's new params, the state)."""
    params = make_params(rng) if mesh_axes is None else sharded_params(rng, make_mesh(*mesh_axes))
    opt = offload_stream(TRANSFORMATIONS["adamw"](), bucket_params=30, max_grad_norm=1.0)
    grads = [random_grads(rng, params) for _ in range(steps)]
    state = opt.init(params, stacked_layers=STACKED)
    for g in grads:
        new_params, state = opt.step(g, state)
    return params, opt, grads, new_params, state


def grouped_steps(opt, params, grads, write_back, **init_kwargs):
    """A fresh state stepped through ``grads`` by ``grouped_step`` in one jitted program (as
    inside a trainer's step): (the last step's new params, the state)."""
    state = opt.init(params, stacked_layers=STACKED, **init_kwargs)
    in_one = jax.jit(lambda g, s: grouped_step(opt, g, s, write_back),
                     out_shardings=(None, opt.state_shardings(state)))
    for g in grads:
        leaves, state = in_one(g, state)
    return jax.tree.unflatten(state.layout.treedef, leaves), state


@pytest.mark.parametrize("mesh_axes", [None, (("data", 2), ("model", 4))])
def test_updating_group_by_group_equals_the_whole_step_bit_for_bit(rng, mesh_axes):
    params, opt, grads, whole_params, whole = streamed_case(rng, mesh_axes, steps=2)

    # One program for every group, as inside a trainer's step; written back as each bucket is
    # updated (the slot chain) or only once every group is (write_back=False).
    for write_back in (True, False):
        new_params, state = grouped_steps(opt, params, grads, write_back)
        assert all(a.sharding.memory_kind == "pinned_host" for a in state.master)
        assert_tree_close(new_params, whole_params, rtol=0)
        assert_tree_close(opt.master_params(state), opt.master_params(whole), rtol=0)
        assert_tree_close(state.streamed, whole.streamed, rtol=0)
        assert_tree_close(state.shared, whole.shared, rtol=0)
    with pytest.raises(ValueError, match="slot_chain: expected None"):
        opt.update_group(state.layout.group_leaves(grads[0], 0), state.group(0),
                         opt.step_scalars(grads[0], state), slot_chain=[], write_back=False)

    # A program per group, as a layer's update placed in its own program.
    state = opt.init(params, stacked_layers=STACKED)
    for g in grads:
        layout = state.layout
        scalars = jax.jit(opt.step_scalars)(g, state)
        groups = []
        for index in range(len(layout.groups)):
            update = jax.jit(opt.update_group,
                             out_shardings=(None, opt.state_shardings(state).group(index)))
            _, group = update(layout.group_leaves(g, index), state.group(index), scalars)
            groups.append(group)
        state = jax.jit(opt.new_state, out_shardings=opt.state_shardings(state))(
            state, groups, scalars)
    assert all(a.sharding.memory_kind == "pinned_host" for a in state.master)
    assert_tree_close(opt.master_params(state), opt.master_params(whole), rtol=0)
    assert_tree_close(state.shared, whole.shared, rtol=0)


def test_bad_layer_groups_are_refused(rng):
    params = make_params(rng)
    opt = offload_stream(optax.sgd(1e-3))
    with pytest.raises(ValueError, match="stacked_layers: .* same leading"):
        opt.init(params, stacked_layers={"embed": True, "layers": True, "scale": False})
    with pytest.raises(ValueError, match="stacked_layers: expected at least one"):
        opt.init(params, stacked_layers=False)
    mesh = make_mesh(("data", 2), ("model", 4))
    sharded = {**params, "layers": jax.tree.map(
        lambda p: jax.device_put(p, NamedSharding(mesh, P("data"))), params["layers"])}
    sharded = jax.tree.map(lambda p: p if isinstance(p.sharding, NamedSharding)
                           else jax.device_put(p, NamedSharding(mesh, P())), sharded)
    with pytest.raises(ValueError, match="stacked_layers: the layer axis .* is sharded"):
        opt.init(sharded, stacked_layers=STACKED)
    state = opt.init(params, stacked_layers=STACKED)
    with pytest.raises(ValueError, match="grads: expected group 1's leaf shapes"):
        opt.update_group([jnp.zeros((2,))], state.group(1), opt.step_scalars(params, state))


def test_the_slot_chain_runs_across_layer_groups(rng):
    params = make_params(rng)
    opt = offload_stream(optax.lion(1e-3), bucket_params=30, slots=2)
    state = opt.init(params, stacked_layers=STACKED)
    jaxpr = jax.make_jaxpr(opt.step)(random_grads(rng, params), state).jaxpr
    copy_ins, write_backs, waits = copy_dependencies(jaxpr)
    # 97 unstacked -> 4 buckets; a layer, 72 -> 3 buckets each.
    assert len(copy_ins) == len(write_backs) == len(state.master) == 10
    for b in range(len(copy_ins)):
        waited = {i for i, w in enumerate(write_backs) if id(w) in waits[b]}
        assert waited == set(range(b - 2, -1, -2)), (b, waited)


# -- resident groups: the first groups' state kept in device memory --------------------------------


def link_bytes(jaxpr):
    """Bytes the step's jaxpr copies between host and device memory (every device_put from one
    memory space to the other, in any of its jaxprs: each operand's global bytes)."""
    total = 0
    for inner in iter_jaxprs(jaxpr):
        for eqn in inner.eqns:
            if eqn.primitive.name != "device_put":
                continue
            for source, target in zip(eqn.invars, eqn.outvars):
                if {source.aval.memory_space, target.aval.memory_space} == {
                        MemorySpace.Host, MemorySpace.Device}:
                    total += source.aval.size * source.aval.dtype.itemsize
    return total


@pytest.mark.parametrize("mesh_axes", [None, (("data", 2), ("model", 4))])
@pytest.mark.parametrize("resident", [1, 2, 3])
def test_resident_groups_change_no_bit_and_move_only_the_streamed_bytes(rng, mesh_axes,
                                                                        resident):
    """Keeping the first groups' state on the device: the same masters, moments and working
    params bit for bit as streaming all of it, over three steps, by the whole step and group by
    group (written back as updated and after every group); the resident buckets in device
    memory after each; and the step's program copies 2 (4 + S) (P - P_r) bytes, the streamed
    buckets' master and state each way, against the formula's count of the layout's buckets."""
    from peakflat_jax.optim.offload_stream import offload_stream_link_bytes

    params, opt, grads, streamed_params, streamed = streamed_case(rng, mesh_axes, steps=3)

    state = opt.init(params, stacked_layers=STACKED, resident_groups=resident)
    layout = state.layout
    # Per device, the groups' buckets and parameters (bucket_params 30): unstacked embed (96)
    # and scale (1), then each layer's w (64) and b (8); on the 2 x 4 mesh, the shards: embed
    # split over data (48), w over model (16), b and scale whole.
    buckets, sizes = ([4, 3, 3], [97, 72, 72]) if mesh_axes is None else ([2, 1, 1],
                                                                            [49, 24, 24])
    kinds = ["device"] * sum(buckets[:resident]) + ["pinned_host"] * sum(buckets[resident:])
    assert list(layout.memory_kinds()) == kinds
    assert [a.sharding.memory_kind for a in state.master] == kinds
    assert layout.resident_params() == sum(sizes[:resident])
    devices = layout.placement.num_devices
    streamed_bytes = offload_stream_link_bytes(sum(sizes), opt.state_bytes_per_param,
                                               sum(sizes[:resident]))
    assert link_bytes(jax.make_jaxpr(opt.step)(grads[0], state).jaxpr) == (
        devices * streamed_bytes)
    for write_back in (True, False):  # group by group, also with every write-back deferred
        jaxpr = jax.make_jaxpr(lambda g, s, w=write_back: grouped_step(opt, g, s, w))(
            grads[0], state).jaxpr
        assert link_bytes(jaxpr) == devices * streamed_bytes, write_back
    for g in grads:
        new_params, state = opt.step(g, state)
    assert [a.sharding.memory_kind for a in state.master] == kinds
    assert_tree_close(new_params, streamed_params, rtol=0)
    assert_tree_close(opt.master_params(state), opt.master_params(streamed), rtol=0)
    assert_tree_close(state.streamed, streamed.streamed, rtol=0)

    for write_back in (True, False):
        new_params, state = grouped_steps(opt, params, grads, write_back,
                                          resident_groups=resident)
        assert [a.sharding.memory_kind for a in state.master] == kinds
        assert_tree_close(new_params, streamed_params, rtol=0)
        assert_tree_close(opt.master_params(state), opt.master_params(streamed), rtol=0)


def test_the_resident_groups_stay_out_of_the_slot_chain(rng):
    """The streamed buckets wait for the write-back ``slots`` streamed buckets before (the
    resident ones have none to wait for or to be waited on)."""
    params = make_params(rng)
    opt = offload_stream(optax.lion(1e-3), bucket_params=30, slots=2)
    state = opt.init(params, stacked_layers=STACKED, resident_groups=1)
    copy_ins, write_backs, waits = copy_dependencies(
        jax.make_jaxpr(opt.step)(random_grads(rng, params), state).jaxpr)
    # 97 unstacked -> 4 resident buckets; the two layers, 72 each -> 3 streamed buckets each.
    assert len(copy_ins) == len(write_backs) == 6
    for b in range(len(copy_ins)):
        waited = {i for i, w in enumerate(write_backs) if id(w) in waits[b]}
        assert waited == set(range(b - 2, -1, -2)), (b, waited)


def test_a_state_restores_into_another_residency(rng, tmp_path):
    """A checkpoint of a streamed state restores into a target with resident groups (and back)
    with every value equal, the resident buckets landing in device memory: the layout's
    metadata leaves residency out."""
    import orbax.checkpoint as ocp

    params = make_params(rng)
    opt = offload_stream(TRANSFORMATIONS["adamw"](), bucket_params=30)
    state = opt.init(params, stacked_layers=STACKED)
    for _ in range(2):
        _, state = opt.step(random_grads(rng, params), state)
    saved = state
    for name, resident in (("streamed_to_resident", 2), ("resident_to_streamed", 0)):
        with ocp.StandardCheckpointer() as checkpointer:
            checkpointer.save(tmp_path / name, saved)
        target = opt.abstract_state(params, stacked_layers=STACKED, resident_groups=resident)
        opt.check_metadata(target, opt.state_metadata(saved))
        with ocp.StandardCheckpointer() as checkpointer:
            restored = checkpointer.restore(tmp_path / name, target)
        assert [a.sharding.memory_kind for a in restored.master] == list(
            target.layout.memory_kinds())
        assert_tree_close(opt.master_params(restored), opt.master_params(state), rtol=0)
        assert_tree_close(restored.streamed, state.streamed, rtol=0)
        saved = restored


@pytest.mark.parametrize("resident", [-1, 4, 1.0, True])
def test_a_residency_past_the_groups_is_refused(rng, resident):
    with pytest.raises(ValueError, match=r"resident_groups: expected an int from 0 to the "
                                         r"layout's 3 groups"):
        offload_stream(optax.sgd(1e-3)).init(make_params(rng), stacked_layers=STACKED,
                                             resident_groups=resident)


# -- stacked layers: a block's buckets as rows of arrays, a loop over its layers ------------------


def scanned_step(opt, grads, state, write_back=True):
    """What the trainer's scanned stack does inside its program: the unstacked groups one by
    one, then each stacked block's layers by a ``lax.scan`` over its rows (the row traced), the
    block threaded through the loop; without ``write_back`` the streamed rows are gathered on
    the device and go back together after every group's new leaves."""
    layout = state.layout
    scalars = opt.step_scalars(grads, state)
    grad_leaves = jax.tree.leaves(grads)
    units, leaves = {}, {}
    for index in range(len(layout.groups)):
        if layout.block_of(index) is None:
            leaves[index], units[index] = opt.update_group(
                layout.group_leaves(grads, index), state.group(index), scalars,
                write_back=write_back)
    for block in layout.blocks:
        group = layout.groups[block.first_group]
        gathered = None if write_back or block.resident else state.block(block).device_zeros()

        def body(carry, row, group=group):
            block_state, gathered = carry
            grads = [jax.lax.dynamic_index_in_dim(grad_leaves[i], group.layer + row, 0,
                                                  keepdims=False) for i in group.leaves]
            new_leaves, new = opt.update_group(grads, block_state.group(row), scalars,
                                               slot_chain=[] if write_back else None,
                                               write_back=write_back)
            if new.row is None:
                gathered = gathered.with_row(row, new)
            else:
                block_state = new.stacks()
            return (block_state, gathered), new_leaves

        (block_state, gathered), stacked = jax.lax.scan(
            body, (state.block(block), gathered), jnp.arange(block.num_layers))
        units[block] = block_state if gathered is None else gathered
        for row in range(block.num_layers):
            leaves[block.first_group + row] = [leaf[row] for leaf in stacked]
    if not write_back:
        units = {key: opt.write_back(unit, after=leaves) for key, unit in units.items()}
    return (layout.merge_groups([leaves[i] for i in range(len(layout.groups))]),
            opt.new_state(state, [units[u] for u in layout.units()], scalars))


@pytest.mark.parametrize("mesh_axes", [None, (("data", 2), ("model", 4))])
def test_stacked_layers_change_no_bit(rng, mesh_axes):
    """The layer groups' buckets stacked, a block per residency (``stack_layers``): the whole
    step, and a loop over each block's rows (written back as updated or after every group),
    give the unstacked state's working params, masters, moments and shared state bit for bit,
    streamed or with the outer group and the first layer resident; each block's arrays in its
    memory kind, a row per layer. A checkpoint's metadata of one layout refuses the other."""
    params, opt, grads, whole_params, whole = streamed_case(rng, mesh_axes, steps=2)
    for resident in (0, 2):
        state = opt.init(params, stacked_layers=STACKED, resident_groups=resident,
                         stack_layers=True)
        layout = state.layout
        blocks = [(b.first_group, b.stop_group, b.resident) for b in layout.blocks]
        assert blocks == ([(1, 3, False)] if resident == 0 else [(1, 2, True), (2, 3, False)])
        kinds = [a.sharding.memory_kind for a in state.master]
        assert kinds == list(layout.memory_kinds())
        assert all(a.shape[0] == b.num_layers for b in layout.blocks
                   for a in state.master[b.first_array:][:len(layout.groups[1].bucket_sizes)])
        for g in grads:
            new_params, state = opt.step(g, state)
        assert [a.sharding.memory_kind for a in state.master] == kinds
        assert_tree_close(new_params, whole_params, rtol=0)
        assert_tree_close(optimizer_state_values(state), optimizer_state_values(whole), rtol=0)
        for write_back in (True, False):
            state = opt.init(params, stacked_layers=STACKED, resident_groups=resident,
                             stack_layers=True)
            in_one = jax.jit(lambda g, s, w=write_back: scanned_step(opt, g, s, w),
                             out_shardings=(None, opt.state_shardings(state)))
            for g in grads:
                leaves, state = in_one(g, state)
            assert [a.sharding.memory_kind for a in state.master] == kinds
            assert_tree_close(jax.tree.unflatten(layout.treedef, leaves), whole_params, rtol=0)
            assert_tree_close(optimizer_state_values(state), optimizer_state_values(whole),
                              rtol=0)
    with pytest.raises(ValueError, match="stacked_blocks"):
        opt.check_metadata(state, opt.state_metadata(whole))
    with pytest.raises(ValueError, match="stack_layers: expected layer groups"):
        opt.init(params, stack_layers=True)
