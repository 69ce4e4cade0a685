"""reset_prefix_cache from outside: refused while blocks are in use, then AllBlocksCleared on the wire."""

import asyncio
import subprocess
import sys

import zmq

from launch.client import AsyncEngineClient
from launch.client.kv_event_subscriber import KVEventSubscriber
from protocol import AllBlocksCleared
from tests.e2e.serve_support import LONG_RUN, LONG_RUN_FLAGS, prompts


def reset_cli(address: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launch.cli", "reset-prefix-cache", address],
                          capture_output=True, text=True, timeout=120, check=False)


def test_reset_is_refused_while_a_request_holds_blocks_and_clears_the_cache_when_idle(start_server, tmp_path):
    events = f"ipc://{tmp_path}/events"
    server = start_server(*LONG_RUN_FLAGS, "--kv-events-endpoint", events)
    asyncio.run(server.wait_ready())
    prompt = prompts(1, seed=3, lo=64, hi=65)[0]

    async def scenario() -> tuple[bool, bool, int, int]:
        async with AsyncEngineClient(server.address) as client:
            stream = client.generate(prompt, LONG_RUN)
            await stream.__anext__()  # the request is running and holds blocks
            refused = await client.reset_prefix_cache()
            await stream.aclose()  # abort it; its full blocks stay cached
            for _ in range(100):
                if (await client.get_stats()).num_running_reqs == 0:
                    break
                await asyncio.sleep(0.05)
            cached_before = (await client.get_stats()).num_cached_free_blocks
            done = await client.reset_prefix_cache()
            cached_after = (await client.get_stats()).num_cached_free_blocks
            return refused, done, cached_before, cached_after

    ctx = zmq.Context()
    subscriber = KVEventSubscriber(ctx, events, None)
    try:
        refused, done, cached_before, cached_after = asyncio.run(scenario())
        seen = []
        for _ in range(50):
            seen += [e for _, batch in subscriber.recv(timeout_ms=100) for e in batch.events]
            if any(isinstance(e, AllBlocksCleared) for e in seen):
                break
    finally:
        subscriber.close()
        ctx.term()
    assert refused is False
    assert done is True and cached_before > 0 and cached_after == 0
    assert any(isinstance(e, AllBlocksCleared) for e in seen)


def test_reset_prefix_cache_command(start_server):
    server = start_server("--max-model-len", "256", "--kv-cache-memory-bytes", "8MiB")
    asyncio.run(server.wait_ready())
    done = reset_cli(server.address)
    assert done.returncode == 0 and "prefix cache reset" in done.stdout
    assert "Prefix cache reset" in server.output()
