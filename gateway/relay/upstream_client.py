"""The gateway's HTTP client to the engines (step 7, "Forward"): the small part of httpx's API that
:mod:`gateway.relay.proxy` uses (``send``, ``aread``, ``aiter_raw``, ``aclose``) over a
transport, raising its own small exception tree (:mod:`gateway.relay.upstream_base`) whatever the
transport.

Transports (``gateway.upstream_client``): ``h1`` (the default, :mod:`gateway.relay.h1_transport`:
asyncio protocols and httptools' parser) or ``aiohttp`` (:mod:`gateway.relay.aiohttp_transport`:
aiohttp's ``ClientSession``), plus :class:`MockTransport`, whose handler plays the engine in the
same process (tests and benches relay without a socket, as httpx's ``MockTransport``). Why not
httpx, and why ``h1`` over aiohttp: docs/gateway.md, "The upstream client". Both transports pass
the same tests (tests/test_gateway_upstream_client.py).

What every transport does:

- ``on_sent()`` is called once the request's headers are written to an engine's connection,
  never when connecting fails: from then on the engine may be working on the request, so the
  quota settle charges its prompt (:mod:`gateway.relay.finish`);
- a pool of ``max_connections`` connections per upstream origin (scheme, host, port), an idle
  one kept :data:`~gateway.relay.upstream_base.KEEPALIVE_SECONDS`: an engine that holds all of
  its connections (hung, or slow) never makes a request to another engine wait;
- timeouts: ``connect_timeout`` for the TCP (and TLS) connect and the wait for a pooled
  connection (a send's ``pool_timeout`` may bound that wait shorter), ``read_timeout`` between
  two reads of the response (headers or body), as httpx's ``read``, and ``exchange_timeout``
  (``None``: none) for the whole exchange, from the send to the response's last byte, a
  :class:`ReadTimeout` too;
- bodies are raw: no decompression (the proxy asks for ``identity``) and chunked framing
  removed, as httpx's ``aiter_raw``; no ``User-Agent``.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from multidict import CIMultiDict, CIMultiDictProxy

from gateway.relay.h1_transport import H1Transport
from gateway.relay.upstream_base import (
    KEEPALIVE_SECONDS,
    ConnectError,
    ConnectFailed,
    ConnectTimeout,
    PoolTimeout,
    ReadError,
    ReadTimeout,
    RemoteProtocolError,
    ResponseTooLarge,
    Transport,
    TransportError,
    UpstreamError,
    UpstreamResponse,
    WriteError,
    read_bounded,
)

__all__ = [
    "KEEPALIVE_SECONDS",
    "ConnectError",
    "ConnectFailed",
    "ConnectTimeout",
    "PoolTimeout",
    "MockRequest",
    "MockResponse",
    "MockTransport",
    "ReadError",
    "ReadTimeout",
    "RemoteProtocolError",
    "ResponseTooLarge",
    "Transport",
    "TransportError",
    "UpstreamClient",
    "UpstreamError",
    "UpstreamResponse",
    "WriteError",
    "transport_class",
]


def transport_class(name: str) -> Any:
    """The transport class named ``name`` (``"h1"`` or ``"aiohttp"``, ``gateway.upstream_client``).
    aiohttp is imported only when asked for. Raises ``ValueError`` for another name."""
    if name == "h1":
        return H1Transport
    if name == "aiohttp":
        from gateway.relay.aiohttp_transport import AiohttpTransport

        return AiohttpTransport
    raise ValueError(f"unknown upstream client {name!r}: 'h1' or 'aiohttp'")


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

    async def aread(self, limit: int | None = None) -> bytes:
        """The whole body (``ResponseTooLarge`` past ``limit`` bytes)."""
        return await read_bounded(self.aiter_raw(), limit)

    async def aiter_raw(self) -> AsyncGenerator[bytes, None]:
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
        self,
        method: str,
        url: str,
        content: bytes,
        headers: Mapping[str, str],
        on_sent: Callable[[], None] | None,
        pool_timeout: float | None = None,
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
    """The forward path's client: :meth:`send` through ``transport``, or else the transport named
    ``kind`` (:func:`transport_class`; default :attr:`default_kind`) built from
    ``connect_timeout``/``read_timeout`` (seconds) and ``max_connections`` (per upstream origin;
    all three then required), and ``exchange_timeout`` (seconds; ``None``: unbounded). Create and use it inside
    the event loop it will run on; :meth:`aclose` at shutdown."""

    #: the transport built when none is given and no ``kind`` is named
    default_kind = "h1"

    def __init__(
        self,
        *,
        connect_timeout: float | None = None,
        read_timeout: float | None = None,
        max_connections: int | None = None,
        exchange_timeout: float | None = None,
        transport: Transport | None = None,
        kind: str | None = None,
    ) -> None:
        if transport is None:
            if connect_timeout is None or read_timeout is None or max_connections is None:
                raise TypeError(
                    "UpstreamClient needs a transport, or connect_timeout, read_timeout and max_connections"
                )
            transport = transport_class(kind or self.default_kind)(
                connect_timeout=connect_timeout,
                read_timeout=read_timeout,
                max_connections=max_connections,
                exchange_timeout=exchange_timeout,
            )
        self.transport: Transport = transport

    async def send(
        self,
        method: str,
        url: str,
        content: bytes,
        headers: Mapping[str, str],
        on_sent: Callable[[], None] | None = None,
        pool_timeout: float | None = None,
    ) -> UpstreamResponse:
        """Send the request and return once the response's headers are in (the body is read from
        the returned :class:`UpstreamResponse`). ``on_sent`` is called once the request's headers
        have been written to a connection to the engine (so the engine may be working on it,
        whatever happens next); never when connecting failed. ``pool_timeout``: the longest wait
        for a free connection of the origin's pool, in seconds (``None``: ``connect_timeout``; the
        relay passes what is left of a request's wait for its tenant's share); a connect keeps
        its own ``connect_timeout``. Raises :class:`UpstreamError`."""
        return await self.transport.send(method, url, content, headers, on_sent, pool_timeout)

    async def aclose(self) -> None:
        """Close the transport's connections."""
        await self.transport.aclose()
