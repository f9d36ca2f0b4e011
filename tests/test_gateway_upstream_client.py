"""The forward path's client (gateway/relay/upstream_client.py) against raw asyncio servers on loopback
that misbehave on purpose: every aiohttp failure must reach the proxy as the client's own exception
(gateway.relay.upstream_client's tree), bodies must come back byte for byte, and an abandoned response must close its
connection (so the engine sees the request cancelled)."""

from __future__ import annotations

import asyncio
import socket

import aiohttp
import pytest

from gateway.relay import upstream_client as uc
from gateway.relay.aiohttp_transport import as_upstream_error
from gateway.relay.upstream_client import UpstreamClient

pytestmark = pytest.mark.timeout(30)


class Server:
    """A loopback TCP server whose ``handler(reader, writer)`` plays the engine."""

    def __init__(self, handler) -> None:
        self.handler = handler
        self.requests: list[bytes] = []
        self.closed = asyncio.Event()
        self.server: asyncio.AbstractServer | None = None

    async def __aenter__(self) -> Server:
        async def on_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                await self.handler(self, reader, writer)
            finally:
                writer.close()

        self.server = await asyncio.start_server(on_conn, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/v1/chat/completions"
        return self

    async def __aexit__(self, *exc) -> None:
        assert self.server is not None
        self.server.close()

    async def read_request(self, reader: asyncio.StreamReader) -> bytes:
        head = await reader.readuntil(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":", 1)[1])
        body = await reader.readexactly(length)
        self.requests.append(head + body)
        return head + body


def client(**kw) -> UpstreamClient:
    return UpstreamClient(
        connect_timeout=kw.get("connect_timeout", 1.0),
        read_timeout=kw.get("read_timeout", 1.0),
        max_connections=kw.get("max_connections", 8),
    )


HEADERS = {"content-type": "application/json", "accept-encoding": "identity", "x-request-id": "rid-1"}


async def test_a_chunked_stream_comes_back_byte_for_byte_and_the_request_as_sent() -> None:
    events = [b'data: {"a":"\xe2\x80\xa8"}\n\n', b'data: {"b":"\xc3', b'\xa9"}\n\n', b"data: [DONE]\n\n"]

    async def engine(srv, reader, writer):
        await srv.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        for ev in events:
            writer.write(b"%x\r\n%s\r\n" % (len(ev), ev))
            await writer.drain()
            await asyncio.sleep(0.02)
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    async with Server(engine) as srv:
        c = client()
        r = await c.send("POST", srv.url, b'{"x":1}', HEADERS)
        assert (r.status_code, r.headers["Content-Type"]) == (200, "text/event-stream")
        got = b"".join([chunk async for chunk in r.aiter_raw()])
        await r.aclose()
        await c.aclose()
    assert got == b"".join(events)
    head, body = srv.requests[0].split(b"\r\n\r\n", 1)
    lines = head.split(b"\r\n")
    assert lines[0] == b"POST /v1/chat/completions HTTP/1.1"
    names = sorted(ln.split(b":", 1)[0].lower() for ln in lines[1:])
    assert names == [b"accept", b"accept-encoding", b"content-length", b"content-type", b"host", b"x-request-id"]
    assert b"accept-encoding: identity" in head.lower() and body == b'{"x":1}'


async def test_a_gzip_body_is_passed_raw_not_decompressed() -> None:
    import gzip

    raw = gzip.compress(b'{"ok":true}')

    async def engine(srv, reader, writer):
        await srv.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-encoding: gzip\r\ncontent-length: %d\r\n\r\n%s" % (len(raw), raw))
        await writer.drain()

    async with Server(engine) as srv:
        c = client()
        r = await c.send("POST", srv.url, b"{}", HEADERS)
        assert await r.aread() == raw
        await r.aclose()
        await c.aclose()


async def test_connection_refused_is_connect_error() -> None:
    from tests.gateway_harness import refused_port

    url = f"http://127.0.0.1:{refused_port()}/v1/chat/completions"
    c = client()
    with pytest.raises(uc.ConnectError):
        await c.send("POST", url, b"{}", HEADERS)
    await c.aclose()


async def test_no_answer_within_the_read_timeout_is_read_timeout() -> None:
    async def engine(srv, reader, writer):
        await srv.read_request(reader)
        await asyncio.sleep(5)

    async with Server(engine) as srv:
        c = client(read_timeout=0.3)
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(uc.ReadTimeout):
            await c.send("POST", srv.url, b"{}", HEADERS)
        assert asyncio.get_running_loop().time() - t0 < 1.5
        await c.aclose()


async def test_a_stalled_body_is_read_timeout_and_a_cut_body_a_protocol_error() -> None:
    async def engine(srv, reader, writer):
        await srv.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n0123456789")
        await writer.drain()
        if len(srv.requests) == 1:
            await asyncio.sleep(5)  # stall

    async with Server(engine) as srv:
        c = client(read_timeout=0.3)
        r = await c.send("POST", srv.url, b"{}", HEADERS)
        with pytest.raises(uc.ReadTimeout):
            await r.aread()
        await r.aclose()
        r = await c.send("POST", srv.url, b"{}", HEADERS)  # second: cut after 10 of 100 bytes
        with pytest.raises(uc.RemoteProtocolError):
            async for _ in r.aiter_raw():
                pass
        await r.aclose()
        await c.aclose()


async def test_closed_before_the_status_line_is_remote_protocol_error() -> None:
    async def engine(srv, reader, writer):
        await srv.read_request(reader)

    async with Server(engine) as srv:
        c = client()
        with pytest.raises(uc.RemoteProtocolError):
            await c.send("POST", srv.url, b"{}", HEADERS)
        await c.aclose()


async def test_a_full_pool_is_connect_timeout_after_the_connect_timeout() -> None:
    async def engine(srv, reader, writer):
        await srv.read_request(reader)
        await asyncio.sleep(5)

    async with Server(engine) as srv:
        c = client(max_connections=1, connect_timeout=0.3, read_timeout=10)
        first = asyncio.ensure_future(c.send("POST", srv.url, b"{}", HEADERS))
        await asyncio.sleep(0.1)
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(uc.ConnectTimeout):
            await c.send("POST", srv.url, b"{}", HEADERS)
        assert 0.25 < asyncio.get_running_loop().time() - t0 < 1.5
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        await c.aclose()


async def test_on_sent_fires_once_the_request_is_written_never_for_a_failed_connect() -> None:
    """The quota settle charges a request once ``on_sent`` fired: it must fire for a request the
    engine received, even when the engine then never answers (read timeout), or when the sender
    is cancelled while waiting for the answer; and never for a refused connection or a request
    still waiting for a pooled connection."""

    async def engine(srv, reader, writer):
        await srv.read_request(reader)
        await asyncio.sleep(5)

    sent: list[str] = []
    # bound and never listening, and held for the whole test: every connect is refused, and no
    # other process can take the port in between (a closed port was once taken, and answered nothing)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        refused = f"http://127.0.0.1:{s.getsockname()[1]}/v1/chat/completions"
        async with Server(engine) as srv:
            c = client(max_connections=1, connect_timeout=0.3, read_timeout=0.5)
            with pytest.raises(uc.ConnectError):
                await c.send("POST", refused, b"{}", HEADERS, lambda: sent.append("refused"))
            with pytest.raises(uc.ReadTimeout):
                await c.send("POST", srv.url, b'{"n":1}', HEADERS, lambda: sent.append("timed out"))
            first = asyncio.ensure_future(c.send("POST", srv.url, b'{"n":2}', HEADERS, lambda: sent.append("held")))
            await asyncio.sleep(0.1)
            queued = asyncio.ensure_future(c.send("POST", srv.url, b'{"n":3}', HEADERS, lambda: sent.append("queued")))
            await asyncio.sleep(0.1)  # waiting for the one pooled connection
            for t in (queued, first):
                t.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await t
            await c.aclose()
    assert sent == ["timed out", "held"]
    assert [r.rsplit(b"\r\n\r\n", 1)[1] for r in srv.requests] == [b'{"n":1}', b'{"n":2}']


async def test_an_abandoned_response_closes_its_connection_a_read_one_is_reused() -> None:
    peers: list[str] = []

    async def engine(srv, reader, writer):
        peers.append(writer.get_extra_info("peername"))
        while True:
            try:
                await srv.read_request(reader)
            except (asyncio.IncompleteReadError, ConnectionError):
                srv.closed.set()
                return
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            writer.write(b"5\r\nhello\r\n")
            await writer.drain()
            if len(srv.requests) == 3:  # the third stream never ends: the client gives up on it
                if await asyncio.wait_for(reader.read(1), 5) == b"":
                    srv.closed.set()
                return
            writer.write(b"0\r\n\r\n")
            await writer.drain()

    async with Server(engine) as srv:
        c = client()
        for _ in range(2):  # read whole: the one connection goes back to the pool
            r = await c.send("POST", srv.url, b"{}", HEADERS)
            assert [x async for x in r.aiter_raw()] == [b"hello"]
            await r.aclose()
        assert len(peers) == 1
        r = await c.send("POST", srv.url, b"{}", HEADERS)
        it = r.aiter_raw()
        assert await it.__anext__() == b"hello"
        await r.aclose()  # abandoned mid-body: the engine sees the connection closed
        await asyncio.wait_for(srv.closed.wait(), 2)
        await c.aclose()


def test_every_aiohttp_failure_maps_to_an_upstream_error_others_pass() -> None:
    key = aiohttp.client_reqrep.ConnectionKey("h", 1, False, True, None, None, None)
    cases = [
        (aiohttp.ConnectionTimeoutError(), True, uc.ConnectTimeout),
        (aiohttp.ClientConnectorError(key, OSError(111, "refused")), True, uc.ConnectError),
        (aiohttp.SocketTimeoutError(), False, uc.ReadTimeout),
        (TimeoutError(), False, uc.ReadTimeout),
        (aiohttp.ServerDisconnectedError(), True, uc.RemoteProtocolError),
        (aiohttp.ClientPayloadError("cut"), False, uc.RemoteProtocolError),
        (aiohttp.ClientOSError(104, "reset"), True, uc.WriteError),
        (aiohttp.ClientOSError(104, "reset"), False, uc.ReadError),
        (ConnectionResetError(), False, uc.ReadError),
        (aiohttp.InvalidURL("x"), True, uc.TransportError),
    ]
    for exc, connecting, want in cases:
        got = as_upstream_error(exc, connecting=connecting)
        assert type(got) is want, (exc, got)
        assert isinstance(got, uc.UpstreamError)
    assert as_upstream_error(ValueError("not ours"), connecting=True) is None
    assert as_upstream_error(asyncio.CancelledError(), connecting=True) is None
