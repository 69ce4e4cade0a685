"""The /metrics endpoint over real sockets: idle, slow and flooding clients take no thread and block no scraper."""

import asyncio
import contextlib
import socket
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from engine_core.metrics import MAX_CONNECTIONS, EngineMetrics, MetricsServer
from tests.e2e.conftest import ServerProcess
from tests.e2e.serve_support import free_port

LIVENESS_S = 60  # socket timeouts: only so that a broken server fails the test instead of hanging it


def scrape(port: int, path: str = "/metrics") -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=LIVENESS_S).read().decode()


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=LIVENESS_S)


def closed_by_server(sock: socket.socket) -> bool:
    """True once the server closed it without an answer (a reset when it left our bytes unread)."""
    try:
        return sock.recv(1024) == b""
    except ConnectionResetError:
        return True


@contextlib.contextmanager
def idle_connections(port: int, n: int):
    socks = []
    try:
        socks += [connect(port) for _ in range(n)]
        yield socks
    finally:
        for sock in socks:
            sock.close()


@pytest.fixture
def metrics():
    m = EngineMetrics(block_size=16)
    m.serve(0)
    yield m
    m.close()


def test_200_idle_connections_start_no_thread_and_a_scrape_answers(metrics):
    assert metrics.server is not None
    metrics.kv_cache_usage.set(0.25)
    before = threading.active_count()
    with idle_connections(metrics.server.port, 200):
        text = scrape(metrics.server.port)  # accepted after the 200: the server has seen them all
        assert threading.active_count() <= before + 1
        assert len(metrics.server.connections) <= MAX_CONNECTIONS
    assert "kvengine:kv_cache_usage_perc 0.25" in text


def test_a_slow_client_is_cut_off_after_the_timeout_and_others_are_served_meanwhile():
    server = MetricsServer(CollectorRegistry(), "127.0.0.1", 0, timeout=0.5)
    try:
        slow = connect(server.port)
        slow.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # the head never ends
        scrape(server.port)
        assert closed_by_server(slow)
        slow.close()
    finally:
        server.close()


def test_beyond_max_connections_the_oldest_is_dropped_for_the_new_one():
    server = MetricsServer(CollectorRegistry(), "127.0.0.1", 0, timeout=3600, max_connections=4)
    try:
        with idle_connections(server.port, 4) as socks:
            scrape(server.port)  # the fifth connection
            assert closed_by_server(socks[0])  # the oldest, long before its timeout
            socks[1].sendall(b"GET /metrics HTTP/1.0\r\n\r\n")  # the others still get their answer
            assert socks[1].recv(1024).startswith(b"HTTP/1.1 200 OK")
    finally:
        server.close()


def test_http_details(metrics):
    assert metrics.server is not None
    port = metrics.server.port
    with pytest.raises(urllib.error.HTTPError, match="405"):
        urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/metrics", data=b"x"),
                               timeout=LIVENESS_S)
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics",
                                     headers={"Accept": "application/openmetrics-text; version=1.0.0"})
    with urllib.request.urlopen(request, timeout=LIVENESS_S) as reply:
        assert reply.headers["Content-Type"].startswith("application/openmetrics-text")
        assert reply.read().decode().endswith("# EOF\n")
    assert "kvengine:num_preemptions_total" not in scrape(port, "/metrics?name[]=kvengine:num_requests_running")
    with connect(port) as sock:
        sock.sendall(b"nonsense\r\n\r\n")
        assert sock.recv(1024).startswith(b"HTTP/1.1 400 Bad Request")
    with connect(port) as sock:  # prometheus_client raises a TypeError on this header
        sock.sendall(b"GET /metrics HTTP/1.1\r\nAccept: text/plain; version=abc\r\n\r\n")
        assert sock.recv(1024).startswith(b"HTTP/1.1 500 Internal Server Error")
    with connect(port) as sock:
        sock.sendall(b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 20000)  # a head over the limit
        assert closed_by_server(sock)


def test_close_with_open_connections_stops_the_thread_and_frees_the_port():
    server = MetricsServer(CollectorRegistry(), "127.0.0.1", 0)
    with idle_connections(server.port, 5) as socks:
        scrape(server.port)
        server.close()
        assert not server.thread.is_alive()
        assert all(closed_by_server(sock) for sock in socks)
    with pytest.raises(ConnectionRefusedError):
        connect(server.port)


def proc_threads(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("Threads:")).split()[1])


def test_the_serve_process_keeps_its_thread_count_under_200_idle_connections(tmp_path):
    port = free_port()
    server = ServerProcess(tmp_path, ["--max-model-len", "128", "--kv-cache-memory-bytes", "4MiB",
                                      "--metrics-port", str(port)])
    try:
        asyncio.run(server.wait_ready())
        scrape(port)
        before = proc_threads(server.proc.pid)
        with idle_connections(port, 200):
            assert "kvengine:kv_cache_usage_perc" in scrape(port)
            assert proc_threads(server.proc.pid) <= before + 1
    finally:
        server.stop()
