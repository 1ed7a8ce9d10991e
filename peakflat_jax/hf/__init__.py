"""Hugging Face checkpoints (Mixtral, Qwen3-MoE) in and out: config.json <-> ModelConfig
(``config``), checkpoint tensor names and layouts (``weights``), loading into the sharded state
(``load``), writing a checkpoint transformers loads (``export``). ``torch_reference.py`` is the
transformers side of the tests, a standalone script (docs/hf.md)."""

from peakflat_jax.hf.config import hf_config_from_model, model_config_from_hf, resolve_pretrained
from peakflat_jax.hf.export import export_pretrained, export_run
from peakflat_jax.hf.load import CheckpointError, load_pretrained

__all__ = ["CheckpointError", "export_pretrained", "export_run", "hf_config_from_model",
           "load_pretrained", "model_config_from_hf", "resolve_pretrained"]
