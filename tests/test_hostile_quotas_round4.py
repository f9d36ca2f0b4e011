"""Hostile review of the quota stage, round 4: tenants alone and two together, and an engine that
lies. A caller cancelled at every point of admission (each reservation undone or settled exactly
once), the same tenant from two stores at the window's boundary, rate-limit headers under
concurrency, tenants whose ids differ only in case or a trailing dot, limits lowered while
requests are in flight, a settle far above any count, a Redis busy longer than the round-trip
bound, and clients that never read the streams filling their tenant's concurrency. Against the
real Redis on 127.0.0.1:6379 (a key prefix per test), or a redis-server of the test's own where
the test blocks it."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import time
import uuid
from typing import Any

import httpx
import pytest
import redis
import redis.asyncio as aioredis

from config.errors import OpenAIError
from config.models import QuotaSettings, TenantConfig
from gateway.edge.protocol import EdgeState
from gateway.quotas.stores import QuotaLimits, RedisQuotaStore
from gateway.quotas.tenant_quotas import TenantQuotas, redis_client_from_url, refusal_error
from tests.fixtures.redis_keys import REDIS_URL
from tests.gateway_harness import KEY_A, Gateway, chat, settings_for, tenants, upstream
from tests.mock_engine import MockEngine
from tests.quota_fixtures import SpareRedis, recovered, spare_redis  # noqa: F401
from tests.test_faults_slow_clients import SEND_LIMITS, Produced, _head, _request, _wait
from tests.test_hostile_edge import LIMITS, EdgeServer

pytestmark = pytest.mark.timeout(60)


def _tenant(**kw: Any) -> TenantConfig:
    return TenantConfig(id=f"r4-{uuid.uuid4().hex[:8]}", **kw)


def _stage(prefix: str, url: str = REDIS_URL, **settings: Any) -> TenantQuotas:
    store = RedisQuotaStore(redis_client_from_url(url, 0.25), prefix=prefix)
    return TenantQuotas(QuotaSettings(**settings), store)


async def _state(store: RedisQuotaStore, tenant_id: str, url: str = REDIS_URL) -> dict[str, Any]:
    """The tenant's keys as Redis holds them (read on a client of its own)."""
    r = aioredis.from_url(url)
    try:
        rpm, tpm, debits, total, leases = store.keys(tenant_id)
        raw = await r.get(total)
        return {
            "rpm": int(await r.zcard(rpm)),
            "tpm": int(await r.zcard(tpm)),
            "debits": sorted(int(v) for v in await r.hvals(debits)),
            "sum": None if raw is None else int(raw),
            "leases": int(await r.zcard(leases)),
        }
    finally:
        await r.aclose()


# ---------------------------------------------------------------- 1. cancelled at every await point
async def _two_steps(stage: TenantQuotas, tenant: TenantConfig, tokens: int) -> Any:
    """What admission does on the two-step path (``gateway/admission/admit.py`` ``admit``): begin,
    then the tokens, the lease settled at 0 by whatever ends the request meanwhile."""
    lease = await stage.begin(tenant, "r")
    try:
        await stage.reserve_tokens(tenant, lease, tokens)
    except BaseException:
        await stage.settle(lease, 0)
        raise
    return lease


async def _one_step(stage: TenantQuotas, tenant: TenantConfig, tokens: int) -> Any:
    return await stage.begin_reserve(tenant, "r", tokens)


@pytest.mark.parametrize("path", ["two_steps", "one_step"])
async def test_a_caller_cancelled_at_any_point_leaves_no_lease_and_no_tokens(redis_prefix, path) -> None:
    """A tenant whose client leaves at every moment of admission: each attempt is cancelled after
    a different number of loop turns (0 to 60, then at random times within a round trip). Whatever
    the moment, once the stage's background round is done Redis holds no lease, no token debit
    and no TPM sum above zero, the stage holds no lease to renew, and RPM counts at most one
    entry per attempt (an entry kept only for a request begun and released, never one undone
    twice or lost from the count of its tenant's other requests)."""
    stage = _stage(redis_prefix)
    tenant = _tenant(rpm=10_000, tpm=10_000_000, max_concurrent=10_000)
    run = _two_steps if path == "two_steps" else _one_step
    finished = 0
    rng = random.Random(4)
    attempts = [("turns", k) for k in range(61)] + [("sleep", rng.uniform(0, 0.004)) for _ in range(40)]
    try:
        for kind, amount in attempts:
            task = asyncio.ensure_future(run(stage, tenant, 100))
            if kind == "turns":
                for _ in range(int(amount)):
                    await asyncio.sleep(0)
            else:
                await asyncio.sleep(amount)
            task.cancel()
            out = (await asyncio.gather(task, return_exceptions=True))[0]
            if not isinstance(out, BaseException):  # it won the race: its request ran, settled at 30
                finished += 1
                await stage.settle(out, 30)
            else:
                assert isinstance(out, asyncio.CancelledError), out
        await recovered(stage)
        await asyncio.sleep(0.05)  # a settle's coalesced round trip
        state = await _state(stage.store, tenant.id)  # type: ignore[arg-type]
        assert state["leases"] == 0, state
        assert stage._live == {}
        assert state["sum"] in (None, 30 * finished), (state, finished)
        assert sum(state["debits"]) == 30 * finished, (state, finished)
        assert state["rpm"] <= len(attempts)
    finally:
        await stage.aclose()


# ---------------------------------------------------------------- 2. two replicas, one key
async def test_rpm_is_exact_across_two_stores_at_the_window_boundary(redis_prefix) -> None:
    """The same tenant from two replicas (two stores, two connections): RPM 3 in a 1 s window, the
    three admissions 40 ms apart. A fourth is refused from either replica until the first
    admission leaves the window, at the ``Retry-After`` the refusal named (exact, in ms); then
    exactly one of two simultaneous requests from the two replicas is admitted, not two: the
    second admission is still in the window."""
    a = RedisQuotaStore(redis_client_from_url(REDIS_URL, 0.5), prefix=redis_prefix)
    b = RedisQuotaStore(redis_client_from_url(REDIS_URL, 0.5), prefix=redis_prefix)
    lim = QuotaLimits(3, None, None)
    t = f"r4-{uuid.uuid4().hex[:8]}"
    try:
        got = []
        for i, s in enumerate((a, b, a)):
            got.append(await s.begin(t, lim, f"l{i}", 1000, 120_000))
            await asyncio.sleep(0.04)
        assert [(d.admitted, d.remaining_requests) for d in got] == [(True, 2), (True, 1), (True, 0)]
        t0 = time.monotonic()
        refused = await b.begin(t, lim, "l3", 1000, 120_000)
        assert (refused.admitted, refused.refused, refused.remaining_requests) == (False, ("rpm",), 0)
        assert 800 <= refused.retry_after_ms <= 1000 - 80, refused
        await asyncio.sleep(max(0.0, refused.retry_after_ms / 1000 - 0.03 - (time.monotonic() - t0)))
        early = await asyncio.gather(a.begin(t, lim, "e1", 1000, 120_000), b.begin(t, lim, "e2", 1000, 120_000))
        assert [d.admitted for d in early] == [False, False]
        await asyncio.sleep(max(0.0, refused.retry_after_ms / 1000 + 0.005 - (time.monotonic() - t0)))
        both = await asyncio.gather(a.begin(t, lim, "x1", 1000, 120_000), b.begin(t, lim, "x2", 1000, 120_000))
        assert sorted(d.admitted for d in both) == [False, True], both
        assert sorted(d.remaining_requests for d in both) == [0, 0]
    finally:
        await a.aclose()
        await b.aclose()


async def test_rate_limit_headers_are_exact_under_concurrency_across_two_replicas(redis_prefix) -> None:
    """20 requests of one tenant at once, 10 through each of two replicas' stages, RPM 10, TPM
    1000 at 100 tokens each: exactly 10 admitted, their ``x-ratelimit-remaining-requests`` 9 down
    to 0 and ``-tokens`` 900 down to 0, each value once (every admission saw the ones before it
    and no other); the 10 refused say ``Used 10`` and remaining 0."""
    one, two = _stage(redis_prefix), _stage(redis_prefix)
    tenant = _tenant(rpm=10, tpm=1000)
    try:
        outs = await asyncio.gather(
            *(s.begin_reserve(tenant, f"r{i}", 100) for i, s in enumerate([one, two] * 10)), return_exceptions=True
        )
        ok = [o for o in outs if not isinstance(o, BaseException)]
        refused = [o for o in outs if isinstance(o, OpenAIError)]
        assert (len(ok), len(refused)) == (10, 10), outs
        assert sorted(int(o.headers["x-ratelimit-remaining-requests"]) for o in ok) == list(range(10))
        assert sorted(int(o.headers["x-ratelimit-remaining-tokens"]) for o in ok) == list(range(0, 1000, 100))
        assert {o.headers["x-ratelimit-limit-requests"] for o in ok} == {"10"}
        for e in refused:
            assert e.status == 429 and e.headers["x-ratelimit-remaining-requests"] == "0", e.headers
            assert "(RPM): Limit 10, Used 10, Requested 1." in e.message, e.message
        for lease in ok:
            await (one if ok.index(lease) % 2 else two).settle(lease, 0)
    finally:
        await one.aclose()
        await two.aclose()


# ---------------------------------------------------------------- 3. ids that look alike
async def test_tenants_whose_ids_differ_in_case_or_a_trailing_dot_never_share_a_limit(redis_prefix) -> None:
    """``Acme``, ``acme`` and ``acme.`` are three tenants (ids are compared as written): each has
    its own RPM 1 and concurrency 1 in Redis, under keys of its own, each key carrying its own id
    as the hash tag."""
    stage = _stage(redis_prefix)
    ids = [f"Acme{uuid.uuid4().hex[:4]}"]
    ids += [ids[0].lower(), ids[0].lower() + "."]
    tenants = [TenantConfig(id=i, rpm=1, max_concurrent=1) for i in ids]
    try:
        leases = [await stage.begin(t, "r") for t in tenants]
        assert [lease.headers["x-ratelimit-remaining-requests"] for lease in leases] == ["0", "0", "0"]
        for t in tenants:
            with pytest.raises(OpenAIError) as e:
                await stage.begin(t, "r")
            assert e.value.status == 429
            assert e.value.message.startswith(f"Rate limit reached for tenant '{t.id}' on requests per 60s window")
        store = stage.store
        assert isinstance(store, RedisQuotaStore)
        keys = [store.keys(i)[0] for i in ids]
        assert keys == [f"{redis_prefix}:{{{i}}}:rpm" for i in ids] and len(set(keys)) == 3
        for i in ids:
            assert (await _state(store, i))["leases"] == 1
        for lease in leases:
            await stage.settle(lease, 0)
    finally:
        await stage.aclose()


# ---------------------------------------------------------------- 4. limits changed in flight
async def test_limits_lowered_while_requests_are_in_flight_apply_to_the_next_request(redis_prefix) -> None:
    """Three requests in flight (concurrency 3, TPM 1000, 300 tokens each); a reload lowers the
    tenant to concurrency 1 and TPM 500. The next request is refused for both (the in-flight ones
    count against the new limits), the in-flight ones settle against what they reserved (no
    double count: the sum is exactly their usage), and once they ended the next is admitted."""
    stage = _stage(redis_prefix)
    old = _tenant(rpm=100, tpm=1000, max_concurrent=3)
    new = old.model_copy(update={"tpm": 500, "max_concurrent": 1})
    try:
        held = [await stage.begin_reserve(old, f"r{i}", 300) for i in range(3)]
        with pytest.raises(OpenAIError) as e:
            await stage.begin_reserve(new, "n", 10)
        assert e.value.status == 429
        assert "concurrent requests: Limit 1" in e.value.message, e.value.message
        wide = new.model_copy(update={"max_concurrent": 5})  # the TPM alone
        with pytest.raises(OpenAIError) as e:
            await stage.begin_reserve(wide, "w", 10)
        # the 429 says what the tenant used (900), not the new limit (it said "Used 500")
        assert "(TPM): Limit 500, Used 900, Requested 10." in e.value.message, e.value.message
        assert e.value.headers["x-ratelimit-remaining-tokens"] == "0"
        for lease in held:
            await stage.settle(lease, 50)
        await asyncio.sleep(0.05)
        state = await _state(stage.store, old.id)  # type: ignore[arg-type]
        assert (state["leases"], state["sum"], state["debits"]) == (0, 150, [50, 50, 50]), state
        lease = await stage.begin_reserve(new, "n2", 350)
        assert lease.headers["x-ratelimit-limit-tokens"] == "500"
        assert lease.headers["x-ratelimit-remaining-tokens"] == "0"
        with pytest.raises(OpenAIError) as e:
            await stage.begin_reserve(new, "n3", 1)
        assert e.value.message.endswith("on concurrent requests: Limit 1. Please try again in 1s."), e.value.message
        with pytest.raises(OpenAIError) as e:
            await stage.begin_reserve(wide, "n4", 1)
        assert "(TPM): Limit 500, Used 500, Requested 1." in e.value.message, e.value.message
        # six RPM entries: the three, "w" and "n4" (begun, then refused for tokens) and "n2"
        narrow = new.model_copy(update={"rpm": 2, "max_concurrent": None})
        with pytest.raises(OpenAIError) as e:
            await stage.begin(narrow, "n5")
        assert "(RPM): Limit 2, Used 6, Requested 1." in e.value.message, e.value.message
        assert e.value.headers["x-ratelimit-remaining-requests"] == "0"
        await stage.settle(lease, 350)
    finally:
        await stage.aclose()


# ---------------------------------------------------------------- 5. an engine that lies
async def test_a_settle_far_above_any_count_is_charged_as_an_exact_integer(redis_prefix) -> None:
    """A usage of 10^17 tokens reaches the settle (an engine's lie the relay let through; the
    relay bounds counts, docs/quotas.md, but the stage is the last place that can): Redis must
    still hold integers. Before, ``settle.lua`` stored the debit as ``1e+17`` (a Lua float
    written back as text) and added a delta rounded to a double, so the sum and the debits
    disagreed; the charge is now capped at 2^53 - 1, what the scripts count exactly, and the
    lease is released."""
    stage = _stage(redis_prefix)
    tenant = _tenant(rpm=100, tpm=1000, max_concurrent=2)
    r = aioredis.from_url(REDIS_URL)
    try:
        lease = await stage.begin_reserve(tenant, "r", 100)
        await stage.settle(lease, 10**17)
        await asyncio.sleep(0.05)
        store = stage.store
        assert isinstance(store, RedisQuotaStore)
        _, _, debits, total, leases = store.keys(tenant.id)
        assert list((await r.hgetall(debits)).values()) == [str(2**53 - 1).encode()]
        assert await r.get(total) == str(2**53 - 1).encode()
        assert await r.zcard(leases) == 0
        with pytest.raises(OpenAIError) as e:
            await stage.begin_reserve(tenant, "r2", 1)
        assert e.value.status == 429 and "(TPM): Limit 1000, Used 9007199254740991, Requested 1." in e.value.message
    finally:
        await r.aclose()
        await stage.aclose()


# ---------------------------------------------------------------- 6. Redis busier than the bound
async def test_a_begin_redis_runs_after_the_gateway_gave_up_leaves_no_lease(spare_redis: SpareRedis) -> None:  # noqa: F811
    """Another client's script holds Redis 1 s, longer than the round-trip bound (0.55 s): the
    begin waiting behind it is answered 503 (fail closed) and Redis runs it when the script ends.
    The background round then undoes it: no lease holds a slot until its TTL, no RPM entry
    counts, and the next request is admitted with its exact remaining count."""
    stage = _stage(f"r4-{uuid.uuid4().hex[:6]}", url=spare_redis.url)
    tenant = _tenant(rpm=5, max_concurrent=1)
    busy = redis.Redis(port=spare_redis.port)
    try:
        await stage.start()
        spin = "local t = redis.call('TIME') local s = t[1] * 1e6 + t[2] " + (
            "repeat t = redis.call('TIME') until t[1] * 1e6 + t[2] - s > 1000000 return 1"
        )
        blocker = asyncio.ensure_future(asyncio.to_thread(busy.eval, spin, 0))
        await asyncio.sleep(0.1)
        t0 = time.monotonic()
        with pytest.raises(OpenAIError) as e:
            await stage.begin(tenant, "r")
        assert e.value.status == 503 and e.value.code == "quota_backend_unavailable"
        assert time.monotonic() - t0 < 0.9
        assert await blocker == 1
        await asyncio.sleep(0.6)  # past the back-off
        await recovered(stage)
        state = await _state(stage.store, tenant.id, spare_redis.url)  # type: ignore[arg-type]
        assert (state["rpm"], state["leases"]) == (0, 0), state
        lease = await stage.begin(tenant, "r2")
        assert lease.headers["x-ratelimit-remaining-requests"] == "4"
        await stage.settle(lease, 0)
    finally:
        busy.close()
        await stage.aclose()


# ---------------------------------------------------------------- 7. streams nobody reads
def test_streams_a_tenant_never_reads_free_its_concurrency_when_the_send_timeout_cuts_them(redis_prefix) -> None:
    """A tenant with ``max_concurrent: 2`` (in Redis) fills both slots with streams whose client
    never reads a byte. A third request is refused (429, concurrency) meanwhile; once the edge's
    send timeout (1 s) cuts both connections, both leases are released in Redis and in the stage
    (nothing left to renew), and the tenant's next request is answered 200. (The send-timeout
    tests of ``test_faults_slow_clients.py`` ran a tenant without a concurrency limit, so no
    lease was there to check.)"""
    engine = MockEngine().start()
    stage = _stage(redis_prefix)
    settings = settings_for([upstream("u1", engine)], gateway={"max_body_bytes": 64 * 1024})
    gw = Gateway(settings, tenants(rpm=100, max_concurrent=2), quotas=stage)
    edge = EdgeServer(gw.app, SEND_LIMITS).__enter__()
    state: EdgeState = edge.server.config.kvgate_edge_state
    r = redis.Redis.from_url(REDIS_URL)
    leases_key = stage.store.keys("tenant-a")[4]  # type: ignore[attr-defined]
    sockets: list[socket.socket] = []
    try:
        engine.state.stream_chunks = Produced(state)  # type: ignore[assignment]
        engine.state.chunk_interval_seconds = 0.005
        for _ in range(2):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1)
            s.settimeout(10)
            s.connect(("127.0.0.1", edge.port))
            sockets.append(s)
        conns_ready = _wait(lambda: len(edge.server.server_state.connections) == 2, 3.0)
        assert conns_ready
        for conn in edge.server.server_state.connections:
            conn.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        for s in sockets:
            s.sendall(_request(chat(max_tokens=3000, stream=True)))  # and never reads
        assert _wait(lambda: r.zcard(leases_key) == 2, 5.0), r.zcard(leases_key)
        client = httpx.Client(base_url=f"http://127.0.0.1:{edge.port}", headers={"authorization": f"Bearer {KEY_A}"})
        third = client.post("/v1/chat/completions", json=chat(max_tokens=2))
        assert third.status_code == 429, third.text
        assert third.json()["error"]["message"] == (
            "Rate limit reached for tenant 'tenant-a' on concurrent requests: Limit 2. Please try again in 1s."
        )
        assert _wait(lambda: state.send_timeouts == 2, SEND_LIMITS.send_timeout_seconds + 8.0), state.send_timeouts
        assert _wait(lambda: r.zcard(leases_key) == 0, 3.0), r.zcard(leases_key)
        assert stage._live == {}
        engine.state.stream_chunks = None  # type: ignore[assignment]
        after = client.post("/v1/chat/completions", json=chat(max_tokens=2))
        assert after.status_code == 200, after.text
        assert json.loads(after.text)["object"] == "chat.completion"
        client.close()
    finally:
        for s in sockets:
            s.close()
        r.close()
        edge.__exit__(None, None, None)
        engine.stop()


# ---------------------------------------------------------------- 8. the client gone mid-admission
class _PausingStore(RedisQuotaStore):
    """A store whose ``pause_in`` call waits 0.3 s after Redis answered it (Redis made the
    reservation), so that a test can cut the client's connection at that moment."""

    pause_in = ""
    paused = 0

    async def _paused(self, name: str, result: Any) -> Any:
        if name == self.pause_in:
            self.paused += 1
            await asyncio.sleep(0.3)
        return result

    async def begin(self, *a: Any, **kw: Any) -> Any:
        return await self._paused("begin", await super().begin(*a, **kw))

    async def begin_tokens(self, *a: Any, **kw: Any) -> Any:
        return await self._paused("begin_tokens", await super().begin_tokens(*a, **kw))

    async def take_tokens(self, *a: Any, **kw: Any) -> Any:
        return await self._paused("take_tokens", await super().take_tokens(*a, **kw))


@pytest.mark.parametrize("pause_in", ["begin", "take_tokens", "begin_tokens"])
@pytest.mark.parametrize("reset", [False, True])
def test_a_client_gone_during_each_quota_call_of_admission_leaves_no_lease(redis_prefix, pause_in, reset) -> None:
    """The real app behind the edge; the client closes (or resets) its connection while a quota
    call of its admission is out: ``begin`` (the body sent apart from the head: two steps),
    ``take_tokens`` (the token step of those two) or ``begin_tokens`` (head and body in one
    write: one step). Whatever the moment, the request's lease is released in Redis and in the
    stage, its RPM entry counts once, and its TPM debit is what docs/quotas.md charges a request
    that never reached an engine: nothing."""
    engine = MockEngine().start()
    store = _PausingStore(redis_client_from_url(REDIS_URL, 0.25), prefix=redis_prefix)
    store.pause_in = pause_in
    stage = TenantQuotas(QuotaSettings(), store)
    settings = settings_for([upstream("u1", engine)], gateway={"max_body_bytes": 64 * 1024})
    gw = Gateway(settings, tenants(rpm=100, tpm=100_000, max_concurrent=1), quotas=stage)
    edge = EdgeServer(gw.app, LIMITS).__enter__()
    r = redis.Redis.from_url(REDIS_URL)
    rpm_key, _, debits_key, sum_key, leases_key = store.keys("tenant-a")
    try:
        data = json.dumps(chat(max_tokens=5)).encode()
        s = socket.create_connection(("127.0.0.1", edge.port), timeout=10)
        if pause_in == "begin_tokens":
            s.sendall(_head(KEY_A, len(data)) + data)
        else:
            s.sendall(_head(KEY_A, len(data)))
            time.sleep(0.05)
            s.sendall(data)
        assert _wait(lambda: store.paused == 1, 5.0), store.paused
        if reset:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        s.close()
        done = _wait(lambda: gw.gw.in_flight == 0 and r.zcard(leases_key) == 0 and not stage._live, 5.0)
        assert done, (gw.gw.in_flight, r.zcard(leases_key), stage._live)
        time.sleep(0.1)
        reached = len(engine.state.requests)
        debits = [int(v) for v in r.hvals(debits_key)]
        assert (r.zcard(rpm_key), r.zcard(leases_key)) == (1, 0)
        # the relay saw the client gone before it connected: nothing reached the engine, charged 0
        # (a request begun whose body never came reserved no tokens at all)
        assert (reached, debits) == (0, [] if pause_in == "begin" else [0]), (reached, debits)
        assert int(r.get(sum_key) or 0) == sum(debits)
    finally:
        r.close()
        edge.__exit__(None, None, None)
        engine.stop()


async def test_both_stores_answer_a_lowered_limit_with_what_the_window_holds(quota_store) -> None:
    """Redis and the in-process store give the same refusal after a limit was lowered below the
    window's use: RPM 5 -> 2 with 3 admitted, TPM 1000 -> 100 with 600 debited. The refusal
    tells what the window holds (3 requests, 600 tokens), so the 429 says ``Used 3`` and
    ``Used 600`` (before, it said the new limit: the remaining counts, clamped to 0, were all it
    had); the remaining counts and the headers are 0."""
    t = f"r4-{uuid.uuid4().hex[:8]}"
    for i in range(3):
        assert (await quota_store.begin(t, QuotaLimits(5, None, None), f"b{i}", 60_000, 120_000)).admitted
    d = await quota_store.begin(t, QuotaLimits(2, None, None), "b3", 60_000, 120_000)
    assert (d.admitted, d.refused, d.remaining_requests, d.used_requests) == (False, ("rpm",), 0, 3)
    assert (await quota_store.take_tokens(t, QuotaLimits(None, 1000, None), "b0", 600, 60_000)).admitted
    d = await quota_store.take_tokens(t, QuotaLimits(None, 100, None), "b1", 50, 60_000)
    assert (d.admitted, d.refused, d.remaining_tokens, d.used_tokens, d.too_large) == (False, ("tpm",), 0, 600, False)
    d = await quota_store.take_tokens(t, QuotaLimits(None, 100, None), "b1", 500, 60_000)
    assert (d.refused, d.remaining_tokens, d.used_tokens, d.too_large) == (("tpm",), 0, 600, True)
    d = await quota_store.reserve(t, QuotaLimits(2, 100, None), "r", 50, 60_000, 120_000)
    assert (d.refused, d.remaining_requests, d.remaining_tokens) == (("rpm", "tpm"), 0, 0)
    assert (d.used_requests, d.used_tokens) == (3, 600)
    tenant = TenantConfig(id=t, rpm=2, tpm=100)
    e = refusal_error(tenant, QuotaLimits(2, 100, None), d, 50, 60)
    assert e.message == (
        f"Rate limit reached for tenant '{t}' on requests per 60s window (RPM): Limit 2, Used 3, Requested 1; "
        "tokens per 60s window (TPM): Limit 100, Used 600, Requested 50. Please try again in 60s."
    ), e.message
    assert (e.headers["x-ratelimit-remaining-requests"], e.headers["x-ratelimit-remaining-tokens"]) == ("0", "0")
