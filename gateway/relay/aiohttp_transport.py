"""The forward path's transport over aiohttp's ``ClientSession`` (``gateway.upstream_client:
aiohttp``; the default is :mod:`gateway.relay.h1_transport`). It keeps the semantics of
:class:`gateway.relay.upstream_base.Transport`: ``on_sent``, pools of ``max_connections`` per
upstream origin (scheme, host and port: :func:`~gateway.relay.h1_transport.url_origin`, busy and
idle connections together; no bound across them) kept
:data:`~gateway.relay.upstream_base.KEEPALIVE_SECONDS`, the two timeouts, raw bodies (no
decompression: the proxy asks for ``identity``; chunked framing removed), no header added but
``Host``, ``Content-Length`` and aiohttp's own ``Accept``; every aiohttp failure mapped onto the
exception tree (:func:`as_upstream_error`).

The pool's bound is the transport's own (:class:`_Slots`), not aiohttp's ``limit_per_host``:
aiohttp's ``connect`` timeout covers the wait for a pooled connection and the connect together,
so a busy engine (its connections all held by other requests) and an unreachable one would both be
a :class:`ConnectTimeout`, and the busy one backed off. A request first takes one of its origin's
``max_connections`` slots, waiting at most ``connect_timeout`` (else a :class:`PoolTimeout`, the
h1 transport's message), and only then goes to aiohttp, whose connector has no limit and never
waits: its ``connect`` timeout is a connect's alone. The slot is given back once, when the send
fails or is cancelled, or when its response is closed (after aiohttp has let go of the
connection). A pooled connection holds one descriptor at most: an upstream's addresses are tried
one at a time (no Happy Eyeballs, which opens a socket per address while the first still connects)
and a connection aiohttp closes is aborted (:func:`_abort_closing`) before its slot is given
back, so the sockets are at most ``max_connections`` times the origins sent to (what
:func:`gateway.edge.server.fds_needed` counts).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
from collections.abc import AsyncGenerator, Callable, Mapping
from contextvars import ContextVar
from typing import Any

import aiohttp

from gateway.relay.h1_transport import Origin, url_origin
from gateway.relay.upstream_base import (
    KEEPALIVE_SECONDS,
    ConnectError,
    ConnectTimeout,
    PooledTransport,
    PoolTimeout,
    ReadError,
    ReadTimeout,
    RemoteProtocolError,
    TransportError,
    UpstreamError,
    UpstreamResponse,
    WriteError,
    read_bounded,
    wake_first,
)


def as_upstream_error(exc: BaseException, *, connecting: bool) -> UpstreamError | None:
    """The :class:`UpstreamError` that stands for an aiohttp (or timeout) exception ``exc``, or
    ``None`` when ``exc`` is not a transport error. ``connecting``: raised before the response's
    headers arrived (a reset then is a failed send; afterwards, a failed read)."""
    name = type(exc).__name__
    msg = f"{name}: {exc}" if str(exc) else name
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return ConnectTimeout(msg)
    if isinstance(exc, aiohttp.ClientConnectorError):
        return ConnectError(msg)
    if isinstance(exc, (aiohttp.ServerTimeoutError, asyncio.TimeoutError)):
        return ReadTimeout(msg)
    if isinstance(exc, (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError, aiohttp.ClientResponseError)):
        return RemoteProtocolError(msg)
    if isinstance(exc, (aiohttp.ClientOSError, aiohttp.ClientConnectionError, ConnectionError)):
        return WriteError(msg) if connecting else ReadError(msg)
    if isinstance(exc, aiohttp.ClientError):
        return TransportError(msg)
    return None


class _Slots:
    """One origin's ``max_connections`` slots (module docstring): ``free`` ones, and the requests
    waiting for one, first come first served (a slot given back goes to the first of them)."""

    __slots__ = ("free", "origin", "waiters")

    def __init__(self, origin: Origin, size: int) -> None:
        self.origin = origin
        self.free = size
        self.waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    async def acquire(self, timeout: float) -> None:
        """Take a slot: at once when one is free, else the next given back within ``timeout``
        seconds; raises :class:`PoolTimeout` when none is."""
        if self.free > 0:
            self.free -= 1
            return
        waiter = asyncio.get_running_loop().create_future()
        self.waiters.append(waiter)
        try:
            async with asyncio.timeout(timeout):
                await waiter
        except BaseException as e:
            if waiter.done() and not waiter.cancelled():
                self.release()  # handed a slot in the turn it gave up: it goes to the next one
            if isinstance(e, TimeoutError):
                _, host, port = self.origin
                raise PoolTimeout(f"PoolTimeout: no free connection to {host}:{port} within {timeout:g}s") from None
            raise
        finally:
            with contextlib.suppress(ValueError):
                self.waiters.remove(waiter)

    def release(self) -> None:
        """Give a slot back: handed to the first request still waiting (it holds it from now on,
        :meth:`acquire` passing it on if it gave up in that turn), else counted free."""
        if not wake_first(self.waiters, None):
            self.free += 1


class AiohttpResponse:
    """An aiohttp response as an :class:`UpstreamResponse` (errors mapped, see the module); it
    holds its origin's slot until :meth:`aclose`."""

    __slots__ = ("_resp", "_slots", "_transports", "headers", "status_code")

    def __init__(self, resp: aiohttp.ClientResponse, transports: list[asyncio.Transport], slots: _Slots) -> None:
        self._resp = resp
        self._transports = transports
        self._slots: _Slots | None = slots
        self.status_code: int = resp.status
        self.headers: Mapping[str, str] = resp.headers

    async def aread(self, limit: int | None = None) -> bytes:
        """The whole body (bytes), at most ``limit`` of them (``None``: unbounded)."""
        if limit is not None:
            return await read_bounded(self.aiter_raw(), limit)
        try:
            return await self._resp.read()
        except Exception as e:
            mapped = as_upstream_error(e, connecting=False)
            if mapped is None:
                raise
            raise mapped from e

    async def aiter_raw(self) -> AsyncGenerator[bytes, None]:
        """The body's bytes as they arrive (transfer framing removed, content left encoded)."""
        content = self._resp.content
        while True:
            try:
                chunk = await content.readany()
            except Exception as e:
                mapped = as_upstream_error(e, connecting=False)
                if mapped is None:
                    raise
                raise mapped from e
            if not chunk:
                return
            yield chunk

    async def aclose(self) -> None:
        """Done with the response: a fully read body gives the connection back to the pool; an
        unread or partly read one closes it (so the engine sees the request abandoned). Then the
        origin's slot is given back (the first call only)."""
        resp = self._resp
        try:
            if resp.content.at_eof():
                resp.release()
            else:
                resp.close()
            _abort_closing(self._transports)
        finally:
            slots, self._slots = self._slots, None
            if slots is not None:
                slots.release()


class _Exchange:
    """One :meth:`AiohttpTransport.send`: its ``on_sent`` and the transports its request was
    written on (aiohttp sends it again on a new connection when a kept one fails)."""

    __slots__ = ("on_sent", "transports")

    def __init__(self, on_sent: Callable[[], None] | None) -> None:
        self.on_sent = on_sent
        self.transports: list[asyncio.Transport] = []


#: the exchange of the request being sent in this task (set by :meth:`AiohttpTransport.send`)
_EXCHANGE: ContextVar[_Exchange | None] = ContextVar("kvgate_upstream_exchange", default=None)


def _abort_closing(transports: list[asyncio.Transport]) -> None:
    """Abort those of ``transports`` aiohttp closed: its close waits to write the request bytes
    not yet sent, keeping the descriptor while an engine that reads nothing never takes them,
    and the origin's slot, given back next, would let a new connection open meanwhile. One still
    open is left alone."""
    for t in transports:
        if t.is_closing():
            t.abort()


class _Request(aiohttp.ClientRequest):
    """aiohttp's request (its documented ``request_class`` hook) that records the connection's
    transport in the sending task's :class:`_Exchange` and calls its ``on_sent`` once :meth:`send`
    has written the request's headers to the connection. (aiohttp's ``on_request_headers_sent``
    trace signal says the same, but a trace config makes aiohttp build and send every other signal
    of every request too: 13-23% more CPU per forward in an ad-hoc run against
    bench/mock_engine.py, where this hook measured the same as none.)"""

    async def send(self, conn: Any) -> aiohttp.ClientResponse:
        exchange = _EXCHANGE.get()
        if exchange is not None and conn.transport is not None:
            exchange.transports.append(conn.transport)
        resp = await super().send(conn)
        if exchange is not None and exchange.on_sent is not None:
            exchange.on_sent()
        return resp


#: a URL's origin (:func:`~gateway.relay.h1_transport.url_origin`), parsed once per URL (an
#: engine's URLs are few: the upstreams' routes)
_origin_of = functools.lru_cache(maxsize=256)(url_origin)


class AiohttpTransport(PooledTransport):
    """One pooled aiohttp session (module docstring), its limits a :class:`PooledTransport`'s. The
    session opens at the first send, inside the event loop it will run on; :meth:`aclose` at
    shutdown."""

    _session: aiohttp.ClientSession | None = None
    _pools: dict[Origin, _Slots] | None = None

    def _slots_for(self, url: str) -> _Slots:
        """The slots of ``url``'s origin (created at its first request)."""
        pools = self._pools
        if pools is None:
            pools = self._pools = {}
        origin = _origin_of(url)
        slots = pools.get(origin)
        if slots is None:
            slots = pools[origin] = _Slots(origin, self.max_connections)
        return slots

    def _open(self) -> aiohttp.ClientSession:
        connector = aiohttp.TCPConnector(
            # no bound across upstreams (a hung one must not make the others wait), nor per host:
            # an origin's bound is its slots (:class:`_Slots`), taken before aiohttp gets the
            # request and given back after it let go of the connection, so aiohttp never waits
            # for one of its own (a wait its ``connect`` timeout would count as a connect's)
            limit=0,
            limit_per_host=0,
            # one address at a time, as the h1 transport connects: Happy Eyeballs (RFC 8305) opens
            # a socket per address tried while the first is still connecting, past the origin's slots
            happy_eyeballs_delay=None,
            keepalive_timeout=KEEPALIVE_SECONDS,
            ttl_dns_cache=10,
            enable_cleanup_closed=False,
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(
                total=self.exchange_timeout, connect=self.connect_timeout, sock_read=self.read_timeout
            ),
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept-Encoding"),
            trust_env=False,
            cookie_jar=aiohttp.DummyCookieJar(),
            request_class=_Request,
        )
        return self._session

    async def send(
        self,
        method: str,
        url: str,
        content: bytes,
        headers: Mapping[str, str],
        on_sent: Callable[[], None] | None,
        pool_timeout: float | None = None,
    ) -> UpstreamResponse:
        """As :meth:`UpstreamClient.send`: once one of the origin's slots is taken (else
        :class:`PoolTimeout` after ``pool_timeout``, default ``connect_timeout``), given back
        when the send fails."""
        session = self._session or self._open()
        slots = self._slots_for(url)
        await slots.acquire(self.connect_timeout if pool_timeout is None else pool_timeout)
        exchange = _Exchange(on_sent)
        token = _EXCHANGE.set(exchange)
        try:
            resp = await session.request(method, url, data=content, headers=headers, allow_redirects=False)
        except BaseException as e:
            _abort_closing(exchange.transports)
            slots.release()
            mapped = as_upstream_error(e, connecting=True) if isinstance(e, Exception) else None
            if mapped is None:
                raise
            raise mapped from e
        finally:
            _EXCHANGE.reset(token)
        _abort_closing(exchange.transports)
        return AiohttpResponse(resp, exchange.transports, slots)

    async def aclose(self) -> None:
        """Close the pooled connections."""
        session, self._session = self._session, None
        if session is not None:
            await session.close()
