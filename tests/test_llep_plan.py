"""The LLEP plan: hand-derived assignments under the paper's rule (Alg. 2, as the public LLEP code
runs it), the piece counts of issue 19 on the paper's profiles, the plain-loop reference on
random loads, and invariants."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from llep_reference import foreign_pieces
from llep_reference import plan as reference_plan

from peakflat_jax import skew
from peakflat_jax.ops.llep_plan import (
    LLEPConfig,
    default_max_foreign_experts,
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
    # though min_tokens (1024) is larger: a piece that holds the whole excess is always taken.
    np.testing.assert_array_equal(plan([100, 0, 0, 0], 2), [[50, 50], [0, 0], [0, 0], [0, 0]])


def test_balanced_load_stays_home():
    np.testing.assert_array_equal(plan([10, 10, 10, 10], 2),
                                  plain_assignment(jnp.array([10, 10, 10, 10]), 2))


def test_owner_holds_room_for_its_experts_still_to_come():
    # E = 8 over 2 devices, T = 1100: capacity 550. Device 0 owns 600 + 3 x 100. Expert 0 comes
    # first, with 300 of device 0's load still pending: it keeps 550 - 300 = 250 and spills 350
    # to device 1 (pending 200: room 350), and experts 1-3 stay home. One piece; without the
    # room held back device 0 would keep 550 of expert 0 and spill 1, 2 and 3 whole (4 pieces).
    expected = [[250, 350], [100, 0], [100, 0], [100, 0], [0, 50], [0, 50], [0, 50], [0, 50]]
    loads = [600, 100, 100, 100, 50, 50, 50, 50]
    np.testing.assert_array_equal(plan(loads, 2, min_tokens=64), expected)
    before = reference_plan(loads, 2, min_tokens=64, reserve=False, small_room="overfill",
                            fallback="least_loaded_device")
    assert foreign_pieces(before) == (4, 4)


def test_several_owners_spill_by_pending_load():
    # E = 8 over 4 devices (E_l = 2), T = 1200: capacity 300. Native loads 700 / 400 / 100 / 0.
    # Expert 0 (500; 200 of device 0 pending): keeps 100, 300 to device 3 (burden 0), 100 to
    # device 2 (burden 100). Expert 2 (300; 100 of device 1 pending): keeps 200, 100 to device 2
    # (burden 200, room 100). Experts 1, 3 and 4 then fit at home.
    expected = [[100, 0, 100, 300], [200, 0, 0, 0], [0, 200, 100, 0], [0, 100, 0, 0],
                [0, 0, 100, 0], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]
    loads = [500, 200, 300, 100, 100, 0, 0, 0]
    assignment = plan(loads, 4, min_tokens=50)
    np.testing.assert_array_equal(assignment, expected)
    np.testing.assert_array_equal(foreign_experts(jnp.asarray(assignment), 2),
                                  [[-1, -1], [-1, -1], [0, 2], [0, -1]])


def test_spill_goes_to_least_loaded_counting_pending_native_load():
    # T = 600 over 4 devices (one expert each): capacity 150. Expert 0 (400) keeps 150; its
    # excess goes to device 3 (assigned 0 + pending 0) up to its room, 150; then device 1
    # (pending 100: room 50 = m); then device 2, likewise.
    expected = [[150, 50, 50, 150], [0, 100, 0, 0], [0, 0, 100, 0], [0, 0, 0, 0]]
    assignment = plan([400, 100, 100, 0], 4, min_tokens=50, max_foreign_experts=2)
    np.testing.assert_array_equal(assignment, expected)
    np.testing.assert_array_equal(foreign_experts(jnp.asarray(assignment), 2),
                                  [[-1, -1], [0, -1], [0, -1], [0, -1]])


def test_helper_with_room_below_min_tokens_takes_the_whole_excess():
    # As above with m = 80: device 3 takes 150; then the least loaded helper, device 1, has 50
    # of room, less than m and than the 100 left, so no helper can take a piece (the others
    # have less room) and the 100 go to device 1 whole: one piece past its capacity instead of
    # pieces of m = 80 on devices 1 and 2. Expert 1 then keeps 50 and spills 50 to device 2.
    expected = [[150, 100, 0, 150], [0, 50, 50, 0], [0, 0, 100, 0], [0, 0, 0, 0]]
    np.testing.assert_array_equal(plan([400, 100, 100, 0], 4, min_tokens=80), expected)


def test_foreign_bound_keeps_the_excess_home():
    assignment = plan([400, 100, 100, 0], 4, min_tokens=50, max_foreign_experts=0)
    np.testing.assert_array_equal(assignment, np.diag([400, 100, 100, 0]))
    # The several-owners case with one foreign expert per device. Expert 2's excess may go to
    # device 0 only (2 and 3 host expert 0): no room there, so all of it; then expert 1's to
    # device 1 only, all of it; expert 3's excess finds no helper left and stays home.
    loads = [500, 200, 300, 100, 100, 0, 0, 0]
    expected = [[100, 0, 100, 300], [100, 100, 0, 0], [100, 200, 0, 0], [0, 100, 0, 0],
                [0, 0, 100, 0], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]
    np.testing.assert_array_equal(plan(loads, 4, min_tokens=50, max_foreign_experts=1),
                                  expected)


def test_threshold_gate():
    # native loads [130, 100]: max/mean = 1.13 < 1.3: plain; with threshold 1.1: LLEP.
    loads = [130, 0, 100, 0]
    np.testing.assert_array_equal(plan(loads, 2), plain_assignment(jnp.array(loads), 2))
    assert plan(loads, 2, threshold=1.1, min_tokens=1)[0, 1] > 0


@pytest.mark.parametrize("devices, profile, pieces", [
    (2, skew.SkewProfile(0.95, 16), 4),  # the rule before issue 19: 52
    (2, skew.SkewProfile(0.80, 16), 4),  # 51
    (2, skew.SkewProfile(0.50, 4), 2),   # 60
    (8, skew.SkewProfile(0.50, 4), 10),  # 21
])
def test_piece_counts_on_the_paper_profiles(devices, profile, pieces):
    """Issue 19's loads (E = 128, top-8, 65,536 tokens per rank, every rank alike, no foreign
    bound): the foreign pieces the public LLEP code makes on them, and the same busiest load."""
    ids = skew.route(65536, 8, 128, profile)
    loads = np.bincount(ids.reshape(-1), minlength=128) * devices
    assignment = plan(loads, devices, max_foreign_experts=128 - 128 // devices)
    assert foreign_pieces(assignment)[0] == pieces
    assert assignment.sum(axis=0).max() == loads.sum() // devices  # every device at capacity


@pytest.mark.parametrize("num_devices, num_experts", [(2, 8), (4, 8), (4, 16), (8, 32)])
def test_matches_the_reference_on_random_loads(rng, num_devices, num_experts):
    """Loads where min_tokens is large against the capacity (small rooms, helpers passed over)
    and foreign bounds that bind: the compiled plan equals the plain loop's."""
    local = num_experts // num_devices
    for min_tokens, bound in [(16, num_experts - local), (300, num_experts - local), (40, 1),
                              (200, 2)]:
        config = LLEPConfig(threshold=1.0, min_tokens=min_tokens, max_foreign_experts=bound)
        compiled = jax.jit(lambda loads: llep_assignment(loads, num_devices, config))
        for _ in range(6):
            loads = rng.integers(0, 1000, num_experts) * (rng.random(num_experts) < 0.6)
            expected = reference_plan(loads, num_devices, threshold=1.0, min_tokens=min_tokens,
                                      max_foreign_experts=bound)
            np.testing.assert_array_equal(compiled(jnp.asarray(loads, jnp.int32)), expected)


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
    # 0; with the default foreign bound LLEP spreads them to capacity.
    num_devices, num_experts = 8, 128
    ids = np.concatenate([skew.route(4096, 8, num_experts, skew.SkewProfile(0.95, 16))] * 8)
    loads = np.bincount(ids.reshape(-1), minlength=num_experts)
    per_device = plan(loads, num_devices, min_tokens=1024).sum(axis=0)
    capacity = np.ceil(loads.sum() / num_devices)
    plain = np.asarray(plain_assignment(jnp.asarray(loads), num_devices)).sum(axis=0)
    assert plain.max() > 5 * capacity
    assert per_device.max() <= capacity


def test_default_foreign_bound():
    assert default_max_foreign_experts(128, 1) == 0
    assert default_max_foreign_experts(128, 2) == default_max_foreign_experts(128, 8) == 6
    assert default_max_foreign_experts(8, 4) == 2 and default_max_foreign_experts(64, 8) == 6
    assert LLEPConfig().foreign_bound(128, 2) == default_max_foreign_experts(128, 2)
    assert LLEPConfig(max_foreign_experts=3).foreign_bound(128, 2) == 3
