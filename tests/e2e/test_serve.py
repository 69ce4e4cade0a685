"""End-to-end: the real server as a subprocess, driven through the asyncio client over ZeroMQ."""

import asyncio
import os
import signal
import socket
import time
from pathlib import Path

import pytest
import zmq

from launch.client import AsyncEngineClient, EngineDeadError
from protocol import SamplingParams
from tests.e2e.conftest import processes_in_group, wait_exit
from tests.e2e.serve_support import (
    FP32,
    GREEDY,
    LONG,
    LONG_RUN,
    LONG_RUN_FLAGS,
    SMALL,
    collect,
    generate_all,
    prompts,
    vanish_mid_requests,
)


@pytest.mark.parametrize("tp", [1, 2])
def test_concurrent_streamed_requests_match_in_process_engine(start_server, tp):
    from tests.e2e.in_process import in_process_greedy

    server = start_server("-tp", str(tp), *FP32, *SMALL)
    asyncio.run(server.wait_ready())
    batch = prompts(16, seed=tp)
    results = asyncio.run(generate_all(server.address, batch))
    assert all(last.finish_reason == "length" for _, last in results)
    assert all(len(tokens) == GREEDY.max_tokens for tokens, _ in results)
    assert [tokens for tokens, _ in results] == in_process_greedy(batch, GREEDY, dtype="float32")


@pytest.mark.parametrize("tp", [1, 2])
def test_async_scheduling_serves_the_same_tokens_and_stops_where_asked(start_server, tp):
    """Step N+1 goes to the workers before step N's tokens are applied: a request that stops is computed
    once more and that token must never reach its client."""
    from tests.e2e.in_process import in_process_greedy

    server = start_server("-tp", str(tp), "--async-scheduling", *FP32, *SMALL)
    asyncio.run(server.wait_ready())
    batch = prompts(16, seed=30 + tp)
    want = in_process_greedy(batch, GREEDY, dtype="float32")
    stops = [None if i % 2 else want[i][i % GREEDY.max_tokens] for i in range(len(batch))]
    params = [GREEDY if stop is None else SamplingParams(max_tokens=GREEDY.max_tokens, temperature=0.0,
                                                         ignore_eos=True, stop_token_ids=[stop]) for stop in stops]

    async def run_all():
        async with AsyncEngineClient(server.address) as client:
            return await asyncio.gather(*(collect(client, p, sp) for p, sp in zip(batch, params, strict=True)))

    for (tokens, last), expected, stop in zip(asyncio.run(run_all()), want, stops, strict=True):
        if stop is None:
            assert (tokens, last.finish_reason) == (expected, "length")
        else:
            assert (tokens, last.finish_reason) == (expected[: expected.index(stop) + 1], "stop")


def test_sliding_window_model_served_with_two_ranks_matches_in_process_engine(start_server, tmp_path):
    """A Qwen2 model whose last two layers slide: two KV cache groups, the hybrid coordinator, TP 2."""
    from launch.cli import main
    from tests.e2e.in_process import in_process_greedy

    model = str(tmp_path / "qwen2-sliding")
    assert main(["make-model", "--architecture", "qwen2", "--sliding-window", "24", model]) == 0
    server = start_server("--model", model, "-tp", "2", *FP32, *SMALL)
    asyncio.run(server.wait_ready())
    assert "in 2 group(s)" in server.output()
    assert server.output().count("freed activations stay mapped") == 2  # worker/cpu_malloc.py, on each rank
    batch = prompts(8, seed=21, lo=30, hi=80)  # longer than the window
    results = asyncio.run(generate_all(server.address, batch))
    assert [tokens for tokens, _ in results] == in_process_greedy(batch, GREEDY, model=model, dtype="float32")


def test_abort_and_cancellation_free_every_block(start_server):
    server = start_server(*LONG_RUN_FLAGS, "--check-block-tables")
    asyncio.run(server.wait_ready())

    async def scenario():  # LONG_RUN: both requests still running when cancelled and aborted half a second in
        async with AsyncEngineClient(server.address) as client:
            aborted_id = "to-abort"
            stream = client.generate(prompts(1, 5)[0], LONG_RUN, request_id=aborted_id)
            first = await stream.__anext__()  # running now

            async def cancelled():
                async for _ in client.generate(prompts(1, 6)[0], LONG_RUN):
                    pass

            task = asyncio.create_task(cancelled())
            await asyncio.sleep(0.5)
            task.cancel()
            await client.abort(aborted_id)
            rest = [out async for out in stream]
            for _ in range(100):  # the abort of the cancelled request is asynchronous
                stats = await client.get_stats()
                if stats.num_running_reqs == 0:
                    break
                await asyncio.sleep(0.05)
            return first, rest, stats

    _first, rest, stats = asyncio.run(scenario())
    assert rest[-1].finish_reason == "abort"
    assert stats.num_running_reqs == 0 and stats.num_waiting_reqs == 0
    assert stats.kv_cache_usage == 0.0  # free == N - 1


def test_block_count_is_the_minimum_across_ranks(start_server):
    # Built-in model at TP 2: 4 layers x 2 KV heads x 16 tokens x (32 + 32) x 4 bytes = 32 KiB per block.
    server = start_server("-tp", "2", *FP32, "--max-model-len", "256", "--kv-cache-memory-bytes", "4MiB,2MiB")
    asyncio.run(server.wait_ready())
    log = server.output()
    assert "KV cache: 64 blocks" in log, log
    assert "Rank 0 can give the KV cache 4 MiB" in log and "Rank 1 can give the KV cache 2 MiB" in log


def test_sigterm_stops_every_process_and_leaves_no_files(start_server):
    server = start_server("-tp", "2", *SMALL)
    asyncio.run(server.wait_ready())
    workers = server.worker_pids()
    assert sorted(workers) == [0, 1]
    server.proc.send_signal(signal.SIGTERM)
    assert wait_exit(server.proc) == 0
    assert processes_in_group(server.proc.pid) == []
    assert not Path(server.address.removeprefix("ipc://")).exists()
    assert not [p for p in Path("/dev/shm").glob("*") if str(server.proc.pid) in p.name]


def test_sigterm_during_start_up_does_not_wait_for_the_workers(start_server):
    server = start_server("-tp", "2", *SMALL)
    for _ in range(600):  # the workers exist but are still loading
        if len(server.worker_pids()) == 2 or server.proc.poll() is not None:
            break
        time.sleep(0.01)
    assert "kvengine ready" not in server.output()
    server.proc.send_signal(signal.SIGTERM)
    assert wait_exit(server.proc) == 0
    assert processes_in_group(server.proc.pid) == []
    assert "Start-up interrupted" in server.output()


def test_killed_worker_fails_in_flight_requests_and_the_server_exits(start_server):
    server = start_server("-tp", "2", *SMALL)
    asyncio.run(server.wait_ready())

    async def scenario():
        async with AsyncEngineClient(server.address) as client:
            tasks = [asyncio.create_task(collect(client, p, LONG)) for p in prompts(4, 9)]
            await asyncio.sleep(1.0)
            os.kill(server.worker_pids()[1], signal.SIGKILL)
            return await asyncio.gather(*tasks, return_exceptions=True)

    results = asyncio.run(scenario())
    for result in results:  # an error output, or the client noticing the server is gone
        assert isinstance(result, EngineDeadError) or result[1].finish_reason == "error", result
    assert wait_exit(server.proc) not in (0, None)
    assert "worker rank 1 died" in server.output()


def test_garbage_on_the_input_socket_does_not_stop_the_server(start_server):
    server = start_server(*SMALL)
    asyncio.run(server.wait_ready())
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(server.address)
    sock.send(b"\xc1garbage")
    sock.send_multipart([b"two", b"frames"])
    sock.send(b"")
    sock.close(linger=1000)
    ctx.term()
    results = asyncio.run(generate_all(server.address, prompts(2)))
    assert all(last.finish_reason == "length" for _, last in results)
    assert "Dropped a malformed client message" in server.output()


def test_a_disconnected_client_has_its_requests_aborted(start_server):
    server = start_server(*LONG_RUN_FLAGS)
    asyncio.run(server.wait_ready())
    stats = asyncio.run(vanish_mid_requests(server.address, prompts(1)))
    assert stats.num_running_reqs == 0 and stats.kv_cache_usage == 0.0, stats
    assert server.output().count("A client disconnected; aborting its 1 request(s)") == 1, server.output()


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--kv-cache-memory-bytes", "1000"], "No available memory for the cache blocks"),
        (["--kv-cache-memory-bytes", "1MiB", "--max-model-len", "2048"], "estimated maximum model length"),
    ],
)
def test_start_up_errors_end_with_one_clear_line(start_server, flags, message):
    server = start_server(*flags)
    assert wait_exit(server.proc) == 1
    out = server.output()
    assert message in out and "Traceback" not in out, out


def test_port_in_use_is_a_clear_start_up_error(start_server):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = start_server("--address", f"tcp://127.0.0.1:{port}")
        assert wait_exit(server.proc) == 1
    assert f"cannot listen on tcp://127.0.0.1:{port}" in server.output() and "Traceback" not in server.output()
