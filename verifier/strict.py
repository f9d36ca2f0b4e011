"""The strict path's checks (what a strict guard, :mod:`verifier.guards`, asks before it releases).

:class:`StrictChecks` owns the strict thread pool and the state lock: every check that touches
the store, the own-shingle cache or the latency model takes the lock here, in a pool thread, so
a guard never takes a lock nor blocks the event loop. The lock is the one the background worker,
admission-time indexing and the latency keeper use for the same state (built once by
:func:`verifier.build.build_verifier`).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextvars
import functools
import threading
from typing import Any

from config.models import VerifierSettings
from verifier.findings import STORE_ERRORS, CheckJob, Evidence, Findings, StoreSkipped, incident, trusted
from verifier.incidents import CHECKS, Incident
from verifier.jobs import JobQueue
from verifier.latency import LatencyModel
from verifier.leak_index import LeakIndex, LeakVerdict
from verifier.shingles import ShingleHasher
from verifier.stage import Exchange, ResponseWithheld


class StrictChecks:
    """Checks for strict guards, each blocking (run them via :meth:`run`). ``lock``: the state
    lock (store, own-shingle cache, latency model; shared with the worker); ``stats``: the
    verifier's counters (``withheld``, ``checked``)."""

    #: threads for strict checks (they serialize on the lock for the store part; the pool is
    #: separate from the loop's default executor, so strict requests waiting on the lock never
    #: starve other ``to_thread`` users such as prompt counting)
    THREADS = 4

    def __init__(
        self,
        cfg: VerifierSettings,
        findings: Findings,
        evidence: Evidence,
        jobs: JobQueue,
        lock: threading.Lock,
        stats: collections.Counter,
    ) -> None:
        self.cfg = cfg
        self.findings = findings
        self.evidence = evidence
        self.jobs = jobs
        self.lock = lock
        self.stats = stats
        self.index: LeakIndex = findings.index
        self.hasher: ShingleHasher = findings.index.hasher
        self.latency: LatencyModel = findings.latency
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    async def run(self, fn, /, *args, **kwargs):
        """Run ``fn(*args, **kwargs)`` (a strict guard's blocking step) in the strict thread
        pool and return its result or raise its exception (:class:`ResponseWithheld`
        included). The caller's context variables go with it (as :func:`asyncio.to_thread`).
        Needs a running event loop."""
        loop = asyncio.get_running_loop()
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                self.THREADS, thread_name_prefix="kvgate-verifier-strict"
            )
        ctx = contextvars.copy_context()
        return await loop.run_in_executor(self._pool, functools.partial(ctx.run, fn, *args, **kwargs))

    def close(self) -> None:
        """Stop the pool (running checks finish; none waits for them)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False)

    # ------------------------------------------------------------------ checks (blocking)
    def latency_precheck(self, exchange: Exchange, ttft_seconds: float) -> Incident | None:
        """A strict stream's first text arrived ``ttft_seconds`` after the request was forwarded
        (the clock the calibrated TTFTs use, :class:`~verifier.stage.ExchangeRequest`): an incident
        (not recorded) when that is below the calibrated bound for the whole prompt; calibration
        is not touched. The cached-token count is not known yet, so the caller only holds the
        stream back until the end."""
        req = exchange.request
        with self.lock:
            lv = self.latency.judge(req.upstream, req.prompt_tokens, ttft_seconds, "stream", model=req.model)
        if not lv.anomaly:
            return None
        return self.findings.latency_incident(exchange, ttft_seconds, lv, None)

    def check_body(self, job: CheckJob) -> list[Incident]:
        """A strict non-streamed body, checked whole: the incidents that withhold it (recorded)."""
        with self.lock:
            self.jobs.drain_ingests_locked(job.exchange)
            return self.findings.check_whole_locked(job, self.stats)

    def check_piece(
        self, exchange: Exchange, verdict: LeakVerdict, seen: set[int], canaries: list[str], ids_list: list[list[int]]
    ) -> list[Incident]:
        """Incremental stream check: new canaries and, per text stream, the token ids whose
        shingles are new (``seen``: the stream's shingles checked so far, updated; ``verdict``:
        the stream's leak verdict so far, merged into). Returns content incidents (not yet
        recorded) once the evidence so far reaches the withhold threshold."""
        f = self.findings
        found: list[Incident] = []
        with self.lock:
            self.jobs.drain_ingests_locked(exchange)
            own = f.own_locked(exchange)
            try:
                if (canaries or any(ids_list)) and not f.store.up():
                    raise StoreSkipped
                if canaries:
                    found += f.canary(exchange, canaries)
                tenant, spread = exchange.request.tenant.id, trusted(exchange)
                for ids in filter(None, ids_list):
                    verdict.merge(self.index.check_ids(tenant, ids, own, seen, record_spread=spread))
            except StoreSkipped:
                pass
            except STORE_ERRORS as e:  # the store is down: fail open (counted), latency still applies
                f.store.error(e)
        leak = f.leak(exchange, verdict)
        if leak:
            found.append(leak)
        return found

    def checked(self, exchange: Exchange) -> None:
        """A strict stream's text has been checked to its end (counted)."""
        CHECKS.labels(exchange.request.upstream, "strict").inc()
        self.stats["checked"] += 1

    def tail(
        self, exchange: Exchange, usage: dict[str, Any] | None, finish_reason: str | None, ttft_seconds: float | None
    ) -> list[Incident]:
        """The end of a strict stream: the tail detectors (usage drift, ``finish_reason``,
        latency with the cached-token count) run; their incidents that do not withhold are
        recorded, and those that do are returned (not recorded)."""
        with self.lock:
            withhold, tail = self.findings.tail(exchange, usage, finish_reason, ttft_seconds, strict=True)
        self.evidence.record(tail, exchange=exchange)
        return withhold

    def oversize(self, exchange: Exchange, text_bytes: int, text_streams: int = 0, held_bytes: int = 0) -> Incident:
        """The incident of a strict response past ``strict_max_text_bytes``,
        :data:`~verifier.findings.MAX_TEXT_STREAMS` or ``strict_max_held_bytes``."""
        return self.findings.oversize(exchange, text_bytes, text_streams, held_bytes)

    # ------------------------------------------------------------------ outcomes
    def withhold(self, exchange: Exchange, found: list[Incident]) -> ResponseWithheld:
        """Record ``found`` as withheld (counted: ``withheld``); the exception naming the first."""
        self.evidence.record(found, withheld=True, exchange=exchange)
        self.stats["withheld"] += 1
        return ResponseWithheld(found[0].id, found[0].detector)

    def fault(self, exchange: Exchange, e: BaseException) -> ResponseWithheld:
        """A check raised ``e``: counted as a job fault and withheld as a ``check_fault``
        incident (a response is never released unchecked)."""
        self.jobs.fault("strict", e)
        return self.withhold(exchange, [incident("check_fault", exchange, {"error": type(e).__name__[:80]})])
