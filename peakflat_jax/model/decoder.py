"""The MoP decoder: a long-context MoE language model whose layer stack runs through SCO and
whose loss runs through Ring-DTP.

    tokens [B, T] -> embedding -> L decoder layers (the first ``num_dense_layers`` with a dense
    FFN, the rest with the MoE) -> RMSNorm -> head [H, V'] -> mean cross-entropy over the
    valid targets

The layers are stacked (a leading L axis on every weight, made with ``nnx.vmap``) and run by
``pf.sco_scan`` (one stack for the dense layers, one for the MoE layers): each layer is
rematerialized in backward from its input, and the inputs chosen by ``operators.offload`` wait
in host memory. The carry holds, besides h, the step's positions and segment ids (integers:
they travel, nothing offloads them) and the MoE layers' per-expert counts, which the trainer
uses for the router's bias balancing.

Memory per device with the operators on (the planner's terms, ``peakflat_jax.plan``): the
weight and gradient shards; the kept checkpoint boundaries, 2 restored ones; one layer's
recompute (attention, the MoE's chunk buffers: ``pf.pipelined_moe``'s bound); the loss's
strips (``pf.ring_cross_entropy``'s bound).

Legend: B sequences, T sequence length, H hidden, L layers, V vocab, V' = V padded to a
multiple of the mesh's W devices, E experts.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from peakflat_jax import mesh as mop
from peakflat_jax.config import ModelConfig
from peakflat_jax.model.layers import DecoderLayer, RMSNorm, Runtime, _normal, gathered, on_tokens
from peakflat_jax.ops.global_forms import (
    materialized_cross_entropy_global,
    ring_cross_entropy_global,
)
from peakflat_jax.ops.sco import MadeInLoop, MadeInScan, PerLayer, sco_scan

IGNORE = -100
"""The target of a token that predicts nothing (document ends, padding)."""


def embedding_init_std(config: ModelConfig) -> float:
    """``model.embedding_init_std`` resolved: the residual stream starts at RMS ~1 (its
    docstring says why), or, tied, the table is sized as the head."""
    if config.embedding_init_std is not None:
        return config.embedding_init_std
    return 1 / math.sqrt(config.hidden) if config.tie_embeddings else 1.0


def head_init_std(config: ModelConfig) -> float:
    """``model.head_init_std`` resolved: 1 / sqrt(H), logits of std ~1 from the unit-RMS final
    norm."""
    return 1 / math.sqrt(config.hidden) if config.head_init_std is None else config.head_init_std


def _stack(config: ModelConfig, count: int, *, moe: bool, rngs: nnx.Rngs) -> DecoderLayer:
    """``count`` layers as one module whose weights have a leading layer axis."""
    @nnx.split_rngs(splits=count)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs: nnx.Rngs) -> DecoderLayer:
        return DecoderLayer(config, moe=moe, rngs=rngs)

    return create(rngs)


class MoEDecoder(nnx.Module):
    """The model (module doc). ``padded_vocab``: V rounded up to a multiple of the mesh's
    devices (``mesh.padded_vocab``)."""

    def __init__(self, config: ModelConfig, *, padded_vocab: int, rngs: nnx.Rngs):
        dtype = jnp.dtype(config.dtype)
        self.config = config
        self.padded_vocab = padded_vocab
        self.embedding = _normal(rngs, (padded_vocab, config.hidden),
                                 embedding_init_std(config), dtype)
        num_dense = config.num_dense_layers
        num_moe = config.num_layers - num_dense
        self.dense_layers = _stack(config, num_dense, moe=False, rngs=rngs) if num_dense else None
        self.moe_layers = _stack(config, num_moe, moe=True, rngs=rngs) if num_moe else None
        self.final_norm = RMSNorm(config.hidden, config.norm_eps, dtype)
        self.head = None if config.tie_embeddings else _normal(
            rngs, (config.hidden, padded_vocab), head_init_std(config), dtype)

    @property
    def num_moe_layers(self) -> int:
        return self.config.num_layers - self.config.num_dense_layers

    def __call__(self, batch: dict, run: Runtime, offload: tuple[bool, ...],
                 moe_layers: PerLayer | MadeInLoop | MadeInScan | None = None):
        """(mean loss over the valid targets, per-layer expert counts [L_moe, E] int32).

        ``batch``: tokens, targets, positions, segment_ids, each [B, T] int32, split over the
        mesh's (data, seq) axes. ``offload``: L bools, the boundaries SCO keeps in host memory.
        ``moe_layers``: the MoE layers' variables given per layer (a PerLayer of per-layer
        nnx.States, e.g. weights and router bias), instead of this module's stacked ones: a
        step that updates each layer's weights itself lets layer l start before the later
        layers' weights exist; a MadeInLoop (unrolled layers) or a MadeInScan (scanned) makes
        them inside the forward, each behind the layer before. With no valid target the mean
        is NaN (as torch's)."""
        config = self.config
        h, counts = self.final_hidden(batch, run, offload, moe_layers)
        loss = mean_cross_entropy(h.reshape(-1, config.hidden), self.head_kernel(),
                                  batch["targets"].reshape(-1), run, config.vocab_size)
        return loss, counts

    def final_hidden(self, batch: dict, run: Runtime, offload: tuple[bool, ...],
                     moe_layers: PerLayer | MadeInLoop | MadeInScan | None = None
                     ) -> tuple[jax.Array, jax.Array]:
        """(the final RMSNorm's output [B, T, H], per-layer expert counts [L_moe, E]): the
        model up to its head (``__call__``'s arguments; ``batch`` needs no targets)."""
        config, mesh = self.config, run.mesh
        table = gathered(mesh, self.embedding[...])
        h = on_tokens(mesh, jnp.take(table, batch["tokens"], axis=0))
        carry = {"h": h, "positions": batch["positions"], "segment_ids": batch["segment_ids"]}
        num_dense = config.num_dense_layers
        if self.dense_layers is not None:
            carry = self._run_stack(self.dense_layers, carry, run, offload[:num_dense],
                                    first_layer=0)
        counts = jnp.zeros((self.num_moe_layers, config.num_experts), jnp.int32)
        if self.moe_layers is not None:
            carry = self._run_stack(self.moe_layers, {**carry, "counts": counts}, run,
                                    offload[num_dense:], moe_layers, first_layer=num_dense)
            counts = carry["counts"]
        return self.final_norm(carry["h"]), counts

    def head_kernel(self) -> jax.Array:
        """The output head [H, V']: its own weight, or the embedding transposed when tied."""
        return self.embedding[...].T if self.head is None else self.head[...]

    def logits(self, batch: dict, run: Runtime, offload: tuple[bool, ...]) -> jax.Array:
        """[B, T, V] fp32 logits of the true vocabulary, materialized (for checks against
        another implementation and for evaluation at small V; training never forms them)."""
        h, _ = self.final_hidden(batch, run, offload)
        logits = jnp.einsum("bth,hv->btv", h, gathered(run.mesh, self.head_kernel()),
                            preferred_element_type=jnp.float32)
        return logits[..., : self.config.vocab_size]

    def _run_stack(self, stack: DecoderLayer, carry: dict, run: Runtime,
                   offload: tuple[bool, ...],
                   per_layer: PerLayer | MadeInLoop | MadeInScan | None = None, *,
                   first_layer: int) -> dict:
        graphdef, state = nnx.split(stack)
        windows = layer_windows(self.config)
        if windows is not None:  # this stack's, indexed by the traced layer index
            windows = jnp.asarray(windows[first_layer:first_layer + len(offload)], jnp.int32)
        if per_layer is None:
            params = ((state,), jnp.arange(len(offload), dtype=jnp.int32))
        elif isinstance(per_layer, MadeInLoop | MadeInScan):
            params = per_layer.map_params(lambda i, states: (tuple(states), jnp.int32(i)))
        else:
            params = PerLayer(tuple((tuple(states), jnp.int32(i))
                                    for i, states in enumerate(per_layer.layers)))

        def layer_fn(carry, params):
            layer_states, layer_index = params
            layer = nnx.merge(graphdef, *layer_states)
            window = None if windows is None else windows[layer_index]
            h, counts = layer(carry["h"], carry["positions"], carry["segment_ids"], run, window)
            carry = {**carry, "h": h}
            if counts is not None:
                carry["counts"] = carry["counts"].at[layer_index].set(counts)
            return carry

        return sco_scan(layer_fn, carry, params, offload=offload,
                        loop=run.operators.layer_loop)


def layer_windows(config: ModelConfig) -> tuple[int, ...] | None:
    """Each layer's sliding window (0: the whole document), or None when no layer slides
    (``model.sliding_window``, ``model.sliding_window_layers``)."""
    if not config.sliding_window:
        return None
    return tuple(config.sliding_window if config.sliding_window_layers == "all" or layer % 2 == 0
                 else 0 for layer in range(config.num_layers))


def mean_cross_entropy(hidden: jax.Array, kernel: jax.Array, targets: jax.Array, run: Runtime,
                       vocab_size: int) -> jax.Array:
    """The mean loss over the valid targets of the global batch, by the configured loss: the
    ring's reduced form (one pass over the vocabulary where a device sees all of it, a
    strip-by-strip ring otherwise), or the materialized baseline."""
    ops = run.operators
    common = dict(mesh=run.mesh, axis_name=mop.ALL, vocab_size=vocab_size, ignore_index=IGNORE,
                  reduction="mean")
    if ops.loss == "ring":
        return ring_cross_entropy_global(hidden, kernel, targets, mode=ops.loss_mode,
                                         vocab_block=ops.vocab_block, **common)
    return materialized_cross_entropy_global(hidden, kernel, targets, **common)
