"""The README's Python blocks run as written (on the 8 simulated devices of conftest), and what
each computes matches the plain reference."""

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from peakflat_jax import reference

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```", README.read_text(), re.S | re.M)


def run_block(source: str) -> dict:
    namespace: dict = {"__name__": "readme"}
    exec(compile(source, str(README), "exec"), namespace)  # noqa: S102 - the README's own code
    return namespace


def block_with(text: str) -> str:
    (block,) = [b for b in BLOCKS if text in b]
    return block


def test_the_readme_has_the_four_operator_blocks():
    assert len(BLOCKS) == 4
    for name in ("ring_cross_entropy_global", "pipelined_moe_global", "sco_scan",
                 "offload_stream_adamw"):
        block_with(name)


def test_ring_cross_entropy_block():
    ns = run_block(block_with("ring_cross_entropy_global"))
    hidden, kernel, targets = (np.asarray(ns[k], np.float64) for k in ("hidden", "kernel",
                                                                       "targets"))
    logits = hidden @ kernel
    logits -= logits.max(-1, keepdims=True)
    log_z = np.log(np.exp(logits).sum(-1))
    valid = targets != -100
    ids = np.where(valid, targets, 0).astype(int)
    expected = np.sum(np.where(valid, log_z - logits[np.arange(len(ids)), ids], 0)) / valid.sum()
    np.testing.assert_allclose(float(ns["loss"]), expected, rtol=1e-5)


def test_pipelined_moe_block():
    ns = run_block(block_with("pipelined_moe_global"))
    expected = reference.mixture_of_experts(*(ns[k] for k in (
        "x", "expert_ids", "gates", "w_gate", "w_up", "w_down")))
    np.testing.assert_allclose(np.asarray(ns["y"]), np.asarray(expected), rtol=1e-5, atol=1e-5)


def test_sco_scan_block():
    ns = run_block(block_with("sco_scan"))
    h = jax.random.normal(jax.random.key(0), (128, 64))
    expected, _ = jax.lax.scan(lambda c, w: (ns["layer_fn"](c, w), None), h,
                               ns["stacked_params"])
    np.testing.assert_allclose(np.asarray(ns["carry"]), np.asarray(expected), rtol=1e-5,
                               atol=1e-5)


def test_offload_stream_block():
    ns = run_block(block_with("offload_stream_adamw"))
    master = {"w": jnp.ones((64, 32)), "b": jnp.zeros((32,))}
    adamw = optax.adamw(ns["schedule"], weight_decay=0.1, mu_dtype=jnp.float32)
    updates, _ = adamw.update(jax.tree.map(jnp.ones_like, master), adamw.init(master), master)
    expected = optax.apply_updates(master, updates)
    ours = ns["opt"].master_params(ns["state"])
    for key in master:
        np.testing.assert_allclose(np.asarray(ours[key]), np.asarray(expected[key]), rtol=1e-6)
    assert ns["params"]["w"].dtype == jnp.bfloat16


def test_global_forms_refuse_out_of_range_targets_and_ids():
    ns = run_block(block_with("ring_cross_entropy_global"))
    pf, mesh = ns["pf"], ns["mesh"]
    with pytest.raises(ValueError, match=r"^targets: expected ids in \[0, vocab_size = 260\)"):
        pf.ring_cross_entropy_global(ns["hidden"], ns["kernel"], ns["targets"].at[5].set(-1),
                                     mesh=mesh, axis_name=("data", "seq"), reduction="mean")
    with pytest.raises(ValueError, match=r"^hidden: expected the tokens .* multiple of P = 8"):
        pf.ring_cross_entropy_global(ns["hidden"][:60], ns["kernel"], ns["targets"][:60],
                                     mesh=mesh, axis_name=("data", "seq"))
    with pytest.raises(ValueError, match=r"^axis_name: 'model' is not an axis"):
        pf.ring_cross_entropy_global(ns["hidden"], ns["kernel"], ns["targets"], mesh=mesh,
                                     axis_name="model")
    with pytest.raises(ValueError, match=r"^mesh: expected a jax.sharding.Mesh"):
        pf.ring_cross_entropy_global(ns["hidden"], ns["kernel"], ns["targets"],
                                     axis_name="data")


@pytest.mark.parametrize("axis_types", ["auto", "explicit", "mixed"])
@pytest.mark.parametrize("loss", ["ring", "materialized"])
def test_the_loss_forms_take_either_axis_type_and_pad_the_vocab(axis_types, loss):
    """V = 997 columns on 8 devices (padded to 1,000 inside), values and gradients, under jit
    and eagerly."""
    from jax.sharding import AxisType

    import peakflat_jax as pf

    kinds = {"auto": (AxisType.Auto,) * 2, "explicit": (AxisType.Explicit,) * 2,
             "mixed": (AxisType.Explicit, AxisType.Auto)}[axis_types]
    mesh = jax.make_mesh((2, 4), ("data", "seq"), axis_types=kinds)
    t, h, v = 32, 16, 997
    keys = jax.random.split(jax.random.key(1), 3)
    hidden = jax.random.normal(keys[0], (t, h))
    kernel = jax.random.normal(keys[1], (h, v)) / 4
    targets = jax.random.randint(keys[2], (t,), 0, v).at[3].set(-100)
    form = pf.ring_cross_entropy_global if loss == "ring" else (
        pf.materialized_cross_entropy_global)

    def mean_loss(hidden, kernel):
        return form(hidden, kernel, targets, mesh=mesh, axis_name=("data", "seq"),
                    reduction="mean")

    def expected_loss(hidden, kernel):
        losses = optax.softmax_cross_entropy_with_integer_labels(
            hidden @ kernel, jnp.maximum(targets, 0))
        return jnp.sum(jnp.where(targets >= 0, losses, 0)) / jnp.sum(targets >= 0)

    value, grads = jax.jit(jax.value_and_grad(mean_loss, argnums=(0, 1)))(hidden, kernel)
    expected, expected_grads = jax.value_and_grad(expected_loss, argnums=(0, 1))(hidden, kernel)
    np.testing.assert_allclose(float(value), float(expected), rtol=1e-5)
    assert grads[1].shape == (h, v)
    for ours, theirs in zip(grads, expected_grads):
        np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), rtol=1e-4, atol=1e-6)
    eager = mean_loss(hidden, kernel)  # outside jit: the same program
    np.testing.assert_allclose(float(eager), float(expected), rtol=1e-5)


def quoted_commands() -> list[tuple[list[str], list[str]]]:
    """The README's ``console`` blocks: each ``$ peakflat ...`` command with the lines quoted
    after it (its output's first lines)."""
    quoted = []
    for block in re.findall(r"^```console\n(.*?)^```", README.read_text(), re.S | re.M):
        for chunk in re.split(r"^\$ ", block, flags=re.M)[1:]:
            command, *output = chunk.rstrip("\n").split("\n")
            quoted.append((command.split(), output))
    return quoted


def test_the_readme_quotes_what_peakflat_plan_prints(capsys):
    """Every ``peakflat plan`` figure the README quotes is what the tool prints at this commit."""
    from peakflat_jax import cli

    commands = quoted_commands()
    assert commands, "the README quotes no peakflat command"
    for words, output in commands:
        assert words[:2] == ["peakflat", "plan"], words
        assert cli.main(words[1:]) == 0
        printed = capsys.readouterr().out.splitlines()
        assert printed[:len(output)] == output, (words, printed[:len(output)])
