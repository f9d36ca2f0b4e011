"""``POST /v1/embeddings`` as a route value (:data:`EMBEDDINGS`): each input
(:mod:`tokenizer.embeddings`) must be ``<= limit`` (no completion) and all of them together
``<= pool limit``; at most the tenant's ``max_embedding_inputs`` inputs; TPM reserves their
total. Embeddings have no output text to verify: their inputs are not indexed.
"""

from __future__ import annotations

from typing import Any

import orjson

from config.errors import ErrorCode, OpenAIError
from config.models import TenantConfig
from gateway.admission.checks import INT64_MAX, check_fields, drop_nulls
from gateway.admission.engine_refusals import check_embedding_dimensions
from gateway.admission.gate import Admission, CompletionBound, CountedPrompt, effective_limit, refuse_empty_prompts
from gateway.admission.registry import ModelEntry
from gateway.admission.value_checks import Check, anything, int_in, one_of, string
from gateway.relay.stream_protocol import StreamProtocol
from gateway.relay.whole_answer import read_choices_answer
from tokenizer import TokenizerError
from tokenizer.embeddings import acount_embedding_input
from verifier.engine_response import EngineOutput

#: ``POST /v1/embeddings`` (OpenAI ``EmbeddingCreateParams``). vLLM's prompt-changing extensions
#: (``truncate_prompt_tokens``, ``add_special_tokens``) are refused.
EMBEDDINGS_FIELDS: dict[str, Check] = {
    "model": string,
    "input": anything,  # shape: validated while counting (tokenizer.embeddings)
    "encoding_format": one_of("float", "base64"),
    "dimensions": int_in(1, INT64_MAX),
    "user": string,
}


def embedding_length_message(limit: int, tokens: int) -> str:
    """vLLM's wording for an embedding input above the model's length (``serving_engine.py``)."""
    return (
        f"This model's maximum context length is {limit} tokens. However, you requested {tokens} tokens in the "
        "input for embedding generation. Please reduce the length of the input."
    )


def batch_over_pool(tokens: int, inputs: int, pool_limit: int, *, at_least: bool = False) -> OpenAIError:
    """The 400 (``param`` ``input``) for an embeddings batch of ``inputs`` inputs holding
    ``tokens`` tokens in all (``at_least``: a lower bound, before counting) over ``pool_limit``."""
    return OpenAIError(
        400,
        f"This request needs {'at least ' if at_least else ''}{tokens} tokens of KV cache ({inputs} inputs); "
        f"the engines serving this model hold at most {pool_limit} for one request. Send fewer or shorter inputs.",
        code=ErrorCode.INVALID_REQUEST,
        param="input",
    )


def _batch_lower_bound(entry: ModelEntry, value: list[Any]) -> int:
    """A lower bound of a batch's tokens without counting: each token-id list's length, each
    string's characters over the counter's ``max_token_chars``."""
    per = entry.counter.max_token_chars
    return sum(len(p) if isinstance(p, list) else len(p) // per if isinstance(p, str) and per else 0 for p in value)


async def count_embeddings(
    entry: ModelEntry, tenant: TenantConfig, body: dict[str, Any], pool_limit: int | None = None
) -> CountedPrompt:
    """Tokens of each input (``per_prompt``). Raises :class:`OpenAIError` 400: more inputs than the tenant's
    ``max_embedding_inputs`` (``param`` ``input``; checked before anything is counted), a batch
    certainly over ``pool_limit`` (the live pool limit, when known: :func:`batch_over_pool`, before
    any id is checked or text counted), a bad shape or token id (``input`` / ``input[i]``)."""
    value = body.get("input")
    cap = tenant.max_embedding_inputs
    if isinstance(value, list) and value and not isinstance(value[0], int):  # a batch
        if len(value) > cap:
            raise OpenAIError(
                400,
                f"'input' holds {len(value)} inputs, above this key's cap of {cap} inputs per request.",
                code=ErrorCode.INVALID_REQUEST,
                param="input",
            )
        if pool_limit is not None and (lower := _batch_lower_bound(entry, value)) > pool_limit:
            raise batch_over_pool(lower, len(value), pool_limit, at_least=True)
    try:
        pc = await acount_embedding_input(entry.counter, value)
    except TokenizerError as e:
        raise e.to_openai() from None
    return CountedPrompt(pc.largest, pc.total, len(pc.per_prompt), per_prompt=pc.per_prompt)


def embeddings_text(body: dict[str, Any]) -> str:
    """The string inputs joined by newlines (the verifier's view of the request's own text)."""
    v = body.get("input")
    if isinstance(v, str):
        return v
    return "\n".join(x for x in v if isinstance(x, str)) if isinstance(v, list) else ""


def decide_embeddings(
    entry: ModelEntry, tenant: TenantConfig, body: dict[str, Any], counts: CountedPrompt, pool_limit: int
) -> Admission:
    """No input empty (:func:`~gateway.admission.gate.refuse_empty_prompts`), each ``<= limit``
    (the first one above it is named: ``input`` or ``input[i]``: 400
    ``context_length_exceeded``) and the inputs' total ``<= pool_limit`` (400 naming ``input``);
    the reservation is the total, with no completion. Raises :class:`OpenAIError`."""
    limit = effective_limit(entry, tenant, pool_limit)
    value = body.get("input")
    single = len(counts.per_prompt) == 1 and not (
        isinstance(value, list) and value and isinstance(value[0], (str, list))
    )
    refuse_empty_prompts(counts.per_prompt, "input", single)
    for i, c in enumerate(counts.per_prompt):
        if c > limit:
            raise OpenAIError(
                400,
                embedding_length_message(limit, c),
                code=ErrorCode.CONTEXT_LENGTH_EXCEEDED,
                param="input" if single else f"input[{i}]",
                prompt_tokens=counts.total,
            )
    n = len(counts.per_prompt)
    if counts.total > pool_limit:  # the engine holds the whole batch's KV at once, as a completion's
        raise batch_over_pool(counts.total, n, pool_limit)
    prompt = CountedPrompt(counts.largest, counts.total, n, embeddings_text(body), counts.per_prompt)
    return Admission(entry, prompt, CompletionBound(0, False, "max_tokens"), limit, 1, n, counts.total)


class EmbeddingsRoute:
    """Embeddings (OpenAI ``EmbeddingCreateParams``)."""

    name = "embeddings"
    path = "/v1/embeddings"
    upstream_path = "/embeddings"
    tasks: tuple[str, ...] = ("embedding",)
    id_fields: tuple[str, ...] = ("prompt", "input")
    fields = EMBEDDINGS_FIELDS
    stream_protocol: StreamProtocol | None = None  # never streamed
    streams = False
    adds_usage = False
    verified = False

    def validate(self, body: dict[str, Any]) -> None:
        check_fields(body, self.fields, ("input",))

    async def count(
        self, entry: ModelEntry, tenant: TenantConfig, body: dict[str, Any], served: list[Any], live: int | None
    ) -> CountedPrompt:
        """``dimensions`` as the model's ``matryoshka`` setting allows
        (:func:`~gateway.admission.engine_refusals.check_embedding_dimensions`), then the inputs
        counted (:func:`count_embeddings`; a batch certainly over ``live`` is refused uncounted)."""
        check_embedding_dimensions(body, entry.engines, entry.config.matryoshka)
        return await count_embeddings(entry, tenant, body, live)

    def decide(
        self, entry: ModelEntry, tenant: TenantConfig, body: dict[str, Any], prompt: CountedPrompt, pool_limit: int
    ) -> Admission:
        return decide_embeddings(entry, tenant, body, prompt, pool_limit)

    def forward_body(self, body: dict[str, Any], adm: Admission, cache_salt: str, served: list[Any]) -> bytes:
        """``model`` becomes the ``upstream_model``; any client ``cache_salt`` and every field
        sent as ``null`` (:func:`~gateway.admission.checks.drop_nulls`: vLLM refuses a ``null``
        ``encoding_format``) are left out."""
        drop_nulls(body)
        body["model"] = adm.model.upstream_model
        body.pop("cache_salt", None)
        return orjson.dumps(body)

    def verifier_prompts(self, body: dict[str, Any]) -> tuple[list[list[int]], list[str]]:
        return [], []

    def whole_answer(self, data: Any) -> EngineOutput:
        return read_choices_answer(data)


EMBEDDINGS = EmbeddingsRoute()
