"""/v1/completions and /v1/chat/completions: requests to the engine, pieces of text back, as JSON or SSE."""

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import msgspec

from launch.api_server.detokenizer import IncrementalDetokenizer
from launch.api_server.errors import ApiError, bad_param
from launch.api_server.generation import Piece, pieces, start
from launch.api_server.prompts import max_tokens_for
from launch.api_server.schemas import ChatCompletionRequest, CompletionRequest
from launch.api_server.text_model import TextModel
from launch.client import AsyncEngineClient
from protocol import SamplingParams

Request = CompletionRequest | ChatCompletionRequest


@dataclass
class Served:
    """What every handler needs: the engine connection, the text side and the model's name and length limit."""

    engine: AsyncEngineClient
    text: TextModel
    model_name: str
    max_model_len: int
    metrics_url: str

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(404, f"The model `{model}` does not exist; this server serves `{self.model_name}`", "model")


def sampling_params(req: Request, prompt: list[int], max_tokens: int | None, max_model_len: int) -> SamplingParams:
    if req.n != 1:
        raise ApiError(400, "n must be 1 (one choice per prompt)", "n")
    try:
        return SamplingParams(
            max_tokens=max_tokens_for(prompt, max_tokens, max_model_len), temperature=req.temperature,
            top_k=0 if req.top_k == -1 else req.top_k, top_p=req.top_p, seed=req.seed,
            stop_token_ids=req.stop_token_ids or [], ignore_eos=req.ignore_eos, logprobs=requested_logprobs(req),
        )
    except ValueError as e:
        raise bad_param(e) from None


def requested_logprobs(req: Request) -> int | None:
    """Alternatives per token, or None for no log-probabilities: completions take logprobs=k (0..20); chat takes
    logprobs=true with top_logprobs=k."""
    if isinstance(req, ChatCompletionRequest):
        if req.top_logprobs is not None and not req.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs=true", "top_logprobs")
        return (req.top_logprobs or 0) if req.logprobs else None
    if req.top_logprobs is not None:
        raise ApiError(400, "top_logprobs is a chat parameter; completions take logprobs=k", "top_logprobs")
    if isinstance(req.logprobs, bool):
        raise ApiError(400, "logprobs of a completion is the number of alternatives per token (0 to 20)", "logprobs")
    return req.logprobs


def stop_strings(stop: str | list[str] | None) -> list[str]:
    return [stop] if isinstance(stop, str) else list(stop or [])


async def generate(served: Served, req: Request, prompts: list[list[int]], max_tokens: int | None,
                   prefix: str) -> tuple[str, list[AsyncIterator[Piece]]]:
    """Send every prompt to the engine; (response id, one piece stream per choice) once all are accepted."""
    response_id = f"{prefix}-{uuid.uuid4().hex}"
    params = [sampling_params(req, p, max_tokens, served.max_model_len) for p in prompts]
    results = await asyncio.gather(*(start(served.engine, prompt, p, f"{response_id}-{i}")
                                     for i, (prompt, p) in enumerate(zip(prompts, params, strict=True))),
                                   return_exceptions=True)
    started = [r for r in results if not isinstance(r, BaseException)]
    if len(started) < len(results):  # one was refused: abort the others, answer with the refusal
        for outputs in started:
            await outputs.aclose()  # type: ignore[attr-defined]
        raise next(r for r in results if isinstance(r, BaseException))
    stop = stop_strings(req.stop)
    streams = [pieces(i, outputs, IncrementalDetokenizer(served.text.decode, prompt, stop))
               for i, (prompt, outputs) in enumerate(zip(prompts, started, strict=True))]
    return response_id, streams


async def merge(streams: list[AsyncIterator[Piece]]) -> AsyncIterator[Piece]:
    """Pieces of all choices as they come; closing this closes (and aborts) every choice."""
    if len(streams) == 1:
        async for piece in streams[0]:
            yield piece
        return
    queue: asyncio.Queue[Piece | None] = asyncio.Queue()

    async def pump(stream: AsyncIterator[Piece]) -> None:
        try:
            async for piece in stream:
                queue.put_nowait(piece)
        finally:
            queue.put_nowait(None)

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def usage(prompts: list[list[int]], finals: list[Piece]) -> dict:
    prompt_tokens = sum(len(p) for p in prompts)
    completion_tokens = sum(p.completion_tokens for p in finals)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(p.cached_tokens for p in finals)}}


async def collect(streams: list[AsyncIterator[Piece]]) -> tuple[list[Piece], list[Piece]]:
    """The whole text and token ids of each choice (as one piece), and its final piece."""
    wholes = [Piece(i, "", []) for i in range(len(streams))]
    finals = [Piece(i, "", []) for i in range(len(streams))]
    async for piece in merge(streams):
        wholes[piece.index].text += piece.text
        wholes[piece.index].token_ids += piece.token_ids
        wholes[piece.index].logprobs += piece.logprobs
        if piece.finish_reason is not None:
            finals[piece.index] = piece
    if any(f.finish_reason in ("error", "abort") for f in finals):
        raise ApiError(503, "the engine stopped before the request finished")
    return wholes, finals


def sse(data: object) -> bytes:
    return b"data: " + msgspec.json.encode(data) + b"\n\n"


async def sse_stream(streams: list[AsyncIterator[Piece]], prompts: list[list[int]], include_usage: bool,
                     chunk: Callable[[Piece], dict], usage_chunk: Callable[[dict], dict],
                     first: list[dict]) -> AsyncIterator[bytes]:
    """The SSE body: the first chunks (chat: the role), one chunk per piece, usage if asked, then [DONE]."""
    for data in first:
        yield sse(data)
    finals: list[Piece] = []
    async for piece in merge(streams):
        if piece.finish_reason is not None:
            finals.append(piece)
        if piece.text or piece.finish_reason is not None:
            yield sse(chunk(piece))
    if include_usage:
        yield sse(usage_chunk(usage(prompts, finals)))
    yield b"data: [DONE]\n\n"


def now() -> int:
    return int(time.time())
