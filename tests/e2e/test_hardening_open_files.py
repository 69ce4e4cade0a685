"""A server whose clients' connections reach its open-file limit keeps serving (RLIMIT_NOFILE 256, 300 idle
connections): libzmq's ipc:// listener aborts the process when accept() finds no descriptor, so the server
hides its socket file while connections hold half the limit (engine_core/listener_gate.py); the tcp://
listener survives the limit by itself. A client connected before the flood is served during it, and once the
flood leaves a new client is served too."""

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from launch.client import AsyncEngineClient
from launch.commands.local_server import wait_until_serving
from protocol import SamplingParams
from tests.e2e.conftest import processes_in_group, wait_exit
from tests.e2e.serve_support import free_port
from tests.e2e.test_serve import SMALL

LIMIT = 256
FLOOD = 300
LIVENESS = 60.0  # seconds: a bound for an answer that should come at once, not a timing
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


# Runs a Python command under an open-file limit (soft = hard = argv[1]), in the same process (exec).
UNDER_LIMIT = ("import os, resource, sys; resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[1]),) * 2); "
               "os.execv(sys.executable, [sys.executable, *sys.argv[2:]])")


def connect(address: str) -> socket.socket:
    """A non-blocking connection (raises OSError as connect() does)."""
    if address.startswith("ipc://"):
        sock, target = socket.socket(socket.AF_UNIX), address.removeprefix("ipc://")
    else:
        host, port = address.removeprefix("tcp://").rsplit(":", 1)
        sock, target = socket.socket(socket.AF_INET), (host, int(port))
    sock.setblocking(False)  # a full accept queue must not block the flood
    try:
        sock.connect(target)
    except BlockingIOError:
        if address.startswith("ipc://"):  # the queue of connections to accept is full: the caller tries again
            sock.close()
            raise
        # tcp: the handshake goes on in the kernel
    except OSError:
        sock.close()
        raise
    return sock


def open_idle_connections(address: str) -> tuple[list[socket.socket], bool]:
    """Up to FLOOD connections that never speak, each tried until the server takes it; stops early, saying
    so, where the socket file is gone (hidden), or at anything else that refuses (a server gone)."""
    opened: list[socket.socket] = []
    for _ in range(100 * FLOOD):  # a bound on the tries, for a server that neither takes nor refuses
        if len(opened) == FLOOD:
            break
        try:
            opened.append(connect(address))
        except BlockingIOError:
            continue
        except FileNotFoundError:
            return opened, True
        except OSError:
            break
    return opened, False


async def generate(client: AsyncEngineClient) -> list[int]:
    tokens = []
    async for out in client.generate([5, 17, 300, 42, 9], PARAMS):
        tokens += out.new_token_ids
    return tokens


async def flood_and_serve(address: str) -> tuple[list[int], list[int], list[int], bool]:
    """Tokens before the flood, during it (same client) and after it (a new client); whether the flood found
    the socket file gone."""
    async with AsyncEngineClient(address) as good:
        before = await asyncio.wait_for(generate(good), LIVENESS)
        flood, turned_away = open_idle_connections(address)
        try:
            during = await asyncio.wait_for(generate(good), LIVENESS)
        finally:
            for sock in flood:
                sock.close()
    async with AsyncEngineClient(address, connect_timeout=LIVENESS) as late:
        after = await asyncio.wait_for(generate(late), LIVENESS)
    return before, during, after, turned_away


@pytest.mark.parametrize("scheme", ["ipc", "tcp"])
def test_clients_that_exhaust_the_open_file_limit_do_not_stop_the_server(tmp_path, scheme):
    address = f"ipc://{tmp_path}/engine.sock" if scheme == "ipc" else f"tcp://127.0.0.1:{free_port()}"
    log_path = tmp_path / "server.log"
    with open(log_path, "wb") as log:
        server = subprocess.Popen(
            [sys.executable, "-c", UNDER_LIMIT, str(LIMIT), "-m", "launch.cli", "serve", "--address", address,
             "--api-server-count", "0", *SMALL, "--attention-backend", "torch"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=Path(__file__).resolve().parents[2])
    try:
        asyncio.run(wait_until_serving(address, server))
        before, during, after, turned_away = asyncio.run(flood_and_serve(address))
        assert server.poll() is None, log_path.read_text()[-3000:]
        output = log_path.read_text()
    finally:
        stop(server)
    assert before == during == after and len(before) == PARAMS.max_tokens
    assert "Too many open files" not in output
    if scheme == "ipc":
        assert "new clients wait" in output and "new clients are accepted again" in output, output[-3000:]
        assert turned_away


def stop(server: subprocess.Popen) -> None:
    if server.poll() is None:
        server.send_signal(signal.SIGTERM)
        wait_exit(server)
    for pid in processes_in_group(server.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    if server.poll() is None:
        server.kill()
        server.wait()
