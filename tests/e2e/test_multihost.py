"""Tensor parallelism across hosts: two network namespaces joined by a veth pair stand for two hosts.

The head (`kvengine serve -tp 2 --nnodes 2 --node-rank 0`) runs the engine core and rank 0; the other
host (`--headless --node-rank 1`) runs rank 1, which reaches the head's worker socket and the
torch.distributed store over the veth. The client talks to the head over its ipc:// socket (a file,
which every network namespace can reach).
"""

import asyncio
import contextlib
import os
import signal
import socket
from pathlib import Path

import pytest

from launch.commands.local_server import ServerStartError, wait_until_serving
from tests.e2e.conftest import cmdline, wait_exit
from tests.e2e.netns import SUBNET, Host, NamespaceError, two_hosts
from tests.e2e.serve_support import FP32, GREEDY, SMALL, generate_all, prompts, stream_after_first_outputs

HOSTNAME = socket.gethostname()  # both namespaces share it: hosts are told apart by address
NODES = ["-tp", "2", "--nnodes", "2", "--master-addr", f"{SUBNET}.1"]


class TwoHostServer:
    """The head and the headless host, each in its namespace, each with its log."""

    def __init__(self, hosts: tuple[Host, Host], tmp_path: Path, head_flags: list[str], other_flags: list[str]):
        self.head, self.other = hosts
        self.tmp_path = tmp_path
        self.address = f"ipc://{tmp_path}/engine.sock"
        self.head_proc = self.head.serve(
            [*NODES, "--node-rank", "0", "--address", self.address, "--api-server-count", "0", *head_flags],
            tmp_path / "head.log")
        self.other_proc = self.other.serve([*NODES, "--node-rank", "1", "--headless", *other_flags],
                                           tmp_path / "other.log")

    def logs(self) -> str:
        return "\n".join(f"--- {name}:\n{(self.tmp_path / name).read_text()}" for name in ("head.log", "other.log"))

    async def wait_ready(self) -> None:
        try:
            await asyncio.wait_for(wait_until_serving(self.address, self.head_proc), 300)
        except (ServerStartError, TimeoutError) as e:
            raise RuntimeError(f"{e!r}:\n{self.logs()}") from None

    def remote_worker(self) -> int:
        [pid] = [pid for pid in self.other.pids() if "worker.main" in cmdline(pid)]
        return pid

    def stop(self) -> None:
        """Whatever is left in either namespace, also after a failure."""
        for host, proc in ((self.head, self.head_proc), (self.other, self.other_proc)):
            host.kill_all()
            proc.wait()


@pytest.fixture
def start_two_hosts(tmp_path):
    """start_two_hosts(head_flags, other_flags): a TwoHostServer; every process in both namespaces is killed after."""
    with contextlib.ExitStack() as stack:
        try:
            hosts = stack.enter_context(two_hosts())
        except NamespaceError as e:
            pytest.skip(f"cannot make network namespaces here: {e}")
        servers: list[TwoHostServer] = []

        def start(head_flags: list[str], other_flags: list[str]) -> TwoHostServer:
            server = TwoHostServer(hosts, tmp_path, head_flags, other_flags)
            servers.append(server)
            return server

        try:
            yield start
        finally:
            for server in servers:
                server.stop()


def assert_both_exit(server: TwoHostServer, code: int) -> None:
    assert (wait_exit(server.head_proc, 60), wait_exit(server.other_proc, 60)) == (code, code), server.logs()
    assert server.head.pids() == [] and server.other.pids() == [], server.logs()


def test_tp2_across_two_hosts_gives_the_in_process_engines_greedy_tokens(start_two_hosts):
    from tests.e2e.in_process import in_process_greedy

    server = start_two_hosts([*FP32, *SMALL], [*FP32, *SMALL])
    asyncio.run(server.wait_ready())
    batch = prompts(16, seed=5)
    results = asyncio.run(generate_all(server.address, batch))
    assert all(last.finish_reason == "length" for _, last in results)
    assert [tokens for tokens, _ in results] == in_process_greedy(batch, GREEDY, dtype="float32")
    server.head_proc.send_signal(signal.SIGTERM)  # a plain stop: the other host is told and exits cleanly
    assert_both_exit(server, 0)
    assert "The head stopped; waiting for this host's workers" in server.logs()


def test_each_hosts_kv_budget_is_logged_with_its_host_and_the_minimum_is_used(start_two_hosts):
    # Built-in model at TP 2: 4 layers x 2 KV heads x 16 tokens x (32 + 32) x 4 bytes = 32 KiB per block.
    server = start_two_hosts([*FP32, "--max-model-len", "256", "--kv-cache-memory-bytes", "4MiB"],
                             [*FP32, "--max-model-len", "256", "--kv-cache-memory-bytes", "2MiB"])
    asyncio.run(server.wait_ready())
    log = (server.tmp_path / "head.log").read_text()
    line = {rank: next((line for line in log.splitlines() if f"Rank {rank} can give" in line), "") for rank in (0, 1)}
    assert "Rank 0 can give the KV cache 4 MiB" in line[0] and line[0].endswith(f" on host {HOSTNAME} ({SUBNET}.1)"), log
    assert "Rank 1 can give the KV cache 2 MiB" in line[1] and line[1].endswith(f" on host {HOSTNAME} ({SUBNET}.2)"), log
    assert "KV cache: 64 blocks" in log and "minimum across 2 rank(s)" in log, log


@pytest.mark.parametrize("fault", ["kill_the_remote_worker", "kill_the_remote_host", "cut_the_link"])
def test_a_lost_host_fails_in_flight_requests_and_every_process_exits(start_two_hosts, fault):
    server = start_two_hosts([*FP32, *SMALL], [*FP32, *SMALL])
    asyncio.run(server.wait_ready())
    remote_worker = server.remote_worker()

    def act() -> None:
        if fault == "kill_the_remote_worker":
            os.kill(remote_worker, signal.SIGKILL)
        elif fault == "kill_the_remote_host":  # its process and its worker at once: nobody there reports
            server.other.kill_all()
        else:
            server.other.set_link("down")

    # A liveness bound: without the heartbeats, a cut link leaves rank 0 blocked in gloo for 30 minutes.
    outputs = asyncio.run(asyncio.wait_for(stream_after_first_outputs(server.address, 2, act), 120))
    assert [outs[-1].finish_reason for outs in outputs] == ["error", "error"], server.logs()
    error = outputs[0][-1].error
    assert "worker rank 1 on host " in error and f"({SUBNET}.2)" in error, error
    if fault == "kill_the_remote_worker":
        assert "died (exit code -9)" in error, error
    else:
        assert "sent no heartbeat" in error, error
    assert wait_exit(server.head_proc, 60) == 1, server.logs()
    if fault == "kill_the_remote_host":
        assert wait_exit(server.other_proc, 60) == -signal.SIGKILL
    else:
        assert wait_exit(server.other_proc, 60) == 1, server.logs()
    assert server.head.pids() == [] and server.other.pids() == [], server.logs()
    if fault == "cut_the_link":  # the other host noticed the head's silence by itself
        assert "The head sent no heartbeat" in (server.tmp_path / "other.log").read_text(), server.logs()


def test_hosts_started_with_other_model_flags_fail_at_start_up_on_both(start_two_hosts):
    server = start_two_hosts(["--dtype", "float32", *SMALL], ["--dtype", "bfloat16", *SMALL])
    assert_both_exit(server, 1)
    head_log, other_log = ((server.tmp_path / name).read_text() for name in ("head.log", "other.log"))
    assert "Start-up failed: rank 1 reports other KV cache specs than rank 0" in head_log, server.logs()
    assert "The head stopped after a failure: start-up failed: rank 1 reports other KV cache specs" in other_log
