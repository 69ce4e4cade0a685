"""A client that stops reading loses nothing: past ZeroMQ's high-water mark its outputs wait in a backlog."""

import asyncio
import time

import zmq

from launch.client import AsyncEngineClient
from protocol import EngineCoreRequest, SamplingParams
from protocol.codec import client_codec, outputs_codec
from tests.e2e.conftest import wait_until
from tests.e2e.serve_support import collect

PROMPT = [5, 17, 300, 42, 9]
REQUESTS = 32
PARAMS = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
LIVENESS = 60.0  # seconds: a bound for what should happen soon, not a timing
FLAGS = ["--max-model-len", "512", "--kv-cache-memory-bytes", "64MiB"]


def engine_stats(address: str):
    async def ask():
        async with AsyncEngineClient(address) as client:
            return await client.get_stats()

    return asyncio.run(ask())


def test_a_client_that_reads_late_gets_every_token_and_every_finish(start_server):
    server = start_server(*FLAGS)
    asyncio.run(server.wait_ready())
    # Long ids make each step's message large, so the pipe fills after fewer steps than a request lasts.
    ids = [f"{i:03d}-" + "x" * 200 for i in range(REQUESTS)]
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVHWM, 1)
    try:
        sock.connect(server.address)
        for request_id in ids:
            sock.send(client_codec().encode(EngineCoreRequest(request_id, PROMPT, PARAMS, time.time())))
        # Not reading until every request has finished in the engine.
        assert wait_until(lambda: engine_stats(server.address).num_generation_tokens == REQUESTS * PARAMS.max_tokens,
                          LIVENESS * 5)
        tokens: dict[str, list[int]] = {request_id: [] for request_id in ids}
        finished: dict[str, str | None] = {}
        while len(finished) < REQUESTS:
            assert sock.poll(LIVENESS * 1000), f"outputs lost: {REQUESTS - len(finished)} request(s) never finished"
            for out in outputs_codec().decode(sock.recv()).outputs:
                assert out.request_id not in finished, "an output after the finish"
                tokens[out.request_id] += out.new_token_ids
                if out.finish_reason is not None:
                    finished[out.request_id] = out.finish_reason
    finally:
        sock.close(linger=0)
        ctx.term()

    async def reference():
        async with AsyncEngineClient(server.address) as client:
            return await collect(client, PROMPT, PARAMS)

    expected, _ = asyncio.run(reference())
    assert len(expected) == PARAMS.max_tokens
    assert set(finished.values()) == {"length"}
    assert all(t == expected for t in tokens.values())
    assert "reads slower than its outputs arrive" in server.output()  # the pipe did fill up
