"""Benchmark of PipelinedLLEP against standard expert parallelism and unchunked LLEP over the
paper's routing skew profiles: memory and forward+backward time, each case in a fresh process.

    peakflat bench moe_dispatch --preset cpu   # XLA's memory plan at a small size, 8 CPU devices
    peakflat bench moe_dispatch --preset gpu   # the paper's shapes on two H200s (see below)

Methods: ``ep`` (balance none, one chunk), ``llep`` (LLEP, one chunk), ``pipelined`` (LLEP,
token_budget, strided or contiguous chunks). All compute the same function.

The gpu preset (65,536 tokens per rank, H = 7168, E = 128, top-8, F = 2048) needs the Mosaic GPU
grouped matmul: XLA's ragged_dot runs at 45 TFLOP/s there and materializes [M, M] temporaries
(JAX-NOTES.md), so with the portable path it is neither fast nor small. Its cases name the
Mosaic grouped matmul and the padded exchange (the ragged one stays off: expert_exchange).
Measured on 2 H200s: scripts/results/moe_dispatch_gpu_20261130-*.json and the README.
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
from peakflat_jax.ops import expert_exchange, grouped_matmul
from peakflat_jax.ops.pipelined_moe import pipelined_moe

METHODS = {  # label: pipelined_moe keywords (token_budget filled from the case)
    "ep": dict(balance="none"),
    "llep": dict(balance="llep"),
    "pipelined": dict(balance="llep"),
}


def presets() -> dict[str, list[dict]]:
    def cases(shape, profiles, tokens_list, budget):
        out = []
        for tokens in tokens_list:
            for profile in profiles:
                common = dict(shape, tokens=tokens, profile=[profile.hot_fraction,
                                                             profile.hot_experts])
                out += [dict(common, method="ep"), dict(common, method="llep"),
                        dict(common, method="pipelined", membership="strided",
                             token_budget=budget),
                        dict(common, method="pipelined", membership="contiguous",
                             token_budget=budget)]
        return out

    paper = dict(devices=2, experts=128, top_k=8, hidden=7168, ffn=2048, dtype="bfloat16",
                 llep_min_tokens=1024, grouped_matmul="mosaic", exchange="padded")
    small = dict(devices=8, experts=32, top_k=4, hidden=64, ffn=32, dtype="float32",
                 llep_min_tokens=64, repeats=3)
    cpu_profiles = [skew.PAPER_PROFILES[i] for i in (0, 1, 3)]
    return {"gpu": cases(paper, skew.PAPER_PROFILES, (65536, 32768), 6554),
            "gpu-x8": cases(dict(paper, devices=8), skew.PAPER_PROFILES, (65536,), 6554),
            "cpu": cases(small, cpu_profiles, (1024,), 128)}


def _inputs(case: dict, mesh: Mesh):
    devices, tokens, experts = case["devices"], case["tokens"], case["experts"]
    hidden, ffn, top_k = case["hidden"], case["ffn"], case["top_k"]
    dtype = jnp.dtype(case["dtype"])
    profile = skew.SkewProfile(*case["profile"])
    ids = np.concatenate([skew.route(tokens, top_k, experts, profile)] * devices)
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

    arrays = jax.jit(draw, out_shardings=(shard,) * 5)(jax.random.key(case.get("seed", 0)))
    return jax.device_put(jnp.asarray(ids), shard), arrays


def run_case(case: dict) -> dict:
    devices = jax.devices()[: case["devices"]]
    if len(devices) < case["devices"]:
        return {"error": f"needs {case['devices']} devices, found {len(devices)}"}
    mesh = Mesh(np.array(devices), ("expert",))
    # Each case names its grouped matmul and exchange; this process (one case) follows them.
    grouped_matmul.AUTO_SELECTS_MOSAIC = case.get("grouped_matmul") == "mosaic"
    expert_exchange.RAGGED_ON_GPU = case.get("exchange") == "ragged"
    keywords = dict(METHODS[case["method"]], llep_min_tokens=case["llep_min_tokens"])
    if case["method"] == "pipelined":
        keywords.update(token_budget=case["token_budget"], membership=case["membership"],
                        max_chunks=case.get("max_chunks", 10))
    layer = jax.shard_map(
        lambda x, ids, g, wg, wu, wd: pipelined_moe(
            x, ids, g, wg, wu, wd, axis_name="expert", num_experts=case["experts"], **keywords),
        mesh=mesh, in_specs=(P("expert"),) * 6, out_specs=P("expert"))
    ids, (x, gates, w_gate, w_up, w_down) = _inputs(case, mesh)

    def loss(x, gates, w_gate, w_up, w_down):
        return jnp.sum(layer(x, ids, gates, w_gate, w_up, w_down).astype(jnp.float32) ** 2)

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))
    args = (x, gates, w_gate, w_up, w_down)
    compiled = step.lower(*args).compile()
    measured = harness.measure_compiled(compiled, args, devices, case)
    value, grads = compiled(*args)
    return {
        **measured,
        "loss": float(value),
        "grad_x_norm": float(jnp.linalg.norm(grads[0].astype(jnp.float32))),
    }


def _label(case: dict) -> str:
    if case["method"] == "pipelined":
        return f"pipelined {case['membership']} c={case['token_budget']}"
    return {"ep": "standard EP", "llep": "LLEP, one chunk"}[case["method"]]


def summarize(record: dict) -> str:
    """Each case's memory and time, with ratios to unchunked LLEP on the same profile."""
    def key(c):
        return (c["tokens"], tuple(c["profile"]))

    baselines = {key(c): c for c in record["cases"] if c["method"] == "llep" and "error" not in c}
    uses_peak = any(c.get("peak_bytes") for c in record["cases"])
    memory_key = "peak_bytes" if uses_peak else "xla_temp_bytes"
    rows = []
    for case in record["cases"]:
        profile = skew.SkewProfile(*case["profile"]).name
        if "error" in case:
            rows.append([case["tokens"], profile, _label(case),
                         "OOM" if case.get("oom") else "error", "-", "-", "-"])
            continue
        base = baselines.get(key(case))
        ratio = lambda k: f"{case[k] / base[k]:.3f}x" if base and base.get(k) else "-"  # noqa
        rows.append([case["tokens"], profile, _label(case), harness.format_bytes(case[memory_key]),
                     ratio(memory_key), f"{case['time_s'] * 1e3:.1f} ms", ratio("time_s")])
    headers = ["N/rank", "profile", "method", "peak (allocator)" if uses_peak else
               "XLA temp (plan)", "vs LLEP", "fwd+bwd", "vs LLEP"]
    return (f"{record['benchmark']} on {record['device']}, {record['date']}\n"
            + harness.format_table(headers, rows))


if __name__ == "__main__" and "--case" in sys.argv:
    harness.case_main(run_case)
