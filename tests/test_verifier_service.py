"""The verifier stage driven directly (no HTTP): sampling, background checks, strict mode,
honeypot canaries, quarantine, drift, and two replicas sharing Redis."""

from __future__ import annotations

import dataclasses
import json
import random
import time
import uuid
from functools import partial

import pytest
import redis
from conftest import SEEDS

from config.models import ModelConfig, Settings, TenantConfig, UpstreamConfig, VerifierSettings
from tests.fixtures.settings import verifier_settings
from verifier.build import build_verifier
from verifier.canary import new_canary
from verifier.incidents import read_incidents
from verifier.shingles import encode
from verifier.stage import Exchange, ExchangeRequest, ResponseWithheld

SEED_PL = (SEEDS / "001_85707760a0179a93.txt").read_text()
SEED_ZH = (SEEDS / "000_cd7ee3cfd92e9ff1.txt").read_text()
SECRETS = {"leak_index_key": b"service-test-key", "cache_salt_key": b"x", "admin_key": b"y"}


#: the shared verifier settings with this module's latency calibration
settings = partial(verifier_settings, latency_min_samples=5, latency_min_prompt_tokens=100)


def tenant(tid: str, **kw) -> TenantConfig:
    return TenantConfig(id=tid, verify_sample_rate=kw.pop("rate", 1.0), **kw)


def ex(t: TenantConfig, prompt: str, *, stream: bool = False, rid: str | None = None) -> Exchange:
    request = ExchangeRequest(
        rid or f"req-{uuid.uuid4().hex[:8]}",
        t,
        "up",
        "m",
        len(encode(prompt)),
        stream,
        time.monotonic(),
    )
    return Exchange(request, prompt)


def sse(text: str) -> bytes:
    return b"data: " + json.dumps({"choices": [{"index": 0, "text": text}]}).encode() + b"\n\n"


A, B, C = tenant("a"), tenant("b"), tenant("c")
D = tenant("d")
STRICT = tenant("s", strict_verify=True)
A_PROMPT = SEED_PL[:5000]
LEAK = SEED_PL[2000:2600]  # ~150 tokens of A's prompt


async def test_background_check_flags_leak_and_quarantines(tmp_path):
    """One source tenant's text in another's response is a confirmed incident but no quarantine
    (one tenant could have planted it: docs/design.md step 8); a second source tenant's text
    within the window is a high-severity alert, still no quarantine (two keys of one actor can
    plant that too); an operator quarantines."""
    svc = build_verifier(settings(tmp_path), secrets=SECRETS)
    try:
        assert svc.begin(ex(A, A_PROMPT)) is not None
        g = svc.begin(ex(B, "Tell me a story about rivers and stones."))
        assert await g.feed("Once upon a time ", b"e1") == [b"e1"]  # non-strict: passes at once
        assert await g.feed(LEAK, b"e2") == [b"e2"]
        assert await g.finish_stream(usage=None, finish_reason="length", ttft_seconds=None) == []
        await svc.drain()
        incs = [i for i in svc.incidents.recent if i.detector == "leak_index"]
        assert len(incs) == 1
        inc = incs[0]
        assert (inc.tenant, inc.upstream, inc.confirmed, inc.withheld) == ("b", "up", True, False)
        assert inc.evidence["source_tenant"] == "a" and inc.evidence["shingles_foreign"] >= 4
        assert inc.evidence["quarantine"] is None and not svc.is_quarantined("up", 5000)
        # the same source again, seen by a third tenant: still one source, still no quarantine
        g = svc.begin(ex(C, "hello"))
        await g.check_body(LEAK, usage=None, finish_reason="stop", ttft_seconds=None)
        await svc.drain()
        assert not svc.is_quarantined("up", 5000)
        # a second source tenant (c's prompt in b's response): a high-severity alert, no quarantine
        svc.begin(ex(C, SEED_ZH[:3000]))
        g = svc.begin(ex(B, "and another"))
        await g.check_body(SEED_ZH[1000:1600], usage=None, finish_reason="stop", ttft_seconds=None)
        await svc.drain()
        inc2 = svc.incidents.recent[-1]
        assert (inc2.evidence["source_tenant"], inc2.evidence["quarantine"]) == ("c", None)
        assert (inc2.evidence["severity"], inc2.evidence["alert"], inc2.evidence["sources_in_window"]) == (
            "high",
            "two_sources",
            2,
        )
        assert svc.stats["alerts"] == 1 and not svc.quarantine.records()
        # an operator quarantines: prompts above quarantine_min_prompt_tokens (1024) only
        svc.quarantine.put("up", "operator", "operator", 1024)
        assert svc.is_quarantined("up", 1025) and not svc.is_quarantined("up", 1024)
        # the record on disk holds no text
        rows = read_incidents(tmp_path / "incidents.jsonl")
        assert len(rows) == 3 and LEAK[:20] not in json.dumps(rows) and A_PROMPT[:20] not in json.dumps(rows)
        assert json.loads((tmp_path / "quarantine.json").read_text())["up"]["incident_id"] == "operator"
    finally:
        await svc.aclose()


async def test_unsampled_tenant_is_indexed_but_not_checked(tmp_path):
    svc = build_verifier(settings(tmp_path), secrets=SECRETS)
    try:
        quiet = tenant("quiet", rate=0.0)
        assert svc.begin(ex(quiet, A_PROMPT)) is None
        g = svc.begin(ex(B, "hello"))
        await g.check_body(LEAK, usage=None, finish_reason="stop", ttft_seconds=None)
        await svc.drain()
        (inc,) = svc.incidents.recent
        assert inc.detector == "leak_index" and inc.evidence["source_tenant"] == "quiet"
        assert svc.stats["ingested"] == 2 and svc.stats["checked"] == 1
    finally:
        await svc.aclose()


async def test_public_text_and_own_prompt_are_not_leaks(tmp_path):
    svc = build_verifier(settings(tmp_path), secrets=SECRETS)
    try:
        boiler = "You are a helpful assistant. " + SEED_PL[:1500]
        for t in (A, C):
            svc.begin(ex(t, boiler + f" Question from {t.id}: what is a river?"))
        g = svc.begin(ex(B, "Summarize: " + SEED_ZH[:800]))
        await g.check_body(SEED_PL[300:900] + SEED_ZH[100:400], usage=None, finish_reason="stop", ttft_seconds=None)
        await svc.drain()
        assert svc.incidents.recent == []
        assert svc.stats["checked"] == 1
    finally:
        await svc.aclose()


async def test_strict_body_withheld_with_incident_id(tmp_path):
    svc = build_verifier(settings(tmp_path), secrets=SECRETS)
    try:
        svc.begin(ex(A, A_PROMPT))
        g = svc.begin(ex(STRICT, "hello there"))
        with pytest.raises(ResponseWithheld) as ei:
            await g.check_body("Sure: " + LEAK, usage=None, finish_reason="stop", ttft_seconds=None)
        inc = svc.incidents.recent[-1]
        assert ei.value.incident_id == inc.id and ei.value.detector == "leak_index"
        assert inc.withheld is True and inc.tenant == "s"
        # a clean strict body passes
        g2 = svc.begin(ex(STRICT, "hello again"))
        assert await g2.check_body("General Kenobi. " * 10, usage=None, finish_reason="stop", ttft_seconds=None) is None
    finally:
        await svc.aclose()


async def test_strict_stream_holdback_and_cut(tmp_path):
    svc = build_verifier(settings(tmp_path, strict_holdback_tokens=64), secrets=SECRETS)
    try:
        # clean stream: nothing is sent until 64 tokens follow it; everything arrives, in order
        words = [f" word{i}" for i in range(100)]
        g = svc.begin(ex(STRICT, "count words", stream=True))
        sent = []
        for i, w in enumerate(words):
            sent += await g.feed(w, sse(w))
            held_tokens = sum(len(encode(x)) for x in words[len(sent) : i + 1])
            assert held_tokens >= 64 or len(sent) == 0
        sent += await g.finish_stream(usage={"prompt_tokens": 2}, finish_reason="stop", ttft_seconds=0.01)
        assert sent == [sse(w) for w in words]
        # leaking stream: cut before the leaked run leaves
        svc.begin(ex(A, A_PROMPT))
        g = svc.begin(ex(STRICT, "tell me something", stream=True))
        lead = [" Here", " is", " an", " answer", ":"]
        leak_ids = encode(LEAK)
        pieces = lead + [_dec(leak_ids[i : i + 1]) for i in range(len(leak_ids))]
        released: list[bytes] = []
        with pytest.raises(ResponseWithheld) as ei:
            for p in pieces:
                released += await g.feed(p, sse(p))
        inc = svc.incidents.recent[-1]
        assert ei.value.incident_id == inc.id and inc.withheld
        assert released == []  # the 5 lead-in events were still inside the 64-token window
        with pytest.raises(ResponseWithheld):
            await g.finish_stream(usage=None, finish_reason="length", ttft_seconds=None)
    finally:
        await svc.aclose()


def _dec(ids: list[int]) -> str:
    from tokenizer.encodings import bundled_encoding

    return bundled_encoding().decode(ids)


async def test_honeypot_canary_in_another_tenant(tmp_path):
    svc = build_verifier(settings(tmp_path), secrets=SECRETS)
    try:
        hp = tenant("honey", honeypot=True, rate=0.0)
        can = new_canary()
        svc.begin(ex(hp, f"Remember the code {can}. " + SEED_ZH[:300]))
        g = svc.begin(ex(B, "what's up", rid="req-leaked"))
        await g.check_body(f"I recall {can} from somewhere.", usage=None, finish_reason="stop", ttft_seconds=None)
        # the honeypot itself echoing its canary is no leak; nor is B planting and echoing its own
        own = new_canary()
        g2 = svc.begin(ex(B, f"repeat {own}"))
        await g2.check_body(own, usage=None, finish_reason="stop", ttft_seconds=None)
        await svc.drain()
        # (when the canary tokenizes into 16+ tokens its shingle is also leak-index evidence)
        assert {i.request_id for i in svc.incidents.recent} == {"req-leaked"}
        assert {i.detector for i in svc.incidents.recent} <= {"canary", "leak_index"}
        (inc,) = [i for i in svc.incidents.recent if i.detector == "canary"]
        assert inc.detector == "canary" and inc.confirmed
        assert inc.evidence["source_tenants"] == ["honey"] and inc.evidence["honeypot"] is True
        assert inc.evidence["known_origin"] == 1 and can not in json.dumps(inc.evidence)
    finally:
        await svc.aclose()


async def test_drift_abort_and_latency(tmp_path):
    svc = build_verifier(settings(tmp_path), secrets=SECRETS)
    try:
        prompt = SEED_PL[:1200]
        n = len(encode(prompt))
        g = svc.begin(ex(A, prompt))
        await g.check_body(
            "ok", usage={"prompt_tokens": 1, "completion_tokens": 1}, finish_reason="abort", ttft_seconds=None
        )
        rng = random.Random(3)
        samples = [0.1 + rng.uniform(0, 0.01) for _ in range(5)]
        for i, t in enumerate(samples):  # calibrate: ~100 ms; three tenants (latency_min_tenants)
            await svc.begin(ex((A, C, D)[i % 3], prompt)).check_body(
                "ok", usage={"prompt_tokens": n}, finish_reason="stop", ttft_seconds=t
            )
        await svc.begin(ex(A, prompt)).check_body(
            "ok", usage={"prompt_tokens": n}, finish_reason="stop", ttft_seconds=0.001
        )
        await svc.drain()
        det = [i.detector for i in svc.incidents.recent]
        assert det == ["usage_drift", "finish_abort", "latency"]
        d = svc.incidents.recent[0].evidence
        assert (d["gateway_prompt_tokens"], d["engine_prompt_tokens"], d["difference_tokens"]) == (n, 1, 1 - n)
        lat = svc.incidents.recent[2].evidence
        # bound = level x 0.5; level = the upper median of the tenants' q(0.001), i.e. of three
        # tenants the middle one of their smallest samples (DDSketch: within 1%)
        level = sorted(min(samples[k::3]) for k in range(3))[1]
        assert lat["ttft_ms"] == 1.0 and lat["bound_ms"] == pytest.approx(level * 500, rel=0.01)
        assert not svc.is_quarantined("up", 5000)  # anomalies alone do not quarantine
    finally:
        await svc.aclose()


async def test_two_replicas_share_the_index_and_quarantine(tmp_path, redis_client, redis_prefix):
    c, prefix = redis_client, redis_prefix + ":"
    s = settings(tmp_path)
    r1 = build_verifier(s, secrets=SECRETS, redis=c, key_prefix=prefix, incident_path=str(tmp_path / "1.jsonl"))
    r2 = build_verifier(s, secrets=SECRETS, redis=c, key_prefix=prefix, incident_path=str(tmp_path / "2.jsonl"))
    try:
        r1.begin(ex(A, A_PROMPT))
        r1.begin(ex(C, SEED_ZH[:3000]))
        await r1.drain()
        g = r2.begin(ex(B, "hi"))
        await g.check_body(LEAK, usage=None, finish_reason="stop", ttft_seconds=None)
        await r2.drain()
        (inc,) = r2.incidents.recent
        assert inc.detector == "leak_index" and inc.confirmed and inc.evidence["quarantine"] is None
        r1.quarantine.refresh()
        assert not r1.is_quarantined("up", 2000)  # one source tenant: an incident, no quarantine
        # the second source is seen by the other replica: the evidence window is shared
        g = r1.begin(ex(B, "hi again"))
        await g.check_body(SEED_ZH[1000:1600], usage=None, finish_reason="stop", ttft_seconds=None)
        await r1.drain()
        last = r1.incidents.recent[-1]
        assert (last.evidence["quarantine"], last.evidence["alert"]) == (None, "two_sources")
        assert c.zcard(prefix + "qevidence:up") == 2
        r1.quarantine.refresh()
        assert not r1.is_quarantined("up", 2000)  # an alert, not a quarantine
        r2.quarantine.put("up", "operator", "operator", 1024)  # the operator's decision
        r1.quarantine.refresh()
        assert r1.is_quarantined("up", 2000)  # replica 1 sees replica 2's quarantine
        assert c.hexists(prefix + "quarantine", "up")
        from verifier.quarantine import Quarantine, RedisQuarantineBackend

        assert Quarantine(RedisQuarantineBackend(c, prefix)).clear("up")
        assert not c.exists(prefix + "qevidence:up")  # clearing forgets the evidence too
        r1.quarantine.refresh()
        assert not r1.is_quarantined("up", 2000)
    finally:
        await r1.aclose()
        await r2.aclose()


async def test_periodic_probe_quarantines_a_leaking_upstream(tmp_path):
    """``verifier.probe_interval_seconds``: the gateway probes each upstream straight at the
    engine; a surfaced canary is a confirmed ``probe`` incident and quarantines the upstream, and
    the probe's canaries are registered as honeypot canaries."""
    import asyncio

    from test_verifier_leaky_engine import LeakyEngine

    engine = LeakyEngine(pool_tokens=4096, context_length=8192, faults=True).start()
    try:
        s = Settings(
            state_dir=str(tmp_path),
            verifier=VerifierSettings(probe_interval_seconds=0.2),
            models=[ModelConfig(id="m", context_length=8192)],
            upstreams=[
                UpstreamConfig(
                    name="leaky", api_url=engine.api_url, pool_source="static", static_pool_tokens=16384, models=["m"]
                )
            ],
        )
        svc = build_verifier(s, secrets=SECRETS)
        svc.start()
        deadline = time.monotonic() + 30
        while not svc.incidents.recent and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await svc.aclose()
        inc = svc.incidents.recent[0]
        assert (inc.detector, inc.tenant, inc.upstream, inc.confirmed) == ("probe", "kvgate-probe", "leaky", True)
        assert inc.evidence["limit_tokens"] == 8192 and inc.evidence["surfaced_canaries"] >= 1
        assert svc.is_quarantined("leaky", 1025)
        # the five probe requests went straight to the engine, sized at the static limit
        assert [r["prompt_tokens"] for r in engine.state.requests[:5]] == [4032, 8128, 8128, 8129, 8129]
        probe_canaries = svc.canaries.store  # registered under the probe tenant
        assert len(probe_canaries) == 3
    finally:
        engine.stop()


async def test_store_down_fails_open_and_counts(tmp_path):
    """Redis unreachable: checks that need the index are skipped and counted, never a crash;
    a strict response is released (the latency check still applies)."""
    import socket

    s_ = socket.socket()
    s_.bind(("127.0.0.1", 0))
    dead_port = s_.getsockname()[1]
    s_.close()
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    dead = redis.Redis(
        host="127.0.0.1", port=dead_port, socket_connect_timeout=0.2, socket_timeout=0.2, retry=Retry(NoBackoff(), 0)
    )
    svc = build_verifier(settings(tmp_path), secrets=SECRETS, redis=dead, key_prefix="dead:")
    try:
        svc.begin(ex(A, A_PROMPT))
        g = svc.begin(ex(STRICT, "hello"))
        assert await g.check_body(LEAK, usage=None, finish_reason="stop", ttft_seconds=None) is None
        g2 = svc.begin(ex(B, "hi"))
        await g2.check_body(LEAK, usage={"prompt_tokens": 999}, finish_reason="stop", ttft_seconds=None)
        await svc.drain()
        # the first store call fails (A's ingest); everything after it skips the store for 5 s
        assert (svc.stats["store_errors"], svc.stats["errors"]) == (1, 1)
        assert svc.stats["store_skipped"] >= 2
        assert [i.detector for i in svc.incidents.recent] == ["usage_drift"]
    finally:
        await svc.aclose()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["body", "stream"])
async def test_strict_check_leaves_the_event_loop_free(tmp_path, kind):
    """Another thread holds the service lock (as the background worker does for a long batch)
    for at least 0.5 s while a strict check that needs it is awaited: the check waits in a
    worker thread, a ticker on the same loop keeps ticking meanwhile, and the check's outcome
    is unchanged once the lock is free (body: withheld with its incident; stream: the first
    event held back, 64-token window)."""
    import asyncio
    import threading

    svc = build_verifier(settings(tmp_path), secrets=SECRETS)
    holding, enough = threading.Event(), threading.Event()
    check_done = threading.Event()
    done_while_held: list[bool] = []

    def hold_lock() -> None:
        with svc.strict.lock:
            holding.set()
            t0 = time.monotonic()
            enough.wait(10)  # the ticker says it ticked (never, if the loop were blocked)
            time.sleep(max(0.0, 0.5 - (time.monotonic() - t0)))
            done_while_held.append(check_done.is_set())
            holding.clear()

    ticks_while_held = 0

    async def ticker() -> None:
        nonlocal ticks_while_held
        while not check_done.is_set():
            if holding.is_set():
                ticks_while_held += 1
                if ticks_while_held >= 5:
                    enough.set()
            await asyncio.sleep(0.01)

    try:
        svc.begin(ex(A, A_PROMPT))
        g = svc.begin(ex(STRICT, "hello there", stream=kind == "stream"))
        holder = threading.Thread(target=hold_lock)
        holder.start()
        await asyncio.to_thread(holding.wait, 10)
        tick = asyncio.create_task(ticker())
        try:
            if kind == "body":
                with pytest.raises(ResponseWithheld) as ei:
                    await g.check_body("Sure: " + LEAK, usage=None, finish_reason="stop", ttft_seconds=None)
                inc = svc.incidents.recent[-1]
                assert (ei.value.incident_id, ei.value.detector) == (inc.id, "leak_index") and inc.withheld
            else:
                assert await g.feed(" Hello", sse(" Hello")) == []
        finally:
            check_done.set()
            await tick
            await asyncio.to_thread(holder.join, 10)
        assert done_while_held == [False]  # the check really waited for the lock
        assert ticks_while_held >= 5  # ... and the loop ran while it waited
    finally:
        enough.set()
        await svc.aclose()


async def test_background_guard_calls_never_suspend(tmp_path):
    """The non-strict guard's coroutines finish on their first step (no thread hop, no await):
    driving them with ``send(None)`` ends in ``StopIteration`` carrying the result."""
    svc = build_verifier(settings(tmp_path), secrets=SECRETS)
    try:
        g = svc.begin(ex(B, "hi", stream=True))

        def step(coro):
            with pytest.raises(StopIteration) as si:
                coro.send(None)
            return si.value.value

        assert step(g.feed("Once", b"e1")) == [b"e1"]
        assert step(g.feed("", b"e2")) == [b"e2"]
        assert step(g.finish_stream(usage=None, finish_reason="stop", ttft_seconds=None)) == []
        assert (
            step(svc.begin(ex(B, "hi")).check_body("ok", usage=None, finish_reason="stop", ttft_seconds=None)) is None
        )
        await svc.drain()
        assert svc.stats["checked"] == 2
    finally:
        await svc.aclose()


@pytest.mark.parametrize("waited_before_forwarding", [False, True])
async def test_strict_stream_first_token_is_timed_from_forwarding(tmp_path, waited_before_forwarding):
    """A strict stream's first-token check uses the clock its calibration uses: from forwarding,
    not from arrival. A request that spent 1 s in the gateway (counting, quotas, a queue) before
    its engine answered in 1 ms is still too fast for a bound calibrated at ~50 ms; one forwarded
    1 s before its first token is not."""
    svc = build_verifier(settings(tmp_path), secrets=SECRETS)
    try:
        prompt = SEED_PL[:1200]
        n = len(encode(prompt))
        for i in range(6):  # streamed TTFTs of ~100 ms from three tenants: the bound is ~50 ms
            g = svc.begin(ex((A, C, D)[i % 3], prompt, stream=True))
            await g.feed("ok", sse("ok"))
            await g.finish_stream(usage={"prompt_tokens": n}, finish_reason="stop", ttft_seconds=0.1)
        await svc.drain()
        svc.begin(ex(A, A_PROMPT))
        e = ex(STRICT, prompt, stream=True, rid="req-fast")
        now = time.monotonic()
        forwarded = now - 1.0 if waited_before_forwarding else now
        e.request = dataclasses.replace(e.request, started_monotonic=now - 1.0, forwarded_monotonic=forwarded)
        g = svc.begin(e)
        with pytest.raises(ResponseWithheld):
            await g.feed(LEAK, sse(LEAK))
        incs = [i for i in svc.incidents.recent if i.request_id == "req-fast"]
        det = sorted(i.detector for i in incs)
        if waited_before_forwarding:
            assert det == ["leak_index"]
        else:
            assert det == ["latency", "leak_index"]
            (lat,) = [i for i in incs if i.detector == "latency"]
            assert lat.evidence["ttft_ms"] < 10 and lat.evidence["bound_ms"] == pytest.approx(50, rel=0.02)
    finally:
        await svc.aclose()
