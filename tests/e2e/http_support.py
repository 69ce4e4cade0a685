"""Helpers for the HTTP front-door tests: raw requests with any headers and body, the API processes' memory, the
engine's stats, and sockets held open the way a hostile client holds them."""

import asyncio
import http.client
import json
import socket
from pathlib import Path

from launch.client import AsyncEngineClient
from protocol import SchedulerStats
from tests.e2e.conftest import cmdline, processes_in_group
from tests.e2e.openai_server import ApiServer

SMALL = ["--max-model-len", "256", "--kv-cache-memory-bytes", "8MiB"]
ANSWER_WAIT = 300.0  # seconds a client waits for an answer: a liveness bound, not a timing


def send(api: ApiServer, method: str, path: str, body: object = None, headers: dict[str, str] | None = None,
         raw: bytes | None = None) -> tuple[int, dict | str, dict[str, str]]:
    """(status, the body as JSON when it is JSON, the response headers); body as JSON, or raw bytes."""
    conn = http.client.HTTPConnection("127.0.0.1", api.port, timeout=ANSWER_WAIT)
    try:
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        conn.request(method, path, data, {"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        text = response.read().decode()
    finally:
        conn.close()
    is_json = (response.getheader("Content-Type") or "").startswith("application/json")
    return response.status, json.loads(text) if is_json else text, {k.lower(): v for k, v in response.getheaders()}


def error_of(answer: dict | str) -> dict:
    """The error object of an answer in OpenAI's shape (fails the test on any other shape)."""
    assert isinstance(answer, dict) and set(answer) == {"error"}, answer
    assert set(answer["error"]) == {"message", "type", "param", "code"}, answer
    return answer["error"]


def api_pids(api: ApiServer) -> list[int]:
    return [p for p in processes_in_group(api.server.proc.pid) if "launch.api_server.process" in cmdline(p)]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


def stats(api: ApiServer) -> SchedulerStats:
    async def get() -> SchedulerStats:
        async with AsyncEngineClient(api.server.address) as client:
            return await client.get_stats()

    return asyncio.run(get())


def idle(api: ApiServer) -> bool:
    """The engine runs nothing and holds no KV block."""
    now = stats(api)
    return now.num_running_reqs == 0 and now.num_waiting_reqs == 0 and now.num_blocks_held == 0


def closed_by_peer(sock: socket.socket) -> bool:
    """Whether the server has closed this socket (reads what it sent before, without waiting)."""
    sock.setblocking(False)
    try:
        while sock.recv(65536):
            pass
    except BlockingIOError:
        return False
    except OSError:
        return True
    return True


def raw_exchange(port: int, data: bytes) -> bytes:
    """Send bytes on a fresh connection; everything the server answers until it closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=ANSWER_WAIT) as sock:
        sock.sendall(data)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)
