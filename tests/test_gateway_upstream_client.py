"""The forward path's client (gateway/relay/upstream_client.py), each test over both transports
(the gateway's own ``h1`` and ``aiohttp``, which serves as the reference), against raw asyncio
servers on loopback that misbehave on purpose: every failure must reach the proxy as the client's
own exception (gateway.relay.upstream_base's tree), bodies must come back byte for byte, a
connection is kept only when its response allows it, and an abandoned response must close its
connection (so the engine sees the request cancelled)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

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

    async def each_request(self, reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
        """The requests of one connection, until the client closes it (then ``closed`` is set)."""
        while True:
            try:
                yield await self.read_request(reader)
            except (asyncio.IncompleteReadError, ConnectionError):
                self.closed.set()
                return


@pytest.fixture(params=["h1", "aiohttp"], autouse=True)
def transport_kind(request, monkeypatch) -> str:
    """Every test runs against both transports."""
    monkeypatch.setattr(UpstreamClient, "default_kind", request.param)
    return request.param


def client(**kw) -> UpstreamClient:
    return UpstreamClient(
        connect_timeout=kw.get("connect_timeout", 1.0),
        read_timeout=kw.get("read_timeout", 1.0),
        max_connections=kw.get("max_connections", 8),
        exchange_timeout=kw.get("exchange_timeout"),
    )


HEADERS = {"content-type": "application/json", "accept-encoding": "identity", "x-request-id": "rid-1"}


async def test_a_chunked_stream_comes_back_byte_for_byte_and_the_request_as_sent(transport_kind) -> None:
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
    added = [b"accept"] if transport_kind == "aiohttp" else []  # aiohttp's own Accept: */*
    assert names == [*added, b"accept-encoding", b"content-length", b"content-type", b"host", b"x-request-id"]
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


async def _trickle(writer: asyncio.StreamWriter, n: int) -> None:
    """A 200 whose ``n``-byte body arrives one byte every 50 ms (each wait within a read timeout)."""
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % n)
    for _ in range(n):
        writer.write(b"x")
        await writer.drain()
        await asyncio.sleep(0.05)


async def test_an_answer_trickled_past_the_exchange_timeout_is_read_timeout() -> None:
    """An engine that sends a byte of its body every 50 ms never trips the read timeout (1 s);
    the exchange timeout (0.4 s) cuts it off, whether the body is read whole or as it comes, and
    a head that takes longer than the exchange timeout is cut off too. An answer that ends in
    time leaves its connection to the next request, whose own clock starts at its send."""

    async def engine(srv, reader, writer):
        await srv.read_request(reader)
        n = len(srv.requests)
        if n == 3:
            await asyncio.sleep(0.8)  # the head: later than the exchange timeout, sooner than a read timeout
        if n in (4, 5):
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            await writer.drain()
            return
        await _trickle(writer, 100)

    async with Server(engine) as srv:
        c = client(read_timeout=1.0, exchange_timeout=0.4)
        loop = asyncio.get_running_loop()
        for read_whole in (True, False):
            t0 = loop.time()
            r = await c.send("POST", srv.url, b"{}", HEADERS)
            with pytest.raises(uc.ReadTimeout):
                if read_whole:
                    await r.aread()
                else:
                    async for _ in r.aiter_raw():
                        pass
            assert 0.35 <= loop.time() - t0 < 0.9
            await r.aclose()
        t0 = loop.time()
        with pytest.raises(uc.ReadTimeout):
            await c.send("POST", srv.url, b"{}", HEADERS)
        assert 0.35 <= loop.time() - t0 < 0.75
        r = await c.send("POST", srv.url, b"{}", HEADERS)
        assert await r.aread() == b"ok"
        await r.aclose()
        await asyncio.sleep(0.5)  # past the first exchange's deadline: no timer of it is left
        r = await c.send("POST", srv.url, b"{}", HEADERS)
        assert (r.status_code, await r.aread()) == (200, b"ok")
        await r.aclose()
        await c.aclose()
    assert len(srv.requests) == 5


async def test_exchange_timeout_null_leaves_a_trickle_unbounded_and_zero_or_negative_is_refused() -> None:
    """``gateway.exchange_timeout_seconds: null`` bounds nothing: an answer trickled over 0.6 s,
    no byte a read timeout apart, is read whole. 0 and negatives are refused when the settings
    load (every deadline would be one already passed)."""
    from pydantic import ValidationError

    from config.models import GatewaySettings

    assert GatewaySettings(exchange_timeout_seconds=None).exchange_timeout_seconds is None
    assert GatewaySettings().exchange_timeout_seconds == 3600.0
    for bad in (0, -1, float("nan")):
        with pytest.raises(ValidationError):
            GatewaySettings(exchange_timeout_seconds=bad)

    async def engine(srv, reader, writer):
        await srv.read_request(reader)
        await _trickle(writer, 12)

    async with Server(engine) as srv:
        c = client(read_timeout=0.5, exchange_timeout=None)
        r = await c.send("POST", srv.url, b"{}", HEADERS)
        assert await r.aread() == b"x" * 12
        await r.aclose()
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


async def test_a_full_pool_is_connect_timeout_after_the_connect_timeout(transport_kind) -> None:
    async def engine(srv, reader, writer):
        await srv.read_request(reader)
        await asyncio.sleep(5)

    async with Server(engine) as srv:
        c = client(max_connections=1, connect_timeout=0.3, read_timeout=10)
        first = asyncio.ensure_future(c.send("POST", srv.url, b"{}", HEADERS))
        await asyncio.sleep(0.1)
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(uc.ConnectTimeout) as e:
            await c.send("POST", srv.url, b"{}", HEADERS)
        assert 0.25 < asyncio.get_running_loop().time() - t0 < 1.5
        # both transports tell a busy pool from an unreachable engine
        assert type(e.value) is uc.PoolTimeout
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
        async for _ in srv.each_request(reader):
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


async def test_a_body_framed_by_the_close_is_read_whole_and_its_connection_not_kept() -> None:
    peers: list[object] = []

    async def engine(srv, reader, writer):
        peers.append(writer.get_extra_info("peername"))
        await srv.read_request(reader)
        writer.write(b"HTTP/1.0 200 OK\r\ncontent-type: application/json\r\n\r\n" + b"x" * 5000)
        await writer.drain()  # and the server closes: the body's end

    async with Server(engine) as srv:
        c = client()
        for _ in range(2):
            r = await c.send("POST", srv.url, b"{}", HEADERS)
            assert await r.aread() == b"x" * 5000
            await r.aclose()
        await c.aclose()
    assert len(peers) == 2


async def test_connection_close_and_interim_responses() -> None:
    """A ``Connection: close`` answer is not kept; a ``103 Early Hints`` before the answer is skipped."""
    peers: list[object] = []

    async def engine(srv, reader, writer):
        peers.append(writer.get_extra_info("peername"))
        async for _ in srv.each_request(reader):
            writer.write(b"HTTP/1.1 103 Early Hints\r\nlink: </a>; rel=preload\r\n\r\n")
            close = len(srv.requests) == 1
            writer.write(
                b"HTTP/1.1 201 Created\r\ncontent-length: 2\r\n%s\r\nok" % (b"connection: close\r\n" if close else b"")
            )
            await writer.drain()
            if close:
                return

    async with Server(engine) as srv:
        c = client()
        for _ in range(3):
            r = await c.send("POST", srv.url, b"{}", HEADERS)
            assert (r.status_code, "link" in r.headers, await r.aread()) == (201, False, b"ok")
            await r.aclose()
        await c.aclose()
    assert len(peers) == 2  # the first connection closed; the second kept for the third request


async def test_a_malformed_status_line_is_a_protocol_error() -> None:
    async def engine(srv, reader, writer):
        await srv.read_request(reader)
        writer.write(b"HTTP/1.1 2OO OK\r\ncontent-length: 0\r\n\r\n")
        await writer.drain()

    async with Server(engine) as srv:
        c = client()
        with pytest.raises(uc.RemoteProtocolError):
            await c.send("POST", srv.url, b"{}", HEADERS)
        await c.aclose()


async def test_a_large_body_comes_back_byte_for_byte_to_a_slow_reader() -> None:
    body = bytes(range(256)) * 8192  # 2 MiB, well past the read-pause mark

    async def engine(srv, reader, writer):
        await srv.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for i in range(0, len(body), 65536):
            part = body[i : i + 65536]
            writer.write(b"%x\r\n%s\r\n" % (len(part), part))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    async with Server(engine) as srv:
        c = client(read_timeout=5.0)
        r = await c.send("POST", srv.url, b"{}", HEADERS)
        got = []
        async for chunk in r.aiter_raw():
            got.append(chunk)
            await asyncio.sleep(0.002)
        await r.aclose()
        await c.aclose()
    assert b"".join(got) == body


async def test_a_connection_the_engine_closed_while_idle_is_not_used_again() -> None:
    async def engine(srv, reader, writer):
        await srv.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()  # keep-alive allowed, then closed at once (an engine's idle timeout)

    async with Server(engine) as srv:
        c = client()
        for _ in range(3):
            r = await c.send("POST", srv.url, b"{}", HEADERS)
            assert await r.aread() == b"ok"
            await r.aclose()
            await asyncio.sleep(0.05)
        await c.aclose()
    assert len(srv.requests) == 3


async def test_h1_a_header_with_a_line_break_raises_before_anything_is_sent(transport_kind) -> None:
    if transport_kind != "h1":
        pytest.skip("the H1 transport's own check")

    async def engine(srv, reader, writer):
        await srv.read_request(reader)

    async with Server(engine) as srv:
        c = client()
        for bad in ({"x-request-id": "a\r\nx-admin: 1"}, {"x-a\nb": "1"}, {"x-request-id": "a\0b"}):
            with pytest.raises(ValueError, match="CR, LF or NUL"):
                await c.send("POST", srv.url, b"{}", bad)
        await c.aclose()
    assert srv.requests == []


async def test_h1_reset_inside_the_body_is_read_error_and_the_pool_is_shared_by_origins(transport_kind) -> None:
    if transport_kind != "h1":
        pytest.skip("the H1 transport's own pool and error")

    async def reset(srv, reader, writer):
        await srv.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nabc")
        await writer.drain()
        writer.transport.abort()  # RST

    async def fine(srv, reader, writer):
        async for _ in srv.each_request(reader):
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            await writer.drain()

    async with Server(reset) as bad, Server(fine) as a, Server(fine) as b:
        c = client(max_connections=1)
        r = await c.send("POST", bad.url, b"{}", HEADERS)
        with pytest.raises((uc.ReadError, uc.RemoteProtocolError)):
            await r.aread()
        await r.aclose()
        for url in (a.url, b.url, a.url):  # one slot: the idle connection to the other origin is closed
            r = await c.send("POST", url, b"{}", HEADERS)
            assert await r.aread() == b"ok"
            await r.aclose()
        await c.aclose()
    assert (len(a.requests), len(b.requests)) == (2, 1)


async def test_h1_https_upstream_is_verified(transport_kind, tmp_path) -> None:
    """An ``https`` engine: reached with a context that trusts its CA; refused (``ConnectError``)
    with the default trust store, which does not."""
    import ssl
    import subprocess

    from gateway.relay.h1_transport import H1Transport

    if transport_kind != "h1":
        pytest.skip("the H1 transport's TLS")
    key, cert = tmp_path / "k.pem", tmp_path / "c.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1"]
        + ["-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
    )
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(cert, key)

    async def on_conn(reader, writer):
        srv = Server(None)
        await srv.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(on_conn, "127.0.0.1", 0, ssl=server_ctx)
    url = f"https://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/chat/completions"
    try:
        trusting = H1Transport(
            connect_timeout=2, read_timeout=2, max_connections=2, ssl_context=ssl.create_default_context(cafile=cert)
        )
        r = await trusting.send("POST", url, b"{}", HEADERS, None)
        assert (r.status_code, await r.aread()) == (200, b"ok")
        await r.aclose()
        await trusting.aclose()
        default = H1Transport(connect_timeout=2, read_timeout=2, max_connections=2)
        with pytest.raises(uc.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            await default.send("POST", url, b"{}", HEADERS, None)
        await default.aclose()
    finally:
        server.close()


def _framed(body: bytes, framing: str, chunk_sizes: list[int]) -> bytes:
    """An HTTP/1.1 200 response carrying ``body`` framed by ``framing``."""
    if framing == "length":
        return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
    if framing == "close":
        return b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\n" + body
    out, i = [b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"], 0
    for n in [*chunk_sizes, len(body)]:
        part = body[i : i + max(n, 1)]
        if part:
            out.append(b"%x\r\n%s\r\n" % (len(part), part))
        i += len(part)
    out.append(b"0\r\n\r\n")
    return b"".join(out)


@given(
    body=st.binary(max_size=3000),
    framing=st.sampled_from(["length", "chunked", "close"]),
    chunk_sizes=st.lists(st.integers(1, 700), max_size=6),
    cuts=st.lists(st.integers(0, 4000), max_size=8),
    streamed=st.booleans(),
)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_any_framing_split_anywhere_gives_the_body_back_exactly(
    transport_kind, body, framing, chunk_sizes, cuts, streamed
):
    """Whatever the framing and wherever the engine's writes split the response (inside the status
    line, a header, a chunk size, a CRLF), the body comes back byte for byte, read whole or
    streamed, over either transport."""
    wire = _framed(body, framing, chunk_sizes)
    points = sorted({c for c in cuts if 0 < c < len(wire)})
    pieces = [wire[a:b] for a, b in zip([0, *points], [*points, len(wire)], strict=True)]

    async def engine(srv, reader, writer):
        await srv.read_request(reader)
        for piece in pieces:
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(0.001)
        if framing == "close":
            writer.close()

    async def run() -> bytes:
        async with Server(engine) as srv:
            c = client()
            r = await c.send("POST", srv.url, b"{}", HEADERS)
            got = b"".join([x async for x in r.aiter_raw()]) if streamed else await r.aread()
            await r.aclose()
            await c.aclose()
            return got

    assert asyncio.run(run()) == body


async def test_h1_an_endless_or_crowded_response_head_is_a_protocol_error(transport_kind) -> None:
    """httptools keeps a head's lines until it is complete: a head past 64 KiB (here an endless
    header value) or past 256 header lines is refused instead of held."""
    if transport_kind != "h1":
        pytest.skip("the H1 transport's own bounds")

    async def endless(srv, reader, writer):
        await srv.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nx-long: ")
        for _ in range(100):  # 6.4 MiB, never a line end
            writer.write(b"a" * 65536)
            await writer.drain()

    async def crowded(srv, reader, writer):
        await srv.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\n" + b"".join(b"x-%d: 1\r\n" % i for i in range(300)) + b"\r\n")
        await writer.drain()

    for engine, what in ((endless, "over 65536 bytes"), (crowded, "more than 256 header lines")):
        async with Server(engine) as srv:
            c = client()
            with pytest.raises(uc.RemoteProtocolError, match=what):
                await c.send("POST", srv.url, b"{}", HEADERS)
            await c.aclose()


@pytest.mark.parametrize("stream", [False, True])
def test_the_setting_picks_the_transport_and_both_relay_the_same_answer(engine, transport_kind, stream, caplog) -> None:
    """``gateway.upstream_client`` names the forward path's transport (and the start-up log line
    says which); a chat through the gateway over either gets the same answer from the same engine
    (the mock's reply is deterministic)."""
    caplog.set_level(logging.INFO, logger="kvgate.app")
    from pydantic import ValidationError

    from gateway.relay.aiohttp_transport import AiohttpTransport
    from gateway.relay.h1_transport import H1Transport
    from tests.gateway_harness import Gateway, chat, settings_for, upstream, wait_for

    settings = settings_for([upstream("u1", engine)], gateway={"upstream_client": transport_kind})
    gw = Gateway(settings).start()
    try:
        want = {"h1": H1Transport, "aiohttp": AiohttpTransport}[transport_kind]
        assert type(gw.gw.forwarder.transport) is want
        line = f"forwarding to u1 ({engine.api_url.rstrip('/')}) with upstream_client {transport_kind}"
        assert wait_for(lambda: line in caplog.messages), caplog.messages
        with gw.client() as http:
            assert wait_for(lambda: http.get("/readyz").status_code == 200)
            r = http.post("/v1/chat/completions", json=chat("Say hello.", stream=stream, max_tokens=8))
        assert r.status_code == 200
        body = r.text if stream else r.json()["choices"][0]["message"]["content"]
    finally:
        gw.stop()
    answers = _ANSWERS.setdefault(stream, {})
    answers[transport_kind] = body
    if len(answers) == 2:
        assert answers["h1"] == answers["aiohttp"]
    with pytest.raises(ValidationError, match="upstream_client"):
        settings_for([upstream("u1", engine)], gateway={"upstream_client": "h2"})


#: each transport's answer, by ``stream``, compared once both ran
_ANSWERS: dict[bool, dict[str, str]] = {}


def test_h1_the_host_header_is_the_urls_host_and_port_only() -> None:
    from urllib.parse import urlsplit

    from gateway.relay.h1_transport import _host, _parsed, _request_bytes

    cases = {
        "http://engine:8000/v1": "engine:8000",
        "http://engine/v1": "engine",
        "http://engine:80/v1": "engine",
        "https://engine:443/v1": "engine",
        "https://engine:80/v1": "engine:80",
        "http://user:secret@engine:8000/v1": "engine:8000",
        "http://[::1]:8000/v1": "[::1]:8000",
    }
    assert {u: _host(urlsplit(u)) for u in cases} == cases
    assert {u: _parsed(u)[2] for u in cases} == cases
    origin, target, host = _parsed("HTTP://e:1/v1/chat?x=1")
    assert (origin, target, host) == (("http", "e", 1), "/v1/chat?x=1", "e:1")
    head = _request_bytes("POST", target, host, b"{}", {"a": "b", "Content-Length": "9"})
    assert head == b"POST /v1/chat?x=1 HTTP/1.1\r\nHost: e:1\r\na: b\r\nContent-Length: 2\r\n\r\n{}"
    assert _parsed("https://e") == (("https", "e", 443), "/", "e")
    with pytest.raises(ValueError, match="request target"):
        _parsed("http://e:1/v1/a b")
    with pytest.raises(uc.ConnectError, match="not an http"):
        _parsed("ftp://e/v1")


async def test_a_request_waiting_for_the_full_pool_gets_the_connection_the_first_gives_back() -> None:
    release = asyncio.Event()
    peers: list[object] = []

    async def engine(srv, reader, writer):
        peers.append(writer.get_extra_info("peername"))
        async for _ in srv.each_request(reader):
            if len(srv.requests) == 1:
                await release.wait()
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\n\r\n%d" % len(srv.requests))
            await writer.drain()

    async with Server(engine) as srv:
        c = client(max_connections=1, connect_timeout=2.0)

        async def one() -> bytes:
            r = await c.send("POST", srv.url, b"{}", HEADERS)
            try:
                return await r.aread()
            finally:
                await r.aclose()

        first = asyncio.ensure_future(one())
        await asyncio.sleep(0.05)
        second = asyncio.ensure_future(one())  # waits: the one connection is busy
        await asyncio.sleep(0.1)
        assert not second.done()
        release.set()
        assert (await first, await second) == (b"1", b"2")
        await c.aclose()
    assert len(peers) == 1


async def test_aread_stops_past_its_limit_and_the_connection_is_not_kept() -> None:
    body = b"y" * (3 << 20)
    peers: list[object] = []

    async def engine(srv, reader, writer):
        peers.append(writer.get_extra_info("peername"))
        async for _ in srv.each_request(reader):
            n = len(body) if len(srv.requests) == 1 else 1 << 20
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % n)
            try:
                writer.write(body[:n])
                await writer.drain()
            except ConnectionError:
                return

    async with Server(engine) as srv:
        c = client()
        r = await c.send("POST", srv.url, b"{}", HEADERS)
        with pytest.raises(uc.ResponseTooLarge, match="over 1048576 bytes") as e:
            await r.aread(1 << 20)
        assert e.value.limit == 1 << 20
        await r.aclose()
        r = await c.send("POST", srv.url, b"{}", HEADERS)  # exactly the limit: read whole
        assert await r.aread(1 << 20) == body[: 1 << 20]
        await r.aclose()
        await c.aclose()
    assert len(peers) == 2


def sockets_to(*ports: int) -> int:
    """This process's TCP sockets whose peer's port is one of ``ports`` (Linux: the inodes of
    /proc/net/tcp's rows among /proc/self/fd's sockets), connecting ones included."""
    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/self/fd/{fd}")
            if link.startswith("socket:["):
                mine.add(link[8:-1])
    n = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            next(f)
            for row in f:
                cols = row.split()
                n += int(cols[2].rsplit(":", 1)[1], 16) in ports and cols[9] in mine
    return n


async def test_the_pools_hold_max_connections_per_origin_what_the_open_file_check_counts() -> None:
    """``max_connections`` 2, three engines that answer nothing, three requests to each: 6 sockets
    (2 per origin; the third request of each waits), the 3 x 2 that
    ``gateway.edge.server.fds_needed`` counts for 3 origins; none once the requests are cancelled."""

    async def hang(srv, reader, writer):
        await srv.read_request(reader)
        await asyncio.sleep(10)

    async with Server(hang) as a, Server(hang) as b, Server(hang) as d:
        ports = [urlsplit(s.url).port or 0 for s in (a, b, d)]
        c = client(max_connections=2, connect_timeout=5.0, read_timeout=5.0)
        sends = [asyncio.ensure_future(c.send("POST", s.url, b"{}", HEADERS)) for s in (a, b, d) for _ in range(3)]
        await asyncio.sleep(0.3)
        held = sockets_to(*ports)
        for t in sends:
            t.cancel()
        await asyncio.gather(*sends, return_exceptions=True)
        await asyncio.sleep(0.05)
        left = sockets_to(*ports)
        await c.aclose()
    assert (held, left) == (6, 0)


async def test_a_connection_given_up_on_an_engine_that_reads_nothing_closes_its_descriptor() -> None:
    """An engine that accepts and reads nothing (hung; its receive buffer 4 KiB): a 16 MiB body
    stays partly unsent, and the request ends in a ``ReadTimeout``. With ``max_connections`` 1,
    after each of 3 such requests no socket to it is left. Each used to stay open, waiting to write
    the rest of its body (a close flushes first), while its slot was given back and the next
    request opened another: 1, 2, 3 sockets, past what the pool is counted to hold."""
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)  # never accepted: the kernel completes the handshakes and reads 4 KiB
        port = listener.getsockname()[1]
        c = client(max_connections=1, read_timeout=0.3, exchange_timeout=0.6)
        left = []
        for _ in range(3):
            with pytest.raises(uc.ReadTimeout):
                await c.send("POST", f"http://127.0.0.1:{port}/v1/chat/completions", b"x" * (16 << 20), HEADERS)
            await asyncio.sleep(0.05)
            left.append(sockets_to(port))
        await c.aclose()
    assert left == [0, 0, 0]


async def test_a_connect_to_a_host_of_two_addresses_holds_one_socket_at_a_time(monkeypatch) -> None:
    """``engine.test`` resolves to 127.0.0.1 and 127.0.0.2, neither answering a connect (accept
    queues full: the kernel drops the SYNs): 0.6 s into one connect, the client holds 1 socket.
    aiohttp's Happy Eyeballs had opened a second to the next address after 0.25 s, one descriptor
    past ``limit_per_host`` for each connect in flight."""
    fillers: list[socket.socket] = []
    with socket.socket() as one, socket.socket() as two:
        one.bind(("127.0.0.1", 0))
        port = one.getsockname()[1]
        two.bind(("127.0.0.2", port))
        for listener in (one, two):
            listener.listen(0)
            for _ in range(2):  # the first fills the accept queue, the second's SYN is dropped
                s = socket.socket()
                s.setblocking(False)
                s.connect_ex(listener.getsockname())
                fillers.append(s)
        await asyncio.sleep(0.1)
        loop = asyncio.get_running_loop()
        resolve = loop.getaddrinfo

        async def getaddrinfo(host, p, *args, **kw):
            if host != "engine.test":
                return await resolve(host, p, *args, **kw)
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, p)) for ip in ("127.0.0.1", "127.0.0.2")]

        monkeypatch.setattr(loop, "getaddrinfo", getaddrinfo)
        before = sockets_to(port)
        c = client(max_connections=1, connect_timeout=3.0)
        send = asyncio.ensure_future(c.send("POST", f"http://engine.test:{port}/v1/chat/completions", b"{}", HEADERS))
        await asyncio.sleep(0.6)
        connecting = sockets_to(port) - before
        send.cancel()
        with pytest.raises(asyncio.CancelledError):
            await send
        await c.aclose()
        for s in fillers:
            s.close()
    assert connecting == 1
