"""OpenAI-style error bodies {"error": {message, type, param, code}} and the handlers that produce them."""
from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import ContextLengthError, InvalidRequestError
from .scheduler import QueueFullError, ShuttingDownError

log = logging.getLogger("kvboost.server")

# An engine argument → the OpenAI request field a client sent it as.
_OPENAI_PARAMS = {"max_new_tokens": "max_tokens", "input_ids": "prompt"}
ModelT = TypeVar("ModelT", bound=BaseModel)


class APIError(Exception):
    """An error with an HTTP status that the client should see as an OpenAI error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers or {}
        self.type = "rate_limit_exceeded" if status == 429 else "invalid_request_error" if status < 500 \
            else "server_error"

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def unsupported(message: str, param: str) -> APIError:
    return APIError(400, message, param=param, code="unsupported_parameter")


def invalid(message: str, param: str | None) -> APIError:
    return APIError(400, message, param=param, code="invalid_value")


def to_api_error(exc: BaseException) -> APIError:
    """Any exception as the APIError a client should see: engine validation → 400, the unknown → 500."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ContextLengthError):  # prepare.py checks first; this is the engine's own check
        return APIError(400, str(exc), param=openai_param(exc.param), code="context_length_exceeded")
    if isinstance(exc, InvalidRequestError):
        return APIError(400, str(exc), param=openai_param(exc.param), code="invalid_value")
    if isinstance(exc, QueueFullError):
        return APIError(429, str(exc), code="queue_full", headers={"Retry-After": str(exc.retry_after)})
    if isinstance(exc, ShuttingDownError):
        return APIError(503, str(exc), code="shutting_down")
    return APIError(500, f"internal error while generating: {type(exc).__name__}: {exc}", code="internal_error")


def openai_param(param: str | None) -> str | None:
    return _OPENAI_PARAMS.get(param, param) if param else param


def validation_error(errors: Sequence[Any]) -> APIError:
    """A 400 with a one-line message naming the offending parameter (dotted path), from pydantic / FastAPI errors."""
    if not errors:
        return APIError(400, "invalid request body", code="invalid_request")
    first = errors[0]
    param = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
    if first.get("type") == "json_invalid":
        return APIError(400, f"could not parse the JSON body: {first.get('msg', '')}".rstrip(": "),
                        code="invalid_request")
    text = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
    if len(errors) > 1:
        text += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
    return APIError(400, text, param=param, code="invalid_request")


def validated(model: type[ModelT], data: Any) -> ModelT:
    """`data` as `model`, or the 400 saying what is wrong with it."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None


def install_error_handlers(app: FastAPI) -> None:
    async def _known(_: Request, exc: Exception) -> JSONResponse:  # an APIError, or the engine's validation
        return to_api_error(exc).response()

    for known in (APIError, InvalidRequestError):
        app.add_exception_handler(known, _known)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc.errors()).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else None
        return APIError(exc.status_code, str(exc.detail), code=code, headers=exc.headers).response()

    @app.exception_handler(Exception)
    async def _unknown(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return to_api_error(exc).response()
