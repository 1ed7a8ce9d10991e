"""The decoder's size in closed form: parameters by part, and the model's FLOPs.

Pure functions of the config (and, for attention, of the batch's documents), shared by the
planner (bytes of every weight shard, the step-time estimate) and the trainer (model TFLOP/s
and MFU). Model FLOPs count forward and backward, not the recomputation: the figure a stack
without remat would need, so that stacks compare fairly.

The convention (``FLOPS_CONVENTION``): matmuls 6 per active weight per token (2 forward, 4
backward), over every token of the batch; attention 12 Hq D per layer per causal query-key
pair (QK^T and PV, 2 FLOPs each per pair and head dimension, times 3 for forward + backward),
over the pairs that attention within documents computes: ``causal_pairs``, the sum over rows
and documents (segment id > 0; padding, id 0, is no document) of L_s (L_s + 1) / 2. That is
what runs: the kernels mask (XLA) or skip (cuDNN's packed-segment layout) the pairs that cross
a document boundary. With one document per sequence (synthetic data) it is full causal,
T (T + 1) / 2 per sequence (``model_flops_per_token``).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from peakflat_jax.config import ModelConfig

FLOPS_CONVENTION = ("model FLOPs: 6 x active params x tokens (matmuls, forward + backward) + "
                    "12 x layers x query heads x head_dim x causal pairs within documents "
                    "(segment ids > 0 of each batch); no recompute")
"""The convention of every model FLOP figure, as the trainer's summary states it."""


@dataclasses.dataclass(frozen=True)
class ParameterCounts:
    """Parameters of each part (elements, the head's padded vocab included)."""

    embedding: int
    head: int
    attention_per_layer: int
    dense_ffn_per_layer: int
    router_per_layer: int
    experts_per_layer: int
    shared_expert_per_layer: int
    norms: int
    num_dense_layers: int
    num_moe_layers: int

    @property
    def dense_total(self) -> int:
        """Everything but the routed experts: what FSDP shards."""
        layers = (self.num_dense_layers + self.num_moe_layers) * self.attention_per_layer
        layers += self.num_dense_layers * self.dense_ffn_per_layer
        layers += self.num_moe_layers * (self.router_per_layer + self.shared_expert_per_layer)
        return self.embedding + self.head + layers + self.norms

    @property
    def expert_total(self) -> int:
        """The routed experts: what expert parallelism splits."""
        return self.num_moe_layers * self.experts_per_layer

    @property
    def total(self) -> int:
        return self.dense_total + self.expert_total


def parameter_counts(config: ModelConfig, padded_vocab: int) -> ParameterCounts:
    h, hq, hkv, d = config.hidden, config.num_heads, config.num_kv_heads, config.head_dim
    num_moe = config.num_layers - config.num_dense_layers
    return ParameterCounts(
        embedding=padded_vocab * h,
        head=0 if config.tie_embeddings else h * padded_vocab,
        attention_per_layer=h * d * (2 * hq + 2 * hkv)
        + ((hq + 2 * hkv) * d + h if config.attention_bias else 0)
        + (hq if config.attention_sinks else 0),
        dense_ffn_per_layer=3 * h * config.dense_ffn,
        router_per_layer=h * config.num_experts
        + (config.num_experts if config.router_logit_bias else 0),
        experts_per_layer=3 * config.num_experts * h * config.expert_ffn
        + (config.num_experts * (2 * config.expert_ffn + h) if config.expert_bias else 0),
        shared_expert_per_layer=3 * h * config.shared_expert_ffn,
        norms=h * (2 * config.num_layers + 1) + (2 * d * config.num_layers if config.qk_norm
                                                  else 0),
        num_dense_layers=config.num_dense_layers, num_moe_layers=num_moe)


def active_parameters_per_token(config: ModelConfig) -> int:
    """Weights one token's forward multiplies by (its k experts, not all E; the true vocab)."""
    counts = parameter_counts(config, config.vocab_size)
    per_moe_layer = (counts.router_per_layer + counts.shared_expert_per_layer
                     + 3 * config.top_k * config.hidden * config.expert_ffn)
    return (config.num_layers * counts.attention_per_layer
            + counts.num_dense_layers * counts.dense_ffn_per_layer
            + counts.num_moe_layers * per_moe_layer + config.hidden * config.vocab_size)


def causal_pairs(segment_ids: np.ndarray) -> int:
    """The query-key pairs of causal attention within documents in a batch of ``segment_ids``
    ``[B, T]`` (or ``[T]``): the sum over rows and over the ids s > 0 of L_s (L_s + 1) / 2,
    L_s the tokens of id s in the row (the data pipeline's convention: ids 1, 2, ... number a
    sequence's documents, 0 is padding). Tokens of one id attend to the earlier ones of that id
    (the attention mask), so the count is the mask's."""
    ids = np.asarray(segment_ids)
    ids = ids.reshape(-1, ids.shape[-1]) if ids.ndim else ids.reshape(1, 1)
    if ids.size == 0:
        return 0
    if ids.min() < 0:
        raise ValueError(f"segment_ids: expected ids >= 0, got {ids.min()}")
    width = int(ids.max()) + 1
    rows = np.arange(ids.shape[0])[:, None]
    lengths = np.bincount((rows * width + ids).ravel(), minlength=ids.shape[0] * width)
    lengths = lengths.reshape(ids.shape[0], width)[:, 1:].astype(np.int64)
    return int(np.sum(lengths * (lengths + 1) // 2))


def attention_flops(config: ModelConfig, pairs: int | float) -> float:
    """Forward + backward attention FLOPs over ``pairs`` causal query-key pairs (module doc)."""
    return 12.0 * config.num_layers * config.num_heads * config.head_dim * pairs


def model_flops(config: ModelConfig, segment_ids: np.ndarray) -> float:
    """Forward + backward model FLOPs of a batch of ``segment_ids`` ``[B, T]`` (module doc):
    the matmuls over its B T tokens and attention within its documents."""
    tokens = np.asarray(segment_ids).size
    return (6.0 * active_parameters_per_token(config) * tokens
            + attention_flops(config, causal_pairs(segment_ids)))


def model_flops_per_token(config: ModelConfig, seq_len: int) -> float:
    """Forward + backward FLOPs per token of one document filling a sequence of ``seq_len``
    (full causal: T (T + 1) / 2 pairs per sequence; synthetic data). Packed documents compute
    fewer pairs: ``model_flops`` of the batch."""
    pairs = seq_len * (seq_len + 1) / 2
    return 6.0 * active_parameters_per_token(config) + attention_flops(config, pairs) / seq_len
