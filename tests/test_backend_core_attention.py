"""The paged attention op's decode batch (its K/V gathered once into padded buffers, attended in one
call): each row equals that sequence attended alone (within 1e-6: the batched kernel's threads may
split the rows differently), and reads no slot outside the sequence's own positions (every other
slot of the pool holds NaN here)."""

from __future__ import annotations

import pytest
import torch

from gpu_backend.attention import PagedAttention, SeqSpan
from gpu_backend.kv_pool import KVPool

HQ, HKV, D, PAGE = 6, 2, 8, 4


def _pool_with(tables: list[list[int]], lens: list[int]) -> KVPool:
    """A one-layer pool: NaN everywhere except each sequence's positions 0 .. len - 1 (random)."""
    pool = KVPool(32, PAGE, 1, HKV, D, torch.float32, "cpu")
    pool.kv.fill_(float("nan"))
    kc, vc = pool.layer_cache(0)
    g = torch.Generator().manual_seed(1)
    for pages, n in zip(tables, lens, strict=True):
        slots = torch.tensor([pages[m // PAGE] * PAGE + m % PAGE for m in range(n)])
        kc[slots] = torch.randn(n, HKV, D, generator=g)
        vc[slots] = torch.randn(n, HKV, D, generator=g)
    return pool


CASES = {
    "uniform": ([[0, 1, 2], [3, 4, 5], [6, 7, 8]], [9, 9, 9]),
    "uneven-spacing": ([[0, 1, 2], [4, 5, 6], [7, 8, 9]], [9, 9, 9]),
    "reverse-order": ([[6, 7, 8], [3, 4, 5], [0, 1, 2]], [9, 9, 9]),
    "lengths-differ": ([[0, 1, 2], [3, 4, 5], [6, 7, 8]], [9, 5, 12]),
    "scattered-pages": ([[0, 9, 2], [3, 4, 5], [10, 7, 1]], [9, 9, 9]),
}


@pytest.mark.parametrize("case", CASES)
def test_decode_batch_equals_each_sequence_alone_and_reads_only_its_own_slots(case):
    tables, lens = CASES[case]
    pool = _pool_with(tables, [n - 1 for n in lens])
    g = torch.Generator().manual_seed(2)
    B = len(tables)
    q, k, v = (
        torch.randn(B, HQ, D, generator=g),
        torch.randn(B, HKV, D, generator=g),
        torch.randn(B, HKV, D, generator=g),
    )
    spans = [SeqSpan(t, n - 1, 1) for t, n in zip(tables, lens, strict=True)]
    with torch.inference_mode():
        attn = PagedAttention(pool, spans)
        out = attn.attend(0, q, k, v, D**-0.5)
        alone = [
            PagedAttention(pool, [s]).attend(0, q[b : b + 1], k[b : b + 1], v[b : b + 1], D**-0.5)
            for b, s in enumerate(spans)
        ]
    assert not out.isnan().any()
    ref = torch.cat(alone)
    # one batched kernel call over padded buffers: its threads may split the rows differently (~6e-8)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)
