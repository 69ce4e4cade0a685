"""--cpu-threads-bind: which cores and how many torch threads each CPU worker gets, and that a worker pins itself."""

import asyncio
import logging
import os
import subprocess
from pathlib import Path

import pytest

from protocol.config import engine_config
from protocol.process.worker_config import auto_binding, format_cores, parse_binding, worker_configs
from tests.e2e.conftest import ServerProcess

USABLE = sorted(os.sched_getaffinity(0))


@pytest.mark.parametrize(("cores", "tp", "expected"), [
    (8, 1, [[0, 1, 2, 3, 4, 5, 6, 7]]),  # every core to the rank; its threads give way to other processes
    (8, 2, [[0, 1, 2, 3], [4, 5, 6, 7]]),
    (8, 3, [[0, 1], [2, 3], [4, 5]]),  # equal shares: the odd cores stay free
    (3, 2, [[0], [1]]),
    (2, 1, [[0, 1]]),  # measured best on 2 cores idle (0.6-0.7x with one core left to the engine core)
    (2, 2, [[0], [1]]),
    (1, 2, [[0], [0]]),  # fewer cores than ranks: they share
    (3, 4, [[0], [1], [2], [0]]),
])
def test_auto_binding(cores, tp, expected):
    assert auto_binding(list(range(cores)), tp) == expected


def test_auto_binding_follows_the_mask_not_the_core_numbers():
    assert auto_binding([4, 5, 9, 10], 1) == [[4, 5, 9, 10]]


def test_only_auto_adapts_the_thread_count():
    [auto] = worker_configs(engine_config(), "ipc://x", "")
    assert auto.adapt_threads and auto.torch_threads == len(USABLE)
    [fixed] = worker_configs(engine_config(cpu_threads_bind=str(USABLE[0])), "ipc://x", "")
    [nobind] = worker_configs(engine_config(cpu_threads_bind="nobind"), "ipc://x", "")
    [cuda] = worker_configs(engine_config(device="cuda"), "ipc://x", "")
    assert not (fixed.adapt_threads or nobind.adapt_threads or cuda.adapt_threads)


def test_explicit_core_lists():
    assert parse_binding("0-1|2-3", 2, [0, 1, 2, 3]) == [[0, 1], [2, 3]]
    assert parse_binding(" 3, 0-1 ,1 ", 1, [0, 1, 2, 3]) == [[0, 1, 3]]


@pytest.mark.parametrize(("text", "tp", "message"), [
    ("0-1", 2, r"gives 1 core lists for tensor parallel size 2 \(one per rank, separated by \|\)"),
    ("0|1|2", 2, "gives 3 core lists for tensor parallel size 2"),
    ("0-9", 1, r"cores 4-9 are outside the CPU affinity mask of this process \(0-3\)"),
    ("1|7", 2, r"cores 7 are outside"),
    ("x", 1, "'x' is not a core or a range like 0-3"),
    ("3-1", 1, "'3-1' is not a core"),
    ("0|", 2, "'' is not a core"),
    ("0-", 1, "'0-' is not a core"),
])
def test_invalid_core_lists_are_named(text, tp, message):
    with pytest.raises(ValueError, match=message):
        parse_binding(text, tp, [0, 1, 2, 3])


def test_format_cores():
    assert format_cores([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"


def test_worker_configs_log_each_ranks_cores(caplog):
    core = USABLE[-1]
    caplog.set_level(logging.INFO)
    [config] = worker_configs(engine_config(cpu_threads_bind=str(core)), "ipc://x", "")
    assert (config.cpu_cores, config.torch_threads) == ([core], 1)
    assert f"rank 0: 1 threads on cores {core}" in caplog.text


def test_nobind_and_cuda_do_not_pin():
    configs = worker_configs(engine_config(cpu_threads_bind="nobind", tensor_parallel_size=2), "ipc://x", "")
    assert [(c.cpu_cores, c.torch_threads) for c in configs] == [(None, max(1, len(USABLE) // 2))] * 2
    [cuda] = worker_configs(engine_config(device="cuda", cpu_threads_bind="0-99999"), "ipc://x", "")
    assert (cuda.cpu_cores, cuda.torch_threads) == (None, 1)


def test_auto_uses_the_affinity_mask():
    configs = worker_configs(engine_config(tensor_parallel_size=2), "ipc://x", "")
    assert [c.cpu_cores for c in configs] == auto_binding(USABLE, 2)
    assert [c.torch_threads for c in configs] == [len(c) for c in auto_binding(USABLE, 2)]


def allowed_cores(pid: int) -> str:
    status = Path(f"/proc/{pid}/status").read_text()
    return next(line for line in status.splitlines() if line.startswith("Cpus_allowed_list:")).split()[1]


def test_a_worker_runs_on_the_cores_it_was_given(tmp_path):
    core = USABLE[-1]
    server = ServerProcess(tmp_path, ["--max-model-len", "128", "--kv-cache-memory-bytes", "4MiB",
                                      "--cpu-threads-bind", str(core)])
    try:
        asyncio.run(server.wait_ready())
        [pid] = server.worker_pids().values()
        assert allowed_cores(pid) == str(core)
        assert allowed_cores(server.proc.pid) == format_cores(USABLE)  # the engine core itself stays unpinned
        assert f"rank 0: 1 threads on cores {core}" in server.output()
    finally:
        server.stop()


def test_serve_refuses_a_wrong_binding_with_one_line(tmp_path):
    server = ServerProcess(tmp_path, ["--cpu-threads-bind", "0|0"])
    try:
        assert server.proc.wait(timeout=120) == 1
    except subprocess.TimeoutExpired:
        pytest.fail(f"serve did not exit:\n{server.output()}")
    finally:
        server.stop()
    assert "Start-up failed: --cpu-threads-bind '0|0' gives 2 core lists for tensor parallel size 1" in server.output()
    assert "Traceback" not in server.output()
