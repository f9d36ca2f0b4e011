"""The large-body budget (gateway/edge/body_budget.py): bytes past a body's first 64 KiB are paced by a
process-wide token bucket, tenants served in turn; small bodies never wait. Unit tests on a fake
clock (every wait exact), then through the real app over HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import time

import orjson
import pytest

from gateway.edge.body_budget import FREE_BODY_BYTES, BodyBudget
from tests.gateway_harness import MODEL, Gateway, settings_for, upstream, wait_for

pytestmark = [pytest.mark.timeout(60), pytest.mark.engine(pool_tokens=1 << 20, context_length=1 << 20)]

MiB = 1 << 20


class FakeTime:
    """A clock that only moves when the budget sleeps; records each sleep (seconds)."""

    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    async def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.now += s
        await asyncio.sleep(0)  # let the others queue meanwhile


@pytest.fixture
def fake():
    return FakeTime()


def test_the_burst_is_free_then_each_byte_waits_its_share_of_the_rate(fake):
    b = BodyBudget(bytes_per_second=MiB, burst_bytes=MiB, clock=fake.clock, sleep=fake.sleep)

    async def go() -> None:
        await b.take("t", MiB)  # the whole burst: no wait
        assert fake.sleeps == []
        await b.take("t", MiB // 2)  # half a second's worth of debt
        assert fake.sleeps == [0.5]
        fake.now += 60  # a minute idle refills only up to the burst
        await b.take("t", MiB)
        await b.take("t", 1024)
        assert fake.sleeps == [0.5, 1024 / MiB]
        await b.take("t", 0)  # nothing to spend: no wait, no state
        await b.take("t", -5)
        assert len(fake.sleeps) == 2 and b._tenants == {}

    asyncio.run(go())


def test_tenants_are_served_in_turn_not_by_connection(fake):
    """Tenant a queues three reads at once, tenant b one after them: b's read is the second
    served, not the fourth (one read per tenant waits for the bucket at a time)."""
    b = BodyBudget(bytes_per_second=MiB, burst_bytes=64 * 1024, clock=fake.clock, sleep=fake.sleep)
    order: list[str] = []

    async def read(tenant: str, tag: str) -> None:
        await b.take(tenant, MiB)
        order.append(tag)

    async def go() -> None:
        await asyncio.gather(read("a", "a1"), read("a", "a2"), read("a", "a3"), read("b", "b1"))

    asyncio.run(go())
    assert order == ["a1", "b1", "a2", "a3"]
    assert b._tenants == {}  # nothing kept once the tenants' reads are done


def test_a_cancelled_wait_leaves_no_waiter_behind(fake):
    b = BodyBudget(bytes_per_second=MiB, burst_bytes=64 * 1024, clock=fake.clock, sleep=fake.sleep)

    async def go() -> None:
        first = asyncio.ensure_future(b.take("a", 4 * MiB))
        second = asyncio.ensure_future(b.take("a", MiB))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        second.cancel()  # the client left while its read waited behind the first
        await asyncio.gather(first, second, return_exceptions=True)
        assert second.cancelled() and b._tenants == {}
        await b.take("b", 1024)  # the bucket still serves others

    asyncio.run(go())


def test_a_budget_needs_a_positive_rate_and_burst():
    with pytest.raises(ValueError, match="positive rate and burst"):
        BodyBudget(0)
    with pytest.raises(ValueError, match="positive rate and burst"):
        BodyBudget(MiB, burst_bytes=0)


@contextlib.contextmanager
def serving(settings):
    """A started gateway whose pool is known."""
    g = Gateway(settings).start()
    try:
        assert wait_for(lambda: g.gw.upstreams.eligible(MODEL)[1] is not None)
        yield g
    finally:
        g.stop()


@pytest.fixture
def spent(monkeypatch) -> list[tuple[str, int]]:
    """Every (tenant id, bytes) the app spends from a body budget, as it spends it."""
    calls: list[tuple[str, int]] = []
    real_take = BodyBudget.take

    async def take(self, tenant_id: str, n: int) -> None:
        calls.append((tenant_id, n))
        await real_take(self, tenant_id, n)

    monkeypatch.setattr(BodyBudget, "take", take)
    return calls


def test_only_the_bytes_past_a_body_first_64_kib_are_paced_and_small_bodies_never(engine, spent):
    """Through the real app: a 300,000-byte completions body (token ids) spends exactly its bytes
    past the first 64 KiB, for its own tenant; a chat request spends nothing; with the budget
    off (null) nothing is paced."""
    s = settings_for([upstream("up", engine)], gateway={"max_body_bytes": 8 * MiB}, context_length=1 << 20)
    body = orjson.dumps({"model": MODEL, "prompt": [17] * 99_990, "max_tokens": 1})
    assert 290_000 < len(body) < 310_000
    with serving(s) as g, g.client() as c:
        r = c.post("/v1/completions", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 200, r.text
        assert [t for t, _ in spent] == ["tenant-a"] * len(spent)
        assert sum(n for _, n in spent) == len(body) - FREE_BODY_BYTES
        spent.clear()
        r = c.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200 and spent == []
    off = settings_for(
        [upstream("up", engine)],
        gateway={"max_body_bytes": 8 * MiB, "large_body_bytes_per_second": None},
        context_length=1 << 20,
    )
    with serving(off) as g, g.client() as c:
        assert g.gw.body_budget is None
        r = c.post("/v1/completions", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 200 and spent == []


def test_large_bodies_back_to_back_take_at_least_the_budget_time(engine):
    """At 256 KiB/s with the default 1 MiB burst, two bodies of 1 MiB + 64 KiB + 64 KiB each
    (2.125 MiB paced) cannot both be read in under (2.125 - 1) MiB / 256 KiB/s = 4.5 s."""
    s = settings_for(
        [upstream("up", engine)],
        gateway={"max_body_bytes": 8 * MiB, "large_body_bytes_per_second": 256 * 1024, "body_timeout_seconds": 20},
        context_length=1 << 20,
    )
    prompt = "x " * ((MiB + 2 * FREE_BODY_BYTES - 64) // 2)
    body = orjson.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 1})
    with serving(s) as g, g.client(timeout=30) as c:
        t0 = time.monotonic()
        for _ in range(2):
            r = c.post("/v1/completions", content=body, headers={"content-type": "application/json"})
            assert r.status_code == 200, r.text
        took = time.monotonic() - t0
    paced = 2 * (len(body) - FREE_BODY_BYTES)
    assert took >= (paced - MiB) / (256 * 1024) - 0.05


def _event(content: str) -> bytes:
    obj = {"id": "c1", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": content}}]}
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def test_a_huge_stream_event_is_read_at_the_budget_rate_and_relayed_byte_exact(engine, spent):
    """An upstream event of 640 KiB arriving in 64 KiB reads: the bytes each read adds past the
    unfinished event's first 64 KiB are spent for the request's tenant (at most the event's size
    less 64 KiB: the read that ends it is not paced), small events spend nothing, and the stream
    arrives byte for byte as the engine sent it."""
    big = _event("z" * (640 * 1024))
    stream = [_event("a"), big, _event("b"), b"data: [DONE]\n\n"]
    raw = b"".join(stream)
    engine.state.stream_chunks = [raw[i : i + 65536] for i in range(0, len(raw), 65536)]
    engine.state.chunk_interval_seconds = 0.01  # one read each
    s = settings_for([upstream("up", engine)])
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 5}
    with serving(s) as g, g.client() as c:
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200 and r.content == raw
        total = sum(n for _, n in spent)
        assert {t for t, _ in spent} == {"tenant-a"}
        assert len(big) - FREE_BODY_BYTES - 2 * 65536 <= total <= len(big) - FREE_BODY_BYTES
        spent.clear()
        engine.state.stream_chunks = [_event("a"), _event("b"), b"data: [DONE]\n\n"]
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200 and spent == []
