"""offload_stream_adamw: optax.adamw streamed from host memory, the optimizer of SPEC.md's
operator 4 (OffloadStreamAdamW).

It is ``offload_stream(optax.adamw(..., mu_dtype=float32), bucket_params, slots,
max_grad_norm)``: the algorithm, its layout, checkpoints and the per-group update are
``offload_stream``'s (peakflat_jax/optim/offload_stream.py). Its host state is the fp32 master,
mu and nu, 12 bytes per parameter; the per-device bounds are
``offload_stream_adamw_memory_terms`` (device) and ``offload_stream_adamw_host_bytes`` (host),
``offload_stream``'s with S = 8, formulas in ``MEMORY_FORMULAS``.

After every step the master equals optax.adamw applied to fp32 parameters with the same
gradients upcast to fp32 (gradients of any dtype are upcast before use; optax given bf16
gradients would square and clip them in bf16).

Why optax's own adamw and not a hand-written copy: run per bucket it is the same elementwise
arithmetic, and one streaming path serves every transformation.

Legend: P parameters per device, beta = bucket_params, s = slots, b = bytes per element of the
working params.

Measured: docs/offload_adamw.md
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

from peakflat_jax._validate import as_int
from peakflat_jax.optim.offload_stream import (
    OffloadStream,
    offload_stream_host_bytes,
    offload_stream_link_bytes,
    offload_stream_memory_terms,
)

Schedule = Callable[[jax.Array], jax.Array]

ADAMW_STATE_BYTES_PER_PARAM = 8  # fp32 mu and nu

MEMORY_FORMULAS = {
    "resident_state": "P_r * 12  (the resident groups' fp32 master, mu and nu, in device memory "
                      "for the state's lifetime; P_r: their parameters per device)",
    "staging": "min(s, num_buckets) * min(beta, P) * 16  (fp32 master, mu, nu and grad of each "
               "staged bucket: what the slot chain bounds)",
    "staging_gpu_excess": "min(beta, P) * 8  (what XLA's GPU plan of the step held beyond the "
                          "slots, at most, in the measured sweep)",
    "working_params": "P * b  (the new working params: the step's output, the trainer's)",
    "grads": "P * b  (the gradients: the step's input, the trainer's)",
}


def offload_stream_adamw_memory_terms(num_params_per_device: int, bucket_params: int,
                                      slots: int, param_dtype,
                                      resident_params: int = 0) -> dict[str, int]:
    """Per-device bytes of each term of the step's device bound (``MEMORY_FORMULAS``); see
    ``offload_stream_memory_terms``."""
    return offload_stream_memory_terms(num_params_per_device, bucket_params, slots, param_dtype,
                                       ADAMW_STATE_BYTES_PER_PARAM, resident_params)


def offload_stream_adamw_host_bytes(num_params_per_device: int, resident_params: int = 0) -> int:
    """Per-device host bytes of the state: fp32 master, mu and nu of the streamed groups,
    12 * (P - P_r)."""
    return offload_stream_host_bytes(num_params_per_device, ADAMW_STATE_BYTES_PER_PARAM,
                                     resident_params)


def offload_stream_adamw_link_bytes(num_params_per_device: int, resident_params: int = 0) -> int:
    """Per-device bytes a step moves over the host link: 24 * (P - P_r)."""
    return offload_stream_link_bytes(num_params_per_device, ADAMW_STATE_BYTES_PER_PARAM,
                                     resident_params)


def offload_stream_adamw(learning_rate: float | Schedule, b1: float = 0.9, b2: float = 0.999,
                         eps: float = 1e-8, weight_decay: float = 0.0,
                         bucket_params: int = 100_000_000, slots: int = 2,
                         max_grad_norm: float | None = None) -> OffloadStream:
    """AdamW (``optax.adamw`` with ``mu_dtype=float32``) with its fp32 master and moments in
    host memory, streamed through the device in buckets of at most ``bucket_params``, ``slots``
    staged at a time.

    ``learning_rate`` is a non-negative number or an optax schedule; ``max_grad_norm`` clips the
    gradients to that global norm first (as ``optax.clip_by_global_norm``). Returns an
    OffloadStream: ``state = opt.init(params)``, ``params, state = opt.step(grads, state)``,
    ``opt.master_params(state)``."""
    if not callable(learning_rate) and not (_is_real(learning_rate) and learning_rate >= 0):
        raise ValueError(f"learning_rate: expected a non-negative number or an optax schedule, "
                         f"got {learning_rate!r}")
    for name, value in (("b1", b1), ("b2", b2)):
        if not (_is_real(value) and 0 <= value < 1):
            raise ValueError(f"{name}: expected a number in [0, 1), got {value!r}")
    if not (_is_real(eps) and eps > 0):
        raise ValueError(f"eps: expected a positive number, got {eps!r}")
    if not (_is_real(weight_decay) and weight_decay >= 0):
        raise ValueError(f"weight_decay: expected a non-negative number, got {weight_decay!r}")
    as_int("bucket_params", bucket_params)
    as_int("slots", slots)
    learning_rate = learning_rate if callable(learning_rate) else float(learning_rate)
    transformation = optax.adamw(learning_rate, b1=float(b1), b2=float(b2), eps=float(eps),
                                 mu_dtype=jnp.float32, weight_decay=float(weight_decay))
    return OffloadStream(transformation, bucket_params, slots, max_grad_norm)


def _is_real(value) -> bool:
    return (isinstance(value, numbers.Real) and not isinstance(value, bool)
            and math.isfinite(value))
