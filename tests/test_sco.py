"""SCO: values and gradients equal the checkpointed scan (single-array and pytree carries);
transfers placed as chosen and tied in order; budgets; the bound against XLA's CPU plan."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers import iter_eqns, iter_jaxprs, relative_error
from conftest import make_mesh
from jax.sharding import PartitionSpec as P

import peakflat_jax as pf
from peakflat_jax import memory, skew
from peakflat_jax.ops import sco

LAYERS, TOKENS, HIDDEN, EXPERTS = 5, 8, 6, 4


def layer_fn(h, p):
    return h + jnp.tanh(h @ p["w"] + p["b"]) * p["scale"]


def routed_layer(carry, p):
    """A layer with side outputs through the stack: a router's per-expert load (f32 [E]) and an
    auxiliary loss (f32 scalar) ride in the carry with h."""
    h, load, aux = carry
    probs = jax.nn.softmax(h @ p["router"], axis=-1)
    return layer_fn(h, p), load + probs.sum(0), aux + jnp.mean(probs**2) * p["scale"]


def draw(rng):
    params = {"w": rng.standard_normal((LAYERS, HIDDEN, HIDDEN)) / 3,
              "b": rng.standard_normal((LAYERS, HIDDEN)),
              "scale": rng.standard_normal((LAYERS,)),
              "router": rng.standard_normal((LAYERS, HIDDEN, EXPERTS))}
    params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params)
    h = jnp.asarray(rng.standard_normal((TOKENS, HIDDEN)), jnp.float32)
    return h, params, jnp.asarray(rng.standard_normal((TOKENS, HIDDEN)), jnp.float32)


def draw_routed(rng):
    h, params, d_h = draw(rng)
    carry = (h, jnp.asarray(rng.random(EXPERTS), jnp.float32), jnp.float32(rng.random()))
    cotangent = (d_h, jnp.asarray(rng.standard_normal(EXPERTS), jnp.float32),
                 jnp.float32(rng.standard_normal()))
    return carry, params, cotangent


LOOPS = ["scan", "unrolled"]


def sco_stack(offload, loop="scan"):
    """``pf.sco_scan`` with ``offload`` and ``loop`` fixed, called like ``checkpointed_scan``."""
    return lambda layer_fn, carry, params: pf.sco_scan(layer_fn, carry, params, offload=offload,
                                                       loop=loop)


def checkpointed_scan(layer_fn, carry, params):
    return jax.lax.scan(lambda c, p: (jax.checkpoint(layer_fn)(c, p), None), carry, params)[0]


def value_and_grads(fn, carry, params, cotangent):
    """The carry's value and the gradients w.r.t. every leaf of carry and params of
    <fn(carry, params), cotangent>."""
    def weighted(carry, params):
        return sum(jnp.vdot(a, b) for a, b in zip(jax.tree.leaves(fn(carry, params)),
                                                  jax.tree.leaves(cotangent)))

    value = jax.jit(fn)(carry, params)
    return value, jax.jit(jax.grad(weighted, argnums=(0, 1)))(carry, params)


def assert_equal_trees(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(x, y)


BOUNDARY_BYTES = TOKENS * HIDDEN * 4
OFFLOADS = [0, 2, LAYERS, [True, False, True, False, True], [False] * 4 + [True],
            pf.HostBudget(3 * BOUNDARY_BYTES + 1)]


@pytest.mark.parametrize("offload", OFFLOADS, ids=str)
@pytest.mark.parametrize("loop", LOOPS)
def test_equals_checkpointed_scan(rng, offload, loop):
    h, params, cotangent = draw(rng)
    result = value_and_grads(lambda h, p: pf.sco_scan(layer_fn, h, p, offload=offload,
                                                      loop=loop),
                             h, params, cotangent)
    expected = value_and_grads(lambda h, p: checkpointed_scan(layer_fn, h, p), h, params,
                               cotangent)
    # The same operations in the same order: equal, not merely close.
    assert_equal_trees(result, expected)


@pytest.mark.parametrize("offload", [0, 2, LAYERS, [False, True, False, True, True]], ids=str)
@pytest.mark.parametrize("loop", LOOPS)
def test_pytree_carry_equals_checkpointed_scan(rng, offload, loop):
    """A carry of (h, f32 [E] load counter, f32 scalar aux loss): values and the gradients
    w.r.t. every carry leaf and every parameter, bit for bit."""
    carry, params, cotangent = draw_routed(rng)
    result = value_and_grads(lambda c, p: pf.sco_scan(routed_layer, c, p, offload=offload,
                                                      loop=loop),
                             carry, params, cotangent)
    expected = value_and_grads(lambda c, p: checkpointed_scan(routed_layer, c, p), carry,
                               params, cotangent)
    assert_equal_trees(result, expected)
    assert all(np.any(np.asarray(g) != 0) for g in jax.tree.leaves(result[1]))


def transfers(jaxpr) -> list[str]:
    """The memory space of every device_put in a jaxpr, nested jaxprs included, in order."""
    return [str(d) for eqn in iter_eqns(jaxpr, "device_put") for d in eqn.params["devices"]]


def grad_jaxpr(layer, carry, params, offload, loop="unrolled"):
    def loss(carry, params):
        return sum(jnp.sum(leaf) for leaf in jax.tree.leaves(pf.sco_scan(
            layer, carry, params, offload=offload, loop=loop))
            if jnp.issubdtype(leaf.dtype, jnp.inexact))

    return jax.make_jaxpr(jax.grad(loss, argnums=(0, 1), allow_int=True))(carry, params).jaxpr


@pytest.mark.parametrize("offload, expected", [
    (0, 0), (3, 3), ([True, False, True, False, True], 3), (pf.HostBudget(2 * BOUNDARY_BYTES), 2),
])
def test_gradient_moves_exactly_the_chosen_boundaries(rng, offload, expected):
    h, params, _ = draw(rng)
    moves = transfers(grad_jaxpr(layer_fn, h, params, offload))
    # Forward sends them all before backward brings any back.
    assert moves == ["MemorySpace.Host"] * expected + ["MemorySpace.Device"] * expected


@pytest.mark.parametrize("offload, runs", [
    (0, 0), (3, 1), ([True, False, True, False, True], 3), (pf.HostBudget(2 * BOUNDARY_BYTES), 1),
    ("all", 1), ([4, 0], 2),
])
def test_scanned_gradient_moves_each_offloaded_run_once(rng, offload, runs):
    """The scanned loop traces one copy per run of offloaded layers: to host in the forward
    loop's body, and back in the backward (the run's first restore before its loop, the next
    ones in its body)."""
    h, params, _ = draw(rng)
    jaxpr = grad_jaxpr(layer_fn, h, params, offload, loop="scan")
    assert transfers(jaxpr) == ["MemorySpace.Host"] * runs + ["MemorySpace.Device"] * 2 * runs
    scans = list(iter_eqns(jaxpr, "scan"))
    forward_runs = len(sco._runs(sco.offload_plan(offload, LAYERS, BOUNDARY_BYTES)))
    assert len(scans) == 2 * forward_runs  # a forward and a backward loop per run
    assert sum(e.params["length"] for e in scans) == 2 * LAYERS


def test_pytree_carry_moves_its_inexact_leaves_only(rng):
    """The boundary is every inexact leaf of the carry; an integer leaf (segment ids) stays on
    the device. A HostBudget counts the inexact leaves' bytes."""
    (h, load, aux), params, _ = draw_routed(rng)
    carry = (h, load, aux, jnp.arange(TOKENS, dtype=jnp.int32) % 2)
    boundary = BOUNDARY_BYTES + 4 * EXPERTS + 4
    assert sco.carry_bytes(carry) == (boundary, 4 * TOKENS)

    def layer(c, p):
        return (*routed_layer(c[:3], p), c[3])

    for offload, count in [(2, 2), (pf.HostBudget(3 * boundary), 3),
                           (pf.HostBudget(3 * boundary - 1), 2)]:
        moves = transfers(grad_jaxpr(layer, carry, params, offload))
        assert moves == ["MemorySpace.Host"] * 3 * count + ["MemorySpace.Device"] * 3 * count


def barrier_roles(jaxpr) -> dict[str, list]:
    """Every optimization_barrier of a jaxpr (nested ones included), by the role it plays, each
    as (its operands' origins, whether each of its outputs is read):

    - "copy_tie": takes a fresh device-to-host copy (forward: boundary l with layer l's output);
    - "restore": its output is what a host-to-device copy (a restore) takes;
    - "layer_tie": takes a restored boundary (backward: layer l waits for layer l + 1);
    - "slice_tie": the rest (forward: layer l's parameters sliced behind its input).

    An operand's origin is "host" (made by a copy to host), "restored" (a copy to the device)
    or "value"."""
    roles = {"copy_tie": [], "restore": [], "layer_tie": [], "slice_tie": []}
    for inner in iter_jaxprs(jaxpr):
        origin, read, feeds_restore = {}, set(inner.outvars), set()
        for eqn in inner.eqns:
            read.update(v for v in eqn.invars if not hasattr(v, "val"))
            if eqn.primitive.name == "device_put":
                to_host = "Host" in str(eqn.params["devices"])
                origin.update({v: "host" if to_host else "restored" for v in eqn.outvars})
                if not to_host:
                    feeds_restore.update(eqn.invars)
        for eqn in inner.eqns:
            if eqn.primitive.name != "optimization_barrier":
                continue
            kinds = ["value" if hasattr(v, "val") else origin.get(v, "value")
                     for v in eqn.invars]
            entry = (kinds, [v in read for v in eqn.outvars])
            if "host" in kinds:
                roles["copy_tie"].append(entry)
            elif "restored" in kinds:
                roles["layer_tie"].append(entry)
            elif feeds_restore & set(eqn.outvars):
                roles["restore"].append(entry)
            else:
                roles["slice_tie"].append(entry)
    return roles


@pytest.mark.parametrize("routed", [False, True], ids=["array", "pytree"])
def test_transfers_and_layers_are_tied_in_order(rng, routed):
    """The ties that keep XLA's GPU scheduler in line (each found missing on an H200): each
    host copy must finish with its layer's forward, each restore is issued behind a barrier of
    its own, each layer's recompute waits for the whole backward of the layer above, and each
    layer slices its parameters behind its input. A tie counts only if what comes out of the
    barrier is what is used."""
    carry, params, _ = draw_routed(rng) if routed else draw(rng)
    roles = barrier_roles(grad_jaxpr(routed_layer if routed else layer_fn, carry, params,
                                     LAYERS))
    num_leaves = len(jax.tree.leaves(carry))
    for role in ("copy_tie", "restore", "layer_tie", "slice_tie"):
        assert len(roles[role]) == LAYERS, role
    for role in ("copy_tie", "layer_tie", "slice_tie"):  # a restore reads the copy only
        assert all(all(used) for _, used in roles[role]), role
    # Every leaf of the boundary is tied: its host copies to the layer's output, its restored
    # leaves to the backward of the layer above.
    assert all(kinds.count("host") == num_leaves for kinds, _ in roles["copy_tie"])
    assert all(kinds.count("restored") == num_leaves for kinds, _ in roles["layer_tie"])
    # The parameters are behind both the slice tie and the layer tie.
    num_params = len(jax.tree.leaves(params))
    assert all(len(kinds) >= num_leaves + num_params for kinds, _ in roles["slice_tie"])
    assert all(len(kinds) >= 2 * num_leaves + 2 * num_params for kinds, _ in roles["layer_tie"])


def test_no_copies_without_differentiation(rng):
    h, params, _ = draw(rng)
    jaxpr = jax.make_jaxpr(lambda h, p: pf.sco_scan(layer_fn, h, p, offload=LAYERS))(h, params)
    assert transfers(jaxpr.jaxpr) == []


def segment_layer(carry, p):
    """Attention-like mixing within segments: the segment ids are a per-token input without a
    gradient, passed as an integer leaf of the carry and returned unchanged."""
    h, segment_ids = carry
    same = segment_ids[:, None] == segment_ids[None, :]
    scores = jnp.where(same, h @ p["w"] @ h.T, -jnp.inf)
    return layer_fn(h + jax.nn.softmax(scores, -1) @ h, p), segment_ids


@pytest.mark.parametrize("loop", LOOPS)
def test_integer_leaf_carries_per_token_inputs(rng, loop):
    """The recommended channel for a per-layer input without gradients: values and gradients
    equal the checkpointed scan's, and the ids are neither copied to host nor differentiated."""
    h, params, d_h = draw(rng)
    segment_ids = jnp.asarray(rng.integers(0, 3, TOKENS), jnp.int32)

    def run(stack):
        fn = jax.jit(lambda h, p: stack(segment_layer, (h, segment_ids), p)[0])
        return fn(h, params), jax.jit(jax.grad(lambda h, p: jnp.vdot(fn(h, p), d_h),
                                               argnums=(0, 1)))(h, params)

    assert_equal_trees(run(sco_stack(LAYERS, loop)), run(checkpointed_scan))
    moves = transfers(grad_jaxpr(segment_layer, (h, segment_ids), params, LAYERS, loop))
    copies = LAYERS if loop == "unrolled" else 1  # the scanned loop traces one layer
    assert moves == ["MemorySpace.Host"] * copies + ["MemorySpace.Device"] * copies * (
        1 if loop == "unrolled" else 2)


@pytest.mark.parametrize("loop", LOOPS)
def test_closures_over_arrays(rng, loop):
    """layer_fn may close over an array without gradients (here a jitted function's argument);
    closing over one that is differentiated is refused, never a silently zero gradient."""
    h, params, d_h = draw(rng)
    bias = jnp.asarray(rng.standard_normal(HIDDEN), jnp.float32)

    def loss(stack, h, p, bias):
        return jnp.vdot(stack(lambda h, p: layer_fn(h, p) + bias, h, p), d_h)

    stack = sco_stack(LAYERS, loop)
    grads = jax.jit(jax.grad(lambda h, p, b: loss(stack, h, p, b), argnums=(0, 1)))(
        h, params, bias)
    expected = jax.jit(jax.grad(lambda h, p, b: loss(checkpointed_scan, h, p, b),
                                argnums=(0, 1)))(h, params, bias)
    assert_equal_trees(grads, expected)
    with pytest.raises(jax.errors.UnexpectedTracerError):
        jax.jit(jax.grad(lambda h, p, b: loss(stack, h, p, b), argnums=2))(h, params, bias)


@pytest.mark.parametrize("budget, count", [(0, 0), (BOUNDARY_BYTES - 1, 0), (BOUNDARY_BYTES, 1),
                                           (4 * BOUNDARY_BYTES + 7, 4), (10**9, LAYERS)])
def test_host_budget_picks_as_many_as_fit(budget, count):
    chosen = sco.offload_plan(pf.HostBudget(budget), LAYERS, BOUNDARY_BYTES)
    assert chosen == tuple(i < count for i in range(LAYERS))
    assert sco.sco_host_bytes(sum(chosen), BOUNDARY_BYTES) == count * BOUNDARY_BYTES <= budget


def test_impossible_budget_raises_before_compiling():
    # Two boundaries of 2^40 bytes each: no host has that much memory.
    h = jax.ShapeDtypeStruct((2**20, 2**18), jnp.float32)
    params = {"w": jax.ShapeDtypeStruct((3, 1), jnp.float32)}
    with pytest.raises(ValueError, match="host memory"):
        jax.jit(lambda h, p: pf.sco_scan(lambda h, p: h * p["w"][0], h, p, offload=2)).trace(
            h, params)


@pytest.mark.parametrize("offload, match", [
    (True, "offload"), (LAYERS + 1, "offload"), (-1, "offload"), ([True] * 4, "offload"),
    ([1, 0, 1, 0, 1], "offload"), (2.0, "offload"), ([0, LAYERS], "offload"), ("some", "offload"),
    ([0, True], "offload"),
])
def test_bad_offload_names_the_argument(rng, offload, match):
    h, params, _ = draw(rng)
    with pytest.raises(ValueError, match=match):
        pf.sco_scan(layer_fn, h, params, offload=offload)


def test_bad_loop_names_the_argument(rng):
    h, params, _ = draw(rng)
    with pytest.raises(ValueError, match="loop: expected one of"):
        pf.sco_scan(layer_fn, h, params, offload=0, loop="python")


def test_numpy_offloads_and_zero_layers(rng):
    h, params, cotangent = draw(rng)
    chosen = np.array([True, False, True, False, True])
    assert sco.offload_plan(None, LAYERS, 1) == (False,) * LAYERS  # the config's forms
    assert sco.offload_plan("all", LAYERS, 1) == (True,) * LAYERS
    for offload in (chosen, list(chosen), np.int64(2), [0, 2, 4], np.array([4, 2, 0])):
        value, _ = value_and_grads(lambda h, p: pf.sco_scan(layer_fn, h, p, offload=offload),
                                   h, params, cotangent)
        ref_value, _ = value_and_grads(lambda h, p: checkpointed_scan(layer_fn, h, p), h,
                                       params, cotangent)
        np.testing.assert_array_equal(value, ref_value)
    empty = jax.tree.map(lambda a: a[:0], params)
    grads = jax.grad(lambda h: pf.sco_scan(layer_fn, h, empty, offload=0).sum())(h)
    np.testing.assert_array_equal(grads, jnp.ones_like(h))


@pytest.mark.parametrize("bad_layer", [
    lambda c, p: (routed_layer(c, p)[0].astype(jnp.bfloat16), *routed_layer(c, p)[1:]),
    lambda c, p: routed_layer(c, p)[:2],
    lambda c, p: list(routed_layer(c, p)),
    lambda c, p: (routed_layer(c, p)[0], routed_layer(c, p)[1][:2], routed_layer(c, p)[2]),
], ids=["dtype", "structure", "container", "shape"])
def test_layer_that_changes_the_carry_is_refused(rng, bad_layer):
    carry, params, _ = draw_routed(rng)
    with pytest.raises(ValueError, match="layer_fn"):
        pf.sco_scan(bad_layer, carry, params, offload=1)


def test_bad_budget_params_and_carry():
    with pytest.raises(ValueError, match="HostBudget"):
        pf.HostBudget(-1)
    with pytest.raises(ValueError, match="HostBudget"):
        pf.HostBudget(True)
    with pytest.raises(ValueError, match="stacked_params"):
        pf.sco_scan(layer_fn, jnp.ones((2, 2)), {"w": jnp.ones((3, 2)), "b": jnp.ones((4,))},
                    offload=0)
    for carry in ((), (jnp.ones(2), 1.0)):
        with pytest.raises(ValueError, match="carry"):
            pf.sco_scan(lambda c, p: c, carry, {"w": jnp.ones((3, 2))}, offload=0)


@pytest.mark.slow
def test_a_layer_with_pipelined_moe_keeps_its_chunk_bound(rng):
    """Integration: SCO inside shard_map around layers that each hold a PipelinedLLEP layer,
    the routing (ids, gates) riding in the carry: values match the checkpointed scan, and no
    array the size of a rank's whole dispatch appears."""
    devices, experts, tokens, top_k, hidden, ffn, layers = 4, 8, 256, 4, 32, 16, 3
    mesh = make_mesh(("expert", devices))
    ids = jnp.asarray(np.concatenate([skew.route(tokens, top_k, experts,
                                                 skew.SkewProfile(0.8, 2))] * devices))
    gates = jnp.asarray(rng.random((devices * tokens, top_k)), jnp.float32)

    def moe_layer(carry, p):
        h, ids, gates = carry
        y = pf.pipelined_moe(h, ids, gates, p["wg"], p["wu"], p["wd"],
                             axis_name="expert", num_experts=experts, token_budget=8,
                             max_chunks=64, llep_min_tokens=8)
        return h + y, ids, gates

    def per_shard(h, ids, gates, wg, wu, wd, use_sco):
        params = {"wg": wg, "wu": wu, "wd": wd}
        stack = sco_stack(2) if use_sco else checkpointed_scan
        return stack(moe_layer, (h, ids, gates), params)[0]

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
        assert relative_error(a, b) <= 1e-4
    compiled = grad.lower(h, *weights).compile()
    memory.assert_no_array_at_least(compiled, tokens * top_k * hidden, what="dispatch buffer")


# -- the bound against XLA's CPU plan ----------------------------------------------------------


def mlp_layer(carry, p):
    """A carry of (h, a f32 [E] load counter, an f32 scalar, int32 segment ids)."""
    h, load, aux, segment_ids = carry
    probs = jax.nn.softmax(h @ p["router"], axis=-1)
    h = h + jnp.tanh(h @ p["up"]) @ p["down"] * (segment_ids[:, None] > 0)
    return h, load + probs.sum(0), aux + jnp.mean(probs**2), segment_ids


def mlp_shapes(num_layers, tokens, hidden, experts=8):
    carry = (jax.ShapeDtypeStruct((tokens, hidden), jnp.float32),
             jax.ShapeDtypeStruct((experts,), jnp.float32),
             jax.ShapeDtypeStruct((), jnp.float32), jax.ShapeDtypeStruct((tokens,), jnp.int32))
    params = {"up": jax.ShapeDtypeStruct((num_layers, hidden, 4 * hidden), jnp.float32),
              "down": jax.ShapeDtypeStruct((num_layers, 4 * hidden, hidden), jnp.float32),
              "router": jax.ShapeDtypeStruct((num_layers, hidden, experts), jnp.float32)}
    return carry, params


def gradient_temp_bytes(num_layers, tokens, hidden, offload=0, loop="scan"):
    """XLA's temporaries of the gradient of a stack of mlp_layer (on CPU no copy leaves the
    device, so every boundary stays in the plan whatever ``offload`` says)."""
    carry, params = mlp_shapes(num_layers, tokens, hidden)

    def loss(carry, params):
        h, load, aux, _ = pf.sco_scan(mlp_layer, carry, params, offload=offload, loop=loop)
        return h.sum() + load.sum() + aux

    grad = jax.grad(loss, argnums=(0, 1), allow_int=True)
    return memory.compiled_memory(jax.jit(grad).lower(carry, params).compile()).temp


@pytest.mark.parametrize("loop", LOOPS)
def test_gradient_temporaries_grow_by_one_boundary_per_layer(loop):
    """With nothing offloaded (and on CPU nothing is) each added layer may add one boundary,
    never a layer's parameters or their gradients (which XLA kept alive for all layers until
    the slices and the gradient writes were tied to the layer order). A layer's parameters here
    are 32x a boundary; the carry has four leaves, one of them integer (the bound's L * C_int:
    the scanned loop saves it per layer, where the unrolled one's copies were one buffer)."""
    tokens, hidden = 32, 128
    boundary, integer = sco.carry_bytes(mlp_shapes(1, tokens, hidden)[0])
    growth = (gradient_temp_bytes(8, tokens, hidden, loop=loop)
              - gradient_temp_bytes(4, tokens, hidden, loop=loop))
    # measured: 65,536 bytes unrolled, 66,048 scanned (4 boundaries and 4 integer leaves)
    assert growth <= 4 * (boundary + integer)


def layer_working_bytes(carry, params):
    """W: XLA's temporaries of one layer's VJP compiled as its own program."""
    layer_params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape[1:], s.dtype), params)
    cotangent = jax.tree.map(lambda s: s if jnp.issubdtype(s.dtype, jnp.inexact) else
                             jax.ShapeDtypeStruct(s.shape, jax.dtypes.float0), carry)

    def layer_vjp(carry, params, d_carry):
        return jax.vjp(mlp_layer, carry, params)[1](d_carry)

    return memory.compiled_memory(jax.jit(layer_vjp).lower(carry, layer_params,
                                                           cotangent).compile()).temp


@pytest.mark.parametrize("num_layers, tokens, hidden", [(4, 32, 128), (8, 256, 64),
                                                        (6, 1024, 32)])
@pytest.mark.parametrize("loop", LOOPS)
def test_memory_terms_bound_the_cpu_plan(num_layers, tokens, hidden, loop):
    """sco_memory_terms with n_offloaded = 0 (on CPU every boundary stays on the device) holds
    XLA's plan of the whole gradient. Measured bound / plan: 1.67, 1.22 and 1.12 at these
    shapes unrolled, 1.63, 1.09 and 1.02 scanned; the slack is mostly the layer_parameters
    term: XLA:CPU reads a layer's parameters from the stack in place instead of slicing a
    copy."""
    carry, params = mlp_shapes(num_layers, tokens, hidden)
    boundary, integer = sco.carry_bytes(carry)
    layer_params = sum(math.prod(s.shape[1:]) * s.dtype.itemsize
                       for s in jax.tree.leaves(params))
    terms = sco.sco_memory_terms(num_layers, 0, boundary, layer_params,
                                 layer_working_bytes(carry, params), integer)
    assert set(terms) == set(sco.MEMORY_FORMULAS)
    plan = gradient_temp_bytes(num_layers, tokens, hidden, loop=loop)
    assert plan <= sum(terms.values()) <= 1.7 * plan


def test_memory_terms_count_offloaded_boundaries():
    terms = sco.sco_memory_terms(24, 12, 100, 7, 5, integer_bytes=3)
    assert terms == {"kept_boundaries": 1200, "restored_boundaries": 200, "integer_leaves": 72,
                     "carry_cotangents": 200, "layer_parameters": 14, "layer_working_set": 5}
    assert sco.sco_memory_terms(24, 1, 100, 0, 0)["restored_boundaries"] == 100
    assert sco.sco_host_bytes(12, 100) == 1200
    with pytest.raises(ValueError, match="num_offloaded"):
        sco.sco_memory_terms(4, 5, 100, 0, 0)


@pytest.mark.parametrize("offload", [0, 2, LAYERS], ids=str)
@pytest.mark.parametrize("loop", LOOPS)
def test_per_layer_params_equal_stacked(rng, offload, loop):
    """PerLayer params (one pytree per layer) give the stacked form's values, and per-layer
    gradients equal to the slices of its stacked gradients, bit for bit."""
    carry, params, cotangent = draw_routed(rng)
    per_layer = pf.PerLayer(tuple(jax.tree.map(lambda a: a[i], params) for i in range(LAYERS)))

    def run(carry, params):
        return pf.sco_scan(routed_layer, carry, params, offload=offload, loop=loop)

    value, vjp = jax.vjp(jax.jit(run), carry, params)
    value_layers, vjp_layers = jax.vjp(jax.jit(run), carry, per_layer)
    for a, b in zip(jax.tree.leaves(value), jax.tree.leaves(value_layers)):
        np.testing.assert_array_equal(a, b)
    d_carry, d_params = vjp(cotangent)
    d_carry_layers, d_per_layer = vjp_layers(cotangent)
    assert isinstance(d_per_layer, pf.PerLayer)
    for a, b in zip(jax.tree.leaves(d_carry), jax.tree.leaves(d_carry_layers)):
        np.testing.assert_array_equal(a, b)
    for i, layer in enumerate(d_per_layer.layers):
        for stacked, sliced in zip(jax.tree.leaves(d_params), jax.tree.leaves(layer)):
            np.testing.assert_array_equal(stacked[i], sliced)


def test_per_layer_layer_waits_only_for_its_own_params(rng):
    """In the forward, layer l's barrier ties its carry to layer l's parameters only: the
    parameters of later layers may be computed while it runs."""
    carry, params, _ = draw_routed(rng)
    per_layer = pf.PerLayer(tuple(jax.tree.map(lambda a: a[i], params) for i in range(LAYERS)))
    jaxpr = jax.make_jaxpr(jax.grad(lambda c, p: pf.sco_scan(
        routed_layer, c, p, offload=0, loop="unrolled")[0].sum(), argnums=1))(carry, per_layer)
    layer_leaves = len(jax.tree.leaves(per_layer.layers[0]))
    carry_leaves = len(jax.tree.leaves(carry))
    barriers = [e for e in iter_eqns(jaxpr.jaxpr, "optimization_barrier")]
    forward = barriers[:LAYERS]  # the first L barriers tie each layer's input and params
    assert all(len(e.invars) == carry_leaves + layer_leaves for e in forward)


def _wide_layer(h, p):
    w1, w2 = p
    return h + jnp.tanh(h @ w1) @ w2


def _two_stacks_temp_bytes(first_stack: int) -> int:
    """XLA:CPU's temporaries of the gradient of two scanned stacks (the first of
    ``first_stack`` layers, the second of 4), each layer with a wide [N, F] activation."""
    n, h, f = 4096, 256, 4096
    keys = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(keys[0], (n, h))
    first = (jax.random.normal(keys[1], (first_stack, h, f)) * 0.05,
             jax.random.normal(keys[2], (first_stack, f, h)) * 0.05)
    second = (jax.random.normal(keys[3], (4, h, f)) * 0.05,
              jax.random.normal(keys[4], (4, f, h)) * 0.05)

    def loss(x, first, second):
        x = pf.sco_scan(_wide_layer, x, first, offload=None, loop="scan")
        x = pf.sco_scan(_wide_layer, x, second, offload=None, loop="scan")
        return jnp.sum(x * x)

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, first, second).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_a_stack_of_one_layer_holds_no_activation_from_its_forward():
    """A scanned stack of one layer is straight-line code to XLA: without the backward's tie of
    the recompute to the cotangent from above, XLA merged the recompute with the forward and
    held the layer's [N, F] activation through the other stack's backward (XLA:GPU at h200-1,
    and XLA:CPU here: 64 MiB more than the same program with a stack of two)."""
    assert _two_stacks_temp_bytes(1) <= _two_stacks_temp_bytes(2)


def _made_in_loop(sources, offsets, into=None):
    """A ``sco.MadeInLoop`` whose layer l's params are ``2 * sources[l]`` plus its offsets, wrapped
    twice (``map_params``): the params pytree, then with the layer's index beside it."""
    def make(layer, source, chain, ready):
        return jax.tree.map(lambda a: 2 * a, source), None, chain + 1

    made = sco.MadeInLoop(make, sources, jnp.int32(0), offsets, into=into)
    return made.map_params(lambda layer, p: {**p, "scale": p["scale"] * 0.5}).map_params(
        lambda layer, p: {**p, "scale": p["scale"] * 2})


@pytest.mark.parametrize("offload", [0, LAYERS], ids=str)
@pytest.mark.parametrize("given_into", [False, True], ids=["zeros", "into"])
def test_made_in_loop_equals_the_stacked_params(rng, offload, given_into):
    """Params made inside the unrolled forward (``sco.MadeInLoop``: layer l's made from its
    source, plus offsets that are not zero, written into stacked arrays) give the values and
    the gradients of the stacked params they equal, the gradients with respect to the offsets
    including those through the stacked output a loss reads too."""
    h, params, d_h = draw(rng)
    offsets = jax.tree.map(lambda a: a / 7, draw(rng)[1])
    sources = tuple(jax.tree.map(lambda a, i=i: a[i] / 2, params) for i in range(LAYERS))
    into = jax.tree.map(lambda a: jnp.full_like(a, 3.0), offsets) if given_into else None

    def made(h, offsets):
        loop = _made_in_loop(sources, offsets, into)
        out = pf.sco_scan(layer_fn, h, loop, offload=offload, loop="unrolled")
        outputs, chain, stacked = loop.results
        assert chain.dtype == jnp.int32 and len(outputs) == LAYERS
        return jnp.vdot(out, d_h) + sum(jnp.sum(a**2) for a in jax.tree.leaves(stacked))

    def stacked(h, offsets):
        p = jax.tree.map(lambda a, o: 2 * (a / 2) + o, params, offsets)
        out = checkpointed_scan(layer_fn, h, p)
        return jnp.vdot(out, d_h) + sum(jnp.sum(a**2) for a in jax.tree.leaves(p))

    result = jax.jit(jax.value_and_grad(made, argnums=(0, 1)))(h, offsets)
    expected = jax.jit(jax.value_and_grad(stacked, argnums=(0, 1)))(h, offsets)
    for a, b in zip(jax.tree.leaves(result), jax.tree.leaves(expected)):
        assert relative_error(a, b) < 1e-6


def test_made_in_loop_refuses_params_unlike_its_offsets(rng):
    """A made layer, or ``into``, of another dtype or shape than the offsets is refused with
    the argument named, not cast into the stacked arrays."""
    h, params, _ = draw(rng)
    offsets = jax.tree.map(jnp.zeros_like, params)
    sources = tuple(jax.tree.map(lambda a, i=i: a[i], params) for i in range(LAYERS))
    narrow = tuple(jax.tree.map(lambda a: a.astype(jnp.bfloat16), s) for s in sources)
    with pytest.raises(ValueError, match="MadeInLoop.make's params of layer 0"):
        pf.sco_scan(layer_fn, h, _made_in_loop(narrow, offsets), offload=0, loop="unrolled")
    short = jax.tree.map(lambda a: a[1:], offsets)
    with pytest.raises(ValueError, match="MadeInLoop.into"):
        pf.sco_scan(layer_fn, h, _made_in_loop(sources, offsets, into=short), offload=0,
                    loop="unrolled")
    with pytest.raises(ValueError, match="MadeInLoop.offsets"):
        pf.sco_scan(layer_fn, h, _made_in_loop(sources[1:], offsets), offload=0,
                    loop="unrolled")


def _made_in_scan(params, offsets, segments, into=None):
    """A ``sco.MadeInScan`` whose layer l's params are ``2 * (params[l] / 2)`` (read as row l of
    the stacked halves it carries) plus its offsets, wrapped twice (``map_params``); it counts
    in its carried state how many layers each segment made."""
    halves = jax.tree.map(lambda a: a / 2, params)

    def make(layer, carried, ready, segment):
        sources, counts = carried
        made = jax.tree.map(
            lambda a: 2 * jax.lax.dynamic_index_in_dim(a, layer, 0, keepdims=False), sources)
        return made, (sources, counts.at[segment].add(1))

    made = sco.MadeInScan(make, (halves, jnp.zeros(3, jnp.int32)), segments, offsets, into=into)
    return made.map_params(lambda layer, p: {**p, "scale": p["scale"] * 0.5}).map_params(
        lambda layer, p: {**p, "scale": p["scale"] * 2})


@pytest.mark.parametrize("offload", [0, LAYERS, [True, False, True, True, False]], ids=str)
@pytest.mark.parametrize("segments", [(0,) * LAYERS, (0, 0, 1, 1, 2)], ids=["one", "three"])
def test_made_in_scan_equals_made_in_loop_bit_for_bit(rng, offload, segments):
    """Params made inside the scanned forward (``sco.MadeInScan``: layer l + 1's made in layer
    l's iteration, from a row of carried stacked state) give the unrolled ``MadeInLoop``'s
    values and gradients bit for bit, the offsets' gradients including those through the
    stacked output a loss reads too; every layer is made once, by the loop of its segment; and
    the program holds one loop per run of layers with one offload choice and one next
    segment, the last layer a loop of its own (nothing left to make)."""
    h, params, d_h = draw(rng)
    offsets = jax.tree.map(lambda a: a / 7, draw(rng)[1])
    into = jax.tree.map(lambda a: jnp.full_like(a, 3.0), offsets)
    sources = tuple(jax.tree.map(lambda a, i=i: a[i] / 2, params) for i in range(LAYERS))

    def scanned(h, offsets):
        made = _made_in_scan(params, offsets, segments, into)
        out = pf.sco_scan(layer_fn, h, made, offload=offload, loop="scan")
        (_, counts), stacked = made.results
        value = jnp.vdot(out, d_h) + sum(jnp.sum(a**2) for a in jax.tree.leaves(stacked))
        return value, counts

    def unrolled(h, offsets):
        made = _made_in_loop(sources, offsets, into)
        out = pf.sco_scan(layer_fn, h, made, offload=offload, loop="unrolled")
        return jnp.vdot(out, d_h) + sum(jnp.sum(a**2) for a in jax.tree.leaves(made.results[2]))

    (value, counts), grads = jax.jit(jax.value_and_grad(scanned, argnums=(0, 1),
                                                        has_aux=True))(h, offsets)
    expected = jax.jit(jax.value_and_grad(unrolled, argnums=(0, 1)))(h, offsets)
    assert_equal_trees((value, grads), expected)
    assert counts.tolist() == [segments.count(s) for s in range(3)]
    chosen = sco.offload_plan(offload, LAYERS, BOUNDARY_BYTES)
    runs = sco._made_runs(chosen, segments)
    assert runs[-1] == (LAYERS - 1, LAYERS, chosen[-1], None)
    jaxpr = jax.make_jaxpr(jax.grad(lambda h, o: scanned(h, o)[0], argnums=1))(h, offsets)
    loops = [e for e in iter_eqns(jaxpr.jaxpr, "scan")]
    assert len(loops) == 2 * len(runs)  # a forward and a backward loop per run


def test_made_in_scan_refuses_what_it_cannot_loop_over(rng):
    """A MadeInScan under the unrolled loop, segments not one per layer (or None), and made
    params unlike the offsets are refused with the argument named."""
    h, params, _ = draw(rng)
    offsets = jax.tree.map(jnp.zeros_like, params)
    with pytest.raises(ValueError, match='loop: expected "scan" for a MadeInScan'):
        pf.sco_scan(layer_fn, h, _made_in_scan(params, offsets, (0,) * LAYERS), offload=0,
                    loop="unrolled")
    with pytest.raises(ValueError, match="MadeInScan.segments"):
        pf.sco_scan(layer_fn, h, _made_in_scan(params, offsets, (0,) * (LAYERS - 1)),
                    offload=0)
    with pytest.raises(ValueError, match="MadeInScan.segments"):
        pf.sco_scan(layer_fn, h, _made_in_scan(params, offsets, (0, None, 0, 0, 0)),
                    offload=0)
    narrow = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
    with pytest.raises(ValueError, match="MadeInScan.make's params"):
        pf.sco_scan(layer_fn, h, _made_in_scan(narrow, offsets, (0,) * LAYERS), offload=0)
