"""How many grouped-matmul calls one MoE layer puts into a training step's program (the Mosaic
kernels are compiled once per call site on a GPU): forward, SCO's recompute and the custom
VJP's backward of ``pf.pipelined_moe`` inside ``pf.sco_scan``, counted in the gradient's jaxpr.

    python scripts/probes/count_grouped_matmul_sites.py
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import peakflat_jax as pf  # noqa: E402
from peakflat_jax.ops import grouped_matmul as gm  # noqa: E402
from peakflat_jax.ops.pipelined_moe import MoEBackend  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
from _helpers import iter_eqns  # noqa: E402


def _ragged(lhs, rhs, group_sizes):
    return jax.lax.ragged_dot(lhs, rhs, group_sizes,
                              preferred_element_type=jnp.float32).astype(lhs.dtype)


def _weight_grad(lhs, dy, group_sizes):
    numbers = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((0,), (0,)), ((), ())), lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[])
    return jax.lax.ragged_dot_general(lhs, dy, group_sizes, numbers,
                                      preferred_element_type=jnp.float32).astype(lhs.dtype)


# Stand-ins with the Mosaic path's custom-VJP rule: one ragged_dot per kernel call.
KERNELS = gm.GroupedMatmulKernels(
    forward=_ragged, input_grad=lambda dy, rhs, gs: _ragged(dy, jnp.swapaxes(rhs, 1, 2), gs),
    weight_grad=_weight_grad)


def call_sites(layers: int, chunks: int, tokens=1024, hidden=128, ffn=128, experts=8,
               top_k=2) -> int:
    mesh = jax.make_mesh((1,), ("e",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:1])

    def layer(h, p):
        ids = jnp.tile(jnp.arange(top_k, dtype=jnp.int32)[None], (tokens, 1))
        gates = jnp.full((tokens, top_k), 0.5, h.dtype)
        moe = jax.shard_map(
            lambda *a: pf.pipelined_moe(*a, axis_name="e", num_experts=experts,
                                        token_budget=tokens // chunks,
                                        backend=MoEBackend(grouped_matmul=KERNELS)),
            mesh=mesh, in_specs=(P("e"),) * 6, out_specs=P("e"))
        return h + moe(h, ids, gates, p["w_gate"], p["w_up"], p["w_down"])

    params = {"w_gate": jnp.zeros((layers, experts, hidden, ffn), jnp.bfloat16),
              "w_up": jnp.zeros((layers, experts, hidden, ffn), jnp.bfloat16),
              "w_down": jnp.zeros((layers, experts, ffn, hidden), jnp.bfloat16)}
    h = jnp.zeros((tokens, hidden), jnp.bfloat16)
    jaxpr = jax.make_jaxpr(jax.grad(lambda h, p: pf.sco_scan(layer, h, p, offload=layers).astype(
        jnp.float32).sum(), argnums=1))(h, params)
    return sum(1 for _ in iter_eqns(jaxpr.jaxpr, "ragged_dot_general"))


if __name__ == "__main__":
    for chunks in (1, 4):
        for layers in (1, 7):
            print(f"chunks {chunks}, MoE layers {layers}: {call_sites(layers, chunks)} grouped-"
                  f"matmul call sites")
