"""The gateway's HTTP client to the engines (step 7, "Forward"): aiohttp's ``ClientSession`` behind
the small part of httpx's API that :mod:`gateway.relay.proxy` uses, so the proxy keeps one vocabulary of
errors (httpx's exception classes) whatever the transport.

Why aiohttp: ``bench/gateway.py --transports`` sends the same POST to a mock engine from one event
loop with each client. On the 2-core dev VM (other work running) httpx's ``AsyncClient`` answered
about 170 requests/s with 64 in flight (p99 1.6 s: its connection pool's cost grows with the
requests in flight), httpx over aiohttp (``httpx-aiohttp``) about 850, and aiohttp itself about
2,270 (p99 78 ms): the httpx layer above the transport costs more than the transport. So the
forward path uses aiohttp directly; httpx stays for the pool watcher's slow polls.

:class:`UpstreamClient` ``send(method, url, content, headers, on_sent=None) -> UpstreamResponse``:

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
  ``Accept``); no ``User-Agent``;
- errors are raised as httpx's classes (:func:`as_httpx_error`): connection refused or unresolvable
  host ``ConnectError``; no connection in time (connect or pool) ``ConnectTimeout``; no byte within
  ``read_timeout`` ``ReadTimeout``; the engine closing or breaking the connection before or inside
  the response ``RemoteProtocolError``; a reset ``ReadError``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping
from contextvars import ContextVar
from typing import Any

import aiohttp
import httpx

#: an idle pooled connection is closed after this many seconds
KEEPALIVE_SECONDS = 4.0


def as_httpx_error(exc: BaseException, *, connecting: bool) -> httpx.HTTPError | None:
    """The httpx exception that stands for an aiohttp (or timeout) exception ``exc``, or ``None``
    when ``exc`` is not a transport error. ``connecting``: raised before the response's headers
    arrived (a reset then is a failed send; afterwards, a failed read)."""
    name = type(exc).__name__
    msg = f"{name}: {exc}" if str(exc) else name
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return httpx.ConnectTimeout(msg)
    if isinstance(exc, aiohttp.ClientConnectorError):
        return httpx.ConnectError(msg)
    if isinstance(exc, (aiohttp.ServerTimeoutError, asyncio.TimeoutError)):
        return httpx.ReadTimeout(msg)
    if isinstance(exc, (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError, aiohttp.ClientResponseError)):
        return httpx.RemoteProtocolError(msg)
    if isinstance(exc, (aiohttp.ClientOSError, aiohttp.ClientConnectionError, ConnectionError)):
        return httpx.WriteError(msg) if connecting else httpx.ReadError(msg)
    if isinstance(exc, aiohttp.ClientError):
        return httpx.TransportError(msg)
    return None


class UpstreamResponse:
    """A response whose body is still to be read: ``status_code``, ``headers`` (case-insensitive
    mapping), :meth:`aread`, :meth:`aiter_raw`, :meth:`aclose` (httpx's names). Reading raises
    httpx exceptions (see the module)."""

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
            mapped = as_httpx_error(e, connecting=False)
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
                mapped = as_httpx_error(e, connecting=False)
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


#: the ``on_sent`` of the request being sent in this task (set by :meth:`UpstreamClient.send`)
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


class UpstreamClient:
    """One pooled aiohttp session for the forward path. ``connect_timeout``/``read_timeout`` in
    seconds, ``max_connections`` >= 1. Create and use it inside the event loop it will run on;
    :meth:`aclose` at shutdown."""

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
        whatever happens next); never when connecting failed. Raises httpx exceptions (see the module)."""
        session = self._session or self._open()
        token = _ON_SENT.set(on_sent)
        try:
            resp = await session.request(method, url, data=content, headers=headers, allow_redirects=False)
        except Exception as e:
            mapped = as_httpx_error(e, connecting=True)
            if mapped is None:
                raise
            raise mapped from e
        finally:
            _ON_SENT.reset(token)
        return UpstreamResponse(resp)

    async def aclose(self) -> None:
        """Close the pooled connections."""
        session, self._session = self._session, None
        if session is not None:
            await session.close()
