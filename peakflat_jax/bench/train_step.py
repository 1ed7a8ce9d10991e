"""Benchmark of a config's whole training step: the operators composed, the optimizer
overlapped with the next forward, applied after the backward, or removed (the floor); each case
in a fresh process, with the planner's bound beside the measured peak.

    peakflat bench train_step --preset gpu    # one H200: h200-1 and a 2e9-parameter model,
                                              # optimizer overlapped / after backward / removed
    peakflat bench train_step --preset cpu    # a small size, to check the harness

A case: ``config`` (a preset's name or a path), ``overrides`` (``section.field=value``),
``mode`` (``overlap``, ``plain``: the optimizer's own program after the gradients,
``no_optimizer``: the gradient program alone, ``device``: optax's AdamW not streamed, the
fused step on the device or, with ``optimizer.update_on: host_cpu``, the host CPU's update after
the gradient program, ``auto``: the config's operators as they are), ``steps`` timed after
``warmup``. Step times are medians of wall time per step, each step waiting for its loss; the
batches come from the data pipeline, made before the clock starts.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time

import jax
import numpy as np

from peakflat_jax.bench import harness

MODES = {
    "overlap": ["operators.optimizer_offload=true", "operators.optimizer_overlap=true"],
    "plain": ["operators.optimizer_offload=true", "operators.optimizer_overlap=false"],
    "no_optimizer": ["operators.optimizer_offload=true", "operators.optimizer_overlap=false"],
    "device": ["operators.optimizer_offload=false"],
    "auto": [],  # the config's own operators (auto: the planner's choice)
}


def presets() -> dict[str, list[dict]]:
    def modes(config, overrides, **extra):
        return [dict(config=config, overrides=overrides, mode=mode, **extra)
                for mode in ("overlap", "plain", "no_optimizer")]

    two_billion = ["model.num_layers=8", "model.num_experts=64", "model.expert_ffn=2048",
                   "model.hidden=2048", "data.seq_len=16384"]
    return {
        "gpu": [*modes("h200-1", [], steps=6, warmup=2),
                *modes("h200-1", two_billion, steps=6, warmup=2)],
        "cpu": modes("tiny", ["model.num_layers=2", "data.seq_len=64"], steps=2, warmup=1),
    }


def run_case(case: dict) -> dict:
    from peakflat_jax.hf.config import load_config
    from peakflat_jax.model.size import model_flops
    from peakflat_jax.train.machine import enable_compilation_cache, set_pool_cap
    from peakflat_jax.train.metrics import device_memory_bytes, host_peak_resident_bytes
    from peakflat_jax.train.trainer import DoesNotFit, Trainer

    mode = case["mode"]
    config = load_config(case["config"], [*case.get("overrides", []), *MODES[mode],
                                          "train.checkpoint_every=0"])
    set_pool_cap(config)  # as peakflat train does, before the backend starts
    enable_compilation_cache()  # the modes of one config share its gradient program
    trainer = Trainer(config, run_dir=tempfile.mkdtemp())
    state = trainer.initial_state()
    warmup, steps = case.get("warmup", 1), case.get("steps", 5)
    batches = [trainer.global_batch(next(trainer.batches)) for _ in range(warmup + steps)]
    started = time.perf_counter()
    try:
        trainer.compile(state, batches[0])
    except DoesNotFit as error:
        return {"error": "DoesNotFit", "oom": True, "message": str(error)[:2000]}
    result = {"compile_s": time.perf_counter() - started, "xla_plan_bytes": trainer.xla_plan.total,
              "parameters": _parameter_count(state.params),
              "plan_bytes": trainer.plan.total_bytes, "optimizer": trainer.optimizer_placement()}
    samples, losses = [], []
    for i, batch in enumerate(batches):
        started = time.perf_counter()
        if mode == "no_optimizer":
            metrics, grads, extras = trainer._gradient_step(state.params, state.extras, batch)
            state = type(state)(state.params, extras, state.opt_state, state.step + 1)
            del grads
        else:
            state, metrics = trainer.step(state, batch)
        losses.append(float(metrics["loss"]))  # waits for the step
        if i >= warmup:
            samples.append(time.perf_counter() - started)
    tokens = config.data.batch_size * config.data.seq_len
    median = statistics.median(samples)
    # Model FLOPs of the timed batches' own documents (model.size's convention).
    flops = statistics.mean(model_flops(config.model, np.asarray(batch["segment_ids"]))
                            for batch in batches[warmup:])
    tflops = flops / median / len(jax.devices()) / 1e12
    return {**result, "step_s": median, "step_min_s": min(samples),
            "step_max_s": max(samples), "tokens_per_s": tokens / median,
            "model_tflops_per_device": tflops, "peak_bytes": harness.peak_bytes_over(
                jax.local_devices()), "host_peak_bytes": host_peak_resident_bytes(),
            "limit_bytes": device_memory_bytes(), "losses": losses}


def _parameter_count(params) -> int:
    return sum(leaf.size for leaf in jax.tree.leaves(params))


def summarize(record: dict) -> str:
    rows = []
    floors = {}
    for case in record["cases"]:
        if case.get("mode") == "no_optimizer" and "error" not in case:
            floors[(case["config"], tuple(case.get("overrides", [])))] = case["step_s"]
    for case in record["cases"]:
        key = (case["config"], tuple(case.get("overrides", [])))
        if "error" in case:
            rows.append([case["config"], " ".join(case.get("overrides", [])) or "-",
                         case["mode"], case["error"], "-", "-", "-", "-"])
            continue
        floor = floors.get(key)
        exposed = "-" if floor is None else f"{(case['step_s'] - floor) * 1e3:.1f} ms"
        rows.append([case["config"], " ".join(case.get("overrides", [])) or "-", case["mode"],
                     f"{case['step_s'] * 1e3:.1f} ms", exposed,
                     harness.format_bytes(case.get("peak_bytes")),
                     harness.format_bytes(case.get("plan_bytes")),
                     f"{case['model_tflops_per_device']:.1f}"])
    header = f"train_step on {record.get('device')}, {record['date']}\n"
    return header + harness.format_table(
        ["config", "overrides", "mode", "step", "over the floor", "peak", "plan",
         "model TFLOP/s/dev"], rows)


if __name__ == "__main__" and "--case" in sys.argv:
    harness.case_main(run_case)
