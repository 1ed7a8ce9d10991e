"""Probe (CPU, about 25 minutes on 2 cores): what the LLEP plan does on the paper's profiles and
on random Zipf loads, under the rule the operator runs and the variants issue 19 compared it
with; the numbers behind ``llep_plan.default_max_foreign_experts`` (docs/pipelined_moe.md, "The
LLEP plan").

Loads: E = 128 experts, top-8, D = 2, 4, 8 ranks. The paper's profiles at 65,536 tokens per rank
(every rank routes alike, ``peakflat_jax.skew``), and Zipf loads at 65,536, 8,192 and 512 tokens
per rank (at 512, min_tokens is a quarter of a device's capacity: small rooms). A Zipf token
picks 8 distinct experts with probability proportional to rank^-s (Gumbel top-k), the ranks a
random permutation of the experts, several exponents s and seeds.

Rules (``tests/llep_reference.py``): ``adopted`` (the operator's; checked equal to
``llep_plan.llep_assignment`` on every load), ``overfill`` (a helper whose room is below
min_tokens still takes a min_tokens piece), ``owner_fallback`` (an excess no helper can take a
piece of falls to the least loaded device, the owner included), ``before`` (the rule before
issue 19: no room held back by the owner, overfill, owner fallback). No foreign bound
(max_foreign_experts = E - E_l), so that the plan shows what it needs; the gate (lambda = 1.3)
applies, and loads it sends to plain EP are counted apart. Per rule and load: foreign pieces, the
most foreign experts on one device, and the busiest device's load over the capacity. Then the
adopted rule under foreign bounds of 1 to 8: how far the busiest device ends over capacity when
the bound keeps an excess at home.

    PYTHONPATH=. python3 scripts/probe_llep_plan.py [--seeds 8] [--out-dir DIR]

Writes ``<out-dir>/llep_plan_probe_<date>.json`` (default scripts/results).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

from peakflat_jax import skew
from peakflat_jax.bench import harness
from peakflat_jax.ops.llep_plan import LLEPConfig, llep_assignment

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
from llep_reference import foreign_pieces, plan  # noqa: E402

EXPERTS, TOP_K, MIN_TOKENS = 128, 8, 1024
PAPER_TOKENS, ZIPF_TOKENS = 65536, (65536, 8192, 512)
DEVICES = (2, 4, 8)
EXPONENTS = (0.6, 0.8, 1.0, 1.2, 1.5)
BOUNDS = (1, 2, 3, 4, 6, 8)
RULES = {
    "adopted": {},
    "overfill": dict(small_room="overfill"),
    "owner_fallback": dict(fallback="least_loaded_device"),
    "before": dict(reserve=False, small_room="overfill", fallback="least_loaded_device"),
}


def zipf_loads(rng: np.random.Generator, exponent: float, num_tokens: int) -> np.ndarray:
    """Per-expert token-slot counts of ``num_tokens`` tokens, each choosing TOP_K distinct
    experts with probability proportional to rank^-exponent (ranks permuted at random)."""
    log_weight = -exponent * np.log(np.arange(1, EXPERTS + 1))[rng.permutation(EXPERTS)]
    loads = np.zeros(EXPERTS, np.int64)
    for start in range(0, num_tokens, 32768):
        count = min(32768, num_tokens - start)
        keys = log_weight + rng.gumbel(size=(count, EXPERTS)).astype(np.float32)
        chosen = np.argpartition(-keys, TOP_K, axis=1)[:, :TOP_K]
        loads += np.bincount(chosen.reshape(-1), minlength=EXPERTS)
    return loads


def measure(loads: np.ndarray, devices: int, check) -> dict:
    total = int(loads.sum())
    capacity = math.ceil(total / devices)
    local = EXPERTS // devices
    native = loads.reshape(devices, local).sum(axis=1)
    result = {"native_max_over_mean": round(float(native.max() * devices / total), 4)}
    result["gated"] = bool(native.max() * devices < 1.3 * total)
    if result["gated"]:
        return result
    adopted = None
    for name, variant in RULES.items():
        assignment = plan(loads, devices, min_tokens=MIN_TOKENS,
                          max_foreign_experts=EXPERTS - local, **variant)
        if name == "adopted":
            check(loads, devices, assignment)
            adopted = assignment
        pieces, most = foreign_pieces(assignment)
        result[name] = {"pieces": pieces, "most_foreign_on_a_device": most,
                        "busiest_over_capacity": int(assignment.sum(axis=0).max()) - capacity,
                        "same_as_adopted": bool(np.array_equal(assignment, adopted))}
    result["bounded"] = {
        str(bound): int(plan(loads, devices, min_tokens=MIN_TOKENS,
                             max_foreign_experts=bound).sum(axis=0).max()) - capacity
        for bound in BOUNDS}
    return result


def summarize(cases: list[dict]) -> dict:
    summary = {}
    for devices in DEVICES:
        mine = [c for c in cases if c["devices"] == devices]
        planned = [c for c in mine if not c["gated"]]
        entry = {"loads": len(mine), "gated_to_plain_ep": len(mine) - len(planned)}
        for name in RULES:
            entry[name] = {
                "most_foreign_on_a_device": max(c[name]["most_foreign_on_a_device"]
                                                for c in planned),
                "most_pieces": max(c[name]["pieces"] for c in planned),
                "total_pieces": sum(c[name]["pieces"] for c in planned),
                "most_over_capacity": max(c[name]["busiest_over_capacity"] for c in planned),
                "loads_unlike_adopted": sum(not c[name]["same_as_adopted"] for c in planned)}
        entry["bounded"] = {
            bound: {"loads_over_capacity": sum(c["bounded"][bound] > 0 for c in planned),
                    "most_over_capacity": max(c["bounded"][bound] for c in planned)}
            for bound in map(str, BOUNDS)}
        summary[f"D={devices}"] = entry
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=8, help="Zipf draws per exponent and D")
    parser.add_argument("--out-dir", type=pathlib.Path, default=harness.RESULTS_DIR)
    args = parser.parse_args()
    compiled = {}

    def check(loads, devices, expected):
        """The operator's plan equals the reference's on these loads."""
        if devices not in compiled:
            config = LLEPConfig(min_tokens=MIN_TOKENS,
                                max_foreign_experts=EXPERTS - EXPERTS // devices)
            compiled[devices] = jax.jit(lambda counts: llep_assignment(counts, devices, config))
        got = np.asarray(compiled[devices](jnp.asarray(loads, jnp.int32)))
        if not np.array_equal(got, expected):
            raise AssertionError(f"llep_assignment differs from the reference at D={devices}")

    cases = []
    for devices in DEVICES:
        for profile in skew.PAPER_PROFILES:
            ids = skew.route(PAPER_TOKENS, TOP_K, EXPERTS, profile)
            loads = np.bincount(ids.reshape(-1), minlength=EXPERTS) * devices
            cases.append({"devices": devices, "loads": f"paper {profile.name}",
                          "tokens_per_rank": PAPER_TOKENS, **measure(loads, devices, check)})
        for tokens in ZIPF_TOKENS:
            for exponent in EXPONENTS:
                for seed in range(args.seeds):
                    rng = np.random.default_rng([seed, devices, int(exponent * 100), tokens])
                    loads = zipf_loads(rng, exponent, devices * tokens)
                    cases.append({"devices": devices, "loads": f"zipf s={exponent}",
                                  "seed": seed, "tokens_per_rank": tokens,
                                  **measure(loads, devices, check)})
        print(f"D={devices}: {len(cases)} loads so far", flush=True)
    summary = summarize(cases)
    now = datetime.datetime.now(datetime.timezone.utc)
    record = {"probe": "llep_plan", "command": " ".join([sys.executable, *sys.argv]),
              "device": "CPU (the plan only)", "date": now.isoformat(timespec="seconds"),
              "jax": jax.__version__, "commit": harness.git_commit(),
              "setup": dict(experts=EXPERTS, top_k=TOP_K, paper_tokens_per_rank=PAPER_TOKENS,
                            zipf_tokens_per_rank=ZIPF_TOKENS, min_tokens=MIN_TOKENS,
                            threshold=1.3, capacity=1.0, exponents=EXPONENTS,
                            seeds=args.seeds, rules=RULES, bounds=BOUNDS),
              "summary": summary, "cases": cases}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / f"llep_plan_probe_{now:%Y%m%d-%H%M%S}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    for key, value in summary.items():
        print(key, json.dumps(value))
    print(f"record: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
