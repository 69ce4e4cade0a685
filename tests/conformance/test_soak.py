"""Soak: mixed load with aborts, vanishing clients and preemption, then every request accounted for.

    python -m pytest -m conformance tests/conformance/test_soak.py

A server of its own with a small KV cache (so that requests get preempted), KVENGINE_SOAK_SECONDS of load (default
60) from six clients; soak_support.py says how each request may end. Fails if any request was lost or hung, if greedy
requests of one prompt got other tokens (float32), if the server died, or if the pool is not back to idle at the end.
The RSS of the engine core and of each worker, before and after, are among the figures printed.
"""

import asyncio
import os

import pytest

from tests.conformance.soak_support import SoakSettings, run_soak

pytestmark = pytest.mark.conformance


def test_every_request_ends_and_the_pool_comes_back_to_idle(tmp_path, conformance_figures):
    settings = SoakSettings(duration=float(os.environ.get("KVENGINE_SOAK_SECONDS", "60")))
    log = tmp_path / "server.log"
    try:
        result = asyncio.run(run_soak(settings, log))
    except Exception as e:  # noqa: BLE001 - whatever ended the soak early, shown with the server's own account
        pytest.fail(f"the soak ended early: {type(e).__name__}: {e}\nserver log:\n{log.read_text()[-3000:]}")
    conformance_figures.extend(result.figures())
    context = "\n".join([*result.figures(), *result.errors[:10], log.read_text()[-3000:]])
    assert result.outcomes["lost"] == result.outcomes["hung"] == 0, context
    assert result.mismatches == 0, context
    assert result.alive and result.idle(), context
    assert result.outcomes["finished"] > 0, context
