"""One MaxText training run, as the end-to-end bench's peer probe: MaxText's pre-training entry
point (``maxtext.trainers.pre_train.train``) with every line of its output stamped with a
monotonic clock, and at exit what MaxText does not log: the device allocator's peak and the
process's peak resident memory.

    python3 scripts/maxtext/run_maxtext.py CONFIG.yml key=value ...   # MaxText's own arguments

MaxText's logged ``seconds`` of a step is the time between two dispatches (the step runs
asynchronously; its line is logged one step late, once the step's loss is read, so when the step
has finished), so the bench times steps from the stamps of consecutive ``completed step`` lines
instead (``peakflat_jax.bench.maxtext.parse_log``).

Launch-side fixes, ours, that change nothing MaxText computes (``PEER_FIXES``, comma-separated):

* ``first_step``: with ``optimizer_memory_host_offload=true`` every optimizer leaf lives in
  pinned host memory, and MaxText 0.2.5's ``train.get_first_step`` reads the step counter with
  ``int()`` before the first step donates the state. On a GPU a pinned-host buffer counts as a
  CPU buffer, so ``int()`` goes through a zero-copy numpy view that holds an external reference,
  and the donation that follows can fail ("Donation requested for buffer with external
  reference"). The fix reads a device copy of the counter instead.
* ``scalars_on_device``: keeps the optimizer's scalar leaves (its step and AdamW's counts) in
  device memory, mu and nu still in pinned host memory: a few bytes, for the case where donating
  a pinned-host scalar is what fails.
"""

import atexit
import os
import resource
import sys
import threading
import time


class StampedLines:
    """A text stream that prefixes every line written to ``stream`` with ``time.monotonic()``."""

    def __init__(self, stream):
        self.stream = stream
        self.at_line_start = True

    def write(self, text: str) -> int:
        out = []
        for piece in text.splitlines(keepends=True):
            if self.at_line_start:
                out.append(f"{time.monotonic():.3f} ")
            out.append(piece)
            self.at_line_start = piece.endswith("\n")
        self.stream.write("".join(out))
        self.stream.flush()
        return len(text)

    def flush(self):
        self.stream.flush()

    def __getattr__(self, name):
        return getattr(self.stream, name)


PEAKS = {"peak": 0, "limit": 0, "device": ""}


def watch_device_memory(period: float = 0.5) -> None:
    """Reads the allocator's peak every ``period`` seconds once jax has a backend, keeping the
    largest: MaxText's exit resets the statistics before an exit hook could read them."""
    import jax
    from jax._src import xla_bridge

    while True:
        time.sleep(period)
        if not xla_bridge.backends_are_initialized():
            continue
        try:
            device = jax.local_devices()[0]
            stats = device.memory_stats() or {}
        except Exception:  # the backend going away at exit
            return
        PEAKS["peak"] = max(PEAKS["peak"], stats.get("peak_bytes_in_use", 0))
        PEAKS["limit"] = stats.get("bytes_limit", PEAKS["limit"])
        PEAKS["device"] = device.device_kind


def report_peaks() -> None:
    gib = 2**30
    print(f"PEER_PEAK_BYTES_GIB={PEAKS['peak'] / gib:.3f} "
          f"PEER_LIMIT_BYTES_GIB={PEAKS['limit'] / gib:.3f} device={PEAKS['device']}",
          flush=True)
    print(f"PEER_HOST_PEAK_GIB={resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.3f}",
          flush=True)


def read_first_step_from_a_device_copy(train) -> None:
    """``PEER_FIXES=first_step`` (module doc)."""
    original = train.get_first_step

    def get_first_step(model, state):
        if not hasattr(state, "optimizer"):
            return original(model, state)
        import jax

        value = state.optimizer.step.get_value()
        sharding = getattr(value, "sharding", None)
        if getattr(sharding, "memory_kind", None) == "pinned_host":
            value = jax.device_put(value, sharding.with_memory_kind("device"))
        return int(value)

    train.get_first_step = get_first_step


def keep_optimizer_scalars_on_device() -> None:
    """``PEER_FIXES=scalars_on_device`` (module doc)."""
    from maxtext.utils import maxtext_utils_nnx

    original = maxtext_utils_nnx.move_memory_to_host

    def move_memory_to_host(path, x):
        names = {getattr(k, "key", getattr(k, "name", None)) for k in path}
        return x if names & {"step", "count"} else original(path, x)

    maxtext_utils_nnx.move_memory_to_host = move_memory_to_host


if __name__ == "__main__":
    sys.stdout = StampedLines(sys.stdout)
    sys.stderr = StampedLines(sys.stderr)
    atexit.register(report_peaks)
    threading.Thread(target=watch_device_memory, daemon=True).start()
    from absl import app
    from maxtext.trainers.pre_train import train

    fixes = set(filter(None, os.environ.get("PEER_FIXES", "").split(",")))
    if "first_step" in fixes:
        read_first_step_from_a_device_copy(train)
    if "scalars_on_device" in fixes:
        keep_optimizer_scalars_on_device()
    print(f"PEER_FIXES={sorted(fixes)}", flush=True)
    app.run(train.main, argv=sys.argv)
