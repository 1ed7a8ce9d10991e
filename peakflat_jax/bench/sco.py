"""Benchmark of SCO: a decoder-like stack (attention + MLP) with no, half and all checkpoint
boundaries in host memory, against the checkpointed ``lax.scan``; peak memory and step time,
each case in a fresh process.

    peakflat bench sco --preset gpu   # one H200: 24 layers, N = 65,536, H = 4096, bf16
    peakflat bench sco --preset cpu   # a small size, to check the harness
"""

from __future__ import annotations

import math
import sys

import jax
import jax.numpy as jnp

from peakflat_jax.bench import harness
from peakflat_jax.ops.sco import sco_scan


def presets() -> dict[str, list[dict]]:
    def cases(shape):
        layers = shape["layers"]
        return [dict(shape, method="scan"),
                *(dict(shape, method="sco", offload=n) for n in (0, layers // 2, layers)),
                dict(shape, method="sco", offload=layers, loop="unrolled")]

    return {"gpu": cases(dict(layers=24, tokens=65536, hidden=4096, heads=32, mlp=4,
                              dtype="bfloat16", repeats=3, attention="cudnn")),
            "cpu": cases(dict(layers=4, tokens=256, hidden=64, heads=4, mlp=4,
                              dtype="float32", repeats=3, attention="xla"))}


def _rms_norm(x):
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6)).astype(x.dtype)


def decoder_layer(case: dict):
    """Pre-norm causal self-attention and a GELU MLP, residual around each."""
    heads = case["heads"]

    def layer(h, p):
        tokens, hidden = h.shape
        qkv = _rms_norm(h) @ p["qkv"]
        q, k, v = (a.reshape(1, tokens, heads, hidden // heads) for a in jnp.split(qkv, 3, -1))
        implementation = None if case["attention"] == "xla" else case["attention"]
        attended = jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                implementation=implementation)
        h = h + attended.reshape(tokens, hidden) @ p["out"]
        return h + jax.nn.gelu(_rms_norm(h) @ p["up"]) @ p["down"]

    return layer


def run_case(case: dict) -> dict:
    device = jax.devices()[0]
    layers, tokens, hidden = case["layers"], case["tokens"], case["hidden"]
    dtype = jnp.dtype(case["dtype"])
    width = case["mlp"] * hidden

    def draw(key):
        k = jax.random.split(key, 5)
        scale = 1 / math.sqrt(hidden)
        return (jax.random.normal(k[0], (tokens, hidden), dtype),
                {"qkv": jax.random.normal(k[1], (layers, hidden, 3 * hidden), dtype) * scale,
                 "out": jax.random.normal(k[2], (layers, hidden, hidden), dtype) * scale,
                 "up": jax.random.normal(k[3], (layers, hidden, width), dtype) * scale,
                 "down": jax.random.normal(k[4], (layers, width, hidden), dtype)
                 / math.sqrt(width)})

    h, params = jax.jit(draw)(jax.random.key(0))
    layer = decoder_layer(case)
    if case["method"] == "scan":
        def stack(h, p):
            return jax.lax.scan(lambda h, p: (jax.checkpoint(layer)(h, p), None), h, p)[0]
    else:
        def stack(h, p):
            return sco_scan(layer, h, p, offload=case["offload"],
                            loop=case.get("loop", "scan"))

    step = jax.jit(jax.value_and_grad(
        lambda h, p: jnp.mean(stack(h, p).astype(jnp.float32) ** 2), argnums=(0, 1)))
    compiled = step.lower(h, params).compile()
    return {**harness.measure_compiled(compiled, (h, params), [device], case),
            "boundary_bytes": tokens * hidden * dtype.itemsize}


def summarize(record: dict) -> str:
    cases = record["cases"]
    base = next((c for c in cases if c["method"] == "scan" and "error" not in c), None)
    uses_peak = any(c.get("peak_bytes") for c in cases)
    memory_key = "peak_bytes" if uses_peak else "xla_temp_bytes"
    rows = []
    for case in cases:
        label = "checkpointed lax.scan" if case["method"] == "scan" else (
            f"sco_scan offload={case['offload']} ({case.get('loop', 'scan')})")
        if "error" in case:
            rows.append([label, "OOM" if case.get("oom") else "error", "-", "-", "-"])
            continue
        saved = (f"{(base[memory_key] - case[memory_key]) / case['boundary_bytes']:.1f}"
                 if base else "-")
        rows.append([label, harness.format_bytes(case[memory_key]), saved,
                     f"{case['time_s'] * 1e3:.1f} ms",
                     f"{case['time_s'] / base['time_s']:.3f}x" if base else "-"])
    headers = ["method", "peak (allocator)" if uses_peak else "XLA temp (plan)",
               "boundaries saved", "step", "vs scan"]
    return (f"{record['benchmark']} on {record['device']}, {record['date']}\n"
            + harness.format_table(headers, rows))


if __name__ == "__main__" and "--case" in sys.argv:
    harness.case_main(run_case)
