"""The all-to-all that carries token-slots to the devices that process them, and back.

Two forms with the same semantics: slot j of a source reaches its destination device, is
processed there, and its result comes back to slot j. ``exchange_kind()`` chooses by backend.

``"padded"`` (``PaddedRoutes`` / ``pack`` / ``exchange`` / ``unpack``): every bucket has room
for all S slots of a chunk, since in the worst case they all go to one device. It runs
everywhere (XLA:CPU has no ragged-all-to-all). Buffers: D * S rows sent and D * S received,
each way.

``"ragged"`` (``RaggedRoutes`` / ``dispatch`` / ``combine``): ``lax.ragged_all_to_all`` sends
only the rows that exist, sorted by destination, and each receiver lays its sources' rows end to
end in a buffer of the worst case, D * S rows. Buffers: S rows sent and D * S received going
out, D * S sent and S received coming back: (D + 1) * S rows each way instead of 2 * D * S. The
per-chunk send counts are all-gathered ([D, D] int32) so that every sender knows where its rows
land. ``dispatch`` and ``combine`` are each other's transposes, stated as custom VJPs, so the
backward is the same two ragged all-to-alls and keeps the same bound.

Status: the ragged form is off (``RAGGED_ON_GPU``); ``exchange_kind()`` returns "padded"
everywhere. It is exact but slow on 2 H200s (``scripts/probe_ragged_exchange.py``, records
``scripts/results/ragged_exchange_probe_20261130-*.json``). Through ``pipelined_moe`` under skew,
its forward first matched the padded form but its gradients did not (relative difference ~1):
the backward went through jax's transpose rule of ``ragged_all_to_all``. The custom VJPs that
replaced that rule then failed to trace (``-090305.json``): the collective's result has the type
of its output buffer, invariant over the expert axis. With both directions typed as varying (see
the note above ``_dispatch``; the CPU tests' emulated collective is typed like the real one), the
re-run at commit 70e20c6 (``-105050.json``) matched the padded form: loss to 2e-7, gates to 4e-7,
x and the expert weights exactly.

Speed: one chunk's round trip at the paper's shape (52,432 rows of 7168 bf16 per device) took
473.3 ms against 11.0 ms padded (``-105050.json``; 491.7 and 491.5 ms in earlier probes), and
15.7 ms with XLA's ragged-all-to-all decomposer, whose plan then held 6.0 GB against the padded
form's 3.0 GB.

On CPU its routing is tested against the padded form with ``emulated_ragged_all_to_all``, a
stand-in with ``lax.ragged_all_to_all``'s semantics built from an all-gather (tests only: it
gathers every source's rows).

Legend: D devices of the expert-parallel axis, S token-slots of one chunk from one source.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from peakflat_jax.ops import row_permutation
from peakflat_jax.ops._shard import varying_like, varying_over

KINDS = ("padded", "ragged")
# Off: on 2 H200s the ragged round trip is 43x slower than the padded one (module doc).
RAGGED_ON_GPU = False
# The collective the ragged form calls; tests on CPU put emulated_ragged_all_to_all here.
RAGGED_ALL_TO_ALL = lax.ragged_all_to_all


def bucket_positions(destination: jax.Array, num_devices: int) -> jax.Array:
    """Each slot's row within its destination's bucket (slots keep their order within a
    bucket). ``destination [S]`` in ``[0, D]``; D marks a slot that is not sent."""
    order = jnp.argsort(destination, stable=True)
    sorted_destination = destination[order]
    counts = jnp.zeros(num_devices + 1, jnp.int32).at[destination].add(1)
    starts = jnp.cumsum(counts) - counts
    positions_sorted = jnp.arange(destination.shape[0]) - starts[sorted_destination]
    return jnp.zeros_like(destination).at[order].set(positions_sorted)


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


def padded_routes(destination: jax.Array, num_devices: int) -> PaddedRoutes:
    """Routes of the slots ``destination [S]`` in ``[0, D]`` (D: not sent) for one chunk: each
    slot takes the next row of its destination's bucket, in slot order."""
    num_slots = destination.shape[0]
    positions = bucket_positions(destination, num_devices)
    sent = destination < num_devices
    bucket_row = jnp.where(sent, destination * num_slots + positions, num_devices * num_slots)
    bucket_row = bucket_row.astype(jnp.int32)
    return PaddedRoutes(bucket_row,
                        row_permutation.inverse_map(bucket_row, num_devices * num_slots))


def pack(rows: jax.Array, routes: PaddedRoutes, fill=0) -> jax.Array:
    """``[D, S, ...]`` buckets holding ``rows [S, ...]``; slots not sent are left out and empty
    places hold ``fill``. A gather both ways (``row_permutation``); its transpose is
    ``unpack``."""
    buckets = row_permutation.gather_rows(rows, routes.source_row, routes.bucket_row, fill)
    return buckets.reshape(routes.num_devices, *rows.shape)


def unpack(buckets: jax.Array, routes: PaddedRoutes) -> jax.Array:
    """The rows ``[S, ...]`` at each slot's place in ``buckets [D, S, ...]``; 0 where not sent.
    The transpose of ``pack`` (a gather both ways)."""
    return row_permutation.gather_rows(buckets.reshape(-1, *buckets.shape[2:]),
                                       routes.bucket_row, routes.source_row)


def exchange(buckets: jax.Array, axis_name) -> jax.Array:
    """Bucket d of this device goes to device d; the result's bucket s came from device s."""
    return lax.all_to_all(buckets, axis_name, split_axis=0, concat_axis=0)


def exchange_kind() -> str:
    """The form this backend runs: ragged on GPU (once checked there), padded elsewhere."""
    return "ragged" if RAGGED_ON_GPU and jax.default_backend() == "gpu" else "padded"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RaggedRoutes:
    """Where one chunk's slots go and where they land, for both directions."""

    order: jax.Array           # [S] slots sorted by destination (not-sent slots last)
    send_offsets: jax.Array    # [D] start of each destination's rows in the sorted slots
    send_sizes: jax.Array      # [D] rows to each destination
    landing_offsets: jax.Array  # [D] where this source's rows start in each receiver's buffer
    recv_offsets: jax.Array    # [D] where each source's rows start in this device's buffer
    recv_sizes: jax.Array      # [D] rows from each source
    home_offsets: jax.Array    # [D] where each source's rows sit in that source's sorted slots

    @property
    def num_slots(self) -> int:
        return self.order.shape[0]


def ragged_routes(destination: jax.Array, num_devices: int, axis_name) -> RaggedRoutes:
    """Routes of the slots ``destination [S]`` in ``[0, D]`` (D: not sent) for one chunk."""
    counts = jnp.zeros(num_devices + 1, jnp.int32).at[destination].add(1)[:num_devices]
    all_counts = lax.all_gather(counts, axis_name)  # [source, destination]
    me = lax.axis_index(axis_name)
    all_send_offsets = jnp.cumsum(all_counts, axis=1) - all_counts
    earlier = jnp.arange(num_devices)[:, None] < me
    recv_sizes = all_counts[:, me]
    return RaggedRoutes(
        order=jnp.argsort(destination, stable=True),
        send_offsets=all_send_offsets[me], send_sizes=counts,
        landing_offsets=jnp.sum(jnp.where(earlier, all_counts, 0), axis=0),
        recv_offsets=jnp.cumsum(recv_sizes) - recv_sizes, recv_sizes=recv_sizes,
        home_offsets=all_send_offsets[:, me])


def dispatch(rows: jax.Array, routes: RaggedRoutes, num_devices: int, axis_name,
             fill=0) -> jax.Array:
    """``[D * S, ...]``: the rows sent to this device, source by source, then ``fill``.
    Linear in ``rows``; its transpose is ``combine`` (a custom VJP: module doc)."""
    return _dispatch(num_devices, axis_name, fill, varying_over(rows, axis_name), routes)


def combine(processed: jax.Array, routes: RaggedRoutes, num_slots: int,
            axis_name) -> jax.Array:
    """``[S, ...]``: each slot's processed row back at its place; 0 for slots not sent.
    Linear in ``processed``; its transpose is ``dispatch`` with fill 0 (a custom VJP)."""
    return _combine(num_slots, axis_name, varying_over(processed, axis_name), routes)


# The two directions are each other's transposes, which these custom VJPs state directly: jax's
# own transpose rule of ragged_all_to_all gave wrong gradients on 2 H200s (module doc). Rows of
# the received buffer that no source filled are constants, so they get no cotangent.
#
# Types: the custom VJPs take operands that vary over the exchange's axis (the public functions
# cast them; for an operand that did not, the cast's transpose psums its cotangent), and type
# their results as varying like the operand, as their values do. ragged_all_to_all gives its
# result the type of its output buffer, invariant (a fresh constant), and the cotangents then
# failed to match their varying inputs (2 H200s: "the manual axis types do not match").


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _dispatch(num_devices, axis_name, fill, rows, routes):
    sorted_rows = rows[routes.order]
    output = _fresh_buffer((num_devices * rows.shape[0], *rows.shape[1:]), rows.dtype, fill,
                           routes.recv_sizes)
    received = RAGGED_ALL_TO_ALL(sorted_rows, output, routes.send_offsets, routes.send_sizes,
                                 routes.landing_offsets, routes.recv_sizes, axis_name=axis_name)
    return varying_like(received, rows)


def _dispatch_fwd(num_devices, axis_name, fill, rows, routes):
    return _dispatch(num_devices, axis_name, fill, rows, routes), routes


def _dispatch_bwd(num_devices, axis_name, fill, routes, d_received):
    num_slots = d_received.shape[0] // num_devices
    return _combine(num_slots, axis_name, d_received, routes), None


_dispatch.defvjp(_dispatch_fwd, _dispatch_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _combine(num_slots, axis_name, processed, routes):
    output = _fresh_buffer((num_slots, *processed.shape[1:]), processed.dtype, 0,
                           routes.send_sizes)
    sorted_out = RAGGED_ALL_TO_ALL(processed, output, routes.recv_offsets, routes.recv_sizes,
                                   routes.home_offsets, routes.send_sizes, axis_name=axis_name)
    sorted_out = varying_like(sorted_out, processed)
    return jnp.zeros_like(sorted_out).at[routes.order].set(sorted_out)


def _combine_fwd(num_slots, axis_name, processed, routes):
    return _combine(num_slots, axis_name, processed, routes), routes


def _combine_bwd(num_slots, axis_name, routes, d_slots):
    num_devices = routes.send_sizes.shape[0]
    return _dispatch(num_devices, axis_name, 0, d_slots, routes), None


_combine.defvjp(_combine_fwd, _combine_bwd)


def _fresh_buffer(shape, dtype, fill, tie):
    """A ``fill``-ed output buffer tied to ``tie`` (this chunk's routes, not the rows, which
    must stay linear for the transpose): a constant buffer inside a scan can be hoisted out of
    the loop and copied in every iteration (JAX-NOTES.md)."""
    value, _ = lax.optimization_barrier((jnp.asarray(fill, dtype), tie))  # varies per iteration
    return jnp.broadcast_to(value, shape)


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                               recv_sizes, *, axis_name):
    """``lax.ragged_all_to_all``'s semantics from an all-gather, for tests on backends without
    it (XLA:CPU). It gathers every source's operand: a semantic stand-in, not a bounded one."""
    del recv_sizes  # implied by the senders' sizes
    me = lax.axis_index(axis_name)
    operands = lax.all_gather(operand, axis_name)  # [D, rows_in, ...]
    starts = lax.all_gather(output_offsets, axis_name)[:, me]  # [D] each source's landing
    sizes = lax.all_gather(send_sizes, axis_name)[:, me]
    sources = lax.all_gather(input_offsets, axis_name)[:, me]
    row = jnp.arange(output.shape[0])
    inside = (row >= starts[:, None]) & (row < (starts + sizes)[:, None])  # [D, rows_out]
    source = jnp.argmax(inside, axis=0)
    source_row = jnp.clip(sources[source] + row - starts[source], 0, operand.shape[0] - 1)
    values = operands[source, source_row]
    covered = inside.any(axis=0).reshape(-1, *([1] * (output.ndim - 1)))
    return jnp.where(covered, values, output)
