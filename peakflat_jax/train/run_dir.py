"""A run directory holds one run: nothing of another run mixed in, nothing of its own lost.

What it holds (``train.run_dir`` or ``--run-dir``):

    config.json     the config as the run started (null knobs filled by the planner)
    config_changes.jsonl  what each resume changed of it, where one did (``CHANGEABLE``)
    metrics.jsonl   one record per logged step, each step once
    tensorboard/    the same metrics as TensorBoard events
    checkpoints/    orbax's steps: <step>/ each complete, the latest train.keep_checkpoints kept
    summary.json    the whole run's summary (losses, medians, peaks), rewritten after each part

``check_run_dir`` decides, before anything is compiled, what a run may do with one: a fresh run
needs it empty or absent (else it is refused: appending to another run's metrics, and orbax
skipping the steps below that run's latest checkpoint, mixed two runs into one), ``--resume``
needs a complete checkpoint in it, written with the settings that shape the state (the model,
where the optimizer's state lives: ``STATE_KEYS``) and the same run otherwise (a changed data,
optimizer or seed field is refused naming the old and new values: a resume continues the run
it names; what a user legitimately changes on a resume, ``CHANGEABLE``, is accepted and recorded
in config_changes.jsonl, config.json keeping the run's start), and ``--overwrite`` clears it
first, if it holds nothing but a run's files. The lock files of ``run_lock`` are no run's
content: they are neither counted nor cleared.

``check_path`` refuses, in one line, a path that cannot be a run directory (a file, under a
file, not writable), before anything is made.
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import shutil

from peakflat_jax.config import ConfigError

RUN_FILES = ("config.json", "config_changes.jsonl", "metrics.jsonl", "summary.json",
             "tensorboard", "checkpoints", "profile", "profile.json")
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


LOCK_NAME = ".lock"
"""``run_lock``'s file: ``.lock`` (process 0), ``.lock.<i>`` (process i)."""


def is_lock_file(name: str) -> bool:
    """Whether ``name`` is a run lock's file (never a run's content)."""
    return name == LOCK_NAME or name.startswith(f"{LOCK_NAME}.")


CHANGEABLE = ("name", "train.steps", "train.run_dir", "train.log_every", "train.checkpoints",
              "train.checkpoint_every", "train.keep_checkpoints", "train.async_checkpoints",
              "train.progress", "train.profile_steps", "train.device_memory_gib",
              "train.host_memory_gib", "optimizer.resident_groups", "optimizer.slots",
              "mesh.", "device.", "operators.")
"""What a resume may change (a key, or a section's prefix), each change recorded: the run's
length (``train.steps``: a run extended; with a cosine decay the schedule then decays over
the new length from the resumed step on), its cadences (logging, checkpoints, profiling, the
progress bar), and how it is computed where that changes no number beyond float rounding (the
mesh, the machine, the operators and the knobs the planner fills, which a resume on another
machine may fill otherwise). Everything else (the model, the data, the optimizer's
hyperparameters, the seed) makes another run; ``STATE_KEYS`` are refused first, with why."""


def run_dir_of(config, run_dir: str | pathlib.Path | None = None) -> pathlib.Path:
    """The run directory of ``config``: ``run_dir`` (``--run-dir``) where given, else
    ``train.run_dir`` with ``{name}`` the config's name (a ConfigError naming the field where
    it holds another ``{...}``)."""
    if run_dir:
        return pathlib.Path(run_dir)
    try:
        return pathlib.Path(config.train.run_dir.format(name=config.name))
    except (KeyError, IndexError, ValueError) as error:
        raise ConfigError(f"train.run_dir: {config.train.run_dir!r} is not a path with at most "
                          f"{{name}} in it ({type(error).__name__}: {error})") from None


def check_path(run_dir: pathlib.Path) -> None:
    """Raises RunDirError (one line) where ``run_dir`` cannot be a run directory: a file, a path
    under a file, or one this user cannot write (the directory, or where it would be made)."""
    hint = "expected a directory this user can write (pick another --run-dir)"
    if run_dir.exists() and not run_dir.is_dir():
        raise RunDirError(f"run directory {run_dir} is a file; {hint}")
    existing = run_dir
    while not existing.exists():
        parent = existing.parent
        if parent == existing:
            break
        existing = parent
    if existing != run_dir and not existing.is_dir():
        raise RunDirError(f"run directory {run_dir}: {existing} is a file, not a directory; "
                          f"{hint}")
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "is" if existing == run_dir else f"cannot be made: {existing} is"
        raise RunDirError(f"run directory {run_dir} {what} not writable by this user; {hint}")


def flat(config: dict, prefix: str = "") -> dict:
    """``config`` (nested mappings) as {"section.field": value}."""
    out = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _changeable(key: str) -> bool:
    return any(key == name or (name.endswith(".") and key.startswith(name))
               for name in CHANGEABLE)


def run_config(run_dir: pathlib.Path) -> dict | None:
    """The config the run in ``run_dir`` runs under now: its config.json with each change of
    config_changes.jsonl applied in order (None without a config.json)."""
    path = run_dir / "config.json"
    if not path.is_file():
        return None
    config = flat(json.loads(path.read_text()))
    changes = run_dir / "config_changes.jsonl"
    if changes.is_file():
        for line in changes.read_text().splitlines():
            if line.strip():
                config.update({k: v["now"] for k, v in json.loads(line)["changed"].items()})
    return config


def resume_changes(run_dir: pathlib.Path, config: dict) -> dict:
    """{key: {"was": old, "now": new}} of what a resume under ``config`` (``to_dict``'s) changes
    of the run in ``run_dir`` (``run_config``), all of them ``CHANGEABLE``; RunDirError naming
    the first other change, its old and new values, and what to do."""
    saved = run_config(run_dir)
    if saved is None:
        return {}
    now = flat(config)
    changed = {key: {"was": saved.get(key), "now": value} for key, value in now.items()
               if key in saved and saved[key] != value}
    refused = [key for key in changed if not _changeable(key)]
    if refused:
        key = refused[0]
        more = (f" (and {len(refused) - 1} more: {', '.join(refused[1:])})"
                if len(refused) > 1 else "")
        raise RunDirError(f"--resume: {run_dir} holds a run with {key} = "
                          f"{json.dumps(changed[key]['was'])}, this one has "
                          f"{json.dumps(changed[key]['now'])}{more}: a resume continues the "
                          f"run it names; resume with {key}={json.dumps(changed[key]['was'])}, "
                          f"or start a new run (another --run-dir, or --overwrite)")
    return changed


def record_config(run_dir: pathlib.Path, config: dict, *, resumed_from: int | None) -> dict:
    """Writes the run's config: config.json for a run that starts (or a resumed one without
    it), else what the resume changed (``resume_changes``) as one more line of
    config_changes.jsonl, config.json left as the run started. Returns the changes."""
    if resumed_from is None or not (run_dir / "config.json").is_file():
        (run_dir / "config.json").write_text(json.dumps(config, indent=1))
        return {}
    changed = resume_changes(run_dir, config)
    if changed:
        record = {"resumed_from": resumed_from,
                  "time": datetime.datetime.now().isoformat(timespec="seconds"),
                  "changed": changed}
        with open(run_dir / "config_changes.jsonl", "a") as file:
            file.write(json.dumps(record) + "\n")
    return changed


def describe_changes(changed: dict) -> str:
    """The changes of ``resume_changes`` in words: ``train.steps 24 -> 48, ...``."""
    return ", ".join(f"{key} {json.dumps(c['was'])} -> {json.dumps(c['now'])}"
                     for key, c in changed.items())


def check_run_dir(run_dir: pathlib.Path, *, resume: bool, overwrite: bool,
                  saved_step: int | None, config: dict | None = None) -> None:
    """Raises RunDirError where ``run_dir`` cannot be used as asked: ``resume`` without a
    complete checkpoint (``saved_step`` None), under other ``STATE_KEYS`` than the run's
    (``config``: this run's, as ``config.to_dict`` gives it, against the directory's
    config.json) or with another change than ``CHANGEABLE``'s, a fresh run into a directory
    that holds anything unless ``overwrite``, ``overwrite`` of a directory that holds files of
    no run."""
    if resume and overwrite:
        raise RunDirError("resume and overwrite: expected at most one (continue the run in the "
                          "run directory, or clear it first)")
    if resume:
        saved_config = run_dir / "config.json"
        if config is not None and saved_config.is_file():
            _check_same_state(run_dir, json.loads(saved_config.read_text()), config)
            resume_changes(run_dir, config)
        if saved_step is None:
            raise RunDirError(f"--resume: {run_dir} holds no complete checkpoint to resume from; "
                              f"to start afresh, run without --resume (and with --overwrite if "
                              f"{run_dir} is not empty)")
        return
    entries = sorted(p.name for p in run_dir.iterdir()
                     if not is_lock_file(p.name)) if run_dir.is_dir() else []
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
