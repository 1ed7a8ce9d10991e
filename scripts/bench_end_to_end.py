"""End to end on one machine: the longest context each stack trains, its tokens/s, MFU and peak
memory at given contexts; every probe a fresh process, the record rewritten after each.

Stacks (``--stacks``, ``--longest``):

* ``peakflat``: ours, ``operators: auto`` (the planner's choice at each context);
* ``baseline``: ours with the four operators off, AdamW on the device: the ablation;
* ``maxtext:SETTING[:MOE]``: MaxText (``peakflat_jax.bench.maxtext``): the same model in its
  Mixtral block, with one of its memory settings (``SETTINGS``: ``default``, ``offload``,
  ``offload+optimizer``, ``offload+bf16``) and MoE paths (``MOE_PATHS``, default tokamax),
  from the wheels ``scripts/maxtext/setup.sh`` installed (``--maxtext-site``).

A probe trains ``--steps`` steps of one sequence of the context per data-parallel rank; it fits when
every step ran. The step time is the median over the steps after the first (ours: each step waits
for its loss; MaxText: the stamps of its consecutive step lines). Model FLOPs are one formula for
both stacks (``model.size``: attention within documents, no recompute), each over its own model; MFU
is over the vendor's dense bf16 peak (``--peak-tflops``, 989.4 for an H100 or H200), and beside it,
labelled, over the measured matmul rate (``--measured-tflops``).

The longest context (``--longest STACK``) is searched from ``--start``: doubled until a probe
misses, then narrowed by the memory the fitting probes used (the device peak grows about
linearly with the context; the next probe is where the line meets the device's limit) until
the first miss is within ``--resolution`` (5%) of the last fit.

    python scripts/bench_end_to_end.py --config h200-e2e --stacks peakflat maxtext:offload \
        --at 32768 65536 --longest maxtext:offload --deadline-min 20
    python scripts/bench_end_to_end.py --config tiny --stacks peakflat --longest peakflat \
        --start 256 --multiple 64 --device-memory 0.05     # the harness, on CPU

The parent process never starts a backend: every device figure comes from a probe.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import shlex
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from peakflat_jax import memory  # noqa: E402
from peakflat_jax.bench import maxtext  # noqa: E402
from peakflat_jax.hf.config import load_config  # noqa: E402
from peakflat_jax.model.size import model_flops_per_token  # noqa: E402

RESULTS = ROOT / "scripts" / "results"
PEER_ENVIRONMENT = dict(os.environ)
"""The environment MaxText's probes start from: this process's before ours is set up (ours runs as
``peakflat`` sets it up, ``cli.prepare_environment``)."""
OPERATORS_OFF = ["operators.moe_dispatch=ep", "operators.loss=materialized",
                 "operators.offload=none", "operators.optimizer_offload=false",
                 "train.device_memory_gib=1000000", "train.host_memory_gib=1000000"]
"""The ablation: our stack with its four operators off, the planner's check lifted (XLA and the
allocator say where it stops)."""


def probe(stack: str, context: int, args) -> dict:
    """One probe of ``stack`` at ``context`` tokens in a fresh process: its summary."""
    started = time.monotonic()
    print(f"[end_to_end] {stack} at {context:,} ...", file=sys.stderr, flush=True)
    if stack.startswith("maxtext"):
        result = probe_maxtext(stack, context, args)
        model = maxtext.comparable_model(args.model)
    else:
        result = probe_ours(stack, context, args)
        model = args.model
    sequences = 1 if stack.startswith("maxtext") else args.batch
    flops = model_flops_per_token(model, context) * context * sequences
    step = result.get("step_s")
    fits = bool(step) and result.get("steps_done", 0) >= args.steps and not result.get("error")
    summary = {"stack": stack, "context": context, "fits": fits, "wall_s": round(
        time.monotonic() - started, 1), **result}
    if fits:
        summary.update(tokens_per_s=context * sequences / step, model_tflops=flops / step / 1e12,
                       mfu=flops / step / (args.peak_tflops * 1e12),
                       mfu_of_measured_rate=flops / step / (args.measured_tflops * 1e12))
    print(f"[end_to_end] -> {json.dumps(short(summary))}", file=sys.stderr, flush=True)
    return summary


def probe_ours(stack: str, context: int, args) -> dict:
    """``peakflat_jax.bench.train_step``'s case for our stack (``auto``) or the ablation."""
    overrides = [*args.overrides, f"data.seq_len={context}", f"data.batch_size={args.batch}",
                 "data.source=synthetic"]
    if stack == "baseline":
        overrides += OPERATORS_OFF
    elif args.device_memory:  # the plan's budget (a CPU's: required)
        overrides.append(f"train.device_memory_gib={args.device_memory}")
    case = dict(config=args.config, overrides=overrides,
                mode="device" if stack == "baseline" else "auto", steps=args.steps - 1,
                warmup=1)
    result = memory.run_in_fresh_process("peakflat_jax.bench.train_step",
                                         ["--case", json.dumps(case)], timeout=args.timeout)
    if "losses" in result:
        result["steps_done"] = len(result["losses"])
    if result.get("error") == "DoesNotFit":  # refused by the plan or by XLA's: memory
        result["oom"] = True
    over = (args.device_memory and (result.get("xla_plan_bytes") or 0)
            > args.device_memory * 2**30)
    if over:  # a CPU runs out of nothing: XLA's plan over the budget is the miss
        result.update(error="XLA's plan over --device-memory", oom=True)
    return result


def probe_maxtext(stack: str, context: int, args) -> dict:
    """MaxText's training of ``--steps`` steps at ``context``, in a fresh process from a clean
    working directory, through ``scripts/maxtext/run_maxtext.py``; what its log says. With its
    optimizer state offloaded, the launch-side fixes of ``run_maxtext.py`` apply: the first
    step's counter read from a device copy, and where the donation of the state still fails,
    the optimizer's scalars kept on the device too (each attempt recorded)."""
    _, setting, *rest = stack.split(":") + ([] if stack.count(":") else ["offload"])
    moe = rest[0] if rest else args.maxtext_moe
    moe_keys, moe_flag = maxtext.MOE_PATHS[moe]
    keys = {**maxtext.model_keys(args.model), **maxtext.setting_keys(setting, context),
            **moe_keys, **maxtext.RUN_KEYS, "steps": args.steps, "max_target_length": context}
    keys.update(args.maxtext_keys)
    env = {**PEER_ENVIRONMENT, **maxtext.ENVIRONMENT, "PYTHONPATH": args.maxtext_site,
           "XLA_FLAGS": " ".join(filter(None, [PEER_ENVIRONMENT.get("XLA_FLAGS", ""),
                                               maxtext.XLA_FLAGS, moe_flag]))}
    offloads = maxtext.SETTINGS[setting]
    if offloads.get("optimizer_memory_host_offload") or offloads.get(
            "decoder_layer_input") == "offload":
        env["XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"] = str(args.maxtext_host_pool_gib)
    attempts = [""]
    if offloads.get("optimizer_memory_host_offload"):
        attempts = ["first_step", "first_step,scalars_on_device"]
    base = pathlib.Path(args.maxtext_site) / "maxtext" / "configs" / "base.yml"
    for fixes in attempts:
        work = pathlib.Path(tempfile.mkdtemp(prefix="maxtext-"))
        keys.update(run_name=f"probe{context}", base_output_directory=str(work / "out"))
        command = [sys.executable, str(ROOT / "scripts" / "maxtext" / "run_maxtext.py"),
                   str(base), *maxtext.overrides(keys)]
        log = work / "log.txt"
        try:
            with log.open("w") as out:
                completed = subprocess.run(command, cwd=work, env={**env, "PEER_FIXES": fixes},
                                           stdout=out, stderr=subprocess.STDOUT,
                                           timeout=args.timeout)
            returncode = completed.returncode
        except subprocess.TimeoutExpired:
            returncode = "timeout"
        text = log.read_text(errors="replace")
        result = {**maxtext.parse_log(text), "returncode": returncode, "setting": setting,
                  "moe": moe, "fixes": fixes, "command": shlex.join(command[1:])}
        if returncode != 0:
            result["error"] = f"exit {returncode}"
            result["log_tail"] = text[-3000:]
        if args.keep_logs:
            keep = pathlib.Path(args.keep_logs)
            keep.mkdir(parents=True, exist_ok=True)
            name = f"{stack.replace(':', '_')}_{context}{'_' + fixes if fixes else ''}.log"
            (keep / name.replace(",", "+")).write_text(text)
        if "Donation requested for buffer with external reference" not in text:
            break
        result["donation_error"] = True
        print(f"[end_to_end] {stack} at {context:,}: the donation error with fixes "
              f"{fixes or 'none'}", file=sys.stderr, flush=True)
    return result


def next_context(fits: list[dict], misses: list[dict], args) -> int | None:
    """The next context of a longest-context search (module doc), or None when done."""
    def rounded(value: float) -> int:
        return max(args.multiple, int(value) // args.multiple * args.multiple)

    if not fits:
        lowest = min(m["context"] for m in misses)
        return None if lowest <= args.multiple else rounded(lowest / 2)
    best = max(fits, key=lambda p: p["context"])
    above = [m["context"] for m in misses if m["context"] > best["context"]]
    first_miss = min(above) if above else None
    if first_miss is not None and first_miss <= best["context"] * (1 + args.resolution):
        return None
    guess = linear_guess(fits, args)
    if first_miss is None:
        target = best["context"] * 2 if guess is None else min(guess, best["context"] * 4)
        target = max(target, best["context"] * (1 + args.resolution))
    else:
        low, high = best["context"] * (1 + args.resolution / 2), first_miss / (
            1 + args.resolution / 2)
        target = (best["context"] + first_miss) / 2 if guess is None else min(max(guess, low),
                                                                              high)
    context = rounded(target)
    if context <= best["context"] or (first_miss is not None and context >= first_miss):
        return None
    return context


def linear_guess(fits: list[dict], args) -> float | None:
    """Where the fitting probes' device peaks (XLA's plan where the allocator keeps none), on a
    line through the two longest (or through the longest and the peak's part that does not
    grow, ``--fixed-gib``), reach the device's limit (the probes', else ``--device-memory``,
    else ``--limit-gib``), less ``--headroom``."""
    points = sorted((p["context"], p.get("peak_bytes") or p.get("xla_plan_bytes")
                     or p.get("xla_estimate_bytes")) for p in fits)
    points = [(c, b) for c, b in points if b]
    limit = (max(p.get("limit_bytes") or 0 for p in fits)
             or (args.device_memory or args.limit_gib) * 2**30)
    if not points or not limit:
        return None
    (c1, b1), (c2, b2) = (points[-2], points[-1]) if len(points) > 1 else (
        (0, args.fixed_gib * 2**30), points[-1])
    if c2 == c1 or b2 <= b1:
        return None
    slope = (b2 - b1) / (c2 - c1)
    return c2 + (limit * (1 - args.headroom) - b2) / slope


def longest(stack: str, args, record: dict) -> int | None:
    """The longest context ``stack`` trains (``next_context``'s search), every probe recorded."""
    fits, misses = [], []
    for p in record["probes"]:  # what an earlier part of this run already measured
        if p["stack"] == stack:
            (fits if p["fits"] else misses).append(p)
    context = args.start if not fits and not misses else next_context(fits, misses, args)
    while context is not None and not out_of_time(args):
        result = probe(stack, context, args)
        record["probes"].append(result)
        (fits if result["fits"] else misses).append(result)
        save(record, args)
        if not result["fits"] and not result.get("oom"):
            print(f"[end_to_end] {stack} at {context:,} failed for another reason than memory: "
                  f"{result.get('error')}; the search stops", file=sys.stderr, flush=True)
            break
        context = next_context(fits, misses, args)
    best = max((p["context"] for p in fits), default=None)
    first_miss = min((m["context"] for m in misses if best is None or m["context"] > best),
                     default=None)
    record["longest"][stack] = {"context": best, "first_miss": first_miss,
                                "resolved": bool(best and first_miss and first_miss
                                                 <= best * (1 + args.resolution))}
    save(record, args)
    return best


def out_of_time(args) -> bool:
    return args.deadline is not None and time.monotonic() > args.deadline


def short(summary: dict) -> dict:
    return {k: v for k, v in summary.items() if k not in ("log_tail", "stderr_tail", "losses",
                                                          "step_gaps_s", "command",
                                                          "message")}


def save(record: dict, args) -> None:
    args.path.write_text(json.dumps(record, indent=1) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--override", dest="overrides", action="append", default=[],
                        help="a section.field=value override for our stacks (repeatable)")
    parser.add_argument("--stacks", nargs="+", default=[], help="stacks probed at --at")
    parser.add_argument("--at", nargs="*", type=int, default=[], help="contexts to probe")
    parser.add_argument("--at-longest-of", nargs="*", default=[],
                        help="also probe --stacks at these stacks' longest context")
    parser.add_argument("--scales", nargs="*", type=float, default=[1.0],
                        help="... times these factors (e.g. 1 4)")
    parser.add_argument("--longest", nargs="*", default=[], help="stacks to search")
    parser.add_argument("--start", type=int, default=32768)
    parser.add_argument("--multiple", type=int, default=1024)
    parser.add_argument("--resolution", type=float, default=0.05)
    parser.add_argument("--headroom", type=float, default=0.02)
    parser.add_argument("--fixed-gib", type=float, default=0.0,
                        help="the part of a peak that does not grow with the context (a first "
                             "guess where one probe fits)")
    parser.add_argument("--limit-gib", type=float, default=0.0,
                        help="the device's limit where the probes do not report one")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--device-memory", type=float, help="GiB per device (CPU: required)")
    parser.add_argument("--peak-tflops", type=float, default=989.4)
    parser.add_argument("--measured-tflops", type=float, default=760.0)
    parser.add_argument("--timeout", type=float, default=900, help="seconds per probe")
    parser.add_argument("--deadline-min", type=float, help="start no probe after this")
    parser.add_argument("--maxtext-site", default="/tmp/maxtext-site")
    parser.add_argument("--maxtext-moe", default="tokamax", choices=sorted(maxtext.MOE_PATHS))
    parser.add_argument("--maxtext-key", dest="maxtext_keys", action="append", default=[],
                        help="another MaxText key=value for every MaxText probe (repeatable)")
    parser.add_argument("--maxtext-host-pool-gib", type=int, default=100)
    parser.add_argument("--keep-logs", help="a folder for every MaxText probe's log")
    parser.add_argument("--out", help="the record's path (default scripts/results/...); an "
                                      "existing record there is continued")
    args = parser.parse_args()
    from peakflat_jax.cli import prepare_environment

    prepare_environment()  # our probes' processes as `peakflat` runs them; no backend here
    args.deadline = (time.monotonic() + 60 * args.deadline_min if args.deadline_min else None)
    config = load_config(args.config, args.overrides)
    args.model = config.model
    args.batch = max(1, config.mesh.data)  # one sequence per data-parallel rank
    args.maxtext_keys = dict(word.split("=", 1) for word in args.maxtext_keys)
    now = datetime.datetime.now(datetime.timezone.utc)
    args.path = pathlib.Path(args.out) if args.out else (
        RESULTS / f"end_to_end_{args.config}_{now:%Y%m%d-%H%M%S}.json")
    args.path.parent.mkdir(parents=True, exist_ok=True)
    record = json.loads(args.path.read_text()) if args.path.exists() else {
              "benchmark": "end_to_end", "config": args.config, "overrides": args.overrides,
              "command": shlex.join(["scripts/bench_end_to_end.py", *sys.argv[1:]]),
              "date": now.isoformat(timespec="seconds"),
              "commit": os.environ.get("PEAKFLAT_COMMIT", ""),
              "flops": "model.size: 6 x active params x tokens + 12 x layers x heads x head_dim "
                       "x causal pairs within documents; each stack over its own model",
              "peak_tflops": args.peak_tflops, "measured_tflops": args.measured_tflops,
              "maxtext": {"version": maxtext.MAXTEXT_VERSION,
                          "model_keys": maxtext.model_keys(args.model),
                          "unmatched": maxtext.unmatched(args.model),
                          "extra_keys": args.maxtext_keys},
              "probes": [], "longest": {}}
    record.setdefault("commands", []).append(shlex.join(["scripts/bench_end_to_end.py",
                                                         *sys.argv[1:]]))
    for stack in args.longest:
        longest(stack, args, record)
    longest_of = [record["longest"].get(s, {}).get("context") for s in args.at_longest_of]
    contexts = list(args.at) + [int(c * scale) // args.multiple * args.multiple
                                for c in longest_of if c for scale in args.scales]
    for context in dict.fromkeys(c for c in contexts if c):
        for stack in args.stacks:
            done = any(p["stack"] == stack and p["context"] == context
                       for p in record["probes"])
            if done or out_of_time(args):
                continue
            record["probes"].append(probe(stack, context, args))
            save(record, args)
    save(record, args)
    print(json.dumps({"longest": record["longest"],
                      "probes": [short(p) for p in record["probes"]]}, indent=1))
    print(f"record: {args.path}", file=sys.stderr)


if __name__ == "__main__":
    main()
