"""The least-loaded expert-parallel (LLEP) plan: which device processes how many of each expert's
token-slots.

A pure function of the all-reduced per-expert loads, computed inside the compiled program (no
host round trip) and identical on every rank. The plan is an ``[E, D]`` int32 matrix
``assignment[e, d]``: the number of expert e's token-slots that device d processes. Row e sums
to the load of e; ``assignment[e, e // E_l]`` is what the owner keeps; any other non-zero entry
makes d a helper that receives e's weights.

Algorithm (SPEC.md, Operator 1, step 2; the paper's Alg. 2, as the public LLEP code runs it):

1. Gate: with native loads ``D_d = sum of d's experts' loads`` and mean ``T / D``, plain expert
   parallelism (every expert stays home) unless ``max_d D_d / mean >= threshold``.
2. Capacity ``m_a = ceil(capacity * T / D)``. Experts in descending load (ties by id); an
   expert's load leaves its owner's *pending* load (its experts not yet planned) when its turn
   comes. The owner keeps ``m_a - (assigned + pending)`` of it, at least 0: it holds room back
   for its own experts still to come, so an overloaded owner spills its overload from the
   experts it plans first (its largest) and keeps the later ones, instead of keeping its
   largest and spilling every later one whole, however small.
3. The excess goes, piece by piece, to the helper with the lowest ``assigned + pending`` (ties
   by id): a piece is ``min(excess, room)`` of its room ``m_a - (assigned + pending)``, if that
   room is at least ``min_tokens`` or holds the whole excess. Otherwise no helper can take a
   piece (the least loaded has the most room), and the whole excess goes to that least loaded
   helper: one piece past its capacity rather than many small ones (the room it holds back for
   its own experts is then negative, so they spill in their turn).
4. A device hosts at most ``max_foreign_experts`` foreign experts (static buffers); helpers at
   that bound are passed over, and when none is left the excess stays with the owner.

Why these rules and ``default_max_foreign_experts``: docs/pipelined_moe.md, "The LLEP plan"
(the rules were compared there with the ones they replaced, on the paper's profiles and on
random Zipf loads).

The knobs are one frozen ``LLEPConfig``; the operator's keywords default to its fields.

Legend: E experts, D devices in the expert-parallel group, E_l = E / D experts per device.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax


@dataclasses.dataclass(frozen=True)
class LLEPConfig:
    """The knobs of the least-loaded plan (SPEC.md, Operator 1, step 2; the paper's values)."""

    threshold: float = 1.3
    """lambda: plain expert parallelism while the busiest device's native load is below lambda
    times the mean."""
    capacity: float = 1.0
    """alpha: devices are filled to ``ceil(alpha * T / D)`` token-slots (T: all of them)."""
    min_tokens: int = 1024
    """m: the smallest piece of an expert a helper takes (a final remainder may be smaller)."""
    max_foreign_experts: int | None = None
    """Foreign experts a device may host: the size of its static buffers for migrated weights.
    None: ``default_max_foreign_experts``."""

    def foreign_bound(self, num_experts: int, num_devices: int) -> int:
        """``max_foreign_experts``, or its default for E experts over D devices."""
        if self.max_foreign_experts is not None:
            return self.max_foreign_experts
        return default_max_foreign_experts(num_experts, num_devices)


# The most foreign experts a device hosted over the plans of the paper's profiles and of random
# Zipf loads (E = 128, top-8, D = 2, 4, 8) was 5; one more for loads beyond those
# (docs/pipelined_moe.md, "The LLEP plan").
DEFAULT_MAX_FOREIGN_EXPERTS = 6


def default_max_foreign_experts(num_experts: int, num_devices: int) -> int:
    """The foreign-expert bound when none is given: ``DEFAULT_MAX_FOREIGN_EXPERTS``, or E_l if
    a device owns fewer experts (no more foreign experts than it owns, the bound before the
    census; 0 on one device). A plan that would exceed it keeps the excess with the owner
    (module doc, step 4)."""
    if num_devices < 2:
        return 0
    return min(DEFAULT_MAX_FOREIGN_EXPERTS, num_experts // num_devices)


def plain_assignment(loads: jax.Array, num_devices: int) -> jax.Array:
    """Every expert's load on its owner: the ``[E, D]`` plan of standard expert parallelism."""
    num_experts = loads.shape[0]
    owner = jnp.arange(num_experts) // (num_experts // num_devices)
    return jnp.where(owner[:, None] == jnp.arange(num_devices)[None, :], loads[:, None], 0
                     ).astype(jnp.int32)


def llep_assignment(loads: jax.Array, num_devices: int,
                    config: LLEPConfig = LLEPConfig()) -> jax.Array:
    """The ``[E, D]`` int32 LLEP plan for per-expert token-slot ``loads [E]`` (module doc)."""
    num_experts = loads.shape[0]
    experts_per_device = num_experts // num_devices
    threshold, capacity, min_tokens = config.threshold, config.capacity, config.min_tokens
    max_foreign = config.foreign_bound(num_experts, num_devices)
    loads = loads.astype(jnp.int32)
    owner = jnp.arange(num_experts) // experts_per_device
    devices = jnp.arange(num_devices)
    # Every array derives from `loads` so that it varies over the same mesh axes (loop carries
    # inside shard_map must).
    zeros = functools.partial(jnp.zeros_like, loads, dtype=jnp.int32)
    native = zeros(shape=(num_devices,)).at[owner].add(loads)
    total = jnp.sum(loads)
    # Integer arithmetic wherever possible so that every rank derives the same plan.
    balanced = native.max() * num_devices < threshold * jnp.maximum(total, 1)
    room_total = jnp.ceil(capacity * total / num_devices).astype(jnp.int32)
    order = jnp.argsort(-loads, stable=True)

    def plan_expert(i, state):
        assignment, assigned, pending, foreign = state
        expert = order[i]
        load, home = loads[expert], owner[expert]
        pending = pending.at[home].add(-load)
        keep = jnp.clip(room_total - assigned[home] - pending[home], 0, load)
        assignment = assignment.at[expert, home].add(keep)
        assigned = assigned.at[home].add(keep)

        def place_piece(_, state):
            assignment, assigned, foreign, excess = state
            hosting = assignment[expert] > 0
            eligible = (devices != home) & (hosting | (foreign < max_foreign))
            burden = assigned + pending
            helper = jnp.argmin(jnp.where(eligible, burden, jnp.iinfo(jnp.int32).max))
            room = room_total - burden[helper]
            takes_piece = (room > 0) & ((room >= min_tokens) | (room >= excess))
            # A piece that fits, else the whole excess to the least loaded helper; with no
            # helper left under the foreign bound, the excess stays home.
            target = jnp.where(eligible.any(), helper, home)
            piece = jnp.where(eligible.any() & takes_piece, jnp.minimum(excess, room), excess)
            new_host = (target != home) & ~hosting[target] & (piece > 0)
            assignment = assignment.at[expert, target].add(piece)
            assigned = assigned.at[target].add(piece)
            foreign = foreign.at[target].add(new_host.astype(jnp.int32))
            return assignment, assigned, foreign, excess - piece

        # Each piece fills a helper to capacity or ends the excess: D pieces always suffice.
        assignment, assigned, foreign, _ = lax.fori_loop(
            0, num_devices, place_piece, (assignment, assigned, foreign, load - keep))
        return assignment, assigned, pending, foreign

    init = (zeros(shape=(num_experts, num_devices)), zeros(shape=(num_devices,)), native,
            zeros(shape=(num_devices,)))
    assignment = lax.fori_loop(0, num_experts, plan_expert, init)[0]
    return jnp.where(balanced, plain_assignment(loads, num_devices), assignment)


def foreign_experts(assignment: jax.Array, max_foreign: int) -> jax.Array:
    """``[D, max_foreign]`` int32: the foreign experts each device hosts, by ascending id; -1 pads.
    """
    num_experts, num_devices = assignment.shape
    owner = jnp.arange(num_experts) // (num_experts // num_devices)
    hosts = (assignment.T > 0) & (owner[None, :] != jnp.arange(num_devices)[:, None])  # [D, E]
    # Sort each device's hosted experts to the front, in id order.
    keys = jnp.where(hosts, jnp.arange(num_experts)[None, :], num_experts)
    ranked = jnp.sort(keys, axis=1)[:, :max_foreign]
    return jnp.where(ranked < num_experts, ranked, -1).astype(jnp.int32)
