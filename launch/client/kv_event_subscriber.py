"""KVEventSubscriber: reads a server's KV event batches in order, replaying missed ones (vLLM's frames)."""

import zmq

from protocol import KVEventBatch, ProtocolError
from protocol.codec import kv_events_codec
from protocol.kv_events import END_SEQ, TOPIC

REPLAY_TIMEOUT_MS = 5000
SeqBatch = tuple[int, KVEventBatch]  # a batch with the sequence number of its frame


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

    def recv(self, timeout_ms: int | None = None) -> list[SeqBatch]:
        """The next batches in sequence order (with any missed ones replayed first); [] on timeout."""
        if not self.sub.poll(timeout_ms):
            return []
        frames = self.sub.recv_multipart()
        if len(frames) != 3 or len(frames[1]) != 8:
            raise RuntimeError(f"malformed KV event message from the server ({len(frames)} frames)")
        _, seq_bytes, payload = frames
        seq = int.from_bytes(seq_bytes, "big")
        batches = []
        if seq > self.next_seq and self.replay_endpoint:
            batches = [(s, b) for s, b in self._replay(self.next_seq) if s < seq]
        if seq < self.next_seq:
            return batches  # already seen through a replay
        batches.append((seq, self._decode(payload)))
        self.next_seq = seq + 1
        return batches

    def catch_up(self, timeout_ms: int | None = REPLAY_TIMEOUT_MS) -> list[SeqBatch]:
        """Batches published since the last one received, fetched from the replay socket.

        Raises TimeoutError if the replay socket does not answer within timeout_ms (None: wait for it)."""
        batches = self._replay(self.next_seq, timeout_ms)
        if batches:
            self.next_seq = batches[-1][0] + 1
        return batches

    def _replay(self, start: int, timeout_ms: int | None = REPLAY_TIMEOUT_MS) -> list[SeqBatch]:
        assert self.replay_endpoint is not None
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.replay_endpoint)
        try:
            sock.send_multipart([b"", start.to_bytes(8, "big")])  # the empty delimiter a REQ socket would add
            out: list[SeqBatch] = []
            while True:
                if not sock.poll(timeout_ms):
                    raise TimeoutError(f"nothing answers at the KV event replay endpoint {self.replay_endpoint}")
                frames = sock.recv_multipart()
                if len(frames) != 4 or frames[0] or len(frames[2]) != 8:
                    raise RuntimeError(f"malformed KV event replay message from the server ({len(frames)} frames)")
                _, _, seq, payload = frames
                if seq == END_SEQ:
                    return out
                out.append((int.from_bytes(seq, "big"), self._decode(payload)))
        finally:
            sock.close()

    def _decode(self, payload: bytes) -> KVEventBatch:
        try:
            return self.codec.decode(payload)
        except ProtocolError as e:
            raise RuntimeError(f"malformed KV event batch from the server: {e}") from None

    def close(self) -> None:
        self.sub.close()
