"""Start and stop the API server processes of a `kvengine serve`; they share one listening socket."""

import contextlib
import logging
import socket
import subprocess
import sys

import msgspec

from launch.commands.local_server import die_with_parent
from protocol.config import EngineConfig, ServerConfig

logger = logging.getLogger("kvengine.serve")
BACKLOG = 4096  # connections the kernel queues before an API process accepts them (64 streams start at once)


class ApiServerSettings(msgspec.Struct, kw_only=True, frozen=True):
    """What an API process is told on its command line (as JSON)."""

    engine_address: str
    fd: int  # the inherited listening socket
    model: str | None
    model_name: str
    max_model_len: int
    metrics_url: str  # the engine core's metrics endpoint
    server: ServerConfig = msgspec.field(default_factory=ServerConfig)  # keys from the environment stay there
    engine_window: int = 256  # engine requests in flight from one API process
    scheduling_policy: str = "fcfs"  # the engine's: a request's priority needs "priority"
    log_level: str = "INFO"


def engine_window(config: EngineConfig) -> int:
    """Engine requests one API process keeps in flight: what the engine admits from one client and its share of
    the engine's total, at most the batch the engine cores can run at once (the rest wait here, where they are
    granted fairly between users, not in the engine's first-come queue)."""
    server = config.server
    share = server.max_pending_requests // max(server.api_server_count, 1)
    running = config.scheduler.max_num_seqs * config.parallel.data_parallel_size
    return max(1, min(server.max_client_requests, share, running))


class ApiServers:
    def __init__(self, config: EngineConfig) -> None:
        """Bind the HTTP port now, so a taken port fails start-up before the model loads."""
        server = config.server
        self.config = config
        self.procs: list[subprocess.Popen] = []
        self.sock = socket.create_server((server.host, server.port), backlog=BACKLOG)
        self.url = f"http://{server.host}:{self.sock.getsockname()[1]}"

    def spawn(self, engine_address: str, max_model_len: int, metrics_port: int) -> None:
        """One process per --api-server-count; each dies with this process (parent-death signal)."""
        model = self.config.model.model
        server = self.config.server
        host = server.host if server.metrics_port is not None else "127.0.0.1"
        if host in ("0.0.0.0", "::", ""):
            host = "127.0.0.1"
        settings = ApiServerSettings(
            engine_address=engine_address, fd=self.sock.fileno(), model=model,
            model_name=server.served_model_name or model or "tiny", max_model_len=max_model_len,
            metrics_url=f"http://{host}:{metrics_port}/metrics",
            server=server,
            engine_window=engine_window(self.config), log_level=server.log_level,
            scheduling_policy=self.config.scheduler.scheduling_policy,
        )
        argv = [sys.executable, "-m", "launch.api_server.process", msgspec.json.encode(settings).decode()]
        for _ in range(server.api_server_count):
            self.procs.append(subprocess.Popen(argv, pass_fds=[self.sock.fileno()], preexec_fn=die_with_parent()))  # noqa: PLW1509
        logger.info("OpenAI-compatible API on %s (%d process(es))", self.url, len(self.procs))

    def close(self, timeout: float = 10.0) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        with contextlib.suppress(OSError):
            self.sock.close()
