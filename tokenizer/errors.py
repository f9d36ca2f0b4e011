"""Typed errors of prompt counting. The gateway turns each into an OpenAI-shaped error with the
error's ``status`` (400 for the request's own faults) and ``code``; ``param`` names the offending
field as the OpenAI API does (``messages[2].content[1].type``, ``prompt[1]``)."""

from __future__ import annotations

import logging

from config.errors import ErrorCode, OpenAIError

log = logging.getLogger("kvgate.tokenizer")

#: characters of an engine tokenizer fault's detail written to the log (:class:`EngineTokenizeError`)
MAX_LOGGED_DETAIL_CHARS = 300


def _short(value: object) -> str:
    """``repr`` of a value for a message, bounded (huge ints cannot even be printed in full)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"<a {value.bit_length()}-bit integer>"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


class TokenizerError(ValueError):
    """Base class; follows ``config.errors.ErrorLike``. ``param``: the request field at fault (or
    ``None``). ``status``: the HTTP status the gateway answers with (400: the request is wrong).
    ``code``: the OpenAI ``code`` (an ``ErrorCode``)."""

    status: int = 400
    code: str | None = ErrorCode.INVALID_REQUEST

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def to_openai(self) -> OpenAIError:
        """The OpenAI error: the request's own faults are 400s naming the field (``param``); an
        engine's failure (status >= 500) names no field."""
        return OpenAIError(self.status, self.message, code=self.code, param=self.param if self.status < 500 else None)


class InvalidPromptError(TokenizerError):
    """The prompt or messages have the wrong shape or type (e.g. content is a number)."""


class InvalidTokenIdError(TokenizerError):
    """A token-id prompt holds an id that is negative or not defined by the model's tokenizer.

    ``param`` is ``prompt`` for a single token-id prompt and ``prompt[i]`` for prompt ``i`` of a
    list of token-id lists; ``token_id`` is the first bad id, ``vocab_size`` the id bound."""

    def __init__(self, token_id: object, vocab_size: int, param: str) -> None:
        super().__init__(
            f"Invalid token id {_short(token_id)} in '{param}': ids must be integers in [0, {vocab_size}) "
            "that the model's tokenizer defines.",
            param,
        )
        self.token_id = token_id
        self.vocab_size = vocab_size


class UnknownContentPartError(TokenizerError):
    """A chat content part has a ``type`` this model cannot take (or none at all).
    ``param`` is ``messages[i].content[j].type``."""

    def __init__(self, part_type: object, param: str) -> None:
        super().__init__(
            f"Unknown content part type {_short(part_type)} at '{param}'; expected one of "
            "'text', 'image_url', 'input_image', 'refusal'.",
            param,
        )
        self.part_type = part_type


class ImagesNotSupportedError(TokenizerError):
    """Raised when rendering chat for a text-only engine meets an image part."""


class EngineTokenizeError(TokenizerError):
    """The engine's tokenize endpoint failed or answered an unexpected shape: the engine's fault,
    not the request's, so it is a 502 ``upstream_unavailable``. ``detail`` (its ``str``) names the
    engine's URL and what it answered: the log gets it (:meth:`to_openai`), the client a fixed
    :attr:`message`, as the forward path tells a client a transport failure's class only."""

    status = 502
    code = ErrorCode.UPSTREAM_UNAVAILABLE
    #: what the client reads
    CLIENT_MESSAGE = "The upstream engine's tokenizer failed to answer; the request was not forwarded."

    def __init__(self, detail: str, param: str | None = None) -> None:
        super().__init__(detail, param)
        self.detail = detail
        self.message = self.CLIENT_MESSAGE

    def to_openai(self) -> OpenAIError:
        """The client's 502, the detail logged as a warning (its ``repr``, cut to
        :data:`MAX_LOGGED_DETAIL_CHARS`: an engine shapes part of it)."""
        log.warning("engine tokenizer failed: %s", repr(self.detail)[:MAX_LOGGED_DETAIL_CHARS])
        return super().to_openai()


class TokenizerFaultError(TokenizerError):
    """The tokenizer library itself failed on a text: tiktoken's Rust core panics
    (``pyo3_runtime.PanicException``, a ``BaseException``) where its regex overflows, or an HF
    tokenizer raises. A 400 naming the field whose text it was (``param``; ``None`` until the
    caller knows it). Text that came from an engine (the verifier re-encoding an answer) raises
    the same error, for the caller to record and go on. ``cause``: the original exception's type
    name."""

    def __init__(self, message: str, param: str | None = None, cause: str = "") -> None:
        super().__init__(message, param)
        self.cause = cause
