"""grouped_matmul: the CPU path is lax.ragged_dot; the tiled path against float64; the choice of
implementation (from the device a call runs on) and its errors; the block choice; the custom
VJP's rule (built from reference kernels) against float64."""

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh
from jax import lax
from jax.sharding import PartitionSpec as P

from peakflat_jax.ops import grouped_matmul as gm

TOL = 1e-5  # fp32 with K <= 16 against float64: max error relative to the largest entry

# (group sizes, M): empty groups, padded rows (sum < M), one group holding every row.
GROUPINGS = [((7, 0, 13, 1, 9), 40), ((10, 10, 10, 10), 40), ((0, 0, 40, 0), 40),
             ((0, 0, 0), 8)]


def draw(rng, sizes, m, k=16, n=12, dtype=jnp.float32):
    x = rng.standard_normal((m, k))
    w = rng.standard_normal((len(sizes), k, n)) / np.sqrt(k)
    ct = rng.standard_normal((m, n))
    return (jnp.asarray(x, dtype), jnp.asarray(w, dtype), jnp.asarray(sizes, jnp.int32),
            jnp.asarray(ct, jnp.float32))


def reference64(x, w, sizes, ct):
    """Output, dx and dW of sum(out * ct) in float64, group by group."""
    x, w, ct = (np.asarray(a, np.float64) for a in (x, w, ct))
    out, dx, dw = np.zeros((x.shape[0], w.shape[2])), np.zeros_like(x), np.zeros_like(w)
    start = 0
    for g, size in enumerate(np.asarray(sizes)):
        rows = slice(start, start + size)
        out[rows], dx[rows], dw[g] = x[rows] @ w[g], ct[rows] @ w[g].T, x[rows].T @ ct[rows]
        start += size
    return out, dx, dw


def max_relative_error(actual, expected) -> float:
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    scale = np.abs(expected).max()
    return float(np.abs(actual - expected).max() / (scale if scale > 0 else 1.0))


def value_and_grads(fn, x, w, sizes, ct):
    out, vjp = jax.vjp(lambda x, w: fn(x, w, sizes), x, w)
    return (out, *vjp(ct))


# Reference kernels with the Mosaic kernels' contracts (GroupedMatmulKernels): rows past
# sum(group_sizes) of forward and input_grad come back as NaN (the Mosaic kernels leave them
# unwritten), and weight_grad masks rows by multiplying, as the Mosaic kernel does with its
# partial blocks, so that a non-zero or NaN dy in a padded row would leak into dW.


def row_groups(m, sizes):
    """Each row's group, G for rows past sum(sizes)."""
    return jnp.searchsorted(jnp.cumsum(sizes), jnp.arange(m), side="right")


def garbage_past_end(result, sizes):
    return jnp.where((row_groups(result.shape[0], sizes) < sizes.shape[0])[:, None], result,
                     jnp.nan)


def ref_forward(lhs, rhs, sizes):
    return garbage_past_end(lax.ragged_dot(lhs, rhs, sizes, precision=lax.Precision.HIGHEST,
                                           preferred_element_type=jnp.float32), sizes)


def ref_input_grad(dy, rhs, sizes):
    return garbage_past_end(lax.ragged_dot(dy, jnp.swapaxes(rhs, 1, 2), sizes,
                                           precision=lax.Precision.HIGHEST,
                                           preferred_element_type=jnp.float32), sizes)


def ref_weight_grad(lhs, dy, sizes):
    member = (row_groups(lhs.shape[0], sizes)[:, None] == jnp.arange(sizes.shape[0]))
    return jnp.einsum("mg,mk,mn->gkn", member.astype(jnp.float32), lhs.astype(jnp.float32),
                      dy.astype(jnp.float32), precision=lax.Precision.HIGHEST)


H200 = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
A100 = jax.sharding.AbstractDevice(device_kind="NVIDIA A100-SXM4-80GB", num_cores=108,
                                   platform="gpu")

REF_KERNELS = gm.GroupedMatmulKernels(forward=ref_forward, input_grad=ref_input_grad,
                                      weight_grad=ref_weight_grad)


def typed_like_pallas(kernel):
    """``kernel`` whose result, like a ``pallas_call``'s inside a ``shard_map``, is typed as
    invariant over the manual mesh axes (a host callback drops the varying type the same way)."""

    def call(*operands):
        result = kernel(*operands)
        return jax.pure_callback(np.asarray, jax.ShapeDtypeStruct(result.shape, result.dtype),
                                 result)

    return call


# What the MoE tests swap in for the Mosaic kernels.
PALLAS_TYPED_REF_KERNELS = gm.GroupedMatmulKernels(
    forward=typed_like_pallas(ref_forward), input_grad=typed_like_pallas(ref_input_grad),
    weight_grad=typed_like_pallas(ref_weight_grad))


# ----------------------------------------------------------------------------------------------
# The paths on CPU.


@pytest.mark.parametrize("sizes,m", GROUPINGS)
@pytest.mark.parametrize("implementation", [None, "xla"])
def test_cpu_path_is_ragged_dot(rng, sizes, m, implementation):
    x, w, sizes, ct = draw(rng, sizes, m)
    expected = value_and_grads(lambda x, w, s: lax.ragged_dot(
        x, w, s, preferred_element_type=jnp.float32), x, w, sizes, ct)
    actual = value_and_grads(jax.jit(lambda x, w, s: gm.grouped_matmul(
        x, w, s, implementation=implementation)), x, w, sizes, ct)
    for a, e in zip(actual, expected):
        np.testing.assert_array_equal(a, e)
    total = int(np.sum(sizes))
    assert actual[0].dtype == jnp.float32 and not np.any(np.asarray(actual[0])[total:])
    for a, r in zip(actual, reference64(x, w, sizes, ct)):
        assert max_relative_error(a, r) < TOL


def test_cpu_path_bf16_output_is_fp32(rng):
    x, w, sizes, _ = draw(rng, (5, 3), 10, dtype=jnp.bfloat16)
    out = gm.grouped_matmul(x, w, sizes.astype(jnp.int16))
    assert out.dtype == jnp.float32 and out.shape == (10, 12)
    np.testing.assert_array_equal(out, lax.ragged_dot(x, w, sizes,
                                                      preferred_element_type=jnp.float32))


def test_choice_follows_the_device():
    bf16 = jnp.bfloat16
    assert gm.select_grouped_matmul(H200, bf16, bf16, 128, 256) == gm.GroupedMatmul("mosaic")
    assert gm.select_grouped_matmul(H200, bf16, bf16, 128, 256, "xla") == gm.GroupedMatmul("xla")
    assert gm.select_grouped_matmul(A100, bf16, bf16, 128, 256) == gm.GroupedMatmul("tiled")
    assert gm.select_grouped_matmul(jax.devices()[0], bf16, bf16, 128, 256).implementation == "xla"
    assert gm.select_grouped_matmul(H200, bf16, bf16, 128, 256, "tiled") == gm.GroupedMatmul(
        "tiled")
    assert gm.GroupedMatmul("mosaic").row_alignment == gm.ROW_ALIGNMENT
    assert gm.GroupedMatmul("xla").row_alignment == 1
    # fp32 on a Hopper GPU (the kernels take bf16 and f16 only): the tiled path, no warning.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert gm.select_grouped_matmul(H200, jnp.float32, jnp.float32, 128, 256) == (
            gm.GroupedMatmul("tiled"))
    # bf16 where a shape rules the kernels out: tiled, with a warning (Mosaic would be faster).
    with pytest.warns(UserWarning, match="tiled XLA path.*K=192"):
        chosen = gm.select_grouped_matmul(H200, bf16, bf16, 192, 256)
    assert chosen == gm.GroupedMatmul("tiled")
    # The planner's view of the same choice (a GPU taken to be Hopper).
    assert [gm.planned_path(platform, dtype, dtype, k, 256) for platform, dtype, k in (
        ("gpu", bf16, 128), ("gpu", jnp.float32, 128), ("gpu", bf16, 192), ("cpu", bf16, 128))
    ] == ["mosaic", "tiled", "tiled", "xla"]
    with pytest.raises(ValueError, match=r"implementation='mosaic'\) cannot run.*K=192"):
        gm.select_grouped_matmul(H200, bf16, bf16, 192, 256, "mosaic")
    with pytest.raises(RuntimeError, match=r"Hopper GPU.*A100"):
        gm.select_grouped_matmul(A100, bf16, bf16, 128, 256, "mosaic")
    kernels = gm.select_grouped_matmul(jax.devices()[0], bf16, bf16, 8, 8, REF_KERNELS)
    assert kernels == gm.GroupedMatmul("mosaic", kernels=REF_KERNELS)


def test_call_device_is_the_meshs_inside_shard_map():
    mesh = make_mesh(("x", 2))
    seen = []

    def record(a):
        seen.append(gm.call_device())
        return a

    jax.jit(jax.shard_map(record, mesh=mesh, in_specs=P("x"), out_specs=P("x")))(jnp.ones(2))
    assert isinstance(seen[0], jax.sharding.AbstractDevice) and seen[0].platform == "cpu"
    assert gm.call_device() == jax.devices()[0]  # outside a mesh: the default device


def test_bad_implementation(rng):
    x, w, sizes, _ = draw(rng, (3, 5), 8)
    with pytest.raises(ValueError, match="implementation"):
        gm.grouped_matmul(x, w, sizes, implementation="cuda")


def test_mosaic_on_cpu_says_why(rng):
    x, w, sizes, _ = draw(rng, (64, 64), 128, k=128, n=128, dtype=jnp.bfloat16)
    with pytest.raises(RuntimeError, match="Hopper GPU.*cpu"):
        gm.grouped_matmul(x, w, sizes, implementation="mosaic")
    with pytest.raises(ValueError, match="implementation"):
        gm.GroupedMatmul("xla", kernels=REF_KERNELS)


def test_bad_operands(rng):
    x, w, sizes, _ = draw(rng, (3, 5), 8)
    with pytest.raises(ValueError, match="group_sizes"):
        gm.grouped_matmul(x, w, sizes[:1])
    with pytest.raises(ValueError, match="lhs"):
        gm.grouped_matmul(x[:, :3], w, sizes)


# ----------------------------------------------------------------------------------------------
# The tiled path.


def assert_float64_exact(out, dx, dw, x, w, sizes, ct):
    """fp32 out, dx and dW within TOL of the float64 reference; padded rows (past the groups)
    and empty groups' weight gradients exactly zero."""
    total = int(np.sum(sizes))
    for name, a, r in zip(("out", "dx", "dw"), (out, dx, dw), reference64(x, w, sizes, ct)):
        assert a.dtype == jnp.float32 and a.shape == r.shape
        assert max_relative_error(a, r) < TOL, name
    assert not np.any(np.asarray(out)[total:]) and not np.any(np.asarray(dx)[total:])
    for g in np.flatnonzero(np.asarray(sizes) == 0):
        assert not np.any(np.asarray(dw)[g])


@pytest.mark.parametrize("sizes,m,tile", [
    (*GROUPINGS[0], 4), (*GROUPINGS[0], 7), (*GROUPINGS[1], 7), (*GROUPINGS[2], 128),
    (*GROUPINGS[3], 4), ((100, 0, 21, 8, 70, 0, 3), 210, 16)])
def test_tiled_path_against_float64(rng, sizes, m, tile):
    """Tiles that do and do not divide M (the last one moved back), groups that start and end
    inside tiles, empty groups, padded rows that hold NaN in lhs and in the cotangent (they
    must not reach any result), and a tile larger than M."""
    x, w, sizes, ct = draw(rng, sizes, m)
    total = int(np.sum(sizes))
    x_padded, ct_padded = x.at[total:].set(jnp.nan), ct.at[total:].set(jnp.nan)
    fn = jax.jit(gm.tiled_grouped_matmul(tile))
    out, dx, dw = value_and_grads(fn, x_padded, w, sizes, ct_padded)
    assert_float64_exact(out, dx, dw, x, w, sizes, ct)
    assert jax.vjp(fn, x, w, sizes)[1](ct)[2].dtype == jax.dtypes.float0


def test_tiled_path_bf16_dtypes_and_the_tile_choice(rng):
    """bf16 operands: fp32 output, dx and dW in bf16, each rounded once from fp32 products of
    the fp32 cotangent (as the XLA path's); the call takes tiles of about M / G rows."""
    x, w, sizes, ct = draw(rng, (50, 14, 0, 16), 80, dtype=jnp.bfloat16)
    out, dx, dw = value_and_grads(jax.jit(gm.GroupedMatmul("tiled")), x, w, sizes, ct)
    assert (out.dtype, dx.dtype, dw.dtype) == (jnp.float32, jnp.bfloat16, jnp.bfloat16)
    xla = value_and_grads(gm.GroupedMatmul("xla"), x, w, sizes, ct)
    for a, b in zip((out, dx, dw), xla):
        assert max_relative_error(a, b) < 2.0**-8  # one bf16 rounding apart at most
    assert [gm.tile_rows_for(m, g) for m, g in ((80, 4), (8192, 64), (256, 64), (10**6, 8))] == [
        16, 128, 8, 128]


def test_tiled_path_inside_shard_map(rng):
    """Per-device groups under shard_map (operands varying over the mesh axis): values and
    gradients equal the same calls made device by device."""
    mesh = make_mesh(("x", 2))
    x, w, _, ct = draw(rng, (0,) * 6, 64)
    sizes = jnp.asarray([[9, 0, 11], [0, 30, 1]], jnp.int32)
    w = w.reshape(2, 3, *w.shape[1:])
    matmul = gm.GroupedMatmul("tiled")
    sharded = jax.shard_map(lambda x, w, s: matmul(x, w[0], s[0]), mesh=mesh,
                            in_specs=(P("x"), P("x"), P("x")), out_specs=P("x"))
    out, vjp = jax.vjp(lambda x, w: sharded(x, w, sizes), x, w)
    dx, dw = vjp(ct)
    for d in range(2):
        rows = slice(32 * d, 32 * (d + 1))
        e_out, e_dx, e_dw = value_and_grads(matmul, x[rows], w[d], sizes[d], ct[rows])
        np.testing.assert_allclose(out[rows], e_out, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(dx[rows], e_dx, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(dw[d], e_dw, rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# The blocks of the Mosaic kernels.


def test_blocks_of_the_expert_shape():
    configs = gm.mosaic_block_configs(65536, 7168, 2048, jnp.bfloat16, jnp.bfloat16)
    assert configs == gm.PREFERRED
    assert configs.forward == gm.BlockConfig(128, 128, 64, 6, 4)


def test_blocks_never_shrink_and_snakes_stay_whole():
    # K = 128*9 makes 9 dx column tiles: grid_block_n 4 halves to 1; N = 128*6 makes 6 forward
    # and dW column tiles: 2. Block sizes stay the preferred (the only ones run on an H200).
    configs = gm.mosaic_block_configs(256, 128 * 9, 128 * 6, jnp.float16, jnp.float16)
    assert configs.forward == gm.BlockConfig(128, 128, 64, 6, 2)
    assert configs.input_grad == gm.BlockConfig(128, 128, 64, 6, 1)
    assert configs.weight_grad == gm.BlockConfig(128, 128, 64, 6, 2)


@pytest.mark.parametrize("shape,dtypes,match", [
    ((256, 192, 128), ("bfloat16",) * 2, r"dx .*K % block_n == 0.*K=192"),
    ((256, 128, 192), ("bfloat16",) * 2, r"forward kernel needs N % block_n == 0.*N=192"),
    ((256, 128, 100), ("bfloat16",) * 2, r"forward kernel needs N % block_n == 0.*N=100"),
    ((200, 128, 128), ("bfloat16",) * 2, r"forward kernel needs M % block_m == 0.*M=200"),
    ((256, 64, 128), ("bfloat16",) * 2, r"forward kernel needs K // block_k >= 2"),
    ((256, 128, 128), ("float32",) * 2, r"one dtype in .*float32"),
    ((256, 128, 128), ("bfloat16", "float16"), r"one dtype in .*bfloat16 and float16"),
])
def test_blocks_name_the_unmet_constraint(shape, dtypes, match):
    reason = gm.mosaic_block_configs(*shape, *dtypes)
    assert isinstance(reason, str)
    assert re.search(match, reason), reason


# ----------------------------------------------------------------------------------------------
# The custom VJP's rule, built from the reference kernels.


@pytest.mark.parametrize("sizes,m", GROUPINGS)
def test_custom_vjp_rule_against_float64(rng, sizes, m):
    x, w, sizes, ct = draw(rng, sizes, m)
    total = int(np.sum(sizes))
    # A cotangent on the padded rows must not reach dx or dW, even a NaN.
    ct_padded = ct.at[total:].set(jnp.nan)
    fn = jax.jit(gm.build_grouped_matmul(REF_KERNELS))
    out, dx, dw = value_and_grads(fn, x, w, sizes, ct_padded)
    assert_float64_exact(out, dx, dw, x, w, sizes, ct)
    # value_and_grad through the rule, with no gradient for the sizes
    loss = lambda x, w: jnp.sum(fn(x, w, sizes) * ct)  # noqa: E731
    value, grads = jax.value_and_grad(loss, argnums=(0, 1))(x, w)
    np.testing.assert_allclose(grads[0], dx, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(grads[1], dw, rtol=1e-6, atol=1e-6)
    assert jax.vjp(fn, x, w, sizes)[1](ct)[2].dtype == jax.dtypes.float0


def test_custom_vjp_rule_bf16_dtypes(rng):
    x, w, sizes, ct = draw(rng, (50, 14), 80, dtype=jnp.bfloat16)
    out, dx, dw = value_and_grads(gm.build_grouped_matmul(REF_KERNELS), x, w, sizes, ct)
    assert (out.dtype, dx.dtype, dw.dtype) == (jnp.float32, jnp.bfloat16, jnp.bfloat16)
    for a, r in zip((out, dx, dw), reference64(x, w, sizes, ct)):
        assert max_relative_error(a, r) < 2e-2  # dy, dx and dW each rounded to bf16 once


def test_mosaic_path_pads_rows_to_the_alignment(rng):
    """The Mosaic path with stand-in kernels: M = 192 rows reach the kernels as 256 (the row
    alignment), and the result is cut back to 192 rows, zero past the groups."""
    rows_seen = []

    def counted(kernel):
        def call(*operands):
            rows_seen.append(operands[0].shape[0])
            return kernel(*operands)
        return call

    kernels = gm.GroupedMatmulKernels(*(counted(k) for k in (ref_forward, ref_input_grad,
                                                             ref_weight_grad)))
    x, w, sizes, ct = draw(rng, (100, 0, 60), 192, k=128, n=128, dtype=jnp.bfloat16)
    out, dx, dw = value_and_grads(gm.GroupedMatmul("mosaic", kernels=kernels), x, w, sizes, ct)
    assert set(rows_seen) == {256}
    assert out.shape == (192, 128) and dx.shape == (192, 128)
    for a, r in zip((out, dx, dw), reference64(x, w, sizes, ct)):
        assert max_relative_error(a, r) < 2e-2  # dy, dx and dW each rounded to bf16 once
    assert not np.any(np.asarray(out)[160:]) and not np.any(np.asarray(dx)[160:])


@pytest.mark.parametrize("sizes", [(100, 0, 20, 8), (60, 0, 100, 40), (0, 0, 0, 0), (0, 256, 0, 0)])
def test_rows_in_two_parts_equal_one_call(rng, sizes):
    """With head_rows, the forward and dx kernels run on the first 128 rows and on the rest only
    when a group reaches past them; values and gradients equal the one-call rule's, both when
    the rest runs (groups past row 128) and when it is skipped."""
    x, w, sizes, ct = draw(rng, sizes, 256)
    calls = []

    def counted(kernel):
        def call(*operands):
            calls.append(operands[0].shape[0])
            return kernel(*operands)
        return call

    kernels = gm.GroupedMatmulKernels(forward=counted(ref_forward),
                                      input_grad=counted(ref_input_grad),
                                      weight_grad=ref_weight_grad)
    split = value_and_grads(jax.jit(gm.build_grouped_matmul(kernels, 128)), x, w, sizes, ct)
    whole = value_and_grads(jax.jit(gm.build_grouped_matmul(REF_KERNELS)), x, w, sizes, ct)
    for a, b in zip(split, whole):
        np.testing.assert_array_equal(a, b)
    assert sorted(set(calls)) == [128]  # each kernel traced on both halves, never on all rows
