"""Can a jitted step donate optimizer-state leaves that live in pinned host memory, the way
MaxText 0.2.5 does with ``optimizer_memory_host_offload=true``? A standalone check, jax only,
about a minute on one GPU.

The state is made like MaxText's (a jit with pinned-host output shardings for mu, nu and the step
counter), the step moves those leaves to the device inside the jit, updates, and returns them to
pinned host memory, donating its whole input (MaxText's ``donate_argnums=0``). The cases differ
only in what touches the state before the first step:

    plain             nothing
    aot               the step lowered and compiled first (MaxText compiles before its loop)
    int_step          int() of the pinned-host step counter first (MaxText's get_first_step)
    maxtext_order     int() of the counter, then the compile, then the loop: MaxText's order
    devcopy_step      int() of a device copy of the counter instead (the bench's fix)
    live_view         a numpy view of mu kept alive (a control: must fail with the error)
    scalar_on_device  maxtext_order with the counter kept in device memory

One line per case: OK, or FAIL with the error.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

MESH = jax.make_mesh((1,), ("x",))
HOST = NamedSharding(MESH, P(), memory_kind="pinned_host")
DEVICE = HOST.with_memory_kind("device")
CASES = ("plain", "aot", "int_step", "maxtext_order", "devcopy_step", "live_view",
         "scalar_on_device")


def init():
    return {"w": jnp.ones((2048, 2048), jnp.float32), "mu": jnp.zeros((2048, 2048), jnp.float32),
            "nu": jnp.zeros((2048, 2048), jnp.float32), "step": jnp.array(0, jnp.uint32)}


def step(state):
    moved = jax.device_put({k: state[k] for k in ("mu", "nu", "step")},
                           {k: DEVICE for k in ("mu", "nu", "step")})
    g = jnp.sin(state["w"])
    mu = 0.9 * moved["mu"] + 0.1 * g
    nu = 0.95 * moved["nu"] + 0.05 * g * g
    return {"w": state["w"] - 1e-3 * mu / (jnp.sqrt(nu) + 1e-8), "mu": mu, "nu": nu,
            "step": moved["step"] + 1}


def run(case: str) -> str:
    shardings = {"w": DEVICE, "mu": HOST, "nu": HOST,
                 "step": DEVICE if case == "scalar_on_device" else HOST}
    train = jax.jit(step, in_shardings=(shardings,), out_shardings=shardings, donate_argnums=0)
    state = jax.jit(init, out_shardings=shardings)()
    keep = None
    if case in ("int_step", "maxtext_order", "scalar_on_device"):
        int(state["step"])
    if case in ("aot", "maxtext_order", "scalar_on_device"):
        train.lower(state).compile()
    if case == "devcopy_step":
        int(jax.device_put(state["step"], DEVICE))
    if case == "live_view":
        keep = np.asarray(state["mu"])
    try:
        for _ in range(3):
            state = train(state)
        jax.block_until_ready(state)
        return f"OK step={int(jax.device_put(state['step'], DEVICE))}"
    except Exception as error:  # a failure is this check's result
        return f"FAIL {type(error).__name__}: {str(error)[:300]}"
    finally:
        del keep


if __name__ == "__main__":
    print(jax.__version__, jax.devices()[0].device_kind, flush=True)
    for name in CASES:
        print(f"CASE {name}: {run(name)}", flush=True)
