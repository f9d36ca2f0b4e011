"""The route handlers. A completion reads top to bottom (DESIGN.md, "A request's way through the
gateway"): :func:`~gateway.admit.admit` (steps 1-6: auth from the headers, body, validation,
count, gate, quarantine filter, quota reserve) returns an :class:`~gateway.admit.Admitted`
record; :func:`~gateway.proxy.relay` (step 7, with the verifier's guard of step 8) opens an
upstream and yields the answer's bytes while it fills a :class:`~gateway.proxy.RelayOutcome`;
:func:`~gateway.finish.finish` settles the quota, counts and logs it; the
:class:`~gateway.response.RelayResponse` shell carries the bytes to the client. Kept free of
pydantic model building per request: the body is a dict from orjson, checked by
:mod:`gateway.requests`."""

from __future__ import annotations

import os
import time
from typing import Any, Protocol

import orjson
from starlette.requests import Request
from starlette.responses import Response

from config.errors import OpenAIError
from gateway import logging as glog
from gateway.admission import effective_limit
from gateway.admit import AdmitContext, Arrival, Refused, admit
from gateway.auth import authenticate
from gateway.finish import FinishContext, finish
from gateway.proxy import RelayContext, RelayOutcome, relay
from gateway.requests import ClientGone
from gateway.response import RelayResponse


class HandlerContext(AdmitContext, RelayContext, FinishContext, Protocol):
    """What the handlers read from the gateway: every stage's context, and ``started_at`` (unix
    seconds, the ``created`` of ``/v1/models``)."""

    started_at: int


_ALLOWED_RID = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.:/+=")


def request_id_of(value: str | None) -> str:
    """The client's ``x-request-id`` when it is 1-128 safe characters, else a new random id."""
    if value and len(value) <= 128 and all(c in _ALLOWED_RID for c in value):
        return value
    return os.urandom(16).hex()


def refusal(gw: HandlerContext, err: OpenAIError, rid: str, t0: float, tenant: str, route: str) -> Response:
    """The JSON error answer of a refused request, counted and access-logged."""
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


async def handle_completion(gw: HandlerContext, request: Request, route: str) -> Response:
    """``POST /v1/chat/completions`` (``route`` ``chat``) and ``/v1/completions`` (``completions``)."""
    arrival = Arrival(request_id_of(request.headers.get("x-request-id")), route, time.perf_counter())
    try:
        admitted = await admit(gw, request, arrival)
    except Refused as r:
        return refusal(gw, r.error, arrival.request_id, arrival.t_perf, r.tenant_id, route)
    except ClientGone:
        return Response(status_code=499)
    outcome = RelayOutcome(admitted)
    return RelayResponse(relay(gw, outcome), outcome, on_close=lambda: finish(gw, outcome))


async def handle_models(gw: HandlerContext, request: Request) -> Response:
    """``GET /v1/models``: the tenant's models; ``max_model_len`` is its effective limit now
    (``null`` while the pool is unknown)."""
    t0 = time.perf_counter()
    rid = request_id_of(request.headers.get("x-request-id"))
    try:
        tenant = authenticate(request.headers.get("authorization"), gw.tenants)
    except OpenAIError as e:
        return refusal(gw, e, rid, t0, "-", "models")
    data: list[dict[str, Any]] = []
    for entry in gw.models.allowed(tenant):
        _, pool_limit = gw.upstreams.eligible(entry.id)
        data.append(
            {
                "id": entry.id,
                "object": "model",
                "created": gw.started_at,
                "owned_by": "kvgate",
                "root": entry.id,
                "max_model_len": effective_limit(entry, tenant, pool_limit) if pool_limit is not None else None,
            }
        )
    gw.metrics.requests.labels(tenant.id, "models", "200").inc()
    return Response(
        orjson.dumps({"object": "list", "data": data}),
        media_type="application/json",
        headers={"x-request-id": rid, "x-kvgate-overhead-ms": f"{(time.perf_counter() - t0) * 1000:.3f}"},
    )
