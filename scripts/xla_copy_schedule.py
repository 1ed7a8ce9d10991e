"""Where XLA placed a program's host copies in its schedule, from XLA's dumps of it: how many
copies start before the first layer's forward (its first attention), and how many start and
end between each attention of the step and the next.

    XLA_FLAGS="--xla_dump_to=DIR --xla_dump_hlo_as_text --xla_dump_hlo_module_re=overlapped" \
        peakflat plan CONFIG --check
    python scripts/xla_copy_schedule.py DIR [--module overlapped]

Reads ``*<module>*after_optimizations-live-range.txt`` (its InstructionSequence: the order the
compute stream runs). A copy whose start and end sit between two compute-heavy instructions
can run under them; copies all scheduled ahead of the first layer run under nothing (issue 26:
h200-1's overlapped step, 366 of 390 before the first attention, docs/offload_adamw.md).
"""

from __future__ import annotations

import argparse
import pathlib
import sys

ATTENTION = ("dot_product_attention_fwd", "dot_product_attention_bwd")


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
    rows = copy_schedule(read_sequence(paths[0]))
    total = sum(started for _, started, _ in rows)
    print(f"{paths[0].name}: {total} host copies; {rows[0][1]} start before the first "
          f"attention")
    for label, started, ended in rows:
        if started or ended:
            where = "before the first attention" if label == "start" else f"after {label}"
            print(f"  {where}: {started} started, {ended} ended")
    return 0


if __name__ == "__main__":
    sys.exit(main())
