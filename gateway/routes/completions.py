"""``POST /v1/completions`` as a route value (:data:`COMPLETIONS`): its field table, how its
prompts are counted (a string, strings, token ids or id lists: :mod:`tokenizer.base`; a
``suffix`` added to each), the batch refused before counting, the values the engines serving the
model would refuse after admission (:mod:`gateway.admission.engine_refusals`), and what the
verifier reads of it (token-id prompts, the texts an echo repeats)."""

from __future__ import annotations

from typing import Any

from config.errors import ErrorCode, OpenAIError, context_length_message
from gateway.admission import fields
from gateway.admission.checks import COMPLETION_FIELDS, check_fields, check_stream_options
from gateway.admission.engine_refusals import check_engine_refusals
from gateway.admission.gate import CountedPrompt, sequences_error, sequences_of
from gateway.admission.registry import ModelEntry
from gateway.routes.base import PromptApiRoute
from tokenizer import PromptCounter, split_completion_prompt
from tokenizer.base import PromptCount, prompt_cost
from tokenizer.chat import ChatOptions


def suffix_tokens(counter: PromptCounter, body: dict[str, Any]) -> int:
    """Tokens of a completions ``suffix`` (only ever accepted for ``openai`` upstreams, see
    :mod:`gateway.admission.fields`), counted as prompt text added to every prompt; 0 without one. Raises
    :class:`OpenAIError` 400 (``param`` ``suffix``) for a counter that counts prompts only."""
    suffix = body.get("suffix")
    if not isinstance(suffix, str) or not suffix:
        return 0
    try:
        return counter.count_text(suffix)
    except NotImplementedError:  # an engine-tokenize counter
        raise OpenAIError(
            400, "'suffix' is not supported for this model.", code=ErrorCode.INVALID_REQUEST, param="suffix"
        ) from None


def _with_suffix(pc: PromptCount, extra: int) -> CountedPrompt:
    num = len(pc.per_prompt)
    per_prompt = tuple(n + extra for n in pc.per_prompt)
    return CountedPrompt(pc.largest + extra, pc.total + num * extra, num, per_prompt=per_prompt)


class CompletionsRoute(PromptApiRoute):
    """Text completions: ``prompt`` (shape validated while counting), ``best_of``, ``echo``, ``suffix``."""

    name = "completions"
    path = "/v1/completions"
    upstream_path = "/completions"
    fields = COMPLETION_FIELDS
    bound_fields: tuple[str, ...] = ("max_tokens",)
    prompt_param = "prompt"

    def validate(self, body: dict[str, Any]) -> None:
        check_fields(body, self.fields, ("prompt",))
        check_stream_options(body)

    def forwarded_bound(self, engines: frozenset[str]) -> str:
        return "max_tokens"

    def length_message(self, limit: int, largest: int, max_tokens: int) -> str:
        return context_length_message(limit, largest, max_tokens, messages=False)

    def check_batch(self, body: dict[str, Any], max_sequences: int) -> None:
        """A batch of more prompts x sequences than ``max_sequences``: 400 before counting."""
        p = body.get("prompt")
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            seqs = sequences_of(body)
            if len(p) * seqs > max_sequences:
                raise sequences_error(len(p), seqs, max_sequences, body)

    def cost(self, body: dict[str, Any], limit: int) -> int:
        return prompt_cost(body.get("prompt"), limit)

    def longest_text_chars(self, body: dict[str, Any]) -> int:
        p = body.get("prompt")
        if isinstance(p, str):
            return len(p)
        if isinstance(p, list) and p and isinstance(p[0], str):
            return max(map(len, p))
        return 0

    def check_fields(self, body: dict[str, Any], entry: ModelEntry) -> ChatOptions:
        """The engines' field policy (:func:`gateway.admission.fields.check_completion_request`),
        then the values they would refuse after admission
        (:func:`gateway.admission.engine_refusals.check_engine_refusals`: ``best_of`` and
        ``response_format`` among them)."""
        options = fields.check_completion_request(body, entry.engines)
        check_engine_refusals(body, entry.engines, self.name)
        return options

    def count_now(self, counter: PromptCounter, body: dict[str, Any], options: ChatOptions) -> CountedPrompt:
        pc = counter.count_prompt(body["prompt"])
        return _with_suffix(pc, suffix_tokens(counter, body))

    async def acount(self, counter: PromptCounter, body: dict[str, Any], options: ChatOptions) -> CountedPrompt:
        pc = await counter.acount_prompt(body["prompt"])
        return _with_suffix(pc, suffix_tokens(counter, body))

    def prompt_text(self, body: dict[str, Any]) -> str:
        """The string prompts, then the ``suffix`` (rendered after each prompt), joined by
        newlines; token-id prompts contribute nothing (the verifier decodes them)."""
        p = body.get("prompt")
        out: list[str] = []
        if isinstance(p, str):
            out.append(p)
        elif isinstance(p, list) and p and isinstance(p[0], str):  # validated: a list of strings, or of ids
            out.extend(p)
        suffix = body.get("suffix")
        if isinstance(suffix, str) and suffix:
            out.append(suffix)
        return "\n".join(out)

    def verifier_prompts(self, body: dict[str, Any]) -> tuple[list[list[int]], list[str]]:
        """The token-id prompts (the verifier decodes them) and the string prompts (an echo repeats them)."""
        ids: list[list[int]] = []
        texts: list[str] = []
        for p in split_completion_prompt(body["prompt"]):  # validated: no error here
            if isinstance(p, str):
                texts.append(p)
            else:
                ids.append(p)
        return ids, texts


COMPLETIONS = CompletionsRoute()
