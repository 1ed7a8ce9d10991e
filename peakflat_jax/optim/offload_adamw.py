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
Bucket i's host copies wait on bucket i - slots's write-back (an optimization barrier), so that
at most ``slots`` buckets should be staged on the device:

    staging ~ slots * bucket_params * 16 bytes   (master, mu, nu and the fp32 gradient)

Why it is fast: every copy is a whole array placed by XLA inside one program, so the copies run
at link speed and overlap the updates; the buckets are separate host arrays because slicing
one host array in a loop falls to 5 GB/s. Measured on one H200 with 2e9 parameters
(scripts/results/offload_adamw_gpu_20261130-070502.json): 0.780 s per step at 2.5e8 x 2 slots
(48 GB moved, 61.6 GB/s), against 0.876 s for moving the whole state and 2.38 s for
optax.adamw on 16 host cores. The step's XLA temporaries, the staging, were 4.3 and 8.0 GB at
2.5e8 x 1 and x 2 slots (formula: 4.0 and 8.0) and 2.4 and 3.6 GB at 1e8 (formula: 1.6 and
3.2): each bucket's working pieces are cast inside its update and tied into the slot chain, so
no fp32 master outlives its write-back (before that, 2.5e8 x 2 held 12.1 GiB). On CPU the
memory kinds exist but the copies lower to nothing: tests check the numbers, not the
transfers.

The limit is the link as XLA drives it: 23.6 GB each way as independent whole-array copies in
one program took 0.880 s, as long as one direction after the other (0.859 s;
offload_adamw_gpu_20261130-090838.json). XLA issues host copies of both directions on one
extra stream (openxla/xla#10450), and larger buckets or more slots (5e8, 3 slots: 0.83 s)
gained nothing.

FSDP. Params (and grads, placed alike) may be NamedShardings on one mesh. The buckets are then
cut from each device's own shards, and each bucket of the state is one global array of
``num_devices * bucket`` elements, a piece per device in host memory. Each device updates only
its shards (``shard_map``): the step moves nothing between devices except, with clipping, the
scalar global norm (an all-reduce). Unsharded params run the same code on a one-device mesh.
Limit: a leaf replicated over some mesh axes is updated identically on every device that holds
it, so its host state and its host traffic are multiplied by its replication (on a mesh of
pure data parallelism, by the number of devices); sharding the state over the replicas (ZeRO-1)
is not done. Checkpoints record the layout, and ``restore`` refuses one saved for another
(the pieces belong to mesh positions); ``save`` gathers the state into one process.

The update is optax.adamw's, operation for operation (``mu_dtype=float32``): after every step the
master equals optax.adamw applied to fp32 parameters with the same gradients upcast to fp32
(gradients of any dtype are upcast before use; optax given bf16 gradients would square and clip
them in bf16).

Legend: P parameters in all, beta = bucket_params, s = slots.
"""

from __future__ import annotations

import dataclasses
import functools
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
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

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
class _Placement:
    """Where the leaves live: a mesh, each leaf's PartitionSpec on it, and the shape of the
    shard each device holds. Unsharded params live on a one-device mesh, so one code path serves
    both. Every device streams the state of its own shards (FSDP: each updates its part)."""

    mesh: Mesh
    specs: tuple[P, ...]
    local_shapes: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, leaves) -> _Placement:
        shardings = [leaf.sharding for leaf in leaves]
        if all(isinstance(s, SingleDeviceSharding) for s in shardings):
            devices = {d for s in shardings for d in s.device_set}
            if len(devices) != 1:
                raise ValueError(f"params: expected every leaf on one device or on one mesh, "
                                 f"got leaves on {len(devices)} devices")
            mesh = Mesh(np.array(list(devices)), ("device",))
            return cls(mesh, tuple(P() for _ in leaves), tuple(leaf.shape for leaf in leaves))
        meshes = {s.mesh for s in shardings if isinstance(s, NamedSharding)}
        if len(meshes) != 1 or not all(isinstance(s, NamedSharding) for s in shardings):
            raise ValueError(f"params: expected every leaf to be a NamedSharding on one mesh "
                             f"(or every leaf on one device), got {sorted(map(str, shardings))}")
        mesh = meshes.pop()
        return cls(mesh, tuple(s.spec for s in shardings),
                   tuple(tuple(s.shard_shape(leaf.shape)) for s, leaf in zip(shardings, leaves)))

    @property
    def num_devices(self) -> int:
        return self.mesh.devices.size

    @property
    def flat_spec(self) -> P:
        """The state's spec: one flat axis split over every mesh axis, a piece per device."""
        return P(tuple(self.mesh.axis_names))

    def state_sharding(self, memory_kind: str) -> NamedSharding:
        return NamedSharding(self.mesh, self.flat_spec, memory_kind=memory_kind)

    def leaf_shardings(self) -> list[NamedSharding]:
        return [NamedSharding(self.mesh, spec) for spec in self.specs]

    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    def local(self, fn, in_specs, out_specs):
        """``fn`` on each device's shards (shard_map over the whole mesh)."""
        return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs,
                             check_vma=False)


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Where every parameter sits: buckets of a flat vector over the leaves in tree order. On a
    mesh, the leaves are each device's shards, and a bucket of the state is a global array of
    ``num_devices * bucket_size`` elements, one piece per device."""

    treedef: Any
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[Any, ...]
    placement: _Placement
    bucket_sizes: tuple[int, ...]
    buckets: tuple[tuple[_Piece, ...], ...]

    @classmethod
    def of(cls, params, bucket_params: int) -> _Layout:
        leaves, treedef = jax.tree.flatten(params)
        placement = _Placement.of(leaves)
        sizes = [math.prod(shape) for shape in placement.local_shapes]
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
                   tuple(jnp.dtype(leaf.dtype) for leaf in leaves), placement,
                   tuple(bucket_sizes), tuple(buckets))

    def gather(self, local_leaves, bucket: int, dtype=jnp.float32) -> jax.Array:
        """Bucket ``bucket`` of the flat vector of this device's shards, as ``dtype``."""
        parts = [local_leaves[p.leaf].reshape(-1)[p.leaf_start:p.leaf_start + p.size]
                 .astype(dtype) for p in self.buckets[bucket]]
        return parts[0] if len(parts) == 1 else jnp.concatenate(parts)

    def pieces(self, bucket_array: jax.Array, bucket: int, dtypes=None) -> tuple:
        """The pieces of this device's part of ``bucket``, each cast to its leaf's dtype (or
        ``dtypes``'s)."""
        dtypes = self.dtypes if dtypes is None else dtypes
        return tuple(bucket_array[p.bucket_start:p.bucket_start + p.size].astype(dtypes[p.leaf])
                     for p in self.buckets[bucket])

    def assemble(self, pieces_per_bucket, dtypes=None) -> list[jax.Array]:
        """This device's shards (in their local shapes) from every bucket's ``pieces``."""
        dtypes = self.dtypes if dtypes is None else dtypes
        parts: list[list[tuple[int, jax.Array]]] = [[] for _ in self.shapes]
        for pieces, layout in zip(pieces_per_bucket, self.buckets):
            for piece, p in zip(pieces, layout):
                parts[p.leaf].append((p.leaf_start, piece))
        leaves = []
        for shape, dtype, leaf_parts in zip(self.placement.local_shapes, dtypes, parts):
            if not leaf_parts:  # a leaf of size zero lies in no bucket
                leaves.append(jnp.zeros(shape, dtype))
                continue
            flat = jnp.concatenate([x for _, x in sorted(leaf_parts, key=lambda t: t[0])])
            leaves.append(flat.reshape(shape))
        return leaves

    def scatter(self, buckets: list[jax.Array], dtypes=None) -> list[jax.Array]:
        """This device's shards (in ``dtypes``, default the leaves') from its parts of the
        buckets."""
        return self.assemble([self.pieces(a, b, dtypes) for b, a in enumerate(buckets)], dtypes)

    def describe(self) -> dict:
        """What a checkpoint must match to be restored here (JSON): the buckets, and the mesh
        positions and shards whose pieces they hold."""
        mesh = self.placement.mesh
        return {"bucket_sizes": list(self.bucket_sizes),
                "shapes": [list(shape) for shape in self.shapes],
                "dtypes": [str(dtype) for dtype in self.dtypes],
                # In order: the state's pieces follow the mesh positions, axis by axis.
                "mesh": [[str(name), int(size)] for name, size in mesh.shape.items()],
                "specs": [str(spec) for spec in self.placement.specs],
                "local_shapes": [list(shape) for shape in self.placement.local_shapes]}

    def state_shapes(self) -> tuple[tuple[int], ...]:
        return tuple((self.placement.num_devices * n,) for n in self.bucket_sizes)

    def check(self, state: OffloadAdamWState) -> None:
        """Raises unless ``state`` was made for this layout (the same buckets)."""
        shapes = tuple(tuple(a.shape) for a in state.master)
        if shapes != self.state_shapes() or not (len(state.mu) == len(state.nu) == len(shapes)):
            raise ValueError(f"state: expected {len(self.bucket_sizes)} buckets of "
                             f"{self.placement.num_devices} x {self.bucket_sizes} elements (from "
                             f"the last init), got {shapes}: a state of another optimizer, params "
                             f"tree, sharding or bucket_params")


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
        self._step_fn = None

    def init(self, params) -> OffloadAdamWState:
        """fp32 master copies of ``params`` and zero moments, in host memory.

        ``params`` live on one device, or as NamedShardings on one mesh (FSDP); each device
        then keeps the state of its own shards. It binds this optimizer to the params'
        structure and placement: states from an earlier ``init`` with another are refused."""
        if not any(math.prod(leaf.shape) for leaf in jax.tree.leaves(params)):
            raise ValueError("params: expected at least one non-empty array")
        layout = _Layout.of(params, self.bucket_params)
        self._layout, self._step_fn = layout, None
        placement = layout.placement
        num_buckets = len(layout.bucket_sizes)

        def initial_state(*local_leaves):
            master = tuple(layout.gather(local_leaves, b) for b in range(num_buckets))
            zeros = tuple(jnp.zeros_like(m) for m in master)
            return master, zeros, tuple(jnp.zeros_like(m) for m in master)

        local = placement.local(initial_state, in_specs=placement.specs,
                                out_specs=((placement.flat_spec,) * num_buckets,) * 3)
        host = placement.state_sharding("pinned_host")
        master, mu, nu = jax.jit(local, out_shardings=((host,) * num_buckets,) * 3)(
            *jax.tree.leaves(params))
        count = jax.device_put(jnp.zeros((), jnp.int32), placement.replicated())
        return OffloadAdamWState(count, master, mu, nu)

    def master_params(self, state: OffloadAdamWState):
        """The fp32 master weights as a pytree shaped (and sharded) like the params."""
        layout = self._require_layout()
        layout.check(state)
        placement = layout.placement
        f32 = (jnp.dtype(jnp.float32),) * len(layout.dtypes)
        local = placement.local(lambda *buckets: tuple(layout.scatter(buckets, f32)),
                                in_specs=(placement.flat_spec,) * len(state.master),
                                out_specs=placement.specs)
        on_device = [jax.device_put(m, placement.state_sharding("device")) for m in state.master]
        return jax.tree.unflatten(layout.treedef, jax.jit(local)(*on_device))

    # -- checkpoints ----------------------------------------------------------------------------

    def save(self, directory, state: OffloadAdamWState) -> None:
        """Writes the state and its layout with orbax-checkpoint (a new directory).

        One process (one host): the state is gathered into this process to be written."""
        layout = self._require_layout()
        layout.check(state)
        checkpointer = ocp.Checkpointer(ocp.CompositeCheckpointHandler())
        checkpointer.save(pathlib.Path(directory).absolute(), args=ocp.args.Composite(
            state=ocp.args.StandardSave(jax.device_get(state)),
            layout=ocp.args.JsonSave(layout.describe())))

    def restore(self, directory) -> OffloadAdamWState:
        """The state saved by ``save``, back in host memory; ``init`` must have been called with
        params of the same structure and placement (they fix the bucket layout). A checkpoint
        of another layout is refused: its pieces belong to other shards."""
        layout = self._require_layout()
        path = pathlib.Path(directory).absolute()
        checkpointer = ocp.Checkpointer(ocp.CompositeCheckpointHandler())
        saved_layout = checkpointer.restore(
            path, args=ocp.args.Composite(layout=ocp.args.JsonRestore()))["layout"]
        expected = layout.describe()
        differences = {key: (value, expected.get(key)) for key, value in saved_layout.items()
                       if expected.get(key) != value}
        if differences:
            raise ValueError(f"state: the checkpoint in {directory} was saved for another layout "
                             f"(saved vs this optimizer's): {differences}")
        buckets = tuple(jax.ShapeDtypeStruct(shape, jnp.float32)
                        for shape in layout.state_shapes())
        target = OffloadAdamWState(jax.ShapeDtypeStruct((), jnp.int32), buckets, buckets, buckets)
        saved = checkpointer.restore(path, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(target)))["state"]
        layout.check(saved)
        host = layout.placement.state_sharding("pinned_host")
        return OffloadAdamWState(
            jax.device_put(saved.count, layout.placement.replicated()),
            *(tuple(jax.device_put(a, host) for a in arrays)
              for arrays in (saved.master, saved.mu, saved.nu)))

    # -- the step -------------------------------------------------------------------------------

    def step(self, grads, state: OffloadAdamWState):
        """New working params (on device, in the params' dtypes and shardings) and the new
        state (on host).

        The state passed in is donated: use the returned one. Grads placed unlike the params are
        moved to the params' placement first.
        """
        layout = self._require_layout()
        leaves, treedef = jax.tree.flatten(grads)
        if treedef != layout.treedef:
            raise ValueError(f"grads: expected the params' tree structure {layout.treedef}, got "
                             f"{treedef}")
        shapes = tuple(leaf.shape for leaf in leaves)
        if shapes != layout.shapes:
            raise ValueError(f"grads: expected leaf shapes {layout.shapes}, got {shapes}")
        # Grads placed otherwise (GSPMD may choose another layout for them) are moved to the
        # params' placement first: a resharding collective, never a different update.
        leaves = [g if isinstance(getattr(g, "sharding", None), jax.sharding.Sharding)
                  and g.sharding.is_equivalent_to(target, g.ndim) else jax.device_put(g, target)
                  for g, target in zip(leaves, layout.placement.leaf_shardings())]
        layout.check(state)
        if self._step_fn is None:
            self._step_fn = self._compile_step()
        new_leaves, state = self._step_fn(leaves, state)
        return jax.tree.unflatten(layout.treedef, new_leaves), state

    def _compile_step(self):
        layout = self._layout
        placement = layout.placement
        host = placement.state_sharding("pinned_host")
        num_buckets = len(layout.bucket_sizes)
        state_shardings = OffloadAdamWState(placement.replicated(),
                                            *((host,) * num_buckets for _ in range(3)))
        on_device = placement.leaf_shardings()
        # Declared memory kinds on both sides let donation pair host inputs with host outputs
        # only; left unknown, a donated host bucket could become a same-shaped device output.
        return jax.jit(self._update, donate_argnums=1, in_shardings=(on_device, state_shardings),
                       out_shardings=(on_device, state_shardings))

    def _update(self, grad_leaves, state: OffloadAdamWState):
        layout = self._layout
        placement = layout.placement
        flat, replicated = placement.flat_spec, P()
        count = state.count
        count_inc = _safe_increment(count)
        if callable(self.learning_rate):
            step_size = -self.learning_rate(count)
        else:
            step_size = -jnp.asarray(self.learning_rate, jnp.float32)
        # The global norm of the global arrays: XLA sums each shard once, whatever the mesh.
        norm = self._global_norm(grad_leaves)
        scalars = (count_inc, step_size) + (() if norm is None else (norm,))
        hyper = dict(b1=self.b1, b2=self.b2, eps=self.eps, weight_decay=self.weight_decay)

        def update_bucket(b, local_grads, master, mu, nu, count_inc, step_size, norm=None):
            grad = layout.gather(local_grads, b)
            if norm is not None:  # optax.clip_by_global_norm, given the global norm
                grad = jnp.where(norm < self.max_grad_norm, grad,
                                 (grad / norm.astype(grad.dtype)) * self.max_grad_norm)
            master, mu, nu = _adamw(master, mu, nu, grad, count_inc, step_size, **hyper)
            # The working pieces are cast here, so that no bucket's fp32 master outlives its
            # write-back (on an H200, buckets that split leaves kept every master to the end).
            return master, mu, nu, layout.pieces(master, b)

        working, written = [], []  # per bucket: the working pieces; (master, mu, nu) home
        for b in range(len(layout.bucket_sizes)):
            host_in = (state.master[b], state.mu[b], state.nu[b])
            if b >= self.slots:  # wait for bucket b - slots to be done: at most `slots` staged
                host_in, _ = lax.optimization_barrier(
                    (host_in, (written[b - self.slots], working[b - self.slots])))
            master, mu, nu = (jax.device_put(a, jax.memory.Space.Device) for a in host_in)
            local = placement.local(functools.partial(update_bucket, b),
                                    in_specs=(list(placement.specs), flat, flat, flat)
                                    + (replicated,) * len(scalars),
                                    out_specs=(flat, flat, flat,
                                               (flat,) * len(layout.buckets[b])))
            master, mu, nu, pieces = local(list(grad_leaves), master, mu, nu, *scalars)
            working.append(pieces)
            written.append(tuple(jax.device_put(a, jax.memory.Space.Host)
                                 for a in (master, mu, nu)))
        masters, mus, nus = (tuple(column) for column in zip(*written))
        new_state = OffloadAdamWState(count_inc, masters, mus, nus)
        assemble = placement.local(lambda pieces: tuple(layout.assemble(pieces)),
                                   in_specs=(tuple((flat,) * len(p) for p in working),),
                                   out_specs=placement.specs)
        return list(assemble(tuple(working))), new_state

    def _global_norm(self, grad_leaves):
        """The global gradient norm, or None without clipping."""
        if self.max_grad_norm is None:
            return None
        return jnp.sqrt(sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in grad_leaves))

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


def offload_stream_adamw(learning_rate: float | Schedule, b1: float = 0.9, b2: float = 0.999,
                         eps: float = 1e-8, weight_decay: float = 0.0,
                         bucket_params: int = 100_000_000, slots: int = 2,
                         max_grad_norm: float | None = None) -> OffloadStreamAdamW:
    """AdamW with fp32 state in host memory, streamed through the device in buckets."""
    return OffloadStreamAdamW(learning_rate, b1, b2, eps, weight_decay, bucket_params, slots,
                              max_grad_norm)
