"""A stand-in for ``lax.ragged_all_to_all`` on backends without it (XLA:CPU), for tests and CPU dry
runs of the experimental ragged exchange: the same semantics, built from an all-gather (every
source's operand is gathered: a semantic stand-in, not a bounded one)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from peakflat_jax.ops._shard import varying_like


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                               recv_sizes, *, axis_name):
    """``lax.ragged_all_to_all``'s result: each source's ``send_sizes[d]`` rows from
    ``input_offsets[d]`` land on device d at that source's ``output_offsets[d]``; the rest of
    ``output`` is kept."""
    del recv_sizes  # implied by the senders' sizes
    me = lax.axis_index(axis_name)
    operands = lax.all_gather(operand, axis_name)  # [D, rows_in, ...]
    starts = lax.all_gather(output_offsets, axis_name)[:, me]  # [D] each source's landing
    sizes = lax.all_gather(send_sizes, axis_name)[:, me]
    sources = lax.all_gather(input_offsets, axis_name)[:, me]
    row = jnp.arange(output.shape[0])
    inside = (row >= starts[:, None]) & (row < (starts + sizes)[:, None])  # [D, rows_out]
    source = jnp.argmax(inside, axis=0)
    source_row = jnp.clip(sources[source] + row - starts[source], 0, operand.shape[0] - 1)
    values = operands[source, source_row]
    covered = inside.any(axis=0).reshape(-1, *([1] * (output.ndim - 1)))
    return jnp.where(covered, values, output)


def typed_like_the_collective(operand, output, *routing, axis_name):
    """The emulation, typed like the real collective and failing if anything differentiates it:
    the ragged exchange must take its own transposes (jax's rule for the real collective gave
    wrong gradients on GPUs).

    ``lax.ragged_all_to_all``'s result has the type of its ``output`` operand, invariant over
    the expert axis when that is a fresh constant buffer, whereas the emulation's ``where``
    varies; a host callback drops the varying type the same way."""

    @jax.custom_jvp
    def collective(operand, output):
        result = emulated_ragged_all_to_all(operand, output, *routing, axis_name=axis_name)
        invariant = jax.pure_callback(
            np.asarray, jax.ShapeDtypeStruct(result.shape, result.dtype), result)
        return varying_like(invariant, output)

    @collective.defjvp
    def _differentiated(primals, tangents):
        raise AssertionError("the ragged all-to-all itself was differentiated")

    return collective(operand, output)
