"""A small asyncio HTTP/1.1 client for OpenAI-compatible servers: POST JSON, read server-sent events.

Plain asyncio streams, so that a load generator measures the server, not a heavy client library.
"""

import asyncio
import json
from collections.abc import AsyncIterator
from urllib.parse import urlsplit


class HttpError(RuntimeError):
    pass


async def get_json(url: str, api_key: str | None = None) -> dict:
    reader, writer = await _send(url, "GET", b"", api_key)
    try:
        status, headers = await _read_head(reader)
        body = b"".join([chunk async for chunk in _body(reader, headers)])
    finally:
        writer.close()
    if status != 200:
        raise HttpError(f"GET {url}: HTTP {status}: {body[:500].decode(errors='replace')}")
    return json.loads(body)


async def post_sse(url: str, payload: dict, api_key: str | None = None) -> AsyncIterator[dict]:
    """POST payload as JSON and yield the JSON of each `data:` event until `[DONE]`."""
    reader, writer = await _send(url, "POST", json.dumps(payload).encode(), api_key)
    try:
        status, headers = await _read_head(reader)
        if status != 200:
            body = b"".join([chunk async for chunk in _body(reader, headers)])
            raise HttpError(f"POST {url}: HTTP {status}: {body[:500].decode(errors='replace')}")
        buffer = b""
        async for chunk in _body(reader, headers):
            buffer += chunk.replace(b"\r\n", b"\n")
            *events, buffer = buffer.split(b"\n\n")
            for event in events:
                data = event.strip().removeprefix(b"data:").strip()
                if data == b"[DONE]":
                    return
                if data:
                    yield json.loads(data)
    finally:
        writer.close()


async def _send(url: str, method: str, body: bytes,
                api_key: str | None) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    parts = urlsplit(url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port or 80, limit=1 << 20)
    auth = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
    head = (f"{method} {parts.path or '/'} HTTP/1.1\r\nHost: {parts.netloc}\r\nConnection: close\r\n{auth}"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
    writer.write(head.encode() + body)
    await writer.drain()
    return reader, writer


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    status_line, *lines = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
    headers = {}
    for line in lines:
        name, _, value = line.partition(":")
        if name:
            headers[name.strip().lower()] = value.strip()
    return int(status_line.split(" ")[1]), headers


async def _body(reader: asyncio.StreamReader, headers: dict[str, str]) -> AsyncIterator[bytes]:
    """The body as it arrives: chunked transfer encoding, a Content-Length, or until the connection closes."""
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while size := int((await reader.readuntil(b"\r\n")).split(b";")[0], 16):
            yield (await reader.readexactly(size + 2))[:-2]
        return
    if "content-length" in headers:
        yield await reader.readexactly(int(headers["content-length"]))
        return
    while chunk := await reader.read(1 << 16):
        yield chunk
