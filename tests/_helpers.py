"""Small helpers shared by the tests."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np


def relative_error(actual, expected) -> float:
    """``|actual - expected| / |expected|`` in float64 (Frobenius norms over all elements)."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))


def iter_jaxprs(jaxpr) -> Iterator:
    """A jaxpr and every jaxpr nested in it (scan, cond, custom_vjp, shard_map bodies...)."""
    yield jaxpr
    for eqn in jaxpr.eqns:
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else [value]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from iter_jaxprs(inner)


def iter_eqns(jaxpr, primitive: str | None = None) -> Iterator:
    """Every equation of a jaxpr in program order, each followed by those of the jaxprs nested
    in it; only ``primitive``'s if given."""
    for eqn in jaxpr.eqns:
        if primitive is None or eqn.primitive.name == primitive:
            yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else [value]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from iter_eqns(inner, primitive)
