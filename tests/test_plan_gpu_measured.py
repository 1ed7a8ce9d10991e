"""The closed form against what was measured on an H200 (issue 25's rule: every measured peak at
or under the plan, and the plan within 1.2x of it). The measurements are the records under
scripts/results/ (XLA's GPU plans and the allocator's peaks of the trainer's programs, and the
buffer XLA:GPU gave cuDNN's attention backward): the first set taken with h200-1 at the segment
cap it had then (``data.max_segments: 64``), the second at today's (4), across contexts and
with each operator alone; nothing here runs on a GPU, and no number is restated from the code.
Where the plan is more than 1.2x the measurement the case is an expected failure (strict), with
the ratio: those are the open part of issue 25.
"""

import json
import math
import pathlib
import re
import tarfile

import pytest
from _helpers import load_script

from peakflat_jax import config as config_module
from peakflat_jax.plan import host_pool, make_plan
from peakflat_jax.plan import operators as plan_operators
from peakflat_jax.plan import terms as plan_terms
from peakflat_jax.plan.terms import cudnn_backward_workspace, packed_attention_runs


@pytest.fixture(autouse=True)
def layer_loop_as_measured(monkeypatch):
    """Every run here was measured when ``operators.layer_loop: auto`` resolved to ``unrolled``
    wherever the offloaded optimizer overlapped the forward on a GPU (before the scanned stack
    made each MoE layer's update inside its loop, ``sco.MadeInScan``): the plans of those runs
    are made under that rule."""
    def as_measured(knobs, platform: str) -> str:
        return "unrolled" if knobs.optimizer_overlap and platform == "gpu" else "scan"

    for module in (plan_terms, plan_operators):
        monkeypatch.setattr(module, "auto_layer_loop", as_measured)


def load_config(name: str, overrides=()):
    """The config as these runs had it: every run here streamed its optimizer with no group
    resident (``optimizer.resident_groups`` was 0 until 2026-12-03; null now lets the planner
    choose)."""
    return config_module.load_config(name, ["optimizer.resident_groups=0", *overrides])


RESULTS = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "results"
TRAIN = RESULTS / "h200_1_train_scan_gpu_20261201-105253.json"
TRAIN_AUTO = RESULTS / "h200_1_train_auto_gpu_20261201-140353.json"
CHECKS = RESULTS / "h200_1_plan_check_gpu_20261201-141839.json"
PLAN_CHECK = RESULTS / "plan_check_h200-1_on_gpu_20261201-1058.txt"
BUFFERS = RESULTS / "xla_gpu_buffer_assignment_h200-1_20261201.tgz"
# h200-1 as it was measured: its segment cap then, and its four operators forced on.
AT_MEASUREMENT = ["data.max_segments=64", "operators.moe_dispatch=pipelined", "operators.loss=ring",
                  "operators.offload=all", "operators.optimizer_offload=true"]
ALL_OFF = ["operators.moe_dispatch=ep", "operators.loss=materialized", "operators.offload=none",
           "operators.optimizer_offload=false"]


def _train_peak(run: str) -> int:
    return json.loads(TRAIN.read_text())["runs"][run]["peak_device_bytes"]


def _compile_plan(layers: int) -> int:
    (path,) = RESULTS.glob(f"compile_h200-1_L{layers}_20261201-110*.json")
    return json.loads(path.read_text())["xla_plan_bytes"]


def _checked_program(name: str) -> int:
    """XLA's total for ``name`` in a ``plan --check`` table (GiB with 3 decimals)."""
    for line in PLAN_CHECK.read_text().splitlines():
        if line.startswith(name + " ") and line.count("|") == 2:
            return int(float(line.split("|")[1].split()[-1]) * 2**30)
    raise AssertionError(f"{name} not in {PLAN_CHECK.name}")


ON_UNROLLED = ["operators.moe_dispatch=pipelined", "operators.loss=ring", "operators.offload=all",
               "operators.optimizer_offload=true", "operators.layer_loop=unrolled"]


def _over(ratio: str):
    return pytest.mark.xfail(strict=True, reason=f"the plan is {ratio} the measured peak")


BEFORE_ZEROS_FIX = pytest.mark.xfail(strict=True, reason=(
    "measured before pipelined_moe._zeros_after (2026-12-03): that unrolled program made the "
    "later MoE layers' fp32 weight-gradient sums all at once before the first MoE layer "
    "((L_m - 1) 3 G H F 4, 9 GiB for h200-1), which today's does not (SESSION8's on64k_autoK: "
    "62.38 GiB, 10.4 under the same run before the fix); the plan, which no longer counts them, "
    "is under this old peak"))
"""A measurement of a program the code no longer builds: strict, so a plan that counts the
hoisted sums again (or a program that makes them again, measured anew) shows here."""

BEFORE_FFN_BARRIER = pytest.mark.xfail(strict=True, reason=(
    "measured before model.layers.weight_gradients_first (2026-12-03): where SCO offloads a "
    "boundary the dense FFN's backward now hands out its input's cotangent only with its "
    "weight gradients, so that none of its four [N, F_d] is live under the attention's "
    "backward; this program let XLA:GPU compute them last and hold the four, which the plan "
    "no longer counts there (ffn.under_attention)"))
"""The same for the dense FFN's order (strict: a plan that counts the four again shows here)."""

BEFORE_IN_PLACE = pytest.mark.xfail(strict=True, raises=AssertionError, reason=(
    "measured before 2026-12-04 18:44 (3880cf6): that overlapped step kept the MoE layers' new "
    "weights and gradients in per-layer copies and stacked them at its end, where XLA:GPU held "
    "both through the dense layer's backward in some schedules (h200-e2e at 540,672 unrolled: "
    "117.04 GiB, today's program 98.92 at the same config and knobs; h200-1 at 855,174: "
    "116.55); today's sco.MadeInLoop writes each layer's into the stacked arrays in place, "
    "and the plan, counting them once, is under this old peak. Where the run left knobs to "
    "operators auto, the plan now also chooses others there"))
"""A measurement of a program the code no longer builds (strict: a plan that counts the
per-layer copies again, or a program that makes them again, shows here)."""

MARKS_BY_NAME = {name: BEFORE_IN_PLACE for name in [
    "test_the_plan_bounds_what_the_gpu_measured[overlapped step, allocator peak]",
    "test_the_plan_bounds_the_device_peaks_of_the_e2e_session[prof_opt]",
    "test_the_plan_bounds_the_device_peaks_of_the_e2e_session[e2e_auto_262144]",
    "test_the_plan_bounds_the_peaks_of_the_fourth_session[ours_h200-1_634496]",
    "test_the_plan_bounds_the_peaks_of_the_fourth_session[auto_h200-e2e_262144]",
    "test_the_plan_bounds_the_peaks_of_the_fourth_session[auto_h200-e2e_32768_batch8]",
    "test_the_plan_bounds_the_peaks_of_the_sixth_session[record1-on64k_bwd-overrides1]",
    "test_the_plan_bounds_the_peaks_of_the_sixth_session[record2-opt64k-overrides2]",
    "test_the_plan_bounds_the_peaks_of_the_sixth_session[record6-opt64k_bwd-overrides6]",
    "test_the_plan_bounds_the_peaks_after_the_zeros_fix[pgle_profiled-h200-1-overrides1]",
    "test_the_plan_bounds_the_peaks_after_the_zeros_fix[pgle_used-h200-1-overrides2]",
    "test_the_plan_bounds_the_peaks_after_the_zeros_fix[on512k_autoK-h200-1-overrides5]",
    "test_the_host_plan_bounds_the_resident_memory_after_the_zeros_fix"
    "[auto64k-h200-e2e-overrides4]",
    "test_all_four_at_698k_compile_under_the_plan_without_the_hoisted_zeros",
    "test_the_plan_bounds_the_drivers_compiles[record0-on524k-h200-1-overrides0-overlapped]",
    "test_the_plan_bounds_the_drivers_compiles[record3-slop524k-h200-1-overrides3-overlapped]",
    "test_the_plan_bounds_the_drivers_compiles[record6-check524k-h200-1-overrides6-overlapped]",
    "test_the_plan_bounds_the_drivers_compiles"
    "[record12-dump_e2e540k_unrolled-h200-e2e-overrides12-overlapped]",
    "test_the_plan_bounds_the_runs_with_the_ffn_ordered[largest]",
]}
"""The measurements of the older overlapped step, by test (tests/conftest.py applies them)."""

BEFORE_SCAN_BARRIER = pytest.mark.xfail(strict=True, raises=AssertionError, reason=(
    "measured before the scanned backward's barrier (sco_scan, 2026-12-01 22:05): that standard "
    "stack's step let XLA:GPU hold the dense FFN's four [N, F_d] under the attention's "
    "backward (its dumps at 64K with 64 segments and at 256K; its peaks at 378,176 and 416,768 "
    "were 10.5 and 11.6 GiB over today's step's, no dump); today's holds none at any context "
    "compiled (64K with 64 segments, 128K, 262,144-621,208: "
    "test_the_plan_bounds_today_s_standard_step_compiled_as_on_the_h200), and the plan, which no "
    "longer counts them for the standard stack (plan.programs.step_terms), is under this old "
    "peak"))
"""A measurement of a standard-stack program the code no longer builds (strict: a plan that
counts the four again, or a program that holds them again, shows here)."""

MARKS_BY_NAME.update({name: BEFORE_SCAN_BARRIER for name in [
    "test_the_plan_bounds_what_the_gpu_measured[all-off step, allocator peak]",
    "test_the_plan_bounds_what_the_gpu_measured_at_four_segments[all off, 128K, XLA's plan]",
    "test_the_plan_bounds_what_the_gpu_measured_this_session[h200-1 all off, 256K, XLA's plan]",
    "test_the_plan_bounds_what_the_gpu_measured_this_session[h200-1 all off, 384K, XLA's plan]",
    "test_the_plan_bounds_the_device_peaks_after_the_barrier"
    "[all off, 378K, allocator peak, before the barrier]",
    "test_the_plan_bounds_the_device_peaks_after_the_barrier"
    "[all off, 416K, allocator peak, before the barrier]",
]})


MEASURED = {
    # (overrides, the plan's program, the measured bytes)
    "overlapped step, allocator peak": ([], "overlapped", lambda: _train_peak("cold")),
    "optimizer step, XLA's plan": ([], "optimizer_step",
                                   lambda: _checked_program("optimizer_step")),
    "all-off step, allocator peak": (ALL_OFF, "gradient", lambda: _train_peak("off")),
    "gradient at 8 layers, XLA's plan": pytest.param(
        ["operators.layer_loop=scan"], "gradient", lambda: _compile_plan(8),
        marks=BEFORE_FFN_BARRIER),
    "gradient at 32 layers, XLA's plan": pytest.param(
        ["model.num_layers=32", "operators.layer_loop=scan"], "gradient",
        lambda: _compile_plan(32), marks=BEFORE_FFN_BARRIER),
    "optimizer on device, allocator peak": pytest.param(
        ["operators.optimizer_offload=false"], "gradient", lambda: _train_peak("devopt"),
        marks=pytest.mark.xfail(strict=True, reason=(
            "the plan is 0.96x the measured peak: measured before "
            "model.layers.weight_gradients_first, with the dense FFN's four [N, F_d] (4 GiB) "
            "held, which the plan no longer counts where SCO offloads; and 0.98x before that: "
            "XLA:GPU holds ~1.9 GiB beyond the on-device AdamW's state that no term names yet "
            "(no buffer dump of this program)"))),
}


@pytest.mark.parametrize("overrides, program, measured", MEASURED.values(), ids=MEASURED.keys())
def test_the_plan_bounds_what_the_gpu_measured(overrides, program, measured):
    config = load_config("h200-1", [*AT_MEASUREMENT, *overrides])
    bound = make_plan(config, 1, platform="gpu", baseline=False,
                      search_context=False).programs[program]
    assert measured() <= bound <= 1.2 * measured()


def _run_peak(record: pathlib.Path, run: str) -> int:
    return json.loads(record.read_text())["runs"][run]["peak_device_bytes"]


def _checked(case: str, program: str) -> int:
    """XLA's plan of ``program`` in a ``plan --check`` of CHECKS (GiB with 3 decimals)."""
    gib = json.loads(CHECKS.read_text())["plan_checks"][case]["programs"][program]
    return int(gib["xla_total_gib"] * 2**30)


SEGMENT_CAP_4 = {
    # (overrides of h200-1 as it is, the plan's program, the measured bytes)
    "all off, 16K, XLA's plan": (ALL_OFF + ["data.seq_len=16384"], "gradient",
                                 lambda: _checked("all_off_16384", "train_step")),
    "all off, 64K, allocator peak": (ALL_OFF, "gradient",
                                     lambda: _run_peak(TRAIN_AUTO, "auto_cold")),
    "all off, 128K, XLA's plan": (ALL_OFF + ["data.seq_len=131072"], "gradient",
                                  lambda: _checked("all_off_131072", "train_step")),
    "pipelined alone, 64K, allocator peak": (
        ALL_OFF + ["operators.moe_dispatch=pipelined"], "gradient",
        lambda: _run_peak(TRAIN_AUTO, "alone_pipelined")),
    "ring alone, 64K, allocator peak": (ALL_OFF + ["operators.loss=ring"], "gradient",
                                        lambda: _run_peak(TRAIN_AUTO, "alone_ring")),
    # SCO alone at 64K was measured again after the scanned backward's barrier (sco.py), which
    # freed 4.1 GiB of it: that measurement replaces this one (SESSION3 below).
    "all on, 64K, allocator peak": pytest.param(
        ON_UNROLLED, "overlapped", lambda: _run_peak(TRAIN_AUTO, "on_unrolled"),
        marks=BEFORE_ZEROS_FIX),
    "all on, 64K, 16 slots, allocator peak": pytest.param(
        ON_UNROLLED + ["optimizer.slots=16"], "overlapped",
        lambda: _run_peak(CHECKS, "on_slots16"), marks=BEFORE_ZEROS_FIX),
    "all on, 64K, 60 slots, allocator peak": pytest.param(
        ON_UNROLLED + ["optimizer.slots=60"], "overlapped",
        lambda: _run_peak(CHECKS, "on_slots60"), marks=_over("1.57x (1.74x with the hoisted "
                                                              "zeros counted: XLA staged no more "
                                                              "buckets than at 16 slots)")),
    "all on, 16K, optimizer step, XLA's plan": (
        ON_UNROLLED + ["data.seq_len=16384"], "optimizer_step",
        lambda: _checked("on_16384", "optimizer_step")),
    # 1.28x over it when measured; the plan (20.36 GiB) is under it (23.21) since it counts
    # neither the hoisted sums (9 GiB at any context) nor the per-layer copies: not measured
    # with today's program (scripts/gpu_session.sh).
    "all on, 16K, XLA's plan": pytest.param(
        ON_UNROLLED + ["data.seq_len=16384"], "overlapped",
        lambda: _checked("on_16384", "overlapped_step"), marks=BEFORE_ZEROS_FIX),
    # 8.5 GiB under the plan since it leaves the FFN's four [N, F_d] out (16 GiB), within the
    # 9.0 GiB of hoisted sums this program held.
    "all on, 256K, XLA's plan": pytest.param(
        ON_UNROLLED + ["data.seq_len=262144"], "overlapped",
        lambda: _checked("on_262144", "overlapped_step"),
        marks=pytest.mark.xfail(strict=True, reason=(
            "0.88x: measured before pipelined_moe._zeros_after (its hoisted sums: 9.0 GiB) and "
            "before model.layers.weight_gradients_first; 8.5 GiB under the plan"))),
}


@pytest.mark.parametrize("overrides, program, measured", SEGMENT_CAP_4.values(),
                         ids=SEGMENT_CAP_4.keys())
def test_the_plan_bounds_what_the_gpu_measured_at_four_segments(overrides, program, measured):
    config = load_config("h200-1", overrides)
    bound = make_plan(config, 1, platform="gpu", baseline=False,
                      search_context=False).programs[program]
    assert measured() <= bound <= 1.2 * measured()


HOST = {
    # run -> (its record, overrides of h200-1 as it is): the process's resident memory
    "auto_cold": (TRAIN_AUTO, ALL_OFF), "auto_warm": (TRAIN_AUTO, ALL_OFF),
    "alone_pipelined": (TRAIN_AUTO, ALL_OFF + ["operators.moe_dispatch=pipelined"]),
    "alone_ring": (TRAIN_AUTO, ALL_OFF + ["operators.loss=ring"]),
    "alone_sco": (TRAIN_AUTO, ALL_OFF + ["operators.offload=all", "operators.layer_loop=scan"]),
    "on_unrolled": (TRAIN_AUTO, ON_UNROLLED),
    "on_slots16": (CHECKS, ON_UNROLLED + ["optimizer.slots=16"]),
    "on_slots60": (CHECKS, ON_UNROLLED + ["optimizer.slots=60"]),
    "losses30": (CHECKS, ALL_OFF),
}


@pytest.mark.parametrize("run", HOST)
def test_the_host_plan_bounds_the_resident_memory(run):
    """The host's terms (the pinned arrays, XLA's pinned-host pool grown over them, the
    runtime) against each run's resident memory: the runtime is a measured constant of these
    runs (``plan.host_pool.RUNTIME_GPU``); the pool is modelled from XLA's allocator."""
    record, overrides = HOST[run]
    measured = json.loads(record.read_text())["runs"][run]["host_bytes"]
    # These runs had XLA's own pinned-host pool (the default then).
    plan = make_plan(load_config("h200-1", [*overrides, "device.pinned_host_pool=xla"]), 1,
                     platform="gpu", baseline=False, search_context=False)
    assert measured <= plan.host_bytes <= 1.2 * measured


SESSION = RESULTS / "h200_1_session_gpu_20261201-162217.json"
FINETUNED = pathlib.Path(__file__).resolve().parent / "data" / "hf_qwen3_moe_3b"
"""The config.json of the random Qwen3-MoE checkpoint the GPU fine-tuned
(scripts/make_hf_checkpoint.py; its weights are not needed to plan)."""


def _checked_columns(run: str, program: str, record: pathlib.Path = SESSION) -> list[float]:
    """XLA's columns for ``program`` in ``record``'s ``plan --check`` log of ``run`` (GiB):
    arguments + outputs - aliases, temporaries, total."""
    for line in json.loads(record.read_text())["runs"][run]["log_tail"]:
        fields = line.split()
        if len(fields) > 2 and fields[1] == program and line.count("|") == 2:
            return [float(x) for x in line.split("|")[1].split()]
    raise AssertionError(f"{program} not in {run}'s log")


def _session_checked(run: str, program: str, record: pathlib.Path = SESSION) -> int:
    """XLA's total for ``program`` in ``record``'s ``plan --check`` log of ``run``."""
    return int(_checked_columns(run, program, record)[-1] * 2**30)


def _session_peak(run: str) -> int:
    return json.loads(SESSION.read_text())["runs"][run]["peak_device_bytes"]


# h200-e2e as the planner resolved operators auto at 32K and 64K (the runs' banners).
E2E_AUTO_32K = ["data.seq_len=32768", "operators.moe_dispatch=ep", "operators.loss=ring",
                "operators.offload=none", "operators.optimizer_offload=false"]
E2E_AUTO_64K = ["operators.moe_dispatch=pipelined", "operators.loss=ring", "operators.offload=all",
                "operators.optimizer_offload=false", "operators.token_budget=21846"]
FINETUNE = [f"model.from_pretrained={FINETUNED}", "data.tokenizer=bytes"]

THIS_SESSION = {
    # (config, overrides, the plan's program, the measured bytes)
    "h200-1 all off, 256K, XLA's plan": (
        "h200-1", ALL_OFF + ["data.seq_len=262144"], "gradient",
        lambda: _session_checked("plan_check_off_262144", "train_step")),
    "h200-1 all off, 384K, XLA's plan": (
        "h200-1", ALL_OFF + ["data.seq_len=393216"], "gradient",
        lambda: _session_checked("plan_check_off_393216", "train_step")),
    "h200-1 all on, 64K, allocator peak": pytest.param(
        "h200-1", ON_UNROLLED, "overlapped", lambda: _session_peak("on_fwd"),
        marks=BEFORE_ZEROS_FIX),
    "h200-1 all on, write-back under the backward, allocator peak": pytest.param(
        "h200-1", ON_UNROLLED + ["operators.optimizer_writeback=backward"], "overlapped",
        lambda: _session_peak("on_bwd")),
    "h200-1 streamed optimizer alone, allocator peak": pytest.param(
        "h200-1", ["operators.optimizer_offload=true", "operators.optimizer_writeback=backward"],
        "overlapped", lambda: _session_peak("opt_alone")),
    "h200-e2e all off, 12K, allocator peak": ("h200-e2e", ALL_OFF + ["data.seq_len=12288"],
                                              "gradient", lambda: _session_peak("e2e_off_12k")),
    "h200-e2e all off, 16K, allocator peak": ("h200-e2e", ALL_OFF + ["data.seq_len=16384"],
                                              "gradient", lambda: _session_peak("e2e_off_16k")),
    "h200-e2e auto, 32K, allocator peak": ("h200-e2e", E2E_AUTO_32K, "gradient",
                                           lambda: _session_peak("e2e_auto_32k")),
    "h200-e2e auto, 64K, allocator peak": ("h200-e2e", E2E_AUTO_64K, "gradient",
                                           lambda: _session_peak("e2e_auto_64k")),
    "fine-tune of a 3.3B Qwen3-MoE, 64K, allocator peak": (
        "finetune-h200", FINETUNE, "gradient", lambda: _session_peak("finetune")),
}


@pytest.mark.parametrize("config, overrides, program, measured", THIS_SESSION.values(),
                         ids=THIS_SESSION.keys())
def test_the_plan_bounds_what_the_gpu_measured_this_session(config, overrides, program,
                                                            measured):
    bound = make_plan(load_config(config, overrides), 1, platform="gpu", baseline=False,
                      search_context=False).programs[program]
    assert measured() <= bound <= 1.2 * measured()


SESSION_HOST = {
    # run -> (config, overrides): resident memory, with the pinned-host pool each run had
    "host_cap": ("h200-1", ON_UNROLLED + ["device.pinned_host_pool=planned"]),
    "on_fwd": ("h200-1", ON_UNROLLED + ["device.pinned_host_pool=xla"]),
    "on_bwd": ("h200-1", ON_UNROLLED + ["operators.optimizer_writeback=backward",
                                        "device.pinned_host_pool=xla"]),
    "opt_alone": ("h200-1", ["operators.optimizer_offload=true",
                             "operators.optimizer_writeback=backward",
                             "device.pinned_host_pool=xla"]),
    "e2e_off_12k": ("h200-e2e", ALL_OFF + ["data.seq_len=12288"]),
    "e2e_auto_64k": ("h200-e2e", E2E_AUTO_64K),
}


@pytest.mark.parametrize("run", SESSION_HOST)
def test_the_host_plan_bounds_the_resident_memory_this_session(run, monkeypatch):
    monkeypatch.delenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", raising=False)
    config, overrides = SESSION_HOST[run]
    plan = make_plan(load_config(config, overrides), 1, platform="gpu", baseline=False,
                     search_context=False)
    measured = json.loads(SESSION.read_text())["runs"][run]["host_bytes"]
    assert measured <= plan.host_bytes <= 1.2 * measured


def test_the_cudnn_workspace_is_the_buffer_xla_gave_it():
    """The attention backward's workspace formula against the u8 buffer of every
    ``dot_product_attention_bwd`` in XLA:GPU's buffer assignment of h200-1's programs."""
    sizes = set()
    with tarfile.open(BUFFERS) as archive:
        for member in archive.getmembers():
            if member.name.endswith("buffer-assignment.txt"):
                text = archive.extractfile(member).read().decode()
                sizes |= {int(s) for s in re.findall(
                    r"<\d+ dot_product_attention_bwd[.\d]*\{3\} @0> \(size=(\d+)", text)}
    config = load_config("h200-1", AT_MEASUREMENT)
    model = config.model
    runs = packed_attention_runs(config)
    assert runs == 65
    assert sizes == {cudnn_backward_workspace(runs, config.data.seq_len, model.num_heads,
                                              model.head_dim)}


def test_one_document_a_sequence_takes_one_run():
    assert packed_attention_runs(load_config("h200-1", ["data.source=synthetic"])) == 1
    assert packed_attention_runs(load_config("h200-1", ["data.max_segments=1"])) == 1
    assert packed_attention_runs(load_config("h200-1", [])) == 5


SESSION2 = RESULTS / "h200_session_gpu_20261201-185430.json"
# As the planner resolved operators auto in those runs (their banners).
E2E_AUTO_128K = ["data.seq_len=131072", "operators.moe_dispatch=ep", "operators.loss=ring",
                 "operators.offload=none", "operators.optimizer_offload=true"]
E2E_AUTO_256K = ["data.seq_len=262144", "operators.moe_dispatch=pipelined", "operators.loss=ring",
                 "operators.offload=all", "operators.optimizer_offload=true",
                 "operators.token_budget=87382"]
E2E_HOST_CPU_32K = ALL_OFF + ["data.seq_len=32768", "optimizer.update_on=host_cpu"]
SESSION2_RUNS = {
    # run -> (config, overrides, the plan's program)
    "prof_on": ("h200-1", ON_UNROLLED, "overlapped"),
    "prof_opt": ("h200-1", ["operators.optimizer_offload=true"], "overlapped"),
    "e2e_hostcpu_32768": ("h200-e2e", E2E_HOST_CPU_32K, "gradient"),
    "e2e_off_20480": ("h200-e2e", ALL_OFF + ["data.seq_len=20480"], "gradient"),
    "e2e_off_22528": ("h200-e2e", ALL_OFF + ["data.seq_len=22528"], "gradient"),
    "e2e_auto_131072": ("h200-e2e", E2E_AUTO_128K, "overlapped"),
    "e2e_auto_262144": ("h200-e2e", E2E_AUTO_256K, "overlapped"),
}
SESSION2_DEVICE_OVER = {
    "prof_on": None,  # BEFORE_ZEROS_FIX
}
SESSION2_HOST_OVER = {
    "e2e_hostcpu_32768": "1.23x of the resident memory sampled between steps, which misses "
                         "the host-CPU update's gradients in transit (VmHWM, the peak, is "
                         "recorded since this session)",
}


def _session2_run(run: str) -> dict:
    return json.loads(SESSION2.read_text())["runs"][run]


def _pool_cap_gib(run: str) -> str | None:
    """The pinned-host pool's cap the run set (its banner), as the variable's text."""
    for line in _session2_run(run)["log_tail"]:
        if match := re.search(r"pinned-host pool limit (\d+) GiB", line):
            return match.group(1)
    return None


def _session2_plan(run: str, monkeypatch):
    config, overrides, program = SESSION2_RUNS[run]
    monkeypatch.delenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", raising=False)
    if cap := _pool_cap_gib(run):
        monkeypatch.setenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", cap)
    return make_plan(load_config(config, overrides), 1, platform="gpu", baseline=False,
                     search_context=False), program


@pytest.mark.parametrize("run", [
    pytest.param(run, marks=_over(SESSION2_DEVICE_OVER[run]) if SESSION2_DEVICE_OVER[run]
                 else BEFORE_ZEROS_FIX) if run in SESSION2_DEVICE_OVER else run
    for run in SESSION2_RUNS])
def test_the_plan_bounds_the_device_peaks_of_the_e2e_session(run, monkeypatch):
    plan, program = _session2_plan(run, monkeypatch)
    measured = _session2_run(run)["peak_device_bytes"]
    assert measured <= plan.programs[program] <= 1.2 * measured


@pytest.mark.parametrize("run", [pytest.param(run, marks=_over(SESSION2_HOST_OVER[run]))
                                 if run in SESSION2_HOST_OVER else run
                                 for run in SESSION2_RUNS])
def test_the_host_plan_bounds_the_resident_memory_of_the_e2e_session(run, monkeypatch):
    """With the pool's cap each run set (its banner): the pool grows to it (the growth's
    model), the runtime beside it is ``host_pool.runtime_gpu_bytes``."""
    plan, _ = _session2_plan(run, monkeypatch)
    measured = _session2_run(run)["host_bytes"]
    assert measured <= plan.host_bytes <= 1.2 * measured


LHS = RESULTS / "h200_1_lhs_gpu_20261201-193600.json"


def test_the_host_plan_bounds_the_peak_resident_memory_under_the_run_s_own_cap(monkeypatch):
    """The first run with the pool's cap planned from its own operators (39 GiB: the streamed
    state alone) and the process's peak resident memory recorded (``VmHWM``)."""
    run = json.loads(LHS.read_text())["runs"]["lhs"]
    assert any("pool limit 39 GiB" in line for line in run["log_tail"])
    monkeypatch.delenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", raising=False)
    plan = make_plan(load_config("h200-1", ["operators.optimizer_offload=true"]), 1,
                     platform="gpu", device_memory=int(132.8 * 2**30),
                     host_memory=125 * 2**30, baseline=False, search_context=False)
    measured = run["host_peak_bytes"]
    assert measured <= plan.host_bytes <= 1.2 * measured


SESSION3 = RESULTS / "h200_session_gpu_20261201-220535.json"
BASELINE_LARGEST = 592_826
"""The largest context the plan gives h200-1's standard stack (all four off), with the step
counted as XLA:GPU schedules it (``plan.programs.step_terms``): its MoE layer as XLA:GPU's
buffer assignments at 64K-621K hold it (two [M, H], three [M, F] and
``held_through_attention``: ``test_the_standard_step_follows_xla_s_dumps``). It was 517,600
before that correction (2026-12-02), with four [M, H] and four [M, F] counted."""
TRAINED_LARGEST = 443_720
"""The standard stack's largest before that rule (bbe9481), which trained."""
DEVICE = dict(device_memory=int(132.8 * 2**30))


def _session3_run(run: str) -> dict:
    return json.loads(SESSION3.read_text())["runs"][run]


SESSION3_DEVICE = [
    # (the record's run, overrides of h200-1, what was measured), each at its commit
    pytest.param(
        "plan_check_sco_64k_after",
        ALL_OFF + ["operators.offload=all", "operators.layer_loop=scan"], "xla_plan_bytes",
        id="SCO alone, 64K, XLA's plan after the barrier"),
    pytest.param("base_378176", ALL_OFF + ["data.seq_len=378176"], "peak_device_bytes",
                 id="all off, 378K, allocator peak, before the barrier"),
    pytest.param("base_416768", ALL_OFF + ["data.seq_len=416768"], "peak_device_bytes",
                 id="all off, 416K, allocator peak, before the barrier"),
    pytest.param(
        "base_443720", ALL_OFF + [f"data.seq_len={TRAINED_LARGEST}"], "peak_device_bytes",
        id="all off, 443,720, trained"),
    pytest.param("plan_check_base_488448", ALL_OFF + ["data.seq_len=488448"], "xla_plan_bytes",
                 id="all off, 488,448, XLA's plan"),
]


@pytest.mark.parametrize("run, overrides, measured_key", SESSION3_DEVICE)
def test_the_plan_bounds_the_device_peaks_after_the_barrier(run, overrides, measured_key):
    """Each plan as the trainer checks it, against the device's memory (132.8 GiB); the
    barrier is the scanned backward's (sco_scan, 2026-12-01 22:05), and the points measured
    before it are strict expected failures (BEFORE_SCAN_BARRIER)."""
    bound = make_plan(load_config("h200-1", overrides), 1, platform="gpu", baseline=False,
                      search_context=False, **DEVICE).programs["gradient"]
    measured = _session3_run(run)[measured_key]
    assert measured <= bound <= 1.2 * measured


def test_the_standard_stack_s_largest_context_is_past_what_trained_and_within_what_fit():
    """Issue 25's last check, first half, as far as it was measured: the plan's largest
    context for h200-1 all off (592,826) lies past the 443,720 that trained 3 steps and the
    532,464 that XLA:GPU planned within the device (122.24 GiB), and under 621,208, which
    XLA:GPU also planned within it (130.25 GiB; both compiled only). Before the MoE layer's
    narrower terms (2026-12-02) it was 517,600, under 532,464, and trained
    (``test_the_standard_stack_trained_below_the_plan_s_largest_context``); 592,826 itself has
    not been run."""
    config = load_config("h200-1", ALL_OFF)
    plan = make_plan(config, 1, platform="gpu", baseline=False, **DEVICE,
                     host_memory=int(config.device.host_memory_gib * 2**30))
    assert plan.largest_context == BASELINE_LARGEST
    assert TRAINED_LARGEST < 532_464 < BASELINE_LARGEST < 621_208
    run = _session3_run("base_443720")
    assert run["steps"] == 3 and f"data.seq_len={TRAINED_LARGEST}" in run["command"]
    assert run["losses"][-1] < run["losses"][0]
    assert _session4_run("plan_check_off_532464")["xla_plan_gib"] < 132.8
    assert _session4_run("plan_check_off_621208")["xla_plan_gib"] < 132.8


def test_the_first_context_compiled_past_1_1x_of_the_plan_s_largest_does_not_fit():
    """The second half: past 1.1x of the largest (652,109) the step does not fit the device:
    the one context compiled past it, 665,580 (1.12x), XLA:GPU planned at 136.41 GiB of 132.8;
    within it, 621,208 (1.05x) fit (130.25 GiB). This was an expected failure while the
    largest was 517,600 (before 2026-12-02's narrower MoE terms): 621,208 was past 1.1x of it
    and fit. XLA:GPU's plan is not monotone in the context (docs/plan.md) and nothing between
    621,208 and 665,580 was compiled: a compile at 652,110 would settle 1.1x itself."""
    device = load_config("h200-1", ALL_OFF).device.memory_gib
    within = _session4_run("plan_check_off_621208")
    above = _session5_run("check_off_665580")
    assert BASELINE_LARGEST < 621_208 <= 1.1 * BASELINE_LARGEST < 665_580
    assert within["xla_plan_gib"] <= device < above["xla_plan_gib"]


SESSION4 = RESULTS / "h200_session_gpu_20261202-064500.json"
SESSION4_RUNS = {
    # the record's run -> (config, overrides), operators as the planner chose them then
    "ours_h200-1_634496": ("h200-1", ["data.seq_len=634496"]),
    "hostcpu_h200-e2e_65536": ("h200-e2e", ALL_OFF + ["data.seq_len=65536",
                                                       "optimizer.update_on=host_cpu"]),
    "auto_h200-e2e_65536": ("h200-e2e", ["data.seq_len=65536"]),
    "auto_h200-e2e_262144": ("h200-e2e", ["data.seq_len=262144"]),
    "auto_h200-e2e_32768_batch8": ("h200-e2e", ["data.seq_len=32768", "data.batch_size=8"]),
}


def _session4_run(run: str) -> dict:
    return json.loads(SESSION4.read_text())["runs"][run]


def _session4_plan(run: str, monkeypatch):
    """The plan the trainer checked the run against: the config's device and host memory, the
    pinned-host pool capped as the trainer caps it (from the plan)."""
    monkeypatch.delenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", raising=False)
    config = load_config(*SESSION4_RUNS[run])
    return make_plan(config, 1, platform="gpu", baseline=False, search_context=False,
                     device_memory=int(config.device.memory_gib * 2**30),
                     host_memory=int(config.device.host_memory_gib * 2**30))


@pytest.mark.parametrize("run", list(SESSION4_RUNS))
def test_the_plan_bounds_the_peaks_of_the_fourth_session(run, monkeypatch):
    """Device (the allocator's peak) and host (the process's peak resident memory, VmHWM),
    each at or under the plan and the plan within 1.2x; the host-CPU standard stack's host
    peak is what its cross-client copy term was inferred from (optim/host_cpu_adamw.py)."""
    plan = _session4_plan(run, monkeypatch)
    measured = _session4_run(run)
    assert measured["steps"] == 3 and all(math.isfinite(loss) for loss in measured["losses"])
    assert measured["peak_device_bytes"] <= plan.total_bytes <= 1.2 * measured["peak_device_bytes"]
    assert measured["host_peak_bytes"] <= plan.host_bytes <= 1.2 * measured["host_peak_bytes"]


def test_ours_trained_where_the_plan_says_it_fits():
    """h200-1 with operators auto trained 3 steps at 634,496 tokens, 52 below the plan's
    largest on 2026-12-02 (634,548; 634,549 was refused by cuDNN, odd, which the search now
    leaves out). The plan there is at or over the measured peak, and its largest context is
    now past it: where SCO offloads a boundary none of the dense FFN's four [N, F_d] is held
    under the attention's backward (model.layers.weight_gradients_first), which gives ours
    ~35% more context by the plan (trained at 855,174 on 2026-12-03 19:12:
    ``test_ours_trains_at_the_plan_s_largest_context_with_the_ffn_ordered``)."""
    config = load_config("h200-1")
    memory = dict(device_memory=int(config.device.memory_gib * 2**30),
                  host_memory=int(config.device.host_memory_gib * 2**30))
    plan = make_plan(config, 1, platform="gpu", baseline=False, **memory)
    assert plan.largest_context > 1.3 * 634_496
    run = _session4_run("ours_h200-1_634496")
    assert run["steps"] == 3 and run["losses"][-1] < run["losses"][0]
    at_run = make_plan(config, 1, context=634_496, platform="gpu", baseline=False,
                       search_context=False, **memory)
    assert run["peak_device_bytes"] <= at_run.total_bytes <= 1.2 * run["peak_device_bytes"]
    refused = _session4_run("ours_h200-1_634549")
    assert "Unsupported sequence length Q 634549" in refused["outcome"]


@pytest.mark.parametrize("run, context", [("plan_check_off_532464", 532_464),
                                          ("plan_check_off_621208", 621_208)])
def test_the_plan_bounds_the_standard_stack_at_532k_and_621k(run, context):
    """XLA:GPU's plans of h200-1 all off at 532,464 and 621,208 tokens (compiled only): at or
    under the plan counted as XLA:GPU schedules the standard stack's step, within 1.2x
    (1.01x and 1.05x with the MoE layer's narrower terms; 1.11x and 1.15x with four [M, H] and
    four [M, F] counted; 1.23x and 1.29x counted as with memory to spare)."""
    plan = make_plan(load_config("h200-1", ALL_OFF + [f"data.seq_len={context}"]), 1,
                     platform="gpu", baseline=False, search_context=False, **DEVICE)
    measured = _session4_run(run)["xla_plan_gib"] * 2**30
    assert measured <= plan.programs["gradient"] <= 1.2 * measured
    assert any(t.name == "ffn.under_attention" and t.bytes == 0 for t in plan.terms)


EMULATION_1 = RESULTS / "h100_session_gpu_20261205-123444.json"
EMULATION_2 = RESULTS / "h100_session_gpu_20261205-162214.json"
EMULATED = {
    # the record's run: today's standard stack compiled on an H100 with the H200's limit
    **{run: EMULATION_1 for run in ["emu262k", "emu378k", "emu416k", "emu430k", "emu443k"]},
    **{run: EMULATION_2 for run in ["emu64k_seg64", "emu128k", "emu621k"]},
}


@pytest.mark.parametrize("run", EMULATED)
def test_the_plan_bounds_today_s_standard_step_compiled_as_on_the_h200(run):
    """XLA:GPU's plan of today's standard stack (h200-1 all off), compiled as on the H200
    (test_the_h100_compiles_as_the_h200_with_its_limit), from 64K with 64 segments to 621,208:
    at or under the plan, within 1.2x (1.015x-1.052x); among them 64K with 64 segments, 128K,
    378,176 and 416,768, where the program measured before the scanned backward's barrier was
    over the plan (BEFORE_SCAN_BARRIER)."""
    record = json.loads(EMULATED[run].read_text())["runs"][run]
    overrides = [word for word in record["command"].split()
                 if "=" in word and word.split(".")[0] in ("data", "operators")]
    measured = _session_checked(run, "train_step", EMULATED[run])
    plan = make_plan(load_config("h200-1", overrides), 1, platform="gpu", baseline=False,
                     search_context=False, **DEVICE)
    assert measured <= plan.programs["gradient"] <= 1.2 * measured


OFF_443K = RESULTS / "xla_gpu_live_ranges_h200-1_off443k_20261202.tgz"
PADDED_ROWS = 128
"""How many rows past N (or M) XLA:GPU pads a buffer's leading dimension in that dump (by 24
and 56 for N, 96 for M)."""


def _rows_and_width(shape: str, rows: int) -> tuple[int, int] | None:
    """(the dimensions before, after) a ``dtype[dims]`` buffer's dimension of ``rows`` to
    ``rows + PADDED_ROWS``, each multiplied out ([7, 1, N, H]: (7, H); [1, 16, N, 128]: (16,
    128)); None for a buffer with no such dimension."""
    dims = [int(d) for d in re.search(r"\[([\d,]*)\]", shape).group(1).split(",") if d]
    for axis, size in enumerate(dims):
        if rows <= size < rows + PADDED_ROWS:
            return math.prod(dims[:axis]), math.prod(dims[axis + 1:])
    return None


STANDARD_DUMPS = RESULTS / "xla_gpu_live_ranges_h200-1_off262k-443k_h100_as_h200_20261205.tgz"
"""XLA:GPU's dumps of today's standard-stack step (h200-1 all off), compiled on an H100 with the
H200's allocator limit (h100_session_gpu_20261205-123444.json)."""


STANDARD_DUMPS_2 = RESULTS / "xla_gpu_live_ranges_h200-1_off64k-128k-621k_h100_as_h200_20261205.tgz"
"""The same at 64K with 64 segments, 128K and 621,208 (h100_session_gpu_20261205-162214.json)."""


def _standard_dump(archive: pathlib.Path, folder: str, tmp_path):
    """(values, schedule, ranges, bytes in use after each step, XLA's total allocation) of the
    train step dumped in ``folder`` of ``archive`` (``_read_dump``)."""
    script, values, _, schedule, ranges = _read_dump(archive, "train_step", tmp_path, folder)
    (report,) = (tmp_path / folder).glob("*train_step*memory-usage-report.txt")
    total = int(re.search(r"Total bytes: (\d+)", report.read_text()).group(1))
    return values, schedule, ranges, script.usage(values, ranges, len(schedule)), total


def test_the_h100_compiles_as_the_h200_with_its_limit(tmp_path):
    """The compiles of STANDARD_DUMPS ran on an H100 whose allocator's limit was set to the
    H200's 132.8 GiB (scripts/gpu_session.sh, STAGES=h100), so that XLA:GPU's scheduling and
    rematerialization limit is the H200's. Held against the H200's own compile of the same
    program at 443,720 tokens (2026-12-02): the same total to 8 KB of 109 GiB, the same peak in
    use, at the same instruction."""
    h200 = _standard_dump(OFF_443K, "pick-off443k", tmp_path)
    h100 = _standard_dump(STANDARD_DUMPS, "pick-emu443k", tmp_path)
    assert abs(h200[4] - h100[4]) <= 8192
    peaks = [max(range(len(schedule)), key=used.__getitem__) for _, schedule, _, used, _ in
             (h200, h100)]
    assert abs(h200[3][peaks[0]] - h100[3][peaks[1]]) <= 8192
    assert h200[1][peaks[0]] == h100[1][peaks[1]] == "dot_product_attention_bwd.0"


def test_the_h100_compiles_as_the_h200_where_its_limit_binds():
    """At 621,208 tokens the standard stack's temporaries are past the H200's scheduler limit,
    (132.8 GiB - arguments and outputs) x 0.95 (XLA:GPU's slop factor), so XLA:GPU schedules
    under memory pressure there; the H100 compiling with the H200's allocator limit
    (STANDARD_DUMPS_2, h100_session_gpu_20261205-162214.json) planned what the H200's own
    compile of the same program planned (2026-12-02, 4e5ac10): 130.245 GiB, to the MB the
    records keep."""
    arguments, temporaries, total = _checked_columns("emu621k", "train_step", EMULATION_2)
    assert temporaries > (132.8 - arguments) * 0.95
    assert abs(total - _session4_run("plan_check_off_621208")["xla_plan_gib"]) <= 0.001


@pytest.mark.parametrize("archive, folder, context, segments, rows_over, past_limit", [
    (OFF_443K, "pick-off443k", 443_720, None, 0, False),
    (STANDARD_DUMPS, "pick-emu262k", 262_144, None, 0, False),
    (STANDARD_DUMPS, "pick-emu378k", 378_176, None, 0, False),
    (STANDARD_DUMPS, "pick-emu416k", 416_768, None, 0, False),
    (STANDARD_DUMPS, "pick-emu430k", 430_000, None, 0, False),
    (STANDARD_DUMPS_2, "pick-emu64k_seg64", 65_536, 64, 1, False),
    (STANDARD_DUMPS_2, "pick-emu128k", 131_072, None, 0, False),
    (STANDARD_DUMPS_2, "pick-emu621k", 621_208, None, 0, True),
], ids=["443,720 (H200)", "262,144", "378,176", "416,768", "430,000", "65,536 x 64 segments",
        "131,072", "621,208"])
def test_the_standard_step_follows_xla_s_dumps(tmp_path, archive, folder, context, segments,
                                               rows_over, past_limit):
    """The standard stack's step as the plan counts it (plan.programs.step_terms) against
    XLA:GPU's buffer assignments of h200-1 all off, 64K-621K (read with
    scripts/xla_live_set.py): no bf16 [N, F_d] of the dense FFN live through any attention
    backward (ffn.under_attention counts none); at most as many [M, H] (moe.dispatch) and
    [M, F] (moe.expert_ffn) live at any step as the terms count, but for one [M, H] more at
    one fusion at 64 segments (``rows_over``), and wherever [M, .] rows are live the plan's FFN
    phase at or over what is in use; XLA's peak a MoE layer's attention backward, which the
    plan's attention phase bounds, with the whole plan within 1.2x of it (the plan's own peak
    is its attention phase but at 131,072, where its FFN phase is 0.11 GiB over); and at it
    the [N, H] buffers (q, O and dQ among them: Hq D = H) and the boundaries counted in
    [N, H], and RoPE's fp32 [N, D / 2] as many as the terms count, held_through_attention the
    two [N, H], the [N, V'] and the two [N, D / 2] no other term names. From 430,000 on the
    [N, H] at the peak are as many as the terms count and the loss's fp32 [N, V'] is live;
    below, fewer (15 of 17) and not (the plan's 1.05x there against 1.015x). At 621,208
    XLA's temporaries are past the H200's scheduler limit
    (test_the_h100_compiles_as_the_h200_where_its_limit_binds): it holds 15 [N, H] and no
    RoPE table at the peak (1.05x)."""
    from peakflat_jax import mesh as mop
    from peakflat_jax.plan.programs import program_bytes

    script = load_script("xla_live_set")
    values, schedule, ranges, used, _ = _standard_dump(archive, folder, tmp_path)

    def live(step):
        """The values live after ``step``, each allocation's bytes once."""
        found = {}
        for name, first, last in ranges:
            if first <= step <= last and (buffer := script._lookup(values, name)):
                found.setdefault(buffer[:2], buffer)
        return found.values()

    def count(step, rows, width, dtype, heads=None):
        """How many [rows, width] arrays of ``dtype`` are live after ``step``: [..., rows,
        width] buffers, as many as the dimensions before; with ``heads``, each [heads, rows,
        width / heads] (the head-major layout of cuDNN's output and dQ) one."""
        total = 0
        for _, _, _, shape in live(step):
            if shape.startswith(dtype + "[") and (found := _rows_and_width(shape, rows)):
                lead, after = found
                if after == width:
                    total += lead
                elif heads and (lead, after * heads) == (heads, width):
                    total += 1
        return total

    config = load_config("h200-1", ALL_OFF + [f"data.seq_len={context}"] + (
        [f"data.max_segments={segments}"] if segments else []))
    model = config.model
    n, h, d = context, model.hidden, model.head_dim
    m, vocab, b = model.top_k * n, mop.padded_vocab(model.vocab_size, 1), 2
    plan = make_plan(config, 1, platform="gpu", baseline=False, search_context=False)
    terms = plan.terms
    named = {t.name: t.bytes for t in terms}
    steps = range(len(schedule))
    backward = [s for s in steps if schedule[s].startswith("dot_product_attention_bwd")]
    assert len(backward) == 8 and named["ffn.under_attention"] == 0
    assert all(count(s, n, model.dense_ffn, "bf16") == 0 for s in backward)
    assert (max(count(s, m, h, "bf16") for s in steps) * m * h * b
            == named["moe.dispatch"] + rows_over * m * h * b)
    assert (max(count(s, m, model.expert_ffn, "bf16") for s in steps) * m * model.expert_ffn * b
            == named["moe.expert_ffn"])
    # Wherever XLA holds [M, .] rows, the plan's FFN phase (its terms without the attention's)
    # bounds what is in use: also at the one step of 64 segments with a third [M, H].
    ffn_phase = program_bytes([t for t in terms if t.live != "layer/attention"])["gradient"]
    assert all(used[s] <= ffn_phase for s in steps
               if count(s, m, h, "bf16") or count(s, m, model.expert_ffn, "bf16"))

    peak = max(steps, key=used.__getitem__)
    assert peak in backward
    assert all(t.formula.startswith("[moe layer]") for t in terms
               if t.live.startswith("layer") and t.bytes)
    attention = [t for t in terms if t.live != "layer/ffn"]
    assert used[peak] <= program_bytes(attention)["gradient"]
    assert max(program_bytes(terms).values()) <= 1.2 * used[peak]

    # What is live at the peak against the terms that count it: equal from 430,000 on, less
    # below (the plan's 1.05x there) and past the scheduler's limit.
    unit = n * h * b
    logits, rope = count(peak, n, vocab, "f32"), count(peak, n, d // 2, "f32")
    assert logits <= 1 and rope == (0 if past_limit else 2)
    assert (logits == 1) == (context >= 430_000)
    assert (2 * unit + logits * n * vocab * 4 + rope * n * (d // 2) * 4
            <= named["held_through_attention"])
    planned = (named["kept_boundaries"] + named["carry_cotangents"] + named["residual_stream"]
               + 2 * unit + 3 * n * model.num_heads * d * b)
    at_peak = count(peak, n, h, "bf16", heads=model.num_heads) * unit
    assert at_peak == planned if context >= 430_000 and not past_limit else at_peak < planned


def test_ours_fits_where_the_standard_stack_stops():
    """What the four operators gain over h200-1's standard stack (132.8 GiB), measured: all four
    on at 698,002 tokens compiled to 124.15 GiB, within the device, where the standard stack at
    a shorter 665,580 compiled past it (136.41 GiB): ours reaches at least 1.049x past where the
    standard stack stops. The plan agrees on both sides of that, and plans ours past 698,002
    (it planned 634,548 while it counted the dense FFN's four [N, F_d] under the attention's
    backward, which XLA:GPU did not hold there)."""
    record = json.loads((RESULTS / "h200_session_gpu_20261202-185840.json").read_text())
    ours = record["runs"]["ours_1p1"]
    assert "data.seq_len=698002" in ours["command"]
    assert all(setting in ours["command"] for setting in ALL_ON_UNROLLED[:4])
    device = load_config("h200-1").device.memory_gib
    standard = _session5_run("check_off_665580")
    assert ours["programs"]["overlapped_step"]["xla_gib"] <= device < standard["xla_plan_gib"]
    at = make_plan(load_config("h200-1", ALL_OFF + ["data.seq_len=665580"]), 1, platform="gpu",
                   baseline=False, search_context=False, **DEVICE)
    assert not at.feasible
    ours_largest = make_plan(load_config("h200-1"), 1, platform="gpu", baseline=False,
                             **DEVICE).largest_context
    assert BASELINE_LARGEST < 665_580 and ours_largest > 698_002


def test_the_standard_step_rule_does_not_switch_on_with_the_context():
    """A host budget for the boundaries offloads fewer of them as the context grows (none at
    500K here): the step never counts as the standard stack's, so whether it fits stays
    monotone in the context and the search's edge is the true one."""
    config = load_config("h200-1", ALL_OFF + ["operators.offload=1.9"])
    largest = make_plan(config, 1, platform="gpu", baseline=False, **DEVICE).largest_context
    assert largest is not None and largest < 500_000
    at = make_plan(config.replace(data={"seq_len": 500_000}), 1, platform="gpu",
                   baseline=False, search_context=False, **DEVICE)
    assert not at.feasible
    assert all(t.bytes for t in at.terms if t.name == "ffn.under_attention")


SESSION5 = RESULTS / "h200_session_gpu_20261202-130810.json"
ALL_ON_UNROLLED = ["operators.moe_dispatch=pipelined", "operators.loss=ring",
                   "operators.offload=all", "operators.optimizer_offload=true",
                   "operators.layer_loop=unrolled"]
SESSION5_RUNS = [
    # the record's run, its config and overrides
    pytest.param("on64k_fwd", "h200-1", ALL_ON_UNROLLED, marks=BEFORE_ZEROS_FIX),
    ("on64k_bwd", "h200-1", ALL_ON_UNROLLED + ["operators.optimizer_writeback=backward"]),
    ("base64k", "h200-1", []),
    ("base_517600", "h200-1", ALL_OFF + ["data.seq_len=517600"]),
    ("e2e_hostcpu_b2", "h200-e2e", ALL_OFF + ["data.seq_len=32768", "data.batch_size=2",
                                              "optimizer.update_on=host_cpu"]),
]


def _session5_run(run: str) -> dict:
    return json.loads(SESSION5.read_text())["runs"][run]


@pytest.mark.parametrize("run, config, overrides", SESSION5_RUNS)
def test_the_plan_bounds_the_peaks_of_the_fifth_session(run, config, overrides, monkeypatch):
    """The fifth driver's trained runs (allocator peaks; the host-CPU stack's host too, VmHWM),
    each planned against the device's memory (the host-CPU stack's lifted, as the bench lifts
    it): at or under the plan and the plan within 1.2x."""
    monkeypatch.delenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", raising=False)
    plan = make_plan(load_config(config, overrides), 1, platform="gpu", baseline=False,
                     search_context=False, **DEVICE)
    measured = _session5_run(run)
    assert len(measured["losses"]) in (3, 5)
    assert all(math.isfinite(loss) for loss in measured["losses"])
    assert measured["peak_device_bytes"] <= plan.total_bytes <= 1.2 * measured["peak_device_bytes"]
    if run == "e2e_hostcpu_b2":
        assert measured["host_peak_bytes"] <= plan.host_bytes <= 1.2 * measured["host_peak_bytes"]


def test_the_standard_stack_trained_below_the_plan_s_largest_context():
    """Issue 25's last check for the standard stack, as far as it was measured: h200-1 all off
    trained 3 steps at 517,600 tokens, its loss falling: the plan's largest until the MoE
    layer's narrower terms (2026-12-02), 0.87x of today's (592,826, not run: training there is
    the check still to make); and at 1.12x of today's largest (665,580) XLA:GPU's plan is
    past the device (136.41 GiB of 132.8, compiled only), under the plan's 143.50 (1.05x; it
    was 157.30, 1.15x, with four [M, H] and four [M, F] counted)."""
    largest = make_plan(load_config("h200-1", ALL_OFF), 1, platform="gpu", baseline=False,
                        **DEVICE, host_memory=128 * 2**30).largest_context
    assert largest == BASELINE_LARGEST and 517_600 < largest
    run = _session5_run("base_517600")
    assert len(run["losses"]) == 3 and run["losses"][-1] < run["losses"][0]
    above = _session5_run("check_off_665580")
    assert above["xla_plan_gib"] > load_config("h200-1").device.memory_gib
    plan = make_plan(load_config("h200-1", ALL_OFF + ["data.seq_len=665580"]), 1,
                     platform="gpu", baseline=False, search_context=False, **DEVICE)
    assert above["xla_plan_gib"] * 2**30 <= plan.programs["gradient"]


def test_the_host_plan_refuses_the_e2e_run_the_host_killed(monkeypatch):
    """h200-e2e at 427,790 tokens with what the planner then chose (every boundary offloaded,
    the optimizer streamed; pinned-host pool 114 GiB) was killed twice: 123.01 GiB resident,
    under the plan's 124.00 of the config's 125, while the machine's available memory fell from
    124.86 GiB to zero. Held to the memory a run gets (124.8 available, not the total) with
    what the kernel and the driver keep beside the pinned pool (measured by the pinned-host
    probe, h200_session_gpu_20261202-183240.json), the plan refuses it: its process terms still
    bound the resident set, and with the outside share they pass the available memory."""
    monkeypatch.delenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", raising=False)
    run = _session5_run("e2e_auto_427790")
    config = load_config("h200-e2e", ["data.seq_len=427790", "operators.moe_dispatch=pipelined",
                                      "operators.loss=ring", "operators.offload=all",
                                      "operators.optimizer_offload=true"])
    plan = make_plan(config, 1, platform="gpu", baseline=False, search_context=False, **DEVICE,
                     host_memory=int(config.device.host_memory_gib * 2**30))
    outside = plan.host_terms()["host.pinned_outside_process"]
    assert run["host_rss_at_kill_gib"] * 2**30 <= plan.host_bytes - outside
    assert plan.host_bytes > 124.86 * 2**30 and plan.fits_host is False
    # auto at the same context now keeps the boundaries on the device and fits both memories.
    auto = make_plan(load_config("h200-e2e", ["data.seq_len=427790"]), 1, platform="gpu",
                     baseline=False, search_context=False, **DEVICE,
                     host_memory=int(config.device.host_memory_gib * 2**30))
    assert auto.feasible and auto.knobs.num_offloaded == 0


def test_the_pinned_probe_s_outside_share_is_under_the_term():
    """The pinned-host probe (536 fp32 arrays of 5e7 under a 110 GiB cap): what the machine
    lost beyond the process's resident set, sampled every 2 s, never passed the term of the
    pool XLA's allocator model grows to over those arrays."""
    record = json.loads((RESULTS / "h200_session_gpu_20261202-183240.json").read_text())
    probe = record["runs"]["pinned_rss"]
    pool = host_pool.pool_bytes([4 * probe["bucket"]] * probe["arrays"], 110 * 2**30)
    available_at_start = 130952624 * 1024  # meminfo_before_pinned.txt
    lost = available_at_start - (probe["max_vmrss_gib"] + probe["min_mem_available_gib"]) * 2**30
    assert 0 < lost <= host_pool.outside_process_bytes(pool)


def test_the_untied_overlapped_step_scheduled_its_copies_before_the_forward(tmp_path):
    """Issue 26's cause, read off XLA:GPU's schedule of h200-1's overlapped step (the streamed
    optimizer alone, every MoE layer updated before the model was called; the 18:54 dump):
    nearly all of its 390 host copies start and end before the first attention, so none can
    run under the layers (scripts/xla_copy_schedule.py; sco.MadeInLoop is the change)."""
    script = load_script("xla_copy_schedule")
    with tarfile.open(RESULTS / "xla_gpu_live_ranges_h200-1_opt64k_20261201.tgz") as archive:
        (member,) = [m for m in archive.getmembers() if m.name.endswith("live-range.txt")]
        archive.extract(member, tmp_path, filter="data")
    rows = script.copy_schedule(script.read_sequence(tmp_path / member.name))
    assert sum(started for _, started, _ in rows) == 390
    (label, started, ended), *after = rows
    assert label == "start" and started >= 360 and ended >= 360
    assert all(label.startswith(script.ATTENTION) for label, _, _ in after)


SESSION6 = RESULTS / "h200_session_gpu_20261202-162728.json"  # the tied update, 2 copies in flight
SESSION6_LIMIT = RESULTS / "h200_session_gpu_20261202-164706.json"  # 8 and 32 in flight
ON_BACKWARD = ALL_ON_UNROLLED + ["operators.optimizer_writeback=backward"]
OPT_ALONE = ALL_OFF + ["operators.optimizer_offload=true", "operators.layer_loop=unrolled"]
SESSION6_RUNS = [
    # the record, its run, the overrides of h200-1 at 64K
    pytest.param(SESSION6, "on64k_fwd", ALL_ON_UNROLLED, marks=BEFORE_ZEROS_FIX),
    # With 2 host copies in flight XLA:GPU held less of the deferred write-back at its peak:
    # 1.25x with the hoisted sums counted; 1.11x without, against a program that held them
    # (its peak was not at them: the bound holds either way).
    (SESSION6, "on64k_bwd", ON_BACKWARD),
    (SESSION6, "opt64k", OPT_ALONE),
    (SESSION6, "base64k", []),
    pytest.param(SESSION6_LIMIT, "on64k_bwd_l8", ON_BACKWARD, marks=BEFORE_ZEROS_FIX),
    pytest.param(SESSION6_LIMIT, "on64k_bwd_l32", ON_BACKWARD, marks=BEFORE_ZEROS_FIX),
    (SESSION6_LIMIT, "opt64k_bwd", OPT_ALONE + ["operators.optimizer_writeback=backward"]),
    (SESSION6_LIMIT, "base64k", []),
]


@pytest.mark.parametrize("record, run, overrides", SESSION6_RUNS)
def test_the_plan_bounds_the_peaks_of_the_sixth_session(record, run, overrides, monkeypatch):
    """The sixth session's trained runs of h200-1 at 64K (allocator peaks; VmHWM on the host),
    with XLA:GPU's default of 2 host copies in flight and with 8 or 32
    (``cli.GPU_HOST_COPIES_FLAG``): at or under the plan and the plan within 1.2x, device and
    host."""
    monkeypatch.delenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", raising=False)
    plan = make_plan(load_config("h200-1", overrides), 1, platform="gpu", baseline=False,
                     search_context=False, **DEVICE)
    measured = json.loads(record.read_text())["runs"][run]
    assert len(measured["losses"]) == 5 and all(map(math.isfinite, measured["losses"]))
    assert measured["peak_device_bytes"] <= plan.total_bytes <= 1.2 * measured["peak_device_bytes"]
    assert measured["host_peak_bytes"] <= plan.host_bytes <= 1.2 * measured["host_peak_bytes"]


@pytest.mark.xfail(strict=True, reason=(
    "0.87x: 13.4 GiB under the plan. Measured before pipelined_moe._zeros_after (the hoisted "
    "sums: 9.0 GiB) and model.layers.weight_gradients_first, with 8 host copies in flight "
    "(--xla_gpu_experimental_parallel_async_compute_limit=8) where the plan counts its 2 slots "
    "(6 buckets' fp32 state more: ~3.4 GiB); ~1 GiB unexplained. Not re-measured: the "
    "standard stack's planned largest is now 592,826, where all four on trained on today's "
    "program at 125.95 GiB under a plan of 132.62 (1.053x; h200_session_gpu_20261205-015142)"))
def test_all_four_at_the_standard_stack_s_largest_context_compile_under_the_plan():
    """All four on at 517,600 tokens (the standard stack's planned largest before 2026-12-02's
    narrower MoE terms; written back as updated, 8 host copies in flight): XLA:GPU's plan of
    the overlapped step, read from the run's log (the lease ended after its first step), at
    or under the plan and within 1.2x of it."""
    run = json.loads(SESSION6_LIMIT.read_text())["runs"]["on517k_fwd"]
    (line,) = [line for line in run["log_tail"] if "XLA's plan" in line]
    xla_plan = float(re.search(r"XLA's plan ([0-9.]+) GiB", line).group(1)) * 2**30
    plan = make_plan(load_config("h200-1", ALL_ON_UNROLLED + ["data.seq_len=517600"]), 1,
                     platform="gpu", baseline=False, search_context=False, **DEVICE)
    assert xla_plan <= plan.programs["overlapped"] <= 1.2 * xla_plan


SESSION7 = RESULTS / "h200_session_gpu_20261203-103231.json"
SESSION7_RUNS = {
    # run -> overrides of h200-1 (each trained 5 steps, or 3 at 592,826)
    "base64k": [],
    "res8_fwd": ON_UNROLLED + ["operators.optimizer_writeback=forward",
                               "optimizer.resident_groups=8"],
    "res4_bwd": ON_UNROLLED + ["operators.optimizer_writeback=backward",
                               "optimizer.resident_groups=4"],
    "res4_fwd": ON_UNROLLED + ["operators.optimizer_writeback=forward",
                               "optimizer.resident_groups=4"],
    "base592k": ALL_OFF + [f"data.seq_len={BASELINE_LARGEST}"],
}


@pytest.mark.parametrize("run", [pytest.param(run, marks=BEFORE_ZEROS_FIX)
                                 if run.startswith("res") else run for run in SESSION7_RUNS])
def test_the_plan_bounds_the_peaks_of_the_seventh_session(run, monkeypatch):
    """The 2026-12-03 driver's trained runs (the resident sweep at 64K, the standard stack at
    64K and at its largest context): the allocator's peak and the host's VmHWM at or under the
    plan, the plan within 1.2x of each."""
    monkeypatch.delenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", raising=False)
    measured = json.loads(SESSION7.read_text())["runs"][run]
    plan = make_plan(load_config("h200-1", SESSION7_RUNS[run]), 1, platform="gpu",
                     baseline=False, search_context=False, **DEVICE)
    assert all(math.isfinite(loss) for loss in measured["losses"])
    assert measured["peak_device_bytes"] <= plan.total_bytes <= 1.2 * measured["peak_device_bytes"]
    assert measured["host_peak_bytes"] <= plan.host_bytes <= 1.2 * measured["host_peak_bytes"]


def test_the_standard_stack_trains_its_planned_largest_context_and_not_1p1x():
    """Issue 25's last check for the standard stack: h200-1 all off trained 3 steps at the
    plan's largest context (592,826), its loss falling, and at 1.1x of it (652,110) XLA:GPU's
    own plan of the step (compiled only, ``plan --check``) is past the device's memory and at
    or under the closed form."""
    largest = make_plan(load_config("h200-1", ALL_OFF), 1, platform="gpu", baseline=False,
                        **DEVICE, host_memory=128 * 2**30).largest_context
    assert largest == BASELINE_LARGEST
    runs = json.loads(SESSION7.read_text())["runs"]
    trained = runs["base592k"]
    assert f"data.seq_len={largest}" in trained["command"]
    assert len(trained["losses"]) == 3 and trained["losses"][-1] < trained["losses"][0]
    xla_total = _session_checked("check652k", "train_step", SESSION7)
    assert "data.seq_len=652110" in runs["check652k"]["command"] and 652_110 >= 1.1 * largest
    assert xla_total > load_config("h200-1").device.memory_gib * 2**30
    plan = make_plan(load_config("h200-1", ALL_OFF + ["data.seq_len=652110"]), 1,
                     platform="gpu", baseline=False, search_context=False, **DEVICE)
    assert xla_total <= plan.programs["gradient"] <= 1.2 * xla_total


SESSION8 = RESULTS / "h200_session_gpu_20261203-130600.json"
ON = ALL_ON_UNROLLED[:-1]  # the four forced on, the layer loop left to the planner
E2E_8X = ["data.seq_len=540672", "operators.moe_dispatch=pipelined", "operators.token_budget=56292",
          "operators.loss=ring", "operators.offload=none", "operators.optimizer_offload=true",
          "optimizer.resident_groups=0", "operators.layer_loop=scan"]
SESSION8_RUNS = [
    # run, config, overrides as run (the resident count as the planner chose it then, each
    # run's banner), what is over
    ("on64k_autoK", "h200-1", ON + ["optimizer.resident_groups=8"], None),
    ("pgle_profiled", "h200-1", ON_BACKWARD + ["optimizer.resident_groups=0"], None),
    ("pgle_used", "h200-1", ON_BACKWARD + ["optimizer.resident_groups=0"], None),
    ("hostcpu64k", "h200-e2e", ALL_OFF + ["data.seq_len=65536", "optimizer.update_on=host_cpu"],
     None),
    ("auto64k", "h200-e2e", ["data.seq_len=65536"], None),
    ("on512k_autoK", "h200-1", ON + ["data.seq_len=524288", "optimizer.resident_groups=4"], None),
    # 1.37x until the MoE layers' new weights were counted beside the dense layer's forward,
    # not the backward, where the layer loop is scanned (overlap.forward): 1.17x.
    ("e2e_8x", "h200-e2e", E2E_8X, None),
]


@pytest.mark.parametrize("run, config, overrides", [
    pytest.param(run, config, overrides, marks=_over(over) if over else ())
    for run, config, overrides, over in SESSION8_RUNS])
def test_the_plan_bounds_the_peaks_after_the_zeros_fix(run, config, overrides, monkeypatch):
    """The 2026-12-03 13:06 driver's trained runs, the first of programs without the MoE
    layers' hoisted zeros (pipelined_moe._zeros_after): the allocator's peak at or under the
    plan and the plan within 1.2x of it, each planned against the device's memory (the runs
    that lifted the check only let the trainer start; the knobs are the config's)."""
    monkeypatch.delenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", raising=False)
    measured = json.loads(SESSION8.read_text())["runs"][run]
    assert len(measured["losses"]) in (3, 5) and all(map(math.isfinite, measured["losses"]))
    plan = make_plan(config_module.load_config(config, overrides), 1, platform="gpu",
                     baseline=False, search_context=False, **DEVICE)
    assert measured["peak_device_bytes"] <= plan.total_bytes <= 1.2 * measured["peak_device_bytes"]


@pytest.mark.parametrize("run, config, overrides", [
    (run, config, overrides) for run, config, overrides, _ in SESSION8_RUNS])
def test_the_host_plan_bounds_the_resident_memory_after_the_zeros_fix(run, config, overrides,
                                                                      monkeypatch):
    """The same runs' VmHWM at or under the host plan, and the plan within 1.2x of it."""
    monkeypatch.delenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", raising=False)
    measured = json.loads(SESSION8.read_text())["runs"][run]["host_peak_bytes"]
    plan = make_plan(config_module.load_config(config, overrides), 1, platform="gpu",
                     baseline=False, search_context=False, **DEVICE)
    assert measured <= plan.host_bytes <= 1.2 * measured


@pytest.mark.parametrize("run, context, resident", [("on64k_autoK", 65_536, 8)])
def test_the_planner_s_resident_count_is_the_run_s(run, context, resident):
    """Left to the planner, h200-1 all four on keeps all 8 groups' state on the device at 64K,
    as the run's banner said; its host peak follows (8.29 GiB, none of the state). (At 524,288
    the run kept the 4 the planner chose then; with the dense FFN's four [N, F_d] no longer
    counted there, model.layers.weight_gradients_first, the planner keeps all 8: untrained.)"""
    plan = make_plan(config_module.load_config("h200-1", ON + [f"data.seq_len={context}"]), 1,
                     platform="gpu", baseline=False, search_context=False, **DEVICE)
    assert plan.knobs.resident_groups == resident
    measured = json.loads(SESSION8.read_text())["runs"][run]
    assert any(f"{resident} of 8 groups" in line for line in measured["log_tail"]) or (
        resident == 8 and measured["host_peak_bytes"] < 9 * 2**30)


def test_all_four_at_698k_compile_under_the_plan_without_the_hoisted_zeros():
    """All four on at 698,002 tokens (no group resident), compiled only: XLA:GPU's plan of the
    overlapped step fell from 124.15 GiB to 105.58 with the MoE loop zeros made per layer
    (pipelined_moe._zeros_after); its live ranges (..._on698k_zeros_20261203.tgz) hold no fp32
    weight-gradient sum but the layer's own, and none of the dense FFN's [N, F_d] under the
    attention's backward. At or under the closed form, and within 1.2x (1.36x while the plan
    counted four [N, F_d] there; 1.07x now, with XLA's packing counted)."""
    xla_total = _session_checked("dump698k", "overlapped_step", SESSION8)
    plan = make_plan(load_config("h200-1", ON + ["data.seq_len=698002"]), 1, platform="gpu",
                     baseline=False, search_context=False, **DEVICE)
    assert xla_total <= plan.programs["overlapped"] <= 1.2 * xla_total


SESSION9 = RESULTS / "h200_session_gpu_20261203-164617.json"
SESSION10 = RESULTS / "h200_session_gpu_20261203-191200.json"
SESSION11 = RESULTS / "h200_session_gpu_20261203-192857.json"
SESSION12 = RESULTS / "h200_session_gpu_20261203-225100.json"  # all four at 592,826; 889,240
SESSION13 = RESULTS / "h200_session_gpu_20261203-232644.json"  # 940,692 trained
SESSION14 = RESULTS / "h200_session_gpu_20261204-150655.json"  # all four at 889,240; e2e dumps
LARGEST_FFN_ORDERED = 855_174
"""The largest context the plan gave h200-1 with operators auto from the dense FFN's backward
ordered where SCO offloads (model.layers.weight_gradients_first) until the overlapped step wrote
its MoE weights and gradients in place (2026-12-04): 1.44x the standard stack's."""
PINNED_AT_LARGEST = ["operators.moe_dispatch=pipelined", "operators.token_budget=16384",
                     "operators.loss=materialized", "operators.offload=all",
                     "operators.optimizer_offload=true", "optimizer.resident_groups=0"]
"""The knobs the planner chose at LARGEST_FFN_ORDERED, and chooses at OURS_LARGEST, pinned where
a run lifted the device check."""
E2E_684K = ["data.seq_len=684042", "operators.layer_loop=scan", "operators.moe_dispatch=pipelined",
            "operators.token_budget=97721", "operators.loss=ring", "operators.offload=all",
            "operators.optimizer_offload=true", "optimizer.resident_groups=2"]
"""h200-e2e at the plan's largest context with the layer loop scanned, with the knobs the
planner chose there (2026-12-03)."""


@pytest.mark.parametrize("record, run, config, overrides, program", [
    (SESSION9, "on524k", "h200-1", ON + ["data.seq_len=524288", "optimizer.resident_groups=0"],
     "overlapped"),
    (SESSION9, "on524k", "h200-1", ON + ["data.seq_len=524288", "optimizer.resident_groups=0"],
     "optimizer_step"),
    # Compiled with the scheduler's memory limit raised (slop factor 130): the optimizer's own
    # program with 4 of 8 groups resident takes their state in (25.56 GiB of arguments), which
    # the plan's optimizer_step left out until this lease (18.38 GiB: ABOVE THE BOUND).
    (SESSION9, "slop524k", "h200-1", ON + ["data.seq_len=524288", "optimizer.resident_groups=4"],
     "optimizer_step"),
    (SESSION9, "slop524k", "h200-1", ON + ["data.seq_len=524288", "optimizer.resident_groups=4"],
     "overlapped"),
    (SESSION9, "dump_e2e540k", "h200-e2e", E2E_8X, "optimizer_step"),
    (SESSION9, "dump_e2e540k", "h200-e2e", E2E_8X, "overlapped"),
    # The first compiles with the dense FFN's backward ordered (the 19:12 driver): 524,288 at
    # 82.13 GiB against 90.92, where XLA had chosen that order itself at 82.36 before the
    # barrier; 940,692 at 130.10 against 143.62.
    (SESSION10, "check524k", "h200-1",
     ON + ["data.seq_len=524288", "optimizer.resident_groups=0"], "overlapped"),
    (SESSION10, "check524k", "h200-1",
     ON + ["data.seq_len=524288", "optimizer.resident_groups=0"], "optimizer_step"),
    (SESSION10, "over1p1", "h200-1", PINNED_AT_LARGEST + ["data.seq_len=940692"], "overlapped"),
    (SESSION10, "over1p1", "h200-1", PINNED_AT_LARGEST + ["data.seq_len=940692"],
     "optimizer_step"),
    # The 2026-12-04 driver: h200-e2e scanned at 684,042, the plan's largest scanned, where no
    # run had been (121.99 GiB against 133.19); unrolled at 540,672 (117.04 against 138.47:
    # 144.19, 1.23x, while the MoE stack's boundaries were counted in the dense layer's
    # backward too); h200-1 at 1.2x ours' largest (140.86 against 154.45).
    *[(SESSION14, run, config, overrides, program)
      for run, config, overrides in [
          ("dump_e2e684k", "h200-e2e", E2E_684K),
          ("dump_e2e540k_unrolled", "h200-e2e", E2E_8X[:-1] + ["operators.layer_loop=unrolled"]),
          ("check1p2", "h200-1", PINNED_AT_LARGEST + ["data.seq_len=1026208"])]
      for program in ("overlapped", "optimizer_step")],
])
def test_the_plan_bounds_the_drivers_compiles(record, run, config, overrides, program):
    """The 2026-12-03 16:46 and 19:12 and 2026-12-04 15:06 drivers' compiles (``plan
    --check``, the device check lifted): XLA's GPU plan of each program at or under the closed
    form, and within 1.2x."""
    check = {"overlapped": "overlapped_step", "optimizer_step": "optimizer_step"}[program]
    xla = _session_checked(run, check, record)
    plan = make_plan(config_module.load_config(config, overrides), 1, platform="gpu",
                     baseline=False, search_context=False, **DEVICE)
    assert xla <= plan.programs[program] <= 1.2 * xla


def _read_dump(archive: pathlib.Path, module: str, tmp_path, folder: str = ""):
    """scripts/xla_live_set.py, and what it reads of ``module`` in a dump's archive (under
    ``folder`` of it, where it holds several): its values, allocations, schedule and live
    ranges."""
    script = load_script("xla_live_set")
    with tarfile.open(archive) as opened:
        opened.extractall(tmp_path, filter="data")
    (buffers,) = (tmp_path / folder).rglob(f"*{module}*buffer-assignment.txt")
    (live_ranges,) = (tmp_path / folder).rglob(f"*{module}*live-range.txt")
    values, allocations, _ = script.read_buffers(buffers)
    schedule, ranges = script.read_live_ranges(live_ranges)
    return script, values, allocations, schedule, ranges


def _unused_at_peak(archive: pathlib.Path, module: str, tmp_path) -> int:
    """What XLA:GPU allocated on the device for ``module`` less the most it had in use at
    once (each byte once, scripts/xla_live_set.py), from a dump's buffer assignment."""
    script, values, allocations, schedule, ranges = _read_dump(archive, module, tmp_path)
    peak = max(script.usage(values, ranges, len(schedule)))
    return sum(size for size, description in allocations.values()
               if script._color(description) == 0) - peak


@pytest.mark.parametrize("archive, config, overrides", [
    ("xla_gpu_live_ranges_h200-1_on698k_zeros_20261203.tgz", "h200-1",
     ON + ["data.seq_len=698002", "optimizer.resident_groups=0"]),
    ("xla_gpu_live_ranges_h200-e2e_on540k_scan_20261203.tgz", "h200-e2e", E2E_8X),
])
def test_the_packing_term_covers_what_xla_left_unused(archive, config, overrides, tmp_path):
    """The plan's overlap.packing against XLA:GPU's buffer assignments of the two overlapped
    steps it was read from: what XLA left unused at the peak is at most the term, and more
    than two thirds of it."""
    plan = make_plan(config_module.load_config(config, overrides), 1, platform="gpu",
                     baseline=False, search_context=False, **DEVICE)
    (term,) = [t.bytes for t in plan.terms if t.name == "overlap.packing"]
    assert 2 / 3 * term < _unused_at_peak(RESULTS / archive, "overlapped", tmp_path) <= term


def test_unrolled_the_dense_layer_s_backward_holds_its_own_boundary_only(tmp_path):
    """Why the plan counts the MoE stack's boundaries (kept_boundaries.moe_stack) beside the
    loss and the MoE layers' backward but not the dense layer's, where the layer loop is
    unrolled: XLA:GPU's buffer assignment of h200-e2e's overlapped step at 540,672 tokens
    (offload none, 2026-12-04) holds at least the 12 layers' boundaries ([N, H] values made in
    the forward) when its backward starts; each MoE layer's backward frees its own, and at the
    program's peak, in the dense FFN's backward, one is left. (So counted, the plan there is
    the MoE layer's, 138.47 GiB, 1.18x XLA's 117.04: test_the_plan_bounds_the_drivers_compiles;
    1.23x with every boundary beside the dense layer's backward.)"""
    script, values, _, schedule, ranges = _read_dump(
        RESULTS / "xla_gpu_live_ranges_h200-e2e_on540k_unrolled_20261204.tgz", "overlapped",
        tmp_path)
    used = script.usage(values, ranges, len(schedule))
    peak = max(range(len(used)), key=used.__getitem__)
    backward = next(i for i, name in enumerate(schedule) if "attention_bwd" in name)
    boundary = 540_672 * 2048 * 2

    def made_in_the_forward_and_live(step):
        return {name for name, first, last in ranges
                if first < backward and first <= step <= last
                and (value := script._lookup(values, name)) and value[2] == boundary}

    layers = load_config("h200-e2e").model.num_layers
    assert len(made_in_the_forward_and_live(backward - 1)) >= layers == 12
    assert len(made_in_the_forward_and_live(peak)) == 1


def test_the_standard_stack_s_step_leaves_nothing_unused(tmp_path):
    """Why overlap.packing is the overlapped step's alone: XLA:GPU's buffer assignment of h200-1
    all off at 443,720 tokens allocated what it had in use at its peak, within 6 MB of 109.19
    GiB (and the standard stack's plan has no such term)."""
    assert _unused_at_peak(OFF_443K, "train_step", tmp_path) < 6 * 10**6
    plan = make_plan(load_config("h200-1", ALL_OFF + ["data.seq_len=443720"]), 1,
                     platform="gpu", baseline=False, search_context=False, **DEVICE)
    assert not any(t.name == "overlap.packing" for t in plan.terms)


def _record_run(record: pathlib.Path, run: str) -> dict:
    return json.loads(record.read_text())["runs"][run]


TRAINED_WITH_THE_FFN_ORDERED = [
    # (record, run, overrides of h200-1 as run; the resident count left to the planner)
    (SESSION10, "base64k", []),
    (SESSION10, "on64k_autoK", ON),
    (SESSION10, "alone_moe_dispatch", ALL_OFF[1:] + ["operators.moe_dispatch=pipelined"]),
    (SESSION10, "alone_loss", ALL_OFF[:1] + ALL_OFF[2:] + ["operators.loss=ring"]),
    (SESSION10, "alone_offload", ALL_OFF[:2] + ALL_OFF[3:] + ["operators.offload=all"]),
    (SESSION10, "largest", [f"data.seq_len={LARGEST_FFN_ORDERED}"]),
    (SESSION11, "std592k", ALL_OFF + [f"data.seq_len={BASELINE_LARGEST}"]),
    (SESSION11, "auto592k", [f"data.seq_len={BASELINE_LARGEST}"]),
    (SESSION12, "on592k", ON + [f"data.seq_len={BASELINE_LARGEST}"]),
    # Past the plan's largest, the device check lifted: XLA:GPU recomputed to fit.
    (SESSION12, "ours889k", PINNED_AT_LARGEST + ["data.seq_len=889240"]),
    (SESSION13, "train940k", PINNED_AT_LARGEST + ["data.seq_len=940692"]),
    # All four forced on there (the ring loss where the planner chose the materialized one).
    (SESSION14, "all4on889k", [o for o in PINNED_AT_LARGEST if not o.startswith("operators.loss")]
     + ["operators.loss=ring", "data.seq_len=889240"]),
]


@pytest.mark.parametrize("record, run, overrides", TRAINED_WITH_THE_FFN_ORDERED,
                         ids=[run for _, run, _ in TRAINED_WITH_THE_FFN_ORDERED])
def test_the_plan_bounds_the_runs_with_the_ffn_ordered(record, run, overrides, monkeypatch):
    """The trained runs of the 2026-12-03 drivers (19:12, 19:28, 22:51, 23:26) and of
    2026-12-04 15:06, each a fresh process: the allocator's peak and the process's peak
    resident memory (VmHWM) at or under the plan of the same config and knobs, and the plan
    within 1.2x of each (device 1.02-1.13x, host 1.01-1.13x)."""
    monkeypatch.delenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", raising=False)
    measured = _record_run(record, run)
    assert len(measured["losses"]) in (3, 5) and all(map(math.isfinite, measured["losses"]))
    for override in overrides:
        assert override in measured["command"]
    config = config_module.load_config("h200-1", overrides)
    plan = make_plan(config, 1, platform="gpu", baseline=False, search_context=False,
                     device_memory=int(config.device.memory_gib * 2**30),
                     host_memory=int(config.device.host_memory_gib * 2**30))
    device, host = measured["peak_device_bytes"], measured["host_peak_bytes"]
    assert device <= plan.total_bytes <= 1.2 * device
    assert host <= plan.host_bytes <= 1.2 * host


def _rematerialized(archive: pathlib.Path) -> int:
    """How many values XLA:GPU's rematerialization made (named ``*.remat*``) in a dump's
    buffer assignment."""
    with tarfile.open(archive) as opened:
        (member,) = [m for m in opened.getmembers() if m.name.endswith("buffer-assignment.txt")]
        text = opened.extractfile(member).read().decode()
    return len(re.findall(r"^ value: <\d+ \S+\.remat\d*\S* @", text, re.MULTILINE))


@pytest.mark.parametrize("archive, rematerialized", [
    # XLA's total of each program (GiB): 130.10, 124.15, 105.58, 109.19, 105.02
    ("xla_gpu_buffer_assignment_h200-1_on940k_remat_20261203.tgz", True),
    ("xla_gpu_live_ranges_h200-1_on698k_20261203.tgz", True),
    ("xla_gpu_live_ranges_h200-1_on698k_zeros_20261203.tgz", False),
    ("xla_gpu_live_ranges_h200-1_off443k_20261202.tgz", False),
    ("xla_gpu_live_ranges_h200-e2e_on540k_scan_20261203.tgz", False),
])
def test_xla_rematerializes_only_where_its_schedule_is_past_the_device(archive, rematerialized):
    """Why 1.1x of the plan's largest compiled within the device: after scheduling, XLA:GPU
    recomputes values (HloRematerialization, under the scheduler's memory limit, taken from
    the device's memory) to fit where it can, which the closed form does not model. Its
    dumps say so: the two programs whose schedules were past the limit (940,692 tokens, and
    698,002 while the MoE loop's zeros were hoisted) hold rematerialized values; the three
    compiled well within it hold none. XLA's totals are the compiles' ``--check`` tables."""
    assert (_rematerialized(RESULTS / archive) > 0) == rematerialized


def test_1_2x_of_ours_largest_does_not_fit():
    """Where the plan's largest context is tight: at 1.2x it (1,026,208 tokens), with the knobs
    it chose there, XLA:GPU's plan of the overlapped step, rematerialization and all, is past
    the device's memory (140.86 GiB of 132.8; the 2026-12-04 driver's compile), where at 1.1x
    it fit by recomputing (test_1_1x_of_ours_largest_does_not_fit's reason)."""
    run = _record_run(SESSION14, "check1p2")
    assert "data.seq_len=1026208" in run["command"] and 1_026_208 == int(1.2 * LARGEST_FFN_ORDERED)
    for override in PINNED_AT_LARGEST:
        assert override in run["command"]
    xla = _session_checked("check1p2", "overlapped_step", SESSION14)
    assert xla > load_config("h200-1").device.memory_gib * 2**30


def test_past_the_plan_s_largest_xla_s_recomputation_trains_slower():
    """What the plan's largest context means where XLA:GPU recomputes past the device: the last
    one its schedule fits without recomputing. With the knobs it chose there pinned and the
    device check lifted, 889,240 (1.5x the standard stack's largest) and 940,692 (1.1x ours')
    trained 3 steps within the device, each at a lower MFU (attention counted within
    documents): 40.8% at 855,174, 38.9%, 35.9%."""
    runs = [_record_run(SESSION10, "largest"), _record_run(SESSION12, "ours889k"),
            _record_run(SESSION13, "train940k")]
    for run, context in zip(runs, (LARGEST_FFN_ORDERED, 889_240, 940_692)):
        assert f"data.seq_len={context}" in run["command"] and len(run["losses"]) == 3
        assert run["losses"][-1] < run["losses"][0]
        assert run["peak_device_bytes"] <= DEVICE["device_memory"]
    assert 889_240 >= 1.5 * BASELINE_LARGEST and 940_692 >= 1.1 * LARGEST_FFN_ORDERED
    assert runs[0]["mfu"] > runs[1]["mfu"] > runs[2]["mfu"]


def test_a_refusal_just_past_the_device_names_xla_s_own_remat():
    """Where a GPU plan is past the device by at most programs.REMAT_REACH, the refusal offers
    the lift that lets XLA:GPU try: at 940,692 tokens (the plan 1.012x the device) XLA's plan
    was 130.10 GiB, within it; at 1,026,208 (1.093x) it was past it (140.86), and the refusal
    does not offer it."""
    from peakflat_jax.plan.programs import _reasons

    def reasons(context: int) -> str:
        config = config_module.load_config("h200-1", PINNED_AT_LARGEST
                                           + [f"data.seq_len={context}"])
        plan = make_plan(config, 1, platform="gpu", baseline=False, search_context=False,
                         **DEVICE)
        assert plan.fits_device is False
        return " ".join(_reasons(plan))

    assert _session_checked("over1p1", "overlapped_step", SESSION10) <= DEVICE["device_memory"]
    assert _session_checked("check1p2", "overlapped_step", SESSION14) > DEVICE["device_memory"]
    offered = reasons(940_692)  # the plan: 134.39 GiB
    assert "pin the operators" in offered and "train.device_memory_gib=135:" in offered
    assert "train.device_memory_gib" not in reasons(1_026_208)


SESSION15 = RESULTS / "h200_session_gpu_20261204-153030.json"  # h200-e2e at auto's largest
AUTO_534K_AS_RUN = ["data.seq_len=533994", "operators.moe_dispatch=pipelined",
                    "operators.token_budget=88999", "operators.loss=ring", "operators.offload=all",
                    "operators.optimizer_offload=true", "optimizer.resident_groups=0"]
"""h200-e2e at the plan's largest context under auto as the 2026-12-04 15:30 run chose it, with
its pinned-host pool's cap (112 GiB) in the environment (its banner and its dump's
bf16[6, 88999, 2048]; the trainer now chooses ``peakflat plan``'s 1 group and 8 chunks:
tests/test_plan_host_pool.py)."""


def _auto_534k_plan(monkeypatch):
    monkeypatch.setenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "112")
    config = load_config("h200-e2e", AUTO_534K_AS_RUN)
    return make_plan(config, 1, platform="gpu", baseline=False, search_context=False, **DEVICE,
                     host_memory=int(config.device.host_memory_gib * 2**30))


def test_e2e_trains_at_the_plan_s_largest_under_auto_within_its_plan(monkeypatch):
    """h200-e2e at the plan's largest context under auto until 2026-12-04 18:14, 533,994
    tokens (unrolled): it trained 3 steps, the loss falling, at 138.9 s a step (MFU 43.7%),
    the allocator's peak (89.22 GiB) and the host's VmHWM (122.41 GiB) at or under the plan
    (131.82 then, 97.76 now; 124.45), the host within 1.2x (1.017x)."""
    measured = _record_run(SESSION15, "auto_e2e534k")
    assert "data.seq_len=533994" in measured["command"] and "operators." not in measured["command"]
    assert len(measured["losses"]) == 3 and measured["losses"][-1] < measured["losses"][0]
    plan = _auto_534k_plan(monkeypatch)
    assert measured["peak_device_bytes"] <= plan.total_bytes
    assert measured["host_peak_bytes"] <= plan.host_bytes <= 1.2 * measured["host_peak_bytes"]


def test_e2e_at_the_plan_s_largest_under_auto_is_within_1_2x_of_its_plan(monkeypatch):
    """The same run's plan within 1.2x of its device peak (issue 25's rule): 1.48x until the
    plan counted four [M_c, H] rows, as XLA:GPU's buffer assignments of the pipelined layer
    hold them, and the new weights once (97.76 GiB against 89.22, 1.096x; this program held
    the new weights per layer, which today's does not)."""
    measured = _record_run(SESSION15, "auto_e2e534k")["peak_device_bytes"]
    assert _auto_534k_plan(monkeypatch).total_bytes <= 1.2 * measured


SESSION16 = RESULTS / "h200_session_gpu_20261204-181441.json"  # new weights in place (2fe39bb)
SESSION17 = RESULTS / "h200_session_gpu_20261204-184414.json"  # and gradients (3880cf6)
E2E_540K_UNROLLED = E2E_8X[:-1] + ["operators.layer_loop=unrolled"]
E2E_LARGEST = 741_848
"""The largest context the plan gives h200-e2e under operators auto (unrolled), the MoE layers'
new weights and gradients written in place and four [M_c, H] rows counted: 11.3x the 65,536 the
standard stack trains with AdamW on the host CPU (docs/end_to_end.md)."""
AUTO_741K_AS_RUN = [f"data.seq_len={E2E_LARGEST}", "operators.moe_dispatch=pipelined",
                    "operators.token_budget=74185", "operators.loss=ring",
                    "operators.offload=none", "operators.optimizer_offload=true",
                    "optimizer.resident_groups=0"]
"""The knobs the trainer chose there (its banner: pipelined, ring, 0 of 12 boundaries offloaded,
the optimizer streamed; its dump's bf16[10, 74185, 2048]), as ``peakflat plan`` chooses them."""


GRADIENTS_STACKED_AT_THE_END = pytest.mark.xfail(strict=True, raises=AssertionError, reason=(
    "1.001x above (107.445 GiB against 107.326): this program wrote the new weights in place "
    "but stacked the gradients at its end, and XLA:GPU held ten layers' (11.25 GiB) through "
    "the dense layer's backward (test_the_unrolled_step_holds_no_layer_s_copy_beside_the_"
    "stacks); 3880cf6 writes them in place too"))


@pytest.mark.parametrize("record, run, config, overrides, program", [
    pytest.param(record, run, config, overrides, program,
                 marks=GRADIENTS_STACKED_AT_THE_END
                 if (run, program) == ("check540u", "overlapped") else ())
    for record, run, config, overrides in [
        (SESSION16, "check855", "h200-1", PINNED_AT_LARGEST + ["data.seq_len=855174"]),
        (SESSION16, "check540u", "h200-e2e", E2E_540K_UNROLLED),
        (SESSION17, "check855b", "h200-1", PINNED_AT_LARGEST + ["data.seq_len=855174"]),
        (SESSION17, "check540u2", "h200-e2e", E2E_540K_UNROLLED)]
    for program in ("overlapped", "optimizer_step")])
def test_the_plan_bounds_the_in_place_step_s_compiles(record, run, config, overrides, program):
    """The 2026-12-04 18:14 and 18:44 compiles (``plan --check``) of the overlapped step that
    writes the MoE layers' new weights (and, from 3880cf6, their gradients) into stacked arrays
    in place: XLA's GPU plan at or under the closed form and within 1.2x. h200-e2e at 540,672
    unrolled: 98.92 GiB against 107.33 (1.085x; 117.04 with the per-layer copies); h200-1 at
    855,174: 116.55 against 123.56 (1.060x)."""
    run_record = _record_run(record, run)
    for override in overrides:
        assert override in run_record["command"]
    check = {"overlapped": "overlapped_step", "optimizer_step": "optimizer_step"}[program]
    xla = _session_checked(run, check, record)
    plan = make_plan(config_module.load_config(config, overrides), 1, platform="gpu",
                     baseline=False, search_context=False, **DEVICE)
    assert xla <= plan.programs[program] <= 1.2 * xla


def test_e2e_trains_at_the_plan_s_largest_under_auto_within_1_2x_of_its_plan(monkeypatch):
    """Issue 25's last check for h200-e2e: the plan's largest context under auto is 741,848
    tokens, with the knobs the trainer chose there, and it trained 3 steps there (the 18:14
    lease), the loss falling, at 260.4 s a step (MFU 43.9%): the allocator's peak (131.14 GiB)
    and the host's VmHWM (102.92) at or under the plan (132.80, 104.45) and within 1.2x
    (1.013x, 1.015x). That program (2fe39bb) stacked the MoE gradients at its end, which
    today's writes in place: it holds less (test_the_plan_bounds_the_in_place_step_s_compiles),
    not measured at this context."""
    monkeypatch.delenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", raising=False)
    config = load_config("h200-e2e", ["optimizer.resident_groups=null"])
    memory = dict(device_memory=int(config.device.memory_gib * 2**30),
                  host_memory=int(config.device.host_memory_gib * 2**30))
    assert make_plan(config, 1, platform="gpu", baseline=False, **memory).largest_context == (
        E2E_LARGEST)
    at = make_plan(load_config("h200-e2e", ["optimizer.resident_groups=null",
                                            f"data.seq_len={E2E_LARGEST}"]),
                   1, platform="gpu", baseline=False, search_context=False, **memory)
    as_run = config_module.load_config("h200-e2e", AUTO_741K_AS_RUN)
    assert (at.knobs.moe_dispatch, at.knobs.token_budget, at.knobs.loss) == (
        as_run.operators.moe_dispatch, as_run.operators.token_budget, as_run.operators.loss)
    assert not any(at.knobs.offload) and at.knobs.resident_groups == 0
    measured = _record_run(SESSION16, "auto741k")
    assert f"data.seq_len={E2E_LARGEST}" in measured["command"]
    assert "operators." not in measured["command"]
    assert len(measured["losses"]) == 3 and measured["losses"][-1] < measured["losses"][0]
    device, host = measured["peak_device_bytes"], measured["host_peak_bytes"]
    assert device <= at.total_bytes <= 1.2 * device
    assert host <= at.host_bytes <= 1.2 * host


def _values_at_peak(archive: str, tmp_path) -> list[tuple]:
    """The buffers ((allocation, offset, size, shape), one per live range) of the values
    XLA:GPU's buffer assignment of the overlapped step in ``archive`` holds at its peak."""
    script, values, _, schedule, ranges = _read_dump(RESULTS / archive, "overlapped", tmp_path)
    used = script.usage(values, ranges, len(schedule))
    peak = max(range(len(used)), key=used.__getitem__)
    return [value for name, first, last in ranges if first <= peak <= last
            and (value := script._lookup(values, name))]


def _layer_copies_at_peak(archive: str, tmp_path) -> tuple[int, int]:
    """How many values of one MoE layer's weight (bf16 [64, 2048, 1536] or its transpose) and
    of the eleven layers' stack of one (bf16 [11, 64, 2048, 1536]) XLA:GPU's buffer assignment
    of h200-e2e's overlapped step holds at its peak."""
    layer = 64 * 2048 * 1536 * 2
    sizes = [size for _, _, size, _ in _values_at_peak(archive, tmp_path)]
    return sizes.count(layer), sizes.count(11 * layer)


@pytest.mark.parametrize("archive, per_layer, stacked", [
    # The per-layer new weights of ten layers beside the stacks (the output) and the donated
    # parameters, 117.04 GiB.
    ("xla_gpu_live_ranges_h200-e2e_on540k_unrolled_20261204.tgz", 30, 3),
    # The new weights written in place; the ten layers' gradients per layer, 107.45 GiB.
    ("xla_gpu_live_ranges_h200-e2e_on540k_weights_inplace_20261204.tgz", 30, 3),
    # Both written in place (3880cf6): the new weights' and the gradients' stacks only, 98.92.
    ("xla_gpu_live_ranges_h200-e2e_on540k_inplace_20261204.tgz", 0, 6),
    # At 741,848 under auto: the gradients per layer (2fe39bb, trained at 131.14 GiB), then
    # both in place (bff6b63, compiled at 131.37: the peak moved, its stacks six).
    ("xla_gpu_live_ranges_h200-e2e_auto741k_20261204.tgz", 30, 3),
    ("xla_gpu_live_ranges_h200-e2e_auto741k_inplace_20261205.tgz", 0, 6),
])
def test_the_unrolled_step_holds_no_layer_s_copy_beside_the_stacks(archive, per_layer, stacked,
                                                                   tmp_path):
    """Why the plan counts the unrolled overlapped step's new MoE weights once
    (``overlap.new_weights``) and its gradients as the persistent ``grads``: at the peak of
    h200-e2e's step at 540,672 tokens (the dense FFN's backward), XLA:GPU's buffer assignment
    held thirty per-layer copies (ten layers' three weights) beside the stacks while the step
    stacked them at its end; since sco.MadeInLoop writes each layer's into the stacked arrays
    in place, none."""
    assert _layer_copies_at_peak(archive, tmp_path) == (per_layer, stacked)


def _most_live_of_size(archive: str, size: int, tmp_path) -> int:
    """The most values of ``size`` bytes XLA:GPU's buffer assignment of the overlapped step
    in ``archive`` holds at once."""
    script, values, _, schedule, ranges = _read_dump(RESULTS / archive, "overlapped", tmp_path)
    sized = [(first, last) for name, first, last in ranges
             if (value := script._lookup(values, name)) and value[2] == size]
    return max(sum(first <= step <= last for first, last in sized)
               for step in range(len(schedule)))


@pytest.mark.parametrize("archive, budget", [
    ("xla_gpu_live_ranges_h200-e2e_auto534k_unrolled_20261204.tgz", 88_999),
    ("xla_gpu_live_ranges_h200-e2e_auto741k_20261204.tgz", 74_185),
    ("xla_gpu_live_ranges_h200-e2e_auto741k_inplace_20261205.tgz", 74_185),
])
def test_the_pipelined_layer_holds_four_rows_of_width_h_on_a_gpu(archive, budget, tmp_path):
    """Why the plan counts four [M_c, H] for the pipelined MoE layer on one GPU, unrolled
    (``moe.dispatch_gpu_pipelined``), where the operator's CPU-measured terms count nine:
    XLA:GPU's buffer assignments of h200-e2e's step at 533,994 (6 chunks of 88,999 tokens)
    and 741,848 (10 of 74,185) never hold more than four at once, and do hold four."""
    from peakflat_jax.ops.pipelined_moe import ROW_ALIGNMENT

    model = load_config("h200-e2e").model
    rows = -(-model.top_k * budget // ROW_ALIGNMENT) * ROW_ALIGNMENT  # the exchange's padding
    assert _most_live_of_size(archive, rows * model.hidden * 2, tmp_path) == 4


def test_the_gpu_forms_apply_where_they_were_measured():
    """The two GPU forms of the in-place overlapped step's plan, where the dumps above measured
    them only: one GPU, the layers unrolled, the MoE pipelined in chunks on the Mosaic path.
    Scanned, on two devices or in one chunk the older counts stay. (Without the dense layer,
    whose FFN is the plan's layer scanned, the MoE layer's terms are the plan's.)"""
    def terms(overrides, devices=1):
        config = load_config("h200-e2e", AUTO_741K_AS_RUN + ["model.num_dense_layers=0",
                                                             *overrides])
        plan = make_plan(config, devices, platform="gpu", baseline=False, search_context=False)
        return {t.name: t for t in plan.terms}

    def four_rows(found):
        return "4 * M * H * b on one GPU" in found["moe.dispatch"].formula

    unrolled = terms(["operators.layer_loop=unrolled"])
    assert "overlap.new_weights" in unrolled and four_rows(unrolled)
    scanned = terms(["operators.layer_loop=scan"])
    assert "overlap.moe_layer_weights" in scanned and not four_rows(scanned)
    two = terms(["operators.layer_loop=unrolled", "mesh.data=2", "data.batch_size=2"],
                devices=2)
    assert "overlap.moe_layer_weights" in two and not four_rows(two)
    one_chunk = terms(["operators.layer_loop=unrolled", "operators.max_chunks=1"])
    assert not four_rows(one_chunk)


SESSION18 = RESULTS / "h200_session_gpu_20261205-015142.json"  # today's program, issue 25's sweep
OURS_LARGEST = 928_166
"""The largest context the plan gives h200-1 with operators auto since the overlapped step
writes its MoE layers' new weights and gradients in place (3880cf6): 1.57x the standard
stack's."""
IN_PLACE_RUNS = {
    # run: (config, the overrides it ran with, the groups whose state the trainer kept on the
    # device, its banner)
    "on64k": ("h200-1", ON, 8),
    "opt64k": ("h200-1", ALL_OFF + ["operators.optimizer_offload=true"], 8),
    "on592k": ("h200-1", ON + [f"data.seq_len={BASELINE_LARGEST}"], 8),
    "ours928k": ("h200-1", [f"data.seq_len={OURS_LARGEST}"], 0),
    "e2e64k": ("h200-e2e", ["data.seq_len=65536"], 11),
    "e2e32kb8": ("h200-e2e", ["data.seq_len=32768", "data.batch_size=8"], 6),
    "e2e262k": ("h200-e2e", ["data.seq_len=262144"], 2),
}


def _banner_resident_groups(run: dict) -> int:
    """The optimizer groups the run kept on the device, as its banner said (0: none)."""
    found = re.search(r"optimizer offloaded \((\d+) of \d+ groups", run["banner"])
    return int(found.group(1)) if found else 0


def _machine(config_name: str) -> dict:
    """The device's and the host's memory of the machine the config targets, as the
    trainer and ``peakflat plan`` take them."""
    device = config_module.load_config(config_name).device
    return dict(device_memory=int(device.memory_gib * 2**30),
                host_memory=int(device.host_memory_gib * 2**30))


@pytest.mark.parametrize("run", list(IN_PLACE_RUNS))
def test_the_plan_bounds_the_in_place_step_s_runs(run, monkeypatch):
    """Issue 25's sweep on today's program (the 2026-12-05 lease, each run a fresh process,
    3 steps): the allocator's peak and the process's VmHWM at or under the plan of the same
    config, with the optimizer groups the planner chose as the run did, and the plan within
    1.2x of each (device 1.001-1.115x, host 1.004-1.024x). Where every group's state is
    resident (h200-1 at 64K and 592,826) the step holds what the older program held (62.67 GiB
    at 64K, 62.38 before): the plan counts the new weights as it did (overlap.moe_layer_weights),
    where today's in-place form would be 5.5 GiB under."""
    monkeypatch.delenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", raising=False)
    config_name, overrides, resident = IN_PLACE_RUNS[run]
    measured = _record_run(SESSION18, run)
    assert len(measured["losses"]) == 3 and all(map(math.isfinite, measured["losses"]))
    for override in overrides:
        assert override in measured["command"]
    config = config_module.load_config(config_name, overrides)
    plan = make_plan(config, 1, platform="gpu", baseline=False, search_context=False,
                     **_machine(config_name))
    assert plan.knobs.resident_groups == resident == _banner_resident_groups(measured)
    device, host = measured["peak_device_bytes"], measured["host_peak_bytes"]
    assert device <= plan.total_bytes <= 1.2 * device
    assert host <= plan.host_bytes <= 1.2 * host


def test_ours_trains_at_the_plan_s_largest_context():
    """Issue 25's last check, first half, for h200-1: the plan's largest context under
    operators auto is 928,166 tokens (1.57x the standard stack's 592,826), with the knobs
    pinned where a run lifts the device check, and it trained 3 steps there (the 2026-12-05
    lease), the loss falling, at 55.4 s a step (MFU 37.1%), within the device (124.76 GiB of
    132.8; the plan within 1.064x: test_the_plan_bounds_the_in_place_step_s_runs)."""
    config = config_module.load_config("h200-1")
    plan = make_plan(config, 1, platform="gpu", baseline=False,
                     device_memory=int(config.device.memory_gib * 2**30),
                     host_memory=int(config.device.host_memory_gib * 2**30))
    assert plan.largest_context == OURS_LARGEST > 1.5 * BASELINE_LARGEST
    at_largest = make_plan(config_module.load_config(
        "h200-1", [f"data.seq_len={OURS_LARGEST}"]), 1, platform="gpu", baseline=False,
        search_context=False, **DEVICE)
    pinned = config_module.load_config("h200-1", PINNED_AT_LARGEST)
    assert (at_largest.knobs.moe_dispatch, at_largest.knobs.token_budget,
            at_largest.knobs.loss) == (pinned.operators.moe_dispatch,
                                       pinned.operators.token_budget, pinned.operators.loss)
    assert at_largest.knobs.optimizer_offload and at_largest.knobs.resident_groups == 0
    assert all(at_largest.knobs.offload)
    run = _record_run(SESSION18, "ours928k")
    assert f"data.seq_len={OURS_LARGEST}" in run["command"] and "operators." not in run["command"]
    assert len(run["losses"]) == 3 and run["losses"][-1] < run["losses"][0]
    assert run["peak_device_bytes"] <= DEVICE["device_memory"]


@pytest.mark.parametrize("config_name, largest, context, run, pinned", [
    ("h200-1", OURS_LARGEST, 1_020_984, "ours1p1", PINNED_AT_LARGEST),
    ("h200-e2e", E2E_LARGEST, 816_034, "e2e1p1", AUTO_741K_AS_RUN[1:]),
])
def test_1_1x_of_each_largest_does_not_fit(config_name, largest, context, run, pinned):
    """Issue 25's last check, second half: at 1.1x each stack's largest context under auto
    (h200-1: 1,020,984; h200-e2e: 816,034), with the knobs the plan chose at the largest
    pinned and the device check lifted, XLA:GPU's plan of the overlapped step is past the
    device's memory (135.91 and 134.96 GiB of 132.8; the 2026-12-05 lease's compiles), and the
    closed form bounds it there (144.55, 142.19)."""
    assert 1.1 * largest <= context < 1.1 * largest + 2
    measured = _record_run(SESSION18, run)
    for override in pinned + [f"data.seq_len={context}"]:
        assert override in measured["command"]
    at_largest = make_plan(load_config(config_name, ["optimizer.resident_groups=null",
                                                     f"data.seq_len={largest}"]),
                           1, platform="gpu", baseline=False, search_context=False,
                           **_machine(config_name))
    as_pinned = config_module.load_config(config_name, pinned)
    assert (at_largest.knobs.moe_dispatch, at_largest.knobs.token_budget,
            at_largest.knobs.loss, at_largest.knobs.resident_groups) == (
        as_pinned.operators.moe_dispatch, as_pinned.operators.token_budget,
        as_pinned.operators.loss, as_pinned.optimizer.resident_groups)
    xla = _session_checked(run, "overlapped_step", SESSION18)
    assert xla > DEVICE["device_memory"]
    plan = make_plan(config_module.load_config(config_name, pinned + [f"data.seq_len={context}"]),
                     1, platform="gpu", baseline=False, search_context=False,
                     **_machine(config_name))
    assert xla <= plan.programs["overlapped"] <= 1.2 * xla


def test_e2e_s_largest_compiles_under_the_plan_with_today_s_program():
    """h200-e2e at its largest under auto (741,848) with the gradients written in place too
    (the 18:14 run of 2026-12-04 stacked them at its end: 131.14 GiB): XLA's GPU plan of the
    overlapped step 131.37 GiB against the plan's 132.80 (1.011x), the optimizer's step 41.69
    against 42.99."""
    measured = _record_run(SESSION18, "check741k")
    assert f"data.seq_len={E2E_LARGEST}" in measured["command"]
    plan = make_plan(load_config("h200-e2e", ["optimizer.resident_groups=null",
                                              f"data.seq_len={E2E_LARGEST}"]),
                     1, platform="gpu", baseline=False, search_context=False,
                     **_machine("h200-e2e"))
    for program, checked in (("overlapped", "overlapped_step"),
                             ("optimizer_step", "optimizer_step")):
        xla = _session_checked("check741k", checked, SESSION18)
        assert xla <= plan.programs[program] <= 1.2 * xla


def test_the_plan_s_in_place_form_is_the_streamed_one():
    """Where every optimizer group is resident the plan keeps the older count of the new
    weights (P b + (L_m - 1) b_m), measured so (test_the_plan_bounds_the_in_place_step_s_runs);
    where a group streams, the in-place one (P b - (L_m - 1) b_m)."""
    def terms(resident):
        config = load_config("h200-1", ON + [f"optimizer.resident_groups={resident}"])
        plan = make_plan(config, 1, platform="gpu", baseline=False, search_context=False)
        return {t.name for t in plan.terms}

    assert "overlap.moe_layer_weights" in terms(8) and "overlap.new_weights" not in terms(8)
    assert "overlap.new_weights" in terms(7) and "overlap.moe_layer_weights" not in terms(7)


SESSION19 = RESULTS / "h100_session_gpu_20261205-071630.json"  # 16K sweep, on an H100 80GB
SWEEP_16K = {
    # run: the overrides of h200-1 it ran with at 16K (the knobs it left null to the planner)
    "on16k": ON,
    "off16k": ALL_OFF,
    "opt16k": ALL_OFF + ["operators.optimizer_offload=true"],
    "moe16k": ALL_OFF + ["operators.moe_dispatch=pipelined"],
    "loss16k": ALL_OFF + ["operators.loss=ring"],
    "sco16k": ALL_OFF + ["operators.offload=all"],
}


SWEEP_16K_H200 = RESULTS / "h200_session_gpu_20261205-172600.json"  # the same on an H200


@pytest.mark.parametrize("record", [SESSION19, SWEEP_16K_H200], ids=["H100", "H200"])
@pytest.mark.parametrize("run", list(SWEEP_16K))
def test_the_plan_bounds_issue_25_s_sweep_at_16k(record, run, monkeypatch):
    """Issue 25's sweep at 16K on today's program, each run a fresh process, 3 steps: h200-1
    with the four on, all off and each operator alone, twice: 2026-12-05 07:16, where the
    device tool gave an H100 80GB for kind nvidia-h200, and 17:26 on the H200. The allocator's
    peak at or under the plan of the same config (the H200's: device.memory_gib 132.8; at 16K
    the step's temporaries, about 8-13 GiB, are under either card's scheduler limit) and the
    plan within 1.2x of it (1.050-1.107x on either card), with the optimizer groups the
    planner chose as the run did. The host's VmHWM at or under the plan; on the H200 machine,
    whose runtime the plan's runtime term is fitted to, within 1.2x of it too (1.008-1.116x);
    on the H100 machine 1.36-1.63x (1.9-2.4 GiB over)."""
    monkeypatch.delenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", raising=False)
    overrides = SWEEP_16K[run] + ["data.seq_len=16384"]
    measured = _record_run(record, run)
    on_h200 = "H200" in json.loads(record.read_text())["device"]
    assert on_h200 == (record == SWEEP_16K_H200)
    assert len(measured["losses"]) == 3 and measured["losses"][-1] < measured["losses"][0]
    for override in overrides:
        assert override in measured["command"]
    config = config_module.load_config("h200-1", overrides)
    plan = make_plan(config, 1, platform="gpu", baseline=False, search_context=False,
                     **_machine("h200-1"))
    assert plan.knobs.resident_groups == _banner_resident_groups(measured)
    device, host = measured["peak_device_bytes"], measured["host_peak_bytes"]
    assert device <= plan.total_bytes <= 1.2 * device
    assert host <= plan.host_bytes
    assert plan.host_bytes <= 1.2 * host or not on_h200


def test_the_plan_bounds_all_four_at_16k_with_every_group_streamed():
    """h200-1 with the four on at 16K, the layers unrolled and every optimizer group streamed,
    compiled on the H200 (2026-12-05 17:26; the 16K point of 2026-12-01 was of a program no
    longer built, BEFORE_ZEROS_FIX): XLA's plan of the overlapped step and of the optimizer's
    step each at or under the plan's, within 1.2x (1.111x and 1.022x)."""
    run = "on16k_r0"
    overrides = ON + ["data.seq_len=16384", "operators.layer_loop=unrolled",
                      "optimizer.resident_groups=0"]
    for override in overrides:
        assert override in _record_run(SWEEP_16K_H200, run)["command"]
    plan = make_plan(config_module.load_config("h200-1", overrides), 1, platform="gpu",
                     baseline=False, search_context=False, **_machine("h200-1"))
    for program, checked in (("overlapped", "overlapped_step"),
                             ("optimizer_step", "optimizer_step")):
        xla = _session_checked(run, checked, SWEEP_16K_H200)
        assert xla <= plan.programs[program] <= 1.2 * xla


def test_with_every_group_resident_the_step_holds_the_old_stacks_and_the_layers_slices(
        tmp_path):
    """Why the plan keeps the older count of the new weights where every optimizer group is
    resident (``overlap.moe_layer_weights``, P b + (L_m - 1) b_m, where the in-place form
    counts P b - (L_m - 1) b_m): XLA:GPU's buffer assignment of h200-1's overlapped step at
    64K, the four on, 8 of 8 groups resident (compiled 2026-12-05 on an H100: 62.92 GiB, where
    the H200 trained 62.67), holds at its peak the MoE stacks three times (the old weights, one
    argument and two copies made at the step's start; the new ones; the gradients), where the
    streamed step at 741,848 holds them twice (test_the_unrolled_step_holds_no_layer_s_copy_
    beside_the_stacks), and beside them eighteen slices of one layer's weight (three of each of
    L_m - 1 = 6 layers) taken in the forward: 9.75 GiB. The plan so counted bounds XLA's total
    within 1.2x; with the in-place form it would be under it."""
    model = load_config("h200-1").model
    num_moe = model.num_layers - model.num_dense_layers
    held = set(_values_at_peak("xla_gpu_live_ranges_h200-1_res64k_h100_20261205.tgz",
                               tmp_path))  # each allocated byte once
    # (by shape: at 64K one [N, H] in bf16 has one layer's weight's bytes too)
    experts = f"{model.num_experts},"
    stacks = sum(shape.startswith(f"bf16[{num_moe},{experts}") for *_, shape in held)
    slices = sum(shape.startswith(f"bf16[1,{experts}") for *_, shape in held)
    assert (stacks, slices) == (9, 3 * (num_moe - 1))

    def plan(resident):
        return make_plan(load_config("h200-1", ON + [f"optimizer.resident_groups={resident}"]),
                         1, platform="gpu", baseline=False, search_context=False, **DEVICE)

    older = plan(8)
    (counted,) = [t.bytes for t in older.terms if t.name == "overlap.moe_layer_weights"]
    (in_place,) = [t.bytes for t in plan(7).terms if t.name == "overlap.new_weights"]
    xla = _session_checked("res64k", "overlapped_step", SESSION19)
    for override in ON + ["optimizer.resident_groups=8"]:
        assert override in _record_run(SESSION19, "res64k")["command"]
    assert older.programs["overlapped"] - counted + in_place < xla
    assert xla <= older.programs["overlapped"] <= 1.2 * xla
