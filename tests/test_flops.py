"""Model FLOPs by the trainer's convention (peakflat_jax/model/size.py): the causal pairs within
documents against a brute-force count of the attention mask, the full-causal count of synthetic
data, the throughput record and its warning (train/metrics.py), and the planner's attention."""

import dataclasses
import types

import numpy as np
import pytest

from peakflat_jax import plan
from peakflat_jax.config import DataConfig, ModelConfig, load_config
from peakflat_jax.model import size
from peakflat_jax.train import data as pf_data
from peakflat_jax.train import metrics


def mask_pairs(segment_ids) -> int:
    """The causal mask within documents, built as the XLA attention kernel builds it (query i
    sees key j <= i of the same segment), restricted to documents (id > 0), and counted."""
    ids = np.atleast_2d(segment_ids)
    t = ids.shape[-1]
    same = ids[:, :, None] == ids[:, None, :]
    causal = np.tril(np.ones((t, t), bool))
    return int(np.sum(same & causal & (ids[:, :, None] > 0)))


def test_pairs_match_the_mask_on_handmade_rows():
    ids = np.array([[1, 1, 1, 2, 2, 0, 0, 0],
                    [1, 1, 1, 1, 1, 1, 1, 1],
                    [0, 0, 0, 0, 0, 0, 0, 0],
                    [3, 1, 1, 3, 2, 2, 2, 1]])  # an id in several runs: the mask joins them
    assert size.causal_pairs(ids) == mask_pairs(ids) == 6 + 3 + 36 + 0 + 3 + 6 + 6
    assert size.causal_pairs(ids[1]) == 36


@pytest.mark.parametrize("max_segments", [1, 3, 16])
def test_pairs_match_the_mask_on_random_packings(rng, max_segments):
    for _ in range(20):
        rows, t = rng.integers(1, 4), rng.integers(1, 64)
        lengths = rng.integers(1, 20, (rows, max_segments))
        ids = np.zeros((rows, t), np.int64)
        for r in range(rows):
            cut = np.minimum(np.cumsum(lengths[r]), t)
            for s, (start, stop) in enumerate(zip(np.r_[0, cut[:-1]], cut)):
                ids[r, start:stop] = s + 1
        assert size.causal_pairs(ids) == mask_pairs(ids)


@pytest.mark.parametrize("blank_lines", [1, 2])
def test_pairs_match_the_mask_on_the_pipeline_batches(blank_lines):
    data = DataConfig(seq_len=512, batch_size=4, max_segments=8,
                      document_blank_lines=blank_lines)
    batches = pf_data.make_batches(data, vocab_size=260)
    for _ in range(3):
        ids = next(batches)["segment_ids"]
        assert size.causal_pairs(ids) == mask_pairs(ids)


def test_synthetic_data_gives_full_causal():
    config = ModelConfig()
    data = DataConfig(source="synthetic", seq_len=128, batch_size=3)
    ids = next(pf_data.make_batches(data, vocab_size=config.vocab_size))["segment_ids"]
    assert size.causal_pairs(ids) == mask_pairs(ids) == 3 * 128 * 129 // 2
    assert pf_data.causal_pairs_per_sequence(data) == 128 * 129 / 2
    np.testing.assert_allclose(size.model_flops(config, ids),
                               3 * 128 * size.model_flops_per_token(config, 128), rtol=1e-12)
    attention = 12 * config.num_layers * config.num_heads * config.head_dim * 3 * 128 * 129 / 2
    matmuls = 6 * size.active_parameters_per_token(config) * 3 * 128
    assert size.model_flops(config, ids) == matmuls + attention


def test_packed_chapters_count_a_small_share_of_full_causal():
    """At h200-1's 64K context the chapters (level 1) leave a few percent of full causal; the
    books (level 2, the preset) most of it; synthetic all."""
    from peakflat_jax.plan.rates import attention_fraction

    def fraction(config):
        return attention_fraction(plan.Target(data=pf_data.data_stats(config.data)), 65536)

    config = load_config("h200-1")
    assert fraction(config) > 0.5
    assert fraction(config.replace(data={"document_blank_lines": 1})) < 0.15
    assert fraction(config.replace(data={"source": "synthetic"})) == 1.0


def test_the_step_estimate_counts_attention_within_documents():
    """Its attention term (no offload, the optimizer on the device: no term hides under it)."""
    config = load_config("h200-1").replace(operators={
        "moe_dispatch": "pipelined", "loss": "ring", "offload": "none",
        "optimizer_offload": False})
    knobs = plan.knobs_from_config(config, 1, context=config.data.seq_len, platform="gpu")
    rates = plan.measured_for("gpu").rates
    fast = dataclasses.replace(rates, attention_flops=1e30)
    m = config.model
    for data in ({"document_blank_lines": 1}, {"document_blank_lines": 2}, {"source": "synthetic"}):
        c = config.replace(data=data)
        target = plan.Target(data=pf_data.data_stats(c.data))
        attention = (plan.step_seconds(c, knobs, target)
                     - plan.step_seconds(c, knobs, dataclasses.replace(target, rates=fast)))
        pairs = pf_data.causal_pairs_per_sequence(c.data, knobs.context)
        expected = 16 * m.num_layers * m.num_heads * m.head_dim * pairs * (
            knobs.tokens_per_device / knobs.context) / rates.attention_flops
        np.testing.assert_allclose(attention, expected, rtol=1e-6)


def fake_mesh(kind: str, count: int = 1):
    device = types.SimpleNamespace(device_kind=kind, process_index=0)
    return types.SimpleNamespace(devices=np.array([device] * count, dtype=object))


def test_mfu_is_of_the_vendor_peak_beside_the_measured_rate_and_too_fast_a_step_warns():
    config = ModelConfig(dtype="bfloat16")
    ids = np.ones((2, 64), np.int32)
    flops = size.model_flops(config, ids)
    throughput = metrics.Throughput(config, fake_mesh("NVIDIA H200", 2))
    assert throughput.denominator == 989.4e12
    assert "vendor's dense bfloat16 peak" in throughput.label
    record = throughput.step(ids, seconds=flops / 2 / 100e12)   # 100 TFLOP/s per device
    np.testing.assert_allclose(record["model_tflops_per_device"], 100.0, rtol=1e-12)
    np.testing.assert_allclose(record["mfu"], 100e12 / 989.4e12, rtol=1e-12)
    np.testing.assert_allclose(record["fraction_of_measured_matmul"], 100e12 / 760e12,
                               rtol=1e-12)
    assert record["attention_pairs_fraction"] == 1.0
    assert throughput.warning() is None
    throughput.step(ids, seconds=flops / 2 / 800e12)            # above the measured rate
    assert "above the device's measured dense matmul rate" in throughput.warning()
    throughput.step(ids, seconds=flops / 2 / 900e12)
    assert throughput.warning() is None                          # once per run
    fields = throughput.summary_fields()
    assert fields["flops_convention"] == size.FLOPS_CONVENTION
    assert fields["mfu_denominator_flops"] == 989.4e12
    assert "760 TFLOP/s" in fields["fraction_of_measured_matmul_denominator"]


def test_without_a_measured_rate_mfu_is_of_the_labelled_vendor_peak():
    throughput = metrics.Throughput(ModelConfig(dtype="float32"), fake_mesh("NVIDIA H100"))
    assert throughput.denominator == metrics.PEAK_FLOPS["H100"]["float32"]
    assert "vendor's dense float32 peak" in throughput.label
    cpu = metrics.Throughput(ModelConfig(), fake_mesh("cpu"))
    assert cpu.denominator is None and cpu.step(np.ones((1, 8), np.int32), 1.0)["mfu"] is None
