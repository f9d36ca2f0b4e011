"""Counting ``/v1/embeddings`` inputs (OpenAI ``input``; vLLM ``EmbeddingCompletionRequest``).

``input`` takes the shapes of a completions ``prompt``: a string, a list of strings, a list of
token ids (one input) or a list of token-id lists. Strings are encoded as the engines encode an
embedding input, with the tokenizer's added tokens (vLLM's ``add_special_tokens`` defaults to
true there), so each count is :meth:`PromptCounter.count_prompt_text`; token ids are validated
against the vocabulary and counted as they are. Errors name ``input`` / ``input[i]``.
"""

from __future__ import annotations

from typing import Any

from tokenizer.base import PromptCount, PromptCounter, prompt_param, split_completion_prompt
from tokenizer.errors import TokenizerFaultError

FIELD = "input"


def split_embedding_input(value: Any) -> list[str | list[int]]:
    """The inputs of an embeddings request, each a string or a list of ids. Raises
    :class:`~tokenizer.errors.InvalidPromptError` (``param`` ``input`` or ``input[i]``)."""
    return split_completion_prompt(value, FIELD)


async def acount_embedding_input(counter: PromptCounter, value: Any) -> PromptCount:
    """Tokens of each input of ``value`` (one entry per input, in order). Token ids are checked
    first (:class:`~tokenizer.errors.InvalidTokenIdError` naming ``input`` / ``input[i]``), so
    nothing is sent to an engine tokenizer for a request that is wrong; strings are then counted
    by the counter's async API (a worker thread for long text, the engine for ``engine``
    tokenizers)."""
    inputs = split_embedding_input(value)
    texts = [p for p in inputs if isinstance(p, str)]
    for i, p in enumerate(inputs):
        if not isinstance(p, str):
            counter.check_ids(p, prompt_param(value, i, FIELD))
    try:
        text_counts = iter((await counter.acount_prompt(texts)).per_prompt if texts else ())
    except TokenizerFaultError as e:
        e.param = FIELD  # the index among the strings is not the index among the inputs
        raise
    return PromptCount(tuple(next(text_counts) if isinstance(p, str) else len(p) for p in inputs))
