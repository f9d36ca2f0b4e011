"""EngineCounter against a real HTTP server on loopback that answers both tokenize shapes:
SGLang ``POST /v1/tokenize`` (prompt: str or list of str) and vLLM ``POST /tokenize`` (prompt or
messages). The server counts with the bundled tokenizer, so the expected values are exact."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from config.models import TokenizerConfig
from tokenizer import (
    EngineTokenizeError,
    InvalidPromptError,
    InvalidTokenIdError,
    UnknownContentPartError,
    bundled_counter,
    make_counter,
)
from tokenizer.engine_counter import EngineCounter

COUNTER = bundled_counter()


class FakeEngine(BaseHTTPRequestHandler):
    """Engine-shaped tokenize endpoints. ``server.mode`` switches to broken answers."""

    def log_message(self, *args: Any) -> None:  # keep pytest output clean
        pass

    def _send(self, status: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("content-type", ctype)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        self.server.requests.append((self.path, body))
        mode = self.server.mode
        if mode == "500":
            return self._send(500, b'{"object": "error", "message": "boom", "code": 500}')
        if mode == "html":
            return self._send(200, b"<html>not json</html>", "text/html")
        if mode == "list":
            return self._send(200, b"[1, 2, 3]")
        if mode == "no-count":
            return self._send(200, b'{"max_model_len": 8192}')
        if mode == "bool-count":
            return self._send(200, b'{"count": true}')
        if self.path in ("/v1/detokenize", "/detokenize"):  # SGLang: {"text"}; vLLM: {"prompt"}
            if mode == "no-text":
                return self._send(200, b'{"tokens": [1]}')
            key = "text" if self.path == "/v1/detokenize" else "prompt"
            return self._send(200, json.dumps({key: COUNTER.decode(body["tokens"])}).encode())
        if self.path == "/v1/tokenize":  # SGLang: prompt only (str or list of str)
            prompt = body.get("prompt")
            if "messages" in body and self.server.sglang_accepts_messages:
                ids = COUNTER.encode_chat(body["messages"], body.get("tools"))
                return self._send(200, json.dumps({"tokens": ids, "count": len(ids), "max_model_len": 8192}).encode())
            if isinstance(prompt, str):
                ids = COUNTER.encode_text(prompt)
                return self._send(200, json.dumps({"tokens": ids, "count": len(ids), "max_model_len": 8192}).encode())
            if isinstance(prompt, list):
                ids = [COUNTER.encode_text(p) for p in prompt]
                out = {"tokens": ids, "count": [len(i) for i in ids], "max_model_len": 8192}
                return self._send(200, json.dumps(out).encode())
            return self._send(400, b'{"object": "error", "message": "prompt is required", "code": 400}')
        if self.path == "/tokenize":  # vLLM: prompt (str) or messages
            if "messages" in body:
                assert body["add_generation_prompt"] is True
                ids = COUNTER.encode_chat(body["messages"], body.get("tools"))
            else:
                assert isinstance(body["prompt"], str)
                ids = COUNTER.encode_text(body["prompt"])
            if mode == "tokens-only":
                return self._send(200, json.dumps({"tokens": ids}).encode())
            return self._send(200, json.dumps({"count": len(ids), "max_model_len": 8192, "tokens": ids}).encode())
        return self._send(404, b'{"detail": "Not Found"}')


@pytest.fixture
def engine():
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeEngine)
    server.requests = []
    server.mode = "ok"
    server.sglang_accepts_messages = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def base(server) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}"


CHAT = [
    {"role": "system", "content": "Be brief."},
    {
        "role": "user",
        "name": "bob",
        "content": [
            {"type": "text", "text": "hello world <|endoftext|>"},
            {"type": "image_url", "image_url": {"url": "data:,"}},
        ],
    },
]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("api,path", [("sglang", "/v1/tokenize"), ("vllm", "/tokenize")])
async def test_counts_equal_the_engine(engine, api, path):
    counter = make_counter(TokenizerConfig(kind="engine", url=base(engine), engine_api=api, image_tokens=100), "m1")
    assert isinstance(counter, EngineCounter) and counter.url == base(engine) + path
    try:
        assert (await counter.acount_prompt("hello world")).per_prompt == (2,)
        assert (await counter.acount_prompt("<|endoftext|>")).per_prompt == (7,)
        assert (await counter.acount_prompt([15339, 1917])).per_prompt == (2,)
        assert (await counter.acount_prompt([[1, 2, 3], [4]])).per_prompt == (3, 1)
        engine.requests.clear()
        batch = await counter.acount_prompt(["hello world", "hi", "<|im_start|>"])
        assert batch.per_prompt == (2, 1, 6)
        # one string per request, the shape every engine takes
        assert sorted(b["prompt"] for _, b in engine.requests) == ["<|im_start|>", "hello world", "hi"]
        assert {p for p, _ in engine.requests} == {path}
        assert all(b["model"] == "m1" and b["add_special_tokens"] is True for _, b in engine.requests)
        engine.requests.clear()
        count = await counter.acount_chat(CHAT, TOOLS)
        text_only = [CHAT[0], {**CHAT[1], "content": [CHAT[1]["content"][0]]}]
        assert count == COUNTER.count_chat(text_only, TOOLS) + 100
        ((p, sent),) = engine.requests
        assert p == path and sent["add_generation_prompt"] is True and sent["tools"] == TOOLS
        assert sent["messages"][1]["content"] == [CHAT[1]["content"][0]]  # image parts are not sent
    finally:
        await counter.aclose()


async def test_ids_and_shapes_are_checked_before_any_request(engine):
    counter = EngineCounter(base(engine), "m1", api="vllm", vocab_size=1000)
    try:
        with pytest.raises(InvalidTokenIdError) as ei:
            await counter.acount_prompt([[1], [1000]])
        assert ei.value.param == "prompt[1]"
        with pytest.raises(InvalidTokenIdError) as ei:
            await counter.acount_prompt([5, -1])
        assert ei.value.param == "prompt"
        with pytest.raises(InvalidPromptError):
            await counter.acount_prompt([])
        with pytest.raises(UnknownContentPartError) as ei:
            await counter.acount_chat([{"role": "user", "content": [{"type": "file"}]}])
        assert ei.value.param == "messages[0].content[0].type"
        assert engine.requests == []
    finally:
        await counter.aclose()


async def test_sglang_batch_answer_shape_is_understood():
    from tokenizer.engine_counter import _counts_of

    assert _counts_of({"tokens": [[1, 2], [3]], "count": [2, 1], "max_model_len": 8}, 2) == [2, 1]
    assert _counts_of({"tokens": [[1, 2], [3]]}, 2) == [2, 1]
    with pytest.raises(EngineTokenizeError):
        _counts_of({"count": [2]}, 2)


async def test_tokens_only_answer_is_counted(engine):
    engine.mode = "tokens-only"
    counter = EngineCounter(base(engine), "m1", api="vllm")
    try:
        assert (await counter.acount_prompt("hello world")).per_prompt == (2,)
    finally:
        await counter.aclose()


@pytest.mark.parametrize(
    "mode,needle",
    [
        ("500", "answered HTTP 500"),
        ("html", "not JSON"),
        ("list", "not an object"),
        ("no-count", "without a usable 'count'"),
        ("bool-count", "without a usable 'count'"),
    ],
)
async def test_engine_faults_are_502_not_500(engine, mode, needle):
    engine.mode = mode
    counter = EngineCounter(base(engine), "m1", api="sglang")
    try:
        with pytest.raises(EngineTokenizeError, match=needle) as ei:
            await counter.acount_prompt("hello")
        assert (ei.value.status, ei.value.code) == (502, "upstream_unavailable")
    finally:
        await counter.aclose()


async def test_sglang_without_chat_support_is_an_engine_error(engine):
    engine.sglang_accepts_messages = False  # real SGLang: /v1/tokenize takes no messages
    counter = EngineCounter(base(engine), "m1", api="sglang")
    try:
        with pytest.raises(EngineTokenizeError, match="HTTP 400"):
            await counter.acount_chat([{"role": "user", "content": "hi"}])
    finally:
        await counter.aclose()


async def test_unreachable_engine(engine):
    port = engine.server_address[1]
    engine.shutdown()
    engine.server_close()
    counter = EngineCounter(f"http://127.0.0.1:{port}", "m1", timeout_seconds=2)
    try:
        with pytest.raises(EngineTokenizeError, match="ConnectError"):
            await counter.acount_prompt("hello")
    finally:
        await counter.aclose()


def test_sync_api_is_refused_and_api_names_checked():
    counter = EngineCounter("http://127.0.0.1:9", "m1")
    with pytest.raises(NotImplementedError):
        counter.count_text("x")
    with pytest.raises(NotImplementedError):
        counter.count_chat([{"role": "user", "content": "x"}])
    with pytest.raises(ValueError):
        EngineCounter("http://127.0.0.1:9", "m1", api="tgi")


@pytest.mark.parametrize("api,path", [("sglang", "/v1/detokenize"), ("vllm", "/detokenize")])
async def test_decode_asks_the_engines_detokenize(engine, api, path):
    """Token ids cut inside a UTF-8 character decode with U+FFFD (the engine's answer, kept as is);
    each engine's answer shape is read."""
    ids = COUNTER.encode_text("note 日本")
    cut = ids[:-1] if len(COUNTER.decode(ids[-1:])) != 1 else ids
    counter = EngineCounter(base(engine), "m1", api=api)
    try:
        text = await counter.adecode(cut)
        assert text == COUNTER.decode(cut)
        assert engine.requests[-1] == (path, {"model": "m1", "tokens": cut})
        with pytest.raises(NotImplementedError):
            counter.decode(cut)
        engine.mode = "no-text"
        with pytest.raises(EngineTokenizeError, match="without a 'text' string") as ei:
            await counter.adecode(cut)
        assert ei.value.status == 502
    finally:
        await counter.aclose()


def test_a_view_equal_to_the_messages_is_not_rendered_again(monkeypatch) -> None:
    """A chat each engine hands to the template as sent is rendered and counted once (the
    engines' views equal the messages); one whose tool-call arguments an engine parses is
    rendered for that engine too, and counts as the largest rendering, as before."""
    import tokenizer.tiktoken_counter as tc
    from tokenizer.tiktoken_counter import bundled_counter

    renders: list[int] = []
    real = tc.render_chatml

    def counting(*a, **kw):
        renders.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(tc, "render_chatml", counting)
    counter = bundled_counter()
    counter.engines = frozenset({"sglang", "vllm"})
    plain = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}]
    # 5 specials, "system\nBe brief." 5, "user\nSay hello." 5, two "\n", "assistant\n" 2
    assert counter.count_chat(plain) == 19 and len(renders) == 1
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a":  1}'}}
    tools = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    renders.clear()
    parsed = counter.count_chat(tools)
    assert len(renders) == 3  # as sent (validation), then each engine's parsed arguments
    assert parsed == max(
        tc.chatml_token_count(real(tc.chatml_view(tools, v), None), counter.count_text, 0) for v in ("sglang", "vllm")
    )
