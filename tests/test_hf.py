"""Hugging Face checkpoints in and out (peakflat_jax.hf): tiny random Mixtral, Qwen3-MoE and
gpt-oss models made by transformers (in .venv-torch, scripts/xcheck_torch_env.sh), imported with
``model.from_pretrained``: our logits and loss equal transformers' (fp32, operators on and off),
one training step's loss and every gradient equal torch.autograd's; exported back, transformers
loads the same family with the same logits; gpt-oss's MXFP4 experts are read as transformers
dequantizes them; bad checkpoints are refused naming the tensor or the config.json field."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import stat
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from peakflat_jax import mesh as mop
from peakflat_jax.config import ConfigError
from peakflat_jax.hf.config import load_config
from peakflat_jax.hf.export import export_pretrained
from peakflat_jax.hf.load import CheckpointError, init_or_load
from peakflat_jax.model.decoder import IGNORE
from peakflat_jax.train.trainer import boundary_offload, runtime_for

REPO = pathlib.Path(__file__).resolve().parents[1]
TORCH_REFERENCE = REPO / "peakflat_jax" / "hf" / "torch_reference.py"
BATCH, LENGTH, VOCAB = 2, 16, 300
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=8, num_key_value_heads=4,
              num_experts_per_tok=2, rms_norm_eps=1e-5)
# Each family, and Qwen3-MoE's other branches: a dense first layer, renormalized gates and YaRN
# RoPE (its ramp's ends truncated, transformers' default) in one, tied embeddings, linear RoPE
# scaling and unrenormalized gates in the other.
MODELS = {
    "mixtral": dict(family="mixtral", seed=1, config=dict(
        COMMON, num_hidden_layers=2, intermediate_size=32, num_local_experts=8,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    "qwen3_moe": dict(family="qwen3_moe", seed=2, config=dict(
        COMMON, num_hidden_layers=3, head_dim=16, intermediate_size=48,
        moe_intermediate_size=32, num_experts=8, norm_topk_prob=True, mlp_only_layers=[0],
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 256})),
    "qwen3_moe_tied": dict(family="qwen3_moe", seed=3, config=dict(
        COMMON, num_hidden_layers=2, head_dim=8, moe_intermediate_size=32, num_experts=8,
        norm_topk_prob=False, tie_word_embeddings=True,
        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})),
    # gpt-oss: sinks, q/k/v/o and expert biases, the router's bias, YaRN RoPE (transformers'
    # gpt-oss default: factor 32 over 4,096, no truncation), sliding-window layers 0 and 2 of
    # 3 (a window of 5 of the 16 tokens), the clamped SwiGLU with a limit that binds.
    "gpt_oss": dict(family="gpt_oss", seed=4, config=dict(
        COMMON, num_hidden_layers=3, head_dim=16, intermediate_size=32, num_local_experts=8,
        sliding_window=5, swiglu_limit=1.0)),
}
# gpt-oss as its official checkpoints store it: the experts in MXFP4 (random codes and scales;
# transformers dequantizes them on load).
MXFP4 = dict(MODELS["gpt_oss"], seed=5, mxfp4=True)
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
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, VOCAB, (BATCH, LENGTH)).astype(np.int32)
    labels = tokens.copy()  # a training step's labels: some ignored, as padding would be
    labels[0, 5:8] = labels[1, 11] = IGNORE
    np.save(root / "tokens.npy", tokens)
    np.save(root / "labels.npy", labels)
    jobs = [dict(dir=str(root / name), make=dict(spec, init_std=0.1),
                 tokens=str(root / "tokens.npy"), out=str(root / f"{name}.npz"),
                 labels=str(root / "labels.npy"), grads_dir=str(root / f"{name}_grads"))
            for name, spec in MODELS.items()]
    jobs.append(dict(dir=str(root / "mxfp4"), make=dict(MXFP4, init_std=0.1),
                     tokens=str(root / "tokens.npy"), out=str(root / "mxfp4.npz")))
    run_torch(torch_python, jobs, root)
    return {"root": root, "tokens": tokens, "labels": labels,
            **{name: (root / name, dict(np.load(root / f"{name}.npz")))
               for name in (*MODELS, "mxfp4")}}


def config_for(directory, tmp_path, overrides=()):
    """A run config with nothing but the checkpoint for a model section (no architecture)."""
    path = tmp_path / "run.yaml"
    path.write_text(f"model:\n  from_pretrained: {directory}\nmesh:\n  data: 2\n  seq: 4\n"
                    f"data:\n  source: synthetic\n  seq_len: {LENGTH}\n  batch_size: {BATCH}\n")
    return load_config(path, list(overrides))


def batch_of(tokens: np.ndarray, labels: np.ndarray | None = None) -> dict:
    """Our batch of ``tokens``: each position's target is the next position's label (the
    tokens themselves by default), the last predicts nothing (transformers' shift)."""
    labels = tokens if labels is None else labels
    targets = np.concatenate([labels[:, 1:], np.full((BATCH, 1), IGNORE)], axis=1)
    return {"tokens": jnp.asarray(tokens), "targets": jnp.asarray(targets, jnp.int32),
            "positions": jnp.broadcast_to(jnp.arange(LENGTH, dtype=jnp.int32), tokens.shape),
            "segment_ids": jnp.ones(tokens.shape, jnp.int32)}


def forward(config, tokens):
    """(logits [B, T, V], mean loss) of our model of ``config`` on ``tokens``."""
    mesh = mop.make_mesh(config.mesh)
    graphdef, state = init_or_load(config.model, mesh, seed=0)
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


def test_mxfp4_experts_are_read_as_transformers_dequantizes_them(references, tmp_path):
    """A gpt-oss checkpoint with MXFP4 experts (``{name}_blocks``, ``{name}_scales``): our
    logits equal those of transformers' dequantized model; exported, the experts are written
    unquantized (and config.json without the quantization), which reads back bit for bit."""
    directory, theirs = references["mxfp4"]
    assert any(directory.glob("*.safetensors"))
    config = config_for(directory, tmp_path, OPERATORS["off"])
    logits, _, (_, state) = forward(config, references["tokens"])
    assert relative(logits, theirs["logits"]) < 1e-5
    out = export_pretrained(config.model, state, tmp_path / "unpacked")
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    _, again = load_in(out, tmp_path)
    assert all(np.array_equal(a, b) for a, b in zip(leaves_of(again).values(),
                                                     leaves_of(state).values()))


def step_gradients(config, tokens, labels, run_dir):
    """(loss, gradients) of one training step from the trainer's compiled gradient program, at
    the imported weights, on ``tokens`` with ``labels`` (``batch_of``)."""
    from peakflat_jax.train.trainer import Trainer

    trainer = Trainer(config, run_dir=str(run_dir))
    state = trainer.initial_state()
    batch = trainer.global_batch({k: np.asarray(v) for k, v in batch_of(tokens, labels).items()})
    metrics, grads, _ = trainer.gradient_program(state, batch)(state.params, state.extras, batch)
    return float(metrics["loss"]), grads


def write_step_gradients(jobs_file: str) -> None:
    """Each job's (``steps``) loss and gradients in the checkpoint's names (the exporter's
    rules, ``checkpoint_tensors``), and the gradients of the vocab padding, to its .npz."""
    from peakflat_jax.hf.export import checkpoint_tensors

    for job in json.loads(pathlib.Path(jobs_file).read_text()):
        run_dir = pathlib.Path(job["run_dir"])
        run_dir.mkdir(parents=True, exist_ok=True)
        config = config_for(job["dir"], run_dir, job["overrides"])
        loss, grads = step_gradients(config, np.load(job["tokens"]), np.load(job["labels"]),
                                     run_dir / "run")
        padding = [np.asarray(grads["embedding"][...])[VOCAB:]]
        if not config.model.tie_embeddings:
            padding.append(np.asarray(grads["head"][...])[:, VOCAB:])
        np.savez(job["out"], loss=loss, padding=np.concatenate([p.ravel() for p in padding]),
                 **dict(checkpoint_tensors(config.model, grads)))


@pytest.fixture(scope="module")
def steps(references, tmp_path_factory) -> dict:
    """{(name, operators): our step's .npz} for MODELS, operators on and off, computed in one
    child process with XLA:CPU's concurrency-optimized scheduler off, as ``peakflat`` runs
    (``cli.CPU_SCHEDULER_FLAG``): with it on, this program with the operators on gave wrong
    gradients on some calls (docs/hf.md); the flag is read once per process, and the suite's
    own operator memory tests hold XLA's plans under the default one."""
    import os
    import sys

    from peakflat_jax.cli import CPU_SCHEDULER_FLAG

    root = tmp_path_factory.mktemp("steps")
    jobs = [dict(dir=str(references[name][0]), overrides=OPERATORS[operators],
                 tokens=str(references["root"] / "tokens.npy"),
                 labels=str(references["root"] / "labels.npy"),
                 run_dir=str(root / f"{name}-{operators}"),
                 out=str(root / f"{name}-{operators}.npz"))
            for name in MODELS for operators in OPERATORS]
    (root / "jobs.json").write_text(json.dumps(jobs))
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO),
           "XLA_FLAGS": f"--xla_force_host_platform_device_count=8 {CPU_SCHEDULER_FLAG}"}
    completed = subprocess.run([sys.executable, __file__, str(root / "jobs.json")], env=env,
                               cwd=str(REPO), capture_output=True, text=True, timeout=1200)
    assert completed.returncode == 0, completed.stderr[-4000:]
    return {(name, operators): dict(np.load(root / f"{name}-{operators}.npz"))
            for name in MODELS for operators in OPERATORS}


@pytest.mark.parametrize("operators", ["on", "off"])
@pytest.mark.parametrize("name", list(MODELS))
def test_step_loss_and_gradients_equal_torch_autograd(references, steps, name, operators):
    """One training step (the trainer's gradient program): the mean next-token loss with
    ignored labels equals ``cross_entropy`` of transformers' logits (and its own ``labels=``
    loss: the shift and the ignore index are the same convention), and every weight's gradient
    equals ``torch.autograd``'s, ours reached through the exporter's rules (the router's
    included: the top-k choice is discrete, the gates are not)."""
    from peakflat_jax.hf.load import SafetensorsCheckpoint

    _, theirs = references[name]
    ours = dict(steps[(name, operators)])
    step_loss = float(theirs["step_loss"])
    assert abs(float(theirs["labels_loss"]) - step_loss) <= 1e-6 * step_loss
    assert abs(float(ours.pop("loss")) - step_loss) <= 1e-5 * step_loss
    assert not np.any(ours.pop("padding"))  # the vocab padding gets no gradient
    torch_grads = SafetensorsCheckpoint(references["root"] / f"{name}_grads")
    assert sorted(ours) == sorted(torch_grads.files)
    for tensor_name, grad in ours.items():
        theirs_grad = torch_grads.tensor(tensor_name, grad.shape)
        # Relative to the tensor's largest entry; an expert no token chose gets exactly none.
        error = float(np.max(np.abs(grad - theirs_grad)))
        assert error <= 1e-4 * float(np.max(np.abs(theirs_grad))), (tensor_name, error)


def test_export_loads_in_transformers_as_the_same_family(references, torch_python, tmp_path):
    jobs = []
    for name in MODELS:
        directory, _ = references[name]
        config = config_for(directory, tmp_path)
        mesh = mop.make_mesh(config.mesh)
        _, state = init_or_load(config.model, mesh, seed=0)
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
        umask = os.umask(0)
        os.umask(umask)
        for file in (tmp_path / f"export_{name}").iterdir():  # as any file is written
            assert stat.S_IMODE(file.stat().st_mode) == 0o666 & ~umask, file
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
    return init_or_load(config.model, mop.make_mesh(config.mesh), seed=0)


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


@pytest.mark.parametrize("name, field, edit", [
    ("qwen3_moe", "rope_parameters.rope_type",
     lambda hf: hf.update(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4,
                                           "factor": 4.0})),
    ("qwen3_moe", "rope_parameters.mscale",
     lambda hf: hf["rope_parameters"].update(mscale=1.0, mscale_all_dim=1.0)),
    ("qwen3_moe", "attention_bias", lambda hf: hf.update(attention_bias=True)),
    ("qwen3_moe", "sliding_window",
     lambda hf: hf.update(use_sliding_window=True, sliding_window=8)),
    ("qwen3_moe", "hidden_act", lambda hf: hf.update(hidden_act="gelu")),
    ("qwen3_moe", "mlp_only_layers", lambda hf: hf.update(mlp_only_layers=[1])),
    ("gpt_oss", "layer_types", lambda hf: hf.update(
        layer_types=["full_attention", "sliding_attention", "full_attention"])),
    ("gpt_oss", "quantization_config.quant_method",
     lambda hf: hf.update(quantization_config={"quant_method": "fp8"})),
])
def test_unsupported_feature_is_refused_naming_the_field(references, tmp_path, name, field,
                                                         edit):
    directory = edited_copy(references, tmp_path, name, config_edit=edit)
    with pytest.raises(ConfigError, match=rf"^config.json {field}: .* is not supported"):
        config_for(directory, tmp_path)


@pytest.mark.parametrize("fields, message", [
    (dict(attention_sinks=True), r"^model.router_logit_bias: False has no gpt_oss equivalent"),
    (dict(attention_bias=True), r"^model.attention_bias: True has no mixtral equivalent"),
    (dict(sliding_window=8, qk_norm=True), r"^model.sliding_window: 8 has no qwen3_moe"),
])
def test_export_refuses_what_the_family_cannot_express(fields, message):
    """A model with some of gpt-oss's fields but not all is no gpt-oss model; gpt-oss's fields
    have no place in Mixtral or Qwen3-MoE."""
    from peakflat_jax.config import ModelConfig
    from peakflat_jax.hf.config import family_of

    with pytest.raises(ConfigError, match=message):
        family_of(ModelConfig(**fields))


def hf_dict(name: str, **fields) -> dict:
    """The config.json of MODELS[name] (as transformers writes it, near enough) with
    ``fields``."""
    return dict(MODELS[name]["config"], model_type=MODELS[name]["family"], **fields)


def test_a_mixtral_window_no_shorter_than_the_context_is_accepted():
    """A Mixtral sliding window at least as long as the run's sequences changes nothing
    there: accepted; a shorter one is refused naming sliding_window and the context."""
    from peakflat_jax.hf.config import model_config_from_hf

    for window in (LENGTH, 4096):
        model = model_config_from_hf(hf_dict("mixtral", sliding_window=window), context=LENGTH)
        assert model.sliding_window == 0
    with pytest.raises(ConfigError, match=rf"^config.json sliding_window: 8 is not supported "
                                          rf"\(a Mixtral window shorter than the context "
                                          rf"\(data.seq_len = {LENGTH}\)"):
        model_config_from_hf(hf_dict("mixtral", sliding_window=8), context=LENGTH)


def test_dense_layers_placed_elsewhere_are_refused_naming_the_field_that_places_them():
    from peakflat_jax.hf.config import model_config_from_hf

    with pytest.raises(ConfigError, match=r"^config.json decoder_sparse_step: 2 is not "):
        model_config_from_hf(hf_dict("qwen3_moe", mlp_only_layers=[], decoder_sparse_step=2))
    with pytest.raises(ConfigError, match=r"^config.json mlp_only_layers: \[1\] is not "):
        model_config_from_hf(hf_dict("qwen3_moe", mlp_only_layers=[1]))


def test_exporting_a_default_tiny_run_names_every_field_it_needs():
    """tiny's dense first layer and its moving balancing bias have no Mixtral equivalent: one
    line names both and what to train with (checked before anything is restored)."""
    from peakflat_jax.hf.export import check_exportable

    with pytest.raises(ConfigError) as refused:
        check_exportable(load_config("tiny").model)
    message = str(refused.value)
    assert "\n" not in message and message.startswith("model.num_dense_layers: 1 has no mixtral")
    assert "model.router_bias_rate: 0.001" in message and "model.qk_norm: true" in message
    assert message.endswith("to export, train with model.num_dense_layers=0 "
                            "model.router_bias_rate=0")
    check_exportable(load_config("tiny", ["model.num_dense_layers=0",
                                          "model.router_bias_rate=0"]).model)


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
@pytest.mark.parametrize("name, operators", [("mixtral", []), ("gpt_oss", OPERATORS["on"])],
                         ids=["mixtral", "gpt_oss-on"])
def test_fine_tune_then_export_hf(references, torch_python, tmp_path, name, operators):
    """Import, train two steps, ``peakflat export-hf RUN_DIR OUT_DIR``: transformers loads the
    trained weights, whose logits equal ours of the same checkpoint imported again (and differ
    from the untrained model's: the steps moved the weights). gpt-oss with the operators on:
    the overlapped step, whose MoE layers take their weights one layer at a time, and the
    offloaded optimizer's state of its biases and sinks."""
    from peakflat_jax import cli
    from peakflat_jax.train.trainer import Trainer

    directory, untrained = references[name]
    config = config_for(directory, tmp_path, ["train.steps=2", "optimizer.warmup_steps=0",
                                              "optimizer.learning_rate=1e-2", *operators])
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


@pytest.mark.parametrize("name", ["mixtral", "mxfp4"])
def test_each_expert_tensor_is_read_once_by_its_device(references, tmp_path, monkeypatch, name):
    """The experts split over the 8 devices: each expert's tensor is read by the one shard that
    holds it, once (a shard's callback reads its own layers and experts only). gpt-oss keeps a
    layer's experts in one tensor (here in MXFP4): each shard reads its expert's rows, once
    per weight the tensor holds (gate and up interleave in gate_up_proj)."""
    from peakflat_jax.hf import load

    reads: list[tuple] = []
    original = load.SafetensorsCheckpoint.tensor

    def tensor(self, tensor_name, shape, rows=None):
        reads.append((tensor_name, None if rows is None else (rows.start, rows.stop)))
        return original(self, tensor_name, shape, rows)

    monkeypatch.setattr(load.SafetensorsCheckpoint, "tensor", tensor)
    directory, _ = references[name]
    load_in(directory, tmp_path)
    experts = [read for read in reads if ".experts." in read[0]]
    if name == "mixtral":
        assert len(experts) == len(set(experts)) == 2 * 8 * 3  # layers x experts x (w1, w3, w2)
        return
    parts = {"gate_up_proj": 2, "gate_up_proj_bias": 2, "down_proj": 1, "down_proj_bias": 1}
    expected = sorted((f"model.layers.{layer}.mlp.experts.{tensor_name}", (e, e + 1))
                      for layer in range(3) for tensor_name, count in parts.items()
                      for e in range(8) for _ in range(count))
    assert sorted(experts) == expected


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
    _, state = init_or_load(config.model, mop.make_mesh(config.mesh), seed=0)
    out = export_pretrained(config.model, state, tmp_path / "bf16_out")
    with open(out / "model.safetensors", "rb") as file:
        header = json.loads(file.read(int.from_bytes(file.read(8), "little")))
    assert {entry["dtype"] for key, entry in header.items() if key != "__metadata__"} == {"BF16"}
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    _, again = load_in(out, tmp_path)
    for key, value in leaves_of(again).items():
        np.testing.assert_array_equal(value, rounded[key], err_msg=key)


if __name__ == "__main__":  # the child process of ``steps``
    import sys

    write_step_gradients(sys.argv[1])
