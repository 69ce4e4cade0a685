"""Every AsyncEngineClient call returns when its server dies or freezes mid-call, close() included.

A client process (tests/e2e/client_under_kill.py) kills its server at a seeded line of close(),
generate() or get_stats() running on several clients at once; each call must end, as "ok" or with
EngineDeadError, and so must every later call. The client runs in a process of its own so that a hang
fails the test (HANG_GUARD_S is that guard: far beyond the seconds the run takes, not a timing)."""

import asyncio
import contextlib
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.test_serve import SMALL

REPO = Path(__file__).resolve().parents[2]
FLAGS = [*SMALL, "--attention-backend", "torch"]  # the reference attention: no kernel build to wait for
HANG_GUARD_S = 600.0
POINTS = [("close_idle", seed) for seed in range(4)] + [
    (phase, seed) for phase in ("close", "generate", "get_stats") for seed in range(2)]


def run_client(tmp_path: Path, address: str, pid: int, phase: str, seed: int, signum: str,
               heartbeat_timeout: float | None = None) -> dict:
    """The client process's report; fails the test with every thread's stack if it does not end."""
    args = {"address": address, "pid": pid, "phase": phase, "seed": seed, "signal": signum,
            "heartbeat_timeout": heartbeat_timeout}
    stderr_path = tmp_path / "client.stderr"
    with open(stderr_path, "wb") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "tests.e2e.client_under_kill", json.dumps(args)],
                                cwd=REPO, stdout=subprocess.PIPE, stderr=stderr)
        try:
            out, _ = proc.communicate(timeout=HANG_GUARD_S)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGUSR1)  # faulthandler: the threads' stacks of the hung client
            proc.send_signal(signal.SIGUSR2)  # and its asyncio tasks', if its event loop still runs
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)
            proc.kill()
            proc.communicate()
            pytest.fail(f"the client hung ({phase}, seed {seed}):\n{stderr_path.read_text()[-6000:]}")
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert proc.returncode == 0, stderr_path.read_text()[-6000:]
    return json.loads(out)


def assert_every_call_ended(report: dict) -> None:
    """During the phase a call ends "ok" or with EngineDeadError; after the death every call fails but close."""
    assert report["fired_at"] is not None
    for result in report["during"]:
        assert result.removeprefix("close: ") in ("ok", "EngineDeadError"), report
        if result.startswith("close: "):
            assert result == "close: ok", report
    for calls in report["after"]:
        assert calls == ["EngineDeadError"] * 4 + ["close: ok"], report


@pytest.mark.parametrize(("phase", "seed"), POINTS)
def test_every_call_returns_when_the_server_is_killed(start_server, tmp_path, phase, seed):
    server = start_server(*FLAGS)
    asyncio.run(server.wait_ready())
    report = run_client(tmp_path, server.address, server.proc.pid, phase, seed, "SIGKILL")
    assert_every_call_ended(report)
    assert server.proc.wait() == -signal.SIGKILL


def test_every_call_returns_when_the_server_freezes(start_server, tmp_path):
    """A stopped server keeps its connections open: the heartbeat timeout is what ends the calls."""
    server = start_server(*FLAGS)
    asyncio.run(server.wait_ready())
    try:
        report = run_client(tmp_path, server.address, server.proc.pid, "generate", 0, "SIGSTOP",
                            heartbeat_timeout=2.0)
    finally:
        server.proc.kill()
    assert_every_call_ended(report)


def test_a_client_left_open_when_its_event_loop_ends_is_freed(start_server, tmp_path):
    """No close(): the context is not left for the garbage collector, whose term would wait forever."""
    server = start_server(*FLAGS)
    asyncio.run(server.wait_ready())
    assert run_client(tmp_path, server.address, server.proc.pid, "abandon", 0, "SIGKILL") == {"collected": True}
