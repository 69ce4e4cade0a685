"""The engine-core process (`kvengine serve`): the client socket, metrics and KV events, one worker per rank
through MultiprocExecutor's handshake, then the engine loop until a stop signal or a worker failure.

The HTTP API is not part of this process: the serve command binds its port first and hands it in as the
front door, which this process starts once the engine is ready (it needs the address and max_model_len).
"""

import gc
import shutil
import tempfile
from typing import Protocol

import zmq

from engine_core.client_address import open_client_router, remove_socket_file
from engine_core.client_router import ClientRouter
from engine_core.core import EngineCore
from engine_core.engine_loop import EngineLoop
from engine_core.executor.multiproc_executor import MultiprocExecutor, WorkerFailedError
from engine_core.kv_cache.planning import KVCacheSizingError
from engine_core.kv_event_publisher import KVEventPublisher
from engine_core.metrics import EngineMetrics
from protocol.config import EngineConfig
from protocol.process.hosts import host_label
from protocol.process.server_process import ServerProcess
from protocol.process.worker_config import worker_configs


class FrontDoor(Protocol):
    """The HTTP API processes, started once the engine is ready."""

    def spawn(self, engine_address: str, max_model_len: int, metrics_port: int) -> None: ...

    def close(self) -> None: ...


class Interrupted(Exception):
    """A stop signal arrived during start-up."""


class EngineServer(ServerProcess):
    def __init__(self, config: EngineConfig, front_door: FrontDoor | None = None) -> None:
        super().__init__()
        self.config = config
        self.front_door = front_door
        self.router: ClientRouter | None = None
        self.metrics: EngineMetrics | None = None
        self.kv_events: KVEventPublisher | None = None
        self.executor: MultiprocExecutor | None = None
        self.engine: EngineCore | None = None
        self.failure = ""  # the first line of a WorkerFailedError, told to headless hosts at shutdown
        self.tmpdir = tempfile.mkdtemp(prefix="kvengine-")
        self.ctx = zmq.Context()

    def serve(self) -> int:
        """Serve until SIGINT, SIGTERM or SIGHUP (a closed terminal). Returns the process exit code."""
        try:
            loop = self._start()
            if loop is None:
                return 1
            loop.run(lambda: self.stopping)
            assert self.router is not None
            self.router.fail_all("the server is shutting down", reason="abort")
            return 0
        except Interrupted:
            self.logger.info("Start-up interrupted")
            return 0
        except WorkerFailedError as e:
            self.failure = str(e).splitlines()[0]
            self.logger.error("%s", self.failure)
            if self.router is not None:
                self.router.fail_all(f"the engine stopped: {self.failure}")
            return 1

    def _start(self) -> EngineLoop | None:
        """Sockets, observers, workers and the engine core; None (after one log line) if start-up failed."""
        self.router = open_client_router(self.ctx, self.config, self.tmpdir)
        if self.router is None:
            return None
        try:
            self._start_observers()
        except (OSError, zmq.ZMQError) as e:
            self.logger.error("Start-up failed: cannot open the metrics or KV event endpoint: %s", e)
            return None
        try:
            configs = worker_configs(self.config, *self._worker_links())
            self.executor = MultiprocExecutor(self.ctx, configs[0].engine_address, configs, self._check_stop)
            self.engine = EngineCore(self.config, self.executor)
        except (KVCacheSizingError, ValueError, OSError, zmq.ZMQError) as e:
            self.failure = f"start-up failed: {e}"
            self.logger.error("Start-up failed: %s", e)
            return None
        gc.freeze()  # the block pool's objects live as long as the server: keep them out of GC passes
        for sock in self.router.sockets:
            self.executor.serve_while_waiting(sock, self.router.read)
        self.logger.info("kvengine ready: serving on %s (tensor parallel %d)", self.router.address,
                         self.config.parallel.tensor_parallel_size)
        if self.front_door is not None:
            assert self.metrics is not None and self.metrics.server is not None
            self.front_door.spawn(self.router.address, self.engine.max_model_len, self.metrics.server.port)
        return EngineLoop(self.engine, self.router, self.config.server.stats_interval, self.metrics, self.kv_events)

    def _worker_links(self) -> tuple[str, str, str]:
        """(worker socket, torch.distributed init method, host label): private files on one host; on several,
        tcp on master_addr (the store on master_port, the worker socket on the port after it)."""
        parallel = self.config.parallel
        if parallel.nnodes == 1:
            return f"ipc://{self.tmpdir}/workers.sock", f"file://{self.tmpdir}/dist-init", ""
        address, port = parallel.master_addr, parallel.master_port
        return f"tcp://{address}:{port + 1}", f"tcp://{address}:{port}", host_label(address)

    def _check_stop(self) -> None:
        """Called while waiting for the workers: a signal during start-up must not wait for them."""
        if self.stopping and self.engine is None:
            raise Interrupted()

    def _start_observers(self) -> None:
        """Metrics endpoint and KV event publisher, when asked for; errors here are start-up errors."""
        server = self.config.server
        if server.metrics_port is not None or self.front_door is not None:
            model_name = server.served_model_name or self.config.model.model or "tiny"  # as the HTTP API names it
            self.metrics = EngineMetrics(self.config.cache.block_size, model_name)
            if server.metrics_port is None:  # a private endpoint, for the HTTP API's /metrics
                self.metrics.serve(0, "127.0.0.1")
            else:
                self.metrics.serve(server.metrics_port, server.host)
                self.logger.info("Metrics on http://%s:%d/metrics", server.host, server.metrics_port)
        if server.kv_events_endpoint is not None:
            self.kv_events = KVEventPublisher(self.ctx, server.kv_events_endpoint, server.kv_events_replay_endpoint)
            self.logger.info("KV events on %s (replay: %s)", server.kv_events_endpoint,
                             server.kv_events_replay_endpoint or "off")

    def close(self) -> None:
        if self.front_door is not None:
            self.front_door.close()
        if self.metrics is not None:
            self.metrics.close()
        if self.kv_events is not None:
            self.kv_events.close()
        if self.executor is not None:
            self.executor.shutdown(error=self.failure)
        if self.router is not None:
            self.router.close()
            remove_socket_file(self.router.address)
        self.ctx.term()
        shutil.rmtree(self.tmpdir, ignore_errors=True)
