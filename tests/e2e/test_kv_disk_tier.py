"""The disk tier through real `kvengine serve` processes (float32, the built-in model): prompts sharing a long
prefix are served, the server is stopped with SIGTERM and started again on the same folder, and the first request
after the restart reports the prefix as cached with the first run's tokens; under -dp 2 a prefix one engine core
computed is a hit for the other; over HTTP, `usage` counts the prompt tokens the tier served as cached and /metrics
counts them as the tier's hits."""

import asyncio
import signal
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from launch.client import AsyncEngineClient
from protocol import SamplingParams
from protocol.kv_store.index import BlockIndex
from tests.e2e.conftest import wait_exit, wait_until
from tests.e2e.openai_server import start_api_server
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


def tier_hits(port: int) -> float | None:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    return next((s.value for family in text_string_to_metric_families(text) for s in family.samples
                 if s.name == "kvengine:kv_tier_hits_total" and s.labels == {"medium": "DISK"}), None)


def complete_and_stop(start_server, disk: str, body: dict, hits: int) -> dict:
    """One completion on a fresh server over the tier; once /metrics shows `hits` tier hits, SIGTERM."""
    api = start_api_server(start_server, *FLAGS, "--kv-disk-path", disk)
    status, answer = api.request("POST", "/v1/completions", body)
    assert status == 200, answer
    assert wait_until(lambda: tier_hits(api.port) == hits), api.server.output()
    api.server.proc.send_signal(signal.SIGTERM)
    assert wait_exit(api.server.proc, 60) == 0, api.server.output()
    return answer


def test_http_usage_and_metrics_count_the_tiers_hits_after_a_restart(start_server, tmp_path):
    disk = str(tmp_path / "tier")
    body = {"model": "tiny", "prompt": PREFIX + [7], "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    first = complete_and_stop(start_server, disk, body, 0)
    second = complete_and_stop(start_server, disk, body, 20 * BLOCK)  # the prefix comes from disk
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 20 * BLOCK
    assert second["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]


def rank_keys(disk) -> dict[str, list[bytes]]:
    """Each tensor-parallel rank's blocks, in the order they were saved."""
    out = {}
    for index_path in sorted(disk.glob("*/rank*/index.sqlite")):
        index = BlockIndex(str(index_path))
        try:
            out[index_path.parent.name] = [k for (k,) in index.db.execute("SELECT key FROM blocks ORDER BY ctime")]
        finally:
            index.close()
    return out


def test_tp2_ranks_keep_their_shards_and_load_the_fewest_blocks_any_rank_has(start_server, tmp_path):
    """-tp 2: each rank saves its KV heads' shard in its own folder; after a restart the prefix loads on both.
    A shard one rank lost stops the load there for both (the rest is computed), with the same tokens."""
    disk = tmp_path / "tier"
    flags = ("-tp", "2", *FLAGS, "--kv-disk-path", str(disk))
    batch = [PREFIX + [7, 8, 9], PREFIX[: 10 * BLOCK] + [5]]
    first = start_server(*flags, subdir="first")
    asyncio.run(first.wait_ready())
    before = serve_in_turn(first.address, batch)
    first.proc.send_signal(signal.SIGTERM)
    assert wait_exit(first.proc, 60) == 0, first.output()
    keys = rank_keys(disk)
    assert sorted(keys) == ["rank0", "rank1"] and keys["rank0"] == keys["rank1"] and len(keys["rank0"]) == 20
    second = start_server(*flags, subdir="second")
    asyncio.run(second.wait_ready())
    after = serve_in_turn(second.address, batch)
    assert after == [(before[0][0], 20 * BLOCK), (before[1][0], 10 * BLOCK)], second.output()
    second.proc.send_signal(signal.SIGTERM)
    assert wait_exit(second.proc, 60) == 0, second.output()
    name = keys["rank1"][3].hex()  # rank 1's shard of block 3: corrupt
    path = next(disk.glob(f"*/rank1/blocks/{name[:2]}/{name}.kv"))
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))
    third = start_server(*flags, subdir="third")
    asyncio.run(third.wait_ready())
    (tokens, cached), = serve_in_turn(third.address, batch[:1])
    assert (tokens, cached) == (before[0][0], 3 * BLOCK), third.output()
    assert "fails its checksum" in third.output()
