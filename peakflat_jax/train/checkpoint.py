"""Checkpoints of a run, with orbax's CheckpointManager: weights, optimizer state (the
host-resident state too), the data iterator's position, and the step.

One orbax Composite per step under ``run_dir/checkpoints/<step>``: ``params`` and ``extras``
(the router's bias) in their shards, ``opt_state`` (for the offloaded optimizer its host arrays,
restored into host memory, and its layout as JSON beside them, checked before restoring), the
Grain iterator's state, and ``meta`` (step, config, the rest of the train state). Saves run in
the background where orbax can (``train.async_checkpoints``); orbax writes a step into a
temporary directory and renames it when complete, so a run killed during a save resumes from
the last complete checkpoint and loses nothing that was complete. The trainer saves at the end,
every ``train.checkpoint_every`` steps and when interrupted, unless ``train.checkpoints`` is off.

The train state holds no random key: initialisation is a pure function of ``train.seed`` (in
``meta``) and the data order is the data iterator's state.
"""

from __future__ import annotations

import os
import pathlib

import grain
import jax
import orbax.checkpoint as ocp

from peakflat_jax.config import Config, to_dict


class Checkpoints:
    """``save(state, batches, optimizer)`` and ``restore_latest(state, batches, optimizer)``
    over one directory. ``log`` (a line's printer) is told of each save as it starts and, at
    ``close``, that the last one is written: a save in the background is otherwise unseen."""

    def __init__(self, directory: pathlib.Path, config: Config, log=None):
        self.directory = directory.absolute()
        self.config = config
        self._log = log or (lambda line: None)
        self._unannounced: int | None = None  # the last save not yet said to be written
        train = config.train
        self._manager = None
        if train.checkpoints or self.directory.exists():
            options = ocp.CheckpointManagerOptions(
                max_to_keep=train.keep_checkpoints, create=True,
                enable_async_checkpointing=train.async_checkpoints)
            self._manager = ocp.CheckpointManager(self.directory, options=options)

    def save(self, state, batches, optimizer) -> None:
        items = dict(
            params=ocp.args.StandardSave(state.params),
            opt_state=ocp.args.StandardSave(state.opt_state),
            data=grain.checkpoint.CheckpointSave(batches),
            meta=ocp.args.JsonSave({"step": state.step, "config": to_dict(self.config),
                                    "optimizer": _opt_metadata(optimizer, state.opt_state)}))
        if jax.tree.leaves(state.extras):  # a model without MoE layers has no router bias
            items["extras"] = ocp.args.StandardSave(state.extras)
        background = self.config.train.async_checkpoints
        self._log(f"checkpoint of step {state.step}: saving to {self.directory / str(state.step)}"
                  + (" in the background" if background else ""))
        self._manager.save(state.step, args=ocp.args.Composite(**items))
        if background:
            self._unannounced = state.step
        else:
            self._log(f"checkpoint of step {state.step}: written")
        kill_at = os.environ.get("PEAKFLAT_TEST_EXIT_DURING_SAVE")
        if kill_at and int(kill_at) == state.step:  # tests: a run killed while a save runs
            os._exit(17)

    def restore_latest(self, state, batches, optimizer):
        """The state of the latest complete checkpoint (None when there is none); ``state``
        (a freshly initialised one) gives the shapes, shardings and memory kinds."""
        if self._manager is None:
            return None
        step = self._manager.latest_step()
        if step is None:
            return None
        meta = self._manager.restore(step, args=ocp.args.Composite(
            meta=ocp.args.JsonRestore()))["meta"]
        _check_opt_metadata(optimizer, state.opt_state, meta["optimizer"])
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, dict(
            params=state.params, extras=state.extras,
            opt_state=state.opt_state))
        items = dict(params=ocp.args.StandardRestore(abstract["params"]),
                     opt_state=ocp.args.StandardRestore(abstract["opt_state"]),
                     data=grain.checkpoint.CheckpointRestore(batches))
        if jax.tree.leaves(state.extras):
            items["extras"] = ocp.args.StandardRestore(abstract["extras"])
        restored = self._manager.restore(step, args=ocp.args.Composite(**items))
        restored_extras = restored["extras"] if "extras" in items else state.extras
        # Every array where the fresh state keeps it (orbax may restore a leaf replicated).
        params, extras, opt_state = jax.tree.map(
            lambda array, like: jax.device_put(array, like.sharding),
            (restored["params"], restored_extras, restored["opt_state"]),
            (state.params, state.extras, state.opt_state))
        return type(state)(params, extras, opt_state, meta["step"])

    def close(self) -> None:
        if self._manager is not None:
            self._manager.wait_until_finished()
            self._manager.close()
            if self._unannounced is not None:
                self._log(f"checkpoint of step {self._unannounced}: written")
                self._unannounced = None


def latest_step(directory: pathlib.Path) -> int | None:
    """The step of the latest complete checkpoint under ``directory`` (None where there is
    none), without opening a manager: nothing is created or changed."""
    if not directory.is_dir():
        return None
    steps = ocp.utils.checkpoint_steps(directory.absolute())
    return max(steps) if steps else None


def _opt_metadata(optimizer, opt_state) -> dict:
    describe = getattr(optimizer, "state_metadata", None)
    return describe(opt_state) if describe else {}


def _check_opt_metadata(optimizer, opt_state, saved: dict) -> None:
    check = getattr(optimizer, "check_metadata", None)
    if check:
        check(opt_state, saved)
