"""One prompt's engine request turned into text pieces: detokenised, cut at stop strings, errors mapped to HTTP."""

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from launch.api_server.detokenizer import IncrementalDetokenizer
from launch.api_server.errors import ApiError
from launch.client import AsyncEngineClient, EngineDeadError, RequestOutput
from protocol import SamplingParams, TokenLogprobs


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


async def start(engine: AsyncEngineClient, prompt: list[int], params: SamplingParams,
                request_id: str) -> AsyncIterator[RequestOutput]:
    """The request's outputs, once the engine has accepted it: a refusal raises ApiError before any byte is sent."""
    outputs = engine.generate(prompt, params, request_id=request_id)
    try:
        first = await anext(outputs)
    except EngineDeadError as e:
        raise ApiError(503, f"the engine is not available: {e}") from None
    if first.finish_reason == "error":
        await outputs.aclose()  # type: ignore[attr-defined]
        error = first.error or "the engine refused the request"
        raise ApiError(400 if error.startswith("the prompt") else 503, error)  # else: overloaded or stopping
    return _chain(first, outputs)


async def _chain(first: RequestOutput, rest: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    yield first
    async for out in rest:
        yield out


async def pieces(index: int, outputs: AsyncIterator[RequestOutput], detok: IncrementalDetokenizer,
                 ) -> AsyncIterator[Piece]:
    """Text pieces until the engine finishes or a stop string appears (leaving the loop aborts the request)."""
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
    finally:
        await outputs.aclose()  # type: ignore[attr-defined]
