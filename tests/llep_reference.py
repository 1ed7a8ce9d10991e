"""The least-loaded plan as a plain Python loop: the oracle of tests/test_llep_plan.py, and the
rule variants that scripts/probe_llep_plan.py compares (docs/pipelined_moe.md, "The LLEP plan").

Written from the rule (SPEC.md, Operator 1, step 2; the paper's Alg. 2; the behaviour of the
public LLEP code on the same loads), not from any implementation:

    for each expert, heaviest first (ties: lower id):
        its load leaves its owner's pending load
        the owner keeps what fits: capacity - (assigned + pending) of the owner, at least 0
        while some of it is left:
            helper = the device other than the owner with the least assigned + pending load
                     (ties: lower id), among those that may host it (the foreign bound)
            room = capacity - (its assigned + pending)
            if room > 0 and (room >= min_tokens or room >= what is left):
                the helper takes min(what is left, room)
            else:
                the rest goes to the fallback, whole

Variants (keywords of ``plan``): ``reserve=False`` lets the owner keep up to
``capacity - assigned`` (no room held back for its experts still to come: the rule before
issue 19); ``small_room="overfill"`` gives a helper whose room is below ``min_tokens`` a piece of
``min_tokens`` anyway; ``fallback="least_loaded_device"`` lets the rest fall to the least loaded
device, the owner included. The defaults are the rule the operator implements.
"""

from __future__ import annotations

import math

import numpy as np


def plan(loads, num_devices: int, *, threshold: float = 1.3, capacity: float = 1.0,
         min_tokens: int = 1024, max_foreign_experts: int | None = None,
         reserve: bool = True, small_room: str = "pass_over",
         fallback: str = "least_loaded_helper") -> np.ndarray:
    """The ``[E, D]`` plan of ``loads [E]`` (see module doc); int64."""
    loads = [int(v) for v in loads]
    num_experts = len(loads)
    local = num_experts // num_devices
    bound = local if max_foreign_experts is None else max_foreign_experts
    owner = [e // local for e in range(num_experts)]
    total = sum(loads)
    native = [0] * num_devices
    for e, load in enumerate(loads):
        native[owner[e]] += load
    assignment = np.zeros((num_experts, num_devices), np.int64)
    if max(native) * num_devices < threshold * max(total, 1):  # the gate: plain EP
        for e, load in enumerate(loads):
            assignment[e, owner[e]] = load
        return assignment
    room_total = math.ceil(capacity * total / num_devices)
    assigned = [0] * num_devices
    pending = list(native)
    foreign = [0] * num_devices

    def burden(d):
        return assigned[d] + pending[d]

    def give(e, d, amount):
        if d != owner[e] and assignment[e, d] == 0 and amount > 0:
            foreign[d] += 1
        assignment[e, d] += amount
        assigned[d] += amount

    for e in sorted(range(num_experts), key=lambda e: (-loads[e], e)):
        home = owner[e]
        pending[home] -= loads[e]
        fits = room_total - burden(home) if reserve else room_total - assigned[home]
        keep = min(loads[e], max(fits, 0))
        give(e, home, keep)
        left = loads[e] - keep
        while left > 0:
            helpers = [d for d in range(num_devices) if d != home
                       and (assignment[e, d] > 0 or foreign[d] < bound)]
            if not helpers:  # the foreign bound: what is left stays with the owner
                give(e, home, left)
                break
            helper = min(helpers, key=lambda d: (burden(d), d))
            room = room_total - burden(helper)
            if room > 0 and (room >= min_tokens or room >= left):
                piece = min(left, room)
            elif room > 0 and small_room == "overfill":
                piece = min(left, min_tokens)
            else:
                if fallback == "least_loaded_device":
                    helper = min(helpers + [home], key=lambda d: (burden(d), d))
                give(e, helper, left)
                break
            give(e, helper, piece)
            left -= piece
    return assignment


def foreign_pieces(assignment: np.ndarray) -> tuple[int, int]:
    """(pieces, most on one device): how many (expert, helper) pairs the plan makes, and the
    most foreign experts one device hosts."""
    num_experts, num_devices = assignment.shape
    owner = np.arange(num_experts) // (num_experts // num_devices)
    hosted = (assignment > 0) & (owner[:, None] != np.arange(num_devices)[None, :])
    return int(hosted.sum()), int(hosted.sum(axis=0).max(initial=0))
