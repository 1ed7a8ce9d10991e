"""Benchmark of OffloadStreamAdamW: step time against AdamW on the host CPU, AdamW on device with
the whole state moved each step, and the link floor; device peak (staging), each case in a fresh
process.

    peakflat bench offload_adamw --preset gpu   # one H200, 2e9 params (bf16 on device)
    peakflat bench offload_adamw --preset cpu   # a small size, to check the harness

Methods:
- ``host_cpu``: optax.adamw on the jax CPU backend, state and params there (all cores).
- ``whole_state``: optax.adamw on the device, the fp32 state moved host -> device -> host whole
  inside one jitted step.
- ``stream``: pf.offload_stream_adamw over (bucket_params, slots).
- ``link``: the floor: 12 bytes/param each way, timed as one in-jit host -> device and one
  device -> host copy of that many bytes.
- ``duplex``: the same bytes each way as independent copies in one jitted program, to see
  whether XLA runs the two directions at once (the floor would halve) or one after the other.
- ``stream_shared``: ``processes`` workers at once, each a ``stream`` case on its own device
  (``CUDA_VISIBLE_DEVICES``, when the case says ``pin_gpus``) with its own host state, started
  together once all have compiled: the host link and memory shared as by 8 ranks of one node.
  The step time is the slowest worker's median; ``overlap`` is the share of the timed window
  during which all workers were timing.

The gpu-x8 preset (nvidia-h200-x8) runs 2e9 parameters in all: one worker with 2.5e8 alone,
then eight at once, and AdamW on the host CPU over all 2e9.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import optax
from jax.sharding import SingleDeviceSharding

from peakflat_jax import memory
from peakflat_jax.bench import harness
from peakflat_jax.optim import offload_adamw as offload


def presets() -> dict[str, list[dict]]:
    def cases(num_params, leaf_params, buckets, slots, repeats):
        common = dict(num_params=num_params, leaf_params=leaf_params, repeats=repeats)
        out = [dict(common, method="link"), dict(common, method="duplex"),
               dict(common, method="whole_state"),
               dict(common, method="host_cpu", repeats=3)]
        out += [dict(common, method="stream", bucket_params=b, slots=s)
                for b in buckets for s in slots]
        return out

    def shared(num_params, leaf_params, bucket_params, processes, pin_gpus):
        common = dict(num_params=num_params, leaf_params=leaf_params, repeats=5,
                      bucket_params=bucket_params, slots=2, pin_gpus=pin_gpus)
        return [dict(common, method="stream_shared", processes=p) for p in processes]

    per_gpu = 250_000_000  # 2e9 parameters over 8 ranks
    return {"gpu": cases(2_000_000_000, 100_000_000, (100_000_000, 250_000_000, 500_000_000),
                         (1, 2, 3), 5),
            "gpu-x8": [dict(num_params=8 * per_gpu, leaf_params=100_000_000, repeats=3,
                            method="host_cpu"),
                       *shared(per_gpu, 50_000_000, 62_500_000, (1, 8), True),
                       *shared(per_gpu, 50_000_000, 125_000_000, (1, 8), True)],
            "cpu": [*cases(2_000_000, 300_000, (500_000,), (1, 2), 3),
                    *shared(1_000_000, 200_000, 500_000, (2,), False)]}


def _params(case, device, dtype):
    num_leaves = case["num_params"] // case["leaf_params"]

    def draw(key):
        keys = jax.random.split(key, num_leaves)
        return [jax.random.normal(k, (case["leaf_params"],), dtype) * 0.02 for k in keys]

    return jax.jit(draw, out_shardings=SingleDeviceSharding(device))(jax.random.key(0))


def run_case(case: dict) -> dict:
    method = case["method"]
    if method == "stream_shared":  # before any backend starts: the workers need the devices
        return _shared_link(case)
    device = jax.devices()[0]
    extra = {}
    if method == "host_cpu":
        device = jax.devices("cpu")[0]
        params = _params(case, device, jnp.float32)
        opt = optax.adamw(1e-3, mu_dtype=jnp.float32)
        state = opt.init(params)
        grads = _params(case, device, jnp.float32)
        step = jax.jit(lambda g, s, p: _apply(opt, g, s, p), donate_argnums=(1, 2))
        args = [grads, state, params]
    elif method == "whole_state":
        params = _params(case, device, jnp.bfloat16)
        grads = _params(case, device, jnp.bfloat16)
        host = SingleDeviceSharding(device, memory_kind="pinned_host")
        opt = optax.adamw(1e-3, mu_dtype=jnp.float32)
        master = jax.jit(lambda p: [x.astype(jnp.float32) for x in p], out_shardings=host)(params)
        state = jax.jit(opt.init, out_shardings=host)(master)

        def whole(grads, state, master):
            state, master = jax.device_put((state, master), jax.memory.Space.Device)
            grads = [g.astype(jnp.float32) for g in grads]
            updates, state = opt.update(grads, state, master)
            master = optax.apply_updates(master, updates)
            working = [m.astype(jnp.bfloat16) for m in master]
            return working, jax.device_put((state, master), jax.memory.Space.Host)

        device_sharding = SingleDeviceSharding(device)
        jitted = jax.jit(whole, donate_argnums=(1, 2),
                         out_shardings=(device_sharding, (host, host)))

        def step(grads, state, master):
            working, (state, master) = jitted(grads, state, master)
            return working, state, master

        args = [grads, state, master]
    elif method == "stream":
        params = _params(case, device, jnp.bfloat16)
        grads = _params(case, device, jnp.bfloat16)
        opt = offload.offload_stream_adamw(1e-3, bucket_params=case["bucket_params"],
                                           slots=case["slots"])
        state = jax.block_until_ready(opt.init(params))
        # The allocator's peak never resets: what init reached is read here, so that a larger
        # final peak can be told apart as the step's.
        extra["peak_after_init_bytes"] = harness.peak_bytes_over([device])
        plan = memory.compiled_memory(opt.lower(grads, state).compile())
        extra["step_xla_temp_bytes"] = plan.temp
        terms = offload.offload_stream_adamw_memory_terms(
            case["num_params"], case["bucket_params"], case["slots"], jnp.bfloat16)
        extra["staging_bound_bytes"] = terms["staging"] + terms["staging_gpu_excess"]

        def step(grads, state, _):
            params, state = opt.step(grads, state)
            return params, state, None

        args = [grads, state, None]
    elif method in ("link", "duplex"):
        host = SingleDeviceSharding(device, memory_kind="pinned_host")
        elements = 12 * case["num_params"] // 4  # fp32, in arrays of at most 2**28
        sizes = [1 << 28] * (elements >> 28) + ([elements % (1 << 28)] if elements % (1 << 28)
                                                 else [])
        arrays = jax.jit(lambda: [jnp.ones((size,), jnp.float32) for size in sizes],
                         out_shardings=host)()
        if method == "duplex":
            resident = jax.jit(lambda a: jax.device_put(a, jax.memory.Space.Device))(arrays)
            both_ways = jax.jit(lambda down, up: (jax.device_put(down, jax.memory.Space.Device),
                                                  jax.device_put(up, jax.memory.Space.Host)),
                                out_shardings=(None, host))
            return {**harness.time_fields(both_ways, (arrays, resident), dict(case, warmup=1)),
                    "peak_bytes": harness.peak_bytes_over([device])}
        to_device = jax.jit(lambda a: jax.device_put(a, jax.memory.Space.Device))
        on_device = to_device(arrays)
        to_host = jax.jit(lambda a: jax.device_put(a, jax.memory.Space.Host),
                          out_shardings=host)
        down = harness.time_call(to_device, arrays, warmup=1, repeats=case["repeats"])
        del on_device
        up = harness.time_call(lambda: to_host(to_device(arrays)), warmup=1,
                               repeats=case["repeats"])
        return {"host_to_device_s": down["median_s"], "round_trip_s": up["median_s"],
                "time_s": up["median_s"], "peak_bytes": harness.peak_bytes_over([device])}
    else:
        raise ValueError(f"method: unknown {method!r}")

    def run():
        nonlocal args
        out = step(*args)
        args = [args[0], out[1], out[2] if method != "host_cpu" else out[0]]
        return out

    jax.block_until_ready(run())  # compiles
    if RENDEZVOUS_ENV in os.environ:  # a stream_shared worker: start with the others
        _ready_then_wait_for_go(os.environ[RENDEZVOUS_ENV], os.environ[WORKER_ENV])
        extra["timed_from"] = time.time()
    timing = harness.time_fields(run, (), dict(case, warmup=0))
    if RENDEZVOUS_ENV in os.environ:
        extra["timed_to"] = time.time()
    return {**extra, **timing,
            "peak_bytes": harness.peak_bytes_over([device]) if device.platform != "cpu"
            else None}


RENDEZVOUS_ENV, WORKER_ENV = "PEAKFLAT_RENDEZVOUS", "PEAKFLAT_WORKER"


def _shared_link(case: dict) -> dict:
    """``processes`` stream workers at once, one per device, each in its own process."""
    processes = case["processes"]
    worker_case = {key: value for key, value in case.items()
                   if key not in ("processes", "pin_gpus")} | {"method": "stream"}
    with tempfile.TemporaryDirectory() as rendezvous:
        workers = []
        for index in range(processes):
            env = dict(os.environ, **{RENDEZVOUS_ENV: rendezvous, WORKER_ENV: str(index)})
            if case.get("pin_gpus"):
                env["CUDA_VISIBLE_DEVICES"] = str(index)
            workers.append(subprocess.Popen(
                [sys.executable, "-m", __spec__.name, "--case", json.dumps(worker_case)],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
        ready = [pathlib.Path(rendezvous, f"ready_{index}") for index in range(processes)]
        deadline = time.time() + 600
        while not all(path.exists() for path in ready):
            if time.time() > deadline or any(w.poll() is not None for w in workers):
                for worker in workers:
                    worker.kill()
                errors = [w.communicate()[1][-1500:] for w in workers]
                return {"error": "a worker failed or never got ready", "stderr_tails": errors}
            time.sleep(0.05)
        pathlib.Path(rendezvous, "go").touch()
        outputs = [worker.communicate(timeout=900) for worker in workers]
    results = []
    for worker, (stdout, stderr) in zip(workers, outputs):
        lines = [line for line in stdout.splitlines() if line.startswith("{")]
        result = json.loads(lines[-1]) if lines else None
        if worker.returncode != 0 or result is None or "error" in result:
            return {"error": f"worker exit {worker.returncode}", "stderr_tail": stderr[-2000:],
                    "result": result}
        results.append(result)
    start, end = max(r["timed_from"] for r in results), min(r["timed_to"] for r in results)
    window = max(r["timed_to"] for r in results) - min(r["timed_from"] for r in results)
    peaks = [r["peak_bytes"] for r in results]
    return {"time_s": max(r["time_s"] for r in results),
            "worker_time_s": [r["time_s"] for r in results],
            "overlap": max(0.0, end - start) / window if window > 0 else 1.0,
            "peak_bytes": None if None in peaks else max(peaks),
            "device": results[0]["device"]}


def _ready_then_wait_for_go(rendezvous: str, worker: str) -> None:
    pathlib.Path(rendezvous, f"ready_{worker}").touch()
    go = pathlib.Path(rendezvous, "go")
    while not go.exists():
        time.sleep(0.01)


def _apply(opt, grads, state, params):
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state


def summarize(record: dict) -> str:
    cases = record["cases"]
    host = next((c for c in cases if c["method"] == "host_cpu" and "error" not in c), None)
    link = next((c for c in cases if c["method"] == "link" and "error" not in c), None)
    rows = []
    for case in cases:
        label = case["method"] + (
            f" x{case['processes']} ({case['num_params']:.3g} params each)"
            if "processes" in case else "") + (
            f" beta={case['bucket_params']:.3g} slots={case['slots']}"
            if case["method"].startswith("stream") else "")
        if "error" in case:
            rows.append([label, "OOM" if case.get("oom") else "error", "-", "-", "-"])
            continue
        # Per parameter: a shared case updates processes x num_params in its step.
        params = case["num_params"] * case.get("processes", 1)
        speedup = (f"{host['time_s'] / host['num_params'] * params / case['time_s']:.2f}x"
                   if host else "-")
        over_floor = f"{case['time_s'] / link['time_s']:.2f}x" if link else "-"
        rows.append([label, f"{case['time_s'] * 1e3:.1f} ms", speedup, over_floor,
                     harness.format_bytes(case.get("peak_bytes"))])
    headers = ["method", "step", "vs host CPU", "vs link floor", "device peak"]
    return (f"{record['benchmark']} on {record['device']}, {record['date']}, "
            f"{cases[0]['num_params']:.1e} params\n"
            + harness.format_table(headers, rows))


if __name__ == "__main__" and "--case" in sys.argv:
    harness.case_main(run_case)
