"""Session set-up shared by every test folder."""

import contextlib

import pytest
from hypothesis import settings

from worker.ops.cpu_attention import CpuAttentionUnavailable, load_extension

# No wall-clock limit per example: hypothesis's default 200 ms deadline fails a test when a loaded machine pauses it.
settings.register_profile("kvengine", deadline=None)
settings.load_profile("kvengine")


@pytest.fixture(scope="session", autouse=True)
def cpu_attention_built() -> None:
    """Compile the CPU attention kernel once, before any server starts (its workers then load the cached build).
    Where it cannot be built, servers fall back to the torch path and test_cpu_attention_kernel.py says why."""
    with contextlib.suppress(CpuAttentionUnavailable):
        load_extension()
