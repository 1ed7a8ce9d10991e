"""Probe (GPUs): the experimental ragged exchange against the padded one.

1. Exactness: ``pf.pipelined_moe`` with ``backend=MoEBackend(exchange="ragged")``
   (``lax.ragged_all_to_all``) and with the padded all-to-all, on the same inputs under skew:
   values and all five gradients must agree (the same arithmetic; only the exchange differs).
2. Speed and memory of one chunk's dispatch and return at the paper's chunk size (c = 6554
   tokens, top-8, H = 7168, bf16), both forms: time of a jitted round trip and XLA's temp plan.

    PYTHONPATH=. python3 scripts/probe_ragged_exchange.py --out-dir DIR      # 2+ GPUs
    PYTHONPATH=. python3 scripts/probe_ragged_exchange.py --emulate --small  # CPU: a dry run

``--emulate`` passes the ragged exchange an emulated collective (``tests/ragged_emulation.py``;
XLA:CPU has no ragged all-to-all), so a CPU run checks this script, not the GPU collective.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import sys

if "--emulate" in sys.argv:  # before jax starts: simulated devices for a CPU dry run
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=2")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from peakflat_jax import memory, skew  # noqa: E402
from peakflat_jax.bench import harness  # noqa: E402
from peakflat_jax.ops.expert_exchange import PaddedExchange  # noqa: E402
from peakflat_jax.ops.pipelined_moe import MoEBackend, pipelined_moe  # noqa: E402
from peakflat_jax.ops.ragged_exchange import RaggedExchange  # noqa: E402


def exchanges(emulate: bool) -> dict:
    """The two forms by name; with ``emulate``, the ragged one over the CPU stand-in."""
    if not emulate:
        return {"padded": PaddedExchange(), "ragged": RaggedExchange()}
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
    from ragged_emulation import emulated_ragged_all_to_all
    return {"padded": PaddedExchange(), "ragged": RaggedExchange(emulated_ragged_all_to_all)}


def exactness(mesh, forms: dict, small: bool) -> dict:
    devices = mesh.devices.size
    tokens, experts, top_k, hidden, ffn = (24, 8, 2, 16, 8) if small else (512, 16, 4, 256, 128)
    rng = np.random.default_rng(0)
    ids = jnp.asarray(np.concatenate(
        [skew.route(tokens, top_k, experts, skew.SkewProfile(0.8, 2))] * devices))
    arrays = [jnp.asarray(rng.standard_normal(s) / np.sqrt(s[-2] if len(s) == 3 else 1),
                          jnp.float32)
              for s in ((devices * tokens, hidden), (devices * tokens, top_k),
                        (experts, hidden, ffn), (experts, hidden, ffn), (experts, ffn, hidden))]
    cotangent = jnp.asarray(rng.standard_normal((devices * tokens, hidden)), jnp.float32)
    results = {}
    for kind, exchange in forms.items():
        layer = jax.shard_map(
            lambda x, i, g, wg, wu, wd, exchange=exchange: pipelined_moe(
                x, i, g, wg, wu, wd, axis_name="expert", num_experts=experts,
                token_budget=tokens // 3, llep_min_tokens=2,
                backend=MoEBackend(exchange=exchange)),
            mesh=mesh, in_specs=(P("expert"),) * 6, out_specs=P("expert"))

        def loss(*a):
            return jnp.vdot(layer(a[0], ids, *a[1:]), cotangent)

        value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))(*arrays)
        results[kind] = [value, *grads]
    errors = {name: float(jnp.max(jnp.abs(r - p)) / (jnp.max(jnp.abs(p)) + 1e-30))
              for name, p, r in zip(("loss", "x", "gates", "w_gate", "w_up", "w_down"),
                                    results["padded"], results["ragged"])}
    return {"max_relative_difference": errors, "ok": max(errors.values()) < 1e-5}


def round_trip(mesh, exchange, small: bool) -> dict:
    """One chunk's dispatch and return, the payload untouched in between."""
    devices = mesh.devices.size
    chunk_tokens, top_k, hidden = (64, 2, 16) if small else (6554, 8, 7168)
    slots = chunk_tokens * top_k
    rng = np.random.default_rng(1)
    rows = jnp.asarray(rng.standard_normal((devices * slots, hidden)), jnp.bfloat16)
    skewed = rng.random(devices * slots) < 0.7  # 70% of every source's slots to device 0
    destination = jnp.asarray(np.where(skewed, 0, rng.integers(0, devices, devices * slots)),
                              jnp.int32)

    def trip(rows, destination):
        routes = exchange.routes(destination, devices, "expert")
        received = exchange.send(rows, routes, "expert")
        return exchange.combine(received * 2, routes, "expert")

    step = jax.jit(jax.shard_map(trip, mesh=mesh, in_specs=(P("expert"), P("expert")),
                                 out_specs=P("expert")))
    compiled = step.lower(rows, destination).compile()
    out = compiled(rows, destination)
    assert bool(jnp.all(out == rows * 2)), "the round trip changed the rows"
    timing = harness.time_call(compiled, rows, destination, warmup=2, repeats=10)
    return {"time_ms": 1e3 * timing["median_s"],
            "xla_temp_bytes": memory.compiled_memory(compiled).temp,
            "rows_per_device": slots, "hidden": hidden}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out-dir", type=pathlib.Path, default=harness.RESULTS_DIR)
    parser.add_argument("--emulate", action="store_true",
                        help="CPU dry run: an emulated ragged all-to-all on 2 CPU devices")
    parser.add_argument("--small", action="store_true", help="small shapes")
    args = parser.parse_args()
    forms = exchanges(args.emulate)
    devices = jax.devices()
    if len(devices) < 2:
        print("probe_ragged_exchange needs 2 or more devices", file=sys.stderr)
        return 2
    mesh = Mesh(np.array(devices[:2]), ("expert",))
    now = datetime.datetime.now(datetime.timezone.utc)
    record = {"probe": "ragged_exchange", "command": " ".join([sys.executable, *sys.argv]),
              "device": f"{len(devices)} x {devices[0].device_kind}", "emulated": args.emulate,
              "date": now.isoformat(timespec="seconds"), "jax": jax.__version__,
              "commit": harness.git_commit(), "results": {}}
    steps = [("exactness", lambda: exactness(mesh, forms, args.small))]
    steps += [(f"round_trip/{kind}", lambda form=form: round_trip(mesh, form, args.small))
              for kind, form in forms.items()]
    for name, run in steps:
        try:
            record["results"][name] = run()
        except Exception as error:  # one failure must not lose the other numbers
            record["results"][name] = {"error": type(error).__name__, "message": str(error)[:2000]}
        print(name, json.dumps(record["results"][name]), flush=True)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / f"ragged_exchange_probe_{now:%Y%m%d-%H%M%S}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"record: {path}")
    failed = [n for n, r in record["results"].items() if "error" in r or r.get("ok") is False]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
