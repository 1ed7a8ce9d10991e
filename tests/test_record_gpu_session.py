"""scripts/record_gpu_session.py reads a GPU driver's commands as the driver wrote them (an
environment prefix, ``python3 -m peakflat_jax.cli train``, flags with values) and records the
plan that ``make_plan`` gives the same config and overrides."""

from __future__ import annotations

import importlib.util
import pathlib

from peakflat_jax.config import load_config
from peakflat_jax.plan import make_plan

SCRIPT = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "record_gpu_session.py"
spec = importlib.util.spec_from_file_location("record_gpu_session", SCRIPT)
record = importlib.util.module_from_spec(spec)
spec.loader.exec_module(record)


def test_a_driver_s_command_is_planned_as_its_config_and_overrides(monkeypatch):
    monkeypatch.delenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", raising=False)
    command = ("XLA_FLAGS=--xla_gpu_experimental_parallel_async_compute_limit=8 python3 -m "
               "peakflat_jax.cli train h200-1 train.steps=5 operators.optimizer_offload=true "
               "--run-dir /tmp/r1 operators.layer_loop=unrolled train.checkpoints=false "
               "--no-progress --overwrite")
    assert record.train_words(command)[:2] == ["h200-1", "train.steps=5"]
    plan = make_plan(load_config("h200-1", ["train.steps=5", "operators.optimizer_offload=true",
                                            "operators.layer_loop=unrolled",
                                            "train.checkpoints=false"]),
                     1, platform="gpu", baseline=False, search_context=False,
                     device_memory=int(132.8 * 2**30))
    got = record.plan_gib(command)
    assert got["plan_device_gib"] == round(plan.total_bytes / 2**30, 2)
    assert got["plan_host_gib"] == round(plan.host_bytes / 2**30, 2)
    assert record.plan_gib("python3 scripts/probes/probe_host_link.py --gib 4") is None
