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
"""

from __future__ import annotations

import os
import signal
import threading

import numpy as np

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(Exception):
    """A run stopped by a signal after its step ``step``; ``saved_step`` is the step of the
    checkpoint to resume from (None without one), ``exit_status`` 128 + the signal's number."""

    def __init__(self, signum: int, step: int, total_steps: int, saved_step: int | None,
                 checkpoint_dir):
        self.signum, self.step, self.total_steps = signum, step, total_steps
        self.saved_step, self.checkpoint_dir = saved_step, checkpoint_dir
        self.exit_status = 128 + signum
        name = signal.Signals(signum).name
        if saved_step is None:
            saved = "nothing to resume from (train.checkpoints is false)"
        else:
            saved = f"the checkpoint of step {saved_step} is in {checkpoint_dir}"
        super().__init__(f"{name}: stopped after step {step} of {total_steps}; {saved}")


class StopRequests:
    """``with StopRequests() as stop: ... stop.requested() ...``: SIGINT and SIGTERM noted,
    not acted on, inside the block (module doc). Outside the main thread, where Python cannot
    install handlers, it notes nothing."""

    def __init__(self, announce: str = "peakflat train"):
        self.signum: int | None = None
        self._announce = announce
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopRequests:
        if threading.current_thread() is threading.main_thread():
            for signum in SIGNALS:
                self._previous[signum] = signal.signal(signum, self._note)
        return self

    def __exit__(self, *exc_info) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _note(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.signum is not None:
            os.write(2, f"{self._announce}: {name} again: stopping now; the last complete "
                        f"checkpoint is the one to resume from\n".encode())
            os._exit(128 + signum)
        self.signum = signum
        # os.write: a handler may run while the main thread is inside print.
        os.write(2, f"{self._announce}: {name}: stopping after the current step (a checkpoint "
                    f"is saved where checkpointing is on); {name} again stops at once\n".encode())

    def requested(self) -> bool:
        """Whether any process of the run got a signal (the first one noted is kept in
        ``signum``). With several processes this is a collective: every process calls it at
        the same point of the loop."""
        import jax

        if jax.process_count() == 1:
            return self.signum is not None
        from jax.experimental import multihost_utils

        signals = np.ravel(multihost_utils.process_allgather(np.int32(self.signum or 0)))
        if self.signum is None and signals.any():
            self.signum = int(signals[np.flatnonzero(signals)[0]])
        return self.signum is not None
