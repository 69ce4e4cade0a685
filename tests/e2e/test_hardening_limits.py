"""Admission limits: requests past --max-client-requests or --max-pending-requests get "server overloaded"."""

import asyncio

from launch.client import AsyncEngineClient
from protocol import SamplingParams
from tests.e2e.serve_support import SMALL, collect, prompts

LONG = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)
SHORT = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
LIVENESS = 120.0  # seconds: a bound for the whole scenario, not a timing


async def outcome(client: AsyncEngineClient, prompt: list[int], params: SamplingParams) -> tuple[int, str | None]:
    """(tokens received, error or None)."""
    tokens, last = await collect(client, prompt, params)
    return len(tokens), last.error


def test_requests_over_the_per_client_and_overall_limits_are_refused(start_server):
    server = start_server(*SMALL, "--max-client-requests", "3", "--max-pending-requests", "5")
    asyncio.run(server.wait_ready())
    batch = prompts(8, seed=3)

    async def scenario():
        async with AsyncEngineClient(server.address) as first, AsyncEngineClient(server.address) as second:
            # The first client's four are read together; three are admitted and run long after the fourth's refusal.
            first_results = [asyncio.create_task(outcome(first, p, LONG)) for p in batch[:4]]
            await asyncio.wait(first_results, return_when=asyncio.FIRST_COMPLETED)  # the refusal
            # Three in flight: the second client gets two more before the overall limit.
            second_results = await asyncio.gather(*(outcome(second, p, LONG) for p in batch[4:7]))
            # Once they have finished, the second client is admitted again.
            after = await outcome(second, batch[7], SHORT)
            return await asyncio.gather(*first_results), second_results, after

    first_results, second_results, after = asyncio.run(asyncio.wait_for(scenario(), LIVENESS))
    assert sorted(first_results) == [(0, per_client_error(3))] + [(LONG.max_tokens, None)] * 3
    assert sorted(second_results) == [(0, overall_error(5))] + [(LONG.max_tokens, None)] * 2
    assert after == (SHORT.max_tokens, None)


def per_client_error(limit: int) -> str:
    return (f"server overloaded: this client has {limit} requests in flight, the limit per client "
            f"(--max-client-requests {limit})")


def overall_error(limit: int) -> str:
    return f"server overloaded: {limit} requests in flight, the server's limit (--max-pending-requests {limit})"
