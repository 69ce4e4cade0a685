"""Fixtures that start a real `kvengine serve` subprocess and always stop it, also on failure."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launch.local_server import ServerStartError, wait_until_serving


def processes_in_group(pgid: int) -> list[int]:
    """Live processes whose process group is pgid (read from /proc, no extra dependency)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(stat.parent.name))
    return pids


class ServerProcess:
    def __init__(self, tmp_path: Path, flags: list[str]) -> None:
        self.address = f"ipc://{tmp_path}/engine.sock"
        if "--port" not in flags:
            flags = ["--address", self.address, *flags]
        self.log_path = tmp_path / "server.log"
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "launch.cli", "serve", *flags],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
        )

    def output(self) -> str:
        self.log.flush()
        return self.log_path.read_text()

    async def wait_ready(self) -> None:
        try:
            await wait_until_serving(self.address, self.proc)
        except ServerStartError as e:
            raise RuntimeError(f"{e}:\n{self.output()}") from None

    def worker_pids(self) -> dict[int, int]:
        """rank -> pid of the server's worker processes."""
        out = {}
        for pid in processes_in_group(self.proc.pid):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"launch.worker_main" in cmdline:
                config = cmdline[cmdline.index(b"launch.worker_main") + 1]
                out[int(config.split(b'"rank":')[1].split(b",")[0])] = pid
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
        for pid in processes_in_group(self.proc.pid):  # whatever is left, also after a failure
            os.kill(pid, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.wait()
        self.log.close()


@pytest.fixture
def start_server(tmp_path):
    servers = []

    def start(*flags: str, subdir: str = "") -> ServerProcess:
        path = tmp_path / (subdir or f"s{len(servers)}")
        path.mkdir()
        server = ServerProcess(path, list(flags))
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


def wait_exit(proc: subprocess.Popen, seconds: float = 30.0) -> int | None:
    """The exit code, or None if it is still running after `seconds` (a liveness bound, not a timing)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return proc.returncode
        time.sleep(0.05)
    return None
