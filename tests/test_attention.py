"""Attention's gpt-oss additions (model/attention.py): sinks and sliding windows, through the
Ulysses exchange on the (data, seq) mesh, with packed documents, against a float64 reference
written per query (a log-sum-exp over the visible keys and the sink), values and gradients;
and the kernel choice they force."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers import relative_error
from conftest import make_mesh

from peakflat_jax.model.attention import (
    check_sequence_length,
    choose_implementation,
    ulysses_attention,
)

TOL = 1e-5  # fp32 against float64, one softmax and two matmuls


def reference_attention(q, k, v, segment_ids, sinks, window):
    """out[b, i, h] = sum_j w_ij v[b, j, h // G] over the keys j that query i sees (j <= i, its
    document, i - j < window unless window is 0), w_ij = exp(s_ij - lse_i), lse_i the
    log-sum-exp of those s_ij and of the head's sink logit (none: -inf)."""
    batch, length, num_heads, dim = q.shape
    group = num_heads // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    scores = jnp.einsum("bihd,bjhd->bhij", q, k) / np.sqrt(dim)
    i, j = np.arange(length)[:, None], np.arange(length)[None, :]
    visible = (j <= i) & ((window == 0) | (i - j < window))
    visible = visible[None, None] & (segment_ids[:, None, :, None] == segment_ids[:, None, None, :])
    scores = jnp.where(visible, scores, -jnp.inf)
    sink = jnp.full((num_heads,), -jnp.inf) if sinks is None else sinks
    lse = jnp.logaddexp(jax.scipy.special.logsumexp(scores, axis=-1),
                        sink[None, :, None])  # [B, H, T]
    return jnp.einsum("bhij,bjhd->bihd", jnp.exp(scores - lse[..., None]), v)


def draw(rng, *, batch=2, length=16, heads=8, kv_heads=4, dim=8):
    q = rng.standard_normal((batch, length, heads, dim))
    k = rng.standard_normal((batch, length, kv_heads, dim))
    v = rng.standard_normal((batch, length, kv_heads, dim))
    sinks = rng.standard_normal(heads) * 2
    # Packed documents: 3 in the first sequence (a run shorter than the window among them),
    # padding (segment 0) ending the second.
    segment_ids = np.array([[1] * 6 + [2] * 3 + [3] * 7, [1] * 12 + [0] * 4])[:batch]
    return [jnp.asarray(a, jnp.float32) for a in (q, k, v, sinks)], jnp.asarray(segment_ids)


@pytest.mark.parametrize("kv_heads", [4, 2])  # seq divides 4 kv heads, not 2 (repeated first)
@pytest.mark.parametrize("sinks_on, window", [(True, 5), (True, 0), (False, 4)])
def test_sinks_and_window_match_reference(rng, kv_heads, sinks_on, window):
    """On a (2, 4) mesh: each seq device attends for 2 of the 8 heads after the exchange, so
    each must take its own heads' sinks."""
    mesh = make_mesh(("data", 2), ("seq", 4))
    (q, k, v, sinks), segment_ids = draw(rng, kv_heads=kv_heads)
    sinks = sinks if sinks_on else None
    cotangent = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)

    def ours(q, k, v, sinks):
        out = ulysses_attention(q, k, v, segment_ids, mesh=mesh, implementation="xla",
                                max_segments=3, sinks=sinks, window=jnp.int32(window))
        return jnp.vdot(out, cotangent), out

    argnums = (0, 1, 2, 3) if sinks_on else (0, 1, 2)
    (_, out), grads = jax.jit(jax.value_and_grad(ours, argnums=argnums, has_aux=True))(
        q, k, v, sinks)
    with jax.enable_x64(True):
        as64 = [None if a is None else jnp.asarray(np.asarray(a), jnp.float64)
                for a in (q, k, v, sinks, cotangent)]

        def theirs(q, k, v, sinks):
            out = reference_attention(q, k, v, segment_ids, sinks, window)
            return jnp.vdot(out, as64[4]), out

        (_, ref), ref_grads = jax.value_and_grad(theirs, argnums=argnums, has_aux=True)(
            *as64[:4])
        ref, ref_grads = np.asarray(ref), [np.asarray(g) for g in ref_grads]
    assert relative_error(out, ref) < TOL
    for name, grad, expected in zip("qkvs", grads, ref_grads):
        assert relative_error(grad, expected) < TOL, name


def test_without_sinks_the_kernel_is_jaxs_and_a_zero_window_is_none(rng):
    """No sinks, no window: jax.nn.dot_product_attention as before, equal to the reference
    (which the written-out form is checked against above); a traced window of 0 (a full layer
    in a stack where others slide) is the same attention."""
    mesh = make_mesh(("data", 2), ("seq", 4))
    (q, k, v, _), segment_ids = draw(rng)

    def run(window):
        return jax.jit(lambda *a: ulysses_attention(*a, segment_ids, mesh=mesh,
                                                    implementation="xla", max_segments=3,
                                                    window=window))(q, k, v)

    with jax.enable_x64(True):
        ref = np.asarray(reference_attention(*(jnp.asarray(np.asarray(a), jnp.float64)
                                               for a in (q, k, v)), segment_ids, None, 0))
    assert relative_error(run(None), ref) < TOL
    assert relative_error(run(jnp.int32(0)), ref) < TOL


def test_sinks_and_windows_take_the_xla_kernel():
    fields = ("model.attention_sinks",)
    assert choose_implementation("auto", "gpu", jnp.bfloat16) == "cudnn"
    assert choose_implementation("auto", "gpu", jnp.bfloat16, xla_only=fields) == "xla"
    with pytest.raises(ValueError, match=r"cudnn cannot compute model.attention_sinks"):
        choose_implementation("cudnn", "gpu", jnp.bfloat16, xla_only=fields)


@pytest.mark.parametrize("length", [634_549, 634_548, 443_720, 65_537, 4_096, 3])
def test_the_cudnn_length_rule_is_jaxs_own(length):
    """``check_sequence_length`` refuses exactly the lengths jax's cuDNN flash attention refuses
    to train (its trace-time check, run here on shapes alone; the training path passes a bias
    operand always, an empty one where there is none: has_bias True). The XLA kernel takes
    any length."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    q = jax.ShapeDtypeStruct((1, length, 16, 128), jnp.bfloat16)
    try:
        cudnn.check_is_flash_attention(q, q, q, cudnn.AttentionLayout.BTNH.value, 91000,
                                       True, True)
        jax_refuses = False
    except NotImplementedError:
        jax_refuses = True
    try:
        check_sequence_length("cudnn", length)
        we_refuse = False
    except ValueError as error:
        assert f"got {length}" in str(error)
        we_refuse = True
    assert we_refuse == jax_refuses
    check_sequence_length("xla", length)
