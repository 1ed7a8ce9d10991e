"""The initialisation scale and the warm-up's first step (REVIEW s3, section 5): the embedding
starts the residual stream at RMS ~1 (std 1.0, or 1 / sqrt(H) when it is also the head), the
head at 1 / sqrt(H), each overridable; the learning rate's first step is not 0."""

import math

import numpy as np
import pytest
from conftest import make_mesh

from peakflat_jax.config import ConfigError, ModelConfig, OptimizerConfig, load_config
from peakflat_jax.model.sharding import init_model
from peakflat_jax.train.optimizer import learning_rate_schedule

HIDDEN = 64


def initial_weights(**fields) -> dict:
    config = ModelConfig(hidden=HIDDEN, num_layers=2, num_experts=8, **fields)
    _, state = init_model(config, make_mesh(("data", 2), ("seq", 4)), seed=0)
    return {"embedding": np.asarray(state["embedding"][...], np.float64),
            "head": None if config.tie_embeddings else np.asarray(state["head"][...],
                                                                  np.float64)}


def assert_std(array, expected):
    assert abs(array.std() - expected) <= 0.03 * expected, (array.std(), expected)


def test_embedding_and_head_scales():
    weights = initial_weights()
    assert_std(weights["embedding"], 1.0)               # rows of RMS ~1: the stream's start
    assert_std(weights["head"], 1 / math.sqrt(HIDDEN))  # logits of std ~1 from the final norm


def test_tied_table_is_sized_as_the_head():
    assert_std(initial_weights(tie_embeddings=True)["embedding"], 1 / math.sqrt(HIDDEN))


def test_the_scales_are_fields_of_their_own():
    weights = initial_weights(embedding_init_std=0.5, head_init_std=0.02, init_std=0.01)
    assert_std(weights["embedding"], 0.5)
    assert_std(weights["head"], 0.02)


@pytest.mark.parametrize("key", ["embedding_init_std", "head_init_std", "init_std"])
def test_a_bad_scale_names_its_key(key):
    with pytest.raises(ConfigError, match=f"^model.{key}: expected a finite non-negative"):
        load_config("tiny", [f"model.{key}=-1.0"])


@pytest.mark.parametrize("decay", ["cosine", "constant"])
def test_warm_up_starts_above_zero(decay):
    schedule = learning_rate_schedule(
        OptimizerConfig(learning_rate=1e-3, warmup_steps=4, decay=decay), total_steps=20)
    rates = [float(schedule(step)) for step in range(6)]
    np.testing.assert_allclose(rates[:5], [2e-4, 4e-4, 6e-4, 8e-4, 1e-3], rtol=1e-6)
    assert rates[5] <= 1e-3 * (1 + 1e-6)
    no_warmup = learning_rate_schedule(OptimizerConfig(learning_rate=1e-3, warmup_steps=0), 20)
    np.testing.assert_allclose(float(no_warmup(0)), 1e-3, rtol=1e-6)
