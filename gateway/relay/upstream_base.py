"""What the forward path's HTTP transports share (:mod:`gateway.relay.upstream_client` has the
whole story): the exception tree every transport raises, the response and transport protocols,
how long an idle connection is kept, and how a first-come-first-served queue of waiters is woken
(:func:`wake_first`).

Exceptions (a class's name is part of the 502 message the client gets, so the leaves keep
httpx's names)::

    UpstreamError                 an exchange with an engine failed
    ├── ConnectFailed             nothing reached the engine: the proxy may try the next upstream
    │   ├── ConnectError          connection refused, host unresolvable, TLS handshake refused
    │   └── ConnectTimeout        no connection in time (TCP connect, or a pooled one)
    │       └── PoolTimeout       every connection of the upstream's pool stayed busy
    ├── ReadTimeout               no byte within ``read_timeout`` (headers or body)
    └── TransportError            the connection failed otherwise
        ├── RemoteProtocolError   the engine closed or broke the connection before or inside the response
        ├── WriteError            reset while sending the request
        ├── ReadError             reset while reading the response
        └── ResponseTooLarge      a body read whole ran past the reader's limit
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from typing import Protocol, TypeVar

#: an idle pooled connection is closed after this many seconds (shorter than the 5 s idle timeout
#: of engines served by uvicorn, so the gateway drops an idle connection before the engine does)
KEEPALIVE_SECONDS = 4.0


_T = TypeVar("_T")


def wake_first(waiters: collections.deque[asyncio.Future[_T]], result: _T) -> bool:
    """Wake the first of ``waiters`` (futures in arrival order) that still waits: those done
    (cancelled, or already given a result: a waiter queued in several places) are dropped from
    the left, the first not done gets ``result`` and is dropped too. Whether one was woken
    (``False``: none waits, ``waiters`` is empty). What a wake means is the caller's: the h1
    transport's pool wakes a waiter to look again (nothing is handed over, nothing counted when
    none waits), the aiohttp transport's slots hand it what was given back (counted free again
    when none waits)."""
    while waiters:
        waiter = waiters.popleft()
        if not waiter.done():
            waiter.set_result(result)
            return True
    return False


class UpstreamError(Exception):
    """An exchange with an engine failed (the tree in the module docstring)."""


class ConnectFailed(UpstreamError):
    """Nothing reached the engine (``on_sent`` was not called)."""


class ConnectError(ConnectFailed):
    """The connection was refused, or the host did not resolve."""


class ConnectTimeout(ConnectFailed):
    """No connection within ``connect_timeout`` (connecting, or waiting for a pooled one)."""


class PoolTimeout(ConnectTimeout):
    """No connection of the upstream's pool came free within ``connect_timeout``: its
    ``max_connections`` are all busy with other requests (the engine is slow or at capacity, not
    unreachable). Both transports tell it apart (the aiohttp one waits for its own slots before
    aiohttp gets the request: :mod:`gateway.relay.aiohttp_transport`)."""


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


class ResponseTooLarge(TransportError):
    """A body read whole ran past the reader's ``limit`` (bytes); the rest is left unread."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"ResponseTooLarge: a response body over {limit} bytes")
        self.limit = limit


def over_limit(size: int, limit: int | None) -> None:
    """Raise :class:`ResponseTooLarge` when ``size`` bytes read is past ``limit`` (``None``: no limit)."""
    if limit is not None and size > limit:
        raise ResponseTooLarge(limit)


async def read_bounded(chunks: AsyncGenerator[bytes, None], limit: int | None) -> bytes:
    """``chunks`` (a response's :meth:`UpstreamResponse.aiter_raw`) joined, reading stopped (and
    ``chunks`` closed) with :class:`ResponseTooLarge` once past ``limit`` bytes (``None``: no limit)."""
    parts: list[bytes] = []
    size = 0
    async with contextlib.aclosing(chunks):
        async for chunk in chunks:
            parts.append(chunk)
            size += len(chunk)
            over_limit(size, limit)
    return b"".join(parts)


class UpstreamResponse(Protocol):
    """A response whose body is still to be read: ``status_code``, ``headers`` (case-insensitive
    mapping), :meth:`aread`, :meth:`aiter_raw`, :meth:`aclose` (httpx's names). Reading raises
    :class:`UpstreamError`."""

    status_code: int
    headers: Mapping[str, str]

    async def aread(self, limit: int | None = None) -> bytes:
        """The whole body (bytes); past ``limit`` bytes (``None``: unbounded) reading stops with
        :class:`ResponseTooLarge`."""
        ...

    def aiter_raw(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive (transfer framing removed, content left encoded)."""
        ...

    async def aclose(self) -> None:
        """Done with the response (an unread body closes its connection)."""
        ...


class PooledTransport:
    """What a network transport is built from (:func:`gateway.relay.upstream_client.transport_class`):
    at most ``max_connections`` pooled connections; ``connect_timeout`` (s) bounds a connect and
    the wait for a free connection, ``read_timeout`` (s) the wait for the next byte of a
    response, ``exchange_timeout`` (s; ``None``: unbounded) the whole exchange, from the request
    written to the response's last byte (each a :class:`ConnectTimeout` or :class:`ReadTimeout`)."""

    def __init__(
        self,
        *,
        connect_timeout: float,
        read_timeout: float,
        max_connections: int,
        exchange_timeout: float | None = None,
    ) -> None:
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.max_connections = max_connections
        self.exchange_timeout = exchange_timeout


class Transport(Protocol):
    """Where :class:`UpstreamClient` sends: :meth:`send` (as :meth:`UpstreamClient.send`) and :meth:`aclose`."""

    async def send(
        self,
        method: str,
        url: str,
        content: bytes,
        headers: Mapping[str, str],
        on_sent: Callable[[], None] | None,
        pool_timeout: float | None = None,
    ) -> UpstreamResponse: ...

    async def aclose(self) -> None: ...
