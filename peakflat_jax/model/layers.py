"""The decoder's layers (flax.nnx): RMSNorm, RoPE, grouped-query attention, SwiGLU FFN, the
top-k router and the MoE FFN.

Every layer computes on global arrays of a jitted program: activations [B, T, H] split over the
mesh's (data, seq) axes, dense weights stored sharded over every device (FSDP) and gathered to
a full copy where a layer uses them (``gathered``: one layer's weights at a time, since SCO
runs the layers one after another). The heavy parts call the library's global-array
operators: ``ulysses_attention`` and ``pipelined_moe_global`` (standard EP and LLEP are the same
operator in one chunk). Why the gather is explicit: with the weights constrained to be
replicated at their use, GSPMD all-gathers the weights (small) instead of the activations
(large at long context), and the backward reduce-scatters their gradients.

Legend: B sequences, T tokens per sequence, H hidden, Hq / Hkv query / kv heads, D head width,
E experts, k top-k, F FFN width.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from peakflat_jax import mesh as mop
from peakflat_jax.config import ModelConfig, OperatorsConfig
from peakflat_jax.model.attention import ulysses_attention
from peakflat_jax.ops.global_forms import pipelined_moe_global


class RouterBias(nnx.Variable):
    """The auxiliary-loss-free balancing bias (DeepSeek-V3): it shifts the scores of the top-k
    choice only, gets no gradient, and is moved after each step by ``update_router_bias``."""


@dataclasses.dataclass(frozen=True)
class Runtime:
    """What a forward pass needs besides the weights and the batch: the mesh and the operators'
    settings (static: part of the compiled program)."""

    mesh: Mesh
    operators: OperatorsConfig
    attention: str  # "cudnn" | "xla", resolved
    max_segments: int
    token_budget: int | None


def gathered(mesh: Mesh, weight: jax.Array) -> jax.Array:
    """A full copy of an FSDP-sharded weight where a layer uses it (an all-gather)."""
    return jax.lax.with_sharding_constraint(weight, NamedSharding(mesh, P()))


def on_tokens(mesh: Mesh, x: jax.Array) -> jax.Array:
    """``x [B, T, ...]`` constrained to the token split (B over data, T over seq)."""
    return jax.lax.with_sharding_constraint(x, mop.token_sharding(mesh, x.ndim))


def _normal(rngs: nnx.Rngs, shape, std: float, dtype) -> nnx.Param:
    return nnx.Param((jax.random.normal(rngs.params(), shape, jnp.float32) * std).astype(dtype))


class RMSNorm(nnx.Module):
    """``x / rms(x) * scale``, computed in fp32."""

    def __init__(self, width: int, eps: float, dtype):
        self.scale = nnx.Param(jnp.ones((width,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (normed * self.scale[...].astype(jnp.float32)).astype(x.dtype)


def rope_frequencies(config: ModelConfig) -> jax.Array:
    """[D / 2] inverse frequencies, with the long-context scaling of the config."""
    dim = config.head_dim
    theta = config.rope_theta
    if config.rope_scaling == "ntk":
        theta = theta * config.rope_scaling_factor ** (dim / (dim - 2))
    inverse = 1.0 / theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)
    if config.rope_scaling == "linear":
        inverse = inverse / config.rope_scaling_factor
    if config.rope_scaling == "yarn":
        inverse = _yarn_frequencies(config)
    return inverse


def _yarn_frequencies(config: ModelConfig) -> jax.Array:
    """YaRN's blend of the frequencies kept (extrapolated) and divided by the factor
    (interpolated): the dimensions that turn more than ``rope_beta_fast`` times over the
    original context keep theirs, those turning fewer than ``rope_beta_slow`` times are
    interpolated, a linear ramp between (transformers' ``_compute_yarn_parameters``, step for
    step)."""
    dim, base = config.head_dim, config.rope_theta

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(config.rope_original_context / (rotations * 2 * math.pi))
                / (2 * math.log(base)))

    low, high = correction_dim(config.rope_beta_fast), correction_dim(config.rope_beta_slow)
    if config.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    base_powers = base ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)
    interpolated = 1.0 / (config.rope_scaling_factor * base_powers)
    return interpolated * (1 - extrapolation) + (1.0 / base_powers) * extrapolation


def rope_attention_factor(config: ModelConfig) -> float:
    """The factor YaRN scales cos and sin by (so q . k by its square): 0.1 ln(factor) + 1;
    1 for the other scalings."""
    factor = config.rope_scaling_factor
    if config.rope_scaling != "yarn" or factor <= 1:
        return 1.0
    return 0.1 * math.log(factor) + 1.0


def apply_rope(x: jax.Array, positions: jax.Array, inverse_frequencies: jax.Array,
               attention_factor: float = 1.0) -> jax.Array:
    """Rotates the two halves of each head of ``x [B, T, heads, D]`` by ``positions [B, T]``
    (the rotate-half convention of Llama, gpt-oss, Mixtral and Qwen3: element i pairs with
    i + D/2 at frequency i, as transformers' ``rotate_half`` with cos/sin of the frequencies
    concatenated twice), cos and sin scaled by ``attention_factor`` (YaRN's)."""
    angles = positions.astype(jnp.float32)[..., None] * inverse_frequencies  # [B, T, D/2]
    cos, sin = jnp.cos(angles)[:, :, None], jnp.sin(angles)[:, :, None]
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    first, second = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], -1)
    return rotated.astype(x.dtype)


class Attention(nnx.Module):
    """Grouped-query causal self-attention with RoPE, within documents."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        h, hq, hkv, d = config.hidden, config.num_heads, config.num_kv_heads, config.head_dim
        dtype, std = jnp.dtype(config.dtype), config.init_std
        self.wq = _normal(rngs, (h, hq, d), std, dtype)
        self.wk = _normal(rngs, (h, hkv, d), std, dtype)
        self.wv = _normal(rngs, (h, hkv, d), std, dtype)
        self.wo = _normal(rngs, (hq, d, h), std / math.sqrt(2 * config.num_layers), dtype)
        # Qwen3's per-head norms (``model.qk_norm``); they draw no random numbers, so the
        # other weights' initialisation is the same with or without them.
        self.q_norm = RMSNorm(d, config.norm_eps, dtype) if config.qk_norm else None
        self.k_norm = RMSNorm(d, config.norm_eps, dtype) if config.qk_norm else None
        # gpt-oss's biases and sinks (``model.attention_bias``, ``model.attention_sinks``):
        # zeros, which draw no random numbers either.
        biased = config.attention_bias
        self.bq = nnx.Param(jnp.zeros((hq, d), dtype)) if biased else None
        self.bk = nnx.Param(jnp.zeros((hkv, d), dtype)) if biased else None
        self.bv = nnx.Param(jnp.zeros((hkv, d), dtype)) if biased else None
        self.bo = nnx.Param(jnp.zeros((h,), dtype)) if biased else None
        self.sinks = nnx.Param(jnp.zeros((hq,), dtype)) if config.attention_sinks else None
        self.config = config

    def __call__(self, x, positions, segment_ids, run: Runtime, window=None):
        """``window``: this layer's sliding window (an int32 scalar, 0: none) or None."""
        mesh = run.mesh

        def project(weight, bias):
            out = jnp.einsum("bth,hnd->btnd", x, gathered(mesh, weight[...]))
            return on_tokens(mesh, out if bias is None else out + gathered(mesh, bias[...]))

        q, k, v = project(self.wq, self.bq), project(self.wk, self.bk), project(self.wv, self.bv)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        inverse_frequencies = rope_frequencies(self.config)
        factor = rope_attention_factor(self.config)
        q = apply_rope(q, positions, inverse_frequencies, factor)
        k = apply_rope(k, positions, inverse_frequencies, factor)
        sinks = None if self.sinks is None else gathered(mesh, self.sinks[...])
        out = ulysses_attention(q, k, v, segment_ids if run.max_segments > 1 else None,
                                mesh=mesh, data_axis=mop.DATA, seq_axis=mop.SEQ,
                                implementation=run.attention, max_segments=run.max_segments,
                                sinks=sinks, window=window)
        out = jnp.einsum("btnd,ndh->bth", out, gathered(mesh, self.wo[...]))
        return on_tokens(mesh, out if self.bo is None else out + gathered(mesh, self.bo[...]))


class FFN(nnx.Module):
    """A dense SwiGLU FFN: ``(silu(x W_gate) * (x W_up)) W_down`` (the dense layers' and the MoE's
    shared expert)."""

    def __init__(self, hidden: int, width: int, config: ModelConfig, rngs: nnx.Rngs):
        dtype, std = jnp.dtype(config.dtype), config.init_std
        self.w_gate = _normal(rngs, (hidden, width), std, dtype)
        self.w_up = _normal(rngs, (hidden, width), std, dtype)
        self.w_down = _normal(rngs, (width, hidden), std / math.sqrt(2 * config.num_layers),
                              dtype)

    def __call__(self, x, run: Runtime):
        mesh = run.mesh

        def swiglu(x, w_gate, w_up, w_down):
            gate = jnp.einsum("bth,hf->btf", x, gathered(mesh, w_gate))
            up = jnp.einsum("bth,hf->btf", x, gathered(mesh, w_up))
            return on_tokens(mesh, jnp.einsum("btf,fh->bth", jax.nn.silu(gate) * up,
                                              gathered(mesh, w_down)))

        return swiglu(x, self.w_gate[...], self.w_up[...], self.w_down[...])


def route(scores_logits: jax.Array, bias: jax.Array, config: ModelConfig):
    """Top-k expert ids [.., k] and their gate weights (fp32) from router logits [.., E].

    softmax scores: the top-k of softmax(logits) renormalized over the k (gpt-oss); sigmoid
    scores: the top-k of sigmoid(logits) normalized over the k (DeepSeek-V3); either left
    unnormalized without ``router_renormalize`` (Qwen3-MoE's norm_topk_prob false). The
    balancing bias shifts the choice, not the gates. Both are scaled by ``routed_scale``.
    """
    logits = scores_logits.astype(jnp.float32)
    scores = jax.nn.softmax(logits, axis=-1) if config.router_score == "softmax" else (
        jax.nn.sigmoid(logits))
    _, expert_ids = jax.lax.top_k(scores + bias.astype(jnp.float32), config.top_k)
    gates = jnp.take_along_axis(scores, expert_ids, axis=-1)
    if config.router_renormalize:
        gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
    return expert_ids.astype(jnp.int32), gates * config.routed_scale


class MoE(nnx.Module):
    """Top-k routed SwiGLU experts (expert-parallel over the whole mesh) and an optional shared
    expert."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        h, e, f = config.hidden, config.num_experts, config.expert_ffn
        dtype, std = jnp.dtype(config.dtype), config.init_std
        self.config = config
        # The router reads the normalized stream (RMS 1): logits of std init_std sqrt(H), near
        # a fan-in init's 1 at the presets' widths and smaller (routing nearer uniform, the
        # balanced start a router wants) at small H.
        self.router = _normal(rngs, (h, e), std, dtype)
        self.router_bias = RouterBias(jnp.zeros((e,), jnp.float32))
        self.w_gate = _normal(rngs, (e, h, f), std, dtype)
        self.w_up = _normal(rngs, (e, h, f), std, dtype)
        self.w_down = _normal(rngs, (e, f, h), std / math.sqrt(2 * config.num_layers), dtype)
        # gpt-oss's router logit bias and expert biases: zeros (no random numbers drawn).
        self.router_logit_bias = (nnx.Param(jnp.zeros((e,), dtype))
                                  if config.router_logit_bias else None)
        self.b_gate = nnx.Param(jnp.zeros((e, f), dtype)) if config.expert_bias else None
        self.b_up = nnx.Param(jnp.zeros((e, f), dtype)) if config.expert_bias else None
        self.b_down = nnx.Param(jnp.zeros((e, h), dtype)) if config.expert_bias else None
        self.shared = (FFN(h, config.shared_expert_ffn, config, rngs)
                       if config.shared_expert_ffn else None)

    def __call__(self, x, run: Runtime):
        """[B, T, H] output and the per-expert token-slot counts [E] int32 of this step."""
        config, mesh = self.config, run.mesh
        batch, length, hidden = x.shape
        logits = jnp.einsum("bth,he->bte", x, gathered(mesh, self.router[...]),
                            preferred_element_type=jnp.float32)
        if self.router_logit_bias is not None:
            logits = logits + gathered(mesh, self.router_logit_bias[...]).astype(jnp.float32)
        expert_ids, gates = route(logits, self.router_bias[...], config)
        counts = jnp.zeros((config.num_experts,), jnp.int32).at[expert_ids.reshape(-1)].add(1)
        biases = None if self.b_gate is None else (self.b_gate[...], self.b_up[...],
                                                   self.b_down[...])
        y = pipelined_moe_global(
            x.reshape(-1, hidden), expert_ids.reshape(-1, config.top_k),
            gates.reshape(-1, config.top_k), self.w_gate[...], self.w_up[...],
            self.w_down[...], mesh=mesh, axis_name=mop.ALL, num_experts=config.num_experts,
            expert_biases=biases, **expert_ffn_options(config), **moe_options(run))
        y = on_tokens(mesh, y.reshape(batch, length, hidden))
        if self.shared is not None:
            y = y + self.shared(x, run)
        return y, counts


def expert_ffn_options(config: ModelConfig) -> dict[str, Any]:
    """pipelined_moe's keywords for the experts' gated unit (none for plain SwiGLU, so that the
    call is the one it always was)."""
    if config.expert_activation == "swiglu":
        return {}
    return dict(activation=config.expert_activation, swiglu_alpha=config.swiglu_alpha,
                swiglu_limit=config.swiglu_limit)


def moe_options(run: Runtime) -> dict[str, Any]:
    """pipelined_moe's keywords for the configured dispatch."""
    ops = run.operators
    llep = dict(llep_threshold=ops.llep.threshold, llep_capacity=ops.llep.capacity,
                llep_min_tokens=ops.llep.min_tokens)
    if ops.llep.max_foreign_experts is not None:
        llep["max_foreign_experts"] = ops.llep.max_foreign_experts
    if ops.moe_dispatch == "ep":
        return dict(balance="none")
    if ops.moe_dispatch == "llep":
        return dict(balance="llep", **llep)
    return dict(balance="llep", token_budget=run.token_budget, max_chunks=ops.max_chunks,
                membership=ops.membership, **llep)


class DecoderLayer(nnx.Module):
    """Pre-norm residual layer: attention, then a dense FFN or the MoE."""

    def __init__(self, config: ModelConfig, *, moe: bool, rngs: nnx.Rngs):
        dtype = jnp.dtype(config.dtype)
        self.attention_norm = RMSNorm(config.hidden, config.norm_eps, dtype)
        self.attention = Attention(config, rngs)
        self.ffn_norm = RMSNorm(config.hidden, config.norm_eps, dtype)
        self.moe = MoE(config, rngs) if moe else None
        self.ffn = None if moe else FFN(config.hidden, config.dense_ffn, config, rngs)

    def __call__(self, h, positions, segment_ids, run: Runtime, window=None):
        """(new h, the MoE's counts [E] or None). ``window``: the layer's sliding window (an
        int32 scalar, 0: none), or None where no layer of the model slides."""
        h = h + self.attention(self.attention_norm(h), positions, segment_ids, run, window)
        if self.moe is None:
            return h + self.ffn(self.ffn_norm(h), run), None
        y, counts = self.moe(self.ffn_norm(h), run)
        return h + y, counts
