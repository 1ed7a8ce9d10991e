"""Plain, obviously-correct implementations: the test oracles and the benchmarks' baselines.

Each function materializes everything and is written for clarity, not memory. Tests call them on
float64 inputs inside ``jax.enable_x64(True)`` and differentiate them with ``jax.grad``; the
benchmarks run the same functions in the operators' dtype as "the standard implementation".
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax


def cross_entropy(hidden: jax.Array, full_kernel: jax.Array, targets: jax.Array, *,
                  vocab_size: int | None = None, ignore_index: int = -100,
                  reduction: str = "none") -> jax.Array:
    """Per-token ``-log_softmax(hidden @ full_kernel)[target]`` over the first vocab_size columns.

    hidden [N, H], full_kernel [H, V'] (V' >= vocab_size; extra columns are padding), targets [N].
    Returns [N] in the promoted float dtype (at least float32), 0 where the target is ignored;
    with ``reduction="sum"`` their sum, with ``"mean"`` the sum over the count of targets that
    are not ignored (NaN when there is none, as torch's).
    """
    vocab_size = full_kernel.shape[1] if vocab_size is None else vocab_size
    dtype = jnp.promote_types(jnp.result_type(hidden, full_kernel), jnp.float32)
    logits = jnp.dot(hidden, full_kernel[:, :vocab_size], preferred_element_type=dtype)
    log_probs = jax.nn.log_softmax(logits.astype(dtype), axis=-1)
    ignored = targets == ignore_index
    safe_targets = jnp.where(ignored, 0, targets)
    picked = jnp.take_along_axis(log_probs, safe_targets[:, None], axis=-1)[:, 0]
    losses = jnp.where(ignored, 0.0, -picked)
    return _reduce(losses, ignored, reduction, axis_name=None)


def materialized_cross_entropy(hidden: jax.Array, kernel: jax.Array, targets: jax.Array, *,
                               axis_name: Any, vocab_size: int | None = None,
                               ignore_index: int = -100, reduction: str = "none") -> jax.Array:
    """The standard vocab-parallel loss (a per-shard function for shard_map): all-gathers the
    kernel shards [H, Vs] into [H, P*Vs] and materializes the N x V logits and log-softmax.

    Same contract as ``pf.ring_cross_entropy``; this is what it is measured against. A
    ``reduction`` sums (and counts) over the ranks of ``axis_name``.
    """
    full_kernel = lax.all_gather(kernel, axis_name, axis=1, tiled=True)
    losses = cross_entropy(hidden, full_kernel, targets, vocab_size=vocab_size,
                           ignore_index=ignore_index)
    return _reduce(losses, targets == ignore_index, reduction, axis_name=axis_name)


def _reduce(losses, ignored, reduction: str, axis_name):
    if reduction == "none":
        return losses
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction: expected 'none', 'mean' or 'sum', got {reduction!r}")
    total, count = jnp.sum(losses), jnp.sum(~ignored).astype(losses.dtype)
    if axis_name is not None:
        total, count = lax.psum(total, axis_name), lax.psum(count, axis_name)
    return total / count if reduction == "mean" else total


def swiglu_experts(x: jax.Array, w_gate: jax.Array, w_up: jax.Array,
                   w_down: jax.Array, biases=None, activation: str = "swiglu",
                   swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0) -> jax.Array:
    """Every expert applied to every token: ``[E, N, H]``,
    ``ffn_e(v) = (silu(v @ w_gate[e]) * (v @ w_up[e])) @ w_down[e]``; with ``biases``
    (b_gate, b_up [E, F], b_down [E, H]) each projection adds its expert's; ``activation=
    "clamped_swiglu"``: gpt-oss's unit, g sigmoid(alpha g) (u + 1) of g = min(gate, limit),
    u = clip(up, -limit, limit)."""
    gate = jnp.einsum("nh,ehf->enf", x, w_gate)
    up = jnp.einsum("nh,ehf->enf", x, w_up)
    if biases is not None:
        gate, up = gate + biases[0][:, None], up + biases[1][:, None]
    if activation == "swiglu":
        hidden = jax.nn.silu(gate) * up
    else:
        gate = jnp.clip(gate, None, swiglu_limit)
        up = jnp.clip(up, -swiglu_limit, swiglu_limit)
        hidden = gate * jax.nn.sigmoid(swiglu_alpha * gate) * (up + 1)
    out = jnp.einsum("enf,efh->enh", hidden, w_down)
    return out if biases is None else out + biases[2][:, None]


def mixture_of_experts(x: jax.Array, expert_ids: jax.Array, gates: jax.Array,
                       w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
                       **ffn_options) -> jax.Array:
    """``y[n] = sum_j gates[n, j] * ffn_{expert_ids[n, j]}(x[n])`` with all E experts' weights
    ([E, H, F], [E, H, F], [E, F, H]) on one device: x [N, H], expert_ids and gates [N, k];
    ``ffn_options``: ``swiglu_experts``' biases and activation."""
    outputs = swiglu_experts(x, w_gate, w_up, w_down, **ffn_options)  # [E, N, H]
    num_experts = w_gate.shape[0]
    # weight[e, n] = sum of the gates of n's slots that chose e (a slot may repeat an expert).
    weight = jnp.einsum("nk,nke->en", gates, jax.nn.one_hot(expert_ids, num_experts,
                                                             dtype=gates.dtype))
    return jnp.einsum("en,enh->nh", weight, outputs)


def adamw_steps(params: dict, grads: list[dict], hyperparams: list[dict], *,
                max_grad_norm: float | None = None) -> list[dict]:
    """AdamW (Loshchilov & Hutter, bias-corrected, decoupled decay as optax.adamw applies it) in
    float64 numpy, one step per entry of ``grads`` with that step's ``hyperparams``
    (learning_rate, b1, b2, eps, weight_decay); the gradients first clipped to the global norm
    ``max_grad_norm`` (scaled by max_grad_norm / norm where the norm exceeds it). Returns the
    params after each step. The optimizers' oracle: it shares no code with optax."""
    import numpy as np

    params = {k: np.asarray(v, np.float64) for k, v in params.items()}
    mu = {k: np.zeros_like(v) for k, v in params.items()}
    nu = {k: np.zeros_like(v) for k, v in params.items()}
    history = []
    for t, (step_grads, h) in enumerate(zip(grads, hyperparams), start=1):
        g = {k: np.asarray(v, np.float64) for k, v in step_grads.items()}
        if max_grad_norm is not None:
            norm = np.sqrt(sum(np.sum(v * v) for v in g.values()))
            if norm > max_grad_norm:
                g = {k: v * (max_grad_norm / norm) for k, v in g.items()}
        for k in params:
            mu[k] = h["b1"] * mu[k] + (1 - h["b1"]) * g[k]
            nu[k] = h["b2"] * nu[k] + (1 - h["b2"]) * g[k] ** 2
            mu_hat = mu[k] / (1 - h["b1"] ** t)
            nu_hat = nu[k] / (1 - h["b2"] ** t)
            update = mu_hat / (np.sqrt(nu_hat) + h["eps"]) + h["weight_decay"] * params[k]
            params[k] = params[k] - h["learning_rate"] * update
        history.append(dict(params))
    return history
