"""The host-CPU AdamW baseline's memory and link traffic: ZeRO-Offload's placement, the standard
stack's optimizer where the device cannot hold AdamW's state (``optimizer.update_on:
host_cpu``; the optimizer is ``peakflat_jax.train.optimizer.HostCpuAdamW``).

The fp32 master and both moments live in host memory and the host CPU updates them: each step
the gradients come down in the working dtype (P * b bytes), one CPU program (its inputs
donated: in place) clips them by their global norm and applies AdamW leaf after leaf, each
leaf's chunks side by side (the state keeps a large leaf in up to 8 chunks of whole rows, so
that XLA:CPU runs a loop per chunk at once: all the host's cores, where one loop per leaf got
ceil(sqrt(cores)) of them), the new working params written over the gradients' buffer, and
those go back up (P * b bytes). So the device holds no optimizer state at all, only the params
and their gradients (``params``, ``grads``: 2 * P * b, the same as with OffloadStreamAdamW),
and the host holds, per device

    12 * P                                fp32 master, mu, nu (in chunks: the same bytes)
    P * b + 4 * P_max / W [clipped]       the step's transit: the gradients as they came down
                                          (then the working params), and with global-norm
                                          clipping one leaf's clipped fp32 gradient at a time
                                          (its chunks' side by side), the largest leaf's
                                          (P_max elements, whole: the one process's program
                                          holds it for its W devices)

which is XLA:CPU's plan of the update to its bookkeeping (arguments, temporaries, the outputs
aliased; tests/test_plan.py). The leaf after leaf is the program's doing
(``HostCpuAdamW``): over the whole tree at once XLA:CPU kept every leaf's clipped fp32 gradient
alive, 4 * P more. The link carries 2 * P * b a step (``host_cpu_adamw_link_bytes``) against
OffloadStreamAdamW's 24 * P (its state in and out): the host-CPU placement trades the link for
the host's arithmetic, which the planner's step estimate prices with a measured CPU rate
(``plan.rates.Rates.host_adamw_seconds_per_param``).

Legend: P parameters per device (its shards), P_max the largest leaf's elements (whole), W the
devices of the process, b bytes per element of the working params.

Measured: docs/offload_adamw.md ("The host-CPU baseline").
"""

from __future__ import annotations

import jax.numpy as jnp

from peakflat_jax._validate import as_int

MEMORY_FORMULAS = {
    "cpu_adamw_state": "12 * P: fp32 master, mu and nu in the CPU backend's host memory (not "
                       "XLA's pinned-host pool), a large leaf's in chunks",
    "cpu_adamw_transit": "P * b + 4 * P_max / W with clipping (else P * b): the gradients as "
                         "they came down, whose buffer the new working params reuse, and one "
                         "leaf's clipped fp32 gradient at a time (its chunks' side by side), "
                         "the largest's (P_max, whole; the process's W devices share it): "
                         "XLA:CPU's plan of the host update",
    "cpu_adamw_scalars": "1 KiB: the update's scalars and bookkeeping in XLA:CPU's plan of it "
                         "(step counts, hyperparameters, the global norm; 932 bytes over 8 "
                         "devices for tiny)",
    "cpu_adamw_cross_client_copy": "P * b on a GPU: the gradients' host copy as jax moves them "
                                   "from the GPU's client to the CPU's (inferred from one "
                                   "H200 host peak, h200-e2e at 64K: 124.62 GiB)",
    "cpu_adamw_cpu_client": "1.25 GiB on a GPU: the CPU client beside the GPU trainer's runtime "
                            "(resident between steps over the state: 7.14 and 7.22 GiB on an "
                            "H200, against the runtime's 6.0)",
}
SCALAR_BYTES = 1024
"""``cpu_adamw_scalars`` (``MEMORY_FORMULAS``): per device, whatever the model's size."""
CPU_CLIENT_BYTES = int(1.25 * 2**30)
"""``cpu_adamw_cpu_client`` (``MEMORY_FORMULAS``): measured, not derived."""


def host_cpu_adamw_host_terms(num_params_per_device: int, param_dtype, *, largest_leaf: int,
                              num_devices: int, clipped: bool,
                              platform: str) -> dict[str, int]:
    """Per-device host bytes of each term (``MEMORY_FORMULAS``): the state, and what the
    update's program holds beside it; ``largest_leaf``: P_max, the largest leaf's elements
    (whole); ``num_devices``: W, the devices whose shards the one program updates;
    ``clipped``: global-norm clipping on; ``platform``: the devices' (on ``cpu`` the gradients
    stay in one client and nothing is copied between two)."""
    num_params = as_int("num_params_per_device", num_params_per_device)
    largest, width = as_int("largest_leaf", largest_leaf), as_int("num_devices", num_devices)
    itemsize = jnp.dtype(param_dtype).itemsize
    clipped_leaf = -(-4 * largest // width) if clipped else 0
    terms = {"cpu_adamw_state": 12 * num_params,
             "cpu_adamw_transit": num_params * itemsize + clipped_leaf,
             "cpu_adamw_scalars": SCALAR_BYTES}
    if platform == "gpu":
        terms["cpu_adamw_cross_client_copy"] = num_params * itemsize
        terms["cpu_adamw_cpu_client"] = CPU_CLIENT_BYTES
    return terms


def host_cpu_adamw_link_bytes(num_params_per_device: int, param_dtype) -> dict[str, int]:
    """Per-device bytes a step moves across the host link: the gradients down and the new
    working params up, P * b each."""
    num_params = as_int("num_params_per_device", num_params_per_device)
    itemsize = jnp.dtype(param_dtype).itemsize
    return {"device_to_host": num_params * itemsize, "host_to_device": num_params * itemsize}
