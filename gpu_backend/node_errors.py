"""Node errors as OpenAI errors: what the router, the nodes and the servers answer when a request
fails (:func:`backend_error` for an exception, :func:`remote_error` for another node's body)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from config.errors import ErrorCode, OpenAIError, as_openai_error


def backend_error(exc: BaseException) -> OpenAIError:
    """Any error a node or the router meets, as an :class:`OpenAIError`: kvgate's own errors
    through the one mapper (:func:`config.errors.as_openai_error`: status, code and param kept);
    a timeout is 504 ``upstream_timeout``, an unreachable node 502 ``upstream_unavailable``,
    anything else 500 ``internal_error`` naming only the exception's type."""
    err = as_openai_error(exc)
    if err is not None:
        return err
    if isinstance(exc, asyncio.TimeoutError):
        return OpenAIError(status=504, message="The backend timed out.", code=ErrorCode.UPSTREAM_TIMEOUT)
    if isinstance(exc, httpx.HTTPError):
        return OpenAIError(
            status=502,
            message=f"A backend node is unreachable: {type(exc).__name__}.",
            code=ErrorCode.UPSTREAM_UNAVAILABLE,
        )
    return OpenAIError(status=500, message=f"Internal error: {type(exc).__name__}.", code=ErrorCode.INTERNAL_ERROR)


def remote_error(status: int, body: Any) -> OpenAIError:
    """Rebuild an :class:`OpenAIError` from a node's JSON error body (OpenAI shape); a body that is
    not one is 502 ``upstream_unavailable`` (``status`` kept when it is an error status)."""
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict) and isinstance(err.get("message"), str):
        return OpenAIError(
            status=status, message=err["message"], code=err.get("code"), param=err.get("param"), type=err.get("type")
        )
    return OpenAIError(
        status=status if status >= 400 else 502,
        message=f"Backend node answered {status}.",
        code=ErrorCode.UPSTREAM_UNAVAILABLE,
    )
