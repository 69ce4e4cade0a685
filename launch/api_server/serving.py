"""/v1/completions and /v1/chat/completions: a request's checks, its engine requests, and the answer as JSON or SSE."""

import time
import uuid
from collections.abc import AsyncIterator, Callable
from functools import partial

import msgspec

from launch.api_server.auth import User
from launch.api_server.detokenizer import IncrementalDetokenizer
from launch.api_server.errors import ApiError
from launch.api_server.generation import Choice, Generation, Piece
from launch.api_server.parameters import check_parameters
from launch.api_server.request_params import echo_only, engine_params
from launch.api_server.schemas import MAX_CACHE_SALT_CHARS, ChatCompletionRequest, CompletionRequest, StreamOptions
from launch.api_server.state import Served
from launch.api_server.structured import request_structured_outputs
from protocol.messages import MAX_PRIORITY, MIN_PRIORITY

Request = CompletionRequest | ChatCompletionRequest
MAX_STOP_STRINGS, MAX_STOP_CHARS = 16, 256  # the detokenizer searches each one after every token
MAX_REQUEST_ID_CHARS = 128  # a client's request_id, inside the engine requests' ids (at most 256 characters)


def check_request(req: Request, served: Served) -> None:
    """Refuse what this server does not honour, naming the parameter (parameters.py), and what contradicts itself."""
    check_parameters(req)
    if req.stream_options is not None and not req.stream:
        raise ApiError(400, "stream_options needs stream=true", "stream_options")
    if req.cache_salt is not None and not 0 < len(req.cache_salt) <= MAX_CACHE_SALT_CHARS:
        raise ApiError(400, f"cache_salt is a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters",
                       "cache_salt")
    if req.request_id is not None and not 0 < len(req.request_id) <= MAX_REQUEST_ID_CHARS:
        raise ApiError(400, f"request_id is a non-empty string of at most {MAX_REQUEST_ID_CHARS} characters",
                       "request_id")
    priority = req.priority or 0
    if not MIN_PRIORITY <= priority <= MAX_PRIORITY:
        raise ApiError(400, f"priority must be in [{MIN_PRIORITY}, {MAX_PRIORITY}], got {priority}", "priority")
    if priority and not served.priority_scheduling:
        raise ApiError(400, "priority needs a server started with --scheduling-policy priority (this one runs "
                            "requests first come, first served)", "priority")
    if isinstance(req, CompletionRequest) and req.suffix:
        raise ApiError(400, "suffix is not supported: this model has no fill-in-the-middle template", "suffix")
    if isinstance(req, ChatCompletionRequest) and req.continue_final_message and req.add_generation_prompt:
        raise ApiError(400, "continue_final_message and add_generation_prompt cannot both be true",
                       "continue_final_message")


def stop_strings(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in stops):
        raise ApiError(400, f"stop takes at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} characters",
                       "stop")
    return stops


def truncated(req: Request, prompt: list[int], max_model_len: int) -> list[int]:
    """vLLM's truncate_prompt_tokens=k: the prompt's last k tokens (first k with truncation_side right; -1 is
    max_model_len)."""
    k = req.truncate_prompt_tokens
    if k is None:
        return prompt
    if k == -1:
        k = max_model_len
    if k < 1:
        raise ApiError(400, f"truncate_prompt_tokens is -1 or at least 1, got {k}", "truncate_prompt_tokens")
    return prompt[:k] if req.truncation_side == "right" else prompt[-k:]


def start(served: Served, user: User, req: Request, prompts: list[list[int]], max_tokens: int | None,
          prefix: str) -> tuple[str, Generation]:
    """Check every prompt's parameters, then start its engine request: (response id, the generation)."""
    structured = request_structured_outputs(req)
    params = [engine_params(req, p, max_tokens, served.max_model_len, served.text.encode, structured)
              for p in prompts]
    stop = stop_strings(req.stop)
    decode = served.text.decode if req.skip_special_tokens is not False else partial(served.text.decode,
                                                                                    skip_special_tokens=False)
    include_stop = bool(req.include_stop_str_in_output)
    eos = served.text.eos_token_id
    choices = [Choice(p, sp, [IncrementalDetokenizer(decode, p, stop, include_stop, sp.min_tokens)
                              for _ in range(sp.n)], drop_output=echo_only(req, max_tokens),
                      stop_ids=frozenset() if include_stop else frozenset([*sp.stop_token_ids,
                                                                           *([] if eos is None else [eos])]))
               for p, sp in zip(prompts, params, strict=True)]
    response_id = f"{prefix}-{req.request_id or uuid.uuid4().hex}"
    generation = Generation(served.engine, served.slots, user.name, response_id, choices,
                            user.cache_salt(req.cache_salt), req.priority or 0)
    return response_id, generation


def usage(prompts: list[list[int]], finals: list[Piece], n: int) -> dict:
    """Prompt tokens once per prompt, completion tokens of every choice; cached tokens of each prompt's first
    sequence (the others read the prompt it computed)."""
    prompt_tokens = sum(len(p) for p in prompts)
    completion_tokens = sum(p.completion_tokens for p in finals)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(p.cached_tokens for p in finals if p.index % n == 0)}}


async def collect(generation: Generation, count: int) -> tuple[list[Piece], list[Piece]]:
    """The whole text and token ids of each choice (as one piece), and its final piece."""
    wholes = [Piece(i, "", []) for i in range(count)]
    finals = [Piece(i, "", []) for i in range(count)]
    async for piece in generation.pieces():
        whole = wholes[piece.index]
        whole.text += piece.text
        whole.token_ids += piece.token_ids
        whole.logprobs += piece.logprobs
        if piece.prompt_logprobs is not None:
            whole.prompt_logprobs = piece.prompt_logprobs
        if piece.finish_reason is not None:
            finals[piece.index] = piece
    if any(f.finish_reason in ("error", "abort", None) for f in finals):
        raise ApiError(503, "the engine stopped before the request finished")
    return wholes, finals


def sse(data: object) -> bytes:
    return b"data: " + msgspec.json.encode(data) + b"\n\n"


async def sse_stream(generation: Generation, prompts: list[list[int]], n: int, options: StreamOptions | None,
                     chunk: Callable[[Piece], dict], usage_chunk: Callable[[dict], dict],
                     first: list[dict]) -> AsyncIterator[bytes]:
    """The SSE body: the first chunks (chat: the roles), one chunk per piece, usage if asked (with
    continuous_usage_stats, each chunk also carries its choice's usage so far), then [DONE]."""
    include_usage = bool(options and options.include_usage)
    continuous = include_usage and bool(options and options.continuous_usage_stats)
    for data in first:
        if continuous:
            data["usage"] = {"prompt_tokens": len(prompts[0]), "completion_tokens": 0, "total_tokens": len(prompts[0])}
        yield sse(data)
    finals: list[Piece] = []
    generated: dict[int, int] = {}
    async for piece in generation.pieces():
        generated[piece.index] = generated.get(piece.index, 0) + len(piece.token_ids)
        if piece.finish_reason is not None:
            finals.append(piece)
        if piece.text or piece.finish_reason is not None or piece.prompt_logprobs is not None:
            data = chunk(piece)
            if continuous:
                prompt_tokens = len(prompts[piece.index // n])
                data["usage"] = {"prompt_tokens": prompt_tokens, "completion_tokens": generated[piece.index],
                                 "total_tokens": prompt_tokens + generated[piece.index]}
            yield sse(data)
    if include_usage:
        yield sse(usage_chunk(usage(prompts, finals, n)))
    yield b"data: [DONE]\n\n"


def now() -> int:
    return int(time.time())
