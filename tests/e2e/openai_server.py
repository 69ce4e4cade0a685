"""Helpers for the HTTP API tests: start `kvengine serve` with its API on a free port, talk raw HTTP to it."""

import asyncio
import http.client
import json
from collections.abc import Iterator

from tests.e2e.conftest import ServerProcess, wait_until
from tests.e2e.serve_support import free_port

SMALL = ["--max-model-len", "256", "--kv-cache-memory-bytes", "8MiB"]


class ApiServer:
    """A started server and the base URL of its HTTP API."""

    def __init__(self, server: ServerProcess, port: int) -> None:
        self.server, self.port = server, port
        self.base_url = f"http://127.0.0.1:{port}"

    def request(self, method: str, path: str, body: object = None) -> tuple[int, dict | str]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        try:
            conn.request(method, path, None if body is None else json.dumps(body),
                         {"Content-Type": "application/json"})
            response = conn.getresponse()
            data = response.read().decode()
        finally:
            conn.close()
        is_json = response.getheader("Content-Type", "").startswith("application/json")
        return response.status, json.loads(data) if is_json else data

    def health(self) -> int | None:
        try:
            return self.request("GET", "/health")[0]
        except OSError:
            return None


def start_api_server(start_server, *flags: str) -> ApiServer:
    """Start a server with the HTTP API on a free port; return once /health answers 200."""
    port = free_port()
    server = start_server("--port", str(port), *flags)
    asyncio.run(server.wait_ready())
    api = ApiServer(server, port)
    assert wait_until(lambda: api.health() == 200, 120), server.output()
    return api


def sse_events(response: http.client.HTTPResponse) -> Iterator[str]:
    """The data fields of a server-sent event stream, read line by line as they arrive."""
    for raw in response:
        line = raw.decode().rstrip("\r\n")
        if line.startswith("data: "):
            yield line.removeprefix("data: ")
