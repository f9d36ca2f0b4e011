"""Clients that read slowly or never, refused before their body is read (401 without a key, 413
by ``Content-Length``, 429 over RPM or concurrency), against the gateway app behind the bounded
edge (gateway/edge/protocol.py) over real sockets. A client whose receive buffer is tiny and that
reads 7 bytes at a time gets the refusal's exact bytes and then the end of the stream; the refused
request holds no concurrency lease and no in-flight slot while its connection lingers; and a
client that never reads is closed by the server within the linger time (docs/gateway.md, "Client
connections" and "Fault behaviour, in short")."""

from __future__ import annotations

import dataclasses
import json
import socket
import threading
import time

import pytest

from config.models import QuotaSettings
from gateway.edge.protocol import LINGER_SECONDS, SEND_PIECE_BYTES, EdgeLimits, EdgeState
from gateway.quotas.stores import LocalQuotaStore
from gateway.quotas.tenant_quotas import TenantQuotas
from tests.gateway_harness import KEY_A, Gateway, chat, settings_for, tenants, upstream
from tests.mock_engine import MockEngine
from tests.test_hostile_edge import LIMITS, EdgeServer

pytestmark = pytest.mark.timeout(60)

#: the body a refused client declares and starts to send: it is never read
DECLARED = 1 << 20


def _body(message: str, etype: str, code: str) -> bytes:
    error = {"message": message, "type": etype, "param": None, "code": code}
    return json.dumps({"error": error}, separators=(",", ":")).encode()


def _head(key: str | None, length: int = DECLARED) -> bytes:
    auth = f"authorization: Bearer {key}\r\n" if key else ""
    return (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n{auth}"
        f"content-length: {length}\r\n\r\n"
    ).encode()


def _slow_socket(port: int) -> socket.socket:
    """A connection whose receive buffer is the kernel's smallest (set before the connect, so the
    window it advertises is small too)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1)
    s.settimeout(10)
    s.connect(("127.0.0.1", port))
    return s


def _read_slowly(s: socket.socket, piece: int = 7, pause: float = 0.002) -> bytes:
    """Everything until the end of the stream, ``piece`` bytes at a time."""
    out = b""
    while True:
        try:
            got = s.recv(piece)
        except ConnectionResetError:
            raise AssertionError(f"reset after {len(out)} bytes: {out!r}") from None
        if not got:
            return out
        out += got
        time.sleep(pause)


def _split(answer: bytes) -> tuple[bytes, dict[str, str], bytes]:
    head, _, body = answer.partition(b"\r\n\r\n")
    status, *lines = head.decode().split("\r\n")
    return status.encode(), {k.lower(): v for k, v in (ln.split(": ", 1) for ln in lines)}, body


class Stack:
    """The mock engine, the gateway app with in-process quotas, and the edge in front of them."""

    def __init__(self, edge: EdgeLimits = LIMITS, **limits) -> None:
        self.engine = MockEngine().start()
        self.store = LocalQuotaStore()
        quotas = TenantQuotas(QuotaSettings(), self.store, fallback=self.store)
        settings = settings_for([upstream("u1", self.engine)], gateway={"max_body_bytes": 64 * 1024})
        self.gw = Gateway(settings, tenants(**limits), quotas=quotas)
        self.edge = EdgeServer(self.gw.app, edge).__enter__()
        self.state: EdgeState = self.edge.server.config.kvgate_edge_state

    def close(self) -> None:
        self.edge.__exit__(None, None, None)
        self.engine.stop()

    def chat(self, key: str = KEY_A) -> bytes:
        """One whole chat request on a new connection; its answer's status line."""
        data = json.dumps(chat(max_tokens=2)).encode()
        with socket.create_connection(("127.0.0.1", self.edge.port), timeout=10) as s:
            s.sendall(_head(key, len(data)) + data)
            return s.recv(65536).split(b"\r\n", 1)[0]

    def leases(self) -> int:
        t = self.store._tenants.get("tenant-a")
        return len(t.leases) if t is not None else 0

    def connections(self) -> tuple[int, int]:
        """(uvicorn's open connections, lingering ones)."""
        return len(self.edge.server.server_state.connections), len(self.edge.server.config.kvgate_edge_state.lingering)


@pytest.fixture
def stack():
    made: list[Stack] = []
    yield lambda edge=LIMITS, **limits: made.append(Stack(edge, **limits)) or made[-1]
    for s in made:
        s.close()


def _wait(pred, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


KEYLESS = (
    "You didn't provide an API key. You need to provide your API key in an Authorization header using Bearer "
    "auth (i.e. Authorization: Bearer YOUR_KEY)."
)
RPM = "Rate limit reached for tenant 'tenant-a' on requests per 60s window (RPM): Limit 1, Used 1, Requested 1. "
#: key sent, status line, extra headers, error message (``{retry}``: the answer's ``retry-after``), type, code
REFUSALS = {
    "401": (None, b"HTTP/1.1 401 Unauthorized", {}, KEYLESS, "authentication_error", "invalid_api_key"),
    "413": (
        KEY_A,
        b"HTTP/1.1 413 Request Entity Too Large",
        {},
        "The request body is larger than 65536 bytes.",
        "invalid_request_error",
        "request_too_large",
    ),
    "429-rpm": (
        KEY_A,
        b"HTTP/1.1 429 Too Many Requests",
        {"x-ratelimit-limit-requests": "1", "x-ratelimit-remaining-requests": "0"},
        RPM + "Please try again in {retry}s.",
        "rate_limit_error",
        "rate_limit_exceeded",
    ),
}
#: headers of every answer whose values differ per request
VARYING = {"date", "x-request-id", "x-kvgate-overhead-ms", "retry-after"}


@pytest.mark.parametrize("kind", list(REFUSALS))
def test_a_slow_reader_gets_its_early_refusal_whole_then_the_end(stack, kind: str) -> None:
    st = stack(rpm=1)
    if kind == "429-rpm":
        assert st.chat() == b"HTTP/1.1 200 OK"  # the one request of the minute
    key, status, extra, message, etype, code = REFUSALS[kind]
    s = _slow_socket(st.edge.port)
    t0 = time.monotonic()
    s.sendall(_head(key) + b'{"model": "kvgate-tiny", "messages": [')
    answer = _read_slowly(s)
    elapsed = time.monotonic() - t0
    s.close()
    got_status, headers, body = _split(answer)
    assert got_status == status, answer
    fixed = {k: v for k, v in headers.items() if k not in VARYING}
    assert fixed == {  # no "server" header: the test server runs as kvgate serve does
        "connection": "close",
        "content-type": "application/json",
        "content-length": str(len(body)),
        **extra,
    }, headers
    retry = headers.get("retry-after")
    assert retry in ((None,) if kind != "429-rpm" else ("59", "60"))
    assert body == _body(message.format(retry=retry), etype, code), body
    assert elapsed < 5.0  # the refusal delay is 0 in LIMITS; a reader 7 bytes at a time takes ~0.1 s
    # nothing of the refused request is held once its client is gone: no lease, no in-flight
    # request, no connection (the linger ends at the client's close, not after LINGER_SECONDS)
    assert _wait(lambda: st.connections() == (0, 0) and st.gw.gw.in_flight == 0, 3.0), st.connections()
    assert st.leases() == 0
    assert len(st.engine.state.requests) == (1 if kind == "429-rpm" else 0)


def test_a_concurrency_429_holds_no_lease_while_its_reader_is_slow(stack) -> None:
    st = stack(rpm=100, max_concurrent=1)
    st.engine.state.mode, st.engine.state.delay_seconds = "delay", 1.0
    first = threading.Thread(target=st.chat)
    first.start()
    assert _wait(lambda: len(st.engine.state.requests) == 1, 5.0)
    s = _slow_socket(st.edge.port)
    s.sendall(_head(KEY_A) + b'{"model": "kvgate-tiny", "messages": [')
    time.sleep(0.2)  # answered; the answer waits in the buffers, unread, the connection lingers
    first.join(10)
    st.engine.state.mode = "ok"
    # the slot the refused request never took is free while its client has not read a byte (the
    # first request's own lease is released by its settle, just after its answer went out)
    assert _wait(lambda: st.leases() == 0, 2.0), st.leases()
    assert st.chat() == b"HTTP/1.1 200 OK"
    answer = _read_slowly(s)
    s.close()
    status, headers, body = _split(answer)
    assert status == b"HTTP/1.1 429 Too Many Requests" and headers["connection"] == "close"
    assert json.loads(body)["error"]["message"] == (
        "Rate limit reached for tenant 'tenant-a' on concurrent requests: Limit 1. Please try again in 1s."
    )
    assert _wait(lambda: st.connections() == (0, 0) and st.gw.gw.in_flight == 0, 3.0), st.connections()


def test_a_client_that_never_reads_its_refusal_is_closed_within_the_linger_time(stack) -> None:
    st = stack(rpm=100)
    s = _slow_socket(st.edge.port)
    t0 = time.monotonic()
    s.sendall(_head(None) + b"{")  # refused 401; the client neither reads nor ends
    assert _wait(lambda: st.connections() == (0, 1), 2.0), st.connections()  # lingering, counted
    assert st.gw.gw.in_flight == 0 and st.leases() == 0
    assert _wait(lambda: st.connections() == (0, 0), LINGER_SECONDS + 3.0), st.connections()
    assert LINGER_SECONDS - 0.5 <= time.monotonic() - t0 < LINGER_SECONDS + 3.0
    # what the server sent before it closed is still in the client's buffer: the answer, then the end
    status, headers, body = _split(_read_slowly(s))
    assert status == b"HTTP/1.1 401 Unauthorized" and json.loads(body)["error"]["code"] == "invalid_api_key"
    s.close()


# ---------------------------------------------------------------- answers a client does not read
#: the edge limits of the write-timeout tests: a client that takes nothing of its answer for 1 s is cut off
SEND_LIMITS = dataclasses.replace(LIMITS, send_timeout_seconds=1.0, keepalive_timeout_seconds=5.0)
#: asyncio's (and uvloop's) default write-buffer high-water mark, which uvicorn keeps
HIGH_WATER = 64 * 1024
EVENT_TEXT = 8000  # characters of one large stream event


def _event(text: str) -> bytes:
    return b'data: {"choices":[{"index":0,"delta":{"content":"%s"},"finish_reason":null}]}\n\n' % text.encode()


class Produced:
    """A stream's events, made as the engine sends them: large ones until the gateway's connection
    to its client has paused writing (``state.write_pauses``), then small ones, up to ``limit``;
    ``count`` says how many the engine took."""

    def __init__(self, state: EdgeState, limit: int = 3000) -> None:
        self.state, self.limit, self.count = state, limit, 0

    def __iter__(self):
        while self.count < self.limit:
            self.count += 1
            yield _event("x" * (EVENT_TEXT if self.state.write_pauses == 0 else 10))
        yield b"data: [DONE]\n\n"


def _answer_socket(st: Stack, rcvbuf: int = 1) -> socket.socket:
    """A client connection whose receive buffer is ``rcvbuf`` bytes (the kernel's smallest by
    default) and whose server side sends through a small kernel buffer (a fixed ``SO_SNDBUF``
    instead of loopback's autotuned megabytes), so that an answer the client does not take waits
    in the gateway after some 80 KB instead of about 2 MB."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.settimeout(10)
    s.connect(("127.0.0.1", st.edge.port))
    assert _wait(lambda: len(st.edge.server.server_state.connections) == 1, 3.0)
    (conn,) = st.edge.server.server_state.connections
    conn.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    return s


def _request(body: dict) -> bytes:
    data = json.dumps(body).encode()
    return _head(KEY_A, len(data)) + data


def _disconnects(st: Stack) -> float:
    value = st.gw.gw.metrics.registry.get_sample_value("kvgate_client_disconnects_total", {"route": "chat"})
    return value or 0.0


def _assert_let_go(st: Stack, t_paused: float) -> None:
    """The connection is gone within the send timeout (plus slack) of the pause, nothing of the
    request is held, and it counts as a client that went away."""
    assert _wait(lambda: st.connections() == (0, 0), SEND_LIMITS.send_timeout_seconds + 4.0), st.connections()
    assert time.monotonic() - t_paused < SEND_LIMITS.send_timeout_seconds + 4.0
    assert st.state.send_timeouts == 1
    assert _wait(lambda: st.gw.gw.in_flight == 0 and st.leases() == 0, 3.0)
    assert _wait(lambda: _disconnects(st) == 1.0, 3.0)


def test_a_client_that_never_reads_a_large_stream_is_cut_off_after_the_send_timeout(stack) -> None:
    st = stack(SEND_LIMITS, rpm=100)
    produced = Produced(st.state)
    st.engine.state.stream_chunks = produced  # type: ignore[assignment]  # any iterable of events
    st.engine.state.chunk_interval_seconds = 0.005
    s = _answer_socket(st)
    s.sendall(_request(chat(max_tokens=3000, stream=True)))  # and never reads
    assert _wait(lambda: st.state.write_pauses > 0, 10.0), produced.count
    t_paused = time.monotonic()
    _assert_let_go(st, t_paused)
    # the engine saw its client go: its stream was cancelled, not run to the end
    assert _wait(lambda: st.engine.state.cancelled, 3.0)
    assert produced.count < produced.limit
    # the gateway held at most the high-water mark and one event unsent for it
    assert st.state.peak_unsent <= HIGH_WATER + EVENT_TEXT + 1024, st.state.peak_unsent
    s.close()


def test_a_client_that_never_reads_a_large_whole_answer_is_cut_off_after_the_send_timeout(stack) -> None:
    st = stack(SEND_LIMITS, rpm=100)
    st.engine.state.text = "word " * 400_000  # a 2 MB answer
    s = _answer_socket(st)
    s.sendall(_request(chat(max_tokens=3000)))  # and never reads
    assert _wait(lambda: st.state.write_pauses > 0, 15.0)
    _assert_let_go(st, time.monotonic())
    # the answer was written in pieces, each once the connection took the one before
    assert st.state.peak_unsent <= HIGH_WATER + SEND_PIECE_BYTES + 1024, st.state.peak_unsent
    s.close()


def test_a_slow_but_steady_reader_is_not_cut_off(stack) -> None:
    st = stack(SEND_LIMITS, rpm=100)
    st.engine.state.stream_chunks = [_event("y" * EVENT_TEXT)] * 16 + [b"data: [DONE]\n\n"]  # ~130 KB
    s = _answer_socket(st, rcvbuf=4096)
    s.sendall(_request(chat(max_tokens=3000, stream=True)))
    s.settimeout(0.05)
    out = b""
    t0 = time.monotonic()
    while not out.endswith(b"0\r\n\r\n") and time.monotonic() - t0 < 30:
        time.sleep(0.2)  # a few KB every 0.2 s: the send timeout of 1 s passes many times meanwhile
        got = b""
        while len(got) < 6000:
            try:
                piece = s.recv(6000 - len(got))
            except TimeoutError:
                break
            if not piece:
                break
            got += piece
        out += got
    s.close()
    assert out.startswith(b"HTTP/1.1 200 OK") and out.endswith(b"0\r\n\r\n"), out[-200:]
    assert out.count(b"y" * EVENT_TEXT) == 16
    assert st.state.write_pauses > 0  # the answer did wait for the client, often
    assert st.state.send_timeouts == 0
    assert time.monotonic() - t0 > 2 * SEND_LIMITS.send_timeout_seconds
