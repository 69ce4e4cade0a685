"""Connection hygiene on top of uvicorn's h11 protocol: a cap on open connections, a deadline for each request's
headers, errors of the HTTP layer in OpenAI's shape, and a shutdown that ends the handlers in flight first.

uvicorn closes an idle keep-alive connection (`timeout_keep_alive`) but waits forever for the first request of
a new connection and for headers sent a byte at a time; here the line and headers of each request must arrive
within `header_timeout` seconds of the connection's opening or of the previous response. Past
`max_connections`, a new connection closes the longest-open idle one (no request in progress: idle, or still
sending its headers), so a flood of idle or slow connections cannot lock out a client that sends a request;
with none idle, it is refused with 503.
"""

import asyncio
import socket

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from launch.api_server.errors import ApiError
from launch.api_server.state import Served


class HttpConfig(uvicorn.Config):
    def __init__(self, app, *, max_connections: int, header_timeout: float, **kwargs) -> None:
        super().__init__(app, http=GuardedH11Protocol, **kwargs)
        self.max_connections, self.header_timeout = max_connections, header_timeout


class GuardedH11Protocol(H11Protocol):
    config: HttpConfig
    head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.opened = self.loop.time()
        if len(self.connections) > self.config.max_connections and not self._close_oldest_idle():
            self._refuse(ApiError(503, f"too many open connections (--max-http-connections "
                                       f"{self.config.max_connections}); try again"))
            return
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self._disarm_head_timer()

    def on_response_complete(self) -> None:
        if self.conn.their_state is h11.SEND_BODY:  # answered before its body arrived (401, 413): do not read on
            self.transport.close()
            return
        self._arm_head_timer()
        super().on_response_complete()
        if self.conn.their_state is not h11.IDLE:  # a pipelined request's headers were already here
            self._disarm_head_timer()

    def send_400_response(self, msg: str) -> None:
        self._refuse(ApiError(400, f"invalid HTTP request: {msg}"))

    @property
    def idle(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _close_oldest_idle(self) -> bool:
        idle = [c for c in self.connections if c is not self and isinstance(c, GuardedH11Protocol) and c.idle
                and not c.transport.is_closing()]
        if not idle:
            return False
        min(idle, key=lambda c: c.opened).transport.close()
        return True

    def _refuse(self, error: ApiError) -> None:
        """Answer error at the HTTP layer, outside any request cycle, and close."""
        body = error.encode()
        head = (f"HTTP/1.1 {error.status} {_phrase(error.status)}\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
        if not self.transport.is_closing():
            self.transport.write(head.encode() + body)
            self.transport.close()

    def _arm_head_timer(self) -> None:
        self._disarm_head_timer()
        self.head_timer = self.loop.call_later(self.config.header_timeout, self._head_timeout)

    def _disarm_head_timer(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def _head_timeout(self) -> None:
        self.head_timer = None
        if self.idle and not self.transport.is_closing():
            self.transport.close()


def _phrase(status: int) -> str:
    return {400: "Bad Request", 503: "Service Unavailable"}.get(status, "Error")


class HttpServer(uvicorn.Server):
    """uvicorn's server; its shutdown first ends the handlers in flight (Served.stop), then closes connections."""

    def __init__(self, config: HttpConfig, served: Served) -> None:
        super().__init__(config)
        self.served = served

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await self.served.stop()
        await super().shutdown(sockets)
