"""Steps 1-6 of a request's way through the gateway, as one stage (docs/design.md): ``admit`` either
refuses a request (:class:`Refused`) or returns one :class:`Admitted` record, with the quota
reserved, that the relay (:mod:`gateway.relay.proxy`) forwards and :mod:`gateway.relay.finish` settles.

In that order, each step a call into the module that owns it (docs/gateway.md, "Refuse
before working": a refusal comes before the work it would waste):

1. authenticate from the ``Authorization`` header (:mod:`gateway.admission.auth`), then take one request
   against RPM and the concurrency lease (:meth:`gateway.quotas.stage.QuotaStage.begin`), before any
   byte of the body is read (:func:`begin_request`): neither an unauthenticated client nor a
   tenant over its limits makes the gateway read or parse a body;
2. read the body (size limit) and parse it as strict JSON (:func:`read_request`,
   :mod:`gateway.admission.body`), in a worker thread when it is larger than
   :data:`OFFLOAD_BODY_BYTES`: its token-id arrays cut out and parsed in slices, after refusing
   (413) one that holds more than ``gateway.max_body_values`` other JSON values
   (:mod:`gateway.admission.density`);
3. validate it against the route's field table (the route value, :mod:`gateway.admission.route`:
   ``route.validate``), and check that the model's ``task`` serves the route;
4. resolve the model (:mod:`gateway.admission.registry`), read the pool limit once, count the
   prompt (``route.count``), apply the route's gate (``route.decide``, :mod:`gateway.admission.gate`); a
   batch above the tenant's ``max_sequences_per_request`` is refused before it is counted, and a
   request whose counting is costly is counted off the event loop, on the tenant's share of the
   offload threads (:mod:`gateway.edge.offload`); an unknown or stale pool is 503
   ``pool_size_unknown`` (fail closed);
5. skip the upstreams the verifier quarantined for prompts of this length (none left: 503) and
   build the body to forward (``route.forward_body``);
6. reserve the request's tokens against TPM (:meth:`gateway.quotas.stage.QuotaStage.reserve_tokens`)
   and index the prompt (:meth:`verifier.stage.VerifierStage.admit`: token-id prompts decoded by
   the counter's :meth:`~tokenizer.base.PromptCounter.prompt_decoder`, an engine tokenizer's
   answers to them reading one byte budget in all, sized by their ids; the prompt fingerprinted
   and indexed, on this request's own time, before it can be forwarded); a small prompt is
   fingerprinted first and its index write rides the reservation's Redis round trip, made only if
   the reservation was (:func:`_reserve_and_index`): a refused prompt is never indexed.

A request refused after step 1 has its lease released and its tokens refunded
(``settle(lease, 0)``); its RPM entry stays spent, so invalid requests cost their sender RPM.

A small body already in memory (:data:`COMBINED_BODY_BYTES`) takes step 1's quota call together
with step 6's (:func:`_admit_counted`; docs/quotas.md, "Both steps in one round trip"): the same
answers and the same Redis state, one round trip instead of two.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import orjson
from starlette.requests import Request

from config.errors import ErrorCode, OpenAIError
from config.models import Settings, TenantConfig
from gateway.admission.auth import authenticate
from gateway.admission.body import ClientGone, body_declared, closing, parse_json_body, read_body
from gateway.admission.density import BadIds, StringDensity, count_ids, restore_ids, split_ids, values_over
from gateway.admission.gate import Admission, client_wants_usage, effective_limit, nested_too_deeply, over_context_error
from gateway.admission.registry import ModelEntry, ModelIndex
from gateway.admission.route import ApiRoute, Route, check_task
from gateway.edge import offload
from gateway.edge.body_budget import FREE_BODY_BYTES, BodyBudget
from gateway.edge.extensions import completion_of, refusal_of
from gateway.ops.tenants import TenantRegistry
from gateway.quotas.stage import QuotaLease, QuotaStage
from gateway.relay.upstreams import Upstream, UpstreamSet
from verifier.stage import Decoder, Exchange, ExchangeRequest, VerifierStage

#: A body larger than this (bytes) is parsed, and its forwarded form encoded, in a worker thread:
#: orjson builds one object per element, and 64 KiB of ``[""]`` is about 22,000 of them (about a
#: millisecond); an 8 MiB body would hold the event loop for tens of milliseconds.
OFFLOAD_BODY_BYTES = FREE_BODY_BYTES


def too_many_values(max_values: int, over: int) -> OpenAIError:
    """The 413 for a body with more than ``max_values`` values (``over``: a lower bound of its
    commas outside strings, :func:`gateway.admission.density.values_over` or
    :class:`gateway.admission.density.StringDensity`)."""
    return OpenAIError(
        413,
        f"The request body holds more than {max_values} JSON values besides its token-id arrays "
        f"({over + 1} or more); send fewer prompts or messages per request.",
        code=ErrorCode.REQUEST_TOO_LARGE,
    )


def _density_check(max_values: int):
    """A ``read_body`` check refusing (413) a body whose strings alone prove more than
    ``max_values`` values (:class:`gateway.admission.density.StringDensity`), as the read goes."""
    density = StringDensity(max_values)

    def check(chunk: bytes) -> None:
        over = density.feed(chunk)
        if over is not None:
            raise too_many_values(max_values, over)

    return check


def _parse_large(
    raw: bytes,
    max_values: int,
    max_ids: Callable[[dict], int | None] | None = None,
    id_fields: tuple[str, ...] = ("prompt", "input"),
) -> dict:
    """Parse a large body in a worker thread: its token-id arrays cut out
    (:func:`gateway.admission.density.split_ids`), a body whose other values are more than ``max_values``
    refused (413, :func:`gateway.admission.density.values_over`) before any parse, the rest parsed, then
    the token-id arrays parsed in slices and put back. ``max_ids(body)``: the most ids one prompt
    may hold for the parsed rest's model (its ``context_length``; ``None``: unknown); a longer
    token-id array is refused (400 ``context_length_exceeded``) before its ids are parsed (two
    million ids: 25 ms of parsing and 10 ms of checking, in one-millisecond GIL holds, saved).
    Raises :class:`OpenAIError` 413, 400 for a body that is not JSON, or that 400."""
    skeleton, ids = split_ids(raw)
    over = values_over(skeleton, max_values)
    if over is not None:
        raise too_many_values(max_values, over)
    body = parse_json_body(skeleton)
    field = next((f for f in id_fields if f in body), id_fields[-1])
    prompts = body.get(field)
    markers = [m for m in (prompts if isinstance(prompts, list) else [prompts]) if type(m) is int and m in ids]
    cap = max_ids(body) if markers and max_ids is not None else None
    if cap is not None:  # only the prompts' arrays: any other (a field's) is validated as usual
        longest = max(count_ids(ids[m]) for m in markers)
        if longest > cap:
            raise over_context_error(cap, longest, field)
    try:
        restore_ids(body, ids)
    except BadIds as e:
        raise OpenAIError(
            400, f"We could not parse the JSON body of your request ({e}).", code=ErrorCode.INVALID_REQUEST
        ) from None
    return body


class AdmitContext(Protocol):
    """What admission reads from the gateway (``gateway.app.Gateway`` provides it)."""

    settings: Settings
    tenants: TenantRegistry
    models: ModelIndex
    upstreams: UpstreamSet
    quotas: QuotaStage
    verifier: VerifierStage
    body_budget: BodyBudget | None

    def cache_salt(self, tenant_id: str) -> str: ...


#: the route an :class:`Arrival` came in on (an arrival on a chat route is an arrival on a route)
_R = TypeVar("_R", bound=Route, covariant=True)


@dataclass(frozen=True, slots=True)
class Arrival(Generic[_R]):
    """A request as it arrived: ``request_id`` (the client's ``x-request-id`` or a new one),
    ``api`` (its route value: :class:`gateway.admission.route.ApiRoute` for a request admission
    forwards), ``t_perf`` (``time.perf_counter()`` at arrival)."""

    request_id: str
    api: _R
    t_perf: float

    @property
    def route(self) -> str:
        """The route's name (``chat``, ``completions``, ``responses``, ``embeddings``,
        ``tokenize``, ``detokenize``, ``models``): the metrics and access-log label."""
        return self.api.name


@dataclass(frozen=True)
class Forward:
    """What goes upstream: ``body`` (JSON bytes: model rewritten, the tenant's ``cache_salt``,
    defaulted ``max_tokens``, ``stream_options.include_usage`` on streams); ``stream``;
    ``strip_usage``: the gateway asked for the usage chunk on the client's behalf, so the relay
    removes it (and the ``"usage": null`` members) again."""

    body: bytes
    stream: bool
    strip_usage: bool


@dataclass(frozen=True)
class Admitted:
    """An admitted request: who (``tenant``), what admission decided (``admission``: model, token
    counts, limit), the quota ``lease`` (settled exactly once by :func:`gateway.relay.finish.finish`),
    the upstreams it may go to (``candidates``: known pool, not quarantined) and ``forward``;
    ``exchange``: the request as the verifier saw it at admission (the relay names its upstream)."""

    arrival: Arrival[ApiRoute]
    tenant: TenantConfig
    admission: Admission
    lease: QuotaLease
    candidates: list[Upstream]
    forward: Forward
    exchange: Exchange | None = None


class Refused(Exception):
    """Admission refused the request: ``error`` is the answer; ``tenant_id`` is ``"-"`` before
    authentication succeeded (for metrics and the access log)."""

    def __init__(self, error: OpenAIError, tenant_id: str) -> None:
        super().__init__(error.message)
        self.error = error
        self.tenant_id = tenant_id


def authenticate_request(ctx: AdmitContext, request: Request) -> TenantConfig:
    """Step 1's authentication, from the ``Authorization`` header alone, for every route; the
    offloaded work that follows takes this tenant's share (:func:`gateway.edge.offload.set_tenant`).
    Raises :class:`Refused` 401, with ``connection: close`` when a body was announced (it is
    never read)."""
    headers = request.headers
    try:
        tenant = authenticate(headers.getlist("authorization"), ctx.tenants)
    except OpenAIError as e:  # the body is never read: the connection is not kept for it
        raise Refused(closing(e) if body_declared(headers) else e, "-") from None
    offload.set_tenant(tenant.id)
    return tenant


async def begin_request(ctx: AdmitContext, request: Request, request_id: str) -> tuple[TenantConfig, QuotaLease]:
    """Step 1, shared by every route that reads a body: authenticate from the headers, then take
    the request's RPM entry and concurrency lease (:meth:`gateway.quotas.stage.QuotaStage.begin`),
    before any byte of the body is read (:func:`authenticate_request`). Returns ``(tenant,
    lease)``; the caller settles the lease. Raises :class:`Refused` (401, 429, 503), with
    ``connection: close`` when a body was announced (it is never read)."""
    tenant = authenticate_request(ctx, request)
    return tenant, await _begin(ctx, tenant, request_id, unread=body_declared(request.headers))


async def _begin(ctx: AdmitContext, tenant: TenantConfig, request_id: str, *, unread: bool) -> QuotaLease:
    """:meth:`gateway.quotas.stage.QuotaStage.begin`; its refusal as :class:`Refused`, with
    ``connection: close`` when a body is left ``unread``."""
    try:
        return await ctx.quotas.begin(tenant, request_id)
    except OpenAIError as e:  # refused before working: nothing of the body is read or parsed
        raise Refused(closing(e) if unread else e, tenant.id) from None


#: A request whose body is at most this many bytes and is in the server's memory when admission
#: starts, or one turn of the event loop later (:func:`_received_small`), is decided by one quota
#: call once it is counted (:func:`_admit_counted`): counting such a body before its RPM decision
#: costs less than the Redis round trip it saves.
COMBINED_BODY_BYTES = 32 * 1024


async def _received_small(request: Request) -> bool:
    """Whether ``request`` declared a body of at most :data:`COMBINED_BODY_BYTES` and the server
    holds all of it already (reading it waits for nothing). Most HTTP clients write a request's
    head and body apart (``http.client``, httpx), so a body not yet in gets one turn of the event
    loop, in which the server reads what its socket holds, and is asked about again."""
    length = request.headers.get("content-length")
    complete = completion_of(request.scope)
    if complete is None or length is None or not length.isdigit() or int(length) > COMBINED_BODY_BYTES:
        return False  # another server (it says nothing), no length, or a large body
    if complete():
        return True
    await asyncio.sleep(0)
    return complete()


async def admit(ctx: AdmitContext, request: Request, arrival: Arrival[ApiRoute]) -> Admitted:
    """Run steps 1-6 (module docstring) for ``request``. Raises :class:`Refused` (an OpenAI error:
    401, 400, 404, 413, 429, 503, ...) or ``gateway.admission.body.ClientGone`` (the client left while
    its body was arriving, or the server layer answered it itself, a body too slow its 408; with
    the tenant's id, :func:`read_request`). A request refused after step 1 has its lease released and its tokens
    refunded (its RPM entry stays spent); the returned one's lease is settled by
    :func:`gateway.relay.finish.finish`. A small body that arrived with its head goes through
    :func:`_admit_counted` when the quota stage :meth:`~gateway.quotas.stage.QuotaStage.combines`
    its two calls (the same outcomes, one round trip)."""
    tenant = authenticate_request(ctx, request)
    if ctx.quotas.combines(tenant) and await _received_small(request):
        return await _admit_counted(ctx, request, arrival, tenant)
    lease = await _begin(ctx, tenant, arrival.request_id, unread=body_declared(request.headers))
    try:
        return await _admit_tenant(ctx, request, arrival, tenant, lease)
    except BaseException as e:
        await ctx.quotas.settle(lease, 0)
        if isinstance(e, OpenAIError):
            raise Refused(e, tenant.id) from None
        raise


async def _admit_counted(
    ctx: AdmitContext, request: Request, arrival: Arrival[ApiRoute], tenant: TenantConfig
) -> Admitted:
    """Steps 2-5, then step 1's RPM entry and lease with step 6's tokens and index write in one
    quota call (:func:`_begin_and_index`): for a small body already received, whose reading waits
    for nothing. Outcomes as :func:`admit`'s other order: a request refused by its own content
    (400, 404, 413, 503) is answered as step 1 would have answered it first (its RPM entry spent,
    or the tenant's 429 when it is over RPM or concurrency); a refusal for RPM or concurrency
    sends the tenant's next requests through step 1 first (``combines``). A client gone before
    its received body was read spends no RPM entry."""
    route = arrival.api
    try:
        body, large = await read_request(ctx, request, tenant, route.id_fields)
        adm, candidates, served = await _count_and_decide(ctx, tenant, body, route)
        forward = await _forward(body, route, adm, ctx.cache_salt(tenant.id), served, large)
    except OpenAIError as e:
        await ctx.quotas.settle(await _begin(ctx, tenant, arrival.request_id, unread=False), 0)
        raise Refused(e, tenant.id) from None
    exchange = verifier_exchange(arrival, tenant, adm, body, forward.stream) if route.verified else None
    lease = await _begin_and_index(ctx, tenant, arrival.request_id, adm, exchange)
    return Admitted(arrival, tenant, adm, lease, candidates, forward, exchange)


async def read_request(
    ctx: AdmitContext, request: Request, tenant: TenantConfig, id_fields: tuple[str, ...] = ("prompt", "input")
) -> tuple[dict[str, Any], bool]:
    """Step 2, shared by every route that reads a body: ``(body, large)``. The body is read up to
    ``gateway.max_body_bytes`` (paced past its first 64 KiB by the body budget; one that may be
    large is density-checked as it arrives, :func:`_density_check`) and parsed as strict JSON;
    ``large`` (over :data:`OFFLOAD_BODY_BYTES`): parsed in a worker thread (:func:`_parse_large`),
    a token-id array in one of ``id_fields`` longer than the effective limit refused before its
    ids are parsed. Raises :class:`OpenAIError` (413, 400) or ``ClientGone``, which carries
    ``tenant``'s id and the answer the server layer gave the request itself, if it did
    (:func:`gateway.edge.extensions.refusal_of`)."""
    headers = request.headers
    length = headers.get("content-length")
    small = length is not None and length.isdigit() and int(length) <= OFFLOAD_BODY_BYTES
    # a body that may be large is counted as it arrives: a dense one is refused before it is all read
    check = None if small else _density_check(ctx.settings.gateway.max_body_values)
    pace = ctx.body_budget.pacer(tenant.id) if ctx.body_budget is not None else None
    try:
        raw = await read_body(request.receive, length, ctx.settings.gateway.max_body_bytes, check, pace)
    except ClientGone:
        raise ClientGone(tenant.id, refusal_of(request.scope)) from None
    if len(raw) <= OFFLOAD_BODY_BYTES:
        return parse_json_body(raw), False

    def max_ids(skeleton: dict) -> int | None:  # the effective limit, before any id is parsed
        try:
            model = ctx.models.resolve(tenant, skeleton.get("model"))
        except OpenAIError:
            return None  # the model is refused later, in order
        _, live = ctx.upstreams.eligible(model.id)
        return model.config.context_length if live is None else effective_limit(model, tenant, live)

    args = (raw, ctx.settings.gateway.max_body_values, max_ids, id_fields)
    return await asyncio.to_thread(_parse_large, *args), True


def _pool_unknown(entry: ModelEntry) -> OpenAIError:
    return OpenAIError(
        503,
        f"The live KV pool size of the engines serving '{entry.id}' is unknown or "
        "stale; refusing rather than risking a silent rejection. Retry shortly.",
        code=ErrorCode.POOL_SIZE_UNKNOWN,
        headers={"Retry-After": "1"},
    )


async def _count_and_decide(
    ctx: AdmitContext, tenant: TenantConfig, body: dict[str, Any], route: ApiRoute
) -> tuple[Admission, list[Upstream], list[Upstream]]:
    """Steps 3-5: validate, resolve the model, count, gate, filter the upstreams; the pool limit
    is read once, before counting (a too-long prompt's 400 quotes it). Returns ``(admission,
    candidates, the upstreams serving the model)``. Raises :class:`OpenAIError`."""
    route.validate(body)
    entry = ctx.models.resolve(tenant, body.get("model"))
    check_task(entry, route)
    served = ctx.upstreams.by_model.get(entry.id, [])
    candidates, pool_limit = ctx.upstreams.eligible(entry.id)
    prompt = await route.count(entry, tenant, body, served, pool_limit)
    if pool_limit is None:
        raise _pool_unknown(entry)
    adm = route.decide(entry, tenant, body, prompt, pool_limit)
    candidates = [u for u in candidates if not ctx.verifier.is_quarantined(u.name, adm.prompt_tokens)]
    if not candidates:
        raise OpenAIError(
            503,
            "Every upstream engine for this model is quarantined for prompts of this length.",
            code=ErrorCode.UPSTREAM_UNAVAILABLE,
        )
    return adm, candidates, served


async def _forward(
    body: dict[str, Any], route: ApiRoute, adm: Admission, salt: str, served: list[Upstream], large: bool
) -> Forward:
    """Step 6's body to forward (in a worker thread for a large body). Raises :class:`OpenAIError`
    400 for a body nested too deeply to encode."""
    stream = route.streams and bool(body.get("stream"))
    strip_usage = stream and route.adds_usage and not client_wants_usage(body)  # before the body asks for usage
    args = (body, adm, salt, served)
    try:
        forwarded = await asyncio.to_thread(route.forward_body, *args) if large else route.forward_body(*args)
    except orjson.JSONEncodeError:  # orjson writes 254 levels of nesting at most (it reads 1024)
        raise nested_too_deeply() from None
    return Forward(forwarded, stream, strip_usage)


async def _admit_tenant(
    ctx: AdmitContext, request: Request, arrival: Arrival[ApiRoute], tenant: TenantConfig, lease: QuotaLease
) -> Admitted:
    route = arrival.api
    body, large = await read_request(ctx, request, tenant, route.id_fields)
    adm, candidates, served = await _count_and_decide(ctx, tenant, body, route)
    forward = await _forward(body, route, adm, ctx.cache_salt(tenant.id), served, large)
    exchange = verifier_exchange(arrival, tenant, adm, body, forward.stream) if route.verified else None
    await _reserve_and_index(ctx, tenant, lease, adm, exchange)
    return Admitted(arrival, tenant, adm, lease, candidates, forward, exchange)


async def _reserve_and_index(
    ctx: AdmitContext, tenant: TenantConfig, lease: QuotaLease, adm: Admission, exchange: Exchange | None
) -> None:
    """Step 6: reserve the request's tokens (TPM) and index its prompt (``exchange``; ``None``
    for a route without output text to verify), so that only an admitted prompt is ever indexed.
    A prompt whose writes the verifier can hand back (:meth:`verifier.stage.VerifierStage.defers`:
    small, Redis stores) is fingerprinted first and its writes ride the reservation's round trip,
    each made only if the reservation was (one round trip for both; ``discard`` on refusal);
    any other is indexed after the reservation admitted it. Raises :class:`OpenAIError` as
    :meth:`gateway.quotas.stage.QuotaStage.reserve_tokens`."""
    if exchange is None or not ctx.verifier.defers(exchange):
        await ctx.quotas.reserve_tokens(tenant, lease, adm.reserve_tokens)
        if exchange is not None:
            await ctx.verifier.admit(exchange, _decoder(adm, exchange))
        return
    pending = await ctx.verifier.admit(exchange, _decoder(adm, exchange), defer_write=True)
    if pending is None:  # verification off, or the ingest budget full: nothing to send
        await ctx.quotas.reserve_tokens(tenant, lease, adm.reserve_tokens)
        return
    try:
        await ctx.quotas.reserve_tokens(tenant, lease, adm.reserve_tokens, also=pending)
    except BaseException:
        pending.discard()  # refused (or the request is gone): its prompt is never indexed
        raise
    finally:
        await pending.finish()


async def _begin_and_index(
    ctx: AdmitContext, tenant: TenantConfig, request_id: str, adm: Admission, exchange: Exchange | None
) -> QuotaLease:
    """:func:`_reserve_and_index` with the request's RPM entry and lease taken in the same quota
    call (:meth:`gateway.quotas.stage.QuotaStage.begin_reserve`): a deferred index write rides it,
    made only if the tokens were reserved; any other prompt is indexed once admitted. Returns the
    held lease. Raises :class:`Refused` (429, 503), nothing held."""
    defers = exchange is not None and ctx.verifier.defers(exchange)
    pending = None
    if exchange is not None and defers:
        pending = await ctx.verifier.admit(exchange, _decoder(adm, exchange), defer_write=True)
    try:
        lease = await ctx.quotas.begin_reserve(tenant, request_id, adm.reserve_tokens, also=pending)
    except BaseException as e:
        if pending is not None:
            pending.discard()  # refused (or the request is gone): its prompt is never indexed
            await pending.finish()
        if isinstance(e, OpenAIError):
            raise Refused(e, tenant.id) from None
        raise
    try:  # the lease is held from here: whatever ends the request now releases it
        if pending is not None:
            await pending.finish()
        if exchange is not None and not defers:
            await ctx.verifier.admit(exchange, _decoder(adm, exchange))
    except BaseException:
        await ctx.quotas.settle(lease, 0)
        raise
    return lease


def _decoder(adm: Admission, exchange: Exchange) -> Decoder:
    """The decoder of ``exchange``'s token-id prompts, made once per request by the model's counter."""
    return adm.model.counter.prompt_decoder(exchange.prompt_ids)


def verifier_exchange(
    arrival: Arrival[ApiRoute], tenant: TenantConfig, adm: Admission, body: dict[str, Any], stream: bool
) -> Exchange:
    """The request as the verifier sees it (its upstream is named once the relay picked one):
    the prompt's text; a completions request's token-id prompts (``prompt_ids``, which the
    verifier decodes); ``echo`` and the texts an echo would repeat (each string prompt; a chat's
    last message). ``started_monotonic`` is the arrival, on the monotonic clock."""
    ids, echo_prompts = arrival.api.verifier_prompts(body)
    started_monotonic = time.monotonic() - (time.perf_counter() - arrival.t_perf)
    return Exchange(
        ExchangeRequest(
            arrival.request_id,
            tenant,
            "",
            adm.model.id,
            adm.prompt_tokens,
            stream,
            started_monotonic,
            prompt_tokens_total=adm.prompt_tokens_total if adm.num_prompts > 1 else None,
        ),
        adm.prompt_text,
        prompt_ids=ids,
        echo=body.get("echo") is True,
        echo_prompts=echo_prompts,
    )
