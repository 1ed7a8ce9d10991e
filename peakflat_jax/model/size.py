"""The decoder's size in closed form: parameters by part, and the model's FLOPs per token.

Both are pure functions of the config, shared by the planner (bytes of every weight shard) and
the trainer (model TFLOP/s and MFU). Model FLOPs count the matmuls of forward and backward
(6 per weight per token) and causal attention (QK^T and PV over the causal half), not the
recomputation: the figure a stack without remat would need, so that stacks compare fairly.
"""

from __future__ import annotations

import dataclasses

from peakflat_jax.config import ModelConfig


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
        attention_per_layer=h * d * (2 * hq + 2 * hkv),
        dense_ffn_per_layer=3 * h * config.dense_ffn,
        router_per_layer=h * config.num_experts,
        experts_per_layer=3 * config.num_experts * h * config.expert_ffn,
        shared_expert_per_layer=3 * h * config.shared_expert_ffn,
        norms=h * (2 * config.num_layers + 1),
        num_dense_layers=config.num_dense_layers, num_moe_layers=num_moe)


def active_parameters_per_token(config: ModelConfig) -> int:
    """Weights one token's forward multiplies by (its k experts, not all E; the true vocab)."""
    counts = parameter_counts(config, config.vocab_size)
    per_moe_layer = (counts.router_per_layer + counts.shared_expert_per_layer
                     + 3 * config.top_k * config.hidden * config.expert_ffn)
    return (config.num_layers * counts.attention_per_layer
            + counts.num_dense_layers * counts.dense_ffn_per_layer
            + counts.num_moe_layers * per_moe_layer + config.hidden * config.vocab_size)


def model_flops_per_token(config: ModelConfig, seq_len: int) -> float:
    """Forward + backward FLOPs per token at context ``seq_len``: 6 per active weight, and
    causal attention's 6 T Hq D per layer (QK^T and PV, 2 FLOPs each, over half the T x T
    scores, times 3 for forward + backward)."""
    attention = 6 * config.num_layers * seq_len * config.num_heads * config.head_dim
    return 6.0 * active_parameters_per_token(config) + attention
