"""Reproducer: XLA:CPU (jax 0.11.2) matches two different all-to-alls of one program with each
other, and the program's gradients come out wrong (docs/cpu_scheduler.md).

    python scripts/repro_cpu_scheduler.py [--processes 8] [--executions 4] [--keys]

The program: the trainer's loss-and-gradient program of a 2-layer Mixtral-shaped model (hidden 64,
8 experts top-2, 16 tokens x 2 sequences) on 8 simulated CPU devices, with PipelinedLLEP's chunk
loop whose backward is arranged as peakflat had it before commit 6b2e542 (at 5196037, where the
failure was found): each chunk's token cotangent leaves the loop as a scan output instead of
being written over the outputs' cotangents in a carried buffer. In that arrangement each
backward step holds a ``lax.cond`` (the previous chunk's dispatch: two all-to-alls) and,
independent of it, the current chunk's return all-to-all. The arithmetic is the same in both
arrangements; what changes is XLA's buffer assignment, which in the later one happens to order
the return exchange after the conditional (a buffer the two share, not a dependency).

Each child process builds the program, executes it ``--executions`` times on the same inputs and
saves every gradient; a child with ``--xla_cpu_enable_concurrency_optimized_scheduler=false``
gives the reference. The failure shows mostly on a process's first execution, so the rate is
reported per execution and per process. ``--keys`` then runs children with XLA's collective
logging on (at most ``--processes``, 2 executions each) until one execution's devices started
their collectives in different orders, and prints the pair a device swapped (both with the
rendezvous key ``op_id=1``: jax gives every collective of a ``shard_map`` channel 1, and XLA:CPU
keys its in-process rendezvous by channel).
"""

from __future__ import annotations

import argparse
import collections
import os
import pathlib
import re
import subprocess
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parents[1]
FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"
CONFIG = """\
model: {vocab_size: 300, hidden: 64, num_layers: 2, num_heads: 8, num_kv_heads: 4, head_dim: 8,
        num_experts: 8, top_k: 2, expert_ffn: 32, rope_theta: 1000000.0, norm_eps: 1.0e-5,
        init_std: 0.1, router_bias_rate: 0.0, dtype: float32}
mesh: {data: 2, seq: 4}
data: {source: synthetic, seq_len: 16, batch_size: 2}
operators: {moe_dispatch: pipelined, token_budget: 2, loss: ring, offload: all,
            optimizer_offload: true}
"""
LOGGED = ("collective_thunk=3,all_to_all_thunk=3,collective_permute_thunk=3,all_reduce_thunk=3,"
          "all_gather_thunk=3")


def earlier_chunk_backward() -> None:
    """PipelinedLLEP's chunk-loop backward as it was before commit 6b2e542: the same values,
    each chunk's token cotangent a scan output."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    from peakflat_jax.ops import pipelined_moe as pm
    from peakflat_jax.ops._shard import varying_like

    def backward(plan, residuals, d_outputs):
        weights, chunks = residuals

        def chunk_grads(i, dispatched):
            def process(w, rows, gates):
                return pm._process_chunk(plan, w, dispatched._replace(rows=rows), gates)

            _, vjp = jax.vjp(process, weights, dispatched.rows, chunks.gates[i])
            d_w, d_received, d_gates = vjp(d_outputs[i])
            d_x = pm._tokens_cotangent(plan, d_received, dispatched.routes, chunks.x.dtype)
            return d_w, d_x, d_gates

        def step(carry, i):
            dispatched, d_weights = carry
            upcoming = pm._dispatch_if(plan, chunks, i - 1, dispatched)
            d_w, d_x, d_gates = chunk_grads(i, dispatched)
            d_weights = jax.tree.map(lambda acc, g: acc + g.astype(jnp.float32), d_weights, d_w)
            return (upcoming, d_weights), (d_x, d_gates)

        zeros = jax.tree.map(lambda w: varying_like(jnp.zeros(w.shape, jnp.float32), w), weights)
        (_, d_weights), (d_x, d_gates) = lax.scan(
            step, (pm._dispatch_chunk(plan, chunks, plan.num_chunks - 1), zeros),
            jnp.arange(plan.num_chunks), reverse=True)
        d_weights = jax.tree.map(lambda g, w: g.astype(w.dtype), d_weights, weights)
        return d_weights, pm._Chunks(x=d_x, gates=d_gates, destination=None, group=None)

    pm._run_chunks.defvjp(pm._run_chunks_fwd, backward)


def child(out: str, executions: int, arrangement: str) -> None:
    """Builds the program, executes it ``executions`` times, saves each execution's gradients."""
    import jax
    import numpy as np

    from peakflat_jax.hf.config import load_config
    from peakflat_jax.train.trainer import Trainer

    if arrangement == "earlier":
        earlier_chunk_backward()
    with tempfile.TemporaryDirectory() as directory:
        path = pathlib.Path(directory) / "repro.yaml"
        path.write_text(CONFIG)
        trainer = Trainer(load_config(path), run_dir=str(pathlib.Path(directory) / "run"))
        state = trainer.initial_state()
        batch = trainer.global_batch(next(trainer.batches))
        program = trainer.gradient_program(state, batch)
        copy = jax.jit(lambda tree: jax.tree.map(lambda a: a + 0, tree))  # extras are donated
        saved = {}
        for execution in range(executions):
            _, grads, _ = program(state.params, copy(state.extras), batch)
            for index, leaf in enumerate(jax.tree.leaves(grads)):
                saved[f"{execution}_{index}"] = np.asarray(leaf)
    np.savez(out, **saved)


def run_child(out: pathlib.Path, executions: int, arrangement: str, scheduler: str,
              log: pathlib.Path | None = None) -> None:
    flags = "--xla_force_host_platform_device_count=8" + (f" {FLAG}" if scheduler == "off" else "")
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO),
           "PEAKFLAT_KEEP_CPU_SCHEDULER": "1"}
    if log is not None:
        env.update(TF_CPP_MIN_LOG_LEVEL="0", TF_CPP_VMODULE=LOGGED)
    with open(log or os.devnull, "w") as stderr:
        subprocess.run([sys.executable, __file__, "--child", str(out), "--executions",
                        str(executions), "--arrangement", arrangement], env=env, check=True,
                       stdout=subprocess.DEVNULL, stderr=stderr)


def executions_of(path: pathlib.Path, executions: int) -> list[list]:
    import numpy as np

    data = np.load(path)
    count = len(data.files) // executions
    return [[data[f"{e}_{i}"] for i in range(count)] for e in range(executions)]


def start_orders(log: pathlib.Path) -> dict[int, dict[int, list[tuple]]]:
    """{execution: {device: [(kind, source slice, op_id), ...]}}: the order in which each
    device started its collectives, from XLA:CPU's VLOG(3) lines (a collective's lines come
    from one thread; its device is its rank's entry of the key's device list)."""
    line_re = re.compile(r"^[IWEF]\d{4} [\d:.]+\s+(\d+) \w+\.cc:\d+\] (.*)$")
    kinds = {"AllGather": "all-gather", "AllToAll": "all-to-all", "AllReduce": "all-reduce",
             "CollectivePermute": "collective-permute", "ReduceScatter": "reduce-scatter"}
    pending: dict[str, dict] = {}
    runs: dict = collections.defaultdict(lambda: collections.defaultdict(list))
    for line in log.read_text(errors="replace").splitlines():
        match = line_re.match(line)
        if not match:
            continue
        thread, text = match.groups()
        word = text.split(":")[0]
        if word in kinds:
            pending[thread] = {"kind": kinds[word], "source": None}
        elif thread in pending and text.lstrip().startswith("src:"):
            if pending[thread]["source"] is None:
                pending[thread]["source"] = re.search(r"\{index:(\d+), offset:(\d+), size:(\d+)\}",
                                                      text).groups()
        elif thread in pending and "rank=" in text:
            key = re.search(r"rank=(\d+), key=RendezvousKey\{run_id=RunId: (-?\d+), "
                            r"global_devices=\[([^\]]*)\].*op_id=(\d+)", text)
            rank, run, devices, op_id = key.groups()
            started = pending.pop(thread)
            device = int(devices.split(",")[int(rank)])
            runs[run][device].append((started["kind"], started["source"], int(op_id)))
    return {index: runs[run] for index, run in enumerate(sorted(runs, key=int))}


def report_keys(directory: pathlib.Path, executions: int, tries: int) -> None:
    """Children with XLA's collective logging until one execution's devices started their
    collectives in different orders; prints the two collectives a device swapped."""
    for attempt in range(tries):
        log = directory / f"keys{attempt}.log"
        run_child(directory / f"keys{attempt}.npz", executions, "earlier", "default", log)
        for execution, devices in start_orders(log).items():
            reference = devices[0]
            for device, order in sorted(devices.items()):
                if order == reference:
                    continue
                at = next(i for i, (a, b) in enumerate(zip(order, reference)) if a != b)
                print(f"keys: process {attempt}, execution {execution}: device {device} started "
                      f"collective #{at} as {order[at]}, device 0 as {reference[at]} (kind, "
                      f"source buffer (allocation, offset, bytes), rendezvous op_id); both "
                      f"started {len(order)} collectives")
                return
    print(f"keys: every device started its collectives in one order in {tries} processes")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=8)
    parser.add_argument("--executions", type=int, default=4)
    parser.add_argument("--arrangement", choices=["earlier", "current"], default="earlier",
                        help="PipelinedLLEP's chunk backward: before 6b2e542 (default) or "
                             "this tree's")
    parser.add_argument("--keys", action="store_true",
                        help="also log XLA's collectives and print a swapped pair")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child, args.executions, args.arrangement)
        return 0
    import numpy as np

    with tempfile.TemporaryDirectory() as tmp:
        directory = pathlib.Path(tmp)
        run_child(directory / "reference.npz", 1, args.arrangement, "off")
        reference = executions_of(directory / "reference.npz", 1)[0]
        for scheduler in ("default", "off"):
            marks = []
            for process in range(args.processes):
                out = directory / f"{scheduler}{process}.npz"
                run_child(out, args.executions, args.arrangement, scheduler)
                marks.append("".join(
                    "." if all(np.array_equal(a, b) for a, b in zip(grads, reference)) else "x"
                    for grads in executions_of(out, args.executions)))
            wrong = sum(m.count("x") for m in marks)
            print(f"scheduler {scheduler}: {wrong} of {args.processes * args.executions} "
                  f"executions wrong ({sum(m[0] == 'x' for m in marks)} of {args.processes} "
                  f"first executions); per process: {' '.join(marks)}", flush=True)
        if args.keys:
            report_keys(directory, 2, args.processes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
