"""The forward path against a hostile engine, round 4 (gateway/relay/sse.py, gateway/relay/h1_transport.py):
a stream that starts with a UTF-8 byte order mark, and an answer in a coding the gateway never asked
for. What the client reads is a well-formed stream or an OpenAI error, never bytes the gateway could
not read, and each lease settles once, to what was produced.

Engines are played in-process (the upstream client's ``MockTransport``: each chunk one read, so a
mark cut across reads is cut exactly there) or by raw asyncio servers on loopback (the gateway's own
HTTP/1.1 transport: tests/test_hostile_relay.py's harness)."""

from __future__ import annotations

import asyncio
import gzip
import json
from typing import Any

import httpx
import pytest
from openai._streaming import SSEDecoder

from gateway.relay.h1_transport import H1Transport
from gateway.relay.sse import SSESplitter
from gateway.relay.upstream_client import RemoteProtocolError
from tests.gateway_harness import MODEL, chat
from tests.test_gateway_pipeline import LedgerQuotas
from tests.test_gateway_relay import WITHHELD, _chunk, _event, error_of, guarded, post, streaming
from tests.test_hostile_relay import loopback_gateway
from tokenizer import bundled_counter

pytestmark = pytest.mark.timeout(30)

BOM = b"\xef\xbb\xbf"
DONE = b"data: [DONE]\n\n"
STREAM_BODY = chat(max_tokens=5, stream=True)
HEADERS = {"content-type": "application/json", "accept-encoding": "identity", "x-request-id": "rid-1"}
#: a stream without a usage chunk: the settle counts its text (11 prompt tokens + the text's)
TEXT = "Hello there, my good friend"
TEXT_TOKENS = bundled_counter().count_text(TEXT)  # the model's tokenizer, as the settle counts text
STREAM = _chunk(TEXT, False) + _chunk("", False, "stop") + DONE
ENGINE_FAILED = {
    "message": "The upstream engine failed (RemoteProtocolError).",
    "type": "server_error",
    "param": None,
    "code": "upstream_unavailable",
}


def sdk_events(stream: bytes) -> list[str]:
    """The ``data`` of each event the openai SDK reads in ``stream`` (its own decoder, fed one
    byte at a time): what a Python client of the gateway gets."""
    return [e.data for e in SSEDecoder().iter_bytes(stream[i : i + 1] for i in range(len(stream)))]


async def _serve(answer: bytes) -> tuple[asyncio.AbstractServer, int]:
    """A loopback engine that reads one request, writes ``answer`` and closes the connection."""

    async def on_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        size = next(
            int(v) for k, _, v in (h.partition(b":") for h in head.split(b"\r\n")) if k.lower() == b"content-length"
        )
        await reader.readexactly(size)
        writer.write(answer)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(on_conn, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


def through_gateway(answer: bytes, body: dict[str, Any]) -> tuple[httpx.Response, LedgerQuotas, list[int]]:
    """``body`` posted (request id ``r4``) to a gateway whose one engine answers ``answer`` on
    loopback: the response, the quota ledger, what is left in flight."""

    async def run() -> tuple[httpx.Response, LedgerQuotas, list[int]]:
        server, port = await _serve(answer)
        try:
            async with loopback_gateway(port, {"x-request-id": "r4"}) as (c, q, gw):
                r = await c.post("/v1/chat/completions", json=body)
                return r, q, [u.in_flight for u in gw.upstreams.all]
        finally:
            server.close()

    return asyncio.run(run())


# ---------------------------------------------------------------- a stream that starts with a byte order mark


def _cuts(stream: bytes) -> list[list[bytes]]:
    """``stream`` as one read, as a read per byte, and cut once at each of its first 8 bytes."""
    return [[stream], [stream[i : i + 1] for i in range(len(stream))]] + [[stream[:k], stream[k:]] for k in range(1, 8)]


def test_one_leading_bom_is_dropped_however_the_reads_cut_it():
    """WHATWG HTML, "Event stream interpretation": one U+FEFF at the start of the stream is
    ignored. The splitter returned it as the first event's first bytes, so the gateway read that
    event's first line as the field ``\\ufeffdata`` (no data: its text unread). Dropped, the events
    are those of the stream without it, wherever the reads cut the mark; a second mark, or one
    later in the stream, is kept (a client does not drop it either), and a stream that ends inside
    the mark leaves it as its unfinished tail."""
    events = [_chunk(TEXT, False), _chunk("", False, "stop"), DONE]
    for reads in _cuts(BOM + b"".join(events)):
        s = SSESplitter(1 << 20)
        got = [e for r in reads for e in s.feed(r)]
        assert (got, s.tail()) == (events, b""), reads[:3]
    for stream in (BOM + BOM + b"".join(events), events[0] + BOM + b"".join(events[1:])):
        s = SSESplitter(1 << 20)
        got = s.feed(stream[:2]) + s.feed(stream[2:])
        assert b"".join(got) == stream.removeprefix(BOM)
        assert got[0 if stream.startswith(BOM) else 1].startswith(BOM)
    s = SSESplitter(1 << 20)
    assert (s.feed(BOM[:1]), s.feed(BOM[1:2]), s.tail(), s.pending_bytes) == ([], [], BOM[:2], 2)
    s = SSESplitter(1 << 20)
    assert (s.feed(b"\xefdata: x\n\n"), s.tail()) == ([b"\xefdata: x\n\n"], b"")  # not a mark: kept


def test_a_stream_starting_with_a_bom_reaches_the_client_well_formed_and_its_text_is_charged():
    """An engine whose stream starts with a BOM (and sends no usage): the client got the mark, and
    the openai SDK (whose UTF-8 decoding keeps it) read the first line as the field
    ``\\ufeffdata`` and lost the first chunk, text and all; the gateway read no data in it either,
    so the settle charged the prompt (11) and none of its text. Now the client gets the stream
    without the mark, the SDK reads every chunk, and the text is charged."""
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n"
    r, q, in_flight = through_gateway(head + BOM + STREAM, STREAM_BODY)
    assert (r.status_code, r.content) == (200, STREAM)
    assert [json.loads(d)["choices"][0]["delta"]["content"] for d in sdk_events(r.content)[:2]] == [TEXT, ""]
    assert (q.settled, in_flight) == ({"r4": [11 + TEXT_TOKENS]}, [0])


def test_a_bom_cut_across_reads_does_not_hide_the_first_event_from_the_guard():
    """The mark cut across three reads, then an event with the guarded word: the gateway read the
    event as no data, so a strict guard never saw "the secret" and the client got it under a 200.
    The guard now reads it: the response is withheld (502), as without the mark."""
    reads = [BOM[:1], BOM[1:2], BOM[2:] + _chunk("the secret", False), _chunk("", False, "stop"), DONE]
    r = guarded(reads, STREAM_BODY)
    assert (r.status_code, error_of(r)) == (502, WITHHELD)


def test_a_responses_stream_starting_with_a_bom_is_relayed_without_it():
    """The same mark before a ``/v1/responses`` stream (same splitter): the client got it, and
    the openai SDK lost ``response.created``."""
    events = [
        _event("response.created", 0, response={"id": "r1", "status": "in_progress", "output": []}),
        _event("response.output_text.delta", 1, output_index=0, content_index=0, delta="Hel"),
        _event("response.completed", 2, response={"id": "r1", "status": "completed", "output": []}),
    ]
    body = {"model": MODEL, "input": "Say hello.", "stream": True, "max_output_tokens": 5}
    r, _ = post(streaming([BOM + events[0][:5], events[0][5:]] + events[1:]), body, path="/v1/responses")
    assert (r.status_code, r.content) == (200, b"".join(events))
    assert [json.loads(d)["type"] for d in sdk_events(r.content)] == [
        "response.created",
        "response.output_text.delta",
        "response.completed",
    ]


# ---------------------------------------------------------------- a transfer coding the gateway never accepted


def _te(codings: bytes, body: bytes, ctype: bytes = b"text/event-stream") -> bytes:
    """An answer whose ``Transfer-Encoding`` is ``codings``, its body ``body`` (chunk-framed when
    the codings end in chunked, else framed by the close)."""
    head = b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ntransfer-encoding: %s\r\n\r\n" % (ctype, codings)
    if codings.lower().replace(b" ", b"").endswith((b"chunked", b"chunked,", b"chunked;x=1")):
        return head + b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    return head + body


@pytest.mark.parametrize(
    ("codings", "body", "named"),
    [
        (b"gzip, chunked", gzip.compress(STREAM), "gzip, chunked"),
        (b"GZIP,chunked", gzip.compress(STREAM), "GZIP,chunked"),
        (b"chunked, gzip", STREAM, "chunked, gzip"),
        (b"gzip", STREAM, "gzip"),
        (b"identity", STREAM, "identity"),
        (b"x-unknown, chunked", STREAM, "x-unknown, chunked"),
        (b"chunked, chunked", STREAM, "chunked, chunked"),
        (b"chunked\r\ntransfer-encoding: chunked", STREAM, "chunked, chunked"),
        (b"chunked,", STREAM, "chunked,"),
        (b", chunked", STREAM, ", chunked"),
        (b"chunked;x=1", STREAM, "chunked;x=1"),
    ],
    ids=[
        "gzip-chunked",
        "gzip-chunked-case",
        "chunked-gzip",
        "gzip-alone",
        "identity",
        "unknown",
        "chunked-twice",
        "chunked-in-two-fields",
        "trailing-empty-element",
        "leading-empty-element",
        "with-a-parameter",
    ],
)
async def test_a_transfer_coding_other_than_chunked_is_a_protocol_error(codings, body, named):
    """RFC 9110 10.1.4 and RFC 9112 7.4: a request's ``TE`` names the transfer codings, besides
    chunked, the client accepts; the gateway sends none. ``gzip, chunked`` was de-chunked and its
    gzip bytes handed on as the body (the relay read them as an event stream); ``chunked, gzip``,
    ``gzip`` and ``identity`` were read as plain bytes until the close. The transport now refuses
    the answer before its body, naming the codings, and keeps no connection."""

    async def engine(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await reader.readexactly(2)
        writer.write(_te(codings, body))
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(engine, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/chat/completions"
    t = H1Transport(connect_timeout=1.0, read_timeout=2.0, max_connections=4)
    try:
        with pytest.raises(RemoteProtocolError) as e:
            r = await t.send("POST", url, b"{}", HEADERS, None)
            await r.aread()
        assert str(e.value) == f"RemoteProtocolError: the engine answered Transfer-Encoding {named!r}"
        assert t._open == 0 and not t._idle.get(("http", "127.0.0.1", server.sockets[0].getsockname()[1]))
    finally:
        await t.aclose()
        server.close()


async def test_chunked_alone_in_any_case_is_still_read():
    """The check refuses codings, not spellings: ``CHUNKED`` and `` Chunked `` name chunked alone
    (RFC 9112 7: coding names are case-insensitive; whitespace around a list element is not part
    of it) and the body comes back as sent."""
    for codings in (b"CHUNKED", b" Chunked "):

        async def engine(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, codings: bytes = codings) -> None:
            await reader.readuntil(b"\r\n\r\n")
            await reader.readexactly(2)
            writer.write(_te(codings, STREAM))
            await writer.drain()

        server = await asyncio.start_server(engine, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/chat/completions"
        t = H1Transport(connect_timeout=1.0, read_timeout=2.0, max_connections=4)
        try:
            r = await t.send("POST", url, b"{}", HEADERS, None)
            assert (r.status_code, await r.aread()) == (200, STREAM), codings
            await r.aclose()
        finally:
            await t.aclose()
            server.close()


@pytest.mark.parametrize(
    ("answer", "body"),
    [
        (_te(b"gzip, chunked", gzip.compress(STREAM)), STREAM_BODY),
        (_te(b"gzip, chunked", STREAM), STREAM_BODY),
        (_te(b"chunked, gzip", STREAM), STREAM_BODY),
        (
            _te(
                b"gzip, chunked",
                gzip.compress(b'{"choices":[{"index":0,"message":{"content":"hi"},"finish_reason":"stop"}]}'),
                b"application/json",
            ),
            chat(max_tokens=5),
        ),
    ],
    ids=["gzip-stream", "labelled-gzip-plain-stream", "chunked-gzip-stream", "gzip-whole-answer"],
)
def test_through_the_gateway_a_transfer_coded_answer_is_a_502_charged_its_prompt(answer, body):
    """Through the gateway: the gzip stream was a 502 that blamed the event stream ("ended before
    any event could be read"), and an answer labelled gzip whose bytes happened to read as events
    was relayed as a 200, as if the coding the engine named were not there. Now each is the
    transport's 502 before any byte reaches the client; the lease settles once, to the prompt
    (the request reached the engine), and nothing is left in flight."""
    r, q, in_flight = through_gateway(answer, body)
    assert (r.status_code, error_of(r)) == (502, ENGINE_FAILED)
    assert (q.settled, in_flight) == ({"r4": [11]}, [0])


# ---------------------------------------------------------------- a content coding the gateway never accepted

CE_GZIP = {
    "message": "The upstream engine answered with Content-Encoding 'gzip', which the gateway does not accept.",
    "type": "server_error",
    "param": None,
    "code": "upstream_unavailable",
}


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_a_content_coding_the_gateway_did_not_accept_is_a_502_naming_it(stream):
    """The gateway sends ``Accept-Encoding: identity``; an engine answering
    ``Content-Encoding: gzip`` anyway got a 502 that blamed the event stream or the JSON, and an
    error status's gzip body was quoted, bytes and all, as the client's error message."""
    payload = STREAM if stream else b'{"choices":[{"index":0,"message":{"content":"hi"},"finish_reason":"stop"}]}'
    ctype = b"text/event-stream" if stream else b"application/json"
    coded = gzip.compress(payload)
    answer = b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ncontent-encoding: gzip\r\ncontent-length: %d\r\n\r\n%s" % (
        ctype,
        len(coded),
        coded,
    )
    r, q, in_flight = through_gateway(answer, chat(max_tokens=5, stream=stream))
    assert (r.status_code, error_of(r)) == (502, CE_GZIP)
    assert (q.settled, in_flight) == ({"r4": [11]}, [0])
    error = gzip.compress(b'{"error":{"message":"overloaded"}}')
    answer = (
        b"HTTP/1.1 503 Busy\r\ncontent-type: application/json\r\ncontent-encoding: gzip\r\ncontent-length: %d\r\n\r\n%s"
    )
    r, _, _ = through_gateway(answer % (len(error), error), chat(max_tokens=5, stream=stream))
    assert (r.status_code, error_of(r)["message"]) == (503, "The upstream engine answered 503.")
