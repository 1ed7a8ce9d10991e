"""The all-to-all that carries token-slots to the devices that process them, and back.

An ``Exchange`` moves one chunk: slot j of a source reaches its destination device, is processed
there, and its result comes back to slot j. Three steps, each a method:

    routes  = exchange.routes(destination [S], num_devices, axis_name)   # once per chunk
    arrived = exchange.send(rows [S, ...], routes, axis_name, fill)       # [D * S, ...]
    back    = exchange.combine(processed [D * S, ...], routes, axis_name) # [S, ...]

``send`` is linear in ``rows`` and ``combine`` is its transpose (slots not sent come back as 0,
and rows that no slot filled send nothing back), so a backward pass sends cotangents home with
``combine`` and brings them out with ``send``: the same buffers as the forward.

``PaddedExchange`` (this module) is the one that runs: every destination's bucket has room for
all S slots of a chunk, since in the worst case they all go to one device, and one
``lax.all_to_all`` moves the D buckets. It runs on every backend. Buffers per device: D * S
rows sent and D * S received, each way. The ragged form (``ragged_exchange``) sends only the
rows that exist; it is exact, and experimental: docs/pipelined_moe.md says why it is not the
default.

Rows move into and out of the buckets by gathers both ways (``row_permutation``), never by
scatters: on GPUs the scatters were the largest kernels after the grouped matmuls.

Legend: D devices of the expert-parallel axis, S token-slots of one chunk from one source.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from jax import lax

from peakflat_jax.ops import row_permutation


class Exchange(Protocol):
    """How a chunk's slots travel to their devices and back (module doc). Implementations are
    frozen dataclasses: they are part of a call's static description."""

    def routes(self, destination: jax.Array, num_devices: int, axis_name: Any) -> Any:
        """Where the slots ``destination [S]`` in ``[0, D]`` (D: not sent) go and land: a pytree
        of arrays, computed once per chunk for every send and combine of it."""

    def send(self, rows: jax.Array, routes: Any, axis_name: Any, fill=0) -> jax.Array:
        """``[D * S, ...]``: the rows sent to this device, then ``fill`` (a Python scalar)."""

    def combine(self, processed: jax.Array, routes: Any, axis_name: Any) -> jax.Array:
        """``[S, ...]``: each slot's processed row back at its place, 0 for slots not sent."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PaddedRoutes:
    """Where one chunk's slots sit in the padded buckets, as maps both ways."""

    bucket_row: jax.Array  # [S] each slot's row in the flattened [D * S] buckets; D * S: not sent
    source_row: jax.Array  # [D * S] each bucket row's slot; S: empty

    @property
    def num_slots(self) -> int:
        return self.bucket_row.shape[0]

    @property
    def num_devices(self) -> int:
        return self.source_row.shape[0] // self.bucket_row.shape[0]


@dataclasses.dataclass(frozen=True)
class PaddedExchange:
    """Buckets of S rows for every destination, moved by one ``lax.all_to_all`` (module doc)."""

    def routes(self, destination: jax.Array, num_devices: int, axis_name: Any) -> PaddedRoutes:
        del axis_name  # every bucket's place is known locally
        return padded_routes(destination, num_devices)

    def send(self, rows: jax.Array, routes: PaddedRoutes, axis_name: Any, fill=0) -> jax.Array:
        sent = exchange(pack(rows, routes, fill=fill), axis_name)
        return sent.reshape(-1, *rows.shape[1:])

    def combine(self, processed: jax.Array, routes: PaddedRoutes, axis_name: Any) -> jax.Array:
        buckets = processed.reshape(routes.num_devices, routes.num_slots, *processed.shape[1:])
        return unpack(exchange(buckets, axis_name), routes)


def padded_routes(destination: jax.Array, num_devices: int) -> PaddedRoutes:
    """Routes of the slots ``destination [S]`` in ``[0, D]`` (D: not sent) for one chunk: each
    slot takes the next row of its destination's bucket, in slot order."""
    num_slots = destination.shape[0]
    positions = row_permutation.bucket_positions(destination, num_devices)
    sent = destination < num_devices
    bucket_row = jnp.where(sent, destination * num_slots + positions, num_devices * num_slots)
    bucket_row = bucket_row.astype(jnp.int32)
    return PaddedRoutes(bucket_row,
                        row_permutation.inverse_map(bucket_row, num_devices * num_slots))


def pack(rows: jax.Array, routes: PaddedRoutes, fill=0) -> jax.Array:
    """``[D, S, ...]`` buckets holding ``rows [S, ...]``; slots not sent are left out and empty
    places hold ``fill``. A gather both ways; its transpose is ``unpack``."""
    buckets = row_permutation.gather_rows(rows, routes.source_row, routes.bucket_row, fill)
    return buckets.reshape(routes.num_devices, *rows.shape)


def unpack(buckets: jax.Array, routes: PaddedRoutes) -> jax.Array:
    """The rows ``[S, ...]`` at each slot's place in ``buckets [D, S, ...]``; 0 where not sent.
    The transpose of ``pack`` (a gather both ways)."""
    return row_permutation.gather_rows(buckets.reshape(-1, *buckets.shape[2:]),
                                       routes.bucket_row, routes.source_row)


def exchange(buckets: jax.Array, axis_name: Any) -> jax.Array:
    """Bucket d of this device goes to device d; the result's bucket s came from device s."""
    return lax.all_to_all(buckets, axis_name, split_axis=0, concat_axis=0)
