"""How long the host-CPU AdamW's update (``optimizer.update_on: host_cpu``,
``peakflat_jax.train.optimizer.HostCpuAdamW``) takes per parameter on this machine's CPU: the
rate the planner's step estimate prices the host-CPU baseline with
(``plan.rates.Rates.host_adamw_seconds_per_param``).

    PYTHONPATH=. python scripts/probes/probe_host_adamw.py [--sizes 4e6,1.6e7,6.4e7] \
        [--leaf 4e6] [--cols 2048] [--programs chunked,previous] [--dtypes bfloat16,float32] \
        [--machine "what this machine is"] [--out-dir D]

What is timed: the compiled host update alone (global-norm clipping, AdamW with injected
hyperparameters, the working params cast), the gradients and state already in host memory, as
``HostCpuAdamW.step`` runs it between the two copies (``update_s``); and ``step`` whole, its
host copy of the gradients included (``step_s``: on a GPU host that copy crosses the link, here
it is a memory copy into a fresh buffer). Each size in 2-D leaves of ``--leaf`` parameters
(rows of ``--cols``, as a model's weights are), for each program and dtype, the median of
``--repeats`` calls after a warm-up. Programs: ``chunked`` (``HostCpuAdamW``: each leaf's
state in chunks, updated side by side) and ``previous`` (``PreviousHostCpuAdamW`` below: the
leaf-after-leaf program it replaced, whole leaves; the same bits). The rate is the first
program's bf16 median at the largest size over its parameters (the GPU runs' working dtype).

Beside the times, each case records the compiled program's structure: its elementwise loops,
the tasks XLA:CPU cuts each into (``outer_dimension_partitions``), and its temporaries. XLA
picks the tasks from the cores it sees (``os.sched_getaffinity``), so the structure a 16-core
host compiles can be read on any machine under ``scripts/probes/fake_ncpus.c`` (its doc: how):
``--structure-only`` compiles and reports without timing.

The machine is recorded with the numbers, and its load averages before and after (a shared
machine's other work slows the medians). The default rate was measured on the 2-core dev CPU
(no GPU), not on the GPU host: rerun this there for a GPU plan's rate (``peakflat plan
--rate``).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import re
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from peakflat_jax.bench import harness
from peakflat_jax.cli import CPU_SCHEDULER_FLAG
from peakflat_jax.config import OptimizerConfig
from peakflat_jax.train.optimizer import HostCpuAdamW, hyperparams_at, with_hyperparams


class PreviousHostCpuAdamW(HostCpuAdamW):
    """``HostCpuAdamW`` as it was before its state went into chunks (commit 80246c1): the
    state in ``DeviceAdamW``'s structure, the leaves updated one after another, each whole (one
    loop per array: at most ceil(sqrt(cores)) tasks each). Kept to compare against: times
    (this probe) and bits (tests/test_train_optimizer.py)."""

    def standard_state(self, state, params):
        return state

    def _host_init(self, params):
        master = jax.tree.map(lambda p: p.astype(jnp.float32), params)
        return master, self.device_adamw.transformation.init(master)

    def _host_update(self, grads, state):
        master, (clip_state, adamw_state) = state
        grad_leaves, treedef = jax.tree.flatten(grads)
        max_norm = self.device_adamw.max_grad_norm
        norm = (None if max_norm is None else
                optax.tree.norm([g.astype(jnp.float32) for g in grad_leaves]))
        shapes = [g.shape for g in grad_leaves]

        def per_param(node) -> bool:
            return (jax.tree.structure(node) == treedef
                    and [getattr(x, "shape", None) for x in jax.tree.leaves(node)] == shapes)

        nodes, outer = jax.tree.flatten(adamw_state, is_leaf=per_param)
        moments = [j for j, node in enumerate(nodes) if per_param(node)]
        moment_leaves = {j: treedef.flatten_up_to(nodes[j]) for j in moments}

        def adamw_of(leaves: dict):
            return outer.unflatten([leaves.get(j, node) for j, node in enumerate(nodes)])

        working, new_master, new_moments = [], [], {j: [] for j in moments}
        done = ()
        for i, (grad, leaf_master) in enumerate(zip(grad_leaves,
                                                    treedef.flatten_up_to(master))):
            grad, _ = lax.optimization_barrier((grad, done))
            piece = grad.astype(jnp.float32)
            if norm is not None:
                piece = lax.select(norm < max_norm, piece,
                                   (piece / norm.astype(piece.dtype)) * max_norm)
            updates, new = self.device_adamw.adamw.update(
                piece, adamw_of({j: moment_leaves[j][i] for j in moments}), leaf_master)
            leaf_master = optax.apply_updates(leaf_master, updates)
            new_nodes = outer.flatten_up_to(new)
            for j in moments:
                new_moments[j].append(new_nodes[j])
            working.append(leaf_master.astype(grad.dtype))
            new_master.append(leaf_master)
            done = (working[-1], leaf_master, *(new_nodes[j] for j in moments))
        empty = jnp.zeros((0,), jnp.float32)
        _, advanced = self.device_adamw.adamw.update(empty, adamw_of(dict.fromkeys(moments,
                                                                                   empty)), empty)
        new_nodes = [treedef.unflatten(new_moments[j]) if j in new_moments else shared
                     for j, shared in enumerate(outer.flatten_up_to(advanced))]
        return (treedef.unflatten(working),
                (treedef.unflatten(new_master), (clip_state, outer.unflatten(new_nodes))))


PROGRAMS = {"chunked": HostCpuAdamW, "previous": PreviousHostCpuAdamW}


def cpu_model() -> str:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def structure(compiled) -> dict:
    """What XLA:CPU made of the update: its loops over more than 4096 elements with the tasks
    each is cut into (the product of its ``outer_dimension_partitions``; 1 where it has none)
    and its temporaries' bytes."""
    text = compiled.as_text()
    tasks = []
    for line in text[text.index("\nENTRY"):].splitlines():
        shape = re.search(r"= \w+\[([\d,]*)\]", line)
        if " fusion(" not in line or not shape or not shape.group(1):
            continue
        if np.prod([int(d) for d in shape.group(1).split(",")]) <= 4096:
            continue
        parts = re.search(r'"outer_dimension_partitions":\[([^\]]*)\]', line)
        counts = [int(p.strip('"')) for p in parts.group(1).split(",") if p] if parts else []
        tasks.append(int(np.prod(counts)) if counts else 1)
    return {"loops": len(tasks), "tasks_per_loop_max": max(tasks, default=0),
            "tasks_per_loop_min": min(tasks, default=0),
            "temp_bytes": compiled.memory_analysis().temp_size_in_bytes}


def leaf_shapes(num_params: int, leaf: int, cols: int) -> list[tuple[int, int]]:
    """At least one leaf of (``leaf // cols``, ``cols``), as many as ``num_params`` holds."""
    rows = max(1, leaf // cols)
    return [(rows, cols)] * max(1, num_params // (rows * cols))


def loops_side_by_side(program: str, shape, dtype: str = "bfloat16") -> dict:
    """How many of the update's loops XLA:CPU's thunk executor may run at once, for one leaf
    of ``shape``: compiled in a child process whose thunk executor logs its graph
    (``TF_CPP_VMODULE=thunk_executor=6``: each thunk and the thunks it waits for, by buffer),
    the loops over more than 4096 elements put in levels (the longest chain of them before
    each), the most in one level; ``leaf_loops`` all of them, ``tasks_per_loop`` the most tasks
    XLA cut one into."""
    child = (f"import json, sys; sys.path.insert(0, {str(pathlib.Path(__file__).parent)!r}); "
             "import probe_host_adamw as p; "
             f"o = p.PROGRAMS[{program!r}](p.OptimizerConfig()); "
             f"x = {{'w': p.jax.ShapeDtypeStruct({tuple(shape)!r}, {dtype!r})}}; "
             "c = o.lower(x, o.abstract_state(x)).compile(); "  # the one program compiled
             "print(json.dumps({'big': p.big_loops(c), **p.structure(c)}))")
    # As a GPU host's trainer compiles it: XLA:CPU's concurrency-optimized scheduler as jax
    # leaves it (the trainer turns it off only where there is no GPU: cli.CPU_SCHEDULER_FLAG).
    flags = os.environ.get("XLA_FLAGS", "").replace(CPU_SCHEDULER_FLAG, "")
    env = {**os.environ, "XLA_FLAGS": flags, "TF_CPP_MIN_LOG_LEVEL": "0",
           "TF_CPP_VMODULE": "thunk_executor=6"}
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                          env=env, check=True)
    found = json.loads(done.stdout.strip().splitlines()[-1])
    graphs, graph = [], None
    for line in done.stderr.splitlines():
        if line.startswith("ThunkExecutor: #thunks="):
            graph = {}
            graphs.append(graph)
        elif graph is not None and (thunk := re.search(
                r"op_name=(\S+), kind=\S+, dependencies=\[([^\]]*)\]", line)):
            graph[thunk.group(1)] = [d.strip() for d in thunk.group(2).split(",") if d.strip()]
    if not graphs:
        raise RuntimeError("no thunk graph logged (TF_CPP_VMODULE ignored?)")
    graph, big = graphs[-1], set(found["big"])
    level: dict = {}

    def depth(name):  # loops before it on its longest chain
        if name not in level:
            level[name] = max((depth(d) + (d in big) for d in graph.get(name, ())), default=0)
        return level[name]

    counts: dict = {}
    for name in graph:
        if name in big:
            counts[depth(name)] = counts.get(depth(name), 0) + 1
    return {"loops_side_by_side": max(counts.values(), default=0),
            "leaf_loops": found["loops"], "tasks_per_loop": found["tasks_per_loop_max"]}


def big_loops(compiled) -> list[str]:
    """The names of the update's loops over more than 4096 elements (``structure``'s)."""
    text = compiled.as_text()
    names = []
    for line in text[text.index("\nENTRY"):].splitlines():
        shape = re.search(r"%(\S+) = \w+\[([\d,]*)\]", line)
        if (" fusion(" in line and shape and shape.group(2)
                and np.prod([int(d) for d in shape.group(2).split(",")]) > 4096):
            names.append(shape.group(1))
    return names


def make_case(num_params: int, leaf: int, cols: int, dtype, program: str):
    """(optimizer, params, state, gradients as numpy): ``num_params // leaf`` leaves of
    ``leaf`` parameters each, ``leaf // cols`` rows of ``cols`` (``leaf_shapes``)."""
    optimizer = PROGRAMS[program](OptimizerConfig())  # clipping on (max_grad_norm 1.0)
    host = optimizer.host_sharding
    rng = np.random.default_rng(0)
    params = {f"w{i}": jax.device_put(
        jnp.asarray(rng.standard_normal(s, np.float32) * 0.02, dtype), host)
        for i, s in enumerate(leaf_shapes(num_params, leaf, cols))}
    state = optimizer.init(params)
    state = with_hyperparams(state, hyperparams_at(OptimizerConfig(), lambda _: 1e-3, 0))
    grads = {k: np.asarray(jnp.asarray(rng.standard_normal(v.shape, np.float32) * 1e-3, dtype))
             for k, v in params.items()}  # numpy: each device_put below makes a new array
    return optimizer, params, state, grads


def time_update(num_params: int, leaf: int, cols: int, dtype, program: str, repeats: int,
                structure_only: bool = False) -> dict:
    optimizer, params, state, grads_host = make_case(num_params, leaf, cols, dtype, program)
    num_params = sum(g.size for g in grads_host.values())  # whole leaves of whole rows
    leaf = next(iter(grads_host.values())).size
    host = optimizer.host_sharding
    started = time.perf_counter()
    compiled = optimizer.lower(params, state).compile()
    compile_s = time.perf_counter() - started
    case = {"program": program, "num_params": num_params, "leaf_params": leaf, "cols": cols,
            "dtype": jnp.dtype(dtype).name, "compile_s": compile_s, **structure(compiled)}
    if structure_only:  # and the loops one leaf's update may run at once (a child compiles)
        return {**case, **loops_side_by_side(program, next(iter(params.values())).shape,
                                             case["dtype"])}
    optimizer.compile(params, state)
    update, step = [], []
    for i in range(repeats + 1):
        grads = jax.device_put(grads_host, host)  # donated: a fresh host copy per call
        jax.block_until_ready(grads)
        executable = optimizer._executable(grads, state)
        started = time.perf_counter()
        working, state = executable(grads, state)
        jax.block_until_ready((working, state))
        elapsed = time.perf_counter() - started
        grads = jax.device_put(grads_host, host)
        jax.block_until_ready(grads)
        started = time.perf_counter()
        working, state = optimizer.step(grads, state)  # its own host copy of the gradients
        jax.block_until_ready((working, state))
        if i:  # the first call warms up
            update.append(elapsed)
            step.append(time.perf_counter() - started)
    median = statistics.median(update)
    return {**case, "median_s": median, "min_s": min(update), "max_s": max(update),
            "step_median_s": statistics.median(step), "repeats": repeats,
            "seconds_per_param": median / num_params,
            "step_seconds_per_param": statistics.median(step) / num_params}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="4e6,1.6e7,6.4e7")
    parser.add_argument("--leaf", type=float, default=4e6)
    parser.add_argument("--cols", type=int, default=2048,
                        help="the leaves' last dimension: a leaf is --leaf // --cols rows of it")
    parser.add_argument("--programs", default="chunked,previous")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--structure-only", action="store_true",
                        help="compile and report each program's loops, no timing")
    parser.add_argument("--machine", default="",
                        help="what the machine is, recorded before its CPU count and model")
    parser.add_argument("--out-dir")
    args = parser.parse_args()
    sizes = [int(float(s)) for s in args.sizes.split(",")]
    programs = args.programs.split(",")
    load_before = os.getloadavg()  # a shared machine: what else ran, as the kernel counts it
    cases = []
    for dtype in args.dtypes.split(","):
        for size in sizes:
            for program in programs:
                case = time_update(size, int(args.leaf), args.cols, jnp.dtype(dtype), program,
                                   args.repeats, args.structure_only)
                print(f"[host_adamw] {case}", file=sys.stderr, flush=True)
                cases.append(case)
    gpus = [d for d in jax.devices() if d.platform != "cpu"]
    cores = len(os.sched_getaffinity(0))
    machine = (f"{args.machine + ': ' if args.machine else ''}{os.cpu_count()} CPUs "
               f"({cores} schedulable), {cpu_model()}, {len(gpus)} GPUs")
    fields = dict(machine=machine, cpu_count=os.cpu_count(), schedulable_cpus=cores,
                  cpu_model=cpu_model(), load_average_before=load_before,
                  load_average_after=os.getloadavg(), cases=cases)
    if args.structure_only:
        emulated = os.environ.get("FAKE_NCPUS") and "fake_ncpus" in os.environ.get("LD_PRELOAD",
                                                                                   "")
        path = harness.write_record(harness.new_record(
            "host_adamw_structure", **fields,
            emulated=f"FAKE_NCPUS={os.environ['FAKE_NCPUS']} (scripts/probes/fake_ncpus.c)"
            if emulated else None), args.out_dir)
        for case in cases:
            print(f"{case['program']:>8} {case['dtype']:>8} {case['num_params']:.2e}: "
                  f"{case['loops']} loops of {case['tasks_per_loop_min']}-"
                  f"{case['tasks_per_loop_max']} tasks, a leaf's {case['loops_side_by_side']} "
                  f"side by side, temp {case['temp_bytes']:,} B ({cores} schedulable CPUs)")
        print(f"record: {path}")
        return
    first = [c for c in cases if c["program"] == programs[0]]
    rated = [c for c in first if c["dtype"] == "bfloat16"] or first
    largest = max(rated, key=lambda c: c["num_params"])
    record = harness.new_record("host_adamw", **fields,
                                seconds_per_param=largest["seconds_per_param"],
                                rate_from={"program": programs[0], "dtype": largest["dtype"],
                                           "num_params": largest["num_params"]})
    path = harness.write_record(record, args.out_dir)
    for case in cases:
        print(f"{case['program']:>8} {case['dtype']:>8} {case['num_params']:.2e}: update "
              f"{case['seconds_per_param'] * 1e9:.3f} s per 1e9 (min "
              f"{case['min_s'] / case['num_params'] * 1e9:.3f}), step "
              f"{case['step_seconds_per_param'] * 1e9:.3f}; {case['loops']} loops of "
              f"<= {case['tasks_per_loop_max']} tasks")
    print(f"{largest['seconds_per_param'] * 1e9:.3f} s per 1e9 parameters ({machine}); "
          f"record: {path}")


if __name__ == "__main__":
    main()
