"""Where XLA placed a program's host copies in its schedule, from XLA's dumps of it: how many
copies start before the first layer's forward (its first attention), and how many start and
end between each attention of the step and the next.

    XLA_FLAGS="--xla_dump_to=DIR --xla_dump_hlo_as_text --xla_dump_hlo_module_re=overlapped" \
        peakflat plan CONFIG --check
    python scripts/xla_copy_schedule.py DIR [--module overlapped]

Reads ``*<module>*after_optimizations-live-range.txt`` (its InstructionSequence: the order the
compute stream runs), and counts the copies with no heavy instruction between their start and
end (``uncovered_copies``). A copy whose start and end sit between two compute-heavy instructions
can run under them; copies all scheduled ahead of the first layer run under nothing (issue 26:
h200-1's overlapped step, 366 of 390 before the first attention, docs/offload_adamw.md).
"""

from __future__ import annotations

import argparse
import pathlib
import sys

ATTENTION = ("dot_product_attention_fwd", "dot_product_attention_bwd")
HEAVY = ("dot_product_attention", "custom-call", "gemm", "while")
"""The instructions that carry a step's time on a GPU: cuDNN's attention, the grouped matmul's and
other custom calls, cuBLAS matmuls, loops. A host copy whose start and end have none of them
between them runs under nothing but small fusions."""


def read_sequence(path: pathlib.Path) -> list[str]:
    """The scheduled instructions' names, in order."""
    names, inside = [], False
    for line in path.read_text().splitlines():
        if line.strip() == "InstructionSequence:":
            inside = True
        elif inside and line.startswith("  ") and not line.startswith("    "):
            break
        elif inside and ":" in line:
            names.append(line.split(":", 1)[1].strip())
    return names


def copy_schedule(names: list[str]) -> list[tuple[str, int, int]]:
    """(an attention instruction, copies started, copies ended after it and before the next),
    the first row ('start') for the copies before the first attention."""
    rows, starts, dones, label = [], 0, 0, "start"
    for name in names:
        if name.startswith("copy-start"):
            starts += 1
        elif name.startswith("copy-done"):
            dones += 1
        elif name.startswith(ATTENTION):
            rows.append((label, starts, dones))
            label, starts, dones = name, 0, 0
    rows.append((label, starts, dones))
    return rows


def copy_cover(names: list[str]) -> dict[str, int]:
    """Each host copy (its name's suffix) and how many ``HEAVY`` instructions the schedule puts
    between its start and its end: what the copy can run under."""
    started, cover, heavy = {}, {}, 0
    for name in names:
        if name.startswith("copy-start"):
            started[name.split(".", 1)[1]] = heavy
        elif name.startswith("copy-done"):
            key = name.split(".", 1)[1]
            if key in started:
                cover[key] = heavy - started[key]
        elif name.startswith(HEAVY):
            heavy += 1
    return cover


def uncovered_copies(names: list[str]) -> tuple[int, int, int, int]:
    """(copies that start in the forward, of them those with no ``HEAVY`` instruction between
    start and end; the same for the backward), the backward beginning at the first attention's
    backward."""
    cover = copy_cover(names)
    backward = next((i for i, n in enumerate(names) if n.startswith(ATTENTION[1])), len(names))
    where = {n.split(".", 1)[1]: i < backward for i, n in enumerate(names)
             if n.startswith("copy-start")}
    forward = [k for k in cover if where[k]]
    rest = [k for k in cover if not where[k]]
    return (len(forward), sum(cover[k] == 0 for k in forward),
            len(rest), sum(cover[k] == 0 for k in rest))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dump_dir", type=pathlib.Path)
    parser.add_argument("--module", default="", help="part of the dumped module's file name")
    args = parser.parse_args(argv)
    pattern = f"*{args.module}*" if args.module else "*"
    paths = sorted(args.dump_dir.glob(pattern + "after_optimizations-live-range.txt"))
    if len(paths) != 1:
        print(f"error: expected one live-range dump matching {args.module!r} in "
              f"{args.dump_dir}, found {len(paths)}", file=sys.stderr)
        return 2
    names = read_sequence(paths[0])
    rows = copy_schedule(names)
    total = sum(started for _, started, _ in rows)
    print(f"{paths[0].name}: {total} host copies; {rows[0][1]} start before the first "
          f"attention")
    forward, bare_forward, backward, bare_backward = uncovered_copies(names)
    print(f"  with no attention, custom call, matmul or loop between start and end: "
          f"{bare_forward} of {forward} started in the forward, {bare_backward} of {backward} "
          f"in the backward")
    for label, started, ended in rows:
        if started or ended:
            where = "before the first attention" if label == "start" else f"after {label}"
            print(f"  {where}: {started} started, {ended} ended")
    return 0


if __name__ == "__main__":
    sys.exit(main())
