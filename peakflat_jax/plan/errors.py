"""The planner's errors, and ``GIB``."""

from __future__ import annotations

GIB = 2**30


class PlanError(ValueError):
    """An argument the planner cannot plan for, named in the message."""


class DoesNotFit(RuntimeError):
    """A configuration whose step needs more device or host memory than there is; the message
    says by how much, the largest term, and what to change."""
