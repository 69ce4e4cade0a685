"""End-to-end process faults: a worker that dies while the engine is idle or hangs mid-step, stop
signals to the engine or to its whole process group, and more clients than a low open-file limit."""

import asyncio
import contextlib
import os
import signal
import socket
import sys

import pytest

from tests.e2e.conftest import processes_in_group, wait_exit
from tests.e2e.serve_support import SMALL, generate_all, prompts, stream_after_first_outputs


def test_a_worker_that_dies_while_idle_stops_the_server(start_server):
    server = start_server("-tp", "2", *SMALL)
    asyncio.run(server.wait_ready())
    os.kill(server.worker_pids()[1], signal.SIGKILL)
    # No request follows: only the idle loop's liveness check can notice.
    assert wait_exit(server.proc) == 1, server.output()
    assert "worker rank 1 died (exit code -9)" in server.output()
    assert processes_in_group(server.proc.pid) == []


def test_a_stopped_worker_is_named_after_the_step_timeout(start_server):
    server = start_server("-tp", "2", "--step-timeout", "3", *SMALL)
    asyncio.run(server.wait_ready())
    stopped = server.worker_pids()[1]
    try:
        stop_rank_1 = stream_after_first_outputs(server.address, 2, lambda: os.kill(stopped, signal.SIGSTOP))
        outputs = asyncio.run(asyncio.wait_for(stop_rank_1, 60))  # a liveness bound: without a timeout it hangs
    finally:
        with contextlib.suppress(ProcessLookupError):  # the server should have killed it; if not, let it go on
            os.kill(stopped, signal.SIGCONT)
    assert [outs[-1].finish_reason for outs in outputs] == ["error", "error"]
    assert "worker rank 1 did not answer step" in outputs[0][-1].error
    assert wait_exit(server.proc) == 1
    assert "worker rank 1 did not answer step" in server.output() and "(its process is stopped)" in server.output()
    assert processes_in_group(server.proc.pid) == []


@pytest.mark.parametrize("stop", ["sighup", "sigterm_to_the_group"])
def test_stop_signals_abort_requests_and_exit_cleanly(start_server, stop):
    server = start_server("-tp", "2", *SMALL)
    asyncio.run(server.wait_ready())

    def send() -> None:
        if stop == "sighup":  # the terminal closed
            server.proc.send_signal(signal.SIGHUP)
        else:  # a container or cgroup stop: every process of the group at once
            os.killpg(server.proc.pid, signal.SIGTERM)

    outputs = asyncio.run(stream_after_first_outputs(server.address, 3, send))
    assert [outs[-1].finish_reason for outs in outputs] == ["abort"] * 3
    assert wait_exit(server.proc) == 0, server.output()
    assert processes_in_group(server.proc.pid) == []
    assert f"Received {'SIGHUP' if stop == 'sighup' else 'SIGTERM'}, shutting down" in server.output()


def test_more_clients_than_a_low_open_file_limit(start_server, tmp_path, monkeypatch):
    # The server starts as after `ulimit -Sn 64` in its shell (hard limit 4096): without raising the soft
    # limit, libzmq's ipc listener aborts the engine at the 50th connection or so.
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nulimit -S -n 64 && ulimit -H -n 4096 && exec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    with monkeypatch.context() as m:
        m.setattr(sys, "executable", str(python))
        server = start_server(*SMALL)
    asyncio.run(server.wait_ready())
    path = server.address.removeprefix("ipc://")
    with contextlib.ExitStack() as idle_clients:
        for _ in range(200):
            sock = idle_clients.enter_context(socket.socket(socket.AF_UNIX))
            sock.connect(path)
        results = asyncio.run(generate_all(server.address, prompts(1)))
        assert results[0][1].finish_reason == "length"
        assert server.proc.poll() is None
