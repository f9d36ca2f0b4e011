"""Refuse before working, through the real app (a gateway on a free port, in-process quotas):
a tenant over its RPM or concurrency limit is refused right after authentication, before its
body is read, parsed, counted or indexed; a request refused later releases its lease (its RPM
stays spent); only admitted prompts reach the verifier's index; an embeddings batch is gated on
its total; ``/tokenize`` and ``/detokenize`` take admission's prologue (RPM, density check,
offload, too-long shortcut, TPM above 2,048 tokens)."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

import gateway.admission.admit as admit_module
import gateway.admission.density as density
from config.models import QuotaSettings
from gateway.quotas.stores import LocalQuotaStore
from gateway.quotas.tenant_quotas import TenantQuotas
from tests.gateway_harness import MODEL, Gateway, chat, settings_for, tenants, upstream

pytestmark = pytest.mark.timeout(120)

#: a chat whose counting is heavy (about 230 KiB of distinct words: counted in a worker thread)
HEAVY = chat(" ".join(f"w{i * 7919 % 100_003}" for i in range(40_000)), max_tokens=1)


class IndexingVerifier:
    """A VerifierStage recording which requests' prompts it was asked to index (``admit``)."""

    def __init__(self) -> None:
        self.indexed: list[str] = []

    def defers(self, exchange):

        return False

    async def admit(self, exchange, decode=None, *, defer_write=False):
        self.indexed.append(exchange.request.request_id)
        return None

    def begin(self, exchange):
        return None

    def is_quarantined(self, upstream, prompt_tokens):
        return False

    async def aclose(self):
        return None


class Calls:
    """Wraps the model's counter to record every count of a chat or prompt."""

    def __init__(self, monkeypatch, counter) -> None:
        self.n = 0
        self.threads: list[str] = []  # the thread each synchronous count ran on
        for name in ("count_chat", "acount_chat", "count_prompt", "acount_prompt", "prompt_token_ids", "decode"):
            real = getattr(counter, name)

            def wrapped(*a, _real=real, **kw):
                self.n += 1
                self.threads.append(threading.current_thread().name)
                return _real(*a, **kw)

            monkeypatch.setattr(counter, name, wrapped)


def start(engine, *, heavy: bool = False, **limits):
    """The gateway with in-process quotas and :class:`IndexingVerifier`; ``heavy``: a 131,072-token
    model behind a pool that holds :data:`HEAVY` (else 8,192 tokens, the mock's pool: limit 3,276)."""
    store = LocalQuotaStore()
    quotas = TenantQuotas(QuotaSettings(), store, fallback=store)
    verifier = IndexingVerifier()
    if heavy:
        engine.state.pool_tokens = engine.state.context_length = 200_000
    kw = {"context_length": 131_072} if heavy else {}
    settings = settings_for([upstream("u1", engine)], gateway={"max_body_bytes": 8 << 20}, **kw)
    g = Gateway(settings, tenants(**limits), quotas=quotas, verifier=verifier).start()
    return g, store, verifier


def rpm_429(r: httpx.Response, used: int, limit: int) -> dict:
    """The RPM 429's body, with the ``Retry-After`` of ``r`` (60 s, or 59 once a second passed
    since the first admission: the window's oldest entry leaves it then)."""
    retry = r.headers["retry-after"]
    assert retry in ("59", "60")
    return {
        "message": f"Rate limit reached for tenant 'tenant-a' on requests per 60s window (RPM): Limit {limit}, "
        f"Used {used}, Requested 1. Please try again in {retry}s.",
        "type": "rate_limit_error",
        "param": None,
        "code": "rate_limit_exceeded",
    }


def test_a_tenant_over_its_limits_is_refused_before_its_heavy_chats_are_parsed_counted_or_indexed(engine, monkeypatch):
    g, store, verifier = start(engine, heavy=True, rpm=1, max_concurrent=1)
    entry = g.gw.models.by_name[MODEL]
    calls = Calls(monkeypatch, entry.counter)
    parsed: list[int] = []
    real_parse = admit_module._parse_large
    monkeypatch.setattr(admit_module, "_parse_large", lambda raw, *a: parsed.append(len(raw)) or real_parse(raw, *a))
    try:
        with g.client() as c:
            r = c.post("/v1/chat/completions", json=HEAVY, headers={"x-request-id": "first"})
            assert r.status_code == 200, r.text
            assert (calls.n, len(parsed), verifier.indexed) == (1, 1, ["first"])
            # counted on the offload executor (gateway/edge/offload.py), on the tenant's share
            assert calls.threads[0].startswith("kvgate-offload")
            for i in range(5):
                r = c.post("/v1/chat/completions", json=HEAVY, headers={"x-request-id": f"flood-{i}"})
                assert (r.status_code, r.json()) == (429, {"error": rpm_429(r, 1, 1)})
                assert r.headers["connection"] == "close"
        # nothing of the refused bodies was parsed, counted or indexed; nothing more was forwarded
        assert (calls.n, len(parsed), verifier.indexed, len(engine.state.requests)) == (1, 1, ["first"], 1)
        assert store._tenants["tenant-a"].leases == {}  # the admitted request's lease was settled
    finally:
        g.stop()


def test_a_tenant_at_its_concurrency_limit_is_refused_without_its_body_counted(engine, monkeypatch):
    engine.state.mode, engine.state.delay_seconds = "delay", 1.5
    g, store, verifier = start(engine, heavy=True, rpm=100, max_concurrent=1)
    calls = Calls(monkeypatch, g.gw.models.by_name[MODEL].counter)
    try:
        with g.client() as c:
            slow = threading.Thread(target=lambda: c.post("/v1/chat/completions", json=chat(max_tokens=1)))
            slow.start()
            assert _wait(lambda: len(engine.state.requests) == 1)
            before = calls.n
            r = c.post("/v1/chat/completions", json=HEAVY)
            assert r.status_code == 429
            assert r.json()["error"]["message"] == (
                "Rate limit reached for tenant 'tenant-a' on concurrent requests: Limit 1. Please try again in 1s."
            )
            assert calls.n == before and len(verifier.indexed) == 1
            slow.join()
    finally:
        g.stop()


def test_a_request_refused_after_it_began_releases_its_lease_and_spends_its_rpm(engine):
    g, store, verifier = start(engine, rpm=3, max_concurrent=1, tpm=100)
    try:
        with g.client() as c:
            r = c.post("/v1/chat/completions", json={**chat(), "bogus": 1})  # invalid: 400
            assert (r.status_code, r.json()["error"]["param"]) == (400, "bogus")
            r = c.post("/v1/chat/completions", json=chat(max_tokens=200))  # over TPM: 429
            assert (r.status_code, r.json()["error"]["message"]) == (
                429,
                "Request too large for tenant 'tenant-a' on tokens per 60s window (TPM): Limit 100, Requested 211 "
                "(prompt + max_tokens). Reduce the prompt or max_tokens.",
            )
            log = store._tenants["tenant-a"]
            assert (len(log.rpm), log.leases, log.tpm_sum) == (2, {}, 0)  # both spent RPM; no lease, no tokens
            r = c.post("/v1/chat/completions", json=chat(max_tokens=5))  # the lease is free again
            assert r.status_code == 200
            assert (r.headers["x-ratelimit-remaining-requests"], r.headers["x-ratelimit-remaining-tokens"]) == (
                "0",
                "84",
            )
            r = c.post("/v1/chat/completions", json=chat(max_tokens=5))
            assert (r.status_code, r.json()) == (429, {"error": rpm_429(r, 3, 3)})
        assert len(verifier.indexed) == 1  # only the admitted prompt
        assert len(engine.state.requests) == 1
    finally:
        g.stop()


def _wait(pred, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


# ---------------------------------------------------------------- /v1/embeddings: the batch's total
def test_an_embeddings_batch_over_the_pool_is_400_naming_input_and_at_it_is_served():
    from tests.mock_api_engine import ApiMockEngine
    from tests.test_gateway_api_routes import EMB, forwarded
    from tests.test_gateway_api_routes import start as start_api

    engine = ApiMockEngine().start()
    g = start_api(engine, max_embedding_inputs=64)  # each input at most 200 (the tenant's limit); pool 3,276
    try:
        with g.client() as c:
            # 3,276 tokens, the pool limit: 16 texts of 200 tokens and one of 76 (n words and the last space)
            at = ["hello " * 199] * 16 + ["hello " * 75]
            r = c.post("/v1/embeddings", json={"model": EMB, "input": at})
            assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 3276, r.text
            # one token more: counted (the texts' lower bound, 147 tokens of 128 characters, is no proof), then refused
            r = c.post("/v1/embeddings", json={"model": EMB, "input": [*at[:-1], "hello " * 76]})
            assert (r.status_code, r.json()) == (
                400,
                {
                    "error": {
                        "message": "This request needs 3277 tokens of KV cache (17 inputs); the engines serving "
                        "this model hold at most 3276 for one request. Send fewer or shorter inputs.",
                        "type": "invalid_request_error",
                        "param": "input",
                        "code": "invalid_request",
                    }
                },
            )
        assert len(forwarded(engine, "/v1/embeddings")) == 1
    finally:
        g.stop()
        engine.stop()


# ---------------------------------------------------------------- /tokenize, /detokenize: admission's prologue
def _on_a_loop() -> bool:
    """Whether this thread is running an event loop (a worker thread is not)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _parse_threads(monkeypatch) -> list[str]:
    """The threads the large-body parse and the small one ran on (``loop``: a thread running an
    event loop, or ``worker``)."""
    where: list[str] = []
    real_large, real_small = admit_module._parse_large, admit_module.parse_json_body

    def large(raw, *a):
        where.append("loop" if _on_a_loop() else "worker")
        return real_large(raw, *a)

    def small(raw):
        if len(raw) > admit_module.OFFLOAD_BODY_BYTES:
            where.append("loop")
        return real_small(raw)

    monkeypatch.setattr(admit_module, "_parse_large", large)
    monkeypatch.setattr(admit_module, "parse_json_body", small)
    import gateway.routes.tokenize_handlers as th

    if hasattr(th, "parse_json_body"):  # today's handler parses on its own, on the loop
        monkeypatch.setattr(th, "parse_json_body", small)
    return where


def test_tokenize_refuses_a_dense_8_mb_body_off_the_loop_and_detokenize_3m_ids_before_parsing_them(engine, monkeypatch):
    g, store, verifier = start(engine, rpm=100)
    where = _parse_threads(monkeypatch)
    parsed_ids: list[int] = []
    real_ids = density.parse_ids
    monkeypatch.setattr(density, "parse_ids", lambda content: parsed_ids.append(1) or real_ids(content))
    calls = Calls(monkeypatch, g.gw.models.by_name[MODEL].counter)
    try:
        with g.client(timeout=30) as c:
            dense = b'{"model": "kvgate-tiny", "prompt": "x", "junk": [' + b"[]," * 2_700_000 + b"[]]}"
            assert len(dense) > 8_000_000
            r = c.post("/tokenize", content=dense, headers={"content-type": "application/json"})
            assert (r.status_code, r.json()["error"]["code"], r.json()["error"]["type"]) == (
                413,
                "request_too_large",
                "invalid_request_error",
            )
            assert r.json()["error"]["message"].startswith(
                "The request body holds more than 131072 JSON values besides its token-id arrays ("
            )
            ids = b'{"model": "kvgate-tiny", "tokens": [' + b"1," * 2_999_999 + b"1]}"
            r = c.post("/detokenize", content=ids, headers={"content-type": "application/json"})
            assert (r.status_code, r.json()) == (
                400,
                {
                    "error": {
                        "message": "This model's maximum context length is 3276 tokens. However, you requested "
                        "at least 3000000 tokens in the tokens alone (counting stopped there). Please reduce the "
                        "length of the tokens.",
                        "type": "invalid_request_error",
                        "param": "tokens",
                        "code": "context_length_exceeded",
                    }
                },
            )
        assert where == ["worker", "worker"]  # both large bodies parsed off the event loop
        assert (parsed_ids, calls.n) == ([], 0)  # not one id parsed, nothing decoded
        assert len(store._tenants["tenant-a"].rpm) == 2  # each one request against RPM
    finally:
        g.stop()


def test_tokenize_refuses_a_prompt_too_long_for_the_context_without_tokenizing_it(engine, monkeypatch):
    g, store, verifier = start(engine)
    counter = g.gw.models.by_name[MODEL].counter
    calls = Calls(monkeypatch, counter)
    per = counter.max_token_chars
    try:
        with g.client(timeout=30) as c:
            text = "a" * (per * 3277)  # at least 3,277 tokens: over the 3,276 limit whatever it counts
            r = c.post("/tokenize", json={"model": MODEL, "prompt": text})
            assert (r.status_code, r.json()["error"]["code"], r.json()["error"]["param"]) == (
                400,
                "context_length_exceeded",
                "prompt",
            )
            assert r.json()["error"]["message"] == (
                "This model's maximum context length is 3276 tokens. However, you requested at least 3277 tokens "
                "in the prompt alone (counting stopped there). Please reduce the length of the prompt."
            )
            r = c.post("/tokenize", json={"model": MODEL, "messages": [{"role": "user", "content": text}]})
            assert (r.status_code, r.json()["error"]["param"]) == (400, "messages")
        assert calls.n == 0
    finally:
        g.stop()


def test_tokenize_spends_rpm_before_its_body_is_read_and_tpm_above_2048_tokens(engine, monkeypatch):
    g, store, verifier = start(engine, rpm=3, tpm=5000)
    where = _parse_threads(monkeypatch)
    long_text = "hello " * 2999  # 3,000 tokens with the bundled tokenizer (one per word, the last space)
    try:
        with g.client() as c:
            r = c.post("/tokenize", json={"model": MODEL, "prompt": "Say hello."})
            assert (r.status_code, r.json()["count"]) == (200, 3)
            assert r.headers["x-ratelimit-remaining-requests"] == "2"
            assert "x-ratelimit-remaining-tokens" not in r.headers  # 3 tokens: free
            r = c.post("/tokenize", json={"model": MODEL, "prompt": long_text})
            assert (r.status_code, r.json()["count"]) == (200, 3000)
            assert r.headers["x-ratelimit-remaining-tokens"] == "2000"
            r = c.post("/tokenize", json={"model": MODEL, "prompt": long_text})  # 3,000 > 2,000 left
            assert r.status_code == 429
            assert r.json()["error"]["message"].startswith(
                "Rate limit reached for tenant 'tenant-a' on tokens per 60s window (TPM): Limit 5000, Used 3000, "
                "Requested 3000."
            )
            big = {"model": MODEL, "prompt": "x" * 100_000}
            r = c.post("/tokenize", json=big)  # the RPM is spent: refused before the body is read
            assert (r.status_code, r.json()) == (429, {"error": rpm_429(r, 3, 3)})
            assert r.headers["connection"] == "close"
        assert where == []  # no large body was parsed
        log = store._tenants["tenant-a"]
        assert (log.tpm_sum, log.leases) == (3000, {})
    finally:
        g.stop()


def test_a_client_gone_mid_body_releases_its_lease(engine):
    import socket

    from tests.gateway_harness import KEY_A

    g, store, verifier = start(engine, rpm=10, max_concurrent=1)
    try:
        s = socket.create_connection(("127.0.0.1", g.port))
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            + f"authorization: Bearer {KEY_A}\r\ncontent-length: 100000\r\n\r\n".encode()
            + b'{"model": "kvgate-tiny", "messages": ['
        )
        assert _wait(lambda: "tenant-a" in store._tenants and len(store._tenants["tenant-a"].leases) == 1)
        s.close()  # gone before the body arrived
        assert _wait(lambda: store._tenants["tenant-a"].leases == {})
        with g.client() as c:
            assert c.post("/v1/chat/completions", json=chat()).status_code == 200  # the slot is free
        assert len(store._tenants["tenant-a"].rpm) == 2
    finally:
        g.stop()


def test_2048_embedding_inputs_of_1100_ids_are_refused_before_their_ids_are_checked(monkeypatch):
    from tests import test_gateway_api_routes as api
    from tests.mock_api_engine import ApiMockEngine

    engine = ApiMockEngine().start()
    s = api.api_settings(engine)
    s = s.model_copy(update={"gateway": s.gateway.model_copy(update={"max_body_bytes": 8 << 20})})
    g = Gateway(s, tenants(allowed_models=[MODEL, api.EMB])).start()  # 2,048 inputs allowed
    checked: list[int] = []
    counter = g.gw.models.by_name[api.EMB].counter
    real_check = counter.check_ids
    monkeypatch.setattr(counter, "check_ids", lambda ids, param: checked.append(len(ids)) or real_check(ids, param))
    try:
        with g.client(timeout=30) as c:
            r = c.post("/v1/embeddings", json={"model": api.EMB, "input": [[1] * 1100] * 2048})
            assert (r.status_code, r.json()) == (
                400,
                {
                    "error": {
                        "message": "This request needs at least 2252800 tokens of KV cache (2048 inputs); the "
                        "engines serving this model hold at most 3276 for one request. Send fewer or shorter inputs.",
                        "type": "invalid_request_error",
                        "param": "input",
                        "code": "invalid_request",
                    }
                },
            )
        assert (checked, api.forwarded(engine, "/v1/embeddings")) == ([], [])
    finally:
        g.stop()
        engine.stop()
