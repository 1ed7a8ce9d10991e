"""``peakflat train``: the training loop of the MoP decoder.

Per step: a global batch from the data pipeline (each process feeds its rows), the loss and
gradients in one compiled program (the layer stack through SCO, the loss through Ring-DTP, as
configured), then AdamW: fused into the same program when its state is on the device,
``pf.offload_stream_adamw``'s own program when its state is in host memory streamed through the
device, or a program on the host CPU when it is updated there (``optimizer.update_on:
host_cpu``: the gradients down, the new params up). The router's balancing bias moves after
every step from that step's per-expert counts.

Before compiling: the config's keys and values, the mesh against the model and batch, and the
planner's closed form (``peakflat_jax.plan``), which fills the knobs left null, chooses the
operators left ``auto``, and refuses a step it puts past the device by more than its measured
margin. After compiling, and before the first step: XLA's own plan of each program against
the device's memory, the verdict, refused in one line where it does not fit. With ``operators:
auto`` near the device's edge the programs are compiled first, and a lighter setting taken
where XLA's plan of the chosen one does not fit (``fitting_trainer``).

Reported per step (JSONL + TensorBoard under ``train.run_dir``, a progress bar on a terminal):
loss, learning rate, gradient norm, tokens/s, model TFLOP/s per device and MFU (model FLOPs of
each batch by ``model.size``'s convention, attention within documents; MFU of the device's
measured matmul rate, ``train.metrics``), peak device memory, host memory. A batch without a
valid target is reported and skipped (its mean loss is NaN).

After the first step, one line says where the start-up went, phase by phase since the
process's start (``startup``; summary.json's ``startup_seconds``).

A run directory holds one run (``run_dir``: what it holds, when a run may use it; checkpoints at
the end, every ``train.checkpoint_every`` steps and when interrupted), and SIGINT or SIGTERM
stops a run after the step in flight with a checkpoint saved (``interrupts``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from peakflat_jax import mesh as mop
from peakflat_jax.config import Config, ConfigError, optimizer_groups, to_dict
from peakflat_jax.hf.load import init_or_load
from peakflat_jax.memory import compiled_memory
from peakflat_jax.model.attention import (
    check_sequence_length,
    choose_implementation,
    xla_only_fields,
)
from peakflat_jax.model.decoder import IGNORE
from peakflat_jax.model.layers import Runtime
from peakflat_jax.model.sharding import abstract_model
from peakflat_jax.ops.sco import MadeInLoop, MadeInScan
from peakflat_jax.plan import DoesNotFit, Plan, layer_loop, offload_flags, overlaps_optimizer
from peakflat_jax.plan.host_pool import LIMIT_VARIABLE
from peakflat_jax.plan.operators import describe as describe_operators
from peakflat_jax.train import checkpoint as ckpt
from peakflat_jax.train import data as data_pipeline
from peakflat_jax.train import interrupts, oom, run_lock, startup
from peakflat_jax.train import metrics as report
from peakflat_jax.train import run_dir as run_dirs
from peakflat_jax.train.machine import plan_run
from peakflat_jax.train.optimizer import (
    DeviceAdamW,
    HostCpuAdamW,
    hyperparams_at,
    learning_rate_schedule,
    make_offloaded,
    with_hyperparams,
)
from peakflat_jax.train.profile import StepProfiler

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
    """What the model's forward reads of a config: its MoE dispatch and loss must be chosen
    (not ``auto``: the trainer's config is its plan's, ``Plan.filled_config``); a layer loop
    left ``auto`` is resolved by the planner's rule (``plan.layer_loop``)."""
    ops = config.operators
    unresolved = [name for name in ("moe_dispatch", "loss") if getattr(ops, name) == "auto"]
    if unresolved:
        raise ConfigError(f"operators: {', '.join(unresolved)} still auto; the planner "
                          f"chooses them (peakflat_jax.plan.make_plan)")
    platform = np.asarray(mesh.devices).flat[0].platform
    if ops.layer_loop == "auto":
        ops = dataclasses.replace(ops, layer_loop=layer_loop(
            config, overlaps_optimizer(config),
            "gpu" if platform in ("gpu", "cuda", "rocm") else "cpu"))
    try:
        attention = choose_implementation(ops.attention, platform, config.model.dtype,
                                          xla_only=xla_only_fields(config.model))
    except ValueError as error:
        raise ConfigError(f"operators.attention: {error}") from None
    try:
        check_sequence_length(attention, config.data.seq_len)
    except ValueError as error:
        raise ConfigError(f"data.seq_len: {error}") from None
    budget = ops.token_budget if ops.moe_dispatch == "pipelined" else None
    # Synthetic data is one document a sequence: cuDNN's unpacked kernel (as planned,
    # ``plan.terms.packed_attention_runs``), which reads no segment ids. The XLA kernel masks
    # by the ids it is given whatever their number, so it keeps them (a caller's packed input
    # through a synthetic config stays within its documents).
    one_document = config.data.source == "synthetic" and attention == "cudnn"
    return Runtime(mesh=mesh, operators=ops, attention=attention,
                   max_segments=1 if one_document else config.data.max_segments,
                   token_budget=budget)


def split_model_state(state):
    """(trainable params, the router's bias and other non-trained variables)."""
    return nnx.split_state(state, nnx.Param, ...)


class Trainer:
    """One run: ``Trainer(config).run(resume=False) -> summary``."""

    def __init__(self, config: Config, *, run_dir: str | None = None,
                 timeline: startup.Timeline | None = None, plan: Plan | None = None):
        if timeline is None:  # made without the command: the process's start to here, as one
            timeline = startup.Timeline()
            timeline.mark("before")
        self.timeline = timeline  # where the start-up goes, phase by phase (``startup``)
        mop.initialize_distributed(config.mesh)
        self.mesh = mop.make_mesh(config.mesh)
        mop.check_model_fits_mesh(config, self.mesh)
        # The planner's closed form before anything compiles: knobs left null (token_budget,
        # vocab_block, resident_groups) are filled and auto operators chosen as planned; a step
        # surely past the device is refused (``plan``: one made for this mesh already).
        self.plan = plan if plan is not None else plan_run(config, self.mesh)
        self.config = config = self.plan.filled_config()
        self.runtime = runtime_for(config, self.mesh)
        self.xla_plan = None  # XLA's plan of the largest compiled program, once compiled
        self.compile_seconds: dict[str, float] = {}  # per program compiled by this run
        self.offload = boundary_offload(config, self.mesh)
        self.run_dir = run_dirs.run_dir_of(config, run_dir)
        self.total_steps = config.train.steps
        self.offloaded_optimizer = config.operators.optimizer_offload
        # ZeRO-Offload's placement: the state in host memory, updated by the host CPU.
        self.host_cpu_optimizer = config.optimizer.update_on == "host_cpu"
        if self.host_cpu_optimizer and jax.process_count() > 1:
            raise ConfigError(f"optimizer.update_on: host_cpu runs in one process (its host "
                              f"state is one process's), this run has {jax.process_count()}")
        # Overlapping hides the MoE layers' updates under the forward: without MoE layers there
        # is nothing to hide them under.
        self.overlap = (self.offloaded_optimizer and config.operators.optimizer_overlap
                        and config.model.num_layers > config.model.num_dense_layers)
        # The scanned stack makes each MoE layer's update in the loop iteration before it, from
        # its row of the optimizer state's stacked blocks (sco.MadeInScan).
        self.stack_layer_state = self.overlap and self.runtime.operators.layer_loop == "scan"
        self.schedule = learning_rate_schedule(config.optimizer, self.total_steps)
        self.batches = data_pipeline.make_batches(
            config.data, vocab_size=config.model.vocab_size,
            process_index=jax.process_index(), process_count=jax.process_count())

    # -- state --------------------------------------------------------------------------------

    def initial_state(self, abstract: bool = False) -> TrainState:
        """The state at step 0: the weights from ``train.seed`` (or ``model.from_pretrained``)
        and the optimizer's initial state. ``abstract``: ShapeDtypeStructs with the shardings
        and memory kinds of those arrays, nothing made or read: what a resume restores into
        (making a state only to overwrite it cost a resume the weights' initialisation and a
        second copy of the host-resident optimizer state)."""
        graphdef, state = (abstract_model(self.config.model, self.mesh) if abstract else
                           init_or_load(self.config.model, self.mesh, self.config.train.seed))
        self.graphdef = graphdef
        params, extras = split_model_state(state)
        if self.offloaded_optimizer:
            # One optimizer object per structure in a process: its compiled step is reused
            # (the hyperparameters are inputs: ``with_hyperparams``).
            key = json.dumps(_structural_optimizer_fields(self.config), sort_keys=True)
            self.optimizer = _OPTIMIZERS.setdefault(key, make_offloaded(self.config.optimizer))
            # Each MoE layer's weights form their own buckets (layer groups), in both modes, so
            # that overlapping changes no bit; the first resident_groups stay on the device.
            make = self.optimizer.abstract_state if abstract else self.optimizer.init
            opt_state = make(params, stacked_layers=moe_stack_mask(params),
                             resident_groups=self.config.optimizer.resident_groups,
                             stack_layers=self.stack_layer_state)
        elif self.host_cpu_optimizer:
            # One per structure in a process, as above: its compiled host update is reused.
            key = json.dumps({"update_on": "host_cpu",
                              **_structural_optimizer_fields(self.config)}, sort_keys=True)
            self.optimizer = _OPTIMIZERS.setdefault(key, HostCpuAdamW(self.config.optimizer))
            make = self.optimizer.abstract_state if abstract else self.optimizer.init
            opt_state = make(params)
        else:
            self.optimizer = DeviceAdamW(self.config.optimizer)
            # The master and moments sharded like the params (FSDP), the step counts
            # replicated: left to itself, jit put optax's zeros on every device whole.
            shapes = jax.eval_shape(self.optimizer.init, params)
            shardings = shardings_like_params(shapes, params, NamedSharding(self.mesh, P()))
            opt_state = (jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                                        sharding=s),
                                      shapes, shardings) if abstract else
                         jax.jit(self.optimizer.init, out_shardings=shardings)(params))
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
        if self.overlap:
            # One program for every step, the first included (its pending update is one that
            # changes nothing): the whole model is compiled once. The params are read for their
            # shapes only: kept in the signature, so that they are donated.
            self._overlapped_step = self._compiled(
                "overlapped_step", lambda: jax.jit(
                    self._overlapped, donate_argnums=(0, 1, 2, 3), keep_unused=True,
                    out_shardings=(*kept, self.optimizer.state_shardings(state.opt_state),
                                   params_shardings, None)).lower(
                    state.params, state.extras, state.opt_state, state.params, batch,
                    self._replicated(True)).compile(),
                "the overlapped step")
            return
        if self.offloaded_optimizer:
            self._gradient_step = self.gradient_program(state, batch)
            return
        if self.host_cpu_optimizer:
            self._gradient_step = self.gradient_program(state, batch)
            started = time.perf_counter()
            if self.optimizer.compile(state.params, state.opt_state):  # False: reused
                self.compile_seconds["the host CPU update"] = time.perf_counter() - started
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

    def gradient_program(self, state: TrainState, batch):
        """The compiled loss and gradient program, ``(params, extras, batch) -> (metrics,
        grads, extras)``: the step of the offloaded optimizer without overlap (the optimizer's
        own program follows it), and for tests and benchmarks in any mode."""
        params_shardings, extras_shardings = jax.tree.map(lambda a: a.sharding,
                                                          (state.params, state.extras))

        def gradient_step(params, extras, batch):
            loss, counts, grads, grad_norm, extras = self._gradients(params, extras, batch)
            return dict(loss=loss, grad_norm=grad_norm, counts=counts), grads, extras

        return self._compiled(
            "gradient_step", lambda: jax.jit(
                gradient_step, donate_argnums=(1,),
                out_shardings=(None, params_shardings, extras_shardings)).lower(
                state.params, state.extras, batch).compile(),
            "the loss and gradient program")

    def _program_key(self, program: str) -> tuple:
        """What a compiled program depends on: the config without the loop's bookkeeping and
        the optimizer's hyperparameters (inputs of the step: ``with_hyperparams``), and without
        the optimizer for the gradient program; and the devices."""
        config = to_dict(self.config)
        for section in ("name", "train"):
            config.pop(section)
        config["optimizer"] = _structural_optimizer_fields(self.config)
        if program == "gradient_step":
            config.pop("optimizer")
            for field in ("optimizer_offload", "optimizer_overlap"):
                config["operators"].pop(field)
        return (program, json.dumps(config, sort_keys=True),
                tuple(d.id for d in np.asarray(self.mesh.devices).flat))

    def _compiled(self, program: str, compile_it, what: str, device: bool = True):
        """The program compiled (or reused), its XLA plan checked against the device (a
        ``device`` program's)."""
        key = self._program_key(program)
        if key not in _PROGRAMS:
            started = time.perf_counter()
            _PROGRAMS[key] = compile_it()
            self.compile_seconds[what] = time.perf_counter() - started
        if device:
            self._check_fits(_PROGRAMS[key], what)
        return _PROGRAMS[key]

    def _check_fits(self, compiled, what: str) -> None:
        """XLA's plan of a compiled program against the device's memory: the verdict. Refused
        in one line (``DoesNotFit``) where it is past the device."""
        limit = self.device_memory()
        plan = compiled_memory(compiled)
        if self.xla_plan is None or plan.total > self.xla_plan.total:
            self.xla_plan = plan  # the largest of the step's programs
        if limit is not None and plan.total > limit:
            raise DoesNotFit(
                f"{self.config.name} does not fit: XLA's plan of {what} is "
                f"{plan.total / 2**30:.2f} GiB per device (arguments "
                f"{plan.argument / 2**30:.2f}, temporaries {plan.temp / 2**30:.2f}, outputs "
                f"{plan.output / 2**30:.2f}), the device has {limit / 2**30:.2f} GiB (the closed "
                f"form {self.plan.total_bytes / 2**30:.2f}); `peakflat plan {self.config.name} "
                f"--largest` finds the context that fits")

    def device_memory(self) -> int | None:
        """The memory XLA's plan is held to: the plan's (``train.device_memory_gib``, else the
        device's allocator limit, else a CPU device's share of the host)."""
        return self.plan.device_memory

    def abstract_batch(self) -> dict:
        """The global batch's shapes, dtypes and shardings: what the step compiles for."""
        data = self.config.data
        shape = jax.ShapeDtypeStruct((data.batch_size, data.seq_len), jnp.int32,
                                     sharding=mop.token_sharding(self.mesh))
        return {key: shape for key in ("tokens", "targets", "segment_ids", "positions")}

    def compile_abstract(self) -> None:
        """Compiles the step's programs for the state's and the batch's shapes (nothing is
        made, read or run) and checks XLA's plan of each against the device's memory: the
        verdict before anything is allocated. The programs are reused by the run's compile."""
        self.compile(self.initial_state(abstract=True), self.abstract_batch())

    def compiled_programs(self) -> dict:
        """The compiled programs of a step (for the abstract state: nothing is made), by name:
        the step's own (``train_step``, ``gradient_step`` or ``overlapped_step``), and the
        optimizer's (``optimizer_step``, ``host_cpu_update``) where it is a program of its
        own. Raises DoesNotFit where XLA's plan of the step's own is past the device."""
        state = self.initial_state(abstract=True)
        self.compile(state, self.abstract_batch())
        compiled = {name: getattr(self, "_" + name) for name in
                    ("train_step", "gradient_step", "overlapped_step")
                    if hasattr(self, "_" + name)}
        if self.offloaded_optimizer:
            compiled["optimizer_step"] = self._compiled(
                "optimizer_step", lambda: self.optimizer.lower(state.params,
                                                               state.opt_state).compile(),
                "the optimizer's step")
        if self.host_cpu_optimizer:  # a program of the host's memory, not the device's
            compiled["host_cpu_update"] = self._compiled(
                "host_cpu_update", lambda: self.optimizer.lower(state.params,
                                                                state.opt_state).compile(),
                "the host CPU update", device=False)
        return compiled

    def step(self, state: TrainState, batch) -> tuple[TrainState, dict]:
        """One optimizer step; the state passed in is consumed. Overlapped, the step's update
        is left pending for the next step's program (``flush`` applies it)."""
        # The update about to run follows this many updates: its hyperparameters go in.
        updates_done = state.step - (state.pending is not None)
        state = dataclasses.replace(state, opt_state=self._hyperparams(state.opt_state,
                                                                       updates_done))
        if self.overlap:
            # Nothing pending (a run's first step, or the first after a checkpoint): the same
            # program with zero gradients and its update switched off, bit for bit a no-op.
            first = state.pending is None
            pending = self._zero_gradients(state.params) if first else state.pending
            params, extras, opt_state, grads, metrics = self._overlapped_step(
                state.params, state.extras, state.opt_state, pending, batch,
                self._replicated(not first))
            return TrainState(params, extras, opt_state, state.step + 1, grads), metrics
        if self.offloaded_optimizer or self.host_cpu_optimizer:
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
        opt_state = self._hyperparams(state.opt_state, state.step - 1)
        params, opt_state = self.optimizer.step(state.pending, opt_state)
        return dataclasses.replace(state, params=params, opt_state=opt_state, pending=None)

    def _replicated(self, flag: bool) -> jax.Array:
        """A bool on every device of the mesh (the same on every process)."""
        return jax.device_put(np.bool_(flag), NamedSharding(self.mesh, P()))

    def _zero_gradients(self, params):
        """Zeros placed like ``params``: the gradients of an update that changes nothing."""
        if not hasattr(self, "_zeros_like_params"):
            shardings = jax.tree.map(lambda a: a.sharding, params)
            self._zeros_like_params = jax.jit(
                lambda p: jax.tree.map(jnp.zeros_like, p), out_shardings=shardings)
        return self._zeros_like_params(params)

    def _hyperparams(self, opt_state, updates_done: int):
        """``opt_state`` set for the update that follows ``updates_done`` updates."""
        return with_hyperparams(opt_state, hyperparams_at(self.config.optimizer, self.schedule,
                                                          updates_done))

    def _overlapped(self, params, extras, opt_state, pending, batch, apply):
        """The update of the previous step's gradients ``pending`` and this step's loss and
        gradients, in one program: each layer group's buckets are streamed in, updated and
        written back in layer order (the slot chain running across groups). The same arithmetic
        as the optimizer's own step, then the gradient program; where ``apply`` is False the
        update leaves everything as it was (a step with nothing pending).

        The groups outside the MoE stack are updated first; each MoE layer's update is made
        inside the forward, one layer ahead: with the unrolled stack (``MadeInLoop``) layer l's
        buckets are streamed in once layer l - 1 starts, with the scanned one
        (``MadeInScan``) in the loop iteration that computes layer l - 1, from the state's
        stacked blocks (``stack_layers``, a row per layer). Layer l's forward waits for its own
        update only, so that the host traffic can run under layer l - 1's compute. (Updated
        before the forward, as the outer group still is, XLA:GPU scheduled every bucket's copies
        and update ahead of the first layer: 366 of the 390 copies of h200-1's step, none under
        compute.) With ``operators.optimizer_writeback: backward`` the buckets are written back
        only once the loss exists, under the backward (no slot chain: every updated bucket
        waits on the device)."""
        opt = self.optimizer
        layout = opt_state.layout
        scalars = opt.step_scalars(pending, opt_state, apply)
        leaves, treedef = jax.tree.flatten(params)
        moe = moe_leaf_indices(params)
        new_leaves = list(leaves)
        num_moe_layers = self.config.model.num_layers - self.config.model.num_dense_layers
        # Written back as updated (the slot chain), or after the forward's loss.
        deferred = self.config.operators.optimizer_writeback == "backward"
        groups, slot_chain = [None] * len(layout.groups), None if deferred else []
        for index, group in enumerate(layout.groups):
            if group.layer is not None:
                continue  # made inside the forward (below)
            updated, groups[index] = opt.update_group(layout.group_leaves(pending, index),
                                                      opt_state.group(index), scalars,
                                                      slot_chain=slot_chain,
                                                      write_back=not deferred)
            for i, leaf in zip(group.leaves, updated):
                new_leaves[i] = leaf

        moe_def = jax.tree.structure(params["moe_layers"])
        outer = [leaf for i, leaf in enumerate(new_leaves) if i not in moe]
        abstract = {i: jax.ShapeDtypeStruct(leaves[i].shape, leaves[i].dtype) for i in moe}
        # Each layer's new weights written into the donated stacks, whose old values the update
        # does not read (it reads the fp32 master): they are the step's output. (The router's
        # bias rides along; _balanced_extras reads its old value, so XLA may copy that small
        # stack first.)
        into = (jax.tree.unflatten(moe_def, [leaves[i] for i in moe]), extras["moe_layers"])
        if self.runtime.operators.layer_loop == "scan":
            made, units_of = self._made_in_scan(opt, layout, pending, opt_state, scalars,
                                                moe, moe_def, extras, deferred, slot_chain,
                                                into)
        else:
            made, units_of = self._made_in_loop(opt, layout, pending, opt_state, scalars, moe,
                                                moe_def, extras, deferred, slot_chain, into,
                                                num_moe_layers)

        def loss(outer, offsets):
            outer = iter(outer)
            full = [abstract[i] if i in abstract else next(outer) for i in range(len(leaves))]
            model = nnx.merge(self.graphdef, jax.tree.unflatten(treedef, full), extras)
            layers = dataclasses.replace(made, offsets=offsets)
            value, counts = model(batch, self.runtime, self.offload, moe_layers=layers)
            *made_state, (stacked, _) = layers.results  # (.., the made params stacked)
            return value, (counts, made_state, jax.tree.leaves(stacked))

        # The gradients are taken with respect to zeros added to the made weights, stacked:
        # each layer's are written in place into the stacked result (sco.MadeInLoop,
        # sco.MadeInScan).
        offsets = (jax.tree.unflatten(moe_def, [jnp.zeros(abstract[i].shape, abstract[i].dtype)
                                                for i in moe]),
                   jax.tree.map(jnp.zeros_like, extras["moe_layers"]))
        (value, (counts, made_state, stacked)), (d_outer, (d_moe, _)) = jax.value_and_grad(
            loss, argnums=(0, 1), has_aux=True)(outer, offsets)
        d_outer, d_moe = iter(d_outer), jax.tree.leaves(d_moe)
        grads, new_params = [], []
        for i in range(len(leaves)):
            if i in abstract:
                k = moe.index(i)
                grads.append(d_moe[k])
                new_params.append(stacked[k])
            else:
                grads.append(next(d_outer))
                new_params.append(new_leaves[i])
        grads = jax.tree.unflatten(treedef, grads)
        metrics = dict(loss=value, grad_norm=optax_global_norm(grads), counts=counts)
        # The state, its deferred buckets copied back once the loss exists.
        units = [opt.write_back(u, after=value) if deferred else u
                 for u in units_of(groups, made_state)]
        return (jax.tree.unflatten(treedef, new_params), self._balanced_extras(extras, counts),
                opt.new_state(opt_state, units, scalars), grads, metrics)

    def _made_in_loop(self, opt, layout, pending, opt_state, scalars, moe, moe_def, extras,
                      deferred, slot_chain, into, num_moe_layers):
        """The unrolled stack's MoE layers made inside its forward (``_overlapped``): the
        ``MadeInLoop`` (its offsets set by the caller) and a function of (the outer groups' new
        states, the made results' first part) giving the new state's units in order."""
        extras_layers = [jax.tree.map(lambda a, at=layer: a[at], extras["moe_layers"])
                         for layer in range(num_moe_layers)]
        layer_groups = [layout.layer_group(layer) for layer in range(num_moe_layers)]
        slots = opt.slots

        def make(layer, source, chain, ready):
            """Layer ``layer``'s new weights: its group's buckets updated inside the forward
            (``MadeInLoop``: copied in once layer l - 1 starts), the slot chain carried on.
            Written back under the backward (no chain), each bucket's update also waits for
            layer l - 1 to end, so that its copies have that layer's compute to run under;
            with the chain that tie would hold every bucket past the first ``slots`` until
            then (bucket b's copies wait for bucket b - slots's write-back)."""
            grads, group_state, step_scalars = source
            chain = None if deferred else list(chain)
            updated, group_state = opt.update_group(grads, group_state, step_scalars,
                                                    slot_chain=chain, write_back=not deferred,
                                                    after=ready if deferred else None)
            by_leaf = dict(zip(layout.groups[group_state.index].leaves, updated))
            weights = [by_leaf[i] for i in moe]
            return ((jax.tree.unflatten(moe_def, weights), extras_layers[layer]),
                    group_state, () if deferred else tuple(chain[-slots:]))

        made = MadeInLoop(
            make, tuple((layout.group_leaves(pending, g), opt_state.group(g), scalars)
                        for g in layer_groups),
            () if deferred else tuple(slot_chain[-slots:]), None, into=into)

        def units(groups, made_state):
            group_states, _ = made_state  # MadeInLoop's results: the layers' states, the chain
            groups = list(groups)
            for layer, group_state in enumerate(group_states):
                groups[layer_groups[layer]] = group_state
            return groups

        return made, units

    def _made_in_scan(self, opt, layout, pending, opt_state, scalars, moe, moe_def, extras,
                      deferred, slot_chain, into):
        """The scanned stack's MoE layers made inside its forward (``_overlapped``): the
        ``MadeInScan`` (its offsets set by the caller) and a function of (the outer groups' new
        states, the made state) giving the new state's units in order. The MoE layers' state
        is the layout's stacked blocks (``stack_layers``), each a segment: layer l's update
        reads and writes its row (in place, or, written back under the backward, its new row
        into a device copy of the block that goes back once the loss exists)."""
        blocks = layout.blocks
        first_group = layout.layer_group(0)
        leaves = jax.tree.leaves(pending)
        group_leaves = layout.groups[first_group].leaves  # every layer group's, alike
        slots = opt.slots
        outer_chain = () if deferred else tuple(slot_chain[-slots:])

        def make(layer, carried, ready, segment):
            """Layer ``layer``'s new weights (``layer`` traced but for the first, made before
            the loop): its row of block ``segment`` updated, the block threaded on. The first
            layer's buckets continue the outer groups' slot chain; a loop iteration's start a
            chain of their own (the iteration before has ended). Written back under the
            backward (no chain), each bucket's update also waits for layer l - 1 to end."""
            states, new_rows = map(list, carried)
            block = blocks[segment]
            row = layer - (block.first_group - first_group)
            grads = [lax.dynamic_index_in_dim(leaves[i], layer, 0, keepdims=False)
                     for i in group_leaves]
            index = layout.layer_group(layer) if isinstance(layer, int) else block.first_group
            chain = None if deferred else list(outer_chain if isinstance(layer, int) else ())
            updated, group_state = opt.update_group(grads, states[segment].group(row, index),
                                                    scalars, slot_chain=chain,
                                                    write_back=not deferred,
                                                    after=ready if deferred else None)
            if group_state.row is not None:
                states[segment] = group_state.stacks()
            else:  # a streamed row left on the device: into the block's device copy
                new_rows[segment] = new_rows[segment].with_row(row, group_state)
            by_leaf = dict(zip(group_leaves, updated))
            extras_layer = jax.tree.map(
                lambda a: lax.dynamic_index_in_dim(a, layer, 0, keepdims=False),
                extras["moe_layers"])
            return ((jax.tree.unflatten(moe_def, [by_leaf[i] for i in moe]), extras_layer),
                    (tuple(states), tuple(new_rows)))

        states = tuple(opt_state.block(block) for block in blocks)
        new_rows = tuple(state.device_zeros() if deferred and not state.block.resident else None
                         for state in states)
        segments = tuple(blocks.index(layout.block_of(layout.layer_group(layer)))
                         for layer in range(len(layout.groups) - first_group))
        made = MadeInScan(make, (states, new_rows), segments, None, into=into)

        def units(groups, made_state):
            (states, new_rows), = made_state  # MadeInScan's results: the carried state
            final = [rows if rows is not None else state for state, rows in zip(states, new_rows)]
            return [groups[u] if isinstance(u, int) else final[blocks.index(u)]
                    for u in layout.units()]

        return made, units

    # -- the loop -----------------------------------------------------------------------------

    def global_batch(self, local: dict) -> dict:
        sharding = mop.token_sharding(self.mesh)
        return {key: jax.make_array_from_process_local_data(sharding, value)
                for key, value in local.items()}

    def run(self, *, resume: bool = False, overwrite: bool = False,
            progress: bool | None = None, stop_after: int | None = None) -> dict:
        """Trains to ``train.steps`` (or stops after step ``stop_after``, as an interrupted run
        would) and returns the summary of the whole run. The run directory is checked first
        (``run_dir.check_run_dir``: a fresh run needs it empty unless ``overwrite``, which
        clears it; ``resume`` needs a checkpoint); a resumed run that is at its last step
        already is left as it is. SIGINT or SIGTERM stops the run after the step in flight,
        saves a checkpoint (where ``train.checkpoints``) and raises ``Interrupted``. Out of
        device memory (``oom``), it writes a summary.json that says so and raises
        ``OutOfMemory``. Where XLA's plan of the step may be past the device (``near_the_edge``)
        the programs are compiled first, and a step that does not fit is refused
        (``DoesNotFit``, one line) before anything else."""
        self.steps_done = None  # the steps completed, once the state is made
        if near_the_edge(self.plan):
            # XLA's plan may be past the device where the closed form is not: the verdict
            # before the run directory is touched or anything is made.
            self.compile_abstract()
        # One run per directory (``run_lock``): held until the run ends, however it ends.
        lock = run_lock.hold(self.run_dir, process_index=jax.process_index(), create=not resume)
        try:
            return self._run(resume=resume, overwrite=overwrite, progress=progress,
                             stop_after=stop_after)
        except jax.errors.JaxRuntimeError as error:
            what = oom.describe(error)
            if what is None:
                raise
            raise oom.OutOfMemory(self._record_failure(what)) from None
        finally:
            if lock is not None:
                lock.release()

    def _record_failure(self, what: str) -> str:
        """The line of a run out of memory (``what``: ``oom.describe``'s) with its step and the
        plans, also written as summary.json's ``failed``: the steps done are in metrics.jsonl,
        the summary says that the run did not finish, and why."""
        done, xla, limit = self.steps_done, self.xla_plan, report.device_memory_bytes()
        configured, planned = self.config.train.device_memory_gib, self.plan.device_memory
        at = "making the state" if done is None else f"at step {done + 1} of {self.total_steps}"
        plans = f"the planner's {self.plan.total_bytes / 2**30:.2f} GiB"
        if xla:  # known once the step compiled
            plans = f"XLA's plan {xla.total / 2**30:.2f} GiB per device and {plans}"
        if configured:
            against = f"train.device_memory_gib={configured:.15g}" + (
                f" instead of the device's {limit / 2**30:.2f} GiB" if limit else "")
        else:
            against = f"{planned / 2**30:.2f} GiB per device" if planned else "the device"
        line = f"{what} {at}; {plans}, checked against {against}"
        if jax.process_index() == 0:
            summary = {"config": self.config.name, "failed": line, "steps": done,
                       "total_steps": self.total_steps, "xla_plan_bytes": xla and xla.total,
                       "planned_bytes": self.plan.total_bytes, "device_limit_bytes": limit,
                       **self.timeline.summary_fields()}
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        return f"{line}; {self.run_dir / 'summary.json'} records the failure"

    def _run(self, *, resume: bool, overwrite: bool, progress: bool | None,
             stop_after: int | None) -> dict:
        config = self.config
        last_step = self.total_steps if stop_after is None else min(stop_after,
                                                                    self.total_steps)
        progress = config.train.progress if progress is None else progress
        checkpoint_dir = self.run_dir / "checkpoints"
        saved_step = ckpt.latest_step(checkpoint_dir) if resume else None
        run_dirs.check_run_dir(self.run_dir, resume=resume, overwrite=overwrite,
                               saved_step=saved_step, config=to_dict(config))
        if resume and saved_step >= last_step:
            return self._finished_already(saved_step)
        wait_for_every_process("peakflat-run-dir-checked")  # before process 0 clears it
        if overwrite and jax.process_index() == 0:
            run_dirs.clear_run_dir(self.run_dir)
        wait_for_every_process("peakflat-run-dir-ready")
        # Said before the state is made: its initialisation compiles (tens of seconds on a CPU).
        first_step = saved_step if resume else 0
        bar = report.Progress(self.total_steps, first_step, enabled=progress)
        bar.write(self.banner(first_step))
        checkpoints = ckpt.Checkpoints(checkpoint_dir, config, log=bar.write)
        self.timeline.mark("setup")
        bar.status("restoring the checkpoint" if resume else "making the initial state")
        state = self.initial_state(abstract=resume)
        resumed_from = None
        if resume:
            state = checkpoints.restore_latest(state, self.batches, self.optimizer)
            resumed_from = state.step
        # Made, not only dispatched: the phase holds the state's own time.
        jax.block_until_ready((state.params, state.extras, state.opt_state))
        self.timeline.mark("state")
        # The records of the steps before the resume, for the summary of the whole run (those
        # of later steps, which this run computes again, are dropped).
        earlier = [r for r in report.read_records(self.run_dir)
                   if resumed_from is not None and r["step"] <= resumed_from]
        writer = report.MetricsWriter(self.run_dir, resume_step=resumed_from)
        if jax.process_index() == 0:  # config.json as the run started; a resume's changes beside
            changed = run_dirs.record_config(self.run_dir, to_dict(config),
                                             resumed_from=resumed_from)
            if changed:
                bar.write(f"resumed with {run_dirs.describe_changes(changed)} (recorded in "
                          f"{self.run_dir / 'config_changes.jsonl'})")
        tokens_per_step = config.data.batch_size * config.data.seq_len
        throughput = report.Throughput(config.model, self.mesh)  # FLOPs from each batch
        history = []
        compiled = False
        stop = interrupts.StopRequests()
        profiler = StepProfiler(self.run_dir, first=state.step + 1,
                                count=config.train.profile_steps)
        wait_for_every_process("peakflat-started")  # before the first collective
        try:
            with stop:
                # Asked before a step's batch is drawn: a checkpoint's data position is then
                # always that of its step.
                while state.step < last_step and not stop.requested():
                    self.steps_done = state.step
                    local = next(self.batches)
                    batch = self.global_batch(local)
                    valid = int(jnp.sum(batch["targets"] != IGNORE))
                    if not compiled:
                        self.timeline.mark("data")
                        stop.during = "the compile"  # before it is said: a signal may follow
                        bar.write("compiling the step's programs ...")
                        bar.status("compiling")
                        started = time.perf_counter()
                        self.compile(state, batch)
                        each = ", ".join(f"{what} {seconds:.1f} s"
                                         for what, seconds in self.compile_seconds.items())
                        bar.write(f"compiled in {time.perf_counter() - started:.1f} s "
                                  f"({each or 'all reused'}); XLA's plan "
                                  f"{self.xla_plan.total / 2**30:.3f} GiB per device")
                        wait_for_every_process("peakflat-compiled")
                        compiled = True
                        self.timeline.mark("compile")
                        stop.during = None
                        if stop.requested():  # a signal during the compile: no step runs
                            break
                    if valid == 0:  # mean over no token: NaN; report it, keep the weights
                        bar.write(f"step {state.step + 1}: batch without a valid target, "
                                  f"skipped")
                        state = dataclasses.replace(state, step=state.step + 1)
                        continue
                    profiler.before(state.step + 1)
                    started = time.perf_counter()
                    state, metrics = self.step(state, batch)
                    loss = float(metrics["loss"])  # waits for the step
                    seconds = time.perf_counter() - started
                    if line := profiler.after(state.step, (state.params, state.opt_state)):
                        bar.write(line)
                    if not history:
                        self.timeline.mark("first step")
                        bar.write(self.timeline.line())
                    record = {
                        "loss": loss, "grad_norm": float(metrics["grad_norm"]),
                        "learning_rate": float(self.schedule(state.step - 1)),
                        "step_seconds": seconds, "tokens_per_second": tokens_per_step / seconds,
                        **throughput.step(local["segment_ids"], seconds),
                        "peak_device_bytes": report.device_peak_bytes(),
                        "host_bytes": report.host_resident_bytes(),
                        "host_peak_bytes": report.host_peak_resident_bytes(),
                        "valid_targets": valid,
                    }
                    history.append(record)
                    if warning := throughput.warning():
                        bar.write(warning)
                    if state.step % config.train.log_every == 0 or state.step == last_step:
                        writer.write(state.step, record)
                    bar.update(state.step, self.total_steps,
                               f"loss {loss:.4f}  {record['tokens_per_second']:,.0f} tok/s")
                    every = config.train.checkpoint_every
                    if config.train.checkpoints and every and state.step % every == 0:
                        state = self.flush(state)  # a checkpoint holds every update applied
                        checkpoints.save(state, self.batches, self.optimizer)
                        saved_step = state.step
                # The end, a stop_after, or a signal: the last step saved too (none where no
                # step ran: the data iterator is past a batch that no step took).
                state = self.flush(state)
                if config.train.checkpoints and state.step not in (saved_step, first_step):
                    checkpoints.save(state, self.batches, self.optimizer)
                    saved_step = state.step
        finally:
            if line := profiler.close(state.step):
                bar.write(line)
            checkpoints.close()  # waits for the writes in flight
            writer.close()
            bar.close()
        self.final_state = state
        summary = {**self.summary([*earlier, *history], state), **throughput.summary_fields()}
        summary["resumed_from"] = resumed_from
        summary.update(self.timeline.summary_fields())  # where the start-up went
        if jax.process_index() == 0:
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        if stop.signum is not None:
            raise interrupts.Interrupted(stop.signum, state.step, self.total_steps, saved_step,
                                         checkpoint_dir, trained=state.step != first_step)
        bar.write(format_summary(summary) + f"\n  tensorboard --logdir "
                  f"{shlex.quote(str(self.run_dir / 'tensorboard'))}")
        return summary

    def _finished_already(self, saved_step: int) -> dict:
        """A resumed run whose checkpoint is at its last step: said, nothing touched; its
        summary.json (None where it has none)."""
        if jax.process_index() == 0:
            print(f"peakflat train {self.config.name}: the run in {self.run_dir} is at step "
                  f"{saved_step} of {self.total_steps} already: nothing to do, nothing changed",
                  file=sys.stderr, flush=True)
        path = self.run_dir / "summary.json"
        return json.loads(path.read_text()) if path.exists() else None

    def banner(self, step: int) -> str:
        """The run's first lines: the model, the devices, the operators, the step it starts
        at and the run directory."""
        from peakflat_jax.model.size import parameter_counts

        counts = parameter_counts(self.config.model, mop.padded_vocab(
            self.config.model.vocab_size, mop.num_devices(self.mesh)))
        ops = self.config.operators
        return (f"peakflat train {self.config.name}: {counts.total / 1e6:.2f}M parameters "
                f"({counts.expert_total / 1e6:.2f}M in experts) on {mop.describe(self.mesh)}; "
                f"moe {ops.moe_dispatch}, loss {ops.loss}, offload {sum(self.offload)}/"
                f"{len(self.offload)} boundaries, optimizer "
                f"{self.optimizer_placement()}, attention "
                f"{self.runtime.attention}; step {step} of {self.total_steps}"
                + f"\nrun directory {self.run_dir}"
                + (f"\n{chosen}" if (chosen := describe_operators(self.plan.choices)) else "")
                + (f"\npinned-host pool limit {cap} GiB ({LIMIT_VARIABLE})"
                   if self.plan.platform == "gpu" and (cap := os.environ.get(LIMIT_VARIABLE))
                   else ""))

    def optimizer_placement(self) -> str:
        """Where the optimizer's state lives and its update runs, in words."""
        if self.offloaded_optimizer:
            resident = self.config.optimizer.resident_groups
            return (f"offloaded ({resident} of {optimizer_groups(self.config.model)} groups' "
                    f"state on the device)" if resident else "offloaded")
        return "on the host CPU" if self.host_cpu_optimizer else "on device"

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
            "host_peak_bytes": max((r.get("host_peak_bytes", 0) for r in history), default=0),
            "xla_plan_bytes": self.xla_plan and self.xla_plan.total,
            "compile_seconds": self.compile_seconds,
            "devices": mop.num_devices(self.mesh),
            "device_kind": jax.devices()[0].device_kind,
        }


def _structural_optimizer_fields(config: Config) -> dict:
    """The optimizer fields that shape its compiled programs (the rest are their inputs)."""
    optimizer = config.optimizer
    return {"bucket_params": optimizer.bucket_params, "slots": optimizer.slots,
            "resident_groups": optimizer.resident_groups,
            "max_grad_norm": optimizer.max_grad_norm is not None and optimizer.max_grad_norm}


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
        f"MFU {fmt(summary['mfu'] and summary['mfu'] * 100, '%', digits=1)} "
        f"({summary.get('mfu_denominator', 'n/a')}; attention within documents)",
        f"  peak device memory {fmt(summary['peak_device_bytes'], ' GiB', 2**30)} (XLA's plan "
        f"{fmt(summary['xla_plan_bytes'], ' GiB', 2**30)}), host "
        f"{fmt(summary['host_bytes'], ' GiB', 2**30)} (peak "
        f"{fmt(summary.get('host_peak_bytes'), ' GiB', 2**30)})",
    ]
    return "\n".join(lines)


def train(config: Config, *, resume: bool = False, overwrite: bool = False,
          run_dir: str | None = None, progress: bool | None = None,
          timeline: startup.Timeline | None = None) -> dict:
    """Runs ``config`` and returns the summary (also written to run_dir/summary.json);
    ``Trainer.run`` says what ``resume`` and ``overwrite`` do, and what a signal does;
    ``timeline``: the start-up's phases so far (``startup``; None: the trainer opens one)."""
    if os.environ.get("PEAKFLAT_DEBUG_NANS"):
        jax.config.update("jax_debug_nans", True)
    return fitting_trainer(config, run_dir=run_dir, timeline=timeline).run(
        resume=resume, overwrite=overwrite, progress=progress)


def near_the_edge(plan: Plan) -> bool:
    """Whether XLA's plan may be past the device where the closed form is under it: the
    closed form times the highest ratio of XLA's plan to it measured (``Measured.margin``) is
    past the device's memory."""
    _, high = plan.target.measured.margin.get("device", (1.0, 1.0))
    return plan.device_memory is not None and high * plan.total_bytes > plan.device_memory


def fitting_trainer(config: Config, *, run_dir: str | None = None,
                    timeline: startup.Timeline | None = None) -> Trainer:
    """The trainer of ``config`` whose compiled programs fit the device. With ``operators:
    auto`` near the device's edge (``near_the_edge``) the chosen setting's programs are
    compiled here, before anything is made, and where XLA's plan of them does not fit the
    next lighter setting by the closed form (``Plan.lighter``, fastest first) is tried, until
    one fits; refused in one line, naming every setting tried, where none does. Elsewhere the
    compile is the run's own, before its first step."""
    trainer = Trainer(config, run_dir=run_dir, timeline=timeline)
    if not trainer.plan.lighter or not near_the_edge(trainer.plan):
        return trainer
    tried = []
    for candidate in (None, *trainer.plan.lighter):
        if candidate is not None:
            trainer = Trainer(candidate, run_dir=run_dir, timeline=trainer.timeline)
        try:
            trainer.compile_abstract()
            return trainer
        except DoesNotFit:
            ops = trainer.config.operators
            tried.append(f"{ops.moe_dispatch}/{ops.loss}/offload {sum(trainer.offload)}/"
                         f"optimizer {trainer.optimizer_placement()} "
                         f"{trainer.xla_plan.total / 2**30:.2f} GiB")
    raise DoesNotFit(f"{config.name} does not fit: XLA's plan of no auto setting fits the "
                     f"device's {trainer.device_memory() / 2**30:.2f} GiB ({'; '.join(tried)}); "
                     f"`peakflat plan {config.name} --largest` finds the context that fits")

