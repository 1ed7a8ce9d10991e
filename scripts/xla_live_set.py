"""What a compiled program holds, step by step, from XLA's dumps of it: the bytes of device memory
in use after each instruction of the schedule, each byte counted once (values that share an
allocation's bytes, a loop's carry and its body's parameter say, are merged by their offsets),
its peak and what is live there, and how much of XLA's temporary allocation its packing leaves
unused at that peak.

    XLA_FLAGS="--xla_dump_to=DIR --xla_dump_hlo_as_text --xla_dump_hlo_module_re=train_step" \
        peakflat plan CONFIG --check
    python scripts/xla_live_set.py DIR [--module train_step] [--window 50] [--at STEP] [--top 30]

Reads ``*<module>*after_optimizations-live-range.txt`` (the schedule and each value's live range)
and ``*-buffer-assignment.txt`` (each value's allocation, offset and size). Only the default
memory space is counted (color 0; pinned-host allocations, color 5, are the host's). Values the
buffer assignment does not name (bookkeeping of a few bytes) are left out and counted in the
report's first line. scripts/compare_records.py holds such figures to the closed form.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys

GIB = 2**30
ALLOCATION = re.compile(r"^allocation (\d+): size (\d+), (.*)$")
COLOR = re.compile(r"\bcolor (\d+)\b")
VALUE = re.compile(r"^ value: <\d+ (\S+)(?: \(phi\))? @\d+> \(size=(\d+),offset=(\d+)\): (\S+)")
RANGE = re.compile(r"^    (\S+):(\d+)-(\d+)$")


def read_buffers(path: pathlib.Path):
    """{value name: (allocation, offset, size, shape)} of the default memory space,
    {allocation: (size, description)}, and the names of the values in other memory."""
    values, allocations, elsewhere, current, skip = {}, {}, set(), None, False
    for line in path.read_text().splitlines():
        if match := ALLOCATION.match(line):
            current = int(match.group(1))
            description = match.group(3)
            skip = _color(description) != 0
            allocations[current] = (int(match.group(2)), description)
        elif (match := VALUE.match(line)) and current is not None:
            name, size, offset, shape = match.groups()
            if skip:
                elsewhere.add(name)
            else:
                values[name] = (current, int(offset), int(size), shape)
    return values, allocations, elsewhere


def _color(description: str) -> int:
    """An allocation's memory space: 0, the device's, unless its line names another (XLA:GPU
    writes pinned host memory as ``color 5``)."""
    match = COLOR.search(description)
    return int(match.group(1)) if match else 0


def read_live_ranges(path: pathlib.Path):
    """(the schedule's instruction names, [(value name, first step, last step)])."""
    lines = path.read_text().splitlines()
    schedule, ranges, section = [], [], None
    for line in lines:
        if line.startswith("  InstructionSequence"):
            section = "sequence"
        elif line.startswith("  BufferLiveRange"):
            section = "ranges"
        elif line.startswith("  ") and not line.startswith("    "):
            section = None
        elif section == "sequence" and line.startswith("    "):
            schedule.append(line.strip().split(":", 1)[1])
        elif section == "ranges" and (match := RANGE.match(line)):
            ranges.append((match.group(1), int(match.group(2)), int(match.group(3))))
    return schedule, ranges


def _lookup(values, name: str):
    """The buffer of a live range's value: the buffer assignment names a value of a whole
    array without the live ranges' ``{}`` and a tuple's own index table with it."""
    if name in values:
        return values[name]
    return values.get(name[:-2]) if name.endswith("{}") else None


def usage(values, ranges, steps: int):
    """Bytes in use after each step, each allocation's bytes counted once."""
    live_at = [[] for _ in range(steps)]
    for name, first, last in ranges:
        if (buffer := _lookup(values, name)) is not None:
            for step in range(first, min(last, steps - 1) + 1):
                live_at[step].append(buffer)
    used = []
    for buffers in live_at:
        by_allocation: dict[int, list[tuple[int, int]]] = {}
        for allocation, offset, size, _ in buffers:
            by_allocation.setdefault(allocation, []).append((offset, offset + size))
        total = 0
        for spans in by_allocation.values():
            spans.sort()
            start, end = spans[0]
            for low, high in spans[1:]:
                if low > end:
                    total += end - start
                    start, end = low, high
                else:
                    end = max(end, high)
            total += end - start
        used.append(total)
    return used


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dump_dir", type=pathlib.Path)
    parser.add_argument("--module", default="", help="part of the dumped module's file name")
    parser.add_argument("--window", type=int, default=50, help="steps per line of the sweep")
    parser.add_argument("--at", type=int, help="list what is live after this step (default: "
                                               "the peak)")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args(argv)
    module = f"*{args.module}*" if args.module else "*"
    found = {kind: sorted(args.dump_dir.glob(f"{module}after_optimizations-{kind}.txt"))
             for kind in ("live-range", "buffer-assignment")}
    if not all(len(paths) == 1 for paths in found.values()):
        print(f"xla_live_set: expected one live-range and one buffer-assignment dump matching "
              f"{args.module!r} in {args.dump_dir}, found {found}", file=sys.stderr)
        return 2
    values, allocations, elsewhere = read_buffers(found["buffer-assignment"][0])
    schedule, ranges = read_live_ranges(found["live-range"][0])
    used = usage(values, ranges, len(schedule))
    host = sum(1 for name, _, _ in ranges
               if name in elsewhere or (name.endswith("{}") and name[:-2] in elsewhere))
    unnamed = sum(1 for name, _, _ in ranges if _lookup(values, name) is None) - host
    peak = max(range(len(used)), key=used.__getitem__)
    temp = [a for a, (_, description) in allocations.items() if "preallocated-temp" in description]
    total = sum(size for size, description in allocations.values() if _color(description) == 0)
    print(f"{len(ranges)} values ({host} in host memory, {unnamed} not in the buffer "
          f"assignment); device allocations "
          f"{total / GIB:.2f} GiB; peak in use {used[peak] / GIB:.2f} GiB after step {peak} "
          f"({schedule[peak]})")
    if temp:
        size = allocations[temp[0]][0]
        in_temp = [0] * len(schedule)
        for name, first, last in ranges:
            buffer = _lookup(values, name)
            if buffer is not None and buffer[0] == temp[0]:
                for step in range(first, min(last, len(schedule) - 1) + 1):
                    in_temp[step] += buffer[2]
        print(f"temporaries: XLA allocates {size / GIB:.2f} GiB; at most "
              f"{max(in_temp) / GIB:.2f} GiB of values live in it at once (summed, shared "
              f"bytes counted per value)")
    for start in range(0, len(schedule), args.window):
        stop = min(len(schedule), start + args.window)
        step = max(range(start, stop), key=used.__getitem__)
        print(f"  steps {start:5d}-{stop - 1:5d}: at most {used[step] / GIB:8.2f} GiB, after "
              f"{step} ({schedule[step][:48]})")
    at = peak if args.at is None else args.at
    live = sorted(((_lookup(values, name), name, first, last) for name, first, last in ranges
                   if first <= at <= last and _lookup(values, name) is not None),
                  key=lambda v: -v[0][2])
    print(f"live after step {at} ({schedule[at]}): {used[at] / GIB:.2f} GiB")
    for (allocation, offset, size, shape), name, first, last in live[:args.top]:
        print(f"  {size / GIB:8.3f} GiB  {name}  [{first}-{last}]  {shape}  "
              f"(allocation {allocation} at {offset})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
