"""Two hosts on one machine: network namespaces joined by a veth pair (needs root and iproute2).

Each pair is isolated (its namespaces see only their own veth ends), so every pair can use the same
subnet; only the names must be unique, which the pid and a counter make them.
"""

import contextlib
import itertools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

SUBNET = "10.99.0"
_counter = itertools.count()


class NamespaceError(RuntimeError):
    """Network namespaces cannot be made here (not root, no iproute2, no kernel support)."""


@dataclass(frozen=True)
class Host:
    netns: str
    link: str  # this host's end of the veth pair
    address: str

    def pids(self) -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", self.netns], check=False, capture_output=True, text=True).stdout
        return [int(pid) for pid in out.split()]

    def popen(self, argv: list[str], log: Path) -> subprocess.Popen:
        """argv inside this namespace, in a session of its own, its output in log (`ip netns exec` execs argv)."""
        with open(log, "wb") as out:
            return subprocess.Popen(["ip", "netns", "exec", self.netns, *argv], stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)

    def serve(self, flags: list[str], log: Path) -> subprocess.Popen:
        return self.popen([sys.executable, "-m", "launch.cli", "serve", *flags], log)

    def kill_all(self) -> None:
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def set_link(self, state: str) -> None:
        _ip("-n", self.netns, "link", "set", self.link, state)


def _ip(*args: str) -> None:
    try:
        done = subprocess.run(["ip", *args], check=False, capture_output=True, text=True)
    except FileNotFoundError as e:
        raise NamespaceError(f"no iproute2: {e}") from None
    if done.returncode:
        raise NamespaceError(f"ip {' '.join(args)}: {done.stderr.strip() or f'exit code {done.returncode}'}")


@contextlib.contextmanager
def two_hosts() -> Iterator[tuple[Host, Host]]:
    """(head, other), SUBNET.1 and SUBNET.2; every process left in them is killed at the end."""
    tag = f"{os.getpid() % 100000}x{next(_counter)}"
    hosts = (Host(f"kvt{tag}a", f"kv{tag}a", f"{SUBNET}.1"), Host(f"kvt{tag}b", f"kv{tag}b", f"{SUBNET}.2"))
    made: list[Host] = []
    try:
        for host in hosts:
            _ip("netns", "add", host.netns)
            made.append(host)
        _ip("link", "add", hosts[0].link, "type", "veth", "peer", "name", hosts[1].link)
        for host in hosts:
            _ip("link", "set", host.link, "netns", host.netns)
            _ip("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", host.link)
            _ip("-n", host.netns, "link", "set", host.link, "up")
            _ip("-n", host.netns, "link", "set", "lo", "up")
        yield hosts
    finally:
        subprocess.run(["ip", "link", "del", hosts[0].link], check=False, capture_output=True)  # if it never left this namespace
        for host in made:
            for _ in range(100):  # a killed process leaves the namespace when it is reaped
                host.kill_all()
                if not host.pids():
                    break
                time.sleep(0.05)
            subprocess.run(["ip", "netns", "del", host.netns], check=False, capture_output=True)  # its veth end goes with it
