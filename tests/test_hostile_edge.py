"""The server layer under hostile clients (gateway/edge.py), over real sockets against the gateway
app: oversized and too many headers (431), slow heads and slow bodies (408 within the bound),
too many client connections (503), idle keep-alive connections closed. Exact bytes each time."""

from __future__ import annotations

import dataclasses
import json
import socket
import threading
import time

import pytest
import uvicorn

from gateway.edge import EdgeLimits, configure
from tests.gateway_harness import KEY_A, Gateway, chat, settings_for, tenants, upstream
from tests.mock_engine import MockEngine, free_socket

pytestmark = pytest.mark.timeout(60)

LIMITS = EdgeLimits(
    max_header_bytes=8 * 1024,
    max_header_count=20,
    header_timeout_seconds=0.6,
    body_timeout_seconds=0.6,
    max_inbound_connections=6,
    keepalive_timeout_seconds=0.4,
    refusal_delay_seconds=0.0,
)


class EdgeServer:
    """The gateway app under uvicorn with :func:`gateway.edge.configure` applied, on a free port."""

    def __init__(self, app, limits: EdgeLimits) -> None:
        self.sock = free_socket()
        self.port = self.sock.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=1)
        self.server = uvicorn.Server(configure(config, limits))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> EdgeServer:
        self.thread.start()
        deadline = time.monotonic() + 15
        while not self.server.started:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(5)
        self.sock.close()

    def connect(self) -> socket.socket:
        s = socket.create_connection(("127.0.0.1", self.port), timeout=5)
        return s


def read_all(s: socket.socket, timeout: float = 5.0) -> bytes:
    """Everything until the server closes the connection."""
    s.settimeout(timeout)
    out = b""
    while True:
        try:
            b = s.recv(65536)
        except ConnectionResetError:
            break
        if not b:
            break
        out += b
    return out


def refusal(status: int, reason: str, message: str, code: str) -> bytes:
    etype = "server_error" if status >= 500 else "invalid_request_error"
    body = json.dumps(
        {"error": {"message": message, "type": etype, "param": None, "code": code}}, separators=(",", ":")
    ).encode()
    return (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    ).encode() + body


TOO_LARGE = refusal(
    431,
    "Request Header Fields Too Large",
    "The request's headers are too large: more than 8192 bytes.",
    "request_header_fields_too_large",
)


@pytest.fixture(scope="module")
def edge():
    engine = MockEngine().start()
    gw = Gateway(settings_for([upstream("u1", engine)], gateway={"max_body_bytes": 8 << 20}), tenants())
    with EdgeServer(gw.app, LIMITS) as srv:
        srv.engine = engine
        yield srv
    engine.stop()


def get(path: str = "/healthz", extra: bytes = b"") -> bytes:
    return f"GET {path} HTTP/1.1\r\nhost: x\r\n".encode() + extra + b"\r\n"


def test_normal_requests_pass_with_keepalive_then_idle_close(edge):
    s = edge.connect()
    for _ in range(2):
        s.sendall(get())
        data = s.recv(65536)
        assert data.startswith(b"HTTP/1.1 200 OK\r\n") and data.endswith(b'{"status":"ok"}')
    t0 = time.monotonic()
    assert read_all(s) == b""  # the idle keep-alive connection is closed by the server
    assert 0.3 <= time.monotonic() - t0 < 3
    s.close()


def test_header_bytes_over_the_limit_get_431(edge):
    s = edge.connect()
    s.sendall(get(extra=b"x-big: " + b"a" * 9000 + b"\r\n"))  # a whole head, too long
    assert read_all(s) == TOO_LARGE
    s = edge.connect()
    s.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\nx-endless: " + b"b" * 9000)  # a head that never ends
    assert read_all(s) == TOO_LARGE
    s = edge.connect()
    s.sendall(get(extra=b"x-fits: " + b"c" * 7000 + b"\r\n"))
    assert s.recv(65536).startswith(b"HTTP/1.1 200 OK\r\n")
    s.close()


def test_parsing_stops_at_the_refused_header(edge, monkeypatch, caplog):
    """20,000 headers: 431 at the 21st, and the parser is stopped there: 21 header callbacks,
    not 20,001, and no second answer or parse-error log line after the refusal."""
    from gateway.edge import BoundedHttpToolsProtocol

    calls: list[bytes] = []
    real = BoundedHttpToolsProtocol.on_header

    def counting(self, name, value):
        calls.append(name)
        return real(self, name, value)

    monkeypatch.setattr(BoundedHttpToolsProtocol, "on_header", counting)
    s = edge.connect()
    s.sendall(get(extra=b"".join(b"x-h%d: 1\r\n" % i for i in range(20_000))))
    assert read_all(s) == refusal(
        431,
        "Request Header Fields Too Large",
        "The request's headers are too large: more than 20 header fields.",
        "request_header_fields_too_large",
    )
    assert len(calls) == 21
    assert "Invalid HTTP request" not in caplog.text
    s = edge.connect()  # the next connection is served as usual
    s.sendall(get())
    assert s.recv(65536).startswith(b"HTTP/1.1 200 OK\r\n")
    s.close()


def test_a_refused_head_on_a_kept_alive_connection_gets_its_answer(edge):
    """The second request on a connection has too many headers, or too many header bytes: it
    gets its 431 like a first one (it used to get a silent close: the refusal looked at the
    previous request's finished response)."""
    for extra, why in (
        (b"".join(b"x-h%d: 1\r\n" % i for i in range(30)), "more than 20 header fields"),
        (b"x-big: " + b"a" * 9000 + b"\r\n", "more than 8192 bytes"),
    ):
        s = edge.connect()
        s.sendall(get())
        first = s.recv(65536)
        assert first.startswith(b"HTTP/1.1 200 OK\r\n") and first.endswith(b'{"status":"ok"}')
        s.sendall(get(extra=extra))
        assert read_all(s) == refusal(
            431,
            "Request Header Fields Too Large",
            f"The request's headers are too large: {why}.",
            "request_header_fields_too_large",
        )
        s.close()


def test_too_many_headers_get_431(edge):
    s = edge.connect()
    s.sendall(get(extra=b"".join(b"x-h%d: 1\r\n" % i for i in range(20))))  # host + 20 = 21 fields
    assert read_all(s) == refusal(
        431,
        "Request Header Fields Too Large",
        "The request's headers are too large: more than 20 header fields.",
        "request_header_fields_too_large",
    )
    s = edge.connect()
    s.sendall(get(extra=b"".join(b"x-h%d: 1\r\n" % i for i in range(19))))  # exactly 20
    assert s.recv(65536).startswith(b"HTTP/1.1 200 OK\r\n")
    s.close()


def test_slow_head_gets_408_within_the_bound(edge):
    s = edge.connect()
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")
    t0 = time.monotonic()
    assert read_all(s) == refusal(
        408, "Request Timeout", "The request head did not arrive within 0.6 seconds.", "request_timeout"
    )
    assert time.monotonic() - t0 < 0.6 + 1.5
    s = edge.connect()  # connected, never a byte
    assert read_all(s).startswith(b"HTTP/1.1 408 Request Timeout\r\n")


def test_slow_body_gets_408_within_the_bound_and_nothing_is_forwarded(edge):
    before = len(edge.engine.state.requests)
    s = edge.connect()
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        f"authorization: Bearer {KEY_A}\r\ncontent-length: 8000000\r\n\r\n"
    ).encode()
    s.sendall(head + b'{"model": ')
    t0 = time.monotonic()
    for _ in range(3):  # trickling does not extend the deadline
        time.sleep(0.1)
        s.sendall(b" ")
    assert read_all(s) == refusal(
        408, "Request Timeout", "The request body did not arrive within 0.6 seconds.", "request_timeout"
    )
    assert time.monotonic() - t0 < 0.6 + 1.5
    assert len(edge.engine.state.requests) == before
    # a body that arrives in time is answered as usual
    s = edge.connect()
    body = json.dumps(chat(max_tokens=4)).encode()
    s.sendall(head.replace(b"8000000", str(len(body)).encode()) + body)
    assert s.recv(65536).startswith(b"HTTP/1.1 200 OK\r\n")
    s.close()


def test_client_connections_above_the_limit_get_503(edge):
    held = [edge.connect() for _ in range(6)]
    try:
        time.sleep(0.1)
        extra = edge.connect()
        assert read_all(extra) == refusal(
            503,
            "Service Unavailable",
            "The gateway holds its maximum of 6 client connections; retry shortly.",
            "server_busy",
        )
    finally:
        for s in held:
            s.close()
    time.sleep(0.2)
    s = edge.connect()
    s.sendall(get())
    assert s.recv(65536).startswith(b"HTTP/1.1 200 OK\r\n")
    s.close()


def _send_after_the_answer(s: socket.socket, n_pieces: int = 12) -> None:
    """What a client that sends its whole request before reading does: goes on sending (here
    192 KiB in blocking 16 KiB sends) after the server has answered."""
    time.sleep(0.2)  # the answer is on its way, the server has closed its side
    for _ in range(n_pieces):
        s.sendall(b"a" * 16384)


def test_a_client_still_sending_gets_its_431_not_a_reset(edge):
    """A client that goes on sending after its head was refused still reads the 431 and then the
    end of the stream: the server lingers, dropping up to 256 KiB more, instead of closing with
    bytes unread (the kernel's reset then discarded the answer on its way, or failed the send)."""
    from gateway.edge import LINGER_MAX_HEAD_BYTES

    assert 12 * 16384 < LINGER_MAX_HEAD_BYTES
    s = edge.connect()
    s.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 9000)
    _send_after_the_answer(s)
    assert read_all(s) == TOO_LARGE
    s.close()


def test_a_body_refused_before_it_is_read_is_answered_with_connection_close(edge):
    """413 from Content-Length (above max_body_bytes) and 401 without a key, each while the
    client still sends its body: the client gets the answer, ``connection: close`` in it, and
    the end of the stream, not a reset; nothing is forwarded."""
    before = len(edge.engine.state.requests)
    for auth, status, code in (
        (f"authorization: Bearer {KEY_A}\r\n", b"413", "request_too_large"),  # 9 MiB > max_body_bytes
        ("", b"401", "invalid_api_key"),  # no key: the body is never read
    ):
        s = edge.connect()
        head = (
            f"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n{auth}"
            f"content-length: {9 << 20}\r\n\r\n"
        ).encode()
        s.sendall(head + b'{"model": "x", "prompt": "')
        _send_after_the_answer(s)
        answer = read_all(s)
        status_line, _, rest = answer.partition(b"\r\n")
        assert status_line.split(b" ")[1] == status, answer[:200]
        head_bytes, _, body = rest.partition(b"\r\n\r\n")
        assert b"connection: close" in head_bytes.lower()
        assert json.loads(body)["error"]["code"] == code
        s.close()
    assert len(edge.engine.state.requests) == before


def test_a_refused_head_is_answered_after_the_refusal_delay():
    """With ``refusal_delay_seconds`` 0.4, a head with too many bytes gets its exact 431 no sooner
    than 0.4 s after it was sent, and a head within the limits is answered at once."""
    engine = MockEngine().start()
    gw = Gateway(settings_for([upstream("u1", engine)]), tenants())
    try:
        with EdgeServer(gw.app, dataclasses.replace(LIMITS, refusal_delay_seconds=0.4)) as srv:
            s = srv.connect()
            t0 = time.monotonic()
            s.sendall(get(extra=b"x-big: " + b"a" * 9000 + b"\r\n"))
            assert read_all(s) == TOO_LARGE
            assert time.monotonic() - t0 >= 0.4
            s.close()
            s = srv.connect()
            t0 = time.monotonic()
            s.sendall(get())
            assert s.recv(65536).startswith(b"HTTP/1.1 200 OK\r\n")
            assert time.monotonic() - t0 < 0.4
            s.close()
    finally:
        engine.stop()
