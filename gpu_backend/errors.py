"""Typed engine errors. Each :class:`EngineError` knows its HTTP status and OpenAI error ``code``;
``body()`` renders the OpenAI error shape with :func:`config.errors.openai_error` (docs/design.md,
"Error bodies"). Servers (issue 4) map them 1:1 to responses.
"""

from __future__ import annotations

from typing import Any

from config.errors import ErrorCode, OpenAIError, context_length_message, openai_error


class EngineError(Exception):
    """Base of the engine's request errors.

    Attributes: ``status`` (HTTP status), ``code`` (OpenAI ``code``), ``message`` (human text),
    ``param`` (OpenAI ``param`` or ``None``), ``request_id`` (when known).
    """

    status: int = 500
    code: str = ErrorCode.INTERNAL_ERROR

    def __init__(
        self, message: str, *, request_id: str | None = None, param: str | None = None, status: int | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.request_id = request_id
        self.param = param
        if status is not None:
            self.status = status

    def body(self) -> dict[str, Any]:
        """The OpenAI error body ``{"error": {"message", "type", "param", "code"}}``."""
        return openai_error(self.message, status=self.status, code=self.code, param=self.param)

    def to_openai(self) -> OpenAIError:
        """The same error as :class:`config.errors.OpenAIError` (what the servers' handler renders)."""
        return OpenAIError(status=self.status, message=self.message, code=self.code, param=self.param)


class InvalidRequestError(EngineError):
    """400 ``invalid_request``: empty prompt, token id outside the vocabulary, bad sampling params."""

    status = 400
    code = ErrorCode.INVALID_REQUEST


class PromptTooLongError(EngineError):
    """400 ``context_length_exceeded``: ``prompt_tokens > max_req_input_len`` at admission.

    Raised before any page is allocated (docs/design.md invariant 1); the request's state is REJECTED.
    The message keeps the OpenAI wording (:func:`config.errors.context_length_message`) with
    ``max_req_input_len`` as the limit. Attributes: ``prompt_tokens``, ``max_req_input_len``.
    """

    status = 400
    code = ErrorCode.CONTEXT_LENGTH_EXCEEDED

    def __init__(
        self, prompt_tokens: int, max_req_input_len: int, *, request_id: str | None = None, param: str | None = "prompt"
    ) -> None:
        self.prompt_tokens = prompt_tokens
        self.max_req_input_len = max_req_input_len
        msg = context_length_message(max_req_input_len, prompt_tokens, 0, messages=param == "messages")
        super().__init__(msg, request_id=request_id, param=param)


class PoolExhaustedError(EngineError):
    """503 ``pool_exhausted`` (retryable): the prompt fits the pool but the pool stayed full for
    ``pool_wait_timeout_seconds``. Never a 400 (docs/design.md, backend flags contract)."""

    status = 503
    code = ErrorCode.POOL_EXHAUSTED


class RequestAbortedError(EngineError):
    """``aborted``: the request was aborted (client gone: 499; engine stopping: 503)."""

    status = 499
    code = ErrorCode.ABORTED


class TransferMismatchError(EngineError):
    """500 ``transfer_mismatch``: decode received pages it did not reserve for: another number of
    tokens, another request's, or another prompt's (its ``prompt_ids_sha256``) (docs/design.md
    invariant 2; raised by the disaggregation layer)."""

    status = 500
    code = ErrorCode.TRANSFER_MISMATCH


class StaleHandleError(Exception):
    """A read or write through a page handle ``(index, generation)`` whose page was released
    (its generation moved on). docs/design.md invariant 3. Not an HTTP error: a bug or an attack."""
