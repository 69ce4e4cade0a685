"""AsyncEngineClient survives a cancelled call, and a failure of its reader fails every waiter instead of hanging."""

import asyncio
import time

import pytest
import zmq
import zmq.asyncio

from launch.client import AsyncEngineClient, EngineDeadError
from protocol import EngineCoreOutputs, SamplingParams, SchedulerStats
from protocol.codec import outputs_codec
from tests.e2e.serve_support import GREEDY, SMALL, collect

PROMPT = [5, 17, 300, 42, 9]
LIVENESS = 60.0  # seconds: a bound for an answer that should come at once, not a timing


def test_a_cancelled_get_stats_leaves_the_client_working(start_server):
    server = start_server(*SMALL)
    asyncio.run(server.wait_ready())

    async def scenario():
        async with AsyncEngineClient(server.address) as client:
            await client.get_stats()
            cancelled = asyncio.create_task(client.get_stats())
            await asyncio.sleep(0)  # it has sent its request and waits for the answer
            cancelled.cancel()
            with pytest.raises(asyncio.CancelledError):
                await cancelled
            stats = await asyncio.wait_for(client.get_stats(), LIVENESS)
            tokens, last = await asyncio.wait_for(collect(client, PROMPT), LIVENESS)
            return stats, tokens, last

    stats, tokens, last = asyncio.run(scenario())
    assert isinstance(stats, SchedulerStats)
    assert len(tokens) == GREEDY.max_tokens and last.finish_reason == "length"


class FailingCodec:
    def decode(self, message: bytes) -> EngineCoreOutputs:
        raise RuntimeError("decoder broke")


def test_a_reader_failure_fails_pending_streams_and_calls(tmp_path):
    """A fake server answers the readiness probe; then the client's decoder breaks under its reader."""
    address = f"ipc://{tmp_path}/fake.sock"

    async def scenario():
        ctx = zmq.asyncio.Context()
        fake = ctx.socket(zmq.ROUTER)
        fake.bind(address)
        try:
            async with AsyncEngineClient(address) as client:
                stream = asyncio.create_task(collect(client, PROMPT, SamplingParams(max_tokens=4)))
                identity, _probe = await fake.recv_multipart()
                await fake.send_multipart([identity, outputs_codec().encode(
                    EngineCoreOutputs([], time.time(), stats=SchedulerStats()))])
                await fake.recv_multipart()  # the request
                stats = asyncio.create_task(client.get_stats())
                await fake.recv_multipart()  # its stats request
                client._outputs_codec = FailingCodec()  # type: ignore[assignment]
                await fake.send_multipart([identity, b"anything"])
                results = await asyncio.wait_for(asyncio.gather(stream, stats, return_exceptions=True), LIVENESS)
                with pytest.raises(EngineDeadError, match="stopped reading"):
                    await client.get_stats()
                return results
        finally:
            fake.close(linger=0)
            ctx.term()

    results = asyncio.run(scenario())
    assert all(isinstance(r, EngineDeadError) and "decoder broke" in str(r) for r in results), results
