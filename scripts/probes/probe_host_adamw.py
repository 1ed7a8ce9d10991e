"""How long the host-CPU AdamW's update (``optimizer.update_on: host_cpu``,
``peakflat_jax.train.optimizer.HostCpuAdamW``) takes per parameter on this machine's CPU: the
rate the planner's step estimate prices the host-CPU baseline with
(``plan.rates.Rates.host_adamw_seconds_per_param``).

    PYTHONPATH=. python scripts/probes/probe_host_adamw.py [--sizes 4e6,1.6e7,6.4e7] \
        [--machine "what this machine is"] [--out-dir D]

What is timed: the compiled host update alone (global-norm clipping, AdamW with injected
hyperparameters, the working params cast), the gradients and state already in host memory, as
``HostCpuAdamW.step`` runs it between the two copies; each size in leaves of ``--leaf``
parameters, bf16 and fp32 working params, the median of ``--repeats`` calls after a warm-up.
The rate is the bf16 median at the largest size over its parameters (the GPU runs' working
dtype; the fixed cost per call is negligible there). The copies are not timed: on a GPU host
they cross the link (priced at ``Rates.host_link_bytes``), here they would be memory copies.

The machine is recorded with the numbers, and its load averages before and after (a shared
machine's other work slows the medians). The default rate was measured on the 2-core dev CPU
(no GPU), not on the GPU host, whose 16 cores ran optax.adamw about 3x faster per parameter
(docs/offload_adamw.md): rerun this there for a GPU plan's rate (``peakflat plan --rate``).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from peakflat_jax.bench import harness
from peakflat_jax.config import OptimizerConfig
from peakflat_jax.train.optimizer import HostCpuAdamW, hyperparams_at, with_hyperparams


def cpu_model() -> str:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def time_update(num_params: int, leaf: int, dtype, repeats: int) -> dict:
    optimizer = HostCpuAdamW(OptimizerConfig())  # clipping on (max_grad_norm 1.0)
    host = optimizer.host_sharding
    rng = np.random.default_rng(0)
    sizes = [leaf] * (num_params // leaf) + ([num_params % leaf] if num_params % leaf else [])
    params = {f"w{i}": jax.device_put(jnp.asarray(rng.standard_normal(n) * 0.02, dtype), host)
              for i, n in enumerate(sizes)}
    state = optimizer.init(params)
    state = with_hyperparams(state, hyperparams_at(OptimizerConfig(), lambda _: 1e-3, 0))
    grads_host = {k: np.asarray(jnp.asarray(rng.standard_normal(v.shape) * 1e-3, dtype))
                  for k, v in params.items()}  # numpy: each device_put below makes a new array
    started = time.perf_counter()
    optimizer.compile(params, state)
    compile_s = time.perf_counter() - started
    samples = []
    for i in range(repeats + 1):
        grads = jax.device_put(grads_host, host)  # donated: a fresh host copy per call
        jax.block_until_ready(grads)
        executable = optimizer._executable(grads, state)
        started = time.perf_counter()
        working, state = executable(grads, state)
        jax.block_until_ready((working, state))
        if i:  # the first call warms up
            samples.append(time.perf_counter() - started)
    median = statistics.median(samples)
    return {"num_params": num_params, "leaf_params": leaf, "dtype": jnp.dtype(dtype).name,
            "median_s": median, "min_s": min(samples), "max_s": max(samples),
            "repeats": repeats, "compile_s": compile_s,
            "seconds_per_param": median / num_params}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="4e6,1.6e7,6.4e7")
    parser.add_argument("--leaf", type=float, default=4e6)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--machine", default="",
                        help="what the machine is, recorded before its CPU count and model")
    parser.add_argument("--out-dir")
    args = parser.parse_args()
    sizes = [int(float(s)) for s in args.sizes.split(",")]
    load_before = os.getloadavg()  # a shared machine: what else ran, as the kernel counts it
    cases = []
    for dtype in (jnp.bfloat16, jnp.float32):
        for size in sizes:
            case = time_update(size, int(args.leaf), dtype, args.repeats)
            print(f"[host_adamw] {case}", file=sys.stderr, flush=True)
            cases.append(case)
    largest = max((c for c in cases if c["dtype"] == "bfloat16"), key=lambda c: c["num_params"])
    gpus = [d for d in jax.devices() if d.platform != "cpu"]
    machine = (f"{args.machine + ': ' if args.machine else ''}{os.cpu_count()} CPUs, "
               f"{cpu_model()}, {len(gpus)} GPUs")
    record = harness.new_record("host_adamw", machine=machine, cpu_count=os.cpu_count(),
                                cpu_model=cpu_model(), load_average_before=load_before,
                                load_average_after=os.getloadavg(), cases=cases,
                                seconds_per_param=largest["seconds_per_param"],
                                rate_from={"dtype": "bfloat16",
                                           "num_params": largest["num_params"]})
    path = harness.write_record(record, args.out_dir)
    print(f"{largest['seconds_per_param'] * 1e9:.3f} s per 1e9 parameters ({machine}); "
          f"record: {path}")


if __name__ == "__main__":
    main()
