"""The forward path's HTTP/1.1 transport: asyncio protocols over a pool of kept-alive connections,
responses parsed by httptools (llhttp, the parser of Node.js and uvicorn).

It implements :class:`gateway.relay.upstream_base.Transport` with the semantics
:mod:`gateway.relay.upstream_client` documents (``on_sent``, the pool, the two timeouts, raw
bodies, the exception tree) and nothing more: no redirects, cookies, proxies, decompression,
``Expect: 100-continue`` or pipelining. What it saves over aiohttp's ``ClientSession`` is the
per-request machinery a general client carries (request and response objects, a stream reader, a
timer per read, connector bookkeeping): docs/performance.md, "eighth pass", has the measurement.

The request goes out as one write: the request line, ``Host`` (unless given), the given headers
(``Content-Length``/``Transfer-Encoding`` among them are dropped: the transport frames the body),
``Content-Length``, the body. A header name or value holding CR, LF or NUL raises ``ValueError``
(a request never goes out with a header it did not mean). A response body is framed by its
``Content-Length``, chunked encoding or, with neither, the connection's close; a response whose
``Transfer-Encoding`` names any coding but ``chunked`` (``gzip, chunked``: the request sends no
``TE``, so none may be applied, RFC 9112 7.4) is a :class:`RemoteProtocolError`, its body never
read as the answer (a ``Content-Encoding`` is not the transport's: bodies are raw); a connection is
kept for the next request only when its response was read to the end and both sides allow
keep-alive, and no byte came after it (RFC 9112 6.3: such bytes are never read as the next
request's response); one that is not kept is aborted, its descriptor closed at once and request
bytes not yet sent dropped. Trailer fields are discarded. A response head over :data:`MAX_HEAD_BYTES` or
:data:`MAX_HEAD_LINES` lines, or chunk framing or a trailer section of more than
:data:`MAX_HEAD_BYTES` between two body bytes, is a :class:`RemoteProtocolError`; reading pauses
while the reader holds :data:`HIGH_WATER_BYTES`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import math
import ssl
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any
from urllib.parse import SplitResult, urlsplit

import httptools
from multidict import CIMultiDict, CIMultiDictProxy

from config.models import DEFAULT_PORTS, split_origin
from gateway.relay.upstream_base import (
    KEEPALIVE_SECONDS,
    ConnectError,
    ConnectTimeout,
    PooledTransport,
    PoolTimeout,
    ReadError,
    ReadTimeout,
    RemoteProtocolError,
    UpstreamError,
    WriteError,
    over_limit,
    wake_first,
)

#: buffered body bytes at which the connection stops reading until the consumer catches up
HIGH_WATER_BYTES = 64 * 1024
#: a response head (status line, interim answers and headers) larger, or with more header lines, is
#: a protocol error: httptools keeps a head's header lines in memory until it is complete
MAX_HEAD_BYTES = 64 * 1024
MAX_HEAD_LINES = 256
_FRAMING = frozenset({"content-length", "transfer-encoding"})
_BAD_HEADER_CHARS = ("\r", "\n", "\0")

Origin = tuple[str, str, int]  # scheme, host, port


class _Connection(asyncio.Protocol):
    """One connection to an engine: writes a request, parses its response, and answers the
    :class:`H1Response` reading it. At most one request at a time."""

    def __init__(self, pool: H1Transport, origin: Origin) -> None:
        self.pool = pool
        self.origin = origin
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        #: holds one of its origin's ``max_connections`` slots (given back once: :meth:`H1Transport._free`)
        self.counted = True
        self.idle_since = 0.0
        self.response: H1Response | None = None
        self._headers: list[tuple[bytes, bytes]] = []
        self._head: asyncio.Future[H1Response] | None = None  # waits for the status line and headers
        self._head_bytes = 0  # bytes received while ``_head`` waits, or since the response's last body byte
        self._last_data = 0.0
        self._deadline = math.inf  # loop time by which the exchange must have ended (``exchange_timeout``)
        self._timer: asyncio.TimerHandle | None = None
        self._paused = False
        self._keep_alive = False  # the last response allows the connection's reuse

    # asyncio.Protocol ------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self._last_data = self.loop.time()
        if self._head is None and self.response is None:  # bytes nobody asked for: not a connection to keep
            self.close()
            return
        # checked before feeding: a head may share its last read with the body; the bytes between two
        # body bytes (chunk lines, a trailer section) are bounded as a head is: httptools keeps a
        # trailer field's value until its line ends
        if self._head_bytes > MAX_HEAD_BYTES:
            what = "head" if self._head is not None else "chunk framing or trailer section"
            self._fail(RemoteProtocolError(f"RemoteProtocolError: a response {what} over {MAX_HEAD_BYTES} bytes"))
            return
        self._head_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(RemoteProtocolError("RemoteProtocolError: the engine switched protocols"))
        except httptools.HttpParserError as e:
            self._fail(RemoteProtocolError(f"RemoteProtocolError: malformed response: {e}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._stop_timer()
        self.pool._free(self)
        r = self.response
        if r is not None and not r.complete and r.until_close and exc is None:
            r._end()  # a body framed by the connection's close
            return
        if isinstance(exc, OSError):  # reset, broken pipe, a TLS error
            name = type(exc).__name__
            err: UpstreamError = (WriteError if self._head is not None else ReadError)(f"{name}: {exc}")
        else:
            where = "before its response" if self._head is not None else "inside its response"
            err = RemoteProtocolError(f"RemoteProtocolError: the engine closed the connection {where}")
        self._fail(err)

    @property
    def open(self) -> bool:
        """Neither closed nor closing: :meth:`close` (a parser error, bytes nobody asked for) only
        starts closing, and the engine may not see the close before the pool would hand the
        connection to the next request."""
        return not self.closed and self.transport is not None and not self.transport.is_closing()

    # httptools callbacks -----------------------------------------------------------------------
    def on_message_begin(self) -> None:
        if self._head is None:
            # bytes after the response's end that no request asked for (a Content-Length shorter
            # than the body, a second answer): never read as the next request's response (RFC 9112
            # 6.3: a client MUST NOT process such extra data as a separate response); held by the
            # parser, they would be prepended to it. The response before them stands.
            self.close()
            raise httptools.HttpParserError("stop")

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._head is None:
            # a trailer field (after a chunked body's last chunk): discarded (RFC 9112 7.1.2), never
            # merged into a header section (RFC 9110 6.5.1), least of all the next response's
            return
        self._headers.append((name, value))
        if len(self._headers) > MAX_HEAD_LINES:
            self._fail(RemoteProtocolError(f"RemoteProtocolError: more than {MAX_HEAD_LINES} header lines"))
            raise httptools.HttpParserError("stop")  # stop parsing; the failure above is the one reported

    def on_headers_complete(self) -> None:
        if self._head is None:  # a response to no request: never read it, never keep the connection
            self.close()
            return
        status = self.parser.get_status_code()
        if 100 <= status < 200:  # an interim response (100 Continue, 103 Early Hints): the real one follows
            self._headers = []
            return
        headers = CIMultiDict((n.decode("latin-1"), v.decode("latin-1")) for n, v in self._headers)
        self._headers = []
        te = headers.getall("transfer-encoding", [])
        if te and transfer_codings(te) != ["chunked"]:
            # a transfer coding is the message's framing, which the gateway must undo to read the
            # body; the request sends no TE, so an engine may apply no coding but chunked (RFC 9112
            # 7.4, RFC 9110 10.1.4): its body is bytes nobody here can read, never the answer
            named = ", ".join(te)
            self._fail(RemoteProtocolError(f"RemoteProtocolError: the engine answered Transfer-Encoding {named!r}"))
            raise httptools.HttpParserError("stop")  # stop parsing; the failure above is the one reported
        framed = "content-length" in headers or bool(te)
        r = H1Response(self, status, CIMultiDictProxy(headers), until_close=not framed and status not in (204, 304))
        self.response = r
        head, self._head = self._head, None
        if head is not None and not head.done():
            head.set_result(r)

    def on_body(self, body: bytes) -> None:
        self._head_bytes = 0
        r = self.response
        if r is not None and not r.complete:
            r._feed(body)

    def on_message_complete(self) -> None:
        r = self.response
        if r is not None and self._head is None:
            self._keep_alive = self.parser.should_keep_alive()  # llhttp forgets it once the next message starts
            r._end()

    # the request -------------------------------------------------------------------------------
    def send(self, data: bytes) -> asyncio.Future[H1Response]:
        """Write one request (``data``: head and body) and return the future of its response's head."""
        assert self.transport is not None
        self.response = None
        self._keep_alive = False
        self._head_bytes = 0
        self._head = self.loop.create_future()
        self.transport.write(data)
        self._start_timer()
        return self._head

    def _start_timer(self) -> None:
        self._last_data = self.loop.time()
        limit = self.pool.exchange_timeout
        self._deadline = self._last_data + limit if limit is not None else math.inf
        if self._timer is None:
            self._timer = self.loop.call_at(
                min(self._last_data + self.pool.read_timeout, self._deadline), self._on_timer
            )

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _on_timer(self) -> None:
        """No byte within ``read_timeout`` of the request or of the last byte, while the response is
        unfinished and reading not paused, or the response unfinished ``exchange_timeout`` after
        the request (paused or not: an engine that trickles its answer): a :class:`ReadTimeout`;
        else check again ``read_timeout`` after the last byte, or at the deadline if sooner (one
        timer a request, not one a read)."""
        self._timer = None
        now = self.loop.time()
        if now >= self._deadline:
            limit = self.pool.exchange_timeout
            self._fail(ReadTimeout(f"ReadTimeout: the engine's answer did not end within {limit:g}s"))
            self.close()
            return
        due = self._last_data + self.pool.read_timeout
        if self._paused or now < due:
            self._timer = self.loop.call_at(min(max(due, now + 0.001), self._deadline), self._on_timer)
            return
        self._fail(ReadTimeout(f"ReadTimeout: no byte from the engine within {self.pool.read_timeout:g}s"))
        self.close()

    def pause(self) -> None:
        if not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self._paused and self.transport is not None:
            self._paused = False
            self._last_data = self.loop.time()
            self.transport.resume_reading()

    def _fail(self, err: UpstreamError) -> None:
        head, self._head = self._head, None
        if head is not None and not head.done():
            head.set_exception(err)
        elif self.response is not None and not self.response.complete:
            self.response._error(err)
        self.close()

    def finished(self, reusable: bool) -> None:
        """The response is done with: keep the connection for the next request, or close it."""
        self._stop_timer()
        self.response = None
        if reusable and self.open and self._keep_alive:
            self.pool._release(self)
        else:
            self.close()
            self.pool._free(self)

    def close(self) -> None:
        """Close at once, dropping request bytes not yet sent (``abort``, also for a transport
        already closing): a closing transport keeps its descriptor until its unsent bytes are
        written, which an engine that reads nothing never lets happen, while the connection's
        slot is given back and filled by a new connection."""
        self._stop_timer()
        if self.transport is not None:
            self.transport.abort()


class H1Response:
    """An engine's response (:class:`gateway.relay.upstream_base.UpstreamResponse`): the status
    and headers are in; the body is read with :meth:`aread` or :meth:`aiter_raw`."""

    __slots__ = (
        "_conn",
        "_chunks",
        "_buffered",
        "_waiter",
        "_err",
        "complete",
        "until_close",
        "status_code",
        "headers",
        "_done",
    )

    def __init__(self, conn: _Connection, status: int, headers: CIMultiDictProxy[str], until_close: bool) -> None:
        self._conn = conn
        self.status_code = status
        self.headers: Mapping[str, str] = headers
        self.until_close = until_close
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._waiter: asyncio.Future[None] | None = None
        self._err: UpstreamError | None = None
        self.complete = False
        self._done = False  # aclose ran

    def _feed(self, body: bytes) -> None:
        self._chunks.append(body)
        self._buffered += len(body)
        if self._buffered > HIGH_WATER_BYTES:
            self._conn.pause()
        self._wake()

    def _end(self) -> None:
        self.complete = True
        self._conn._stop_timer()
        self._wake()

    def _error(self, err: UpstreamError) -> None:
        self._err = err
        self._wake()

    def _wake(self) -> None:
        w, self._waiter = self._waiter, None
        if w is not None and not w.done():
            w.set_result(None)

    async def _more(self) -> bool:
        """Wait until a chunk, the end or an error is there; ``False`` at the end."""
        while not self._chunks:
            if self._err is not None:
                raise self._err
            if self.complete:
                return False
            self._waiter = self._conn.loop.create_future()
            await self._waiter
        return True

    def _take(self) -> bytes:
        data = b"".join(self._chunks) if len(self._chunks) > 1 else self._chunks[0]
        self._chunks.clear()
        self._buffered = 0
        self._conn.resume()
        return data

    async def aread(self, limit: int | None = None) -> bytes:
        """The whole body (bytes), at most ``limit`` of them (``None``: unbounded). Raises
        :class:`UpstreamError` (:class:`ResponseTooLarge` past ``limit``)."""
        parts: list[bytes] = []
        size = 0
        while await self._more():
            parts.append(self._take())
            size += len(parts[-1])
            over_limit(size, limit)
        return b"".join(parts) if len(parts) != 1 else parts[0]

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive (chunked framing removed, content left encoded)."""
        while await self._more():
            yield self._take()

    async def aclose(self) -> None:
        """Done with the response: a body read to its end gives the connection back to the pool;
        an unread or partly read one closes it (the engine sees the request abandoned)."""
        if not self._done:
            self._done = True
            self._conn.finished(
                reusable=self.complete and not self._chunks and self._err is None and not self.until_close
            )


class _OriginPool:
    """One origin's share of the transport: its idle connections (most recently freed last), the
    connections open or connecting (idle ones included) and the requests waiting for one."""

    __slots__ = ("idle", "open", "waiters")

    def __init__(self) -> None:
        self.idle: list[_Connection] = []
        self.open = 0
        self.waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    def wake_one(self) -> None:
        """A connection was freed (kept idle, or its slot given back): the first request still
        waiting looks again (:meth:`H1Transport._acquire`; it is handed nothing, and a request
        arriving meanwhile may take the connection first); none waiting, nothing to do."""
        wake_first(self.waiters, None)


class H1Transport(PooledTransport):
    """Pools of at most ``max_connections`` connections per origin (scheme, host, port: one per
    upstream; :func:`url_origin`), busy, idle and connecting together, so an engine that holds all
    of its connections (hung, or slow) never makes a request to another one wait; across origins,
    an idle connection is closed to make room while the transport holds ``max_connections`` or
    more in all, a busy one never: the transport may hold ``max_connections`` times the origins it
    sends to (what :func:`gateway.edge.server.fds_needed` counts). Each idle connection is kept
    :data:`~gateway.relay.upstream_base.KEEPALIVE_SECONDS` when idle; the timeouts as
    :class:`~gateway.relay.upstream_base.PooledTransport` says (``connect_timeout`` bounds the
    wait for a free connection and, apart from it, each connect, the TLS handshake included:
    :meth:`_acquire`). ``ssl_context``: for ``https`` upstreams (default: the system's trust store,
    hostnames checked)."""

    def __init__(
        self,
        *,
        connect_timeout: float,
        read_timeout: float,
        max_connections: int,
        exchange_timeout: float | None = None,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        super().__init__(
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            max_connections=max_connections,
            exchange_timeout=exchange_timeout,
        )
        self._ssl = ssl_context
        self._pools: dict[Origin, _OriginPool] = {}
        self._open = 0  # connections open or connecting, all origins together, idle ones included
        self._closing = False

    async def send(
        self,
        method: str,
        url: str,
        content: bytes,
        headers: Mapping[str, str],
        on_sent: Callable[[], None] | None,
        pool_timeout: float | None = None,
    ) -> H1Response:
        """As :meth:`gateway.relay.upstream_client.UpstreamClient.send`."""
        origin, target, host = _parsed(url)
        request = _request_bytes(method, target, host, content, headers)
        conn = await self._acquire(origin, self.connect_timeout if pool_timeout is None else pool_timeout)
        try:
            head = conn.send(request)
        except BaseException:
            conn.finished(reusable=False)
            raise
        if on_sent is not None:
            on_sent()
        try:
            return await head
        except BaseException:
            conn.finished(reusable=False)
            raise

    async def _acquire(self, origin: Origin, pool_timeout: float) -> _Connection:
        """A kept connection to ``origin``, or a new one while ``origin`` holds fewer than
        ``max_connections`` (an idle one to another origin is closed first while the transport
        holds ``max_connections`` in all), or the next one to ``origin`` freed within
        ``pool_timeout`` seconds (else a :class:`PoolTimeout`). Two bounds: the wait for a free
        slot (``pool_timeout``: ``connect_timeout``, or what is left of the relay's wait for the
        tenant's share), and a connect, which whenever it starts (at once, or when a
        slot freed by a closed connection needs a new one) has a full ``connect_timeout`` of its
        own (else a :class:`ConnectTimeout`): a request that waited for a slot is not left a
        sliver of time to connect, and a busy engine slow to accept is not taken for an
        unreachable one (a connect failure backs its upstream off for every tenant)."""
        loop = asyncio.get_running_loop()
        pool_deadline = loop.time() + pool_timeout
        pool = self._pools.get(origin)
        if pool is None:
            pool = self._pools[origin] = _OriginPool()
        while True:
            idle = pool.idle
            while idle:
                conn = idle.pop()
                if conn.open and loop.time() - conn.idle_since < KEEPALIVE_SECONDS:
                    return conn
                conn.close()  # stale
                self._free(conn)
            if pool.open < self.max_connections:
                if self._open >= self.max_connections:
                    self._close_an_idle_connection()
                return await self._connect(origin, pool)
            waiter = loop.create_future()
            pool.waiters.append(waiter)
            try:
                async with asyncio.timeout_at(pool_deadline):
                    await waiter
            except BaseException as e:
                if waiter.done() and not waiter.cancelled():
                    pool.wake_one()  # woken in the same turn it gave up: the freed connection goes to the next one
                if isinstance(e, TimeoutError):
                    raise PoolTimeout(
                        f"PoolTimeout: no free connection to {origin[1]}:{origin[2]} within {pool_timeout:g}s"
                    ) from None
                raise
            finally:
                with contextlib.suppress(ValueError):
                    pool.waiters.remove(waiter)

    def _close_an_idle_connection(self) -> None:
        """Close the longest-idle connection of the first origin that has one (none: nothing)."""
        for pool in self._pools.values():
            if pool.idle:
                conn = pool.idle.pop(0)
                conn.close()
                self._free(conn)
                return

    async def _connect(self, origin: Origin, pool: _OriginPool) -> _Connection:
        """A new connection to ``origin`` (its slot taken now), within ``connect_timeout`` from
        now, however long the request waited for the slot."""
        scheme, host, port = origin
        self._open += 1
        pool.open += 1
        conn = _Connection(self, origin)
        ctx = None
        if scheme == "https":
            if self._ssl is None:
                self._ssl = ssl.create_default_context()  # once: it loads the trust store
            ctx = self._ssl
        try:
            async with asyncio.timeout(self.connect_timeout):
                await asyncio.get_running_loop().create_connection(lambda: conn, host, port, ssl=ctx)
        except BaseException as e:
            conn.closed = True
            self._free(conn)
            if isinstance(e, TimeoutError):
                raise ConnectTimeout(
                    f"ConnectTimeout: no connection to {host}:{port} within {self.connect_timeout:g}s"
                ) from None
            if isinstance(e, (OSError, ssl.SSLError)):
                raise ConnectError(f"ConnectError: {host}:{port}: {e}") from e
            raise
        return conn

    def _release(self, conn: _Connection) -> None:
        """``conn`` is free: kept for its origin (closed instead while the transport closes)."""
        if self._closing:
            conn.close()
            return
        conn.idle_since = conn.loop.time()
        pool = self._pools[conn.origin]
        pool.idle.append(conn)
        pool.wake_one()

    def _free(self, conn: _Connection) -> None:
        """``conn`` is closed or closing: out of its origin's idle list, its slot given back (once)."""
        pool = self._pools[conn.origin]
        if conn in pool.idle:
            pool.idle.remove(conn)
        if conn.counted:
            conn.counted = False
            self._open -= 1
            pool.open -= 1
            pool.wake_one()

    @property
    def _idle(self) -> dict[Origin, list[_Connection]]:
        """Each origin's idle connections (its pool's list, derived)."""
        return {origin: pool.idle for origin, pool in self._pools.items()}

    async def aclose(self) -> None:
        """Close every idle connection; a busy one closes when its response is done with."""
        self._closing = True
        for pool in self._pools.values():
            for conn in list(pool.idle):
                conn.close()
                self._free(conn)
        await asyncio.sleep(0)


@functools.lru_cache(maxsize=256)
def _parsed(url: str) -> tuple[Origin, str, str]:
    """``url``'s origin, request target and ``Host`` value, parsed once per URL (an engine's
    URLs are few: the upstreams' routes). Raises :class:`ConnectError` for a URL that is not
    http(s) with a host, ``ValueError`` for a target holding whitespace or a control character."""
    parts = urlsplit(url)
    origin = _origin(parts, url)
    target = parts.path or "/"
    if parts.query:
        target += "?" + parts.query
    if not target.isprintable() or " " in target:
        raise ValueError(f"request target {target!r} holds whitespace or a control character")
    return origin, target, _host(parts)


def url_origin(url: str) -> Origin:
    """The origin whose pool a request to ``url`` uses: :func:`config.models.split_origin`'s
    (scheme and host lower-cased but an IPv6 zone id, the scheme's default port when the URL has
    none; the upstreams' tenant shares are keyed by the same reading), for http(s) URLs with a
    host only.
    aiohttp keys its pools by the same three (host, port and TLS). Raises :class:`ConnectError`
    for a URL that is not http(s) with a host, ``ValueError`` for a port out of range or not a
    number."""
    return _origin(urlsplit(url), url)


def _origin(parts: SplitResult, url: str) -> Origin:
    scheme, host, port = split_origin(parts)
    if scheme not in ("http", "https") or not host:
        raise ConnectError(f"ConnectError: not an http(s) URL: {url!r}")
    if port is None:
        raise ValueError(f"the port of {url!r} is not a number from 0 to 65535")
    return scheme, host, port


def _request_bytes(method: str, target: str, host: str, content: bytes, headers: Mapping[str, str]) -> bytes:
    """The request's head and body as one ``bytes``. Raises ``ValueError`` for a header holding
    CR, LF or NUL."""
    lines = [f"{method} {target} HTTP/1.1"]
    if not any(k.lower() == "host" for k in headers):
        lines.append(f"Host: {host}")
    for k, v in headers.items():
        if k.lower() in _FRAMING:
            continue
        for c in _BAD_HEADER_CHARS:
            if c in k or c in v:
                raise ValueError(f"header {k!r} holds a CR, LF or NUL")
        lines.append(f"{k}: {v}")
    lines.append(f"Content-Length: {len(content)}\r\n\r\n")
    return "\r\n".join(lines).encode("latin-1") + content


def transfer_codings(values: list[str]) -> list[str]:
    """The list elements of ``Transfer-Encoding`` field values, in order, trimmed and lower-cased
    (RFC 9112 7: coding names are case-insensitive). Empty elements and parameters are kept: the
    transport reads a body only under ``["chunked"]``, and llhttp, which frames it, reads
    ``chunked,`` or ``chunked;x=1`` as no chunked coding at all."""
    return [c.strip().lower() for v in values for c in v.split(",")]


def _host(parts: Any) -> str:
    """The ``Host`` header of a URL (RFC 9110 7.2): the host (an IPv6 one bracketed) and a port
    other than the scheme's default; never the URL's user information."""
    host = parts.hostname
    if ":" in host:
        host = f"[{host}]"
    default_port = DEFAULT_PORTS.get(parts.scheme.lower())
    return host if parts.port in (None, default_port) else f"{host}:{parts.port}"
