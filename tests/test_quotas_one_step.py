"""The request path's two quota steps taken as one (``begin_tokens`` / ``begin_reserve``): for a
small body the server holds whole, the request is counted first and its RPM entry, lease and
tokens are taken in one Redis round trip, ``begin.lua`` then ``tokens.lua`` guarded by the entry
``begin.lua`` left, then the index write guarded by the debit. What lands in Redis must be what
the two steps leave (both stores), a refusal at either script must leave what the two-step path
leaves, and through the real app on the gateway's own server layer every answer must be the one
the two-step path gives (a property over request sequences, compared with the same app on
uvicorn's stock protocol, which goes the two-step way)."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import re
import socket
import time

import hypothesis.strategies as st
import pytest
import redis
from hypothesis import HealthCheck, given, settings

from config.errors import OpenAIError
from config.models import QuotaSettings, TenantConfig, VerifierSettings
from gateway.admission import admit as admit_module
from gateway.edge.extensions import REQUEST_COMPLETE, completion_of, mark_complete_when
from gateway.quotas.stores import LocalQuotaStore, QuotaLimits, RedisQuotaStore
from gateway.quotas.tenant_quotas import TenantQuotas, redis_client_from_url
from tests.fixtures.redis_keys import REDIS_URL, delete_prefix, new_prefix
from tests.gateway_harness import wait_for
from tests.test_admission_round_trip import PROMPT, WARMUP_PROMPT, ex, load_all_scripts
from tests.test_quotas_two_step import TTL_MS, WINDOW_MS, answer


def state(prefix: str, tenant: str) -> tuple[int, int, int, int]:
    """``(rpm entries, leases, tpm sum, debits)`` of ``tenant`` under ``prefix`` in Redis."""
    c = redis.Redis.from_url(REDIS_URL)
    base = f"{prefix}:{{{tenant}}}"
    try:
        return (
            c.zcard(base + ":rpm"),
            c.zcard(base + ":leases"),
            int(c.get(base + ":tpm:sum") or 0),
            c.hlen(base + ":tpm:debits"),
        )
    finally:
        c.close()


async def test_one_step_leaves_what_the_two_steps_leave(quota_store) -> None:
    """Admitted, refused by RPM, refused by concurrency, refused by TPM (too large and over the
    window): the same decisions as ``begin`` then ``take_tokens``, and a refused ``begin``
    debits nothing."""
    lim = QuotaLimits(rpm=3, tpm=100, max_concurrent=1)
    begun, took = await quota_store.begin_tokens("t", lim, "a", 60, WINDOW_MS, TTL_MS)
    assert (answer(begun), answer(took)) == ((True, (), 2, -1, False), (True, (), -1, 40, False))
    begun, took = await quota_store.begin_tokens("t", lim, "b", 10, WINDOW_MS, TTL_MS)  # "a" holds the lease
    assert (answer(begun), begun.retry_after_ms, took) == ((False, ("concurrency",), 2, -1, False), 1000, None)
    await quota_store.settle("t", lim, "a", 60, 60, WINDOW_MS)
    begun, took = await quota_store.begin_tokens("t", lim, "c", 41, WINDOW_MS, TTL_MS)  # 60 + 41 > 100
    assert (answer(begun), answer(took)) == ((True, (), 1, -1, False), (False, ("tpm",), -1, 40, False))
    await quota_store.settle("t", lim, "c", 0, 0, WINDOW_MS)  # what the stage does after a TPM refusal
    begun, took = await quota_store.begin_tokens("t", lim, "d", 101, WINDOW_MS, TTL_MS)
    assert (answer(begun), answer(took)) == ((True, (), 0, -1, False), (False, ("tpm",), -1, 40, True))
    await quota_store.settle("t", lim, "d", 0, 0, WINDOW_MS)
    begun, took = await quota_store.begin_tokens("t", lim, "e", 1, WINDOW_MS, TTL_MS)  # three requests spent
    assert (answer(begun), took) == ((False, ("rpm",), 0, -1, False), None)
    # what is left: 60 tokens of "a", no lease; the refused "e" debited nothing
    assert answer(await quota_store.take_tokens("t", QuotaLimits(None, 100, None), "f", 40, WINDOW_MS))[:4] == (
        True,
        (),
        -1,
        0,
    )


@pytest.mark.parametrize(
    "limits", [QuotaLimits(rpm=1, tpm=100, max_concurrent=None), QuotaLimits(rpm=None, tpm=100, max_concurrent=1)]
)
async def test_a_refused_begin_debits_nothing_in_redis(redis_store, redis_prefix, limits) -> None:
    """``tokens.lua`` runs behind ``begin.lua`` in the same pipeline whatever ``begin.lua``
    answered; it checks the entry ``begin.lua`` leaves (the RPM log, or the leases without an
    RPM limit) and debits nothing for a refused request."""
    assert answer((await redis_store.begin_tokens("t", limits, "a", 30, WINDOW_MS, TTL_MS))[1])[0] is True
    trips = redis_store.round_trips
    begun, took = await redis_store.begin_tokens("t", limits, "b", 30, WINDOW_MS, TTL_MS)
    assert (begun.admitted, took, redis_store.round_trips) == (False, None, trips + 1)
    rpm = 1 if limits.rpm is not None else 0
    assert state(redis_prefix, "t") == (rpm, 1 if limits.max_concurrent else 0, 30, 1)


async def test_without_tpm_only_begin_runs(quota_store) -> None:
    begun, took = await quota_store.begin_tokens("t", QuotaLimits(2, None, None), "a", 10**9, WINDOW_MS, TTL_MS)
    assert (answer(begun), took) == ((True, (), 1, -1, False), None)


async def stage_on(store) -> TenantQuotas:
    return TenantQuotas(QuotaSettings(), store)


async def test_the_stage_answers_as_the_two_steps_do(redis_store, redis_prefix) -> None:
    """``begin_reserve``: the same lease headers as ``begin`` + ``reserve_tokens``; a TPM refusal
    is the same 429 (TPM pair only), its lease released here and its RPM entry spent; an RPM
    refusal is ``begin``'s 429."""
    stage = await stage_on(redis_store)
    one = TenantConfig(id="one", rpm=3, tpm=100, max_concurrent=2)
    two = TenantConfig(id="two", rpm=3, tpm=100, max_concurrent=2)
    lease = await stage.begin_reserve(one, "r1", 60)
    ref = await stage.begin(two, "r1")
    await stage.reserve_tokens(two, ref, 60)
    assert (
        (lease.reserved_tokens, lease.headers)
        == (ref.reserved_tokens, ref.headers)
        == (
            60,
            {
                "x-ratelimit-limit-requests": "3",
                "x-ratelimit-remaining-requests": "2",
                "x-ratelimit-limit-tokens": "100",
                "x-ratelimit-remaining-tokens": "40",
            },
        )
    )
    errors = []
    with pytest.raises(OpenAIError) as e:
        await stage.begin_reserve(one, "r2", 41)
    errors.append(e.value)
    ref = await stage.begin(two, "r2")
    with pytest.raises(OpenAIError) as e:
        await stage.reserve_tokens(two, ref, 41)
    await stage.settle(ref, 0)
    errors.append(e.value)
    assert [(x.status, x.message.replace("'two'", "'one'"), x.headers) for x in errors] == [
        (
            429,
            "Rate limit reached for tenant 'one' on tokens per 60s window (TPM): Limit 100, Used 60, "
            f"Requested 41. Please try again in {errors[0].headers['Retry-After']}s.",
            errors[0].headers,
        )
    ] * 2
    assert errors[0].headers.keys() == {"Retry-After", "x-ratelimit-limit-tokens", "x-ratelimit-remaining-tokens"}
    assert state(redis_prefix, "one") == state(redis_prefix, "two") == (2, 1, 60, 1)
    assert stage.combines(one)  # a TPM refusal: the body had to be counted anyway
    await stage.begin_reserve(one, "r3", 1)
    with pytest.raises(OpenAIError) as e:
        await stage.begin_reserve(one, "r4", 1)
    assert (e.value.status, e.value.message) == (
        429,
        "Rate limit reached for tenant 'one' on requests per 60s window (RPM): Limit 3, Used 3, Requested 1; "
        f"concurrent requests: Limit 2. Please try again in {e.value.headers['Retry-After']}s.",
    )  # "r1" and "r3" hold both leases
    assert state(redis_prefix, "one") == (3, 2, 61, 2)


async def test_after_an_rpm_or_concurrency_refusal_the_tenant_begins_first_until_retry_after(redis_store) -> None:
    """``combines``: a tenant refused for RPM or concurrency has its next requests begun before
    their bodies are read, until that refusal's Retry-After; unlimited tenants and a store in
    back-off never combine."""
    stage = await stage_on(redis_store)
    tenant = TenantConfig(id="c", max_concurrent=1)
    assert stage.combines(tenant) and not stage.combines(TenantConfig(id="free"))
    held = await stage.begin_reserve(tenant, "r1", 5)
    with pytest.raises(OpenAIError) as e:
        await stage.begin_reserve(tenant, "r2", 5)
    assert (e.value.status, e.value.headers["Retry-After"]) == (429, "1")
    assert not stage.combines(tenant)
    until = stage._refused_until[tenant.id]
    assert 0.9 < until - time.monotonic() <= 1.0
    stage._refused_until[tenant.id] = time.monotonic() - 0.001  # its Retry-After has passed
    assert stage.combines(tenant) and tenant.id not in stage._refused_until
    await stage.settle(held, 5)
    stage._backoff.failed(None)
    assert not stage.combines(tenant)


async def test_the_in_process_fallback_decides_both_steps_when_redis_is_down() -> None:
    """A store that does not answer: ``local_fallback`` decides the one step on the fallback,
    with the per-process share of each limit."""
    down = RedisQuotaStore(redis_client_from_url("redis://127.0.0.1:1/0", 0.2), prefix="x")
    stage = TenantQuotas(QuotaSettings(redis_failure_policy="local_fallback"), down, fallback=LocalQuotaStore())
    tenant = TenantConfig(id="f", rpm=2, tpm=100)
    lease = await stage.begin_reserve(tenant, "r1", 30)
    assert lease.headers["x-ratelimit-remaining-requests"] == "1"
    assert lease.headers["x-ratelimit-remaining-tokens"] == "70"
    await stage.aclose()


# ---------------------------------------------------------------- the server's extension
def test_the_extension_is_absent_under_another_server_and_read_when_given() -> None:
    scope: dict = {"type": "http"}
    assert completion_of(scope) is None
    done = [False]
    mark_complete_when(scope, lambda: done[0])
    complete = completion_of(scope)
    assert complete is not None and not complete() and REQUEST_COMPLETE in scope["extensions"]
    done[0] = True
    assert complete()


# ---------------------------------------------------------------- through the real app
@contextlib.contextmanager
def two_apps(prefix: str, verifier: bool = False, **limits):
    """The same app twice over one mock engine, quotas in Redis under a prefix each: on the
    gateway's own server layer (``edge``, which tells the app when a body is whole: the one-step
    path) and on uvicorn's stock protocol (the two-step path). Yields ``((edge app, its stage),
    (stock app, its stage), engine, [verifier services])``."""
    from tests.gateway_harness import SECRETS as APP_SECRETS
    from tests.gateway_harness import Gateway, settings_for, tenants, upstream
    from tests.mock_engine import MockEngine
    from verifier.build import build_verifier

    engine = MockEngine().start()
    base = settings_for([upstream("u1", engine)])
    s = base.model_copy(update={"redis_url": REDIS_URL, "verifier": VerifierSettings(enabled=verifier)})
    apps, services = [], []
    for name, edge in (("edge", True), ("stock", False)):
        quotas = TenantQuotas(
            QuotaSettings(), RedisQuotaStore(redis_client_from_url(REDIS_URL, 0.5), prefix=f"{prefix}:{name}")
        )
        svc = build_verifier(s, secrets=APP_SECRETS, key_prefix=f"{prefix}:{name}:v:") if verifier else None
        extra = {"verifier": svc} if svc is not None else {}
        apps.append((Gateway(s, tenants(**limits), quotas=quotas, edge=edge, **extra).start(), quotas))
        services.append(svc)
    load_all_scripts()
    try:
        yield apps[0], apps[1], engine, services
    finally:
        for g, _ in apps:
            g.stop()
        engine.stop()


class Answer:
    """A response read by :func:`post`: ``status_code``, ``headers`` (lower-case names), ``json()``."""

    def __init__(self, r: http.client.HTTPResponse) -> None:
        self.status_code = r.status
        self.headers = {k.lower(): v for k, v in r.getheaders()}
        self.body = r.read()

    def json(self):
        return json.loads(self.body)


def post(port: int, body: dict | bytes, key: str = "sk-test-tenant-a") -> Answer:
    """POST a chat on a new connection, its head and body in one write (one ``sendall``), so the
    server holds the whole request when it starts it. (``http.client`` and httpx write the head
    and the body apart; whether both are in by then is a race.)"""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\nauthorization: Bearer {key}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(raw)}\r\nconnection: close\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head + raw)
        r = http.client.HTTPResponse(sock)
        r.begin()
        return Answer(r)


@pytest.fixture
def order(monkeypatch):
    """What admission did first for each request: ``read`` (the body) or ``begin`` (step 1's
    quota call alone)."""
    seen: list[str] = []
    real_read, real_begin = admit_module.read_request, admit_module._begin

    async def read(*a, **kw):
        seen.append("read")
        return await real_read(*a, **kw)

    async def begin(*a, **kw):
        seen.append("begin")
        return await real_begin(*a, **kw)

    monkeypatch.setattr(admit_module, "read_request", read)
    monkeypatch.setattr(admit_module, "_begin", begin)
    return seen


def test_through_the_edge_a_chat_makes_one_round_trip_before_it_is_forwarded(redis_prefix, order):
    """On the gateway's own server layer a chat is counted first, then its RPM entry, lease,
    tokens and index write go in one round trip (two with the settle; the stock server's path
    makes three); after an RPM refusal the tenant's next request is begun before its body is
    read, and neither refused prompt is indexed."""
    from tests.gateway_harness import chat

    with two_apps(redis_prefix, verifier=True, rpm=1, tpm=10_000) as ((edge, quotas), _, engine, (svc, _)):
        if True:
            trips = quotas.store.round_trips
            r = post(edge.port, chat(PROMPT))
            assert r.status_code == 200, r.body
            wait_for(lambda: quotas.store.round_trips >= trips + 2)
            time.sleep(0.1)
            assert quotas.store.round_trips == trips + 2
            assert (r.headers["x-ratelimit-remaining-requests"], r.headers["x-ratelimit-remaining-tokens"]) == (
                "0",
                str(10_000 - 16 - 369),
            )
            assert order == ["read"]
            for text in (WARMUP_PROMPT, WARMUP_PROMPT + " again"):
                r = post(edge.port, chat(text))
                assert (r.status_code, r.json()["error"]["code"]) == (429, "rate_limit_exceeded")
                assert "requests per 60s window (RPM): Limit 1, Used 1, Requested 1" in r.json()["error"]["message"]
            assert order == ["read", "read", "begin"]  # the second refusal read no body
            assert len(engine.state.requests) == 1
    fps, _ = svc.ingest.fingerprint(ex(TenantConfig(id="x"), PROMPT), PROMPT)
    assert {frozenset(o) for o in svc.index.store.owners(sorted(fps))} == {frozenset({"tenant-a"})}
    refused, _ = svc.ingest.fingerprint(ex(TenantConfig(id="x"), WARMUP_PROMPT), WARMUP_PROMPT)
    assert refused and svc.index.store.owners(sorted(refused)) == [set()] * len(refused)


def test_a_body_still_arriving_is_begun_before_it_is_read(redis_prefix, order):
    """A request whose body has not all arrived with its head takes step 1 first, as before:
    the gateway waits for no byte of a body before an RPM decision."""
    with two_apps(redis_prefix, rpm=5, tpm=10_000) as ((edge, _), _, _, _):
        body = b'{"model": "kvgate-tiny", "messages": [{"role": "user", "content": "Say hello."}]}'
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer sk-test-tenant-a\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
        ).encode()
        with socket.create_connection(("127.0.0.1", edge.port), timeout=5) as s:
            s.sendall(head + body[:10])
            wait_for(lambda: len(order) >= 2)
            assert order == ["begin", "read"]  # begun, then reading (waiting for the rest)
            s.sendall(body[10:])
            answer_bytes = s.recv(65536)
        assert answer_bytes.startswith(b"HTTP/1.1 200 ")
        assert order == ["begin", "read"]


_TRY_AGAIN = re.compile(r"Please try again in \d+s\.")

#: the requests the property draws from: (name, body); every one small enough for one step
REQUESTS = {
    "chat": {"model": "kvgate-tiny", "messages": [{"role": "user", "content": "Say hello."}]},
    "long": {"model": "kvgate-tiny", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 64},
    "huge_max_tokens": {"model": "kvgate-tiny", "messages": [{"role": "user", "content": "Hi."}], "max_tokens": 4000},
    "unknown_model": {"model": "no-such-model", "messages": [{"role": "user", "content": "Hi."}]},
    "bad_field": {"model": "kvgate-tiny", "messages": [{"role": "user", "content": "Hi."}], "temperature": "hot"},
    "not_json": b'{"model": "kvgate-tiny", "messages": [',
}


def _send(port: int, name: str) -> Answer:
    return post(port, REQUESTS[name])


def _seen(r) -> tuple:
    """What a client sees: status, error body (the seconds of "try again" aside: the two runs are
    moments apart), the rate-limit headers."""
    body = r.json()
    if "error" in body:
        body = {**body["error"], "message": _TRY_AGAIN.sub("Please try again in Ns.", body["error"]["message"])}
    else:
        body = body["usage"]
    limits = {k: v for k, v in r.headers.items() if k.startswith("x-ratelimit-")}
    return r.status_code, body, limits


@pytest.fixture(scope="module")
def apps_for_the_property():
    """The two apps, and a count of the requests admission took the one-step way."""
    p = new_prefix("one_step_property")
    one_step = [0]
    real = admit_module._admit_counted

    async def counted(*a, **kw):
        one_step[0] += 1
        return await real(*a, **kw)

    with pytest.MonkeyPatch.context() as mp, two_apps(p, rpm=6, tpm=900) as (edge, stock, _, _):
        mp.setattr(admit_module, "_admit_counted", counted)
        yield p, edge, stock, one_step
    delete_prefix(p)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.sampled_from(sorted(REQUESTS)), min_size=1, max_size=9))
def test_either_path_gives_every_request_the_same_answer(apps_for_the_property, names):
    """Any sequence of requests (admitted, too long for the tenant's TPM, refused for RPM,
    invalid in four ways; tenant: RPM 6, TPM 900) gets the same statuses, error bodies and
    rate-limit headers, and leaves the same RPM entries, leases and TPM debits, on the one-step
    path (the gateway's server layer) as on the two-step path (uvicorn's stock protocol)."""
    p, (edge, edge_quotas), (stock, stock_quotas), one_step = apps_for_the_property
    delete_prefix(p)
    for q in (edge_quotas, stock_quotas):
        q._refused_until.clear()
    before = one_step[0]
    seen = [[_seen(_send(edge.port, n)) for n in names]]
    assert one_step[0] > before  # the first request at least (no refusal yet) went the one-step way
    before = one_step[0]
    seen.append([_seen(_send(stock.port, n)) for n in names])
    assert one_step[0] == before and seen[0] == seen[1]
    for q in (edge_quotas, stock_quotas):  # every settle has landed (it follows the answer)
        wait_for(lambda q=q: not q._live)
    time.sleep(0.05)
    assert state(f"{p}:edge", "tenant-a") == state(f"{p}:stock", "tenant-a")
    assert state(f"{p}:edge", "tenant-a")[1] == 0  # no lease left behind


async def test_a_store_round_trip_keeps_its_connection_and_reconnects_after_a_restart(tmp_path) -> None:
    """The store keeps the connections it used between round trips (no pool checkout per round
    trip); when Redis restarts they are stale, and the next call still succeeds on a fresh one."""
    from tests.quota_fixtures import SpareRedis

    spare = SpareRedis(tmp_path)
    spare.start()
    store = RedisQuotaStore(redis_client_from_url(spare.url, 0.5), prefix="k")
    store.bound_round_trips(0.9)
    try:
        lim = QuotaLimits(rpm=100, tpm=None, max_concurrent=None)
        for i in range(3):
            assert (await store.begin("t", lim, f"a{i}", WINDOW_MS, TTL_MS)).admitted
        assert len(store._held) == 1
        spare.kill()
        spare.start()
        assert (await store.begin("t", lim, "b", WINDOW_MS, TTL_MS)).admitted
        assert len(store._held) == 1
        await asyncio.sleep(0)
    finally:
        await store.aclose()
        spare.kill()


async def begin_reserve_with_write(svc, quotas: TenantQuotas, tenant: TenantConfig, tokens: int):
    """What ``_admit_counted`` does for a small prompt: fingerprint, then begin and the token
    reservation with the index write guarded by them (discarded on refusal), then finish.
    Returns the error a refusal raised, else ``None`` (the lease settled at 0)."""
    pending = await svc.admit(ex(tenant, PROMPT), defer_write=True)
    assert pending is not None and len(pending.calls) == 1
    try:
        lease = await quotas.begin_reserve(tenant, "r", tokens, also=pending)
    except OpenAIError as e:
        pending.discard()
        return e
    finally:
        await pending.finish()
    await quotas.settle(lease, 0)
    return None


async def test_the_one_step_write_is_made_only_when_admitted_also_after_redis_lost_its_scripts(tmp_path, redis_prefix):
    """The index write behind ``begin.lua`` and ``tokens.lua``: refused by RPM or by TPM, nothing
    is written; admitted, the prompt is indexed under its tenant. After ``SCRIPT FLUSH`` the
    quota scripts are loaded and sent again, and the write (answered ``NOSCRIPT``) is sent by the
    verifier once the request was admitted, never for a refused one."""
    from tests.fixtures.settings import verifier_settings
    from tests.test_admission_round_trip import SECRETS, owners
    from verifier.build import build_verifier

    svc = build_verifier(verifier_settings(tmp_path, REDIS_URL), secrets=SECRETS, key_prefix=redis_prefix + ":v:")
    quotas = TenantQuotas(QuotaSettings(), RedisQuotaStore(redis_client_from_url(REDIS_URL, 0.5), prefix=redis_prefix))
    tenant = TenantConfig(id="t", rpm=2, tpm=50, verify_sample_rate=0.0)
    r = redis.Redis.from_url(REDIS_URL)
    nobody = [set()] * len(owners(svc, PROMPT))
    try:
        load_all_scripts()
        assert (await begin_reserve_with_write(svc, quotas, tenant, 51)).status == 429  # too large for TPM
        assert owners(svc, PROMPT) == nobody
        r.script_flush()
        assert await begin_reserve_with_write(svc, quotas, tenant, 50) is None
        assert set(map(frozenset, owners(svc, PROMPT))) == {frozenset({"t"})}
        other = TenantConfig(id="u", rpm=1, tpm=50, verify_sample_rate=0.0)
        await quotas.settle(await quotas.begin_reserve(other, "r0", 1), 1)  # its one request a minute
        r.script_flush()
        error = await begin_reserve_with_write(svc, quotas, other, 1)
        assert error is not None and "(RPM): Limit 1, Used 1" in error.message
        assert set(map(frozenset, owners(svc, PROMPT))) == {frozenset({"t"})}  # never "u"
        assert (svc.stats["ingested"], svc.stats["store_errors"], svc.ingest_pending_bytes) == (1, 0, 0)
    finally:
        r.close()
        await quotas.aclose()
        await svc.aclose()


async def test_a_body_written_apart_from_its_head_gets_one_turn_of_the_loop() -> None:
    """Most clients write a request's head and its body apart; a body that is not in when the
    app starts is asked about again after one turn of the event loop (in which the server reads
    its socket), and only a body still missing then, or one over 32 KiB, takes the two steps."""
    from starlette.requests import Request

    def request(length: int, complete) -> Request:
        scope = {"type": "http", "headers": [(b"content-length", str(length).encode())]}
        mark_complete_when(scope, complete)
        return Request(scope)

    arrived = [False]
    asyncio.get_running_loop().call_soon(lambda: arrived.__setitem__(0, True))  # the server's read, one turn on
    assert await admit_module._received_small(request(300, lambda: arrived[0]))
    assert not await admit_module._received_small(request(300, lambda: False))  # still arriving
    assert not await admit_module._received_small(request(admit_module.COMBINED_BODY_BYTES + 1, lambda: True))
    assert await admit_module._received_small(request(admit_module.COMBINED_BODY_BYTES, lambda: True))
