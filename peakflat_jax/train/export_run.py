"""A ``peakflat train`` run's latest checkpoint written as a Hugging Face checkpoint
(``peakflat export-hf RUN_DIR OUT_DIR``): the run's config and orbax checkpoint read here, the
tensors written by ``peakflat_jax.hf.export``."""

from __future__ import annotations

import json
import pathlib

import jax

from peakflat_jax.config import ConfigError
from peakflat_jax.hf.export import check_exportable, export_pretrained
from peakflat_jax.train.checkpoint import latest_step


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

    run_dir = pathlib.Path(run_dir)
    if not (run_dir / "config.json").is_file():
        raise ConfigError(f"RUN_DIR: no config.json in {str(run_dir)!r} (expected the directory "
                          f"of a peakflat train run)")
    config = from_dict(json.loads((run_dir / "config.json").read_text()))
    check_exportable(config.model)  # before anything is restored
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
