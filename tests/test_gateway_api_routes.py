"""``/v1/responses``, ``/v1/embeddings``, ``/tokenize`` and ``/detokenize`` through the whole
gateway (real app on a free port) against the mock engine of tests/mock_api_engine.py, driven by
the official ``openai`` SDK where it has the route: exact counts, the limit and limit + 1,
stateful refusals, quotas (429), strict withholding, a stream's exact bytes, disconnects."""

from __future__ import annotations

import base64
import json
import struct
import time
from typing import Any

import httpx
import openai
import pytest

from config.errors import MAX_MESSAGE_CHARS, bounded
from gateway.quotas.tenant_quotas import build_quota_stage
from gateway.routes.embeddings import embedding_length_message
from gateway.routes.responses import responses_length_message
from tests.gateway_harness import KEY_A, KEY_B, MODEL, SECRETS, Gateway, settings_for, tenants, upstream, wait_for
from tests.mock_api_engine import COUNTER, ApiMockEngine, response_stream
from tests.mock_engine import gateway_id
from tests.test_gateway_pipeline import access  # noqa: F401  (the access fixture)
from tokenizer.errors import EngineTokenizeError
from verifier.build import build_verifier

pytestmark = [pytest.mark.timeout(60), pytest.mark.engine("api")]

EMB = "embed-tiny"
LIMIT = 200  # tenant-a's max_context_tokens: the effective limit (the pool allows more)


def api_settings(engine: ApiMockEngine, *, up: dict | None = None, verifier: bool = False, quotas: bool = False):
    """:func:`tests.gateway_harness.settings_for` with the embedding model :data:`EMB` beside
    :data:`MODEL` on ``engine``."""
    return settings_for(
        [{**upstream("u1", engine), "models": [MODEL, EMB], **(up or {})}],
        gateway={"max_body_bytes": 1 << 16},
        models=[{"id": EMB, "context_length": 8192, "task": "embedding", "matryoshka": True}],
        verifier={"enabled": verifier, "strict_holdback_tokens": 16},
        quotas={"enabled": quotas, "window_seconds": 60},
    )


def start(engine: ApiMockEngine, *, up: dict | None = None, verifier: bool = False, quotas: bool = False, **a: Any):
    s = api_settings(engine, up=up, verifier=verifier, quotas=quotas)
    kw: dict[str, Any] = {}
    if verifier:
        kw["verifier"] = build_verifier(s, secrets=SECRETS)
    if quotas:
        kw["quotas"] = build_quota_stage(s)
    reg = tenants(**{"max_context_tokens": LIMIT, "allowed_models": [MODEL, EMB], "max_embedding_inputs": 4, **a})
    return Gateway(s, reg, **kw).start()


@pytest.fixture
def gw(engine):
    g = start(engine)
    yield g
    g.stop()


def sdk(gw: Gateway, key: str = KEY_A) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=10)


def error_of(r: httpx.Response) -> dict:
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def forwarded(engine: ApiMockEngine, path: str) -> list[dict]:
    return [r["body"] for r in engine.state.requests if r["path"] == path]


# ---------------------------------------------------------------- /v1/responses
def test_responses_at_the_limit_is_served_and_one_over_is_context_length_exceeded(gw, engine):
    client = sdk(gw)
    r = client.responses.create(model=MODEL, input="Say hello.", max_output_tokens=LIMIT - 11)  # 11 + 189 == 200
    assert r.output_text == "Hello from the mock."
    assert (r.usage.input_tokens, r.usage.output_tokens) == (11, 4)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="Say hello.", max_output_tokens=LIMIT - 10)
    assert (e.value.status_code, e.value.code, e.value.param) == (400, "context_length_exceeded", "input")
    assert e.value.body["message"] == responses_length_message(LIMIT, 11, LIMIT - 10)
    [sent] = forwarded(engine, "/v1/responses")
    assert sent["model"] == MODEL and sent["max_output_tokens"] == 189 and sent["store"] is False
    assert sent["cache_salt"] == gw.gw.cache_salt("tenant-a") and "stream_options" not in sent


@pytest.fixture
def gw_bundled(engine):
    """The gateway with the mock declared the bundled engine (``engine: kvgate``), which takes
    tool-call arguments as sent, as the mock counts (SGLang and vLLM parse them first)."""
    g = start(engine, up={"engine": "kvgate", "models": [MODEL]})
    yield g
    g.stop()


def test_responses_counts_instructions_items_and_tools_exactly(gw_bundled, engine):
    gw = gw_bundled
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "What is 2+2?"}]},
        {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a":2,"b":2}'},
        {"type": "function_call_output", "call_id": "c1", "output": "4"},
    ]
    tools = [{"type": "function", "name": "add", "parameters": {"type": "object"}}]
    from tokenizer.responses import count_responses, responses_to_chat

    n = count_responses(COUNTER, responses_to_chat(items, "Be brief.", tools))
    assert n == 100
    client = sdk(gw)
    r = client.responses.create(
        model=MODEL, input=items, instructions="Be brief.", tools=tools, max_output_tokens=LIMIT - n
    )
    assert r.usage.input_tokens == n  # the mock counts like the bundled engine: the same number
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(
            model=MODEL, input=items, instructions="Be brief.", tools=tools, max_output_tokens=LIMIT - n + 1
        )
    assert e.value.body["message"] == responses_length_message(LIMIT, n, LIMIT - n + 1)


def test_responses_default_max_output_tokens_and_the_tenant_cap(engine):
    g = start(engine, max_tokens_cap=100)
    try:
        with g.client() as c:
            assert c.post("/v1/responses", json={"model": MODEL, "input": "Say hello."}).status_code == 200
            r = c.post("/v1/responses", json={"model": MODEL, "input": "Say hello.", "max_output_tokens": 101})
        assert r.status_code == 400
        assert error_of(r) == {
            "message": "'max_output_tokens' is 101, above this key's cap of 100 tokens.",
            "type": "invalid_request_error",
            "param": "max_output_tokens",
            "code": "invalid_request",
        }
    finally:
        g.stop()
    [sent] = forwarded(engine, "/v1/responses")
    assert sent["max_output_tokens"] == 16  # min(default 16, 200 - 11, cap 100)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"background": True}, "background"),
        ({"store": True}, "store"),
    ],
)
def test_stateful_features_are_refused_by_default(gw, engine, extra, param):
    with gw.client() as c:
        r = c.post("/v1/responses", json={"model": MODEL, "input": "hi", **extra})
    assert r.status_code == 400 and error_of(r)["param"] == param
    assert "cannot count or gate" in error_of(r)["message"]
    assert forwarded(engine, "/v1/responses") == []


def test_stateful_features_pass_through_when_the_upstream_allows_them(engine):
    g = start(engine, up={"pass_stateful_responses": True})
    try:
        with g.client() as c:
            body = {"model": MODEL, "input": "hi", "store": True, "previous_response_id": "resp_0"}
            assert c.post("/v1/responses", json=body).status_code == 200
            assert c.post("/v1/responses", json={"model": MODEL, "input": "hi"}).status_code == 200
    finally:
        g.stop()
    first, second = forwarded(engine, "/v1/responses")
    assert first["store"] is True and first["previous_response_id"] == "resp_0"
    assert "store" not in second  # nothing forced either way


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
            "input[0].content[0].type",
        ),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": "x", "prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://h/x.png"}]}]},
            "input[0].content[0].image_url",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}]},
            "input[0].content[0].image_url",
        ),
        ({"input": "x", "min_tokens": 5}, "min_tokens"),  # no engine's Responses model reads it
        ({"input": "x", "stream_options": {"include_obfuscation": False}}, "stream_options"),
        ({"input": "x", "truncation": "sometimes"}, "truncation"),
        ({}, "input"),
    ],
)
def test_bad_responses_requests_are_400_and_forward_nothing(gw, engine, body, param):
    with gw.client() as c:
        r = c.post("/v1/responses", json={"model": MODEL, **body})
    assert r.status_code == 400 and error_of(r)["param"] == param
    assert forwarded(engine, "/v1/responses") == []


def test_responses_stream_is_relayed_byte_exact_without_done(gw, engine):
    body = {"model": MODEL, "input": "Say hello.", "max_output_tokens": 8, "stream": True}
    with gw.client() as c, c.stream("POST", "/v1/responses", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = b"".join(r.iter_raw())
    [sent] = forwarded(engine, "/v1/responses")
    assert raw == b"".join(response_stream(engine.state, sent))
    assert b"[DONE]" not in raw and "stream_options" not in sent


def test_sdk_streams_responses_and_reads_usage_from_completed(gw):
    events = list(sdk(gw).responses.create(model=MODEL, input="Say hello.", max_output_tokens=8, stream=True))
    types = [e.type for e in events]
    assert types[0] == "response.created" and types[-1] == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Hello from the mock."
    assert (events[-1].response.usage.input_tokens, events[-1].response.usage.output_tokens) == (11, 4)


def test_engine_error_event_before_output_is_an_http_error(gw, engine):
    engine.state.responses_events = [
        b'event: response.created\ndata: {"type":"response.created","sequence_number":0,"response":{"id":"r"}}\n\n',
        b'event: error\ndata: {"type":"error","code":"invalid_prompt","message":"engine says no","param":null,'
        b'"sequence_number":1}\n\n',
    ]
    with pytest.raises(openai.APIStatusError) as e:
        list(sdk(gw).responses.create(model=MODEL, input="hi", stream=True))
    assert e.value.status_code == 502
    assert e.value.body == {
        "message": "engine says no",
        "type": "server_error",
        "param": None,
        "code": "invalid_prompt",
    }


def test_stream_cut_after_output_ends_with_a_responses_error_event(gw, engine):
    delta = (
        b"event: response.output_text.delta\n"
        b'data: {"type":"response.output_text.delta","sequence_number":4,"output_index":0,"delta":"Hi"}\n\n'
    )
    engine.state.responses_events = [delta]
    engine.state.mode = "reset"
    with gw.client() as c, c.stream("POST", "/v1/responses", json={"model": MODEL, "input": "hi", "stream": True}) as r:
        raw = b"".join(r.iter_raw())
    assert raw.startswith(delta)
    tail = raw[len(delta) :]
    assert tail.startswith(b'event: error\ndata: {"type":"error","code":"upstream_unavailable"')
    assert tail.endswith(b'"param":null,"sequence_number":5}\n\n') and b"[DONE]" not in raw


def test_client_disconnect_cancels_the_upstream_response(gw, engine, access):  # noqa: F811
    engine.state.mode = "hang"
    with httpx.Client(base_url=gw.url, headers={"authorization": f"Bearer {KEY_A}"}, timeout=0.5) as c:
        with pytest.raises(httpx.ReadTimeout):
            c.post("/v1/responses", json={"model": MODEL, "input": "hi"}, headers={"x-request-id": "gone-r"})
    assert wait_for(lambda: engine.state.cancelled, 2.0)
    assert wait_for(lambda: len(access("gone-r")) == 1, 2.0)
    sent = gateway_id(access("gone-r")[0]["upstream_request_id"], "gone-r")  # the engine's id for it
    assert engine.state.request_ids() == [sent]
    assert engine.state.cancelled_ids() == [sent]


# ---------------------------------------------------------------- strict mode reads every text field
PLANTED = (
    "The quarterly ledger for the northern warehouse lists four hundred crates of copper wire, "
    "ninety barrels of linseed oil, and a locked cabinet of surveyor maps that nobody has opened since "
    "the spring flood; the night clerk signs for each delivery in green ink and keeps the carbon copies "
    "under the loose floorboard beside the stove."
)


def _plant(g: Gateway) -> None:
    with g.client() as c:
        assert (
            c.post(
                "/v1/chat/completions",
                json={"model": MODEL, "messages": [{"role": "user", "content": PLANTED}], "max_tokens": 4},
            ).status_code
            == 200
        )
    svc = g.gw.verifier
    deadline = time.monotonic() + 10
    while svc.queued_jobs or svc.stats["in_flight"]:
        assert time.monotonic() < deadline
        time.sleep(0.01)


def _strict_gateway(engine: ApiMockEngine) -> Gateway:
    from config.models import TenantsFile
    from gateway.ops.tenants import TenantRegistry, hash_key

    s = api_settings(engine, verifier=True)
    reg = TenantRegistry(
        TenantsFile.model_validate(
            {
                "tenants": [
                    {"id": "tenant-a", "api_key_sha256": [hash_key(KEY_A)], "allowed_models": [MODEL]},
                    {
                        "id": "strict",
                        "api_key_sha256": [hash_key("sk-strict")],
                        "strict_verify": True,
                        "allowed_models": [MODEL],
                    },
                ]
            }
        )
    )
    return Gateway(s, reg, verifier=build_verifier(s, secrets=SECRETS)).start()


def _events(kind: str, text: str) -> list[bytes]:
    from tests.mock_api_engine import sse

    if kind == "snapshot":  # harmless deltas; the leak only in the whole text that the end repeats
        item = {"type": "message", "content": [{"type": "output_text", "text": text}]}
        done = {"id": "r", "status": "completed", "output": [item], "usage": {"input_tokens": 5, "output_tokens": 9}}
        return [
            sse({"type": "response.output_text.delta", "sequence_number": 0, "output_index": 0, "delta": "Fine."}),
            sse({"type": "response.completed", "sequence_number": 1, "response": done}),
        ]
    words = text.split(" ")
    out = [sse({"type": "response.created", "sequence_number": 0, "response": {"id": "r", "status": "in_progress"}})]
    for i, w in enumerate(words):
        out.append(sse({"type": kind, "sequence_number": i + 1, "output_index": 0, "delta": (" " if i else "") + w}))
    out.append(
        sse(
            {
                "type": "response.completed",
                "sequence_number": len(words) + 1,
                "response": {"id": "r", "status": "completed", "usage": {"input_tokens": 5, "output_tokens": 9}},
            }
        )
    )
    return out


@pytest.mark.parametrize(
    "kind",
    [
        "response.output_text.delta",
        "response.reasoning_text.delta",
        "response.function_call_arguments.delta",
        "snapshot",
    ],
)
def test_strict_tenant_stream_is_withheld_whatever_field_carries_the_leak(engine, kind):
    g = _strict_gateway(engine)
    try:
        _plant(g)
        engine.state.responses_events = _events(kind, PLANTED)
        with (
            g.client("sk-strict") as c,
            c.stream("POST", "/v1/responses", json={"model": MODEL, "input": "hi", "stream": True}) as r,
        ):
            raw = b"".join(r.iter_raw())
            status = r.status_code
        assert b"copper wire, ninety barrels" not in raw and b"green ink" not in raw
        assert b"response_withheld" in raw
        assert status in (200, 502)
    finally:
        g.stop()


def test_strict_tenant_whole_response_is_withheld(engine):
    g = _strict_gateway(engine)
    try:
        _plant(g)
        engine.state.text = PLANTED
        with pytest.raises(openai.APIStatusError) as e:
            sdk(g, "sk-strict").responses.create(model=MODEL, input="hi")
        assert e.value.status_code == 502 and e.value.code == "response_withheld"
    finally:
        g.stop()


# ---------------------------------------------------------------- /v1/embeddings
def test_sdk_embeddings_exact_usage_and_vectors(gw, engine):
    r = sdk(gw).embeddings.create(model=EMB, input=["Say hello.", "hello world"])
    assert r.usage.prompt_tokens == 3 + 2 and r.usage.total_tokens == 5
    assert [d.embedding for d in r.data] == [[(i + 1) * (k + 1) / 8 for k in range(8)] for i in range(2)]
    [sent] = forwarded(engine, "/v1/embeddings")
    assert sent == {"model": EMB, "input": ["Say hello.", "hello world"], "encoding_format": "base64"}


def test_embeddings_encoding_format_and_dimensions_pass_through(gw, engine):
    with gw.client() as c:
        r = c.post(
            "/v1/embeddings", json={"model": EMB, "input": [[1, 2, 3]], "encoding_format": "float", "dimensions": 3}
        )
    assert r.status_code == 200 and r.json()["data"][0]["embedding"] == [0.125, 0.25, 0.375]
    assert forwarded(engine, "/v1/embeddings")[0]["dimensions"] == 3
    with gw.client() as c:
        r = c.post("/v1/embeddings", json={"model": EMB, "input": "x", "encoding_format": "base64"})
    assert struct.unpack("<8f", base64.b64decode(r.json()["data"][0]["embedding"]))[0] == 0.125


def test_embedding_input_at_the_limit_is_served_and_one_over_is_refused(gw, engine):
    at, over = [7] * LIMIT, [7] * (LIMIT + 1)
    client = sdk(gw)
    assert client.embeddings.create(model=EMB, input=at, encoding_format="float").usage.prompt_tokens == LIMIT
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=EMB, input=over)
    assert (e.value.code, e.value.param) == ("context_length_exceeded", "input")
    assert e.value.body["message"] == embedding_length_message(LIMIT, LIMIT + 1)
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=EMB, input=[at, over])
    assert e.value.param == "input[1]"
    assert len(forwarded(engine, "/v1/embeddings")) == 1


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"input": ["a"] * 5}, "input", "'input' holds 5 inputs, above this key's cap of 4 inputs per request."),
        ({"input": [[1], [-1]]}, "input[1]", None),
        ({"input": []}, "input", None),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format", None),
        ({"input": "x", "truncate_prompt_tokens": 4}, "truncate_prompt_tokens", None),
        ({"input": "x", "dimensions": 0}, "dimensions", None),
    ],
)
def test_bad_embeddings_requests_are_400(gw, engine, body, param, message):
    with gw.client() as c:
        r = c.post("/v1/embeddings", json={"model": EMB, **body})
    assert r.status_code == 400 and error_of(r)["param"] == param
    if message:
        assert error_of(r)["message"] == message
    assert forwarded(engine, "/v1/embeddings") == []


def test_a_route_the_model_does_not_serve_is_400_naming_model(gw, engine):
    with gw.client() as c:
        r = c.post("/v1/embeddings", json={"model": MODEL, "input": "x"})
        assert r.status_code == 400
        assert error_of(r) == {
            "message": f"The model `{MODEL}` is a chat model and does not serve /v1/embeddings; it serves "
            "/v1/chat/completions, /v1/completions, /v1/responses, /tokenize, /detokenize.",
            "type": "invalid_request_error",
            "param": "model",
            "code": "invalid_request",
        }
        for path, body in (
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
            ("/v1/completions", {"prompt": "x"}),
            ("/v1/responses", {"input": "x"}),
        ):
            r = c.post(path, json={"model": EMB, **body})
            assert r.status_code == 400 and error_of(r)["param"] == "model"
            assert error_of(r)["message"].endswith("it serves /v1/embeddings, /tokenize, /detokenize.")
    assert engine.state.requests == []


# ---------------------------------------------------------------- quotas
def test_tpm_reserves_the_embedding_total_and_the_responses_bound(engine):
    g = start(engine, quotas=True, tpm=30)
    try:
        client = sdk(g)
        client.embeddings.create(model=EMB, input=[[1] * 10, [2] * 10])  # 20 reserved, settled to 20
        with pytest.raises(openai.RateLimitError) as e:
            client.embeddings.create(model=EMB, input=[[1] * 11])  # 20 + 11 > 30
        assert e.value.code == "rate_limit_exceeded" and int(e.value.response.headers["retry-after"]) >= 1
        with pytest.raises(openai.RateLimitError):
            client.responses.create(model=MODEL, input="Say hello.", max_output_tokens=1)  # 11 + 1 > 10 left
    finally:
        g.stop()
    assert len(forwarded(engine, "/v1/embeddings")) == 1 and forwarded(engine, "/v1/responses") == []


def test_tokenize_counts_against_rpm_not_tpm(engine):
    g = start(engine, quotas=True, rpm=2, tpm=1)
    try:
        with g.client() as c:
            for _ in range(2):
                r = c.post("/tokenize", json={"model": MODEL, "prompt": "Say hello."})
                assert r.status_code == 200 and r.json()["count"] == 3  # tpm 1 does not stop it
            r = c.post("/v1/tokenize", json={"model": MODEL, "prompt": "Say hello."})
        assert r.status_code == 429 and error_of(r)["code"] == "rate_limit_exceeded"
    finally:
        g.stop()


# ---------------------------------------------------------------- /tokenize, /detokenize
def test_tokenize_answers_the_gates_count_and_the_tenants_live_limit(gw, engine):
    messages = [{"role": "user", "content": "Say hello."}]
    with gw.client() as c:
        r = c.post("/tokenize", json={"model": MODEL, "messages": messages})
        assert r.json() == {
            "count": 11,
            "max_model_len": LIMIT,
            "tokens": COUNTER.encode_chat(messages),
            "token_strs": None,
        }
        r = c.post("/v1/tokenize", json={"model": EMB, "prompt": "hello world", "return_token_strs": True})
        assert r.json() == {
            "count": 2,
            "max_model_len": LIMIT,
            "tokens": [15339, 1917],
            "token_strs": ["hello", " world"],
        }
        # MODEL is served by SGLang, which applies no add_generation_prompt: chat's own 400, word for word
        r = c.post("/tokenize", json={"model": MODEL, "messages": messages, "add_generation_prompt": False})
        assert r.status_code == 400 and error_of(r) == {
            "message": "Unrecognized request argument supplied: add_generation_prompt (the engines serving this "
            "model do not accept it).",
            "type": "invalid_request_error",
            "param": "add_generation_prompt",
            "code": "invalid_request",
        }
        r = c.post("/detokenize", json={"model": MODEL, "tokens": [15339, 1917]})
        assert r.json() == {"prompt": "hello world"}
        r = c.post("/v1/detokenize", json={"model": MODEL, "tokens": [100256]})
        assert r.status_code == 400 and error_of(r)["param"] == "tokens"
        for body, param in (
            ({"prompt": "a", "messages": messages}, "prompt"),
            ({}, "messages"),
            (
                {"messages": messages, "add_generation_prompt": True, "continue_final_message": True},
                "continue_final_message",
            ),
            ({"messages": messages, "continue_final_message": True}, "continue_final_message"),  # ChatML cannot
            ({"prompt": "x", "add_generation_prompt": False}, "add_generation_prompt"),
            ({"messages": messages, "chat_template": "{{x}}"}, "chat_template"),
            (
                {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
                "messages[0].content[0].image_url",
            ),
            ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ):
            r = c.post("/tokenize", json={"model": MODEL, **body})
            assert r.status_code == 400 and error_of(r)["param"] == param, body
        r = c.post("/tokenize", json={"model": MODEL, "prompt": "x"}, headers={"authorization": "Bearer nope"})
        assert r.status_code == 401
    assert engine.state.requests == []  # answered by the gateway's own counter


def test_tokenize_of_an_engine_tokenizer_asks_the_engine(engine):
    s = api_settings(engine)
    s.models[0].tokenizer = s.models[0].tokenizer.model_validate(
        {"kind": "engine", "url": engine.url, "engine_api": "vllm"}
    )
    g = Gateway(s, tenants(max_context_tokens=LIMIT, allowed_models=[MODEL, EMB])).start()
    try:
        with g.client() as c:
            r = c.post("/tokenize", json={"model": MODEL, "prompt": "hello world"})
    finally:
        g.stop()
    assert r.json() == {"count": 2, "max_model_len": LIMIT, "tokens": [15339, 1917], "token_strs": None}
    assert [q["path"] for q in engine.state.requests] == ["/tokenize"]


CANARY_TEXT = "the secret of tenant b: KVGATE-CANARY-0123456789abcdef"


def _engine_tokenizer_gateway(engine: ApiMockEngine) -> Gateway:
    """The verifier on, :data:`MODEL` counted by ``engine`` (vLLM shapes), tenant-a sampled at
    rate 1 and ``strict`` strict."""
    from config.models import TenantsFile
    from gateway.ops.tenants import TenantRegistry, hash_key

    s = api_settings(engine, verifier=True)
    s.models[0].tokenizer = s.models[0].tokenizer.model_validate(
        {"kind": "engine", "url": engine.url, "engine_api": "vllm"}
    )
    a = {"id": "tenant-a", "api_key_sha256": [hash_key(KEY_A)], "allowed_models": [MODEL], "verify_sample_rate": 1.0}
    strict = {
        "id": "strict",
        "api_key_sha256": [hash_key("sk-strict")],
        "strict_verify": True,
        "allowed_models": [MODEL],
    }
    reg = TenantRegistry(TenantsFile.model_validate({"tenants": [a, strict]}))
    g = Gateway(s, reg, verifier=build_verifier(s, secrets=SECRETS))
    g.start()
    return g


def _engine_answers(engine: ApiMockEngine, body: dict) -> None:
    """Every later request to ``engine`` is answered 200 with ``body``."""
    engine.state.mode, engine.state.error_status, engine.state.error_body = "error", 200, json.dumps(body).encode()


def _withheld(inc_id: str) -> dict:
    """The relay's 502 body of a withheld whole answer (gateway.relay.proxy.withheld_error)."""
    message = f"The response was withheld by verification (incident {inc_id})."
    return {"error": {"message": message, "type": "server_error", "param": None, "code": "response_withheld"}}


def test_detokenize_of_an_engine_tokenizer_goes_through_the_strict_guard(engine):
    """The engine's /detokenize text is engine output: a strict tenant gets it only when the guard
    passes it (an honest decode: 200, the exact text); a canary, or another tenant's prompt, is
    withheld with the relay's own 502 for a whole answer, naming the incident recorded."""
    g = _engine_tokenizer_gateway(engine)
    svc = g.gw.verifier
    try:
        _plant(g)
        with g.client("sk-strict") as c:
            r = c.post("/detokenize", json={"model": MODEL, "tokens": [15339, 1917]})
            assert (r.status_code, r.json()) == (200, {"prompt": "hello world"})
            for text, detector in ((CANARY_TEXT, "canary"), (PLANTED, "leak_index")):
                before = len(svc.incidents.recent)
                _engine_answers(engine, {"prompt": text})
                r = c.post("/detokenize", json={"model": MODEL, "tokens": [15339, 1917]})
                incs = svc.incidents.recent[before:]
                assert (r.status_code, [(i.detector, i.withheld, i.tenant) for i in incs]) == (
                    502,
                    [(detector, True, "strict")],
                )
                assert r.json() == _withheld(incs[0].id)
                engine.state.mode = "ok"
    finally:
        g.stop()
    assert [q["body"]["tokens"] for q in engine.state.requests if q["path"] == "/detokenize"] == [[15339, 1917]] * 3


def test_detokenize_of_an_engine_tokenizer_is_sampled_for_a_tenant_that_is_not_strict(engine):
    """A sampled tenant gets the engine's text (200, exact) and the background checker records
    the canary in it, not withheld."""
    g = _engine_tokenizer_gateway(engine)
    svc = g.gw.verifier
    try:
        _engine_answers(engine, {"prompt": CANARY_TEXT})
        with g.client() as c:
            r = c.post("/v1/detokenize", json={"model": MODEL, "tokens": [15339, 1917]})
        assert (r.status_code, r.json()) == (200, {"prompt": CANARY_TEXT})
        assert wait_for(lambda: svc.incidents.recent)
        assert [(i.detector, i.withheld, i.tenant) for i in svc.incidents.recent] == [("canary", False, "tenant-a")]
    finally:
        g.stop()


def test_detokenize_of_an_engine_tokenizer_bounds_the_engines_text(engine, caplog):
    """At most 1,024 characters an id (ENGINE_TOKEN_CHARS: an engine tokenizer has no
    max_token_chars): 2 ids and 2,048 characters are answered, 2,049 are the engine's fault."""
    g = _engine_tokenizer_gateway(engine)
    try:
        with g.client() as c:
            _engine_answers(engine, {"prompt": "x" * 2048})
            r = c.post("/detokenize", json={"model": MODEL, "tokens": [15339, 1917]})
            assert (r.status_code, r.json()) == (200, {"prompt": "x" * 2048})
            _engine_answers(engine, {"prompt": "x" * 2049})
            r = c.post("/detokenize", json={"model": MODEL, "tokens": [15339, 1917]})
    finally:
        g.stop()
    message = EngineTokenizeError.CLIENT_MESSAGE
    assert (r.status_code, r.json()) == (
        502,
        {"error": {"message": message, "type": "server_error", "param": None, "code": "upstream_unavailable"}},
    )
    detail = f"engine detokenize at {engine.url}/detokenize answered 2049 characters for 2 token ids"
    detail += " (at most 1024 each)"
    assert [r.getMessage() for r in caplog.records if r.name == "kvgate.tokenizer"] == [
        f"engine tokenizer failed: {detail!r}"
    ]


def test_a_long_responses_input_is_converted_and_counted_off_the_loop_exactly(gw, engine):
    text = "Litwo! Ojczyzno moja! ty jesteś jak zdrowie. " * 800  # ~36,000 characters: over offload_count_chars
    items = [{"role": "user", "content": [{"type": "input_text", "text": text}]}]
    from tokenizer.responses import count_responses, responses_to_chat

    n = count_responses(COUNTER, responses_to_chat(items))
    with gw.client() as c:
        r = c.post("/v1/responses", json={"model": MODEL, "input": items, "max_output_tokens": 5})
    assert r.status_code == 400
    assert error_of(r)["message"] == responses_length_message(LIMIT, n, 5)
    assert forwarded(engine, "/v1/responses") == []


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/responses"])
def test_hostile_nesting_is_a_400_not_a_500(engine, route):
    g = start(engine, max_context_tokens=None)
    g.gw.settings.gateway.max_body_bytes = 1 << 20
    deep = lambda n: '{"a":' * n + "1" + "}" * n  # noqa: E731
    head = (
        '"messages":[{"role":"user","content":"x"}],"tools":[{"type":"function","function":{"name":"f","parameters":'
        if route.endswith("completions")
        else '"input":"x","tools":[{"type":"function","name":"f","parameters":'
    )
    close = "}}]" if route.endswith("completions") else "}]"
    try:
        with g.client() as c:
            r = c.post(
                route,
                content=f'{{"model":"{MODEL}",{head}{deep(1000)}{close}}}',
                headers={"content-type": "application/json"},
            )
            assert r.status_code == 400 and error_of(r)["param"] == "tools[0]"  # too deep to render the template
            body = f'{{"model":"{MODEL}",{head}{deep(300)}{close}}}'  # renders, but orjson cannot write it back
            r = c.post(route, content=body, headers={"content-type": "application/json"})
            assert (
                r.status_code == 400 and error_of(r)["message"] == "The request body is nested too deeply to forward."
            )
    finally:
        g.stop()
    assert engine.state.requests == []


def test_responses_reserve_the_bound_and_settle_to_input_plus_output_tokens(engine):
    g = start(engine, quotas=True, tpm=40)
    try:
        client = sdk(g)
        r = client.responses.create(model=MODEL, input="Say hello.", max_output_tokens=20)  # reserves 11 + 20 = 31
        assert (r.usage.input_tokens, r.usage.output_tokens) == (11, 4)  # settled to 15
        client.responses.create(model=MODEL, input="Say hello.", max_output_tokens=14)  # 15 + 25 = 40: fits
        with pytest.raises(openai.RateLimitError):  # 15 + 15 settled, + 11 + 1 > 40
            client.responses.create(model=MODEL, input="Say hello.", max_output_tokens=1)
    finally:
        g.stop()
    assert len(forwarded(engine, "/v1/responses")) == 2


def test_an_oversized_responses_event_ends_the_stream_with_a_responses_error_event(engine):
    from tests.mock_api_engine import sse

    first = sse({"type": "response.output_text.delta", "sequence_number": 3, "output_index": 0, "delta": "Hi"})
    huge = sse({"type": "response.output_text.delta", "sequence_number": 4, "output_index": 0, "delta": "x" * 4000})
    engine.state.responses_events = [first, huge]
    g = start(engine)
    g.gw.settings.gateway.max_sse_event_bytes = 1024
    try:
        with (
            g.client() as c,
            c.stream("POST", "/v1/responses", json={"model": MODEL, "input": "hi", "stream": True}) as r,
        ):
            raw = b"".join(r.iter_raw())
    finally:
        g.stop()
    assert raw.startswith(first) and b"x" * 100 not in raw and b"[DONE]" not in raw
    tail = raw[len(first) :]
    assert tail.startswith(b'event: error\ndata: {"type":"error","code":"upstream_unavailable"')
    assert tail.endswith(b'"sequence_number":4}\n\n')


# ---------------------------------------------------------------- GET /v1/models/{id}


def _not_found(name: str) -> dict:
    message = f"The model `{name}` does not exist or you do not have access to it."
    return {
        "message": bounded(message, MAX_MESSAGE_CHARS),
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }


def test_sdk_retrieves_a_model_as_models_lists_it_and_an_alias_resolves(gw):
    client = sdk(gw)
    listed = {m.id: m.model_dump() for m in client.models.list().data}
    m = client.models.retrieve(MODEL)
    assert m.model_dump() == listed[MODEL]
    assert (m.id, m.object, m.owned_by, (m.model_extra or {})["max_model_len"]) == (MODEL, "model", "kvgate", LIMIT)
    assert client.models.retrieve("tiny-alias").model_dump() == listed[MODEL]  # the canonical id
    assert client.models.retrieve(EMB).model_dump() == listed[EMB]


@pytest.mark.parametrize("name", ["no-such-model", "a/b/c", "x" * 5000, "kvgate-tiny ", "KVGATE-TINY", "tiny-alias."])
def test_unknown_model_is_404_model_not_found_in_openais_shape(gw, name):
    with pytest.raises(openai.NotFoundError) as e:
        sdk(gw).models.retrieve(name)
    assert e.value.code == "model_not_found"
    with gw.client() as c:
        r = c.get("/v1/models/" + name)
    assert r.status_code == 404 and error_of(r) == _not_found(name)
    assert len(r.content) < 1400  # the echoed name is cut, never the whole 5000 characters


def test_a_model_the_tenant_may_not_use_is_the_same_404(gw):
    with gw.client(KEY_B) as c:
        r = c.get(f"/v1/models/{MODEL}")
        assert r.status_code == 404 and error_of(r) == _not_found(MODEL)
        r = c.get("/v1/models/other-model")  # allowed, but not configured: unknown
        assert r.status_code == 404 and error_of(r) == _not_found("other-model")


@pytest.mark.parametrize("key", [None, "sk-wrong"])
def test_retrieve_authenticates_first(gw, key):
    with gw.client(key) as c:
        for name in (MODEL, "no-such-model"):
            r = c.get(f"/v1/models/{name}")
            assert r.status_code == 401 and error_of(r)["code"] == "invalid_api_key", name


def test_retrieve_is_get_only_and_the_bare_path_is_not_a_model(gw):
    with gw.client() as c:
        assert c.post(f"/v1/models/{MODEL}", json={}).status_code == 405
        assert c.get("/v1/models/").status_code == 404
        assert c.get("/v1/models").json()["object"] == "list"
