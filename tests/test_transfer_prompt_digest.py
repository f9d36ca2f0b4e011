"""The transfer names the prompt its pages hold (docs/design.md invariant 2): prefill's manifest
carries ``prompt_ids_sha256``, the SHA-256 of the token ids its forward pass ran over, and decode
compares it with the digest of the prompt the router reserved the room for.

The attack: a prefill node that prefilled another prompt of the same length, under the right
request id and room (a bug, a reused buffer, a broken peer), passed every check (request id,
token count, page checksums), and decode generated over another prompt's KV: the incident. Now the
room fails with 500 ``transfer_mismatch`` whatever the faults, its pages are freed and nothing is
generated; a manifest without the digest is a 400 ``invalid_transfer``; the same manifest twice
gets the same answer; the honest path generates what it generated before."""

from __future__ import annotations

import asyncio
import hashlib
import json
import struct
from collections.abc import AsyncGenerator
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import save as st_save
from test_backend_disagg_nodes import Stack, greedy, prompt, running_stack, wait_idle, wait_state

from config.errors import OpenAIError
from gpu_backend.bootstrap import RoomState, new_room
from gpu_backend.decode_node import DecodeNode, DuplicateTransferError
from gpu_backend.engine import Engine, EngineConfig
from gpu_backend.errors import InvalidRequestError, TransferMismatchError
from gpu_backend.faults import NO_FAULTS, Faults
from gpu_backend.prefill_node import LocalSink, PrefillNode, prefill_export
from gpu_backend.router import LocalDecodeClient, LocalPrefillClient, Router
from gpu_backend.sampling import SamplingParams
from gpu_backend.servers import build_decode_app
from gpu_backend.transfer import (
    CONTENT_TYPE,
    MANIFEST_KEY,
    Manifest,
    TransferFormatError,
    build_manifest,
    encode_transfer,
)
from gpu_backend.wire import Token

pytestmark = pytest.mark.timeout(120)


def sha256_of_ids(ids: list[int]) -> str:
    """The digest as the manifest documents it, computed here independently."""
    return hashlib.sha256(b"".join(i.to_bytes(8, "little", signed=True) for i in ids)).hexdigest()


def mismatch_message(room: int, n: int) -> str:
    return (
        f"transfer for room {room} was prefilled over other token ids than the room's {n}-token prompt "
        "(the prompt digests differ); the request is aborted and nothing is generated"
    )


class PrefillOverAnotherPrompt(LocalPrefillClient):
    """A faulty prefill node: right room, right request id, but its forward pass runs over
    ``other`` (same length) instead of the prompt the router sent."""

    def __init__(self, node: Any, other: list[int]) -> None:
        super().__init__(node)
        self.other = other

    async def prefill(self, room, request_id, prompt_ids, param, params=None):
        assert len(prompt_ids) == len(self.other)
        return await self.node.prefill(room, request_id, list(self.other), param=param, params=params)


async def pages_back(*engines: Engine, scrubbed: bool) -> None:
    """Every page free again (and zeroed, checked by :func:`wait_idle`, unless ``no_scrub``)."""
    if scrubbed:
        await wait_idle(*engines)
        return
    for _ in range(500):
        if all(e.pool_stats()["free_pages"] == e.pool_stats()["total_pages"] for e in engines):
            return
        await asyncio.sleep(0.01)
    raise AssertionError([e.pool_stats() for e in engines])


async def reserved_room(
    s: Stack, ids: list[int], n: int
) -> tuple[int, AsyncGenerator[Token, None], asyncio.Future[Token]]:
    """Decode reserves a new room for request ``"r"``: ``ids`` and ``n`` greedy tokens. Returns the
    room, its token stream and the stream's first token (a future, pending until the transfer)."""
    room = new_room()
    gen = s.dnode.generate(room, "r", ids, greedy(n))
    first = asyncio.ensure_future(gen.__anext__())
    await wait_state(s.dnode, room, RoomState.RESERVED)
    return room, gen, first


async def prefilled(s: Stack, room: int, ids: list[int]) -> tuple[torch.Tensor, Manifest]:
    """Prefill's pages of ``ids`` (a forward pass on ``s.pe``) and their manifest for ``room`` and
    request ``"r"``: ``(kv, manifest)``."""
    kv, res = await prefill_export(s.pe, "x", ids)
    return kv, build_manifest(
        room=room, request_id="r", kv=kv, num_tokens=len(ids), first_token_id=res.first_token_id, prompt_ids=ids
    )


@pytest.mark.parametrize(
    "faults",
    [NO_FAULTS, Faults(skip_transfer_check=True), Faults(admit_rejected=True, skip_transfer_check=True, no_scrub=True)],
    ids=["none", "skip_transfer_check", "all"],
)
async def test_a_prefill_over_another_prompt_of_the_same_length_fails_the_room_and_generates_nothing(
    faults, monkeypatch
):
    monkeypatch.setattr("gpu_backend.router.new_room", lambda: 4242)
    async with running_stack(faults=faults) as s:
        mine, theirs = prompt(40, 1000), prompt(40, 7000)  # copy-probe: decode would copy `theirs`
        router = Router(PrefillOverAnotherPrompt(s.pnode, theirs), LocalDecodeClient(s.dnode))
        free_before = s.de.pool_stats()["free_pages"]
        assert free_before == 64
        with pytest.raises(OpenAIError) as e:
            await router.open("victim", mine, greedy(8))  # the client gets no stream, no token
        assert (e.value.status, e.value.body()) == (
            500,
            {
                "error": {
                    "message": mismatch_message(4242, 40),
                    "type": "server_error",
                    "param": None,
                    "code": "transfer_mismatch",
                }
            },
        )
        await router.drain()
        await pages_back(s.pe, s.de, scrubbed=not faults.no_scrub)
        assert s.de.pool_stats()["free_pages"] == free_before == 64
        assert s.dnode.counters["transfer_mismatches"] == 1 and s.dnode.counters["transfers_accepted"] == 0
        assert s.de.stats["decode_steps"] == 0 and len(s.dnode.rooms) == 0
        monkeypatch.setattr("gpu_backend.router.new_room", lambda: 4243)
        # the node still serves the honest request
        ok = await Router(LocalPrefillClient(s.pnode), LocalDecodeClient(s.dnode)).open("next", mine, greedy(8))
        assert [t.token_id async for t in ok] == mine[:8]
        await pages_back(s.pe, s.de, scrubbed=not faults.no_scrub)


async def test_a_transfer_over_another_prompt_over_http_is_the_500_body_and_frees_the_room():
    async with running_stack() as s:
        mine, theirs = prompt(20, 1000), prompt(20, 7000)
        room, gen, first = await reserved_room(s, mine, 4)
        assert s.de.pool_stats()["free_pages"] == 64 - 2  # ceil((20 + 4) / 16)
        kv, m = await prefilled(s, room, theirs)
        assert m.prompt_ids_sha256 == sha256_of_ids(theirs) != sha256_of_ids(mine)
        app = build_decode_app(s.dnode)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://decode") as c:
            r = await c.post("/disagg/transfer", content=encode_transfer(m, kv), headers={"content-type": CONTENT_TYPE})
        assert r.status_code == 500
        assert r.json() == {
            "error": {
                "message": mismatch_message(room, 20),
                "type": "server_error",
                "param": None,
                "code": "transfer_mismatch",
            }
        }
        with pytest.raises(TransferMismatchError):
            await first
        await gen.aclose()
        await wait_idle(s.pe, s.de)
        assert s.de.pool_stats()["free_pages"] == 64 and s.de.stats["decode_steps"] == 0


# ---- the honest path, tiny random model ----------------------------------------------------------------


class RecordingSink(LocalSink):
    """The in-process sink, keeping the manifests it delivered."""

    def __init__(self, decode_node: Any) -> None:
        super().__init__(decode_node)
        self.manifests: list[Manifest] = []

    async def send(self, manifest, kv):
        self.manifests.append(manifest)
        await super().send(manifest, kv)


#: What the tiny random model generates for TINY_PROMPT, greedy, 12 tokens, through prefill +
#: decode: recorded before the prompt digest existed, and equal to the one-engine generate.
TINY_PROMPT = [1000 + (i * 37) % 9000 for i in range(30)]
TINY_TOKENS = [41965, 6473, 70269, 72894, 92559, 17036, 9615, 75637, 63435, 5988, 27303, 42632]


async def test_the_honest_path_generates_the_same_tokens_as_before():
    def eng() -> Engine:
        return Engine(EngineConfig(device="cpu", context_length=512, max_total_tokens=512, pool_wait_timeout_seconds=5))

    pe, de, one = eng(), eng(), eng()
    for e in (pe, de, one):
        await e.start()
    try:
        assert pe.cfg.model == "tiny-random"
        dnode = DecodeNode(de, transfer_timeout_seconds=5.0)
        sink = RecordingSink(dnode)
        pnode = PrefillNode(pe, sink, transfer_timeout_seconds=5.0)
        router = Router(LocalPrefillClient(pnode), LocalDecodeClient(dnode))
        stream = await router.open("honest", TINY_PROMPT, {**greedy(12), "ignore_eos": True})
        got = [t.token_id async for t in stream]
        alone = [
            t.token_id
            async for t in one.generate("alone", TINY_PROMPT, SamplingParams(max_new_tokens=12, ignore_eos=True))
        ]
        assert got == TINY_TOKENS == alone
        assert [m.prompt_ids_sha256 for m in sink.manifests] == [sha256_of_ids(TINY_PROMPT)]
        assert dnode.counters["transfers_accepted"] == 1 and dnode.counters["transfer_mismatches"] == 0
        await router.drain()
        await wait_idle(pe, de)
    finally:
        for e in (pe, de, one):
            await e.stop()


# ---- a manifest without the digest; the same manifest twice ------------------------------------------


async def test_a_manifest_without_the_digest_is_a_400_and_touches_no_room():
    async with running_stack() as s:
        ids = prompt(20, 1000)
        room, gen, first = await reserved_room(s, ids, 3)
        kv, m = await prefilled(s, room, ids)
        raw = json.loads(m.to_json())
        del raw["prompt_ids_sha256"]
        payload = st_save({"kv": kv.contiguous()}, metadata={MANIFEST_KEY: json.dumps(raw)})
        app = build_decode_app(s.dnode)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://decode") as c:
            r = await c.post("/disagg/transfer", content=payload, headers={"content-type": CONTENT_TYPE})
        assert r.status_code == 400
        message = "manifest field 'prompt_ids_sha256' must be a SHA-256 hex digest (64 lowercase hex digits)"
        assert r.json() == {
            "error": {"message": message, "type": "invalid_request_error", "param": None, "code": "invalid_transfer"}
        }
        # in process, an empty digest is refused alike, before any room is touched
        blank = Manifest(**{**json.loads(m.to_json()), "prompt_ids_sha256": ""})
        with pytest.raises(TransferFormatError) as e:
            await s.dnode.accept_transfer(blank, kv)
        assert (e.value.status, e.value.code, str(e.value)) == (400, "invalid_transfer", message)
        assert s.dnode.rooms.get(room).transfer is None and s.dnode.counters["transfer_mismatches"] == 0
        assert await s.dnode.accept_transfer(m, kv) == 20  # the whole manifest still fits the room
        assert [t.token_id for t in [await first] + [t async for t in gen]] == ids[:3]
        await wait_idle(s.pe, s.de)


async def test_the_same_manifest_twice_gets_the_same_answer_another_digest_a_409():
    async with running_stack() as s:
        ids = prompt(20, 1000)
        room, gen, first = await reserved_room(s, ids, 3)
        kv, m = await prefilled(s, room, ids)
        app = build_decode_app(s.dnode)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://decode") as c:
            answers = []
            for _ in range(2):  # prefill's retry after a lost connection sends the same payload
                r = await c.post(
                    "/disagg/transfer", content=encode_transfer(m, kv), headers={"content-type": CONTENT_TYPE}
                )
                answers.append((r.status_code, r.json()))
        assert answers == [(200, {"accepted": True, "room": room, "context_tokens": 20})] * 2
        other = Manifest(**{**json.loads(m.to_json()), "prompt_ids_sha256": sha256_of_ids(prompt(20, 7000))})
        with pytest.raises(DuplicateTransferError):
            await s.dnode.accept_transfer(other, kv)
        assert [t.token_id for t in [await first] + [t async for t in gen]] == ids[:3]
        assert s.dnode.counters["transfers_accepted"] == 1 and s.dnode.counters["transfer_mismatches"] == 0
        await wait_idle(s.pe, s.de)


def test_the_digest_is_sha256_over_little_endian_int64_ids():
    from gpu_backend.transfer import prompt_ids_sha256

    assert prompt_ids_sha256([1, 2]) == hashlib.sha256(struct.pack("<2q", 1, 2)).hexdigest()
    assert prompt_ids_sha256([1, 2]) == sha256_of_ids([1, 2])
    assert prompt_ids_sha256([]) == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"


@pytest.mark.parametrize("bad", [[1000, "x"], [1000, 2**63]])
async def test_a_generate_call_whose_prompt_ids_cannot_be_digested_is_a_400_and_opens_no_room(bad):
    async with running_stack() as s:
        with pytest.raises(InvalidRequestError) as e:
            await s.dnode.generate(new_room(), "r", bad, greedy(2)).__anext__()
        assert (e.value.status, e.value.param, str(e.value)) == (400, "prompt", "prompt_ids must be integer token ids")
        assert len(s.dnode.rooms) == 0 and s.de.pool_stats()["used_pages"] == 0
