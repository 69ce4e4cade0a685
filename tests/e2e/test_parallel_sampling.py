"""n > 1 and best_of through a real server: the client fans out, the prompt is computed once (the other children
hit every full block of it), each child has its own seed stream, best_of returns the most likely sequences."""

import asyncio

import pytest

from launch.client import AsyncEngineClient
from protocol import SamplingParams
from tests.e2e.serve_support import FP32, SMALL, prompts

BLOCK = 16


async def run_parent(client: AsyncEngineClient, prompt: list[int], params: SamplingParams) -> dict[int, list]:
    """index -> that sequence's outputs."""
    outs: dict[int, list] = {}
    async for out in client.generate(prompt, params):
        outs.setdefault(out.index, []).append(out)
    return outs


def tokens(outs: list) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def cumulative(outs: list) -> float:
    return sum(lp.logprob for o in outs for lp in o.logprobs or [])


@pytest.fixture
def server(start_server):
    """A long prompt takes several steps, at most 32 tokens each while others wait: children sent together would
    be admitted beside the first one's prefill and compute the blocks it has not reached yet."""
    s = start_server(*FP32, *SMALL, "--max-num-batched-tokens", "64", "--long-prefill-token-threshold", "32")
    asyncio.run(s.wait_ready())
    return s


def test_n_samples_share_one_prompt_computation(server):
    """A 200-token prompt in a chunked prefill: the other 3 children hit its 12 full blocks."""
    prompt = prompts(1, seed=3, lo=200, hi=201)[0]
    params = SamplingParams(n=4, max_tokens=24, temperature=1.0, ignore_eos=True)

    async def go():
        async with AsyncEngineClient(server.address) as client:
            before = await client.get_stats()
            outs = await run_parent(client, prompt, params)
            return before, outs, await client.get_stats()

    before, outs, after = asyncio.run(go())
    assert sorted(outs) == [0, 1, 2, 3]
    assert all(o[-1].finish_reason == "length" and len(tokens(o)) == 24 for o in outs.values())
    assert len({tuple(tokens(o)) for o in outs.values()}) == 4
    assert all(o.request_id == outs[0][0].request_id for seq in outs.values() for o in seq)
    assert after.prefix_cache_hits - before.prefix_cache_hits == 3 * (200 // BLOCK) * BLOCK
    assert after.prefix_cache_queries - before.prefix_cache_queries == 4 * 200
    assert [o[-1].num_cached_tokens for _, o in sorted(outs.items())] == [0] + [192] * 3


def test_each_child_has_its_own_seed_stream(server):
    """Child i samples as a request of its own with seed + i would."""
    prompt = prompts(1, seed=4, lo=40, hi=41)[0]

    async def go():
        async with AsyncEngineClient(server.address) as client:
            parent = await run_parent(client, prompt, SamplingParams(n=3, seed=77, max_tokens=16, ignore_eos=True))
            alone = [await run_parent(client, prompt, SamplingParams(seed=77 + i, max_tokens=16, ignore_eos=True))
                     for i in range(3)]
            return parent, alone

    parent, alone = asyncio.run(go())
    assert [tokens(parent[i]) for i in range(3)] == [tokens(a[0]) for a in alone]
    assert len({tuple(tokens(parent[i])) for i in range(3)}) == 3


@pytest.mark.parametrize("n,best_of,logprobs", [(1, 4, None), (2, 3, 1)])
def test_best_of_returns_the_sequences_of_highest_cumulative_logprob(server, n, best_of, logprobs):
    prompt = prompts(1, seed=5, lo=30, hi=31)[0]
    common = {"temperature": 1.0, "max_tokens": 10, "ignore_eos": True}

    async def go():
        async with AsyncEngineClient(server.address) as client:
            got = await run_parent(client, prompt, SamplingParams(n=n, best_of=best_of, seed=9, logprobs=logprobs,
                                                                  **common))
            each = [await run_parent(client, prompt, SamplingParams(seed=9 + i, logprobs=0, **common))
                    for i in range(best_of)]
            return got, each

    got, each = asyncio.run(go())
    assert sorted(got) == list(range(n)) and all(len(seq) == 1 for seq in got.values())  # whole, at the end
    ranked = sorted(each, key=lambda outs: -cumulative(outs[0]))
    assert [tokens(got[i]) for i in range(n)] == [tokens(r[0]) for r in ranked[:n]]
    for i in range(n):
        if logprobs is None:
            assert got[i][0].logprobs is None
        else:
            assert len(got[i][0].logprobs) == 10 and all(len(lp.top_token_ids) == 1 for lp in got[i][0].logprobs)
    assert cumulative(ranked[0][0]) >= max(cumulative(e[0]) for e in each)


def test_prompt_logprobs_are_computed_once_and_given_to_every_sequence(server):
    prompt = prompts(1, seed=6, lo=50, hi=51)[0]

    async def go():
        async with AsyncEngineClient(server.address) as client:
            return await run_parent(client, prompt, SamplingParams(n=2, max_tokens=4, prompt_logprobs=1))

    outs = asyncio.run(go())
    first = [seq[0] for _, seq in sorted(outs.items())]
    assert first[0].prompt_logprobs is not None and len(first[0].prompt_logprobs) == 49
    assert first[1].prompt_logprobs == first[0].prompt_logprobs
    assert [seq[-1].num_cached_tokens for _, seq in sorted(outs.items())] == [0, 48]


def test_leaving_the_stream_aborts_every_child(server):
    prompt = prompts(1, seed=7, lo=20, hi=21)[0]

    async def go():
        async with AsyncEngineClient(server.address) as client:
            stream = client.generate(prompt, SamplingParams(n=3, max_tokens=400, ignore_eos=True))
            seen = set()
            async for out in stream:
                seen.add(out.index)
                if len(seen) == 3:
                    break
            await stream.aclose()
            for _ in range(2):  # the aborts are sent by tasks: by the second stats request, before it
                stats = await client.get_stats()
            return stats

    stats = asyncio.run(go())
    assert stats.num_running_reqs == 0 and stats.num_waiting_reqs == 0 and stats.num_blocks_held == 0
