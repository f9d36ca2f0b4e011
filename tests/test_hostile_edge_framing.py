"""The server layer (gateway/edge/protocol.py) under a hostile client, on framing: pipelined
requests whose refusal must not be read as the answer to the request before them, trailer fields,
bodies the app answers without reading, ``Expect: 100-continue`` from HTTP/1.0, the Host rule, and
the smuggling vectors httptools must refuse. Real sockets against the gateway app, exact bytes."""

from __future__ import annotations

import json
import re
import socket
import time

import pytest

from tests.gateway_harness import KEY_A, chat
from tests.mock_engine import gateway_id
from tests.test_hostile_edge import NOT_HTTP, TOO_LARGE, chunks, mock_gateway_edge, read_all, refusal, undated

pytestmark = pytest.mark.timeout(60)

AUTH = f"authorization: Bearer {KEY_A}\r\n".encode()
MOCK_ANSWER = {
    "id": "c1",
    "object": "chat.completion",
    "created": 1,
    "model": "m",
    "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "Hello from the mock."}, "finish_reason": "stop"}
    ],
    "usage": {"prompt_tokens": 7, "completion_tokens": 4, "total_tokens": 11},
}
BODY_TIMEOUT = refusal(408, "Request Timeout", "The request body did not arrive within 0.6 seconds.", "request_timeout")


@pytest.fixture(scope="module")
def served():
    with mock_gateway_edge() as srv:
        yield srv


def _ready(srv) -> bool:
    s = srv.connect()
    s.sendall(b"GET /readyz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
    return read_all(s).startswith(b"HTTP/1.1 200 ")


@pytest.fixture
def edge(served):
    """The module's gateway, its live pool read: on a loaded machine one pool read can outlast its
    timeout, and an unread pool is a 503 ``pool_size_unknown`` (by design), not what these tests test."""
    st = served.engine.state
    deadline = time.monotonic() + 15
    while not _ready(served) and time.monotonic() < deadline:
        time.sleep(0.1)
    yield served
    st.mode, st.delay_seconds, st.chunk_interval_seconds, st.text = "ok", 0.0, 0.0, "Hello from the mock."


def post(body: dict, extra: bytes = b"") -> bytes:
    data = json.dumps(body).encode()
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n" + AUTH + b"content-type: application/json\r\n"
        b"content-length: %d\r\n" % len(data) + extra + b"\r\n" + data
    )


def split_response(data: bytes) -> tuple[bytes, dict[bytes, bytes], bytes, bytes]:
    """The first response in ``data``: (status line, headers (lowercased names, each once), body
    (de-chunked), the bytes after it)."""
    head, sep, rest = data.partition(b"\r\n\r\n")
    assert sep, data[:300]
    status, *lines = head.split(b"\r\n")
    headers: dict[bytes, bytes] = {}
    for line in lines:
        name, _, value = line.partition(b": ")
        assert name.lower() not in headers, head
        headers[name.lower()] = value
    if b"content-length" in headers:
        n = int(headers[b"content-length"])
        assert len(rest) >= n, data[:300]
        return status, headers, rest[:n], rest[n:]
    assert headers.get(b"transfer-encoding") == b"chunked", head
    body = b""
    while True:
        size_line, _, rest = rest.partition(b"\r\n")
        n = int(size_line, 16)
        if n == 0:
            assert rest.startswith(b"\r\n"), rest[:50]
            return status, headers, body, rest[2:]
        body, rest = body + rest[:n], rest[n:]
        assert rest.startswith(b"\r\n")
        rest = rest[2:]


def assert_mock_answer(status: bytes, headers: dict[bytes, bytes], body: bytes) -> None:
    assert status == b"HTTP/1.1 200 OK"
    assert headers[b"content-type"] == b"application/json"
    assert b"connection" not in headers
    assert json.loads(body) == MOCK_ANSWER


# ---------------------------------------------------------------- pipelined refusals
def test_a_pipelined_body_that_stalls_is_refused_after_the_answer_before_it(edge):
    """Two requests in one write; the second's body stops halfway while the first waits 1 s on
    the engine. The first gets its 200, then the second its 408 (its deadline runs from its own
    start), then the end. The 408 used to go out after 0.6 s as the answer to the first request,
    whose engine request ran on unanswered."""
    edge.engine.state.mode, edge.engine.state.delay_seconds = "delay", 1.0
    before = len(edge.engine.state.requests)
    s = edge.connect()
    stalled = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n" + AUTH + b"content-length: 100\r\n\r\n" + b'{"model"'
    s.sendall(post(chat(max_tokens=4)) + stalled)
    status, headers, body, rest = split_response(read_all(s))
    assert_mock_answer(status, headers, body)
    assert undated(rest) == BODY_TIMEOUT
    assert len(edge.engine.state.requests) == before + 1
    s.close()


def test_a_refusal_never_lands_inside_a_streamed_answer_before_it(edge, caplog):
    """The first request streams for about a second; the pipelined second sends 70 one-byte
    chunks (413 at the 66th). The stream ends whole, then the 413, then the end of the stream.
    The 413 used to be written into the middle of the chunked stream at once, and the stream's
    next write raised ``Cannot call write() after write_eof()`` (logged tracebacks)."""
    edge.engine.state.chunk_interval_seconds, edge.engine.state.text = 0.1, "a b c d e f g h"
    s = edge.connect()
    second = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n" + AUTH + b"transfer-encoding: chunked\r\n\r\n"
    ) + chunks(b"x" * 70, 1)
    s.sendall(post(chat(max_tokens=40, stream=True)) + second)
    status, headers, body, rest = split_response(read_all(s))
    assert status == b"HTTP/1.1 200 OK" and headers[b"content-type"] == b"text/event-stream; charset=utf-8"
    events = [e for e in body.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    text = "".join(
        (json.loads(e[6:])["choices"][0]["delta"].get("content") or "") for e in events[:-1] if e.startswith(b"data: {")
    )
    assert text == "a b c d e f g h"
    assert undated(rest) == refusal(
        413,
        "Content Too Large",
        "The request body's chunks average under 256 bytes; send larger chunks or a Content-Length body.",
        "request_too_large",
    )
    assert "write_eof" not in caplog.text and "unhandled error" not in caplog.text
    s.close()


def test_a_pipelined_head_too_large_is_answered_after_the_request_before_it(edge):
    """The second request's head is over ``max_header_bytes`` while the first waits 0.5 s on the
    engine: the first gets its 200, then the 431, then the end. The 431 used to be the first
    request's answer (and the first request was cancelled)."""
    edge.engine.state.mode, edge.engine.state.delay_seconds = "delay", 0.5
    s = edge.connect()
    s.sendall(post(chat(max_tokens=4)) + b"GET /healthz HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 9000 + b"\r\n\r\n")
    status, headers, body, rest = split_response(read_all(s))
    assert_mock_answer(status, headers, body)
    assert undated(rest) == TOO_LARGE
    s.close()


def test_bytes_that_are_not_http_after_a_request_are_refused_after_its_answer(edge):
    edge.engine.state.mode, edge.engine.state.delay_seconds = "delay", 0.5
    s = edge.connect()
    s.sendall(post(chat(max_tokens=4)) + b"NOT HTTP AT ALL\r\n\r\n")
    status, headers, body, rest = split_response(read_all(s))
    assert_mock_answer(status, headers, body)
    assert undated(rest) == NOT_HTTP
    s.close()


# ---------------------------------------------------------------- trailers, unread bodies
def test_trailer_fields_are_not_taken_as_request_headers(edge):
    """A chunked body's trailer section carries ``authorization`` and ``x-request-id``: neither
    is merged into the request's headers (RFC 9110 section 6.5.1). They were: the request got
    401 "this request has 2" (and a trailer ``x-request-id`` became the request's id), fields a
    proxy in front never saw in the head."""
    data = json.dumps(chat(max_tokens=4)).encode()
    s = edge.connect()
    s.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n" + AUTH + b"content-type: application/json\r\n"
        b"transfer-encoding: chunked\r\nconnection: close\r\n\r\n"
        + chunks(data, 4096)
        + b"0\r\nauthorization: Bearer sk-someone-else\r\nx-request-id: from-the-trailer\r\n\r\n"
    )
    status, headers, body, rest = split_response(read_all(s))
    assert (status, json.loads(body), rest) == (b"HTTP/1.1 200 OK", MOCK_ANSWER, b"")
    assert re.fullmatch(rb"[0-9a-f]{32}", headers[b"x-request-id"]), headers
    sent = edge.engine.state.requests[-1]["headers"]["x-request-id"]  # the gateway's own id for the engine
    assert gateway_id(sent, headers[b"x-request-id"].decode()) != "from-the-trailer"


def test_a_body_the_app_answers_without_reading_closes_the_connection(edge):
    """``POST /healthz`` with a tenant's key and a 1 MB body, its head alone sent: the 405 says
    ``connection: close`` and, once the client has sent its end, the connection closes. It used
    to be kept alive and the body read on past ``max_body_bytes``, unpaced (a 100 MB body was
    read whole within 0.1 s)."""
    s = edge.connect()
    s.sendall(b"POST /healthz HTTP/1.1\r\nhost: x\r\n" + AUTH + b"content-length: 1000000\r\n\r\n" + b"a" * 1000)
    body = json.dumps(
        {
            "error": {
                "message": "Method POST is not allowed for /healthz.",
                "type": "invalid_request_error",
                "param": None,
                "code": "method_not_allowed",
            }
        },
        separators=(",", ":"),
    ).encode()
    want = (
        b"HTTP/1.1 405 Method Not Allowed\r\nallow: GET, HEAD\r\ncontent-length: %d\r\n"
        b"content-type: application/json\r\nconnection: close\r\n\r\n" % len(body)
    ) + body
    got = b""
    s.settimeout(5)
    while len(got) < len(want) + 37:  # the date header: "date: " + 29 + "\r\n"
        got += s.recv(65536)
    s.shutdown(socket.SHUT_WR)
    t0 = time.monotonic()
    got = undated(got + read_all(s))
    assert time.monotonic() - t0 < 1.0
    assert got == want  # the methods in alphabetical order, in every process
    s.close()


# ---------------------------------------------------------------- Expect, Host
def test_expect_100_continue_from_http_1_0_is_ignored(edge):
    """RFC 9110 section 10.1.1: a 100-continue expectation in an HTTP/1.0 request is ignored
    (an HTTP/1.0 client does not know 1xx answers). It got ``HTTP/1.1 100 Continue``. HTTP/1.1
    gets it, then the 408 of a body that never came."""
    for version, interim in ((b"1.0", b""), (b"1.1", b"HTTP/1.1 100 Continue\r\n\r\n")):
        s = edge.connect()
        s.sendall(
            b"POST /v1/chat/completions HTTP/"
            + version
            + b"\r\nhost: x\r\n"
            + AUTH
            + b"content-type: application/json\r\n"
            b"content-length: 20\r\nexpect: 100-continue\r\n\r\n"
        )
        answer = read_all(s)
        assert answer.startswith(interim), answer[:100]
        assert undated(answer[len(interim) :]) == BODY_TIMEOUT
        s.close()


@pytest.mark.parametrize("hosts", [b"", b"host: a\r\nhost: b\r\n"], ids=["none", "two"])
def test_an_http_1_1_request_needs_one_host(edge, hosts):
    """RFC 9112 section 3.2: 400 for an HTTP/1.1 request without a Host header or with two (a
    proxy in front may route by one, the gateway see the other). Both were answered 200."""
    s = edge.connect()
    s.sendall(b"GET /healthz HTTP/1.1\r\n" + hosts + b"\r\n")
    n = hosts.count(b"host:")
    assert undated(read_all(s)) == refusal(
        400, "Bad Request", f"An HTTP/1.1 request needs one Host header; this one has {n}.", "invalid_request"
    )
    s.close()


@pytest.mark.parametrize(
    ("line", "version"),
    [
        (b"GET /healthz HTTP/2.0\r\nhost: x\r\n", "2.0"),
        (b"GET /healthz HTTP/0.9\r\n", "0.9"),
        (b"GET /healthz\r\n", "0.9"),  # HTTP/0.9's request line: no version
    ],
    ids=["2.0", "0.9", "no-version"],
)
def test_a_request_line_not_http_1_is_refused_with_505(edge, line, version):
    """RFC 9110 section 15.6.6: a request line naming HTTP/2.0, HTTP/0.9 or no version is not
    HTTP/1.x. Each was answered 200, as if it were HTTP/1.1."""
    s = edge.connect()
    s.sendall(line + b"\r\n")
    assert undated(read_all(s)) == refusal(
        505,
        "HTTP Version Not Supported",
        f"HTTP/{version} is not supported; send HTTP/1.1.",
        "http_version_not_supported",
    )
    s.close()


@pytest.mark.parametrize("extra", [b"", b"connection: keep-alive\r\n"], ids=["plain", "keep-alive"])
def test_an_http_1_0_request_without_host_is_answered_and_closed(edge, extra):
    """HTTP/1.0 needs no Host; its connection is closed after the answer, ``keep-alive`` or not."""
    s = edge.connect()
    s.sendall(b"GET /healthz HTTP/1.0\r\n" + extra + b"\r\n")
    assert undated(read_all(s)) == (
        b"HTTP/1.1 200 OK\r\ncontent-length: 15\r\ncontent-type: application/json\r\nconnection: close\r\n\r\n"
        b'{"status":"ok"}'
    )
    s.close()


def test_a_huge_request_id_is_replaced_not_echoed(edge):
    """A 7 KB ``x-request-id`` (within the 8 KiB ``max_header_bytes`` here) is neither echoed nor forwarded: the
    request gets an id of its own."""
    s = edge.connect()
    s.sendall(post(chat(max_tokens=4), b"x-request-id: " + b"r" * 7_000 + b"\r\nconnection: close\r\n"))
    status, headers, body, rest = split_response(read_all(s))
    assert (status, json.loads(body), rest) == (b"HTTP/1.1 200 OK", MOCK_ANSWER, b"")
    assert re.fullmatch(rb"[0-9a-f]{32}", headers[b"x-request-id"]), headers[b"x-request-id"][:100]
    gateway_id(edge.engine.state.requests[-1]["headers"]["x-request-id"], headers[b"x-request-id"].decode())


# ---------------------------------------------------------------- smuggling vectors httptools refuses
POST_HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n" + AUTH


@pytest.mark.parametrize(
    "raw",
    [
        POST_HEAD + b"transfer-encoding: chunked, identity\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
        POST_HEAD + b"transfer-encoding: identity\r\ncontent-length: 2\r\n\r\n{}",
        POST_HEAD + b"transfer-encoding: identity\r\n\r\n{}",
        POST_HEAD + b"transfer-encoding: chunked\r\ntransfer-encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
        POST_HEAD + b"content-length: 2, 2\r\n\r\n{}",
        POST_HEAD + b"content-length: +2\r\n\r\n{}",
        POST_HEAD + b"transfer-encoding: chunked\r\n\r\n10000000000000002\r\n{}\r\n0\r\n\r\n",
        POST_HEAD + b"transfer-encoding: chunked\r\n\r\n+2\r\n{}\r\n0\r\n\r\n",
        POST_HEAD + b"transfer-encoding: chunked\r\n\r\n2;a\n{}\r\n0\r\n\r\n",
        b"GET /healthz HTTP/1.1\nhost: x\n\n",
        b"GET /healthz HTTP/1.1\r\nhost: x\nx-a: 1\r\n\r\n",
        b"GET /healthz HTTP/1.1\r\nhost: x\r\nx-a: a\x00b\r\n\r\n",
        b"GET /healthz HTTP/1.1\r\nhost: x\r\nx-a: a\rb\r\n\r\n",
        b"POST /healthz HTTP/1.1\r\nhost: x\r\ncontent-length : 5\r\n\r\nhello",
        b"get /healthz HTTP/1.1\r\nhost: x\r\n\r\n",
        b"GET /healthz HTTP/1.2\r\nhost: x\r\n\r\n",
        b"CONNECT x:443 HTTP/1.1\r\nhost: x:443\r\n\r\n",
    ],
    ids=[
        "te-chunked-identity",
        "te-identity-and-length",
        "te-identity",
        "te-twice",
        "length-list",
        "length-plus",
        "chunk-size-overflow",
        "chunk-size-plus",
        "chunk-ext-bare-lf",
        "bare-lf",
        "bare-lf-in-head",
        "nul-in-value",
        "cr-in-value",
        "space-before-colon",
        "lowercase-method",
        "http-1.2",
        "connect",
    ],
)
def test_ambiguous_framing_is_refused_and_closed(edge, raw):
    before = len(edge.engine.state.requests)
    s = edge.connect()
    s.sendall(raw)
    assert undated(read_all(s)) == NOT_HTTP
    assert len(edge.engine.state.requests) == before
    s.close()


@pytest.mark.parametrize(
    "target, reported",
    [("//v1/chat/completions", "//v1/chat/completions"), ("/v1/chat/completions/..", "/v1/chat/completions/..")],
)
def test_paths_that_would_normalise_to_a_route_are_unknown(edge, target, reported):
    s = edge.connect()
    s.sendall(b"POST " + target.encode() + b" HTTP/1.1\r\nhost: x\r\n" + AUTH + b"content-length: 2\r\n\r\n{}")
    body = json.dumps(
        {
            "error": {
                "message": f"Unknown request URL: POST {reported}. Please check the URL.",
                "type": "invalid_request_error",
                "param": None,
                "code": "not_found",
            }
        },
        separators=(",", ":"),
    ).encode()
    got = b""
    s.settimeout(5)
    while not got.endswith(body):
        got += s.recv(65536)
    status, headers, got_body, rest = split_response(got)
    assert (status, got_body, rest) == (b"HTTP/1.1 404 Not Found", body, b"")
    s.close()
