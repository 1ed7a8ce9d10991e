"""The shared-link AdamW benchmark's orchestration: workers start together, results gather."""

from peakflat_jax.bench import offload_adamw

CASE = dict(method="stream_shared", num_params=100_000, leaf_params=50_000,
            bucket_params=50_000, slots=2, repeats=3, pin_gpus=False)


def test_workers_run_together_and_report():
    result = offload_adamw.run_case(dict(CASE, processes=2))
    assert "error" not in result, result
    assert len(result["worker_time_s"]) == 2
    assert result["time_s"] == max(result["worker_time_s"]) > 0
    assert 0 <= result["overlap"] <= 1


def test_a_failing_worker_is_an_error_not_a_number():
    result = offload_adamw.run_case(dict(CASE, processes=2, bucket_params=0))
    assert "error" in result and "time_s" not in result
