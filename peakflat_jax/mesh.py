"""The MoP mesh: where every array of the model lives.

One named mesh of W = data x seq devices (``MeshConfig``):

* tokens: a batch [B, T] is split over ``data`` along B and over ``seq`` along T, so each
  device holds N = B T / W tokens; flattened to [B T] they are split over ``("data", "seq")``
  in that order (B-major), which is the token order the ring and the experts see;
* dense weights: fully sharded over all W devices (FSDP / ZeRO-3) along their largest dimension
  that W divides, gathered one layer at a time;
* attention: Ulysses: within ``seq``, a sequence <-> head all-to-all gives each device the whole
  sequence for heads / seq of the heads;
* experts: expert-parallel over all W devices (E_p = W), expert e on device e // (E / W);
* the output head's vocab: over all W devices (the ring, P = W), padded to a multiple of W.

Why these choices: every axis that shards tokens also shards experts and vocab, so each
operator's group is the whole mesh and no activation is ever replicated; the only replicated
arrays are those too small to shard (norm scales, biases).

Several processes join through ``jax.distributed.initialize`` (the coordinator, process count
and id from the config, else from JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES /
JAX_PROCESS_ID).
"""

from __future__ import annotations

import math
import os

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from peakflat_jax.config import Config, ConfigError, MeshConfig

DATA, SEQ = "data", "seq"
AXES = (DATA, SEQ)
"""The mesh's axis names, in order."""
ALL = (DATA, SEQ)
"""The axes of the experts, the vocab ring and the FSDP shards: every device."""


def initialize_distributed(config: MeshConfig) -> None:
    """Joins a multi-process run when one is configured (config or environment); a no-op for a
    single process or when already initialized."""
    address = config.coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS")
    if not address or jax.distributed.is_initialized():
        return
    num_processes = config.num_processes or int(os.environ.get("JAX_NUM_PROCESSES", "0"))
    process_id = config.process_id
    if process_id is None:
        process_id = int(os.environ.get("JAX_PROCESS_ID", "-1"))
    if num_processes < 1 or process_id < 0:
        raise ConfigError(f"mesh.coordinator_address: {address!r} needs mesh.num_processes and "
                          f"mesh.process_id (or JAX_NUM_PROCESSES and JAX_PROCESS_ID)")
    if jax.config.jax_platforms in ("cpu", None) or "cpu" in str(jax.config.jax_platforms):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(address, num_processes, process_id)


def mesh_shape(config: MeshConfig, num_devices: int) -> tuple[int, int]:
    """(data, seq) for ``num_devices`` devices; raises ConfigError naming the key that does not
    fit."""
    data = config.data
    if num_devices % data:
        raise ConfigError(f"mesh.data: {data} does not divide the {num_devices} devices")
    seq = num_devices // data if config.seq == -1 else config.seq
    if data * seq != num_devices:
        raise ConfigError(f"mesh.seq: data x seq = {data} x {seq} = {data * seq}, but there are "
                          f"{num_devices} devices")
    return data, seq


def make_mesh(config: MeshConfig, devices=None) -> Mesh:
    """The (data, seq) mesh over ``devices`` (default: all), axes of type Auto."""
    devices = jax.devices() if devices is None else list(devices)
    shape = mesh_shape(config, len(devices))
    return jax.make_mesh(shape, AXES, axis_types=(jax.sharding.AxisType.Auto,) * 2,
                         devices=devices)


def num_devices(mesh: Mesh) -> int:
    return math.prod(mesh.shape.values())


def padded_vocab(vocab_size: int, num_devices: int) -> int:
    """The head's vocab rounded up to a multiple of the ring size."""
    return -(-vocab_size // num_devices) * num_devices


def check_model_fits_mesh(config: Config, mesh: Mesh) -> None:
    """Raises ConfigError naming the key when the mesh does not divide the model or the batch."""
    model, data = config.model, config.data
    data_degree, seq_degree = mesh.shape[DATA], mesh.shape[SEQ]
    width = num_devices(mesh)
    if data.batch_size % data_degree:
        raise ConfigError(f"data.batch_size: {data.batch_size} sequences do not split over "
                          f"mesh.data = {data_degree}")
    if data.seq_len % seq_degree:
        raise ConfigError(f"data.seq_len: {data.seq_len} tokens do not split over mesh.seq = "
                          f"{seq_degree}")
    if model.num_heads % seq_degree:
        raise ConfigError(f"model.num_heads: {model.num_heads} heads do not split over "
                          f"mesh.seq = {seq_degree} (Ulysses attention gives each device "
                          f"num_heads / seq heads)")
    if model.num_experts % width:
        raise ConfigError(f"model.num_experts: {model.num_experts} experts do not split over "
                          f"the {width} devices of the mesh (expert parallelism over all of them)")


def token_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """[B, T, ...]: B over data, T over seq."""
    return NamedSharding(mesh, P(DATA, SEQ, *([None] * (ndim - 2))))


def flat_token_spec() -> P:
    """[B T, ...] flattened tokens: over every device, B-major."""
    return P(ALL)


def fsdp_spec(shape: tuple[int, ...], width: int, *, skip_leading: int = 0) -> P:
    """Shards the largest dimension that ``width`` divides (after ``skip_leading`` dims, e.g. a
    stacked layer axis) over every device; replicated when none does (small arrays)."""
    candidates = [(size, axis) for axis, size in enumerate(shape)
                  if axis >= skip_leading and size % width == 0 and size >= width]
    if not candidates:
        return P()
    _, axis = max(candidates, key=lambda t: (t[0], -t[1]))
    spec = [None] * len(shape)
    spec[axis] = ALL
    return P(*spec)


def expert_spec(ndim: int, expert_axis: int) -> P:
    """Experts over every device along ``expert_axis``."""
    spec = [None] * ndim
    spec[expert_axis] = ALL
    return P(*spec)


def describe(mesh: Mesh) -> str:
    kinds = sorted({d.device_kind for d in np.asarray(mesh.devices).flat})
    return (f"{num_devices(mesh)} x {', '.join(kinds)} as data {mesh.shape[DATA]} x seq "
            f"{mesh.shape[SEQ]} ({jax.process_count()} process"
            f"{'es' if jax.process_count() > 1 else ''})")
