"""The memory of the two optimizers the trainer implements itself (``train.optimizer``): AdamW
with its state on the device, and AdamW on the host CPU. (OffloadStreamAdamW, an operator,
exports its own: ``optim.offload_adamw``.)

On the device (``DeviceAdamW``: plain ``optax.adamw``, ``mu_dtype`` fp32) the state is the
params, their gradients, an fp32 master where the params are narrower than fp32 and the two
fp32 moments: 16 bytes a parameter with fp32 params (``on_device_adamw_memory_terms``).

On the host CPU (``HostCpuAdamW``, ZeRO-Offload's placement: ``optimizer.update_on:
host_cpu``) the fp32 master and both moments live in the CPU backend's host memory: each step
the gradients come down (P b bytes), one CPU program with its inputs donated clips them and
applies AdamW leaf after leaf (a large leaf's chunks side by side), the new working params are
written over the gradients' buffer and go back up (P b bytes). The device then holds only the
params and their gradients; the host holds, per device,

    12 P                              fp32 master, mu, nu
    P b + 4 P_max / W  [clipped]      the gradients as they came down (then the new params),
                                      and one leaf's clipped fp32 gradient at a time, the
                                      largest's (P_max elements, whole: one process's program
                                      holds it for its W devices)

which is XLA:CPU's plan of the update, held in tests/test_plan.py. Leaf after leaf is the
program's doing: over the whole tree at once XLA:CPU kept every leaf's clipped fp32 gradient
alive, 4 P more. On a GPU the gradients also cross from the GPU's client to the CPU's through a
host copy of their own (P b), and the CPU client is resident beside the GPU runtime (a measured
constant, ``host_cpu_adamw_client_bytes``).

Legend: P parameters per device (its shards), P_max the largest leaf's elements (whole), W the
devices of the process, b bytes per element of the working params.
"""

from __future__ import annotations

import jax.numpy as jnp

from peakflat_jax._validate import as_int

ON_DEVICE_FORMULAS = {
    "params": "P * b: this device's weight shards",
    "grads": "P * b: their gradients, placed alike",
    "master": "P * 4 if b < 4 else 0: an fp32 master beside lower-precision params",
    "moments": "P * 8: AdamW's fp32 mu and nu",
}


def on_device_adamw_memory_terms(num_params_per_device: int,
                                 param_dtype=jnp.float32) -> dict[str, int]:
    """Per-device bytes of each term of on-device AdamW (``ON_DEVICE_FORMULAS``). The step
    count (4 bytes) is left out."""
    num_params = as_int("num_params_per_device", num_params_per_device)
    itemsize = jnp.dtype(param_dtype).itemsize
    return {"params": num_params * itemsize,
            "grads": num_params * itemsize,
            "master": num_params * 4 if itemsize < 4 else 0,
            "moments": num_params * 8}


HOST_CPU_FORMULAS = {
    "cpu_adamw_state": "12 * P: fp32 master, mu and nu in the CPU backend's host memory",
    "cpu_adamw_transit": "P * b + 4 * P_max / W with clipping (else P * b): the gradients as "
                         "they came down, whose buffer the new params reuse, and one leaf's "
                         "clipped fp32 gradient at a time, the largest's",
    "cpu_adamw_scalars": "1 KiB: the update's scalars and bookkeeping",
    "cpu_adamw_cross_client_copy": "P * b on a GPU: the gradients' host copy between the GPU's "
                                   "client and the CPU's",
    "cpu_adamw_cpu_client": "the CPU client beside the GPU runtime (measured: "
                            "host_cpu_adamw_client_bytes)",
}
SCALAR_BYTES = 1024
"""``cpu_adamw_scalars``: per device, whatever the model's size."""


def host_cpu_adamw_host_terms(num_params_per_device: int, param_dtype, *, largest_leaf: int,
                              num_devices: int, clipped: bool, platform: str,
                              client_bytes: int = 0) -> dict[str, int]:
    """Per-device host bytes of each term (``HOST_CPU_FORMULAS``); ``largest_leaf``: P_max,
    the largest leaf's elements (whole); ``num_devices``: W, the devices whose shards the one
    program updates; ``clipped``: global-norm clipping on; ``platform``: the devices' (on
    ``cpu`` nothing crosses between two clients); ``client_bytes``: the CPU client's resident
    bytes beside a GPU runtime (a measured constant)."""
    num_params = as_int("num_params_per_device", num_params_per_device)
    largest, width = as_int("largest_leaf", largest_leaf), as_int("num_devices", num_devices)
    itemsize = jnp.dtype(param_dtype).itemsize
    clipped_leaf = -(-4 * largest // width) if clipped else 0
    terms = {"cpu_adamw_state": 12 * num_params,
             "cpu_adamw_transit": num_params * itemsize + clipped_leaf,
             "cpu_adamw_scalars": SCALAR_BYTES}
    if platform == "gpu":
        terms["cpu_adamw_cross_client_copy"] = num_params * itemsize
        terms["cpu_adamw_cpu_client"] = client_bytes
    return terms


def host_cpu_adamw_link_bytes(num_params_per_device: int, param_dtype) -> dict[str, int]:
    """Per-device bytes a step moves across the host link: the gradients down and the new
    working params up, P * b each."""
    num_params = as_int("num_params_per_device", num_params_per_device)
    itemsize = jnp.dtype(param_dtype).itemsize
    return {"device_to_host": num_params * itemsize, "host_to_device": num_params * itemsize}
