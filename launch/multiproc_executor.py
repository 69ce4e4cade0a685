"""MultiprocExecutor: one worker process per tensor-parallel rank, reached over one ZeroMQ ROUTER.

Every SchedulerOutput is encoded once and sent to every rank in step order (ZeroMQ keeps order per
peer). While the workers compute, the wait loop also serves other sockets (the client socket), so
decoding new requests overlaps the forward pass.

Faults: a dead worker is noticed within one poll period, while waiting for the workers and, through
check_health (a non-blocking waitpid of each worker), whenever the engine loop is idle. A step that
rank 0 has not answered within --step-timeout fails: a stopped rank (state T in /proc/PID/stat:
SIGSTOP, a debugger) is named as the one that hangs; when none is stopped, rank 0 is named, the rank
that answers steps, though with tensor parallelism it may be waiting for another rank in a
collective. Every worker is then killed with SIGKILL, the one signal a stopped process obeys.
"""

import contextlib
import logging
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
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
        self.step_timeout = configs[0].engine.parallel.step_timeout
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

    def check_health(self) -> None:
        """Raise WorkerFailedError if a worker has exited."""
        for rank, proc in enumerate(self.procs):
            if proc.poll() is not None:
                raise WorkerFailedError(rank, f"died (exit code {proc.returncode})")

    def _recv(self, wanted: type[M], ranks: set[int], deadline: float | None = None) -> dict[int, M]:
        """Wait for one `wanted` message from each rank in ranks; TimeoutError once past deadline (monotonic)."""
        got: dict[int, M] = {}
        while len(got) < len(ranks):
            poll_ms = POLL_MS if deadline is None else max(0, min(POLL_MS, int((deadline - time.monotonic()) * 1000)))
            events = dict(self.poller.poll(poll_ms))
            for sock, handler in self.handlers.items():
                if sock in events:
                    handler()
            if self.sock not in events:
                self.check_stop()
                self.check_health()
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError()
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
                self.check_health()
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
        step = scheduler_output.step
        self._send_all(scheduler_output)
        deadline = time.monotonic() + self.step_timeout if self.step_timeout else None
        while True:
            try:
                output = self._recv(ModelRunnerOutput, {0}, deadline)[0]
            except TimeoutError:
                raise self._step_timed_out(step) from None
            if output.step == step:
                return output
            logger.error("Dropped the output of step %d while waiting for step %d", output.step, step)

    def _step_timed_out(self, step: int) -> WorkerFailedError:
        """Name the rank that hangs (see the module doc) and kill every worker."""
        stopped = [rank for rank, proc in enumerate(self.procs) if _process_state(proc.pid) in ("T", "t")]
        rank = stopped[0] if stopped else 0
        if stopped:
            why = " (its process is stopped)"
        else:
            why = " (no rank is stopped; rank 0 may be waiting for another in a collective)" if len(self.procs) > 1 else ""
        self._kill_all()
        return WorkerFailedError(rank, f"did not answer step {step} within {self.step_timeout:g} s{why}")

    def shutdown(self, timeout: float = 5.0) -> None:
        """Ask every worker to exit; kill those still running after timeout (workers ignore SIGTERM)."""
        with contextlib.suppress(WorkerFailedError):
            self._send_all(Shutdown())
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.0, deadline - time.monotonic()))
        self._kill_all()
        self.sock.close()

    def _kill_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def _process_state(pid: int) -> str:
    """The state letter of /proc/PID/stat (R, S, D, T stopped, t traced, Z, ...); '?' if unreadable."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"

