"""The quota stage's background rounds and its close (``gateway/quotas/tenant_quotas.py``), against
the real Redis on 127.0.0.1:6379 (a key prefix per test, its keys deleted after it):

- an undo or resend round cancelled at any loop turn leaves no store call's coroutine never
  awaited (Python's ``RuntimeWarning``), and what it did not do is done later, exactly;
- ``aclose`` sends the settles handed over just before it (a request cancelled at a graceful
  shutdown's end, or one whose settle met the store's back-off) before closing the connection.
"""

from __future__ import annotations

import asyncio
import gc
import time
import uuid
import warnings
from typing import Any

import pytest

from config.models import TenantConfig
from gateway.quotas.stores import QuotaLimits
from tests.quota_fixtures import recovered
from tests.test_hostile_quotas_round4 import _stage, _state

pytestmark = pytest.mark.timeout(60)

TURNS = 40  # loop turns a round is cancelled after: 0..TURNS-1 (one round trip takes a few)


def _tenant(**kw: Any) -> TenantConfig:
    return TenantConfig(id=f"r4b-{uuid.uuid4().hex[:8]}", **kw)


def _never_awaited(caught: list[warnings.WarningMessage]) -> list[str]:
    return [
        str(w.message) for w in caught if issubclass(w.category, RuntimeWarning) and "never awaited" in str(w.message)
    ]


# ---------------------------------------------------------------- 1. a round cancelled at every loop turn
@pytest.mark.parametrize("round_", ["undo", "settle"])
async def test_a_round_cancelled_at_any_turn_leaves_no_coroutine_unawaited_and_is_done_later(
    redis_prefix, round_
) -> None:
    """Each attempt puts one store call per tenant (two tenants) in the stage's queue (a
    reservation Redis made whose call counted as failed, or a settle the store could not take),
    starts the round that sends them (``_cancel_uncertain`` / ``_settle_left_over``) and cancels
    it after 0..39 loop turns. No ``coroutine ... was never awaited`` warning is emitted, and
    once the background round is done Redis holds exactly what every call made would leave:
    undone, no lease, no debit, no RPM entry; settled at 30 of 100, 30 per request."""
    stage = _stage(redis_prefix)
    tenants = [_tenant(rpm=10_000, tpm=10_000_000, max_concurrent=10_000) for _ in range(2)]
    caught: list[warnings.WarningMessage]
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for turns in range(TURNS):
                for t in tenants:
                    if round_ == "undo":
                        lease_id = uuid.uuid4().hex
                        limits = QuotaLimits.of(t)
                        d = await stage.store.reserve(t.id, limits, lease_id, 100, stage.window_ms, stage.lease_ttl_ms)
                        assert d.admitted
                        stage._uncertain.append((t.id, lease_id, False))
                    else:
                        lease = await stage.reserve(t, 100, "r")
                        held = lease.state
                        held.settled = True  # as settle() does before queueing it
                        stage._live.pop(held.lease_id, None)
                        stage._unsettled.append((held, 30, 100))
                run = stage._cancel_uncertain() if round_ == "undo" else stage._settle_left_over()
                task = asyncio.ensure_future(run)
                for _ in range(turns):
                    await asyncio.sleep(0)
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                # this turn's garbage (younger generations: a full pass over the whole suite's heap
                # took ~0.25 s, 40 of them most of the test); the full pass below finds the rest
                gc.collect(1)
            stage._ensure_recoverer()
            await recovered(stage)
            await asyncio.sleep(0.05)  # a settle's coalesced round trip
            gc.collect()
        assert _never_awaited(caught) == []
        for t in tenants:
            state = await _state(stage.store, t.id)  # type: ignore[arg-type]
            if round_ == "undo":
                assert state == {"rpm": 0, "tpm": 0, "debits": [], "sum": 0, "leases": 0}, state
            else:
                assert state == {"rpm": TURNS, "tpm": TURNS, "debits": [30] * TURNS, "sum": 30 * TURNS, "leases": 0}, (
                    state
                )
    finally:
        await stage.aclose()


# ---------------------------------------------------------------- 2. aclose sends what is handed over
async def test_a_settle_of_a_request_cancelled_just_before_aclose_is_applied(redis_prefix) -> None:
    """A graceful shutdown's end: the request's task hands its settle over and is cancelled
    (uvicorn cancels the request tasks), then the lifespan closes the stage. The settle reaches
    Redis before the connection closes: debit exactly 30, no lease."""
    stage = _stage(redis_prefix)
    t = _tenant(rpm=1000, tpm=1_000_000, max_concurrent=10)
    lease = await stage.reserve(t, 100, "r")
    task = asyncio.ensure_future(stage.settle(lease, 30))
    await asyncio.sleep(0)  # the settle is handed over (queued for its round trip)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await stage.aclose()
    state = await _state(stage.store, t.id)  # type: ignore[arg-type]
    assert state == {"rpm": 1, "tpm": 1, "debits": [30], "sum": 30, "leases": 0}, state


async def test_a_settle_left_over_from_the_back_off_is_sent_by_aclose(redis_prefix) -> None:
    """A settle handed over while the store backs off (a call failed a moment before) waits for
    the background round; the stage closing before it comes sends it anyway, once, within the
    decision deadline: debit exactly 30 (not the reservation's 100), no lease left to expire by
    TTL, and an uncertain reservation undone."""
    stage = _stage(redis_prefix)
    t = _tenant(rpm=1000, tpm=1_000_000, max_concurrent=10)
    lease = await stage.reserve(t, 100, "r")
    other = uuid.uuid4().hex
    d = await stage.store.reserve(t.id, QuotaLimits.of(t), other, 500, stage.window_ms, stage.lease_ttl_ms)
    assert d.admitted
    stage._backoff.failed()  # the store backs off: settle() queues it for the background round
    stage._uncertain.append((t.id, other, False))
    await stage.settle(lease, 30)
    assert len(stage._unsettled) == 1
    t0 = time.monotonic()
    await stage.aclose()
    assert time.monotonic() - t0 < stage.deadline_seconds + 0.5
    assert stage._recoverer is None
    state = await _state(stage.store, t.id)  # type: ignore[arg-type]
    assert state == {"rpm": 1, "tpm": 1, "debits": [30], "sum": 30, "leases": 0}, state
