"""Exception handlers: every error the app answers is OpenAI-shaped JSON (docs/design.md, "Error
bodies"), unknown routes included (404 ``not_found``, 405 ``method_not_allowed``); an unexpected
exception is a 500 whose body is OpenAI-shaped too and names no internals.

The routes are plain Starlette routes that read the body themselves, so FastAPI's request
validation (``RequestValidationError``) never runs and has no handler here. The request path
answers its own errors (:mod:`gateway.routes.handlers`, :mod:`gateway.relay.response`); these handlers catch
what escapes it."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from config.errors import ErrorCode, OpenAIError, as_openai_error, openai_error_bytes
from tokenizer import TokenizerError

log = logging.getLogger("kvgate.errors")

JSON = "application/json"


def error_response(err: OpenAIError, headers: dict[str, str] | None = None) -> Response:
    """The HTTP response for ``err`` (its status, body and headers, plus ``headers``)."""
    h = dict(err.headers or {})
    if headers:
        h.update(headers)
    return Response(err.body_bytes(), status_code=err.status, media_type=JSON, headers=h)


def install(app: FastAPI) -> None:
    """Register the handlers on ``app``."""

    async def _kvgate(request: Request, exc: Exception) -> Response:
        err = as_openai_error(exc)
        assert err is not None  # registered only for the ErrorLike families below
        return error_response(err)

    for family in (OpenAIError, TokenizerError):  # config.errors.ErrorLike: status, code, to_openai()
        app.add_exception_handler(family, _kvgate)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 404:
            msg = f"Unknown request URL: {request.method} {request.url.path}. Please check the URL."
            code = ErrorCode.NOT_FOUND
        elif exc.status_code == 405:
            msg = f"Method {request.method} is not allowed for {request.url.path}."
            code = ErrorCode.METHOD_NOT_ALLOWED
        else:
            msg, code = str(exc.detail), None
        return Response(
            openai_error_bytes(msg, status=exc.status_code, code=code),
            status_code=exc.status_code,
            media_type=JSON,
            headers=getattr(exc, "headers", None),
        )

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        log.error("unhandled error on %s %s: %s", request.method, request.url.path, type(exc).__name__, exc_info=exc)
        return Response(
            openai_error_bytes(
                "The server had an error while processing your request.", status=500, code=ErrorCode.INTERNAL_ERROR
            ),
            status_code=500,
            media_type=JSON,
        )
