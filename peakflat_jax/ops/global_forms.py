"""The operators on global arrays, for jit users who never write a shard_map.

Each function takes global arrays whose token (or expert, or vocab) dimension is split over the
mesh axes ``axis_name`` (a name or a tuple of names, e.g. ``("data", "seq")``), runs the
per-shard operator inside ``jax.shard_map`` over those axes, and returns global arrays split the
same way. Values, gradients and memory bounds are those of the per-shard operator with P (or
E_p) = the product of the axes' sizes. Other mesh axes see replicated operands.

    pipelined_moe_global(x [T, H], expert_ids [T, k], gates [T, k],
                         w_gate [E, H, F], w_up [E, H, F], w_down [E, F, H], *, mesh, axis_name,
                         num_experts, ...) -> [T, H]
    ring_cross_entropy_global(hidden [T, H], kernel [H, V'], targets [T], *, mesh, axis_name,
                              ...) -> [T] (or a scalar with a reduction)
    materialized_cross_entropy_global(...)   # the standard loss, same contract (the baseline)

Legend: T tokens in all (split over the axes), H hidden, k top-k, E experts (split over the axes),
F expert FFN width, V' padded vocab (split over the axes).
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from peakflat_jax import reference
from peakflat_jax.ops.pipelined_moe import pipelined_moe
from peakflat_jax.ops.ring_cross_entropy import ring_cross_entropy


def _axes(axis_name) -> tuple:
    return tuple(axis_name) if isinstance(axis_name, tuple | list) else (axis_name,)


def pipelined_moe_global(x: jax.Array, expert_ids: jax.Array, gates: jax.Array,
                         w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array, *,
                         mesh: Mesh | None = None, axis_name: Any, num_experts: int,
                         **options) -> jax.Array:
    """``pf.pipelined_moe`` on global arrays: tokens (x, expert_ids, gates) split over
    ``axis_name`` along their first dimension, experts (the weights' first dimension) split
    over it too. ``options``: pipelined_moe's keywords (token_budget, balance, ...)."""
    axes = _axes(axis_name)
    split = P(axes)

    def local(x, ids, g, wg, wu, wd):
        return pipelined_moe(x, ids, g, wg, wu, wd, axis_name=axes, num_experts=num_experts,
                             **options)

    return jax.shard_map(local, mesh=mesh, in_specs=(split,) * 6, out_specs=split)(
        x, expert_ids, gates, w_gate, w_up, w_down)


def ring_cross_entropy_global(hidden: jax.Array, kernel: jax.Array, targets: jax.Array, *,
                              mesh: Mesh | None = None, axis_name: Any,
                              **options) -> jax.Array:
    """``pf.ring_cross_entropy`` on global arrays: hidden and targets split over ``axis_name``
    along the tokens, the kernel along its vocab columns (position r holds columns r Vs ...).
    With ``reduction="mean"`` or ``"sum"`` the result is one replicated scalar."""
    return _loss_on_mesh(ring_cross_entropy, hidden, kernel, targets, mesh, axis_name, options)


def materialized_cross_entropy_global(hidden: jax.Array, kernel: jax.Array,
                                      targets: jax.Array, *, mesh: Mesh | None = None,
                                      axis_name: Any, **options) -> jax.Array:
    """The standard vocab-parallel loss on global arrays (the kernel all-gathered, the N x V
    logits materialized: ``reference.materialized_cross_entropy``), same contract as
    ``ring_cross_entropy_global``: the baseline it is measured against."""
    return _loss_on_mesh(reference.materialized_cross_entropy, hidden, kernel, targets, mesh,
                         axis_name, options)


def _loss_on_mesh(per_shard, hidden, kernel, targets, mesh, axis_name, options):
    axes = _axes(axis_name)
    reduced = options.get("reduction", "none") != "none"

    def local(h, w, t):
        return per_shard(h, w, t, axis_name=axes, **options)

    return jax.shard_map(local, mesh=mesh, in_specs=(P(axes), P(None, axes), P(axes)),
                         out_specs=P() if reduced else P(axes))(hidden, kernel, targets)
