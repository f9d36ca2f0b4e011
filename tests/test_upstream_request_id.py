"""The ``x-request-id`` an engine gets is the gateway's own id for the request
(``RelayOutcome.upstream_request_id`` in gateway/relay/proxy.py: 32 hex digits), never the
client's: vLLM takes the header as its engine request id (``serving_engine.py``
``_base_request_id``), so two tenants sending one id shared an engine request id (aborts by id,
"request id already running", one engine log for both). The client still gets its own id back,
and the access line carries both (``upstream_request_id``: ``None`` when nothing was forwarded).
And a pool with every connection busy (``PoolTimeout``) is counted as
``kvgate_upstream_errors_total{kind="pool"}`` and sends the upstream into no connect back-off:
the engine answers, its connections are all taken."""

from __future__ import annotations

import hashlib
import hmac
import json
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit

import pytest

from config.models import TenantsFile
from gateway.ops.tenants import TenantRegistry, hash_key
from tests.gateway_harness import (
    KEY_A,
    KEY_B,
    MODEL,
    SECRETS,
    Gateway,
    chat,
    closed_port_url,
    settings_for,
    upstream,
    wait_for,
)
from tests.mock_engine import MockEngine, gateway_id
from tests.test_gateway_pipeline import access  # noqa: F401  (the access fixture)

pytestmark = pytest.mark.timeout(60)

VICTIM = "chatcmpl-victim-0001"  # a request id another tenant can read or guess
OTHER = "other-model"


def _registry() -> TenantRegistry:
    """``tenant-a`` (:data:`KEY_A`) and ``tenant-b`` (:data:`KEY_B`), both allowed :data:`MODEL`
    and :data:`OTHER`."""
    entries = [
        {"id": tid, "api_key_sha256": [hash_key(key)], "allowed_models": [MODEL, OTHER]}
        for tid, key in (("tenant-a", KEY_A), ("tenant-b", KEY_B))
    ]
    return TenantRegistry(TenantsFile.model_validate({"tenants": entries}))


def _salt(tenant_id: str) -> str:
    """The ``cache_salt`` the gateway forwards for ``tenant_id`` (gateway.app ``cache_salt``)."""
    return hmac.new(SECRETS["cache_salt_key"], tenant_id.encode(), hashlib.sha256).hexdigest()


def _metric(g: Gateway, line_start: str) -> list[str]:
    with g.client() as c:
        text = c.get("/metrics").text
    return [line for line in text.splitlines() if line.startswith(line_start)]


# ---------------------------------------------------------------- one client id, two tenants
def test_two_tenants_sending_one_request_id_get_two_engine_request_ids(engine, access):  # noqa: F811
    """``tenant-a`` and ``tenant-b`` each send ``x-request-id: chatcmpl-victim-0001``, whole and
    streamed: the engine gets four different ids of the gateway's, none the client's; each client
    gets its own id back; each access line pairs the client's id with the one its engine got. Before,
    the engine got ``chatcmpl-victim-0001`` four times."""
    g = Gateway(settings_for([upstream("u1", engine)]), _registry()).start()
    try:
        for stream in (False, True):
            for key in (KEY_A, KEY_B):
                with g.client(key) as c:
                    body = chat(max_tokens=5, stream=stream)
                    r = c.post("/v1/chat/completions", json=body, headers={"x-request-id": VICTIM})
                assert (r.status_code, r.headers["x-request-id"]) == (200, VICTIM)
                if stream:
                    assert r.text.endswith("data: [DONE]\n\n") and r.text.count("[DONE]") == 1
                else:
                    assert r.json()["choices"][0]["message"]["content"] == "Hello from the mock."
        assert wait_for(lambda: len(access(VICTIM)) == 4, 3)
    finally:
        g.stop()
    tenant_of = {_salt(t): t for t in ("tenant-a", "tenant-b")}
    got = {
        (tenant_of[r["body"]["cache_salt"]], bool(r["body"].get("stream"))): gateway_id(
            r["headers"]["x-request-id"], VICTIM
        )
        for r in engine.state.requests
    }
    assert len(engine.state.requests) == 4 and len(set(got.values())) == 4  # four requests, four engine ids
    assert sorted(got) == [("tenant-a", False), ("tenant-a", True), ("tenant-b", False), ("tenant-b", True)]
    lines = access(VICTIM)
    assert {line["request_id"] for line in lines} == {VICTIM}
    assert {(line["tenant"], line["stream"]): line["upstream_request_id"] for line in lines} == got


def test_a_request_refused_before_it_is_forwarded_has_no_upstream_request_id(engine, access):  # noqa: F811
    """Refused by every engine's port (503 ``upstream_unavailable``): nothing reached an engine,
    the access line's ``upstream_request_id`` is ``None``. Refused by admission (400
    ``context_length_exceeded``): the line has no relay fields at all, that one included."""
    up = upstream("u1", engine, api_url=closed_port_url() + "/v1")  # the pool read from the engine
    g = Gateway(settings_for([up]), _registry()).start()
    try:
        with g.client() as c:
            r = c.post("/v1/chat/completions", json=chat(max_tokens=5), headers={"x-request-id": "down"})
            assert (r.status_code, r.json()["error"]["code"]) == (503, "upstream_unavailable")
            r = c.post("/v1/chat/completions", json=chat(max_tokens=4096), headers={"x-request-id": "long"})
            assert (r.status_code, r.json()["error"]["code"]) == (400, "context_length_exceeded")
        assert wait_for(lambda: len(access("down")) == len(access("long")) == 1, 3)
    finally:
        g.stop()
    assert engine.state.requests == []
    down, long = access("down")[0], access("long")[0]
    assert down.pop("overhead_ms") >= 0 and down.pop("total_ms") >= 0
    assert down == {
        "request_id": "down",
        "tenant": "tenant-a",
        "route": "chat",
        "status": 503,
        "model": MODEL,
        "upstream": None,
        "upstream_request_id": None,
        "stream": False,
        "prompt_tokens": 11,
        "max_tokens": 5,
        "limit_tokens": 3276,
        "completion_tokens": None,
        "finish_reason": None,
        "ttft_ms": None,
        "error_code": "upstream_unavailable",
    }
    assert long.pop("overhead_ms") >= 0
    assert long == {
        "request_id": "long",
        "tenant": "tenant-a",
        "route": "chat",
        "status": 400,
        "error_code": "context_length_exceeded",
        "param": "messages",
        "prompt_tokens": 11,
    }


# ---------------------------------------------------------------- a pool with every connection busy
@contextmanager
def _holding(g: Gateway, engine: MockEngine) -> Iterator[None]:
    """A :data:`OTHER` request that ``engine`` (in ``hang`` mode) never answers holds the only
    connection of its origin's pool (``max_connections`` 1) until the block ends and its client
    leaves."""
    data = json.dumps(chat(model=OTHER, max_tokens=5)).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\nauthorization: Bearer {KEY_A}\r\n"
        f"content-type: application/json\r\nx-request-id: holder\r\ncontent-length: {len(data)}\r\n\r\n"
    ).encode()
    url = urlsplit(g.url)
    with socket.create_connection((url.hostname, url.port), timeout=5) as s:
        s.sendall(head + data)
        assert wait_for(lambda: len(engine.state.requests) == 1, 3)
        yield
    assert wait_for(lambda: engine.state.cancelled, 3)


def _busy_gateway(busy: MockEngine, spare: MockEngine | None) -> Gateway:
    """Upstream ``holder`` (:data:`OTHER`) and ``busy`` (:data:`MODEL`, first in order) on
    ``busy``'s one origin, then ``spare`` (:data:`MODEL`) when given; one connection per origin,
    0.3 s to wait for it."""
    ups: list[dict[str, Any]] = [upstream("holder", busy, models=[OTHER]), upstream("busy", busy)]
    if spare is not None:
        ups.append(upstream("spare", spare))
    gateway = {"max_connections": 1, "connect_timeout_seconds": 0.3}
    return Gateway(settings_for(ups, gateway=gateway, models=[{"id": OTHER, "context_length": 8192}]), _registry())


@pytest.mark.parametrize("with_spare", [True, False], ids=["spare", "alone"])
def test_a_busy_pool_is_no_connect_failure(engines, access, with_spare):  # noqa: F811
    """``busy``'s only connection is held by a hung request; a :data:`MODEL` request tries
    ``busy`` first (round robin starts at the first candidate; both have none in flight), waits
    0.3 s for a connection (``PoolTimeout``), then goes to ``spare`` (200), or, with no other
    upstream, is 504 ``upstream_timeout``. ``busy`` is not backing off (its engine answers) and the
    wait is counted ``kind="pool"``. Before, it was counted ``connect`` and ``busy`` backed off,
    as if its engine were down."""
    busy = engines()
    busy.state.mode = "hang"
    spare = engines() if with_spare else None
    g = _busy_gateway(busy, spare).start()
    try:
        with _holding(g, busy):
            with g.client() as c:
                t0 = time.monotonic()
                r = c.post("/v1/chat/completions", json=chat(max_tokens=5), headers={"x-request-id": "second"})
                took = time.monotonic() - t0
        assert wait_for(lambda: len(access("second")) == 1, 3)
        u = next(u for u in g.gw.upstreams.all if u.name == "busy")
        backoff = (u.backoff_until, u.backing_off(time.monotonic()), u.connect_failures)
        errors = _metric(g, "kvgate_upstream_errors_total{")
    finally:
        g.stop()
    assert 0.3 <= took < 2.0  # the pool's wait, then the next upstream at once
    assert backoff == (0.0, False, 0)
    assert errors == ['kvgate_upstream_errors_total{kind="pool",upstream="busy"} 1.0']
    assert [r["body"]["model"] for r in busy.state.requests] == [OTHER]  # only the holder reached it
    line = access("second")[0]
    if spare is not None:
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "Hello from the mock."
        assert spare.state.request_ids() == [gateway_id(line["upstream_request_id"], "second")]
        assert (line["status"], line["upstream"]) == (200, "spare")
    else:
        assert r.status_code == 504
        assert r.json() == {
            "error": {
                "message": "No upstream engine accepted the connection in time.",
                "type": "server_error",
                "param": None,
                "code": "upstream_timeout",
            }
        }
        assert (line["status"], line["upstream"], line["upstream_request_id"]) == (504, None, None)
