"""The admission fingerprint of a prompt the same tenant sent recently comes from the cache
(verifier.fingerprint_cache, verifier.jobs.IngestBudget.fingerprint): the same fingerprints,
canaries and own-shingle set as computed afresh, for any text; never another tenant's entry; the
returned sets are the caller's own; bounded in bytes, least recently used first; long texts
never kept."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from config.models import TenantConfig
from tests.fixtures.settings import verifier_settings
from tests.test_verifier_inline_ingest import ex, prose
from verifier.build import build_verifier
from verifier.canary import new_canary
from verifier.fingerprint_cache import MAX_TEXT_CHARS, FingerprintCache, Fingerprinted
from verifier.jobs import IngestBudget

SECRETS = {"leak_index_key": b"fp-cache-key", "cache_salt_key": b"x", "admin_key": b"y"}
A = TenantConfig(id="a", verify_sample_rate=1.0)
B = TenantConfig(id="b", verify_sample_rate=1.0)


@pytest.fixture
def budget(tmp_path):
    svc = build_verifier(verifier_settings(tmp_path), secrets=SECRETS)
    return svc.ingest


def counting(budget: IngestBudget, monkeypatch) -> list[str]:
    """Records every text :meth:`IngestBudget._fingerprint` computes (a cache miss)."""
    computed: list[str] = []
    real = budget._fingerprint

    def spy(text, yield_gil):
        computed.append(text)
        return real(text, yield_gil)

    monkeypatch.setattr(budget, "_fingerprint", spy)
    return computed


def sampled(t: TenantConfig, text: str):
    e = ex(t, text)
    e.state.sampled = True
    return e


def test_a_prompt_sent_again_by_its_tenant_is_not_fingerprinted_again(budget, monkeypatch):
    computed = counting(budget, monkeypatch)
    text = prose(900, seed=3) + " " + new_canary()
    first_ex, again_ex = sampled(A, text), sampled(A, text)
    first = budget.fingerprint(first_ex, text)
    again = budget.fingerprint(again_ex, text)
    assert computed == [text] and len(budget.fingerprints) == 1
    assert again == first and len(first[0]) >= 5 and len(first[1]) == 1
    assert again_ex.state.own_shingles == first_ex.state.own_shingles and len(first_ex.state.own_shingles) >= 100
    assert again_ex.state.own_shingles is first_ex.state.own_shingles  # built once, shared (read only)
    first[0].clear()  # the caller's own copies: the next hit is whole
    first[1].clear()
    assert budget.fingerprint(ex(A, text), text) == again


def test_another_tenants_same_prompt_is_computed_for_it(budget, monkeypatch):
    computed = counting(budget, monkeypatch)
    text = prose(700, seed=4)
    a = budget.fingerprint(ex(A, text), text)
    b = budget.fingerprint(ex(B, text), text)
    assert computed == [text, text] and a == b  # the same result, from its own computation
    assert len(budget.fingerprints) == 2
    assert FingerprintCache.key("a", text) != FingerprintCache.key("b", text)
    assert FingerprintCache.key("a:", "x") != FingerprintCache.key("a", ":x")  # the tenant id is delimited


def test_an_unsampled_hit_sets_no_own_shingles(budget):
    text = prose(500, seed=5)
    budget.fingerprint(sampled(A, text), text)
    plain = ex(A, text)
    budget.fingerprint(plain, text)
    assert plain.state.own_shingles is None


def test_long_texts_are_not_remembered(budget, monkeypatch):
    computed = counting(budget, monkeypatch)
    text = prose(MAX_TEXT_CHARS + 1, seed=6)
    budget.fingerprint(ex(A, text), text)
    budget.fingerprint(ex(A, text), text)
    assert len(computed) == 2 and len(budget.fingerprints) == 0


def entry(n: int) -> Fingerprinted:
    return Fingerprinted(frozenset(range(n)), (), np.zeros(100, dtype=np.uint64))


def test_the_cache_is_bounded_in_bytes_least_recently_used_first():
    size = entry(1).nbytes
    assert size == 800 + 72 * 100 + 100 + 600  # array, own-shingle set, one fingerprint, the rest
    cache = FingerprintCache(max_bytes=3 * size)
    for i in range(5):
        cache.put(bytes([i]), entry(1))
    assert len(cache) == 3 and cache.nbytes == 3 * size
    assert [cache.get(bytes([i])) is not None for i in range(5)] == [False, False, True, True, True]
    assert cache.get(bytes([2])) is not None  # used last: 3 is now the least recently used
    cache.put(bytes([5]), entry(1))
    assert [cache.get(bytes([i])) is not None for i in (2, 3, 4, 5)] == [True, False, True, True]
    cache.put(bytes([4]), entry(1))  # replaced, not counted twice
    assert cache.nbytes == 3 * size
    cache.put(b"big", Fingerprinted(frozenset(), (), np.zeros(1000, dtype=np.uint64)))  # larger than the bound
    assert cache.get(b"big") is None and len(cache) == 3
    cache.put(None, entry(1))  # a text too long to have a key
    assert len(cache) == 3
    with pytest.raises(ValueError):
        cache.get(bytes([4])).fast[0] = 1  # read-only: no caller changes a remembered array


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(min_size=0, max_size=600))
def test_a_hit_equals_a_fresh_computation_for_any_text(budget, text):
    """Whatever the text (runs, whitespace, any code point), the cached answer is the fresh one."""
    fresh = budget._fingerprint(text, False)
    first, hit = sampled(A, text), sampled(A, text)
    assert budget.fingerprint(first, text) == (set(fresh.fps), list(fresh.canaries))
    assert budget.fingerprint(hit, text) == (set(fresh.fps), list(fresh.canaries))
    assert hit.state.own_shingles == first.state.own_shingles == set(fresh.fast.tolist())
