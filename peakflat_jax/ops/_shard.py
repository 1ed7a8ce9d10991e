"""Helpers for per-shard functions that run inside ``jax.shard_map``."""

from __future__ import annotations

import jax
from jax import lax


def varying_axes(a: jax.Array) -> frozenset:
    """The mesh axes over which ``a`` varies (empty outside shard_map or without vma checks)."""
    return getattr(getattr(jax.typeof(a), "manual_axis_type", None), "varying", frozenset())


def varying_over(value: jax.Array, axes) -> jax.Array:
    """``value`` cast to vary over the mesh axes ``axes`` (a name or names) as well as its own
    (the type changes, not the values; the cast's transpose is a psum)."""
    axes = {axes} if isinstance(axes, str) else set(axes)
    missing = axes - varying_axes(value)
    return lax.pcast(value, tuple(sorted(missing)), to="varying") if missing else value


def varying_like(value: jax.Array, *like: jax.Array) -> jax.Array:
    """``value`` cast to vary over every mesh axis that any of ``like`` varies over.

    A ``pallas_call`` inside ``shard_map`` (the Mosaic kernels) returns values typed invariant
    over the manual axes, whatever its operands; a custom VJP whose backward returned such a
    value for a varying input fails to trace.
    """
    return varying_over(value, frozenset().union(*map(varying_axes, like)))


def vary_alike(*arrays):
    """Makes all operands vary over the same mesh axes (the union of theirs).

    Loop carries must match their updates' varying axes, and inside a custom VJP the cotangent
    of, say, a kernel replicated over a data axis must not vary over that axis: casting first
    lets autodiff insert the psum it needs.
    """
    return tuple(varying_like(a, *arrays) for a in arrays)
