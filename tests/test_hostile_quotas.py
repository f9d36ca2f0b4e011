"""A hostile review of the quota stage (RPM, TPM, concurrency leases in Redis): replies lost after
Redis ran a script (the store's one reconnect-and-resend must not apply a reservation twice), and
callers cancelled at the await points of begin / begin_reserve / settle (every lease released
exactly once, every TPM reservation settled or refunded). Against the real Redis on
127.0.0.1:6379, each test under a key prefix of its own."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
import uuid
from typing import Any

import pytest
import redis.asyncio as aioredis

from config.errors import OpenAIError
from config.models import QuotaSettings, TenantConfig
from gateway.quotas.stores import RedisQuotaStore
from gateway.quotas.tenant_quotas import TenantQuotas, redis_client_from_url
from tests.fixtures.redis_keys import REDIS_URL
from tests.quota_fixtures import TcpForwarder

pytestmark = pytest.mark.timeout(30)


def _tenant(**kw: Any) -> TenantConfig:
    return TenantConfig(id=f"h-{uuid.uuid4().hex[:8]}", **kw)


async def _state(store: RedisQuotaStore, tenant_id: str) -> dict[str, Any]:
    """What Redis holds for ``tenant_id`` (read on a client of its own): RPM entries, TPM entries,
    the debits hash's values, the TPM sum and the leases."""
    r = aioredis.from_url(REDIS_URL)
    try:
        rpm, tpm, debits, total, leases = store.keys(tenant_id)
        return {
            "rpm": int(await r.zcard(rpm)),
            "tpm": int(await r.zcard(tpm)),
            "debits": sorted(int(v) for v in (await r.hvals(debits))),
            "sum": int(await r.get(total) or 0),
            "leases": int(await r.zcard(leases)),
        }
    finally:
        await r.aclose()


# ---------------------------------------------------------------- a reply lost after the script ran
class ReplyDropProxy(TcpForwarder):
    """A TCP forwarder to the shared Redis. While armed, the first connection that carries an
    ``EVALSHA`` has Redis's reply withheld: Redis ran the scripts, then the client's side is reset
    (a load balancer or NAT box dropping a connection, ``CLIENT KILL``, a network blip)."""

    def __init__(self, port: int = 6379) -> None:
        self.armed = threading.Event()
        self.dropped = 0
        super().__init__(port)

    def _up(self, c: socket.socket, u: socket.socket, seen: threading.Event) -> None:
        try:
            while data := c.recv(65536):
                if b"EVALSHA" in data:
                    seen.set()
                u.sendall(data)
        except OSError:
            pass
        for s in (c, u):
            try:
                s.close()
            except OSError:
                pass

    def _down(self, u: socket.socket, c: socket.socket, seen: threading.Event) -> None:
        u.settimeout(None)
        try:
            while data := u.recv(65536):
                if seen.is_set() and self.armed.is_set():
                    self.armed.clear()
                    self.dropped += 1
                    time.sleep(0.05)  # every script of the pipeline has run
                    for s in (c, u):  # wakes the other thread's recv; the client reads end of stream
                        s.shutdown(socket.SHUT_RDWR)
                    return
                seen.clear()
                c.sendall(data)
        except OSError:
            pass

@pytest.fixture
def drop_proxy():
    p = ReplyDropProxy()
    try:
        yield p
    finally:
        p.close()


async def _stage_via(url: str, prefix: str, **settings: Any) -> TenantQuotas:
    store = RedisQuotaStore(redis_client_from_url(url, 0.5), prefix=prefix)
    stage = TenantQuotas(QuotaSettings(**settings), store)
    await stage.start()
    return stage


async def test_a_begin_whose_reply_was_lost_is_not_run_twice(drop_proxy, redis_prefix) -> None:
    """Redis ran ``begin.lua`` (RPM 1, concurrency 1), the reply was lost, the store reconnected
    and sent the pipeline once more: the second run must not see the first run's entry as another
    request's. Before the fix the request got a 429 for RPM and concurrency while Redis kept its
    RPM entry and its lease (a lease nobody would settle)."""
    stage = await _stage_via(drop_proxy.url, redis_prefix)
    tenant = _tenant(rpm=1, max_concurrent=1)
    drop_proxy.armed.set()
    try:
        lease = await stage.begin(tenant, "r1")
    except OpenAIError as e:
        pytest.fail(f"the resent begin answered {e.status}: {e.message}")
    finally:
        assert drop_proxy.dropped == 1
    assert lease.headers == {"x-ratelimit-limit-requests": "1", "x-ratelimit-remaining-requests": "0"}
    assert await _state(stage.store, tenant.id) == {"rpm": 1, "tpm": 0, "debits": [], "sum": 0, "leases": 1}
    await stage.settle(lease, 0)
    await asyncio.sleep(0.05)
    assert await _state(stage.store, tenant.id) == {"rpm": 1, "tpm": 0, "debits": [], "sum": 0, "leases": 0}
    await stage.aclose()


async def test_a_token_debit_whose_reply_was_lost_is_not_debited_twice(drop_proxy, redis_prefix) -> None:
    """``begin.lua`` + ``tokens.lua`` in one round trip, run by Redis, reply lost, resent: the
    TPM sum must still equal the debits (before the fix: 600 debited for a 300-token
    reservation, a sum the window never gives back, since trimming subtracts the hash's 300)."""
    stage = await _stage_via(drop_proxy.url, redis_prefix)
    tenant = _tenant(rpm=10, tpm=1000)
    drop_proxy.armed.set()
    lease = await stage.begin_reserve(tenant, "r1", 300)
    assert drop_proxy.dropped == 1
    assert lease.headers == {
        "x-ratelimit-limit-requests": "10",
        "x-ratelimit-remaining-requests": "9",
        "x-ratelimit-limit-tokens": "1000",
        "x-ratelimit-remaining-tokens": "700",
    }
    assert await _state(stage.store, tenant.id) == {"rpm": 1, "tpm": 1, "debits": [300], "sum": 300, "leases": 0}
    await stage.settle(lease, 120)
    await asyncio.sleep(0.05)
    assert await _state(stage.store, tenant.id) == {"rpm": 1, "tpm": 1, "debits": [120], "sum": 120, "leases": 0}
    await stage.aclose()


async def test_a_late_settle_whose_reply_was_lost_charges_the_excess_once(drop_proxy, redis_prefix) -> None:
    """A request longer than the window settles above its reservation (``settle.lua`` logs the
    excess as ``<lease>:x``); the reply is lost and the settle resent: the excess is charged once
    (before the fix the sum got it twice and kept the second forever)."""
    stage = await _stage_via(drop_proxy.url, redis_prefix, window_seconds=0.2)
    tenant = _tenant(tpm=1000)
    lease = await stage.begin_reserve(tenant, "r1", 100)
    await asyncio.sleep(0.3)  # the debit has left the 200 ms window
    drop_proxy.armed.set()
    await stage.settle(lease, 150)
    await asyncio.sleep(0.1)
    assert drop_proxy.dropped == 1
    # the reservation (100, out of the window, not trimmed yet: settle trims nothing) and the excess (50)
    assert await _state(stage.store, tenant.id) == {"rpm": 0, "tpm": 2, "debits": [50, 100], "sum": 150, "leases": 0}
    await stage.aclose()


# ---------------------------------------------------------------- callers cancelled mid-call
async def _redis_stage(prefix: str, **settings: Any) -> TenantQuotas:
    return await _stage_via(REDIS_URL, prefix, **settings)


async def test_a_settle_whose_caller_is_cancelled_still_reaches_redis(redis_prefix) -> None:
    """``settle`` marks the lease settled before its round trip; a caller cancelled while the
    settle waits for its turn's round trip (a task cancelled at shutdown, a finishing request
    cancelled again) must not drop it: before the fix the lease stayed in Redis for its whole TTL
    and the TPM debit at the full reservation, and no later settle could fix it."""
    stage = await _redis_stage(redis_prefix)
    tenant = _tenant(tpm=1000, max_concurrent=1)
    lease = await stage.begin_reserve(tenant, "r1", 500)
    assert await _state(stage.store, tenant.id) == {"rpm": 0, "tpm": 1, "debits": [500], "sum": 500, "leases": 1}
    settling = asyncio.ensure_future(stage.settle(lease, 100))
    await asyncio.sleep(0)  # queued for this turn's round trip
    settling.cancel()
    with pytest.raises(asyncio.CancelledError):
        await settling
    await asyncio.sleep(0.1)
    assert await _state(stage.store, tenant.id) == {"rpm": 0, "tpm": 1, "debits": [100], "sum": 100, "leases": 0}
    nxt = await stage.begin(tenant, "r2")  # the slot is free again
    await stage.settle(nxt, 0)
    await stage.aclose()


async def test_a_settle_during_the_back_off_is_sent_when_the_store_answers(redis_prefix) -> None:
    """A settle that comes while the store is in its back-off after a failure (0.5 s, for every
    tenant of a standalone Redis) is not dropped: it is sent in the background once the store may
    be called again, so the lease is released then, not by its TTL, and the debit corrected. Before
    the fix the tenant's only concurrency slot stayed taken for the lease TTL (120 s)."""
    from gateway.quotas.stores import QuotaStoreUnavailable

    stage = await _redis_stage(redis_prefix)
    tenant = _tenant(tpm=1000, max_concurrent=1)
    lease = await stage.begin_reserve(tenant, "r1", 500)
    stage._mark_down(QuotaStoreUnavailable("a blip"), tenant.id)  # as after a call that timed out
    await stage.settle(lease, 100)
    assert await _state(stage.store, tenant.id) == {"rpm": 0, "tpm": 1, "debits": [500], "sum": 500, "leases": 1}
    await asyncio.sleep(1.0)  # the back-off (0.5 s) is over and the background round has run
    assert await _state(stage.store, tenant.id) == {"rpm": 0, "tpm": 1, "debits": [100], "sum": 100, "leases": 0}
    nxt = await stage.begin(tenant, "r2")  # the slot is free again
    await stage.settle(nxt, 0)
    await stage.aclose()


async def test_a_begin_whose_caller_is_cancelled_in_flight_takes_nothing(redis_prefix) -> None:
    """``begin`` is cancelled after its call went out in a coalesced round trip: Redis takes the
    RPM entry and the lease, and no caller will ever settle it. The stage must undo it (as it
    undoes a call that timed out); before the fix the tenant's only concurrency slot stayed taken
    for the lease TTL."""
    stage = await _redis_stage(redis_prefix)
    other = _tenant(max_concurrent=5)
    other_lease = await stage.begin(other, "o1")
    tenant = _tenant(rpm=5, max_concurrent=1)
    settling = asyncio.ensure_future(stage.settle(other_lease, 0))  # makes this turn a coalesced round trip
    gone = asyncio.ensure_future(stage.begin(tenant, "r1"))
    await asyncio.sleep(0)  # both queued
    await asyncio.sleep(0)  # the round trip is under way
    gone.cancel()
    await settling
    with pytest.raises(asyncio.CancelledError):
        await gone
    await asyncio.sleep(0.4)
    assert await _state(stage.store, tenant.id) == {"rpm": 0, "tpm": 0, "debits": [], "sum": 0, "leases": 0}
    lease = await stage.begin(tenant, "r2")
    assert lease.headers == {"x-ratelimit-limit-requests": "5", "x-ratelimit-remaining-requests": "4"}
    await stage.settle(lease, 0)
    await stage.aclose()


class _Write:
    """A verifier index write (``PendingWrite``) whose calls are never made."""

    calls = [("0" * 40, [], [])]

    def guarded(self, key: str, field: str) -> list[tuple[str, list[str], list[Any]]]:
        return self.calls

    def sent(self, outcome: Any) -> None:
        pass

    def discard(self) -> None:
        pass

    async def finish(self) -> None:
        pass


async def test_begin_reserve_cancelled_after_the_lease_is_held_releases_it(redis_prefix) -> None:
    """``begin_reserve`` for a tenant without TPM holds the lease (and renews it every TTL / 3),
    then sends the verifier's write; cancelled there, the caller never gets the lease. Before the
    fix the lease stayed in the stage's live set and was renewed for as long as the process ran:
    the tenant's concurrency slot was lost for good."""
    stage = await _redis_stage(redis_prefix, lease_ttl_seconds=0.3)
    tenant = _tenant(rpm=10, max_concurrent=1)
    entered = asyncio.Event()

    async def slow_send(writes: Any) -> None:  # the write's round trip, slow
        entered.set()
        await asyncio.sleep(30)

    stage.send_writes = slow_send  # type: ignore[method-assign]
    gone = asyncio.ensure_future(stage.begin_reserve(tenant, "r1", 10, also=_Write()))  # type: ignore[arg-type]
    await entered.wait()
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    await asyncio.sleep(0.6)  # two TTLs: a renewed lease would still be there
    assert (await stage.renew_now(), len(stage._live)) == (0, 0)
    assert await _state(stage.store, tenant.id) == {"rpm": 1, "tpm": 0, "debits": [], "sum": 0, "leases": 0}
    lease = await stage.begin(tenant, "r2")
    assert lease.headers["x-ratelimit-remaining-requests"] == "8"
    await stage.settle(lease, 0)
    await stage.aclose()


async def test_a_settle_given_no_count_releases_the_lease_and_keeps_the_reservation(redis_prefix) -> None:
    """``settle`` never raises and runs once per lease: handed something that is not a token count
    (NaN, infinity), it must still release the lease and leave the debit at the reservation (an
    overcharge, never an undercharge). Before the fix the conversion failed inside the settle's
    ``try``: logged, nothing sent, the lease kept for its TTL."""
    stage = await _redis_stage(redis_prefix)
    tenant = _tenant(tpm=1000, max_concurrent=2)
    a = await stage.begin_reserve(tenant, "r1", 300)
    b = await stage.begin_reserve(tenant, "r2", 200)
    await stage.settle(a, float("nan"))  # type: ignore[arg-type]
    await stage.settle(b, float("inf"))  # type: ignore[arg-type]
    await asyncio.sleep(0.05)
    assert await _state(stage.store, tenant.id) == {"rpm": 0, "tpm": 2, "debits": [200, 300], "sum": 500, "leases": 0}
    await stage.aclose()


# ---------------------------------------------------------------- admission: the lease after begin_reserve
async def test_admission_cancelled_while_its_index_write_finishes_releases_the_lease() -> None:
    """``begin_reserve`` handed back the lease, then the request was cancelled while the deferred
    index write finished: the lease is settled at 0, not lost (its renewals would hold the tenant's
    concurrency slot until the process restarts)."""
    from types import SimpleNamespace

    from gateway.admission.admit import _begin_and_index
    from gateway.quotas.stage import QuotaLease

    settled: list[tuple[str, int]] = []
    finishing = asyncio.Event()

    class Pending:
        def discard(self) -> None:
            pass

        async def finish(self) -> None:
            finishing.set()
            await asyncio.sleep(10)

    class Verifier:
        def defers(self, exchange: object) -> bool:
            return True

        async def admit(self, exchange: object, decode: object, defer_write: bool = False) -> Pending:
            return Pending()

    class Quotas:
        async def begin_reserve(self, tenant: TenantConfig, request_id: str, tokens: int, also: object = None):
            return QuotaLease(tenant.id, request_id, tokens)

        async def settle(self, lease: QuotaLease, used: int) -> None:
            settled.append((lease.request_id, used))

    ctx = SimpleNamespace(verifier=Verifier(), quotas=Quotas())
    counter = SimpleNamespace(prompt_decoder=lambda prompt_ids: None)
    adm = SimpleNamespace(reserve_tokens=10, model=SimpleNamespace(counter=counter))
    task = asyncio.create_task(_begin_and_index(ctx, _tenant(), "r-1", adm, SimpleNamespace(prompt_ids=[])))  # type: ignore[arg-type]
    await asyncio.wait_for(finishing.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert settled == [("r-1", 0)]


async def test_a_refused_token_call_walks_a_bounded_number_of_debits(redis_prefix) -> None:
    """A tenant holding thousands of small debits: a refused TPM call walks at most the oldest
    1,024 of them for its Retry-After (each walked entry costs Redis time that every tenant
    shares), and answers the 1,024th's expiry, a lower bound, instead of walking to the exact
    one. 2,000 one-token debits 10 ms apart, the oldest 59 s old, TPM 2,000: 1,500 more tokens
    need the oldest 1,500 to leave (exactly in 15.99 s); the bound answers the 1,024th (11.23 s)."""
    stage = await _redis_stage(redis_prefix)
    tenant = _tenant(tpm=2000)
    _, tpm_log, debits, total, _ = stage.store.keys(tenant.id)
    r = aioredis.from_url(REDIS_URL)
    try:
        sec, usec = await r.time()
        now_ms = sec * 1000 + usec // 1000
        await r.zadd(tpm_log, {f"d{i}": now_ms - 59_000 + 10 * i for i in range(2000)})
        await r.hset(debits, mapping={f"d{i}": 1 for i in range(2000)})
        await r.set(total, 2000)
    finally:
        await r.aclose()
    with pytest.raises(OpenAIError) as refused:  # reserve.lua
        await stage.begin_reserve(tenant, "r1", 1500)
    assert refused.value.status == 429
    assert refused.value.headers["Retry-After"] == "12"  # ceil(11.23 s - the few ms since)
    lease = await stage.begin(tenant, "r2")
    with pytest.raises(OpenAIError) as refused:  # tokens.lua
        await stage.reserve_tokens(tenant, lease, 1500)
    assert refused.value.status == 429 and refused.value.headers["Retry-After"] == "12"
    await stage.settle(lease, 0)
    await stage.aclose()
