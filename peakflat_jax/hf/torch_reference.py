"""The transformers side of the Hugging Face checks: a standalone script (torch, transformers,
numpy only; run by the Python of scripts/xcheck_torch_env.sh, which jax's Python is not).

    python peakflat_jax/hf/torch_reference.py JOBS.json

JOBS.json is a list of jobs, run in order, each a mapping:

* ``dir``: a checkpoint directory; with ``make`` (``{"family": "mixtral" | "qwen3_moe" |
  "gpt_oss", "config": {...}, "seed": int, "init_std": float}``) a random fp32 model of that
  family is made there first (``AutoConfig.for_model`` -> ``AutoModelForCausalLM.from_config``
  -> ``save_pretrained``; nothing is downloaded), its norm scales drawn around 1 so that a
  swapped norm shows, gpt-oss's biases (zeros at init) drawn like the weights and its sinks
  of std 1, so that a misplaced one shows; with ``"mxfp4": true`` its experts are then
  replaced by random MXFP4 tensors (``pack_experts_mxfp4``);
* ``tokens``: an .npy of [B, T] token ids; ``out``: the .npz written: ``logits`` [B, T, V]
  fp32 and ``loss`` (transformers' own mean next-token cross-entropy with ``labels=tokens``) of
  the model loaded back with ``from_pretrained``, its ``model_type`` and class name;
* optionally ``labels`` (an .npy of [B, T] ids, -100 where ignored) and ``grads_dir``: one
  training step's loss and gradients by ``torch.autograd``. The loss is
  ``torch.nn.functional.cross_entropy`` of the logits at t against ``labels`` at t + 1 (the
  last position predicts nothing), mean over the targets that are not -100, written as
  ``step_loss``; ``labels_loss`` is transformers' own ``labels=`` loss of the same labels (the
  two conventions are checked to agree, not assumed). The gradients are written as a
  checkpoint by ``save_pretrained`` from a copy of the model whose parameters hold them, so
  they come out in the checkpoint's own names and layouts (transformers' save-time conversion
  of its fused expert tensors included), which the JAX side reaches through the exporter's
  rules.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM, Mxfp4Config


def make(directory: str, spec: dict) -> None:
    config = AutoConfig.for_model(spec["family"], initializer_range=spec.get("init_std", 0.02),
                                  **spec["config"])
    torch.manual_seed(spec.get("seed", 0))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.ndim == 1 and name.endswith("norm.weight"):
                parameter.copy_(1 + 0.2 * torch.randn_like(parameter))
            elif name.endswith("bias"):  # gpt-oss's, which start at zero: drawn, to show
                parameter.copy_(spec.get("init_std", 0.02) * torch.randn_like(parameter))
            elif name.endswith("sinks"):  # as large as the attention logits, to matter
                parameter.copy_(torch.randn_like(parameter))
    model.save_pretrained(directory)
    if spec.get("mxfp4"):
        pack_experts_mxfp4(directory, np.random.default_rng(spec.get("seed", 0)))


def pack_experts_mxfp4(directory: str, rng: np.random.Generator) -> None:
    """gpt-oss's expert tensors replaced by random MXFP4 ones, as the official checkpoints
    store them: ``{name}_blocks`` [E, out, in / 32, 16] uint8 (two FP4 codes a byte) and
    ``{name}_scales`` [E, out, in / 32] uint8 (power-of-two exponents, bias 127), config.json
    naming the quantization; ``run`` has transformers dequantize them on load."""
    from safetensors.numpy import load_file, save_file

    path = f"{directory}/model.safetensors"
    tensors = load_file(path)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, inputs, outputs = tensors.pop(name).shape  # stored [E, in, out]
        groups = inputs // 32
        tensors[f"{name}_blocks"] = rng.integers(0, 256, (experts, outputs, groups, 16),
                                                 dtype=np.uint8)
        tensors[f"{name}_scales"] = rng.integers(119, 123, (experts, outputs, groups),
                                                 dtype=np.uint8)
    save_file(tensors, path, metadata={"format": "pt"})
    with open(f"{directory}/config.json") as file:
        config = json.load(file)
    config["quantization_config"] = {"quant_method": "mxfp4"}
    with open(f"{directory}/config.json", "w") as file:
        json.dump(config, file, indent=2)


def step(model, tokens: torch.Tensor, labels: torch.Tensor, grads_dir: str) -> dict:
    """One step's loss (module doc) and its gradients, saved to ``grads_dir`` as a checkpoint
    of the gradients; returns the losses."""
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=tokens).logits.float()
    vocab = logits.shape[-1]
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, vocab),
                                             labels[:, 1:].reshape(-1), ignore_index=-100)
    loss.backward()
    with torch.no_grad():
        labels_loss = model(input_ids=tokens, labels=labels).loss.float()
        for name, parameter in model.named_parameters():
            if parameter.grad is None:
                raise RuntimeError(f"{name}: no gradient")
            parameter.copy_(parameter.grad)
    model.save_pretrained(grads_dir)
    return dict(step_loss=loss.detach().numpy(), labels_loss=labels_loss.numpy())


def run(job: dict) -> None:
    if job.get("make"):
        make(job["dir"], job["make"])
    with open(f"{job['dir']}/config.json") as file:
        quantized = "quantization_config" in json.load(file)
    # MXFP4: dequantized on load (transformers' own path without its GPU kernels).
    options = {"quantization_config": Mxfp4Config(dequantize=True)} if quantized else {}
    model = AutoModelForCausalLM.from_pretrained(job["dir"], dtype=torch.float32,
                                                 **options).eval()
    tokens = torch.from_numpy(np.load(job["tokens"]).astype(np.int64))
    with torch.no_grad():
        output = model(input_ids=tokens, labels=tokens)
    losses = {}
    if job.get("grads_dir"):
        labels = torch.from_numpy(np.load(job["labels"]).astype(np.int64))
        losses = step(model, tokens, labels, job["grads_dir"])
    np.savez(job["out"], logits=output.logits.float().numpy(), loss=output.loss.float().numpy(),
             model_type=np.array(model.config.model_type),
             architecture=np.array(type(model).__name__), **losses)


def main(argv: list[str]) -> int:
    with open(argv[1]) as file:
        jobs = json.load(file)
    for job in jobs:
        run(job)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
