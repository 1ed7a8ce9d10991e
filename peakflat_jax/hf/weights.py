"""Where each of the decoder's weights lives in a Hugging Face checkpoint, and how it turns.

Our tree (``peakflat_jax.model``) stacks each layer stack's weights along a leading L axis and
the experts along E, stores projections input-major (``x @ W``: wq [H, Hq, D], w_gate
[E, H, F]) and pads the vocab to V' (a multiple of the device count). A checkpoint stores one
tensor per layer and per expert, output-major (torch's ``Linear.weight`` [out, in]), with the
true vocab V. A ``Rule`` names one of our weights' per-layer (per-expert) tensor in the
checkpoint and converts between the two layouts; ``rules`` lists them for a family.

The names, as transformers' ``save_pretrained`` writes them (5.x, the hub's layout):

    model.embed_tokens.weight [V, H]           embedding [V', H] (zero padding rows)
    lm_head.weight [V, H]                      head [H, V'] (absent when tied)
    model.norm.weight [H]                      final_norm.scale
    model.layers.{i}.input_layernorm.weight    attention_norm.scale
    model.layers.{i}.post_attention_layernorm  ffn_norm.scale
    model.layers.{i}.self_attn.{q,k,v}_proj    wq [H, Hq, D], wk / wv [H, Hkv, D]
    model.layers.{i}.self_attn.o_proj          wo [Hq, D, H]
    model.layers.{i}.self_attn.{q,k}_norm      q_norm / k_norm scale [D] (Qwen3)
    Mixtral: model.layers.{i}.block_sparse_moe.gate [E, H], .experts.{e}.w1 / w3 / w2
    Qwen3:   model.layers.{i}.mlp.gate [E, H], .experts.{e}.gate_proj / up_proj / down_proj;
             a dense layer's model.layers.{i}.mlp.gate_proj / up_proj / down_proj

Mixtral's w1, w3, w2 are the gate, up and down projections: ``w2(silu(w1 x) * w3 x)``.
The router's balancing bias has no tensor (imported routers have none: zeros).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from peakflat_jax.config import ModelConfig

Path = tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Rule:
    """One of our weights (``path``, without the stack and expert axes) and its checkpoint
    tensor: ``name`` with ``{layer}`` and ``{expert}`` filled in, of shape ``hf_shape``;
    ``to_ours`` and ``to_hf`` convert one such tensor between the layouts."""

    path: Path
    name: str
    hf_shape: tuple[int, ...]
    to_ours: Callable[[np.ndarray], np.ndarray]
    to_hf: Callable[[np.ndarray], np.ndarray]

    @property
    def stacked(self) -> bool:
        return "{layer}" in self.name

    @property
    def per_expert(self) -> bool:
        return "{expert}" in self.name


def _identity(x: np.ndarray) -> np.ndarray:
    return x


def _linear(path: Path, name: str, out_in: tuple[int, int], ours: tuple[int, ...]) -> Rule:
    """A torch Linear weight [out, in] that is ours transposed, then reshaped to ``ours``
    (the output axis split into heads for wq, the input axis for wo)."""
    return Rule(path, name, out_in, lambda w: w.T.reshape(ours),
                lambda w: w.reshape(out_in[1], out_in[0]).T)


def rules(config: ModelConfig, family: str) -> list[Rule]:
    """Every weight of the decoder of ``config`` (``family``'s checkpoint names; module doc),
    except the router's balancing bias."""
    h, hq, hkv, d = config.hidden, config.num_heads, config.num_kv_heads, config.head_dim
    e, f, v = config.num_experts, config.expert_ffn, config.vocab_size
    layer = "model.layers.{layer}"
    out: list[Rule] = [
        Rule(("embedding",), "model.embed_tokens.weight", (v, h), _identity, _identity),
        Rule(("final_norm", "scale"), "model.norm.weight", (h,), _identity, _identity),
    ]
    if not config.tie_embeddings:
        out.append(Rule(("head",), "lm_head.weight", (v, h), lambda w: w.T, lambda w: w.T))
    stacks = []
    if config.num_dense_layers:
        stacks.append("dense_layers")
    if config.num_layers > config.num_dense_layers:
        stacks.append("moe_layers")
    for stack in stacks:
        attention = (stack, "attention")
        out += [
            Rule((stack, "attention_norm", "scale"), f"{layer}.input_layernorm.weight", (h,),
                 _identity, _identity),
            Rule((stack, "ffn_norm", "scale"), f"{layer}.post_attention_layernorm.weight",
                 (h,), _identity, _identity),
            _linear((*attention, "wq"), f"{layer}.self_attn.q_proj.weight", (hq * d, h),
                    (h, hq, d)),
            _linear((*attention, "wk"), f"{layer}.self_attn.k_proj.weight", (hkv * d, h),
                    (h, hkv, d)),
            _linear((*attention, "wv"), f"{layer}.self_attn.v_proj.weight", (hkv * d, h),
                    (h, hkv, d)),
            _linear((*attention, "wo"), f"{layer}.self_attn.o_proj.weight", (h, hq * d),
                           (hq, d, h)),
        ]
        if config.qk_norm:
            out += [Rule((*attention, f"{x}_norm", "scale"), f"{layer}.self_attn.{x}_norm.weight",
                         (d,), _identity, _identity) for x in ("q", "k")]
        if stack == "dense_layers":
            width = config.dense_ffn
            out += [_linear((stack, "ffn", f"w_{ours}"), f"{layer}.mlp.{theirs}_proj.weight",
                            (width, h), (h, width)) for ours, theirs in (("gate", "gate"),
                                                                          ("up", "up"))]
            out.append(_linear((stack, "ffn", "w_down"), f"{layer}.mlp.down_proj.weight",
                               (h, width), (width, h)))
            continue
        moe = (stack, "moe")
        if family == "mixtral":
            block, names = "block_sparse_moe", {"w_gate": "w1", "w_up": "w3", "w_down": "w2"}
        else:
            block, names = "mlp", {"w_gate": "gate_proj", "w_up": "up_proj",
                                   "w_down": "down_proj"}
        expert = f"{layer}.{block}.experts.{{expert}}"
        out += [
            _linear((*moe, "router"), f"{layer}.{block}.gate.weight", (e, h), (h, e)),
            _linear((*moe, "w_gate"), f"{expert}.{names['w_gate']}.weight", (f, h), (h, f)),
            _linear((*moe, "w_up"), f"{expert}.{names['w_up']}.weight", (f, h), (h, f)),
            _linear((*moe, "w_down"), f"{expert}.{names['w_down']}.weight", (h, f), (f, h)),
        ]
    return out


def layer_offset(config: ModelConfig, path: Path) -> int:
    """The checkpoint's index of the first layer of ``path``'s stack."""
    return config.num_dense_layers if path[0] == "moe_layers" else 0


IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
"""Checkpoint tensors that hold no weight (buffers older transformers saved)."""
