"""Eight simulated CPU devices, made before jax is imported anywhere; XLA:CPU's default
scheduler kept (``import peakflat_jax`` would turn it off: the operators' memory tests hold XLA's
default plans, and tests that need the other scheduler run a child process with its flag); a
seeded numpy Generator per test."""

import math
import os
import zlib

os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8"]).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("PEAKFLAT_KEEP_CPU_SCHEDULER", "1")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

# Most of the suite's time is XLA compiling small programs. JAX's persistent compilation cache
# would skip the recompiles, but executables of multi-device CPU programs read back from it
# crashed or gave wrong values about half the time in their collectives (jax 0.11.2: "Check
# failed: id < num_threads ... collective permute RendezvousKey"). So it is off unless
# PEAKFLAT_JAX_CACHE names a folder (for local loops over tests without collectives).
_cache = os.environ.get("PEAKFLAT_JAX_CACHE", "")
if _cache:
    jax.config.update("jax_compilation_cache_dir", _cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
else:
    os.environ["PEAKFLAT_JAX_CACHE"] = ""  # nor in the `peakflat` commands that tests start


def make_mesh(*axes: tuple[str, int]) -> jax.sharding.Mesh:
    """A mesh over the first prod(sizes) CPU devices with Auto axis types."""
    names = tuple(name for name, _ in axes)
    sizes = tuple(size for _, size in axes)
    return jax.make_mesh(sizes, names, axis_types=(jax.sharding.AxisType.Auto,) * len(axes),
                         devices=jax.devices()[: math.prod(sizes)])


def seed_for(nodeid: str) -> int:
    """The seed of a test: ``PEAKFLAT_SEED`` if set; else a fresh draw under ``PEAKFLAT_FUZZ=1``
    (for a nightly run that explores new inputs); else a stable hash of the test's id, so that
    every run of a commit draws the same inputs."""
    if "PEAKFLAT_SEED" in os.environ:
        return int(os.environ["PEAKFLAT_SEED"])
    if os.environ.get("PEAKFLAT_FUZZ") == "1":
        return int(np.random.SeedSequence().entropy % 2**32)
    return zlib.crc32(nodeid.encode())


@pytest.fixture
def rng(request):
    """A numpy Generator seeded by ``seed_for``; the seed is printed, so that a failure can be
    replayed with ``PEAKFLAT_SEED``."""
    seed = seed_for(request.node.nodeid)
    print(f"PEAKFLAT_SEED={seed}")
    return np.random.default_rng(seed)


@pytest.fixture(scope="session")
def torch_python() -> str:
    """The Python of .venv-torch (torch, transformers, safetensors: the PyTorch side of the
    cross-check and the Hugging Face tests), made if missing. A failure fails the test: CI must
    check."""
    import pathlib
    import subprocess

    script = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "xcheck_torch_env.sh"
    completed = subprocess.run(["bash", str(script)], capture_output=True, text=True,
                               timeout=1200)
    if completed.returncode:
        pytest.fail(f"scripts/xcheck_torch_env.sh failed:\n{completed.stderr[-4000:]}")
    return completed.stdout.strip().splitlines()[-1]
