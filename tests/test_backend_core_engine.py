"""Engine behaviour: rejection (invariant 1), batching, sampling, stop/length, abort, pool waits,
and the disaggregation hooks. Every test's engines are checked idle and scrubbed on teardown
(invariants 3 and 4) by the ``make_engine`` fixture."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from backend_core_support import collect, make_engine, worker_paused  # noqa: F401  (fixture)

from config.errors import ErrorCode
from gpu_backend.attention import ContiguousAttention, ContiguousKVCache, SeqSpan
from gpu_backend.bridge import queue_tokens
from gpu_backend.decode_node import decode_reserved, load_pages, reserve_pages
from gpu_backend.engine import PLACEHOLDER_PROMPT
from gpu_backend.errors import (
    InvalidRequestError,
    PoolExhaustedError,
    PromptTooLongError,
    RequestAbortedError,
    TransferMismatchError,
)
from gpu_backend.faults import Faults
from gpu_backend.prefill_node import prefill_export
from gpu_backend.replies import Failed, PagesGranted, Reply
from gpu_backend.sampling import SamplingParams
from gpu_backend.sequence import SeqState, Sequence
from gpu_backend.wire import Token

SMALL = dict(model="tiny-random", max_total_tokens=1024, context_length=1024)
PROBE = dict(model="copy-probe", max_total_tokens=2048, context_length=2048)


def _prompt(n: int, base: int = 1000) -> list[int]:
    return [base + (i * 37) % 9000 for i in range(n)]


# ---- invariant 1: rejected is terminal, distinct from finished, allocates nothing ---------------
async def test_over_length_prompt_rejected_at_admission(make_engine):
    eng = await make_engine(**SMALL)
    assert eng.max_req_input_len == 1018  # min(1023, 1023) - 5
    with pytest.raises(PromptTooLongError) as ei:
        await collect(eng, "long", _prompt(1019), max_new_tokens=4)
    err = ei.value
    assert (err.status, err.code, err.prompt_tokens, err.max_req_input_len) == (
        400,
        "context_length_exceeded",
        1019,
        1018,
    )
    assert err.body() == {
        "error": {
            "message": "This model's maximum context length is 1018 tokens. However, you requested 1019 tokens "
            "(1019 in the prompt, 0 in the completion). Please reduce the length of the prompt or completion.",
            "type": "invalid_request_error",
            "param": "prompt",
            "code": ErrorCode.CONTEXT_LENGTH_EXCEEDED,
        }
    }
    assert eng.request_state("long") == "rejected"
    assert eng.pool_stats()["used_pages"] == 0 and eng.stats["prefill_steps"] == 0  # nothing allocated or run
    # prefill side: same rejection, before any page
    with pytest.raises(PromptTooLongError):
        await prefill_export(eng, "long2", _prompt(5000))
    assert eng.request_state("long2") == "rejected" and eng.stats["prefill_steps"] == 0
    # exactly at the limit is admitted; max_new_tokens clamped to max_req_len - prompt - 1 = 4
    toks, _, last = await collect(eng, "edge", _prompt(1018), max_new_tokens=100, ignore_eos=True)
    assert (len(toks), last.finish_reason, last.prompt_tokens, last.completion_tokens) == (4, "length", 1018, 4)
    assert eng.request_state("edge") == "finished"


def test_rejected_and_finished_are_terminal():
    seq = Sequence("r", [1, 2], SamplingParams(max_new_tokens=1), lambda _: None)
    seq.set_state(SeqState.REJECTED)
    for s in SeqState:
        with pytest.raises(RuntimeError, match="illegal transition rejected"):
            seq.set_state(s)
    done = Sequence("f", [1], SamplingParams(max_new_tokens=1), lambda _: None)
    done.set_state(SeqState.PREFILLING)
    done.set_state(SeqState.FINISHED)
    assert done.state is not SeqState.REJECTED
    with pytest.raises(RuntimeError):
        done.set_state(SeqState.DECODING)
    fresh = Sequence("w", [1], SamplingParams(max_new_tokens=1), lambda _: None)
    fresh.set_state(SeqState.PREFILLING)
    with pytest.raises(RuntimeError):  # rejection only happens at admission
        fresh.set_state(SeqState.REJECTED)


async def test_admit_rejected_fault_gives_placeholder(make_engine):
    eng = await make_engine(**PROBE, faults=Faults(admit_rejected=True))
    kv, res = await prefill_export(eng, "over", _prompt(3000))
    assert (res.placeholder, res.num_tokens, res.original_prompt_tokens) == (True, 1, 3000)
    assert tuple(kv.shape) == (1, 1, 2, 16, 1, 64) and kv.is_contiguous() and kv.device.type == "cpu"
    assert res.first_token_id == PLACEHOLDER_PROMPT[0]  # copy-probe copies the placeholder token
    assert res.prefill_seconds > 0


async def test_invalid_requests_are_400(make_engine):
    eng = await make_engine(**SMALL)
    for prompt, params in (
        ([], {}),
        ([100256], {}),
        ([-1], {}),
        ([200_000], {}),
        (["a"], {}),
        ([5], {"max_new_tokens": 0}),
        ([5], {"top_p": 0.0}),
        ([5], {"temperature": "hot"}),
        ([5], {"temperature": float("nan")}),
        ([5], {"stop": "x"}),
        ([5], {"seed": 1.5}),
    ):
        kw = {"max_new_tokens": 2, **params}
        with pytest.raises(InvalidRequestError) as ei:
            await collect(eng, "bad", prompt, **kw)
        assert ei.value.status == 400
    assert eng.pool_stats()["used_pages"] == 0


# ---- batching ------------------------------------------------------------------------------------
async def test_prefill_batching_and_continuous_decode_batching(make_engine):
    eng = await make_engine(**SMALL)
    with worker_paused(eng):
        tasks = [
            asyncio.create_task(collect(eng, f"b{i}", _prompt(10 + i, 2000 + i), max_new_tokens=6, ignore_eos=True))
            for i in range(4)
        ]
        await asyncio.sleep(0.05)  # every request is in the inbox before the worker can look
    results = await asyncio.gather(*tasks)
    assert [len(t) for t, _, _ in results] == [6, 6, 6, 6]
    st = eng.stats
    assert (st["prefill_steps"], st["max_prefill_batch"], st["prefill_tokens"]) == (1, 4, 10 + 11 + 12 + 13)
    assert st["decode_steps"] == 5 and dict(st["decode_batch_sizes"]) == {4: 5}  # 4 sequences per decode step

    # a late request joins a running decode batch (continuous batching)
    first = eng.generate("long", _prompt(8, 3000), SamplingParams(max_new_tokens=400, ignore_eos=True))
    got = [await first.__anext__() for _ in range(3)]
    assert [t.finish_reason for t in got] == [None, None, None]
    with worker_paused(eng):  # the worker is between steps: "long" cannot finish meanwhile
        assert eng.request_state("long") == "decoding"
        remaining = 400 - len(eng._live["long"].completion_ids)
        late = asyncio.create_task(collect(eng, "late", _prompt(8, 4000), max_new_tokens=5, ignore_eos=True))
        await asyncio.sleep(0.05)
    assert remaining > 5
    toks_late, _, last_late = await late
    assert len(toks_late) == 5 and last_late.finish_reason == "length"
    eng.abort("long")
    rest = [ev async for ev in first]
    assert rest[-1].finish_reason == "abort"
    # the late request's 4 decode steps all carried both sequences
    assert dict(st["decode_batch_sizes"])[2] == 4


async def test_chunked_prefill_matches_unchunked(make_engine):
    a = await make_engine(**SMALL)
    b = await make_engine(**SMALL, max_batch_tokens=64)
    prompt = _prompt(300, 5000)
    ta, _, _ = await collect(a, "x", prompt, max_new_tokens=8, ignore_eos=True)
    tb, _, _ = await collect(b, "x", prompt, max_new_tokens=8, ignore_eos=True)
    assert ta == tb and b.stats["prefill_steps"] == 5  # 300 tokens in chunks of 64


# ---- the tokens come from forward passes: paged == contiguous-KV reference -----------------------
async def test_greedy_tokens_equal_contiguous_reference(make_engine):
    eng = await make_engine(**SMALL)
    prompt = _prompt(23, 700)
    toks, _, _ = await collect(eng, "g", prompt, max_new_tokens=6, ignore_eos=True)
    model = eng.model
    cache = ContiguousKVCache(2, 1, 64, 2, 16, torch.float32, "cpu")
    ref, ids, start = [], list(prompt), 0
    with torch.inference_mode():
        for _ in range(6):
            attn = ContiguousAttention(cache, [SeqSpan([], start, len(ids) - start)])
            h = model(torch.tensor(ids[start:]), attn)
            logits = model.compute_logits(h[-1:]) + eng.runner.vocab_bias
            start = len(ids)
            ids.append(int(logits.argmax(-1)))
            ref.append(ids[-1])
    assert toks == ref


# ---- sampling ------------------------------------------------------------------------------------
async def test_sampling_greedy_and_seeded(make_engine):
    eng = await make_engine(**SMALL)
    p = _prompt(12, 800)
    g1, _, _ = await collect(eng, "g1", p, max_new_tokens=10, ignore_eos=True)
    g2, _, _ = await collect(eng, "g2", p, max_new_tokens=10, ignore_eos=True)
    tiny_p, _, _ = await collect(eng, "tp", p, max_new_tokens=10, temperature=1.0, top_p=1e-9, seed=1, ignore_eos=True)
    assert g1 == g2 == tiny_p  # top_p -> 0 keeps only the argmax
    s1, _, _ = await collect(eng, "s1", p, max_new_tokens=10, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True)
    # same seed in a busy batch: same tokens (per-request generator)
    others = [
        asyncio.create_task(
            collect(eng, f"o{i}", _prompt(9, 900 + i), max_new_tokens=10, temperature=1.0, ignore_eos=True)
        )
        for i in range(3)
    ]
    s2, _, _ = await collect(eng, "s2", p, max_new_tokens=10, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True)
    await asyncio.gather(*others)
    s3, _, _ = await collect(eng, "s3", p, max_new_tokens=10, temperature=0.9, top_p=0.95, seed=8, ignore_eos=True)
    assert s1 == s2 and s1 != s3 and s1 != g1


# ---- stop strings, stop ids, EOS, length (copy-probe makes the output the prompt itself) ----------
async def test_stop_strings_eos_and_length(make_engine):
    eng = await make_engine(**PROBE)
    text = "one two three four five six seven"
    ids = eng.counter.encode_text(text)
    toks, out, last = await collect(eng, "all", ids, max_new_tokens=len(ids))
    assert (toks, out, last.finish_reason, last.completion_tokens) == (ids, text, "length", len(ids))
    _, out, last = await collect(eng, "s1", ids, max_new_tokens=50, stop=[" four"])
    assert (out, last.finish_reason) == ("one two three", "stop")
    _, out, last = await collect(eng, "s2", ids, max_new_tokens=50, stop=["zzz", "wo thr"])  # spans tokens
    assert (out, last.finish_reason) == ("one t", "stop")
    toks, out, last = await collect(eng, "s3", ids, max_new_tokens=50, stop_token_ids=[ids[2]])
    assert (toks, out, last.finish_reason) == (ids[:3], "one two", "stop")
    chat = eng.counter.encode_chat([{"role": "user", "content": "hi"}])  # <|im_start|>user\nhi<|im_end|>...
    toks, out, last = await collect(eng, "eos", chat, max_new_tokens=50)
    assert toks == chat[: chat.index(eng.eos_token_id) + 1] and last.finish_reason == "stop"
    assert out == "<|im_start|>user\nhi"
    toks, _, last = await collect(eng, "ign", chat, max_new_tokens=len(chat), ignore_eos=True)
    assert toks == chat and last.finish_reason == "length"
    # multi-byte characters split over tokens come out whole
    ja = "日本語のテキスト"
    jids = eng.counter.encode_text(ja)
    _, out, _ = await collect(eng, "ja", jids, max_new_tokens=len(jids))
    assert out == ja


# ---- abort -----------------------------------------------------------------------------------------
async def test_abort_frees_every_page(make_engine):
    eng = await make_engine(**SMALL)
    it = eng.generate("ab", _prompt(40), SamplingParams(max_new_tokens=900, ignore_eos=True))
    evs = [await it.__anext__() for _ in range(3)]
    with worker_paused(eng):
        assert eng.request_state("ab") == "decoding"
        assert eng.pool_stats()["used_pages"] == eng.pool.pages_for(40 + 900)
        eng.abort("ab")
    evs += [ev async for ev in it]
    assert evs[-1].finish_reason == "abort" and evs[-1].finished and evs[-1].token_id == -1
    assert eng.request_state("ab") == "aborted"
    assert eng.pool_stats()["used_pages"] == 0
    # a client that goes away (iterator closed early) aborts too
    it2 = eng.generate("gone", _prompt(40), SamplingParams(max_new_tokens=500, ignore_eos=True))
    await it2.__anext__()
    await it2.aclose()  # the abort is queued at once (no garbage collection needed) ...
    for _ in range(500):  # ... and carried out by the worker at its next step boundary
        if eng.request_state("gone") == "aborted":
            break
        await asyncio.sleep(0.01)
    assert eng.pool_stats()["used_pages"] == 0 and eng.request_state("gone") == "aborted"


# ---- pool momentarily full: wait, then 503 (never the 400) -----------------------------------------
async def test_pool_full_waits_then_503(make_engine):
    eng = await make_engine(
        model="tiny-random", max_total_tokens=256, context_length=1024, pool_wait_timeout_seconds=0.3
    )
    assert eng.max_req_input_len == 250
    hold = await reserve_pages(eng, "hold", 200, 50)  # 16 pages: the whole pool
    assert len(hold) == 16 and eng.pool_stats()["free_pages"] == 0
    with pytest.raises(PoolExhaustedError) as ei:
        await collect(eng, "waits", _prompt(200), max_new_tokens=8)  # fits the pool, finds it full
    assert (ei.value.status, ei.value.code) == (503, "pool_exhausted")
    assert eng.request_state("waits") == "aborted"
    with pytest.raises(PoolExhaustedError):
        await reserve_pages(eng, "r2", 10, 10)
    # a request that waits and gets the pages once they are released
    eng.scheduler.pool_wait_timeout_seconds = 30.0  # no timing race on a busy machine
    task = asyncio.create_task(collect(eng, "later", _prompt(200), max_new_tokens=8, ignore_eos=True))
    await asyncio.sleep(0.1)
    assert eng.request_state("later") == "waiting"
    eng.abort("hold")
    eng.abort("hold")  # idempotent
    toks, _, last = await task
    assert len(toks) == 8 and last.finish_reason == "length"


# ---- disaggregation hooks: prefill on one engine, decode on another ------------------------------
async def test_prefill_export_then_decode_reserved(make_engine):
    pre = await make_engine(**PROBE)
    dec = await make_engine(**PROBE)
    prompt = _prompt(37, 6000)
    kv, res = await prefill_export(pre, "x", prompt)
    assert (res.num_tokens, res.placeholder, res.first_token_id) == (37, False, prompt[0])
    assert tuple(kv.shape) == (3, 1, 2, 16, 1, 64)
    assert torch.count_nonzero(kv[2, :, :, 5:]) == 0  # past num_tokens: zeros
    assert pre.pool_stats()["used_pages"] == 0  # exported and freed
    pages = await reserve_pages(dec, "x", 37, 10)
    assert len(pages) == 3 and dec.request_state("x") == "reserved"
    await load_pages(dec, "x", kv, res.num_tokens)
    evs = [
        ev
        async for ev in decode_reserved(
            dec, "x", prompt, res.first_token_id, SamplingParams(max_new_tokens=10), res.num_tokens
        )
    ]
    assert [e.token_id for e in evs] == prompt[:10]
    assert [e.completion_tokens for e in evs] == list(range(1, 11)) and evs[-1].finish_reason == "length"
    assert dec.pool_stats()["used_pages"] == 0
    # errors of the hooks
    with pytest.raises(KeyError):
        await load_pages(dec, "nope", kv, 37)
    await reserve_pages(dec, "y", 10, 2)
    with pytest.raises(ValueError):
        await load_pages(dec, "y", kv, 37)  # 3 pages into a 1-page reservation
    with pytest.raises(InvalidRequestError):
        async for _ in decode_reserved(dec, "y", prompt, 1, SamplingParams(max_new_tokens=2), 37):
            pass
    assert dec.request_state("y") is None and dec.pool_stats()["used_pages"] == 0  # freed on error
    # decoding over more positions than were loaded is refused by the engine too (invariant 2)
    await reserve_pages(dec, "z", 37, 4)
    await load_pages(dec, "z", kv[:1], 16)
    with pytest.raises(TransferMismatchError):
        async for _ in decode_reserved(dec, "z", prompt, prompt[0], SamplingParams(max_new_tokens=4), 37):
            pass
    assert dec.request_state("z") is None and dec.pool_stats()["used_pages"] == 0


# ---- lifecycle and ids ---------------------------------------------------------------------------
async def test_ids_reusable_after_finish_duplicates_refused_and_stop_aborts(make_engine):
    eng = await make_engine(**SMALL)
    for _ in range(3):  # the id is free again as soon as the final event arrives
        toks, _, _ = await collect(eng, "same", _prompt(5), max_new_tokens=2, ignore_eos=True)
        assert len(toks) == 2
    it = eng.generate("dup", _prompt(5), SamplingParams(max_new_tokens=900, ignore_eos=True))
    await it.__anext__()
    with pytest.raises(InvalidRequestError, match="already in flight"):
        await collect(eng, "dup", _prompt(5), max_new_tokens=2)
    with pytest.raises(InvalidRequestError):
        await reserve_pages(eng, "dup", 5, 5)
    await eng.stop()  # in-flight work ends with "abort" and every page is freed
    rest = [ev async for ev in it]
    assert rest[-1].finish_reason == "abort"
    assert eng.pool_stats()["used_pages"] == 0 and eng.server_info()["status"] == "stopped"


# ---- threading: every page operation runs on the worker; integrity when idle (invariant 4) --------
async def test_every_page_operation_runs_on_the_worker_thread(make_engine):
    pre = await make_engine(**PROBE)
    dec = await make_engine(**PROBE)
    seen: list[tuple[str, str]] = []
    for eng in (pre, dec):
        for name in ("try_alloc", "free", "read_pages", "write_pages"):
            orig = getattr(eng.pool, name)

            def spy(*a, _orig=orig, _name=name, **kw):
                seen.append((_name, threading.current_thread().name))
                return _orig(*a, **kw)

            setattr(eng.pool, name, spy)
    prompt = _prompt(20, 6000)
    kv, res = await prefill_export(pre, "x", prompt)
    await reserve_pages(dec, "x", 20, 4)
    await load_pages(dec, "x", kv, res.num_tokens)
    toks = [t.token_id async for t in decode_reserved(dec, "x", prompt, res.first_token_id, SamplingParams(4), 20)]
    await reserve_pages(dec, "gone", 20, 4)
    dec.abort("gone")  # a reservation released before it decodes
    _, _, last = await collect(pre, "g", prompt, max_new_tokens=3, ignore_eos=True)
    assert toks == prompt[:4] and last.finish_reason == "length"
    for eng in (pre, dec):
        for _ in range(200):
            if eng.pool_stats()["used_pages"] == 0:
                break
            await asyncio.sleep(0.01)
        eng.check_integrity()
    assert {n for n, _ in seen} == {"try_alloc", "free", "read_pages", "write_pages"}
    assert {t for _, t in seen} == {"kvgate-engine"}, seen


async def test_check_integrity_catches_a_leak_and_a_corrupt_free_list(make_engine):
    eng = await make_engine(**SMALL)
    await collect(eng, "a", _prompt(20), max_new_tokens=2)
    eng.check_integrity()  # idle and whole
    with worker_paused(eng):  # test-only: touch the pool while the worker waits between steps
        leaked = eng.pool.try_alloc(2, "nobody")  # pages held with no request in flight
        with pytest.raises(AssertionError, match="idle engine holds pages"):
            eng.check_integrity()
        eng.pool.free(leaked)
        eng.pool.owner[0] = "ghost"  # owned and on the free list at once
        with pytest.raises(AssertionError, match="free list has an owner|has an owner"):
            eng.check_integrity()
        eng.pool.owner[0] = None
    eng.check_integrity()


async def test_messages_after_stop_are_refused_with_503_not_left_hanging(make_engine):
    eng = await make_engine(**PROBE)
    kv, _ = await prefill_export(eng, "p", _prompt(5))
    await eng.stop()
    for call in (
        load_pages(eng, "x", kv, 5),
        reserve_pages(eng, "y", 5, 5),
        prefill_export(eng, "z", _prompt(5)),
    ):
        with pytest.raises(RequestAbortedError) as ei:
            await asyncio.wait_for(call, 5)
        assert ei.value.status == 503
    with pytest.raises(RequestAbortedError) as ei:
        await asyncio.wait_for(collect(eng, "w", _prompt(5), max_new_tokens=2), 5)
    assert ei.value.status == 503
    toks = decode_reserved(eng, "x", _prompt(5), 1, SamplingParams(max_new_tokens=2), 5)
    with pytest.raises(RequestAbortedError) as ei:
        await asyncio.wait_for(toks.__anext__(), 5)
    assert ei.value.status == 503 and eng.pool_stats()["used_pages"] == 0


async def test_the_token_reader_matches_the_worker_reply_type():
    """Tokens pass, ``Failed`` raises its error without an abort (the worker retired the request),
    a reply of another kind is a ``TypeError`` and aborts."""
    aborts: list[str] = []
    queue: asyncio.Queue[Reply] = asyncio.Queue()
    tok = Token(7, "a", False, None, 3, 1)
    for reply in (tok, Failed(PoolExhaustedError("KV pool full")), PagesGranted([])):
        queue.put_nowait(reply)
    got = []
    with pytest.raises(PoolExhaustedError, match="KV pool full"):
        async for t in queue_tokens(queue, lambda: aborts.append("first")):
            got.append(t)
    assert got == [tok] and aborts == []
    with pytest.raises(TypeError, match="^unexpected worker reply PagesGranted$"):
        async for _ in queue_tokens(queue, lambda: aborts.append("second")):
            pass
    assert aborts == ["second"]
