"""Where a process's resident host memory goes when it holds pinned_host arrays (issue 25:
h200-1 with the streamed optimizer held 72 GiB resident for 33 GiB of state).

    PYTHONPATH=. python scripts/probes/probe_pinned_host_rss.py [--gib 32] [--bucket 50000000]

Makes fp32 pinned_host arrays of ``--bucket`` elements (the streamed optimizer's bucket) by
jitted programs whose outputs are placed in pinned_host, as ``offload_stream.init`` does, until
``--gib`` GiB are live, printing the resident set (VmRSS) and the bytes live after each GiB; then
the same made by ``jax.device_put`` of host numpy arrays; then deletes them. One JSON line per
reading, then a summary line: resident bytes per live byte for each way."""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np


def rss() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=32)
    parser.add_argument("--bucket", type=int, default=50_000_000)
    args = parser.parse_args()
    device = jax.devices()[0]
    host = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
    per_array = args.bucket * 4
    count = int(args.gib * 2**30 // per_array)
    base = rss()
    summary = {"device": device.device_kind, "bucket": args.bucket, "arrays": count,
               "live_bytes": count * per_array, "rss_before": base}
    for way in ("jit_out_pinned_host", "device_put_numpy"):
        make = jax.jit(lambda i: jnp.full((args.bucket,), i, jnp.float32), out_shardings=host)
        arrays, start, next_gib = [], rss(), 1
        for i in range(count):
            if way == "jit_out_pinned_host":
                arrays.append(make(jnp.float32(i)))
            else:
                arrays.append(jax.device_put(np.full((args.bucket,), i, np.float32), host))
            arrays[-1].block_until_ready()
            live = (i + 1) * per_array
            if live >= next_gib * 2**30 or i == count - 1:
                print(json.dumps({"way": way, "live_gib": round(live / 2**30, 2),
                                  "rss_gib": round(rss() / 2**30, 2)}), flush=True)
                next_gib += 1
        held = rss() - start
        del arrays
        time.sleep(1)
        summary[way] = {"rss_growth": held, "per_live_byte": round(held / (count * per_array), 3),
                        "rss_after_delete": rss()}
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
