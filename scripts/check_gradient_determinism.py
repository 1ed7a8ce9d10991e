"""Do the trainer's compiled programs give the same bits on every execution with the same inputs?
The check of docs/cpu_scheduler.md, for whatever machine runs it (a GPU lease: h200-1 with the
four operators on by default).

    python scripts/check_gradient_determinism.py [CONFIG] [section.field=value ...]
        [--executions 16] [--out PATH]

CONFIG (default ``h200-1``) gets ``DEFAULT_OVERRIDES`` (the four operators forced on, every
optimizer group streamed: none resident on the device, where the copies below would not fit) and
then the given overrides (``data.seq_len=16384``, say). The process's XLA flags are the ones
``peakflat train`` sets (``cli.prepare_environment``). Two programs are built by the trainer
itself (``Trainer.gradient_program``, ``Trainer.compile``) and executed ``--executions`` times
each on the same inputs, never chained:

- the loss and gradient program ``(params, extras, batch) -> (metrics, grads, extras)``;
- the step that updates: the overlapped step where the config overlaps the streamed optimizer
  (``(params, extras, opt_state, pending, batch, apply)``; pending: the gradient program's first
  gradients, apply on), else the optimizer's own step on those gradients (streamed or host-CPU
  AdamW), else the fused train step.

Each execution gets fresh copies of the inputs its program donates (``jax.device_put(...,
may_alias=False)``), so every execution starts from the same state. Every output leaf is compared
with the first execution's: leaves in device memory bit for bit in place (with their largest
absolute difference); leaves in host memory (the streamed optimizer state) one at a time on the
device by a fingerprint of their bits (three wrapping sums of their words, weighted by position),
which two different arrays share with negligible probability. The JSON record (``--out``, default
``gradient_determinism_<kind>_<time>.json``) holds the device, jax version, commit, config and
overrides, XLA_FLAGS, and per program its compile time, execution times, the leaves compared and,
per execution, how many differed and the largest difference. One summary line goes to stdout; the
exit status is 1 where any leaf differed.

Memory beyond a training step's: the copy an execution consumes of the inputs its program donates
(for h200-1's overlapped step the host-resident optimizer state, about 35 GB of host memory, and
the params and pending gradients on the device) and the first execution's device outputs. The
pinned-host pool must hold the streamed state twice: set ``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB``
(100 for h200-1 on a 125 GiB host) where the trainer's planned cap, sized for one copy, is less.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import pathlib
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from peakflat_jax import cli  # noqa: E402  (the package sets the CPU scheduler flag, as peakflat)

DEFAULT_OVERRIDES = ("operators.moe_dispatch=pipelined", "operators.loss=ring",
                     "operators.offload=all", "operators.optimizer_offload=true",
                     "optimizer.resident_groups=0")


def commit() -> str:
    """This tree's commit, ``+dirty`` where tracked files differ from it."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout
    try:
        head = git("rev-parse", "HEAD").strip() or "unknown"
    except OSError:  # no git on the machine
        return "unknown"
    return head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no").strip()
                   else "")


def copies(tree):
    """Fresh copies of every array of ``tree``, placed as they are (inputs a program donates)."""
    import jax

    return jax.tree.map(lambda a: jax.device_put(a, a.sharding, may_alias=False), tree)


class Comparison:
    """The first execution's outputs (device leaves kept, host leaves fingerprinted) and each
    later execution's differences from them."""

    def __init__(self, outputs):
        import jax

        self.first = [self._kept(leaf) for leaf in jax.tree.leaves(outputs)]
        self.host = sum(1 for kind, _ in self.first if kind == "host")
        self.differing: list[int] = []  # per later execution: leaves that differ
        self.host_differing: list[int] = []  # of which in host memory (no difference known)
        self.largest: list[float] = []  # per later execution: over the device leaves

    @staticmethod
    def _on_device(leaf):
        import jax

        if getattr(leaf.sharding, "memory_kind", None) in (None, "device"):
            return leaf
        return jax.device_put(leaf, leaf.sharding.with_memory_kind("device"))

    @classmethod
    def _kept(cls, leaf):
        if getattr(leaf.sharding, "memory_kind", None) in (None, "device"):
            return "device", leaf
        return "host", fingerprint(cls._on_device(leaf))

    def add(self, outputs) -> None:
        import jax

        differing = host_differing = 0
        largest = 0.0
        for (kind, kept), leaf in zip(self.first, jax.tree.leaves(outputs), strict=True):
            if kind == "device":
                equal, difference = compare(kept, leaf)
                differing += not equal
                largest = max(largest, difference)
            elif fingerprint(self._on_device(leaf)) != kept:
                differing += 1
                host_differing += 1
        self.differing.append(differing)
        self.host_differing.append(host_differing)
        self.largest.append(largest)


def _words(x):
    """``x``'s bits as unsigned words of its width (bools as bytes)."""
    import jax
    import jax.numpy as jnp

    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint8)
    width = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
    return x if x.dtype == width else jax.lax.bitcast_convert_type(x, width)


@functools.cache
def _jitted():
    """The fingerprint and comparison programs (jit caches them per shape and sharding)."""
    import jax
    import jax.numpy as jnp

    @jax.jit
    def fingerprint_of(x):
        words = _words(x).reshape(-1).astype(jnp.uint32)
        index = jnp.arange(words.size, dtype=jnp.uint32)
        mixed = (words ^ (words >> jnp.uint32(16))) * jnp.uint32(0x45D9F3B)
        return (jnp.sum(words, dtype=jnp.uint32),
                jnp.sum(words * (index * jnp.uint32(2) + jnp.uint32(1)), dtype=jnp.uint32),
                jnp.sum(mixed * (index * index * jnp.uint32(2) + jnp.uint32(1)),
                        dtype=jnp.uint32))

    @jax.jit
    def compare_of(a, b):
        same = jnp.all(_words(a) == _words(b))
        if a.dtype == jnp.bool_:
            return same, jnp.float32(0)
        return same, jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)),
                             initial=0.0)

    return fingerprint_of, compare_of


def fingerprint(leaf) -> tuple[int, ...]:
    """Three wrapping 32-bit sums of ``leaf``'s bits as words (narrower elements widened):
    plain, weighted by 2i + 1, and of the words mixed (xor-shift, odd multiplier) weighted by
    2i^2 + 1; computed where the leaf is."""
    return tuple(int(v) for v in _jitted()[0](leaf))


def compare(a, b) -> tuple[bool, float]:
    """(bit for bit equal, largest absolute difference) of two device arrays of one shape."""
    same, difference = _jitted()[1](a, b)
    return bool(same), float(difference)


def timed_executions(run, executions: int) -> dict:
    """Executes ``run()`` ``executions`` times; the first's outputs are the reference."""
    import jax

    seconds, comparison = [], None
    for _ in range(executions):
        started = time.perf_counter()
        outputs = run()
        jax.block_until_ready(outputs)
        seconds.append(time.perf_counter() - started)
        if comparison is None:
            comparison = Comparison(outputs)
        else:
            comparison.add(outputs)
        del outputs
    return {"execution_seconds": seconds, "leaves": len(comparison.first),
            "host_leaves": comparison.host, "leaves_differing": comparison.differing,
            "host_leaves_differing": comparison.host_differing,
            "executions_differing": sum(1 for d in comparison.differing if d),
            "max_abs_difference": max(comparison.largest, default=0.0)}


def check(config_name: str, overrides: list[str], executions: int,
          revision: str | None = None) -> dict:
    """The record of ``config_name`` with ``overrides`` (module doc)."""
    import jax
    import jaxlib.version

    from peakflat_jax.config import to_dict
    from peakflat_jax.hf.config import load_config
    from peakflat_jax.train.trainer import Trainer

    started = time.time()
    config = load_config(config_name, list(overrides))
    trainer = Trainer(config, run_dir=str(REPO / "runs" / "determinism"))
    state = trainer.initial_state()
    batch = trainer.global_batch(next(trainer.batches))
    record = {"device_kind": jax.devices()[0].device_kind, "platform": jax.default_backend(),
              "devices": jax.device_count(), "jax": jax.__version__,
              "jaxlib": jaxlib.version.__version__,
              "commit": revision or commit(), "config": config_name, "overrides": list(overrides),
              "filled_config": to_dict(trainer.config),
              "xla_flags": os.environ.get("XLA_FLAGS", ""), "executions": executions,
              "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}

    compile_started = time.perf_counter()
    gradients = trainer.gradient_program(state, batch)
    compile_seconds = time.perf_counter() - compile_started
    kept = {}

    def run_gradients():
        out = gradients(state.params, copies(state.extras), batch)
        kept.setdefault("grads", out[1])  # the first execution's, the step's pending update
        return out

    record["gradient_program"] = {"compile_seconds": compile_seconds,
                                  **timed_executions(run_gradients, executions)}
    pending = kept["grads"]

    compile_started = time.perf_counter()
    trainer.compile(state, batch)
    compile_seconds = time.perf_counter() - compile_started
    opt_state = trainer._hyperparams(state.opt_state, 0)
    if trainer.overlap:
        what, apply = "overlapped_step", trainer._replicated(True)

        def run_step():
            return trainer._overlapped_step(copies(state.params), copies(state.extras),
                                            copies(opt_state), copies(pending), batch, apply)
    elif trainer.offloaded_optimizer or trainer.host_cpu_optimizer:
        what = "optimizer_step"

        def run_step():
            return trainer.optimizer.step(copies(pending), copies(opt_state))
    else:
        what = "train_step"

        def run_step():
            return trainer._train_step(copies(state.params), copies(state.extras),
                                       copies(opt_state), batch)
    record[what] = {"compile_seconds": compile_seconds,
                    **timed_executions(run_step, executions)}
    record["step_program"] = what
    record["wall_seconds"] = time.time() - started
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", nargs="?", default="h200-1")
    parser.add_argument("overrides", nargs="*", help="section.field=value, after the defaults")
    parser.add_argument("--executions", type=int, default=16)
    parser.add_argument("--out", help="the JSON record's path")
    parser.add_argument("--commit", help="the commit to record (default: git's, where the tree "
                                             "is a checkout)")
    parser.add_argument("--no-default-overrides", action="store_true",
                        help="the config's own operators (DEFAULT_OVERRIDES not applied)")
    args = parser.parse_args(argv)
    if args.executions < 2:
        parser.error("--executions: at least 2 (the first is the reference)")
    cli.prepare_environment()
    overrides = [*(() if args.no_default_overrides else DEFAULT_OVERRIDES), *args.overrides]
    record = check(args.config, overrides, args.executions, args.commit)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    kind = record["device_kind"].replace(" ", "_")
    out = pathlib.Path(args.out or f"gradient_determinism_{kind}_{stamp}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1, default=str))
    step = record[record["step_program"]]
    grads = record["gradient_program"]
    print(f"{record['device_kind']} x{record['devices']} {record['config']} "
          f"{' '.join(overrides)}: gradient program {grads['executions_differing']} of "
          f"{args.executions - 1} executions differ from the first ({grads['leaves']} leaves, max "
          f"|diff| {grads['max_abs_difference']}); {record['step_program']} "
          f"{step['executions_differing']} of {args.executions - 1} ({step['leaves']} leaves, "
          f"{step['host_leaves']} in host memory, max |diff| in device memory "
          f"{step['max_abs_difference']}); "
          f"{out}")
    return 1 if grads["executions_differing"] or step["executions_differing"] else 0


if __name__ == "__main__":
    sys.exit(main())
