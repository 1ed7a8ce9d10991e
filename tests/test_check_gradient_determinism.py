"""scripts/check_gradient_determinism.py's comparison: the first execution's outputs against a
later one's, device leaves bit for bit (with the largest difference), host leaves by their
fingerprint; one flipped bit anywhere is a differing leaf."""

from __future__ import annotations

import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from conftest import make_mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "check_gradient_determinism.py"


def load_script():
    spec = importlib.util.spec_from_file_location("check_gradient_determinism", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def flipped(array: np.ndarray, index: int) -> np.ndarray:
    """``array`` with the lowest bit of its element ``index`` (flat) flipped."""
    width = {1: np.uint8, 2: np.uint16, 4: np.uint32}[array.dtype.itemsize]
    out = array.copy()
    out.reshape(-1).view(width)[index] ^= 1
    return out


def test_a_flipped_bit_is_a_differing_leaf_in_device_and_host_memory(rng):
    script = load_script()
    mesh = make_mesh(("x", 8))
    device = NamedSharding(mesh, P("x"))
    host = device.with_memory_kind("pinned_host")
    grads = rng.normal(size=(64, 8)).astype(np.float32)
    weights = rng.normal(size=(16, 8)).astype(jnp.bfloat16)
    state = rng.normal(size=(32, 4)).astype(np.float32)

    def outputs(g, w, s):
        return {"grads": jax.device_put(g, device), "weights": jax.device_put(w, device),
                "state": jax.device_put(s, host), "step": jnp.int32(3)}

    comparison = script.Comparison(outputs(grads, weights, state))
    assert (len(comparison.first), comparison.host) == (4, 1)
    comparison.add(outputs(grads, weights, state))
    comparison.add(outputs(flipped(grads, 37), weights, state))
    comparison.add(outputs(grads, flipped(weights, 5), flipped(state, 100)))
    assert comparison.differing == [0, 1, 2]
    assert comparison.host_differing == [0, 0, 1]
    assert comparison.largest[0] == 0.0
    assert comparison.largest[1] == abs(float(flipped(grads, 37).reshape(-1)[37])
                                        - float(grads.reshape(-1)[37]))
    assert comparison.largest[1] > 0.0
