"""How long a config's loss-and-gradient program takes to lower and compile, and how many
grouped-matmul call sites and distinct Mosaic kernels it holds: compile only, with abstract
weights (nothing is allocated, so a depth that would not fit still compiles).

    python scripts/bench_compile.py h200-1 model.num_layers=32 [--out-dir DIR]

One JSON record per run under scripts/results/ (or --out-dir): command, device, commit, the
seconds of tracing, lowering and XLA's compile, XLA's memory plan. Run each depth in a fresh
process: jaxlib's in-process kernel cache would otherwise carry kernels from one to the next.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import re
import sys
import time

import jax
import jax.numpy as jnp
from flax import nnx

from peakflat_jax import mesh as mop
from peakflat_jax.hf.config import load_config
from peakflat_jax.memory import compiled_memory
from peakflat_jax.model.decoder import MoEDecoder
from peakflat_jax.model.sharding import state_shardings
from peakflat_jax.plan import make_plan
from peakflat_jax.train.machine import read_device_memory
from peakflat_jax.train.trainer import boundary_offload, runtime_for


def platform_of(devices) -> str:
    return "gpu" if devices[0].platform in ("gpu", "cuda", "rocm") else "cpu"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--out-dir", default=str(pathlib.Path(__file__).parent / "results"))
    args = parser.parse_args()
    config = load_config(args.config, args.overrides)
    mesh = mop.make_mesh(config.mesh)
    # What the trainer would compile: the planner's choices for this machine (operators left
    # auto, null knobs), without its fit check (a depth that would not fit still compiles).
    devices = list(mesh.devices.flat)
    config = make_plan(config, len(devices), platform=platform_of(devices),
                       device_memory=read_device_memory(devices), baseline=False,
                       search_context=False).filled_config()
    runtime = runtime_for(config, mesh)
    offload = boundary_offload(config, mesh)
    padded = mop.padded_vocab(config.model.vocab_size, mop.num_devices(mesh))
    graphdef, abstract = nnx.split(nnx.eval_shape(
        lambda: MoEDecoder(config.model, padded_vocab=padded, rngs=nnx.Rngs(0))))
    shardings = state_shardings(abstract, mesh)
    params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          abstract, shardings)
    tokens = jax.ShapeDtypeStruct((config.data.batch_size, config.data.seq_len), jnp.int32,
                                  sharding=mop.token_sharding(mesh))
    batch = {key: tokens for key in ("tokens", "targets", "positions", "segment_ids")}

    def loss(params, batch):
        return nnx.merge(graphdef, params)(batch, runtime, offload)

    step = jax.jit(jax.value_and_grad(loss, has_aux=True))
    started = time.perf_counter()
    traced = step.trace(params, batch)
    traced_at = time.perf_counter()
    lowered = traced.lower()
    lowered_at = time.perf_counter()
    compiled = lowered.compile()
    compiled_at = time.perf_counter()
    text = lowered.as_text()
    hashes = re.findall(r'kernel_hash = "([^"]*)"', text)
    plan = compiled_memory(compiled)
    record = {
        "benchmark": "compile", "command": " ".join(["python", *sys.argv]),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "device": jax.devices()[0].device_kind, "jax": jax.__version__,
        "commit": os.environ.get("PEAKFLAT_COMMIT", "unknown"),
        "config": config.name, "overrides": args.overrides,
        "num_layers": config.model.num_layers, "layer_loop": config.operators.layer_loop,
        "operators": {k: getattr(config.operators, k) for k in
                      ("moe_dispatch", "loss", "offload", "optimizer_offload")},
        "trace_s": traced_at - started, "lower_s": lowered_at - traced_at,
        "compile_s": compiled_at - lowered_at, "total_s": compiled_at - started,
        "mosaic_call_sites": len(hashes), "distinct_mosaic_kernels": len(set(hashes)),
        "xla_plan_bytes": plan.total, "xla_temp_bytes": plan.temp,
    }
    out = pathlib.Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = out / f"compile_{config.name}_L{config.model.num_layers}_{stamp}.json"
    path.write_text(json.dumps(record, indent=1))
    print(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
