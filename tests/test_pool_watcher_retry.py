"""The pool watcher retries a failed poll sooner than ``pool.poll_interval_seconds``: 0.25 s after
the first failure, doubling on each further one, capped at the interval, and back to the interval
after a success (docs/gateway.md, "Live pool limit", "Unknown fails closed"). A failed poll still
drops the reading at once (fail closed); the retry only shortens the 503 ``pool_size_unknown``
window one transient failure (a non-200, an answer later than ``pool.request_timeout_seconds``)
causes, from the whole interval (5 s by default) to about a quarter of a second. A dead engine is
never polled in a tight loop (the cap), and the failure is logged once, not on every retry.

Each test drives a real :class:`PoolWatcher` task against the mock engine over loopback and
records when every poll ends (``on_update`` is called after each one)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from config.models import PoolSettings, UpstreamConfig
from gateway.ops.pool_watcher import PoolWatcher
from tests.gateway_harness import MODEL, closed_port_url
from tests.mock_engine import MockEngine

pytestmark = pytest.mark.timeout(60)

#: floor(4096 / 1.25): the mock engine's pool under the default headroom
LIMIT = 3276


class _Polls:
    """``on_update``: when each poll ended and whether it read the pool."""

    def __init__(self) -> None:
        self.ends: list[tuple[float, bool]] = []

    def __call__(self, pool: int | None, limit: int | None) -> None:
        self.ends.append((time.monotonic(), limit is not None))

    def gaps(self, start: int = 0) -> list[float]:
        t = [e[0] for e in self.ends[start:]]
        return [round(b - a, 3) for a, b in zip(t, t[1:], strict=False)]


@pytest.fixture
def engine() -> Iterator[MockEngine]:
    e = MockEngine().start()
    try:
        yield e
    finally:
        e.stop()


def _watcher(info_url: str, interval: float, polls: _Polls, timeout: float = 0.5) -> PoolWatcher:
    up = UpstreamConfig(
        name="u1", api_url="http://127.0.0.1:1/v1", pool_source="sglang", pool_urls=[info_url], models=[MODEL]
    )
    settings = PoolSettings(poll_interval_seconds=interval, max_staleness_seconds=30, request_timeout_seconds=timeout)
    return PoolWatcher(up, settings, httpx.AsyncClient(), 8192, on_update=polls)


async def _until(pred: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True


async def _stop(w: PoolWatcher) -> None:
    await w.stop()
    await w.client.aclose()


@pytest.mark.parametrize(
    ("mode", "error"),
    [("500", "{url} answered 500"), ("hang", "{url} answered nothing whole within 0.5 s")],
)
async def test_one_failed_poll_is_retried_within_a_second_not_the_interval(
    engine: MockEngine, mode: str, error: str
) -> None:
    # before: the next poll came poll_interval_seconds (5 s) later, and every request for the
    # upstream was refused 503 pool_size_unknown for those 5 s
    polls = _Polls()
    engine.state.info_mode = mode
    w = _watcher(engine.info_url, 5.0, polls)
    w.start()
    try:
        assert await _until(lambda: len(polls.ends) >= 1, 3.0)
        # fails closed at once
        assert (w.limit_now(), w.last_error) == (None, error.format(url=engine.info_url))
        engine.state.info_mode = "ok"
        t0 = time.monotonic()
        assert await _until(lambda: w.limit_now() == LIMIT, 1.0), (w.status(), polls.gaps())
        assert time.monotonic() - t0 < 1.0
        assert w.last_error is None
        assert [ok for _, ok in polls.ends] == [False, True]
    finally:
        await _stop(w)


@pytest.mark.parametrize("where", ["500", "refused"])
async def test_repeated_failures_space_out_up_to_the_interval_and_log_once(
    engine: MockEngine, where: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="kvgate.pool")
    polls = _Polls()
    url = engine.info_url if where == "500" else closed_port_url() + "/server_info"
    engine.state.info_mode = "500"
    w = _watcher(url, 1.0, polls)
    w.start()
    try:
        await asyncio.sleep(4.0)
    finally:
        await _stop(w)
    gaps = polls.gaps()
    assert all(not ok for _, ok in polls.ends)
    # polls end at about 0, 0.25, 0.75, 1.75, 2.75, 3.75 s: 6 in 4 s, never a tight loop
    assert 5 <= len(polls.ends) <= 7, gaps
    if where == "500":
        assert engine.state.info_hits == len(polls.ends)
    # the first retry is early (before: the whole interval, 1 s), each next one later, the last at
    # the interval (the cap), never beyond it by more than a loaded machine's slack
    assert gaps[0] < 0.6, gaps
    assert gaps[1] > gaps[0] and gaps[2] > gaps[1], gaps
    assert all(0.9 <= g < 1.5 for g in gaps[2:]), gaps
    # the failure is logged once, not on every retry
    unknown = [r for r in caplog.records if "unknown" in r.getMessage()]
    assert len(unknown) == 1, [r.getMessage() for r in caplog.records]


async def test_after_recovery_the_interval_is_normal_and_a_new_failure_retries_early_again(
    engine: MockEngine,
) -> None:
    polls = _Polls()
    engine.state.info_mode = "500"
    w = _watcher(engine.info_url, 1.0, polls)
    w.start()
    try:
        # back off up to the cap: failures at about 0, 0.25, 0.75, 1.75 s
        assert await _until(lambda: len(polls.ends) >= 4, 4.0), polls.gaps()
        engine.state.info_mode = "ok"
        assert await _until(lambda: w.limit_now() == LIMIT, 2.0)
        first_ok = len(polls.ends) - 1
        # successes come at the normal interval, not at a retry's delay
        assert await _until(lambda: len(polls.ends) >= first_ok + 3, 4.0)
        assert all(ok for _, ok in polls.ends[first_ok:])
        assert all(0.9 <= g < 1.5 for g in polls.gaps(first_ok)), polls.gaps(first_ok)
        # a new failure starts again at the short delay: the success reset the back-off
        engine.state.info_mode = "500"
        n = len(polls.ends)
        assert await _until(lambda: len(polls.ends) >= n + 2, 3.0)
        fail = next(i for i in range(n, len(polls.ends)) if not polls.ends[i][1])
        assert await _until(lambda: len(polls.ends) >= fail + 2, 2.0)
        assert polls.gaps(fail)[0] < 0.6, polls.gaps(fail)
        engine.state.info_mode = "ok"
        assert await _until(lambda: w.limit_now() == LIMIT, 1.0), polls.gaps()
    finally:
        await _stop(w)
