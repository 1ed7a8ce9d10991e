"""Where every parameter of a streamed optimizer's state sits: placement, groups and buckets.

The params' leaves (each device's shards of them, on a mesh) are ordered into groups, and each
group's leaves, flattened and concatenated, are cut into buckets of at most ``bucket_params``
elements (a bucket may split a leaf, never a group). Without ``stacked_layers`` there is one
group, the leaves in tree order. With it, the leaves marked stacked carry a leading layer axis
``L``: the unmarked leaves form the first group, then layer l's slices of the stacked leaves form
group 1 + l, in layer order, so that one layer's state can be updated on its own.

The first ``resident_groups`` groups keep their state in device memory (resident); the others'
lives in host memory (pinned_host) and is streamed through the device by the step.

A bucket of the state is one global array of ``num_devices * bucket_size`` elements split over
every mesh axis: a piece per device, each device's piece cut from its own shards. With
``stack_layers`` the layer groups' buckets are stored stacked instead: the layer groups of one
residency form a block, and bucket j of every layer of a block is one row of one array
``[layers, num_devices * bucket_size_j]`` (every layer group has the same buckets). A loop over
the layers then reads and writes layer l's buckets as row l of whole arrays; separate arrays per
layer could only be indexed by a layer known when tracing.

Everything here is hashable: the layout is the static metadata of the state.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from peakflat_jax.optim._elementwise import StateSplit


@dataclasses.dataclass(frozen=True)
class Piece:
    """A run of one group leaf's flattened elements inside one bucket."""

    leaf: int
    """Index into the group's leaves."""
    leaf_start: int
    bucket_start: int
    size: int


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where the leaves live: a mesh, each leaf's PartitionSpec on it, and the shape of the
    shard each device holds. Unsharded params live on a one-device mesh, so one code path serves
    both."""

    mesh: Mesh
    specs: tuple[P, ...]
    local_shapes: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, leaves) -> Placement:
        shardings = [getattr(leaf, "sharding", None) for leaf in leaves]
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

    def stacked_sharding(self, memory_kind: str) -> NamedSharding:
        """A block's stacked state: rows of layers, each row split as ``state_sharding``."""
        return NamedSharding(self.mesh, P(None, tuple(self.mesh.axis_names)),
                             memory_kind=memory_kind)

    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    def local(self, fn, in_specs, out_specs, *, rebuilds_leaves: bool = False):
        """``fn`` on each device's shards (shard_map over the whole mesh).

        ``rebuilds_leaves``: ``fn`` returns shards of leaves from parts of buckets. That needs
        check_vma=False: the buckets are split over every mesh axis, so the type system sees
        every piece as varying over all of them, while a leaf replicated over some axes is
        rebuilt from pieces that are equal on its replicas (each replica applied the same update
        to the same values). JAX cannot infer that, and making it inferable would take a
        collective."""
        return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs,
                             check_vma=not rebuilds_leaves)


@dataclasses.dataclass(frozen=True)
class Group:
    """Leaves updated together: whole leaves (``layer`` None) or layer ``layer``'s slices of
    stacked leaves; their flat vector is cut into buckets."""

    leaves: tuple[int, ...]
    """Indices of the params' leaves (tree order)."""
    layer: int | None
    specs: tuple[P, ...]
    """The group leaves' specs (a stacked leaf's without its layer axis)."""
    local_shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[Any, ...]
    first_bucket: int
    """Index of the group's first bucket in the state."""
    bucket_sizes: tuple[int, ...]
    buckets: tuple[tuple[Piece, ...], ...]

    @property
    def bucket_indices(self) -> range:
        """The group's buckets' indices among every group's buckets (the state's arrays where
        no layers are stacked: ``Layout.bucket_arrays`` says where each is stored)."""
        return range(self.first_bucket, self.first_bucket + len(self.bucket_sizes))

    def gather(self, local_leaves, bucket: int, dtype=jnp.float32) -> jax.Array:
        """The group's bucket ``bucket`` (its own index) of this device's shards, as
        ``dtype``."""
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
        """This device's shards of the group leaves from every bucket's ``pieces``."""
        dtypes = self.dtypes if dtypes is None else dtypes
        parts: list[list[tuple[int, jax.Array]]] = [[] for _ in self.leaves]
        for pieces, layout in zip(pieces_per_bucket, self.buckets):
            for piece, p in zip(pieces, layout):
                parts[p.leaf].append((p.leaf_start, piece))
        leaves = []
        for shape, dtype, leaf_parts in zip(self.local_shapes, dtypes, parts):
            if not leaf_parts:  # a leaf of size zero lies in no bucket
                leaves.append(jnp.zeros(shape, dtype))
                continue
            flat = jnp.concatenate([x for _, x in sorted(leaf_parts, key=lambda t: t[0])])
            leaves.append(flat.reshape(shape))
        return leaves


@dataclasses.dataclass(frozen=True)
class Block:
    """Consecutive layer groups of one residency whose state is stacked (``Layout.stack_layers``):
    groups ``first_group`` to ``stop_group - 1`` are rows 0, 1, ... of the arrays from
    ``first_array`` on, one array per bucket of a layer."""

    first_group: int
    stop_group: int
    resident: bool
    first_array: int

    @property
    def num_layers(self) -> int:
        return self.stop_group - self.first_group

    def row(self, group: int) -> int:
        """Group ``group``'s row in the block's arrays."""
        return group - self.first_group


@dataclasses.dataclass(frozen=True)
class Layout:
    """The params' tree and placement, the groups and their buckets, and the split of the
    transformation's state (which leaves stream)."""

    treedef: Any
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[Any, ...]
    placement: Placement
    groups: tuple[Group, ...]
    state_split: StateSplit
    resident_groups: int = 0
    """How many of the first groups keep their state in device memory (the rest: pinned_host)."""
    stack_layers: bool = False
    """The layer groups' buckets stored stacked, a block per residency (module doc)."""

    @classmethod
    def of(cls, params, bucket_params: int, state_split: StateSplit,
           stacked_layers=None, resident_groups: int = 0,
           stack_layers: bool = False) -> Layout:
        leaves, treedef = jax.tree.flatten(params)
        if not any(math.prod(leaf.shape) for leaf in leaves):
            raise ValueError("params: expected at least one non-empty array")
        placement = Placement.of(leaves)
        stacked = _stacked_flags(stacked_layers, params, leaves, placement)
        unstacked = tuple(i for i, flag in enumerate(stacked) if not flag)
        layered = tuple(i for i, flag in enumerate(stacked) if flag)
        num_layers = leaves[layered[0]].shape[0] if layered else 0
        groups, first_bucket = [], 0
        for layer in ([None] if unstacked else []) + list(range(num_layers)):
            members = unstacked if layer is None else layered
            cut = (lambda x: x) if layer is None else (lambda x: x[1:])
            group = _cut_into_buckets(
                members, layer, tuple(P(*cut(tuple(placement.specs[i]))) for i in members),
                tuple(tuple(cut(placement.local_shapes[i])) for i in members),
                tuple(jnp.dtype(leaves[i].dtype) for i in members), first_bucket,
                bucket_params)
            groups.append(group)
            first_bucket += len(group.bucket_sizes)
        if (isinstance(resident_groups, bool) or not isinstance(resident_groups, int)
                or not 0 <= resident_groups <= len(groups)):
            raise ValueError(f"resident_groups: expected an int from 0 to the layout's "
                             f"{len(groups)} groups, got {resident_groups!r}")
        if stack_layers and not layered:
            raise ValueError("stack_layers: expected layer groups to stack (stacked_layers)")
        return cls(treedef, tuple(tuple(leaf.shape) for leaf in leaves),
                   tuple(jnp.dtype(leaf.dtype) for leaf in leaves), placement, tuple(groups),
                   state_split, resident_groups, bool(stack_layers))

    @property
    def bucket_sizes(self) -> tuple[int, ...]:
        return tuple(n for group in self.groups for n in group.bucket_sizes)

    def resident(self, group: int) -> bool:
        """Whether group ``group``'s state lives in device memory (not streamed)."""
        return group < self.resident_groups

    def memory_kinds(self) -> tuple[str, ...]:
        """Per array of the state, the memory kind it lives in: ``device`` (resident) or
        ``pinned_host`` (without ``stack_layers``: per bucket)."""
        return tuple(kind for _, kind in self._arrays())

    @property
    def blocks(self) -> tuple[Block, ...]:
        """The stacked blocks (``stack_layers``): the layer groups split by residency."""
        if not self.stack_layers:
            return ()
        blocks, first_array, index = [], 0, 0
        while index < len(self.groups):
            group = self.groups[index]
            stop = index
            while (stop < len(self.groups) and self.groups[stop].layer is not None
                   and self.resident(stop) == self.resident(index)):
                stop += 1
            if stop > index:
                blocks.append(Block(index, stop, self.resident(index), first_array))
            first_array += len(group.bucket_sizes)
            index = max(stop, index + 1)
        return tuple(blocks)

    def block_of(self, group: int) -> Block | None:
        """The stacked block holding group ``group``'s state, or None."""
        return next((b for b in self.blocks if b.first_group <= group < b.stop_group), None)

    def units(self) -> tuple[int | Block, ...]:
        """What a new state is made of, in storage order: each unstacked group's index and each
        block (``OffloadStreamState.new_state``)."""
        units = []
        for index in range(len(self.groups)):
            block = self.block_of(index)
            if block is None:
                units.append(index)
            elif block.first_group == index:
                units.append(block)
        return tuple(units)

    def bucket_arrays(self, group: int) -> tuple[tuple[int, int | None], ...]:
        """Per bucket of group ``group``: (the index of the state's array holding it, its row
        there, None for an unstacked bucket)."""
        block = self.block_of(group)
        count = len(self.groups[group].bucket_sizes)
        if block is None:
            first = self._first_array(group)
            return tuple((first + b, None) for b in range(count))
        return tuple((block.first_array + b, block.row(group)) for b in range(count))

    def _first_array(self, group: int) -> int:
        return sum(len(self.groups[i].bucket_sizes) for i in range(group)
                   if (b := self.block_of(i)) is None or b.first_group == i)

    def _arrays(self) -> list[tuple[tuple[int, ...], str]]:
        """(shape, memory kind) of each array of the state, in storage order."""
        devices, arrays = self.placement.num_devices, []
        for index, group in enumerate(self.groups):
            kind = "device" if self.resident(index) else "pinned_host"
            block = self.block_of(index)
            if block is None:
                arrays += [((devices * n,), kind) for n in group.bucket_sizes]
            elif block.first_group == index:
                arrays += [((block.num_layers, devices * n), kind) for n in group.bucket_sizes]
        return arrays

    def resident_params(self) -> int:
        """Parameters per device whose state is resident."""
        return sum(sum(g.bucket_sizes) for g in self.groups[:self.resident_groups])

    def layer_group(self, layer: int) -> int:
        """The index of the group of layer ``layer``'s slices (``stacked_layers`` layouts)."""
        for index, group in enumerate(self.groups):
            if group.layer == layer:
                return index
        raise ValueError(f"layer: expected one of the stacked layers "
                         f"{[g.layer for g in self.groups if g.layer is not None]}, got {layer}")

    def group_leaves(self, tree, group: int) -> list:
        """Group ``group``'s leaves of a params-shaped ``tree`` (layer slices for a layer
        group): what ``update_group`` takes as gradients."""
        leaves = jax.tree.leaves(tree)
        chosen = self.groups[group]
        if chosen.layer is None:
            return [leaves[i] for i in chosen.leaves]
        return [leaves[i][chosen.layer] for i in chosen.leaves]

    def merge_groups(self, leaves_per_group) -> list:
        """The params' leaves (tree order) from every group's leaves: whole leaves taken as
        they are, layer slices stacked. A stacked leaf of no layer (L = 0) does not occur:
        stacking needs L >= 1."""
        whole, slices = {}, {}
        for group, group_leaves in zip(self.groups, leaves_per_group):
            for i, leaf in zip(group.leaves, group_leaves):
                if group.layer is None:
                    whole[i] = leaf
                else:
                    slices.setdefault(i, []).append(leaf)
        return [whole[i] if i in whole else jnp.stack(slices[i]) for i in range(len(self.shapes))]

    def leaf_shardings(self) -> list[NamedSharding]:
        return [NamedSharding(self.placement.mesh, spec) for spec in self.placement.specs]

    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """Per array of the state, its global shape."""
        return tuple(shape for shape, _ in self._arrays())

    def state_array_shardings(self) -> tuple[NamedSharding, ...]:
        """Per array of the state, its sharding (a stacked block's rows of layers unsplit)."""
        return tuple(self.placement.stacked_sharding(kind) if len(shape) == 2
                     else self.placement.state_sharding(kind) for shape, kind in self._arrays())

    def describe(self) -> dict:
        """What a checkpoint must match to be restored here (JSON): the buckets and groups, the
        mesh positions and shards whose pieces they hold, and the transformation's state. Not
        which groups are resident (the same values restore into device or host memory), except
        where layers are stacked: there the residency splits the blocks, whose arrays' shapes
        it sets."""
        mesh = self.placement.mesh
        split = self.state_split
        stacked = ({"stacked_blocks": [[b.first_group, b.stop_group, b.resident]
                                       for b in self.blocks]} if self.stack_layers else {})
        return {**stacked, "bucket_sizes": list(self.bucket_sizes),
                "groups": [[None if g.layer is None else g.layer, list(g.leaves),
                            len(g.bucket_sizes)] for g in self.groups],
                "treedef": str(self.treedef),
                "shapes": [list(shape) for shape in self.shapes],
                "dtypes": [str(dtype) for dtype in self.dtypes],
                # In order: the state's pieces follow the mesh positions, axis by axis.
                "mesh": [[str(name), int(size)] for name, size in mesh.shape.items()],
                "specs": [str(spec) for spec in self.placement.specs],
                "local_shapes": [list(shape) for shape in self.placement.local_shapes],
                "transformation_state": str(split.treedef),
                "streamed_dtypes": [str(dtype) for dtype in split.per_param_dtypes]}

    def __repr__(self) -> str:  # the state's treedef prints it: keep it to a line
        sizes = self.bucket_sizes
        resident = f", {self.resident_groups} resident" if self.resident_groups else ""
        resident += ", layers stacked" if self.stack_layers else ""
        return (f"Layout({len(sizes)} buckets of {list(sizes[:4])}"
                f"{'...' if len(sizes) > 4 else ''} in {len(self.groups)} groups{resident} over "
                f"{len(self.shapes)} leaves, mesh {dict(self.placement.mesh.shape)})")


def _cut_into_buckets(members, layer, specs, local_shapes, dtypes, first_bucket,
                      bucket_params) -> Group:
    sizes = [math.prod(shape) for shape in local_shapes]
    total = sum(sizes)
    bucket_sizes = [min(bucket_params, total - start) for start in range(0, total, bucket_params)]
    leaf_starts = np.cumsum([0, *sizes])
    buckets = []
    for b, bucket_size in enumerate(bucket_sizes):
        lo, hi = b * bucket_params, b * bucket_params + bucket_size
        pieces = []
        for leaf, (start, end) in enumerate(zip(leaf_starts[:-1], leaf_starts[1:])):
            a, z = max(lo, start), min(hi, end)
            if a < z:
                pieces.append(Piece(leaf, int(a - start), int(a - lo), int(z - a)))
        buckets.append(tuple(pieces))
    return Group(tuple(members), layer, specs, local_shapes, dtypes, first_bucket,
                 tuple(bucket_sizes), tuple(buckets))


def _stacked_flags(stacked_layers, params, leaves, placement) -> tuple[bool, ...]:
    """Per leaf, whether its leading axis is the layer axis; checks the stacked leaves."""
    if stacked_layers is None:
        return (False,) * len(leaves)
    try:
        flags = jax.tree.leaves(jax.tree.map(
            lambda flag, subtree: jax.tree.map(lambda _: bool(flag), subtree), stacked_layers,
            params))
    except (ValueError, TypeError) as error:
        raise ValueError(f"stacked_layers: expected a pytree of bools with the params' "
                         f"structure (or a prefix of it): {error}") from error
    stacked = [i for i, flag in enumerate(flags) if flag]
    if not stacked:
        raise ValueError("stacked_layers: expected at least one leaf marked True")
    num_layers = {leaves[i].shape[0] if leaves[i].ndim else None for i in stacked}
    if len(num_layers) != 1 or None in num_layers or 0 in num_layers:
        raise ValueError(f"stacked_layers: expected every marked leaf to have the same leading "
                         f"layer axis of size >= 1, got leading sizes "
                         f"{sorted(map(str, num_layers))}")
    for i in stacked:
        spec = tuple(placement.specs[i])
        if spec and spec[0] is not None:
            raise ValueError(f"stacked_layers: the layer axis of leaf {i} is sharded "
                             f"({placement.specs[i]}); each device must hold every layer")
    return tuple(flags)
