"""The relay against a hostile engine and a client that leaves (gateway/relay/): what a client
reads of a stream is what the gateway read of it, a stream the engine cut is never relayed as a
whole one, no event shape becomes a 500, and the lease is settled once to what was produced.

Engines are played in-process (the upstream client's ``MockTransport``, the app over httpx's
``ASGITransport``: tests/test_gateway_relay.py's harness) or by a raw asyncio server on loopback
(the gateway's own HTTP/1.1 transport), and a client that leaves is a raw ASGI ``receive``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from gateway.app import create_app
from gateway.relay import sse
from gateway.relay.upstream_client import MockResponse, MockTransport, UpstreamClient
from tests.gateway_harness import KEY_A, MODEL, SECRETS, chat, settings_for, tenants
from tests.test_gateway_pipeline import LedgerQuotas
from tests.test_gateway_relay import (
    SSE,
    WITHHELD,
    _chunk,
    _event,
    error_of,
    guarded,
    post,
    static_upstream,
    streaming,
)

pytestmark = pytest.mark.timeout(30)

STREAM = chat(max_tokens=5, stream=True)
RESPONSES = {"model": MODEL, "input": "Say hello.", "stream": True, "max_output_tokens": 5}
CUT = {
    "message": "The upstream engine broke the connection (RemoteProtocolError).",
    "type": "server_error",
    "param": None,
    "code": "upstream_unavailable",
}
BARE_CR = {
    "message": "The upstream engine sent an event stream with bare CR line endings, which the gateway does not relay.",
    "type": "server_error",
    "param": None,
    "code": "upstream_unavailable",
}


def error_event(error: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps({"error": error}, separators=(",", ":")).encode() + b"\n\n"


def client_events(stream: bytes) -> list[str]:
    """The ``data`` of each event a WHATWG client (the openai SDK, a browser) reads in ``stream``:
    lines end at CRLF, LF or a bare CR; a blank line dispatches the event."""
    out: list[str] = []
    data: list[str] = []
    for line in re.split(rb"\r\n|\r|\n", stream):
        if not line:
            if data:
                out.append("\n".join(data))
            data = []
        elif line.startswith(b"data:"):
            v = line[5:].decode()
            data.append(v[1:] if v.startswith(" ") else v)
    return out


# ---------------------------------------------------------------- what the client reads is what was read


def test_sse_lines_are_read_as_a_client_reads_them():
    """A bare CR ends a line for every SSE client; the gateway read ``data: A\\r: x`` as one line
    (data ``A\\r: x``, not JSON, so not text). Several events in what the splitter found (a blank
    line made with a bare CR, or ``\\n\\r\\n``) are told apart from one."""
    assert sse.data_of(b'data: {"a":1}\r: comment\n\n') == b'{"a":1}'
    assert sse.data_of(b"data: x\rdata: y\r\n\r\n") == b"x\ny"
    assert sse.data_of(b"data: x\r\n\r\n") == b"x"
    for one in (b"data: x\n\n", b"data: x\r\n\r\n", b"data: x\r\n\n", b"\r\ndata: x\r\n\r\n", b"data: x\n\r\n\r\n"):
        assert sse.is_one_event(one), one
    for several in (b"data: x\r\rdata: y\n\n", b"data: x\n\r\ndata: y\n\n", b"data: x\r\n\rdata: y\r\n\r\n"):
        assert not sse.is_one_event(several), several
        with pytest.raises(sse.SeveralEvents):  # what the relay reads them with
            sse.relayed_fields(several)
    assert sse.relayed_fields(b"data: x\r\n\r\n") == (b"data: x\r\n\r\n", ())


def test_a_bare_cr_in_an_event_does_not_hide_its_text_from_the_guard():
    """``data: {...}\\r: x\\n\\n``: a client reads the chunk (the ``: x`` is a comment line); the
    gateway read one line that was not JSON, so the strict guard never saw "the secret" and the
    client got it with a 200."""
    hidden = _chunk("the secret", False)[:-2] + b"\r: x\n\n"
    assert client_events(hidden) == client_events(_chunk("the secret", False))  # what a client reads
    r = guarded([_chunk("Hello ", False), hidden, _chunk("", False, "stop"), b"data: [DONE]\n\n"], STREAM)
    assert r.status_code == 200
    assert r.content == _chunk("Hello ", False) + error_event(WITHHELD) + b"data: [DONE]\n\n"


@pytest.mark.parametrize("blank", [b"\r\r", b"\n\r\n", b"\r\n\r"], ids=["cr-cr", "lf-crlf", "crlf-cr"])
def test_events_a_client_splits_where_the_gateway_does_not_end_the_stream(blank):
    """Two events joined by a blank line the splitter does not take for one (a bare CR in it): a
    client reads both; the gateway read one event that was not JSON, relayed it unread by the
    guard (here: "the secret" reached the client under a 200) and uncounted by the settle. Now
    the stream ends there with an error event (before any content: a 502)."""
    joined = _chunk("the secret", False)[:-2] + blank + _chunk("", False, "stop")
    assert [json.loads(e)["choices"][0]["delta"]["content"] for e in client_events(joined)] == ["the secret", ""]
    r = guarded([_chunk("Hello ", False), joined, b"data: [DONE]\n\n"], STREAM)
    assert r.status_code == 200
    assert r.content == _chunk("Hello ", False) + error_event(BARE_CR) + b"data: [DONE]\n\n"
    r, _ = post(streaming([joined, b"data: [DONE]\n\n"]), STREAM)
    assert (r.status_code, error_of(r)) == (502, BARE_CR)


# ---------------------------------------------------------------- odd shapes are never a 500


@pytest.mark.parametrize("etype", [[], {}, ["response.output_text.delta"]], ids=["array", "object", "array-of-str"])
def test_a_responses_event_whose_type_is_an_array_or_object_is_relayed_not_a_500(etype):
    """``{"type": []}`` in a /v1/responses stream raised TypeError in the event parser (an
    unhashable type looked up in its tables): a 500 ``internal_error`` before the response
    started, an ``internal_error`` event after it, and a traceback in the log."""
    created = _event("response.created", 0, response={"id": "r1", "status": "in_progress", "output": []})
    delta = _event("response.output_text.delta", 1, output_index=0, content_index=0, delta="Hel")
    odd = b"data: " + json.dumps({"type": etype, "sequence_number": 2}).encode() + b"\n\n"
    done = _event("response.completed", 3, response={"id": "r1", "status": "completed", "output": []})
    for events in ([created, odd, delta, done], [created, delta, odd, done]):
        r, _ = post(streaming(events), RESPONSES, path="/v1/responses")
        assert (r.status_code, r.content) == (200, b"".join(events))


def test_a_stream_content_type_is_matched_whatever_its_case():
    """Media types are case-insensitive (RFC 9110 8.3.1): an engine answering
    ``Text/Event-Stream`` got a 502 whose message held its whole stream, read as an error body."""
    stream = _chunk("hi", False, "stop") + b"data: [DONE]\n\n"
    for ctype in ("Text/Event-Stream", "TEXT/EVENT-STREAM; charset=UTF-8", " text/event-stream ;charset=utf-8"):
        r, _ = post(streaming([stream], headers={"content-type": ctype}), STREAM)
        assert (r.status_code, r.headers["content-type"], r.content) == (
            200,
            "text/event-stream; charset=utf-8",
            stream,
        )
    r, _ = post(streaming([stream], headers={"content-type": "text/event-streamx"}), STREAM)
    assert r.status_code == 502


# ---------------------------------------------------------------- a stream cut is never a whole answer


def test_a_chat_stream_ended_without_done_or_finish_reason_is_relayed_as_cut():
    """The body ended cleanly after "Hel" (no ``[DONE]``, no finish reason): the gateway added its
    own ``[DONE]`` and the client read a cut answer as a whole one. Now it ends as a stream the
    transport cut does: an error event, then ``[DONE]``; before any content, a 502."""
    first = _chunk("Hel", False)
    r, gw = post(streaming([first]), STREAM)
    assert (r.status_code, r.content) == (200, first + error_event(CUT) + b"data: [DONE]\n\n")
    assert 'kvgate_upstream_errors_total{kind="reset",upstream="u1"} 1.0' in gw.metrics()
    role = b'data: {"choices":[{"index":0,"delta":{"role":"assistant"}}]}\n\n'
    for chunks in ([role], []):
        r, _ = post(streaming(chunks), STREAM)
        assert (r.status_code, error_of(r)) == (502, CUT)
    # what ended the stream is still an end: a finish reason, [DONE], an engine error event
    finished = _chunk("Hel", False, "stop")
    assert post(streaming([finished]), STREAM)[0].content == finished + b"data: [DONE]\n\n"
    assert post(streaming([first, b"data: [DONE]\n\n"]), STREAM)[0].content == first + b"data: [DONE]\n\n"
    failed = b'data: {"error":{"message":"engine died","code":500}}\n\n'
    r, _ = post(streaming([first, failed]), STREAM)
    engine_died = {"message": "engine died", "type": "server_error", "param": None, "code": None}
    assert r.content == first + error_event(engine_died) + b"data: [DONE]\n\n"


def _choice(index: int, content: str, finish: str | None = None) -> bytes:
    obj = {
        "id": "c1",
        "object": "chat.completion.chunk",
        "choices": [{"index": index, "delta": {"content": content}, "finish_reason": finish}],
    }
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def test_a_stream_of_several_choices_ended_before_each_finished_is_relayed_as_cut():
    """``n: 2``: choice 0 finished, choice 1 had said "Wor" when the body ended (no ``[DONE]``).
    One finish reason ended the stream for the relay, so the gateway's ``[DONE]`` made choice 1's
    cut text read as whole. Each choice asked for must now finish; completions count the prompts
    too (two prompts x ``n: 1``)."""
    a, b = _choice(0, "Hel", "stop"), _choice(1, "Wor")
    r, _ = post(streaming([a, b]), {**STREAM, "n": 2})
    assert (r.status_code, r.content) == (200, a + b + error_event(CUT) + b"data: [DONE]\n\n")
    both = _choice(1, "ld", "length")
    r, _ = post(streaming([a, b, both]), {**STREAM, "n": 2})
    assert (r.status_code, r.content) == (200, a + b + both + b"data: [DONE]\n\n")
    r, _ = post(streaming([a, b, b"data: [DONE]\n\n"]), {**STREAM, "n": 2})  # the engine's own end stands
    assert (r.status_code, r.content) == (200, a + b + b"data: [DONE]\n\n")
    completions = {"model": MODEL, "prompt": ["Say hello.", "Say hi."], "max_tokens": 5, "stream": True}
    r, _ = post(streaming([a, b]), completions, path="/v1/completions")
    assert (r.status_code, r.content) == (200, a + b + error_event(CUT) + b"data: [DONE]\n\n")
    r, _ = post(streaming([a, b, both]), completions, path="/v1/completions")
    assert (r.status_code, r.content) == (200, a + b + both + b"data: [DONE]\n\n")


def test_an_error_status_with_an_event_stream_body_reads_the_error_in_its_event():
    """A stream request answered 500 with its error as an event (``data: {"error": ...}``, as
    an engine writes errors inside streams): the client's message was the raw ``data:`` line,
    JSON and all. The error object inside is now read as any error body is."""
    event = b'data: {"error":{"message":"CUDA out of memory","type":"server_error","code":"oom"}}\r\n\r\n'
    r, _ = post(streaming([event], status=500), STREAM)
    assert (r.status_code, error_of(r)) == (
        500,
        {"message": "CUDA out of memory", "type": "server_error", "param": None, "code": "oom"},
    )
    sglang = b'data: {"object":"error","message":"Input too long","type":"BadRequestError","code":400}\n\n'
    r, _ = post(streaming([sglang], status=400), STREAM)
    assert (r.status_code, error_of(r)) == (
        400,
        {"message": "Input too long", "type": "invalid_request_error", "param": None, "code": None},
    )
    r, _ = post(streaming([b"data: not json\n\n"], status=502), STREAM)  # nothing to read: quoted as before
    assert (r.status_code, error_of(r)["message"]) == (502, "The upstream engine answered 502: data: not json\n\n")


def test_a_responses_stream_ended_without_a_terminal_event_ends_with_its_error_event():
    events = [
        _event("response.created", 0, response={"id": "r1", "status": "in_progress", "output": []}),
        _event("response.output_text.delta", 1, output_index=0, content_index=0, delta="Hel"),
    ]
    r, _ = post(streaming(events), RESPONSES, path="/v1/responses")
    assert (r.status_code, r.content) == (
        200,
        b"".join(events) + b'event: error\ndata: {"type":"error","code":"upstream_unavailable",'
        b'"message":"The upstream engine broke the connection (RemoteProtocolError).","param":null,'
        b'"sequence_number":2}\n\n',
    )


async def serve_once(answer: bytes) -> tuple[asyncio.AbstractServer, int]:
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


@contextlib.asynccontextmanager
async def loopback_gateway(
    port: int, headers: dict[str, str] | None = None
) -> AsyncIterator[tuple[httpx.AsyncClient, LedgerQuotas, Any]]:
    """The whole app over httpx's ``ASGITransport``, its one upstream the engine on loopback
    ``port`` (through the gateway's own HTTP/1.1 transport), quotas kept in a
    :class:`~tests.test_gateway_pipeline.LedgerQuotas`: yields ``(client, ledger, gateway)``,
    the client sending tenant a's key and ``headers``; the gateway is stopped on exit."""
    up = {**static_upstream(), "api_url": f"http://127.0.0.1:{port}/v1"}
    q = LedgerQuotas()
    app = create_app(settings_for([up]), tenants(), secrets=SECRETS, quotas=q)
    gw = app.state.gateway
    await gw.start()
    try:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app),
            base_url="http://gateway.test",
            headers={"authorization": f"Bearer {KEY_A}", **(headers or {})},
        ) as c:
            yield c, q, gw
    finally:
        await gw.stop()


def post_to_loopback_engine(
    answer: bytes, body: dict[str, Any], request_id: str
) -> tuple[httpx.Response, LedgerQuotas, list[int]]:
    """``body`` posted to ``/v1/chat/completions`` (request id ``request_id``) through
    :func:`loopback_gateway`, its engine one :func:`serve_once` answering ``answer``: the
    response, the quota ledger, and what each upstream has left in flight."""

    async def run() -> tuple[httpx.Response, LedgerQuotas, list[int]]:
        server, port = await serve_once(answer)
        try:
            async with loopback_gateway(port, {"x-request-id": request_id}) as (c, q, gw):
                r = await c.post("/v1/chat/completions", json=body)
                return r, q, [u.in_flight for u in gw.upstreams.all]
        finally:
            server.close()

    return asyncio.run(run())


def test_an_engine_dying_inside_a_close_framed_stream_is_a_cut_and_settles_once():
    """An answer framed by the connection's close (no Content-Length, no chunking) whose engine
    died after "Hel": the close is the body's end, so the client got "Hel" and ``[DONE]``, a
    whole answer. Over the gateway's own HTTP/1.1 transport it now ends with the error event;
    the lease settles once, to the prompt (11) and the text relayed (1), and nothing is left in
    flight."""
    first = _chunk("Hel", False)
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n"

    r, q, in_flight = post_to_loopback_engine(head + first, STREAM, "cut-1")
    assert (r.status_code, r.content) == (200, first + error_event(CUT) + b"data: [DONE]\n\n")
    assert (q.settled, in_flight) == ({"cut-1": [12]}, [0])


# ---------------------------------------------------------------- a client that leaves


class Stalling(MockResponse):
    """An engine that sends ``first`` then nothing (its prefill of a long prompt, a hang)."""

    def __init__(self, first: bytes) -> None:
        super().__init__(200, SSE, [])
        self.first = first

    async def aiter_raw(self):
        yield self.first
        await asyncio.sleep(60)


def test_a_client_leaving_while_the_relay_holds_back_settles_once_and_closes_the_upstream():
    """The engine sent only its role chunk (held back: no byte reached the client yet) and the
    client left: the upstream response is closed, nothing is in flight, the lease settles once
    to the prompt, and the request is counted as 499 with one disconnect."""
    from prometheus_client import generate_latest

    engine = Stalling(b'data: {"choices":[{"index":0,"delta":{"role":"assistant"}}]}\n\n')

    async def run() -> tuple[list[dict], LedgerQuotas, Any]:
        q = LedgerQuotas()
        app = create_app(settings_for([static_upstream()]), tenants(), secrets=SECRETS, quotas=q)
        gw = app.state.gateway
        gw.forwarder = UpstreamClient(transport=MockTransport(lambda request: engine))
        await gw.start()
        body = json.dumps(STREAM).encode()
        messages = [{"type": "http.request", "body": body, "more_body": False}]
        left = asyncio.Event()

        async def receive() -> dict:
            if messages:
                return messages.pop()
            await left.wait()
            return {"type": "http.disconnect"}

        sent: list[dict] = []

        async def send(m: dict) -> None:
            sent.append(m)

        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": "/v1/chat/completions",
            "raw_path": b"/v1/chat/completions",
            "query_string": b"",
            "root_path": "",
            "headers": [
                (b"host", b"gateway.test"),
                (b"authorization", f"Bearer {KEY_A}".encode()),
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"x-request-id", b"left-1"),
            ],
            "client": ("127.0.0.1", 1),
            "server": ("127.0.0.1", 2),
        }
        task = asyncio.create_task(app(scope, receive, send))
        for _ in range(200):  # until the engine's first read is held
            await asyncio.sleep(0.005)
            if gw.upstreams.all[0].in_flight:
                break
        await asyncio.sleep(0.05)
        left.set()
        await asyncio.wait_for(task, 5)
        try:
            return sent, q, gw
        finally:
            await gw.stop()

    sent, q, gw = asyncio.run(run())
    assert sent == []  # nothing was started: the role chunk was still held back
    assert engine.closed and [u.in_flight for u in gw.upstreams.all] == [0]
    assert q.settled == {"left-1": [11]}
    metrics = generate_latest(gw.metrics.registry).decode()
    assert 'kvgate_requests_total{route="chat",status="499",tenant="tenant-a"} 1.0' in metrics
    assert 'kvgate_client_disconnects_total{route="chat"} 1.0' in metrics
