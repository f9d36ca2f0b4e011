"""A hostile review of the quota stage from a tenant's side, round three: what one tenant's
requests may cost the others in the in-process store (``redis_url: null``, and every gateway
process under ``local_fallback`` while Redis is down), which decides on the event loop that
every tenant shares."""

from __future__ import annotations

import asyncio
import threading
import types
from collections import deque
from typing import Any

import pytest
import redis.asyncio as aioredis

import gateway.app as app_module
from config.errors import OpenAIError
from config.models import QuotaSettings, TenantConfig
from gateway.edge import offload
from gateway.quotas.stores import LocalQuotaStore, QuotaLimits, RedisQuotaStore
from gateway.quotas.tenant_quotas import TenantQuotas, redis_client_from_url
from tests.fixtures.redis_keys import REDIS_URL

pytestmark = pytest.mark.timeout(30)

WINDOW_MS = 60_000


class _Walked(deque):
    """A TPM log that counts how many entries were read by iterating it."""

    walked = 0

    def __iter__(self) -> Any:
        for item in super().__iter__():
            type(self).walked += 1
            yield item


def _local_with_small_debits(now_ms: float, n: int = 2000) -> LocalQuotaStore:
    """An in-process store whose tenant ``t`` holds ``n`` one-token debits 10 ms apart, the
    oldest 59 s old at ``now_ms`` (TPM ``n``: the window is full)."""
    clock = [now_ms - 59_000.0]
    store = LocalQuotaStore(clock=lambda: clock[0])
    limits = QuotaLimits(None, n, None)
    for i in range(n):
        clock[0] = now_ms - 59_000.0 + 10 * i
        assert store.take_tokens_now("t", limits, f"d{i}", 1, WINDOW_MS).admitted
    clock[0] = now_ms
    return store


def test_a_refused_token_call_in_process_walks_a_bounded_number_of_debits() -> None:
    """The in-process twin of ``tokens.lua``'s bound (docs/quotas.md, "The window"): a tenant
    holding thousands of small debits, refused for TPM, had every one of them walked for its
    Retry-After, on the event loop every tenant shares (100,000 debits: about 30 ms a refusal,
    as often as the tenant sends a request that cannot fit). Now at most the oldest 1,024 are
    walked and the 1,024th's expiry answered, as Redis answers: 1,500 more tokens need the
    oldest 1,500 debits to leave (exactly 15.99 s); the bound answers 11.23 s."""
    store = _local_with_small_debits(1_000_000.0)
    log = store._tenants["t"]
    log.tpm = _Walked(log.tpm)
    decision = store.take_tokens_now("t", QuotaLimits(None, 2000, None), "big", 1500, WINDOW_MS)
    assert (decision.admitted, decision.refused, decision.retry_after_ms) == (False, ("tpm",), 11_230)
    assert _Walked.walked == 1024
    _Walked.walked = 0
    # within the bound the answer stays exact: 500 tokens need the oldest 500 to leave
    decision = store.take_tokens_now("t", QuotaLimits(None, 2000, None), "small", 500, WINDOW_MS)
    assert (decision.admitted, decision.retry_after_ms, _Walked.walked) == (False, 5_990, 500)


async def test_the_in_process_store_answers_the_retry_after_redis_answers() -> None:
    """The same window in Redis and in process memory gets the same 429: ``Retry-After: 12``
    (ceil of 11.23 s) from both, where the in-process store answered 16 (the exact 15.99 s)."""
    tenant = TenantConfig(id="walker", tpm=2000)
    prefix = "kvgate-test-round3-walk"
    client = aioredis.from_url(REDIS_URL)
    try:
        sec, usec = await client.time()
        now_ms = sec * 1000 + usec // 1000
        store = RedisQuotaStore(redis_client_from_url(REDIS_URL, 0.5), prefix=prefix)
        _, tpm_log, debits, total, _ = store.keys(tenant.id)
        await client.zadd(tpm_log, {f"d{i}": now_ms - 59_000 + 10 * i for i in range(2000)})
        await client.hset(debits, mapping={f"d{i}": 1 for i in range(2000)})
        await client.set(total, 2000)
        for key in (tpm_log, debits, total):
            await client.pexpire(key, 30_000)
        answers = []
        local = _local_with_small_debits(1_000_000.0)
        local._tenants[tenant.id] = local._tenants.pop("t")
        for stage in (TenantQuotas(QuotaSettings(), store), TenantQuotas(QuotaSettings(), local, fallback=local)):
            lease = await stage.begin(tenant, "r1")
            with pytest.raises(OpenAIError) as refused:
                await stage.reserve_tokens(tenant, lease, 1500)
            await stage.settle(lease, 0)
            answers.append((refused.value.status, refused.value.headers["Retry-After"]))
            await stage.aclose()
        assert answers == [(429, "12"), (429, "12")]
    finally:
        keys = [k async for k in client.scan_iter(match=f"{prefix}*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()


# ---------------------------------------------------------------- /metrics on the ops share
class _BlockingMetrics:
    """A multiprocess ``GatewayMetrics`` stand-in whose render waits for ``release``."""

    multiprocess_dir = "workers"
    content_type = "text/plain; version=0.0.4; charset=utf-8"

    def __init__(self) -> None:
        self.release = threading.Event()

    def render(self) -> bytes:
        self.release.wait(10)
        return b"# rendered\n"


async def test_a_flood_of_metrics_scrapes_holds_one_share_of_the_offload_threads_not_all():
    """Before: ``/metrics`` rendered its workers' files in ``asyncio.to_thread`` with no tenant
    set, so scrapes (no token by default) could take every offload thread and a tenant's counting
    queued behind them. Now they run on :data:`gateway.edge.offload.OPS_SHARE`: 8 scrapes on a
    pool of 4 threads (a share of 1) hold one thread, and a tenant's job still starts at once."""
    loop = asyncio.get_running_loop()
    executor = offload.TenantExecutor(max_workers=4, share=1)
    old = getattr(loop, "_default_executor", None)
    loop.set_default_executor(executor)
    m = _BlockingMetrics()
    gw = types.SimpleNamespace(metrics=m)
    request = types.SimpleNamespace(headers={})
    try:
        scrapes = [asyncio.ensure_future(app_module.metrics(gw, lambda _h: True, request)) for _ in range(8)]
        await asyncio.sleep(0.2)
        assert (executor.running(offload.OPS_SHARE), executor.waiting(offload.OPS_SHARE)) == (1, 7)

        async def tenant_job() -> str:
            offload.set_tenant("tenant-a")
            return await asyncio.wait_for(asyncio.to_thread(lambda: "counted"), 2)

        assert await asyncio.ensure_future(tenant_job()) == "counted"
        m.release.set()
        answers = await asyncio.wait_for(asyncio.gather(*scrapes), 10)
        assert [(r.status_code, r.body) for r in answers] == [(200, b"# rendered\n")] * 8
    finally:
        m.release.set()
        loop._default_executor = old  # the loop's own again (set_default_executor refuses None)
        executor.shutdown(wait=False)
