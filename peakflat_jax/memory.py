"""Measuring memory: XLA's buffer plan, peaks on a device, and arrays that must not exist.

Three views, used by tests (CPU) and benchmarks (GPU) alike:

* ``compiled_memory(compiled)``: XLA's static plan of a compiled program (temp, arguments,
  outputs, aliases, host temp). Deterministic; on GPU it leaves out fragmentation and library
  workspaces, on CPU fused chains may plan temp = 0.
* ``peak_device_bytes()``: the allocator's ``peak_bytes_in_use`` (GPU only). It never resets in
  jax 0.11.2, so each case is measured in a fresh process: ``run_in_fresh_process``.
* ``largest_arrays(compiled)`` / ``assert_no_array_at_least``: a structural proof on the optimized
  HLO that no array of a forbidden size (e.g. N x V logits) exists anywhere in the program, loop
  bodies and custom-VJP replays included.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import subprocess
import sys

import jax

# An HLO array type such as `f32[2048,16384]{1,0}` or `bf16[8]`; tuples are walked element-wise.
_HLO_ARRAY = re.compile(r"\b(pred|bf16|[subfc][0-9]+[a-z0-9]*)\[([0-9,]*)\]")  # f8e4m3fnuz too


@dataclasses.dataclass(frozen=True)
class CompiledMemory:
    """XLA's memory plan of one compiled program, in bytes (per device for SPMD programs)."""

    temp: int
    """Scratch buffers live during execution: where unbounded intermediates show up."""
    argument: int
    output: int
    alias: int
    """Output bytes that reuse (donated) argument buffers."""
    host_temp: int
    """Scratch in host memory (offloaded buffers)."""

    @property
    def total(self) -> int:
        """The device bytes the program needs at its peak by XLA's plan."""
        return self.temp + self.argument + self.output - self.alias


def compiled_memory(compiled) -> CompiledMemory:
    """Reads ``compiled.memory_analysis()`` of a ``jax.stages.Compiled``."""
    analysis = compiled.memory_analysis()
    return CompiledMemory(
        temp=int(analysis.temp_size_in_bytes),
        argument=int(analysis.argument_size_in_bytes),
        output=int(analysis.output_size_in_bytes),
        alias=int(analysis.alias_size_in_bytes),
        host_temp=int(getattr(analysis, "host_temp_size_in_bytes", 0) or 0),
    )


def largest_arrays(compiled_or_text, count: int = 5) -> list[tuple[int, str]]:
    """The ``count`` largest array types (elements, HLO type) in an optimized HLO program."""
    text = compiled_or_text if isinstance(compiled_or_text, str) else compiled_or_text.as_text()
    sizes = {}
    for match in _HLO_ARRAY.finditer(text):
        dims = [int(d) for d in match.group(2).split(",") if d]
        sizes[match.group(0)] = math.prod(dims)
    return sorted(((n, t) for t, n in sizes.items()), reverse=True)[:count]


def assert_no_array_at_least(compiled_or_text, elements: int, *, what: str = "array") -> None:
    """Raises AssertionError if any array in the program has ``elements`` elements or more."""
    largest = largest_arrays(compiled_or_text, count=1)
    if largest and largest[0][0] >= elements:
        raise AssertionError(f"a {what} of {largest[0][0]:,} elements ({largest[0][1]}) exists in "
                             f"the compiled program; the bound forbids {elements:,} or more")


def peak_device_bytes(device=None) -> int | None:
    """``peak_bytes_in_use`` of a device since its process started (None where unsupported)."""
    device = device or jax.local_devices()[0]
    stats = device.memory_stats()
    return None if stats is None else int(stats.get("peak_bytes_in_use", 0))


def run_in_fresh_process(module: str, args: list[str], *, timeout: float = 600,
                         env: dict | None = None) -> dict:
    """Runs ``python -m module *args`` in a new process and returns the JSON object that it
    prints as its last line of stdout, so that each case's peak memory is its own."""
    merged_env = {**os.environ, **(env or {})}
    try:
        result = subprocess.run([sys.executable, "-m", module, *args], capture_output=True,
                                text=True, timeout=timeout, env=merged_env)
    except subprocess.TimeoutExpired as expired:  # one slow case must not lose the others
        return {"error": f"timeout after {timeout} s",
                "stderr_tail": (expired.stderr or b"")[-3000:].decode(errors="replace")}
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if result.returncode != 0 or not lines:
        return {"error": f"exit {result.returncode}", "stderr_tail": result.stderr[-3000:]}
    return json.loads(lines[-1])
