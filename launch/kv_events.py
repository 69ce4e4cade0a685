"""KV cache events over ZeroMQ: a PUB socket for live batches and a ROUTER for replaying missed ones.

Live frames:   [topic, seq (8 bytes, big-endian), KVEventBatch]
Replay:        a subscriber sends [seq] to the replay socket and gets back [seq, batch] for every
               buffered batch from that seq on, then [END_SEQ, b""].
"""

import logging
import threading
import time
from collections import deque

import zmq

from protocol import KVCacheEvent, KVEventBatch, ProtocolError
from protocol.codec import kv_events_codec

logger = logging.getLogger(__name__)
TOPIC = b"kv-events"
END_SEQ = (2**64 - 1).to_bytes(8, "big")
REPLAY_TIMEOUT_MS = 5000


class KVEventPublisher:
    """Publishes from the engine loop; a thread of its own answers replay requests, even mid-step."""

    def __init__(self, ctx: zmq.Context, endpoint: str, replay_endpoint: str | None, buffer_steps: int = 10_000):
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind(endpoint)
        self.buffer: deque[tuple[bytes, bytes]] = deque(maxlen=buffer_steps)
        self.lock = threading.Lock()
        self.seq = 0
        self.codec = kv_events_codec()
        self.stopping = threading.Event()
        self.replay_thread = None
        if replay_endpoint:
            replay = ctx.socket(zmq.ROUTER)
            replay.setsockopt(zmq.LINGER, 0)
            replay.bind(replay_endpoint)  # here, so a bad address is a start-up error
            self.replay_thread = threading.Thread(target=self._serve_replays, args=(replay,), daemon=True,
                                                  name="kv-event-replay")
            self.replay_thread.start()

    def publish(self, events: list[KVCacheEvent]) -> None:
        """One batch per engine step that produced events."""
        if not events:
            return
        seq = self.seq.to_bytes(8, "big")
        payload = self.codec.encode(KVEventBatch(self.seq, time.time(), events))
        with self.lock:
            self.buffer.append((seq, payload))
        self.pub.send_multipart([TOPIC, seq, payload])
        self.seq += 1

    def _serve_replays(self, replay: zmq.Socket) -> None:
        try:
            while not self.stopping.is_set():
                if not replay.poll(100):
                    continue
                frames = replay.recv_multipart()
                if len(frames) != 2 or len(frames[1]) != 8:
                    logger.warning("Dropped a malformed KV event replay request")
                    continue
                identity, start = frames
                with self.lock:
                    wanted = [(seq, payload) for seq, payload in self.buffer if seq >= start]
                for seq, payload in wanted:
                    replay.send_multipart([identity, seq, payload])
                replay.send_multipart([identity, END_SEQ, b""])
        finally:
            replay.close()

    def close(self) -> None:
        self.stopping.set()
        if self.replay_thread is not None:
            self.replay_thread.join()
        self.pub.close()


class KVEventSubscriber:
    """Receives batches in order; after a gap (a late start or a dropped message) it asks for a replay."""

    def __init__(self, ctx: zmq.Context, endpoint: str, replay_endpoint: str | None, from_seq: int = 0) -> None:
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
        self.sub.connect(endpoint)
        self.ctx = ctx
        self.replay_endpoint = replay_endpoint
        self.next_seq = from_seq
        self.codec = kv_events_codec()

    def recv(self, timeout_ms: int | None = None) -> list[KVEventBatch]:
        """The next batches in sequence order (with any missed ones replayed first); [] on timeout."""
        if not self.sub.poll(timeout_ms):
            return []
        topic, seq_bytes, payload = self.sub.recv_multipart()
        seq = int.from_bytes(seq_bytes, "big")
        batches = []
        if seq > self.next_seq and self.replay_endpoint:
            batches = [b for b in self._replay(self.next_seq) if b.seq < seq]
        if seq < self.next_seq:
            return batches  # already seen through a replay
        batches.append(self._decode(payload))
        self.next_seq = batches[-1].seq + 1
        return batches

    def catch_up(self) -> list[KVEventBatch]:
        """Batches published since the last one received, fetched from the replay socket."""
        batches = self._replay(self.next_seq)
        if batches:
            self.next_seq = batches[-1].seq + 1
        return batches

    def _replay(self, start: int) -> list[KVEventBatch]:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.replay_endpoint)
        try:
            sock.send(start.to_bytes(8, "big"))
            out = []
            while True:
                if not sock.poll(REPLAY_TIMEOUT_MS):
                    raise TimeoutError(f"no answer from the KV event replay socket {self.replay_endpoint}")
                seq, payload = sock.recv_multipart()
                if seq == END_SEQ:
                    return out
                out.append(self._decode(payload))
        finally:
            sock.close()

    def _decode(self, payload: bytes) -> KVEventBatch:
        try:
            return self.codec.decode(payload)
        except ProtocolError as e:
            raise RuntimeError(f"malformed KV event batch from the server: {e}") from None

    def close(self) -> None:
        self.sub.close()
