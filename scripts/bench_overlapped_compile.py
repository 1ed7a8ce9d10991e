"""How long the trainer's overlapped step (the streamed optimizer's update inside the step's
forward) takes to lower and compile, from the abstract state: nothing is made, so a depth whose
optimizer state the host could not hold still compiles.

    python scripts/bench_overlapped_compile.py h200-1 model.num_layers=32 \
        operators.optimizer_offload=true optimizer.resident_groups=0 [--out FILE]

Prints one JSON line (and appends it to ``--out``): the command, the commit, the device, the
layer loop, the seconds of lowering and XLA's compile, the lowered program's lines, the compiled
program's HLO instructions and XLA's memory plan. The memory checks are lifted
(``train.device_memory_gib`` and ``train.host_memory_gib`` are set past any machine): give
``optimizer.resident_groups``, or the planner keeps every group on the device it believes so
large. Run each depth in a fresh process: jaxlib's kernel cache would carry Mosaic kernels from
one compile to the next.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from peakflat_jax import mesh as mop
from peakflat_jax.hf.config import load_config
from peakflat_jax.memory import compiled_memory
from peakflat_jax.train.trainer import Trainer

UNBOUNDED = ["train.device_memory_gib=1000000", "train.host_memory_gib=1000000"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--out", help="a JSON-lines file the record is appended to")
    args = parser.parse_args()
    from peakflat_jax import cli

    cli.prepare_environment()  # the trainer's XLA flags, before the backends start
    started = time.perf_counter()
    config = load_config(args.config, [*args.overrides, *UNBOUNDED])
    trainer = Trainer(config, run_dir="unused")
    if not trainer.overlap:
        raise SystemExit("the config does not overlap the optimizer with the step "
                         "(operators.optimizer_offload and optimizer_overlap, MoE layers)")
    state = trainer.initial_state(abstract=True)
    tokens = jax.ShapeDtypeStruct((config.data.batch_size, config.data.seq_len), "int32",
                                  sharding=mop.token_sharding(trainer.mesh))
    batch = {key: tokens for key in ("tokens", "targets", "positions", "segment_ids")}
    apply = jax.ShapeDtypeStruct((), "bool", sharding=NamedSharding(trainer.mesh, P()))
    kept = jax.tree.map(lambda a: a.sharding, (state.params, state.extras))
    step = jax.jit(trainer._overlapped, donate_argnums=(0, 1, 2, 3), keep_unused=True,
                   out_shardings=(*kept, trainer.optimizer.state_shardings(state.opt_state),
                                  kept[0], None))
    ready = time.perf_counter()
    lowered = step.lower(state.params, state.extras, state.opt_state, state.params, batch, apply)
    lowered_at = time.perf_counter()
    compiled = lowered.compile()
    compiled_at = time.perf_counter()
    plan = compiled_memory(compiled)
    layout = state.opt_state.layout
    record = {
        "command": " ".join([os.path.basename(sys.argv[0]), *sys.argv[1:]]),
        "commit": os.environ.get("PEAKFLAT_COMMIT") or _commit(),
        "device": jax.devices()[0].device_kind,
        "num_layers": config.model.num_layers,
        "layer_loop": trainer.runtime.operators.layer_loop,
        "resident_groups": layout.resident_groups,
        "groups": len(layout.groups),
        "buckets": len(layout.bucket_sizes),
        "setup_seconds": ready - started,
        "lower_seconds": lowered_at - ready,
        "compile_seconds": compiled_at - lowered_at,
        "lowered_lines": sum(" = " in line for line in lowered.as_text().splitlines()),
        "hlo_instructions": sum(1 for line in compiled.as_text().splitlines()
                                if re.match(r"\s+(ROOT )?%?[\w.\-]+ = ", line)),
        "xla_plan_bytes": plan.total,
        "xla_temp_bytes": plan.temp,
    }
    line = json.dumps(record)
    print(line, flush=True)
    if args.out:
        with open(args.out, "a") as out:
            out.write(line + "\n")
    return 0


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
