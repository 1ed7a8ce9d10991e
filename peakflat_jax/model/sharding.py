"""Where each of the decoder's weights lives on the MoP mesh, and the model made there.

* the experts' stacked [L, E, ...] weights (and biases): E over every device (expert
  parallelism);
* the head [H, V'] along V' and the embedding [V', H] along V' over every device (the ring's
  vocab shards; a tied head is the embedding transposed, so the same split);
* the router's balancing bias: replicated (E floats);
* every other weight: FSDP over every device along its largest dimension that the device
  count divides (a stacked layer axis never), replicated when none does (norm scales).
"""

from __future__ import annotations

import functools

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from peakflat_jax import mesh as mop
from peakflat_jax.config import ModelConfig
from peakflat_jax.model.decoder import MoEDecoder

_EXPERT_WEIGHTS = ("w_gate", "w_up", "w_down", "b_gate", "b_up", "b_down")


def weight_spec(path: tuple[str, ...], shape: tuple[int, ...], width: int) -> P:
    """The PartitionSpec of the weight at ``path`` (names, without the trailing 'value')."""
    stacked = path[0] in ("dense_layers", "moe_layers")
    if stacked and len(path) >= 3 and path[-2] == "moe" and path[-1] in _EXPERT_WEIGHTS:
        return mop.expert_spec(len(shape), expert_axis=1)
    if path == ("embedding",):
        return P(mop.ALL, None) if shape[0] % width == 0 else P()
    if path == ("head",):
        return P(None, mop.ALL) if shape[1] % width == 0 else P()
    if path[-1] == "router_bias":
        return P()
    return mop.fsdp_spec(shape, width, skip_leading=1 if stacked else 0)


def _names(path) -> tuple[str, ...]:
    names = tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in path)
    return names[:-1] if names and names[-1] == "value" else names


def state_shardings(state, mesh: Mesh):
    """NamedShardings shaped like the model's (abstract) state."""
    width = mop.num_devices(mesh)
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: NamedSharding(mesh, weight_spec(_names(path), leaf.shape, width)),
        state)


def init_model(config: ModelConfig, mesh: Mesh, seed: int):
    """(graphdef, state): the decoder's weights made randomly, directly in their shards (no
    device ever holds the whole model). A checkpoint's weights: ``hf.load.init_or_load``.
    The initialisation is compiled once per model and mesh (the seed is its argument), so a
    second trainer of the same model, any seed, starts without compiling it again."""
    graphdef, make_state = _initializer(config, mesh)
    return graphdef, make_state(jax.numpy.uint32(seed % 2**32))  # nnx.Rngs(int)'s key bits


@functools.lru_cache(maxsize=8)
def _initializer(config: ModelConfig, mesh: Mesh):
    """(graphdef, the jitted seed -> state) of ``config`` on ``mesh``."""
    padded = mop.padded_vocab(config.vocab_size, mop.num_devices(mesh))

    def make(seed):  # nnx.Rngs(int) keys its streams with jax.random.key(int): the same bits
        return MoEDecoder(config, padded_vocab=padded, rngs=nnx.Rngs(jax.random.key(seed)))

    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: make(0)))
    shardings = state_shardings(abstract, mesh)
    return graphdef, jax.jit(lambda seed: nnx.split(make(seed))[1], out_shardings=shardings)


def abstract_model(config: ModelConfig, mesh: Mesh):
    """(graphdef, state) as ``init_model`` gives them, the state as ShapeDtypeStructs with their
    shardings: nothing is computed or read (a checkpoint's restore target)."""
    padded = mop.padded_vocab(config.vocab_size, mop.num_devices(mesh))
    graphdef, abstract = nnx.split(nnx.eval_shape(
        lambda: MoEDecoder(config, padded_vocab=padded, rngs=nnx.Rngs(0))))
    return graphdef, jax.tree.map(
        lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
        abstract, state_shardings(abstract, mesh))
