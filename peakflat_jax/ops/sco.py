"""SCO: a layer scan whose checkpoint boundaries go to host memory and come back one layer ahead.

``sco_scan(layer_fn, carry, stacked_params, offload=...)`` computes the same values and gradients
as ``lax.scan`` over ``jax.checkpoint(layer_fn)``: each layer is rematerialized in backward from
its input carry_l (the checkpoint boundary). The boundaries chosen by ``offload`` are sent to
pinned host memory as soon as they exist, and the device copy is freed once layer l has used it.
Backward walks the layers in reverse. While layer l recomputes and differentiates, carry_(l-1)
is already coming back.

The carry is a pytree (the hidden state plus side outputs such as a router's per-expert load
counts or an auxiliary loss). Its inexact leaves are "the boundary": they are what ``offload``
moves and what the bound counts. Integer and bool leaves (token segment ids, positions) stay on
the device and travel as they are; they have no gradient.

Memory (per device, beyond inputs and outputs): the boundaries not offloaded, at most two
restored ones (the one in use and the one arriving), every layer's integer leaves, and one
layer's backward: its carry cotangents, its parameters and their gradients, and its
rematerialized working set, which only the caller knows (``layer_fn`` is theirs).
``sco_memory_terms`` gives each term in bytes, ``MEMORY_FORMULAS`` its formula, and
``sco_host_bytes`` the pinned host memory. In short

    (L - n_offloaded + min(n_offloaded, 2) + 2) * C + L * C_int + 2 * P_l + W

What ``layer_fn`` may close over: arrays that need no gradient (a jitted function's argument,
a constant). It must not close over arrays that need gradients: pass those in
``stacked_params`` (autodiff of the closure raises an UnexpectedTracerError). For a
non-differentiated per-layer input such as token segment ids or positions, the recommended
channel is an integer leaf of the carry that ``layer_fn`` returns unchanged: one copy, never
offloaded, no cotangent. Derive float tables (RoPE sin/cos) from such a leaf inside
``layer_fn``. A stacked param broadcast over L works too, but the barrier that slices each
layer's parameters materializes all L copies.

Two loops ("Why the code is shaped so"). The scanned loop (``loop="scan"``, the default) runs
each run of consecutive layers that share an offload choice through one ``lax.scan``: the
forward loop's body computes layer l and copies its input to host memory (the loop's output is
a host buffer written in place); the backward loop walks the run in reverse, and its body
recomputes and differentiates layer l from the boundary restored by the previous iteration
while it brings boundary l - 1 back (the carry holds the one arriving), writing layer l's
parameter gradients in place into the stacked result. A program then holds one layer's code
per run, whatever the depth: compile time and the count of kernel call sites do not grow with
L. The unrolled loop (``loop="unrolled"``) traces every layer in Python and places the
transfers explicitly in straight-line code, where XLA overlaps host copies without help; its
optimization barriers keep XLA's scheduler from undoing the bound (each was missing once, and
an H200 showed what XLA did without it):

- forward: boundary l's device-to-host copy is tied to layer l's output, so it runs while
  layer l computes and is done before layer l + 1 starts. Untied, XLA sank every copy into the
  backward pass and kept all boundaries on the device until then;
- backward: the restore of carry_(l-1) is issued when layer l's backward starts, not earlier
  (which would hold every boundary on the device at once);
- backward: layer l's recompute waits for the whole backward of layer l + 1, its parameter
  gradients included. Untied, XLA deferred weight-gradient matmuls and kept several layers'
  activations alive;
- each layer slices its parameters behind its input, and backward writes each layer's
  parameter gradients in place into the stacked result. Without these two, XLA held all L
  layers' parameter copies and offloading more boundaries stopped lowering the peak.

A loop's iterations run one after another, which gives the scanned loop the same order with one
barrier (and XLA:GPU's host offloading failed to compile a barrier between a host copy and a
loop's write of it): each layer's recompute waits for the cotangent from above, which a loop of
one iteration (straight-line code to XLA) or the first layer of a stack needs. The unrolled
loop stays for comparison and for ``PerLayer`` parameters that must reach each layer
separately; docs/sco.md holds what each measured.

Parameters made inside the forward (the trainer's overlapped optimizer: each layer's weights
updated from host-resident state while the layer before computes) come as a ``MadeInLoop``
(unrolled: layer l's made behind layer l - 1's input) or a ``MadeInScan`` (scanned: layer l + 1's
made in the iteration that computes layer l, from a row of state stacked over the layers, the
copies beside the layer's compute in one iteration's straight-line code). Either way the made
params are written into one stacked array per leaf, which the backward slices.

On CPU the memory kinds lower to nothing, so tests check values, the placement of transfers,
the barriers' ties in the jaxpr, and XLA's plan against ``sco_memory_terms``.

Measured: docs/sco.md.

Legend: L layers, n_offloaded boundaries in host memory, C bytes of the carry's inexact leaves
(one boundary, N * H * b for a plain hidden state), C_int bytes of its integer and bool leaves,
P_l bytes of one layer's parameters, W one layer's working set.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from peakflat_jax._validate import as_int

MEMORY_FORMULAS: dict[str, str] = {
    "kept_boundaries": "(L - n_offloaded) * C: the boundaries left on the device",
    "restored_boundaries": "min(n_offloaded, 2) * C: in backward, the one in use and the next",
    "integer_leaves": "L * C_int: each layer's integer and bool carry leaves, never offloaded",
    "carry_cotangents": "2 * C: the carry's cotangent into and out of the layer in backward",
    "layer_parameters": "2 * P_l: one layer's parameters sliced from the stack, and their "
                        "gradients before they are written into the stacked result",
    "layer_working_set": "W: the temporaries of one layer's VJP (the caller's layer_fn)",
}


def sco_memory_terms(num_layers: int, num_offloaded: int, boundary_bytes: int,
                     layer_param_bytes: int, layer_working_bytes: int,
                     integer_bytes: int = 0) -> dict[str, int]:
    """Per-device bytes of each term of SCO's bound, beyond inputs and outputs.

    ``boundary_bytes`` C is one boundary (the carry's inexact leaves) and ``integer_bytes``
    C_int its integer and bool leaves (both from ``carry_bytes``); ``layer_param_bytes`` P_l one
    layer's slice of ``stacked_params``; ``layer_working_bytes`` W what one layer's
    ``jax.vjp(layer_fn, carry, params_l)`` holds beyond its inputs and outputs (its
    rematerialized intermediates and their cotangents), which only the caller can know.
    """
    num_layers, num_offloaded = as_int("num_layers", num_layers), as_int("num_offloaded",
                                                                           num_offloaded)
    if not 0 <= num_offloaded <= num_layers:
        raise ValueError(f"num_offloaded: expected a count in [0, L={num_layers}], got "
                         f"{num_offloaded}")
    return {"kept_boundaries": (num_layers - num_offloaded) * boundary_bytes,
            "restored_boundaries": min(num_offloaded, 2) * boundary_bytes,
            "integer_leaves": num_layers * integer_bytes,
            "carry_cotangents": 2 * boundary_bytes,
            "layer_parameters": 2 * layer_param_bytes,
            "layer_working_set": layer_working_bytes}


def sco_host_bytes(num_offloaded: int, boundary_bytes: int) -> int:
    """Pinned host memory SCO uses per device: the offloaded boundaries, n_offloaded * C."""
    return as_int("num_offloaded", num_offloaded) * boundary_bytes


def carry_bytes(carry) -> tuple[int, int]:
    """(C, C_int): the bytes of a carry's inexact leaves (one boundary, what ``offload``
    moves) and of its integer and bool leaves (which stay on the device). Leaves may be arrays
    or ``jax.ShapeDtypeStruct``s."""
    inexact = integer = 0
    for leaf in jax.tree.leaves(carry):
        size = math.prod(leaf.shape) * jnp.dtype(leaf.dtype).itemsize
        if _is_inexact(leaf):
            inexact += size
        else:
            integer += size
    return inexact, integer


@dataclasses.dataclass(frozen=True)
class HostBudget:
    """Offload as many boundaries as fit in ``bytes`` of host memory, in forward order."""

    bytes: int

    def __post_init__(self):
        if as_int("HostBudget.bytes", self.bytes) < 0:
            raise ValueError(f"HostBudget.bytes: expected a non-negative int, got {self.bytes!r}")


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class PerLayer:
    """Layer parameters given as one pytree per layer instead of stacked along a leading axis.

    With stacked parameters every layer's slice comes from one array, which exists only once
    all layers' parameters do. A program that computes each layer's parameters itself (the
    trainer updating them from host-resident optimizer state inside the step) passes them
    per layer, so that under the unrolled loop layer l waits for its own parameters only (the
    scanned loop stacks them first). The cotangent is a PerLayer too."""

    layers: tuple

    def tree_flatten(self):
        return tuple(self.layers), None

    @classmethod
    def tree_unflatten(cls, _, children):
        return cls(tuple(children))


@dataclasses.dataclass(frozen=True, eq=False)
class MadeInLoop:
    """Layer parameters made inside the unrolled forward, layer by layer, each once the input
    of layer ``l - lead`` exists (the trainer's overlapped step: each MoE layer's weights
    updated from host-resident optimizer state, its host copies under the layers before it).

    Given as ``sco_scan``'s ``stacked_params`` (``loop="unrolled"`` only). Layer l's
    parameters are ``make(l, sources[l], chain, ready) -> (params_l, output_l, chain)``, run in
    the forward with ``sources[l]`` behind an optimization barrier on layer ``l - lead``'s input
    (none for the first ``lead`` layers), plus layer l's slice of ``offsets`` (zeros shaped
    like the params stacked along a leading layer axis: the gradients are taken with respect
    to them, and equal the gradients with respect to the made params; each layer's are
    written in place into the stacked result, as for stacked params). ``sources`` and
    ``chain`` are pytrees of arrays that take no gradient; ``chain`` is threaded from layer to
    layer (the optimizer's slot chain). ``ready`` is layer l's own input (its inexact leaves,
    without gradient): work that ``make`` ties to it waits for layer l - 1's compute (the
    trainer ties the update's arithmetic to it where no slot chain orders the copies).
    ``layer_fn`` takes ``wrap(l, params_l)`` (the identity unless ``map_params`` set it).

    Each layer's params (made plus offset) are written, as they are made, into one array per
    leaf with a leading layer axis: ``into`` (stacked like ``offsets``; donated buffers, say,
    whose values are not read again), else fresh zeros. The backward slices its layer's params
    from those arrays, which are the residual, and after the call ``results`` holds
    ``(outputs, chain, stacked)``: the per-layer ``output_l``, the last chain and the stacked
    params, tracers of the same trace, to be returned by the caller.

    Why: the layers' parameters made before the loop depend on nothing the forward computes,
    and XLA:GPU then scheduled all of their work (every optimizer bucket's copy in, update and
    copy out) before the first layer: none of the host traffic ran under compute (docs/
    offload_adamw.md). The barrier is a data dependency no scheduler can reorder. Written into
    the stacked arrays as made, the params exist once: kept per layer for the backward and
    stacked by the caller, XLA:GPU held both copies through the dense layers' backward in one
    schedule and not in another (h200-e2e at 540,672 and 533,994 tokens); and
    with per-layer gradients stacked by the caller, XLA:GPU held every layer's through the
    dense layers' backward (h200-e2e at 540,672 tokens)."""

    make: Callable
    sources: tuple
    chain: object
    offsets: Any
    lead: int = 1
    results: list = dataclasses.field(default_factory=list)
    into: Any = None
    wrap: Callable | None = None

    def map_params(self, fn: Callable) -> MadeInLoop:
        """The same, ``layer_fn`` given each layer's params as ``fn(layer, params_l)`` (a
        caller's wrapping of the layer pytree), sharing ``results``."""
        inner = self.wrap
        wrap = fn if inner is None else (lambda layer, params: fn(layer, inner(layer, params)))
        return dataclasses.replace(self, wrap=wrap)

    def wrapped(self, layer: int, params):
        """What ``layer_fn`` takes for layer ``layer``'s params."""
        return params if self.wrap is None else self.wrap(layer, params)


@dataclasses.dataclass(frozen=True)
class _Maker:
    """The static part of a MadeInLoop (a custom_vjp's non-differentiable argument)."""

    make: Callable
    lead: int
    wrap: Callable | None

    def wrapped(self, layer: int, params):
        return params if self.wrap is None else self.wrap(layer, params)

    def layers(self, made_inputs, offsets):
        """A function of (layer, the inputs of the layers so far) giving layer l's params
        (made plus its offset), written into the stacked arrays, and one giving
        (outputs, chain, stacked) once every layer is made."""
        sources, chain, into = made_inputs
        if into is None:
            into = jax.tree.map(jnp.zeros_like, offsets)
        state = {"chain": chain, "outputs": [], "stacked": into}

        def boundary(carry):
            return lax.stop_gradient(_CarryLeaves(carry).inexact_part(carry))

        def params(layer, inputs):
            source = sources[layer]
            if layer - self.lead >= 0:
                source, _ = lax.optimization_barrier((source, boundary(inputs[layer - self.lead])))
            made, output, state["chain"] = self.make(layer, source, state["chain"],
                                                     boundary(inputs[layer]))
            state["outputs"].append(output)
            _check_like(f"MadeInLoop.make's params of layer {layer}", made,
                        _layer_params(offsets, layer))
            made = jax.tree.map(lambda m, o: m + o if _is_inexact(m) else m,
                                made, _layer_params(offsets, layer))
            state["stacked"] = jax.tree.map(lambda s, m: s.at[layer].set(m), state["stacked"],
                                            made)
            return made

        return params, lambda: (tuple(state["outputs"]), state["chain"], state["stacked"])


@dataclasses.dataclass(frozen=True, eq=False)
class MadeInScan:
    """Layer parameters made inside the scanned forward: layer l + 1's in the loop iteration
    that computes layer l (the trainer's overlapped step with the scanned stack: each MoE
    layer's weights updated from host-resident optimizer state, its host copies under the
    layer before). The scanned counterpart of ``MadeInLoop``.

    Given as ``sco_scan``'s ``stacked_params`` (``loop="scan"`` only). Layer l's parameters are
    ``make(l, carried, ready, segment) -> (params_l, carried)``: ``l`` is traced inside the loop
    (an int for layer 0, made before it), ``carried`` a pytree of arrays without gradient that
    is threaded from make to make in layer order (the optimizer's stacked state, rows read and
    written by layer), ``ready`` layer l's input (its inexact leaves, without gradient: work that
    ``make`` ties to it waits for layer l - 1's compute) and ``segment`` the static
    ``segments[l]``. A loop makes only layers of one segment (a loop ends where the next
    layer's segment changes), so that ``make`` can choose by segment what it cannot by a
    traced layer (the trainer: which stacked block of the optimizer's state holds the layer).
    The params made are layer l's slice of ``offsets`` added (zeros stacked like the params:
    the gradients are taken with respect to them) and written in place into ``into`` (else
    fresh zeros), whose rows the backward slices, as ``MadeInLoop``. ``layer_fn`` takes
    ``wrap(l, params_l)`` (the identity unless ``map_params`` set it). After the call
    ``results`` holds ``(carried, stacked)``, tracers of the same trace.

    Why: the unrolled loop compiles every layer, so its compile grows with depth; a scanned
    stack whose weights are made before the loop waits for every bucket of the optimizer's
    stream, none of which then runs under a layer's compute (docs/compile.md). Made one layer
    ahead inside the loop's body, layer l + 1's copies run in straight-line code beside layer
    l's compute, within one iteration, where XLA overlaps host copies; its state is a row of
    arrays stacked over the layers, read and written in place, because separate arrays per
    layer cannot be indexed by the loop's traced layer. The last layer, which has no next
    layer to make, is a loop of its own (one iteration: straight-line code), one layer's code
    more than the scanned stack's, whatever the depth."""

    make: Callable
    carried: Any
    segments: tuple
    offsets: Any
    results: list = dataclasses.field(default_factory=list)
    into: Any = None
    wrap: Callable | None = None

    def map_params(self, fn: Callable) -> MadeInScan:
        """The same, ``layer_fn`` given each layer's params as ``fn(layer, params_l)`` (a
        caller's wrapping of the layer pytree; ``layer`` may be traced), sharing ``results``."""
        inner = self.wrap
        wrap = fn if inner is None else (lambda layer, params: fn(layer, inner(layer, params)))
        return dataclasses.replace(self, wrap=wrap)

    def wrapped(self, layer, params):
        """What ``layer_fn`` takes for layer ``layer``'s params."""
        return params if self.wrap is None else self.wrap(layer, params)


@dataclasses.dataclass(frozen=True)
class _ScanMaker:
    """The static part of a MadeInScan (a custom_vjp's non-differentiable argument)."""

    make: Callable
    segments: tuple
    wrap: Callable | None

    def wrapped(self, layer, params):
        return params if self.wrap is None else self.wrap(layer, params)


def _check_like(what: str, tree, like) -> None:
    """Raises a ValueError naming ``what`` unless ``tree`` has ``like``'s structure, shapes and
    dtypes (a made layer's params against its offsets' slice; ``into`` against the offsets):
    written into the stacked arrays, a mismatch would be cast or broadcast silently, and the
    backward would recompute with other params than the forward used."""
    expected = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), like)
    got = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)
    if jax.tree.structure(got) != jax.tree.structure(expected) or any(
            (a.shape, a.dtype) != (b.shape, b.dtype)
            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected))):
        raise ValueError(f"{what}: expected the offsets' structure, shapes and dtypes "
                         f"({expected}), got {got}")


def host_memory_bytes() -> int:
    """Physical memory of this host (the ceiling for pinned host buffers)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def offload_plan(offload, num_layers: int, boundary_bytes: int) -> tuple[bool, ...]:
    """Which of the L boundaries go to host memory, checked against this host's memory.

    A pure function of static numbers, so every process makes the same choice (a mismatch
    would deadlock collectives) and a budget that cannot be met fails before any compute.
    """
    expected = (f"\"all\", None, a count, {num_layers} bools (one per layer), a list of layer "
                f"indices in [0, {num_layers}) or a HostBudget")
    if isinstance(offload, HostBudget):
        count = min(num_layers, offload.bytes // boundary_bytes) if boundary_bytes else num_layers
        chosen = tuple(i < count for i in range(num_layers))
    elif offload is None or (isinstance(offload, str) and offload == "all"):
        chosen = (offload is not None,) * num_layers
    elif isinstance(offload, bool | str):
        raise ValueError(f"offload: expected {expected}, got {offload!r}")
    elif isinstance(offload, Sequence | np.ndarray):
        items = list(offload)
        if items and all(isinstance(x, bool | np.bool_) for x in items):
            if len(items) != num_layers:
                raise ValueError(f"offload: expected {num_layers} bools (one per layer), got "
                                 f"{offload!r}")
            chosen = tuple(bool(x) for x in items)
        elif all(isinstance(x, int | np.integer) and not isinstance(x, bool | np.bool_)
                 and 0 <= x < num_layers for x in items) and len(set(items)) == len(items):
            chosen = tuple(i in set(int(x) for x in items) for i in range(num_layers))
        else:
            raise ValueError(f"offload: expected {expected}, got {offload!r}")
    else:
        count = as_int("offload", offload)
        if not 0 <= count <= num_layers:
            raise ValueError(f"offload: expected a count in [0, L={num_layers}], got {count}")
        chosen = tuple(i < count for i in range(num_layers))
    needed = sco_host_bytes(sum(chosen), boundary_bytes)
    available = host_memory_bytes()
    if needed > available:
        raise ValueError(f"offload: {sum(chosen)} boundaries need {needed:,} bytes of host "
                         f"memory, this host has {available:,}")
    return chosen


LOOPS = ("scan", "unrolled")


def sco_scan(layer_fn: Callable, carry, stacked_params, *, offload, loop: str = "scan"):
    """``lax.scan`` of the checkpointed ``layer_fn(carry, params_l) -> carry`` over the leading
    layer axis of ``stacked_params`` (or over the layers of a ``PerLayer``), with the
    boundaries chosen by ``offload`` kept in host memory.

    ``carry``: an array or a pytree of arrays; ``layer_fn`` returns the same structure, shapes
    and dtypes. Its inexact leaves are the boundary that ``offload`` moves; integer and bool
    leaves stay on the device. ``offload``: ``"all"``, ``None`` (none), an int (the first n
    boundaries), a sequence of L bools, a sequence of layer indices, or ``HostBudget(bytes)``
    (as many as fit, in forward order). ``layer_fn`` must not close over arrays that need
    gradients (pass them in ``stacked_params``); per-layer inputs without gradients (segment
    ids, positions) are best an integer leaf of the carry.

    ``loop``: ``"scan"`` (the default) runs the layers through ``lax.scan``, one loop per run
    of consecutive layers that share an offload choice, so that the program (and its compile
    time) does not grow with depth; ``"unrolled"`` traces every layer (module doc, "Two
    loops"). Both give the same values and gradients. A ``PerLayer`` under ``"scan"`` is
    stacked first: every layer then waits for all layers' parameters. Parameters made inside
    the forward are a ``MadeInLoop`` (unrolled) or a ``MadeInScan`` (scanned).

    Limits: reverse mode only (a custom VJP: ``jax.jvp`` and ``jacfwd`` raise); under
    ``jax.vmap`` a HostBudget counts the bytes of one example's boundary. Inside an enclosing
    ``jax.checkpoint`` the forward runs twice (first pass and replay) and each run copies the
    boundaries to host (in the unrolled loop the barriers that order the copies keep XLA from
    dropping the first run's, which nothing reads).
    """
    if loop not in LOOPS:
        raise ValueError(f"loop: expected one of {LOOPS}, got {loop!r}")
    if isinstance(stacked_params, MadeInScan):
        return _made_in_scan(layer_fn, carry, stacked_params, offload, loop)
    made = stacked_params if isinstance(stacked_params, MadeInLoop) else None
    if made is not None:
        if loop != "unrolled":
            raise ValueError(f"loop: expected \"unrolled\" for a MadeInLoop (a scanned loop "
                             f"needs every layer's parameters first), got {loop!r}")
        if as_int("MadeInLoop.lead", made.lead) < 1:
            raise ValueError(f"MadeInLoop.lead: expected at least 1, got {made.lead}")
        layers = {leaf.shape[0] if leaf.ndim else None for leaf in jax.tree.leaves(made.offsets)}
        if len(layers) != 1 or len(made.sources) not in layers:
            raise ValueError(f"MadeInLoop.offsets: expected a leading layer axis of "
                             f"{len(made.sources)} (one per source) on every leaf, got "
                             f"{[leaf.shape for leaf in jax.tree.leaves(made.offsets)]}")
        if made.into is not None:
            _check_like("MadeInLoop.into", made.into, made.offsets)
        stacked_params = made.offsets
    per_layer = isinstance(stacked_params, PerLayer)
    if per_layer:
        num_layers = len(stacked_params.layers)
        structures = {jax.tree.structure(p) for p in stacked_params.layers}
        if len(structures) > 1:
            raise ValueError(f"stacked_params: expected every layer of a PerLayer to have one "
                             f"structure, got {structures}")
    else:
        leaves = jax.tree.leaves(stacked_params)
        if not leaves:
            raise ValueError("stacked_params: expected at least one array with a leading layer "
                             "axis")
        num_layers = leaves[0].shape[0]
        if any(leaf.ndim < 1 or leaf.shape[0] != num_layers for leaf in leaves):
            raise ValueError(f"stacked_params: every leaf needs the same leading layer axis, "
                             f"got {[leaf.shape for leaf in leaves]}")
    carry_leaves = jax.tree.leaves(carry)
    if not carry_leaves or not all(hasattr(leaf, "shape") and hasattr(leaf, "dtype")
                                   for leaf in carry_leaves):
        raise ValueError(f"carry: expected an array or a pytree of arrays, got {carry!r}")
    chosen = offload_plan(offload, num_layers, carry_bytes(carry)[0])
    if num_layers == 0:
        return carry
    expected = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), carry)
    first = (_layer_params(stacked_params, 0) if made is None
             else made.wrapped(0, _layer_params(stacked_params, 0)))
    out = jax.eval_shape(layer_fn, carry, first)
    if (jax.tree.structure(out) != jax.tree.structure(expected)
            or any((a.shape, a.dtype) != (b.shape, b.dtype)
                   for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(expected)))):
        raise ValueError(f"layer_fn: expected it to return a carry like its input (same "
                         f"structure, shapes and dtypes: {expected}), got {out}")
    if made is not None:
        carry, results = _sco_unrolled(layer_fn, chosen, _Maker(made.make, made.lead, made.wrap),
                                       carry, stacked_params,
                                       (made.sources, made.chain, made.into))
        made.results[:] = results
        return carry
    if loop == "unrolled":
        return _sco_unrolled(layer_fn, chosen, None, carry, stacked_params, None)
    if per_layer:
        stacked = jax.tree.map(lambda *layers: jnp.stack(layers), *stacked_params.layers)
        return _sco_scanned(layer_fn, _runs(chosen), carry, stacked)
    return _sco_scanned(layer_fn, _runs(chosen), carry, stacked_params)


def _layer_params(stacked_params, layer: int):
    if isinstance(stacked_params, PerLayer):
        return stacked_params.layers[layer]
    return jax.tree.map(lambda leaf: leaf[layer], stacked_params)


def _own_params(stacked_params, layer: int):
    """What layer ``layer``'s barriers tie: all stacked params (their slice is taken after the
    barrier), or only the layer's own pytree of a PerLayer."""
    if isinstance(stacked_params, PerLayer):
        return PerLayer(tuple(p if i == layer else None
                              for i, p in enumerate(stacked_params.layers)))
    return stacked_params


def _is_inexact(leaf) -> bool:
    return jnp.issubdtype(leaf.dtype, jnp.inexact)


def _move_boundary(carry, space):
    """The carry with its inexact leaves (the boundary) sent to ``space``."""
    return jax.tree.map(lambda a: jax.device_put(a, space) if _is_inexact(a) else a, carry)


# ----------------------------------------------------------------------------------------------
# The unrolled loop: every layer traced, transfers placed by hand.


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _sco_unrolled(layer_fn, chosen, maker, carry, stacked_params, made_inputs):
    # Without differentiation nothing reads the boundaries again: no copies, no barriers.
    # ``maker``: None, or a MadeInLoop's _Maker (then ``stacked_params`` are its offsets and
    # the result is (carry, (outputs, chain, stacked))).
    if maker is not None:
        params_of, results = maker.layers(made_inputs, stacked_params)
    inputs = []
    for layer in range(len(chosen)):
        inputs.append(carry)
        params = (_layer_params(stacked_params, layer) if maker is None else
                  maker.wrapped(layer, params_of(layer, inputs)))
        carry = layer_fn(carry, params)
    return carry if maker is None else (carry, results())


def _sco_unrolled_fwd(layer_fn, chosen, maker, carry, stacked_params, made_inputs):
    if maker is not None:
        params_of, results = maker.layers(made_inputs, stacked_params)
    boundaries, inputs = [], []
    for layer, to_host in enumerate(chosen):
        inputs.append(carry)
        if maker is not None:  # layer l's params, made once layer l - lead's input exists
            carry, params = lax.optimization_barrier((carry, params_of(layer, inputs)))
            carry_next = layer_fn(carry, maker.wrapped(layer, params))
        else:
            # Layer l slices its parameters once its input exists. Otherwise the slices, which
            # depend on nothing but the parameters, are free to run early, and XLA kept every
            # layer's slice alive from forward to backward (XLA:CPU: one layer's parameters
            # of temporaries per layer).
            carry, params = lax.optimization_barrier((carry, _own_params(stacked_params, layer)))
            carry_next = layer_fn(carry, _layer_params(params, layer))
        if to_host:
            # The copy runs while this layer computes and must be done before the next layer
            # starts. Untied, XLA's scheduler sank every device-to-host copy into the backward
            # pass, keeping all boundaries on the device until then (seen on an H200).
            boundary, carry_next = lax.optimization_barrier(
                (_move_boundary(carry, jax.memory.Space.Host), carry_next))
        else:
            boundary = carry
        boundaries.append(boundary)
        carry = carry_next
    if maker is not None:  # the backward slices each layer's params from the stacked arrays
        outputs, chain, stacked = results()
        return (carry, (outputs, chain, stacked)), (tuple(boundaries), stacked)
    return carry, (tuple(boundaries), stacked_params)


def _sco_unrolled_bwd(layer_fn, chosen, maker, residuals, d_out):
    # With a maker the residuals hold the made params stacked, and the offsets' cotangents
    # are theirs, plus the stacked output's own (stacked = made + offsets); the made outputs,
    # the chain and the sources take no gradient.
    boundaries, stacked_params = residuals
    d_carry = d_out if maker is None else d_out[0]
    num_layers = len(chosen)

    def restore(layer, after):
        """Boundary ``layer`` on the device, its copy issued once ``after`` exists."""
        boundary, _ = lax.optimization_barrier((boundaries[layer], after))
        return _move_boundary(boundary, jax.memory.Space.Device) if chosen[layer] else boundary

    # Cotangents of integer leaves are float0 (nothing to compute): only the inexact ones pass
    # through the barriers, and the float0 zeros are put back around each layer's VJP.
    carry_leaves = _CarryLeaves(boundaries[0])
    full_cotangent, inexact_part = carry_leaves.full, carry_leaves.inexact_part

    # Each layer's parameter gradients are written in place into the stacked result, and the
    # layer slices its parameters only after the barrier below. Stacking per-layer gradients
    # at the end, or slicing before the barrier, let XLA keep all L layers' copies alive:
    # one layer's parameters of temporaries per layer (XLA:CPU, each fix alone not enough).
    # Integer leaves (token ids, say) have float0 cotangents: nothing to write. PerLayer
    # params get per-layer gradients, each written once.
    # With a maker the params are its stacked arrays, and their gradients are the offsets'.
    per_layer = isinstance(stacked_params, PerLayer)
    layer_tree = _layer_params(stacked_params, 0) if per_layer else None
    leaves, treedef = jax.tree.flatten(layer_tree if per_layer else stacked_params)
    inexact = [i for i, leaf in enumerate(leaves) if _is_inexact(leaf)]
    if per_layer:
        d_stacked = []
    elif maker is not None:  # the stacked output's cotangent (zeros where nothing reads it)
        given = treedef.flatten_up_to(d_out[1][2])
        d_stacked = [given[i] for i in inexact]
    else:
        d_stacked = [jnp.zeros_like(leaves[i]) for i in inexact]
    d_layers = [None] * num_layers
    d_inexact = inexact_part(d_carry)
    incoming = restore(num_layers - 1, d_inexact)
    for layer in reversed(range(num_layers)):
        # Layer l's recompute waits for all of layer l + 1's backward: its input cotangent and
        # its parameter gradients. Untied, XLA deferred each layer's weight-gradient matmuls to
        # the end and kept their inputs, several layers' activations, alive (seen on an H200).
        done = d_stacked if not per_layer else (d_layers[layer + 1] if layer + 1 < num_layers
                                                 else [])
        carry_in, d_inexact, done, params = lax.optimization_barrier(
            (incoming, d_inexact, done, _own_params(stacked_params, layer)))
        if per_layer:
            if layer + 1 < num_layers:
                d_layers[layer + 1] = done
        else:
            d_stacked = done
        if layer > 0:
            incoming = restore(layer - 1, d_inexact)  # overlaps this layer's recompute and bwd
        own = _layer_params(params, layer)
        if maker is None:
            _, vjp = jax.vjp(layer_fn, carry_in, own)
        else:
            _, vjp = jax.vjp(lambda c, p, at=layer: layer_fn(c, maker.wrapped(at, p)),
                             carry_in, own)
        d_carry, d_layer = vjp(full_cotangent(d_inexact))
        d_inexact = inexact_part(d_carry)
        d_layer = treedef.flatten_up_to(d_layer)
        if per_layer:
            d_layers[layer] = [d_layer[i] for i in inexact]
        else:
            write = (lambda stack, g: stack.at[layer].add(g)) if maker is not None else (
                lambda stack, g: stack.at[layer].set(g))
            d_stacked = [write(stack, d_layer[i]) for stack, i in zip(d_stacked, inexact)]

    def cotangent_tree(inexact_grads):
        d_leaves = [np.zeros(leaf.shape, jax.dtypes.float0) for leaf in leaves]
        for i, grad in zip(inexact, inexact_grads):
            d_leaves[i] = grad
        return treedef.unflatten(d_leaves)

    if per_layer:
        return (full_cotangent(d_inexact), PerLayer(tuple(cotangent_tree(d) for d in d_layers)),
                None)
    return full_cotangent(d_inexact), cotangent_tree(d_stacked), None


_sco_unrolled.defvjp(_sco_unrolled_fwd, _sco_unrolled_bwd)


# ----------------------------------------------------------------------------------------------
# The scanned loop: one lax.scan per run of layers with one offload choice.


def _runs(chosen: tuple[bool, ...]) -> tuple[tuple[int, int, bool], ...]:
    """(start, stop, to_host) of each run of consecutive layers with one offload choice."""
    runs, start = [], 0
    for layer in range(1, len(chosen) + 1):
        if layer == len(chosen) or chosen[layer] != chosen[start]:
            runs.append((start, layer, chosen[start]))
            start = layer
    return tuple(runs)


def _layer_at(stacked_params, layer):
    """Layer ``layer``'s slice of every stacked leaf (``layer`` may be traced)."""
    return jax.tree.map(lambda leaf: lax.dynamic_index_in_dim(leaf, layer, 0, keepdims=False),
                        stacked_params)


class _CarryLeaves:
    """The inexact leaves of a carry (the boundary: what has a cotangent) and back. Integer
    leaves have float0 cotangents: nothing to compute or carry through a loop."""

    def __init__(self, carry):
        self.leaves, self.treedef = jax.tree.flatten(carry)
        self.inexact = [i for i, leaf in enumerate(self.leaves) if _is_inexact(leaf)]

    def inexact_part(self, tree) -> list:
        leaves = self.treedef.flatten_up_to(tree)
        return [leaves[i] for i in self.inexact]

    def full(self, inexact_leaves):
        """A tree like the carry: these leaves where it is inexact, float0 zeros elsewhere."""
        leaves = [np.zeros(leaf.shape, jax.dtypes.float0) for leaf in self.leaves]
        for i, leaf in zip(self.inexact, inexact_leaves):
            leaves[i] = leaf
        return self.treedef.unflatten(leaves)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _sco_scanned(layer_fn, runs, carry, stacked_params):
    # Without differentiation nothing reads the boundaries again: one loop, no copies.
    def body(carry, layer):
        return layer_fn(carry, _layer_at(stacked_params, layer)), None

    return lax.scan(body, carry, jnp.arange(runs[-1][1], dtype=jnp.int32))[0]


def _sco_scanned_fwd(layer_fn, runs, carry, stacked_params):
    saved = []
    for start, stop, to_host in runs:
        def body(carry, layer, to_host=to_host):
            carry_next = layer_fn(carry, _layer_at(stacked_params, layer))
            if not to_host:
                return carry_next, carry
            # The copy of this layer's input runs while the layer computes; the loop's output
            # (a host buffer written in place) needs it done by the iteration's end. No barrier
            # here: XLA:GPU's host offloading fails to compile one between the copy and the
            # loop's write (jax 0.11.2).
            return carry_next, _move_boundary(carry, jax.memory.Space.Host)

        carry, boundaries = lax.scan(body, carry, jnp.arange(start, stop, dtype=jnp.int32))
        saved.append(boundaries)
    return carry, (tuple(saved), stacked_params)


def _sco_scanned_bwd(layer_fn, runs, residuals, d_carry):
    saved, stacked_params = residuals
    return _scanned_backward(lambda carry, params, layer: layer_fn(carry, params), runs, saved,
                             stacked_params, d_carry)


def _scanned_backward(apply, runs, saved, stacked_params, d_carry, given=None):
    """The scanned loop's backward: per run in reverse, one ``lax.scan`` whose body recomputes
    and differentiates ``apply(carry, params_l, l)`` from boundary l while it brings boundary
    l - 1 back; each layer's parameter gradients written in place into the stacked result (set,
    or added to ``given``: a cotangent of the stacked params themselves). Returns (the carry's
    cotangent, the stacked params' cotangent tree)."""
    carry_leaves = _CarryLeaves(_layer_at(saved[0], 0))
    param_leaves, param_def = jax.tree.flatten(stacked_params)
    inexact = [i for i, leaf in enumerate(param_leaves) if _is_inexact(leaf)]

    def write(stack, grad, layer):
        grad = grad.astype(stack.dtype)
        if given is not None:
            grad = lax.dynamic_index_in_dim(stack, layer, 0, keepdims=False) + grad
        return lax.dynamic_update_index_in_dim(stack, grad, layer, 0)

    def layer_vjp(boundary, layer, d_inexact, d_stacked):
        """Layer ``layer`` recomputed from its boundary and differentiated; its parameter
        gradients written in place into the stacked result. The recompute waits for the
        cotangent from the layers above: a loop of one layer (a stack of one dense layer) is
        straight-line code to XLA, which otherwise merged the recompute with the forward
        (common subexpressions) or ran it before the other stacks' backward, holding that
        layer's activations through the whole step (5.7 GiB at h200-1's 256K in XLA:GPU's
        buffer assignment)."""
        boundary, d_inexact = lax.optimization_barrier((boundary, d_inexact))
        _, vjp = jax.vjp(lambda c, p: apply(c, p, layer), boundary,
                         _layer_at(stacked_params, layer))
        d_boundary, d_layer = vjp(carry_leaves.full(d_inexact))
        d_layer = param_def.flatten_up_to(d_layer)
        d_stacked = [write(stack, d_layer[i], layer) for stack, i in zip(d_stacked, inexact)]
        return carry_leaves.inexact_part(d_boundary), d_stacked

    d_inexact = carry_leaves.inexact_part(d_carry)
    if given is None:
        d_stacked = [jnp.zeros_like(param_leaves[i]) for i in inexact]
    else:
        given = param_def.flatten_up_to(given)
        d_stacked = [given[i] for i in inexact]
    for (start, stop, to_host), boundaries in reversed(list(zip(runs, saved))):
        layers = jnp.arange(stop - start, dtype=jnp.int32)
        if not to_host:
            def body(state, j, start=start, boundaries=boundaries):
                return layer_vjp(_layer_at(boundaries, j), start + j, *state), None

            (d_inexact, d_stacked), _ = lax.scan(body, (d_inexact, d_stacked), layers,
                                                 reverse=True)
            continue

        def restore(j, boundaries=boundaries):
            return _move_boundary(_layer_at(boundaries, j), jax.memory.Space.Device)

        def body(state, j, start=start, restore=restore):
            # Boundary j - 1 comes back while layer j recomputes and differentiates: two are
            # on the device, the one in use and the one arriving (at j = 0 a copy of boundary 0
            # again, which nothing reads: the loop's body stays one).
            restored, d_inexact, d_stacked = state
            upcoming = restore(jnp.maximum(j - 1, 0))
            d_inexact, d_stacked = layer_vjp(restored, start + j, d_inexact, d_stacked)
            return (upcoming, d_inexact, d_stacked), None

        first = restore(stop - start - 1)
        (_, d_inexact, d_stacked), _ = lax.scan(body, (first, d_inexact, d_stacked), layers,
                                                reverse=True)

    d_leaves = [np.zeros(leaf.shape, jax.dtypes.float0) for leaf in param_leaves]
    for i, grad in zip(inexact, d_stacked):
        d_leaves[i] = grad
    return carry_leaves.full(d_inexact), param_def.unflatten(d_leaves)


_sco_scanned.defvjp(_sco_scanned_fwd, _sco_scanned_bwd)


# ----------------------------------------------------------------------------------------------
# The scanned loop with each layer's parameters made in the iteration before (MadeInScan).


def _made_in_scan(layer_fn, carry, made: MadeInScan, offload, loop):
    """``sco_scan`` of a MadeInScan: checked, then one loop per run of layers that share an
    offload choice and the next layer's segment."""
    if loop != "scan":
        raise ValueError(f"loop: expected \"scan\" for a MadeInScan, got {loop!r}")
    leaves = jax.tree.leaves(made.offsets)
    num_layers = leaves[0].shape[0] if leaves and leaves[0].ndim else None
    if num_layers is None or any(leaf.ndim < 1 or leaf.shape[0] != num_layers
                                 for leaf in leaves):
        raise ValueError(f"MadeInScan.offsets: expected a leading layer axis on every leaf, got "
                         f"{[leaf.shape for leaf in leaves]}")
    segments = tuple(made.segments)
    if len(segments) != num_layers or any(s is None for s in segments):
        raise ValueError(f"MadeInScan.segments: expected {num_layers} keys (one per layer, not "
                         f"None), got {made.segments!r}")
    if made.into is not None:
        _check_like("MadeInScan.into", made.into, made.offsets)
    chosen = offload_plan(offload, num_layers, carry_bytes(carry)[0])
    maker = _ScanMaker(made.make, segments, made.wrap)
    expected = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), carry)
    out = jax.eval_shape(lambda c, p: layer_fn(c, maker.wrapped(0, p)), carry,
                         _layer_params(made.offsets, 0))
    if (jax.tree.structure(out) != jax.tree.structure(expected)
            or any((a.shape, a.dtype) != (b.shape, b.dtype)
                   for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(expected)))):
        raise ValueError(f"layer_fn: expected it to return a carry like its input (same "
                         f"structure, shapes and dtypes: {expected}), got {out}")
    carry, results = _sco_made_scanned(layer_fn, _made_runs(chosen, segments), maker, carry,
                                       made.offsets, (made.carried, made.into))
    made.results[:] = results
    return carry


def _made_runs(chosen, segments) -> tuple[tuple[int, int, bool, Any], ...]:
    """(start, stop, to_host, segment) of each run of consecutive layers with one offload choice
    whose iterations make layers of one segment: layer l's iteration makes layer l + 1, of
    ``segment``; None where nothing is made (the last layer, a run of its own)."""
    num_layers = len(chosen)
    keys = [(chosen[i], segments[i + 1] if i + 1 < num_layers else None)
            for i in range(num_layers)]
    runs, start = [], 0
    for layer in range(1, num_layers + 1):
        if layer == num_layers or keys[layer] != keys[start]:
            runs.append((start, layer, *keys[start]))
            start = layer
    return tuple(runs)


def _made_forward(layer_fn, runs, maker: _ScanMaker, carry, offsets, made_inputs, save: bool):
    """The forward of a MadeInScan: layer 0's params made before the loops, then per run one
    ``lax.scan`` whose body computes layer l with the params made in the iteration before and
    makes layer l + 1's. Returns (carry, carried, stacked params, the boundaries saved per run:
    in host memory where offloaded; None without ``save``)."""
    carried, into = made_inputs
    stacked = jax.tree.map(jnp.zeros_like, offsets) if into is None else into
    like = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), offsets)

    def ready(carry):
        return lax.stop_gradient(_CarryLeaves(carry).inexact_part(carry))

    def made_layer(layer, carried, ready, segment):
        params, carried = maker.make(layer, carried, ready, segment)
        _check_like("MadeInScan.make's params", params, like)
        params = jax.tree.map(lambda m, o: m + o if _is_inexact(m) else m, params,
                              _layer_at(offsets, layer))
        return params, carried

    def written(stacked, params, layer):
        return jax.tree.map(lambda s, p: lax.dynamic_update_index_in_dim(s, p, layer, 0),
                            stacked, params)

    params, carried = made_layer(0, carried, ready(carry), maker.segments[0])
    stacked = written(stacked, params, 0)
    saved = []
    for start, stop, to_host, segment in runs:
        def body(state, _, to_host=to_host, segment=segment):
            # The layer index is carried (not sliced from a constant): an index that is a
            # function of the loop's counter is what XLA turns a host row's slice into a copy
            # by (its dynamic-memcpy thunk).
            layer, carry, params, carried, stacked = state
            carry_next = layer_fn(carry, maker.wrapped(layer, params))
            if segment is not None:
                params, carried = made_layer(layer + 1, carried, ready(carry_next), segment)
                stacked = written(stacked, params, layer + 1)
            boundary = None if not save else (
                _move_boundary(carry, jax.memory.Space.Host) if to_host else carry)
            return (layer + 1, carry_next, params, carried, stacked), boundary

        state = (jnp.int32(start), carry, params, carried, stacked)
        (_, carry, params, carried, stacked), boundaries = lax.scan(body, state, None,
                                                                    length=stop - start)
        saved.append(boundaries)
    return carry, carried, stacked, tuple(saved)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _sco_made_scanned(layer_fn, runs, maker, carry, offsets, made_inputs):
    carry, carried, stacked, _ = _made_forward(layer_fn, runs, maker, carry, offsets,
                                               made_inputs, save=False)
    return carry, (carried, stacked)


def _sco_made_scanned_fwd(layer_fn, runs, maker, carry, offsets, made_inputs):
    carry, carried, stacked, saved = _made_forward(layer_fn, runs, maker, carry, offsets,
                                                   made_inputs, save=True)
    return (carry, (carried, stacked)), (saved, stacked)


def _sco_made_scanned_bwd(layer_fn, runs, maker, residuals, d_out):
    # The backward slices each layer's params from the stacked made params; the offsets'
    # cotangents are theirs plus the stacked output's own (stacked = made + offsets). The
    # carried state takes no gradient.
    saved, stacked = residuals
    d_carry, (_, d_stacked) = d_out
    d_carry, d_offsets = _scanned_backward(
        lambda c, p, layer: layer_fn(c, maker.wrapped(layer, p)),
        tuple((start, stop, to_host) for start, stop, to_host, _ in runs), saved, stacked,
        d_carry, given=d_stacked)
    return d_carry, d_offsets, None


_sco_made_scanned.defvjp(_sco_made_scanned_fwd, _sco_made_scanned_bwd)
