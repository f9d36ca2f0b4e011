"""The request path's two quota steps against the real Redis (own key prefix) and the in-process
store alike: ``begin`` (``begin.lua``: RPM and a lease, all or none) at arrival, then
``take_tokens`` (``tokens.lua``: TPM) once counted; a refusal at either step changes nothing it
decides, and the stage's ``begin`` / ``reserve_tokens`` / ``settle(lease, 0)`` leave no lease or
debit behind."""

from __future__ import annotations

import uuid

import pytest

from config.errors import OpenAIError
from config.models import QuotaSettings, TenantConfig
from gateway.quotas.stores import LocalQuotaStore, QuotaLimits
from gateway.quotas.tenant_quotas import TenantQuotas

WINDOW_MS = 60_000
TTL_MS = 120_000


def answer(d):
    return (d.admitted, d.refused, d.remaining_requests, d.remaining_tokens, d.too_large)


async def test_begin_takes_rpm_and_a_lease_or_nothing_and_tokens_take_tpm_or_nothing(quota_store) -> None:
    lim = QuotaLimits(rpm=2, tpm=100, max_concurrent=1)
    assert answer(await quota_store.begin("t", lim, "a", WINDOW_MS, TTL_MS)) == (True, (), 1, -1, False)
    d = await quota_store.begin("t", lim, "b", WINDOW_MS, TTL_MS)  # the lease is held: nothing spent
    assert (answer(d), d.retry_after_ms) == ((False, ("concurrency",), 1, -1, False), 1000)
    assert answer(await quota_store.take_tokens("t", lim, "a", 60, WINDOW_MS)) == (True, (), -1, 40, False)
    d = await quota_store.take_tokens("t", lim, "a2", 50, WINDOW_MS)
    assert answer(d) == (False, ("tpm",), -1, 40, False) and 59_000 < d.retry_after_ms <= 60_000
    d = await quota_store.take_tokens("t", lim, "a3", 101, WINDOW_MS)
    assert (answer(d), d.retry_after_ms) == ((False, ("tpm",), -1, 40, True), WINDOW_MS)
    await quota_store.settle("t", lim, "a", 10, 60, WINDOW_MS)  # lease released, debit corrected to 10
    assert answer(await quota_store.begin("t", lim, "c", WINDOW_MS, TTL_MS)) == (True, (), 0, -1, False)
    assert answer(await quota_store.take_tokens("t", lim, "c", 90, WINDOW_MS)) == (True, (), -1, 0, False)
    await quota_store.settle("t", lim, "c", 0, 90, WINDOW_MS)  # refused later: refunded
    d = await quota_store.begin("t", lim, "d", WINDOW_MS, TTL_MS)  # two requests spent the RPM
    assert answer(d) == (False, ("rpm",), 0, -1, False) and 59_000 < d.retry_after_ms <= 60_000
    assert answer(await quota_store.reserve("t", QuotaLimits(None, 100, None), "e", 90, WINDOW_MS, TTL_MS))[:2] == (
        True,
        (),
    )


async def test_the_stage_releases_a_refused_request_and_keeps_its_rpm_spent(redis_store) -> None:
    stage = TenantQuotas(QuotaSettings(), redis_store)
    tenant = TenantConfig(id=f"t-{uuid.uuid4().hex[:6]}", rpm=3, tpm=100, max_concurrent=1)
    lease = await stage.begin(tenant, "r1")
    assert (lease.reserved_tokens, lease.headers) == (
        0,
        {"x-ratelimit-limit-requests": "3", "x-ratelimit-remaining-requests": "2"},
    )
    with pytest.raises(OpenAIError) as e:
        await stage.reserve_tokens(tenant, lease, 101)
    headers = e.value.headers
    assert (e.value.status, headers.get("Retry-After"), headers["x-should-retry"]) == (429, None, "false")
    assert e.value.message.startswith(f"Request too large for tenant '{tenant.id}' on tokens per 60s window (TPM)")
    await stage.settle(lease, 0)
    lease = await stage.begin(tenant, "r2")  # the lease was released
    await stage.reserve_tokens(tenant, lease, 30)
    assert (lease.reserved_tokens, lease.headers["x-ratelimit-remaining-tokens"]) == (30, "70")
    await stage.settle(lease, 25)
    lease = await stage.begin(tenant, "r3")
    assert lease.headers["x-ratelimit-remaining-requests"] == "0"
    await stage.settle(lease, 0)
    with pytest.raises(OpenAIError) as e:
        await stage.begin(tenant, "r4")
    retry = e.value.headers["Retry-After"]  # 59 once a second passed since the first request
    assert retry in ("59", "60") and e.value.message == (
        f"Rate limit reached for tenant '{tenant.id}' on requests per 60s window (RPM): Limit 3, Used 3, "
        f"Requested 1. Please try again in {retry}s."
    )
    assert set(e.value.headers) == {"Retry-After", "x-ratelimit-limit-requests", "x-ratelimit-remaining-requests"}
    client = redis_store.client
    rpm, tpm, debits, total, leases = redis_store.keys(tenant.id)
    assert (await client.zcard(rpm), await client.zcard(leases), int(await client.get(total))) == (3, 0, 25)
    await stage.aclose()


class TokensDown:
    """A shared store that answers ``begin`` and then fails (Redis gone between the two steps)."""

    name = "flaky"

    def __init__(self) -> None:
        self.inner = LocalQuotaStore()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def take_tokens(self, *a, **kw):
        from gateway.quotas.stores import QuotaStoreUnavailable

        raise QuotaStoreUnavailable("gone")


async def test_a_store_lost_between_the_two_steps_takes_the_failure_policy() -> None:
    tenant = TenantConfig(id="t", rpm=10, tpm=100, max_concurrent=4)
    fallback = LocalQuotaStore()
    stage = TenantQuotas(QuotaSettings(replicas=2), TokensDown(), fallback=fallback)
    lease = await stage.begin(tenant, "r1")
    await stage.reserve_tokens(tenant, lease, 50)  # decided locally, against 100 // 2
    # undone later but for its RPM entry: the request goes on (docs/quotas.md, "When Redis fails")
    assert (lease.headers["x-ratelimit-remaining-tokens"], list(stage._uncertain)) == (
        "0",
        [("t", lease.state.lease_id, True)],
    )
    assert lease.state.store is fallback and fallback._tenants["t"].tpm_sum == 50
    await stage.settle(lease, 20)
    assert fallback._tenants["t"].tpm_sum == 20
    closed = TenantQuotas(QuotaSettings(), TokensDown())  # fail closed: 503
    lease = await closed.begin(tenant, "r2")
    with pytest.raises(OpenAIError) as e:
        await closed.reserve_tokens(tenant, lease, 50)
    assert (e.value.status, e.value.code) == (503, "quota_backend_unavailable")
    assert list(closed._uncertain) == [("t", lease.state.lease_id, False)]  # refused: all undone
    await closed.settle(lease, 0)
    await stage.aclose()
    await closed.aclose()
