"""The all-to-all that carries token-slots to the devices that process them, and back.

``pack`` places each slot's row in its destination's bucket; ``exchange`` swaps buckets so that
bucket d of every source lands on device d (and, applied again, brings results home).

This is the padded form: every bucket has room for all S slots of a chunk, since in the worst
case they all go to one device. It runs everywhere (XLA:CPU has no ragged-all-to-all) and its
buffers are bounded by the chunk, not the routing: D * S rows sent and D * S received. On GPU a
``lax.ragged_all_to_all`` sends only the rows that exist; it is not wired in yet.

Legend: D devices of the expert-parallel axis, S token-slots of one chunk from one source.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def bucket_positions(destination: jax.Array, num_devices: int) -> jax.Array:
    """Each slot's row within its destination's bucket (slots keep their order within a
    bucket). ``destination [S]`` in ``[0, D]``; D marks a slot that is not sent."""
    order = jnp.argsort(destination, stable=True)
    sorted_destination = destination[order]
    counts = jnp.zeros(num_devices + 1, jnp.int32).at[destination].add(1)
    starts = jnp.cumsum(counts) - counts
    positions_sorted = jnp.arange(destination.shape[0]) - starts[sorted_destination]
    return jnp.zeros_like(destination).at[order].set(positions_sorted)


def pack(rows: jax.Array, destination: jax.Array, positions: jax.Array, num_devices: int,
         fill=0) -> jax.Array:
    """``[D, S, ...]`` buckets holding ``rows [S, ...]``; slots with destination D are left out
    and empty places hold ``fill``."""
    buckets = jnp.full((num_devices, *rows.shape), fill, rows.dtype)
    return buckets.at[destination, positions].set(rows, mode="drop")


def unpack(buckets: jax.Array, destination: jax.Array, positions: jax.Array) -> jax.Array:
    """The rows ``[S, ...]`` at each slot's place in ``buckets [D, S, ...]``; 0 where not sent."""
    return buckets.at[destination, positions].get(mode="fill", fill_value=0)


def exchange(buckets: jax.Array, axis_name) -> jax.Array:
    """Bucket d of this device goes to device d; the result's bucket s came from device s."""
    return lax.all_to_all(buckets, axis_name, split_axis=0, concat_axis=0)
