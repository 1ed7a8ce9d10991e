"""The run's optimizer: AdamW with warm-up, cosine decay and global-norm clipping, its state in
host memory streamed through the device (``pf.offload_stream``), on the device (``optax.adamw``,
sharded like the params, ``DeviceAdamW``), or in host memory updated by the host CPU
(``HostCpuAdamW``, ZeRO-Offload's placement: ``optimizer.update_on: host_cpu``). The schedule
runs on the host: each step's rate (and the other hyperparameters) go into the state before the
step, so the compiled step does not depend on them.

All keep an fp32 master copy of every weight and give the model its working dtype: the
offloaded and host-CPU ones in host memory by design, the device one on the device when the
working dtype is narrower than fp32 (mixed precision's usual 16 bytes per parameter: bf16
weight and gradient, fp32 master and two moments). So switching the placement changes where
the state lives and which processor updates it, never the update: each applies optax.adamw's
arithmetic to the fp32 master (the host-CPU placement ``DeviceAdamW``'s own injected AdamW,
leaf after leaf).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from peakflat_jax.config import OptimizerConfig
from peakflat_jax.optim.offload_stream import OffloadStreamState, offload_stream


def learning_rate_schedule(config: OptimizerConfig, total_steps: int) -> optax.Schedule:
    """Linear warm-up over W = ``warmup_steps`` steps from peak / (W + 1) (step s takes peak
    (s + 1) / (W + 1), the peak at step W), then cosine decay to ``min_learning_rate_ratio`` x
    peak at ``total_steps`` (or constant). Not from 0: optax counts steps from 0, so a warm-up
    from 0 makes the first update a no-op that still moves Adam's moments."""
    peak, warmup = config.learning_rate, config.warmup_steps
    start = peak / (warmup + 1)
    if config.decay == "cosine":
        return optax.warmup_cosine_decay_schedule(
            start, peak, warmup_steps=warmup, decay_steps=max(total_steps, warmup + 1),
            end_value=peak * config.min_learning_rate_ratio)
    if warmup == 0:
        return optax.constant_schedule(peak)
    return optax.join_schedules([optax.linear_schedule(start, peak, warmup),
                                 optax.constant_schedule(peak)], [warmup])


HYPERPARAMS = ("learning_rate", "b1", "b2", "eps", "weight_decay")
"""AdamW's hyperparameters that live in the optimizer state (``optax.inject_hyperparams``) and
are set before every step (``with_hyperparams``): inputs of the compiled step, not constants,
so that a new schedule, step count or rate reuses it."""


def injected_adamw(config: OptimizerConfig) -> optax.GradientTransformation:
    """optax.adamw (fp32 moments) with its hyperparameters in its state (``HYPERPARAMS``)."""
    return optax.inject_hyperparams(optax.adamw, static_args=("mu_dtype",))(
        learning_rate=config.learning_rate, b1=config.b1, b2=config.b2, eps=config.eps,
        weight_decay=config.weight_decay, mu_dtype=jnp.float32)


def hyperparams_at(config: OptimizerConfig, schedule: optax.Schedule, step: int) -> dict:
    """The values of ``HYPERPARAMS`` for the update that follows ``step`` updates: the
    schedule's rate at ``step`` (as optax's own count-driven schedule gives it), the rest as
    configured. Computed on the host."""
    return {"learning_rate": float(schedule(step)), "b1": config.b1, "b2": config.b2,
            "eps": config.eps, "weight_decay": config.weight_decay}


def with_hyperparams(opt_state, values: dict):
    """``opt_state`` (a DeviceAdamW's, a HostCpuAdamW's or an OffloadStreamState) with its
    injected hyperparameters set to ``values``, each placed where the old value was."""
    def replace(path, leaf):
        # Dict entries are DictKeys (.key), the state's fields GetAttrKeys (.name).
        keys = [getattr(k, "key", getattr(k, "name", None)) for k in path]
        if "hyperparams" in keys and keys[-1] in values:
            new = jnp.asarray(values[keys[-1]], leaf.dtype)
            sharding = getattr(leaf, "sharding", None)
            return jax.device_put(new, sharding) if sharding is not None else new
        return leaf

    if isinstance(opt_state, OffloadStreamState):
        split = opt_state.layout.state_split
        placeholders = [np.zeros(0) for _ in split.per_param_dtypes]
        tree = jax.tree_util.tree_map_with_path(replace,
                                                split.join(placeholders, opt_state.shared))
        return dataclasses.replace(opt_state, shared=tuple(split.split(tree)[1]))
    return jax.tree_util.tree_map_with_path(replace, opt_state)


class DeviceAdamW:
    """optax.adamw (clipped) on an fp32 master kept on the device: ``init(params) -> state``,
    ``update(grads, params, state) -> (params, state)``, pure, for use inside a jitted step.
    Its hyperparameters are set per step with ``with_hyperparams``."""

    def __init__(self, config: OptimizerConfig):
        self.max_grad_norm = config.max_grad_norm
        self.adamw = injected_adamw(config)
        clip = (optax.clip_by_global_norm(config.max_grad_norm)
                if config.max_grad_norm is not None else optax.identity())
        self.transformation = optax.chain(clip, self.adamw)  # its state: (clip's, adamw's)

    def init(self, params):
        """(fp32 master or None where the params are fp32 already, optax state)."""
        master = None
        if any(leaf.dtype != jnp.float32 for leaf in jax.tree.leaves(params)):
            master = jax.tree.map(lambda p: p.astype(jnp.float32), params)
        return master, self.transformation.init(params if master is None else master)

    def update(self, grads, params, state):
        master, optax_state = state
        target = params if master is None else master
        grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        updates, optax_state = self.transformation.update(grads, optax_state, target)
        target = optax.apply_updates(target, updates)
        if master is None:
            return target, (None, optax_state)
        working = jax.tree.map(lambda m, p: m.astype(p.dtype), target, params)
        return working, (target, optax_state)


MAX_HOST_CHUNKS = 8
"""At most this many chunks per leaf in ``HostCpuAdamW``'s state: XLA:CPU fuses a concatenate
of at most 8 operands into the loop that reads it (``kMaxConcatenateArguments``,
xla/service/cpu/cpu_instruction_fusion.cc), which is how a leaf's working params are written
from its chunks with no copy in between."""
MIN_HOST_CHUNK_PARAMS = 1 << 20
"""No chunk of ``HostCpuAdamW``'s state is smaller than this (but a smaller leaf's one): a
4 MiB fp32 chunk already gets XLA:CPU's most tasks per loop."""


def host_chunk_rows(shape) -> tuple[int, ...]:
    """How ``HostCpuAdamW`` cuts a leaf of ``shape`` into chunks: the rows (of its last
    dimension) of each, consecutive; one chunk, the leaf as it is, where that is ``()``. As many
    chunks as ``MIN_HOST_CHUNK_PARAMS`` allows up to ``MAX_HOST_CHUNKS`` (and the rows), as
    equal as whole rows make them. Whole rows, so that each element sits where it sat in the
    leaf's innermost loop (XLA:CPU cuts a loop's tasks along its outer dimensions too). A
    function of the shape only, so that a checkpoint restores on any host."""
    size = math.prod(shape)
    rows = size // shape[-1] if len(shape) > 1 and shape[-1] else 1
    count = min(MAX_HOST_CHUNKS, max(1, size // MIN_HOST_CHUNK_PARAMS), rows)
    if count == 1:
        return ()
    base, extra = divmod(rows, count)
    return tuple(base + (k < extra) for k in range(count))


def _chunks(leaf) -> tuple:
    """``leaf`` in ``host_chunk_rows`` chunks: (leaf,) or its rows' pieces, each 2-D."""
    rows = host_chunk_rows(leaf.shape)
    if not rows:
        return (leaf,)
    table, start, pieces = leaf.reshape(-1, leaf.shape[-1]), 0, []
    for count in rows:
        pieces.append(table[start:start + count])
        start += count
    return tuple(pieces)


class HostCpuAdamW:
    """``DeviceAdamW``'s update on the host CPU, its state in host memory: ZeRO-Offload's
    placement (DeepSpeed's CPU Adam), the standard stack's optimizer where the device cannot
    hold the state (``optimizer.update_on: host_cpu``).

    The state, ``(fp32 master, optax state)``, lives on the host's CPU device (jax's CPU
    backend; one device: the whole model's update is one program). It is ``DeviceAdamW``'s
    state with each per-parameter leaf kept in chunks: a tuple of arrays, the leaf itself where
    it is small, else consecutive pieces of its rows (of its last dimension), each 2-D
    (``host_chunk_rows``; ``standard_state`` joins them back). Each
    ``step(grads, state)``: the gradients go device -> host (P * b bytes, b the working dtype's);
    one CPU program, its inputs donated, takes the global norm of the upcast gradients (optax's
    ``tree.norm``), then updates the leaves one after another, each leaf's chunks side by side:
    a chunk's gradient upcast and clipped as ``optax.clip_by_global_norm`` clips it given that
    norm, the injected AdamW (``DeviceAdamW.adamw``, the same optax update) applied to the
    chunk's master and moments in place; the leaf's new working params, its chunks' masters
    cast and joined, written over its gradients; the gradients' buffers, now the working params,
    go host -> device (P * b bytes) to where the gradients came from, which is where the params
    were (the gradient program places them alike). Nothing of the optimizer is on the device;
    the host holds 12 bytes a parameter of state, the gradients in the working dtype and one
    leaf's fp32 clipped gradient (``peakflat_jax.plan.optimizer_terms``).

    Why chunks: XLA:CPU runs each elementwise loop on at most ceil(sqrt(cores)) tasks when it
    moves more bytes than it computes flops (4 of an H200 host's 16 cores; ParallelTaskAssigner,
    xla/service/cpu/parallel_task_assignment.cc), and AdamW's loops all do. Independent loops
    run side by side (the thunk executor runs its graph's ready nodes concurrently), but a
    leaf's loops write its arrays in place, one loop per array; a chunk is an array of its own,
    so a leaf of 8 chunks runs 8 loops of 4 tasks at once where it ran one. The loops are the
    same, each on a slice: the same arithmetic, bit for bit. Why leaf after leaf (an
    optimization barrier ties each leaf's gradient to the previous leaf's new moments): updating
    the whole tree at once, XLA:CPU kept every leaf's clipped fp32 gradient alive together, 4
    bytes a parameter more host memory than the state, 27 GiB for a 7.4B-parameter model, past
    what an H200's host has beside the state; a leaf's clipped gradient is dead once its
    moments are written, so the next leaf's starts there while this one's master and working
    params are still being written. Why the clipped gradient is a buffer at all (its loop's
    result read by the two moments' loops): computed again inside each, it was gone, but LLVM
    then contracted AdamW's multiply-adds into FMAs differently, and the fp32 moments left
    ``DeviceAdamW``'s bits. AdamW is elementwise, so a chunk's numbers are the tree's (the norm
    is the whole tree's, the step count one for all): the same optax arithmetic as the
    device's. On one device the optax state (moments, counts) comes out bit for bit the
    device's and the master within an ulp or two a step (XLA compiles the two programs' bias
    corrections apart; tests/test_train_optimizer.py). Why a program of its own on the CPU
    backend rather than ``compute_on("device_host")`` inside the step: that is the baseline as
    ZeRO-Offload runs it (gradients down, a CPU optimizer, weights up). One process only: its
    state is one process's host arrays (``config.check_config`` refuses more)."""

    def __init__(self, config: OptimizerConfig):
        self.device_adamw = DeviceAdamW(config)
        self.host = jax.local_devices(backend="cpu")[0]
        self.host_sharding = jax.sharding.SingleDeviceSharding(self.host)
        # The gradients (host copies, made for the update) and the state are donated: the new
        # state overwrites the old in place and the working params overwrite the gradients.
        self._update = jax.jit(self._host_update, donate_argnums=(0, 1))
        self._executables: dict = {}

    def init(self, params):
        """(fp32 master, optax state) of ``params``, in chunks, on the host CPU device: the
        params come down once."""
        host_params = jax.device_put(params, self.host_sharding)
        return jax.jit(self._host_init, out_shardings=self.host_sharding)(host_params)

    def abstract_state(self, params):
        """ShapeDtypeStructs of ``init(params)``'s state, placed on the host CPU device:
        what a resume restores into."""
        shapes = jax.eval_shape(self._host_init, params)
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                           sharding=self.host_sharding), shapes)

    def standard_state(self, state, params):
        """``state`` in ``DeviceAdamW``'s structure (each chunked leaf joined and shaped as
        ``params``' leaf): new arrays, where ``state`` is."""
        treedef = jax.tree.structure(params)
        shapes = [p.shape for p in jax.tree.leaves(params)]
        chunked = jax.tree.structure(state[0])

        def join(node):
            if jax.tree.structure(node) != chunked:
                return node
            return treedef.unflatten([jnp.concatenate(pieces).reshape(shape) for pieces, shape
                                      in zip(treedef.flatten_up_to(node), shapes)])

        return jax.tree.map(join, state, is_leaf=lambda n: jax.tree.structure(n) == chunked)

    def step(self, grads, state):
        """(new working params on the device, placed as ``grads``; the new host state).
        ``state`` is consumed."""
        shardings = jax.tree.map(lambda g: g.sharding, grads)
        # A copy always (where the gradients are on the host device already, too): it is
        # donated to the update, and the caller's arrays stay theirs.
        host_grads = jax.device_put(grads, self.host_sharding, may_alias=False)
        working, state = self._executable(host_grads, state)(host_grads, state)
        return jax.device_put(working, shardings), state

    def lower(self, params, state):
        """The host update lowered for gradients shaped like ``params`` (on the host CPU) and
        ``state``: ``.compile()`` it to read XLA's plan (tests, ``--check``)."""
        return self._update.lower(self._host_grads_like(params), state)

    def compile(self, params, state) -> bool:
        """Compiles the host update for ``params``' shapes ahead of the first step; False where
        this object had compiled it already."""
        grads = self._host_grads_like(params)
        compiled = self._key(grads, state) not in self._executables
        self._executable(grads, state)
        return compiled

    def _executable(self, grads, state):
        key = self._key(grads, state)
        if key not in self._executables:
            self._executables[key] = self._update.lower(grads, state).compile()
        return self._executables[key]

    @staticmethod
    def _key(grads, state) -> tuple:
        return (jax.tree.structure((grads, state)),
                tuple((a.shape, str(a.dtype)) for a in jax.tree.leaves(grads)))

    def _host_grads_like(self, params):
        return jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype,
                                                           sharding=self.host_sharding), params)

    def _host_init(self, params):
        master = jax.tree.map(lambda p: _chunks(p.astype(jnp.float32)), params)
        return master, self.device_adamw.transformation.init(master)

    def _host_update(self, grads, state):
        """(working params, new state): the class doc's program."""
        master, (clip_state, adamw_state) = state
        grad_leaves, treedef = jax.tree.flatten(grads)
        max_norm = self.device_adamw.max_grad_norm
        norm = (None if max_norm is None else
                optax.tree.norm([g.astype(jnp.float32) for g in grad_leaves]))
        # AdamW's state: subtrees chunked like the master (the moments), taken chunk by chunk,
        # and shared leaves (the step count, the hyperparameters).
        chunked = jax.tree.structure(master)
        sizes = [tuple(x.shape for x in pieces) for pieces in treedef.flatten_up_to(master)]

        def per_param(node) -> bool:
            return (jax.tree.structure(node) == chunked
                    and [tuple(getattr(x, "shape", None) for x in pieces)
                         for pieces in treedef.flatten_up_to(node)] == sizes)

        nodes, outer = jax.tree.flatten(adamw_state, is_leaf=per_param)
        moments = [j for j, node in enumerate(nodes) if per_param(node)]
        moment_chunks = {j: treedef.flatten_up_to(nodes[j]) for j in moments}

        def adamw_of(arrays: dict):
            """AdamW's state with each per-parameter subtree replaced by one chunk's array."""
            return outer.unflatten([arrays.get(j, node) for j, node in enumerate(nodes)])

        working, new_master, new_moments = [], [], {j: [] for j in moments}
        done = ()
        for i, (grad, master_chunks) in enumerate(zip(grad_leaves,
                                                      treedef.flatten_up_to(master))):
            # Leaf i starts once leaf i - 1's moments are written: its clipped gradient is dead.
            grad, _ = lax.optimization_barrier((grad, done))
            leaf_master, leaf_moments = [], {j: [] for j in moments}
            for k, (chunk_grad, chunk_master) in enumerate(zip(_chunks(grad), master_chunks,
                                                                strict=True)):
                piece = chunk_grad.astype(jnp.float32)
                if norm is not None:  # optax.clip_by_global_norm, given the global norm
                    piece = lax.select(norm < max_norm, piece,
                                       (piece / norm.astype(piece.dtype)) * max_norm)
                updates, new = self.device_adamw.adamw.update(
                    piece, adamw_of({j: moment_chunks[j][i][k] for j in moments}),
                    chunk_master)
                leaf_master.append(optax.apply_updates(chunk_master, updates))
                new_nodes = outer.flatten_up_to(new)
                for j in moments:
                    leaf_moments[j].append(new_nodes[j])
            working.append(jnp.concatenate([m.astype(grad.dtype) for m in leaf_master])
                           .reshape(grad.shape))  # one chunk: the leaf as it is
            new_master.append(tuple(leaf_master))
            for j in moments:
                new_moments[j].append(tuple(leaf_moments[j]))
            done = tuple(leaf_moments.values())
        # The shared leaves advance without looking at any element: an empty leaf's update.
        empty = jnp.zeros((0,), jnp.float32)
        _, advanced = self.device_adamw.adamw.update(empty, adamw_of(dict.fromkeys(moments,
                                                                                   empty)), empty)
        new_nodes = [treedef.unflatten(new_moments[j]) if j in new_moments else shared
                     for j, shared in enumerate(outer.flatten_up_to(advanced))]
        return (treedef.unflatten(working),
                (treedef.unflatten(new_master), (clip_state, outer.unflatten(new_nodes))))


def make_offloaded(config: OptimizerConfig):
    """``pf.offload_stream`` of the injected AdamW (``injected_adamw``) with the run's buckets,
    slots and clipping."""
    return offload_stream(injected_adamw(config), bucket_params=config.bucket_params,
                          slots=config.slots, max_grad_norm=config.max_grad_norm)
