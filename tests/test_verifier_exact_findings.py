"""The verifier's finding decisions pinned at their edges, with exact values: which usage reports
are drift, which texts hold a canary, which response shingles are foreign evidence, which TTFTs
are anomalies, and how many distinct source tenants count against an upstream."""

from __future__ import annotations

import math

import pytest

from verifier.canary import find_canaries
from verifier.drift import check_finish, check_usage
from verifier.latency import LatencyModel
from verifier.leak_index import LeakIndex, LeakVerdict, MemoryLeakStore
from verifier.quarantine import FileQuarantineBackend, Quarantine, RedisQuarantineBackend
from verifier.shingles import ShingleHasher
from verifier.stage import StreamUsage

CANARY = "KVGATE-CANARY-0123456789abcdef"


# ------------------------------------------------------------------ usage drift
def _evidence(engine, diff, problems=None, **extra):
    ev = {
        "gateway_prompt_tokens": 100,
        "engine_prompt_tokens": engine,
        "difference_tokens": diff,
        "tolerance_tokens": 2,
    }
    if problems is not None:
        ev["malformed_usage"] = problems
    return {**ev, **extra}


def _details(cached):
    return {"prompt_tokens": 100, "prompt_tokens_details": {"cached_tokens": cached}}


@pytest.mark.parametrize(
    ("usage", "expected"),
    [
        (None, None),
        ([{"prompt_tokens": 1}], None),
        ({}, _evidence(None, None, ["prompt_tokens:missing"])),
        ({"prompt_tokens": 102}, None),
        ({"prompt_tokens": 98}, None),
        ({"prompt_tokens": 103}, _evidence(103, 3)),
        ({"prompt_tokens": 97}, _evidence(97, -3)),
        ({"prompt_tokens": 100, "prompt_tokens_details": None}, None),
        ({"prompt_tokens": 100, "prompt_tokens_details": {}}, None),
        (_details(None), None),
        (_details(0), None),
        (_details(100), None),
        (_details(101), _evidence(100, 0, ["cached_tokens>prompt_tokens"])),
        (_details(-1), _evidence(100, 0, ["cached_tokens<0"])),
        (_details(1.0), _evidence(100, 0, ["cached_tokens:float"])),
        (_details(True), _evidence(100, 0, ["cached_tokens:bool"])),
        ({"prompt_tokens": 100, "prompt_tokens_details": [5]}, _evidence(100, 0, ["prompt_tokens_details:list"])),
        ({"prompt_tokens": 100, "prompt_tokens_details": 5}, _evidence(100, 0, ["prompt_tokens_details:int"])),
        # no count to hold a cache hit against: only the count is malformed
        (
            {"prompt_tokens": "100", "prompt_tokens_details": {"cached_tokens": 500}},
            _evidence(None, None, ["prompt_tokens:str"]),
        ),
        (
            {"prompt_tokens_details": {"cached_tokens": -1}},
            _evidence(None, None, ["prompt_tokens:missing", "cached_tokens<0"]),
        ),
        ({"prompt_tokens": None}, _evidence(None, None, ["prompt_tokens:null"])),
        (
            {"prompt_tokens": True, "prompt_tokens_details": {"cached_tokens": None}},
            _evidence(None, None, ["prompt_tokens:bool"]),
        ),
        ({"prompt_tokens": 100.0}, _evidence(None, None, ["prompt_tokens:float"])),
        # counts clamped to the signed 64-bit range, exactly at its edges
        ({"prompt_tokens": 2**63 - 1}, _evidence(2**63 - 1, 2**63 - 101)),
        ({"prompt_tokens": 2**70}, _evidence(2**63 - 1, 2**63 - 1)),
        ({"prompt_tokens": -(2**70)}, _evidence(-(2**63), -(2**63))),
        ({"prompt_tokens": -(2**63)}, _evidence(-(2**63), -(2**63))),
        # a stream whose reports disagreed is drift even when the largest count is right
        (
            StreamUsage({"prompt_tokens": 100}, [1, 100]),
            _evidence(100, 0, ["prompt_tokens:disagree"], engine_prompt_tokens_reported=[1, 100]),
        ),
        (
            StreamUsage({"prompt_tokens": 100, "prompt_tokens_details": {"cached_tokens": -2}}, [100, "str"]),
            _evidence(
                100, 0, ["cached_tokens<0", "prompt_tokens:disagree"], engine_prompt_tokens_reported=[100, "str"]
            ),
        ),
    ],
)
def test_usage_drift_finding_is_exact_at_every_edge(usage, expected):
    """``check_usage(100, usage, tolerance 2)``: no finding within the tolerance or for an honest
    cache hit from 0 to the prompt; otherwise exactly these counts and malformed codes."""
    f = check_usage(100, usage, 2)
    assert (None if f is None else (f.detector, f.evidence)) == (
        None if expected is None else ("usage_drift", expected)
    )


@pytest.mark.parametrize(
    ("reason", "status", "found"),
    [
        ("abort", None, True),
        ("abort", 200, True),
        ("abort", 299, True),
        ("abort", 300, False),
        ("abort", 199, False),
        ("stop", 200, False),
    ],
)
def test_finish_abort_is_a_finding_only_under_a_2xx(reason, status, found):
    """``status`` ``None``: not given (a 200)."""
    f = check_finish(reason) if status is None else check_finish(reason, status)
    assert (None if f is None else (f.detector, f.evidence)) == (
        ("finish_abort", {"status_code": status or 200}) if found else None
    )


# ------------------------------------------------------------------ canaries
_ALL_INVISIBLE = "\u00ad\u200b\u200c\u200d\u2060\ufeff"


@pytest.mark.parametrize(
    "mark", [*_ALL_INVISIBLE, _ALL_INVISIBLE], ids=[*(f"U+{ord(c):04X}" for c in _ALL_INVISIBLE), "all"]
)
def test_a_canary_with_invisible_characters_between_its_letters_is_found(mark):
    """Each invisible character, and all six of them together, between every two letters."""
    assert find_canaries("seen: " + mark.join(CANARY) + " ok") == [CANARY]


# ------------------------------------------------------------------ quarantine
@pytest.mark.parametrize("kind", ["file", "redis"])
def test_evidence_counts_distinct_sources_per_upstream_within_the_window(kind, tmp_path, redis_client, redis_prefix):
    """Both backends: a source counts once however often it recurs, per upstream, and drops out
    exactly ``window`` seconds after its last evidence (at ``now - window`` it is gone)."""
    b = FileQuarantineBackend(tmp_path) if kind == "file" else RedisQuarantineBackend(redis_client, redis_prefix + ":")
    got = [
        b.add_evidence("up", "a", 1000.0, 60),
        b.add_evidence("up", "a", 1030.0, 60),
        b.add_evidence("up2", "b", 1030.0, 60),
        b.add_evidence("up", "b", 1089.5, 60),
        b.add_evidence("up", "c", 1090.0, 60),
        b.add_evidence("up", "a", 1150.0, 60),
    ]
    assert got == [1, 1, 1, 2, 2, 1]


def test_a_stale_view_is_reread_once_refresh_seconds_have_passed(tmp_path):
    """Another process's quarantine shows here at the first look ``refresh_seconds`` after the
    last read, not before (the view is a cache of the store)."""
    now = [10.0]
    writer = Quarantine(FileQuarantineBackend(tmp_path))
    reader = Quarantine(FileQuarantineBackend(tmp_path), refresh_seconds=1.0, clock=lambda: now[0])
    seen = [reader.is_quarantined("up", 5000)]
    writer.put("up", "inc_1", "probe", 1024)
    for t in (10.5, 10.999, 11.0):
        now[0] = t
        seen.append(reader.is_quarantined("up", 5000))
    assert seen == [False, False, False, True]


# ------------------------------------------------------------------ leak index
def _leak_index(public_tenants: int = 3) -> LeakIndex:
    return LeakIndex(
        MemoryLeakStore(3600), ShingleHasher(b"exact-findings-key", 4), 5, MemoryLeakStore(3600), public_tenants
    )


def _counts(v: LeakVerdict) -> tuple:
    return (v.checked, v.own, v.public, v.public_answers, v.foreign, v.foreign_by_tenant, v.source_tenant)


def test_a_shingle_is_evidence_only_when_exactly_one_other_tenant_sent_it():
    """Owners ``{}``: nothing; the tenant among them (even with others): own; two or more other
    tenants: public; exactly one other tenant: foreign evidence, named by its fingerprint."""
    idx = _leak_index()
    v = LeakVerdict()
    hashes = [0x11, 0x22, 0x33, 0x44, 0x55, 0x66]
    owners = [set(), {"b"}, {"a", "b"}, {"a", "c"}, {"a"}, {"c"}]
    idx.classify(v, "b", hashes, owners=owners)
    assert _counts(v) == (0, 2, 1, 0, 2, {"a": 1, "c": 1}, "a")
    assert v.evidence_hashes == ["0000000000000055", "0000000000000066"]


def test_text_recited_to_public_tenants_other_tenants_is_no_longer_evidence():
    """Answers to 3 distinct other tenants held the shingle: from then on it is public text. The
    first answers are reported, repeats of one tenant count once, an answer not recorded
    (``record_spread`` false) counts for nobody, and the asking tenant's own earlier answers do
    not count towards its own. Without a spread store the rule is off."""
    idx = _leak_index(public_tenants=3)
    found = []
    for tenant, record in [("b", True), ("b", True), ("c", False), ("d", True), ("e", True), ("d", True), ("f", True)]:
        v = LeakVerdict()
        idx.classify(v, tenant, [0x77], record, owners=[{"a"}])
        found.append((v.foreign, v.public, v.public_answers))
    # f's answer: b, d and e answered before
    assert found == [(1, 0, 0)] * 6 + [(0, 1, 1)]
    off = LeakIndex(MemoryLeakStore(3600), ShingleHasher(b"exact-findings-key", 4), 5)
    found = []
    for tenant in "bcdef":
        v = LeakVerdict()
        off.classify(v, tenant, [0x77], owners=[{"a"}])
        found.append((v.foreign, v.public))
    assert found == [(1, 0)] * 5


def test_evidence_names_at_most_eight_fingerprints_and_the_largest_source_wins_ties_by_name():
    idx = _leak_index()
    v = LeakVerdict()
    hashes = list(range(1, 11))
    idx.classify(v, "x", hashes, owners=[{"b"}] * 5 + [{"a"}] * 5)
    assert (v.foreign, v.foreign_by_tenant, v.source_tenant) == (10, {"b": 5, "a": 5}, "a")
    assert v.evidence_hashes == [f"{h:016x}" for h in range(1, 9)]
    more = LeakVerdict(foreign=2, foreign_by_tenant={"b": 2}, evidence_hashes=["00000000000000ff"])
    v.merge(more)
    assert (v.foreign, v.foreign_by_tenant, v.source_tenant, len(v.evidence_hashes)) == (12, {"b": 7, "a": 5}, "b", 8)


def test_repeated_own_and_already_seen_shingles_are_not_looked_up():
    """Response ids with 7 shingles (k = 4), 6 distinct: 2 in the own prompt, 1 seen before; the
    other 3 are looked up: one is another tenant's (foreign), one public, one nobody's."""
    idx = _leak_index()
    h = idx.hasher
    ids = [1, 2, 3, 4, 5, 6, 1, 2, 3, 4]  # shingles 0..6; shingle 6 repeats shingle 0
    fast = h.fast(ids).tolist()
    assert len(set(fast)) == 6 and fast[6] == fast[0]
    full = h.hashes(ids)
    idx.store.add("a", [full[3]])
    idx.store.add("a", [full[4]])
    idx.store.add("c", [full[4]])
    seen = {fast[2]}
    v = idx.check_ids("b", ids, own={fast[0], fast[1]}, seen=seen)
    assert _counts(v) == (5, 2, 1, 0, 1, {"a": 1}, "a")
    assert v.evidence_hashes == [f"{full[3]:016x}"]
    assert seen == set(fast)
    again = idx.check_ids("b", ids, seen=seen)
    assert _counts(again) == (0, 0, 0, 0, 0, {}, None)


def test_a_tenants_claim_on_a_fingerprint_expires_exactly_ttl_after_its_last_send():
    now = [1000.0]
    store = MemoryLeakStore(60, clock=lambda: now[0])
    store.add("a", [1])
    now[0] = 1030.0
    store.add("b", [1, 2])
    got = []
    for t in (1059.5, 1060.0, 1089.5):
        now[0] = t
        got.append(store.owners([1, 2, 3]))
    store.sweep()
    kept = len(store)
    now[0] = 1090.0
    got.append(store.owners([1, 2]))
    store.sweep()
    assert got == [[{"a", "b"}, {"b"}, set()], [{"b"}, {"b"}, set()], [{"b"}, {"b"}, set()], [set(), set()]]
    assert (kept, len(store)) == (2, 0)


# ------------------------------------------------------------------ latency
def _calibrate(m: LatencyModel, prompt_tokens: int, ttft: float, tenants: str = "abc", n: int = 4) -> None:
    for t in tenants:
        for _ in range(n):
            m.record("up", prompt_tokens, ttft, "whole", "m", t)


def test_a_bucket_calibrates_only_with_min_samples_from_min_tenants_each_capped():
    """``min_samples`` 8, one tenant's samples counting at most 4 (share 0.5), 3 tenants: two
    tenants' 100 samples are not enough; 100 samples of one tenant and 1 each of two others are
    6, uncalibrated, until 2 more make 8."""
    bounds = []
    m = LatencyModel(min_samples=8, min_prompt_tokens=512, tenant_share=0.5, min_tenants=3)
    for tenant, n in [("a", 50), ("b", 50), ("c", 1)]:
        _calibrate(m, 3000, 0.40, tenant, n)
        bounds.append(m.bound("up", 3000, "whole", "m"))
    m = LatencyModel(min_samples=8, min_prompt_tokens=512, tenant_share=0.5, min_tenants=3)
    for tenant, n in [("a", 100), ("b", 1), ("c", 1), ("b", 1), ("b", 1)]:
        _calibrate(m, 3000, 0.40, tenant, n)
        bounds.append(m.bound("up", 3000, "whole", "m"))
    assert [b is not None for b in bounds] == [False, False, True, False, False, False, False, True]
    assert bounds[2] == bounds[7] == pytest.approx(0.20, rel=0.01)


def test_a_longer_bucket_never_raises_a_shorter_prompts_bound():
    """Buckets 9 (0.40 s) and 10 (4.0 s): a prompt of bucket 9 is held to bucket 9 alone."""
    m, ref = LatencyModel(min_samples=3, min_tenants=3), LatencyModel(min_samples=3, min_tenants=3)
    for model in (m, ref):
        _calibrate(model, 600, 0.40)
    _calibrate(m, 1500, 4.0)
    assert m.bound("up", 600, "whole", "m") == ref.bound("up", 600, "whole", "m")
    assert m.bound("up", 1500, "whole", "m") > m.bound("up", 600, "whole", "m")


def test_an_anomaly_is_strictly_faster_than_the_bound_from_min_prompt_tokens_on():
    m = LatencyModel(min_samples=3, min_prompt_tokens=512, min_tenants=3)
    _calibrate(m, 600, 0.40)
    b = m.bound("up", 600, "whole", "m")
    fast = math.nextafter(b, 0.0)
    got = [
        m.judge("up", n, t, "whole", model="m").anomaly
        for n, t in [(600, b), (600, fast), (600, 0.0), (512, fast), (511, 0.0)]
    ]
    assert got == [False, True, True, True, False]
