"""Hugging Face checkpoints in and out (peakflat_jax.hf): tiny random Mixtral and Qwen3-MoE
models made by transformers (in .venv-torch, scripts/xcheck_torch_env.sh), imported with
``model.from_pretrained``: our logits and loss equal transformers' (fp32, operators on and off);
exported back, transformers loads the same family with the same logits; bad checkpoints are
refused naming the tensor or the config.json field."""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from peakflat_jax import mesh as mop
from peakflat_jax.config import ConfigError, load_config
from peakflat_jax.hf.export import export_pretrained
from peakflat_jax.hf.load import CheckpointError
from peakflat_jax.model.decoder import IGNORE
from peakflat_jax.model.sharding import init_model
from peakflat_jax.train.trainer import boundary_offload, runtime_for

REPO = pathlib.Path(__file__).resolve().parents[1]
TORCH_REFERENCE = REPO / "peakflat_jax" / "hf" / "torch_reference.py"
BATCH, LENGTH, VOCAB = 2, 16, 300
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=8, num_key_value_heads=4,
              num_experts_per_tok=2, rms_norm_eps=1e-5)
# Each family, and Qwen3-MoE's other branches: a dense first layer and renormalized gates in
# one, tied embeddings, linear RoPE scaling and unrenormalized gates in the other.
MODELS = {
    "mixtral": dict(family="mixtral", seed=1, config=dict(
        COMMON, num_hidden_layers=2, intermediate_size=32, num_local_experts=8,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    "qwen3_moe": dict(family="qwen3_moe", seed=2, config=dict(
        COMMON, num_hidden_layers=3, head_dim=16, intermediate_size=48,
        moe_intermediate_size=32, num_experts=8, norm_topk_prob=True, mlp_only_layers=[0])),
    "qwen3_moe_tied": dict(family="qwen3_moe", seed=3, config=dict(
        COMMON, num_hidden_layers=2, head_dim=8, moe_intermediate_size=32, num_experts=8,
        norm_topk_prob=False, tie_word_embeddings=True,
        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})),
}
# Operators on: PipelinedLLEP in several chunks, the ring loss, every boundary offloaded, the
# streamed optimizer; off: plain EP, materialized, none offloaded, optax on the device. Forced:
# left to the planner (``auto``, the default), they would be whatever fits the CPU's memory.
OPERATORS = {"on": ["operators.moe_dispatch=pipelined", "operators.token_budget=2",
                    "operators.loss=ring", "operators.offload=all",
                    "operators.optimizer_offload=true"],
             "off": ["operators.moe_dispatch=ep", "operators.loss=materialized",
                     "operators.offload=none", "operators.optimizer_offload=false"]}


def run_torch(python: str, jobs: list[dict], directory: pathlib.Path) -> None:
    path = directory / "jobs.json"
    path.write_text(json.dumps(jobs))
    completed = subprocess.run([python, str(TORCH_REFERENCE), str(path)], capture_output=True,
                               text=True, timeout=600)
    assert completed.returncode == 0, completed.stderr[-4000:]


@pytest.fixture(scope="module")
def references(torch_python, tmp_path_factory) -> dict:
    """{name: (checkpoint dir, transformers' outputs)} for MODELS, made in one torch call."""
    root = tmp_path_factory.mktemp("hf")
    tokens = np.random.default_rng(0).integers(0, VOCAB, (BATCH, LENGTH)).astype(np.int32)
    np.save(root / "tokens.npy", tokens)
    jobs = [dict(dir=str(root / name), make=dict(spec, init_std=0.1),
                 tokens=str(root / "tokens.npy"), out=str(root / f"{name}.npz"))
            for name, spec in MODELS.items()]
    run_torch(torch_python, jobs, root)
    return {"root": root, "tokens": tokens,
            **{name: (root / name, dict(np.load(root / f"{name}.npz"))) for name in MODELS}}


def config_for(directory, tmp_path, overrides=()):
    """A run config with nothing but the checkpoint for a model section (no architecture)."""
    path = tmp_path / "run.yaml"
    path.write_text(f"model:\n  from_pretrained: {directory}\nmesh:\n  data: 2\n  seq: 4\n"
                    f"data:\n  source: synthetic\n  seq_len: {LENGTH}\n  batch_size: {BATCH}\n")
    return load_config(path, list(overrides))


def batch_of(tokens: np.ndarray) -> dict:
    targets = np.concatenate([tokens[:, 1:], np.full((BATCH, 1), IGNORE)], axis=1)
    return {"tokens": jnp.asarray(tokens), "targets": jnp.asarray(targets, jnp.int32),
            "positions": jnp.broadcast_to(jnp.arange(LENGTH, dtype=jnp.int32), tokens.shape),
            "segment_ids": jnp.ones(tokens.shape, jnp.int32)}


def forward(config, tokens):
    """(logits [B, T, V], mean loss) of our model of ``config`` on ``tokens``."""
    mesh = mop.make_mesh(config.mesh)
    graphdef, state = init_model(config.model, mesh, seed=0)
    run = runtime_for(config, mesh)
    offload = boundary_offload(config, mesh)
    batch = batch_of(tokens)

    @jax.jit
    def both(state):
        model = nnx.merge(graphdef, state)
        return model.logits(batch, run, offload), model(batch, run, offload)[0]

    logits, loss = both(state)
    return np.asarray(logits), float(loss), (graphdef, state)


def relative(ours, theirs) -> float:
    return float(np.max(np.abs(ours - theirs)) / np.max(np.abs(theirs)))


@pytest.mark.parametrize("operators", ["on", "off"])
@pytest.mark.parametrize("name", list(MODELS))
def test_imported_logits_and_loss_equal_transformers(references, tmp_path, name, operators):
    directory, theirs = references[name]
    config = config_for(directory, tmp_path, OPERATORS[operators])
    assert config.model.qk_norm == (MODELS[name]["family"] == "qwen3_moe")
    logits, loss, (_, state) = forward(config, references["tokens"])
    assert logits.shape == theirs["logits"].shape
    assert relative(logits, theirs["logits"]) < 1e-5
    assert abs(loss - float(theirs["loss"])) < 1e-5 * abs(float(theirs["loss"]))
    # Every device holds its shard only: the experts split E over the 8 devices.
    experts = state["moe_layers"]["moe"]["w_gate"][...]
    assert {shard.data.shape[1] for shard in experts.addressable_shards} == {1}


def test_export_loads_in_transformers_as_the_same_family(references, torch_python, tmp_path):
    jobs = []
    for name in MODELS:
        directory, _ = references[name]
        config = config_for(directory, tmp_path)
        mesh = mop.make_mesh(config.mesh)
        _, state = init_model(config.model, mesh, seed=0)
        # One in shards of at most 128 KiB (an index and several files), as large ones are.
        shard = 2**17 if name == "qwen3_moe" else 5 * 2**30
        out = export_pretrained(config.model, state, tmp_path / f"export_{name}",
                                max_shard_bytes=shard)
        jobs.append(dict(dir=str(out), tokens=str(references["root"] / "tokens.npy"),
                         out=str(tmp_path / f"{name}.npz")))
    run_torch(torch_python, jobs, tmp_path)
    for name in MODELS:
        _, theirs = references[name]
        again = np.load(tmp_path / f"{name}.npz")
        assert str(again["model_type"]) == MODELS[name]["family"]
        assert relative(again["logits"], theirs["logits"]) < 1e-6
        exported = json.loads((tmp_path / f"export_{name}" / "config.json").read_text())
        assert exported["model_type"] == MODELS[name]["family"]
        assert (tmp_path / f"export_{name}" / "generation_config.json").is_file()  # copied
    sharded = tmp_path / "export_qwen3_moe"
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == len(list(sharded.glob("*.safetensors"))) > 2
    _, again = load_in(sharded, tmp_path)  # our import reads the shards back bit for bit
    _, first = load_in(references["qwen3_moe"][0], tmp_path)
    assert all(np.array_equal(a, b) for a, b in zip(leaves_of(again).values(),
                                                     leaves_of(first).values()))


# -- refusals ------------------------------------------------------------------------------------


def edited_copy(references, tmp_path, name, *, config_edit=None, tensors_edit=None):
    """A copy of checkpoint ``name`` with its config.json or tensors changed."""
    from safetensors.numpy import load_file, save_file

    source, _ = references[name]
    target = tmp_path / f"edited_{name}"
    shutil.copytree(source, target)
    if config_edit is not None:
        hf = json.loads((target / "config.json").read_text())
        config_edit(hf)
        (target / "config.json").write_text(json.dumps(hf))
    if tensors_edit is not None:
        tensors = load_file(target / "model.safetensors")
        tensors_edit(tensors)
        save_file(tensors, target / "model.safetensors")
    return target


def load_in(directory, tmp_path):
    config = config_for(directory, tmp_path)
    return init_model(config.model, mop.make_mesh(config.mesh), seed=0)


def test_missing_tensor_is_refused_by_name(references, tmp_path):
    name = "model.layers.1.block_sparse_moe.experts.5.w3.weight"
    directory = edited_copy(references, tmp_path, "mixtral",
                            tensors_edit=lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=rf"^{name}: missing"):
        load_in(directory, tmp_path)


def test_shape_mismatch_is_refused_by_name(references, tmp_path):
    name = "model.layers.0.self_attn.k_norm.weight"
    directory = edited_copy(references, tmp_path, "qwen3_moe",
                            tensors_edit=lambda t: t.update({name: t[name][:8]}))
    with pytest.raises(CheckpointError, match=rf"^{name}: shape \(8,\) in the checkpoint, "
                                              rf"expected \(16,\)"):
        load_in(directory, tmp_path)


def test_unused_tensor_is_refused_by_name(references, tmp_path):
    name = "model.layers.0.self_attn.q_proj.bias"
    directory = edited_copy(references, tmp_path, "mixtral", tensors_edit=lambda t: t.update(
        {name: np.zeros(64, np.float32)}))
    with pytest.raises(CheckpointError, match=rf"^{name}: a checkpoint tensor that no weight"):
        load_in(directory, tmp_path)


@pytest.mark.parametrize("field, edit", [
    ("rope_parameters.rope_type",
     lambda hf: hf.update(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4,
                                           "factor": 4.0})),
    ("attention_bias", lambda hf: hf.update(attention_bias=True)),
    ("sliding_window", lambda hf: hf.update(use_sliding_window=True, sliding_window=8)),
    ("hidden_act", lambda hf: hf.update(hidden_act="gelu")),
    ("mlp_only_layers", lambda hf: hf.update(mlp_only_layers=[1])),
])
def test_unsupported_feature_is_refused_naming_the_field(references, tmp_path, field, edit):
    directory = edited_copy(references, tmp_path, "qwen3_moe", config_edit=edit)
    with pytest.raises(ConfigError, match=rf"^config.json {field}: .* is not supported"):
        config_for(directory, tmp_path)


def test_conflicting_fields_are_refused(references, tmp_path):
    directory, _ = references["mixtral"]
    with pytest.raises(ConfigError, match=r"^model.num_layers: 3 differs from 2"):
        config_for(directory, tmp_path, ["model.num_layers=3"])
    with pytest.raises(ConfigError, match=r"^model.qk_norm: False differs from True"):
        config_for(references["qwen3_moe"][0], tmp_path, ["model.qk_norm=false"])  # a default
    assert config_for(directory, tmp_path, ["model.num_layers=2"]).model.num_layers == 2
    with pytest.raises(ConfigError, match=r"^model.router_bias_rate: expected 0"):
        config_for(directory, tmp_path, ["model.router_bias_rate=0.001"])


@pytest.mark.slow
def test_fine_tune_then_export_hf(references, torch_python, tmp_path):
    """Import, train two steps, ``peakflat export-hf RUN_DIR OUT_DIR``: transformers loads the
    trained weights, whose logits equal ours of the same checkpoint imported again (and differ
    from the untrained model's: the steps moved the weights)."""
    from peakflat_jax import cli
    from peakflat_jax.train.trainer import Trainer

    directory, untrained = references["mixtral"]
    config = config_for(directory, tmp_path, ["train.steps=2", "optimizer.warmup_steps=0",
                                              "optimizer.learning_rate=1e-2"])
    Trainer(config, run_dir=str(tmp_path / "run")).run(progress=False)
    assert cli.main(["export-hf", str(tmp_path / "run"), str(tmp_path / "out")]) == 0
    run_torch(torch_python, [dict(dir=str(tmp_path / "out"), tokens=str(references["root"] /
                                                                        "tokens.npy"),
                                  out=str(tmp_path / "trained.npz"))], tmp_path)
    theirs = np.load(tmp_path / "trained.npz")
    ours, loss, _ = forward(config_for(tmp_path / "out", tmp_path, OPERATORS["off"]),
                           references["tokens"])
    assert relative(ours, theirs["logits"]) < 1e-5
    assert abs(loss - float(theirs["loss"])) < 1e-5 * abs(float(theirs["loss"]))
    assert relative(theirs["logits"], untrained["logits"]) > 1e-3


def test_export_hf_refuses_a_directory_without_a_run(tmp_path, capsys):
    from peakflat_jax import cli

    assert cli.main(["export-hf", str(tmp_path), str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.startswith("peakflat export-hf: RUN_DIR: no config.json")


def leaves_of(state) -> dict:
    return {jax.tree_util.keystr(path): np.asarray(leaf, np.float32)
            for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]}


def test_each_expert_tensor_is_read_once_by_its_device(references, tmp_path, monkeypatch):
    """The experts split over the 8 devices: each expert's tensor is read by the one shard that
    holds it, once (a shard's callback reads its own layers and experts only)."""
    from peakflat_jax.hf import load

    reads: list[str] = []
    original = load.SafetensorsCheckpoint.tensor
    monkeypatch.setattr(load.SafetensorsCheckpoint, "tensor",
                        lambda self, name, shape: reads.append(name) or original(self, name,
                                                                                 shape))
    directory, _ = references["mixtral"]
    load_in(directory, tmp_path)
    experts = [name for name in reads if ".experts." in name]
    assert len(experts) == len(set(experts)) == 2 * 8 * 3  # layers x experts x (w1, w3, w2)


def test_bfloat16_checkpoint_in_and_out(references, tmp_path):
    """A bf16 checkpoint (safetensors' numpy side has no bfloat16: read through its header)
    loads as its values; a bf16 model exports BF16 tensors that load back bit for bit."""
    import ml_dtypes

    def to_bf16(tensors):
        for name in tensors:
            tensors[name] = tensors[name].astype(ml_dtypes.bfloat16)

    directory, _ = references["qwen3_moe"]
    bf16_dir = edited_copy(references, tmp_path, "qwen3_moe", tensors_edit=to_bf16)
    _, fp32_state = load_in(directory, tmp_path)
    _, from_bf16 = load_in(bf16_dir, tmp_path)
    rounded = {k: v.astype(ml_dtypes.bfloat16).astype(np.float32)
               for k, v in leaves_of(fp32_state).items()}
    assert rounded.keys() == leaves_of(from_bf16).keys()
    for key, value in leaves_of(from_bf16).items():
        np.testing.assert_array_equal(value, rounded[key], err_msg=key)
    config = config_for(bf16_dir, tmp_path, ["model.dtype=bfloat16"])
    _, state = init_model(config.model, mop.make_mesh(config.mesh), seed=0)
    out = export_pretrained(config.model, state, tmp_path / "bf16_out")
    with open(out / "model.safetensors", "rb") as file:
        header = json.loads(file.read(int.from_bytes(file.read(8), "little")))
    assert {entry["dtype"] for key, entry in header.items() if key != "__metadata__"} == {"BF16"}
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    _, again = load_in(out, tmp_path)
    for key, value in leaves_of(again).items():
        np.testing.assert_array_equal(value, rounded[key], err_msg=key)
