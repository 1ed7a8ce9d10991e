"""The LLEP plan: hand-derived assignments and invariants on random loads."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from peakflat_jax import skew
from peakflat_jax.ops.llep_plan import (
    LLEPConfig,
    foreign_experts,
    llep_assignment,
    plain_assignment,
)


def plan(loads, num_devices, **knobs):
    """The jitted plan; ``knobs`` are LLEPConfig's fields."""
    config = LLEPConfig(**knobs)
    return np.asarray(jax.jit(lambda loads: llep_assignment(loads, num_devices, config))(
        jnp.asarray(loads, jnp.int32)))


def test_one_hot_expert_splits_at_capacity():
    # T = 100 over 2 devices: capacity 50; the owner keeps 50, the other device takes 50 even
    # though min_tokens (1024) is larger: a piece never exceeds what is left.
    np.testing.assert_array_equal(plan([100, 0, 0, 0], 2), [[50, 50], [0, 0], [0, 0], [0, 0]])


def test_balanced_load_stays_home():
    np.testing.assert_array_equal(plan([10, 10, 10, 10], 2),
                                  plain_assignment(jnp.array([10, 10, 10, 10]), 2))


def test_spill_goes_to_least_loaded_counting_pending_native_load():
    # T = 600 over 4 devices (one expert each): capacity 150. Expert 0 (400) keeps 150; its
    # excess goes to device 3 (assigned 0 + pending 0) up to its room, 150; then device 1
    # (pending 100: room 50, a piece of max(50, m=50)); then device 2, likewise.
    expected = [[150, 50, 50, 150], [0, 100, 0, 0], [0, 0, 100, 0], [0, 0, 0, 0]]
    assignment = plan([400, 100, 100, 0], 4, min_tokens=50, max_foreign_experts=2)
    np.testing.assert_array_equal(assignment, expected)
    np.testing.assert_array_equal(foreign_experts(jnp.asarray(assignment), 2),
                                  [[-1, -1], [0, -1], [0, -1], [0, -1]])


def test_min_tokens_makes_pieces_larger_than_room():
    # As above with m = 80: device 3 takes 150; device 1's room is 50 but its piece is 80;
    # the last 20 go to device 2.
    assignment = plan([400, 100, 100, 0], 4, min_tokens=80, max_foreign_experts=2)
    np.testing.assert_array_equal(assignment[0], [150, 80, 20, 150])


def test_foreign_bound_keeps_the_excess_home():
    assignment = plan([400, 100, 100, 0], 4, min_tokens=50, max_foreign_experts=0)
    np.testing.assert_array_equal(assignment, np.diag([400, 100, 100, 0]))
    # One foreign expert per device: expert 0 may still go to all three helpers.
    assignment = plan([300, 300, 0, 0], 4, min_tokens=1, max_foreign_experts=1)
    hosted = (assignment > 0) & ~np.eye(4, dtype=bool)
    assert hosted.sum(axis=0).max() <= 1


def test_threshold_gate():
    # native loads [130, 100]: max/mean = 1.13 < 1.3: plain; with threshold 1.1: LLEP.
    loads = [130, 0, 100, 0]
    np.testing.assert_array_equal(plan(loads, 2), plain_assignment(jnp.array(loads), 2))
    assert plan(loads, 2, threshold=1.1, min_tokens=1)[0, 1] > 0


@pytest.mark.parametrize("num_devices, num_experts", [(2, 8), (4, 16), (8, 64)])
def test_invariants_on_random_and_paper_loads(rng, num_devices, num_experts):
    loads_list = [rng.integers(0, 1000, num_experts) * (rng.random(num_experts) < 0.5)]
    for profile in (p for p in skew.PAPER_PROFILES if p.hot_experts < num_experts):
        ids = np.concatenate([skew.route(256, 8, num_experts, profile)] * num_devices)
        loads_list.append(np.bincount(ids.reshape(-1), minlength=num_experts))
    for loads in loads_list:
        for max_foreign in (1, num_experts // num_devices):
            assignment = plan(loads, num_devices, min_tokens=16, max_foreign_experts=max_foreign)
            np.testing.assert_array_equal(assignment.sum(axis=1), loads)  # nothing lost
            assert (assignment >= 0).all()
            owner = np.arange(num_experts) // (num_experts // num_devices)
            hosted = (assignment > 0) & (owner[:, None] != np.arange(num_devices)[None, :])
            assert hosted.sum(axis=0).max(initial=0) <= max_foreign
            # LLEP never leaves the busiest device busier than plain EP does.
            plain = np.asarray(plain_assignment(jnp.asarray(loads), num_devices))
            assert assignment.sum(axis=0).max() <= plain.sum(axis=0).max()


def test_skewed_paper_profile_is_balanced_to_capacity():
    # 95%/16 over 8 devices of 16 experts, top-8: hot slots go to experts 0..7, all on device
    # 0; with the default foreign bound (E_l) LLEP spreads them to capacity.
    num_devices, num_experts = 8, 128
    ids = np.concatenate([skew.route(4096, 8, num_experts, skew.SkewProfile(0.95, 16))] * 8)
    loads = np.bincount(ids.reshape(-1), minlength=num_experts)
    per_device = plan(loads, num_devices, min_tokens=1024).sum(axis=0)
    capacity = np.ceil(loads.sum() / num_devices)
    plain = np.asarray(plain_assignment(jnp.asarray(loads), num_devices)).sum(axis=0)
    assert plain.max() > 5 * capacity
    assert per_device.max() <= capacity + 1024  # at most one minimum piece over
