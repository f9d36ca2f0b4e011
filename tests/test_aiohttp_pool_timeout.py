"""The aiohttp transport (``gateway.upstream_client: aiohttp``) tells a busy pool from an
unreachable engine, as the h1 transport does: a request that finds every one of its origin's
``max_connections`` connections busy with other requests waits ``connect_timeout`` for one, then
is a ``PoolTimeout`` (the relay counts it ``kind="pool"`` and backs nothing off), while a refused
or timed-out connect stays a ``ConnectError`` / ``ConnectTimeout`` (``kind="connect"``, back-off).
Before, aiohttp's ``connect`` timeout covered the wait for a pooled connection and the connect
together: a busy engine was a ``ConnectTimeout``, and the balancer backed it off for every tenant.
And an origin's slot is given back exactly once, however its request ends (cancelled while
waiting for a slot or for the answer, an error answer, a broken connection): never leaked, never
given twice."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest

from gateway.relay import upstream_client as uc
from gateway.relay.upstream_client import UpstreamClient
from tests.gateway_harness import Gateway, chat, closed_port_url, refused_port, settings_for, upstream, wait_for
from tests.mock_engine import MockEngine, gateway_id
from tests.test_gateway_pipeline import access  # noqa: F401  (the access fixture)
from tests.test_upstream_request_id import OTHER, _holding, _metric, _registry

pytestmark = pytest.mark.timeout(60)

HEADERS = {"content-type": "application/json", "accept-encoding": "identity", "x-request-id": "rid-1"}
OK_BODY = b'{"ok":true}'
ERROR_BODY = b'{"error":"overloaded"}'


class Engine:
    """A loopback engine whose answer is picked by the request body's ``mode``: ``ok`` (200,
    :data:`OK_BODY`), ``error`` (500, :data:`ERROR_BODY`), ``hold`` (200 headers of a chunked
    stream and its first chunk, then nothing until the client closes), ``hang`` (no answer until
    the client closes), ``drop`` (closed before the status line). ``open``: its connections open
    now; ``received``: the requests read."""

    def __init__(self) -> None:
        self.open = 0
        self.received = 0

    async def __aenter__(self) -> Engine:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}/v1/chat/completions"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.open += 1
        try:
            while await self._answer(reader, writer):
                pass
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.open -= 1
            writer.close()

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Answer one request; ``False`` when the connection is to end."""
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":", 1)[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")
        )
        mode = json.loads(await reader.readexactly(length))["mode"]
        self.received += 1
        if mode in ("ok", "error"):
            status, body = (b"200 OK", OK_BODY) if mode == "ok" else (b"500 Internal Server Error", ERROR_BODY)
            writer.write(b"HTTP/1.1 %s\r\ncontent-length: %d\r\n\r\n%s" % (status, len(body), body))
            await writer.drain()
            return True
        if mode == "hold":
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n")
            await writer.drain()
        if mode in ("hold", "hang"):
            await reader.read(1)  # b"": the client closed the connection
        return False  # drop: closed before the status line


async def until(pred: Callable[[], bool], timeout: float = 3.0) -> bool:
    """Poll ``pred()`` on the loop until true or ``timeout`` seconds; returns its last value."""
    deadline = time.monotonic() + timeout
    while not pred() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    return pred()


def client(max_connections: int = 1) -> UpstreamClient:
    return UpstreamClient(connect_timeout=0.3, read_timeout=10, max_connections=max_connections, kind="aiohttp")


async def send(c: UpstreamClient, url: str, mode: str) -> uc.UpstreamResponse:
    return await c.send("POST", url, json.dumps({"mode": mode}).encode(), HEADERS)


async def pool_timeout(c: UpstreamClient, eng: Engine) -> None:
    """A request to ``eng`` while every slot of its origin is busy: a :class:`PoolTimeout` once
    ``connect_timeout`` (0.3 s) has passed (the upper bound only a generous one)."""
    t0 = time.monotonic()
    with pytest.raises(uc.PoolTimeout) as e:
        await send(c, eng.url, "ok")
    assert 0.25 <= time.monotonic() - t0 < 5
    assert type(e.value) is uc.PoolTimeout
    assert str(e.value) == f"PoolTimeout: no free connection to 127.0.0.1:{eng.port} within 0.3s"


@contextlib.asynccontextmanager
async def held(c: UpstreamClient, eng: Engine, n: int) -> AsyncIterator[None]:
    """``n`` answers of ``eng`` begun (their first chunk read) and held open, their connections
    busy, until the block ends."""
    responses: list[uc.UpstreamResponse] = []
    try:
        for _ in range(n):
            responses.append(await send(c, eng.url, "hold"))
            async with contextlib.aclosing(responses[-1].aiter_raw()) as chunks:
                assert (responses[-1].status_code, await anext(chunks)) == (200, b"first")
        yield
    finally:
        for r in responses:
            await r.aclose()


async def probe(c: UpstreamClient, eng: Engine, max_connections: int = 1) -> None:
    """The origin's slots are exactly ``max_connections``: every connection the requests before
    left is closed; all slots held, the next request is a :class:`PoolTimeout` without a new
    connection (none was given twice); all given back, a request is answered (none leaked)."""
    assert await until(lambda: eng.open == 0)
    async with held(c, eng, max_connections):
        await pool_timeout(c, eng)
        assert eng.open == max_connections
    r = await send(c, eng.url, "ok")
    assert (r.status_code, await r.aread()) == (200, OK_BODY)
    await r.aclose()


# ---------------------------------------------------------------- the transport
@contextlib.contextmanager
def _unanswered_port() -> Iterator[int]:
    """A loopback port whose listener accepts nothing and whose accept queue is full: a further
    connect's handshake is never answered (a connect that times out, not a refused one)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        port = listener.getsockname()[1]
        fillers: list[socket.socket] = []
        try:
            for _ in range(2):  # Linux queues backlog + 1 connections, then drops handshakes
                fillers.append(socket.socket())
                fillers[-1].setblocking(False)
                fillers[-1].connect_ex(("127.0.0.1", port))
            yield port
        finally:
            for f in fillers:
                f.close()


@pytest.mark.parametrize("max_connections", [1, 2])
async def test_a_busy_pool_is_pool_timeout_a_failed_connect_still_a_connect_failure(max_connections) -> None:
    """Every slot of an engine's origin held by a streamed answer: the next request to it waits
    0.3 s and is a ``PoolTimeout`` (before: aiohttp's ``ConnectionTimeoutError``, a
    ``ConnectTimeout``), never connecting. Meanwhile a refused port is a ``ConnectError`` and a
    connect never answered a ``ConnectTimeout``, each as before (other origins: the busy one's
    slots are not theirs). Given back, the slots are all there again."""
    refused = refused_port()
    async with Engine() as eng:
        c = client(max_connections)
        try:
            async with held(c, eng, max_connections):
                await pool_timeout(c, eng)
                with pytest.raises(uc.ConnectError) as e:
                    await c.send("POST", f"http://127.0.0.1:{refused}/v1/chat/completions", b"{}", HEADERS)
                assert type(e.value) is uc.ConnectError
                assert str(e.value) == (
                    f"ClientConnectorError: Cannot connect to host 127.0.0.1:{refused} ssl:default "
                    f"[Connect call failed ('127.0.0.1', {refused})]"
                )
                with _unanswered_port() as port, pytest.raises(uc.ConnectTimeout) as t:
                    await c.send("POST", f"http://127.0.0.1:{port}/v1/chat/completions", b"{}", HEADERS)
                assert type(t.value) is uc.ConnectTimeout
                assert str(t.value) == (
                    f"ConnectionTimeoutError: Connection timeout to host http://127.0.0.1:{port}/v1/chat/completions"
                )
                assert (eng.open, eng.received) == (max_connections, max_connections)
            await probe(c, eng, max_connections)
            assert eng.received == 2 * max_connections + 1  # held twice, and the probe's answer
        finally:
            await c.aclose()


async def test_cancelled_requests_give_their_slot_back_once() -> None:
    """Five requests cancelled while waiting for the one slot, five cancelled while waiting for
    the engine's answer, one cancelled in the very turn the slot was handed to it: the slot is
    neither leaked (a request is answered after) nor given twice (held, the next is a
    ``PoolTimeout``; the engine never saw two connections at once)."""
    async with Engine() as eng:
        c = client(1)
        try:
            async with held(c, eng, 1):
                for _ in range(5):
                    queued = asyncio.ensure_future(send(c, eng.url, "ok"))
                    await asyncio.sleep(0.02)
                    queued.cancel()
                    with pytest.raises(asyncio.CancelledError):
                        await queued
            for _ in range(5):
                before = eng.received
                waiting = asyncio.ensure_future(send(c, eng.url, "hang"))
                assert await until(lambda b=before: eng.received == b + 1)
                waiting.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await waiting
            holder = await send(c, eng.url, "hold")
            queued = asyncio.ensure_future(send(c, eng.url, "ok"))
            await asyncio.sleep(0.02)
            await holder.aclose()  # hands the slot to ``queued``, which is cancelled before it runs
            queued.cancel()
            with pytest.raises(asyncio.CancelledError):
                await queued
            await probe(c, eng)
            assert eng.received == 1 + 5 + 1 + 1 + 1  # held, hung, holder, the probe's held and answered
        finally:
            await c.aclose()


async def test_error_answers_and_broken_connections_give_their_slot_back_once() -> None:
    """A 500 read whole, a 500 left unread, a connection closed before the status line
    (``RemoteProtocolError``), a response closed twice: each gives the one slot back, once."""
    async with Engine() as eng:
        c = client(1)
        try:
            r = await send(c, eng.url, "error")
            assert (r.status_code, await r.aread()) == (500, ERROR_BODY)
            await r.aclose()
            r = await send(c, eng.url, "error")
            assert r.status_code == 500
            await r.aclose()
            await r.aclose()  # a second close gives nothing back
            for _ in range(3):
                with pytest.raises(uc.RemoteProtocolError) as e:
                    await send(c, eng.url, "drop")
                assert str(e.value) == "ServerDisconnectedError: Server disconnected"
            await probe(c, eng)
            assert eng.received == 2 + 3 + 2
        finally:
            await c.aclose()


# ---------------------------------------------------------------- through the gateway
def _busy_gateway(busy: MockEngine, other: dict[str, Any] | None) -> Gateway:
    """``gateway.upstream_client: aiohttp``; upstream ``holder`` (:data:`OTHER`) and ``busy``
    (the model, first in order) on ``busy``'s one origin, then ``other`` (the model) when
    given; one connection per origin, 0.3 s to wait for it."""
    ups = [upstream("holder", busy, models=[OTHER]), upstream("busy", busy)]
    if other is not None:
        ups.append(other)
    gateway = {"max_connections": 1, "connect_timeout_seconds": 0.3, "upstream_client": "aiohttp"}
    return Gateway(settings_for(ups, gateway=gateway, models=[{"id": OTHER, "context_length": 8192}]), _registry())


def _state(g: Gateway, name: str) -> tuple[float, bool, int]:
    u = next(u for u in g.gw.upstreams.all if u.name == name)
    return u.backoff_until, u.backing_off(time.monotonic()), u.connect_failures


#: how a request ends when ``busy``'s pool stays full, by what comes after ``busy``: the status, and the error
ENDS = {
    "down": (503, "No upstream engine for this model is reachable.", "upstream_unavailable"),
    "alone": (504, "No upstream engine accepted the connection in time.", "upstream_timeout"),
}


@pytest.mark.parametrize("then", ["spare", "down", "alone"])
def test_a_busy_pool_backs_nothing_off_through_the_gateway(engines, access, then):  # noqa: F811
    """``busy``'s one connection is held by a hung request; a request for the model tries
    ``busy`` first, waits 0.3 s for a connection (``kind="pool"``, no back-off: its engine
    answers), then ``spare`` (200), or ``down``, a refused port (``kind="connect"``, backed off:
    503 ``upstream_unavailable``), or, alone, is 504 ``upstream_timeout``. Before, under aiohttp,
    ``busy`` was counted ``connect`` and backed off."""
    busy = engines()
    busy.state.mode = "hang"
    spare = engines() if then == "spare" else None
    other = None
    if spare is not None:
        other = upstream("spare", spare)
    elif then == "down":
        other = upstream("down", busy, api_url=closed_port_url() + "/v1")  # the pool read from ``busy``
    g = _busy_gateway(busy, other).start()
    try:
        with _holding(g, busy):
            with g.client() as c:
                r = c.post("/v1/chat/completions", json=chat(max_tokens=5), headers={"x-request-id": "second"})
        assert wait_for(lambda: len(access("second")) == 1, 3)
        states = {u.name: _state(g, u.name) for u in g.gw.upstreams.all}
        errors = _metric(g, "kvgate_upstream_errors_total{")
    finally:
        g.stop()
    assert states["busy"] == (0.0, False, 0)
    assert [r["body"]["model"] for r in busy.state.requests] == [OTHER]  # only the holder reached it
    line = access("second")[0]
    if then == "down":
        assert states["down"][1:] == (True, 1) and states["down"][0] > 0
        assert errors == [
            'kvgate_upstream_errors_total{kind="pool",upstream="busy"} 1.0',
            'kvgate_upstream_errors_total{kind="connect",upstream="down"} 1.0',
        ]
    else:
        assert errors == ['kvgate_upstream_errors_total{kind="pool",upstream="busy"} 1.0']
    if spare is not None:
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "Hello from the mock."
        assert spare.state.request_ids() == [gateway_id(line["upstream_request_id"], "second")]
        assert (line["status"], line["upstream"]) == (200, "spare")
        return
    status, message, code = ENDS[then]
    assert r.status_code == status
    assert r.json() == {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
    assert (line["status"], line["upstream"], line["upstream_request_id"]) == (status, None, None)


async def test_a_wake_skips_waiters_that_left_and_only_the_slots_count_one_given_back_to_none() -> None:
    """``wake_first`` (one loop for the aiohttp transport's slots, the h1 transport's pools and a
    tenant's share): waiters cancelled or already woken are dropped, the first still waiting gets
    the result. Given back with none waiting, the aiohttp slot is counted free; the h1 pool's
    wake-up (a hint to look again: its idle list and open count are the state) counts nothing."""
    from collections import deque

    from gateway.relay.aiohttp_transport import _Slots
    from gateway.relay.h1_transport import _OriginPool
    from gateway.relay.upstream_base import wake_first

    loop = asyncio.get_running_loop()
    left, woken, first, second = (loop.create_future() for _ in range(4))
    left.cancel()
    woken.set_result("elsewhere")  # a waiter queued in two places, woken by the other
    waiters: deque[asyncio.Future[str]] = deque([left, woken, first, second])
    assert wake_first(waiters, "given") is True
    assert (first.result(), list(waiters), second.done()) == ("given", [second], False)
    second.cancel()
    assert (wake_first(waiters, "given"), list(waiters)) == (False, [])

    slots = _Slots(("http", "h", 80), 1)
    slots.free = 0
    gone, waiting = loop.create_future(), loop.create_future()
    gone.cancel()
    slots.waiters.extend([gone, waiting])
    slots.release()
    assert (waiting.done(), slots.free, list(slots.waiters)) == (True, 0, [])
    slots.release()
    assert slots.free == 1

    pool = _OriginPool()
    gone, waiting = loop.create_future(), loop.create_future()
    gone.cancel()
    pool.waiters.extend([gone, waiting])
    pool.wake_one()
    assert (waiting.done(), pool.open, list(pool.waiters)) == (True, 0, [])
    pool.wake_one()
    assert (pool.open, pool.idle, list(pool.waiters)) == (0, [], [])
