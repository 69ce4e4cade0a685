"""MultiprocExecutor against scripted worker processes over a real ROUTER socket."""

import sys
import textwrap

import pytest
import zmq

from launch.multiproc_executor import MultiprocExecutor, WorkerFailedError
from launch.worker_config import WorkerConfig, worker_configs
from protocol.config import engine_config

# A worker that first sends garbage and an out-of-place message, then a valid KV report.
NOISY_WORKER = textwrap.dedent("""
    import sys, msgspec, zmq
    from launch.worker_config import WorkerConfig
    from protocol import FullAttentionSpec, WorkerKVReport, WorkerReady
    from protocol.codec import worker_to_engine_codec
    cfg = msgspec.json.decode(sys.argv[1], type=WorkerConfig)
    sock = zmq.Context().socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, f"rank{cfg.rank}".encode())
    sock.connect(cfg.engine_address)
    codec = worker_to_engine_codec()
    sock.send(b"\\xc1 not msgpack")
    sock.send(codec.encode(WorkerReady(cfg.rank, 5)))
    sock.send(codec.encode(WorkerKVReport(cfg.rank, 1 << 20, {"l0": FullAttentionSpec(16, 1, 8, 2)}, [], 64, 100)))
    sock.recv()  # wait for anything, then exit
""")


def configs(tmp_path, n: int) -> list[WorkerConfig]:
    return worker_configs(engine_config(tensor_parallel_size=n), f"ipc://{tmp_path}/w.sock", "")


def test_malformed_and_unexpected_worker_messages_are_dropped(tmp_path, caplog):
    ctx = zmq.Context()
    executor = MultiprocExecutor(ctx, f"ipc://{tmp_path}/w.sock", configs(tmp_path, 2),
                                 entry=(sys.executable, "-c", NOISY_WORKER))
    try:
        reports = executor.determine_available_memory()
        assert [r.rank for r in reports] == [0, 1]
        assert "Dropped a malformed message" in caplog.text
        assert "Dropped an unexpected WorkerReady" in caplog.text
    finally:
        executor.shutdown(timeout=2.0)
        ctx.term()


def test_a_worker_that_exits_is_named(tmp_path):
    ctx = zmq.Context()
    executor = MultiprocExecutor(ctx, f"ipc://{tmp_path}/w.sock", configs(tmp_path, 2),
                                 entry=(sys.executable, "-c", "import sys; sys.exit(3)"))
    try:
        with pytest.raises(WorkerFailedError, match=r"worker rank \d died \(exit code 3\)"):
            executor.determine_available_memory()
    finally:
        executor.shutdown(timeout=2.0)
        ctx.term()
