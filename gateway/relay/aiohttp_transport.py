"""The forward path's transport over aiohttp's ``ClientSession`` (``gateway.upstream_client:
aiohttp``; the default is :mod:`gateway.relay.h1_transport`). It keeps the semantics of
:class:`gateway.relay.upstream_base.Transport`: ``on_sent``, pools of ``max_connections`` per
upstream (host, port and TLS: aiohttp's ``limit_per_host``, busy and idle connections together;
no bound across them) kept :data:`~gateway.relay.upstream_base.KEEPALIVE_SECONDS`, the two
timeouts, raw bodies (no decompression: the proxy asks for ``identity``; chunked framing removed),
no header added but ``Host``, ``Content-Length`` and aiohttp's own ``Accept``; every aiohttp
failure mapped onto the exception tree (:func:`as_upstream_error`). A pooled connection holds
one descriptor at most: an upstream's addresses are tried one at a time (no Happy Eyeballs, which
opens a socket per address while the first still connects) and a connection aiohttp closes is
aborted (:func:`_abort_closing`), so the sockets are at most ``max_connections`` times the
origins sent to (what :func:`gateway.edge.server.fds_needed` counts).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable, Mapping
from contextvars import ContextVar
from typing import Any

import aiohttp

from gateway.relay.upstream_base import (
    KEEPALIVE_SECONDS,
    ConnectError,
    ConnectTimeout,
    PooledTransport,
    ReadError,
    ReadTimeout,
    RemoteProtocolError,
    TransportError,
    UpstreamError,
    UpstreamResponse,
    WriteError,
    read_bounded,
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


class AiohttpResponse:
    """An aiohttp response as an :class:`UpstreamResponse` (errors mapped, see the module)."""

    __slots__ = ("_resp", "_transports", "headers", "status_code")

    def __init__(self, resp: aiohttp.ClientResponse, transports: list[asyncio.Transport]) -> None:
        self._resp = resp
        self._transports = transports
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
        unread or partly read one closes it (so the engine sees the request abandoned)."""
        resp = self._resp
        if resp.content.at_eof():
            resp.release()
        else:
            resp.close()
        _abort_closing(self._transports)


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
    not yet sent, keeping the descriptor while an engine that reads nothing never takes them, and
    gives the connection's ``limit_per_host`` slot back meanwhile. One still open is left alone."""
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


class AiohttpTransport(PooledTransport):
    """One pooled aiohttp session (module docstring), its limits a :class:`PooledTransport`'s. The
    session opens at the first send, inside the event loop it will run on; :meth:`aclose` at
    shutdown."""

    _session: aiohttp.ClientSession | None = None

    def _open(self) -> aiohttp.ClientSession:
        connector = aiohttp.TCPConnector(
            limit=0,  # no bound across upstreams: a hung one must not make the others wait
            limit_per_host=self.max_connections,
            # one address at a time, as the h1 transport connects: Happy Eyeballs (RFC 8305) opens
            # a socket per address tried while the first is still connecting, past limit_per_host
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
        self, method: str, url: str, content: bytes, headers: Mapping[str, str], on_sent: Callable[[], None] | None
    ) -> UpstreamResponse:
        """As :meth:`UpstreamClient.send`."""
        session = self._session or self._open()
        exchange = _Exchange(on_sent)
        token = _EXCHANGE.set(exchange)
        try:
            resp = await session.request(method, url, data=content, headers=headers, allow_redirects=False)
        except Exception as e:
            mapped = as_upstream_error(e, connecting=True)
            if mapped is None:
                raise
            raise mapped from e
        finally:
            _EXCHANGE.reset(token)
            _abort_closing(exchange.transports)
        return AiohttpResponse(resp, exchange.transports)

    async def aclose(self) -> None:
        """Close the pooled connections."""
        session, self._session = self._session, None
        if session is not None:
            await session.close()
