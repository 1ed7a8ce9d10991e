"""Hugging Face checkpoints (Mixtral, Qwen3-MoE, gpt-oss) in and out: config.json <-> ModelConfig
and the loader of configs that name a checkpoint (``config``), checkpoint tensor names and
layouts (``weights``), loading into the sharded state (``load``), writing a checkpoint
transformers loads (``export``). ``torch_reference.py`` is the transformers side of the tests,
a standalone script (docs/hf.md). The loading and export modules (jax, flax, safetensors) are
imported on first use, so that reading a config stays light."""

import importlib

from peakflat_jax.hf.config import (
    hf_config_from_model,
    load_config,
    model_config_from_hf,
    resolve_pretrained,
)

_LAZY = {"export_pretrained": "export", "CheckpointError": "load",
         "load_pretrained": "load", "init_or_load": "load"}

__all__ = ["CheckpointError", "export_pretrained", "hf_config_from_model",
           "init_or_load", "load_config", "load_pretrained", "model_config_from_hf",
           "resolve_pretrained"]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"peakflat_jax.hf.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'peakflat_jax.hf' has no attribute {name!r}")
