"""Steps 4 and 5 (and the model resolution of step 6's note): which model, how many prompt
tokens, how many completion tokens, and whether they fit (docs/design.md, "A request's way through the
gateway", "Contracts": max_tokens).

- Model: the request's ``model`` (an id or an alias); absent, the tenant's only model. A model
  the tenant may not use, or that does not exist, is 404 ``model_not_found``.
- Completion bound: one value per request (:data:`BOUND_FIELDS`: chat ``max_completion_tokens``
  over ``max_tokens``; 0 is refused at validation); above the tenant's ``max_tokens_cap``: 400
  with ``param`` naming the field. Absent: ``min(default_max_tokens, limit - prompt_tokens, cap,
  what the KV demand leaves)``. Either way the bound is forwarded explicitly, under one field.
- Sequences: prompts x max(n, best_of) <= tenant ``max_sequences_per_request``.
- Gate: ``prompt_tokens + bound <= limit`` with
  ``limit = min(context_length, live pool limit, tenant max_context_tokens)``; above it 400
  ``context_length_exceeded`` in OpenAI's wording (``config.errors.context_length_message``).
- KV demand (the whole request): ``max(n, best_of) x sum over prompts of (prompt + bound) <= live
  pool limit``; the quotas reserve exactly that number.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import orjson

from config.errors import ErrorCode, OpenAIError, context_length_message
from config.models import ModelConfig, Settings, TenantConfig
from gateway.admission import fields
from tokenizer import PromptCounter, TokenizerError, make_counter
from tokenizer.base import prompt_cost
from tokenizer.chat import chat_cost
from tokenizer.images import ImageCoster


@dataclass
class ModelEntry:
    """A served model: its config, its counter and the engines (upstream ``engine`` values) that
    serve it, which pick the fields passed through (:mod:`gateway.admission.fields`)."""

    config: ModelConfig
    counter: PromptCounter
    engines: frozenset[str] = frozenset()

    @property
    def id(self) -> str:
        return self.config.id

    @property
    def upstream_model(self) -> str:
        return self.config.upstream_model or self.config.id


def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    try:
        port = parts.port or {"http": 80, "https": 443}.get(scheme)
    except ValueError:
        port = None
    return scheme, (parts.hostname or "").lower(), port


def engine_api_key(settings: Settings, tokenize_url: str | None) -> str | None:
    """The ``api_key`` of the first upstream whose ``api_url`` shares the scheme, host and port of
    ``tokenize_url`` (an engine tokenizer's base URL), else ``None``. ``tokenizer.api_key``, when
    set, wins over it (:func:`tokenizer.make_counter`)."""
    if not tokenize_url:
        return None
    want = _origin(tokenize_url)
    for u in settings.upstreams:
        if u.api_key is not None and _origin(u.api_url) == want:
            return u.api_key.get_secret_value() or None
    return None


class ModelIndex:
    """Name (id or alias) -> :class:`ModelEntry`, built once per app from settings."""

    def __init__(self, settings: Settings, offload_chars: int | None = None) -> None:
        self.by_name: dict[str, ModelEntry] = {}
        self.entries: list[ModelEntry] = []
        engines: dict[str, set[str]] = {}
        for u in settings.upstreams:
            for n in u.models:
                served = settings.model_by_name(n)
                if served is not None and u.engine is not None:
                    engines.setdefault(served.id, set()).add(u.engine)
        for m in settings.models:
            counter = make_counter(m.tokenizer, m.upstream_model or m.id, engine_api_key(settings, m.tokenizer.url))
            if offload_chars is not None:
                counter.offload_chars = offload_chars
            counter.engines = frozenset(engines.get(m.id, ()))  # chats counted as these engines render them
            if m.images.cost != "fixed":
                counter.image_cost = ImageCoster(m.images, m.tokenizer.image_tokens)
            e = ModelEntry(m, counter, frozenset(engines.get(m.id, ())))
            self.entries.append(e)
            for n in (m.id, *m.aliases):
                self.by_name[n] = e
        self._allowed_cache: dict[tuple[str, ...], tuple[ModelEntry, ...]] = {}

    def allowed(self, tenant: TenantConfig) -> tuple[ModelEntry, ...]:
        """The models ``tenant`` may use (``allowed_models`` names ids or aliases; empty = all)."""
        key = tuple(tenant.allowed_models)
        hit = self._allowed_cache.get(key)
        if hit is None:
            if not key:
                hit = tuple(self.entries)
            else:
                seen: list[ModelEntry] = []
                for n in key:
                    e = self.by_name.get(n)
                    if e is not None and e not in seen:
                        seen.append(e)
                hit = tuple(seen)
            self._allowed_cache[key] = hit
        return hit

    def resolve(self, tenant: TenantConfig, name: str | None) -> ModelEntry:
        """The model ``name`` names for ``tenant``. Raises :class:`OpenAIError` 404
        ``model_not_found`` (unknown or not allowed) or 400 (``model`` missing while the tenant
        has several models)."""
        allowed = self.allowed(tenant)
        if name is None:
            if len(allowed) == 1:
                return allowed[0]
            raise OpenAIError(400, "you must provide a model parameter", code=ErrorCode.INVALID_REQUEST, param="model")
        e = self.by_name.get(name)
        if e is None or e not in allowed:
            raise OpenAIError(
                404,
                f"The model `{name}` does not exist or you do not have access to it.",
                code=ErrorCode.MODEL_NOT_FOUND,
                param="model",
            )
        return e


@dataclass(frozen=True)
class PromptCount:
    """The request's prompts as counted, in tokens: ``largest`` (what the gate checks), ``total``
    (every prompt of a batch), ``num_prompts``; ``text``: the prompt's text for the verifier
    (never logged)."""

    largest: int
    total: int
    num_prompts: int
    text: str


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
    prompt: PromptCount
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
        return self.prompt.text

    @property
    def max_tokens(self) -> int:
        return self.bound.max_tokens

    @property
    def defaulted(self) -> bool:
        return self.bound.defaulted

    @property
    def bound_field(self) -> str:
        return self.bound.field


class PromptTally(tuple):
    """``(largest, total, number_of_prompts)`` prompt tokens, as :func:`count_prompt` returns them;
    ``text``: the prompt's text when it was gathered off the event loop with the count (a heavy
    request), else ``None`` (:func:`decide` gathers it then)."""

    text: str | None

    def __new__(cls, largest: int, total: int, num: int, text: str | None = None) -> PromptTally:
        obj = super().__new__(cls, (largest, total, num))
        obj.text = text
        return obj


def request_cost(body: dict[str, Any], route: str, limit: int) -> int:
    """What counting ``body`` costs, in characters (:func:`tokenizer.chat.chat_cost` /
    :func:`tokenizer.base.prompt_cost`: text plus a weight per message, prompt and token id);
    stops early past ``limit``."""
    if route == "chat":
        return chat_cost(body.get("messages"), body.get("tools"), limit)
    return prompt_cost(body.get("prompt"), limit)


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


def _longest_text_chars(body: dict[str, Any], route: str) -> int:
    """Characters of the request's longest prompt text (chat: every string content and text
    part of every message together; completions: the longest string prompt). Validated bodies only."""
    if route == "chat":
        n = 0
        for m in body.get("messages") or ():
            c = m.get("content") if isinstance(m, dict) else None
            if isinstance(c, str):
                n += len(c)
            elif isinstance(c, list):
                n += sum(len(p["text"]) for p in c if isinstance(p, dict) and isinstance(p.get("text"), str))
        return n
    p = body.get("prompt")
    if isinstance(p, str):
        return len(p)
    if isinstance(p, list) and p and isinstance(p[0], str):
        return max(map(len, p))
    return 0


def too_long_to_count(entry: ModelEntry, body: dict[str, Any], route: str, limit: int | None = None) -> None:
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
    at_least = _longest_text_chars(body, route) // per
    limit = entry.config.context_length if limit is None else limit
    if at_least > limit:
        raise over_context_error(limit, at_least, "messages" if route == "chat" else "prompt")


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


def _count_now(entry: ModelEntry, body: dict[str, Any], route: str, limit: int | None = None) -> PromptTally:
    """:func:`count_prompt`'s work done synchronously (in a worker thread), prompt text included;
    a prompt too long for the model is refused first without counting (:func:`too_long_to_count`)."""
    counter = entry.counter
    options = fields.check_request(body, route, entry.engines, entry.config.images, counter.special_token_texts)
    too_long_to_count(entry, body, route, limit)
    try:
        if route == "chat":
            c = counter.count_chat(body["messages"], body.get("tools"), options)
            return PromptTally(c, c, 1, prompt_text_of(body, route))
        pc = counter.count_prompt(body["prompt"])
        extra = suffix_tokens(counter, body)
    except TokenizerError as e:
        raise e.to_openai() from None
    num = len(pc.per_prompt)
    return PromptTally(pc.largest + extra, pc.total + num * extra, num, prompt_text_of(body, route))


async def count_prompt(
    entry: ModelEntry, body: dict[str, Any], route: str, *, max_sequences: int | None = None, limit: int | None = None
) -> PromptTally:
    """``(largest, total, number_of_prompts)`` prompt tokens of the request, as the engines
    serving ``entry`` will build the prompt: the engines' field policy is applied first
    (:func:`gateway.admission.fields.check_request`: fields they do not accept refused, prompt-changing
    fields turned into :class:`~tokenizer.chat.ChatOptions`). Raises :class:`OpenAIError` 400 for
    refused fields and invalid messages/prompt/token ids (``param`` names the field).

    ``max_sequences`` (the tenant's ``max_sequences_per_request``): a batch of more prompts x
    sequences is refused before anything is counted (:func:`sequences_error`, the answer
    :func:`decide` would give). A request whose counting costs more than the counter's
    ``offload_chars`` (:func:`request_cost`) is checked and counted in a worker thread, its prompt
    text gathered there too, so no request holds the event loop for long; there a prompt whose
    text alone is over ``limit`` (the effective limit, :func:`too_long_to_count`) is refused first."""
    if max_sequences is not None and route == "completions":
        p = body.get("prompt")
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            seqs = sequences_of(body)
            if len(p) * seqs > max_sequences:
                raise sequences_error(len(p), seqs, max_sequences, body)
    counter = entry.counter
    heavy = request_cost(body, route, counter.offload_chars) > counter.offload_chars
    if heavy and counter.counts_sync:
        return await asyncio.to_thread(_count_now, entry, body, route, limit)
    policy = (body, route, entry.engines, entry.config.images, counter.special_token_texts)
    if heavy:
        options = await asyncio.to_thread(fields.check_request, *policy)
    else:
        options = fields.check_request(*policy)
    try:
        if route == "chat":
            c = await counter.acount_chat(body["messages"], body.get("tools"), options)
            return PromptTally(c, c, 1)
        pc = await counter.acount_prompt(body["prompt"])
        extra = suffix_tokens(counter, body)
        num = len(pc.per_prompt)
        return PromptTally(pc.largest + extra, pc.total + num * extra, num)
    except TokenizerError as e:
        raise e.to_openai() from None


def prompt_text_of(body: dict[str, Any], route: str) -> str:
    """The request's prompt text (chat: every text part of every message, joined by newlines;
    completions: the string prompts). Token-id prompts contribute nothing."""
    if route == "chat":
        out = []
        for m in body.get("messages") or ():
            c = m.get("content") if isinstance(m, dict) else None
            if isinstance(c, str):
                out.append(c)
            elif isinstance(c, list):
                out.extend(p.get("text", "") for p in c if isinstance(p, dict) and isinstance(p.get("text"), str))
        return "\n".join(out)
    p = body.get("prompt")
    if isinstance(p, str):
        return p
    if isinstance(p, list) and p and isinstance(p[0], str):  # validated: a list of strings, or of ids
        return "\n".join(p)
    return ""


#: The fields that carry a route's completion bound, in precedence order (the first one present
#: wins; the others are dropped when forwarding). SGLang and vLLM both read
#: ``max_completion_tokens or max_tokens`` (SGLang protocol.py ``to_sampling_params``, vLLM
#: chat_completion/protocol.py ``build_tok_params``), the bundled backend the same.
BOUND_FIELDS: dict[str, tuple[str, ...]] = {
    "chat": ("max_completion_tokens", "max_tokens"),
    "completions": ("max_tokens",),
}


def requested_max_tokens(body: dict[str, Any], route: str) -> tuple[int | None, str]:
    """``(value, field)``: the first of :data:`BOUND_FIELDS` ``[route]`` present in ``body``
    (chat: ``max_completion_tokens`` over ``max_tokens``); ``(None, last alias)`` when none is.
    Validation (:func:`gateway.admission.body.validate`) has already refused 0 and non-integers."""
    aliases = BOUND_FIELDS.get(route, ("max_tokens",))
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


def decide(
    entry: ModelEntry,
    tenant: TenantConfig,
    body: dict[str, Any],
    route: str,
    prompt: tuple[int, int, int],
    pool_limit: int,
) -> Admission:
    """Apply the completion-bound rules and the gates to a counted request (docs/gateway.md,
    "The gate's invariant"). ``prompt``: ``(largest, total, number of prompts)`` in tokens.

    - bound: the requested one (:func:`requested_max_tokens`), refused above the tenant's
      ``max_tokens_cap``; absent, ``min(default_max_tokens, cap, limit - largest prompt, what the
      KV demand leaves)``: always an explicit value >= 1, forwarded under one field;
    - sequences: prompts x max(n, best_of) <= ``max_sequences_per_request`` (400 naming
      ``prompt``, ``n`` or ``best_of``);
    - context gate: ``largest + bound <= limit`` (400 ``context_length_exceeded``);
    - KV demand: ``max(n, best_of) x (total + prompts x bound) <= pool_limit`` (400 naming ``n``,
      ``best_of`` or the prompt); the same number is what the quotas reserve.

    Raises :class:`OpenAIError` 400."""
    largest, total, num = prompt
    limit = effective_limit(entry, tenant, pool_limit)
    seqs = sequences_of(body)
    cap_seqs = tenant.max_sequences_per_request
    if num * seqs > cap_seqs:
        raise sequences_error(num, seqs, cap_seqs, body)
    requested, field = requested_max_tokens(body, route)
    cap = tenant.max_tokens_cap
    chat = route == "chat"
    prompt_param = "messages" if chat else "prompt"
    if requested is not None:
        if cap is not None and requested > cap:
            raise OpenAIError(
                400,
                f"'{field}' is {requested}, above this key's cap of {cap} tokens.",
                code=ErrorCode.INVALID_REQUEST,
                param=field,
            )
        max_tokens = requested
        defaulted = False
    else:
        max_tokens = min(tenant.default_max_tokens, limit - largest, (pool_limit // seqs - total) // num)
        if cap is not None:
            max_tokens = min(max_tokens, cap)
        max_tokens = max(max_tokens, 1)  # below 1 nothing fits: the gates below say which
        defaulted = True
    if largest + max_tokens > limit:
        raise OpenAIError(
            400,
            context_length_message(limit, largest, max_tokens, messages=chat),
            code=ErrorCode.CONTEXT_LENGTH_EXCEEDED,
            param=prompt_param,
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
            param=_sequence_param(body) if seqs > 1 else prompt_param,
        )
    text = getattr(prompt, "text", None)
    return Admission(
        entry,
        PromptCount(largest, total, num, text if text is not None else prompt_text_of(body, route)),
        CompletionBound(max_tokens, defaulted, fields.bound_field(entry.engines, route)),
        limit,
        body.get("n") or 1,
        num * seqs,
        demand,
    )


def client_wants_usage(body: dict[str, Any]) -> bool:
    """Whether a stream request asked for the usage chunk itself (``stream_options.include_usage``)."""
    so = body.get("stream_options")
    return bool(body.get("stream") and isinstance(so, dict) and so.get("include_usage"))


def upstream_body(body: dict[str, Any], adm: Admission, cache_salt: str) -> bytes:
    """The body to forward, as JSON bytes; ``body`` is changed in place. ``model`` becomes the
    model's ``upstream_model``; ``cache_salt`` the tenant's (any client salt is dropped); the
    completion bound the gate checked goes under the one field the engines read
    (``adm.bound_field``), every other alias removed (:func:`gateway.admission.fields.set_bound`); a stream
    that did not ask for usage gets ``stream_options.include_usage: true`` (the quota settle needs it)."""
    body["model"] = adm.model.upstream_model
    body["cache_salt"] = cache_salt
    fields.set_bound(body, adm.bound_field, adm.max_tokens)
    if body.get("stream") and not client_wants_usage(body):
        body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
    return orjson.dumps(body)
