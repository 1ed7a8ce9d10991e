"""The transformers side of the Hugging Face checks: a standalone script (torch, transformers,
numpy only; run by the Python of scripts/xcheck_torch_env.sh, which jax's Python is not).

    python peakflat_jax/hf/torch_reference.py JOBS.json

JOBS.json is a list of jobs, run in order, each a mapping:

* ``dir``: a checkpoint directory; with ``make`` (``{"family": "mixtral" | "qwen3_moe",
  "config": {...}, "seed": int, "init_std": float}``) a random fp32 model of that family is
  made there first (``AutoConfig.for_model`` -> ``AutoModelForCausalLM.from_config`` ->
  ``save_pretrained``; nothing is downloaded), its norm scales drawn around 1 so that a
  swapped norm shows;
* ``tokens``: an .npy of [B, T] token ids; ``out``: the .npz written: ``logits`` [B, T, V]
  fp32 and ``loss`` (transformers' own mean next-token cross-entropy with ``labels=tokens``) of
  the model loaded back with ``from_pretrained``, its ``model_type`` and class name.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM


def make(directory: str, spec: dict) -> None:
    config = AutoConfig.for_model(spec["family"], initializer_range=spec.get("init_std", 0.02),
                                  **spec["config"])
    torch.manual_seed(spec.get("seed", 0))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.ndim == 1 and name.endswith("norm.weight"):
                parameter.copy_(1 + 0.2 * torch.randn_like(parameter))
    model.save_pretrained(directory)


def run(job: dict) -> None:
    if job.get("make"):
        make(job["dir"], job["make"])
    model = AutoModelForCausalLM.from_pretrained(job["dir"], dtype=torch.float32).eval()
    tokens = torch.from_numpy(np.load(job["tokens"]).astype(np.int64))
    with torch.no_grad():
        output = model(input_ids=tokens, labels=tokens)
    np.savez(job["out"], logits=output.logits.float().numpy(), loss=output.loss.float().numpy(),
             model_type=np.array(model.config.model_type),
             architecture=np.array(type(model).__name__))


def main(argv: list[str]) -> int:
    with open(argv[1]) as file:
        jobs = json.load(file)
    for job in jobs:
        run(job)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
