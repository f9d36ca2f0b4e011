"""A small prompt's leak-index write can ride a quota reservation's Redis round trip
(verifier.stage.PendingWrite, gateway.quotas.stores.RedisQuotaStore._call_with): one pipeline
holds the reservation and the index write. What lands in Redis, what happens when Redis lost
the scripts (NOSCRIPT), when the reservation makes no round trip (unlimited tenant), when the
round trip fails; the write in the quota store's next coalesced round trip
(``TenantQuotas.send_writes``); the write riding the token reservation (``reserve_tokens``),
guarded by it: made only when the reservation is, so a refused prompt is never indexed; and
through the real app, where a small prompt is fingerprinted before its tokens are reserved and
its write rides that reservation's round trip."""

from __future__ import annotations

import contextlib
import time
import uuid

import pytest
import redis

from config.models import QuotaSettings, TenantConfig, VerifierSettings
from gateway.quotas.stores import RedisQuotaStore, load_script
from gateway.quotas.tenant_quotas import TenantQuotas, redis_client_from_url
from tests.fixtures.settings import verifier_settings as settings
from tests.test_verifier_inline_ingest import ex
from verifier.build import build_verifier
from verifier.leak_index import RedisLeakStore
from verifier.service import VerifierService

REDIS_URL = "redis://127.0.0.1:6379/0"
SECRETS = {"leak_index_key": b"round-trip-key", "cache_salt_key": b"x", "admin_key": b"y"}
LIMITED = TenantConfig(id="a", rpm=1000, tpm=10**9, verify_sample_rate=0.0)
UNLIMITED = TenantConfig(id="u", verify_sample_rate=0.0)
WARMUP_PROMPT = " ".join(f"orchard{i} kettle{i * 5 % 17} meadow{i * 2 % 19}" for i in range(60))
WARMUP = TenantConfig(id="w", rpm=1000, tpm=10**9, verify_sample_rate=0.0)
PROMPT = " ".join(f"harbour{i} ledger{i * 7 % 13} lantern{i * 3 % 11}" for i in range(60))


@pytest.fixture
def prefix():
    p = f"test-rt-{uuid.uuid4().hex[:8]}"
    yield p
    c = redis.Redis.from_url(REDIS_URL)
    keys = list(c.scan_iter(match=p + "*"))
    if keys:
        c.delete(*keys)
    c.close()


@pytest.fixture
def own_writes(monkeypatch):
    """Counts the verifier's own ``aadd`` calls (the writes that did not ride the reservation)."""
    calls: list[str] = []
    real = RedisLeakStore.aadd

    async def counting(self, tenant, fps):
        calls.append(tenant)
        await real(self, tenant, fps)

    monkeypatch.setattr(RedisLeakStore, "aadd", counting)
    return calls


async def admit_and_reserve(svc: VerifierService, quotas: TenantQuotas, tenant: TenantConfig, prompt: str):
    """What gateway.admission.admit does: the deferred index write sent with the reservation, then finished."""
    e = ex(tenant, prompt)
    pending = await svc.admit(e, defer_write=True)
    assert pending is not None and len(pending.calls) == 1
    try:
        return await quotas.reserve(tenant, 100, e.request.request_id, also=pending)
    finally:
        await pending.finish()


def owners(svc: VerifierService, prompt: str) -> list[set[str]]:
    fps, _ = svc.ingest.fingerprint(ex(LIMITED, prompt), prompt)
    assert len(fps) >= 5
    return svc.index.store.owners(sorted(fps))


def load_all_scripts() -> None:
    """Every script a request's round trips use, loaded (an earlier test flushed them): else a
    ``NOSCRIPT`` reply sends the index write apart."""
    from verifier.leak_index import _ADD_IF_LUA, _ADD_LUA

    for script in (_ADD_LUA, _ADD_IF_LUA, *(load_script(n) for n in ("begin", "tokens", "settle"))):
        redis.Redis.from_url(REDIS_URL).script_load(script)


@contextlib.contextmanager
def app_with_redis(prefix: str, **limits):
    """The real app with Redis quotas and the verifier's Redis stores under ``prefix``, tenant
    ``tenant-a`` held to ``limits``, over a mock engine. Yields ``(gateway, engine, verifier,
    quotas)``."""
    from tests.gateway_harness import SECRETS as APP_SECRETS
    from tests.gateway_harness import Gateway, settings_for, tenants, upstream
    from tests.mock_engine import MockEngine

    engine = MockEngine().start()
    base = settings_for([upstream("u1", engine)])
    s = base.model_copy(update={"redis_url": REDIS_URL, "verifier": VerifierSettings()})
    quotas = TenantQuotas(QuotaSettings(), RedisQuotaStore(redis_client_from_url(REDIS_URL, 0.5), prefix=prefix + ":q"))
    svc = build_verifier(s, secrets=APP_SECRETS, key_prefix=prefix + ":v:")
    g = Gateway(s, tenants(**limits), quotas=quotas, verifier=svc).start()
    load_all_scripts()
    try:
        yield g, engine, svc, quotas
    finally:
        g.stop()
        engine.stop()


async def test_the_index_write_rides_the_reservation(tmp_path, prefix, own_writes):
    svc = build_verifier(settings(tmp_path, REDIS_URL), secrets=SECRETS, key_prefix=prefix + ":v:")
    quotas = TenantQuotas(QuotaSettings(), RedisQuotaStore(redis_client_from_url(REDIS_URL, 0.5), prefix=prefix + ":q"))
    try:
        # a Redis that has not run both scripts yet (fresh, or flushed: the next test) sends the
        # first index write on its own; once both are loaded every write rides along
        warm = await admit_and_reserve(svc, quotas, WARMUP, WARMUP_PROMPT)
        await quotas.settle(warm, 10)
        own_writes.clear()
        lease = await admit_and_reserve(svc, quotas, LIMITED, PROMPT)
        assert lease.headers["x-ratelimit-remaining-requests"] == "999"
        assert own_writes == []  # nothing sent on its own
        assert set(map(frozenset, owners(svc, PROMPT))) == {frozenset({"a"})}
        assert (svc.stats["ingested"], svc.stats["store_errors"], svc.ingest_pending_bytes) == (2, 0, 0)
        await quotas.settle(lease, 10)
    finally:
        await quotas.aclose()
        await svc.aclose()


async def test_scripts_lost_by_redis_are_loaded_again(tmp_path, prefix, own_writes):
    """SCRIPT FLUSH (a restarted Redis): the reservation is loaded and sent again; the index
    write's NOSCRIPT is sent again by the verifier's own client. Both land."""
    svc = build_verifier(settings(tmp_path, REDIS_URL), secrets=SECRETS, key_prefix=prefix + ":v:")
    quotas = TenantQuotas(QuotaSettings(), RedisQuotaStore(redis_client_from_url(REDIS_URL, 0.5), prefix=prefix + ":q"))
    try:
        redis.Redis.from_url(REDIS_URL).script_flush()
        lease = await admit_and_reserve(svc, quotas, LIMITED, PROMPT)
        assert lease.headers["x-ratelimit-remaining-requests"] == "999"
        assert own_writes == ["a"]
        assert set(map(frozenset, owners(svc, PROMPT))) == {frozenset({"a"})}
        assert (svc.stats["ingested"], svc.stats["store_errors"]) == (1, 0)
        await quotas.settle(lease, 10)
        lease = await admit_and_reserve(svc, quotas, LIMITED, PROMPT + " again")
        assert own_writes == ["a"] and lease.headers["x-ratelimit-remaining-requests"] == "998"
        await quotas.settle(lease, 10)
    finally:
        await quotas.aclose()
        await svc.aclose()


async def test_an_unlimited_tenant_makes_no_round_trip_so_the_verifier_writes_itself(tmp_path, prefix, own_writes):
    svc = build_verifier(settings(tmp_path, REDIS_URL), secrets=SECRETS, key_prefix=prefix + ":v:")
    quotas = TenantQuotas(QuotaSettings(), RedisQuotaStore(redis_client_from_url(REDIS_URL, 0.5), prefix=prefix + ":q"))
    try:
        await admit_and_reserve(svc, quotas, UNLIMITED, PROMPT)
        assert own_writes == ["u"]
        assert set(map(frozenset, owners(svc, PROMPT))) == {frozenset({"u"})}
    finally:
        await quotas.aclose()
        await svc.aclose()


def closed_port() -> int:
    from tests.gateway_harness import refused_port

    return refused_port()


async def test_a_failed_round_trip_counts_a_store_error_and_the_quota_policy_applies(tmp_path, prefix, own_writes):
    """The quota store's Redis is gone (fail closed: 503); the index write that rode it failed
    with it: counted once as a store error, not sent again, the budget released."""
    from config.errors import OpenAIError

    svc = build_verifier(settings(tmp_path, REDIS_URL), secrets=SECRETS, key_prefix=prefix + ":v:")
    dead = RedisQuotaStore(redis_client_from_url(f"redis://127.0.0.1:{closed_port()}/0", 0.25), prefix=prefix + ":q")
    quotas = TenantQuotas(QuotaSettings(redis_failure_policy="fail_closed"), dead)
    try:
        with pytest.raises(OpenAIError) as ei:
            await admit_and_reserve(svc, quotas, LIMITED, PROMPT)
        assert (ei.value.status, ei.value.code) == (503, "quota_backend_unavailable")
        assert own_writes == []
        assert (svc.stats["ingested"], svc.stats["store_errors"], svc.ingest_pending_bytes) == (1, 1, 0)
    finally:
        await quotas.aclose()
        await svc.aclose()


def test_through_the_app_only_the_admitted_prompt_is_indexed(prefix, own_writes):
    """A chat through the real app with Redis quotas and the verifier: the admitted prompt's
    fingerprints are in Redis under its tenant, written in its token reservation's round trip
    (guarded by it), none by the verifier's own client; the next chat, over the tenant's RPM, is
    refused before its body is read and indexes nothing."""
    from tests.gateway_harness import chat, wait_for

    with app_with_redis(prefix, rpm=1, tpm=10_000) as (g, _, svc, quotas), g.client() as c:
        trips = quotas.store.round_trips
        r = c.post("/v1/chat/completions", json=chat(PROMPT))
        assert r.status_code == 200, r.text
        # begin; the tokens with the index write; the settle (after the answer: awaited here)
        wait_for(lambda: quotas.store.round_trips >= trips + 3)
        time.sleep(0.1)
        assert quotas.store.round_trips == trips + 3
        assert (r.headers["x-ratelimit-remaining-requests"], r.headers["x-ratelimit-remaining-tokens"]) == (
            "0",
            str(10_000 - 16 - 369),  # the default bound (16) + the prompt's 369 tokens
        )
        r = c.post("/v1/chat/completions", json=chat(WARMUP_PROMPT))
        assert (r.status_code, r.json()["error"]["code"]) == (429, "rate_limit_exceeded")
    assert own_writes == []
    fps, _ = svc.ingest.fingerprint(ex(LIMITED, PROMPT), PROMPT)
    assert fps and {frozenset(o) for o in svc.index.store.owners(sorted(fps))} == {frozenset({"tenant-a"})}
    refused, _ = svc.ingest.fingerprint(ex(LIMITED, WARMUP_PROMPT), WARMUP_PROMPT)
    assert refused and svc.index.store.owners(sorted(refused)) == [set()] * len(refused)
    assert svc.stats["ingested"] == 1 and svc.stats["store_errors"] == 0


async def test_the_index_write_rides_the_next_coalesced_round_trip(tmp_path, prefix, own_writes):
    """``send_writes``: the index write goes out with the other quota calls of the same turn of
    the event loop (one round trip for both); it lands under its tenant, none sent on its own."""
    import asyncio

    from verifier.leak_index import _ADD_LUA

    svc = build_verifier(settings(tmp_path, REDIS_URL), secrets=SECRETS, key_prefix=prefix + ":v:")
    store = RedisQuotaStore(redis_client_from_url(REDIS_URL, 0.5), prefix=prefix + ":q")
    quotas = TenantQuotas(QuotaSettings(), store)
    try:
        redis.Redis.from_url(REDIS_URL).script_load(_ADD_LUA)
        warm = await quotas.begin(WARMUP, "warm")  # the quota script loaded
        await quotas.settle(warm, 0)
        e = ex(LIMITED, PROMPT)
        pending = await svc.admit(e, defer_write=True)
        assert pending is not None
        trips, calls = store.round_trips, store.calls
        first, second, _ = await asyncio.gather(
            quotas.begin(WARMUP, "first"), quotas.begin(WARMUP, "second"), quotas.send_writes(pending)
        )
        await pending.finish()
        assert (store.round_trips, store.calls) == (trips + 2, calls + 3)  # the first alone, then the others
        assert own_writes == []
        assert set(map(frozenset, owners(svc, PROMPT))) == {frozenset({"a"})}
        assert (svc.stats["ingested"], svc.stats["store_errors"], svc.ingest_pending_bytes) == (1, 0, 0)
        await quotas.settle(first, 0)
        await quotas.settle(second, 0)
    finally:
        await quotas.aclose()
        await svc.aclose()


async def reserve_tokens_with_write(svc: VerifierService, quotas: TenantQuotas, tenant: TenantConfig, tokens: int):
    """What gateway.admission.admit does for a small prompt: begin, fingerprint, then the token
    reservation with the index write guarded by it (discarded on refusal), then finish. Returns
    ``(lease, error)``: the error a refused reservation raised, else ``None``."""
    from config.errors import OpenAIError

    lease = await quotas.begin(tenant, "r")
    pending = await svc.admit(ex(tenant, PROMPT), defer_write=True)
    assert pending is not None and len(pending.calls) == 1
    error = None
    try:
        await quotas.reserve_tokens(tenant, lease, tokens, also=pending)
    except OpenAIError as e:
        pending.discard()
        error = e
    finally:
        await pending.finish()
    await quotas.settle(lease, 0)
    return lease, error


async def test_the_index_write_rides_the_token_reservation_and_only_an_admitted_one(tmp_path, prefix, own_writes):
    """``reserve_tokens(also=...)``: the token reservation and the guarded index write share one
    round trip. Admitted: the fingerprints land under the tenant, nothing sent on its own.
    Refused (over TPM): the guarded write answers -1 and writes nothing, and after ``discard``
    nothing is sent later, nothing counts as ingested, the budget is back."""
    svc = build_verifier(settings(tmp_path, REDIS_URL), secrets=SECRETS, key_prefix=prefix + ":v:")
    store = RedisQuotaStore(redis_client_from_url(REDIS_URL, 0.5), prefix=prefix + ":q")
    quotas = TenantQuotas(QuotaSettings(), store)
    tight = TenantConfig(id="t", rpm=1000, tpm=50, verify_sample_rate=0.0)
    try:
        load_all_scripts()
        trips = store.round_trips
        lease, error = await reserve_tokens_with_write(svc, quotas, tight, 51)
        assert (error.status, error.code) == (429, "rate_limit_exceeded")
        assert store.round_trips == trips + 3  # begin; the tokens with the write; settle
        assert owners(svc, PROMPT) == [set()] * len(owners(svc, PROMPT))
        assert own_writes == []
        assert (svc.stats["ingested"], svc.stats["store_errors"], svc.ingest_pending_bytes) == (0, 0, 0)
        assert svc.ingest.caps.leak.used("t") == 0  # what the caps let in for it is given back

        trips = store.round_trips
        lease, error = await reserve_tokens_with_write(svc, quotas, tight, 50)
        assert error is None and lease.reserved_tokens == 50
        assert store.round_trips == trips + 3
        assert set(map(frozenset, owners(svc, PROMPT))) == {frozenset({"t"})}
        assert own_writes == []
        assert (svc.stats["ingested"], svc.stats["store_errors"], svc.ingest_pending_bytes) == (1, 0, 0)
        assert svc.ingest.caps.leak.used("t") == len(owners(svc, PROMPT))
    finally:
        await quotas.aclose()
        await svc.aclose()


async def test_a_reservation_reloaded_after_noscript_still_indexes_only_when_admitted(tmp_path, prefix, own_writes):
    """Redis lost the token script but not the guarded write's: the write runs first in the
    pipeline (no reservation yet: -1, nothing written), the reservation is loaded and sent again.
    Admitted: the verifier sends the write itself afterwards. Refused: nothing is written. Redis
    lost both: the first write is sent apart and loads the scripts; the next one rides along."""
    from verifier.leak_index import _ADD_IF_LUA

    svc = build_verifier(settings(tmp_path, REDIS_URL), secrets=SECRETS, key_prefix=prefix + ":v:")
    store = RedisQuotaStore(redis_client_from_url(REDIS_URL, 0.5), prefix=prefix + ":q")
    quotas = TenantQuotas(QuotaSettings(), store)
    tight = TenantConfig(id="t", rpm=1000, tpm=50, verify_sample_rate=0.0)
    r = redis.Redis.from_url(REDIS_URL)
    try:
        r.script_flush()
        r.script_load(_ADD_IF_LUA)
        _, error = await reserve_tokens_with_write(svc, quotas, tight, 51)
        assert error is not None and error.status == 429
        assert owners(svc, PROMPT) == [set()] * len(owners(svc, PROMPT)) and own_writes == []

        r.script_flush()
        r.script_load(_ADD_IF_LUA)
        _, error = await reserve_tokens_with_write(svc, quotas, tight, 50)
        assert error is None
        assert own_writes == ["t"]
        assert set(map(frozenset, owners(svc, PROMPT))) == {frozenset({"t"})}
        assert (svc.stats["ingested"], svc.stats["store_errors"], svc.ingest_pending_bytes) == (1, 0, 0)

        r.script_flush()  # both lost: the first write goes apart and loads its scripts, the next rides
        for _ in range(2):
            _, error = await reserve_tokens_with_write(svc, quotas, tight, 20)
            assert error is None
        assert own_writes == ["t", "t"]
        assert (svc.stats["ingested"], svc.stats["store_errors"]) == (3, 0)
    finally:
        r.close()
        await quotas.aclose()
        await svc.aclose()


def test_through_the_app_a_prompt_refused_for_tpm_is_never_indexed(prefix, own_writes):
    """Through the real app: a chat whose tokens exceed what is left of the tenant's TPM is
    refused (429) after it was counted and fingerprinted, and none of its fingerprints reach
    Redis; the admitted chat before it is indexed under its tenant."""
    from tests.gateway_harness import chat

    with app_with_redis(prefix, rpm=10, tpm=800) as (g, engine, svc, _), g.client() as c:
        r = c.post("/v1/chat/completions", json=chat(PROMPT))
        assert r.status_code == 200, r.text
        assert r.headers["x-ratelimit-remaining-tokens"] == str(800 - 16 - 369)
        r = c.post("/v1/chat/completions", json=chat(WARMUP_PROMPT))
        assert (r.status_code, r.json()["error"]["code"]) == (429, "rate_limit_exceeded")
        assert r.json()["error"]["message"].startswith(
            "Rate limit reached for tenant 'tenant-a' on tokens per 60s window (TPM): "
            "Limit 800, Used 373, Requested 504."  # the first chat settled at its usage (369 + 4)
        )
        assert len(engine.state.requests) == 1
    assert own_writes == []
    fps, _ = svc.ingest.fingerprint(ex(LIMITED, PROMPT), PROMPT)
    assert {frozenset(o) for o in svc.index.store.owners(sorted(fps))} == {frozenset({"tenant-a"})}
    refused, _ = svc.ingest.fingerprint(ex(LIMITED, WARMUP_PROMPT), WARMUP_PROMPT)
    assert refused and svc.index.store.owners(sorted(refused)) == [set()] * len(refused)
    assert (svc.stats["ingested"], svc.stats["store_errors"], svc.ingest_pending_bytes) == (1, 0, 0)
