"""Routing skew profiles of the paper (App. B.2, LLEP's generator), for tests and benchmarks.

Every rank routes by token position only:

* ``balanced``: slot j of token i goes to expert ``(i + j) mod E``.
* ``hot(r, h)``: the first ``floor(r * N)`` tokens are hot and slot j goes to expert
  ``j mod h``; a cold token i, slot j, goes to ``h + ((i + j) mod (E - h))``.

With h < k a hot token is routed to the same expert more than once, which the operators must
handle (each slot counts). The paper's profiles: balanced, 95%/16, 80%/16, 50%/4, 30%/16.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class SkewProfile:
    """A routing profile: ``hot_fraction`` of the tokens go to the first ``hot_experts``."""

    hot_fraction: float = 0.0
    """r: the share of tokens (the first floor(r * N)) routed to the hot experts."""
    hot_experts: int = 0
    """h: how many experts (0 .. h-1) are hot; 0 for the balanced profile."""

    @property
    def name(self) -> str:
        if self.hot_experts == 0:
            return "balanced"
        return f"{round(self.hot_fraction * 100)}%/{self.hot_experts}"


PAPER_PROFILES = (SkewProfile(), SkewProfile(0.95, 16), SkewProfile(0.80, 16),
                  SkewProfile(0.50, 4), SkewProfile(0.30, 16))


def route(num_tokens: int, top_k: int, num_experts: int, profile: SkewProfile) -> np.ndarray:
    """``[num_tokens, top_k]`` int32 expert ids of one rank under ``profile``."""
    if not 0 <= profile.hot_experts < num_experts:
        raise ValueError(f"profile: hot_experts must be in [0, {num_experts}), got "
                         f"{profile.hot_experts}")
    if not 0.0 <= profile.hot_fraction <= 1.0:
        raise ValueError(f"profile: hot_fraction must be in [0, 1], got {profile.hot_fraction}")
    token = np.arange(num_tokens)[:, None]
    slot = np.arange(top_k)[None, :]
    if profile.hot_experts == 0:
        return ((token + slot) % num_experts).astype(np.int32)
    hot = token < int(np.floor(profile.hot_fraction * num_tokens))
    cold_ids = profile.hot_experts + (token + slot) % (num_experts - profile.hot_experts)
    return np.where(hot, slot % profile.hot_experts, cold_ids).astype(np.int32)
