"""A Hugging Face config.json and our ModelConfig, both ways, for the Mixtral, Qwen3-MoE and
gpt-oss families.

``model_config_from_hf`` reads the architecture (widths, heads, experts, RoPE, norms, tying) into
ModelConfig's fields and refuses, with one line naming the HF field, whatever the decoder cannot
compute as transformers does (a RoPE scaling other than linear or YaRN, Mixtral's and Qwen3's
attention biases and sliding windows, a non-SwiGLU activation, dense layers anywhere but first,
a gpt-oss layer pattern other than all full, all sliding or alternating from a sliding first,
quantized tensors). A Mixtral window at least as long as the run's sequences (``data.seq_len``)
changes nothing there and is accepted. Fields that only shape training in transformers
(dropout, router jitter, the auxiliary loss's coefficient, cache flags) are ignored: a
fine-tune here has none of them.
``hf_config_from_model`` writes the config.json of a family back, over the checkpoint's own when
there is one (keeping its token ids, context length and the like).

The families, in transformers' code (5.x): all are pre-norm decoders with RMSNorm, GQA
attention with rotate-half RoPE and gated experts routed by the top-k of a softmax over all
experts; Mixtral renormalizes the k gates, Qwen3-MoE does when ``norm_topk_prob``, adds an
RMSNorm on each query and key head, and may make some layers dense (``mlp_only_layers``,
``decoder_sparse_step``). gpt-oss softmaxes the top-k router logits (the renormalized gates of
the full softmax, the same function), with a bias on the logits; it has biases on the attention
projections (``attention_bias``) and the experts, attention sinks, sliding-window layers
(``layer_types``, ``sliding_window``), YaRN RoPE and a clamped SwiGLU (``swiglu_alpha``,
``swiglu_limit``).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

from peakflat_jax import config as config_module
from peakflat_jax.config import Config, ConfigError, ModelConfig

FAMILIES = ("mixtral", "qwen3_moe", "gpt_oss")
"""The ``model_type`` values that can be imported and exported."""

ARCHITECTURE_FIELDS = (
    "vocab_size", "hidden", "num_layers", "num_dense_layers", "dense_ffn", "num_heads",
    "num_kv_heads", "head_dim", "rope_theta", "rope_scaling", "rope_scaling_factor",
    "num_experts", "top_k", "expert_ffn", "shared_expert_ffn", "router_score",
    "router_renormalize", "routed_scale", "tie_embeddings", "norm_eps", "qk_norm",
    "rope_original_context", "rope_beta_fast", "rope_beta_slow", "rope_truncate",
    "attention_bias", "attention_sinks", "sliding_window", "sliding_window_layers",
    "router_logit_bias", "expert_bias", "expert_activation", "swiglu_alpha", "swiglu_limit",
)
"""The ModelConfig fields a checkpoint's config.json decides."""


def read_hf_config(directory: str | pathlib.Path) -> dict[str, Any]:
    """The parsed config.json of a checkpoint directory."""
    path = pathlib.Path(directory) / "config.json"
    if not path.is_file():
        raise ConfigError(f"model.from_pretrained: no config.json in {str(directory)!r}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ConfigError(f"model.from_pretrained: {path} is not valid JSON: {error}") from None


def _refuse(field: str, value: Any, why: str) -> ConfigError:
    return ConfigError(f"config.json {field}: {value!r} is not supported ({why})")


def _rope(hf: dict) -> dict[str, Any]:
    """Our RoPE fields from ``rope_parameters`` (transformers 5) or the older ``rope_theta`` +
    ``rope_scaling``: default, linear, or YaRN (its attention factor the one transformers
    derives from the factor: an explicit one, or DeepSeek's mscale pair, is refused)."""
    params = hf.get("rope_parameters")
    field = "rope_parameters"
    if params is None:
        params = {"rope_theta": hf.get("rope_theta", 10000.0), **(hf.get("rope_scaling") or {})}
        field = "rope_scaling"
    kind = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    defaults = ModelConfig()
    out = dict(rope_theta=theta, rope_scaling="none", rope_scaling_factor=1.0,
               rope_original_context=defaults.rope_original_context,
               rope_beta_fast=defaults.rope_beta_fast, rope_beta_slow=defaults.rope_beta_slow,
               rope_truncate=defaults.rope_truncate)
    if kind == "default":
        return out
    if kind == "linear":
        return {**out, "rope_scaling": "linear", "rope_scaling_factor": float(params["factor"])}
    if kind != "yarn":
        raise _refuse(f"{field}.rope_type", kind, "the model's RoPE takes default, linear or "
                      "yarn")
    for name in ("attention_factor", "mscale", "mscale_all_dim"):
        if params.get(name) is not None:
            raise _refuse(f"{field}.{name}", params[name], "YaRN's attention factor is "
                          "derived from its factor here")
    if params.get("factor") is None:
        raise _refuse(f"{field}.factor", None, "YaRN needs its factor")
    return {**out, "rope_scaling": "yarn", "rope_scaling_factor": float(params["factor"]),
            "rope_original_context": int(params["original_max_position_embeddings"]),
            "rope_beta_fast": float(params.get("beta_fast") or 32),
            "rope_beta_slow": float(params.get("beta_slow") or 1),
            "rope_truncate": bool(params.get("truncate", True))}


def _gpt_oss_fields(hf: dict, num_layers: int) -> dict[str, Any]:
    """gpt-oss's fields (module doc); its layer pattern refused naming ``layer_types`` unless
    all full, all sliding, or alternating from a sliding layer 0 (transformers' default)."""
    types = hf.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention"
                                      for i in range(num_layers)]
    alternating = ["sliding_attention" if i % 2 == 0 else "full_attention"
                   for i in range(num_layers)]
    window, layers = int(hf.get("sliding_window") or 0), "all"
    if all(t == "full_attention" for t in types):
        window = 0
    else:
        if types == alternating and num_layers > 1:
            layers = "even"
        elif not all(t == "sliding_attention" for t in types):
            raise _refuse("layer_types", types, "sliding layers are all, none, or the even "
                          "ones")
        if window < 1:
            raise _refuse("sliding_window", hf.get("sliding_window"), "sliding layers need a "
                          "window")
    return dict(attention_bias=bool(hf.get("attention_bias", True)), attention_sinks=True,
                sliding_window=window, sliding_window_layers=layers, router_logit_bias=True,
                expert_bias=True, expert_activation="clamped_swiglu",
                swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
                swiglu_limit=float(hf.get("swiglu_limit", 7.0)))


def _num_dense_layers(hf: dict, num_layers: int) -> int:
    """Qwen3-MoE's dense layers, which the decoder must have first and contiguous; a refusal
    names the field that places one elsewhere (``decoder_sparse_step`` where its own dense
    layers are not the first ones, else ``mlp_only_layers``)."""
    only = sorted(hf.get("mlp_only_layers") or [])
    step = int(hf.get("decoder_sparse_step", 1) or 1)
    dense = [i for i in range(num_layers) if i in only or (i + 1) % step]
    if dense != list(range(len(dense))):
        by_step = [i for i in range(num_layers) if (i + 1) % step]
        if by_step != list(range(len(by_step))):
            raise _refuse("decoder_sparse_step", step, f"dense layers {by_step} (each layer i "
                          f"with (i + 1) % {step} != 0): the model's dense layers are the first "
                          f"ones")
        raise _refuse("mlp_only_layers", only, f"dense layers {dense} with decoder_sparse_step "
                      f"{step}: the model's dense layers are the first ones")
    return len(dense)


def model_config_from_hf(hf: dict, base: ModelConfig | None = None, *,
                         context: int | None = None) -> ModelConfig:
    """``base`` (default: ModelConfig()) with its architecture fields set from a parsed
    config.json (module doc); ConfigError naming the config.json field the model cannot
    follow. ``context``: the longest sequence the model will see (``data.seq_len``), against
    which a Mixtral window is checked (None: not checked here)."""
    base = ModelConfig() if base is None else base
    family = hf.get("model_type")
    if family not in FAMILIES:
        raise _refuse("model_type", family, f"expected one of {list(FAMILIES)}")
    if hf.get("hidden_act", "silu") != "silu":
        raise _refuse("hidden_act", hf["hidden_act"], "the FFNs are SwiGLU (silu)")
    if hf.get("quantization_config") is not None:
        method = (hf["quantization_config"] or {}).get("quant_method")
        if not (family == "gpt_oss" and method == "mxfp4"):  # gpt-oss's own: dequantized
            raise _refuse("quantization_config.quant_method", method, "of quantizations, "
                          "gpt-oss's MXFP4 experts are read; dequantize others first")
    if family != "gpt_oss" and hf.get("attention_bias"):
        raise _refuse("attention_bias", True, f"{family} has no attention biases here")
    window = hf.get("sliding_window")
    if window is not None and family == "mixtral" and context is not None and window < context:
        raise _refuse("sliding_window", window, f"a Mixtral window shorter than the context "
                      f"(data.seq_len = {context}) is not mapped; one at least as long changes "
                      f"nothing and is accepted")
    if window is not None and family != "mixtral" and hf.get("use_sliding_window"):
        raise _refuse("sliding_window", window, f"{family}'s sliding windows are not mapped "
                      f"(gpt-oss's are)")
    heads = int(hf["num_attention_heads"])
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    num_layers = int(hf["num_hidden_layers"])
    defaults = ModelConfig()
    extra = {name: getattr(defaults, name) for name in (
        "attention_bias", "attention_sinks", "sliding_window", "sliding_window_layers",
        "router_logit_bias", "expert_bias", "expert_activation", "swiglu_alpha",
        "swiglu_limit")}
    if family == "gpt_oss":
        experts = hf["num_local_experts"]
        expert_ffn, dense, dense_ffn = hf["intermediate_size"], 0, base.dense_ffn
        renormalize, qk_norm = True, False
        extra = _gpt_oss_fields(hf, num_layers)
    elif family == "mixtral":
        experts = hf.get("num_local_experts", hf.get("num_experts"))
        expert_ffn, dense, dense_ffn = hf["intermediate_size"], 0, base.dense_ffn
        renormalize, qk_norm = True, False
    else:
        experts = hf.get("num_experts", hf.get("num_local_experts"))
        expert_ffn, dense_ffn = hf["moe_intermediate_size"], hf["intermediate_size"]
        dense = _num_dense_layers(hf, num_layers)
        renormalize, qk_norm = bool(hf.get("norm_topk_prob", False)), True
    fields = dict(
        vocab_size=int(hf["vocab_size"]), hidden=int(hf["hidden_size"]), num_layers=num_layers,
        num_dense_layers=dense, dense_ffn=int(dense_ffn), num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads), head_dim=int(head_dim),
        **_rope(hf), **extra, num_experts=int(experts), top_k=int(hf["num_experts_per_tok"]),
        expert_ffn=int(expert_ffn), shared_expert_ffn=0, router_score="softmax",
        router_renormalize=renormalize, routed_scale=1.0,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)), qk_norm=qk_norm)
    return dataclasses.replace(base, **fields)


def resolve_pretrained(config: Config, explicit: set[str] | None = None) -> Config:
    """``config`` with the architecture of ``model.from_pretrained``'s config.json, and for a
    text source whose ``data.tokenizer`` is null, the checkpoint's tokenizer. A field
    set to another value than the checkpoint's is an error naming both (the checkpoint decides
    the architecture; a stray override would otherwise be dropped silently): ``explicit``, the
    model fields the YAML and overrides set (``load_config``), or where unknown, those that
    differ from their defaults. So is a router bias that moves (imported routers have none)."""
    model = config.model
    hf = read_hf_config(model.from_pretrained)
    resolved = model_config_from_hf(hf, model, context=config.data.seq_len)
    defaults = ModelConfig()
    for name in ARCHITECTURE_FIELDS:
        ours, theirs = getattr(model, name), getattr(resolved, name)
        was_set = name in explicit if explicit is not None else ours != getattr(defaults, name)
        if ours != theirs and was_set:
            raise ConfigError(f"model.{name}: {ours!r} differs from {theirs!r}, the value of "
                              f"model.from_pretrained's config.json (which sets it)")
    if model.router_bias_rate != 0:
        raise ConfigError(f"model.router_bias_rate: expected 0 with model.from_pretrained (the "
                          f"checkpoint's router has no balancing bias), got "
                          f"{model.router_bias_rate}")
    data = config.data
    if data.tokenizer is None and data.source != "synthetic":
        # Text for a pretrained model is tokenized as it was trained: the checkpoint's own.
        data = dataclasses.replace(data, tokenizer=str(model.from_pretrained))
    return dataclasses.replace(config, model=resolved, data=data)


GPT_OSS_FIELDS = (("attention_sinks", True), ("router_logit_bias", True), ("expert_bias", True),
                  ("expert_activation", "clamped_swiglu"))
"""The fields that make a model gpt-oss (each, as gpt-oss has it, the others' defaults)."""


def family_of(config: ModelConfig) -> str:
    """The family whose config.json can express ``config``: gpt-oss with any of its own fields
    (``GPT_OSS_FIELDS``: then it needs all of them), else Qwen3-MoE with q/k norms, Mixtral
    without; ConfigError naming the field the family cannot express."""
    gpt_oss = any(getattr(config, name) == value for name, value in GPT_OSS_FIELDS)
    family = "gpt_oss" if gpt_oss else "qwen3_moe" if config.qk_norm else "mixtral"
    unsupported = [("shared_expert_ffn", config.shared_expert_ffn, 0),
                   ("router_score", config.router_score, "softmax"),
                   ("routed_scale", config.routed_scale, 1.0)]
    if config.rope_scaling == "ntk":
        unsupported.append(("rope_scaling", "ntk", "none, linear or yarn"))
    if family == "gpt_oss":
        unsupported += [(name, getattr(config, name), value) for name, value in GPT_OSS_FIELDS]
        unsupported += [("num_dense_layers", config.num_dense_layers, 0),
                        ("qk_norm", config.qk_norm, False),
                        ("router_renormalize", config.router_renormalize, True)]
    else:
        defaults = ModelConfig()
        unsupported += [(name, getattr(config, name), getattr(defaults, name)) for name in (
            "attention_bias", "sliding_window")]
    if family == "mixtral":
        unsupported += [("num_dense_layers", config.num_dense_layers, 0),
                        ("router_renormalize", config.router_renormalize, True)]
    problems = [(name, value, expected) for name, value, expected in unsupported
                if value != expected]
    if problems:
        name, value, expected = problems[0]
        also = "".join(f"; also model.{n}: {v!r} (expected {e!r})" for n, v, e in problems[1:])
        hint = ("; Qwen3-MoE, with model.qk_norm: true, has dense first layers"
                if family == "mixtral" and name == "num_dense_layers" else "")
        raise ConfigError(f"model.{name}: {value!r} has no {family} equivalent (expected "
                          f"{expected!r}{hint}){also}")
    return family


ARCHITECTURES = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                 "gpt_oss": "GptOssForCausalLM"}


def _rope_parameters(config: ModelConfig) -> dict[str, Any]:
    rope: dict[str, Any] = {"rope_theta": config.rope_theta, "rope_type": "default"}
    if config.rope_scaling == "linear":
        rope = {**rope, "rope_type": "linear", "factor": config.rope_scaling_factor}
    if config.rope_scaling == "yarn":
        rope = {**rope, "rope_type": "yarn", "factor": config.rope_scaling_factor,
                "original_max_position_embeddings": config.rope_original_context,
                "beta_fast": config.rope_beta_fast, "beta_slow": config.rope_beta_slow,
                "truncate": config.rope_truncate}
    return rope


def hf_config_from_model(config: ModelConfig, base: dict | None = None) -> dict[str, Any]:
    """The config.json of ``config``'s family (``family_of``): ``base`` (the imported
    checkpoint's, when there is one) with the architecture fields replaced."""
    family = family_of(config)
    hf = dict(base or {})
    if hf.get("model_type", family) != family:
        raise ConfigError(f"model: a {family} model cannot be written over a config.json of "
                          f"model_type {hf['model_type']!r}")
    for old in ("rope_theta", "rope_scaling"):
        hf.pop(old, None)
    hf.update(
        architectures=[ARCHITECTURES[family]], model_type=family, vocab_size=config.vocab_size,
        hidden_size=config.hidden, num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads, num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim, hidden_act="silu", rms_norm_eps=config.norm_eps,
        rope_parameters=_rope_parameters(config), tie_word_embeddings=config.tie_embeddings,
        num_experts_per_tok=config.top_k, attention_bias=config.attention_bias,
        sliding_window=None, dtype=config.dtype)
    if family == "mixtral":
        # An imported window (at least the run's context: ``model_config_from_hf``) kept.
        hf.update(intermediate_size=config.expert_ffn, num_local_experts=config.num_experts,
                  sliding_window=(base or {}).get("sliding_window"))
        hf.pop("attention_bias")
    elif family == "gpt_oss":
        sliding = [config.sliding_window > 0 and (config.sliding_window_layers == "all"
                                                  or i % 2 == 0)
                   for i in range(config.num_layers)]
        hf.update(intermediate_size=config.expert_ffn, num_local_experts=config.num_experts,
                  layer_types=["sliding_attention" if s else "full_attention" for s in sliding],
                  sliding_window=config.sliding_window or hf.get("sliding_window"),
                  swiglu_alpha=config.swiglu_alpha, swiglu_limit=config.swiglu_limit)
        hf.pop("quantization_config", None)
    else:
        hf.pop("num_local_experts", None)
        hf.update(moe_intermediate_size=config.expert_ffn, num_experts=config.num_experts,
                  intermediate_size=config.dense_ffn, norm_topk_prob=config.router_renormalize,
                  mlp_only_layers=list(range(config.num_dense_layers)), decoder_sparse_step=1,
                  use_sliding_window=False)
    return hf


def load_config(path_or_name, overrides=()) -> Config:
    """``peakflat_jax.config.load_config`` with ``model.from_pretrained`` read in
    (``resolve_pretrained``): the loader of every command."""
    return config_module.load_config(path_or_name, overrides,
                                     resolve_pretrained=resolve_pretrained)
