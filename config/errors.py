"""The OpenAI error shape, shared by the gateway and the bundled backend.

Shape (OpenAI API reference, "Error codes"; also what LiteLLM and LangChain parse)::

    {"error": {"message": str, "type": str, "param": str | None, "code": str | None}}
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson


#: longest ``param`` an error body carries (characters); a field name is never longer in a valid request
MAX_PARAM_CHARS = 128
#: longest ``message`` an error body carries (characters)
MAX_MESSAGE_CHARS = 1024


def bounded(text: str, limit: int) -> str:
    """``text`` itself when at most ``limit`` characters, else its first ``limit`` characters and
    the marker ``"...[N more characters]"`` (so an echoed name or value, e.g. a 4 MB field name,
    never makes an error body or a log line large)."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}...[{len(text) - limit} more characters]"


class ErrorCode:
    """The ``code`` values kvgate emits, with their HTTP status in comments."""

    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # 400
    INVALID_REQUEST = "invalid_request"  # 400 (generic validation)
    INVALID_API_KEY = "invalid_api_key"  # 401
    MODEL_NOT_FOUND = "model_not_found"  # 404
    NOT_FOUND = "not_found"  # 404 unknown route
    REQUEST_TOO_LARGE = "request_too_large"  # 413
    RATE_LIMIT_EXCEEDED = "rate_limit_exceeded"  # 429
    POOL_SIZE_UNKNOWN = "pool_size_unknown"  # 503
    UPSTREAM_UNAVAILABLE = "upstream_unavailable"  # 502/503
    UPSTREAM_TIMEOUT = "upstream_timeout"  # 504
    RESPONSE_WITHHELD = "response_withheld"  # 502 (strict verification)
    QUOTA_BACKEND_UNAVAILABLE = "quota_backend_unavailable"  # 503 (Redis down, fail closed)
    POOL_EXHAUSTED = "pool_exhausted"  # 503 (engine: pool momentarily full)
    SERVER_SHUTTING_DOWN = "server_shutting_down"  # 503 (draining)
    INTERNAL_ERROR = "internal_error"  # 500


_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}


def error_type_for_status(status: int) -> str:
    """OpenAI ``type`` for an HTTP status: 4xx map as the OpenAI API does, 5xx are ``server_error``."""
    if status >= 500:
        return "server_error"
    return _TYPE_BY_STATUS.get(status, "invalid_request_error")


def openai_error(
    message: str,
    *,
    status: int = 400,
    code: str | None = None,
    param: str | None = None,
    type: str | None = None,
) -> dict[str, Any]:
    """Build the OpenAI error body as a dict. ``type`` defaults from ``status``; ``message`` and
    ``param`` are cut as :class:`OpenAIError` cuts them."""
    return {
        "error": {
            "message": bounded(message, MAX_MESSAGE_CHARS),
            "type": type or error_type_for_status(status),
            "param": None if param is None else bounded(param, MAX_PARAM_CHARS),
            "code": code,
        }
    }


def openai_error_bytes(message: str, **kwargs: Any) -> bytes:
    """Same as :func:`openai_error`, serialized with orjson."""
    return orjson.dumps(openai_error(message, **kwargs))


@dataclass
class OpenAIError(Exception):
    """An error that is answered with an OpenAI-shaped body and ``status``.

    Raised anywhere on a request path; the server's exception handler renders it.
    ``headers`` are added to the response (e.g. ``Retry-After``). ``message`` and ``param`` are
    cut to :data:`MAX_MESSAGE_CHARS` / :data:`MAX_PARAM_CHARS` with :func:`bounded`'s marker: they
    may echo what a client sent (an unknown field's name), and the body and the access log must
    stay small.
    """

    status: int
    message: str
    code: str | None = None
    param: str | None = None
    type: str | None = None
    headers: dict[str, str] | None = None

    def __post_init__(self) -> None:
        if len(self.message) > MAX_MESSAGE_CHARS:
            self.message = bounded(self.message, MAX_MESSAGE_CHARS)
        if self.param is not None and len(self.param) > MAX_PARAM_CHARS:
            self.param = bounded(self.param, MAX_PARAM_CHARS)
        super().__init__(self.message)

    def body(self) -> dict[str, Any]:
        """The JSON body: ``{"error": {...}}`` (message and param already cut)."""
        etype = self.type or error_type_for_status(self.status)
        return {"error": {"message": self.message, "type": etype, "param": self.param, "code": self.code}}

    def body_bytes(self) -> bytes:
        """The JSON body as bytes."""
        return orjson.dumps(self.body())


def context_length_message(limit: int, prompt_tokens: int, completion_tokens: int, *, messages: bool) -> str:
    """The OpenAI wording for ``context_length_exceeded`` (kept verbatim: clients parse it).

    ``messages`` selects "in the messages" (chat) or "in the prompt" (completions).
    """
    where = "messages" if messages else "prompt"
    total = prompt_tokens + completion_tokens
    return (
        f"This model's maximum context length is {limit} tokens. However, you requested "
        f"{total} tokens ({prompt_tokens} in the {where}, {completion_tokens} in the completion). "
        f"Please reduce the length of the {where} or completion."
    )
