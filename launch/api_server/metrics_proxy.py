"""/metrics of the HTTP API: the engine core's own Prometheus registry, fetched from its metrics endpoint."""

import asyncio
from urllib.parse import urlsplit

from launch.api_server.errors import ApiError

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
FETCH_TIMEOUT = 10.0  # seconds for the engine's endpoint to answer


async def fetch_metrics(url: str) -> bytes:
    """The exposition text at url (plain HTTP/1.0 GET); 503 if the engine's endpoint does not answer."""
    parts = urlsplit(url)
    try:
        return await asyncio.wait_for(_get(parts.hostname or "127.0.0.1", parts.port or 80, parts.path),
                                      FETCH_TIMEOUT)
    except (OSError, asyncio.TimeoutError, ValueError) as e:
        raise ApiError(503, f"the engine's metrics endpoint does not answer: {e!r}") from None


async def _get(host: str, port: int, path: str) -> bytes:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(f"GET {path} HTTP/1.0\r\nHost: {host}\r\n\r\n".encode())
        head, _, body = (await reader.read()).partition(b"\r\n\r\n")
    finally:
        writer.close()
    if not head.startswith(b"HTTP/1.1 200") and not head.startswith(b"HTTP/1.0 200"):
        raise ValueError(head.split(b"\r\n", 1)[0].decode("latin-1"))
    return body
