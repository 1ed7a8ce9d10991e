"""Eight simulated CPU devices, made before jax is imported anywhere."""

import os

os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8"]).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402


def make_mesh(*axes: tuple[str, int]) -> jax.sharding.Mesh:
    """A mesh over the first prod(sizes) CPU devices with Auto axis types."""
    names = tuple(name for name, _ in axes)
    sizes = tuple(size for _, size in axes)
    return jax.make_mesh(sizes, names, axis_types=(jax.sharding.AxisType.Auto,) * len(axes),
                         devices=jax.devices()[: int(__import__("math").prod(sizes))])


@pytest.fixture
def rng(request):
    """A fresh numpy Generator per test, seeded from the test's name and a random draw, logged so
    a failure can be replayed with PEAKFLAT_SEED."""
    import numpy as np

    seed = int(os.environ.get("PEAKFLAT_SEED", np.random.SeedSequence().entropy % 2**32))
    print(f"PEAKFLAT_SEED={seed}")
    return np.random.default_rng(seed)
