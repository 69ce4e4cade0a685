"""`kvengine serve --data-parallel-size N`: N engine cores behind one router on the client address.

Each engine core is a `kvengine serve` subprocess with its own tensor-parallel group, on a private
ipc:// address, publishing KV events on a private endpoint (with a replay socket), no HTTP API, and
its own share of the CPU cores. This process owns the client address: a ClientRouter (the engine
core's own client socket, so admission limits, slow clients and disconnects behave as with one
engine) in front of one DEALER per engine. launch/data_parallel/routing.py picks the engine of each request
from the engines' KV events and loads; outputs go back to their clients, get_stats answers the sum
with each engine's stats, reset_prefix_cache goes to every engine, and the requests of an engine
that dies end with `error` while the others keep serving. The HTTP API, when asked for, runs here
as clients of the router; its /metrics and --metrics-port show every engine's metrics with an
`engine` label.
"""

import itertools
import logging
import os
import shutil
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
from prometheus_client import CollectorRegistry

from engine_core.client_address import open_client_router, remove_socket_file
from engine_core.client_router import ClientRouter
from engine_core.metrics import MetricsServer
from launch.api_server.launcher import ApiServers
from launch.data_parallel.engines import EngineProcess, engine_cpu_binds
from launch.data_parallel.metrics import EngineMetricsCollector
from launch.data_parallel.routing import Router
from protocol import (
    EngineCoreAbort,
    EngineCoreGetInfo,
    EngineCoreGetStats,
    EngineCoreOutput,
    EngineCoreRequest,
    EngineCoreResetPrefixCache,
    EngineInfo,
    ProtocolError,
    SchedulerStats,
)
from protocol.codec import client_codec, outputs_codec
from protocol.config import EngineConfig, with_settings
from protocol.process.server_process import ServerProcess

logger = logging.getLogger("kvengine.serve")
POLL_MS = 100
BACKLOG_RETRY_MS = 10
HEALTH_PERIOD = 0.1  # seconds between checks that every engine process lives
ENGINE_STOP_TIMEOUT = 60.0  # seconds an engine core has to exit after SIGTERM before it is killed
METRICS_FETCH_TIMEOUT = 5.0


def check_data_parallel(config: EngineConfig) -> str | None:
    """Why these settings cannot run data parallel, or None."""
    parallel = config.parallel
    if parallel.nnodes > 1 or parallel.headless:
        return "--data-parallel-size > 1 runs every engine core on this host: multi-host tensor parallelism " \
               "(--nnodes > 1, --headless) cannot be combined with it"
    if config.server.kv_events_endpoint is not None:
        return "--kv-events-endpoint cannot be combined with --data-parallel-size > 1: each engine core's KV " \
               "events go to the router on a private endpoint"
    return None


@dataclass
class Gather:
    """A client's get_stats or reset_prefix_cache, waiting for every live engine's answer."""

    identity: bytes
    kind: str  # "stats" or "reset"
    waiting: set[int]
    answers: dict[int, object] = field(default_factory=dict)


def sum_stats(stats: list[SchedulerStats]) -> SchedulerStats:
    """Counters and gauges summed over the engines; KV usage averaged (every engine has the same pool)."""
    if not stats:
        return SchedulerStats()
    per_pos = "spec_decode_num_accepted_tokens_per_pos"  # summed position by position
    fields: dict[str, Any] = {name: sum(getattr(s, name) for s in stats) for name in SchedulerStats.__struct_fields__
                                 if name not in ("engines", per_pos)}
    fields["kv_cache_usage"] = sum(s.kv_cache_usage for s in stats) / len(stats)
    fields[per_pos] = [sum(column) for column in itertools.zip_longest(*(getattr(s, per_pos) for s in stats),
                                                                        fillvalue=0)]
    return SchedulerStats(**fields)


class DataParallelServer(ServerProcess):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__()
        self.config = config
        self.n = config.parallel.data_parallel_size
        self.tmpdir = tempfile.mkdtemp(prefix="kvengine-dp-")
        self.ctx = zmq.Context()
        self.engines: list[EngineProcess] = []
        self.client: ClientRouter | None = None
        self.api_servers: ApiServers | None = None
        self.metrics_server: MetricsServer | None = None
        cache = config.cache
        self.router = Router(self.n, config.parallel.router_policy, cache.block_size, cache.prefix_caching_hash_algo)
        self.engine_of: dict[str, int] = {}  # request id -> engine, while in flight
        self.gathers: list[deque[Gather]] = [deque() for _ in range(self.n)]
        self.info = EngineInfo(0, 0, 0)  # what the engines serve, from their ready handshake
        self.client_codec, self.outputs_codec = client_codec(), outputs_codec()

    def serve(self) -> int:
        """Serve until a stop signal (0), a failed start-up or every engine core gone (1)."""
        if not self._start() or not self._wait_ready():
            return 0 if self.stopping else 1
        self._loop()
        return 0 if self.stopping else 1

    def _start(self) -> bool:
        self.client = open_client_router(self.ctx, self.config, self.tmpdir)
        if self.client is None:
            return False
        server = self.config.server
        try:
            self.api_servers = ApiServers(self.config) if server.api_server_count else None
        except OSError as e:
            logger.error("Start-up failed: cannot listen on http://%s:%d: %s", server.host, server.port, e)
            return False
        try:
            self._start_metrics()
        except OSError as e:
            logger.error("Start-up failed: cannot open the metrics endpoint: %s", e)
            return False
        binds = engine_cpu_binds(self.config, sorted(os.sched_getaffinity(0)))
        for i in range(self.n):
            # The router enforces the per-client limit; each engine sees one client, the router.
            engine_config = with_settings(self.config, data_parallel_size=1, cpu_threads_bind=binds[i], address=None,
                                          max_client_requests=self.config.server.max_pending_requests, metrics_port=None)
            self.engines.append(EngineProcess(i, engine_config, self.tmpdir, self.ctx, self._serves_metrics()))
        logger.info("Started %d engine cores (cpu threads bind: %s)", self.n, ", ".join(binds))
        return True

    def _wait_ready(self) -> bool:
        """Until every engine answers its ready handshake (EngineCoreGetInfo); False if one exits first, the engines
        disagree on what they serve, or a stop signal arrives."""
        for engine in self.engines:
            engine.sock.send(self.client_codec.encode(EngineCoreGetInfo()))
        poller = zmq.Poller()
        for engine in self.engines:
            poller.register(engine.sock, zmq.POLLIN)
        infos: dict[int, EngineInfo] = {}
        while len(infos) < self.n:
            if self.stopping:
                logger.info("Start-up interrupted")
                return False
            for sock, _ in poller.poll(POLL_MS):
                engine = next(e for e in self.engines if e.sock is sock)
                info = self.outputs_codec.decode(engine.sock.recv()).info
                if info is None:
                    logger.error("Start-up failed: engine core %d answered its handshake without EngineInfo", engine.index)
                    return False
                infos[engine.index] = info
            for engine in self.engines:
                if engine.proc.poll() is not None:
                    logger.error("Start-up failed: engine core %d exited with code %d", engine.index,
                                 engine.proc.returncode)
                    return False
        return self._ready(list(infos.values()))

    def _ready(self, infos: list[EngineInfo]) -> bool:
        lengths = {info.max_model_len for info in infos}
        if len(lengths) > 1:
            logger.error("Start-up failed: the engine cores resolved different max_model_len: %s", sorted(lengths))
            return False
        self.info = EngineInfo(infos[0].max_model_len, infos[0].block_size, sum(i.num_gpu_blocks for i in infos))
        assert self.client is not None
        address = self.client.address
        logger.info("kvengine ready: serving on %s (data parallel %d, router policy %s, tensor parallel %d)",
                    address, self.n, self.config.parallel.router_policy, self.config.parallel.tensor_parallel_size)
        if self.api_servers is not None:
            assert self.metrics_server is not None
            self.api_servers.spawn(address, self.info.max_model_len, self.metrics_server.port)
        return True

    def _serves_metrics(self) -> bool:
        """For --metrics-port, and for the HTTP API's /metrics."""
        return self.config.server.metrics_port is not None or self.config.server.api_server_count > 0

    def _start_metrics(self) -> None:
        """The router's metrics endpoint: it scrapes the engines' when scraped (raises OSError if it cannot bind)."""
        server = self.config.server
        if not self._serves_metrics():
            return
        registry = CollectorRegistry()
        registry.register(EngineMetricsCollector(self.engines))
        if server.metrics_port is None:
            self.metrics_server = MetricsServer(registry, "127.0.0.1", 0)
        else:
            self.metrics_server = MetricsServer(registry, server.host, server.metrics_port)
            logger.info("Metrics on http://%s:%d/metrics", server.host, server.metrics_port)

    def _loop(self) -> None:
        assert self.client is not None
        client = self.client
        poller = zmq.Poller()
        for sock in client.sockets:
            poller.register(sock, zmq.POLLIN)
        for engine in self.engines:
            poller.register(engine.sock, zmq.POLLIN)
            poller.register(engine.events.sub, zmq.POLLIN)
        last_check = 0.0
        while not self.stopping:
            poller.poll(BACKLOG_RETRY_MS if client.backlogs else POLL_MS)
            for engine in self.engines:
                if engine.alive:
                    self._read_events(engine)
                    self._read_outputs(engine)
            client.read()
            self._apply_inbox()
            client.flush()
            if time.monotonic() - last_check >= HEALTH_PERIOD:
                last_check = time.monotonic()
                for engine in self.engines:
                    if engine.alive and engine.proc.poll() is not None and not self.stopping:
                        poller.unregister(engine.sock)
                        poller.unregister(engine.events.sub)
                        self._read_outputs(engine)  # what it sent before it died still counts
                        self._engine_died(engine)
                if not any(e.alive for e in self.engines):
                    logger.error("Every engine core has stopped; exiting")
                    return
        client.fail_all("the server is shutting down", reason="abort")

    def _read_events(self, engine: EngineProcess) -> None:
        try:
            while batches := engine.events.recv(0):
                for _, batch in batches:
                    self.router.on_events(engine.index, batch.events)
        except (RuntimeError, TimeoutError) as e:
            logger.warning("Engine core %d: KV events lost (%s); its cached prefixes are forgotten", engine.index, e)
            self.router.index.clear(engine.index)

    def _read_outputs(self, engine: EngineProcess) -> None:
        assert self.client is not None
        while True:
            try:
                frame = engine.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = self.outputs_codec.decode(frame)
            except ProtocolError as e:
                logger.error("Dropped a malformed message from engine core %d: %s", engine.index, e)
                continue
            if msg.outputs:
                self._finish(msg.outputs)
                self.client.route(msg.outputs)
            if msg.stats is not None:
                self._answer(engine.index, msg.stats)
            if msg.reset_prefix_cache is not None:
                self._answer(engine.index, msg.reset_prefix_cache)

    def _finish(self, outputs: list[EngineCoreOutput]) -> None:
        for out in outputs:
            if out.finish_reason is not None:
                engine = self.engine_of.pop(out.request_id, None)
                if engine is not None:
                    self.router.finished(engine)

    def _apply_inbox(self) -> None:
        assert self.client is not None
        client = self.client
        for identity, msg in client.take_inbox():
            if msg is None:
                self._abort(client.drop_client(identity))
            elif isinstance(msg, EngineCoreRequest):
                if client.admit(identity, msg):
                    self._forward(msg)
            elif isinstance(msg, EngineCoreAbort):
                self._abort([rid for rid in msg.request_ids if client.owns(identity, rid)])
            elif isinstance(msg, EngineCoreGetStats | EngineCoreResetPrefixCache):
                self._fan_out(identity, msg)
            elif isinstance(msg, EngineCoreGetInfo):
                client.reply(identity, [], info=self.info)

    def _forward(self, request: EngineCoreRequest) -> None:
        engine = self.router.route(request.prompt_token_ids, request.cache_salt)
        self.engine_of[request.request_id] = engine
        self.engines[engine].sock.send(self.client_codec.encode(request))

    def _abort(self, request_ids: list[str]) -> None:
        by_engine: dict[int, list[str]] = {}
        for rid in request_ids:
            engine = self.engine_of.get(rid)
            if engine is not None:
                by_engine.setdefault(engine, []).append(rid)
        for engine, rids in by_engine.items():
            self.engines[engine].sock.send(self.client_codec.encode(EngineCoreAbort(rids)))

    def _fan_out(self, identity: bytes, msg: EngineCoreGetStats | EngineCoreResetPrefixCache) -> None:
        live = {e.index for e in self.engines if e.alive}
        gather = Gather(identity, "stats" if isinstance(msg, EngineCoreGetStats) else "reset", live)
        payload = self.client_codec.encode(msg)
        for engine in sorted(live):
            self.gathers[engine].append(gather)
            self.engines[engine].sock.send(payload)
        self._maybe_reply(gather)

    def _answer(self, engine: int, answer: object) -> None:
        if not self.gathers[engine]:
            return
        gather = self.gathers[engine].popleft()
        gather.answers[engine] = answer
        self._maybe_reply(gather)

    def _maybe_reply(self, gather: Gather) -> None:
        """Answer the client once every engine it waits for has answered (or died)."""
        assert self.client is not None
        if not gather.waiting.issubset(gather.answers):
            return
        if gather.kind == "stats":
            # A dead engine's place holds empty stats; the sum counts the live ones.
            stats = [a if isinstance(a := gather.answers.get(i), SchedulerStats) else SchedulerStats()
                     for i in range(self.n)]
            live = [s for i, s in enumerate(stats) if i in gather.answers]
            total = msgspec.structs.replace(sum_stats(live), engines=stats)
            self.client.reply(gather.identity, [], stats=total)
        else:
            self.client.reply(gather.identity, [], reset_prefix_cache=all(gather.answers.values()))

    def _engine_died(self, engine: EngineProcess) -> None:
        """Fail its requests, stop routing to it, and stop waiting for its answers."""
        assert self.client is not None
        engine.alive = False
        self.router.engine_dead(engine.index)
        error = f"engine core {engine.index} stopped (exit code {engine.proc.returncode})"
        logger.error("%s; failing its requests, serving on with the others", error.capitalize())
        failed = [rid for rid, e in self.engine_of.items() if e == engine.index]
        for rid in failed:
            del self.engine_of[rid]
        self.client.route([EngineCoreOutput(rid, [], "error", error=error) for rid in failed])
        pending, self.gathers[engine.index] = self.gathers[engine.index], deque()
        for gather in pending:
            gather.waiting.discard(engine.index)
            self._maybe_reply(gather)

    def close(self) -> None:
        if self.api_servers is not None:
            self.api_servers.close()
        if self.metrics_server is not None:
            self.metrics_server.close()
        for engine in self.engines:  # all at once: they stop in parallel
            engine.terminate()
        for engine in self.engines:
            engine.wait()
            engine.close_sockets()
        if self.client is not None:
            self.client.close()
            remove_socket_file(self.client.address)
        self.ctx.term()
        shutil.rmtree(self.tmpdir, ignore_errors=True)
