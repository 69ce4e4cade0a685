"""Start `kvengine serve` as a subprocess on a private ipc:// address, and stop it again."""

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence

from launch.client import AsyncEngineClient


class ServerStartError(RuntimeError):
    pass


class LocalServer:
    """`async with LocalServer(flags) as server:` gives server.address once the engine serves."""

    def __init__(self, flags: Sequence[str] = (), log_file: str | None = None) -> None:
        self.flags = list(flags)
        self.log_file = log_file
        self.proc: subprocess.Popen | None = None

    async def __aenter__(self) -> "LocalServer":
        self.tmpdir = tempfile.mkdtemp(prefix="kvengine-client-")
        self.address = f"ipc://{self.tmpdir}/engine.sock"
        log = open(self.log_file, "ab") if self.log_file else None
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "launch.cli", "serve", "--address", self.address, *self.flags],
            stdout=log, stderr=subprocess.STDOUT if log else None, start_new_session=True,
        )
        try:
            await self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    async def wait_ready(self) -> None:
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


async def wait_until_serving(address: str, proc: subprocess.Popen) -> None:
    """Return once the server at address answers a stats request; raise if proc exits first."""
    async with AsyncEngineClient(address) as client:
        ready = asyncio.ensure_future(client.get_stats())
        while not ready.done():
            await asyncio.wait([ready], timeout=0.2)
            if proc.poll() is not None:
                ready.cancel()
                raise ServerStartError(f"kvengine serve exited with code {proc.returncode} during start-up")
        ready.result()
