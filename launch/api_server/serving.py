"""/v1/completions and /v1/chat/completions: a request's checks, its engine requests, and the answer as JSON or SSE."""

import time
import uuid
from collections.abc import AsyncIterator, Callable

import msgspec

from launch.api_server.auth import User
from launch.api_server.detokenizer import IncrementalDetokenizer
from launch.api_server.errors import ApiError, bad_param
from launch.api_server.generation import Choice, Generation, Piece
from launch.api_server.prompts import max_tokens_for
from launch.api_server.schemas import MAX_CACHE_SALT_CHARS, ChatCompletionRequest, CompletionRequest, unsupported
from launch.api_server.state import Served
from launch.api_server.structured import request_structured_outputs
from protocol import SamplingParams, StructuredOutputsParams

Request = CompletionRequest | ChatCompletionRequest
MAX_STOP_STRINGS, MAX_STOP_CHARS = 16, 256  # the detokenizer searches each one after every token


def check_request(req: Request) -> None:
    """Refuse what the engine would not honour, naming the parameter."""
    name = unsupported(req)
    if name is not None:
        raise ApiError(400, f"{name} is not supported yet: the engine would not honour it", name)
    if req.n != 1:
        raise ApiError(400, "n must be 1 (one choice per prompt)", "n")
    if req.stream_options is not None and not req.stream:
        raise ApiError(400, "stream_options needs stream=true", "stream_options")
    if req.cache_salt is not None and not 0 < len(req.cache_salt) <= MAX_CACHE_SALT_CHARS:
        raise ApiError(400, f"cache_salt is a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters",
                       "cache_salt")


def sampling_params(req: Request, prompt: list[int], max_tokens: int | None, max_model_len: int,
                    structured: StructuredOutputsParams | None = None) -> SamplingParams:
    try:
        return SamplingParams(
            max_tokens=max_tokens_for(prompt, max_tokens, max_model_len), temperature=req.temperature,
            top_k=0 if req.top_k == -1 else req.top_k, top_p=req.top_p, seed=req.seed,
            stop_token_ids=req.stop_token_ids or [], ignore_eos=req.ignore_eos, logprobs=requested_logprobs(req),
            structured_outputs=structured,
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
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in stops):
        raise ApiError(400, f"stop takes at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} characters",
                       "stop")
    return stops


def start(served: Served, user: User, req: Request, prompts: list[list[int]], max_tokens: int | None,
          prefix: str) -> tuple[str, Generation]:
    """Check every prompt's parameters, then start its engine request: (response id, the generation)."""
    structured = request_structured_outputs(req)
    params = [sampling_params(req, p, max_tokens, served.max_model_len, structured) for p in prompts]
    stop = stop_strings(req.stop)
    choices = [Choice(p, sp, IncrementalDetokenizer(served.text.decode, p, stop))
               for p, sp in zip(prompts, params, strict=True)]
    response_id = f"{prefix}-{uuid.uuid4().hex}"
    generation = Generation(served.engine, served.slots, user.name, response_id, choices,
                            user.cache_salt(req.cache_salt))
    return response_id, generation


def usage(prompts: list[list[int]], finals: list[Piece]) -> dict:
    prompt_tokens = sum(len(p) for p in prompts)
    completion_tokens = sum(p.completion_tokens for p in finals)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(p.cached_tokens for p in finals)}}


async def collect(generation: Generation, count: int) -> tuple[list[Piece], list[Piece]]:
    """The whole text and token ids of each choice (as one piece), and its final piece."""
    wholes = [Piece(i, "", []) for i in range(count)]
    finals = [Piece(i, "", []) for i in range(count)]
    async for piece in generation.pieces():
        wholes[piece.index].text += piece.text
        wholes[piece.index].token_ids += piece.token_ids
        wholes[piece.index].logprobs += piece.logprobs
        if piece.finish_reason is not None:
            finals[piece.index] = piece
    if any(f.finish_reason in ("error", "abort", None) for f in finals):
        raise ApiError(503, "the engine stopped before the request finished")
    return wholes, finals


def sse(data: object) -> bytes:
    return b"data: " + msgspec.json.encode(data) + b"\n\n"


async def sse_stream(generation: Generation, prompts: list[list[int]], include_usage: bool,
                     chunk: Callable[[Piece], dict], usage_chunk: Callable[[dict], dict],
                     first: list[dict]) -> AsyncIterator[bytes]:
    """The SSE body: the first chunks (chat: the role), one chunk per piece, usage if asked, then [DONE]."""
    for data in first:
        yield sse(data)
    finals: list[Piece] = []
    async for piece in generation.pieces():
        if piece.finish_reason is not None:
            finals.append(piece)
        if piece.text or piece.finish_reason is not None:
            yield sse(chunk(piece))
    if include_usage:
        yield sse(usage_chunk(usage(prompts, finals)))
    yield b"data: [DONE]\n\n"


def now() -> int:
    return int(time.time())
