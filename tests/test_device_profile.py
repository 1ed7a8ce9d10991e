"""The profile summary benchmarks attach to their records: stream busy times and op times."""

import jax
import jax.numpy as jnp
import pytest

from peakflat_jax.bench import harness
from peakflat_jax.train import device_profile


def test_summary_takes_the_union_per_stream_and_ranks_ops_per_device():
    events = [("gpu:0", "stream 1", "gemm", "gemm_1", 0, 10),
              ("gpu:0", "stream 1", "gemm", "gemm_2", 5, 10),
              ("gpu:0", "stream 1", "add", "add", 30, 4),
              ("gpu:0", "stream 2", "all-to-all", "nccl", 0, 40),
              ("gpu:0", "stream 1", "gemm", "gemm_1", 100, 10),
              ("gpu:0", "stream 1", "gemm", "gemm_2", 105, 10),
              ("gpu:0", "stream 1", "add", "add", 130, 4),
              ("gpu:0", "stream 2", "all-to-all", "nccl", 100, 40),
              ("gpu:1", "stream 1", "gemm", "gemm", 0, 6),
              ("gpu:1", "stream 1", "gemm", "gemm", 100, 6)]
    summary = device_profile.summarize_events(events, steps=2, top=2)
    first, second = summary["planes"]["gpu:0"], summary["planes"]["gpu:1"]
    # Overlapping kernels count once in a stream's busy time: 15 + 4 per step.
    assert first["lines"] == {"stream 1": {"busy_ms": 19e-6, "events": 3},
                              "stream 2": {"busy_ms": 40e-6, "events": 1}}
    assert list(first["ops_ms"].items()) == [("all-to-all", 40e-6), ("gemm", 20e-6)]
    assert first["other_ops_ms"] == 4e-6
    # Kernel families: gemm_1 and gemm_2 are one family (the two are top=2 of three families).
    assert first["kernel_families_ms"] == {"nccl": 40e-6, "gemm": 20e-6}
    # Devices are not summed: gpu:1's gemm is its own.
    assert second == {"lines": {"stream 1": {"busy_ms": 6e-6, "events": 1}},
                      "ops_ms": {"gemm": 6e-6}, "other_ops_ms": 0,
                      "kernel_families_ms": {"gemm": 6e-6}}


def test_host_copies_under_compute_are_the_intersection_of_their_unions():
    # One step on gpu:0: compute 0-10 and 20-30 (two streams overlapping at 5-10 count once),
    # a device-to-host copy 8-24 and a host-to-device one 40-50; gpu:1 copies alone.
    events = [("gpu:0", "compute", "gemm", "gemm_1", 0, 10),
              ("gpu:0", "compute 2", "add", "add", 5, 5),
              ("gpu:0", "compute", "gemm", "gemm_2", 20, 10),
              ("gpu:0", "copies", "copy-start", "MemcpyD2H", 8, 16),
              ("gpu:0", "copies", "copy-start", "MemcpyH2D", 40, 10),
              ("gpu:0", "compute", "copy", "MemcpyD2D", 60, 5),  # on the device: compute
              ("gpu:1", "copies", "copy-start", "MemcpyHtoD", 0, 7)]
    result = device_profile.host_copy_overlap(events, steps=1)
    # Copies 8-24 and 40-50 (26 ns); compute 0-10, 20-30, 60-65 (25 ns); both at 8-10, 20-24.
    assert result["gpu:0"] == {"host_copy_ms": 26e-6, "compute_ms": 25e-6,
                               "overlapped_ms": pytest.approx(6e-6)}
    assert result["gpu:1"] == {"host_copy_ms": 7e-6, "compute_ms": 0.0, "overlapped_ms": 0.0}


def test_exposed_host_copies_are_charged_to_the_op_that_ran_next():
    # compute: attn 0-10, mlp 10-20, a second stream 18-24, attn 40-50, add 70-75, and an
    # instant marker at 27; copies: -5-0 (before any compute), 5-30 (on two streams, 5-25 and
    # 22-30), 45-60, 80-90. Exposed: -5-0 (attn.1 next), 24-30 (attn.2 next at 40: the marker
    # holds nothing back), 50-60 (add next at 70) and 80-90 (nothing after).
    events = [("gpu:0", "compute", "attn.1", "k", 0, 10),
              ("gpu:0", "compute", "mlp.1", "k", 10, 10),
              ("gpu:0", "compute 2", "side", "k", 18, 6),
              ("gpu:0", "compute", "marker", "k", 27, 0),
              ("gpu:0", "compute", "attn.2", "k", 40, 10),
              ("gpu:0", "compute", "add", "k", 70, 5),
              ("gpu:0", "copies 1", "copy-start.0", "MemcpyH2D", -5, 5),
              ("gpu:0", "copies 1", "copy-start.1", "MemcpyH2D", 5, 20),
              ("gpu:0", "copies 2", "copy-start.2", "MemcpyD2H", 22, 8),
              ("gpu:0", "copies 1", "copy-start.3", "MemcpyH2D", 45, 15),
              ("gpu:0", "copies 1", "copy-start.4", "MemcpyD2H", 80, 10)]
    result = device_profile.exposed_host_copies(events, steps=2)["gpu:0"]
    assert result["exposed_ms"] == pytest.approx(31e-6 / 2)
    assert result["waited_ms"] == {"attn.1": pytest.approx(2.5e-6), "attn.2": pytest.approx(3e-6),
                                   "add": pytest.approx(5e-6),
                                   "(none after)": pytest.approx(5e-6)}
    overlap = device_profile.host_copy_overlap(events, steps=2)["gpu:0"]
    assert overlap["host_copy_ms"] - overlap["overlapped_ms"] == pytest.approx(
        result["exposed_ms"])


def test_profile_call_reads_its_own_trace():
    """On CPU, XLA's thunks show on the host plane under their HLO names (the GPU planes are
    read by the same code)."""
    fn = jax.jit(lambda a: jnp.tanh(a @ a) @ a)
    a = jnp.ones((256, 256))
    fn(a)
    summary = device_profile.profile_call(fn, a, steps=2, top=1000, plane_prefix="/host:CPU")
    host = summary["planes"]["/host:CPU"]
    assert summary["steps"] == 2
    assert any(name.startswith("wrapped_tanh") and ms > 0 for name, ms in host["ops_ms"].items())
    assert any(line["busy_ms"] > 0 for line in host["lines"].values())
    missing = device_profile.profile_call(fn, a, steps=1, plane_prefix="/nothing")
    assert "no events" in missing["error"]


def test_bad_steps():
    with pytest.raises(ValueError, match="steps"):
        device_profile.profile_call(lambda: None, steps=0)


def test_a_case_with_trace_steps_records_a_profile():
    fn = jax.jit(lambda a: a @ a)
    a = jnp.ones((64, 64))
    compiled = fn.lower(a).compile()
    plain = harness.measure_compiled(compiled, (a,), jax.devices()[:1], {"repeats": 1})
    traced = harness.measure_compiled(compiled, (a,), jax.devices()[:1],
                                      {"repeats": 1, "trace_steps": 1})
    assert "device_profile" not in plain
    # CPU has no device plane: the record says so instead of holding numbers.
    assert "no events" in traced["device_profile"]["error"]


def test_artifacts_keep_the_trace_and_the_program(tmp_path, monkeypatch):
    """With $PEAKFLAT_ARTIFACTS set, a traced case leaves its trace and optimized HLO behind,
    named by its label, for reading offline."""
    import tarfile

    fn = jax.jit(lambda a: jnp.tanh(a @ a))
    a = jnp.ones((32, 32))
    compiled = fn.lower(a).compile()
    monkeypatch.setenv("PEAKFLAT_ARTIFACTS", str(tmp_path))
    harness.trace_fields(compiled, (a,), {"trace_steps": 1, "label": "ep 95%/16"})
    with tarfile.open(tmp_path / "trace_ep_95_16.tar.gz") as archive:
        assert sorted(archive.getnames()) == ["program.hlo.txt", "trace.xplane.pb"]
        program = archive.extractfile("program.hlo.txt").read().decode()
    assert program == compiled.as_text()
