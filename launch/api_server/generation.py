"""The engine requests of one HTTP request, one per prompt, turned into text pieces.

Each choice runs in a task of its own: it waits for an engine slot (fairness.EngineSlots), sends its prompt,
and detokenises the outputs as they come, whether or not the HTTP side reads them yet, so that a finished
choice frees its slot for the next prompt. The response starts once every choice has been accepted by the
engine; a refusal before that answers the whole request with the refusal.
"""

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from launch.api_server.detokenizer import IncrementalDetokenizer
from launch.api_server.errors import ApiError
from launch.api_server.fairness import EngineSlots
from launch.client import AsyncEngineClient, EngineDeadError, RequestOutput
from protocol import SamplingParams, TokenLogprobs

logger = logging.getLogger(__name__)


@dataclass
class Piece:
    """New text of one choice; the last piece has finish_reason and the request's token counts."""

    index: int
    text: str
    token_ids: list[int]  # the tokens that arrived since the previous piece
    finish_reason: str | None = None
    completion_tokens: int = 0
    cached_tokens: int = 0
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # of token_ids, when the request asked


@dataclass
class Choice:
    prompt: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer


class Generation:
    def __init__(self, engine: AsyncEngineClient, slots: EngineSlots, user: str, response_id: str,
                 choices: list[Choice], cache_salt: str | None) -> None:
        self.engine, self.slots, self.user, self.cache_salt = engine, slots, user, cache_salt
        self.queue: asyncio.Queue[Piece | None] = asyncio.Queue()
        self.accepted = 0
        self.error: ApiError | None = None
        self.settled = asyncio.Event()  # every choice accepted, or one refused
        self.tasks = [asyncio.create_task(self._run(i, c, f"{response_id}-{i}")) for i, c in enumerate(choices)]

    async def wait_accepted(self) -> None:
        """Return once the engine has accepted every choice; raise the first refusal."""
        await self.settled.wait()
        if self.error is not None:
            raise self.error

    async def pieces(self) -> AsyncIterator[Piece]:
        """Pieces of all choices as they come, until every choice has ended."""
        remaining = len(self.tasks)
        while remaining:
            piece = await self.queue.get()
            if piece is None:
                remaining -= 1
            else:
                yield piece

    async def close(self) -> None:
        """End every choice (its engine request aborted if unfinished)."""
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    def _refused(self, error: ApiError) -> None:
        if self.error is None:
            self.error = error
        self.settled.set()

    async def _run(self, index: int, choice: Choice, request_id: str) -> None:
        try:
            await self.slots.acquire(self.user)
            try:
                await self._generate(index, choice, request_id)
            finally:
                self.slots.release(self.user)
        except Exception:
            logger.exception("Choice %d of %s failed", index, request_id)
            self._refused(ApiError(500, "internal error"))
        finally:
            self.queue.put_nowait(None)

    async def _generate(self, index: int, choice: Choice, request_id: str) -> None:
        outputs = self.engine.generate(choice.prompt, choice.params, request_id=request_id,
                                       cache_salt=self.cache_salt)
        try:
            try:
                first = await anext(outputs)
            except EngineDeadError as e:
                return self._refused(ApiError(503, f"the engine is not available: {e}"))
            if first.finish_reason == "error":
                error = first.error or "the engine refused the request"
                return self._refused(ApiError(400 if error.startswith("the prompt") else 503, error))
            self.accepted += 1
            if self.accepted == len(self.tasks):
                self.settled.set()
            chained = _chain(first, outputs)
            try:
                async for piece in pieces(index, chained, choice.detokenizer):
                    self.queue.put_nowait(piece)
            finally:
                await chained.aclose()  # type: ignore[attr-defined]
        finally:
            await outputs.aclose()  # type: ignore[attr-defined]


async def _chain(first: RequestOutput, rest: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    yield first
    async for out in rest:
        yield out


async def pieces(index: int, outputs: AsyncIterator[RequestOutput], detok: IncrementalDetokenizer,
                 ) -> AsyncIterator[Piece]:
    """Text pieces until the engine finishes or a stop string appears (the caller closes outputs: an abort)."""
    count, ids, logprobs = 0, [], []
    try:
        async for out in outputs:
            count += len(out.new_token_ids)
            ids += out.new_token_ids
            logprobs += out.logprobs or []
            text = detok.add(out.new_token_ids, final=out.finished)
            if detok.stopped or out.finished:
                reason = "stop" if detok.stopped else out.finish_reason
                yield Piece(index, text, ids, reason, count, out.num_cached_tokens, logprobs)
                return
            if text:
                yield Piece(index, text, ids, logprobs=logprobs)
                ids, logprobs = [], []
    except EngineDeadError:  # the status line has left: the choice ends with finish_reason "error"
        yield Piece(index, detok.add([], final=True), ids, "error", count, logprobs=logprobs)
