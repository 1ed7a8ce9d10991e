"""OffloadStreamAdamW: AdamW whose fp32 state lives in host memory and streams through the device
in buckets.

The device keeps the working parameters (their own dtype, e.g. bf16) and the gradients. The
fp32 master weights and both moments (12 bytes per parameter) live in host memory (memory kind
``pinned_host``). The parameters, taken as one flat vector in tree order, are cut into buckets
of at most ``bucket_params`` (a bucket may split a leaf), and each bucket keeps its own host
arrays: slicing one big host array inside a loop ran at 5 GB/s on H200 against 54 GB/s for
whole-array copies (JAX-NOTES.md).

One jitted step, buckets unrolled: for each bucket, copy (master, mu, nu) host -> device
(``device_put`` to ``Space.Device`` inside jit, the fast path), apply AdamW with the bucket's
gradient pieces, write the new working parameters, and copy the state back (``Space.Host``).
Bucket i's host copies wait on bucket i - slots's write-back (an optimization barrier), so at
most ``slots`` buckets are staged on the device:

    staging <= slots * bucket_params * 16 bytes   (master, mu, nu and the fp32 gradient)

Whether XLA then overlaps bucket i+1's copy with bucket i's update at link speed is measured on
an H200 by ``scripts/bench_offload_adamw.py`` (not yet run). On CPU the memory kinds exist but
the copies lower to nothing: tests check the numbers, not the transfers.

The update is optax.adamw's, operation for operation (``mu_dtype=float32``): after every step the
master equals optax.adamw applied to fp32 parameters with the same gradients upcast to fp32
(gradients of any dtype are upcast before use; optax given bf16 gradients would square and clip
them in bf16).

Legend: P parameters in all, beta = bucket_params, s = slots.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import pathlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax import lax
from jax.sharding import SingleDeviceSharding

from peakflat_jax._validate import as_int

Schedule = Callable[[jax.Array], jax.Array]


@dataclasses.dataclass(frozen=True)
class _Piece:
    """A run of one leaf's flattened elements inside one bucket."""

    leaf: int
    leaf_start: int
    bucket_start: int
    size: int


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Where every parameter sits: buckets of a flat vector over the leaves in tree order."""

    treedef: Any
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[Any, ...]
    bucket_sizes: tuple[int, ...]
    buckets: tuple[tuple[_Piece, ...], ...]

    @classmethod
    def of(cls, params, bucket_params: int) -> _Layout:
        leaves, treedef = jax.tree.flatten(params)
        sizes = [math.prod(leaf.shape) for leaf in leaves]
        total = sum(sizes)
        bucket_sizes = [min(bucket_params, total - start) for start in range(0, total,
                                                                                bucket_params)]
        leaf_starts = np.cumsum([0, *sizes])
        buckets = []
        for b, bucket_size in enumerate(bucket_sizes):
            lo, hi = b * bucket_params, b * bucket_params + bucket_size
            pieces = []
            for leaf, (start, end) in enumerate(zip(leaf_starts[:-1], leaf_starts[1:])):
                a, z = max(lo, start), min(hi, end)
                if a < z:
                    pieces.append(_Piece(leaf, int(a - start), int(a - lo), int(z - a)))
            buckets.append(tuple(pieces))
        return cls(treedef, tuple(leaf.shape for leaf in leaves),
                   tuple(jnp.dtype(leaf.dtype) for leaf in leaves), tuple(bucket_sizes),
                   tuple(buckets))

    def gather(self, leaves, bucket: int, dtype=jnp.float32) -> jax.Array:
        """Bucket ``bucket`` of the flat vector of ``leaves``, as ``dtype``."""
        parts = [leaves[p.leaf].reshape(-1)[p.leaf_start:p.leaf_start + p.size].astype(dtype)
                 for p in self.buckets[bucket]]
        return parts[0] if len(parts) == 1 else jnp.concatenate(parts)

    def scatter(self, buckets: list[jax.Array]) -> list[jax.Array]:
        """The leaves (in their dtypes and shapes) from the buckets of a flat vector."""
        parts: list[list[tuple[int, jax.Array]]] = [[] for _ in self.shapes]
        for bucket, pieces in zip(buckets, self.buckets):
            for p in pieces:
                parts[p.leaf].append((p.leaf_start, bucket[p.bucket_start:p.bucket_start + p.size]))
        leaves = []
        for shape, dtype, leaf_parts in zip(self.shapes, self.dtypes, parts):
            if not leaf_parts:  # a leaf of size zero lies in no bucket
                leaves.append(jnp.zeros(shape, dtype))
                continue
            flat = jnp.concatenate([x for _, x in sorted(leaf_parts, key=lambda t: t[0])])
            leaves.append(flat.astype(dtype).reshape(shape))
        return leaves

    def check(self, state: OffloadAdamWState) -> None:
        """Raises unless ``state`` was made for this layout (the same buckets)."""
        shapes = tuple(tuple(a.shape) for a in state.master)
        if shapes != tuple((n,) for n in self.bucket_sizes) or not (
                len(state.mu) == len(state.nu) == len(shapes)):
            raise ValueError(f"state: expected {len(self.bucket_sizes)} buckets of sizes "
                             f"{self.bucket_sizes} (from the last init), got {shapes}: a state "
                             f"of another optimizer, params tree or bucket_params")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class OffloadAdamWState:
    """Step count (device) and, per bucket, fp32 master weights and moments (host memory)."""

    count: jax.Array
    master: tuple[jax.Array, ...]
    mu: tuple[jax.Array, ...]
    nu: tuple[jax.Array, ...]


class OffloadStreamAdamW:
    """AdamW with host-resident fp32 state, streamed in buckets (see module doc).

    ``init(params) -> state``; ``step(grads, state) -> (params, state)``;
    ``master_params(state) -> fp32 pytree``.
    """

    def __init__(self, learning_rate: float | Schedule, b1: float = 0.9, b2: float = 0.999,
                 eps: float = 1e-8, weight_decay: float = 0.0,
                 bucket_params: int = 100_000_000, slots: int = 2,
                 max_grad_norm: float | None = None):
        if not callable(learning_rate) and not (_is_real(learning_rate) and learning_rate >= 0):
            raise ValueError(f"learning_rate: expected a non-negative number or an optax "
                             f"schedule, got {learning_rate!r}")
        for name, value in (("b1", b1), ("b2", b2)):
            if not (_is_real(value) and 0 <= value < 1):
                raise ValueError(f"{name}: expected a number in [0, 1), got {value!r}")
        if not (_is_real(eps) and eps > 0):
            raise ValueError(f"eps: expected a positive number, got {eps!r}")
        if not _is_real(weight_decay) or weight_decay < 0:
            raise ValueError(f"weight_decay: expected a non-negative number, got "
                             f"{weight_decay!r}")
        if as_int("bucket_params", bucket_params) < 1:
            raise ValueError(f"bucket_params: expected a positive int, got {bucket_params!r}")
        if as_int("slots", slots) < 1:
            raise ValueError(f"slots: expected a positive int, got {slots!r}")
        if max_grad_norm is not None and not (_is_real(max_grad_norm) and max_grad_norm > 0):
            raise ValueError(f"max_grad_norm: expected None or a positive number, got "
                             f"{max_grad_norm!r}")
        self.learning_rate = learning_rate if callable(learning_rate) else float(learning_rate)
        self.b1, self.b2, self.eps = float(b1), float(b2), float(eps)
        self.weight_decay = float(weight_decay)
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.bucket_params, self.slots = int(bucket_params), int(slots)
        self._layout: _Layout | None = None
        self._device = None
        self._step_fn = None

    # -- placement ------------------------------------------------------------------------------

    @staticmethod
    def _host(device) -> SingleDeviceSharding:
        return SingleDeviceSharding(device, memory_kind="pinned_host")

    def init(self, params) -> OffloadAdamWState:
        """fp32 master copies of ``params`` and zero moments, in host memory.

        It binds this optimizer to the params' structure: states from an earlier ``init`` with
        another structure are refused afterwards."""
        if not any(math.prod(leaf.shape) for leaf in jax.tree.leaves(params)):
            raise ValueError("params: expected at least one non-empty array")
        layout = _Layout.of(params, self.bucket_params)
        self._layout, self._step_fn = layout, None
        leaves = jax.tree.leaves(params)
        device = self._device = _single_device(leaves)
        host = self._host(device)

        def initial_state(leaves):
            master = tuple(layout.gather(leaves, b) for b in range(len(layout.bucket_sizes)))
            zeros = tuple(jnp.zeros_like(m) for m in master)
            return master, zeros, tuple(jnp.zeros_like(m) for m in master)

        shardings = tuple((host,) * len(layout.bucket_sizes) for _ in range(3))
        master, mu, nu = jax.jit(initial_state, out_shardings=shardings)(leaves)
        return OffloadAdamWState(jax.device_put(jnp.zeros((), jnp.int32), device), master, mu,
                                 nu)

    def master_params(self, state: OffloadAdamWState):
        """The fp32 master weights as a pytree shaped like the params."""
        layout = self._require_layout()
        layout.check(state)
        f32 = dataclasses.replace(layout, dtypes=(jnp.dtype(jnp.float32),) * len(layout.dtypes))
        return jax.tree.unflatten(layout.treedef, f32.scatter(
            [jax.device_put(m, m.sharding.with_memory_kind("device")) for m in state.master]))

    # -- checkpoints ----------------------------------------------------------------------------

    def save(self, directory, state: OffloadAdamWState) -> None:
        """Writes the state with orbax-checkpoint (a new directory)."""
        checkpointer = ocp.StandardCheckpointer()
        checkpointer.save(pathlib.Path(directory).absolute(), jax.device_get(state))
        checkpointer.wait_until_finished()

    def restore(self, directory) -> OffloadAdamWState:
        """The state saved by ``save``, back in host memory; ``init`` must have been called with
        params of the same structure (it fixes the bucket layout)."""
        layout = self._require_layout()
        device = jax.devices()[0] if self._device is None else self._device
        buckets = tuple(jax.ShapeDtypeStruct((n,), jnp.float32) for n in layout.bucket_sizes)
        target = OffloadAdamWState(jax.ShapeDtypeStruct((), jnp.int32), buckets, buckets, buckets)
        try:
            saved = ocp.StandardCheckpointer().restore(pathlib.Path(directory).absolute(), target)
        except ValueError as error:  # another bucket count: orbax's tree structures differ
            raise ValueError(f"state: the checkpoint in {directory} holds another bucket layout "
                             f"than this optimizer's {layout.bucket_sizes}: {error}") from error
        layout.check(saved)  # orbax returns what was saved, whatever the target's shapes
        host = self._host(device)
        return OffloadAdamWState(
            jax.device_put(saved.count, device),
            *(tuple(jax.device_put(a, host) for a in arrays)
              for arrays in (saved.master, saved.mu, saved.nu)))

    # -- the step -------------------------------------------------------------------------------

    def step(self, grads, state: OffloadAdamWState):
        """New working params (on device, in the params' dtypes) and the new state (on host).

        The state passed in is donated: use the returned one.
        """
        layout = self._require_layout()
        leaves, treedef = jax.tree.flatten(grads)
        if treedef != layout.treedef:
            raise ValueError(f"grads: expected the params' tree structure {layout.treedef}, got "
                             f"{treedef}")
        shapes = tuple(leaf.shape for leaf in leaves)
        if shapes != layout.shapes:
            raise ValueError(f"grads: expected leaf shapes {layout.shapes}, got {shapes}")
        layout.check(state)
        if self._step_fn is None:
            self._step_fn = self._compile_step(_single_device(leaves))
        new_leaves, state = self._step_fn(leaves, state)
        return jax.tree.unflatten(layout.treedef, new_leaves), state

    def _compile_step(self, device):
        layout = self._layout
        host = self._host(device)
        num_buckets = len(layout.bucket_sizes)
        state_shardings = OffloadAdamWState(
            SingleDeviceSharding(device), *((host,) * num_buckets for _ in range(3)))
        on_device = [SingleDeviceSharding(device)] * len(layout.shapes)
        # Declared memory kinds on both sides let donation pair host inputs with host outputs
        # only; left unknown, a donated host bucket could become a same-shaped device output.
        return jax.jit(self._update, donate_argnums=1, in_shardings=(on_device, state_shardings),
                       out_shardings=(on_device, state_shardings))

    def _update(self, grad_leaves, state: OffloadAdamWState):
        layout = self._layout
        count = state.count
        count_inc = _safe_increment(count)
        if callable(self.learning_rate):
            step_size = -self.learning_rate(count)
        else:
            step_size = -self.learning_rate
        clip = self._clip_factor(grad_leaves)
        working, written = [], []  # per bucket: new fp32 master on device; (master, mu, nu) home
        for b in range(len(layout.bucket_sizes)):
            host_in = (state.master[b], state.mu[b], state.nu[b])
            if b >= self.slots:  # wait for bucket b - slots to be home: at most `slots` staged
                host_in, _ = lax.optimization_barrier((host_in, written[b - self.slots]))
            master, mu, nu = (jax.device_put(a, jax.memory.Space.Device) for a in host_in)
            grad = layout.gather(grad_leaves, b)
            if clip is not None:
                grad = clip(grad)
            master, mu, nu = _adamw(master, mu, nu, grad, count_inc, step_size, b1=self.b1,
                                    b2=self.b2, eps=self.eps, weight_decay=self.weight_decay)
            working.append(master)
            out = tuple(jax.device_put(a, jax.memory.Space.Host) for a in (master, mu, nu))
            written.append(out)
        masters, mus, nus = (tuple(column) for column in zip(*written))
        new_state = OffloadAdamWState(count_inc, masters, mus, nus)
        return layout.scatter(working), new_state

    def _clip_factor(self, grad_leaves):
        """optax.clip_by_global_norm, applied per bucket with the global norm of all grads."""
        if self.max_grad_norm is None:
            return None
        norm = jnp.sqrt(sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in grad_leaves))
        max_norm = self.max_grad_norm

        def clip(g):
            return jnp.where(norm < max_norm, g, (g / norm.astype(g.dtype)) * max_norm)

        return clip

    def _require_layout(self) -> _Layout:
        if self._layout is None:
            raise ValueError("state: call init(params) on this optimizer first")
        return self._layout


def _adamw(master, mu, nu, grad, count_inc, step_size, *, b1, b2, eps, weight_decay):
    """optax.adamw (scale_by_adam, add_decayed_weights, scale_by_learning_rate, apply_updates),
    operation for operation, on fp32 arrays."""
    mu = (1 - b1) * grad + b1 * mu
    nu = (1 - b2) * grad**2 + b2 * nu
    mu_hat = mu / (1 - b1**count_inc).astype(mu.dtype)
    nu_hat = nu / (1 - b2**count_inc).astype(nu.dtype)
    update = mu_hat / (jnp.sqrt(nu_hat + 0.0) + eps)
    update = update + weight_decay * master
    update = jnp.asarray(step_size, update.dtype) * update
    return (master + update).astype(master.dtype), mu, nu


def _is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _safe_increment(count):
    """optax.numerics.safe_increment: count + 1, saturating at the int32 maximum."""
    max_value = jnp.iinfo(count.dtype).max
    return jnp.where(count < max_value, count + 1, max_value)


def _single_device(leaves):
    devices = {d for leaf in leaves for d in leaf.devices()}
    if len(devices) != 1:
        raise ValueError(f"params: expected every leaf on one device, got {len(devices)}: "
                         f"sharded (FSDP) parameters are not supported yet")
    return devices.pop()


def offload_stream_adamw(learning_rate: float | Schedule, b1: float = 0.9, b2: float = 0.999,
                         eps: float = 1e-8, weight_decay: float = 0.0,
                         bucket_params: int = 100_000_000, slots: int = 2,
                         max_grad_norm: float | None = None) -> OffloadStreamAdamW:
    """AdamW with fp32 state in host memory, streamed through the device in buckets."""
    return OffloadStreamAdamW(learning_rate, b1, b2, eps, weight_decay, bucket_params, slots,
                              max_grad_norm)
