"""peakflat xcheck: the JAX export checked by the PyTorch side, run in its own Python 3.11 with
torch (scripts/xcheck_torch_env.sh); a planted difference fails naming the tensor."""

from __future__ import annotations

import ast
import json
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

from peakflat_jax import cli
from peakflat_jax.xcheck import run as xcheck_run
from peakflat_jax.xcheck.export import export

REPO = pathlib.Path(__file__).resolve().parents[1]
TORCH_SIDE = REPO / "peakflat_jax" / "xcheck" / "torch_side.py"

# A small model with every part: a dense layer and an MoE layer with a shared expert, GQA,
# packed documents; several chunks in the MoE; 8 devices (conftest).
SMALL = [
    "model.hidden=64", "model.num_layers=2", "model.num_dense_layers=1", "model.dense_ffn=64",
    "model.num_heads=8", "model.num_kv_heads=4", "model.head_dim=8", "model.expert_ffn=32",
    "data.seq_len=64", "operators.token_budget=16",
]
FP32_VARIANT = ["model.shared_expert_ffn=32"]
# The other branches of the model: tied head, sigmoid router with a routed scale, NTK RoPE.
BF16_VARIANT = ["model.tie_embeddings=true", "model.router_score=sigmoid",
                "model.routed_scale=2.5", "model.rope_scaling=ntk",
                "model.rope_scaling_factor=4.0"]
CASES = {"cross_entropy_move_weights", "cross_entropy_move_activations", "moe",
         "checkpointed_stack", "adamw", "model"}


def torch_side(python: str, directory, *args) -> subprocess.CompletedProcess:
    return subprocess.run([python, str(TORCH_SIDE), str(directory), *args],
                          capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def exported_fp32(tmp_path_factory) -> pathlib.Path:
    directory = tmp_path_factory.mktemp("xcheck_fp32")
    export(directory, config="tiny", overrides=(*SMALL, *FP32_VARIANT), dtype="float32",
           seed=1234)
    return directory


@pytest.mark.slow
def test_fp32_both_sides_agree(exported_fp32, torch_python, tmp_path):
    report_path = tmp_path / "report.json"
    completed = torch_side(torch_python, exported_fp32, "--json", str(report_path))
    assert completed.returncode == 0, completed.stdout + completed.stderr
    report = json.loads(report_path.read_text())
    assert report["passed"] and report["torch_version"].startswith("2.13.0")
    rows = {(r["case"], r["tensor"]): r for r in report["tensors"]}
    assert CASES <= {case for case, _ in rows}
    # One line per case as it finished, with the JAX export's seconds from the manifest.
    lines = [line for line in completed.stdout.splitlines() if line.startswith("xcheck ")]
    assert [line.split(":")[0] for line in lines] == [f"xcheck {c}" for c in report["seconds"]]
    assert all(": passed " in line and "jax export " in line for line in lines), lines
    assert set(report["seconds"]) == {case for case, _ in rows}
    manifest = json.loads((exported_fp32 / "manifest.json").read_text())
    for name, case in manifest["cases"].items():  # every output and gradient was compared
        compared = {e["name"] for e in case["arrays"] if e["role"] != "input"}
        assert compared == {tensor for c, tensor in rows if c == name}, name
    # fp32: the gating tolerances are the house's, and routing is exact.
    assert rows[("model", "expert_counts")]["difference"] == 0
    assert rows[("moe", "grad.w_gate")]["tolerance"] == 1e-4
    assert rows[("cross_entropy_move_weights", "grad.kernel")]["tolerance"] == 1e-5
    # The cases exercise what they claim: LLEP spilled and moved weights in several chunks,
    # the model's batch packs two documents into a row, every weight has its gradient.
    moe = manifest["cases"]["moe"]["params"]
    assert moe["spilled_slots"] > 0 and moe["migrated_expert_copies"] > 0 and moe["chunks"] > 1
    with np.load(exported_fp32 / "model.npz") as model:
        assert np.max(model["batch.segment_ids"]) > 1
        weights = {k for k in model.files if not k.startswith(("batch.", "grad.", "rope.", "loss",
                                                                "expert_counts"))}
        assert {f"grad.{w}" for w in weights if not w.endswith("router_bias")} <= set(
            model.files)
        assert "grad.layers.1.moe.shared.w_gate" in model.files
        assert np.any(model["layers.1.moe.router_bias"] != 0)


@pytest.mark.slow
def test_planted_difference_fails_naming_the_tensor(exported_fp32, torch_python, tmp_path):
    """One gradient element moved by 10x the fp32 complex tolerance (relative to the tensor's
    largest): the torch side exits 1 and names that tensor, and only it."""
    planted = tmp_path / "planted"
    shutil.copytree(exported_fp32, planted)
    name = "grad.layers.1.moe.w_up"
    with np.load(planted / "model.npz") as stored:
        arrays = dict(stored)
    value = arrays[name].copy()
    index = np.unravel_index(np.argmin(np.abs(value)), value.shape)
    value[index] += 1e-3 * np.max(np.abs(value))
    arrays[name] = value
    np.savez(planted / "model.npz", **arrays)
    completed = torch_side(torch_python, planted, "--case", "model", "--reference", "none")
    assert completed.returncode == 1, completed.stdout + completed.stderr
    failures = [line for line in completed.stdout.splitlines() if line.startswith("FAIL ")]
    assert len(failures) == 1 and f"model/{name}:" in failures[0], completed.stdout


@pytest.mark.slow
def test_bf16_both_sides_agree(torch_python, tmp_path):
    export(tmp_path, config="tiny", overrides=(*SMALL, *BF16_VARIANT), dtype="bfloat16",
           seed=99)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    entries = {e["name"]: e for e in manifest["cases"]["model"]["arrays"]}
    assert entries["grad.embedding"]["dtype"] == "bfloat16"
    assert entries["grad.embedding"]["storage"] == "uint16 bits"
    assert "head" not in entries  # tied
    completed = torch_side(torch_python, tmp_path, "--json", str(tmp_path / "report.json"))
    assert completed.returncode == 0, completed.stdout + completed.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    kinds = {(r["case"], r["tensor"]): r["kind"] for r in report["tensors"]}
    assert kinds[("adamw", "step3.master.kernel")] == "fp32"
    assert kinds[("adamw", "step3.working.kernel")] == "bf16_rounding"


COMPARE_BOTH_WAYS = """
import sys, numpy as np, torch
sys.path.insert(0, sys.argv[1])
import torch_side as ts
rng = np.random.default_rng(7)
a = rng.standard_normal(1000).astype(np.float32)
b = (a + 1e-4 * rng.standard_normal(1000)).astype(np.float32)
blocks = [(a, b), (a[:1], b[:1]), (a, np.zeros_like(b))]
bad = b.copy(); bad[3] = np.nan
blocks += [(a, bad), (np.where(a > 2, np.inf, a).astype(np.float32), b)]
for x, y in blocks:  # the torch branch (a GPU's) and the numpy branch (a CPU's)
    assert ts._block_extrema(torch.from_numpy(x), torch.from_numpy(y)) == (
        ts._block_extrema(x, y)), (x, y)
half = torch.from_numpy(a).to(torch.bfloat16)
assert ts.relative_difference(half, half.to(torch.float32)) == 0.0
print(ts.relative_difference(torch.from_numpy(a), torch.from_numpy(b)))
"""


def test_comparisons_on_a_gpu_and_a_cpu_agree(torch_python):
    """The PyTorch side compares in torch on a GPU and in numpy on a CPU: each block's extrema
    are the same float64 numbers both ways, NaN and infinities included."""
    completed = subprocess.run([torch_python, "-c", COMPARE_BOTH_WAYS, str(TORCH_SIDE.parent)],
                               capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr
    assert 0 < float(completed.stdout) < 1e-3


def test_manifest_describes_every_array(exported_fp32):
    manifest = json.loads((exported_fp32 / "manifest.json").read_text())
    assert manifest["format"] == "peakflat-xcheck/1" and manifest["seed"] == 1234
    assert manifest["dtype"] == "float32" and manifest["config"] == "tiny"
    assert manifest["jax_version"] and manifest["mesh"] == {"data": 2, "seq": 4}
    assert CASES <= set(manifest["cases"])
    for name, case in manifest["cases"].items():
        with np.load(exported_fp32 / case["file"]) as stored:
            assert set(stored.files) == {e["name"] for e in case["arrays"]}, name
            for entry in case["arrays"]:
                assert entry["role"] in ("input", "output", "gradient") and entry["what"]
                assert list(stored[entry["name"]].shape) == entry["shape"], entry["name"]
                assert str(stored[entry["name"]].dtype) == entry["storage"], entry["name"]
        assert case["tolerance"] in ("simple", "complex")


def test_torch_side_imports_only_torch_numpy_and_the_standard_library():
    tree = ast.parse(TORCH_SIDE.read_text())
    modules = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            modules.add(node.module.split(".")[0])
    assert modules - set(sys.stdlib_module_names) == {"numpy", "torch"}


def test_bad_dtype_is_refused_before_compiling(tmp_path):
    with pytest.raises(ValueError, match="dtype"):
        export(tmp_path, dtype="float16")
    assert not (tmp_path / "manifest.json").exists()


def test_fields_the_torch_side_lacks_are_refused_before_compiling(tmp_path):
    """gpt-oss's fields: torch_side.py does not implement them, so a check would hold the model
    to one without them (tests/test_hf.py checks them against transformers instead)."""
    from peakflat_jax.config import ConfigError

    with pytest.raises(ConfigError, match=r"^model.attention_sinks: True is not modelled"):
        export(tmp_path, overrides=("model.attention_sinks=true",))
    assert not (tmp_path / "manifest.json").exists()


def test_run_without_torch_prints_the_torch_command(exported_fp32, tmp_path, monkeypatch,
                                                    capsys):
    """Where this Python has no torch (the project's venv), `peakflat xcheck run` exports and
    says how to run the PyTorch side, with its own exit status."""
    def fake_export(directory, **_):
        shutil.copytree(exported_fp32, directory)

    monkeypatch.setattr(xcheck_run, "export_in_child", fake_export)
    monkeypatch.setattr(xcheck_run, "torch_available", lambda: False)
    directory = tmp_path / "out"
    status = cli.main(["xcheck", "run", "--dir", str(directory), "--record-dir",
                       str(tmp_path / "records")])
    assert status == xcheck_run.NOT_CHECKED
    assert f"torch_side.py {directory}" in capsys.readouterr().err
    assert not (tmp_path / "records").exists()
