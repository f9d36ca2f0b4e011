"""The gateway's HTTP client to the engines (step 7, "Forward"): aiohttp's ``ClientSession`` behind
the small part of httpx's API that :mod:`gateway.relay.proxy` uses (``send``, ``aread``,
``aiter_raw``, ``aclose``), raising its own small exception tree whatever the transport.

Why aiohttp: ``bench/gateway.py --transports`` sends the same POST to a mock engine from one event
loop with each client. On the 2-core dev VM (other work running) httpx's ``AsyncClient`` answered
about 170 requests/s with 64 in flight (p99 1.6 s: its connection pool's cost grows with the
requests in flight), httpx over aiohttp (``httpx-aiohttp``) about 850, and aiohttp itself about
2,270 (p99 78 ms): the httpx layer above the transport costs more than the transport. So the
forward path uses aiohttp directly; httpx stays for the pool watcher's slow polls.

:class:`UpstreamClient` ``send(method, url, content, headers, on_sent=None) -> UpstreamResponse``
hands the request to its transport: :class:`AiohttpTransport` (the default), or a
:class:`MockTransport` whose handler plays the engine in the same process (tests and benches
relay without a socket, as httpx's ``MockTransport``).

- ``on_sent()`` is called once the request's headers are written to an engine's connection
  (:class:`_Request`), never when connecting fails: from then on
  the engine may be working on the request, so the quota settle charges its prompt
  (:mod:`gateway.relay.finish`);
- one pooled session (``max_connections`` connections, kept alive :data:`KEEPALIVE_SECONDS`,
  shorter than the 5 s idle timeout engines served by uvicorn use, so the gateway closes an idle
  connection before the engine does);
- timeouts: ``connect_timeout`` for the TCP connect and the wait for a pooled connection, and
  ``read_timeout`` between two reads of the response (headers or body), as httpx's ``read``;
- bodies are raw: no decompression (the proxy asks for ``identity``) and chunked framing removed,
  as httpx's ``aiter_raw``; no header is added but ``Host``, ``Content-Length`` (and aiohttp's
  ``Accept``); no ``User-Agent``.

Exceptions (:func:`as_upstream_error` maps aiohttp's; a class's name is part of the 502 message
the client gets, so the leaves keep httpx's names)::

    UpstreamError                 an exchange with an engine failed
    ├── ConnectFailed             nothing reached the engine: the proxy may try the next upstream
    │   ├── ConnectError          connection refused, host unresolvable
    │   └── ConnectTimeout        no connection in time (TCP connect, or a pooled one)
    ├── ReadTimeout               no byte within ``read_timeout`` (headers or body)
    └── TransportError            the connection failed otherwise
        ├── RemoteProtocolError   the engine closed or broke the connection before or inside the response
        ├── WriteError            reset while sending the request
        └── ReadError             reset while reading the response
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp
from multidict import CIMultiDict, CIMultiDictProxy

#: an idle pooled connection is closed after this many seconds
KEEPALIVE_SECONDS = 4.0


class UpstreamError(Exception):
    """An exchange with an engine failed (the tree in the module docstring)."""


class ConnectFailed(UpstreamError):
    """Nothing reached the engine (``on_sent`` was not called)."""


class ConnectError(ConnectFailed):
    """The connection was refused, or the host did not resolve."""


class ConnectTimeout(ConnectFailed):
    """No connection within ``connect_timeout`` (connecting, or waiting for a pooled one)."""


class ReadTimeout(UpstreamError):
    """No byte of the response within ``read_timeout``."""


class TransportError(UpstreamError):
    """The connection failed in another way."""


class RemoteProtocolError(TransportError):
    """The engine closed or broke the connection before or inside its response."""


class WriteError(TransportError):
    """The connection was reset while the request was sent."""


class ReadError(TransportError):
    """The connection was reset while the response was read."""


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


class UpstreamResponse(Protocol):
    """A response whose body is still to be read: ``status_code``, ``headers`` (case-insensitive
    mapping), :meth:`aread`, :meth:`aiter_raw`, :meth:`aclose` (httpx's names). Reading raises
    :class:`UpstreamError`."""

    status_code: int
    headers: Mapping[str, str]

    async def aread(self) -> bytes:
        """The whole body (bytes)."""
        ...

    def aiter_raw(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive (transfer framing removed, content left encoded)."""
        ...

    async def aclose(self) -> None:
        """Done with the response (an unread body closes its connection)."""
        ...


class Transport(Protocol):
    """Where :class:`UpstreamClient` sends: :meth:`send` (as :meth:`UpstreamClient.send`) and :meth:`aclose`."""

    async def send(
        self, method: str, url: str, content: bytes, headers: Mapping[str, str], on_sent: Callable[[], None] | None
    ) -> UpstreamResponse: ...

    async def aclose(self) -> None: ...


class AiohttpResponse:
    """An aiohttp response as an :class:`UpstreamResponse` (errors mapped, see the module)."""

    __slots__ = ("_resp", "headers", "status_code")

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self._resp = resp
        self.status_code: int = resp.status
        self.headers: Mapping[str, str] = resp.headers

    async def aread(self) -> bytes:
        """The whole body (bytes)."""
        try:
            return await self._resp.read()
        except Exception as e:
            mapped = as_upstream_error(e, connecting=False)
            if mapped is None:
                raise
            raise mapped from e

    async def aiter_raw(self) -> AsyncIterator[bytes]:
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


#: the ``on_sent`` of the request being sent in this task (set by :meth:`AiohttpTransport.send`)
_ON_SENT: ContextVar[Callable[[], None] | None] = ContextVar("kvgate_upstream_on_sent", default=None)


class _Request(aiohttp.ClientRequest):
    """aiohttp's request (its documented ``request_class`` hook) that calls the sending task's
    ``on_sent`` once :meth:`send` has written the request's headers to the connection. (aiohttp's
    ``on_request_headers_sent`` trace signal says the same, but a trace config makes aiohttp build
    and send every other signal of every request too: 13-23% more CPU per forward in an ad-hoc
    run against bench/mock_engine.py, where this hook measured the same as none.)"""

    async def send(self, conn: Any) -> aiohttp.ClientResponse:
        resp = await super().send(conn)
        on_sent = _ON_SENT.get()
        if on_sent is not None:
            on_sent()
        return resp


class AiohttpTransport:
    """One pooled aiohttp session (module docstring). ``connect_timeout``/``read_timeout`` in
    seconds, ``max_connections`` >= 1. The session opens at the first send, inside the event loop
    it will run on; :meth:`aclose` at shutdown."""

    def __init__(self, *, connect_timeout: float, read_timeout: float, max_connections: int) -> None:
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None

    def _open(self) -> aiohttp.ClientSession:
        connector = aiohttp.TCPConnector(
            limit=self.max_connections,
            limit_per_host=0,
            keepalive_timeout=KEEPALIVE_SECONDS,
            ttl_dns_cache=10,
            enable_cleanup_closed=False,
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=None, connect=self.connect_timeout, sock_read=self.read_timeout),
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
        token = _ON_SENT.set(on_sent)
        try:
            resp = await session.request(method, url, data=content, headers=headers, allow_redirects=False)
        except Exception as e:
            mapped = as_upstream_error(e, connecting=True)
            if mapped is None:
                raise
            raise mapped from e
        finally:
            _ON_SENT.reset(token)
        return AiohttpResponse(resp)

    async def aclose(self) -> None:
        """Close the pooled connections."""
        session, self._session = self._session, None
        if session is not None:
            await session.close()


@dataclass(frozen=True)
class MockRequest:
    """What a :class:`MockTransport` handler is given: the request as the client would send it."""

    method: str
    url: str
    content: bytes
    headers: Mapping[str, str]


@dataclass
class MockResponse:
    """An engine's answer played by a :class:`MockTransport` handler: ``status_code``,
    ``headers``, and the body as ``chunks``, one read each; an :class:`UpstreamError` among them
    is raised at that read (a stream cut mid-way). :meth:`aread` joins the chunks."""

    status_code: int = 200
    headers: Mapping[str, str] = field(default_factory=dict)
    chunks: Iterable[bytes | UpstreamError] = ()
    closed: bool = False

    def __post_init__(self) -> None:
        self.headers = CIMultiDictProxy(CIMultiDict(self.headers))

    async def aread(self) -> bytes:
        """The whole body."""
        return b"".join([c async for c in self.aiter_raw()])

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        """The chunks, one read each (raising the error chunks)."""
        for c in self.chunks:
            if isinstance(c, UpstreamError):
                raise c
            yield c

    async def aclose(self) -> None:
        self.closed = True


#: a :class:`MockTransport` handler: the answer to one request, or an :class:`UpstreamError` to raise
MockHandler = Callable[[MockRequest], "MockResponse | UpstreamError | Awaitable[MockResponse | UpstreamError]"]


class MockTransport:
    """A transport whose ``handler`` plays the engine in-process (httpx's ``MockTransport``): it
    is given each :class:`MockRequest` and returns a :class:`MockResponse` (or an awaitable of
    one), or an :class:`UpstreamError` to raise from ``send``. ``on_sent`` is called before the
    handler runs unless the error is a :class:`ConnectFailed`. ``requests``: every request, in order."""

    def __init__(self, handler: MockHandler) -> None:
        self.handler = handler
        self.requests: list[MockRequest] = []

    async def send(
        self, method: str, url: str, content: bytes, headers: Mapping[str, str], on_sent: Callable[[], None] | None
    ) -> UpstreamResponse:
        request = MockRequest(method, url, content, dict(headers))
        self.requests.append(request)
        answer = self.handler(request)
        if not isinstance(answer, (MockResponse, UpstreamError)):
            answer = await answer
        if on_sent is not None and not isinstance(answer, ConnectFailed):
            on_sent()
        if isinstance(answer, UpstreamError):
            raise answer
        return answer

    async def aclose(self) -> None:
        return None


class UpstreamClient:
    """The forward path's client: :meth:`send` through ``transport``, or else an
    :class:`AiohttpTransport` built from ``connect_timeout``/``read_timeout`` (seconds) and
    ``max_connections`` (all three then required). Create and use it inside the event loop it will
    run on; :meth:`aclose` at shutdown."""

    def __init__(
        self,
        *,
        connect_timeout: float | None = None,
        read_timeout: float | None = None,
        max_connections: int | None = None,
        transport: Transport | None = None,
    ) -> None:
        if transport is None:
            if connect_timeout is None or read_timeout is None or max_connections is None:
                raise TypeError(
                    "UpstreamClient needs a transport, or connect_timeout, read_timeout and max_connections"
                )
            transport = AiohttpTransport(
                connect_timeout=connect_timeout, read_timeout=read_timeout, max_connections=max_connections
            )
        self.transport: Transport = transport

    async def send(
        self,
        method: str,
        url: str,
        content: bytes,
        headers: Mapping[str, str],
        on_sent: Callable[[], None] | None = None,
    ) -> UpstreamResponse:
        """Send the request and return once the response's headers are in (the body is read from
        the returned :class:`UpstreamResponse`). ``on_sent`` is called once the request's headers
        have been written to a connection to the engine (so the engine may be working on it,
        whatever happens next); never when connecting failed. Raises :class:`UpstreamError`."""
        return await self.transport.send(method, url, content, headers, on_sent)

    async def aclose(self) -> None:
        """Close the transport's connections."""
        await self.transport.aclose()
