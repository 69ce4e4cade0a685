"""ClientRouter: the engine core's client-facing ROUTER socket.

Each request belongs to the client (ZeroMQ identity) that sent it, so its outputs go back there,
and a client that disconnects has its requests aborted. Messages are decoded as they arrive and
queued; the engine loop applies them between steps. Nothing is dropped silently: a client whose pipe
is full keeps its outputs in a Backlog until it reads, and admission limits bound what is in flight.
"""

import contextlib
import logging
import time
from collections import Counter, deque
from typing import Annotated

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from engine_core.listener_gate import ListenerGate
from engine_core.safe_log import PeerWarnings, safe_for_log
from engine_core.socket_monitor import monitor_socket
from protocol import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineInfo,
    ProtocolError,
    SchedulerStats,
)
from protocol.codec import client_codec, outputs_codec
from protocol.messages import MAX_PROMPT_TOKENS, MAX_REQUEST_ID_LENGTH, ClientMessage, FinishReason

logger = logging.getLogger(__name__)

# The largest client frame: a prompt of MAX_PROMPT_TOKENS ids at 9 bytes each (the longest msgpack
# integer) plus 1 MiB for the rest (id, sampling parameters, salt). ZeroMQ drops the connection of a
# peer that sends more (its requests are then aborted); the client library refuses such a prompt first.
MAX_CLIENT_FRAME_BYTES = 9 * MAX_PROMPT_TOKENS + (1 << 20)
MAX_ERROR_CHARS = 300  # a decode error is cut to this in replies and logs (it quotes numbers, never a list)
MAX_READS = 256  # client messages read per call: steps keep running while a client floods the socket
# Messages ZeroMQ queues for one client; past that a slow client's outputs merge in its Backlog.
CLIENT_SNDHWM = 100
MAX_BACKLOG_REPLIES = 1024  # replies (errors, stats) kept for a client that sends without reading
# Connections the kernel queues for accept(): still accepted after the ListenerGate turns new clients away.
ACCEPT_BACKLOG = 32


class _RequestHead(msgspec.Struct, array_like=True):
    """The tag and id that open an EngineCoreRequest frame; decoding skips the rest without building it."""

    tag: str
    # Answering an id a few times too long still tells its client why; a longer one is not echoed.
    request_id: Annotated[str, msgspec.Meta(max_length=4 * MAX_REQUEST_ID_LENGTH)]


_REQUEST_TAG = EngineCoreRequest.__struct_config__.tag


class Backlog:
    """What a slow client has not taken yet. Each admitted request's outputs merge into one (tokens
    appended, the latest finish and counts kept), so this holds at most the client's admitted requests
    and their tokens; replies to its other messages queue up to MAX_BACKLOG_REPLIES."""

    def __init__(self) -> None:
        self.outputs: dict[str, EngineCoreOutput] = {}
        self.replies: deque[EngineCoreOutputs] = deque()

    def add_outputs(self, outs: list[EngineCoreOutput]) -> None:
        for out in outs:
            queued = self.outputs.get(out.request_id)
            if queued is not None and queued.finish_reason is not None:
                continue  # finished is final (fail_all at shutdown may add an abort)
            if queued is not None:
                logprobs = None if out.logprobs is None else (queued.logprobs or []) + out.logprobs
                out = EngineCoreOutput(out.request_id, queued.new_token_ids + out.new_token_ids, out.finish_reason,
                                       out.num_cached_tokens, out.error, logprobs,
                                       out.prompt_logprobs if queued.prompt_logprobs is None else queued.prompt_logprobs)
            self.outputs[out.request_id] = out


class ClientRouter:
    def __init__(self, ctx: zmq.Context, address: str, max_pending_requests: int = 4096,
                 max_client_requests: int = 1024) -> None:
        """Binds address (raises zmq.ZMQError if it cannot)."""
        self.address = address
        self.max_pending_requests, self.max_client_requests = max_pending_requests, max_client_requests
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 1000)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_CLIENT_FRAME_BYTES)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full pipe raises zmq.Again instead of dropping silently
        self.sock.setsockopt(zmq.SNDHWM, CLIENT_SNDHWM)
        self.sock.setsockopt(zmq.BACKLOG, ACCEPT_BACKLOG)
        # An event names the connection's file descriptor; messages carry theirs (SRCFD).
        self.monitor = monitor_socket(ctx, self.sock, zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self.gate = ListenerGate(address)
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.poller.register(self.monitor, zmq.POLLIN)
        # request id -> client, from admission until its finish output is handed to ZeroMQ
        self.owners: dict[str, bytes] = {}
        self.requests_per_client: Counter[bytes] = Counter()
        self.backlogs: dict[bytes, Backlog] = {}
        self.inbox: list[tuple[bytes, ClientMessage | None]] = []  # None: that client is gone
        self.fd_to_client: dict[int, bytes] = {}
        self.warnings = PeerWarnings(logger)
        self.client_codec, self.outputs_codec = client_codec(), outputs_codec()
        self.head_decoder = msgspec.msgpack.Decoder(_RequestHead)
        try:
            self.sock.bind(address)
        except zmq.ZMQError:
            self.close()
            raise

    @property
    def sockets(self) -> tuple[zmq.Socket, zmq.Socket]:
        return self.sock, self.monitor

    def poll(self, timeout_ms: int) -> None:
        self.poller.poll(timeout_ms)

    def read(self) -> None:
        """Drain connection events, then read up to MAX_READS client messages, without blocking.

        Events first: a descriptor is reused only after its disconnect event is queued. The bound keeps
        steps running during a flood; ZeroMQ takes inbound messages from the clients in turn."""
        self._read_events()
        for _ in range(MAX_READS):
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            identity = frames[0].bytes
            with contextlib.suppress(zmq.ZMQError):  # a legacy ZMTP/1.0 peer's frames carry no source fd
                self.fd_to_client[frames[-1].get(zmq.SRCFD)] = identity
            if len(frames) != 2:
                self.warnings.warning(identity, "Dropped a malformed client message: expected 2 frames, got %d",
                                      len(frames))
                continue
            try:
                self.inbox.append((identity, self.client_codec.decode(frames[1].buffer)))
            except ProtocolError as e:
                self._refuse(identity, frames[1].buffer, str(e))

    def _read_events(self) -> None:
        """A gone client's requests are aborted; new connections' descriptors go to the gate."""
        accepted, disconnected = [], 0
        while True:
            try:
                event = recv_monitor_message(self.monitor, zmq.NOBLOCK)
            except zmq.Again:
                break
            if event["event"] == zmq.EVENT_ACCEPTED:
                accepted.append(event["value"])
                continue
            disconnected += 1
            identity = self.fd_to_client.pop(event["value"], None)
            if identity is not None:
                self.inbox.append((identity, None))
        self.gate.update(accepted, disconnected)

    def _refuse(self, identity: bytes, frame: memoryview, error: str) -> None:
        """Log a message that does not decode; if it opens like a request with a readable id, answer that id."""
        try:
            head = self.head_decoder.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError):
            head = None
        if head is None or head.tag != _REQUEST_TAG:
            self.warnings.warning(identity, "Dropped a malformed client message: %s", safe_for_log(error, MAX_ERROR_CHARS))
            return
        self.warn_rejected(identity, head.request_id, error)
        self.reply(identity, [EngineCoreOutput(head.request_id, [], "error", error=error[:MAX_ERROR_CHARS])])

    def warn_rejected(self, identity: bytes, request_id: str, error: str) -> None:
        """Log a refused request (within the client's warning limit)."""
        self.warnings.warning(identity, "Rejected request %s: %s", safe_for_log(request_id),
                              safe_for_log(error, MAX_ERROR_CHARS))

    def take_inbox(self) -> list[tuple[bytes, ClientMessage | None]]:
        inbox, self.inbox = self.inbox, []
        return inbox

    def admit(self, identity: bytes, request: EngineCoreRequest) -> bool:
        """Record the request's owner; False (and an error output sent) if its id is in use or a limit is reached."""
        error = self._admission_error(identity, request.request_id)
        if error is not None:
            self.reply(identity, [EngineCoreOutput(request.request_id, [], "error", error=error)])
            return False
        self.owners[request.request_id] = identity
        self.requests_per_client[identity] += 1
        return True

    def _admission_error(self, identity: bytes, request_id: str) -> str | None:
        if request_id in self.owners:
            return "request id already in use"
        if len(self.owners) >= self.max_pending_requests:
            return (f"server overloaded: {len(self.owners)} requests in flight, the server's limit "
                    f"(--max-pending-requests {self.max_pending_requests})")
        if self.requests_per_client[identity] >= self.max_client_requests:
            return (f"server overloaded: this client has {self.requests_per_client[identity]} requests in flight, "
                    f"the limit per client (--max-client-requests {self.max_client_requests})")
        return None

    def drop_client(self, identity: bytes) -> list[str]:
        """A client is gone: forget what it was owed and its requests, and return those for the caller to abort.
        Once: the monitor's event and a failed send can both report one client."""
        self.forget(identity)
        gone = [rid for rid, owner in self.owners.items() if owner == identity]
        for rid in gone:
            del self.owners[rid]
        self.requests_per_client.pop(identity, None)
        if gone:
            logger.info("A client disconnected; aborting its %d request(s)", len(gone))
        return gone

    def owns(self, identity: bytes, request_id: str) -> bool:
        return self.owners.get(request_id) == identity

    def route(self, outputs: list[EngineCoreOutput]) -> None:
        """Send each output to its request's client (through its backlog while that client reads slowly)."""
        by_client: dict[bytes, list[EngineCoreOutput]] = {}
        for out in outputs:
            owner = self.owners.get(out.request_id)
            if owner is not None:
                by_client.setdefault(owner, []).append(out)
        for identity, outs in by_client.items():
            backlog = self.backlogs.get(identity)
            if backlog is not None:
                backlog.add_outputs(outs)
            elif self._try_send(identity, EngineCoreOutputs(outs, time.time())):
                self._release(identity, outs)
            else:
                self._start_backlog(identity).add_outputs(outs)

    def reply(self, identity: bytes, outs: list[EngineCoreOutput], stats: SchedulerStats | None = None,
              reset_prefix_cache: bool | None = None, info: EngineInfo | None = None) -> None:
        """Answer a client's message (not an output of an admitted request)."""
        msg = EngineCoreOutputs(outs, time.time(), stats=stats, reset_prefix_cache=reset_prefix_cache, info=info)
        backlog = self.backlogs.get(identity)
        if backlog is None:
            if self._try_send(identity, msg):
                return
            backlog = self._start_backlog(identity)
        if len(backlog.replies) < MAX_BACKLOG_REPLIES:
            backlog.replies.append(msg)
        else:
            self.warnings.warning(identity, "Dropped a reply: the client sent more than %d messages without reading "
                                  "the answers", MAX_BACKLOG_REPLIES)

    def _start_backlog(self, identity: bytes) -> Backlog:
        self.warnings.warning(identity, "A client reads slower than its outputs arrive: keeping them until it reads")
        backlog = self.backlogs[identity] = Backlog()
        return backlog

    def flush(self) -> None:
        """Hand slow clients as much of their backlogs as their pipes take now."""
        for identity, backlog in list(self.backlogs.items()):
            if backlog.outputs:
                outs = list(backlog.outputs.values())
                if not self._try_send(identity, EngineCoreOutputs(outs, time.time())):
                    continue
                backlog.outputs.clear()
                self._release(identity, outs)
            while backlog.replies and self._try_send(identity, backlog.replies[0]):
                backlog.replies.popleft()
            if not backlog.replies:
                self.backlogs.pop(identity, None)

    def _try_send(self, identity: bytes, msg: EngineCoreOutputs) -> bool:
        """False if the client's pipe is full. A gone client's message is dropped, and the client is queued as
        gone (its requests are aborted) also when no monitor event names it: SRCFD may name a reused descriptor."""
        try:
            self.sock.send(identity, zmq.NOBLOCK | zmq.SNDMORE)  # raises here, before encoding, if full or gone
        except zmq.Again:
            return False
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:
                raise
            self.forget(identity)
            self.inbox.append((identity, None))
            return True
        self.sock.send(self.outputs_codec.encode(msg), zmq.NOBLOCK)
        return True

    def _release(self, identity: bytes, outs: list[EngineCoreOutput]) -> None:
        """Outputs of admitted requests were handed over: a finished one stops counting against the limits."""
        for out in outs:
            if out.finish_reason is not None and self.owners.get(out.request_id) == identity:
                del self.owners[out.request_id]
                self.requests_per_client[identity] -= 1
                if not self.requests_per_client[identity]:
                    del self.requests_per_client[identity]

    def forget(self, identity: bytes) -> None:
        """Drop what a gone client was owed (its unfinished requests are aborted by the caller)."""
        backlog = self.backlogs.pop(identity, None)
        if backlog is not None:
            self._release(identity, list(backlog.outputs.values()))
        self.warnings.forget(identity)

    def fail_all(self, error: str, reason: FinishReason = "error") -> None:
        """End every in-flight request, so no client waits forever."""
        self.route([EngineCoreOutput(rid, [], reason, error=error) for rid in self.owners])
        self.flush()

    def close(self) -> None:
        self.sock.disable_monitor()  # before its reader closes (engine_core/socket_monitor.py)
        self.monitor.close()
        self.sock.close()
        self.gate.close()
