"""Prefill node, decode node and router in one process over real copy-probe engines: docs/design.md
invariant 2 (decode accepts a transfer only if it equals the reservation), prefill rejection,
and every abort / disconnect / timeout path freeing the pages on both sides."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest

from config.errors import OpenAIError, context_length_message
from gpu_backend.bootstrap import RoomState, new_room
from gpu_backend.decode_node import DecodeNode, RoomGoneError, TransferTimeoutError, reserve_pages
from gpu_backend.engine import Engine, EngineConfig
from gpu_backend.errors import TransferMismatchError
from gpu_backend.faults import NO_FAULTS, Faults
from gpu_backend.prefill_node import LocalSink, PrefillNode, prefill_export
from gpu_backend.router import LocalDecodeClient, LocalPrefillClient, Router
from gpu_backend.transfer import build_manifest

pytestmark = pytest.mark.timeout(60)

CONTEXT = 512
PREFILL_POOL = 256  # max_req_input_len = min(511, 255) - 5 = 250
DECODE_POOL = 1024


def greedy(n: int) -> dict:
    return {
        "max_new_tokens": n,
        "temperature": 0.0,
        "top_p": 1.0,
        "seed": None,
        "stop": [],
        "stop_token_ids": [],
        "ignore_eos": False,
    }


def prompt(n: int, base: int = 1000) -> list[int]:
    return [base + i for i in range(n)]


@dataclass
class Stack:
    pe: Engine
    de: Engine
    pnode: PrefillNode
    dnode: DecodeNode
    router: Router


async def make_stack(
    *,
    faults: Faults = NO_FAULTS,
    decode_pool: int = DECODE_POOL,
    pool_wait: float = 5.0,
    transfer_timeout: float = 5.0,
    open_timeout: float = 30.0,
    sink=None,
) -> Stack:
    def eng(pool: int) -> Engine:
        return Engine(
            EngineConfig(
                model="copy-probe",
                device="cpu",
                context_length=CONTEXT,
                max_total_tokens=pool,
                pool_wait_timeout_seconds=pool_wait,
                faults=faults,
            )
        )

    pe, de = eng(PREFILL_POOL), eng(decode_pool)
    await pe.start()
    await de.start()
    dnode = DecodeNode(de, faults=faults, transfer_timeout_seconds=transfer_timeout)
    pnode = PrefillNode(pe, sink or LocalSink(dnode), transfer_timeout_seconds=transfer_timeout)
    router = Router(LocalPrefillClient(pnode), LocalDecodeClient(dnode), open_timeout=open_timeout)
    return Stack(pe, de, pnode, dnode, router)


@contextlib.asynccontextmanager
async def running_stack(**kw: Any) -> AsyncIterator[Stack]:
    """:func:`make_stack` (``kw``: its options), both engines stopped on the way out."""
    s = await make_stack(**kw)
    try:
        yield s
    finally:
        await s.pe.stop()
        await s.de.stop()


@pytest.fixture
async def stack():
    s = await make_stack()
    yield s
    await s.router.drain()
    await s.pe.stop()
    await s.de.stop()


async def wait_idle(*engines: Engine, timeout: float = 10.0) -> None:
    """Every page free and zeroed on every engine (the worker frees at the next step boundary)."""
    deadline = time.monotonic() + timeout
    while True:
        views = [(e.pool_stats(), bool(e.pool.kv.any())) for e in engines]
        if all(st["free_pages"] == st["total_pages"] and st["used_pages"] == 0 and not nz for st, nz in views):
            for e in engines:
                e.check_integrity()  # invariant 4 counted two ways, on the idle engine
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"pools not idle: {views}")
        await asyncio.sleep(0.02)


async def wait_state(dnode: DecodeNode, room: int, state: RoomState, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not (dnode.rooms.get(room) and dnode.rooms.get(room).state == state):
        assert time.monotonic() < deadline, f"room never reached {state}"
        await asyncio.sleep(0.005)


async def test_router_round_trip_copies_the_own_prompt(stack):
    p = prompt(40)
    s = await stack.router.open("r1", p, greedy(8))
    toks = [t async for t in s]
    assert [t.token_id for t in toks] == p[:8]
    assert [t.completion_tokens for t in toks] == list(range(1, 9))
    assert toks[-1].finished and toks[-1].finish_reason == "length" and toks[-1].prompt_tokens == 40
    assert s.outcome.num_tokens == 40 and s.outcome.first_token_id == p[0] and not s.outcome.placeholder
    assert stack.dnode.counters["transfers_accepted"] == 1
    await stack.router.drain()
    await wait_idle(stack.pe, stack.de)


async def _export(stack: Stack, n: int, room: int):
    kv, res = await prefill_export(stack.pe, f"x{room}", prompt(n, 5000))
    return build_manifest(
        room=room,
        request_id="r",
        kv=kv,
        num_tokens=res.num_tokens,
        first_token_id=res.first_token_id,
        prompt_ids=prompt(n, 5000),
    ), kv


async def test_invariant_2_a_short_transfer_is_refused_and_nothing_is_generated(stack):
    room = new_room()
    gen = stack.dnode.generate(room, "r", prompt(40), greedy(4))
    first = asyncio.ensure_future(gen.__anext__())
    await wait_state(stack.dnode, room, RoomState.RESERVED)
    assert stack.de.pool_stats()["used_pages"] == 3  # ceil((40 + 4) / 16)
    manifest, kv = await _export(stack, 16, room)  # one page: what the incident sent
    with pytest.raises(TransferMismatchError) as e:
        await stack.dnode.accept_transfer(manifest, kv)
    assert e.value.status == 500 and e.value.code == "transfer_mismatch"
    assert e.value.message == (
        f"decode reserved 40 prompt tokens for room {room} but the transfer holds 16; "
        "the request is aborted and nothing is generated"
    )
    with pytest.raises(TransferMismatchError) as g:
        await first  # the generate call fails before yielding a single token
    assert g.value is e.value
    assert stack.dnode.counters["transfer_mismatches"] == 1 and stack.dnode.counters["transfers_accepted"] == 0
    with pytest.raises(RoomGoneError):  # the room is closed: a retry cannot sneak in
        await stack.dnode.accept_transfer(manifest, kv)
    await wait_idle(stack.pe, stack.de)


async def test_invariant_2_a_long_transfer_is_refused_too(stack):
    room = new_room()
    gen = stack.dnode.generate(room, "r", prompt(10), greedy(4))
    first = asyncio.ensure_future(gen.__anext__())
    await wait_state(stack.dnode, room, RoomState.RESERVED)
    manifest, kv = await _export(stack, 12, room)
    with pytest.raises(TransferMismatchError, match="reserved 10 prompt tokens .* holds 12"):
        await stack.dnode.accept_transfer(manifest, kv)
    with pytest.raises(TransferMismatchError):
        await first
    await wait_idle(stack.pe, stack.de)


async def test_fault_skip_transfer_check_accepts_the_short_transfer_and_attends_over_the_reservation():
    async with running_stack(faults=Faults(skip_transfer_check=True)) as s:
        room = new_room()
        gen = s.dnode.generate(room, "r", prompt(40), greedy(4))
        first = asyncio.ensure_future(gen.__anext__())
        await wait_state(s.dnode, room, RoomState.RESERVED)
        manifest, kv = await _export(s, 16, room)
        assert await s.dnode.accept_transfer(manifest, kv) == 40  # context = every reserved prompt position
        ev = await first
        rest = [e async for e in gen]
        assert ev.completion_tokens == 1 and rest[-1].finished and rest[-1].prompt_tokens == 40
        assert s.dnode.counters["transfer_mismatches"] == 1 and s.dnode.counters["transfers_accepted"] == 1


async def test_prefill_rejection_is_a_400_and_frees_the_decode_reservation(stack):
    p = prompt(251)  # max_req_input_len is 250
    with pytest.raises(OpenAIError) as e:
        await stack.router.open("r-long", p, greedy(8))
    assert e.value.status == 400
    assert e.value.body() == {
        "error": {
            "message": context_length_message(250, 251, 0, messages=False),
            "type": "invalid_request_error",
            "param": "prompt",
            "code": "context_length_exceeded",
        }
    }
    await stack.router.drain()
    assert stack.pnode.counters == {"prefilled": 0, "rejected": 1, "placeholders": 0, "aborted": 0}
    assert stack.pe.stats["prefill_tokens"] == 0  # retired at admission: no forward pass
    assert stack.dnode.counters["transfers_accepted"] == 0 and len(stack.dnode.rooms) == 0
    await wait_idle(stack.pe, stack.de)
    with pytest.raises(OpenAIError) as chat:
        await stack.router.open("r-long-chat", p, greedy(8), param="messages")
    assert chat.value.param == "messages" and "in the messages" in chat.value.message


async def test_abort_request_mid_decode_ends_with_abort_and_frees_both(stack):
    p = prompt(30)
    s = await stack.router.open("r-abort", p, greedy(400))
    got = [await s.__anext__(), await s.__anext__()]
    assert stack.router.abort("r-abort") is True
    rest = [t async for t in s]
    assert rest[-1].finished and rest[-1].finish_reason == "abort"
    ids = [t.token_id for t in got + rest if t.token_id >= 0]
    assert ids == [p[j % 30] for j in range(len(ids))] and len(ids) < 400
    assert stack.router.abort("r-abort") is False  # no longer in flight
    await stack.router.drain()
    await wait_idle(stack.pe, stack.de)


async def test_client_disconnect_mid_decode_frees_both(stack):
    s = await stack.router.open("r-gone", prompt(30), greedy(400))
    await s.__anext__()
    s.close_now()  # what the server does when the client goes away
    await stack.router.drain()
    await wait_idle(stack.pe, stack.de)
    assert stack.router.inflight == {}


async def test_client_disconnect_during_prefill_frees_both(stack):
    task = asyncio.ensure_future(stack.router.open("r-early", prompt(250), greedy(8)))
    for _ in range(3):  # let it start the prefill and the reservation, not finish them
        await asyncio.sleep(0)
    assert not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await stack.router.drain()
    await wait_idle(stack.pe, stack.de)
    assert len(stack.dnode.rooms) == 0


async def test_decode_waits_for_a_transfer_then_times_out_and_frees_the_reservation():
    async with running_stack(transfer_timeout=0.3) as s:
        room = new_room()
        gen = s.dnode.generate(room, "r", prompt(40), greedy(4))
        t0 = time.monotonic()
        with pytest.raises(TransferTimeoutError) as e:
            await gen.__anext__()
        assert 0.25 < time.monotonic() - t0 < 5
        assert e.value.status == 504 and e.value.code == "upstream_timeout"
        assert s.dnode.counters["transfer_timeouts"] == 1
        await wait_idle(s.de)
        manifest, kv = await _export(s, 40, room)
        with pytest.raises(RoomGoneError):  # a late transfer finds the room closed
            await s.dnode.accept_transfer(manifest, kv)
        await wait_idle(s.pe, s.de)


async def test_a_transfer_without_reservation_times_out():
    async with running_stack(transfer_timeout=0.2, pool_wait=0.2) as s:
        room = new_room()
        manifest, kv = await _export(s, 20, room)
        with pytest.raises(TransferTimeoutError, match="no reservation"):
            await s.dnode.accept_transfer(manifest, kv)
        with pytest.raises(RoomGoneError):
            await s.dnode.generate(room, "r", prompt(20), greedy(2)).__anext__()
        await wait_idle(s.pe, s.de)


async def test_full_decode_pool_is_a_503_never_a_400_and_prefill_is_freed():
    async with running_stack(decode_pool=64, pool_wait=0.3) as s:
        hog = await reserve_pages(s.de, "hog", 48, 16)  # all 4 pages
        with pytest.raises(OpenAIError) as e:
            await s.router.open("r-wait", prompt(20), greedy(8))
        assert e.value.status == 503 and e.value.code == "pool_exhausted"
        assert len(hog) == 4
        s.de.abort("hog")
        await s.router.drain()
        await wait_idle(s.pe, s.de)
        ok = await s.router.open("r-after", prompt(20), greedy(8))  # the pool is back: it succeeds
        assert [t.token_id async for t in ok] == prompt(20)[:8]
        await s.router.drain()


async def test_router_timeout_frees_both_sides():
    class BlackHole:
        async def send(self, manifest, kv):
            await asyncio.sleep(3600)

    async with running_stack(sink=BlackHole(), open_timeout=0.5) as s:
        with pytest.raises(OpenAIError) as e:
            await s.router.open("r-slow", prompt(40), greedy(4))
        assert e.value.status == 504 and e.value.code == "upstream_timeout"
        await s.router.drain()
        await wait_idle(s.pe, s.de)
        assert len(s.dnode.rooms) == 0 and s.router.inflight == {}


async def test_the_same_transfer_twice_is_idempotent_a_different_one_is_refused(stack):
    from gpu_backend.decode_node import DuplicateTransferError

    room = new_room()
    gen = stack.dnode.generate(room, "r", prompt(20, 5000), greedy(3))
    first = asyncio.ensure_future(gen.__anext__())
    await wait_state(stack.dnode, room, RoomState.RESERVED)
    manifest, kv = await _export(stack, 20, room)
    assert await stack.dnode.accept_transfer(manifest, kv) == 20
    assert await stack.dnode.accept_transfer(manifest, kv) == 20  # a retry after a lost connection
    other, kv2 = await _export(stack, 20, room)
    other.first_token_id += 1
    with pytest.raises(DuplicateTransferError):
        await stack.dnode.accept_transfer(other, kv2)
    toks = [await first] + [t async for t in gen]
    assert [t.token_id for t in toks] == prompt(20, 5000)[:3]
    assert stack.dnode.counters["transfers_accepted"] == 1
    await wait_idle(stack.pe, stack.de)


async def test_prefill_is_idempotent_per_room(stack):
    room = new_room()
    gen = stack.dnode.generate(room, "r", prompt(20), greedy(2))
    first = asyncio.ensure_future(gen.__anext__())
    a, b = await asyncio.gather(stack.pnode.prefill(room, "r", prompt(20)), stack.pnode.prefill(room, "r", prompt(20)))
    assert a == b and stack.pnode.counters["prefilled"] == 1 and stack.pe.stats["prefill_tokens"] == 20
    assert [t.token_id for t in [await first] + [t async for t in gen]] == prompt(20)[:2]
    await wait_idle(stack.pe, stack.de)


async def test_decode_stream_survives_a_lost_connection_by_reattaching(stack):
    """The HTTP decode stream: a follower that goes away and comes back with the number of lines it
    had reads the rest; nothing is generated twice."""
    import orjson

    from gpu_backend.decode_node import DecodeStreams

    streams = DecodeStreams(stack.dnode, grace_seconds=5.0)
    room, p = new_room(), prompt(30, 7000)
    follower = streams.open(room, "r", p, greedy(6))
    pre = asyncio.ensure_future(stack.pnode.prefill(room, "r", p))
    got = [orjson.loads(await follower.__anext__()) for _ in range(2)]
    await follower.aclose()  # the connection is lost
    again = streams.open(room, "r", p, greedy(6), start=2)  # the router re-attaches
    got += [orjson.loads(line) async for line in again]
    await pre
    assert [g["token_id"] for g in got] == p[:6] and [g["completion_tokens"] for g in got] == [1, 2, 3, 4, 5, 6]
    assert got[-1]["finished"] and got[-1]["finish_reason"] == "length"
    assert stack.dnode.counters["transfers_accepted"] == 1
    await wait_idle(stack.pe, stack.de)


async def test_a_decode_stream_nobody_reads_is_released_after_the_grace_period(stack):
    import orjson

    from gpu_backend.decode_node import DecodeStreams

    streams = DecodeStreams(stack.dnode, grace_seconds=0.2)
    room = new_room()
    follower = streams.open(room, "r", prompt(30), greedy(400))
    await follower.aclose()  # the router vanished before reading anything (and never released the room)
    await asyncio.sleep(0.5)
    await wait_idle(stack.de)
    late = [orjson.loads(line) async for line in streams.open(room, "r", prompt(30), greedy(400))]
    assert late == [
        {
            "error": {
                "message": f"room {room}: no reader left",
                "type": "invalid_request_error",
                "param": None,
                "code": "aborted",
            },
            "status": 499,
        }
    ]
