"""PipelinedLLEP: a mixture-of-experts layer whose dispatch buffers are bounded by a per-source
token budget, whatever the routing.

Per rank (a shard_map over the expert-parallel axis of D devices, each owning E_l experts):

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
   strided (chunk i holds tokens i, i+K, i+2K, ...: a hot expert's tail is spread over all
   chunks) or contiguous. A software-pipelined ``lax.scan``: step i issues chunk i+1's dispatch
   before chunk i's expert matmuls, and nothing links the two, so on a GPU the all-to-all can
   run under the matmuls. A custom VJP keeps only the inputs (autodiff of the scan would save
   every carried receive buffer); backward re-dispatches and recomputes chunk by chunk in
   reverse, pipelined the same way. Forward, backward and any replay of an enclosing checkpoint
   hold two chunks' receive buffers and one chunk's intermediates at a time.
5. **Per chunk.** All-to-all dispatch of the chunk's S = c*k slots (padded, or ragged on GPU:
   ``expert_exchange``), grouped SwiGLU matmuls over the local and foreign experts, all-to-all
   back, gate-weighted sum over k.

Memory bound (per device, besides inputs, outputs and their gradients; b = bytes of x's dtype,
G = E_l + max_foreign_experts groups, M = D * k * c rows that reach a device per chunk):

    dispatch:   5 * M * H * b          the carried receive buffer, and one chunk's send and
                                       receive buckets, there and back (backward: 7 * M * H * b,
                                       with the received rows' cotangent and its way home)
    expert FFN: 3 * M * F * 4          gate and up projections (fp32), their product
    weights:    2 * 3 * G * H * F * b  local + foreign experts side by side, and their gradients
                + 3 * G * H * F * 4    backward's fp32 sum of the chunks' weight gradients
    tokens:     3 * N * H * b          chunked copies of x and y, the output gather
    routing:    O(N * k) int32 metadata
    Mosaic:     R * H * b              the grouped matmul's copy of the first R =
                                       max(lambda, alpha) * k * c sorted rows (its forward
                                       and dx kernels skip the rest when empty)

Every term is fixed at launch: skew makes the plan move more weights, never a buffer larger. The
paper's receive-side bound is 2 * M * H * b; the padded all-to-all (the only one XLA:CPU has)
adds send buckets of the same size. The ragged form (``expert_exchange.exchange_kind``, for
GPUs) sends only the rows that exist: a chunk's exchanges then hold 2 * (M + k * c) rows
instead of 4 * M. The portable grouped matmul
(``lax.ragged_dot``) adds XLA's dense expansion, about 5 * G * M * max(H, F) * 4 per chunk,
which a grouped-matmul kernel does not have. No token-slot is dropped: an expert id outside
[0, E) makes its token's output NaN.

Rows move between orders (expert order, send buckets, chunks, migrated weights) by gathers
both ways (``row_permutation``): as scatters they were 140 ms of a 718 ms step on 2 H200s
(``scripts/results/trace_summary_70e20c6_*.json``).

Measured on 2 H200s (scripts/results/moe_dispatch_gpu_20261130-112517.json, commit 95a208b; E =
128, k = 8, H = 7168, F = 2048, bf16, c = 6554, G = 128, Mosaic grouped matmul): at N = 32,768
the bound gives 60.6 GB, XLA planned 49.0 GB of temporaries besides 6.1 GB each of arguments
and outputs, and the allocator peaked at 57.0 GiB (one chunk: 68.1 GiB). The weight terms (45
GB at G = 128) dominate there; what grows with N is bounded: at N = 65,536 the peak was 59.3
GiB (at commit 5fc6457, before the grouped matmul's split, ``-111648.json``: 59.7 GiB against
98.9 GiB for one chunk).

Legend: N tokens on this rank, H hidden, F expert FFN width, k top-k, E experts, D devices,
E_l = E / D, K chunks, c tokens per chunk, S = c * k slots per chunk per source.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from peakflat_jax._validate import as_int, as_positive_float
from peakflat_jax.ops import expert_exchange, grouped_matmul, llep_plan, row_permutation
from peakflat_jax.ops._shard import vary_alike

MEMBERSHIPS = ("strided", "contiguous")
BALANCES = ("llep", "none")


@dataclasses.dataclass(frozen=True)
class _Layer:
    """Static description of one call."""

    axis_name: Any
    num_devices: int
    num_experts: int
    num_tokens: int
    top_k: int
    num_chunks: int
    membership: str
    balance: str
    llep_threshold: float
    llep_capacity: float
    llep_min_tokens: int
    max_foreign_experts: int
    exchange: str  # expert_exchange.KINDS

    @property
    def experts_per_device(self) -> int:
        return self.num_experts // self.num_devices

    @property
    def num_groups(self) -> int:
        return self.experts_per_device + self.max_foreign_experts

    @property
    def chunk_tokens(self) -> int:
        return math.ceil(self.num_tokens / self.num_chunks)

    @property
    def expected_rows(self) -> int:
        """Rows a device usually receives per chunk: a source's k * c slots (the mean), times
        the most the plan lets a device exceed it by: below the gate's lambda plain EP runs, and
        above it the plan fills devices to alpha times the mean. The buffer holds D times the
        mean, for any routing; the grouped matmul skips its rows past this many when empty.
        With balance="none" nothing bounds a device's load: under skew the rest runs too."""
        return math.ceil(max(self.llep_threshold, self.llep_capacity) * self.top_k
                         * self.chunk_tokens)


def pipelined_moe(x: jax.Array, expert_ids: jax.Array, gates: jax.Array, w_gate: jax.Array,
                  w_up: jax.Array, w_down: jax.Array, *, axis_name: Any, num_experts: int,
                  token_budget: int | None = None, max_chunks: int = 10,
                  membership: str = "strided", balance: str = "llep",
                  llep_threshold: float = 1.3, llep_capacity: float = 1.0,
                  llep_min_tokens: int = 1024,
                  max_foreign_experts: int | None = None) -> jax.Array:
    """``y[n] = sum_j gates[n, j] * ffn_{expert_ids[n, j]}(x[n])`` with experts spread over
    ``axis_name`` (expert e on position e // E_l), in chunks of bounded size.

    Call inside ``jax.shard_map``.

    Args:
      x: ``[N, H]`` this rank's tokens.
      expert_ids: ``[N, k]`` int expert of each slot, in ``[0, num_experts)``.
      gates: ``[N, k]`` weight of each slot.
      w_gate, w_up: ``[E_l, H, F]``; w_down: ``[E_l, F, H]``: this rank's experts,
        ``ffn_e(v) = (silu(v @ w_gate[e]) * (v @ w_up[e])) @ w_down[e]``.
      axis_name: the expert-parallel mesh axis (D devices).
      num_experts: E, a multiple of D.
      token_budget: tokens per chunk per source (c); None means one chunk.
      max_chunks: at most this many chunks (K_max); it wins over token_budget.
      membership: ``"strided"`` or ``"contiguous"`` chunks.
      balance: ``"llep"`` (least-loaded spill with weight migration) or ``"none"``.
      llep_threshold, llep_capacity, llep_min_tokens: the plan's lambda, alpha and m.
      max_foreign_experts: foreign experts a device may host (static buffers); default E_l.

    Returns:
      ``[N, H]`` in x's dtype; rows whose ids leave ``[0, num_experts)`` are NaN.

    Reverse-mode differentiable (a custom VJP over the chunks): ``jax.jvp`` and ``jacfwd``
    raise.
    """
    layer = _describe_call(x, expert_ids, gates, w_gate, w_up, w_down, axis_name, num_experts,
                           token_budget, max_chunks, membership, balance, llep_threshold,
                           llep_capacity, llep_min_tokens, max_foreign_experts)
    x, gates, w_gate, w_up, w_down, expert_ids = vary_alike(x, gates, w_gate, w_up, w_down,
                                                            expert_ids)
    return _pipelined_moe(layer, x, expert_ids, gates, w_gate, w_up, w_down)


def _describe_call(x, expert_ids, gates, w_gate, w_up, w_down, axis_name, num_experts,
                   token_budget, max_chunks, membership, balance, llep_threshold, llep_capacity,
                   llep_min_tokens, max_foreign_experts) -> _Layer:
    """Checks the arguments at trace time and fixes the static plan of the layer."""
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
    if w_down.shape != (local, w_gate.shape[2], hidden):
        raise ValueError(f"w_down: expected [E_l={local}, F={w_gate.shape[2]}, H={hidden}], got "
                         f"{list(w_down.shape)}")
    token_budget = None if token_budget is None else as_int("token_budget", token_budget)
    if token_budget is not None and token_budget < 1:
        raise ValueError(f"token_budget: expected None or a positive int, got {token_budget!r}")
    max_chunks = as_int("max_chunks", max_chunks)
    if max_chunks < 1:
        raise ValueError(f"max_chunks: expected a positive int, got {max_chunks!r}")
    if membership not in MEMBERSHIPS:
        raise ValueError(f"membership: expected one of {MEMBERSHIPS}, got {membership!r}")
    if balance not in BALANCES:
        raise ValueError(f"balance: expected one of {BALANCES}, got {balance!r}")
    llep_threshold = as_positive_float("llep_threshold", llep_threshold)
    llep_capacity = as_positive_float("llep_capacity", llep_capacity)
    llep_min_tokens = as_int("llep_min_tokens", llep_min_tokens)
    if llep_min_tokens < 1:
        raise ValueError(f"llep_min_tokens: expected a positive int, got {llep_min_tokens!r}")
    if max_foreign_experts is None:
        max_foreign_experts = local if balance == "llep" and num_devices > 1 else 0
    max_foreign_experts = as_int("max_foreign_experts", max_foreign_experts)
    if not 0 <= max_foreign_experts <= num_experts - local:
        raise ValueError(f"max_foreign_experts: expected an int in [0, E - E_l = "
                         f"{num_experts - local}], got {max_foreign_experts!r}")
    if balance == "none":
        max_foreign_experts = 0
    num_chunks = 1 if token_budget is None else min(math.ceil(num_tokens / token_budget),
                                                    max_chunks)
    return _Layer(axis_name, num_devices, num_experts, num_tokens, expert_ids.shape[1],
                  num_chunks, membership, balance, llep_threshold, llep_capacity,
                  llep_min_tokens, max_foreign_experts, expert_exchange.exchange_kind())


# ----------------------------------------------------------------------------------------------
# Routing: where every slot goes, decided once per step from the all-gathered counts.


@dataclasses.dataclass(frozen=True)
class _Routes:
    destination: jax.Array  # [N, k] device of each slot; D where the id is invalid
    group: jax.Array        # [N, k] group (local expert, then foreign slot) on that device
    foreign: jax.Array      # [D, max_foreign] foreign experts hosted by each device, -1 pads
    invalid_token: jax.Array  # [N] bool: some id of the token is outside [0, E)


def _route_slots(layer: _Layer, expert_ids: jax.Array) -> _Routes:
    ids = expert_ids.reshape(-1).astype(jnp.int32)
    valid = (ids >= 0) & (ids < layer.num_experts)
    expert = jnp.where(valid, ids, layer.num_experts)  # invalid slots sort last, count nowhere
    counts = jnp.zeros(layer.num_experts + 1, jnp.int32).at[expert].add(1)[:-1]
    all_counts = lax.all_gather(counts, layer.axis_name)  # [D, E]
    loads = all_counts.sum(0)
    if layer.balance == "llep":
        assignment = llep_plan.llep_assignment(
            loads, layer.num_devices, threshold=layer.llep_threshold,
            capacity=layer.llep_capacity, min_tokens=layer.llep_min_tokens,
            max_foreign=layer.max_foreign_experts)
    else:
        assignment = llep_plan.plain_assignment(loads, layer.num_devices)
    me = lax.axis_index(layer.axis_name)
    # Global index of each slot among its expert's slots: earlier sources first, then the
    # slot's rank among this source's slots of the same expert.
    earlier_sources = jnp.sum(jnp.where(jnp.arange(layer.num_devices)[:, None] < me,
                                        all_counts, 0), axis=0)
    rank_in_source = expert_exchange.bucket_positions(expert, layer.num_experts)
    safe_expert = jnp.minimum(expert, layer.num_experts - 1)
    global_index = earlier_sources[safe_expert] + rank_in_source
    segment_ends = jnp.cumsum(assignment, axis=1)[safe_expert]  # [S, D]
    destination = jnp.sum(global_index[:, None] >= segment_ends, axis=1).astype(jnp.int32)
    destination = jnp.where(valid, destination, layer.num_devices)

    local = layer.experts_per_device
    foreign = llep_plan.foreign_experts(assignment, layer.max_foreign_experts)
    if layer.max_foreign_experts:
        hosted = foreign[jnp.minimum(destination, layer.num_devices - 1)] == safe_expert[:, None]
        foreign_slot = jnp.argmax(hosted, axis=1).astype(jnp.int32)
    else:
        foreign_slot = jnp.zeros_like(destination)
    at_home = destination == safe_expert // local
    group = jnp.where(at_home, safe_expert % local, local + foreign_slot)
    shape = expert_ids.shape
    return _Routes(destination.reshape(shape), group.reshape(shape), foreign,
                   ~valid.reshape(shape).all(axis=1))


# ----------------------------------------------------------------------------------------------
# Expert-weight migration.


def _migrate_weights(layer: _Layer, foreign: jax.Array, weights):
    """This device's local experts followed by the foreign experts it hosts: [G, ...] each.

    Shift s sends to device me + s the foreign experts it hosts that this device owns (zeros
    elsewhere); D - 1 ppermutes of ``max_foreign_experts`` experts each. Their transposes carry
    the foreign copies' gradients back to the owners.
    """
    if not layer.max_foreign_experts:
        return weights
    me = lax.axis_index(layer.axis_name)
    local = layer.experts_per_device
    received = [jnp.zeros((layer.max_foreign_experts, *w.shape[1:]), w.dtype) for w in weights]
    for shift in range(1, layer.num_devices):
        wanted = foreign[(me + shift) % layer.num_devices]  # [max_foreign] expert ids
        mine = (wanted >= 0) & (wanted // local == me)
        # A device hosts an expert at most once, so the picks are one-to-one: a gather both
        # ways (the slots not picked read an out-of-range row, zeros).
        index = jnp.where(mine, wanted % local, local).astype(jnp.int32)
        inverse = row_permutation.inverse_map(index, local)
        perm = [(d, (d + shift) % layer.num_devices) for d in range(layer.num_devices)]
        for i, w in enumerate(weights):
            outgoing = row_permutation.gather_rows(w, index, inverse)
            received[i] = received[i] + lax.ppermute(outgoing, layer.axis_name, perm)
    return tuple(jnp.concatenate([w, r]) for w, r in zip(weights, received))


# ----------------------------------------------------------------------------------------------
# Chunks.


def _chunk_layout(layer: _Layer) -> tuple[np.ndarray, np.ndarray]:
    """Static token indices of each chunk ``[K, c]`` (N pads) and each token's place in the
    flattened chunks ``[N]``."""
    num_chunks, chunk_tokens, num_tokens = layer.num_chunks, layer.chunk_tokens, layer.num_tokens
    slots = np.arange(num_chunks * chunk_tokens)
    if layer.membership == "strided":
        # chunk i, position p holds token i + p*K
        tokens = (slots % chunk_tokens) * num_chunks + slots // chunk_tokens
    else:
        tokens = slots
    tokens = np.where(tokens < num_tokens, tokens, num_tokens).reshape(num_chunks, chunk_tokens)
    place = np.zeros(num_tokens, np.int32)
    flat = tokens.reshape(-1)
    place[flat[flat < num_tokens]] = np.nonzero(flat < num_tokens)[0]
    return tokens, place


def _expert_ffn(rows, group, weights, num_groups: int, expected_rows: int):
    """SwiGLU of each row with its group's expert: rows [M, H], group [M] in [0, G] (G: none);
    ``expected_rows``: how many usually have a group (``_Layer.expected_rows``)."""
    w_gate, w_up, w_down = weights
    num_rows = rows.shape[0]
    order = jnp.argsort(group, stable=True).astype(jnp.int32)
    sizes = jnp.zeros(num_groups + 1, jnp.int32).at[group].add(1)[:num_groups]
    # Sorted into a buffer whose length the grouped matmul takes without a padded copy; the
    # extra rows (index num_rows: out of range) are zeros past every group.
    alignment = grouped_matmul.row_alignment()
    extra = -num_rows % alignment
    if extra:
        order = jnp.concatenate([order, jnp.full(extra, num_rows, order.dtype)])
    place = row_permutation.inverse_map(order, num_rows)  # each row's place in sorted order
    sorted_rows = row_permutation.gather_rows(rows, order, place)
    matmul = functools.partial(grouped_matmul.grouped_matmul, group_sizes=sizes,
                               expected_rows=expected_rows)
    hidden = jax.nn.silu(matmul(sorted_rows, w_gate)) * matmul(sorted_rows, w_up)
    out = matmul(hidden.astype(rows.dtype), w_down)
    return row_permutation.gather_rows(out.astype(rows.dtype), place, order)


def _chunk_routes(layer: _Layer, destination):
    """Where a chunk's slots go (``destination [c, k]``), computed once per chunk for every
    exchange of it: the padded buckets' maps, or the ragged form's offsets and sizes."""
    destination = destination.reshape(-1)
    if layer.exchange == "ragged":
        return expert_exchange.ragged_routes(destination, layer.num_devices, layer.axis_name)
    return expert_exchange.padded_routes(destination, layer.num_devices)


def _send(layer: _Layer, rows, routes, fill=0):
    """The slots' ``rows [S, ...]`` on the devices that process them: ``[D * S, ...]``. Linear in
    ``rows``; its transpose is ``_return``."""
    devices, axis = layer.num_devices, layer.axis_name
    if layer.exchange == "ragged":
        return expert_exchange.dispatch(rows, routes, devices, axis, fill=fill)
    sent = expert_exchange.pack(rows, routes, fill=fill)
    return expert_exchange.exchange(sent, axis).reshape(-1, *rows.shape[1:])


def _return(layer: _Layer, processed, routes):
    """Rows ``processed [D * S, ...]`` back at their slots: ``[S, ...]``, 0 for slots not sent.
    The transpose of ``_send`` (the rows it filled get nothing), so backward sends cotangents
    home with it instead of transposing ``_send``."""
    if layer.exchange == "ragged":
        return expert_exchange.combine(processed, routes, routes.num_slots, layer.axis_name)
    returned = expert_exchange.exchange(
        processed.reshape(layer.num_devices, routes.num_slots, *processed.shape[1:]),
        layer.axis_name)
    return expert_exchange.unpack(returned, routes)


def _send_tokens(layer: _Layer, x_chunk, routes):
    """Each token's row, once per slot (slot (n, j) at row n*k + j), sent: [D * S, H]."""
    return _send(layer, jnp.repeat(x_chunk, layer.top_k, axis=0), routes)


def _tokens_cotangent(layer: _Layer, d_received, routes, dtype):
    """The transpose of ``_send_tokens``, applied to ``d_received [D * S, H]``: ``[c, H]``, each
    token's k slots summed in fp32."""
    d_slots = _return(layer, d_received, routes)
    d_slots = d_slots.reshape(-1, layer.top_k, d_received.shape[1])
    return jnp.sum(d_slots, axis=1, dtype=jnp.float32).astype(dtype)


def _dispatch(layer: _Layer, chunks, i):
    """Chunk i's dispatch: (received rows [D * S, H], their groups [D * S], routes).
    ``chunks``: the chunked (x, gates, destination, group)."""
    x_chunks, _, destination_chunks, group_chunks = chunks
    routes = _chunk_routes(layer, destination_chunks[i])
    rows = _send_tokens(layer, x_chunks[i], routes)
    groups = _send(layer, group_chunks[i].reshape(-1), routes, fill=layer.num_groups)
    return rows, groups, routes


def _process(layer: _Layer, weights, received, received_group, routes, gates_chunk):
    """A dispatched chunk's grouped SwiGLU, combine back home, and gate-weighted sum: [c, H]."""
    processed = _expert_ffn(received, received_group, weights, layer.num_groups,
                            layer.expected_rows)
    slot_out = _return(layer, processed, routes)
    slot_out = slot_out.reshape(-1, layer.top_k, received.shape[1]).astype(jnp.float32)
    combined = jnp.einsum("ck,ckh->ch", gates_chunk.astype(jnp.float32), slot_out)
    return combined.astype(received.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _run_chunks(layer: _Layer, weights, x_chunks, gate_chunks, destination_chunks,
                group_chunks):
    """``[K, c, H]``: every chunk's output, in a software-pipelined scan.

    Step i issues chunk i+1's dispatch before chunk i's expert matmuls; the two do not depend on
    each other, so the all-to-all can run under the matmuls. Two chunks' receive buffers are then
    live (the one carried in, the one arriving). The custom VJP keeps only the inputs: autodiff
    of a scan would save every carried receive buffer, the whole dispatch; backward instead
    re-dispatches and recomputes chunk by chunk, pipelined the same way in reverse.
    """
    chunks = (x_chunks, gate_chunks, destination_chunks, group_chunks)

    def process(i, sent):
        received, received_group, routes = sent
        return _process(layer, weights, received, received_group, routes, gate_chunks[i])

    def step(sent, i):
        upcoming = _dispatch(layer, chunks, i + 1)  # issued before this chunk's matmuls
        return upcoming, process(i, sent)

    last = layer.num_chunks - 1
    sent, outputs = lax.scan(step, _dispatch(layer, chunks, 0), jnp.arange(last))
    return jnp.concatenate([outputs, process(last, sent)[None]])


def _run_chunks_fwd(layer, weights, x_chunks, gate_chunks, destination_chunks, group_chunks):
    residuals = (weights, x_chunks, gate_chunks, destination_chunks, group_chunks)
    return _run_chunks(layer, *residuals), residuals


def _run_chunks_bwd(layer, residuals, d_outputs):
    weights, *chunks = residuals
    x_chunks, gate_chunks, _, _ = chunks

    def chunk_grads(i, sent):
        """Chunk i recomputed from its dispatch, and differentiated: (dW, dx, d_gates)."""
        received, received_group, routes = sent

        def process(w, rows, gates):
            return _process(layer, w, rows, received_group, routes, gates)

        _, vjp = jax.vjp(process, weights, received, gate_chunks[i])
        d_w, d_received, d_gates = vjp(d_outputs[i])
        d_x = _tokens_cotangent(layer, d_received, routes, x_chunks.dtype)
        return d_w, d_x, d_gates

    def accumulate(total, d_w):  # the chunks' weight gradients sum in fp32
        return jax.tree.map(lambda acc, g: acc + g.astype(jnp.float32), total, d_w)

    def step(carry, i):  # i = K-2, ..., 1
        sent, d_weights = carry
        upcoming = _dispatch(layer, chunks, i - 1)  # issued before this chunk's recompute
        d_w, d_x, d_gates = chunk_grads(i, sent)
        return (upcoming, accumulate(d_weights, d_w)), (d_x, d_gates)

    last = layer.num_chunks - 1
    sent = _dispatch(layer, chunks, last)
    if last == 0:
        d_weights, d_x, d_gates = chunk_grads(0, sent)
        return d_weights, d_x[None], d_gates[None], None, None
    # The last chunk starts the sum (no zero-filled accumulator to write and add: one pass over
    # the G experts' fp32 gradients fewer).
    upcoming = _dispatch(layer, chunks, last - 1)
    d_w, d_x_last, d_gates_last = chunk_grads(last, sent)
    d_weights = jax.tree.map(lambda g: g.astype(jnp.float32), d_w)
    (sent, d_weights), (d_x, d_gates) = lax.scan(
        step, (upcoming, d_weights), jnp.arange(1, last), reverse=True)
    d_w, d_x0, d_gates0 = chunk_grads(0, sent)
    d_weights = jax.tree.map(lambda g, w: g.astype(w.dtype), accumulate(d_weights, d_w),
                             weights)
    return (d_weights, jnp.concatenate([d_x0[None], d_x, d_x_last[None]]),
            jnp.concatenate([d_gates0[None], d_gates, d_gates_last[None]]), None, None)


_run_chunks.defvjp(_run_chunks_fwd, _run_chunks_bwd)


def _pipelined_moe(layer: _Layer, x, expert_ids, gates, w_gate, w_up, w_down):
    routes = _route_slots(layer, expert_ids)
    weights = _migrate_weights(layer, routes.foreign, (w_gate, w_up, w_down))
    tokens, place = _chunk_layout(layer)
    tokens, place = jnp.asarray(tokens.reshape(-1), jnp.int32), jnp.asarray(place, jnp.int32)
    num_chunks = layer.num_chunks

    def chunked(a, fill):  # [K, c, ...]; token N (out of range) pads the last chunk
        return row_permutation.gather_rows(a, tokens, place, fill).reshape(
            num_chunks, -1, *a.shape[1:])

    y_chunks = _run_chunks(layer, weights, chunked(x, 0), chunked(gates, 0),
                           chunked(routes.destination, layer.num_devices),
                           chunked(routes.group, layer.num_groups))
    y = row_permutation.gather_rows(y_chunks.reshape(-1, x.shape[1]), place, tokens)
    return jnp.where(routes.invalid_token[:, None], jnp.nan, y).astype(x.dtype)
