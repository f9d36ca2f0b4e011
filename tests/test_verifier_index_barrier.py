"""The index barrier (verifier.barrier, VerifierService.start_admit): admission starts a prompt's
ingest without awaiting it, and a response check that begins later first awaits every ingest in
flight when it began, so it never misses a prompt forwarded before it; an ingest's slowness or
failure never holds or fails a response that is not strict; nothing is lost at shutdown."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
import redis

from config.models import TenantConfig
from tests.fixtures.settings import verifier_settings
from tests.test_verifier_inline_ingest import prose
from verifier.barrier import BarrierGuard
from verifier.build import build_verifier
from verifier.guards import BackgroundGuard
from verifier.stage import Exchange, ExchangeRequest, ResponseWithheld

SECRETS = {"leak_index_key": b"barrier-test-key", "cache_salt_key": b"x", "admin_key": b"y"}
VICTIM = TenantConfig(id="victim")
SAMPLED = TenantConfig(id="sampled", verify_sample_rate=1.0)
STRICT = TenantConfig(id="strict", strict_verify=True)
BODY = {"usage": None, "finish_reason": "stop", "ttft_seconds": None}


def ex(t: TenantConfig, prompt: str, ids: list[list[int]] | None = None) -> Exchange:
    request = ExchangeRequest(f"req-{uuid.uuid4().hex[:8]}", t, "up", "m", 10, False, time.monotonic())
    return Exchange(request, prompt, prompt_ids=ids or ())


class Gate:
    """A decoder that answers ``text`` only once :meth:`open` was called (an ingest in flight)."""

    def __init__(self, text: str, fail: bool = False) -> None:
        self.text, self.fail, self.event = text, fail, asyncio.Event()

    def open(self) -> None:
        self.event.set()

    async def decode(self, ids: list[int]) -> str:
        await self.event.wait()
        if self.fail:
            raise RuntimeError("engine /detokenize down")
        return self.text


def admitted(svc, t: TenantConfig, prompt: str) -> Exchange:
    """An exchange of ``t`` that passed admission (its own ingest started)."""
    e = ex(t, prompt)
    assert svc.start_admit(e) is not None
    return e


async def settle(n: int = 5) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


@pytest.fixture
def prefix():
    p = f"test-barrier-{uuid.uuid4().hex[:8]}:"
    yield p
    c = redis.Redis(host="127.0.0.1", port=6379)
    keys = list(c.scan_iter(match=p + "*"))
    if keys:
        c.delete(*keys)
    c.close()


@pytest.mark.parametrize("store", ["memory", "redis"])
async def test_a_prompt_still_being_indexed_is_found_by_a_later_strict_check(tmp_path, prefix, store):
    url = "" if store == "memory" else "redis://127.0.0.1:6379/0"
    svc = build_verifier(verifier_settings(tmp_path, url), secrets=SECRETS, key_prefix=prefix)
    try:
        text = prose(3000, seed=11)
        gate = Gate(text)
        victim = ex(VICTIM, "", [[1, 2, 3]])
        ingest = svc.start_admit(victim, gate.decode)
        assert ingest is not None and victim.state.admitted and svc.ingests_in_flight == 1
        guard = svc.begin(admitted(svc, STRICT, "hello there"))
        assert isinstance(guard, BarrierGuard)
        check = asyncio.create_task(guard.check_body("Sure: " + text[1000:1600], **BODY))
        await settle()
        assert not check.done()  # waits for the victim's ingest
        gate.open()
        with pytest.raises(ResponseWithheld) as ei:
            await check
        assert ei.value.detector == "leak_index"
        assert ingest.done() and svc.stats["ingested"] == 2 and svc.ingest_pending_bytes == 0
        # a check that begins once no ingest is in flight gets the plain guard
        later = admitted(svc, STRICT, "hi")
        await settle()
        assert not isinstance(svc.begin(later), BarrierGuard)
    finally:
        await svc.aclose()


async def test_a_strict_stream_waits_for_the_barrier_before_it_releases_anything(tmp_path):
    svc = build_verifier(verifier_settings(tmp_path, ""), secrets=SECRETS)
    try:
        text = prose(3000, seed=12)
        gate = Gate(text)
        svc.start_admit(ex(VICTIM, "", [[7]]), gate.decode)
        guard = svc.begin(admitted(svc, STRICT, "hello there"))
        fed = asyncio.create_task(guard.feed(text[1000:1600], b"data: x\n\n"))
        await settle()
        assert not fed.done()
        gate.open()
        with pytest.raises(ResponseWithheld):
            await fed
            await guard.finish_stream(**BODY)
    finally:
        await svc.aclose()


async def test_a_sampled_check_is_queued_after_the_barrier_without_holding_the_response(tmp_path):
    svc = build_verifier(verifier_settings(tmp_path, ""), secrets=SECRETS)
    try:
        text = prose(3000, seed=13)
        gate = Gate(text)
        svc.start_admit(ex(VICTIM, "", [[7]]), gate.decode)
        guard = svc.begin(admitted(svc, SAMPLED, "hello there"))
        assert isinstance(guard, BarrierGuard) and isinstance(guard.guard, BackgroundGuard)
        # nothing waits: the events pass, the check is deferred
        assert await asyncio.wait_for(guard.feed(text[1000:1600], b"data: x\n\n"), 0.5) == [b"data: x\n\n"]
        assert await asyncio.wait_for(guard.finish_stream(**BODY), 0.5) == []
        assert svc.queued_jobs == 0  # not queued before the victim's prompt is indexed
        gate.open()
        await svc.drain(timeout=5)
        assert [i.detector for i in svc.incidents.recent] == ["leak_index"]
    finally:
        await svc.aclose()


@pytest.mark.parametrize("fault", ["decode", "index"])
async def test_a_failing_ingest_neither_fails_nor_holds_the_response(tmp_path, fault):
    svc = build_verifier(verifier_settings(tmp_path, ""), secrets=SECRETS)
    try:
        if fault == "index":

            def broken(*a, **kw):
                raise RuntimeError("tokenizer panic")

            svc.ingest.fingerprint = broken  # type: ignore[method-assign]
        gate = Gate("some text", fail=fault == "decode")
        own = ex(SAMPLED, "", [[5]])
        ingest = svc.start_admit(own, gate.decode)
        guard = svc.begin(own)
        assert await asyncio.wait_for(guard.check_body("a plain answer", **BODY), 0.5) is None
        gate.open()
        assert ingest is not None and await asyncio.wait_for(ingest, 2) is None  # never raises
        await svc.drain(timeout=5)
        if fault == "decode":
            assert svc.stats["decode_failed"] == 1 and not own.state.own_text_complete
        else:
            assert svc.stats["job_faults"] == 1
        assert svc.ingest_pending_bytes == 0 and svc.ingests_in_flight == 0
        strict = svc.begin(admitted(svc, STRICT, "hi"))
        await strict.check_body("a plain answer", **BODY)  # no barrier left, nothing found
    finally:
        await svc.aclose()


async def test_shutdown_waits_for_the_ingests_in_flight(tmp_path):
    svc = build_verifier(verifier_settings(tmp_path, ""), secrets=SECRETS)
    text = prose(3000, seed=14)
    gate = Gate(text)
    svc.start_admit(ex(VICTIM, "", [[9]]), gate.decode)
    closing = asyncio.create_task(svc.aclose())
    await asyncio.sleep(0.05)
    assert not closing.done() and svc.ingests_in_flight == 1
    gate.open()
    await asyncio.wait_for(closing, 5)
    assert svc.stats["ingested"] == 1 and svc.ingests_in_flight == 0 and svc.ingest_pending_bytes == 0
    fps, _ = svc.ingest.fingerprint(ex(VICTIM, text), text)
    assert svc.index.store.owners(sorted(fps)) == [{"victim"}] * len(fps)


async def test_a_cancelled_request_leaves_its_ingest_running(tmp_path):
    svc = build_verifier(verifier_settings(tmp_path, ""), secrets=SECRETS)
    try:
        text = prose(3000, seed=15)
        gate = Gate(text)
        ingest = svc.start_admit(ex(VICTIM, "", [[9]]), gate.decode)
        assert ingest is not None

        async def request() -> None:
            await asyncio.wait([ingest])  # as gateway.relay.finish does

        waiter = asyncio.create_task(request())
        await settle()
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
        assert not ingest.done()
        gate.open()
        await svc.drain(timeout=5)
        assert svc.stats["ingested"] == 1
    finally:
        await svc.aclose()
