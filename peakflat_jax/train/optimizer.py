"""The run's optimizer: AdamW with warm-up, cosine decay and global-norm clipping, its state in
host memory (``pf.offload_stream``) or on the device (``optax.adamw``, sharded like the
params). The schedule runs on the host: each step's rate (and the other hyperparameters) go
into the state before the step, so the compiled step does not depend on them.

Both keep an fp32 master copy of every weight and give the model its working dtype: the
offloaded one in host memory by design, the device one on the device when the working dtype
is narrower than fp32 (mixed precision's usual 16 bytes per parameter: bf16 weight and gradient,
fp32 master and two moments). So switching the operator changes where the state lives, never
the update: both apply optax.adamw's arithmetic to the fp32 master.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax

from peakflat_jax.config import OptimizerConfig
from peakflat_jax.optim.offload_stream import OffloadStreamState, offload_stream


def learning_rate_schedule(config: OptimizerConfig, total_steps: int) -> optax.Schedule:
    """Linear warm-up over W = ``warmup_steps`` steps from peak / (W + 1) (step s takes peak
    (s + 1) / (W + 1), the peak at step W), then cosine decay to ``min_learning_rate_ratio`` x
    peak at ``total_steps`` (or constant). Not from 0: optax counts steps from 0, so a warm-up
    from 0 makes the first update a no-op that still moves Adam's moments."""
    peak, warmup = config.learning_rate, config.warmup_steps
    start = peak / (warmup + 1)
    if config.decay == "cosine":
        return optax.warmup_cosine_decay_schedule(
            start, peak, warmup_steps=warmup, decay_steps=max(total_steps, warmup + 1),
            end_value=peak * config.min_learning_rate_ratio)
    if warmup == 0:
        return optax.constant_schedule(peak)
    return optax.join_schedules([optax.linear_schedule(start, peak, warmup),
                                 optax.constant_schedule(peak)], [warmup])


HYPERPARAMS = ("learning_rate", "b1", "b2", "eps", "weight_decay")
"""AdamW's hyperparameters that live in the optimizer state (``optax.inject_hyperparams``) and
are set before every step (``with_hyperparams``): inputs of the compiled step, not constants,
so that a new schedule, step count or rate reuses it."""


def injected_adamw(config: OptimizerConfig) -> optax.GradientTransformation:
    """optax.adamw (fp32 moments) with its hyperparameters in its state (``HYPERPARAMS``)."""
    return optax.inject_hyperparams(optax.adamw, static_args=("mu_dtype",))(
        learning_rate=config.learning_rate, b1=config.b1, b2=config.b2, eps=config.eps,
        weight_decay=config.weight_decay, mu_dtype=jnp.float32)


def hyperparams_at(config: OptimizerConfig, schedule: optax.Schedule, step: int) -> dict:
    """The values of ``HYPERPARAMS`` for the update that follows ``step`` updates: the
    schedule's rate at ``step`` (as optax's own count-driven schedule gives it), the rest as
    configured. Computed on the host."""
    return {"learning_rate": float(schedule(step)), "b1": config.b1, "b2": config.b2,
            "eps": config.eps, "weight_decay": config.weight_decay}


def with_hyperparams(opt_state, values: dict):
    """``opt_state`` (a DeviceAdamW's or an OffloadStreamState) with its injected
    hyperparameters set to ``values``, each placed where the old value was."""
    def replace(path, leaf):
        # Dict entries are DictKeys (.key), the state's fields GetAttrKeys (.name).
        keys = [getattr(k, "key", getattr(k, "name", None)) for k in path]
        if "hyperparams" in keys and keys[-1] in values:
            new = jnp.asarray(values[keys[-1]], leaf.dtype)
            sharding = getattr(leaf, "sharding", None)
            return jax.device_put(new, sharding) if sharding is not None else new
        return leaf

    if isinstance(opt_state, OffloadStreamState):
        split = opt_state.layout.state_split
        placeholders = [np.zeros(0) for _ in split.per_param_dtypes]
        tree = jax.tree_util.tree_map_with_path(replace,
                                                split.join(placeholders, opt_state.shared))
        return dataclasses.replace(opt_state, shared=tuple(split.split(tree)[1]))
    return jax.tree_util.tree_map_with_path(replace, opt_state)


class DeviceAdamW:
    """optax.adamw (clipped) on an fp32 master kept on the device: ``init(params) -> state``,
    ``update(grads, params, state) -> (params, state)``, pure, for use inside a jitted step.
    Its hyperparameters are set per step with ``with_hyperparams``."""

    def __init__(self, config: OptimizerConfig):
        clip = (optax.clip_by_global_norm(config.max_grad_norm)
                if config.max_grad_norm is not None else optax.identity())
        self.transformation = optax.chain(clip, injected_adamw(config))

    def init(self, params):
        """(fp32 master or None where the params are fp32 already, optax state)."""
        master = None
        if any(leaf.dtype != jnp.float32 for leaf in jax.tree.leaves(params)):
            master = jax.tree.map(lambda p: p.astype(jnp.float32), params)
        return master, self.transformation.init(params if master is None else master)

    def update(self, grads, params, state):
        master, optax_state = state
        target = params if master is None else master
        grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        updates, optax_state = self.transformation.update(grads, optax_state, target)
        target = optax.apply_updates(target, updates)
        if master is None:
            return target, (None, optax_state)
        working = jax.tree.map(lambda m, p: m.astype(p.dtype), target, params)
        return working, (target, optax_state)


def make_offloaded(config: OptimizerConfig):
    """``pf.offload_stream`` of the injected AdamW (``injected_adamw``) with the run's buckets,
    slots and clipping."""
    return offload_stream(injected_adamw(config), bucket_params=config.bucket_params,
                          slots=config.slots, max_grad_norm=config.max_grad_norm)
