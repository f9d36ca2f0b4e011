"""What kvgate's ``/tokenize`` answers, from the model's own counter (so its ``count`` is exactly
the one the context gate uses).

Shapes are vLLM's (``vllm/entrypoints/serve/tokenize/protocol.py``): ``TokenizeResponse``
``{"count", "max_model_len", "tokens", "token_strs"}`` (the gateway adds ``max_model_len``).

- A ``prompt`` (one string): ``count`` is the gate's count of a completions prompt
  (:meth:`PromptCounter.count_prompt_text`, or :meth:`PromptCounter.count_text` when
  ``add_special_tokens`` is false); ``tokens`` the tokenizer's ids.
- ``messages`` (and ``tools``, and the chat switches as :class:`~tokenizer.chat.ChatOptions`):
  ``count`` is the gate's count of the chat (:meth:`PromptCounter.count_chat`); ``tokens`` the
  rendered template's ids.

For Hugging Face tokenizers, a request string holding a special-token look-alike
(``<|im_start|>`` typed as text) is counted as its text encoding (kvgate never undercounts,
docs/tokenizer.md) while ``tokens`` are the engine tokenizer's ids, so there ``count`` exceeds
``len(tokens)`` by that surcharge; otherwise they are equal. Image parts have no ids here and are
refused (400). Long inputs are tokenized in a worker thread, and so are short ones once the
payer has spent its share of the event loop (:func:`tokenizer.base.on_loop`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenizer.base import PromptCounter, off_loop
from tokenizer.chat import DEFAULT_CHAT, ChatOptions, chat_text_length
from tokenizer.guard import fault_param


@dataclass
class Tokenized:
    """``count``: the gate's count (tokens); ``tokens``: the ids; ``token_strs``: each id's token
    (only when asked)."""

    count: int
    tokens: list[int]
    token_strs: list[str] | None = None


async def tokenize_prompt(
    counter: PromptCounter, text: str, add_special_tokens: bool = True, return_token_strs: bool = False
) -> Tokenized:
    """A completions-style string's count and ids. Raises ``NotImplementedError`` for a counter
    without local ids (``engine`` tokenizers: the gateway forwards to the engine instead)."""

    def run() -> Tokenized:
        with fault_param("prompt"):
            count = counter.count_prompt_text(text) if add_special_tokens else counter.count_text(text)
            ids = counter.prompt_token_ids(text, add_special_tokens)
        return Tokenized(count, ids, counter.token_strs(ids) if return_token_strs else None)

    return await off_loop(len(text), counter.offload_chars, run)


async def tokenize_chat(
    counter: PromptCounter,
    messages: Any,
    tools: Any = None,
    return_token_strs: bool = False,
    options: ChatOptions = DEFAULT_CHAT,
) -> Tokenized:
    """A chat's count and ids, rendered with ``options`` (by default with the generation
    prompt). Raises the typed errors of :mod:`tokenizer.errors` (shapes, unknown parts;
    ``ImagesNotSupportedError`` for images)."""

    def run() -> Tokenized:
        count = counter.count_chat(messages, tools, options)
        ids = counter.chat_token_ids(messages, tools, options)
        return Tokenized(count, ids, counter.token_strs(ids) if return_token_strs else None)

    limit = counter.offload_chars
    return await off_loop(chat_text_length(messages, tools, limit=limit + 1), limit, run)
