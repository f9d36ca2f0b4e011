"""The forward path against a hostile engine, round 4 (gateway/relay/sse.py, gateway/relay/h1_transport.py,
gateway/relay/stream.py, gateway/relay/finish.py, gateway/relay/proxy.py): a stream that starts with a
UTF-8 byte order mark, an answer in a coding the gateway never asked for, an event whose JSON only a
client's laxer reader reads, usage reported twice or below the text streamed, and a transport failure
the log did not explain. What the client reads is a well-formed stream or an OpenAI error, never
bytes the gateway could not read, and each lease settles once, to what was produced.

Engines are played in-process (the upstream client's ``MockTransport``: each chunk one read, so a
mark cut across reads is cut exactly there) or by raw asyncio servers on loopback (the gateway's own
HTTP/1.1 transport: tests/test_hostile_relay.py's harness)."""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
from typing import Any

import httpx
import pytest
from openai._streaming import SSEDecoder

from gateway.app import create_app
from gateway.relay.h1_transport import H1Transport
from gateway.relay.sse import SSESplitter
from gateway.relay.upstream_client import MockTransport, RemoteProtocolError, UpstreamClient
from tests.gateway_harness import KEY_A, MODEL, SECRETS, chat, settings_for, tenants
from tests.test_gateway_pipeline import LedgerQuotas
from tests.test_gateway_relay import (
    WITHHELD,
    GuardingVerifier,
    _chunk,
    _event,
    error_of,
    guarded,
    post,
    static_upstream,
    streaming,
)
from tests.test_hostile_relay import post_to_loopback_engine
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


def through_gateway(answer: bytes, body: dict[str, Any]) -> tuple[httpx.Response, LedgerQuotas, list[int]]:
    """``body`` posted (request id ``r4``) to a gateway whose one engine answers ``answer`` on
    loopback: the response, the quota ledger, what is left in flight."""
    return post_to_loopback_engine(answer, body, "r4")


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


# ---------------------------------------------------------------- JSON only a lenient reader reads

#: the 502 that ends a stream holding an event whose JSON only a lenient reader reads
LENIENT = {
    "message": (
        "The upstream engine sent a stream event whose JSON the gateway does not read (a lone surrogate, "
        "NaN or Infinity, a number out of range, invalid UTF-8 or nesting too deep), which it does not relay."
    ),
    "type": "server_error",
    "param": None,
    "code": "upstream_unavailable",
}
#: the 502 that ends a stream holding an event whose data no JSON reader takes
NOT_JSON = {
    "message": (
        "The upstream engine sent a stream event whose data is not JSON (plain text, a cut object "
        "or an object followed by text), which the gateway does not relay."
    ),
    "type": "server_error",
    "param": None,
    "code": "upstream_unavailable",
}
HELLO = _chunk("Hello ", False)
HELLO_TOKENS = bundled_counter().count_text("Hello ")
CLOSE_FRAMED = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n"


def error_event(error: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps({"error": error}, separators=(",", ":")).encode() + b"\n\n"


def _with_member(event: bytes, value: bytes) -> bytes:
    """``event`` (one ``data:`` line of a JSON object) with the member ``"x": value`` added last."""
    assert event.endswith(b"}\n\n")
    return event[:-3] + b', "x": ' + value + b"}\n\n"


#: members orjson refuses and a client's JSON reader takes: Python's ``json`` (the openai SDK)
#: reads the first four; a browser's ``JSON.parse`` (after its UTF-8 decoding, which replaces an
#: invalid byte) reads the lone surrogate, the out-of-range numbers, the invalid byte and the depth
LENIENT_MEMBERS = {
    "lone-surrogate": b'"\\ud800"',
    "out-of-range": b"1e999",
    "nan": b"NaN",
    "minus-infinity": b"-Infinity",
    "invalid-utf8": b'"\xff"',
    "too-deep": b"[" * 1100 + b"]" * 1100,
    "long-integer": b"1" + b"0" * 5000,
}
SDK_READS = ("lone-surrogate", "out-of-range", "nan", "minus-infinity")


def through_gateway_as(
    reads: list[bytes],
    body: dict[str, Any],
    *,
    strict: bool,
    path: str = "/v1/chat/completions",
    ctype: str = "text/event-stream",
) -> tuple[httpx.Response, LedgerQuotas, list[int]]:
    """``body`` posted (request id ``r4``) by tenant a, with strict verification (``strict``: its
    guard the miniature strict guard that refuses "secret", tests/test_gateway_relay.py) or
    without, to the whole app whose engine answers 200 with ``reads`` (one read each: the
    upstream client's ``MockTransport``); the response, the quota ledger, what is left in flight."""

    async def run() -> tuple[httpx.Response, LedgerQuotas, list[int]]:
        q = LedgerQuotas()
        app = create_app(
            settings_for([static_upstream()]),
            tenants(strict_verify=True) if strict else tenants(),
            secrets=SECRETS,
            quotas=q,
            verifier=GuardingVerifier("secret") if strict else None,
        )
        gw = app.state.gateway
        gw.forwarder = UpstreamClient(transport=MockTransport(streaming(reads, headers={"content-type": ctype})))
        await gw.start()
        try:
            async with httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app),
                base_url="http://gateway.test",
                headers={"authorization": f"Bearer {KEY_A}", "x-request-id": "r4"},
            ) as c:
                r = await c.post(path, json=body)
                return r, q, [u.in_flight for u in gw.upstreams.all]
        finally:
            await gw.stop()

    return asyncio.run(run())


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "not-strict"])
@pytest.mark.parametrize("member", list(LENIENT_MEMBERS), ids=list(LENIENT_MEMBERS))
def test_a_chunk_only_a_lenient_json_reader_reads_ends_the_stream(member, strict):
    """A chunk carrying "the secret" and one more member orjson refuses (a lone surrogate escape,
    ``1e999``, ``NaN``, ``-Infinity``, an invalid UTF-8 byte, nesting past orjson's 1024 levels):
    the gateway read the event as no JSON, so a strict guard relayed it unchecked and the settle
    did not count its text, while the openai SDK (Python's ``json``) or a browser read the chunk
    and showed "the secret" under a 200. No honest engine writes such JSON (vLLM and SGLang
    serialise with pydantic or orjson), so the stream now ends there, for every tenant, as for a
    bare CR: an error event after the response started, a 502 before; the settle counts the
    prompt and the text relayed, and nothing is left in flight."""
    hidden = _with_member(_chunk("the secret", False), LENIENT_MEMBERS[member])
    if member not in ("too-deep", "long-integer"):  # past Python's limits; a browser's JSON.parse reads them
        payload = hidden[len(b"data: ") : -2].decode("utf-8", "replace")  # a browser's decoding
        assert json.loads(payload)["choices"][0]["delta"]["content"] == "the secret"
    if member in SDK_READS:  # what the openai SDK itself reads of the stream
        assert json.loads(sdk_events(hidden)[0])["choices"][0]["delta"]["content"] == "the secret"
    r, q, in_flight = through_gateway_as([HELLO, hidden, _chunk("", False, "stop"), DONE], STREAM_BODY, strict=strict)
    assert (r.status_code, r.content) == (200, HELLO + error_event(LENIENT) + DONE)
    assert (q.settled, in_flight) == ({"r4": [11 + HELLO_TOKENS]}, [0])
    r, q, in_flight = through_gateway_as([hidden, DONE], STREAM_BODY, strict=strict)
    assert (r.status_code, error_of(r)) == (502, LENIENT)
    assert (q.settled, in_flight) == ({"r4": [11]}, [0])


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "not-strict"])
def test_an_error_event_only_a_lenient_json_reader_reads_ends_the_stream(strict):
    """The same for an engine error object: ``{"error": {...}, "x": NaN}`` was relayed as an
    unread event (its message shown to a strict tenant, which is told no engine text)."""
    hidden = b'data: {"error": {"message": "the secret", "code": 500}, "x": NaN}\n\n'
    r, q, _ = through_gateway_as([HELLO, hidden, DONE], STREAM_BODY, strict=strict)
    assert (r.status_code, r.content) == (200, HELLO + error_event(LENIENT) + DONE)
    assert q.settled == {"r4": [11 + HELLO_TOKENS]}


def test_text_that_is_not_json_for_any_reader_ends_the_stream():
    """Data no JSON reader takes (plain text, a cut object) was relayed as carrying no text a
    client reads; but a client receives it (a browser's ``EventSource`` hands it to the page, the
    openai SDK's ``JSONDecodeError`` holds it) while the verifier read nothing in it. It now ends
    the stream as JSON only a lax reader reads does (tests/test_relay_non_object_events.py)."""
    for odd in (b"data: hello\n\n", b'data: {"choices": [\n\n', b'data: {"a": 1} x\n\n'):
        r, q, _ = through_gateway_as([HELLO, odd, _chunk("", False, "stop"), DONE], STREAM_BODY, strict=False)
        assert (r.status_code, r.content) == (200, HELLO + error_event(NOT_JSON) + DONE)
        assert q.settled == {"r4": [11 + HELLO_TOKENS]}


def _responses_error_event(error: dict[str, Any], seq: int) -> bytes:
    data = {"type": "error", "code": error["code"], "message": error["message"], "param": None, "sequence_number": seq}
    return b"event: error\ndata: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "not-strict"])
@pytest.mark.parametrize("member", list(LENIENT_MEMBERS), ids=list(LENIENT_MEMBERS))
def test_a_responses_event_only_a_lenient_json_reader_reads_ends_the_stream(member, strict):
    """The same gap in ``/v1/responses`` (its own event reader): a text delta with "the secret"
    and a member orjson refuses was relayed unread. Now the stream ends there with the Responses
    ``error`` event numbered after the last event; before anything started, a 502."""
    created = _event("response.created", 0, response={"id": "r1", "status": "in_progress", "output": []})
    delta = _event("response.output_text.delta", 1, output_index=0, content_index=0, delta="Hel")
    hidden = _with_member(
        _event("response.output_text.delta", 2, output_index=0, content_index=0, delta="the secret"),
        LENIENT_MEMBERS[member],
    )
    done = _event("response.completed", 3, response={"id": "r1", "status": "completed", "output": []})
    body = {"model": MODEL, "input": "Say hello.", "stream": True, "max_output_tokens": 5}
    r, q, in_flight = through_gateway_as([created, delta, hidden, done], body, strict=strict, path="/v1/responses")
    assert (r.status_code, r.content) == (200, created + delta + _responses_error_event(LENIENT, 2))
    hel = bundled_counter().count_text("Hel")
    assert (q.settled, in_flight) == ({"r4": [q.reserved["r4"] - 5 + hel]}, [0])
    r, q, _ = through_gateway_as([created, hidden, done], body, strict=strict, path="/v1/responses")
    assert (r.status_code, error_of(r)) == (502, LENIENT)


def test_the_whole_answer_path_already_refuses_what_orjson_does_not_read():
    """A whole answer orjson refuses (the same members) was already a 502, never relayed: the
    path fails closed (recorded here so that it stays so); the settle counts the prompt."""
    for member in LENIENT_MEMBERS.values():
        answer = b'{"choices":[{"index":0,"message":{"content":"the secret"},"finish_reason":"stop"}],"x":%s}' % member
        r, q, _ = through_gateway_as([answer], chat(max_tokens=5), strict=False, ctype="application/json")
        assert (r.status_code, error_of(r)["message"]) == (
            502,
            "The upstream engine answered a body that is not a JSON object.",
        )
        assert q.settled == {"r4": [11]}


# ---------------------------------------------------------------- usage the engine sent twice


def _usage(prompt: int, completion: int) -> bytes:
    return b'data: {"id":"c1","choices":[],"usage":{"prompt_tokens":%d,"completion_tokens":%d}}\n\n' % (
        prompt,
        completion,
    )


@pytest.mark.parametrize(
    ("usages", "settled"),
    [([(11, 5), (11, 1)], 16), ([(11, 1), (11, 5)], 16), ([(11, 5), (13, 1)], 18)],
    ids=["larger-first", "larger-last", "per-field"],
)
def test_of_two_usage_chunks_the_larger_count_of_each_field_is_charged(usages, settled):
    """An engine sending two usage chunks: the last one counted, so (11, 5) then (11, 1) settled
    at 12 and the reverse at 16. Each field now keeps the larger of its reports (vLLM's
    continuous usage stats only grow, so an honest engine is charged as before); the client,
    which did not ask for usage, still gets the stream without either chunk."""
    answer = CLOSE_FRAMED + STREAM[: -len(DONE)] + b"".join(_usage(p, c) for p, c in usages) + DONE
    r, q, in_flight = through_gateway(answer, STREAM_BODY)
    assert (r.status_code, r.content) == (200, STREAM)
    assert (q.settled, in_flight) == ({"r4": [settled]}, [0])


# ---------------------------------------------------------------- a completion count below the text streamed

PIECES = ["Hel", "lo", " there, my good friend"]  # three chunks of text: at least three generated tokens
PIECES_TOKENS = bundled_counter().count_text("".join(PIECES))  # 6


def _choice_chunk(index: int, content: str, finish: str | None = None) -> bytes:
    obj = {"id": "c1", "choices": [{"index": index, "delta": {"content": content}, "finish_reason": finish}]}
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


@pytest.mark.parametrize(
    ("completion", "settled"),
    [
        (3, 11 + 3),  # honest: one token a chunk
        (7, 11 + 7),  # honest: speculative decoding, several tokens a chunk
        (2, 11 + PIECES_TOKENS),  # fewer tokens than chunks of text: the text is counted
        (0, 11 + PIECES_TOKENS),
    ],
    ids=["one-a-chunk", "several-a-chunk", "fewer-than-chunks", "zero"],
)
def test_a_completion_count_below_the_chunks_of_text_streamed_is_replaced_by_the_text(completion, settled):
    """``usage.completion_tokens: 0`` after three chunks of text charged the prompt alone: the
    text was free. Each chunk with text took at least one generated token, so a count below the
    number of such chunks is no engine's: the text relayed is counted instead, as without usage.
    An honest count (one token a chunk, several a chunk, a chunk with empty text between) is
    charged as reported."""
    chunks = [_chunk(PIECES[0], False), _chunk("", False), *(_chunk(t, False) for t in PIECES[1:])]
    stream = b"".join(chunks) + _chunk("", False, "stop")
    body = chat(max_tokens=16, stream=True)
    r, q, in_flight = through_gateway(CLOSE_FRAMED + stream + _usage(11, completion) + DONE, body)
    assert (r.status_code, r.content) == (200, stream + DONE)
    assert (q.settled, in_flight) == ({"r4": [settled]}, [0])


@pytest.mark.parametrize(
    ("completion", "settled"),
    [(4, 22 + 4), (3, 22 + 2 * PIECES_TOKENS)],
    ids=["honest", "fewer-than-chunks"],
)
def test_with_n_2_the_chunks_of_every_choice_bound_the_completion_count(completion, settled):
    """``n: 2``, each choice streaming "Hello" and " there, my good friend" (four chunks of text in all): 4 tokens is
    honest, 3 is not, and then each choice's text is counted (prompt 11 x 2 sequences)."""
    stream = b"".join(_choice_chunk(i, t) for t in ("Hello", " there, my good friend") for i in (0, 1))
    stream += _choice_chunk(0, "", "stop") + _choice_chunk(1, "", "stop")
    body = chat(max_tokens=5, stream=True, n=2)
    r, q, _ = through_gateway(CLOSE_FRAMED + stream + _usage(11, completion) + DONE, body)
    assert (r.status_code, r.content) == (200, stream + DONE)
    assert q.settled == {"r4": [settled]}


def test_a_whole_answer_with_text_and_no_completion_tokens_is_charged_its_text():
    """A whole answer with text and ``completion_tokens: 0`` (one piece of text: at least one
    token) is charged its text; ``completion_tokens: 1`` is charged as reported."""
    for completion, settled in ((0, 11 + PIECES_TOKENS), (1, 12)):
        answer = (
            b'{"choices":[{"index":0,"message":{"content":"Hello there, my good friend"},"finish_reason":"stop"}],'
            b'"usage":{"prompt_tokens":11,"completion_tokens":%d}}' % completion
        )
        head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(answer)
        r, q, _ = through_gateway(head + answer, chat(max_tokens=5))
        assert (r.status_code, r.content) == (200, answer)
        assert q.settled == {"r4": [settled]}


# ---------------------------------------------------------------- what went wrong, in the log


def _failures(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "kvgate.proxy" and "failed" in r.getMessage()]


def test_a_transport_failure_is_logged_once_with_its_detail(caplog):
    """The client reads "The upstream engine failed (RemoteProtocolError)." (no engine detail);
    the log said nothing of what failed, so an operator could not tell a gzip coding from a
    reset. One warning per failed request now names the upstream and the transport's detail,
    with the request id."""
    caplog.set_level(logging.WARNING, logger="kvgate.proxy")
    r, _, _ = through_gateway(_te(b"gzip, chunked", gzip.compress(STREAM)), STREAM_BODY)
    assert (r.status_code, error_of(r)) == (502, ENGINE_FAILED)
    [rec] = _failures(caplog)
    assert rec.levelno == logging.WARNING and rec.fields == {"request_id": "r4", "upstream": "u1"}
    assert rec.getMessage() == (
        "upstream u1 failed (RemoteProtocolError): "
        "\"RemoteProtocolError: the engine answered Transfer-Encoding 'gzip, chunked'\""
    )


def test_a_transport_failure_detail_is_logged_on_one_bounded_line(caplog):
    """A detail holding CR/LF (text an engine can shape) and 10,000 characters is written on one
    line (its repr) of bounded size: it cannot forge a log line nor flood the log."""
    caplog.set_level(logging.WARNING, logger="kvgate.proxy")
    detail = "RemoteProtocolError: bad\r\n2026-01-01 forged line " + "A" * 10_000
    r, _ = post(streaming([HELLO, RemoteProtocolError(detail)]), STREAM_BODY)
    assert r.status_code == 200 and r.content.endswith(DONE)
    [rec] = _failures(caplog)
    message = rec.getMessage()
    assert "\r" not in message and "\n" not in message and len(message) < 700
    assert message.startswith("upstream u1 failed (RemoteProtocolError): 'RemoteProtocolError: bad\\r\\n2026")
    assert set(rec.fields) == {"request_id", "upstream"} and rec.fields["upstream"] == "u1"
