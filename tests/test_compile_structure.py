"""What a step compiles does not grow with depth: the layer stack is one loop body, the MoE's
chunk loop has no peeled steps, and identical Mosaic kernels share one kernel hash."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers import iter_eqns
from flax import nnx

from peakflat_jax import mesh as mop
from peakflat_jax.config import load_config
from peakflat_jax.model.decoder import MoEDecoder
from peakflat_jax.train.trainer import runtime_for

# h200-1 leaves its operators to the planner; these programs are the ones with all four on.
ON = ["operators.moe_dispatch=pipelined", "operators.loss=ring", "operators.offload=all",
      "operators.optimizer_offload=true"]


def gradient_jaxpr(overrides: list[str]):
    """The jaxpr of h200-1's loss gradient (abstract weights: nothing is allocated), on one
    CPU device, as the trainer traces it."""
    config = load_config("h200-1", [*ON, *overrides])
    mesh = mop.make_mesh(config.mesh, jax.devices()[:1])
    runtime = runtime_for(config, mesh)
    padded = mop.padded_vocab(config.model.vocab_size, 1)
    graphdef, params = nnx.split(nnx.eval_shape(
        lambda: MoEDecoder(config.model, padded_vocab=padded, rngs=nnx.Rngs(0))))
    tokens = jax.ShapeDtypeStruct((config.data.batch_size, config.data.seq_len), jnp.int32)
    batch = {key: tokens for key in ("tokens", "targets", "positions", "segment_ids")}
    offload = (True,) * config.model.num_layers

    def loss(params, batch):
        return nnx.merge(graphdef, params)(batch, runtime, offload)[0]

    return jax.make_jaxpr(jax.grad(loss))(params, batch).jaxpr


def grouped_matmul_sites(jaxpr) -> int:
    """Grouped matmuls in the program (on CPU each is one lax.ragged_dot_general; on a GPU one
    Mosaic kernel call, or two where its rows run in two parts)."""
    return sum(1 for _ in iter_eqns(jaxpr, "ragged_dot_general"))


@pytest.mark.parametrize("loop", ["scan", "unrolled"])
def test_grouped_matmul_sites_do_not_grow_with_depth(loop):
    small = ["data.seq_len=4096", "operators.token_budget=1024", f"operators.layer_loop={loop}"]
    depths = (8, 32) if loop == "scan" else (4, 8)  # (tracing 32 unrolled layers takes 30 s)
    sites = {layers: grouped_matmul_sites(gradient_jaxpr([f"model.num_layers={layers}",
                                                          *small]))
             for layers in depths}
    if loop == "scan":
        # One MoE layer's forward (3), SCO's recompute (3) and the chunk loop's backward
        # (3 recomputed + 6): each once, whatever the depth and the number of chunks.
        assert sites == {8: 15, 32: 15}
    else:  # the unrolled stack traces every layer: 3 and 7 MoE layers
        assert sites == {4: 3 * 15, 8: 7 * 15}


def test_identical_mosaic_kernels_share_one_hash():
    """Lowered for a GPU (on this CPU): N calls of one kernel give one kernel hash; a kernel
    with other blocks gives another. Without the fix (jax 0.11.2) each call hashed apart."""
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    from peakflat_jax.ops import grouped_matmul as gm

    gm.mosaic_kernels(gm.PREFERRED)  # installs the fix, as the Mosaic path does
    blocks = dict(block_m=128, block_n=128, block_k=64, max_concurrent_steps=4)

    def calls(lhs, rhs, group_sizes):
        out = [ragged_dot_mgpu.ragged_dot(lhs, rhs, group_sizes=group_sizes, grid_block_n=1,
                                          **blocks) for _ in range(3)]
        out.append(ragged_dot_mgpu.ragged_dot(lhs, rhs, group_sizes=group_sizes,
                                              grid_block_n=2, **blocks))
        return sum(out)

    lhs = jax.ShapeDtypeStruct((1024, 512), jnp.bfloat16)
    rhs = jax.ShapeDtypeStruct((8, 512, 512), jnp.bfloat16)
    group_sizes = jax.ShapeDtypeStruct((8,), jnp.int32)
    text = jax.jit(calls).trace(lhs, rhs, group_sizes).lower(
        lowering_platforms=("cuda",)).as_text()
    hashes = re.findall(r'kernel_hash = "([^"]*)"', text)
    assert len(hashes) == 4 and len(set(hashes)) == 2
    # The same program lowered again (a second process, or later in this one) is the same
    # text: the persistent cache's key does not depend on what was lowered before.
    again = jax.jit(calls).trace(lhs, rhs, group_sizes).lower(
        lowering_platforms=("cuda",)).as_text()
    assert again == text
    assert np.unique(hashes).size == 2
