"""The step-time estimate that ``operators: auto`` and ``--auto`` rank candidates by: the
model's FLOPs and bytes over the measured rates (``measured.json``)."""

from __future__ import annotations

import jax.numpy as jnp

from peakflat_jax.config import Config
from peakflat_jax.model.size import active_parameters_per_token
from peakflat_jax.plan.optimizer_terms import host_cpu_adamw_link_bytes
from peakflat_jax.plan.target import GPU, Target
from peakflat_jax.plan.terms import Knobs, layer_loop, model_weights, resident_param_count


def attention_fraction(target: Target, context: int) -> float:
    """The causal pairs within documents of the target's data at ``context``, over full
    causal's T (T + 1) / 2: what the step estimate's attention counts."""
    return target.data.causal_pairs(context) / (context * (context + 1) / 2)


def step_seconds(config: Config, knobs: Knobs, target: Target = GPU) -> float:
    """An estimate of one step's time on a device: the model's matmuls with one recompute of
    every layer, attention within documents, the Ulysses exchanges, the MoE's extra chunks,
    the boundary copies that do not hide under a layer's compute, the offloaded optimizer's
    streaming (what of it the forward does not hide, when overlapped), and the host-CPU
    optimizer's update with its copies, after the backward and before the next step."""
    rates = target.step_rates
    model = config.model
    n, width = knobs.tokens_per_device, knobs.num_devices
    itemsize = jnp.dtype(model.dtype).itemsize
    layers = model.num_layers
    num_moe = layers - model.num_dense_layers
    # 6 FLOPs per active weight per token, +2 for the recompute of every layer's forward.
    matmul = 8.0 * active_parameters_per_token(model) * n / rates.matmul_flops
    # 12 Hq D model FLOPs per layer per causal pair, +1/3 for the recompute, n / T sequences.
    pairs = target.data.causal_pairs(knobs.context)
    attention = 16.0 * layers * model.num_heads * model.head_dim * pairs * (
        n / knobs.context) / rates.attention_flops
    compute = matmul + attention
    hkv = model.num_kv_heads if model.num_kv_heads % knobs.seq == 0 else model.num_heads
    exchanged = n * (2 * model.num_heads + 2 * hkv) * model.head_dim * itemsize
    ulysses = 3 * layers * exchanged * (knobs.seq - 1) / knobs.seq / rates.all_to_all_bytes
    chunks = 1 if knobs.token_budget is None else min(knobs.max_chunks,
                                                      -(-n // knobs.token_budget))
    moe = (num_moe * (chunks - 1) * rates.moe_chunk_seconds
           if knobs.moe_dispatch == "pipelined" else 0.0)
    copy = n * model.hidden * itemsize / rates.host_link_bytes
    per_layer = compute / layers
    # A boundary goes out under its layer's forward (1/4 of the layer) and comes back under
    # the next layer's recompute and backward (3/4).
    boundaries = knobs.num_offloaded * (max(0.0, copy - per_layer / 4)
                                        + max(0.0, copy - 3 * per_layer / 4))
    optimizer = 0.0
    if knobs.optimizer_offload:
        # The resident groups' state is updated where it is: only the rest crosses the link.
        streamed = model_weights(model, width).param_count - resident_param_count(
            model, width, knobs.resident_groups)
        optimizer = streamed * rates.optimizer_seconds_per_param
        # Overlapped in straight-line code the stream runs under the forward (1/4 of the
        # compute); a scanned stack's stacked MoE weights wait for all their buckets.
        unrolled = layer_loop(config, knobs.optimizer_overlap, target.platform) == "unrolled"
        if knobs.optimizer_overlap and unrolled:
            optimizer = max(0.0, optimizer - compute / 4)
    elif config.optimizer.update_on == "host_cpu":
        params = model_weights(model, width).param_count
        copies = sum(host_cpu_adamw_link_bytes(params, model.dtype).values())
        # One process: its CPU updates every device's shards; each device's copies cross its
        # own link.
        optimizer = (width * params * rates.host_adamw_seconds_per_param
                     + copies / rates.host_link_bytes)
    return compute + ulysses + moe + boundaries + optimizer
