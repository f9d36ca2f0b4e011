"""Structured incident records (docs/design.md, Verifier: "Actions").

An incident names its id, time, tenant, upstream, detector and evidence made only of counts,
keyed hashes and request ids (never prompt or response text). Each one is appended to a JSONL
file (when configured), logged on the ``kvgate.verifier`` logger, and counted in the Prometheus
counter ``kvgate_verifier_incidents_total{detector, upstream}``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import MutableMapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import orjson
from prometheus_client import CollectorRegistry, Counter

from config.background import FaultLog, Repeats
from config.secrets import private_dir

log = logging.getLogger("kvgate.verifier")

#: Detectors: ``canary`` (a planted canary in another request's response), ``leak_index``
#: (another tenant's prompt shingles), ``latency`` (TTFT below the calibrated bound),
#: ``usage_drift``, ``finish_abort``, ``probe`` (a canary probe surfaced a canary), ``oversize``
#: (a strict response past ``strict_max_text_bytes``, ``MAX_TEXT_STREAMS`` or ``strict_max_held_bytes``),
#: ``check_fault`` (a strict response whose check raised, e.g. a tokenizer panic: withheld).
DETECTORS = ("canary", "leak_index", "latency", "usage_drift", "finish_abort", "probe", "oversize", "check_fault")

#: the verifier's own registry; the gateway's ``/metrics`` renders it after its own
REGISTRY = CollectorRegistry(auto_describe=True)
INCIDENTS = Counter(
    "kvgate_verifier_incidents_total",
    "Verifier incidents by detector and upstream",
    ["detector", "upstream"],
    registry=REGISTRY,
)
CHECKS = Counter(
    "kvgate_verifier_checks_total", "Responses checked by the verifier", ["upstream", "mode"], registry=REGISTRY
)
DROPPED = Counter(
    "kvgate_verifier_dropped_total",
    "Verifier work dropped (queue_full, ingest_bytes: over the pending-ingest budget, store_error, store_down)",
    ["reason"],
    registry=REGISTRY,
)
DROPPED_BYTES = Counter(
    "kvgate_verifier_dropped_ingest_bytes_total",
    "Prompt text (UTF-8 bytes) not indexed because the pending-ingest budget was full",
    registry=REGISTRY,
)
JOB_FAULTS = Counter(
    "kvgate_verifier_job_faults_total",
    "Background verifier jobs or periodic rounds that raised (recorded; the task went on), by kind",
    ["kind"],
    registry=REGISTRY,
)
WORKER_STOPS = Counter(
    "kvgate_verifier_worker_stops_total",
    "Times the verifier's background worker stopped other than at shutdown (/readyz fails while it is down)",
    registry=REGISTRY,
)
ALERTS = Counter(
    "kvgate_verifier_alerts_total",
    "High-severity verifier alerts (evidence of two or more source tenants for one upstream), by upstream",
    ["upstream", "reason"],
    registry=REGISTRY,
)
CAP_DROPPED = Counter(
    "kvgate_verifier_cap_dropped_total",
    "Fingerprints (leak_index) or canaries (canary) not indexed: over the tenant's cap for the window",
    ["store"],
    registry=REGISTRY,
)
QUARANTINES = Counter(
    "kvgate_verifier_quarantines_total", "Upstreams quarantined after a confirmed leak", ["upstream"], registry=REGISTRY
)

_ALLOWED_EVIDENCE = (int, float, bool, type(None))


class RoundFaults(FaultLog):
    """:func:`config.background.one_round`'s ``fault`` for a periodic task's rounds (``kind``:
    ``probe``, ``quarantine_refresh``, ``latency``): every fault, a native library's panic (a
    ``BaseException``) included, is counted (``kvgate_verifier_job_faults_total{kind}``,
    ``stats["job_faults"]`` when given) and reported as "verifier job fault (<kind>): <type>"
    with its traceback, as the worker's job faults are, when ``repeats`` says so (default: a
    fault that persists in a task of frequent rounds once a minute, with a count); the task goes
    on with its next round."""

    def __init__(self, kind: str, stats: MutableMapping[str, int] | None = None, repeats: Repeats | None = None):
        super().__init__(log, f"verifier job fault ({kind})", repeats)
        self.kind, self.stats = kind, stats

    def __call__(self, e: BaseException) -> None:
        JOB_FAULTS.labels(self.kind).inc()
        if self.stats is not None:
            self.stats["job_faults"] += 1
        super().__call__(e)

    def message(self, e: BaseException) -> str:
        return f"{self.what}: {type(e).__name__}"


def _check_evidence(value: Any, path: str = "evidence") -> None:
    """Evidence holds counts, hex hashes, ids and names: strings are capped at 80 characters so
    no text can ride along. Raises ``ValueError`` otherwise."""
    if isinstance(value, _ALLOWED_EVIDENCE):
        return
    if isinstance(value, str):
        if len(value) > 80:
            raise ValueError(f"{path}: strings in evidence are ids or hashes (<= 80 chars), not text")
        return
    if isinstance(value, dict):
        for k, v in value.items():
            _check_evidence(k, path)
            _check_evidence(v, f"{path}.{k}")
        return
    if isinstance(value, (list, tuple)):
        if len(value) > 64:
            raise ValueError(f"{path}: at most 64 items")
        for i, v in enumerate(value):
            _check_evidence(v, f"{path}[{i}]")
        return
    raise ValueError(f"{path}: unsupported type {type(value).__name__}")


@dataclass
class Incident:
    """One detection. ``time``: UNIX seconds; ``confirmed``: strong evidence (a registered
    canary, or leak-index evidence at or above the confirm threshold); it quarantines the
    upstream only by docs/design.md step 8's rule (a canary kvgate planted: the evidence's
    ``quarantine`` says which, ``None`` when not; evidence of two distinct source tenants is a
    high-severity alert, ``severity``/``alert`` in the evidence); ``withheld``: a strict
    response was held back or cut."""

    detector: str
    tenant: str
    upstream: str
    request_id: str
    evidence: dict[str, Any]
    confirmed: bool = False
    withheld: bool = False
    id: str = field(default_factory=lambda: "inc_" + uuid.uuid4().hex[:20])
    time: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        if self.detector not in DETECTORS:
            raise ValueError(f"unknown detector {self.detector!r}")
        _check_evidence(self.evidence)

    def to_json(self) -> bytes:
        """One JSONL line (with the trailing newline)."""
        return orjson.dumps(asdict(self)) + b"\n"


class IncidentSink:
    """Writes incidents: JSONL file (``path``; ``None`` = none), log line, counters. Keeps the
    last ``keep`` in memory (:attr:`recent`) for tests and the admin view. A file that cannot be
    written (disk full, permissions) is logged and counted (:attr:`write_errors`), never raised:
    the incident still counts, withholds and quarantines. Thread-safe."""

    def __init__(self, path: str | os.PathLike[str] | None = None, keep: int = 1000) -> None:
        self.path = Path(path) if path else None
        if self.path is not None:
            private_dir(self.path.parent)  # a state directory: 0700 when kvgate creates it
        self.keep = keep
        self.recent: list[Incident] = []
        #: incidents the file could not take
        self.write_errors = 0
        self._lock = threading.Lock()

    def emit(self, incident: Incident) -> Incident:
        """Record ``incident`` everywhere; returns it."""
        INCIDENTS.labels(incident.detector, incident.upstream).inc()
        line = incident.to_json()
        with self._lock:
            self.recent.append(incident)
            if len(self.recent) > self.keep:
                del self.recent[: len(self.recent) - self.keep]
            if self.path is not None:
                try:
                    with open(self.path, "ab") as f:
                        f.write(line)
                except OSError as e:
                    self.write_errors += 1
                    log.error("verifier: could not write incident %s to %s: %s", incident.id, self.path, e)
        log.warning("verifier incident %s", line.decode().rstrip())
        return incident


def read_incidents(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Parse a JSONL incident file (missing file: ``[]``)."""
    p = Path(path)
    if not p.exists():
        return []
    return [orjson.loads(line) for line in p.read_bytes().splitlines() if line.strip()]
