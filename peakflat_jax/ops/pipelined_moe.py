"""PipelinedLLEP: a mixture-of-experts layer whose dispatch buffers are bounded by a per-source
token budget, whatever the routing.

Per rank (a shard_map over the expert-parallel axis or axes, D devices, each owning E_l experts):

1. **Load.** Count token-slots per expert (a token routed to k experts counts k times),
   all-gather the counts over the group (the sum is the plan's input; the per-source rows give
   each slot its place in its expert's global order).
2. **Plan.** ``llep_plan.llep_assignment`` (or plain expert parallelism): ``[E, D]`` slots of
   each expert per device, the same on every rank. Each slot's destination follows from its
   place in the global order (source rank, then slot order) of its expert's slots.
3. **Migrate.** Helpers receive the weights of the foreign experts they host (at most
   ``max_foreign_experts`` each); the gradients of those copies flow back to the owners through
   the transposed collectives and add to theirs.
4. **Chunks.** K = min(ceil(N / token_budget), max_chunks) chunks of c = ceil(N / K) tokens:
   strided (chunk i holds tokens i, i+K, i+2K, ...) or contiguous. A software-pipelined
   ``lax.scan``: step i issues chunk i+1's dispatch before chunk i's expert matmuls, and
   nothing links the two, so on a GPU the all-to-all can run under the matmuls. A custom VJP
   keeps only the inputs; backward re-dispatches and recomputes chunk by chunk in reverse,
   pipelined the same way.
5. **Per chunk.** Dispatch of the chunk's S = c*k slots (an ``expert_exchange.Exchange``),
   grouped SwiGLU matmuls over the local and foreign experts (``grouped_matmul``), the
   exchange back, gate-weighted sum over k.

The expert FFN is SwiGLU, or gpt-oss's clamped form (``activation="clamped_swiglu"``), with
optional biases on its three projections (``expert_biases``): each sorted row adds its group's
bias rows, which travel with the weights (migrated to helpers, their gradients sent home the
same way); rows of no group add none.

Memory bound: ``pipelined_moe_memory_terms`` gives it per device, term by term, as a function of
the static sizes (``MEMORY_FORMULAS`` states each term). Every term is fixed at launch: skew
makes the plan move more weights (up to the foreign bound), never a buffer larger. The paper's
receive-side bound is 2 * M * H * b (M = D * k * c rows reach a device per chunk); the padded
all-to-all adds send buckets of the same size. ``unchunked_moe_memory_terms`` gives the same
terms for one chunk (plain EP or LLEP without a budget): the baseline a planner compares with.

Why the code is shaped so:

- Chunks are strided by default: LLEP orders each expert's slots by source position, so
  contiguous chunks hand a hot expert's whole spill tail to one helper.
- A custom VJP over the chunk scan, not autodiff: autodiff of a scan saves every iteration's
  carried receive buffer, the whole dispatch; recomputing per chunk keeps one chunk live in
  forward, backward and any replay of an enclosing checkpoint.
- Rows move between orders (expert order, send buckets, chunks, migrated weights) by gathers
  both ways (``row_permutation``), because scatters were the bottleneck on GPUs.
- Platform choices (which exchange, which grouped matmul) are made once per call in
  ``_describe_call`` from the mesh's devices, and recorded in the call's static ``_MoEPlan``;
  tests and benchmarks override them with ``backend=MoEBackend(...)``.

Constraints: E a multiple of D; ``expert_ids`` in ``[0, E)`` (a token with an id outside gives
NaN, never a dropped slot); reverse-mode differentiation only.

Measured: docs/pipelined_moe.md (records: scripts/results/moe_dispatch_*, moe_plan_*).

Legend: N tokens on this rank, H hidden, F expert FFN width, k top-k, E experts, D devices of
the expert axis (E_p), E_l = E / D, K chunks, c tokens per chunk, S = c * k slots per chunk per
source, M = D * S rows per chunk on a device, G = E_l + max_foreign_experts expert groups on a
device, b bytes per element of x's dtype.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from peakflat_jax._validate import as_int, as_positive_float
from peakflat_jax.ops import grouped_matmul, llep_plan, row_permutation
from peakflat_jax.ops._shard import vary_alike, varying_like
from peakflat_jax.ops.expert_exchange import Exchange, PaddedExchange
from peakflat_jax.ops.grouped_matmul import IMPLEMENTATIONS as MATMUL_PATHS
from peakflat_jax.ops.grouped_matmul import ROW_ALIGNMENT
from peakflat_jax.ops.llep_plan import LLEPConfig
from peakflat_jax.ops.ragged_exchange import RaggedExchange

MEMBERSHIPS = ("strided", "contiguous")
BALANCES = ("llep", "none")
EXCHANGES = {"padded": PaddedExchange(), "ragged": RaggedExchange()}


@dataclasses.dataclass(frozen=True)
class MoEBackend:
    """How one call moves and multiplies rows: an override for tests and benchmarks. By default
    (``backend=None``) the call takes the padded exchange and the grouped matmul that
    ``grouped_matmul.select_grouped_matmul`` picks for the mesh's devices."""

    exchange: str | Exchange = "padded"
    """``"padded"``, ``"ragged"`` (experimental: ``ragged_exchange``) or an ``Exchange``."""
    grouped_matmul: str | grouped_matmul.GroupedMatmulKernels | None = None
    """None (automatic), ``"xla"``, ``"mosaic"``, or kernels that stand in for the Mosaic ones
    (the Mosaic path's custom-VJP rule, on any platform)."""


def pipelined_moe(x: jax.Array, expert_ids: jax.Array, gates: jax.Array, w_gate: jax.Array,
                  w_up: jax.Array, w_down: jax.Array, *, axis_name: Any, num_experts: int,
                  token_budget: int | None = None, max_chunks: int = 10,
                  membership: str = "strided", balance: str = "llep",
                  llep_threshold: float = LLEPConfig.threshold,
                  llep_capacity: float = LLEPConfig.capacity,
                  llep_min_tokens: int = LLEPConfig.min_tokens,
                  max_foreign_experts: int | None = LLEPConfig.max_foreign_experts,
                  backend: MoEBackend | None = None,
                  expert_biases: tuple[jax.Array, jax.Array, jax.Array] | None = None,
                  activation: str = "swiglu", swiglu_alpha: float = 1.702,
                  swiglu_limit: float = 7.0) -> jax.Array:
    """``y[n] = sum_j gates[n, j] * ffn_{expert_ids[n, j]}(x[n])`` with experts spread over
    ``axis_name`` (expert e on position e // E_l), in chunks of bounded size.

    Call inside ``jax.shard_map``.

    Args:
      x: ``[N, H]`` this rank's tokens.
      expert_ids: ``[N, k]`` int expert of each slot, in ``[0, num_experts)``.
      gates: ``[N, k]`` weight of each slot.
      w_gate, w_up: ``[E_l, H, F]``; w_down: ``[E_l, F, H]``: this rank's experts,
        ``ffn_e(v) = (silu(v @ w_gate[e]) * (v @ w_up[e])) @ w_down[e]``.
      axis_name: the expert-parallel mesh axis, or a tuple of axes (D = the product of their
        sizes; positions in row-major order, as ``P(axes)`` shards the experts).
      num_experts: E, a multiple of D.
      token_budget: tokens per chunk per source (c); None means one chunk.
      max_chunks: at most this many chunks (K_max); it wins over token_budget.
      membership: ``"strided"`` or ``"contiguous"`` chunks.
      balance: ``"llep"`` (least-loaded spill with weight migration) or ``"none"``.
      llep_threshold, llep_capacity, llep_min_tokens: the plan's lambda, alpha and m
        (``llep_plan.LLEPConfig``).
      max_foreign_experts: foreign experts a device may host (static buffers); None: the
        plan's default (``llep_plan.default_max_foreign_experts``).
      backend: for tests and benchmarks: the exchange and grouped matmul to use
        (``MoEBackend``); None picks them from the mesh's devices.
      expert_biases: None, or (b_gate, b_up ``[E_l, F]``, b_down ``[E_l, H]``), this rank's
        experts' biases: ``ffn_e(v) = act(v @ w_gate[e] + b_gate[e], v @ w_up[e] + b_up[e])
        @ w_down[e] + b_down[e]``; differentiable like the weights.
      activation: ``act(g, u)``: ``"swiglu"``, silu(g) * u; ``"clamped_swiglu"`` (gpt-oss),
        g' sigmoid(alpha g') * (u' + 1) with g' = min(g, limit) and u' = u clipped to
        [-limit, limit] (the clamps pass gradient where they do not bind, as torch.clamp).
      swiglu_alpha, swiglu_limit: ``"clamped_swiglu"``'s alpha and limit.

    Returns:
      ``[N, H]`` in x's dtype; rows whose ids leave ``[0, num_experts)`` are NaN.

    Reverse-mode differentiable (a custom VJP over the chunks): ``jax.jvp`` and ``jacfwd``
    raise.
    """
    plan = _describe_call(
        x=x, expert_ids=expert_ids, gates=gates, w_gate=w_gate, w_up=w_up, w_down=w_down,
        axis_name=axis_name, num_experts=num_experts, token_budget=token_budget,
        max_chunks=max_chunks, membership=membership, balance=balance,
        llep=LLEPConfig(threshold=llep_threshold, capacity=llep_capacity,
                        min_tokens=llep_min_tokens, max_foreign_experts=max_foreign_experts),
        backend=backend, expert_biases=expert_biases,
        activation=_checked_activation(activation, swiglu_alpha, swiglu_limit))
    biases = tuple(expert_biases or ())
    x, gates, w_gate, w_up, w_down, expert_ids, *biases = vary_alike(
        x, gates, w_gate, w_up, w_down, expert_ids, *biases)
    return _pipelined_moe(plan, x, expert_ids, gates, (w_gate, w_up, w_down, *biases))


def _pipelined_moe(plan: _MoEPlan, x, expert_ids, gates, weights):
    """Route every slot, migrate the foreign experts' weights, run the chunks, unchunk."""
    slots = _plan_slots(plan, expert_ids)
    weights = _migrate_weights(plan, slots.foreign, weights)
    tokens, place = _chunk_layout(plan)
    tokens, place = jnp.asarray(tokens.reshape(-1), jnp.int32), jnp.asarray(place, jnp.int32)

    def chunked(a, fill):  # [K, c, ...]; token N (out of range) pads the last chunk
        return row_permutation.gather_rows(a, tokens, place, fill).reshape(
            plan.num_chunks, -1, *a.shape[1:])

    chunks = _Chunks(x=chunked(x, 0), gates=chunked(gates, 0),
                     destination=chunked(slots.destination, plan.num_devices),
                     group=chunked(slots.group, plan.num_groups))
    y_chunks = _run_chunks(plan, weights, chunks)
    y = row_permutation.gather_rows(y_chunks.reshape(-1, x.shape[1]), place, tokens)
    return jnp.where(slots.invalid_token[:, None], jnp.nan, y).astype(x.dtype)


# ----------------------------------------------------------------------------------------------
# The call's static plan.


@dataclasses.dataclass(frozen=True)
class _MoEPlan:
    """Everything static about one call: sizes, chunking, the LLEP knobs (with the foreign bound
    resolved), and the backend chosen for its devices."""

    axis_name: Any
    num_devices: int
    num_experts: int
    num_tokens: int
    top_k: int
    num_chunks: int
    membership: str
    balance: str
    llep: LLEPConfig  # max_foreign_experts resolved to an int (0 without LLEP)
    exchange: Exchange
    matmul: grouped_matmul.GroupedMatmul
    activation: ExpertActivation

    @property
    def experts_per_device(self) -> int:
        return self.num_experts // self.num_devices

    @property
    def max_foreign_experts(self) -> int:
        return self.llep.max_foreign_experts

    @property
    def num_groups(self) -> int:
        return self.experts_per_device + self.max_foreign_experts

    @property
    def chunk_tokens(self) -> int:
        return math.ceil(self.num_tokens / self.num_chunks)

    @property
    def expected_rows(self) -> int:
        return _expected_rows(self.llep, self.top_k, self.chunk_tokens)


def _expected_rows(llep: LLEPConfig, top_k: int, chunk_tokens: int) -> int:
    """Rows a device usually receives per chunk: a source's k * c slots (the mean), times the
    most the plan lets a device exceed it by: below the gate's lambda plain EP runs, and above
    it the plan fills devices to alpha times the mean. The buffer holds D times the mean, for
    any routing; the grouped matmul skips its rows past this many when empty. With
    balance="none" nothing bounds a device's load: under skew the rest runs too."""
    return math.ceil(max(llep.threshold, llep.capacity) * top_k * chunk_tokens)


@dataclasses.dataclass(frozen=True)
class ExpertActivation:
    """The expert FFN's gated unit (``pipelined_moe``'s ``activation`` and its two knobs)."""

    kind: str = "swiglu"
    alpha: float = 1.702
    limit: float = 7.0

    def __call__(self, gate: jax.Array, up: jax.Array) -> jax.Array:
        if self.kind == "swiglu":
            return jax.nn.silu(gate) * up
        # torch.clamp's gradient is 1 up to and at the limit: a where, not jnp.minimum (whose
        # gradient halves at a tie).
        gate = jnp.where(gate > self.limit, self.limit, gate)
        up = jnp.where(up > self.limit, self.limit, jnp.where(up < -self.limit, -self.limit, up))
        return gate * jax.nn.sigmoid(self.alpha * gate) * (up + 1)


ACTIVATIONS = ("swiglu", "clamped_swiglu")


def _checked_activation(activation, alpha, limit) -> ExpertActivation:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {activation!r}")
    if activation == "swiglu":
        return ExpertActivation()
    alpha = as_positive_float("swiglu_alpha", alpha)
    return ExpertActivation("clamped_swiglu", alpha, as_positive_float("swiglu_limit", limit))


def _describe_call(*, x, expert_ids, gates, w_gate, w_up, w_down, axis_name, num_experts,
                   token_budget, max_chunks, membership, balance, llep: LLEPConfig,
                   backend: MoEBackend | None, expert_biases=None,
                   activation: ExpertActivation = ExpertActivation()) -> _MoEPlan:
    """Checks the arguments at trace time and fixes the static plan of the call."""
    if x.ndim != 2 or not jnp.issubdtype(x.dtype, jnp.floating) or x.shape[0] < 1:
        raise ValueError(f"x: expected a floating [N, H] array with N >= 1, got "
                         f"{x.dtype}{list(x.shape)}")
    num_tokens, hidden = x.shape
    if expert_ids.ndim != 2 or expert_ids.shape[0] != num_tokens or not jnp.issubdtype(
            expert_ids.dtype, jnp.integer):
        raise ValueError(f"expert_ids: expected an integer [N={num_tokens}, k] array, got "
                         f"{expert_ids.dtype}{list(expert_ids.shape)}")
    if gates.shape != expert_ids.shape or not jnp.issubdtype(gates.dtype, jnp.floating):
        raise ValueError(f"gates: expected a floating array shaped like expert_ids "
                         f"{list(expert_ids.shape)}, got {gates.dtype}{list(gates.shape)}")
    num_devices = lax.axis_size(axis_name)
    num_experts = as_int("num_experts", num_experts)
    if num_experts < 1 or num_experts % num_devices:
        raise ValueError(f"num_experts: expected a positive multiple of the axis size "
                         f"{num_devices}, got {num_experts!r}")
    local = num_experts // num_devices
    if w_gate.ndim != 3 or w_gate.shape[:2] != (local, hidden):
        raise ValueError(f"w_gate: expected [E_l={local}, H={hidden}, F], got "
                         f"{list(w_gate.shape)}")
    if w_up.shape != w_gate.shape:
        raise ValueError(f"w_up: expected {list(w_gate.shape)} like w_gate, got "
                         f"{list(w_up.shape)}")
    ffn = w_gate.shape[2]
    if w_down.shape != (local, ffn, hidden):
        raise ValueError(f"w_down: expected [E_l={local}, F={ffn}, H={hidden}], got "
                         f"{list(w_down.shape)}")
    if expert_biases is not None:
        if len(expert_biases) != 3:
            raise ValueError(f"expert_biases: expected (b_gate, b_up, b_down), got "
                             f"{len(expert_biases)} arrays")
        for name, bias, shape in zip(("b_gate", "b_up", "b_down"), expert_biases,
                                     ((local, ffn), (local, ffn), (local, hidden))):
            if tuple(bias.shape) != shape:
                raise ValueError(f"expert_biases: {name} expected {list(shape)}, got "
                                 f"{list(bias.shape)}")
    num_chunks = _num_chunks(num_tokens, token_budget, max_chunks)
    if membership not in MEMBERSHIPS:
        raise ValueError(f"membership: expected one of {MEMBERSHIPS}, got {membership!r}")
    llep = _checked_llep(llep, balance, num_experts, num_devices)
    return _MoEPlan(axis_name=axis_name, num_devices=num_devices, num_experts=num_experts,
                    num_tokens=num_tokens, top_k=expert_ids.shape[1], num_chunks=num_chunks,
                    membership=membership, balance=balance, llep=llep,
                    exchange=_resolve_exchange(backend),
                    matmul=_resolve_grouped_matmul(backend, x.dtype, w_gate.dtype, hidden, ffn),
                    activation=activation)


def _num_chunks(num_tokens: int, token_budget, max_chunks) -> int:
    """K = min(ceil(N / c), K_max), or 1 without a budget; checks both arguments."""
    if token_budget is not None:
        token_budget = as_int("token_budget", token_budget)
        if token_budget < 1:
            raise ValueError(f"token_budget: expected None or a positive int, got "
                             f"{token_budget!r}")
    max_chunks = as_int("max_chunks", max_chunks)
    if max_chunks < 1:
        raise ValueError(f"max_chunks: expected a positive int, got {max_chunks!r}")
    if token_budget is None:
        return 1
    return min(math.ceil(num_tokens / token_budget), max_chunks)


def _checked_llep(llep: LLEPConfig, balance: str, num_experts: int,
                  num_devices: int) -> LLEPConfig:
    """The LLEP knobs checked (errors name the public keywords), with the foreign bound
    resolved: 0 under plain expert parallelism."""
    if balance not in BALANCES:
        raise ValueError(f"balance: expected one of {BALANCES}, got {balance!r}")
    threshold = as_positive_float("llep_threshold", llep.threshold)
    capacity = as_positive_float("llep_capacity", llep.capacity)
    min_tokens = as_int("llep_min_tokens", llep.min_tokens)
    if min_tokens < 1:
        raise ValueError(f"llep_min_tokens: expected a positive int, got {min_tokens!r}")
    local = num_experts // num_devices
    if llep.max_foreign_experts is not None:
        bound = as_int("max_foreign_experts", llep.max_foreign_experts)
        if not 0 <= bound <= num_experts - local:
            raise ValueError(f"max_foreign_experts: expected an int in [0, E - E_l = "
                             f"{num_experts - local}], got {bound!r}")
    bound = llep.foreign_bound(num_experts, num_devices) if balance == "llep" else 0
    return LLEPConfig(threshold=threshold, capacity=capacity, min_tokens=min_tokens,
                      max_foreign_experts=min(bound, num_experts - local))


def _resolve_exchange(backend: MoEBackend | None) -> Exchange:
    exchange = (backend or MoEBackend()).exchange
    if isinstance(exchange, str):
        if exchange not in EXCHANGES:
            raise ValueError(f"backend: exchange must be one of {sorted(EXCHANGES)} or an "
                             f"Exchange, got {exchange!r}")
        return EXCHANGES[exchange]
    if not all(hasattr(exchange, name) for name in ("routes", "send", "combine")):
        raise ValueError(f"backend: exchange must be one of {sorted(EXCHANGES)} or an "
                         f"Exchange, got {exchange!r}")
    return exchange


def _resolve_grouped_matmul(backend: MoEBackend | None, x_dtype, w_dtype, hidden: int,
                            ffn: int) -> grouped_matmul.GroupedMatmul:
    """The grouped matmul for the devices this call runs on; one choice serves the (H, F) and
    (F, H) products, whose Mosaic constraints are the same."""
    implementation = (backend or MoEBackend()).grouped_matmul
    return grouped_matmul.select_grouped_matmul(grouped_matmul.call_device(), x_dtype, w_dtype,
                                                hidden, ffn, implementation)


# ----------------------------------------------------------------------------------------------
# Routing: where every slot goes, decided once per step from the all-gathered counts.


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _SlotPlan:
    destination: jax.Array    # [N, k] device of each slot; D where the id is invalid
    group: jax.Array          # [N, k] group (local expert, then foreign slot) on that device
    foreign: jax.Array        # [D, max_foreign] foreign experts hosted by each device, -1 pads
    invalid_token: jax.Array  # [N] bool: some id of the token is outside [0, E)


def _plan_slots(plan: _MoEPlan, expert_ids: jax.Array) -> _SlotPlan:
    ids = expert_ids.reshape(-1).astype(jnp.int32)
    valid = (ids >= 0) & (ids < plan.num_experts)
    expert = jnp.where(valid, ids, plan.num_experts)  # invalid slots sort last, count nowhere
    counts = jnp.zeros(plan.num_experts + 1, jnp.int32).at[expert].add(1)[:-1]
    all_counts = lax.all_gather(counts, plan.axis_name)  # [D, E]
    loads = all_counts.sum(0)
    if plan.balance == "llep":
        assignment = llep_plan.llep_assignment(loads, plan.num_devices, plan.llep)
    else:
        assignment = llep_plan.plain_assignment(loads, plan.num_devices)
    me = lax.axis_index(plan.axis_name)
    # Global index of each slot among its expert's slots: earlier sources first, then the
    # slot's rank among this source's slots of the same expert.
    earlier_sources = jnp.sum(jnp.where(jnp.arange(plan.num_devices)[:, None] < me,
                                        all_counts, 0), axis=0)
    rank_in_source = row_permutation.bucket_positions(expert, plan.num_experts)
    safe_expert = jnp.minimum(expert, plan.num_experts - 1)
    global_index = earlier_sources[safe_expert] + rank_in_source
    segment_ends = jnp.cumsum(assignment, axis=1)[safe_expert]  # [S, D]
    destination = jnp.sum(global_index[:, None] >= segment_ends, axis=1).astype(jnp.int32)
    destination = jnp.where(valid, destination, plan.num_devices)

    local = plan.experts_per_device
    foreign = llep_plan.foreign_experts(assignment, plan.max_foreign_experts)
    if plan.max_foreign_experts:
        hosted = foreign[jnp.minimum(destination, plan.num_devices - 1)] == safe_expert[:, None]
        foreign_slot = jnp.argmax(hosted, axis=1).astype(jnp.int32)
    else:
        foreign_slot = jnp.zeros_like(destination)
    at_home = destination == safe_expert // local
    group = jnp.where(at_home, safe_expert % local, local + foreign_slot)
    shape = expert_ids.shape
    return _SlotPlan(destination.reshape(shape), group.reshape(shape), foreign,
                     ~valid.reshape(shape).all(axis=1))


# ----------------------------------------------------------------------------------------------
# Expert-weight migration.


def _migrate_weights(plan: _MoEPlan, foreign: jax.Array, weights):
    """This device's local experts followed by the foreign experts it hosts: [G, ...] each.

    Shift s sends to device me + s the foreign experts it hosts that this device owns (zeros
    elsewhere); D - 1 ppermutes of ``max_foreign_experts`` experts each. Their transposes carry
    the foreign copies' gradients back to the owners.
    """
    if not plan.max_foreign_experts:
        return weights
    me = lax.axis_index(plan.axis_name)
    local = plan.experts_per_device
    received = [jnp.zeros((plan.max_foreign_experts, *w.shape[1:]), w.dtype) for w in weights]
    for shift in range(1, plan.num_devices):
        wanted = foreign[(me + shift) % plan.num_devices]  # [max_foreign] expert ids
        mine = (wanted >= 0) & (wanted // local == me)
        # A device hosts an expert at most once, so the picks are one-to-one: a gather both
        # ways (the slots not picked read an out-of-range row, zeros).
        index = jnp.where(mine, wanted % local, local).astype(jnp.int32)
        inverse = row_permutation.inverse_map(index, local)
        perm = [(d, (d + shift) % plan.num_devices) for d in range(plan.num_devices)]
        for i, w in enumerate(weights):
            outgoing = row_permutation.gather_rows(w, index, inverse)
            received[i] = received[i] + lax.ppermute(outgoing, plan.axis_name, perm)
    return tuple(jnp.concatenate([w, r]) for w, r in zip(weights, received))


# ----------------------------------------------------------------------------------------------
# Chunks.


class _Chunks(NamedTuple):
    """The chunked per-token inputs, [K, c, ...] each (token N pads the last chunk)."""

    x: jax.Array            # [K, c, H]
    gates: jax.Array        # [K, c, k]
    destination: jax.Array  # [K, c, k] device of each slot (D: not sent)
    group: jax.Array        # [K, c, k] expert group of each slot on that device


def _chunk_layout(plan: _MoEPlan) -> tuple[np.ndarray, np.ndarray]:
    """Static token indices of each chunk ``[K, c]`` (N pads) and each token's place in the
    flattened chunks ``[N]``."""
    num_chunks, chunk_tokens, num_tokens = plan.num_chunks, plan.chunk_tokens, plan.num_tokens
    slots = np.arange(num_chunks * chunk_tokens)
    if plan.membership == "strided":
        # chunk i, position p holds token i + p*K
        tokens = (slots % chunk_tokens) * num_chunks + slots // chunk_tokens
    else:
        tokens = slots
    tokens = np.where(tokens < num_tokens, tokens, num_tokens).reshape(num_chunks, chunk_tokens)
    place = np.zeros(num_tokens, np.int32)
    flat = tokens.reshape(-1)
    place[flat[flat < num_tokens]] = np.nonzero(flat < num_tokens)[0]
    return tokens, place


class _Dispatched(NamedTuple):
    """A chunk's rows on the devices that process them."""

    rows: jax.Array   # [M, H] received rows
    group: jax.Array  # [M] their expert groups (G: empty row)
    routes: Any       # the exchange's routes of the chunk


def _dispatch_chunk(plan: _MoEPlan, chunks: _Chunks, i) -> _Dispatched:
    """Chunk i's slots sent: each token's row once per slot (slot (n, j) at row n*k + j), and
    each slot's group."""
    routes = plan.exchange.routes(chunks.destination[i].reshape(-1), plan.num_devices,
                                  plan.axis_name)
    rows = plan.exchange.send(jnp.repeat(chunks.x[i], plan.top_k, axis=0), routes,
                              plan.axis_name)
    group = plan.exchange.send(chunks.group[i].reshape(-1), routes, plan.axis_name,
                               fill=plan.num_groups)
    return _Dispatched(rows, group, routes)


def _combine_rows(plan: _MoEPlan, processed, routes):
    """Rows ``processed [M, ...]`` back at their slots: ``[S, ...]``, 0 for slots not sent.
    The transpose of the dispatch's send, so backward sends cotangents home with it too."""
    return plan.exchange.combine(processed, routes, plan.axis_name)


def _tokens_cotangent(plan: _MoEPlan, d_received, routes, dtype):
    """The transpose of sending each token's row once per slot, applied to ``d_received
    [M, H]``: ``[c, H]``, each token's k slots summed in fp32."""
    d_slots = _combine_rows(plan, d_received, routes)
    d_slots = d_slots.reshape(-1, plan.top_k, d_received.shape[1])
    return jnp.sum(d_slots, axis=1, dtype=jnp.float32).astype(dtype)


def _expert_ffn(plan: _MoEPlan, rows, group, weights):
    """The FFN of each row with its group's expert: rows [M, H], group [M] in [0, G] (G: none).
    ``weights``: (w_gate, w_up, w_down), then the three biases if the call has them."""
    w_gate, w_up, w_down = weights[:3]
    num_rows = rows.shape[0]
    order = jnp.argsort(group, stable=True).astype(jnp.int32)
    sizes = jnp.zeros(plan.num_groups + 1, jnp.int32).at[group].add(1)[:plan.num_groups]
    # Sorted into a buffer whose length the grouped matmul takes without a padded copy; the
    # extra rows (index num_rows: out of range) are zeros past every group.
    extra = -num_rows % plan.matmul.row_alignment
    if extra:
        order = jnp.concatenate([order, jnp.full(extra, num_rows, order.dtype)])
    place = row_permutation.inverse_map(order, num_rows)  # each row's place in sorted order
    sorted_rows = row_permutation.gather_rows(rows, order, place)

    def matmul(lhs, rhs):
        return plan.matmul(lhs, rhs, sizes, expected_rows=plan.expected_rows)

    gate, up = matmul(sorted_rows, w_gate), matmul(sorted_rows, w_up)
    if len(weights) > 3:  # each sorted row's group's bias rows; no group's rows add zeros
        sorted_group = jnp.take(group, order, mode="fill", fill_value=plan.num_groups)

        def bias_rows(bias, like):
            return jnp.take(bias, sorted_group, axis=0, mode="fill",
                            fill_value=0).astype(like.dtype)

        gate, up = gate + bias_rows(weights[3], gate), up + bias_rows(weights[4], up)
    hidden = plan.activation(gate, up)
    out = matmul(hidden.astype(rows.dtype), w_down)
    if len(weights) > 3:
        out = out + bias_rows(weights[5], out)
    return row_permutation.gather_rows(out.astype(rows.dtype), place, order)


def _process_chunk(plan: _MoEPlan, weights, dispatched: _Dispatched, gates_chunk):
    """A dispatched chunk's grouped SwiGLU, combine back home, and gate-weighted sum: [c, H]."""
    rows = dispatched.rows
    processed = _expert_ffn(plan, rows, dispatched.group, weights)
    slot_out = _combine_rows(plan, processed, dispatched.routes)
    slot_out = slot_out.reshape(-1, plan.top_k, rows.shape[1]).astype(jnp.float32)
    combined = jnp.einsum("ck,ckh->ch", gates_chunk.astype(jnp.float32), slot_out)
    return combined.astype(rows.dtype)


def _zeros_after(shape, dtype, after: jax.Array, like: jax.Array) -> jax.Array:
    """Zeros that cannot exist before ``after`` does, varying like ``like``.

    A layer's zero-initialized loop buffers (the chunks' outputs, the fp32 sums of the chunks'
    weight gradients) are constants to XLA: XLA:GPU fused every MoE layer's into one fusion run
    before the first layer, each then held until its own layer's loop, (L_m - 1) * (N * H * b
    + 3 * G * H * F * 4) bytes beyond the bound: 25 GiB at the backward's peak of h200-1's
    overlapped step at 698,002 tokens, in XLA:GPU's buffer assignment. Zeros read out of
    an optimization barrier with ``after`` (the layer's input, or its outputs' cotangent) are
    made only once the layer's data is, and stay the same zeros."""
    zero, _ = lax.optimization_barrier((jnp.zeros((), dtype), after))
    return varying_like(jnp.broadcast_to(zero, shape), like)


def _dispatch_if(plan: _MoEPlan, chunks: _Chunks, i, like: _Dispatched) -> _Dispatched:
    """Chunk i's dispatch where 0 <= i < K, else an empty one shaped like ``like``: a loop's
    last step has no next chunk, and a ``lax.cond`` skips its exchange while every step's body
    stays one (no peeled step: each grouped matmul is one call site of the program)."""
    def empty():
        return jax.tree.map(lambda a: varying_like(jnp.zeros(a.shape, a.dtype), a), like)

    return lax.cond((i >= 0) & (i < plan.num_chunks),
                    lambda: _dispatch_chunk(plan, chunks, jnp.clip(i, 0, plan.num_chunks - 1)),
                    empty)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _run_chunks(plan: _MoEPlan, weights, chunks: _Chunks):
    """``[K, c, H]``: every chunk's output, in a software-pipelined scan.

    Step i issues chunk i+1's dispatch before chunk i's expert matmuls; the two do not depend on
    each other, so the all-to-all can run under the matmuls. Two chunks' receive buffers are then
    live (the one carried in, the one arriving). The custom VJP keeps only the inputs (module
    doc); backward re-dispatches and recomputes chunk by chunk, pipelined the same way in
    reverse.
    """
    def step(carry, i):
        dispatched, outputs = carry
        upcoming = _dispatch_if(plan, chunks, i + 1, dispatched)  # before this chunk's matmuls
        outputs = lax.dynamic_update_index_in_dim(
            outputs, _process_chunk(plan, weights, dispatched, chunks.gates[i]), i, 0)
        return (upcoming, outputs), None

    first = _dispatch_chunk(plan, chunks, 0)
    outputs = _zeros_after(chunks.x.shape, chunks.x.dtype, chunks.x, chunks.x)
    return lax.scan(step, (first, outputs), jnp.arange(plan.num_chunks))[0][1]


def _run_chunks_fwd(plan, weights, chunks):
    return _run_chunks(plan, weights, chunks), (weights, chunks)


def _run_chunks_bwd(plan, residuals, d_outputs):
    weights, chunks = residuals

    def chunk_grads(i, dispatched: _Dispatched, d_output):
        """Chunk i recomputed from its dispatch, and differentiated: (dW, dx, d_gates)."""
        def process(w, rows, gates):
            return _process_chunk(plan, w, dispatched._replace(rows=rows), gates)

        _, vjp = jax.vjp(process, weights, dispatched.rows, chunks.gates[i])
        d_w, d_received, d_gates = vjp(d_output)
        d_x = _tokens_cotangent(plan, d_received, dispatched.routes, chunks.x.dtype)
        return d_w, d_x, d_gates

    def step(carry, i):  # i = K-1, ..., 0
        dispatched, d_weights, d_chunks = carry
        upcoming = _dispatch_if(plan, chunks, i - 1, dispatched)  # before this chunk's recompute
        d_w, d_x, d_gates = chunk_grads(i, dispatched, d_chunks[i])
        # The chunks' weight gradients sum in fp32.
        d_weights = jax.tree.map(lambda acc, g: acc + g.astype(jnp.float32), d_weights, d_w)
        # Chunk i's token cotangent takes the place of its output's, read above and not again.
        d_chunks = lax.dynamic_update_index_in_dim(d_chunks, d_x.astype(d_chunks.dtype), i, 0)
        return (upcoming, d_weights, d_chunks), d_gates

    last = plan.num_chunks - 1
    zeros = jax.tree.map(lambda w: _zeros_after(w.shape, jnp.float32, d_outputs, w), weights)
    (_, d_weights, d_x), d_gates = lax.scan(
        step, (_dispatch_chunk(plan, chunks, last), zeros, d_outputs),
        jnp.arange(plan.num_chunks), reverse=True)
    d_weights = jax.tree.map(lambda g, w: g.astype(w.dtype), d_weights, weights)
    # No cotangent for the integer routing.
    return d_weights, _Chunks(x=d_x, gates=d_gates, destination=None, group=None)


_run_chunks.defvjp(_run_chunks_fwd, _run_chunks_bwd)


# ----------------------------------------------------------------------------------------------
# The memory bound, term by term (per device; the planner composes these).

MEMORY_FORMULAS: dict[str, str] = {
    "dispatch": "8 * M * H * b + M * H * a: backward's rows of width H, per chunk: the "
                "received rows and their sorted copy, the next chunk's send buckets and "
                "arrival, the rows' cotangents on their way home, and the cotangent of the down "
                "projection (fp32, a = 4; in x's dtype on the Mosaic path, a = b); one chunk "
                "(K = 1) has no next chunk: 6 * M * H * b + M * H * a",
    "expert_ffn": "5 * M * F * a + M * F * b: backward's recomputed gate and up projections, "
                  "the cotangent of their product and theirs (fp32, a as dispatch's), the "
                  "product in x's dtype",
    "weights": "2 * 3 * G * H * F * b: local and foreign experts side by side and their "
               "gradients",
    "weight_sum": "3 * G * H * F * 4: backward's fp32 sum of the chunks' weight gradients "
                  "(none on the Mosaic path at K = 1)",
    "tokens": "3 * N * H * b: the chunked copies of x and y and the output's gather",
    "routing": "4 * N * k * (12 + D + G_f): int32 slot metadata (destination, group, chunked "
               "copies, sort orders) and the [S, D] and [S, G_f] lookups of the plan",
    "mosaic_head_rows": "R * H * b on the Mosaic path: the grouped matmul's copy of the first "
                        "R = roundup(max(lambda, alpha) * k * c, 128) sorted rows",
    "xla_dense_expansion": "6 * G * M * (H + F) * 4 on the XLA path: lax.ragged_dot's dense "
                           "lowering, [G, M, K] masked operands and [G, M, N] products, one "
                           "chunk at a time",
    "tiled_loop": "4 * G * H * F * (1 + 3 [b < 4]) + H * F * (3 * 4 + b) on the tiled path "
                  "(as XLA's CPU plans of the layer hold it beyond the Mosaic path's): one fp32 "
                  "weight gradient's worth more, and where the weights are narrower than fp32 "
                  "the three weight gradients' fp32 loop carries beside their casts; one "
                  "iteration's weight slice, the gradient's part and the slice it adds to",
}


def chunk_rows(*, num_tokens: int, top_k: int, num_devices: int, token_budget: int | None,
               max_chunks: int) -> int:
    """M, the rows one chunk's exchange delivers to a device (the padded buffers' height):
    D * k * ceil(N / K)."""
    num_chunks = _num_chunks(num_tokens, token_budget, max_chunks)
    return num_devices * top_k * math.ceil(num_tokens / num_chunks)


def pipelined_moe_memory_terms(*, num_tokens: int, hidden: int, ffn: int, top_k: int,
                               num_experts: int, num_devices: int,
                               token_budget: int | None = None, max_chunks: int = 10,
                               balance: str = "llep",
                               max_foreign_experts: int | None = None,
                               llep_threshold: float = LLEPConfig.threshold,
                               llep_capacity: float = LLEPConfig.capacity,
                               dtype: Any = "bfloat16",
                               grouped_matmul: str = "mosaic") -> dict[str, int]:
    """Per-device bytes of each term of the layer's bound (``MEMORY_FORMULAS``), for one
    forward + backward with the padded exchange, beyond its inputs, outputs and their
    gradients. Arguments as ``pipelined_moe``'s (num_tokens = N per rank, dtype = x's);
    ``grouped_matmul``: ``"mosaic"``, ``"xla"`` or ``"tiled"``, the path the devices take
    (``grouped_matmul.planned_path``). A term that does not apply is 0."""
    num_chunks = _num_chunks(num_tokens, token_budget, max_chunks)
    llep = _checked_llep(LLEPConfig(threshold=llep_threshold, capacity=llep_capacity,
                                    max_foreign_experts=max_foreign_experts),
                         balance, num_experts, num_devices)
    if grouped_matmul not in MATMUL_PATHS:
        raise ValueError(f"grouped_matmul: expected one of {MATMUL_PATHS}, got "
                         f"{grouped_matmul!r}")
    b = jnp.dtype(dtype).itemsize
    chunk_tokens = math.ceil(num_tokens / num_chunks)
    rows = chunk_rows(num_tokens=num_tokens, top_k=top_k, num_devices=num_devices,
                      token_budget=token_budget, max_chunks=max_chunks)
    foreign = llep.max_foreign_experts
    groups = num_experts // num_devices + foreign  # G
    # a: the bytes of the backward's fp32 row values. On the Mosaic path (a GPU) they stay
    # inside the kernels and XLA:GPU's fusions: its buffer assignment of h200-1's step holds no
    # fp32 [M, H] or [M, F] buffer, and at K = 1 no fp32 weight gradient (the chunks' fp32 sum
    # is a scan carry only when there are chunks to sum).
    a = b if grouped_matmul == "mosaic" else 4
    weight_sum = 3 * groups * hidden * ffn * 4 if num_chunks > 1 or a == 4 else 0
    terms = {
        "dispatch": (8 if num_chunks > 1 else 6) * rows * hidden * b + rows * hidden * a,
        "expert_ffn": 5 * rows * ffn * a + rows * ffn * b,
        "weights": 2 * 3 * groups * hidden * ffn * b,
        "weight_sum": weight_sum,
        "tokens": 3 * num_tokens * hidden * b,
        "routing": 4 * num_tokens * top_k * (12 + num_devices + foreign),
        "mosaic_head_rows": 0,
        "xla_dense_expansion": 0,
        "tiled_loop": 0,
    }
    if grouped_matmul == "mosaic":
        aligned = -(-rows // ROW_ALIGNMENT) * ROW_ALIGNMENT
        head = -(-_expected_rows(llep, top_k, chunk_tokens) // ROW_ALIGNMENT) * ROW_ALIGNMENT
        terms["mosaic_head_rows"] = head * hidden * b if head < aligned else 0
    elif grouped_matmul == "xla":
        terms["xla_dense_expansion"] = 6 * groups * rows * (hidden + ffn) * 4
    else:
        terms["tiled_loop"] = (4 * groups * hidden * ffn * (1 + (3 if b < 4 else 0))
                               + hidden * ffn * (3 * 4 + b))
    return terms


def unchunked_moe_memory_terms(*, num_tokens: int, hidden: int, ffn: int, top_k: int,
                               num_experts: int, num_devices: int, balance: str = "none",
                               **options) -> dict[str, int]:
    """The same terms for the layer without a token budget (one chunk: c = N): plain expert
    parallelism (``balance="none"``) or unchunked LLEP, whose receive buffers must hold the
    worst routing, D * k * N rows. The baseline a planner compares the budgeted layer with."""
    return pipelined_moe_memory_terms(
        num_tokens=num_tokens, hidden=hidden, ffn=ffn, top_k=top_k, num_experts=num_experts,
        num_devices=num_devices, token_budget=None, balance=balance, **options)
