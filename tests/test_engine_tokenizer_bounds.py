"""A hostile engine behind an ``engine`` tokenizer (:mod:`tokenizer.engine_counter`): its
``/tokenize`` and ``/detokenize`` answers are read as the gateway's other engine clients read
theirs. Through the whole gateway (kvgate's edge server, quotas in process), each fault is the
client's 502 ``upstream_unavailable`` (:class:`~tokenizer.errors.EngineTokenizeError`), settled as
an engine that answered 500 is, and the gateway answers ``/livez`` at once afterwards.

The findings this file holds fixed: a gzip answer was inflated whole, however large (memory, and
the event loop stalled while it was); an answer nesting 100,000 arrays raised ``RecursionError``
(500 ``internal_error`` on chat, completions, ``/tokenize`` and ``/detokenize``); an answer trickled
a byte at a time never tripped the per-read timeout (a chat held its tenant's lease all along)."""

from __future__ import annotations

import gzip
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest

import tokenizer.engine_counter as engine_counter
from config.models import GatewaySettings, Settings, TenantsFile
from gateway.ops.tenants import TenantRegistry, hash_key
from gateway.quotas.tenant_quotas import build_quota_stage
from tests.gateway_harness import KEY_A, Gateway, closed_port_url, wait_for
from tokenizer.errors import EngineTokenizeError

pytestmark = pytest.mark.timeout(60)

MODEL = "eng"
#: the real cap, read before any test shrinks it
REAL_CAP = getattr(engine_counter, "MAX_ENGINE_BODY_BYTES", None)
#: the cap the tests read under (the real one is 64 MiB), above :data:`DEEP`'s size
CAP = 256 * 1024
#: a whole chat answer, for what the gateway admits and forwards
WHOLE = json.dumps(
    {
        "id": "c1",
        "object": "chat.completion",
        "model": MODEL,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
    }
).encode()
#: 100,000 nested arrays: past Python's recursion limit and orjson's nesting limit
DEEP = b'{"count": 5, "tokens": [1], "prompt": "x", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"


def sized(n: int) -> bytes:
    """A well-formed tokenize answer of exactly ``n`` bytes (count 5, padded)."""
    head, tail = b'{"count": 5, "tokens": [1, 2, 3, 4, 5], "prompt": "x", "pad": "', b'"}'
    return head + b"a" * (n - len(head) - len(tail)) + tail


class HostileEngine(BaseHTTPRequestHandler):
    """``/tokenize`` and ``/detokenize`` (vLLM's paths) answer as ``server.mode`` says; the chat
    and completions paths answer :data:`WHOLE`."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:  # keep pytest output clean
        pass

    def _send(self, status: int, body: bytes, *headers: tuple[str, str], length: int | None = None) -> None:
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body) if length is None else length))
        for k, v in headers:
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["content-length"]))
        mode = self.server.mode  # type: ignore[attr-defined]
        self.server.codings.append(self.headers.get("accept-encoding"))  # type: ignore[attr-defined]
        if not self.path.endswith("tokenize"):
            return self._send(200, WHOLE)
        ok = b'{"count": 5, "tokens": [1, 2, 3, 4, 5], "prompt": "x"}'
        if mode == "500":
            return self._send(500, b'{"object": "error", "message": "boom", "code": 500}')
        if mode == "gzip":  # 2 MB of JSON in about 2 KB
            return self._send(200, gzip.compress(sized(2_000_000)), ("content-encoding", "gzip"))
        if mode == "at-cap":
            return self._send(200, sized(CAP))
        if mode == "over-cap":
            return self._send(200, sized(CAP + 1))
        if mode == "deep":
            return self._send(200, DEEP)
        if mode == "trickle":  # a byte every 0.1 s: each read is prompt, the whole takes 5.5 s
            self._send(200, b"", length=len(ok))
            try:
                for i in range(len(ok)):
                    self.wfile.write(ok[i : i + 1])
                    self.wfile.flush()
                    time.sleep(0.1)
            except OSError:  # the gateway gave up
                self.close_connection = True
            return None
        return self._send(200, ok)


@pytest.fixture(scope="module")
def engine():
    server = ThreadingHTTPServer(("127.0.0.1", 0), HostileEngine)
    server.daemon_threads = True
    server.mode = "ok"
    server.codings = []
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join(5)


@pytest.fixture(scope="module")
def gw(engine):
    base = f"http://127.0.0.1:{engine.server_address[1]}"
    s = Settings.model_validate(
        {
            "gateway": {"connect_timeout_seconds": 1, "read_timeout_seconds": 5},
            "models": [
                {
                    "id": MODEL,
                    "context_length": 8192,
                    "tokenizer": {"kind": "engine", "url": base, "engine_api": "vllm"},
                }
            ],
            "upstreams": [
                {
                    "name": "u1",
                    "api_url": f"{base}/v1",
                    "pool_source": "static",
                    "static_pool_tokens": 100_000,
                    "pool_urls": [],
                    "models": [MODEL],
                }
            ],
            "verifier": {"enabled": False},
            "quotas": {"enabled": True, "window_seconds": 3600},
        }
    )
    limits = {"rpm": 10**6, "tpm": 10**9, "max_concurrent": 64}
    tenant = {"id": "tenant-a", "api_key_sha256": [hash_key(KEY_A)], "allowed_models": [MODEL], **limits}
    reg = TenantRegistry(TenantsFile.model_validate({"tenants": [tenant]}))
    g = Gateway(s, reg, edge=True, quotas=build_quota_stage(s)).start()
    yield g
    g.stop()


@pytest.fixture(autouse=True)
def small_cap(monkeypatch, engine):
    """Every test reads under :data:`CAP`; the engine answers well until a test says otherwise."""
    monkeypatch.setattr(engine_counter, "MAX_ENGINE_BODY_BYTES", CAP, raising=False)
    engine.mode = "ok"


ROUTES = {
    "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 5},
    "/v1/completions": {"model": MODEL, "prompt": "Say hello.", "max_tokens": 5},
    "/tokenize": {"model": MODEL, "prompt": "Say hello."},
    "/detokenize": {"model": MODEL, "tokens": [1, 2]},
}


def footprint(g: Gateway) -> tuple[int, int, int, int]:
    """Tenant a's RPM entries, TPM sum and held leases, and the requests the gateway holds, once
    every finished request has left the gateway and its lease is settled (within 5 s)."""
    log = lambda: g.gw.quotas.store._tenants.get("tenant-a")  # noqa: E731
    assert wait_for(lambda: not g.gw.requests and (log() is None or not log().leases))
    t = log()
    return (len(t.rpm), t.tpm_sum, len(t.leases), len(g.gw.requests)) if t else (0, 0, 0, len(g.gw.requests))


def ask(g: Gateway, path: str) -> tuple[httpx.Response, tuple[int, ...], float]:
    """``(answer, change of the footprint, seconds taken)`` of one request to ``path``; the
    gateway then answers ``/livez`` within 2 s (the gzip answer stalled it 5 s)."""
    before = footprint(g)
    t = time.monotonic()
    with g.client() as c:
        r = c.post(path, json=ROUTES[path])
        took = time.monotonic() - t
        assert c.get("/livez", timeout=2).status_code == 200
    return r, tuple(a - b for a, b in zip(footprint(g), before, strict=True)), took


def engine_error(caplog: pytest.LogCaptureFixture, engine: Any, message: str, what: str = "tokenize") -> dict:
    """The client's 502 body, once the gateway's log holds the fault's detail (``message``), which
    names the engine's URL: the client reads a fixed sentence."""
    port = engine.server_address[1]
    detail = f"engine {what} at http://127.0.0.1:{port}/{what} {message}"
    logged = [r.getMessage() for r in caplog.records if r.name == "kvgate.tokenizer"]
    assert logged[-1:] == [f"engine tokenizer failed: {detail!r}"]
    return {
        "error": {
            "message": EngineTokenizeError.CLIENT_MESSAGE,
            "type": "server_error",
            "param": None,
            "code": "upstream_unavailable",
        }
    }


#: a refusal's footprint: one RPM entry, nothing reserved, no lease held, no request left
REFUSED = (1, 0, 0, 0)


def test_an_engine_500_is_the_refusal_each_fault_matches(gw, engine, caplog):
    """The existing path each fault below now takes: the engine's 500 is the client's 502."""
    engine.mode = "500"
    r, delta, _ = ask(gw, "/v1/chat/completions")
    assert (r.status_code, r.json(), delta) == (502, engine_error(caplog, engine, "answered HTTP 500"), REFUSED)


def test_a_gzip_answer_is_refused_unread(gw, engine, caplog):
    """The client asks for ``identity``; a coded answer is the engine's fault, never inflated
    (it was: 2 KB here became 2 MB, over the cap, and counted)."""
    engine.mode = "gzip"
    engine.codings.clear()
    r, delta, _ = ask(gw, "/v1/chat/completions")
    assert (r.status_code, r.json()) == (502, engine_error(caplog, engine, "answered with Content-Encoding 'gzip'"))
    assert delta == REFUSED and engine.codings == ["identity"]


def test_an_answer_over_the_cap_is_refused_and_one_at_it_counted(gw, engine, caplog):
    engine.mode = "at-cap"
    r, delta, _ = ask(gw, "/v1/chat/completions")
    assert (r.status_code, r.json()["usage"], delta) == (
        200,
        {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
        (1, 6, 0, 0),
    )
    engine.mode = "over-cap"
    r, delta, _ = ask(gw, "/v1/chat/completions")
    assert (r.status_code, r.json()) == (502, engine_error(caplog, engine, f"answered more than {CAP} bytes"))
    assert delta == REFUSED


@pytest.mark.parametrize("path", list(ROUTES))
def test_deep_nesting_is_the_engines_fault_not_a_500(gw, engine, path, caplog):
    """orjson's nesting limit (1,024) is a parse failure like any other (``json`` raised
    ``RecursionError``: 500 ``internal_error`` on every route)."""
    engine.mode = "deep"
    r, delta, _ = ask(gw, path)
    what = "detokenize" if path == "/detokenize" else "tokenize"
    assert (r.status_code, r.json()) == (502, engine_error(caplog, engine, "answered a body that is not JSON", what))
    assert delta == REFUSED


def test_a_trickled_answer_ends_at_the_deadline(gw, engine, monkeypatch, caplog):
    """Each byte comes well within the per-read timeout, the whole not within ``timeout_seconds``
    (0.5 s here): the request ends then, its lease given back."""
    monkeypatch.setattr(gw.gw.models.by_name[MODEL].counter, "timeout_seconds", 0.5, raising=False)
    engine.mode = "trickle"
    r, delta, took = ask(gw, "/v1/chat/completions")
    assert (r.status_code, r.json()) == (502, engine_error(caplog, engine, "answered nothing whole within 0.5 s"))
    assert delta == REFUSED and took < 2


async def test_proxy_variables_are_not_followed(engine, monkeypatch):
    """As the pool watcher's client: the engine is reached directly, whatever the environment's
    proxy variables say (a proxy where nothing listens here)."""
    monkeypatch.setenv("ALL_PROXY", closed_port_url())
    monkeypatch.setenv("HTTP_PROXY", closed_port_url())
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    counter = engine_counter.EngineCounter(f"http://127.0.0.1:{engine.server_address[1]}", MODEL, api="vllm")
    try:
        assert (await counter.acount_prompt("Say hello.")).per_prompt == (5,)
    finally:
        await counter.aclose()


def test_the_cap_holds_the_largest_honest_tokenize_answer():
    """:data:`~tokenizer.engine_counter.MAX_ENGINE_BODY_BYTES` (:data:`REAL_CAP`) against the largest honest answer:
    the largest token-id prompt a default body holds (``0,`` per id), answered by ``/tokenize``
    with the widest ids (10 digits) and separators (``", "``); and the bound the forward path
    reads a completion under (the text ``/detokenize`` answers for as many ids)."""
    body_bytes = GatewaySettings().max_body_bytes
    ids = (body_bytes - len(b'{"model":"m","prompt":[]}')) // 2 + 1
    widest = json.dumps({"count": ids, "max_model_len": 2**31, "tokens": [2**31 - 1] * 3})
    per_id = len(", 2147483647")
    answer = len(widest) + (ids - 3) * per_id
    assert (ids, answer) == (4_194_292, 50_331_563)
    assert REAL_CAP == 64 << 20 and answer <= REAL_CAP and GatewaySettings().max_response_bytes <= REAL_CAP
