"""One upstream's faults stay its own: a hung engine holding all of its connections does not make a
request to another engine wait (the connection pool is per upstream), and an engine that drops
connects is put at the back of the order for a back-off instead of costing every other request a
``connect_timeout`` (:mod:`gateway.relay.upstreams`)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from gateway.relay.upstreams import UpstreamSet, make_upstream
from tests.gateway_harness import MODEL, chat, settings_for, tenants, upstream, wait_for

OTHER = "other-model"


def _hold(url: str, body: dict, seconds: float) -> None:
    """A request that gives up (and leaves) after ``seconds``."""
    try:
        httpx.post(url, json=body, headers={"authorization": "Bearer sk-test-tenant-a"}, timeout=seconds)
    except httpx.TimeoutException:
        pass


@pytest.mark.parametrize("kind", ["h1", "aiohttp"])
def test_a_hung_upstream_holding_its_connections_does_not_block_another(engines, gateway, kind):
    """``max_connections`` 2: two requests hang on u1 holding both of its connections; a request
    for the model u2 serves is answered 200 at once, and u2 sees exactly that one request."""
    hung = engines(mode="hang")
    ok = engines()
    settings = settings_for(
        [upstream("u1", hung), upstream("u2", ok, models=[OTHER])],
        models=[{"id": OTHER, "context_length": 8192}],
        # one tenant fills u1's whole pool here: no per-tenant share (tests/test_upstream_tenant_share.py)
        gateway={
            "max_connections": 2,
            "connect_timeout_seconds": 1,
            "upstream_client": kind,
            "upstream_tenant_share": 1.0,
        },
    )
    g = gateway(settings, tenants(allowed_models=[MODEL, OTHER]))
    holders = [
        threading.Thread(target=_hold, args=(g.url + "/v1/chat/completions", chat(max_tokens=5), 4.0)) for _ in range(2)
    ]
    for t in holders:
        t.start()
    try:
        assert wait_for(lambda: len(hung.state.requests) == 2, 3)  # both of u1's connections are held
        with g.client() as c:
            t0 = time.monotonic()
            r = c.post("/v1/chat/completions", json=chat(model=OTHER, max_tokens=5))
            took = time.monotonic() - t0
        assert r.status_code == 200, r.text
        assert took < 0.5
        assert len(ok.state.requests) == 1
    finally:
        for t in holders:
            t.join()


@pytest.fixture
def black_hole() -> Iterator[str]:
    """A loopback URL whose connects hang: a listening socket that never accepts, its queue (one
    connection at backlog 0) filled first, so the kernel drops further SYNs."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    for _ in range(3):
        s = socket.socket()
        s.setblocking(False)
        try:
            s.connect(("127.0.0.1", port))
        except BlockingIOError:
            pass
        fillers.append(s)
    time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        for s in [*fillers, listener]:
            s.close()


def _timed(c: httpx.Client) -> float:
    t0 = time.monotonic()
    r = c.post("/v1/chat/completions", json=chat(max_tokens=5))
    assert r.status_code == 200, r.text
    return time.monotonic() - t0


def test_an_upstream_that_drops_connects_backs_off(engines, gateway, black_hole):
    """Two upstreams, one dropping connects (its pool read elsewhere, so it stays eligible), a
    ``connect_timeout`` of 1 s: after its first connect timeout the next requests go to the other
    at once; once the 1 s back-off is over it is tried again, and its second failure backs it off
    for 2 s."""
    ok = engines()
    settings = settings_for(
        [upstream("hole", ok, api_url=black_hole), upstream("ok", ok)],
        gateway={"connect_timeout_seconds": 1},
    )
    g = gateway(settings)
    with g.client() as c:
        first = [_timed(c) for _ in range(2)]  # one of them tries the hole first
        assert sorted(round(t) for t in first) == [0, 1]
        after = [_timed(c) for _ in range(6)]
        assert all(t < 0.5 for t in after), after
        time.sleep(1.0)  # the back-off is over: the hole is tried again, once
        again = [_timed(c) for _ in range(2)]
        assert sorted(round(t) for t in again) == [0, 1]
        time.sleep(1.0)  # within the second, 2 s back-off
        later = [_timed(c) for _ in range(4)]
        assert all(t < 0.5 for t in later), later
    assert len(ok.state.requests) == 14


def test_backoff_order_and_growth():
    """The API itself: a failed upstream goes last, still tried when it is the only one left; the
    back-off doubles per failure in a row up to the cap; a connect that works ends it."""
    from gateway.relay.upstreams import BACKOFF_MAX_SECONDS

    urls = ["http://127.0.0.1:1/v1", "http://127.0.0.1:2/v1"]
    settings = settings_for([upstream(f"u{i}", api_url=u, pool_urls=[u]) for i, u in enumerate(urls)])
    ups = [make_upstream(cfg, None) for cfg in settings.upstreams]  # type: ignore[arg-type]
    us = UpstreamSet(settings, ups)
    a, b = ups
    a.connect_failed(now=time.monotonic())
    assert [us.order([a, b]) for _ in range(4)] == [([b], [a])] * 4  # a last whatever the rotation
    assert us.order([a]) == ([], [a])  # the only one: still tried
    now = 1000.0
    a.connected()
    backoffs = []
    for _ in range(8):  # each failure as the back-off before it ends
        a.connect_failed(now=now)
        backoffs.append(a.backoff_until - now)
        now = a.backoff_until
    assert backoffs == [1, 2, 4, 8, 16, BACKOFF_MAX_SECONDS, BACKOFF_MAX_SECONDS, BACKOFF_MAX_SECONDS]
    a.connected()
    for _ in range(8):  # eight requests that were connecting together: one back-off, not 2**8
        a.connect_failed(now=2000.0)
    assert (a.connect_failures, a.backoff_until) == (1, 2001.0)
    a.connect_failed(now=2001.0)  # as it ends: the next, doubled
    assert a.backoff_until == 2003.0
    a.connect_failed(now=2003.0 + BACKOFF_MAX_SECONDS + 1)  # long after: from the first again
    assert (a.connect_failures, a.backoff_until - (2003.0 + BACKOFF_MAX_SECONDS + 1)) == (1, 1.0)
    a.connected()
    assert not a.backing_off(time.monotonic()) and a.connect_failures == 0


def test_order_splits_once_ready_by_in_flight_round_robin_then_backing_by_end():
    """``UpstreamSet.order`` at one ``now``: ``(ready, backing)``, each candidate in one of them;
    ready ones fewest in flight first, ties in round-robin turn (the rotation advances once per
    call with two or more candidates); backing ones whose back-off ends first first."""
    urls = [f"http://127.0.0.1:{port}/v1" for port in range(1, 6)]
    settings = settings_for([upstream(f"u{i}", api_url=u, pool_urls=[u]) for i, u in enumerate(urls)])
    ups = [make_upstream(cfg, None) for cfg in settings.upstreams]  # type: ignore[arg-type]
    us = UpstreamSet(settings, ups)
    u0, u1, u2, u3, u4 = ups
    u1.in_flight = 3
    u3.backoff_until = 110.0  # backing off at 100, ends last
    u4.backoff_until = 105.0  # backing off at 100, ends first
    u2.backoff_until = 100.0  # ends at 100: not backing off then
    turns = [us.order(ups, now=100.0) for _ in range(4)]  # rotations u0.., u1.., u2.., u3..
    assert [([u.name for u in r], [u.name for u in b]) for r, b in turns] == [
        (["u0", "u2", "u1"], ["u4", "u3"]),
        (["u2", "u0", "u1"], ["u4", "u3"]),
        (["u2", "u0", "u1"], ["u4", "u3"]),
        (["u0", "u2", "u1"], ["u4", "u3"]),
    ]
    assert us.order(ups, now=110.0)[1] == []  # every back-off over: none backing
    assert us.order([u3], now=100.0) == ([], [u3])
    assert us.order([], now=100.0) == ([], [])
