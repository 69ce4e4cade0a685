"""An asyncio client for a running `kvengine serve`: many concurrent streamed requests on one socket.

    async with AsyncEngineClient(address) as client:
        async for out in client.generate([1, 2, 3], SamplingParams(max_tokens=8, temperature=0)):
            print(out.new_token_ids, out.finish_reason)

Leaving the loop early (break, cancellation) aborts the request in the engine. Until the server
has answered once, a call raises EngineDeadError after `connect_timeout` seconds without an answer
(so a wrong address fails instead of hanging); afterwards a lost connection raises it, and so does a
server that answers no heartbeat for `heartbeat_timeout` seconds (stopped, or its host unreachable).
No call waits on a server that is gone: close() returns whatever the server does, and ends the calls
still waiting on the client with EngineDeadError.
"""

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from engine_core.socket_monitor import monitor_socket
from launch.client.parallel_sampling import ParentRequest, fan_out
from protocol import (
    EngineCoreAbort,
    EngineCoreGetStats,
    EngineCoreRequest,
    EngineCoreResetPrefixCache,
    ProtocolError,
    SamplingParams,
    SchedulerStats,
    TokenLogprobs,
)
from protocol.codec import client_codec, outputs_codec

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self from Python 3.11 on

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The server went away with requests in flight, or none answered at the address."""


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None  # "length", "stop", "abort" or "error" on the last output
    num_cached_tokens: int
    error: str | None = None
    logprobs: list[TokenLogprobs] | None = None  # one per new token, with SamplingParams(logprobs=k)
    # with SamplingParams(prompt_logprobs=k), on the first output: one per prompt token from the second on
    prompt_logprobs: list[TokenLogprobs] | None = None
    index: int = 0  # which of the n sequences (SamplingParams.n > 1)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class AsyncEngineClient:
    def __init__(self, address: str, connect_timeout: float | None = 10.0, heartbeat_timeout: float = 30.0) -> None:
        """connect_timeout: until the server has answered once, a call that gets no answer within this many
        seconds raises EngineDeadError (None: wait as long as it takes, e.g. while a server starts).
        heartbeat_timeout: a connected server that answers no ZeroMQ heartbeat for this many seconds is dead
        (the server's I/O thread answers them, also while its engine is busy)."""
        if not heartbeat_timeout > 0:
            raise ValueError(f"heartbeat_timeout must be > 0, got {heartbeat_timeout}")
        self.address = address
        self.connect_timeout = connect_timeout
        self.heartbeat_timeout = heartbeat_timeout
        self._ctx: zmq.asyncio.Context | None = None
        self._closed = False
        self._seen = False
        self._probe: asyncio.Task | None = None
        self._queues: dict[str, asyncio.Queue] = {}
        self._parents: dict[str, ParentRequest] = {}  # n > 1 requests in flight, by their id
        self._stats_waiters: list[asyncio.Future] = []
        self._reset_waiters: list[asyncio.Future] = []
        self._tasks: list[asyncio.Task] = []
        self._dead: str | None = None
        self._request_codec, self._outputs_codec = client_codec(), outputs_codec()

    async def __aenter__(self) -> "Self":
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._died = asyncio.get_running_loop().create_future()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        # A ping goes out within half the timeout of the last traffic and waits half the timeout for any answer.
        half_ms = max(1, round(self.heartbeat_timeout * 500))
        self._sock.setsockopt(zmq.HEARTBEAT_IVL, half_ms)
        self._sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, half_ms)
        self._monitor = monitor_socket(self._ctx, self._sock, zmq.EVENT_DISCONNECTED)
        self._sock.connect(self.address)
        self._tasks = [asyncio.create_task(self._read_outputs()), asyncio.create_task(self._watch())]

    async def close(self) -> None:
        """End every call still waiting (EngineDeadError) and release the sockets; returns whatever the server does."""
        if self._ctx is None or self._closed:
            return
        self._closed = True
        for task in self._tasks:
            task.cancel()
        try:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        finally:
            self._release()

    def _release(self) -> None:
        """Fail what waits, then close the sockets and the context, the monitor stopped before its reader closes
        (engine_core/socket_monitor.py: an event that found no reader would block disable_monitor and term)."""
        self._fail("the client is closed")
        assert self._ctx is not None
        if self._ctx.closed:
            return
        if not self._sock.closed:
            self._sock.disable_monitor()
        self._monitor.close()
        self._sock.close()
        self._ctx.term()

    async def generate(
        self,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; the last one has finish_reason set. With n > 1 (or best_of) the outputs of
        its n sequences come interleaved, each with its index, and the stream ends once all have finished."""
        await self._connect(self.connect_timeout)
        request_id = request_id or uuid.uuid4().hex
        params = sampling_params or SamplingParams()
        if request_id in self._parents:
            raise ValueError(f"request id {request_id!r} is already in flight on this client")
        if params.num_sequences > 1:
            parent = self._parents[request_id] = ParentRequest(request_id, params)
            stream = fan_out(parent, lambda p, rid: self._generate_one(prompt_token_ids, p, rid, cache_salt, priority))
        else:
            stream = self._generate_one(prompt_token_ids, params, request_id, cache_salt, priority)
        try:
            async for out in stream:
                yield out
        finally:
            self._parents.pop(request_id, None)
            await stream.aclose()  # type: ignore[attr-defined]  # its request is aborted now if it has not finished

    async def _generate_one(self, prompt_token_ids: list[int], sampling_params: SamplingParams, request_id: str,
                            cache_salt: str | None, priority: int) -> AsyncIterator[RequestOutput]:
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in flight on this client")
        request = EngineCoreRequest(  # raises ValueError for an id, prompt or priority out of bounds
            request_id, list(prompt_token_ids), sampling_params, time.time(), cache_salt, priority
        )
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        finished = False
        try:
            await self._send(self._request_codec.encode(request))
            while not finished:
                item = await queue.get()
                if isinstance(item, EngineDeadError):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            del self._queues[request_id]
            if not finished:
                self._abort_nowait(request_id)

    def _abort_nowait(self, request_id: str) -> None:
        """Abort from a finally block (a cancelled or abandoned stream): never blocks, never raises."""
        if self._dead is not None or self._sock.closed:
            return
        abort = self._request_codec.encode(EngineCoreAbort([request_id]))
        sent = asyncio.ensure_future(self._sock.send(abort, zmq.NOBLOCK))
        sent.add_done_callback(lambda f: f.cancelled() or f.exception())

    async def abort(self, request_id: str) -> None:
        """Abort a request in the engine (every child of an n > 1 request)."""
        parent = self._parents.get(request_id)
        ids = [request_id] if parent is None else [parent.child_id(i) for i in range(parent.num_children)]
        await self._send(self._request_codec.encode(EngineCoreAbort(ids)))

    async def _send(self, frame: bytes) -> None:
        """Send, or raise EngineDeadError once the server is gone: a send that waits for room in the pipe to a
        dead server would wait forever (ZeroMQ keeps the pipe for a reconnect that never comes)."""
        self._check_alive()
        sending = asyncio.ensure_future(self._sock.send(frame))  # done at once unless the pipe is full
        if sending.done():
            sending.result()
            return
        try:
            await asyncio.wait([sending, self._died], return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not sending.done():
                sending.cancel()
        if sending.cancelled():
            self._check_alive()
        sending.result()

    async def get_stats(self) -> SchedulerStats:
        """A snapshot of the engine core's counters; also a readiness check (answered once it serves)."""
        await self._connect(self.connect_timeout)
        return await self._request_stats()

    async def _request_stats(self) -> SchedulerStats:
        return await self._ask(self._stats_waiters, self._request_codec.encode(EngineCoreGetStats()))

    async def _ask(self, waiters: list[asyncio.Future], frame: bytes) -> Any:
        """Send a request that the server answers in order (stats, reset) and wait for its answer.
        A request that was never sent leaves no waiter behind, or a later call would wait for its answer."""
        self._check_alive()
        waiter = asyncio.get_running_loop().create_future()
        waiters.append(waiter)
        try:
            await self._send(frame)
        except BaseException:
            if waiter in waiters:
                waiters.remove(waiter)
            raise
        return await waiter

    async def _connect(self, timeout: float | None) -> None:
        """Until the server has answered once, wait up to timeout seconds for the answer to a stats probe.

        A request's own first output is no proof of life: it may wait in the queue behind other clients' work."""
        self._check_alive()
        if self._seen:
            return
        if self._probe is None:
            self._probe = asyncio.create_task(self._request_stats())
            self._tasks.append(self._probe)
        try:
            await asyncio.wait_for(asyncio.shield(self._probe), timeout)
        except asyncio.TimeoutError:
            raise EngineDeadError(f"no kvengine server answers at {self.address}") from None

    async def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix in the engine; False if refused because requests hold blocks."""
        await self._connect(self.connect_timeout)
        return await self._ask(self._reset_waiters, self._request_codec.encode(EngineCoreResetPrefixCache()))

    async def wait_ready(self, timeout: float | None = None) -> None:
        """Raise EngineDeadError if no server answers within timeout seconds (default: connect_timeout)."""
        await self._connect(self.connect_timeout if timeout is None else timeout)

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)

    async def _read_outputs(self) -> None:
        """Hand each output to its waiter; if this ever fails, every waiter gets EngineDeadError, none hangs."""
        try:
            while True:
                self._dispatch(await self._sock.recv())
        except Exception as e:
            logger.exception("The client's reader failed")
            self._fail(f"the client stopped reading from {self.address}: {e!r}")

    def _dispatch(self, message: bytes) -> None:
        self._seen = True
        try:
            outputs = self._outputs_codec.decode(message)
        except ProtocolError as e:
            logger.error("Dropped a malformed message from the server: %s", e)
            return
        for out in outputs.outputs:
            queue = self._queues.get(out.request_id)
            if queue is not None:
                queue.put_nowait(RequestOutput(
                    out.request_id, out.new_token_ids, out.finish_reason, out.num_cached_tokens, out.error,
                    out.logprobs, out.prompt_logprobs,
                ))
        if outputs.stats is not None:
            _answer_first(self._stats_waiters, outputs.stats)
        if outputs.reset_prefix_cache is not None:
            _answer_first(self._reset_waiters, outputs.reset_prefix_cache)

    async def _watch(self) -> None:
        """A dropped connection (closed, or silent past the heartbeat timeout) means the server is gone.
        Ending, it releases the sockets: an event loop that ends without close() leaves no context for the
        garbage collector to term (its sockets would be unreachable by then, and term would wait for them)."""
        try:
            while True:
                await recv_monitor_message(self._monitor)
                self._fail(f"lost the connection to the kvengine server at {self.address}")
        finally:
            self._release()

    def _fail(self, message: str) -> None:
        """Every waiting call ends with EngineDeadError(message), and so does every later one."""
        if self._dead is not None:
            return
        self._dead = message
        self._died.set_result(None)
        for queue in self._queues.values():
            queue.put_nowait(EngineDeadError(message))
        for waiter in self._stats_waiters + self._reset_waiters:
            if not waiter.done():
                waiter.set_exception(EngineDeadError(message))
        self._stats_waiters.clear()
        self._reset_waiters.clear()


def _answer_first(waiters: list[asyncio.Future], value: object) -> None:
    """Answer the oldest waiter still waiting (a cancelled call's answer goes to the next one)."""
    while waiters:
        waiter = waiters.pop(0)
        if not waiter.done():
            waiter.set_result(value)
            return


def install_uvloop() -> None:
    """Use uvloop's event loop where it is installed."""
    try:
        import uvloop
    except ImportError:
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
