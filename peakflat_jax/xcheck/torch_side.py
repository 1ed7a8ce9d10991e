"""The PyTorch side of ``peakflat xcheck``: recomputes every exported case with the standard
PyTorch implementation and compares, tensor by tensor.

    python peakflat_jax/xcheck/torch_side.py DIR [--device cpu|cuda] [--reference float64|none]
                                                 [--json REPORT]

A standalone file: it imports only torch, numpy and the standard library (no jax, not the
package's ``__init__``), so that it runs in a Python that has torch and not jax. DIR holds what
``peakflat xcheck export`` wrote: ``manifest.json`` and one ``<case>.npz`` per case.

What each case computes here (the standard PyTorch way):

* ``cross_entropy``: ``F.cross_entropy`` over the materialized logits ``hidden @ kernel[:, :V]``
  (computed in the inputs' dtype, then upcast to fp32 as mixed-precision code does);
* ``moe``: a loop over experts (``torch.where`` on the routing, SwiGLU per expert, scaled by the
  gate weights, ``index_add_`` into the output), as Mixtral's reference code does;
* ``checkpointed_stack``: the layers one by one under ``torch.utils.checkpoint``;
* ``adamw``: ``torch.optim.AdamW`` on fp32 master weights with a ``LambdaLR`` schedule (linear
  warm-up, cosine decay) and ``clip_grad_norm_``;
* ``model``: the decoder rebuilt from ``nn.Module``s (``nn.Embedding``, ``nn.Linear``,
  ``F.rms_norm`` in fp32, rotate-half RoPE, ``F.scaled_dot_product_attention`` with a causal
  within-document mask and grouped kv heads, the router with the balancing bias on the choice
  only, SwiGLU experts and the shared expert, the head over the true vocab, mean
  ``F.cross_entropy``), loaded from the exported weights; its gradients are mapped back to the
  exported layouts.

Comparison. For a JAX tensor a and the torch tensor b (both taken to float64), the relative
difference is ``max|a - b| / max|b|`` over the tensor (0 when both are all zero; inf when only
b is). Integer tensors (the model's expert counts) compare as the share of routed slots that
differ: ``sum|a - b| / (2 * sum b)``. Each difference is checked against ``TOLERANCES[dtype]
[kind]``; the exit status is 1 when any exceeds its tolerance (naming each tensor), 0 otherwise.

With ``--reference float64`` (the default) each case is also computed in float64 from the same
inputs, and the report shows how far each side is from it: when the two sides disagree, the
side far from float64 is the one to fix. These columns inform; they do not gate.

Tolerances (``TOLERANCES``). fp32: 1e-5 for the simple functions (cross-entropy, the
checkpointed stack, AdamW), 1e-4 for the complex ones (the MoE, the model), never loosened.
bf16: derived from bf16's unit roundoff u = 2^-8 and the roundings each side makes, as
``2 * r * u`` (r roundings per side, first order; both sides round, so the two differ by at most
twice one side's error):

* ``bf16_rounding`` (r = 1 ulp = 2u): a value both sides compute in fp32 and round to bf16 once
  (AdamW's working params): two fp32 results a few ulps apart may round to neighbouring bf16
  values, one ulp (at most 2^-7 relative) apart;
* ``bf16_simple`` (r = 4): one bf16 layer: inputs exact, the product rounded, the elementwise
  step rounded, the result rounded, the cotangent product rounded: 2 * 4 * u = 2^-5;
* ``bf16_complex`` (r = 16): a composition of such layers (the MoE: two matmuls, SwiGLU and the
  gate-weighted combine; the model: L layers of them, residual sums, attention's softmax), where
  the roundings of a few layers add along the residual stream: 2 * 16 * u = 2^-3;
* ``fp32`` work inside a bf16 run (AdamW's master weights and its schedule) keeps the fp32
  tolerance: both sides upcast the same bf16 values exactly;
* ``routing`` (expert counts): exact in fp32 (0); in bf16 a token whose k-th and (k+1)-th
  scores lie within the rounding of the router's input may choose differently, which the
  gradients already carry, so the count is reported and held to 1/32 of the slots (a slot's
  choice flips only where two scores are within ~u of each other).

Legend: N tokens, H hidden, V vocab (V' padded), E experts, k top-k, F FFN width, L layers,
B sequences, T sequence length, Hq / Hkv query / kv heads, D head width.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import pathlib
import platform
import sys
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

FORMAT = "peakflat-xcheck/1"
UNIT_ROUNDOFF_BF16 = 2.0**-8

TOLERANCES = {
    "float32": {"simple": 1e-5, "complex": 1e-4, "fp32": 1e-5, "bf16_rounding": 1e-5,
                "routing": 0.0},
    "bfloat16": {"simple": 2 * 4 * UNIT_ROUNDOFF_BF16, "complex": 2 * 16 * UNIT_ROUNDOFF_BF16,
                 "fp32": 1e-5, "bf16_rounding": 2 * UNIT_ROUNDOFF_BF16, "routing": 1 / 32},
}
"""Per run dtype, per tensor kind: the largest relative difference that passes (module doc)."""
COMPARE_BLOCK = 1 << 22
"""Elements compared at a time (``relative_difference``): 32 MiB of float64 per operand."""


# ----------------------------------------------------------------------------------------------
# Loading.


def load_case(directory: pathlib.Path, case: dict) -> dict[str, torch.Tensor]:
    """The case's arrays as torch tensors in their exported dtypes (bf16 from its bits)."""
    with np.load(directory / case["file"]) as stored:
        arrays = {}
        for entry in case["arrays"]:
            value = stored[entry["name"]]
            if entry["dtype"] == "bfloat16":
                tensor = torch.from_numpy(value.view(np.int16).copy()).view(torch.bfloat16)
            else:
                tensor = torch.from_numpy(np.ascontiguousarray(value))
            arrays[entry["name"]] = tensor
    return arrays


def as_compute(arrays: dict[str, torch.Tensor], dtype: torch.dtype | None, device: str):
    """Inputs on ``device``; floating ones cast to ``dtype`` (None: as exported)."""
    def convert(tensor):
        tensor = tensor.to(device)
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        return tensor
    return {name: convert(tensor) for name, tensor in arrays.items()}


def wide(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the math that the model keeps at fp32 or wider (norms, router, softmax)."""
    return torch.promote_types(dtype, torch.float32)


# ----------------------------------------------------------------------------------------------
# The cases, each ``fn(inputs, params) -> {exported name: tensor}``.


def cross_entropy(a: dict, p: dict) -> dict:
    hidden = a["hidden"].clone().requires_grad_()
    kernel = a["kernel"].clone().requires_grad_()
    vocab = p["vocab_size"]
    logits = (hidden @ kernel[:, :vocab]).to(wide(hidden.dtype))
    reduction = p["reduction"]
    loss = F.cross_entropy(logits, a["targets"].long(), ignore_index=p["ignore_index"],
                           reduction=reduction)
    objective = loss if reduction != "none" else (loss * a["cotangent"].to(loss.dtype)).sum()
    objective.backward()
    return {"loss": loss, "grad.hidden": hidden.grad, "grad.kernel": kernel.grad}


def swiglu(x, w_gate, w_up, w_down):
    """``(silu(x W_gate) * (x W_up)) W_down`` with weights in the exported [in, out] layout."""
    return (F.silu(x @ w_gate) * (x @ w_up)) @ w_down


def experts_loop(x, expert_ids, gates, w_gate, w_up, w_down):
    """``y[n] = sum_j gates[n, j] * ffn_{expert_ids[n, j]}(x[n])``, a loop over experts.

    The stacked weights are unbound into one view per expert first, as Mixtral's experts are
    modules of their own: indexing ``w[expert]`` in the loop would make autograd add a zero
    [E, ...] gradient per expert (E full-size passes per weight: docs/xcheck.md), where
    unbind's backward stacks the experts' gradients once."""
    y = torch.zeros_like(x)
    experts = zip(w_gate.unbind(0), w_up.unbind(0), w_down.unbind(0))
    for expert, (gate, up, down) in enumerate(experts):
        token, slot = torch.where(expert_ids == expert)
        if token.numel() == 0:
            continue
        out = swiglu(x[token], gate, up, down)
        y = y.index_add(0, token, out * gates[token, slot, None].to(out.dtype))
    return y


def moe(a: dict, p: dict) -> dict:
    names = ("x", "gates", "w_gate", "w_up", "w_down")
    leaves = {name: a[name].clone().requires_grad_() for name in names}
    y = experts_loop(leaves["x"], a["expert_ids"].long(), leaves["gates"], leaves["w_gate"],
                     leaves["w_up"], leaves["w_down"])
    (y.to(wide(y.dtype)) * a["cotangent"].to(wide(y.dtype))).sum().backward()
    return {"y": y, **{f"grad.{name}": leaf.grad for name, leaf in leaves.items()}}


def checkpointed_stack(a: dict, p: dict) -> dict:
    h0 = a["h"].clone().requires_grad_()
    w_in = a["w_in"].clone().requires_grad_()
    w_out = a["w_out"].clone().requires_grad_()

    def layer(h, aux, w_in, w_out):
        h = h + F.silu(h @ w_in) @ w_out
        return h, aux + h.to(wide(h.dtype)).square().mean()

    h, aux = h0, torch.zeros((), dtype=wide(h0.dtype), device=h0.device)
    for index in range(p["layers"]):
        h, aux = checkpoint(layer, h, aux, w_in[index], w_out[index], use_reentrant=False)
    (torch.sum(h.to(aux.dtype) * a["cotangent"].to(aux.dtype)) + aux).backward()
    return {"h_out": h, "aux_out": aux, "grad.h": h0.grad, "grad.w_in": w_in.grad,
            "grad.w_out": w_out.grad}


def learning_rate(p: dict, step: int) -> float:
    """The trainer's schedule (optax's warmup_cosine_decay_schedule from peak / (W + 1) /
    warm-up then constant)."""
    peak, warmup = p["learning_rate"], p["warmup_steps"]
    if step < warmup:
        return peak * (step + 1) / (warmup + 1)
    if p["decay"] == "constant":
        return peak
    span = p["decay_steps"] - warmup
    progress = min(step - warmup, span) / span
    alpha = p["end_value"] / peak if peak else 0.0
    return peak * ((1 - alpha) * 0.5 * (1 + math.cos(math.pi * progress)) + alpha)


def adamw(a: dict, p: dict) -> dict:
    steps, leaves = p["steps"], p["leaves"]
    working_dtype = a[f"params.{leaves[0]}"].dtype
    master_dtype = wide(working_dtype)
    master = [nn.Parameter(a[f"params.{name}"].to(master_dtype).clone()) for name in leaves]
    peak = p["learning_rate"]
    optimizer = torch.optim.AdamW(master, lr=peak, betas=(p["b1"], p["b2"]), eps=p["eps"],
                                  weight_decay=p["weight_decay"])
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: learning_rate(p, step) / peak if peak else 0.0)
    out, rates = {}, []
    for step in range(steps):
        for name, param in zip(leaves, master):
            param.grad = a[f"step{step}.grads.{name}"].to(master_dtype).clone()
        if p["max_grad_norm"] is not None:
            torch.nn.utils.clip_grad_norm_(master, p["max_grad_norm"])
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
        for name, param in zip(leaves, master):
            out[f"step{step}.master.{name}"] = param.detach().clone()
            # .to() returns the parameter itself when the dtypes agree: copy, for the
            # in-place steps that follow.
            out[f"step{step}.working.{name}"] = param.detach().to(working_dtype, copy=True)
    out["learning_rate"] = torch.tensor(rates, dtype=torch.float64)
    return out


# -- the model ---------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, scale: torch.Tensor, eps: float):
        super().__init__()
        self.weight = nn.Parameter(scale.clone())
        self.eps = eps

    def forward(self, x):
        math_dtype = wide(x.dtype)
        return F.rms_norm(x.to(math_dtype), (x.shape[-1],), self.weight.to(math_dtype),
                          self.eps).to(x.dtype)


def linear_from(weight_in_out: torch.Tensor) -> nn.Linear:
    """An ``nn.Linear`` (weight [out, in]) holding an exported [in, ..., out] weight."""
    fan_in = weight_in_out.shape[0]
    matrix = weight_in_out.reshape(fan_in, -1).T.contiguous()
    layer = nn.Linear(matrix.shape[1], matrix.shape[0], bias=False, dtype=matrix.dtype,
                      device=matrix.device)
    with torch.no_grad():
        layer.weight.copy_(matrix)
    return layer


def rope_inverse_frequencies(config: dict, device) -> torch.Tensor:
    """[D / 2] fp32 inverse frequencies with the config's long-context scaling."""
    dim, theta = config["head_dim"], config["rope_theta"]
    if config["rope_scaling"] == "ntk":
        theta = theta * config["rope_scaling_factor"] ** (dim / (dim - 2))
    inverse = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim)
    if config["rope_scaling"] == "linear":
        inverse = inverse / config["rope_scaling_factor"]
    return inverse


def rotate_half(x):
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rope(x, positions, inverse_frequencies):
    """x [B, T, heads, D] rotated by positions [B, T] (rotate-half, as Llama's)."""
    math_dtype = wide(x.dtype)
    angles = positions.to(torch.float32)[..., None] * inverse_frequencies  # [B, T, D/2]
    angles = torch.cat((angles, angles), dim=-1)[:, :, None].to(math_dtype)
    x_wide = x.to(math_dtype)
    return (x_wide * angles.cos() + rotate_half(x_wide) * angles.sin()).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, w: dict, config: dict):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (linear_from(w[n]) for n in ("wq", "wk", "wv"))
        self.o_proj = linear_from(w["wo"].reshape(-1, w["wo"].shape[-1]))
        self.num_heads, self.num_kv_heads = config["num_heads"], config["num_kv_heads"]
        self.head_dim = config["head_dim"]
        # model.qk_norm (Qwen3): an RMSNorm on every query and key head before RoPE.
        qk_norm = config.get("qk_norm", False)
        self.q_norm = RMSNorm(w["q_norm.scale"], config["norm_eps"]) if qk_norm else None
        self.k_norm = RMSNorm(w["k_norm.scale"], config["norm_eps"]) if qk_norm else None

    def forward(self, x, positions, segment_ids, inverse_frequencies):
        batch, length, _ = x.shape
        q = self.q_proj(x).view(batch, length, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(batch, length, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(batch, length, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q, positions, inverse_frequencies)
        k = apply_rope(k, positions, inverse_frequencies)
        causal = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
        same_document = segment_ids[:, :, None] == segment_ids[:, None, :]
        mask = (causal & same_document)[:, None]  # [B, 1, T, T]
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), attn_mask=mask,
                                             scale=self.head_dim ** -0.5, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))

    def exported_grads(self, prefix: str, config: dict) -> dict:
        h, d = self.q_proj.weight.shape[1], self.head_dim
        norms = {} if self.q_norm is None else {
            f"{prefix}.q_norm.scale": self.q_norm.weight.grad,
            f"{prefix}.k_norm.scale": self.k_norm.weight.grad}
        return {**norms, f"{prefix}.wq": self.q_proj.weight.grad.T.reshape(h, self.num_heads, d),
                f"{prefix}.wk": self.k_proj.weight.grad.T.reshape(h, self.num_kv_heads, d),
                f"{prefix}.wv": self.v_proj.weight.grad.T.reshape(h, self.num_kv_heads, d),
                f"{prefix}.wo": self.o_proj.weight.grad.T.reshape(self.num_heads, d, h)}


class SwiGLU(nn.Module):
    def __init__(self, w: dict):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = (
            linear_from(w[n]) for n in ("w_gate", "w_up", "w_down"))

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def exported_grads(self, prefix: str) -> dict:
        return {f"{prefix}.w_gate": self.gate_proj.weight.grad.T,
                f"{prefix}.w_up": self.up_proj.weight.grad.T,
                f"{prefix}.w_down": self.down_proj.weight.grad.T}


class MoE(nn.Module):
    """Router (scores in fp32, the bias on the choice only, top-k gates renormalized unless
    model.router_renormalize is off, scaled), routed SwiGLU experts looped over, and the
    shared expert."""

    def __init__(self, w: dict, config: dict):
        super().__init__()
        self.config = config
        self.router = linear_from(w["router"])
        self.register_buffer("router_bias", w["router_bias"].clone())
        self.w_gate, self.w_up, self.w_down = (nn.Parameter(w[n].clone())
                                               for n in ("w_gate", "w_up", "w_down"))
        shared = {n: w[f"shared.{n}"] for n in ("w_gate", "w_up", "w_down")
                  if f"shared.{n}" in w}
        self.shared = SwiGLU(shared) if shared else None

    def forward(self, x):
        config = self.config
        batch, length, hidden = x.shape
        tokens = x.reshape(-1, hidden)
        math_dtype = wide(x.dtype)
        logits = F.linear(tokens.to(math_dtype), self.router.weight.to(math_dtype))
        scores = (logits.softmax(-1) if config["router_score"] == "softmax"
                  else logits.sigmoid())
        _, expert_ids = torch.topk(scores + self.router_bias.to(math_dtype), config["top_k"],
                                   dim=-1)
        gates = scores.gather(-1, expert_ids)
        if config.get("router_renormalize", True):
            gates = gates / gates.sum(-1, keepdim=True)
        gates = gates * config["routed_scale"]
        y = experts_loop(tokens, expert_ids, gates, self.w_gate, self.w_up, self.w_down)
        y = y.view(batch, length, hidden)
        if self.shared is not None:
            y = y + self.shared(x)
        counts = torch.bincount(expert_ids.reshape(-1), minlength=config["num_experts"])
        return y, counts

    def exported_grads(self, prefix: str) -> dict:
        grads = {f"{prefix}.router": self.router.weight.grad.T,
                 f"{prefix}.w_gate": self.w_gate.grad, f"{prefix}.w_up": self.w_up.grad,
                 f"{prefix}.w_down": self.w_down.grad}
        if self.shared is not None:
            grads.update(self.shared.exported_grads(f"{prefix}.shared"))
        return grads


class DecoderLayer(nn.Module):
    def __init__(self, w: dict, config: dict):
        super().__init__()
        eps = config["norm_eps"]
        self.attention_norm = RMSNorm(w["attention_norm.scale"], eps)
        self.attention = Attention({k.split(".", 1)[1]: v for k, v in w.items()
                                    if k.startswith("attention.")}, config)
        self.ffn_norm = RMSNorm(w["ffn_norm.scale"], eps)
        is_moe = "moe.router" in w
        part = "moe." if is_moe else "ffn."
        weights = {k[len(part):]: v for k, v in w.items() if k.startswith(part)}
        self.moe = MoE(weights, config) if is_moe else None
        self.ffn = None if is_moe else SwiGLU(weights)

    def forward(self, h, positions, segment_ids, inverse_frequencies):
        h = h + self.attention(self.attention_norm(h), positions, segment_ids,
                               inverse_frequencies)
        if self.moe is None:
            return h + self.ffn(self.ffn_norm(h)), None
        y, counts = self.moe(self.ffn_norm(h))
        return h + y, counts

    def exported_grads(self, prefix: str, config: dict) -> dict:
        grads = {f"{prefix}.attention_norm.scale": self.attention_norm.weight.grad,
                 f"{prefix}.ffn_norm.scale": self.ffn_norm.weight.grad,
                 **self.attention.exported_grads(f"{prefix}.attention", config)}
        if self.moe is not None:
            grads.update(self.moe.exported_grads(f"{prefix}.moe"))
        else:
            grads.update(self.ffn.exported_grads(f"{prefix}.ffn"))
        return grads


class Decoder(nn.Module):
    def __init__(self, w: dict, config: dict):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding.from_pretrained(w["embedding"].clone(), freeze=False)
        self.layers = nn.ModuleList(
            DecoderLayer({k.split(".", 2)[2]: v for k, v in w.items()
                          if k.startswith(f"layers.{i}.")}, config)
            for i in range(config["num_layers"]))
        self.norm = RMSNorm(w["final_norm.scale"], config["norm_eps"])
        # The untied head as nn.Linear(H, V') (weight [V', H]); its padded rows are never read.
        self.lm_head = None if config["tie_embeddings"] else linear_from(w["head"])

    def forward(self, tokens, targets, positions, segment_ids, inverse_frequencies,
                ignore_index: int):
        config = self.config
        h = self.embed_tokens(tokens.long())
        counts = []
        for layer in self.layers:
            h, layer_counts = layer(h, positions, segment_ids, inverse_frequencies)
            if layer_counts is not None:
                counts.append(layer_counts)
        h = self.norm(h)
        head = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = F.linear(h, head[: config["vocab_size"]])  # the true vocab only
        loss = F.cross_entropy(logits.to(wide(logits.dtype)).flatten(0, 1),
                               targets.long().flatten(), ignore_index=ignore_index)
        return loss, torch.stack(counts) if counts else torch.zeros(
            (0, config["num_experts"]), dtype=torch.int64)

    def exported_grads(self) -> dict:
        grads = {"embedding": self.embed_tokens.weight.grad,
                 "final_norm.scale": self.norm.weight.grad}
        if self.lm_head is not None:
            grads["head"] = self.lm_head.weight.grad.T
        for i, layer in enumerate(self.layers):
            grads.update(layer.exported_grads(f"layers.{i}", self.config))
        return grads


def model(a: dict, p: dict) -> dict:
    config = p["model"]
    weights = {name: tensor for name, tensor in a.items()
               if not name.startswith(("batch.", "grad.", "rope."))}
    decoder = Decoder(weights, config)
    # The rotation uses the exported fp32 table (see its manifest entry); the table itself is
    # compared with this side's own.
    frequencies = a["rope.inverse_frequencies"].to(torch.float32)
    loss, counts = decoder(a["batch.tokens"], a["batch.targets"], a["batch.positions"],
                           a["batch.segment_ids"], frequencies, p["ignore_index"])
    loss.backward()
    grads = {f"grad.{name}": grad for name, grad in decoder.exported_grads().items()}
    return {"loss": loss, "expert_counts": counts,
            "rope.inverse_frequencies.recomputed": rope_inverse_frequencies(
                config, frequencies.device), **grads}


CASES: dict[str, Callable[[dict, dict], dict]] = {
    "cross_entropy": cross_entropy, "moe": moe, "checkpointed_stack": checkpointed_stack,
    "adamw": adamw, "model": model,
}


# ----------------------------------------------------------------------------------------------
# Comparing.


def relative_difference(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``max|a - b| / max|b|`` in float64 (module doc); for integers the share of differing
    routed slots. Both tensors on one device: on a GPU the comparisons run there, on a CPU in
    numpy (faster than torch at this on the 2-core machines: docs/xcheck.md)."""
    if actual.shape != expected.shape:
        return math.inf
    if not expected.is_floating_point():
        actual, expected = actual.to(torch.int64), expected.to(torch.int64)
        total = 2 * expected.abs().sum().item()
        return float((actual - expected).abs().sum().item() / max(total, 1))
    # Block by block: float64 copies of whole tensors (an expert weight gradient at h200-1's
    # widths is 64 x 2048 x 1024) made the comparisons slower than the computations.
    actual, expected = actual.detach().reshape(-1), expected.detach().reshape(-1)
    if actual.device.type == "cpu":
        actual, expected = _as_numpy(actual), _as_numpy(expected)
    error = scale = 0.0
    for start in range(0, actual.shape[0], COMPARE_BLOCK):
        extrema = _block_extrema(actual[start:start + COMPARE_BLOCK],
                                 expected[start:start + COMPARE_BLOCK])
        if extrema is None:
            return math.inf
        error, scale = max(error, extrema[0]), max(scale, extrema[1])
    if scale == 0.0:
        return 0.0 if error == 0.0 else math.inf
    return error / scale


def _as_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A CPU tensor as numpy (bf16, which numpy lacks, as its exact fp32 values)."""
    return (tensor.to(torch.float32) if tensor.dtype == torch.bfloat16 else tensor).numpy()


def _block_extrema(a, b) -> tuple[float, float] | None:
    """``(max|a - b|, max|b|)`` of one block in float64 (torch tensors or numpy arrays); None
    where either holds a NaN or an infinity."""
    if isinstance(a, torch.Tensor):
        a, b = a.to(torch.float64), b.to(torch.float64)
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            return None
        return (a - b).abs().max().item(), b.abs().max().item()
    a, b = a.astype(np.float64), b.astype(np.float64)
    if not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
        return None
    return float(np.max(np.abs(a - b))), float(np.max(np.abs(b)))


def tolerance_kind(case: dict, entry: dict, run_dtype: str) -> str:
    """The kind of a compared tensor (module doc): the case's, except AdamW's fp32 master and
    schedule, its working params (one rounding of the master) and integer routing counts."""
    if entry["dtype"].startswith("int"):
        return "routing"
    if case["function"] == "adamw":
        if ".working." in entry["name"] and run_dtype == "bfloat16":
            return "bf16_rounding"
        return "fp32"
    return case["tolerance"]


def exported_tensor(value: np.ndarray, entry: dict, device: str) -> torch.Tensor:
    """An exported output as a tensor on ``device`` (bf16 from its bits), for comparing."""
    if entry["dtype"] == "bfloat16":
        tensor = torch.from_numpy(value.view(np.int16).copy()).view(torch.bfloat16)
    else:
        tensor = torch.as_tensor(value)  # keeps a scalar's shape (ascontiguousarray would not)
    return tensor.to(device)


def check(directory, *, device: str = "cpu", reference: str = "float64",
          cases: list[str] | None = None, log: Callable[[str], None] = print) -> dict:
    """Recomputes every case of ``directory`` and compares; returns the report (``passed``,
    ``tensors``: one row per compared tensor; ``seconds``: per case, the JAX side's from the
    manifest, this side's, the float64 reference's and the comparisons'). ``log`` gets one line
    per case as it finishes (``case_line``)."""
    directory = pathlib.Path(directory)
    manifest = json.loads((directory / "manifest.json").read_text())
    if manifest.get("format") != FORMAT:
        raise SystemExit(f"{directory}: expected a {FORMAT} manifest, got "
                         f"{manifest.get('format')!r}")
    run_dtype = manifest["dtype"]
    tolerances = TOLERANCES[run_dtype]
    rows, seconds = [], {}
    for name, case in manifest["cases"].items():
        if cases and name not in cases:
            continue
        function = CASES[case["function"]]
        stored = load_case(directory, case)
        inputs = {e["name"]: stored[e["name"]] for e in case["arrays"] if e["role"] == "input"}
        result, torch_seconds = timed(function, as_compute(inputs, None, device),
                                      case["params"], device=device)
        exact, float64_seconds = (timed(function, as_compute(inputs, torch.float64, device),
                                        case["params"], device=device)
                                  if reference == "float64" else (None, None))
        seconds[name] = {"export": case.get("export_seconds"), "torch": round(torch_seconds, 3),
                         "float64": None if float64_seconds is None else round(
                             float64_seconds, 3)}
        started = time.perf_counter()
        with np.load(directory / case["file"]) as npz:
            for entry in case["arrays"]:
                if entry["role"] == "input":
                    continue
                if entry["name"] not in result or result[entry["name"]] is None:
                    raise SystemExit(f"{name}/{entry['name']}: the torch side computes no such "
                                     f"tensor (a bug in torch_side.py)")
                jax_value = exported_tensor(npz[entry["name"]], entry, device)
                torch_value = result[entry["name"]].detach().to(device)
                kind = tolerance_kind(case, entry, run_dtype)
                row = {"case": name, "tensor": entry["name"], "role": entry["role"],
                       "kind": kind, "difference": relative_difference(jax_value, torch_value),
                       "tolerance": tolerances[kind]}
                if exact is not None:
                    exact_value = exact[entry["name"]].detach().to(device)
                    row["jax_vs_float64"] = relative_difference(jax_value, exact_value)
                    row["torch_vs_float64"] = relative_difference(torch_value, exact_value)
                row["passed"] = bool(row["difference"] <= row["tolerance"])
                rows.append(row)
        seconds[name]["compare"] = round(time.perf_counter() - started, 3)
        log(case_line(name, [r for r in rows if r["case"] == name], seconds[name]))
    return {
        "format": FORMAT, "directory": str(directory), "dtype": run_dtype,
        "seed": manifest["seed"], "config": manifest["config"],
        "jax_version": manifest["jax_version"], "jax_device": manifest["device"],
        "torch_version": torch.__version__, "torch_device": describe_torch_device(device),
        "python": platform.python_version(), "reference": reference,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "tolerances": tolerances, "seconds": seconds, "tensors": rows,
        "passed": all(r["passed"] for r in rows),
    }


def timed(function: Callable, inputs: dict, params: dict, *, device: str):
    """``(function(inputs, params), seconds)``, the device's queue drained before the clock
    stops (CUDA runs asynchronously)."""
    started = time.perf_counter()
    result = function(inputs, params)
    if device.startswith("cuda"):
        torch.cuda.synchronize(torch.device(device))
    return result, time.perf_counter() - started


def case_line(name: str, rows: list[dict], seconds: dict) -> str:
    """One case's line: pass / fail, the tensor nearest its tolerance (largest difference over
    tolerance) with its difference, and the seconds of each side."""
    def margin(row):
        if row["tolerance"] > 0:
            return row["difference"] / row["tolerance"]
        return math.inf if row["difference"] > 0 else 0.0

    failed = sum(not r["passed"] for r in rows)
    worst = max(rows, key=margin)
    verdict = f"FAILED {failed} of {len(rows)}" if failed else f"passed {len(rows)}"
    export = seconds.get("export")
    float64 = seconds.get("float64")
    return (f"xcheck {name}: {verdict} tensors; largest difference {worst['difference']:.2e} "
            f"({worst['tensor']}, tolerance {worst['tolerance']:.0e}); seconds: jax export "
            f"{'-' if export is None else f'{export:.2f}'}, torch {seconds['torch']:.2f}"
            f"{'' if float64 is None else f', float64 reference {float64:.2f}'}, compare "
            f"{seconds['compare']:.2f}")


def describe_torch_device(device: str) -> str:
    if device.startswith("cuda"):
        return f"{torch.cuda.get_device_name(torch.device(device))} (cuda)"
    return f"{platform.processor() or platform.machine()} (cpu)"


def format_report(report: dict) -> str:
    def fmt(value):
        return "-" if value is None else f"{value:.2e}"

    lines = [f"{'case/tensor':<52} {'kind':<13} {'difference':>10} {'tolerance':>9} "
             f"{'jax~f64':>9} {'torch~f64':>9}"]
    for row in report["tensors"]:
        mark = "" if row["passed"] else "  FAIL"
        lines.append(f"{row['case'] + '/' + row['tensor']:<52} {row['kind']:<13} "
                     f"{fmt(row['difference']):>10} {fmt(row['tolerance']):>9} "
                     f"{fmt(row.get('jax_vs_float64')):>9} "
                     f"{fmt(row.get('torch_vs_float64')):>9}{mark}")
    failed = [r for r in report["tensors"] if not r["passed"]]
    lines.append(f"{len(report['tensors']) - len(failed)} passed, {len(failed)} failed "
                 f"({report['dtype']}, seed {report['seed']}, jax {report['jax_version']} on "
                 f"{report['jax_device']}, torch {report['torch_version']} on "
                 f"{report['torch_device']})")
    for row in failed:
        lines.append(f"FAIL {row['case']}/{row['tensor']}: relative difference "
                     f"{row['difference']:.3e} > tolerance {row['tolerance']:.3e} "
                     f"({row['kind']})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", help="what `peakflat xcheck export` wrote")
    parser.add_argument("--device", default="cpu", help="torch device (cpu, cuda, ...)")
    parser.add_argument("--reference", choices=("float64", "none"), default="float64",
                        help="also compute each case in float64 (informative columns)")
    parser.add_argument("--case", action="append", help="check only this case (repeatable)")
    parser.add_argument("--json", help="write the report as JSON to this path")
    args = parser.parse_args(argv)
    report = check(args.directory, device=args.device, reference=args.reference,
                   cases=args.case, log=lambda line: print(line, flush=True))
    print(format_report(report))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
