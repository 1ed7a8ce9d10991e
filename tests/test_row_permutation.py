"""gather_rows: a one-to-one row map as a gather both ways, against autodiff of the scatter it
replaces; bucket_positions; and the MoE layer's forward and backward move no rows by scatter."""

import jax
import jax.numpy as jnp
import numpy as np
from _helpers import iter_eqns
from conftest import make_mesh
from jax.sharding import PartitionSpec as P

import peakflat_jax as pf
from peakflat_jax import skew
from peakflat_jax.ops import row_permutation


def test_values_and_gradient_equal_the_scatter_it_replaces(rng):
    rows, out_rows = 7, 10
    x = jnp.asarray(rng.standard_normal((rows, 3)), jnp.float32)
    index = np.full(out_rows, rows + 5)  # out of range: filled
    index[rng.permutation(out_rows)[:rows]] = rng.permutation(rows)
    index = jnp.asarray(index, jnp.int32)
    inverse = row_permutation.inverse_map(index, rows)
    assert np.array_equal(np.asarray(index)[np.asarray(inverse)], np.arange(rows))
    d_y = jnp.asarray(rng.standard_normal((out_rows, 3)), jnp.float32)

    def by_scatter(x):  # every x row lands at its place; the other places hold the fill
        return jnp.full((out_rows, 3), -1.0).at[inverse].set(x)

    def by_gather(x):
        return row_permutation.gather_rows(x, index, inverse, fill=-1.0)

    np.testing.assert_array_equal(by_gather(x), by_scatter(x))
    grad = jax.grad(lambda x: jnp.vdot(by_gather(x), d_y))(x)
    np.testing.assert_array_equal(grad, jax.grad(lambda x: jnp.vdot(by_scatter(x), d_y))(x))


def test_rows_not_taken_get_no_gradient_and_integers_pass_through(rng):
    x = jnp.arange(12.0).reshape(4, 3)
    index = jnp.asarray([2, 0], jnp.int32)  # rows 1 and 3 are not taken
    inverse = row_permutation.inverse_map(index, 4)
    assert inverse.tolist() == [1, 2, 0, 2]
    grad = jax.grad(lambda x: jnp.sum(row_permutation.gather_rows(x, index, inverse)))(x)
    np.testing.assert_array_equal(grad, [[1] * 3, [0] * 3, [1] * 3, [0] * 3])
    ids = row_permutation.gather_rows(jnp.arange(4), jnp.asarray([3, 9, -1]), None, fill=-7)
    assert ids.tolist() == [3, -7, -7]  # negative indices are out of range, not from the end
    assert row_permutation.inverse_map(jnp.asarray([-1, 0]), 3).tolist() == [1, 2, 2]


def test_bucket_positions_count_within_each_bucket(rng):
    bucket = rng.integers(0, 4, 30)  # bucket 3 stands for "not sent": counted like the others
    positions = np.asarray(row_permutation.bucket_positions(jnp.asarray(bucket, jnp.int32), 3))
    expected = [int(np.sum(bucket[:i] == b)) for i, b in enumerate(bucket)]
    np.testing.assert_array_equal(positions, expected)


def test_the_layer_moves_no_rows_by_scatter():
    """In the jaxpr of the layer's forward and backward (the custom VJPs' rules included),
    every scatter is over integers or small routing arrays: none writes rows of the hidden or
    FFN width (they were the largest kernels after the matmuls on GPUs)."""
    devices, experts, tokens, top_k, hidden, ffn = 4, 8, 64, 2, 40, 24
    mesh = make_mesh(("expert", devices))
    ids = jnp.asarray(np.concatenate([skew.route(tokens, top_k, experts,
                                                 skew.SkewProfile(0.95, 2))] * devices))
    layer = jax.shard_map(
        lambda x, ids, g, wg, wu, wd: pf.pipelined_moe(
            x, ids, g, wg, wu, wd, axis_name="expert", num_experts=experts, token_budget=16),
        mesh=mesh, in_specs=(P("expert"),) * 6, out_specs=P("expert"))
    args = (jnp.ones((devices * tokens, hidden)), jnp.ones((devices * tokens, top_k)),
            jnp.ones((experts, hidden, ffn)), jnp.ones((experts, hidden, ffn)),
            jnp.ones((experts, ffn, hidden)))
    step = jax.grad(lambda x, g, wg, wu, wd: jnp.sum(layer(x, ids, g, wg, wu, wd)),
                    argnums=(0, 1, 2, 3, 4))
    jaxpr = jax.make_jaxpr(step)(*args).jaxpr
    scatters = [eqn for eqn in iter_eqns(jaxpr) if eqn.primitive.name.startswith("scatter")]
    assert scatters, "expected the routing's integer scatters"
    for eqn in scatters:
        shape = eqn.outvars[0].aval.shape
        assert shape[-1:] not in ((hidden,), (ffn,)), (eqn.primitive.name, shape)
    # The rows do move, by gathers.
    assert any(eqn.outvars[0].aval.shape[-1:] == (hidden,) for eqn in iter_eqns(jaxpr, "gather"))
