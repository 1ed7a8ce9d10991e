"""Helpers for per-shard functions that run inside ``jax.shard_map``."""

from __future__ import annotations

import jax
from jax import lax


def varying_axes(a: jax.Array) -> frozenset:
    """The mesh axes over which ``a`` varies (empty outside shard_map or without vma checks)."""
    return getattr(getattr(jax.typeof(a), "manual_axis_type", None), "varying", frozenset())


def vary_alike(*arrays):
    """Makes all operands vary over the same mesh axes (the union of theirs).

    Loop carries must match their updates' varying axes, and inside a custom VJP the cotangent
    of, say, a kernel replicated over a data axis must not vary over that axis: casting first
    lets autodiff insert the psum it needs.
    """
    union = frozenset().union(*map(varying_axes, arrays))
    return tuple(
        lax.pcast(a, tuple(sorted(union - varying_axes(a))), to="varying")
        if union - varying_axes(a) else a
        for a in arrays
    )
