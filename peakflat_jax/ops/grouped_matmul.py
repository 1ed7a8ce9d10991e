"""Grouped matmul for the expert FFN: rows sorted by group, one weight matrix per group.

``grouped_matmul(lhs [M, K], rhs [G, K, Nout], group_sizes [G]) -> [M, Nout]`` fp32: rows
``sum(group_sizes[:g]) ...`` use ``rhs[g]``; rows past ``sum(group_sizes)`` give zeros (padding)
and get zero gradient. ``sum(group_sizes) <= M`` is the caller's promise (it is traced, so not
checked). ``group_sizes`` gets no gradient.

Three implementations; ``select_grouped_matmul`` is the one place that chooses among them, from
the device a call runs on (inside ``shard_map``: the mesh's), the dtypes and K, N, unless the
caller names one. It returns a ``GroupedMatmul``, a frozen (hashable) callable that also says
how many rows its caller should allocate (``row_alignment``), so that a layer can record the
choice in its static description.

``"xla"``: ``jax.lax.ragged_dot`` with fp32 accumulation and output. Exact and differentiable by
JAX's own rules, but XLA lowers it densely: on CPU with [G, M, K] temporaries, on a GPU as a
masked dense matmul with an [M, M]-sized temporary, an order of magnitude slower than the
Mosaic kernels below (docs/pipelined_moe.md, "The grouped matmul"). It is the CPU path (the
tests' shapes are small, and the planner's CPU terms are checked against it).

``"tiled"``: the rows cut into tiles (``tile_rows_for``: about M / G rows, at most
``TILE_ROWS``), and one plain ``lax.dot_general`` per (tile, group) pair that holds rows of the
group, in a ``lax.fori_loop`` whose trip count is the number of such pairs (at most
M / tile + G - 1; none past ``sum(group_sizes)``). Each row's output is selected from its own
group's product, so it is that product and nothing else: the XLA path's matmul without the
G-fold work and the [G, M, K] buffers of its dense lowering. dx is the same loop with rhs
transposed; dW[g] sums ``lhs_tile^T @ dy_tile`` over the group's tiles, the rows outside the
group selected to zero in both. A custom VJP keeps dy in fp32, as autodiff of
``lax.ragged_dot`` does. It is the path on a GPU where the Mosaic kernels cannot run: fp32,
which they do not take (the cross-check's fp32 run took the dense lowering there before:
docs/xcheck.md), a GPU other than Hopper, or shapes outside their blocks. Its work is one tile's
dot per pair: the rows, plus up to G - 1 tiles of spare rows at the groups' edges; each pair
also reads its group's matrix, so with few rows per group the loop is bound by those reads.

``"mosaic"``: a ``jax.custom_vjp`` of three Pallas Mosaic GPU kernels that jax ships
(``jax.experimental.pallas.ops.gpu``):

- forward: ``ragged_dot_mgpu.ragged_dot(lhs, rhs, group_sizes=...)``;
- dx = dy @ rhs[g]^T: the same kernel with ``transpose_rhs=True`` on (dy, rhs), which reads
  rhs [G, K, N] as [G, n=K, k=N] and contracts over N;
- dW[g] = lhs_g^T @ dy_g: ``transposed_ragged_dot_mgpu.transposed_ragged_dot(lhs, dy, ...)``,
  which takes lhs [M, K] and dy [M, N] grouped along M and returns [G, K, N].

Tests and the memory planner replace the three kernels (``GroupedMatmul("mosaic",
kernels=...)``): the custom-VJP rule then runs anywhere.

Numbers on the Mosaic path. The kernels accumulate in an fp32 wgmma accumulator but write their
result in the input dtype, so each product is rounded once to bf16 (or f16) and then cast to
the fp32 of this function's contract: the output differs from the XLA path by that rounding
(relative ~2**-9 for bf16). The backward kernels need both operands in one dtype, so the fp32
cotangent dy is rounded to the input dtype before them (the XLA path multiplies fp32 dy with
the bf16 operand); dx and dW come back in the inputs' dtypes, rounded once, as on the XLA path.

Padded rows on the Mosaic path. The forward kernel (and so dx) never writes rows past
``sum(group_sizes)``: they hold whatever the buffer held, so they are selected to zero here (a
select that XLA can fuse into the fp32 cast). dy's padded rows are zeroed before both backward
kernels, so a cotangent there has no effect. The weight-gradient kernel masks a group's partial
first and last ``block_k``-row blocks by *multiplying* lhs by 0, so lhs rows up to ``block_k``
past ``sum(group_sizes)`` must be finite (an inf or NaN there would make dW NaN); the padding
the MoE dispatch makes is finite, and zeroing it here would cost a pass over lhs.

Rows past the groups on the Mosaic path. The forward kernel (and so dx) tiles its whole
operand: its grid has cdiv(M, block_m) + G - 1 row tiles, and each costs a full tile of matmul
work whether or not a group fills it (by the kernel's source in jax 0.11.2). A receive buffer
sized for the worst routing holds D times the rows a device usually gets, so these kernels' time
would follow the buffer, not the routing (the weight-gradient kernel walks the groups' rows
instead). With ``expected_rows`` the forward and dx kernels run in two parts
(``_rows_in_two_parts``): on the first ``expected_rows`` rows (rounded up to 128) always, and on
the rest only when the groups reach there. The head part is a copy of those rows of lhs (XLA
gives a custom call a slice as a new buffer): R * K * b bytes, R the rounded expected rows.

Mosaic constraints (``hopper_gpu_reason`` and ``mosaic_block_configs`` name the first one
unmet; a requested ``"mosaic"`` raises with it):

- a Hopper GPU (compute capability 9.x: H100, H200): the kernels use wgmma and TMA;
- ``lhs.dtype == rhs.dtype`` in {bfloat16, float16};
- each kernel's blocks divide its dimensions: the forward needs M % block_m, N % block_n and
  K % block_k; dx needs M % block_m, K % block_n and N % block_k; dW needs K % block_m,
  N % block_n and M % block_k (dW's blocks then never read past row M). The preferred blocks
  (``PREFERRED``: 128 x 128 x 64, 6 pipeline stages, ``grid_block_n`` = 4) were the fastest
  measured on an H200 for all three kernels at the MoE's shapes. M is padded with zero rows to
  a multiple of ``ROW_ALIGNMENT`` = 128 (a copy of lhs, unless the caller allocated aligned
  rows: ``GroupedMatmul.row_alignment``), so the M constraints always hold. K and N must be
  multiples of 128: they are never padded, and no smaller block is offered because the one
  tried on an H200 (64, 64, 32) failed to lower in Mosaic; only measured blocks are used. The
  constraints on K and N are symmetric, so the MoE's (H, F) and (F, H) products pass or fail
  together;
- at least two pipeline steps along the contraction of the forward and dx kernels
  (K // block_k, N // block_k >= 2), since their pipelines hold back one stage;
- the kernels are single-device custom calls: call under ``jax.shard_map`` (as the MoE layer
  does), not on arrays GSPMD would have to partition.

The automatic choice takes the Mosaic path wherever the constraints hold; elsewhere on a GPU the
tiled path (with a warning on a Hopper GPU where only the shapes rule the kernels out, since
they would be faster there); on a CPU the XLA path.

Measured: docs/pipelined_moe.md (records: scripts/results/grouped_matmul_probe_*).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from peakflat_jax.ops._mosaic_hash import share_identical_kernels
from peakflat_jax.ops._shard import varying_like

IMPLEMENTATIONS = ("xla", "mosaic", "tiled")
# The Mosaic path pads M to a multiple of this (the largest block over M in any kernel), so that
# no constraint on M remains.
ROW_ALIGNMENT = 128
# Rows per dot on the tiled path, at most: fewer, larger dots keep a GPU's cores busy (128 rows
# is a matmul kernel's tile), while the groups' partial tiles cost up to G - 1 spare tiles of
# work, so a call with few rows per group takes smaller tiles (``tile_rows_for``).
TILE_ROWS = 128
MIN_TILE_ROWS = 8
MOSAIC_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@dataclasses.dataclass(frozen=True)
class BlockConfig:
    """Keyword arguments of one Mosaic kernel. block_m and block_n tile the kernel's output,
    block_k its contraction; max_concurrent_steps is the pipeline depth and grid_block_n the
    width of the tile order's snake (L2 reuse)."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    max_concurrent_steps: int = 6
    grid_block_n: int = 4

    def kwargs(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class MosaicConfigs:
    """Blocks of the three kernels of one call."""

    forward: BlockConfig
    input_grad: BlockConfig
    weight_grad: BlockConfig


PREFERRED = MosaicConfigs(forward=BlockConfig(), input_grad=BlockConfig(),
                          weight_grad=BlockConfig())


@dataclasses.dataclass(frozen=True)
class GroupedMatmulKernels:
    """The three kernels a custom-VJP grouped matmul is built from (``build_grouped_matmul``).
    group_sizes is int32 [G]; rows past sum(group_sizes) of a kernel's [M, .] result may hold
    anything (the Mosaic kernels leave them unwritten).

    forward(lhs [M, K], rhs [G, K, N], group_sizes) -> [M, N]
    input_grad(dy [M, N], rhs [G, K, N], group_sizes) -> [M, K], rows: dy_r @ rhs[g]^T
    weight_grad(lhs [M, K], dy [M, N], group_sizes) -> [G, K, N], lhs_g^T @ dy_g; it is called
    with dy's padded rows zeroed.
    """

    forward: Callable
    input_grad: Callable
    weight_grad: Callable


@dataclasses.dataclass(frozen=True)
class GroupedMatmul:
    """One chosen implementation, called like ``grouped_matmul`` (module doc).

    ``implementation``: ``"xla"``, ``"mosaic"`` or ``"tiled"``. ``kernels``: on the Mosaic
    path, kernels to use instead of the Mosaic ones (tests, the memory planner); the caller
    vouches that they run. Hashable, so that it can be part of a static description.
    """

    implementation: str
    kernels: GroupedMatmulKernels | None = None

    def __post_init__(self):
        if self.implementation not in IMPLEMENTATIONS:
            raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got "
                             f"{self.implementation!r}")
        if self.kernels is not None and self.implementation != "mosaic":
            raise ValueError("kernels: only the 'mosaic' implementation takes kernels")

    @property
    def row_alignment(self) -> int:
        """The multiple of rows that lhs should have to be taken without a padded copy."""
        return ROW_ALIGNMENT if self.implementation == "mosaic" else 1

    def __call__(self, lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *,
                 expected_rows: int | None = None) -> jax.Array:
        """``[M, Nout]`` fp32 (module doc). ``expected_rows``: how many rows the groups usually
        fill, where M is a worst case (a receive buffer); the Mosaic forward and dx kernels then
        skip the rest when it is empty (module doc, "Rows past the groups"). Same result."""
        _check_operands(lhs, rhs, group_sizes)
        group_sizes = group_sizes.astype(jnp.int32)
        if self.implementation == "xla":
            return lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=jnp.float32)
        if self.implementation == "tiled":
            tile = tile_rows_for(lhs.shape[0], rhs.shape[0])
            return tiled_grouped_matmul(tile)(lhs, rhs, group_sizes)
        rows = lhs.shape[0]
        aligned = -(-rows // ROW_ALIGNMENT) * ROW_ALIGNMENT
        kernels = self.kernels
        if kernels is None:
            configs = mosaic_block_configs(aligned, lhs.shape[1], rhs.shape[2], lhs.dtype,
                                           rhs.dtype)
            if isinstance(configs, str):
                raise ValueError(f"grouped_matmul(implementation='mosaic') cannot run: {configs}")
            kernels = mosaic_kernels(configs)
        head_rows = None
        if expected_rows is not None:
            head_rows = max(1, -(-int(expected_rows) // ROW_ALIGNMENT)) * ROW_ALIGNMENT
            head_rows = head_rows if head_rows < aligned else None
        mosaic = build_grouped_matmul(kernels, head_rows)
        if aligned == rows:
            return mosaic(lhs, rhs, group_sizes)
        # Zero rows past M lie past sum(group_sizes): padding, as the contract already has.
        # A copy of lhs: callers that allocate aligned rows (row_alignment) avoid it.
        return mosaic(jnp.pad(lhs, ((0, aligned - rows), (0, 0))), rhs, group_sizes)[:rows]


def select_grouped_matmul(device: Any, lhs_dtype, rhs_dtype, k: int, n: int,
                          implementation: str | GroupedMatmulKernels | None = None
                          ) -> GroupedMatmul:
    """The grouped matmul for lhs [M, k] and rhs [G, k, n] on ``device`` (a ``jax.Device`` or
    the ``AbstractDevice`` of a mesh: anything with ``platform`` and ``device_kind``).

    ``implementation``: None (Mosaic where it can run; else on a GPU the tiled path, with a
    warning on a Hopper GPU where only the shapes rule Mosaic out; else XLA), ``"xla"``,
    ``"tiled"``, ``"mosaic"`` (raises where it cannot run: RuntimeError for the platform,
    ValueError for the shapes or dtypes), or ``GroupedMatmulKernels`` (the Mosaic path's rule
    with these kernels, wherever it runs).
    """
    if isinstance(implementation, GroupedMatmulKernels):
        return GroupedMatmul("mosaic", kernels=implementation)
    if implementation is not None and implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, kernels or None, "
                         f"got {implementation!r}")
    if implementation in ("xla", "tiled"):
        return GroupedMatmul(implementation)
    platform_reason = hopper_gpu_reason(device)
    configs = mosaic_block_configs(ROW_ALIGNMENT, k, n, lhs_dtype, rhs_dtype)
    if platform_reason is None and isinstance(configs, MosaicConfigs):
        return GroupedMatmul("mosaic")
    reason = platform_reason or configs
    if implementation == "mosaic":
        error = RuntimeError if platform_reason else ValueError
        raise error(f"grouped_matmul(implementation='mosaic') cannot run: {reason}")
    if device.platform != "gpu":
        return GroupedMatmul("xla")
    if platform_reason is None and _mosaic_dtypes(lhs_dtype, rhs_dtype):
        warnings.warn(f"grouped_matmul: taking the tiled XLA path on a Hopper GPU, slower than "
                      f"the Mosaic kernels, because they cannot run: {reason}", stacklevel=3)
    return GroupedMatmul("tiled")


def planned_path(platform: str, lhs_dtype, rhs_dtype, k: int, n: int) -> str:
    """The implementation ``select_grouped_matmul`` takes on ``platform`` ("gpu" taken to be a
    Hopper GPU, as the configs' machines are), for the memory planner, which has no device."""
    if platform != "gpu":
        return "xla"
    configs = mosaic_block_configs(ROW_ALIGNMENT, k, n, lhs_dtype, rhs_dtype)
    return "mosaic" if isinstance(configs, MosaicConfigs) else "tiled"


def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *,
                   implementation: str | None = None,
                   expected_rows: int | None = None) -> jax.Array:
    """``[M, Nout]`` fp32 products of row groups with their matrices (module doc), with the
    implementation ``select_grouped_matmul`` picks for the device this call runs on
    (``call_device``) or the one named."""
    _check_operands(lhs, rhs, group_sizes)
    matmul = select_grouped_matmul(call_device(), lhs.dtype, rhs.dtype, lhs.shape[1],
                                   rhs.shape[2], implementation)
    return matmul(lhs, rhs, group_sizes, expected_rows=expected_rows)


def call_device() -> Any:
    """The device a traced call runs on: inside ``shard_map``, the mesh's (an
    ``AbstractDevice``: platform and device kind); elsewhere the default device."""
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    return device if device is not None else jax.devices()[0]


def _check_operands(lhs, rhs, group_sizes) -> None:
    if lhs.ndim != 2 or rhs.ndim != 3 or lhs.shape[1] != rhs.shape[1]:
        raise ValueError(f"grouped_matmul needs lhs [M, K] and rhs [G, K, Nout], got "
                         f"{lhs.shape} and {rhs.shape}")
    if group_sizes.shape != (rhs.shape[0],) or not jnp.issubdtype(group_sizes.dtype,
                                                                   jnp.integer):
        raise ValueError(f"group_sizes must be integers of shape ({rhs.shape[0]},), got "
                         f"{group_sizes.dtype}{list(group_sizes.shape)}")


# ----------------------------------------------------------------------------------------------
# When the Mosaic path can run.


def hopper_gpu_reason(device: Any) -> str | None:
    """None if ``device`` (a ``jax.Device`` or a mesh's ``AbstractDevice``) is a Hopper GPU
    (compute capability 9.x), else why the Mosaic kernels cannot run there."""
    platform, kind = device.platform, device.device_kind
    if platform != "gpu":
        return (f"the Mosaic kernels need a Hopper GPU (H100/H200), and the call runs on "
                f"{platform} ({kind})")
    capability = getattr(device, "compute_capability", None)
    if capability is not None:
        hopper = str(capability).split(".")[0] == "9"
    else:  # a mesh's AbstractDevice knows the kind only
        hopper = any(name in kind for name in ("H100", "H200", "H800", "H20"))
    if not hopper:
        return (f"the Mosaic kernels need a Hopper GPU (compute capability 9.x: H100/H200), and "
                f"the call runs on {kind} (compute capability {capability})")
    return None


def mosaic_block_configs(m: int, k: int, n: int, lhs_dtype,
                         rhs_dtype) -> MosaicConfigs | str:
    """The blocks of the three kernels for lhs [m, k] and rhs [G, k, n]: the preferred ones
    where they divide (no smaller blocks are offered: module doc), else a string naming the
    constraint unmet."""
    lhs_dtype, rhs_dtype = jnp.dtype(lhs_dtype), jnp.dtype(rhs_dtype)
    if not _mosaic_dtypes(lhs_dtype, rhs_dtype):
        return (f"the Mosaic kernels need lhs and rhs of one dtype in "
                f"{[str(d) for d in MOSAIC_DTYPES]}, got {lhs_dtype} and {rhs_dtype}")
    # Each kernel as (rows, cols, contraction) of its own output and sum, with our names.
    forward = _fit("forward", PREFERRED.forward, ("M", m), ("N", n), ("K", k), min_steps=2)
    input_grad = _fit("dx (forward kernel, transpose_rhs=True)", PREFERRED.input_grad,
                      ("M", m), ("K", k), ("N", n), min_steps=2)
    weight_grad = _fit("dW (transposed_ragged_dot)", PREFERRED.weight_grad, ("K", k), ("N", n),
                       ("M", m), min_steps=1)
    for fitted in (forward, input_grad, weight_grad):
        if isinstance(fitted, str):
            return fitted
    return MosaicConfigs(forward=forward, input_grad=input_grad, weight_grad=weight_grad)


def _mosaic_dtypes(lhs_dtype, rhs_dtype) -> bool:
    lhs_dtype, rhs_dtype = jnp.dtype(lhs_dtype), jnp.dtype(rhs_dtype)
    return lhs_dtype == rhs_dtype and lhs_dtype in MOSAIC_DTYPES


def _fit(kernel: str, preferred: BlockConfig, rows: tuple[str, int], cols: tuple[str, int],
         contraction: tuple[str, int], *, min_steps: int) -> BlockConfig | str:
    for field, (name, size) in (("block_m", rows), ("block_n", cols),
                                ("block_k", contraction)):
        block = getattr(preferred, field)
        if size % block:
            return (f"the {kernel} kernel needs {name} % {field} == 0 ({field}={block}), and "
                    f"{name}={size}")
    name, size = contraction
    if size // preferred.block_k < min_steps:
        return (f"the {kernel} kernel needs {name} // block_k >= {min_steps} pipeline steps, and "
                f"{name}={size}, block_k={preferred.block_k}")
    # The tile order snakes over grid_block_n column tiles: halve it until it divides their
    # count, so that every snake is whole (as when it was tuned; 1, 4 and 8 ran on an H200).
    column_tiles = cols[1] // preferred.block_n
    grid_block_n = preferred.grid_block_n
    while column_tiles % grid_block_n:
        grid_block_n //= 2
    return dataclasses.replace(preferred, grid_block_n=grid_block_n)


# ----------------------------------------------------------------------------------------------
# The custom VJP, built from any three kernels (the Mosaic ones on a GPU; reference ones in the
# CPU tests of the backward rule).


@functools.lru_cache(maxsize=None)
def mosaic_kernels(configs: MosaicConfigs) -> GroupedMatmulKernels:
    """The three Mosaic GPU kernels with the given blocks (imported here: GPU-only code). Their
    identical call sites compile once (``_mosaic_hash``)."""
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu

    share_identical_kernels()

    def forward(lhs, rhs, group_sizes):
        return ragged_dot_mgpu.ragged_dot(lhs, rhs, group_sizes=group_sizes,
                                          **configs.forward.kwargs())

    def input_grad(dy, rhs, group_sizes):
        # rhs [G, K, N] read as [G, n=K, k=N]: dy [M, N] contracts with rhs[g] over N.
        return ragged_dot_mgpu.ragged_dot(dy, rhs, group_sizes=group_sizes, transpose_rhs=True,
                                          **configs.input_grad.kwargs())

    def weight_grad(lhs, dy, group_sizes):
        return transposed_ragged_dot_mgpu.transposed_ragged_dot(
            lhs, dy, group_sizes=group_sizes, **configs.weight_grad.kwargs())

    return GroupedMatmulKernels(forward=forward, input_grad=input_grad, weight_grad=weight_grad)


@functools.lru_cache(maxsize=None)
def build_grouped_matmul(kernels: GroupedMatmulKernels,
                         head_rows: int | None = None) -> Callable:
    """``f(lhs, rhs, group_sizes int32) -> [M, N] fp32`` with a custom VJP from ``kernels``:
    the output and dx masked to zero past sum(group_sizes), dy zeroed there before the backward
    kernels, dx and dW in the dtypes of lhs and rhs, no gradient for group_sizes. With
    ``head_rows`` (a multiple of 128 below M), the forward and dx kernels run on rows
    ``[head_rows, M)`` only when the groups reach there (``_rows_in_two_parts``)."""
    forward_kernel = _rows_in_two_parts(kernels.forward, head_rows)
    input_grad_kernel = _rows_in_two_parts(kernels.input_grad, head_rows)

    def valid_rows(m, group_sizes):
        return (jnp.arange(m, dtype=jnp.int32) < jnp.sum(group_sizes))[:, None]

    def forward(lhs, rhs, group_sizes):
        out = varying_like(forward_kernel(lhs, rhs, group_sizes), lhs, rhs, group_sizes)
        # A select, not a multiply: the unwritten rows may hold NaN.
        return jnp.where(valid_rows(lhs.shape[0], group_sizes), out.astype(jnp.float32), 0.0)

    @jax.custom_vjp
    def grouped(lhs, rhs, group_sizes):
        return forward(lhs, rhs, group_sizes)

    def grouped_fwd(lhs, rhs, group_sizes):
        return forward(lhs, rhs, group_sizes), (lhs, rhs, group_sizes)

    def grouped_bwd(residuals, d_out):
        lhs, rhs, group_sizes = residuals
        valid = valid_rows(lhs.shape[0], group_sizes)
        # The kernels take one dtype: dy is rounded to the inputs' dtype, with its padded rows
        # zeroed so that the weight-gradient kernel's partial last block adds nothing.
        dy = jnp.where(valid, d_out, 0.0).astype(lhs.dtype)
        dx = varying_like(input_grad_kernel(dy, rhs, group_sizes), lhs)
        dx = jnp.where(valid, dx, 0.0).astype(lhs.dtype)
        dw = varying_like(kernels.weight_grad(lhs, dy, group_sizes), rhs).astype(rhs.dtype)
        return dx, dw, None

    grouped.defvjp(grouped_fwd, grouped_bwd)
    return grouped


def _rows_in_two_parts(kernel: Callable, head_rows: int | None) -> Callable:
    """``kernel(a [M, .], b, group_sizes) -> [M, n]``, run as two calls: on rows
    ``[0, head_rows)`` always, and on ``[head_rows, M)`` only when some group reaches past
    ``head_rows`` (a ``lax.cond``; otherwise those rows are zeros, which the contract allows:
    they lie past the groups). Each call gets the group sizes clipped to its rows, so the two
    results end to end equal one call's."""
    if head_rows is None:
        return kernel

    def call(a, b, group_sizes):
        if head_rows >= a.shape[0]:
            return kernel(a, b, group_sizes)
        ends = jnp.cumsum(group_sizes)
        head_sizes = jnp.minimum(ends, head_rows) - jnp.minimum(ends - group_sizes, head_rows)
        tail_sizes = group_sizes - head_sizes
        # Typed like the operands (a Pallas call's result is typed invariant): the cond's
        # branches and the two parts must agree.
        head = varying_like(kernel(a[:head_rows], b, head_sizes), a, b, group_sizes)
        tail_shape = (a.shape[0] - head_rows, head.shape[1])
        tail = lax.cond(jnp.sum(tail_sizes) > 0,
                        lambda: varying_like(kernel(a[head_rows:], b, tail_sizes), head),
                        lambda: varying_like(jnp.zeros(tail_shape, head.dtype), head))
        return jnp.concatenate([head, tail])

    return call


# ----------------------------------------------------------------------------------------------
# The tiled path: plain dots over (row tile, group) pairs, for a GPU where the Mosaic kernels
# cannot run (fp32 above all).


def tile_rows_for(rows: int, groups: int) -> int:
    """The tiled path's rows per dot for M = ``rows`` and G = ``groups``: the largest power of
    two up to M / G, within [MIN_TILE_ROWS, TILE_ROWS], so that the spare rows of the groups'
    partial tiles, at most (G - 1) * tile, stay within about M."""
    tile = MIN_TILE_ROWS
    while tile * 2 <= min(TILE_ROWS, rows // max(groups, 1)):
        tile *= 2
    return tile


@functools.lru_cache(maxsize=None)
def tiled_grouped_matmul(tile_rows: int = TILE_ROWS) -> Callable:
    """``f(lhs [M, K], rhs [G, K, N], group_sizes int32) -> [M, N] fp32`` as a loop of dots
    (module doc, ``"tiled"``), with its own VJP: dx = dy_g @ rhs[g]^T and dW[g] = lhs_g^T @ dy_g
    by the same loop, dy kept in fp32 (as the XLA path's autodiff keeps it), dx and dW in the
    dtypes of lhs and rhs, no gradient for group_sizes."""

    @jax.custom_vjp
    def grouped(lhs, rhs, group_sizes):
        return _tiled_products(lhs, rhs, group_sizes, tile_rows, transpose_rhs=False)

    def grouped_fwd(lhs, rhs, group_sizes):
        return grouped(lhs, rhs, group_sizes), (lhs, rhs, group_sizes)

    def grouped_bwd(residuals, d_out):
        lhs, rhs, group_sizes = residuals
        d_out = d_out.astype(jnp.float32)
        dx = _tiled_products(d_out, rhs, group_sizes, tile_rows, transpose_rhs=True)
        dw = _tiled_weight_grad(lhs, d_out, group_sizes, rhs.shape[0], tile_rows)
        return (varying_like(dx.astype(lhs.dtype), lhs), varying_like(dw.astype(rhs.dtype), rhs),
                None)

    grouped.defvjp(grouped_fwd, grouped_bwd)
    return grouped


class _TileItems:
    """The (row tile, group) pairs that hold a group's rows, in row order: item i belongs to
    group ``group(i)`` and covers rows ``[lo(i), hi(i))`` of the tile that starts at row
    ``start(i)`` (tiles of ``tile`` rows, the last one moved back to end at row M, so that a
    slice never runs past the operand; ``lo`` and ``hi`` stay those of the unmoved tile, so
    that no row is taken twice). ``count`` items in all (traced), at most M / tile + G - 1."""

    def __init__(self, group_sizes: jax.Array, rows: int, tile: int):
        self.rows, self.tile = rows, tile
        self.ends = jnp.cumsum(group_sizes)
        self.starts = self.ends - group_sizes
        self.first_tile = self.starts // tile
        tiles = jnp.where(group_sizes > 0, (self.ends - 1) // tile - self.first_tile + 1, 0)
        self.item_ends = jnp.cumsum(tiles)
        self.item_starts = self.item_ends - tiles
        self.count = self.item_ends[-1]

    def item(self, i):
        """(group, start, mask [tile] of the rows of the slice at start that the item owns)."""
        group = jnp.sum(self.item_ends <= i).astype(jnp.int32)
        nominal = (self.first_tile[group] + i - self.item_starts[group]) * self.tile
        start = jnp.minimum(nominal, self.rows - self.tile)
        lo = jnp.maximum(self.starts[group], nominal)
        hi = jnp.minimum(self.ends[group], nominal + self.tile)
        row = start + jnp.arange(self.tile, dtype=jnp.int32)
        return group, start, (row >= lo) & (row < hi)


def _tiled_products(a, rhs, group_sizes, tile_rows: int, *, transpose_rhs: bool):
    """``[M, n]`` fp32: row r of ``a`` times its group's ``rhs[g]`` (``rhs[g]^T`` with
    ``transpose_rhs``), zero past the groups. Each row is written once, by a select, so it holds
    exactly its own product, whatever the other rows of its tile hold."""
    rows = a.shape[0]
    tile = min(tile_rows, rows)
    items = _TileItems(group_sizes.astype(jnp.int32), rows, tile)
    contract = 1 if transpose_rhs else 0  # rhs[g]'s dimension that meets a's columns
    width = rhs.shape[1] if transpose_rhs else rhs.shape[2]

    def body(i, out):
        group, start, mask = items.item(i)
        block = lax.dynamic_slice_in_dim(a, start, tile)
        matrix = lax.dynamic_index_in_dim(rhs, group, keepdims=False)
        if block.dtype != matrix.dtype:  # fp32 dy and a bf16 weight: upcast, exact
            block, matrix = block.astype(jnp.float32), matrix.astype(jnp.float32)
        product = lax.dot_general(block, matrix, (((1,), (contract,)), ((), ())),
                                  preferred_element_type=jnp.float32)
        current = lax.dynamic_slice_in_dim(out, start, tile)
        return lax.dynamic_update_slice_in_dim(out, jnp.where(mask[:, None], product, current),
                                               start, 0)

    out = varying_like(jnp.zeros((rows, width), jnp.float32), a, rhs, group_sizes)
    return lax.fori_loop(0, items.count, body, out)


def _tiled_weight_grad(lhs, dy, group_sizes, num_groups: int, tile_rows: int):
    """``[G, K, N]`` fp32: ``lhs_g^T @ dy_g`` per group, each tile's rows outside its group
    selected to zero in both operands first (so that padding, even NaN, adds nothing)."""
    rows = lhs.shape[0]
    tile = min(tile_rows, rows)
    items = _TileItems(group_sizes.astype(jnp.int32), rows, tile)

    def body(i, dw):
        group, start, mask = items.item(i)
        block = jnp.where(mask[:, None], lax.dynamic_slice_in_dim(lhs, start, tile), 0)
        d_block = jnp.where(mask[:, None], lax.dynamic_slice_in_dim(dy, start, tile), 0.0)
        part = lax.dot_general(block.astype(jnp.float32), d_block, (((0,), (0,)), ((), ())),
                               preferred_element_type=jnp.float32)
        current = lax.dynamic_index_in_dim(dw, group, keepdims=False)
        return lax.dynamic_update_index_in_dim(dw, current + part, group, 0)

    dw = varying_like(jnp.zeros((num_groups, lhs.shape[1], dy.shape[1]), jnp.float32), lhs, dy,
                      group_sizes)
    return lax.fori_loop(0, items.count, body, dw)
