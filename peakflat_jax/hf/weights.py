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

gpt-oss adds biases and sinks, and stores each layer's experts as one tensor each, input-major
(``x @ W`` as ours) with the gate and up projections interleaved along the last axis (gate
columns 0, 2, 4, ..., up columns 1, 3, 5, ...: transformers' ``gate_up[..., ::2]`` and
``[..., 1::2]``):

    model.layers.{i}.self_attn.{q,k,v,o}_proj.bias   bq [Hq, D], bk / bv [Hkv, D], bo [H]
    model.layers.{i}.self_attn.sinks [Hq]            sinks
    model.layers.{i}.mlp.router.weight [E, H], .bias [E]   router, router_logit_bias
    model.layers.{i}.mlp.experts.gate_up_proj [E, H, 2F]   w_gate, w_up (interleaved)
    model.layers.{i}.mlp.experts.gate_up_proj_bias [E, 2F] b_gate, b_up (interleaved)
    model.layers.{i}.mlp.experts.down_proj [E, F, H], down_proj_bias [E, H]   w_down, b_down
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
    ``to_ours`` and ``to_hf`` convert one such tensor between the layouts.

    ``experts_in_tensor``: the tensor holds every expert along its first axis (gpt-oss), where
    ``{expert}`` names one tensor per expert (Mixtral, Qwen3). ``interleave`` (index, count):
    the tensor holds ``count`` of our weights interleaved along its last axis, this one at
    ``index::count``; ``to_ours`` takes the whole tensor (its slice included), ``to_hf`` gives
    this weight's columns, which the exporter interleaves with its siblings'."""

    path: Path
    name: str
    hf_shape: tuple[int, ...]
    to_ours: Callable[[np.ndarray], np.ndarray]
    to_hf: Callable[[np.ndarray], np.ndarray]
    experts_in_tensor: bool = False
    interleave: tuple[int, int] | None = None

    @property
    def stacked(self) -> bool:
        return "{layer}" in self.name

    @property
    def per_expert(self) -> bool:
        return "{expert}" in self.name

    @property
    def has_expert_axis(self) -> bool:
        """Whether our weight has an expert axis (after the layer axis)."""
        return self.per_expert or self.experts_in_tensor


def _identity(x: np.ndarray) -> np.ndarray:
    return x


def _linear(path: Path, name: str, out_in: tuple[int, int], ours: tuple[int, ...]) -> Rule:
    """A torch Linear weight [out, in] that is ours transposed, then reshaped to ``ours``
    (the output axis split into heads for wq, the input axis for wo)."""
    return Rule(path, name, out_in, lambda w: w.T.reshape(ours),
                lambda w: w.reshape(out_in[1], out_in[0]).T)


def _interleaved(path: Path, name: str, hf_shape: tuple[int, ...], index: int) -> Rule:
    """One of the two weights a gpt-oss tensor interleaves along its last axis, at
    ``index::2``; both layouts are input-major (the experts' [E, H, 2F], the biases' [E, 2F])."""
    return Rule(path, name, hf_shape, lambda w: w[..., index::2], _identity,
                experts_in_tensor=True, interleave=(index, 2))


def _gpt_oss_rules(config: ModelConfig, layer: str) -> list[Rule]:
    """The MoE layers' tensors that gpt-oss names and lays out its own way (module doc)."""
    h, hq, hkv, d = config.hidden, config.num_heads, config.num_kv_heads, config.head_dim
    e, f = config.num_experts, config.expert_ffn
    attention, moe = ("moe_layers", "attention"), ("moe_layers", "moe")  # no dense layers
    experts = f"{layer}.mlp.experts"
    out = []
    if config.attention_bias:
        out += [Rule((*attention, f"b{x}"), f"{layer}.self_attn.{x}_proj.bias", (heads * d,),
                     lambda b, heads=heads: b.reshape(heads, d), lambda b: b.reshape(-1))
                for x, heads in (("q", hq), ("k", hkv), ("v", hkv))]
        out.append(Rule((*attention, "bo"), f"{layer}.self_attn.o_proj.bias", (h,), _identity,
                        _identity))
    if config.attention_sinks:
        out.append(Rule((*attention, "sinks"), f"{layer}.self_attn.sinks", (hq,), _identity,
                        _identity))
    out += [
        _linear((*moe, "router"), f"{layer}.mlp.router.weight", (e, h), (h, e)),
        _interleaved((*moe, "w_gate"), f"{experts}.gate_up_proj", (e, h, 2 * f), 0),
        _interleaved((*moe, "w_up"), f"{experts}.gate_up_proj", (e, h, 2 * f), 1),
        Rule((*moe, "w_down"), f"{experts}.down_proj", (e, f, h), _identity, _identity,
             experts_in_tensor=True),
    ]
    if config.router_logit_bias:
        out.append(Rule((*moe, "router_logit_bias"), f"{layer}.mlp.router.bias", (e,),
                        _identity, _identity))
    if config.expert_bias:
        out += [_interleaved((*moe, "b_gate"), f"{experts}.gate_up_proj_bias", (e, 2 * f), 0),
                _interleaved((*moe, "b_up"), f"{experts}.gate_up_proj_bias", (e, 2 * f), 1),
                Rule((*moe, "b_down"), f"{experts}.down_proj_bias", (e, h), _identity,
                     _identity, experts_in_tensor=True)]
    return out


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
        if family == "gpt_oss":
            out += _gpt_oss_rules(config, layer)
            continue
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
