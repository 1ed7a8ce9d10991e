"""What the host link moves, each way alone and both ways at once, inside one jitted program as
the streamed optimizer's copies are made (issue 26: is the ~55 GB/s its copies reach the link's
ceiling, and can the copies in and the copies out share it at twice that?).

    PYTHONPATH=. python scripts/probes/probe_host_link.py [--gib 4] [--pieces 8] [--repeats 5]

Each case is one jitted program over ``--pieces`` fp32 arrays of ``--gib`` GiB in all each way:
``h2d`` copies pinned_host arrays to the device (``jax.device_put(x, Space.Device)``), ``d2h``
device arrays to pinned_host, ``both`` does the two at once (independent arrays: nothing orders
them). Prints one JSON line per case (median of ``--repeats`` after a warm-up, GB/s of the bytes
moved, both directions counted) and a summary line with the ratio of ``both`` to the slower of
the two alone: 1 is a link whose directions share one rate (or copies XLA ran one after
another), 2 one that is full duplex. XLA_FLAGS are the command's (``cli.prepare_environment``;
XLA's 2 host copies in flight unless XLA_FLAGS sets more, which can serialize the two directions
by itself); the record says which."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from peakflat_jax.cli import prepare_environment

prepare_environment()  # the command's XLA flags (a config's own: device.xla_flags)

import jax  # noqa: E402 (after the flags: XLA reads them once, as its backends start)
import jax.numpy as jnp  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=4.0, help="bytes moved each way, GiB")
    parser.add_argument("--pieces", type=int, default=8, help="arrays each way")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    device = jax.devices()[0]
    on_host = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
    on_device = jax.sharding.SingleDeviceSharding(device, memory_kind="device")
    n = int(args.gib * 2**30 / 4 / args.pieces)
    host_in = [jax.device_put(jnp.full((n,), i, jnp.float32), on_host) for i in range(args.pieces)]
    dev_in = [jnp.full((n,), i, jnp.float32, device=on_device) for i in range(args.pieces)]
    bytes_each_way = 4 * n * args.pieces

    cases = {
        "h2d": (jax.jit(lambda h: [jax.device_put(x, jax.memory.Space.Device) + 1 for x in h]),
                (host_in,), bytes_each_way),
        "d2h": (jax.jit(lambda d: [jax.device_put(x * 2, jax.memory.Space.Host) for x in d]),
                (dev_in,), bytes_each_way),
        "both": (jax.jit(lambda h, d: ([jax.device_put(x, jax.memory.Space.Device) + 1 for x in h],
                                       [jax.device_put(x * 2, jax.memory.Space.Host) for x in d])),
                 (host_in, dev_in), 2 * bytes_each_way),
    }
    summary = {"device": device.device_kind, "jax": jax.__version__,
               "xla_flags": os.environ.get("XLA_FLAGS", ""),
               "bytes_each_way": bytes_each_way, "pieces": args.pieces}
    for name, (program, inputs, moved) in cases.items():
        jax.block_until_ready(program(*inputs))  # compile and warm
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            jax.block_until_ready(program(*inputs))
            times.append(time.perf_counter() - start)
        seconds = statistics.median(times)
        summary[name] = {"seconds": round(seconds, 4), "gb_per_s": round(moved / seconds / 1e9, 1)}
        print(json.dumps({"case": name, **summary[name]}), flush=True)
    alone = min(summary["h2d"]["gb_per_s"], summary["d2h"]["gb_per_s"])
    summary["both_over_slower_alone"] = round(summary["both"]["gb_per_s"] / alone, 2)
    print(json.dumps({"summary": summary}), flush=True)


if __name__ == "__main__":
    main()
