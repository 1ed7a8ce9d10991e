"""Benchmark of PipelinedLLEP against standard expert parallelism and unchunked LLEP over the
paper's routing skew profiles: memory and forward+backward time, each case in a fresh process.

    peakflat bench moe_dispatch --preset cpu   # XLA's memory plan at a small size, 8 CPU devices
    peakflat bench moe_dispatch --preset gpu   # the paper's shapes on two H200s (see below)

Methods: ``ep`` (balance none, one chunk), ``llep`` (LLEP, one chunk), ``pipelined`` (LLEP,
token_budget, strided or contiguous chunks). All compute the same function.

The gpu preset (65,536 tokens per rank, H = 7168, E = 128, top-8, F = 2048) needs the Mosaic GPU
grouped matmul: XLA's ragged_dot runs at 45 TFLOP/s there and materializes [M, M] temporaries
(JAX-NOTES.md), so with the portable path it is neither fast nor small. Its cases name the
Mosaic grouped matmul and the padded exchange (``pipelined_moe.MoEBackend``; the ragged one is
experimental: ``ragged_exchange``). A case without them takes the layer's automatic choice.

Measured: docs/pipelined_moe.md (records: scripts/results/moe_dispatch_*).
"""

from __future__ import annotations

import math
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from peakflat_jax import skew
from peakflat_jax.bench import harness
from peakflat_jax.ops.pipelined_moe import MoEBackend, pipelined_moe

METHODS = {  # label: pipelined_moe keywords (token_budget filled from the case)
    "ep": dict(balance="none"),
    "llep": dict(balance="llep"),
    "pipelined": dict(balance="llep"),
}


def presets() -> dict[str, list[dict]]:
    """One case per (tokens, method): it compiles one step and times it on every profile (the
    routing is an argument, and every buffer's shape is fixed at launch, so the profiles share
    the program and its peak)."""
    def cases(shape, profiles, tokens_list, budget):
        profiles = [[p.hot_fraction, p.hot_experts] for p in profiles]
        out = []
        for tokens in tokens_list:
            common = dict(shape, tokens=tokens, profiles=profiles)
            out += [dict(common, method="ep"), dict(common, method="llep"),
                    dict(common, method="pipelined", membership="strided", token_budget=budget),
                    dict(common, method="pipelined", membership="contiguous",
                         token_budget=budget)]
        return out

    paper = dict(devices=2, experts=128, top_k=8, hidden=7168, ffn=2048, dtype="bfloat16",
                 llep_min_tokens=1024, grouped_matmul="mosaic", exchange="padded", repeats=5)
    small = dict(devices=8, experts=32, top_k=4, hidden=64, ffn=32, dtype="float32",
                 llep_min_tokens=64, repeats=3)
    cpu_profiles = [skew.PAPER_PROFILES[i] for i in (0, 1, 3)]
    return {"gpu": cases(paper, skew.PAPER_PROFILES, (65536, 32768), 6554),
            "gpu-x8": cases(dict(paper, devices=8), skew.PAPER_PROFILES, (65536,), 6554),
            "cpu": cases(small, cpu_profiles, (1024,), 128)}


def _route(case: dict, profile, mesh: Mesh) -> jax.Array:
    """Every rank's expert ids under ``profile`` ([r, h]), sharded over the expert axis."""
    ids = skew.route(case["tokens"], case["top_k"], case["experts"], skew.SkewProfile(*profile))
    return jax.device_put(jnp.asarray(np.concatenate([ids] * case["devices"])),
                          NamedSharding(mesh, P("expert")))


def _inputs(case: dict, mesh: Mesh):
    devices, tokens, experts = case["devices"], case["tokens"], case["experts"]
    hidden, ffn, top_k = case["hidden"], case["ffn"], case["top_k"]
    dtype = jnp.dtype(case["dtype"])
    shard = NamedSharding(mesh, P("expert"))

    def draw(key):
        keys = jax.random.split(key, 5)
        x = jax.random.normal(keys[0], (devices * tokens, hidden), dtype)
        gates = jax.nn.softmax(jax.random.normal(keys[1], (devices * tokens, top_k)), -1)
        scale_in, scale_out = 1 / math.sqrt(hidden), 1 / math.sqrt(ffn)
        w_gate = jax.random.normal(keys[2], (experts, hidden, ffn), dtype) * scale_in
        w_up = jax.random.normal(keys[3], (experts, hidden, ffn), dtype) * scale_in
        w_down = jax.random.normal(keys[4], (experts, ffn, hidden), dtype) * scale_out
        return x, gates.astype(dtype), w_gate, w_up, w_down

    return jax.jit(draw, out_shardings=(shard,) * 5)(jax.random.key(case.get("seed", 0)))


def _step(case: dict, mesh: Mesh):
    """The jitted fwd+bwd of the case's method: (x, ids, gates, weights) -> (loss, grads)."""
    keywords = dict(METHODS[case["method"]], llep_min_tokens=case["llep_min_tokens"],
                    backend=MoEBackend(exchange=case.get("exchange", "padded"),
                                       grouped_matmul=case.get("grouped_matmul")))
    if case["method"] == "pipelined":
        keywords.update(token_budget=case["token_budget"], membership=case["membership"],
                        max_chunks=case.get("max_chunks", 10))
    layer = jax.shard_map(
        lambda x, ids, g, wg, wu, wd: pipelined_moe(
            x, ids, g, wg, wu, wd, axis_name="expert", num_experts=case["experts"], **keywords),
        mesh=mesh, in_specs=(P("expert"),) * 6, out_specs=P("expert"))

    def loss(x, gates, w_gate, w_up, w_down, ids):
        return jnp.sum(layer(x, ids, gates, w_gate, w_up, w_down).astype(jnp.float32) ** 2)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))


def run_case(case: dict) -> dict:
    """Compiles the case's step once, then per profile: time, loss and gradient norm. The
    memory plan is read before anything runs, so a step that does not fit still records the
    bytes XLA planned for it."""
    devices = jax.devices()[: case["devices"]]
    if len(devices) < case["devices"]:
        return {"error": f"needs {case['devices']} devices, found {len(devices)}"}
    mesh = Mesh(np.array(devices), ("expert",))
    step = _step(case, mesh)
    arrays = _inputs(case, mesh)
    first_ids = _route(case, case["profiles"][0], mesh)
    compiled = step.lower(*arrays, first_ids).compile()
    result = harness.plan_fields(compiled)
    result["profile_results"] = []
    for i, profile in enumerate(case["profiles"]):
        args = (*arrays, first_ids if i == 0 else _route(case, profile, mesh))
        try:
            timing = harness.time_fields(compiled, args, case)
            measured = {"profile": profile, **timing, **_loss_and_grad_norm(compiled, args)}
            if i == 0 and case.get("trace_steps"):
                label = f"{_label(case)} {skew.SkewProfile(*profile).name} N={case['tokens']}"
                measured["device_profile"] = harness.trace_fields(
                    compiled, args, dict(case, label=label))
        except Exception as error:  # noqa: BLE001  (an OOM is a result; the shapes repeat)
            result.update(harness.error_fields(error))
            break
        result["profile_results"].append(measured)
    result["peak_bytes"] = harness.peak_bytes_over(devices)
    return result


def _loss_and_grad_norm(compiled, args) -> dict:
    """The step's loss and |dL/dx|, with its outputs freed on return (held into the next
    profile's timing, they would add their size to its peak)."""
    value, grads = compiled(*args)
    return {"loss": float(value),
            "grad_x_norm": float(jnp.linalg.norm(grads[0].astype(jnp.float32)))}


def _label(case: dict) -> str:
    if case["method"] == "pipelined":
        return f"pipelined {case['membership']} c={case['token_budget']}"
    return {"ep": "standard EP", "llep": "LLEP, one chunk"}[case["method"]]


def summarize(record: dict) -> str:
    """Each case's memory and each profile's time, with ratios to unchunked LLEP at the same
    tokens (memory) and profile (time); then how far the methods' losses agree."""
    def planned(case):
        return case["xla_temp_bytes"] + case["xla_argument_bytes"] + case["xla_output_bytes"]

    baselines = {c["tokens"]: c for c in record["cases"]
                 if c["method"] == "llep" and "xla_temp_bytes" in c}
    uses_peak = any(c.get("peak_bytes") for c in record["cases"] if "error" not in c)
    rows, losses = [], {}
    for case in record["cases"]:
        base = baselines.get(case["tokens"])
        if "xla_temp_bytes" not in case:  # failed before compiling
            rows.append([case["tokens"], "-", _label(case), case.get("error", "?"), "-", "-",
                         "-", "-", "-"])
            continue
        plan = f"{harness.format_bytes(planned(case))}"
        plan_ratio = f"{planned(case) / planned(base):.3f}x" if base else "-"
        if "error" in case:
            peak, peak_ratio = ("OOM" if case.get("oom") else case["error"]), "-"
        elif uses_peak:
            peak = harness.format_bytes(case["peak_bytes"])
            base_ok = base and "error" not in base
            peak_ratio = f"{case['peak_bytes'] / base['peak_bytes']:.3f}x" if base_ok else "-"
        else:
            peak, peak_ratio = "-", "-"
        base_times = {tuple(p["profile"]): p["time_s"] for p in (base or {}).get(
            "profile_results", [])}
        measured = case.get("profile_results") or [{"profile": case["profiles"][0]}]
        for p in measured:
            key = (case["tokens"], tuple(p["profile"]))
            name = skew.SkewProfile(*p["profile"]).name
            if "time_s" not in p:
                rows.append([case["tokens"], name, _label(case), plan, plan_ratio, peak,
                             peak_ratio, "-", "-"])
                continue
            losses.setdefault(key, []).append(p["loss"])
            base_time = base_times.get(tuple(p["profile"]))
            time_ratio = f"{p['time_s'] / base_time:.3f}x" if base_time else "-"
            rows.append([case["tokens"], name, _label(case), plan, plan_ratio, peak, peak_ratio,
                         f"{p['time_s'] * 1e3:.1f} ms", time_ratio])
    headers = ["N/rank", "profile", "method", "XLA plan (args+temp+out)", "vs LLEP",
               "peak (allocator)", "vs LLEP", "fwd+bwd", "vs LLEP"]
    spread = max((max(v) - min(v)) / max(abs(max(v)), 1e-30)
                 for v in losses.values() if v) if losses else 0.0
    return (f"{record['benchmark']} on {record['device']}, {record['date']}\n"
            + harness.format_table(headers, rows)
            + f"\nlargest relative spread of one profile's loss over the methods: {spread:.2e}")


if __name__ == "__main__" and "--case" in sys.argv:
    harness.case_main(run_case)
