"""The MoE benchmark's case runner on CPU: one compile serves every profile, the methods compute
the same function, and a step that cannot run still records XLA's plan."""

import pytest

from peakflat_jax.bench import harness, moe_dispatch

pytestmark = pytest.mark.slow  # the benchmark harness: real cases, structural checks

TINY = dict(devices=8, experts=16, top_k=2, hidden=16, ffn=16, dtype="float32",
            llep_min_tokens=8, tokens=64, profiles=[[0.0, 0], [0.5, 4]], repeats=1, warmup=0)
CASES = [dict(TINY, method="ep"), dict(TINY, method="llep"),
         dict(TINY, method="pipelined", membership="strided", token_budget=16)]


def test_every_method_times_every_profile_and_agrees_on_the_loss():
    results = [{**case, **moe_dispatch.run_case(case)} for case in CASES]
    for result in results:
        assert "error" not in result
        assert [p["profile"] for p in result["profile_results"]] == TINY["profiles"]
        assert all(p["time_s"] > 0 for p in result["profile_results"])
        assert result["xla_temp_bytes"] > 0
    for i in range(len(TINY["profiles"])):
        losses = [r["profile_results"][i]["loss"] for r in results]
        assert max(losses) - min(losses) <= 1e-5 * abs(losses[0])
    # The two profiles route differently, so they must not share a loss (the ids are an
    # argument of the one compiled step, not a constant baked into it).
    assert results[0]["profile_results"][0]["loss"] != results[0]["profile_results"][1]["loss"]
    table = moe_dispatch.summarize({"benchmark": "moe_dispatch", "device": "cpu", "date": "-",
                                    "cases": results})
    assert table.count("| 64 ") == 6 and "1.000x" in table


def test_a_run_that_fails_keeps_the_plan(monkeypatch):
    def out_of_memory(*args, **kwargs):
        raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate")

    monkeypatch.setattr(harness, "time_fields", out_of_memory)
    result = moe_dispatch.run_case(CASES[1])
    assert result["oom"] and result["error"] == "RuntimeError"
    assert result["xla_temp_bytes"] > 0 and result["profile_results"] == []


def test_a_case_needing_more_devices_says_so():
    assert "needs 16 devices" in moe_dispatch.run_case(dict(CASES[0], devices=16))["error"]
