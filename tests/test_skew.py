"""The paper's routing skew profiles, by their definition (App. B.2)."""

import numpy as np
import pytest

from peakflat_jax import skew


def test_balanced_profile():
    ids = skew.route(5, 3, 4, skew.SkewProfile())
    np.testing.assert_array_equal(ids, [[0, 1, 2], [1, 2, 3], [2, 3, 0], [3, 0, 1], [0, 1, 2]])


def test_hot_profile_with_fewer_hot_experts_than_slots():
    # 50%/2 of 6 tokens, top-3, 6 experts: tokens 0-2 hot (slot j -> j mod 2, so expert 0
    # twice); cold token i, slot j -> 2 + (i + j) mod 4.
    ids = skew.route(6, 3, 6, skew.SkewProfile(0.5, 2))
    np.testing.assert_array_equal(ids[:3], [[0, 1, 0]] * 3)
    np.testing.assert_array_equal(ids[3:], [[5, 2, 3], [2, 3, 4], [3, 4, 5]])


def test_paper_profiles_names_and_load():
    assert [p.name for p in skew.PAPER_PROFILES] == ["balanced", "95%/16", "80%/16", "50%/4",
                                                     "30%/16"]
    ids = skew.route(1000, 8, 128, skew.SkewProfile(0.95, 16))
    loads = np.bincount(ids.reshape(-1), minlength=128)
    assert loads[:8].sum() == 950 * 8  # top-8 < 16: hot slots land on experts 0..7


@pytest.mark.parametrize("profile", [skew.SkewProfile(0.5, 4), skew.SkewProfile(1.5, 2)])
def test_bad_profile(profile):
    with pytest.raises(ValueError, match="profile"):
        skew.route(8, 2, 4, profile)
