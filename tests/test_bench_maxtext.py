"""The end-to-end bench's MaxText arm: the peer's model, settings and log, held against MaxText's
own figures where it prints them."""

import pytest

from peakflat_jax.bench import maxtext
from peakflat_jax.config import load_config

# MaxText 0.2.5's own line for one step of h200-e2e's six-layer cut (its five MoE layers) at
# 32,768 tokens on an H100: its TFLOP/s per device is its FLOP count over its `seconds`.
MAXTEXT_STEP_LINE = ("completed step: 4, seconds: 1.067, TFLOP/s/device: 190.661, "
                     "Tokens/s/device: 30715.613, total_weights: 32768, loss: 10.969")


def stamped(lines):
    return "\n".join(f"{t:.3f} {line}" for t, line in lines) + "\n"


def test_our_flop_formula_counts_the_peer_s_model_as_maxtext_counts_it():
    model = load_config("h200-e2e", ["model.num_layers=6"]).model
    theirs = 190.661e12 * 1.067  # MAXTEXT_STEP_LINE: TFLOP/s/device x seconds
    assert maxtext.flops_per_step(model, 32768) == pytest.approx(theirs, rel=1e-3)


def test_the_step_time_is_the_gap_between_finished_steps_not_the_flush():
    log = stamped([(10.0, "[train] Total estimated memory size: 71.4 GB, estimated output"),
                   (20.0, "completed step: 0, seconds: 0.440, loss: 12.282"),
                   (22.2, "completed step: 1, seconds: 2.148, loss: 11.828"),
                   (24.2, "completed step: 2, seconds: 1.972, loss: 11.377"),
                   (26.2, "completed step: 3, seconds: 1.973, loss: 11.091"),
                   (26.21, MAXTEXT_STEP_LINE),
                   (26.3, "PEER_PEAK_BYTES_GIB=70.500 PEER_LIMIT_BYTES_GIB=75.221 device=H100"),
                   (26.3, "PEER_HOST_PEAK_GIB=37.233")])
    parsed = maxtext.parse_log(log)
    assert parsed["steps_done"] == 5
    assert parsed["step_s"] == pytest.approx(2.0)  # the flush's 0.01 s and the warm-up left out
    assert parsed["losses"][-1] == pytest.approx(10.969)
    assert parsed["xla_estimate_bytes"] == int(71.4 * 2**30)  # MaxText's "GB" is GiB
    assert parsed["peak_bytes"] == int(70.5 * 2**30)
    assert not parsed["oom"] and not parsed["errors"]


def test_three_steps_are_timed_by_their_one_full_gap_and_an_oom_is_one():
    log = stamped([(1.0, "completed step: 0, seconds: 1.086, loss: 12.280"),
                   (4.237, "completed step: 1, seconds: 3.408, loss: 11.906"),
                   (4.247, "completed step: 2, seconds: 3.241, loss: 11.662")])
    assert maxtext.parse_log(log)["step_s"] == pytest.approx(3.237)
    failed = maxtext.parse_log(stamped([(1.0, "jax.errors.JaxRuntimeError: RESOURCE_EXHAUSTED: "
                                               "Out of memory while trying to allocate")]))
    assert failed["oom"] and failed["step_s"] is None and failed["steps_done"] == 0


@pytest.mark.parametrize("context", [4096, 32768, 65536, 100_000, 741_848])
def test_vocab_tiles_divide_the_tokens_into_tiles_of_about_4096(context):
    tiles = maxtext.vocab_tiles(context)
    assert context % tiles == 0
    assert context / tiles <= maxtext.VOCAB_TILE_TOKENS


def test_the_peer_s_model_is_our_moe_stack_and_says_what_it_leaves_out():
    model = load_config("h200-e2e").model
    peer = maxtext.comparable_model(model)
    assert (peer.num_layers, peer.num_dense_layers) == (11, 0)
    keys = maxtext.model_keys(model)
    assert keys["base_num_decoder_layers"] == 11 and keys["decoder_block"] == "mixtral"
    assert keys["base_mlp_dim"] == keys["base_moe_mlp_dim"] == model.expert_ffn
    notes = " ".join(maxtext.unmatched(model))
    assert "dense layer" in notes and "bias" in notes
    words = maxtext.overrides({"mlp_activations": ["silu", "linear"], "scan_layers": True,
                               "learning_rate": 2e-4})
    assert words == ['mlp_activations=["silu","linear"]', "scan_layers=true",
                     "learning_rate=0.0002"]
