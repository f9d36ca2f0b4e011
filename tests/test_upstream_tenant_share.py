"""One tenant holds at most its share of an upstream origin's connections in a gateway process
(``gateway.upstream_tenant_share``: max(1, floor(share x ``max_connections``)) connections;
:class:`gateway.relay.upstreams.TenantShare`). Before, a tenant's slow streams could hold all of an
upstream's ``max_connections`` (its concurrency quota may allow it, and two keys of one tenant
together surely did), and every other tenant's request waited ``connect_timeout_seconds`` for a
pooled connection and got 504.

A request of a tenant at its cap waits for one of its own connections to that origin, at most
``connect_timeout_seconds``, and then gets what a pool wait in vain gets (504 ``upstream_timeout``,
no back-off for the healthy upstream, counted ``kind="tenant_share"``); another tenant is served
at once; a tenant at its cap on one upstream goes to another serving the model. The gateway
forwards through its real transport to :class:`HoldingEngine`, whose streams hold their
connection until the test lets them end."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from config import ConfigError, load_settings
from config.models import GatewaySettings, TenantsFile
from gateway.ops.tenants import TenantRegistry, hash_key
from tests.gateway_harness import MODEL, chat, settings_for, upstream, wait_for
from tests.mock_engine import MockState, ServerThread, default_stream, whole_body

pytestmark = pytest.mark.timeout(120)

KEY_A1 = "sk-share-tenant-a-1"  # two keys of one tenant: one share between them
KEY_A2 = "sk-share-tenant-a-2"
KEY_B = "sk-share-tenant-b"
KEY_C = "sk-share-tenant-c"
OTHER = "other-model"

#: what a request gets when no connection came free within ``connect_timeout_seconds``: the pool
#: wait in vain of today, and the tenant's wait for its own share in vain
POOL_WAIT_504 = (
    b'{"error":{"message":"No upstream engine accepted the connection in time.",'
    b'"type":"server_error","param":null,"code":"upstream_timeout"}}'
)
#: a whole answer as the engine sends it and the client gets it (:func:`tests.mock_engine.whole_body`)
WHOLE = JSONResponse(whole_body(MockState(), True)).body
#: the engine's 500 answer (:class:`HoldingEngine`, prompt ``fail``) and what the client gets of it
ENGINE_500 = {"error": {"message": "engine boom", "type": "server_error", "code": "engine_boom"}}
RELAYED_500 = b'{"error":{"message":"engine boom","type":"server_error","param":null,"code":"engine_boom"}}'
#: a stream answer as the engine sends it and the client gets it (:func:`tests.mock_engine.default_stream`)
STREAM_EVENTS = default_stream(MockState(), {"stream": True}, True)
STREAM = b"".join(STREAM_EVENTS)
#: what the client gets of a stream the engine breaks after its first two events
CUT_STREAM = (
    STREAM_EVENTS[0]
    + STREAM_EVENTS[1]
    + b'data: {"error":{"message":"The upstream engine broke the connection (RemoteProtocolError).",'
    b'"type":"server_error","param":null,"code":"upstream_unavailable"}}\n\ndata: [DONE]\n\n'
)


class HoldingEngine(ServerThread):
    """An SGLang-like engine (``/server_info``, ``/v1/chat/completions``) on a free loopback
    port. A stream request whose prompt is ``hold <name>`` gets its first event at once, then
    holds its connection until :meth:`release` names it (or the gateway goes away); ``fail``: a
    500 error answer; ``cut``: a stream broken after its first event; any other prompt: answered
    at once (whole or streamed). ``seen``: the prompts received, in order."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        self.released: set[str] = set()
        self.release_all = False
        super().__init__(self._app())

    @property
    def api_url(self) -> str:
        return self.url + "/v1"

    @property
    def info_url(self) -> str:
        return self.url + "/server_info"

    def release(self, name: str) -> None:
        self.released.add(name)

    def stop(self) -> None:
        self.release_all = True
        super().stop()

    def _app(self) -> Starlette:
        async def server_info(request: Request) -> Response:
            return JSONResponse({"max_total_num_tokens": 4096, "page_size": 16, "context_length": 8192, "status": "ok"})

        async def completion(request: Request) -> Response:
            body = json.loads(await request.body())
            prompt = body["messages"][0]["content"]
            self.seen.append(prompt)
            if prompt == "fail":
                return JSONResponse(ENGINE_500, status_code=500)
            if not body.get("stream"):
                return JSONResponse(whole_body(MockState(), True))
            return StreamingResponse(self._events(prompt, body), media_type="text/event-stream")

        return Starlette(
            routes=[
                Route("/server_info", server_info),
                Route("/v1/chat/completions", completion, methods=["POST"]),
            ]
        )

    async def _events(self, prompt: str, body: dict[str, Any]) -> Any:
        chunks = default_stream(MockState(), body, True)
        yield chunks[0] + chunks[1]  # the role and the first words: the gateway starts its answer
        if prompt == "cut":
            raise ConnectionResetError("the engine broke the stream")
        name = prompt.removeprefix("hold ")
        while prompt.startswith("hold ") and name not in self.released and not self.release_all:
            await asyncio.sleep(0.01)
        for c in chunks[2:]:
            yield c


@pytest.fixture
def holding_engines() -> Iterator[Any]:
    """``holding_engines()`` starts a :class:`HoldingEngine`; all stop after the test."""
    with ExitStack() as stack:

        def start() -> HoldingEngine:
            e = HoldingEngine().start()
            stack.callback(e.stop)
            return e  # type: ignore[return-value]

        yield start


def _registry() -> TenantRegistry:
    """``tenant-a`` (keys :data:`KEY_A1`, :data:`KEY_A2`), ``tenant-b`` (:data:`KEY_B`) and
    ``tenant-c`` (:data:`KEY_C`), all allowed :data:`MODEL` and :data:`OTHER`, no quotas."""
    keys = {"tenant-a": [KEY_A1, KEY_A2], "tenant-b": [KEY_B], "tenant-c": [KEY_C]}
    entries = [
        {"id": tid, "api_key_sha256": [hash_key(k) for k in ks], "allowed_models": [MODEL, OTHER]}
        for tid, ks in keys.items()
    ]
    return TenantRegistry(TenantsFile.model_validate({"tenants": entries}))


def _gateway(gateway: Any, engine: HoldingEngine, share: float, connect_timeout_seconds: float = 1.0) -> Any:
    """A gateway with ``max_connections`` 4 and ``upstream_tenant_share`` ``share`` (0.5: 2 a
    tenant) and one upstream, ``u1``, to ``engine``."""
    settings = settings_for(
        [upstream("u1", api_url=engine.api_url, pool_urls=[engine.info_url])],
        gateway={
            "max_connections": 4,
            "upstream_tenant_share": share,
            "connect_timeout_seconds": connect_timeout_seconds,
            "read_timeout_seconds": 60,
        },
    )
    return gateway(settings, _registry())


def _open_stream(stack: ExitStack, g: Any, key: str, prompt: str, model: str = MODEL) -> httpx.Response:
    """A stream request whose answer has started (so the gateway holds its upstream connection);
    it stays open until ``stack`` closes or it is read to its end."""
    c = stack.enter_context(httpx.Client(base_url=g.url, headers={"authorization": f"Bearer {key}"}, timeout=15))
    body = chat(prompt, model=model, max_tokens=5, stream=True)
    r = stack.enter_context(c.stream("POST", "/v1/chat/completions", json=body))
    assert r.status_code == 200
    return r


def _post(g: Any, key: str, prompt: str, *, stream: bool = False, timeout: float = 15) -> tuple[int, bytes, float]:
    """``(status, body, seconds it took)`` of a chat request."""
    t0 = time.monotonic()
    with httpx.Client(base_url=g.url, headers={"authorization": f"Bearer {key}"}, timeout=timeout) as c:
        r = c.post("/v1/chat/completions", json=chat(prompt, max_tokens=5, stream=stream))
    return r.status_code, r.content, time.monotonic() - t0


def _upstream_errors(g: Any) -> list[str]:
    with httpx.Client(base_url=g.url, timeout=5) as c:
        text = c.get("/metrics").text
    return [line for line in text.splitlines() if line.startswith("kvgate_upstream_errors_total{")]


def _shares(g: Any) -> list[Any]:
    """Each upstream's :class:`~gateway.relay.upstreams.TenantShare` (asserted to be there)."""
    shares = [getattr(u, "share", None) for u in g.gw.upstreams.all]
    assert all(s is not None for s in shares)
    return shares


def _idle(g: Any) -> bool:
    """No tenant holds or waits for a connection of any upstream's share."""
    return all(s.held_connections == {} and s._waiters == {} for s in _shares(g))


def test_a_tenant_at_its_share_waits_then_gets_the_pool_wait_504_while_another_is_served(holding_engines, gateway):
    """Share 0.5 of 4 connections: tenant A holds 2 streams, one per key; its third request
    waits ``connect_timeout_seconds`` (1 s) and gets the pool wait's 504, byte for byte, never
    reaching the engine; meanwhile tenant B's request is answered 200 at once. Counted
    ``kind="tenant_share"``; the upstream is not backed off. Before, the third request was
    forwarded at once (A could hold the whole pool)."""
    engine = holding_engines()
    g = _gateway(gateway, engine, 0.5)
    with ExitStack() as stack, ThreadPoolExecutor(2) as pool:
        held = [_open_stream(stack, g, KEY_A1, "hold a1"), _open_stream(stack, g, KEY_A2, "hold a2")]
        third: Future[tuple[int, bytes, float]] = pool.submit(_post, g, KEY_A1, "third")
        time.sleep(0.3)
        assert not third.done()  # waiting for one of A's own connections
        status_b, body_b, took_b = _post(g, KEY_B, "b now")
        assert (status_b, body_b) == (200, WHOLE) and took_b < 0.5
        status, body, took = third.result()
        assert (status, body) == (504, POOL_WAIT_504)
        assert 1.0 <= took < 1.8
        u1 = g.gw.upstreams.all[0]
        assert (u1.backoff_until, u1.connect_failures) == (0.0, 0)
        assert _shares(g)[0].held_connections == {"tenant-a": 2}
        for name, r in zip(("a1", "a2"), held, strict=True):
            engine.release(name)
            assert r.read() == STREAM
    assert engine.seen == ["hold a1", "hold a2", "b now"]
    assert _upstream_errors(g) == ['kvgate_upstream_errors_total{kind="tenant_share",upstream="u1"} 1.0']
    assert wait_for(lambda: _idle(g), 3)


def test_when_one_of_its_streams_ends_the_waiting_request_goes_on(holding_engines, gateway):
    """Tenant A holds its 2; its third request waits; as soon as one of A's streams ends, the
    third is forwarded and answered 200 (well within ``connect_timeout_seconds``, 3 s). Before,
    it was forwarded at once, before either stream ended."""
    engine = holding_engines()
    g = _gateway(gateway, engine, 0.5, connect_timeout_seconds=3.0)
    with ExitStack() as stack, ThreadPoolExecutor(1) as pool:
        a1 = _open_stream(stack, g, KEY_A1, "hold a1")
        _open_stream(stack, g, KEY_A1, "hold a2")
        third = pool.submit(_post, g, KEY_A2, "third", stream=True)
        time.sleep(0.3)
        assert not third.done() and engine.seen == ["hold a1", "hold a2"]
        engine.release("a1")
        assert a1.read() == STREAM
        status, body, took = third.result()
        assert (status, body) == (200, STREAM)
        assert 0.3 <= took < 1.5
        assert engine.seen == ["hold a1", "hold a2", "third"]
        assert wait_for(lambda: _shares(g)[0].held_connections == {"tenant-a": 1}, 3)  # a2 still held
        engine.release("a2")
    assert wait_for(lambda: _idle(g), 3)
    assert _upstream_errors(g) == []


def test_a_tenant_at_its_share_of_one_upstream_uses_another_and_none_backs_off(holding_engines, gateway):
    """``max_connections`` 8, share 0.25: 2 a tenant. u1 serves :data:`MODEL`, u2 it and
    :data:`OTHER`; tenants B and C hold 2 streams each on u2 (only it serves OTHER). Tenant A's
    streams go to u1, the upstream with fewest in flight, until A holds its 2 there; its next
    two go to u2 though u1 still has fewer in flight. A's fifth request then waits for whichever
    of its own comes back first, ``connect_timeout_seconds`` (1 s) in all (not one wait per
    upstream), and gets the pool wait's 504. Neither upstream backs off: B's next requests still
    go to u1, the one with fewest in flight. Before, A's third stream went to u1."""
    e1, e2 = holding_engines(), holding_engines()
    settings = settings_for(
        [
            upstream("u1", api_url=e1.api_url, pool_urls=[e1.info_url]),
            upstream("u2", api_url=e2.api_url, pool_urls=[e2.info_url], models=[MODEL, OTHER]),
        ],
        models=[{"id": OTHER, "context_length": 8192}],
        gateway={
            "max_connections": 8,
            "upstream_tenant_share": 0.25,
            "connect_timeout_seconds": 1.0,
            "read_timeout_seconds": 60,
        },
    )
    g = gateway(settings, _registry())
    with ExitStack() as stack:
        for i, key in enumerate((KEY_B, KEY_B, KEY_C, KEY_C)):
            _open_stream(stack, g, key, f"hold o{i}", model=OTHER)
        for i in range(4):
            _open_stream(stack, g, (KEY_A1, KEY_A2)[i % 2], f"hold a{i}")
        assert (e1.seen, e2.seen) == (
            ["hold a0", "hold a1"],
            ["hold o0", "hold o1", "hold o2", "hold o3", "hold a2", "hold a3"],
        )
        assert [u.in_flight for u in g.gw.upstreams.all] == [2, 6]
        status, body, took = _post(g, KEY_A1, "fifth")
        assert (status, body) == (504, POOL_WAIT_504)
        assert 1.0 <= took < 1.8  # one wait for both, not one each
        assert [(u.backoff_until, u.connect_failures) for u in g.gw.upstreams.all] == [(0.0, 0), (0.0, 0)]
        answers = [_post(g, KEY_B, f"b{i}") for i in range(3)]
        assert [(s, b) for s, b, _ in answers] == [(200, WHOLE)] * 3
        assert all(t < 0.5 for _, _, t in answers)
        assert e1.seen[2:] == ["b0", "b1", "b2"] and "fifth" not in e2.seen
        e1.release_all = e2.release_all = True
    assert _upstream_errors(g) == [
        'kvgate_upstream_errors_total{kind="tenant_share",upstream="u1"} 1.0',
        'kvgate_upstream_errors_total{kind="tenant_share",upstream="u2"} 1.0',
    ]
    assert wait_for(lambda: _idle(g), 3)


def test_no_share_leaks_after_errors_cuts_and_clients_that_leave(holding_engines, gateway):
    """Many of tenant A's requests end otherwise than well: the engine's 500 (relayed: 500 with
    the engine's error), streams the engine breaks (200 and the stream's error tail), clients
    that leave mid-stream, and clients that leave while waiting at the cap. Afterwards no
    connection of A's is counted, and A can hold exactly its 2 again: a third waits and gets
    the 504. Before, A's third request was forwarded at once."""
    engine = holding_engines()
    g = _gateway(gateway, engine, 0.5)
    for _ in range(6):
        assert _post(g, KEY_A1, "fail")[:2] == (500, RELAYED_500)
    for _ in range(6):
        status, body, _ = _post(g, KEY_A2, "cut", stream=True)
        assert (status, body) == (200, CUT_STREAM)
    for i in range(6):  # clients that leave mid-stream
        with ExitStack() as stack:
            _open_stream(stack, g, KEY_A1, f"hold left{i}")
    with ExitStack() as stack:  # clients that leave while waiting for one of A's own
        _open_stream(stack, g, KEY_A1, "hold x1")
        _open_stream(stack, g, KEY_A2, "hold x2")
        for _ in range(4):
            with pytest.raises(httpx.ReadTimeout):
                _post(g, KEY_A1, "gave up", timeout=0.3)
        assert _shares(g)[0].held_connections == {"tenant-a": 2}
    assert wait_for(lambda: _idle(g), 3)
    with ExitStack() as stack, ThreadPoolExecutor(1) as pool:
        _open_stream(stack, g, KEY_A1, "hold y1")
        _open_stream(stack, g, KEY_A2, "hold y2")
        third = pool.submit(_post, g, KEY_A1, "third")
        status, body, took = third.result()
        assert (status, body) == (504, POOL_WAIT_504)
        assert 1.0 <= took < 1.8
        engine.release_all = True
    assert wait_for(lambda: _idle(g), 3)
    assert "gave up" not in engine.seen and "third" not in engine.seen


def test_share_one_keeps_the_whole_pool_for_one_tenant(holding_engines, gateway):
    """``upstream_tenant_share`` 1.0: no cap, as before. Tenant A holds all 4 connections; then
    A's next request and tenant B's both wait for the pool and get the same 504, counted
    ``kind="pool"``; when one stream ends, B's next request is served."""
    engine = holding_engines()
    g = _gateway(gateway, engine, 1.0)
    with ExitStack() as stack:
        held = [_open_stream(stack, g, (KEY_A1, KEY_A2)[i % 2], f"hold a{i}") for i in range(4)]
        assert _post(g, KEY_A1, "fifth")[:2] == (504, POOL_WAIT_504)
        assert _post(g, KEY_B, "b waits")[:2] == (504, POOL_WAIT_504)
        engine.release("a0")
        assert held[0].read() == STREAM
        status, body, _ = _post(g, KEY_B, "b served")
        assert (status, body) == (200, WHOLE)
        engine.release_all = True
    assert engine.seen == [f"hold a{i}" for i in range(4)] + ["b served"]
    assert _upstream_errors(g) == ['kvgate_upstream_errors_total{kind="pool",upstream="u1"} 2.0']


@pytest.mark.parametrize(
    ("share", "max_connections", "cap"),
    [(0.5, 4, 2), (0.75, 512, 384), (0.29, 100, 29), (0.1, 4, 1), (0.001, 512, 1), (0.75, 1, None), (1.0, 512, None)],
)
def test_the_cap_is_the_floor_of_the_share_at_least_one(share, max_connections, cap):
    """max(1, floor(share x max_connections)), the share as the decimal written (0.29 of 100 is
    29, not the 28 of 0.29 x 100 in binary floats); ``None`` (no cap) when it is the whole pool."""
    from gateway.relay.upstreams import tenant_cap_connections

    g = GatewaySettings(upstream_tenant_share=share, max_connections=max_connections)
    assert tenant_cap_connections(g) == cap
    assert GatewaySettings().upstream_tenant_share == 0.75


def test_upstreams_share_one_tenant_share_exactly_when_their_requests_share_one_pool():
    """The tenant share of an origin (``config.models.url_origin``) and the transport's pool
    (``gateway.relay.h1_transport.url_origin``, the aiohttp transport's too) read one origin: host
    case and a port written as the scheme's default make none of their own. An IPv6 zone id's
    case does (``%25eth0`` and ``%25ETH0`` name two interfaces): the pools kept it, the share
    lower-cased it, so one share capped a tenant across two pools."""
    from types import SimpleNamespace

    from config.models import url_origin
    from gateway.relay.h1_transport import url_origin as pool_origin
    from gateway.relay.upstreams import UpstreamSet, make_upstream

    urls = [
        "http://Engine.Example/v1",
        "http://engine.example:80/v2",
        "http://[FE80::1%25ETH0]:8000/v1",
        "http://[fe80::1%25ETH0]:8000/v2",
        "http://[fe80::1%25eth0]:8000/v1",
    ]
    settings = settings_for(
        [upstream(f"u{i}", api_url=u, pool_urls=[u]) for i, u in enumerate(urls)],
        gateway={"max_connections": 4, "upstream_tenant_share": 0.5},
    )
    ups = [make_upstream(cfg, None) for cfg in settings.upstreams]  # type: ignore[arg-type]
    UpstreamSet(settings, ups)
    route = SimpleNamespace(upstream_path="/chat/completions")
    pools = [pool_origin(u.url_for(route)) for u in ups]
    assert pools == [("http", "engine.example", 80)] * 2 + [("http", "fe80::1%25ETH0", 8000)] * 2 + [
        ("http", "fe80::1%25eth0", 8000)
    ]
    assert [url_origin(u) for u in urls] == pools
    shares = [u.share for u in ups]
    assert [[j for j, t in enumerate(shares) if t is s] for s in shares] == [[0, 1], [0, 1], [2, 3], [2, 3], [4]]
    assert [[j for j, p in enumerate(pools) if p == q] for q in pools] == [[0, 1], [0, 1], [2, 3], [2, 3], [4]]
    assert {s.cap_connections for s in shares if s is not None} == {2}


def test_a_connection_given_back_passes_to_the_first_waiter_and_a_waiter_that_leaves_holds_none():
    """The share's own rules: a given-back connection goes to the tenant's first waiter (a later
    request of the tenant cannot take it first); a waiter handed one in the turn it gives up
    passes it on; a waiter on two origins takes the first one given back and leaves the other's
    queue; other tenants are not counted against it."""

    from gateway.relay.upstreams import TenantShare

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        s, t = TenantShare(1, 4), TenantShare(1, 4)
        assert s.try_take("a") and not s.try_take("a") and s.try_take("b")
        first = asyncio.ensure_future(TenantShare.take_any([s], "a", loop.time() + 5))
        second = asyncio.ensure_future(TenantShare.take_any([s], "a", loop.time() + 5))
        await asyncio.sleep(0)
        s.release("a")
        assert not s.try_take("a")  # handed to ``first``, not free for a newcomer
        assert await first is s and not second.done()
        s.release("a")
        second.cancel()  # handed one, then cancelled in the same turn: it passes on
        with pytest.raises(asyncio.CancelledError):
            await second
        assert s.held_connections == {"b": 1} and s._waiters == {}
        assert s.try_take("a")
        with pytest.raises(TimeoutError):
            await TenantShare.take_any([s], "a", loop.time() + 0.05)
        assert s.held_connections == {"a": 1, "b": 1} and s._waiters == {}
        assert t.try_take("a")
        both = asyncio.ensure_future(TenantShare.take_any([s, t], "a", loop.time() + 5))
        await asyncio.sleep(0)
        t.release("a")
        assert await both is t
        assert s._waiters == {} and t._waiters == {}
        for share, tenant in ((s, "a"), (s, "b"), (t, "a")):
            share.release(tenant)
        assert s.held_connections == {} and t.held_connections == {}

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("0", "Input should be greater than 0 (got 0)"),
        ("-0.25", "Input should be greater than 0 (got -0.25)"),
        ("1.5", "Input should be less than or equal to 1 (got 1.5)"),
        ("half", "Input should be a valid number, unable to parse string as a number (got 'half')"),
        (
            "true",
            "must be a number, not a boolean (YAML reads true/false, yes/no and on/off as booleans) (got True)",
        ),
    ],
)
def test_a_bad_share_is_a_config_error_naming_the_key(tmp_path: Path, value: str, problem: str):
    p = tmp_path / "kvgate.yaml"
    p.write_text(f"gateway:\n  upstream_tenant_share: {value}\n", encoding="utf-8")
    with pytest.raises(ConfigError) as ei:
        load_settings(p, environ={})
    assert str(ei.value) == f"{p}: line 2: gateway.upstream_tenant_share: {problem}"
    q = tmp_path / "empty.yaml"
    q.write_text("", encoding="utf-8")
    with pytest.raises(ConfigError) as ei:
        load_settings(q, environ={"KVGATE_GATEWAY__UPSTREAM_TENANT_SHARE": value})
    assert str(ei.value) == (
        f"{q}: gateway.upstream_tenant_share: {problem} "
        "(from environment variable KVGATE_GATEWAY__UPSTREAM_TENANT_SHARE)"
    )


#: what a request gets when every upstream it was tried on refused the connect (the last failure)
UNREACHABLE_503 = (
    b'{"error":{"message":"No upstream engine for this model is reachable.",'
    b'"type":"server_error","param":null,"code":"upstream_unavailable"}}'
)


@pytest.mark.parametrize("transport_kind", ["h1", "aiohttp"])
def test_a_wait_for_a_full_origin_is_a_share_wait_first_come_first_served_among_equals(
    holding_engines, gateway, transport_kind
):
    """``max_connections`` 2, share 0.5: 1 a tenant. A and B hold one stream each (the origin is
    full). A's second request waits for A's share; then C's (C has room) waits for the origin.
    0.8 s into A's wait A's stream ends: its connection goes to A's waiting request (each of the
    two holds none; A's came first), a stream that goes on, and C's request waits out its
    ``connect_timeout_seconds`` (1 s) in the share, not in the pool after it: 504, counted
    ``kind="pool"`` (every connection held by others, C below its cap), nothing back-off. Before,
    A's share passed to A's request and the connection to C's (the pool's first waiter), and
    A's request then waited in the pool and got the 504."""
    engine = holding_engines()
    settings = settings_for(
        [upstream("u1", api_url=engine.api_url, pool_urls=[engine.info_url])],
        gateway={
            "max_connections": 2,
            "upstream_tenant_share": 0.5,
            "connect_timeout_seconds": 1.0,
            "read_timeout_seconds": 60,
            "upstream_client": transport_kind,
        },
    )
    g = gateway(settings, _registry())
    with ExitStack() as stack, ThreadPoolExecutor(2) as pool:
        a1 = _open_stream(stack, g, KEY_A1, "hold a1")
        _open_stream(stack, g, KEY_B, "hold b1")
        a2 = pool.submit(_post, g, KEY_A2, "hold a2", stream=True)
        time.sleep(0.1)
        c1 = pool.submit(_post, g, KEY_C, "c1")
        time.sleep(0.7)
        assert not a2.done() and not c1.done()
        engine.release("a1")
        assert a1.read() == STREAM
        status, body, took = c1.result()
        assert (status, body) == (504, POOL_WAIT_504)
        assert 1.0 <= took < 1.5
        assert _shares(g)[0].held_connections == {"tenant-a": 1, "tenant-b": 1}
        u1 = g.gw.upstreams.all[0]
        assert (u1.backoff_until, u1.connect_failures) == (0.0, 0)
        engine.release("a2")
        assert a2.result()[:2] == (200, STREAM)
        engine.release_all = True
    assert engine.seen == ["hold a1", "hold b1", "hold a2"]
    assert _upstream_errors(g) == ['kvgate_upstream_errors_total{kind="pool",upstream="u1"} 1.0']
    assert wait_for(lambda: _idle(g), 3)


def test_two_tenants_holding_the_whole_origin_pass_the_next_connection_to_a_third(holding_engines, gateway):
    """``max_connections`` 4, share 0.75: 3 a tenant, so two tenants below their caps hold the
    whole origin (A and B two streams each). A's third stream request waits, then C's request:
    when one of A's streams ends, its connection goes to C (holding none), not to A's waiting
    request (A still holds one), which came first; when one of B's ends, to A's. Before, both
    waited in the transport's pool first come first served: A's third took the first connection
    given back and C waited for the second."""
    engine = holding_engines()
    g = _gateway(gateway, engine, 0.75, connect_timeout_seconds=5.0)
    with ExitStack() as stack, ThreadPoolExecutor(2) as pool:
        a1 = _open_stream(stack, g, KEY_A1, "hold a1")
        _open_stream(stack, g, KEY_A2, "hold a2")
        b1 = _open_stream(stack, g, KEY_B, "hold b1")
        _open_stream(stack, g, KEY_B, "hold b2")
        a3 = pool.submit(_post, g, KEY_A1, "hold a3", stream=True)
        time.sleep(0.2)
        c = pool.submit(_post, g, KEY_C, "c now")
        time.sleep(0.2)
        assert not a3.done() and not c.done()
        engine.release("a1")
        assert a1.read() == STREAM
        assert c.result()[:2] == (200, WHOLE)
        assert not a3.done()
        engine.release("a3")
        engine.release("b1")
        assert b1.read() == STREAM
        assert a3.result()[:2] == (200, STREAM)
        engine.release_all = True
    assert engine.seen == ["hold a1", "hold a2", "hold b1", "hold b2", "c now", "hold a3"]
    assert _upstream_errors(g) == []
    assert wait_for(lambda: _idle(g), 3)


def _refused_url() -> str:
    """An API URL on a loopback port nothing listens on (a connect to it is refused)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/v1"


def test_a_tenant_at_its_share_waits_for_it_before_an_upstream_that_backs_off(holding_engines, gateway):
    """u1 serves; u2 (another origin, connects refused) backs off. Tenant A holds its 2 of u1's
    connections (share 0.5 of 4). A's third request waits for its share of u1, not for a connect
    to u2: when one of A's streams ends it is answered 200 by u1, and nothing was tried on u2.
    A's next request, when no stream of A's ends, waits its ``connect_timeout_seconds`` in vain
    and only then is tried on u2, refused: 503. Before, each of A's requests at its share was
    first sent to u2 (a connect failure counted each time; a full ``connect_timeout_seconds``
    when the engine's connects hang) and then waited for its share (the last failure a 504)."""
    engine = holding_engines()
    settings = settings_for(
        [
            upstream("u1", api_url=engine.api_url, pool_urls=[engine.info_url]),
            upstream("u2", api_url=_refused_url(), pool_urls=[engine.info_url]),
        ],
        gateway={
            "max_connections": 4,
            "upstream_tenant_share": 0.5,
            "connect_timeout_seconds": 1.0,
            "read_timeout_seconds": 60,
        },
    )
    g = gateway(settings, _registry())
    u1, u2 = g.gw.upstreams.all
    u2.connect_failures, u2.backoff_until = 1, time.monotonic() + 60  # a connect to it just failed
    with ExitStack() as stack, ThreadPoolExecutor(1) as pool:
        a1 = _open_stream(stack, g, KEY_A1, "hold a1")
        _open_stream(stack, g, KEY_A2, "hold a2")
        third = pool.submit(_post, g, KEY_A1, "third")
        time.sleep(0.3)
        assert not third.done()
        assert _upstream_errors(g) == []  # not sent to u2 meanwhile
        engine.release("a1")
        assert a1.read() == STREAM
        status, body, took = third.result()
        assert (status, body) == (200, WHOLE) and took < 1.0
        assert _upstream_errors(g) == []
        _open_stream(stack, g, KEY_A1, "hold a3")  # A holds its 2 again
        status, body, took = _post(g, KEY_A2, "fourth")
        assert (status, body) == (503, UNREACHABLE_503)
        assert took >= 1.0
        engine.release_all = True
    assert engine.seen == ["hold a1", "hold a2", "third", "hold a3"]
    assert _upstream_errors(g) == [
        'kvgate_upstream_errors_total{kind="tenant_share",upstream="u1"} 1.0',
        'kvgate_upstream_errors_total{kind="connect",upstream="u2"} 1.0',
    ]
    assert (u1.backoff_until, u1.connect_failures) == (0.0, 0)
    assert wait_for(lambda: _idle(g), 3)


def test_a_share_wait_in_vain_is_counted_and_logged_once_per_origin_with_tenant_and_cap(
    holding_engines, gateway, caplog
):
    """u1 and u2 are two upstreams at one origin (one pool, one share). Tenant A holds its 2;
    its third request waits 0.5 s in vain: one ``tenant_share`` count and one log line, naming
    the tenant, its cap and both upstreams, saying no upstream is left. Before, the one wait
    was counted and logged once per upstream, each line ending "trying the next", without the
    tenant or the cap."""
    caplog.set_level(logging.WARNING, logger="kvgate.proxy")
    engine = holding_engines()
    settings = settings_for(
        [
            upstream("u1", api_url=engine.api_url, pool_urls=[engine.info_url]),
            upstream("u2", api_url=engine.api_url + "/", pool_urls=[engine.info_url]),
        ],
        gateway={
            "max_connections": 4,
            "upstream_tenant_share": 0.5,
            "connect_timeout_seconds": 0.5,
            "read_timeout_seconds": 60,
        },
    )
    g = gateway(settings, _registry())
    with ExitStack() as stack:
        _open_stream(stack, g, KEY_A1, "hold a1")
        _open_stream(stack, g, KEY_A2, "hold a2")
        assert _post(g, KEY_A1, "third")[:2] == (504, POOL_WAIT_504)
        engine.release_all = True
    assert _upstream_errors(g) == ['kvgate_upstream_errors_total{kind="tenant_share",upstream="u1"} 1.0']
    records = [r for r in caplog.records if r.name == "kvgate.proxy"]
    assert [r.getMessage() for r in records] == [
        "upstream u1: the tenant holds its share of the connections (TenantShareTimeout: tenant tenant-a "
        "held its 2 connections to u1, u2 for 0.5s), no upstream left to try"
    ]
    assert len(records[0].fields["request_id"]) == 32  # type: ignore[attr-defined]
    assert wait_for(lambda: _idle(g), 3)


def test_a_failing_close_of_the_upstream_response_keeps_the_answer_and_frees_the_share(
    holding_engines, gateway, monkeypatch, caplog
):
    """The transport's ``aclose`` of the engine's response raises (after closing it): the
    client still gets what it would have (the engine's 500 relayed, a whole answer, a stream, a
    stream cut with its error tail), the failure is logged with the request id, and the
    tenant's share and the upstream's in-flight count are given back once each. Before, the
    engine's 500 became the gateway's own 500 (``aclose``'s exception replaced it)."""
    from gateway.relay.h1_transport import H1Response

    original = H1Response.aclose

    async def failing_aclose(self: H1Response) -> None:
        await original(self)
        raise RuntimeError("aclose blew up")

    monkeypatch.setattr(H1Response, "aclose", failing_aclose)
    caplog.set_level(logging.ERROR, logger="kvgate.proxy")
    engine = holding_engines()
    g = _gateway(gateway, engine, 0.5)
    assert _post(g, KEY_A1, "fail")[:2] == (500, RELAYED_500)
    assert _post(g, KEY_A1, "w")[:2] == (200, WHOLE)
    assert _post(g, KEY_A1, "s", stream=True)[:2] == (200, STREAM)
    assert _post(g, KEY_A1, "cut", stream=True)[:2] == (200, CUT_STREAM)
    assert wait_for(lambda: _idle(g), 3)
    assert g.gw.upstreams.all[0].in_flight == 0
    assert wait_for(lambda: len([r for r in caplog.records if r.levelno == logging.ERROR]) >= 4, 3)
    records = [r for r in caplog.records if r.name == "kvgate.proxy" and r.levelno == logging.ERROR]
    assert [r.getMessage() for r in records] == ["closing the upstream response failed"] * 4
    assert all(str(r.exc_info[1]) == "aclose blew up" for r in records if r.exc_info)
    assert len({r.fields["request_id"] for r in records}) == 4  # type: ignore[attr-defined]
    assert _upstream_errors(g) == [
        'kvgate_upstream_errors_total{kind="http_500",upstream="u1"} 1.0',
        'kvgate_upstream_errors_total{kind="reset",upstream="u1"} 1.0',
    ]
