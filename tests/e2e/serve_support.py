"""What the end-to-end tests share: server flags, prompts, and clients that collect streams (no tests here)."""

import asyncio
import random
import socket

from launch.client import AsyncEngineClient
from protocol import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
SMALL = ["--max-model-len", "512", "--kv-cache-memory-bytes", "8MiB", "--check-block-tables"]


def prompts(n: int, seed: int = 0, lo: int = 4, hi: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1024) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


async def collect(client: AsyncEngineClient, prompt: list[int], params: SamplingParams = GREEDY):
    tokens, last = [], None
    async for out in client.generate(prompt, params):
        tokens += out.new_token_ids
        last = out
    return tokens, last


async def generate_all(address: str, batch: list[list[int]], params: SamplingParams = GREEDY):
    async with AsyncEngineClient(address) as client:
        return await asyncio.gather(*(collect(client, p, params) for p in batch))


# In bfloat16 two ranks round their partial sums before the all-reduce, one rank does not: greedy tokens
# across tensor-parallel sizes are exactly equal in float32, which these tests use.
FP32 = ("--dtype", "float32")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


LONG = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
# Requests of 4,000 steps (some 6 s on 2 cores), for a server with LONG_RUN_FLAGS: still running when the client acts
# on them (disconnects, aborts, asks a prefix-cache reset), also on a loaded machine.
LONG_RUN_FLAGS = ["--max-model-len", "4096", "--kv-cache-memory-bytes", "32MiB"]
LONG_RUN = SamplingParams(max_tokens=4000, temperature=0.0, ignore_eos=True)


async def vanish_mid_requests(address: str, batch: list[list[int]]):
    """Start the requests, and once each has an output close the socket without an abort, as a crashed client
    would; then the server's stats once nothing runs (or after 200 asks)."""
    client = AsyncEngineClient(address)
    await client.start()
    streams = [client.generate(p, LONG_RUN) for p in batch]
    for s in streams:
        await s.__anext__()
    client._sock.close(linger=0)
    async with AsyncEngineClient(address) as watcher:
        for _ in range(200):
            stats = await watcher.get_stats()
            if stats.num_running_reqs == 0:
                break
            await asyncio.sleep(0.05)
    return stats


async def stream_after_first_outputs(address: str, n: int, act) -> list[list]:
    """Start n long requests, call act() once each has an output (all running), then read them to the end."""
    async with AsyncEngineClient(address) as client:
        streams = [client.generate(p, LONG) for p in prompts(n, seed=11)]
        outputs = [[await s.__anext__()] for s in streams]
        act()
        for outs, s in zip(outputs, streams, strict=True):
            outs += [out async for out in s]
        return outputs
