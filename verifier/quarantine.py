"""Upstream quarantine after a confirmed leak, shared with the ``kvgate upstream clear`` CLI.

A quarantined upstream receives no prompt longer than ``min_prompt_tokens`` (the gateway
answers those from another upstream or fails them) until an operator runs
``kvgate upstream clear NAME``. The state lives in Redis (hash ``<prefix>quarantine``, field =
upstream name, value = JSON record) when ``redis_url`` is configured, else in
``<state_dir>/quarantine.json``, so the CLI can clear it for running gateways. Gateways re-read
it at most every ``refresh_seconds``.

What quarantines (docs/design.md step 8: only evidence kvgate planted): a canary kvgate itself
planted (the periodic probe, a honeypot tenant) found in another response, or an operator
(``kvgate upstream quarantine NAME``). Tenants can plant any other evidence, so it never
quarantines; :meth:`Quarantine.add_evidence` counts, per upstream, the source tenants whose
text was found in other tenants' responses within a window (in Redis, sorted set
``<prefix>qevidence:<upstream>``, so replicas count together): two or more are a
high-severity alert (:class:`verifier.findings.Evidence`).
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from config.background import one_round
from config.secrets import private_dir
from verifier.incidents import JOB_FAULTS, RoundFaults, log


@dataclass(frozen=True)
class QuarantineRecord:
    """``since``: UNIX seconds; ``min_prompt_tokens``: prompts longer than this are refused."""

    upstream: str
    incident_id: str
    detector: str
    min_prompt_tokens: int
    since: float


class FileQuarantineBackend:
    """``quarantine.json`` in the state directory: ``{upstream: record}``, replaced atomically."""

    def __init__(self, state_dir: str | os.PathLike[str]) -> None:
        self.path = Path(state_dir) / "quarantine.json"
        self._lock = threading.Lock()
        #: upstream -> {source tenant: last evidence time}
        self._evidence: dict[str, dict[str, float]] = {}

    def load(self) -> dict[str, QuarantineRecord]:
        try:
            raw = json.loads(self.path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return {}
        return {k: QuarantineRecord(**v) for k, v in raw.items()}

    def _write(self, data: dict[str, QuarantineRecord]) -> None:
        private_dir(self.path.parent)  # a state directory: 0700 when kvgate creates it
        tmp = self.path.with_name(f".quarantine.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_text(json.dumps({k: asdict(v) for k, v in data.items()}, indent=1))
        os.replace(tmp, self.path)

    def put(self, rec: QuarantineRecord) -> None:
        with self._lock:
            data = self.load()
            if rec.upstream not in data:
                data[rec.upstream] = rec
                self._write(data)

    def clear(self, upstream: str) -> bool:
        with self._lock:
            self._evidence.pop(upstream, None)
            data = self.load()
            if upstream not in data:
                return False
            del data[upstream]
            self._write(data)
            return True

    def add_evidence(self, upstream: str, source: str, now: float, window_seconds: float) -> int:
        """Record that ``source``'s text was found in another tenant's response from ``upstream``
        at ``now`` (UNIX seconds); returns the distinct sources within the window. In process
        (one gateway process uses a state file)."""
        with self._lock:
            ev = self._evidence.setdefault(upstream, {})
            ev[source] = now
            for s, t in list(ev.items()):
                if t <= now - window_seconds:
                    del ev[s]
            return len(ev)


_EVIDENCE_LUA = """
redis.call('ZADD', KEYS[1], ARGV[1], ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1] - ARGV[3])
redis.call('PEXPIRE', KEYS[1], math.ceil(ARGV[3] * 1000))
return redis.call('ZCARD', KEYS[1])
"""


class RedisQuarantineBackend:
    """Redis hash ``<prefix>quarantine``; ``client`` a synchronous redis-py client (standalone,
    Sentinel or Cluster: every call touches one key)."""

    def __init__(self, client, prefix: str = "kvgate:") -> None:
        self.client = client
        self.prefix = prefix
        self.key = f"{prefix}quarantine"
        self._evidence_script: Any = None  # a redis-py Script, registered on first use

    def load(self) -> dict[str, QuarantineRecord]:
        raw = self.client.hgetall(self.key)
        out = {}
        for k, v in raw.items():
            k = k.decode() if isinstance(k, bytes) else k
            out[k] = QuarantineRecord(**json.loads(v))
        return out

    def put(self, rec: QuarantineRecord) -> None:
        self.client.hsetnx(self.key, rec.upstream, json.dumps(asdict(rec)))

    def clear(self, upstream: str) -> bool:
        self.client.delete(f"{self.prefix}qevidence:{upstream}")
        return bool(self.client.hdel(self.key, upstream))

    def add_evidence(self, upstream: str, source: str, now: float, window_seconds: float) -> int:
        """As :meth:`FileQuarantineBackend.add_evidence`, in the sorted set
        ``<prefix>qevidence:<upstream>`` (member: source tenant, score: time), one Lua call."""
        if self._evidence_script is None:
            self._evidence_script = self.client.register_script(_EVIDENCE_LUA)
        key = f"{self.prefix}qevidence:{upstream}"
        return int(self._evidence_script(keys=[key], args=[now, source, window_seconds]))


class Quarantine:
    """Cached view of the quarantine state. :meth:`is_quarantined` is cheap (a dict lookup; the
    backend is re-read at most every ``refresh_seconds``, and a read error keeps the last view:
    while it fails, quarantines other replicas set are not seen here, so each failed read counts in
    ``kvgate_verifier_job_faults_total{kind="quarantine_refresh"}`` and the first one, then the
    first read that works again, is logged: :meth:`refresh`).

    ``inline_refresh``: when true (the default, for CLI use), a stale view is re-read on the
    caller's thread; a server sets it false and runs :meth:`refresh_loop` instead, so the
    request path never waits on the store (a Redis read or a file read)."""

    def __init__(self, backend, refresh_seconds: float = 1.0, clock=time.monotonic) -> None:
        self.backend = backend
        self.refresh_seconds = refresh_seconds
        self.clock = clock
        self.inline_refresh = True
        self._view: dict[str, QuarantineRecord] = {}
        self._read_at = float("-inf")
        self._lock = threading.Lock()
        #: quarantines this process put, numbered: a read that began before a put may not hold it
        self._puts = 0
        self._put: dict[str, tuple[int, QuarantineRecord]] = {}
        #: store reads failed in a row (0: the last read worked)
        self.failed_reads = 0

    async def refresh_loop(self) -> None:
        """Re-read the backend every ``refresh_seconds`` in a worker thread, forever (cancel to
        stop). The caller switches :attr:`inline_refresh` off when it schedules this; it is
        switched back on when the loop ends."""
        import asyncio

        faults = RoundFaults("quarantine_refresh")  # a persistent fault: once a minute, counted each round
        try:
            while True:
                # a read's fault (a native panic): the last view stays
                with one_round(faults):
                    await asyncio.to_thread(self.refresh)
                await asyncio.sleep(self.refresh_seconds)
        finally:
            self.inline_refresh = True

    def refresh(self) -> None:
        """Re-read the backend now. A quarantine this process put while the read was under way
        stays in the view (the read may have been answered before the put was stored). A read that
        raises an ``Exception`` (the store is down) keeps the last view, a flapping store must not
        lift a quarantine, but it is no silent one: quarantines other replicas set meanwhile are
        not seen here, so it counts in ``kvgate_verifier_job_faults_total{kind="quarantine_refresh"}``
        (every failed read: alert on its increase), and the first failed read of a run is logged
        with its error, as is the first read that works again (once each, not once a round)."""
        with self._lock:
            before = self._puts
        try:
            view = self.backend.load()
        except Exception as e:
            JOB_FAULTS.labels("quarantine_refresh").inc()
            with self._lock:
                self.failed_reads += 1
                first = self.failed_reads == 1
            if first:
                log.error(
                    "quarantine view not refreshed: reading the store failed (%s: %s); the last view stays "
                    "(%d upstream(s) quarantined), and quarantines set elsewhere are not seen here until a read works",
                    type(e).__name__,
                    e,
                    len(self._view),
                )
            self._read_at = self.clock()
            return
        with self._lock:
            for upstream, (n, rec) in list(self._put.items()):
                if n > before:
                    view.setdefault(upstream, rec)
                else:  # stored before this read began: the read is the truth
                    del self._put[upstream]
            failed, self.failed_reads = self.failed_reads, 0
        self._view = view
        self._read_at = self.clock()
        if failed:
            log.warning(
                "quarantine view refreshed again after %d failed read(s): %d upstream(s) quarantined", failed, len(view)
            )

    def records(self) -> dict[str, QuarantineRecord]:
        """Current records by upstream."""
        if self.inline_refresh and self.clock() - self._read_at >= self.refresh_seconds:
            self.refresh()
        return dict(self._view)

    def is_quarantined(self, upstream: str, prompt_tokens: int) -> bool:
        """Whether ``upstream`` is quarantined for a prompt of ``prompt_tokens`` tokens."""
        rec = self.records().get(upstream)
        return rec is not None and prompt_tokens > rec.min_prompt_tokens

    def put(self, upstream: str, incident_id: str, detector: str, min_prompt_tokens: int) -> QuarantineRecord:
        """Quarantine ``upstream`` (the first record stays when it already is)."""
        rec = QuarantineRecord(upstream, incident_id, detector, min_prompt_tokens, time.time())
        self.backend.put(rec)
        with self._lock:
            self._puts += 1
            self._put[upstream] = (self._puts, rec)
        self._view.setdefault(upstream, rec)
        return rec

    def add_evidence(self, upstream: str, source_tenant: str, window_seconds: float) -> int:
        """Record leak evidence against ``upstream`` whose source (the tenant whose text or
        canary surfaced) is ``source_tenant``; returns how many distinct source tenants the
        upstream has within the last ``window_seconds``. Raises the backend's errors."""
        return self.backend.add_evidence(upstream, source_tenant, time.time(), window_seconds)

    def clear(self, upstream: str) -> bool:
        """Lift the quarantine (and forget its evidence); ``False`` when there was none."""
        ok = self.backend.clear(upstream)
        with self._lock:
            self._put.pop(upstream, None)
        self._view.pop(upstream, None)
        return ok


def backend_for(redis_url: str | None, state_dir: str | os.PathLike[str], prefix: str = "kvgate:"):
    """The backend a configuration implies: Redis when ``redis_url`` is set, else the state file."""
    if redis_url:
        from config.redis_client import redis_client

        return RedisQuarantineBackend(redis_client(redis_url, 1.0, sync=True), prefix)
    return FileQuarantineBackend(state_dir)
