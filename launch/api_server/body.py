"""A request body read within a size and a time limit, then decoded: every failure is an error in OpenAI's shape."""

import asyncio
import re
from typing import TypeVar

import msgspec
from fastapi import Request
from starlette.requests import ClientDisconnect

from launch.api_server.errors import ApiError, bad_body, closing

T = TypeVar("T")
_TOKENS = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}:]')  # strings (escapes included) and structure
MAX_DEPTH = 500  # past this a field is named as the one too deep (the decoder gives up near 1,000)
MAX_SCAN = 1_000_000


async def read_body(request: Request, limit: int, timeout: float) -> bytes:
    """The body; 413 past limit bytes (before reading, when Content-Length says so), 408 after timeout seconds."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise closing(413, f"the request body has {length} bytes, more than the limit of {limit} "
                           "(--max-request-body-bytes)")
    try:
        return await asyncio.wait_for(_read(request, limit), timeout)
    except asyncio.TimeoutError:
        raise closing(408, f"the request body did not arrive within {timeout:g} seconds (--http-body-timeout)"
                      ) from None
    except ClientDisconnect:
        raise ApiError(499, "the client closed the connection") from None


async def _read(request: Request, limit: int) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise closing(413, f"the request body is longer than the limit of {limit} bytes (--max-request-body-bytes)")
        chunks.append(chunk)
    return b"".join(chunks)


def decode(body: bytes, kind: type[T]) -> T:
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.DecodeError as e:
        raise bad_body(e) from None
    except RecursionError:
        raise ApiError(400, "invalid request: JSON nested too deeply", _too_deep(body)) from None


def _too_deep(body: bytes) -> str | None:
    """The top-level field whose value nests past what decoding allows: a scan of the JSON's structure (strings
    skipped, at most MAX_SCAN tokens), since the decoder cannot tell where it gave up."""
    depth, key, text = 0, None, b""
    for count, match in enumerate(_TOKENS.finditer(body)):
        token = match.group()
        if token[0] == ord('"'):
            text = token
        elif token == b":" and depth == 1:
            key = text
        elif token in (b"[", b"{"):
            depth += 1
            if depth > MAX_DEPTH and key is not None:
                return key[1:-1].decode(errors="replace")[:64]
        elif token in (b"]", b"}"):
            depth -= 1
        if count > MAX_SCAN:
            break
    return None
