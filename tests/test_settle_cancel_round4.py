"""The settle of an admitted request against cancellation at every await between its end and the
hand-over of its settle to the quota stage (gateway/relay/response.py's ``finally``,
gateway/relay/finish.py): a request whose task is cancelled there (the server stopping while its
client also left, uvicorn cancelling the tasks its graceful shutdown did not see end, a transport
whose close awaits) must still release its lease once, with the exact tokens, or its concurrency
slot is renewed by this process for as long as it lives.

Through the real app in-process (tests/test_hostile_relay.py's raw ASGI harness: an engine played
by the upstream client's ``MockTransport``, a client that leaves as a raw ``receive``), over the
production quota stage on the shared Redis (a key prefix per test). The awaits are held by gates:
the upstream response's ``aclose`` (awaited by the relay's ``finally``, inside the response shell's
``body_iterator.aclose()`` when the relay is suspended at a ``yield``) and ``finish``'s
``used_tokens`` (a worker-thread count of a long completion). At each gate the request's task is
cancelled once, then once more after a loop turn (landing in the settle's own round trip); every
request must be settled exactly once (the amount: what it used, or its reservation when the count
was cut), Redis must hold no lease and the debit settled, and the stage no lease to renew."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from config.models import QuotaSettings
from gateway.app import create_app
from gateway.quotas.stage import QuotaLease
from gateway.quotas.stores import RedisQuotaStore
from gateway.quotas.tenant_quotas import TenantQuotas, redis_client_from_url
from gateway.relay import finish as finish_module
from gateway.relay.upstream_client import MockResponse, MockTransport, UpstreamClient
from tests.fixtures.redis_keys import REDIS_URL
from tests.gate_oracle import text_tokens
from tests.gateway_harness import KEY_A, MODEL, SECRETS, chat, settings_for, tenants
from tests.quota_fixtures import recovered
from tests.test_gateway_relay import SSE, _chunk, _event, static_upstream
from tests.test_hostile_quotas_round4 import _state

pytestmark = pytest.mark.timeout(60)

TENANT = "tenant-a"
JSON = {"content-type": "application/json"}
PROMPT = 11  # chat() and the Responses body below, as admitted (the bundled tokenizer)
RESERVED = PROMPT + 5  # max_tokens / max_output_tokens 5, one sequence


class RecordingQuotas(TenantQuotas):
    """The production quota stage over the shared Redis, keeping every settle it is handed
    (request id, tokens) as it is called."""

    def __init__(self, prefix: str) -> None:
        super().__init__(QuotaSettings(), RedisQuotaStore(redis_client_from_url(REDIS_URL, 0.25), prefix=prefix))
        self.settles: list[tuple[str, int]] = []

    async def settle(self, lease: QuotaLease, used_tokens: int) -> None:
        self.settles.append((lease.request_id, used_tokens))
        await super().settle(lease, used_tokens)


class Gate:
    """An await held until released; ``entered`` is set once something waits on it."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.release = asyncio.Event()

    async def wait(self) -> None:
        self.entered.set()
        await self.release.wait()


class Engine(MockResponse):
    """An engine's answer: ``chunks``, then nothing for a minute when ``stall`` (a long prefill);
    its ``aclose`` waits on ``gate`` when given (a transport whose close awaits its connection)."""

    def __init__(
        self, status: int, headers: dict[str, str], chunks: list[bytes], gate: Gate | None, stall: bool
    ) -> None:
        super().__init__(status, headers, chunks)
        self.gate = gate
        self.stall = stall

    async def aiter_raw(self):
        for c in self.chunks:
            yield c
        if self.stall:
            await asyncio.sleep(60)

    async def aclose(self) -> None:
        if self.gate is not None:
            await self.gate.wait()
        self.closed = True


RESPONSES = {"model": MODEL, "input": "Say hello.", "stream": True, "max_output_tokens": 5}
WHOLE = (
    b'{"id":"c1","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant",'
    b'"content":"hi there"},"finish_reason":"stop"}],"usage":{"prompt_tokens":11,"completion_tokens":2}}'
)
STREAM = [
    _chunk("hi", False),
    _chunk(" there", False, "stop"),
    b'data: {"id":"c1","choices":[],"usage":{"prompt_tokens":11,"completion_tokens":3}}\n\n',
    b"data: [DONE]\n\n",
]
RESPONSES_STREAM = [
    _event("response.created", 0, response={"id": "r1", "status": "in_progress", "output": []}),
    _event("response.output_text.delta", 1, output_index=0, content_index=0, delta="Hel"),
    _event(
        "response.completed",
        2,
        response={"id": "r1", "status": "completed", "output": [], "usage": {"input_tokens": 11, "output_tokens": 4}},
    ),
]
#: a completion longer than a counter's ``offload_chars`` (32,768), without usage: counted in a worker thread
LONG_TEXT = "hello " * 6000
LONG_STREAM = [_chunk(LONG_TEXT, False, "stop"), b"data: [DONE]\n\n"]
ENGINE_400 = b'{"object":"error","message":"bad temp","type":"BadRequestError","code":400}'

#: case -> (path, body, engine status, headers, chunks, stall, how the request ends, tokens it used)
#: ``end``: it runs to its end; ``left_sending``: its client leaves while the gateway waits to
#: write to it (the relay suspended at a ``yield``); ``left_waiting``: its client leaves while the
#: gateway waits on the engine; ``stopped``: the server cancels its task while it waits on the engine
CASES: dict[str, tuple[str, dict[str, Any], int, dict[str, str], list[bytes], bool, str, int]] = {
    "whole": ("/v1/chat/completions", chat(max_tokens=5), 200, JSON, [WHOLE], False, "end", PROMPT + 2),
    "stream": ("/v1/chat/completions", chat(max_tokens=5, stream=True), 200, SSE, STREAM, False, "end", PROMPT + 3),
    "responses_stream": ("/v1/responses", RESPONSES, 200, SSE, RESPONSES_STREAM, False, "end", PROMPT + 4),
    "upstream_error": ("/v1/chat/completions", chat(max_tokens=5), 400, JSON, [ENGINE_400], False, "end", PROMPT),
    "client_gone_sending": (
        "/v1/chat/completions",
        chat(max_tokens=5, stream=True),
        200,
        SSE,
        [_chunk("hi", False)],
        True,
        "left_sending",
        PROMPT + text_tokens("hi"),
    ),
    "client_gone_waiting": (
        "/v1/chat/completions",
        chat(max_tokens=5, stream=True),
        200,
        SSE,
        [_chunk("hi", False)],
        True,
        "left_waiting",
        PROMPT + text_tokens("hi"),
    ),
    "long_stream": (
        "/v1/chat/completions",
        chat(max_tokens=5, stream=True),
        200,
        SSE,
        LONG_STREAM,
        False,
        "end",
        PROMPT + text_tokens(LONG_TEXT),
    ),
    "server_stopping": (
        "/v1/chat/completions",
        chat(max_tokens=5, stream=True),
        200,
        SSE,
        [_chunk("hi", False)],
        True,
        "stopped",
        PROMPT + text_tokens("hi"),
    ),
}


async def _first(task: asyncio.Task, event: asyncio.Event, timeout: float = 2.0) -> bool:
    """Wait until ``event`` is set (True) or ``task`` ended / ``timeout`` passed (False)."""
    waiter = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait([task, waiter], timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
    return event.is_set()


def _hold_count(monkeypatch: pytest.MonkeyPatch, gates: tuple[str, ...], gate: Gate, fault: bool) -> None:
    """Hold the count of the tokens used on ``gate``: ``count``, ``finish``'s ``used_tokens``;
    ``thread``, its worker-thread hop (``asyncio.to_thread`` of the counter's ``count_text``).
    ``fault``: ``used_tokens`` raises instead."""
    if "thread" in gates:
        real_to_thread = asyncio.to_thread

        def to_thread(func: Any, /, *args: Any, **kwargs: Any) -> Any:
            if getattr(func, "__name__", "") != "count_text":
                return real_to_thread(func, *args, **kwargs)

            async def held() -> Any:
                await gate.wait()
                return await real_to_thread(func, *args, **kwargs)

            return held()

        monkeypatch.setattr(asyncio, "to_thread", to_thread)
    if "count" in gates or fault:
        real = finish_module.used_tokens

        async def used_tokens(outcome: Any) -> int:
            if fault:
                raise RuntimeError("the tokenizer's worker died")
            await gate.wait()
            return await real(outcome)

        monkeypatch.setattr(finish_module, "used_tokens", used_tokens)


class Client:
    """A client as raw ASGI: it sends ``body`` to ``path``, then leaves when ``left`` is set;
    ``reads_nothing``: the gateway's first write of the body waits forever (its socket full)."""

    def __init__(self, path: str, body: dict[str, Any], request_id: str, reads_nothing: bool) -> None:
        raw = json.dumps(body).encode()
        self.messages = [{"type": "http.request", "body": raw, "more_body": False}]
        self.left = asyncio.Event()
        self.body_sent = asyncio.Event()
        self.reads_nothing = reads_nothing
        self.scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "query_string": b"",
            "root_path": "",
            "headers": [
                (b"host", b"gateway.test"),
                (b"authorization", f"Bearer {KEY_A}".encode()),
                (b"content-type", b"application/json"),
                (b"content-length", str(len(raw)).encode()),
                (b"x-request-id", request_id.encode()),
            ],
            "client": ("127.0.0.1", 1),
            "server": ("127.0.0.1", 2),
        }

    async def receive(self) -> dict[str, Any]:
        if self.messages:
            return self.messages.pop()
        await self.left.wait()
        return {"type": "http.disconnect"}

    async def send(self, m: dict[str, Any]) -> None:
        if m["type"] == "http.response.body":
            self.body_sent.set()
            if self.reads_nothing:
                await asyncio.Event().wait()


async def _run(
    prefix: str, case: str, gates: tuple[str, ...], monkeypatch: pytest.MonkeyPatch, *, count_fault: bool = False
) -> tuple[RecordingQuotas, dict[str, Any], list[str]]:
    """One request of ``case`` through the app, its task cancelled once at each gate of ``gates``
    (``close``, ``count``, ``thread``) as it reaches it and, if it reached one, once more a few
    loop turns after the last; returns the stage, the tenant's Redis state once the stage's
    background round is done, and the gates the request reached."""
    path, body, status, headers, chunks, stall, ending, _ = CASES[case]
    close_gate, count_gate = Gate(), Gate()
    engine = Engine(status, headers, list(chunks), close_gate if "close" in gates else None, stall)
    _hold_count(monkeypatch, gates, count_gate, count_fault)
    stage = RecordingQuotas(prefix)
    registry = tenants(rpm=1000, tpm=1_000_000, max_concurrent=10)
    app = create_app(settings_for([static_upstream()]), registry, secrets=SECRETS, quotas=stage)
    gw = app.state.gateway
    gw.forwarder = UpstreamClient(transport=MockTransport(lambda request: engine))
    await gw.start()
    client = Client(path, body, case, reads_nothing=ending == "left_sending")
    reached: list[str] = []
    try:
        task = asyncio.create_task(app(client.scope, client.receive, client.send))
        if ending != "end":
            assert await _first(task, client.body_sent), "the stream never started"
            if ending == "stopped":
                task.cancel()
            else:
                client.left.set()
        for name in gates:
            if await _first(task, close_gate.entered if name == "close" else count_gate.entered):
                reached.append(name)
                task.cancel()
        if reached:
            for _ in range(3):
                await asyncio.sleep(0)
            task.cancel()  # once more: wherever the request now waits (the settle's own round trip)
        close_gate.release.set()
        count_gate.release.set()
        await asyncio.wait([task], timeout=5)
        assert task.done()
        await recovered(stage)
        await asyncio.sleep(0.05)  # a settle's coalesced round trip
        state = await _state(stage.store, TENANT)  # type: ignore[arg-type]
    finally:
        close_gate.release.set()
        count_gate.release.set()
        await gw.stop()
    return stage, state, reached


def _assert_settled_once(stage: RecordingQuotas, state: dict[str, Any], case: str, tokens: int) -> None:
    assert stage.settles == [(case, tokens)]
    assert stage._live == {}
    assert state["leases"] == 0, state
    assert state["debits"] == [tokens], state
    assert state["sum"] == tokens, state


@pytest.mark.parametrize("case", list(CASES))
async def test_a_request_that_is_not_cancelled_settles_what_it_used(redis_prefix, case, monkeypatch) -> None:
    """The baseline: no gate held, no cancel but the case's own (its server stopping)."""
    stage, state, reached = await _run(redis_prefix, case, (), monkeypatch)
    assert reached == []
    _assert_settled_once(stage, state, case, CASES[case][-1])


@pytest.mark.parametrize("case", list(CASES))
async def test_cancelled_while_the_relay_closes_the_request_still_settles_what_it_used(
    redis_prefix, case, monkeypatch
) -> None:
    """Cancelled while the upstream response's close is awaited: on a request that ran to its end
    or whose client left while the gateway waited to write (the close in the response shell's
    ``finally``), ``on_close`` was skipped before the fix, its lease renewed for as long as the
    process lived (no settle, a live lease, Redis holding the lease and the whole reservation).
    Now the settle is the tokens used, counted as for any end."""
    stage, state, reached = await _run(redis_prefix, case, ("close",), monkeypatch)
    assert reached == ["close"]
    # a long completion is still being counted in its worker thread when the second cancel comes
    _assert_settled_once(stage, state, case, RESERVED if case == "long_stream" else CASES[case][-1])


@pytest.mark.parametrize("case", list(CASES))
async def test_cancelled_while_the_completion_is_counted_the_request_settles_its_reservation(
    redis_prefix, case, monkeypatch
) -> None:
    """Cancelled while ``finish`` awaits the count of the tokens used (a long completion counted in
    a worker thread): the settle was skipped before the fix. Now the request is settled at once to
    its reservation (docs/quotas.md, "What is charged": the count did not finish; never an
    undercharge), and a cancel landing in the settle's own round trip sends it again, never twice."""
    stage, state, reached = await _run(redis_prefix, case, ("count",), monkeypatch)
    assert reached == ["count"]
    _assert_settled_once(stage, state, case, RESERVED)


@pytest.mark.parametrize("case", list(CASES))
async def test_cancelled_at_the_close_then_at_the_count_the_request_settles_its_reservation(
    redis_prefix, case, monkeypatch
) -> None:
    """Cancelled at both awaits in turn (the close, then the count ``finish`` still runs): one
    settle, to the reservation."""
    stage, state, reached = await _run(redis_prefix, case, ("close", "count"), monkeypatch)
    assert reached == ["close", "count"]
    _assert_settled_once(stage, state, case, RESERVED)


async def test_cancelled_while_a_long_completion_is_counted_in_a_worker_thread(redis_prefix, monkeypatch) -> None:
    """The count's real await, unpatched: a stream without usage whose completion is longer than
    the counter's ``offload_chars`` is counted in a worker thread (``asyncio.to_thread``), and the
    request's task cancelled there (twice) was never settled. Now it is settled to its reservation."""
    stage, state, reached = await _run(redis_prefix, "long_stream", ("thread",), monkeypatch)
    assert reached == ["thread"]
    _assert_settled_once(stage, state, "long_stream", RESERVED)


@pytest.mark.parametrize("case", ["stream", "client_gone_sending"])
async def test_a_count_that_fails_settles_the_reservation(redis_prefix, case, monkeypatch) -> None:
    """A fault in the count of the tokens used (a tokenizer's worker raising what it never should)
    was caught by ``finish`` before it settled: the settle was skipped, the lease renewed for good.
    Now it settles the reservation."""
    stage, state, reached = await _run(redis_prefix, case, (), monkeypatch, count_fault=True)
    assert reached == []
    _assert_settled_once(stage, state, case, RESERVED)


@pytest.mark.parametrize("case", ["whole", "stream", "client_gone_sending", "server_stopping"])
async def test_the_request_is_counted_in_the_metrics_before_its_lease_is_released(
    redis_prefix, case, monkeypatch
) -> None:
    """``finish`` records the metrics just before the settle, with no await between: whoever sees
    the lease released (a test's ledger, a scrape beside a concurrency check) sees the request
    counted. Before, the metrics came after the settle's await, and a reader in another thread
    once saw the lease gone and ``kvgate_prompt_tokens_total`` still 0 (a red CI run)."""
    order: list[str] = []
    record, settle = finish_module.record_metrics, RecordingQuotas.settle

    def recorded(m: Any, outcome: Any) -> None:
        record(m, outcome)
        order.append("metrics")

    async def settled(self: RecordingQuotas, lease: QuotaLease, used_tokens: int) -> None:
        order.append("settle")
        await settle(self, lease, used_tokens)

    monkeypatch.setattr(finish_module, "record_metrics", recorded)
    monkeypatch.setattr(RecordingQuotas, "settle", settled)
    stage, state, _ = await _run(redis_prefix, case, (), monkeypatch)
    assert order == ["metrics", "settle"]
    _assert_settled_once(stage, state, case, CASES[case][-1])


async def test_a_metrics_fault_still_settles_what_the_request_used(redis_prefix, monkeypatch, caplog) -> None:
    """A fault recording the metrics (a registry that raises, as a label the client never should
    reach) is logged, and the lease is settled to the tokens used as for any end."""

    def broken(m: Any, outcome: Any) -> None:
        raise ValueError("a label the registry refuses")

    monkeypatch.setattr(finish_module, "record_metrics", broken)
    stage, state, _ = await _run(redis_prefix, "stream", (), monkeypatch)
    _assert_settled_once(stage, state, "stream", CASES["stream"][-1])
    assert [r.getMessage() for r in caplog.records if r.exc_info and r.name.startswith("kvgate")] == [
        "recording the request's metrics failed"
    ]
