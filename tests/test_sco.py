"""SCO: values and gradients equal the checkpointed scan; transfers placed as chosen; budgets."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh
from jax.sharding import PartitionSpec as P

import peakflat_jax as pf
from peakflat_jax import memory, skew
from peakflat_jax.ops import sco

LAYERS, TOKENS, HIDDEN = 5, 8, 6


def layer_fn(h, p):
    return h + jnp.tanh(h @ p["w"] + p["b"]) * p["scale"]


def draw(rng):
    params = {"w": rng.standard_normal((LAYERS, HIDDEN, HIDDEN)) / 3,
              "b": rng.standard_normal((LAYERS, HIDDEN)),
              "scale": rng.standard_normal((LAYERS,))}
    params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params)
    h = jnp.asarray(rng.standard_normal((TOKENS, HIDDEN)), jnp.float32)
    return h, params, jnp.asarray(rng.standard_normal((TOKENS, HIDDEN)), jnp.float32)


def checkpointed_scan(layer_fn, h, params):
    return jax.lax.scan(lambda h, p: (jax.checkpoint(layer_fn)(h, p), None), h, params)[0]


def value_and_grads(fn, h, params, cotangent):
    return jax.jit(jax.value_and_grad(lambda h, p: jnp.vdot(fn(h, p), cotangent),
                                      argnums=(0, 1)))(h, params)


BOUNDARY_BYTES = TOKENS * HIDDEN * 4
OFFLOADS = [0, 2, LAYERS, [True, False, True, False, True], [False] * 4 + [True],
            pf.HostBudget(3 * BOUNDARY_BYTES + 1)]


@pytest.mark.parametrize("offload", OFFLOADS, ids=str)
def test_equals_checkpointed_scan(rng, offload):
    h, params, cotangent = draw(rng)
    value, grads = value_and_grads(lambda h, p: pf.sco_scan(layer_fn, h, p, offload=offload),
                                   h, params, cotangent)
    ref_value, ref_grads = value_and_grads(lambda h, p: checkpointed_scan(layer_fn, h, p),
                                           h, params, cotangent)
    # The same operations in the same order: equal, not merely close.
    np.testing.assert_array_equal(value, ref_value)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_array_equal(a, b)


def transfers(jaxpr) -> list[str]:
    """The memory space of every device_put in a jaxpr, nested jaxprs included, in order."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "device_put":
            found += [str(d) for d in eqn.params["devices"]]
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else [value]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    found += transfers(inner)
    return found


@pytest.mark.parametrize("offload, expected", [
    (0, 0), (3, 3), ([True, False, True, False, True], 3), (pf.HostBudget(2 * BOUNDARY_BYTES), 2),
])
def test_gradient_moves_exactly_the_chosen_boundaries(rng, offload, expected):
    h, params, _ = draw(rng)
    jaxpr = jax.make_jaxpr(jax.grad(
        lambda h, p: pf.sco_scan(layer_fn, h, p, offload=offload).sum(), argnums=(0, 1)))(
        h, params)
    moves = transfers(jaxpr.jaxpr)
    assert moves.count("MemorySpace.Host") == expected
    assert moves.count("MemorySpace.Device") == expected
    # Forward sends them all before backward brings any back.
    assert moves == ["MemorySpace.Host"] * expected + ["MemorySpace.Device"] * expected


def jaxprs(jaxpr):
    """A jaxpr and every jaxpr nested in it."""
    yield jaxpr
    for eqn in jaxpr.eqns:
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else [value]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from jaxprs(inner)


def barriers(jaxpr) -> list[tuple[list[str], list[bool]]]:
    """Every optimization_barrier (nested jaxprs included): its operands' kinds ("host" for a
    value made by a device_put to host, else "value") and, per output, whether anything in its
    jaxpr reads it; and per device_put to the device (a restore), whether its operand came out
    of a barrier of its own rather than straight from the forward's copy tie."""
    found, restores = [], []
    for inner in jaxprs(jaxpr):
        host, read = set(), set(inner.outvars)
        made_by_barrier = {}  # output -> whether that barrier took a fresh host copy
        for eqn in inner.eqns:
            read.update(v for v in eqn.invars if not hasattr(v, "val"))
        for eqn in inner.eqns:
            if eqn.primitive.name == "device_put":
                if "Host" in str(eqn.params["devices"]):
                    host.update(eqn.outvars)
                else:  # a restore: behind a barrier of its own, not the forward's tie
                    restores.append(made_by_barrier.get(eqn.invars[0]) is False)
            if eqn.primitive.name == "optimization_barrier":
                takes_copy = eqn.invars[0] in host
                made_by_barrier.update({v: takes_copy for v in eqn.outvars})
                found.append((["host" if v in host else "value" for v in eqn.invars],
                              [v in read for v in eqn.outvars]))
    return found, restores


def test_transfers_and_layers_are_tied_in_order(rng):
    """The ties that keep XLA's GPU scheduler in line (each found missing on an H200): each
    host copy must finish with its layer's forward, each restore is issued behind a barrier, and
    each layer's recompute must wait for the whole backward of the layer above, its parameter
    gradients included. A tie counts only if what comes out of the barrier is what is used."""
    h, params, _ = draw(rng)
    jaxpr = jax.make_jaxpr(jax.grad(
        lambda h, p: pf.sco_scan(layer_fn, h, p, offload=LAYERS).sum(), argnums=(0, 1)))(
        h, params)
    found, restores = barriers(jaxpr.jaxpr)
    forward_ties = [used for kinds, used in found if kinds == ["host", "value"]]
    assert len(forward_ties) == LAYERS and all(all(used) for used in forward_ties)
    num_param_leaves = len(jax.tree.leaves(params))
    assert num_param_leaves > 1  # ties are told apart by their operand counts
    # Forward: each layer slices its parameters behind its input.
    slice_ties = [used for kinds, used in found if len(kinds) == 1 + num_param_leaves]
    assert len(slice_ties) == LAYERS and all(all(used) for used in slice_ties)
    # Backward: restored input, cotangent, the gradients so far and the parameters.
    whole_layer_ties = [used for kinds, used in found if len(kinds) == 2 + 2 * num_param_leaves]
    assert len(whole_layer_ties) == LAYERS and all(all(u) for u in whole_layer_ties)
    assert len(restores) == LAYERS and all(restores)


def test_no_copies_without_differentiation(rng):
    h, params, _ = draw(rng)
    jaxpr = jax.make_jaxpr(lambda h, p: pf.sco_scan(layer_fn, h, p, offload=LAYERS))(h, params)
    assert transfers(jaxpr.jaxpr) == []


@pytest.mark.parametrize("budget, count", [(0, 0), (BOUNDARY_BYTES - 1, 0), (BOUNDARY_BYTES, 1),
                                           (4 * BOUNDARY_BYTES + 7, 4), (10**9, LAYERS)])
def test_host_budget_picks_as_many_as_fit(budget, count):
    chosen = sco.offload_plan(pf.HostBudget(budget), LAYERS, BOUNDARY_BYTES)
    assert chosen == tuple(i < count for i in range(LAYERS))


def test_impossible_budget_raises_before_compiling():
    # Two boundaries of 2^40 bytes each: no host has that much memory.
    h = jax.ShapeDtypeStruct((2**20, 2**18), jnp.float32)
    params = {"w": jax.ShapeDtypeStruct((3, 1), jnp.float32)}
    with pytest.raises(ValueError, match="host memory"):
        jax.jit(lambda h, p: pf.sco_scan(lambda h, p: h * p["w"][0], h, p, offload=2)).trace(
            h, params)


@pytest.mark.parametrize("offload, match", [
    (True, "offload"), (LAYERS + 1, "offload"), (-1, "offload"), ([True] * 4, "offload"),
    ([1, 0, 1, 0, 1], "offload"), (2.0, "offload"),
])
def test_bad_offload_names_the_argument(rng, offload, match):
    h, params, _ = draw(rng)
    with pytest.raises(ValueError, match=match):
        pf.sco_scan(layer_fn, h, params, offload=offload)


def test_numpy_offloads_and_zero_layers(rng):
    h, params, cotangent = draw(rng)
    chosen = np.array([True, False, True, False, True])
    for offload in (chosen, list(chosen), np.int64(2)):
        value, _ = value_and_grads(lambda h, p: pf.sco_scan(layer_fn, h, p, offload=offload),
                                   h, params, cotangent)
        ref_value, _ = value_and_grads(lambda h, p: checkpointed_scan(layer_fn, h, p), h,
                                       params, cotangent)
        np.testing.assert_array_equal(value, ref_value)
    empty = jax.tree.map(lambda a: a[:0], params)
    grads = jax.grad(lambda h: pf.sco_scan(layer_fn, h, empty, offload=0).sum())(h)
    np.testing.assert_array_equal(grads, jnp.ones_like(h))


def test_layer_that_changes_h_is_refused(rng):
    h, params, _ = draw(rng)
    with pytest.raises(ValueError, match="layer_fn"):
        pf.sco_scan(lambda h, p: layer_fn(h, p).astype(jnp.bfloat16), h, params, offload=1)


def test_bad_budget_and_params():
    with pytest.raises(ValueError, match="HostBudget"):
        pf.HostBudget(-1)
    with pytest.raises(ValueError, match="stacked_params"):
        pf.sco_scan(layer_fn, jnp.ones((2, 2)), {"w": jnp.ones((3, 2)), "b": jnp.ones((4,))},
                    offload=0)


def test_a_layer_with_pipelined_moe_keeps_its_chunk_bound(rng):
    """SCO inside shard_map around layers that each hold a PipelinedLLEP layer: values match the
    checkpointed scan, and no array the size of a rank's whole dispatch appears."""
    devices, experts, tokens, top_k, hidden, ffn, layers = 4, 8, 256, 4, 32, 16, 3
    mesh = make_mesh(("expert", devices))
    ids = jnp.asarray(np.concatenate([skew.route(tokens, top_k, experts,
                                                 skew.SkewProfile(0.8, 2))] * devices))
    gates = jnp.asarray(rng.random((devices * tokens, top_k)), jnp.float32)

    def moe_layer(h, p):
        y = pf.pipelined_moe(h, p["ids"], p["gates"], p["wg"], p["wu"], p["wd"],
                             axis_name="expert", num_experts=experts, token_budget=8,
                             max_chunks=64, llep_min_tokens=8)
        return h + y

    def per_shard(h, ids, gates, wg, wu, wd, use_sco):
        params = {"ids": jnp.broadcast_to(ids, (layers, *ids.shape)),
                  "gates": jnp.broadcast_to(gates, (layers, *gates.shape)),
                  "wg": wg, "wu": wu, "wd": wd}
        if use_sco:
            return pf.sco_scan(moe_layer, h, params, offload=2)
        return checkpointed_scan(moe_layer, h, params)

    weights = [jnp.asarray(rng.standard_normal((layers, experts) + s) / 8, jnp.float32)
               for s in ((hidden, ffn), (hidden, ffn), (ffn, hidden))]
    h = jnp.asarray(rng.standard_normal((devices * tokens, hidden)), jnp.float32)
    specs = (P("expert"), P("expert"), P("expert"), P(None, "expert"), P(None, "expert"),
             P(None, "expert"))

    def loss(use_sco):
        fn = jax.shard_map(lambda *a: per_shard(*a, use_sco), mesh=mesh, in_specs=specs,
                           out_specs=P("expert"))
        return lambda h, *w: fn(h, ids, gates, *w).sum()

    grad = jax.jit(jax.value_and_grad(loss(True), argnums=(0, 1, 2, 3)))
    value, grads = grad(h, *weights)
    ref_value, ref_grads = jax.jit(jax.value_and_grad(loss(False), argnums=(0, 1, 2, 3)))(
        h, *weights)
    assert abs(float(value - ref_value)) <= 1e-5 * abs(float(ref_value))
    for a, b in zip(grads, ref_grads):
        assert np.linalg.norm(a - b) <= 1e-4 * np.linalg.norm(b)
    compiled = grad.lower(h, *weights).compile()
    memory.assert_no_array_at_least(compiled, tokens * top_k * hidden, what="dispatch buffer")


def mlp_layer(h, p):
    return h + jnp.tanh(h @ p["up"]) @ p["down"]


def gradient_temp_bytes(num_layers, tokens, hidden):
    h = jax.ShapeDtypeStruct((tokens, hidden), jnp.float32)
    params = {"up": jax.ShapeDtypeStruct((num_layers, hidden, 4 * hidden), jnp.float32),
              "down": jax.ShapeDtypeStruct((num_layers, 4 * hidden, hidden), jnp.float32)}
    grad = jax.grad(lambda h, p: pf.sco_scan(mlp_layer, h, p, offload=0).sum(), argnums=(0, 1))
    return jax.jit(grad).lower(h, params).compile().memory_analysis().temp_size_in_bytes


def test_gradient_temporaries_grow_by_one_boundary_per_layer():
    """Bound: (L - n_offloaded + 2) boundaries + one layer's activations, so with nothing
    offloaded (and on CPU nothing is) each added layer may add one boundary, never a layer's
    parameters or their gradients (which XLA kept alive for all layers until the slices and the
    gradient writes were tied to the layer order). A layer's parameters here are 32x a
    boundary."""
    tokens, hidden = 32, 128
    boundary = tokens * hidden * 4
    growth = gradient_temp_bytes(8, tokens, hidden) - gradient_temp_bytes(4, tokens, hidden)
    assert growth <= 4 * boundary
