"""The OpenAI error shape, shared by the gateway and the bundled backend.

Shape (OpenAI API reference, "Error codes"; also what LiteLLM and LangChain parse)::

    {"error": {"message": str, "type": str, "param": str | None, "code": str | None}}
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

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
    """The ``code`` values kvgate emits, with their HTTP status in comments. Every code kvgate
    itself sets is one of these (tests/test_errors.py scans the tree for string literals); codes
    an engine sends are passed through as the engine wrote them."""

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
    METHOD_NOT_ALLOWED = "method_not_allowed"  # 405
    HTTP_VERSION_NOT_SUPPORTED = "http_version_not_supported"  # 505 (a request line not HTTP/1.x)
    UNSUPPORTED_MEDIA_TYPE = "unsupported_media_type"  # 415 (backend)
    ABORTED = "aborted"  # 499/503 (backend: client gone or engine stopping)
    TRANSFER_MISMATCH = "transfer_mismatch"  # 500 (backend: tokens received != tokens reserved)
    INVALID_TRANSFER = "invalid_transfer"  # 400 (backend: malformed transfer payload)
    ROOM_CLOSED = "room_closed"  # 410 (backend: bootstrap room already released)
    DUPLICATE_TRANSFER = "duplicate_transfer"  # 409 (backend: second transfer for a room)
    # the edge's refusals of a connection or a request head, before the app (gateway/edge/protocol.py)
    REQUEST_TIMEOUT = "request_timeout"  # 408 (head or body too slow)
    URI_TOO_LONG = "uri_too_long"  # 414 (request-target over its limit)
    REQUEST_HEADER_FIELDS_TOO_LARGE = "request_header_fields_too_large"  # 431
    TOO_MANY_CONNECTIONS = "too_many_connections"  # 429 (one client address's connection cap)
    NOT_IMPLEMENTED = "not_implemented"  # 501 (a transfer coding other than chunked)
    SERVER_BUSY = "server_busy"  # 503 (the gateway's connection cap)

    @classmethod
    def members(cls) -> frozenset[str]:
        """Every code value defined here."""
        return frozenset(v for k, v in vars(cls).items() if k.isupper() and isinstance(v, str))


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
    #: the request's prompt tokens where they were counted before the refusal (for the access log
    #: of a ``context_length_exceeded``; never in the body)
    prompt_tokens: int | None = None
    #: the message, code and param are an engine's (:func:`verifier.engine_response.engine_error`),
    #: text no verifier has checked
    from_engine: bool = False

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

    def to_openai(self) -> OpenAIError:
        """Itself (:class:`ErrorLike`)."""
        return self


@runtime_checkable
class ErrorLike(Protocol):
    """The one error protocol: what every kvgate error family (:class:`OpenAIError`,
    ``tokenizer.errors.TokenizerError``, ``gpu_backend.errors.EngineError``) carries.
    ``status``: the HTTP status answered; ``code``: an :class:`ErrorCode` value or ``None``;
    ``to_openai()``: the same error as an :class:`OpenAIError`, what servers render."""

    status: int
    code: str | None

    def to_openai(self) -> OpenAIError: ...


def as_openai_error(exc: BaseException) -> OpenAIError | None:
    """The one mapper: ``exc`` as an :class:`OpenAIError` when it follows :class:`ErrorLike`
    (has a callable ``to_openai``), else ``None`` (not a kvgate error: the caller answers 500)."""
    if isinstance(exc, OpenAIError):
        return exc
    to_openai = getattr(exc, "to_openai", None)
    return to_openai() if callable(to_openai) else None


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
