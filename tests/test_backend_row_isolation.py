"""A forward pass that raises fails only the request that makes it raise.

One tenant's request whose row raises (a fault keyed on its request id, injected after the whole
pass ran so every row's K/V was written; or a real NaN row that ``torch.multinomial`` refuses)
shares a batch with other tenants' requests. The engine runs the rows again in halves
(``engine.bisect_rows``): the culprit fails with its own error and its pages are freed at once,
the others finish with exactly the tokens they get without it (greedy and seeded), and the pool
ends where it started. A fault every row meets alone fails every row and the engine goes on."""

from __future__ import annotations

import asyncio

import backend_core_support
import pytest
import torch
from backend_core_support import worker_paused

from gpu_backend.engine import bisect_rows
from gpu_backend.sampling import SamplingParams
from gpu_backend.scheduler import Batch
from gpu_backend.sequence import Sequence

make_engine = backend_core_support.make_engine  # the fixture: engines stopped and checked idle after each test
pytestmark = pytest.mark.timeout(120)

SMALL = dict(model="tiny-random", max_total_tokens=1024, context_length=1024)
GREEDY = dict(max_new_tokens=8, ignore_eos=True)
SEEDED = dict(max_new_tokens=8, ignore_eos=True, temperature=0.9, top_p=0.95, seed=7)


def _prompt(n: int, base: int) -> list[int]:
    return [base + (i * 37) % 9000 for i in range(n)]


VICTIMS = {"v1": (_prompt(12, 1000), GREEDY), "v2": (_prompt(9, 2000), SEEDED), "v3": (_prompt(15, 3000), GREEDY)}


class InjectedFault(RuntimeError):
    pass


def faulty_runner(eng, monkeypatch, fails) -> list[list[str]]:
    """Replace ``eng.runner.run``: the real pass runs (every row's K/V written, tokens sampled),
    then raises :class:`InjectedFault` when ``fails(seqs)`` names a culprit. Returns the request
    ids of every pass, in order."""
    real = eng.runner.run
    calls: list[list[str]] = []

    def run(items, sample_rows):
        seqs = [seq for seq, _ in items]
        calls.append([s.request_id for s in seqs])
        out = real(items, sample_rows)
        culprit = fails(seqs)
        if culprit is not None:
            raise InjectedFault(f"injected fault: {culprit}")
        return out

    monkeypatch.setattr(eng.runner, "run", run)
    return calls


def watch_failures(eng, monkeypatch) -> list[tuple[list[str], int]]:
    """Record each ``scheduler.fail``: the request ids it failed and the used pages right after."""
    real = eng.scheduler.fail
    seen: list[tuple[list[str], int]] = []

    def fail(batch, err):
        real(batch, err)
        seen.append(([s.request_id for s, _ in batch.items], eng.pool_stats()["used_pages"]))

    monkeypatch.setattr(eng.scheduler, "fail", fail)
    return seen


async def run_together(
    eng, requests: dict[str, tuple[list[int], dict]], streamed: dict[str, list[int]] | None = None
) -> dict[str, object]:
    """Submit every request while the worker waits (one prefill batch, in dict order); each
    request's (token ids, last event), or the exception it raised. ``streamed``: each request's
    token ids as they came (those before an error too)."""
    streamed = {} if streamed is None else streamed

    async def one(rid: str, prompt: list[int], kw: dict):
        toks, last = streamed.setdefault(rid, []), None
        async for ev in eng.generate(rid, prompt, SamplingParams(**kw)):
            if ev.token_id >= 0:
                toks.append(ev.token_id)
            last = ev
        return toks, last

    with worker_paused(eng):
        tasks = {rid: asyncio.ensure_future(one(rid, p, kw)) for rid, (p, kw) in requests.items()}
        await asyncio.sleep(0.05)
    done = await asyncio.gather(*tasks.values(), return_exceptions=True)
    return dict(zip(tasks, done, strict=True))


def finished(result: object) -> tuple[list[int], object]:
    """A request's (token ids, last event); a clear failure when it raised instead."""
    assert not isinstance(result, BaseException), f"a request that should finish raised {result!r}"
    assert isinstance(result, tuple)
    return result


def pages_of(eng, rids: list[str]) -> int:
    return sum(eng.pool.pages_for(len(VICTIMS[r][0]) + VICTIMS[r][1]["max_new_tokens"]) for r in rids)


# ---- bisection, alone --------------------------------------------------------------------------
def test_bisection_runs_halves_and_finds_each_row_that_fails_alone():
    seqs = [Sequence(f"r{i}", [1], SamplingParams(max_new_tokens=1), lambda _: None) for i in range(8)]
    batch = Batch(False, [(s, 1) for s in seqs], [True] * 8)
    calls: list[list[int]] = []

    def run(items, sample_rows):
        ids = [int(s.request_id[1:]) for s, _ in items]
        calls.append(ids)
        if 2 in ids or 5 in ids:
            raise ValueError(f"bad {ids}")
        return [100 + i for i in ids]

    ran, failed = bisect_rows(run, batch, ValueError("whole batch"))
    assert calls == [[0, 1, 2, 3], [4, 5, 6, 7], [4, 5], [6, 7], [4], [5], [0, 1], [2, 3], [2], [3]]
    assert ran == {6: 106, 7: 107, 4: 104, 0: 100, 1: 101, 3: 103}
    assert {i: str(e) for i, e in failed.items()} == {5: "bad [5]", 2: "bad [2]"}
    # a batch of one is not run again: it fails with the error its pass raised
    calls.clear()
    err = ValueError("alone")
    assert bisect_rows(run, batch.rows([2]), err) == ({}, {0: err}) and calls == []


# ---- the engine --------------------------------------------------------------------------------
async def test_no_fault_costs_no_extra_pass(make_engine, monkeypatch):
    eng = await make_engine(**SMALL)
    calls = faulty_runner(eng, monkeypatch, lambda seqs: None)
    out = await run_together(eng, VICTIMS)
    assert [len(finished(out[r])[0]) for r in VICTIMS] == [8, 8, 8]
    st = eng.stats
    assert (st["prefill_steps"], st["decode_steps"]) == (1, 7)
    assert len(calls) == 8  # one pass per step


async def test_a_row_that_raises_at_prefill_fails_alone(make_engine, monkeypatch):
    eng = await make_engine(**SMALL)
    start = eng.pool_stats()["free_pages"]
    alone = await run_together(eng, {r: VICTIMS[r] for r in ("v1", "v2")})
    calls = faulty_runner(eng, monkeypatch, lambda seqs: "c" if any(s.request_id == "c" for s in seqs) else None)
    fails = watch_failures(eng, monkeypatch)
    out = await run_together(eng, {"v1": VICTIMS["v1"], "c": (_prompt(10, 4000), GREEDY), "v2": VICTIMS["v2"]})
    err = out["c"]
    assert isinstance(err, InjectedFault) and str(err) == "injected fault: c"
    assert eng.request_state("c") == "aborted"
    for r in ("v1", "v2"):
        toks, last = finished(out[r])
        assert toks == finished(alone[r])[0] and (last.finish_reason, last.completion_tokens) == ("length", 8)
    # the prefill pass over three rows, then halves: v1 alone runs, [c, v2] raises, c alone raises
    assert calls[:5] == [["v1", "c", "v2"], ["v1"], ["c", "v2"], ["c"], ["v2"]]
    assert all("c" not in call for call in calls[5:]) and len(calls) == 5 + 7
    assert fails == [(["c"], pages_of(eng, ["v1", "v2"]))]  # c's pages freed at once, the others' held
    assert eng.pool_stats()["free_pages"] == start
    eng.check_integrity()


async def test_a_row_that_raises_mid_decode_fails_alone_after_its_tokens(make_engine, monkeypatch):
    eng = await make_engine(**SMALL)
    start = eng.pool_stats()["free_pages"]
    alone = await run_together(eng, VICTIMS)

    def culprit_third_decode(seqs):
        c = [s for s in seqs if s.request_id == "c"]
        return "c at its 4th token" if c and len(c[0].completion_ids) == 3 else None

    calls = faulty_runner(eng, monkeypatch, culprit_third_decode)
    fails = watch_failures(eng, monkeypatch)
    streamed: dict[str, list[int]] = {}
    out = await run_together(eng, {**VICTIMS, "c": (_prompt(10, 4000), GREEDY)}, streamed)
    err = out["c"]
    assert isinstance(err, InjectedFault) and str(err) == "injected fault: c at its 4th token"
    got = streamed["c"]
    assert len(got) == 3 and eng.request_state("c") == "aborted"
    for r in VICTIMS:
        toks, last = finished(out[r])
        assert toks == finished(alone[r])[0] and (last.finish_reason, last.completion_tokens) == ("length", 8)
    # prefill + 2 decode steps of four rows, then the failing one and its halves
    assert calls[3:8] == [["v1", "v2", "v3", "c"], ["v1", "v2"], ["v3", "c"], ["v3"], ["c"]]
    assert all("c" not in call for call in calls[8:])
    assert fails == [(["c"], pages_of(eng, list(VICTIMS)))]
    assert eng.pool_stats()["free_pages"] == start
    eng.check_integrity()


async def test_a_nan_row_fails_its_own_sampling_only(make_engine, monkeypatch):
    """No injected raise: the culprit's row is NaN (as an overflow in a lower precision would
    make it) and its temperature sampling makes the real ``torch.multinomial`` raise."""
    eng = await make_engine(**SMALL)
    marker = 99  # a prompt token no victim prompt holds
    real = eng.model.forward

    def forward(input_ids, attn):
        h = real(input_ids, attn)
        return torch.where((input_ids == marker)[:, None], torch.full_like(h, float("nan")), h)

    monkeypatch.setattr(eng.model, "forward", forward)
    start = eng.pool_stats()["free_pages"]
    alone = await run_together(eng, VICTIMS)
    bad = ([*_prompt(6, 4000), marker], dict(max_new_tokens=8, temperature=1.0, seed=1))
    out = await run_together(eng, {"v1": VICTIMS["v1"], "v2": VICTIMS["v2"], "c": bad, "v3": VICTIMS["v3"]})
    assert isinstance(out["c"], RuntimeError)
    assert str(out["c"]) == "probability tensor contains either `inf`, `nan` or element < 0"
    assert {r: finished(out[r])[0] for r in VICTIMS} == {r: finished(alone[r])[0] for r in VICTIMS}
    assert eng.pool_stats()["free_pages"] == start


async def test_a_fault_every_row_meets_fails_them_all_and_the_engine_goes_on(make_engine, monkeypatch):
    eng = await make_engine(**SMALL)
    start = eng.pool_stats()["free_pages"]
    alone = await run_together(eng, {"v1": VICTIMS["v1"]})
    broken = [True]
    calls = faulty_runner(eng, monkeypatch, lambda seqs: "out of memory" if broken[0] else None)
    out = await run_together(eng, VICTIMS)
    assert {r: str(out[r]) for r in VICTIMS} == dict.fromkeys(VICTIMS, "injected fault: out of memory")
    assert [len(c) for c in calls] == [3, 1, 2, 1, 1]  # 2B - 1 passes, each row last alone
    assert {r: eng.request_state(r) for r in VICTIMS} == dict.fromkeys(VICTIMS, "aborted")
    assert eng.pool_stats()["free_pages"] == start
    eng.check_integrity()
    broken[0] = False
    again = await run_together(eng, {"v1": VICTIMS["v1"]})
    assert finished(again["v1"])[0] == finished(alone["v1"])[0]
