"""The reduced loss (``ring_cross_entropy(reduction="mean" | "sum")``) and its one-pass path:
values and gradients against the float64 reference, NaN and ignored tokens, structure (no
[N, V] array, three strip matmuls per block), the bound against XLA's CPU plan, the auto rule."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers import iter_eqns, relative_error
from conftest import make_mesh
from jax.sharding import PartitionSpec as P

import peakflat_jax as pf
from peakflat_jax import memory, reference
from peakflat_jax.ops import fused_cross_entropy as fce
from peakflat_jax.ops import ring_cross_entropy as rce

LOSS_TOL = 1e-5  # fp32, simple: a sum of log-sum-exps
GRAD_TOL = 1e-4  # fp32, complex: blocks of matmuls, or a replayed ring
BF16_TOL = 2.0**-8  # a bf16 result: round-to-nearest alone costs up to 2^-9 relative


def reduced_loss_fn(mesh, check_vma=True, **kwargs):
    """The global mean (or sum): tokens and targets over the ring, the kernel sharded on it."""
    return jax.shard_map(
        lambda x, w, t: pf.ring_cross_entropy(x, w, t, axis_name="vocab", **kwargs),
        mesh=mesh, in_specs=(P("vocab"), P(None, "vocab"), P("vocab")), out_specs=P(),
        check_vma=check_vma)


def draw_case(rng, *, tokens, hidden, padded_vocab, vocab_size, ignored=0.2,
              hidden_dtype=np.float32, kernel_dtype=np.float32):
    x = rng.standard_normal((tokens, hidden)).astype(hidden_dtype)
    w = (rng.standard_normal((hidden, padded_vocab)) / np.sqrt(hidden)).astype(kernel_dtype)
    t = rng.integers(0, vocab_size, tokens).astype(np.int32)
    t[rng.random(tokens) < ignored] = -100
    return jnp.asarray(x), jnp.asarray(w), jnp.asarray(t)


def reference_value_and_grads(x, w, t, vocab_size, reduction):
    with jax.enable_x64(True):
        x64, w64 = (jnp.asarray(np.asarray(a, np.float64)) for a in (x, w))

        def loss(x, w):
            return reference.cross_entropy(x, w, t, vocab_size=vocab_size, reduction=reduction)

        value, grads = jax.value_and_grad(loss, argnums=(0, 1))(x64, w64)
        return float(value), [np.asarray(g) for g in grads]


def assert_matches_reference(loss_fn, x, w, t, vocab_size, reduction, *, grad_tol=GRAD_TOL):
    value, (dx, dw) = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1)))(x, w, t)
    ref_value, (ref_dx, ref_dw) = reference_value_and_grads(x, w, t, vocab_size, reduction)
    assert value.shape == () and value.dtype == jnp.float32
    assert dx.dtype == x.dtype and dw.dtype == w.dtype
    assert abs(float(value) - ref_value) <= LOSS_TOL * abs(ref_value)
    tolerance = {jnp.float32: grad_tol}
    assert relative_error(dx, ref_dx) < tolerance.get(dx.dtype, BF16_TOL)
    assert relative_error(dw, ref_dw) < tolerance.get(dw.dtype, BF16_TOL)
    # Without differentiation the loss alone (the one-pass path's primal) gives the same value.
    np.testing.assert_allclose(jax.jit(loss_fn)(x, w, t), value, rtol=LOSS_TOL)


@pytest.mark.parametrize("ring_size, mode, reduction", [
    # At P = 1 every mode is the one-pass path.
    (1, "auto", "mean"), (1, "move_weights", "sum"),
    (2, "gather_kernel", "mean"), (2, "gather_kernel", "sum"), (2, "move_weights", "mean"),
    (2, "move_activations", "mean"), (2, "move_activations", "sum"),
    (8, "gather_kernel", "mean"), (8, "move_weights", "sum"), (8, "move_activations", "mean"),
])
def test_matches_reference(rng, ring_size, mode, reduction):
    """Padding (the last shard ends in padding), ignored tokens excluded from the mean, and a
    token block that does not divide N (the last block starts early)."""
    tokens_per_rank, shard_width = 20, 12
    vocab_size = ring_size * shard_width - 3
    mesh = make_mesh(("vocab", ring_size))
    x, w, t = draw_case(rng, tokens=ring_size * tokens_per_rank, hidden=16,
                        padded_vocab=ring_size * shard_width, vocab_size=vocab_size)
    loss_fn = reduced_loss_fn(mesh, vocab_size=vocab_size, mode=mode, reduction=reduction,
                              token_block=8, vocab_block=5)
    assert_matches_reference(loss_fn, x, w, t, vocab_size, reduction)


@pytest.mark.parametrize("ring_size", [1, 2])
@pytest.mark.parametrize("hidden_dtype, kernel_dtype", [(jnp.bfloat16, jnp.bfloat16),
                                                       (jnp.bfloat16, np.float32)])
def test_bf16_inputs(rng, ring_size, hidden_dtype, kernel_dtype):
    # bf16 x bf16 products are exact in fp32 and the softmax math is fp32, so the loss keeps the
    # fp32 tolerance; a bf16 gradient is held to its own rounding (dY is rounded to the compute
    # dtype for the matmuls, as the standard bf16 loss does).
    mesh = make_mesh(("vocab", ring_size))
    x, w, t = draw_case(rng, tokens=ring_size * 64, hidden=32, padded_vocab=ring_size * 48,
                        vocab_size=ring_size * 48, hidden_dtype=hidden_dtype,
                        kernel_dtype=kernel_dtype)
    loss_fn = reduced_loss_fn(mesh, mode="gather_kernel", reduction="mean", token_block=16)
    assert_matches_reference(loss_fn, x, w, t, ring_size * 48, "mean")


def test_without_vma_checks(rng):
    mesh = make_mesh(("vocab", 4))
    x, w, t = draw_case(rng, tokens=64, hidden=16, padded_vocab=64, vocab_size=61)
    for mode in ("gather_kernel", "move_activations"):
        loss_fn = reduced_loss_fn(mesh, check_vma=False, vocab_size=61, mode=mode,
                                  reduction="mean")
        assert_matches_reference(loss_fn, x, w, t, 61, "mean")


@pytest.mark.parametrize("mode", ["gather_kernel", "move_weights"])
def test_no_valid_token_is_nan_mean_with_zero_gradients(rng, mode):
    """torch's mean over no token: NaN; the gradients are zero (and finite), as torch's. The
    sum of no token is 0."""
    mesh = make_mesh(("vocab", 2))
    x, w, t = draw_case(rng, tokens=16, hidden=8, padded_vocab=32, vocab_size=32, ignored=1.0)
    for reduction, expected in [("mean", np.nan), ("sum", 0.0)]:
        loss_fn = reduced_loss_fn(mesh, mode=mode, reduction=reduction)
        value, grads = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1)))(x, w, t)
        np.testing.assert_array_equal(value, expected)
        for grad in grads:
            np.testing.assert_array_equal(grad, jnp.zeros_like(grad))
    with jax.enable_x64(True):
        assert np.isnan(reference.cross_entropy(x, w, t, reduction="mean"))


@pytest.mark.parametrize("mode", ["gather_kernel", "move_activations"])
def test_target_outside_vocab_is_nan(rng, mode):
    mesh = make_mesh(("vocab", 2))
    x, w, t = draw_case(rng, tokens=16, hidden=8, padded_vocab=32, vocab_size=30, ignored=0.0)
    t = t.at[3].set(30)  # a padding column
    loss_fn = reduced_loss_fn(mesh, vocab_size=30, mode=mode, reduction="mean")
    value, (dx, dw) = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1)))(x, w, t)
    assert np.isnan(value) and np.isnan(np.asarray(dx)[3]).all() and np.isnan(dw).any()


def test_padding_columns_are_never_read(rng):
    mesh = make_mesh(("vocab", 2))
    x, w, t = draw_case(rng, tokens=32, hidden=8, padded_vocab=32, vocab_size=27)
    w = w.at[:, 27:29].set(jnp.nan).at[:, 29:].set(jnp.inf)
    loss_fn = reduced_loss_fn(mesh, vocab_size=27, mode="gather_kernel", reduction="mean")
    value, (dx, dw) = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1)))(x, w, t)
    ref_value, (ref_dx, ref_dw) = reference_value_and_grads(x, w[:, :27], t, 27, "mean")
    assert abs(float(value) - ref_value) <= LOSS_TOL * abs(ref_value)
    assert relative_error(dx, ref_dx) < GRAD_TOL
    assert relative_error(dw[:, :27], ref_dw) < GRAD_TOL
    assert (np.asarray(dw[:, 27:]) == 0).all()


def test_mean_equals_the_per_token_forms_mean(rng):
    """The reduced form's value and gradients equal those of the per-token form's mean."""
    mesh = make_mesh(("vocab", 4))
    x, w, t = draw_case(rng, tokens=96, hidden=16, padded_vocab=64, vocab_size=60)
    per_token = jax.shard_map(
        lambda x, w, t: pf.ring_cross_entropy(x, w, t, axis_name="vocab", vocab_size=60),
        mesh=mesh, in_specs=(P("vocab"), P(None, "vocab"), P("vocab")), out_specs=P("vocab"))

    def per_token_mean(x, w, t):
        return per_token(x, w, t).sum() / (t != -100).sum()

    expected = jax.jit(jax.value_and_grad(per_token_mean, argnums=(0, 1)))(x, w, t)
    for mode in ("gather_kernel", "move_weights", "move_activations"):
        loss_fn = reduced_loss_fn(mesh, vocab_size=60, mode=mode, reduction="mean")
        value, grads = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1)))(x, w, t)
        assert abs(float(value - expected[0])) <= LOSS_TOL * abs(float(expected[0]))
        for grad, ref in zip(grads, expected[1]):
            assert relative_error(grad, ref) < GRAD_TOL


# -- structure ---------------------------------------------------------------------------------


def strip_dots(jaxpr, width):
    """The dot_generals of a jaxpr (nested ones included) with an operand or a result that has
    ``width`` columns: the matmuls over a [tokens, V] strip or the [H, V] kernel."""
    def touches(eqn):
        return any(width in getattr(v.aval, "shape", ()) for v in [*eqn.invars, *eqn.outvars])

    return [eqn for eqn in iter_eqns(jaxpr, "dot_general") if touches(eqn)]


def test_one_pass_does_three_strip_matmuls_per_block():
    """In the gradient's jaxpr every matmul over the vocabulary sits in the block loop's body,
    three of them (logits, dX, dW), and the loop runs once per block (the backward has none);
    without differentiation there is one."""
    tokens, hidden, vocab, block = 96, 16, 200, 32
    mesh = make_mesh(("vocab", 1))
    x = jax.ShapeDtypeStruct((tokens, hidden), jnp.float32)
    w = jax.ShapeDtypeStruct((hidden, vocab), jnp.float32)
    t = jax.ShapeDtypeStruct((tokens,), jnp.int32)
    loss_fn = reduced_loss_fn(mesh, reduction="mean", token_block=block)
    grad_jaxpr = jax.make_jaxpr(jax.grad(loss_fn, argnums=(0, 1)))(x, w, t).jaxpr
    loops = list(iter_eqns(grad_jaxpr, "scan"))
    assert len(loops) == 1 and loops[0].params["length"] == tokens // block
    body = loops[0].params["jaxpr"].jaxpr
    assert len(strip_dots(body, vocab)) == 3 == len(strip_dots(grad_jaxpr, vocab))
    primal = jax.make_jaxpr(loss_fn)(x, w, t).jaxpr
    assert len(strip_dots(primal, vocab)) == 1


def test_one_pass_holds_no_logits_sized_array():
    """Compiled forward + backward at P = 1 and P = 4 (gather_kernel): no array of N x V
    elements, only [T, V] strips and the [H, V] kernel and its gradient."""
    for ring_size, tokens, hidden, width, block in [(1, 2048, 16, 4096, 256),
                                                    (4, 1024, 16, 1024, 128)]:
        mesh = make_mesh(("vocab", ring_size))
        x = jax.ShapeDtypeStruct((ring_size * tokens, hidden), jnp.float32)
        w = jax.ShapeDtypeStruct((hidden, ring_size * width), jnp.float32)
        t = jax.ShapeDtypeStruct((ring_size * tokens,), jnp.int32)
        loss_fn = reduced_loss_fn(mesh, mode="gather_kernel", reduction="mean",
                                  token_block=block)
        compiled = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1))).lower(x, w, t).compile()
        vocab = ring_size * width
        memory.assert_no_array_at_least(compiled, 2 * block * vocab, what="logits strip")
        assert memory.largest_arrays(compiled, 1)[0][0] >= block * vocab  # the strip is there


# -- memory ------------------------------------------------------------------------------------


@pytest.mark.parametrize("ring_size, tokens, hidden, width, block, hidden_dtype, vocab_size", [
    (1, 1000, 32, 8192, 256, jnp.float32, None),
    (2, 512, 64, 4096, 128, jnp.float32, None),
    (4, 512, 32, 2048, 128, jnp.bfloat16, None),
    (4, 512, 32, 2048, 128, jnp.float32, 8000),
])
def test_memory_terms_bound_the_cpu_plan(ring_size, tokens, hidden, width, block, hidden_dtype,
                                         vocab_size):
    """The gather_kernel / one-pass terms hold XLA's CPU plan of forward + backward. Measured
    plan / bound: 0.993, 0.988, 0.994, 0.980: XLA keeps one block's logits and dY, fuses the
    softmax and one-hot into them, and scales the stored gradients in place. Compute dtypes are
    fp32 here: XLA:CPU upcasts the operands of bf16 x bf16 matmuls to fp32 copies, which a GPU
    does not (at P = 2, bf16 x bf16: 1.29x the bound, measured)."""
    mesh = make_mesh(("vocab", ring_size))
    x = jax.ShapeDtypeStruct((ring_size * tokens, hidden), hidden_dtype)
    w = jax.ShapeDtypeStruct((hidden, ring_size * width), jnp.float32)
    t = jax.ShapeDtypeStruct((ring_size * tokens,), jnp.int32)
    loss_fn = reduced_loss_fn(mesh, mode="gather_kernel", reduction="mean", token_block=block,
                              vocab_size=vocab_size)
    compiled = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1))).lower(x, w, t).compile()
    terms = rce.ring_cross_entropy_memory_terms(tokens, hidden, width, ring_size,
                                                mode="gather_kernel",
                                                hidden_dtype=hidden_dtype, reduction="mean",
                                                token_block=block, vocab_size=vocab_size)
    assert set(terms) == set(rce.MEMORY_FORMULAS)
    plan = memory.compiled_memory(compiled).temp
    assert plan <= sum(terms.values()) <= 1.05 * plan


def test_memory_terms_of_the_one_pass_path():
    terms = fce.memory_terms(10_000, 8, 100, token_block=1000, hidden_dtype=jnp.bfloat16,
                             kernel_dtype=jnp.bfloat16, gradient_is_output=False, vocab_size=99)
    assert terms == {"fused_strips": 1000 * 100 * (4 + 2),
                     "kernel_gradient": 8 * 100 * 4 + 8 * 100 * 2,
                     "hidden_gradient": 10_000 * 8 * 2, "block_partials": 1000 * 8 * 4,
                     "padding_bias": 1000 * 100 * 4, "cast": 0}
    ring = rce.ring_cross_entropy_memory_terms(10_000, 8, 25, 4, mode="gather_kernel",
                                               reduction="mean", token_block=1000,
                                               kernel_dtype=jnp.bfloat16,
                                               hidden_dtype=jnp.bfloat16, vocab_size=99)
    assert {k: ring[k] for k in terms} == terms
    assert ring["gathered_kernel"] == 8 * 100 * 2 and ring["masked_shard"] == 8 * 25 * 2
    assert ring["strips"] == ring["hops"] == 0
    # At P = 1 an fp32 kernel's accumulator is the gradient output itself.
    alone = fce.memory_terms(10_000, 8, 100, token_block=1000)
    assert alone["kernel_gradient"] == alone["padding_bias"] == 0


# -- the auto rule -----------------------------------------------------------------------------


def test_auto_schedule_rule():
    paper = dict(hidden=7168, hidden_dtype=jnp.float32, kernel_dtype=jnp.float32)
    choose = rce.choose_schedule
    # One device: always the one-pass path; per-token losses never gather the kernel.
    assert choose(16384, shard_width=200_000, ring_size=1, reduction="mean", **paper) == \
        "gather_kernel"
    assert choose(16384, shard_width=200_000, ring_size=1, reduction="mean",
                  mode="move_weights", **paper) == "gather_kernel"
    assert choose(16384, shard_width=100_000, ring_size=2, **paper) == "move_activations"
    # P = 2, N = 32,768 per rank, a 4096-column strip: the ring holds less than the gathered
    # head's O(H V), so auto keeps the ring; with the whole shard as one strip, or a budget
    # that holds the gathered head, it gathers.
    sizes = dict(num_tokens=32768, shard_width=100_000, ring_size=2, reduction="mean", **paper)
    assert choose(vocab_block=4096, **sizes) == "move_activations"
    assert choose(**sizes) == "gather_kernel"
    gathered = sum(rce.ring_cross_entropy_memory_terms(
        32768, 7168, 100_000, 2, mode="gather_kernel", reduction="mean").values())
    assert choose(vocab_block=4096, device_budget_bytes=gathered, **sizes) == "gather_kernel"
    assert choose(vocab_block=4096, device_budget_bytes=gathered - 1, **sizes) == \
        "move_activations"
    # What auto picks is what the operator runs (its memory terms are that schedule's).
    auto = rce.ring_cross_entropy_memory_terms(32768, 7168, 100_000, 2, reduction="mean")
    assert auto == rce.ring_cross_entropy_memory_terms(32768, 7168, 100_000, 2,
                                                       mode="gather_kernel", reduction="mean")


def test_auto_runs_the_chosen_schedule(rng):
    """A mean at P = 4 with a small N moves activations (no all_gather in the jaxpr); with a
    token count whose ring strips [N, Vs] outgrow the gathered head's [T, V], it gathers."""
    mesh = make_mesh(("vocab", 4))
    for tokens, expect_gather in [(8, False), (512, True)]:
        x, w, t = draw_case(rng, tokens=4 * tokens, hidden=8, padded_vocab=4 * 64,
                            vocab_size=256)
        schedule = rce.choose_schedule(tokens, 8, 64, 4, reduction="mean", token_block=32)
        assert (schedule == "gather_kernel") == expect_gather
        loss_fn = reduced_loss_fn(mesh, reduction="mean", token_block=32)
        jaxpr = jax.make_jaxpr(loss_fn)(x, w, t).jaxpr
        assert bool(list(iter_eqns(jaxpr, "all_gather"))) == expect_gather
        if expect_gather:
            assert_matches_reference(loss_fn, x, w, t, 256, "mean")


# -- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, argument", [
    (dict(mode="gather_kernel"), "mode"),
    (dict(reduction="avg"), "reduction"),
    (dict(reduction="mean", mode="ring"), "mode"),
    (dict(reduction="mean", token_block=0), "token_block"),
    (dict(reduction="mean", token_block=2.0), "token_block"),
])
def test_bad_input_names_the_argument(kwargs, argument):
    mesh = make_mesh(("vocab", 2))
    x, w, t = np.zeros((16, 8), np.float32), np.zeros((8, 32), np.float32), np.zeros(16, np.int32)
    loss_fn = jax.shard_map(
        lambda x, w, t: pf.ring_cross_entropy(x, w, t, axis_name="vocab", **kwargs),
        mesh=mesh, in_specs=(P("vocab"), P(None, "vocab"), P("vocab")),
        out_specs=P() if kwargs.get("reduction", "none") != "none" else P("vocab"))
    with pytest.raises(ValueError, match=argument):
        jax.jit(loss_fn).lower(x, w, t)
