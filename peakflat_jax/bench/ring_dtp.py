"""Benchmark of Ring-DTP against the materialized vocab-parallel loss (and, on one device, a
blockwise token-chunked loss): peak memory and forward+backward time, each case in a fresh
process.

    peakflat bench ring_dtp --preset gpu     # the paper's H = 7168, V = 200,000, fp32
    peakflat bench ring_dtp --preset gpu --only fused_one_gpu    # issue 18, one H200
    peakflat bench ring_dtp --preset gpu --only fused_two_gpus   # issue 18, two H200s
    python -m peakflat_jax.bench.ring_dtp --case '{...}'   # one case (used by the suite)

Every rank holds its own N tokens; the loss is the mean over all tokens; time is the median of
``repeats`` calls of the jitted value_and_grad w.r.t. hidden and kernel after a warm-up.
Methods: ``materialized`` (``reference.materialized_cross_entropy``), ``blockwise``, ``ring``
(today's per-token form, then ``.mean()``), and ``fused``: the reduced form,
``ring_cross_entropy(reduction="mean")`` with ``mode`` (default ``gather_kernel``; at P = 1 the
one-pass path). ``dtype`` is that of hidden and kernel alike.
"""

from __future__ import annotations

import math
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from peakflat_jax import reference
from peakflat_jax.bench import harness
from peakflat_jax.ops.ring_cross_entropy import ring_cross_entropy

PAPER = dict(hidden=7168, vocab=200_000, dtype="float32")


def presets() -> dict[str, list[dict]]:
    gpu = []
    for tokens in (8192, 16384):  # one H200: a single-device chunked loss
        gpu += [dict(method="materialized", ring_size=1, tokens=tokens, **PAPER),
                dict(method="blockwise", ring_size=1, tokens=tokens, token_block=1024, **PAPER),
                dict(method="ring", ring_size=1, tokens=tokens, vocab_block=8192, **PAPER)]
    for tokens in (16384, 32768):  # two H200s
        gpu += [dict(method="materialized", ring_size=2, tokens=tokens, **PAPER),
                dict(method="ring", ring_size=2, tokens=tokens, mode="move_activations",
                     vocab_block=4096, **PAPER),
                dict(method="ring", ring_size=2, tokens=tokens, mode="move_weights",
                     vocab_block=4096, **PAPER)]
    # The whole shard as one strip: bounded by N x Vs, not by a block.
    gpu.append(dict(method="ring", ring_size=2, tokens=16384, mode="auto", **PAPER))
    gpu += fused_cases()
    small = dict(hidden=32, vocab=32_768, dtype="float32", repeats=3)
    cpu = [dict(method="materialized", ring_size=8, tokens=512, **small),
           dict(method="ring", ring_size=8, tokens=512, mode="auto", **small),
           dict(method="ring", ring_size=8, tokens=512, mode="auto", vocab_block=1024, **small),
           dict(method="fused", ring_size=8, tokens=512, token_block=128, **small),
           dict(method="materialized", ring_size=1, tokens=1024, **small),
           dict(method="blockwise", ring_size=1, tokens=1024, token_block=128, **small),
           dict(method="ring", ring_size=1, tokens=1024, vocab_block=2048, **small),
           dict(method="fused", ring_size=1, tokens=1024, token_block=256, **small)]
    # Eight H200s (issue 6): the paper's P = 8 table, tokens per rank.
    gpu_x8 = []
    for tokens in (16384, 32768):
        gpu_x8 += [dict(method="materialized", ring_size=8, tokens=tokens, **PAPER),
                   dict(method="ring", ring_size=8, tokens=tokens, mode="move_activations",
                        vocab_block=4096, **PAPER),
                   dict(method="ring", ring_size=8, tokens=tokens, mode="move_weights",
                        vocab_block=4096, **PAPER)]
    return {"gpu": gpu, "gpu-x8": gpu_x8, "cpu": cpu}


def fused_cases() -> list[dict]:
    """Issue 18: the mean loss in one pass (3 matmul units) against the materialized loss and
    today's per-token ring, in fp32 and with bf16 inputs. Two groups, one per machine kind
    (``--only fused_one_gpu``, ``--only fused_two_gpus``), 5 timed steps each."""
    cases = []

    def add(group, dtype, **case):
        cases.append(dict(PAPER, group=group, repeats=5, **case, dtype=dtype))

    for dtype in ("float32", "bfloat16"):  # one H200: targets at N = 16,384
        for tokens in (8192, 16384):
            add("fused_one_gpu", dtype, method="materialized", ring_size=1, tokens=tokens)
            add("fused_one_gpu", dtype, method="fused", ring_size=1, tokens=tokens,
                token_block=2048)
        add("fused_one_gpu", dtype, method="ring", ring_size=1, tokens=16384, vocab_block=8192)
    add("fused_one_gpu", "float32", method="fused", ring_size=1, tokens=16384, token_block=4096)
    for tokens in (16384, 32768):  # two H200s, tokens per rank: the gathered head
        add("fused_two_gpus", "float32", method="materialized", ring_size=2, tokens=tokens)
        add("fused_two_gpus", "float32", method="ring", ring_size=2, tokens=tokens,
            mode="move_activations", vocab_block=4096)
        add("fused_two_gpus", "float32", method="fused", ring_size=2, tokens=tokens,
            token_block=2048)
        add("fused_two_gpus", "bfloat16", method="materialized", ring_size=2, tokens=tokens)
        add("fused_two_gpus", "bfloat16", method="fused", ring_size=2, tokens=tokens,
            token_block=2048)
    add("fused_two_gpus", "bfloat16", method="ring", ring_size=2, tokens=16384,
        mode="move_activations", vocab_block=4096)
    return cases


def blockwise_cross_entropy(hidden, kernel, targets, *, token_block: int):
    """A single-device loss that materializes [token_block, V] logits per chunk of tokens, each
    chunk checkpointed: the usual way to bound the loss on one device."""
    num_tokens, width = hidden.shape
    if num_tokens % token_block:
        raise ValueError(f"token_block: expected a divisor of N={num_tokens}, got {token_block}")
    chunk_loss = jax.checkpoint(lambda x, t: reference.cross_entropy(x, kernel, t))
    losses = lax.map(lambda xt: chunk_loss(*xt),
                     (hidden.reshape(-1, token_block, width), targets.reshape(-1, token_block)))
    return losses.reshape(num_tokens)


def _per_shard_loss(case: dict):
    vocab = case["vocab"]
    if case["method"] == "materialized":
        return lambda x, w, t: reference.materialized_cross_entropy(
            x, w, t, axis_name="vocab", vocab_size=vocab)
    if case["method"] == "blockwise":
        if case["ring_size"] != 1:
            raise ValueError("method: blockwise runs on one device (ring_size=1)")
        return lambda x, w, t: blockwise_cross_entropy(
            x, w[:, :vocab], t, token_block=case["token_block"])
    if case["method"] == "ring":
        return lambda x, w, t: ring_cross_entropy(
            x, w, t, axis_name="vocab", vocab_size=vocab, mode=case.get("mode", "auto"),
            vocab_block=case.get("vocab_block"))
    if case["method"] == "fused":
        return lambda x, w, t: ring_cross_entropy(
            x, w, t, axis_name="vocab", vocab_size=vocab, reduction="mean",
            mode=case.get("mode", "gather_kernel"), token_block=case.get("token_block"))
    raise ValueError(f"method: expected materialized, blockwise, ring or fused, got "
                     f"{case['method']!r}")


def _random_inputs(case: dict, mesh: Mesh):
    """Inputs drawn on the devices themselves (the kernel alone is 5.7 GB at paper size)."""
    ring_size, tokens, hidden = case["ring_size"], case["tokens"], case["hidden"]
    shard_width = math.ceil(case["vocab"] / ring_size)
    dtype = jnp.dtype(case["dtype"])
    token_sharding = NamedSharding(mesh, P("vocab"))
    kernel_sharding = NamedSharding(mesh, P(None, "vocab"))

    def draw(key):
        kx, kw, kt = jax.random.split(key, 3)
        x = jax.random.normal(kx, (ring_size * tokens, hidden), dtype)
        w = jax.random.normal(kw, (hidden, ring_size * shard_width), dtype) / math.sqrt(hidden)
        t = jax.random.randint(kt, (ring_size * tokens,), 0, case["vocab"], jnp.int32)
        return x, w, t

    draw = jax.jit(draw, out_shardings=(token_sharding, kernel_sharding, token_sharding))
    return draw(jax.random.key(case.get("seed", 0)))


def run_case(case: dict) -> dict:
    devices = jax.devices()[: case["ring_size"]]
    if len(devices) < case["ring_size"]:
        return {"error": f"needs {case['ring_size']} devices, found {len(devices)}"}
    mesh = Mesh(np.array(devices), ("vocab",))
    reduced = case["method"] == "fused"  # one scalar, the mean; the others are per token
    loss_fn = jax.shard_map(_per_shard_loss(case), mesh=mesh,
                            in_specs=(P("vocab"), P(None, "vocab"), P("vocab")),
                            out_specs=P() if reduced else P("vocab"))
    x, w, t = _random_inputs(case, mesh)
    step = jax.jit(jax.value_and_grad(
        (lambda x, w, t: loss_fn(x, w, t)) if reduced
        else (lambda x, w, t: loss_fn(x, w, t).mean()), argnums=(0, 1)))
    start = time.perf_counter()
    compiled = step.lower(x, w, t).compile()
    compile_s = time.perf_counter() - start
    measured = harness.measure_compiled(compiled, (x, w, t), devices, case)
    loss, (dx, dw) = compiled(x, w, t)
    return {
        **measured, "compile_s": compile_s,
        # Checksums to compare methods: all compute the same function.
        "loss": float(loss),
        "grad_hidden_norm": float(jnp.linalg.norm(dx.astype(jnp.float32))),
        "grad_kernel_norm": float(jnp.linalg.norm(dw.astype(jnp.float32))),
    }


def _label(case: dict) -> str:
    if case["method"] == "ring":
        block = case.get("vocab_block")
        return f"ring {case.get('mode', 'auto')}" + (f" B={block}" if block else "")
    if case["method"] == "blockwise":
        return f"blockwise c={case['token_block']}"
    if case["method"] == "fused":
        mode = "one pass" if case["ring_size"] == 1 else case.get("mode", "gather_kernel")
        return f"mean {mode}" + (f" T={case['token_block']}" if case.get("token_block") else "")
    return "materialized"


def summarize(record: dict) -> str:
    """A table with each case's ratios to the materialized baseline of the same P, N and
    dtype."""
    def key(case):
        return case["ring_size"], case["tokens"], case["dtype"]

    baselines = {key(c): c for c in record["cases"]
                 if c["method"] == "materialized" and "error" not in c}
    rows = []
    for case in record["cases"]:
        base = baselines.get(key(case))
        dtype = {"float32": "fp32", "bfloat16": "bf16"}.get(case["dtype"], case["dtype"])
        if "error" in case:
            rows.append([case["ring_size"], case["tokens"], dtype, _label(case),
                         "OOM" if case.get("oom") else "error", "-", "-", "-", "-", "-"])
            continue
        memory_key = "peak_bytes" if case.get("peak_bytes") is not None else "xla_temp_bytes"
        ratio = lambda key: (f"{case[key] / base[key]:.3f}x"  # noqa: E731
                             if base and base.get(key) else "-")
        loss_delta = f"{abs(case['loss'] - base['loss']) / abs(base['loss']):.1e}" if base else "-"
        rows.append([case["ring_size"], case["tokens"], dtype, _label(case),
                     harness.format_bytes(case[memory_key]), ratio(memory_key),
                     f"{case['time_s'] * 1e3:.1f} ms", ratio("time_s"), loss_delta,
                     case["largest_array"]])
    memory_label = ("peak (allocator)" if any(c.get("peak_bytes") for c in record["cases"])
                    else "XLA temp (CPU plan)")
    headers = ["P", "N/rank", "dtype", "method", memory_label, "mem ratio", "fwd+bwd",
               "time ratio", "rel. loss diff", "largest HLO value"]
    return (f"{record['benchmark']} on {record['device']}, {record['date']}\n"
            + harness.format_table(headers, rows))


if __name__ == "__main__" and "--case" in sys.argv:
    harness.case_main(run_case)
