"""Small helpers shared by the tests."""

from __future__ import annotations

import importlib.util
import pathlib
from collections.abc import Iterator
from types import ModuleType

import numpy as np

SCRIPTS = pathlib.Path(__file__).resolve().parents[1] / "scripts"


def load_script(name: str) -> ModuleType:
    """``scripts/NAME.py`` imported as a module (the scripts are no package)."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def relative_error(actual, expected) -> float:
    """``|actual - expected| / |expected|`` in float64 (Frobenius norms over all elements)."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))


def optimizer_state_values(state) -> list:
    """An ``OffloadStreamState``'s values as numpy arrays, group by group and bucket by bucket
    (a stacked block's groups read row by row), then its shared state: what two states of
    different layouts (stacked or not, another residency) are compared by."""
    import jax

    values = []
    for index in range(len(state.layout.groups)):
        group = state.group(index)
        take = (lambda a: np.asarray(jax.device_get(a))) if group.row is None else (
            lambda a, row=group.row: np.asarray(jax.device_get(a))[row])
        values.append([take(a) for a in jax.tree.leaves((group.master, group.streamed))])
    values.append([np.asarray(jax.device_get(a)) for a in state.shared])
    return values


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
