"""Experimental: the token-slot exchange over ``lax.ragged_all_to_all``, which sends only the rows
that exist. Same interface and semantics as ``expert_exchange.PaddedExchange`` (an ``Exchange``);
ask for it with ``pipelined_moe(..., backend=MoEBackend(exchange="ragged"))``.

Each source sorts its slots by destination and sends each destination its rows end to end; each
receiver lays its sources' rows end to end in a buffer of the worst case, D * S rows. The
per-chunk send counts are all-gathered ([D, D] int32), so that every sender knows where its rows
land. Buffers per device: S rows sent and D * S received going out, D * S sent and S received
coming back: (D + 1) * S rows each way instead of the padded form's 2 * D * S.

``send`` and ``combine`` are each other's transposes, stated as custom VJPs, so the backward is
the same two ragged all-to-alls and keeps the same bound. Why custom VJPs: jax's own transpose of
``ragged_all_to_all`` gave wrong gradients on GPUs. Why the casts to "varying": the collective's
result has the type of its output buffer, a fresh constant, invariant over the expert axis,
while its values vary; the custom VJPs type their results like their operands.

Why it is not the default: in jax 0.11.2 the GPU lowering of ``ragged_all_to_all`` is far slower
than the padded all-to-all, and XLA's decomposer moves the padded bytes anyway
(docs/pipelined_moe.md, "The exchanges"). XLA:CPU has no ragged all-to-all: the CPU tests pass an
emulation (``RaggedExchange(all_to_all=...)``; tests/ragged_emulation.py).

Legend: D devices of the expert-parallel axis, S token-slots of one chunk from one source.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from peakflat_jax.ops._shard import varying_like, varying_over


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RaggedRoutes:
    """Where one chunk's slots go and where they land, for both directions."""

    order: jax.Array            # [S] slots sorted by destination (not-sent slots last)
    send_offsets: jax.Array     # [D] start of each destination's rows in the sorted slots
    send_sizes: jax.Array       # [D] rows to each destination
    landing_offsets: jax.Array  # [D] where this source's rows start in each receiver's buffer
    recv_offsets: jax.Array     # [D] where each source's rows start in this device's buffer
    recv_sizes: jax.Array       # [D] rows from each source
    home_offsets: jax.Array     # [D] where each source's rows sit in that source's sorted slots

    @property
    def num_slots(self) -> int:
        return self.order.shape[0]

    @property
    def num_devices(self) -> int:
        return self.send_sizes.shape[0]


@dataclasses.dataclass(frozen=True)
class RaggedExchange:
    """The exchange over a ragged all-to-all (module doc). ``all_to_all``: a function with
    ``lax.ragged_all_to_all``'s signature and semantics (tests pass an emulation)."""

    all_to_all: Callable = lax.ragged_all_to_all

    def routes(self, destination: jax.Array, num_devices: int, axis_name: Any) -> RaggedRoutes:
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

    def send(self, rows: jax.Array, routes: RaggedRoutes, axis_name: Any, fill=0) -> jax.Array:
        return _send(self.all_to_all, axis_name, fill, varying_over(rows, axis_name), routes)

    def combine(self, processed: jax.Array, routes: RaggedRoutes, axis_name: Any) -> jax.Array:
        return _combine(self.all_to_all, axis_name, varying_over(processed, axis_name), routes)


# The two directions are each other's transposes, stated directly (module doc). Rows of the
# received buffer that no source filled are constants, so they get no cotangent. The custom VJPs
# take operands that vary over the exchange's axis (the methods cast them; for an operand that
# did not, the cast's transpose psums its cotangent) and type their results like the operand.


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _send(all_to_all, axis_name, fill, rows, routes):
    sorted_rows = rows[routes.order]
    output = _fresh_buffer((routes.num_devices * rows.shape[0], *rows.shape[1:]), rows.dtype,
                           fill, routes.recv_sizes)
    received = all_to_all(sorted_rows, output, routes.send_offsets, routes.send_sizes,
                          routes.landing_offsets, routes.recv_sizes, axis_name=axis_name)
    return varying_like(received, rows)


def _send_fwd(all_to_all, axis_name, fill, rows, routes):
    return _send(all_to_all, axis_name, fill, rows, routes), routes


def _send_bwd(all_to_all, axis_name, fill, routes, d_received):
    return _combine(all_to_all, axis_name, d_received, routes), None


_send.defvjp(_send_fwd, _send_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _combine(all_to_all, axis_name, processed, routes):
    output = _fresh_buffer((routes.num_slots, *processed.shape[1:]), processed.dtype, 0,
                           routes.send_sizes)
    sorted_out = all_to_all(processed, output, routes.recv_offsets, routes.recv_sizes,
                            routes.home_offsets, routes.send_sizes, axis_name=axis_name)
    sorted_out = varying_like(sorted_out, processed)
    return jnp.zeros_like(sorted_out).at[routes.order].set(sorted_out)


def _combine_fwd(all_to_all, axis_name, processed, routes):
    return _combine(all_to_all, axis_name, processed, routes), routes


def _combine_bwd(all_to_all, axis_name, routes, d_slots):
    return _send(all_to_all, axis_name, 0, d_slots, routes), None


_combine.defvjp(_combine_fwd, _combine_bwd)


def _fresh_buffer(shape, dtype, fill, tie):
    """A ``fill``-ed output buffer tied to ``tie`` (this chunk's routes, not the rows, which
    must stay linear for the transpose): a constant buffer inside a scan can be hoisted out of
    the loop and copied in every iteration."""
    value, _ = lax.optimization_barrier((jnp.asarray(fill, dtype), tie))  # varies per iteration
    return jnp.broadcast_to(value, shape)
