"""Peak device memory and tokens/s against context for h200-e2e on one H200: the standard stack
(AdamW on the device; where its state does not fit there, on the host CPU) and ours
(``operators: auto``; at 540,672 auto's knobs from 506,628 held, the device check lifted; at
741,848 the plan's largest, the overlapped step writing its MoE weights in place),
from the runs' records under scripts/results/ (each run a fresh process, 3 steps, batch 1).
Writes docs/figures/end_to_end_h200.png.

    python scripts/plot_end_to_end.py
"""

import json
import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "scripts" / "results"
GIB = 2**30
# (record, run) of each point; the standard stack's 24K run ran out of device memory.
STANDARD = [("h200_1_session_gpu_20261201-162217.json", "e2e_off_12k"),
            ("h200_1_session_gpu_20261201-162217.json", "e2e_off_16k"),
            ("h200_session_gpu_20261201-185430.json", "e2e_off_20480"),
            ("h200_session_gpu_20261201-185430.json", "e2e_off_22528")]
STANDARD_HOST_CPU = [("h200_session_gpu_20261201-185430.json", "e2e_hostcpu_32768"),
                     ("h200_session_gpu_20261203-130600.json", "hostcpu64k")]
STANDARD_OOM = 24576
# Where a context ran twice, the latest run (the planner's choice as it is now).
OURS = [("h200_1_session_gpu_20261201-162217.json", "e2e_auto_32k"),
        ("h200_session_gpu_20261205-015142.json", "e2e64k"),
        ("h200_session_gpu_20261201-185430.json", "e2e_auto_131072"),
        ("h200_session_gpu_20261205-015142.json", "e2e262k"),
        ("h200_session_gpu_20261202-185840.json", "e2e_largest"),
        ("h200_session_gpu_20261203-130600.json", "e2e_8x"),
        ("h200_session_gpu_20261204-153030.json", "auto_e2e534k"),
        ("h200_session_gpu_20261204-181441.json", "auto741k")]
DEVICE_GIB = 132.8  # the allocator's limit on an H200


def points(runs):
    """(context, peak GiB, tokens/s) of each run."""
    out = []
    for record, run in runs:
        r = json.loads((RESULTS / record).read_text())["runs"][run]
        step = r.get("median_step_seconds", r.get("step_seconds"))  # the session records' name
        context = round(r["tokens_per_second"] * step)
        out.append((context, r["peak_device_bytes"] / GIB, r["tokens_per_second"]))
    return out


def main():
    standard, host_cpu, ours = points(STANDARD), points(STANDARD_HOST_CPU), points(OURS)
    # Below the standard stack's longest context, auto chooses the standard stack itself.
    ours = sorted(standard + ours)
    fig, (memory, speed) = plt.subplots(1, 2, figsize=(11, 4.8))
    for axis in (memory, speed):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("context (tokens, batch 1)")
        axis.grid(alpha=0.3)
    style = {"standard stack (AdamW on device)": (standard, "C0", "o"),
             "standard stack (AdamW on host CPU)": (host_cpu, "C0", "s"),
             "ours (operators: auto; at 540,672 its knobs held)": (ours, "C3", "^")}
    for label, (pts, color, marker) in style.items():
        xs, peaks, rates = zip(*pts)
        memory.plot(xs, peaks, marker=marker, color=color, label=label,
                    linestyle="--" if "host" in label else "-")
        speed.plot(xs, rates, marker=marker, color=color, label=label,
                   linestyle="--" if "host" in label else "-")
    memory.axhline(DEVICE_GIB, color="gray", linestyle=":", label="H200 allocator limit")
    memory.axvline(STANDARD_OOM, color="C0", alpha=0.4, linestyle=":",
                   label="standard stack out of memory (24K)")
    memory.set_ylabel("peak device memory (GiB, allocator)")
    speed.set_yscale("log")
    speed.set_ylabel("tokens/s")
    fig.legend(*memory.get_legend_handles_labels(), loc="lower center", ncol=3, fontsize=8)
    fig.suptitle("h200-e2e (7.36B MoE, V = 131,072) on one H200, 3 steps per point")
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    out = ROOT / "docs" / "figures" / "end_to_end_h200.png"
    fig.savefig(out, dpi=110)
    print(out)


if __name__ == "__main__":
    main()
