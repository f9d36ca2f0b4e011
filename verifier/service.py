"""The verifier stage the gateway calls (implements :class:`verifier.stage.VerifierStage`).

- :meth:`VerifierService.admit` (admission, before forwarding) decodes token-id prompts with the
  model's tokenizer and indexes the prompt in the leak index and the canary registry (every
  tenant, sampled or not: the index must know every prompt to recognise it elsewhere), in a
  thread of its own that the request awaits: a tenant's prompt costs its own time, and a later
  check finds it indexed. One tenant's ingests run ``ingest_concurrency_per_tenant`` at a time;
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
  text leaves. A strict response with more than ``strict_max_text_bytes`` of text is withheld
  (never released unchecked). Their blocking work
  (tokenizing, hashing, the store round trip, the service lock the worker may hold for a whole
  batch, incident records) runs in a small dedicated thread pool (:attr:`STRICT_THREADS`), so a
  strict request never blocks the event loop; each guard call awaits its own work, so order
  and withholding are unchanged.
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
import contextvars
import functools
import logging
import random
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from config.models import Settings, TenantConfig
from config.redis_client import redis_client as redis_client_for
from verifier.canary import CanaryRegistry, CanaryScanner
from verifier.caps import TenantCaps
from verifier.findings import (
    Evidence,
    Findings,
    StoreHealth,
    StoreSkipped,
    incident,
    kvgate_planted,
    strip_echo,
    trusted,
)
from verifier.incidents import CHECKS, Incident, IncidentSink
from verifier.jobs import FATAL, INLINE_INGEST_BYTES, CheckJob, IngestBudget, IngestJob, JobQueue, PendingIndex
from verifier.latency import LatencyKeeper, LatencyModel, RedisLatencyStore
from verifier.leak_index import LeakIndex, LeakStore, LeakVerdict, MemoryLeakStore, RedisLeakStore, RedisSpreadStore
from verifier.quarantine import FileQuarantineBackend, Quarantine, RedisQuarantineBackend
from verifier.shingles import IncrementalShingler, ShingleHasher, encode
from verifier.stage import Decoder, Exchange, ExchangeRequest, ResponseWithheld

log = logging.getLogger("kvgate.verifier")

#: ``strip_echo`` lives in :mod:`verifier.findings`; it is re-exported here for its callers
__all__ = ["VerifierService", "strip_echo"]

#: most characters of one response a background guard keeps for its check
MAX_CHECK_CHARS = 4 * 1024 * 1024


class VerifierService:
    """The gateway's verifier. Build one per gateway process; call :meth:`aclose` at shutdown.

    - ``settings``: the gateway's :class:`~config.models.Settings` (``verifier`` section,
      ``redis_url``, ``state_dir``).
    - ``secrets``: ``{"leak_index_key": bytes, ...}`` (``config.secrets.load_secrets``); loaded
      from ``state_dir`` when ``None``.
    - ``redis_client``: a synchronous redis-py client (default: from ``settings.redis_url`` by
      :func:`config.redis_client.redis_client`, any mode, with its ``redis.asyncio`` twin beside
      it for small prompts' admission writes; ``None`` and no URL = in-process stores and the
      quarantine state file).
    - ``key_prefix``: Redis key prefix (tests use their own).
    - ``rng``: ``random.Random`` for sampling (tests seed it).
    - ``probe_targets``: for the periodic probe (``verifier.probe_interval_seconds``): a list of
      :class:`verifier.probe.ProbeTarget`; default: every upstream, straight at the engine.
    - ``tenant_source``: ``tenant id -> TenantConfig | None`` (the gateway's tenant table, e.g.
      ``TenantRegistry.get``), asked first whether a canary's owner is a honeypot: with several
      gateway workers, the honeypot's own request may have been served by another process.

    The stage API and the strict path live here; the work is done by collaborators with one job
    each: :attr:`ingest` (admission-time indexing, :class:`verifier.jobs.IngestBudget`),
    :attr:`jobs` (the background queue, :class:`verifier.jobs.JobQueue`), :attr:`findings`
    (detectors as incidents, :class:`verifier.findings.Findings`), :attr:`evidence` (incident
    records and quarantine, :class:`verifier.findings.Evidence`) and the periodic probe.
    """

    def __init__(
        self,
        settings: Settings,
        tenants: Iterable[TenantConfig] = (),
        *,
        secrets: dict[str, bytes] | None = None,
        redis_client=None,
        key_prefix: str = "kvgate:",
        rng: random.Random | None = None,
        incident_path: str | None = None,
        probe_targets: list | None = None,
        tenant_source: Callable[[str], TenantConfig | None] | None = None,
    ) -> None:
        self.settings = settings
        self.cfg = cfg = settings.verifier
        self.tenants = {t.id: t for t in tenants}
        self.tenant_source = tenant_source
        if secrets is None:
            from config.secrets import load_secrets

            secrets = load_secrets(settings.state_dir)
        key = secrets["leak_index_key"]
        aredis_client = None
        if redis_client is None and settings.redis_url:
            # strict checks call the store on the request path: the quotas' bound on every connect
            # and read, no retries; the asyncio client is for small prompts' admission-time
            # writes on the event loop
            timeout = settings.quotas.redis_timeout_seconds
            redis_client = redis_client_for(settings.redis_url, timeout, sync=True)
            aredis_client = redis_client_for(settings.redis_url, timeout)
        self.redis = redis_client
        self.aredis = aredis_client
        leak_store: LeakStore
        canary_store: LeakStore
        qbackend: RedisQuarantineBackend | FileQuarantineBackend
        if redis_client is not None:
            ttl = cfg.leak_index_ttl_seconds
            leak_store = RedisLeakStore(redis_client, ttl, key_prefix + "leak:", aclient=aredis_client)
            canary_store = RedisLeakStore(redis_client, ttl, key_prefix + "canary:", aclient=aredis_client)
            spread_store: LeakStore = RedisSpreadStore(
                redis_client, cfg.public_text_window_seconds, key_prefix + "spread:", cap=cfg.public_text_tenants + 1
            )
            qbackend = RedisQuarantineBackend(redis_client, key_prefix)
        else:
            leak_store = MemoryLeakStore(cfg.leak_index_ttl_seconds)
            canary_store = MemoryLeakStore(cfg.leak_index_ttl_seconds)
            spread_store = MemoryLeakStore(cfg.public_text_window_seconds)
            qbackend = FileQuarantineBackend(settings.state_dir)
        self.hasher = ShingleHasher(key, cfg.shingle_k)
        self.index = LeakIndex(leak_store, self.hasher, cfg.winnow_w, spread_store, cfg.public_text_tenants)
        self.canaries = CanaryRegistry(canary_store, key)
        self.quarantine = Quarantine(qbackend)
        self.latency = LatencyModel(
            quantile=cfg.latency_quantile,
            margin=cfg.latency_margin,
            min_samples=cfg.latency_min_samples,
            min_prompt_tokens=cfg.latency_min_prompt_tokens,
            tenant_share=cfg.latency_tenant_share,
            min_tenants=cfg.latency_min_tenants,
        )
        #: keeps calibration samples where they outlive the process (Redis), or in memory only
        path = incident_path or cfg.incident_log or str(Path(settings.state_dir) / "incidents.jsonl")
        self.incidents = IncidentSink(path)
        self.rng = rng or random.Random()
        self.probe_targets = probe_targets
        #: counts for tests, benchmarks and the admin view
        self.stats: collections.Counter = collections.Counter()
        #: the service lock: the store, the own-shingle cache and the latency model
        self._lock = threading.Lock()
        store = RedisLatencyStore(redis_client, key_prefix) if redis_client is not None else None
        self.latency_keeper = LatencyKeeper(self.latency, store, self._lock, self.stats)
        own_cache: dict[str, set[int]] = {}
        self.store = StoreHealth(self.stats)
        self.evidence = Evidence(cfg, self.quarantine, self.incidents, self.stats)
        probe_tenant = cfg.probe_tenant or "kvgate-probe"
        self.findings = Findings(
            cfg,
            self.index,
            self.canaries,
            self.latency,
            self.store,
            self.evidence,
            own_cache,
            lambda tid: kvgate_planted(tid, self.tenant_source, self.tenants, probe_tenant),
        )
        #: per-tenant caps on indexed fingerprints and canaries
        self.caps = TenantCaps(cfg)
        self.ingest = IngestBudget(
            cfg, self.hasher, self.index, self.canaries, self.store, self._lock, self.stats, self.caps
        )
        self.jobs = JobQueue(cfg, self.findings, self._lock, own_cache, self.stats, self.caps)
        #: the queued jobs (read by :meth:`drain` and tests)
        self._jobs = self.jobs.jobs
        #: admission's indexing step, called in a thread of its own (an attribute, so a test can
        #: slow it down)
        self._admit_ingest = self.ingest.index_prompt
        self._tasks: list[asyncio.Task] = []
        self._strict_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._closed = False

    @property
    def _ingest_pending_bytes(self) -> int:
        """Prompt bytes reserved by admission-time ingests not yet finished (tests read it)."""
        return self.ingest.pending_bytes

    # ------------------------------------------------------------------ lifecycle
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
        if self.cfg.probe_interval_seconds:
            prober = _Prober(self)
            self._tasks.append(loop.create_task(prober.loop(), name="kvgate-verifier-probe"))

    async def drain(self, timeout: float = 30.0) -> None:
        """Wait until every queued job has been processed (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        while self._jobs or self.stats["in_flight"]:
            if self.jobs.wake is not None:
                self.jobs.wake.set()
            if time.monotonic() > deadline:
                raise TimeoutError(f"verifier queue not drained: {len(self._jobs)} jobs left")
            await asyncio.sleep(0.005)

    async def aclose(self) -> None:
        """Finish queued work (bounded by the gateway's drain) and stop the tasks."""
        if self._tasks:
            try:
                await self.drain(timeout=5.0)
            except TimeoutError:
                log.warning("verifier: %d jobs dropped at shutdown", len(self._jobs))
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
        pool, self._strict_pool = self._strict_pool, None
        if pool is not None:
            pool.shutdown(wait=False)
        if self.aredis is not None:
            with contextlib.suppress(Exception):
                await self.aredis.aclose()

    #: threads for strict guards' checks (they serialize on the service lock for the store
    #: part; the pool is separate from the loop's default executor, so strict requests waiting
    #: on the lock never starve other ``to_thread`` users such as prompt counting)
    STRICT_THREADS = 4

    async def run_strict(self, fn, /, *args, **kwargs):
        """Run ``fn(*args, **kwargs)`` (a strict guard's blocking step) in the strict thread
        pool and return its result or raise its exception (:class:`ResponseWithheld`
        included). The caller's context variables go with it (as :func:`asyncio.to_thread`).
        Needs a running event loop."""
        loop = asyncio.get_running_loop()
        if self._strict_pool is None:
            self._strict_pool = concurrent.futures.ThreadPoolExecutor(
                self.STRICT_THREADS, thread_name_prefix="kvgate-verifier-strict"
            )
        ctx = contextvars.copy_context()
        return await loop.run_in_executor(self._strict_pool, functools.partial(ctx.run, fn, *args, **kwargs))

    def health(self) -> dict[str, bool]:
        """Named readiness checks (``/readyz``): ``verifier_worker`` is false once the background
        worker has stopped (sampled responses would go unchecked)."""
        worker = self._tasks[0] if self._tasks else None
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

    async def admit(
        self, exchange: Exchange, decode: Decoder | None = None, *, defer_write: bool = False
    ) -> PendingIndex | None:
        """Admission-time work of one request, awaited before it is forwarded (see the module
        doc): decode ``exchange.prompt_ids`` with ``decode`` (the model tokenizer's ``adecode``;
        a failure, or no decoder, leaves ``own_text_complete`` false and is counted as
        ``decode_failed``), then tokenize and fingerprint the prompt and add it to the leak index
        and the canary registry (a prompt of at most :data:`~verifier.jobs.INLINE_INGEST_BYTES`
        with Redis stores: on the event loop, one awaited call per store; otherwise in a thread
        of its own), and keep its own-shingle set on the
        exchange when the response will be checked. Over the pending-ingest byte budget the
        prompt is not indexed (``kvgate_verifier_dropped_total{reason="ingest_bytes"}``). Never
        raises, except :class:`asyncio.CancelledError` when the request is cancelled.
        ``defer_write`` (a small prompt with Redis stores): return the writes unsent, as a
        :class:`~verifier.jobs.PendingIndex`, for the caller to send with its quota reservation
        (one round trip for both) and then ``finish``; otherwise returns ``None``."""
        if not self.cfg.enabled or exchange.state.admitted:
            return None
        try:
            self.start()
        except RuntimeError:
            pass
        tenant = exchange.request.tenant
        self.tenants[tenant.id] = tenant
        self._decide_sampled(exchange)
        if exchange.prompt_ids:
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
        exchange.state.admitted = True
        text = exchange.prompt_text
        nbytes = len(text) if text.isascii() else len(text.encode("utf-8", "replace"))
        if not self.ingest.reserve(nbytes):
            return None
        try:
            if nbytes <= INLINE_INGEST_BYTES and self.ingest.inline_store():
                pending = self.ingest.prepare_small(exchange, text, nbytes)  # no ingest slot: no thread
                if defer_write:
                    return pending
                await pending.finish()
                return None
            await self._ingest_in_thread(exchange, text, nbytes)
        except FATAL:
            raise
        except BaseException as e:  # a tokenizer panic: the prompt goes unindexed, the request on
            self.jobs.fault("ingest", e)
        return None

    async def _ingest_in_thread(self, exchange: Exchange, text: str, nbytes: int) -> None:
        started = False
        try:
            async with self.ingest.semaphore(exchange.request.tenant.id):
                started = True
                await _in_own_thread(self._admit_ingest, exchange, text, nbytes)
        finally:
            if not started:
                self.ingest.release(nbytes)

    def begin(self, exchange: Exchange) -> _BackgroundGuard | _StrictGuard | None:
        """A guard when sampled or strict (see the module doc). An exchange that did not pass
        :meth:`admit` has its prompt queued for the background worker."""
        if not self.cfg.enabled:
            return None
        try:
            self.start()
        except RuntimeError:  # no running loop: synchronous use (tests, benchmarks)
            pass
        tenant = exchange.request.tenant
        self.tenants[tenant.id] = tenant  # honeypot flags come with the exchanges
        sampled = self._decide_sampled(exchange)
        if not exchange.state.admitted:
            self.jobs.enqueue(IngestJob(tenant.id, exchange.prompt_text, exchange.internal_id, sampled))
        if tenant.strict_verify:
            return _StrictGuard(self, exchange)
        if sampled:
            return _BackgroundGuard(self, exchange)
        return None

    def is_quarantined(self, upstream: str, prompt_tokens: int) -> bool:
        """Whether ``upstream`` is quarantined for prompts of this length."""
        return self.quarantine.is_quarantined(upstream, prompt_tokens)

    # ------------------------------------------------------------------ strict path
    # used by the strict guard, in the strict thread pool (these block: lock, store, hashing)
    def latency_precheck(self, exchange: Exchange, ttft_seconds: float) -> Incident | None:
        """A strict stream's first text arrived ``ttft_seconds`` after the request: an incident
        (not recorded) when that is below the calibrated bound for the whole prompt; calibration
        is not touched. The cached-token count is not known yet, so the caller only holds the
        stream back until the end. Takes the service lock: call it off the event loop."""
        with self._lock:
            lv = self.latency.judge(
                exchange.request.upstream,
                exchange.request.prompt_tokens,
                ttft_seconds,
                "stream",
                model=exchange.request.model,
            )
        if not lv.anomaly:
            return None
        return self.findings.latency_incident(exchange, ttft_seconds, lv, None)

    def strict_check_body(self, job: CheckJob) -> list[Incident]:
        """A strict non-streamed body, checked whole: the incidents that withhold it (recorded).
        Blocking; run it via :meth:`run_strict`."""
        with self._lock:
            self.jobs.drain_ingests_locked(job.exchange)
            return self.findings.check_whole_locked(job, self.stats)

    def strict_check_piece(self, guard: _StrictGuard, canaries: list[str], ids_list: list[list[int]]) -> list[Incident]:
        """Incremental stream check of a strict guard: new canaries and, per text stream, the
        token ids whose shingles are new. Returns content incidents (not yet recorded) once the
        evidence so far reaches the withhold threshold. Blocking; run it via :meth:`run_strict`."""
        exchange = guard.exchange
        f = self.findings
        with self._lock:
            self.jobs.drain_ingests_locked(exchange)
            own = f.own_locked(exchange)
            found: list[Incident] = []
            try:
                if (canaries or any(ids_list)) and not self.store.up():
                    raise StoreSkipped
                if canaries:
                    found += f.canary(exchange, canaries)
                for ids in ids_list:
                    if ids:
                        guard.verdict.merge(
                            self.index.check_ids(
                                exchange.request.tenant.id, ids, own, guard.seen, record_spread=trusted(exchange)
                            )
                        )
            except StoreSkipped:
                pass
            except Exception as e:  # the store is down: fail open (counted), latency still applies
                self.store.error(e)
        leak = f.leak(exchange, guard.verdict)
        if leak:
            found.append(leak)
        return found


class _Prober:
    """The periodic probe (``verifier.probe_interval_seconds``): plants the probe tenant's
    canaries through each target and records a confirmed ``probe`` incident for each leak."""

    def __init__(self, service: VerifierService) -> None:
        self.service = service
        self.tenant_id = service.cfg.probe_tenant or "kvgate-probe"

    async def loop(self) -> None:
        """Run the probe every interval, forever (the service cancels it)."""
        from verifier.probe import run_probe_targets, targets_from_settings

        svc = self.service
        interval = float(svc.cfg.probe_interval_seconds or 0)
        while True:
            await asyncio.sleep(interval)
            try:
                targets = svc.probe_targets or targets_from_settings(svc.settings)
                results = await run_probe_targets(targets, register=self.register)
            except Exception as e:
                log.warning("verifier probe failed to run: %s", e)
                continue
            for target, result in results:
                svc.stats["probes"] += 1
                if result.outcome == "leak":
                    request = ExchangeRequest(
                        f"probe-{int(time.time())}",
                        TenantConfig(id=self.tenant_id, honeypot=True),
                        target.upstream,
                        target.model or "",  # ExchangeRequest.model: "" when unnamed, as in verifier/latency.py
                        "/v1/completions",
                        result.limit or 0,
                        False,
                        time.monotonic(),
                    )
                    ex = Exchange(request, "")
                    inc = incident(
                        "probe",
                        ex,
                        {"surfaced_canaries": result.surfaced, "limit_tokens": result.limit or 0},
                        confirmed=True,
                    )
                    svc.evidence.record([inc])

    def register(self, canaries: list[str]) -> None:
        """Register the probe's canaries as the probe tenant's."""
        with self.service._lock:
            self.service.canaries.register(self.tenant_id, canaries)


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


class _EchoStrip:
    """:func:`strip_echo` for a text that arrives in pieces: while the text so far is a prefix of
    one of the prompts it is swallowed (kept for :meth:`flush`); once it is a whole prompt (or
    diverges from every one) the rest passes. Each piece costs its own length, not the prompt's."""

    def __init__(self, prompts: Sequence[str]) -> None:
        self._cands = [(p.rstrip("\ufffd"), len(p) > len(p.rstrip("\ufffd"))) for p in prompts if p.rstrip("\ufffd")]
        self._buf: list[str] = []
        self._n = 0
        self._extra = 0  # characters of a cut character still to swallow after a whole prompt
        self.done = not self._cands

    def push(self, piece: str) -> str:
        """Text of ``piece`` that is not echo (maybe ``""``)."""
        if self.done:
            return piece
        if self._extra:
            self.done = True
            return piece[1:]
        live = []
        for core, cut in self._cands:
            seg = core[self._n : self._n + len(piece)]
            if piece.startswith(seg) and (len(seg) == len(piece) or self._n + len(seg) == len(core)):
                live.append((core, cut))
        if not live:  # not an echo: everything held passes
            self.done = True
            held, self._buf = "".join(self._buf), []
            return held + piece
        self._cands = live
        self._n += len(piece)
        finished = [(c, cut) for c, cut in live if self._n >= len(c)]
        if finished:
            core, cut = max(finished, key=lambda x: len(x[0]))
            rest = piece[len(piece) - (self._n - len(core)) :] if self._n > len(core) else ""
            self._buf = []
            if cut and not rest:
                self._extra = 1
                return ""
            self.done = True
            return rest[1:] if cut else rest
        self._buf.append(piece)
        return ""

    @property
    def held_chars(self) -> int:
        """Characters swallowed that may still turn out not to be an echo (not yet checked)."""
        return sum(len(b) for b in self._buf)

    def flush(self) -> str:
        """What is still swallowed at the end (a partial echo: the tenant's own text anyway)."""
        held, self._buf = "".join(self._buf), []
        self.done = True
        return held


class _TextStream:
    """One text stream of a strict guard (a choice's field): echo strip, canary scan, shingler,
    and how far it has been checked: ``checked_tokens`` is the stream's token count up to the
    last piece whose every character the shingler has encoded (text still buffered for a safe
    cut, or swallowed as a possible echo, is not checked yet)."""

    __slots__ = ("_bounds", "_chars", "checked_tokens", "echo", "scanner", "shingler", "tokens")

    def __init__(self, service: VerifierService, exchange: Exchange) -> None:
        self.echo = _EchoStrip(exchange.echo_prompts) if exchange.echo else None
        self.scanner = CanaryScanner()
        self.shingler = IncrementalShingler(service.hasher, max_pending_chars=256)
        self.tokens = 0
        self.checked_tokens = 0
        self._chars = 0
        self._bounds: collections.deque[tuple[int, int]] = collections.deque()  # (chars, tokens) at piece ends

    def _advance(self) -> None:
        pending = self.shingler.pending_chars + (self.echo.held_chars if self.echo is not None else 0)
        done = self._chars - pending
        while self._bounds and self._bounds[0][0] <= done:
            self.checked_tokens = self._bounds.popleft()[1]

    def push(self, piece: str, tokens: int) -> tuple[list[str], list[int]]:
        self._chars += len(piece)
        self.tokens += tokens
        self._bounds.append((self._chars, self.tokens))
        cans: list[str] = []
        ids: list[int] = []
        text = self.echo.push(piece) if self.echo is not None else piece
        if text:
            cans, ids = self.scanner.push(text), self.shingler.push(text)
        self._advance()
        return cans, ids

    def flush(self) -> tuple[list[str], list[list[int]]]:
        """End of the text: canaries and id runs (each with its own ``k - 1`` carry) still due."""
        cans: list[str] = []
        runs: list[list[int]] = []
        if self.echo is not None:
            held = self.echo.flush()
            if held:
                cans = self.scanner.push(held)
                runs.append(self.shingler.push(held))
        runs.append(self.shingler.flush())
        self.checked_tokens = self.tokens
        self._bounds.clear()
        return cans, runs


def _pieces(delta_text: str, pieces: Sequence[tuple[str, str]] | None) -> list[tuple[str, str]]:
    if pieces is None:
        return [("0", delta_text)] if delta_text else []
    return [(k, t) for k, t in pieces if t]


class _BackgroundGuard:
    """Sampled, non-strict: passes everything at once; the check runs in the background. Its
    coroutines never suspend (no thread hop per event): they only append to a list or queue."""

    def __init__(self, service: VerifierService, exchange: Exchange) -> None:
        self.service = service
        self.exchange = exchange
        self._parts: dict[str, list[str]] = {}
        self._chars = 0

    async def feed(
        self, delta_text: str, raw_event: bytes, pieces: Sequence[tuple[str, str]] | None = None
    ) -> list[bytes]:
        for key, text in _pieces(delta_text, pieces):
            if self._chars < MAX_CHECK_CHARS:
                self._parts.setdefault(key, []).append(text)
                self._chars += len(text)
        return [raw_event]

    async def finish_stream(
        self, *, usage: dict[str, Any] | None, finish_reason: str | None, ttft_seconds: float | None
    ) -> list[bytes]:
        texts = ["".join(p) for p in self._parts.values()]
        self.service.jobs.enqueue(CheckJob(self.exchange, texts, usage, finish_reason, ttft_seconds))
        return []

    async def check_body(
        self,
        text: str | Sequence[str],
        *,
        usage: dict[str, Any] | None,
        finish_reason: str | None,
        ttft_seconds: float | None,
    ) -> None:
        texts, room = [], MAX_CHECK_CHARS
        for t in [text] if isinstance(text, str) else text:
            if room > 0 and t:
                texts.append(t[:room])
                room -= len(texts[-1])
        self.service.jobs.enqueue(CheckJob(self.exchange, texts, usage, finish_reason, ttft_seconds))


class _StrictGuard:
    """Strict tenant: nothing detected leaves, and nothing unchecked. Streams are held back by
    ``strict_holdback_tokens`` tokens and checked as shingles and canaries complete, each text
    stream (choice and field) on its own. A first token faster than the latency bound holds the
    whole rest of the stream until its end, where the usage's cached-token count decides. More
    than ``strict_max_text_bytes`` of text cuts the stream (withheld, ``oversize``).

    Each call's blocking part runs in the service's strict thread pool
    (:meth:`VerifierService.run_strict`) and the call returns only when it is done; calls are
    awaited one at a time, so the guard's state is touched by one thread at a time. An event
    without text needs no check and is handled on the loop."""

    def __init__(self, service: VerifierService, exchange: Exchange) -> None:
        self.service = service
        self.exchange = exchange
        self.holdback = service.cfg.strict_holdback_tokens
        #: held events: raw bytes and, per text stream it added to, that stream's token total after it
        self._held: collections.deque[tuple[bytes, dict[str, int]]] = collections.deque()
        self.seen: set[int] = set()
        self.verdict = LeakVerdict()
        self._streams: dict[str, _TextStream] = {}
        self._cut: ResponseWithheld | None = None
        self._first_text_seen = False
        self._suspect: Incident | None = None
        self._text_bytes = 0

    def _withhold(self, found: list[Incident]) -> None:
        if self._suspect is not None and all(i.detector != "latency" for i in found):
            found = [*found, self._suspect]  # the first token was too fast as well: say so
        self._suspect = None
        self.service.evidence.record(found, withheld=True, exchange=self.exchange)
        self.service.stats["withheld"] += 1
        self._held.clear()
        self._cut = ResponseWithheld(found[0].id, found[0].detector)
        raise self._cut

    async def _checked(self, fn, /, *args):
        """:meth:`VerifierService.run_strict` of a check; a check that raises anything but a
        withholding or :data:`~verifier.jobs.FATAL` (a tokenizer panic) could not check the
        text, so the response is withheld (a ``check_fault`` incident): never released unchecked."""
        try:
            return await self.service.run_strict(fn, *args)
        except (ResponseWithheld, *FATAL):
            raise
        except BaseException as e:
            self.service.jobs.fault("strict", e)
            inc = incident("check_fault", self.exchange, {"error": type(e).__name__[:80]})
            self.service.evidence.record([inc], withheld=True, exchange=self.exchange)
            self.service.stats["withheld"] += 1
            self._held.clear()
            self._cut = ResponseWithheld(inc.id, inc.detector)
            raise self._cut from None

    def _release(self) -> list[bytes]:
        """The held events, in order, each once every text stream it added to has at least
        ``holdback`` *checked* tokens of that stream behind it (per stream: two interleaved
        choices do not count each other's tokens; text the shingler still buffers, such as a
        run of CJK without a safe cut, is not checked yet); none while the stream is suspect."""
        out: list[bytes] = []
        if self._suspect is not None:
            return out
        streams = self._streams
        while self._held:
            raw, ends = self._held[0]
            if any(streams[k].checked_tokens - end < self.holdback for k, end in ends.items()):
                break
            self._held.popleft()
            out.append(raw)
        return out

    async def feed(
        self, delta_text: str, raw_event: bytes, pieces: Sequence[tuple[str, str]] | None = None
    ) -> list[bytes]:
        if self._cut is not None:
            raise self._cut
        ps = _pieces(delta_text, pieces)
        if not ps:  # no tokens, nothing to check: no thread hop
            self._held.append((raw_event, {}))
            return self._release()
        # the first text's arrival time is taken here, not after the hop
        return await self._checked(self._feed_text, ps, raw_event, time.monotonic())

    def _stream(self, key: str) -> _TextStream:
        st = self._streams.get(key)
        if st is None:
            st = self._streams[key] = _TextStream(self.service, self.exchange)
        return st

    def _feed_text(self, pieces: list[tuple[str, str]], raw_event: bytes, now: float) -> list[bytes]:
        """:meth:`feed`'s blocking part (strict pool thread): count, pre-check, check, release."""
        self._text_bytes += sum(len(t.encode("utf-8", "replace")) for _, t in pieces)
        if self._text_bytes > self.service.cfg.strict_max_text_bytes:
            self._withhold([self.service.findings.oversize(self.exchange, self._text_bytes)])
        if not self._first_text_seen:
            self._first_text_seen = True
            self._suspect = self.service.latency_precheck(self.exchange, now - self.exchange.request.started_monotonic)
        ends: dict[str, int] = {}
        cans: list[str] = []
        ids_list: list[list[int]] = []
        for key, text in pieces:
            st = self._stream(key)
            c, ids = st.push(text, len(encode(text)))
            ends[key] = st.tokens
            cans += c
            ids_list.append(ids)
        self._held.append((raw_event, ends))
        if cans or any(ids_list):
            found = self.service.strict_check_piece(self, cans, ids_list)
            if found:
                self._withhold(found)
        return self._release()

    async def finish_stream(
        self, *, usage: dict[str, Any] | None, finish_reason: str | None, ttft_seconds: float | None
    ) -> list[bytes]:
        if self._cut is not None:
            raise self._cut
        return await self._checked(self._finish_stream, usage, finish_reason, ttft_seconds)

    def _finish_stream(
        self, usage: dict[str, Any] | None, finish_reason: str | None, ttft_seconds: float | None
    ) -> list[bytes]:
        """:meth:`finish_stream`'s blocking part (strict pool thread)."""
        svc = self.service
        cans: list[str] = []
        ids_list: list[list[int]] = []
        for st in self._streams.values():
            c, runs = st.flush()
            cans += c
            ids_list += runs
        found = svc.strict_check_piece(self, cans, ids_list)
        CHECKS.labels(self.exchange.request.upstream, "strict").inc()
        svc.stats["checked"] += 1
        if found:
            self._withhold(found)
        with svc._lock:
            withhold, tail = svc.findings.tail(self.exchange, usage, finish_reason, ttft_seconds, strict=True)
        svc.evidence.record(tail, exchange=self.exchange)
        if withhold:
            self._withhold(withhold)
        out = [raw for raw, _ in self._held]
        self._held.clear()
        return out

    async def check_body(
        self,
        text: str | Sequence[str],
        *,
        usage: dict[str, Any] | None,
        finish_reason: str | None,
        ttft_seconds: float | None,
    ) -> None:
        texts = [text] if isinstance(text, str) else [t for t in text if t]
        found = await self._checked(
            self.service.strict_check_body, CheckJob(self.exchange, texts, usage, finish_reason, ttft_seconds)
        )
        if found:
            self.service.stats["withheld"] += 1
            raise ResponseWithheld(found[0].id, found[0].detector)
