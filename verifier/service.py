"""The verifier stage the gateway calls (implements :class:`verifier.stage.VerifierStage`).

- :meth:`VerifierService.admit` (admission, before forwarding) decodes token-id prompts with the
  model's tokenizer and indexes the prompt in the leak index and the canary registry (every
  tenant, sampled or not: the index must know every prompt to recognise it elsewhere), in a
  thread of its own that the request awaits (a prompt of at most 4 KiB on the event loop: see
  :meth:`VerifierService.admit`): a tenant's prompt costs its own time, and a later check
  finds it indexed. One tenant's ingests run ``ingest_concurrency_per_tenant`` at a time;
  pending ingest is bounded in bytes (``max_pending_ingest_bytes``), beyond which a prompt is not
  indexed and is counted as dropped.
- :meth:`VerifierService.begin` returns a guard when the response is sampled
  (``verify_sample_rate``) or the tenant is strict (an exchange that skipped :meth:`admit` has
  its prompt queued for the background worker instead, as before).
- Non-strict guards pass every event through at once and hand the whole text to a bounded
  background queue; a worker (a thread per job, so the event loop stays free) runs the detectors.
- Strict guards (``strict_verify``) check before release: a non-streamed body is checked in
  :meth:`check_body` (raises :class:`ResponseWithheld`); a stream is held back by
  ``strict_holdback_tokens`` tokens, checked incrementally (canaries and leak-index shingles as
  they complete, each choice's each text field on its own) and cut on detection, so no detected
  text leaves. A strict response with more than ``strict_max_text_bytes`` of text, or more than
  :data:`~verifier.findings.MAX_TEXT_STREAMS` text streams, is withheld (never released unchecked). Their blocking work
  (tokenizing, hashing, the store round trip, the service lock the worker may hold for a whole
  batch, incident records) runs in a small dedicated thread pool (:attr:`verifier.strict.StrictChecks.THREADS`), so a
  strict request never blocks the event loop; each guard call awaits its own work, so order
  and withholding are unchanged. The guards live in :mod:`verifier.guards`, their checks in
  :mod:`verifier.strict`; :func:`verifier.build.build_verifier` assembles the service.
- Detectors: canary scan (:mod:`verifier.canary`), leak index (:mod:`verifier.leak_index`),
  usage drift and ``finish_reason: abort`` (:mod:`verifier.drift`), TTFT lower bounds
  (:mod:`verifier.latency`). Findings become incidents (:mod:`verifier.incidents`). Quarantine
  (:mod:`verifier.quarantine`) needs evidence kvgate planted itself (docs/design.md step 8);
  evidence of two source tenants is a high-severity alert.
- A tenant's own text is never evidence: its prompt (decoded token ids included) is excluded,
  and with ``echo`` the echoed prompt at the start of each text is not checked at all.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import random
import time
from typing import Any

from config.models import Settings, TenantConfig
from verifier.canary import CanaryRegistry
from verifier.caps import TenantCaps
from verifier.findings import strip_echo
from verifier.guards import BackgroundGuard, StrictGuard
from verifier.incidents import IncidentSink
from verifier.jobs import FATAL, INLINE_INGEST_BYTES, IngestBudget, IngestJob, JobQueue, PendingIndex
from verifier.latency import LatencyKeeper, LatencyModel
from verifier.leak_index import LeakIndex
from verifier.prober import PeriodicProbe
from verifier.quarantine import Quarantine
from verifier.shingles import ShingleHasher
from verifier.shingles import encode as shingle_ids
from verifier.stage import Decoder, Exchange
from verifier.strict import StrictChecks

log = logging.getLogger("kvgate.verifier")

#: ``strip_echo`` lives in :mod:`verifier.findings`; it is re-exported here for its callers
__all__ = ["VerifierService", "strip_echo"]


class VerifierService:
    """The gateway's verifier: the stage API over collaborators with one job each. Build one
    per gateway process with :func:`verifier.build.build_verifier`; call :meth:`aclose` at
    shutdown.

    - :attr:`ingest`: admission-time indexing (:class:`verifier.jobs.IngestBudget`);
    - :attr:`jobs`: the background queue and its worker (:class:`verifier.jobs.JobQueue`);
    - :attr:`strict`: the strict guards' checks (:class:`verifier.strict.StrictChecks`);
    - :attr:`quarantine` (from ``strict.evidence``), :attr:`latency_keeper` and the periodic
      probe (:attr:`prober`, or ``None``) run as tasks of their own once :meth:`start` is called;
    - :attr:`index`, :attr:`canaries`, :attr:`hasher`, :attr:`latency`, :attr:`caps` and
      :attr:`incidents` are the stores, models and sinks those share (read-only views for
      tests and benchmarks; the admin view reads :attr:`stats`).

    ``tenants``: tenant id -> :class:`~config.models.TenantConfig` as last seen (the honeypot
    check reads it); ``rng``: sampling (``verify_sample_rate``); ``aredis``: the asyncio Redis
    client to close at shutdown (or ``None``)."""

    def __init__(
        self,
        settings: Settings,
        *,
        ingest: IngestBudget,
        jobs: JobQueue,
        strict: StrictChecks,
        latency_keeper: LatencyKeeper,
        tenants: dict[str, TenantConfig],
        rng: random.Random,
        prober: PeriodicProbe | None = None,
        aredis: Any = None,
    ) -> None:
        self.settings = settings
        self.cfg = settings.verifier
        self.ingest = ingest
        self.jobs = jobs
        self.strict = strict
        self.latency_keeper = latency_keeper
        self.tenants = tenants
        self.rng = rng
        #: counts for tests, benchmarks and the admin view (shared by the collaborators)
        self.stats: collections.Counter = ingest.stats
        #: quarantine view (its refresher runs as a task once started)
        self.quarantine: Quarantine = strict.evidence.quarantine
        #: the incident records
        self.incidents: IncidentSink = strict.evidence.incidents
        self.prober = prober
        self.aredis = aredis
        self._tasks: list[asyncio.Task] = []
        self._closed = False

    # ------------------------------------------------------------------ read-only views
    @property
    def index(self) -> LeakIndex:
        """The leak index (its store: ``index.store``)."""
        return self.ingest.index

    @property
    def hasher(self) -> ShingleHasher:
        """The keyed shingle hasher (the ``leak_index_key`` secret and ``shingle_k``)."""
        return self.ingest.hasher

    @property
    def canaries(self) -> CanaryRegistry:
        """The canary registry."""
        return self.ingest.canaries

    @property
    def caps(self) -> TenantCaps:
        """The per-tenant caps on indexed fingerprints and canaries."""
        return self.ingest.caps

    @property
    def latency(self) -> LatencyModel:
        """The TTFT lower-bound model."""
        return self.latency_keeper.model

    @property
    def ingest_pending_bytes(self) -> int:
        """Prompt bytes reserved by admission-time ingests not yet finished."""
        return self.ingest.pending_bytes

    @property
    def queued_jobs(self) -> int:
        """Jobs (prompt ingests, whole-response checks) queued for the background worker."""
        return len(self.jobs.jobs)

    @property
    def worker(self) -> asyncio.Task | None:
        """The background worker's task once :meth:`start` ran, else ``None``."""
        return self._tasks[0] if self._tasks else None

    # ------------------------------------------------------------------ lifecycle
    def warm_up(self) -> None:
        """Build the shingle encoder (cl100k_base with the ChatML specials: about 75 ms) before
        the first prompt is fingerprinted on the event loop. Blocking: call it in a worker thread."""
        shingle_ids("kvgate warm-up")

    def start(self) -> None:
        """Start the background worker (and the periodic probe when configured). Needs a running
        event loop; :meth:`begin` calls it lazily."""
        if self._tasks or self._closed:
            return
        loop = asyncio.get_running_loop()
        self.jobs.wake = asyncio.Event()
        self._tasks.append(loop.create_task(self.jobs.work(), name="kvgate-verifier"))
        self.quarantine.refresh()  # once at start-up; from now on only the refresher reads the store
        self.quarantine.inline_refresh = False
        self._tasks.append(loop.create_task(self.quarantine.refresh_loop(), name="kvgate-verifier-quarantine"))
        if self.latency_keeper.store is not None:
            self._tasks.append(loop.create_task(self.latency_keeper.loop(), name="kvgate-verifier-latency"))
        if self.prober is not None:
            self._tasks.append(loop.create_task(self.prober.loop(), name="kvgate-verifier-probe"))

    async def drain(self, timeout: float = 30.0) -> None:
        """Wait until every queued job has been processed (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        while self.jobs.jobs or self.stats["in_flight"]:
            if self.jobs.wake is not None:
                self.jobs.wake.set()
            if time.monotonic() > deadline:
                raise TimeoutError(f"verifier queue not drained: {self.queued_jobs} jobs left")
            await asyncio.sleep(0.005)

    async def aclose(self) -> None:
        """Finish queued work (bounded by the gateway's drain) and stop the tasks."""
        if self._tasks:
            try:
                await self.drain(timeout=5.0)
            except TimeoutError:
                log.warning("verifier: %d jobs dropped at shutdown", self.queued_jobs)
        self._closed = True
        self.jobs.closing = True
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
        with contextlib.suppress(Exception):
            await asyncio.to_thread(self.latency_keeper.save)
        self.strict.close()
        if self.aredis is not None:
            with contextlib.suppress(Exception):
                await self.aredis.aclose()

    def health(self) -> dict[str, bool]:
        """Named readiness checks (``/readyz``): ``verifier_worker`` is false once the background
        worker has stopped (sampled responses would go unchecked)."""
        worker = self.worker
        down = self.jobs.stopped or (worker is not None and worker.done() and not self._closed)
        return {"verifier_worker": not down}

    # ------------------------------------------------------------------ stage API
    def _decide_sampled(self, exchange: Exchange) -> bool:
        if exchange.state.sampled is None:
            t = exchange.request.tenant
            exchange.state.sampled = t.strict_verify or (
                t.verify_sample_rate > 0 and self.rng.random() < t.verify_sample_rate
            )
        return exchange.state.sampled

    def _arrive(self, exchange: Exchange) -> bool:
        """Start the tasks when a loop runs, note the exchange's tenant (honeypot flags come
        with the exchanges) and decide whether its response is sampled."""
        with contextlib.suppress(RuntimeError):  # no running loop: synchronous use (tests, benchmarks)
            self.start()
        tenant = exchange.request.tenant
        self.tenants[tenant.id] = tenant
        return self._decide_sampled(exchange)

    async def admit(
        self, exchange: Exchange, decode: Decoder | None = None, *, defer_write: bool = False
    ) -> PendingIndex | None:
        """Admission-time work of one request, awaited before it is forwarded (see the module
        doc): decode ``exchange.prompt_ids`` with ``decode`` (the model tokenizer's ``adecode``;
        a failure, or no decoder, leaves ``own_text_complete`` false and is counted as
        ``decode_failed``), then tokenize and fingerprint the prompt and add it to the leak index
        and the canary registry (a prompt of at most :data:`~verifier.jobs.INLINE_INGEST_BYTES`
        with Redis stores: on the event loop, one awaited call per store; with in-memory stores:
        on the event loop when the state lock is free at once; otherwise in a thread of its
        own), and keep its own-shingle set on the
        exchange when the response will be checked. Over the pending-ingest byte budget the
        prompt is not indexed (``kvgate_verifier_dropped_total{reason="ingest_bytes"}``). Never
        raises, except :class:`asyncio.CancelledError` when the request is cancelled.
        ``defer_write`` (a small prompt with Redis stores): return the writes unsent, as a
        :class:`~verifier.jobs.PendingIndex`, for the caller to send with its quota reservation
        (one round trip for both) and then ``finish``; otherwise returns ``None``."""
        if not self.cfg.enabled or exchange.state.admitted:
            return None
        self._arrive(exchange)
        if exchange.prompt_ids:
            await self._decode_prompt_ids(exchange, decode)
        exchange.state.admitted = True
        return await self._index_prompt(exchange, defer_write)

    def defers(self, exchange: Exchange) -> bool:
        """Whether :meth:`admit` with ``defer_write`` would hand the prompt's writes back unsent
        (a prompt text of at most :data:`~verifier.jobs.INLINE_INGEST_BYTES`, no token-id prompts
        to decode, Redis stores with an asyncio client) rather than index it itself."""
        if not self.cfg.enabled or exchange.state.admitted or exchange.prompt_ids:
            return False
        return self._writes_inline(_utf8_len(exchange.prompt_text))

    def _writes_inline(self, nbytes: int) -> bool:
        """Whether a prompt of ``nbytes`` is indexed on the loop with its writes handed back."""
        return nbytes <= INLINE_INGEST_BYTES and self.ingest.inline_store()

    async def _decode_prompt_ids(self, exchange: Exchange, decode: Decoder | None) -> None:
        """Append the token-id prompts' text to the prompt text and the echo prompts. ``decode`` is
        made for this request: an engine tokenizer's reads one byte budget for all of its prompts,
        and once an answer spent it each prompt left fails at once (counted, as any failure)."""
        decoded: list[str] = []
        for ids in exchange.prompt_ids:
            try:
                if decode is None:
                    raise LookupError("no decoder")
                decoded.append(await decode(list(ids)))
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the engine's /detokenize failed: not the client's fault
                exchange.state.own_text_complete = False
                self.stats["decode_failed"] += 1
                log.warning("verifier: could not decode a token-id prompt: %s", type(e).__name__)
        exchange.prompt_text = "\n".join(t for t in (exchange.prompt_text, *decoded) if t)
        exchange.echo_prompts.extend(decoded)

    async def _index_prompt(self, exchange: Exchange, defer_write: bool) -> PendingIndex | None:
        """:meth:`admit`'s indexing step, within the pending-bytes budget."""
        text = exchange.prompt_text
        nbytes = _utf8_len(text)
        try:
            if self._writes_inline(nbytes):
                if not self.ingest.reserve(nbytes):
                    return None
                pending = self.ingest.prepare_small(exchange, text, nbytes)  # no ingest slot: no thread
                if defer_write:
                    return pending
                await pending.finish()
                return None
            if nbytes <= INLINE_INGEST_BYTES and self.ingest.memory_store():
                if not self.ingest.reserve(nbytes):
                    return None
                if self.ingest.index_small_now(exchange, text, nbytes):  # the lock was free
                    return None
                self.ingest.release(nbytes)  # the lock was held: a thread, in the tenant's turn
            await self._ingest_in_thread(exchange, text, nbytes)
        except FATAL:
            raise
        except BaseException as e:  # a tokenizer panic: the prompt goes unindexed, the request on
            self.jobs.fault("ingest", e)
        return None

    async def _ingest_in_thread(self, exchange: Exchange, text: str, nbytes: int) -> None:
        """Index in an admission thread in the tenant's turn (``ingest_concurrency_per_tenant``),
        then within the pending-bytes budget: a prompt waiting for its tenant's turn holds none
        of the budget, so one tenant's queue of large prompts never leaves another tenant's
        prompt unindexed (``ingest_bytes`` dropped)."""
        async with self.ingest.semaphore(exchange.request.tenant.id):
            if self.ingest.reserve(nbytes):
                await _in_own_thread(self.ingest.index_prompt, exchange, text, nbytes)  # it releases them

    def begin(self, exchange: Exchange) -> BackgroundGuard | StrictGuard | None:
        """A guard when sampled or strict (see the module doc). An exchange that did not pass
        :meth:`admit` has its prompt queued for the background worker."""
        if not self.cfg.enabled:
            return None
        sampled = self._arrive(exchange)
        tenant = exchange.request.tenant
        if not exchange.state.admitted:
            self.jobs.enqueue(IngestJob(tenant.id, exchange.prompt_text, exchange.internal_id, sampled))
        if tenant.strict_verify:
            return StrictGuard(self.strict, exchange)
        if sampled:
            return BackgroundGuard(self.jobs, exchange)
        return None

    def is_quarantined(self, upstream: str, prompt_tokens: int) -> bool:
        """Whether ``upstream`` is quarantined for prompts of this length."""
        return self.quarantine.is_quarantined(upstream, prompt_tokens)


def _utf8_len(text: str) -> int:
    """The UTF-8 length of ``text`` in bytes (a lone surrogate counts as one replacement)."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "replace"))


#: threads for admission ingests (started on demand, then reused); more ingests than this at once queue
ADMIT_THREADS = 64
_admit_pool: concurrent.futures.ThreadPoolExecutor | None = None


def _admit_executor() -> concurrent.futures.ThreadPoolExecutor:
    global _admit_pool
    if _admit_pool is None:
        _admit_pool = concurrent.futures.ThreadPoolExecutor(ADMIT_THREADS, thread_name_prefix="kvgate-verifier-admit")
    return _admit_pool


async def _in_own_thread(fn, /, *args):
    """Run ``fn(*args)`` on a thread of the admission pool (:data:`ADMIT_THREADS` threads, none
    shared with other work, so no other kind of work queues ahead of a request's own admission
    work) and await its result. A thread is started only when none is idle: starting one per
    request blocked the event loop in ``Thread.start()`` until the new thread ran, about 1.5 ms
    a request under load. Cancelling the await does not stop the work; ``fn`` must clean up after
    itself."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def settle(result, exc) -> None:
        if fut.done():
            return
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)

    def run() -> None:
        try:
            result, exc = fn(*args), None
        except BaseException as e:  # handed to the awaiting task
            result, exc = None, e
        try:
            loop.call_soon_threadsafe(settle, result, exc)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass

    _admit_executor().submit(run)
    return await fut
