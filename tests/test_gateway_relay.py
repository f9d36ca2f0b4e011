"""The relay's bytes without a socket: the whole gateway app in-process (httpx's ``ASGITransport``)
forwarding to an engine played by the upstream client's ``MockTransport`` (gateway/relay/
upstream_client.py). Streams byte for byte, usage stripping, ``[DONE]`` exactly once, engine errors
before and after the response started, a stream cut by the transport, the Responses protocol's
own error event, a guard's refusal before and after the response started. (The same paths over
real sockets: tests/test_gateway_http.py and tests/test_gateway_faults.py.)"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterable
from typing import Any

import httpx
import pytest

from gateway.app import create_app
from gateway.relay.upstream_client import (
    ConnectError,
    MockRequest,
    MockResponse,
    MockTransport,
    ReadError,
    UpstreamClient,
    UpstreamError,
)
from tests.gateway_harness import KEY_A, MODEL, SECRETS, chat, settings_for, tenants
from verifier.stage import NullVerifier, ResponseWithheld

pytestmark = pytest.mark.timeout(60)

SSE = {"content-type": "text/event-stream"}
TEXTS = ["caf\u00e9 \u2028 ", "\U0001f600 \u4e2d\u6587", "\u2029end"]


def _chunk(content: str, usage_null: bool, finish: str | None = None) -> bytes:
    obj: dict[str, Any] = {
        "id": "c1",
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": finish}],
    }
    if usage_null:
        obj["usage"] = None
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


def _usage_chunk() -> bytes:
    return b'data: {"id": "c1", "choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": 3}}\n\n'


def _cut(stream: bytes, step: int) -> list[bytes]:
    return [stream[i : i + step] for i in range(0, len(stream), step)]


def static_upstream(name: str = "u1") -> dict[str, Any]:
    """An upstream whose pool is configured (no pool polls: nothing listens anywhere)."""
    return {
        "name": name,
        "api_url": f"http://{name}.engine.invalid",
        "pool_source": "static",
        "static_pool_tokens": 100_000,
        "pool_urls": [],
        "models": [MODEL],
    }


def streaming(chunks: Iterable[bytes | UpstreamError], status: int = 200, headers=SSE) -> Callable:
    """A handler answering every request with ``chunks``, one read each."""
    return lambda request: MockResponse(status, headers, list(chunks))


class InProcess:
    """The gateway app over ``ASGITransport``, its upstreams answered by ``handler``."""

    def __init__(
        self,
        handler: Callable[[MockRequest], Any],
        upstreams: list[dict] | None = None,
        verifier: Any = None,
        gateway: dict[str, Any] | None = None,
    ) -> None:
        settings = settings_for(upstreams or [static_upstream()], gateway=gateway)
        self.app = create_app(settings, tenants(), secrets=SECRETS, verifier=verifier)
        self.gw = self.app.state.gateway
        self.transport = MockTransport(handler)
        self.gw.forwarder = UpstreamClient(transport=self.transport)

    async def post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        await self.gw.start()
        try:
            async with httpx.AsyncClient(
                transport=httpx.ASGITransport(app=self.app),
                base_url="http://gateway.test",
                headers={"authorization": f"Bearer {KEY_A}"},
            ) as c:
                return await c.post(path, json=body)
        finally:
            await self.gw.stop()

    def metrics(self) -> str:
        from prometheus_client import generate_latest

        return generate_latest(self.gw.metrics.registry).decode()


def post(handler, body: dict[str, Any], path: str = "/v1/chat/completions", **kw) -> tuple[httpx.Response, InProcess]:
    gw = InProcess(handler, **kw)
    return asyncio.run(gw.post(path, body)), gw


def error_of(r: httpx.Response) -> dict:
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


# ---------------------------------------------------------------- chat/completions streams


def test_stream_is_byte_exact_when_client_asks_usage():
    events = [_chunk(t, True) for t in TEXTS] + [_chunk("", True, "stop"), _usage_chunk(), b"data: [DONE]\n\n"]
    stream = b"".join(events)
    body = chat(max_tokens=5, stream=True, stream_options={"include_usage": True})
    r, _ = post(streaming(_cut(stream, 5)), body)  # cuts through multi-byte characters
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert r.content == stream
    assert r.content.count(b"[DONE]") == 1


def test_stream_strips_usage_the_client_did_not_ask_for():
    asked = [_chunk(t, True) for t in TEXTS] + [_chunk("", True, "stop"), _usage_chunk(), b"data: [DONE]\n\n"]
    r, gw = post(streaming(_cut(b"".join(asked), 3)), chat(max_tokens=5, stream=True))
    plain = [_chunk(t, False) for t in TEXTS] + [_chunk("", False, "stop"), b"data: [DONE]\n\n"]
    assert r.content == b"".join(plain)
    assert json.loads(gw.transport.requests[0].content)["stream_options"] == {"include_usage": True}
    # the engine's usage still reached the metrics (the quota settle uses it too)
    assert 'kvgate_completion_tokens_total{tenant="tenant-a"} 3.0' in gw.metrics()


def test_stream_without_done_gets_one():
    body = chat(max_tokens=5, stream=True, stream_options={"include_usage": True})
    r, _ = post(streaming([_chunk("hi", False, "stop")]), body)
    assert r.content == _chunk("hi", False, "stop") + b"data: [DONE]\n\n"


def test_error_event_before_content_is_mapped():
    chunks = [
        b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n',
        b'data: {"object":"error","message":"The input (5000 tokens) is longer than the model",'
        b'"type":"BadRequestError","param":null,"code":400}\n\n',
        b"data: [DONE]\n\n",
    ]
    r, _ = post(streaming(chunks), chat(max_tokens=5, stream=True))
    assert r.status_code == 400
    assert error_of(r) == {
        "message": "The input (5000 tokens) is longer than the model",
        "type": "invalid_request_error",
        "param": None,
        "code": None,
    }


def test_error_event_after_content_passes_as_openai_event():
    chunks = [
        _chunk("partial", False),
        b'data: {"error":{"message":"engine died","code":500}}\n\n',
        b"data: [DONE]\n\n",
    ]
    r, _ = post(streaming(chunks), chat(max_tokens=5, stream=True))
    assert r.status_code == 200
    assert r.content == (
        _chunk("partial", False) + b'data: {"error":{"message":"engine died","type":"server_error",'
        b'"param":null,"code":null}}\n\n' + b"data: [DONE]\n\n"
    )


def test_json_answer_to_a_stream_request_is_mapped():
    answer = [b'{"object":"error","message":"stream refused","code":429}']
    r, _ = post(streaming(answer, headers={"content-type": "application/json"}), chat(max_tokens=5, stream=True))
    assert r.status_code == 429
    assert error_of(r) == {"message": "stream refused", "type": "rate_limit_error", "param": None, "code": None}


def test_a_cut_stream_ends_with_one_error_event_and_one_done():
    first = b'data: {"choices":[{"index":0,"delta":{"content":"Hel"},"finish_reason":null}]}\n\n'
    r, gw = post(streaming([first, ReadError("reset")]), chat(max_tokens=5, stream=True))
    assert r.status_code == 200
    assert r.content == first + (
        b'data: {"error":{"message":"The upstream engine broke the connection (ReadError).",'
        b'"type":"server_error","param":null,"code":"upstream_unavailable"}}\n\n'
        b"data: [DONE]\n\n"
    )
    assert 'kvgate_upstream_errors_total{kind="reset",upstream="u1"} 1.0' in gw.metrics()


def test_a_cut_before_any_content_is_502():
    start = b'data: {"choices":[{"index":0,"delta":{"role":"assistant"}}]}\n\n'
    r, _ = post(streaming([start, ReadError("reset")]), chat(max_tokens=5, stream=True))
    assert (r.status_code, error_of(r)["code"]) == (502, "upstream_unavailable")


def test_a_refused_connect_moves_to_the_next_upstream_before_any_byte():
    def handler(request: MockRequest):
        if request.url.startswith("http://u1."):
            return ConnectError("refused")
        return MockResponse(200, SSE, [_chunk("hi", False, "stop")])

    r, gw = post(handler, chat(max_tokens=5, stream=True), upstreams=[static_upstream("u1"), static_upstream("u2")])
    assert r.content == _chunk("hi", False, "stop") + b"data: [DONE]\n\n"
    assert {q.url.split(".")[0] for q in gw.transport.requests} == {"http://u1", "http://u2"}


def test_a_whole_answer_is_relayed_unchanged():
    answer = (
        b'{"id":"c1","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant",'
        b'"content":"hi \\u2028"},"finish_reason":"stop"}],"usage":{"prompt_tokens":11,"completion_tokens":2}}'
    )
    r, gw = post(lambda q: MockResponse(200, {"content-type": "application/json"}, [answer[:9], answer[9:]]), chat())
    assert (r.status_code, r.content, r.headers["content-length"]) == (200, answer, str(len(answer)))
    assert 'kvgate_completion_tokens_total{tenant="tenant-a"} 2.0' in gw.metrics()


def test_an_answer_over_max_response_bytes_is_a_502_and_an_error_body_is_read_only_for_its_message():
    """A hostile engine's endless answer is not held: past ``gateway.max_response_bytes`` reading
    stops; an error answer's message is read up to 64 KiB, past that it is reported without it."""
    piece = b'{"id":"c1","choices":[],"pad":"' + b"x" * 65536
    r, gw = post(
        lambda q: MockResponse(200, {"content-type": "application/json"}, [piece] * 40),
        chat(),
        gateway={"max_response_bytes": 1 << 20},
    )
    assert (r.status_code, error_of(r)) == (
        502,
        {
            "message": "The upstream engine answered more than 1048576 bytes (gateway.max_response_bytes).",
            "type": "server_error",
            "param": None,
            "code": "upstream_unavailable",
        },
    )
    assert 'kvgate_upstream_errors_total{kind="too_large",upstream="u1"} 1.0' in gw.metrics()
    message = b'{"object":"error","message":"engine overloaded","code":503}'
    for body, want in (
        (message, "engine overloaded"),
        (message + b" " * (64 * 1024), "The upstream engine answered 503."),
    ):
        r, _ = post(lambda q, body=body: MockResponse(503, {"content-type": "application/json"}, [body]), chat())
        assert (r.status_code, error_of(r)["message"]) == (503, want)


# ---------------------------------------------------------------- /v1/responses streams


def _event(etype: str, seq: int, **data: Any) -> bytes:
    return (
        f"event: {etype}\ndata: ".encode()
        + json.dumps({"type": etype, "sequence_number": seq, **data}).encode()
        + b"\n\n"
    )


def test_a_responses_stream_is_relayed_as_sent_and_a_cut_ends_with_its_error_event():
    events = [
        _event("response.created", 0, response={"id": "r1", "status": "in_progress", "output": []}),
        _event("response.output_text.delta", 1, output_index=0, content_index=0, delta="Hel"),
    ]
    body = {"model": MODEL, "input": "Say hello.", "stream": True, "max_output_tokens": 5}
    r, _ = post(streaming([*events, ReadError("reset")]), body, path="/v1/responses")
    assert r.status_code == 200
    assert r.content == b"".join(events) + (
        b'event: error\ndata: {"type":"error","code":"upstream_unavailable",'
        b'"message":"The upstream engine broke the connection (ReadError).","param":null,"sequence_number":2}\n\n'
    )
    done = _event("response.completed", 2, response={"id": "r1", "status": "completed", "output": []})
    r, _ = post(streaming([*events, done]), body, path="/v1/responses")
    assert r.content == b"".join(events) + done  # no [DONE]: that protocol has none


# ---------------------------------------------------------------- a guard that withholds


class WithholdingGuard:
    """A strict guard in miniature: passes every event on until one adds ``word``, then refuses."""

    def __init__(self, word: str) -> None:
        self.word = word

    async def feed(self, delta_text: str, raw_event: bytes, pieces=None) -> list[bytes]:
        if self.word in delta_text:
            raise ResponseWithheld("inc-7", "test")
        return [raw_event]

    async def finish_stream(self, *, usage, finish_reason, ttft_seconds) -> list[bytes]:
        return []

    async def check_body(self, text, *, usage, finish_reason, ttft_seconds) -> None:
        if any(self.word in t for t in text):
            raise ResponseWithheld("inc-7", "test")


class GuardingVerifier(NullVerifier):
    def __init__(self, word: str) -> None:
        self.word = word

    def begin(self, exchange):
        return WithholdingGuard(self.word)


def guarded(chunks, body, word="secret", path="/v1/chat/completions") -> httpx.Response:
    gw = InProcess(streaming(chunks), verifier=GuardingVerifier(word))
    return asyncio.run(gw.post(path, body))


WITHHELD = {
    "message": "The response was withheld by verification (incident inc-7).",
    "type": "server_error",
    "param": None,
    "code": "response_withheld",
}


def test_a_refusal_after_the_response_started_in_the_same_read_ends_the_stream():
    # one read: the first event starts the response (200 sent), the guard refuses the second;
    # nothing of that read leaves (a real strict guard holds its window back anyway)
    read = _chunk("Hello ", False) + _chunk("the secret", False) + b"data: [DONE]\n\n"
    r = guarded([read], chat(max_tokens=5, stream=True))
    assert r.status_code == 200
    error = json.dumps({"error": WITHHELD}, separators=(",", ":")).encode()
    assert r.content == b"data: " + error + b"\n\ndata: [DONE]\n\n"


def test_a_refusal_before_the_response_started_is_a_502():
    r = guarded([_chunk("the secret", False), b"data: [DONE]\n\n"], chat(max_tokens=5, stream=True))
    assert (r.status_code, error_of(r)) == (502, WITHHELD)
    answer = b'{"choices":[{"index":0,"message":{"role":"assistant","content":"the secret"},"finish_reason":"stop"}]}'
    gw = InProcess(
        lambda q: MockResponse(200, {"content-type": "application/json"}, [answer]), verifier=GuardingVerifier("secret")
    )
    r = asyncio.run(gw.post("/v1/chat/completions", chat(max_tokens=5)))
    assert (r.status_code, error_of(r)) == (502, WITHHELD)


def test_a_read_of_many_events_lets_the_loop_run_between_slices(monkeypatch):
    """One upstream read of 20 x EVENTS_PER_TURN comment events and a chunk: they are relayed in
    21 slices with a loop turn between each two, in which another task runs (it counts turns),
    and the client gets every byte. Relayed in one go, such a read (an engine's 22 MB of
    comments) held every other request of the gateway for about 0.4 s."""
    from gateway.relay import stream as stream_mod

    n = 20 * stream_mod.EVENTS_PER_TURN
    body = b": keep-alive\n\n" * n + _chunk("hi", False, "stop") + b"data: [DONE]\n\n"
    gw = InProcess(streaming([body]))
    turns = {"n": 0}
    seen: list[tuple[int, int]] = []  # (events in the slice, turns counted when it was relayed)
    take = stream_mod._Events.take

    def counting_take(self, events, out):
        seen.append((len(events), turns["n"]))
        return take(self, events, out)

    monkeypatch.setattr(stream_mod._Events, "take", counting_take)

    async def run() -> httpx.Response:
        stop = asyncio.Event()

        async def ticker() -> None:
            while not stop.is_set():
                turns["n"] += 1
                await asyncio.sleep(0)

        t = asyncio.create_task(ticker())
        try:
            return await gw.post("/v1/chat/completions", chat(max_tokens=5, stream=True))
        finally:
            stop.set()
            await t

    r = asyncio.run(run())
    assert r.status_code == 200 and r.content == body
    assert [size for size, _ in seen] == [stream_mod.EVENTS_PER_TURN] * 20 + [2]  # the chunk and [DONE]
    marks = [t for _, t in seen]
    assert all(b > a for a, b in zip(marks, marks[1:], strict=False))  # the ticker ran between every two slices
