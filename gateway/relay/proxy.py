"""Step 7 (and the hook of 8): forward an admitted request and relay the answer (docs/design.md, "A
request's way through the gateway", "Error bodies").

:func:`relay` is an async iterator of the bytes to send the client; it fills one
:class:`RelayOutcome` as it goes, which :func:`gateway.relay.finish.finish` then settles and logs.
The transport (ASGI messages, client disconnect) is :mod:`gateway.relay.response`'s. In order:

- :func:`open_upstream` tries the candidates in balance order; a connect failure (refused,
  connect timeout, pool full) moves to the next before any byte is sent; the last failure is 503
  ``upstream_unavailable`` (504 ``upstream_timeout`` when it timed out);
- an engine's non-200 answer, or a JSON answer to a stream request, is mapped to the OpenAI
  shape with the engine's status (:func:`verifier.engine_response.engine_error`);
- :func:`relay_stream` relays a stream event by event, byte-exact (:mod:`gateway.relay.sse`): it yields
  an empty chunk once the response starts (its first text or finish reason: an error event before that
  is the engine's answer, after it an error event inside the stream), ends with
  ``data: [DONE]`` exactly once, strips the usage chunk and ``"usage": null`` members the gateway
  asked for on the client's behalf, and raises :class:`~config.errors.OpenAIError` when the
  stream is cut (the response shell turns it into an error event and ``[DONE]``);
- :func:`read_whole` reads a whole JSON answer and yields it once, unchanged;
- both feed the verifier's guard; a strict guard that withholds raises 502 ``response_withheld``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, TypeAlias

import httpx
import orjson

from config.errors import ErrorCode, OpenAIError
from config.models import Settings
from gateway.admission.admit import Admitted
from gateway.edge.body_budget import FREE_BODY_BYTES, BodyBudget
from gateway.ops.metrics import GatewayMetrics
from gateway.relay.sse import DONE_EVENT, SSEEventTooLarge, SSESplitter, data_of, inspect, strip_usage_null
from gateway.relay.upstream_client import UpstreamClient, UpstreamResponse
from gateway.relay.upstreams import Upstream, UpstreamSet
from verifier.engine_response import (
    EngineOutput,
    ResponseOutput,
    engine_error,
    is_error_payload,
    parse_body,
    parse_response_body,
    parse_response_event,
)
from verifier.stage import Exchange, ExchangeRequest, ResponseGuard, ResponseWithheld, VerifierStage

log = logging.getLogger("kvgate.proxy")

_CONNECT_FAILURES = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)

#: what the relay yields: ``(body, more_body)``, as in an ASGI ``http.response.body`` message
Chunk: TypeAlias = tuple[bytes, bool]


class RelayContext(Protocol):
    """What the relay reads from the gateway (``gateway.app.Gateway`` provides it)."""

    forwarder: UpstreamClient
    upstreams: UpstreamSet
    metrics: GatewayMetrics
    verifier: VerifierStage
    settings: Settings
    body_budget: BodyBudget | None


@dataclass
class Produced:
    """What the engine produced, as far as it was relayed. ``texts``: choice index -> the text
    pieces it produced (what a settle without usage counts); ``usage``: the engine's usage object;
    ``finish_reason``: the first one seen; ``ttft_seconds``: from forwarding to the first text
    (streams) or the engine's ``x-prefill-seconds`` (whole answers); ``sequence_number``: the
    last ``sequence_number`` of a ``/v1/responses`` stream (the gateway's own error event follows it)."""

    texts: dict[int, list[str]] = field(default_factory=dict)
    usage: dict[str, Any] | None = None
    finish_reason: str | None = None
    ttft_seconds: float | None = None
    sequence_number: int | None = None


@dataclass
class RelayOutcome:
    """One admitted request's relay, filled while it runs. ``upstream``: the one tried last;
    ``forwarded``: the request was written to an upstream's connection (the engine may have
    started on it, whether or not it answered; never set by a connect failure); ``status``: the
    HTTP status the client got (499: it went away); ``error_code``: the code of an error answered
    or sent mid-stream; ``overhead_seconds``: time spent in the gateway (arrival to forwarding,
    plus a whole answer's post-processing)."""

    admitted: Admitted
    upstream: Upstream | None = None
    forwarded: bool = False
    status: int = 0
    error_code: str | None = None
    disconnected: bool = False
    overhead_seconds: float = 0.0
    produced: Produced = field(default_factory=Produced)


def error_event(err: OpenAIError) -> bytes:
    """An OpenAI error body as one SSE event."""
    return b"data: " + err.body_bytes() + b"\n\n"


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


def response_error_event(err: OpenAIError, after: int | None) -> bytes:
    """The Responses API's own ``error`` event for ``err``
    (``{"type": "error", "code", "message", "param", "sequence_number"}``), numbered after the
    stream's last event ``after``: how the gateway ends a ``/v1/responses`` stream it must cut
    (that protocol has no ``[DONE]``)."""
    e = orjson.loads(err.body_bytes())["error"]
    data: dict[str, Any] = {
        "type": "error",
        "code": e.get("code"),
        "message": e.get("message"),
        "param": e.get("param"),
    }
    if after is not None:
        data["sequence_number"] = after + 1
    return b"event: error\ndata: " + orjson.dumps(data) + b"\n\n"


def stream_error_tail(outcome: RelayOutcome, err: OpenAIError) -> bytes:
    """The bytes that end a started stream with ``err``: an error chunk and ``[DONE]`` (chat,
    completions), the Responses ``error`` event (``/v1/responses``)."""
    if outcome.admitted.arrival.route == "responses":
        return response_error_event(err, outcome.produced.sequence_number)
    return error_event(err) + DONE_EVENT


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
    """Open an upstream, check its answer, then yield the client's bytes (:func:`relay_stream` or
    :func:`read_whole`) as :data:`Chunk` items, the last with ``more_body`` false. Raises
    :class:`OpenAIError` for an answer that is an error. Closing the iterator closes the upstream
    response (so a client disconnect cancels the upstream request)."""
    resp, t_forward = await open_upstream(ctx, outcome)
    try:
        outcome.overhead_seconds = t_forward - outcome.admitted.arrival.t_perf
        await _check_answer(ctx, outcome, resp)
        route = outcome.admitted.arrival.route
        guard = None if route == "embeddings" else ctx.verifier.begin(_exchange(outcome))  # no output text
        if not outcome.admitted.forward.stream:
            body = read_whole
        else:
            body = relay_response_stream if route == "responses" else relay_stream
        async with contextlib.aclosing(body(ctx, outcome, resp, guard, t_forward)) as chunks:
            async for chunk in chunks:
                yield chunk
    finally:
        if outcome.upstream is not None:
            outcome.upstream.in_flight -= 1
        await resp.aclose()


async def open_upstream(ctx: RelayContext, outcome: RelayOutcome) -> tuple[UpstreamResponse, float]:
    """``(the upstream's response, its headers read; perf_counter when it was sent)``. Sets
    ``outcome.upstream`` (whose ``in_flight`` stays counted until :func:`relay` ends) and
    ``forwarded`` (as soon as the request was written to an engine's connection, before its answer:
    an engine that then times out or breaks, or a client that leaves, does not undo it). Raises
    :class:`OpenAIError` 503/504 (no upstream took it) or 502."""
    a = outcome.admitted
    route, rid = a.arrival.route, a.arrival.request_id
    last: Exception | None = None

    def on_sent() -> None:  # the request is on its way to an engine: from now on it is charged
        outcome.forwarded = True

    for u in ctx.upstreams.order(a.candidates):
        headers = {"content-type": "application/json", "accept-encoding": "identity", "x-request-id": rid}
        if u.auth_header:
            headers["authorization"] = u.auth_header
        t_forward = time.perf_counter()
        u.in_flight += 1
        accepted = False
        try:
            resp = await ctx.forwarder.send("POST", u.url_for(route), a.forward.body, headers, on_sent)
            accepted = True
        except _CONNECT_FAILURES as e:
            ctx.metrics.upstream_errors.labels(u.name, "connect").inc()
            log.warning(
                "upstream %s: connect failed (%s), trying the next",
                u.name,
                type(e).__name__,
                extra={"fields": {"request_id": rid}},
            )
            last = e
            continue
        except httpx.HTTPError as e:
            outcome.upstream = u
            raise _transport_error(ctx, u, e, "answer") from None
        finally:
            if not accepted:  # failed, or cancelled (the client left) while waiting for the answer
                u.in_flight -= 1
        outcome.upstream = u
        outcome.forwarded = True
        return resp, t_forward
    if isinstance(last, (httpx.ConnectTimeout, httpx.PoolTimeout)):
        raise OpenAIError(504, "No upstream engine accepted the connection in time.", code=ErrorCode.UPSTREAM_TIMEOUT)
    raise OpenAIError(503, "No upstream engine for this model is reachable.", code=ErrorCode.UPSTREAM_UNAVAILABLE)


def _transport_error(ctx: RelayContext, u: Upstream | None, e: httpx.HTTPError, verb: str) -> OpenAIError:
    """504 ``upstream_timeout`` or 502 ``upstream_unavailable`` for a failed upstream exchange
    (``verb``: ``answer`` while sending, ``read`` while reading the answer); counted per upstream."""
    name = u.name if u is not None else "-"
    if isinstance(e, httpx.TimeoutException):
        ctx.metrics.upstream_errors.labels(name, "timeout").inc()
        return OpenAIError(504, "The upstream engine did not answer in time.", code=ErrorCode.UPSTREAM_TIMEOUT)
    ctx.metrics.upstream_errors.labels(name, "reset").inc()
    what = "failed" if verb == "answer" else "broke the connection"
    return OpenAIError(502, f"The upstream engine {what} ({type(e).__name__}).", code=ErrorCode.UPSTREAM_UNAVAILABLE)


async def _check_answer(ctx: RelayContext, outcome: RelayOutcome, resp: UpstreamResponse) -> None:
    """Raise the engine's error for a non-200 answer, or for a stream request answered without
    an event stream (an engine that does so is reporting an error in a JSON body)."""
    name = outcome.upstream.name if outcome.upstream is not None else "-"
    if resp.status_code != 200:
        try:
            raw = await resp.aread()
        except httpx.HTTPError:
            raw = b""
        ctx.metrics.upstream_errors.labels(name, f"http_{resp.status_code}").inc()
        raise engine_error(resp.status_code, raw)
    if outcome.admitted.forward.stream and not resp.headers.get("content-type", "").startswith("text/event-stream"):
        try:
            raw = await resp.aread()
        except httpx.HTTPError as e:
            raise _transport_error(ctx, outcome.upstream, e, "read") from None
        ctx.metrics.upstream_errors.labels(name, "not_a_stream").inc()
        raise engine_error(200, raw)


def _exchange(outcome: RelayOutcome) -> Exchange:
    """The request as the verifier sees it: the one admission built (now with its upstream),
    else a new one."""
    a = outcome.admitted
    if a.exchange is not None:
        a.exchange.request = replace(a.exchange.request, upstream=outcome.upstream.name if outcome.upstream else "")
        return a.exchange
    adm = a.admission
    started_monotonic = time.monotonic() - (time.perf_counter() - a.arrival.t_perf)
    request = ExchangeRequest(
        a.arrival.request_id,
        a.tenant,
        outcome.upstream.name if outcome.upstream else "",
        adm.model.id,
        a.arrival.route,
        adm.prompt_tokens,
        a.forward.stream,
        started_monotonic,
    )
    return Exchange(request, adm.prompt_text)


async def read_whole(
    ctx: RelayContext, outcome: RelayOutcome, resp: UpstreamResponse, guard: ResponseGuard | None, t_forward: float
) -> AsyncGenerator[Chunk, None]:
    """Read a whole JSON answer, note what it produced, let the guard check it, and yield its
    bytes once, unchanged, as the last chunk. Raises :class:`OpenAIError` 502/504 (read failed, not JSON, an error
    object, withheld)."""
    try:
        raw = await resp.aread()
    except httpx.HTTPError as e:
        raise _transport_error(ctx, outcome.upstream, e, "read") from None
    t_done = time.perf_counter()
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise OpenAIError(
            502, "The upstream engine answered a body that is not JSON.", code=ErrorCode.UPSTREAM_UNAVAILABLE
        ) from None
    if outcome.admitted.arrival.route == "responses":
        answer = parse_response_body(data)
        if answer.kind == "error":
            raise engine_error(200, {"error": answer.error})
        out: EngineOutput | ResponseOutput = answer
    elif is_error_payload(data):
        raise engine_error(200, data)
    else:
        out = parse_body(data)
    p = outcome.produced
    p.usage, p.finish_reason = out.usage, out.finish_reason
    p.texts = {i: [t] for i, t in out.texts.items()}
    prefill = resp.headers.get("x-prefill-seconds")
    if prefill:
        try:
            p.ttft_seconds = float(prefill)
        except ValueError:
            pass
    if guard is not None:
        try:
            await guard.check_body(
                list(out.fields.values()), usage=p.usage, finish_reason=p.finish_reason, ttft_seconds=p.ttft_seconds
            )
        except ResponseWithheld as w:
            raise withheld_error(w) from None
    outcome.overhead_seconds += time.perf_counter() - t_done
    outcome.status = 200
    yield raw, False


class HoldBack:
    """The events of a stream held back until its response starts (so that an engine error
    before any content is answered with the engine's own status), at most ``limit`` bytes: an
    engine that sends only events without content cannot make the gateway hold them without
    bound, and past the limit the response starts anyway. ``started``: the response has started
    (the relay yields its ``(b"", True)`` marker when it starts it); ``held``: the events held."""

    __slots__ = ("held", "limit", "size", "started")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held: list[bytes] = []
        self.size = 0
        self.started = False

    def offer(self, out: list[bytes], outcome: RelayOutcome) -> list[Chunk]:
        """What to yield for the events ``out`` of one read: nothing while they are held, the
        start marker and everything held once the limit is passed (``outcome.status`` 200), or
        the held events and ``out`` together once started."""
        if not out:
            return []
        if not self.started:
            self.held.extend(out)
            self.size += sum(map(len, out))
            if self.size <= self.limit:
                return []
            self.started = True
            outcome.status = 200
            held, self.held = self.held, []
            return [(b"", True), (b"".join(held), True)]
        held, self.held = self.held, []
        return [(b"".join(held + out) if held else b"".join(out), True)]


async def stream_tail(
    outcome: RelayOutcome, guard: ResponseGuard | None, hold: HoldBack, unfinished: bytes
) -> list[bytes]:
    """The events that end a relayed stream: those still held, then what the guard held back
    (its final checks run: a strict refusal raises the 502 ``response_withheld``); an
    ``unfinished`` event (bytes after the last terminator) is logged and dropped."""
    tail = hold.held
    if guard is not None:
        p = outcome.produced
        try:
            tail += await guard.finish_stream(usage=p.usage, finish_reason=p.finish_reason, ttft_seconds=p.ttft_seconds)
        except ResponseWithheld as w:
            raise withheld_error(w) from None
    if unfinished.strip():
        log.warning(
            "upstream stream ended inside an event",
            extra={"fields": {"request_id": outcome.admitted.arrival.request_id}},
        )
    return tail


async def _split(
    ctx: RelayContext, outcome: RelayOutcome, splitter: SSESplitter, chunk: bytes
) -> tuple[list[bytes], SSEEventTooLarge | None]:
    """One upstream read through ``splitter``: the complete events, and the
    :class:`gateway.relay.sse.SSEEventTooLarge` that ends the stream (``None``: it goes on; the events
    before the too-large one are still relayed). While an unfinished event holds more than
    :data:`gateway.edge.body_budget.FREE_BODY_BYTES`, the read's bytes past them are spent from the
    large-body budget for the request's tenant (the upstream is not read meanwhile): a stream of
    huge events costs the event loop what a large request body does."""
    try:
        events, too_large = splitter.feed(chunk), None
    except SSEEventTooLarge as e:
        events, too_large = e.before, e
    pending, budget = splitter.pending_bytes, ctx.body_budget
    if budget is not None and pending > FREE_BODY_BYTES:
        await budget.take(outcome.admitted.tenant.id, min(len(chunk), pending - FREE_BODY_BYTES))
    return events, too_large


async def relay_stream(
    ctx: RelayContext, outcome: RelayOutcome, resp: UpstreamResponse, guard: ResponseGuard | None, t_forward: float
) -> AsyncGenerator[Chunk, None]:
    """Relay an event stream (module docstring). Events before the response starts are held
    back, so that an engine error before any content is answered with the engine's status."""
    splitter = SSESplitter(ctx.settings.gateway.max_sse_event_bytes)
    hold = HoldBack(ctx.settings.gateway.max_sse_event_bytes)
    p = outcome.produced
    done = False
    try:
        async for chunk in resp.aiter_raw():
            out: list[bytes] = []
            events, too_large = await _split(ctx, outcome, splitter, chunk)
            for ev in events:
                info = inspect(ev)
                if info.kind == "done":
                    done = True
                    break
                if info.kind == "error":
                    err = engine_error(200, info.data)
                    if not hold.started:
                        raise err
                    out.append(error_event(err))
                    outcome.error_code = err.code
                    continue
                if info.kind == "chunk":
                    o = info.output
                    if o.usage is not None:
                        p.usage = o.usage
                    for i, t in o.texts.items():
                        p.texts.setdefault(i, []).append(t)
                    if o.finish_reason is not None:
                        p.finish_reason = o.finish_reason
                    if outcome.admitted.forward.strip_usage:
                        if o.usage_only:
                            continue
                        ev = strip_usage_null(ev)
                    if o.texts and p.ttft_seconds is None:
                        p.ttft_seconds = time.perf_counter() - t_forward
                if guard is not None:
                    out.extend(await guard.feed(info.text, ev, list(info.output.fields.items())))
                else:
                    out.append(ev)
                if not hold.started and (info.text or info.finish_reason):
                    hold.started = True
                    outcome.status = 200
                    yield b"", True  # the response starts now, even when the guard holds every event back
            for piece in hold.offer(out, outcome):
                yield piece
            if done:
                break
            if too_large is not None:
                raise event_too_large(outcome, too_large)
    except httpx.HTTPError as e:
        err = _transport_error(ctx, outcome.upstream, e, "read")
        if hold.held and hold.started:
            yield b"".join(hold.held), True
        raise err from None
    except ResponseWithheld as w:
        raise withheld_error(w) from None
    tail = await stream_tail(outcome, guard, hold, b"" if done else splitter.tail())
    outcome.status = 200
    yield b"".join(tail) + DONE_EVENT, False


async def relay_response_stream(
    ctx: RelayContext, outcome: RelayOutcome, resp: UpstreamResponse, guard: ResponseGuard | None, t_forward: float
) -> AsyncGenerator[Chunk, None]:
    """Relay a ``/v1/responses`` event stream byte-exact (:func:`relay_stream`'s rules, in that
    protocol): nothing appended (no ``[DONE]``) or stripped; usage from ``response.completed``;
    every string of every event through the guard (what
    :func:`verifier.engine_response.parse_response_event` reads: deltas, what an event repeats
    where it differs from the deltas, annotations, unknown events); the response starts at the
    first text or terminal event; an ``error`` event or ``response.failed`` before it is the
    engine's error, after it relayed as sent."""
    splitter = SSESplitter(ctx.settings.gateway.max_sse_event_bytes)
    hold = HoldBack(ctx.settings.gateway.max_sse_event_bytes)
    p = outcome.produced
    streamed: dict[str, list[str]] = {}  # text stream key -> its deltas (what a snapshot must repeat)
    try:
        async for chunk in resp.aiter_raw():
            out: list[bytes] = []
            events, too_large = await _split(ctx, outcome, splitter, chunk)
            for ev in events:
                payload = data_of(ev)
                info = ResponseOutput()
                if payload is not None:
                    try:
                        info = parse_response_event(orjson.loads(payload))
                    except orjson.JSONDecodeError:
                        pass
                if info.sequence_number is not None:
                    p.sequence_number = info.sequence_number
                if info.kind == "error":
                    err = engine_error(200, {"error": info.error or {}})
                    if not hold.started:
                        raise err
                    outcome.error_code = err.code
                if info.usage is not None:
                    p.usage = info.usage
                if info.finish_reason is not None:
                    p.finish_reason = info.finish_reason
                text = info.text
                for k, t in info.fields.items():  # every new string, counted text or not
                    streamed.setdefault(k, []).append(t)
                if text:
                    for i, t in info.texts.items():
                        p.texts.setdefault(i, []).append(t)
                    if p.ttft_seconds is None:
                        p.ttft_seconds = time.perf_counter() - t_forward
                pieces = list(info.fields.items())
                for k, t in info.snapshots.items():  # text an event repeats: checked where it is new
                    if t != "".join(streamed.get(k, ())):
                        pieces.append((k + ":snapshot", t))
                if guard is not None:
                    out.extend(await guard.feed(text, ev, pieces))
                else:
                    out.append(ev)
                if not hold.started and (text or info.kind == "terminal"):
                    hold.started = True
                    outcome.status = 200
                    yield b"", True
            for piece in hold.offer(out, outcome):
                yield piece
            if too_large is not None:
                raise event_too_large(outcome, too_large)
    except httpx.HTTPError as e:
        err = _transport_error(ctx, outcome.upstream, e, "read")
        if hold.held and hold.started:
            yield b"".join(hold.held), True
        raise err from None
    except ResponseWithheld as w:
        raise withheld_error(w) from None
    tail = await stream_tail(outcome, guard, hold, splitter.tail())
    outcome.status = 200
    yield b"".join(tail), False
