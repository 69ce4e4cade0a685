"""`kvengine serve --data-parallel-size 2`: real engine-core processes behind the router, over real sockets."""

import asyncio
import os
import random
import signal
import urllib.request

import pytest
import zmq

from launch.client import AsyncEngineClient
from protocol import (
    EngineCoreGetInfo,
    EngineCoreGetStats,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineInfo,
    SamplingParams,
    SchedulerStats,
)
from protocol.codec import client_codec, outputs_codec
from tests.e2e.conftest import ServerProcess, cmdline, descendants, processes_in_group, wait_exit, wait_until
from tests.e2e.serve_support import LONG_RUN_FLAGS, collect, vanish_mid_requests

SMALL = ["--max-model-len", "512", "--kv-cache-memory-bytes", "8MiB", "--dtype", "float32"]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
BLOCK = 16  # the default --block-size


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(1024) for _ in range(3 * BLOCK)]
    # Half share a 3-block prefix, so that routing by prefix has something to find.
    return [(shared if i % 2 else []) + [rng.randrange(1024) for _ in range(rng.randrange(4, 40))] for i in range(n)]


def raw_generate(address: str, batch: list[list[int]], params: SamplingParams) -> dict[str, list]:
    """Every output the server sends for these requests, on a plain DEALER: per request id, its outputs in order.

    Reads until each request finished, then asks for stats: the answer comes after anything an engine sent before."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    encode, decode = client_codec().encode, outputs_codec().decode
    seen: dict[str, list] = {f"r{i}": [] for i in range(len(batch))}
    try:
        for i, prompt in enumerate(batch):
            sock.send(encode(EngineCoreRequest(f"r{i}", prompt, params, 0.0)))
        finished = 0
        stats_asked = False
        while True:
            assert sock.poll(120_000), "the server stopped answering"
            msg: EngineCoreOutputs = decode(sock.recv())
            for out in msg.outputs:
                seen[out.request_id].append(out)
                finished += out.finish_reason is not None
            if msg.stats is not None:
                return seen
            if finished >= len(batch) and not stats_asked:
                sock.send(encode(EngineCoreGetStats()))
                stats_asked = True
    finally:
        sock.close()
        ctx.term()


def engine_info(address: str) -> EngineInfo:
    """The answer to EngineCoreGetInfo, on a plain DEALER."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        sock.send(client_codec().encode(EngineCoreGetInfo()))
        assert sock.poll(120_000), "the server stopped answering"
        info = outputs_codec().decode(sock.recv()).info
        assert info is not None
        return info
    finally:
        sock.close()
        ctx.term()


async def engine_stats(address: str) -> list[SchedulerStats]:
    async with AsyncEngineClient(address) as client:
        stats = await client.get_stats()
    assert stats.engines is not None
    return stats.engines


def test_dp2_answers_every_request_exactly_once_with_dp1s_greedy_tokens(start_server):
    dp2 = start_server("-dp", "2", "--router-policy", "prefix", *SMALL)
    dp1 = start_server(*SMALL)
    asyncio.run(dp2.wait_ready())
    asyncio.run(dp1.wait_ready())
    batch = prompts(16, seed=1)
    got = raw_generate(dp2.address, batch, GREEDY)
    want = raw_generate(dp1.address, batch, GREEDY)
    for outs in got.values():
        assert [o.finish_reason for o in outs].count(None) == len(outs) - 1, "not exactly one final output"
        assert outs[-1].finish_reason == "length"
    tokens = {rid: [t for o in outs for t in o.new_token_ids] for rid, outs in got.items()}
    assert tokens == {rid: [t for o in outs for t in o.new_token_ids] for rid, outs in want.items()}
    assert all(len(t) == GREEDY.max_tokens for t in tokens.values())
    per_engine = asyncio.run(engine_stats(dp2.address))
    assert len(per_engine) == 2
    # The router took max_model_len from the engines' handshake: what one engine with the same flags serves.
    one, two = engine_info(dp1.address), engine_info(dp2.address)
    assert one.max_model_len == two.max_model_len == 512
    assert two.num_gpu_blocks == 2 * one.num_gpu_blocks and two.block_size == one.block_size == BLOCK
    assert all(s.num_prompt_tokens > 0 for s in per_engine), "one engine got no request"
    assert sum(s.num_prompt_tokens for s in per_engine) == sum(map(len, batch))


def wave(seed: int, prefixes: list[list[int]]) -> list[list[int]]:
    rng = random.Random(seed)
    return [p + [rng.randrange(1024) for _ in range(20)] for p in prefixes]


@pytest.mark.parametrize("policy", ["prefix", "round-robin"])
def test_a_second_wave_of_shared_prefixes_goes_to_their_holders_under_prefix_only(start_server, policy):
    """Three 4-block prefixes, sent at once in a fixed order (engines 0, 1, 0: by load, or in turn), then again with
    new suffixes. By prefix each returns to its holder and hits its 64 tokens; round-robin, continuing at engine 1,
    sends each to the other engine, which holds none of it."""
    server = start_server("-dp", "2", "--router-policy", policy, *SMALL)
    asyncio.run(server.wait_ready())
    rng = random.Random(7)
    prefixes = [[rng.randrange(1024) for _ in range(4 * BLOCK)] for _ in range(3)]

    def run_wave(seed: int) -> list[int]:
        outputs = raw_generate(server.address, wave(seed, prefixes), GREEDY)
        return [outputs[f"r{i}"][-1].num_cached_tokens for i in range(len(prefixes))]

    first = run_wave(1)
    before = asyncio.run(engine_stats(server.address))
    second = run_wave(2)
    after = asyncio.run(engine_stats(server.address))
    hits = [a.prefix_cache_hits - b.prefix_cache_hits for a, b in zip(after, before, strict=True)]
    assert first == [0, 0, 0]
    assert [b.num_prompt_tokens for b in before] == [2 * 84, 84]  # the first wave: engines 0, 1, 0
    if policy == "prefix":
        assert second == [4 * BLOCK] * 3
        assert hits == [2 * 4 * BLOCK, 4 * BLOCK]  # prefixes 0 and 2 on engine 0, prefix 1 on engine 1
        assert asyncio.run(reset(server.address)) is True  # goes to every engine: none has a prefix left
        assert run_wave(3) == [0, 0, 0]
    else:
        assert second == [0, 0, 0]
        assert hits == [0, 0]


async def reset(address: str) -> bool:
    async with AsyncEngineClient(address) as client:
        return await client.reset_prefix_cache()


def engine_pids(server: ServerProcess) -> dict[int, int]:
    """engine index -> pid of the router's engine-core processes."""
    out = {}
    for pid in descendants(server.proc.pid):
        args = cmdline(pid)
        if "serve" in args and "--address" in args:
            address = args[args.index("--address") + 1]
            if "/engine-" in address:
                out[int(address.rsplit("/engine-", 1)[1].split(".")[0])] = pid
    return out


def test_a_killed_engine_fails_its_requests_and_the_other_serves_on(start_server):
    server = start_server("-dp", "2", "--router-policy", "round-robin", "--max-model-len", "2048",
                          "--kv-cache-memory-bytes", "40MiB")
    asyncio.run(server.wait_ready())
    pids = engine_pids(server)
    assert sorted(pids) == [0, 1]
    long = SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True)  # far longer than the test's steps

    async def scenario():
        async with AsyncEngineClient(server.address) as client:
            started = [asyncio.Event() for _ in range(4)]

            async def one(i: int):
                last = None
                async for out in client.generate([5 + i, 6, 7, 8], long):
                    started[i].set()
                    last = out
                return last

            tasks = [asyncio.create_task(one(i)) for i in range(4)]  # two per engine, in turn
            await asyncio.gather(*(e.wait() for e in started))
            os.kill(pids[1], signal.SIGKILL)
            while sum(t.done() for t in tasks) < 2:  # engine 1's two; engine 0's still have most of 2000 to go
                await asyncio.wait([t for t in tasks if not t.done()], return_when=asyncio.FIRST_COMPLETED)
            failed = [t.result() for t in tasks if t.done()]
            for t in tasks:
                if not t.done():
                    t.cancel()  # the other engine's requests: aborted, no need to wait for 2000 tokens
            await asyncio.gather(*tasks, return_exceptions=True)
            after = await collect(client, [9, 9, 9], GREEDY)
            return failed, after

    failed, (tokens, after) = asyncio.run(scenario())
    assert [last.finish_reason for last in failed] == ["error", "error"], [(x.finish_reason, x.error) for x in failed]
    assert all("engine core 1 stopped" in last.error for last in failed)
    assert after.finish_reason == "length" and len(tokens) == GREEDY.max_tokens
    assert "Engine core 1 stopped" in server.output()


def test_a_disconnected_client_has_its_requests_aborted_on_every_engine(start_server):
    server = start_server("-dp", "2", "--router-policy", "round-robin", *LONG_RUN_FLAGS)
    asyncio.run(server.wait_ready())
    stats = asyncio.run(vanish_mid_requests(server.address, prompts(2, seed=4)))  # one on each engine
    assert stats.num_running_reqs == 0 and stats.kv_cache_usage == 0.0, stats
    assert server.output().count("A client disconnected; aborting its 2 request(s)") == 1, server.output()


def test_sigterm_stops_the_router_and_every_engine(start_server):
    server = start_server("-dp", "2", *SMALL)
    asyncio.run(server.wait_ready())
    group = processes_in_group(server.proc.pid)
    assert len(engine_pids(server)) == 2 and len(group) >= 5  # router, two engine cores, their workers
    server.proc.send_signal(signal.SIGTERM)
    assert wait_exit(server.proc, 120) == 0
    assert wait_until(lambda: not processes_in_group(server.proc.pid)), "processes left behind"
    assert not os.path.exists(server.address.removeprefix("ipc://"))


def test_data_parallel_refuses_multi_host_tensor_parallelism(start_server):
    server = start_server("-dp", "2", "--nnodes", "2", "-tp", "2")
    assert wait_exit(server.proc, 60) == 2
    assert "multi-host tensor parallelism" in server.output()


def test_the_http_api_and_metrics_sit_in_front_of_the_router(start_server):
    from tests.e2e.openai_server import start_api_server
    from tests.e2e.serve_support import free_port

    metrics_port = free_port()
    api = start_api_server(start_server, "-dp", "2", "--router-policy", "round-robin", "--metrics-port",
                           str(metrics_port), *SMALL)
    for i in range(2):  # one request per engine, in turn
        status, body = api.request("POST", "/v1/completions", {"model": "tiny", "prompt": [5 + i, 6, 7], "max_tokens": 4,
                                                              "temperature": 0, "ignore_eos": True})
        assert status == 200, body
        assert isinstance(body, dict) and body["usage"]["completion_tokens"] == 4
    status, models = api.request("GET", "/v1/models")
    assert status == 200 and isinstance(models, dict) and models["data"][0]["max_model_len"] == 512

    def prompt_tokens(text: str) -> dict[str, float]:
        prefix = "kvengine:prompt_tokens_total{"
        return {line.split('engine="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
                for line in text.splitlines() if line.startswith(prefix)}

    for port in (metrics_port, api.port):  # the router's endpoint, and the API's /metrics that fetches it
        assert wait_until(lambda p=port: prompt_tokens(
            urllib.request.urlopen(f"http://127.0.0.1:{p}/metrics", timeout=30).read().decode()) == {"0": 3, "1": 3})


def test_metrics_port_alone_shows_each_engine(start_server):
    from tests.e2e.serve_support import free_port

    port = free_port()
    server = start_server("-dp", "2", "--router-policy", "round-robin", "--metrics-port", str(port), *SMALL)
    asyncio.run(server.wait_ready())
    raw_generate(server.address, [[5, 6, 7], [8, 9, 10, 11]], GREEDY)  # one per engine

    def engines_seen() -> set[str]:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
        return {line.split('engine="')[1].split('"')[0] for line in text.splitlines()
                if line.startswith("kvengine:generation_tokens_total{") and not line.endswith(" 0.0")}

    assert wait_until(lambda: engines_seen() == {"0", "1"})


def test_a_taken_metrics_port_fails_start_up_before_any_engine_starts(start_server):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        server = start_server("-dp", "2", "--metrics-port", str(taken.getsockname()[1]), *SMALL)
        assert wait_exit(server.proc, 120) == 1
    assert "Start-up failed: cannot open the metrics endpoint" in server.output()
    assert "Started 2 engine cores" not in server.output() and "Traceback" not in server.output()
