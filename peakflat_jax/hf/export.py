"""The decoder's weights out as a Hugging Face checkpoint: config.json + model.safetensors that
transformers loads as the same family (Mixtral, or Qwen3-MoE for a model with q/k norms;
``config.family_of``).

Each of our weights is fetched to the host one at a time (a leaf, not the model, on the
device-to-host path) and cut into the checkpoint's per-layer, per-expert tensors
(``weights.Rule.to_hf``), the vocab padding dropped. The router's balancing bias has no place in
either family: a moved bias (``model.router_bias_rate`` > 0) is refused rather than dropped;
``check_exportable`` names, in one line, every field of a model that keeps it from a family
and what to train with instead (``peakflat_jax.train.export_run`` calls it for a run). The
files are written as any file is (0666 less the umask).
"""

from __future__ import annotations

import json
import os
import pathlib

import jax
import numpy as np

from peakflat_jax.config import ConfigError, ModelConfig
from peakflat_jax.hf.config import FAMILIES, family_of, hf_config_from_model, read_hf_config
from peakflat_jax.hf.weights import layer_offset, rules


def _names(path) -> tuple[str, ...]:
    names = tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in path)
    return names[:-1] if names and names[-1] == "value" else names


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "generation_config.json")
"""Files of an imported checkpoint that the export copies as they are (the model does not read
them; a checkpoint without its tokenizer is of little use)."""


def checkpoint_tensors(config: ModelConfig, state):
    """(name, tensor) of every checkpoint tensor of ``state`` (the decoder's weights, or any
    tree shaped like them: their gradients, say), in the names and layouts of ``config``'s
    family (``family_of``), each fetched from the devices one layer of one weight at a time."""
    leaves = {_names(path): leaf for path, leaf in
              jax.tree_util.tree_flatten_with_path(state)[0]}
    return _checkpoint_tensors(config, family_of(config), leaves)


def _checkpoint_tensors(config: ModelConfig, family: str, leaves: dict):
    """(name, tensor) of every checkpoint tensor, fetched from the devices one layer of one
    weight at a time (a stacked leaf whole would be L layers' worth of host memory); the
    weights one tensor interleaves (gpt-oss's gate and up) one layer of each at a time."""
    groups: dict[tuple, list] = {}  # each tensor's rules, in order: one, or the interleaved
    for index, rule in enumerate(rules(config, family)):
        if rule.path not in leaves:
            raise ConfigError(f"{'.'.join(rule.path)}: missing from the state to export")
        key = (rule.name, rule.path[0]) if rule.interleave else (index,)
        groups.setdefault(key, []).append(rule)
    for group in groups.values():
        first = group[0]
        leaf = leaves[first.path]
        offset = layer_offset(config, first.path)
        layers = range(leaf.shape[0]) if first.stacked else [None]
        for layer in layers:
            parts = [_host_value(config, rule, leaves[rule.path], layer) for rule in group]
            pieces = (zip(*(enumerate(part) for part in parts)) if first.per_expert
                      else [tuple((None, part) for part in parts)])
            for piece in pieces:
                expert = piece[0][0]
                name = first.name.format(layer=None if layer is None else layer + offset,
                                         expert=expert)
                tensor = _joined(group, [weight for _, weight in piece])
                if tensor.shape != first.hf_shape:  # a bug in a Rule
                    raise ConfigError(f"{name}: exported shape {tensor.shape}, expected "
                                      f"{first.hf_shape}")
                yield name, tensor


def _host_value(config: ModelConfig, rule, leaf, layer: int | None) -> np.ndarray:
    """One layer of a leaf on the host, the vocab padding dropped."""
    value = np.asarray(jax.device_get(leaf if layer is None else leaf[layer]))
    if rule.path == ("embedding",):
        return value[: config.vocab_size]
    if rule.path == ("head",):
        return value[:, : config.vocab_size]
    return value


def _joined(group: list, weights: list[np.ndarray]) -> np.ndarray:
    """The checkpoint tensor of one rule's weight, or of the weights ``group`` interleaves."""
    if len(group) == 1:
        return np.ascontiguousarray(group[0].to_hf(weights[0]))
    parts = [rule.to_hf(weight) for rule, weight in zip(group, weights)]
    count = group[0].interleave[1]
    tensor = np.empty((*parts[0].shape[:-1], parts[0].shape[-1] * count), parts[0].dtype)
    for rule, part in zip(group, parts):
        tensor[..., rule.interleave[0]::count] = part
    return tensor


def export_pretrained(config: ModelConfig, state, directory: str | pathlib.Path,
                      *, base_config: dict | None = None,
                      max_shard_bytes: int = 5 * 2**30) -> pathlib.Path:
    """Writes ``directory``/config.json and the safetensors of the decoder with ``config``
    and weights ``state`` (an nnx.State): one model.safetensors, or, past ``max_shard_bytes``,
    shards model-0000i-of-0000n.safetensors with transformers' model.safetensors.index.json
    (the host holds one shard at a time). The config.json starts from ``base_config``, or from
    ``config.from_pretrained``'s when that is set (its token ids and context length kept), whose
    tokenizer files are copied too. Returns the directory."""
    import shutil

    from safetensors.numpy import save_file

    family = family_of(config)
    if base_config is None and config.from_pretrained is not None:
        base_config = read_hf_config(config.from_pretrained)
    hf = hf_config_from_model(config, base_config)
    leaves = {_names(path): leaf for path, leaf in
              jax.tree_util.tree_flatten_with_path(state)[0]}
    for path, leaf in leaves.items():
        if path[-1] == "router_bias" and np.any(np.asarray(jax.device_get(leaf)) != 0):
            raise ConfigError(f"{'.'.join(path)}: a nonzero router balancing bias, which "
                              f"{family} cannot express (train with model.router_bias_rate=0)")
    directory = pathlib.Path(directory)
    if any(directory.glob("*.safetensors")):
        raise ConfigError(f"OUT_DIR: {str(directory)!r} already holds safetensors files (expected "
                          f"a new or empty directory: stale shards would join the checkpoint)")
    directory.mkdir(parents=True, exist_ok=True)
    shards: list[list[str]] = []  # the tensor names of each written shard
    pending: dict[str, np.ndarray] = {}
    total = 0

    def flush():
        save_file(pending, str(directory / f"shard-{len(shards):05d}.tmp"),
                  metadata={"format": "pt"})
        shards.append(list(pending))
        pending.clear()

    for name, tensor in _checkpoint_tensors(config, family, leaves):
        if pending and sum(t.nbytes for t in pending.values()) + tensor.nbytes > max_shard_bytes:
            flush()
        pending[name] = tensor
        total += tensor.nbytes
    flush()
    count = len(shards)
    files = (["model.safetensors"] if count == 1 else
             [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)])
    mode = _file_mode()
    for i, file in enumerate(files):
        (directory / f"shard-{i:05d}.tmp").replace(directory / file)
        os.chmod(directory / file, mode)  # safetensors writes 0600
    if count > 1:
        index = {"metadata": {"total_size": total},
                 "weight_map": {n: file for names, file in zip(shards, files) for n in names}}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (directory / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    if config.from_pretrained is not None:
        source = pathlib.Path(config.from_pretrained)
        for file in TOKENIZER_FILES:
            if (source / file).is_file() and source.resolve() != directory.resolve():
                shutil.copyfile(source / file, directory / file)
    return directory


def _file_mode() -> int:
    """The mode of a new file under this process's umask (0666 & ~umask)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def check_exportable(config: ModelConfig) -> None:
    """ConfigError, one line, naming every field of ``config`` that no family can express
    (``family_of``'s) and a balancing bias that moves (``model.router_bias_rate``), with the
    values to train with instead."""
    problems = []
    try:
        family_of(config)
    except ConfigError as error:
        problems.append(str(error))
    if config.router_bias_rate:
        problems.append(f"model.router_bias_rate: {config.router_bias_rate!r} moves a balancing "
                        f"bias that none of {list(FAMILIES)} has (expected 0)")
    if problems:
        fields = [p.split(":", 1)[0] for p in problems]
        fields += [part.split("also ", 1)[1].split(":", 1)[0] for p in problems
                   for part in p.split("; ")[1:] if part.startswith("also model.")]
        suggestion = {"model.num_dense_layers": "model.num_dense_layers=0",
                      "model.router_bias_rate": "model.router_bias_rate=0"}
        settings = " ".join(suggestion.get(f, f"{f}=<its default>") for f in fields)
        raise ConfigError(f"{'; '.join(problems)}: to export, train with {settings}")
