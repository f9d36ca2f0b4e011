"""Findings of a hostile review of the day's changes, each a test that failed before its fix.

- Under ``local_fallback`` (Redis down) a request is decided against the process's share of TPM,
  ``tpm // processes``. A request above that share but within the whole TPM fits as soon as Redis
  answers again, yet it was answered as one that never fits: "Request too large", no
  ``Retry-After`` and ``x-should-retry: false``, so the openai SDKs gave up on a request a
  moment's wait would admit. It is now the ordinary TPM refusal with its ``Retry-After``.
- Under ``local_fallback``, a request Redis began whose token step came while the store was
  backing off (another request's call had just failed) was decided by the fallback without a
  call, so nothing queued its Redis lease for undoing: the lease held a concurrency slot in Redis
  until its TTL (120 s by default) after the request ended. The failed-call path undoes it
  (``cancel.lua`` with keep_rpm); the backing-off path now does the same.
- ``begin_tokens`` sends two scripts in one round trip; when the round trip failed, the second
  reply's error was never read, and asyncio logged "Future exception was never retrieved" for it.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import uuid

import pytest
import redis

from config.errors import OpenAIError
from config.models import QuotaSettings, Settings, TenantConfig
from gateway.quotas.stores import LocalQuotaStore, QuotaLimits, QuotaStoreUnavailable, RedisQuotaStore
from gateway.quotas.tenant_quotas import (
    PROBE_INTERVAL_SECONDS,
    TenantQuotas,
    build_quota_stage,
    redis_client_from_url,
)
from tests.quota_fixtures import SpareRedis, free_port, spare_redis  # noqa: F401 (fixture)

pytestmark = pytest.mark.timeout(60)


def _down_stage(replicas: int) -> TenantQuotas:
    """A ``local_fallback`` stage whose Redis refuses every connection (nothing listens)."""
    settings = Settings(
        redis_url=f"redis://127.0.0.1:{free_port()}/0",
        quotas=QuotaSettings(window_seconds=60, redis_failure_policy="local_fallback", replicas=replicas),
    )
    stage = build_quota_stage(settings, key_prefix=f"kvgate-review-{uuid.uuid4().hex[:8]}")
    assert isinstance(stage, TenantQuotas) and stage.processes == replicas
    return stage


def _tenant(**kw: int) -> TenantConfig:
    return TenantConfig(id=f"review-{uuid.uuid4().hex[:8]}", **kw)


@pytest.mark.parametrize("path", ["begin_reserve", "reserve", "begin+reserve_tokens"])
async def test_a_request_above_the_fallback_share_but_within_tpm_may_be_retried(path: str) -> None:
    """TPM 1000 over 4 processes: a 300-token request is above the fallback's share (250) but
    within the TPM; the 429 says when to retry, never 'too large' nor 'do not retry'."""
    stage = _down_stage(4)
    t = _tenant(tpm=1000)
    with pytest.raises(OpenAIError) as ei:
        if path == "begin_reserve":
            await stage.begin_reserve(t, "r1", 300)
        elif path == "reserve":
            await stage.reserve(t, 300, "r1")
        else:
            lease = await stage.begin(t, "r1")
            try:
                await stage.reserve_tokens(t, lease, 300)
            finally:
                await stage.settle(lease, 0)
    e = ei.value
    assert (e.status, e.code) == (429, "rate_limit_exceeded")
    assert e.message == (
        f"Rate limit reached for tenant '{t.id}' on tokens per 60s window (TPM): "
        "Limit 250, Used 0, Requested 300. Please try again in 60s."
    )
    assert e.headers == {
        "Retry-After": "60",
        "x-ratelimit-limit-tokens": "250",
        "x-ratelimit-remaining-tokens": "250",
    }
    await stage.aclose()


async def test_a_request_above_the_whole_tpm_is_still_too_large_under_the_fallback() -> None:
    """Above the whole TPM (1200 > 1000) no wait helps, Redis or not: 'Request too large', no
    Retry-After, ``x-should-retry: false``."""
    stage = _down_stage(4)
    t = _tenant(tpm=1000)
    with pytest.raises(OpenAIError) as ei:
        await stage.begin_reserve(t, "r1", 1200)
    e = ei.value
    assert (e.status, e.code) == (429, "rate_limit_exceeded")
    assert e.message == (
        f"Request too large for tenant '{t.id}' on tokens per 60s window (TPM): Limit 1000, Requested 1200 "
        "(prompt + max_tokens). Reduce the prompt or max_tokens."
    )
    assert e.headers == {
        "x-should-retry": "false",
        "x-ratelimit-limit-tokens": "250",
        "x-ratelimit-remaining-tokens": "250",
    }
    await stage.aclose()


async def test_a_failed_begin_and_tokens_round_trip_leaves_no_unread_error(caplog) -> None:
    """``begin_tokens`` sends two scripts in one round trip; when it fails, the caller read the
    first reply's error and stopped there, so asyncio logged the second's when it was collected
    ("Future exception was never retrieved", an ERROR line per such request during an outage)."""
    store = RedisQuotaStore(redis_client_from_url(f"redis://127.0.0.1:{free_port()}/0", 0.25), prefix="review")
    caplog.set_level(logging.ERROR, logger="asyncio")
    for _ in range(3):
        with pytest.raises(QuotaStoreUnavailable):
            await store.begin_tokens("t", QuotaLimits(10, 1000, None), uuid.uuid4().hex, 100, 60_000, 120_000)
    await store.aclose()
    gc.collect()
    await asyncio.sleep(0)
    assert [r.getMessage() for r in caplog.records if r.name == "asyncio"] == []


async def test_a_token_step_decided_while_backing_off_frees_the_redis_lease(spare_redis: SpareRedis) -> None:  # noqa: F811
    """Redis began the request (its RPM entry, its lease); Redis then paused and another tenant's
    call failed, so the token step came while the store was backing off and the fallback decided
    it (no call). After the request ended and Redis answered again, its lease was still held in
    Redis: ``leases`` 1, and the tenant (max_concurrent 1) was refused "concurrent requests: Limit
    1" until the lease's TTL. Its RPM entry stays, as for a failed token step."""
    store = RedisQuotaStore(redis_client_from_url(spare_redis.url, 0.25), prefix=f"review-{uuid.uuid4().hex[:6]}")
    stage = TenantQuotas(QuotaSettings(redis_failure_policy="local_fallback"), store, fallback=LocalQuotaStore())
    await stage.settle(await stage.begin_reserve(_tenant(tpm=1000), "warm", 1), 1)  # scripts loaded
    t = _tenant(rpm=5, tpm=1000, max_concurrent=1)
    lease = await stage.begin(t, "served")
    spare_redis.pause()
    try:
        await stage.settle(await stage.begin(_tenant(rpm=5), "other"), 0)  # its call fails: back off
        await stage.reserve_tokens(t, lease, 100)  # decided by the fallback, without a call
    finally:
        spare_redis.resume()
    assert lease.state.store is stage.fallback
    await stage.settle(lease, 80)
    await asyncio.sleep(PROBE_INTERVAL_SECONDS + 0.05)
    nxt = await stage.begin(t, "next")  # Redis again; waits for the undo of this part of the store
    assert nxt.headers == {"x-ratelimit-limit-requests": "5", "x-ratelimit-remaining-requests": "3"}
    await stage.settle(nxt, 0)
    with redis.Redis(port=spare_redis.port) as r:
        rpm, _, _, _, leases = store.keys(t.id)
        assert (r.zcard(rpm), r.zcard(leases)) == (2, 0)
    await stage.aclose()
