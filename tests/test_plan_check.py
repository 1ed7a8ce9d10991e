"""``peakflat plan --check``: the closed form held to XLA's plan of the programs the trainer
compiles on this machine (8 CPU devices), and a bound that is too small is caught."""

import dataclasses

import pytest

from peakflat_jax import plan as planner
from peakflat_jax.config import load_config
from peakflat_jax.plan import cli as plan_cli
from peakflat_jax.plan.check import check_plan_against_xla, format_checks

SMALL = ["model.num_layers=2", "data.seq_len=64", "train.steps=2"]


@pytest.fixture(scope="module")
def tiny_plan():
    config = load_config("tiny", SMALL)
    return planner.make_plan(config, 8, platform="cpu", device_memory=2**30,
                             host_memory=2**33)


def test_check_holds_the_plan_to_every_compiled_program(tiny_plan):
    checks = check_plan_against_xla(tiny_plan)
    # All four operators on: the overlapped step (the run's only full-model program) and the
    # optimizer's own (for a checkpoint's flush).
    assert {c.name for c in checks} == {"overlapped_step", "optimizer_step"}
    assert all(c.holds and 0 < c.xla_device_bytes <= c.bound for c in checks)
    assert "the closed form bounds every program" in format_checks(tiny_plan, checks)


def test_a_bound_below_xlas_plan_fails(tiny_plan):
    shrunk = dataclasses.replace(tiny_plan, terms=tuple(
        dataclasses.replace(term, bytes=term.bytes // 10) for term in tiny_plan.terms))
    checks = check_plan_against_xla(shrunk)
    assert not any(c.holds for c in checks)
    assert "does not hold on this machine" in format_checks(shrunk, checks)


def test_the_command(capsys):
    assert plan_cli.main(["tiny", *SMALL, "--check"]) == 0
    assert "the closed form bounds every program" in capsys.readouterr().out
    # A plan for another machine is not checked here: one line, exit 2.
    assert plan_cli.main(["h200-1", "--check"]) == 2
    assert "--check: compiles on this machine" in capsys.readouterr().err
