"""Typed errors of prompt counting. The gateway turns each into a 400 in the OpenAI shape;
``param`` names the offending field as the OpenAI API does (``messages[2].content[1].type``)."""
from __future__ import annotations


class TokenizerError(ValueError):
    """Base class. ``param``: the request field at fault (or ``None``)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidPromptError(TokenizerError):
    """The prompt or messages have the wrong shape or type (e.g. content is a number)."""


class InvalidTokenIdError(TokenizerError):
    """A token-id prompt holds an id that is negative or not in the vocabulary."""

    def __init__(self, token_id: object, vocab_size: int, param: str) -> None:
        super().__init__(
            f"Invalid token id {token_id!r} in '{param}': ids must be integers in [0, {vocab_size}) "
            "that the model's tokenizer defines.",
            param,
        )
        self.token_id = token_id
        self.vocab_size = vocab_size


class UnknownContentPartError(TokenizerError):
    """A chat content part has a ``type`` this model cannot take (or none at all)."""

    def __init__(self, part_type: object, param: str) -> None:
        super().__init__(
            f"Unknown content part type {part_type!r} at '{param}'; expected one of "
            "'text', 'image_url', 'input_image', 'refusal'.",
            param,
        )
        self.part_type = part_type


class ImagesNotSupportedError(TokenizerError):
    """Raised when rendering chat for a text-only engine meets an image part."""


class EngineTokenizeError(TokenizerError):
    """The engine's tokenize endpoint failed or answered an unexpected shape."""
