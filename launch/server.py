"""`kvengine serve`: the EngineCore process. It spawns one worker per rank and serves clients.

Clients talk to one ROUTER socket; each request belongs to the client that sent it, so its
outputs go back there, and a client that disconnects has its requests aborted.
"""

import gc
import logging
import os
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import zmq
from zmq.utils.monitor import recv_monitor_message

from engine_core.config import SchedulerConfig
from engine_core.core import EngineCore
from engine_core.kv_cache.planning import KVCacheSizingError
from launch.executor import MultiprocExecutor, WorkerFailedError
from launch.kv_events import KVEventPublisher
from launch.metrics import EngineMetrics
from launch.stats_log import StatsLogger
from launch.worker_config import WorkerConfig
from protocol import (
    EngineCoreAbort,
    EngineCoreGetStats,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    ProtocolError,
)
from protocol.codec import client_codec, outputs_codec

logger = logging.getLogger("kvengine.serve")


class Interrupted(Exception):
    """SIGINT/SIGTERM arrived during start-up."""

STATS_PERIOD = 0.25  # seconds between stats snapshots for metrics and the log line


@dataclass
class ServeConfig:
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    model: str | None = None
    tensor_parallel_size: int = 1
    device: str = "cpu"
    dtype: str = "auto"
    kv_cache_memory_bytes: list[int] | None = None  # one value for all ranks, or one per rank
    gpu_memory_utilization: float = 0.92
    address: str | None = None  # None: an ipc:// path unique to this server
    stats_interval: float = 5.0
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    log_level: str = "INFO"

    def worker_configs(self, engine_address: str, dist_init_method: str) -> list[WorkerConfig]:
        tp = self.tensor_parallel_size
        budgets = self.kv_cache_memory_bytes or [None]
        if len(budgets) not in (1, tp):
            raise ValueError(f"--kv-cache-memory-bytes takes one value or {tp} (one per rank), got {len(budgets)}")
        threads = max(1, (os.cpu_count() or 1) // tp) if self.device == "cpu" else 1
        return [
            WorkerConfig(
                rank=rank,
                tp_size=tp,
                engine_address=engine_address,
                dist_init_method=dist_init_method,
                model=self.model,
                device=self.device,
                dtype=self.dtype,
                block_size=self.scheduler.block_size,
                max_num_seqs=self.scheduler.max_num_seqs,
                max_num_batched_tokens=self.scheduler.max_num_batched_tokens,
                max_model_len=self.scheduler.max_model_len,
                kv_cache_memory_bytes=budgets[rank % len(budgets)],
                gpu_memory_utilization=self.gpu_memory_utilization,
                check_block_tables=self.scheduler.check_block_tables,
                torch_threads=threads,
                log_level=self.log_level,
            )
            for rank in range(tp)
        ]


class EngineServer:
    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.stopping = False
        self.owners: dict[str, bytes] = {}  # request id -> client identity
        self.inbox: list[tuple[bytes, object]] = []  # decoded client messages (None: gone), applied between steps
        self.fd_to_client: dict[int, bytes] = {}
        self.client_codec, self.outputs_codec = client_codec(), outputs_codec()
        self.metrics: EngineMetrics | None = None
        self.kv_events: KVEventPublisher | None = None
        self.engine: EngineCore | None = None

    def _on_signal(self, signum: int, frame: object) -> None:
        logger.info("Received %s, shutting down", signal.Signals(signum).name)
        self.stopping = True

    def run(self) -> int:
        """Serve until SIGINT/SIGTERM. Returns the process exit code."""
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        self.tmpdir = tempfile.mkdtemp(prefix="kvengine-")
        self.address = self.config.address or f"ipc://{self.tmpdir}/engine.sock"
        self.ctx = zmq.Context()
        self.executor: MultiprocExecutor | None = None
        self.bound = False
        try:
            return self._start() or self._loop()
        except Interrupted:
            logger.info("Start-up interrupted")
            return 0
        except WorkerFailedError as e:
            logger.error("%s", str(e).splitlines()[0])
            self._fail_all(f"the engine stopped: {str(e).splitlines()[0]}")
            return 1
        finally:
            self._close()

    def _start(self) -> int | None:
        """Sockets, observers, workers and the engine core; an exit code if start-up failed."""
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 1000)
        # A disconnect event names the connection's file descriptor; messages carry theirs (SRCFD).
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.poller.register(self.monitor, zmq.POLLIN)
        try:
            self.sock.bind(self.address)
            self.bound = True
        except zmq.ZMQError as e:
            logger.error("Start-up failed: cannot listen on %s: %s", self.address, e)
            return 1
        try:
            self._start_observers()
        except (OSError, zmq.ZMQError) as e:
            logger.error("Start-up failed: cannot open the metrics or KV event endpoint: %s", e)
            return 1
        try:
            configs = self.config.worker_configs(f"ipc://{self.tmpdir}/workers.sock", f"file://{self.tmpdir}/dist-init")
            self.executor = MultiprocExecutor(self.ctx, configs[0].engine_address, configs, self._check_stop)
            self.engine = EngineCore(self.config.scheduler, self.executor)
        except (KVCacheSizingError, ValueError) as e:
            logger.error("Start-up failed: %s", e)
            return 1
        gc.freeze()  # the block pool's objects live as long as the server: keep them out of GC passes
        self.executor.serve_while_waiting(self.sock, self._read_clients)
        self.executor.serve_while_waiting(self.monitor, self._read_clients)
        logger.info("kvengine ready: serving on %s (tensor parallel %d)", self.address, len(configs))
        return None

    def _check_stop(self) -> None:
        """Called while waiting for the workers: a signal during start-up must not wait for them."""
        if self.stopping and self.engine is None:
            raise Interrupted()

    def _close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
        if self.kv_events is not None:
            self.kv_events.close()
        if self.executor is not None:
            self.executor.shutdown()
        self.sock.disable_monitor()
        self.monitor.close()
        self.sock.close()
        self.ctx.term()
        if self.bound and self.address.startswith("ipc://"):
            Path(self.address.removeprefix("ipc://")).unlink(missing_ok=True)
        shutil.rmtree(self.tmpdir, ignore_errors=True)

    def _start_observers(self) -> None:
        """Metrics endpoint and KV event publisher, when asked for; errors here are start-up errors."""
        if self.config.metrics_port is not None:
            self.metrics = EngineMetrics(self.config.scheduler.block_size)
            self.metrics.serve(self.config.metrics_port, self.config.metrics_host)
            logger.info("Metrics on http://%s:%d/metrics", self.config.metrics_host, self.config.metrics_port)
        if self.config.kv_events_endpoint is not None:
            self.kv_events = KVEventPublisher(
                self.ctx, self.config.kv_events_endpoint, self.config.kv_events_replay_endpoint
            )
            logger.info("KV events on %s (replay: %s)", self.config.kv_events_endpoint,
                        self.config.kv_events_replay_endpoint or "off")

    def _loop(self) -> int:
        stats_logger = StatsLogger(self.config.stats_interval)
        last_stats = 0.0
        while not self.stopping:
            if not self.engine.has_work() and not self.inbox:
                self.poller.poll(100)
            self._read_clients()
            self._apply_inbox()
            if self.engine.has_work():
                outputs = self.engine.step().outputs
                if self.metrics is not None:
                    self.metrics.on_outputs(outputs)
                self._send_outputs(outputs)
            if self.kv_events is not None:
                self.kv_events.publish(self.engine.take_kv_events())
            if time.monotonic() - last_stats >= STATS_PERIOD:
                last_stats = time.monotonic()
                stats = self.engine.get_stats()
                if self.metrics is not None:
                    self.metrics.update_stats(stats)
                stats_logger.maybe_log(stats)
        self._fail_all("the server is shutting down", reason="abort")
        return 0

    def _read_clients(self) -> None:
        """Drain disconnect events, then client messages, without blocking; apply them between steps.

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
            self.fd_to_client[frames[-1].get(zmq.SRCFD)] = identity
            try:
                if len(frames) != 2:
                    raise ProtocolError(f"expected 2 frames, got {len(frames)}")
                self.inbox.append((identity, self.client_codec.decode(frames[1].buffer)))
            except ProtocolError as e:
                logger.warning("Dropped a malformed client message: %s", e)

    def _apply_inbox(self) -> None:
        inbox, self.inbox = self.inbox, []
        for identity, msg in inbox:
            if msg is None:
                gone = [rid for rid, owner in self.owners.items() if owner == identity]
                if gone:
                    logger.info("A client disconnected; aborting its %d request(s)", len(gone))
                    self.engine.abort_requests(gone)
            elif isinstance(msg, EngineCoreRequest):
                if msg.request_id in self.owners:
                    self._send(identity, [EngineCoreOutput(msg.request_id, [], "error",
                                                           error="request id already in use")])
                    continue
                self.owners[msg.request_id] = identity
                if self.metrics is not None:
                    self.metrics.on_arrival(msg.request_id)
                self.engine.add_request(msg)
            elif isinstance(msg, EngineCoreAbort):
                self.engine.abort_requests([rid for rid in msg.request_ids if self.owners.get(rid) == identity])
            elif isinstance(msg, EngineCoreGetStats):
                self.sock.send_multipart([identity, self.outputs_codec.encode(
                    EngineCoreOutputs([], time.time(), stats=self.engine.get_stats()))])

    def _send_outputs(self, outputs: list[EngineCoreOutput]) -> None:
        by_client: dict[bytes, list[EngineCoreOutput]] = {}
        for out in outputs:
            owner = self.owners.get(out.request_id)
            if owner is None:
                continue
            by_client.setdefault(owner, []).append(out)
            if out.finish_reason is not None:
                del self.owners[out.request_id]
        for identity, outs in by_client.items():
            self._send(identity, outs)

    def _send(self, identity: bytes, outs: list[EngineCoreOutput]) -> None:
        self.sock.send_multipart([identity, self.outputs_codec.encode(EngineCoreOutputs(outs, time.time()))])

    def _fail_all(self, error: str, reason: str = "error") -> None:
        """End every in-flight request, so no client waits forever."""
        self._send_outputs([EngineCoreOutput(rid, [], reason, error=error) for rid in self.owners])
