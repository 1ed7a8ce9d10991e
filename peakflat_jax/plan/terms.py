"""The closed form: the knobs of a step, the weights' bytes, and every term of the bound
(``plan_terms``), each with its formula and the live set it belongs to.

A term is a set of buffers the step's program holds at once, counted from the program's
structure: the model's arrays by shape and dtype, and each operator's bound from the operator's
own function (``sco_memory_terms``, ``pipelined_moe_memory_terms``,
``ring_cross_entropy_memory_terms``, ``offload_stream_adamw_memory_terms``). One form per term
on every platform: what differs between platforms is structural only (on a CPU the host memory
kinds lower to device memory, so an offloaded boundary stays on the device and the streamed
optimizer stages nothing), or a measured constant of the machine (``measured.json``: the host
runtime, the pinned pool's outside share, cuDNN's fixed scratch). XLA's own plan of the compiled
programs is the verdict (``peakflat plan --check``); this is the estimate that ranks and
bounds before anything compiles, with its margin stated (``Measured.margin``).

Live sets (``LIVE_SETS``) and how they compose into programs: ``plan.programs``.

Legend: W devices (data x seq), B sequences per step, T context, N = B T / W tokens per device,
H hidden, L layers (L_d dense, L_m MoE), V vocab, V' = V padded to a multiple of W, Hq / Hkv
query / kv heads (Hkv' = Hq where seq does not divide Hkv: the kv heads are repeated), D head
width, E experts, k top-k, M the rows a MoE chunk delivers, F expert FFN, F_d dense FFN, F_s
shared expert FFN, P parameters on a device (its shards), P_m the MoE stack's share, D_l one
layer's dense weights (whole), C = N H b one boundary, b bytes of the model's dtype, R the
packed attention runs.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from peakflat_jax import mesh as mop
from peakflat_jax.config import Config, ConfigError
from peakflat_jax.model.decoder import MoEDecoder
from peakflat_jax.model.sharding import _names, weight_spec
from peakflat_jax.ops import pipelined_moe as moe_module
from peakflat_jax.ops import ring_cross_entropy as ring_module
from peakflat_jax.ops import sco as sco_module
from peakflat_jax.ops.grouped_matmul import planned_path
from peakflat_jax.optim import offload_adamw as offload_module
from peakflat_jax.plan import host_pool
from peakflat_jax.plan import optimizer_terms as optimizer_module
from peakflat_jax.plan.target import GPU, Target

GIB = 2**30

MEMORY_FORMULAS: dict[str, str] = {
    "params": "P * b: this device's weight shards (FSDP dense, EP experts, vocab-split "
              "embedding and head; a leaf W divides nowhere is whole)",
    "grads": "P * b: their gradients, placed alike",
    "router_bias": "2 * L_m * E * 4: the router's balancing bias (fp32, replicated), in and out",
    "batch": "4 * N * 4: tokens, targets, positions, segment ids (int32)",
    "kept_boundaries.dense_stack": "(L_d - n_offloaded_d) * C: the dense stack's kept "
                                   "boundaries, all that is live in a dense layer's backward "
                                   "where the layers are unrolled",
    "kept_boundaries.moe_stack": "(L_m - n_offloaded_m) * C: the MoE stack's kept boundaries, "
                                 "unrolled with a dense peak layer: each freed by its layer's "
                                 "backward, before the dense layers'",
    "gathered_weights": "2 * D_l * b: the layer's dense weights all-gathered whole, and their "
                        "whole gradient before the reduce-scatter",
    "residual_stream": "6 * N * H * a: the layer's normed inputs, the residual sums and their "
                       "cotangents (a: the activations' bytes on the platform)",
    "attention.activations": "3 * N * (2 Hq + 2 Hkv') * D * b: q, k, v and the output in the "
                             "token and head layouts of the Ulysses exchange, and cotangents",
    "attention.saved": "xla: 4 * N * Hq * T, the fp32 probabilities [B_l, Hq / seq, T, T] kept "
                       "for the backward; cudnn: 4 * R * N * Hq, the softmax statistics of "
                       "each packed run",
    "attention.backward": "xla: (8 + b) * N * Hq * T, the probabilities' gradient and the "
                          "logits' (fp32) and a copy of one; cudnn: R * N * Hq * (8 D + 4) + "
                          "scratch, the backward's workspace: cuDNN sizes its fp32 dQ "
                          "accumulator, full-head dK and dV and softmax sums for R runs of the "
                          "whole length each, and a fixed scratch (measured)",
    "ffn": "6 * N * F_d * a: the dense FFN's gate, up and their product, and their cotangents",
    "router": "4 * N * E * 4: the router's fp32 logits, scores and their cotangents",
    "shared_expert": "6 * N * F_s * a: the shared expert's gate, up and product, and "
                     "cotangents",
    "final_hidden": "3 * N * H * a: the last layer's output, the final norm's and the "
                    "cotangent that leaves the loss",
    "embedding_table": "V' * H * b: the table gathered whole for the lookup",
    "embedding_gradient": "V' * H * b: the table's dense gradient before the reduce-scatter, "
                          "which XLA may allocate before the layers' backward",
    "optimizer_update": "2 * P * 4: the fused AdamW's fp32 gradients (clipped) and updates",
    "optimizer_update_host_cpu": "0 * P: the update runs on the host CPU, its state and "
                                 "transit are host terms",
    "overlap.moe_layer_weights": "2 * P_m * b: the MoE layers' updated weights taken per "
                                 "layer and their stacked copy beside the stacked params",
    "overlap.staging": "staging + staging_gpu_excess (0 on a CPU): the optimizer step's "
                       "staging, inside the step's program (on a CPU the host state is device "
                       "memory, updated in place)",
    "overlap.deferred_writeback": "12 * (P - P_r) + 12 * min(beta, P): every streamed bucket's "
                                  "new fp32 master, mu and nu, held on the device until the "
                                  "forward's loss, and one bucket's fp32 gradient and excess",
    "optimizer_step.bucketed_params": "P * b: each bucket's new working params, the step's "
                                      "temporaries until the leaves are assembled from them",
    "optimizer_step.router_bias": "2 * L_m * E * 4: the router's bias, in and out",
    "optimizer_step.batch": "4 * N * 4: the batch, in and out",
    "host.optimizer_state": "12 * (P - P_r): fp32 master, mu and nu of the streamed groups",
    "host.offloaded_boundaries": "n_offloaded * C: SCO's boundaries in pinned host memory",
    "host.data_pipeline": "pipeline(T, B) / W: the pipeline's bytes making a batch (the "
                          "data's statistics), one device's share",
    "host.runtime": "runtime + per_pool_byte * pool: the trainer process's Python, jax, CUDA, "
                    "cuDNN and programs, and what grows with the pinned pool (both measured)",
    "host.pinned_pool_growth": "pool - pinned: XLA's pinned-host pool grows by doubling regions "
                               "over the pinned arrays up to its cap (plan.host_pool)",
    "host.pinned_pool_shortfall": "needed cap - cap: what the pinned arrays need beyond the "
                                  "pool's cap; XLA fails their allocation (the run cannot "
                                  "start)",
    "host.pinned_outside_process": "outside_per_pool_byte * pool: what the kernel and the "
                                   "driver keep for page-locked memory outside the process "
                                   "(measured)",
}

LIVE_SETS = {
    "persistent": "the whole step",
    "boundaries": "from each layer's forward to its backward",
    "boundaries.later": "the MoE stack's boundaries where the layers are unrolled and the peak "
                        "layer is dense: live through the loss and each MoE layer's backward, "
                        "freed before the dense layers'",
    "backward": "through the backward, whatever phase it is in",
    "layer": "one layer's recompute and backward (the largest layer kind)",
    "layer/attention": "within the layer: attention's backward",
    "layer/ffn": "within the layer: the FFN's or the MoE's forward and backward",
    "loss": "the loss, forward and backward",
    "embedding": "the lookup and its gradient",
    "update": "the fused AdamW update",
    "optimizer_step": "OffloadStreamAdamW's own program, after the gradients",
    "overlap": "with operators.optimizer_overlap, beside the gradient program's terms in the "
               "program that applies the last step's update inside the next",
    "host": "host memory, per device",
}
"""Where each term is live. The phases (layer, loss, embedding, update) never overlap: the
gradient program's peak takes the largest of them."""

PHASES = ("layer", "loss", "embedding", "update")
MOST_CHUNKS = 256
"""The most MoE chunks ``--auto`` considers: each costs an exchange and a pass over the layer's
expert weights, so the choice never wants more unless memory forces it."""
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


def baseline_knobs(knobs: Knobs) -> Knobs:
    """The same launch with the four operators off (``OperatorsConfig.all_off``): EP in one
    chunk, the materialized loss, no offload, the optimizer on the device."""
    return dataclasses.replace(knobs, moe_dispatch="ep", token_budget=None,
                               loss="materialized", offload=(False,) * len(knobs.offload),
                               optimizer_offload=False, optimizer_overlap=False,
                               resident_groups=0)


def layer_loop(config: Config, optimizer_overlap: bool, platform: str) -> str:
    """``operators.layer_loop`` resolved: as configured, or for ``auto`` ``unrolled`` where
    the offloaded optimizer's update runs inside the next step's forward on a GPU (XLA overlaps
    host copies with compute in straight-line code, not across a loop's iterations), else
    ``scan`` (one layer compiled whatever the depth; on a CPU the host copies are nothing)."""
    loop = config.operators.layer_loop
    if loop != "auto":
        return loop
    return "unrolled" if optimizer_overlap and platform == "gpu" else "scan"


def overlaps_optimizer(config: Config) -> bool:
    """Whether a config's step applies the streamed optimizer's update inside the next step
    (``operators.optimizer_overlap``): with the optimizer offloaded and MoE layers to hide the
    update under."""
    ops, model = config.operators, config.model
    return bool(ops.optimizer_offload is True and ops.optimizer_overlap
                and model.num_layers > model.num_dense_layers)


def activation_bytes(platform: str, dtype) -> int:
    """a, the bytes a float activation of ``dtype`` takes between the step's operations: its
    own on a GPU; 4 on a CPU, whose compiler computes floats narrower than fp32 in fp32 (XLA's
    float normalization) and keeps them so between its loops."""
    return 4 if platform == "cpu" else jnp.dtype(dtype).itemsize


def packed_attention_runs(config: Config) -> int:
    """R, the runs cuDNN's packed layout sizes its arrays for: the data's segment cap plus the
    padding run, or 1 where a sequence is one document (synthetic data, or
    ``data.max_segments: 1``), which takes the unpacked kernel."""
    segments = 1 if config.data.source == "synthetic" else config.data.max_segments
    return 1 if segments == 1 else segments + 1


def cudnn_backward_workspace(runs: int, tokens: int, heads: int, head_dim: int,
                             fixed_scratch: int = 0) -> int:
    """Bytes of cuDNN flash attention's backward workspace for ``tokens`` per device over
    ``heads`` query heads: its fp32 dQ accumulator (4 D), full-head dK and dV (2 D each: GQA's
    kv heads expanded to the query heads) and fp32 softmax sums (4) for every one of the R
    packed runs as if each ran the whole sequence, and the graph's ``fixed_scratch``."""
    return runs * tokens * heads * (8 * head_dim + 4) + fixed_scratch


# ----------------------------------------------------------------------------------------------
# The weights.


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


@functools.lru_cache(maxsize=256)
def model_weights(model_config, num_devices: int) -> WeightBytes:
    """``WeightBytes`` of ``model_config`` on ``num_devices`` devices: the model's abstract
    state (no array is made) under ``model.sharding.weight_spec``."""
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
                       embedding_whole=embedding, largest_leaf=largest)


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

    @property
    def short(self) -> str:
        """The formula alone, without its explanation (what the table prints)."""
        return short_formula(self.formula)


def short_formula(formula: str) -> str:
    """A formula's expression without its explanation: the text before ``: `` or ``  (``, and
    each labelled case (``xla: ...; cudnn: ...``) the same way."""
    if formula.startswith("["):
        formula = formula.split("] ", 1)[1]
    cases = []
    for i, case in enumerate(_top_level(formula, "; ")):
        head, sep, rest = case.partition(": ")
        labelled = bool(sep) and head.isidentifier()
        if i and not labelled:
            break
        expression = rest if labelled else case
        for end in (": ", "  (", ", the "):
            expression = expression.split(end, 1)[0]
        cases.append(f"{head}: {expression.strip()}" if labelled else expression.strip())
    short = "; ".join(cases)
    return short if len(short) <= SHORT_FORMULA else short[:SHORT_FORMULA - 3] + "..."


SHORT_FORMULA = 64
"""The longest formula the table prints (``--formulas``: the whole)."""


def _top_level(text: str, separator: str) -> list[str]:
    """``text`` split at ``separator`` outside parentheses."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth == 0 and text.startswith(separator, i):
            parts.append(text[start:i])
            start = i + len(separator)
    return parts + [text[start:]]


class _Terms:
    """The terms as ``plan_terms`` adds them."""

    def __init__(self):
        self.terms: list[Term] = []

    def add(self, name: str, value, live: str, formula: str | None = None) -> None:
        self.terms.append(Term(name, int(value), live, formula or MEMORY_FORMULAS[name]))

    def add_all(self, prefix: str, values: dict, live: str, formulas: dict) -> None:
        for key, value in values.items():
            self.add(f"{prefix}{key}", value, live, formulas[key])


def plan_terms(config: Config, knobs: Knobs, target: Target = GPU, *,
               operators_on: bool = True) -> list[Term]:
    """Every term of the step's per-device bound (device and host) for ``knobs`` on
    ``target``, with the operators as the knobs set them (``operators_on``) or all four off
    (the baseline: EP in one chunk, the materialized loss, no offload, the optimizer on the
    device)."""
    if target.platform == "cpu":  # host memory kinds are device memory on a CPU
        knobs = dataclasses.replace(knobs, offload=(False,) * config.model.num_layers)
    if not operators_on:
        knobs = baseline_knobs(knobs)
    weights = model_weights(config.model, knobs.num_devices)
    terms = _Terms()
    _persistent_terms(terms, config, knobs, weights)
    _layer_stack_terms(terms, config, knobs, target, weights)
    _loss_terms(terms, config, knobs, target)
    terms.add("embedding_table", weights.embedding_whole, "embedding")
    terms.add("embedding_gradient", weights.embedding_whole, "backward")
    _optimizer_terms(terms, config, knobs, target, weights)
    _host_terms(terms, config, knobs, target)
    return terms.terms


def _uses_host_cpu(config: Config, knobs: Knobs) -> bool:
    return config.optimizer.update_on == "host_cpu" and not knobs.optimizer_offload


def _persistent_terms(terms: _Terms, config: Config, knobs: Knobs,
                      weights: WeightBytes) -> None:
    """The weights and their gradients; the device AdamW's fp32 state where it is on the
    device; the router's bias and the batch."""
    if knobs.optimizer_offload or _uses_host_cpu(config, knobs):
        terms.add("params", weights.params, "persistent")
        terms.add("grads", weights.params, "persistent")
    else:
        adamw = optimizer_module.on_device_adamw_memory_terms(weights.param_count,
                                                              config.model.dtype)
        terms.add_all("", adamw, "persistent", optimizer_module.ON_DEVICE_FORMULAS)
    terms.add("router_bias", 2 * weights.extras, "persistent")
    terms.add("batch", 4 * knobs.tokens_per_device * 4, "persistent")


def _layer_stack_terms(terms: _Terms, config: Config, knobs: Knobs, target: Target,
                       weights: WeightBytes) -> None:
    """SCO's boundaries, stack by stack, and the largest layer's recompute and backward with
    the boundaries still live in it: scanned, every kept boundary; unrolled, a dense layer's
    backward comes after every MoE layer's has freed its boundary, so only the dense stack's
    (the MoE stack's are then live beside every phase but the layer: ``boundaries.later``)."""
    model = config.model
    n = knobs.tokens_per_device
    boundary = n * model.hidden * jnp.dtype(model.dtype).itemsize
    num_dense = model.num_dense_layers
    num_moe = model.num_layers - num_dense
    stacks = []
    if num_dense:
        stacks.append(("dense", knobs.offload[:num_dense], 2 * n * 4))
    if num_moe:
        stacks.append(("moe", knobs.offload[num_dense:],
                       2 * n * 4 + num_moe * model.num_experts * 4))
    kept, integer, layer_sets = {}, 0, {}
    for kind, offload, integer_bytes in stacks:
        sco = sco_module.sco_memory_terms(len(offload), sum(offload), boundary,
                                          weights.layer_shard[kind], 0, integer_bytes)
        kept[kind] = sco["kept_boundaries"]
        integer += sco["integer_leaves"]
        layer_sets[kind] = {key: sco[key] for key in ("restored_boundaries", "carry_cotangents",
                                                      "layer_parameters")}
    unrolled = layer_loop(config, knobs.optimizer_overlap, target.platform) == "unrolled"
    candidates = []
    for kind, sco in layer_sets.items():
        layer = [Term(key, value, "layer", sco_module.MEMORY_FORMULAS[key])
                 for key, value in sco.items()]
        layer += _layer_terms(config, knobs, target, weights, kind)
        live = (kept.get("dense", 0) if unrolled and kind == "dense" else sum(kept.values()))
        candidates.append((phase_total(layer, "layer") + live, live, kind, layer))
    live, kind, layer = 0, None, []
    if candidates:
        _, live, kind, layer = max(candidates, key=lambda c: c[0])
    else:
        live = sum(kept.values())
    if sum(kept.values()) > live:
        terms.add("kept_boundaries", live, "boundaries",
                  MEMORY_FORMULAS["kept_boundaries.dense_stack"])
        terms.add("kept_boundaries.moe_stack", sum(kept.values()) - live, "boundaries.later")
    else:
        terms.add("kept_boundaries", live, "boundaries",
                  sco_module.MEMORY_FORMULAS["kept_boundaries"])
    terms.add("integer_leaves", integer, "boundaries",
              sco_module.MEMORY_FORMULAS["integer_leaves"])
    for term in layer:
        terms.add(term.name, term.bytes, term.live, f"[{kind} layer] {term.formula}")


def _layer_terms(config: Config, knobs: Knobs, target: Target, weights: WeightBytes,
                 kind: str) -> list[Term]:
    """One layer of ``kind`` beyond SCO's terms: its gathered weights, what the whole layer
    holds (the residual stream, attention's activations and saved statistics), and the two
    sub-phases that take turns: attention's backward, and the FFN's or the router's and the
    MoE's (``pipelined_moe_memory_terms``, or the unchunked layer's worst-case buffers)."""
    model = config.model
    itemsize = jnp.dtype(model.dtype).itemsize
    n, h = knobs.tokens_per_device, model.hidden
    hq, d = model.num_heads, model.head_dim
    hkv = model.num_kv_heads if model.num_kv_heads % knobs.seq == 0 else hq
    scores = n * hq * knobs.context  # one [B_l, Hq / seq, T, T] array's elements
    xla = knobs.attention == "xla"
    runs = packed_attention_runs(config)
    scratch = target.measured.constant("cudnn_fixed_scratch_bytes")
    a = activation_bytes(target.platform, model.dtype)
    layer = [
        Term("gathered_weights", 2 * weights.layer_whole_dense[kind], "layer",
             MEMORY_FORMULAS["gathered_weights"]),
        Term("residual_stream", 6 * n * h * a, "layer", MEMORY_FORMULAS["residual_stream"]),
        Term("attention.activations", 3 * n * (2 * hq + 2 * hkv) * d * itemsize, "layer",
             MEMORY_FORMULAS["attention.activations"]),
        Term("attention.saved", 4 * scores if xla else 4 * runs * n * hq, "layer",
             MEMORY_FORMULAS["attention.saved"]),
        Term("attention.backward", (8 + itemsize) * scores if xla
             else cudnn_backward_workspace(runs, n, hq, d, scratch), "layer/attention",
             MEMORY_FORMULAS["attention.backward"]),
    ]
    if kind == "dense":
        layer.append(Term("ffn", 6 * n * model.dense_ffn * a, "layer/ffn",
                          MEMORY_FORMULAS["ffn"]))
        return layer
    layer.append(Term("router", 4 * n * model.num_experts * 4, "layer/ffn",
                      MEMORY_FORMULAS["router"]))
    layer.append(Term("shared_expert", 6 * n * model.shared_expert_ffn * a, "layer/ffn",
                      MEMORY_FORMULAS["shared_expert"]))
    moe = moe_terms(config, knobs, target)
    layer += [Term(f"moe.{key}", value, "layer/ffn", moe_module.MEMORY_FORMULAS[key])
              for key, value in moe.items()]
    return layer


def grouped_matmul_path(config: Config, target: Target) -> str:
    """The grouped matmul's path on ``target``: the Mosaic kernels on a Hopper GPU where its
    blocks fit the shapes (``ops.grouped_matmul.planned_path``), the tiled path on another
    GPU kind, XLA's on a CPU."""
    model = config.model
    path = planned_path(target.platform, model.dtype, model.dtype, model.hidden,
                        model.expert_ffn)
    kind = target.device_kind
    if path == "mosaic" and kind is not None and not _is_hopper(kind):
        return "tiled"
    return path


def _is_hopper(device_kind: str) -> bool:
    return any(name in device_kind for name in ("H100", "H200", "H800", "H20", "GH200"))


def moe_terms(config: Config, knobs: Knobs, target: Target) -> dict[str, int]:
    """``pipelined_moe_memory_terms`` for the configured dispatch (the operator's own
    function): in chunks, or unchunked (EP, LLEP) with its worst-case buffers."""
    model, llep = config.model, config.operators.llep
    common = dict(num_tokens=knobs.tokens_per_device, hidden=model.hidden,
                  ffn=model.expert_ffn, top_k=model.top_k, num_experts=model.num_experts,
                  num_devices=knobs.num_devices, dtype=model.dtype,
                  grouped_matmul=grouped_matmul_path(config, target))
    if knobs.moe_dispatch == "ep":
        return moe_module.unchunked_moe_memory_terms(balance="none", **common)
    options = dict(max_foreign_experts=llep.max_foreign_experts,
                   llep_threshold=llep.threshold, llep_capacity=llep.capacity)
    if knobs.moe_dispatch == "llep":
        return moe_module.unchunked_moe_memory_terms(balance="llep", **options, **common)
    return moe_module.pipelined_moe_memory_terms(
        token_budget=knobs.token_budget, max_chunks=knobs.max_chunks, balance="llep",
        **options, **common)


def _loss_terms(terms: _Terms, config: Config, knobs: Knobs, target: Target) -> None:
    """The last layer's output around the loss, and Ring-DTP's strips or the materialized
    logits (the operator's own terms)."""
    model = config.model
    n, h, width = knobs.tokens_per_device, model.hidden, knobs.num_devices
    shard_width = mop.padded_vocab(model.vocab_size, width) // width
    terms.add("final_hidden", 3 * n * h * activation_bytes(target.platform, model.dtype), "loss")
    if knobs.loss == "ring":
        try:
            ring = ring_module.ring_cross_entropy_memory_terms(
                n, h, shard_width, width, vocab_block=knobs.vocab_block, mode=knobs.loss_mode,
                hidden_dtype=model.dtype, kernel_dtype=model.dtype, reduction="mean",
                vocab_size=model.vocab_size)
        except ValueError as error:
            raise ConfigError(f"operators.loss_mode / vocab_block: {error}") from None
        terms.add_all("loss.", ring, "loss", ring_module.MEMORY_FORMULAS)
    else:
        materialized = ring_module.materialized_memory_terms(
            n, h, shard_width, width, vocab_size=model.vocab_size, kernel_dtype=model.dtype)
        terms.add_all("loss.", materialized, "loss", ring_module.MATERIALIZED_MEMORY_FORMULAS)


def _optimizer_terms(terms: _Terms, config: Config, knobs: Knobs, target: Target,
                     weights: WeightBytes) -> None:
    """The optimizer's update: the streamed optimizer's own program (and, overlapped, its
    staging and the MoE layers' new weights inside the step), the host CPU's (host terms), or
    the fused on-device AdamW's fp32 temporaries."""
    model = config.model
    if knobs.optimizer_offload:
        _streamed_optimizer_terms(terms, config, knobs, target, weights)
    elif _uses_host_cpu(config, knobs):
        terms.add("optimizer_update", 0, "update", MEMORY_FORMULAS["optimizer_update_host_cpu"])
        host = optimizer_module.host_cpu_adamw_host_terms(
            weights.param_count, model.dtype, largest_leaf=weights.largest_leaf,
            num_devices=knobs.num_devices, clipped=config.optimizer.max_grad_norm is not None,
            platform=target.platform,
            client_bytes=target.measured.constant("host_cpu_adamw_client_bytes"))
        terms.add_all("host.", host, "host", optimizer_module.HOST_CPU_FORMULAS)
    else:
        terms.add("optimizer_update", 2 * weights.param_count * 4, "update")


def _streamed_optimizer_terms(terms: _Terms, config: Config, knobs: Knobs, target: Target,
                              weights: WeightBytes) -> None:
    model = config.model
    resident = resident_param_count(model, knobs.num_devices, knobs.resident_groups)
    step = offload_module.offload_stream_adamw_memory_terms(
        weights.param_count, knobs.bucket_params, knobs.slots, model.dtype, resident)
    resident_state = step.pop("resident_state")
    formulas = offload_module.MEMORY_FORMULAS
    terms.add_all("optimizer_step.", step, "optimizer_step", formulas)
    if resident:
        terms.add("optimizer.resident_state", resident_state, "persistent",
                  formulas["resident_state"])
        # The optimizer's own program takes the resident state in and gives it back (donated).
        terms.add("optimizer_step.resident_state", resident_state, "optimizer_step",
                  formulas["resident_state"])
    terms.add("optimizer_step.bucketed_params",
              weights.param_count * jnp.dtype(model.dtype).itemsize, "optimizer_step")
    terms.add("optimizer_step.router_bias", 2 * weights.extras, "optimizer_step")
    terms.add("optimizer_step.batch", 4 * knobs.tokens_per_device * 4, "optimizer_step")
    streamed_state = offload_module.offload_stream_adamw_host_bytes(weights.param_count,
                                                                    resident)
    terms.add("host.optimizer_state", streamed_state, "host")
    if not knobs.optimizer_overlap:
        return
    if config.operators.optimizer_writeback == "backward":
        bucket = min(knobs.bucket_params, weights.param_count)
        terms.add("overlap.deferred_writeback", streamed_state + 12 * bucket, "overlap")
    else:
        staged = (step["staging"] + step["staging_gpu_excess"] if target.platform == "gpu"
                  else 0)
        terms.add("overlap.staging", staged, "overlap")
    num_moe = model.num_layers - model.num_dense_layers
    terms.add("overlap.moe_layer_weights", 2 * num_moe * weights.layer_shard["moe"], "overlap")


def _host_terms(terms: _Terms, config: Config, knobs: Knobs, target: Target) -> None:
    """SCO's offloaded boundaries, the data pipeline's batch, and on a GPU what the trainer
    process and XLA's pinned-host pool hold (the pool from its growth model, the runtime and
    the outside share measured)."""
    model = config.model
    boundary = knobs.tokens_per_device * model.hidden * jnp.dtype(model.dtype).itemsize
    terms.add("host.offloaded_boundaries", sco_module.sco_host_bytes(knobs.num_offloaded,
                                                                     boundary), "host")
    # Every process makes its rows; one device's share is its process's bytes / its devices.
    pipeline = target.data.pipeline_host_bytes(knobs.context, knobs.batch_size)
    terms.add("host.data_pipeline", pipeline // knobs.num_devices, "host")
    if target.platform != "gpu":
        return
    pinned = pinned_allocations(knobs, terms.terms)
    limit = pool_limit(config, target, pinned)
    try:
        pool = host_pool.pool_bytes(pinned, limit)
        shortfall = 0
    except MemoryError:
        pool = limit
        shortfall = host_pool.planned_limit_gib(pinned) * GIB - limit
    measured = target.measured
    loop = layer_loop(config, knobs.optimizer_overlap, target.platform)
    runtime = (measured.constant(f"host_runtime_bytes_{loop}")
               + measured.constant("host_runtime_per_pool_byte") * pool)
    terms.add("host.runtime", runtime, "host")
    terms.add("host.pinned_pool_growth", pool - min(pool, sum(pinned)), "host")
    if shortfall:
        terms.add("host.pinned_pool_shortfall", shortfall, "host")
    terms.add("host.pinned_outside_process",
              measured.constant("pinned_outside_per_pool_byte") * pool, "host")


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


def pool_limit(config: Config, target: Target, pinned: list[int]) -> int:
    """The pinned-host pool's cap, in bytes: the target's where given; else the cap a run of
    this config sets from its own pinned arrays (``device.pinned_host_pool: planned``); else
    XLA's default."""
    if target.pinned_pool_limit_gib is not None:
        return target.pinned_pool_limit_gib * GIB
    if host_pool.planned_cap_applies(config):
        return host_pool.planned_limit_gib(pinned) * GIB
    return host_pool.XLA_DEFAULT_LIMIT_GIB * GIB


def phase_total(terms, phase: str) -> int:
    """A phase's bytes: its own terms, plus the largest of its sub-phases (``phase/...``)."""
    own = sum(t.bytes for t in terms if t.live == phase)
    subs: dict[str, int] = {}
    for t in terms:
        if t.live.startswith(phase + "/"):
            subs[t.live] = subs.get(t.live, 0) + t.bytes
    return own + max(subs.values(), default=0)
