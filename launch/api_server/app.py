"""The FastAPI application: routes, error shape, and aborting the work of a client that went away."""

import asyncio
from collections.abc import AsyncIterator, Awaitable
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version
from typing import TypeVar

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from launch.api_server.errors import ApiError, bad_body
from launch.api_server.logprobs import chat_logprobs, completion_logprobs
from launch.api_server.metrics_proxy import CONTENT_TYPE, fetch_metrics
from launch.api_server.prompts import chat_messages, completion_prompts
from launch.api_server.schemas import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from launch.api_server.serving import Piece, Served, collect, generate, now, sse_stream, usage
from launch.client import EngineDeadError

T = TypeVar("T")
HEALTH_TIMEOUT = 10.0  # seconds for the engine to answer a stats probe


def json_response(data: object, status: int = 200) -> Response:
    return Response(msgspec.json.encode(data), status, media_type="application/json")


async def decode(request: Request, kind: type[T]) -> T:
    try:
        return msgspec.json.decode(await request.body(), type=kind)
    except msgspec.DecodeError as e:
        raise bad_body(e) from None


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


def event_stream(body: AsyncIterator[bytes]) -> StreamingResponse:
    return StreamingResponse(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def create_app(served: Served, lifespan=None) -> FastAPI:
    app = FastAPI(title="kvengine", lifespan=lifespan)
    app.add_exception_handler(ApiError, lambda request, e: e.response())  # type: ignore[arg-type, return-value]

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = await decode(request, CompletionRequest)
        served.check_model(req.model)
        prompts = completion_prompts(req.prompt, served.text)
        response_id, streams = await generate(served, req, prompts, req.max_tokens, "cmpl")
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
                streams, prompts, include_usage,
                lambda p: {**base, "choices": [choice(p, p.finish_reason)]},
                lambda u: {**base, "choices": [], "usage": u}, []))
        wholes, finals = await until_disconnected(request, collect(streams))
        choices = [choice(w, f.finish_reason) for w, f in zip(wholes, finals, strict=True)]
        return json_response({**base, "choices": choices, "usage": usage(prompts, finals)})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = await decode(request, ChatCompletionRequest)
        served.check_model(req.model)
        prompt = chat_prompt(served, req.messages, req.add_generation_prompt, req.chat_template_kwargs or {})
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        response_id, streams = await generate(served, req, [prompt], max_tokens, "chatcmpl")
        base = {"id": response_id, "object": "chat.completion.chunk", "created": now(), "model": served.model_name}

        def logprobs(piece: Piece) -> dict | None:
            return chat_logprobs(served.text.decode, piece.token_ids, piece.logprobs) if req.logprobs else None

        def chunk(delta: dict, finish_reason: str | None = None, piece: Piece | None = None) -> dict:
            return {**base, "choices": [{"index": 0, "delta": delta, "logprobs": piece and logprobs(piece),
                                         "finish_reason": finish_reason}]}

        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return event_stream(sse_stream(
                streams, [prompt], include_usage,
                lambda p: chunk({"content": p.text} if p.text else {}, p.finish_reason, p),
                lambda u: {**base, "choices": [], "usage": u}, [chunk({"role": "assistant", "content": ""})]))
        wholes, finals = await until_disconnected(request, collect(streams))
        message = {"role": "assistant", "content": wholes[0].text}
        choice = {"index": 0, "message": message, "logprobs": logprobs(wholes[0]),
                  "finish_reason": finals[0].finish_reason}
        if req.return_token_ids:
            choice["token_ids"] = wholes[0].token_ids
        return json_response({**base, "object": "chat.completion", "choices": [choice],
                              "usage": usage([prompt], finals)})

    @app.get("/v1/models")
    async def models() -> Response:
        card = {"id": served.model_name, "object": "model", "created": now(), "owned_by": "kvengine",
                "max_model_len": served.max_model_len}
        return json_response({"object": "list", "data": [card]})

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        req = await decode(request, TokenizeRequest)
        served.check_model(req.model)
        if req.messages is not None:
            tokens = chat_prompt(served, req.messages, req.add_generation_prompt, {})
        elif req.prompt is not None:
            tokens = served.text.encode(req.prompt, req.add_special_tokens)
        else:
            raise ApiError(400, "give a prompt or messages", "prompt")
        return json_response({"count": len(tokens), "max_model_len": served.max_model_len, "tokens": tokens})

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        req = await decode(request, DetokenizeRequest)
        served.check_model(req.model)
        return json_response({"prompt": served.text.decode(req.tokens)})

    @app.get("/health")
    async def health() -> Response:
        try:
            await asyncio.wait_for(served.engine.get_stats(), HEALTH_TIMEOUT)
        except (EngineDeadError, asyncio.TimeoutError):
            raise ApiError(503, "the engine does not answer") from None
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(await fetch_metrics(served.metrics_url), media_type=CONTENT_TYPE)

    @app.get("/version")
    async def version() -> Response:
        try:
            return json_response({"version": package_version("kvengine")})
        except PackageNotFoundError:
            return json_response({"version": "unknown"})

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        try:
            done = await served.engine.reset_prefix_cache()
        except EngineDeadError as e:
            raise ApiError(503, f"the engine is not available: {e}") from None
        if not done:
            raise ApiError(409, "the engine refused: running requests hold cached blocks")
        return Response(status_code=200)

    return app


def chat_prompt(served: Served, messages: list[dict], add_generation_prompt: bool, variables: dict) -> list[int]:
    """The conversation rendered by the model's chat template, as token ids (the template adds special tokens)."""
    try:
        text = served.text.render_chat(chat_messages(messages), add_generation_prompt, **variables)
    except ValueError as e:
        raise ApiError(400, str(e), "messages") from None
    return served.text.encode(text, add_special_tokens=False)

