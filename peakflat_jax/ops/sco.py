"""SCO: a layer scan whose checkpoint boundaries go to host memory and come back one layer ahead.

``sco_scan(layer_fn, h, stacked_params, offload=...)`` computes the same values and gradients
as ``lax.scan`` over ``jax.checkpoint(layer_fn)``: each layer is rematerialized in backward from
its input h_l (the checkpoint boundary). The boundaries chosen by ``offload`` are sent to pinned
host memory as soon as they exist, and the device copy is freed once layer l has used it.
Backward walks the layers in reverse. While layer l recomputes and differentiates, h_(l-1) is
already coming back.

Memory (per device): the boundaries not offloaded, plus at most 2 restored ones, plus one
layer's rematerialized intermediates:

    (L - n_offloaded + 2) * N * H * b + one layer's activations

Why the copies can overlap compute: XLA overlaps host copies in straight-line code but not
across while-loop iterations (JAX-NOTES.md: a scan emitting boundaries to host ran compute +
copies serially; unrolled layers ran at link speed). So the layers are unrolled in Python and
the transfers are placed explicitly, in forward and in backward; XLA's scheduler is otherwise
free, and three optimization barriers keep it from undoing the bound (each was missing once,
and an H200 showed what XLA did without it):

- forward: boundary l's device-to-host copy is tied to layer l's output, so it runs while
  layer l computes and is done before layer l + 1 starts. Untied, XLA sank every copy into the
  backward pass and kept all boundaries on the device until then;
- backward: the restore of h_(l-1) is issued when layer l's backward starts, not earlier
  (which would hold every boundary on the device at once);
- backward: layer l's recompute waits for the whole backward of layer l + 1, its parameter
  gradients included. Untied, XLA deferred weight-gradient matmuls and kept several layers'
  activations alive: 24 layers of N = 65,536, H = 4096 asked for 114 GiB with 12 boundaries
  offloaded, against a 43.3 GiB peak for the checkpointed scan.

Two more ties keep XLA from holding all L layers' parameter copies (see _sco_scan_fwd and
_sco_scan_bwd): each layer slices its parameters behind its input, and backward writes each
layer's parameter gradients in place into the stacked result. Without them, offloading all 24
boundaries lowered the peak no further than offloading 12 (sco_gpu_20261130-083730.json).

Measured on one H200 (scripts/results/sco_gpu_20261130-085007.json, commit 2ab9037), 24
layers of N = 65,536, H = 4096, bf16, boundaries of 0.54 GB: the checkpointed scan peaked at
43.26 GiB in 10.18 s. Offloading 12 boundaries (XLA's host temporaries: exactly 6.44 GB)
lowered the peak by 13.0 boundaries to 36.76 GiB, in 10.22 s (1.004x); offloading all 24
(12.88 GB on the host) lowered it by 23.3 boundaries to 31.63 GiB, in 10.23 s (1.005x). The
bound predicts falls of at least 10 and 22. On CPU the memory kinds lower to nothing, so tests
check values, the placement of transfers, the barriers' ties in the jaxpr, and that the
gradient's temporaries grow by one boundary per layer.

Legend: L layers, N tokens, H hidden, b bytes per element of h.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from peakflat_jax._validate import as_int


@dataclasses.dataclass(frozen=True)
class HostBudget:
    """Offload as many boundaries as fit in ``bytes`` of host memory, in forward order."""

    bytes: int

    def __post_init__(self):
        if isinstance(self.bytes, bool) or as_int("HostBudget.bytes", self.bytes) < 0:
            raise ValueError(f"HostBudget.bytes: expected a non-negative int, got {self.bytes!r}")


def host_memory_bytes() -> int:
    """Physical memory of this host (the ceiling for pinned host buffers)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def offload_plan(offload, num_layers: int, boundary_bytes: int) -> tuple[bool, ...]:
    """Which of the L boundaries go to host memory, checked against this host's memory.

    A pure function of static numbers, so every process makes the same choice (a mismatch
    would deadlock collectives) and a budget that cannot be met fails before any compute.
    """
    if isinstance(offload, HostBudget):
        count = min(num_layers, offload.bytes // boundary_bytes) if boundary_bytes else num_layers
        chosen = tuple(i < count for i in range(num_layers))
    elif isinstance(offload, bool):
        raise ValueError(f"offload: expected an int, a sequence of L={num_layers} bools or a "
                         f"HostBudget, got {offload!r}")
    elif isinstance(offload, Sequence | np.ndarray):
        if len(offload) != num_layers or not all(isinstance(x, bool | np.bool_)
                                                 for x in offload):
            raise ValueError(f"offload: expected {num_layers} bools (one per layer), got "
                             f"{offload!r}")
        chosen = tuple(bool(x) for x in offload)
    else:
        count = as_int("offload", offload)
        if not 0 <= count <= num_layers:
            raise ValueError(f"offload: expected a count in [0, L={num_layers}], got {count}")
        chosen = tuple(i < count for i in range(num_layers))
    needed = sum(chosen) * boundary_bytes
    available = host_memory_bytes()
    if needed > available:
        raise ValueError(f"offload: {sum(chosen)} boundaries need {needed:,} bytes of host "
                         f"memory, this host has {available:,}")
    return chosen


def sco_scan(layer_fn: Callable, h: jax.Array, stacked_params, *, offload) -> jax.Array:
    """``lax.scan`` of the checkpointed ``layer_fn(h, params_l) -> h`` over the leading layer
    axis of ``stacked_params``, with the boundaries chosen by ``offload`` kept in host memory.

    ``offload``: an int (the first n boundaries), a sequence of L bools, or ``HostBudget(bytes)``
    (as many as fit, in forward order). ``layer_fn`` must return an array shaped like ``h`` and
    must not close over arrays that need gradients (pass them in ``stacked_params``).

    Limits: reverse mode only (a custom VJP: ``jax.jvp`` and ``jacfwd`` raise); under
    ``jax.vmap`` a HostBudget counts the bytes of one example's boundary. Inside an enclosing
    ``jax.checkpoint`` the forward runs twice (first pass and replay) and each run copies the
    boundaries to host: the barriers that order the copies keep XLA from dropping the first
    run's, which nothing reads.
    """
    leaves = jax.tree.leaves(stacked_params)
    if not leaves:
        raise ValueError("stacked_params: expected at least one array with a leading layer axis")
    num_layers = leaves[0].shape[0]
    if any(leaf.ndim < 1 or leaf.shape[0] != num_layers for leaf in leaves):
        raise ValueError(f"stacked_params: every leaf needs the same leading layer axis, got "
                         f"{[leaf.shape for leaf in leaves]}")
    chosen = offload_plan(offload, num_layers, math.prod(h.shape) * h.dtype.itemsize)
    if num_layers == 0:
        return h
    out = jax.eval_shape(layer_fn, h, _layer_params(stacked_params, 0))
    if not isinstance(out, jax.ShapeDtypeStruct) or (out.shape, out.dtype) != (h.shape, h.dtype):
        raise ValueError(f"layer_fn: expected it to return an array like h "
                         f"({h.dtype}{list(h.shape)}), got {out}")
    return _sco_scan(layer_fn, chosen, h, stacked_params)


def _layer_params(stacked_params, layer: int):
    return jax.tree.map(lambda leaf: leaf[layer], stacked_params)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _sco_scan(layer_fn, chosen, h, stacked_params):
    # Without differentiation nothing reads the boundaries again: no copies, no barriers.
    for layer in range(len(chosen)):
        h = layer_fn(h, _layer_params(stacked_params, layer))
    return h


def _sco_scan_fwd(layer_fn, chosen, h, stacked_params):
    boundaries = []
    for layer, to_host in enumerate(chosen):
        # Layer l slices its parameters once its input exists. Otherwise the slices, which
        # depend on nothing but the parameters, are free to run early, and XLA kept every
        # layer's slice alive from forward to backward (XLA:CPU: one layer's parameters of
        # temporaries per layer).
        h, params = lax.optimization_barrier((h, stacked_params))
        h_next = layer_fn(h, _layer_params(params, layer))
        if to_host:
            # The copy runs while this layer computes and must be done before the next layer
            # starts. Untied, XLA's scheduler sank every device-to-host copy into the backward
            # pass, keeping all boundaries on the device until then (H200: +61 GB).
            boundary, h_next = lax.optimization_barrier(
                (jax.device_put(h, jax.memory.Space.Host), h_next))
        else:
            boundary = h
        boundaries.append(boundary)
        h = h_next
    return h, (tuple(boundaries), stacked_params)


def _sco_scan_bwd(layer_fn, chosen, residuals, d_h):
    boundaries, stacked_params = residuals
    num_layers = len(chosen)

    def restore(layer, after):
        """Boundary ``layer`` on the device, its copy issued once ``after`` exists."""
        boundary, _ = lax.optimization_barrier((boundaries[layer], after))
        return jax.device_put(boundary, jax.memory.Space.Device) if chosen[layer] else boundary

    # Each layer's parameter gradients are written in place into the stacked result, and the
    # layer slices its parameters only after the barrier below. Stacking per-layer gradients
    # at the end, or slicing before the barrier, let XLA keep all L layers' copies alive:
    # one layer's parameters of temporaries per layer (XLA:CPU, each fix alone not enough).
    # Integer leaves (token ids, say) have float0 cotangents: nothing to write.
    leaves, treedef = jax.tree.flatten(stacked_params)
    inexact = [i for i, leaf in enumerate(leaves) if jnp.issubdtype(leaf.dtype, jnp.inexact)]
    d_stacked = [jnp.zeros_like(leaves[i]) for i in inexact]
    incoming = restore(num_layers - 1, d_h)
    for layer in reversed(range(num_layers)):
        # Layer l's recompute waits for all of layer l + 1's backward: its input cotangent and
        # its parameter gradients. Untied, XLA deferred each layer's weight-gradient matmuls to
        # the end and kept their inputs, several layers' activations, alive (H200: the plan
        # grew by gigabytes per layer).
        h_in, d_h, d_stacked, params = lax.optimization_barrier(
            (incoming, d_h, d_stacked, stacked_params))
        if layer > 0:
            incoming = restore(layer - 1, d_h)  # overlaps this layer's recompute and backward
        _, vjp = jax.vjp(layer_fn, h_in, _layer_params(params, layer))
        d_h, d_layer = vjp(d_h)
        d_layer = treedef.flatten_up_to(d_layer)
        d_stacked = [stack.at[layer].set(d_layer[i]) for stack, i in zip(d_stacked, inexact)]
    d_leaves = [np.zeros(leaf.shape, jax.dtypes.float0) for leaf in leaves]
    for i, stack in zip(inexact, d_stacked):
        d_leaves[i] = stack
    return d_h, treedef.unflatten(d_leaves)


_sco_scan.defvjp(_sco_scan_fwd, _sco_scan_bwd)
