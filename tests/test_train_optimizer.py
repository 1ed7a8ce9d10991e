"""The run's optimizer with its hyperparameters as inputs (set from the host schedule before
every step) equals optax's own AdamW whose schedule runs on its internal count, on the device
and offloaded, and one compiled step serves any schedule."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import relative_error

from peakflat_jax.config import OptimizerConfig
from peakflat_jax.train.optimizer import (
    DeviceAdamW,
    hyperparams_at,
    learning_rate_schedule,
    make_offloaded,
    with_hyperparams,
)

STEPS = 6
CONFIG = OptimizerConfig(learning_rate=1e-2, warmup_steps=2, weight_decay=0.1, b2=0.95,
                         max_grad_norm=1.0, bucket_params=7)


def draw(rng):
    params = {"w": jnp.asarray(rng.standard_normal((4, 5)), jnp.float32),
              "b": jnp.asarray(rng.standard_normal((5,)), jnp.float32)}
    grads = [jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape) * scale,
                                                jnp.float32), params)
             for scale in (3.0, 0.1, 2.0, 0.05, 1.0, 0.3)]  # above and below the clip
    return params, grads


def optax_reference(params, grads):
    """optax.adamw with the schedule on its count, after optax's clip: the independent side."""
    schedule = learning_rate_schedule(CONFIG, STEPS)
    transformation = optax.chain(
        optax.clip_by_global_norm(CONFIG.max_grad_norm),
        optax.adamw(schedule, b1=CONFIG.b1, b2=CONFIG.b2, eps=CONFIG.eps,
                    weight_decay=CONFIG.weight_decay, mu_dtype=jnp.float32))
    state = transformation.init(params)
    history = []
    for g in grads:
        updates, state = transformation.update(g, state, params)
        params = optax.apply_updates(params, updates)
        history.append(params)
    return history


@pytest.mark.parametrize("where", ["device", "offloaded"])
def test_injected_hyperparameters_equal_optax_schedule(rng, where):
    params, grads = draw(rng)
    schedule = learning_rate_schedule(CONFIG, STEPS)
    expected = optax_reference(params, grads)
    if where == "device":
        optimizer = DeviceAdamW(CONFIG)
        state = optimizer.init(params)
        step = jax.jit(optimizer.update)
    else:
        optimizer = make_offloaded(CONFIG)
        state = optimizer.init(params)
    current = params
    for t, g in enumerate(grads):
        state = with_hyperparams(state, hyperparams_at(CONFIG, schedule, t))
        if where == "device":
            current, state = step(g, current, state)
        else:
            current, state = optimizer.step(g, state)
        for name in params:
            assert relative_error(current[name], expected[t][name]) < 1e-6, (t, name)


def test_the_rate_set_is_the_rate_used(rng):
    """A zero rate and no decay leave the weights as they are; the configured peak does not."""
    params, grads = draw(rng)
    optimizer = DeviceAdamW(CONFIG)
    state = optimizer.init(params)
    frozen = with_hyperparams(state, dict(hyperparams_at(CONFIG, lambda _: 0.0, 0),
                                          weight_decay=0.0))
    same, _ = jax.jit(optimizer.update)(grads[0], params, frozen)
    moved, _ = jax.jit(optimizer.update)(grads[0], params, state)
    for name in params:
        np.testing.assert_array_equal(same[name], params[name])
        assert not np.allclose(moved[name], params[name])


def test_one_compiled_step_serves_any_schedule(rng):
    """The step's program has no schedule in it: runs of other lengths or rates reuse it."""
    params, grads = draw(rng)
    optimizer = DeviceAdamW(CONFIG)
    # Committed to a device, as the trainer's arrays are (jit's outputs are).
    params, state = jax.device_put((params, optimizer.init(params)), jax.devices()[0])
    step = jax.jit(optimizer.update)
    for total_steps, peak in ((STEPS, 1e-2), (3 * STEPS, 3e-3)):
        config = OptimizerConfig(**{**CONFIG.__dict__, "learning_rate": peak})
        schedule = learning_rate_schedule(config, total_steps)
        for t in range(2):
            state = with_hyperparams(state, hyperparams_at(config, schedule, t))
            params, state = step(grads[t], params, state)
    assert step._cache_size() == 1
