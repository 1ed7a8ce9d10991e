"""Compile as the verdict, on 8 CPU devices: ``peakflat plan --check`` prints XLA's plan of
the trainer's programs beside the closed form; ``--largest`` finds the largest context whose
compiled programs fit by bisection over compiles; ``peakflat train`` refuses, in one line, a
step whose compiled plan does not fit; ``operators: auto`` takes a lighter setting where the
compile says no."""

from __future__ import annotations

import dataclasses

import pytest

from peakflat_jax import cli
from peakflat_jax.cli import plan as plan_command
from peakflat_jax.config import load_config
from peakflat_jax.plan import GIB, DoesNotFit, make_plan
from peakflat_jax.train import preflight, trainer
from peakflat_jax.train.machine import plan_run

SMALL = ["model.num_layers=2", "data.seq_len=64", "train.steps=2"]
ALL_OFF = ["operators.moe_dispatch=ep", "operators.loss=materialized", "operators.offload=none",
           "operators.optimizer_offload=false"]


@pytest.fixture(scope="module")
def tiny_plan():
    return make_plan(load_config("tiny", SMALL), 8, platform="cpu", device_memory=GIB,
                     host_memory=8 * GIB, baseline=False)


@pytest.fixture(scope="module")
def all_off():
    """The standard stack of tiny at 64 tokens: its plan on this machine and XLA's total of
    its one program (compiled once for the module)."""
    plan = plan_run(load_config("tiny", [*SMALL, *ALL_OFF]), 8)
    (check,) = preflight.check(plan)
    return plan, check.xla_device_bytes


@pytest.mark.slow
def test_check_holds_the_plan_to_every_compiled_program(tiny_plan, capsys):
    checks = preflight.check(tiny_plan)
    # All four operators on: the overlapped step (the run's only full-model program) and the
    # optimizer's own (for a checkpoint's flush).
    assert {c.name for c in checks} == {"overlapped_step", "optimizer_step"}
    assert all(c.holds and 0 < c.xla_device_bytes <= c.bound for c in checks)
    table = preflight.format_checks(tiny_plan, checks)
    assert "the closed form bounds every program" in table and "verdict: fits" in table
    shrunk = dataclasses.replace(tiny_plan, terms=tuple(
        dataclasses.replace(term, bytes=term.bytes // 10) for term in tiny_plan.terms))
    assert not any(c.holds for c in preflight.check(shrunk))  # the same programs, reused
    assert preflight.compiled_fits(checks, tiny_plan.device_memory)
    assert not preflight.compiled_fits(checks, min(c.xla_device_bytes for c in checks) - 1)


@pytest.mark.slow
def test_the_check_command(capsys):
    assert plan_command.main(["tiny", *SMALL, "--check"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("peakflat plan tiny fits") and "XLA / closed form" in out
    # A plan for another machine is not compiled here: one line, exit 2.
    assert plan_command.main(["h200-1", "--check"]) == 2
    assert "--check: compiles on this machine" in capsys.readouterr().err


def test_the_bisection_finds_the_edge_of_a_monotone_fit():
    """``bisect_contexts`` against predicates whose edge is known: the answer fits, the
    next multiple past the stated width does not, from below or above the edge."""
    for edge in (1, 7, 64, 1000, 12345):
        for start in (4, 64, 4096):
            for ceiling in (None, 2 * edge, 20000):
                probes = []

                def fits(context, edge=edge):
                    probes.append(context)
                    return context <= edge

                found, width = preflight.bisect_contexts(fits, start, 4, 0.05, ceiling)
                if edge < 4:
                    assert found is None
                    continue
                assert found % 4 == 0 and found <= edge < found + width + 4, (
                    edge, start, ceiling, found)
                assert all(p % 4 == 0 for p in probes) and len(probes) < 40


@pytest.mark.slow
def test_largest_bisects_over_compiles(all_off, capsys):
    """``peakflat plan --largest`` on this machine's 8 CPU devices with a device memory where
    the closed form stops before XLA's plan does: every probe it compiled at or under its
    answer fits by XLA's plan, every one above does not, and it says how many compiles and how
    long."""
    plan, xla = all_off
    memory = 2.5 * xla / GIB  # room for XLA's plan at several times the context
    status = plan_command.main(["tiny", *SMALL, *ALL_OFF, "--largest", "--device-memory",
                                f"{memory:.9f}", "--resolution", "0.5"])
    out = capsys.readouterr().out.splitlines()
    probes = [line for line in out if line.startswith("context")]
    assert status == 0 and probes and "compiles in" in out[-1], out
    answer = int(out[-1].split("fit: ")[1].split(" tokens")[0].replace(",", ""))
    for line in probes:
        context = int(line.split(":")[0].split()[-1].replace(",", ""))
        assert line.endswith(")") and (("does not fit" not in line) == (context <= answer))
    assert answer > plan.knobs.context  # past the context XLA's plan fitted 2.5 times over


@pytest.mark.slow
def test_train_refuses_in_one_line_where_xla_s_plan_does_not_fit(all_off, capsys, tmp_path):
    """A device memory just under XLA's plan of the step (and so over the closed form's reach
    below it): the programs are compiled before anything is made, and the run is refused in
    one line naming XLA's plan and the device's memory, exit status 2, no run directory."""
    plan, xla = all_off
    memory = 0.97 * xla / GIB
    run_dir = tmp_path / "run"
    status = cli.main(["train", "tiny", *SMALL, *ALL_OFF, f"train.device_memory_gib={memory}",
                       "--no-progress", "--run-dir", str(run_dir)])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1, err
    assert "XLA's plan of the train step is" in err[0] and f"the device has {memory:.2f}" in err[0]
    assert "--largest" in err[0] and not run_dir.exists()


def test_auto_takes_the_next_lighter_setting_where_the_compile_says_no(monkeypatch):
    """``operators: auto``: where XLA's plan of the chosen setting does not fit the next one
    lighter by the closed form is compiled, until one fits; and where none does, one line
    names each setting tried. (The compiles are stood in for: the verdicts are the test's.)"""
    config = load_config("tiny", ["model.num_layers=2", "data.seq_len=64",
                                  *[f"operators.{n}=auto" for n in ("moe_dispatch", "loss",
                                                                     "offload",
                                                                     "optimizer_offload")]])
    memory = plan_run(config, 8).total_bytes  # the standard stack's closed form: at the edge
    config = config.replace(train={"device_memory_gib": memory / GIB})
    chosen = plan_run(config, 8)
    assert chosen.lighter
    # On a CPU the closed form bounds XLA's plan (its measured margin's high is 1): nothing is
    # near the edge where the closed form fits. Here it is taken to be.
    monkeypatch.setattr(trainer, "near_the_edge", lambda plan: True)
    tried = []

    def compile_abstract(self, refuse=lambda count: count < 3):
        tried.append(self)
        self.xla_plan = type("Plan", (), {"total": self.plan.total_bytes})()
        if refuse(len(tried)):
            raise DoesNotFit("stand-in")

    monkeypatch.setattr(trainer.Trainer, "compile_abstract", compile_abstract)
    taken = trainer.fitting_trainer(config)
    # The chosen setting, then the lighter ones fastest first: the third compiled is taken.
    assert len(tried) == 3 and taken is tried[2]
    assert taken.config.operators.moe_dispatch == chosen.lighter[1].operators.moe_dispatch
    assert all(t.plan.total_bytes < chosen.total_bytes for t in tried[1:])
    tried.clear()
    monkeypatch.setattr(trainer.Trainer, "compile_abstract",
                        lambda self: compile_abstract(self, lambda count: True))
    with pytest.raises(DoesNotFit, match="no auto setting fits") as refused:
        trainer.fitting_trainer(config)
    assert "\n" not in str(refused.value) and len(tried) == 1 + len(chosen.lighter)
