"""The prompt-counting interface: an OpenAI request in, an exact prompt-token count out."""
from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from tokenizer.chat import chat_text_length
from tokenizer.errors import InvalidPromptError

#: Above this many characters, the async API counts in a worker thread.
OFFLOAD_CHARS = 32_768


@dataclass(frozen=True)
class PromptCount:
    """Prompt tokens of a ``/v1/completions`` request: one entry per prompt (a batch has several).
    ``largest`` is what the context gate checks; ``total`` what a token quota reserves."""

    per_prompt: tuple[int, ...]

    @property
    def total(self) -> int:
        return sum(self.per_prompt)

    @property
    def largest(self) -> int:
        return max(self.per_prompt)


def split_completion_prompt(prompt: Any) -> list[str | list[int]]:
    """Normalise an OpenAI ``prompt`` into a list of prompts (each a string or a list of ids).

    Accepts a string, a list of strings, a list of ints (one token-id prompt) or a list of int
    lists. Raises :class:`InvalidPromptError` (``param`` ``prompt``) for anything else, mixed lists,
    booleans posing as ints, or an empty list.
    """
    if isinstance(prompt, str):
        return [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise InvalidPromptError(
            "'prompt' must be a string, a list of strings, a list of token ids or a list of token-id lists.",
            "prompt")
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
        return [list(prompt)]
    if all(isinstance(p, list) for p in prompt):
        for i, p in enumerate(prompt):
            if not p or not all(isinstance(t, int) and not isinstance(t, bool) for t in p):
                raise InvalidPromptError(f"'prompt[{i}]' must be a non-empty list of integer token ids.",
                                         f"prompt[{i}]")
        return [list(p) for p in prompt]
    raise InvalidPromptError(
        "'prompt' must be a string, a list of strings, a list of token ids or a list of token-id lists "
        "(not a mix).", "prompt")


def _prompt_chars(prompt: Any) -> int:
    if isinstance(prompt, str):
        return len(prompt)
    if isinstance(prompt, list):
        return sum(len(p) if isinstance(p, (str, list)) else 1 for p in prompt)
    return 0


class PromptCounter(ABC):
    """Counts prompt tokens exactly as the engine will see them (never fewer).

    Subclasses implement the synchronous ``count_*`` methods; the ``acount_*`` coroutines run them
    in a worker thread when the input is long, so the event loop is never blocked.
    """

    #: model's vocabulary size (ids are valid in ``[0, vocab_size)`` when defined)
    vocab_size: int
    #: per-image cost in tokens for chat image parts (never 0)
    image_tokens: int = 765
    offload_chars: int = OFFLOAD_CHARS

    @abstractmethod
    def count_text(self, text: str) -> int:
        """Tokens of ordinary text (special-token look-alikes count as text)."""

    @abstractmethod
    def is_valid_id(self, token_id: int) -> bool:
        """Whether ``token_id`` is a token of this vocabulary."""

    @abstractmethod
    def count_chat(self, messages: Any, tools: Any = None) -> int:
        """Prompt tokens of a chat, generation prompt included. Raises the typed errors of
        :mod:`tokenizer.errors` for bad shapes, unknown parts."""

    def check_ids(self, ids: list[int], param: str) -> None:
        """Raise :class:`InvalidTokenIdError` for the first id that is negative or undefined."""
        from tokenizer.errors import InvalidTokenIdError

        for t in ids:
            if t < 0 or not self.is_valid_id(t):
                raise InvalidTokenIdError(t, self.vocab_size, param)

    def count_prompt(self, prompt: Any) -> PromptCount:
        """Prompt tokens of a ``/v1/completions`` ``prompt`` (ids are counted, not re-tokenized)."""
        prompts = split_completion_prompt(prompt)
        counts = []
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                counts.append(self.count_text(p))
            else:
                self.check_ids(p, "prompt" if len(prompts) == 1 and not isinstance(prompt[0], list) else f"prompt[{i}]")
                counts.append(len(p))
        return PromptCount(tuple(counts))

    async def acount_prompt(self, prompt: Any) -> PromptCount:
        """:meth:`count_prompt`, off the event loop for long input."""
        if _prompt_chars(prompt) > self.offload_chars:
            return await asyncio.to_thread(self.count_prompt, prompt)
        return self.count_prompt(prompt)

    async def acount_chat(self, messages: Any, tools: Any = None) -> int:
        """:meth:`count_chat`, off the event loop for long input."""
        if chat_text_length(messages) > self.offload_chars:
            return await asyncio.to_thread(self.count_chat, messages, tools)
        return self.count_chat(messages, tools)
