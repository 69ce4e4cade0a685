"""The engine cores of a data-parallel server: each a `kvengine serve` subprocess with its own share of the cores,
the DEALER the router talks to it on, its KV event subscriber and its relayed log lines."""

import logging
import signal
import socket
import subprocess
import sys
import threading
from typing import IO

import zmq

from launch.client.kv_event_subscriber import KVEventSubscriber
from launch.commands.config_args import config_to_flags
from launch.commands.local_server import die_with_parent
from protocol.config import EngineConfig
from protocol.process.worker_config import auto_binding, format_cores

logger = logging.getLogger("kvengine.serve")
ENGINE_STOP_TIMEOUT = 60.0  # seconds an engine core has to exit after SIGTERM before it is killed


def engine_cpu_binds(config: EngineConfig, usable: list[int]) -> list[str]:
    """Each engine's --cpu-threads-bind. auto: the cores are split among the engines (one each, shared round
    the engines when there are fewer cores than engines), and each engine binds its ranks in its own share as
    one engine would in all of them; anything else applies to every engine as given."""
    n, tp = config.parallel.data_parallel_size, config.parallel.tensor_parallel_size
    bind = config.parallel.cpu_threads_bind
    if bind != "auto" or config.parallel.device != "cpu":
        return [bind] * n
    share = len(usable) // n
    shares = [usable[i * share:(i + 1) * share] for i in range(n)] if share else [[usable[i % len(usable)]]
                                                                                   for i in range(n)]
    return ["|".join(format_cores(c) for c in auto_binding(cores, tp)) for cores in shares]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class EngineProcess:
    """One engine core: its `kvengine serve` subprocess, the DEALER to it and the KV event subscriber."""

    def __init__(self, index: int, config: EngineConfig, tmpdir: str, ctx: zmq.Context, metrics: bool) -> None:
        """metrics: serve Prometheus metrics on a private port, for the router's endpoint."""
        self.index = index
        self.address = f"ipc://{tmpdir}/engine-{index}.sock"
        self.metrics_port = free_port() if metrics else None
        flags = config_to_flags(config) + ["--address", self.address, "--api-server-count", "0",
                                           "--kv-events-endpoint", f"ipc://{tmpdir}/kv-events-{index}.sock",
                                           "--kv-events-replay-endpoint", f"ipc://{tmpdir}/kv-replay-{index}.sock"]
        if self.metrics_port is not None:
            flags += ["--metrics-port", str(self.metrics_port), "--host", "127.0.0.1"]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "launch.cli", "serve", *flags], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            preexec_fn=die_with_parent(),  # noqa: PLW1509 (it only calls prctl and getppid)
        )
        assert self.proc.stdout is not None
        self.log_thread = threading.Thread(target=_relay_log, args=(self.proc.stdout, f"[engine {index}] "),
                                           daemon=True, name=f"engine-{index}-log")
        self.log_thread.start()
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)  # the router's loop never blocks on an engine
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.connect(self.address)
        self.events = KVEventSubscriber(ctx, f"ipc://{tmpdir}/kv-events-{index}.sock",
                                        f"ipc://{tmpdir}/kv-replay-{index}.sock")
        self.alive = True

    def terminate(self) -> None:
        """SIGTERM: the engine core fails its requests, stops its workers and exits."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def wait(self) -> None:
        """Until it exited; SIGKILL if it takes longer than ENGINE_STOP_TIMEOUT."""
        try:
            self.proc.wait(ENGINE_STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            logger.error("Engine core %d did not stop within %.0f s; killing it", self.index, ENGINE_STOP_TIMEOUT)
            self.proc.kill()
            self.proc.wait()
        self.log_thread.join(5)

    def close_sockets(self) -> None:
        self.sock.close()
        self.events.close()


def _relay_log(pipe: IO[bytes], prefix: str) -> None:
    """An engine's log lines on this process's stderr, each with the engine's label."""
    with pipe:
        for line in pipe:
            sys.stderr.write(prefix + line.decode(errors="replace"))
            sys.stderr.flush()
