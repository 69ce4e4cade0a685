"""MultiprocExecutor against scripted worker processes over a real ROUTER socket."""

import os
import signal
import sys
import textwrap

import pytest
import zmq

from engine_core.executor.multiproc_executor import MultiprocExecutor, WorkerFailedError
from protocol import CachedRequestData, SchedulerOutput
from protocol.config import engine_config
from protocol.process.worker_config import WorkerConfig, worker_configs
from tests.launch.executor_support import SILENT_WORKER

# A worker that first sends garbage and an out-of-place message, then a valid KV report.
NOISY_WORKER = textwrap.dedent("""
    import sys, msgspec, zmq
    from protocol.process.worker_config import WorkerConfig
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


def configs(tmp_path, n: int, **settings: object) -> list[WorkerConfig]:
    return worker_configs(engine_config(tensor_parallel_size=n, **settings), f"ipc://{tmp_path}/w.sock", "")


def silent_workers(tmp_path, n: int, action: str, **settings: object) -> MultiprocExecutor:
    """n SILENT_WORKERs that have reported; action: Python run by each after its report (cfg.rank is known)."""
    script = SILENT_WORKER.replace("RANK_ACTION", action)
    executor = MultiprocExecutor(zmq.Context.instance(), f"ipc://{tmp_path}/w.sock", configs(tmp_path, n, **settings),
                                 entry=(sys.executable, "-c", script))
    try:
        executor.determine_available_memory()
    except BaseException:
        executor.shutdown(timeout=0.5)
        raise
    return executor


STEP = SchedulerOutput(step=7, scheduled_new_reqs=[], scheduled_cached_reqs=CachedRequestData(),
                       num_scheduled_tokens={}, total_num_scheduled_tokens=0)


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


def test_check_health_names_a_worker_that_exited_after_start_up(tmp_path):
    executor = silent_workers(tmp_path, 2, "sys.exit(5) if cfg.rank == 1 else time.sleep(60)")
    try:
        executor.procs[1].wait()
        with pytest.raises(WorkerFailedError, match=r"worker rank 1 died \(exit code 5\)"):
            executor.check_health()
    finally:
        executor.shutdown(timeout=0.5)


@pytest.mark.parametrize("stop_rank", [None, 1])
def test_a_step_past_the_step_timeout_names_the_stopped_rank_and_kills_every_worker(tmp_path, stop_rank):
    executor = silent_workers(tmp_path, 2, "time.sleep(60)", step_timeout=0.5)
    try:
        if stop_rank is not None:
            os.kill(executor.procs[stop_rank].pid, signal.SIGSTOP)
        with pytest.raises(WorkerFailedError, match=r"did not answer step 7 within 0.5 s") as failure:
            executor.execute_model(STEP)
        assert failure.value.rank == (stop_rank or 0)
        assert ("its process is stopped" in str(failure.value)) == (stop_rank is not None)
        assert [proc.returncode for proc in executor.procs] == [-signal.SIGKILL] * 2
    finally:
        executor.shutdown(timeout=0.5)


def test_shutdown_kills_workers_that_do_not_exit_when_told(tmp_path):
    executor = silent_workers(tmp_path, 2, "time.sleep(60)")
    executor.shutdown(timeout=0.5)  # Shutdown is ignored, and so is SIGTERM
    assert [proc.returncode for proc in executor.procs] == [-signal.SIGKILL] * 2
