"""``POST /tokenize`` and ``/detokenize`` (also under ``/v1/``), shaped like vLLM's
(``vllm/entrypoints/serve/tokenize/``), answered from the model's own counter so that ``count``
is exactly the number the context gate uses (:mod:`tokenizer.tokenize_api`); for ``engine``
tokenizers, the engine's ``/tokenize`` answers. ``max_model_len`` is the tenant's live
effective limit (``null`` while the pool is unknown), so a client can pre-check exactly:
``count + max_tokens <= max_model_len``. Each call is one request against RPM (and the
concurrency limit while it runs), no tokens against TPM.

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
from gateway import logging as glog
from gateway.admission import effective_limit
from gateway.api_routes import check_task, validate
from gateway.auth import authenticate
from gateway.handlers import HandlerContext, refusal, request_id_of
from gateway.requests import ClientGone, parse_json_body, read_body
from tokenizer import TokenizerError, render_chatml
from tokenizer.chat import ChatOptions, chat_text_length
from tokenizer.engine_counter import EngineCounter
from tokenizer.tokenize_api import Tokenized, tokenize_chat, tokenize_prompt


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


async def _detokenize(counter: Any, body: dict[str, Any]) -> str:
    ids = body["tokens"]
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise OpenAIError(
            400,
            "Invalid value for 'tokens': must be an array of integers",
            code=ErrorCode.INVALID_REQUEST,
            param="tokens",
        )
    counter.check_ids(ids, "tokens")
    adecode = getattr(counter, "adecode", None)
    if adecode is not None:
        return await adecode(ids)
    if len(ids) > counter.offload_chars:
        return await asyncio.to_thread(counter.decode, ids)
    return counter.decode(ids)


async def handle_tokenize(gw: HandlerContext, request: Request, route: str) -> Response:
    """``POST /tokenize`` (``route`` ``tokenize``) or ``/detokenize`` (``detokenize``), and their
    ``/v1/`` aliases: auth, validation, model (its task must serve the route), the answer from
    the model's counter, one request against RPM; OpenAI-shaped errors like every route."""
    t0 = time.perf_counter()
    headers = request.headers
    rid = request_id_of(headers.get("x-request-id"))
    tenant_id = "-"
    try:
        tenant = authenticate(headers.get("authorization"), gw.tenants)  # before any byte of the body
        tenant_id = tenant.id
        budget = gw.body_budget
        raw = await read_body(
            request.receive,
            headers.get("content-length"),
            gw.settings.gateway.max_body_bytes,
            pace=budget.pacer(tenant.id) if budget is not None else None,
        )
        body = parse_json_body(raw)
        validate(body, route)
        entry = gw.models.resolve(tenant, body.get("model"))
        check_task(entry, route)
        try:
            if route == "tokenize":
                t = await _tokenize(entry.counter, body)
                _, pool_limit = gw.upstreams.eligible(entry.id)
                answer: dict[str, Any] = {
                    "count": t.count,
                    "max_model_len": effective_limit(entry, tenant, pool_limit) if pool_limit is not None else None,
                    "tokens": t.tokens,
                    "token_strs": t.token_strs,
                }
            else:
                answer = {"prompt": await _detokenize(entry.counter, body)}
        except TokenizerError as e:
            raise e.to_openai() from None
        except NotImplementedError:
            raise OpenAIError(
                400, f"The model `{entry.id}`'s tokenizer cannot answer {route}.", code=ErrorCode.INVALID_REQUEST
            ) from None
        lease = await gw.quotas.reserve(tenant, 0, rid)
        await gw.quotas.settle(lease, 0)
    except OpenAIError as e:
        return refusal(gw, e, rid, t0, tenant_id, route)
    except ClientGone:
        return Response(status_code=499)
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
