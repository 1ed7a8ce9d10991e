"""What a training run reports: per-step metrics to JSONL and TensorBoard, memory readings, model
FLOP/s and MFU, and a progress bar.

Model FLOP/s: each step's model FLOPs from the batch's own documents (``model.size``'s
convention, ``FLOPS_CONVENTION``: attention over the causal pairs within documents, not over
the whole sequence), over the step's time and the devices. MFU divides it by the vendor's dense
peak (``PEAK_FLOPS``), the field's definition; beside it, labelled, the fraction of the device's
measured dense matmul rate where one is known (``MEASURED_MATMUL_FLOPS``). The summary names
both denominators. Model FLOP/s above the measured matmul rate cannot be real (attention and the
MoE run below it): the run warns.

Only process 0 writes. Peak device memory is the allocator's ``peak_bytes_in_use`` (GPUs; None
where the backend keeps no statistics, as on CPU); host memory is this process's resident set.
"""

from __future__ import annotations

import json
import pathlib
import sys
import time

import jax
import numpy as np

from peakflat_jax.config import ModelConfig
from peakflat_jax.model.size import FLOPS_CONVENTION, causal_pairs, model_flops

H200_MEASURED_BF16_MATMUL_FLOPS = 760e12
"""Dense bf16 matmul FLOP/s measured on one H200 (JAX-NOTES.md: 8192^3 under XLA), the same
figure as the planner's ``Rates.matmul_flops``."""

MEASURED_MATMUL_FLOPS = {"H200": {"bfloat16": H200_MEASURED_BF16_MATMUL_FLOPS}}
"""Dense matmul FLOP/s measured per device kind and dtype: MFU's denominator where known, and
the ceiling that model FLOP/s cannot honestly pass."""

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


def measured_matmul_flops(device, dtype: str) -> float | None:
    """The measured dense matmul rate of ``device`` for ``dtype`` (None where not measured)."""
    for name, rates in MEASURED_MATMUL_FLOPS.items():
        if name in device.device_kind:
            return rates.get(dtype)
    return None


def mfu_denominator(device, dtype: str) -> tuple[float | None, str]:
    """(FLOP/s, its label): the vendor's dense peak of ``device`` for ``dtype``, else (None,
    why)."""
    peak = peak_flops(device, dtype)
    if peak is not None:
        return peak, (f"of the vendor's dense {dtype} peak of {device.device_kind}, "
                      f"{peak / 1e12:.1f} TFLOP/s")
    return None, f"no matmul rate known for {device.device_kind}"


class Throughput:
    """Each step's model FLOP/s per device and MFU, from the step's batch (module doc).

    ``step(segment_ids, seconds)`` takes this process's rows of the batch (the numpy array the
    data pipeline made) and its time, and returns the record's fields; the FLOPs of this
    process's rows are divided over this process's devices of the mesh. ``warning()`` returns,
    once, the warning of a step whose model FLOP/s passed the measured matmul rate."""

    def __init__(self, config: ModelConfig, mesh, dtype: str | None = None):
        self.config = config
        devices = [d for d in np.asarray(mesh.devices).flat
                   if d.process_index == jax.process_index()]
        self.num_devices = len(devices)
        dtype = dtype or config.dtype
        self.denominator, self.label = mfu_denominator(devices[0], dtype)
        self.ceiling = measured_matmul_flops(devices[0], dtype)
        self.kind = devices[0].device_kind
        self._warning: str | None = None
        self._warned = False

    def step(self, segment_ids, seconds: float) -> dict:
        flops = model_flops(self.config, segment_ids) / self.num_devices / seconds
        full = np.asarray(segment_ids).shape[-1]
        if self.ceiling is not None and flops > self.ceiling and not self._warned:
            self._warned = True
            self._warning = (f"warning: {flops / 1e12:.1f} model TFLOP/s per device is above "
                             f"the device's measured dense matmul rate "
                             f"({self.ceiling / 1e12:.0f} TFLOP/s): the FLOP count or the "
                             f"step time is wrong")
        return {"model_tflops_per_device": flops / 1e12,
                "mfu": flops / self.denominator if self.denominator else None,
                "fraction_of_measured_matmul": flops / self.ceiling if self.ceiling else None,
                "attention_pairs_fraction": _pairs_fraction(segment_ids, full)}

    def warning(self) -> str | None:
        """The pending warning (once per run), or None."""
        warning, self._warning = self._warning, None
        return warning

    def summary_fields(self) -> dict:
        """What the summary states about its FLOP figures: the convention and MFU's
        denominator."""
        measured = (None if self.ceiling is None else
                    f"of the measured dense matmul of {self.kind}, "
                    f"{self.ceiling / 1e12:.0f} TFLOP/s")
        return {"flops_convention": FLOPS_CONVENTION, "mfu_denominator": self.label,
                "mfu_denominator_flops": self.denominator,
                "fraction_of_measured_matmul_denominator": measured}


def _pairs_fraction(segment_ids, seq_len: int) -> float:
    """The batch's causal pairs within documents over full causal's T (T + 1) / 2 a row."""
    rows = max(1, np.asarray(segment_ids).size // max(seq_len, 1))
    return causal_pairs(segment_ids) / (rows * seq_len * (seq_len + 1) / 2)


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


def _proc_status_bytes(field: str) -> int:
    """A size field of /proc/self/status (``VmRSS``, ``VmHWM``) in bytes; 0 where unavailable."""
    try:
        for line in pathlib.Path("/proc/self/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def host_resident_bytes() -> int:
    """This process's resident set size now (Linux /proc ``VmRSS``; 0 where unavailable)."""
    return _proc_status_bytes("VmRSS")


def host_peak_resident_bytes() -> int:
    """This process's largest resident set size since it started (Linux /proc ``VmHWM``; 0
    where unavailable): the host's peak that the plan bounds, transients within a step (the
    host-CPU update's gradients, a program's host temporaries) included, which a sample of
    ``VmRSS`` between steps misses."""
    return _proc_status_bytes("VmHWM")


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

    def status(self, text: str) -> None:
        """What the run is doing between steps (making the state, compiling), shown beside the
        bar on a terminal (a bar at 0/N said nothing of it); elsewhere the lines say it."""
        if self._bar is not None:
            self._bar.set_postfix_str(text, refresh=True)

    def write(self, text: str) -> None:
        if self._bar is not None:
            self._bar.write(text)
        elif self.main:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
