"""The gateway over real HTTP against the mock engine (tests/mock_engine.py): the context gate at
the boundary, bad input (nothing forwarded), the forwarded request, engine errors, and the official
openai SDK (stream relaying: tests/test_gateway_relay.py)."""

from __future__ import annotations

import asyncio
import logging

import httpx
import openai
import pytest

from gateway.app import create_app
from gateway.relay.upstream_client import MockResponse, MockTransport, UpstreamClient
from tests.gateway_harness import KEY_A, KEY_B, MODEL, SECRETS, Gateway, chat, settings_for, tenants, upstream, wait_for
from tests.mock_engine import gateway_id
from tests.test_gateway_pipeline import access  # noqa: F401  (the access fixture)
from tests.test_gateway_relay import GuardingVerifier, static_upstream

pytestmark = pytest.mark.timeout(60)

CTX_MSG = (
    "This model's maximum context length is 200 tokens. However, you requested 201 tokens "
    "({p} in the {w}, {c} in the completion). Please reduce the length of the {w} or completion."
)


@pytest.fixture
def gw(engine, gateway):
    return gateway(settings_for([upstream("u1", engine)]), tenants(max_context_tokens=200))


def error_of(r: httpx.Response) -> dict:
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


# ---------------------------------------------------------------- the context gate
def test_chat_boundary_200_then_400_with_exact_message(gw, engine):
    with gw.client() as c:
        r = c.post("/v1/chat/completions", json=chat(max_tokens=189))  # 11 + 189 == 200
        assert r.status_code == 200
        assert r.json()["choices"][0]["message"]["content"] == "Hello from the mock."
        r = c.post("/v1/chat/completions", json=chat(max_tokens=190))
    assert r.status_code == 400
    assert error_of(r) == {
        "message": CTX_MSG.format(p=11, c=190, w="messages"),
        "type": "invalid_request_error",
        "param": "messages",
        "code": "context_length_exceeded",
    }
    assert len(engine.state.requests) == 1


def test_completions_boundary_and_default_max_tokens(gw, engine):
    with gw.client() as c:
        assert (
            c.post("/v1/completions", json={"model": MODEL, "prompt": "Say hello.", "max_tokens": 197}).status_code
            == 200
        )
        r = c.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": "Say hello.", "max_completion_tokens": 1, "max_tokens": 198},
        )
        assert r.status_code == 400 and error_of(r)["param"] == "max_completion_tokens"  # not a completions field
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": "Say hello.", "max_tokens": 198})
        assert error_of(r)["message"] == CTX_MSG.format(p=3, c=198, w="prompt")
        assert error_of(r)["param"] == "prompt"
        # no max_tokens: min(default 16, 200 - 3) is sent upstream
        assert c.post("/v1/completions", json={"prompt": "Say hello."}).status_code == 200
    assert engine.state.requests[-1]["body"]["max_tokens"] == 16
    assert engine.state.requests[-1]["body"]["model"] == MODEL  # the tenant's only model


def test_max_tokens_above_cap_is_400(gw, engine):
    with gw.client() as c:
        r = c.post("/v1/chat/completions", json=chat(max_tokens=4097))
    assert r.status_code == 400 and error_of(r)["param"] == "max_tokens"
    assert engine.state.requests == []


# ---------------------------------------------------------------- bad input: 4xx, nothing forwarded
BAD = [
    (b"{not json", 400, None),
    # not JSON, but a top-level NaN is named (docs/gateway.md, "Parse")
    (
        b'{"model": "kvgate-tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
        400,
        "temperature",
    ),
    (b'{"model": "kvgate-tiny", "messages": [{"role": "user", "content": "hi"}], "logit_bias": {"1": NaN}}', 400, None),
    (b'{"model": "kvgate-tiny", "messages": [{"role": "user", "content": "\xff\xfe"}]}', 400, None),
    (b'{"model": "kvgate-tiny", "messages": "hi"}', 400, "messages"),
    (
        b'{"model": "kvgate-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": "5"}',
        400,
        "max_tokens",
    ),
    (b'{"model": 7, "messages": [{"role": "user", "content": "hi"}]}', 400, "model"),
    (b'{"model": "kvgate-tiny", "messages": [{"role": "user", "content": 5}]}', 400, "messages[0].content"),
    (
        b'{"model": "kvgate-tiny", "messages": [{"role": "user", "content": [{"type": "video", "video": "x"}]}]}',
        400,
        "messages[0].content[0].type",
    ),
    (b'{"model": "kvgate-tiny", "messages": [{"role": "wizard", "content": "hi"}]}', 400, "messages[0].role"),
    (b'{"model": "kvgate-tiny", "messages": [{"role": "user", "content": "hi"}], "surprise": 1}', 400, "surprise"),
    (b'{"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}', 404, "model"),
]


@pytest.mark.parametrize("raw,status,param", BAD)
def test_bad_chat_bodies(gw, engine, raw, status, param):
    with gw.client() as c:
        r = c.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == status
    err = error_of(r)
    assert err["param"] == param
    assert err["type"] == "invalid_request_error"
    assert err["code"] == ("model_not_found" if status == 404 else "invalid_request")
    assert engine.state.requests == []


@pytest.mark.parametrize(
    "prompt,param",
    [
        ([1, 2, 100_300], "prompt"),
        ([-1], "prompt"),
        ([[5], [100_261]], "prompt[1]"),
        ([[5], []], "prompt[1]"),
        ([1, "a"], "prompt"),
    ],
)
def test_invalid_token_ids(gw, engine, prompt, param):
    with gw.client() as c:
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1})
    assert r.status_code == 400 and error_of(r)["param"] == param
    assert engine.state.requests == []


def test_oversized_body_is_413(gw, engine):
    with gw.client() as c:
        r = c.post("/v1/chat/completions", json=chat(content="x" * 5000))
    assert r.status_code == 413
    assert error_of(r)["code"] == "request_too_large"
    assert engine.state.requests == []


def test_auth_errors(gw, engine):
    with gw.client(key=None) as c:
        r = c.post("/v1/chat/completions", json=chat())
        assert r.status_code == 401 and error_of(r)["code"] == "invalid_api_key"
    with gw.client(key="sk-wrong-secret") as c:
        r = c.post("/v1/chat/completions", json=chat())
        assert r.status_code == 401 and error_of(r)["type"] == "authentication_error"
        assert "sk-wrong-secret" not in r.text
        assert c.get("/v1/models").status_code == 401
    with gw.client(key=KEY_B) as c:  # a tenant without this model
        r = c.post("/v1/chat/completions", json=chat())
        assert r.status_code == 404 and error_of(r)["code"] == "model_not_found"
    assert engine.state.requests == []


def test_unknown_route_and_method_are_openai_shaped(gw):
    with gw.client() as c:
        r = c.get("/v1/nothing-here")
        assert r.status_code == 404 and error_of(r)["code"] == "not_found"
        r = c.get("/v1/chat/completions")
        assert r.status_code == 405 and error_of(r)["type"] == "invalid_request_error"


def test_the_in_flight_gauge_counts_requests_not_scrapes(gw, engine):
    """``kvgate_in_flight_requests`` read 1 on an idle gateway: the ``/metrics`` request counted
    itself (and a probe would too), so an HPA threshold on it was off by one. It counts the
    requests being served: 0 idle, 1 while a chat waits on the engine."""
    import threading

    def gauge(c: httpx.Client) -> str:
        return next(line for line in c.get("/metrics").text.splitlines() if line.startswith("kvgate_in_flight"))

    with gw.client() as c:
        c.get("/healthz")
        assert gauge(c) == "kvgate_in_flight_requests 0.0"
        engine.state.mode, engine.state.delay_seconds = "delay", 1.0
        t = threading.Thread(target=lambda: gw.client().post("/v1/chat/completions", json=chat(max_tokens=5)))
        t.start()
        assert wait_for(lambda: len(engine.state.requests) == 1)
        assert gauge(c) == "kvgate_in_flight_requests 1.0"
        t.join()
        assert gauge(c) == "kvgate_in_flight_requests 0.0"


# ---------------------------------------------------------------- what is forwarded
def test_forwarded_request_salt_request_id_alias(gw, engine, access):  # noqa: F811
    import hashlib
    import hmac

    with gw.client() as c:
        r = c.post(
            "/v1/chat/completions",
            json=chat(model="tiny-alias", cache_salt="client-salt", max_tokens=5),
            headers={"x-request-id": "req-42"},
        )
    assert r.status_code == 200
    assert r.headers["x-request-id"] == "req-42"
    assert float(r.headers["x-kvgate-overhead-ms"]) > 0
    got = engine.state.requests[0]
    want_salt = hmac.new(SECRETS["cache_salt_key"], b"tenant-a", hashlib.sha256).hexdigest()
    assert got["body"] == {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say hello."}],
        "cache_salt": want_salt,
        "max_tokens": 5,
    }
    # the engine gets the gateway's own id for the request, not the client's (tenants choose theirs)
    assert wait_for(lambda: len(access("req-42")) == 1, 2.0)
    assert got["headers"]["x-request-id"] == gateway_id(access("req-42")[0]["upstream_request_id"], "req-42")
    assert "authorization" not in got["headers"]  # the client's key never goes upstream
    assert got["path"] == "/v1/chat/completions"


def test_upstream_api_key_and_upstream_model(engine, access):  # noqa: F811
    s = settings_for([upstream("u1", engine, api_key="sk-upstream")])
    s.models[0].upstream_model = "served-name"
    g = Gateway(s).start()
    try:
        with g.client() as c:
            r = c.post("/v1/chat/completions", json=chat(max_tokens=3))
        assert r.status_code == 200
        got = engine.state.requests[0]
        assert got["headers"]["authorization"] == "Bearer sk-upstream"
        assert got["body"]["model"] == "served-name"
        rid = r.headers["x-request-id"]  # the gateway's id for a client that sent none
        assert len(rid) == 32 and wait_for(lambda: len(access(rid)) == 1, 2.0)
        assert got["headers"]["x-request-id"] == gateway_id(access(rid)[0]["upstream_request_id"], rid)
    finally:
        g.stop()


def test_models_readyz_healthz_metrics(gw, engine):
    with gw.client() as c:
        m = c.get("/v1/models").json()
        assert [(d["id"], d["max_model_len"]) for d in m["data"]] == [(MODEL, 200)]
        assert c.get("/healthz").json() == {"status": "ok"}
        ready = c.get("/readyz")
        assert ready.status_code == 200 and ready.json()["upstreams"][0]["limit_tokens"] == 3276
        c.post("/v1/chat/completions", json=chat(max_tokens=5))
        c.post("/v1/chat/completions", json=chat(max_tokens=500))
        text = c.get("/metrics").text
    assert 'kvgate_requests_total{route="chat",status="200",tenant="tenant-a"} 1.0' in text
    assert 'kvgate_requests_total{route="chat",status="400",tenant="tenant-a"} 1.0' in text
    assert 'kvgate_rejections_total{reason="context_length_exceeded"} 1.0' in text
    assert 'kvgate_prompt_tokens_total{tenant="tenant-a"} 11.0' in text
    assert 'kvgate_completion_tokens_total{tenant="tenant-a"} 4.0' in text
    assert 'kvgate_pool_tokens{upstream="u1"} 4096.0' in text
    assert 'kvgate_effective_limit_tokens{upstream="u1"} 3276.0' in text
    assert "kvgate_gateway_overhead_seconds_count" in text
    assert KEY_A not in text and "Say hello" not in text


# ---------------------------------------------------------------- streams and engine errors
# (the relay's stream bytes, in-process through the upstream client's MockTransport:
# tests/test_gateway_relay.py)


@pytest.mark.parametrize(
    "status,body,want",
    [
        (
            400,
            b'{"object":"error","message":"bad","type":"BadRequestError","param":"top_p","code":400}',
            {"message": "bad", "type": "invalid_request_error", "param": "top_p", "code": None},
        ),
        (
            400,
            b'{"error":{"message":"This model\'s maximum context length is 10 tokens.","type":"BadRequestError","param":null,"code":400}}',
            {
                "message": "This model's maximum context length is 10 tokens.",
                "type": "invalid_request_error",
                "param": None,
                "code": "context_length_exceeded",
            },
        ),
        (
            500,
            b'{"error":{"message":"boom"}}',
            {"message": "boom", "type": "server_error", "param": None, "code": None},
        ),
        (
            503,
            b'{"object":"error","message":"pool full, retry","code":503}',
            {"message": "pool full, retry", "type": "server_error", "param": None, "code": None},
        ),
        (  # the client's to hear (vLLM's answer to an unknown previous_response_id): not the gateway's key
            404,
            b'{"object":"error","message":"Response with id \'resp_1\' not found.","type":"NotFoundError","code":404}',
            {
                "message": "Response with id 'resp_1' not found.",
                "type": "invalid_request_error",
                "param": None,
                "code": None,
            },
        ),
    ],
)
def test_engine_error_bodies(gw, engine, status, body, want):
    engine.state.mode = "error"
    engine.state.error_status = status
    engine.state.error_body = body
    with gw.client() as c:
        for stream in (False, True):
            r = c.post("/v1/chat/completions", json=chat(max_tokens=5, stream=stream))
            assert r.status_code == status
            assert error_of(r) == want


@pytest.mark.parametrize(
    ("status", "body", "said"),
    [
        (401, b'{"error":"Unauthorized"}', "Unauthorized"),
        (403, b'{"error":{"message":"Forbidden","type":"permission_error","code":"forbidden"}}', "Forbidden"),
        (407, b'{"detail":"Proxy Authentication Required"}', "Proxy Authentication Required"),
        (200, b'{"error":{"message":"invalid api key","type":"authentication_error","code":401}}', "invalid api key"),
    ],
    ids=["401", "403", "407", "code-401-in-200"],
)
def test_an_engine_refusing_the_gateways_credentials_is_a_502(gw, engine, caplog, status, body, said):
    """An engine's 401, 403 or 407 (or an error object whose code is one) after the gateway
    accepted the client's key: the gateway's own upstream key is wrong or rotated. Relayed under
    its status before, so the client was told its key was bad (the openai SDK's
    ``AuthenticationError``, which LiteLLM never retries); now a 502 ``upstream_unavailable``
    naming the gateway's credentials, logged at error once a minute per upstream."""
    engine.state.mode = "error"
    engine.state.error_status = status
    engine.state.error_body = body
    code = status if status != 200 else 401
    want = {
        "message": f"The upstream engine refused the gateway's own credentials ({code}); "
        f"the client's key was accepted. The engine said: {said}",
        "type": "server_error",
        "param": None,
        "code": "upstream_unavailable",
    }
    with caplog.at_level(logging.ERROR, logger="kvgate.proxy"), gw.client() as c:
        for stream in (False, True, False):
            r = c.post("/v1/chat/completions", json=chat(max_tokens=5, stream=stream))
            assert (r.status_code, error_of(r)) == (502, want)
    logged = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "kvgate.proxy"]
    assert logged == [
        (
            logging.ERROR,
            f"upstream u1 refused the gateway's credentials ({code}): its api_key is wrong or was rotated; "
            "its answers are 502 upstream_unavailable",
        )
    ]


async def _answered(status: int, headers: list[dict[str, str]], strict: bool) -> list[httpx.Response]:
    """Tenant a's chat request (strict or not) once per entry of ``headers``, each answered by an
    engine's ``status`` with those headers (in-process: tests/test_gateway_relay.py's harness)."""
    body = b'{"error":{"message":"engine busy","type":"rate_limit_error","code":"rate_limit_exceeded"}}'
    answers = iter(headers)
    app = create_app(
        settings_for([static_upstream()]),
        tenants(strict_verify=strict),
        secrets=SECRETS,
        verifier=GuardingVerifier("secret") if strict else None,
    )
    gw = app.state.gateway
    handler = lambda q: MockResponse(status, {"content-type": "application/json", **next(answers)}, [body])  # noqa: E731
    gw.forwarder = UpstreamClient(transport=MockTransport(handler))
    await gw.start()
    try:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app),
            base_url="http://gateway.test",
            headers={"authorization": f"Bearer {KEY_A}"},
        ) as c:
            return [await c.post("/v1/chat/completions", json=chat(max_tokens=5)) for _ in headers]
    finally:
        await gw.stop()


@pytest.mark.parametrize("strict", [False, True], ids=["not-strict", "strict"])
def test_an_engines_retry_after_on_429_and_503_is_passed_on(strict):
    """An engine's 429 or 503 with ``Retry-After`` in seconds (0 to 3600): the client's error
    answer carries it (under strict verification too: the gateway's own number, not the engine's
    text). Anything else (an HTTP-date, a sign, a fraction, a unit, more than an hour, several
    values) is dropped, as is the header of any other status. Before, every one was dropped."""
    good = {"30": "30", "0": "0", "3600": "3600", " 007\t": "7"}
    rs = asyncio.run(_answered(429, [{"retry-after": v} for v in good], strict))
    assert [(r.status_code, r.headers.get("retry-after")) for r in rs] == [(429, w) for w in good.values()]
    assert rs[0].json()["error"]["code"] == "rate_limit_exceeded"
    if not strict:
        assert error_of(rs[0]) == {
            "message": "engine busy",
            "type": "rate_limit_error",
            "param": None,
            "code": "rate_limit_exceeded",
        }
    bogus = ["Wed, 21 Oct 2015 07:28:00 GMT", "-1", "+5", "1.5", "5s", "3601", "99999999999", "", "30, 30", "\u0665"]
    rs = asyncio.run(_answered(429, [{"retry-after": v} for v in bogus], strict))
    assert [(r.status_code, r.headers.get("retry-after")) for r in rs] == [(429, None)] * len(bogus)
    (r,) = asyncio.run(_answered(503, [{"retry-after": "5"}], strict))
    assert (r.status_code, r.headers.get("retry-after")) == (503, "5")
    (r,) = asyncio.run(_answered(500, [{"retry-after": "5"}], strict))
    assert (r.status_code, r.headers.get("retry-after")) == (500, None)


def test_an_engine_status_no_client_can_be_answered_with_is_a_502(gw, engine):
    """An engine answering 499 (nginx's "client closed") would read as the gateway's own 499
    for a client that went away; it is relayed as 502, in the OpenAI shape."""
    engine.state.mode = "error"
    engine.state.error_status = 499
    engine.state.error_body = b'{"error":{"message":"closed"}}'
    with gw.client() as c:
        for stream in (False, True):
            r = c.post("/v1/chat/completions", json=chat(max_tokens=5, stream=stream))
            assert (r.status_code, error_of(r)) == (
                502,
                {"message": "closed", "type": "server_error", "param": None, "code": None},
            )


@pytest.mark.parametrize(
    ("chunks", "status", "error"),
    [
        (
            [b'{"error":{"message":"model is loading","code":503}}'],
            503,
            {"message": "model is loading", "type": "server_error", "param": None, "code": None},
        ),
        (
            [b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\r\r', b"data: [DONE]\r\r"],
            502,
            {
                "message": "The upstream engine's event stream ended before any event could be read.",
                "type": "server_error",
                "param": None,
                "code": "upstream_unavailable",
            },
        ),
        (
            [b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\x03+I-.\x01\x00\x0c~\x7f\xd8\x04\x00\x00\x00"],
            502,
            {
                "message": "The upstream engine's event stream ended before any event could be read.",
                "type": "server_error",
                "param": None,
                "code": "upstream_unavailable",
            },
        ),
    ],
    ids=["error-object-as-the-stream", "cr-only-line-endings", "gzip"],
)
def test_a_stream_no_event_of_which_can_be_read_is_an_error_not_an_empty_200(gw, engine, chunks, status, error):
    """Under text/event-stream, bytes with no event terminator (an error object sent as the
    whole stream, CR-only line endings, a gzip-encoded stream) were dropped with a warning and
    the client got 200 with only ``[DONE]``: the engine's error or text lost, the request
    charged as answered."""
    engine.state.stream_chunks = chunks
    with gw.client() as c:
        r = c.post("/v1/chat/completions", json=chat(max_tokens=5, stream=True))
    assert (r.status_code, error_of(r)) == (status, error)


@pytest.mark.parametrize("body", [b"[1,2,3]", b"null", b'"hello"', b"42", b"{broken"])
def test_a_whole_answer_that_is_not_a_json_object_is_a_502(gw, engine, body):
    """A 200 whose body was JSON but no object (an array, null, a string) was relayed as a 200."""
    engine.state.mode, engine.state.error_status, engine.state.error_body = "error", 200, body
    with gw.client() as c:
        r = c.post("/v1/chat/completions", json=chat(max_tokens=5))
    assert (r.status_code, error_of(r)) == (
        502,
        {
            "message": "The upstream engine answered a body that is not a JSON object.",
            "type": "server_error",
            "param": None,
            "code": "upstream_unavailable",
        },
    )


def test_abort_under_200_is_counted(gw, engine):
    engine.state.finish_reason = "abort"
    with gw.client() as c:
        assert c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3}).status_code == 200
        assert 'kvgate_finish_reason_abort_total{upstream="u1"} 1.0' in c.get("/metrics").text


# ---------------------------------------------------------------- the official openai SDK
def test_openai_sdk(gw, engine):
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=KEY_A, max_retries=0)
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hello."}], max_tokens=189
    )
    assert r.choices[0].message.content == "Hello from the mock."
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Say hello."}], max_tokens=190
        )
    assert e.value.code == "context_length_exceeded"
    assert e.value.status_code == 400
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="Say hello.", max_tokens=198)
    assert e.value.code == "context_length_exceeded"
    parts = [
        ch.choices[0].delta.content or ""
        for ch in client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Say hello."}], max_tokens=5, stream=True
        )
        if ch.choices
    ]
    assert "".join(parts) == "Hello from the mock."
    c = client.completions.create(model=MODEL, prompt="Say hello.", max_tokens=5)
    assert c.choices[0].text == "Hello from the mock."
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=gw.url + "/v1", api_key="sk-nope", max_retries=0).models.list()
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-nope", messages=[{"role": "user", "content": "hi"}])
    assert e.value.code == "model_not_found"


# ---------------------------------------------------------------- the stage contracts (quotas, verifier)
class RecordingQuotas:
    """A QuotaStage that records calls; refuses when ``refuse`` is set."""

    def __init__(self, refuse: bool = False) -> None:
        self.refuse = refuse
        self.reserved: list[int] = []
        self.settled: list[int] = []

    async def begin(self, tenant, request_id):
        from config.errors import OpenAIError
        from gateway.quotas.stage import QuotaLease

        if self.refuse:
            raise OpenAIError(
                429, "Rate limit reached for requests.", code="rate_limit_exceeded", headers={"Retry-After": "7"}
            )
        return QuotaLease(tenant.id, request_id, 0, headers={"x-ratelimit-remaining-requests": "9"})

    def combines(self, tenant):
        return False  # the two steps: begin, then reserve_tokens

    async def reserve_tokens(self, tenant, lease, tokens, *, also=None):
        self.reserved.append(tokens)
        lease.reserved_tokens = tokens

    async def settle(self, lease, used_tokens):
        self.settled.append(used_tokens)

    async def aclose(self):
        return None


class WithholdingVerifier:
    """A VerifierStage whose guard withholds every response; ``quarantined`` upstream names."""

    def __init__(self, quarantined=()) -> None:
        self.quarantined = set(quarantined)
        self.exchanges = []

    def begin(self, exchange):
        from verifier.stage import ResponseWithheld

        self.exchanges.append(exchange)

        class Guard:
            async def feed(self, delta_text, raw_event, pieces=None):
                if delta_text:
                    raise ResponseWithheld("inc-1", "leak_index")
                return [raw_event]

            async def finish_stream(self, **kw):
                return []

            async def check_body(self, text, **kw):
                raise ResponseWithheld("inc-2", "canary")

        return Guard()

    def defers(self, exchange):

        return False

    async def admit(self, exchange, decode=None, *, defer_write=False):
        return None

    def is_quarantined(self, upstream, prompt_tokens):
        return upstream in self.quarantined

    async def aclose(self):
        return None


def test_quota_stage_reserve_settle_and_refusal(engine):
    q = RecordingQuotas()
    g = Gateway(settings_for([upstream("u1", engine)]), tenants(), quotas=q).start()
    try:
        with g.client() as c:
            r = c.post("/v1/chat/completions", json=chat(max_tokens=5, n=2))
            assert r.status_code == 200 and r.headers["x-ratelimit-remaining-requests"] == "9"
            r = c.post("/v1/chat/completions", json=chat(max_tokens=5, stream=True))
            assert r.status_code == 200
            q.refuse = True
            r = c.post("/v1/chat/completions", json=chat(max_tokens=5))
            assert r.status_code == 429 and r.headers["retry-after"] == "7"
            assert r.json()["error"]["code"] == "rate_limit_exceeded"
    finally:
        g.stop()
    assert q.reserved == [2 * (11 + 5), 11 + 5]  # n = 2: each sequence holds the prompt and its completion
    # the admitted prompt x its sequences is the floor (the mock reports only 7 prompt tokens), plus the
    # engine's 4 completion tokens
    assert q.settled == [2 * 11 + 4, 11 + 4]
    assert len(engine.state.requests) == 2


def test_verifier_withholds_and_quarantine_skips(engine):
    v = WithholdingVerifier()
    g = Gateway(settings_for([upstream("u1", engine)]), tenants(), verifier=v).start()
    try:
        with g.client() as c:
            r = c.post("/v1/chat/completions", json=chat(max_tokens=5))
            assert r.status_code == 502 and r.json()["error"]["code"] == "response_withheld"
            assert "inc-2" in r.json()["error"]["message"]
            r = c.post("/v1/chat/completions", json=chat(max_tokens=5, stream=True))
            assert r.status_code == 502 and r.json()["error"]["code"] == "response_withheld"
            v.quarantined.add("u1")
            r = c.post("/v1/chat/completions", json=chat(max_tokens=5))
            assert r.status_code == 503 and r.json()["error"]["code"] == "upstream_unavailable"
    finally:
        g.stop()
    ex = v.exchanges[0]
    assert (
        ex.request.tenant.id,
        ex.request.upstream,
        ex.request.model,
        ex.prompt_text,
        ex.request.prompt_tokens,
        ex.request.stream,
    ) == (
        "tenant-a",
        "u1",
        MODEL,
        "Say hello.",
        11,
        False,
    )
    assert len(engine.state.requests) == 2


# ---------------------------------------------------------------- real text, counted off the event loop
def test_long_runbook_prompt_is_counted_exactly_off_loop(engine):
    from tests.conftest import SEEDS

    text = "\n".join([(SEEDS / "001_85707760a0179a93.txt").read_text(encoding="utf-8")] * 3)  # 44,528 chars
    engine.state.pool_tokens = 20_000  # limit floor(20000 / 1.25) = 16000
    engine.state.context_length = 32_768  # the engine reports its own context too (and it bounds the limit)
    g = Gateway(
        settings_for([upstream("u1", engine)], gateway={"max_body_bytes": 1 << 20}, context_length=32_768)
    ).start()
    try:
        with g.client() as c:
            ok = c.post("/v1/chat/completions", json=chat(content=text, max_tokens=16_000 - 14_842))
            assert ok.status_code == 200
            r = c.post("/v1/chat/completions", json=chat(content=text, max_tokens=16_000 - 14_842 + 1))
    finally:
        g.stop()
    assert r.status_code == 400
    assert r.json()["error"]["message"] == (
        "This model's maximum context length is 16000 tokens. However, you requested 16001 tokens (14842 in "
        "the messages, 1159 in the completion). Please reduce the length of the messages or completion."
    )
    assert engine.state.requests[0]["body"]["messages"][0]["content"] == text
    assert len(engine.state.requests) == 1


def test_a_failing_stage_still_answers_openai_shaped_500(engine):
    class BrokenVerifier:
        def begin(self, exchange):
            raise RuntimeError("verifier bug")

        def defers(self, exchange):

            return False

        async def admit(self, exchange, decode=None, *, defer_write=False):
            return None

        def is_quarantined(self, upstream, prompt_tokens):
            return False

        async def aclose(self):
            return None

    q = RecordingQuotas()
    g = Gateway(settings_for([upstream("u1", engine)]), tenants(), quotas=q, verifier=BrokenVerifier()).start()
    try:
        with g.client() as c:
            r = c.post("/v1/chat/completions", json=chat(max_tokens=5))
    finally:
        g.stop()
    assert r.status_code == 500
    assert error_of(r) == {
        "message": "The server had an error while processing your request.",
        "type": "server_error",
        "param": None,
        "code": "internal_error",
    }
    assert len(q.settled) == 1  # the lease is released all the same


def test_start_warms_the_counters_and_the_verifier_before_the_first_request(engine, monkeypatch, tmp_path):
    """What counting and fingerprinting build on first use (tiktoken's whitespace-run pattern,
    the verifier's shingle encoder) is built while the app starts, in a worker thread: before,
    the first request of each worker built them on the event loop (about 90 ms)."""
    import threading

    from tests.fixtures.settings import verifier_settings
    from tokenizer import tiktoken_safe
    from verifier import shingles
    from verifier.build import build_verifier

    tiktoken_safe._long_run.cache_clear()
    monkeypatch.setattr(shingles, "_COUNTER", None)
    where: list[str] = []
    real = shingles.bundled_counter
    monkeypatch.setattr(shingles, "bundled_counter", lambda: where.append(threading.current_thread().name) or real())
    svc = build_verifier(verifier_settings(tmp_path, None), secrets=SECRETS)
    g = Gateway(settings_for([upstream("u1", engine)]), tenants(), verifier=svc).start()
    try:
        assert tiktoken_safe._long_run.cache_info().currsize == 1
        assert shingles._COUNTER is not None and len(where) == 1 and where[0].startswith("kvgate-offload")
        with g.client() as c:
            assert c.post("/v1/chat/completions", json=chat(max_tokens=5)).status_code == 200
        assert len(where) == 1  # built once, at the start
    finally:
        g.stop()
