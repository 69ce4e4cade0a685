"""MultiprocExecutor: one worker process per tensor-parallel rank, reached over one ZeroMQ ROUTER.

Every SchedulerOutput is encoded once and sent to every rank in step order (ZeroMQ keeps order per
peer). While the workers compute, the wait loop also serves other sockets (the client socket), so
decoding new requests overlaps the forward pass. A dead worker is noticed within one poll period.
"""

import contextlib
import logging
import subprocess
import sys
import time
from collections.abc import Callable
from typing import TypeVar

import msgspec
import zmq

from launch.worker_config import WorkerConfig
from protocol import (
    InitKVCache,
    KVCacheConfig,
    ModelRunnerOutput,
    ProtocolError,
    SchedulerOutput,
    Shutdown,
    WorkerError,
    WorkerKVReport,
    WorkerReady,
)
from protocol.codec import engine_to_worker_codec, worker_to_engine_codec
from protocol.messages import EngineToWorker

logger = logging.getLogger(__name__)
POLL_MS = 100
M = TypeVar("M", WorkerKVReport, WorkerReady, ModelRunnerOutput)


class WorkerFailedError(RuntimeError):
    def __init__(self, rank: int, message: str) -> None:
        super().__init__(f"worker rank {rank} {message}")
        self.rank = rank


class MultiprocExecutor:
    def __init__(self, ctx: zmq.Context, address: str, configs: list[WorkerConfig],
                 check_stop: Callable[[], None] = lambda: None,
                 entry: tuple[str, ...] = (sys.executable, "-m", "launch.worker_main")) -> None:
        """check_stop: called every poll period while waiting (it may raise to give up);
        entry: the command that runs one worker; it gets the WorkerConfig as JSON."""
        self.check_stop = check_stop
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a vanished rank raises
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(address)
        self.identities = [f"rank{c.rank}".encode() for c in configs]
        self.rank_of = {identity: rank for rank, identity in enumerate(self.identities)}
        self.encoder, self.decoder = engine_to_worker_codec(), worker_to_engine_codec()
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.handlers: dict[zmq.Socket, Callable[[], None]] = {}
        self.procs = [
            subprocess.Popen([*entry, msgspec.json.encode(c).decode()])
            for c in configs
        ]

    def serve_while_waiting(self, sock: zmq.Socket, handler: Callable[[], None]) -> None:
        """Call handler whenever sock is readable during a wait for the workers."""
        self.handlers[sock] = handler
        self.poller.register(sock, zmq.POLLIN)

    def _check_alive(self) -> None:
        for rank, proc in enumerate(self.procs):
            if proc.poll() is not None:
                raise WorkerFailedError(rank, f"died (exit code {proc.returncode})")

    def _recv(self, wanted: type[M], ranks: set[int]) -> dict[int, M]:
        """Wait for one `wanted` message from each rank in ranks."""
        got: dict[int, M] = {}
        while len(got) < len(ranks):
            events = dict(self.poller.poll(POLL_MS))
            for sock, handler in self.handlers.items():
                if sock in events:
                    handler()
            if self.sock not in events:
                self._check_alive()
                self.check_stop()
                continue
            frames = self.sock.recv_multipart()
            rank = self.rank_of.get(frames[0])
            try:
                if rank is None or len(frames) != 2:
                    raise ProtocolError(f"{len(frames)} frames from an unknown peer")
                msg = self.decoder.decode(frames[1])
            except ProtocolError as e:
                logger.error("Dropped a malformed message from %r: %s", frames[0], e)
                continue
            if isinstance(msg, WorkerError):
                time.sleep(0.2)  # a rank that died often makes its peers fail in a collective: name the dead one
                self._check_alive()
                raise WorkerFailedError(rank, f"failed: {msg.message}")
            if isinstance(msg, wanted) and rank in ranks:
                got[rank] = msg
            else:
                logger.error("Dropped an unexpected %s from %r", type(msg).__name__, frames[0])
        return got

    def _send_all(self, msg: EngineToWorker) -> None:
        payload = self.encoder.encode(msg)
        for identity in self.identities:
            try:
                self.sock.send_multipart([identity, payload])
            except zmq.ZMQError as e:
                raise WorkerFailedError(self.rank_of[identity], f"is unreachable ({e})") from None

    def determine_available_memory(self) -> list[WorkerKVReport]:
        reports = self._recv(WorkerKVReport, set(range(len(self.procs))))
        return [reports[rank] for rank in range(len(self.procs))]

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        self._send_all(InitKVCache(kv_cache_config))
        ready = self._recv(WorkerReady, set(range(len(self.procs))))
        assert all(r.num_blocks == kv_cache_config.num_blocks for r in ready.values())

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._send_all(scheduler_output)
        while True:
            output = self._recv(ModelRunnerOutput, {0})[0]
            if output.step == scheduler_output.step:
                return output
            logger.error("Dropped the output of step %d while waiting for step %d", output.step, scheduler_output.step)

    def shutdown(self, timeout: float = 5.0) -> None:
        """Ask every worker to exit, then terminate and finally kill any that do not."""
        with contextlib.suppress(WorkerFailedError):
            self._send_all(Shutdown())
        for proc in self.procs:
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(2.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.sock.close()

