"""Start `kvengine serve` as a subprocess on a private ipc:// address, and stop it again.

The server must not outlive the command that started it (it holds the KV cache memory): on Linux the
kernel sends it SIGTERM when its parent dies, even by SIGKILL, and `run_until_signal` turns SIGINT and
SIGTERM of the parent into a normal exit through `LocalServer.__aexit__`.
"""

import asyncio
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

from launch.client import AsyncEngineClient
from launch.commands.config_args import config_to_flags
from protocol.config import EngineConfig

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self from Python 3.11 on

# The settings of a server that a command starts for itself; its address is the command's to choose.
LOCAL_SERVER_AREAS = ("model", "cache", "scheduler", "parallel")
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
T = TypeVar("T")


class ServerStartError(RuntimeError):
    pass


class LocalServer:
    """`async with LocalServer(config) as server:` gives server.address once the engine serves.

    Enter it from the main thread: the parent-death signal fires when the thread that started the server ends."""

    def __init__(self, config: EngineConfig | None = None, log_file: str | None = None) -> None:
        self.flags = config_to_flags(config or EngineConfig(), LOCAL_SERVER_AREAS)
        self.log_file = log_file
        self.proc: subprocess.Popen | None = None

    async def __aenter__(self) -> "Self":
        self.spawn()
        try:
            await self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def spawn(self) -> None:
        """Start the server process on a fresh private address (quick: readiness is wait_ready's job)."""
        self.tmpdir = tempfile.mkdtemp(prefix="kvengine-client-")
        self.address = f"ipc://{self.tmpdir}/engine.sock"
        with open(self.log_file or os.devnull, "ab") as log_file:
            log = log_file if self.log_file else None  # None: the server logs to this command's stderr
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "launch.cli", "serve", "--address", self.address, "--api-server-count", "0",
                 *self.flags],
                stdout=log, stderr=subprocess.STDOUT if log else None, start_new_session=True,
                preexec_fn=die_with_parent(),  # noqa: PLW1509 (it only calls prctl and getppid)
            )

    async def wait_ready(self) -> None:
        assert self.proc is not None
        await wait_until_serving(self.address, self.proc)

    async def __aexit__(self, *exc: object) -> None:
        self.stop()

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL of the whole process group if it does not exit in time."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        shutil.rmtree(self.tmpdir, ignore_errors=True)
        return self.proc.returncode if self.proc else None


def die_with_parent() -> Callable[[], None] | None:
    """On Linux, a preexec_fn after which the child gets SIGTERM when this process dies; None elsewhere."""
    if sys.platform != "linux":
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()

    def set_parent_death_signal() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before the signal was armed
            os._exit(1)

    return set_parent_death_signal


class Interrupted(Exception):
    """SIGINT or SIGTERM ended the command; exit_code follows the shell's 128 + signal (130, 143)."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.exit_code = 128 + signum


def run_until_signal(main: Coroutine[Any, Any, T]) -> T:
    """asyncio.run(main), where SIGINT and SIGTERM cancel main (so a LocalServer in it stops) and raise Interrupted."""

    async def runner() -> T:
        task = asyncio.ensure_future(main)
        received: list[int] = []

        def on_signal(signum: int) -> None:
            received.append(signum)
            task.cancel()

        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, on_signal, signum)
        try:
            return await task
        except asyncio.CancelledError:
            if received:
                raise Interrupted(received[0]) from None
            raise

    return asyncio.run(runner())


async def wait_until_serving(address: str, proc: subprocess.Popen) -> None:
    """Return once the server at address answers a stats request; raise if proc exits first."""
    async with AsyncEngineClient(address, connect_timeout=None) as client:
        ready = asyncio.ensure_future(client.get_stats())
        while not ready.done():
            await asyncio.wait([ready], timeout=0.2)
            if proc.poll() is not None:
                ready.cancel()
                raise ServerStartError(f"kvengine serve exited with code {proc.returncode} during start-up")
        ready.result()
