"""`kvengine serve`: the engine-core process. It spawns one worker per rank, then runs the engine loop.

The loop itself (engine_core/engine_loop.py) and the client socket (engine_core/client_router.py)
live with the engine core; what stays here is process wiring that only a launcher does: signals,
the private socket folder, spawning the workers, and turning start-up errors into one log line.
"""

import argparse
import gc
import logging
import shutil
import signal
import tempfile
from pathlib import Path

import zmq

from engine_core.client_router import ClientRouter
from engine_core.core import EngineCore
from engine_core.engine_loop import EngineLoop
from engine_core.executor.multiproc_executor import MultiprocExecutor, WorkerFailedError
from engine_core.kv_cache.planning import KVCacheSizingError
from engine_core.kv_event_publisher import KVEventPublisher
from engine_core.metrics import EngineMetrics
from launch.api_server.launcher import ApiServers
from launch.client_endpoints import open_client_endpoints
from launch.config_args import add_config_args, config_from_args
from protocol.config import EngineConfig
from protocol.process.hosts import host_label
from protocol.process.open_files import raise_open_file_limit
from protocol.process.signals import STOP_SIGNALS
from protocol.process.worker_config import worker_configs
from worker.headless import HeadlessHost

logger = logging.getLogger("kvengine.serve")


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run the engine: an EngineCore process and one worker per rank",
                       description="Serve requests over ZeroMQ. With no flags: the built-in tiny model on CPU.")
    add_config_args(p)
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except ValueError as e:
        print(f"kvengine serve: {e}")
        return 2
    logging.basicConfig(level=config.server.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if config.parallel.data_parallel_size > 1:
        from launch.data_parallel.server import DataParallelServer, check_data_parallel  # it imports this module

        refused = check_data_parallel(config)
        if refused is not None:
            print(f"kvengine serve: {refused}")
            return 2
        return DataParallelServer(config).run()
    if config.parallel.headless:
        return HeadlessHost(config).run()
    return EngineServer(config).run()


class Interrupted(Exception):
    """A stop signal arrived during start-up."""


class EngineServer:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.stopping = False
        self.router: ClientRouter | None = None
        self.metrics: EngineMetrics | None = None
        self.kv_events: KVEventPublisher | None = None
        self.executor: MultiprocExecutor | None = None
        self.engine: EngineCore | None = None
        self.api_servers: ApiServers | None = None
        self.failure = ""  # the first line of a WorkerFailedError, told to headless hosts at shutdown

    def _on_signal(self, signum: int, frame: object) -> None:
        logger.info("Received %s, shutting down", signal.Signals(signum).name)
        self.stopping = True

    def run(self) -> int:
        """Serve until SIGINT, SIGTERM or SIGHUP (a closed terminal). Returns the process exit code."""
        for signum in STOP_SIGNALS:
            signal.signal(signum, self._on_signal)
        raise_open_file_limit()
        self.tmpdir = tempfile.mkdtemp(prefix="kvengine-")
        self.ctx = zmq.Context()
        try:
            loop = self._start()
            if loop is None:
                return 1
            loop.run(lambda: self.stopping)
            assert self.router is not None
            self.router.fail_all("the server is shutting down", reason="abort")
            return 0
        except Interrupted:
            logger.info("Start-up interrupted")
            return 0
        except WorkerFailedError as e:
            self.failure = str(e).splitlines()[0]
            logger.error("%s", self.failure)
            if self.router is not None:
                self.router.fail_all(f"the engine stopped: {str(e).splitlines()[0]}")
            return 1
        finally:
            self._close()

    def _start(self) -> EngineLoop | None:
        """Sockets, observers, workers and the engine core; None (after one log line) if start-up failed."""
        endpoints = open_client_endpoints(self.ctx, self.config, self.tmpdir)
        if endpoints is None:
            return None
        self.router, self.api_servers = endpoints
        address = self.router.address
        try:
            self._start_observers()
        except (OSError, zmq.ZMQError) as e:
            logger.error("Start-up failed: cannot open the metrics or KV event endpoint: %s", e)
            return None
        try:
            configs = worker_configs(self.config, *self._worker_links())
            self.executor = MultiprocExecutor(self.ctx, configs[0].engine_address, configs, self._check_stop)
            self.engine = EngineCore(self.config, self.executor)
        except (KVCacheSizingError, ValueError, OSError, zmq.ZMQError) as e:
            self.failure = f"start-up failed: {e}"
            logger.error("Start-up failed: %s", e)
            return None
        gc.freeze()  # the block pool's objects live as long as the server: keep them out of GC passes
        for sock in self.router.sockets:
            self.executor.serve_while_waiting(sock, self.router.read)
        logger.info("kvengine ready: serving on %s (tensor parallel %d)", address,
                    self.config.parallel.tensor_parallel_size)
        if self.api_servers is not None:
            assert self.metrics is not None and self.metrics.server is not None
            self.api_servers.spawn(address, self.engine.max_model_len, self.metrics.server.port)
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
        if server.metrics_port is not None or server.api_server_count:
            self.metrics = EngineMetrics(self.config.cache.block_size)
            if server.metrics_port is None:  # a private endpoint, for the HTTP API's /metrics
                self.metrics.serve(0, "127.0.0.1")
            else:
                self.metrics.serve(server.metrics_port, server.host)
                logger.info("Metrics on http://%s:%d/metrics", server.host, server.metrics_port)
        if server.kv_events_endpoint is not None:
            self.kv_events = KVEventPublisher(self.ctx, server.kv_events_endpoint, server.kv_events_replay_endpoint)
            logger.info("KV events on %s (replay: %s)", server.kv_events_endpoint,
                        server.kv_events_replay_endpoint or "off")

    def _close(self) -> None:
        if self.api_servers is not None:
            self.api_servers.close()
        if self.metrics is not None:
            self.metrics.close()
        if self.kv_events is not None:
            self.kv_events.close()
        if self.executor is not None:
            self.executor.shutdown(error=self.failure)
        if self.router is not None:
            self.router.close()
            if self.router.address.startswith("ipc://"):
                Path(self.router.address.removeprefix("ipc://")).unlink(missing_ok=True)
        self.ctx.term()
        shutil.rmtree(self.tmpdir, ignore_errors=True)
