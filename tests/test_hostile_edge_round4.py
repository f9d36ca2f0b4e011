"""The server layer (gateway/edge/protocol.py) under a hostile client, round four: an ``Upgrade``
request whose body httptools skips (and would then parse as the next request), bytes of a chunked
body that end no chunk (an endless chunk extension, chunk-size line or trailer field), an
HTTP/1.0 request with ``Transfer-Encoding``, transfer codings other than chunked, and a ``Host``
that is not a host. Real sockets against the gateway app, exact bytes (RFC 9112, RFC 9110)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from collections.abc import Iterator

import pytest

from tests.gateway_harness import KEY_A, Gateway, chat, settings_for, tenants, upstream
from tests.mock_engine import MockEngine
from tests.test_hostile_edge import LIMITS, NOT_HTTP, EdgeServer, read_all, refusal, undated

pytestmark = pytest.mark.timeout(60)

AUTH = f"authorization: Bearer {KEY_A}\r\n".encode()
BODY = json.dumps(chat(max_tokens=4)).encode()
MAX_BODY = 65_536
HEALTHZ = b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n"
OK_CLOSE = (
    b"HTTP/1.1 200 OK\r\ncontent-length: 15\r\ncontent-type: application/json\r\nconnection: close\r\n\r\n"
    b'{"status":"ok"}'
)


@contextlib.contextmanager
def small_body_edge() -> Iterator[EdgeServer]:
    """The gateway over a :class:`MockEngine` (``srv.engine``), its edge with ``max_body_bytes`` 64 KiB."""
    engine = MockEngine().start()
    gw = Gateway(settings_for([upstream("u1", engine)], gateway={"max_body_bytes": MAX_BODY}), tenants())
    try:
        with EdgeServer(gw.app, dataclasses.replace(LIMITS, max_body_bytes=MAX_BODY)) as srv:
            srv.engine = engine
            yield srv
    finally:
        engine.stop()


@pytest.fixture(scope="module")
def edge():
    with small_body_edge() as srv:
        yield srv


def head(extra: bytes, target: bytes = b"/v1/chat/completions", version: bytes = b"1.1") -> bytes:
    return b"POST " + target + b" HTTP/" + version + b"\r\nhost: x\r\n" + AUTH + extra + b"\r\n"


# ---------------------------------------------------------------- Upgrade with a body
UPGRADE_REFUSED = refusal(
    400,
    "Bad Request",
    "The gateway upgrades to no other protocol, and a request with an Upgrade header cannot have a body; "
    "send it without Upgrade.",
    "invalid_request",
)


@pytest.mark.parametrize(
    "upgrade",
    [
        b"connection: upgrade\r\nupgrade: h2c\r\nhttp2-settings: AAMAAABkAARAAAAAAAIAAAAA\r\n",
        b"connection: upgrade\r\nupgrade: websocket\r\n",
    ],
    ids=["h2c", "websocket"],
)
def test_an_upgrade_request_with_a_body_is_refused_not_smuggled(edge, upgrade):
    """A ``POST`` with ``Connection: upgrade``, ``Upgrade`` and a 34-byte ``Content-Length`` body
    that reads as a request (``GET /healthz``), the body sent after the head. httptools skips the
    body of an upgrade request (it takes what follows for the new protocol), and the gateway does
    not upgrade: the app saw an empty body (400 "The request body is empty"), and the body's bytes
    were then parsed as a second request and answered (200): a request a proxy in front sent as
    a body, smuggled (RFC 9112 section 6.3: the body is Content-Length bytes; RFC 9110 section 7.8:
    a server that does not upgrade goes on with HTTP/1.1, body included). Now a 400 and the close,
    and nothing reaches the engine."""
    before = len(edge.engine.state.requests)
    s = edge.connect()
    s.sendall(head(upgrade + b"content-length: %d\r\n" % len(HEALTHZ)))
    time.sleep(0.1)  # the head is read on its own
    with contextlib.suppress(OSError):
        s.sendall(HEALTHZ)
    assert undated(read_all(s)) == UPGRADE_REFUSED
    assert len(edge.engine.state.requests) == before
    s.close()


def test_an_upgrade_request_with_a_chunked_body_is_refused(edge):
    s = edge.connect()
    s.sendall(
        head(b"connection: upgrade\r\nupgrade: websocket\r\ntransfer-encoding: chunked\r\n")
        + b"%x\r\n" % len(BODY)
        + BODY
        + b"\r\n0\r\n\r\n"
    )
    assert undated(read_all(s)) == UPGRADE_REFUSED
    s.close()


def test_an_upgrade_request_without_a_body_is_answered_then_the_connection_closes(edge):
    """``GET /healthz`` with ``Upgrade: h2c`` and no body: answered as HTTP/1.1, with
    ``connection: close``, and a request sent after it on the connection is not parsed. httptools
    stops at an upgrade: bytes in the same read were dropped while a later read was parsed as the
    next request, so what was answered depended on how the client's bytes were split."""
    s = edge.connect()
    s.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\nconnection: upgrade\r\nupgrade: h2c\r\n\r\n")
    time.sleep(0.1)
    with contextlib.suppress(OSError):
        s.sendall(HEALTHZ)
    assert undated(read_all(s)) == OK_CLOSE
    s.close()


# ---------------------------------------------------------------- chunk bytes that end no chunk
TOO_LARGE_CHUNKED = refusal(
    413,
    "Content Too Large",
    f"The request body is larger than {MAX_BODY} bytes (chunk framing included).",
    "request_too_large",
)


@pytest.mark.parametrize(
    "prefix",
    [b"2;a=", b"0", b"%x\r\n" % len(BODY) + BODY + b"\r\n0\r\nx-trailer: "],
    ids=["chunk-extension", "chunk-size-zeros", "trailer-field"],
)
def test_chunk_bytes_that_never_end_a_chunk_count_against_the_body_limit(edge, prefix):
    """A chunked body whose bytes end no chunk-size line or trailer field (an endless chunk
    extension, a size of endless zeros, an endless trailer value), sent after the head: 413 once
    past ``max_body_bytes``, while they arrive. The limit was checked only when a chunk-size line
    ended: 8 MiB of such bytes were all read and parsed until the body timeout (408 here after
    0.6 s; a client sent 360 MB in 3 s, and at the default 30 s timeout gigabytes per
    connection, none of it paced by the large-body budget). RFC 9112 section 7.1.1: a server
    limits chunk extensions as it limits other parts of a message and answers a 4xx."""
    fill = b"a" if prefix != b"0" else b"0"
    s = edge.connect()
    s.sendall(head(b"transfer-encoding: chunked\r\n") + prefix)
    time.sleep(0.1)  # the head and the prefix are read on their own: the rest ends no chunk-size line
    t0 = time.monotonic()
    with contextlib.suppress(OSError):
        s.sendall(fill * (2 * MAX_BODY))
    assert undated(read_all(s)) == TOO_LARGE_CHUNKED
    assert time.monotonic() - t0 < 0.5  # before the 0.6 s body timeout
    s.close()


# ---------------------------------------------------------------- transfer codings
def test_an_http_1_0_request_with_transfer_encoding_is_refused(edge):
    """RFC 9112 section 6.1: an HTTP/1.0 message with Transfer-Encoding is treated as if its
    framing were faulty (an HTTP/1.0 proxy in front reads its body to the end of the connection).
    It was read as chunked and answered 200."""
    before = len(edge.engine.state.requests)
    s = edge.connect()
    s.sendall(head(b"transfer-encoding: chunked\r\n", version=b"1.0") + b"%x\r\n" % len(BODY) + BODY + b"\r\n0\r\n\r\n")
    assert undated(read_all(s)) == refusal(
        400,
        "Bad Request",
        "An HTTP/1.0 request cannot use Transfer-Encoding; send a Content-Length.",
        "invalid_request",
    )
    assert len(edge.engine.state.requests) == before
    s.close()


@pytest.mark.parametrize(
    ("te", "codings"),
    [
        (b"transfer-encoding: gzip, chunked\r\n", "gzip, chunked"),
        (b"transfer-encoding: gzip\r\ntransfer-encoding: chunked\r\n", "gzip, chunked"),
        (b"transfer-encoding: x-custom ,  chunked\r\n", "x-custom, chunked"),
    ],
    ids=["one-line", "two-lines", "unknown"],
)
def test_a_transfer_coding_other_than_chunked_gets_501(edge, te, codings):
    """RFC 9112 section 6.1: a server that receives a transfer coding it does not understand
    SHOULD answer 501. ``gzip, chunked`` (in one field or two) was read as plain chunked, the gzip
    ignored, and the request forwarded: a proxy in front that decodes it sees another body."""
    before = len(edge.engine.state.requests)
    s = edge.connect()
    s.sendall(head(te) + b"%x\r\n" % len(BODY) + BODY + b"\r\n0\r\n\r\n")
    assert undated(read_all(s)) == refusal(
        501,
        "Not Implemented",
        f"Transfer-Encoding {codings} is not supported; send the body chunked alone or with a Content-Length.",
        "not_implemented",
    )
    assert len(edge.engine.state.requests) == before
    s.close()


@pytest.mark.parametrize("te", [b"CHUNKED", b" chunked ", b", chunked"], ids=["case", "ows", "lead"])
def test_chunked_alone_in_any_spelling_rfc_9110_allows_is_read(edge, te):
    """Transfer codings are case-insensitive and a list may hold empty elements (RFC 9110 sections
    10.1.4, 5.6.1): each of these is chunked alone, read as such."""
    s = edge.connect()
    s.sendall(
        head(b"transfer-encoding: " + te + b"\r\nconnection: close\r\n")
        + b"%x\r\n" % len(BODY)
        + BODY
        + b"\r\n0\r\n\r\n"
    )
    assert read_all(s).startswith(b"HTTP/1.1 200 OK\r\n")
    s.close()


# ---------------------------------------------------------------- Host
@pytest.mark.parametrize("host", [b"a b", b"a/b", b"user@a", b"a:b", b"a:80:80", b"[::1", b"a\\b"])
def test_a_host_that_is_not_a_host_is_refused(edge, host):
    """RFC 9112 section 3.2: a server MUST answer 400 to a Host field with an invalid value. Each
    was answered 200."""
    s = edge.connect()
    s.sendall(b"GET /healthz HTTP/1.1\r\nhost: " + host + b"\r\n\r\n")
    assert undated(read_all(s)) == refusal(
        400, "Bad Request", "The Host header is not a valid host.", "invalid_request"
    )
    s.close()


@pytest.mark.parametrize("host", [b"", b"x", b"x:8080", b"127.0.0.1:1", b"[::1]:8080", b"my_gw.internal", b"x:"])
def test_a_valid_host_is_served(edge, host):
    """An empty Host (RFC 9110 section 7.2: a target without an authority), names, addresses and ports."""
    s = edge.connect()
    s.sendall(b"GET /healthz HTTP/1.1\r\nhost: " + host + b"\r\nconnection: close\r\n\r\n")
    assert undated(read_all(s)) == OK_CLOSE
    s.close()


def test_bytes_httptools_refuses_still_get_the_400(edge):
    """The checks above run on what httptools parsed; what it refuses is its 400, as before."""
    s = edge.connect()
    s.sendall(head(b"transfer-encoding: chunked, identity\r\n") + b"2\r\n{}\r\n0\r\n\r\n")
    assert undated(read_all(s)) == NOT_HTTP
    s.close()
