"""offload_stream: any elementwise optax transformation with its fp32 state in host memory,
streamed through the device in buckets.

The device keeps the working parameters (their own dtype, e.g. bf16) and the gradients. The
fp32 master weights and the transformation's per-parameter state (AdamW's mu and nu, Lion's or
SGD's momentum) live in host memory (memory kind ``pinned_host``), cut into buckets of at most
``bucket_params`` elements, each bucket its own host arrays (``_bucket_layout``). Its other state
(counts, schedule state) stays on the device, one copy for all buckets.

One jitted step, buckets unrolled: for each bucket, copy its master and state host -> device
(``device_put`` to ``Space.Device`` inside jit), run ``transformation.update`` on the flat fp32
bucket of gradients (upcast; clipped to ``max_grad_norm`` by the global norm first, as
``optax.clip_by_global_norm``), apply it to the master (``optax.apply_updates``), cast the new
working pieces, and copy master and state back (``Space.Host``). Bucket i's host copies wait on
bucket i - slots's write-back and working pieces (an optimization barrier), so that at most
``slots`` buckets are staged on the device. The per-device bounds are
``offload_stream_memory_terms`` (device) and ``offload_stream_host_bytes`` (host); the formulas
are in ``MEMORY_FORMULAS``.

Which transformations: elementwise ones (adamw, lion, sgd with momentum or nesterov, and chains
of such), whose per-bucket result equals their result on the tree. ``_elementwise`` checks the
contract by tracing, on buckets and on trees of matrices, and refuses reductions
(``optax.clip_by_global_norm``: use ``max_grad_norm``), per-axis state (SM3, Adafactor), masks
and partitions.

Why it is shaped so:
- Every copy is a whole array placed by XLA inside one program: the fast path for host copies,
  overlapped by XLA with the updates of other buckets. Separate host arrays per bucket, because
  slicing one host array inside a loop is a slow path (JAX-NOTES.md).
- Buckets are unrolled in Python, not scanned: XLA overlaps host copies in straight-line code,
  not across loop iterations (JAX-NOTES.md); the barrier chain bounds what unrolling would
  otherwise leave unbounded. Each bucket's working pieces are cast inside its update and tied
  into the chain, so that no bucket's fp32 master outlives its write-back.
- The step is its own jitted program that donates the state: the train step is two programs
  (gradients, then the optimizer). For updating each layer inside the next step's forward,
  ``update_group`` runs one group of buckets inside any jitted program (below).
- The layout (groups, buckets, placement, tree structure, the transformation's state split) is
  static metadata of the state, not of the optimizer: ``step(grads, state)`` depends on its
  arguments only, and one optimizer serves any number of states. The state is a pytree of
  arrays, so the trainer's orbax CheckpointManager saves and restores it with the params
  (pinned_host arrays restore into host memory given the target ``abstract_state(params)``);
  the layout goes beside it as JSON (``state_metadata``), and ``check_metadata`` refuses a
  checkpoint of another layout before its pieces land on the wrong shards.

FSDP. Params (and grads, placed alike) may be NamedShardings on one mesh. Each device's buckets
are cut from its own shards and it updates only those (``shard_map``): the step moves nothing
between devices except, with clipping, the scalar global norm. Unsharded params run the same
code on a one-device mesh. Limit: a leaf replicated over some mesh axes is updated identically
on every device that holds it, so its host state and traffic are multiplied by its replication;
sharding the state over the replicas (ZeRO-1) is not done.

Layer groups. ``init(params, stacked_layers=mask)`` marks leaves whose leading axis is a layer
axis; layer l's slices then form their own buckets (group ``layout.layer_group(l)``), after the
group of the unmarked leaves. The step runs them in that order; a trainer can instead update
one group at a time inside its own jitted program::

    scalars = opt.step_scalars(grads, state)           # the global norm, the shared state
    for g in range(len(state.layout.groups)):
        params_g, group_g = opt.update_group(state.layout.group_leaves(grads, g),
                                             state.group(g), scalars)
        ...                                            # params_g: group g's new leaves
    state = opt.new_state(state, groups, scalars)      # groups: every group_g, in order

which gives the whole step's result bit for bit. The trainer's jit declares the state's host
outputs with ``opt.state_shardings(state)``; the slot chain runs within each group (the trainer
orders the groups). ``update_group(..., write_back=False)`` leaves a group's new state on the
device, outside the slot chain, for ``opt.write_back(group, after=x)`` to copy back once ``x``
exists: the trainer passes the forward's loss, so that half of the link's bytes (the copies
back) run under the backward, for (4 + S) * P bytes of device memory until then.

Stacked layers. ``init(params, stacked_layers=mask, stack_layers=True)`` stores the layer
groups' buckets stacked: the layer groups of one residency form a block, and bucket j of each of
its layers is row l of one array (``_bucket_layout``). A loop over the layers (the trainer's
scanned stack) then updates layer l's buckets as rows of whole arrays, read and written in
place: ``update_group`` takes a row of a block (``BlockState.group(row)``, the row traced) and
returns the block with the row written; separate arrays per layer cannot be indexed by a traced
layer. The step's numbers are the same bit for bit; the state's arrays, and so a checkpoint's,
are of another shape (``describe`` says which, and ``check_metadata`` refuses the other layout).

Resident groups. ``init(params, stacked_layers=mask, resident_groups=k)`` keeps the state of
the layout's first k groups (the unmarked leaves, then layers 0, 1, ...) in device memory:
their buckets are updated where they are, with no copy either way and outside the slot chain.
What that buys is link time where nothing hides it: a trainer that updates each layer inside
the next forward has no compute to put the first groups' copies under (the unmarked leaves are
needed before the first layer). It costs (4 + S) * P_r bytes of device memory for as long as
the state lives (P_r: ``layout.resident_params()``) and saves 2 (4 + S) P_r bytes of link
traffic a step; the numbers are the same bit for bit, and a checkpoint restores into any
residency (``describe`` leaves it out).

On CPU the memory kinds exist but the copies lower to nothing: tests check the numbers, XLA's
plan and the slot chain, not the transfers.

Legend: P parameters per device (the local shards, replicated leaves counted whole), beta =
bucket_params, s = slots, S = bytes per parameter of the transformation's per-parameter state
(``state_bytes_per_param``; AdamW 8), b = bytes per element of the working params.

Measured: docs/offload_adamw.md
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import PartitionSpec as P

from peakflat_jax._validate import as_int
from peakflat_jax.optim._bucket_layout import Block, Group, Layout
from peakflat_jax.optim._elementwise import split_state

MEMORY_FORMULAS = {
    "resident_state": "P_r * (4 + S)  (the resident groups' fp32 master and per-parameter state, "
                      "in device memory for the state's lifetime; P_r: layout.resident_params)",
    "staging": "min(s, num_buckets) * min(beta, P) * (8 + S)  (fp32 master and grad and the "
               "per-parameter state of each staged bucket: what the slot chain bounds)",
    "staging_gpu_excess": "min(beta, P) * 8  (what XLA's GPU plan of the AdamW step held "
                          "beyond the slots, at most, in the measured sweep)",
    "working_params": "P * b  (the new working params: the step's output, the trainer's)",
    "grads": "P * b  (the gradients: the step's input, the trainer's)",
}


def offload_stream_memory_terms(num_params_per_device: int, bucket_params: int, slots: int,
                                param_dtype, state_bytes_per_param: int,
                                resident_params: int = 0) -> dict[str, int]:
    """Per-device bytes of each term of the step's device bound (``MEMORY_FORMULAS``).

    ``resident_state`` is the resident groups' state (``resident_params``: P_r, their
    parameters per device); ``staging`` and ``staging_gpu_excess`` are the step's XLA
    temporaries; ``working_params`` and ``grads`` are the trainer's arrays that the step writes
    and reads, listed so that a planner adding up the optimizer's device memory needs nothing
    else. ``state_bytes_per_param``: ``opt.state_bytes_per_param``."""
    for name, value in (("num_params_per_device", num_params_per_device),
                        ("bucket_params", bucket_params), ("slots", slots)):
        if as_int(name, value) < 1:
            raise ValueError(f"{name}: expected a positive int, got {value!r}")
    if as_int("state_bytes_per_param", state_bytes_per_param) < 0:
        raise ValueError(f"state_bytes_per_param: expected a non-negative int, got "
                         f"{state_bytes_per_param!r}")
    if not 0 <= as_int("resident_params", resident_params) <= num_params_per_device:
        raise ValueError(f"resident_params: expected an int from 0 to num_params_per_device "
                         f"({num_params_per_device}), got {resident_params!r}")
    bucket = min(bucket_params, num_params_per_device)
    num_buckets = -(-num_params_per_device // bucket)
    itemsize = jnp.dtype(param_dtype).itemsize
    return {"resident_state": resident_params * (4 + state_bytes_per_param),
            "staging": min(slots, num_buckets) * bucket * (8 + state_bytes_per_param),
            "staging_gpu_excess": bucket * 8,
            "working_params": num_params_per_device * itemsize,
            "grads": num_params_per_device * itemsize}


def offload_stream_host_bytes(num_params_per_device: int, state_bytes_per_param: int,
                              resident_params: int = 0) -> int:
    """Per-device host bytes of the state: the fp32 master and the per-parameter state of the
    streamed groups, (4 + S) * (P - P_r)."""
    streamed = as_int("num_params_per_device", num_params_per_device) - as_int(
        "resident_params", resident_params)
    if streamed < 0:
        raise ValueError(f"resident_params: expected at most num_params_per_device "
                         f"({num_params_per_device}), got {resident_params!r}")
    return (4 + as_int("state_bytes_per_param", state_bytes_per_param)) * streamed


def offload_stream_link_bytes(num_params_per_device: int, state_bytes_per_param: int,
                              resident_params: int = 0) -> int:
    """Per-device bytes a step moves over the host link: every streamed bucket's fp32 master
    and per-parameter state in and back, 2 (4 + S) (P - P_r)."""
    return 2 * offload_stream_host_bytes(num_params_per_device, state_bytes_per_param,
                                         resident_params)


# -- the optimizer --------------------------------------------------------------------------------


def offload_stream(transformation: optax.GradientTransformation,
                   bucket_params: int = 100_000_000, slots: int = 2,
                   max_grad_norm: float | None = None) -> OffloadStream:
    """``transformation`` (an elementwise optax GradientTransformation) with its fp32 master
    and per-parameter state in host memory, streamed through the device in buckets of at most
    ``bucket_params``, ``slots`` staged at a time; gradients clipped to the global norm
    ``max_grad_norm`` first if given. See the module doc."""
    return OffloadStream(transformation, bucket_params, slots, max_grad_norm)


class OffloadStream:
    """A streamed optax transformation (see the module doc). It holds its hyperparameters only:
    ``state = opt.init(params)``, ``params, state = opt.step(grads, state)``,
    ``opt.master_params(state)`` -> fp32 pytree."""

    def __init__(self, transformation: optax.GradientTransformation,
                 bucket_params: int = 100_000_000, slots: int = 2,
                 max_grad_norm: float | None = None):
        if as_int("bucket_params", bucket_params) < 1:
            raise ValueError(f"bucket_params: expected a positive int, got {bucket_params!r}")
        if as_int("slots", slots) < 1:
            raise ValueError(f"slots: expected a positive int, got {slots!r}")
        if max_grad_norm is not None and not (
                isinstance(max_grad_norm, numbers.Real) and not isinstance(max_grad_norm, bool)
                and math.isfinite(max_grad_norm) and max_grad_norm > 0):
            raise ValueError(f"max_grad_norm: expected None or a positive number, got "
                             f"{max_grad_norm!r}")
        self.transformation = transformation
        self.state_split = split_state(transformation)
        self.bucket_params, self.slots = int(bucket_params), int(slots)
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        # A cache, not state: the jitted step of each layout met so far (its shardings differ).
        self._jitted_steps: dict[Layout, jax.stages.Wrapped] = {}

    @property
    def state_bytes_per_param(self) -> int:
        """Host bytes per parameter of the transformation's per-parameter state (S)."""
        return self.state_split.bytes_per_param

    # -- state ----------------------------------------------------------------------------------

    def init(self, params, stacked_layers=None, resident_groups: int = 0,
             stack_layers: bool = False) -> OffloadStreamState:
        """fp32 master copies of ``params`` and the transformation's initial state, the
        per-parameter part in host memory (device memory for the first ``resident_groups``
        groups); the state carries its layout.

        ``params`` live on one device, or as NamedShardings on one mesh (FSDP); each device then
        keeps the state of its own shards. ``stacked_layers``: a pytree of bools with the
        params' structure, or a prefix of it, marking leaves whose leading axis is the layer
        axis (the same size L for all, not sharded); their layer slices get buckets of their
        own, a group per layer. ``resident_groups``: how many of the first groups keep their
        state in device memory instead (module doc). ``stack_layers``: the layer groups' buckets
        stored stacked, a block per residency (module doc, "Stacked layers")."""
        layout = self._layout(params, stacked_layers, resident_groups, stack_layers)
        placement, flat = layout.placement, layout.placement.flat_spec
        num_streamed = len(layout.state_split.per_param_dtypes)

        def initial_state(leaves):
            masters, streamed = [], []  # per bucket of every group, in group order
            for index, group in enumerate(layout.groups):
                def buckets(*local_leaves, group=group):
                    master = tuple(group.gather(local_leaves, b)
                                   for b in range(len(group.bucket_sizes)))
                    return master, tuple(self._split(self.transformation.init(m))[0]
                                         for m in master)

                num_buckets = len(group.bucket_sizes)
                master, state = placement.local(
                    buckets, in_specs=group.specs,
                    out_specs=((flat,) * num_buckets, ((flat,) * num_streamed,) * num_buckets))(
                    *layout.group_leaves(leaves, index))
                masters += master
                streamed += state
            zero = jnp.zeros((0,), jnp.float32)
            shared = self._split(self.transformation.init(zero))[1]
            masters, streamed = _stored(layout, masters, streamed)
            return OffloadStreamState(masters, streamed, shared, layout=layout)

        return jax.jit(initial_state, out_shardings=_state_shardings(layout))(
            jax.tree.leaves(params))

    def abstract_state(self, params, stacked_layers=None, resident_groups: int = 0,
                       stack_layers: bool = False) -> OffloadStreamState:
        """The state ``init(params, stacked_layers, resident_groups, stack_layers)`` would make, as
        ShapeDtypeStructs with their shardings (pinned_host for the streamed buckets, device
        for the resident ones), allocating nothing: a checkpoint restore target. ``params`` may
        be arrays or ShapeDtypeStructs with shardings."""
        layout = self._layout(params, stacked_layers, resident_groups, stack_layers)
        shardings = _state_shardings(layout)
        split = layout.state_split
        master = tuple(jax.ShapeDtypeStruct(shape, jnp.float32, sharding=sharding)
                       for shape, sharding in zip(layout.state_shapes(), shardings.master))
        streamed = tuple(tuple(jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
                               for dtype, sharding in zip(split.per_param_dtypes, bucket))
                         for shape, bucket in zip(layout.state_shapes(), shardings.streamed))
        zero = jax.ShapeDtypeStruct((0,), jnp.float32)
        shared = self._split(jax.eval_shape(self.transformation.init, zero))[1]
        shared = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
                       for x, sharding in zip(shared, shardings.shared))
        return OffloadStreamState(master, streamed, shared, layout=layout)

    def state_shardings(self, state: OffloadStreamState) -> OffloadStreamState:
        """The state's shardings (a state-shaped pytree): what a jitted program that returns a
        new state declares as its out_shardings (host outputs need it)."""
        return _state_shardings(self._checked_layout(state))

    def master_params(self, state: OffloadStreamState):
        """The fp32 master weights as a pytree shaped (and sharded) like the params."""
        layout = self._checked_layout(state)
        placement, flat = layout.placement, layout.placement.flat_spec

        def masters(buckets):
            per_group = []
            for index, group in enumerate(layout.groups):
                f32 = (jnp.dtype(jnp.float32),) * len(group.leaves)

                def rebuild(*group_buckets, group=group, f32=f32):
                    return tuple(group.assemble(
                        [group.pieces(a, b, f32) for b, a in enumerate(group_buckets)], f32))

                per_group.append(placement.local(
                    rebuild, in_specs=(flat,) * len(group.bucket_sizes),
                    out_specs=group.specs, rebuilds_leaves=True)(
                    *(buckets[i] if row is None else buckets[i][row]
                      for i, row in layout.bucket_arrays(index))))
            return layout.merge_groups(per_group)

        on_device = [jax.device_put(m, sharding.with_memory_kind("device"))
                     for m, sharding in zip(state.master, layout.state_array_shardings())]
        leaves = jax.jit(masters, out_shardings=layout.leaf_shardings())(on_device)
        return jax.tree.unflatten(layout.treedef, leaves)

    # -- checkpoints: the state is saved by the trainer's orbax call; its layout goes beside it --

    def state_metadata(self, state: OffloadStreamState) -> dict:
        """The state's layout as JSON, to save beside the state (e.g. ``ocp.args.JsonSave``)."""
        return self._checked_layout(state).describe()

    def check_metadata(self, state: OffloadStreamState, metadata: dict) -> None:
        """Raises ValueError unless ``metadata`` (from ``state_metadata`` of a saved state)
        describes ``state``'s layout: the same buckets of the same shards on the same mesh
        positions, and the same transformation state. Call it before restoring into ``state``'s
        layout: a checkpoint of another layout would put each piece of state on another
        parameter."""
        expected = self._checked_layout(state).describe()
        if not isinstance(metadata, dict):
            raise ValueError(f"metadata: expected the dict of state_metadata, got "
                             f"{type(metadata).__name__}")
        differences = {key: (metadata.get(key), value) for key, value in expected.items()
                       if metadata.get(key) != value}
        if differences:
            raise ValueError(f"metadata: the checkpoint's optimizer state was saved for another "
                             f"layout (saved vs this state's): {differences}")

    # -- the step -------------------------------------------------------------------------------

    def step(self, grads, state: OffloadStreamState):
        """New working params (on device, in the params' dtypes and shardings) and the new
        state.

        The state passed in is donated: use the returned one. Grads placed unlike the params are
        moved to the params' placement first."""
        leaves = self._grad_leaves(grads, state)
        new_leaves, state = self._jitted_step(state.layout)(leaves, state)
        return jax.tree.unflatten(state.layout.treedef, new_leaves), state

    def lower(self, grads, state: OffloadStreamState) -> jax.stages.Lowered:
        """The step lowered for these arguments (``.compile()`` for XLA's memory plan and HLO)."""
        return self._jitted_step(state.layout).lower(self._grad_leaves(grads, state), state)

    def step_scalars(self, grads, state: OffloadStreamState, apply=None) -> StepScalars:
        """What every group's update shares: the global gradient norm (with clipping) and the
        transformation's shared state before the step. Traceable (inside the trainer's jit).
        ``apply``: None, or a traced bool; where it is False the groups' updates and
        ``new_state`` leave the state and the working params exactly as they were (one
        program that updates then serves a step with nothing to update)."""
        self._checked_layout(state)
        return StepScalars(state.shared, self._global_norm(jax.tree.leaves(grads)), apply)

    def update_group(self, grads, group_state: GroupState, scalars: StepScalars,
                     slot_chain: list | None = None, write_back: bool = True, after=None):
        """Updates one group's buckets (traceable: inside the trainer's jit).

        ``grads``: the group's gradient leaves (``layout.group_leaves(grads, g)``: whole leaves,
        or layer slices for a layer group), placed like the params' (layer slices: without the
        layer axis). ``group_state``: ``state.group(g)``, or for stacked layers a row of its
        block (``BlockState.group``: the row may be traced, inside a loop over the layers).
        Returns (the group's new working leaves, in the params' dtypes, and its new GroupState:
        for a row, the block's arrays with the row written, except where ``write_back=False``
        leaves a streamed row's new state on the device as the row alone).

        ``write_back=False``: the new GroupState is left on the device, unbounded by the slot
        chain (``slot_chain`` must be None): the caller writes it back with ``write_back``,
        later in its program (the trainer: under the backward). Every updated bucket's master
        and state then stay on the device until then, (4 + S) * P bytes.

        ``after``: arrays each bucket's update waits for once its copies are in (an
        optimization barrier; the trainer passes the layer's input where nothing is written
        back, so that the copies run under the layer before). With the slot chain it would
        hold every bucket past the first ``slots`` until ``after`` exists."""
        if not write_back and slot_chain is not None:
            raise ValueError("slot_chain: expected None with write_back=False (the slots bound "
                             "the buckets written back)")
        layout = group_state.layout
        group = layout.groups[group_state.index]
        grads = list(grads)
        shapes = [tuple(g.shape) for g in grads]
        expected = [layout.shapes[i] if group.layer is None else layout.shapes[i][1:]
                    for i in group.leaves]
        if shapes != expected:
            raise ValueError(f"grads: expected group {group_state.index}'s leaf shapes "
                             f"{expected}, got {shapes}")
        leaves, new_group, chain = self._update_group(grads, group_state, scalars,
                                                      slot_chain or [], write_back, after)
        if slot_chain is not None:
            slot_chain[:] = chain
        return leaves, new_group

    def write_back(self, group_state: GroupState | BlockState, after=None):
        """A GroupState that ``update_group(..., write_back=False)`` left on the device (or a
        BlockState of such rows stacked), copied to its host buckets (traceable). ``after``: any
        arrays the copies must wait for (an optimization barrier): the trainer passes the
        forward's loss, so that the copies run under the backward. A resident group's (or
        block's) state stays where it is."""
        resident = (group_state.block.resident if isinstance(group_state, BlockState)
                    else group_state.layout.resident(group_state.index))
        if resident:
            return group_state
        arrays = (group_state.master, group_state.streamed)
        if after is not None:
            arrays, _ = lax.optimization_barrier((arrays, after))
        master, streamed = jax.device_put(arrays, jax.memory.Space.Host)
        return dataclasses.replace(group_state, master=tuple(master),
                                   streamed=tuple(tuple(s) for s in streamed))

    def new_state(self, state: OffloadStreamState, groups, scalars: StepScalars):
        """The state after a step run group by group: the new state of every group (in group
        order) and the transformation's shared state advanced by one step. Where layers are
        stacked, a block's groups are one entry, at its first group's place: its BlockState
        (or the last row of it that ``update_group`` returned), ``layout.units()``'s order."""
        layout = self._checked_layout(state)
        units = [_unit(u) for u in groups]
        expected = list(layout.units())
        if [key for key, _ in units] != expected:
            raise ValueError(f"groups: expected the new GroupState of each of the "
                             f"{len(layout.groups)} groups, in order (a stacked block's "
                             f"BlockState in place of its groups): {expected}")
        shared = self._next_shared(scalars.shared)
        if scalars.apply is not None:
            shared = tuple(jnp.where(scalars.apply, new, old)
                           for new, old in zip(shared, scalars.shared))
        return OffloadStreamState(tuple(m for _, u in units for m in u.master),
                                  tuple(s for _, u in units for s in u.streamed),
                                  shared, layout=layout)

    def _step(self, grad_leaves, state: OffloadStreamState):
        layout = state.layout
        scalars = StepScalars(state.shared, self._global_norm(grad_leaves))
        chain, units, leaves_per_group = [], {}, []
        # A stacked block's arrays are threaded through its groups' updates, row by row.
        blocks = {block: state.block(block) for block in layout.blocks}
        for index in range(len(layout.groups)):
            block = layout.block_of(index)
            group_state = (state.group(index) if block is None
                           else blocks[block].group(block.row(index), index))
            leaves, group, chain = self._update_group(
                layout.group_leaves(grad_leaves, index), group_state, scalars, chain)
            leaves_per_group.append(leaves)
            if block is None:
                units[index] = group
            else:
                blocks[block] = group.stacks()
        return layout.merge_groups(leaves_per_group), self.new_state(
            state, [units[u] if isinstance(u, int) else blocks[u] for u in layout.units()],
            scalars)

    def _update_group(self, grad_leaves, group_state: GroupState, scalars: StepScalars, chain,
                      write_back: bool = True, after=None):
        """The group's buckets, each waiting for the bucket ``slots`` before it in ``chain``
        (earlier buckets' written state and working pieces, extended and returned); without
        ``write_back`` no chain and no copy back (``update_group``)."""
        layout = group_state.layout
        group: Group = layout.groups[group_state.index]
        placement, flat, replicated = layout.placement, layout.placement.flat_spec, P()
        num_streamed = len(layout.state_split.per_param_dtypes)
        norm, apply = scalars.grad_norm, scalars.apply
        # The step's scalars that the buckets read, replicated: the norm and the apply flag.
        extras = tuple(x for x in (norm, apply) if x is not None)

        def update_bucket(b, local_grads, master, streamed, shared, *extras):
            extras = list(extras)
            norm = extras.pop(0) if scalars.grad_norm is not None else None
            apply = extras.pop(0) if scalars.apply is not None else None
            grad = group.gather(local_grads, b)
            if norm is not None:  # optax.clip_by_global_norm, given the global norm
                grad = jnp.where(norm < self.max_grad_norm, grad,
                                 (grad / norm.astype(grad.dtype)) * self.max_grad_norm)
            updates, state = self.transformation.update(
                grad, layout.state_split.join(streamed, shared), master)
            new_master, new_streamed = optax.apply_updates(master, updates), self._split(state)[0]
            if apply is not None:  # nothing to update: the bucket as it came
                new_master = jnp.where(apply, new_master, master)
                new_streamed = tuple(jnp.where(apply, new, old)
                                     for new, old in zip(new_streamed, streamed))
            return new_master, new_streamed, group.pieces(new_master, b)

        # A resident group's buckets are in device memory already: no copies, no slot chain.
        streamed_group = not layout.resident(group_state.index)
        # A row of a stacked block: each bucket read from and written into the block's arrays.
        row = group_state.row
        chain, pieces_per_bucket, masters, streamed_per_bucket = list(chain), [], [], []
        for b in range(len(group.bucket_sizes)):
            master, streamed = group_state.master[b], group_state.streamed[b]
            stacks = None
            if streamed_group:
                host_in = (master, streamed)
                if write_back and len(chain) >= self.slots:  # wait for the bucket `slots` back
                    host_in, _ = lax.optimization_barrier((host_in, chain[-self.slots]))
                if row is not None:
                    # The row is sliced after the barrier, and copied as sliced: XLA's host
                    # offloading allows nothing but a bitcast between a slice of host memory
                    # and its copy to the device.
                    stacks, host_in = host_in, _row(host_in, row)
                master, streamed = jax.device_put(host_in, jax.memory.Space.Device)
            elif row is not None:
                stacks = (master, streamed)
                master, streamed = _row(stacks, row)
            if row is not None:
                # The row made before its readers: fused into each of them, the slice had them
                # all read the block's arrays, which then had to be copied whole before the row
                # was written back into them (XLA:CPU copied every array of the block, every
                # layer).
                master, streamed = lax.optimization_barrier((master, streamed))
            if after is not None:  # the update waits for `after`, its copies do not
                (master, streamed), _ = lax.optimization_barrier(((master, streamed), after))
            local = placement.local(
                functools.partial(update_bucket, b),
                in_specs=(list(group.specs), flat, (flat,) * num_streamed,
                          (replicated,) * len(scalars.shared)) + (replicated,) * len(extras),
                out_specs=(flat, (flat,) * num_streamed, (flat,) * len(group.buckets[b])))
            master, streamed, pieces = local(list(grad_leaves), master, streamed, scalars.shared,
                                             *extras)
            written = (jax.device_put((master, streamed), jax.memory.Space.Host)
                       if write_back and streamed_group else (master, streamed))
            if stacks is not None and (write_back or not streamed_group):
                written = _with_row(stacks, written, row)  # the copy written as it came
            if streamed_group:
                chain.append((written, pieces))
            masters.append(written[0])
            streamed_per_bucket.append(written[1])
            pieces_per_bucket.append(pieces)
        assemble = placement.local(
            lambda pieces: tuple(group.assemble(pieces)),
            in_specs=(tuple((flat,) * len(p) for p in pieces_per_bucket),),
            out_specs=group.specs, rebuilds_leaves=True)
        in_stacks = row is not None and (write_back or not streamed_group)
        new_group = GroupState(tuple(masters), tuple(streamed_per_bucket), layout=layout,
                               index=group_state.index, row=row if in_stacks else None)
        return list(assemble(tuple(pieces_per_bucket))), new_group, chain

    def _next_shared(self, shared) -> tuple:
        """The shared state after one update. Elementwise transformations advance it without
        looking at any element (``_elementwise``), so an empty bucket gives every bucket's."""
        split = self.state_split
        zero = jnp.zeros((0,), jnp.float32)
        streamed = tuple(jnp.zeros((0,), dtype) for dtype in split.per_param_dtypes)
        _, state = self.transformation.update(zero, split.join(streamed, shared), zero)
        return self._split(state)[1]

    def _split(self, transformation_state) -> tuple[tuple, tuple]:
        return self.state_split.split(transformation_state)

    def _global_norm(self, grad_leaves):
        """The global gradient norm, or None without clipping. The norm of the global arrays:
        XLA sums each shard once, whatever the mesh."""
        if self.max_grad_norm is None:
            return None
        return jnp.sqrt(sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in grad_leaves))

    def _jitted_step(self, layout: Layout):
        if layout not in self._jitted_steps:
            on_device = layout.leaf_shardings()
            state_shardings = _state_shardings(layout)
            # Declared memory kinds on both sides let donation pair host inputs with host outputs
            # only; left unknown, a donated host bucket could become a same-shaped device output.
            self._jitted_steps[layout] = jax.jit(
                self._step, donate_argnums=1, in_shardings=(on_device, state_shardings),
                out_shardings=(on_device, state_shardings))
        return self._jitted_steps[layout]

    def _layout(self, params, stacked_layers, resident_groups: int = 0,
                stack_layers: bool = False) -> Layout:
        return Layout.of(params, self.bucket_params, self.state_split, stacked_layers,
                         resident_groups, stack_layers)

    def _grad_leaves(self, grads, state: OffloadStreamState) -> list[jax.Array]:
        """The grads' leaves, checked against the state's layout and placed like the params."""
        layout = self._checked_layout(state)
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
                for g, target in zip(leaves, layout.leaf_shardings())]

    def _checked_layout(self, state) -> Layout:
        """``state``'s layout, after checking that the state is one of this optimizer's
        transformation and that its arrays are the ones its layout describes."""
        if not isinstance(state, OffloadStreamState):
            raise ValueError(f"state: expected the OffloadStreamState of init, got "
                             f"{type(state).__name__}")
        layout = state.layout
        if layout.state_split != self.state_split:
            raise ValueError(f"state: made for a transformation whose state is "
                             f"{layout.state_split.treedef}, but this optimizer's is "
                             f"{self.state_split.treedef}")
        expected = layout.state_shapes()
        shapes = tuple(tuple(a.shape) for a in state.master)
        streamed = tuple(tuple(tuple(a.shape) for a in bucket) for bucket in state.streamed)
        num_streamed = len(layout.state_split.per_param_dtypes)
        if shapes != expected or streamed != tuple((s,) * num_streamed for s in expected):
            raise ValueError(f"state: expected {len(expected)} arrays of shapes {expected} "
                             f"(its layout's) in master and streamed, got {shapes} and "
                             f"{streamed}")
        return layout


# -- the state ------------------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class OffloadStreamState:
    """Per bucket, the fp32 master and the transformation's per-parameter state leaves (host
    memory; device memory for the layout's resident groups); the transformation's shared state
    (device). The layout is static metadata (not a leaf: jit and orbax see only the arrays)."""

    master: tuple[jax.Array, ...]
    streamed: tuple[tuple[jax.Array, ...], ...]
    """Per bucket, the per-parameter leaves of the transformation's state, in its order."""
    shared: tuple[jax.Array, ...]
    """The other leaves of the transformation's state (counts...), in its order."""
    layout: Layout = dataclasses.field(metadata=dict(static=True))

    def group(self, index: int) -> GroupState:
        """Group ``index``'s buckets (``layout.groups``); for a stacked group, its row of its
        block (``BlockState.group``)."""
        block = self.layout.block_of(index)
        if block is not None:
            return self.block(block).group(block.row(index), index)
        buckets = [i for i, _ in self.layout.bucket_arrays(index)]
        return GroupState(tuple(self.master[i] for i in buckets),
                          tuple(self.streamed[i] for i in buckets), layout=self.layout,
                          index=index)

    def block(self, block: Block) -> BlockState:
        """A stacked block's arrays (``layout.blocks``)."""
        arrays = range(block.first_array,
                       block.first_array + len(self.layout.groups[block.first_group].bucket_sizes))
        return BlockState(tuple(self.master[i] for i in arrays),
                          tuple(self.streamed[i] for i in arrays), layout=self.layout,
                          block=block)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GroupState:
    """One group's buckets of an OffloadStreamState; or, where ``row`` is set, a row of a
    stacked block: ``master`` and ``streamed`` are then the block's arrays, ``row`` the group's
    row in them (an int, or traced inside a loop over the block's layers), and ``index`` a group
    of the block (they are alike but for their row)."""

    master: tuple[jax.Array, ...]
    streamed: tuple[tuple[jax.Array, ...], ...]
    layout: Layout = dataclasses.field(metadata=dict(static=True))
    index: int = dataclasses.field(metadata=dict(static=True))
    row: jax.Array | int | None = None

    def stacks(self) -> BlockState:
        """A row's block: its arrays as they are (the row written, after ``update_group``)."""
        if self.row is None:
            raise ValueError(f"group {self.index}: expected a row of a stacked block")
        return BlockState(self.master, self.streamed, layout=self.layout,
                          block=self.layout.block_of(self.index))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockState:
    """A stacked block's state (``Layout.stack_layers``): per bucket of a layer, the master's
    and the per-parameter state's arrays, a row per layer of the block."""

    master: tuple[jax.Array, ...]
    streamed: tuple[tuple[jax.Array, ...], ...]
    layout: Layout = dataclasses.field(metadata=dict(static=True))
    block: Block = dataclasses.field(metadata=dict(static=True))

    def group(self, row, index: int | None = None) -> GroupState:
        """Row ``row`` (an int, or traced) of the block as what ``update_group`` takes;
        ``index``: the group's index where known (default: the block's first group, alike)."""
        return GroupState(self.master, self.streamed, layout=self.layout,
                          index=self.block.first_group if index is None else index, row=row)

    def device_zeros(self) -> BlockState:
        """A block like this one of zeros in device memory (traceable): where the rows that
        ``update_group(..., write_back=False)`` leaves on the device are gathered
        (``with_row``), to be written back together (``OffloadStream.write_back``)."""
        sharding = self.layout.placement.stacked_sharding("device")
        master, streamed = jax.tree.map(
            lambda a: lax.with_sharding_constraint(jnp.zeros(a.shape, a.dtype), sharding),
            (self.master, self.streamed))
        return dataclasses.replace(self, master=master, streamed=streamed)

    def with_row(self, row, group_state: GroupState) -> BlockState:
        """The block with row ``row`` set to an unstacked GroupState's buckets (a row that
        ``update_group(..., write_back=False)`` left on the device, into device arrays). The
        row's arrays are made before they are written (an optimization barrier): written at a
        constant row into fresh zeros, XLA:CPU folded the write into a pad of the update's
        arithmetic, computed there a second time, and a moment's element rounded otherwise
        than in the update itself (1 ulp)."""
        rows = lax.optimization_barrier((group_state.master, group_state.streamed))
        master, streamed = _with_row((self.master, self.streamed), rows, row)
        return dataclasses.replace(self, master=master, streamed=streamed)


def _row(stacks, row):
    """Row ``row`` of every array of ``stacks`` (a pytree of arrays with a leading axis)."""
    return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, row, 0, keepdims=False), stacks)


def _with_row(stacks, rows, row):
    """``stacks`` with row ``row`` of each array set to ``rows``'s (written in place)."""
    return jax.tree.map(lambda a, r: lax.dynamic_update_index_in_dim(a, r.astype(a.dtype), row, 0),
                        stacks, rows)


def _unit(state) -> tuple:
    """(what ``layout.units()`` lists for a new state's entry, the entry)."""
    if isinstance(state, BlockState):
        return state.block, state
    if state.row is not None:
        return state.layout.block_of(state.index), state.stacks()
    return state.index, state


def _stored(layout: Layout, masters, streamed) -> tuple[tuple, tuple]:
    """The state's arrays in storage order from every group's buckets (in group order):
    a stacked block's bucket j is layer by layer's bucket j, stacked."""
    stored_masters, stored_streamed = [], []
    for unit in layout.units():
        if isinstance(unit, int):
            buckets = layout.groups[unit].bucket_indices
            stored_masters += [masters[i] for i in buckets]
            stored_streamed += [streamed[i] for i in buckets]
            continue
        for j in range(len(layout.groups[unit.first_group].bucket_sizes)):
            buckets = [layout.groups[g].first_bucket + j
                       for g in range(unit.first_group, unit.stop_group)]
            stored_masters.append(jnp.stack([masters[i] for i in buckets]))
            stored_streamed.append(tuple(jnp.stack(leaves)
                                         for leaves in zip(*(streamed[i] for i in buckets))))
    return tuple(stored_masters), tuple(stored_streamed)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepScalars:
    """What every bucket's update of one step shares."""

    shared: tuple[jax.Array, ...]
    """The transformation's shared state before the step."""
    grad_norm: jax.Array | None
    """The global gradient norm (None without clipping)."""
    apply: jax.Array | None = None
    """None, or a traced bool: False leaves the state and the weights as they were."""


def _state_shardings(layout: Layout) -> OffloadStreamState:
    """The state's shardings: the streamed buckets in host memory, the resident ones and the
    shared state on the device (the shared state replicated)."""
    placement = layout.placement
    buckets = layout.state_array_shardings()
    num_streamed = len(layout.state_split.per_param_dtypes)
    num_shared = len(layout.state_split.per_param) - num_streamed
    return OffloadStreamState(buckets, tuple((s,) * num_streamed for s in buckets),
                              (placement.replicated(),) * num_shared, layout=layout)
