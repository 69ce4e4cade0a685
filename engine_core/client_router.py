"""ClientRouter: the engine core's client-facing ROUTER socket.

Each request belongs to the client (ZeroMQ identity) that sent it, so its outputs go back there,
and a client that disconnects has its requests aborted. Messages are decoded as they arrive and
queued; the engine loop applies them between steps.
"""

import contextlib
import logging
import time
from typing import Annotated

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from engine_core.safe_log import safe_for_log
from protocol import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, ProtocolError, SchedulerStats
from protocol.codec import client_codec, outputs_codec
from protocol.messages import MAX_PROMPT_TOKENS, MAX_REQUEST_ID_LENGTH, ClientMessage, FinishReason

logger = logging.getLogger(__name__)

# The largest client frame: a prompt of MAX_PROMPT_TOKENS ids at 9 bytes each (the longest msgpack
# integer) plus 1 MiB for the rest (id, sampling parameters, salt). ZeroMQ drops the connection of a
# peer that sends more (its requests are then aborted); the client library refuses such a prompt first.
MAX_CLIENT_FRAME_BYTES = 9 * MAX_PROMPT_TOKENS + (1 << 20)
MAX_ERROR_CHARS = 300  # a decode error is cut to this in replies and logs (it quotes numbers, never a list)


class _RequestHead(msgspec.Struct, array_like=True):
    """The tag and id that open an EngineCoreRequest frame; decoding skips the rest without building it."""

    tag: str
    # Answering an id a few times too long still tells its client why; a longer one is not echoed.
    request_id: Annotated[str, msgspec.Meta(max_length=4 * MAX_REQUEST_ID_LENGTH)]


_REQUEST_TAG = EngineCoreRequest.__struct_config__.tag


class ClientRouter:
    def __init__(self, ctx: zmq.Context, address: str) -> None:
        """Binds address (raises zmq.ZMQError if it cannot)."""
        self.address = address
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 1000)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_CLIENT_FRAME_BYTES)
        # A disconnect event names the connection's file descriptor; messages carry theirs (SRCFD).
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.poller.register(self.monitor, zmq.POLLIN)
        self.owners: dict[str, bytes] = {}  # request id -> client identity
        self.inbox: list[tuple[bytes, ClientMessage | None]] = []  # None: that client is gone
        self.fd_to_client: dict[int, bytes] = {}
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
        """Drain disconnect events, then client messages, without blocking.

        Events first: a descriptor is reused only after its disconnect event is queued."""
        while True:
            try:
                event = recv_monitor_message(self.monitor, zmq.NOBLOCK)
            except zmq.Again:
                break
            identity = self.fd_to_client.pop(event["value"], None)
            if identity is not None:
                self.inbox.append((identity, None))
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            identity = frames[0].bytes
            with contextlib.suppress(zmq.ZMQError):  # a legacy ZMTP/1.0 peer's frames carry no source fd
                self.fd_to_client[frames[-1].get(zmq.SRCFD)] = identity
            if len(frames) != 2:
                logger.warning("Dropped a malformed client message: expected 2 frames, got %d", len(frames))
                continue
            try:
                self.inbox.append((identity, self.client_codec.decode(frames[1].buffer)))
            except ProtocolError as e:
                self._refuse(identity, frames[1].buffer, str(e))

    def _refuse(self, identity: bytes, frame: memoryview, error: str) -> None:
        """Log a message that does not decode; if it opens like a request with a readable id, answer that id."""
        try:
            head = self.head_decoder.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError):
            head = None
        if head is None or head.tag != _REQUEST_TAG:
            logger.warning("Dropped a malformed client message: %s", safe_for_log(error, MAX_ERROR_CHARS))
            return
        logger.warning("Rejected request %s: %s", safe_for_log(head.request_id), safe_for_log(error, MAX_ERROR_CHARS))
        self.send(identity, [EngineCoreOutput(head.request_id, [], "error", error=error[:MAX_ERROR_CHARS])])

    def take_inbox(self) -> list[tuple[bytes, ClientMessage | None]]:
        inbox, self.inbox = self.inbox, []
        return inbox

    def admit(self, identity: bytes, request: EngineCoreRequest) -> bool:
        """Record the request's owner; False (and an error output sent) if its id is in use."""
        if request.request_id in self.owners:
            self.send(identity, [EngineCoreOutput(request.request_id, [], "error", error="request id already in use")])
            return False
        self.owners[request.request_id] = identity
        return True

    def requests_of(self, identity: bytes) -> list[str]:
        return [rid for rid, owner in self.owners.items() if owner == identity]

    def owns(self, identity: bytes, request_id: str) -> bool:
        return self.owners.get(request_id) == identity

    def route(self, outputs: list[EngineCoreOutput]) -> None:
        """Send each output to its request's client; a finished request's owner is forgotten."""
        by_client: dict[bytes, list[EngineCoreOutput]] = {}
        for out in outputs:
            owner = self.owners.get(out.request_id)
            if owner is None:
                continue
            by_client.setdefault(owner, []).append(out)
            if out.finish_reason is not None:
                del self.owners[out.request_id]
        for identity, outs in by_client.items():
            self.send(identity, outs)

    def send(self, identity: bytes, outs: list[EngineCoreOutput], stats: SchedulerStats | None = None,
             reset_prefix_cache: bool | None = None) -> None:
        msg = EngineCoreOutputs(outs, time.time(), stats=stats, reset_prefix_cache=reset_prefix_cache)
        self.sock.send_multipart([identity, self.outputs_codec.encode(msg)])

    def fail_all(self, error: str, reason: FinishReason = "error") -> None:
        """End every in-flight request, so no client waits forever."""
        self.route([EngineCoreOutput(rid, [], reason, error=error) for rid in self.owners])

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close()
        self.sock.close()
