"""Fixtures that start real `kvengine` subprocesses and always stop them and any server they start, also on failure."""

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from launch.commands.local_server import ServerStartError, wait_until_serving


def _live_processes() -> dict[int, list[str]]:
    """pid -> the fields of /proc/PID/stat after the command name (state, ppid, pgrp, ...), zombies left out."""
    out = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z":
            out[int(stat.parent.name)] = fields
    return out


def processes_in_group(pgid: int) -> list[int]:
    """Live processes whose process group is pgid (read from /proc, no extra dependency)."""
    return [pid for pid, fields in _live_processes().items() if int(fields[2]) == pgid]


def descendants(pid: int) -> list[int]:
    """Live children, grandchildren, ... of pid."""
    children: dict[int, list[int]] = {}
    for child, fields in _live_processes().items():
        children.setdefault(int(fields[1]), []).append(child)
    out, todo = [], [pid]
    while todo:
        found = children.get(todo.pop(), [])
        out += found
        todo += found
    return out


def cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    except OSError:
        return []


def wait_until(condition: Callable[[], object], seconds: float = 60.0) -> bool:
    """Poll until condition() is true; False if it still is not after `seconds` (a liveness bound, not a timing)."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


class ServerProcess:
    def __init__(self, tmp_path: Path, flags: list[str]) -> None:
        self.address = f"ipc://{tmp_path}/engine.sock"
        flags = ["--address", self.address, *flags]  # a later --address in flags wins
        if "--port" not in flags and "--api-server-count" not in flags:  # no HTTP API unless the test asks
            flags = ["--api-server-count", "0", *flags]
        self.log_path = tmp_path / "server.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "launch.cli", "serve", *flags],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )

    def output(self) -> str:
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
            args = cmdline(pid)
            if "worker.main" in args:
                config = args[args.index("worker.main") + 1]
                out[int(config.split('"rank":')[1].split(",")[0])] = pid
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(30)
        for pid in processes_in_group(self.proc.pid):  # whatever is left, also after a failure
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.wait()


@dataclass(frozen=True)
class SpawnedServer:
    """A `kvengine serve` that a command started: it leads a session of its own (LocalServer)."""

    pid: int
    address: str

    def processes(self) -> list[int]:
        """The server and its workers, while any is alive."""
        return processes_in_group(self.pid)


class CommandProcess:
    """A command in a session of its own, its output in files; stop() ends it and every server it started."""

    def __init__(self, path: Path, argv: list[str], env: dict[str, str] | None = None) -> None:
        path.mkdir()
        self.path = path
        self.servers: dict[int, SpawnedServer] = {}
        with open(path / "stdout", "wb") as out, open(path / "stderr", "wb") as err:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=err, start_new_session=True, cwd=path, env=env)

    def stdout(self) -> str:
        return (self.path / "stdout").read_text()

    def stderr(self) -> str:
        return (self.path / "stderr").read_text()

    def find_servers(self) -> list[SpawnedServer]:
        """The `kvengine serve` processes among its descendants (remembered: a server outlives a killed parent)."""
        for pid in descendants(self.proc.pid):
            args = cmdline(pid)
            if "serve" in args and "--address" in args and pid not in self.servers:
                self.servers[pid] = SpawnedServer(pid, args[args.index("--address") + 1])
        return list(self.servers.values())

    def wait_server(self) -> SpawnedServer:
        assert wait_until(self.find_servers), f"no server started:\n{self.stderr()}"
        return self.find_servers()[0]

    def wait(self, seconds: float = 300.0) -> int | None:
        return wait_exit(self.proc, seconds)

    def stop(self) -> None:
        """SIGTERM to its group, then SIGKILL to whatever is left of it and of its servers."""
        self.find_servers()
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            wait_exit(self.proc)
        for pgid in [self.proc.pid, *self.servers]:
            for pid in processes_in_group(pgid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.wait()


@pytest.fixture
def start_command(tmp_path):
    """start_command(*kvengine_args) or start_command(shell="line"): a CommandProcess, stopped after the test."""
    commands: list[CommandProcess] = []

    def start(*args: str, shell: str | None = None, env: dict[str, str] | None = None) -> CommandProcess:
        argv = ["bash", "-c", shell] if shell is not None else [sys.executable, "-m", "launch.cli", *args]
        command = CommandProcess(tmp_path / f"c{len(commands)}", argv, env)
        commands.append(command)
        return command

    yield start
    for command in commands:
        command.stop()


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
