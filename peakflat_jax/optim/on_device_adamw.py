"""The on-device AdamW baseline's memory: plain ``optax.adamw`` with its state on the device, the
alternative that OffloadStreamAdamW is measured against and that the planner compares with.

optax keeps no fp32 master: ``optax.adamw`` updates whatever params it is given, in their dtype.
The baseline therefore keeps fp32 params (they are the master; the gradients are fp32 too),
which is what the trainer's on-device path does. Training bf16 params with optax directly would
apply the updates in bf16, and a bf16 setup that keeps its own fp32 master (cast to bf16 for
the forward) pays the ``master`` term below. Either way the total is 16 bytes per parameter,
SPEC.md's ``16 * Theta / W``: the terms are ``on_device_adamw_memory_terms`` and their
formulas ``MEMORY_FORMULAS``.

Legend: P parameters per device, b = bytes per element of the params and grads.
"""

from __future__ import annotations

import jax.numpy as jnp

from peakflat_jax._validate import as_int

MEMORY_FORMULAS = {
    "params": "P * b  (the params optax updates; fp32 in the baseline)",
    "grads": "P * b",
    "master": "P * 4 if b < 4 else 0  (an fp32 master beside lower-precision params)",
    "moments": "P * 8  (optax.adamw's mu and nu, mu_dtype=float32)",
}


def on_device_adamw_memory_terms(num_params_per_device: int,
                                 param_dtype=jnp.float32) -> dict[str, int]:
    """Per-device bytes of each term of on-device optax.adamw (``MEMORY_FORMULAS``): the params
    and grads in ``param_dtype``, an fp32 master when that is narrower than fp32, and the two
    fp32 moments. The step count (4 bytes) is left out."""
    num_params = as_int("num_params_per_device", num_params_per_device)
    itemsize = jnp.dtype(param_dtype).itemsize
    return {"params": num_params * itemsize,
            "grads": num_params * itemsize,
            "master": num_params * 4 if itemsize < 4 else 0,
            "moments": num_params * 8}
