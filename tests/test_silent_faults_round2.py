"""Faults that were silent (second round): each test shows what an operator now sees.

- A quarantine store that cannot be read keeps this replica's last view (a flapping store must
  not lift a quarantine), but quarantines other replicas set meanwhile are not seen here: every
  failed read counts in ``kvgate_verifier_job_faults_total{kind="quarantine_refresh"}``, and the
  first failed read of an outage and the first read that works again are logged, once each.
- A step of the gateway's start that raised was dropped (``gather(return_exceptions=True)``): a
  warm-up that failed left the gateway ready with no log; a stage start or a pool poll that
  raised left no trace. Each is now logged; a failed warm-up fails ``/readyz`` and is tried
  again (back-off) until it works.
- A worker the supervisor could not restart (its fork failing: ``EAGAIN``) was reported as
  ``cannot bind host:port``; it now names the worker and the fork's error. One failed fork of a
  restart no longer SIGKILLs the healthy workers: it is tried again (back-off, counted in the
  restart budget) while they serve, and a budget spent drains them. A first start that fails
  drains the workers started before it.
"""

from __future__ import annotations

import argparse
import errno
import logging
import signal
import subprocess
import time
from collections.abc import Callable
from typing import Any

import pytest

from gateway.commands import serve
from gateway.edge import workers
from gateway.ops.pool_watcher import PoolReading
from tests.gateway_harness import Gateway, settings_for, upstream, wait_for
from tests.mock_engine import MockEngine
from tests.test_background_tasks_die_loudly import Panic, job_faults, records
from verifier.quarantine import Quarantine, QuarantineRecord
from verifier.stage import NullVerifier

pytestmark = pytest.mark.timeout(60)


# ---------------------------------------------------------------------- 1. quarantine refresh
def _rec(upstream_name: str) -> QuarantineRecord:
    return QuarantineRecord(upstream_name, "inc_1", "probe", 1024, 0.0)


class _FlakyStore:
    """A quarantine store that answers ``view`` while ``down`` is false, else refuses."""

    def __init__(self) -> None:
        self.down = False
        self.view: dict[str, QuarantineRecord] = {"up1": _rec("up1")}

    def load(self) -> dict[str, QuarantineRecord]:
        if self.down:
            raise ConnectionError("Error 111 connecting to redis:6379. Connection refused.")
        return dict(self.view)


def test_a_store_that_cannot_be_read_keeps_the_view_and_says_so_once(caplog: pytest.LogCaptureFixture) -> None:
    """While the store was down, the replica kept its last view (right) and said nothing: a
    quarantine another replica set (``up2``, an upstream found leaking tenants' text) was not seen
    here, with no log line and no count. Now every failed read counts, and the outage is logged
    when it begins and when it ends, not once a round."""
    store = _FlakyStore()
    q = Quarantine(store, refresh_seconds=1.0)
    caplog.set_level(logging.INFO, "kvgate.verifier")
    before = job_faults("quarantine_refresh")
    q.refresh()
    store.down = True
    store.view["up2"] = _rec("up2")  # another replica quarantines up2 while this one cannot read
    for _ in range(3):
        q.refresh()
        assert (q.is_quarantined("up1", 5000), q.is_quarantined("up2", 5000)) == (True, False)  # the last view
    assert job_faults("quarantine_refresh") - before == 3.0
    failing = (
        "ERROR",
        "quarantine view not refreshed: reading the store failed (ConnectionError: Error 111 connecting to "
        "redis:6379. Connection refused.); the last view stays (1 upstream(s) quarantined), and quarantines set "
        "elsewhere are not seen here until a read works",
        None,
    )
    assert records(caplog, "kvgate.verifier") == [failing]
    store.down = False
    q.refresh()
    q.refresh()
    assert (q.is_quarantined("up1", 5000), q.is_quarantined("up2", 5000), q.failed_reads) == (True, True, 0)
    recovered = ("WARNING", "quarantine view refreshed again after 3 failed read(s): 2 upstream(s) quarantined", None)
    assert records(caplog, "kvgate.verifier") == [failing, recovered]
    assert job_faults("quarantine_refresh") - before == 3.0
    store.down = True  # a second outage is news again
    q.refresh()
    assert records(caplog, "kvgate.verifier")[2][1].startswith("quarantine view not refreshed: ")
    assert (len(caplog.records), job_faults("quarantine_refresh") - before) == (3, 4.0)


# ---------------------------------------------------------------------- 2. the gateway's start
class _Verifier(NullVerifier):
    """A verifier stage whose warm-up (the shingle encoder) fails."""

    def warm_up(self) -> None:
        raise RuntimeError("cl100k_base: the bundled encoding is missing")

    def health(self) -> dict[str, bool]:
        return {"verifier_worker": True}


class _Quotas:
    """A quota stage whose ``async start()`` panics (what its own handler does not catch)."""

    async def start(self) -> None:
        raise Panic("redis client panicked")


def test_a_warm_up_that_fails_at_start_fails_readyz_and_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    """The verifier's warm-up raised in the start's ``gather(return_exceptions=True)``: dropped,
    the gateway ready, nothing logged, while every sampled response's check would fault."""
    engine = MockEngine().start()
    caplog.set_level(logging.INFO, "kvgate.app")
    g = Gateway(settings_for([upstream("u1", engine)]), verifier=_Verifier()).start()
    try:
        ready = g.client(None).get("/readyz")
        assert (ready.status_code, ready.json()["status"], ready.json()["checks"]) == (
            503,
            "not_ready",
            {"verifier_worker": True, "warm_up": False},
        )
        assert [r for r in records(caplog, "kvgate.app") if r[0] != "INFO"] == [
            (
                "ERROR",
                "warm-up failed at start (RuntimeError); a model's counter or the verifier's shingle encoder is not "
                "built; /readyz fails until a later try succeeds",
                "RuntimeError",
            )
        ]
    finally:
        g.stop()
        engine.stop()


class _FlakyVerifier(_Verifier):
    """A verifier stage whose warm-up fails ``fails`` times (the first two alike, then another
    fault), then succeeds."""

    def __init__(self, fails: int) -> None:
        self.tries = 0
        self.fails = fails

    def warm_up(self) -> None:
        self.tries += 1
        if self.tries <= self.fails:
            raise (RuntimeError if self.tries <= 2 else MemoryError)("encoder not built")


def test_a_warm_up_that_fails_at_start_is_tried_again_until_it_works(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A failed warm-up left ``/readyz`` failing until a restart, while ``/livez`` passed: a fault
    that had passed (a panic under memory pressure, a volume mounted late) kept the replica out of
    service until someone restarted it by hand. It is tried again with a back-off; the replica is
    ready once a try works, each failed try logged (its traceback only for a fault not seen just
    before) and the fault named in ``/readyz`` meanwhile."""
    from gateway import app

    monkeypatch.setattr(app, "WARM_UP_RETRY_FIRST_SECONDS", 0.05)
    engine = MockEngine().start()
    caplog.set_level(logging.INFO, "kvgate.app")
    verifier = _FlakyVerifier(fails=3)
    g = Gateway(settings_for([upstream("u1", engine)]), verifier=verifier).start()
    try:
        client = g.client(None)
        assert wait_for(lambda: client.get("/readyz").status_code == 200, timeout=10)
        assert client.get("/readyz").json()["checks"] == {"verifier_worker": True}
        assert verifier.tries == 4
        assert [r for r in records(caplog, "kvgate.app") if r[0] != "INFO"] == [
            (
                "ERROR",
                "warm-up failed at start (RuntimeError); a model's counter or the verifier's shingle encoder is not "
                "built; /readyz fails until a later try succeeds",
                "RuntimeError",
            ),
            ("WARNING", "warm-up failed again (RuntimeError); /readyz keeps failing, next try in 0.1 s", None),
            ("WARNING", "warm-up failed again (MemoryError); /readyz keeps failing, next try in 0.2 s", "MemoryError"),
            ("WARNING", "warm-up succeeded on a later try (it failed with MemoryError); /readyz passes again", None),
        ]
    finally:
        g.stop()
        engine.stop()


def test_a_warm_up_still_failing_names_its_fault_and_stops_with_the_gateway(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """While the tries keep failing ``/readyz`` names the last fault; stopping the gateway ends them."""
    from gateway import app

    monkeypatch.setattr(app, "WARM_UP_RETRY_FIRST_SECONDS", 0.02)
    engine = MockEngine().start()
    verifier = _FlakyVerifier(fails=10**9)
    g = Gateway(settings_for([upstream("u1", engine)]), verifier=verifier).start()
    try:
        client = g.client(None)
        assert wait_for(lambda: verifier.tries >= 3, timeout=10)
        ready = client.get("/readyz")
        assert (ready.status_code, ready.json()["checks"]) == (503, {"verifier_worker": True, "warm_up": False})
        assert g.gw.start_faults == {"warm_up": "MemoryError"}
    finally:
        g.stop()
        engine.stop()
    tries = verifier.tries
    time.sleep(0.3)
    assert verifier.tries == tries


def test_a_stage_start_or_a_pool_poll_that_raises_at_start_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    """A quota stage's start that panics and a first pool poll that panics were dropped with no
    trace. Both are logged now; the quota stage degrades (its failure policy), the pool is unknown
    until its watcher reads it, and then the gateway is ready."""
    engine = MockEngine().start()
    caplog.set_level(logging.INFO, "kvgate.app")
    g = Gateway(settings_for([upstream("u1", engine)]), quotas=_Quotas())
    watcher = g.gw.upstreams.all[0].watcher
    read_all = watcher._read_all
    polls = 0

    async def first_panics() -> PoolReading:
        nonlocal polls
        polls += 1
        if polls == 1:
            raise Panic("regex stack overflow")
        return await read_all()

    watcher._read_all = first_panics  # type: ignore[method-assign]
    g.start()
    try:
        client = g.client(None)
        assert wait_for(lambda: client.get("/readyz").status_code == 200, timeout=10)
        assert [r for r in records(caplog, "kvgate.app") if r[0] != "INFO"] == [
            (
                "ERROR",
                "pool poll of upstream u1 failed at start (Panic); its pool is unknown until its watcher reads it",
                "Panic",
            ),
            (
                "ERROR",
                "quota stage failed at start (Panic); requests meet its failure policy until its store answers",
                "Panic",
            ),
        ]
        assert "checks" not in client.get("/readyz").json()
    finally:
        g.stop()
        engine.stop()


# ---------------------------------------------------------------------- 3. the worker supervisor
CANNOT_RESTART_0 = (
    "cannot restart worker 0: starting its process (fork/exec) failed: [Errno 11] Resource temporarily unavailable"
)


def _eagain() -> OSError:
    """A fork refused at a process limit."""
    return OSError(errno.EAGAIN, "Resource temporarily unavailable")


class _DeadWorker:
    """A worker process that was killed (SIGKILL) right away."""

    pid = 4242
    returncode = -9

    def poll(self) -> int:
        return self.returncode


class _Proc:
    """A worker process that runs until a signal (then drains for ``drain`` seconds and exits 0)
    or a kill; it records both. ``on_poll(self)`` runs at each poll."""

    def __init__(self, pid: int, drain: float = 0.0, on_poll: Callable[[_Proc], None] | None = None) -> None:
        self.pid = pid
        self.drain = drain
        self.on_poll = on_poll
        self.returncode: int | None = None
        self.signals: list[int] = []
        self.killed = False
        self.polls = 0
        self._exit_at: float | None = None

    def poll(self) -> int | None:
        self.polls += 1
        if self.on_poll is not None:
            self.on_poll(self)
        if self.returncode is None and self._exit_at is not None and time.monotonic() >= self._exit_at:
            self.returncode = 0
        return self.returncode

    def send_signal(self, sig: int) -> None:
        self.signals.append(sig)
        if self._exit_at is None:
            self._exit_at = time.monotonic() + self.drain

    def kill(self) -> None:
        self.killed = True
        self.returncode = -9

    def wait(self, timeout: float | None = None) -> int:
        deadline = time.monotonic() + (timeout if timeout is not None else 60.0)
        while (rc := self.poll()) is None:
            if time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired("worker", timeout or 0.0)
            time.sleep(0.002)
        return rc


def _popen(monkeypatch: pytest.MonkeyPatch, plan: list[Any]) -> list[list[str]]:
    """Replace ``subprocess.Popen``: each start takes the next of ``plan`` (a process, or an
    ``OSError`` to raise), then a new running :class:`_Proc`; the argvs asked for, in order."""
    spawns: list[list[str]] = []

    def popen(argv: list[str], **kw: Any) -> Any:
        spawns.append(argv)
        step = plan.pop(0) if plan else _Proc(9000 + len(spawns))
        if isinstance(step, OSError):
            raise step
        return step

    monkeypatch.setattr(subprocess, "Popen", popen)
    return spawns


@pytest.fixture
def fast_supervisor(monkeypatch: pytest.MonkeyPatch) -> None:
    """The supervisor polls every 5 ms and tries a failed restart again after 10 ms, then 20 ms."""
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    monkeypatch.setattr(workers, "POLL_SECONDS", 0.005)
    monkeypatch.setattr(workers, "RESTART_BACKOFF_SECONDS", 0.01, raising=False)
    monkeypatch.setattr(workers, "RESTART_BACKOFF_MAX_SECONDS", 0.02, raising=False)


def _serve_args() -> argparse.Namespace:
    return argparse.Namespace(
        config=None, tenants=None, demo=False, tenants_for_served_models=False, allow_open_secrets=False
    )


def _errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "kvgate.workers" and r.levelno >= logging.ERROR]


def test_a_worker_that_cannot_be_restarted_is_not_reported_as_a_bind_failure(
    fast_supervisor: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A dead worker's restart whose fork failed (``EAGAIN``: a process limit) ended ``kvgate
    serve`` with ``cannot bind 127.0.0.1:0``: the address was bound all along. Its restart is now
    tried again until the restart budget is spent, and only then does ``kvgate serve`` end, once."""
    spawns = _popen(monkeypatch, [_DeadWorker()] + [_eagain() for _ in range(workers.MAX_RESTARTS)])
    assert serve._supervise(_serve_args(), 1, "127.0.0.1", 0, "info", False) == 1
    assert len(spawns) == 1 + workers.MAX_RESTARTS
    assert capsys.readouterr().err == f"kvgate serve: {CANNOT_RESTART_0}\n"


def test_a_restart_whose_fork_fails_is_tried_again_while_the_others_serve(
    fast_supervisor: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """One failed fork of a restart (``EAGAIN``) ended the gateway: it SIGKILLed the healthy
    worker, its requests in flight cut off. Now worker 1 is left alone, the failed tries are
    logged, the third try starts worker 0, and the gateway runs until it is stopped: exit 0."""
    caplog.set_level(logging.INFO, "kvgate.workers")
    sup = workers.Supervisor(2, "127.0.0.1", 0, lambda index, port: ["worker", str(index)])
    healthy = _Proc(1001)
    at_stop: list[tuple[list[int], bool]] = []

    def stop_once_supervised(p: _Proc) -> None:  # the restarted worker 0, polled by the supervisor
        if p.polls == 3:
            at_stop.append((list(healthy.signals), healthy.killed))
            sup._on_stop(signal.SIGTERM, None)

    restarted = _Proc(1002, on_poll=stop_once_supervised)
    dead = _Proc(1000)
    dead.returncode = -9
    spawns = _popen(monkeypatch, [dead, healthy, _eagain(), _eagain(), restarted])
    assert sup.run() == 0
    assert spawns == [["worker", "0"], ["worker", "1"]] + [["worker", "0"]] * 3
    assert at_stop == [([], False)]  # untouched until the stop
    assert (healthy.signals, healthy.killed) == ([signal.SIGTERM], False)
    assert (restarted.signals, restarted.killed) == ([signal.SIGTERM], False)
    assert _errors(caplog) == [
        "worker 0 (pid 1000) exited -9 after 0 s: starting it again",
        f"{CANNOT_RESTART_0}; trying again in 0.01 s",
        f"{CANNOT_RESTART_0}; trying again in 0.02 s",
    ]


def test_a_restart_that_keeps_failing_drains_the_others_and_ends_serve(
    fast_supervisor: None,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Every try counts in the restart budget: once it is spent the healthy worker gets one
    SIGTERM (it drains, never a SIGKILL) and ``kvgate serve`` exits 1, saying why once."""
    caplog.set_level(logging.INFO, "kvgate.workers")
    healthy = _Proc(1001, drain=0.05)
    dead = _Proc(1000)
    dead.returncode = -9
    spawns = _popen(monkeypatch, [dead, healthy] + [_eagain() for _ in range(workers.MAX_RESTARTS)])
    assert serve._supervise(_serve_args(), 2, "127.0.0.1", 0, "info", False) == 1
    assert len(spawns) == 2 + workers.MAX_RESTARTS
    assert (healthy.signals, healthy.killed) == ([signal.SIGTERM], False)
    assert capsys.readouterr().err == f"kvgate serve: {CANNOT_RESTART_0}\n"
    errors = _errors(caplog)
    assert len([e for e in errors if e.startswith(f"{CANNOT_RESTART_0}; trying again in ")]) == workers.MAX_RESTARTS
    assert errors[-1] == (
        "worker 0 cannot be restarted and more than 5 restarts or tries came in 60 s: stopping the gateway"
    )


def test_a_stop_cancels_a_pending_restart(
    fast_supervisor: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A SIGTERM while a failed restart waits for its next try: no worker is started after the
    stop, though the other worker drains long past the try's time (10 ms)."""
    caplog.set_level(logging.INFO, "kvgate.workers")
    sup = workers.Supervisor(2, "127.0.0.1", 0, lambda index, port: ["worker", str(index)])
    healthy = _Proc(1001, drain=0.2)
    dead = _Proc(1000)
    dead.returncode = -9
    spawns = _popen(monkeypatch, [dead, healthy, _eagain()])

    def stop_after_the_failed_try(p: _Proc) -> None:
        if len(spawns) == 3 and not sup._stopping:
            sup._on_stop(signal.SIGTERM, None)

    healthy.on_poll = stop_after_the_failed_try
    assert sup.run() == 0
    assert len(spawns) == 3
    assert (healthy.signals, healthy.killed) == ([signal.SIGTERM], False)
    assert _errors(caplog) == [
        "worker 0 (pid 1000) exited -9 after 0 s: starting it again",
        f"{CANNOT_RESTART_0}; trying again in 0.01 s",
    ]


def test_a_worker_that_cannot_start_drains_the_workers_started_before_it(
    fast_supervisor: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Worker 1's first fork failed: worker 0, already started (and maybe serving), was left to
    the supervisor's exit (a SIGKILL by ``PR_SET_PDEATHSIG``, or nothing off Linux). It now gets a
    SIGTERM and drains before ``kvgate serve`` exits 1 with the same message as before."""
    started = _Proc(1000, drain=0.05)
    spawns = _popen(monkeypatch, [started, _eagain()])
    assert serve._supervise(_serve_args(), 2, "127.0.0.1", 0, "info", False) == 1
    assert len(spawns) == 2
    assert (started.signals, started.killed, started.returncode) == ([signal.SIGTERM], False, 0)
    assert capsys.readouterr().err == (
        "kvgate serve: cannot start worker 1: starting its process (fork/exec) failed: "
        "[Errno 11] Resource temporarily unavailable\n"
    )


def test_a_bind_failure_keeps_its_message(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def refused(host: str, port: int, *, reuse_port: bool = False) -> Any:
        raise OSError(errno.EADDRINUSE, "Address already in use")

    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    monkeypatch.setattr("gateway.edge.workers.bind_socket", refused)
    args = argparse.Namespace(
        config=None, tenants=None, demo=False, tenants_for_served_models=False, allow_open_secrets=False
    )
    assert serve._supervise(args, 1, "127.0.0.1", 8080, "info", False) == 1
    assert capsys.readouterr().err == "kvgate serve: cannot bind 127.0.0.1:8080: [Errno 98] Address already in use\n"
