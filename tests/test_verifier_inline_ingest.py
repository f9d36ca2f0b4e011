"""Admission-time indexing of small prompts on the event loop (verifier.jobs.IngestBudget.prepare_small,
and index_small_now for in-memory stores):
with Redis stores, a prompt of at most INLINE_INGEST_BYTES is fingerprinted in place and written
with one awaited Lua call, never through the admission thread; a larger one still takes the
thread. What it stores, what a later check finds, and what Redis down or hanging does to it."""

from __future__ import annotations

import asyncio
import random
import time
import uuid

import pytest
import redis

from config.models import TenantConfig
from tests.fixtures.settings import verifier_settings
from verifier.build import build_verifier
from verifier.canary import new_canary
from verifier.jobs import INLINE_INGEST_BYTES
from verifier.service import VerifierService
from verifier.shingles import encode
from verifier.stage import Exchange, ExchangeRequest, ResponseWithheld

SECRETS = {"leak_index_key": b"inline-test-key", "cache_salt_key": b"x", "admin_key": b"y"}
A = TenantConfig(id="a", verify_sample_rate=1.0)
STRICT = TenantConfig(id="s", strict_verify=True)


def ex(t: TenantConfig, prompt: str) -> Exchange:
    request = ExchangeRequest(f"req-{uuid.uuid4().hex[:8]}", t, "up", "m", len(encode(prompt)), False, time.monotonic())
    return Exchange(request, prompt)


def prose(nbytes: int, seed: int) -> str:
    """ASCII text of exactly ``nbytes`` bytes, words drawn at random (no runs to squeeze)."""
    rng = random.Random(seed)
    vocab = [
        "harbour",
        "ledger",
        "quietly",
        "orbit",
        "sailor",
        "copper",
        "meadow",
        "signal",
        "lantern",
        "window",
        "thunder",
        "marble",
    ]
    out = ""
    while len(out) < nbytes:
        out += rng.choice(vocab) + f"{rng.randrange(1000)} "
    return out[:nbytes]


@pytest.fixture
def prefix():
    p = f"test-inline-{uuid.uuid4().hex[:8]}:"
    yield p
    c = redis.Redis(host="127.0.0.1", port=6379)
    keys = list(c.scan_iter(match=p + "*"))
    if keys:
        c.delete(*keys)
    c.close()


def no_thread(svc: VerifierService) -> list[int]:
    """Replace the admission thread's step with a recorder; returns the list of prompt sizes it saw."""
    seen: list[int] = []
    real = svc.ingest.index_prompt

    def spy(exchange, text, nbytes):
        seen.append(nbytes)
        real(exchange, text, nbytes)

    svc.ingest.index_prompt = spy
    return seen


async def test_small_prompt_is_indexed_on_the_loop_and_found_by_a_strict_check(tmp_path, prefix):
    svc = build_verifier(verifier_settings(tmp_path, "redis://127.0.0.1:6379/0"), secrets=SECRETS, key_prefix=prefix)
    threaded = no_thread(svc)
    try:
        text = prose(INLINE_INGEST_BYTES, seed=1)
        e = ex(A, text)
        await svc.admit(e)
        assert threaded == [] and svc.stats["ingested"] == 1 and svc.ingest_pending_bytes == 0
        fps, _ = svc.ingest.fingerprint(ex(A, text), text)
        assert len(fps) >= 10
        assert svc.index.store.owners(sorted(fps)) == [{"a"}] * len(fps)  # in Redis, owned by a
        assert e.state.own_shingles  # sampled at 100%: its own shingles kept for its own check
        # a strict tenant's response quoting 600 bytes of a's prompt is withheld
        g = svc.begin(ex(STRICT, "hello there"))
        with pytest.raises(ResponseWithheld) as ei:
            await g.check_body("Sure: " + text[1000:1600], usage=None, finish_reason="stop", ttft_seconds=None)
        assert ei.value.detector == "leak_index"
    finally:
        await svc.aclose()


async def test_the_size_boundary_picks_loop_or_thread(tmp_path, prefix):
    svc = build_verifier(verifier_settings(tmp_path, "redis://127.0.0.1:6379/0"), secrets=SECRETS, key_prefix=prefix)
    threaded = no_thread(svc)
    try:
        await svc.admit(ex(A, prose(INLINE_INGEST_BYTES, seed=2)))
        await svc.admit(ex(A, prose(INLINE_INGEST_BYTES + 1, seed=3)))
        assert threaded == [INLINE_INGEST_BYTES + 1]
        assert svc.stats["ingested"] == 2 and svc.ingest_pending_bytes == 0
    finally:
        await svc.aclose()


async def test_a_canary_in_a_small_prompt_is_registered(tmp_path, prefix):
    svc = build_verifier(verifier_settings(tmp_path, "redis://127.0.0.1:6379/0"), secrets=SECRETS, key_prefix=prefix)
    threaded = no_thread(svc)
    try:
        can = new_canary()
        await svc.admit(ex(A, f"remember this: {can} and nothing else"))
        assert threaded == []
        (match,) = svc.canaries.lookup([can])
        assert match.owners == {"a"}
    finally:
        await svc.aclose()


def closed_port() -> int:
    from tests.gateway_harness import refused_port

    return refused_port()


async def test_redis_down_counts_an_error_backs_off_and_lets_the_request_on(tmp_path, prefix):
    svc = build_verifier(
        verifier_settings(tmp_path, f"redis://127.0.0.1:{closed_port()}/0"), secrets=SECRETS, key_prefix=prefix
    )
    threaded = no_thread(svc)
    try:
        await svc.admit(ex(A, prose(500, seed=4)))
        assert (svc.stats["store_errors"], svc.stats["errors"], svc.stats["ingested"]) == (1, 1, 1)
        await svc.admit(ex(A, prose(500, seed=5)))  # inside the back-off: skipped, not retried
        assert (svc.stats["store_errors"], svc.stats["store_skipped"], svc.stats["ingested"]) == (1, 1, 2)
        assert threaded == [] and svc.ingest_pending_bytes == 0
    finally:
        await svc.aclose()


async def test_a_hanging_redis_holds_admission_no_longer_than_its_socket_timeout(tmp_path, prefix):
    """A Redis that accepts and never answers: the awaited write gives up after the client's
    0.25 s socket timeout; the request goes on, the error is counted."""
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    svc = build_verifier(verifier_settings(tmp_path, f"redis://127.0.0.1:{port}/0"), secrets=SECRETS, key_prefix=prefix)
    try:
        t0 = time.monotonic()
        await asyncio.wait_for(svc.admit(ex(A, prose(500, seed=6))), 5)
        assert time.monotonic() - t0 < 1.5
        assert (svc.stats["store_errors"], svc.stats["ingested"]) == (1, 1)
        assert svc.ingest_pending_bytes == 0
    finally:
        await svc.aclose()
        server.close()


async def test_cancelled_inline_admission_releases_its_bytes(tmp_path, prefix):
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)  # never answers
    port = server.sockets[0].getsockname()[1]
    svc = build_verifier(verifier_settings(tmp_path, f"redis://127.0.0.1:{port}/0"), secrets=SECRETS, key_prefix=prefix)
    try:
        t = asyncio.create_task(svc.admit(ex(A, prose(700, seed=7))))
        await asyncio.sleep(0.05)
        assert svc.ingest_pending_bytes == 700
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        assert svc.ingest_pending_bytes == 0 and svc.stats["ingested"] == 0
    finally:
        await svc.aclose()
        server.close()


async def test_in_memory_stores_index_a_small_prompt_on_the_loop_when_the_lock_is_free(tmp_path):
    """No Redis: a small prompt is indexed on the event loop (no admission thread) when the
    state lock is free, a larger one in the thread; both are found by a strict check."""
    svc = build_verifier(verifier_settings(tmp_path, ""), secrets=SECRETS)
    threaded = no_thread(svc)
    try:
        small, large = prose(INLINE_INGEST_BYTES, seed=8), prose(INLINE_INGEST_BYTES + 1, seed=9)
        await svc.admit(ex(A, small))
        await svc.admit(ex(A, large))
        assert threaded == [INLINE_INGEST_BYTES + 1]
        assert svc.stats["ingested"] == 2 and svc.ingest_pending_bytes == 0
        for text in (small, large):
            g = svc.begin(ex(STRICT, "hello there"))
            with pytest.raises(ResponseWithheld) as ei:
                await g.check_body("Sure: " + text[1000:1600], usage=None, finish_reason="stop", ttft_seconds=None)
            assert ei.value.detector == "leak_index"
    finally:
        await svc.aclose()


async def test_in_memory_stores_never_wait_for_the_lock_on_the_loop(tmp_path):
    """The state lock is held (the worker's batch): a small prompt is not indexed on the loop
    but in the admission thread, which waits for the lock; the loop stays free meanwhile."""
    import threading

    svc = build_verifier(verifier_settings(tmp_path, ""), secrets=SECRETS)
    threaded = no_thread(svc)
    holding, released = threading.Event(), threading.Event()

    def hold() -> None:
        with svc.strict.lock:
            holding.set()
            released.wait(10)

    holder = threading.Thread(target=hold)
    try:
        holder.start()
        assert holding.wait(5)
        task = asyncio.create_task(svc.admit(ex(A, prose(500, seed=10))))
        ticks = 0
        while ticks < 5:  # the loop runs while the admission waits for the lock
            await asyncio.sleep(0.01)
            ticks += 1
        assert not task.done() and threaded == [500]
        released.set()
        await asyncio.wait_for(task, 5)
        assert svc.stats["ingested"] == 1 and svc.ingest_pending_bytes == 0
    finally:
        released.set()
        holder.join(5)
        await svc.aclose()
