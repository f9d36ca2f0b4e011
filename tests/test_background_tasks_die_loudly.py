"""Background work must not die silently (docs/gateway.md, "Background tasks").

A tokenizer panic (tiktoken's ``pyo3_runtime.PanicException``, a ``BaseException`` that ``except
Exception`` misses) once ended the verifier's worker with no log and no metric. The same way out
existed in every other loop of the gateway: an iteration that raised anything but an
``Exception``, a ``CancelledError`` that was no shutdown's, or an error raised while the fault was
being reported. Each test makes one loop's own call raise that way and shows what a user sees
afterwards:

- the pool watcher: the fault is logged, the pool unknown for that poll (fail closed), and polling
  goes on; a watcher that stops anyway drops its reading at once (503 ``pool_size_unknown``,
  ``/readyz`` naming why), never admitting on its last reading until that is stale;
- the tenants file watcher: the failed read is counted (``kvgate_tenants_reload_failures_total``,
  ``kvgate_tenants_file_valid`` 0) and the next edit, a revoked key, still takes effect;
- the quota stage's lease renewal and its undoing of uncertain reservations: logged, and the
  next round runs (a held lease stays held, an undone reservation frees its tenant's RPM);
- the verifier's periodic probe, quarantine refresher and latency keeper: counted in
  ``kvgate_verifier_job_faults_total{kind}``, logged, and they go on.

Every loop still ends at once when its task is cancelled (the gateway's shutdown)."""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from config.errors import OpenAIError
from config.models import PoolSettings, QuotaSettings, Settings, TenantConfig, UpstreamConfig
from gateway.ops.metrics import GatewayMetrics
from gateway.ops.pool_watcher import PoolReading, PoolWatcher
from gateway.ops.tenant_reload import TenantFileWatcher
from gateway.ops.tenants import TenantRegistry, hash_key
from gateway.quotas.stores import LocalQuotaStore
from gateway.quotas.tenant_quotas import TenantQuotas
from tests.gateway_harness import KEY_A, MODEL, Gateway, chat, settings_for, upstream, wait_for
from tests.mock_engine import MockEngine
from verifier.incidents import REGISTRY as VERIFIER_REGISTRY
from verifier.latency import LatencyKeeper
from verifier.probe import ProbeResult, ProbeTarget
from verifier.prober import PeriodicProbe
from verifier.quarantine import Quarantine, QuarantineRecord

pytestmark = pytest.mark.timeout(60)


class Panic(BaseException):
    """Stands for ``pyo3_runtime.PanicException`` (a ``BaseException``, not an ``Exception``)."""


def records(caplog: pytest.LogCaptureFixture, logger: str) -> list[tuple[str, str, str | None]]:
    """``(level, message, exception type)`` of each record of ``logger``."""
    return [
        (r.levelname, r.getMessage(), r.exc_info[0].__name__ if r.exc_info and r.exc_info[0] else None)
        for r in caplog.records
        if r.name == logger
    ]


def job_faults(kind: str) -> float:
    return VERIFIER_REGISTRY.get_sample_value("kvgate_verifier_job_faults_total", {"kind": kind}) or 0.0


async def first_of(task: asyncio.Task, event: asyncio.Event) -> None:
    """Wait until ``event`` is set or ``task`` ends (a loop that died), whichever comes first."""
    waiter = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait({task, waiter}, timeout=10, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()


async def cancelled_at_shutdown(task: asyncio.Task) -> None:
    """The shutdown's cancel still ends the loop: the ``CancelledError`` is never swallowed."""
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


# ---------------------------------------------------------------------- pool watcher
def _watcher(on_update: Callable[[int | None, int | None], None]) -> PoolWatcher:
    up = UpstreamConfig(
        name="u1",
        api_url="http://127.0.0.1:1/v1",
        pool_source="sglang",
        pool_urls=["http://n/server_info"],
        models=[MODEL],
    )
    settings = PoolSettings(poll_interval_seconds=0.05, max_staleness_seconds=30, request_timeout_seconds=1)
    return PoolWatcher(up, settings, httpx.AsyncClient(), 8192, on_update=on_update)


@pytest.mark.parametrize("fault", [Panic("regex stack overflow"), asyncio.CancelledError()], ids=["panic", "stray"])
async def test_a_poll_that_panics_is_logged_fails_closed_and_polling_goes_on(
    fault: BaseException, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A poll that raises a ``BaseException`` (or a ``CancelledError`` no ``cancel()`` asked for)
    ended the watcher's task: no log, the gauges at their last values, and the gate admitting on
    the last reading until it was stale, then 503 forever with no error named. Now it is one
    failed poll: logged with its traceback, the pool unknown, and the next poll reads it again."""
    monkeypatch.setattr("gateway.ops.pool_watcher.RETRY_FIRST_DELAY_SECONDS", 0.01)
    seen: list[tuple[int | None, int | None, str | None]] = []
    known = asyncio.Event()

    def on_update(pool: int | None, limit: int | None) -> None:
        seen.append((pool, limit, w.last_error))
        if limit is not None:
            known.set()

    w = _watcher(on_update)
    seen.clear()  # the gauges' first setting, at construction
    polls = 0

    async def read_all() -> PoolReading:
        nonlocal polls
        polls += 1
        if polls == 1:
            raise fault
        return PoolReading(4096, 3276, w.clock(), {"n": 3276}, {"n": (4096,)}, {"n": "/server_info"})

    monkeypatch.setattr(w, "_read_all", read_all)
    caplog.set_level(logging.INFO, "kvgate.pool")
    w.start()
    task = w._task
    assert task is not None
    await first_of(task, known)
    assert not task.done()
    name = type(fault).__name__
    assert seen[:2] == [(None, None, f"poll failed: {name}"), (4096, 3276, None)]
    assert records(caplog, "kvgate.pool") == [("ERROR", "pool poll of u1 failed", name)]
    assert (w.limit_now(), w.status()["known"], w.status()["error"]) == (3276, True, None)
    await w.stop()
    assert task.cancelled()  # the shutdown's cancel still ends it
    assert records(caplog, "kvgate.pool") == [("ERROR", "pool poll of u1 failed", name)]
    await w.client.aclose()


class _RaiseOnce(logging.Filter):
    """A log filter that raises once: the fault's own report fails (a broken handler or filter)."""

    def __init__(self) -> None:
        super().__init__()
        self.raised = False

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.raised:
            self.raised = True
            raise RuntimeError("the log sink is down")
        return True


def test_a_watcher_that_stops_anyway_refuses_at_once_and_says_why(caplog: pytest.LogCaptureFixture) -> None:
    """The watcher's task ends anyway (here: a panicking poll whose log line raises): the gate
    drops its reading at once (503 ``pool_size_unknown``, ``/readyz`` 503 naming the stop, the
    gauges -1) instead of admitting on the last reading until ``max_staleness_seconds`` and then
    refusing with no error named."""
    engine = MockEngine().start()
    g = Gateway(settings_for([upstream("u1", engine)])).start()
    pool_log = logging.getLogger("kvgate.pool")
    broken = _RaiseOnce()
    caplog.set_level(logging.INFO, "kvgate.pool")
    try:
        client = g.client(KEY_A)
        first = client.post("/v1/chat/completions", json=chat())
        assert first.status_code == 200, first.text
        watcher = g.gw.upstreams.all[0].watcher
        task = watcher._task
        assert task is not None

        async def panics() -> PoolReading:
            raise Panic("regex stack overflow")

        pool_log.addFilter(broken)
        watcher._read_all = panics  # type: ignore[method-assign]
        assert wait_for(task.done, timeout=10)
        r = client.post("/v1/chat/completions", json=chat())
        assert (r.status_code, r.headers.get("retry-after"), r.json()) == (
            503,
            "1",
            {
                "error": {
                    "message": f"The live KV pool size of the engines serving '{MODEL}' is unknown or stale; "
                    "refusing rather than risking a silent rejection. Retry shortly.",
                    "type": "server_error",
                    "param": None,
                    "code": "pool_size_unknown",
                }
            },
        )
        ready = client.get("/readyz")
        (up,) = ready.json()["upstreams"]
        assert (ready.status_code, up["known"], up["limit_tokens"], up["error"]) == (
            503,
            False,
            None,
            "pool watcher stopped: RuntimeError",
        )
        assert g.gw.metrics.registry.get_sample_value("kvgate_effective_limit_tokens", {"upstream": "u1"}) == -1.0
        assert broken.raised
        assert records(caplog, "kvgate.pool") == [
            (
                "ERROR",
                "pool watcher of upstream u1 stopped (RuntimeError): its pool is unknown, and requests for it "
                "are refused (503 pool_size_unknown), until the gateway restarts",
                "RuntimeError",
            )
        ]
    finally:
        pool_log.removeFilter(broken)
        g.stop()
        engine.stop()


# ---------------------------------------------------------------------- tenants file watcher
def _write(path: Path, key: str) -> None:
    path.write_text(yaml.safe_dump({"tenants": [{"id": "acme", "api_key_sha256": [hash_key(key)], "rpm": 5}]}))


@pytest.mark.parametrize("fault", [Panic("yaml"), TypeError("a bug")], ids=["panic", "bug_and_broken_log"])
def test_a_reload_that_raises_is_counted_and_the_next_edit_still_revokes_the_key(
    fault: BaseException, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reload that raised a ``BaseException`` ended the reload thread (a traceback on stderr,
    nothing in the log or the metrics): every later edit of the file was ignored, so a key revoked
    afterwards stayed valid until a restart, while ``kvgate_tenants_file_valid`` said 1. An
    ``Exception`` outside the expected ones was logged but not counted, and its log line raising
    (a broken filter) ended the thread too. Now the failed read is counted and the thread goes on."""
    p = tmp_path / "tenants.yaml"
    _write(p, "sk-one")
    reg = TenantRegistry.from_path(p)
    m = GatewayMetrics()
    told: list[tuple[bool, str | None]] = []

    def on_result(ok: bool) -> None:
        m.tenant_reloaded(ok)
        told.append((ok, w.last_error))

    w = TenantFileWatcher(reg, interval_seconds=0, on_result=on_result)
    real = reg.reload
    tries = 0

    def reload(*args: Any, **kwargs: Any) -> None:
        nonlocal tries
        tries += 1
        if tries == 1:
            _write(p, "sk-two")  # the operator revokes sk-one, and sends SIGHUP
            w.poke()
            raise fault
        real(*args, **kwargs)
        w._stop.set()  # the test's end: the thread's loop returns

    monkeypatch.setattr(reg, "reload", reload)
    broken = _RaiseOnce()
    tenants_log = logging.getLogger("kvgate.tenants")
    if isinstance(fault, Exception):
        tenants_log.addFilter(broken)  # the fault's own log line raises
    caplog.set_level(logging.INFO, "kvgate.tenants")
    w.poke()
    try:
        w._run()  # the reload thread's body, in this thread: it returns once the second reload is in
    finally:
        tenants_log.removeFilter(broken)
    name = type(fault).__name__
    assert (tries, reg.lookup("sk-one"), reg.lookup("sk-two").id, w.reloads, w.last_error) == (
        2,
        None,
        "acme",
        1,
        None,
    )
    assert told == [(False, f"{p}: reading it failed ({name})"), (True, None)]
    assert (
        m.registry.get_sample_value("kvgate_tenants_file_valid"),
        m.registry.get_sample_value("kvgate_tenants_reload_failures_total"),
    ) == (1.0, 1.0)
    failed = ("ERROR", f"reading tenants file {p} failed ({name}); the previous tenants stay in force", name)
    reloaded = ("INFO", f"tenants reloaded from {p}: 1 tenant(s)", None)
    assert records(caplog, "kvgate.tenants") == ([reloaded] if isinstance(fault, Exception) else [failed, reloaded])


# ---------------------------------------------------------------------- quota stage
def _quotas(clock: Callable[[], float], ttl_seconds: float = 0.3) -> tuple[TenantQuotas, LocalQuotaStore]:
    store = LocalQuotaStore(clock=clock)
    return TenantQuotas(QuotaSettings(lease_ttl_seconds=ttl_seconds), store, fallback=store), store


async def test_a_lease_renewal_that_panics_is_logged_and_the_lease_stays_held(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A renewal round that raised a ``BaseException`` ended the renewer with no log; no request
    began after it, so no new one started: the leases in flight expired by their TTL while their
    requests ran, and the tenant's ``max_concurrent`` admitted one more (fail open). Now the round
    is logged and the next renews them."""
    now = [0.0]
    q, store = _quotas(lambda: now[0])
    tenant = TenantConfig(id="acme", max_concurrent=1)
    real = store.renew
    renewals = 0
    renewed = asyncio.Event()

    async def renew(tenant_id: str, lease_ids: list[str], ttl_ms: int) -> int:
        nonlocal renewals
        renewals += 1
        if renewals == 1:
            now[0] = 250.0  # the lease (TTL 300 ms) is near its end
            raise Panic("a C extension's panic")
        n = await real(tenant_id, lease_ids, ttl_ms)
        renewed.set()
        return n

    monkeypatch.setattr(store, "renew", renew)
    caplog.set_level(logging.INFO, "kvgate.quotas")
    lease = await q.begin(tenant, "r1")
    renewer = q._renewer
    assert renewer is not None
    await first_of(renewer, renewed)
    now[0] = 400.0  # past the lease's first TTL: only a renewal keeps it held
    with pytest.raises(OpenAIError) as refused:
        await q.begin(tenant, "r2")
    assert (refused.value.status, refused.value.code, refused.value.message) == (
        429,
        "rate_limit_exceeded",
        "Rate limit reached for tenant 'acme' on concurrent requests: Limit 1. Please try again in 1s.",
    )
    assert not renewer.done()
    assert records(caplog, "kvgate.quotas") == [("ERROR", "quota lease renewal failed", "Panic")]
    await cancelled_at_shutdown(renewer)
    await q.settle(lease, 0)
    await q.aclose()


async def test_an_undo_round_that_panics_is_logged_and_the_next_round_sends_the_undo(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A round of undoing uncertain reservations that raised a ``BaseException`` ended the
    background recoverer with no log, and nothing started it again until the store next failed:
    the reservation Redis may have run stayed counted (the tenant refused 429 until its window
    ended), the leases of settles left over held until their TTL. Now the round is logged and the
    next one sends the undo (``cancel.lua``; here the in-process store's, which records it)."""
    now = [0.0]
    q, store = _quotas(lambda: now[0])
    tenant = TenantConfig(id="acme", rpm=1)
    real = q._cancel_uncertain
    rounds = 0
    undone: list[tuple[str, list[str], bool]] = []

    async def cancel_uncertain(*args: Any, **kwargs: Any) -> None:
        nonlocal rounds
        rounds += 1
        if rounds == 1:
            raise Panic("a C extension's panic")
        await real(*args, **kwargs)

    async def cancel(tenant_id: str, lease_ids: list[str], *, keep_rpm: bool = False) -> int:
        undone.append((tenant_id, list(lease_ids), keep_rpm))
        return len(lease_ids)

    monkeypatch.setattr(q, "_cancel_uncertain", cancel_uncertain)
    monkeypatch.setattr(store, "cancel", cancel)
    caplog.set_level(logging.INFO, "kvgate.quotas")
    lease = await q.begin(tenant, "r1")
    lease_id = lease.state.lease_id
    q._undo_later("acme", lease_id)  # its caller was cancelled while its call was out: Redis may have run it
    recoverer = q._recoverer
    assert recoverer is not None
    await asyncio.wait({recoverer}, timeout=10)
    assert recoverer.done() and recoverer.exception() is None  # it ends once the backlog is empty
    assert (rounds, undone, len(q._uncertain)) == (2, [("acme", [lease_id], False)], 0)
    assert records(caplog, "kvgate.quotas") == [
        ("ERROR", "undoing uncertain quota reservations failed", "Panic"),
        ("WARNING", "quota store local: undid 1 reservation(s) it ran after their call had timed out", None),
    ]
    await q.aclose()


# ---------------------------------------------------------------------- verifier's periodic tasks
class _Evidence:
    """The probe's incident sink: ``record`` raises ``fault`` on its first call when given."""

    def __init__(self, fault: BaseException | None, done: asyncio.Event, loop: asyncio.AbstractEventLoop) -> None:
        self.fault = fault
        self.done, self.loop = done, loop
        self.recorded: list[str] = []

    def record(self, incidents: list) -> None:  # called in a worker thread
        if self.fault is not None:
            fault, self.fault = self.fault, None
            raise fault
        self.recorded += [i.detector for i in incidents]
        self.loop.call_soon_threadsafe(self.done.set)


@pytest.mark.parametrize(
    ("where", "fault"),
    [("run", Panic("probe")), ("record", Panic("store")), ("record", OSError(28, "No space left on device"))],
    ids=["run_panics", "record_panics", "record_fails"],
)
async def test_a_probe_round_that_raises_is_counted_and_the_probe_goes_on(
    where: str, fault: BaseException, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The periodic canary probe ended for good, unlogged and uncounted, when a round raised a
    ``BaseException`` or when recording its leak incident raised at all (its quarantine store or
    incident file): no upstream was probed again until a restart. Now it is that round's fault."""
    settings = Settings.model_validate({"verifier": {"probe_interval_seconds": 0.01}})
    done = asyncio.Event()
    stats: collections.Counter = collections.Counter()
    evidence = _Evidence(fault if where == "record" else None, done, asyncio.get_running_loop())
    target = ProbeTarget("http://127.0.0.1:1/v1", upstream="u1")
    probe = PeriodicProbe(settings, [target], None, evidence, threading.Lock(), stats)  # type: ignore[arg-type]
    runs = 0

    async def run_probe_targets(targets: list, **_: Any) -> list:
        nonlocal runs
        runs += 1
        if where == "run" and runs == 1:
            raise fault
        return [(t, ProbeResult("leak", 4096, surfaced=1)) for t in targets]

    monkeypatch.setattr("verifier.probe.run_probe_targets", run_probe_targets)
    caplog.set_level(logging.INFO, "kvgate.verifier")
    before = job_faults("probe")
    task = asyncio.ensure_future(probe.loop())
    await first_of(task, done)
    assert not task.done()
    await cancelled_at_shutdown(task)
    assert evidence.recorded[0] == "probe"
    assert (job_faults("probe") - before, stats["job_faults"]) == (1.0, 1)
    name = type(fault).__name__
    faults = [r for r in records(caplog, "kvgate.verifier") if r[0] == "ERROR"]
    assert faults == [("ERROR", f"verifier job fault (probe): {name}", name)]


class _Backend:
    """A quarantine store whose first read panics; later reads hold ``up1``'s quarantine. ``done``
    is set by the third read: the second's view is in place by then (one read after the other)."""

    def __init__(self, done: asyncio.Event, loop: asyncio.AbstractEventLoop) -> None:
        self.reads = 0
        self.done, self.loop = done, loop

    def load(self) -> dict[str, QuarantineRecord]:
        self.reads += 1
        if self.reads == 1:
            raise Panic("the store's client panicked")
        if self.reads == 3:
            self.loop.call_soon_threadsafe(self.done.set)
        return {"up1": QuarantineRecord("up1", "inc_1", "probe", 1024, 0.0)}


async def test_a_quarantine_read_that_panics_is_counted_and_refreshing_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The quarantine refresher ended on a read that raised a ``BaseException``: no log, no count,
    and every request from then on re-read the store on the event loop (the inline mode the loop
    restores when it ends). Now the read is counted and the refresher goes on, off the loop."""
    done = asyncio.Event()
    q = Quarantine(_Backend(done, asyncio.get_running_loop()), refresh_seconds=0.01)
    q.inline_refresh = False  # as a serving gateway runs it
    caplog.set_level(logging.INFO, "kvgate.verifier")
    before = job_faults("quarantine_refresh")
    task = asyncio.ensure_future(q.refresh_loop())
    await first_of(task, done)
    assert not task.done()
    assert (q.inline_refresh, q.is_quarantined("up1", 5000), q.is_quarantined("up1", 1024)) == (False, True, False)
    assert job_faults("quarantine_refresh") - before == 1.0
    assert records(caplog, "kvgate.verifier") == [("ERROR", "verifier job fault (quarantine_refresh): Panic", "Panic")]
    await cancelled_at_shutdown(task)
    assert q.inline_refresh  # stopped: the CLI-style inline mode is back


class _FailingBackend:
    """A quarantine store whose first ``panics`` reads panic; ``done`` is set by the read after."""

    def __init__(self, panics: int, done: asyncio.Event, loop: asyncio.AbstractEventLoop) -> None:
        self.reads, self.panics = 0, panics
        self.done, self.loop = done, loop

    def load(self) -> dict[str, QuarantineRecord]:
        self.reads += 1
        if self.reads <= self.panics:
            raise Panic("the store's client panicked")
        self.loop.call_soon_threadsafe(self.done.set)
        return {}


async def test_a_quarantine_read_that_keeps_panicking_is_counted_each_round_and_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The refresher's rounds come every ``refresh_seconds`` (1 s by default); a panic that
    persisted logged a traceback each round. Each is counted; the log has one line a minute."""
    done = asyncio.Event()
    q = Quarantine(_FailingBackend(5, done, asyncio.get_running_loop()), refresh_seconds=0.01)
    q.inline_refresh = False
    caplog.set_level(logging.INFO, "kvgate.verifier")
    before = job_faults("quarantine_refresh")
    task = asyncio.ensure_future(q.refresh_loop())
    await first_of(task, done)
    assert job_faults("quarantine_refresh") - before == 5.0
    assert records(caplog, "kvgate.verifier") == [("ERROR", "verifier job fault (quarantine_refresh): Panic", "Panic")]
    await cancelled_at_shutdown(task)


class _LatencyStore:
    """A latency store whose first save panics."""

    def __init__(self, done: asyncio.Event, loop: asyncio.AbstractEventLoop) -> None:
        self.saves = 0
        self.done, self.loop = done, loop

    def load(self) -> list:
        return []

    def save(self, samples: list) -> None:
        self.saves += 1
        if self.saves == 1:
            raise Panic("the store's client panicked")
        self.loop.call_soon_threadsafe(self.done.set)


class _Model:
    def take_unsaved(self) -> list:
        return []

    def replay(self, samples: list) -> int:
        return 0


async def test_a_latency_save_that_panics_is_counted_and_saving_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    """The latency keeper ended on a save that raised a ``BaseException``: this replica's TTFT
    samples reached the shared store only at shutdown. Now the save is counted and the next one
    runs."""
    done = asyncio.Event()
    stats: collections.Counter = collections.Counter()
    store = _LatencyStore(done, asyncio.get_running_loop())
    keeper = LatencyKeeper(_Model(), store, threading.Lock(), stats)  # type: ignore[arg-type]
    keeper.SAVE_SECONDS = 0.01
    caplog.set_level(logging.INFO, "kvgate.verifier")
    before = job_faults("latency")
    task = asyncio.ensure_future(keeper.loop())
    await first_of(task, done)
    assert not task.done()
    assert (store.saves >= 2, job_faults("latency") - before, stats["job_faults"]) == (True, 1.0, 1)
    assert records(caplog, "kvgate.verifier") == [("ERROR", "verifier job fault (latency): Panic", "Panic")]
    await cancelled_at_shutdown(task)


# ---------------------------------------------------------------------- already handled
async def test_an_offloaded_job_that_panics_reaches_its_caller_and_frees_the_tenants_share() -> None:
    """The offload executor (``gateway/edge/offload.py``) hands any ``BaseException`` of a job to
    the task awaiting it and passes the tenant's share on, so a panicking count is that request's
    error (the tokenizer guard turns it into a 400) and never holds the share: the next job runs."""
    from gateway.edge import offload

    offload.install(asyncio.get_running_loop(), threads=2, share=1, cores=1)
    offload.set_tenant("t")

    def panics() -> None:
        raise Panic("regex stack overflow")

    with pytest.raises(Panic):
        await asyncio.to_thread(panics)
    assert await asyncio.to_thread(lambda: "next") == "next"


# ---------------------------------------------------------------------- the shared round guard
async def test_one_round_hands_a_fault_on_and_lets_a_stop_through() -> None:
    """``config.background.one_round``, which every loop above runs its rounds in: a panic and a
    ``CancelledError`` nobody asked for go to the fault handler and no further; a cancel of the
    task itself and ``KeyboardInterrupt`` end the loop."""
    from config.background import one_round

    faults: list[str] = []

    def fault(e: BaseException) -> None:
        faults.append(type(e).__name__)

    for raised in (Panic("regex stack overflow"), asyncio.CancelledError(), ValueError("x")):
        with one_round(fault):
            raise raised
    assert faults == ["Panic", "CancelledError", "ValueError"]
    with pytest.raises(KeyboardInterrupt), one_round(fault):
        raise KeyboardInterrupt
    started = asyncio.Event()

    async def loop() -> None:
        while True:
            with one_round(fault):
                started.set()
                await asyncio.sleep(3600)

    task = asyncio.ensure_future(loop())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert faults == ["Panic", "CancelledError", "ValueError"]


def test_a_fault_that_persists_in_a_fast_loop_is_one_line_a_minute(caplog: pytest.LogCaptureFixture) -> None:
    """The quota stage's undo rounds run every 0.1 s while a backlog waits: a fault that came back
    every round logged ten tracebacks a second. ``config.background.FaultLog`` logs a new kind of
    fault at once, the same one again once a minute with how many came between, also when two
    kinds take turns."""
    from config.background import FaultLog, Repeats

    now = [0.0]
    repeats = Repeats(clock=lambda: now[0])
    faults = FaultLog(logging.getLogger("kvgate.quotas"), "undoing uncertain quota reservations", repeats)
    caplog.set_level(logging.INFO, "kvgate.quotas")
    for i in range(1201):  # two minutes of rounds, 0.1 s apart
        now[0] = i / 10
        faults(Panic("regex stack overflow") if i != 700 else OSError("disk"))
    assert repeats.faults == 1201
    assert records(caplog, "kvgate.quotas") == [
        ("ERROR", "undoing uncertain quota reservations failed", "Panic"),
        ("ERROR", "undoing uncertain quota reservations failed (599 more like it since the last report)", "Panic"),
        ("ERROR", "undoing uncertain quota reservations failed", "OSError"),
        ("ERROR", "undoing uncertain quota reservations failed (598 more like it since the last report)", "Panic"),
    ]
    caplog.clear()
    for i in range(1200):  # a flapping store: two kinds of fault taking turns
        now[0] = 200 + i / 10
        faults(ConnectionRefusedError() if i % 2 else TimeoutError())
    failed, again = "undoing uncertain quota reservations failed", " (299 more like it since the last report)"
    assert records(caplog, "kvgate.quotas") == [
        ("ERROR", failed, "TimeoutError"),
        ("ERROR", failed, "ConnectionRefusedError"),
        ("ERROR", failed + again, "TimeoutError"),
        ("ERROR", failed + again, "ConnectionRefusedError"),
    ]


def test_a_verifier_round_fault_that_persists_is_counted_each_time_and_logged_once_a_minute(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The latency keeper saves every second: a save that panicked every round logged a traceback
    a second. Each fault still counts in ``kvgate_verifier_job_faults_total``; the log says it
    once a minute, with how many came since."""
    from config.background import Repeats
    from verifier.incidents import RoundFaults

    now = [0.0]
    repeats = Repeats(clock=lambda: now[0])
    stats: collections.Counter = collections.Counter()
    faults = RoundFaults("latency", stats, repeats)
    caplog.set_level(logging.INFO, "kvgate.verifier")
    before = job_faults("latency")
    for second in range(121):
        now[0] = float(second)
        faults(Panic("regex stack overflow"))
    assert (job_faults("latency") - before, stats["job_faults"]) == (121.0, 121)
    assert records(caplog, "kvgate.verifier") == [
        ("ERROR", "verifier job fault (latency): Panic", "Panic"),
        ("ERROR", "verifier job fault (latency): Panic (59 more like it since the last report)", "Panic"),
        ("ERROR", "verifier job fault (latency): Panic (59 more like it since the last report)", "Panic"),
    ]
