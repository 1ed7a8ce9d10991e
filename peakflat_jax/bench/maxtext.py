"""MaxText, the peer of the end-to-end bench: the same model in MaxText's terms, the settings a
MaxText user has against each memory peak, the command of one probe, and what its log says.

A JAX user training a Mixture-of-Experts model on GPUs reaches for MaxText
(AI-Hypercomputer/maxtext; the pip package ``maxtext``). The bench runs it beside peakflat on the
same card, each probe a fresh process (``scripts/maxtext/run_maxtext.py``), and counts both
stacks' FLOPs by one formula (``model.size``: attention within documents, no recompute), so that
MFU compares the models, not the frameworks' own counters.

What cannot match: MaxText places dense FFN layers before MoE layers only in its DeepSeek block,
whose attention is MLA, so the peer runs the Mixtral block (GQA, every layer MoE) with the MoE
layers of our model (``comparable_model``: the model MaxText trains, in our terms, whose FLOPs
are its own); the router's auxiliary-loss-free bias has no Mixtral counterpart (MaxText's
balance loss is off); a shared expert has none either. ``unmatched`` says which apply.

No MaxText module is imported here: the probe runs in the peer's own process, from the wheels
the bench installs (``scripts/maxtext/setup.sh``).
"""

from __future__ import annotations

import dataclasses
import json
import re
import statistics

from peakflat_jax.config import ModelConfig
from peakflat_jax.model.size import model_flops_per_token

MAXTEXT_VERSION = "0.2.5"

SETTINGS: dict[str, dict[str, object]] = {
    # MaxText's defaults for this model: every layer rematerialized from its input, the input
    # kept on the device, AdamW's fp32 state on the device, the whole [N, V] logits.
    "default": {"remat_policy": "full", "optimizer_memory_host_offload": False,
                "weight_dtype": "float32", "num_vocab_tiling": 1},
    # Its answer to the checkpoint boundaries and the logits: each layer's input offloaded to
    # pinned host memory (the rest rematerialized), the loss over token tiles.
    "offload": {"remat_policy": "custom", "decoder_layer_input": "offload",
                "optimizer_memory_host_offload": False, "weight_dtype": "float32",
                "num_vocab_tiling": "tiles"},
    # The same with its answer to AdamW's state: kept in pinned host memory between steps.
    "offload+optimizer": {"remat_policy": "custom", "decoder_layer_input": "offload",
                          "optimizer_memory_host_offload": True, "weight_dtype": "float32",
                          "num_vocab_tiling": "tiles"},
    # bf16 weights: half the weights' and gradients' bytes, and no fp32 master copy (a
    # different training: the update rounds to bf16), reported beside, never as the like.
    "offload+bf16": {"remat_policy": "custom", "decoder_layer_input": "offload",
                     "optimizer_memory_host_offload": False, "weight_dtype": "bfloat16",
                     "num_vocab_tiling": "tiles"},
}
"""Named MaxText settings, the memory options of MaxText's own config (``base.yml``);
``num_vocab_tiling: tiles`` is sized per context (``vocab_tiles``)."""

MOE_PATHS: dict[str, tuple[dict[str, object], str]] = {
    # tokamax's grouped matmul (Mosaic GPU on Hopper): MaxText's GPU path for dropless MoE.
    "tokamax": ({"sparse_matmul": True, "megablox": False, "use_tokamax_gmm": True}, ""),
    # jax.lax.ragged_dot, which XLA:GPU rewrites as a dense matmul unless told to use cuDNN's
    # grouped GEMM for its forward and input gradient.
    "ragged_dot": ({"sparse_matmul": True, "megablox": False, "use_tokamax_gmm": False},
                   "--xla_gpu_experimental_use_ragged_dot_fusion=true"),
    # Every expert over every token, masked (capacity 1): exact, and E / k times the FLOPs.
    "dense": ({"sparse_matmul": False, "megablox": False, "use_tokamax_gmm": False,
               "capacity_factor": 1.0}, ""),
}
"""The MoE paths a MaxText user on an NVIDIA GPU can choose: their config keys and the XLA flag
each needs."""

RUN_KEYS: dict[str, object] = {
    "hardware": "gpu", "dataset_type": "synthetic", "per_device_batch_size": 1,
    "packing": False, "reuse_example_batch": 1, "enable_checkpointing": False,
    "enable_tensorboard": False, "scan_layers": True, "attention": "cudnn_flash_jax",
    "opt_type": "adamw", "learning_rate": 2e-4, "adam_b1": 0.9, "adam_b2": 0.95,
    "adam_weight_decay": 0.1, "gradient_clipping_threshold": 1.0, "log_period": 1,
}
"""What every probe sets besides the model, the setting and the MoE path: synthetic tokens, one
sequence, no checkpoint or TensorBoard writes (checkpointing is on by default and would write the
state every so often), the layers scanned (its per-layer offload needs it; its default), and
jax's cuDNN flash attention, the one kernel of MaxText's that runs long contexts on a GPU
without TransformerEngine (its Pallas flash attention materializes a [T, T] segment mask)."""

XLA_FLAGS = " ".join([
    "--xla_gpu_enable_latency_hiding_scheduler=true", "--xla_gpu_enable_triton_gemm=false",
    "--xla_gpu_enable_command_buffer=", "--xla_gpu_enable_while_loop_double_buffering=true",
    "--xla_gpu_enable_highest_priority_async_stream=true"])
"""The XLA flags of MaxText's own GPU recipes (``configs/gpu/a3/*``, its Mixtral end-to-end
scripts), less ``--xla_disable_hlo_passes=rematerialization``: at the edge of the device's memory
XLA's rematerialization is what lets a long context fit."""

ENVIRONMENT = {"DECOUPLE_GCLOUD": "TRUE", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.95",
               "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONUNBUFFERED": "1"}
"""The peer's process environment: no Google Cloud services, the device's memory as our trainer
takes it (JAX reserves 75% by default)."""

VOCAB_TILE_TOKENS = 4096
"""Tokens per tile of ``num_vocab_tiling``: a tile's fp32 logits are 4096 x V x 4 bytes (2 GiB at
V = 131,072), whatever the context."""


def comparable_model(model: ModelConfig) -> ModelConfig:
    """The model the peer trains, in our terms: every layer MoE (the Mixtral block), as many as
    ``model``'s MoE layers, no router bias, no shared expert. Its FLOPs (``model.size``) are
    the peer's."""
    return dataclasses.replace(model, num_layers=model.num_layers - model.num_dense_layers,
                               num_dense_layers=0, router_bias_rate=0.0, shared_expert_ffn=0)


def unmatched(model: ModelConfig) -> list[str]:
    """What of ``model`` the peer's Mixtral block cannot express (module doc)."""
    notes = []
    if model.num_dense_layers:
        notes.append(f"{model.num_dense_layers} dense layer(s) first: MaxText's Mixtral block is "
                     f"all-MoE, so the peer trains the {model.num_layers - model.num_dense_layers}"
                     f" MoE layers alone")
    if model.router_bias_rate:
        notes.append("the router's auxiliary-loss-free bias: none in the Mixtral block (its "
                     "balance loss is off)")
    if model.shared_expert_ffn:
        notes.append("the shared expert: none in the Mixtral block")
    unsupported = {"qk_norm": model.qk_norm, "attention_bias": model.attention_bias,
                   "attention_sinks": model.attention_sinks,
                   "sliding_window": model.sliding_window, "expert_bias": model.expert_bias,
                   "router_score sigmoid": model.router_score == "sigmoid",
                   "rope_scaling": model.rope_scaling != "none",
                   "tie_embeddings": model.tie_embeddings}
    notes += [f"{name}: not mapped" for name, on in unsupported.items() if on]
    return notes


def model_keys(model: ModelConfig) -> dict[str, object]:
    """MaxText's config keys for ``comparable_model(model)`` (the Mixtral block)."""
    peer = comparable_model(model)
    return {
        "decoder_block": "mixtral", "base_emb_dim": peer.hidden,
        "base_num_query_heads": peer.num_heads, "base_num_kv_heads": peer.num_kv_heads,
        "head_dim": peer.head_dim, "base_num_decoder_layers": peer.num_layers,
        "num_experts": peer.num_experts, "num_experts_per_tok": peer.top_k,
        # The Mixtral block's experts are mlp_dim wide (it must equal the MoE width).
        "base_mlp_dim": peer.expert_ffn, "base_moe_mlp_dim": peer.expert_ffn,
        "mlp_activations": ["silu", "linear"], "vocab_size": peer.vocab_size,
        "logits_via_embedding": peer.tie_embeddings,
        "normalization_layer_epsilon": peer.norm_eps, "rope_max_timescale": int(peer.rope_theta),
        "dtype": peer.dtype, "enable_dropout": False, "load_balance_loss_weight": 0.0,
    }


def vocab_tiles(context: int, batch: int = 1) -> int:
    """``num_vocab_tiling`` for ``context`` tokens x ``batch``: tiles of about
    ``VOCAB_TILE_TOKENS``, a divisor of the tokens (MaxText requires one)."""
    tokens = context * batch
    tiles = max(1, -(-tokens // VOCAB_TILE_TOKENS))
    while tokens % tiles:
        tiles += 1
    return tiles


def setting_keys(setting: str, context: int) -> dict[str, object]:
    """MaxText's keys for the named ``setting`` at ``context`` (``SETTINGS``)."""
    keys = dict(SETTINGS[setting])
    if keys.get("num_vocab_tiling") == "tiles":
        keys["num_vocab_tiling"] = vocab_tiles(context)
    return keys


def overrides(keys: dict[str, object]) -> list[str]:
    """``key=value`` words of MaxText's command line (its pyconfig's syntax)."""
    def word(value):
        if isinstance(value, bool):
            return "true" if value else "false"
        if isinstance(value, list):
            return json.dumps(value).replace(" ", "")
        return str(value)

    return [f"{key}={word(value)}" for key, value in keys.items()]


_STEP = re.compile(r"^(?P<t>\d+\.\d+) .*completed step: (?P<step>\d+), seconds: "
                   r"(?P<seconds>[\d.]+).*?loss: (?P<loss>[-\d.naif]+)", re.MULTILINE)
_ERROR = re.compile(r"RESOURCE_EXHAUSTED|[Oo]ut of memory|OOM|Error:|Exception:|Killed")


def parse_log(text: str) -> dict:
    """What one probe's log (``run_maxtext.py``'s output: every line stamped with the seconds of
    a monotonic clock) says: the steps completed, their losses, the step time, XLA's compiled
    estimate, the device's and host's peaks, and the last error lines.

    MaxText logs a step's line one step late, once it has read the step's loss, so when the step
    has finished: the gap between two consecutive lines is the later step's time. Its last line
    comes from the flush after the loop, whose gap is not a step's, and its first gap holds the
    first step's warm-up where more gaps are left: the step time is the median of the others
    (``step_gaps_s`` keeps them all, MaxText's own per-step ``seconds`` beside them)."""
    steps = [(int(m["step"]), float(m["t"]), m["loss"], float(m["seconds"]))
             for m in _STEP.finditer(text)]
    stamps = [t for _, t, _, _ in steps]
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    timed = gaps[:-1]
    if len(timed) > 2:
        timed = timed[1:]

    def last(pattern: str) -> float | None:
        found = re.findall(pattern, text)
        return float(found[-1]) if found else None

    errors = [line.strip()[:300] for line in text.splitlines() if _ERROR.search(line)][-3:]
    return {
        "steps_done": len(steps), "losses": [_number(loss) for _, _, loss, _ in steps],
        "step_s": statistics.median(timed) if timed else None,
        "step_gaps_s": gaps, "maxtext_seconds": [seconds for *_, seconds in steps],
        # MaxText prints XLA's plan in GiB, labelled GB (max_utils.print_compiled_memory_stats).
        "xla_estimate_bytes": _gib(last(r"Total estimated memory size: ([\d.]+) GB")),
        "peak_bytes": _gib(last(r"PEER_PEAK_BYTES_GIB=([\d.]+)")) or None,
        "limit_bytes": _gib(last(r"PEER_LIMIT_BYTES_GIB=([\d.]+)")),
        "host_peak_bytes": _gib(last(r"PEER_HOST_PEAK_GIB=([\d.]+)")),
        "parameters": _billions(last(r"number parameters: ([\d.]+) billion")),
        "errors": errors,
        "oom": any(re.search(r"RESOURCE_EXHAUSTED|[Oo]ut of memory", e) for e in errors),
    }


def flops_per_step(model: ModelConfig, context: int, batch: int = 1) -> float:
    """Model FLOPs of one step of the peer's model (``comparable_model``) over ``batch``
    sequences of one document of ``context`` tokens: our formula, for both stacks."""
    return model_flops_per_token(comparable_model(model), context) * context * batch


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def _gib(value: float | None) -> int | None:
    return None if value is None else int(value * 2**30)


def _billions(value: float | None) -> int | None:
    return None if value is None else int(value * 1e9)
