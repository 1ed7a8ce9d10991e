"""Run configurations: frozen dataclasses with a docstring under each field, read from YAML.

A config file is a mapping of sections (``model``, ``mesh``, ``data``, ``operators``,
``optimizer``, ``train``, ``device``), each setting fields of its dataclass; ``key=value``
overrides on the command line address a field as ``section.field`` (``train.steps=20``) and take
a YAML value.
Every key must name a field and every value must have the field's type: a mistake is an error
that names the key, raised before anything is compiled.

The shipped presets live in ``configs/`` at the repository root; ``load_config("tiny")`` finds
them by name as well as by path.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import pathlib
import re
import types
import typing
from typing import Literal

import yaml

_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")
CONFIGS_DIR = pathlib.Path(__file__).resolve().parents[1] / "configs"


class ConfigError(ValueError):
    """A config that cannot be run, with the key at fault in its message."""


# ----------------------------------------------------------------------------------------------
# Sections.


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The decoder: gpt-oss / DeepSeek-V3 shaped, a stack of attention + MoE layers."""

    vocab_size: int = 260
    """V, the true vocabulary (byte-level data: 256 bytes + 4 specials; at least a
    ``data.tokenizer``'s). The head is padded to a multiple of the ring size; padded columns
    never enter the softmax."""
    hidden: int = 64
    """H, the residual width."""
    num_layers: int = 4
    """L, decoder layers, each one checkpoint boundary."""
    num_dense_layers: int = 0
    """How many of the first layers use a dense SwiGLU FFN instead of the MoE."""
    dense_ffn: int = 128
    """FFN width of the leading dense layers."""
    num_heads: int = 8
    """Query heads."""
    num_kv_heads: int = 8
    """Key/value heads (grouped-query attention: num_heads is a multiple)."""
    head_dim: int = 16
    """Width of one attention head."""
    rope_theta: float = 10000.0
    """RoPE base."""
    rope_scaling: Literal["none", "linear", "ntk", "yarn"] = "none"
    """Long-context RoPE scaling: ``linear`` divides positions by ``rope_scaling_factor``
    (position interpolation); ``ntk`` raises the base to theta * factor^(d / (d - 2));
    ``yarn`` (gpt-oss) interpolates the low frequencies by the factor, keeps the high ones,
    ramps between (``rope_beta_fast``, ``rope_beta_slow``) and scales the rotated q and k by
    0.1 ln(factor) + 1 (transformers' ``_compute_yarn_parameters``)."""
    rope_scaling_factor: float = 1.0
    """The context-extension factor of ``rope_scaling``."""
    rope_original_context: int = 4096
    """``yarn``: the context the model was pretrained at (config.json's
    ``original_max_position_embeddings``), which places the ramp."""
    rope_beta_fast: float = 32.0
    """``yarn``: rotations over the original context above which a frequency is kept as it
    is."""
    rope_beta_slow: float = 1.0
    """``yarn``: rotations over the original context below which a frequency is interpolated
    (divided by the factor)."""
    rope_truncate: bool = True
    """``yarn``: round the ramp's ends to whole dimensions (gpt-oss: false)."""
    num_experts: int = 16
    """E, routed experts per MoE layer."""
    top_k: int = 2
    """k, experts per token."""
    expert_ffn: int = 32
    """F, the FFN width of one routed expert."""
    shared_expert_ffn: int = 0
    """FFN width of the always-on shared expert; 0 for none."""
    router_score: Literal["softmax", "sigmoid"] = "softmax"
    """Router scores: softmax over experts (gpt-oss, top-k renormalized) or per-expert sigmoid
    (DeepSeek-V3, top-k normalized)."""
    router_renormalize: bool = True
    """Whether the top-k gates are renormalized to sum to one (Mixtral, gpt-oss, DeepSeek-V3,
    Qwen3-MoE with ``norm_topk_prob``); False: a token's gates are its chosen experts' scores as
    they are (Qwen3-MoE without ``norm_topk_prob``: softmax probabilities over all experts)."""
    router_bias_rate: float = 0.0
    """Auxiliary-loss-free balancing (DeepSeek-V3): a per-expert bias added to the scores for
    the top-k choice only, moved by this rate against each expert's load error after every
    step. 0 turns it off."""
    routed_scale: float = 1.0
    """Scales the routed experts' output (DeepSeek-V3's routed_scaling_factor)."""
    tie_embeddings: bool = False
    """Whether the output head is the embedding table (transposed)."""
    norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    qk_norm: bool = False
    """RMSNorm (a learned scale of ``head_dim``, shared by the heads) on every query and key head
    after its projection and before RoPE (Qwen3's q_norm / k_norm), which keeps the attention
    logits bounded whatever the projections' growth."""
    attention_bias: bool = False
    """Biases on the query, key, value and output projections (gpt-oss)."""
    attention_sinks: bool = False
    """A learned logit per query head that joins each of the head's attention softmaxes as one
    more column with no value (gpt-oss's sinks): a query can give part of its weight to
    nothing. Attention on the XLA kernel only (cuDNN's has no sinks: refused)."""
    sliding_window: int = 0
    """Keys a query of a sliding-window layer sees, itself included (token i sees
    i - window + 1 ... i, within its document); 0: every layer attends over the whole
    document. XLA attention only (refused on cuDNN's packed kernel)."""
    sliding_window_layers: Literal["all", "even"] = "all"
    """Which layers slide (with ``sliding_window``): every one, or layers 0, 2, 4, ... with
    the others over the whole document (gpt-oss's alternation)."""
    router_logit_bias: bool = False
    """A learned bias on the router's logits, trained like any weight (gpt-oss; not the
    balancing bias of ``router_bias_rate``, which moves the choice only)."""
    expert_bias: bool = False
    """Biases on every routed expert's gate, up and down projections (gpt-oss)."""
    expert_activation: Literal["swiglu", "clamped_swiglu"] = "swiglu"
    """The routed experts' gated unit: ``swiglu``, silu(gate) * up; ``clamped_swiglu``
    (gpt-oss), g sigmoid(alpha g) * (u + 1) with g = min(gate, limit) and u = up clipped to
    [-limit, limit] (``swiglu_alpha``, ``swiglu_limit``)."""
    swiglu_alpha: float = 1.702
    """``clamped_swiglu``'s sigmoid slope (config.json's ``swiglu_alpha``)."""
    swiglu_limit: float = 7.0
    """``clamped_swiglu``'s clamp (config.json's ``swiglu_limit``)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Working dtype of parameters and activations (optimizer state is fp32 either way)."""
    init_std: float = 0.02
    """Standard deviation of the normal initialisation of the layers' input projections (q, k,
    v, the FFNs' gate and up, the router); the output projections (wo, w_down) take
    ``init_std / sqrt(2 L)``, so that the L residual branches add up to about one's size."""
    embedding_init_std: float | None = None
    """Standard deviation of the embedding table's initialisation; None: 1.0, or 1 / sqrt(H)
    with ``tie_embeddings`` (the table is then also the head, whose logits want a std of
    about one). The embedding is the residual stream's start: under pre-RMSNorm every layer
    divides by the stream's RMS, so a small table (``init_std``) amplifies the cotangents
    into the first layers by 1 / RMS, which gave grad norms of ~100 and a loss spike in the
    first steps (docs/design.md). 1.0 is MaxText's Llama default (flax's nn.Embed)."""
    head_init_std: float | None = None
    """Standard deviation of the output head's initialisation (untied); None: 1 / sqrt(H), so
    that the logits of the final RMSNorm's unit-RMS output start with a std of about one (a
    fan-in scaling, MaxText's logits dense)."""
    from_pretrained: str | None = None
    """A local Hugging Face checkpoint directory (config.json and *.safetensors) of the
    Mixtral, Qwen3-MoE or gpt-oss family to start from: its config.json sets the architecture
    fields of this section (``peakflat_jax.hf``; a field set here to another value than the
    checkpoint's is an error, as is a feature of the checkpoint that the model lacks), and its
    weights replace the initialisation (``dtype`` and the init fields are this section's).
    None: a random initialisation."""


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """The MoP mesh (``peakflat_jax.mesh``): ``data`` x ``seq`` devices. Batches split over
    ``data``, each sequence over ``seq`` (Ulysses attention exchanges sequence for heads within
    it); dense weights are sharded over all devices (FSDP), experts over all devices (expert
    parallelism, E_p = W) and the output head's vocab over all devices (the ring, P = W)."""

    data: int = 1
    """Data-parallel degree."""
    seq: int = -1
    """Sequence-parallel (Ulysses) degree; -1: every device not used by ``data``."""
    coordinator_address: str | None = None
    """``host:port`` of process 0 for multi-process runs (else JAX_COORDINATOR_ADDRESS, or
    single-process)."""
    num_processes: int | None = None
    """Processes in the run (else JAX_NUM_PROCESSES)."""
    process_id: int | None = None
    """This process's id (else JAX_PROCESS_ID)."""


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Token batches: text (a corpus file, or a JSONL file of documents or chat examples)
    tokenized and packed into sequences, or synthetic tokens (``peakflat_jax.train.data``)."""

    source: Literal["corpus", "jsonl", "synthetic"] = "corpus"
    """``corpus``: the text file ``corpus_path``, its documents packed; ``jsonl``: the JSONL
    file ``path``, its documents (``text_field``) or chat examples (``prompt_field`` and
    ``response_field``) packed; ``synthetic``: uniformly random tokens (one document per
    sequence)."""
    tokenizer: str | None = None
    """How text becomes tokens: ``bytes`` (UTF-8 bytes and 4 specials, a vocabulary of 260), or
    a Hugging Face ``tokenizer.json`` (its path, or a directory holding one) read by
    ``tokenizers``; null: ``bytes``, or with ``model.from_pretrained`` the checkpoint's
    directory (its tokenizer.json; without one, an error: set ``bytes`` to train it on bytes).
    Its vocabulary must fit ``model.vocab_size``."""
    bos_token: str | None = None
    """The token (its text) that opens every document or example; null: the ``bos_token`` of
    the tokenizer_config.json beside the tokenizer.json, else none. Not with bytes."""
    eos_token: str | None = None
    """The token (its text) that closes every document or example (a chat response's end,
    which the model learns to predict); null: the ``eos_token`` of the tokenizer_config.json
    beside the tokenizer.json, which must then name one. Not with bytes."""
    corpus_path: str | None = None
    """A UTF-8 text file whose documents are separated by blank lines; None: the public-domain
    corpus shipped in ``peakflat_jax/train/corpus/``."""
    path: str | None = None
    """The JSONL file of the ``jsonl`` source: one JSON object a line (blank lines skipped),
    each holding ``text_field``, or ``prompt_field`` and ``response_field``, as strings; every
    line is checked when the pipeline is made, an error naming the line."""
    text_field: str | None = None
    """The field of a JSONL line that holds a document's text (pretraining-style: every token a
    target)."""
    prompt_field: str | None = None
    """The field of a JSONL line that holds a chat example's prompt, any chat template
    included: its tokens are context, never targets (the SFT loss mask)."""
    response_field: str | None = None
    """The field of a JSONL line that holds a chat example's response: its tokens and the EOS
    after it are the targets."""
    document_blank_lines: int = 1
    """The document level: a run of at least this many blank lines ends a document (blank
    lines within a document stay in its text). The shipped corpus separates chapters by one
    and books by two: 1 gives a chapter a document, 2 a book a document, which long-context
    runs want, so that a sequence attends over one long text rather than many short ones
    (attention stays within a document)."""
    seq_len: int = 256
    """Context length T of every sequence."""
    batch_size: int = 8
    """Sequences per step (global); a multiple of the mesh's data degree."""
    max_segments: int = 32
    """The most documents packed into one sequence (the fused attention kernels take the
    document boundaries as a static-size list)."""
    seed: int = 0
    """Shuffling seed."""


@dataclasses.dataclass(frozen=True)
class LLEPConfig:
    """The least-loaded plan of PipelinedLLEP (SPEC.md, Operator 1, step 2)."""

    threshold: float = 1.3
    """lambda: plain expert parallelism while max/mean device load stays below it."""
    capacity: float = 1.0
    """alpha: a device is filled to alpha times the mean load."""
    min_tokens: int = 1024
    """m: the smallest piece of a spilled expert."""
    max_foreign_experts: int | None = None
    """Foreign experts a device may host (static buffers); None: the operator's default."""


AUTO_OPERATORS = ("moe_dispatch", "loss", "offload", "optimizer_offload")
"""The operators' switches that take ``auto``."""


@dataclasses.dataclass(frozen=True)
class OperatorsConfig:
    """The four operators, each switchable on its own. All off is the standard baseline of the
    same model: full remat, flash attention, the same mesh. ``auto`` (each operator's default;
    ``operators: auto`` in a YAML file sets all four) leaves the choice to the planner, which
    turns an operator on only where the run's peak needs it at its context, device and host
    (``plan.operators``); a value given forces it."""

    moe_dispatch: Literal["auto", "pipelined", "llep", "ep"] = "auto"
    """``pipelined``: PipelinedLLEP in chunks of ``token_budget``; ``llep``: least-loaded EP in
    one chunk; ``ep``: standard expert parallelism, one chunk; ``auto``: ``ep`` or
    ``pipelined``, the planner's choice."""
    token_budget: int | None = None
    """c, tokens per chunk per device for ``pipelined``; None: the planner's choice, or one
    chunk."""
    max_chunks: int = 10
    """K_max, the most chunks per MoE layer."""
    membership: Literal["strided", "contiguous"] = "strided"
    """Which tokens form a chunk."""
    llep: LLEPConfig = LLEPConfig()
    """The LLEP plan's knobs (``pipelined`` and ``llep``)."""
    loss: Literal["auto", "ring", "materialized"] = "auto"
    """``ring``: Ring-DTP, the N x V logits never formed; ``materialized``: all-gathered head,
    full logits; ``auto``: the planner's choice."""
    loss_mode: Literal["auto", "move_weights", "move_activations", "gather_kernel"] = "auto"
    """The ring's schedule (``pf.ring_cross_entropy``'s mode)."""
    vocab_block: int | None = None
    """Vocab columns per logit strip of the ring; None: a whole shard."""
    offload: Literal["auto", "none", "all"] | int | list | float = "auto"
    """Checkpoint boundaries kept in host memory (SCO): ``none``, ``all``, a count (the first
    n), a list of L bools, or a float: a host budget in GiB per device; ``auto``: ``none`` or
    ``all``, the planner's choice."""
    optimizer_offload: bool | Literal["auto"] = "auto"
    """True: OffloadStreamAdamW (fp32 state in host memory, streamed in buckets); False:
    optax.adamw with its state on the device, sharded like the params; ``auto``: the
    planner's choice."""
    optimizer_overlap: bool = True
    """With the offloaded optimizer: apply each step's update inside the next step's program
    (the same numbers as updating after the backward). Each MoE layer's update runs while the
    layer before it computes, so that the layers' host traffic runs under the forward: unrolled,
    in straight-line code; scanned, in the loop iteration of the layer before, its state a row
    of the optimizer's stacked blocks (``sco.MadeInScan``). False: the optimizer's own program
    after the gradients."""
    optimizer_writeback: Literal["forward", "backward"] = "forward"
    """With the overlapped optimizer, when each bucket's new master and state go back to the
    host: ``forward``, as the buckets are updated (the slot chain: at most ``optimizer.slots``
    buckets on the device, and both directions' traffic before the layers that wait for it);
    ``backward``, after the forward's loss, under the backward (the forward's link carries only
    the copies in, 12 of the 24 bytes a parameter; every updated bucket stays on the device
    until then: (4 + S) * P bytes, S = 8 for AdamW). The same numbers either way."""
    attention: Literal["auto", "cudnn", "xla"] = "auto"
    """Attention kernel: cuDNN flash attention on GPU, XLA elsewhere (``auto``)."""
    layer_loop: Literal["auto", "scan", "unrolled"] = "auto"
    """How the layer stack is traced (``pf.sco_scan``'s ``loop``): ``scan`` compiles one layer
    whatever the depth (with the overlapped optimizer, one layer and the next layer's update);
    ``unrolled`` traces every layer (compile time grows with depth); ``auto``: ``scan``
    (``plan.operators.choose_layer_loop``). XLA overlaps host copies with compute within
    straight-line code, which the unrolled stack is and a scanned iteration's body is."""

    @property
    def chosen_by_planner(self) -> tuple[str, ...]:
        """The operators left to the planner (``auto``)."""
        return tuple(name for name in AUTO_OPERATORS if getattr(self, name) == "auto")

    @property
    def all_off(self) -> OperatorsConfig:
        """The baseline: every operator off, everything else alike."""
        return dataclasses.replace(self, moe_dispatch="ep", loss="materialized", offload="none",
                                   optimizer_offload=False)


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW with warm-up and cosine decay, global-norm clipping."""

    learning_rate: float = 3e-3
    """Peak learning rate."""
    warmup_steps: int = 10
    """W: a linear warm-up to the peak at step W + 1, starting at peak / (W + 1) (step s, from
    0, takes peak (s + 1) / (W + 1)): not from 0, which made the first step no update."""
    decay: Literal["cosine", "constant"] = "cosine"
    """After warm-up: cosine decay to ``min_learning_rate_ratio`` x peak over the run, or
    constant."""
    min_learning_rate_ratio: float = 0.1
    """Where the cosine ends, relative to the peak."""
    b1: float = 0.9
    """First-moment decay."""
    b2: float = 0.95
    """Second-moment decay."""
    eps: float = 1e-8
    """Denominator epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay."""
    max_grad_norm: float | None = 1.0
    """Global-norm clipping; None for none."""
    bucket_params: int = 100_000_000
    """beta: parameters per streamed bucket (offloaded optimizer)."""
    slots: int = 2
    """s: buckets staged on the device at once (offloaded optimizer)."""
    resident_groups: int | None = None
    """How many of the streamed optimizer's first groups keep their fp32 master and moments in
    device memory instead of the host (offloaded optimizer): 1 is the weights outside the MoE
    stack (embedding, dense layers, final norm, head), each further one the next MoE layer, up
    to 1 + the MoE layers; null: as many as fit on the device beside the step (the planner
    chooses; none where the device's memory is unknown, and on a CPU, whose host memory is the
    device's). Each resident group costs 12 bytes a parameter of device memory and saves 24
    bytes a parameter of host-link traffic a step; the first groups are the ones whose copies
    have no forward to hide under (updated before the first layer, or inside the first layers'
    forward). The numbers are the same bit for bit."""
    update_on: Literal["device", "host_cpu"] = "device"
    """Where the standard stack's AdamW (``operators.optimizer_offload: false``) keeps its state
    and runs its update: ``device``, optax on the device inside the step, the fp32 master and
    moments sharded like the params (12 bytes a parameter of device memory); ``host_cpu``, the
    ZeRO-Offload placement: the fp32 master and moments in host memory, updated by the host CPU
    (jax's CPU backend) after each step's gradients come down, the new working params sent
    back (``train.optimizer.HostCpuAdamW``). The same arithmetic either way. Never chosen by
    the planner: it is the baseline's placement, not an operator (``operators.optimizer_offload:
    auto`` resolves to false with it). One process only."""


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The loop: steps, logging, checkpoints."""

    steps: int = 60
    """Optimizer steps."""
    seed: int = 0
    """Parameter initialisation seed."""
    run_dir: str = "runs/{name}"
    """Where metrics, TensorBoard events and checkpoints go; ``{name}`` is the config's name."""
    log_every: int = 1
    """Write metrics every n steps."""
    checkpoints: bool = True
    """Save checkpoints: at the end, every ``checkpoint_every`` steps, and when the run is
    interrupted (SIGINT, SIGTERM); false: none (nothing to ``--resume`` from)."""
    checkpoint_every: int = 0
    """Also save a checkpoint every n steps; 0: only at the end (and when interrupted)."""
    keep_checkpoints: int = 2
    """How many complete checkpoints to keep."""
    async_checkpoints: bool = True
    """Write checkpoints in the background where orbax can."""
    progress: bool = True
    """Show a progress bar on a terminal."""
    profile_steps: int = 0
    """Trace this many steps after the first (which compiles) with ``jax.profiler`` into the
    run directory's ``profile/`` (TensorBoard's or xprof's trace viewer reads it) and write
    ``profile.json``: each device's streams' busy time and how much of the host copies ran
    under compute (``peakflat_jax.train.profile``); 0: none."""
    device_memory_gib: float | None = None
    """The device's memory for the fit check (GiB); None: read from the device."""
    host_memory_gib: float | None = None
    """One device's share of the host's memory for the fit check (GiB); None: the host's
    physical memory over its local devices (which a VM whose memory grows as it is used may
    report below what it can hold)."""


@dataclasses.dataclass(frozen=True)
class DeviceConfig:
    """The machine a config is meant for, so that ``peakflat plan CONFIG`` answers for it on any
    machine (a laptop plans an H200 run); its flags (``--platform``, ``--devices``,
    ``--device-memory``, ``--host-memory``) override these fields. ``peakflat train`` runs on
    the devices it finds and checks against their memory (or ``train.device_memory_gib``)."""

    platform: Literal["gpu", "cpu"] = "cpu"
    """The devices' kind; the plan's attention kernel and grouped matmul follow it."""
    count: int | None = None
    """W, the devices of the run; None: the mesh's ``data x seq`` where ``mesh.seq`` is set,
    else the devices of the machine that plans."""
    memory_gib: float | None = None
    """Memory per device in GiB (a GPU's allocator limit); None: read from the local device,
    and on a CPU, whose devices live in the host's memory, one device's share of the host."""
    host_memory_gib: float | None = None
    """Host memory per device in GiB (the share of its host's memory that one device's process
    may use); None: the planning machine's physical memory over its local devices."""
    pinned_host_pool: Literal["xla", "planned"] = "planned"
    """On a GPU, the cap of XLA's pinned-host pool, which serves the offloaded optimizer's
    state and SCO's boundaries and grows by doubling regions (up to twice the live bytes):
    ``planned``, ``peakflat train`` sets ``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB`` to the plan's
    ``pinned_pool_cap_gib`` (its pinned bytes, 10% and 2 GiB of margin) before the backend
    starts, where it is unset (``plan.host_pool``); ``xla``, XLA's own (64 GiB unless that
    variable is set). The pool is resident memory: capped, it holds the planned bytes and the
    margin instead of up to twice them (docs/plan.md)."""
    kind: str | None = None
    """The devices' kind as jax names it (``NVIDIA H200``): which measured constants the plan
    takes (``peakflat_jax/plan/measured.json``: the host runtime, cuDNN's scratch, the rates,
    the margin); None: the platform's default entry. A run takes its devices' own."""
    xla_flags: list = dataclasses.field(default_factory=list)
    """XLA flags (``--name=value``) that ``peakflat`` adds to ``XLA_FLAGS`` before the backend
    starts, for this config's commands (a flag ``XLA_FLAGS`` sets already wins); none by
    default. An experimental flag belongs here, where a config asks for it, not in every
    command: a jax upgrade may rename it, and XLA refuses a flag it does not know. E.g.
    ``--xla_gpu_experimental_parallel_async_compute_limit=8``: XLA:GPU's scheduler keeps 8 host
    copies in flight beside compute where jax 0.11.2 keeps 2, so that the streamed optimizer's
    copies hide under compute (docs/offload_adamw.md)."""


@dataclasses.dataclass(frozen=True)
class Config:
    """A whole run."""

    name: str = "tiny"
    """The run's name (default: the config file's stem)."""
    model: ModelConfig = ModelConfig()
    mesh: MeshConfig = MeshConfig()
    data: DataConfig = DataConfig()
    operators: OperatorsConfig = OperatorsConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    train: TrainConfig = TrainConfig()
    device: DeviceConfig = DeviceConfig()

    def replace(self, **sections) -> Config:
        """A copy with some fields of some sections replaced: ``replace(train={"steps": 3})``."""
        return from_dict({**to_dict(self), **{k: {**to_dict(self)[k], **v} if isinstance(v, dict)
                                             else v for k, v in sections.items()}})


# ----------------------------------------------------------------------------------------------
# Reading and checking.


def load_config(path_or_name: str | pathlib.Path, overrides: list[str] = (), *,
                resolve_pretrained=None) -> Config:
    """The config in a YAML file (a path, or the name of a preset in ``configs/``), with
    ``section.field=value`` overrides applied, checked (``check_config``). A config with
    ``model.from_pretrained`` takes its architecture from the checkpoint's config.json through
    ``resolve_pretrained(config, explicit=...)``, which ``peakflat_jax.hf.load_config`` passes
    (this module reads no checkpoint); without it such a config is refused."""
    path = pathlib.Path(path_or_name)
    presets = sorted(p.stem for p in CONFIGS_DIR.glob("*.yaml"))
    if not path.is_file() and not path.suffix:
        # A preset's name, also where a directory of that name (a run's, say) is here.
        preset = CONFIGS_DIR / f"{path_or_name}.yaml"
        if preset.is_file() or not path.exists():
            path = preset
    if path.is_dir():
        raise ConfigError(f"config: {str(path_or_name)!r} is a directory; expected a YAML file "
                          f"or a preset's name (presets in configs/: {presets})")
    if not path.exists():
        raise ConfigError(f"config: no file {str(path_or_name)!r} (presets in configs/: "
                          f"{presets})")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except OSError as error:
        raise ConfigError(f"config: {path} cannot be read ({error.strerror}); expected a "
                          f"readable YAML file") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config: {path} is not UTF-8 text; expected a YAML file") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"config: {path} is not valid YAML: {error}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config: {path} must hold a mapping of sections, got "
                          f"{type(raw).__name__}")
    raw.setdefault("name", path.stem)
    if raw.get("operators") == "auto":  # the shorthand: all four left to the planner
        raw["operators"] = {}
    for override in overrides:
        key, sep, value = override.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {override!r}: expected section.field=value")
        *sections, field = key.split(".")
        target = raw
        for section in sections:
            target = target.setdefault(section, {})
            if not isinstance(target, dict):
                raise ConfigError(f"{key}: {section} is not a section")
        target[field] = yaml.safe_load(value) if value else None
    config = from_dict(raw)
    if config.model.from_pretrained is not None:
        if resolve_pretrained is None:
            raise ConfigError("model.from_pretrained: the checkpoint's architecture is read by "
                              "peakflat_jax.hf.load_config (as the peakflat command does)")
        config = resolve_pretrained(config, explicit=set(raw.get("model") or {}))
    return check_config(config)


def from_dict(raw: dict) -> Config:
    """A Config from nested mappings; unknown keys and ill-typed values raise ConfigError naming
    the key."""
    return _build(Config, raw, "")


def to_dict(config) -> dict:
    """Nested plain mappings (YAML- and JSON-ready)."""
    return dataclasses.asdict(config)


@functools.cache
def _type_hints(cls) -> dict:
    """``typing.get_type_hints`` of a config class, evaluated once (``replace`` builds many)."""
    return typing.get_type_hints(cls)


def _build(cls, raw, prefix: str):
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping of "
                          f"{cls.__name__}'s fields, got {raw!r}")
    hints = _type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ConfigError(f"{prefix}{unknown[0]}: unknown key (fields of {cls.__name__}: "
                          f"{sorted(fields)})")
    values = {}
    for name, value in raw.items():
        values[name] = _convert(hints[name], value, f"{prefix}{name}")
    return cls(**values)


def _convert(hint, value, key: str):
    """``value`` checked (and, for nested configs, built) against the type ``hint``."""
    origin = typing.get_origin(hint)
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, f"{key}.")
    if origin is Literal:
        if value not in typing.get_args(hint):
            raise ConfigError(f"{key}: expected one of {list(typing.get_args(hint))}, got "
                              f"{value!r}")
        return value
    if origin in (typing.Union, types.UnionType):
        errors = []
        for option in typing.get_args(hint):
            try:
                return _convert(option, value, key)
            except ConfigError as error:
                errors.append(str(error).split(": ", 1)[-1])
        raise ConfigError(f"{key}: {value!r} fits none of: {'; '.join(errors)}")
    if hint is type(None):
        if value is not None:
            raise ConfigError(f"{key}: expected null, got {value!r}")
        return None
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, str) and _FLOAT.fullmatch(value.strip()):
            value = float(value)  # YAML 1.1 reads 1e-3 (no dot) as a string
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    if hint is list or origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return value
    raise TypeError(f"{key}: unsupported field type {hint}")  # a bug in this module


def optimizer_groups(model: ModelConfig) -> int:
    """How many groups the streamed optimizer's layout has (``optimizer.resident_groups`` counts
    them): the weights outside the MoE stack, then one per MoE layer."""
    return 1 + model.num_layers - model.num_dense_layers


def check_config(config: Config) -> Config:
    """Raises ConfigError naming the key for values that no mesh could run; returns config.
    (Whether the mesh divides the model is checked by ``peakflat_jax.mesh`` once the device
    count is known.)"""
    m, d, o, opt, t = (config.model, config.data, config.operators, config.optimizer,
                       config.train)
    positive = [("model.vocab_size", m.vocab_size), ("model.hidden", m.hidden),
                ("model.num_layers", m.num_layers), ("model.num_heads", m.num_heads),
                ("model.num_kv_heads", m.num_kv_heads), ("model.head_dim", m.head_dim),
                ("model.num_experts", m.num_experts), ("model.top_k", m.top_k),
                ("model.expert_ffn", m.expert_ffn), ("model.dense_ffn", m.dense_ffn),
                ("data.seq_len", d.seq_len), ("data.batch_size", d.batch_size),
                ("data.max_segments", d.max_segments),
                ("data.document_blank_lines", d.document_blank_lines),
                ("operators.max_chunks", o.max_chunks), ("optimizer.bucket_params",
                                                         opt.bucket_params),
                ("optimizer.slots", opt.slots), ("train.steps", t.steps),
                ("train.log_every", t.log_every), ("train.keep_checkpoints", t.keep_checkpoints),
                ("mesh.data", config.mesh.data)]
    for key, value in positive:
        if value < 1:
            raise ConfigError(f"{key}: expected a positive integer, got {value}")
    nonnegative = [("model.num_dense_layers", m.num_dense_layers),
                   ("model.shared_expert_ffn", m.shared_expert_ffn),
                   ("model.router_bias_rate", m.router_bias_rate),
                   ("model.sliding_window", m.sliding_window),
                   ("optimizer.warmup_steps", opt.warmup_steps),
                   ("optimizer.weight_decay", opt.weight_decay),
                   ("optimizer.learning_rate", opt.learning_rate),
                   ("train.checkpoint_every", t.checkpoint_every),
                   ("train.profile_steps", t.profile_steps)]
    for key, value in nonnegative:
        if not value >= 0:  # NaN too
            raise ConfigError(f"{key}: expected a non-negative number, got {value}")
    if m.num_dense_layers > m.num_layers:
        raise ConfigError(f"model.num_dense_layers: expected at most model.num_layers = "
                          f"{m.num_layers}, got {m.num_dense_layers}")
    if m.num_heads % m.num_kv_heads:
        raise ConfigError(f"model.num_heads: expected a multiple of model.num_kv_heads = "
                          f"{m.num_kv_heads}, got {m.num_heads}")
    if m.head_dim % 2:
        raise ConfigError(f"model.head_dim: expected an even number (RoPE pairs), got "
                          f"{m.head_dim}")
    if m.top_k > m.num_experts:
        raise ConfigError(f"model.top_k: expected at most model.num_experts = "
                          f"{m.num_experts}, got {m.top_k}")
    for key, value in (("model.init_std", m.init_std),
                       ("model.embedding_init_std", m.embedding_init_std),
                       ("model.head_init_std", m.head_init_std)):
        if value is not None and not (value >= 0 and math.isfinite(value)):
            raise ConfigError(f"{key}: expected a finite non-negative number, got {value}")
    if not (m.swiglu_limit > 0 and math.isfinite(m.swiglu_limit)):
        raise ConfigError(f"model.swiglu_limit: expected a finite positive number, got "
                          f"{m.swiglu_limit}")
    if m.rope_scaling == "yarn" and m.rope_original_context < 1:
        raise ConfigError(f"model.rope_original_context: expected a positive integer, got "
                          f"{m.rope_original_context}")
    if m.rope_scaling_factor < 1 or not math.isfinite(m.rope_scaling_factor):
        raise ConfigError(f"model.rope_scaling_factor: expected a finite number >= 1, got "
                          f"{m.rope_scaling_factor}")
    check_data_fields(d)
    if d.source != "synthetic" and d.tokenizer in (None, "bytes") and m.vocab_size < 260:
        raise ConfigError(f"model.vocab_size: byte-level text needs at least 260 (256 bytes + "
                          f"4 specials), got {m.vocab_size}")
    if config.mesh.seq == 0 or config.mesh.seq < -1:
        raise ConfigError(f"mesh.seq: expected a positive integer or -1 (the rest), got "
                          f"{config.mesh.seq}")
    if o.token_budget is not None and o.token_budget < 1:
        raise ConfigError(f"operators.token_budget: expected null or a positive integer, got "
                          f"{o.token_budget}")
    offload = o.offload
    if isinstance(offload, bool):
        raise ConfigError("operators.offload: expected none, all, a count, a list of "
                          "model.num_layers bools, or a host budget in GiB (a float)")
    if isinstance(offload, int) and not 0 <= offload <= m.num_layers:
        raise ConfigError(f"operators.offload: expected a count in [0, model.num_layers = "
                          f"{m.num_layers}], got {offload}")
    if isinstance(offload, list) and (len(offload) != m.num_layers or not all(
            isinstance(x, bool) for x in offload)):
        raise ConfigError(f"operators.offload: expected a list of model.num_layers = "
                          f"{m.num_layers} bools, got {offload}")
    if isinstance(offload, float) and not offload >= 0:
        raise ConfigError(f"operators.offload: expected a non-negative host budget in GiB, got "
                          f"{offload}")
    if o.loss_mode == "gather_kernel" and o.loss == "materialized":
        raise ConfigError("operators.loss_mode: gather_kernel is a schedule of the ring loss "
                          "(operators.loss: ring)")
    if not 0 <= opt.b1 < 1 or not 0 <= opt.b2 < 1:
        raise ConfigError(f"optimizer.b1/b2: expected numbers in [0, 1), got {opt.b1}, "
                          f"{opt.b2}")
    if opt.update_on == "host_cpu" and o.optimizer_offload is True:
        raise ConfigError("optimizer.update_on: host_cpu (the update on the host CPU) contradicts "
                          "operators.optimizer_offload: true (the state streamed through the "
                          "device, updated there); set one of them")
    if opt.update_on == "host_cpu" and (config.mesh.num_processes or 1) > 1:
        raise ConfigError(f"optimizer.update_on: host_cpu runs in one process (its host state "
                          f"is one process's), got mesh.num_processes = "
                          f"{config.mesh.num_processes}")
    num_groups = optimizer_groups(m)
    if opt.resident_groups is not None and not 0 <= opt.resident_groups <= num_groups:
        raise ConfigError(f"optimizer.resident_groups: expected an integer from 0 to "
                          f"{num_groups} (the weights outside the MoE stack, then each of its "
                          f"{num_groups - 1} layers), got {opt.resident_groups}")
    if opt.resident_groups and (o.optimizer_offload is False or opt.update_on == "host_cpu"):
        raise ConfigError(f"optimizer.resident_groups: keeps part of the streamed optimizer's "
                          f"state on the device, but the optimizer is not streamed "
                          f"(operators.optimizer_offload: {o.optimizer_offload}, "
                          f"optimizer.update_on: {opt.update_on}); set it to 0")
    if opt.max_grad_norm is not None and opt.max_grad_norm <= 0:
        raise ConfigError(f"optimizer.max_grad_norm: expected null or a positive number, got "
                          f"{opt.max_grad_norm}")
    for key, value in (("train.device_memory_gib", t.device_memory_gib),
                       ("train.host_memory_gib", t.host_memory_gib)):
        if value is not None and not value > 0:
            raise ConfigError(f"{key}: expected null or a positive number of GiB, got {value}")
    target = config.device
    if target.count is not None and target.count < 1:
        raise ConfigError(f"device.count: expected null or a positive integer, got "
                          f"{target.count}")
    for key, value in (("device.memory_gib", target.memory_gib),
                       ("device.host_memory_gib", target.host_memory_gib)):
        if value is not None and not (value > 0 and math.isfinite(value)):
            raise ConfigError(f"{key}: expected null or a positive number of GiB, got {value}")
    for flag in target.xla_flags:
        if not (isinstance(flag, str) and re.fullmatch(r"--xla_\w+(=\S+)?", flag)):
            raise ConfigError(f"device.xla_flags: expected XLA flags like --xla_name=value, "
                              f"got {flag!r}")
    return config


def check_data_fields(data: DataConfig):
    """ConfigError naming the field when a JSONL source's fields do not say what its lines
    hold: ``data.path``, and either ``data.text_field`` or both ``data.prompt_field`` and
    ``data.response_field``. (The files themselves are read by ``peakflat_jax.train.data``.)"""
    if data.source != "jsonl":
        return
    if data.path is None:
        raise ConfigError("data.path: the jsonl source needs a JSONL file (one JSON object a "
                          "line)")
    chat = (data.prompt_field, data.response_field)
    if data.text_field is not None and any(field is not None for field in chat):
        raise ConfigError("data.text_field: set either it (documents) or data.prompt_field "
                          "and data.response_field (chat examples), not both")
    if data.text_field is None:
        if chat == (None, None):
            raise ConfigError("data.text_field: the jsonl source needs the field that holds a "
                              "document's text, or data.prompt_field and data.response_field "
                              "for chat examples")
        for key, value in zip(("data.prompt_field", "data.response_field"), chat):
            if value is None:
                raise ConfigError(f"{key}: chat examples need both data.prompt_field and "
                                  f"data.response_field")
