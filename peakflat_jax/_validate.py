"""Argument checks shared by the operators: clear errors that name the argument."""

from __future__ import annotations

import math
import numbers
import operator


def as_int(name: str, value) -> int:
    """An int from an int-like (numpy ints too); bools and floats are errors, not 1 or 0."""
    if isinstance(value, bool):
        raise ValueError(f"{name}: expected an int, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{name}: expected an int, got {value!r}") from None


def as_positive_float(name: str, value) -> float:
    """A finite positive float."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (
            math.isfinite(value) and value > 0):
        raise ValueError(f"{name}: expected a finite positive number, got {value!r}")
    return float(value)
