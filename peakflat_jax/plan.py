"""The planner: the per-device memory of a training step in closed form, before anything is
compiled; whether it fits; the largest context that does; and the launch knobs chosen for you.

Algorithm. A step's peak is not the sum of everything it ever allocates: it is the largest of
its live sets (SPEC.md, Composition). The planner lists every term of every live set as bytes
per device, each with a one-line formula, and composes them as the step runs:

    gradient program = persistent + boundaries + backward + max(layer, loss, embedding[, update])
    overlapped program = gradient program + staging + the MoE layers' per-layer weights
    optimizer program = grads + working params + staging  (OffloadStreamAdamW's own program)
    device total = max(the programs the trainer compiles)

(the overlapped program, with ``operators.optimizer_overlap``, applies the last step's update
before each layer's forward; its first step and a flush run the other two).

* persistent: the weight shards and their gradients, the device optimizer's fp32 master and
  moments (or nothing, when OffloadStreamAdamW keeps them in host memory), the router bias, the
  batch;
* boundaries: the checkpoint boundaries SCO keeps on the device, and every layer's integer
  carry leaves (``sco_memory_terms``);
* layer: one layer's recompute and backward, the largest layer kind: the restored boundaries,
  carry cotangents and parameter slices (``sco_memory_terms``), the layer's dense weights
  gathered whole with their whole gradient, its activations (attention's saved probabilities
  with the XLA kernel), and then in turn attention's backward or the FFN's, or the router's and
  the MoE's (``pipelined_moe_memory_terms``, or the worst-case buffers of unchunked dispatch);
* loss: Ring-DTP's strips (``ring_cross_entropy_memory_terms``) or the materialized logits
  (``materialized_memory_terms``), with the hidden state around them;
* backward: the embedding's dense gradient, which XLA may allocate early;
* embedding: the table gathered whole for the lookup;
* update: the fused on-device AdamW's fp32 temporaries (``on_device_adamw_memory_terms`` gives
  its state);
* overlap: the staging of the update inside the step, and the MoE layers' updated weights taken
  per layer beside their stacked copy (XLA:CPU's peak held both);
* host: OffloadStreamAdamW's state (``offload_stream_adamw_host_bytes``), the offloaded
  boundaries (``sco_host_bytes``) and the data pipeline (``pipeline_host_bytes``).

Each operator's terms come from the operator's own function: one source of truth per bound.
The weights' bytes come from the model itself (its abstract shapes under ``model.sharding``'s
placement), so a replicated leaf is counted whole. ``plan_terms`` gives every term;
``MEMORY_FORMULAS`` the formulas of the planner's own (the operators' are in their modules).

On a CPU the memory kinds lower to nothing: a plan for ``platform="cpu"`` keeps the
"offloaded" boundaries on the device, as XLA:CPU does.

Choosing the knobs (``choose_knobs``). A knob left null in a config (``operators.token_budget``,
``operators.vocab_block``) is filled by the rule ``--auto`` uses for it: the fewest chunks, then
the largest vocab block, that fit (memory falls and time rises with chunks); with the device's
memory unknown (a CPU), the tightest setting the config allows. ``--auto`` re-chooses all of
them with the offloaded boundaries, the optimizer's placement, its bucket size and slots, and
the mesh's data x seq split: it estimates each candidate's step time from measured rates
(``Rates``: FLOP rates, the host link, the all-to-all, the optimizer's streaming, the cost of a
chunk) and takes the fastest that fits; to maximise the context (or, at a given context, the
sequences per step) it first takes every knob at its lightest and searches, then the fastest
knobs there. Remat is fixed: every layer is rematerialized from its boundary (the only policy
the model has).

Why it is shaped so: the same terms serve three callers (``peakflat plan``, the trainer's check
before compiling, and the end-to-end benchmark that holds measured peaks against the plan), so
the composition lives in one function, ``plan_terms``, and everything else (feasibility, the
largest context, the search) calls it. The search is a few thousand closed-form evaluations,
no compile.

Measured: docs/plan.md.

Legend: W devices (data x seq), B sequences per step, T context, N = B T / W tokens per device,
H hidden, L layers (L_d dense, L_m MoE), V vocab, V' = V padded to a multiple of W, Vs = V' / W,
Hq / Hkv query / kv heads (Hkv' = Hq where seq does not divide Hkv: the kv heads are repeated),
D head width, E experts, k top-k, F expert FFN, F_d dense FFN, F_s shared expert FFN, P
parameters on a device (its shards), D_l one layer's dense weights (whole), C = N H b one
boundary, b bytes of the model's dtype.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from peakflat_jax import mesh as mop
from peakflat_jax.config import Config, ConfigError, offload_count, to_dict
from peakflat_jax.model.attention import choose_implementation
from peakflat_jax.model.size import active_parameters_per_token
from peakflat_jax.ops import ring_cross_entropy as ring_module
from peakflat_jax.ops import sco as sco_module
from peakflat_jax.ops.sco import HostBudget
from peakflat_jax.optim import offload_adamw as offload_module
from peakflat_jax.optim import on_device_adamw as device_adamw_module
from peakflat_jax.train.data import causal_pairs_per_sequence

GIB = 2**30

# ----------------------------------------------------------------------------------------------
# Errors.


class PlanError(ValueError):
    """An argument the planner cannot plan for, named in the message."""


class DoesNotFit(RuntimeError):
    """A configuration whose step needs more device or host memory than there is; the message
    holds the table of terms and what to change."""


# ----------------------------------------------------------------------------------------------
# The planner's own terms (the operators' formulas are in their modules' MEMORY_FORMULAS).

MEMORY_FORMULAS: dict[str, str] = {
    "params": "P * b: this device's weight shards (FSDP dense, EP experts, vocab-split "
              "embedding and head; a leaf W divides nowhere is whole)",
    "grads": "P * b: their gradients, placed alike",
    "router_bias": "2 * L_m * E * 4: the router's balancing bias (fp32, replicated), in and out",
    "batch": "4 * N * 4: tokens, targets, positions, segment ids (int32)",
    "gathered_weights": "2 * D_l * b: the layer's dense weights all-gathered whole, and their "
                        "whole gradient before the reduce-scatter",
    "residual_stream": "6 * N * H * 4: the layer's norms (fp32 inside), the residual sums and "
                       "their cotangents",
    "attention.activations": "3 * N * (2 Hq + 2 Hkv') * D * b: q, k, v and the output in the "
                             "token and head layouts of the Ulysses exchange, and cotangents",
    "attention.saved": "xla: 4 * N * Hq * T, the fp32 probabilities [B_l, Hq / seq, T, T] "
                       "kept for the backward; cudnn: N * Hq * 4, the softmax statistics",
    "attention.backward": "xla: (4 + b) * N * Hq * T, the probabilities' gradient and the "
                          "logits' (fp32); cudnn: N * Hq * 4",
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
    "overlap.moe_layer_weights": "2 * P_m * b: the MoE layers' updated weights taken per layer and "
                                 "their stacked copy (the program's output) beside the stacked "
                                 "params; P_m the MoE stack's share of P",
    "data_pipeline": "pipeline_host_bytes / local devices: the batch being made",
}

LIVE_SETS = {
    "persistent": "the whole step",
    "boundaries": "from each layer's forward to its backward",
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
# Measured rates.


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
    layer_whole_dense: dict
    """Per stack: one layer's non-expert weights, whole, bytes (what the layer gathers)."""
    embedding_whole: int
    """The embedding table [V', H], whole, bytes."""


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
    count = param_bytes = embedding = 0
    shard = {"dense": 0, "moe": 0}
    whole = {"dense": 0, "moe": 0}
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        names = _names(path)
        spec = weight_spec(names, leaf.shape, num_devices)
        local = math.prod(_shard_shape(leaf.shape, spec, num_devices))
        itemsize = jnp.dtype(leaf.dtype).itemsize
        count += local
        param_bytes += local * itemsize
        if names == ("embedding",):
            embedding = math.prod(leaf.shape) * itemsize
        stack = stacks.get(names[0])
        if stack:
            shard[stack] += local * itemsize // layers[stack]
            if names[-2:-1] != ("moe",) or names[-1] not in ("w_gate", "w_up", "w_down"):
                whole[stack] += math.prod(leaf.shape) * itemsize // layers[stack]
    extra_bytes = sum(math.prod(leaf.shape) * jnp.dtype(leaf.dtype).itemsize
                      for leaf in jax.tree.leaves(extras))
    return WeightBytes(param_count=count, params=param_bytes, extras=extra_bytes,
                       layer_shard=shard, layer_whole_dense=whole, embedding_whole=embedding)


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
               operators_on: bool = True) -> list[Term]:
    """Every term of the step's per-device bound (device and host) for ``knobs``, with the
    operators as the knobs set them (``operators_on``) or all four off (the baseline: EP in one
    chunk, the materialized loss, no offload, the optimizer on the device)."""
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

    # Persistent state.
    if knobs.optimizer_offload:
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
    kept = integer = 0
    layer_sets = {}
    for kind, offload, integer_bytes in stacks:
        sco = sco_module.sco_memory_terms(len(offload), sum(offload), boundary,
                                          weights.layer_shard[kind], 0, integer_bytes)
        kept += sco["kept_boundaries"]
        integer += sco["integer_leaves"]
        layer_sets[kind] = {key: sco[key] for key in ("restored_boundaries", "carry_cotangents",
                                                      "layer_parameters")}
    add("kept_boundaries", kept, "boundaries", sco_module.MEMORY_FORMULAS["kept_boundaries"])
    add("integer_leaves", integer, "boundaries", sco_module.MEMORY_FORMULAS["integer_leaves"])

    # One layer's recompute and backward: the larger of the dense and the MoE layer.
    for name, value, live, formula in _layer_terms(config, knobs, platform, weights,
                                                   layer_sets):
        add(name, value, live, formula)

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
        step = offload_module.offload_stream_adamw_memory_terms(
            weights.param_count, knobs.bucket_params, knobs.slots, model.dtype)
        add_all("optimizer_step.", step, "optimizer_step", offload_module.MEMORY_FORMULAS)
        add("optimizer_step.router_bias", 2 * weights.extras, "optimizer_step",
            MEMORY_FORMULAS["router_bias"])
        add("optimizer_step.batch", 4 * n * 4, "optimizer_step", MEMORY_FORMULAS["batch"])
        add("host.optimizer_state",
            offload_module.offload_stream_adamw_host_bytes(weights.param_count), "host",
            "12 * P: fp32 master, mu and nu (offload_stream_adamw_host_bytes)")
        if knobs.optimizer_overlap:
            # XLA:CPU updates the donated host buffers in place: nothing is staged there
            # (tests/test_optim_memory.py measured it).
            staged = step["staging"] + step["staging_gpu_excess"] if platform == "gpu" else 0
            add("overlap.staging", staged, "overlap",
                "the optimizer step's staging terms (above), now inside the step's program; 0 "
                "on CPU, where XLA updates in place")
            add("overlap.moe_layer_weights", 2 * num_moe * weights.layer_shard["moe"], "overlap")
    else:
        add("optimizer_update", 2 * weights.param_count * 4, "update")
    add("host.offloaded_boundaries", sco_module.sco_host_bytes(knobs.num_offloaded, boundary),
        "host", "n_offloaded * C (sco_host_bytes)")
    add("host.data_pipeline", _pipeline_bytes(config, knobs), "host",
        MEMORY_FORMULAS["data_pipeline"])
    return terms


def _layer_terms(config: Config, knobs: Knobs, platform: str, weights: WeightBytes,
                 layer_sets: dict) -> list[tuple[str, int, str, str]]:
    """(name, bytes, live, formula) of the largest layer's recompute and backward. Within the
    layer, the attention's backward and the FFN's (or MoE's) never overlap: each is its own
    sub-phase beside what the whole layer holds (its saved activations and weights)."""
    model = config.model
    itemsize = jnp.dtype(model.dtype).itemsize
    n, h = knobs.tokens_per_device, model.hidden
    hq, d = model.num_heads, model.head_dim
    hkv = model.num_kv_heads if model.num_kv_heads % knobs.seq == 0 else hq
    scores = n * hq * knobs.context  # one [B_l, Hq / seq, T, T] array's elements
    xla = knobs.attention == "xla"
    sco_formulas = sco_module.MEMORY_FORMULAS
    attention = [
        ("residual_stream", 6 * n * h * 4, "layer"),
        ("attention.activations", 3 * n * (2 * hq + 2 * hkv) * d * itemsize, "layer"),
        ("attention.saved", 4 * scores if xla else 4 * n * hq, "layer"),
        ("attention.backward", (4 + itemsize) * scores if xla else 4 * n * hq,
         "layer/attention"),
    ]
    candidates = []
    for kind, sco in layer_sets.items():
        terms = [(key, value, "layer", sco_formulas[key]) for key, value in sco.items()]
        terms.append(("gathered_weights", 2 * weights.layer_whole_dense[kind], "layer",
                      MEMORY_FORMULAS["gathered_weights"]))
        terms += [(name, value, live, MEMORY_FORMULAS[name]) for name, value, live in attention]
        if kind == "dense":
            terms.append(("ffn", 6 * n * model.dense_ffn * 4, "layer/ffn",
                          MEMORY_FORMULAS["ffn"]))
        else:
            terms.append(("router", 4 * n * model.num_experts * 4, "layer/ffn",
                          MEMORY_FORMULAS["router"]))
            terms.append(("shared_expert", 6 * n * model.shared_expert_ffn * 4, "layer/ffn",
                          MEMORY_FORMULAS["shared_expert"]))
            moe, formulas = _moe_terms(config, knobs, platform)
            terms += [(f"moe.{key}", value, "layer/ffn", formulas[key])
                      for key, value in moe.items()]
        candidates.append((_phase_total(terms, "layer"), kind, terms))
    if not candidates:
        return []
    _, kind, terms = max(candidates, key=lambda c: c[0])
    return [(name, value, live, f"[{kind} layer] {formula}")
            for name, value, live, formula in terms]


def _phase_total(terms, phase: str) -> int:
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
                  grouped_matmul="mosaic" if platform == "gpu" else "xla")
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
                               optimizer_offload=False, optimizer_overlap=False)


def _pipeline_bytes(config: Config, knobs: Knobs) -> int:
    from peakflat_jax.train.data import pipeline_host_bytes

    data = dataclasses.replace(config.data, seq_len=knobs.context, batch_size=knobs.batch_size)
    # Every process makes its rows; one device's share is its process's bytes / its devices.
    return pipeline_host_bytes(data) // knobs.num_devices


# ----------------------------------------------------------------------------------------------
# Composing the terms.


def program_bytes(terms: Sequence[Term]) -> dict[str, int]:
    """The device bytes of each program at its peak: ``gradient`` (or the fused step) =
    persistent + boundaries + backward + the largest phase; ``overlapped`` (the gradient
    program's terms and the overlap's, the staging counted beside every phase: an upper bound,
    as the updates run during the forward); ``optimizer_step`` (when present)."""
    by_live: dict[str, int] = {}
    for term in terms:
        by_live[term.live] = by_live.get(term.live, 0) + term.bytes
    phases = phase_bytes(terms)
    programs = {"gradient": by_live.get("persistent", 0) + by_live.get("boundaries", 0)
                + by_live.get("backward", 0) + max(phases.values())}
    if "overlap" in by_live:
        programs["overlapped"] = programs["gradient"] + by_live["overlap"]
    if "optimizer_step" in by_live:
        programs["optimizer_step"] = by_live["optimizer_step"]
    return programs


def phase_bytes(terms: Sequence[Term]) -> dict[str, int]:
    """Each phase's bytes (its sub-phases, ``layer/attention`` and ``layer/ffn``, take
    turns)."""
    rows = [(t.name, t.bytes, t.live) for t in terms]
    return {phase: _phase_total(rows, phase) for phase in PHASES}


@dataclasses.dataclass(frozen=True)
class Choice:
    """A knob's value and the rule that chose it."""

    key: str
    value: Any
    why: str


@dataclasses.dataclass(frozen=True)
class Plan:
    """The plan of one configuration (module doc): terms, totals, feasibility."""

    config: Config
    knobs: Knobs
    platform: str
    terms: tuple[Term, ...]
    device_memory: int | None
    host_memory: int | None
    operators_on: bool = True
    choices: tuple[Choice, ...] = ()
    baseline: Plan | None = None
    largest_context: int | None = None
    step_seconds: float | None = None

    @property
    def programs(self) -> dict[str, int]:
        return program_bytes(self.terms)

    @property
    def total_bytes(self) -> int:
        """The device bytes at the step's peak: the larger program."""
        return max(self.programs.values())

    @property
    def host_bytes(self) -> int:
        return sum(t.bytes for t in self.terms if t.live == "host")

    @property
    def phases(self) -> dict[str, int]:
        return phase_bytes(self.terms)

    @property
    def peak_phase(self) -> str:
        phases = self.phases
        return max(phases, key=phases.get)

    @property
    def fits_device(self) -> bool | None:
        return None if self.device_memory is None else self.total_bytes <= self.device_memory

    @property
    def fits_host(self) -> bool | None:
        return None if self.host_memory is None else self.host_bytes <= self.host_memory

    @property
    def feasible(self) -> bool | None:
        """Whether the step fits both memories; None when the device's memory is unknown."""
        if self.fits_device is None:
            return None
        return bool(self.fits_device and self.fits_host is not False)

    def device_terms(self) -> dict[str, int]:
        return {t.name: t.bytes for t in self.terms if t.live != "host"}

    def host_terms(self) -> dict[str, int]:
        return {t.name: t.bytes for t in self.terms if t.live == "host"}

    def reasons(self) -> list[str]:
        """Why it does not fit, and what to change (empty when it fits)."""
        return _reasons(self)

    def filled_config(self) -> Config:
        """The config with the plan's knobs (null ones filled, or all chosen with --auto):
        what to run. The attention kernel stays as configured (the trainer resolves it)."""
        sections: dict[str, dict] = {}
        for key, value in self.knobs.as_config().items():
            if key == "operators.attention":
                continue
            section, field = key.split(".")
            sections.setdefault(section, {})[field] = value
        return self.config.replace(**sections)


def _fits(config: Config, knobs: Knobs, platform: str, device_memory: int | None,
          host_memory: int | None) -> bool:
    terms = plan_terms(config, knobs, platform=platform)
    device = max(program_bytes(terms).values())
    host = sum(t.bytes for t in terms if t.live == "host")
    return ((device_memory is None or device <= device_memory)
            and (host_memory is None or host <= host_memory))


# ----------------------------------------------------------------------------------------------
# The knobs: from the config, nulls filled, or all chosen (--auto).


def knobs_from_config(config: Config, num_devices: int, *, context: int | None = None,
                      batch_size: int | None = None, platform: str = "gpu") -> Knobs:
    """The config's knobs on ``num_devices`` devices (nulls not yet filled); raises PlanError
    or ConfigError naming what does not divide."""
    ops, model = config.operators, config.model
    num_devices = _positive("devices", num_devices)
    context = _positive("context", config.data.seq_len if context is None else context)
    batch_size = _positive("batch_size", config.data.batch_size if batch_size is None
                           else batch_size)
    data, seq = mop.mesh_shape(config.mesh, num_devices)
    _check_divides(config, data, seq, context, batch_size)
    try:
        attention = choose_implementation(ops.attention, platform, model.dtype)
    except ValueError as error:
        raise ConfigError(f"operators.attention: {error}") from None
    knobs = Knobs(data=data, seq=seq, batch_size=batch_size, context=context,
                  moe_dispatch=ops.moe_dispatch, token_budget=ops.token_budget,
                  max_chunks=ops.max_chunks, loss=ops.loss, loss_mode=ops.loss_mode,
                  vocab_block=ops.vocab_block, offload=(False,) * model.num_layers,
                  optimizer_offload=ops.optimizer_offload,
                  optimizer_overlap=(ops.optimizer_offload and ops.optimizer_overlap
                                     and model.num_layers > model.num_dense_layers),
                  bucket_params=config.optimizer.bucket_params, slots=config.optimizer.slots,
                  attention=attention)
    return dataclasses.replace(knobs, offload=offload_flags(config, knobs.tokens_per_device))


def offload_flags(config: Config, tokens_per_device: int) -> tuple[bool, ...]:
    """``operators.offload`` as L bools: a host budget (GiB per device) takes as many leading
    boundaries as it holds, N * H * b each."""
    chosen = offload_count(config)
    layers = config.model.num_layers
    if isinstance(chosen, HostBudget):
        boundary = tokens_per_device * config.model.hidden * jnp.dtype(
            config.model.dtype).itemsize
        count = min(layers, chosen.bytes // boundary)
        return tuple(i < count for i in range(layers))
    if isinstance(chosen, tuple):
        return chosen
    return tuple(i < chosen for i in range(layers))


def _positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PlanError(f"{name}: expected a positive integer, got {value!r}")
    return value


def _check_divides(config: Config, data: int, seq: int, context: int, batch_size: int):
    model, width = config.model, data * seq
    if batch_size % data:
        raise PlanError(f"batch size: {batch_size} sequences do not split over mesh.data = "
                        f"{data}")
    if context % seq:
        raise PlanError(f"context: {context} tokens do not split over mesh.seq = {seq} "
                        f"(each device holds context / seq tokens of a sequence)")
    if model.num_heads % seq:
        raise PlanError(f"model.num_heads: {model.num_heads} heads do not split over mesh.seq "
                        f"= {seq} (Ulysses attention gives each device num_heads / seq heads)")
    if model.num_experts % width:
        raise PlanError(f"model.num_experts: {model.num_experts} experts do not split over the "
                        f"{width} devices (expert parallelism over all of them)")


def choose_knobs(config: Config, knobs: Knobs, platform: str, device_memory: int | None,
                 host_memory: int | None, *, auto: bool,
                 rates: Rates = Rates()) -> tuple[Knobs, list[Choice]]:
    """The knobs with nulls (every knob, with ``auto``) chosen: the fastest estimated setting
    that fits; with the device's memory unknown, the lightest setting the config allows."""
    ops, model = config.operators, config.model
    choices: list[Choice] = []
    n = knobs.tokens_per_device
    pipelined = knobs.moe_dispatch == "pipelined" and model.num_layers > model.num_dense_layers
    ring = knobs.loss == "ring"
    choose_budget = pipelined and (auto or ops.token_budget is None)
    choose_block = ring and (auto or ops.vocab_block is None)
    chunk_options = _chunk_options(n, knobs.max_chunks, auto) if choose_budget else [None]
    block_options = _block_options(config, knobs) if choose_block else [knobs.vocab_block]
    offload_options = (list(range(model.num_layers + 1)) if auto else [knobs.num_offloaded])
    has_moe = model.num_layers > model.num_dense_layers
    optimizer_options = ([(False, False), (True, False)] + ([(True, True)] if has_moe else [])
                         if auto else [(knobs.optimizer_offload, knobs.optimizer_overlap)])

    def with_chunks(k: Knobs, chunks):
        if chunks is None:
            return k
        return dataclasses.replace(k, token_budget=-(-n // chunks),
                                   max_chunks=max(chunks, k.max_chunks if not auto else chunks))

    def with_offload(k: Knobs, count):
        if not auto:
            return k
        return dataclasses.replace(k, offload=tuple(i < count for i in range(model.num_layers)))

    def buckets_for(k: Knobs) -> list[Knobs]:
        """With auto and the optimizer offloaded: the measured fastest bucket, then halves of
        it down to 1e6 parameters, two slots each; else the config's."""
        if not (auto and k.optimizer_offload):
            return [k]
        bucket, options = rates.optimizer_bucket_params, []
        while True:
            options.append(dataclasses.replace(k, bucket_params=bucket, slots=2))
            if bucket <= 1_000_000:
                return options
            bucket //= 2

    def bucket_for(k: Knobs) -> Knobs:
        return buckets_for(k)[-1 if device_memory is None else 0]

    if device_memory is None:  # nothing to fit: the lightest setting allowed
        lightest = with_offload(knobs, model.num_layers if auto else None)
        lightest = with_chunks(lightest, chunk_options[-1])
        lightest = dataclasses.replace(lightest, vocab_block=block_options[-1])
        if auto:
            lightest = bucket_for(dataclasses.replace(lightest, optimizer_offload=True,
                                                      optimizer_overlap=False))
        best = lightest
        why = "the device's memory is unknown: the tightest bound the config allows"
    else:
        best, best_time = None, math.inf
        for offloaded, overlap in optimizer_options:
            for count in offload_options:
                candidate = None
                for base in buckets_for(with_offload(dataclasses.replace(
                        knobs, optimizer_offload=offloaded, optimizer_overlap=overlap), count)):
                    candidate = _lightest_fitting(config, base, platform, device_memory,
                                                  host_memory, chunk_options, block_options,
                                                  with_chunks)
                    if candidate is not None:  # the largest bucket that fits
                        break
                if candidate is None:
                    continue
                seconds = step_seconds(config, candidate, rates)
                if seconds < best_time - 1e-12:
                    best, best_time = candidate, seconds
        why = ("the fastest estimated setting that fits" if auto else
               "the fewest chunks, then the largest block, that fit")
        if best is None:  # nothing fits: report the lightest setting, infeasible
            best = with_chunks(with_offload(knobs, model.num_layers if auto else None),
                               chunk_options[-1])
            best = dataclasses.replace(best, vocab_block=block_options[-1])
            if auto:
                best = bucket_for(dataclasses.replace(best, optimizer_offload=True,
                                                      optimizer_overlap=False))
            why = "nothing fits: the lightest setting"
    if choose_budget:
        chunks = -(-n // best.token_budget)
        choices.append(Choice("operators.token_budget", best.token_budget,
                              f"{chunks} chunk(s) of N = {n:,} tokens: {why} (each chunk more "
                              f"costs about {rates.moe_chunk_seconds * 1e3:.1f} ms per MoE "
                              f"layer)"))
        if auto:
            choices.append(Choice("operators.max_chunks", best.max_chunks, "= the chunks"))
    if choose_block:
        choices.append(Choice("operators.vocab_block", best.vocab_block,
                              f"{why} (None: the whole shard of {_shard_width(config, knobs):,}"
                              f" columns; the largest block that fits is taken)"))
    if auto:
        choices.append(Choice("operators.offload", Knobs.as_config(best)["operators.offload"],
                              f"{best.num_offloaded} of {model.num_layers} boundaries; {why} "
                              f"(a copy hides under the layer's compute when the link allows)"))
        choices.append(Choice("operators.optimizer_offload", best.optimizer_offload,
                              f"{why} (on the device costs 12 bytes/param of device memory; "
                              f"offloaded costs the link: "
                              f"{rates.optimizer_seconds_per_param * 1e9:.2f} s per 1e9 params)"))
        if best.optimizer_offload and has_moe:
            choices.append(Choice("operators.optimizer_overlap", best.optimizer_overlap,
                                  f"{why} (overlapped, the stream hides under the forward and "
                                  f"the step holds the staging and a second copy of the MoE "
                                  f"layers' weights)"))
        if best.optimizer_offload:
            choices.append(Choice("optimizer.bucket_params", best.bucket_params,
                                  "the fastest measured bucket size, halved until the step "
                                  "fits"))
            choices.append(Choice("optimizer.slots", best.slots,
                                  "two: the measured sweep gained nothing from a third"))
    return best, choices


def _lightest_fitting(config, base: Knobs, platform, device_memory, host_memory, chunk_options,
                      block_options, with_chunks) -> Knobs | None:
    """The setting with the fewest chunks and then the largest vocab block that fits (memory
    falls as chunks rise and blocks shrink), or None."""
    def fits(k):
        return _fits(config, k, platform, device_memory, host_memory)

    lightest_block = dataclasses.replace(base, vocab_block=block_options[-1])
    chunks = _first_true(chunk_options, lambda c: fits(with_chunks(lightest_block, c)))
    if chunks is None:
        return None
    with_c = with_chunks(base, chunk_options[chunks])
    block = _first_true(block_options, lambda b: fits(dataclasses.replace(with_c,
                                                                          vocab_block=b)))
    return dataclasses.replace(with_c, vocab_block=block_options[block])


def _first_true(options: list, predicate) -> int | None:
    """The first index whose predicate holds, for a predicate monotone over the options."""
    if not options or not predicate(options[-1]):
        return None
    low, high = 0, len(options) - 1
    while low < high:
        middle = (low + high) // 2
        if predicate(options[middle]):
            high = middle
        else:
            low = middle + 1
    return low


def _chunk_options(tokens: int, max_chunks: int, auto: bool) -> list[int]:
    """Effective chunk counts to try, fewest first: up to max_chunks (the config's), or with
    auto up to MOST_CHUNKS (never more than the tokens)."""
    most = min(tokens, max_chunks if not auto else max(MOST_CHUNKS, max_chunks))
    counts = sorted({-(-tokens // -(-tokens // k)) for k in range(1, most + 1)})
    return counts


def _shard_width(config: Config, knobs: Knobs) -> int:
    return mop.padded_vocab(config.model.vocab_size, knobs.num_devices) // knobs.num_devices


def _block_options(config: Config, knobs: Knobs) -> list[int | None]:
    """Vocab blocks to try, largest first: the whole shard, then powers of two down to
    SMALLEST_VOCAB_BLOCK."""
    width = _shard_width(config, knobs)
    options: list[int | None] = [None]
    block = 1 << (width - 1).bit_length() - 1
    while block >= SMALLEST_VOCAB_BLOCK:
        if block < width:
            options.append(block)
        block //= 2
    return options


# ----------------------------------------------------------------------------------------------
# The step-time estimate.


def attention_fraction(config: Config, context: int) -> float:
    """The causal pairs within documents of this config's data at ``context``, over full
    causal's T (T + 1) / 2 (1 for synthetic data): what the step estimate's attention counts."""
    return causal_pairs_per_sequence(config.data, context) / (context * (context + 1) / 2)


def step_seconds(config: Config, knobs: Knobs, rates: Rates = Rates()) -> float:
    """An estimate of one step's time on a device: the model's matmuls with one recompute of
    every layer, attention, the Ulysses exchanges, the MoE's extra chunks, the boundary copies
    that do not hide under a layer's compute, and the offloaded optimizer's streaming (what of
    it the forward does not hide, when overlapped)."""
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
        optimizer = model_weights(model, width).param_count * rates.optimizer_seconds_per_param
        if knobs.optimizer_overlap:  # the stream runs under the forward (1/4 of the compute)
            optimizer = max(0.0, optimizer - compute / 4)
    return compute + ulysses + moe + boundaries + optimizer


# ----------------------------------------------------------------------------------------------
# Plans.


def make_plan(config: Config, num_devices: int, *, context: int | None = None,
              device_memory: int | None = None, host_memory: int | None = None,
              platform: str = "gpu", auto: bool = False, rates: Rates = Rates(),
              baseline: bool = True, search_context: bool = True) -> Plan:
    """The plan of ``config`` on ``num_devices`` devices at ``context`` (default
    ``data.seq_len``), memories in bytes per device (None: unknown). Null knobs are filled
    (and, with ``auto``, every knob is chosen: with ``context`` given, for the most tokens per
    step; without, for the longest context). ``baseline``: also plan the same model and mesh
    with the four operators off. ``search_context``: also find the largest context that fits
    (needs ``device_memory``)."""
    if platform not in ("gpu", "cpu"):
        raise PlanError(f"platform: expected 'gpu' or 'cpu', got {platform!r}")
    for name, value in (("device_memory", device_memory), ("host_memory", host_memory)):
        if value is not None and (isinstance(value, bool) or value <= 0):
            raise PlanError(f"{name}: expected a positive number of bytes, got {value!r}")
    choices: list[Choice] = []
    if auto:
        config, mesh_choices, context = _auto_layout(config, num_devices, context,
                                                     device_memory, host_memory, platform,
                                                     rates)
        choices += mesh_choices
    knobs = knobs_from_config(config, num_devices, context=context, platform=platform)
    knobs, knob_choices = choose_knobs(config, knobs, platform, device_memory, host_memory,
                                       auto=auto, rates=rates)
    choices += knob_choices
    terms = tuple(plan_terms(config, knobs, platform=platform))
    largest = base = None
    if search_context and device_memory is not None:
        largest = largest_context(config, num_devices, device_memory=device_memory,
                                  host_memory=host_memory, platform=platform, knobs=knobs,
                                  auto=auto, rates=rates)
    if baseline:
        base_config = config.replace(operators=to_dict(config.operators.all_off))
        base_knobs = baseline_knobs(knobs)
        base_terms = tuple(plan_terms(base_config, base_knobs, platform=platform))
        base_largest = None
        if search_context and device_memory is not None:
            base_largest = largest_context(base_config, num_devices,
                                           device_memory=device_memory,
                                           host_memory=host_memory, platform=platform,
                                           knobs=base_knobs, rates=rates)
        base = Plan(base_config, base_knobs, platform, base_terms, device_memory, host_memory,
                    operators_on=False, largest_context=base_largest)
    return Plan(config, knobs, platform, terms, device_memory, host_memory, True,
                tuple(choices), base, largest, step_seconds(config, knobs, rates))


def largest_context(config: Config, num_devices: int, *, device_memory: int,
                    host_memory: int | None = None, platform: str = "gpu",
                    knobs: Knobs | None = None, auto: bool = False,
                    rates: Rates = Rates()) -> int | None:
    """The largest context (a multiple of mesh.seq) whose step fits, at the batch size of
    ``knobs`` (default the config's): with the knobs' fixed settings and null knobs at their
    lightest (with ``auto``: every knob at its lightest). None when none fits."""
    if knobs is None:
        knobs = knobs_from_config(config, num_devices, platform=platform)
    step = knobs.seq * (knobs.num_devices // math.gcd(knobs.num_devices,
                                                      knobs.batch_size * knobs.seq))

    def fits(context: int) -> bool:
        k = knobs_from_config(config, num_devices, context=context,
                              batch_size=knobs.batch_size, platform=platform)
        k = dataclasses.replace(k, data=knobs.data, seq=knobs.seq)
        lightest = _lightest(config, k, auto)
        return _fits(config, lightest, platform, device_memory, host_memory)

    if not fits(step):
        return None
    low = 1  # in units of `step`
    high = 2
    while fits(high * step):
        low, high = high, high * 2
        if high * step > 2**40:
            return low * step
    while high - low > 1:
        middle = (low + high) // 2
        if fits(middle * step):
            low = middle
        else:
            high = middle
    return low * step


def _lightest(config: Config, knobs: Knobs, auto: bool) -> Knobs:
    """Every knob that is chosen (null, or all with auto) at its lightest setting."""
    ops, model = config.operators, config.model
    n = knobs.tokens_per_device
    if knobs.moe_dispatch == "pipelined" and (auto or ops.token_budget is None):
        chunks = _chunk_options(n, knobs.max_chunks, auto)[-1]
        knobs = dataclasses.replace(knobs, token_budget=-(-n // chunks),
                                    max_chunks=max(chunks, knobs.max_chunks))
    if knobs.loss == "ring" and (auto or ops.vocab_block is None):
        knobs = dataclasses.replace(knobs, vocab_block=_block_options(config, knobs)[-1])
    if auto:
        knobs = dataclasses.replace(knobs, offload=(True,) * model.num_layers,
                                    optimizer_offload=True, optimizer_overlap=False,
                                    bucket_params=min(knobs.bucket_params, 1_000_000), slots=2)
    return knobs


def _auto_layout(config: Config, num_devices: int, context: int | None, device_memory,
                 host_memory, platform, rates) -> tuple[Config, list[Choice], int | None]:
    """--auto's mesh split (and, at a given context, the batch size): for each data x seq
    split that divides the model, the longest context (or the most sequences at ``context``)
    whose lightest setting fits; ties go to the faster estimate (fewer Ulysses exchanges)."""
    model = config.model
    splits = [(d, num_devices // d) for d in range(1, num_devices + 1) if num_devices % d == 0
              and model.num_heads % (num_devices // d) == 0]
    if not splits:
        raise PlanError(f"devices: no data x seq split of {num_devices} devices divides "
                        f"model.num_heads = {model.num_heads}")
    best = None
    for data, seq in splits:
        candidate = config.replace(mesh={"data": data, "seq": seq})
        if context is None:
            batch = -(-config.data.batch_size // data) * data
            candidate = candidate.replace(data={"batch_size": batch})
            if device_memory is None:
                score = (config.data.seq_len, data)
                chosen_context = None
            else:
                knobs = _safe_knobs(candidate, num_devices, None, batch, platform)
                if knobs is None:
                    continue
                found = largest_context(candidate, num_devices, device_memory=device_memory,
                                        host_memory=host_memory, platform=platform,
                                        knobs=knobs, auto=True, rates=rates)
                if found is None:
                    continue
                score, chosen_context = (found, data), found
        else:
            batch = _largest_batch(candidate, num_devices, context, data, device_memory,
                                   host_memory, platform)
            if batch is None:
                continue
            candidate = candidate.replace(data={"batch_size": batch})
            score, chosen_context = (batch, data), context
        if best is None or score > best[0]:
            best = (score, candidate, data, seq, chosen_context)
    if best is None:
        raise PlanError(f"--auto: no data x seq split of {num_devices} devices fits the model "
                        f"at any context (even with every operator at its lightest)")
    _, chosen, data, seq, chosen_context = best
    why = ("the split with the longest context that fits (ties: more data parallelism, fewer "
           "Ulysses exchanges)" if context is None else
           "the split with the most tokens per step at this context (ties: more data "
           "parallelism)")
    choices = [Choice("mesh.data x mesh.seq", f"{data} x {seq}", why)]
    if context is not None:
        choices.append(Choice("data.batch_size", chosen.data.batch_size,
                              "the most sequences whose lightest setting fits"))
    elif chosen_context is not None:
        choices.append(Choice("data.seq_len", chosen_context, "the longest context that fits"))
    return chosen, choices, chosen_context if context is None else context


def _safe_knobs(config, num_devices, context, batch, platform) -> Knobs | None:
    try:
        return knobs_from_config(config, num_devices, context=context, batch_size=batch,
                                 platform=platform)
    except PlanError:
        return None


def _largest_batch(config, num_devices, context, data, device_memory, host_memory,
                   platform) -> int | None:
    """The most sequences (a multiple of data) whose lightest setting fits at ``context``."""
    def fits(batch):
        knobs = _safe_knobs(config, num_devices, context, batch, platform)
        return knobs is not None and (device_memory is None or _fits(
            config, _lightest(config, knobs, True), platform, device_memory, host_memory))

    if device_memory is None:
        batch = -(-config.data.batch_size // data) * data
        return batch if fits(batch) else None
    if not fits(data):
        return None
    low, high = 1, 2
    while fits(high * data):
        low, high = high, high * 2
        if high > 2**20:
            return low * data
    while high - low > 1:
        middle = (low + high) // 2
        if fits(middle * data):
            low = middle
        else:
            high = middle
    return low * data


# ----------------------------------------------------------------------------------------------
# What to change.


_REMEDIES = {
    "kept_boundaries": "keep fewer boundaries on the device: operators.offload: all",
    "moe.": "bound the MoE's buffers: operators.moe_dispatch: pipelined with a smaller "
            "operators.token_budget (null: the planner's choice)",
    "loss.": "bound the loss: operators.loss: ring, a smaller operators.vocab_block",
    "master": "move the optimizer's state to host memory: operators.optimizer_offload: true",
    "moments": "move the optimizer's state to host memory: operators.optimizer_offload: true",
    "attention.scores": "use cuDNN attention (operators.attention: cudnn, a GPU and bf16): the "
                        "XLA kernel materializes T x T scores",
    "params": "spread the weights over more devices",
    "grads": "spread the weights over more devices",
    "embedding_table": "spread the vocabulary over more devices",
    "embedding_gradient": "spread the vocabulary over more devices",
}


def _reasons(plan: Plan) -> list[str]:
    reasons = []
    if plan.fits_device is False:
        terms = [t for t in plan.terms if t.live != "host"]
        largest = sorted(terms, key=lambda t: -t.bytes)[:3]
        reasons.append(
            f"the device needs {plan.total_bytes / GIB:.2f} GiB, it has "
            f"{plan.device_memory / GIB:.2f} GiB; largest terms: "
            + ", ".join(f"{t.name} {t.bytes / GIB:.2f} GiB" for t in largest))
        remedies = []
        for term in largest:
            for prefix, remedy in _REMEDIES.items():
                if term.name.startswith(prefix) and remedy not in remedies:
                    remedies.append(remedy)
        remedies.append("a shorter context (data.seq_len) or fewer sequences (data.batch_size)")
        remedies.append("`peakflat plan CONFIG --auto` to choose the knobs")
        reasons.append("to change: " + "; ".join(remedies))
    if plan.fits_host is False:
        reasons.append(
            f"the host needs {plan.host_bytes / GIB:.2f} GiB per device, it has "
            f"{plan.host_memory / GIB:.2f} GiB; to change: offload fewer boundaries "
            f"(operators.offload), or keep the optimizer on the device")
    return reasons


# ----------------------------------------------------------------------------------------------
# For the trainer and the benchmarks.


def read_device_memory(devices=None) -> int | None:
    """The allocator's limit of the first of ``devices`` this process holds (``bytes_limit``);
    None where the backend does not say (CPU)."""
    local = [d for d in (devices if devices is not None else jax.local_devices())
             if d.process_index == jax.process_index()]
    device = local[0]
    stats = device.memory_stats()
    return int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


def read_host_memory() -> int:
    """One device's share of this host's physical memory."""
    import os

    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return physical // max(1, jax.local_device_count())


def cpu_device_memory(host_memory: int) -> int:
    """What one CPU device may hold: its share of the host's memory (``host_memory``, per
    device), the memory its buffers come from. The host terms are held to the same share on
    their own, so a plan can overcommit it by up to twice; it refuses what cannot run."""
    return host_memory


def check_plan(config: Config, mesh_or_devices, device_memory: int | None = None,
               host_memory: int | None = None) -> Plan:
    """The plan of ``config`` on a mesh (or a device count, or a list of devices) at its
    ``data.seq_len``, null knobs filled (``Plan.knobs``: run with these). Memories in bytes per
    device; None: ``train.device_memory_gib``, else read from the devices (the host: its
    physical memory over its local devices). Raises DoesNotFit, with the table of terms and what
    to change, when the step does not fit. A CPU does not report its devices' memory: they live
    in the host's, so each is held to its share of the host (``cpu_device_memory``); without
    that, a config a thousand times too large reached XLA:CPU's compiler, which died of a
    division by zero (SIGFPE) emitting the T x T attention scores at T = 2^20."""
    devices = None
    if isinstance(mesh_or_devices, int):
        num_devices = mesh_or_devices
    elif hasattr(mesh_or_devices, "devices") and hasattr(mesh_or_devices, "shape"):
        devices = list(mesh_or_devices.devices.flat)
        num_devices = len(devices)
    else:
        devices = list(mesh_or_devices)
        num_devices = len(devices)
    platform = devices[0].platform if devices else jax.devices()[0].platform
    platform = "gpu" if platform in ("gpu", "cuda", "rocm") else "cpu"
    if device_memory is None and config.train.device_memory_gib:
        device_memory = int(config.train.device_memory_gib * GIB)
    if device_memory is None:
        device_memory = read_device_memory(devices)
    if host_memory is None:
        host_memory = read_host_memory()
    plan = make_plan(config, num_devices, device_memory=device_memory, host_memory=host_memory,
                     platform=platform, baseline=False, search_context=False)
    if plan.device_memory is None and platform == "cpu":
        # After choosing the knobs: those chosen with the memory unknown (the lightest) stay.
        plan = dataclasses.replace(plan, device_memory=cpu_device_memory(host_memory))
    if plan.fits_device is False or plan.fits_host is False:
        from peakflat_jax.plan_cli import format_table

        # The table's last line is the largest context that does fit (a closed-form search).
        largest = largest_context(config, num_devices, device_memory=plan.device_memory,
                                  host_memory=host_memory, platform=platform, knobs=plan.knobs)
        plan = dataclasses.replace(plan, largest_context=largest)
        raise DoesNotFit(f"{config.name} does not fit: {plan.reasons()[0]}\n"
                         + format_table(plan))
    return plan


def device_total_bytes(config: Config, num_devices: int, context: int | None = None, *,
                       platform: str | None = None, device_memory: int | None = None) -> int:
    """The plan's device total (the largest program) for ``config`` at ``context`` (default
    ``data.seq_len``), null knobs filled as ``check_plan`` fills them for the trainer (the device
    memory: ``device_memory``, else ``train.device_memory_gib``, else the local device's):
    what a measured peak is held against. ``platform``: default the local devices'."""
    if platform is None:
        platform = "gpu" if jax.devices()[0].platform in ("gpu", "cuda", "rocm") else "cpu"
    if device_memory is None and config.train.device_memory_gib:
        device_memory = int(config.train.device_memory_gib * GIB)
    if device_memory is None:
        device_memory = read_device_memory()
    return make_plan(config, num_devices, context=context, device_memory=device_memory,
                     platform=platform, baseline=False, search_context=False).total_bytes


def plan_json(plan: Plan) -> dict:
    """API.md's object: terms, total_bytes, device_bytes, feasible, baseline; plus the
    programs, phases, host terms, the knobs (with the rules that chose them) and the largest
    context that fits."""
    def one(p: Plan) -> dict:
        return {"terms": p.device_terms(), "total_bytes": p.total_bytes,
                "feasible": p.feasible, "programs": p.programs, "phases": p.phases,
                "peak_phase": p.peak_phase, "host_terms": p.host_terms(),
                "host_bytes": p.host_bytes, "reasons": p.reasons(),
                "largest_context": p.largest_context}

    out = one(plan)
    out.update({
        "device_bytes": plan.device_memory, "host_memory_bytes": plan.host_memory,
        "config": plan.config.name, "platform": plan.platform,
        "devices": plan.knobs.num_devices, "tokens_per_device": plan.knobs.tokens_per_device,
        "knobs": plan.knobs.as_config(),
        "choices": [{"key": c.key, "value": c.value, "why": c.why} for c in plan.choices],
        "step_seconds_estimate": plan.step_seconds,
        "step_attention_fraction": attention_fraction(plan.config, plan.knobs.context),
        "formulas": {t.name: t.formula for t in plan.terms},
    })
    if plan.baseline is not None:
        out["baseline"] = one(plan.baseline)
    return out
