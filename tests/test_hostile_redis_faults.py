"""A hostile review of Redis faults as the quota stage meets them, on a redis-server of the test's
own: Redis restarted mid-traffic (scripts and keys gone, another call having reloaded only some
scripts), a tenant's quota keys evicted one at a time (a ``maxmemory`` policy: simulated by
deleting the key the policy would pick), and ``maxmemory`` hit under ``noeviction``. Each must give
the documented answer (docs/quotas.md, "When Redis fails"): an admission, a 429 for a real limit or
an OpenAI-shaped 503, and counters that stay exact, never negative nor holding phantom tokens.
And a failover behind one address (a DNS name or proxy): the old primary, now a replica, answers
``READONLY`` on the connections the store keeps."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from config.errors import OpenAIError
from config.models import QuotaSettings, TenantConfig
from gateway.quotas.stores import RedisQuotaStore
from gateway.quotas.tenant_quotas import (
    BACKLOG_SLICE_MIN,
    PROBE_INTERVAL_SECONDS,
    TenantQuotas,
    redis_client_from_url,
)
from tests.quota_fixtures import SpareRedis, quota_state, spare_redis  # noqa: F401 (fixture)

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def server(spare_redis: SpareRedis) -> SpareRedis:  # noqa: F811 (the fixture)
    """A redis-server of this test's own (no persistence), killed after it."""
    return spare_redis


def _tenant(**kw: Any) -> TenantConfig:
    return TenantConfig(id=f"rf-{uuid.uuid4().hex[:8]}", **kw)


def _stage(server: SpareRedis, **settings: Any) -> TenantQuotas:
    store = RedisQuotaStore(redis_client_from_url(server.url, 0.25), prefix=f"rf-{uuid.uuid4().hex[:6]}")
    return TenantQuotas(QuotaSettings(**settings), store)


def _state(server: SpareRedis, stage: TenantQuotas, tenant_id: str) -> dict[str, Any]:
    """The tenant's keys as Redis holds them (:func:`quota_state` of the stage's store)."""
    assert isinstance(stage.store, RedisQuotaStore)
    return quota_state(server, stage.store, tenant_id)


def _evict(server: SpareRedis, stage: TenantQuotas, tenant_id: str, *which: int) -> None:
    """What an eviction policy does to a tenant's keys: some go (by index in ``store.keys``)."""
    assert isinstance(stage.store, RedisQuotaStore)
    keys = stage.store.keys(tenant_id)
    with redis.Redis(port=server.port) as r:
        assert r.delete(*(keys[i] for i in which)) == len(which)


async def test_begin_reserve_after_a_restart_that_reloaded_only_tokens_lua(server: SpareRedis) -> None:
    """Redis restarts without persistence; a request begun before it reserves its tokens, which
    loads ``tokens.lua`` alone again. The next one-step request's pipeline then met ``NOSCRIPT``
    for ``begin.lua`` while ``tokens.lua`` ran, found no begin and answered "begin"; the store
    re-ran only ``begin.lua``, so the request got a 429 naming no limit ("... on . Please try
    again in 1s.", remaining tokens 0) and lost its RPM entry. It must be admitted."""
    stage = _stage(server)
    t = _tenant(rpm=10, tpm=1000, max_concurrent=5)
    before = await stage.begin(t, "before")
    server.kill()
    server.start()  # same port, empty: keys and scripts gone
    await stage.reserve_tokens(t, before, 100)  # the stale connection reconnects; tokens.lua is loaded again
    lease = await stage.begin_reserve(t, "after", 200)
    assert lease.headers == {
        "x-ratelimit-limit-requests": "10",
        "x-ratelimit-remaining-requests": "9",
        "x-ratelimit-limit-tokens": "1000",
        "x-ratelimit-remaining-tokens": "700",
    }
    await stage.settle(lease, 150)
    await stage.settle(before, 80)  # settles against a window that lost its begin: nothing negative
    assert _state(server, stage, t.id) == {"rpm": 1, "tpm": 2, "debits": [80, 150], "sum": 230, "leases": 0}
    await stage.aclose()


async def test_an_evicted_tpm_sum_is_rebuilt_not_driven_negative(server: SpareRedis) -> None:
    """The TPM sum is evicted while the debits stay; the request then settles below its
    reservation. ``settle.lua`` added the refund to a missing key (sum -500), and the tenant was
    admitted 950 more tokens with 100 already in the window of a 1000 TPM."""
    stage = _stage(server)
    t = _tenant(tpm=1000)
    lease = await stage.begin_reserve(t, "a", 600)
    _evict(server, stage, t.id, 3)
    await stage.settle(lease, 100)
    with pytest.raises(OpenAIError) as ei:
        await stage.begin_reserve(t, "b", 950)
    assert (ei.value.status, ei.value.code) == (429, "rate_limit_exceeded")
    assert ei.value.message == (
        f"Rate limit reached for tenant '{t.id}' on tokens per 60s window (TPM): "
        "Limit 1000, Used 100, Requested 950. Please try again in 60s."
    )
    assert ei.value.headers == {
        "Retry-After": "60",
        "x-ratelimit-limit-tokens": "1000",
        "x-ratelimit-remaining-tokens": "900",
    }
    assert _state(server, stage, t.id) == {"rpm": 0, "tpm": 1, "debits": [100], "sum": 100, "leases": 0}
    await stage.aclose()


async def test_evicted_debits_leave_no_phantom_tokens_in_the_sum(server: SpareRedis) -> None:
    """The TPM log and its debits are evicted, the sum stays (900 of 1000). Every admission
    renewed the sum's expiry, so those 900 tokens, which no debit accounts for, never left the
    window: two windows later a 200-token request got a 429 with nothing in the window."""
    stage = _stage(server, window_seconds=1)
    t = _tenant(tpm=1000)
    await stage.settle(await stage.begin_reserve(t, "a", 900), 900)
    _evict(server, stage, t.id, 1, 2)
    await asyncio.sleep(1.1)
    await stage.settle(await stage.begin_reserve(t, "b", 100), 100)
    await asyncio.sleep(1.1)  # "b" has left the window too: the window is empty
    lease = await stage.begin_reserve(t, "c", 200)
    assert lease.headers == {"x-ratelimit-limit-tokens": "1000", "x-ratelimit-remaining-tokens": "800"}
    await stage.settle(lease, 200)
    assert _state(server, stage, t.id) == {"rpm": 0, "tpm": 1, "debits": [200], "sum": 200, "leases": 0}
    await stage.aclose()


async def test_a_late_settle_and_a_cancel_on_an_evicted_sum_keep_it_exact(server: SpareRedis) -> None:
    """With the sum evicted, a settle charging above a reservation that left the window (its
    ``:x`` debit) and a cancel of a reservation whose call failed must not create a sum of
    their own (``extra``, or minus the debit) that the next admission takes as the window's."""
    stage = _stage(server)
    t = _tenant(tpm=1000)
    kept = await stage.begin_reserve(t, "kept", 300)
    gone = await stage.begin_reserve(t, "gone", 200)
    _evict(server, stage, t.id, 3)
    assert isinstance(stage.store, RedisQuotaStore)
    assert await stage.store.cancel(t.id, [gone.state.lease_id]) == 1
    _evict(server, stage, t.id, 1, 2)  # now the log and debits go, the sum (absent) stays absent
    await stage.settle(kept, 500)  # its debit is gone: only usage above the reservation, 200, is debited
    assert _state(server, stage, t.id) == {"rpm": 0, "tpm": 1, "debits": [200], "sum": 200, "leases": 0}
    lease = await stage.begin_reserve(t, "next", 800)
    assert lease.headers == {"x-ratelimit-limit-tokens": "1000", "x-ratelimit-remaining-tokens": "0"}
    await stage.settle(lease, 800)
    await stage.aclose()


async def test_maxmemory_with_noeviction_is_a_503_and_leaves_nothing_behind(server: SpareRedis) -> None:
    """``maxmemory`` reached under ``noeviction``: a write-first script is refused with ``OOM``.
    The request gets the fail-closed 503 (OpenAI shape), the begin its pipeline made is undone,
    and limits hold again once memory is freed."""
    stage = _stage(server)
    t = _tenant(rpm=10, tpm=1000, max_concurrent=2)
    held = await stage.begin_reserve(t, "held", 100)
    with redis.Redis(port=server.port) as r:
        r.config_set("maxmemory-policy", "noeviction")
        r.config_set("maxmemory", 1)
        try:
            with pytest.raises(OpenAIError) as ei:
                await stage.begin_reserve(t, "oom", 100)
        finally:
            r.config_set("maxmemory", 0)
    assert (ei.value.status, ei.value.headers) == (503, {"Retry-After": "1"})
    assert ei.value.body() == {
        "error": {
            "message": "The quota store is unavailable, so the request cannot be admitted. Please try again shortly.",
            "type": "server_error",
            "param": None,
            "code": "quota_backend_unavailable",
        }
    }
    await asyncio.sleep(PROBE_INTERVAL_SECONDS + 0.1)  # the background round undoes the "oom" begin
    await stage.settle(held, 60)
    assert _state(server, stage, t.id) == {"rpm": 1, "tpm": 1, "debits": [60], "sum": 60, "leases": 0}
    await stage.aclose()


_UNAVAILABLE = {
    "error": {
        "message": "The quota store is unavailable, so the request cannot be admitted. Please try again shortly.",
        "type": "server_error",
        "param": None,
        "code": "quota_backend_unavailable",
    }
}


@contextlib.contextmanager
def _oom(server: SpareRedis) -> Iterator[None]:
    """``maxmemory`` reached under ``noeviction`` while the block runs (lifted after it)."""
    with redis.Redis(port=server.port) as r:
        r.config_set("maxmemory-policy", "noeviction")
        r.config_set("maxmemory", 1)
        try:
            yield
        finally:
            r.config_set("maxmemory", 0)


async def test_a_begin_under_noeviction_is_a_503_and_writes_nothing(server: SpareRedis) -> None:
    """``begin.lua`` trimmed the tenant's expired entries before adding its own. A removal is a
    write, and Redis refuses a script's adding command under ``noeviction`` only while the script
    has written nothing: every begin was admitted past ``maxmemory``. It must get the 503, its
    trims not made either, and the limits hold once memory is freed."""
    stage = _stage(server, window_seconds=1)
    t = _tenant(rpm=2, max_concurrent=3)
    await stage.settle(await stage.begin(t, "old"), 0)
    await asyncio.sleep(1.1)  # "old" has left the window; its entry is still in the log
    with _oom(server):
        with pytest.raises(OpenAIError) as ei:
            await stage.begin(t, "oom")
        assert _state(server, stage, t.id) == {"rpm": 1, "tpm": 0, "debits": [], "sum": None, "leases": 0}
    assert (ei.value.status, ei.value.headers, ei.value.body()) == (503, {"Retry-After": "1"}, _UNAVAILABLE)
    await asyncio.sleep(PROBE_INTERVAL_SECONDS + 0.1)  # the background round undoes the "oom" begin
    first = await stage.begin(t, "a")
    second = await stage.begin(t, "b")
    assert second.headers == {"x-ratelimit-limit-requests": "2", "x-ratelimit-remaining-requests": "0"}
    with pytest.raises(OpenAIError) as refused:
        await stage.begin(t, "c")
    assert (refused.value.status, refused.value.message) == (
        429,
        f"Rate limit reached for tenant '{t.id}' on requests per 1s window (RPM): "
        "Limit 2, Used 2, Requested 1. Please try again in 1s.",
    )
    await stage.settle(first, 0)
    await stage.settle(second, 0)
    assert _state(server, stage, t.id) == {"rpm": 2, "tpm": 0, "debits": [], "sum": None, "leases": 0}
    await stage.aclose()


@pytest.mark.parametrize("step", ["begin_reserve", "reserve_tokens", "reserve"])
async def test_a_reservation_with_an_expired_debit_to_trim_under_noeviction_is_a_503(
    server: SpareRedis, step: str
) -> None:
    """``tokens.lua`` and ``reserve.lua`` trimmed the expired debits before adding: with one to
    trim the script had written before its first adding command, so Redis ran it whole under
    ``noeviction`` at ``maxmemory`` (refused only with nothing to trim). Each step must get the
    503 with nothing written, the begin undone, and the limits hold once memory is freed."""
    stage = _stage(server, window_seconds=1)
    t = _tenant(rpm=10, tpm=1000, max_concurrent=3)
    await stage.settle(await stage.begin_reserve(t, "old", 300), 300)
    await asyncio.sleep(1.1)  # "old"'s debit has left the window: an expired debit to trim
    begun = await stage.begin(t, "two-step") if step == "reserve_tokens" else None  # trims the RPM log only
    before = _state(server, stage, t.id)
    leases = 0 if begun is None else 1
    assert before == {"rpm": 1, "tpm": 1, "debits": [300], "sum": 300, "leases": leases}
    with _oom(server):
        with pytest.raises(OpenAIError) as ei:
            if begun is not None:
                await stage.reserve_tokens(t, begun, 100)
            elif step == "reserve":
                await stage.reserve(t, 100, "oom")
            else:
                await stage.begin_reserve(t, "oom", 100)
        assert _state(server, stage, t.id) == before
    assert (ei.value.status, ei.value.headers, ei.value.body()) == (503, {"Retry-After": "1"}, _UNAVAILABLE)
    if begun is not None:
        await stage.settle(begun, 0)
    await asyncio.sleep(PROBE_INTERVAL_SECONDS + 0.1)  # the background round undoes the "oom" call
    lease = await stage.begin_reserve(t, "after", 1000)
    assert lease.headers == {
        "x-ratelimit-limit-requests": "10",
        "x-ratelimit-remaining-requests": "9",
        "x-ratelimit-limit-tokens": "1000",
        "x-ratelimit-remaining-tokens": "0",
    }
    with pytest.raises(OpenAIError) as refused:
        await stage.begin_reserve(t, "over", 1)
    assert (refused.value.status, refused.value.message) == (
        429,
        f"Rate limit reached for tenant '{t.id}' on tokens per 1s window (TPM): "
        "Limit 1000, Used 1000, Requested 1. Please try again in 1s.",
    )
    await stage.settle(lease, 1000)
    assert _state(server, stage, t.id) == {"rpm": 2, "tpm": 1, "debits": [1000], "sum": 1000, "leases": 0}
    await stage.aclose()


@pytest.mark.parametrize("step", ["reserve_tokens", "reserve"])
async def test_a_tpm_refusal_that_rebuilds_the_sum_under_noeviction_is_still_a_429(
    server: SpareRedis, step: str
) -> None:
    """A TPM refusal writes nothing but its trims and, when the sum was lost alone, the rebuilt
    sum. That ``SET`` was then the script's first write, which Redis refuses under ``noeviction``
    at ``maxmemory``: the 429 became a 503 (and under ``local_fallback`` a local admission of a
    request Redis refuses). The refusal must stand, the sum left to the next admission."""
    stage = _stage(server)
    t = _tenant(rpm=10, tpm=100, max_concurrent=3)
    held = await stage.begin_reserve(t, "held", 90)
    begun = await stage.begin(t, "two-step") if step == "reserve_tokens" else None
    _evict(server, stage, t.id, 3)  # the TPM sum lost alone: the next script rebuilds it
    before = _state(server, stage, t.id)
    with _oom(server):
        with pytest.raises(OpenAIError) as ei:
            if begun is not None:
                await stage.reserve_tokens(t, begun, 50)
            else:
                await stage.reserve(t, 50, "over")
        assert _state(server, stage, t.id) == before
    assert (ei.value.status, ei.value.message) == (
        429,
        f"Rate limit reached for tenant '{t.id}' on tokens per 60s window (TPM): "
        "Limit 100, Used 90, Requested 50. Please try again in 60s.",
    )
    if begun is not None:
        await stage.settle(begun, 0)
    lease = await stage.begin_reserve(t, "fits", 10)  # the sum rebuilt by this admission
    assert lease.headers["x-ratelimit-remaining-tokens"] == "0"
    await stage.settle(lease, 10)
    await stage.settle(held, 90)
    assert _state(server, stage, t.id)["sum"] == 100
    await stage.aclose()


async def test_a_settle_cancelled_while_redis_is_paused_is_sent_again(server: SpareRedis) -> None:
    """The client leaves while its request's settle is out and Redis is paused (SIGSTOP): the
    settle goes on without its caller and times out. It was dropped there, so the lease stayed
    held until its TTL (a concurrency slot lost for 2 minutes) instead of being sent again once
    Redis answers, as a failed settle is."""
    stage = _stage(server)
    t = _tenant(max_concurrent=1)
    lease = await stage.begin(t, "a")
    server.pause()
    try:
        task = asyncio.ensure_future(stage.settle(lease, 0))
        await asyncio.sleep(0.1)  # the settle's round trip is out
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(stage.deadline_seconds + 0.1)  # its round trip has timed out
    finally:
        server.resume()
    await asyncio.sleep(PROBE_INTERVAL_SECONDS + 0.3)
    assert _state(server, stage, t.id)["leases"] == 0
    await stage.settle(await stage.begin(t, "b"), 0)
    await stage.aclose()


async def test_failover_behind_one_address_reconnects_past_readonly(tmp_path: Path) -> None:
    """A managed Redis fails over behind one DNS name: the old primary becomes a replica of the
    new and answers every write ``READONLY`` on the connections the store kept; new connections
    reach the new primary. The store took READONLY as a reply: every request got a 503 until
    the gateway restarted. It must reconnect once, inside the deadline, and count there."""
    from quota_fixtures import StaleProxy

    old, new = SpareRedis(tmp_path / "old"), SpareRedis(tmp_path / "new")
    (tmp_path / "old").mkdir()
    (tmp_path / "new").mkdir()
    old.start()
    new.start()
    proxy = StaleProxy(old.port)  # the DNS name: new connections go where it points
    try:
        store = RedisQuotaStore(redis_client_from_url(proxy.url, 0.25), prefix=f"rf-{uuid.uuid4().hex[:6]}")
        stage = TenantQuotas(QuotaSettings(), store)
        t = _tenant(rpm=5)
        await stage.settle(await stage.reserve(t, 1, "before"), 1)
        with redis.Redis(port=old.port) as r:
            r.replicaof("127.0.0.1", new.port)  # demoted: writes answer READONLY
        proxy.target = new.port
        for i in range(4):
            await stage.settle(await stage.reserve(t, 1, f"after-{i}"), 1)  # a 503 raises
        await stage.reserve(t, 1, "last")  # the new primary counted the four: one left
        with pytest.raises(OpenAIError) as refused:
            await stage.reserve(t, 1, "refused")
        assert refused.value.status == 429 and "Limit 5, Used 5, Requested 1" in refused.value.message
        with redis.Redis(port=new.port) as r:
            assert r.zcard(store.keys(t.id)[0]) == 5
        await stage.aclose()
    finally:
        proxy.close()
        old.close()
        new.close()


async def test_a_redis_6_script_readonly_error_also_reconnects(server: SpareRedis, monkeypatch) -> None:
    """Redis 6 wraps a script's refused write: ``ERR Error running script ... -READONLY ...``, a
    plain ``ResponseError`` to redis-py, not a ``ReadOnlyError``; it is a failover all the same.
    The first reply is made such an error (the call itself ran): the store reconnects, sends the
    call again, and the reservation, which knows its own lease id, counts once."""
    from redis.asyncio.connection import AbstractConnection
    from redis.exceptions import ResponseError

    stage = _stage(server)
    t = _tenant(rpm=5)
    await stage.settle(await stage.reserve(t, 1, "warm"), 1)
    real = AbstractConnection.read_response
    wrapped: list[int] = []

    async def once_readonly(self, *a, **kw):
        reply = await real(self, *a, **kw)
        if not wrapped:
            wrapped.append(1)
            raise ResponseError(
                "Error running script (call to f_0): @user_script:12: @user_script: 12: "
                "-READONLY You can't write against a read only replica."
            )
        return reply

    monkeypatch.setattr(AbstractConnection, "read_response", once_readonly)
    await stage.settle(await stage.reserve(t, 1, "after"), 1)  # a 503 raises
    assert wrapped == [1]
    assert _state(server, stage, t.id)["rpm"] == 2
    await stage.aclose()


async def test_the_quota_store_state_reaches_the_gateways_gauge(server: SpareRedis) -> None:
    """The compose stack's Redis refused every gateway for a whole round and nothing showed it
    but a log line. ``kvgate_quota_store_up`` is 0 from a failed start or call until a call
    succeeds again, each change told once."""
    from gateway.app import create_app
    from tests.gateway_harness import SECRETS, closed_port_url, settings_for, tenants, upstream

    dead_url = closed_port_url().replace("http://", "redis://") + "/0"
    dead = RedisQuotaStore(redis_client_from_url(dead_url, 0.25), prefix="rf-dead")
    stage = TenantQuotas(QuotaSettings(), dead)
    app = create_app(
        settings_for([upstream("u1", api_url=closed_port_url() + "/v1", pool_urls=[closed_port_url() + "/x"])]),
        tenants(),
        quotas=stage,
        secrets=SECRETS,
    )
    gauge = app.state.gateway.metrics.registry

    def up() -> float | None:
        return gauge.get_sample_value("kvgate_quota_store_up")

    assert up() == 1.0
    await stage.start()  # nothing answers: as a failed call
    assert up() == 0.0
    await stage.aclose()

    changes: list[bool] = []
    stage = _stage(server)
    stage.watch_store(changes.append)
    await stage.start()
    t = _tenant(rpm=5)
    await stage.settle(await stage.reserve(t, 1, "a"), 1)
    server.kill()
    with pytest.raises(OpenAIError) as e:
        await stage.reserve(t, 1, "b")
    assert e.value.status == 503 and changes == [False]
    server.start()
    await asyncio.sleep(PROBE_INTERVAL_SECONDS + 0.1)
    await stage.settle(await stage.reserve(t, 1, "c"), 1)
    assert changes == [False, True]
    await stage.aclose()


async def test_settles_left_over_from_an_outage_go_together(server: SpareRedis) -> None:
    """The settles the store could not take during an outage were sent again one round trip
    each, in the path of the request whose call found Redis back (up to 10,000 of them: seconds,
    and a deque.remove each). They go together, riding the store's round trips, and every lease
    is released."""
    import time

    stage = _stage(server)
    assert isinstance(stage.store, RedisQuotaStore)
    t = _tenant(max_concurrent=1000)
    leases = [await stage.begin(t, f"l{i}") for i in range(300)]
    server.pause()
    try:
        for lease in leases:  # the first fails at the deadline; the rest wait for the back-off
            await stage.settle(lease, 0)
    finally:
        server.resume()
    trips = stage.store.round_trips
    deadline = time.monotonic() + 10
    while (stage._unsettled or _state(server, stage, t.id)["leases"]) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert (len(stage._unsettled), _state(server, stage, t.id)["leases"]) == (0, 0)
    # 300 before; a slice holds at least BACKLOG_SLICE_MIN (4 on an idle machine: 20, 40, 80, 160)
    assert stage.store.round_trips - trips <= 300 // BACKLOG_SLICE_MIN + 4
    await stage.aclose()
