"""The route handlers. A completion reads top to bottom (docs/design.md, "A request's way through the
gateway"): :func:`~gateway.admission.admit.admit` (steps 1-6: auth from the headers, body, validation,
count, gate, quarantine filter, quota reserve) returns an :class:`~gateway.admission.admit.Admitted`
record; :func:`~gateway.relay.proxy.relay` (step 7, with the verifier's guard of step 8) opens an
upstream and yields the answer's bytes while it fills a :class:`~gateway.relay.proxy.RelayOutcome`;
:func:`~gateway.relay.finish.finish` settles the quota, counts and logs it; the
:class:`~gateway.relay.response.RelayResponse` shell carries the bytes to the client. Kept free of
pydantic model building per request: the body is a dict from orjson, checked by
the route's field table (:mod:`gateway.admission.checks`)."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

import orjson
from starlette.requests import Request
from starlette.responses import Response

from config.errors import OpenAIError
from config.models import TenantConfig
from gateway.admission.admit import AdmitContext, Arrival, Refused, admit, authenticate_request
from gateway.admission.body import ClientGone, body_declared, closing
from gateway.admission.gate import effective_limit
from gateway.admission.registry import ModelEntry
from gateway.admission.route import ApiRoute, Route
from gateway.ops import access_log as glog
from gateway.ops.log_param import loggable_param
from gateway.relay.finish import FinishContext, finish
from gateway.relay.proxy import RelayContext, RelayOutcome, client_of, relay
from gateway.relay.response import RelayResponse


class HandlerContext(AdmitContext, RelayContext, FinishContext, Protocol):
    """What the handlers read from the gateway: every stage's context, and ``started_at`` (unix
    seconds, the ``created`` of ``/v1/models``)."""

    started_at: int


#: the route of a :func:`prologue`, and what its ``step`` returns
R = TypeVar("R", bound=Route)
T = TypeVar("T")

_ALLOWED_RID = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.:/+=")


def request_id_of(value: str | None) -> str:
    """The client's ``x-request-id`` when it is 1-128 safe characters, else a new random id."""
    if value and len(value) <= 128 and all(c in _ALLOWED_RID for c in value):
        return value
    return os.urandom(16).hex()


class DelayedResponse(Response):
    """A ``Response`` sent ``delay_seconds`` after the app hands it over (the request's task
    sleeps; nothing else is held but its connection)."""

    def __init__(self, *args: Any, delay_seconds: float, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.delay_seconds = delay_seconds

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await asyncio.sleep(self.delay_seconds)
        await super().__call__(scope, receive, send)


def refusal(gw: HandlerContext, err: OpenAIError, arrival: Arrival[Route], tenant: str) -> Response:
    """The JSON error answer of a refused request (``tenant``: its id, ``"-"`` before
    authentication succeeded), counted and access-logged under its route's name. A 401 before any
    tenant is known (no valid key, every route) is sent ``gateway.refusal_delay_seconds`` later
    (:class:`DelayedResponse`; counted, logged and its ``x-kvgate-overhead-ms`` measured
    without the delay): a client guessing keys, or flooding the gateway with requests it may
    not make, waits that long for each answer; the server layer delays a 431 as long
    (:mod:`gateway.edge.protocol`). In ``bench/hostile.py``, 100 unauthenticated sockets that reconnected
    as soon as they were answered had cost a fifth of the event loop (515 refusals a second)."""
    rid, route = arrival.request_id, arrival.route
    overhead = time.perf_counter() - arrival.t_perf
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
            "param": loggable_param(err.param),
            "overhead_ms": round(overhead * 1000, 3),
            **({"prompt_tokens": err.prompt_tokens} if err.prompt_tokens is not None else {}),
        }
    )
    delay = gw.settings.gateway.refusal_delay_seconds if err.status == 401 and tenant == "-" else 0.0
    if delay > 0:
        return DelayedResponse(
            err.body_bytes(),
            status_code=err.status,
            media_type="application/json",
            headers=headers,
            delay_seconds=delay,
        )
    return Response(err.body_bytes(), status_code=err.status, media_type="application/json", headers=headers)


def client_gone(gw: HandlerContext, arrival: Arrival[Route], tenant: str, refused: tuple[int, str] | None) -> Response:
    """The 499 of a request whose client left before its body was all read (``ClientGone``): nobody
    reads it, but it is counted as the relay counts a client that left during its answer
    (``kvgate_requests_total`` status 499 under ``tenant`` and its route;
    ``kvgate_client_disconnects_total``; the overhead) and access-logged with
    ``client_disconnected``. With ``refused`` (``ClientGone.refused``: the server layer answered
    the request ``(status, code)`` itself and closed the connection, so the app saw a disconnect:
    a body too slow, 408 ``request_timeout``) it is recorded as that answer, the one the client
    got: that status, ``kvgate_rejections_total`` under ``code``, no client disconnect, the access
    line with ``error_code``. Stock uvicorn answers no such refusal and says nothing
    (:func:`gateway.edge.extensions.refusal_of`): there it stays a 499."""
    route = arrival.route
    overhead = time.perf_counter() - arrival.t_perf
    m = gw.metrics
    why: dict[str, Any]
    if refused is None:
        status, why = 499, {"client_disconnected": True}
        m.client_disconnects.labels(route).inc()
    else:
        status, code = refused
        why = {"error_code": code}
        m.rejections.labels(code).inc()
    m.requests.labels(tenant, route, str(status)).inc()
    m.overhead.labels(route).observe(overhead)
    glog.access(
        {
            "request_id": arrival.request_id,
            "tenant": tenant,
            "route": route,
            "status": status,
            **why,
            "overhead_ms": round(overhead * 1000, 3),
        }
    )
    return Response(status_code=status)


async def prologue(
    gw: HandlerContext, request: Request, route: R, step: Callable[[Arrival[R]], Awaitable[T]]
) -> tuple[Arrival[R], T] | Response:
    """Admission's prologue, shared by every route: the request's :class:`Arrival` (its request
    id: the client's ``x-request-id`` when safe, else a new one; its start time), then ``step``
    on it, which authenticates first (:func:`~gateway.admission.admit.authenticate_request`;
    :func:`~gateway.admission.admit.begin_request` for a route that reads a body; the whole of
    :func:`~gateway.admission.admit.admit` for a forwarded one). Returns ``(arrival, what step
    returned)``, or the :func:`refusal` answering the :class:`Refused` it raised, or the
    :func:`client_gone` 499 of a ``ClientGone`` (the client left while its body arrived; the
    server layer's own answer when it gave one: a body too slow's 408), under the tenant it carries."""
    arrival = Arrival(request_id_of(request.headers.get("x-request-id")), route, time.perf_counter())
    try:
        return arrival, await step(arrival)
    except Refused as r:
        return refusal(gw, r.error, arrival, r.tenant_id)
    except ClientGone as gone:
        return client_gone(gw, arrival, gone.tenant_id, gone.refused)


async def handle_completion(gw: HandlerContext, request: Request, route: ApiRoute) -> Response:
    """``POST`` to an admitted and forwarded route (:data:`gateway.routes.API_ROUTES`: chat,
    completions, Responses, embeddings)."""
    opened = await prologue(gw, request, route, lambda arrival: admit(gw, request, arrival))
    if isinstance(opened, Response):
        return opened
    outcome = RelayOutcome(opened[1], client=client_of(request.receive))
    return RelayResponse(relay(gw, outcome), outcome, on_close=lambda: finish(gw, outcome))


def _model_object(gw: HandlerContext, entry: ModelEntry, tenant: TenantConfig) -> dict[str, Any]:
    """One model as ``/v1/models`` lists it (OpenAI's model object: ``id``, ``object`` ``"model"``,
    ``created`` (unix seconds), ``owned_by``; vLLM's ``root`` and ``max_model_len``): ``max_model_len``
    is ``tenant``'s effective limit on ``entry`` now, in tokens (``null`` while the pool is unknown)."""
    _, pool_limit = gw.upstreams.eligible(entry.id)
    return {
        "id": entry.id,
        "object": "model",
        "created": gw.started_at,
        "owned_by": "kvgate",
        "root": entry.id,
        "max_model_len": effective_limit(entry, tenant, pool_limit) if pool_limit is not None else None,
    }


def _json(body: dict[str, Any], arrival: Arrival[Route], request: Request) -> Response:
    """A ``GET``'s JSON answer; one that announced a body (never read) closes its connection."""
    overhead_ms = (time.perf_counter() - arrival.t_perf) * 1000
    headers = {"x-request-id": arrival.request_id, "x-kvgate-overhead-ms": f"{overhead_ms:.3f}"}
    if body_declared(request.headers):
        headers["connection"] = "close"
    return Response(orjson.dumps(body), media_type="application/json", headers=headers)


class ModelsRoute:
    """``GET /v1/models`` and ``/v1/models/{model_id}`` as a route value (:data:`MODELS`): answered
    from the gateway's model index, without a body."""

    name = "models"
    path = "/v1/models"


MODELS = ModelsRoute()


async def handle_models(gw: HandlerContext, request: Request) -> Response:
    """``GET /v1/models``: the tenant's models; ``max_model_len`` is its effective limit now
    (``null`` while the pool is unknown)."""

    async def authenticated(arrival: Arrival[ModelsRoute]) -> TenantConfig:
        return authenticate_request(gw, request)

    opened = await prologue(gw, request, MODELS, authenticated)
    if isinstance(opened, Response):
        return opened
    arrival, tenant = opened
    data = [_model_object(gw, entry, tenant) for entry in gw.models.allowed(tenant)]
    gw.metrics.requests.labels(tenant.id, MODELS.name, "200").inc()
    return _json({"object": "list", "data": data}, arrival, request)


async def handle_model(gw: HandlerContext, request: Request, model_id: str) -> Response:
    """``GET /v1/models/{model_id}`` (OpenAI's "Retrieve model"; the SDK's ``models.retrieve``): the
    object ``/v1/models`` lists for that model, its canonical ``id`` even when ``model_id`` is an
    alias. Authentication comes first (401 before anything about the model); a model that is
    unknown or that the tenant may not use is 404 ``model_not_found`` in OpenAI's error shape
    (the same answer for both, so a tenant cannot probe for other tenants' models)."""

    async def resolved(arrival: Arrival[ModelsRoute]) -> tuple[TenantConfig, ModelEntry]:
        tenant = authenticate_request(gw, request)
        try:
            return tenant, gw.models.resolve(tenant, model_id)
        except OpenAIError as e:
            raise Refused(closing(e) if body_declared(request.headers) else e, tenant.id) from None

    opened = await prologue(gw, request, MODELS, resolved)
    if isinstance(opened, Response):
        return opened
    arrival, (tenant, entry) = opened
    gw.metrics.requests.labels(tenant.id, MODELS.name, "200").inc()
    return _json(_model_object(gw, entry, tenant), arrival, request)
