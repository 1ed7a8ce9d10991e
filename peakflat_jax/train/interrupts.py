"""Stopping a run cleanly on SIGINT (Ctrl-C) and SIGTERM (a cluster's preemption).

``StopRequests`` installs handlers for both that only note the signal; the training loop asks
``requested()`` between steps, so the step in flight finishes, the pending update is applied, a
checkpoint is saved where checkpointing is on and pending asynchronous writes complete; then
the run raises ``Interrupted`` (``peakflat train`` exits 128 + the signal's number: 130, 143).
A second signal of either kind stops the process at once (the last complete checkpoint is
intact: orbax renames a step's directory only once it is whole). The previous handlers come
back when the loop ends.

Why handlers of our own: Python's default raises KeyboardInterrupt wherever the main thread
happens to be, and the threads of orbax, Grain and TensorBoard's writer left running at exit
ended the process in ``std::terminate`` (SIGABRT, nothing saved). And a process started in the
background of a non-interactive shell inherits SIGINT ignored (POSIX), so a ``kill -INT`` did
nothing at all: installing the handler makes the signal stop it.

Several processes: each may see the signal before a different step, and a checkpoint is a
collective, so they agree before every step (``requested`` takes the signal of any process).

Said at once, whatever the main thread is doing: Python runs a signal's handler only between
the main thread's bytecodes, so a signal during a long call into XLA (a compile of tens of
seconds) was answered only when it returned, and a second one could not stop the process.
The signals are therefore also written to a pipe (``signal.set_wakeup_fd``, from the C-level
handler), which a thread of ours reads: it says what will happen the moment a signal comes,
and a second signal ends the process from there. ``during`` names what the run is in, for
that line (``the compile``: no step runs after it).
"""

from __future__ import annotations

import os
import select
import signal
import threading

import numpy as np

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(Exception):
    """A run stopped by a signal after its step ``step``; ``saved_step`` is the step of the
    checkpoint to resume from (None without one), ``exit_status`` 128 + the signal's number."""

    def __init__(self, signum: int, step: int, total_steps: int, saved_step: int | None,
                 checkpoint_dir, *, trained: bool = True):
        self.signum, self.step, self.total_steps = signum, step, total_steps
        self.saved_step, self.checkpoint_dir = saved_step, checkpoint_dir
        self.exit_status = 128 + signum
        name = signal.Signals(signum).name
        if saved_step is not None:
            saved = f"the checkpoint of step {saved_step} is in {checkpoint_dir}"
        elif trained:
            saved = "nothing to resume from (train.checkpoints is false)"
        else:
            saved = "nothing to resume from: start again with --overwrite"
        when = (f"after step {step}" if trained else
                f"before step {step + 1} (while compiling; no step ran)")
        super().__init__(f"{name}: stopped {when} of {total_steps}; {saved}")


class StopRequests:
    """``with StopRequests() as stop: ... stop.requested() ...``: SIGINT and SIGTERM noted,
    not acted on, inside the block (module doc). Outside the main thread, where Python cannot
    install handlers, it notes nothing."""

    def __init__(self, announce: str = "peakflat train"):
        self.signum: int | None = None
        self.during: str | None = None
        """What the run is in where it is not a step (``the compile``), for the line a signal
        gets; None: a step."""
        self._announce = announce
        self._previous: dict[int, object] = {}
        self._lock = threading.Lock()
        self._pipe: tuple[int, int] | None = None
        self._previous_fd = -1
        self._watcher: threading.Thread | None = None

    def __enter__(self) -> StopRequests:
        if threading.current_thread() is threading.main_thread():
            for signum in SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handler)
            read, write = os.pipe()
            os.set_blocking(read, False)
            os.set_blocking(write, False)
            try:
                self._previous_fd = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
            except (ValueError, OSError):
                os.close(read)
                os.close(write)
            else:
                self._pipe = (read, write)
                self._watcher = threading.Thread(target=self._watch, daemon=True,
                                                 name="peakflat-stop-requests")
                self._watcher.start()
        return self

    def __exit__(self, *exc_info) -> None:
        if self._pipe is not None:
            signal.set_wakeup_fd(self._previous_fd)
            self._drain()
            os.close(self._pipe[1])  # the watcher reads the end of the pipe and returns
            self._watcher.join(timeout=5)
            os.close(self._pipe[0])
            self._pipe = self._watcher = None
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handler(self, signum: int, frame) -> None:
        if self._pipe is None:  # no pipe: the handler is the only reader
            self._note(signum)

    def _watch(self) -> None:
        read = self._pipe[0]
        while True:
            try:
                select.select([read], [], [])
            except (OSError, ValueError):
                return
            if not self._drain():
                return

    def _drain(self) -> bool:
        """Notes the signals in the pipe; False once the pipe is closed."""
        with self._lock:
            pipe = self._pipe
            if pipe is None:
                return False
            try:
                data = os.read(pipe[0], 64)
            except BlockingIOError:
                return True
            except OSError:
                return False
            if not data:
                return False
            for signum in data:
                if signum in SIGNALS:
                    self._note(signum)
            return True

    def _note(self, signum: int) -> None:
        name = signal.Signals(signum).name
        if self.signum is not None:
            os.write(2, f"{self._announce}: {name} again: stopping now; the last complete "
                        f"checkpoint is the one to resume from\n".encode())
            os._exit(128 + signum)
        self.signum = signum
        # os.write: the main thread may be inside print.
        after = (f"{self.during} (no step runs after it)" if self.during else
                 "the current step (a checkpoint is saved where checkpointing is on)")
        os.write(2, f"{self._announce}: {name}: stopping after {after}; {name} again stops at "
                    f"once\n".encode())

    def requested(self) -> bool:
        """Whether any process of the run got a signal (the first one noted is kept in
        ``signum``). With several processes this is a collective: every process calls it at
        the same point of the loop."""
        import jax

        self._drain()
        if jax.process_count() == 1:
            return self.signum is not None
        from jax.experimental import multihost_utils

        signals = np.ravel(multihost_utils.process_allgather(np.int32(self.signum or 0)))
        if self.signum is None and signals.any():
            self.signum = int(signals[np.flatnonzero(signals)[0]])
        return self.signum is not None
