"""Probe (Hopper GPU): the Mosaic grouped matmul's numbers and speed at one device's expert shape.

M = 65536 rows, K = H = 7168, N = F = 2048, G = E/E_p = 64 experts (E = 128 over 2 devices), bf16,
with uniform, skewed (one group holds half the rows) and padded (sum(group_sizes) < M, empty
groups) group sizes:

- exactness of ``grouped_matmul(implementation="mosaic")``: the output, dx and dW of
  sum(out * ct) against fp32 products (precision HIGHEST) of the same bf16 inputs, group by group
  (lax.ragged_dot itself would build a [M, G*K] operand here); max error relative to the largest
  entry, bound 2e-2 (bf16 rounding), and exact zeros in the padded rows of out and dx and in the
  dW of empty groups. At a small shape, also against lax.ragged_dot itself and its VJP (the
  smaller blocks (64, 64, 32) tried there on 2026-11-30 failed to lower in Mosaic, so
  ``grouped_matmul`` offers no smaller blocks and this probe no longer tries them);
- time of forward and of forward+backward (jax.value_and_grad of sum(out * ct)) against a dense
  batched matmul of equal FLOPs ([G, M/G, K] x [G, K, N], bf16 in, fp32 out, jnp.einsum),
  TFLOP/s and the ratio Mosaic / dense (target >= 0.85);
- each kernel alone, and a few alternative blocks for each kernel.

Each measurement that fails is recorded (error and message) and the rest go on; the record is
rewritten after each, to ``<out-dir>/grouped_matmul_probe_<date>.json``. Exit status 1 when a
check failed or a measurement broke.

    PYTHONPATH=. python3 scripts/probe_grouped_matmul.py --out-dir DIR [--no-sweep]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import pathlib
import platform
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from peakflat_jax.bench import harness
from peakflat_jax.ops import grouped_matmul as gm

M, K, N, G = 65536, 7168, 2048, 64
DTYPE = jnp.bfloat16
BOUND = 2e-2  # relative to the largest entry: bf16 rounding of out, dy, dx and dW
SMALL = dict(m=4096, k=1024, n=512, sizes=(1000, 0, 37, 2000, 500, 11, 300, 100))
SWEEP = {
    # The forward kernel alone ran at 0.82x the dense matmul with the preferred blocks.
    "forward": [gm.BlockConfig(128, 256, 64, 4, 4), gm.BlockConfig(128, 128, 64, 4, 8),
                gm.BlockConfig(128, 128, 128, 3, 4)],
    "input_grad": [gm.BlockConfig(128, 128, 64, 4, 8), gm.BlockConfig(128, 128, 64, 6, 1)],
    "weight_grad": [gm.BlockConfig(128, 128, 128, 3, 4), gm.BlockConfig(128, 128, 128, 2, 4),
                    gm.BlockConfig(128, 128, 64, 4, 8)],
}


def group_cases() -> dict[str, np.ndarray]:
    uniform = np.full(G, M // G)
    skewed = np.zeros(G, np.int64)  # group 7 holds half the rows; the others share the rest
    skewed[7] = M // 2
    others = np.delete(np.arange(G), 7)
    skewed[others] = (M - M // 2) // (G - 1)  # 520 rows: few groups start on a 64-row boundary
    skewed[others[: (M - M // 2) % (G - 1)]] += 1
    padded = np.full(G, 1000)  # sum 61517: 4019 padded rows, two empty groups
    padded[[3, 50]] = 0
    padded[10] = 517
    cases = {"uniform": uniform, "skewed": skewed, "padded": padded}
    assert sum(uniform) == sum(skewed) == M and sum(padded) < M
    return {name: sizes.astype(np.int32) for name, sizes in cases.items()}


class Probe:
    """Holds the record, writes it after each step, and keeps one failure from losing the rest."""

    def __init__(self, out_dir: pathlib.Path, budget_s: float):
        now = datetime.datetime.now(datetime.timezone.utc)
        self.start, self.budget_s = time.perf_counter(), budget_s
        self.record = {
            "probe": "grouped_matmul", "command": " ".join([sys.executable, *sys.argv]),
            "device": jax.devices()[0].device_kind, "backend": jax.default_backend(),
            "date": now.isoformat(timespec="seconds"), "jax": jax.__version__,
            "python": platform.python_version(), "commit": harness.git_commit(),
            "shape": dict(M=M, K=K, N=N, G=G, dtype=jnp.dtype(DTYPE).name),
            "bound": BOUND, "results": {}, "failed": [],
        }
        out_dir.mkdir(parents=True, exist_ok=True)
        self.path = out_dir / f"grouped_matmul_probe_{now:%Y%m%d-%H%M%S}.json"

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def write(self):
        self.record["elapsed_s"] = round(self.elapsed(), 1)
        self.path.write_text(json.dumps(self.record, indent=1, default=str) + "\n")

    def step(self, name: str, fn, *, optional: bool = False, critical: bool = True):
        """Runs ``fn() -> dict`` and records its result under ``name``, or its error. A failed
        check or an error of a critical step makes the exit status 1; a sweep's (blocks that do
        not fit in shared memory, say) is only recorded."""
        if optional and self.elapsed() > self.budget_s:
            self.record["results"][name] = {"skipped": f"past the {self.budget_s:.0f} s budget"}
            self.write()
            return None
        print(f"[{self.elapsed():6.1f} s] {name}", file=sys.stderr, flush=True)
        started = time.perf_counter()
        try:
            result = fn()
        except Exception as error:  # one failure is a result; the other measurements go on
            result = {"error": type(error).__name__, "message": str(error)[:3000],
                      "traceback": traceback.format_exc()[-3000:]}
            if critical:
                self.record["failed"].append(name)
            print(f"  FAILED: {type(error).__name__}: {str(error)[:500]}", file=sys.stderr)
        else:
            if result.get("ok") is False:
                self.record["failed"].append(name)
        result["step_s"] = round(time.perf_counter() - started, 1)
        self.record["results"][name] = result
        self.write()
        return result


def timing(fn, *args) -> float:
    return harness.time_call(fn, *args, warmup=2, repeats=10)["median_s"]


def tflops(flops: float, seconds: float) -> float:
    return round(flops / seconds / 1e12, 1)


# ----------------------------------------------------------------------------------------------
# Exactness.


@functools.partial(jax.jit, static_argnames="size")
def _group_errors(x, w, ct, out, dx, dw, start, g, *, size):
    """Max |error| and max |reference| of out, dx and dW over one group of ``size`` rows."""
    hi = lax.Precision.HIGHEST
    xs = lax.dynamic_slice_in_dim(x, start, size).astype(jnp.float32)
    cts = lax.dynamic_slice_in_dim(ct, start, size)
    wg = w[g].astype(jnp.float32)
    pairs = [(lax.dynamic_slice_in_dim(out, start, size), jnp.dot(xs, wg, precision=hi)),
             (lax.dynamic_slice_in_dim(dx, start, size), jnp.dot(cts, wg.T, precision=hi)),
             (dw[g], jnp.dot(xs.T, cts, precision=hi))]
    return jnp.stack([v for got, ref in pairs
                      for v in (jnp.max(jnp.abs(got.astype(jnp.float32) - ref)),
                                jnp.max(jnp.abs(ref)))])


def exactness(x, w, ct, sizes, out, dx, dw) -> dict:
    errors = np.zeros(3)
    scales = np.zeros(3)
    empty_dw = 0.0
    start = 0
    for g, size in enumerate(sizes.tolist()):
        if size == 0:
            empty_dw = max(empty_dw, float(jnp.max(jnp.abs(dw[g].astype(jnp.float32)))))
            continue
        stats = np.asarray(_group_errors(x, w, ct, out, dx, dw, start, g, size=size))
        errors, scales = np.maximum(errors, stats[0::2]), np.maximum(scales, stats[1::2])
        start += size
    relative = errors / np.where(scales > 0, scales, 1.0)
    total = int(sizes.sum())
    padded = {"out_padded_max_abs": float(jnp.max(jnp.abs(out[total:]))) if total < M else 0.0,
              "dx_padded_max_abs": float(jnp.max(jnp.abs(dx[total:].astype(jnp.float32))))
              if total < M else 0.0,
              "dw_empty_groups_max_abs": empty_dw}
    result = {"rel_err_out": float(relative[0]), "rel_err_dx": float(relative[1]),
              "rel_err_dw": float(relative[2]), **padded}
    # "not <" so that a NaN fails
    result["ok"] = bool(all(not (r >= BOUND) and np.isfinite(r) for r in relative)
                        and not any(padded.values()))
    return result


def small_against_ragged_dot(configs: gm.MosaicConfigs) -> dict:
    """A shape where lax.ragged_dot fits: the Mosaic VJP against it (fp32, HIGHEST)."""
    m, k, n, sizes = SMALL["m"], SMALL["k"], SMALL["n"], np.asarray(SMALL["sizes"], np.int32)
    keys = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(keys[0], (m, k), DTYPE)
    w = (jax.random.normal(keys[1], (len(sizes), k, n)) / np.sqrt(k)).astype(DTYPE)
    ct = jax.random.normal(keys[2], (m, n), jnp.float32)
    group_sizes = jnp.asarray(sizes)

    def with_vjp(fn, x, w, ct):
        out, vjp = jax.vjp(lambda x, w: fn(x, w, group_sizes), x, w)
        return (out, *vjp(ct))

    mosaic = jax.jit(functools.partial(with_vjp, gm.build_grouped_matmul(gm.mosaic_kernels(
        configs))))
    reference = jax.jit(functools.partial(with_vjp, lambda x, w, s: lax.ragged_dot(
        x, w, s, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)))
    got = mosaic(x, w, ct)
    expected = reference(x.astype(jnp.float32), w.astype(jnp.float32), ct)
    result = {"configs": dataclasses.asdict(configs), "sizes": sizes.tolist()}
    for name, a, e in zip(("out", "dx", "dw"), got, expected):
        a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
        result[f"rel_err_{name}"] = float(np.abs(a - e).max() / np.abs(e).max())
    total = int(sizes.sum())
    result["padded_rows_zero"] = bool(not np.any(np.asarray(got[0])[total:])
                                      and not np.any(np.asarray(got[1], np.float32)[total:]))
    result["ok"] = bool(result["padded_rows_zero"] and all(
        result[f"rel_err_{name}"] < BOUND for name in ("out", "dx", "dw")))
    return result


# ----------------------------------------------------------------------------------------------
# Speed.


def dense_baseline(x, w, ct) -> dict:
    xb, ctb = x.reshape(G, M // G, K), ct.reshape(G, M // G, N)

    def dense(xb, w):
        return jnp.einsum("gmk,gkn->gmn", xb, w, preferred_element_type=jnp.float32)

    forward = jax.jit(dense)
    both = jax.jit(jax.value_and_grad(lambda xb, w, ctb: jnp.sum(dense(xb, w) * ctb),
                                      argnums=(0, 1)))
    flops = 2 * M * K * N
    fwd_s, both_s = timing(forward, xb, w), timing(both, xb, w, ctb)
    return {"flops": flops, "fwd_ms": 1e3 * fwd_s, "fwd_tflops": tflops(flops, fwd_s),
            "fwd_bwd_ms": 1e3 * both_s, "fwd_bwd_tflops": tflops(3 * flops, both_s)}


def kernel_alone(kernel: str, config: gm.BlockConfig, x, w, dy, cases) -> dict:
    """One Mosaic kernel with the given blocks, without the masks and casts around it."""
    configs = dataclasses.replace(gm.PREFERRED, **{kernel: config})
    kernels = gm.mosaic_kernels(configs)
    fn, args = {"forward": (kernels.forward, (x, w)), "input_grad": (kernels.input_grad, (dy, w)),
                "weight_grad": (kernels.weight_grad, (x, dy))}[kernel]
    fn = jax.jit(fn)
    result = {"config": dataclasses.asdict(config)}
    for name in ("uniform", "skewed"):
        seconds = timing(fn, *args, jnp.asarray(cases[name]))
        result[f"{name}_ms"] = 1e3 * seconds
        result[f"{name}_tflops"] = tflops(2 * M * K * N, seconds)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out-dir", type=pathlib.Path, default=harness.RESULTS_DIR)
    parser.add_argument("--no-sweep", action="store_true", help="skip the backward blocks sweep")
    parser.add_argument("--budget-s", type=float, default=150,
                        help="skip the optional steps (small checks, sweep) past this many s")
    args = parser.parse_args()
    reason = gm.hopper_gpu_reason(jax.devices()[0])
    if reason:
        print(f"probe_grouped_matmul needs a Hopper GPU: {reason}", file=sys.stderr)
        return 2
    probe = Probe(args.out_dir, args.budget_s)
    configs = gm.mosaic_block_configs(M, K, N, DTYPE, DTYPE)
    probe.record["configs"] = dataclasses.asdict(configs)
    cases = group_cases()
    probe.record["group_cases"] = {name: {"total_rows": int(s.sum()), "sizes": s.tolist()}
                                   for name, s in cases.items()}
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (M, K), DTYPE)
    w = (jax.random.normal(keys[1], (G, K, N)) / np.sqrt(K)).astype(DTYPE)
    ct = jax.random.normal(keys[2], (M, N), jnp.float32)

    mosaic = functools.partial(gm.grouped_matmul, implementation="mosaic")
    forward = jax.jit(mosaic)
    both = jax.jit(jax.value_and_grad(lambda x, w, s, ct: jnp.sum(mosaic(x, w, s) * ct),
                                      argnums=(0, 1)))

    for name, sizes in cases.items():
        def check(sizes=sizes):
            group_sizes = jnp.asarray(sizes)
            out = forward(x, w, group_sizes)
            _, (dx, dw) = both(x, w, group_sizes, ct)
            return exactness(x, w, ct, sizes, out, dx, dw)
        probe.step(f"exact/{name}", check)

    for name, sizes in cases.items():
        def speed(sizes=sizes):
            group_sizes, flops = jnp.asarray(sizes), 2 * int(sizes.sum()) * K * N
            fwd_s, both_s = timing(forward, x, w, group_sizes), timing(both, x, w, group_sizes,
                                                                       ct)
            return {"flops": flops, "fwd_ms": 1e3 * fwd_s, "fwd_tflops": tflops(flops, fwd_s),
                    "fwd_bwd_ms": 1e3 * both_s, "fwd_bwd_tflops": tflops(3 * flops, both_s)}
        probe.step(f"time/mosaic/{name}", speed)
    dense = probe.step("time/dense", lambda: dense_baseline(x, w, ct))
    for name in ("uniform", "skewed", "padded"):  # throughput ratios, FLOPs per second
        mosaic_result = probe.record["results"].get(f"time/mosaic/{name}", {})
        if dense and "error" not in dense and "fwd_ms" in mosaic_result:
            for phase in ("fwd", "fwd_bwd"):
                mosaic_result[f"{phase}_ratio_to_dense"] = round(
                    (mosaic_result["flops"] / mosaic_result[f"{phase}_ms"])
                    / (dense["flops"] / dense[f"{phase}_ms"]), 3)
    probe.write()

    dy = ct.astype(DTYPE)
    probe.step("kernel/forward", lambda: kernel_alone("forward", configs.forward, x, w, dy,
                                                      cases))
    for kernel in ("input_grad", "weight_grad"):
        probe.step(f"kernel/{kernel}", lambda kernel=kernel: kernel_alone(
            kernel, getattr(configs, kernel), x, w, dy, cases))
    small_configs = gm.mosaic_block_configs(SMALL["m"], SMALL["k"], SMALL["n"], DTYPE, DTYPE)
    probe.step("small/preferred", lambda: small_against_ragged_dot(small_configs),
               optional=True)
    if not args.no_sweep:
        for kernel, alternatives in SWEEP.items():
            for i, config in enumerate(alternatives):
                probe.step(f"sweep/{kernel}/{i}", lambda kernel=kernel, config=config:
                           kernel_alone(kernel, config, x, w, dy, cases), optional=True,
                           critical=False)

    print_table(probe.record)
    print(f"record: {probe.path}  ({probe.elapsed():.0f} s)")
    if probe.record["failed"]:
        print(f"FAILED: {probe.record['failed']}")
        return 1
    return 0


def print_table(record: dict) -> None:
    rows = []
    for name, r in record["results"].items():
        if "error" in r or "skipped" in r:
            rows.append([name, r.get("error") or "skipped", str(r.get("message", r.get(
                "skipped")))[:80]])
        elif name.startswith(("exact", "small")):
            rows.append([name, "ok" if r["ok"] else "FAIL", " ".join(
                f"{k}={r[k]:.2e}" for k in ("rel_err_out", "rel_err_dx", "rel_err_dw"))])
        elif name.startswith("time"):
            rows.append([name, f"{r['fwd_tflops']} / {r['fwd_bwd_tflops']} TFLOP/s",
                         f"fwd {r['fwd_ms']:.2f} ms, fwd+bwd {r['fwd_bwd_ms']:.2f} ms; vs dense "
                         f"{r.get('fwd_ratio_to_dense', '-')} / "
                         f"{r.get('fwd_bwd_ratio_to_dense', '-')}"])
        else:
            c = r["config"]
            rows.append([name, f"{r['uniform_tflops']} / {r['skewed_tflops']} TFLOP/s",
                         f"uniform / skewed; blocks {c['block_m']}x{c['block_n']}x"
                         f"{c['block_k']}, {c['max_concurrent_steps']} stages, "
                         f"grid_block_n {c['grid_block_n']}"])
    print(harness.format_table(["step", "result", "detail"], rows))


if __name__ == "__main__":
    sys.exit(main())
