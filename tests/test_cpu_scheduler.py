"""``import peakflat_jax`` turns XLA:CPU's concurrency-optimized scheduler off before jax starts
its backends (``peakflat_jax._xla_cpu``, docs/cpu_scheduler.md), leaves ``XLA_FLAGS`` alone where
it names the option or ``PEAKFLAT_KEEP_CPU_SCHEDULER`` is set, and warns once where a backend has
started already. Each case is a fresh interpreter: XLA reads its flags once per process."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from peakflat_jax import _xla_cpu

REPO = pathlib.Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(_xla_cpu.has_nvidia_gpus(),
                                reason="the flag is set only where no NVIDIA GPU is")


def child(code: str, xla_flags: str, keep: bool = False) -> dict:
    """Runs ``code`` (which prints one JSON line last) in a fresh interpreter with ``xla_flags``
    and the suite's opt-out removed (or set where ``keep``)."""
    env = {k: v for k, v in os.environ.items() if k != _xla_cpu.KEEP_VARIABLE}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags, PYTHONPATH=str(REPO))
    if keep:
        env[_xla_cpu.KEEP_VARIABLE] = "1"
    completed = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env,
                               capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-3000:]
    return json.loads(completed.stdout.strip().splitlines()[-1])


COMPILE_AND_REPORT = """
import json, os, pathlib
import peakflat_jax
import jax, jax.numpy as jnp
jax.jit(lambda x: x + 1)(jnp.ones(3)).block_until_ready()
options = "".join(p.read_text() for p in pathlib.Path({dump!r}).glob("*debug_options"))
print(json.dumps({{"flags": os.environ["XLA_FLAGS"], "options": options}}))
"""


def test_import_sets_the_flag_and_xla_compiles_with_it(tmp_path):
    """Imported before any computation: the flag is in ``XLA_FLAGS`` and XLA compiled the first
    program with the memory-optimized scheduler (its dumped debug options)."""
    given = f"--xla_force_host_platform_device_count=8 --xla_dump_to={tmp_path}"
    out = child(COMPILE_AND_REPORT.format(dump=str(tmp_path)), given)
    assert out["flags"].split() == [*given.split(), _xla_cpu.CPU_SCHEDULER_FLAG]
    assert "xla_cpu_scheduler_type: CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED" in out["options"]


@pytest.mark.parametrize("case", ["given", "kept"])
def test_a_given_option_or_the_keep_variable_leaves_the_flags(tmp_path, case):
    """``XLA_FLAGS`` naming the option (here: the default scheduler, asked for) or
    ``PEAKFLAT_KEEP_CPU_SCHEDULER``: the flags as they were, XLA's default scheduler."""
    given = f"--xla_force_host_platform_device_count=8 --xla_dump_to={tmp_path}"
    if case == "given":
        given += f" --{_xla_cpu.OPTION}=true"
    out = child(COMPILE_AND_REPORT.format(dump=str(tmp_path)), given, keep=case == "kept")
    assert out["flags"] == given
    assert "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED" not in out["options"]


def test_import_after_the_backend_started_warns_once():
    """A backend started before the import: too late to set the flag, one RuntimeWarning that
    names the record and the remedy, however often the check runs; the flags untouched."""
    code = """
import json, os, warnings
import jax
jax.devices()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import peakflat_jax
    from peakflat_jax._xla_cpu import protect_cpu_backend
    again = protect_cpu_backend()
print(json.dumps({"flags": os.environ["XLA_FLAGS"], "again": again,
                  "warnings": [(w.category.__name__, str(w.message)) for w in caught]}))
"""
    out = child(code, "--xla_force_host_platform_device_count=8")
    assert out["flags"] == "--xla_force_host_platform_device_count=8"
    assert out["again"] == "warned"
    assert [category for category, _ in out["warnings"]] == ["RuntimeWarning"]
    message = out["warnings"][0][1]
    assert "docs/cpu_scheduler.md" in message and _xla_cpu.CPU_SCHEDULER_FLAG in message
