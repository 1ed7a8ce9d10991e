"""``peakflat train``: the training loop of the MoP decoder.

Per step: a global batch from the data pipeline (each process feeds its rows), the loss and
gradients in one compiled program (the layer stack through SCO, the loss through Ring-DTP, as
configured), then AdamW: fused into the same program when its state is on the device, or
``pf.offload_stream_adamw``'s own program when its state is in host memory. The router's
balancing bias moves after every step from that step's per-expert counts.

Before compiling: the config's keys and values, the mesh against the model and batch, and the
planner's closed-form bound against the device's memory (``peakflat_jax.plan``). After
compiling, and before the first step: XLA's own plan of the step against the device's memory.
Either refusal names the terms and what to change.

Reported per step (JSONL + TensorBoard under ``train.run_dir``, a progress bar on a terminal):
loss, learning rate, gradient norm, tokens/s, model TFLOP/s per device and MFU (model FLOPs of
each batch by ``model.size``'s convention, attention within documents; MFU of the device's
measured matmul rate, ``train.metrics``), peak device memory, host memory. A batch without a
valid target is reported and skipped (its mean loss is NaN).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from peakflat_jax import mesh as mop
from peakflat_jax.config import Config, ConfigError, to_dict
from peakflat_jax.model.attention import choose_implementation
from peakflat_jax.model.decoder import IGNORE
from peakflat_jax.model.layers import Runtime
from peakflat_jax.model.sharding import init_model
from peakflat_jax.model.size import model_flops_per_token
from peakflat_jax.ops.sco import PerLayer
from peakflat_jax.plan import DoesNotFit, check_plan, offload_flags
from peakflat_jax.train import checkpoint as ckpt
from peakflat_jax.train import data as data_pipeline
from peakflat_jax.train import metrics as report
from peakflat_jax.train.optimizer import DeviceAdamW, learning_rate_schedule, make_offloaded

_PROGRAMS: dict[tuple, object] = {}
"""The compiled step programs of this process, by what each depends on (``_program_key``)."""
_OPTIMIZERS: dict[tuple, object] = {}
"""The offloaded optimizer of each config in this process (it holds its compiled step)."""


@dataclasses.dataclass
class TrainState:
    """Everything a step changes: weights (trainable params and the router's bias), optimizer
    state and the step count (the data iterator keeps its own position)."""

    params: Any
    extras: Any
    opt_state: Any
    step: int
    pending: Any = None
    """With the optimizer overlapped: the last step's gradients, whose update the next step's
    program applies (None when every step's update is applied)."""


def boundary_offload(config: Config, mesh) -> tuple[bool, ...]:
    """``operators.offload`` as L bools (the planner's rule: a host budget in GiB per device
    takes as many leading boundaries as it holds)."""
    tokens = config.data.batch_size * config.data.seq_len // mop.num_devices(mesh)
    return offload_flags(config, tokens)


def runtime_for(config: Config, mesh) -> Runtime:
    platform = np.asarray(mesh.devices).flat[0].platform
    ops = config.operators
    try:
        attention = choose_implementation(ops.attention, platform, config.model.dtype)
    except ValueError as error:
        raise ConfigError(f"operators.attention: {error}") from None
    budget = ops.token_budget if ops.moe_dispatch == "pipelined" else None
    return Runtime(mesh=mesh, operators=ops, attention=attention,
                   max_segments=1 if config.data.source == "synthetic" else
                   config.data.max_segments, token_budget=budget)


def split_model_state(state):
    """(trainable params, the router's bias and other non-trained variables)."""
    return nnx.split_state(state, nnx.Param, ...)


class Trainer:
    """One run: ``Trainer(config).run(resume=False) -> summary``."""

    def __init__(self, config: Config, *, run_dir: str | None = None):
        mop.initialize_distributed(config.mesh)
        self.mesh = mop.make_mesh(config.mesh)
        mop.check_model_fits_mesh(config, self.mesh)
        # The planner's closed-form bound before anything compiles: an infeasible config is
        # refused with its table of terms; knobs left null (token_budget, vocab_block) are
        # filled as planned.
        self.plan = check_plan(config, self.mesh)
        self.config = config = self.plan.filled_config()
        self.runtime = runtime_for(config, self.mesh)
        self.xla_plan = None  # XLA's plan of the largest compiled program, once compiled
        self.offload = boundary_offload(config, self.mesh)
        self.run_dir = pathlib.Path(run_dir or config.train.run_dir.format(name=config.name))
        self.total_steps = config.train.steps
        self.offloaded_optimizer = config.operators.optimizer_offload
        # Overlapping hides the MoE layers' updates under the forward: without MoE layers there
        # is nothing to hide them under.
        self.overlap = (self.offloaded_optimizer and config.operators.optimizer_overlap
                        and config.model.num_layers > config.model.num_dense_layers)
        self.schedule = learning_rate_schedule(config.optimizer, self.total_steps)
        self.batches = data_pipeline.make_batches(
            config.data, vocab_size=config.model.vocab_size,
            process_index=jax.process_index(), process_count=jax.process_count())
        self.flops_per_token = model_flops_per_token(config.model, config.data.seq_len)

    # -- state --------------------------------------------------------------------------------

    def initial_state(self) -> TrainState:
        graphdef, state = init_model(self.config.model, self.mesh, self.config.train.seed)
        self.graphdef = graphdef
        params, extras = split_model_state(state)
        if self.offloaded_optimizer:
            # One optimizer object per config in a process: its compiled step is reused.
            key = (json.dumps(to_dict(self.config.optimizer), sort_keys=True), self.total_steps)
            self.optimizer = _OPTIMIZERS.setdefault(
                key, make_offloaded(self.config.optimizer, self.total_steps))
            # Each MoE layer's weights form their own buckets (layer groups), in both modes, so
            # that overlapping changes no bit.
            opt_state = self.optimizer.init(params, stacked_layers=moe_stack_mask(params))
        else:
            self.optimizer = DeviceAdamW(self.config.optimizer, self.total_steps)
            # The master and moments sharded like the params (FSDP), the step counts
            # replicated: left to itself, jit put optax's zeros on every device whole.
            shardings = shardings_like_params(jax.eval_shape(self.optimizer.init, params),
                                              params, NamedSharding(self.mesh, P()))
            opt_state = jax.jit(self.optimizer.init, out_shardings=shardings)(params)
        return TrainState(params, extras, opt_state, 0)

    # -- the compiled programs ------------------------------------------------------------------

    def _loss(self, params, extras, batch):
        model = nnx.merge(self.graphdef, params, extras)
        return model(batch, self.runtime, self.offload)

    def _balanced_extras(self, extras, counts):
        """The router's bias moved against each expert's load error (DeepSeek-V3's
        auxiliary-loss-free balancing): up for experts below the mean load, down above."""
        rate = self.config.model.router_bias_rate
        if rate == 0 or counts.shape[0] == 0:
            return extras

        def move(path, leaf):
            if not any(getattr(k, "key", None) == "router_bias" for k in path):
                return leaf
            load = counts.astype(jnp.float32)
            error = jnp.mean(load, axis=-1, keepdims=True) - load
            return leaf + rate * jnp.sign(error)

        return jax.tree_util.tree_map_with_path(move, extras)

    def _gradients(self, params, extras, batch):
        (loss, counts), grads = jax.value_and_grad(self._loss, has_aux=True)(params, extras,
                                                                             batch)
        grad_norm = optax_global_norm(grads)
        return loss, counts, grads, grad_norm, self._balanced_extras(extras, counts)

    def compile(self, state: TrainState, batch) -> None:
        """Compiles the step's programs and checks XLA's plan of each against the device's
        memory. A program compiled earlier in this process for what it depends on (the
        gradient program: model, mesh, data and operators; the steps that update: the optimizer
        and the step count too) is reused: a resumed run, a test, a benchmark's modes."""
        kept = jax.tree.map(lambda a: a.sharding, (state.params, state.extras))
        params_shardings, extras_shardings = kept  # gradients are placed as the params
        if self.offloaded_optimizer:
            def gradient_step(params, extras, batch):
                loss, counts, grads, grad_norm, extras = self._gradients(params, extras, batch)
                return dict(loss=loss, grad_norm=grad_norm, counts=counts), grads, extras

            self._gradient_step = self._compiled(
                "gradient_step", lambda: jax.jit(
                    gradient_step, donate_argnums=(1,),
                    out_shardings=(None, params_shardings, extras_shardings)).lower(
                    state.params, state.extras, batch).compile(),
                "the loss and gradient program")
            if self.overlap:
                self._overlapped_step = self._compiled(
                    "overlapped_step", lambda: jax.jit(
                        self._overlapped, donate_argnums=(0, 1, 2, 3),
                        out_shardings=(*kept, self.optimizer.state_shardings(state.opt_state),
                                       params_shardings, None)).lower(
                        state.params, state.extras, state.opt_state, state.params,
                        batch).compile(),
                    "the overlapped step")
            return

        def train_step(params, extras, opt_state, batch):
            loss, counts, grads, grad_norm, extras = self._gradients(params, extras, batch)
            params, opt_state = self.optimizer.update(grads, params, opt_state)
            return params, extras, opt_state, dict(loss=loss, grad_norm=grad_norm,
                                                   counts=counts)

        # The state comes out where it went in: each step's inputs match the compiled ones.
        opt_shardings = jax.tree.map(lambda a: a.sharding, state.opt_state)
        self._train_step = self._compiled(
            "train_step", lambda: jax.jit(
                train_step, donate_argnums=(0, 1, 2),
                out_shardings=(*kept, opt_shardings, None)).lower(
                state.params, state.extras, state.opt_state, batch).compile(),
            "the train step")

    def _program_key(self, program: str) -> tuple:
        """What a compiled program depends on: the config without the loop's bookkeeping (and,
        for the gradient program, without the optimizer), and the devices."""
        config = to_dict(self.config)
        config.pop("name")
        config["train"] = {"steps": config["train"]["steps"]}
        if program == "gradient_step":
            config.pop("optimizer")
            config.pop("train")
            for field in ("optimizer_offload", "optimizer_overlap"):
                config["operators"].pop(field)
        return (program, json.dumps(config, sort_keys=True),
                tuple(d.id for d in np.asarray(self.mesh.devices).flat))

    def _compiled(self, program: str, compile_it, what: str):
        """The program compiled (or reused), its XLA plan checked against the device."""
        key = self._program_key(program)
        if key not in _PROGRAMS:
            _PROGRAMS[key] = compile_it()
        self._check_fits(_PROGRAMS[key], what)
        return _PROGRAMS[key]

    def _check_fits(self, compiled, what: str) -> None:
        from peakflat_jax.memory import compiled_memory

        limit = self.device_memory()
        plan = compiled_memory(compiled)
        if self.xla_plan is None or plan.total > self.xla_plan.total:
            self.xla_plan = plan  # the largest of the step's programs
        if limit is not None and plan.total > limit:
            raise DoesNotFit(
                f"{what} needs {plan.total / 2**30:.2f} GiB per device by XLA's plan "
                f"(arguments {plan.argument / 2**30:.2f}, temporaries {plan.temp / 2**30:.2f}, "
                f"outputs {plan.output / 2**30:.2f}), the device has {limit / 2**30:.2f} GiB: "
                f"see `peakflat plan` for the terms and what to change")

    def device_memory(self) -> int | None:
        configured = self.config.train.device_memory_gib
        return int(configured * 2**30) if configured else report.device_memory_bytes()

    def step(self, state: TrainState, batch) -> tuple[TrainState, dict]:
        """One optimizer step; the state passed in is consumed. Overlapped, the step's update
        is left pending for the next step's program (``flush`` applies it)."""
        if self.overlap:
            if state.pending is None:
                metrics, grads, extras = self._gradient_step(state.params, state.extras, batch)
                params, opt_state = state.params, state.opt_state
            else:
                params, extras, opt_state, grads, metrics = self._overlapped_step(
                    state.params, state.extras, state.opt_state, state.pending, batch)
            return TrainState(params, extras, opt_state, state.step + 1, grads), metrics
        if self.offloaded_optimizer:
            metrics, grads, extras = self._gradient_step(state.params, state.extras, batch)
            jax.tree.map(lambda a: a.delete(), state.params)  # the optimizer writes new ones
            params, opt_state = self.optimizer.step(grads, state.opt_state)
        else:
            params, extras, opt_state, metrics = self._train_step(
                state.params, state.extras, state.opt_state, batch)
        return TrainState(params, extras, opt_state, state.step + 1), metrics

    def flush(self, state: TrainState) -> TrainState:
        """The state with a pending update applied (the optimizer's own program)."""
        if state.pending is None:
            return state
        jax.tree.map(lambda a: a.delete(), state.params)
        params, opt_state = self.optimizer.step(state.pending, state.opt_state)
        return dataclasses.replace(state, params=params, opt_state=opt_state, pending=None)

    def _overlapped(self, params, extras, opt_state, pending, batch):
        """The update of the previous step's gradients ``pending`` and this step's loss and
        gradients, in one program: each layer group's buckets are streamed in, updated and
        written back in layer order (the slot chain running across groups), and the MoE layers
        reach the model per layer (``PerLayer``), so layer l's forward waits for layer l's
        update only and the later layers' host traffic runs under it. The same arithmetic as
        the optimizer's own step, then the gradient program."""
        opt = self.optimizer
        layout = opt_state.layout
        scalars = opt.step_scalars(pending, opt_state)
        leaves, treedef = jax.tree.flatten(params)
        moe = moe_leaf_indices(params)
        new_leaves = list(leaves)
        num_moe_layers = self.config.model.num_layers - self.config.model.num_dense_layers
        layer_leaves = [{} for _ in range(num_moe_layers)]
        groups, slot_chain = [], []
        for index, group in enumerate(layout.groups):
            updated, group_state = opt.update_group(layout.group_leaves(pending, index),
                                                    opt_state.group(index), scalars,
                                                    slot_chain=slot_chain)
            groups.append(group_state)
            for i, leaf in zip(group.leaves, updated):
                if group.layer is None:
                    new_leaves[i] = leaf
                else:
                    layer_leaves[group.layer][i] = leaf
        opt_state = opt.new_state(opt_state, groups, scalars)
        moe_def = jax.tree.structure(params["moe_layers"])
        per_layer = [jax.tree.unflatten(moe_def, [layer[i] for i in moe]) for layer in
                     layer_leaves]
        outer = [leaf for i, leaf in enumerate(new_leaves) if i not in moe]
        abstract = {i: jax.ShapeDtypeStruct(leaves[i].shape, leaves[i].dtype) for i in moe}
        extras_layers = [jax.tree.map(lambda a, at=layer: a[at], extras["moe_layers"])
                         for layer in range(num_moe_layers)]

        def loss(outer, per_layer):
            outer = iter(outer)
            full = [abstract[i] if i in abstract else next(outer) for i in range(len(leaves))]
            model = nnx.merge(self.graphdef, jax.tree.unflatten(treedef, full), extras)
            layers = PerLayer(tuple((p, e) for p, e in zip(per_layer, extras_layers)))
            return model(batch, self.runtime, self.offload, moe_layers=layers)

        (value, counts), (d_outer, d_layers) = jax.value_and_grad(
            loss, argnums=(0, 1), has_aux=True)(outer, per_layer)
        d_outer, d_layers = iter(d_outer), [jax.tree.leaves(d) for d in d_layers]
        grads, new_params = [], []
        for i in range(len(leaves)):
            if i in abstract:
                k = moe.index(i)
                grads.append(jnp.stack([d[k] for d in d_layers]))
                new_params.append(jnp.stack([layer[i] for layer in layer_leaves]))
            else:
                grads.append(next(d_outer))
                new_params.append(new_leaves[i])
        grads = jax.tree.unflatten(treedef, grads)
        metrics = dict(loss=value, grad_norm=optax_global_norm(grads), counts=counts)
        return (jax.tree.unflatten(treedef, new_params), self._balanced_extras(extras, counts),
                opt_state, grads, metrics)

    # -- the loop -----------------------------------------------------------------------------

    def global_batch(self, local: dict) -> dict:
        sharding = mop.token_sharding(self.mesh)
        return {key: jax.make_array_from_process_local_data(sharding, value)
                for key, value in local.items()}

    def run(self, *, resume: bool = False, progress: bool | None = None,
            stop_after: int | None = None) -> dict:
        """Trains to ``train.steps`` (or stops after step ``stop_after``, as an interrupted run
        would) and returns the summary."""
        config = self.config
        last_step = self.total_steps if stop_after is None else min(stop_after,
                                                                    self.total_steps)
        progress = config.train.progress if progress is None else progress
        checkpoints = ckpt.Checkpoints(self.run_dir / "checkpoints", config)
        state = self.initial_state()
        if resume:
            state = checkpoints.restore_latest(state, self.batches, self.optimizer) or state
        writer = report.MetricsWriter(self.run_dir)
        if jax.process_index() == 0:
            (self.run_dir / "config.json").write_text(json.dumps(to_dict(config), indent=1))
        bar = report.Progress(self.total_steps, state.step, enabled=progress)
        bar.write(self.banner(state))
        tokens_per_step = config.data.batch_size * config.data.seq_len
        throughput = report.Throughput(config.model, self.mesh)  # FLOPs from each batch
        history = []
        compiled = False
        wait_for_every_process("peakflat-started")  # before the first collective
        try:
            while state.step < last_step:
                local = next(self.batches)
                batch = self.global_batch(local)
                valid = int(jnp.sum(batch["targets"] != IGNORE))
                if not compiled:
                    started = time.perf_counter()
                    self.compile(state, batch)
                    bar.write(f"compiled in {time.perf_counter() - started:.1f} s; XLA's plan "
                              f"{self.xla_plan.total / 2**30:.3f} GiB per device")
                    wait_for_every_process("peakflat-compiled")
                    compiled = True
                if valid == 0:  # mean over no token: NaN; report it, keep the weights
                    bar.write(f"step {state.step + 1}: batch without a valid target, skipped")
                    state = dataclasses.replace(state, step=state.step + 1)
                    continue
                started = time.perf_counter()
                state, metrics = self.step(state, batch)
                loss = float(metrics["loss"])  # waits for the step
                seconds = time.perf_counter() - started
                record = {
                    "loss": loss, "grad_norm": float(metrics["grad_norm"]),
                    "learning_rate": float(self.schedule(state.step - 1)),
                    "step_seconds": seconds, "tokens_per_second": tokens_per_step / seconds,
                    **throughput.step(local["segment_ids"], seconds),
                    "peak_device_bytes": report.device_peak_bytes(),
                    "host_bytes": report.host_resident_bytes(),
                    "valid_targets": valid,
                }
                history.append(record)
                if warning := throughput.warning():
                    bar.write(warning)
                if state.step % config.train.log_every == 0 or state.step == self.total_steps:
                    writer.write(state.step, record)
                bar.update(state.step, self.total_steps,
                           f"loss {loss:.4f}  {record['tokens_per_second']:,.0f} tok/s")
                every = config.train.checkpoint_every
                if every and (state.step % every == 0 or state.step == self.total_steps):
                    state = self.flush(state)  # a checkpoint holds every update applied
                    checkpoints.save(state, self.batches, self.optimizer)
            state = self.flush(state)
        finally:
            checkpoints.close()
            writer.close()
            bar.close()
        self.final_state = state
        summary = {**self.summary(history, state), **throughput.summary_fields()}
        if jax.process_index() == 0:
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        bar.write(format_summary(summary))
        return summary

    def banner(self, state: TrainState) -> str:
        from peakflat_jax.model.size import parameter_counts

        counts = parameter_counts(self.config.model, mop.padded_vocab(
            self.config.model.vocab_size, mop.num_devices(self.mesh)))
        ops = self.config.operators
        return (f"peakflat train {self.config.name}: {counts.total / 1e6:.2f}M parameters "
                f"({counts.expert_total / 1e6:.2f}M in experts) on {mop.describe(self.mesh)}; "
                f"moe {ops.moe_dispatch}, loss {ops.loss}, offload {sum(self.offload)}/"
                f"{len(self.offload)} boundaries, optimizer "
                f"{'offloaded' if self.offloaded_optimizer else 'on device'}, attention "
                f"{self.runtime.attention}; step {state.step} of {self.total_steps}")

    def summary(self, history: list[dict], state: TrainState) -> dict:
        timed = history[1:] or history  # the first step's time includes warming up
        def median(key):
            values = [r[key] for r in timed if r.get(key) is not None]
            return float(np.median(values)) if values else None
        return {
            "config": self.config.name, "steps": state.step,
            "first_loss": history[0]["loss"] if history else None,
            "final_loss": history[-1]["loss"] if history else None,
            "losses": [r["loss"] for r in history],
            "median_step_seconds": median("step_seconds"),
            "tokens_per_second": median("tokens_per_second"),
            "model_tflops_per_device": median("model_tflops_per_device"),
            "mfu": median("mfu"),
            "peak_device_bytes": max((r["peak_device_bytes"] or 0 for r in history),
                                     default=None) or None,
            "host_bytes": max((r["host_bytes"] for r in history), default=0),
            "xla_plan_bytes": self.xla_plan and self.xla_plan.total,
            "devices": mop.num_devices(self.mesh),
            "device_kind": jax.devices()[0].device_kind,
        }


def wait_for_every_process(name: str) -> None:
    """A barrier of the processes of a multi-process run (none for one process), through the
    coordination service, which waits as long as a compile takes. The step's first collective
    would wait too, but the CPU's gloo collectives give up after 30 s: a process that finished
    compiling (or initializing) that much earlier than another failed the run."""
    if jax.process_count() == 1:
        return
    from jax._src import distributed

    distributed.global_state.client.wait_at_barrier(name, timeout_in_ms=3_600_000)


def shardings_like_params(tree, params, other):
    """Shardings for ``tree`` (e.g. an optimizer state): each subtree shaped like ``params``
    (a master copy, a moment) sharded leaf by leaf as the params are, every other leaf
    ``other``."""
    structure = jax.tree.structure(params)
    param_shardings = jax.tree.map(lambda p: p.sharding, params)

    def like_params(node) -> bool:
        return jax.tree.structure(node) == structure

    return jax.tree.map(lambda node: param_shardings if like_params(node) else other, tree,
                        is_leaf=like_params)


def moe_leaf_indices(params) -> list[int]:
    """Tree-order indices of the params' leaves under the MoE layer stack."""
    paths = jax.tree_util.tree_leaves_with_path(params)
    return [i for i, (path, _) in enumerate(paths)
            if getattr(path[0], "key", None) == "moe_layers"]


def moe_stack_mask(params):
    """The optimizer's ``stacked_layers``: True for the MoE stack's leaves (leading layer
    axis), None when the model has no MoE layers."""
    moe = set(moe_leaf_indices(params))
    if not moe:
        return None
    leaves, treedef = jax.tree.flatten(params)
    return jax.tree.unflatten(treedef, [i in moe for i in range(len(leaves))])


def optax_global_norm(tree) -> jax.Array:
    return jnp.sqrt(sum(jnp.sum(jnp.square(g.astype(jnp.float32)))
                        for g in jax.tree.leaves(tree)))


def format_summary(summary: dict) -> str:
    def fmt(value, unit="", scale=1.0, digits=2):
        return "n/a" if value is None else f"{value / scale:,.{digits}f}{unit}"
    lines = [
        f"done: {summary['steps']} steps of {summary['config']} on {summary['devices']} x "
        f"{summary['device_kind']}",
        f"  loss {fmt(summary['first_loss'], digits=4)} -> {fmt(summary['final_loss'], digits=4)}",
        f"  {fmt(summary['tokens_per_second'], ' tokens/s', digits=0)}, "
        f"{fmt(summary['median_step_seconds'], ' s/step', digits=3)}, "
        f"{fmt(summary['model_tflops_per_device'], ' model TFLOP/s per device')}, "
        f"MFU {fmt(summary['mfu'] and summary['mfu'] * 100, '%', digits=1)} (of the "
        f"{summary.get('mfu_denominator', 'n/a')}; attention within documents)",
        f"  peak device memory {fmt(summary['peak_device_bytes'], ' GiB', 2**30)} (XLA's plan "
        f"{fmt(summary['xla_plan_bytes'], ' GiB', 2**30)}), host "
        f"{fmt(summary['host_bytes'], ' GiB', 2**30)}",
    ]
    return "\n".join(lines)


def train(config: Config, *, resume: bool = False, run_dir: str | None = None,
          progress: bool | None = None) -> dict:
    """Runs ``config`` and returns the summary (also written to run_dir/summary.json)."""
    if os.environ.get("PEAKFLAT_DEBUG_NANS"):
        jax.config.update("jax_debug_nans", True)
    return Trainer(config, run_dir=run_dir).run(resume=resume, progress=progress)

