"""The quota scripts against the real Redis on 127.0.0.1:6379 (each test has its own key prefix),
and the in-process store against the same expectations: all-or-none reservation, settle,
lease TTL, Retry-After values, key layout."""

from __future__ import annotations

import asyncio
import gc
import uuid

import pytest
import redis.asyncio as aioredis
from quota_fixtures import spare_redis  # noqa: F401 (fixture)

from config.errors import OpenAIError
from config.models import QuotaSettings, TenantConfig
from gateway.quotas import stores as stores_module
from gateway.quotas.stores import BUSY_SECONDS, LocalQuotaStore, QuotaLimits, RedisQuotaStore
from gateway.quotas.tenant_quotas import TenantQuotas, redis_client_from_url
from tests.fixtures.redis_keys import REDIS_URL

WINDOW_MS = 60_000
TTL_MS = 120_000


async def test_tpm_refusal_spends_no_rpm_slot_and_no_lease(quota_store) -> None:
    lim = QuotaLimits(rpm=3, tpm=1000, max_concurrent=5)
    d = await quota_store.reserve("t", lim, "a", 900, WINDOW_MS, TTL_MS)
    assert (d.admitted, d.refused, d.remaining_requests, d.remaining_tokens) == (True, (), 2, 100)
    d = await quota_store.reserve("t", lim, "b", 200, WINDOW_MS, TTL_MS)
    assert (d.admitted, d.refused, d.remaining_requests, d.remaining_tokens) == (False, ("tpm",), 2, 100)
    # the refusal took nothing: two more requests fit the RPM, and the TPM still has 100
    d = await quota_store.reserve("t", lim, "c", 100, WINDOW_MS, TTL_MS)
    assert (d.admitted, d.remaining_requests, d.remaining_tokens) == (True, 1, 0)
    d = await quota_store.reserve("t", lim, "d", 0, WINDOW_MS, TTL_MS)
    assert (d.admitted, d.remaining_requests, d.remaining_tokens) == (True, 0, 0)
    d = await quota_store.reserve("t", lim, "e", 0, WINDOW_MS, TTL_MS)
    assert (d.admitted, d.refused) == (False, ("rpm",))


async def test_concurrency_refusal_spends_nothing_and_settle_frees_the_lease(quota_store) -> None:
    lim = QuotaLimits(rpm=10, tpm=None, max_concurrent=2)
    assert (await quota_store.reserve("t", lim, "a", 5, WINDOW_MS, TTL_MS)).admitted
    assert (await quota_store.reserve("t", lim, "b", 5, WINDOW_MS, TTL_MS)).admitted
    d = await quota_store.reserve("t", lim, "c", 5, WINDOW_MS, TTL_MS)
    assert (d.admitted, d.refused, d.retry_after_ms, d.remaining_requests, d.remaining_tokens) == (
        False,
        ("concurrency",),
        1000,
        8,
        -1,
    )
    await quota_store.settle("t", lim, "a", 5, 5, WINDOW_MS)
    d = await quota_store.reserve("t", lim, "c", 5, WINDOW_MS, TTL_MS)
    assert (d.admitted, d.remaining_requests) == (True, 7)


async def test_all_refused_dimensions_are_named(quota_store) -> None:
    lim = QuotaLimits(rpm=1, tpm=100, max_concurrent=1)
    assert (await quota_store.reserve("t", lim, "a", 100, WINDOW_MS, TTL_MS)).admitted
    d = await quota_store.reserve("t", lim, "b", 1, WINDOW_MS, TTL_MS)
    assert (d.admitted, d.refused, d.too_large) == (False, ("rpm", "tpm", "concurrency"), False)


async def test_settle_corrects_tpm_to_real_usage(quota_store) -> None:
    lim = QuotaLimits(rpm=None, tpm=1000, max_concurrent=None)
    assert (await quota_store.reserve("t", lim, "a", 700, WINDOW_MS, TTL_MS)).remaining_tokens == 300
    await quota_store.settle("t", lim, "a", 250, 700, WINDOW_MS)  # refund 450
    d = await quota_store.reserve("t", lim, "b", 750, WINDOW_MS, TTL_MS)
    assert (d.admitted, d.remaining_tokens, d.remaining_requests) == (True, 0, -1)
    await quota_store.settle("t", lim, "b", 760, 750, WINDOW_MS)  # usage above the reservation is debited too
    d = await quota_store.reserve("t", lim, "c", 1, WINDOW_MS, TTL_MS)
    assert (d.admitted, d.remaining_tokens) == (False, 0)


async def test_settle_after_the_debit_left_the_window_charges_only_the_excess(quota_store) -> None:
    lim = QuotaLimits(rpm=None, tpm=100, max_concurrent=None)
    assert (await quota_store.reserve("t", lim, "a", 60, 200, TTL_MS)).admitted
    await asyncio.sleep(0.25)  # the 200 ms window has moved past the debit
    await quota_store.settle("t", lim, "a", 70, 60, 200)  # 10 tokens over the reservation
    d = await quota_store.reserve("t", lim, "b", 90, 200, TTL_MS)
    assert (d.admitted, d.remaining_tokens) == (True, 0)
    d = await quota_store.reserve("t", lim, "c", 1, 200, TTL_MS)
    assert d.admitted is False


async def test_request_larger_than_tpm_and_rpm_zero_are_refused_for_a_whole_window(quota_store) -> None:
    d = await quota_store.reserve("t", QuotaLimits(None, 100, None), "a", 101, WINDOW_MS, TTL_MS)
    assert (d.admitted, d.refused, d.too_large, d.retry_after_ms, d.remaining_tokens) == (
        False,
        ("tpm",),
        True,
        WINDOW_MS,
        100,
    )
    d = await quota_store.reserve("t", QuotaLimits(0, None, None), "b", 1, WINDOW_MS, TTL_MS)
    assert (d.admitted, d.refused, d.retry_after_ms, d.remaining_requests) == (False, ("rpm",), WINDOW_MS, 0)


async def test_lease_expires_after_its_ttl_without_settle(quota_store) -> None:
    lim = QuotaLimits(rpm=None, tpm=None, max_concurrent=1)
    assert (await quota_store.reserve("t", lim, "dead-replica", 1, WINDOW_MS, 600)).admitted
    assert (await quota_store.reserve("t", lim, "b", 1, WINDOW_MS, 600)).refused == ("concurrency",)
    await asyncio.sleep(0.65)
    assert (await quota_store.reserve("t", lim, "b", 1, WINDOW_MS, 600)).admitted
    # renewing a live lease keeps it; renewing an expired one does not bring it back
    assert await quota_store.renew("t", ["b", "dead-replica"], 600) == 1
    await asyncio.sleep(0.4)
    assert await quota_store.renew("t", ["b"], 600) == 1
    await asyncio.sleep(0.4)  # 800 ms after b was admitted, but renewed 400 ms ago
    assert (await quota_store.reserve("t", lim, "c", 1, WINDOW_MS, 600)).refused == ("concurrency",)


async def test_cancel_undoes_a_reservation_and_skips_unknown_ones(redis_store) -> None:
    store = redis_store
    lim = QuotaLimits(rpm=2, tpm=100, max_concurrent=1)
    assert (await store.reserve("t", lim, "a", 60, WINDOW_MS, TTL_MS)).admitted
    assert (await store.reserve("t", lim, "b", 60, WINDOW_MS, TTL_MS)).refused == ("tpm", "concurrency")
    assert await store.cancel("t", ["a", "never-reserved"]) == 1
    d = await store.reserve("t", lim, "b", 100, WINDOW_MS, TTL_MS)
    assert (d.admitted, d.remaining_requests, d.remaining_tokens) == (True, 1, 0)
    assert int(await store.client.get(store.keys("t")[3])) == 100


async def test_retry_after_is_when_the_window_admits_the_request(redis_store) -> None:
    store, client = redis_store, redis_store.client

    async def server_ms() -> float:
        s, us = await client.time()
        return s * 1000 + us // 1000

    lim = QuotaLimits(rpm=2, tpm=1000, max_concurrent=None)
    assert (await store.reserve("t", lim, "a", 400, WINDOW_MS, TTL_MS)).admitted
    await asyncio.sleep(0.3)
    assert (await store.reserve("t", lim, "b", 400, WINDOW_MS, TTL_MS)).admitted
    (_, t_a), (_, t_b) = await client.zrange(store.keys("t")[0], 0, -1, withscores=True)
    assert t_b - t_a >= 300
    # RPM: a third request waits until a's admission leaves the window
    before = await server_ms()
    d = await store.reserve("t", lim, "c", 1, WINDOW_MS, TTL_MS)
    after = await server_ms()
    assert d.refused == ("rpm",)
    assert t_a + WINDOW_MS - after <= d.retry_after_ms <= t_a + WINDOW_MS - before
    # TPM: 800 used, 500 asked, 1000 allowed -> 300 must leave; a's 400 is enough, so a's time counts
    lim2 = QuotaLimits(rpm=None, tpm=1000, max_concurrent=None)
    before = await server_ms()
    d = await store.reserve("t", lim2, "c", 500, WINDOW_MS, TTL_MS)
    after = await server_ms()
    assert (d.refused, d.remaining_tokens) == (("tpm",), 200)
    assert t_a + WINDOW_MS - after <= d.retry_after_ms <= t_a + WINDOW_MS - before
    # 700 must leave: a's 400 is not enough, b's admission is the one that makes room
    before = await server_ms()
    d = await store.reserve("t", lim2, "c", 900, WINDOW_MS, TTL_MS)
    after = await server_ms()
    assert t_b + WINDOW_MS - after <= d.retry_after_ms <= t_b + WINDOW_MS - before


async def test_keys_carry_the_tenant_hash_tag_and_expire(redis_store) -> None:
    store, client = redis_store, redis_store.client
    lim = QuotaLimits(rpm=5, tpm=50, max_concurrent=2)
    assert (await store.reserve("acme.prod", lim, "a", 10, WINDOW_MS, TTL_MS)).admitted
    keys = sorted(k.decode() for k in await client.keys(f"{store.prefix}:*"))
    base = f"{store.prefix}:{{acme.prod}}"
    assert keys == sorted([f"{base}:rpm", f"{base}:tpm", f"{base}:tpm:debits", f"{base}:tpm:sum", f"{base}:leases"])
    for k in keys:
        limit = TTL_MS if k.endswith(":leases") else WINDOW_MS
        assert limit < await client.pttl(k) <= limit + 1000
    assert int(await client.get(f"{base}:tpm:sum")) == 10


async def test_reservations_are_atomic_across_clients(redis_store) -> None:
    """50 reservations from 5 separate connections at once: exactly the RPM is admitted."""
    clients = [aioredis.Redis.from_url(REDIS_URL) for _ in range(5)]
    stores = [RedisQuotaStore(c, prefix=redis_store.prefix) for c in clients]
    try:
        lim = QuotaLimits(rpm=7, tpm=None, max_concurrent=None)
        ds = await asyncio.gather(*(stores[i % 5].reserve("t", lim, f"r{i}", 1, WINDOW_MS, TTL_MS) for i in range(50)))
        assert sum(d.admitted for d in ds) == 7
        assert sorted(d.remaining_requests for d in ds if d.admitted) == [0, 1, 2, 3, 4, 5, 6]
    finally:
        for s in stores:
            await s.aclose()


# ---------------------------------------------------------------- the stage over Redis
def _tenant(**kw) -> TenantConfig:
    return TenantConfig(id=f"t-{uuid.uuid4().hex[:8]}", **kw)


async def test_stage_headers_429_body_and_settle_once(redis_store) -> None:
    q = TenantQuotas(QuotaSettings(window_seconds=60), redis_store)
    t = _tenant(rpm=2, tpm=1000, max_concurrent=3)
    lease = await q.reserve(t, 300, "req-1")
    assert (lease.tenant_id, lease.request_id, lease.reserved_tokens) == (t.id, "req-1", 300)
    assert lease.headers == {
        "x-ratelimit-limit-requests": "2",
        "x-ratelimit-remaining-requests": "1",
        "x-ratelimit-limit-tokens": "1000",
        "x-ratelimit-remaining-tokens": "700",
    }
    await q.settle(lease, 120)
    await q.settle(lease, 999)  # a second settle does nothing
    lease2 = await q.reserve(t, 880, "req-2")
    assert lease2.headers["x-ratelimit-remaining-tokens"] == "0"
    with pytest.raises(OpenAIError) as ei:
        await q.reserve(t, 1, "req-3")
    e = ei.value
    assert (e.status, e.code, e.type, e.param) == (429, "rate_limit_exceeded", None, None)
    assert e.body()["error"]["type"] == "rate_limit_error"
    assert e.headers is not None and 58 <= int(e.headers["Retry-After"]) <= 60
    retry = e.headers["Retry-After"]
    assert e.headers == {
        "Retry-After": retry,
        "x-ratelimit-limit-requests": "2",
        "x-ratelimit-remaining-requests": "0",
        "x-ratelimit-limit-tokens": "1000",
        "x-ratelimit-remaining-tokens": "0",
    }
    assert e.message == (
        f"Rate limit reached for tenant '{t.id}' on requests per 60s window (RPM): Limit 2, "
        f"Used 2, Requested 1; tokens per 60s window (TPM): Limit 1000, Used 1000, "
        f"Requested 1. Please try again in {retry}s."
    )
    await q.settle(lease2, 880)
    await q.aclose()


async def test_stage_too_large_message_and_unlimited_tenant_skips_the_store(redis_store) -> None:
    q = TenantQuotas(QuotaSettings(window_seconds=30), redis_store)
    t = _tenant(tpm=100)
    with pytest.raises(OpenAIError) as ei:
        await q.reserve(t, 101, "r")
    assert ei.value.message == (
        f"Request too large for tenant '{t.id}' on tokens per 30s window (TPM): "
        "Limit 100, Requested 101 (prompt + max_tokens). Reduce the prompt or max_tokens."
    )
    assert ei.value.headers == {  # no wait makes it fit: the openai SDKs' retry is told off
        "x-should-retry": "false",
        "x-ratelimit-limit-tokens": "100",
        "x-ratelimit-remaining-tokens": "100",
    }
    free = _tenant()
    lease = await q.reserve(free, 10**9, "r")
    assert (lease.headers, lease.state) == ({}, None)
    assert await redis_store.client.keys(f"{redis_store.prefix}:{{{free.id}}}*") == []
    await q.aclose()


async def test_stage_renews_live_leases_so_long_requests_keep_their_slot(redis_store) -> None:
    q = TenantQuotas(QuotaSettings(window_seconds=60, lease_ttl_seconds=0.6), redis_store)
    t = _tenant(max_concurrent=1)
    lease = await q.reserve(t, 1, "long")
    await asyncio.sleep(1.3)  # > 2 TTLs: the background renewal (every 0.2 s) kept the lease
    with pytest.raises(OpenAIError) as ei:
        await q.reserve(t, 1, "second")
    assert ei.value.headers == {"Retry-After": "1"}
    await q.settle(lease, 1)
    await q.settle(await q.reserve(t, 1, "third"), 1)
    await q.aclose()


async def test_sentinel_url_finds_the_master(tmp_path, spare_redis) -> None:
    """A real redis-server in sentinel mode monitoring the spare server: ``redis+sentinel://``."""
    sentinel = spare_redis.start_sentinel(tmp_path, "kvgmaster")
    url = f"redis+sentinel://127.0.0.1:{sentinel},127.0.0.1:1/kvgmaster/0"  # a dead sentinel is skipped
    q = TenantQuotas(QuotaSettings(), RedisQuotaStore(redis_client_from_url(url, 0.25), prefix="kvgate-test-s"))
    t = _tenant(rpm=1)
    lease = await q.reserve(t, 1, "r")
    assert lease.headers["x-ratelimit-remaining-requests"] == "0"
    with pytest.raises(OpenAIError):
        await q.reserve(t, 1, "r2")
    spare = aioredis.Redis(port=spare_redis.port)
    assert await spare.zcard(f"kvgate-test-s:{{{t.id}}}:rpm") == 1
    await spare.aclose()
    await q.aclose()


def test_sentinel_url_errors() -> None:
    with pytest.raises(ValueError, match="needs hosts and a service name"):
        redis_client_from_url("redis+sentinel://127.0.0.1:26379", 0.25)
    with pytest.raises(ValueError, match="bad port"):
        redis_client_from_url("redis+sentinel://127.0.0.1:x/m", 0.25)


def test_local_store_trims_by_its_clock() -> None:
    now = [0.0]
    s = LocalQuotaStore(clock=lambda: now[0])
    lim = QuotaLimits(rpm=1, tpm=None, max_concurrent=None)
    assert s.reserve_now("t", lim, "a", 1, 1000, TTL_MS).admitted
    now[0] = 400.0
    d = s.reserve_now("t", lim, "b", 1, 1000, TTL_MS)
    assert (d.admitted, d.retry_after_ms) == (False, 600)
    now[0] = 1000.0  # exactly one window after a: a no longer counts
    assert s.reserve_now("t", lim, "b", 1, 1000, TTL_MS).admitted


async def test_calls_in_one_turn_share_one_round_trip_each_with_its_own_reply(redis_store) -> None:
    """The calls requests make in one turn of the event loop while a round trip is under way go
    to Redis as one pipeline (the RPM decisions add up as one by one); a call
    with nothing under way goes at once; a call whose script the server does not know
    (``NOSCRIPT``) is loaded and sent again; a failing call fails alone."""
    store = redis_store
    lim = QuotaLimits(rpm=3, tpm=None, max_concurrent=None)
    trips = store.round_trips
    out = await asyncio.gather(*(store.begin("t", lim, f"l{i}", WINDOW_MS, TTL_MS) for i in range(5)))
    # exactly the limit admitted (which three of five concurrent calls: whichever Redis ran first)
    assert sorted(d.remaining_requests for d in out if d.admitted) == [0, 1, 2]
    assert sum(not d.admitted for d in out) == 2
    assert store.round_trips == trips + 2  # the first at once, the other four together
    unknown = store.client.register_script(f"return '{uuid.uuid4().hex}'")  # never loaded: NOSCRIPT first
    broken = store.client.register_script("return redis.call('NO_SUCH_COMMAND')")
    replies = await asyncio.gather(
        store.begin("u", lim, "m", WINDOW_MS, TTL_MS),
        store._call(unknown, [], []),
        store._call(broken, [], []),
        return_exceptions=True,
    )
    assert replies[0].admitted
    assert isinstance(replies[1], (str, bytes)) and len(replies[1]) == 32
    from gateway.quotas.stores import QuotaStoreUnavailable

    assert isinstance(replies[2], QuotaStoreUnavailable)


async def _leases(store: RedisQuotaStore, tenant: str) -> int:
    """The concurrency leases Redis holds for ``tenant`` now (read on a client of its own)."""
    r = aioredis.from_url(REDIS_URL)
    try:
        return int(await r.zcard(store.keys(tenant)[4]))
    finally:
        await r.aclose()


async def test_a_settle_goes_in_its_turns_round_trip_never_alone_from_its_caller(redis_store) -> None:
    """A settle (its response has gone) is not sent from its caller even when nothing else is
    under way: it waits for this turn's round trip, with the turn's other calls after it in the
    same pipeline, so a tenant at its concurrency limit whose request settles while the next one
    begins is admitted; a settle alone in its turn goes in a round trip of its own."""
    store = redis_store
    lim = QuotaLimits(rpm=None, tpm=None, max_concurrent=1)
    assert (await store.begin("t", lim, "a", WINDOW_MS, TTL_MS)).admitted
    trips, calls = store.round_trips, store.calls
    _, begun = await asyncio.gather(
        store.settle("t", lim, "a", 0, 0, WINDOW_MS), store.begin("t", lim, "b", WINDOW_MS, TTL_MS)
    )
    assert (begun.admitted, store.round_trips, store.calls) == (True, trips + 1, calls + 2)
    assert await _leases(store, "t") == 1  # b's
    await store.settle("t", lim, "b", 0, 0, WINDOW_MS)
    assert (store.round_trips, await _leases(store, "t")) == (trips + 2, 0)


async def test_while_requests_arrive_a_settle_rides_the_next_requests_round_trip(redis_store, monkeypatch) -> None:
    """One client's requests back to back: its next request's call comes turns after the settle
    of the one before (its answer had to reach the client first), so each request cost two round
    trips. While requests arrive, a settle with no request's call in its turn waits for the next
    one and goes in its pipeline, before it: one round trip, and a tenant at its concurrency
    limit of 1 is admitted for the next request. (Both windows widened: on a loaded machine the
    test's own steps took longer than 2 ms and 1 ms.)"""
    import gateway.quotas.stores as stores

    monkeypatch.setattr(stores, "BUSY_SECONDS", 5.0)
    monkeypatch.setattr(stores, "SETTLE_WAIT_SECONDS", 5.0)
    store = redis_store
    lim = QuotaLimits(rpm=None, tpm=None, max_concurrent=1)
    assert (await store.begin("t", lim, "a", WINDOW_MS, TTL_MS)).admitted  # a request's call: requests arrive
    trips, calls = store.round_trips, store.calls
    settle = asyncio.ensure_future(store.settle("t", lim, "a", 0, 0, WINDOW_MS))
    for _ in range(5):  # the turns in which the answer goes out and the next request is read
        await asyncio.sleep(0)
    assert (settle.done(), store.round_trips, store._settle_wait is not None) == (False, trips, True)
    begun = await store.begin("t", lim, "b", WINDOW_MS, TTL_MS)
    await settle
    assert (begun.admitted, store.round_trips, store.calls, store._settle_wait) == (True, trips + 1, calls + 2, None)
    assert await _leases(store, "t") == 1  # b's


async def test_a_settle_waits_for_no_request_when_none_came_lately(redis_store) -> None:
    """Requests not arriving back to back (none within ``BUSY_SECONDS``): a settle goes in its
    own turn's round trip, as before, so its slot is free at once for any replica. One that
    waited and saw no request goes alone when its wait ends."""
    store = redis_store
    lim = QuotaLimits(rpm=None, tpm=None, max_concurrent=1)
    assert (await store.begin("t", lim, "a", WINDOW_MS, TTL_MS)).admitted
    store._request_call_at -= BUSY_SECONDS  # the last request's call was a while ago
    trips = store.round_trips
    settle = asyncio.ensure_future(store.settle("t", lim, "a", 0, 0, WINDOW_MS))
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert (store._settle_wait, store.round_trips) == (None, trips + 1)  # under way in its turn
    await settle
    assert await _leases(store, "t") == 0
    assert (await store.begin("t", lim, "b", WINDOW_MS, TTL_MS)).admitted  # requests arrive again
    await store.settle("t", lim, "b", 0, 0, WINDOW_MS)  # waited for a request that never came
    assert (store.round_trips, store._settle_wait, await _leases(store, "t")) == (trips + 3, None, 0)


async def test_waiting_requests_resume_before_the_settles_of_their_round_trip(redis_store) -> None:
    store = redis_store
    lim = QuotaLimits(rpm=None, tpm=None, max_concurrent=None)
    order: list[str] = []

    async def settle() -> None:
        await store.settle("t", lim, "a", 0, 0, WINDOW_MS)
        order.append("settle")

    async def begin() -> None:
        await store.begin("t", lim, "b", WINDOW_MS, TTL_MS)
        order.append("begin")

    await asyncio.gather(settle(), begin())  # one round trip, the settle first in it
    assert order == ["begin", "settle"]


async def test_a_cancelled_caller_does_not_fail_the_settle_it_shares_a_round_trip_with(
    redis_store, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A settle waiting for the next request rides that request's round trip, sent from the
    request's own task: the request may go away (its caller cancelled) mid-way without failing
    the settle, which is sent again in a round trip of its own."""
    # requests back to back however slowly this machine runs them: the settle waits for the next
    monkeypatch.setattr(stores_module, "BUSY_SECONDS", 60.0)
    store = redis_store
    store.bound_round_trips(5.0)  # as the gateway's stage does: the write is not a task of its own
    lim = QuotaLimits(rpm=None, tpm=None, max_concurrent=2)
    assert (await store.begin("t", lim, "a", WINDOW_MS, TTL_MS)).admitted
    settling = asyncio.ensure_future(store.settle("t", lim, "a", 0, 0, WINDOW_MS))
    gone = asyncio.ensure_future(store.begin("t", lim, "b", WINDOW_MS, TTL_MS))
    trips = store.round_trips
    await asyncio.sleep(0)  # the settle waits; the begin takes it along, written, its replies unread
    assert (store.round_trips, store._queued, store._settle_wait) == (trips + 1, [], None)
    gone.cancel()
    await settling  # no QuotaStoreUnavailable
    assert (gone.cancelled(), store.round_trips) == (True, trips + 2)
    await asyncio.sleep(0.05)
    assert await _leases(store, "t") == 1  # a settled; b was begun by the round trip its caller left
    del gone
    gc.collect()  # the cancelled request's own reply, failed and never awaited: retrieved, not logged
    assert [r.getMessage() for r in caplog.records if r.name == "asyncio"] == []


async def test_closing_the_store_sends_a_waiting_settle(redis_prefix) -> None:
    store = RedisQuotaStore(redis_client_from_url(REDIS_URL, 0.5), prefix=redis_prefix)
    lim = QuotaLimits(rpm=None, tpm=None, max_concurrent=1)
    assert (await store.begin("t", lim, "a", WINDOW_MS, TTL_MS)).admitted
    settling = asyncio.ensure_future(store.settle("t", lim, "a", 0, 0, WINDOW_MS))
    await asyncio.sleep(0)
    await store.aclose()
    await settling
    assert await _leases(store, "t") == 0


async def test_a_call_made_while_a_settles_round_trip_waits_to_start_goes_after_it(redis_store) -> None:
    """Between the turn that hands a settle to its round trip's task and that task's first step,
    a call finds no round trip to join: it must still reach Redis after the settle (a client that
    sends its next request at once sees the previous one settled), never be written first."""
    store = redis_store
    lim = QuotaLimits(rpm=None, tpm=None, max_concurrent=1)
    assert (await store.begin("t", lim, "a", WINDOW_MS, TTL_MS)).admitted
    store._request_call_at -= BUSY_SECONDS  # not back to back: the settle goes in its own turn
    settling = asyncio.ensure_future(store.settle("t", lim, "a", 0, 0, WINDOW_MS))
    await asyncio.sleep(0)  # the settle queued, this turn's flush scheduled
    await asyncio.sleep(0)  # the flush ran: the settle's task exists, its first step not yet
    assert not store._queued and store._sending
    begun = await store.begin("t", lim, "b", WINDOW_MS, TTL_MS)
    await settling
    assert begun.admitted, begun.refused
