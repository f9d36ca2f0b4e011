"""The bundled engine's isolation invariants attacked again, fourth round (copy-probe engines in one
process; docs/backend.md and docs/backend-disaggregation.md list the invariants):

- an abort at every stage (queued, between two prefill chunks, mid-decode; on the disaggregated
  path after prefill before the transfer and between the page load and decode) frees and zeroes
  the pages the request held, turns its handles stale, and the next request, handed those very
  pages, reads only its own prompt; under the ``no_scrub`` fault the pages stay readable and the
  handles stay usable, so the test fails as it must;
- the incident through the router with every subset of the three faults: only all three together
  leak another tenant's prompt; each invariant alone stops it;
- a transfer built for another request (a faulty prefill node confusing rooms) is refused, its
  room fails and the tenant gets nothing of the other request;
- a client id reused while the first request still decodes, or right after it finished while its
  caller has not yet left;
- identical prompts from two tenants share no page (the engine has no prefix cache);
- a transfer for a room that already finished, a decode pool exhausted while a request decodes (no
  preemption: pages are reserved up front), a batch with one over-length row, and a completion that
  ends on the last slot of the decode pool.
"""

from __future__ import annotations

import asyncio
import threading
import time

import backend_core_support
import pytest
from backend_core_support import collect, worker_paused
from test_backend_disagg_nodes import greedy, running_stack, wait_idle, wait_state

from config.errors import OpenAIError
from gpu_backend.bootstrap import RoomState, new_room
from gpu_backend.decode_node import RoomGoneError, decode_reserved, load_pages, reserve_pages
from gpu_backend.errors import (
    InvalidRequestError,
    PromptTooLongError,
    RequestAbortedError,
    StaleHandleError,
    TransferMismatchError,
)
from gpu_backend.faults import NO_FAULTS, Faults
from gpu_backend.prefill_node import prefill_export
from gpu_backend.sampling import SamplingParams
from gpu_backend.transfer import build_manifest

pytestmark = pytest.mark.timeout(60)
make_engine = backend_core_support.make_engine  # the fixture: every engine stopped, checked idle and scrubbed

SCRUB = pytest.mark.parametrize("faults", [NO_FAULTS, Faults(no_scrub=True)], ids=["scrub", "no_scrub"])


def _ids(n: int, base: int) -> list[int]:
    return [base + i for i in range(n)]


class Gate:
    """Stops the engine's worker right after a forward pass that ``when(items)`` picks (the pass's
    K/V written, its tokens not yet recorded) until :meth:`open`; ``reached`` is set there."""

    def __init__(self, eng, monkeypatch, when) -> None:
        self.reached, self._go = threading.Event(), threading.Event()
        run = eng.runner.run

        def gated(items, sample_rows):
            out = run(items, sample_rows)
            if not self._go.is_set() and when(items):
                self.reached.set()
                self._go.wait(10)
            return out

        monkeypatch.setattr(eng.runner, "run", gated)

    async def wait(self) -> None:
        assert await asyncio.to_thread(self.reached.wait, 10), "the gated pass never ran"

    def open(self) -> None:
        self._go.set()


def _leftovers(pool, handles) -> tuple[list[int], bool]:
    """The pages of ``handles`` that still hold data, and whether the handles are refused as stale."""
    try:
        pool.check(handles)
    except StaleHandleError:
        stale = True
    else:
        stale = False
    return [h.index for h in handles if not pool.page_is_zero(h.index)], stale


# ---- abort at every stage, engine core -----------------------------------------------------------
# 5 pages of 16: max_req_len 79; the victim (64 + 15) takes the whole pool, so the next request gets
# exactly its pages. max_batch_tokens 16: the victim's prompt is prefilled in four chunks.
CORE = dict(model="copy-probe", max_total_tokens=80, context_length=2048, max_batch_tokens=16)
VICTIM = _ids(64, 20_000)


@SCRUB
@pytest.mark.parametrize("stage", ["queued", "between_prefill_chunks", "mid_decode"])
async def test_an_abort_at_every_stage_frees_zeroes_and_stales_every_page(make_engine, monkeypatch, stage, faults):
    eng = await make_engine(**CORE, faults=faults)
    scrub = faults == NO_FAULTS

    def picks(items) -> bool:
        return any(
            s.request_id == "victim" and (s.num_cached == 0 if stage == "between_prefill_chunks" else s.num_cached > 64)
            for s, _ in items
        )

    gate = Gate(eng, monkeypatch, picks)
    it = eng.generate("victim", VICTIM, SamplingParams(max_new_tokens=15, ignore_eos=True))
    if stage == "queued":
        with worker_paused(eng):  # AddRequest and Abort reach the worker together: it never runs
            first = asyncio.ensure_future(it.__anext__())
            await asyncio.sleep(0)
            eng.abort("victim")
        handles, written = [], 0
    else:
        first = asyncio.ensure_future(it.__anext__())
        await gate.wait()
        victim = eng._live["victim"]
        handles, written = list(victim.pages), victim.num_cached + (16 if stage == "between_prefill_chunks" else 1)
        eng.abort("victim")  # queued while the worker is held after the pass: handled before the next one
        gate.open()
    evs = [await first] + [ev async for ev in it]
    assert evs[-1].finish_reason == "abort" and eng.request_state("victim") == "aborted"
    if stage == "mid_decode":
        assert [e.token_id for e in evs[:-1]] == VICTIM[: len(evs) - 1]
    assert eng.stats["prefill_tokens"] == {"queued": 0, "between_prefill_chunks": 16, "mid_decode": 64}[stage]
    assert eng.pool_stats()["used_pages"] == 0
    leftovers, stale = _leftovers(eng.pool, handles)
    # the scrub zeroes every page the victim wrote and its handles are refused; no_scrub leaves both
    dirty = [h.index for h in handles][: -(-written // 16)]
    assert (leftovers, stale) == (([], bool(handles)) if scrub else (dirty, False))
    # the next tenant is handed every page the victim held and reads only its own prompt
    nxt = _ids(74, 40_000)
    toks, _, last = await collect(eng, "next", nxt, max_new_tokens=4, ignore_eos=True)
    assert (toks, last.finish_reason, last.prompt_tokens) == (nxt[:4], "length", 74)


# ---- abort at every stage, disaggregated ---------------------------------------------------------
# decode pool of 3 pages (48 tokens): a 40-token prompt reserves every page (40 + 6, max_req_len 47)


async def _reserved_room(s, rid: str, ids: list[int], n: int):
    room = new_room()
    gen = s.dnode.generate(room, rid, ids, greedy(n))
    first = asyncio.ensure_future(gen.__anext__())
    await wait_state(s.dnode, room, RoomState.RESERVED)
    return room, gen, first


async def _pages_freed(eng) -> None:
    for _ in range(500):  # the worker frees at its next step boundary
        if eng.pool_stats()["used_pages"] == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"pages still held: {eng.pool_stats()}")


@SCRUB
@pytest.mark.parametrize("stage", ["before_transfer", "between_load_and_decode"])
async def test_a_release_around_the_transfer_frees_zeroes_and_the_next_tenant_reads_its_own(stage, faults):
    scrub = faults == NO_FAULTS
    async with running_stack(faults=faults, decode_pool=48) as s:
        secret = _ids(40, 20_000)
        room, gen, first = await _reserved_room(s, "victim", secret, 6)
        handles = list(s.de._live[f"victim@{room:016x}"].pages)
        kv, res = await prefill_export(s.pe, "x", secret)
        m = build_manifest(
            room=room, request_id="victim", kv=kv, num_tokens=40, first_token_id=res.first_token_id, prompt_ids=secret
        )
        if stage == "before_transfer":
            assert s.dnode.release(room)
            with pytest.raises(RoomGoneError):
                await s.dnode.accept_transfer(m, kv)
        else:
            with worker_paused(s.de):  # the load and the release reach the worker together, load first
                load = asyncio.ensure_future(s.dnode.accept_transfer(m, kv))
                while not s.de.scheduler.mailbox._queue:
                    await asyncio.sleep(0)
                assert s.dnode.release(room)
            with pytest.raises(RoomGoneError):  # the room closed before its pages were loaded
                await load
        with pytest.raises(RequestAbortedError):
            await first
        await gen.aclose()
        await _pages_freed(s.de)
        leftovers, stale = _leftovers(s.de.pool, handles)
        loaded = stage != "before_transfer"
        assert (leftovers, stale) == (([], True) if scrub else ([h.index for h in handles] if loaded else [], False))
        if scrub:
            await wait_idle(s.pe, s.de)
        nxt = _ids(40, 40_000)  # the next tenant gets the same three pages
        stream = await s.router.open("next", nxt, greedy(6))
        toks = [t.token_id async for t in stream]
        assert toks == nxt[:6]


# ---- the incident with every subset of the faults ------------------------------------------------
# decode pool of 17 pages (272 tokens, max_req_len 271): the secret (250 + 20) takes every page, so
# the over-length request's reservation (251 + 8) is handed exactly the secret's pages


@pytest.mark.parametrize(
    "names",
    [
        "admit_rejected,skip_transfer_check,no_scrub",
        "skip_transfer_check,no_scrub",
        "admit_rejected,no_scrub",
        "admit_rejected,skip_transfer_check",
    ],
)
async def test_only_all_three_faults_leak_each_invariant_alone_stops_the_incident(names):
    faults = Faults(**dict.fromkeys(names.split(","), True))
    async with running_stack(faults=faults, decode_pool=272) as s:
        secret = _ids(250, 20_000)  # the longest prompt prefill admits (max_req_input_len 250)
        stream = await s.router.open("tenant-a", secret, greedy(20))
        assert [t.token_id async for t in stream] == secret[:20]
        await s.router.drain()
        await _pages_freed(s.de)
        over = _ids(251, 60_000)
        try:
            stream = await s.router.open("tenant-b", over, greedy(8))
            got = [t async for t in stream]
            outcome: object = ([t.token_id for t in got], got[-1].prompt_tokens)
        except OpenAIError as e:
            outcome = (e.status, e.code)
        await s.router.drain()
        expected = {
            # the incident: a 200 whose text is tenant A's prompt (B's own first token is the placeholder's)
            "admit_rejected,skip_transfer_check,no_scrub": ([0, *secret[1:8]], 251),
            "skip_transfer_check,no_scrub": (400, "context_length_exceeded"),  # invariant 1
            "admit_rejected,no_scrub": (500, "transfer_mismatch"),  # invariant 2
            # invariant 3: the positions never received read as zeros, so decode attends to the
            # placeholder's position 0 and copies it (nobody else's token)
            "admit_rejected,skip_transfer_check": ([0] * 8, 251),
        }[names]
        assert outcome == expected
        await _pages_freed(s.pe)
        await _pages_freed(s.de)


# ---- a transfer built for another request --------------------------------------------------------


async def test_a_transfer_built_for_another_request_is_refused_and_its_room_fails():
    """A faulty prefill node confusing rooms sends tenant A's pages (same length) into tenant B's
    room, under A's request id. Decode accepted it: B's completion was A's prompt."""
    async with running_stack() as s:
        a, b = _ids(20, 1000), _ids(20, 3000)
        room, gen, first = await _reserved_room(s, "tenant-b", b, 5)
        kv, res = await prefill_export(s.pe, "x", a)
        m = build_manifest(
            room=room, request_id="tenant-a", kv=kv, num_tokens=20, first_token_id=res.first_token_id, prompt_ids=a
        )
        with pytest.raises(TransferMismatchError) as e:
            await s.dnode.accept_transfer(m, kv)
        msg = f"transfer for room {room} was built for request 'tenant-a', the room's request is 'tenant-b'"
        assert (e.value.status, str(e.value)) == (500, msg)
        with pytest.raises(TransferMismatchError):
            await first
        await gen.aclose()
        assert s.dnode.counters["transfers_accepted"] == 0 and s.dnode.counters["transfer_mismatches"] == 1
        await wait_idle(s.pe, s.de)


async def test_a_transfer_for_a_room_that_already_finished_is_a_410_and_touches_no_page():
    async with running_stack() as s:
        ids = _ids(20, 1000)
        room, gen, first = await _reserved_room(s, "r", ids, 3)
        kv, res = await prefill_export(s.pe, "x", ids)
        m = build_manifest(
            room=room, request_id="r", kv=kv, num_tokens=20, first_token_id=res.first_token_id, prompt_ids=ids
        )
        assert await s.dnode.accept_transfer(m, kv) == 20
        assert [t.token_id for t in [await first] + [t async for t in gen]] == ids[:3]
        await wait_idle(s.pe, s.de)
        with pytest.raises(RoomGoneError):  # the same transfer again, and another one
            await s.dnode.accept_transfer(m, kv)
        m2 = build_manifest(room=room, request_id="r", kv=kv, num_tokens=20, first_token_id=ids[1], prompt_ids=ids)
        with pytest.raises(RoomGoneError):
            await s.dnode.accept_transfer(m2, kv)
        assert s.dnode.counters["transfers_refused"] == 2 and s.de.stats["decode_steps"] == 2
        await wait_idle(s.pe, s.de)


# ---- request ids ------------------------------------------------------------------------------------


async def test_a_client_id_reused_while_the_first_decodes_serves_both_their_own_prompts():
    async with running_stack() as s:
        a, b = _ids(30, 1000), _ids(30, 5000)
        first = await s.router.open("same", a, greedy(60))
        got_a = [await first.__anext__()]
        second = await s.router.open("same", b, greedy(10))  # another room, another engine id
        got_b = [t async for t in second]
        got_a += [t async for t in first]
        assert [t.token_id for t in got_a] == [a[j % 30] for j in range(60)]
        assert [t.token_id for t in got_b] == b[:10]
        await s.router.drain()
        await wait_idle(s.pe, s.de)


async def test_an_engine_id_reused_while_the_first_decodes_is_a_400_and_the_first_goes_on(make_engine):
    eng = await make_engine(model="copy-probe", max_total_tokens=1024, context_length=1024)
    a = _ids(20, 1000)
    it = eng.generate("X", a, SamplingParams(max_new_tokens=40, ignore_eos=True))
    got = [await it.__anext__()]
    with pytest.raises(InvalidRequestError, match="request id 'X' is already in flight"):
        await collect(eng, "X", _ids(20, 5000), max_new_tokens=2)
    with pytest.raises(InvalidRequestError, match="request id 'X' is already in flight"):
        await reserve_pages(eng, "X", 20, 2)
    got += [ev async for ev in it]
    assert [e.token_id for e in got] == [a[j % 20] for j in range(40)]


async def test_a_decode_caller_leaving_late_does_not_abort_the_next_reservation_with_its_id(make_engine):
    """The round-3 fix for ``generate`` held for ``decode_reserved`` too: its caller leaving after
    the request retired (its last token unread) aborted whatever request had the id by then."""
    eng = await make_engine(model="copy-probe", max_total_tokens=1024, context_length=1024)
    ids = _ids(3, 5000)
    kv, res = await prefill_export(eng, "p", ids)
    await reserve_pages(eng, "X", 3, 2)
    await load_pages(eng, "X", kv, 3)
    old = decode_reserved(eng, "X", ids, res.first_token_id, SamplingParams(max_new_tokens=2, ignore_eos=True), 3)
    assert (await old.__anext__()).token_id == 5000
    for _ in range(500):  # the worker retires it; its last token waits, unread
        if eng.request_state("X") == "finished":
            break
        await asyncio.sleep(0.01)
    assert eng.request_state("X") == "finished"
    await reserve_pages(eng, "X", 3, 2)  # the id is free: a new reservation takes it
    await old.aclose()  # the old caller leaves
    await load_pages(eng, "X", kv, 3)
    new = decode_reserved(eng, "X", ids, res.first_token_id, SamplingParams(max_new_tokens=2, ignore_eos=True), 3)
    assert [ev.token_id async for ev in new] == ids[:2]


def waiter_room(s) -> int:
    """The room of the one request of client id ``b`` in flight."""
    (room,) = s.router.inflight["b"]
    return room


# ---- prefix sharing, pool exhaustion, batches, the pool's end ----------------------------------------


async def test_identical_prompts_from_two_tenants_share_no_page_and_no_forward_pass(make_engine):
    """The engine has no prefix cache: a prompt's KV lives in its own request's pages only, so no
    tenant's KV is reused for another (a prefix cache would have to key pages by the cache salt)."""
    eng = await make_engine(model="copy-probe", max_total_tokens=1024, context_length=1024)
    same = _ids(40, 9000)
    with worker_paused(eng):
        tasks = [
            asyncio.ensure_future(collect(eng, rid, same, max_new_tokens=30, ignore_eos=True)) for rid in ("ta", "tb")
        ]
        await asyncio.sleep(0)
    owners: dict[str, set[int]] = {}
    for _ in range(500):
        owners = {rid: {i for i, o in enumerate(eng.pool.owner) if o == rid} for rid in ("ta", "tb")}
        if all(owners.values()):
            break
        await asyncio.sleep(0.005)
    assert len(owners["ta"]) == len(owners["tb"]) == 5 and not owners["ta"] & owners["tb"]
    for toks, _, last in await asyncio.gather(*tasks):
        assert toks == same[:30] and last.finish_reason == "length"
    assert eng.stats["prefill_tokens"] == 80  # both prompts computed in full
    toks, _, _ = await collect(eng, "tc", same, max_new_tokens=3, ignore_eos=True)  # after both finished
    assert toks == same[:3] and eng.stats["prefill_tokens"] == 120


async def test_a_full_decode_pool_mid_decode_preempts_nobody_and_the_waiter_gets_scrubbed_pages(monkeypatch):
    """No preemption: pages for prompt + max_tokens are reserved before decode starts, so a pool
    that fills up mid-decode never takes a running request's pages; the next request waits for
    them and reads only its own prompt."""
    async with running_stack(decode_pool=48) as s:  # one request (40 + 6) takes every page
        a, b = _ids(40, 1000), _ids(40, 5000)
        run = s.de.runner.run

        def slow(items, sample_rows):  # a's decode steps take a while: b arrives mid-decode
            if any(seq.request_id.startswith("a@") for seq, _ in items):
                time.sleep(0.05)
            return run(items, sample_rows)

        monkeypatch.setattr(s.de.runner, "run", slow)
        first = await s.router.open("a", a, greedy(6))
        waiter = asyncio.ensure_future(s.router.open("b", b, greedy(6)))
        for _ in range(500):
            if s.de.scheduler.reservations.waiting:
                break
            await asyncio.sleep(0.005)
        assert s.de.request_state(first.engine_id) == "decoding" and s.de.pool_stats()["free_pages"] == 0
        assert [r.request_id for r in s.de.scheduler.reservations.waiting] == [f"b@{waiter_room(s):016x}"]
        assert [t.token_id async for t in first] == a[:6]
        second = await waiter
        assert [t.token_id async for t in second] == b[:6]
        await s.router.drain()
        await wait_idle(s.pe, s.de)


async def test_one_over_length_row_is_rejected_alone_and_its_batch_runs(make_engine):
    eng = await make_engine(model="copy-probe", max_total_tokens=256, context_length=2048)  # input limit 250
    jobs = {"r0": _ids(30, 1000), "r1": _ids(251, 3000), "r2": _ids(250, 6000)}
    with worker_paused(eng):
        tasks = {
            rid: asyncio.ensure_future(collect(eng, rid, p, max_new_tokens=4, ignore_eos=True))
            for rid, p in jobs.items()
        }
        await asyncio.sleep(0)
    with pytest.raises(PromptTooLongError):
        await tasks["r1"]
    assert eng.request_state("r1") == "rejected"
    for rid in ("r0", "r2"):
        toks, _, last = await tasks[rid]
        assert (toks, last.prompt_tokens) == (jobs[rid][:4], len(jobs[rid]))
    assert eng.stats["prefill_steps"] == 2 and eng.stats["prefill_tokens"] == 280


async def test_a_completion_ending_on_the_decode_pool_s_last_slot_is_exact():
    async with running_stack(decode_pool=48) as s:  # max_req_len 47: 40 + 6 reserved, 45 positions written
        p = _ids(40, 1000)
        stream = await s.router.open("edge", p, greedy(10**4))
        got = [t async for t in stream]
        assert [t.token_id for t in got] == p[:6] and got[-1].finish_reason == "length"
        await s.router.drain()
        await wait_idle(s.pe, s.de)


async def test_a_second_generate_call_for_a_decoding_room_is_a_400_and_the_first_goes_on():
    async with running_stack() as s:
        ids = _ids(20, 1000)
        room, gen, first = await _reserved_room(s, "r", ids, 30)
        kv, res = await prefill_export(s.pe, "x", ids)
        m = build_manifest(
            room=room, request_id="r", kv=kv, num_tokens=20, first_token_id=res.first_token_id, prompt_ids=ids
        )
        assert await s.dnode.accept_transfer(m, kv) == 20
        got = [await first]
        with pytest.raises(InvalidRequestError, match=f"room {room} already has a generate call"):
            await s.dnode.generate(room, "r", _ids(20, 5000), greedy(3)).__anext__()
        got += [t async for t in gen]
        assert [t.token_id for t in got] == [ids[j % 20] for j in range(30)]
        await wait_idle(s.pe, s.de)
