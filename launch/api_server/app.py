"""The FastAPI application: its routes, and every error (404, 405 and 500 included) in OpenAI's shape."""

import asyncio
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.exceptions import HTTPException

from launch.api_server.chat_prompt import ChatPrompt, chat_prompt
from launch.api_server.completions import (
    admit,
    chat_completions,
    completions,
    encode_texts,
    json_response,
    read,
    served_of,
)
from launch.api_server.errors import ApiError
from launch.api_server.guard import Guard
from launch.api_server.metrics_proxy import CONTENT_TYPE, fetch_metrics
from launch.api_server.prompts import check_token_ids
from launch.api_server.responses import responses
from launch.api_server.schemas import DetokenizeRequest, TokenizeRequest
from launch.api_server.serving import now
from launch.api_server.state import Served
from launch.client import EngineDeadError


def create_app(served: Served, lifespan=None) -> FastAPI:
    app = FastAPI(title="kvengine", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.served = served
    app.add_middleware(Guard, served=served)
    app.add_exception_handler(ApiError, lambda request, e: e.response())  # type: ignore[arg-type, return-value]
    app.add_exception_handler(HTTPException, http_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, internal_error)  # the traceback goes to the log, never to the client
    app.add_api_route("/v1/completions", completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
    app.add_api_route("/v1/responses", responses, methods=["POST"])
    app.add_api_route("/v1/models", models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", model, methods=["GET"])
    app.add_api_route("/tokenize", tokenize, methods=["POST"])
    app.add_api_route("/detokenize", detokenize, methods=["POST"])
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/ping", health, methods=["GET", "POST"])  # vLLM's (SageMaker's) name for /health
    app.add_api_route("/metrics", metrics, methods=["GET"])
    app.add_api_route("/version", version, methods=["GET"])
    app.add_api_route("/reset_prefix_cache", reset_prefix_cache, methods=["POST"])
    return app


async def http_error(request: Request, e: HTTPException) -> Response:
    """Starlette's own errors (404 no such route, 405 wrong method) in OpenAI's shape."""
    return ApiError(e.status_code, str(e.detail), headers=e.headers).response()


async def internal_error(request: Request, e: Exception) -> Response:
    return ApiError(500, "internal server error").response()


def model_card(served: Served) -> dict:
    return {"id": served.model_name, "object": "model", "created": now(), "owned_by": "kvengine",
            "max_model_len": served.max_model_len}


async def models(request: Request) -> Response:
    return json_response({"object": "list", "data": [model_card(served_of(request))]})


async def model(request: Request, model_id: str) -> Response:
    """One model's card (OpenAI's retrieve); 404 for a model this server does not serve."""
    served = served_of(request)
    served.check_model(model_id)
    return json_response(model_card(served))


async def tokenize(request: Request) -> Response:
    served = served_of(request)
    req = await read(request, TokenizeRequest)
    served.check_model(req.model)
    if (req.messages is None) == (req.prompt is None):
        raise ApiError(400, "give a prompt or messages", "prompt")
    admit(request, 1)
    if req.messages is not None:
        tokens = await chat_prompt(served, req.messages, None, ChatPrompt(req.add_generation_prompt))
    else:
        [tokens] = await encode_texts(served, [req.prompt or ""], req.add_special_tokens)
    return json_response({"count": len(tokens), "max_model_len": served.max_model_len, "tokens": tokens})


async def detokenize(request: Request) -> Response:
    served = served_of(request)
    req = await read(request, DetokenizeRequest)
    served.check_model(req.model)
    check_token_ids(req.tokens, "tokens")
    if len(req.tokens) > served.max_model_len:
        raise ApiError(400, f"at most max_model_len ({served.max_model_len}) tokens", "tokens")
    admit(request, 1)
    return json_response({"prompt": await served.run_text(served.text.decode, req.tokens)})


async def health(request: Request) -> Response:
    try:
        await served_of(request).engine_answers()
    except (EngineDeadError, asyncio.TimeoutError):
        raise ApiError(503, "the engine does not answer") from None
    return Response(status_code=200)


async def metrics(request: Request) -> Response:
    return Response(await fetch_metrics(served_of(request).metrics_url), media_type=CONTENT_TYPE)


async def version(request: Request) -> Response:
    try:
        return json_response({"version": package_version("kvengine")})
    except PackageNotFoundError:
        return json_response({"version": "unknown"})


async def reset_prefix_cache(request: Request) -> Response:
    served = served_of(request)
    try:
        async with served.reset_lock:  # one at a time: each is a message the engine answers
            done = await served.engine.reset_prefix_cache()
    except EngineDeadError as e:
        raise ApiError(503, f"the engine is not available: {e}") from None
    if not done:
        raise ApiError(409, "the engine refused: running requests hold cached blocks")
    return Response(status_code=200)
