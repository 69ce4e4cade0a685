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
from launch.api_server.chat_prompt import ChatPrompt, chat_prompt
from launch.api_server.choices import ChatChoices, CompletionChoices
from launch.api_server.errors import ApiError
from launch.api_server.guard import cleanup, user_of
from launch.api_server.prompts import check_length, completion_prompts
from launch.api_server.schemas import ChatCompletionRequest, CompletionRequest
from launch.api_server.serving import check_request, collect, now, sse_stream, start, truncated, usage
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


async def completions(request: Request) -> Response:
    served = served_of(request)
    req = await read(request, CompletionRequest)
    served.check_model(req.model)
    check_request(req, served)
    given = completion_prompts(req.prompt, served.config.max_request_prompts)
    n = req.best_of or req.n or 1
    admit(request, len(given) * n)
    encoded = await encode_texts(served, given, req.add_special_tokens is not False) if isinstance(given[0], str) \
        else given  # type: ignore[assignment]
    prompts = [truncated(req, p, served.max_model_len) for p in encoded]
    response_id, generation = start(served, user_of(request), req, prompts, req.max_tokens, "cmpl")
    cleanup(request, generation.close)
    await until_disconnected(request, generation.wait_accepted())
    base = {"id": response_id, "object": "text_completion", "created": now(), "model": served.model_name}
    n = req.n or 1
    echoed = [g if isinstance(g, str) and p == e else served.text.decode(p)  # the text as given, unless truncated
              for g, e, p in zip(given, encoded, prompts, strict=True)] if req.echo else []
    choices = CompletionChoices(served.text, req, prompts, n, echoed)
    if req.stream:
        return event_stream(sse_stream(
            generation, prompts, n, req.stream_options,
            lambda p: {**base, "choices": [choices.choice(p, p.finish_reason)]},
            lambda u: {**base, "choices": [], "usage": u}, []))
    wholes, finals = await until_disconnected(request, collect(generation, len(prompts) * n))
    answer = [choices.choice(w, f.finish_reason) for w, f in zip(wholes, finals, strict=True)]
    return json_response({**base, "choices": answer, "usage": usage(prompts, finals, n)})


async def chat_completions(request: Request) -> Response:
    served = served_of(request)
    req = await read(request, ChatCompletionRequest)
    served.check_model(req.model)
    check_request(req, served)
    tools = chat_tools(served, req)
    admit(request, req.best_of or req.n or 1)
    options = ChatPrompt(add_generation_prompt=not req.continue_final_message if req.add_generation_prompt is None
                         else req.add_generation_prompt, continue_final_message=bool(req.continue_final_message),
                         template=req.chat_template, documents=req.documents,
                         add_special_tokens=bool(req.add_special_tokens))
    prompt = truncated(req, await chat_prompt(served, template_messages(req.messages),
                                              tools.template_kwargs(req.chat_template_kwargs), options),
                       served.max_model_len)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    response_id, generation = start(served, user_of(request), req, [prompt], max_tokens, "chatcmpl")
    cleanup(request, generation.close)
    await until_disconnected(request, generation.wait_accepted())
    base = {"id": response_id, "object": "chat.completion.chunk", "created": now(), "model": served.model_name}
    n = req.n or 1
    last = req.messages[-1] if req.messages else {}
    echo_text = last.get("content") or "" if req.echo and last.get("role") == "assistant" else ""
    choices = ChatChoices(served.text, req, [prompt], n, echo_text if isinstance(echo_text, str) else "", tools)
    if req.stream:
        return event_stream(sse_stream(
            generation, [prompt], n, req.stream_options, lambda p: {**base, "choices": [choices.delta(p)]},
            lambda u: {**base, "choices": [], "usage": u}, [{**base, "choices": [choices.opening(i)]}
                                                             for i in range(n)]))
    wholes, finals = await until_disconnected(request, collect(generation, n))
    answer = [choices.message(w, f.finish_reason) for w, f in zip(wholes, finals, strict=True)]
    body = {**base, "object": "chat.completion", "choices": answer, "usage": usage([prompt], finals, n)}
    if req.prompt_logprobs is not None:  # vLLM puts a chat's on the answer, as well as on each choice here
        body["prompt_logprobs"] = answer[0].get("prompt_logprobs")
    return json_response(body)
