"""Steps 4 and 5 (and the model resolution of step 6's note): which model, how many prompt
tokens, how many completion tokens, and whether they fit (DESIGN.md, "A request's way through the
gateway", "Contracts": max_tokens).

- Model: the request's ``model`` (an id or an alias); absent, the tenant's only model. A model
  the tenant may not use, or that does not exist, is 404 ``model_not_found``.
- ``max_tokens``: ``max_completion_tokens`` (chat) when given, else ``max_tokens``; above the
  tenant's ``max_tokens_cap``: 400 with ``param`` naming the field. Absent:
  ``min(default_max_tokens, limit - prompt_tokens)`` (and the cap).
- Gate: ``prompt_tokens + max(1, max_tokens) <= limit`` with
  ``limit = min(context_length, live pool limit, tenant max_context_tokens)``; above it 400
  ``context_length_exceeded`` in OpenAI's wording (``config.errors.context_length_message``).
- Reservation for quotas: ``prompt tokens (all prompts) + n x max_tokens`` per prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from config.errors import ErrorCode, OpenAIError, context_length_message
from config.models import ModelConfig, Settings, TenantConfig
from tokenizer import PromptCounter, TokenizerError, make_counter


@dataclass
class ModelEntry:
    """A served model: its config, its counter and the names that reach it."""

    config: ModelConfig
    counter: PromptCounter

    @property
    def id(self) -> str:
        return self.config.id

    @property
    def upstream_model(self) -> str:
        return self.config.upstream_model or self.config.id


class ModelIndex:
    """Name (id or alias) -> :class:`ModelEntry`, built once per app from settings."""

    def __init__(self, settings: Settings, offload_chars: int | None = None) -> None:
        self.by_name: dict[str, ModelEntry] = {}
        self.entries: list[ModelEntry] = []
        for m in settings.models:
            counter = make_counter(m.tokenizer, m.upstream_model or m.id)
            if offload_chars is not None:
                counter.offload_chars = offload_chars
            e = ModelEntry(m, counter)
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


@dataclass
class Admission:
    """What admission decided. Token numbers in tokens.

    ``prompt_tokens``: the largest prompt (what the gate checks); ``prompt_tokens_total``: all
    prompts of a batch; ``max_tokens``: per completion; ``defaulted``: the client sent none, so
    the gateway must send ``max_tokens`` upstream; ``reserve_tokens``: prompt total + prompts x n x
    max_tokens; ``prompt_text``: the prompt's text for the verifier (never logged)."""

    model: ModelEntry
    prompt_tokens: int
    prompt_tokens_total: int
    num_prompts: int
    max_tokens: int
    defaulted: bool
    limit: int
    n: int
    reserve_tokens: int
    prompt_text: str


def tokenizer_error(e: TokenizerError) -> OpenAIError:
    """A counting error as an OpenAI error: the request's own faults are 400s naming the field
    (``param``); an engine tokenize failure keeps its own status and code (502 ``upstream_unavailable``)."""
    if e.status >= 500:
        return OpenAIError(e.status, e.message, code=e.code)
    return OpenAIError(e.status, e.message, code=e.code or ErrorCode.INVALID_REQUEST, param=e.param)


async def count_prompt(entry: ModelEntry, body: dict[str, Any], route: str) -> tuple[int, int, int]:
    """``(largest, total, number_of_prompts)`` prompt tokens of the request. Raises
    :class:`OpenAIError` 400 for invalid messages/prompt/token ids (``param`` names the field)."""
    counter = entry.counter
    try:
        if route == "chat":
            c = await counter.acount_chat(body["messages"], body.get("tools"))
            return c, c, 1
        pc = await counter.acount_prompt(body["prompt"])
        return pc.largest, pc.total, len(pc.per_prompt)
    except TokenizerError as e:
        raise tokenizer_error(e) from None


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
    if isinstance(p, list):
        return "\n".join(x for x in p if isinstance(x, str))
    return ""


def requested_max_tokens(body: dict[str, Any], route: str) -> tuple[int | None, str]:
    """``(value, field)``: ``max_completion_tokens`` (chat) over ``max_tokens``; ``None`` when absent."""
    if route == "chat" and body.get("max_completion_tokens") is not None:
        return body["max_completion_tokens"], "max_completion_tokens"
    return body.get("max_tokens"), "max_tokens"


def effective_limit(entry: ModelEntry, tenant: TenantConfig, pool_limit: int) -> int:
    """``min(model context_length, pool_limit, tenant max_context_tokens)`` in tokens."""
    limit = min(entry.config.context_length, pool_limit)
    if tenant.max_context_tokens is not None:
        limit = min(limit, tenant.max_context_tokens)
    return limit


def decide(
    entry: ModelEntry,
    tenant: TenantConfig,
    body: dict[str, Any],
    route: str,
    prompt: tuple[int, int, int],
    pool_limit: int,
) -> Admission:
    """Apply the max_tokens rules and the context gate to a counted request. Raises
    :class:`OpenAIError` 400 (``max_tokens`` over the cap, or ``context_length_exceeded``)."""
    largest, total, num = prompt
    limit = effective_limit(entry, tenant, pool_limit)
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
        max_tokens = requested
        defaulted = False
    else:
        max_tokens = min(tenant.default_max_tokens, limit - largest)
        if cap is not None:
            max_tokens = min(max_tokens, cap)
        max_tokens = max(max_tokens, 0)
        defaulted = True
    completion = max(1, max_tokens)
    if largest + completion > limit:
        chat = route == "chat"
        raise OpenAIError(
            400,
            context_length_message(limit, largest, completion, messages=chat),
            code=ErrorCode.CONTEXT_LENGTH_EXCEEDED,
            param="messages" if chat else "prompt",
        )
    n = body.get("n") or 1
    best_of = body.get("best_of") or 0
    seqs = max(n, best_of)
    return Admission(
        entry,
        largest,
        total,
        num,
        max_tokens,
        defaulted,
        limit,
        n,
        total + num * seqs * max_tokens,
        prompt_text_of(body, route),
    )
