"""KV pool (invariants 3 and 4 at the pool level) and pool sizing (SGLang's formula)."""

from __future__ import annotations

import pytest
import torch
from backend_core_support import make_engine  # noqa: F401  (fixture)

from gpu_backend import packed_linear, pool_sizing
from gpu_backend.errors import StaleHandleError
from gpu_backend.kv_pool import KVPool, PageHandle


def _pool(scrub: bool = True, pages: int = 4) -> KVPool:
    return KVPool(pages, 4, num_layers=2, num_kv_heads=2, head_dim=3, dtype=torch.float32, device="cpu", scrub=scrub)


def _pages(n: int, value: float) -> torch.Tensor:
    return torch.full((n, 2, 2, 4, 2, 3), value)


def test_alloc_free_accounting():
    pool = _pool()
    assert pool.stats() == {"total_pages": 4, "free_pages": 4, "used_pages": 0, "page_size": 4}
    a = pool.try_alloc(3, "a")
    assert [h.index for h in a] == [0, 1, 2] and all(h.generation == 0 for h in a)
    assert pool.try_alloc(2, "b") is None  # nothing taken on failure
    assert pool.stats() == {"total_pages": 4, "free_pages": 1, "used_pages": 3, "page_size": 4}
    assert pool.owner[:3] == ["a", "a", "a"]
    assert pool.free(a) == 3
    assert pool.stats()["free_pages"] == 4 and pool.stats()["used_pages"] == 0
    b = pool.try_alloc(4, "b")  # FIFO free list: the never-used page first, then the released ones
    assert [tuple(h) for h in b] == [(3, 0), (0, 1), (1, 1), (2, 1)]
    pool.free(b)
    assert pool.pages_for(0) == 0 and pool.pages_for(1) == 1 and pool.pages_for(4) == 1 and pool.pages_for(5) == 2


def test_stale_handles_raise_and_released_pages_read_zero():
    pool = _pool()
    hs = pool.try_alloc(2, "a")
    pool.write_pages(hs, _pages(2, 7.0))
    assert torch.equal(pool.read_pages(hs), _pages(2, 7.0))
    assert not pool.page_is_zero(hs[0].index)
    pool.free(hs)
    assert pool.page_is_zero(0) and pool.page_is_zero(1)
    assert pool.generation[:2] == [1, 1]
    with pytest.raises(StaleHandleError):
        pool.read_pages(hs)
    with pytest.raises(StaleHandleError):
        pool.write_pages(hs, _pages(2, 1.0))
    with pytest.raises(StaleHandleError):
        pool.check(hs)
    with pytest.raises(StaleHandleError):
        pool.free(hs)  # double free
    assert pool.stats() == {"total_pages": 4, "free_pages": 4, "used_pages": 0, "page_size": 4}
    # the page handed out again works through its new handle only
    again = pool.try_alloc(4, "b")
    fresh = [h for h in again if h.index == 0][0]
    assert fresh == PageHandle(0, 1)
    assert torch.equal(pool.read_pages([fresh]), torch.zeros(1, 2, 2, 4, 2, 3))
    with pytest.raises(StaleHandleError):
        pool.read_pages([PageHandle(0, 0)])
    assert pool.free(again + [PageHandle(0, 0)], ignore_stale=True) == 4
    with pytest.raises(ValueError):
        pool.write_pages(pool.try_alloc(1, "c"), _pages(2, 1.0))


def test_no_scrub_keeps_stale_data_readable():
    """The ``no_scrub`` fault (test use only): no zeroing, no generation check."""
    pool = _pool(scrub=False)
    hs = pool.try_alloc(1, "a")
    pool.write_pages(hs, _pages(1, 5.0))
    pool.free(hs)
    assert not pool.page_is_zero(hs[0].index)
    assert torch.equal(pool.read_pages(hs), _pages(1, 5.0))  # stale handle reads the old tenant's KV
    assert pool.stats()["free_pages"] == 4


def test_pool_sizing_formula():
    cell = pool_sizing.kv_cell_bytes(2, 2, 16, torch.float32)
    assert cell == 512
    assert pool_sizing.kv_cell_bytes(32, 8, 128, torch.bfloat16) == 131072  # Llama-3-8B: 128 KiB / token
    # 0.88 x 128 MiB - 51,638,048 B of weights = 66,473,552 B -> 129,831 tokens -> 129,824 (page multiple)
    assert pool_sizing.max_total_num_tokens(128 * 2**20, 51_638_048, cell, 0.88, 16, None) == 129_824
    assert pool_sizing.max_total_num_tokens(128 * 2**20, 51_638_048, cell, 0.88, 16, 4100) == 4096
    with pytest.raises(ValueError, match="not enough memory"):
        pool_sizing.max_total_num_tokens(50 * 2**20, 51_638_048, cell, 0.88, 16, None)
    assert pool_sizing.max_req_input_len(8192, 4096) == 4090
    assert pool_sizing.max_req_input_len(8192, 16384) == 8186
    # the runbook's incident: pool 681,280, context 1,048,576
    assert pool_sizing.max_req_input_len(1_048_576, 681_280) == 681_274


async def test_engine_derives_pool_from_memory_budget(make_engine):
    eng = await make_engine(model="tiny-random", mem_budget_bytes=128 * 2**20)
    # 2 x 100,277 x 64 x 4 B + layers; with a packed GEMM, the packed copies too: the logits' 100,277 x 64 x 4 B
    # and 2 layers x 36,864 x 4 B (qkv 64 x 128, o 64 x 64, gate and up 64 x 128, down 128 x 64)
    packed = 25_670_912 + 294_912 if packed_linear.PACKERS else 0
    assert eng.weight_bytes == 51_638_048 + packed
    # (0.88 x 128 MiB - 77,603,872 B) // 512 B = 79,116 tokens -> 79,104 (page multiple)
    tokens = 79_104 if packed else 129_824
    assert eng.max_total_num_tokens == tokens
    assert eng.max_req_input_len == 8186
    info = eng.server_info()
    assert {
        k: info[k]
        for k in (
            "max_total_num_tokens",
            "max_req_input_len",
            "context_length",
            "page_size",
            "disaggregation_mode",
            "status",
            "free_tokens",
            "used_tokens",
        )
    } == {
        "max_total_num_tokens": tokens,
        "max_req_input_len": 8186,
        "context_length": 8192,
        "page_size": 16,
        "disaggregation_mode": "null",
        "status": "ready",
        "free_tokens": tokens,
        "used_tokens": 0,
    }
    unpacked = await make_engine(model="tiny-random", mem_budget_bytes=128 * 2**20, packed_weights=False)
    assert unpacked.weight_bytes == 51_638_048 and unpacked.max_total_num_tokens == 129_824
    capped = await make_engine(
        model="copy-probe", mem_budget_bytes=128 * 2**20, max_total_tokens=1000, context_length=512
    )
    assert capped.max_total_num_tokens == 992 and capped.max_req_input_len == 506
    assert capped.pool_stats() == {"total_pages": 62, "free_pages": 62, "used_pages": 0, "page_size": 16}
