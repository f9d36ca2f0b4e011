"""Faults that were silent (second round): each test shows what an operator now sees.

- A quarantine store that cannot be read keeps this replica's last view (a flapping store must
  not lift a quarantine), but quarantines other replicas set meanwhile are not seen here: every
  failed read counts in ``kvgate_verifier_job_faults_total{kind="quarantine_refresh"}``, and the
  first failed read of an outage and the first read that works again are logged, once each.
- A step of the gateway's start that raised was dropped (``gather(return_exceptions=True)``): a
  warm-up that failed left the gateway ready with no log; a stage start or a pool poll that
  raised left no trace. Each is now logged; a failed warm-up fails ``/readyz``.
- A worker the supervisor could not restart (its fork failing: ``EAGAIN``) was reported as
  ``cannot bind host:port``; it now names the worker and the fork's error.
"""

from __future__ import annotations

import argparse
import errno
import logging
import subprocess
from typing import Any

import pytest

from gateway.commands import serve
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
                "built; /readyz fails until a restart",
                "RuntimeError",
            )
        ]
    finally:
        g.stop()
        engine.stop()


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
class _DeadWorker:
    """A worker process that was killed (SIGKILL) right away."""

    pid = 4242
    returncode = -9

    def poll(self) -> int:
        return self.returncode


def test_a_worker_that_cannot_be_restarted_is_not_reported_as_a_bind_failure(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A dead worker's restart whose fork failed (``EAGAIN``: a process limit) ended ``kvgate
    serve`` with ``cannot bind 127.0.0.1:0``: the address was bound all along."""
    spawns: list[list[str]] = []

    def popen(argv: list[str], **kw: Any) -> _DeadWorker:
        spawns.append(argv)
        if len(spawns) == 1:
            return _DeadWorker()
        raise OSError(errno.EAGAIN, "Resource temporarily unavailable")

    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    monkeypatch.setattr(subprocess, "Popen", popen)
    args = argparse.Namespace(
        config=None, tenants=None, demo=False, tenants_for_served_models=False, allow_open_secrets=False
    )
    assert serve._supervise(args, 1, "127.0.0.1", 0, "info", False) == 1
    assert len(spawns) == 2
    assert capsys.readouterr().err == (
        "kvgate serve: cannot restart worker 0: starting its process (fork/exec) failed: "
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
