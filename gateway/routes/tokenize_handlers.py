"""``POST /tokenize`` and ``/detokenize`` (also under ``/v1/``), shaped like vLLM's
(``vllm/entrypoints/serve/tokenize/``), answered from the model's own counter so that ``count``
is exactly the number the context gate uses (:mod:`tokenizer.tokenize_api`); for ``engine``
tokenizers, the engine's ``/tokenize`` answers. ``max_model_len`` is the tenant's live
effective limit (``null`` while the pool is unknown), so a client can pre-check exactly:
``count + max_tokens <= max_model_len``. Each call goes through admission's prologue
(:mod:`gateway.admission.admit`): one request against RPM and a concurrency lease before its body is read,
the body read, density-checked and parsed (off the loop when large) as admission does, a prompt
certainly longer than the effective limit refused before it is tokenized (400
``context_length_exceeded``), as are more ids than it to ``/detokenize``; a count above
:data:`TOKENIZE_FREE_TOKENS` is charged against TPM.

- ``{"prompt": str, "add_special_tokens": true, "return_token_strs": false}`` or
  ``{"messages": [...], "tools": [...], "add_generation_prompt": true, "continue_final_message":
  false, "chat_template_kwargs": {...}}`` ->
  ``{"count", "max_model_len", "tokens", "token_strs"}``; image parts are refused (400).
- ``{"tokens": [ids]}`` -> ``{"prompt": text}``; ids are validated against the vocabulary (400
  naming ``tokens``).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from config.errors import ErrorCode, OpenAIError
from config.models import TenantConfig
from gateway.admission.admit import Refused, begin_request, read_request
from gateway.admission.body import ClientGone
from gateway.admission.gate import ModelEntry, effective_limit, over_context_error, too_long_to_count
from gateway.ops import access_log as glog
from gateway.quotas.stage import QuotaLease
from gateway.routes.api_routes import check_task, validate
from gateway.routes.handlers import HandlerContext, refusal, request_id_of
from tokenizer import TokenizerError, render_chatml
from tokenizer.base import TOKEN_ID_CHARS
from tokenizer.chat import ChatOptions, chat_text_length
from tokenizer.engine_counter import EngineCounter
from tokenizer.tokenize_api import Tokenized, tokenize_chat, tokenize_prompt

#: A ``/tokenize`` whose count is above this many tokens charges them against TPM: counting a
#: prompt longer than a typical message is work the tenant pays for, as the chat it prepares
#: would (a short pre-check stays free).
TOKENIZE_FREE_TOKENS = 2048


def chat_options(body: dict[str, Any]) -> ChatOptions:
    """The :class:`~tokenizer.chat.ChatOptions` of a ``/tokenize`` chat body (vLLM
    ``TokenizeChatRequest``: ``add_generation_prompt`` default true, ``continue_final_message``,
    ``chat_template_kwargs``), as the chat route counts them."""
    cfm = bool(body.get("continue_final_message"))
    return ChatOptions(
        add_generation_prompt=body.get("add_generation_prompt") is not False and not cfm,
        continue_final_message=cfm,
        template_kwargs=tuple(sorted((body.get("chat_template_kwargs") or {}).items())),
    )


async def _tokenize(counter: Any, body: dict[str, Any]) -> Tokenized:
    strs = bool(body.get("return_token_strs"))
    messages = body.get("messages")
    if messages is not None:
        options = chat_options(body)
        tools = body.get("tools")

        def images() -> int:
            return render_chatml(messages, tools, ChatOptions(options.add_generation_prompt)).images

        long = chat_text_length(messages, tools, limit=counter.offload_chars) > counter.offload_chars
        if await asyncio.to_thread(images) if long else images():
            raise OpenAIError(
                400,
                "/tokenize does not take image content parts (they have no token ids here).",
                code=ErrorCode.INVALID_REQUEST,
                param="messages",
            )
        if isinstance(counter, EngineCounter):
            payload: dict[str, Any] = {"messages": messages, "add_generation_prompt": options.add_generation_prompt}
            if options.continue_final_message:
                payload["continue_final_message"] = True
            if options.template_kwargs:
                payload["chat_template_kwargs"] = dict(options.template_kwargs)
            if body.get("tools"):
                payload["tools"] = body["tools"]
            count, ids = await counter.atokenize_ids(payload)
            return Tokenized(count, ids)
        return await tokenize_chat(counter, messages, body.get("tools"), strs, options)
    add = body.get("add_special_tokens")
    add = True if add is None else add
    if isinstance(counter, EngineCounter):
        count, ids = await counter.atokenize_ids({"prompt": body["prompt"], "add_special_tokens": add})
        return Tokenized(count, ids)
    return await tokenize_prompt(counter, body["prompt"], add, strs)


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
    heavy = len(ids) * TOKEN_ID_CHARS > counter.offload_chars
    if heavy:
        await asyncio.to_thread(_check_token_ids, counter, ids)
    else:
        _check_token_ids(counter, ids)
    adecode = getattr(counter, "adecode", None)
    if adecode is not None:
        return await adecode(ids)
    return await asyncio.to_thread(counter.decode, ids) if heavy else counter.decode(ids)


async def _answer(
    gw: HandlerContext, request: Request, tenant: TenantConfig, lease: QuotaLease, route: str
) -> tuple[ModelEntry, dict[str, Any], int]:
    """``(model, answer, tokens to charge)`` for a begun request: admission's body prologue
    (:func:`gateway.admission.admit.read_request`), validation, the model, the too-long shortcut, the
    answer; a ``/tokenize`` count above :data:`TOKENIZE_FREE_TOKENS` is reserved against TPM
    (429 over it). Raises :class:`OpenAIError` or ``ClientGone``."""
    body, _ = await read_request(gw, request, tenant, ("tokens",) if route == "detokenize" else ("prompt",))
    validate(body, route)
    entry = gw.models.resolve(tenant, body.get("model"))
    check_task(entry, route)
    _, pool_limit = gw.upstreams.eligible(entry.id)
    max_model_len = effective_limit(entry, tenant, pool_limit) if pool_limit is not None else None
    limit = max_model_len if max_model_len is not None else entry.config.context_length
    try:
        if route == "detokenize":
            return entry, {"prompt": await _detokenize(entry.counter, body, limit)}, 0
        chat = body.get("messages") is not None
        too_long_to_count(entry, body, "chat" if chat else "completions", limit)
        t = await _tokenize(entry.counter, body)
    except TokenizerError as e:
        raise e.to_openai() from None
    except NotImplementedError:
        raise OpenAIError(
            400, f"The model `{entry.id}`'s tokenizer cannot answer {route}.", code=ErrorCode.INVALID_REQUEST
        ) from None
    charge = t.count if t.count > TOKENIZE_FREE_TOKENS else 0
    if charge:
        await gw.quotas.reserve_tokens(tenant, lease, charge)
    answer = {"count": t.count, "max_model_len": max_model_len, "tokens": t.tokens, "token_strs": t.token_strs}
    return entry, answer, charge


async def handle_tokenize(gw: HandlerContext, request: Request, route: str) -> Response:
    """``POST /tokenize`` (``route`` ``tokenize``) or ``/detokenize`` (``detokenize``), and their
    ``/v1/`` aliases, through admission's own prologue: auth and one request against RPM (and a
    concurrency lease) before the body is read (:func:`gateway.admission.admit.begin_request`), the body
    read, density-checked and parsed as admission does, then validation, the model (its task
    must serve the route) and the answer from the model's counter; OpenAI-shaped errors like
    every route."""
    t0 = time.perf_counter()
    rid = request_id_of(request.headers.get("x-request-id"))
    try:
        tenant, lease = await begin_request(gw, request, rid)
    except Refused as r:
        return refusal(gw, r.error, rid, t0, r.tenant_id, route)
    charged = 0
    try:
        entry, answer, charged = await _answer(gw, request, tenant, lease, route)
    except OpenAIError as e:
        return refusal(gw, e, rid, t0, tenant.id, route)
    except ClientGone:
        return Response(status_code=499)
    finally:
        await gw.quotas.settle(lease, charged)
    overhead = time.perf_counter() - t0
    out = {"x-request-id": rid, "x-kvgate-overhead-ms": f"{overhead * 1000:.3f}", **lease.headers}
    gw.metrics.requests.labels(tenant.id, route, "200").inc()
    gw.metrics.overhead.labels(route).observe(overhead)
    glog.access(
        {
            "request_id": rid,
            "tenant": tenant.id,
            "route": route,
            "status": 200,
            "model": entry.id,
            "prompt_tokens": answer.get("count"),
            "overhead_ms": round(overhead * 1000, 3),
        }
    )
    return Response(orjson.dumps(answer), media_type="application/json", headers=out)
