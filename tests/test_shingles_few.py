"""A short text's selection hashes (:data:`verifier.shingles.FEW_SHINGLES` shingles or fewer,
hashed in Python ints) are the array path's, bit for bit."""

from __future__ import annotations

import random

import pytest

import verifier.shingles as shingles
from verifier.shingles import ShingleHasher


@pytest.mark.parametrize("k", [1, 4, 5, 16, 17, 31])
def test_few_shingles_hash_as_the_array_path(k, monkeypatch):
    rng = random.Random(k)
    h = ShingleHasher(b"few-%d" % k, k)
    cases = [[rng.randrange(0, 200_000) for _ in range(k + n - 1)] for n in range(1, 7) for _ in range(20)]
    cases.append([2**32 - 1] * (k + 1))
    short = [h.fast(ids) for ids in cases]
    monkeypatch.setattr(shingles, "FEW_SHINGLES", 0)
    for ids, got in zip(cases, short, strict=True):
        want = h.fast(ids)
        assert got.dtype == want.dtype and got.tolist() == want.tolist()


@pytest.mark.parametrize("k", [1, 16, 17])
def test_matmul_and_doubling_paths_hash_alike(k, monkeypatch):
    """A prompt of at most :data:`verifier.shingles.MATMUL_SHINGLES` shingles (one matrix
    product) hashes as the doubling path does, on both sides of the bound, ids up to 2**32 - 1."""
    rng = random.Random(100 + k)
    h = ShingleHasher(b"matmul-%d" % k, k)
    bound = shingles.MATMUL_SHINGLES
    cases = [[rng.randrange(0, 2**32) for _ in range(n + k - 1)] for n in (5, 6, 187, bound - 1, bound, bound + 1)]
    got = [h.fast(ids).tolist() for ids in cases]
    monkeypatch.setattr(shingles, "MATMUL_SHINGLES", 0)
    assert got == [h.fast(ids).tolist() for ids in cases]
