"""Exception handlers: every error the app answers is OpenAI-shaped JSON (docs/design.md, "Error
bodies"), unknown routes included (404 ``not_found``, 405 ``method_not_allowed``); an unexpected
exception is a 500 whose body is OpenAI-shaped too and names no internals.

The app is a plain Starlette app whose routes read the body themselves: no request validation
runs before them. The request path answers its own errors (:mod:`gateway.routes.handlers`,
:mod:`gateway.relay.response`); these handlers catch what escapes it."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
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


async def _kvgate(request: Request, exc: Exception) -> Response:
    err = as_openai_error(exc)
    assert err is not None  # registered only for the ErrorLike families (handlers())
    return error_response(err)


async def _http(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
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
        headers=_sorted_allow(getattr(exc, "headers", None)),
    )


def _sorted_allow(headers: Mapping[str, str] | None) -> Mapping[str, str] | None:
    """``headers`` with a 405's ``Allow`` list in alphabetical order: Starlette joins a route's
    method set, whose order varies between processes, so replicas answered ``GET, HEAD`` and
    ``HEAD, GET`` for the same route."""
    if not headers or "Allow" not in headers:
        return headers
    methods = sorted(m.strip() for m in headers["Allow"].split(","))
    return {**headers, "Allow": ", ".join(methods)}


async def _unexpected(request: Request, exc: Exception) -> Response:
    log.error("unhandled error on %s %s: %s", request.method, request.url.path, type(exc).__name__, exc_info=exc)
    return Response(
        openai_error_bytes(
            "The server had an error while processing your request.", status=500, code=ErrorCode.INTERNAL_ERROR
        ),
        status_code=500,
        media_type=JSON,
    )


def handlers() -> dict[Any, Callable[[Request, Exception], Awaitable[Response]]]:
    """The app's exception handlers (Starlette's ``exception_handlers``): kvgate's error families
    (``config.errors.ErrorLike``: status, code, ``to_openai()``), Starlette's HTTP errors (404,
    405) and, for anything else, the 500."""
    return {OpenAIError: _kvgate, TokenizerError: _kvgate, StarletteHTTPException: _http, Exception: _unexpected}
