"""``peakflat xcheck``: evidence that the JAX operators and model compute what the standard
PyTorch implementations compute, on the user's shapes.

``export.py`` (the JAX side) writes fresh inputs, outputs and gradients with a manifest;
``torch_side.py`` (standalone: torch and numpy only) recomputes them in PyTorch and compares;
``run.py`` runs both where one Python has jax and torch. docs/xcheck.md says what is compared,
how, and to what tolerance.
"""
