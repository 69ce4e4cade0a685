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

Several hosts (nnodes > 1): this executor spawns the head's ranks; every other host's ranks are
spawned there by `kvengine serve --headless` (worker/headless.py) and connect over tcp. That host's
process and this executor exchange heartbeats every HEARTBEAT_INTERVAL over the same ROUTER; a host
unheard of for HEARTBEAT_TIMEOUT (dead or cut off), or one that reports a dead worker, fails the
engine with its host and ranks named.
"""

import contextlib
import logging
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import msgspec
import zmq

from protocol import (
    GrammarOutput,
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
from protocol.messages import HEARTBEAT_INTERVAL, HEARTBEAT_TIMEOUT, EngineHeartbeat, EngineToWorker, NodeHeartbeat
from protocol.process.worker_config import WorkerConfig, local_ranks

logger = logging.getLogger(__name__)
POLL_MS = 100
M = TypeVar("M", WorkerKVReport, WorkerReady, ModelRunnerOutput)


class WorkerFailedError(RuntimeError):
    def __init__(self, rank: int, message: str, host: str = "") -> None:
        super().__init__(f"worker rank {rank}{f' on host {host}' if host else ''} {message}")
        self.rank = rank


@dataclass
class RemoteHost:
    """A headless host, as the head sees it through its heartbeats."""

    node_rank: int
    ranks: range
    host: str = ""  # its label, from its first heartbeat
    last_seen: float | None = None  # monotonic time of its last heartbeat; None before the first

    def label(self) -> str:
        return self.host or f"node {self.node_rank}"


class MultiprocExecutor:
    def __init__(self, ctx: zmq.Context, address: str, configs: list[WorkerConfig],
                 check_stop: Callable[[], None] = lambda: None,
                 entry: tuple[str, ...] = (sys.executable, "-m", "worker.main")) -> None:
        """check_stop: called every poll period while waiting (it may raise to give up);
        entry: the command that runs one worker; it gets the WorkerConfig as JSON."""
        self.check_stop = check_stop
        parallel = configs[0].engine.parallel
        self.step_timeout = parallel.step_timeout
        self.world_size = parallel.tensor_parallel_size
        self.host = configs[0].host
        self.remote = {
            f"node{k}".encode(): RemoteHost(k, local_ranks(msgspec.structs.replace(parallel, node_rank=k)))
            for k in range(1, parallel.nnodes)
        }
        self.next_heartbeat = 0.0
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a vanished rank raises
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(address)
        self.identities = [f"rank{rank}".encode() for rank in range(self.world_size)]
        self.rank_of = {identity: rank for rank, identity in enumerate(self.identities)}
        self.encoder, self.decoder = engine_to_worker_codec(), worker_to_engine_codec()
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.handlers: dict[zmq.Socket, Callable[[], None]] = {}
        self.procs = [  # the head's ranks 0 .. local-1: the index is the rank
            subprocess.Popen([*entry, msgspec.json.encode(c).decode()])
            for c in configs
        ]

    def serve_while_waiting(self, sock: zmq.Socket, handler: Callable[[], None]) -> None:
        """Call handler whenever sock is readable during a wait for the workers."""
        self.handlers[sock] = handler
        self.poller.register(sock, zmq.POLLIN)

    def check_health(self) -> None:
        """Raise WorkerFailedError if a worker has exited or a host has gone silent."""
        self._check_local()
        self._drain()
        self._heartbeat()

    def _drain(self, rank_errors: bool = True) -> None:
        """Read what has arrived while no step runs: only heartbeats and errors are due then. rank_errors: raise
        WorkerFailedError for a rank's WorkerError (always for a host's report)."""
        while self.remote and self.sock.poll(0):
            frames = self.sock.recv_multipart()
            if frames[0] in self.remote:
                self._from_host(frames)
                continue
            with contextlib.suppress(ProtocolError):
                msg = self.decoder.decode(frames[-1])
                if isinstance(msg, WorkerError) and frames[0] in self.rank_of and rank_errors:
                    rank = self.rank_of[frames[0]]
                    raise WorkerFailedError(rank, f"failed: {msg.message}", self.host_of(rank))
            logger.error("Dropped a message from %r while no step runs", frames[0])

    def _check_local(self) -> None:
        for rank, proc in enumerate(self.procs):
            if proc.poll() is not None:
                raise WorkerFailedError(rank, f"died (exit code {proc.returncode})", self.host)

    def host_of(self, rank: int) -> str:
        if rank < len(self.procs):
            return self.host
        return next((h.label() for h in self.remote.values() if rank in h.ranks), "")

    def _heartbeat(self) -> None:
        """Send the heartbeat when due; raise WorkerFailedError for a host silent for HEARTBEAT_TIMEOUT."""
        now = time.monotonic()
        for identity, host in self.remote.items():
            if host.last_seen is None:
                continue
            if now - host.last_seen > HEARTBEAT_TIMEOUT:
                raise WorkerFailedError(host.ranks[0], f"is lost: its host sent no heartbeat for {HEARTBEAT_TIMEOUT:g} s "
                                        f"(ranks {host.ranks[0]}-{host.ranks[-1]}; the host died or is cut off)",
                                        host.label())
            if now >= self.next_heartbeat:
                with contextlib.suppress(zmq.ZMQError):  # a host that vanished: its silence names it
                    self.sock.send_multipart([identity, self.encoder.encode(EngineHeartbeat())], zmq.NOBLOCK)
        if now >= self.next_heartbeat:
            self.next_heartbeat = now + HEARTBEAT_INTERVAL

    def _from_host(self, frames: list[bytes]) -> None:
        """A headless host's heartbeat, or its report of a dead worker (raised as WorkerFailedError)."""
        host = self.remote[frames[0]]
        msg = self._decode(frames, known_peer=True)
        if msg is None:
            return
        if isinstance(msg, NodeHeartbeat):
            if host.last_seen is None:
                host.host = msg.host
                if (msg.tensor_parallel_size, msg.nnodes) != (self.world_size, len(self.remote) + 1):
                    raise WorkerFailedError(host.ranks[0], f"was started with tensor parallel size "
                                            f"{msg.tensor_parallel_size} over {msg.nnodes} hosts, the head with "
                                            f"{self.world_size} over {len(self.remote) + 1}: give every host the "
                                            "same -tp and --nnodes", msg.host)
                logger.info("Host %s (node %d, ranks %d-%d) joined", msg.host, host.node_rank, host.ranks[0],
                            host.ranks[-1])
            host.last_seen = time.monotonic()
        elif isinstance(msg, WorkerError):
            raise WorkerFailedError(msg.rank, msg.message, host.label())
        else:
            logger.error("Dropped an unexpected %s from %r", type(msg).__name__, frames[0])

    def _decode(self, frames: list[bytes], known_peer: bool) -> object | None:
        """The message of [identity, payload] from a known peer; None (logged) for anything else."""
        try:
            if not known_peer or len(frames) != 2:
                raise ProtocolError(f"{len(frames)} frames" + ("" if known_peer else " from an unknown peer"))
            return self.decoder.decode(frames[1])
        except ProtocolError as e:
            logger.error("Dropped a malformed message from %r: %s", frames[0], e)
            return None

    def _recv(self, wanted: type[M], ranks: set[int], deadline: float | None = None) -> dict[int, M]:
        """Wait for one `wanted` message from each rank in ranks; TimeoutError once past deadline (monotonic)."""
        got: dict[int, M] = {}
        while len(got) < len(ranks):
            self._heartbeat()
            poll_ms = POLL_MS if deadline is None else max(0, min(POLL_MS, int((deadline - time.monotonic()) * 1000)))
            events = dict(self.poller.poll(poll_ms))
            for sock, handler in self.handlers.items():
                if sock in events:
                    handler()
            if self.sock not in events:
                self.check_stop()
                self._check_local()
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError()
                continue
            frames = self.sock.recv_multipart()
            if frames[0] in self.remote:
                self._from_host(frames)
                continue
            rank = self.rank_of.get(frames[0])
            msg = self._decode(frames, known_peer=rank is not None)
            if msg is None or rank is None:
                continue
            if isinstance(msg, WorkerError):
                self._name_the_dead()
                raise WorkerFailedError(rank, f"failed: {msg.message}", self.host_of(rank))
            if isinstance(msg, wanted) and rank in ranks:
                got[rank] = msg
            else:
                logger.error("Dropped an unexpected %s from %r", type(msg).__name__, frames[0])
        return got

    def _name_the_dead(self) -> None:
        """A rank that died often makes its peers fail in a collective: wait a little for its death to raise instead
        (on several hosts: its host's report of it, or the silence of a host that died with it)."""
        if not self.remote:
            time.sleep(0.2)
            self.check_health()
            return
        deadline = time.monotonic() + HEARTBEAT_TIMEOUT + 2 * HEARTBEAT_INTERVAL
        while time.monotonic() < deadline:  # ranks that exit with an error may only have failed in a collective
            time.sleep(0.05)
            for rank, proc in enumerate(self.procs):
                if proc.poll() is not None and proc.returncode < 0:
                    raise WorkerFailedError(rank, f"died (exit code {proc.returncode})", self.host)
            self._drain(rank_errors=False)
            self._heartbeat()
        self.check_health()

    def _send_all(self, msg: EngineToWorker) -> None:
        payload = self.encoder.encode(msg)
        for identity in self.identities:
            try:
                self.sock.send_multipart([identity, payload])
            except zmq.ZMQError as e:
                rank = self.rank_of[identity]
                raise WorkerFailedError(rank, f"is unreachable ({e})", self.host_of(rank)) from None

    def determine_available_memory(self) -> list[WorkerKVReport]:
        if self.remote:
            logger.info("Waiting for the workers of %d other host(s) on %s", len(self.remote),
                        self.sock.getsockopt_string(zmq.LAST_ENDPOINT))
        reports = self._recv(WorkerKVReport, set(range(self.world_size)))
        return [reports[rank] for rank in range(self.world_size)]

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        self._send_all(InitKVCache(kv_cache_config))
        ready = self._recv(WorkerReady, set(range(self.world_size)))
        assert all(r.num_blocks == kv_cache_config.num_blocks for r in ready.values())

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.submit(scheduler_output)
        return self.collect(scheduler_output)

    def submit(self, scheduler_output: SchedulerOutput, grammar_follows: bool = False) -> None:
        """grammar_follows: rank 0 (the rank that samples) waits for the step's GrammarOutput before it samples;
        its own requests' parameters tell it so."""
        self._send_all(scheduler_output)

    def submit_grammar(self, grammar: GrammarOutput) -> None:
        try:
            self.sock.send_multipart([self.identities[0], self.encoder.encode(grammar)])
        except zmq.ZMQError as e:
            raise WorkerFailedError(0, f"is unreachable ({e})", self.host_of(0)) from None

    def collect(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Rank 0's output of this step; workers run steps in the order they were sent."""
        step = scheduler_output.step
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
            why = " (no rank is stopped; rank 0 may be waiting for another in a collective)" if self.world_size > 1 else ""
        self._kill_all()
        return WorkerFailedError(rank, f"did not answer step {step} within {self.step_timeout:g} s{why}", self.host)

    def shutdown(self, timeout: float = 5.0, error: str = "") -> None:
        """Ask every worker to exit; kill those still running after timeout (workers ignore SIGTERM).

        error: why the engine stops after a failure; headless hosts are told, and exit non-zero. With other
        hosts, local workers are then killed at once: a peer that is gone can leave them blocked in a collective."""
        with contextlib.suppress(WorkerFailedError):
            self._send_all(Shutdown())
        for identity in self.remote:
            with contextlib.suppress(zmq.ZMQError):
                self.sock.send_multipart([identity, self.encoder.encode(Shutdown(error))], zmq.NOBLOCK)
        deadline = time.monotonic() + (0.0 if error and self.remote else timeout)
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.0, deadline - time.monotonic()))
        self._kill_all()
        self.sock.close(linger=1000 if self.remote else None)  # let Shutdown reach the other hosts

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

