"""``POST /v1/completions`` as a route value (:data:`COMPLETIONS`): its field table, how its
prompts are counted (a string, strings, token ids or id lists: :mod:`tokenizer.base`; a
``suffix`` added to each), the batch refused before counting, the values the engines serving the
model would refuse after admission (:func:`check_engine_refusals`), and what the verifier reads of
it (token-id prompts, the texts an echo repeats)."""

from __future__ import annotations

from typing import Any

from config.errors import ErrorCode, OpenAIError, context_length_message
from gateway.admission import fields
from gateway.admission.checks import COMPLETION_FIELDS, bad_value, check_fields, check_stream_options
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


#: SGLang reads a temperature below this as greedy and sets ``top_k`` to 1 before ``verify``
#: (``python/sglang/srt/sampling/sampling_params.py`` ``_SAMPLING_EPS``, ``__post_init__``)
SGLANG_GREEDY_BELOW = 1e-6

#: The bundled backend's ``/v1/completions`` (``gpu_backend/openai_api.py``: ``_UNSUPPORTED``,
#: ``_check_unsupported``, ``_prompt_ids``): an OpenAI field -> the values it takes (any other is
#: its 400 "'<field>' is not supported by this backend."; ``n``: "Only 'n' = 1 is supported").
BUNDLED_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "n": (1,),
    "best_of": (1,),
    "echo": (False,),
    "logprobs": (0,),
    "logit_bias": ({},),
    "frequency_penalty": (0,),
    "presence_penalty": (0,),
}


def _refused(param: str, message: str) -> OpenAIError:
    return OpenAIError(400, message, code=ErrorCode.INVALID_REQUEST, param=param)


def check_engine_refusals(body: dict[str, Any], engines: frozenset[str]) -> None:
    """Refuse (400 naming the field) the values an engine serving the model refuses only after
    kvgate admitted the request, so that its 400 came after the prompt had been charged
    (``gateway/relay/finish.py``: an engine's error is settled at the prompt x its sequences).
    Every engine in ``engines`` may get the request, so each one's refusals apply; ``openai``
    upstreams are left to OpenAI.

    - ``top_p`` 0: vLLM ``vllm/sampling_params.py`` ``SamplingParams._verify_args`` ("top_p must be
      in (0, 1]", checked before the greedy reset), SGLang ``python/sglang/srt/sampling/
      sampling_params.py`` ``SamplingParams.verify`` (the same words), the bundled backend's
      ``_sampling`` (``_num(..., lo_open=True)``);
    - ``top_k`` 0 on SGLang (``verify``: "top_k must be -1 (disable) or at least 1"), unless the
      temperature is below :data:`SGLANG_GREEDY_BELOW` (SGLang then sets ``top_k`` 1 first);
      vLLM reads 0 as off;
    - ``n`` > 1 with ``temperature`` 0 on vLLM (``SamplingParams._verify_greedy_sampling``: "n
      must be 1 when using greedy sampling"; a temperature in (0, 0.01) is raised to 0.01 first,
      so only 0 is greedy);
    - on the bundled backend (``kvgate``): more than one prompt ("Batched prompts are not
      supported by this backend"), and the fields of :data:`BUNDLED_NEUTRAL` at any other value."""
    if not engines or engines <= {"openai"}:
        return
    top_p = body.get("top_p")
    if top_p is not None and top_p <= 0:
        raise bad_value("top_p", "must be > 0 and <= 1 (the engines serving this model refuse 0)")
    temperature = body.get("temperature")
    if "sglang" in engines and body.get("top_k") == 0:
        if temperature is None or temperature >= SGLANG_GREEDY_BELOW:
            raise bad_value("top_k", "must be -1 (off) or at least 1 for the engines serving this model (SGLang)")
    if "vllm" in engines and temperature == 0 and (body.get("n") or 1) > 1:
        raise bad_value("n", "must be 1 when 'temperature' is 0 (greedy sampling) for the engines serving this model")
    if "kvgate" in engines:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) > 1 and isinstance(prompt[0], (str, list)):  # a batch
            raise _refused(
                "prompt",
                f"'prompt' holds {len(prompt)} prompts; the engines serving this model take one prompt per request.",
            )
        for key, neutral in BUNDLED_NEUTRAL.items():
            value = body.get(key)
            if value is not None and value not in neutral:  # validated: no bool poses as a number here
                raise _refused(key, f"'{key}' is not supported by the engines serving this model.")


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
        if body.get("best_of") is not None and body.get("n") is not None and body["best_of"] < body["n"]:
            raise bad_value("best_of", "must be >= 'n'")
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
        then the values they would refuse after admission (:func:`check_engine_refusals`)."""
        options = fields.check_completion_request(body, entry.engines)
        check_engine_refusals(body, entry.engines)
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
