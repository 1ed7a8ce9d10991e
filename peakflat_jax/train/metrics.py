"""What a training run reports: per-step metrics to JSONL and TensorBoard, memory readings, the
device's peak FLOP rate for MFU, and a progress bar.

Only process 0 writes. Peak device memory is the allocator's ``peak_bytes_in_use`` (GPUs; None
where the backend keeps no statistics, as on CPU); host memory is this process's resident set.
"""

from __future__ import annotations

import json
import pathlib
import sys
import time

import jax

# Dense matmul peaks per device, FLOP/s (vendor figures: bf16 and TF32 tensor cores without
# sparsity). fp32 matmuls on these GPUs run on TF32 under XLA's default precision.
PEAK_FLOPS = {
    "H200": {"bfloat16": 989.4e12, "float32": 494.7e12},
    "H100": {"bfloat16": 989.4e12, "float32": 494.7e12},
    "A100": {"bfloat16": 312e12, "float32": 156e12},
}


def peak_flops(device, dtype: str) -> float | None:
    """The device's dense peak for ``dtype`` matmuls, or None when unknown (CPUs)."""
    for name, peaks in PEAK_FLOPS.items():
        if name in device.device_kind:
            return peaks.get(dtype)
    return None


def device_peak_bytes() -> int | None:
    """The largest ``peak_bytes_in_use`` over this process's devices (None on CPU)."""
    peaks = []
    for device in jax.local_devices():
        stats = device.memory_stats()
        if stats and "peak_bytes_in_use" in stats:
            peaks.append(int(stats["peak_bytes_in_use"]))
    return max(peaks) if peaks else None


def device_memory_bytes() -> int | None:
    """The allocator's limit on one local device (None where unknown, as on CPU)."""
    stats = jax.local_devices()[0].memory_stats()
    return int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


def host_resident_bytes() -> int:
    """This process's resident set size (Linux /proc; 0 where unavailable)."""
    try:
        for line in pathlib.Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def read_records(run_dir: pathlib.Path) -> list[dict]:
    """The records of ``run_dir/metrics.jsonl`` (none where there is no file)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class MetricsWriter:
    """JSONL (``metrics.jsonl``) and TensorBoard event files under ``run_dir``, process 0 only.

    ``resume_step``: the step a resumed run continues after. The records of later steps (those
    that a run killed between checkpoints wrote, and that the resumed run computes again) are
    dropped from the JSONL, and TensorBoard is told to discard its events from the next step on
    (``purge_step``), so that every step is recorded once."""

    def __init__(self, run_dir: pathlib.Path, *, enabled: bool = True,
                 resume_step: int | None = None):
        self.enabled = enabled and jax.process_index() == 0
        self.run_dir = run_dir
        self._jsonl = None
        self._tensorboard = None
        if self.enabled:
            run_dir.mkdir(parents=True, exist_ok=True)
            path = run_dir / "metrics.jsonl"
            if resume_step is not None and path.exists():
                kept = [r for r in read_records(run_dir) if r["step"] <= resume_step]
                path.write_text("".join(json.dumps(r) + "\n" for r in kept))
            self._jsonl = path.open("a" if resume_step is not None else "w")
            from tensorboardX import SummaryWriter

            purge = None if resume_step is None else resume_step + 1
            self._tensorboard = SummaryWriter(str(run_dir / "tensorboard"), purge_step=purge)

    def write(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        self._jsonl.write(json.dumps({"step": step, **metrics}) + "\n")
        self._jsonl.flush()
        for key, value in metrics.items():
            if isinstance(value, int | float) and value == value:  # numbers, NaN left out
                self._tensorboard.add_scalar(key, value, step)

    def close(self) -> None:
        if self.enabled:
            self._jsonl.close()
            self._tensorboard.close()


class Progress:
    """Process 0's terminal output: a tqdm bar on a terminal, a line every few seconds
    elsewhere (CI logs, pipes); neither with ``enabled=False``. ``write`` (the banner, the
    summary, warnings) always prints."""

    def __init__(self, total: int, initial: int, *, enabled: bool):
        self.main = jax.process_index() == 0
        self.enabled = enabled and self.main
        self._bar = None
        self._last_line = 0.0
        if self.enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)

    def update(self, step: int, total: int, summary: str) -> None:
        if self._bar is not None:
            self._bar.set_postfix_str(summary, refresh=False)
            self._bar.update(1)
        elif self.enabled and (time.monotonic() - self._last_line > 5 or step == total):
            print(f"step {step}/{total}  {summary}", file=sys.stderr, flush=True)
            self._last_line = time.monotonic()

    def write(self, text: str) -> None:
        if self._bar is not None:
            self._bar.write(text)
        elif self.main:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
