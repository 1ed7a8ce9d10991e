"""One run per run directory: a lock held for the run's life.

``hold(run_dir, process_index=...)`` takes an exclusive ``flock`` on a lock file in the run
directory (``.lock`` for process 0, ``.lock.<i>`` for process i of a multi-process run) and
writes the holder's pid, host and start into it; a second run into the directory, whether a
fresh start, ``--resume`` or ``--overwrite``, finds the lock taken and is refused
(``RunDirInUse``) naming the holder, before it reads or changes anything there. Two writers of
one directory interleaved their metrics.jsonl records (NUL bytes, steps twice) and an
``--overwrite`` deleted a live run's files.

Why flock: the kernel releases it with the process, however the process ends (a crash, a
``kill -9``, a lost node's processes reaped), so a run that died never leaves a directory that
cannot be resumed; the lock file left behind is stale, and the next run takes it over. A run
that ends normally removes the file (and the directory, where it made it and nothing else was
written): a refused run leaves nothing behind.

Several processes: each process locks its own file, so that the processes of one run do not
refuse each other, and every process of a second run with the same process count is refused,
whether the run directory is one shared file system or each host's own disk.

The lock is re-entrant within a process (``peakflat train`` takes it before jax is imported,
and the trainer takes it again); a filesystem without locks gets a warning, not a refusal.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import pathlib
import socket
import sys
import time

from peakflat_jax.train.run_dir import LOCK_NAME, RunDirError, check_path, is_lock_file

__all__ = ["RunDirInUse", "RunLock", "hold", "is_lock_file", "lock_name", "process_index_of"]


class RunDirInUse(RunDirError):
    """A run directory whose lock another live process holds; the message names it."""


def lock_name(process_index: int) -> str:
    """The lock file of process ``process_index``: ``.lock``, ``.lock.1``, ..."""
    return LOCK_NAME if process_index == 0 else f"{LOCK_NAME}.{process_index}"


def process_index_of(mesh_config) -> int:
    """This process's index in its run before jax is initialised: ``mesh.process_id`` or
    JAX_PROCESS_ID where a coordinator is configured, else 0 (``mesh.initialize_distributed``'s
    rule)."""
    address = mesh_config.coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS")
    if not address:
        return 0
    if mesh_config.process_id is not None:
        return mesh_config.process_id
    try:
        return max(0, int(os.environ.get("JAX_PROCESS_ID", "0")))
    except ValueError:
        return 0


class RunLock:
    """A held run lock (``hold``); ``release()`` gives it back once every holder in this
    process has."""

    def __init__(self, key: str, path: pathlib.Path, fd: int | None, made_dir: bool):
        self.key, self.path, self._fd, self._made_dir = key, path, fd, made_dir
        self._holders = 1

    def release(self) -> None:
        self._holders -= 1
        if self._holders > 0:
            return
        _HELD.pop(self.key, None)
        if self._fd is None:
            return
        try:
            self.path.unlink()  # still locked: a waiting opener then sees another inode
        except OSError:
            pass
        os.close(self._fd)
        self._fd = None
        if self._made_dir:
            try:
                self.path.parent.rmdir()  # only where nothing else was written
            except OSError:
                pass

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc_info) -> None:
        self.release()


_HELD: dict[str, RunLock] = {}
"""The run locks this process holds, by run directory and process index."""


def hold(run_dir: str | pathlib.Path, *, process_index: int = 0,
         create: bool = True) -> RunLock | None:
    """The lock of ``run_dir`` for this process (module doc), made where needed: the directory
    is created (``create``; else an absent directory is not locked and None is returned: there
    is nothing to guard, and the caller refuses it). Raises ``RunDirInUse`` naming the holder
    when another process holds it, and ``RunDirError`` (one line) where the path cannot be a
    run directory (a file, under a file, not writable)."""
    run_dir = pathlib.Path(run_dir)
    check_path(run_dir)
    key = f"{os.path.realpath(run_dir)}#{process_index}"
    if key in _HELD:
        _HELD[key]._holders += 1
        return _HELD[key]
    if not run_dir.is_dir() and not create:
        return None
    path = run_dir / lock_name(process_index)
    for _ in range(20):  # a holder that just released may have removed the file
        made_dir = not run_dir.exists()
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            except FileNotFoundError:
                if run_dir.is_dir():
                    raise
                continue  # its holder removed the directory it had made on release
        except OSError as error:
            raise RunDirError(f"run directory {run_dir}: {error.strerror.lower()} "
                              f"({error.filename or run_dir}); expected a directory this user "
                              f"can write (pick another --run-dir)") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise RunDirInUse(f"run directory {run_dir} is in use by a run still going "
                              f"({holder}): a run directory holds one run at a time; wait for "
                              f"it to end or stop it, or pick another --run-dir") from None
        except OSError as error:  # a filesystem without flock
            if error.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise
            os.close(fd)
            print(f"warning: run directory {run_dir} cannot be locked ({error.strerror}): "
                  f"nothing stops a second run from writing into it", file=sys.stderr)
            lock = _HELD[key] = RunLock(key, path, None, made_dir)
            return lock
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if not same:  # locked a file its holder removed on release: take the new one
            os.close(fd)
            continue
        os.ftruncate(fd, 0)
        os.write(fd, (json.dumps({
            "pid": os.getpid(), "host": socket.gethostname(),
            "started": datetime.datetime.now().isoformat(timespec="seconds"),
            "command": sys.argv}) + "\n").encode())
        lock = _HELD[key] = RunLock(key, path, fd, made_dir)
        return lock
    raise RunDirError(f"run directory {run_dir}: its lock file {path} kept changing; expected "
                      f"one run at a time (pick another --run-dir)")


def _read_holder(fd: int) -> str:
    """The holder's pid and host, as the lock file says (a holder may not have written yet)."""
    for _ in range(10):
        os.lseek(fd, 0, os.SEEK_SET)
        text = os.read(fd, 65536).decode(errors="replace").strip()
        if text:
            try:
                holder = json.loads(text)
                return (f"pid {holder['pid']} on {holder['host']}, started "
                        f"{holder['started']}")
            except (ValueError, KeyError, TypeError):
                break
        time.sleep(0.05)
    return "pid unknown: another process holds its lock"
