"""The generation routes, /v1/completions and /v1/chat/completions, and the text work they share with /tokenize.

Each request is bounded before it costs anything: its body (size, time), its shape and parameters, the user's
admission (prompts in flight), the length of every text in characters; only then is it tokenised and
templated, on a text thread, and its prompts sent to the engine.
"""

import asyncio
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

import msgspec
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from launch.api_server.body import decode, read_body
from launch.api_server.errors import ApiError
from launch.api_server.generation import Piece
from launch.api_server.guard import cleanup, user_of
from launch.api_server.logprobs import chat_logprobs, completion_logprobs
from launch.api_server.prompts import chat_messages, check_length, completion_prompts, template_variables
from launch.api_server.schemas import ChatCompletionRequest, CompletionRequest
from launch.api_server.serving import check_request, collect, now, sse_stream, start, usage
from launch.api_server.state import Served
from launch.api_server.text_model import TextModel
from launch.api_server.tools.chat import chat_tools
from launch.api_server.tools.messages import template_messages

T = TypeVar("T")


def served_of(request: Request) -> Served:
    return request.app.state.served


async def read(request: Request, kind: type[T]) -> T:
    config = served_of(request).config
    return decode(await read_body(request, config.max_request_body_bytes, config.http_body_timeout), kind)


def admit(request: Request, prompts: int) -> None:
    """Count the prompts against the user's limit until the response has ended."""
    admission, user = served_of(request).admission, user_of(request).name
    admission.admit(user, prompts)

    async def release() -> None:
        admission.release(user, prompts)

    cleanup(request, release)


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """work's result; if the client disconnects first, work is cancelled (its engine requests aborted)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait([task, watch], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait([task])
    if task.cancelled():
        raise ApiError(499, "the client closed the connection")  # no one reads it; the request ends quietly
    return task.result()


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def json_response(data: object, status: int = 200) -> Response:
    return Response(msgspec.json.encode(data), status, media_type="application/json")


def event_stream(body: AsyncIterator[bytes]) -> StreamingResponse:
    return StreamingResponse(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _encode_texts(text: TextModel, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
    return [text.encode(t, add_special_tokens) for t in texts]


async def encode_texts(served: Served, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
    for t in texts:
        check_length(t, served.max_prompt_chars, served.max_model_len, "prompt")
    return await served.run_text(_encode_texts, served.text, texts, add_special_tokens)


def _chat_prompt(served: Served, messages: list[dict], add_generation_prompt: bool, variables: dict) -> list[int]:
    try:
        text = served.text.render_chat(messages, add_generation_prompt, **variables)
    except ValueError as e:
        raise ApiError(400, str(e), "messages") from None
    check_length(text, served.max_prompt_chars, served.max_model_len, "messages")
    return served.text.encode(text, add_special_tokens=False)


async def chat_prompt(served: Served, messages: list[dict], add_generation_prompt: bool,
                      kwargs: dict | None) -> list[int]:
    """The conversation rendered by the model's chat template, as token ids (the template adds special tokens)."""
    checked, variables = chat_messages(messages), template_variables(kwargs)
    return await served.run_text(_chat_prompt, served, checked, add_generation_prompt, variables)


async def completions(request: Request) -> Response:
    served = served_of(request)
    req = await read(request, CompletionRequest)
    served.check_model(req.model)
    check_request(req)
    given = completion_prompts(req.prompt, served.config.max_request_prompts)
    admit(request, len(given))
    prompts = await encode_texts(served, given) if isinstance(given[0], str) else given  # type: ignore[arg-type]
    response_id, generation = start(served, user_of(request), req, prompts, req.max_tokens, "cmpl")
    cleanup(request, generation.close)
    await until_disconnected(request, generation.wait_accepted())
    base = {"id": response_id, "object": "text_completion", "created": now(), "model": served.model_name}
    text_offsets = [0] * len(prompts)  # per choice: characters sent so far, for logprobs' text_offset

    def choice(piece: Piece, finish_reason: str | None) -> dict:
        logprobs = None
        if req.logprobs is not None:
            logprobs = completion_logprobs(served.text.decode, piece.token_ids, piece.logprobs,
                                           text_offsets[piece.index])
        text_offsets[piece.index] += len(piece.text)
        out = {"index": piece.index, "text": piece.text, "logprobs": logprobs, "finish_reason": finish_reason}
        return {**out, "token_ids": piece.token_ids} if req.return_token_ids else out

    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return event_stream(sse_stream(
            generation, prompts, include_usage, lambda p: {**base, "choices": [choice(p, p.finish_reason)]},
            lambda u: {**base, "choices": [], "usage": u}, []))
    wholes, finals = await until_disconnected(request, collect(generation, len(prompts)))
    choices = [choice(w, f.finish_reason) for w, f in zip(wholes, finals, strict=True)]
    return json_response({**base, "choices": choices, "usage": usage(prompts, finals)})


async def chat_completions(request: Request) -> Response:
    served = served_of(request)
    req = await read(request, ChatCompletionRequest)
    served.check_model(req.model)
    check_request(req)
    tools = chat_tools(served, req)
    admit(request, 1)
    prompt = await chat_prompt(served, template_messages(req.messages), req.add_generation_prompt,
                               tools.template_kwargs(req.chat_template_kwargs))
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    response_id, generation = start(served, user_of(request), req, [prompt], max_tokens, "chatcmpl")
    cleanup(request, generation.close)
    await until_disconnected(request, generation.wait_accepted())
    base = {"id": response_id, "object": "chat.completion.chunk", "created": now(), "model": served.model_name}

    def logprobs(piece: Piece) -> dict | None:
        return chat_logprobs(served.text.decode, piece.token_ids, piece.logprobs) if req.logprobs else None

    def chunk(delta: dict, finish_reason: str | None = None, piece: Piece | None = None) -> dict:
        return {**base, "choices": [{"index": 0, "delta": delta, "logprobs": piece and logprobs(piece),
                                     "finish_reason": finish_reason}]}

    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return event_stream(sse_stream(
            generation, [prompt], include_usage,
            lambda p: chunk(*tools.delta(p.text, p.finish_reason), p),
            lambda u: {**base, "choices": [], "usage": u}, [chunk({"role": "assistant", "content": ""})]))
    wholes, finals = await until_disconnected(request, collect(generation, 1))
    message, finish_reason = tools.message(wholes[0].text, finals[0].finish_reason or "stop")
    choice = {"index": 0, "message": message, "logprobs": logprobs(wholes[0]), "finish_reason": finish_reason}
    if req.return_token_ids:
        choice["token_ids"] = wholes[0].token_ids
    return json_response({**base, "object": "chat.completion", "choices": [choice], "usage": usage([prompt], finals)})
