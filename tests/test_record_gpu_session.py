"""scripts/record_gpu_session.py reads a GPU driver's commands as the driver wrote them (an
environment prefix, ``python3 -m peakflat_jax.cli train``, flags with values) and records the
plan that ``make_plan`` gives the same config and overrides."""

from __future__ import annotations

from _helpers import load_script

from peakflat_jax.config import load_config
from peakflat_jax.plan import make_plan
from peakflat_jax.train.data import data_stats

record = load_script("record_gpu_session")


def test_a_driver_s_command_is_planned_as_its_config_and_overrides(monkeypatch):
    monkeypatch.delenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", raising=False)
    command = ("XLA_FLAGS=--xla_gpu_experimental_parallel_async_compute_limit=8 python3 -m "
               "peakflat_jax.cli train h200-1 train.steps=5 operators.optimizer_offload=true "
               "--run-dir /tmp/r1 operators.layer_loop=unrolled train.checkpoints=false "
               "--no-progress --overwrite")
    assert record.train_words(command)[:2] == ["h200-1", "train.steps=5"]
    config = load_config("h200-1", ["train.steps=5", "operators.optimizer_offload=true",
                                    "operators.layer_loop=unrolled", "train.checkpoints=false"])
    plan = make_plan(config, 1, platform="gpu", device_kind="NVIDIA H200", baseline=False,
                     search_context=False, device_memory=int(132.8 * 2**30),
                     host_memory=int(124.8 * 2**30), data_stats=data_stats(config.data))
    got = record.plan_gib(command)
    assert got["plan_device_gib"] == round(plan.total_bytes / 2**30, 2)
    assert got["plan_host_gib"] == round(plan.host_bytes / 2**30, 2)
    assert record.plan_gib("python3 scripts/probes/probe_host_link.py --gib 4") is None


def test_the_host_sampler_log_is_summarized(tmp_path):
    """scripts/host_samples.py on a log as the driver's sampler writes it (the process's fields
    tab-separated as /proc gives them, absent before the process starts): the start's available
    memory, the largest resident set, its high-water mark, and what the machine lost beyond it
    at that sample."""
    script = load_script("host_samples")
    gib = 2**20  # kB
    lines = [f"100  MemAvailable: {125 * gib} kB",
             f"101 VmHWM:\t {10 * gib} kB VmRSS:\t {10 * gib} kB  MemAvailable: {114 * gib} kB",
             f"102 VmHWM:\t {100 * gib} kB VmRSS:\t {100 * gib} kB  MemAvailable: {23 * gib} kB",
             f"103 VmHWM:\t {100 * gib} kB VmRSS:\t {60 * gib} kB  MemAvailable: {64 * gib} kB",
             "104"]
    assert script.summarize(lines) == {
        "samples": 4, "available_at_start_gib": 125.0, "min_mem_available_gib": 23.0,
        "max_vmrss_gib": 100.0, "max_vmhwm_gib": 100.0, "outside_at_max_rss_gib": 2.0}
