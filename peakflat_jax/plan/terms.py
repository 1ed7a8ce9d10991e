"""The closed form: the knobs of a step, the weights' bytes, and every term of the bound
(``plan_terms``), each with its formula and where it is live."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

import peakflat_jax.plan.host_pool as host_pool
from peakflat_jax import mesh as mop
from peakflat_jax.config import Config, ConfigError, optimizer_groups
from peakflat_jax.ops import ring_cross_entropy as ring_module
from peakflat_jax.ops import sco as sco_module
from peakflat_jax.ops.grouped_matmul import planned_path
from peakflat_jax.ops.pipelined_moe import chunk_rows
from peakflat_jax.optim import host_cpu_adamw as host_cpu_module
from peakflat_jax.optim import offload_adamw as offload_module
from peakflat_jax.optim import on_device_adamw as device_adamw_module

# ----------------------------------------------------------------------------------------------
# The planner's own terms (the operators' formulas are in their modules' MEMORY_FORMULAS).

MEMORY_FORMULAS: dict[str, str] = {
    "params": "P * b: this device's weight shards (FSDP dense, EP experts, vocab-split "
              "embedding and head; a leaf W divides nowhere is whole)",
    "grads": "P * b: their gradients, placed alike",
    "optimizer_update_host_cpu": "0: the update runs on the host CPU (optimizer.update_on: "
                                 "host_cpu), its state and transit are host terms",
    "kept_boundaries.dense_stack": "(L_d - n_offloaded_d) * C: the dense stack's kept "
                                   "boundaries, all that is live in the dense peak layer's "
                                   "backward where the layer loop is unrolled (the MoE "
                                   "stack's: kept_boundaries.moe_stack)",
    "kept_boundaries.moe_stack": "(L_m - n_offloaded_m) * C: the MoE stack's kept boundaries "
                                 "where the layer loop is unrolled and the peak layer is "
                                 "dense: beside the loss and the MoE layers' backward, each "
                                 "freed by its own before the dense layers'",
    "router_bias": "2 * L_m * E * 4: the router's balancing bias (fp32, replicated), in and out",
    "batch": "4 * N * 4: tokens, targets, positions, segment ids (int32)",
    "gathered_weights": "2 * D_l * b: the layer's dense weights all-gathered whole, and their "
                        "whole gradient before the reduce-scatter",
    "residual_stream": "6 * N * H * 4: the layer's norms (fp32 inside), the residual sums and "
                       "their cotangents",
    "attention.activations": "3 * N * (2 Hq + 2 Hkv') * D * b: q, k, v and the output in the "
                             "token and head layouts of the Ulysses exchange, and cotangents",
    "attention.saved": "xla: 4 * N * Hq * T, the fp32 probabilities [B_l, Hq / seq, T, T] "
                       "kept for the backward; cudnn: 4 * R * N * Hq, the softmax statistics "
                       "of each of the R = S + 1 packed runs (R = 1 unpacked)",
    "attention.backward": "xla: (8 + b) * N * Hq * T, the probabilities' gradient and the "
                          "logits' (fp32) and a transposed copy of one (XLA:CPU's buffer "
                          "assignment of the tests' tiny config at T = 256: three fp32 [Hq, "
                          "N, T] at its peak, beside the saved probabilities); cudnn: R * N "
                          "* Hq * (8 D + 4) + 17,152, the "
                          "backward's workspace: cuDNN sizes its fp32 dQ accumulator, full-head "
                          "dK and dV and softmax sums for R runs of the whole length T each "
                          "(XLA:GPU's plan, measured, docs/plan.md)",
    "ffn": "6 * N * F_d * 4: the dense FFN's gate, up and their product, and their "
           "cotangents",
    "router": "4 * N * E * 4: the router's fp32 logits, scores and their cotangents",
    "shared_expert": "6 * N * F_s * 4: the shared expert's gate, up and product, and "
                     "cotangents",
    "final_hidden": "3 * N * H * 4: the last layer's output, the final norm's and the "
                    "cotangent that leaves the loss",
    "embedding_table": "V' * H * b: the table gathered whole for the lookup",
    "embedding_gradient": "V' * H * b: the table's dense gradient before the reduce-scatter, "
                          "which XLA may allocate before the layers' backward (XLA:CPU did)",
    "optimizer_update": "2 * P * 4: the fused AdamW's fp32 gradients (clipped) and updates",
    "residual_stream_gpu": "2 * N * H * b on a GPU: the layer's normed input and its "
                           "attention's residual sum, in the model's dtype",
    "attention.activations_gpu": "N * D * b * (3 * Hq + 4 * Hkv) on a GPU: q, O, dQ, k, v, dK, "
                                 "dV",
    "ffn_gpu": "5 * N * F_d * b on a GPU: the recomputed gate and up, their product and two "
               "cotangents, in the model's dtype (XLA:GPU's buffer assignment at 64K and 256K)",
    "ffn.under_attention": "4 * N * F_d * b on a GPU: four of them live through the attention's "
                           "backward, where XLA:GPU runs the FFN's weight gradients after it "
                           "(seen before the scanned backward's barrier, 2026-12-01); not in "
                           "the standard stack's step as counted by plan.programs.step_terms, "
                           "whose dumps at 64K-621K hold none; none where SCO offloads a "
                           "boundary, whose FFN backward computes them first "
                           "(model.layers.weight_gradients_first)",
    "moe.dispatch_gpu": "4 * M * H * b on one GPU in one chunk (EP): the rows of width H that "
                        "XLA:GPU holds at once in the layer's backward (its buffer assignments "
                        "of h200-1's EP step at 64K and 256K: at most four [M, H])",
    "moe.expert_ffn_gpu": "4 * M * F * b on one GPU in one chunk (EP): the rows of width F held "
                          "at once (the same buffer assignments: at most four [M, F])",
    "moe.dispatch_gpu_pipelined": "4 * M * H * b on one GPU, pipelined in chunks on the Mosaic "
                                  "path, the layers unrolled (M: one chunk's rows): the rows of "
                                  "width H that XLA:GPU holds at once in the layer's backward, "
                                  "where the operator's CPU-measured form counts nine (its "
                                  "buffer assignments of h200-e2e's unrolled step at 533,994 "
                                  "and 741,848 tokens: at most four [M, H]; scanned at 684,042 "
                                  "too, where the plan keeps nine: docs/plan.md)",
    "moe.dispatch_gpu_standard": "2 * M * H * b on one GPU in one chunk (EP), the standard "
                                 "stack's step (plan.programs.step_terms): at most two [M, H] "
                                 "at once, the dispatched rows and the down projection's "
                                 "output (measured: XLA:GPU's buffer assignments of h200-1 "
                                 "all off at 131,072-621,208 tokens: two at most over each "
                                 "schedule; at 65,536 with 64 segments a third at one fusion, "
                                 "which the phase's other terms cover)",
    "moe.expert_ffn_gpu_standard": "3 * M * F * b on one GPU in one chunk (EP), the standard "
                                   "stack's step: at most three [M, F] at once, the gate, the "
                                   "up projection and their product (the same buffer "
                                   "assignments)",
    "held_through_attention": "2 * N * H * b + N * V' * 4 + N * D * 4 on one GPU, the standard "
                              "stack's step: what XLA:GPU holds through a MoE layer's "
                              "attention backward that no other term names: the MoE "
                              "stack's output and a fifth [N, H] of the layer (model dtype), "
                              "the materialized loss's fp32 [N, V'] (from the loss's forward "
                              "until the MoE stack's backward ends) and RoPE's fp32 cos and sin "
                              "[N, D / 2] (measured: all live at XLA's peak, a MoE layer's "
                              "attention backward, in its buffer assignment of h200-1 all off "
                              "at 443,720 tokens, V' = 260)",
    "runtime_gpu": "6.25 GiB scanned, 6.5 unrolled, + 0.035 * pool, on a GPU: the trainer "
                   "process's Python, jax, CUDA, cuDNN and compiled programs, and what grows "
                   "with the pinned-host pool (fitted to nine H200 runs: plan.host_pool)",
    "pinned_pool_growth": "pool - live: XLA's pinned-host pool grows by doubling regions over the "
                          "pinned arrays (optimizer buckets, boundaries) up to its limit "
                          "(plan.host_pool; device.pinned_host_pool); more than any host where "
                          "the limit is reached first",
    "pinned_outside_process": "0.018 * pool on a GPU: what the kernel and the driver hold for "
                              "the pinned pages, outside the process's resident set (measured "
                              "on an H200 host: plan.host_pool); the host's budget is the "
                              "memory available at the start, not its total",
    "optimizer_update_gpu": "0 on a GPU: XLA:GPU fuses the update into elementwise loops over "
                            "the donated state (measured: no fp32 copy of the gradients)",
    "overlap.moe_layer_weights": "2 * P_m * b: the MoE layers' updated weights taken per layer and "
                                 "their stacked copy (the program's output) beside the stacked "
                                 "params; P_m the MoE stack's share of P",
    "overlap.moe_layer_weights_gpu": "P * b + (L_m - 1) * b_m on a GPU: every bucket's new "
                                     "working params, held until the leaves are assembled at "
                                     "the step's end, and the new weights of the MoE layers "
                                     "whose backward is still to come (b_m: one MoE layer's "
                                     "bytes; XLA:GPU's buffer assignments of h200-1's "
                                     "overlapped step at 64K, EP and pipelined: 9.5 GiB live "
                                     "against 10.1; unrolled with every group resident: "
                                     "h200-1 at 64K and 592,826, 1.060x and 1.053x)",
    "overlap.new_weights_gpu": "P * b - (L_m - 1) * b_m on a GPU, unrolled: the new weights of "
                               "the leaves outside the MoE stack, held beside the old to the "
                               "step's end, and one MoE layer's made in the forward before it "
                               "is written into the donated stack in place (sco.MadeInLoop's "
                               "into: the other MoE layers' are the parameters' own bytes; "
                               "measured where a group streams)",
    "forward.dense_layer": "the dense layer's forward on a GPU: what the layer holds but the "
                           "carried cotangent, and the FFN's gate, up and product, 3 * N * F_d "
                           "* b (_first_layer_forward; h200-e2e's buffer assignment at 540,672: "
                           "its peak there, the three held); 0 without dense layers",
    "overlap.packing_gpu": "3 * N * H * b on a GPU: what XLA:GPU's packing of the overlapped "
                           "step's temporaries leaves unused at its peak (its buffer "
                           "assignments: 2.51 [N, H] at 698,002 tokens, h200-1 unrolled; 2.93 "
                           "at 540,672, h200-e2e scanned; none in the standard stack's step "
                           "at 443,720)",
    "data_pipeline": "pipeline_host_bytes / local devices: the batch being made",
    "optimizer_step.bucketed_params_gpu": "P * b: each bucket's new working params, which "
                                          "XLA:GPU holds among the step's temporaries until "
                                          "the leaves are assembled from them (measured, "
                                          "docs/plan.md); 0 on CPU",
}

LIVE_SETS = {
    "persistent": "the whole step",
    "boundaries": "from each layer's forward to its backward",
    "boundaries.later": "the MoE stack's boundaries where the layer loop is unrolled and the "
                        "peak layer is dense: live through the loss and every MoE layer's "
                        "backward, each freed by its own, so none is left in the dense "
                        "layers' (h200-e2e's buffer assignment at 540,672 unrolled: one [N, H] "
                        "boundary live at its peak, in the dense FFN's backward)",
    "backward": "through the backward, whatever phase it is in",
    "layer": "one layer's recompute and backward (the largest layer kind)",
    "layer/attention": "within the layer: attention's backward",
    "layer/ffn": "within the layer: the FFN's or the MoE's forward and backward",
    "loss": "the loss, forward and backward",
    "embedding": "the lookup and its gradient",
    "update": "the fused AdamW update",
    "optimizer_step": "OffloadStreamAdamW's own program, after the gradients",
    "overlap": "with operators.optimizer_overlap, beside the gradient program's terms in the "
               "program that applies the last step's update before each layer's forward",
    "overlap.forward": "the MoE layers' new weights where the layer loop is scanned on a GPU: "
                       "assembled before the MoE stack's loop, beside the embedding and the "
                       "dense layers' forward (counted beside the loss too), not the backward "
                       "(h200-e2e's buffer assignment at 540,672: of the update, 0.72 GiB of "
                       "staged fp32 buckets live in the dense FFN's backward, 1.22 before it, "
                       "under overlap.staging's 1.86)",
    "forward": "the dense layer's forward, beside the MoE layers' new weights "
               "(overlap.forward)",
    "host": "host memory, per device",
}
"""Where each term is live. The phases (layer, loss, embedding, update) never overlap: the
gradient program's peak takes the largest of them."""

PHASES = ("layer", "loss", "embedding", "update")
# The most chunks --auto considers: each costs an exchange and a pass over the layer's expert
# weights (Rates.moe_chunk_seconds), so the choice never wants more unless memory forces it.
MOST_CHUNKS = 256
SMALLEST_VOCAB_BLOCK = 1024


# ----------------------------------------------------------------------------------------------
# The launch knobs and the layout they imply.


@dataclasses.dataclass(frozen=True)
class Knobs:
    """Every choice the plan depends on besides the model."""

    data: int
    seq: int
    batch_size: int
    context: int
    moe_dispatch: str
    token_budget: int | None
    """None: one chunk."""
    max_chunks: int
    loss: str
    loss_mode: str
    vocab_block: int | None
    """None: a whole shard per strip."""
    offload: tuple[bool, ...]
    """Per layer, whether SCO keeps its boundary in host memory."""
    optimizer_offload: bool
    optimizer_overlap: bool
    """Whether the trainer applies each step's (offloaded) update inside the next step's
    program; only with the offloaded optimizer and MoE layers."""
    bucket_params: int
    slots: int
    attention: str
    """The resolved kernel: ``cudnn`` or ``xla``."""
    resident_groups: int = 0
    """How many of the streamed optimizer's first groups keep their state on the device
    (``optimizer.resident_groups``; 0 where the optimizer is not streamed)."""

    @property
    def num_devices(self) -> int:
        return self.data * self.seq

    @property
    def tokens_per_device(self) -> int:
        return self.batch_size * self.context // self.num_devices

    @property
    def num_offloaded(self) -> int:
        return sum(self.offload)

    def as_config(self) -> dict[str, Any]:
        """The knobs as config keys (``section.field``: value)."""
        offload = self.offload
        count = sum(offload)
        simple = all(offload[:count]) and not any(offload[count:])
        return {"mesh.data": self.data, "mesh.seq": self.seq,
                "data.batch_size": self.batch_size, "data.seq_len": self.context,
                "operators.moe_dispatch": self.moe_dispatch,
                "operators.token_budget": self.token_budget,
                "operators.max_chunks": self.max_chunks, "operators.loss": self.loss,
                "operators.loss_mode": self.loss_mode,
                "operators.vocab_block": self.vocab_block,
                "operators.offload": ("none" if count == 0 else "all" if count == len(offload)
                                      else count if simple else list(offload)),
                "operators.optimizer_offload": self.optimizer_offload,
                "operators.optimizer_overlap": self.optimizer_overlap,
                "optimizer.bucket_params": self.bucket_params, "optimizer.slots": self.slots,
                "optimizer.resident_groups": self.resident_groups if self.optimizer_offload else 0,
                "operators.attention": self.attention}


@dataclasses.dataclass(frozen=True)
class WeightBytes:
    """The model's weights on W devices, per device (from its abstract shapes and placement)."""

    param_count: int
    """P: trainable elements on a device (its shards; whole where W divides no dimension)."""
    params: int
    """Their bytes."""
    extras: int
    """Non-trained variables (the router's bias), bytes on a device."""
    layer_shard: dict
    """Per stack ('dense', 'moe'): one layer's slice of the device's shards, bytes."""
    layer_params: dict
    """Per stack: one layer's slice of the device's shards, trainable elements."""
    layer_whole_dense: dict
    """Per stack: one layer's non-expert weights, whole, bytes (what the layer gathers)."""
    embedding_whole: int
    """The embedding table [V', H], whole, bytes."""
    largest_leaf: int = 0
    """The largest trainable leaf's elements, whole (all its shards)."""


@functools.lru_cache(maxsize=64)
def model_weights(model_config, num_devices: int) -> WeightBytes:
    """``WeightBytes`` of ``model_config`` on ``num_devices`` devices: the model's abstract
    state (no array is made) under ``model.sharding.weight_spec``."""
    from flax import nnx

    from peakflat_jax.model.decoder import MoEDecoder
    from peakflat_jax.model.sharding import _names, weight_spec

    padded = mop.padded_vocab(model_config.vocab_size, num_devices)
    abstract = nnx.eval_shape(lambda: MoEDecoder(model_config, padded_vocab=padded,
                                                 rngs=nnx.Rngs(0)))
    _, params, extras = nnx.split(abstract, nnx.Param, ...)
    stacks = {"dense_layers": "dense", "moe_layers": "moe"}
    layers = {"dense": model_config.num_dense_layers,
              "moe": model_config.num_layers - model_config.num_dense_layers}
    count = param_bytes = embedding = largest = 0
    shard = {"dense": 0, "moe": 0}
    shard_params = {"dense": 0, "moe": 0}
    whole = {"dense": 0, "moe": 0}
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        names = _names(path)
        spec = weight_spec(names, leaf.shape, num_devices)
        local = math.prod(_shard_shape(leaf.shape, spec, num_devices))
        itemsize = jnp.dtype(leaf.dtype).itemsize
        count += local
        param_bytes += local * itemsize
        largest = max(largest, math.prod(leaf.shape))
        if names == ("embedding",):
            embedding = math.prod(leaf.shape) * itemsize
        stack = stacks.get(names[0])
        if stack:
            shard[stack] += local * itemsize // layers[stack]
            shard_params[stack] += local // layers[stack]
            if names[-2:-1] != ("moe",) or names[-1] not in ("w_gate", "w_up", "w_down"):
                whole[stack] += math.prod(leaf.shape) * itemsize // layers[stack]
    extra_bytes = sum(math.prod(leaf.shape) * jnp.dtype(leaf.dtype).itemsize
                      for leaf in jax.tree.leaves(extras))
    return WeightBytes(param_count=count, params=param_bytes, extras=extra_bytes,
                       layer_shard=shard, layer_params=shard_params, layer_whole_dense=whole,
                       embedding_whole=embedding,
                       largest_leaf=largest)


def resident_param_count(model_config, num_devices: int, resident_groups: int) -> int:
    """P_r: the parameters per device whose streamed-optimizer state the first
    ``resident_groups`` groups keep on the device (``optimizer.resident_groups``): the first
    group is every weight outside the MoE stack, each further one a MoE layer."""
    if not resident_groups:
        return 0
    weights = model_weights(model_config, num_devices)
    per_layer = weights.layer_params["moe"]
    outside = weights.param_count - (model_config.num_layers
                                     - model_config.num_dense_layers) * per_layer
    return outside + (resident_groups - 1) * per_layer


def _shard_shape(shape, spec, num_devices: int) -> tuple[int, ...]:
    dims = list(shape)
    for axis, entry in enumerate(spec):
        if entry is not None:
            dims[axis] //= num_devices  # every sharded dimension is over all devices (mop.ALL)
    return tuple(dims)


# ----------------------------------------------------------------------------------------------
# The terms.


@dataclasses.dataclass(frozen=True)
class Term:
    """One term of the bound: bytes per device, where it is live, its formula."""

    name: str
    bytes: int
    live: str
    formula: str


def plan_terms(config: Config, knobs: Knobs, *, platform: str = "gpu",
               operators_on: bool = True, standard_step: bool = False) -> list[Term]:
    """Every term of the step's per-device bound (device and host) for ``knobs``, with the
    operators as the knobs set them (``operators_on``) or all four off (the baseline: EP in one
    chunk, the materialized loss, no offload, the optimizer on the device). ``standard_step``: the
    standard stack's step as XLA:GPU's buffer assignments of h200-1 hold it at every context
    dumped since the scanned backward's barrier (64K-621K; ``plan.programs.step_terms`` says
    where it applies): none of the dense FFN's buffers under the attention's backward, and
    the MoE layer (EP, one chunk, one GPU) holding two [M, H] (a third at one fusion at 64
    segments, under the FFN phase's total) and three [M, F], and ``held_through_attention``
    through its attention's backward."""
    model = config.model
    width = knobs.num_devices
    weights = model_weights(model, width)
    itemsize = jnp.dtype(model.dtype).itemsize
    n, h = knobs.tokens_per_device, model.hidden
    padded = mop.padded_vocab(model.vocab_size, width)
    shard_width = padded // width
    num_dense = model.num_dense_layers
    num_moe = model.num_layers - num_dense
    boundary = n * h * itemsize
    if platform == "cpu":  # memory kinds lower to nothing on CPU: an offloaded boundary stays
        knobs = dataclasses.replace(knobs, offload=(False,) * model.num_layers)
    if not operators_on:
        knobs = baseline_knobs(knobs)
    terms: list[Term] = []

    def add(name, value, live, formula=None):
        terms.append(Term(name, int(value), live, formula or MEMORY_FORMULAS[name]))

    def add_all(prefix, values, live, formulas):
        for key, value in values.items():
            add(f"{prefix}{key}", value, live, formulas[key])

    # Persistent state. On the host CPU (ZeRO-Offload's placement) the device keeps what the
    # streamed optimizer leaves it: the weights and their gradients, no fp32 state.
    host_cpu = config.optimizer.update_on == "host_cpu" and not knobs.optimizer_offload
    if knobs.optimizer_offload or host_cpu:
        add("params", weights.params, "persistent")
        add("grads", weights.params, "persistent")
    else:
        adamw = device_adamw_module.on_device_adamw_memory_terms(weights.param_count,
                                                                 model.dtype)
        add_all("", adamw, "persistent", {**device_adamw_module.MEMORY_FORMULAS,
                                           "params": MEMORY_FORMULAS["params"],
                                           "grads": MEMORY_FORMULAS["grads"]})
    add("router_bias", 2 * weights.extras, "persistent")
    add("batch", 4 * n * 4, "persistent")

    # Boundaries and each stack's layer terms (SCO's bound, one stack at a time).
    stacks = []
    if num_dense:
        stacks.append(("dense", knobs.offload[:num_dense], 2 * n * 4))
    if num_moe:
        stacks.append(("moe", knobs.offload[num_dense:], 2 * n * 4 + num_moe * model.num_experts
                       * 4))
    kept, integer = {}, 0
    layer_sets = {}
    for kind, offload, integer_bytes in stacks:
        sco = sco_module.sco_memory_terms(len(offload), sum(offload), boundary,
                                          weights.layer_shard[kind], 0, integer_bytes)
        kept[kind] = sco["kept_boundaries"]
        integer += sco["integer_leaves"]
        layer_sets[kind] = {key: sco[key] for key in ("restored_boundaries", "carry_cotangents",
                                                      "layer_parameters")}
    loop = config.operators.layer_loop
    loop = auto_layer_loop(knobs, platform) if loop == "auto" else loop

    # One layer's recompute and backward: the dense or the MoE layer, whichever holds more
    # with the boundaries still live in its backward (unrolled, a dense layer's backward comes
    # after every MoE layer's has freed its boundary: only the dense stack's are left).
    layer, at_layer, first_forward = _layer_terms(config, knobs, platform, weights,
                                                  layer_sets, kept, loop == "unrolled",
                                                  standard_step)
    if sum(kept.values()) > at_layer:
        add("kept_boundaries", at_layer, "boundaries",
            MEMORY_FORMULAS["kept_boundaries.dense_stack"])
        add("kept_boundaries.moe_stack", sum(kept.values()) - at_layer, "boundaries.later")
    else:
        add("kept_boundaries", at_layer, "boundaries",
            sco_module.MEMORY_FORMULAS["kept_boundaries"])
    add("integer_leaves", integer, "boundaries", sco_module.MEMORY_FORMULAS["integer_leaves"])
    for name, value, live, formula in layer:
        add(name, value, live, formula)
    # Scanned, the overlapped step assembles the MoE stack's new weights before its loop
    # (which takes them stacked), beside the embedding and the dense layers' forward: those
    # are counted there (overlap.forward), not beside the backward. The staged buckets' tail
    # and a write-back deferred to the backward outlive that forward: they stay in "overlap".
    scanned_overlap = (platform == "gpu" and knobs.optimizer_overlap and knobs.optimizer_offload
                       and loop == "scan")
    new_weights_live = "overlap.forward" if scanned_overlap else "overlap"
    if scanned_overlap:
        add("forward.dense_layer", first_forward, "forward", MEMORY_FORMULAS["forward.dense_layer"])

    # The loss.
    add("final_hidden", 3 * n * h * 4, "loss")
    if knobs.loss == "ring":
        try:
            # The model takes the mean over the valid tokens (the reduced form).
            ring = ring_module.ring_cross_entropy_memory_terms(
                n, h, shard_width, width, vocab_block=knobs.vocab_block, mode=knobs.loss_mode,
                hidden_dtype=model.dtype, kernel_dtype=model.dtype, reduction="mean",
                vocab_size=model.vocab_size)
        except ValueError as error:
            raise ConfigError(f"operators.loss_mode / vocab_block: {error}") from None
        add_all("loss.", ring, "loss", ring_module.MEMORY_FORMULAS)
    else:
        materialized = ring_module.materialized_memory_terms(
            n, h, shard_width, width, vocab_size=model.vocab_size, kernel_dtype=model.dtype)
        add_all("loss.", materialized, "loss", ring_module.MATERIALIZED_MEMORY_FORMULAS)

    # The embedding.
    add("embedding_table", weights.embedding_whole, "embedding")
    add("embedding_gradient", weights.embedding_whole, "backward")

    # The optimizer.
    if knobs.optimizer_offload:
        resident = resident_param_count(model, width, knobs.resident_groups)
        step = offload_module.offload_stream_adamw_memory_terms(
            weights.param_count, knobs.bucket_params, knobs.slots, model.dtype, resident)
        resident_state = step.pop("resident_state")
        add_all("optimizer_step.", step, "optimizer_step", offload_module.MEMORY_FORMULAS)
        if resident:
            add("optimizer.resident_state", resident_state, "persistent",
                offload_module.MEMORY_FORMULAS["resident_state"])
            # The optimizer's own program takes it in and gives it back (donated): XLA:GPU's
            # plan of h200-1's at 524,288 with 4 of 8 groups resident had 25.56 GiB of
            # arguments, the resident state's 14.55 among them.
            add("optimizer_step.resident_state", resident_state, "optimizer_step",
                offload_module.MEMORY_FORMULAS["resident_state"])
        add("optimizer_step.router_bias", 2 * weights.extras, "optimizer_step",
            MEMORY_FORMULAS["router_bias"])
        add("optimizer_step.batch", 4 * n * 4, "optimizer_step", MEMORY_FORMULAS["batch"])
        if platform == "gpu":
            add("optimizer_step.bucketed_params_gpu", weights.param_count * itemsize,
                "optimizer_step")
        add("host.optimizer_state",
            offload_module.offload_stream_adamw_host_bytes(weights.param_count, resident),
            "host", "12 * (P - P_r): fp32 master, mu and nu of the streamed groups "
            "(offload_stream_adamw_host_bytes)")
        if knobs.optimizer_overlap and config.operators.optimizer_writeback == "backward":
            bucket = min(knobs.bucket_params, weights.param_count)
            add("overlap.deferred_writeback",
                offload_module.offload_stream_adamw_host_bytes(weights.param_count, resident)
                + 12 * bucket, "overlap",
                "12 * (P - P_r) + 12 * min(beta, P): every streamed bucket's new fp32 master, "
                "mu and nu, held on the device from its update until the forward's loss "
                "(written back under the backward), and one bucket's fp32 gradient and "
                "XLA:GPU's excess (not measured)")
        elif knobs.optimizer_overlap:
            # XLA:CPU updates the donated host buffers in place: nothing is staged there
            # (tests/test_optim_memory.py measured it).
            staged = step["staging"] + step["staging_gpu_excess"] if platform == "gpu" else 0
            add("overlap.staging", staged, "overlap",
                "the optimizer step's staging terms (above), now inside the step's program; 0 "
                "on CPU, where XLA updates in place")
        if knobs.optimizer_overlap and platform == "gpu":
            # Unrolled, each MoE layer's new weights are written into the donated stacks as
            # they are made (sco.MadeInLoop's ``into``): the parameters' own bytes, measured on
            # one GPU where a group streams. Every group resident (nothing streamed: no host
            # copy ties a layer's update to its place in the forward), XLA:GPU's peak was the
            # older program's (h200-1 all resident: 62.67 GiB at 64K, 125.95 at 592,826,
            # where this form plans 57.21 and 123.38). Scanned, with devices to shard over
            # (unmeasured) or every group resident, the older count.
            all_resident = knobs.resident_groups >= optimizer_groups(model)
            if scanned_overlap or width > 1 or all_resident:
                add("overlap.moe_layer_weights", weights.params
                    + max(num_moe - 1, 0) * weights.layer_shard["moe"], new_weights_live,
                    MEMORY_FORMULAS["overlap.moe_layer_weights_gpu"])
            else:
                add("overlap.new_weights",
                    weights.params - max(num_moe - 1, 0) * weights.layer_shard["moe"], "overlap",
                    MEMORY_FORMULAS["overlap.new_weights_gpu"])
            add("overlap.packing", 3 * n * h * itemsize, "overlap",
                MEMORY_FORMULAS["overlap.packing_gpu"])
        elif knobs.optimizer_overlap:
            add("overlap.moe_layer_weights", 2 * num_moe * weights.layer_shard["moe"], "overlap")
    elif host_cpu:
        add("optimizer_update", 0, "update", MEMORY_FORMULAS["optimizer_update_host_cpu"])
        host = host_cpu_module.host_cpu_adamw_host_terms(
            weights.param_count, model.dtype, largest_leaf=weights.largest_leaf,
            num_devices=width, clipped=config.optimizer.max_grad_norm is not None,
            platform=platform)
        add_all("host.", host, "host", host_cpu_module.MEMORY_FORMULAS)
    elif platform == "gpu":
        # XLA:GPU fuses AdamW into elementwise loops over the donated state: h200-1's whole
        # train step at 16K tokens held 8.85 GiB of temporaries in all, where one fp32 copy of
        # its gradients is 11 GiB (scripts/results/h200_1_plan_check_gpu_20261201-141839.json).
        add("optimizer_update", 0, "update", MEMORY_FORMULAS["optimizer_update_gpu"])
    else:
        add("optimizer_update", 2 * weights.param_count * 4, "update")
    offloaded = sco_module.sco_host_bytes(knobs.num_offloaded, boundary)
    add("host.offloaded_boundaries", offloaded, "host", "n_offloaded * C (sco_host_bytes)")
    add("host.data_pipeline", _pipeline_bytes(config, knobs), "host",
        MEMORY_FORMULAS["data_pipeline"])
    if platform == "gpu":
        pinned = pinned_allocations(knobs, terms)
        growth = _pool_growth(config, pinned)
        pool = sum(pinned) + growth if growth != POOL_EXHAUSTED else 0
        add("host.runtime_gpu", host_pool.runtime_gpu_bytes(loop, pool), "host",
            MEMORY_FORMULAS["runtime_gpu"])
        add("host.pinned_pool_growth", growth, "host", MEMORY_FORMULAS["pinned_pool_growth"])
        add("host.pinned_outside_process", host_pool.outside_process_bytes(pool), "host",
            MEMORY_FORMULAS["pinned_outside_process"])
    return terms


POOL_EXHAUSTED = 2**60
"""``host.pinned_pool_growth`` where the pool's limit comes first: more than any host has."""


PINNED_TERMS = ("host.optimizer_state", "host.offloaded_boundaries")
"""The host terms held in pinned_host memory (XLA's pinned-host pool on a GPU)."""


def pinned_allocations(knobs: Knobs, terms) -> list[int]:
    """The pinned_host arrays behind ``terms``' ``PINNED_TERMS``, in the order they are made:
    the streamed optimizer's state (made first) as three fp32 arrays (master, mu, nu) per
    bucket of ``bucket_params``, then the offloaded boundaries (one block of the program's host
    temporaries)."""
    named = {t.name: t.bytes for t in terms}
    state, boundaries = (named.get(name, 0) for name in PINNED_TERMS)
    full, rest = divmod(state, 12 * knobs.bucket_params)
    sizes = [4 * knobs.bucket_params] * (3 * full) + [rest // 3] * (3 if rest else 0)
    return sizes + ([boundaries] if boundaries else [])


def pool_limit(config: Config, pinned: list[int]) -> int:
    """The pinned-host pool's limit, in bytes: the environment's where it is set, else the cap
    a run of this config sets (``host_pool.planned_cap_gib``: from its own pinned arrays,
    ``pinned``), else XLA's own."""
    if (limit := host_pool.set_limit_gib()) is not None:
        return limit * host_pool.GIB
    if host_pool.planned_cap_applies(config):
        return host_pool.planned_limit_gib(pinned) * host_pool.GIB
    return host_pool.XLA_DEFAULT_LIMIT_GIB * host_pool.GIB


def _pool_growth(config: Config, pinned: list[int]) -> int:
    """The pool's bytes beyond the live ones; where the limit is reached first, more than any
    host has (the run cannot allocate its state: ``device.pinned_host_pool: planned``)."""
    try:
        return host_pool.pool_bytes(pinned, pool_limit(config, pinned)) - sum(pinned)
    except MemoryError:
        return POOL_EXHAUSTED


def _layer_terms(config: Config, knobs: Knobs, platform: str, weights: WeightBytes,
                 layer_sets: dict, kept_by_stack: dict, unrolled: bool,
                 standard_step: bool = False
                 ) -> tuple[list[tuple[str, int, str, str]], int, int]:
    """(name, bytes, live, formula) of the largest layer's recompute and backward, the kept
    boundaries live in its backward, and the dense layer's forward on a GPU
    (``_first_layer_forward``; else 0). ``kept_by_stack``: each stack's kept boundaries.
    Scanned, every one is live in every layer's backward; ``unrolled``, a layer's backward
    has its own stack's and those before it (the dense layers come first and are
    differentiated last), so the largest layer is the one whose phase and those boundaries
    are the most. Within the
    layer, the attention's backward and the FFN's (or MoE's) are sub-phases of their own beside
    what the whole layer holds (its saved activations and weights); what one sub-phase keeps
    through the other is a term of that other (on a GPU, ``ffn.under_attention``: the dense
    FFN's buffers that XLA:GPU keeps through the attention's backward where memory allows).
    ``standard_step``: the standard stack's step as XLA:GPU holds it (``plan_terms``)."""
    model = config.model
    itemsize = jnp.dtype(model.dtype).itemsize
    n, h = knobs.tokens_per_device, model.hidden
    hq, d = model.num_heads, model.head_dim
    hkv = model.num_kv_heads if model.num_kv_heads % knobs.seq == 0 else hq
    scores = n * hq * knobs.context  # one [B_l, Hq / seq, T, T] array's elements
    xla = knobs.attention == "xla"
    runs = packed_attention_runs(config)
    sco_formulas = sco_module.MEMORY_FORMULAS
    if platform == "gpu":
        # XLA:GPU's buffer assignment (h200-1 at 64K and 256K, docs/plan.md): two [N, H]
        # buffers of the layer in the model's dtype beside the carried cotangent, and the
        # attention's q, O, dQ and k, v, dK, dV (two of the last four GQA-expanded).
        stream = ("residual_stream", 2 * n * h * itemsize, "layer",
                  MEMORY_FORMULAS["residual_stream_gpu"])
        activations = ("attention.activations", n * d * itemsize * (3 * hq + 4 * hkv), "layer",
                       MEMORY_FORMULAS["attention.activations_gpu"])
    else:
        stream = ("residual_stream", 6 * n * h * 4, "layer", MEMORY_FORMULAS["residual_stream"])
        activations = ("attention.activations", 3 * n * (2 * hq + 2 * hkv) * d * itemsize,
                       "layer", MEMORY_FORMULAS["attention.activations"])
    attention = [
        stream, activations,
        ("attention.saved", 4 * scores if xla else 4 * runs * n * hq, "layer",
         MEMORY_FORMULAS["attention.saved"]),
        ("attention.backward", (8 + itemsize) * scores if xla
         else cudnn_backward_workspace(runs, n, hq, d), "layer/attention",
         MEMORY_FORMULAS["attention.backward"]),
    ]
    candidates = []
    first_forward = 0
    for kind, sco in layer_sets.items():
        terms = [(key, value, "layer", sco_formulas[key]) for key, value in sco.items()]
        terms.append(("gathered_weights", 2 * weights.layer_whole_dense[kind], "layer",
                      MEMORY_FORMULAS["gathered_weights"]))
        terms += attention
        if kind == "dense" and platform == "gpu":
            # XLA:GPU's buffer assignment (h200-1 at 64K and 256K, docs/plan.md): at most five
            # bf16 [N, F_d] buffers, four of them live under the attention's backward where
            # XLA:GPU computes the FFN's weight gradients last. None where SCO offloads a
            # boundary: the FFN's backward then hands out its input's cotangent only with its
            # weight gradients (model.layers.weight_gradients_first); none in the standard
            # stack's step as measured (plan.programs.step_terms takes the term out there).
            ffn = n * model.dense_ffn * itemsize
            terms.append(("ffn", 5 * ffn, "layer/ffn", MEMORY_FORMULAS["ffn_gpu"]))
            if not any(knobs.offload) and not standard_step:
                terms.append(("ffn.under_attention", 4 * ffn, "layer/attention",
                              MEMORY_FORMULAS["ffn.under_attention"]))
        elif kind == "dense":
            terms.append(("ffn", 6 * n * model.dense_ffn * 4, "layer/ffn",
                          MEMORY_FORMULAS["ffn"]))
        else:
            terms.append(("router", 4 * n * model.num_experts * 4, "layer/ffn",
                          MEMORY_FORMULAS["router"]))
            terms.append(("shared_expert", 6 * n * model.shared_expert_ffn * 4, "layer/ffn",
                          MEMORY_FORMULAS["shared_expert"]))
            moe, formulas = _moe_terms(config, knobs, platform)
            if (platform == "gpu" and knobs.moe_dispatch == "ep" and not moe["weight_sum"]
                    and knobs.num_devices == 1):
                # One chunk on the Mosaic path, one device: XLA:GPU fuses the backward's row
                # copies (its buffer assignments of h200-1's EP step at 64K and 256K,
                # docs/plan.md). With devices to exchange with, the send buckets and arrivals
                # are real and unmeasured: the operator's terms stay.
                rows = model.top_k * n  # M on one device
                if standard_step:
                    # XLA:GPU's buffer assignments of h200-1 all off at 65,536-621,208 tokens
                    # (scripts/results/xla_gpu_live_ranges_h200-1_off443k_20261202.tgz and
                    # the two h100_as_h200 archives of 2026-12-05, docs/plan.md) hold at most
                    # 2 [M, H] (3 at one fusion at 64 segments, under the FFN phase's total)
                    # and 3 [M, F] at any step, and the peak is a MoE layer's attention
                    # backward, through which they hold at most the buffers of
                    # held_through_attention. Measured with V' = 260: for a real
                    # vocabulary N V' 4 would be most of the step, measured nowhere.
                    shard_vocab = (mop.padded_vocab(model.vocab_size, knobs.num_devices)
                                   // knobs.num_devices)
                    moe["dispatch"] = 2 * rows * h * itemsize
                    moe["expert_ffn"] = 3 * rows * model.expert_ffn * itemsize
                    formulas = {**formulas,
                                "dispatch": MEMORY_FORMULAS["moe.dispatch_gpu_standard"],
                                "expert_ffn": MEMORY_FORMULAS["moe.expert_ffn_gpu_standard"]}
                    terms.append(("held_through_attention",
                                  2 * n * h * itemsize + n * shard_vocab * 4 + n * d * 4,
                                  "layer", MEMORY_FORMULAS["held_through_attention"]))
                else:
                    moe["dispatch"] = 4 * rows * h * itemsize
                    moe["expert_ffn"] = 4 * rows * model.expert_ffn * itemsize
                    formulas = {**formulas, "dispatch": MEMORY_FORMULAS["moe.dispatch_gpu"],
                                "expert_ffn": MEMORY_FORMULAS["moe.expert_ffn_gpu"]}
            if (platform == "gpu" and knobs.moe_dispatch == "pipelined" and unrolled
                    and knobs.num_devices == 1 and moe["weight_sum"]
                    and planned_path(platform, model.dtype, model.dtype, h,
                                     model.expert_ffn) == "mosaic"):
                # In chunks (weight_sum: their fp32 sum) on the Mosaic path, one device:
                # XLA:GPU holds four [M, H] where the operator's terms (measured on CPU) count
                # nine; the six [M, F] it holds too. With devices to exchange with, or on
                # another path, the operator's terms stay (unmeasured).
                rows = chunk_rows(num_tokens=n, top_k=model.top_k, num_devices=1,
                                  token_budget=knobs.token_budget, max_chunks=knobs.max_chunks)
                moe["dispatch"] = 4 * rows * h * itemsize
                formulas = {**formulas,
                            "dispatch": MEMORY_FORMULAS["moe.dispatch_gpu_pipelined"]}
            terms += [(f"moe.{key}", value, "layer/ffn", formulas[key])
                      for key, value in moe.items()]
        if kind == "dense" and platform == "gpu":
            first_forward = _first_layer_forward(terms, n * model.dense_ffn * itemsize)
        live_boundaries = (kept_by_stack.get("dense", 0) if unrolled and kind == "dense"
                           else sum(kept_by_stack.values()))
        candidates.append((phase_total(terms, "layer") + live_boundaries, live_boundaries,
                           kind, terms))
    if not candidates:
        return [], sum(kept_by_stack.values()), 0
    _, live_boundaries, kind, terms = max(candidates, key=lambda c: c[0])
    return ([(name, value, live, f"[{kind} layer] {formula}")
             for name, value, live, formula in terms], live_boundaries, first_forward)


def _first_layer_forward(terms: list[tuple[str, int, str, str]], dense_ffn: int) -> int:
    """The dense layer's forward on a GPU (its terms as ``_layer_terms`` gives them): what the
    whole layer holds but the carried cotangent, and the FFN's gate, up and product (three
    ``[N, F_d]``, ``dense_ffn`` bytes each: h200-e2e's buffer assignment at 540,672 holds the
    three at its peak)."""
    own = sum(value for name, value, live, _ in terms
              if live == "layer" and name != "carry_cotangents")
    return own + 3 * dense_ffn


# What XLA:GPU's buffer assignment gave cuDNN's attention backward beyond the R-fold arrays
# (h200-1, jax 0.11.2, 2026-12-01): the graph's fixed scratch, the forward's whole workspace.
CUDNN_FIXED_SCRATCH = 17_152


def auto_layer_loop(knobs: Knobs, platform: str) -> str:
    """What ``operators.layer_loop: auto`` resolves to (``plan.operators.choose_layer_loop``
    says why): ``unrolled`` where the offloaded optimizer's stream overlaps the forward on a
    GPU (the scanned stack, each MoE layer's update made in the loop iteration before it, is
    bit for bit the same and compiles flat with depth; it replaces the unrolled one there once
    its GPU step is measured no slower), else ``scan``."""
    return "unrolled" if knobs.optimizer_overlap and platform == "gpu" else "scan"


def packed_attention_runs(config: Config) -> int:
    """R, the runs cuDNN's packed layout sizes its arrays for: the data's segment cap plus the
    padding run (``attention.segment_runs``), or 1 where a sequence is one document (synthetic
    data, or ``data.max_segments: 1``), which takes the unpacked kernel (``runtime_for``)."""
    segments = 1 if config.data.source == "synthetic" else config.data.max_segments
    return 1 if segments == 1 else segments + 1


def cudnn_backward_workspace(runs: int, tokens: int, heads: int, head_dim: int) -> int:
    """Bytes of cuDNN flash attention's backward workspace for ``tokens`` per device over
    ``heads`` query heads (``attention.backward``'s cudnn formula). cuDNN sizes its fp32 dQ
    accumulator (4 D), full-head dK and dV (2 D each: GQA's kv heads expanded to the query
    heads) and fp32 softmax sums (4) for every one of the R packed runs as if each ran the
    whole sequence: R-fold what the tokens need. Measured on an H200: h200-1 at 65,536 tokens,
    16 heads of 128, R = 65 gave u8[70,065,865,472], this formula to the byte. At R = 1 (the
    unpacked kernel) the formula is the same graph's, not measured."""
    return runs * tokens * heads * (8 * head_dim + 4) + CUDNN_FIXED_SCRATCH


def phase_total(terms, phase: str) -> int:
    """A phase's bytes: its own terms, plus the largest of its sub-phases (``phase/...``)."""
    own = sum(t[1] for t in terms if t[2] == phase)
    subs: dict[str, int] = {}
    for t in terms:
        if t[2].startswith(phase + "/"):
            subs[t[2]] = subs.get(t[2], 0) + t[1]
    return own + max(subs.values(), default=0)


def _moe_terms(config: Config, knobs: Knobs, platform: str) -> tuple[dict, dict]:
    """pf.pipelined_moe's terms for the configured dispatch (the operator's own function)."""
    from peakflat_jax.ops import pipelined_moe as moe_module

    model, llep = config.model, config.operators.llep
    common = dict(num_tokens=knobs.tokens_per_device, hidden=model.hidden,
                  ffn=model.expert_ffn, top_k=model.top_k, num_experts=model.num_experts,
                  num_devices=knobs.num_devices, dtype=model.dtype,
                  grouped_matmul=planned_path(platform, model.dtype, model.dtype,
                                              model.hidden, model.expert_ffn))
    if knobs.moe_dispatch == "ep":
        terms = moe_module.unchunked_moe_memory_terms(balance="none", **common)
    else:
        options = dict(max_foreign_experts=llep.max_foreign_experts,
                       llep_threshold=llep.threshold, llep_capacity=llep.capacity)
        if knobs.moe_dispatch == "llep":
            terms = moe_module.unchunked_moe_memory_terms(balance="llep", **options, **common)
        else:
            terms = moe_module.pipelined_moe_memory_terms(
                token_budget=knobs.token_budget, max_chunks=knobs.max_chunks, balance="llep",
                **options, **common)
    return terms, moe_module.MEMORY_FORMULAS


def baseline_knobs(knobs: Knobs) -> Knobs:
    """The same launch with the four operators off (``OperatorsConfig.all_off``): EP in one
    chunk, the materialized loss, no offload, the optimizer on the device."""
    return dataclasses.replace(knobs, moe_dispatch="ep", token_budget=None,
                               loss="materialized", offload=(False,) * len(knobs.offload),
                               optimizer_offload=False, optimizer_overlap=False,
                               resident_groups=0)


def _pipeline_bytes(config: Config, knobs: Knobs) -> int:
    from peakflat_jax.train.data import pipeline_host_bytes

    data = dataclasses.replace(config.data, seq_len=knobs.context, batch_size=knobs.batch_size)
    # Every process makes its rows; one device's share is its process's bytes / its devices.
    return pipeline_host_bytes(data) // knobs.num_devices
