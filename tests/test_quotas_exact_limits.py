"""Exact quota limits: the window's edge to the millisecond, Retry-After to the millisecond, and the
limits' own boundaries (a request of exactly the TPM, a lease expiring right now, a settle of
exactly its reservation), in the Lua scripts on the real Redis at 127.0.0.1:6379 (each test with
its own key prefix) and in the in-process store alike; then the stage's own numbers (Retry-After
rounded up, the decision deadline, the tombstones' life, the fallback's shares and leases).

Redis's clock moves while a test runs, so the tests that need the script's own ``now`` run the
script between two ``TIME`` reads in one pipeline and keep the runs whose two reads fall in the
same millisecond: that millisecond is the script's ``now``. The window's log is filled with one
entry per millisecond around the window's edge, so every count and every Retry-After follows
from ``now`` alone. Where the state must be laid out around ``now`` before the script runs (a
lease expiring at ``now``), each try guesses ``now`` and counts only when the reads confirm it.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from config.errors import OpenAIError
from config.models import QuotaSettings, TenantConfig
from gateway.quotas.stores import (
    LocalQuotaStore,
    QuotaDecision,
    QuotaLimits,
    QuotaStoreUnavailable,
    RedisQuotaStore,
    _begin_args,
    _decision,
    _tokens_args,
)
from gateway.quotas.tenant_quotas import TenantQuotas

WINDOW_MS = 5000
TTL_MS = 120_000
#: requests and 1-token debits logged one per millisecond from the window's edge on: more than
#: the milliseconds the test's runs take
SPAN = 4000


def _ms(t: Any) -> int:
    return int(t[0]) * 1000 + int(t[1]) // 1000


async def _server_ms(store: RedisQuotaStore) -> int:
    return _ms(await store.client.time())


async def _at_known_ms(store: RedisQuotaStore, script: Any, tenant: str, args: list[Any]) -> tuple[int, Any]:
    """Run ``script`` (one of ``store``'s) for ``tenant`` with ``args`` until a run's ``now`` is
    known: the two ``TIME`` reads around it in one pipeline give the same millisecond. Returns
    ``(now, the script's reply)``. Only for calls whose runs change nothing that a later run
    counts (refusals: they trim only what has left the window)."""
    keys = store._script_keys(tenant)
    for _ in range(100):
        pipe = store.client.pipeline(transaction=False)
        pipe.time()
        pipe.evalsha(script.sha, len(keys), *keys, *args)
        pipe.time()
        before, reply, after = await pipe.execute()
        if _ms(before) == _ms(after):
            return _ms(before), reply
    pytest.fail("no run of the script fell within one millisecond of Redis's clock")


async def _fill_window_edge(store: RedisQuotaStore, tenant: str) -> int:
    """Log ``SPAN`` requests and as many 1-token debits, one per millisecond, the oldest exactly one
    window before Redis's time now (the edge a call now would cut at). Returns that time ``t0``:
    a call at ``now`` >= ``t0`` then finds ``t0 + SPAN - 1 - now`` of them in its window (those
    logged after ``now - WINDOW_MS``; one logged exactly then has left it)."""
    rpm, tpm, debits, total, _ = store.keys(tenant)
    t0 = await _server_ms(store)
    entries = {f"e{k}": t0 - WINDOW_MS + k for k in range(SPAN)}
    pipe = store.client.pipeline(transaction=False)
    pipe.zadd(rpm, entries)
    pipe.zadd(tpm, entries)
    pipe.hset(debits, mapping=dict.fromkeys(entries, 1))
    pipe.set(total, SPAN)
    await pipe.execute()
    return t0


async def test_the_window_edge_is_exact_to_the_millisecond(redis_store) -> None:
    """An admission logged exactly ``window`` ms before ``now`` no longer counts (the window is
    ``now - admitted_at < window``), in the three scripts that count it, for RPM and TPM alike;
    an RPM refusal's Retry-After is the exact time until the request that makes room leaves (for
    RPM 5 the 5th newest); a request above the whole TPM waits one window."""
    store, t = redis_store, "edge"
    for script in (store._begin, store._tokens, store._reserve):
        await store.client.script_load(script.script)
    t0 = await _fill_window_edge(store, t)

    def held(now: int) -> int:
        return t0 + SPAN - 1 - now

    args = _begin_args(QuotaLimits(5, None, None), "b", WINDOW_MS, TTL_MS)
    now, r = await _at_known_ms(store, store._begin, t, args)
    d = _decision(r)
    assert (d.admitted, d.refused, d.used_requests, d.remaining_requests) == (False, ("rpm",), held(now), 0)
    assert d.retry_after_ms == held(now) - 4  # the 5th newest's time + window - now

    now, r = await _at_known_ms(store, store._tokens, t, _tokens_args(QuotaLimits(None, 5, None), "k", 6, WINDOW_MS))
    d = _decision(r)
    assert (d.admitted, d.refused, d.used_tokens, d.remaining_tokens, d.too_large, d.retry_after_ms) == (
        False,
        ("tpm",),
        held(now),
        0,
        True,
        WINDOW_MS,
    )

    # reserve.lua's ARGV: id, rpm, tpm, max_concurrent, tokens, window_ms, lease_ttl_ms
    now, r = await _at_known_ms(store, store._reserve, t, ["r", 5, -1, -1, 1, WINDOW_MS, TTL_MS])
    d = _decision(r)
    assert (d.refused, d.used_requests, d.used_tokens, d.retry_after_ms) == (("rpm",), held(now), -1, held(now) - 4)
    now, r = await _at_known_ms(store, store._reserve, t, ["r", 5, 5, -1, 6, WINDOW_MS, TTL_MS])
    d = _decision(r)
    assert (d.refused, d.used_requests, d.used_tokens, d.too_large) == (("rpm", "tpm"), held(now), held(now), True)
    # the refusals trimmed what left the window, and nothing else
    rpm, tpm_log, debits, total, _ = store.keys(t)
    oldest = await store.client.zrange(rpm, 0, 0, withscores=True)
    counts = (await store.client.zcard(rpm), await store.client.zcard(tpm_log), await store.client.hlen(debits))
    assert (counts, int(await store.client.get(total)), oldest[0][1]) == (
        (held(now),) * 3,
        held(now),
        now - WINDOW_MS + 1,
    )


async def test_a_request_of_exactly_the_tpm_waits_for_the_window_and_is_not_too_large(quota_store) -> None:
    """``tokens == tpm`` fits an empty window: refused while the window holds anything, it is told
    when (the last debit leaves), not that it never fits; one token more never fits."""
    lim = QuotaLimits(None, 100, None)
    assert (await quota_store.reserve("t", lim, "a", 1, 60_000, TTL_MS)).admitted
    for d in (
        await quota_store.reserve("t", lim, "b", 100, 60_000, TTL_MS),
        await quota_store.take_tokens("t", lim, "b", 100, 60_000),
    ):
        assert (d.admitted, d.refused, d.too_large, d.remaining_tokens, d.used_tokens) == (
            False,
            ("tpm",),
            False,
            99,
            1,
        )
        assert 59_000 < d.retry_after_ms <= 60_000
    for d in (
        await quota_store.reserve("t", lim, "c", 101, 60_000, TTL_MS),
        await quota_store.take_tokens("t", lim, "c", 101, 60_000),
    ):
        assert (d.admitted, d.too_large, d.retry_after_ms) == (False, True, 60_000)


async def _debits_at(store: RedisQuotaStore, tenant: str, scores: list[int]) -> None:
    """Log 1-token debits ``d0``, ``d1``, ... admitted at ``scores`` (ms, Redis's clock)."""
    _, tpm, debits, total, _ = store.keys(tenant)
    ids = {f"d{i}": s for i, s in enumerate(scores)}
    pipe = store.client.pipeline(transaction=False)
    pipe.zadd(tpm, ids)
    pipe.hset(debits, mapping=dict.fromkeys(ids, 1))
    pipe.set(total, len(ids))
    await pipe.execute()


@pytest.mark.parametrize("kind", ["redis", "local"])
async def test_a_tpm_refusal_waits_exactly_for_the_debit_that_frees_the_last_token_needed(redis_store, kind) -> None:
    """10 debits of 1 token, 1 ms apart; TPM 7, one more token asked: 4 must leave, so the
    request fits when the 4th oldest leaves the window: its time + window - now, to the ms
    (``tokens.lua`` and ``reserve.lua``, and the in-process store on its own clock)."""
    lim, w = QuotaLimits(None, 7, None), 60_000
    if kind == "local":
        clock = [0.0]
        local = LocalQuotaStore(clock=lambda: clock[0])
        for i in range(10):
            clock[0] = 100.0 + i
            assert local.reserve_now("t", QuotaLimits(None, 10, None), f"d{i}", 1, w, TTL_MS).admitted
        clock[0] = 500.0
        first, answers = (
            100,
            [(500, local.take_tokens_now("t", lim, "x", 1, w)), (500, local.reserve_now("t", lim, "x", 1, w, 1))],
        )
    else:
        store = redis_store
        for script in (store._tokens, store._reserve):
            await store.client.script_load(script.script)
        first = await _server_ms(store) - 500
        await _debits_at(store, "t", [first + i for i in range(10)])
        answers = [
            await _at_known_ms(store, store._tokens, "t", _tokens_args(lim, "x", 1, w)),
            await _at_known_ms(store, store._reserve, "t", ["x", -1, 7, -1, 1, w, TTL_MS]),
        ]
    for now, r in answers:
        d = r if isinstance(r, QuotaDecision) else _decision(r)
        assert (d.admitted, d.refused, d.used_tokens, d.too_large) == (False, ("tpm",), 10, False)
        assert d.retry_after_ms == first + 3 + w - now


async def test_the_in_process_store_drops_a_debit_and_a_lease_at_their_exact_end() -> None:
    """In-process, on its own clock: a lease whose TTL ends now is neither counted nor renewed, and
    a debit logged exactly one window ago has left it."""
    now = [0.0]
    store = LocalQuotaStore(clock=lambda: now[0])
    lim = QuotaLimits(None, 100, 1)
    assert store.reserve_now("t", lim, "a", 100, 1000, 500).admitted
    now[0] = 500.0
    assert await store.renew("t", ["a"], 500) == 0
    d = store.reserve_now("t", lim, "b", 1, 1000, 500)
    assert (d.refused, d.retry_after_ms) == (("tpm",), 500)
    now[0] = 999.0
    assert store.reserve_now("t", lim, "b", 1, 1000, 500).retry_after_ms == 1
    now[0] = 1000.0
    d = store.reserve_now("t", lim, "b", 100, 1000, 500)
    assert (d.admitted, d.remaining_tokens) == (True, 0)


async def _run_at_guessed_ms(store: RedisQuotaStore, script: Any, prepare: Any, keys_of: Any = None) -> tuple[str, Any]:
    """Run ``script`` where its ``now`` is a millisecond chosen beforehand: each try guesses the ms
    the script will run at, ``prepare(pipe, tenant, guess)`` queues the writes of a tenant of the
    try's own and returns the script's ARGV, and the try counts when the ``TIME`` reads around
    the script read the guess. ``keys_of(tenant)``: the script's KEYS (default: the six of
    every script but ``renew.lua``). Returns that try's ``(tenant, reply)``."""
    keys_of = keys_of or store._script_keys
    await store.client.script_load(script.script)
    last = await _server_ms(store)
    for i in range(300):
        tenant, guess = f"guess-{i}", last + i % 3
        pipe = store.client.pipeline(transaction=False)
        args = prepare(pipe, tenant, guess)
        keys = keys_of(tenant)
        pipe.time()
        pipe.evalsha(script.sha, len(keys), *keys, *args)
        pipe.time()
        *_, before, reply, after = await pipe.execute()
        if _ms(before) == _ms(after) == guess:
            return tenant, reply
        last = _ms(after)
    pytest.fail("no try of the script ran at the millisecond it guessed")


@pytest.mark.parametrize("script", ["begin", "reserve"])
async def test_a_lease_expiring_at_the_scripts_now_no_longer_counts(redis_store, script) -> None:
    """A concurrency lease counts while ``now < expiry``: one expiring exactly at ``now`` frees
    its slot (``max_concurrent`` 3 with two live leases and one expiring now: admitted)."""
    store = redis_store

    def prepare(pipe: Any, tenant: str, guess: int) -> list[Any]:
        pipe.zadd(store.keys(tenant)[4], {"ends-now": guess, "live-1": guess + 1, "live-2": guess + 50})
        if script == "begin":
            return _begin_args(QuotaLimits(None, None, 3), "new", WINDOW_MS, TTL_MS)
        return ["new", -1, -1, 3, 1, WINDOW_MS, TTL_MS]

    _, r = await _run_at_guessed_ms(store, getattr(store, f"_{script}"), prepare)
    d = _decision(r)
    assert (d.admitted, d.refused) == (True, ())


async def test_renewing_a_lease_that_expires_at_the_scripts_now_does_not_bring_it_back(redis_store) -> None:
    """``renew.lua`` extends only leases still live (``now < expiry``): of one expiring exactly at
    ``now`` and one a millisecond later, one is renewed, to exactly ``now + ttl``."""
    store = redis_store

    def prepare(pipe: Any, tenant: str, guess: int) -> list[Any]:
        pipe.zadd(store.keys(tenant)[4], {"ends-now": guess, "live": guess + 1})
        return [TTL_MS, "ends-now", "live"]

    tenant, renewed = await _run_at_guessed_ms(store, store._renew, prepare, lambda tenant: [store.keys(tenant)[4]])
    now = await store.client.zscore(store.keys(tenant)[4], "ends-now")  # left as it was: at now
    assert (renewed, await store.client.zscore(store.keys(tenant)[4], "live")) == (1, now + TTL_MS)


@pytest.mark.parametrize("script", ["begin", "reserve", "tokens"])
async def test_an_admission_sent_again_exactly_one_window_later_is_decided_anew(redis_store, script) -> None:
    """A call whose own entry was logged exactly one window before ``now`` is no re-sent call of a
    request still in the window (admitted again, counted once) but a new one, refused here: the
    window is full (RPM 1, TPM 1) with another request's entry."""
    store = redis_store

    def prepare(pipe: Any, tenant: str, guess: int) -> list[Any]:
        rpm, tpm, debits, total, _ = store.keys(tenant)
        entries = {"again": guess - WINDOW_MS, "other": guess - 1}
        pipe.zadd(rpm, entries)
        pipe.zadd(tpm, entries)
        pipe.hset(debits, mapping=dict.fromkeys(entries, 1))
        pipe.set(total, 2)
        if script == "begin":
            return _begin_args(QuotaLimits(1, None, None), "again", WINDOW_MS, TTL_MS)
        if script == "tokens":
            return _tokens_args(QuotaLimits(None, 1, None), "again", 1, WINDOW_MS)
        return ["again", 1, 1, -1, 1, WINDOW_MS, TTL_MS]

    _, r = await _run_at_guessed_ms(store, getattr(store, f"_{script}"), prepare)
    d = _decision(r)
    refused = {"begin": ("rpm",), "tokens": ("tpm",), "reserve": ("rpm", "tpm")}[script]
    assert (d.admitted, d.refused, d.retry_after_ms) == (False, refused, WINDOW_MS - 1)


@pytest.mark.parametrize("call", ["reserve", "take_tokens"])
async def test_a_resent_token_debit_answers_the_tokens_remaining_as_of_now(redis_store, call) -> None:
    """A debit sent again (its reply was lost) is admitted without a second debit, and answers what
    the window has left now, its own debit and those made since counted once each."""
    store, lim = redis_store, QuotaLimits(None, 1000, None)

    async def debit(lease_id: str, tokens: int) -> QuotaDecision:
        if call == "reserve":
            return await store.reserve("t", lim, lease_id, tokens, 60_000, TTL_MS)
        return await store.take_tokens("t", lim, lease_id, tokens, 60_000)

    assert [(await debit(i, n)).remaining_tokens for i, n in (("a", 300), ("b", 200))] == [700, 500]
    d = await debit("a", 300)
    assert (d.admitted, d.remaining_tokens) == (True, 500)
    assert int(await store.client.get(store.keys("t")[3])) == 500


async def test_a_settle_at_the_window_edge_charges_its_overage_as_a_new_debit(redis_store) -> None:
    """A settle whose debit was logged exactly one window before ``now`` finds it gone from the
    window: usage above the reservation (70 of 60) is charged as a debit of its own, now (the
    old one is not corrected in place, where it would leave the window at once)."""
    store = redis_store

    def prepare(pipe: Any, tenant: str, guess: int) -> list[Any]:
        _, tpm, debits, total, _ = store.keys(tenant)
        pipe.zadd(tpm, {"a": guess - WINDOW_MS})
        pipe.hset(debits, "a", 60)
        pipe.set(total, 60)
        return ["a", 70, 60, WINDOW_MS, "1", 240_000]  # settle.lua's ARGV

    tenant, charged = await _run_at_guessed_ms(store, store._settle, prepare)
    assert (charged, await store.client.hgetall(store.keys(tenant)[2])) == (10, {b"a": b"60", b"a:x": b"10"})


async def test_a_sum_rebuilt_after_it_was_lost_counts_the_window_exactly(redis_store) -> None:
    """The TPM sum key lost (evicted) while its debits stay: the script rebuilds it from the debits
    in the window, and one logged exactly one window before ``now`` is not among them."""
    store = redis_store

    def prepare(pipe: Any, tenant: str, guess: int) -> list[Any]:
        _, tpm, debits, _, _ = store.keys(tenant)
        pipe.zadd(tpm, {"edge": guess - WINDOW_MS, "in": guess - 1})
        pipe.hset(debits, mapping={"edge": 5, "in": 3})
        return _tokens_args(QuotaLimits(None, 10, None), "big", 11, WINDOW_MS)

    _, r = await _run_at_guessed_ms(store, store._tokens, prepare)
    d = _decision(r)
    assert (d.refused, d.too_large, d.used_tokens, d.remaining_tokens) == (("tpm",), True, 3, 7)


async def test_a_settle_of_exactly_the_reservation_remembers_nothing(redis_store) -> None:
    """Only a settle above its reservation leaves its lease id in the ended set (so that one sent
    again charges nothing more); one of exactly the reservation writes no ended key."""
    store, lim = redis_store, QuotaLimits(None, 100, None)
    assert (await store.reserve("t", lim, "a", 40, 60_000, TTL_MS)).admitted
    await store.settle("t", lim, "a", 40, 40, 60_000)
    assert await store.client.exists(store.ended_key("t")) == 0
    await store.settle("t", lim, "a", 41, 40, 60_000)
    assert await store.client.zrange(store.ended_key("t"), 0, -1) == [b"a"]


async def test_cancel_counts_each_request_undone_once_and_takes_back_its_tokens(redis_store) -> None:
    """``cancel.lua`` returns how many requests it undid, one with only a lease included, and takes
    the undone debit out of the TPM sum, leaving the others' tokens counted."""
    store = redis_store
    assert (await store.begin("t", QuotaLimits(None, None, 5), "lease-only", 60_000, TTL_MS)).admitted
    assert await store.cancel("t", ["lease-only", "unknown"]) == 1
    # the tombstones live ended_ms (the key a second longer), never without an expiry
    assert store.ended_ms < await store.client.pttl(store.ended_key("t")) <= store.ended_ms + 1000
    lim = QuotaLimits(None, 100, None)
    assert (await store.reserve("t", lim, "a", 60, 60_000, TTL_MS)).admitted
    assert (await store.reserve("t", lim, "b", 30, 60_000, TTL_MS)).admitted
    assert await store.cancel("t", ["a"]) == 1
    assert int(await store.client.get(store.keys("t")[3])) == 30
    d = await store.reserve("t", lim, "c", 70, 60_000, TTL_MS)
    assert (d.admitted, d.remaining_tokens) == (True, 0)


async def test_renewing_a_lease_extends_its_key_as_long_as_the_lease(redis_store) -> None:
    """A lease renewed for longer than it was taken for keeps its key at least that long (the
    key's own expiry must never drop a live lease)."""
    store = redis_store
    assert (await store.begin("t", QuotaLimits(None, None, 2), "a", 60_000, 1000)).admitted
    assert await store.renew("t", ["a"], TTL_MS) == 1
    assert TTL_MS < await store.client.pttl(store.keys("t")[4]) <= TTL_MS + 1000


class _Down:
    """A shared store that never answers (the stage then takes its failure policy)."""

    name = "down"

    def scope(self, tenant_id: str) -> None:
        return None

    async def aclose(self) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        async def unavailable(*args: Any, **kwargs: Any) -> Any:
            raise QuotaStoreUnavailable("down")

        return unavailable


async def test_a_request_of_the_whole_tpm_refused_by_the_fallbacks_share_may_retry() -> None:
    """While Redis is down each of 2 processes enforces half the TPM: a request of exactly the
    tenant's whole TPM is refused by that share, but fits once Redis answers, so its 429 says when
    to retry rather than "Request too large"."""
    stage = TenantQuotas(QuotaSettings(replicas=2), _Down(), fallback=LocalQuotaStore())
    tenant = TenantConfig(id="t", tpm=100)
    with pytest.raises(OpenAIError) as e:
        await stage.reserve(tenant, 100, "r")
    assert (e.value.status, e.value.headers) == (
        429,
        {"Retry-After": "60", "x-ratelimit-limit-tokens": "50", "x-ratelimit-remaining-tokens": "50"},
    )
    assert e.value.message.startswith("Rate limit reached for tenant 't' on tokens per 60s window (TPM): Limit 50")
    await stage.aclose()


async def test_retry_after_is_the_wait_in_whole_seconds_rounded_up() -> None:
    """A refusal whose window admits the request again in 1001 ms says ``Retry-After: 2`` (and
    "try again in 2s"): never a second too early."""
    clock = [0.0]
    store = LocalQuotaStore(clock=lambda: clock[0])
    stage = TenantQuotas(QuotaSettings(window_seconds=60), store, fallback=store)
    tenant = TenantConfig(id="t", rpm=1)
    await stage.settle(await stage.reserve(tenant, 1, "a"), 1)
    clock[0] = 58_999.0
    with pytest.raises(OpenAIError) as e:
        await stage.reserve(tenant, 1, "b")
    assert (e.value.headers["Retry-After"], e.value.message.endswith("Please try again in 2s.")) == ("2", True)
    await stage.aclose()


class _Hanging(_Down):
    """A shared store whose calls never return."""

    def __getattr__(self, name: str) -> Any:
        async def hang(*args: Any, **kwargs: Any) -> Any:
            await asyncio.Event().wait()

        return hang


@pytest.mark.parametrize(("timeout", "deadline"), [(0.1, "0.25"), (0.5, "0.9")])
async def test_a_store_that_never_answers_is_given_up_on_after_twice_its_timeout_plus_50ms(
    timeout: float, deadline: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The decision deadline is ``2 x redis_timeout_seconds + 0.05 s``, at most 0.9 s: past it the
    stage fails closed (503) and says how long it waited."""
    stage = TenantQuotas(QuotaSettings(redis_timeout_seconds=timeout), _Hanging())
    started = time.monotonic()
    with pytest.raises(OpenAIError) as e:
        await stage.reserve(TenantConfig(id="t", rpm=1), 1, "r")
    elapsed = time.monotonic() - started
    assert (e.value.status, e.value.code) == (503, "quota_backend_unavailable")
    assert float(deadline) <= elapsed < float(deadline) + 2.0  # not a timing test: it gave up, not hung
    assert f"quota store down unavailable (no answer within {deadline}s)" in caplog.text
    await stage.aclose()


async def test_the_stage_keeps_tombstones_for_two_of_the_longer_of_window_and_lease_ttl(redis_store) -> None:
    """Over Redis, the stage has a cancelled lease id remembered for 2 x max(window, lease TTL): a
    reservation of it that reaches Redis that late still changes nothing."""
    stage = TenantQuotas(QuotaSettings(window_seconds=300, lease_ttl_seconds=120), redis_store)
    assert await redis_store.cancel("t", ["late"]) == 0
    assert 600_000 < await redis_store.client.pttl(redis_store.ended_key("t")) <= 601_000
    await stage.aclose()


async def test_only_a_call_that_failed_is_left_to_undo_not_one_the_fallback_decided_alone() -> None:
    """Under ``local_fallback``: a reservation whose call failed may have run in Redis and is queued
    to be undone there; the next ones, decided by the fallback without a call while the store
    backs off, never reached Redis and queue nothing."""
    stage = TenantQuotas(QuotaSettings(replicas=2), _Down(), fallback=LocalQuotaStore())
    tenant = TenantConfig(id="t", rpm=10, max_concurrent=10)
    failed = await stage.reserve(tenant, 1, "r1")
    await stage.reserve(tenant, 1, "r2")
    await stage.begin(tenant, "r3")
    assert list(stage._uncertain) == [("t", failed.state.lease_id, False)]
    await stage.aclose()


async def test_the_fallbacks_leases_are_renewed_and_released_while_the_store_is_down() -> None:
    """Leases the fallback holds while Redis is down are the fallback's to renew and release at
    once: a settled one frees its slot for the next request (``max_concurrent`` 2 over 2
    processes: 1 each), a live one is renewed."""
    stage = TenantQuotas(QuotaSettings(replicas=2), _Down(), fallback=LocalQuotaStore())
    tenant = TenantConfig(id="t", max_concurrent=2)
    await stage.settle(await stage.reserve(tenant, 1, "r1"), 1)
    lease = await stage.reserve(tenant, 1, "r2")
    assert await stage.renew_now() == 1
    await stage.settle(lease, 1)
    await stage.aclose()


async def test_a_tenant_without_tpm_takes_its_tokens_step_without_a_store_call() -> None:
    """The token step of a tenant with no TPM limit debits nothing and refuses nothing: the lease
    records the tokens, and the headers keep only the requests pair."""
    store = LocalQuotaStore()
    stage = TenantQuotas(QuotaSettings(), store, fallback=store)
    for tenant in (TenantConfig(id="rpm-only", rpm=1), TenantConfig(id="unlimited")):
        lease = await stage.begin(tenant, "r")
        await stage.reserve_tokens(tenant, lease, 10**9)
        expected = {"x-ratelimit-limit-requests": "1", "x-ratelimit-remaining-requests": "0"} if tenant.rpm else {}
        assert (lease.reserved_tokens, lease.headers) == (10**9, expected)
        await stage.settle(lease, 10**9)
    assert store._tenants["rpm-only"].tpm_sum == 0
    await stage.aclose()
