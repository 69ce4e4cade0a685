"""KVEventPublisher: the engine core's KV events on a PUB socket, with a ROUTER that replays missed
batches. Frames and the replay exchange are vLLM's; protocol/kv_events.py describes them."""

import logging
import threading
import time
from collections import deque

import zmq

from protocol.codec import kv_events_codec
from protocol.kv_events import END_SEQ, TOPIC, KVCacheEvent, KVEventBatch

logger = logging.getLogger(__name__)


class KVEventPublisher:
    """Publishes from the engine loop; a thread of its own answers replay requests, even mid-step."""

    def __init__(self, ctx: zmq.Context, endpoint: str, replay_endpoint: str | None, buffer_steps: int = 10_000,
                 data_parallel_rank: int = 0) -> None:
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind(endpoint)
        self.data_parallel_rank = data_parallel_rank  # vLLM's publisher stamps every batch with it
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
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
        batch = KVEventBatch(ts=time.time(), events=events, data_parallel_rank=self.data_parallel_rank)
        payload = self.codec.encode(batch)
        with self.lock:
            self.buffer.append((self.seq, payload))
        self.pub.send_multipart([TOPIC, self.seq.to_bytes(8, "big"), payload])
        self.seq += 1

    def _serve_replays(self, replay: zmq.Socket) -> None:
        try:
            while not self.stopping.is_set():
                if not replay.poll(100):
                    continue
                frames = replay.recv_multipart()
                if len(frames) != 3 or frames[1] or len(frames[2]) != 8:
                    logger.warning("Dropped a malformed KV event replay request (%d frames)", len(frames))
                    continue
                identity, _, start = frames
                start_seq = int.from_bytes(start, "big")
                with self.lock:
                    wanted = [(seq, payload) for seq, payload in self.buffer if seq >= start_seq]
                for seq, payload in wanted:
                    replay.send_multipart([identity, b"", TOPIC, seq.to_bytes(8, "big"), payload])
                replay.send_multipart([identity, b"", b"", END_SEQ, b""])
        finally:
            replay.close()

    def close(self) -> None:
        self.stopping.set()
        if self.replay_thread is not None:
            self.replay_thread.join()
        self.pub.close()
