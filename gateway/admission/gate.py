"""Steps 4 and 5: how many prompt tokens, how many completion tokens, and whether they fit
(docs/design.md, "A request's way through the gateway", "Contracts": max_tokens). The rules are
the same for chat, completions and Responses; what differs per route (which fields carry the
bound, which field a too-long prompt is named by, how a prompt is counted) is the route's
(:class:`BoundRoute`, :class:`PromptRoute`; the routes themselves live in :mod:`gateway.routes`).

- Completion bound: one value per request (the route's ``bound_fields``: chat
  ``max_completion_tokens`` over ``max_tokens``; 0 is refused at validation); above the tenant's
  ``max_tokens_cap``: 400 with ``param`` naming the field. Absent: ``min(default_max_tokens,
  limit - prompt_tokens, cap, what the KV demand leaves)``. Either way the bound is forwarded
  explicitly, under one field.
- Sequences: prompts x max(n, best_of) <= tenant ``max_sequences_per_request``.
- Gate: ``prompt_tokens + bound <= limit`` with
  ``limit = min(context_length, live pool limit, tenant max_context_tokens)``; above it 400
  ``context_length_exceeded`` in OpenAI's wording (the route's ``length_message``).
- KV demand (the whole request): ``max(n, best_of) x sum over prompts of (prompt + bound) <= live
  pool limit``; the quotas reserve exactly that number.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

from config.errors import ErrorCode, OpenAIError
from config.models import TenantConfig
from gateway.admission import fields
from gateway.admission.checks import drop_nulls
from gateway.admission.registry import ModelEntry
from tokenizer import PromptCounter, TokenizerError
from tokenizer.base import charge_loop, on_loop
from tokenizer.chat import ChatOptions


@dataclass(frozen=True, slots=True)
class CountedPrompt:
    """A request's prompts as counted, in tokens, on every route: ``largest`` (what the gate
    checks), ``total`` (every prompt of a batch), ``num_prompts``; ``per_prompt``: each prompt's
    tokens where the gate checks them one by one (completions: none may be empty; embeddings:
    each against the limit too), else empty; ``text``: the prompt's
    text for the verifier (never logged), ``None`` until it is gathered (a heavy request gathers
    it off the event loop with the count; :func:`decide` gathers it otherwise)."""

    largest: int
    total: int
    num_prompts: int
    text: str | None = None
    per_prompt: tuple[int, ...] = ()


@dataclass(frozen=True)
class CompletionBound:
    """The one completion bound: ``max_tokens`` per completion (tokens); ``defaulted``: the client
    sent none, so the gateway chose it (it is forwarded either way); ``field``: the field it is
    forwarded under (:func:`gateway.admission.fields.bound_field`; every other alias is dropped)."""

    max_tokens: int
    defaulted: bool
    field: str = "max_tokens"


@dataclass
class Admission:
    """What admission decided. Token numbers in tokens.

    ``prompt``: the counted prompts; ``bound``: the completion bound; ``limit``: the effective
    limit the gate applied; ``n``: completions per prompt; ``sequences``: prompts x max(n,
    best_of); ``reserve_tokens``: the whole request's KV demand, max(n, best_of) x (prompt total +
    prompts x max_tokens), also what the quotas reserve. The properties name the parts the request
    path reads most."""

    model: ModelEntry
    prompt: CountedPrompt
    bound: CompletionBound
    limit: int
    n: int
    sequences: int
    reserve_tokens: int

    @property
    def prompt_tokens(self) -> int:
        """The largest prompt's tokens (what the gate checks, and the verifier's length)."""
        return self.prompt.largest

    @property
    def prompt_tokens_total(self) -> int:
        return self.prompt.total

    @property
    def num_prompts(self) -> int:
        return self.prompt.num_prompts

    @property
    def prompt_text(self) -> str:
        return self.prompt.text or ""

    @property
    def max_tokens(self) -> int:
        return self.bound.max_tokens

    @property
    def defaulted(self) -> bool:
        return self.bound.defaulted

    @property
    def bound_field(self) -> str:
        return self.bound.field


class BoundRoute(Protocol):
    """What :func:`decide` reads from a route whose request has a completion bound (chat,
    completions, Responses): ``bound_fields``, the fields that carry the bound in precedence
    order (the first present wins); ``prompt_param``, the field a too-long prompt's 400 names."""

    name: str
    bound_fields: tuple[str, ...]
    prompt_param: str

    def forwarded_bound(self, engines: frozenset[str]) -> str:
        """The one field the bound is forwarded under to ``engines``."""
        ...

    def length_message(self, limit: int, largest: int, max_tokens: int) -> str:
        """The ``context_length_exceeded`` message for ``largest + max_tokens > limit``."""
        ...

    def prompt_text(self, body: dict[str, Any]) -> str:
        """The request's prompt text, for the verifier (token-id prompts contribute nothing)."""
        ...


class PromptRoute(BoundRoute, Protocol):
    """What :func:`count_prompt` reads from a route that counts a prompt (chat, completions)."""

    def check_batch(self, body: dict[str, Any], max_sequences: int) -> None:
        """Refuse (400) a batch over ``max_sequences`` before anything is counted."""
        ...

    def cost(self, body: dict[str, Any], limit: int) -> int:
        """What counting ``body`` costs, in characters; stops early past ``limit``."""
        ...

    def longest_text_chars(self, body: dict[str, Any]) -> int:
        """Characters of the request's longest prompt text (validated bodies only)."""
        ...

    def check_fields(self, body: dict[str, Any], entry: ModelEntry) -> ChatOptions:
        """The engines' field policy (:mod:`gateway.admission.fields`); the options to count with."""
        ...

    def count_now(self, counter: PromptCounter, body: dict[str, Any], options: ChatOptions) -> CountedPrompt:
        """The prompt's tokens, counted synchronously. Raises ``TokenizerError``, ``OpenAIError``."""
        ...

    async def acount(self, counter: PromptCounter, body: dict[str, Any], options: ChatOptions) -> CountedPrompt:
        """The prompt's tokens (the counter offloads long texts). Raises as :meth:`count_now`."""
        ...


def sequences_error(num: int, seqs: int, cap: int, body: dict[str, Any]) -> OpenAIError:
    """The 400 for ``num`` prompts x ``seqs`` sequences above the tenant's ``cap``
    (``max_sequences_per_request``); ``param`` names the prompt, ``n`` or ``best_of``."""
    return OpenAIError(
        400,
        f"This request asks for {num} prompt(s) x {seqs} sequence(s) each = {num * seqs} sequences; "
        f"this key allows at most {cap} per request.",
        code=ErrorCode.INVALID_REQUEST,
        param="prompt" if num > cap else _sequence_param(body),
    )


def too_long_to_count(entry: ModelEntry, body: dict[str, Any], route: PromptRoute, limit: int | None = None) -> None:
    """Refuse, without counting it, a prompt whose text alone is certainly longer than the
    model's ``context_length``: no token covers more than the counter's ``max_token_chars``
    characters, so ``chars // max_token_chars`` is a lower bound of its tokens (the template,
    special tokens and images only add to it). An 8 MB prompt took the SmolLM2 tokenizer 7 s
    of CPU to count before its 400; now a length. ``limit``: the request's effective limit
    (:func:`effective_limit`, the number the gate's own 400 quotes); ``None``: the model's
    ``context_length``. Raises :class:`OpenAIError` 400 ``context_length_exceeded`` ("at least
    N tokens")."""
    per = entry.counter.max_token_chars
    if not per:
        return
    at_least = route.longest_text_chars(body) // per
    limit = entry.config.context_length if limit is None else limit
    if at_least > limit:
        raise over_context_error(limit, at_least, route.prompt_param)


def nested_too_deeply() -> OpenAIError:
    """The 400 for a body the gateway cannot write back to forward: orjson writes 254 levels of
    nesting at most (it reads 1,024)."""
    return OpenAIError(400, "The request body is nested too deeply to forward.", code=ErrorCode.INVALID_REQUEST)


def over_context_error(limit: int, at_least: int, where: str) -> OpenAIError:
    """The 400 ``context_length_exceeded`` for a prompt refused before it is counted: ``limit``
    the limit the gate quotes (:func:`effective_limit`), ``at_least`` a lower bound of its tokens, ``where`` the
    field (``messages``, ``prompt``, ``input``; also its ``param``)."""
    return OpenAIError(
        400,
        f"This model's maximum context length is {limit} tokens. However, you requested at least "
        f"{at_least} tokens in the {where} alone (counting stopped there). Please reduce the length "
        f"of the {where}.",
        code=ErrorCode.CONTEXT_LENGTH_EXCEEDED,
        param=where,
        prompt_tokens=at_least,
    )


def _count_now(entry: ModelEntry, body: dict[str, Any], route: PromptRoute, limit: int | None = None) -> CountedPrompt:
    """:func:`count_prompt`'s work done synchronously (in a worker thread), prompt text included;
    a prompt too long for the model is refused first without counting (:func:`too_long_to_count`)."""
    options = route.check_fields(body, entry)
    too_long_to_count(entry, body, route, limit)
    try:
        counted = route.count_now(entry.counter, body, options)
    except TokenizerError as e:
        raise e.to_openai() from None
    return CountedPrompt(
        counted.largest, counted.total, counted.num_prompts, route.prompt_text(body), counted.per_prompt
    )


async def count_prompt(
    entry: ModelEntry,
    body: dict[str, Any],
    route: PromptRoute,
    *,
    max_sequences: int | None = None,
    limit: int | None = None,
) -> CountedPrompt:
    """The request's prompt tokens, as the engines serving ``entry`` will build the prompt: the
    engines' field policy is applied first (the route's ``check_fields``: fields they do not
    accept refused, prompt-changing fields turned into :class:`~tokenizer.chat.ChatOptions`).
    Raises :class:`OpenAIError` 400 for refused fields and invalid messages/prompt/token ids
    (``param`` names the field).

    ``max_sequences`` (the tenant's ``max_sequences_per_request``): a batch of more prompts x
    sequences is refused before anything is counted (:func:`sequences_error`, the answer
    :func:`decide` would give). A request whose counting costs more than the counter's
    ``offload_chars`` (the route's ``cost``) is checked and counted in a worker thread, its prompt
    text gathered there too, so no request holds the event loop for long; there a prompt whose
    text alone is over ``limit`` (the effective limit, :func:`too_long_to_count`) is refused first."""
    if max_sequences is not None:
        route.check_batch(body, max_sequences)
    counter = entry.counter
    start = on_loop(route.cost(body, counter.offload_chars), counter.offload_chars)
    if start is None and counter.counts_sync:
        return await asyncio.to_thread(_count_now, entry, body, route, limit)
    if start is None:
        options = await asyncio.to_thread(route.check_fields, body, entry)
    else:
        try:  # on the event loop, charged to the tenant's share of it (never across an await)
            options = route.check_fields(body, entry)
            if counter.counts_sync:  # what ``acount`` would do, without weighing the cost again
                try:
                    return route.count_now(counter, body, options)
                except TokenizerError as e:
                    raise e.to_openai() from None
        finally:
            charge_loop(start)
    try:
        return await route.acount(counter, body, options)
    except TokenizerError as e:
        raise e.to_openai() from None


def requested_max_tokens(body: dict[str, Any], route: BoundRoute) -> tuple[int | None, str]:
    """``(value, field)``: the first of the route's ``bound_fields`` present in ``body`` (chat:
    ``max_completion_tokens`` over ``max_tokens``); ``(None, last alias)`` when none is.
    Validation has already refused 0 and non-integers."""
    aliases = route.bound_fields
    for name in aliases:
        v = body.get(name)
        if v is not None:
            return v, name
    return None, aliases[-1]


def sequences_of(body: dict[str, Any]) -> int:
    """Sequences one prompt of ``body`` generates: ``max(n, best_of)`` (absent: 1)."""
    return max(body.get("n") or 1, body.get("best_of") or 1)


def effective_limit(entry: ModelEntry, tenant: TenantConfig, pool_limit: int) -> int:
    """``min(model context_length, pool_limit, tenant max_context_tokens)`` in tokens."""
    limit = min(entry.config.context_length, pool_limit)
    if tenant.max_context_tokens is not None:
        limit = min(limit, tenant.max_context_tokens)
    return limit


def _sequence_param(body: dict[str, Any]) -> str:
    n = body.get("n") or 1
    return "best_of" if (body.get("best_of") or 1) > n else "n"


def completion_bound(tenant: TenantConfig, body: dict[str, Any], route: BoundRoute, room: int) -> tuple[int, bool]:
    """``(max_tokens, defaulted)``: the requested bound (:func:`requested_max_tokens`), refused
    above the tenant's ``max_tokens_cap`` (400 naming its field); absent, ``min(default_max_tokens,
    cap, room)`` (``room``: what the limit and the KV demand leave one completion), at least 1."""
    requested, field = requested_max_tokens(body, route)
    cap = tenant.max_tokens_cap
    if requested is not None:
        if cap is not None and requested > cap:
            raise OpenAIError(
                400,
                f"'{field}' is {requested}, above this key's cap of {cap} tokens.",
                code=ErrorCode.INVALID_REQUEST,
                param=field,
            )
        return requested, False
    max_tokens = min(tenant.default_max_tokens, room)
    if cap is not None:
        max_tokens = min(max_tokens, cap)
    return max(max_tokens, 1), True  # below 1 nothing fits: the gates say which


def refuse_empty_prompts(per_prompt: tuple[int, ...], param: str, single: bool) -> None:
    """Refuse a request whose prompt (one of ``per_prompt``, tokens as the engine encodes each)
    holds no token: vLLM refuses an empty prompt for generation and pooling alike
    (``vllm/v1/engine/input_processor.py``, ``InputProcessor._validate_prompt_len``: "The decoder
    prompt cannot be empty"), the bundled engine too (docs/backend.md), and OpenAI's embeddings
    ``input`` "cannot be an empty string"; admitted, it was the engine's 400 after the request
    was charged. A string the tokenizer gives a BOS is not empty (the engine sees that token).
    Raises :class:`OpenAIError` 400 naming ``param`` (``single``) or ``param[i]``, the first."""
    for i, c in enumerate(per_prompt):
        if c == 0:
            where = param if single else f"{param}[{i}]"
            raise OpenAIError(
                400,
                f"Invalid value for '{where}': the prompt is empty (0 tokens); engines refuse an empty prompt.",
                code=ErrorCode.INVALID_REQUEST,
                param=where,
            )


def decide(
    entry: ModelEntry,
    tenant: TenantConfig,
    body: dict[str, Any],
    route: BoundRoute,
    prompt: CountedPrompt,
    pool_limit: int,
) -> Admission:
    """Apply the completion-bound rule and the gates to a counted request of any route with a
    completion (docs/gateway.md, "The gate's invariant"):

    - bound: :func:`completion_bound`, always an explicit value >= 1, forwarded under one field;
    - no empty prompt (each of ``per_prompt`` at least one token) unless every engine is
      ``openai`` (:func:`refuse_empty_prompts`);
    - sequences: prompts x max(n, best_of) <= ``max_sequences_per_request`` (400 naming
      ``prompt``, ``n`` or ``best_of``);
    - context gate: ``largest + bound <= limit`` (400 ``context_length_exceeded``);
    - KV demand: ``max(n, best_of) x (total + prompts x bound) <= pool_limit`` (400 naming ``n``,
      ``best_of`` or the prompt); the same number is what the quotas reserve.

    Raises :class:`OpenAIError` 400."""
    largest, total, num = prompt.largest, prompt.total, prompt.num_prompts
    if prompt.per_prompt and not (entry.engines and entry.engines <= {"openai"}):  # OpenAI completes an empty prompt
        p = body.get(route.prompt_param)
        refuse_empty_prompts(
            prompt.per_prompt, route.prompt_param, not (isinstance(p, list) and p and isinstance(p[0], (str, list)))
        )
    limit = effective_limit(entry, tenant, pool_limit)
    seqs = sequences_of(body)
    cap_seqs = tenant.max_sequences_per_request
    if num * seqs > cap_seqs:
        raise sequences_error(num, seqs, cap_seqs, body)
    room = min(limit - largest, (pool_limit // seqs - total) // num)
    max_tokens, defaulted = completion_bound(tenant, body, route, room)
    if largest + max_tokens > limit:
        raise OpenAIError(
            400,
            route.length_message(limit, largest, max_tokens),
            code=ErrorCode.CONTEXT_LENGTH_EXCEEDED,
            param=route.prompt_param,
            prompt_tokens=total,
        )
    fields.check_bounded(body, max_tokens, entry.counter.vocab_size)
    demand = seqs * (total + num * max_tokens)
    if demand > pool_limit:
        raise OpenAIError(
            400,
            f"This request needs {demand} tokens of KV cache ({seqs} sequence(s) x ({total} prompt tokens + "
            f"{num} x {max_tokens} completion tokens)); the engines serving this model hold at most "
            f"{pool_limit} for one request. Reduce 'n', the batch or the completion.",
            code=ErrorCode.INVALID_REQUEST,
            param=_sequence_param(body) if seqs > 1 else route.prompt_param,
        )
    if prompt.text is None:
        prompt = CountedPrompt(largest, total, num, route.prompt_text(body), prompt.per_prompt)
    bound = CompletionBound(max_tokens, defaulted, route.forwarded_bound(entry.engines))
    return Admission(entry, prompt, bound, limit, body.get("n") or 1, num * seqs, demand)


def client_wants_usage(body: dict[str, Any]) -> bool:
    """Whether a stream request asked for the usage chunk itself (``stream_options.include_usage``)."""
    so = body.get("stream_options")
    return bool(body.get("stream") and isinstance(so, dict) and so.get("include_usage"))


#: top-level fields forwarded even when ``null`` (:func:`upstream_body` drops every other ``null``):
#: vLLM 0.34.0 reads ``tool_choice: null`` as "tools in the prompt, no tool call parsed"
#: (``vllm/entrypoints/openai/chat_completion/message_assembly.py:94``) and takes it on every
#: server, while an absent one with ``tools`` becomes ``auto`` (``chat_completion/protocol.py:992-993``),
#: which a server started without a tool parser refuses (``vllm/renderers/online_renderer.py:272-281``);
#: SGLang reads ``null`` as absent (``protocol.py:1075-1085``), the bundled backend takes it
#: (``gpu_backend/openai_api.py`` ``_UNSUPPORTED``). The prompt is the same either way.
KEPT_NULLS = frozenset({"tool_choice"})


def upstream_body(body: dict[str, Any], adm: Admission, cache_salt: str) -> bytes:
    """The body to forward for chat and completions, as JSON bytes; ``body`` is changed in
    place. A top-level ``null`` is left out, as the Responses route does
    (:func:`gateway.admission.checks.drop_nulls`; but :data:`KEPT_NULLS`): validation and the gate
    read ``null`` as absent (OpenAI's meaning: the default; ``max_tokens: null`` is gated and
    reserved as the default bound), and SGLang 0.5.23's request models refuse it for their fields
    that are no ``Optional`` (``python/sglang/srt/entrypoints/openai/protocol.py``
    ``CompletionRequest`` ``:374-408``, ``ChatCompletionRequest`` ``:924-1018``: ``n``, ``stream``,
    ``echo``, chat ``logprobs``, completions ``temperature`` / ``top_p``, the penalties,
    ``ignore_eos``, ``min_tokens``, ...), vLLM 0.34.0's for completions ``n`` and, on both routes,
    ``ignore_eos``, ``min_tokens``, ``spaces_between_special_tokens``, chat ``add_generation_prompt`` and
    ``continue_final_message`` (``vllm/entrypoints/openai/completion/protocol.py:65,85-88``,
    ``chat_completion/protocol.py:296-299,334,342``):
    each was the engine's 400 after the prompt had been charged. ``model`` becomes the model's
    ``upstream_model``; ``cache_salt`` the tenant's (any client salt is dropped); the completion
    bound the gate checked goes under the one field the engines read (``adm.bound_field``), every
    other alias removed (:func:`gateway.admission.fields.set_bound`); a stream that did not ask
    for usage gets ``stream_options.include_usage: true`` (the quota settle needs it)."""
    drop_nulls(body, keep=KEPT_NULLS)
    body["model"] = adm.model.upstream_model
    body["cache_salt"] = cache_salt
    fields.set_bound(body, adm.bound_field, adm.max_tokens)
    if body.get("stream") and not client_wants_usage(body):
        body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
    return orjson.dumps(body)
