"""The experimental ragged exchange on CPU, with an emulated ragged_all_to_all typed like the real
one: the same slots as the padded exchange both ways, the padded gradient for replicated rows,
and the whole layer against the float64 reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_pipelined_moe as moe_tests
from conftest import make_mesh
from jax import lax
from jax.sharding import PartitionSpec as P
from ragged_emulation import typed_like_the_collective

from peakflat_jax.ops.expert_exchange import PaddedExchange
from peakflat_jax.ops.pipelined_moe import MoEBackend
from peakflat_jax.ops.ragged_exchange import RaggedExchange

pytestmark = pytest.mark.slow  # host callbacks: never in the compilation cache

RAGGED = RaggedExchange(all_to_all=typed_like_the_collective)
PADDED = PaddedExchange()


@pytest.mark.parametrize("devices", [1, 2, 5])
def test_round_trip_equals_padded(rng, devices):
    """Every slot reaches its destination, in its source's order, and comes back to its place;
    slots sent nowhere (destination D) come back as zeros. Processing tags each row with the
    device that saw it and the row's place there."""
    slots, hidden = 9, 3
    mesh = make_mesh(("expert", devices))
    rows = jnp.asarray(rng.standard_normal((devices * slots, hidden)), jnp.float32)
    destination = jnp.asarray(rng.integers(0, devices + 1, devices * slots), jnp.int32)

    def round_trip(exchange, fill):
        def trip(rows, destination):
            routes = exchange.routes(destination, devices, "expert")
            received = exchange.send(rows, routes, "expert", fill=fill)
            processed = received * 2 + lax.axis_index("expert")
            return received, exchange.combine(processed, routes, "expert")
        spec = P("expert")
        return jax.jit(jax.shard_map(trip, mesh=mesh, in_specs=(spec, spec),
                                     out_specs=(spec, spec)))(rows, destination)

    padded_received, padded_back = round_trip(PADDED, 0.0)
    ragged_received, ragged_back = round_trip(RAGGED, 7.0)
    np.testing.assert_array_equal(ragged_back, padded_back)
    # Received: the padded buckets' rows, source by source, packed end to end, then the fill.
    for device in range(devices):
        bucket = np.asarray(padded_received).reshape(devices, devices, slots, hidden)[device]
        counts = [int(np.sum(np.asarray(destination)[s * slots:(s + 1) * slots] == device))
                  for s in range(devices)]
        expected = np.concatenate([bucket[s, :counts[s]] for s in range(devices)])
        got = np.asarray(ragged_received).reshape(devices, devices * slots, hidden)[device]
        np.testing.assert_array_equal(got[:len(expected)], expected)
        assert (got[len(expected):] == 7.0).all()


def test_round_trip_of_replicated_rows_has_the_padded_gradient(rng):
    """Rows that do not vary over the axis (replicated tokens) go through the custom VJPs too:
    their cotangent is summed over the devices like the padded exchange's."""
    devices, slots, hidden = 3, 7, 4
    mesh = make_mesh(("expert", devices))
    rows = jnp.asarray(rng.standard_normal((slots, hidden)), jnp.float32)
    destination = jnp.asarray(rng.integers(0, devices + 1, devices * slots), jnp.int32)
    cotangent = jnp.asarray(rng.standard_normal((devices * slots, hidden)), jnp.float32)

    def gradient(exchange):
        def trip(rows, destination):
            routes = exchange.routes(destination, devices, "expert")
            received = exchange.send(rows, routes, "expert")
            return exchange.combine(received * (2 + lax.axis_index("expert")), routes,
                                    "expert")
        layer = jax.shard_map(trip, mesh=mesh, in_specs=(P(), P("expert")),
                              out_specs=P("expert"))
        return jax.jit(jax.grad(lambda r: jnp.sum(layer(r, destination) * cotangent)))(rows)

    np.testing.assert_allclose(gradient(RAGGED), gradient(PADDED), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("setting", [1, 3, 5, 8])
def test_layer_matches_reference(rng, setting):
    moe_tests.test_matches_reference(rng, *moe_tests.SETTINGS[setting],
                                     backend=MoEBackend(exchange=RAGGED))
