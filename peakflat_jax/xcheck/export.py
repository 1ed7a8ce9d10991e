"""The JAX side of ``peakflat xcheck``: fresh random inputs, and what the JAX stack computes from
them, written for the PyTorch side (``torch_side.py``) to recompute and compare.

``export(directory, config=..., dtype=..., seed=...)`` writes one ``<case>.npz`` per case and
``manifest.json``. Each case is one function of the library, run on the config's mesh (the 8
simulated CPU devices in tests: every operator is the distributed one, its collectives
included):

* ``cross_entropy_*``: ``ring_cross_entropy`` on global arrays (vocab-parallel over every
  device, a padded vocabulary, ignored targets, several strips per shard), once per schedule,
  and the mean reduction where the operator has it;
* ``moe``: ``pipelined_moe`` in several strided chunks under skewed routing (``skew.py``) with
  LLEP on and a small spill piece, so that experts spill and their weights migrate (the
  manifest records how many slots spilled and how many weights moved);
* ``checkpointed_stack``: ``sco_scan`` over residual SiLU MLP layers with a pytree carry (the
  hidden state and a running scalar), some boundaries offloaded;
* ``adamw``: the trainer's ``offload_stream_adamw`` (its schedule, weight decay, clipping) over
  several steps, buckets splitting leaves, params FSDP-sharded;
* ``model``: one forward + backward of the config's ``MoEDecoder`` on one batch of the
  trainer's data pipeline, the operators as the config sets them. Its norm scales and the
  router's balancing bias are drawn away from their initial ones and zeros, so that a side
  that dropped them would differ.

Shapes come from the config (hidden, vocab, experts, top-k, FFN widths, layers; tokens per
device capped at ``MAX_TOKENS_PER_DEVICE`` for the operator cases), so a user checks their own
widths. Outputs and gradients are exported in the dtypes JAX returns; bfloat16 arrays are stored
as their uint16 bit patterns (numpy has no bfloat16), which the manifest says. Gradients are of
``sum(output * cotangent)`` with an exported random cotangent, or of the scalar loss.

The manifest (``FORMAT``): the seed, dtype, config name and model section, jax version,
device, matmul precision, commit; per case its function, parameters, tolerance kind, the
seconds its JAX side took (``export_seconds``), and per array its name, shape, dtype, storage,
role (input / output / gradient) and what it is.

Why fp32 matmuls run at "highest" precision: on GPUs XLA's default fp32 dot is TF32 (10-bit
mantissa), which no fp32 tolerance admits and which torch does not use by default; the check
is about the function, so both sides compute fp32 as fp32.

Legend: N tokens (all devices), H hidden, V vocab (V' padded to the device count), E experts,
k top-k, F FFN width, L layers, W devices.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import inspect
import json
import math
import pathlib
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from peakflat_jax import mesh as mop
from peakflat_jax import skew
from peakflat_jax.config import Config, ConfigError, to_dict
from peakflat_jax.hf.config import load_config
from peakflat_jax.model.decoder import IGNORE
from peakflat_jax.ops.global_forms import pipelined_moe_global, ring_cross_entropy_global
from peakflat_jax.ops.llep_plan import LLEPConfig, llep_assignment
from peakflat_jax.ops.ring_cross_entropy import ring_cross_entropy
from peakflat_jax.ops.sco import sco_scan

FORMAT = "peakflat-xcheck/1"
DTYPES = ("float32", "bfloat16")
MAX_TOKENS_PER_DEVICE = 256
"""Tokens per device of the operator cases (at most; the config's own count if smaller)."""
ADAMW_STEPS = 6
ADAMW_WARMUP = 2
MAX_BATCHES_SEARCHED = 32
"""The model case takes the first batch that packs two documents into one row (attention's
segment mask then matters), looking this far."""


@dataclasses.dataclass
class Case:
    """One exported function: its arrays in order, with their roles and meaning."""

    name: str
    function: str  # what torch_side computes: cross_entropy, moe, checkpointed_stack, ...
    tolerance: str  # "simple" | "complex": torch_side's tolerance table
    description: str
    params: dict[str, Any] = dataclasses.field(default_factory=dict)
    arrays: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    entries: list[dict] = dataclasses.field(default_factory=list)
    seconds: float = 0.0  # wall time of the JAX side: tracing, compiling, running, fetching

    def add(self, name: str, value, role: str, what: str) -> None:
        value = np.asarray(jax.device_get(value))
        dtype = "bfloat16" if value.dtype == jnp.bfloat16 else str(value.dtype)
        stored = value.view(np.uint16) if dtype == "bfloat16" else value
        self.arrays[name] = stored
        self.entries.append({"name": name, "shape": list(value.shape), "dtype": dtype,
                             "storage": "uint16 bits" if dtype == "bfloat16" else dtype,
                             "role": role, "what": what})


def export(directory: str | pathlib.Path, *, config: str = "tiny", overrides: tuple = (),
           dtype: str = "float32", seed: int = 0,
           log: Callable[[str], None] | None = None) -> dict:
    """Writes every case and the manifest under ``directory``; returns the manifest. ``log``
    gets one line as the setup and as each case finishes, with its seconds (``peakflat xcheck``
    prints them flushed, so that a log cut off by a timeout shows where the time went)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype: expected one of {DTYPES}, got {dtype!r}")
    log = log or (lambda line: None)
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    run_config = load_config(config, [*overrides, f"model.dtype={dtype}", f"train.seed={seed}",
                                      f"data.seed={seed}"])
    _check_torch_side_models(run_config.model)
    from peakflat_jax.plan.operators import with_operators_on
    from peakflat_jax.train.trainer import Trainer

    # The check is of the operators: those a config leaves auto are checked on.
    trainer = Trainer(with_operators_on(run_config), run_dir=str(directory / "unused"))
    log(f"xcheck export: setup (config, plan, data pipeline) {time.perf_counter() - started:.1f} s")
    rng = np.random.default_rng(seed)
    precision = "highest" if dtype == "float32" else "default"
    # In this order: each draws its inputs from the one rng, so the order fixes every input.
    makers = [lambda: cross_entropy_case(trainer, rng, "move_weights"),
              lambda: cross_entropy_case(trainer, rng, "move_activations")]
    if "reduction" in inspect.signature(ring_cross_entropy).parameters:
        makers.append(lambda: cross_entropy_case(trainer, rng, "auto", reduction="mean"))
    makers += [lambda: moe_case(trainer, rng), lambda: checkpointed_stack_case(trainer, rng),
               lambda: adamw_case(trainer, rng), lambda: model_case(trainer, rng)]
    cases = []
    with jax.default_matmul_precision(precision) if dtype == "float32" else (
            contextlib.nullcontext()):
        for make in makers:
            started = time.perf_counter()
            case = make()  # its arrays are fetched to the host: the case's work is done
            case.seconds = time.perf_counter() - started
            log(f"xcheck export: {case.name} {case.seconds:.1f} s")
            cases.append(case)
    from peakflat_jax.bench.harness import describe_device, git_commit

    manifest = {
        "format": FORMAT, "seed": seed, "dtype": dtype, "config": run_config.name,
        "overrides": list(overrides), "model": to_dict(run_config.model),
        "jax_version": jax.__version__, "device": describe_device(),
        "mesh": dict(trainer.mesh.shape), "matmul_precision": precision,
        "commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cases": {},
    }
    for case in cases:
        file = f"{case.name}.npz"
        np.savez(directory / file, **case.arrays)
        manifest["cases"][case.name] = {
            "file": file, "function": case.function, "tolerance": case.tolerance,
            "description": case.description, "params": case.params,
            "export_seconds": round(case.seconds, 3), "arrays": case.entries}
    (directory / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


# ----------------------------------------------------------------------------------------------
# Helpers.


def _check_torch_side_models(model) -> None:
    """ConfigError naming a model field that torch_side.py does not implement (gpt-oss's:
    tests/test_hf.py holds those against transformers' own gpt-oss instead), which it would
    otherwise compare against a model without it."""
    defaults = type(model)()
    fields = ("attention_bias", "attention_sinks", "sliding_window", "router_logit_bias",
              "expert_bias", "expert_activation")
    different = [name for name in fields if getattr(model, name) != getattr(defaults, name)]
    if model.rope_scaling == "yarn":
        different.append("rope_scaling")
    if different:
        raise ConfigError(f"model.{different[0]}: {getattr(model, different[0])!r} is not "
                          f"modelled by the PyTorch side of xcheck (tests/test_hf.py checks it "
                          f"against transformers' gpt-oss)")


def _working_dtype(config: Config):
    return jnp.dtype(config.model.dtype)


def _tokens(trainer) -> tuple[int, int]:
    """(tokens per device, devices) of the operator cases."""
    config, width = trainer.config, mop.num_devices(trainer.mesh)
    per_device = config.data.batch_size * config.data.seq_len // width
    return max(1, min(per_device, MAX_TOKENS_PER_DEVICE)), width


def _normal(rng, shape, std=1.0) -> np.ndarray:
    """fp32 normals, drawn as fp32: at h200-1's widths the MoE case draws hundreds of millions,
    and drawing float64 to cast was several times slower (docs/xcheck.md)."""
    value = rng.standard_normal(shape, dtype=np.float32)
    value *= np.float32(std)
    return value


def _put(mesh, value, spec: P, dtype=None) -> jax.Array:
    value = jnp.asarray(value, dtype)
    return jax.device_put(value, NamedSharding(mesh, spec))


def _value_and_vjp(fn):
    """``f(differentiated, others, cotangent) -> (fn(*differentiated, *others), the gradients
    of sum(cotangent * output) for the differentiated arguments)``, one program to jit.

    Every array a compiled program reads is its argument: a ``jax.jit`` of the function
    ``jax.vjp`` returns would close over the forward's residuals (the MoE case's expert
    weights, over a GB at h200-1's widths), and XLA would compile them into the backward as
    constants, which made the MoE case's compile several times longer (docs/xcheck.md)."""
    def value_and_vjp(differentiated, others, cotangent):
        value, vjp = jax.vjp(lambda *args: fn(*args, *others), *differentiated)
        return value, vjp(cotangent)

    return value_and_vjp


# ----------------------------------------------------------------------------------------------
# The cases.


def cross_entropy_case(trainer, rng, mode: str, reduction: str = "none") -> Case:
    """``ring_cross_entropy`` over every device: per-token losses (or their mean) of
    ``hidden @ kernel[:, :V]``, and the gradients for hidden and kernel."""
    config, mesh = trainer.config, trainer.mesh
    per_device, width = _tokens(trainer)
    tokens, hidden_size = per_device * width, config.model.hidden
    vocab = config.model.vocab_size
    padded = mop.padded_vocab(vocab, width)
    shard = padded // width
    block = config.operators.vocab_block or max(1, -(-shard // 3))
    dtype = _working_dtype(config)
    hidden = _put(mesh, _normal(rng, (tokens, hidden_size)), P(mop.ALL), dtype)
    kernel = _put(mesh, _normal(rng, (hidden_size, padded), 2 / math.sqrt(hidden_size)),
                  P(None, mop.ALL), dtype)
    targets = rng.integers(0, vocab, tokens).astype(np.int32)
    targets[rng.random(tokens) < 0.1] = IGNORE
    targets = _put(mesh, targets, P(mop.ALL))
    options = dict(mesh=mesh, axis_name=mop.ALL, vocab_size=vocab, mode=mode,
                   ignore_index=IGNORE, vocab_block=block)
    if reduction != "none":
        options["reduction"] = reduction

    def loss_fn(hidden, kernel, targets):
        return ring_cross_entropy_global(hidden, kernel, targets, **options)

    name = f"cross_entropy_{mode}" if reduction == "none" else f"cross_entropy_{reduction}"
    case = Case(name, "cross_entropy", "simple",
                f"pf.ring_cross_entropy (global form over {width} devices, mode {mode}, "
                f"reduction {reduction}) vs torch.nn.functional.cross_entropy over the "
                f"materialized logits hidden @ kernel[:, :V]",
                params=dict(vocab_size=vocab, ignore_index=IGNORE, mode=mode,
                            reduction=reduction, vocab_block=block, ring_size=width,
                            shard_width=shard))
    if reduction == "none":
        cotangent = _put(mesh, _normal(rng, (tokens,)), P(mop.ALL))
        loss, (d_hidden, d_kernel) = jax.jit(_value_and_vjp(loss_fn))(
            (hidden, kernel), (targets,), cotangent)
    else:
        cotangent = None
        loss, (d_hidden, d_kernel) = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1)))(
            hidden, kernel, targets)
    case.add("hidden", hidden, "input", "[N, H] final hidden states, split over the devices")
    case.add("kernel", kernel, "input", "[H, V'] output head, vocab split over the devices; "
             "columns >= vocab_size are padding")
    case.add("targets", targets, "input", f"[N] target ids, {IGNORE} where ignored")
    if cotangent is not None:
        case.add("cotangent", cotangent, "input", "[N] weights g: gradients are of sum(g * loss)")
    case.add("loss", loss, "output", "[N] per-token loss (0 where ignored)" if reduction ==
             "none" else "scalar: mean loss over the valid targets")
    case.add("grad.hidden", d_hidden, "gradient", "d/d hidden")
    case.add("grad.kernel", d_kernel, "gradient", "d/d kernel (0 on padded columns)")
    return case


def moe_case(trainer, rng) -> Case:
    """``pipelined_moe`` in several chunks under skewed routing with LLEP spilling."""
    config, mesh = trainer.config, trainer.mesh
    model = config.model
    per_device, width = _tokens(trainer)
    tokens, hidden_size = per_device * width, model.hidden
    experts, top_k, ffn = model.num_experts, model.top_k, model.expert_ffn
    dtype = _working_dtype(config)
    profile = skew.SkewProfile(0.8, max(1, min(2, experts - 1)))
    ids = np.concatenate([skew.route(per_device, top_k, experts, profile)] * width)
    token_budget = max(1, -(-per_device // 4))
    llep = config.operators.llep
    min_tokens = max(1, per_device * top_k // (4 * width))
    x = _put(mesh, _normal(rng, (tokens, hidden_size)), P(mop.ALL), dtype)
    gates = _put(mesh, rng.random((tokens, top_k)).astype(np.float32), P(mop.ALL))
    w_gate = _put(mesh, _normal(rng, (experts, hidden_size, ffn), hidden_size ** -0.5),
                  P(mop.ALL), dtype)
    w_up = _put(mesh, _normal(rng, (experts, hidden_size, ffn), hidden_size ** -0.5),
                P(mop.ALL), dtype)
    w_down = _put(mesh, _normal(rng, (experts, ffn, hidden_size), ffn ** -0.5), P(mop.ALL),
                  dtype)
    expert_ids = _put(mesh, ids, P(mop.ALL))
    cotangent = _put(mesh, _normal(rng, (tokens, hidden_size)), P(mop.ALL), dtype)
    options = dict(mesh=mesh, axis_name=mop.ALL, num_experts=experts,
                   token_budget=token_budget, max_chunks=config.operators.max_chunks,
                   membership="strided", balance="llep", llep_threshold=llep.threshold,
                   llep_capacity=llep.capacity, llep_min_tokens=min_tokens)

    def moe(x, gates, w_gate, w_up, w_down, expert_ids):
        return pipelined_moe_global(x, expert_ids, gates, w_gate, w_up, w_down, **options)

    y, grads = jax.jit(_value_and_vjp(moe))((x, gates, w_gate, w_up, w_down), (expert_ids,),
                                            cotangent)
    loads = jnp.asarray(np.bincount(ids.reshape(-1), minlength=experts))
    plan = np.asarray(llep_assignment(loads, width, LLEPConfig(
        threshold=llep.threshold, capacity=llep.capacity, min_tokens=min_tokens)))
    owner = np.arange(experts) // (experts // width)
    foreign = plan * (owner[:, None] != np.arange(width)[None, :])
    chunks = min(math.ceil(per_device / token_budget), config.operators.max_chunks)
    case = Case("moe", "moe", "complex",
                f"pf.pipelined_moe (global form, experts over {width} devices, {chunks} strided "
                f"chunks, LLEP) vs a loop over experts with SwiGLU and the gate weights",
                params=dict(num_experts=experts, top_k=top_k, devices=width,
                            chunks=chunks, token_budget=token_budget,
                            skew=profile.name, llep_min_tokens=min_tokens,
                            spilled_slots=int(foreign.sum()),
                            migrated_expert_copies=int((foreign > 0).sum())))
    case.add("x", x, "input", "[N, H] tokens")
    case.add("expert_ids", expert_ids, "input", f"[N, k] expert of each slot ({profile.name} "
             f"skew per device)")
    case.add("gates", gates, "input", "[N, k] weight of each slot")
    case.add("w_gate", w_gate, "input", "[E, H, F] gate projections")
    case.add("w_up", w_up, "input", "[E, H, F] up projections")
    case.add("w_down", w_down, "input", "[E, F, H] down projections")
    case.add("cotangent", cotangent, "input", "[N, H] g: gradients are of sum(g * y)")
    case.add("y", y, "output", "[N, H] sum_j gates[n, j] * ffn_{expert_ids[n, j]}(x[n])")
    for name, grad in zip(("x", "gates", "w_gate", "w_up", "w_down"), grads):
        case.add(f"grad.{name}", grad, "gradient", f"d/d {name}")
    return case


def checkpointed_stack_case(trainer, rng) -> Case:
    """``sco_scan`` over L residual SiLU MLP layers with a (hidden, scalar) carry."""
    config, mesh = trainer.config, trainer.mesh
    per_device, width = _tokens(trainer)
    tokens, hidden_size = per_device * width, config.model.hidden
    layers, ffn = config.model.num_layers, config.model.dense_ffn
    dtype = _working_dtype(config)
    offload = tuple(i % 2 == 0 for i in range(layers))
    h = _put(mesh, _normal(rng, (tokens, hidden_size)), P(mop.ALL), dtype)
    w_in = _put(mesh, _normal(rng, (layers, hidden_size, ffn), hidden_size ** -0.5), P(),
                dtype)
    w_out = _put(mesh, _normal(rng, (layers, ffn, hidden_size), 0.5 * ffn ** -0.5), P(), dtype)
    cotangent = _put(mesh, _normal(rng, (tokens, hidden_size)), P(mop.ALL), dtype)

    def layer(carry, params):
        w_in, w_out = params
        h = carry["h"] + jnp.dot(jax.nn.silu(jnp.dot(carry["h"], w_in)), w_out)
        return {"h": h, "aux": carry["aux"] + jnp.mean(jnp.square(h.astype(jnp.float32)))}

    def stack(h, w_in, w_out):
        out = sco_scan(layer, {"h": h, "aux": jnp.zeros((), jnp.float32)}, (w_in, w_out),
                       offload=offload)
        return out["h"], out["aux"]

    def objective(h, w_in, w_out, cotangent):
        out, aux = stack(h, w_in, w_out)
        return jnp.vdot(out.astype(jnp.float32), cotangent.astype(jnp.float32)) + aux

    out, aux = jax.jit(stack)(h, w_in, w_out)
    grads = jax.jit(jax.grad(objective, argnums=(0, 1, 2)))(h, w_in, w_out, cotangent)
    case = Case("checkpointed_stack", "checkpointed_stack", "simple",
                "pf.sco_scan (boundaries offloaded: " + "".join("1" if o else "0"
                                                                  for o in offload)
                + ") vs the layers under torch.utils.checkpoint",
                params=dict(layers=layers, offload=list(offload),
                            layer="h' = h + silu(h @ w_in) @ w_out; aux' = aux + mean(h'^2) "
                                  "(fp32)",
                            objective="sum(g * h_L) + aux_L"))
    case.add("h", h, "input", "[N, H] input of the first layer")
    case.add("w_in", w_in, "input", "[L, H, F] per-layer input projections")
    case.add("w_out", w_out, "input", "[L, F, H] per-layer output projections")
    case.add("cotangent", cotangent, "input", "[N, H] g")
    case.add("h_out", out, "output", "[N, H] the last layer's hidden state")
    case.add("aux_out", aux, "output", "scalar: the running sum of mean(h_l^2) (fp32)")
    for name, grad in zip(("h", "w_in", "w_out"), grads):
        case.add(f"grad.{name}", grad, "gradient", f"d objective / d {name}")
    return case


def adamw_case(trainer, rng) -> Case:
    """The trainer's offloaded AdamW over ``ADAMW_STEPS`` steps with warm-up and decay."""
    from peakflat_jax.train.optimizer import (
        hyperparams_at,
        learning_rate_schedule,
        make_offloaded,
        with_hyperparams,
    )

    config, mesh = trainer.config, trainer.mesh
    width = mop.num_devices(mesh)
    hidden_size, ffn = config.model.hidden, config.model.dense_ffn
    dtype = _working_dtype(config)
    optimizer_config = dataclasses.replace(config.optimizer, warmup_steps=ADAMW_WARMUP)
    shapes = {"kernel": (hidden_size, ffn), "bias": (ffn,), "scale": (hidden_size,)}
    per_device = sum(math.prod(s) for s in shapes.values()) // width
    optimizer_config = dataclasses.replace(optimizer_config,
                                           bucket_params=max(1, per_device // 3 + 1))
    schedule = learning_rate_schedule(optimizer_config, ADAMW_STEPS)
    optimizer = make_offloaded(optimizer_config)

    def placed(values):
        return {name: _put(mesh, value, mop.fsdp_spec(value.shape, width), dtype)
                for name, value in values.items()}

    params = placed({name: _normal(rng, shape, 0.02) for name, shape in shapes.items()})
    clip = optimizer_config.max_grad_norm or 1.0
    # Gradient norms alternately above and below the clipping norm: both branches are taken.
    norms = [clip * (3.0 if step % 2 == 0 else 0.5) for step in range(ADAMW_STEPS)]
    case = Case("adamw", "adamw", "simple",
                f"pf.offload_stream_adamw (the trainer's: {optimizer_config.decay} schedule "
                f"after {ADAMW_WARMUP} warm-up steps, weight decay, clipping; buckets of "
                f"{optimizer_config.bucket_params} params per device) vs torch.optim.AdamW on "
                f"fp32 master weights with LambdaLR and clip_grad_norm_",
                params=dict(steps=ADAMW_STEPS, leaves=list(shapes),
                            learning_rate=optimizer_config.learning_rate,
                            warmup_steps=ADAMW_WARMUP, decay=optimizer_config.decay,
                            decay_steps=max(ADAMW_STEPS, ADAMW_WARMUP + 1),
                            end_value=optimizer_config.learning_rate
                            * optimizer_config.min_learning_rate_ratio,
                            b1=optimizer_config.b1, b2=optimizer_config.b2,
                            eps=optimizer_config.eps,
                            weight_decay=optimizer_config.weight_decay,
                            max_grad_norm=optimizer_config.max_grad_norm,
                            bucket_params=optimizer_config.bucket_params))
    for name, value in params.items():
        case.add(f"params.{name}", value, "input", f"{list(value.shape)} initial working "
                 f"params (the fp32 master starts as their upcast)")
    state = optimizer.init(params)
    rates = []
    for step in range(ADAMW_STEPS):
        raw = {name: _normal(rng, shape) for name, shape in shapes.items()}
        scale = norms[step] / math.sqrt(sum(float(np.sum(g.astype(np.float64) ** 2))
                                            for g in raw.values()))
        grads = placed({name: g * scale for name, g in raw.items()})
        for name, grad in grads.items():
            case.add(f"step{step}.grads.{name}", grad, "input", f"step {step}'s gradient")
        rates.append(float(schedule(step)))
        state = with_hyperparams(state, hyperparams_at(optimizer_config, schedule, step))
        working, state = optimizer.step(grads, state)
        master = {name: np.asarray(jax.device_get(leaf))
                  for name, leaf in optimizer.master_params(state).items()}
        for name in shapes:
            case.add(f"step{step}.master.{name}", master[name], "output",
                     f"fp32 master after step {step}")
            case.add(f"step{step}.working.{name}", working[name], "output",
                     f"working params after step {step} (the master in the params' dtype)")
    case.add("learning_rate", np.asarray(rates, np.float32), "output",
             "[steps] the schedule's learning rate at each step")
    return case


def model_case(trainer, rng) -> Case:
    """One forward + backward of the config's decoder on one batch of the data pipeline."""
    from flax import nnx

    from peakflat_jax.hf.load import init_or_load
    from peakflat_jax.model.layers import rope_frequencies
    from peakflat_jax.train.trainer import split_model_state

    config, mesh = trainer.config, trainer.mesh
    model_config = config.model
    graphdef, state = init_or_load(model_config, mesh, config.train.seed)
    norm_std, bias_std = 0.1, 0.5 / model_config.num_experts

    def perturbed(path, leaf):
        names = _path_names(path)
        if names[-1] == "scale":  # RMSNorm scales: 1 + noise
            noise = _normal(rng, leaf.shape, norm_std)
            return jax.device_put((1 + noise).astype(leaf.dtype), leaf.sharding)
        if names[-1] == "router_bias":
            return jax.device_put(_normal(rng, leaf.shape, bias_std), leaf.sharding)
        return leaf

    state = jax.tree_util.tree_map_with_path(perturbed, state)
    params, extras = split_model_state(state)
    batch_index, batch = _packed_batch(trainer.batches)
    batch = trainer.global_batch(batch)

    def loss_fn(params, extras, batch):
        model = nnx.merge(graphdef, params, extras)
        return model(batch, trainer.runtime, trainer.offload)

    (loss, counts), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(params, extras,
                                                                               batch)
    ops = config.operators
    case = Case("model", "model", "complex",
                f"MoEDecoder ({config.name}: moe {ops.moe_dispatch}, loss {ops.loss}, offload "
                f"{sum(trainer.offload)}/{len(trainer.offload)}, attention "
                f"{trainer.runtime.attention}) vs the same model in plain PyTorch",
                params=dict(model=to_dict(model_config),
                            padded_vocab=mop.padded_vocab(model_config.vocab_size,
                                                          mop.num_devices(mesh)),
                            ignore_index=IGNORE, batch_index=batch_index,
                            operators=to_dict(ops), norm_scale_std=norm_std,
                            router_bias_std=bias_std))
    frequencies = rope_frequencies(model_config)
    case.add("rope.inverse_frequencies", frequencies, "input",
             "[D/2] RoPE inverse frequencies as JAX computes them (fp32): the PyTorch model "
             "rotates by these, so that a one-ulp difference of fp32 pow between the libraries, "
             "multiplied by positions up to T, is not mistaken for a model difference")
    case.add("rope.inverse_frequencies.recomputed", frequencies, "output",
             "the same table, which the PyTorch side recomputes from the config and compares")
    for key in ("tokens", "targets", "positions", "segment_ids"):
        case.add(f"batch.{key}", batch[key], "input", f"[B, T] {key} of the data pipeline's "
                 f"batch {batch_index}")
    num_dense = model_config.num_dense_layers
    for path, leaf in _layer_leaves(state, num_dense):
        case.add(path, leaf, "input", "weight" if "router_bias" not in path else
                 "the router's balancing bias (choice only, no gradient)")
    case.add("loss", loss, "output", "scalar: mean cross-entropy over targets != -100")
    case.add("expert_counts", counts, "output", "[L_moe, E] token-slots routed to each expert")
    for path, leaf in _layer_leaves(grads, num_dense):
        case.add(f"grad.{path}", leaf, "gradient", "d loss / d weight")
    return case


def _packed_batch(batches) -> tuple[int, dict]:
    """(index, batch): the first batch with a row that packs two documents, else the first."""
    first = None
    for index in range(MAX_BATCHES_SEARCHED):
        batch = next(batches)
        if np.any(np.max(batch["segment_ids"], axis=1) > 1):
            return index, batch
        first = first or (index, batch)
    return first


def _layer_leaves(state, num_dense: int):
    """(name, array) of every leaf, the stacked layers unstacked: ``layers.{i}.<path>`` with i
    counting the dense layers first, then the MoE layers."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(state):
        names = _path_names(path)
        if names[0] in ("dense_layers", "moe_layers"):
            first = 0 if names[0] == "dense_layers" else num_dense
            value = np.asarray(jax.device_get(leaf))
            for index in range(value.shape[0]):
                yield f"layers.{first + index}." + ".".join(names[1:]), value[index]
        else:
            yield ".".join(names), leaf


def _path_names(path) -> tuple[str, ...]:
    """The names along an nnx state path, without a trailing 'value'."""
    names = tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in path)
    return names[:-1] if names and names[-1] == "value" else names
