"""The kernels both stacks lean on, checked and timed on this GPU before any comparison: the
grouped matmuls a MaxText user can choose for the experts (tokamax's Mosaic and Triton
implementations, and ``jax.lax.ragged_dot``, which XLA:GPU lowers densely unless
``--xla_gpu_experimental_use_ragged_dot_fusion=true``), values and both gradients against an
fp32 per-group reference; and cuDNN's causal flash attention at long context, forward and
forward + backward, which bounds either stack's MFU where attention is most of the FLOPs.

    python3 scripts/maxtext/check_kernels.py [--json OUT] [--attention-context 131072]
        [--attention-only]

Each grouped-matmul case is the h200-e2e expert shape (rows of H = 2048 -> F = 1536, 64 groups,
two of them empty), bf16 operands, fresh random inputs. The relative error is
||out - ref|| / ||ref|| (Frobenius); bf16 rounding of the output alone is ~3e-3. A gradient of an
empty group must be zero. Run it in its own process per XLA flag set: the ragged_dot fusion is
an XLA flag read at start (``--ragged-dot-fusion`` checks only that path, for a process started
with the flag).
"""

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

ROWS = int(os.environ.get("CHECK_ROWS", 65536))  # fewer to try the script on a CPU
K, N, GROUPS, EMPTY = 2048, 1536, 64, (3, 17)


def groups(rng) -> np.ndarray:
    sizes = rng.multinomial(ROWS, rng.dirichlet(np.ones(GROUPS)))
    sizes[list(EMPTY)] = 0
    sizes[0] += ROWS - sizes.sum()
    return sizes


def reference(lhs, rhs, sizes, cotangent):
    """Per-group fp32 matmuls (precision HIGHEST): the output and both gradients."""
    out, dlhs, drhs, start = [], [], [], 0
    for g, size in enumerate(sizes):
        rows = slice(start, start + int(size))
        x = lhs[rows].astype(jnp.float32)
        w = rhs[g].astype(jnp.float32)
        c = cotangent[rows]
        out.append(jnp.dot(x, w, precision="highest"))
        dlhs.append(jnp.dot(c, w.T, precision="highest"))
        drhs.append(jnp.dot(x.T, c, precision="highest"))
        start += int(size)
    return jnp.concatenate(out), jnp.concatenate(dlhs), jnp.stack(drhs)


def relative(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def timed(fn, *args, repeats=10) -> float:
    jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        jax.block_until_ready(fn(*args))
        samples.append(time.perf_counter() - started)
    return float(np.median(samples))


def stamp(what: str) -> None:
    """A progress line on stderr (a stage that times out says where it was)."""
    print(f"{time.strftime('%H:%M:%S')} {what}", file=sys.stderr, flush=True)


def grouped_matmul_cases(paths) -> list[dict]:
    rng = np.random.default_rng(int(time.time()))
    sizes = groups(rng)
    key = jax.random.PRNGKey(int(rng.integers(2**31)))
    k1, k2, k3 = jax.random.split(key, 3)
    lhs = jax.random.normal(k1, (ROWS, K), jnp.bfloat16)
    rhs = (jax.random.normal(k2, (GROUPS, K, N), jnp.float32) / np.sqrt(K)).astype(jnp.bfloat16)
    cotangent = jax.random.normal(k3, (ROWS, N), jnp.float32)
    sizes_j = jnp.asarray(sizes, jnp.int32)
    stamp("fp32 reference")
    ref = jax.block_until_ready(reference(lhs, rhs, sizes, cotangent))
    results = []
    for name, matmul in paths.items():
        def loss(x, w, matmul=matmul):
            out = matmul(x, w, sizes_j)
            return jnp.sum(out.astype(jnp.float32) * cotangent), out

        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
        stamp(name)
        try:
            (_, out), (dlhs, drhs) = jax.block_until_ready(step(lhs, rhs))
            seconds = timed(step, lhs, rhs)
            empty = float(jnp.max(jnp.abs(drhs[jnp.asarray(EMPTY)].astype(jnp.float32))))
            results.append({
                "path": name, "out": relative(out, ref[0]), "dlhs": relative(dlhs, ref[1]),
                "drhs": relative(drhs, ref[2]), "drhs_empty_groups_max": empty,
                "fwd_bwd_ms": seconds * 1e3,
                "tflops": 6 * ROWS * K * N / seconds / 1e12})
        except Exception as error:  # a path that does not run is a result
            results.append({"path": name, "error": f"{type(error).__name__}: {error}"[:1500]})
        print(json.dumps(results[-1]), flush=True)
    return results


def tokamax_paths() -> dict:
    from absl import flags

    flags.FLAGS(sys.argv[:1])  # tokamax reads absl flags on first use
    stamp("import tokamax")
    import tokamax

    def path(implementation):
        return lambda x, w, sizes: tokamax.ragged_dot(
            x, w, sizes, preferred_element_type=jnp.bfloat16, implementation=implementation)

    return {f"tokamax-{impl}": path(impl) for impl in ("mosaic", "triton")}


def ragged_dot_path() -> dict:
    return {"ragged_dot": lambda x, w, sizes: jax.lax.ragged_dot(
        x, w, sizes, preferred_element_type=jnp.bfloat16)}


def attention_case(context: int, heads: int = 16, kv_heads: int = 4, head_dim: int = 128) -> dict:
    """cuDNN causal attention, batch 1, bf16: forward, forward + backward, and a forward then
    forward + backward (a rematerialized layer's attention); model TFLOP/s of each, counting the
    causal half (4 T (T + 1) / 2 Hq D forward, 3x that with the backward)."""
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q = jax.random.normal(keys[0], (1, context, heads, head_dim), jnp.bfloat16)
    k = jax.random.normal(keys[1], (1, context, kv_heads, head_dim), jnp.bfloat16)
    v = jax.random.normal(keys[2], (1, context, kv_heads, head_dim), jnp.bfloat16)
    cotangent = jax.random.normal(keys[3], q.shape, jnp.bfloat16)

    def attend(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")

    def train(q, k, v):
        out, pullback = jax.vjp(attend, q, k, v)
        return pullback(cotangent)

    def remat_train(q, k, v):
        return jax.vjp(jax.checkpoint(attend), q, k, v)[1](cotangent)

    forward_flops = 4 * context * (context + 1) / 2 * heads * head_dim
    result = {"context": context, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim}
    stamp(f"attention at {context}")
    for name, fn, flops in (("forward", attend, forward_flops),
                            ("forward_backward", train, 3 * forward_flops),
                            ("recompute_forward_backward", remat_train, 3 * forward_flops)):
        seconds = timed(jax.jit(fn), q, k, v, repeats=5)
        result[f"{name}_ms"] = seconds * 1e3
        result[f"{name}_model_tflops"] = flops / seconds / 1e12
    print(json.dumps(result), flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--ragged-dot-fusion", action="store_true",
                        help="check jax.lax.ragged_dot only (start the process with the flag)")
    parser.add_argument("--attention-context", type=int, nargs="*", default=[])
    parser.add_argument("--attention-only", action="store_true",
                        help="time cuDNN's attention only (no grouped matmul)")
    args = parser.parse_args()
    record = {"device": jax.devices()[0].device_kind, "jax": jax.__version__}
    if args.attention_only:
        pass
    elif args.ragged_dot_fusion:
        record["grouped_matmul"] = grouped_matmul_cases(ragged_dot_path())
    else:
        paths = {}
        try:
            paths.update(tokamax_paths())
        except Exception as error:
            record["tokamax_import_error"] = f"{type(error).__name__}: {error}"[:1500]
        paths.update(ragged_dot_path())
        record["grouped_matmul"] = grouped_matmul_cases(paths)
        try:
            import tokamax
            record["tokamax"] = getattr(tokamax, "__version__", "?")
        except Exception:
            pass
    record["attention"] = [attention_case(c) for c in args.attention_context]
    if args.json:
        with open(args.json, "w") as out:
            json.dump(record, out, indent=1)


if __name__ == "__main__":
    main()
