"""Each tenant's share of the event loop's time for counting (tokenizer/base.py ``on_loop``,
gateway/edge/offload.py ``loop_account``): short counts run on the loop every tenant shares, so a
tenant that floods it with counts just under ``offload_count_chars`` has its further counts, of any
size, sent to its own share of the offload threads, while another tenant's stay on the loop; its
share refills with time. Deterministic: the clock is a fake one that a count on the loop moves by a
fixed cost, and the path each count took is read from the thread it ran on and the jobs the
offload executor was handed (no timing is measured)."""

from __future__ import annotations

import asyncio
import contextvars
import threading
from typing import Any

import pytest

import tokenizer.base as base
from config.models import GatewaySettings
from gateway.edge import offload
from tokenizer.base import PromptCounter
from tokenizer.tokenize_api import tokenize_prompt

pytestmark = pytest.mark.timeout(30)

#: what one short count costs the loop, in seconds of the fake clock (a power of two: exact sums)
COST = 1 / 64
START = 1024.0


class FakeClock:
    """``time.perf_counter`` for :mod:`tokenizer.base`: moves only when told."""

    def __init__(self) -> None:
        self.t = START

    def __call__(self) -> float:
        return self.t


class TickingCounter(PromptCounter):
    """A counter whose every count costs :data:`COST` of the fake clock when it runs on the loop's
    thread (a worker thread's time is not the loop's), and records where it ran."""

    vocab_size = 100

    def __init__(self, clock: FakeClock, loop_thread: int) -> None:
        self.clock = clock
        self.loop_thread = loop_thread
        self.where: list[str] = []

    def _tick(self) -> None:
        on_loop = threading.get_ident() == self.loop_thread
        self.where.append("loop" if on_loop else "thread")
        if on_loop:
            self.clock.t += COST

    def count_text(self, text: str) -> int:
        self._tick()
        return len(text)

    def count_chat(self, messages: Any, tools: Any = None, options: Any = None) -> int:
        self._tick()
        return len(messages)

    def decode(self, ids: list[int]) -> str:
        self._tick()
        return "x" * len(ids)

    def prompt_token_ids(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [1] * len(text)

    def is_valid_id(self, token_id: int) -> bool:
        return True


@pytest.fixture
async def setup(monkeypatch):
    """``(counter, clock, submitted)``: the loop's executor a fresh :class:`offload.TenantExecutor`
    whose jobs are recorded by tenant in ``submitted``; tenants' loop shares 1/8 of the loop and a
    burst of 1/16 s (so 1/8 s of debt is 1 s of refill, and 1/2 s of slack), made afresh."""
    monkeypatch.setattr(offload, "LOOP_SHARE", 0.125, raising=False)
    monkeypatch.setattr(offload, "LOOP_BURST_SECONDS", 0.0625, raising=False)
    monkeypatch.setattr(offload, "_LOOP_ACCOUNTS", {}, raising=False)
    clock = FakeClock()
    monkeypatch.setattr(base, "perf_counter", clock, raising=False)
    ex = offload.install(asyncio.get_running_loop(), threads=4, share=1, cores=1)
    submitted: list[str | None] = []
    real_submit = ex.submit

    def recording(fn, /, *args, **kwargs):
        submitted.append(offload._TENANT.get())
        return real_submit(fn, *args, **kwargs)

    monkeypatch.setattr(ex, "submit", recording)
    return TickingCounter(clock, threading.get_ident()), clock, submitted


async def as_tenant(tenant: str | None, fn, *args):
    """``await fn(*args)`` in a task of its own that authenticated as ``tenant`` (``None``: none)."""

    async def run():
        if tenant is not None:
            offload.set_tenant(tenant)
        return await fn(*args)

    return await asyncio.ensure_future(run())


SMALL = [{"role": "user", "content": "hi"}]


async def test_a_tenant_over_its_loop_share_counts_in_its_threads_while_another_stays_on_the_loop(setup):
    counter, clock, submitted = setup

    async def seven():
        return [await counter.acount_chat(SMALL) for _ in range(7)]

    assert await as_tenant("flood", seven) == [1] * 7
    # counts k = 0..4 start with k/8 s charged against k/64 s of refill and 1/2 s of slack: the
    # 6th finds the flood's share spent, and it and the 7th go to its threads
    assert counter.where == ["loop"] * 5 + ["thread"] * 2
    assert submitted == ["flood", "flood"]
    assert clock.t == START + 5 * COST  # the loop was held for the five, not the two
    # the victim's short count stays on the loop, however spent the flood's share is
    assert await as_tenant("victim", counter.acount_chat, SMALL) == 1
    assert counter.where[-1] == "loop" and submitted == ["flood", "flood"]
    # the flood's share refills: 5/8 s charged from START is paid back 1/2 s (its slack) early
    clock.t = START + 0.125
    assert await as_tenant("flood", seven) == [1] * 7
    assert counter.where[-7:] == ["loop"] + ["thread"] * 6
    assert submitted == ["flood"] * 8


async def test_every_on_loop_path_takes_the_same_share(setup):
    """``acount_prompt``, ``adecode`` and ``/tokenize``'s ``tokenize_prompt`` decide as
    ``acount_chat`` does, and charge the same account."""
    counter, clock, submitted = setup

    async def mixed():
        return [
            (await counter.acount_prompt("abc")).per_prompt,
            await counter.adecode([1, 2]),
            (await tokenize_prompt(counter, "ab")).count,
            await counter.acount_chat(SMALL),
            await counter.acount_chat(SMALL),
            (await counter.acount_prompt(["a", "b"])).per_prompt,
            await counter.adecode([1, 2]),
            (await tokenize_prompt(counter, "ab")).count,
        ]

    assert await as_tenant("flood", mixed) == [(3,), "xx", 2, 1, 1, (1, 1), "xx", 2]
    # five counts on the loop (the batch of two prompts is one decision, and two counts)
    assert counter.where == ["loop"] * 5 + ["thread"] * 2 + ["thread"] * 2
    assert submitted == ["flood"] * 3


async def test_the_honest_path_stays_on_the_loop(setup):
    """A task with no tenant is not limited; a tenant's occasional short count stays on the loop
    (its share refills faster than it spends); over ``offload_chars`` is a thread, as before."""
    counter, clock, submitted = setup
    counts = [await as_tenant(None, counter.acount_chat, SMALL) for _ in range(20)]
    assert counts == [1] * 20 and counter.where == ["loop"] * 20 and submitted == []
    for _ in range(20):
        assert await as_tenant("honest", counter.acount_chat, SMALL) == 1
        clock.t += 8 * COST  # 1/64 s of counting in every 9/64 s: under its eighth of the loop
    assert counter.where == ["loop"] * 40 and submitted == []
    big = [{"role": "user", "content": "a" * counter.offload_chars}]
    assert await as_tenant("honest", counter.acount_chat, big) == 1
    assert counter.where[-1] == "thread" and submitted == ["honest"]


def test_on_loop_and_charge_loop_keep_one_number(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(base, "perf_counter", clock)
    account = base.LoopAccount(0.125, 0.0625)
    assert (account.due, account.stretch, account.slack) == (0.0, 8.0, 0.5)

    def run() -> list[Any]:
        out: list[Any] = [base.on_loop(10, 10), base.on_loop(11, 10)]  # no account: the limit alone
        base.LOOP_ACCOUNT.set(account)
        start = base.on_loop(10, 10)
        assert start is not None
        clock.t += 0.25  # 1/4 s on the loop is 2 s of refill
        base.charge_loop(start)
        out += [start, account.due]
        clock.t += 2.5  # idle past its due: the next charge starts from now, not from the old due
        start = base.on_loop(1, 10)
        assert start == START + 2.75
        base.charge_loop(start)
        out.append(account.due)
        clock.t += 0.5  # 1/2 s at once: 4 s due, beyond its 1/2 s of slack
        base.charge_loop(START + 2.75)
        out += [account.due, base.on_loop(1, 10), base.on_loop(1, 10**9)]
        clock.t = account.due - account.slack  # refilled just enough
        out.append(base.on_loop(1, 10))
        return out

    assert contextvars.copy_context().run(run) == [
        START,
        None,
        START,
        START + 2.0,
        START + 2.75,
        START + 6.75,
        None,
        None,
        START + 6.25,
    ]
    assert base.LOOP_ACCOUNT.get() is None  # the copy's setting stayed in the copy
    with pytest.raises(ValueError):
        base.LoopAccount(0, 1)
    with pytest.raises(ValueError):
        base.LoopAccount(1.5, 1)


def test_set_tenant_charges_each_tenant_its_own_account(monkeypatch):
    monkeypatch.setattr(offload, "_LOOP_ACCOUNTS", {})

    def accounts() -> tuple[Any, ...]:
        offload.set_tenant("a")
        a = base.LOOP_ACCOUNT.get()
        offload.set_tenant("b")
        return a, base.LOOP_ACCOUNT.get()

    a, b = contextvars.copy_context().run(accounts)
    assert a is offload.loop_account("a") and b is offload.loop_account("b") and a is not b
    assert (a.stretch, a.slack) == (1 / offload.LOOP_SHARE, offload.LOOP_BURST_SECONDS / offload.LOOP_SHARE)
    assert contextvars.copy_context().run(accounts)[0] is a  # one account per tenant, kept


def test_the_default_offload_threshold():
    """Lowered so the worst text under it is counted in about 10 ms (docs/configuration.md)."""
    assert base.OFFLOAD_CHARS == GatewaySettings().offload_count_chars == 16_384


def test_the_gateway_charges_a_request_to_the_tenant_that_authenticated(monkeypatch):
    """Through the real app: a chat from tenant ``a`` is counted on the loop and charged to its
    account, and to no other (``admit`` authenticates, then ``set_tenant``); without that step
    a flood's counts would be charged to no one and never leave the shared loop."""
    from tests.gateway_harness import KEY_A, Gateway, chat, settings_for, tenants, upstream
    from tests.mock_engine import MockEngine

    monkeypatch.setattr(offload, "_LOOP_ACCOUNTS", {})
    a, b = offload.loop_account("tenant-a"), offload.loop_account("tenant-b")
    engine = MockEngine().start()
    g = Gateway(settings_for([upstream("u1", engine)]), tenants()).start()
    try:
        with g.client(KEY_A) as c:
            assert c.post("/v1/chat/completions", json=chat()).status_code == 200
    finally:
        g.stop()
        engine.stop()
    assert a.due > 0.0 and b.due == 0.0
    assert set(offload._LOOP_ACCOUNTS) == {"tenant-a", "tenant-b"}
