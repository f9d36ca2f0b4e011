"""The verifier's prompt indexing and its background queue (collaborators of
:class:`verifier.service.VerifierService`, one job each).

- :class:`IngestBudget`: admission-time indexing of a prompt (tokenize, fingerprint, store),
  bounded in pending bytes (``max_pending_ingest_bytes``) and ``ingest_concurrency_per_tenant``.
- :class:`JobQueue`: the bounded queue (``queue_size``) of prompt ingests and whole-response
  checks that one background worker runs, a thread per batch, so the event loop stays free.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from redis.exceptions import NoScriptError

from config.background import one_round
from config.models import VerifierSettings
from verifier.canary import CanaryRegistry, find_canaries
from verifier.caps import TenantCaps
from verifier.findings import STORE_ERRORS, CheckJob, Findings, Prepared, StoreHealth, attach_owners
from verifier.fingerprint_cache import FingerprintCache, Fingerprinted
from verifier.incidents import DROPPED, DROPPED_BYTES, JOB_FAULTS, WORKER_STOPS
from verifier.leak_index import LeakIndex, MemoryLeakStore, RedisLeakStore
from verifier.shingles import ShingleHasher, encode, fold, squeeze_runs
from verifier.stage import Exchange

log = logging.getLogger("kvgate.verifier")

__all__ = ["FATAL", "CheckJob", "IngestBudget", "IngestJob", "JobQueue", "PendingIndex"]

#: what a job raises in the worker thread that the thread passes on rather than recording as that
#: job's fault (tiktoken's ``pyo3_runtime.PanicException`` is recorded); on the event loop the
#: worker's batch then decides (:func:`config.background.one_round`): a stop ends the worker, a
#: ``CancelledError`` nobody asked for is that batch's fault
FATAL = (KeyboardInterrupt, SystemExit, asyncio.CancelledError)


@dataclass
class IngestJob:
    """A prompt to index in the background (an exchange that skipped admission)."""

    tenant: str
    text: str
    request_id: str = ""
    keep_own: bool = False


#: prompts of at most this many bytes are indexed on the event loop when the stores allow it
#: (:meth:`IngestBudget.prepare_small`, :meth:`IngestBudget.index_small_now`: about 0.1 ms of
#: CPU per KiB, so at most about half a millisecond); larger ones in an admission thread
INLINE_INGEST_BYTES = 4096
#: a run of queued checks is prepared on the event loop (their shingles, CPU only, about 0.1 ms per
#: KiB) when its texts total at most this many characters; a larger run is prepared in the worker thread
LOOP_PREPARE_CHARS = 8192


class IngestBudget:
    """Admission-time prompt indexing. ``pending_bytes``: prompt bytes reserved by ingests not
    yet finished (bounded by ``max_pending_ingest_bytes``); ``lock``: the service lock, taken
    only around the calls of a store that is not thread-safe (``LeakStore.thread_safe``);
    ``caps``: the per-tenant caps on fingerprints and canaries (:mod:`verifier.caps`)."""

    def __init__(
        self,
        cfg: VerifierSettings,
        hasher: ShingleHasher,
        index: LeakIndex,
        canaries: CanaryRegistry,
        store: StoreHealth,
        lock: threading.Lock,
        stats: collections.Counter,
        caps: TenantCaps | None = None,
    ) -> None:
        self.cfg = cfg
        self.caps = caps or TenantCaps(cfg)
        self.hasher = hasher
        self.index = index
        self.canaries = canaries
        self.store = store
        self.lock = lock
        self.stats = stats
        self.pending_bytes = 0
        #: recently fingerprinted prompts, per tenant (:mod:`verifier.fingerprint_cache`)
        self.fingerprints = FingerprintCache()
        self._budget_lock = threading.Lock()
        self._tenant: dict[str, asyncio.Semaphore] = {}

    def reserve(self, nbytes: int) -> bool:
        """Reserve ``nbytes`` of the pending budget; ``False`` (counted as dropped,
        ``kvgate_verifier_dropped_total{reason="ingest_bytes"}``) when it would exceed it."""
        with self._budget_lock:
            if self.pending_bytes + nbytes > self.cfg.max_pending_ingest_bytes:
                DROPPED.labels("ingest_bytes").inc()
                DROPPED_BYTES.inc(nbytes)
                self.stats["ingest_dropped"] += 1
                self.stats["ingest_dropped_bytes"] += nbytes
                return False
            self.pending_bytes += nbytes
            return True

    def release(self, nbytes: int) -> None:
        """Give back what :meth:`reserve` took."""
        with self._budget_lock:
            self.pending_bytes -= nbytes

    def semaphore(self, tenant_id: str) -> asyncio.Semaphore:
        """The tenant's ingest concurrency limit (``ingest_concurrency_per_tenant``)."""
        sem = self._tenant.get(tenant_id)
        if sem is None:
            sem = self._tenant[tenant_id] = asyncio.Semaphore(self.cfg.ingest_concurrency_per_tenant)
        return sem

    def fingerprint(self, exchange: Exchange, text: str, *, yield_gil: bool = False) -> tuple[set[int], list[str]]:
        """The CPU part of indexing ``text`` (no store call): its winnowed keyed fingerprints and
        the canaries it holds; keeps the own-shingle set on a sampled ``exchange``. About 0.1 ms
        per KiB of prompt, or a digest (about 1 us per KiB) for a prompt the same tenant sent
        recently (:mod:`verifier.fingerprint_cache`). ``yield_gil``: yield the GIL between steps
        (``time.sleep(0)``, in a worker thread: a huge prompt never makes another request's
        threads wait out the interpreter's switch interval)."""
        key = FingerprintCache.key(exchange.request.tenant.id, text)
        done = self.fingerprints.get(key)
        if done is None:
            done = self._fingerprint(text, yield_gil)
            self.fingerprints.put(key, done)
        if exchange.state.sampled:
            exchange.state.own_shingles = done.own_shingles()
        return set(done.fps), list(done.canaries)

    def _fingerprint(self, text: str, yield_gil: bool) -> Fingerprinted:
        # folded, then squeezed, as ``encode(fold(text))`` (squeezing bounds any run NFKC made);
        # a canary is ASCII: folding and squeezing leave it whole
        text = squeeze_runs(fold(text))
        if yield_gil:
            time.sleep(0)
        cans = find_canaries(text)
        ids = np.array(encode(text, squeezed=True), dtype=np.uint64)  # converted once, for both hashes
        if yield_gil:
            time.sleep(0)
        fast = self.hasher.fast(ids)
        fps = self.hasher.fingerprints(ids, self.index.w, fast)
        if yield_gil:
            time.sleep(0)
        return Fingerprinted(frozenset(fps), tuple(cans), fast)

    def capped(self, tenant: str, fps: set[int], cans: list[str]) -> tuple[list[int], list[str]]:
        """What of a prompt's fingerprints and canaries the tenant's caps let into the stores."""
        return self.caps.leak.take(tenant, fps), self.caps.canary.take(tenant, cans)

    def _store_failed(self, e: Exception) -> None:
        with self._budget_lock:
            self.stats["errors"] += 1
        self.store.error(e)

    def _ingested(self) -> None:
        with self._budget_lock:
            self.stats["ingested"] += 1

    def index_prompt(self, exchange: Exchange, text: str, nbytes: int) -> None:
        """Admission's thread: the CPU work (:meth:`fingerprint`) runs without the service lock;
        only the store calls take it, and only when the store is not thread-safe (the in-memory
        one). Releases ``nbytes`` of the budget when done."""
        try:
            fps, cans = self.fingerprint(exchange, text, yield_gil=True)
            kept, cans = self.capped(exchange.request.tenant.id, fps, cans)
            # a thread-safe (Redis) store needs no service lock: waiting out a worker's batch
            # under it cost admissions up to milliseconds; the stats have a lock of their own
            shared = getattr(self.index.store, "thread_safe", False) and getattr(
                self.canaries.store, "thread_safe", False
            )
            with contextlib.nullcontext() if shared else self.lock:
                self._add(exchange.request.tenant.id, kept, cans)
        finally:
            self.release(nbytes)

    def _add(self, tenant: str, kept: list[int], cans: list[str]) -> None:
        """Store a prompt's capped fingerprints and canaries (a store error is counted and the
        store backs off) and count it ingested."""
        if self.store.up():
            try:
                self.index.store.add(tenant, kept)
                if cans:
                    self.canaries.register(tenant, cans)
            except Exception as e:
                self._store_failed(e)
        self._ingested()

    def memory_store(self) -> bool:
        """Whether both stores are in process memory (:class:`MemoryLeakStore`: no I/O; they
        are used under the state lock)."""
        return all(isinstance(st, MemoryLeakStore) for st in self._stores())

    def index_small_now(self, exchange: Exchange, text: str, nbytes: int) -> bool:
        """Index a small prompt (at most :data:`INLINE_INGEST_BYTES`; only when
        :meth:`memory_store`) on the event loop, if the state lock is free right now: it never
        waits for it (the worker may hold it for a whole batch). ``False`` when the lock was
        taken: nothing done, the caller indexes in a thread. ``True``: indexed (as
        :meth:`index_prompt`, in about 0.1 ms per KiB of prompt under the lock) and ``nbytes``
        released; an exception of :meth:`fingerprint` is raised, the bytes released too."""
        if not self.lock.acquire(blocking=False):
            return False
        try:
            fps, cans = self.fingerprint(exchange, text)
            tenant = exchange.request.tenant.id
            kept, cans = self.capped(tenant, fps, cans)
            self._add(tenant, kept, cans)
        finally:
            self.lock.release()
            self.release(nbytes)
        return True

    def inline_store(self) -> bool:
        """Whether a small prompt is indexed on the event loop (:meth:`prepare_small`): both
        stores are Redis with an asyncio client (``aadd``)."""
        return all(isinstance(st, RedisLeakStore) and st.aclient is not None for st in self._stores())

    def _stores(self) -> tuple[object, object]:
        return self.index.store, self.canaries.store

    def prepare_small(self, exchange: Exchange, text: str, nbytes: int) -> PendingIndex:
        """Index a small prompt (at most :data:`INLINE_INGEST_BYTES`; only when
        :meth:`inline_store`) on the event loop: the fingerprints computed in place (about 0.1 ms
        per KiB), the store writes returned unsent as a :class:`PendingIndex` (one Lua call per
        store, ``aadd``'s script) for the caller to send with a round trip of its own or to let
        :meth:`PendingIndex.finish` send. No thread: the hop and the GIL hand-offs cost more than
        the work (about 0.2 ms a request; at 64 in flight the admission threads' GIL waits were
        a quarter of the process's samples). ``nbytes`` of the budget are released by ``finish``."""
        try:
            fps, cans = self.fingerprint(exchange, text)
        except BaseException:
            self.release(nbytes)
            raise
        leaks, canaries = self._stores()
        assert isinstance(leaks, RedisLeakStore) and isinstance(canaries, RedisLeakStore)  # inline_store()
        tenant = exchange.request.tenant.id
        kept, leak_window = self.caps.leak.take_in_window(tenant, fps)
        cans, canary_window = self.caps.canary.take_in_window(tenant, cans)
        writes = [(leaks, kept)]
        if cans:
            writes.append((canaries, [self.canaries.fingerprint(c) for c in cans]))

        def give_back() -> None:  # a refused request's entries never reach the stores
            self.caps.leak.give_back(tenant, len(kept), leak_window)
            self.caps.canary.give_back(tenant, len(cans), canary_window)

        return PendingIndex(self, tenant, writes if self.store.up() else [], nbytes, give_back)


class PendingIndex:
    """A small prompt's leak-index (and canary) writes, computed at admission and not yet sent
    (:class:`verifier.stage.PendingWrite`): ``calls`` are the ``aadd`` Lua calls of ``writes``
    (``(store, fingerprints)``; empty when the store is backing off); :meth:`guarded` the same
    calls made conditional on a reservation. After :meth:`finish` the prompt counts as ingested
    (unless :meth:`discard` came first) and its ``nbytes`` are back in the budget."""

    def __init__(
        self,
        budget: IngestBudget,
        tenant: str,
        writes: list[tuple[RedisLeakStore, list[int]]],
        nbytes: int,
        give_back: Callable[[], None] | None = None,
    ):
        self.budget = budget
        self.give_back = give_back
        self.tenant = tenant
        self.writes = writes
        self.nbytes = nbytes
        self._outcome: list[Any] | BaseException | None = None
        self._finished = False
        self._discarded = False

    @functools.cached_property
    def calls(self) -> list[tuple[str, list[str], list[Any]]]:
        """The writes as unsent ``aadd`` Lua calls (built when first asked for: a write that
        rides the token reservation is sent in its :meth:`guarded` form only)."""
        return [store.add_call(self.tenant, fps) for store, fps in self.writes]

    def guarded(self, key: str, field: str) -> list[tuple[str, list[str], list[Any]]]:
        """:attr:`calls`, each writing only if the hash ``key`` holds ``field`` when it runs
        (else it answers ``-1``): sent right after the reservation that sets that field, in
        one pipeline (:meth:`verifier.leak_index.RedisLeakStore.add_call`)."""
        return [store.add_call(self.tenant, fps, guard=(key, field)) for store, fps in self.writes]

    def sent(self, outcome: list[Any] | BaseException) -> None:
        """The outcome of sending :attr:`calls` (see :class:`verifier.stage.PendingWrite`)."""
        self._outcome = outcome

    def discard(self) -> None:
        """The request was refused: :meth:`finish` sends nothing and counts no ingest, and the
        entries the tenant's caps let in for it are given back (``give_back``)."""
        if not self._discarded and self.give_back is not None:
            self.give_back()
        self._discarded = True

    def _written(self, result: Any) -> bool:
        return not isinstance(result, Exception) and result != -1  # -1: a guarded call that wrote nothing

    async def finish(self) -> None:
        """Send what was not sent (refused with ``NOSCRIPT``: the server lost the script; or a
        guarded call that found no reservation, ``-1``) through the store's own client, count a
        failure as a store error (the store then backs off), count the prompt ingested and
        release its bytes; after :meth:`discard`, only release them. Never raises, except
        :class:`asyncio.CancelledError`; the bytes are released whatever happens. A second call
        does nothing."""
        if self._finished:
            return
        self._finished = True
        try:
            if self._discarded:
                return
            await self._send_unsent()
            self.budget._ingested()
        finally:
            self.budget.release(self.nbytes)

    async def _send_unsent(self) -> None:
        outcome = self._outcome
        if isinstance(outcome, BaseException):
            self.budget._store_failed(outcome)  # type: ignore[arg-type]
            return
        for i, (store, fps) in enumerate(self.writes):
            result = outcome[i] if outcome is not None and i < len(outcome) else None
            if outcome is not None and self._written(result):
                continue  # written with the other round trip
            if isinstance(result, Exception) and not isinstance(result, NoScriptError):
                self.budget._store_failed(result)
                return
            try:
                if isinstance(result, NoScriptError):  # Redis lost (or never had) the scripts
                    await store.aload_scripts()
                await store.aadd(self.tenant, fps)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self.budget._store_failed(e)
                return


def job_chars(job: IngestJob | CheckJob) -> int:
    """The text a queued job keeps alive (characters): an ingest's prompt; a check's texts and its
    exchange's prompt."""
    if isinstance(job, IngestJob):
        return len(job.text)
    return sum(map(len, job.texts)) + len(job.exchange.prompt_text)


def job_tenant(job: IngestJob | CheckJob) -> str:
    """The tenant whose request a queued job checks or indexes."""
    return job.tenant if isinstance(job, IngestJob) else job.exchange.request.tenant.id


class _Jobs(collections.deque):
    """The queue's jobs in order, with ``chars`` (what :func:`job_chars` counts of them) and, per
    tenant, ``held[tenant] = [jobs, chars]``, kept by every way in and out the queue uses
    (``append``, ``popleft``, ``extendleft``, ``clear``). Each of those is atomic (a lock of its
    own): the event loop appends while the worker thread pops, and an interleaved count used to
    drop a tenant's entry under the other side's update (its count then drifted below zero)."""

    def __init__(self) -> None:
        super().__init__()
        self.chars = 0
        self.held: dict[str, list[int]] = {}
        self._lock = threading.Lock()

    def _count(self, job: IngestJob | CheckJob, sign: int) -> None:
        n = job_chars(job)
        self.chars += sign * n
        held = self.held.setdefault(job_tenant(job), [0, 0])
        held[0] += sign
        held[1] += sign * n
        if held[0] == 0:
            del self.held[job_tenant(job)]

    def append(self, job: IngestJob | CheckJob) -> None:
        with self._lock:
            super().append(job)
            self._count(job, 1)

    def popleft(self) -> Any:
        with self._lock:
            job = super().popleft()
            self._count(job, -1)
        return job

    def extendleft(self, jobs: Any) -> None:
        jobs = list(jobs)
        with self._lock:
            super().extendleft(jobs)
            for job in jobs:
                self._count(job, 1)

    def clear(self) -> None:
        with self._lock:
            super().clear()
            self.chars = 0
            self.held.clear()


class JobQueue:
    """The background queue and its worker. ``jobs``: the queued :class:`IngestJob` and
    :class:`CheckJob` records, in order; ``own_cache``: own-prompt shingle sets the ingests
    computed, keyed by :attr:`Exchange.internal_id` (shared with :class:`Findings`), at most
    ``queue_size`` of them."""

    def __init__(
        self,
        cfg: VerifierSettings,
        findings: Findings,
        lock: threading.Lock,
        own_cache: dict[str, set[int]],
        stats: collections.Counter,
        caps: TenantCaps | None = None,
    ) -> None:
        self.cfg = cfg
        self.caps = caps or TenantCaps(cfg)
        self.findings = findings
        self.lock = lock
        self.own_cache = own_cache
        self.stats = stats
        self.jobs = _Jobs()
        self.wake: asyncio.Event | None = None
        #: the worker task ended other than by :attr:`closing` (read by ``/readyz``)
        self.stopped = False
        #: set by the service at shutdown: a cancellation then is no stop
        self.closing = False

    def enqueue(self, job: IngestJob | CheckJob) -> bool:
        """Queue ``job``; ``False`` (counted: ``queue_full``) when it would take the queue past
        ``queue_size`` jobs or ``queue_max_chars`` characters, or its tenant past
        ``queue_tenant_share`` of either (so one tenant's burst of large responses never leaves
        another tenant's responses unchecked)."""
        cfg, chars = self.cfg, job_chars(job)
        jobs, held = self.jobs, self.jobs.held.get(job_tenant(job), (0, 0))
        share = cfg.queue_tenant_share
        if (
            len(jobs) >= cfg.queue_size
            or jobs.chars + chars > cfg.queue_max_chars
            or held[0] + 1 > max(1, share * cfg.queue_size)
            or held[1] + chars > share * cfg.queue_max_chars
        ):
            DROPPED.labels("queue_full").inc()
            self.stats["dropped"] += 1
            return False
        self.jobs.append(job)
        if self.wake is not None:
            self.wake.set()
        return True

    async def work(self) -> None:
        """The worker task: batches of up to 32 jobs in a thread. A job that raises anything but
        :data:`FATAL` is recorded (:meth:`fault`, its kind); a batch that raises anything but a stop
        (a ``CancelledError`` nobody asked for included) is recorded as kind ``batch``; the worker
        goes on. Should the task end anyway, :attr:`stopped` turns true (``/readyz`` fails,
        ``kvgate_verifier_worker_stops_total``)."""
        self.wake = wake = self.wake or asyncio.Event()
        self.stopped = False
        try:
            while True:
                if not self.jobs:
                    wake.clear()
                    await wake.wait()
                self.stats["in_flight"] += 1
                try:
                    # never let the worker die of a batch (a panic, a CancelledError nobody asked for)
                    with one_round(functools.partial(self.fault, "batch")):
                        if not await self._lookup_then_check(32):
                            # with awaited lookups, the thread takes one job (an ingest, a large check)
                            # and hands the queue back, so the checks after it are looked up on the loop
                            await asyncio.to_thread(self._run_some, 1 if self._lookups_on_loop() else 32)
                finally:
                    self.stats["in_flight"] -= 1
        except asyncio.CancelledError:
            if not self.closing:
                self._stopped()
            raise
        except BaseException:
            self._stopped()
            raise

    async def _lookup_then_check(self, n: int) -> bool:
        """Up to ``n`` queued checks at the head of the queue, their texts within
        :data:`LOOP_PREPARE_CHARS`: prepared on the event loop under the lock
        (:meth:`Findings.prepare_batch_locked`), their leak-index owners looked up in one awaited
        call (``aowners``: the loop serves requests meanwhile, and no thread waits on Redis holding
        or wanting the interpreter lock), then checked in the worker thread in order, as
        :meth:`_run_some` would. A failed lookup leaves each check to look up its own (the first
        counts the error). ``False``, nothing taken: an ingest or a larger check is first, the
        store has no asyncio client or is backing off, or the lock is held."""
        if not self._lookups_on_loop():
            return False
        if not self.findings.store.backoff.usable() or not self.lock.acquire(blocking=False):
            return False
        try:
            batch = self._pop_checks(n, LOOP_PREPARE_CHARS)
            if not batch:
                return False
            prepared, hashes = self.findings.prepare_batch_locked(batch)
        finally:
            self.lock.release()
        store = self.findings.index.store
        assert isinstance(store, RedisLeakStore)  # _lookups_on_loop()
        try:
            if hashes:
                attach_owners(prepared, hashes, await store.aowners(hashes))
        except asyncio.CancelledError:
            self.jobs.extendleft(reversed(batch))  # shutdown: the checks stay queued, in order
            raise
        except Exception:
            pass  # no owners attached: each check looks up its own, and the first counts the error
        await asyncio.to_thread(self._check_prepared, batch, prepared)
        return True

    def _lookups_on_loop(self) -> bool:
        """Whether the leak store looks up on the event loop (a Redis store with an asyncio client)."""
        store = self.findings.index.store
        return isinstance(store, RedisLeakStore) and store.aclient is not None

    def _pop_checks(self, n: int, max_chars: float = float("inf")) -> list[CheckJob]:
        """Pop the run of at most ``n`` checks at the head of the queue whose texts (and, where the
        own-prompt shingles are not known yet, prompts) total at most ``max_chars``. Caller holds
        the lock."""
        batch: list[CheckJob] = []
        total = 0
        while self.jobs and len(batch) < n and isinstance(self.jobs[0], CheckJob):
            ex = self.jobs[0].exchange
            total += sum(map(len, self.jobs[0].texts))
            if ex.state.own_shingles is None and ex.internal_id not in self.own_cache:
                total += len(ex.prompt_text)
            if total > max_chars:
                break
            batch.append(self.jobs.popleft())
        return batch

    def _check_prepared(self, batch: list[CheckJob], prepared: list[Prepared | None]) -> None:
        """The worker thread's part of :meth:`_lookup_then_check`."""
        with self.lock:
            for job, p in zip(batch, prepared, strict=True):
                self._run(job, p)

    def _stopped(self) -> None:
        self.stopped = True
        WORKER_STOPS.inc()
        self.stats["worker_stops"] += 1
        log.error("verifier worker stopped: sampled responses are no longer checked")

    def fault(self, kind: str, e: BaseException) -> None:
        """A job (``kind``: ``ingest``, ``check``, ``batch``) raised ``e``: counted
        (``kvgate_verifier_job_faults_total{kind}``) and logged with its traceback."""
        JOB_FAULTS.labels(kind).inc()
        self.stats["job_faults"] += 1
        log.error("verifier job fault (%s): %s", kind, type(e).__name__, exc_info=(type(e), e, e.__traceback__))

    def _run_some(self, n: int) -> None:
        """Run up to ``n`` queued jobs, in order: a prompt ingest alone, a run of consecutive
        checks together, their leak-index lookups in one store call (:meth:`Findings.prefetch_locked`)."""
        while n > 0:
            with self.lock:
                if not self.jobs:
                    return
                first = self.jobs.popleft()
                batch = [first, *self._pop_checks(n - 1)] if isinstance(first, CheckJob) else [first]
                n -= len(batch)
                ahead = self.findings.prefetch_locked(batch) if len(batch) > 1 else [None]
                for job, prepared in zip(batch, ahead, strict=True):
                    self._run(job, prepared)

    def drain_ingests_locked(self, exchange: Exchange) -> None:
        """For an exchange that skipped admission only: process queued prompt ingests now (a
        strict check must see every earlier prompt). An admitted exchange never does this other
        tenants' work: every prompt forwarded through admission was indexed before it left.
        Caller holds the lock; checks stay queued, in order, ahead of anything appended meanwhile."""
        if exchange.state.admitted or not any(isinstance(j, IngestJob) for j in list(self.jobs)):
            return
        keep: list[CheckJob] = []
        for _ in range(len(self.jobs)):  # the jobs queued now; later appends stay queued
            job = self.jobs.popleft()
            if isinstance(job, IngestJob):
                self._run(job)
            else:
                keep.append(job)
        # only the left end is touched here and only the right end by appends: no lost job
        self.jobs.extendleft(reversed(keep))

    def _run(self, job: IngestJob | CheckJob, prepared: Prepared | None = None) -> None:
        store = self.findings.store
        try:
            if isinstance(job, IngestJob):
                if not store.up():
                    return
                self._ingest(job)
            else:
                self.findings.check_whole_locked(job, self.stats, prepared)
        except FATAL:
            raise
        except STORE_ERRORS as e:  # Redis down: the store backs off; the worker goes on
            self.stats["errors"] += 1
            store.error(e)
        except BaseException as e:  # a bug or e.g. tiktoken's pyo3 PanicException: this job only
            self.fault("ingest" if isinstance(job, IngestJob) else "check", e)

    def _ingest(self, job: IngestJob) -> None:
        f = self.findings
        ids = encode(fold(job.text))
        fast = f.index.hasher.fast(ids)
        f.index.store.add(
            job.tenant, self.caps.leak.take(job.tenant, f.index.hasher.fingerprints(ids, f.index.w, fast))
        )
        if job.keep_own:
            self.own_cache[job.request_id] = set(fast.tolist())  # keyed by the exchange's internal id
            while len(self.own_cache) > self.cfg.queue_size:  # guards that never finished
                self.own_cache.pop(next(iter(self.own_cache)))
        cans = self.caps.canary.take(job.tenant, find_canaries(job.text))
        if cans:
            f.canaries.register(job.tenant, cans)
        self.stats["ingested"] += 1
