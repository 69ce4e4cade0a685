"""The disk tier through real `kvengine serve` processes (float32, the built-in model): prompts sharing a long
prefix are served, the server is stopped with SIGTERM and started again on the same folder, and the first request
after the restart reports the prefix as cached with the first run's tokens; under -dp 2 a prefix one engine core
computed is a hit for the other."""

import asyncio
import signal

from launch.client import AsyncEngineClient
from protocol import SamplingParams
from protocol.kv_store.index import BlockIndex
from tests.e2e.conftest import wait_exit, wait_until
from tests.e2e.serve_support import FP32, collect

BLOCK = 16
PREFIX = [(i * 53) % 1000 + 2 for i in range(20 * BLOCK)]  # 20 blocks
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
FLAGS = (*FP32, "--max-model-len", "512", "--kv-cache-memory-bytes", "8MiB")


def serve_in_turn(address: str, batch: list[list[int]]) -> list[tuple[list[int], int]]:
    """(tokens, cached prompt tokens) of each prompt, sent one after the other."""

    async def run():
        async with AsyncEngineClient(address) as client:
            out = []
            for prompt in batch:
                tokens, last = await collect(client, prompt, GREEDY)
                out.append((tokens, last.num_cached_tokens))
            return out

    return asyncio.run(run())


def test_a_restart_serves_the_prefix_from_disk_with_the_first_runs_tokens(start_server, tmp_path):
    disk = tmp_path / "tier"
    batch = [PREFIX + [7, 8, 9], PREFIX + [11, 12], PREFIX[: 10 * BLOCK] + [5]]
    first = start_server(*FLAGS, "--kv-disk-path", str(disk), subdir="first")
    asyncio.run(first.wait_ready())
    before = serve_in_turn(first.address, batch)
    assert before[0][1] == 0 and before[1][1] == 20 * BLOCK  # the second hits memory
    first.proc.send_signal(signal.SIGTERM)
    assert wait_exit(first.proc, 60) == 0, first.output()
    second = start_server(*FLAGS, "--kv-disk-path", str(disk), subdir="second")
    asyncio.run(second.wait_ready())
    after = serve_in_turn(second.address, batch)
    assert after[0] == (before[0][0], 20 * BLOCK), second.output()  # the first request after the restart
    assert [tokens for tokens, _ in after] == [tokens for tokens, _ in before]
    assert "KV disk tier" in second.output() and ": 20 blocks" in second.output()


def test_dp2_engines_share_the_tier(start_server, tmp_path):
    """Round-robin sends the second request to the other engine core: its prefix is on disk, not in its memory."""
    disk = tmp_path / "tier"
    server = start_server("-dp", "2", "--router-policy", "round-robin", *FLAGS, "--kv-disk-path", str(disk))
    asyncio.run(server.wait_ready())
    (tokens0, cached0), = serve_in_turn(server.address, [PREFIX + [7]])
    assert cached0 == 0
    (index_path,) = disk.glob("*/index.sqlite")
    index = BlockIndex(str(index_path))
    try:  # the first engine's worker writes its blocks in the background: wait until all 20 are findable
        assert wait_until(lambda: len(index) >= 20), server.output()
    finally:
        index.close()
    (tokens1, cached1), = serve_in_turn(server.address, [PREFIX + [7]])
    assert cached1 == 20 * BLOCK and tokens1 == tokens0, server.output()
