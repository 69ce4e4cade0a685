"""Errors in OpenAI's JSON shape: {"error": {"message", "type", "param", "code"}} with the HTTP status."""

import re
from collections.abc import Mapping

import msgspec
from fastapi.responses import Response

TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError", 404: "NotFoundError",
         405: "MethodNotAllowedError", 408: "RequestTimeoutError", 409: "ConflictError", 413: "RequestTooLargeError",
         429: "RateLimitError", 499: "ClientClosedRequest", 503: "ServiceUnavailableError"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers

    def response(self) -> Response:
        return Response(self.encode(), self.status, self.headers, media_type="application/json")

    def encode(self) -> bytes:
        return msgspec.json.encode(self.body())

    def body(self) -> dict:
        kind = TYPES.get(self.status, "InternalServerError")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.status}}


def closing(status: int, message: str, param: str | None = None) -> ApiError:
    """An error answered before the body was read: the connection closes after it."""
    return ApiError(status, message, param, {"Connection": "close"})


def bad_body(error: msgspec.DecodeError) -> ApiError:
    """A body msgspec refused; the parameter named when msgspec names it (`$.temperature`, unknown field `x`)."""
    match = re.search(r"`\$\.([A-Za-z_]+)", str(error)) or re.search(r"unknown field `([^`]{1,64})`", str(error))
    return ApiError(400, f"invalid request: {error}", match[1] if match else None)


def bad_param(error: ValueError, names: dict[str, str] | None = None) -> ApiError:
    """A SamplingParams refusal: its message starts with the parameter's name, shown as the request's field (names:
    SamplingParams name -> the request's, where they differ)."""
    name, _, rest = str(error).partition(" ")
    field = (names or {}).get(name, name)
    return ApiError(400, f"{field} {rest}", field)
