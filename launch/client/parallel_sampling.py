"""n > 1 and best_of, as vLLM v1 runs them (parallel sampling): the client fans one parent request out into
child requests of n = 1, and the engine core shares the prompt's KV blocks between them through its prefix cache.

Child i is the engine request `f"{i}_{parent id}"`, with seed + i when the parent is seeded (its own seed stream).
Child 0 goes first; the others are sent once its first output is back, so its prompt is computed and every full
block of it is in the prefix cache (also after a chunked prefill): the prompt is computed once, and each other
child computes only what a block does not cover (at least its last prompt token). With best_of > n, best_of
children are sampled and, once all have finished, the n with the highest cumulative log-probability (the sum of
their tokens' log-probabilities under the raw logits) come back, whole, as indices 0 .. n-1. Prompt
log-probabilities are asked of child 0 only (the others may then read the cache) and given to every child.
"""

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import msgspec

from protocol import SamplingParams, TokenLogprobs
from protocol.sampling import INT64_MAX

if TYPE_CHECKING:
    from launch.client import RequestOutput

GenerateOne = Callable[[SamplingParams, str], AsyncIterator["RequestOutput"]]


def child_request_id(parent_id: str, index: int) -> str:
    """The engine request of the parent's sequence `index`."""
    return f"{index}_{parent_id}"


@dataclass
class _Child:
    """A best_of child's whole output, kept until every child has finished."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    last: "RequestOutput | None" = None

    @property
    def cumulative_logprob(self) -> float:
        return sum(lp.logprob for lp in self.logprobs)


class ParentRequest:
    def __init__(self, request_id: str, params: SamplingParams) -> None:
        self.request_id, self.params = request_id, params
        self.num_children = params.num_sequences
        self.ranked = self.num_children > params.n  # best_of: held back and ranked
        self.prompt_logprobs: list[TokenLogprobs] | None = None  # child 0's, for the others
        self.children = [_Child() for _ in range(self.num_children)] if self.ranked else []
        self.seen: set[int] = set()  # children whose first output has come

    def child_id(self, index: int) -> str:
        return child_request_id(self.request_id, index)

    def child_params(self, index: int) -> SamplingParams:
        p = self.params
        changes: dict = {"n": 1, "best_of": None}
        if p.seed is not None:
            changes["seed"] = p.seed + index if p.seed + index <= INT64_MAX else p.seed + index - 2**64
        if index:
            changes["prompt_logprobs"] = None
        if self.ranked and p.logprobs is None:
            changes["logprobs"] = 0  # the sampled tokens' log-probabilities rank the children
        return msgspec.structs.replace(p, **changes)

    def process(self, index: int, out: "RequestOutput") -> list["RequestOutput"]:
        """What the caller yields for one child output: the output under the parent's id and the child's
        index (best_of: nothing until every child has finished, then the n best)."""
        if index == 0 and out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if index not in self.seen:
            self.seen.add(index)
            out = replace(out, prompt_logprobs=self.prompt_logprobs)
        out = replace(out, request_id=self.request_id, index=index)
        if not self.ranked:
            return [out]
        child = self.children[index]
        child.token_ids += out.new_token_ids
        child.logprobs += out.logprobs or []
        child.last = out
        return self._ranked() if all(c.last is not None and c.last.finished for c in self.children) else []

    def _ranked(self) -> list["RequestOutput"]:
        order = sorted(range(self.num_children), key=lambda i: -self.children[i].cumulative_logprob)
        outs = []
        for rank, i in enumerate(order[: self.params.n]):
            child = self.children[i]
            assert child.last is not None
            logprobs = child.logprobs if self.params.logprobs is not None else None
            outs.append(replace(child.last, new_token_ids=child.token_ids, logprobs=logprobs, index=rank,
                                prompt_logprobs=self.prompt_logprobs))
        return outs


async def fan_out(parent: ParentRequest, generate_one: GenerateOne) -> AsyncIterator["RequestOutput"]:
    """The merged outputs of the parent's children; closing it aborts every child still running."""
    queue: asyncio.Queue[tuple[int, RequestOutput | Exception | None]] = asyncio.Queue()

    async def run(index: int) -> None:
        try:
            async for out in generate_one(parent.child_params(index), parent.child_id(index)):
                queue.put_nowait((index, out))
        except Exception as e:  # noqa: BLE001 -- EngineDeadError or a refusal: raised to the caller below
            queue.put_nowait((index, e))
        else:
            queue.put_nowait((index, None))

    tasks = [asyncio.create_task(run(0))]
    running = 1  # children whose stream has not ended
    try:
        while running:
            index, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            if item is None:
                running -= 1
                continue
            if index == 0 and len(tasks) == 1:
                if item.finish_reason in ("error", "abort"):  # refused or aborted: the parent is, once
                    yield replace(item, request_id=parent.request_id)
                    return
                tasks += [asyncio.create_task(run(i)) for i in range(1, parent.num_children)]
                running += parent.num_children - 1
            for out in parent.process(index, item):
                yield out
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
