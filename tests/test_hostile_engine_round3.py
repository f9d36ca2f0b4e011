"""The forward path against an engine that breaks HTTP/1.1 framing (gateway/relay/h1_transport.py):
bytes past the end of an answer, and a chunked answer's trailer section. Whatever one answer holds,
the next request on the same pooled connection gets its own answer, with its own head, and each
lease settles once. And a ``/v1/responses`` stream numbered out of range, then cut, still ends with
the gateway's error event (verifier/engine_response.py).

Engines are raw asyncio servers on loopback, scripted per request; the gateway is the whole app over
httpx's ``ASGITransport`` with its own HTTP/1.1 transport (tests/test_hostile_relay.py's harness)."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import httpx
import pytest

from gateway.app import create_app
from gateway.relay.h1_transport import MAX_HEAD_BYTES, H1Transport
from gateway.relay.upstream_client import (
    MockResponse,
    MockTransport,
    ReadError,
    RemoteProtocolError,
    UpstreamClient,
)
from tests.gateway_harness import KEY_A, MODEL, SECRETS, chat, settings_for, tenants
from tests.test_gateway_pipeline import LedgerQuotas
from tests.test_gateway_relay import SSE, static_upstream
from tests.test_hostile_relay import loopback_gateway

pytestmark = pytest.mark.timeout(30)

HEADERS = {"content-type": "application/json", "accept-encoding": "identity", "x-request-id": "rid-1"}
#: a whole chat answer with text outside ASCII (usage: 11 prompt, 2 completion tokens)
ANSWER = json.dumps(
    {
        "id": "x",
        "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Caf\u00e9"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 11, "completion_tokens": 2},
    },
    ensure_ascii=False,
).encode()
WHOLE = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(ANSWER), ANSWER)
NOT_JSON = {
    "message": "The upstream engine answered a body that is not a JSON object.",
    "type": "server_error",
    "param": None,
    "code": "upstream_unavailable",
}


class Engine:
    """A loopback engine that answers the ``k``-th request it reads (over any connection) with
    ``answers[k]``, one write, and keeps each connection open for the next request.
    ``connections``: how many the gateway opened."""

    def __init__(self, answers: list[bytes]) -> None:
        self.answers = answers
        self.served = 0
        self.connections = 0
        self.server: asyncio.AbstractServer | None = None

    async def __aenter__(self) -> Engine:
        self.server = await asyncio.start_server(self._on_conn, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    async def _on_conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                fields = (h.partition(b":") for h in head.split(b"\r\n"))
                size = next(int(v) for k, _, v in fields if k.lower() == b"content-length")
                await reader.readexactly(size)
                answer = self.answers[self.served]
                self.served += 1
                writer.write(answer)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


async def _gateway(
    engine: Engine, bodies: list[dict[str, Any]]
) -> tuple[list[httpx.Response], LedgerQuotas, list[int]]:
    """``bodies`` posted one after the other (request ids ``p0``, ``p1``...) to a gateway whose one
    upstream is ``engine``: the responses, the quota ledger, what is left in flight."""
    async with loopback_gateway(engine.port) as (c, q, gw):
        out = [
            await c.post("/v1/chat/completions", json=b, headers={"x-request-id": f"p{i}"})
            for i, b in enumerate(bodies)
        ]
        return out, q, [u.in_flight for u in gw.upstreams.all]


def _transport() -> H1Transport:
    return H1Transport(connect_timeout=1.0, read_timeout=2.0, max_connections=4)


# ---------------------------------------------------------------- bytes past an answer's end


def test_an_answer_longer_than_its_content_length_never_reaches_the_next_request():
    """An engine that counts its Content-Length in characters, not bytes ("Caf\u00e9" is one byte
    longer in UTF-8): the body as framed is cut JSON (502, charged its prompt), and the byte left
    over closed the connection while the pool kept it, so the next request, on it, got a 502
    (``RemoteProtocolError``) for an engine that answered it well, and was charged for it. Now the
    connection is not kept: the next request gets its own answer and settles to its usage."""
    short = WHOLE.replace(b"content-length: %d" % len(ANSWER), b"content-length: %d" % (len(ANSWER) - 1))

    async def run() -> tuple[list[httpx.Response], LedgerQuotas, list[int], int]:
        async with Engine([short, WHOLE]) as engine:
            rs, q, in_flight = await _gateway(engine, [chat(max_tokens=5), chat(max_tokens=5)])
            return rs, q, in_flight, engine.connections

    rs, q, in_flight, connections = asyncio.run(run())
    assert [r.status_code for r in rs] == [502, 200]
    assert (rs[0].json(), rs[1].content) == ({"error": NOT_JSON}, ANSWER)
    assert (q.settled, in_flight, connections) == ({"p0": [11], "p1": [13]}, [0], 2)


@pytest.mark.parametrize(
    "extra",
    [b"xyz", b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nx-injected: "],
    ids=["garbage", "part-of-a-head"],
)
async def test_bytes_past_an_answers_end_are_never_read_as_the_next_response(extra):
    """RFC 9112 6.3: extra data after a response is never processed as a separate response. Sent
    in the answer's last write, garbage closed the connection after the pool had kept it (the next
    request failed with ``RemoteProtocolError``), and the start of a head was held by the parser
    and became the start of the next response (its fields among the next answer's). The first
    answer stands; the next request gets its own, on a new connection."""
    ok = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
    async with Engine([b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\n\r\nabc" + extra, ok]) as engine:
        url = f"http://127.0.0.1:{engine.port}/v1/chat/completions"
        t = _transport()
        got = []
        for _ in range(2):
            r = await t.send("POST", url, b"{}", HEADERS, None)
            got.append((r.status_code, dict(r.headers), await r.aread()))
            await r.aclose()
        await t.aclose()
    assert got == [(200, {"content-length": "3"}, b"abc"), (200, {"content-length": "2"}, b"ok")]
    assert engine.connections == 2


# ---------------------------------------------------------------- a chunked answer's trailer section


def _chunked(body: bytes, trailer: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n%s\r\n" % (len(body), body, trailer)


async def test_trailer_fields_are_not_the_next_responses_head():
    """A chunked answer's trailer fields were kept as the first header lines of the next response
    on the same connection (another request's, another tenant's). RFC 9110 6.5.1 lets a recipient
    discard them; they are, and the connection stays reusable."""
    trailer = b"x-prefill-seconds: 0.000001\r\ncontent-type: text/event-stream\r\n"
    ok = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\nok"
    async with Engine([_chunked(b"abc", trailer), ok]) as engine:
        url = f"http://127.0.0.1:{engine.port}/v1/chat/completions"
        t = _transport()
        got = []
        for _ in range(2):
            r = await t.send("POST", url, b"{}", HEADERS, None)
            got.append((r.status_code, list(r.headers.items()), await r.aread()))
            await r.aclose()
        await t.aclose()
    assert got == [
        (200, [("transfer-encoding", "chunked")], b"abc"),
        (200, [("content-type", "application/json"), ("content-length", "2")], b"ok"),
    ]
    assert engine.connections == 1


def test_a_trailer_does_not_give_the_next_request_a_time_to_first_token(caplog):
    """Through the gateway: a stream answered with an ``x-prefill-seconds`` trailer field, then a
    whole answer on the same connection that reports no prefill time. The trailer was read as the
    second answer's header, so its TTFT (logged, fed to the latency detector) was the first
    answer's 0.001 ms; now it has none. Each settles once, to its own usage."""
    caplog.set_level(logging.INFO, logger="kvgate.access")
    events = (
        b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"Hi"},'
        b'"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n'
    )
    stream = _chunked(events, b"x-prefill-seconds: 0.000001\r\n").replace(
        b"transfer-encoding", b"content-type: text/event-stream\r\ntransfer-encoding"
    )

    async def run() -> tuple[list[httpx.Response], LedgerQuotas, int]:
        async with Engine([stream, WHOLE]) as engine:
            rs, q, _ = await _gateway(engine, [chat(max_tokens=5, stream=True), chat(max_tokens=5)])
            return rs, q, engine.connections

    rs, q, connections = asyncio.run(run())
    assert [(r.status_code, r.content) for r in rs] == [(200, events), (200, ANSWER)]
    ttft = {r.fields["request_id"]: r.fields["ttft_ms"] for r in caplog.records if r.name == "kvgate.access"}
    assert ttft["p1"] is None
    assert (q.settled, connections) == ({"p0": [12], "p1": [13]}, 1)


async def test_an_endless_trailer_section_is_a_protocol_error():
    """A trailer field that never ends was kept by the parser as it grew (httptools joins a
    field's value until its line ends): 8 MiB of it held the gateway's memory and event loop and
    then read as a good answer. It is bounded as a head is."""

    async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\nx-t: ")
        for _ in range(128):
            writer.write(b"a" * 65536)
            await writer.drain()
        writer.write(b"\r\n\r\n")
        await writer.drain()

    server = await asyncio.start_server(endless, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/chat/completions"
    t = _transport()
    try:
        r = await t.send("POST", url, b"{}", HEADERS, None)
        with pytest.raises(RemoteProtocolError, match=f"chunk framing or trailer section over {MAX_HEAD_BYTES} bytes"):
            await r.aread()
        await r.aclose()
    finally:
        await t.aclose()
        server.close()


# ---------------------------------------------------------------- a Responses event's number


@pytest.mark.parametrize("seq", [2**64 - 1, -5])
def test_a_cut_responses_stream_after_an_event_numbered_out_of_range_ends_with_its_error_event(seq):
    """The gateway numbers the error event that ends a cut ``/v1/responses`` stream after the
    engine's last event. After one numbered ``2**64 - 1`` (a JSON int orjson reads) that number
    could not be written: the shell raised ``TypeError`` inside its error handling, the stream
    ended without its error event and the request was an unhandled error (after ``-5`` it was
    numbered ``-4``). A number outside 0 to ``2**63 - 2`` is read as absent: the error event
    follows, unnumbered, and the lease settles once."""
    delta = (
        b'data: {"type":"response.output_text.delta","sequence_number":%d,"output_index":0,'
        b'"content_index":0,"delta":"Hel"}\n\n' % seq
    )

    async def run() -> tuple[httpx.Response, LedgerQuotas]:
        q = LedgerQuotas()
        app = create_app(settings_for([static_upstream()]), tenants(), secrets=SECRETS, quotas=q)
        gw = app.state.gateway
        answer = [delta, ReadError("ReadError: reset")]
        gw.forwarder = UpstreamClient(transport=MockTransport(lambda request: MockResponse(200, SSE, answer)))
        await gw.start()
        try:
            async with httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app),
                base_url="http://gateway.test",
                headers={"authorization": f"Bearer {KEY_A}", "x-request-id": "seq-1"},
            ) as c:
                body = {"model": MODEL, "input": "Say hello.", "stream": True, "max_output_tokens": 5}
                return await c.post("/v1/responses", json=body), q
        finally:
            await gw.stop()

    r, q = asyncio.run(run())
    assert (r.status_code, r.content) == (
        200,
        delta + b'event: error\ndata: {"type":"error","code":"upstream_unavailable",'
        b'"message":"The upstream engine broke the connection (ReadError).","param":null}\n\n',
    )
    assert q.settled == {"seq-1": [12]}
