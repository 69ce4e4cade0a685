"""The engine requests of one HTTP request, one per prompt, turned into text pieces.

Each prompt runs in a task of its own: it waits for engine slots (fairness.EngineSlots; one per sequence, n of
them with n > 1), sends its prompt, and detokenises the outputs as they come, whether or not the HTTP side reads
them yet, so that a finished prompt frees its slots for the next one. Prompt p's sequence i is the response's
choice p * n + i. The response starts once every prompt has been accepted by the engine; a refusal before that
answers the whole request with the refusal.
"""

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from launch.api_server.detokenizer import IncrementalDetokenizer
from launch.api_server.errors import ApiError
from launch.api_server.fairness import EngineSlots
from launch.client import AsyncEngineClient, EngineDeadError, RequestOutput
from launch.client.parallel_sampling import child_request_id
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
    prompt_logprobs: list[TokenLogprobs] | None = None  # on the choice's first piece, when the request asked


@dataclass
class Choice:
    """One prompt: its n sequences' detokenizers, and whether its one generated token is dropped (echo only)."""

    prompt: list[int]
    params: SamplingParams
    detokenizers: list[IncrementalDetokenizer]
    drop_output: bool = False
    # a sequence that ends on one of these (EOS, stop_token_ids) leaves its text out, as vLLM does, unless
    # include_stop_str_in_output (then this is empty)
    stop_ids: frozenset[int] = frozenset()


@dataclass
class _Sequence:
    """What one sequence has gathered since its last piece."""

    detokenizer: IncrementalDetokenizer
    count: int = 0
    ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs] | None = None
    done: bool = False


class Generation:
    def __init__(self, engine: AsyncEngineClient, slots: EngineSlots, user: str, response_id: str,
                 choices: list[Choice], cache_salt: str | None, priority: int = 0) -> None:
        self.engine, self.slots, self.user, self.cache_salt, self.priority = engine, slots, user, cache_salt, priority
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
        held = 0
        try:
            for _ in range(choice.params.num_sequences):
                await self.slots.acquire(self.user, self.priority)
                held += 1
            await self._generate(index, choice, request_id)
        except Exception:
            logger.exception("Choice %d of %s failed", index, request_id)
            self._refused(ApiError(500, "internal error"))
        finally:
            for _ in range(held):
                self.slots.release(self.user)
            self.queue.put_nowait(None)

    async def _generate(self, index: int, choice: Choice, request_id: str) -> None:
        outputs = self.engine.generate(choice.prompt, choice.params, request_id=request_id,
                                       cache_salt=self.cache_salt, priority=self.priority)
        try:
            try:
                first = await anext(outputs)
            except EngineDeadError as e:
                return self._refused(ApiError(503, f"the engine is not available: {e}"))
            if first.finish_reason == "error":
                return self._refused(refusal(first.error or "the engine refused the request"))
            self.accepted += 1
            if self.accepted == len(self.tasks):
                self.settled.set()
            chained = _chain(first, outputs)
            try:
                first_index = index * len(choice.detokenizers)
                async for piece in pieces(first_index, chained, choice, self._stop_sequence(request_id)):
                    self.queue.put_nowait(piece)
            finally:
                await chained.aclose()  # type: ignore[attr-defined]
        finally:
            await outputs.aclose()  # type: ignore[attr-defined]

    def _stop_sequence(self, request_id: str) -> Callable[[int], Awaitable[None]]:
        """Abort sequence i of the prompt's n in the engine (a stop string ended it; the others go on)."""
        async def stop(i: int) -> None:
            await self.engine.abort(child_request_id(request_id, i))
        return stop


def refusal(error: str) -> ApiError:
    """The engine's refusal of a request: 503 when it is overloaded, else 400 naming the parameter its reason
    starts with (`logit_bias has token ids outside the vocabulary ...`)."""
    if error.startswith("server overloaded"):
        return ApiError(503, error)
    word = error.split(" ", 1)[0].split("=", 1)[0].rstrip(":")
    return ApiError(400, error, word if word.isidentifier() and word not in ("the", "request") else None)


async def _chain(first: RequestOutput, rest: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    yield first
    async for out in rest:
        yield out


async def pieces(first_index: int, outputs: AsyncIterator[RequestOutput], choice: Choice,
                 stop_sequence: Callable[[int], Awaitable[None]]) -> AsyncIterator[Piece]:
    """Text pieces of the prompt's sequences until each has finished or met a stop string (that sequence is
    aborted; with one sequence the caller's closing of outputs aborts it)."""
    sequences = [_Sequence(d) for d in choice.detokenizers]
    try:
        async for out in outputs:
            seq = sequences[out.index]
            if seq.done:
                continue
            piece = _piece(first_index + out.index, seq, out, choice)
            if piece is not None:
                yield piece
            if seq.done and not out.finished and len(sequences) > 1:
                await stop_sequence(out.index)
            if all(s.done for s in sequences):
                return
    except EngineDeadError:  # the status line has left: the unfinished choices end with finish_reason "error"
        for i, seq in enumerate(sequences):
            if not seq.done:
                yield Piece(first_index + i, seq.detokenizer.add([], final=True), seq.ids, "error", seq.count,
                            logprobs=seq.logprobs, prompt_logprobs=seq.prompt_logprobs)


def _piece(index: int, seq: _Sequence, out: RequestOutput, choice: Choice) -> Piece | None:
    """The piece one output makes of its sequence, if it makes one yet (text held back makes none)."""
    if out.prompt_logprobs is not None:
        seq.prompt_logprobs = out.prompt_logprobs
    new = [] if choice.drop_output else out.new_token_ids
    stop_token = out.finish_reason == "stop" and bool(new) and new[-1] in choice.stop_ids
    text, taken = seq.detokenizer.add_each(new[:-1] if stop_token else new, final=out.finished)
    if seq.detokenizer.stopped:
        new = new[:taken]  # a stop string ends the output at its last token, however many came in this output
    seq.count += len(new)
    seq.ids += new
    seq.logprobs += [] if choice.drop_output else (out.logprobs or [])[: len(new)]
    seq.done = seq.detokenizer.stopped or out.finished
    if not seq.done and not text:
        return None
    reason = "stop" if seq.detokenizer.stopped else out.finish_reason
    piece = Piece(index, text, seq.ids, reason, seq.count if seq.done else 0,
                  out.num_cached_tokens if seq.done else 0, seq.logprobs, seq.prompt_logprobs)
    seq.ids, seq.logprobs, seq.prompt_logprobs = [], [], None
    return piece
