"""Which optax transformations may run per bucket, and how their state splits.

A streamed optimizer runs ``transformation.init`` / ``update`` on flat 1-D fp32 buckets instead of
the params' tree. That gives the tree's result exactly when the transformation is elementwise:
every per-parameter value it computes depends only on the same element of the gradients,
params and per-parameter state, and on scalars that depend on no element. The contract is
checked here by tracing ``init`` and ``update`` twice: on probe buckets of two lengths ``n``
(what the streamer runs), and on probe trees of 1-, 2- and 3-D leaves of two sets of sizes
(what the caller's tree would run: a transformation may treat a matrix unlike a vector, as
SM3's per-dimension accumulators and Adafactor's factored moments do, and be elementwise on a
bucket only). In both:

- every state leaf either has its parameter's shape at both sizes (per-parameter: streamed
  with the buckets) or the same shape at both (shared: counts, schedule state, kept on the
  device); a leaf shaped by one axis of a parameter (a row or column statistic) is neither;
- in the jaxprs (nested ones included), an operation that reads a parameter-shaped array
  writes only arrays of that shape (no reduction, reshape or product over it), is not one of
  the shape-keeping operations that mix elements (cumulative sums, sorts, gathers...), and a
  parameter-shaped array is made from scalars only by broadcasting (no iota, no random bits,
  no broadcast of a row or column);
- the state holds no ``optax.MaskedState`` / ``MultiTransformState``: a mask or a partition
  is a function of the params' tree, which a bucket does not have.

The rules imply that the shared state's new value depends on no element, so one copy serves
every bucket. What the trace cannot see is left to the contract: a transformation must not use
the bucket's length as a number (e.g. a mean written as ``sum / x.size`` is caught by its sum,
but a constant derived from ``x.size`` alone is not).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax

# Two probe lengths that no optax transformation would use as a constant of its own.
_PROBE_LENGTHS = (1031, 1033)
# Two probe trees: a vector, a matrix and a 3-D leaf whose sizes differ from each other's and
# between the two (so that a shape says which leaf and axis it came from); the matrix dims are
# above 128, where Adafactor starts to factor.
_PROBE_TREES = ({"vector": (1031,), "matrix": (131, 137), "cube": (3, 139, 149)},
                {"vector": (1033,), "matrix": (151, 157), "cube": (5, 163, 167)})

# Operations that keep an (n,) shape but mix elements.
_MIXING_PRIMITIVES = frozenset({
    "cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp", "sort", "rev", "gather", "scatter",
    "scatter-add", "scatter_add", "scatter-mul", "scatter_mul", "scatter-min", "scatter-max",
    "dynamic_slice", "dynamic_update_slice", "argsort", "top_k", "fft", "dot_general",
    "conv_general_dilated", "reduce_window", "select_and_scatter_add", "all_gather", "psum",
    "all_to_all", "ppermute", "reduce_scatter"})


@dataclasses.dataclass(frozen=True)
class StateSplit:
    """How a transformation's state splits: its treedef, which leaves are per-parameter, and the
    dtypes of the per-parameter leaves (hashable: part of a streamed state's layout)."""

    treedef: Any
    per_param: tuple[bool, ...]
    per_param_dtypes: tuple[Any, ...]

    @property
    def bytes_per_param(self) -> int:
        """Host bytes per parameter of the per-parameter state (the fp32 master not included)."""
        return sum(jnp.dtype(dtype).itemsize for dtype in self.per_param_dtypes)

    def split(self, state) -> tuple[tuple, tuple]:
        """(per-parameter leaves, shared leaves) of a state of this structure."""
        leaves, treedef = jax.tree.flatten(state)
        if treedef != self.treedef:
            raise ValueError(f"transformation: its state changed structure, from "
                             f"{self.treedef} to {treedef}")
        return (tuple(x for x, p in zip(leaves, self.per_param) if p),
                tuple(x for x, p in zip(leaves, self.per_param) if not p))

    def join(self, per_param, shared):
        """The state of this structure from its per-parameter and shared leaves."""
        per_param, shared = iter(per_param), iter(shared)
        return jax.tree.unflatten(self.treedef, [next(per_param) if p else next(shared)
                                                 for p in self.per_param])


def split_state(transformation: optax.GradientTransformation) -> StateSplit:
    """The transformation's state split, after checking that it is elementwise (module doc);
    raises ValueError naming ``transformation`` otherwise."""
    if not (hasattr(transformation, "init") and hasattr(transformation, "update")):
        raise ValueError(f"transformation: expected an optax GradientTransformation, got "
                         f"{type(transformation).__name__}")
    probes = [jax.ShapeDtypeStruct((n,), jnp.float32) for n in _PROBE_LENGTHS]
    try:
        states = [jax.eval_shape(transformation.init, probe) for probe in probes]
    except Exception as error:  # noqa: BLE001 - any failure means it cannot run on a bucket
        raise ValueError(f"transformation: its init does not run on a flat fp32 bucket: "
                         f"{error}") from error
    _refuse_tree_dependent(states[0])
    (leaves_a, treedef), (leaves_b, treedef_b) = (jax.tree.flatten(s) for s in states)
    if treedef != treedef_b:
        raise ValueError("transformation: its state's structure depends on the bucket length: "
                         "not elementwise")
    per_param = []
    for a, b in zip(leaves_a, leaves_b):
        if a.shape == (_PROBE_LENGTHS[0],) and b.shape == (_PROBE_LENGTHS[1],):
            per_param.append(True)
        elif a.shape == b.shape:
            per_param.append(False)
        else:
            raise ValueError(f"transformation: a state leaf of shape {a.shape} at bucket length "
                             f"{_PROBE_LENGTHS[0]} is neither per-parameter nor shared")
    split = StateSplit(treedef, tuple(per_param),
                       tuple(jnp.dtype(a.dtype) for a, p in zip(leaves_a, per_param) if p))

    length = _PROBE_LENGTHS[0]

    def update(grads, state, params):
        updates, state = transformation.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    zeros = jnp.zeros((length,), jnp.float32)
    bucket = frozenset({(length,)})
    _check_jaxpr(jax.make_jaxpr(transformation.init)(zeros).jaxpr, bucket, "init")
    abstract_state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), states[0])
    _check_jaxpr(_update_jaxpr(update, probes[0], abstract_state), bucket, "update")
    _check_on_trees(transformation, update)
    return split


def _check_on_trees(transformation, update) -> None:
    """The contract on probe trees of vectors, matrices and 3-D leaves (module doc): the
    state's leaves per-parameter or shared, the init and update elementwise."""
    trees = [{key: jax.ShapeDtypeStruct(shape, jnp.float32) for key, shape in probe.items()}
             for probe in _PROBE_TREES]
    try:
        states = [jax.eval_shape(transformation.init, tree) for tree in trees]
    except Exception as error:  # noqa: BLE001 - any failure means it cannot run on a tree
        raise ValueError(f"transformation: its init does not run on a tree of fp32 leaves: "
                         f"{error}") from error
    (leaves_a, treedef), (leaves_b, treedef_b) = (jax.tree.flatten(s) for s in states)
    if treedef != treedef_b:
        raise ValueError("transformation: its state's structure depends on the parameters' "
                         "shapes: not elementwise")
    shapes_a, shapes_b = (list(probe.values()) for probe in _PROBE_TREES)
    for a, b in zip(leaves_a, leaves_b):
        per_param = any(a.shape == sa and b.shape == sb for sa, sb in zip(shapes_a, shapes_b))
        if not per_param and a.shape != b.shape:
            raise ValueError(
                f"transformation: a state leaf of shape {a.shape} for parameters of shapes "
                f"{shapes_a} is neither a parameter's shape nor independent of them: "
                f"per-axis statistics (as SM3's or Adafactor's) are not elementwise")
    param_shapes = frozenset(shapes_a)
    _check_jaxpr(jax.make_jaxpr(transformation.init)(trees[0]).jaxpr, param_shapes, "init")
    _check_jaxpr(_update_jaxpr(update, trees[0], states[0]), param_shapes, "update")


def _update_jaxpr(update, params, state):
    """The jaxpr of ``update(grads, state, params)`` on probes; a ValueError naming
    ``transformation`` where it does not trace so (e.g. it needs the loss: ``value=``)."""
    try:
        return jax.make_jaxpr(update)(params, state, params).jaxpr
    except Exception as error:  # noqa: BLE001 - what the streamer's call would raise
        raise ValueError(f"transformation: its update does not run as update(grads, state, "
                         f"params), the streamer's call: {type(error).__name__}: "
                         f"{error}") from error


def _refuse_tree_dependent(state) -> None:
    tree_dependent = (optax.MaskedState, optax.MultiTransformState)
    nodes = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, tree_dependent))
    for node in nodes:
        if isinstance(node, tree_dependent):
            raise ValueError(f"transformation: its state holds a {type(node).__name__}: masks "
                             f"and partitions are functions of the params' tree, which a bucket "
                             f"does not have; apply it outside the streamed optimizer")


def _nested_jaxprs(eqn):
    for value in eqn.params.values():
        for sub in value if isinstance(value, (list, tuple)) else [value]:
            inner = getattr(sub, "jaxpr", sub)
            if hasattr(inner, "eqns"):
                yield inner


def _check_jaxpr(jaxpr, param_shapes: frozenset, what: str) -> None:
    """Refuses an operation of ``jaxpr`` (nested jaxprs included) that mixes the elements of an
    array of one of ``param_shapes`` or makes one from anything but a scalar (module doc)."""
    for eqn in jaxpr.eqns:
        nested = list(_nested_jaxprs(eqn))
        if nested:  # a call (jit, custom_jvp, cond...): its body is checked instead
            for inner in nested:
                _check_jaxpr(inner, param_shapes, what)
            continue
        reads = {getattr(v.aval, "shape", None) for v in eqn.invars} & param_shapes
        writes = [getattr(v.aval, "shape", None) for v in eqn.outvars]
        name = eqn.primitive.name
        if reads and (len(reads) > 1 or any(shape not in reads for shape in writes)
                      or name in _MIXING_PRIMITIVES):
            raise ValueError(
                f"transformation: its {what} is not elementwise: {name} maps a parameter "
                f"of shape {sorted(reads)[0]} to {writes}. Global-norm clipping goes to "
                f"max_grad_norm; other transformations that mix parameters cannot be "
                f"streamed per bucket")
        from_scalars = name == "broadcast_in_dim" and all(
            getattr(v.aval, "shape", None) == () for v in eqn.invars)
        if not reads and param_shapes & set(writes) and not from_scalars:
            raise ValueError(f"transformation: its {what} is not elementwise: {name} makes "
                             f"per-parameter values that depend on their position")
