"""The route handlers: steps 1-6 of a request's way through the gateway (DESIGN.md), then a
:class:`~gateway.proxy.ProxyCall` for step 7. Kept free of pydantic model building per request:
the body is a dict from orjson, checked by :mod:`gateway.requests`."""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from config.errors import ErrorCode, OpenAIError
from gateway import logging as glog
from gateway.admission import count_prompt, decide, effective_limit
from gateway.auth import authenticate
from gateway.proxy import ProxyCall
from gateway.requests import ClientGone, parse_json_body, read_body, validate

if TYPE_CHECKING:
    from gateway.app import Gateway

_ALLOWED_RID = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.:/+=")


def request_id_of(value: str | None) -> str:
    """The client's ``x-request-id`` when it is 1-128 safe characters, else a new random id."""
    if value and len(value) <= 128 and all(c in _ALLOWED_RID for c in value):
        return value
    return os.urandom(16).hex()


def _error(gw: "Gateway", err: OpenAIError, rid: str, t0: float, tenant: str, route: str) -> Response:
    overhead = time.perf_counter() - t0
    headers = dict(err.headers or {})
    headers["x-request-id"] = rid
    headers["x-kvgate-overhead-ms"] = f"{overhead * 1000:.3f}"
    m = gw.metrics
    m.rejections.labels(err.code or f"http_{err.status}").inc()
    m.requests.labels(tenant, route, str(err.status)).inc()
    m.overhead.labels(route).observe(overhead)
    glog.access(
        {
            "request_id": rid,
            "tenant": tenant,
            "route": route,
            "status": err.status,
            "error_code": err.code,
            "param": err.param,
            "overhead_ms": round(overhead * 1000, 3),
        }
    )
    return Response(err.body_bytes(), status_code=err.status, media_type="application/json", headers=headers)


async def handle_completion(gw: "Gateway", request: Request, route: str) -> Response:
    """``POST /v1/chat/completions`` (``route`` ``chat``) and ``/v1/completions`` (``completions``)."""
    t0 = time.perf_counter()
    headers = request.headers
    rid = request_id_of(headers.get("x-request-id"))
    tenant_id = "-"
    try:
        raw = await read_body(request.receive, headers.get("content-length"), gw.settings.gateway.max_body_bytes)
        body = parse_json_body(raw)
        tenant = authenticate(headers.get("authorization"), gw.tenants)
        tenant_id = tenant.id
        validate(body, route)
        entry = gw.models.resolve(tenant, body.get("model"))
        prompt = await count_prompt(entry, body, route)
        candidates, pool_limit = gw.upstreams.eligible(entry.id)
        if pool_limit is None:
            raise OpenAIError(
                503,
                f"The live KV pool size of the engines serving '{entry.id}' is unknown or "
                "stale; refusing rather than risking a silent rejection. Retry shortly.",
                code=ErrorCode.POOL_SIZE_UNKNOWN,
                headers={"Retry-After": "1"},
            )
        adm = decide(entry, tenant, body, route, prompt, pool_limit)
        verifier = gw.verifier
        candidates = [u for u in candidates if not verifier.is_quarantined(u.name, adm.prompt_tokens)]
        if not candidates:
            raise OpenAIError(
                503,
                "Every upstream engine for this model is quarantined for prompts of this length.",
                code=ErrorCode.UPSTREAM_UNAVAILABLE,
            )
        lease = await gw.quotas.reserve(tenant, adm.reserve_tokens, rid)
    except OpenAIError as e:
        return _error(gw, e, rid, t0, tenant_id, route)
    except ClientGone:
        return Response(status_code=499)
    stream = bool(body.get("stream"))
    so = body.get("stream_options")
    client_usage = bool(stream and isinstance(so, dict) and so.get("include_usage"))
    body["model"] = entry.upstream_model
    body["cache_salt"] = gw.cache_salt(tenant.id)
    if adm.defaulted:
        body["max_tokens"] = adm.max_tokens
    if stream and not client_usage:
        body["stream_options"] = {**(so or {}), "include_usage": True}
    return ProxyCall(gw, route, rid, tenant, adm, lease, candidates, orjson.dumps(body), stream, client_usage, t0)


async def handle_models(gw: "Gateway", request: Request) -> Response:
    """``GET /v1/models``: the tenant's models; ``max_model_len`` is its effective limit now
    (``null`` while the pool is unknown)."""
    t0 = time.perf_counter()
    rid = request_id_of(request.headers.get("x-request-id"))
    try:
        tenant = authenticate(request.headers.get("authorization"), gw.tenants)
    except OpenAIError as e:
        return _error(gw, e, rid, t0, "-", "models")
    data: list[dict[str, Any]] = []
    for e in gw.models.allowed(tenant):
        _, pool_limit = gw.upstreams.eligible(e.id)
        data.append(
            {
                "id": e.id,
                "object": "model",
                "created": gw.started_at,
                "owned_by": "kvgate",
                "root": e.id,
                "max_model_len": effective_limit(e, tenant, pool_limit) if pool_limit is not None else None,
            }
        )
    gw.metrics.requests.labels(tenant.id, "models", "200").inc()
    return Response(
        orjson.dumps({"object": "list", "data": data}),
        media_type="application/json",
        headers={"x-request-id": rid, "x-kvgate-overhead-ms": f"{(time.perf_counter() - t0) * 1000:.3f}"},
    )
