"""The ``peakflat`` command: bad input is one line naming what is wrong and exit status 2, before
anything compiles; overrides and flags come in any order; ``peakflat plan CONFIG`` plans for the
device the config names, on any machine; a run directory holds one run. (Interrupts and resumes,
which compile a trainer, are in test_train.py.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from peakflat_jax import cli
from peakflat_jax.train import interrupts, run_lock
from peakflat_jax.train import run_dir as run_dirs
from tests.test_train import REPO, SMALL, small_args

GIB = 2**30


def run_main(capsys, *argv: str) -> tuple[int, str, str]:
    status = cli.main(list(argv))
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def assert_one_line_naming(status: int, err: str, *names: str) -> None:
    assert status == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    for name in names:
        assert name in err, err


# ----------------------------------------------------------------------------------------------
# Bad input.


@pytest.mark.parametrize("argv, key", [
    (["model.hiden=3"], "model.hiden"),                            # unknown key
    (["data.seq_len=abc"], "data.seq_len"),                        # wrong type
    (["optimizer.learning_rate=-0.1"], "optimizer.learning_rate"),  # negative learning rate
    (["data.corpus_path=/no/such/corpus.txt"], "data.corpus_path"),  # missing file
    (["model.num_heads=6"], "model.num_heads"),                    # not a multiple of 4 kv heads
    (["model.num_heads=4", "model.num_kv_heads=2", "mesh.data=1", "mesh.seq=8"],
     "model.num_heads"),                                           # heads do not split over seq
    (["mesh.data=3"], "mesh.data"),                                # 8 devices
    (["--no-progress", "train.steps=-1"], "train.steps"),          # an override after a flag
    (["--bogus"], "--bogus"),
    (["--no-progress", "steps"], "steps"),
    (["--resume", "--overwrite"], "--overwrite"),
    (["optimizer.update_on=gpu"], "optimizer.update_on"),         # not a placement
    # tiny streams its optimizer (optimizer_offload: true): the host CPU contradicts it.
    (["optimizer.update_on=host_cpu"], "operators.optimizer_offload: true"),
    (["optimizer.update_on=host_cpu", "operators.optimizer_offload=false",
      "mesh.num_processes=2"], "mesh.num_processes"),             # one process only
    (["optimizer.resident_groups=9"], "optimizer.resident_groups"),  # tiny has 1 + 4 groups
    (["optimizer.resident_groups=1", "operators.optimizer_offload=false"],
     "optimizer.resident_groups"),                                # nothing is streamed
], ids=lambda value: value if isinstance(value, str) else None)
def test_bad_train_input_is_one_line_and_status_2(capsys, tmp_path, argv, key):
    overrides = [word for word in argv if "=" in word]
    flags = [word for word in argv if "=" not in word]
    status, _, err = run_main(capsys, "train", "tiny", *small_args(*overrides), *flags,
                              "--run-dir", str(tmp_path / "run"))
    assert_one_line_naming(status, err, key)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("argv, named", [
    (["--run-dir", "a", "--run-dir", "b"], "--run-dir given twice (--run-dir a and --run-dir b)"),
    (["train.steps=1", "train.steps=2"], "train.steps given twice"),
    (["--no-progress", "--no-progress"], "--no-progress given twice"),
])
def test_a_flag_or_override_given_twice_is_one_line(capsys, argv, named):
    status, _, err = run_main(capsys, "train", "tiny", *argv)
    assert_one_line_naming(status, err, named)
    status, _, err = run_main(capsys, "plan", "tiny", "--auto", "--auto")
    assert_one_line_naming(status, err, "--auto given twice")


def test_bad_paths_are_one_line_before_anything_runs(capsys, tmp_path):
    """A config path that is a directory; a run directory that is a file, under a file, or
    where none can be made: one line each, naming the path, exit status 2, nothing made."""
    (tmp_path / "configs").mkdir()
    (tmp_path / "file").write_text("not a directory\n")
    status, _, err = run_main(capsys, "train", str(tmp_path / "configs"))
    assert_one_line_naming(status, err, "is a directory", str(tmp_path / "configs"))
    for run_dir, why in ((tmp_path / "file", "is a file"),
                         (tmp_path / "file" / "run", f"{tmp_path / 'file'} is a file"),
                         ("/proc/peakflat-run", "no such file or directory")):
        status, _, err = run_main(capsys, "train", "tiny", "--run-dir", str(run_dir))
        assert_one_line_naming(status, err, f"run directory {run_dir}", why)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["configs", "file"]


def test_a_gpu_config_on_a_machine_without_one_says_so(capsys, tmp_path):
    status, _, err = run_main(capsys, "train", "h200-1", "--run-dir", str(tmp_path / "run"))
    assert_one_line_naming(status, err, "h200-1 is a GPU config (device.platform: gpu)",
                           "no GPU", "device.platform=cpu", "peakflat plan h200-1")
    assert not (tmp_path / "run").exists()


def test_missing_config_file_is_one_line(capsys):
    status, _, err = run_main(capsys, "train", "no-such-config")
    assert_one_line_naming(status, err, "no-such-config", "tiny")


@pytest.mark.parametrize("argv, key", [
    (["plan", "tiny", "--devices", "abc"], "--devices"),
    (["plan", "tiny", "--devices", "0"], "--devices"),
    (["plan", "tiny", "--json", "model.hiden=1"], "model.hiden"),
    (["plan", "tiny", "--json", "extra"], "extra"),
    (["plan", "tiny", "--device-memory", "-1"], "--device-memory"),
    (["plan", "tiny", "device.count=0"], "device.count"),
    (["xcheck", "export", "unused", "--dtype", "float16"], "--dtype"),
    (["xcheck", "export", "unused", "--seed", "1", "model.hiden=3"], "model.hiden"),
    (["xcheck", "run", "--seed", "x"], "--seed"),
    (["bench", "no_such_operator"], "no_such_operator"),
    (["bench", "sco", "--preset", "nope"], "--preset"),
    (["bench", "sco", "--trace-steps", "0"], "--trace-steps"),
    (["bench", "offload_adamw", "--trace-steps", "2"], "--trace-steps"),
    (["bench", "sco", "--repeats", "0"], "--repeats"),
    (["bench", "sco", "--only", "no case has this"], "--only"),
    (["bench", "sco", "a.b=1"], "a.b=1"),
    ([], "command"),
], ids=lambda value: value if isinstance(value, str) else None)
def test_bad_arguments_of_every_command_are_one_line_and_status_2(capsys, argv, key):
    status, _, err = run_main(capsys, *argv)
    assert_one_line_naming(status, err, key)


def test_a_config_too_large_for_the_cpu_is_refused_before_compiling(capsys, tmp_path):
    """A million-token context on 8 CPU devices: the planner holds each device to its share of
    the host (before, XLA:CPU's compiler died of SIGFPE on the T x T attention scores)."""
    status, _, err = run_main(capsys, "train", "tiny", "data.seq_len=1048576", "--no-progress",
                              "--run-dir", str(tmp_path / "run"))
    first = err.splitlines()[0]
    assert status == 2 and "does not fit" in first and "attention" in first, err
    assert "data.seq_len" in err and "Traceback" not in err
    # The verdict with its largest terms, what to change, and the context that fits.
    lines = err.strip().splitlines()
    assert len(lines) <= 5 and "largest terms: attention" in lines[0], err
    assert "to change:" in err and "it fits up to data.seq_len=" in lines[-1], err
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------------------------
# Overrides and flags in any order.


@pytest.mark.parametrize("argv, overrides", [
    (["train", "tiny", "a.b=1", "--no-progress", "c.d=2", "--run-dir", "x", "e.f=3"],
     ["a.b=1", "c.d=2", "e.f=3"]),
    # scripts/demo.sh: `peakflat train tiny --run-dir "${PEAKFLAT_OUT:-runs/tiny}" "$@"`
    (["train", "tiny", "--run-dir", "runs/tiny", "train.steps=10"], ["train.steps=10"]),
    (["plan", "tiny", "--json", "operators.token_budget=8", "--auto"],
     ["operators.token_budget=8"]),
    (["xcheck", "export", "out", "--seed", "3", "data.seq_len=64"], ["data.seq_len=64"]),
    (["xcheck", "run", "--dtype", "bfloat16", "data.seq_len=64"], ["data.seq_len=64"]),
])
def test_overrides_may_follow_flags(argv, overrides):
    args = cli.parse_arguments(cli.make_parser(), argv)
    assert args.overrides == overrides


def test_an_override_after_a_flag_reaches_the_config(capsys):
    status, _, err = run_main(capsys, "plan", "tiny", "--json", "model.hiden=1")
    assert_one_line_naming(status, err, "model.hiden")


def test_the_resume_command_is_the_command_with_resume_and_without_overwrite():
    argv = ["train", "tiny", "--overwrite", "train.steps=3", "--run-dir", "runs/a b"]
    assert cli.resume_command(argv) == ("peakflat train tiny train.steps=3 --run-dir 'runs/a b' "
                                        "--resume")


# ----------------------------------------------------------------------------------------------
# peakflat plan: the config's device, the flags over it.


def test_plan_tiny_plans_its_8_cpu_devices_without_flags(capsys):
    status, out, err = run_main(capsys, "plan", "tiny")
    assert status == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("peakflat plan tiny fits: "), out  # the verdict first
    assert lines[1].startswith("8 cpu devices (data 2 x seq 4)"), out


def test_plan_of_a_gpu_preset_needs_no_gpu(capsys):
    """h200-1 planned here, on a machine with no GPU, against the H200 its config names: the
    device's 132.8 GiB and the host's 124.8, not this machine's."""
    status, out, err = run_main(capsys, "plan", "h200-1", "--json")
    plan = json.loads(out)
    assert status == 0 and plan["feasible"], err
    assert (plan["platform"], plan["devices"]) == ("gpu", 1)
    assert (plan["device_bytes"], plan["host_memory_bytes"]) == (int(132.8 * GIB),
                                                                 int(124.8 * GIB))
    assert run_main(capsys, "plan", "h200-1", "--auto")[0] == 0


def test_flags_and_overrides_override_the_config_device(capsys):
    status, out, err = run_main(capsys, "plan", "h200-1", "mesh.seq=-1", "--devices", "2",
                                "--device-memory", "80", "--host-memory", "64", "--json")
    plan = json.loads(out)
    assert status == 0, err
    assert (plan["devices"], plan["device_bytes"], plan["host_memory_bytes"]) == (
        2, 80 * GIB, 64 * GIB)
    status, out, err = run_main(capsys, "plan", "h200-1", "device.memory_gib=100", "--platform",
                                "cpu", "--json")
    plan = json.loads(out)
    assert (plan["platform"], plan["device_bytes"]) == ("cpu", 100 * GIB), err


# ----------------------------------------------------------------------------------------------
# Run directories (refused before compiling; the runs themselves are in test_train.py).


def train_into(capsys, run_dir, *flags):
    return run_main(capsys, "train", "tiny", *SMALL, "--no-progress", "--run-dir", str(run_dir),
                    *flags)


def test_a_fresh_run_into_a_run_directory_that_holds_a_run_is_refused(capsys, tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    status, _, err = train_into(capsys, tmp_path)
    assert_one_line_naming(status, err, str(tmp_path), "--resume", "--overwrite")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


def test_resume_without_a_checkpoint_is_refused(capsys, tmp_path):
    for run_dir in (tmp_path / "absent", tmp_path):
        (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
        status, _, err = train_into(capsys, run_dir, "--resume")
        assert_one_line_naming(status, err, "--resume", str(run_dir), "no complete checkpoint")
    assert not (tmp_path / "absent").exists()


HOLD = ("import sys, time; from peakflat_jax.train import run_lock; "
        "run_lock.hold(sys.argv[1]); print('held', flush=True); time.sleep(600)")


def test_a_live_run_directory_is_refused_and_a_killed_holder_leaves_it_usable(capsys,
                                                                              tmp_path):
    """A process holding the run directory's lock (as a run does for its life): a fresh run,
    --resume and --overwrite into it are refused in one line naming its pid, and touch
    nothing there; killed (-9), it leaves a stale lock file that the next run takes over, and
    a run that ends removes it."""
    run_dir = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], cwd=REPO,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
        before = file_snapshot(run_dir)
        for flags in ([], ["--resume"], ["--overwrite"]):
            status, _, err = train_into(capsys, run_dir, *flags)
            assert_one_line_naming(status, err, f"run directory {run_dir} is in use",
                                   f"pid {holder.pid} on ")
        assert file_snapshot(run_dir) == before
    finally:
        holder.kill()
        holder.wait()
    assert (run_dir / ".lock").exists()  # stale: the kernel released its lock
    with run_lock.hold(run_dir) as lock:
        assert json.loads((run_dir / ".lock").read_text())["pid"] == os.getpid()
        assert run_lock.hold(run_dir) is lock  # re-entrant within a process
        lock.release()
    assert sorted(p.name for p in run_dir.iterdir()) == ["metrics.jsonl"]


def file_snapshot(run_dir) -> dict:
    """Every file under ``run_dir`` with its size, modification time and bytes."""
    return {str(p): (p.stat().st_mtime_ns, p.read_bytes()) for p in run_dir.rglob("*")
            if p.is_file()}


def test_resume_changes_are_refused_or_recorded(tmp_path):
    """A resume's config against the run's: a changed learning rate is refused naming the
    old and new values; a longer run (train.steps) is accepted and recorded, config.json
    keeping the start, and the next resume compares against the run as changed."""
    from peakflat_jax.config import load_config, to_dict

    start = to_dict(load_config("tiny"))
    (tmp_path / "config.json").write_text(json.dumps(start))
    with pytest.raises(run_dirs.RunDirError) as refused:
        run_dirs.resume_changes(tmp_path, to_dict(load_config(
            "tiny", ["optimizer.learning_rate=0.01"])))
    message = str(refused.value)
    assert "\n" not in message and ("holds a run with optimizer.learning_rate = 0.003, this "
                                    "one has 0.01: ") in message
    assert "resume with optimizer.learning_rate=0.003, or start a new run" in message
    with pytest.raises(run_dirs.RunDirError, match=r"data.seed = 0, this one has 3 \(and 1 "
                                                   r"more: optimizer.learning_rate\)"):
        run_dirs.resume_changes(tmp_path, to_dict(load_config(
            "tiny", ["optimizer.learning_rate=0.01", "data.seed=3"])))
    longer = to_dict(load_config("tiny", ["train.steps=48", "train.checkpoint_every=4"]))
    changed = run_dirs.record_config(tmp_path, longer, resumed_from=24)
    assert changed == {"train.steps": {"was": 24, "now": 48},
                       "train.checkpoint_every": {"was": 8, "now": 4}}
    assert json.loads((tmp_path / "config.json").read_text()) == start
    assert run_dirs.record_config(tmp_path, longer, resumed_from=30) == {}  # nothing new
    record = json.loads((tmp_path / "config_changes.jsonl").read_text())
    assert (record["resumed_from"], record["changed"]) == (24, changed)


def test_overwrite_clears_only_a_run_directory(capsys, tmp_path):
    (tmp_path / "notes.txt").write_text("mine\n")
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    status, _, err = train_into(capsys, tmp_path, "--overwrite")
    assert_one_line_naming(status, err, "--overwrite", "notes.txt")
    assert (tmp_path / "notes.txt").exists() and (tmp_path / "metrics.jsonl").exists()
    (tmp_path / "notes.txt").unlink()
    (tmp_path / "checkpoints" / "4").mkdir(parents=True)
    run_dirs.check_run_dir(tmp_path, resume=False, overwrite=True, saved_step=None)
    run_dirs.clear_run_dir(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_the_compilation_cache_keeps_even_a_program_that_compiles_at_once(tmp_path):
    """A program of well under a second's compile is written to PEAKFLAT_JAX_CACHE too (a
    fresh process: the cache is global to jax): a second start reads the start's small
    programs instead of compiling them again."""
    code = ("from peakflat_jax.cli import enable_compilation_cache; enable_compilation_cache(); "
            "import jax, jax.numpy as jnp; "
            "jax.jit(lambda x: x * 3 + 1)(jnp.ones(5)).block_until_ready()")
    cache = tmp_path / "cache"
    child = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                           timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu",
                                             "PEAKFLAT_JAX_CACHE": str(cache)})
    assert child.returncode == 0, child.stderr[-2000:]
    assert cache.is_dir() and any(cache.iterdir())


HOST_COPIES = "--xla_gpu_experimental_parallel_async_compute_limit"


@pytest.mark.parametrize("given, asked, expected", [
    ("--xla_dump_hlo_as_text", None, None),
    ("--xla_dump_hlo_as_text", f"{HOST_COPIES}=8", f"{HOST_COPIES}=8"),
    (f"{HOST_COPIES}=4", f"{HOST_COPIES}=8", f"{HOST_COPIES}=4")],
    ids=["not asked", "asked", "the user's own"])
def test_an_experimental_xla_flag_only_where_a_config_asks(given, asked, expected):
    """No command adds an experimental XLA flag of its own: a config asks for one
    (``device.xla_flags``) and a flag XLA_FLAGS sets already wins; the jaxlib we run parses it
    (XLA aborts the process on a flag it does not know) and keeps what was given (a fresh
    process: XLA reads its flags once)."""
    flags_field = f"device.xla_flags=[{asked}]" if asked else "device.xla_flags=[]"
    code = ("import os; from peakflat_jax.cli import prepare_environment, add_config_flags; "
            "from peakflat_jax.config import load_config; prepare_environment(); "
            f"add_config_flags(load_config('tiny', [{flags_field!r}])); "
            "import jax, jax.numpy as jnp; "
            "jax.jit(lambda x: x + 1)(jnp.ones(3)).block_until_ready(); "
            "print(os.environ['XLA_FLAGS'])")
    child = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                           timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu",
                                             "XLA_FLAGS": given})
    assert child.returncode == 0, child.stderr[-2000:]
    flags = child.stdout.split()
    assert [f for f in flags if HOST_COPIES in f] == ([expected] if expected else [])
    assert {*given.split(), "--xla_force_host_platform_device_count=8"} <= set(flags)
    # XLA:CPU's scheduler flag where no GPU is (this suite's machines), not beside one.
    assert (cli.CPU_SCHEDULER_FLAG in flags) == (not cli.has_nvidia_gpus())


# ----------------------------------------------------------------------------------------------
# Signals.


def test_stop_requests_note_signals_and_restore_the_handlers():
    before = {s: signal.getsignal(s) for s in interrupts.SIGNALS}
    with interrupts.StopRequests() as stop:
        assert not stop.requested()
        signal.raise_signal(signal.SIGTERM)  # noted, not acted on
        assert stop.requested() and stop.signum == signal.SIGTERM
    assert {s: signal.getsignal(s) for s in interrupts.SIGNALS} == before
    stopped = interrupts.Interrupted(signal.SIGINT, 5, 12, 5, "runs/x/checkpoints")
    assert stopped.exit_status == 130
    assert str(stopped) == ("SIGINT: stopped after step 5 of 12; the checkpoint of step 5 is in "
                            "runs/x/checkpoints")
