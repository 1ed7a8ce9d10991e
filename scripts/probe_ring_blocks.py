"""Probe (GPU): the cost of Ring-DTP's vocab_block loop against the whole shard and the baseline.

Finished probe: ran at commit 04dfe65 (plus in-place gradient accumulation), record below,
summarized in docs/ring_cross_entropy.md. Kept for the record, not maintained: it replaces a
private function of the operator (``_fold_blocks``).

Recorded in scripts/results/ring_dtp_block_probe_20261130.json. It found that XLA merged
backward's strip matmul with forward's (now prevented by an optimization barrier), and that the
honest cost of the bounded loss is about 4/3 of the materialized one.

    PYTHONPATH=. python3 scripts/probe_ring_blocks.py
"""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from peakflat_jax import reference
from peakflat_jax.bench import harness
from peakflat_jax.ops import ring_cross_entropy as rce

TOKENS, HIDDEN, VOCAB = 8192, 7168, 200_000


def median_time(fn, *args):
    return harness.time_call(fn, *args, warmup=2, repeats=5)["median_s"]


def main():
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (TOKENS, HIDDEN))
    w = jax.random.normal(keys[1], (HIDDEN, VOCAB)) / math.sqrt(HIDDEN)
    t = jax.random.randint(keys[2], (TOKENS,), 0, VOCAB)
    mesh = Mesh(np.array(jax.devices()[:1]), ("vocab",))
    results = {}

    a = jax.random.normal(keys[0], (8192, 7168))
    b = jax.random.normal(keys[1], (7168, 8192))
    for precision in (None, "highest"):
        seconds = median_time(jax.jit(lambda a, b: jnp.dot(a, b, precision=precision)), a, b)
        results[f"gemm8192 {precision}"] = 2 * 8192 * 7168 * 8192 / seconds / 1e12
    seconds = median_time(jax.jit(jnp.dot), a, w)
    results["gemm 8192x7168x200000"] = 2 * 8192 * 7168 * VOCAB / seconds / 1e12

    def measure(name, per_shard):
        loss = jax.shard_map(per_shard, mesh=mesh, in_specs=(P("vocab"), P(None, "vocab"),
                                                             P("vocab")), out_specs=P("vocab"))
        both = jax.jit(jax.value_and_grad(lambda x, w: loss(x, w, t).mean(), argnums=(0, 1)))
        forward = jax.jit(lambda x, w: loss(x, w, t).mean())
        results[f"{name} fwd+bwd ms"] = 1e3 * median_time(both, x, w)
        results[f"{name} fwd ms"] = 1e3 * median_time(forward, x, w)
        print(name, results[f"{name} fwd+bwd ms"], results[f"{name} fwd ms"], flush=True)

    measure("materialized", lambda x, w, t: reference.materialized_cross_entropy(
        x, w, t, axis_name="vocab"))
    for block in (None, 8192, 25000, 50000):
        measure(f"ring B={block}", lambda x, w, t, block=block: rce.ring_cross_entropy(
            x, w, t, axis_name="vocab", vocab_block=block))

    def unrolled(ring, per_block, init):  # the same block loop, unrolled in Python
        for block in range(ring.num_blocks):
            init = per_block(block, init)
        return init

    rce._fold_blocks = unrolled
    measure("ring B=25000 unrolled", lambda x, w, t: rce.ring_cross_entropy(
        x, w, t, axis_name="vocab", vocab_block=25000))
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
