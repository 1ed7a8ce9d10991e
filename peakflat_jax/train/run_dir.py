"""A run directory holds one run: nothing of another run mixed in, nothing of its own lost.

What it holds (``train.run_dir`` or ``--run-dir``):

    config.json     the config as run (null knobs filled by the planner)
    metrics.jsonl   one record per logged step, each step once
    tensorboard/    the same metrics as TensorBoard events
    checkpoints/    orbax's steps: <step>/ each complete, the latest train.keep_checkpoints kept
    summary.json    the whole run's summary (losses, medians, peaks), rewritten after each part

``check_run_dir`` decides, before anything is compiled, what a run may do with one: a fresh run
needs it empty or absent (else it is refused: appending to another run's metrics, and orbax
skipping the steps below that run's latest checkpoint, mixed two runs into one), ``--resume``
needs a complete checkpoint in it, written with the settings that shape the state (the model,
where the optimizer's state lives: ``STATE_KEYS``), and ``--overwrite`` clears it first, if it
holds nothing but a run's files.
"""

from __future__ import annotations

import json
import pathlib
import shutil

from peakflat_jax.config import ConfigError

RUN_FILES = ("config.json", "metrics.jsonl", "summary.json", "tensorboard", "checkpoints")
"""What a run writes into its directory; ``--overwrite`` removes these and nothing else."""


STATE_KEYS = ("model", "optimizer.update_on", "operators.optimizer_offload",
              "optimizer.bucket_params")
"""The config's settings that shape the checkpointed state: the weights' tree, and the optimizer
state's place and layout (on the device, on the host for its CPU, or streamed in buckets of
``bucket_params``, which count only where it is streamed). A resume under other values of these
would restore into another tree, which orbax refuses with an error about its own structures."""


class RunDirError(ConfigError):
    """A run directory that cannot be used as asked, with the directory and what to do in its
    message (one line)."""


def check_run_dir(run_dir: pathlib.Path, *, resume: bool, overwrite: bool,
                  saved_step: int | None, config: dict | None = None) -> None:
    """Raises RunDirError where ``run_dir`` cannot be used as asked: ``resume`` without a
    complete checkpoint (``saved_step`` None) or under other ``STATE_KEYS`` than the run's
    (``config``: this run's, as ``config.to_dict`` gives it, against the directory's
    config.json), a fresh run into a directory that holds anything unless ``overwrite``,
    ``overwrite`` of a directory that holds files of no run."""
    if resume and overwrite:
        raise RunDirError("resume and overwrite: expected at most one (continue the run in the "
                          "run directory, or clear it first)")
    if resume:
        saved_config = run_dir / "config.json"
        if config is not None and saved_config.is_file():
            _check_same_state(run_dir, json.loads(saved_config.read_text()), config)
        if saved_step is None:
            raise RunDirError(f"--resume: {run_dir} holds no complete checkpoint to resume from; "
                              f"to start afresh, run without --resume (and with --overwrite if "
                              f"{run_dir} is not empty)")
        return
    entries = sorted(p.name for p in run_dir.iterdir()) if run_dir.is_dir() else []
    if not entries:
        return
    if not overwrite:
        raise RunDirError(f"run directory {run_dir} already holds a run ({', '.join(entries)}): "
                          f"--resume to continue it, or --overwrite to clear it and start again")
    foreign = [name for name in entries if name not in RUN_FILES]
    if foreign:
        raise RunDirError(f"--overwrite: {run_dir} holds files that no run wrote "
                          f"({', '.join(foreign)}), so it is not cleared; expected a run "
                          f"directory (pick another --run-dir)")


_ABSENT = object()


def _setting(config: dict, key: str):
    section, _, name = key.partition(".")
    value = config.get(section, {})
    return value.get(name, _ABSENT) if name else value


def _check_same_state(run_dir: pathlib.Path, saved: dict, config: dict) -> None:
    """The first of ``STATE_KEYS`` (a model field by name) where ``config`` differs from the
    run's ``saved`` config, as a RunDirError."""
    streamed = _setting(saved, "operators.optimizer_offload") is True
    for key in STATE_KEYS:
        if key == "optimizer.bucket_params" and not streamed:
            continue  # the buckets shape the state only where it is streamed
        was, now = _setting(saved, key), _setting(config, key)
        if key == "model" and isinstance(was, dict) and isinstance(now, dict):
            for field in sorted(set(was) & set(now)):  # a field a later version added: none
                if was[field] != now[field]:
                    was, now, key = was[field], now[field], f"model.{field}"
                    break
            else:
                continue
        if was is not _ABSENT and was != now:
            raise RunDirError(f"--resume: {run_dir} holds a run with {key} = {was!r}, this one "
                              f"has {now!r}: its checkpoint holds another state; resume with "
                              f"{key}={json.dumps(was)}, or start afresh (--overwrite)")


def clear_run_dir(run_dir: pathlib.Path) -> None:
    """Removes what a run wrote into ``run_dir`` (``RUN_FILES``), nothing else."""
    for name in RUN_FILES:
        path = run_dir / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
