"""Hostile inputs against the disaggregated engine (copy-probe engines, one process):

- a message whose handling raises fails only its own request: the Abort and the Reserve queued
  behind it in the same mailbox batch are still handled (pages freed, caller answered);
- a transfer whose ``first_token_id`` is outside the vocabulary is refused with 400
  ``invalid_transfer`` before any room is touched;
- decode reserves ``max_new_tokens`` clamped to the context (as decode itself clamps), so an
  over-long ``max_tokens`` that fits once clamped is served and blocks nobody; a reservation larger
  than the whole pool is refused at once (503 ``pool_exhausted``), not after the pool wait."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from backend_core_support import worker_paused
from test_backend_disagg_nodes import greedy, prompt, running_stack, wait_idle, wait_state

from config.errors import OpenAIError
from gpu_backend.bootstrap import RoomState, new_room
from gpu_backend.decode_node import decode_reserved, load_pages, reserve_pages
from gpu_backend.errors import EngineError, PoolExhaustedError, RequestAbortedError
from gpu_backend.node_errors import backend_error
from gpu_backend.prefill_node import prefill_export
from gpu_backend.sampling import SamplingParams
from gpu_backend.servers import build_decode_app
from gpu_backend.transfer import CONTENT_TYPE, build_manifest, encode_transfer

pytestmark = pytest.mark.timeout(60)

VOCAB = 100277  # copy-probe's vocabulary (the bundled cl100k_base + ChatML)


def used(engine) -> int:
    return engine.pool_stats()["used_pages"]


async def test_a_raising_message_does_not_drop_the_abort_and_reserve_behind_it():
    async with running_stack() as s:  # decode pool 1024 tokens = 64 pages of 16
        de = s.de
        kv, _ = await prefill_export(s.pe, "pa", prompt(40))
        await reserve_pages(de, "A", 40, 4)  # ceil(44 / 16) = 3 pages
        await load_pages(de, "A", kv, 40)
        await reserve_pages(de, "B", 40, 4)  # 3 more
        assert used(de) == 6
        with worker_paused(de):  # the three messages land in one mailbox batch
            gen = decode_reserved(de, "A", prompt(40), -1, SamplingParams(max_new_tokens=4), 40)
            first = asyncio.ensure_future(gen.__anext__())  # StartDecode(A, first_token_id=-1): raises
            await asyncio.sleep(0.05)
            de.abort("B")  # Abort(B) right behind it
            c = asyncio.ensure_future(reserve_pages(de, "C", 16, 1))  # and Reserve(C): ceil(17 / 16) = 2
            await asyncio.sleep(0.05)
        with pytest.raises(OverflowError):  # A's own caller hears its failure
            await asyncio.wait_for(first, 2)
        pages = await asyncio.wait_for(c, 2)  # the Reserve behind it is answered
        assert len(pages) == 2
        assert used(de) == 2  # A's 3 and B's 3 pages freed: only C's 2 held
        assert sorted(de.requests.live) == ["C"]
        assert de.request_state("A") == "aborted" and de.request_state("B") is None
        assert de.request_state("C") == "reserved"
        de.abort("C")
        await wait_idle(s.pe, s.de)
        # the engine still serves
        toks = [t async for t in de.generate("after", prompt(8), SamplingParams(max_new_tokens=3))]
        assert [t.token_id for t in toks] == prompt(3)


def invalid_transfer(room: int, first_token_id: int) -> dict:
    """The exact 400 body of a transfer whose first token is outside the cl100k vocabulary."""
    message = f"transfer for room {room} has first_token_id {first_token_id}, outside the vocabulary (0 .. 100276)"
    return {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": "invalid_transfer"}}


@pytest.mark.parametrize("bad", [-1, VOCAB])
async def test_a_transfer_with_a_first_token_outside_the_vocabulary_is_a_400(bad):
    async with running_stack() as s:
        room = new_room()
        gen = s.dnode.generate(room, "r", prompt(40), greedy(4))
        first = asyncio.ensure_future(gen.__anext__())
        await wait_state(s.dnode, room, RoomState.RESERVED)
        assert used(s.de) == 3
        kv, _ = await prefill_export(s.pe, "x", prompt(40))
        m = build_manifest(room=room, request_id="r", kv=kv, num_tokens=40, first_token_id=bad, prompt_ids=prompt(40))
        with pytest.raises(EngineError) as e:  # decode_node.InvalidTransferError
            await s.dnode.accept_transfer(m, kv)
        err = backend_error(e.value)
        assert err.status == 400
        assert err.body() == invalid_transfer(room, bad)
        assert s.dnode.counters == {
            "transfers_accepted": 0,
            "transfers_refused": 1,
            "transfer_mismatches": 0,
            "transfer_timeouts": 0,
            "released": 0,
        }
        assert s.dnode.rooms.get(room).transfer is None  # no room touched: the good transfer still fits
        good = build_manifest(
            room=room, request_id="r", kv=kv, num_tokens=40, first_token_id=prompt(40)[0], prompt_ids=prompt(40)
        )
        assert await s.dnode.accept_transfer(good, kv) == 40
        toks = [await first] + [t async for t in gen]
        assert [t.token_id for t in toks] == prompt(4) and toks[-1].finish_reason == "length"
        await s.router.drain()
        await wait_idle(s.pe, s.de)


async def test_a_bad_first_token_over_http_is_the_400_body():
    async with running_stack() as s:
        kv, _ = await prefill_export(s.pe, "x", prompt(20))
        m = build_manifest(room=7, request_id="r", kv=kv, num_tokens=20, first_token_id=-1, prompt_ids=prompt(20))
        app = build_decode_app(s.dnode)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://decode") as c:
            r = await c.post("/disagg/transfer", content=encode_transfer(m, kv), headers={"content-type": CONTENT_TYPE})
        assert r.status_code == 400
        assert r.json() == invalid_transfer(7, -1)
        assert len(s.dnode.rooms) == 0 and used(s.de) == 0


async def _stream(router, rid: str, ids: list[int], params: dict) -> tuple[list, float]:
    t0 = time.monotonic()
    st = await router.open(rid, ids, params)
    toks = [t async for t in st]
    return toks, time.monotonic() - t0


async def test_decode_reserves_the_clamped_max_tokens_and_blocks_nobody():
    # context 512, decode pool 256 tokens = 16 pages: max_req_len 255, so prompt 10 + max_tokens 400
    # clamps to 244 new tokens: ceil(254 / 16) = 16 pages, the whole pool (unclamped: 26, never fits).
    # The pool wait is long (30 s) so that a loaded machine's slow 244 steps time nothing out: the
    # victim must be served as soon as the big request's pages come back, whenever that is.
    async with running_stack(decode_pool=256, pool_wait=30.0) as s:
        assert s.de.max_req_len == 255 and s.de.pool_stats()["total_pages"] == 16
        room = new_room()
        gen = s.dnode.generate(room, "big0", prompt(10, 2000), greedy(400))
        first = asyncio.ensure_future(gen.__anext__())
        await wait_state(s.dnode, room, RoomState.RESERVED, timeout=2.0)
        assert s.dnode.rooms.get(room).reservation.max_new_tokens == 244
        assert used(s.de) == 16
        assert s.dnode.release(room)
        with pytest.raises(RequestAbortedError):  # released while waiting for its transfer: 499
            await first
        await wait_idle(s.de)

        ended: dict[str, float] = {}
        big = asyncio.ensure_future(_stream(s.router, "big", prompt(10, 2000), greedy(400)))
        big.add_done_callback(lambda _: ended.setdefault("big", time.monotonic()))
        await asyncio.sleep(0.2)
        victim = asyncio.ensure_future(_stream(s.router, "v1", prompt(10), greedy(4)))
        victim.add_done_callback(lambda _: ended.setdefault("victim", time.monotonic()))
        (btoks, _), (vtoks, _) = await asyncio.wait_for(asyncio.gather(big, victim), 60)
        assert len(btoks) == 244 and btoks[-1].finish_reason == "length"
        assert [t.token_id for t in vtoks] == prompt(4) and vtoks[-1].finish_reason == "length"
        # served once the pages came back (its own 4 steps after the big one ends), not when the
        # pool wait runs out (30 s)
        assert ended["victim"] - ended["big"] < 2.0
        await s.router.drain()
        await wait_idle(s.pe, s.de)


async def test_a_reservation_larger_than_the_pool_is_refused_at_once_and_blocks_nobody():
    async with running_stack(decode_pool=256, pool_wait=5.0) as s:  # 16 pages of 16 tokens
        t0 = time.monotonic()
        huge = asyncio.ensure_future(reserve_pages(s.de, "huge", 300, 100))  # ceil(400 / 16) = 25 pages
        small = asyncio.ensure_future(reserve_pages(s.de, "small", 10, 4))
        with pytest.raises(PoolExhaustedError) as e:
            await asyncio.wait_for(huge, 2)
        assert time.monotonic() - t0 < 1.0  # at once, not after the 5 s pool wait
        err = backend_error(e.value)
        assert isinstance(err, OpenAIError) and err.status == 503 and err.code == "pool_exhausted"
        assert err.message == (
            "KV pool too small: 25 pages (400 tokens) needed, the whole pool holds 16 (256 tokens); reduce max_tokens"
        )
        assert len(await asyncio.wait_for(small, 2)) == 1
        assert time.monotonic() - t0 < 1.0
        assert used(s.de) == 1 and sorted(s.de.requests.live) == ["small"]
        s.de.abort("small")
        await wait_idle(s.de)
