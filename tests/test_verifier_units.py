"""Unit tests of the verifier's detectors, with exact values."""

from __future__ import annotations

import random
import re
import uuid

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import redis
from conftest import ROOT, SEEDS

from verifier.canary import CANARY_RE, CanaryRegistry, CanaryScanner, find_canaries, new_canary, surfaced
from verifier.drift import check_finish, check_usage
from verifier.incidents import INCIDENTS, Incident, IncidentSink, read_incidents
from verifier.latency import LatencyModel, bucket_of
from verifier.leak_index import LeakIndex, MemoryLeakStore, RedisLeakStore
from verifier.quarantine import FileQuarantineBackend, Quarantine, RedisQuarantineBackend
from verifier.shingles import (
    IncrementalShingler,
    ShingleHasher,
    encode,
    fingerprints,
    guaranteed_run_tokens,
    is_cut_point,
    longest_common_run,
    winnow,
)

KEY = b"unit-test-leak-index-key"
SEED_ZH = (SEEDS / "000_cd7ee3cfd92e9ff1.txt").read_text()
SEED_PL = (SEEDS / "001_85707760a0179a93.txt").read_text()


# ------------------------------------------------------------------ shingles and winnowing
def test_vectorised_selection_matches_the_reference_winnowing():
    h = ShingleHasher(KEY, 16)
    r = random.Random(11)
    ids = [r.randrange(100_000) for _ in range(5000)]  # no repeated shingle
    fast = h.fast(ids).tolist()
    assert len(fast) == len(ids) - 15 and len(set(fast)) == len(fast)
    kept = winnow(fast, 35)
    expected = {i for i in range(len(fast)) if fast[i] in kept}
    assert set(h.select(ids, 35)) == expected
    assert h.fingerprints(ids, 35) == {h.hash_ids(ids[i : i + 16]) for i in expected}
    # density close to 2 / (w + 1)
    assert 0.04 < len(expected) / len(fast) < 0.07
    assert h.select(ids[:20], 35) == [min(range(5), key=lambda i: (fast[i], -i))]


def _fast_by_definition(h: ShingleHasher, ids: list[int]) -> list[int]:
    """The selection hash as its docstring defines it, in Python integers (mod 2**64)."""
    m64 = (1 << 64) - 1
    poly, xor = int(h._poly), int(h._xor)
    out = []
    for i in range(len(ids) - h.k + 1):
        v = 0
        for t in ids[i : i + h.k]:
            v = (v * poly + t) & m64
        v ^= xor
        for mul in (0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53):
            v ^= v >> 33
            v = (v * mul) & m64
        out.append(v ^ (v >> 33))
    return out


@pytest.mark.parametrize("k", [1, 2, 3, 5, 16, 17])
def test_fast_hash_and_selection_match_their_definitions_with_ties(k):
    """The doubling polynomial equals the plain one for every k (odd and even bits), and the
    selection is the rightmost minimum of every window, each position once, in order, also
    where repeated shingles tie (a prompt of few distinct ids)."""
    h = ShingleHasher(KEY, k)
    r = random.Random(k)
    for n in (0, 1, k - 1, k, k + 1, 60, 300):
        ids = [r.choice((0, 7, 100_276, 2**31 - 1)) for _ in range(n)]  # many ties
        fast = _fast_by_definition(h, ids)
        assert h.fast(ids).tolist() == fast
        for w in (1, 2, 35):
            if len(fast) <= w:
                expected = [max(range(len(fast)), key=lambda i: (-fast[i], i))] if fast else []
            else:
                expected = sorted({max(range(j, j + w), key=lambda i: (-fast[i], i)) for j in range(len(fast) - w + 1)})
            assert h.select(ids, w) == expected


def test_winnow_exact_selection():
    # windows of 3: [5,1,4]->1 [1,4,2]->1 [4,2,8]->2 [2,8,6]->2
    assert winnow([5, 1, 4, 2, 8, 6], 3) == {1, 2}
    # ties: rightmost minimum; a sequence shorter than w keeps its minimum
    assert winnow([3, 3, 3], 2) == {3}
    assert winnow([9, 7], 35) == {7}
    assert winnow([], 35) == set()
    assert guaranteed_run_tokens(16, 35) == 50


def test_hasher_counts_and_key():
    ids = list(range(100, 140))
    h = ShingleHasher(KEY, 16)
    hs = h.hashes(ids)
    assert len(hs) == 40 - 16 + 1 == 25
    assert hs[0] == h.hash_ids(ids[:16]) and hs[-1] == h.hash_ids(ids[-16:])
    assert all(0 <= x < 2**64 for x in hs)
    assert ShingleHasher(b"another key", 16).hashes(ids) != hs
    assert h.hashes(ids[:15]) == []
    with pytest.raises(ValueError):
        ShingleHasher(b"", 16)


def test_any_shared_run_of_50_tokens_is_found():
    """The winnowing guarantee, k=16, w=35: a run of exactly 50 shared tokens, placed at random
    offsets between unrelated random contexts, always shares a stored fingerprint (2,000 trials);
    runs of 15 tokens (shorter than a shingle) never do."""
    h = ShingleHasher(KEY, 16)
    rng = random.Random(7)
    missed_49 = 0
    for trial in range(2000):
        run = [rng.randrange(100_000) for _ in range(50)]
        a = [rng.randrange(100_000) for _ in range(rng.randrange(0, 300))]
        a = a + run + [rng.randrange(100_000) for _ in range(rng.randrange(0, 300))]
        b = [rng.randrange(100_000) for _ in range(rng.randrange(0, 200))]
        b = b + run + [rng.randrange(100_000) for _ in range(rng.randrange(0, 200))]
        stored = fingerprints(h, a, 35)
        assert stored & set(h.hashes(b)), f"trial {trial}: a 50-token run was missed"
        # the bound is tight: the same placement with only 49 shared tokens is sometimes missed
        run49 = run[:49]
        a49 = a[: a.index(run[0])] + run49 + [rng.randrange(100_000) for _ in range(100)]
        b49 = [rng.randrange(100_000) for _ in range(100)] + run49 + [rng.randrange(100_000) for _ in range(100)]
        if not (fingerprints(h, a49, 35) & set(h.hashes(b49))):
            missed_49 += 1
        short = run[:15]
        assert not (stored & set(h.hashes(short)))
    assert missed_49 > 0


def test_incremental_shingler_matches_whole_text():
    h = ShingleHasher(KEY, 16)
    for text, step in ((SEED_PL, 7), (SEED_ZH, 3), (SEED_PL[:3000], 1)):
        whole = h.hashes(encode(text))
        inc = IncrementalShingler(h, max_pending_chars=256)
        got = []
        for i in range(0, len(text), step):
            got += h.hashes(inc.push(text[i : i + step]))
        got += h.hashes(inc.flush())
        assert got == whole
        assert inc.tokens_seen == len(encode(text))


def test_cut_points():
    assert is_cut_point("ab cd", 2)
    assert not is_cut_point("ab  cd", 2)  # double space: whitespace run
    assert not is_cut_point("a1 cd", 2)
    assert not is_cut_point("ab\ncd", 2)
    assert is_cut_point("ab,cd", 2)


def test_longest_common_run():
    assert longest_common_run([1, 2, 3, 4, 5], [9, 2, 3, 4, 8]) == 3
    assert longest_common_run([1], [2]) == 0


# ------------------------------------------------------------------ leak index
def _index(store) -> LeakIndex:
    return LeakIndex(store, ShingleHasher(KEY, 16), 35)


def _leak_index_cases(index: LeakIndex):
    a_prompt = SEED_PL[:4000]
    c_prompt = SEED_ZH[:3000]
    n, own = index.ingest("tenant-a", a_prompt)
    assert own is None and index.ingest("tenant-a", a_prompt, keep_own=True)[1] == index.own_shingles(a_prompt)
    assert n == len(index.prompt_fingerprints(a_prompt)) > 0
    index.ingest("tenant-c", c_prompt)
    a_ids = encode(a_prompt)
    # B's response holds 60 tokens of A's prompt
    run_text = SEED_PL[1000:1400]
    v = index.check_text("tenant-b", "Sure. " + run_text + " Thanks.")
    assert v.foreign >= 1 and v.source_tenant == "tenant-a" and v.public == 0
    assert v.evidence_hashes and all(len(x) == 16 for x in v.evidence_hashes)
    # A's own response quoting its prompt is never evidence
    v_own = index.check_text("tenant-a", run_text)
    assert v_own.foreign == 0 and v_own.own >= 1
    # ... nor is B quoting its own current prompt (own shingles from the exchange)
    own = index.own_shingles("Please repeat: " + run_text)
    v_self = index.check_text("tenant-b", run_text, own)
    # one shingle differs: the slice starts mid-word, which tokenizes differently after "repeat: "
    assert (v_self.foreign, v_self.checked - v_self.own) == (0, 1)
    # a text that both A and C sent is public
    index.ingest("tenant-c", a_prompt)
    v_pub = index.check_text("tenant-b", run_text)
    assert v_pub.foreign == 0 and v_pub.public >= 1
    # unrelated text: nothing
    v_none = index.check_text("tenant-b", "the quick brown fox jumps over the lazy dog " * 8)
    assert (v_none.foreign, v_none.public, v_none.own) == (0, 0, 0)
    assert len(a_ids) > 500


def test_leak_index_memory():
    _leak_index_cases(_index(MemoryLeakStore(3600)))


def test_leak_index_memory_ttl():
    now = [1000.0]
    store = MemoryLeakStore(60, clock=lambda: now[0])
    idx = _index(store)
    idx.ingest("a", SEED_PL[:2000])
    assert idx.check_text("b", SEED_PL[200:800]).foreign >= 1
    now[0] += 61
    assert idx.check_text("b", SEED_PL[200:800]).foreign == 0
    store.sweep()
    assert len(store) == 0


@pytest.fixture
def redis_client():
    c = redis.Redis(host="127.0.0.1", port=6379, db=0)
    prefix = f"test-verifier-{uuid.uuid4().hex[:8]}:"
    yield c, prefix
    keys = list(c.scan_iter(match=prefix + "*"))
    if keys:
        c.delete(*keys)
    c.close()


def test_leak_index_redis(redis_client):
    c, prefix = redis_client
    store = RedisLeakStore(c, 3600, prefix + "leak:")
    _leak_index_cases(_index(store))
    keys = list(c.scan_iter(match=prefix + "leak:{*}:fp:*"))
    # leak:{<top 6 bits of the fingerprint, 2 hex digits>}:fp:<16 hex digits> (the tag: a Cluster slot)
    assert keys and all(
        re.fullmatch(r"\{([0-3][0-9a-f])\}:fp:([0-9a-f]{16})", k.decode()[len(prefix) + 5 :]) for k in keys
    )
    assert all(int(k.decode()[-16:], 16) >> 58 == int(k.decode()[len(prefix) + 6 : len(prefix) + 8], 16) for k in keys)
    k = keys[0]
    assert 0 < c.pttl(k) <= 3_600_000
    # nothing stored is text: values are a tenant id, or "*" once two tenants sent the shingle
    # (C re-sent all of A's prompt above, so every one of A's is public now)
    values = set(c.mget(keys))
    assert values == {b"tenant-c", b"*"}


# ------------------------------------------------------------------ canaries
def test_canary_shape_and_scan():
    c = new_canary()
    assert CANARY_RE.fullmatch(c) and len(c) == 30
    assert find_canaries(f"x {c} y {c} KVGATE-CANARY-0123") == [c]
    other = new_canary()
    assert surfaced(f"{c} and {other}", own_prompt_text=f"plant {c}") == [other]
    sc = CanaryScanner()
    got = []
    for i in range(0, 40, 4):
        got += sc.push(("ab " + c + " cd")[i : i + 4])
    assert got == [c]


def test_canary_registry_memory():
    reg = CanaryRegistry(MemoryLeakStore(3600), KEY)
    c1, c2 = new_canary(), new_canary()
    assert reg.register("honeypot", [c1]) == 1
    m = reg.lookup([c1, c2])
    assert m[0].owners == {"honeypot"} and m[1].owners == set()
    assert m[0].fingerprint == f"{reg.fingerprint(c1):016x}"


# ------------------------------------------------------------------ drift, latency
def test_usage_drift_exact():
    assert check_usage(624, {"prompt_tokens": 624}, 0) is None
    f = check_usage(624, {"prompt_tokens": 1, "completion_tokens": 5}, 0)
    assert f.detector == "usage_drift"
    assert f.evidence == {
        "gateway_prompt_tokens": 624,
        "engine_prompt_tokens": 1,
        "difference_tokens": -623,
        "tolerance_tokens": 0,
    }
    assert check_usage(624, {"prompt_tokens": 626}, 2) is None
    assert check_usage(624, {"prompt_tokens": 627}, 2).evidence["difference_tokens"] == 3
    assert check_usage(624, None, 0) is None
    # a count that is not an integer is drift too: a broken or hostile engine's usage compares with nothing
    assert check_usage(624, {"prompt_tokens": "1"}, 0).evidence["malformed_usage"] == ["prompt_tokens:str"]
    assert check_finish("abort").evidence == {"status_code": 200}
    assert check_finish("stop") is None and check_finish("abort", 500) is None


def test_latency_buckets_and_bound():
    assert [bucket_of(n) for n in (0, 1, 2, 3, 512, 1023, 1024, 5000)] == [0, 0, 1, 1, 9, 9, 10, 12]
    m = LatencyModel(quantile=0.001, margin=0.5, min_samples=50, min_prompt_tokens=512, relative_accuracy=0.01)
    # uncalibrated: never an anomaly (and the sample calibrates: the bound is a low quantile)
    assert m.observe("fresh", 3000, 0.0001).anomaly is False
    assert m.samples("fresh", 11) == 1
    for i in range(50):
        m.observe("u", 3000, 0.200 + i * 0.001)  # bucket 11: 200..249 ms
    bound = m.bound("u", 3000)
    assert bound == pytest.approx(0.100, rel=0.011)  # q(0.001) = min = 200 ms, x 0.5
    v = m.observe("u", 3000, 0.050)
    assert v.anomaly and v.bucket == 11
    assert m.samples("u", 11) == 50  # the anomaly was kept out of calibration
    # a longer prompt, in a bucket with no clean sample, is held to the shorter bucket's bound
    v2 = m.observe("u", 6000, 0.010)
    assert v2.anomaly and v2.bound_seconds == pytest.approx(bound)
    assert m.observe("u", 6000, 0.300).anomaly is False
    # short prompts are never flagged; other upstreams are separate
    assert m.observe("u", 100, 0.00001).anomaly is False
    assert m.observe("other", 3000, 0.001).anomaly is False
    # streamed TTFTs (gateway-measured) are calibrated apart from engine-reported prefill times
    assert m.bound("u", 3000, "stream") is None and m.observe("u", 3000, 0.001, "stream").anomaly is False


def test_latency_neither_judges_nor_keeps_a_ttft_that_is_no_duration():
    """inf overflowed the sketch (OverflowError in the check) and NaN was kept as a sample, leaving
    its bucket's quantiles NaN: neither is judged or recorded, nor is a negative one."""
    m = LatencyModel(quantile=0.001, margin=0.5, min_samples=10, min_prompt_tokens=512)
    for i in range(10):
        m.observe("u", 3000, 0.200 + i * 0.001)
    bound = m.bound("u", 3000)
    for bad in (float("inf"), float("-inf"), float("nan"), -1.0):
        v = m.observe("u", 3000, bad)
        assert (v.anomaly, v.bound_seconds, v.bucket) == (False, None, 11)
    assert m.samples("u", 11) == 10 and m.bound("u", 3000) == bound
    assert m.take_unsaved()[-1][2] == pytest.approx(0.209)


def test_latency_floor_takes_the_fixed_overhead_out_of_the_margin():
    m = LatencyModel(quantile=0.001, margin=0.5, min_samples=10, min_prompt_tokens=512)
    for i in range(10):
        m.observe("u", 100, 0.050 + i * 0.001, "stream")  # bucket 6: the fixed cost, 50 ms
        m.observe("u", 3000, 0.200 + i * 0.001, "stream")  # bucket 11: 200 ms
    # floor 50 ms + 0.5 x (200 - 50) = 125 ms (DDSketch: within 1%)
    assert m.bound("u", 3000, "stream") == pytest.approx(0.125, rel=0.01)
    assert m.bound("u", 6000, "stream") == pytest.approx(0.125, rel=0.01)
    assert m.observe("u", 6000, 0.110, "stream").anomaly  # overhead + a placeholder prefill
    assert not m.observe("u", 3000, 0.150, "stream").anomaly
    # the floor is capped at 0.8 x the top level: 0.8 x 200 + 0.5 x 40 = 180 ms
    m2 = LatencyModel(quantile=0.001, margin=0.5, min_samples=10, min_prompt_tokens=512)
    for i in range(10):
        m2.observe("u", 100, 0.190, "stream")
        m2.observe("u", 3000, 0.200, "stream")
    assert m2.bound("u", 3000, "stream") == pytest.approx(0.180, rel=0.01)


# ------------------------------------------------------------------ incidents, quarantine
def test_incident_records(tmp_path):
    sink = IncidentSink(tmp_path / "inc.jsonl")
    before = INCIDENTS.labels("canary", "up-x")._value.get()
    inc = sink.emit(
        Incident("canary", "t1", "up-x", "req-1", {"canaries": 1, "canary_hashes": ["00ff" * 4]}, confirmed=True)
    )
    assert INCIDENTS.labels("canary", "up-x")._value.get() == before + 1
    rows = read_incidents(tmp_path / "inc.jsonl")
    assert len(rows) == 1
    r = rows[0]
    assert set(r) == {"detector", "tenant", "upstream", "request_id", "evidence", "confirmed", "withheld", "id", "time"}
    assert (r["id"], r["detector"], r["tenant"], r["upstream"], r["confirmed"]) == (
        inc.id,
        "canary",
        "t1",
        "up-x",
        True,
    )
    with pytest.raises(ValueError):
        Incident("canary", "t", "u", "r", {"text": "x" * 81})
    with pytest.raises(ValueError):
        Incident("nope", "t", "u", "r", {})


def _quarantine_cases(q: Quarantine):
    assert not q.is_quarantined("up1", 5000)
    rec = q.put("up1", "inc_1", "canary", 1024)
    assert rec.min_prompt_tokens == 1024
    q.refresh()
    assert q.is_quarantined("up1", 1025) and not q.is_quarantined("up1", 1024)
    assert not q.is_quarantined("up2", 5000)
    q.put("up1", "inc_2", "leak_index", 10)  # the first record stays
    q.refresh()
    assert q.records()["up1"].incident_id == "inc_1"
    assert q.clear("up1") is True and q.clear("up1") is False
    q.refresh()
    assert not q.is_quarantined("up1", 5000)


def test_quarantine_file(tmp_path):
    _quarantine_cases(Quarantine(FileQuarantineBackend(tmp_path)))


def test_quarantine_redis(redis_client):
    c, prefix = redis_client
    _quarantine_cases(Quarantine(RedisQuarantineBackend(c, prefix)))


def test_upstream_clear_cli(tmp_path, capsys):
    from gateway.cli import main

    cfg = tmp_path / "kvgate.yaml"
    cfg.write_text(
        f"state_dir: {tmp_path}\nmodels: [{{id: m, context_length: 8192}}]\n"
        "upstreams: [{name: local, api_url: 'http://127.0.0.1:1/v1', pool_source: static, "
        "static_pool_tokens: 4096, models: [m]}]\n"
    )
    Quarantine(FileQuarantineBackend(tmp_path)).put("local", "inc_abc", "canary", 1024)
    assert main(["upstream", "--config", str(cfg), "list"]) == 0
    out = capsys.readouterr().out
    assert "local: quarantined since" in out and "above 1024 tokens (incident inc_abc, detector canary)" in out
    assert main(["upstream", "--config", str(cfg), "clear", "local"]) == 0
    assert capsys.readouterr().out == "upstream 'local': quarantine cleared\n"
    assert main(["upstream", "--config", str(cfg), "clear", "local"]) == 1
    assert capsys.readouterr().err == "upstream 'local' is not quarantined\n"
    assert Quarantine(FileQuarantineBackend(tmp_path)).records() == {}


def test_squeeze_runs_shortens_runs_of_one_character_and_of_any_whitespace():
    """Against a regex reference: runs of one repeated character, and runs of mixed whitespace
    (``str.isspace``: tabs, newlines, U+00A0, U+3000 ...), longer than 64 become their first 64
    characters; nothing else changes. 500,000 space-tab pairs then ``x`` (a tiktoken panic
    unsqueezed) become 32 pairs and ``x``."""
    import re

    from verifier.shingles import squeeze_runs

    def reference(t: str) -> str:
        t = re.sub(r"\s{65,}", lambda m: m.group()[:64], t)
        return re.sub(r"(.)\1{64,}", lambda m: m.group()[:64], t, flags=re.S)

    rng = random.Random(2)
    alpha = [" ", "\t", "\n", "a", "b", "\u3000", "\u00a0", "\u00e9", "\U0001f600", "\u3001"]
    for _ in range(2000):
        parts = []
        for _ in range(rng.randint(0, 12)):
            r = rng.random()
            if r < 0.3:
                parts.append(rng.choice(alpha))
            elif r < 0.65:
                parts.append(rng.choice(alpha[:3] + alpha[5:7] + alpha[8:]) * rng.randint(1, 80))
            else:
                parts.append(rng.choice("ab") * rng.randint(1, 90))
        text = "".join(parts)
        assert squeeze_runs(text) == reference(text), repr(text)
    assert squeeze_runs(" \t" * 500_000 + "x") == " \t" * 32 + "x"


@settings(max_examples=400, deadline=None)
@given(
    st.text(alphabet="ab \t\u3000\u00e9.", max_size=40),
    st.sampled_from(["a", " ", "\t", "\u00e9", "\u3000", ".", " \t", "a "]),
    st.integers(min_value=28, max_value=72),
    st.text(alphabet="ab \t\u3000\u00e9.", max_size=40),
)
def test_squeeze_runs_grid_sample_never_misses_a_run(prefix: str, unit: str, reps: int, suffix: str) -> None:
    """The sample of every 13th character that lets most texts through unchanged never misses a
    run of 65 at any offset: runs of 28-144 characters (one character, or two alternating) put
    anywhere in short mixed text squeeze as the regex reference does."""
    from verifier.shingles import squeeze_runs

    text = prefix + (unit * reps)[: reps if len(unit) == 1 else 2 * reps] + suffix
    want = re.sub(
        r"(.)\1{64,}", lambda m: m.group()[:64], re.sub(r"\s{65,}", lambda m: m.group()[:64], text), flags=re.S
    )
    assert squeeze_runs(text) == want


def test_squeeze_runs_quick_path_on_real_text():
    """The demo texts (English and multilingual), short and long: no run to squeeze, the text
    itself back; a run of 65 (one character, or mixed whitespace) put in is squeezed to 64,
    on either side of the quick path's size bound."""
    from verifier.shingles import _QUICK_CHARS, squeeze_runs

    for path in sorted((ROOT / "gateway" / "stack" / "demo_texts").glob("*.txt")):
        full = path.read_text(encoding="utf-8")
        for text in (full[:900], full[:_QUICK_CHARS], full * (1 + 2 * _QUICK_CHARS // len(full))):
            assert squeeze_runs(text) is text
            # between two letters, neither of them the run's own character
            pair = (text[i - 1 : i + 1] for i in range(len(text) // 2, len(text)))
            mid = len(text) // 2 + next(j for j, p in enumerate(pair) if p.isalpha() and "\u00e9" not in p)
            for run in ("\u00e9" * 65, " \t\n\u3000" * 17):
                assert squeeze_runs(text[:mid] + run + text[mid:]) == text[:mid] + run[:64] + text[mid:]
