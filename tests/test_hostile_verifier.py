"""Hostile engines, tenants and faults against the verifier package."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from functools import partial

import pytest
from conftest import SEEDS

from config.models import TenantConfig
from tests.fixtures.settings import verifier_settings
from verifier.build import build_verifier
from verifier.shingles import encode
from verifier.stage import Exchange, ExchangeRequest, ResponseWithheld

SEED_PL = (SEEDS / "001_85707760a0179a93.txt").read_text()
SECRETS = {"leak_index_key": b"hostile-test-key", "cache_salt_key": b"x", "admin_key": b"y"}
settings = partial(verifier_settings, latency_min_samples=5, latency_min_prompt_tokens=100)


def tenant(tid: str, **kw) -> TenantConfig:
    return TenantConfig(id=tid, verify_sample_rate=kw.pop("rate", 1.0), **kw)


def ex(t: TenantConfig, prompt: str, *, stream: bool = False) -> Exchange:
    request = ExchangeRequest(
        f"req-{uuid.uuid4().hex[:8]}", t, "up", "m", len(encode(prompt)), stream, time.monotonic()
    )
    return Exchange(request, prompt)


def sse(text: str) -> bytes:
    return b"data: " + json.dumps({"choices": [{"index": 0, "text": text}]}).encode() + b"\n\n"


A = tenant("a")
STRICT = tenant("s", strict_verify=True)
A_PROMPT = SEED_PL[:5000]
LEAK = SEED_PL[2000:2600]


def _worst_leak() -> str:
    """A run of A's prompt that starts right after a kept shingle and has the widest gap to the
    next kept one: its first kept shingle ends only at its 50th token (w + k - 1)."""
    from tokenizer.encodings import bundled_encoding
    from verifier.shingles import ShingleHasher

    ids = encode(A_PROMPT)
    sel = ShingleHasher(SECRETS["leak_index_key"], 16).select(ids, 35)
    _, a = max((b - a, a) for a, b in zip(sel, sel[1:], strict=False))
    return bundled_encoding().decode(ids[a + 1 : a + 90])


async def test_strict_stream_of_single_characters_releases_no_leaked_text(tmp_path):
    """An engine that streams one character per event: the hold-back window must still be
    64 tokens of text, so no character of a leaked run leaves before the cut."""
    svc = build_verifier(settings(tmp_path, strict_holdback_tokens=64), secrets=SECRETS)
    try:
        svc.begin(ex(A, A_PROMPT))
        g = svc.begin(ex(STRICT, "tell me something", stream=True))
        lead = "Here is an answer that talks about many different things for a while. " * 6
        released: list[bytes] = []
        with pytest.raises(ResponseWithheld):
            for ch in lead + _worst_leak():
                released += await g.feed(ch, sse(ch))
        out = "".join(json.loads(r[6:])["choices"][0]["text"] for r in released)
        assert out == lead[: len(out)]  # none of the leaked run (before the fix, its first words left)
        assert 0 < len(out) <= len(lead)  # the lead-in still flows, 64 tokens behind
    finally:
        await svc.aclose()


async def test_unwritable_incident_log_still_quarantines_on_a_honeypot_canary(tmp_path):
    """The incident file cannot be written (disk full, a directory in its place): a honeypot's
    canary in another tenant's answer still quarantines the upstream, is counted and logged."""
    from verifier.canary import new_canary

    (tmp_path / "incidents").mkdir()
    svc = build_verifier(settings(tmp_path), secrets=SECRETS, incident_path=str(tmp_path / "incidents"))
    try:
        can = new_canary()
        svc.begin(ex(tenant("honey", honeypot=True, rate=0.0), f"Remember the code {can}."))
        g = svc.begin(ex(tenant("b"), "what's up"))
        await g.check_body(f"I recall {can} from somewhere.", usage=None, finish_reason="stop", ttft_seconds=None)
        await svc.drain()
        svc.quarantine.refresh()  # the stored state (the view's refresher may have read just before)
        assert svc.is_quarantined("up", 5000) is True
        assert svc.stats["incident_canary"] == 1
        assert svc.stats["job_faults"] == 0
        assert svc.incidents.write_errors == len(svc.incidents.recent) >= 1
        assert [i.detector for i in svc.incidents.recent if i.detector == "canary"] == ["canary"]
    finally:
        await svc.aclose()


async def test_unwritable_incident_log_still_withholds_a_strict_body(tmp_path):
    """A strict answer with another tenant's text is withheld (ResponseWithheld, a 502), not an
    OSError out of the guard (a 500), when the incident file cannot be written."""
    (tmp_path / "incidents").mkdir()
    svc = build_verifier(settings(tmp_path), secrets=SECRETS, incident_path=str(tmp_path / "incidents"))
    try:
        svc.begin(ex(A, A_PROMPT))
        g = svc.begin(ex(STRICT, "hello there"))
        with pytest.raises(ResponseWithheld) as ei:
            await g.check_body("Sure: " + LEAK, usage=None, finish_reason="stop", ttft_seconds=None)
        assert ei.value.detector == "leak_index"
        assert svc.stats["withheld"] == 1 and svc.stats["incident_leak_index"] == 1
    finally:
        await svc.aclose()


#: the longest x-request-id the gateway takes from a client (gateway.routes.handlers.request_id_of)
LONG_RID = "r" * 128


def ex_rid(t: TenantConfig, prompt: str, rid: str) -> Exchange:
    request = ExchangeRequest(rid, t, "up", "m", len(encode(prompt)), False, time.monotonic())
    return Exchange(request, prompt)


async def test_long_client_request_id_does_not_hide_a_honeypot_canary(tmp_path):
    """A tenant that reads another's canary with a 128-character x-request-id (the gateway
    accepts up to 128): the incident is recorded and the upstream quarantined."""
    from verifier.canary import new_canary

    svc = build_verifier(settings(tmp_path), secrets=SECRETS)
    try:
        can = new_canary()
        svc.begin(ex(tenant("honey", honeypot=True, rate=0.0), f"Remember the code {can}."))
        g = svc.begin(ex_rid(tenant("b"), "what's up", LONG_RID))
        await g.check_body(f"I recall {can} from somewhere.", usage=None, finish_reason="stop", ttft_seconds=None)
        await svc.drain()
        assert svc.stats["job_faults"] == 0
        (inc,) = [i for i in svc.incidents.recent if i.detector == "canary"]
        assert (inc.request_id, inc.confirmed, inc.evidence["quarantine"]) == (LONG_RID, True, "kvgate_canary")
        svc.quarantine.refresh()  # the stored state (the view's refresher may have read just before)
        assert svc.is_quarantined("up", 5000) is True
    finally:
        await svc.aclose()


async def test_long_client_request_id_strict_leak_is_withheld(tmp_path):
    """A strict tenant's leaking answer under a 128-character request id is withheld as a
    leak_index incident (ResponseWithheld), not a ValueError out of the guard."""
    svc = build_verifier(settings(tmp_path), secrets=SECRETS)
    try:
        svc.begin(ex(A, A_PROMPT))
        g = svc.begin(ex_rid(STRICT, "hello there", LONG_RID))
        with pytest.raises(ResponseWithheld) as ei:
            await g.check_body("Sure: " + LEAK, usage=None, finish_reason="stop", ttft_seconds=None)
        assert ei.value.detector == "leak_index"
        assert [(i.detector, i.request_id) for i in svc.incidents.recent] == [("leak_index", LONG_RID)]
        assert svc.stats["job_faults"] == 0
    finally:
        await svc.aclose()


async def test_usage_prompt_tokens_at_the_int64_floor_is_a_drift_incident(tmp_path):
    """An engine reporting ``usage.prompt_tokens`` of -2**63 (valid JSON, an int64): a
    usage_drift incident is recorded, with the rest of the tail (finish_abort), no job fault."""
    svc = build_verifier(settings(tmp_path), secrets=SECRETS)
    try:
        g = svc.begin(ex(A, "hello there"))
        await g.check_body("ok", usage={"prompt_tokens": -(2**63)}, finish_reason="abort", ttft_seconds=None)
        await svc.drain()
        assert svc.stats["job_faults"] == 0
        assert [i.detector for i in svc.incidents.recent] == ["usage_drift", "finish_abort"]
        ev = svc.incidents.recent[0].evidence
        assert (ev["engine_prompt_tokens"], ev["gateway_prompt_tokens"]) == (-(2**63), 2)
        assert ev["difference_tokens"] == -(2**63)
        assert svc.incidents.recent[0].to_json()
    finally:
        await svc.aclose()


async def test_strict_checks_text_nested_deep_in_an_unknown_field(tmp_path):
    """An engine that puts another tenant's text 100 levels deep in a field kvgate does not
    know (orjson reads up to 1,024): the strict check reads it and withholds the answer."""
    import orjson

    from verifier.engine_response import parse_body, parse_response_body

    nested: object = LEAK
    for _ in range(100):
        nested = {"k": [nested]}
    body = orjson.loads(
        orjson.dumps({"choices": [{"index": 0, "message": {"role": "assistant", "content": "Sure.", "x": nested}}]})
    )
    out = parse_body(body)
    assert out.fields["0:other"] == LEAK
    resp = parse_response_body({"status": "completed", "output": [{"type": "message", "x": nested}]})
    assert resp.fields["0:other"] == LEAK
    svc = build_verifier(settings(tmp_path), secrets=SECRETS)
    try:
        svc.begin(ex(A, A_PROMPT))
        g = svc.begin(ex(STRICT, "hello there"))
        with pytest.raises(ResponseWithheld) as ei:
            await g.check_body(list(out.fields.values()), usage=None, finish_reason="stop", ttft_seconds=None)
        assert ei.value.detector == "leak_index"
    finally:
        await svc.aclose()


def _tool_pieces(start: int, n: int) -> list[tuple[str, str]]:
    """One character of arguments in each of ``n`` tool calls, numbered from ``start``: every
    one its own text stream (``"0:tool:<j>:arguments"``)."""
    return [(f"0:tool:{j}:arguments", "x") for j in range(start, start + n)]


async def test_strict_stream_of_events_without_text_behind_held_text_is_cut(tmp_path):
    """A hostile engine sends a little text (held back: fewer than 64 tokens behind it), then
    events without text forever (64 KiB each). They queue behind the held text; unbounded, the
    gateway held the whole stream in memory. Past ``strict_max_held_bytes`` the stream is cut as
    oversize, nothing held; text that releases normally keeps the held bytes at what is held."""
    svc = build_verifier(settings(tmp_path, strict_max_held_bytes=1 << 20), secrets=SECRETS)
    try:
        g = svc.begin(ex(STRICT, "hello", stream=True))
        assert await g.feed("Hello", sse("Hello")) == []  # held: no 64 tokens behind it yet
        pad = b": " + b"x" * (64 * 1024 - 3) + b"\n"
        with pytest.raises(ResponseWithheld) as ei:
            for _ in range(100):
                assert await g.feed("", pad) == []
        assert ei.value.detector == "oversize"
        inc = svc.incidents.recent[-1]
        held = len(sse("Hello")) + 16 * len(pad)
        assert (inc.evidence["held_bytes"], inc.evidence["max_held_bytes"]) == (held, 1 << 20)
        assert (len(g._held), g._held_bytes) == (0, 0)

        g = svc.begin(ex(STRICT, "hello", stream=True))
        released = []
        for i in range(300):  # 300 words, one event each: released 64 tokens behind
            released += await g.feed(f" w{i}", sse(f" w{i}"))
            released += await g.feed("", pad[:1024])
        assert len(released) > 400
        assert g._held_bytes == sum(len(raw) for raw, _ in g._held) < 1 << 20
    finally:
        await svc.aclose()


async def test_strict_stream_with_thousands_of_tool_call_streams_is_withheld(tmp_path):
    """An engine that opens a new text stream per character (a tool call index per event, about
    2.6 KB of state each): the strict stream is cut as oversize at 1,024 streams, not kept."""
    from verifier.findings import MAX_TEXT_STREAMS

    svc = build_verifier(settings(tmp_path), secrets=SECRETS)
    try:
        g = svc.begin(ex(STRICT, "call tools", stream=True))
        with pytest.raises(ResponseWithheld) as ei:
            for i in range(0, 5000, 500):
                await g.feed("", b"e", _tool_pieces(i, 500))
        assert ei.value.detector == "oversize"
        assert len(g._streams) == MAX_TEXT_STREAMS == 1024
        inc = svc.incidents.recent[-1]
        assert (inc.evidence["text_streams"], inc.evidence["max_text_streams"]) == (1025, 1024)
    finally:
        await svc.aclose()


async def test_strict_body_with_thousands_of_text_fields_is_withheld(tmp_path):
    """A non-streamed strict answer with 5,000 one-character tool calls: withheld as oversize,
    not 5,000 texts tokenized one by one under the state lock."""
    svc = build_verifier(settings(tmp_path), secrets=SECRETS)
    try:
        g = svc.begin(ex(STRICT, "call tools"))
        with pytest.raises(ResponseWithheld) as ei:
            await g.check_body(["x"] * 5000, usage=None, finish_reason="stop", ttft_seconds=None)
        assert ei.value.detector == "oversize"
        assert svc.incidents.recent[-1].evidence["text_streams"] == 5000
    finally:
        await svc.aclose()


async def test_sampled_stream_with_thousands_of_streams_keeps_them_in_1025_texts(tmp_path):
    """A sampled (background) answer with 5,000 text streams: the first 1,024 are checked each on
    its own, the rest as one text, so the check holds at most 1,025 texts and still sees the leak
    an engine puts in the last of them."""
    svc = build_verifier(settings(tmp_path), secrets=SECRETS)
    try:
        svc.begin(ex(A, A_PROMPT))
        g = svc.begin(ex(tenant("b"), "call tools", stream=True))
        for i in range(0, 5000, 500):
            await g.feed("", b"e", _tool_pieces(i, 500))
        await g.feed("", b"e", [("0:tool:9999:arguments", LEAK)])
        assert len(g._parts) == 1025
        await g.finish_stream(usage=None, finish_reason="stop", ttft_seconds=None)
        assert len(svc.jobs.jobs[-1].texts) == 1025
        await svc.drain()
        assert [i.detector for i in svc.incidents.recent] == ["leak_index"]
    finally:
        await svc.aclose()


def test_quarantine_put_during_a_refresh_is_not_lost_from_the_view(tmp_path):
    """The refresher reads the store, a check quarantines the upstream meanwhile, then the
    refresher installs what it read: the quarantine must stay in the view (it used to vanish
    until the next refresh, and prompts kept reaching the leaking upstream)."""
    import threading

    from verifier.quarantine import FileQuarantineBackend, Quarantine

    class SlowRead(FileQuarantineBackend):
        def __init__(self, d) -> None:
            super().__init__(d)
            self.reading, self.go = threading.Event(), threading.Event()

        def load(self):
            got = super().load()
            if not self.reading.is_set():  # the refresher's read only (put reads the file too)
                self.reading.set()
                assert self.go.wait(5)
            return got

    backend = SlowRead(tmp_path)
    q = Quarantine(backend)
    q.inline_refresh = False
    t = threading.Thread(target=q.refresh)
    t.start()
    assert backend.reading.wait(5)
    q.put("up", "inc_1", "canary", 1024)
    backend.go.set()
    t.join(5)
    assert q.is_quarantined("up", 5000) is True
    q.refresh()  # the next read sees the stored record
    assert sorted(q.records()) == ["up"]
    assert q.clear("up") is True and q.is_quarantined("up", 5000) is False
    q.refresh()
    assert q.records() == {}


class _LoopTicks:
    """Ticks of the event loop every 5 ms while entered (``async with``); :attr:`longest_gap`:
    the longest time between two, seconds (how long something held the loop)."""

    def __init__(self) -> None:
        self.ticks: list[float] = []
        self._task: asyncio.Task[None] | None = None

    async def _tick(self) -> None:
        while True:
            self.ticks.append(time.monotonic())
            await asyncio.sleep(0.005)

    async def __aenter__(self) -> _LoopTicks:
        self._task = asyncio.create_task(self._tick())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()

    @property
    def longest_gap(self) -> float:
        return max(b - a for a, b in zip(self.ticks, self.ticks[1:], strict=False))


async def test_probe_canary_registration_does_not_block_the_event_loop(tmp_path):
    """The periodic probe registers its canaries under the state lock, which the background
    worker holds for whole batches (and the Redis store answers within its timeout): done on the
    event loop, every request stalled meanwhile. It must wait in a thread, and still register."""
    import asyncio
    import inspect
    import threading

    from verifier.canary import new_canary

    svc = build_verifier(settings(tmp_path, probe_interval_seconds=3600), secrets=SECRETS)
    assert svc.prober is not None
    held, done = threading.Event(), threading.Event()

    def busy_worker() -> None:
        with svc.prober.lock:
            held.set()
            time.sleep(1.0)
        done.set()

    threading.Thread(target=busy_worker).start()
    assert held.wait(5)
    async with _LoopTicks() as loop:
        await asyncio.sleep(0.02)
        can = new_canary()
        got = svc.prober.register([can])
        if inspect.isawaitable(got):
            await got
        await asyncio.sleep(0.02)
    assert done.is_set()
    assert loop.longest_gap < 0.5  # it held the lock 1 s
    assert [m.owners for m in svc.canaries.lookup([can])] == [{"kvgate-probe"}]
    await svc.aclose()


async def test_probe_leak_is_recorded_off_the_event_loop(tmp_path, monkeypatch):
    """A leak the periodic probe finds is an incident (a file write) and a quarantine (a Redis
    write with the blocking client when shared): recorded on the event loop, a slow store stalled
    every request. It must be recorded in a thread, and still quarantine the upstream."""
    import asyncio
    import threading

    import verifier.probe as probe_mod
    from verifier.probe import ProbeResult, ProbeTarget

    svc = build_verifier(
        settings(tmp_path, probe_interval_seconds=0.01), secrets=SECRETS, incident_path=str(tmp_path / "incidents")
    )
    assert svc.prober is not None
    target = ProbeTarget("http://127.0.0.1:1/v1", "m", limit=4096, upstream="up")

    async def one_leak(targets, **kw):
        return [(target, ProbeResult("leak", 4096, surfaced=1))]

    monkeypatch.setattr(probe_mod, "run_probe_targets", one_leak)
    put = svc.prober.evidence.quarantine.put
    threads: list[threading.Thread] = []

    def slow_put(*a, **kw):
        threads.append(threading.current_thread())
        time.sleep(0.5)  # a Redis at the end of its timeout
        return put(*a, **kw)

    monkeypatch.setattr(svc.prober.evidence.quarantine, "put", slow_put)
    async with _LoopTicks() as loop:
        probing = asyncio.create_task(svc.prober.loop())
        for _ in range(200):
            await asyncio.sleep(0.01)
            if threads and svc.prober.evidence.quarantine.is_quarantined("up", 5000):
                break
        probing.cancel()
    assert threads and threading.main_thread() not in threads
    assert svc.prober.evidence.quarantine.is_quarantined("up", 5000) is True
    assert loop.longest_gap < 0.25  # the put took 0.5 s
    incidents = [json.loads(line) for line in (tmp_path / "incidents").read_text().splitlines()]
    assert [(i["detector"], i["upstream"], i["confirmed"]) for i in incidents][:1] == [("probe", "up", True)]
    await svc.aclose()


def test_memory_store_add_sweeps_a_bounded_slice_not_the_whole_store():
    """With in-process stores a small prompt is indexed on the event loop; the add that triggers
    the periodic sweep must not walk the whole store (0.33 s per million entries, every 10,000
    adds): each sweep step drops expired entries among at most ``sweep_every`` of them, and
    successive steps still clear everything that expired."""
    from verifier.leak_index import MemoryLeakStore

    clock = [0.0]
    s = MemoryLeakStore(10, clock=lambda: clock[0], sweep_every=1000)
    s.add("a", range(50_000))  # a sweep ran: nothing had expired
    assert len(s) == 50_000
    clock[0] = 100.0  # every entry of "a" expired
    s.add("b", range(10**6, 10**6 + 1000))  # one sweep step
    assert len(s) == 50_000  # 1,000 new entries in, at most 1,000 expired ones out
    for i in range(150):  # a step per add: two passes over the store
        s.add("b", range(2 * 10**6 + 1000 * i, 2 * 10**6 + 1000 * (i + 1)))
    assert len(s) == 151_000  # only "b"'s live entries are left
    assert s.owners([0, 10**6]) == [set(), {"b"}]


def test_queue_per_tenant_counts_survive_the_worker_thread_popping_while_the_loop_appends():
    """The event loop appends checks (no lock) while the worker thread pops them: the per-tenant
    counts behind ``queue_tenant_share`` must come back to nothing, not drift below zero (a
    tenant at -143 jobs holds 143 more than its share of the queue)."""
    import sys
    import threading

    from verifier.jobs import IngestJob, _Jobs

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for _ in range(5):
            q = _Jobs()
            appended = threading.Event()

            def loop_side(q=q, appended=appended) -> None:
                for i in range(5000):
                    q.append(IngestJob("t", "x" * (i % 7 + 1)))
                appended.set()

            def worker_side(q=q, appended=appended) -> None:
                while not appended.is_set() or q:
                    if q:
                        q.popleft()

            threads = [threading.Thread(target=loop_side), threading.Thread(target=worker_side)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            assert (len(q), q.chars, q.held) == (0, 0, {})
    finally:
        sys.setswitchinterval(interval)
