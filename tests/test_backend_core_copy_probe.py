"""copy-probe: the isolation oracle at the engine core. With isolation intact every completion
reproduces its own prompt's leading tokens; with the scrub and the generation check switched off, a
request handed a stale page emits another request's tokens (the oracle can fail)."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
from backend_core_support import collect, make_engine, worker_paused  # noqa: F401  (fixture)
from conftest import SEEDS

from gpu_backend.decode_node import decode_reserved, load_pages, reserve_pages
from gpu_backend.errors import StaleHandleError
from gpu_backend.faults import Faults
from gpu_backend.kv_pool import PageHandle
from gpu_backend.prefill_node import prefill_export
from gpu_backend.sampling import SamplingParams


@pytest.mark.timeout(120)
async def test_200_concurrent_prompts_from_8_tenants_copy_their_own_tokens(make_engine):
    # a pool much smaller than the workload, so pages are released, scrubbed and reused many times
    eng = await make_engine(model="copy-probe", max_total_tokens=4096, context_length=4096, max_batch_tokens=2048)
    rng = random.Random(1234)
    valid = [i for i in range(100_000) if eng.counter.is_valid_id(i)]
    tenants = [valid[t * 12_000 : (t + 1) * 12_000] for t in range(8)]  # disjoint token ranges per tenant
    jobs = []
    for i in range(200):
        t = i % 8
        n = rng.choice([1, 2, 15, 16, 17, rng.randint(1, 400)])
        jobs.append((f"t{t}-r{i}", t, [rng.choice(tenants[t]) for _ in range(n)], rng.randint(1, 32)))

    async def run(rid, prompt, max_tokens):
        toks, _, last = await collect(eng, rid, prompt, max_new_tokens=max_tokens, ignore_eos=True)
        return toks, last

    results = await asyncio.gather(*(run(rid, p, m) for rid, _, p, m in jobs))
    for (rid, t, prompt, m), (toks, last) in zip(jobs, results):
        assert len(toks) == m and last.finish_reason == "length" and last.prompt_tokens == len(prompt)
        k = min(m, len(prompt))
        assert toks[:k] == prompt[:k], rid
        assert set(toks) <= set(prompt)  # past the prompt it repeats its own tokens, nobody else's
    assert eng.stats["max_decode_batch"] > 8 and eng.stats["max_prefill_batch"] > 1
    assert eng.pool.generation != [0] * eng.pool.num_pages  # pages were recycled


@pytest.mark.timeout(60)
async def test_copy_probe_exact_on_an_8000_token_prompt(make_engine):
    eng = await make_engine(model="copy-probe", max_total_tokens=8192 + 64, context_length=8192, max_batch_tokens=4096)
    text = "".join(p.read_text(encoding="utf-8") for p in sorted(SEEDS.glob("0*.txt")))
    prompt = eng.counter.encode_text(text)[:8000]
    assert len(prompt) == 8000
    toks, out, last = await collect(eng, "long", prompt, max_new_tokens=32, ignore_eos=True)
    assert toks == prompt[:32] and last.prompt_tokens == 8000
    assert eng.stats["prefill_steps"] == 2  # chunked: 4096 + 3904
    # the far end of the prompt too: every page of the block table is addressed by position
    await reserve_pages(eng, "far", 8000, 8)
    await load_pages(eng, "far", _export(eng, prompt), 8000)
    tail = [
        ev.token_id
        async for ev in decode_reserved(eng, "far", prompt, prompt[0], SamplingParams(max_new_tokens=8), 8000)
    ]
    assert tail == prompt[:8]


def _export(eng, prompt):
    """KV pages of ``prompt`` written by a fresh prefill on a second pool (reference transfer)."""
    from gpu_backend.attention import PagedAttention, SeqSpan
    from gpu_backend.kv_pool import KVPool

    pool = KVPool(eng.pool.pages_for(len(prompt) + 8), 16, 1, 1, 64, torch.float32, "cpu")
    hs = pool.try_alloc(pool.num_pages, "ref")
    with torch.inference_mode():
        for a in range(0, len(prompt), 2000):
            n = min(2000, len(prompt) - a)
            eng.model(
                torch.tensor(prompt[a : a + n]),
                PagedAttention(pool, [SeqSpan([h.index for h in hs], a, n, len(prompt))]),
            )
    return pool.read_pages(hs)


async def _stale_scenario(eng):
    """Request A fills the whole pool and finishes; B is then handed A's old page handles (stale)
    and decodes over 64 context positions it never wrote. Returns (A's prompt, B's events)."""
    a_prompt = [20_000 + 7 * i for i in range(64)]
    toks, _, _ = await collect(eng, "A", a_prompt, max_new_tokens=1)
    assert toks == a_prompt[:1]
    stale = [PageHandle(i, 0) for i in range(eng.pool.num_pages)]  # A's pages, generation 0
    fresh = await reserve_pages(eng, "B", 64, 8)  # B's real reservation: the same pages, generation 1
    assert [h.index for h in fresh] == [h.index for h in stale]
    with worker_paused(eng):  # test-only hook, worker between steps: hand B the stale handles instead
        eng.pool.free(fresh)
        eng._live["B"].pages = stale
    b_prompt = [50_000]
    evs = [ev async for ev in decode_reserved(eng, "B", b_prompt, 50_000, SamplingParams(max_new_tokens=8), 64)]
    return a_prompt, evs


async def test_stale_page_leaks_another_requests_tokens_without_scrub(make_engine):
    eng = await make_engine(
        model="copy-probe",
        max_total_tokens=80,
        context_length=2048,
        faults=Faults(no_scrub=True, skip_transfer_check=True),
    )
    assert eng.pool.num_pages == 5
    a_prompt, evs = await _stale_scenario(eng)
    toks = [e.token_id for e in evs]
    # B's completion is A's prompt: the oracle ("only your own prompt's tokens") fails, as it must
    assert toks == [50_000] + a_prompt[1:8]
    assert evs[-1].prompt_tokens == 1 and evs[-1].finish_reason == "length"
    assert eng.pool_stats() == {"total_pages": 5, "free_pages": 5, "used_pages": 0, "page_size": 16}


async def test_stale_page_handle_is_refused_with_scrub(make_engine):
    # skip_transfer_check alone (scrub and generation check on) cannot leak
    eng = await make_engine(
        model="copy-probe", max_total_tokens=80, context_length=2048, faults=Faults(skip_transfer_check=True)
    )
    with pytest.raises(StaleHandleError):
        await _stale_scenario(eng)
    assert eng.pool_stats()["used_pages"] == 0
    # and a fresh reservation over scrubbed pages shows no trace of A: unwritten positions are zeros,
    # so B attends to its own position 0 and copies its own token
    kv, _ = await _prefill_one(eng, 50_000)
    await reserve_pages(eng, "C", 64, 8)
    await load_pages(eng, "C", kv, 1)
    toks = [e.token_id async for e in decode_reserved(eng, "C", [50_000], 50_000, SamplingParams(max_new_tokens=8), 64)]
    assert toks == [50_000] * 8


async def _prefill_one(eng, token):
    return await prefill_export(eng, f"p{token}", [token])
