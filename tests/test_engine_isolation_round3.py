"""The engine core attacked directly (in process, no gateway), third round:

- a request that arrived while a long forward pass ran is offered the pool before its wait is
  judged: the worker's compute time is no wait for pages, so an idle pool serves it (it used to get
  503 ``pool_exhausted``, "KV pool full", with every page free), and one left waiting for the
  token budget is not timed out as if the pool were full;
- a caller that leaves after its request retired does not abort a later request that reuses the
  id (the id is free once retired);
- the copy-probe oracle over the pool-size edges: a prompt at, below and over the limit, a
  completion ending on a page boundary, an abort between prefill and decode whose pages the next
  request gets at once, and greedy outputs alone equal to those beside others in decode batches
  that mix finished and new sequences.

Every engine is stopped and checked idle and scrubbed by the ``make_engine`` fixture."""

from __future__ import annotations

import asyncio
import threading
import time

import backend_core_support
import pytest
from backend_core_support import collect

from gpu_backend.decode_node import reserve_pages
from gpu_backend.errors import PromptTooLongError
from gpu_backend.sampling import SamplingParams

pytestmark = pytest.mark.timeout(60)
make_engine = backend_core_support.make_engine  # the fixture: every engine stopped, checked idle and scrubbed


def _ids(n: int, base: int) -> list[int]:
    """``n`` distinct token ids from ``base`` on (all decodable by the bundled tokenizer there)."""
    return [base + i for i in range(n)]


def _slow_pass(eng, monkeypatch, request_id: str, seconds: float) -> threading.Event:
    """Make every forward pass that holds ``request_id`` take ``seconds`` more (a long prefill on a
    busy CPU); the returned event is set when such a pass starts."""
    started = threading.Event()
    run = eng.runner.run

    def slow(items, sample_rows):
        if any(seq.request_id == request_id for seq, _ in items):
            started.set()
            time.sleep(seconds)
        return run(items, sample_rows)

    monkeypatch.setattr(eng.runner, "run", slow)
    return started


async def test_a_request_that_arrived_during_a_long_pass_gets_the_idle_pool_not_a_503(make_engine, monkeypatch):
    eng = await make_engine(
        model="copy-probe",
        max_total_tokens=1024,
        context_length=1024,
        max_batch_tokens=16,
        pool_wait_timeout_seconds=0.3,
    )
    started = _slow_pass(eng, monkeypatch, "long", 1.0)  # a pass longer than the pool wait
    first = asyncio.create_task(collect(eng, "long", _ids(2, 1000), max_new_tokens=1))
    await asyncio.to_thread(started.wait, 10)
    # these arrive during the pass; three 16-token prompts fit one 16-token budget one at a time
    late = [
        asyncio.create_task(collect(eng, f"late{i}", _ids(16, 2000 + 100 * i), max_new_tokens=3, ignore_eos=True))
        for i in range(3)
    ]
    reserved = asyncio.create_task(reserve_pages(eng, "res", 10, 10))
    toks, _, last = await first
    assert (toks, last.finish_reason) == ([1000], "length")
    for i, task in enumerate(late):
        toks, _, last = await task
        assert (toks, last.finish_reason) == (_ids(3, 2000 + 100 * i), "length")
    assert len(await reserved) == 2  # (10 + 10) tokens in 16-token pages
    assert eng.stats["max_prefill_batch"] == 1  # the budget admitted one prompt per step
    eng.abort("res")


async def test_a_caller_leaving_late_does_not_abort_the_next_request_with_its_id(make_engine):
    eng = await make_engine(model="copy-probe", max_total_tokens=1024, context_length=1024)
    old = eng.generate("X", _ids(2, 1000), SamplingParams(max_new_tokens=2, ignore_eos=True))
    assert (await old.__anext__()).token_id == 1000
    for _ in range(500):  # the worker retires it; its last token waits, unread, in the queue
        if eng.request_state("X") == "finished":
            break
        await asyncio.sleep(0.01)
    assert eng.request_state("X") == "finished"
    new = asyncio.create_task(collect(eng, "X", _ids(3, 3000), max_new_tokens=3, ignore_eos=True))
    await asyncio.sleep(0)  # the new request is admitted under the freed id
    await old.aclose()  # the old client leaves before reading its last token
    toks, _, last = await new
    assert (toks, last.finish_reason, last.completion_tokens) == (_ids(3, 3000), "length", 3)
    assert eng.request_state("X") == "finished"


async def test_copy_probe_at_the_pool_edges_and_after_an_abort_between_prefill_and_decode(make_engine):
    # 5 pages of 16: max_req_len min(2047, 79) = 79, max_req_input_len 74
    eng = await make_engine(model="copy-probe", max_total_tokens=80, context_length=2048)
    assert (eng.pool.num_pages, eng.max_req_len, eng.max_req_input_len) == (5, 79, 74)
    for n, base in ((73, 1000), (74, 2000)):  # one below and at the limit; max_tokens clamped to 79 - n - 1
        toks, _, last = await collect(eng, f"edge{n}", _ids(n, base), max_new_tokens=10**6, ignore_eos=True)
        assert (toks, last.finish_reason, last.prompt_tokens) == (_ids(78 - n, base), "length", n)
    steps = eng.stats["prefill_steps"]
    with pytest.raises(PromptTooLongError):  # one over: rejected before any page or pass
        await collect(eng, "over", _ids(75, 3000), max_new_tokens=1)
    assert eng.request_state("over") == "rejected" and eng.stats["prefill_steps"] == steps
    # 47 + 17 = 64 positions written: the last decode step fills the last slot of page 4
    toks, _, _ = await collect(eng, "page", _ids(47, 4000), max_new_tokens=18, ignore_eos=True)
    assert toks == _ids(18, 4000)
    # A fills the pool, is aborted after prefill (first token read); B needs every page at once
    a = eng.generate("A", _ids(74, 5000), SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert (await a.__anext__()).token_id == 5000
    await a.aclose()
    toks, _, last = await collect(eng, "B", _ids(74, 6000), max_new_tokens=4, ignore_eos=True)
    assert (toks, last.finish_reason) == (_ids(4, 6000), "length")
    assert eng.request_state("A") == "aborted"


async def test_greedy_alone_equals_greedy_in_mixed_decode_batches(make_engine):
    eng = await make_engine(model="tiny-random", max_total_tokens=2048, context_length=1024)
    jobs = [(_ids(n, 7000 + 300 * i), m) for i, (n, m) in enumerate(((1, 20), (16, 3), (17, 12), (40, 1), (5, 16)))]
    alone = [(await collect(eng, f"solo{i}", p, max_new_tokens=m, ignore_eos=True))[0] for i, (p, m) in enumerate(jobs)]

    async def staggered(i: int, p: list[int], m: int) -> list[int]:
        await asyncio.sleep(0.01 * i)  # joins while others decode or finish
        return (await collect(eng, f"mix{i}", p, max_new_tokens=m, ignore_eos=True))[0]

    together = await asyncio.gather(*(staggered(i, p, m) for i, (p, m) in enumerate(jobs)))
    assert together == alone
    assert eng.stats["max_decode_batch"] > 1
