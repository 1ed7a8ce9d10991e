"""OffloadStreamAdamW: AdamW whose fp32 state lives in host memory and streams through the device
in buckets.

The device keeps the working parameters (their own dtype, e.g. bf16) and the gradients. The
fp32 master weights and both moments (12 bytes per parameter) live in host memory (memory kind
``pinned_host``). The parameters, taken as one flat vector in tree order, are cut into buckets
of at most ``bucket_params`` (a bucket may split a leaf), and each bucket keeps its own host
arrays.

One jitted step, buckets unrolled: for each bucket, copy (master, mu, nu) host -> device
(``device_put`` to ``Space.Device`` inside jit), apply AdamW with the bucket's gradient pieces,
cast the new working pieces, and copy the state back (``Space.Host``). Bucket i's host copies
wait on bucket i - slots's write-back and working pieces (an optimization barrier), so that at
most ``slots`` buckets are staged on the device. The per-device bounds are
``offload_stream_adamw_memory_terms`` (device) and ``offload_stream_adamw_host_bytes`` (host);
the formulas are in ``MEMORY_FORMULAS``.

Why it is shaped so:
- Every copy is a whole array placed by XLA inside one program: that is the fast path for host
  copies, and XLA overlaps them with the updates of other buckets. The buckets are separate host
  arrays because slicing one host array inside a loop is a slow path (JAX-NOTES.md).
- The buckets are unrolled in Python, not scanned: XLA overlaps host copies in straight-line
  code, not across loop iterations (JAX-NOTES.md); the barrier chain bounds what unrolling
  would otherwise leave unbounded.
- Each bucket's working pieces are cast inside its update and tied into the slot chain, so that
  no bucket's fp32 master outlives its write-back.
- The step is its own jitted program that donates the state: the train step is two programs
  (gradients, then the optimizer). The state is the only thing the step keeps between calls.
- The layout (buckets, placement, tree structure) is static metadata of the state, not of the
  optimizer: ``step(grads, state)`` depends on its arguments only, and one optimizer serves
  any number of states. The state is a pytree of arrays, so the trainer's orbax
  CheckpointManager saves and restores it like the params (pinned_host arrays restore into
  host memory given the target ``abstract_state(params)``); the layout goes
  beside it as JSON (``state_metadata``), and ``check_metadata`` refuses a checkpoint of
  another layout before its pieces land on the wrong shards.

FSDP. Params (and grads, placed alike) may be NamedShardings on one mesh. The buckets are then
cut from each device's own shards, and each bucket of the state is one global array of
``num_devices * bucket`` elements, a piece per device in host memory. Each device updates only
its shards (``shard_map``): the step moves nothing between devices except, with clipping, the
scalar global norm (an all-reduce). Unsharded params run the same code on a one-device mesh.
Limit: a leaf replicated over some mesh axes is updated identically on every device that holds
it, so its host state and its host traffic are multiplied by its replication (on a mesh of
pure data parallelism, by the number of devices); sharding the state over the replicas (ZeRO-1)
is not done.

The update is optax.adamw's, operation for operation (``mu_dtype=float32``): after every step the
master equals optax.adamw applied to fp32 parameters with the same gradients upcast to fp32
(gradients of any dtype are upcast before use; optax given bf16 gradients would square and clip
them in bf16). On CPU the memory kinds exist but the copies lower to nothing: tests check the
numbers and XLA's plan, not the transfers.

Legend: P parameters per device (the local shards, replicated leaves counted whole), beta =
bucket_params, s = slots, b = bytes per element of the working params.

Measured: docs/offload_adamw.md
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from peakflat_jax._validate import as_int

Schedule = Callable[[jax.Array], jax.Array]

MEMORY_FORMULAS = {
    "staging": "min(s, num_buckets) * min(beta, P) * 16  (fp32 master, mu, nu and grad of each "
               "staged bucket: what the slot chain bounds)",
    "staging_gpu_excess": "min(beta, P) * 8  (what XLA's GPU plan of the step held beyond the "
                          "slots, at most, in the measured sweep)",
    "working_params": "P * b  (the new working params: the step's output, the trainer's)",
    "grads": "P * b  (the gradients: the step's input, the trainer's)",
}


def offload_stream_adamw_memory_terms(num_params_per_device: int, bucket_params: int,
                                      slots: int, param_dtype) -> dict[str, int]:
    """Per-device bytes of each term of the step's device bound (``MEMORY_FORMULAS``).

    ``staging`` and ``staging_gpu_excess`` are the optimizer's own (the step's XLA
    temporaries); ``working_params`` and ``grads`` are the trainer's arrays that the step writes
    and reads, listed so that a planner adding up the optimizer's device memory needs nothing
    else."""
    num_params = as_int("num_params_per_device", num_params_per_device)
    for name, value in (("num_params_per_device", num_params), ("bucket_params", bucket_params),
                        ("slots", slots)):
        if as_int(name, value) < 1:
            raise ValueError(f"{name}: expected a positive int, got {value!r}")
    bucket = min(bucket_params, num_params)
    num_buckets = -(-num_params // bucket)
    itemsize = jnp.dtype(param_dtype).itemsize
    return {"staging": min(slots, num_buckets) * bucket * 16,
            "staging_gpu_excess": bucket * 8,
            "working_params": num_params * itemsize,
            "grads": num_params * itemsize}


def offload_stream_adamw_host_bytes(num_params_per_device: int) -> int:
    """Per-device host bytes of the state: fp32 master, mu and nu, 12 * P."""
    return 12 * as_int("num_params_per_device", num_params_per_device)


# -- the optimizer --------------------------------------------------------------------------------


class OffloadStreamAdamW:
    """AdamW with host-resident fp32 state, streamed in buckets (see the module doc).

    ``opt = offload_stream_adamw(learning_rate, b1, b2, eps, weight_decay, bucket_params, slots,
    max_grad_norm)`` holds hyperparameters only; ``state = opt.init(params)``;
    ``params, state = opt.step(grads, state)``; ``opt.master_params(state)`` -> fp32 pytree.
    ``learning_rate`` is a non-negative number or an optax schedule; ``max_grad_norm`` clips the
    gradients to that global norm first (as ``optax.clip_by_global_norm``).
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
        # A cache, not state: the jitted step of each layout met so far (its shardings differ).
        self._jitted_steps: dict[_Layout, Callable] = {}

    def init(self, params) -> OffloadAdamWState:
        """fp32 master copies of ``params`` and zero moments, in host memory; the state carries
        its layout.

        ``params`` live on one device, or as NamedShardings on one mesh (FSDP); each device
        then keeps the state of its own shards."""
        if not any(math.prod(leaf.shape) for leaf in jax.tree.leaves(params)):
            raise ValueError("params: expected at least one non-empty array")
        layout = _Layout.of(params, self.bucket_params)
        placement = layout.placement
        num_buckets = len(layout.bucket_sizes)

        def initial_buckets(*local_leaves):
            master = tuple(layout.gather(local_leaves, b) for b in range(num_buckets))
            return master, tuple(map(jnp.zeros_like, master)), tuple(map(jnp.zeros_like, master))

        buckets = placement.local(initial_buckets, in_specs=placement.specs,
                                  out_specs=((placement.flat_spec,) * num_buckets,) * 3)

        def initial_state(leaves):
            return OffloadAdamWState(jnp.zeros((), jnp.int32), *buckets(*leaves), layout=layout)

        return jax.jit(initial_state, out_shardings=layout.state_shardings())(
            jax.tree.leaves(params))

    def abstract_state(self, params) -> OffloadAdamWState:
        """The state ``init(params)`` would make, as ShapeDtypeStructs with their shardings
        (memory kind pinned_host for the buckets), allocating nothing: a checkpoint restore
        target. ``params`` may be arrays or ShapeDtypeStructs with shardings."""
        layout = _Layout.of(params, self.bucket_params)
        shardings = layout.state_shardings()
        count = jax.ShapeDtypeStruct((), jnp.int32, sharding=shardings.count)
        buckets = tuple(jax.ShapeDtypeStruct(shape, jnp.float32, sharding=sharding)
                        for shape, sharding in zip(layout.state_shapes(), shardings.master))
        return OffloadAdamWState(count, buckets, buckets, buckets, layout=layout)

    def step(self, grads, state: OffloadAdamWState):
        """New working params (on device, in the params' dtypes and shardings) and the new
        state (on host).

        The state passed in is donated: use the returned one. Grads placed unlike the params are
        moved to the params' placement first.
        """
        leaves = self._grad_leaves(grads, state)
        new_leaves, state = self._jitted_step(state.layout)(leaves, state)
        return jax.tree.unflatten(state.layout.treedef, new_leaves), state

    def lower(self, grads, state: OffloadAdamWState) -> jax.stages.Lowered:
        """The step lowered for these arguments (``.compile()`` for XLA's memory plan and HLO)."""
        return self._jitted_step(state.layout).lower(self._grad_leaves(grads, state), state)

    def master_params(self, state: OffloadAdamWState):
        """The fp32 master weights as a pytree shaped (and sharded) like the params."""
        layout = _checked_layout(state)
        placement = layout.placement
        f32 = (jnp.dtype(jnp.float32),) * len(layout.dtypes)
        scatter = placement.local_to_leaves(lambda *buckets: tuple(layout.scatter(buckets, f32)),
                                            in_specs=(placement.flat_spec,) * len(state.master))
        on_device = [jax.device_put(m, placement.state_sharding("device")) for m in state.master]
        return jax.tree.unflatten(layout.treedef, jax.jit(scatter)(*on_device))

    # -- checkpoints: the state is saved by the trainer's orbax call; its layout goes beside it --

    def state_metadata(self, state: OffloadAdamWState) -> dict:
        """The state's layout as JSON, to save beside the state (e.g. ``ocp.args.JsonSave``)."""
        return _checked_layout(state).describe()

    def check_metadata(self, state: OffloadAdamWState, metadata: dict) -> None:
        """Raises ValueError unless ``metadata`` (from ``state_metadata`` of a saved state)
        describes ``state``'s layout: the same buckets of the same shards on the same mesh
        positions. Call it before restoring into ``state``'s layout: a checkpoint of another
        layout would put each piece of state on another parameter."""
        expected = _checked_layout(state).describe()
        if not isinstance(metadata, dict):
            raise ValueError(f"metadata: expected the dict of state_metadata, got "
                             f"{type(metadata).__name__}")
        differences = {key: (metadata.get(key), value) for key, value in expected.items()
                       if metadata.get(key) != value}
        if differences:
            raise ValueError(f"metadata: the checkpoint's optimizer state was saved for another "
                             f"layout (saved vs this state's): {differences}")

    # -- the step -------------------------------------------------------------------------------

    def _grad_leaves(self, grads, state: OffloadAdamWState) -> list[jax.Array]:
        """The grads' leaves, checked against the state's layout and placed like the params."""
        layout = _checked_layout(state)
        leaves, treedef = jax.tree.flatten(grads)
        if treedef != layout.treedef:
            raise ValueError(f"grads: expected the params' tree structure {layout.treedef}, got "
                             f"{treedef}")
        shapes = tuple(tuple(leaf.shape) for leaf in leaves)
        if shapes != layout.shapes:
            raise ValueError(f"grads: expected leaf shapes {layout.shapes}, got {shapes}")
        # Grads placed otherwise (GSPMD may choose another layout for them) are moved to the
        # params' placement first: a resharding collective, never a different update.
        return [g if isinstance(getattr(g, "sharding", None), jax.sharding.Sharding)
                and g.sharding.is_equivalent_to(target, g.ndim) else jax.device_put(g, target)
                for g, target in zip(leaves, layout.placement.leaf_shardings())]

    def _jitted_step(self, layout: _Layout):
        if layout not in self._jitted_steps:
            on_device = layout.placement.leaf_shardings()
            state_shardings = layout.state_shardings()
            # Declared memory kinds on both sides let donation pair host inputs with host outputs
            # only; left unknown, a donated host bucket could become a same-shaped device output.
            self._jitted_steps[layout] = jax.jit(
                self._update, donate_argnums=1, in_shardings=(on_device, state_shardings),
                out_shardings=(on_device, state_shardings))
        return self._jitted_steps[layout]

    def _update(self, grad_leaves, state: OffloadAdamWState):
        layout = state.layout
        placement = layout.placement
        flat, replicated = placement.flat_spec, P()
        count_inc = _safe_increment(state.count)
        if callable(self.learning_rate):
            step_size = -self.learning_rate(state.count)
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
        new_state = OffloadAdamWState(count_inc, masters, mus, nus, layout=layout)
        assemble = placement.local_to_leaves(lambda pieces: tuple(layout.assemble(pieces)),
                                             in_specs=(tuple((flat,) * len(p) for p in working),))
        return list(assemble(tuple(working))), new_state

    def _global_norm(self, grad_leaves):
        """The global gradient norm, or None without clipping."""
        if self.max_grad_norm is None:
            return None
        return jnp.sqrt(sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in grad_leaves))


offload_stream_adamw = OffloadStreamAdamW


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


# -- the state and its layout ---------------------------------------------------------------------


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
            return cls(mesh, tuple(P() for _ in leaves),
                       tuple(tuple(leaf.shape) for leaf in leaves))
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
        return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs)

    def local_to_leaves(self, fn, in_specs):
        """``fn`` on each device's parts of the buckets, returning its shards of the leaves.

        check_vma=False: the buckets are split over every mesh axis, so the type system sees
        every piece as varying over all of them. A leaf replicated over some axes is rebuilt from
        pieces that are equal on its replicas (each replica applied the same update to the same
        values), which JAX cannot infer; making it inferable would take a collective."""
        return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=self.specs,
                             check_vma=False)


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Where every parameter sits: buckets of a flat vector over the leaves in tree order. On a
    mesh, the leaves are each device's shards, and a bucket of the state is a global array of
    ``num_devices * bucket_size`` elements, one piece per device. Hashable: the state's static
    metadata."""

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
        return cls(treedef, tuple(tuple(leaf.shape) for leaf in leaves),
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

    def scatter(self, buckets, dtypes=None) -> list[jax.Array]:
        """This device's shards (in ``dtypes``, default the leaves') from its parts of the
        buckets."""
        return self.assemble([self.pieces(a, b, dtypes) for b, a in enumerate(buckets)], dtypes)

    def describe(self) -> dict:
        """What a checkpoint must match to be restored here (JSON): the buckets, and the mesh
        positions and shards whose pieces they hold."""
        mesh = self.placement.mesh
        return {"bucket_sizes": list(self.bucket_sizes),
                "treedef": str(self.treedef),
                "shapes": [list(shape) for shape in self.shapes],
                "dtypes": [str(dtype) for dtype in self.dtypes],
                # In order: the state's pieces follow the mesh positions, axis by axis.
                "mesh": [[str(name), int(size)] for name, size in mesh.shape.items()],
                "specs": [str(spec) for spec in self.placement.specs],
                "local_shapes": [list(shape) for shape in self.placement.local_shapes]}

    def __repr__(self) -> str:  # the state's treedef prints it: keep it to a line
        return (f"_Layout({len(self.bucket_sizes)} buckets of {self.bucket_sizes[:4]}"
                f"{'...' if len(self.bucket_sizes) > 4 else ''} over {len(self.shapes)} leaves, "
                f"mesh {dict(self.placement.mesh.shape)})")

    def state_shapes(self) -> tuple[tuple[int], ...]:
        return tuple((self.placement.num_devices * n,) for n in self.bucket_sizes)

    def state_shardings(self) -> OffloadAdamWState:
        """The state's shardings: the count replicated on device, the buckets in host memory."""
        host = (self.placement.state_sharding("pinned_host"),) * len(self.bucket_sizes)
        return OffloadAdamWState(self.placement.replicated(), host, host, host, layout=self)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class OffloadAdamWState:
    """Step count (device) and, per bucket, fp32 master weights and moments (host memory); the
    layout is static metadata (not a leaf: jit and orbax see only the arrays)."""

    count: jax.Array
    master: tuple[jax.Array, ...]
    mu: tuple[jax.Array, ...]
    nu: tuple[jax.Array, ...]
    layout: _Layout = dataclasses.field(metadata=dict(static=True))


def _checked_layout(state) -> _Layout:
    """``state``'s layout, after checking that its arrays are the ones the layout describes."""
    if not isinstance(state, OffloadAdamWState):
        raise ValueError(f"state: expected the OffloadAdamWState of init, got "
                         f"{type(state).__name__}")
    layout = state.layout
    expected = layout.state_shapes()
    for name in ("master", "mu", "nu"):
        shapes = tuple(tuple(a.shape) for a in getattr(state, name))
        if shapes != expected:
            raise ValueError(f"state: expected {len(expected)} {name} buckets of shapes "
                             f"{expected} (its layout's), got {shapes}")
    return layout
