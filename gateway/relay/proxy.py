"""Step 7 (and the hook of 8): forward an admitted request and relay the answer (docs/design.md, "A
request's way through the gateway", "Error bodies").

:func:`relay` is an async iterator of the bytes to send the client; when it ends (however it
ends) it leaves the frozen :class:`~gateway.relay.stream.Produced` record of what the engine
produced on the :class:`RelayOutcome`, which :func:`gateway.relay.finish.finish` then settles and
logs. The transport (ASGI messages, client disconnect, the status) is
:mod:`gateway.relay.response`'s. In order:

- :func:`open_upstream` tries the candidates in balance order; a connect failure (refused,
  connect timeout, pool full) moves to the next before any byte is sent; the last failure is 503
  ``upstream_unavailable`` (504 ``upstream_timeout`` when it timed out). A candidate whose origin
  the tenant already holds its share of (``gateway.upstream_tenant_share``,
  :class:`~gateway.relay.upstreams.TenantShare`), or whose connections are all held, is tried
  after the others that are not backing off, once its share hands the tenant a connection given
  back (fairest first; that wait and the wait for a pooled connection after it: at most
  ``connect_timeout`` together; in vain, as a pool wait in vain); upstreams backing off come
  after that;
- an engine's non-200 answer, or a JSON answer to a stream request, is mapped to the OpenAI
  shape with the engine's status (:func:`verifier.engine_response.engine_error`), its 429's or
  503's ``Retry-After`` kept when it is a number of seconds (:func:`retry_after`); an engine that
  refuses the gateway's own credentials (401, 403, 407) is 502 ``upstream_unavailable``, logged
  at error once a minute per upstream (:func:`credentials_refused`);
- :func:`gateway.relay.stream.relay_stream` relays a stream in its route's protocol
  (:mod:`gateway.relay.stream_protocol`); the stream cut by the engine or the transport raises
  :class:`~config.errors.OpenAIError` (the response shell turns it into the protocol's error
  tail);
- :func:`read_whole` reads a whole JSON answer as its route reads one (the route value's
  ``whole_answer``, :mod:`gateway.relay.whole_answer`) and yields it once, unchanged;
- both feed the verifier's guard; a strict guard that withholds raises 502 ``response_withheld``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import time
import weakref
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import orjson

from config.background import Repeats, since_text
from config.errors import ErrorCode, OpenAIError
from config.models import Settings
from gateway.admission.admit import Admitted
from gateway.edge.body_budget import BodyBudget
from gateway.ops.metrics import GatewayMetrics
from gateway.relay.sse import SSEEventTooLarge
from gateway.relay.stream import (
    NOTHING,
    Chunk,
    Produced,
    StreamOptions,
    Tally,
    odd_choice_index,
    odd_index_event,
    relay_stream,
)
from gateway.relay.stream_protocol import CHAT_SSE, StreamProtocol
from gateway.relay.upstream_client import (
    ConnectFailed,
    ConnectTimeout,
    PoolTimeout,
    ReadTimeout,
    ResponseTooLarge,
    UpstreamClient,
    UpstreamError,
    UpstreamResponse,
)
from gateway.relay.upstreams import TenantShare, TenantShareTimeout, Upstream, UpstreamSet
from verifier.engine_response import CredentialsRefused, engine_error
from verifier.stage import ResponseGuard, ResponseWithheld, VerifierStage

log = logging.getLogger("kvgate.proxy")

#: what of an engine's error answer (or a stream request's non-stream answer) is read for its
#: message; a longer one is reported without it
ERROR_BODY_BYTES = 64 * 1024


class RelayContext(Protocol):
    """What the relay reads from the gateway (``gateway.app.Gateway`` provides it)."""

    forwarder: UpstreamClient
    upstreams: UpstreamSet
    metrics: GatewayMetrics
    verifier: VerifierStage
    settings: Settings
    body_budget: BodyBudget | None


@dataclass
class RelayOutcome:
    """One admitted request's relay. The relay sets ``upstream`` (the one the request was written
    to, as soon as it was, or whose answer failed),
    ``forwarded`` (the request was written to an upstream's connection: the engine may have
    started on it, whether or not it answered; never set by a connect failure),
    ``overhead_seconds`` (time spent in the gateway: arrival to forwarding, plus a whole answer's
    post-processing) and, once it ends, ``produced``. The response shell sets ``status`` (the
    HTTP status the client got; 499: it went away), ``error_code`` (the code of the error it
    answered or ended the stream with) and ``disconnected``. ``client``: the server's record of
    the client's request (:func:`client_of`), or ``None``."""

    admitted: Admitted
    upstream: Upstream | None = None
    forwarded: bool = False
    overhead_seconds: float = 0.0
    produced: Produced = NOTHING
    status: int = 0
    error_code: str | None = None
    disconnected: bool = False
    client: Any = None
    #: the ``x-request-id`` the engine gets: the gateway's own, never the client's (vLLM takes the
    #: header as its engine request id, ``serving_engine.py`` ``_base_request_id``: two tenants
    #: sending one id would share an engine request id)
    upstream_request_id: str = field(default_factory=lambda: os.urandom(16).hex())


def client_of(receive: Any) -> Any:
    """The server's record of a request, whose ``disconnected`` is true once its client has gone,
    from the request's ASGI ``receive``: under uvicorn (its own protocols, and the server layer
    of :mod:`gateway.edge.protocol`) ``receive`` is a method of the request's cycle, whose
    ``connection_lost`` sets the flag. ``None`` under a server that gives no such record (the
    relay then learns of a disconnect from the response shell alone)."""
    return getattr(receive, "__self__", None)


class ClientLeftBeforeSend(asyncio.CancelledError):
    """The client was gone before its request was sent upstream (:func:`open_upstream`): the
    relay ends as the response shell's disconnect watcher would have ended it, by cancellation
    with ``outcome.disconnected`` set (499), nothing forwarded (settled 0)."""


def event_too_large(outcome: RelayOutcome, e: SSEEventTooLarge) -> OpenAIError:
    """The 502 ``upstream_unavailable`` that ends a stream whose engine sent an event above
    ``gateway.max_sse_event_bytes`` (an error event when the stream has started, else the answer)."""
    name = outcome.upstream.name if outcome.upstream is not None else "-"
    log.warning(
        "upstream %s sent a stream event of %d bytes or more (limit %d); stream ended",
        name,
        e.size,
        e.limit,
        extra={"fields": {"request_id": outcome.admitted.arrival.request_id}},
    )
    return OpenAIError(
        502,
        f"The upstream engine sent a stream event larger than {e.limit} bytes "
        "(gateway.max_sse_event_bytes); the stream was ended.",
        code=ErrorCode.UPSTREAM_UNAVAILABLE,
    )


def answer_too_large(ctx: RelayContext, outcome: RelayOutcome, e: ResponseTooLarge) -> OpenAIError:
    """The 502 ``upstream_unavailable`` for an engine's answer, read whole, of more than
    ``gateway.max_response_bytes`` (logged, and counted per upstream)."""
    name = outcome.upstream.name if outcome.upstream is not None else "-"
    ctx.metrics.upstream_errors.labels(name, "too_large").inc()
    log.warning(
        "upstream %s answered more than %d bytes; answer dropped",
        name,
        e.limit,
        extra={"fields": {"request_id": outcome.admitted.arrival.request_id}},
    )
    return OpenAIError(
        502,
        f"The upstream engine answered more than {e.limit} bytes (gateway.max_response_bytes).",
        code=ErrorCode.UPSTREAM_UNAVAILABLE,
    )


def stream_error_tail(outcome: RelayOutcome, err: OpenAIError) -> bytes:
    """The bytes that end a started stream with ``err``, in its route's protocol (the route
    value's ``stream_protocol``): an error chunk and ``[DONE]`` (chat, completions), the
    Responses ``error`` event (``/v1/responses``)."""
    protocol: StreamProtocol = outcome.admitted.arrival.api.stream_protocol
    return protocol.error_tail(err, outcome.produced.sequence_number)


def withheld_error(w: ResponseWithheld) -> OpenAIError:
    """The 502 ``response_withheld`` a strict guard's refusal becomes (docs/design.md, "Error bodies")."""
    return OpenAIError(
        502, f"The response was withheld by verification (incident {w.incident_id}).", code=ErrorCode.RESPONSE_WITHHELD
    )


def response_headers(outcome: RelayOutcome, content_type: bytes) -> list[tuple[bytes, bytes]]:
    """The response's headers: content type, ``x-request-id``, ``x-kvgate-overhead-ms`` and the
    quota lease's rate-limit headers."""
    a = outcome.admitted
    h = [
        (b"content-type", content_type),
        (b"x-request-id", a.arrival.request_id.encode()),
        (b"x-kvgate-overhead-ms", f"{outcome.overhead_seconds * 1000:.3f}".encode()),
    ]
    for k, v in a.lease.headers.items():
        h.append((k.lower().encode(), str(v).encode()))
    return h


async def relay(ctx: RelayContext, outcome: RelayOutcome) -> AsyncGenerator[Chunk, None]:
    """Open an upstream, check its answer, then yield the client's bytes (a stream or a whole
    answer) as :data:`Chunk` items, the last with ``more_body`` false. Raises
    :class:`OpenAIError` for an answer that is an error or a stream cut. Closing the iterator
    closes the upstream response (so a client disconnect cancels the upstream request); however
    it ends, ``outcome.produced`` is set."""
    resp, t_forward = await open_upstream(ctx, outcome)
    tally = Tally(t_forward)
    try:
        outcome.overhead_seconds = t_forward - outcome.admitted.arrival.t_perf
        await _check_answer(ctx, outcome, resp)
        async with contextlib.aclosing(_answer(ctx, outcome, resp, tally)) as chunks:
            async for chunk in chunks:
                yield chunk
    except ResponseTooLarge as e:
        raise answer_too_large(ctx, outcome, e) from None
    except UpstreamError as e:
        raise _transport_error(ctx, outcome, e, "read") from None
    except ResponseWithheld as w:
        raise withheld_error(w) from None
    except SSEEventTooLarge as e:
        raise event_too_large(outcome, e) from None
    except CredentialsRefused as e:
        credentials_refused(outcome, e)
        raise
    finally:
        outcome.produced = tally.result()
        u = outcome.upstream
        if u is not None:
            u.in_flight -= 1
        try:
            await resp.aclose()
        except Exception:  # the answer's outcome (relayed, or its mapped error) stands
            log.exception(
                "closing the upstream response failed",
                extra={"fields": {"request_id": outcome.admitted.arrival.request_id}},
            )
        finally:  # the connection is back in the pool (or closed): the tenant's share of it too
            if u is not None and u.share is not None:
                u.share.release(outcome.admitted.tenant.id)


def _answer(
    ctx: RelayContext, outcome: RelayOutcome, resp: UpstreamResponse, tally: Tally
) -> AsyncGenerator[Chunk, None]:
    """The relay of the answer: the stream in the route's protocol, or the whole answer; both
    through the verifier's guard (none for a request the verifier does not see: embeddings)."""
    a, u = outcome.admitted, outcome.upstream
    assert u is not None, "open_upstream sets the upstream before the answer is relayed"
    guard = None
    if a.exchange is not None:
        a.exchange.request = replace(
            a.exchange.request,
            upstream=u.name,
            forwarded_monotonic=time.monotonic() - (time.perf_counter() - tally.t_forward),
        )
        guard = ctx.verifier.begin(a.exchange)
    if not a.forward.stream:
        return read_whole(outcome, resp, guard, tally, ctx.settings.gateway.max_response_bytes)
    opts = StreamOptions(
        ctx.settings.gateway.max_sse_event_bytes,
        a.forward.strip_usage,
        ctx.body_budget,
        a.tenant.id,
        a.arrival.request_id,
        a.tenant.strict_verify,
        a.admission.n * a.admission.num_prompts,
        a.admission.num_prompts,
        a.admission.model.upstream_model,
        u.config.engine or "openai",  # validation fills it; the type still allows None
    )
    return relay_stream(resp, a.arrival.api.stream_protocol, guard, tally, opts)


async def open_upstream(ctx: RelayContext, outcome: RelayOutcome) -> tuple[UpstreamResponse, float]:
    """``(the upstream's response, its headers read; perf_counter when it was sent)``. Sets
    ``outcome.upstream`` (whose ``in_flight``, and the tenant's share of its origin, stay counted
    until :func:`relay` ends) and ``forwarded`` (as soon as the request was written to an engine's
    connection, before its answer: an engine that then times out or breaks, or a client that
    leaves, does not undo it). The candidates are tried in balance order: first those not backing
    off, then those backing off (a connect to an engine that just failed one is the last resort,
    not the price of a tenant's wait for its share); in each group those whose origin the tenant
    holds its share of, or that is full, last, once a connection given back is handed to the
    tenant (:func:`_try_group`). Raises :class:`OpenAIError` 503/504 (no upstream took it) or 502,
    or :class:`ClientLeftBeforeSend` when the server already knows the client is gone: it may have
    left while admission awaited the quota store, and the response shell's watcher, which has not
    run yet, would learn it only after a pooled connection had taken the request without a loop
    turn."""
    a = outcome.admitted
    if getattr(outcome.client, "disconnected", False):
        outcome.disconnected = True
        outcome.overhead_seconds = time.perf_counter() - a.arrival.t_perf
        raise ClientLeftBeforeSend()
    ready, backing = ctx.upstreams.order(a.candidates)
    last: ConnectFailed | None = None
    for group, then in ((ready, bool(backing)), (backing, False)):
        opened = await _try_group(ctx, outcome, group, then)
        if opened is None:
            continue
        if not isinstance(opened, ConnectFailed):
            return opened
        last = opened
    if isinstance(last, ConnectTimeout):
        raise OpenAIError(504, "No upstream engine accepted the connection in time.", code=ErrorCode.UPSTREAM_TIMEOUT)
    raise OpenAIError(503, "No upstream engine for this model is reachable.", code=ErrorCode.UPSTREAM_UNAVAILABLE)


async def _try_group(
    ctx: RelayContext, outcome: RelayOutcome, group: list[Upstream], then: bool
) -> tuple[UpstreamResponse, float] | ConnectFailed | None:
    """:func:`_try` the upstreams of ``group`` (in order) whose origin's share lets the tenant take
    a connection (below its cap, the origin not full), then, none of them having taken the
    request, wait for the others' shares (:func:`_try_at_share`). ``then``: another group is
    tried after this one (the log says so). Returns as :func:`_try`, or ``None`` for an empty
    group."""
    tenant_id = outcome.admitted.tenant.id
    last: ConnectFailed | None = None
    at_share: list[tuple[Upstream, TenantShare]] = []  # candidates whose share took none (tenant at cap, or full)
    for i, u in enumerate(group):
        if u.share is not None and not u.share.try_take(tenant_id):
            at_share.append((u, u.share))
            continue
        more = then or bool(at_share) or i < len(group) - 1
        opened = await _try(ctx, outcome, u, more)
        if not isinstance(opened, ConnectFailed):
            return opened
        last = opened
    if at_share:
        return await _try_at_share(ctx, outcome, at_share, then)
    return last


async def _try_at_share(
    ctx: RelayContext, outcome: RelayOutcome, at_share: list[tuple[Upstream, TenantShare]], then: bool
) -> tuple[UpstreamResponse, float] | ConnectFailed:
    """:func:`_try` the candidates whose share took none for the tenant (``at_share``, not empty:
    each with that share, in balance order; the tenant at its cap or the origin full), each as
    its share hands the tenant a connection given back (whichever first). The wait for the share
    and the transport's wait for a free connection of the pool after it end at one deadline,
    ``connect_timeout`` from the start (the connect, if one is needed, has its own
    ``connect_timeout``); a share wait in vain is a
    :class:`~gateway.relay.upstreams.TenantShareTimeout` (:func:`_share_timed_out`). ``then``:
    as :func:`_try_group`'s. Returns as :func:`_try`."""
    a = outcome.admitted
    loop = asyncio.get_running_loop()
    deadline = loop.time() + ctx.settings.gateway.connect_timeout_seconds
    left = list(at_share)
    while True:
        try:
            share = await TenantShare.take_any([s for _, s in left], a.tenant.id, deadline)
        except TimeoutError:
            return _share_timed_out(ctx, outcome, left, then)
        u = left.pop(next(i for i, (_, s) in enumerate(left) if s is share))[0]
        opened = await _try(ctx, outcome, u, then or bool(left), max(0.0, deadline - loop.time()))
        if not isinstance(opened, ConnectFailed) or not left:
            return opened


def _share_timed_out(
    ctx: RelayContext, outcome: RelayOutcome, left: list[tuple[Upstream, TenantShare]], then: bool
) -> PoolTimeout:
    """Record that no connection to each origin of the upstreams ``left`` (not empty) came to the
    tenant for all of ``connect_timeout``: once per origin (its upstreams share one
    :class:`~gateway.relay.upstreams.TenantShare`), under the name of its first upstream in
    ``left``, as a pool wait in vain is (no back-off): a
    :class:`~gateway.relay.upstreams.TenantShareTimeout` (counted ``tenant_share``, logged with
    the tenant and its cap) where the tenant holds its cap, a :class:`PoolTimeout` (``pool``)
    where every connection of the origin was held by others. ``then``: as :func:`_try_group`'s.
    The last origin's error."""
    a = outcome.admitted
    timeout_seconds = ctx.settings.gateway.connect_timeout_seconds
    origins: dict[TenantShare, list[Upstream]] = {}
    for u, s in left:
        origins.setdefault(s, []).append(u)
    errors: list[PoolTimeout] = []
    for s, us in origins.items():
        names = ", ".join(u.name for u in us)
        if s.at_cap(a.tenant.id):
            errors.append(
                TenantShareTimeout(
                    f"TenantShareTimeout: tenant {a.tenant.id} held its {s.cap_connections} connections to "
                    f"{names} for {timeout_seconds:g}s"
                )
            )
        else:
            errors.append(PoolTimeout(f"PoolTimeout: all {s.pool_connections} connections to {names} held"))
    for n, (us, e) in enumerate(zip(origins.values(), errors, strict=True), 1):
        _connect_failed(ctx, us[0], e, a.arrival.request_id, then or n < len(errors))
    return errors[-1]


async def _try(
    ctx: RelayContext, outcome: RelayOutcome, u: Upstream, more: bool, pool_timeout: float | None = None
) -> tuple[UpstreamResponse, float] | ConnectFailed:
    """Send the request to ``u``, the tenant's share of its origin (if capped) already taken:
    ``(its response, perf_counter when it was sent)``, or the :class:`ConnectFailed` that kept it
    from ``u`` (recorded: :func:`_connect_failed`; ``more``: another upstream is tried next).
    ``pool_timeout``: the longest wait for a free connection of the pool (``None``:
    ``connect_timeout``). Raises :class:`OpenAIError` for another failure."""
    a = outcome.admitted
    t_forward = time.perf_counter()

    def on_sent() -> None:  # the request is on its way to an engine: from now on it is charged
        outcome.forwarded = True
        outcome.upstream = u  # named in the access line even if the client leaves before its answer

    try:
        resp = await _send(ctx, u, a, on_sent, outcome.upstream_request_id, pool_timeout)
    except ConnectFailed as e:
        _connect_failed(ctx, u, e, a.arrival.request_id, more)
        return e
    except UpstreamError as e:
        outcome.upstream = u
        u.connected()
        raise _transport_error(ctx, outcome, e, "answer") from None
    if u.connect_failures:
        u.connected()
    outcome.upstream = u
    outcome.forwarded = True
    return resp, t_forward


def _connect_failed(ctx: RelayContext, u: Upstream, e: ConnectFailed, request_id: str, more: bool) -> None:
    """Record that nothing reached ``u``: counted (``kvgate_upstream_errors_total`` kind
    ``connect``, ``pool`` for a :class:`PoolTimeout`, ``tenant_share`` for a
    :class:`~gateway.relay.upstreams.TenantShareTimeout`) and logged (``more``: another upstream
    is tried next, else none is left); a failed connect sends ``u``
    to the back of the order for a while (:meth:`gateway.relay.upstreams.Upstream.connect_failed`),
    a busy pool does not (the engine answers; its connections are all taken), nor a tenant that
    holds its share of them."""
    busy = isinstance(e, PoolTimeout)
    if not busy:
        u.connect_failed()
    kind = "tenant_share" if isinstance(e, TenantShareTimeout) else "pool" if busy else "connect"
    ctx.metrics.upstream_errors.labels(u.name, kind).inc()
    log.warning(
        "upstream %s: %s (%s), %s",
        u.name,
        _CONNECT_FAILURES[kind],
        str(e) if kind == "tenant_share" else type(e).__name__,
        "trying the next" if more else "no upstream left to try",
        extra={"fields": {"request_id": request_id}},
    )


#: how the log names each kind of connect failure (:func:`_connect_failed`)
_CONNECT_FAILURES = {
    "connect": "connect failed",
    "pool": "no free connection",
    "tenant_share": "the tenant holds its share of the connections",
}


async def _send(
    ctx: RelayContext,
    u: Upstream,
    a: Admitted,
    on_sent: Callable[[], None],
    request_id: str,
    pool_timeout: float | None,
) -> UpstreamResponse:
    """Send the request to ``u`` with ``x-request-id: request_id`` (waiting at most
    ``pool_timeout`` for a free connection; ``None``: ``connect_timeout``), counted in its
    ``in_flight`` from now on (given back here when no answer came: the send failed, or was
    cancelled because the client left; so is the tenant's share of ``u``'s origin, which the
    caller took)."""
    headers = {"content-type": "application/json", "accept-encoding": "identity", "x-request-id": request_id}
    if u.auth_header:
        headers["authorization"] = u.auth_header
    u.in_flight += 1
    try:
        return await ctx.forwarder.send(
            "POST", u.url_for(a.arrival.api), a.forward.body, headers, on_sent, pool_timeout
        )
    except BaseException:
        u.in_flight -= 1
        if u.share is not None:
            u.share.release(a.tenant.id)
        raise


#: characters of a transport failure's detail written to the log (:func:`_transport_error`)
MAX_LOGGED_DETAIL_CHARS = 300


def _transport_error(ctx: RelayContext, outcome: RelayOutcome, e: UpstreamError, verb: str) -> OpenAIError:
    """504 ``upstream_timeout`` or 502 ``upstream_unavailable`` for a failed upstream exchange
    (``verb``: ``answer`` while sending, ``read`` while reading the answer); counted per upstream
    and logged once (a warning naming the upstream and the request id). The client is told the
    failure's class only; the log has its detail (``the engine answered Transfer-Encoding 'gzip,
    chunked'``), cut to :data:`MAX_LOGGED_DETAIL_CHARS` and written as its ``repr``: an engine
    can shape it (a malformed status line is quoted), and CR/LF in it must not start a line."""
    u = outcome.upstream
    name = u.name if u is not None else "-"
    detail = str(e)
    if len(detail) > MAX_LOGGED_DETAIL_CHARS:
        detail = detail[:MAX_LOGGED_DETAIL_CHARS] + "..."
    log.warning(
        "upstream %s failed (%s): %r",
        name,
        type(e).__name__,
        detail,
        extra={"fields": {"request_id": outcome.admitted.arrival.request_id, "upstream": name}},
    )
    if isinstance(e, (ReadTimeout, ConnectTimeout)):
        ctx.metrics.upstream_errors.labels(name, "timeout").inc()
        return OpenAIError(504, "The upstream engine did not answer in time.", code=ErrorCode.UPSTREAM_TIMEOUT)
    ctx.metrics.upstream_errors.labels(name, "reset").inc()
    what = "failed" if verb == "answer" else "broke the connection"
    return OpenAIError(502, f"The upstream engine {what} ({type(e).__name__}).", code=ErrorCode.UPSTREAM_UNAVAILABLE)


#: the longest ``Retry-After`` of an engine's passed on to a client (seconds)
MAX_RETRY_AFTER_SECONDS = 3600
_DELAY_SECONDS = re.compile(r"[0-9]{1,10}")


def retry_after(value: str | None) -> str | None:
    """An engine's ``Retry-After`` as the gateway passes it on: its delay in seconds (RFC 9110
    10.2.3 ``delay-seconds``, leading zeros dropped) when that is from 0 to
    :data:`MAX_RETRY_AFTER_SECONDS`; ``None`` for anything else (absent, an HTTP-date, a
    fraction, a sign, a longer wait), which is dropped. Before, every engine's was dropped: a
    client told 429 or 503 retried at once, or after its own back-off."""
    if value is None:
        return None
    v = value.strip(" \t")
    if _DELAY_SECONDS.fullmatch(v) is None or int(v) > MAX_RETRY_AFTER_SECONDS:
        return None
    return str(int(v))


#: per upstream, when its refusals of the gateway's credentials were last logged (:func:`credentials_refused`)
_REFUSALS: weakref.WeakKeyDictionary[Upstream, Repeats] = weakref.WeakKeyDictionary()


def credentials_refused(outcome: RelayOutcome, e: CredentialsRefused) -> None:
    """Log an engine's refusal of the gateway's own credentials (its 401, 403 or 407: the
    upstream's ``api_key`` is wrong or was rotated) at error, once a minute per upstream with a
    count of those since (:class:`config.background.Repeats`): every request to it fails alike
    until an operator fixes the key."""
    u = outcome.upstream
    if u is None:
        return
    repeats = _REFUSALS.get(u)
    if repeats is None:
        repeats = _REFUSALS[u] = Repeats()
    since = repeats.due(e)
    if since is not None:
        log.error(
            "upstream %s refused the gateway's credentials (%d): its api_key is wrong or was rotated; "
            "its answers are 502 upstream_unavailable%s",
            u.name,
            e.engine_status,
            since_text(since),
            extra={"fields": {"request_id": outcome.admitted.arrival.request_id, "upstream": u.name}},
        )


def is_event_stream(content_type: str) -> bool:
    """Whether a ``Content-Type`` value names ``text/event-stream``, whatever its case and
    parameters (RFC 9110 8.3.1: type and subtype are case-insensitive)."""
    return content_type.split(";", 1)[0].strip().lower() == "text/event-stream"


async def _check_answer(ctx: RelayContext, outcome: RelayOutcome, resp: UpstreamResponse) -> None:
    """Raise the engine's error for a non-200 answer, or for a stream request answered without
    an event stream (an engine that does so is reporting an error in a JSON body; reading it
    may raise :class:`UpstreamError`), or for an answer in a content coding the gateway did not
    accept (it asks for ``identity``; the transport hands bodies on raw): a 200's is 502
    ``upstream_unavailable`` naming the coding, an error status's body is not read for a message."""
    name = outcome.upstream.name if outcome.upstream is not None else "-"
    coding = resp.headers.get("content-encoding", "").strip()
    coded = coding.lower() not in ("", "identity")
    if resp.status_code != 200:
        try:
            raw = b"" if coded else await resp.aread(ERROR_BODY_BYTES)
        except UpstreamError:
            raw = b""
        ctx.metrics.upstream_errors.labels(name, f"http_{resp.status_code}").inc()
        err = engine_error(resp.status_code, raw)
        wait = retry_after(resp.headers.get("retry-after")) if resp.status_code in (429, 503) else None
        if wait is not None:
            err.headers = {"Retry-After": wait}
        raise err
    if coded:
        ctx.metrics.upstream_errors.labels(name, "content_encoding").inc()
        raise OpenAIError(
            502,
            f"The upstream engine answered with Content-Encoding {coding!r}, which the gateway does not accept.",
            code=ErrorCode.UPSTREAM_UNAVAILABLE,
        )
    if outcome.admitted.forward.stream and not is_event_stream(resp.headers.get("content-type", "")):
        try:
            raw = await resp.aread(ERROR_BODY_BYTES)
        except ResponseTooLarge:
            raw = b""
        ctx.metrics.upstream_errors.labels(name, "not_a_stream").inc()
        raise engine_error(200, raw)


async def read_whole(
    outcome: RelayOutcome, resp: UpstreamResponse, guard: ResponseGuard | None, tally: Tally, limit: int | None = None
) -> AsyncGenerator[Chunk, None]:
    """Read a whole JSON answer, count what it produced in ``tally``, let the guard check it,
    and yield its bytes once, unchanged, as the last chunk. Raises :class:`OpenAIError` 502 (not a
    JSON object, an error object, a chat/completions choice whose index is not one of the choices
    asked for: :func:`gateway.relay.stream.odd_choice_index`), :class:`UpstreamError` (read failed;
    :class:`ResponseTooLarge` past ``limit`` bytes) or :class:`~verifier.stage.ResponseWithheld`."""
    raw = await resp.aread(limit)
    t_done = time.perf_counter()
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        data = None
    if not isinstance(data, dict):  # invalid JSON, or an array, a string, null: no answer of any API
        raise OpenAIError(
            502, "The upstream engine answered a body that is not a JSON object.", code=ErrorCode.UPSTREAM_UNAVAILABLE
        )
    a = outcome.admitted
    out = a.arrival.api.whole_answer(data)  # raises the engine's error when it is one
    if a.arrival.api.stream_protocol is CHAT_SSE and odd_choice_index(
        data.get("choices"), a.admission.n * a.admission.num_prompts
    ):
        raise odd_index_event()
    tally.take_body(out, resp.headers.get("x-prefill-seconds"))
    if guard is not None:
        await guard.check_body(
            list(out.fields.values()),
            usage=tally.usage,
            finish_reason=tally.finish_reason,
            ttft_seconds=tally.ttft_seconds,
        )
    outcome.overhead_seconds += time.perf_counter() - t_done
    yield raw, False
