"""The verifier against a hostile tenant, driven directly (no HTTP): evidence a tenant cannot
plant (token-id prompts decoded, echoes, the own-prompt cache), quarantine only on kvgate's own
canaries (two source tenants: an alert), latency calibration a tenant cannot poison, and
bounded admission-time ingest charged to its sender."""

from __future__ import annotations

import asyncio
import random
import threading
import time
import uuid
from functools import partial

import pytest

from config.models import TenantConfig
from tests.fixtures.settings import verifier_settings
from tokenizer import bundled_counter
from verifier.build import build_verifier
from verifier.canary import new_canary
from verifier.latency import LatencyModel, cached_tokens_of
from verifier.probe import filler_words
from verifier.service import VerifierService, strip_echo
from verifier.shingles import encode
from verifier.stage import Exchange, ExchangeRequest, ResponseWithheld

SECRETS = {"leak_index_key": b"adversary-test-key", "cache_salt_key": b"x", "admin_key": b"y"}
COUNTER = bundled_counter()
SELF_CANARY = "KVGATE-CANARY-00112233deadbeef"


def words(seed: int, n: int) -> str:
    rng = random.Random(seed)
    vocab = filler_words()
    return " ".join(rng.choice(vocab) + (str(rng.randrange(100)) if rng.random() < 0.3 else "") for _ in range(n))


#: the shared verifier settings with this module's latency calibration
settings = partial(verifier_settings, latency_min_samples=10, latency_min_prompt_tokens=512)


def tenant(tid: str, **kw) -> TenantConfig:
    return TenantConfig(id=tid, verify_sample_rate=kw.pop("rate", 1.0), **kw)


A, B, C, D = tenant("a"), tenant("b"), tenant("c"), tenant("d")
STRICT = tenant("s", strict_verify=True)


def ex(t: TenantConfig, prompt: str = "", *, ids=(), echo=False, stream=False, rid=None, n=None) -> Exchange:
    tokens = n if n is not None else (len(encode(prompt)) + sum(len(i) for i in ids))
    request = ExchangeRequest(rid or f"req-{uuid.uuid4().hex[:8]}", t, "up", "m", tokens, stream, time.monotonic())
    return Exchange(request, prompt, prompt_ids=[list(i) for i in ids], echo=echo)


def hold_ingests(svc: VerifierService, tenant: str | None = None) -> threading.Event:
    """Make the threaded ingests of ``tenant`` (every tenant: ``None``) wait, in their thread,
    until the returned event is set (10 s at most)."""
    gate = threading.Event()
    real = svc.ingest.index_prompt

    def held(exchange, text, nbytes):
        if tenant is None or exchange.request.tenant.id == tenant:
            gate.wait(10)
        real(exchange, text, nbytes)

    svc.ingest.index_prompt = held
    return gate


async def admitted(svc: VerifierService, e: Exchange) -> Exchange:
    await svc.admit(e, COUNTER.adecode)
    return e


def sse(text: str) -> bytes:
    return b'data: {"choices":[{"index":0,"text":' + repr(text).encode() + b"}]}\n\n"


# ------------------------------------------------------------------ evidence a tenant cannot plant
async def test_self_planted_canary_as_token_ids_with_echo_is_no_incident(tmp_path):
    """Tenant a sends the canary as text; tenant b sends the same as token ids with echo: b's
    decoded prompt holds the canary, so b's echo of it is no evidence: no incident, no
    quarantine, and a third tenant's long prompt is not refused."""
    svc = build_verifier(settings(tmp_path), secrets=SECRETS)
    try:
        text = f"note {SELF_CANARY}"
        await admitted(svc, ex(A, text))
        eb = await admitted(svc, ex(B, ids=[COUNTER.encode_text(text)], echo=True))
        assert eb.prompt_text == text and eb.state.own_text_complete
        g = svc.begin(eb)
        await g.check_body(text + " and then some more words", usage=None, finish_reason="stop", ttft_seconds=None)
        strict_b = await admitted(svc, ex(STRICT, ids=[COUNTER.encode_text(text)], echo=True))
        g = svc.begin(strict_b)
        assert await g.check_body(text + " ok", usage=None, finish_reason="stop", ttft_seconds=None) is None
        await svc.drain()
        assert svc.incidents.recent == []
        assert not svc.quarantine.records() and not svc.is_quarantined("up", 5000)
    finally:
        await svc.aclose()


async def test_token_id_prompt_cut_inside_a_character_echoed_with_its_canary(tmp_path):
    """A token-id prompt whose last id ends inside a UTF-8 character decodes with U+FFFD; the
    stream's first delta echoes the whole prompt (the character completed) with a canary another
    tenant registered: for a strict tenant nothing is withheld, nothing recorded, every event
    released in order."""
    svc = build_verifier(settings(tmp_path, strict_holdback_tokens=8), secrets=SECRETS)
    try:
        full = f"note {SELF_CANARY} " + words(1, 120) + " 日本語"
        ids = COUNTER.encode_text(full)
        cut = next(i for i in range(len(ids) - 1, 0, -1) if COUNTER.decode(ids[:i]).endswith("\ufffd"))
        await admitted(svc, ex(A, full))  # the same text as a string, from another tenant
        e = await admitted(svc, ex(STRICT, ids=[ids[:cut]], echo=True, stream=True))
        assert e.prompt_text.endswith("\ufffd") and SELF_CANARY in e.prompt_text
        g = svc.begin(e)
        events = [full + " The", " answer", " is", " here", " and", " there", " again", " now", " done", "."]
        sent: list[bytes] = []
        for p in events:
            sent += await g.feed(p, sse(p))
        sent += await g.finish_stream(
            usage={"prompt_tokens": e.request.prompt_tokens}, finish_reason="stop", ttft_seconds=None
        )
        assert sent == [sse(p) for p in events]
        await svc.drain()
        assert svc.incidents.recent == []
    finally:
        await svc.aclose()


async def test_token_id_prompts_get_leak_index_protection(tmp_path):
    """A tenant that sends token ids is indexed like one that sends text: its prompt leaking
    into another tenant's strict response is withheld with the source named."""
    svc = build_verifier(settings(tmp_path), secrets=SECRETS)
    try:
        victim = words(2, 700)
        await admitted(svc, ex(A, ids=[COUNTER.encode_text(victim)]))
        g = svc.begin(await admitted(svc, ex(STRICT, "tell me something")))
        with pytest.raises(ResponseWithheld) as ei:
            await g.check_body("Sure: " + victim[800:1600], usage=None, finish_reason="stop", ttft_seconds=None)
        inc = svc.incidents.recent[-1]
        assert (ei.value.detector, inc.evidence["source_tenant"], inc.withheld) == ("leak_index", "a", True)
    finally:
        await svc.aclose()


async def test_undecodable_token_ids_are_counted_and_never_evidence_for_quarantine(tmp_path):
    async def broken(ids: list[int]) -> str:
        raise RuntimeError("detokenize down")

    svc = build_verifier(settings(tmp_path), secrets=SECRETS)
    try:
        e = ex(B, ids=[[1, 2, 3]])
        await svc.admit(e, broken)
        assert (e.state.own_text_complete, svc.stats["decode_failed"], e.prompt_text) == (False, 1, "")
    finally:
        await svc.aclose()


def test_strip_echo_shapes():
    p = "note 日\ufffd"
    assert strip_echo("note 日本 rest", [p]) == " rest"
    assert strip_echo("note 日本 rest", ["note 日本"]) == " rest"
    assert strip_echo("other text", [p]) == "other text"
    assert strip_echo("abc", ["", "\ufffd"]) == "abc"  # nothing to strip for an empty core
    assert strip_echo("note", ["note and more"]) == "note"  # a partial echo is not cut here


async def test_own_prompt_cache_is_keyed_by_an_internal_id(tmp_path):
    """Two requests with the same client x-request-id: each keeps its own prompt's exclusion
    (a repeated id cannot take or overwrite another request's)."""
    svc = build_verifier(settings(tmp_path), secrets=SECRETS)
    try:
        victim = words(3, 700)
        e1 = ex(A, victim, rid="same-id")
        e2 = ex(B, "short question", rid="same-id")
        assert e1.internal_id != e2.internal_id
        svc.begin(e1)  # legacy path (no admit): own sets cached by internal id
        g2 = svc.begin(e2)
        await g2.check_body(victim[500:1500], usage=None, finish_reason="stop", ttft_seconds=None)
        await svc.drain()
        (inc,) = svc.incidents.recent
        assert (inc.tenant, inc.detector, inc.evidence["source_tenant"]) == ("b", "leak_index", "a")
    finally:
        await svc.aclose()


# ------------------------------------------------------------------ quarantine
async def test_quarantine_needs_a_kvgate_canary_two_sources_only_alert(tmp_path):
    svc = build_verifier(settings(tmp_path), secrets=SECRETS)
    try:
        # a regular tenant's canary in another response: incident, alert, no quarantine
        can_a = new_canary()
        await admitted(svc, ex(A, f"remember {can_a} " + words(4, 50)))
        g = svc.begin(await admitted(svc, ex(B, "hi")))
        await g.check_body(f"I recall {can_a}.", usage=None, finish_reason="stop", ttft_seconds=None)
        # strict: withheld, still no quarantine
        g = svc.begin(await admitted(svc, ex(STRICT, "hi")))
        with pytest.raises(ResponseWithheld):
            await g.check_body(f"I recall {can_a}.", usage=None, finish_reason="stop", ttft_seconds=None)
        await svc.drain()
        # (a canary of 16+ tokens is also a leak-index shingle: only the canary incidents here)
        cans = [i for i in svc.incidents.recent if i.detector == "canary"]
        # (b's check runs in the background worker, s's strict one at once: either may be first)
        assert sorted((i.tenant, i.confirmed, i.withheld, i.evidence["quarantine"]) for i in cans) == [
            ("b", True, False, None),
            ("s", True, True, None),
        ]
        assert all(i.evidence.get("quarantine") is None for i in svc.incidents.recent)
        assert not svc.quarantine.records()
        # echo requests are never evidence, even of a second source
        can_c = new_canary()
        await admitted(svc, ex(C, f"remember {can_c} " + words(5, 50)))
        g = svc.begin(await admitted(svc, ex(D, "hello", echo=True)))
        await g.check_body(f"hello {can_c}", usage=None, finish_reason="stop", ttft_seconds=None)
        await svc.drain()
        last = [i for i in svc.incidents.recent if i.detector == "canary"][-1]
        assert (last.tenant, last.evidence["echo"], last.evidence["quarantine"]) == ("d", True, None)
        assert not svc.quarantine.records()
        # a second source tenant within the window: a high-severity alert, still no quarantine
        # (two keys of one actor can plant exactly this)
        g = svc.begin(await admitted(svc, ex(D, "hello")))
        await g.check_body(f"hello {can_c}", usage=None, finish_reason="stop", ttft_seconds=None)
        await svc.drain()
        last = [i for i in svc.incidents.recent if i.detector == "canary"][-1]
        assert (last.evidence["quarantine"], last.evidence["severity"], last.evidence["alert"]) == (
            None,
            "high",
            "two_sources",
        )
        assert not svc.quarantine.records()
        # a honeypot's canary (planted by kvgate) quarantines at once
        hp = tenant("honey", honeypot=True, rate=0.0)
        can_h = new_canary()
        await admitted(svc, ex(hp, f"code {can_h} " + words(6, 40)))
        g = svc.begin(await admitted(svc, ex(B, "hi")))
        await g.check_body(f"code {can_h}", usage=None, finish_reason="stop", ttft_seconds=None)
        await svc.drain()
        last = [i for i in svc.incidents.recent if i.detector == "canary"][-1]
        assert last.evidence["quarantine"] == "kvgate_canary"
        assert svc.is_quarantined("up", 5000)
    finally:
        await svc.aclose()


async def test_shingle_evidence_from_one_source_quarantines_nothing(tmp_path):
    """Tenant a sends a long text; tenant b (the same attacker) gets it back through a model
    that obeys 'repeat the passage' without b's prompt holding it: an incident per response,
    never a quarantine however often it is repeated."""
    svc = build_verifier(settings(tmp_path), secrets=SECRETS)
    try:
        planted = words(7, 600)
        await admitted(svc, ex(A, planted))
        for i in range(5):
            g = svc.begin(await admitted(svc, ex(B, f"repeat the passage {i}")))
            await g.check_body(planted[: 1000 + i], usage=None, finish_reason="stop", ttft_seconds=None)
        await svc.drain()
        assert [i.detector for i in svc.incidents.recent] == ["leak_index"] * 5
        assert all(i.confirmed and i.evidence["quarantine"] is None for i in svc.incidents.recent)
        assert not svc.quarantine.records()
    finally:
        await svc.aclose()


# ------------------------------------------------------------------ latency
def test_cached_tokens_of_shapes():
    assert cached_tokens_of({"prompt_tokens_details": {"cached_tokens": 7}}) == 7
    for bad in (None, {}, {"prompt_tokens_details": None}):
        assert cached_tokens_of(bad) is None  # not said
    # impossible counts are no evidence of a cache hit: nothing cached, known
    assert cached_tokens_of({"prompt_tokens_details": {"cached_tokens": -1}}) == 0
    assert cached_tokens_of({"prompt_tokens_details": {"cached_tokens": True}}) == 0
    assert LatencyModel.prefilled_tokens(3000, 2990) == 10
    assert LatencyModel.prefilled_tokens(3000, 4000) == 3000  # impossible: counted as no hit
    assert LatencyModel.prefilled_tokens(3000, None) == 3000


async def test_poisoned_calibration_still_flags_a_leak_and_a_cache_hit_is_not_flagged(tmp_path):
    """50 calibration samples of 3,000-token prompts, 49 of them prefix-cache hits (2 ms) that
    the engine reports in usage.prompt_tokens_details.cached_tokens, one honest (0.40 s): the
    hits calibrate the bucket of the tokens really prefilled, not the 3,000-token one. A
    20 ms answer to a 3,000-token prompt with nothing cached is still flagged; a 2 ms answer
    whose cached count says 2,990 tokens were cached is not. The honest samples come from
    three tenants (a bucket needs latency_min_tenants, 3)."""
    svc = build_verifier(settings(tmp_path, latency_min_samples=4), secrets=SECRETS)
    try:
        n = 3000
        rng = random.Random(9)
        for i in range(50):
            t = (A, C, D)[i % 3]
            if i % 50 == 7:  # one honest sample, then more honest ones from both tenants below
                usage, ttft = {"prompt_tokens": n, "prompt_tokens_details": {"cached_tokens": 0}}, 0.40
            else:
                usage = {"prompt_tokens": n, "prompt_tokens_details": {"cached_tokens": n - 10}}
                ttft = 0.002 * (1 + rng.random() * 0.1)
            await svc.begin(ex(t, n=n)).check_body("ok", usage=usage, finish_reason="stop", ttft_seconds=ttft)
        for i in range(4):  # a few more honest ones so the long bucket is calibrated
            await svc.begin(ex((A, C, D)[i % 3], n=n)).check_body(
                "ok",
                usage={"prompt_tokens": n, "prompt_tokens_details": {"cached_tokens": 0}},
                finish_reason="stop",
                ttft_seconds=0.40 + i * 0.01,
            )
        await svc.drain()
        assert svc.incidents.recent == []
        bound = svc.latency.bound("up", n, "whole", "m")
        assert bound == pytest.approx(0.20, rel=0.03)  # 0.5 x the honest 0.40 s, not 0.5 x 2 ms
        # the leak: 20 ms for 3,000 uncached tokens; strict and cached count known: withheld
        g = svc.begin(ex(STRICT, n=n))
        with pytest.raises(ResponseWithheld) as ei:
            await g.check_body(
                "ok",
                usage={"prompt_tokens": n, "prompt_tokens_details": {"cached_tokens": 0}},
                finish_reason="stop",
                ttft_seconds=0.020,
            )
        assert ei.value.detector == "latency"
        inc = svc.incidents.recent[-1]
        assert (inc.evidence["cached_tokens"], inc.evidence["prefilled_tokens"], inc.withheld) == (0, n, True)
        # the same 20 ms, cached count unknown: an alert, the strict response is released
        g = svc.begin(ex(STRICT, n=n))
        assert await g.check_body("ok", usage={"prompt_tokens": n}, finish_reason="stop", ttft_seconds=0.020) is None
        await svc.drain()
        assert (svc.incidents.recent[-1].detector, svc.incidents.recent[-1].withheld) == ("latency", False)
        count = len(svc.incidents.recent)
        # an honest cache hit: 2 ms with 2,990 tokens cached is no anomaly, and is released
        g = svc.begin(ex(STRICT, n=n))
        usage = {"prompt_tokens": n, "prompt_tokens_details": {"cached_tokens": n - 10}}
        assert await g.check_body("ok", usage=usage, finish_reason="stop", ttft_seconds=0.002) is None
        await svc.drain()
        assert len(svc.incidents.recent) == count
    finally:
        await svc.aclose()


def test_one_tenant_cannot_dominate_calibration():
    """Without cached-token counts, one tenant's 49 fast samples neither calibrate a bucket alone
    (it fills at most half of min_samples) nor pull its level down beside two honest tenants
    (the lower median of tenants: a strict majority sets a level, so neither 1 fast of 3 nor,
    tests/test_verifier_latency_poison.py, 2 slow of 4 move it)."""
    m = LatencyModel(min_samples=50, min_prompt_tokens=512, tenant_share=0.5)
    for _ in range(49):
        m.observe("u", 3000, 0.002, model="m", tenant="poisoner")
    assert m.bound("u", 3000, model="m") is None
    for i in range(25):
        m.observe("u", 3000, 0.40 + i * 0.001, model="m", tenant="honest")
        m.observe("u", 3000, 0.40 + i * 0.001, model="m", tenant="honest-2")
    assert m.bound("u", 3000, model="m") == pytest.approx(0.20, rel=0.02)
    assert m.observe("u", 3000, 0.020, model="m", tenant="x").anomaly
    # per model: another model on the same upstream is not calibrated by these
    assert m.bound("u", 3000, model="other") is None


async def test_strict_stream_too_fast_is_held_to_its_end_and_judged_by_cached_tokens(tmp_path):
    """A strict stream whose first token beats the bound releases nothing more; at the end the
    usage's cached count decides: 0 cached -> withheld (nothing was released); a cache hit -> all
    released, no incident."""
    svc = build_verifier(settings(tmp_path, latency_min_samples=4, strict_holdback_tokens=4), secrets=SECRETS)
    try:
        n = 3000
        for i in range(6):
            await svc.begin(ex((A, C, D)[i % 3], n=n, stream=True)).finish_stream(
                usage={"prompt_tokens": n, "prompt_tokens_details": {"cached_tokens": 0}},
                finish_reason="stop",
                ttft_seconds=0.40,
            )
        await svc.drain()
        pieces = [f" word{i}" for i in range(40)]
        for cached, outcome in ((0, "withheld"), (n - 5, "released")):
            e = ex(STRICT, n=n, stream=True)
            g = svc.begin(e)
            sent: list[bytes] = []
            for p in pieces:
                sent += await g.feed(p, sse(p))
            assert sent == []  # suspect: nothing leaves before the end
            usage = {"prompt_tokens": n, "prompt_tokens_details": {"cached_tokens": cached}}
            if outcome == "withheld":
                with pytest.raises(ResponseWithheld) as ei:
                    await g.finish_stream(usage=usage, finish_reason="stop", ttft_seconds=0.001)
                assert ei.value.detector == "latency"
            else:
                sent += await g.finish_stream(usage=usage, finish_reason="stop", ttft_seconds=0.001)
                assert sent == [sse(p) for p in pieces]
        await svc.drain()
        assert [(i.detector, i.withheld) for i in svc.incidents.recent] == [("latency", True)]
    finally:
        await svc.aclose()


async def test_abandoned_stream_then_next_turn_with_wrong_usage(tmp_path):
    """A strict streamed turn abandoned mid-way (the client left: no finish), the next turn at
    once with the same client request id, whose usage says prompt_tokens 1 against kvgate's
    624: the drift is reported (never withheld), the next turn's own prompt is its own (not the
    abandoned one's), and the abandoned turn left nothing behind that counts."""
    svc = build_verifier(settings(tmp_path, strict_holdback_tokens=4), secrets=SECRETS)
    try:
        first = words(10, 400)
        e1 = await admitted(svc, ex(STRICT, first, stream=True, rid="turn"))
        g1 = svc.begin(e1)
        for p in (" Once", " upon", " a"):
            await g1.feed(p, sse(p))
        del g1  # abandoned
        second = first + " " + words(11, 40)
        e2 = await admitted(svc, ex(STRICT, second, stream=True, rid="turn", n=624))
        g2 = svc.begin(e2)
        sent: list[bytes] = []
        echo = [second[:900], second[900:1500]]
        for p in echo:
            sent += await g2.feed(p, sse(p))
        sent += await g2.finish_stream(usage={"prompt_tokens": 1}, finish_reason="stop", ttft_seconds=0.01)
        assert sent == [sse(p) for p in echo]
        await svc.drain()
        (inc,) = svc.incidents.recent
        assert inc.detector == "usage_drift" and not inc.withheld
        assert (inc.evidence["gateway_prompt_tokens"], inc.evidence["engine_prompt_tokens"]) == (624, 1)
    finally:
        await svc.aclose()


# ------------------------------------------------------------------ bounded cost
async def test_pending_ingest_is_bounded_in_bytes_and_drops_are_counted(tmp_path):
    svc = build_verifier(settings(tmp_path, max_pending_ingest_bytes=100_000), secrets=SECRETS)
    gate = hold_ingests(svc)
    try:
        big = "x" * 60_000
        t1 = asyncio.create_task(svc.admit(ex(A, big)))
        await asyncio.sleep(0.05)
        assert svc.ingest_pending_bytes == 60_000
        await svc.admit(ex(C, big))  # over the budget: not indexed, counted, returns at once
        assert (svc.stats["ingest_dropped"], svc.stats["ingest_dropped_bytes"]) == (1, 60_000)
        gate.set()
        await t1
        assert svc.ingest_pending_bytes == 0 and svc.stats["ingested"] == 1
        from verifier.incidents import REGISTRY

        assert REGISTRY.get_sample_value("kvgate_verifier_dropped_total", {"reason": "ingest_bytes"}) >= 1
    finally:
        gate.set()
        await svc.aclose()


async def test_a_tenants_queued_ingests_hold_no_budget_so_another_tenants_prompt_is_indexed(tmp_path):
    """Tenant a sends ten 9,000-byte prompts at once into a 100,000-byte budget. Its ingests run
    one at a time (``ingest_concurrency_per_tenant`` 1) and only the running one holds budget, so
    tenant c's 12,000-byte prompt is indexed, and its text in b's answer is a leak. Before, a's
    nine waiting prompts reserved 90,000 bytes first: c's prompt was dropped unindexed and the
    leak went unseen."""
    svc = build_verifier(settings(tmp_path, max_pending_ingest_bytes=100_000), secrets=SECRETS)
    gate = hold_ingests(svc, "a")
    try:
        floods = [asyncio.create_task(svc.admit(ex(A, words(100 + i, 2000)[:9000]))) for i in range(10)]
        await asyncio.sleep(0.05)
        assert svc.ingest_pending_bytes == 9000  # only the ingest whose turn it is
        secret = words(7, 3000)[:12_000]  # above the inline size: c's own threaded ingest
        await svc.admit(ex(C, secret))
        assert (svc.stats["ingest_dropped"], svc.stats["ingested"]) == (0, 1)
        leak = await admitted(svc, ex(B, "Summarise the weather."))
        await svc.begin(leak).check_body("Sure: " + secret, usage=None, finish_reason="stop", ttft_seconds=None)
        gate.set()
        await asyncio.gather(*floods)
        await svc.drain()
        found = [(i.tenant, i.detector, i.evidence.get("source_tenant")) for i in svc.incidents.recent]
        assert ("b", "leak_index", "c") in found
        assert svc.stats["ingested"] == 12 and svc.ingest_pending_bytes == 0  # a 10, c and b
    finally:
        gate.set()
        await svc.aclose()


async def test_a_strict_stream_scans_its_prompt_for_canaries_once(tmp_path, monkeypatch):
    """A strict tenant's prompt holds 300 canaries and its stream repeats them, one per event:
    every event completes a canary, and each used to rescan the whole prompt under the verifier
    lock (CPU growing with the square of the count: 8,000 canaries took 19 s). The prompt is now
    scanned once per exchange, and none of its own canaries is an incident."""
    import verifier.findings as findings

    svc = build_verifier(settings(tmp_path), secrets=SECRETS)
    strict = tenant("s", strict_verify=True)
    cans = [new_canary() for _ in range(300)]
    prompt = " ".join(cans)
    scans: list[int] = []
    real = findings.find_canaries
    monkeypatch.setattr(findings, "find_canaries", lambda text: (scans.append(len(text)), real(text))[1])
    try:
        e = await admitted(svc, ex(strict, prompt, stream=True, n=3000))
        guard = svc.begin(e)
        for c in cans:
            await guard.feed(" " + c, b'data: {"choices":[{"index":0,"text":" ' + c.encode() + b'"}]}\n\n')
        await guard.finish_stream(usage=None, finish_reason="stop", ttft_seconds=None)
        assert scans.count(len(prompt)) == 1
        assert [i.detector for i in svc.incidents.recent if i.tenant == "s"] == []
    finally:
        await svc.aclose()


async def test_one_tenants_burst_of_large_responses_leaves_room_for_the_others_checks(tmp_path):
    """The background queue holds at most ``queue_max_chars`` of text, and one tenant at most
    ``queue_tenant_share`` (0.5) of it. Tenant a's five sampled 30,000-character answers arrive
    before the worker runs: one is queued (30,000 of a's 50,000), four are dropped and counted.
    Tenant b's answer, which holds c's prompt, is still queued and checked: a leak. Without the
    bound, a's answers filled the queue up to ``queue_size`` jobs whatever their size."""
    from verifier.findings import CheckJob

    svc = build_verifier(settings(tmp_path, queue_max_chars=100_000), secrets=SECRETS)
    try:
        secret = words(9, 300)
        await admitted(svc, ex(C, secret))
        a_jobs = [
            CheckJob(await admitted(svc, ex(A, f"question {i}")), ["z " * 15_000], None, "stop", None) for i in range(5)
        ]
        leak = await admitted(svc, ex(B, "Summarise the weather."))
        queued = [svc.jobs.enqueue(j) for j in a_jobs]
        queued.append(svc.jobs.enqueue(CheckJob(leak, ["Sure: " + secret], None, "stop", None)))
        assert queued == [True, False, False, False, False, True]
        assert svc.stats["dropped"] == 4 and svc.jobs.jobs.held["a"][0] == 1
        svc.start()
        await svc.drain()
        found = [(i.tenant, i.detector, i.evidence.get("source_tenant")) for i in svc.incidents.recent]
        assert found == [("b", "leak_index", "c")]
        assert svc.jobs.jobs.chars == 0 and svc.jobs.jobs.held == {}
    finally:
        await svc.aclose()


async def test_cancelled_admission_releases_its_bytes(tmp_path):
    svc = build_verifier(settings(tmp_path), secrets=SECRETS)
    gate = hold_ingests(svc)
    try:
        t = asyncio.create_task(svc.admit(ex(A, "y" * 5000)))
        await asyncio.sleep(0.05)
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        assert svc.ingest_pending_bytes == 5000  # the thread still runs: its bytes stay counted
        gate.set()
        for _ in range(200):
            if svc.ingest_pending_bytes == 0:
                break
            await asyncio.sleep(0.01)
        assert svc.ingest_pending_bytes == 0
    finally:
        gate.set()
        await svc.aclose()


async def test_strict_check_never_waits_for_another_tenants_ingest(tmp_path):
    """Tenant a's ingests are stuck (a slow thread); a strict request of s is admitted and
    checked meanwhile: its admission and check finish without waiting for a's."""
    svc = build_verifier(settings(tmp_path), secrets=SECRETS)
    gate = hold_ingests(svc, "a")
    try:
        flood = [asyncio.create_task(svc.admit(ex(A, words(20 + i, 2000)))) for i in range(3)]
        await asyncio.sleep(0.05)
        t0 = time.monotonic()
        e = await admitted(svc, ex(STRICT, "hello there"))
        g = svc.begin(e)
        assert await g.check_body("General Kenobi.", usage=None, finish_reason="stop", ttft_seconds=None) is None
        assert time.monotonic() - t0 < 5 and not gate.is_set()
        gate.set()
        await asyncio.gather(*flood)
    finally:
        gate.set()
        await svc.aclose()


async def test_strict_body_over_the_size_cap_is_withheld_whole(tmp_path):
    svc = build_verifier(settings(tmp_path, strict_max_text_bytes=10_000), secrets=SECRETS)
    try:
        g = svc.begin(await admitted(svc, ex(STRICT, "write a lot")))
        with pytest.raises(ResponseWithheld) as ei:
            await g.check_body(["a" * 6000, "b" * 4001], usage=None, finish_reason="stop", ttft_seconds=None)
        assert ei.value.detector == "oversize"
        inc = svc.incidents.recent[-1]
        assert (inc.evidence["text_bytes"], inc.evidence["max_text_bytes"], inc.withheld) == (10_001, 10_000, True)
        g = svc.begin(await admitted(svc, ex(STRICT, "write a lot", stream=True)))
        with pytest.raises(ResponseWithheld):
            for i in range(20):
                await g.feed("é" * 300, sse("x"))  # 600 bytes an event
        assert svc.incidents.recent[-1].evidence["text_bytes"] == 10_200
    finally:
        await svc.aclose()


async def test_strict_stream_checks_each_choice_on_its_own(tmp_path):
    """n=2, one word per event, the two choices interleaved: the leaked passage in choice 1 is
    found (joined with choice 0's words it would shingle into nothing)."""
    svc = build_verifier(settings(tmp_path, strict_holdback_tokens=64), secrets=SECRETS)
    try:
        victim = words(30, 600)
        await admitted(svc, ex(A, victim))
        g = svc.begin(await admitted(svc, ex(STRICT, "two answers please", stream=True)))
        leak_words = victim[400:1400].split(" ")
        sent: list[bytes] = []
        with pytest.raises(ResponseWithheld) as ei:
            for i, w in enumerate(leak_words):
                p0, p1 = f" filler{i}", (" " if i else "") + w
                sent += await g.feed(p0 + p1, sse(p0 + p1), pieces=[("0:content", p0), ("1:content", p1)])
        assert ei.value.detector == "leak_index" and sent == []
    finally:
        await svc.aclose()


async def test_strict_stream_releases_nothing_unchecked_in_text_without_safe_cuts(tmp_path):
    """A leaked passage of CJK text (no letter-separator-letter cut, so the shingler buffers up
    to 256 characters before it encodes): no event leaves before its text was checked with 64
    checked tokens behind it, so the leak is cut with nothing of it sent."""
    svc = build_verifier(settings(tmp_path, strict_holdback_tokens=64), secrets=SECRETS)
    try:
        rng = random.Random(40)
        victim = "".join(chr(0x4E00 + rng.randrange(2000)) for _ in range(900))
        await admitted(svc, ex(A, victim))
        g = svc.begin(await admitted(svc, ex(STRICT, "translate", stream=True)))
        leak = victim[100:700]
        sent: list[bytes] = []
        with pytest.raises(ResponseWithheld):
            for ch in leak:
                sent += await g.feed(ch, sse(ch))
        assert sent == []
    finally:
        await svc.aclose()
