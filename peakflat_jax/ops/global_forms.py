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

The mesh's axes may be of type Auto (``jax.make_mesh(..., axis_types=(AxisType.Auto,) * n)``)
or Explicit (``jax.make_mesh``'s default): on Explicit axes the operands are first resharded to
the layout the operator takes (``jax.reshard``), which a shard_map over Explicit axes requires.
The mesh is ``mesh`` or, when None, the one set by ``jax.set_mesh``.

Every call runs as a jitted program, inside the caller's jit or not: the operators' shard_map
bodies (scans of collectives and dynamic slices) are what XLA compiles, never op-by-op eager
dispatch, which crashed XLA:CPU in the MoE's chunk loop (jax 0.11.2). Called eagerly, the
jitted program is cached by its static arguments (mesh, axes, options), so a second call with
the same shapes does not compile again.

Checks on concrete (not traced) inputs, before anything runs: targets outside
``[0, vocab_size)`` that are not ``ignore_index``, and expert ids outside
``[0, num_experts)``, raise a ValueError (under the caller's jit they cannot be seen: an
out-of-range target gives a NaN loss, the per-shard contract). The loss forms pad a kernel
whose columns the devices do not divide with zero columns, which never enter the softmax
(``vocab_size`` is the true V; default the kernel's columns); the padding's gradient is
dropped.

Legend: T tokens in all (split over the axes), H hidden, k top-k, E experts (split over the axes),
F expert FFN width, V' padded vocab (split over the axes), P the product of the axes' sizes.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from peakflat_jax import reference
from peakflat_jax.ops.pipelined_moe import pipelined_moe
from peakflat_jax.ops.ring_cross_entropy import ring_cross_entropy


def pipelined_moe_global(x: jax.Array, expert_ids: jax.Array, gates: jax.Array,
                         w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array, *,
                         mesh: Mesh | None = None, axis_name: Any, num_experts: int,
                         expert_biases: tuple | None = None, **options) -> jax.Array:
    """``pf.pipelined_moe`` on global arrays: tokens (x, expert_ids, gates) split over
    ``axis_name`` along their first dimension, experts (the weights' first dimension, and the
    ``expert_biases``' [E, F], [E, F], [E, H]) split over it too. ``options``: pipelined_moe's
    other keywords (token_budget, balance, activation, ...)."""
    mesh, axes, size = _mesh_axes(mesh, axis_name)
    for name, array in (("x", x), ("w_gate", w_gate)):
        _check_divides(name, array, size, axes, "tokens" if name == "x" else "experts")
    if _is_concrete(expert_ids):
        ids = np.asarray(expert_ids)
        bad = (ids < 0) | (ids >= num_experts)
        if bad.any():
            raise ValueError(f"expert_ids: expected ids in [0, num_experts = {num_experts}), "
                             f"got {ids[bad].flat[0]}")
    options = {"axis_name": axes, "num_experts": num_experts, **options}
    split = P(axes)
    args = (x, expert_ids, gates, w_gate, w_up, w_down, *(expert_biases or ()))
    per_shard = pipelined_moe if expert_biases is None else _pipelined_moe_with_biases
    return _run(per_shard, mesh, (split,) * len(args), split, options, args)


def _pipelined_moe_with_biases(x, expert_ids, gates, w_gate, w_up, w_down, b_gate, b_up,
                               b_down, **options):
    """``pipelined_moe`` with the biases as positional operands (the shard_map's)."""
    return pipelined_moe(x, expert_ids, gates, w_gate, w_up, w_down,
                         expert_biases=(b_gate, b_up, b_down), **options)


def ring_cross_entropy_global(hidden: jax.Array, kernel: jax.Array, targets: jax.Array, *,
                              mesh: Mesh | None = None, axis_name: Any,
                              **options) -> jax.Array:
    """``pf.ring_cross_entropy`` on global arrays: hidden and targets split over ``axis_name``
    along the tokens, the kernel along its vocab columns (position r holds columns r Vs ...;
    padded here to a multiple of P where needed). With ``reduction="mean"`` or ``"sum"`` the
    result is one replicated scalar."""
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
    mesh, axes, size = _mesh_axes(mesh, axis_name)
    _check_divides("hidden", hidden, size, axes, "tokens")
    if kernel.ndim != 2:
        raise ValueError(f"kernel: expected an [H, V'] array, got {list(kernel.shape)}")
    columns = kernel.shape[1]
    vocab_size = options.get("vocab_size")
    vocab_size = columns if vocab_size is None else vocab_size
    if not isinstance(vocab_size, int | np.integer) or not 1 <= vocab_size <= columns:
        raise ValueError(f"vocab_size: expected an int in [1, the kernel's columns = "
                         f"{columns}], got {vocab_size!r}")
    ignore_index = options.get("ignore_index", -100)
    if _is_concrete(targets):
        ids = np.asarray(targets)
        bad = (ids != ignore_index) & ((ids < 0) | (ids >= vocab_size))
        if bad.any():
            raise ValueError(f"targets: expected ids in [0, vocab_size = {vocab_size}) or "
                             f"ignore_index = {ignore_index}, got {ids[bad].flat[0]} (its "
                             f"loss would be NaN)")
    padded = -(-columns // size) * size
    if padded != columns:  # zero columns past vocab_size: never in the softmax
        kernel = jnp.pad(kernel, ((0, 0), (0, padded - columns)))
    options = {**options, "axis_name": axes, "vocab_size": int(vocab_size)}
    reduced = options.get("reduction", "none") != "none"
    return _run(per_shard, mesh, (P(axes), P(None, axes), P(axes)),
                P() if reduced else P(axes), options, (hidden, kernel, targets))


# ----------------------------------------------------------------------------------------------
# The mesh, the checks and the jitted shard_map.


def _mesh_axes(mesh, axis_name) -> tuple[Mesh | None, tuple, int]:
    """(mesh, the axes as a tuple, P): ValueErrors naming ``mesh`` or ``axis_name``."""
    axes = tuple(axis_name) if isinstance(axis_name, tuple | list) else (axis_name,)
    described = mesh if mesh is not None else jax.sharding.get_abstract_mesh()
    if mesh is not None and not isinstance(mesh, Mesh):
        raise ValueError(f"mesh: expected a jax.sharding.Mesh, got {type(mesh).__name__}")
    if described.empty:
        raise ValueError("mesh: expected a jax.sharding.Mesh, or one set with jax.set_mesh; "
                         "got None outside any mesh")
    types = dict(zip(described.axis_names, described.axis_types))
    for axis in axes:
        if axis not in types:
            raise ValueError(f"axis_name: {axis!r} is not an axis of the mesh "
                             f"{tuple(described.axis_names)}")
        if types[axis] == AxisType.Manual:
            raise ValueError(f"axis_name: {axis!r} is Manual here (inside a shard_map): call "
                             f"the per-shard operator there instead of the global form")
    return mesh, axes, math.prod(described.shape[axis] for axis in axes)


def _check_divides(name: str, array, size: int, axes: tuple, what: str) -> None:
    if array.ndim == 0 or array.shape[0] % size:
        raise ValueError(f"{name}: expected the {what} (first dimension) to be a multiple of "
                         f"P = {size}, the devices of axis_name {axes}; got shape "
                         f"{list(array.shape)}")


def _is_concrete(array) -> bool:
    return not isinstance(array, jax.core.Tracer)


def _run(per_shard, mesh, in_specs, out_specs, options: dict, args):
    """``per_shard(*args, **options)`` in a shard_map over ``mesh``, as a jitted program (the
    module doc says why), operands on Explicit axes resharded first."""
    described = mesh if mesh is not None else jax.sharding.get_abstract_mesh()
    explicit = {axis for axis, kind in zip(described.axis_names, described.axis_types)
                if kind == AxisType.Explicit}
    if explicit:  # shard_map over Explicit axes takes operands laid out as its in_specs
        args = tuple(_reshard(a, spec, mesh, explicit) for a, spec in zip(args, in_specs))
    try:
        key = tuple(sorted(options.items()))
        hash(key)
    except TypeError:  # an unhashable option: a program of its own
        return _jitted(per_shard, mesh, in_specs, out_specs, options)(*args)
    return _cached_program(per_shard, mesh, in_specs, out_specs, key)(*args)


@functools.lru_cache(maxsize=64)
def _cached_program(per_shard, mesh, in_specs, out_specs, options: tuple):
    return _jitted(per_shard, mesh, in_specs, out_specs, dict(options))


def _jitted(per_shard, mesh, in_specs, out_specs, options: dict):
    def local(*shards):
        return per_shard(*shards, **options)

    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_specs))


def _reshard(array, spec, mesh, explicit: set):
    """``array`` laid out as ``spec`` over the mesh's Explicit axes (Auto axes are shard_map's
    to place)."""
    kept = P(*(_keep(entry, explicit) for entry in spec))
    return jax.reshard(array, kept if mesh is None else NamedSharding(mesh, kept))


def _keep(entry, explicit: set):
    if entry is None:
        return None
    names = tuple(n for n in (entry if isinstance(entry, tuple) else (entry,)) if n in explicit)
    return names or None
