"""Helpers shared by the engine-core tests (tests/test_backend_core_*.py); imported by them only."""

from __future__ import annotations

import contextlib

import pytest

from gpu_backend.engine import Engine, EngineConfig
from gpu_backend.sampling import SamplingParams


def check_pool_idle(engine: Engine) -> None:
    """Invariants 3 and 4 once the engine is idle: free + used == total, nothing used, and (with
    scrubbing on) every page reads as zeros."""
    engine.check_integrity()  # owned + free pages == total, counted two ways
    st = engine.pool_stats()
    assert st["free_pages"] + st["used_pages"] == st["total_pages"], st
    assert st["used_pages"] == 0, st
    if engine.pool.scrub:
        assert not bool(engine.pool.kv.any()), "a released page was not zeroed"


@pytest.fixture
async def make_engine():
    """``await make_engine(**EngineConfig kwargs)`` -> a started engine; on teardown every engine is
    stopped and its pool checked idle (invariants 3 and 4 after every test's workload)."""
    engines: list[Engine] = []

    async def make(**kw) -> Engine:
        eng = Engine(EngineConfig(**kw))
        await eng.start()
        engines.append(eng)
        return eng

    yield make
    for eng in engines:
        await eng.stop()
    for eng in engines:
        check_pool_idle(eng)


async def collect(engine: Engine, request_id: str, prompt: list[int], **params):
    """Run ``generate`` to the end; returns (token ids, text, last event)."""
    toks, text, last = [], "", None
    async for ev in engine.generate(request_id, prompt, SamplingParams(**params)):
        if ev.token_id >= 0:
            toks.append(ev.token_id)
        text += ev.text
        last = ev
    return toks, text, last


@contextlib.contextmanager
def worker_paused(engine: Engine):
    """Hold the scheduler's lock so the worker cannot drain its inbox: everything submitted meanwhile
    is picked up together (deterministic batching in tests). The lock is re-entrant for this thread."""
    with engine.scheduler.cond:
        yield
