"""Unit tests of the gateway's pieces that need no server: the pool formula, SSE splitting on
bytes, usage stripping, engine error mapping, request validation, tenants, admission."""

from __future__ import annotations

import pytest

from config.errors import OpenAIError
from config.loader import ConfigError
from config.models import Settings, TenantConfig
from config.pool import effective_pool_limit, pool_limit_from_headroom
from gateway.admission.body import parse_json_body
from gateway.admission.gate import CountedPrompt, decide
from gateway.admission.registry import ModelIndex
from gateway.ops.pool_watcher import PoolReadError, limit_from_server_info, limit_from_vllm_models
from gateway.ops.tenants import TenantRegistry, hash_key
from gateway.relay.sse import SSEEventTooLarge, SSESplitter, data_of, inspect, strip_usage_null
from gateway.relay.stream import Tally
from gateway.routes import CHAT, COMPLETIONS
from gateway.routes.handlers import request_id_of
from verifier.engine_response import EngineOutput, engine_error, strict_view


# ---------------------------------------------------------------- pool formula
def test_incident_pool_gives_runbook_limit():
    assert effective_pool_limit(1_048_576, 681_280, None, 1.25) == 545_024


def test_fixed_pool_gives_context_less_sglang_reserve():
    # ~2.04 M pool: floor(2_040_000 / 1.25) = 1_632_000 > context, so max_req_input_len decides
    assert effective_pool_limit(1_048_576, 2_040_000, 1_048_570, 1.25) == 1_048_570
    assert effective_pool_limit(1_048_576, 2_040_000, None, 1.25) == 1_048_576


def test_headroom_floor_is_exact():
    assert pool_limit_from_headroom(4096, 1.25) == 3276
    assert pool_limit_from_headroom(5, 1.25) == 4
    assert pool_limit_from_headroom(100, 1.1) == 90  # 90.909 -> 90; float 100/1.1 = 90.90909...
    assert pool_limit_from_headroom(110, 1.1) == 100  # float 110/1.1 = 99.99999999999999
    with pytest.raises(ValueError):
        pool_limit_from_headroom(10, 0.5)


def test_server_info_fields():
    assert limit_from_server_info({"max_total_num_tokens": 4096, "context_length": 8192}, 1.25) == (4096, 3276)
    assert limit_from_server_info({"max_total_num_tokens": 10_000, "max_req_input_len": 2000}, 1.25) == (10_000, 2000)
    assert limit_from_server_info({"internal_states": [{"max_total_num_tokens": 400}]}, 1.0, 8192) == (400, 400)
    with pytest.raises(PoolReadError):
        limit_from_server_info({"context_length": 8192}, 1.25)
    with pytest.raises(PoolReadError):
        limit_from_server_info({"max_total_num_tokens": True}, 1.25)
    assert limit_from_vllm_models({"data": [{"id": "m", "max_model_len": 4000}]}, 1.25, 8192) == (4000, 3200)
    with pytest.raises(PoolReadError):
        limit_from_vllm_models({"data": [{"id": "m"}]}, 1.25)


# ---------------------------------------------------------------- SSE on bytes
EVENTS = [
    b'data: {"choices":[{"delta":{"content":"caf\xc3\xa9 \xe2\x80\xa8 line"}}]}\n\n',  # U+00E9 and raw U+2028
    b'data: {"choices":[{"delta":{"content":"\\u2028 escaped, \xf0\x9f\x98\x80"}}]}\n\n',  # 4-byte emoji
    b": a comment\n\n",
    b"data: [DONE]\n\n",
]


@pytest.mark.parametrize("step", [1, 2, 3, 5, 7, 64])
def test_splitter_keeps_every_byte_whatever_the_cuts(step):
    stream = b"".join(EVENTS)
    sp = SSESplitter()
    got = []
    for i in range(0, len(stream), step):
        got += sp.feed(stream[i : i + step])
    assert got == EVENTS
    assert sp.tail() == b""


def test_splitter_crlf_and_multiline_data():
    sp = SSESplitter()
    got = sp.feed(b'data: {"a":\r\ndata: 1}\r\n\r\ndata: x\n\nincomplete')
    assert got == [b'data: {"a":\r\ndata: 1}\r\n\r\n', b"data: x\n\n"]
    assert data_of(got[0]) == b'{"a":\n1}'
    assert sp.tail() == b"incomplete"


def test_splitter_finds_terminators_cut_across_reads_and_mixed_endings():
    stream = b"data: a\r\n\r\ndata: b\n\ndata: c\r\n\r\n: x\n\n"
    want = [b"data: a\r\n\r\n", b"data: b\n\n", b"data: c\r\n\r\n", b": x\n\n"]
    for cut in range(1, len(stream)):
        for cut2 in range(cut, len(stream)):
            sp = SSESplitter()
            got = sp.feed(stream[:cut]) + sp.feed(stream[cut:cut2]) + sp.feed(stream[cut2:])
            assert got == want, (cut, cut2)
            assert sp.tail() == b""


def test_splitter_bounds_one_event():
    ev = b"data: " + b"x" * 94 + b"\n\n"  # 102 bytes
    sp = SSESplitter(max_event_bytes=102)
    assert sp.feed(ev + ev[:50]) == [ev]  # exactly the limit passes
    assert sp.feed(ev[50:]) == [ev]
    with pytest.raises(SSEEventTooLarge) as ei:
        SSESplitter(max_event_bytes=101).feed(b"data: 1\n\n" + ev)
    assert (ei.value.size, ei.value.limit, ei.value.before) == (102, 101, [b"data: 1\n\n"])
    # an unfinished event is bounded too: 16 KiB reads of an 8 MiB event stop at the first read past it
    sp = SSESplitter(max_event_bytes=1 << 20)
    piece = b"data: " + b"y" * (16 * 1024 - 6)
    fed = 0
    with pytest.raises(SSEEventTooLarge) as ei:
        for _ in range(512):
            sp.feed(piece)
            fed += 1
    assert (fed, ei.value.size, ei.value.limit) == (64, 65 * 16 * 1024, 1 << 20)
    assert sp.tail() == b""  # the buffer is released
    unbounded = SSESplitter(max_event_bytes=None)
    assert unbounded.feed(b"data: " + b"z" * (3 << 20)) == [] and len(unbounded.tail()) == 6 + (3 << 20)


@pytest.mark.parametrize(
    ("header", "ttft"),
    [("0.25", 0.25), ("0", 0.0), ("inf", None), ("nan", None), ("-1", None), ("1e999", None), ("x", None)],
)
def test_a_whole_answers_ttft_is_a_finite_duration_or_none(header, ttft):
    """An engine's x-prefill-seconds is the TTFT of a whole answer only when it is a finite number
    of seconds, at least 0 ("inf" once reached the latency sketch and backed the leak index off)."""
    tally = Tally(0.0)
    tally.take_body(EngineOutput(texts={0: "hi"}, finish_reason="stop"), header)
    assert (tally.ttft_seconds, tally.texts) == (ttft, {0: ["hi"]})


def test_inspect_kinds():
    assert inspect(EVENTS[0]).text == "caf\u00e9 \u2028 line"
    assert inspect(EVENTS[3]).kind == "done"
    assert inspect(EVENTS[2]).kind == "other"
    e = inspect(b'data: {"object":"error","message":"bad","code":400}\n\n')
    assert e.kind == "error"
    u = inspect(b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}\n\n')
    assert (u.kind, u.usage_only, u.usage) == ("chunk", True, {"prompt_tokens": 3, "completion_tokens": 2})
    f = inspect(b'data: {"choices":[{"text":"","finish_reason":"abort"}]}\n\n')
    assert f.finish_reason == "abort"


def test_strip_usage_null_leaves_other_bytes():
    ev = b'data: {"id": "c1", "choices": [{"delta": {"content": "\\"usage\\": null"}}], "usage": null}\n\n'
    assert strip_usage_null(ev) == b'data: {"id": "c1", "choices": [{"delta": {"content": "\\"usage\\": null"}}]}\n\n'
    ev2 = b'data: {"usage":null,"id":"x"}\n\n'
    assert strip_usage_null(ev2) == b'data: {"id":"x"}\n\n'
    ev3 = b'data: {"id":"x","usage":{"prompt_tokens":1}}\n\n'
    assert strip_usage_null(ev3) == ev3


# ---------------------------------------------------------------- engine errors
def test_engine_error_shapes():
    sglang = engine_error(
        400, b'{"object":"error","message":"bad temp","type":"BadRequestError","param":null,"code":400}'
    )
    assert (sglang.status, sglang.body()) == (
        400,
        {"error": {"message": "bad temp", "type": "invalid_request_error", "param": None, "code": None}},
    )
    vllm = engine_error(422, b'{"error":{"message":"nope","type":"BadRequestError","param":"n","code":422}}')
    assert (vllm.status, vllm.body()["error"]) == (
        422,
        {"message": "nope", "type": "invalid_request_error", "param": "n", "code": None},
    )
    gen = engine_error(500, b'{"error":{"message":"CUDA out of memory"}}')
    assert (gen.status, gen.body()["error"]["type"], gen.message) == (500, "server_error", "CUDA out of memory")
    text = engine_error(503, b"upstream connect error")
    assert (text.status, text.message) == (503, "The upstream engine answered 503: upstream connect error")
    in_stream = engine_error(200, {"error": {"message": "The input is too long", "code": 400}})
    assert in_stream.status == 400
    no_code = engine_error(200, {"object": "error", "message": "x"})
    assert no_code.status == 502


@pytest.mark.parametrize(
    ("status", "body", "want"),
    [
        (600, b"{}", 502),
        (999, b'{"error":{"message":"odd","code":400}}', 502),
        (499, b"{}", 502),  # the gateway's own status for a client that went away
        (204, b"", 502),
        (200, b'{"error":{"message":"x","code":999}}', 502),
        (200, b'{"error":{"message":"x","code":499}}', 502),
        (200, b'{"error":{"message":"x","code":429}}', 429),
        (599, b"{}", 599),
    ],
)
def test_engine_error_status_is_one_the_gateway_can_answer(status, body, want):
    """An engine's 600 or 999 reached the server layer, which knows no such status line: the
    client's connection was dropped and a KeyError logged as a 500."""
    assert engine_error(status, body).status == want


@pytest.mark.parametrize(
    ("status", "body", "engine_status"),
    [
        (401, b'{"error":"Unauthorized"}', 401),
        (403, b"", 403),
        (407, b'{"detail":"Proxy Authentication Required"}', 407),
        (200, b'{"error":{"message":"bad key","code":403}}', 403),  # an error event's or body's code
        (200, b'{"object":"error","message":"bad key","code":401}', 401),
    ],
)
def test_an_engine_refusing_the_gateways_credentials_is_502_upstream_unavailable(status, body, engine_status):
    """401, 403 and 407 from an engine refuse the gateway's own key, not the client's: 502
    ``upstream_unavailable`` (the engine's message after the gateway's words), not relayed."""
    err = engine_error(status, body)
    assert (err.status, err.code, err.type, err.param, err.engine_status) == (
        502,
        "upstream_unavailable",
        None,
        None,
        engine_status,
    )
    assert err.message.startswith(f"The upstream engine refused the gateway's own credentials ({engine_status}); ")
    assert engine_error(404, b'{"error":{"message":"no such response","code":404}}').status == 404


def test_strict_view_keeps_the_gateways_retry_after():
    err = engine_error(429, b'{"error":{"message":"tenant b: busy"}}')
    err.headers = {"Retry-After": "30"}
    view = strict_view(err)
    assert (view.status, view.headers, "tenant b" in view.message) == (429, {"Retry-After": "30"}, False)


# ---------------------------------------------------------------- parsing and validation
@pytest.mark.parametrize(
    "raw", [b"", b"{", b"[1]", b'{"a": NaN}', b'{"a": Infinity}', b'{"a": "\xff"}', b'{"a": "\\ud800"}']
)
def test_parse_rejects(raw):
    with pytest.raises(OpenAIError) as e:
        parse_json_body(raw)
    assert e.value.status == 400


@pytest.mark.parametrize(
    "body,param",
    [
        ({"messages": [], "max_tokens": "5"}, "max_tokens"),
        ({"messages": [], "max_tokens": True}, "max_tokens"),
        ({"messages": [], "temperature": 3}, "temperature"),
        ({"messages": [], "stream": "yes"}, "stream"),
        ({"messages": [], "n": 0}, "n"),
        ({"messages": [], "stop": [1]}, "stop"),
        ({"messages": [], "bogus": 1}, "bogus"),
        ({"model": "m"}, "messages"),
        ({"messages": [], "stream_options": {"include_usage": True}}, "stream_options"),
    ],
)
def test_validate_names_param(body, param):
    with pytest.raises(OpenAIError) as e:
        CHAT.validate(body)
    assert (e.value.status, e.value.param) == (400, param)


def test_validate_accepts_nulls_and_engine_extensions():
    CHAT.validate(
        {"messages": [], "max_tokens": None, "top_k": 20, "stream": True, "stream_options": {"include_usage": False}}
    )
    COMPLETIONS.validate({"prompt": "x", "echo": False, "logprobs": 2})


# ---------------------------------------------------------------- tenants
def test_registry_lookup_and_atomic_reload(tmp_path):
    path = tmp_path / "tenants.yaml"
    path.write_text(f"tenants:\n  - id: one\n    api_key_sha256: [{hash_key('k1')}]\n")
    reg = TenantRegistry.from_path(path)
    assert reg.lookup("k1").id == "one"
    assert reg.lookup("k2") is None
    path.write_text(f"tenants:\n  - id: two\n    api_key_sha256: [{hash_key('k2')}]\n")
    reg.reload()
    assert reg.lookup("k1") is None and reg.lookup("k2").id == "two"
    path.write_text("tenants: [{id: 'bad id!'}]\n")
    with pytest.raises(ConfigError, match=r"line 1: tenants\[0\]\.id: must be 1-64 characters .* \(got 'bad id!'\)"):
        reg.reload()
    assert reg.lookup("k2").id == "two"  # the old table stays


def test_request_id():
    assert request_id_of("abc-123") == "abc-123"
    generated = request_id_of("bad id with spaces")
    assert len(generated) == 32 and generated != request_id_of(None)


# ---------------------------------------------------------------- admission
def _setup(**tenant):
    s = Settings.model_validate({"models": [{"id": "m", "context_length": 8192}]})
    idx = ModelIndex(s)
    t = TenantConfig.model_validate({"id": "t", "default_max_tokens": 64, **tenant})
    return idx, t


def test_a_counter_that_fails_to_warm_up_is_logged_and_the_rest_warm_up(monkeypatch, caplog):
    """:meth:`ModelIndex.warm_up` (the app's start) never fails the start: a model whose counter
    raises is logged, and its requests meet the error as they would have; the next model warms up."""
    s = Settings.model_validate({"models": [{"id": "m", "context_length": 8192}, {"id": "n", "context_length": 8192}]})
    idx = ModelIndex(s)
    m, n = idx.by_name["m"].counter, idx.by_name["n"].counter
    warmed: list[str] = []

    def broken() -> None:
        raise ValueError("template does not render")

    monkeypatch.setattr(m, "warm_up", broken)
    monkeypatch.setattr(n, "warm_up", lambda: warmed.append("n"))
    with caplog.at_level("WARNING", logger="kvgate.models"):
        idx.warm_up()
    assert warmed == ["n"]
    assert [r.getMessage() for r in caplog.records] == [
        "warming up the counter of model m failed: template does not render"
    ]


def test_gate_boundary_and_message():
    idx, t = _setup()
    e = idx.resolve(t, "m")
    a = decide(e, t, {"max_tokens": 189}, CHAT, CountedPrompt(11, 11, 1), 200)
    assert (a.limit, a.max_tokens, a.reserve_tokens, a.defaulted) == (200, 189, 200, False)
    with pytest.raises(OpenAIError) as err:
        decide(e, t, {"max_tokens": 190}, CHAT, CountedPrompt(11, 11, 1), 200)
    assert err.value.body() == {
        "error": {
            "message": "This model's maximum context length is 200 tokens. However, you requested 201 tokens "
            "(11 in the messages, 190 in the completion). Please reduce the length of the messages "
            "or completion.",
            "type": "invalid_request_error",
            "param": "messages",
            "code": "context_length_exceeded",
        }
    }


def test_max_tokens_rules():
    idx, t = _setup(max_tokens_cap=100, max_context_tokens=150)
    e = idx.resolve(t, None)  # the tenant's only model
    assert decide(e, t, {}, COMPLETIONS, CountedPrompt(100, 100, 1), 3276).max_tokens == 50  # min(64, 150 - 100)
    assert decide(e, t, {}, COMPLETIONS, CountedPrompt(10, 10, 1), 3276).max_tokens == 64
    a = decide(e, t, {"max_tokens": 5, "n": 3}, COMPLETIONS, CountedPrompt(10, 25, 2), 3276)
    assert a.reserve_tokens == 3 * (25 + 2 * 5)  # every sequence holds its prompt's KV: n x (prompts + bounds)
    assert a.sequences == 6
    assert (
        decide(e, t, {"max_tokens": 500, "max_completion_tokens": 7}, CHAT, CountedPrompt(1, 1, 1), 3276).max_tokens
        == 7
    )
    with pytest.raises(OpenAIError) as err:
        decide(e, t, {"max_tokens": 101}, CHAT, CountedPrompt(1, 1, 1), 3276)
    assert (err.value.status, err.value.param) == (400, "max_tokens")
    with pytest.raises(OpenAIError) as err:  # max_tokens 0 is refused at validation, before any counting
        COMPLETIONS.validate({"prompt": "x", "max_tokens": 0})
    assert (err.value.status, err.value.param) == (400, "max_tokens")
    with pytest.raises(OpenAIError) as err:  # a defaulted bound still needs room for one token
        decide(e, t, {}, COMPLETIONS, CountedPrompt(150, 150, 1), 3276)
    assert "(150 in the prompt, 1 in the completion)" in err.value.message
    with pytest.raises(OpenAIError) as err:
        idx.resolve(t, "other")
    assert (err.value.status, err.value.code) == (404, "model_not_found")
