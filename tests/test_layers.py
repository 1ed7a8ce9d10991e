"""The decoder's layers: the dense FFN's backward ordered by ``weight_gradients_first``, against
float64 autodiff of the plain function."""

import jax
import jax.numpy as jnp
import pytest
from _helpers import relative_error

from peakflat_jax.model.layers import weight_gradients_first


def swiglu(x, w_gate, w_up, w_down):
    return (jax.nn.silu(x @ w_gate) * (x @ w_up)) @ w_down


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpointed"])
def test_the_ordered_backward_is_the_ffn_s_exactly(rng, checkpointed):
    """Values and the gradients of the input and of the three weights, in fp32 and under
    ``jax.checkpoint`` as SCO runs a layer, against float64 autodiff of the unordered function
    on fresh random inputs (a cotangent not all ones, so that a dropped or swapped gradient
    shows)."""
    tokens, hidden, width = 48, 16, 40
    arrays = [rng.standard_normal(shape) * scale for shape, scale in [
        ((tokens, hidden), 1.0), ((hidden, width), hidden**-0.5), ((hidden, width), hidden**-0.5),
        ((width, hidden), width**-0.5)]]
    cotangent = rng.standard_normal((tokens, hidden))
    ordered = weight_gradients_first(swiglu)
    if checkpointed:
        ordered = jax.checkpoint(ordered)
    out, vjp = jax.vjp(ordered, *(jnp.asarray(a, jnp.float32) for a in arrays))
    grads = vjp(jnp.asarray(cotangent, jnp.float32))
    with jax.enable_x64(True):
        ref_out, ref_vjp = jax.vjp(swiglu, *(jnp.asarray(a, jnp.float64) for a in arrays))
        ref_grads = ref_vjp(jnp.asarray(cotangent, jnp.float64))
    assert relative_error(out, ref_out) < 1e-5
    for name, grad, ref in zip(("x", "w_gate", "w_up", "w_down"), grads, ref_grads):
        assert grad.dtype == jnp.float32 and grad.shape == ref.shape, name
        assert relative_error(grad, ref) < 1e-5, name
