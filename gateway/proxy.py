"""Step 7 (and the hooks of 6 and 8): forward an admitted request to an upstream and relay the
answer (DESIGN.md, "A request's way through the gateway", "Error bodies").

:class:`ProxyCall` is the ASGI response a route handler returns once admission has passed. It

- tries the upstreams in balance order; a connect failure (refused, connect timeout, pool full)
  moves to the next before any byte is sent; the last failure is 503 ``upstream_unavailable``
  (504 ``upstream_timeout`` when it timed out);
- maps an engine's non-200 answer (SGLang flat ``{"object":"error",...}``, vLLM/OpenAI nested
  ``{"error":{...}}``, ``/generate``'s ``{"error":{"message"}}``) to the OpenAI shape with the
  engine's status, and likewise an error event that a 200 stream sends before any content;
- relays streams event by event, byte-exact (:mod:`gateway.sse`), ``data: [DONE]`` exactly once
  at the end; a stream cut mid-way ends with an OpenAI-shaped error event and ``[DONE]``;
- strips the usage chunk and ``"usage": null`` members the gateway asked for on the client's
  behalf (``stream_options.include_usage``, needed for the quota settle) when the client did not;
- watches the client: a disconnect cancels the upstream request (its connection is closed);
- counts ``finish_reason: "abort"`` under a 200, settles the quota lease exactly once, records
  metrics and one JSON access log line.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx
import orjson
from starlette.responses import Response

from config.errors import ErrorCode, OpenAIError, error_type_for_status
from config.models import TenantConfig
from gateway import logging as glog
from gateway.admission import Admission
from gateway.quotas import completion_tokens_of
from gateway.sse import DONE_EVENT, SSESplitter, inspect, is_error_payload, strip_usage_null
from gateway.stages import QuotaLease
from gateway.upstreams import Upstream
from verifier.stage import Exchange, ResponseGuard, ResponseWithheld

if TYPE_CHECKING:
    from gateway.app import Gateway

log = logging.getLogger("kvgate.proxy")

_OPENAI_TYPES = {
    "invalid_request_error",
    "authentication_error",
    "permission_error",
    "not_found_error",
    "rate_limit_error",
    "server_error",
    "api_error",
}
_CONNECT_FAILURES = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)


def engine_error(status: int, body: bytes | Any) -> OpenAIError:
    """An engine's error answer as an :class:`OpenAIError` with the engine's HTTP ``status``
    (for an error event inside a 200 stream, the event's numeric ``code`` when it is 4xx/5xx,
    else 502). ``body``: the raw bytes or an already parsed object."""
    data = body
    if isinstance(body, (bytes, bytearray)):
        try:
            data = orjson.loads(body)
        except orjson.JSONDecodeError:
            data = None
    e: dict[str, Any] = {}
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict):
            e = err
        elif isinstance(err, str):
            e = {"message": err}
        elif data.get("object") == "error" or "message" in data:
            e = data
        elif "detail" in data:
            e = {"message": str(data["detail"])}
    message = e.get("message")
    if not isinstance(message, str) or not message:
        text = bytes(body[:500]).decode("utf-8", "replace") if isinstance(body, (bytes, bytearray)) else ""
        message = f"The upstream engine answered {status}" + (f": {text}" if text.strip() else ".")
    raw_code = e.get("code")
    if status < 400:
        status = raw_code if isinstance(raw_code, int) and 400 <= raw_code <= 599 else 502
    code = raw_code if isinstance(raw_code, str) and raw_code else None
    if code is None and "maximum context length" in message:
        code = ErrorCode.CONTEXT_LENGTH_EXCEEDED
    etype = e.get("type")
    if etype not in _OPENAI_TYPES:
        etype = error_type_for_status(status)
    param = e.get("param") if isinstance(e.get("param"), str) else None
    return OpenAIError(status, message[:4000], code=code, param=param, type=etype)


def _error_event(err: OpenAIError) -> bytes:
    return b"data: " + err.body_bytes() + b"\n\n"


class _ClientGone(Exception):
    pass


@dataclass(eq=False)
class ProxyCall(Response):
    """The ASGI response of an admitted request. Fields are filled by the route handler;
    ``body`` is the upstream body (model rewritten, cache_salt set) as bytes."""

    gw: "Gateway"
    route: str
    request_id: str
    tenant: TenantConfig
    admission: Admission
    lease: QuotaLease
    candidates: list[Upstream]
    body: bytes
    stream: bool
    client_usage: bool
    t_arrival: float
    extra_headers: dict[str, str] = field(default_factory=dict)
    # starlette Response attributes (a ProxyCall sends its own start and body)
    background: Any = None
    raw_headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    status_code: int = 200
    # filled while running
    upstream: Upstream | None = None
    status: int = 0
    usage: dict[str, Any] | None = None
    finish_reason: str | None = None
    ttft: float | None = None
    t_forward: float = 0.0
    overhead: float = 0.0
    started: bool = False
    finished: bool = False
    disconnected: bool = False
    forwarded: bool = False
    error_code: str | None = None
    texts: dict[int, list[str]] = field(default_factory=dict)  # choice index -> text produced

    # ------------------------------------------------------------------ ASGI entry
    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        task = asyncio.current_task()
        watcher = asyncio.ensure_future(self._watch(receive, task))

        async def send_(message: Any) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                self.finished = True  # from here on a disconnect is the normal end, not a cancel
            await send(message)

        try:
            try:
                await self._run(send_)
            except OpenAIError as e:
                await self._send_error(send_, e)
            except (Exception, ExceptionGroup) as e:  # a bug (ours or a stage's): still an OpenAI body
                if isinstance(e, OSError) and self.started:
                    raise  # the client's socket is gone mid-response: nothing left to tell it
                log.error("request %s failed: %s", self.request_id, type(e).__name__, exc_info=e)
                await self._send_error(
                    send_,
                    OpenAIError(
                        500, "The server had an error while processing your request.", code=ErrorCode.INTERNAL_ERROR
                    ),
                )
        except asyncio.CancelledError:
            if not self.disconnected or task is None:
                raise
            task.uncancel()
            self.status = 499
            self.gw.metrics.client_disconnects.labels(self.route).inc()
        finally:
            self.finished = True
            watcher.cancel()
            await self._finish()

    async def _watch(self, receive: Any, task: asyncio.Task | None) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                if not self.finished and task is not None:
                    self.disconnected = True
                    task.cancel()
                return

    def _headers(self, content_type: bytes) -> list[tuple[bytes, bytes]]:
        h = [
            (b"content-type", content_type),
            (b"x-request-id", self.request_id.encode()),
            (b"x-kvgate-overhead-ms", f"{self.overhead * 1000:.3f}".encode()),
        ]
        for k, v in self.lease.headers.items():
            h.append((k.lower().encode(), str(v).encode()))
        for k, v in self.extra_headers.items():
            h.append((k.lower().encode(), str(v).encode()))
        return h

    async def _send_error(self, send: Any, err: OpenAIError) -> None:
        self.error_code = err.code
        if self.started:  # mid-stream: an error event, then the end of the stream
            self.status = self.status or 200
            await send({"type": "http.response.body", "body": _error_event(err) + DONE_EVENT, "more_body": False})
            return
        self.status = err.status
        if self.overhead == 0.0:
            self.overhead = time.perf_counter() - self.t_arrival
        h = self._headers(b"application/json")
        for k, v in (err.headers or {}).items():
            h.append((k.lower().encode(), str(v).encode()))
        body = err.body_bytes()
        h.append((b"content-length", str(len(body)).encode()))
        self.started = True
        await send({"type": "http.response.start", "status": err.status, "headers": h})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    # ------------------------------------------------------------------ forwarding
    async def _connect(self) -> httpx.Response:
        gw = self.gw
        order = gw.upstreams.order(self.candidates)
        last: Exception | None = None
        for u in order:
            headers = {
                "content-type": "application/json",
                "accept-encoding": "identity",
                "x-request-id": self.request_id,
            }
            if u.auth_header:
                headers["authorization"] = u.auth_header
            req = gw.client.build_request("POST", u.url_for(self.route), content=self.body, headers=headers)
            u.in_flight += 1
            self.upstream = u
            self.t_forward = time.perf_counter()
            try:
                resp = await gw.client.send(req, stream=True)
            except _CONNECT_FAILURES as e:
                u.in_flight -= 1
                self.upstream = None
                gw.metrics.upstream_errors.labels(u.name, "connect").inc()
                log.warning(
                    "upstream %s: connect failed (%s), trying the next",
                    u.name,
                    type(e).__name__,
                    extra={"fields": {"request_id": self.request_id}},
                )
                last = e
                continue
            except httpx.TimeoutException:
                gw.metrics.upstream_errors.labels(u.name, "timeout").inc()
                raise OpenAIError(
                    504, "The upstream engine did not answer in time.", code=ErrorCode.UPSTREAM_TIMEOUT
                ) from None
            except httpx.HTTPError as e:
                gw.metrics.upstream_errors.labels(u.name, "reset").inc()
                raise OpenAIError(
                    502, f"The upstream engine failed ({type(e).__name__}).", code=ErrorCode.UPSTREAM_UNAVAILABLE
                ) from None
            self.forwarded = True
            return resp
        if isinstance(last, (httpx.ConnectTimeout, httpx.PoolTimeout)):
            raise OpenAIError(
                504, "No upstream engine accepted the connection in time.", code=ErrorCode.UPSTREAM_TIMEOUT
            )
        raise OpenAIError(503, "No upstream engine for this model is reachable.", code=ErrorCode.UPSTREAM_UNAVAILABLE)

    async def _run(self, send: Any) -> None:
        resp = await self._connect()
        try:
            self.overhead = self.t_forward - self.t_arrival
            if resp.status_code != 200:
                try:
                    raw = await resp.aread()
                except httpx.HTTPError:
                    raw = b""
                self.gw.metrics.upstream_errors.labels(self.upstream.name, f"http_{resp.status_code}").inc()
                raise engine_error(resp.status_code, raw)
            if self.stream and not resp.headers.get("content-type", "").startswith("text/event-stream"):
                # an engine that answers a stream request with a JSON body is reporting an error
                try:
                    raw = await resp.aread()
                except httpx.HTTPError as e:
                    raise self._read_error(e) from None
                self.gw.metrics.upstream_errors.labels(self.upstream.name, "not_a_stream").inc()
                raise engine_error(200, raw)
            guard = self._begin_guard()
            if self.stream:
                await self._relay_stream(resp, send, guard)
            else:
                await self._relay_whole(resp, send, guard)
        finally:
            await resp.aclose()

    def _begin_guard(self) -> ResponseGuard | None:
        a = self.admission
        return self.gw.verifier.begin(
            Exchange(
                self.request_id,
                self.tenant,
                self.upstream.name if self.upstream else "",
                a.model.id,
                self.route,
                a.prompt_text,
                a.prompt_tokens,
                self.stream,
                self.t_arrival_monotonic,
            )
        )

    @property
    def t_arrival_monotonic(self) -> float:
        return time.monotonic() - (time.perf_counter() - self.t_arrival)

    def _read_error(self, e: httpx.HTTPError) -> OpenAIError:
        u = self.upstream.name if self.upstream else "-"
        if isinstance(e, httpx.TimeoutException):
            self.gw.metrics.upstream_errors.labels(u, "timeout").inc()
            return OpenAIError(504, "The upstream engine did not answer in time.", code=ErrorCode.UPSTREAM_TIMEOUT)
        self.gw.metrics.upstream_errors.labels(u, "reset").inc()
        return OpenAIError(
            502, f"The upstream engine broke the connection ({type(e).__name__}).", code=ErrorCode.UPSTREAM_UNAVAILABLE
        )

    async def _relay_whole(self, resp: httpx.Response, send: Any, guard: ResponseGuard | None) -> None:
        try:
            raw = await resp.aread()
        except httpx.HTTPError as e:
            raise self._read_error(e) from None
        t_done = time.perf_counter()
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise OpenAIError(
                502, "The upstream engine answered a body that is not JSON.", code=ErrorCode.UPSTREAM_UNAVAILABLE
            ) from None
        if is_error_payload(data):
            raise engine_error(200, data)
        text = ""
        if isinstance(data, dict):
            usage = data.get("usage")
            self.usage = usage if isinstance(usage, dict) else None
            texts = []
            for c in data.get("choices") or ():
                if not isinstance(c, dict):
                    continue
                msg = c.get("message")
                t = msg.get("content") if isinstance(msg, dict) else c.get("text")
                if isinstance(t, str):
                    texts.append(t)
                if self.finish_reason is None and isinstance(c.get("finish_reason"), str):
                    self.finish_reason = c["finish_reason"]
            text = "".join(texts)
            self.texts = {i: [t] for i, t in enumerate(texts)}
        prefill = resp.headers.get("x-prefill-seconds")
        if prefill:
            try:
                self.ttft = float(prefill)
            except ValueError:
                pass
        if guard is not None:
            try:
                await guard.check_body(text, usage=self.usage, finish_reason=self.finish_reason, ttft_seconds=self.ttft)
            except ResponseWithheld as w:
                raise OpenAIError(
                    502,
                    f"The response was withheld by verification (incident {w.incident_id}).",
                    code=ErrorCode.RESPONSE_WITHHELD,
                ) from None
        self.overhead += time.perf_counter() - t_done
        h = self._headers(b"application/json")
        h.append((b"content-length", str(len(raw)).encode()))
        self.status = 200
        self.started = True
        await send({"type": "http.response.start", "status": 200, "headers": h})
        await send({"type": "http.response.body", "body": raw, "more_body": False})

    async def _relay_stream(self, resp: httpx.Response, send: Any, guard: ResponseGuard | None) -> None:
        splitter = SSESplitter()
        held: list[bytes] = []
        strip = not self.client_usage
        done = False
        t0 = self.t_forward

        async def start() -> None:
            self.status = 200
            self.started = True
            h = self._headers(b"text/event-stream; charset=utf-8")
            h += [(b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
            await send({"type": "http.response.start", "status": 200, "headers": h})

        try:
            async for chunk in resp.aiter_raw():
                out: list[bytes] = []
                for ev in splitter.feed(chunk):
                    info = inspect(ev)
                    if info.kind == "done":
                        done = True
                        break
                    if info.kind == "error":
                        err = engine_error(200, info.data)
                        if not self.started:
                            raise err
                        out.append(_error_event(err))
                        self.error_code = err.code
                        continue
                    if info.kind == "chunk":
                        if info.usage is not None:
                            self.usage = info.usage
                        if info.text:
                            self._note_text(info.data)
                        if info.finish_reason is not None:
                            self.finish_reason = info.finish_reason
                        if strip:
                            if info.usage_only:
                                continue
                            ev = strip_usage_null(ev)
                        if info.text and self.ttft is None:
                            self.ttft = time.perf_counter() - t0
                    if guard is not None:
                        out.extend(await guard.feed(info.text, ev))
                    else:
                        out.append(ev)
                    if not self.started and (info.text or info.finish_reason):
                        await start()
                if out:
                    if not self.started:
                        held.extend(out)
                    else:
                        if held:
                            out = held + out
                            held = []
                        await send({"type": "http.response.body", "body": b"".join(out), "more_body": True})
                if done:
                    break
        except httpx.HTTPError as e:
            err = self._read_error(e)
            if not self.started:
                raise err from None
            await send(
                {
                    "type": "http.response.body",
                    "body": b"".join(held) + _error_event(err) + DONE_EVENT,
                    "more_body": False,
                }
            )
            self.error_code = err.code
            return
        except ResponseWithheld as w:
            raise OpenAIError(
                502,
                f"The response was withheld by verification (incident {w.incident_id}).",
                code=ErrorCode.RESPONSE_WITHHELD,
            ) from None
        tail: list[bytes] = held
        if guard is not None:
            try:
                tail += await guard.finish_stream(
                    usage=self.usage, finish_reason=self.finish_reason, ttft_seconds=self.ttft
                )
            except ResponseWithheld as w:
                raise OpenAIError(
                    502,
                    f"The response was withheld by verification (incident {w.incident_id}).",
                    code=ErrorCode.RESPONSE_WITHHELD,
                ) from None
        if not done and splitter.tail().strip():
            log.warning("upstream stream ended inside an event", extra={"fields": {"request_id": self.request_id}})
        if not self.started:
            await start()
        await send({"type": "http.response.body", "body": b"".join(tail) + DONE_EVENT, "more_body": False})

    def _note_text(self, chunk: dict[str, Any]) -> None:
        """Keep each choice's streamed text: what a settle without usage counts."""
        for c in chunk.get("choices") or ():
            if isinstance(c, dict):
                d = c.get("delta")
                t = d.get("content") if isinstance(d, dict) else c.get("text")
                if isinstance(t, str) and t:
                    i = c.get("index")
                    self.texts.setdefault(i if isinstance(i, int) else 0, []).append(t)

    # ------------------------------------------------------------------ bookkeeping
    async def _finish(self) -> None:
        gw = self.gw
        a = self.admission
        u = self.upstream
        if u is not None:
            u.in_flight -= 1
        completion = None
        if isinstance(self.usage, dict):
            ct = self.usage.get("completion_tokens")
            pt = self.usage.get("prompt_tokens")
            if isinstance(ct, int):
                completion = ct
            used = (pt if isinstance(pt, int) else a.prompt_tokens_total) + (ct if isinstance(ct, int) else 0)
        elif not self.forwarded:
            used = 0
        else:  # no usage report (none sent, or the stream was cut/cancelled): count what was produced
            used = -1
        try:
            if used < 0:
                used = a.prompt_tokens_total + await completion_tokens_of(a.model.counter, self.texts.values())
            await gw.quotas.settle(self.lease, used)
        except Exception:
            log.exception("quota settle failed")
        tenant = self.tenant.id
        m = gw.metrics
        m.requests.labels(tenant, self.route, str(self.status)).inc()
        if self.forwarded:
            m.prompt_tokens.labels(tenant).inc(a.prompt_tokens_total)
        if completion:
            m.completion_tokens.labels(tenant).inc(completion)
        m.overhead.labels(self.route).observe(self.overhead)
        if self.ttft is not None and u is not None:
            m.ttft.labels(u.name).observe(self.ttft)
        if self.error_code and self.status >= 400:
            m.rejections.labels(self.error_code).inc()
        fields = {
            "request_id": self.request_id,
            "tenant": tenant,
            "route": self.route,
            "status": self.status,
            "model": a.model.id,
            "upstream": u.name if u else None,
            "stream": self.stream,
            "prompt_tokens": a.prompt_tokens_total,
            "max_tokens": a.max_tokens,
            "limit_tokens": a.limit,
            "completion_tokens": completion,
            "finish_reason": self.finish_reason,
            "overhead_ms": round(self.overhead * 1000, 3),
            "ttft_ms": round(self.ttft * 1000, 3) if self.ttft is not None else None,
            "total_ms": round((time.perf_counter() - self.t_arrival) * 1000, 3),
        }
        if self.error_code:
            fields["error_code"] = self.error_code
        if self.finish_reason == "abort" and self.status == 200:
            m.aborts.labels(u.name if u else "-").inc()
            log.warning("upstream finished a 200 response with finish_reason 'abort'", extra={"fields": fields})
        if self.disconnected:
            fields["client_disconnected"] = True
        glog.access(fields)
