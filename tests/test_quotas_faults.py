"""Redis faults at the quota stage: a stopped server (connection refused), a paused one (SIGSTOP:
the kernel accepts, nobody answers) and a black hole (accepts, never answers). Every request gets
the configured policy, decided within 1 s, never an unlimited pass-through; limits hold again by
themselves once Redis is back. Also: no Redis URL, quotas disabled."""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid

import pytest
from quota_fixtures import black_hole, recovered, spare_redis  # noqa: F401 (fixtures)

from config.errors import OpenAIError
from config.models import QuotaSettings, Settings, TenantConfig
from gateway.quotas.stage import NullQuotas
from gateway.quotas.stores import RedisQuotaStore
from gateway.quotas.tenant_quotas import PROBE_INTERVAL_SECONDS, TenantQuotas, build_quota_stage, redis_client_from_url

pytestmark = pytest.mark.timeout(60)


def _tenant(**kw) -> TenantConfig:
    return TenantConfig(id=f"t-{uuid.uuid4().hex[:8]}", **kw)


def _stage(url: str, **kw) -> TenantQuotas:
    settings = Settings(redis_url=url, quotas=QuotaSettings(window_seconds=60, **kw))
    stage = build_quota_stage(settings, key_prefix=f"kvgate-test-f-{uuid.uuid4().hex[:8]}")
    assert isinstance(stage, TenantQuotas)
    return stage


async def _timed(coro) -> tuple[float, object]:
    t0 = time.monotonic()
    try:
        out: object = await coro
    except OpenAIError as e:
        out = e
    return time.monotonic() - t0, out


def _assert_fail_closed(out: object) -> None:
    assert isinstance(out, OpenAIError), f"admitted while the quota store was down: {out!r}"
    assert (out.status, out.code, out.headers) == (503, "quota_backend_unavailable", {"Retry-After": "1"})
    assert out.body()["error"]["type"] == "server_error"
    assert out.message == (
        "The quota store is unavailable, so the request cannot be admitted. Please try again shortly."
    )


async def _assert_limits_hold(stage: TenantQuotas, rpm: int) -> None:
    """A fresh tenant with ``rpm``: exactly ``rpm`` admitted, then 429 (Redis enforces again)."""
    t = _tenant(rpm=rpm)
    for i in range(rpm):
        lease = await stage.reserve(t, 1, f"r{i}")
        assert lease.headers["x-ratelimit-limit-requests"] == str(rpm)
        await stage.settle(lease, 1)
    with pytest.raises(OpenAIError) as ei:
        await stage.reserve(t, 1, "over")
    assert ei.value.status == 429


async def _wait_for_recovery(stage: TenantQuotas, budget: float = 10.0) -> None:
    """Requests may still be refused for up to the probe interval (and while the server starts)."""
    t = _tenant(rpm=1000)
    deadline = time.monotonic() + budget
    while True:
        try:
            await stage.settle(await stage.reserve(t, 1, "probe"), 1)
            return
        except OpenAIError as e:
            assert e.status == 503
            assert time.monotonic() < deadline, "limits did not resume after Redis came back"
            await asyncio.sleep(0.1)


async def test_fail_closed_when_redis_is_stopped_then_back(spare_redis) -> None:
    stage = _stage(spare_redis.url)
    await _assert_limits_hold(stage, 2)
    spare_redis.kill()
    t = _tenant(rpm=100, max_concurrent=5)
    for i in range(6):  # during the probe interval and after it: always 503, always fast
        elapsed, out = await _timed(stage.reserve(t, 1, f"down-{i}"))
        _assert_fail_closed(out)
        assert elapsed < 1.0, f"decision took {elapsed:.2f}s"
        await asyncio.sleep(PROBE_INTERVAL_SECONDS / 2)
    spare_redis.start()  # same port, empty: no persistence
    await _wait_for_recovery(stage)
    await _assert_limits_hold(stage, 3)
    await stage.aclose()


async def test_fail_closed_when_redis_is_paused_then_resumed(spare_redis, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="kvgate.quotas")
    stage = _stage(spare_redis.url)
    t = _tenant(rpm=2)
    held = await stage.reserve(t, 1, "before")
    spare_redis.pause()
    try:
        for i in range(4):
            elapsed, out = await _timed(stage.reserve(t, 1, f"paused-{i}"))
            _assert_fail_closed(out)
            assert elapsed < 1.0, f"decision took {elapsed:.2f}s"
            await asyncio.sleep(PROBE_INTERVAL_SECONDS * 0.6)
        elapsed, _ = await _timed(stage.settle(held, 1))  # settle never raises and never hangs
        assert elapsed < 1.0
    finally:
        spare_redis.resume()
    await _wait_for_recovery(stage)
    await recovered(stage)  # the background round, once the back-off has passed
    # the paused server ran the reservations waiting in its sockets when it resumed; the gateway
    # had refused them with 503, so it undid them
    assert any(
        re.fullmatch(
            r"quota store redis: undid [1-4] reservation\(s\) it ran after their call "
            r"had timed out",
            r.getMessage(),
        )
        for r in caplog.records
    )
    # the state from before the pause survived: one of t's two requests is already used
    await stage.reserve(t, 1, "after")
    with pytest.raises(OpenAIError) as ei:
        await stage.reserve(t, 1, "over")
    assert ei.value.status == 429
    await stage.aclose()


async def test_fail_closed_against_a_server_that_never_answers(black_hole) -> None:
    stage = _stage(f"redis://127.0.0.1:{black_hole.port}/0")
    t = _tenant(rpm=10, tpm=100)
    for i in range(3):
        elapsed, out = await _timed(stage.reserve(t, 1, f"r{i}"))
        _assert_fail_closed(out)
        assert elapsed < 1.0, f"decision took {elapsed:.2f}s"
        await asyncio.sleep(PROBE_INTERVAL_SECONDS + 0.05)  # past the probe interval: Redis is asked again
    assert len(black_hole.conns) >= 2  # it really was asked, more than once
    await stage.aclose()


async def test_one_bound_per_round_trip_ends_every_call_it_carried(black_hole) -> None:
    """A client with no timeouts of its own against a server that never answers: 20 calls made
    at once (the first sent alone, the others coalesced into one pipeline) all fail with the
    store's bound, together, in about one bound, not twenty; the stage, over such a store, sets
    no timer of its own per call."""
    import redis.asyncio

    from gateway.quotas.stores import QuotaLimits, QuotaStoreUnavailable

    store = RedisQuotaStore(redis.asyncio.Redis(port=black_hole.port))
    store.bound_round_trips(0.3)
    lim = QuotaLimits(10, None, None)
    t0 = time.monotonic()
    got = await asyncio.gather(
        *(store.begin("t", lim, f"l{i}", 60_000, 30_000) for i in range(20)), return_exceptions=True
    )
    elapsed = time.monotonic() - t0
    assert [str(e) for e in got] == ["no answer within 0.3s"] * 20
    assert all(isinstance(e, QuotaStoreUnavailable) for e in got)
    assert 0.3 <= elapsed < 1.0, elapsed
    assert (store.calls, store.round_trips) == (20, 2)
    await store.aclose()
    stage = _stage(f"redis://127.0.0.1:{black_hole.port}/0")
    assert stage._store_bounded and stage.store.round_trip_seconds == stage.deadline_seconds
    await stage.aclose()


async def test_local_fallback_keeps_per_replica_limits_then_returns_to_redis(spare_redis) -> None:
    stage = _stage(spare_redis.url, redis_failure_policy="local_fallback", replicas=2)
    t = _tenant(rpm=5, tpm=1000, max_concurrent=4)
    spare_redis.kill()
    admitted = []
    for i in range(2):  # 5 // 2 = 2 requests per replica
        elapsed, lease = await _timed(stage.reserve(t, 100, f"r{i}"))
        assert elapsed < 1.0
        assert not isinstance(lease, OpenAIError), lease
        admitted.append(lease)
    assert admitted[1].headers == {
        "x-ratelimit-limit-requests": "2",
        "x-ratelimit-remaining-requests": "0",
        "x-ratelimit-limit-tokens": "500",
        "x-ratelimit-remaining-tokens": "300",
    }
    elapsed, out = await _timed(stage.reserve(t, 100, "r3"))
    assert elapsed < 1.0
    assert isinstance(out, OpenAIError) and out.status == 429 and "Limit 2, Used 2" in out.message
    for lease in admitted:
        await stage.settle(lease, 50)
    spare_redis.start()
    await asyncio.sleep(PROBE_INTERVAL_SECONDS + 0.05)
    lease = await stage.reserve(t, 100, "back")  # Redis again: the configured limits, not halves
    assert lease.headers["x-ratelimit-limit-requests"] == "5"
    assert lease.headers["x-ratelimit-remaining-requests"] == "4"
    await stage.settle(lease, 100)
    await stage.aclose()


async def test_no_redis_url_keeps_limits_in_process_with_a_warning(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="kvgate.quotas"):
        stage = build_quota_stage(Settings(redis_url=None))
    assert [r.getMessage() for r in caplog.records] == [
        "quotas: no redis_url is configured, so limits are kept in this process: each gateway process "
        "admits a tenant's full limits on its own"
    ]
    assert isinstance(stage, TenantQuotas)
    await _assert_limits_hold(stage, 3)
    t = _tenant(max_concurrent=1)
    lease = await stage.reserve(t, 1, "a")
    with pytest.raises(OpenAIError) as ei:
        await stage.reserve(t, 1, "b")
    assert (ei.value.status, ei.value.headers) == (429, {"Retry-After": "1"})
    await stage.settle(lease, 1)
    await stage.settle(await stage.reserve(t, 1, "c"), 1)
    await stage.aclose()


def test_quotas_disabled_is_the_null_stage() -> None:
    stage = build_quota_stage(Settings(redis_url="redis://127.0.0.1:6379/0", quotas=QuotaSettings(enabled=False)))
    assert isinstance(stage, NullQuotas)


async def test_redis_url_with_timeouts_and_no_retries() -> None:
    client = redis_client_from_url("redis://127.0.0.1:6379/3", 0.25)
    kw = client.connection_pool.connection_kwargs
    assert (kw["socket_timeout"], kw["socket_connect_timeout"], kw["db"]) == (0.25, 0.25, 3)
    assert client.get_retry()._retries == 0
    await client.aclose()
    assert RedisQuotaStore(client).keys("a") == [
        "kvgate:q:{a}:rpm",
        "kvgate:q:{a}:tpm",
        "kvgate:q:{a}:tpm:debits",
        "kvgate:q:{a}:tpm:sum",
        "kvgate:q:{a}:leases",
    ]


async def test_redis_restart_behind_stale_connections_costs_no_503(spare_redis) -> None:
    """Redis restarts and the pooled connections do not know (a proxy keeps their client side
    open): the first command on each gets a reset. Once Redis answers again, no request gets a
    503: the store drops the stale connections and reconnects once, inside the deadline."""
    from quota_fixtures import StaleProxy

    proxy = StaleProxy(spare_redis.port)
    try:
        stage = _stage(proxy.url)
        t = _tenant(rpm=1000, max_concurrent=50)
        leases = await asyncio.gather(*(stage.reserve(t, 1, f"warm-{i}") for i in range(4)))
        for lease in leases:
            await stage.settle(lease, 1)
        # 4 pooled connections (the store sends one turn's calls on one: the client's own calls open them)
        await asyncio.gather(*(stage.store.client.ping() for _ in range(4)))
        pooled = len(stage.store.client.connection_pool._available_connections)
        assert pooled >= 2
        spare_redis.kill()
        spare_redis.start()  # same port, answers PING again before the next request
        for i in range(6):
            elapsed, out = await _timed(stage.reserve(t, 1, f"after-{i}"))
            assert not isinstance(out, OpenAIError), f"request {i} after the restart: {out!r}"
            assert elapsed < 1.0
            await stage.settle(out, 1)
        assert proxy.resets == 1  # one stale connection was tried, the others were dropped unused
        await _assert_limits_hold(stage, 3)
        await stage.aclose()
    finally:
        proxy.close()
