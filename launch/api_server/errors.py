"""Errors in OpenAI's JSON shape: {"error": {"message", "type", "param", "code"}} with the HTTP status."""

import re

import msgspec
from fastapi.responses import Response

TYPES = {400: "BadRequestError", 404: "NotFoundError", 409: "ConflictError", 499: "ClientClosedRequest", 503: "ServiceUnavailableError"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def response(self) -> Response:
        return Response(msgspec.json.encode(self.body()), self.status, media_type="application/json")

    def body(self) -> dict:
        kind = TYPES.get(self.status, "InternalServerError")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.status}}


def bad_body(error: msgspec.DecodeError) -> ApiError:
    """A body msgspec refused; the parameter named when msgspec names it (`$.temperature`)."""
    match = re.search(r"`\$\.([A-Za-z_]+)", str(error))
    return ApiError(400, f"invalid request: {error}", match[1] if match else None)


def bad_param(error: ValueError) -> ApiError:
    """A SamplingParams refusal: its message starts with the parameter's name."""
    return ApiError(400, str(error), str(error).split(" ", 1)[0])
