"""End to end: how long a context, how much throughput and how large a batch each stack trains
with: ours (``operators: auto``, the planner's choice at each probe, held to its plan: a probe
the planner refuses does not fit) against the standard stack of the same model (all four off:
full remat, cuDNN flash attention, the materialized loss, expert parallelism with the same
grouped matmul, the same mesh; optax's AdamW on the device where it fits, and where it does not
the same AdamW with its state in host memory updated by the host CPU, ZeRO-Offload's placement,
``optimizer.update_on: host_cpu``), which the planner does not hold back: it fits where XLA and
the allocator let it run (``train.device_memory_gib`` and ``train.host_memory_gib`` lifted).

    python scripts/bench_end_to_end.py --config h200-1 [--out-dir DIR]   # one H200
    python scripts/bench_end_to_end.py --config h200-2                   # two H200s
    python scripts/bench_end_to_end.py --config tiny --start 64 --step 64 --limit 1024 \
        --batch-context 128 --device-memory 0.05                         # the harness, on CPU

For each stack, every probe is a fresh process (``peakflat_jax.bench.train_step``'s case: a few
steps of the config at a context and batch), so that each peak is its own. A baseline probe runs
with the device optimizer first; where that does not fit (out of memory, or XLA's plan over the
device's memory) the probe runs again with the host-CPU optimizer, and where the device
optimizer missed at a context and batch no larger, it starts there. Each probe's summary says
which optimizer it used (``optimizer``) and, for the host CPU, why (``device_optimizer``).

1. the longest context (one sequence per data-parallel rank) it trains: doubling from
   ``--start`` until a probe does not fit (out of memory, or XLA's plan over the device's
   memory), then bisecting between the last fit and the first miss, in steps of ``--step``;
2. at the baseline's longest context: tokens/s and model TFLOP/s per device of both stacks;
3. at the operators' longest context: the same for the operators;
4. the largest batch (sequences per step) each trains at ``--batch-context`` tokens;
5. every probe's measured peak next to the planner's bound (``peakflat_jax.plan``).

Writes a JSON record (``end_to_end_<platform>_<date>.json``) and a PNG of peak memory and
tokens/s against context for both stacks. On a CPU nothing runs out of memory: give
``--device-memory`` (GiB) and the probes fit by XLA's plan against it.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

from peakflat_jax import memory
from peakflat_jax.bench import harness

STACKS = {
    "peakflat": [],
    # The planner's check lifted: the standard stack runs until XLA, the allocator or the host
    # stops it.
    "baseline": ["operators.moe_dispatch=ep", "operators.loss=materialized",
                 "operators.offload=none", "operators.optimizer_offload=false",
                 "train.device_memory_gib=1000000", "train.host_memory_gib=1000000"],
}
MODE = {"peakflat": "auto", "baseline": "device"}
HOST_CPU = ["optimizer.update_on=host_cpu"]
"""The baseline's optimizer where the device one does not fit: ZeRO-Offload's placement."""
FIELDS = ("step_s", "tokens_per_s", "model_tflops_per_device", "peak_bytes", "plan_bytes",
          "xla_plan_bytes", "compile_s", "error", "oom", "optimizer")


def probe(config: str, stack: str, context: int, batch: int, args) -> dict:
    """``args.steps`` steps of ``config`` at ``context`` tokens and ``batch`` sequences per
    data-parallel rank, in a fresh process; for the baseline, with the device optimizer and,
    where that does not fit, again with the host-CPU one (the module doc)."""
    if stack != "baseline":
        return summarize(stack, context, batch, run_probe(config, stack, context, batch, [],
                                                          args), args)
    missed = next(((c, b) for c, b in args.device_misses if c <= context and b <= batch), None)
    if missed is None:
        result = run_probe(config, stack, context, batch, [], args)
        summary = summarize(stack, context, batch, result, args)
        if summary["fits"] or not out_of_memory(result, args):
            return summary
        args.device_misses.append((context, batch))
        why = {k: summary[k] for k in ("error", "oom", "xla_plan_bytes")}
    else:  # memory grows with the context and the batch: it would miss here too
        why = f"skipped: the device optimizer did not fit at context {missed[0]}, batch " \
              f"{missed[1]}"
    summary = summarize(stack, context, batch, run_probe(config, stack, context, batch,
                                                         HOST_CPU, args), args)
    return {**summary, "device_optimizer": why}


def run_probe(config: str, stack: str, context: int, batch: int, extra: list[str],
              args) -> dict:
    """One fresh process of ``peakflat_jax.bench.train_step``'s case; its result."""
    overrides = [*args.overrides, *STACKS[stack], *extra, f"data.seq_len={context}",
                 f"data.batch_size={batch * args.data_degree}", "data.source=synthetic"]
    if args.device_memory and stack == "peakflat":  # the plan's budget (CPU: required)
        overrides.append(f"train.device_memory_gib={args.device_memory}")
    case = dict(config=config, overrides=overrides, mode=MODE[stack], steps=args.steps,
                warmup=1)
    print(f"[end_to_end] {stack} context {context} batch {batch} {' '.join(extra)}",
          file=sys.stderr, flush=True)
    return memory.run_in_fresh_process("peakflat_jax.bench.train_step",
                                       ["--case", json.dumps(case)], timeout=args.timeout)


def over_device_memory(result: dict, args) -> bool:
    """XLA's plan above ``--device-memory``: on a CPU, which runs out of nothing, the miss."""
    return bool(args.device_memory) and (result.get("xla_plan_bytes") or 0) > (
        args.device_memory * 2**30)


def out_of_memory(result: dict, args) -> bool:
    """A probe that did not fit for memory (the allocator's out-of-memory, the trainer's
    refusal by XLA's plan, or XLA's plan over ``--device-memory``), not for another error."""
    return bool(result.get("oom")) or ("error" not in result and over_device_memory(result,
                                                                                     args))


def summarize(stack: str, context: int, batch: int, result: dict, args) -> dict:
    fits = "error" not in result and not over_device_memory(result, args)
    summary = {"stack": stack, "context": context, "batch": batch, "fits": fits,
               **{k: result.get(k) for k in FIELDS}}
    print(f"[end_to_end] -> {json.dumps(summary)}", file=sys.stderr, flush=True)
    return summary


def largest(fits_at, start: int, step: int, limit: int) -> tuple[int | None, list[dict]]:
    """The largest multiple of ``step`` (>= start, <= limit) at which ``fits_at`` holds, by
    doubling then bisecting; and every probe made."""
    probes, last_fit, first_miss = [], None, None
    size = start
    while size <= limit:
        result = fits_at(size)
        probes.append(result)
        if not result["fits"]:
            first_miss = size
            break
        last_fit = size
        size *= 2
    if last_fit is None or first_miss is None:
        return last_fit, probes
    while first_miss - last_fit > step:
        middle = (last_fit + first_miss) // 2 // step * step
        if middle in (last_fit, first_miss):
            break
        result = fits_at(middle)
        probes.append(result)
        if result["fits"]:
            last_fit = middle
        else:
            first_miss = middle
    return last_fit, probes


def plot(record: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (memory_axis, speed_axis) = plt.subplots(1, 2, figsize=(11, 4))
    for stack, style in (("peakflat", "o-"), ("baseline", "s--")):
        points = sorted({p["context"]: p for p in record["probes"]
                         if p["stack"] == stack and p["fits"] and p["batch"] == 1}.items())
        if not points:
            continue
        contexts = [c for c, _ in points]
        peaks = [(p["peak_bytes"] or p["xla_plan_bytes"] or 0) / 2**30 for _, p in points]
        memory_axis.plot(contexts, peaks, style, label=stack)
        speed_axis.plot(contexts, [p["tokens_per_s"] for _, p in points], style, label=stack)
    memory_axis.axhline(record["device_memory_gib"] or 0, color="gray", lw=0.8)
    for axis, label in ((memory_axis, "peak device memory (GiB)"),
                        (speed_axis, "tokens / s")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("context (tokens, one sequence)")
        axis.set_ylabel(label)
        axis.legend()
    figure.suptitle(f"{record['config']} on {record['device']}")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--override", dest="overrides", action="append", default=[],
                        help="a section.field=value override for both stacks (repeatable)")
    parser.add_argument("--start", type=int, default=4096, help="the first context probed")
    parser.add_argument("--step", type=int, default=4096, help="bisection resolution")
    parser.add_argument("--limit", type=int, default=4 * 2**20, help="the longest context")
    parser.add_argument("--batch-context", type=int, default=32768)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per probe")
    parser.add_argument("--device-memory", type=float, help="GiB per device (CPU: required)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per probe")
    parser.add_argument("--out-dir")
    args = parser.parse_args()
    from peakflat_jax.cli import prepare_environment
    from peakflat_jax.config import load_config

    # As `peakflat` sets it up, for every probe's process: on a CPU, 8 devices and XLA:CPU's
    # concurrency-optimized scheduler off (without it, probes of tiny crashed: SIGSEGV/SIGABRT).
    prepare_environment()

    args.data_degree = load_config(args.config, args.overrides).mesh.data
    args.device_misses = []  # (context, batch) where the baseline's device optimizer missed

    record = harness.new_record("end_to_end", config=args.config, overrides=args.overrides,
                                device_memory_gib=args.device_memory, probes=[], stacks={})
    out_dir = pathlib.Path(args.out_dir) if args.out_dir else harness.RESULTS_DIR
    for stack in STACKS:
        longest, probes = largest(lambda t, s=stack: probe(args.config, s, t, 1, args),
                                  args.start, args.step, args.limit)
        record["probes"] += probes
        record["stacks"][stack] = {"longest_context": longest}
        path = harness.write_record(record, out_dir)
    baseline_longest = record["stacks"]["baseline"]["longest_context"]
    ours_longest = record["stacks"]["peakflat"]["longest_context"]
    ours_at = {p["context"] for p in record["probes"] if p["stack"] == "peakflat" and p["fits"]}
    if baseline_longest and baseline_longest not in ours_at:  # ours at the baseline's longest
        record["probes"].append(probe(args.config, "peakflat", baseline_longest, 1, args))
    for stack in STACKS:
        at = {p["context"]: p for p in record["probes"] if p["stack"] == stack and p["fits"]}
        record["stacks"][stack]["at_baseline_longest"] = at.get(baseline_longest)
        record["stacks"][stack]["at_own_longest"] = at.get(
            record["stacks"][stack]["longest_context"])
        batch, probes = largest(
            lambda b, s=stack: probe(args.config, s, args.batch_context, b, args), 1, 1, 4096)
        record["probes"] += probes
        record["stacks"][stack]["largest_batch_at"] = {"context": args.batch_context,
                                                       "sequences": batch}
        path = harness.write_record(record, out_dir)
    if baseline_longest and ours_longest:
        record["context_ratio"] = ours_longest / baseline_longest
        ours = record["stacks"]["peakflat"]["at_baseline_longest"]
        theirs = record["stacks"]["baseline"]["at_baseline_longest"]
        if ours and theirs:
            record["throughput_ratio_at_baseline_longest"] = (ours["tokens_per_s"]
                                                              / theirs["tokens_per_s"])
    path = harness.write_record(record, out_dir)
    plot(record, path.with_suffix(".png"))
    print(json.dumps({k: v for k, v in record.items() if k != "probes"}, indent=1))
    print(f"record: {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
