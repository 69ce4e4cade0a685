"""`kvengine serve --headless`: a host that runs only its share of the ranks, for the head's engine core.

It spawns this host's workers, which connect over tcp to the head's worker socket (master_port + 1)
and join torch.distributed through the head's store (master_port). Then it watches both sides:
it sends the head a NodeHeartbeat every HEARTBEAT_INTERVAL and expects its EngineHeartbeat back.

- A worker that exits with an error is reported to the head (WorkerError naming the rank): exit 1.
- The head silent for HEARTBEAT_TIMEOUT (dead, or this host cut off), or its Shutdown after a
  failure: exit 1.
- The head's plain Shutdown (it stops): the workers exit by themselves: exit 0.
Whatever the reason, workers still running at the end are killed with SIGKILL: a worker whose peers
vanished may be blocked in a collective for gloo's 30-minute timeout.
"""

import contextlib
import logging
import subprocess
import sys
import time

import msgspec
import zmq

from protocol import ProtocolError, Shutdown, WorkerError
from protocol.codec import engine_to_worker_codec, worker_to_engine_codec
from protocol.config import EngineConfig
from protocol.messages import HEARTBEAT_INTERVAL, HEARTBEAT_TIMEOUT, EngineHeartbeat, NodeHeartbeat
from protocol.process.hosts import host_label
from protocol.process.server_process import ServerProcess
from protocol.process.worker_config import worker_configs

POLL_MS = 100

logger = logging.getLogger("kvengine.headless")
SHUTDOWN_WAIT = 5.0  # seconds the workers get to exit after the head's Shutdown


class HeadlessHost(ServerProcess):
    logger = logger
    stop_note = "stopping this host's workers"

    def __init__(self, config: EngineConfig) -> None:
        super().__init__()
        self.config = config
        self.node_rank = config.parallel.node_rank
        self.procs: dict[int, subprocess.Popen] = {}
        self.to_head, self.from_head = worker_to_engine_codec(), engine_to_worker_codec()
        self.ctx: zmq.Context | None = None
        self.sock: zmq.Socket | None = None

    def serve(self) -> int:
        """Serve the head until it stops (0), fails or goes silent (1), or a stop signal arrives (0)."""
        parallel = self.config.parallel
        head = f"tcp://{parallel.master_addr}:{parallel.master_port + 1}"
        try:
            self.host = host_label(parallel.master_addr)
            configs = worker_configs(self.config, head, f"tcp://{parallel.master_addr}:{parallel.master_port}",
                                     self.host)
        except (OSError, ValueError) as e:
            logger.error("Start-up failed: %s", e)
            return 1
        self.ctx = zmq.Context()
        self.sock = sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, f"node{self.node_rank}".encode())
        sock.setsockopt(zmq.LINGER, 1000)  # a last WorkerError still reaches the head
        sock.connect(head)
        for c in configs:
            self.procs[c.rank] = subprocess.Popen([sys.executable, "-m", "worker.main", msgspec.json.encode(c).decode()])
        logger.info("Host %s (node %d of %d) runs ranks %d-%d for the engine core at %s", self.host,
                    self.node_rank, parallel.nnodes, configs[0].rank, configs[-1].rank, head)
        return self._watch(sock)

    def close(self) -> None:
        self._kill_all()
        if self.sock is not None:
            self.sock.close()
        if self.ctx is not None:
            self.ctx.term()

    def _watch(self, sock: zmq.Socket) -> int:
        head_seen: float | None = None  # monotonic time of the head's last heartbeat; None before the first
        next_beat = 0.0
        while not self.stopping:
            now = time.monotonic()
            if now >= next_beat:
                self._send(sock, NodeHeartbeat(self.node_rank, self.host, self.config.parallel.tensor_parallel_size,
                                               self.config.parallel.nnodes))
                next_beat = now + HEARTBEAT_INTERVAL
            failed = self._failed_worker()
            if failed is not None:
                rank, message = failed
                logger.error("Worker rank %d %s; stopping this host", rank, message)
                self._send(sock, WorkerError(rank, message))
                return 1
            if head_seen is not None and now - head_seen > HEARTBEAT_TIMEOUT:
                logger.error("The head sent no heartbeat for %g s (it died or this host is cut off); stopping "
                             "this host's workers", HEARTBEAT_TIMEOUT)
                return 1
            if not sock.poll(POLL_MS):
                continue
            try:
                msg = self.from_head.decode(sock.recv())
            except ProtocolError as e:
                logger.error("Dropped a malformed message from the head: %s", e)
                continue
            if isinstance(msg, EngineHeartbeat):
                head_seen = time.monotonic()
            elif isinstance(msg, Shutdown):
                return self._shut_down(msg.error)
            else:
                logger.error("Dropped an unexpected %s from the head", type(msg).__name__)
        return 0

    def _failed_worker(self) -> tuple[int, str] | None:
        """(rank, why) of a worker that exited with an error. One that exited 0 was told to by the head."""
        for rank, proc in self.procs.items():
            if proc.poll() not in (None, 0):
                return rank, f"died (exit code {proc.returncode})"
        return None

    def _shut_down(self, error: str) -> int:
        if error:
            logger.error("The head stopped after a failure: %s", error)
            return 1
        logger.info("The head stopped; waiting for this host's workers")
        deadline = time.monotonic() + SHUTDOWN_WAIT
        for proc in self.procs.values():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                break
        return 0

    def _send(self, sock: zmq.Socket, msg: NodeHeartbeat | WorkerError) -> None:
        """Never blocks: while the head is not there yet, messages queue up to the high-water mark."""
        with contextlib.suppress(zmq.Again):
            sock.send(self.to_head.encode(msg), zmq.NOBLOCK)

    def _kill_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()
