"""The ASGI layer around every route: who the user is (auth.ApiKeys), what the request leaves to clean up, and
its end at shutdown.

A handler may register cleanups (`cleanup(request, coroutine_function)`): they run once the response has ended,
streamed or not, whatever ended it. At shutdown `Served.stop` cancels the handlers in flight: each answers 503
(or, mid-stream, ends its stream with an error event), so none is left for uvicorn to cancel.
"""

import asyncio
import logging
from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from launch.api_server.auth import User
from launch.api_server.errors import ApiError
from launch.api_server.state import Served

logger = logging.getLogger(__name__)
Cleanup = Callable[[], Awaitable[None]]


def user_of(request: Request) -> User:
    return request.state.user


def cleanup(request: Request, work: Cleanup) -> None:
    request.state.cleanups.append(work)


class _Sent:
    """send, noting how far the response got."""

    def __init__(self, send: Send) -> None:
        self.send = send
        self.started = self.complete = self.sse = False

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
            self.sse = any(name == b"content-type" and value.startswith(b"text/event-stream")
                           for name, value in message.get("headers", []))
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            self.complete = True
        await self.send(message)


class Guard:
    def __init__(self, app: ASGIApp, served: Served) -> None:
        self.app, self.served = app, served

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        try:
            if self.served.stopping:
                raise ApiError(503, "the server is shutting down")
            user = self.served.keys.user(scope["path"], _header(scope, b"authorization"), scope.get("client"))
        except ApiError as e:
            return await e.response()(scope, receive, send)
        cleanups: list[Cleanup] = []
        scope.setdefault("state", {}).update(user=user, cleanups=cleanups)
        task = asyncio.current_task()
        assert task is not None
        self.served.handlers.add(task)
        sent = _Sent(send)
        try:
            await self.app(scope, receive, sent)
        except asyncio.CancelledError:
            if not self.served.stopping:
                raise
            await _end(scope, receive, sent)
        finally:
            self.served.handlers.discard(task)
            for work in reversed(cleanups):
                await work()


async def _end(scope: Scope, receive: Receive, sent: _Sent) -> None:
    """The answer of a handler that shutdown cancelled."""
    error = ApiError(503, "the server is shutting down")
    if not sent.started:
        await error.response()(scope, receive, sent)
    elif not sent.complete:
        body = b"data: " + error.encode() + b"\n\ndata: [DONE]\n\n" if sent.sse else b""
        await sent({"type": "http.response.body", "body": body, "more_body": False})


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None
