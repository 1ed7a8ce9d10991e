"""The trainer: the operators change no number, resume is exact, processes agree, bad configs are
refused with their key."""

from __future__ import annotations

import contextlib
import io
import json
import os
import pathlib
import shlex
import signal
import socket
import subprocess
import sys
import time

import chex
import jax
import numpy as np
import pytest
from _helpers import optimizer_state_values, relative_error

from peakflat_jax import memory
from peakflat_jax.config import ConfigError, load_config
from peakflat_jax.train.trainer import Trainer, moe_leaf_indices

REPO = pathlib.Path(__file__).resolve().parents[1]

# A small model that still has every part: a dense layer and an MoE layer, GQA, a shared expert,
# bias balancing, packed documents. The tests share its compiled programs (the trainer reuses a
# program within a process for what it depends on, train.steps included), so most keep its 4.
SMALL = [
    "model.hidden=64", "model.num_layers=2", "model.num_dense_layers=1", "model.dense_ffn=128",
    "model.num_heads=8", "model.num_kv_heads=4", "model.head_dim=8", "model.num_experts=8",
    "model.top_k=2", "model.expert_ffn=32", "model.shared_expert_ffn=32",
    "data.seq_len=64", "data.batch_size=8", "data.max_segments=8",
    "operators.token_budget=16", "optimizer.warmup_steps=1", "optimizer.bucket_params=20000",
    "train.steps=4",
]
ALL_OFF = ["operators.moe_dispatch=ep", "operators.loss=materialized", "operators.offload=none",
           "operators.optimizer_offload=false"]


def small_config(*overrides: str):
    return load_config("tiny", [*SMALL, *overrides])


def small_args(*overrides: str) -> list[str]:
    """SMALL with ``overrides``, each key once: the command line of ``small_config(*overrides)``
    (``peakflat`` refuses a key given twice)."""
    merged = {word.split("=", 1)[0]: word for word in [*SMALL, *overrides]}
    return list(merged.values())


def first_gradients(config, run_dir):
    """Loss and gradients of the first batch at the initial weights, from the trainer's compiled
    gradient program (the optimizer offloaded: where its state lives changes no gradient)."""
    config = config.replace(operators={"optimizer_offload": True, "optimizer_overlap": False})
    trainer = Trainer(config, run_dir=run_dir)
    state = trainer.initial_state()
    batch = trainer.global_batch(next(trainer.batches))
    trainer.compile(state, batch)
    metrics, grads, _ = trainer._gradient_step(state.params, state.extras, batch)
    return float(metrics["loss"]), jax.tree.leaves(grads)


@pytest.mark.slow
@pytest.mark.parametrize("mesh, steps", [(("mesh.data=1", "mesh.seq=8"), 0),
                                         (("mesh.data=2", "mesh.seq=4"), 3)], ids=["1d", "2d"])
def test_operators_change_no_number(tmp_path, mesh, steps):
    """All four operators on against all off (the standard stack, optax on the device): the
    same loss and gradients at the first step, and on the 2-D mesh the same losses over three
    steps (fp32, relative 1e-5). The 1-D mesh (every device on the sequence) checks the
    gradients only: its steps compile the slowest programs of the suite, and what the steps add
    to the gradients (the optimizer's paths) does not depend on the mesh's shape (the weights
    are sharded over all 8 devices in both). So the overlapped step's own forward and backward
    run on the 2-D mesh only."""
    results = {}
    for name, switches in (("on", []), ("off", ALL_OFF)):
        config = small_config(*mesh, *switches)
        results[name] = first_gradients(config, str(tmp_path / f"{name}-gradients"))
        if steps:
            trainer = Trainer(config, run_dir=str(tmp_path / name))
            results[name + "_losses"] = trainer.run(progress=False, stop_after=steps)["losses"]
    (loss_on, grads_on), (loss_off, grads_off) = results["on"], results["off"]
    assert abs(loss_on - loss_off) <= 1e-5 * abs(loss_off)
    for on, off in zip(grads_on, grads_off):
        assert relative_error(on, off) <= 1e-5
    if steps:
        np.testing.assert_allclose(results["on_losses"], results["off_losses"], rtol=1e-5)
        assert len(results["on_losses"]) == steps


def assert_startup_accounted(summary: dict, phases: list[str], lived: float) -> None:
    """The summary's start-up phases (``startup``) are ``phases`` in order, none negative, and
    add up to the first step's end, which came before the summary, within ``lived`` (seconds
    the process lived, or the trainer ran after its first phase, as the test saw it); the
    trainer's compile is inside the compile phase, and no phase compiled longer than it took."""
    seconds, first_step = summary["startup_seconds"], summary["first_step_done_s"]
    assert list(seconds) == phases, seconds
    assert all(value >= 0 for value in seconds.values()), seconds
    assert sum(seconds.values()) <= first_step + 1e-3 <= summary["done_s"] + 2e-3
    assert sum(seconds.values()) - seconds[phases[0]] <= lived
    assert seconds["compile"] >= sum(summary["compile_seconds"].values())
    for phase, compiling in summary["startup_xla_seconds"].items():
        assert 0 <= compiling <= seconds[phase] + 1e-3, (phase, compiling, seconds)


@pytest.mark.slow
def test_loss_falls_on_the_corpus(tmp_path):
    started = time.perf_counter()
    summary = Trainer(small_config("train.steps=12", "optimizer.learning_rate=1e-2",
                                   "train.profile_steps=2"),
                      run_dir=str(tmp_path)).run(progress=False)
    lived = time.perf_counter() - started
    losses = summary["losses"]
    assert np.mean(losses[-3:]) < losses[0] - 0.5, losses
    assert "within documents" in summary["flops_convention"]  # the FLOPs' convention, named
    assert summary["mfu"] is None and summary["mfu_denominator"].startswith("no matmul rate")
    record = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert 0 < record["attention_pairs_fraction"] <= 1  # the first batch's share of full causal
    # Made in this process, not by the command: the phases before the trainer are one.
    assert_startup_accounted(summary, ["before", "setup", "state", "data", "compile",
                                       "first step"], lived)
    assert summary["startup_seconds"]["first step"] >= record["step_seconds"]
    assert (tmp_path / "metrics.jsonl").exists() and (tmp_path / "summary.json").exists()
    assert any(p.name.startswith("events") for p in (tmp_path / "tensorboard").iterdir())
    # Steps 2 and 3 traced (train.profile_steps): the trace kept, its summary beside it (a CPU's
    # trace has no device planes to reduce).
    assert list((tmp_path / "profile").glob("**/*.xplane.pb"))
    profile = json.loads((tmp_path / "profile.json").read_text())
    assert profile["steps"] == 2 and "no device planes" in profile["error"]


def leaves_of(trainer_state):
    return [np.asarray(jax.device_get(x)) for x in jax.tree.leaves(
        (trainer_state.params, trainer_state.extras, trainer_state.opt_state))]


# Where the optimizer's state lives: streamed from host memory, on the device, on the host CPU.
PLACEMENTS = {"offloaded": ["operators.optimizer_offload=true"],
              "device": ["operators.optimizer_offload=false"],
              "host_cpu": ["operators.optimizer_offload=false", "optimizer.update_on=host_cpu"]}


@pytest.mark.slow
@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_resume_is_exact(tmp_path, placement):
    """6 steps straight equal 3 steps, a checkpoint, and 3 resumed steps: bit for bit."""
    config = small_config(*PLACEMENTS[placement], "train.steps=6", "train.checkpoint_every=3")
    straight = Trainer(config, run_dir=str(tmp_path / "a"))
    summary = straight.run(progress=False)
    half = Trainer(config, run_dir=str(tmp_path / "b")).run(progress=False, stop_after=3)
    resumed = Trainer(config, run_dir=str(tmp_path / "b"))
    whole = resumed.run(resume=True, progress=False)  # the summary of all 6 steps
    assert half["losses"] == summary["losses"][:3] and whole["losses"] == summary["losses"]
    assert whole["resumed_from"] == 3 and whole["steps"] == 6
    chex.assert_trees_all_equal(leaves_of(straight.final_state), leaves_of(resumed.final_state))


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_the_abstract_state_is_the_made_states_shapes_and_places(placement):
    """What a resume restores into (nothing made) has the made state's structure, shapes,
    dtypes, shardings and memory kinds, leaf by leaf, and the optimizer's layout."""
    optimizer_offload = placement == "offloaded"
    trainer = Trainer(small_config(*PLACEMENTS[placement]), run_dir="unused")
    made, abstract = trainer.initial_state(), trainer.initial_state(abstract=True)
    made, abstract = ((s.params, s.extras, s.opt_state) for s in (made, abstract))
    assert jax.tree.structure(abstract) == jax.tree.structure(made)
    for a, m in zip(jax.tree.leaves(abstract), jax.tree.leaves(made)):
        assert isinstance(a, jax.ShapeDtypeStruct)
        assert (a.shape, a.dtype, a.sharding) == (m.shape, m.dtype, m.sharding)
    if optimizer_offload:
        assert abstract[2].layout == made[2].layout


@pytest.mark.slow
def test_the_host_cpu_optimizer_trains_as_the_device_one(tmp_path):
    """optimizer.update_on: host_cpu (ZeRO-Offload's placement) against optax on the device,
    4 steps of the same config: the same losses and weights to 1e-6 (the same arithmetic; the
    device's global norm sums the sharded gradients in another order). ``optimizer_offload:
    auto`` resolves to false with it, the device holds no optimizer state, and the trainer
    compiles the gradient program and the host update (programs it shares with the resume
    test above)."""
    device = Trainer(small_config(*PLACEMENTS["device"]), run_dir=str(tmp_path / "device"))
    expected = device.run(progress=False)["losses"]
    host = Trainer(small_config("optimizer.update_on=host_cpu", "operators.optimizer_offload=auto"),
                   run_dir=str(tmp_path / "host"))
    assert host.config.operators.optimizer_offload is False and host.host_cpu_optimizer
    summary = host.run(progress=False)
    np.testing.assert_allclose(summary["losses"], expected, rtol=1e-6)
    for ours, theirs in zip(jax.tree.leaves(jax.device_get(host.final_state.params)),
                            jax.tree.leaves(jax.device_get(device.final_state.params))):
        assert relative_error(ours, theirs) <= 1e-6
    cpu = host.optimizer.host_sharding
    assert all(leaf.sharding == cpu for leaf in jax.tree.leaves(host.final_state.opt_state))
    assert {leaf.sharding for leaf in jax.tree.leaves(host.final_state.params)} == {
        leaf.sharding for leaf in jax.tree.leaves(device.final_state.params)}
    assert hasattr(host, "_gradient_step") and not hasattr(host, "_train_step")


def run_cli(args, env=None, timeout=900):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})}
    return subprocess.run([sys.executable, "-m", "peakflat_jax.cli", *args], cwd=REPO,
                          capture_output=True, text=True, env=env, timeout=timeout)


def read_metrics(run_dir: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def snapshot(run_dir: pathlib.Path) -> dict:
    """Every file under ``run_dir`` with its size and modification time."""
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in run_dir.rglob("*")}


@pytest.mark.slow
def test_killed_during_a_save_resumes_from_the_last_complete_checkpoint(tmp_path):
    """A run killed while its step-4 checkpoint is being written resumes from step 2's and
    computes steps 3 and 4 again, to the same losses the killed run logged; the metrics hold
    each step once and the summary covers the whole run. A --resume of the finished run then
    changes nothing."""
    # The model does not matter here: a one-layer dense one compiles fastest.
    common = ["train", "tiny", *small_args("model.num_layers=1", "train.checkpoint_every=2"),
              "--run-dir", str(tmp_path), "--no-progress"]
    killed = run_cli(common, env={"PEAKFLAT_TEST_EXIT_DURING_SAVE": "4"})
    assert killed.returncode == 17, killed.stderr[-2000:]
    steps = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert "2" in steps and "4" not in steps, steps  # 4 never completed
    logged = read_metrics(tmp_path)
    assert [r["step"] for r in logged] == [1, 2, 3, 4]
    started = time.perf_counter()
    resumed = run_cli([*common, "--resume"])
    lived = time.perf_counter() - started
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    again = read_metrics(tmp_path)
    assert [r["step"] for r in again] == [1, 2, 3, 4]  # steps 3 and 4 once, computed again
    assert [r["loss"] for r in again] == [r["loss"] for r in logged]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["resumed_from"] == 2
    # The command's start-up, the restore in "state", and its one line on stderr.
    assert_startup_accounted(summary, ["imports", "backend", "setup", "state", "data",
                                       "compile", "first step"], lived)
    assert summary["first_step_done_s"] <= lived
    assert f"started in {summary['first_step_done_s']:.1f} s: imports " in resumed.stderr
    # What the run says it is doing: the banner with the run directory before the compile is
    # announced and timed, each checkpoint save, and where TensorBoard reads the run.
    lines = resumed.stderr.splitlines()
    said = [next(i for i, line in enumerate(lines) if line.startswith(start)) for start in (
        "peakflat train tiny:", f"run directory {tmp_path}", "compiling the step's programs",
        "compiled in ", "checkpoint of step 4: saving to", "checkpoint of step 4: written",
        "done: 4 steps", f"  tensorboard --logdir {tmp_path / 'tensorboard'}")]
    assert said == sorted(said), resumed.stderr[-3000:]
    assert not (tmp_path / ".lock").exists()  # released: the killed run's stale one taken over
    assert summary["losses"] == [r["loss"] for r in logged]
    before = snapshot(tmp_path)
    finished = run_cli([*common, "--resume"], timeout=120)
    assert finished.returncode == 0, finished.stderr[-2000:]
    assert "at step 4 of 4 already" in finished.stderr and "compiled" not in finished.stderr
    assert snapshot(tmp_path) == before


def start_cli(args, ignore_sigint: bool = False) -> subprocess.Popen:
    """``peakflat ...`` in a subprocess, stderr piped; ``ignore_sigint``: started with SIGINT
    ignored, as a shell without job control starts a background job (POSIX): a shell that
    ignores it execs the command, which inherits that (and keeps the pid the signal goes to)."""
    command = [sys.executable, "-m", "peakflat_jax.cli", *args]
    if ignore_sigint:
        command = ["sh", "-c", 'trap "" INT; exec "$0" "$@"', *command]
    return subprocess.Popen(command, cwd=REPO, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})


def signal_after_the_first_step(process: subprocess.Popen, signum: int,
                                before=lambda: None) -> tuple[int, list]:
    """Sends ``signum`` once the run prints its first step line, after calling ``before``;
    (exit status, stderr lines)."""
    lines = []
    for line in process.stderr:
        lines.append(line.rstrip("\n"))
        if line.startswith("step "):
            before()
            process.send_signal(signum)
            break
    lines += process.stderr.read().splitlines()
    return process.wait(timeout=300), lines


@pytest.mark.slow
def test_sigterm_and_sigint_stop_after_the_step_with_a_checkpoint_and_how_to_resume(tmp_path):
    """SIGTERM (a cluster's preemption) after the first step line: the step in flight finishes,
    a checkpoint of it is saved, exit status 143 and one line naming the step and the command
    that resumes; that command continues from the step, and SIGINT (sent to a process started
    with SIGINT ignored, which used to run on to the end) stops it the same way, status 130.
    Every step is in metrics.jsonl once; --overwrite cleared the old run's records first.

    While the first run goes on, a second process's run into its directory (a fresh start,
    --resume, --overwrite) is refused in one line naming the first's pid, before it touches
    anything there. The resume extends the run (train.steps 200 -> 202): accepted, said and
    recorded in config_changes.jsonl, config.json keeping 200."""
    from peakflat_jax import cli

    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 99.0}\n')  # an older run
    args = ["train", "tiny", *small_args("model.num_layers=1", "train.steps=200"), "--run-dir",
            str(tmp_path), "--overwrite"]  # steps to spare: the signal comes after the first
    process = start_cli(args)

    def second_runs_are_refused():
        for flags in ([], ["--resume"], ["--overwrite"]):
            second = io.StringIO()
            with contextlib.redirect_stderr(second):
                status = cli.main([*args[:-1], *flags])
            err = second.getvalue()
            assert status == 2 and len(err.splitlines()) == 1, err
            assert f"run directory {tmp_path} is in use" in err
            assert f"pid {process.pid} on " in err, err

    status, lines = signal_after_the_first_step(process, signal.SIGTERM,
                                                before=second_runs_are_refused)
    assert status == 143, "\n".join(lines[-20:])
    last = lines[-1]
    assert last.startswith("peakflat train: SIGTERM: stopped after step ") and "Traceback" not in \
        "\n".join(lines), "\n".join(lines[-20:])
    step = int(last.split("stopped after step ")[1].split()[0])
    assert f"the checkpoint of step {step} is in {tmp_path / 'checkpoints'}" in last
    command = shlex.split(last.split("resume with: ")[1])
    assert command == ["peakflat", *[a for a in args if a != "--overwrite"], "--resume"]
    assert str(step) in [p.name for p in (tmp_path / "checkpoints").iterdir()]
    assert [r["step"] for r in read_metrics(tmp_path)] == list(range(1, step + 1))

    extended = [word.replace("train.steps=200", "train.steps=202") for word in command[1:]]
    status, lines = signal_after_the_first_step(start_cli(extended, ignore_sigint=True),
                                                signal.SIGINT)
    assert status == 130, "\n".join(lines[-20:])
    banner = next(line for line in lines if line.startswith("peakflat train tiny:"))
    assert banner.endswith(f"step {step} of 202")  # resumed at the step
    assert next(line for line in lines if line.startswith("step ")).startswith(
        f"step {step + 1}/202")
    assert "resumed with train.steps 200 -> 202 (recorded in " in "\n".join(lines)
    changes = [json.loads(line) for line in
               (tmp_path / "config_changes.jsonl").read_text().splitlines()]
    assert [(c["resumed_from"], c["changed"]) for c in changes] == [
        (step, {"train.steps": {"was": 200, "now": 202}})]
    assert json.loads((tmp_path / "config.json").read_text())["train"]["steps"] == 200
    last = lines[-1]
    assert last.startswith("peakflat train: SIGINT: stopped after step "), last
    second = int(last.split("stopped after step ")[1].split()[0])
    assert second > step and f"the checkpoint of step {second} is in" in last
    assert f"stopped after step {second} of 202" in last
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == list(range(1, second + 1))
    assert 99.0 not in [r["loss"] for r in records]


@pytest.mark.slow
def test_a_signal_during_the_compile_is_said_at_once_and_no_step_runs(tmp_path):
    """SIGINT while the first step compiles: the run says so at once (a thread reads the
    signal: its line comes before 'compiled in'), then ends once the compile returns, without
    a step and without a checkpoint (its data iterator is past a batch no step took): exit
    status 130 and one line saying that nothing was trained."""
    from peakflat_jax.train import checkpoint as ckpt

    process = start_cli(["train", "tiny", *small_args("model.num_layers=1"), "--run-dir",
                         str(tmp_path)])
    lines = []
    for line in process.stderr:
        lines.append(line.rstrip("\n"))
        if line.startswith("compiling the step's programs"):
            process.send_signal(signal.SIGINT)
            break
    lines += process.stderr.read().splitlines()
    assert process.wait(timeout=300) == 130, "\n".join(lines[-20:])
    said = next(i for i, line in enumerate(lines) if "SIGINT: stopping after the compile" in line)
    assert said < next(i for i, line in enumerate(lines) if line.startswith("compiled in"))
    assert not any(line.startswith("step ") for line in lines), lines
    assert lines[-1] == ("peakflat train: SIGINT: stopped before step 1 (while compiling; no "
                         "step ran) of 4; nothing to resume from: start again with --overwrite")
    assert ckpt.latest_step(tmp_path / "checkpoints") is None and not read_metrics(tmp_path)


OUT_OF_MEMORY = ("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 37.46GiB with "
                 "allocator GPU_0_bfc on device 0. [tf-allocator-allocation-error=''] "
                 "[executable_name='jit_train_step']")
"""What jax 0.11.2 raised on an H200 (``peakflat train h200-e2e train.device_memory_gib=1000000``)
when the step's result was fetched."""


@pytest.mark.slow
@pytest.mark.parametrize("failing_step", [1, 2], ids=["compile", "second step"])
def test_out_of_device_memory_is_one_line_status_1_and_a_failed_summary(
        tmp_path, monkeypatch, capsys, failing_step):
    """XLA out of device memory, the planner's check lifted by train.device_memory_gib, as the
    first step compiles or in the second step: exit status 1 and one line, the last, naming the
    program, the size XLA asked for, the step, the plans and the `peakflat plan` without the
    lift; no traceback. The run directory holds the steps done (metrics.jsonl) and a
    summary.json that says the run failed and why, and no checkpoint: nothing looks finished.
    (SMALL's programs: compiled by the runs above in this file's worker.)"""
    from peakflat_jax import cli
    from peakflat_jax.train import checkpoint as ckpt

    def out_of_memory(*_):
        raise jax.errors.JaxRuntimeError(OUT_OF_MEMORY)

    if failing_step == 1:
        monkeypatch.setattr(Trainer, "compile", out_of_memory)
    else:
        step = Trainer.step
        monkeypatch.setattr(Trainer, "step", lambda self, state, batch: (
            out_of_memory() if state.step + 1 == failing_step else step(self, state, batch)))
    run_dir = tmp_path / "run"
    status = cli.main(["train", "tiny", *SMALL, "train.device_memory_gib=1000000",
                       "--no-progress", "--run-dir", str(run_dir)])
    out, err = capsys.readouterr()
    assert status == 1 and "Traceback" not in out + err, err[-3000:]
    last = err.splitlines()[-1]
    assert [line for line in err.splitlines() if "out of device memory" in line] == [last]
    assert last.startswith("peakflat train: out of device memory in jit_train_step (XLA tried "
                           f"to allocate 37.46 GiB on device 0) at step {failing_step} of 4; ")
    assert ("XLA's plan " in last) == (failing_step > 1), last  # known once compiled
    assert "the planner's " in last and "train.device_memory_gib=1000000" in last, last
    plan = shlex.split(last.split("see `")[1].split("`")[0])
    assert plan == ["peakflat", "plan", "tiny", *SMALL], last
    summary = json.loads((run_dir / "summary.json").read_text())
    assert last.split("peakflat train: ")[1].startswith(summary["failed"])
    assert (summary["steps"], summary["total_steps"]) == (failing_step - 1, 4)
    assert "final_loss" not in summary and ckpt.latest_step(run_dir / "checkpoints") is None
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, failing_step))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_give_the_losses_of_one(tmp_path):
    args = ["train", "tiny", *SMALL, "--no-progress"]
    one = run_cli([*args, "--run-dir", str(tmp_path / "one")])
    assert one.returncode == 0, one.stderr[-2000:]
    port = free_port()
    flags = "--xla_force_host_platform_device_count=4"
    processes = [subprocess.Popen(
        [sys.executable, "-m", "peakflat_jax.cli", *args, "--run-dir", str(tmp_path / "two")],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags,
             "JAX_COORDINATOR_ADDRESS": f"localhost:{port}", "JAX_NUM_PROCESSES": "2",
             "JAX_PROCESS_ID": str(i)}) for i in range(2)]
    outputs = [p.communicate(timeout=900) for p in processes]
    for p, (_, err) in zip(processes, outputs):
        assert p.returncode == 0, err[-2000:]
    losses_one = json.loads((tmp_path / "one" / "summary.json").read_text())["losses"]
    losses_two = json.loads((tmp_path / "two" / "summary.json").read_text())["losses"]
    np.testing.assert_allclose(losses_two, losses_one, rtol=1e-5)


@pytest.mark.parametrize("saved, resumed, key", [
    ([], ["optimizer.update_on=host_cpu", *ALL_OFF], "optimizer.update_on"),
    (ALL_OFF, ["operators.optimizer_offload=true"], "operators.optimizer_offload"),
    ([], ["model.num_layers=3"], "model.num_layers"),
    ([], ["optimizer.learning_rate=0.01"], "optimizer.learning_rate"),  # another run
])
def test_a_resume_under_another_state_s_settings_is_refused_by_name(tmp_path, saved, resumed,
                                                                    key):
    """A run directory's config.json against the resuming run's settings that shape the
    checkpointed state (run_dir.STATE_KEYS): refused in one line naming the setting and its
    saved value, before a state is made or a program compiled (orbax, restoring into the other
    tree, failed with an error about its own structures). The directory holds no checkpoint:
    the settings are checked first."""
    from peakflat_jax.config import to_dict
    from peakflat_jax.train.run_dir import RunDirError

    first = Trainer(small_config(*saved), run_dir=str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(to_dict(first.config)))
    again = Trainer(small_config(*saved, *resumed), run_dir=str(tmp_path))
    with pytest.raises(RunDirError, match=rf"--resume: .* holds a run with {key} = ") as refused:
        again.run(resume=True, progress=False)
    assert "\n" not in str(refused.value) and "--overwrite" in str(refused.value)
    with pytest.raises(RunDirError, match="holds no complete checkpoint"):  # same settings
        Trainer(small_config(*saved), run_dir=str(tmp_path)).run(resume=True, progress=False)


def test_packed_input_through_a_synthetic_config_stays_within_its_documents():
    """A Python caller's packed sequences through a config whose data is synthetic (which the
    trainer makes one document a sequence): the attention keeps the caller's segment ids, so a
    document's logits are the same whatever it is packed beside and wherever (they were
    dropped: the second document attended to the first)."""
    from flax import nnx

    from peakflat_jax import mesh as mop
    from peakflat_jax.model.sharding import init_model
    from peakflat_jax.train.trainer import boundary_offload, runtime_for

    config = small_config("data.source=synthetic", "model.num_layers=1", *ALL_OFF)
    mesh = mop.make_mesh(config.mesh)
    graphdef, state = init_model(config.model, mesh, seed=0)
    run, offload = runtime_for(config, mesh), boundary_offload(config, mesh)
    half = config.data.seq_len // 2
    a, b = np.random.default_rng(0).integers(0, 256, (2, half))
    rows = config.data.batch_size // 2
    tokens = np.array([[*a, *b]] * rows + [[*b, *a]] * rows, np.int32)
    batch = {"tokens": tokens, "targets": np.roll(tokens, -1, axis=1),
             "positions": np.tile(np.arange(half, dtype=np.int32), (2 * rows, 2)),
             "segment_ids": np.repeat(np.array([[1, 2]], np.int32), half, axis=1).repeat(
                 2 * rows, axis=0)}
    logits = np.asarray(jax.jit(lambda state: nnx.merge(graphdef, state).logits(
        batch, run, offload))(state))
    np.testing.assert_allclose(logits[0, :half], logits[-1, half:], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(logits[0, half:], logits[-1, :half], rtol=1e-5, atol=1e-5)


def test_a_config_that_does_not_fit_is_refused_before_compiling(tmp_path):
    """The planner's closed form, before anything compiles: the table of terms and what to
    change, exit status 2, and no compiled program (the run stops in well under a compile)."""
    refused = run_cli(["train", "tiny", *SMALL, "train.device_memory_gib=0.0001",
                       "--no-progress", "--run-dir", str(tmp_path)], timeout=120)
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert "does not fit" in refused.stderr and "to change:" in refused.stderr, refused.stderr
    assert "compiled in" not in refused.stdout + refused.stderr


@pytest.mark.parametrize("overrides, key", [
    (["model.hiden=3"], "model.hiden"),
    (["operators.moe_dispatch=fast"], "operators.moe_dispatch"),
    (["data.seq_len=abc"], "data.seq_len"),
    (["model.num_heads=6"], "model.num_heads"),  # not a multiple of num_kv_heads = 4
    (["train.steps=0"], "train.steps"),
    (["operators.offload=9"], "operators.offload"),
    (["train.profile_steps=-1"], "train.profile_steps"),
])
def test_bad_config_names_its_key(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config("tiny", overrides)


@pytest.mark.parametrize("overrides, key", [
    (["mesh.data=3"], "mesh.data"),               # 8 devices
    (["data.batch_size=3"], "data.batch_size"),   # mesh.data = 2
    (["data.seq_len=250"], "data.seq_len"),       # mesh.seq = 4
    (["model.num_heads=4", "model.num_kv_heads=2", "mesh.data=1", "mesh.seq=8"],
     "model.num_heads"),
    (["model.num_experts=12"], "model.num_experts"),
])
def test_mesh_that_does_not_divide_the_model_names_its_key(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        Trainer(small_config(*overrides), run_dir="unused")


def test_missing_config_file_is_named():
    with pytest.raises(ConfigError, match="no-such-config"):
        load_config("no-such-config")


def test_missing_corpus_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"data\.corpus_path"):
        Trainer(small_config(f"data.corpus_path={tmp_path / 'missing.txt'}"), run_dir="unused")


def chat_config(tmp_path: pathlib.Path, *overrides: str):
    """SMALL on a JSONL file of chat examples through a tokenizer trained here (300 tokens)."""
    from test_data_text import random_text, train_tokenizer, write_jsonl

    train_tokenizer(tmp_path / "tokenizer")
    rng = np.random.default_rng(0)
    write_jsonl(tmp_path / "chat.jsonl", [{"prompt": random_text(rng, 12),
                                           "response": random_text(rng, 6)} for _ in range(40)])
    return small_config("data.source=jsonl", f"data.path={tmp_path / 'chat.jsonl'}",
                        "data.prompt_field=prompt", "data.response_field=response",
                        f"data.tokenizer={tmp_path / 'tokenizer'}", "model.vocab_size=300",
                        *overrides)


def test_trainer_takes_sft_batches_from_a_tokenizer(tmp_path):
    """The trainer's pipeline for chat examples through a tokenizer: planned, and its first
    global batch holds the SFT mask's targets (fewer than the tokens of its segments), without
    compiling anything."""
    config = chat_config(tmp_path)
    trainer = Trainer(config, run_dir=str(tmp_path / "run"))
    local = next(trainer.batches)
    batch = trainer.global_batch(local)
    valid = int(np.sum(np.asarray(batch["targets"]) != -100))
    assert 0 < valid < int(np.sum(local["segment_ids"] > 0)) // 2  # the prompts are longer
    assert trainer.plan.feasible is not False
    assert any(term.name == "host.data_pipeline" for term in trainer.plan.terms)


@pytest.mark.slow
def test_train_on_chat_examples_with_a_tokenizer(tmp_path):
    """``peakflat train tiny`` for 2 steps on a JSONL file of chat examples through a
    tokenizer (one dense layer, the operators off: the cheapest compile): each step's valid
    targets are those of the pipeline's batches."""
    from peakflat_jax import cli
    from peakflat_jax.train import data as pf_data

    overrides = ["model.num_layers=1", "model.num_dense_layers=1", *ALL_OFF, "train.steps=2"]
    config = chat_config(tmp_path, *overrides)
    args = [f"data.{key}={getattr(config.data, key)}" for key in (
        "source", "path", "prompt_field", "response_field", "tokenizer")]
    assert cli.main(["train", "tiny", *small_args(*overrides, *args, "model.vocab_size=300"),
                     "--run-dir", str(tmp_path / "run"), "--no-progress"]) == 0
    batches = pf_data.make_batches(config.data, vocab_size=300)
    expected = [int(np.sum(next(batches)["targets"] != -100)) for _ in range(2)]
    records = read_metrics(tmp_path / "run")
    assert [record["valid_targets"] for record in records] == expected
    assert all(np.isfinite(record["loss"]) for record in records)


@pytest.mark.slow
def test_overlapped_optimizer_changes_no_bit(tmp_path):
    """The optimizer's update inside the next step's program (operators.optimizer_overlap) gives
    the plain path's losses, weights and optimizer state bit for bit, with clipping and a
    schedule, across a checkpoint and a resume; and its staging stays within the slots."""
    common = ["optimizer.max_grad_norm=0.5", "optimizer.warmup_steps=2"]
    plain = Trainer(small_config(*common, "operators.optimizer_overlap=false"),
                    run_dir=str(tmp_path / "plain"))
    expected = plain.run(progress=False)["losses"]
    overlapped = [*common, "train.checkpoint_every=2"]
    first = Trainer(small_config(*overlapped), run_dir=str(tmp_path / "overlap"))
    assert first.overlap
    assert first.run(progress=False, stop_after=2)["losses"] == expected[:2]
    resumed = Trainer(small_config(*overlapped), run_dir=str(tmp_path / "overlap"))
    assert resumed.run(resume=True, progress=False)["losses"] == expected  # the whole run's
    # The states' values (the scanned stack's layout stacks the MoE layers' buckets).
    chex.assert_trees_all_equal(
        jax.device_get((plain.final_state.params, plain.final_state.extras)),
        jax.device_get((resumed.final_state.params, resumed.final_state.extras)))
    chex.assert_trees_all_equal(optimizer_state_values(plain.final_state.opt_state),
                                optimizer_state_values(resumed.final_state.opt_state))
    # XLA's plan of the overlapped step against the plain path's gradient program: what it adds
    # is the optimizer's staging (slots x bucket x 16 bytes) and the MoE layers' new weights,
    # made per layer and then stacked for the scanned stack. (The overlapped run compiles no
    # gradient program of its own: its first step is the same program with nothing to update.)
    from peakflat_jax.optim.offload_adamw import offload_stream_adamw_memory_terms
    assert not hasattr(resumed, "_gradient_step")
    grads_plan = memory.compiled_memory(plain._gradient_step)
    overlap_plan = memory.compiled_memory(resumed._overlapped_step)
    params = resumed.final_state.params
    moe_bytes = sum(leaf.addressable_shards[0].data.nbytes
                    for i, leaf in enumerate(jax.tree.leaves(params))
                    if i in set(moe_leaf_indices(params)))
    staging = offload_stream_adamw_memory_terms(
        sum(leaf.addressable_shards[0].data.size for leaf in jax.tree.leaves(params)),
        resumed.config.optimizer.bucket_params, resumed.config.optimizer.slots,
        np.float32)["staging"]
    assert overlap_plan.temp - grads_plan.temp <= staging + 2 * moe_bytes
    # The buckets written back under the backward (operators.optimizer_writeback: backward):
    # the same bits; what it adds beyond the gradient program is bounded by every updated
    # bucket's master and state, (4 + 8) bytes a parameter, and the same MoE weights.
    deferred = Trainer(small_config(*common, "operators.optimizer_writeback=backward"),
                       run_dir=str(tmp_path / "deferred"))
    assert deferred.run(progress=False)["losses"] == expected
    chex.assert_trees_all_equal(jax.device_get(plain.final_state.params),
                                jax.device_get(deferred.final_state.params))
    chex.assert_trees_all_equal(optimizer_state_values(plain.final_state.opt_state),
                                optimizer_state_values(deferred.final_state.opt_state))
    num_params = sum(leaf.addressable_shards[0].data.size for leaf in jax.tree.leaves(params))
    deferred_plan = memory.compiled_memory(deferred._overlapped_step)
    assert deferred_plan.temp - grads_plan.temp <= 12 * num_params + staging + 2 * moe_bytes
