"""Session set-up shared by every test folder."""

import contextlib

import pytest

from worker.ops.cpu_attention import CpuAttentionUnavailable, load_extension


@pytest.fixture(scope="session", autouse=True)
def cpu_attention_built() -> None:
    """Compile the CPU attention kernel once, before any server starts (its workers then load the cached build).
    Where it cannot be built, servers fall back to the torch path and test_cpu_attention_kernel.py says why."""
    with contextlib.suppress(CpuAttentionUnavailable):
        load_extension()
