"""The h1 transport bounds the wait for a free slot of an origin's pool and the connect that may
follow it apart, each by ``connect_timeout``: a request that waited for a slot freed by a closed
connection, so needing a new one, still has a full ``connect_timeout`` to connect. Before, one
deadline, ``connect_timeout`` from the request's start, bounded both: a request that had waited
most of it for the slot got a sliver of time to connect, and a busy engine slow to accept was a
``ConnectTimeout`` (a connect failure, which backs its upstream off for every tenant). A wait that
finds no slot within ``connect_timeout`` is still a ``PoolTimeout``, a connect that does not end
within its own ``connect_timeout`` a ``ConnectTimeout``.

The engine listens with an accept queue of one (``listen(0)``): while it accepts nothing, a
connection waits in the queue and the kernel drops the next connect's SYN (Linux), which the
client sends again 1 s later: a connect that hangs until then, and succeeds then when the engine
has emptied its queue meanwhile."""

from __future__ import annotations

import asyncio
import contextlib
import json
import select
import socket
from collections.abc import AsyncIterator, Iterator

import pytest

from gateway.relay import upstream_client as uc
from gateway.relay.h1_transport import H1Response, H1Transport
from tests.test_aiohttp_pool_timeout import HEADERS, OK_BODY, Engine

pytestmark = pytest.mark.timeout(60)

#: each bound's length (s): a connect whose first SYN is dropped ends 1 s later, within it
CONNECT_TIMEOUT = 1.5


class GatedEngine(Engine):
    """:class:`tests.test_aiohttp_pool_timeout.Engine` (its answers by ``mode``) on a listener
    whose accept queue holds one connection, accepting while :meth:`start` has it accept (from
    the start) until :meth:`stop`; :meth:`cut` closes an accepted connection."""

    async def __aenter__(self) -> GatedEngine:
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(0)
        self.listener.setblocking(False)
        self.port = self.listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}/v1/chat/completions"
        self.writers: list[asyncio.StreamWriter] = []
        self.tasks: set[asyncio.Task[None]] = set()
        self._accepting: asyncio.Task[None] | None = None
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
        for w in self.writers:
            w.close()
        for t in list(self.tasks):
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.listener.close()

    def start(self) -> None:
        self._accepting = asyncio.ensure_future(self._accept())

    async def stop(self) -> None:
        if self._accepting is not None:
            self._accepting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._accepting
            self._accepting = None

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            sock, _ = await loop.sock_accept(self.listener)
            reader, writer = await asyncio.open_connection(sock=sock)
            self.writers.append(writer)
            task = asyncio.ensure_future(self._serve(reader, writer))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    def cut(self, i: int) -> None:
        """Close the ``i``-th accepted connection (the engine's side)."""
        self.writers[i].close()


@contextlib.contextmanager
def full_accept_queue(port: int) -> Iterator[list[socket.socket]]:
    """Two connects to ``port``, whose engine accepts nothing: the first waits in its accept queue
    of one, the second's SYN is dropped (the queue is full: every further connect hangs)."""
    fillers: list[socket.socket] = []
    try:
        for _ in range(2):
            fillers.append(socket.socket())
            fillers[-1].setblocking(False)
            fillers[-1].connect_ex(("127.0.0.1", port))
        yield fillers
    finally:
        for f in fillers:
            f.close()


def connected(s: socket.socket) -> bool:
    """``s``'s non-blocking connect has ended (it is writable)."""
    return bool(select.select([], [s], [], 0)[1])


def transport(connect_timeout: float = CONNECT_TIMEOUT) -> H1Transport:
    return H1Transport(connect_timeout=connect_timeout, read_timeout=10, max_connections=1)


async def send(c: H1Transport, eng: Engine, mode: str) -> H1Response:
    return await c.send("POST", eng.url, json.dumps({"mode": mode}).encode(), HEADERS, None)


@contextlib.asynccontextmanager
async def holding(c: H1Transport, eng: Engine) -> AsyncIterator[AsyncIterator[bytes]]:
    """A streamed answer begun (its first chunk read), holding the transport's one connection to
    ``eng``; its body's iterator, for the rest."""
    r = await send(c, eng, "hold")
    try:
        async with contextlib.aclosing(r.aiter_raw()) as chunks:
            assert (r.status_code, await anext(chunks)) == (200, b"first")
            yield chunks
    finally:
        await r.aclose()


async def at(t0: float, t: float) -> None:
    """Sleep until ``t`` seconds after the loop time ``t0``."""
    await asyncio.sleep(max(0.0, t0 + t - asyncio.get_running_loop().time()))


async def cut_while_waiting(
    c: H1Transport, eng: GatedEngine, resume_at: float | None
) -> tuple[float, asyncio.Task[H1Response]]:
    """A holds the one connection; the engine stops accepting, its accept queue full; B is sent
    (loop time ``t0``, returned) and waits for the slot; at 1.0 s the engine closes A's
    connection (A's body: a ``RemoteProtocolError``), B's connect starts and hangs; at
    ``resume_at`` s (``None``: never) the engine accepts again. Returns ``t0`` and B's task."""
    loop = asyncio.get_running_loop()
    async with holding(c, eng) as a_body:
        await eng.stop()
        with full_accept_queue(eng.port) as fillers:
            await asyncio.sleep(0.1)
            assert [connected(f) for f in fillers] == [True, False]  # one queued, the next one's SYN dropped
            t0 = loop.time()
            b = asyncio.create_task(send(c, eng, "ok"))
            await at(t0, 1.0)
            assert not b.done()  # waiting for the slot
            eng.cut(0)
            with pytest.raises(uc.RemoteProtocolError) as e:
                await anext(a_body)
            assert type(e.value) is uc.RemoteProtocolError
            assert str(e.value) == "RemoteProtocolError: the engine closed the connection inside its response"
            if resume_at is not None:
                await at(t0, resume_at)
                assert not b.done()  # connecting: the engine accepted nothing yet
                eng.start()  # takes the queued filler's connection: room for B's SYN when sent again
            await asyncio.wait([b])
    return t0, b


async def test_a_connect_after_a_wait_for_the_slot_has_a_full_connect_timeout() -> None:
    """B waits 1.0 s for A's slot, then connects; its first SYN is dropped, the engine accepts
    again at 1.4 s and B's SYN, sent again about 1 s after the first (about 2.0 s), is taken: B
    connects within its own 1.5 s and gets its answer. Before, B's one deadline (1.5 s from its
    start) ended its connect at 1.5 s: a ``ConnectTimeout``, though the engine was only busy."""
    async with GatedEngine() as eng:
        c = transport()
        try:
            t0, b = await cut_while_waiting(c, eng, resume_at=1.4)
            r = b.result()
            try:
                assert (r.status_code, await r.aread()) == (200, OK_BODY)
            finally:
                await r.aclose()
            assert 1.4 <= asyncio.get_running_loop().time() - t0 < 10
            assert eng.received == 2  # A's request, B's
        finally:
            await c.aclose()


async def test_a_connect_after_a_wait_for_the_slot_that_never_ends_is_connect_timeout() -> None:
    """As above, the engine never accepting again: B's connect, started at 1.0 s, is a
    ``ConnectTimeout`` a full 1.5 s later (about 2.5 s), not at 1.5 s, 0.5 s into it."""
    async with GatedEngine() as eng:
        c = transport()
        try:
            t0, b = await cut_while_waiting(c, eng, resume_at=None)
            with pytest.raises(uc.ConnectTimeout) as e:
                b.result()
            elapsed = asyncio.get_running_loop().time() - t0
            assert type(e.value) is uc.ConnectTimeout
            assert str(e.value) == f"ConnectTimeout: no connection to 127.0.0.1:{eng.port} within 1.5s"
            assert 2.45 <= elapsed < 10
            assert eng.received == 1  # A's request only
        finally:
            await c.aclose()


async def test_a_wait_for_a_slot_past_the_connect_timeout_is_still_pool_timeout() -> None:
    """The one connection held by A for good: B waits 0.3 s for the slot and is a ``PoolTimeout``
    with its message, never connecting; the slot given back, the next request is answered."""
    async with GatedEngine() as eng:
        c = transport(connect_timeout=0.3)
        try:
            async with holding(c, eng):
                loop = asyncio.get_running_loop()
                t0 = loop.time()
                with pytest.raises(uc.PoolTimeout) as e:
                    await send(c, eng, "ok")
                elapsed = loop.time() - t0
                assert type(e.value) is uc.PoolTimeout
                assert str(e.value) == f"PoolTimeout: no free connection to 127.0.0.1:{eng.port} within 0.3s"
                assert 0.29 <= elapsed < 5
                assert (eng.open, eng.received) == (1, 1)
            r = await send(c, eng, "ok")
            try:
                assert (r.status_code, await r.aread()) == (200, OK_BODY)
            finally:
                await r.aclose()
            assert eng.received == 2
        finally:
            await c.aclose()
