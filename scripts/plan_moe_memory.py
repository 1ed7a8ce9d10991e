"""XLA's memory plan for one PipelinedLLEP layer's forward + backward at the GPU benchmark's shape,
compiled (not run) on D simulated CPU devices (default 2), with the Mosaic path wired to opaque
stand-in kernels (host callbacks of the kernels' output shapes). It answers "how much does this
setting save?" without a GPU; XLA:CPU plans differ from XLA:GPU's (no async collectives), so
compare settings with each other, not with GPU peaks.

    PYTHONPATH=. python3 scripts/plan_moe_memory.py --tokens 32768 --token-budget 6554 \
        [--max-foreign-experts 16] [--devices 8] [--balance none] [--out-dir DIR]

Each run writes ``<out-dir>/moe_plan_cpu_<date>.json`` (default scripts/results).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from peakflat_jax import memory  # noqa: E402
from peakflat_jax.bench import harness  # noqa: E402
from peakflat_jax.ops import grouped_matmul as gm  # noqa: E402
from peakflat_jax.ops.pipelined_moe import MoEBackend, pipelined_moe  # noqa: E402

EXPERTS, TOP_K, HIDDEN, FFN = 128, 8, 7168, 2048


def opaque_kernels() -> gm.GroupedMatmulKernels:
    """Kernels XLA cannot see into: their results' shapes, from a host callback."""

    def opaque(result_shape):
        def call(a, b, group_sizes):
            shape = result_shape(a, b, group_sizes)
            return jax.pure_callback(lambda *_: np.zeros(shape, a.dtype),
                                     jax.ShapeDtypeStruct(shape, a.dtype), a, b, group_sizes)
        return call

    return gm.GroupedMatmulKernels(
        forward=opaque(lambda lhs, rhs, s: (lhs.shape[0], rhs.shape[2])),
        input_grad=opaque(lambda dy, rhs, s: (dy.shape[0], rhs.shape[1])),
        weight_grad=opaque(lambda lhs, dy, s: (s.shape[0], lhs.shape[1], dy.shape[1])))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=32768, help="tokens per rank")
    parser.add_argument("--token-budget", type=int, default=None, help="default: one chunk")
    parser.add_argument("--max-foreign-experts", type=int, default=None)
    parser.add_argument("--devices", type=int, default=2, choices=range(1, 9),
                        help="the expert-parallel group (E_p)")
    parser.add_argument("--balance", default="llep", choices=("llep", "none"),
                        help="none: standard expert parallelism")
    parser.add_argument("--out-dir", type=pathlib.Path, default=harness.RESULTS_DIR)
    args = parser.parse_args()
    backend = MoEBackend(grouped_matmul=opaque_kernels())  # the Mosaic path, kernels opaque
    mesh = Mesh(np.array(jax.devices()[:args.devices]), ("expert",))
    sharded = NamedSharding(mesh, P("expert"))
    rows = args.devices * args.tokens

    def spec(dtype, *shape):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharded)

    layer = jax.shard_map(
        lambda x, ids, g, wg, wu, wd: pipelined_moe(
            x, ids, g, wg, wu, wd, axis_name="expert", num_experts=EXPERTS,
            token_budget=args.token_budget, max_foreign_experts=args.max_foreign_experts,
            balance=args.balance, backend=backend),
        mesh=mesh, in_specs=(P("expert"),) * 6, out_specs=P("expert"))
    grads = jax.grad(lambda x, ids, g, wg, wu, wd: jnp.sum(
        layer(x, ids, g, wg, wu, wd).astype(jnp.float32)), argnums=(0, 2, 3, 4, 5))
    bf16 = jnp.bfloat16
    compiled = jax.jit(grads).lower(
        spec(bf16, rows, HIDDEN), spec(jnp.int32, rows, TOP_K), spec(bf16, rows, TOP_K),
        spec(bf16, EXPERTS, HIDDEN, FFN), spec(bf16, EXPERTS, HIDDEN, FFN),
        spec(bf16, EXPERTS, FFN, HIDDEN)).compile()
    plan = memory.compiled_memory(compiled)
    now = datetime.datetime.now(datetime.timezone.utc)
    record = {"benchmark": "moe_plan", "command": " ".join([sys.executable, *sys.argv]),
              "device": f"{args.devices} simulated CPU devices (XLA:CPU plan, compiled, not run)",
              "date": now.isoformat(timespec="seconds"), "jax": jax.__version__,
              "commit": harness.git_commit(),
              "case": dict(tokens=args.tokens, token_budget=args.token_budget,
                           max_foreign_experts=args.max_foreign_experts, experts=EXPERTS,
                           top_k=TOP_K, hidden=HIDDEN, ffn=FFN, dtype="bfloat16",
                           devices=args.devices, balance=args.balance),
              "xla_temp_bytes": plan.temp, "xla_argument_bytes": plan.argument,
              "xla_output_bytes": plan.output}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / f"moe_plan_cpu_{now:%Y%m%d-%H%M%S}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"D {args.devices}, balance {args.balance}, tokens/rank {args.tokens}, token_budget "
          f"{args.token_budget}, max_foreign_experts "
          f"{args.max_foreign_experts}: temp {plan.temp / 1e9:.2f} GB, arguments "
          f"{plan.argument / 1e9:.2f} GB, outputs {plan.output / 1e9:.2f} GB (XLA:CPU plan, "
          f"per device); record: {path}")

if __name__ == "__main__":
    main()
