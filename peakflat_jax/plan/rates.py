"""The measured rates and the step-time estimate that ``--auto`` ranks candidates by."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from peakflat_jax.config import Config
from peakflat_jax.model.size import active_parameters_per_token
from peakflat_jax.plan.terms import Knobs, model_weights, resident_param_count
from peakflat_jax.train.data import causal_pairs_per_sequence

# ----------------------------------------------------------------------------------------------
# Measured rates.

HOST_ADAMW_RECORD = "host_adamw_cpu_20261201-172306.json"
"""The record (scripts/results/) of the host-CPU AdamW rate: the 2-core dev CPU, no GPU."""
HOST_ADAMW_SECONDS_PER_PARAM = 0.23030315899814013 / 64_000_000
"""That record's bf16 case at 6.4e7 parameters: 3.60 s per 1e9 on the 2-core dev CPU (shared:
its load average was ~4.8; docs/offload_adamw.md)."""


@dataclasses.dataclass(frozen=True)
class Rates:
    """What the step-time estimate uses, per device; defaults measured on one or two H200s
    (docs/plan.md says where each comes from; ``tests/test_plan.py`` recomputes those taken
    from records). Override with ``dataclasses.replace`` or ``peakflat plan --rate NAME=VALUE``.
    """

    matmul_flops: float = 760e12
    """Dense bf16 matmul FLOP/s (JAX-NOTES.md: 8192^3 on one H200)."""
    attention_flops: float = 490e12
    """Causal attention model FLOP/s, forward + backward, at long context (JAX-NOTES.md:
    cuDNN on one H200)."""
    host_link_bytes: float = 12 * 2e9 / 0.4301509520000053
    """Host <-> device bytes/s, both directions together (offload_adamw_gpu_20261130-090838:
    the ``link`` case, 12 bytes x 2e9 params host -> device)."""
    all_to_all_bytes: float = 557e9
    """all_to_all buffer bytes/s per device (JAX-NOTES.md: 2 H200s)."""
    optimizer_seconds_per_param: float = 0.7796447619999753 / 2e9
    """OffloadStreamAdamW's step per parameter (offload_adamw_gpu_20261130-070502: stream,
    bucket 2.5e8, 2 slots, 2e9 params: the fastest measured)."""
    optimizer_bucket_params: int = 250_000_000
    """The bucket size of that measurement: --auto's first choice."""
    moe_chunk_seconds: float = (0.7097738239999956 - 0.5835472699999968) / 4
    """One more MoE chunk, per layer, forward + backward (moe_dispatch_gpu_20261130-090350:
    pipelined at c = 6554 (5 chunks) against LLEP (1 chunk), N = 32,768, 2 H200s)."""
    host_adamw_seconds_per_param: float = HOST_ADAMW_SECONDS_PER_PARAM
    """The host-CPU AdamW's update per parameter (``optimizer.update_on: host_cpu``: clipped,
    bf16 working params), the copies apart. MEASURED ON THE 2-CORE DEV CPU, NOT THE GPU HOST
    (scripts/probes/probe_host_adamw.py, ``HOST_ADAMW_RECORD``): a GPU host's cores run it
    faster; rerun the probe there and pass ``--rate host_adamw_seconds_per_param=...``."""


# ----------------------------------------------------------------------------------------------
# The step-time estimate.


def attention_fraction(config: Config, context: int) -> float:
    """The causal pairs within documents of this config's data at ``context``, over full
    causal's T (T + 1) / 2 (1 for synthetic data): what the step estimate's attention counts."""
    return causal_pairs_per_sequence(config.data, context) / (context * (context + 1) / 2)


def step_seconds(config: Config, knobs: Knobs, rates: Rates = Rates()) -> float:
    """An estimate of one step's time on a device: the model's matmuls with one recompute of
    every layer, attention, the Ulysses exchanges, the MoE's extra chunks, the boundary copies
    that do not hide under a layer's compute, the offloaded optimizer's streaming (what of
    it the forward does not hide, when overlapped), and the host-CPU optimizer's update with
    its copies (gradients down, params up, P * b bytes each at the host link's rate), after
    the backward and before the next step: nothing hides them."""
    model = config.model
    n, width = knobs.tokens_per_device, knobs.num_devices
    itemsize = jnp.dtype(model.dtype).itemsize
    layers = model.num_layers
    num_moe = layers - model.num_dense_layers
    # 6 FLOPs per active weight per token, +2 for the recompute of every layer's forward.
    matmul = 8.0 * active_parameters_per_token(model) * n / rates.matmul_flops
    # Causal attention within documents, the trainer's convention (model.size): 12 Hq D per
    # layer per causal pair (model FLOPs), +1/3 for the recompute, over the pairs of this
    # config's data at this context (full causal for synthetic data), n / T sequences.
    pairs = causal_pairs_per_sequence(config.data, knobs.context)
    attention = 16.0 * layers * model.num_heads * model.head_dim * pairs * (
        n / knobs.context) / rates.attention_flops
    compute = matmul + attention
    hkv = model.num_kv_heads if model.num_kv_heads % knobs.seq == 0 else model.num_heads
    exchanged = n * (2 * model.num_heads + 2 * hkv) * model.head_dim * itemsize
    ulysses = 3 * layers * exchanged * (knobs.seq - 1) / knobs.seq / rates.all_to_all_bytes
    chunks = 1 if knobs.token_budget is None else min(knobs.max_chunks,
                                                      -(-n // knobs.token_budget))
    moe = num_moe * (chunks - 1) * rates.moe_chunk_seconds if knobs.moe_dispatch == (
        "pipelined") else 0.0
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
        # Overlapped with the unrolled stack, the stream runs under the forward (1/4 of the
        # compute); with the scanned one the stacked MoE weights wait for all their buckets,
        # and on an H200 the whole stream showed (h200-1: 2.96 s a step against 1.73 with
        # the optimizer on the device, h200_1_train_scan_gpu_20261201-105253.json).
        if knobs.optimizer_overlap and config.operators.layer_loop != "scan":  # auto: unrolled
            optimizer = max(0.0, optimizer - compute / 4)
    elif config.optimizer.update_on == "host_cpu":
        from peakflat_jax.optim.host_cpu_adamw import host_cpu_adamw_link_bytes

        params = model_weights(model, width).param_count
        copies = sum(host_cpu_adamw_link_bytes(params, model.dtype).values())
        # One process (host_cpu runs in one): its CPU updates every device's shards, each
        # device's copies cross its own link.
        optimizer = (width * params * rates.host_adamw_seconds_per_param
                     + copies / rates.host_link_bytes)
    return compute + ulysses + moe + boundaries + optimizer
