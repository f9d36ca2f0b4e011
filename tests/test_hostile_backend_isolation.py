"""Hostile clients and faulty peers against the bundled engine's isolation invariants and API
(copy-probe engines in one process, as tests/test_backend_disagg_nodes.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

import httpx
import orjson
import pytest
import torch
from backend_core_support import collect
from test_backend_disagg_nodes import Stack, greedy, prompt, running_stack, wait_idle, wait_state

from config.errors import OpenAIError
from gpu_backend.bootstrap import RoomState, new_room
from gpu_backend.errors import EngineError
from gpu_backend.node_errors import backend_error
from gpu_backend.prefill_node import prefill_export
from gpu_backend.router import HttpDecodeClient, HttpPrefillClient, LocalDecodeClient, Router
from gpu_backend.sampling import SamplingParams
from gpu_backend.servers import build_decode_app, build_prefill_app
from gpu_backend.transfer import Manifest, TransferFormatError, build_manifest
from gpu_backend.wire import Token

pytestmark = pytest.mark.timeout(60)


async def reserve(
    s: Stack, request_id: str, ids: list[int], params: dict[str, Any]
) -> tuple[int, AsyncGenerator[Token, None], asyncio.Future[Token]]:
    """A new room on decode, reserved for ``request_id`` (``ids``, ``params``): the room, its token
    stream, and the stream's first token as a future (pending until the room's transfer)."""
    room = new_room()
    stream = s.dnode.generate(room, request_id, ids, params)
    first = asyncio.ensure_future(stream.__anext__())
    await wait_state(s.dnode, room, RoomState.RESERVED)
    return room, stream, first


def manifest(room: int, request_id: str, kv: torch.Tensor, first_token_id: int, ids: list[int]) -> Manifest:
    """The manifest prefill sends with pages ``kv`` of prompt ``ids`` (one token id per position)."""
    return build_manifest(
        room=room, request_id=request_id, kv=kv, num_tokens=len(ids), first_token_id=first_token_id, prompt_ids=ids
    )


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1])
async def test_a_seed_the_sampler_cannot_take_is_a_400_not_a_500(seed):
    """A sampled request (temperature > 0) whose seed is outside what a torch generator takes
    (``[-2**63, 2**64 - 1]``) used to pass validation, then raise ``ValueError`` on decode's
    StartDecode: the router's caller got 500 ``internal_error`` after a whole prefill and transfer.
    (Over HTTP, orjson reads a larger integer as a float, which is already a 400.)"""
    async with running_stack() as s:
        params = {**greedy(4), "temperature": 1.0, "seed": seed}
        with pytest.raises(OpenAIError) as e:
            await s.router.open("r-seed", prompt(20), params)
        assert e.value.body() == {
            "error": {
                "message": "seed must be an integer in [-9223372036854775808, 18446744073709551615].",
                "type": "invalid_request_error",
                "param": "seed",
                "code": "invalid_request",
            }
        }
        assert e.value.status == 400
        await s.router.drain()
        await wait_idle(s.pe, s.de)
        ok = await s.router.open("r-ok", prompt(20), {**greedy(4), "temperature": 1.0, "seed": 2**64 - 1})
        toks = [t async for t in ok]
        assert len(toks) == 4 and toks[-1].finish_reason == "length"
        await s.router.drain()
        await wait_idle(s.pe, s.de)


async def test_a_transfer_whose_pages_do_not_fit_this_pool_is_a_400_and_touches_no_room():
    """A faulty prefill peer (another model, or another ``--page-size``) sends well-formed pages of
    a geometry the decode pool does not have. They used to reach the engine, whose page write
    raised ``ValueError``: the room failed and the transfer (and the client) got 500
    ``internal_error`` naming only ``ValueError``. Like a bad ``first_token_id``, it is a 400
    ``invalid_transfer`` now, refused before any room is touched."""
    async with running_stack() as s:
        room, gen, first = await reserve(s, "r", prompt(40), greedy(4))
        kv, res = await prefill_export(s.pe, "x", prompt(40))
        assert list(kv.shape) == [3, 1, 2, 16, 1, 64]  # copy-probe: one layer, one KV head of 64
        two_layers = torch.cat([kv, kv], dim=1)
        bad = manifest(room, "r", two_layers, res.first_token_id, prompt(40))
        with pytest.raises(EngineError) as e:
            await s.dnode.accept_transfer(bad, two_layers)
        assert backend_error(e.value).body() == {
            "error": {
                "message": f"transfer for room {room} has pages of shape [2, 2, 16, 1, 64]; "
                "this node's pages are [1, 2, 16, 1, 64]",
                "type": "invalid_request_error",
                "param": None,
                "code": "invalid_transfer",
            }
        }
        assert e.value.status == 400 and s.dnode.counters["transfers_refused"] == 1
        assert s.dnode.rooms.get(room).transfer is None and s.de.pool_stats()["used_pages"] == 3
        good = manifest(room, "r", kv, res.first_token_id, prompt(40))
        assert await s.dnode.accept_transfer(good, kv) == 40  # the right pages still fit the room
        toks = [await first] + [t async for t in gen]
        assert [t.token_id for t in toks] == prompt(4) and toks[-1].finish_reason == "length"
        await wait_idle(s.pe, s.de)


async def test_non_finite_pages_from_a_faulty_prefill_are_refused_and_fail_no_other_tenant():
    """A faulty prefill peer (an overflow in half precision, a bad card) sends pages holding a NaN.
    They used to be accepted: the room's first sampled decode step raised in ``torch.multinomial``
    and the engine failed the whole decode batch, so another tenant's request decoding beside it
    died mid-stream with a 500. The transfer is a 400 ``invalid_transfer`` now, before any room
    is touched, and the other tenant runs to the end."""
    async with running_stack() as s:
        p = prompt(40)
        victim = await s.router.open("victim", p, {**greedy(460), "ignore_eos": True})
        got = [await victim.__anext__()]
        params = {**greedy(50), "temperature": 1.0, "seed": 1, "ignore_eos": True}
        room, gen, first = await reserve(s, "faulty", prompt(20, 3000), params)
        kv, res = await prefill_export(s.pe, "x", prompt(20, 3000))
        kv = kv.clone()
        kv[1, 0, 1, 3, 0, 7] = float("nan")  # one value of page 1 (V, position 19)
        m = manifest(room, "faulty", kv, res.first_token_id, prompt(20, 3000))
        with pytest.raises(TransferFormatError) as e:
            await s.dnode.accept_transfer(m, kv)
        assert (e.value.status, e.value.code) == (400, "invalid_transfer")
        assert str(e.value) == "page 1 holds a value that is not finite (NaN or infinity)"
        assert s.dnode.rooms.get(room).transfer is None
        got += [t async for t in victim]
        assert [t.token_id for t in got] == [p[j % 40] for j in range(460)]
        assert got[-1].finish_reason == "length"
        s.dnode.release(room)
        with pytest.raises(EngineError) as gone:
            await first
        assert gone.value.status == 499
        await s.router.drain()
        await wait_idle(s.pe, s.de)


async def test_a_negative_room_from_a_faulty_router_is_a_400_before_any_work():
    """Rooms are non-negative (the router draws 63-bit rooms; a manifest with a negative room is
    malformed). A negative room used to be taken: prefill ran the whole forward pass and then
    answered 500 ``internal_error`` (``TransferFormatError`` building the manifest), and decode
    reserved pages for a room no transfer can ever fill and held them until the transfer timeout."""
    async with running_stack() as s:
        papp, dapp = build_prefill_app(s.pnode), build_decode_app(s.dnode)
        t = dict(base_url="http://node")
        async with (
            httpx.AsyncClient(transport=httpx.ASGITransport(app=papp, raise_app_exceptions=False), **t) as pc,
            httpx.AsyncClient(transport=httpx.ASGITransport(app=dapp, raise_app_exceptions=False), **t) as dc,
        ):
            r = await pc.post("/disagg/prefill", json={"room": -1, "request_id": "r", "prompt_ids": prompt(20)})
            assert (r.status_code, r.json()["error"]["code"]) == (400, "invalid_request")
            assert r.json()["error"]["message"] == (
                "body needs integer 'room' >= 0, string 'request_id', integer list 'prompt_ids'."
            )
            assert s.pe.stats["prefill_tokens"] == 0  # no forward pass for it
            body = {"room": -1, "request_id": "r", "prompt_ids": prompt(20), "params": greedy(4)}
            r = await dc.post("/disagg/generate", json=body)
            assert (r.status_code, r.json()["error"]["code"]) == (400, "invalid_request")
            assert r.json()["error"]["message"] == (
                "body needs 'room' (an integer >= 0), 'request_id', 'prompt_ids', 'params' (and optional 'from')."
            )
            assert len(s.dnode.rooms) == 0 and s.de.pool_stats()["used_pages"] == 0
        await wait_idle(s.pe, s.de)


async def test_a_seeded_request_draws_through_prefill_and_decode_what_one_engine_draws():
    """Prefill draws the first token and decode the rest, each node starting from the request's
    seed. With a generator per node seeded alike, decode's first draw reused prefill's noise
    (tokens 1 and 2 correlated) and no token after the first matched the engine core's. Each
    draw is now keyed by the seed and the token's position (as SGLang's seeded sampling): the
    stack's tokens are one engine's, seed for seed, and differ between seeds."""
    p = prompt(30, 2000)
    params = {**greedy(8), "temperature": 1.0}
    async with running_stack() as s:
        runs = []
        for seed in range(4):
            alone, _, _ = await collect(s.pe, f"alone-{seed}", p, **{**params, "seed": seed})
            st = await s.router.open(f"r{seed}", p, {**params, "seed": seed})
            runs.append((alone, [t.token_id async for t in st]))
        await s.router.drain()
        await wait_idle(s.pe, s.de)
    assert all(len(alone) == 8 and alone == stacked for alone, stacked in runs)
    assert len({tuple(alone) for alone, _ in runs}) == 4


@pytest.mark.parametrize("over_http", [False, True])
async def test_the_first_token_is_sampled_with_the_request_s_own_parameters(over_http):
    """The router sent prefill only the prompt, so prefill picked every request's first token
    greedily: a client asking for ``temperature`` 1 with any ``seed`` got the argmax first (with
    copy-probe, always the prompt's first token), unlike the engine core and unlike every later
    token. Prefill samples it with the request's own parameters now, in process and over
    ``/disagg/prefill``."""
    p = prompt(30, 2000)
    async with running_stack() as s:
        expected = []
        for seed in range(6):
            sp = SamplingParams(max_new_tokens=1, temperature=1.0, seed=seed)
            _, outcome = await prefill_export(s.pe, f"alone-{seed}", p, sp)
            expected.append(outcome.first_token_id)
        assert len(set(expected)) > 1 and expected != [p[0]] * 6
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=build_prefill_app(s.pnode)), base_url="http://prefill"
        ) as c:
            if over_http:
                s.router = Router(HttpPrefillClient("http://prefill", c, 30.0), LocalDecodeClient(s.dnode))
            firsts = []
            for seed in range(6):
                st = await s.router.open(f"r{seed}", p, {**greedy(2), "temperature": 1.0, "seed": seed})
                firsts.append([t.token_id async for t in st][0])
            await s.router.drain()
        assert firsts == expected
        await wait_idle(s.pe, s.de)


async def test_a_peer_answering_outside_its_protocol_is_a_502_naming_the_misfit():
    """A faulty or foreign node: prefill answering 200 with a body that is not a prefill outcome,
    decode streaming a line that is not a token (mistyped, not JSON, an error line whose status
    is not a number). Each raised ``TypeError`` or ``ValueError`` in the router: a 500. Each is
    now 502 ``upstream_unavailable`` saying what was wrong."""

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/disagg/prefill":
            return httpx.Response(200, json={"num_tokens": 3, "first_token_id": 7, "kv": []})
        return httpx.Response(200, content=lines.pop(0))

    async with httpx.AsyncClient(transport=httpx.MockTransport(answer), base_url="http://node") as c:
        with pytest.raises(OpenAIError) as e:
            await HttpPrefillClient("http://node", c, 5.0).prefill(1, "r", [1, 2, 3], "prompt")
        assert (e.value.status, e.value.code, e.value.message) == (
            502,
            "upstream_unavailable",
            "The prefill node answered outside its protocol: a PrefillOutcome has exactly the fields "
            "num_tokens, first_token_id, prefill_seconds, placeholder, original_prompt_tokens.",
        )
        token = {"token_id": "9", "text": "", "finished": False, "finish_reason": None}
        lines = [
            orjson.dumps({**token, "prompt_tokens": 3, "completion_tokens": 1}) + b"\n",
            b"not json\n",
            b'{"error": {"message": "pool full", "code": "pool_exhausted"}, "status": "503"}\n',
        ]
        found = []
        for _ in range(3):
            with pytest.raises(OpenAIError) as e:
                async for _tok in HttpDecodeClient("http://node", c, 5.0).generate(1, "r", [1, 2, 3], {}):
                    pass
            found.append((e.value.status, e.value.message))
    assert found == [
        (502, "The decode node answered outside its protocol: Token.token_id must be int, not str."),
        (
            502,
            "The decode node answered outside its protocol: a Token has exactly the fields token_id, text, "
            "finished, finish_reason, prompt_tokens, completion_tokens.",
        ),
        (500, "pool full"),
    ]
