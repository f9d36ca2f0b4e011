"""The handler of ``POST /tokenize`` and ``/detokenize`` (also under ``/v1/``; the route values
are :mod:`gateway.routes.tokenize`). ``max_model_len`` is the tenant's live effective limit
(``null`` while the pool is unknown), so a client can pre-check exactly: ``count + max_tokens <=
max_model_len``. Each call goes through admission's prologue (:mod:`gateway.admission.admit`):
one request against RPM and a concurrency lease before its body is read, the body read,
density-checked and parsed (off the loop when large) as admission does, then the route's
validation, the model (its task must serve the route), the route's answer, and the route's
``guard``: an engine's ``/detokenize`` text goes through the tenant's verifier guard.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import orjson
from starlette.requests import Request
from starlette.responses import Response

from config.errors import ErrorCode, OpenAIError
from config.models import TenantConfig
from gateway.admission.admit import Arrival, begin_request, read_request
from gateway.admission.body import ClientGone
from gateway.admission.gate import effective_limit
from gateway.admission.registry import ModelEntry
from gateway.admission.route import RouteBase, check_task
from gateway.ops import access_log as glog
from gateway.quotas.stage import QuotaLease
from gateway.routes.handlers import HandlerContext, client_gone, prologue, refusal
from tokenizer import TokenizerError
from verifier.stage import VerifierStage


class TokenRoute(RouteBase, Protocol):
    """``/tokenize`` or ``/detokenize`` (:mod:`gateway.routes.tokenize`)."""

    async def answer(
        self, entry: ModelEntry, body: dict[str, Any], limit: int, max_model_len: int | None
    ) -> tuple[dict[str, Any], int]: ...

    async def guard(
        self,
        verifier: VerifierStage,
        arrival: Arrival[Any],
        tenant: TenantConfig,
        entry: ModelEntry,
        body: dict[str, Any],
        answer: dict[str, Any],
    ) -> None: ...


async def _answer(
    gw: HandlerContext,
    request: Request,
    arrival: Arrival[Any],
    tenant: TenantConfig,
    lease: QuotaLease,
    route: TokenRoute,
) -> tuple[ModelEntry, dict[str, Any], int]:
    """``(model, answer, tokens to charge)`` for a begun request: admission's body prologue
    (:func:`gateway.admission.admit.read_request`), validation, the model, the too-long shortcut, the
    answer, an engine's text through the tenant's verifier guard (the route's ``guard``: 502
    ``response_withheld``); a ``/tokenize`` count above :data:`TOKENIZE_FREE_TOKENS` is reserved
    against TPM (429 over it). Raises :class:`OpenAIError` or ``ClientGone``."""
    body, _ = await read_request(gw, request, tenant, route.id_fields)
    route.validate(body)
    entry = gw.models.resolve(tenant, body.get("model"))
    check_task(entry, route)
    _, pool_limit = gw.upstreams.eligible(entry.id)
    max_model_len = effective_limit(entry, tenant, pool_limit) if pool_limit is not None else None
    limit = max_model_len if max_model_len is not None else entry.config.context_length
    try:
        answer, charge = await route.answer(entry, body, limit, max_model_len)
    except TokenizerError as e:
        raise e.to_openai() from None
    except NotImplementedError:
        raise OpenAIError(
            400, f"The model `{entry.id}`'s tokenizer cannot answer {route.name}.", code=ErrorCode.INVALID_REQUEST
        ) from None
    await route.guard(gw.verifier, arrival, tenant, entry, body, answer)
    if charge:
        await gw.quotas.reserve_tokens(tenant, lease, charge)
    return entry, answer, charge


async def handle_tokenize(gw: HandlerContext, request: Request, route: TokenRoute) -> Response:
    """``POST /tokenize`` (``route`` :data:`~gateway.routes.tokenize.TOKENIZE`) or ``/detokenize``
    (:data:`~gateway.routes.tokenize.DETOKENIZE`), and their ``/v1/`` aliases, through admission's
    own prologue (:func:`gateway.routes.handlers.prologue`): auth and one request against RPM
    (and a concurrency lease) before the body is read (:func:`gateway.admission.admit.begin_request`),
    the body read, density-checked and parsed as admission does, then validation, the model (its
    task must serve the route) and the answer from the model's counter; OpenAI-shaped errors like
    every route."""
    opened = await prologue(gw, request, route, lambda arrival: begin_request(gw, request, arrival.request_id))
    if isinstance(opened, Response):
        return opened
    arrival, (tenant, lease) = opened
    charged = 0
    try:
        entry, answer, charged = await _answer(gw, request, arrival, tenant, lease, route)
    except OpenAIError as e:
        return refusal(gw, e, arrival, tenant.id)
    except ClientGone as gone:
        return client_gone(gw, arrival, tenant.id, gone.refused)
    finally:
        await gw.quotas.settle(lease, charged)
    rid = arrival.request_id
    overhead = time.perf_counter() - arrival.t_perf
    out = {"x-request-id": rid, "x-kvgate-overhead-ms": f"{overhead * 1000:.3f}", **lease.headers}
    gw.metrics.requests.labels(tenant.id, route.name, "200").inc()
    gw.metrics.overhead.labels(route.name).observe(overhead)
    glog.access(
        {
            "request_id": rid,
            "tenant": tenant.id,
            "route": route.name,
            "status": 200,
            "model": entry.id,
            "prompt_tokens": answer.get("count"),
            "overhead_ms": round(overhead * 1000, 3),
        }
    )
    return Response(orjson.dumps(answer), media_type="application/json", headers=out)
