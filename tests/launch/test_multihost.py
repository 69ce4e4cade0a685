"""Several hosts on loopback: which ranks a host runs, the head's side of the heartbeats (a scripted
headless host on a real DEALER socket), and a real `kvengine serve --headless` against a scripted head."""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import zmq

from engine_core.executor.multiproc_executor import MultiprocExecutor, WorkerFailedError
from protocol import Shutdown, WorkerError, WorkerKVReport
from protocol.codec import engine_to_worker_codec, worker_to_engine_codec
from protocol.config import engine_config
from protocol.messages import HEARTBEAT_TIMEOUT, EngineHeartbeat, NodeHeartbeat
from protocol.process.hosts import host_label, interface_with, source_address
from protocol.process.worker_config import worker_configs
from tests.e2e.conftest import processes_in_group, wait_exit, wait_until
from tests.e2e.serve_support import free_port
from tests.launch.executor_support import SILENT_WORKER

TO_HEAD, FROM_HEAD = worker_to_engine_codec(), engine_to_worker_codec()


def two_host_config(port: int, node_rank: int = 0, tp: int = 2, **settings: object):
    """nnodes 2 on loopback; the worker socket (master_port + 1) is port."""
    return engine_config(tensor_parallel_size=tp, nnodes=2, node_rank=node_rank, headless=node_rank > 0,
                         master_addr="127.0.0.1", master_port=port - 1, **settings)


def test_each_host_runs_its_share_of_the_ranks_and_reports_its_label():
    configs = worker_configs(two_host_config(29502, node_rank=1, tp=4), "tcp://127.0.0.1:29502", "tcp://x", "b (1.2.3.4)")
    assert [(c.rank, c.host) for c in configs] == [(2, "b (1.2.3.4)"), (3, "b (1.2.3.4)")]
    assert [c.rank for c in worker_configs(two_host_config(29502, tp=4), "", "")] == [0, 1]
    assert [c.rank for c in worker_configs(engine_config(tensor_parallel_size=2), "", "")] == [0, 1]


def test_the_address_and_interface_toward_the_head():
    assert source_address("127.0.0.1") == "127.0.0.1"
    assert interface_with("127.0.0.1") == "lo"
    assert interface_with("192.0.2.1") is None  # TEST-NET-1: on no interface here
    assert host_label("127.0.0.1") == f"{socket.gethostname()} (127.0.0.1)"


class FakeHost:
    """The headless host of node 1 as the head sees it: a DEALER that heartbeats when told to."""

    def __init__(self, ctx: zmq.Context, port: int) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, b"node1")
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(f"tcp://127.0.0.1:{port}")

    def send(self, msg: NodeHeartbeat | WorkerError) -> None:
        self.sock.send(TO_HEAD.encode(msg))

    def received(self) -> list:
        out = []
        while self.sock.poll(0):
            out.append(FROM_HEAD.decode(self.sock.recv()))
        return out


@pytest.fixture
def head():
    """(executor with rank 0 scripted to report and sleep, fake node 1); rank 1 never reports."""
    port = free_port()
    ctx = zmq.Context()
    configs = worker_configs(two_host_config(port), f"tcp://127.0.0.1:{port}", "", host="a (127.0.0.1)")
    executor = MultiprocExecutor(ctx, configs[0].engine_address, configs,
                                 entry=(sys.executable, "-c", SILENT_WORKER.replace("RANK_ACTION", "time.sleep(60)")))
    host = FakeHost(ctx, port)
    try:
        yield executor, host
    finally:
        executor.shutdown(timeout=0.5)
        host.sock.close()
        ctx.term()


def test_a_host_that_falls_silent_is_named_with_its_ranks(head):
    executor, host = head
    host.send(NodeHeartbeat(1, "b (10.0.0.2)", 2, 2))  # one heartbeat, then silence
    started = time.monotonic()
    with pytest.raises(WorkerFailedError, match=r"worker rank 1 on host b \(10.0.0.2\) is lost: its host sent no "
                                                r"heartbeat for 3 s \(ranks 1-1; the host died or is cut off\)"):
        executor.determine_available_memory()
    assert time.monotonic() - started >= HEARTBEAT_TIMEOUT  # not before the timeout (no upper bound asserted)
    assert EngineHeartbeat() in host.received()  # the head answered while it waited


def test_a_host_that_never_joined_is_waited_for(head):
    executor, _ = head
    with pytest.raises(TimeoutError):  # no heartbeat yet: start-up waits for the host, as for a loading worker
        executor._recv(WorkerKVReport, {1}, deadline=time.monotonic() + HEARTBEAT_TIMEOUT + 1)


@pytest.mark.parametrize("tp,nnodes", [(4, 2), (2, 1)])
def test_a_host_started_with_another_parallel_layout_is_refused(head, tp, nnodes):
    executor, host = head
    host.send(NodeHeartbeat(1, "b", tp, nnodes))
    with pytest.raises(WorkerFailedError, match=rf"worker rank 1 on host b was started with tensor parallel size {tp} "
                                                rf"over {nnodes} hosts, the head with 2 over 2: give every host the "
                                                "same -tp and --nnodes"):
        executor.determine_available_memory()


def test_a_hosts_report_of_a_dead_worker_fails_the_engine(head):
    executor, host = head
    host.send(NodeHeartbeat(1, "b (10.0.0.2)", 2, 2))
    host.send(WorkerError(1, "died (exit code -9)"))
    with pytest.raises(WorkerFailedError, match=r"worker rank 1 on host b \(10.0.0.2\) died \(exit code -9\)"):
        executor.determine_available_memory()


def test_an_idle_head_notices_a_silent_host_and_tells_hosts_why_it_stops(head):
    executor, host = head
    host.send(NodeHeartbeat(1, "b", 2, 2))
    assert wait_until(lambda: executor.check_health() is None and executor.remote[b"node1"].last_seen is not None)
    with pytest.raises(WorkerFailedError, match="is lost"):
        wait_until(lambda: executor.check_health(), seconds=30)  # None until it raises
    executor.shutdown(timeout=0.5, error="worker rank 1 on host b is lost")
    assert wait_until(lambda: Shutdown(error="worker rank 1 on host b is lost") in host.received())


# ---- the headless host's side, against a scripted head --------------------------------------


class FakeHead:
    def __init__(self, port: int) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(f"tcp://127.0.0.1:{port}")

    def recv_heartbeat(self) -> NodeHeartbeat:
        while True:
            assert self.sock.poll(60_000), "no message from the headless host"
            identity, data = self.sock.recv_multipart()
            msg = TO_HEAD.decode(data)
            if isinstance(msg, NodeHeartbeat):
                assert identity == b"node1"
                return msg

    def send(self, msg: EngineHeartbeat | Shutdown) -> None:
        self.sock.send_multipart([b"node1", FROM_HEAD.encode(msg)])

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


@pytest.fixture
def headless(tmp_path):
    """(fake head, the headless host's process, its log); its workers block joining a store nobody serves."""
    port = free_port()
    head = FakeHead(port)
    log = tmp_path / "headless.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "launch.cli", "serve", "--headless", "-tp", "2", "--nnodes", "2",
                                 "--node-rank", "1", "--master-addr", "127.0.0.1", "--master-port", str(port - 1)],
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield head, proc, log
    finally:
        for pid in processes_in_group(proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait()
        head.close()


@pytest.mark.parametrize("head_does", ["falls_silent", "stops_after_a_failure", "stops"])
def test_the_headless_host_follows_the_head(headless, head_does):
    head, proc, log = headless
    beat = head.recv_heartbeat()
    assert beat == NodeHeartbeat(1, f"{socket.gethostname()} (127.0.0.1)", 2, 2)
    assert wait_until(lambda: len(processes_in_group(proc.pid)) == 2)  # itself and rank 1's worker
    for _ in range(4):
        head.send(EngineHeartbeat())
        head.recv_heartbeat()
    if head_does == "stops_after_a_failure":
        head.send(Shutdown(error="worker rank 0 on host a died (exit code -9)"))
    elif head_does == "stops":
        head.send(Shutdown())
    assert wait_exit(proc, 60) == (0 if head_does == "stops" else 1), log.read_text()
    assert processes_in_group(proc.pid) == []  # its worker, blocked joining the group, was killed
    expected = {
        "falls_silent": "The head sent no heartbeat for 3 s (it died or this host is cut off)",
        "stops_after_a_failure": "The head stopped after a failure: worker rank 0 on host a died (exit code -9)",
        "stops": "The head stopped; waiting for this host's workers",
    }[head_does]
    assert expected in log.read_text()


def test_the_headless_host_reports_a_dead_worker(headless):
    head, proc, log = headless
    head.recv_heartbeat()
    assert wait_until(lambda: len(processes_in_group(proc.pid)) == 2)
    [worker] = [pid for pid in processes_in_group(proc.pid) if pid != proc.pid]
    os.kill(worker, signal.SIGKILL)
    while True:
        assert head.sock.poll(60_000), log.read_text()
        msg = TO_HEAD.decode(head.sock.recv_multipart()[1])
        if isinstance(msg, WorkerError):
            break
    assert msg == WorkerError(1, "died (exit code -9)")
    assert wait_exit(proc, 60) == 1
    assert processes_in_group(proc.pid) == []
