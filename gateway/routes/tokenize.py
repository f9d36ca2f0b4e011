"""``/tokenize`` and ``/detokenize`` as route values (:data:`TOKENIZE`, :data:`DETOKENIZE`),
shaped like vLLM's (``vllm/entrypoints/serve/tokenize/protocol.py@030ea52e``:
``TokenizeChatRequest``, ``TokenizeCompletionRequest``, ``DetokenizeRequest``): their field tables
and the answer from the model's own counter, so that ``count`` is exactly the number the gate
counts (:mod:`tokenizer.tokenize_api`); for ``engine`` tokenizers, the engine's ``/tokenize``
answers. A prompt certainly longer than the effective limit is refused before it is tokenized (400
``context_length_exceeded``), as are more ids than it to ``/detokenize``; a count above
:data:`TOKENIZE_FREE_TOKENS` is charged against TPM. The handler that runs them through
admission's prologue is :mod:`gateway.routes.tokenize_handlers`.

- ``{"messages": [...], ...}``: a chat body, and ``/tokenize`` refuses and counts it as
  ``/v1/chat/completions`` does, by calling the chat route itself
  (:data:`~gateway.routes.chat.CHAT`): its validation (``validate``: every chat field, typed and
  ranged), its model task, its engines' field policy and refusals (``check_fields``: extension
  fields such as ``add_generation_prompt: false`` where no engine reads them, message shapes an
  engine refuses, image URLs, ``reasoning_effort`` turned into template variables) and its count
  (``acount``), so a count is never answered for a chat the route refuses, with the route's own
  error body, and never differs from the route's. Beside the chat fields, vLLM
  ``TokenizeChatRequest``'s own ``return_token_strs`` and ``add_special_tokens`` (false only).
  Chat fields that do not change the prompt (``max_tokens``, sampling) are validated, not used:
  the gate's decision (``count + max_tokens <= max_model_len``) is the client's to apply. Image
  parts the route would count are refused (they have no token ids here).
- ``{"prompt": str, "add_special_tokens": true, "return_token_strs": false}`` (vLLM
  ``TokenizeCompletionRequest``): a string prompt, counted as ``/v1/completions`` and
  ``/v1/embeddings`` count one (:meth:`~tokenizer.base.PromptCounter.count_prompt_text`; none of
  these fields is one their field policies refuse).
- ``{"tokens": [ids]}`` -> ``{"prompt": text}``; ids are validated against the vocabulary (400
  naming ``tokens``). For ``engine`` tokenizers the text is the engine's: at most
  :data:`ENGINE_TOKEN_CHARS` characters an id (else the engine's fault, 502), and it goes through
  the verifier's guard as a whole answer does (:meth:`DetokenizeRoute.guard`): a strict tenant's
  is withheld with the relay's 502 ``response_withheld``, a sampled one's is checked in the
  background.

Either answer is ``{"count", "max_model_len", "tokens", "token_strs"}``.
"""

from __future__ import annotations

import time
from typing import Any

import orjson

from config.errors import ErrorCode, OpenAIError
from config.models import TenantConfig
from gateway.admission.admit import Arrival
from gateway.admission.checks import CHAT_FIELDS, bad_value, check_fields
from gateway.admission.gate import nested_too_deeply, over_context_error, too_long_to_count
from gateway.admission.registry import ModelEntry
from gateway.admission.route import check_task
from gateway.admission.value_checks import Check, array, boolean, string
from gateway.relay.proxy import withheld_error
from gateway.routes.chat import CHAT
from gateway.routes.completions import COMPLETIONS
from tokenizer import render_chatml
from tokenizer.base import TOKEN_ID_CHARS, off_loop
from tokenizer.chat import IMAGE_PART_TYPES, ChatOptions, chat_cost
from tokenizer.engine_counter import EngineCounter, chat_tokenize_payload
from tokenizer.errors import EngineTokenizeError
from tokenizer.tokenize_api import Tokenized, tokenize_prompt
from verifier.stage import Exchange, ExchangeRequest, ResponseWithheld, VerifierStage

#: A ``/tokenize`` whose count is above this many tokens charges them against TPM: counting a
#: prompt longer than a typical message is work the tenant pays for, as the chat it prepares
#: would (a short pre-check stays free).
TOKENIZE_FREE_TOKENS = 2048

#: ``POST /tokenize`` with a ``prompt`` (vLLM ``TokenizeCompletionRequest``)
TOKENIZE_PROMPT_FIELDS: dict[str, Check] = {
    "model": string,
    "prompt": string,
    "add_special_tokens": boolean,
    "return_token_strs": boolean,
}
#: ``POST /tokenize`` with ``messages``: vLLM ``TokenizeChatRequest``'s fields that a chat body
#: lacks, beside the chat route's whole table (``CHAT.validate``); a custom ``chat_template`` is
#: refused there, as chat refuses it
TOKENIZE_CHAT_OWN_FIELDS: dict[str, Check] = {"add_special_tokens": boolean, "return_token_strs": boolean}
#: every field ``/tokenize`` takes (its ``fields``: the names an error's ``param`` may log)
TOKENIZE_FIELDS: dict[str, Check] = {**CHAT_FIELDS, **TOKENIZE_PROMPT_FIELDS}
#: fields only a chat takes: in a ``prompt`` body, 400 "is only allowed with 'messages'"
_CHAT_ONLY = ("tools", "add_generation_prompt", "continue_final_message", "chat_template_kwargs")

#: ``POST /detokenize`` (vLLM ``DetokenizeRequest``)
DETOKENIZE_FIELDS: dict[str, Check] = {"model": string, "tokens": array}
#: the most characters an engine's ``/detokenize`` text may hold per id where the counter knows
#: no ``max_token_chars`` of its own (an ``engine`` tokenizer: its vocabulary is not known here);
#: eight times the bundled tokenizer's longest token (128)
ENGINE_TOKEN_CHARS = 1024


def chat_body(body: dict[str, Any]) -> dict[str, Any]:
    """The chat request inside a ``/tokenize`` body with ``messages``: a copy without ``/tokenize``'s
    own fields (:data:`TOKENIZE_CHAT_OWN_FIELDS`) and the absent ``prompt``, so the chat route may
    check it (and drop from it what it drops) without touching ``body``."""
    return {k: v for k, v in body.items() if k not in TOKENIZE_CHAT_OWN_FIELDS and k != "prompt"}


def _refuse_images(messages: list[Any]) -> None:
    """400 for a counted chat holding an image part: its ids are not known here (the route counts
    it at the model's image cost), so ``/tokenize`` cannot answer the ids its count stands for."""
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        for part in content if isinstance(content, list) else ():
            if isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES:
                raise OpenAIError(
                    400,
                    "/tokenize does not take image content parts (they have no token ids here).",
                    code=ErrorCode.INVALID_REQUEST,
                    param="messages",
                )


async def _chat_options(entry: ModelEntry, req: dict[str, Any]) -> ChatOptions:
    """The chat route's field policy on ``req`` (``CHAT.check_fields``: what the engines serving
    the model refuse, and the options the prompt is counted with), in a worker thread when the
    route weighs the chat as heavy, as :func:`gateway.admission.gate.count_prompt` runs it."""
    counter = entry.counter
    return await off_loop(CHAT.cost(req, counter.offload_chars), counter.offload_chars, CHAT.check_fields, req, entry)


async def _engine_chat(counter: EngineCounter, req: dict[str, Any], options: ChatOptions) -> Tokenized:
    """An ``engine`` tokenizer's count and ids of a chat the route admitted, in one engine call:
    the chat validated by the render the counter's own ``acount_chat`` runs first (in a worker
    thread when it weighs as much), image parts refused before anything is sent, then the payload
    that ``acount_chat`` sends."""
    messages, tools = req["messages"], req.get("tools")

    def render() -> None:
        render_chatml(messages, tools, ChatOptions(options.add_generation_prompt))

    await off_loop(chat_cost(messages, tools, counter.offload_chars), counter.offload_chars, render)
    _refuse_images(messages)
    count, ids = await counter.atokenize_ids(chat_tokenize_payload(messages, tools, options))
    return Tokenized(count, ids)


async def _local_chat(counter: Any, req: dict[str, Any], options: ChatOptions, strs: bool) -> Tokenized:
    """A local counter's answer for a chat the route admitted: ``count`` the chat route's own
    (``CHAT.acount``), then image parts refused, then the rendered template's ids (in a worker
    thread for a chat whose :func:`~tokenizer.chat.chat_cost` the counter offloads)."""
    count = (await CHAT.acount(counter, req, options)).largest
    messages, tools = req["messages"], req.get("tools")
    _refuse_images(messages)

    def ids() -> Tokenized:
        tokens = counter.chat_token_ids(messages, tools, options)
        return Tokenized(count, tokens, counter.token_strs(tokens) if strs else None)

    return await off_loop(chat_cost(messages, tools, counter.offload_chars), counter.offload_chars, ids)


async def _tokenize_chat(entry: ModelEntry, body: dict[str, Any], limit: int) -> Tokenized:
    """A ``/tokenize`` chat as the chat route takes it: the model must serve chat
    (:func:`~gateway.admission.route.check_task`), then ``CHAT.check_fields``, the too-long
    shortcut, the count, and the body written back as the route forwards it (too deeply nested:
    :func:`~gateway.admission.gate.nested_too_deeply`), each the route's own; raises what the
    route raises for the same body."""
    check_task(entry, CHAT)
    req = chat_body(body)
    options = await _chat_options(entry, req)
    too_long_to_count(entry, req, CHAT, limit)
    counter = entry.counter
    if isinstance(counter, EngineCounter):
        out = await _engine_chat(counter, req, options)
    else:
        out = await _local_chat(counter, req, options, bool(body.get("return_token_strs")))
    try:  # the route writes the body back to forward it, after its count
        orjson.dumps(req)
    except orjson.JSONEncodeError:
        raise nested_too_deeply() from None
    return out


async def _tokenize_prompt(entry: ModelEntry, body: dict[str, Any], limit: int) -> Tokenized:
    """A ``/tokenize`` string prompt: refused uncounted when its text alone is longer than
    ``limit`` (as completions refuses it), else counted as completions and embeddings count a
    string (``add_special_tokens`` false: its text alone), by the engine for ``engine`` tokenizers."""
    too_long_to_count(entry, body, COMPLETIONS, limit)
    add = body.get("add_special_tokens")
    add = True if add is None else add
    counter = entry.counter
    if isinstance(counter, EngineCounter):
        count, ids = await counter.atokenize_ids({"prompt": body["prompt"], "add_special_tokens": add})
        return Tokenized(count, ids)
    return await tokenize_prompt(counter, body["prompt"], add, bool(body.get("return_token_strs")))


def _check_token_ids(counter: Any, ids: list[Any]) -> None:
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise OpenAIError(
            400,
            "Invalid value for 'tokens': must be an array of integers",
            code=ErrorCode.INVALID_REQUEST,
            param="tokens",
        )
    counter.check_ids(ids, "tokens")


async def _detokenize(counter: Any, body: dict[str, Any], limit: int) -> str:
    """The text of ``body["tokens"]``; more ids than ``limit`` (the effective limit) are refused
    (400 ``context_length_exceeded``, ``param`` ``tokens``) before they are checked or decoded,
    and a long list is checked and decoded in a worker thread."""
    ids = body["tokens"]
    if len(ids) > limit:
        raise over_context_error(limit, len(ids), "tokens")
    cost = len(ids) * TOKEN_ID_CHARS
    await off_loop(cost, counter.offload_chars, _check_token_ids, counter, ids)
    if isinstance(counter, EngineCounter):
        return _engine_text(counter, ids, await counter.adecode(ids))
    adecode = getattr(counter, "adecode", None)
    if adecode is not None:
        return await adecode(ids)
    return await off_loop(cost, counter.offload_chars, counter.decode, ids)


def _engine_text(counter: EngineCounter, ids: list[int], text: str) -> str:
    """``text``, the engine's ``/detokenize`` answer for ``ids``, when it holds at most ``len(ids)``
    times the counter's ``max_token_chars`` characters (:data:`ENGINE_TOKEN_CHARS` where it has
    none): no ids decode to more. Else raises :class:`~tokenizer.errors.EngineTokenizeError` (502
    ``upstream_unavailable``: the engine's fault, as any other malformed answer of it)."""
    per = counter.max_token_chars or ENGINE_TOKEN_CHARS
    if len(text) > len(ids) * per:
        raise EngineTokenizeError(
            f"engine detokenize at {counter.detokenize_url} answered {len(text)} characters for "
            f"{len(ids)} token ids (at most {per} each)"
        )
    return text


async def guard_engine_text(verifier: VerifierStage, exchange: Exchange, text: str) -> None:
    """An engine's text through the guard a whole answer of ``exchange``'s tenant goes through
    (:func:`gateway.relay.proxy.read_whole`: ``admit``, ``begin``, ``check_body``; no usage,
    finish reason or TTFT to judge): a strict tenant's is checked before this returns, and one the
    guard withholds raises the relay's 502 ``response_withheld``
    (:func:`gateway.relay.proxy.withheld_error`); a sampled tenant's is queued for the background
    checker; any other's is not looked at."""
    await verifier.admit(exchange)
    guard = verifier.begin(exchange)
    if guard is None:
        return
    try:
        await guard.check_body(text, usage=None, finish_reason=None, ttft_seconds=None)
    except ResponseWithheld as w:
        raise withheld_error(w) from None


class TokenizeRoute:
    """``POST /tokenize`` (and ``/v1/tokenize``): a prompt or a chat -> its ids and their count."""

    name = "tokenize"
    path = "/tokenize"
    tasks: tuple[str, ...] = ("chat", "embedding")
    id_fields: tuple[str, ...] = ("prompt",)
    fields = TOKENIZE_FIELDS

    def validate(self, body: dict[str, Any]) -> None:
        """Exactly one of ``prompt`` and ``messages``. A ``prompt`` body: no chat-only field,
        then :data:`TOKENIZE_PROMPT_FIELDS`. A ``messages`` body: ``/tokenize``'s own fields
        (``add_special_tokens`` false only), then the chat route's own validation of the rest
        (``CHAT.validate``: its errors, word for word)."""
        has_prompt, has_messages = body.get("prompt") is not None, body.get("messages") is not None
        if has_prompt == has_messages:
            raise OpenAIError(
                400,
                "Send exactly one of 'prompt' (a string) or 'messages'.",
                code=ErrorCode.INVALID_REQUEST,
                param="prompt" if has_prompt else "messages",
            )
        if has_prompt:
            for key in _CHAT_ONLY:
                if body.get(key) is not None:
                    raise bad_value(key, "is only allowed with 'messages'")
            check_fields({k: v for k, v in body.items() if k != "messages"}, TOKENIZE_PROMPT_FIELDS, ())
            return
        check_fields({k: body[k] for k in TOKENIZE_CHAT_OWN_FIELDS if k in body}, TOKENIZE_CHAT_OWN_FIELDS, ())
        if body.get("add_special_tokens"):
            raise bad_value(
                "add_special_tokens", "must be false with 'messages' (the template adds what the model needs)"
            )
        CHAT.validate(chat_body(body))

    async def answer(
        self, entry: ModelEntry, body: dict[str, Any], limit: int, max_model_len: int | None
    ) -> tuple[dict[str, Any], int]:
        """``(answer, tokens to charge)``: a chat as the chat route checks and counts it
        (:func:`_tokenize_chat`), a prompt certainly longer than ``limit`` refused before it is
        tokenized; a count above :data:`TOKENIZE_FREE_TOKENS` is charged."""
        if body.get("messages") is not None:
            t = await _tokenize_chat(entry, body, limit)
        else:
            t = await _tokenize_prompt(entry, body, limit)
        charge = t.count if t.count > TOKENIZE_FREE_TOKENS else 0
        return {
            "count": t.count,
            "max_model_len": max_model_len,
            "tokens": t.tokens,
            "token_strs": t.token_strs,
        }, charge

    async def guard(
        self,
        verifier: VerifierStage,
        arrival: Arrival[Any],
        tenant: TenantConfig,
        entry: ModelEntry,
        body: dict[str, Any],
        answer: dict[str, Any],
    ) -> None:
        """Nothing to check: an engine answers ids and counts here, never text (``token_strs``
        come from the gateway's own counters only)."""
        return None


class DetokenizeRoute:
    """``POST /detokenize`` (and ``/v1/detokenize``): ids -> their text."""

    name = "detokenize"
    path = "/detokenize"
    tasks: tuple[str, ...] = ("chat", "embedding")
    id_fields: tuple[str, ...] = ("tokens",)
    fields = DETOKENIZE_FIELDS

    def validate(self, body: dict[str, Any]) -> None:
        check_fields(body, self.fields, ("tokens",))

    async def answer(
        self, entry: ModelEntry, body: dict[str, Any], limit: int, max_model_len: int | None
    ) -> tuple[dict[str, Any], int]:
        """``({"prompt": text}, 0)``; more ids than ``limit`` refused before they are checked."""
        return {"prompt": await _detokenize(entry.counter, body, limit)}, 0

    async def guard(
        self,
        verifier: VerifierStage,
        arrival: Arrival[Any],
        tenant: TenantConfig,
        entry: ModelEntry,
        body: dict[str, Any],
        answer: dict[str, Any],
    ) -> None:
        """An ``engine`` tokenizer's text (the engine's output) through ``tenant``'s guard
        (:func:`guard_engine_text`; raises 502 ``response_withheld``). The exchange has no prompt
        text (the ids are the prompt, and decoding them means asking the same engine again),
        ``prompt_tokens`` the number of ids, and no upstream (the tokenizer's engine is none the
        gateway picked). A local counter's text is the gateway's own, not checked."""
        if not isinstance(entry.counter, EngineCounter):
            return
        started = time.monotonic() - (time.perf_counter() - arrival.t_perf)
        request = ExchangeRequest(arrival.request_id, tenant, "", entry.id, len(body["tokens"]), False, started)
        await guard_engine_text(verifier, Exchange(request, ""), answer["prompt"])


TOKENIZE = TokenizeRoute()
DETOKENIZE = DetokenizeRoute()
