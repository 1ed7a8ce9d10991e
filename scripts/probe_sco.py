"""Probe (GPU): where SCO's device memory goes when boundaries are offloaded.

Finished probe: ran at commits 54abdc4 and 267913d, records
scripts/results/sco_probe_gpu_20261130-{044920,045914}.json, summarized in docs/sco.md. Kept for
the record, not maintained: it calls private functions of the operator.

The first H200 run of scripts/bench_sco.py (24 layers, N = 65,536, H = 4096) kept the step time
(10.26 s vs 10.25 s) but raised XLA's device temp from 30.9 GB (offload 0) to 91.7 GB (offload
12), with only 1 GiB of host temp. This probe compiles a small stack with several placements of
the backward's barriers and copies, one fresh process each, and keeps every optimized HLO.

    PYTHONPATH=. python3 scripts/probe_sco.py --out-dir DIR
"""

from __future__ import annotations

import argparse
import functools
import gzip
import json
import os
import pathlib
import sys
import tarfile

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from peakflat_jax.bench import harness, sco
from peakflat_jax.ops import sco as sco_ops

SHAPE = dict(layers=6, tokens=8192, hidden=2048, heads=16, mlp=4, dtype="bfloat16", repeats=3,
             attention="cudnn")


def _variant(layer_fn, mode, num_layers):
    """An SCO stack whose backward restores boundaries in the way ``mode`` names."""
    chosen = (True,) * num_layers

    @jax.custom_vjp
    def stack(h, params):
        return sco_ops._sco_scan_fwd(layer_fn, chosen, h, params)[0]

    def fwd(h, params):
        return sco_ops._sco_scan_fwd(layer_fn, chosen, h, params)

    def bwd(residuals, d_h):
        boundaries, params = residuals
        d_params = []
        to_device = functools.partial(jax.device_put, device=jax.memory.Space.Device)
        if mode == "barrier_after":  # copy free to start early; recompute waits for d_h
            for layer in reversed(range(num_layers)):
                h_in, d_h = lax.optimization_barrier((to_device(boundaries[layer]), d_h))
                _, vjp = jax.vjp(layer_fn, h_in, sco_ops._layer_params(params, layer))
                d_h, d_layer = vjp(d_h)
                d_params.append(d_layer)
        elif mode == "no_barrier":
            for layer in reversed(range(num_layers)):
                _, vjp = jax.vjp(layer_fn, to_device(boundaries[layer]),
                                 sco_ops._layer_params(params, layer))
                d_h, d_layer = vjp(d_h)
                d_params.append(d_layer)
        elif mode == "tie_device_copy":  # the device copy (not the host value) is tied to d_h
            for layer in reversed(range(num_layers)):
                restored = to_device(boundaries[layer])
                h_in, d_h = lax.optimization_barrier((restored, d_h))
                h_in = lax.optimization_barrier(h_in)
                _, vjp = jax.vjp(layer_fn, h_in, sco_ops._layer_params(params, layer))
                d_h, d_layer = vjp(d_h)
                d_params.append(d_layer)
        else:
            raise ValueError(mode)
        d_stacked = jax.tree.map(lambda *per: jnp.stack(per[::-1]), *d_params)
        return d_h, d_stacked

    stack.defvjp(fwd, bwd)
    return stack


def _per_layer(layer_fn):
    """One custom VJP per layer: residual = the host copy of its input."""

    @jax.custom_vjp
    def one(h, p):
        return layer_fn(h, p)

    def fwd(h, p):
        return layer_fn(h, p), (jax.device_put(h, jax.memory.Space.Host), p)

    def bwd(res, d_out):
        h_host, p = res
        _, vjp = jax.vjp(layer_fn, jax.device_put(h_host, jax.memory.Space.Device), p)
        return vjp(d_out)

    one.defvjp(fwd, bwd)
    return one


def run_case(case: dict) -> dict:
    device = jax.devices()[0]
    shape = {k: case[k] for k in SHAPE}
    layers, tokens, hidden = shape["layers"], shape["tokens"], shape["hidden"]
    layer = sco.decoder_layer(shape)
    dtype = jnp.dtype(shape["dtype"])
    h = jax.random.normal(jax.random.key(0), (tokens, hidden), dtype)
    keys = jax.random.split(jax.random.key(1), 4)
    width = shape["mlp"] * hidden
    params = {"qkv": jax.random.normal(keys[0], (layers, hidden, 3 * hidden), dtype) * 0.02,
              "out": jax.random.normal(keys[1], (layers, hidden, hidden), dtype) * 0.02,
              "up": jax.random.normal(keys[2], (layers, hidden, width), dtype) * 0.02,
              "down": jax.random.normal(keys[3], (layers, width, hidden), dtype) * 0.02}
    variant = case["variant"]
    if variant == "scan":
        def stack(h, p):
            return lax.scan(lambda h, p: (jax.checkpoint(layer)(h, p), None), h, p)[0]
    elif variant == "scan_offload_policy":
        policy = jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=[], names_which_can_be_offloaded=["layer_in"],
            offload_src="device", offload_dst="pinned_host")

        def named(h, p):
            return layer(checkpoint_name(h, "layer_in"), p)

        def stack(h, p):
            return lax.scan(lambda h, p: (jax.checkpoint(named, policy=policy)(h, p), None),
                            h, p)[0]
    elif variant.startswith("sco"):
        offload = layers if variant == "sco_all" else 0

        def stack(h, p):
            return sco_ops.sco_scan(layer, h, p, offload=offload)
    elif variant == "per_layer":
        one = _per_layer(layer)

        def stack(h, p):
            for i in range(layers):
                h = one(h, sco_ops._layer_params(p, i))
            return h
    else:
        mode_stack = _variant(layer, variant, layers)

        def stack(h, p):
            return mode_stack(h, p)

    step = jax.jit(jax.value_and_grad(
        lambda h, p: jnp.mean(stack(h, p).astype(jnp.float32) ** 2), argnums=(0, 1)))
    compiled = step.lower(h, params).compile()
    hlo_dir = os.environ.get("PROBE_HLO_DIR")
    if hlo_dir:
        with gzip.open(pathlib.Path(hlo_dir) / f"{variant}.hlo.gz", "wt") as f:
            f.write(compiled.as_text())
    return {**harness.measure_compiled(compiled, (h, params), [device], case),
            "boundary_bytes": tokens * hidden * dtype.itemsize}


VARIANTS = ["scan", "scan_offload_policy", "sco_none", "sco_all", "barrier_after",
            "no_barrier", "tie_device_copy", "per_layer"]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--variants", nargs="*", default=VARIANTS, choices=VARIANTS)
    args = parser.parse_args()
    out = pathlib.Path(args.out_dir)
    hlo_dir = pathlib.Path("/tmp/probe_sco_hlo")
    hlo_dir.mkdir(parents=True, exist_ok=True)
    os.environ["PROBE_HLO_DIR"] = str(hlo_dir)
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    record = harness.run_suite("scripts.probe_sco", "sco_probe", "gpu",
                               [dict(SHAPE, variant=v) for v in args.variants],
                               command="python3 scripts/probe_sco.py", out_dir=out)
    with tarfile.open(out / "sco_probe_hlo.tar", "w") as tar:
        tar.add(hlo_dir, arcname="hlo")
    for c in record["cases"]:
        print(json.dumps({k: c.get(k) for k in ("variant", "time_s", "peak_bytes",
                                                 "xla_temp_bytes", "xla_host_temp_bytes",
                                                 "error")}))


if __name__ == "__main__":
    if "--case" in sys.argv:
        harness.case_main(run_case)
    else:
        main()
