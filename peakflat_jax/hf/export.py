"""The decoder's weights out as a Hugging Face checkpoint: config.json + model.safetensors that
transformers loads as the same family (Mixtral, or Qwen3-MoE for a model with q/k norms;
``config.family_of``).

Each of our weights is fetched to the host one at a time (a leaf, not the model, on the
device-to-host path) and cut into the checkpoint's per-layer, per-expert tensors
(``weights.Rule.to_hf``), the vocab padding dropped. The router's balancing bias has no place in
either family: a moved bias (``model.router_bias_rate`` > 0) is refused rather than dropped.
"""

from __future__ import annotations

import json
import pathlib

import jax
import numpy as np

from peakflat_jax.config import ConfigError, ModelConfig
from peakflat_jax.hf.config import family_of, hf_config_from_model, read_hf_config
from peakflat_jax.hf.weights import layer_offset, rules


def _names(path) -> tuple[str, ...]:
    names = tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in path)
    return names[:-1] if names and names[-1] == "value" else names


def export_pretrained(config: ModelConfig, state, directory: str | pathlib.Path,
                      *, base_config: dict | None = None) -> pathlib.Path:
    """Writes ``directory``/config.json and model.safetensors of the decoder with ``config``
    and weights ``state`` (an nnx.State, or the mapping of its params and extras). The
    config.json starts from ``base_config``, or from ``config.from_pretrained``'s when that
    is set (its token ids and context length kept). Returns the directory."""
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
    tensors: dict[str, np.ndarray] = {}
    for rule in rules(config, family):
        if rule.path not in leaves:
            raise ConfigError(f"{'.'.join(rule.path)}: missing from the state to export")
        value = np.asarray(jax.device_get(leaves[rule.path]))
        if rule.path == ("embedding",):
            value = value[: config.vocab_size]
        elif rule.path == ("head",):
            value = value[:, : config.vocab_size]
        offset = layer_offset(config, rule.path)
        if not rule.stacked:
            tensors[rule.name] = rule.to_hf(value)
            continue
        for layer, per_layer in enumerate(value):
            if not rule.per_expert:
                tensors[rule.name.format(layer=layer + offset)] = rule.to_hf(per_layer)
                continue
            for expert, weight in enumerate(per_layer):
                tensors[rule.name.format(layer=layer + offset, expert=expert)] = rule.to_hf(
                    weight)
    for rule in rules(config, family):  # our shapes, turned, must be the checkpoint's
        for name in [n for n in tensors if _matches(rule.name, n)]:
            if tensors[name].shape != rule.hf_shape:  # a bug in a Rule
                raise ConfigError(f"{name}: exported shape {tensors[name].shape}, expected "
                                  f"{rule.hf_shape}")
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()},
              str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    return directory


def _matches(template: str, name: str) -> bool:
    """Whether ``name`` is ``template`` with its ``{layer}`` and ``{expert}`` filled in."""
    import re

    pattern = re.escape(template).replace(r"\{layer\}", r"\d+").replace(r"\{expert\}", r"\d+")
    return re.fullmatch(pattern, name) is not None


def export_run(run_dir: str | pathlib.Path, directory: str | pathlib.Path) -> pathlib.Path:
    """Writes the Hugging Face checkpoint of a ``peakflat train`` run's latest checkpoint (its
    working weights) to ``directory``; the run's config.json gives the model and the mesh, made
    over this machine's devices as the run made it (so the vocab padding matches)."""
    import orbax.checkpoint as ocp
    from flax import nnx

    from peakflat_jax import mesh as mop
    from peakflat_jax.config import from_dict
    from peakflat_jax.model.decoder import MoEDecoder
    from peakflat_jax.model.sharding import state_shardings
    from peakflat_jax.train.checkpoint import latest_step

    run_dir = pathlib.Path(run_dir)
    if not (run_dir / "config.json").is_file():
        raise ConfigError(f"RUN_DIR: no config.json in {str(run_dir)!r} (expected the directory "
                          f"of a peakflat train run)")
    config = from_dict(json.loads((run_dir / "config.json").read_text()))
    step = latest_step(run_dir / "checkpoints")
    if step is None:
        raise ConfigError(f"RUN_DIR: no complete checkpoint under {run_dir / 'checkpoints'}")
    mesh = mop.make_mesh(config.mesh)
    padded = mop.padded_vocab(config.model.vocab_size, mop.num_devices(mesh))
    graphdef, abstract = nnx.split(nnx.eval_shape(
        lambda: MoEDecoder(config.model, padded_vocab=padded, rngs=nnx.Rngs(0))))
    shardings = state_shardings(abstract, mesh)
    abstract = jax.tree.map(lambda leaf, sharding: jax.ShapeDtypeStruct(
        leaf.shape, leaf.dtype, sharding=sharding), abstract, shardings)
    params, extras = nnx.split_state(abstract, nnx.Param, ...)
    items = {"params": ocp.args.StandardRestore(params)}
    if jax.tree.leaves(extras):
        items["extras"] = ocp.args.StandardRestore(extras)
    manager = ocp.CheckpointManager((run_dir / "checkpoints").absolute())
    try:
        restored = manager.restore(step, args=ocp.args.Composite(**items))
    finally:
        manager.close()
    model = nnx.merge(graphdef, restored["params"], restored.get("extras", extras))
    return export_pretrained(config.model, nnx.state(model), directory)
