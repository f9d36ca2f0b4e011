"""The verifier stage the gateway calls (implements :class:`verifier.stage.VerifierStage`).

- :meth:`VerifierService.begin` queues the prompt for the leak index and the canary registry
  (every tenant, sampled or not: the index must know every prompt to recognise it elsewhere) and
  returns a guard when the response is sampled (``verify_sample_rate``) or the tenant is strict.
- Non-strict guards pass every event through at once and hand the whole text to a bounded
  background queue; a worker (a thread per job, so the event loop stays free) runs the detectors.
- Strict guards (``strict_verify``) check before release: a non-streamed body is checked in
  :meth:`check_body` (raises :class:`ResponseWithheld`); a stream is held back by
  ``strict_holdback_tokens`` tokens, checked incrementally (canaries and leak-index shingles as
  they complete) and cut on detection, so no detected text leaves. Their blocking work
  (tokenizing, hashing, the store round trip, the service lock the worker may hold for a whole
  batch, incident records) runs in a small dedicated thread pool (:attr:`STRICT_THREADS`), so a
  strict request never blocks the event loop; each guard call awaits its own work, so order
  and withholding are unchanged.
- Detectors: canary scan (:mod:`verifier.canary`), leak index (:mod:`verifier.leak_index`),
  usage drift and ``finish_reason: abort`` (:mod:`verifier.drift`), TTFT lower bounds
  (:mod:`verifier.latency`). Findings become incidents (:mod:`verifier.incidents`); a confirmed
  leak quarantines the upstream (:mod:`verifier.quarantine`).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextvars
import functools
import logging
import random
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from config.models import Settings, TenantConfig
from verifier.canary import CanaryRegistry, CanaryScanner, find_canaries
from verifier.drift import check_finish, check_usage
from verifier.incidents import CHECKS, DROPPED, QUARANTINES, Incident, IncidentSink
from verifier.latency import LatencyModel
from verifier.leak_index import LeakIndex, LeakVerdict, MemoryLeakStore, RedisLeakStore
from verifier.quarantine import FileQuarantineBackend, Quarantine, RedisQuarantineBackend
from verifier.shingles import IncrementalShingler, ShingleHasher, encode
from verifier.stage import Exchange, ResponseWithheld

log = logging.getLogger("kvgate.verifier")

#: most characters of one response a background guard keeps for its check
MAX_CHECK_CHARS = 4 * 1024 * 1024


class _StoreSkipped(Exception):
    """The store is in its back-off after an error."""


@dataclass
class _Ingest:
    tenant: str
    text: str
    request_id: str = ""
    keep_own: bool = False


@dataclass
class _Check:
    exchange: Exchange
    text: str
    usage: dict[str, Any] | None
    finish_reason: str | None
    ttft_seconds: float | None


class VerifierService:
    """The gateway's verifier. Build one per gateway process; call :meth:`aclose` at shutdown.

    - ``settings``: the gateway's :class:`~config.models.Settings` (``verifier`` section,
      ``redis_url``, ``state_dir``).
    - ``secrets``: ``{"leak_index_key": bytes, ...}`` (``config.secrets.load_secrets``); loaded
      from ``state_dir`` when ``None``.
    - ``redis_client``: a synchronous ``redis.Redis`` (default: from ``settings.redis_url``;
      ``None`` and no URL = in-process stores and the quarantine state file).
    - ``key_prefix``: Redis key prefix (tests use their own).
    - ``rng``: ``random.Random`` for sampling (tests seed it).
    - ``probe_targets``: for the periodic probe (``verifier.probe_interval_seconds``): a list of
      :class:`verifier.probe.ProbeTarget`; default: every upstream, straight at the engine.
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
    ) -> None:
        self.settings = settings
        self.cfg = cfg = settings.verifier
        self.tenants = {t.id: t for t in tenants}
        if secrets is None:
            from config.secrets import load_secrets

            secrets = load_secrets(settings.state_dir)
        key = secrets["leak_index_key"]
        if redis_client is None and settings.redis_url:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry

            # strict checks call the store on the request path: short timeouts, no retries
            redis_client = redis.Redis.from_url(
                settings.redis_url, socket_timeout=0.25, socket_connect_timeout=0.25, retry=Retry(NoBackoff(), 0)
            )
        self.redis = redis_client
        if redis_client is not None:
            leak_store = RedisLeakStore(redis_client, cfg.leak_index_ttl_seconds, key_prefix + "leak:")
            canary_store = RedisLeakStore(redis_client, cfg.leak_index_ttl_seconds, key_prefix + "canary:")
            qbackend = RedisQuarantineBackend(redis_client, key_prefix)
        else:
            leak_store = MemoryLeakStore(cfg.leak_index_ttl_seconds)
            canary_store = MemoryLeakStore(cfg.leak_index_ttl_seconds)
            qbackend = FileQuarantineBackend(settings.state_dir)
        self.hasher = ShingleHasher(key, cfg.shingle_k)
        self.index = LeakIndex(leak_store, self.hasher, cfg.winnow_w)
        self.canaries = CanaryRegistry(canary_store, key)
        self.quarantine = Quarantine(qbackend)
        self.latency = LatencyModel(
            quantile=cfg.latency_quantile,
            margin=cfg.latency_margin,
            min_samples=cfg.latency_min_samples,
            min_prompt_tokens=cfg.latency_min_prompt_tokens,
        )
        path = incident_path or cfg.incident_log or str(Path(settings.state_dir) / "incidents.jsonl")
        self.incidents = IncidentSink(path)
        self.rng = rng or random.Random()
        self.probe_targets = probe_targets
        self._jobs: collections.deque = collections.deque()
        self._own_cache: dict[str, set[int]] = {}
        self._lock = threading.Lock()
        self._wake: asyncio.Event | None = None
        self._worker: asyncio.Task | None = None
        self._prober: asyncio.Task | None = None
        self._quarantine_refresher: asyncio.Task | None = None
        self._strict_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._closed = False
        #: after a store error, skip the store until this monotonic time (a down Redis must not
        #: cost every request a timeout)
        self._store_down_until = 0.0
        #: counts for tests, benchmarks and the admin view
        self.stats = collections.Counter()

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the background worker (and the periodic probe when configured). Needs a running
        event loop; :meth:`begin` calls it lazily."""
        if self._worker is not None or self._closed:
            return
        loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._worker = loop.create_task(self._work(), name="kvgate-verifier")
        self.quarantine.refresh()  # once at start-up; from now on only the refresher reads the store
        self.quarantine.inline_refresh = False
        self._quarantine_refresher = loop.create_task(self.quarantine.refresh_loop(), name="kvgate-verifier-quarantine")
        if self.cfg.probe_interval_seconds:
            self._prober = loop.create_task(self._probe_loop(), name="kvgate-verifier-probe")

    async def drain(self, timeout: float = 30.0) -> None:
        """Wait until every queued job has been processed (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        while self._jobs or self.stats["in_flight"]:
            if self._wake is not None:
                self._wake.set()
            if time.monotonic() > deadline:
                raise TimeoutError(f"verifier queue not drained: {len(self._jobs)} jobs left")
            await asyncio.sleep(0.005)

    async def aclose(self) -> None:
        """Finish queued work (bounded by the gateway's drain) and stop the tasks."""
        if self._worker is not None:
            try:
                await self.drain(timeout=5.0)
            except TimeoutError:
                log.warning("verifier: %d jobs dropped at shutdown", len(self._jobs))
        self._closed = True
        for task in (self._worker, self._prober, self._quarantine_refresher):
            if task is not None:
                task.cancel()
                try:
                    await task
                except (asyncio.CancelledError, Exception):
                    pass
        self._worker = self._prober = self._quarantine_refresher = None
        pool, self._strict_pool = self._strict_pool, None
        if pool is not None:
            pool.shutdown(wait=False)

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

    # ------------------------------------------------------------------ stage API
    def begin(self, exchange: Exchange) -> "_BackgroundGuard | _StrictGuard | None":
        """Queue the prompt for the index; return a guard when sampled or strict (see class doc)."""
        if not self.cfg.enabled:
            return None
        try:
            self.start()
        except RuntimeError:  # no running loop: synchronous use (tests, benchmarks)
            pass
        tenant = exchange.tenant
        self.tenants[tenant.id] = tenant  # honeypot flags come with the exchanges
        sampled = tenant.strict_verify or (
            tenant.verify_sample_rate > 0 and self.rng.random() < tenant.verify_sample_rate
        )
        self._enqueue(_Ingest(tenant.id, exchange.prompt_text, exchange.request_id, sampled))
        if tenant.strict_verify:
            return _StrictGuard(self, exchange)
        if sampled:
            return _BackgroundGuard(self, exchange)
        return None

    def is_quarantined(self, upstream: str, prompt_tokens: int) -> bool:
        """Whether a confirmed leak quarantined ``upstream`` for prompts of this length."""
        return self.quarantine.is_quarantined(upstream, prompt_tokens)

    # ------------------------------------------------------------------ queue
    def _enqueue(self, job: _Ingest | _Check) -> bool:
        if len(self._jobs) >= self.cfg.queue_size:
            DROPPED.labels("queue_full").inc()
            self.stats["dropped"] += 1
            return False
        self._jobs.append(job)
        if self._wake is not None:
            self._wake.set()
        return True

    async def _work(self) -> None:
        assert self._wake is not None
        while True:
            if not self._jobs:
                self._wake.clear()
                await self._wake.wait()
            self.stats["in_flight"] += 1
            try:
                await asyncio.to_thread(self._run_some, 32)
            except Exception:  # never let the worker die
                log.exception("verifier worker error")
            finally:
                self.stats["in_flight"] -= 1

    def _run_some(self, n: int) -> None:
        for _ in range(n):
            with self._lock:
                if not self._jobs:
                    return
                job = self._jobs.popleft()
                self._run_job(job)

    def _drain_ingests_locked(self) -> None:
        """Process queued prompt ingests now (a strict check must see every earlier prompt).
        Caller holds the lock (so no other consumer pops); runs in a strict-pool thread while
        the event loop may append (:meth:`_enqueue`) at the right end. Checks stay queued, in
        order, ahead of anything appended meanwhile."""
        if not any(isinstance(j, _Ingest) for j in list(self._jobs)):
            return
        keep: list[_Check] = []
        for _ in range(len(self._jobs)):  # the jobs queued now; later appends stay queued
            job = self._jobs.popleft()
            if isinstance(job, _Ingest):
                self._run_job(job)
            else:
                keep.append(job)
        # only the left end is touched here and only the right end by appends: no lost job
        self._jobs.extendleft(reversed(keep))

    def _run_job(self, job: _Ingest | _Check) -> None:
        try:
            if isinstance(job, _Ingest):
                if not self._store_up():
                    return
                self._ingest(job)
            else:
                self._check_whole(job)
        except Exception as e:  # a store error must not kill the worker
            self.stats["errors"] += 1
            self._store_error(e)

    # ------------------------------------------------------------------ detectors
    def _ingest(self, job: _Ingest) -> None:
        _, own = self.index.ingest(job.tenant, job.text, keep_own=job.keep_own)
        if own is not None:
            self._own_cache[job.request_id] = own
            while len(self._own_cache) > self.cfg.queue_size:  # guards that never finished
                self._own_cache.pop(next(iter(self._own_cache)))
        cans = find_canaries(job.text)
        if cans:
            self.canaries.register(job.tenant, cans)
        self.stats["ingested"] += 1

    def _own_locked(self, exchange: Exchange) -> set[int]:
        """The own-prompt shingle set of a sampled exchange (computed at ingest; caller holds the lock)."""
        own = self._own_cache.pop(exchange.request_id, None)
        return own if own is not None else self.index.own_shingles(exchange.prompt_text)

    def _canary_findings(self, exchange: Exchange, canaries: list[str]) -> list[Incident]:
        """Incidents for canaries found in a response that its own prompt does not hold."""
        own = set(find_canaries(exchange.prompt_text))
        cans = [c for c in canaries if c not in own]
        if not cans:
            return []
        matches = self.canaries.lookup(cans)
        foreign = [m for m in matches if m.owners and exchange.tenant.id not in m.owners and len(m.owners) == 1]
        unknown = [m for m in matches if not m.owners]
        if not foreign and not unknown:
            return []
        sources = sorted({o for m in foreign for o in m.owners})
        honeypot = any(self.tenants.get(s) is not None and self.tenants[s].honeypot for s in sources)
        ev = {
            "canaries": len(foreign) + len(unknown),
            "known_origin": len(foreign),
            "source_tenants": sources[:8],
            "honeypot": honeypot,
            "canary_hashes": [m.fingerprint for m in (foreign + unknown)[:8]],
        }
        return [self._incident("canary", exchange, ev, confirmed=bool(foreign))]

    #: seconds the store is skipped after an error
    STORE_BACKOFF_SECONDS = 5.0

    def _store_error(self, e: Exception) -> None:
        """A leak-index or canary-registry call failed (Redis down): counted, logged, and the
        store is skipped for :attr:`STORE_BACKOFF_SECONDS`."""
        DROPPED.labels("store_error").inc()
        self.stats["store_errors"] += 1
        self._store_down_until = time.monotonic() + self.STORE_BACKOFF_SECONDS
        log.warning(
            "verifier: leak-index store error, checks skip the store for %.0f s: %s", self.STORE_BACKOFF_SECONDS, e
        )

    def _store_up(self) -> bool:
        if time.monotonic() < self._store_down_until:
            DROPPED.labels("store_down").inc()
            self.stats["store_skipped"] += 1
            return False
        return True

    def _leak_finding(self, exchange: Exchange, verdict: LeakVerdict) -> Incident | None:
        if verdict.foreign < self.cfg.leak_min_shingles:
            return None
        ev = {
            "shingles_checked": verdict.checked,
            "shingles_own": verdict.own,
            "shingles_public": verdict.public,
            "shingles_foreign": verdict.foreign,
            "source_tenant": verdict.source_tenant,
            "evidence_hashes": verdict.evidence_hashes,
        }
        return self._incident("leak_index", exchange, ev, confirmed=verdict.foreign >= self.cfg.leak_confirm_shingles)

    def _incident(self, detector: str, exchange: Exchange, evidence: dict, confirmed: bool = False) -> Incident:
        ev = {"request_id": exchange.request_id, "prompt_tokens": exchange.prompt_tokens, **evidence}
        return Incident(detector, exchange.tenant.id, exchange.upstream, exchange.request_id, ev, confirmed)

    def _tail_findings(self, exchange: Exchange, usage, finish_reason, ttft_seconds) -> list[Incident]:
        """Drift, abort and latency findings (never withhold; reported)."""
        out = []
        d = check_usage(exchange.prompt_tokens, usage, self.cfg.usage_drift_tolerance_tokens)
        if d:
            out.append(self._incident(d.detector, exchange, d.evidence))
        f = check_finish(finish_reason)
        if f:
            out.append(self._incident(f.detector, exchange, f.evidence))
        lv = self.latency.observe(
            exchange.upstream, exchange.prompt_tokens, ttft_seconds, "stream" if exchange.stream else "whole"
        )
        if lv.anomaly:
            out.append(
                self._incident(
                    "latency",
                    exchange,
                    {
                        "ttft_ms": round(ttft_seconds * 1000, 3),
                        "bound_ms": round(lv.bound_seconds * 1000, 3),
                        "length_bucket": lv.bucket,
                    },
                )
            )
        return out

    def _record(self, incidents: list[Incident], withheld: bool = False) -> None:
        for inc in incidents:
            inc.withheld = withheld
            self.incidents.emit(inc)
            self.stats[f"incident_{inc.detector}"] += 1
            if inc.confirmed:
                self._quarantine(inc)

    def _quarantine(self, inc: Incident) -> None:
        if inc.upstream in self.quarantine.records():
            return
        try:
            self.quarantine.put(inc.upstream, inc.id, inc.detector, self.cfg.quarantine_min_prompt_tokens)
        except Exception as e:
            log.error("verifier: could not store quarantine of %s: %s", inc.upstream, e)
            return
        QUARANTINES.labels(inc.upstream).inc()
        log.error(
            "verifier: upstream %s quarantined for prompts above %d tokens (incident %s)",
            inc.upstream,
            self.cfg.quarantine_min_prompt_tokens,
            inc.id,
        )

    def _check_whole(self, job: _Check) -> list[Incident]:
        """Run every detector on a whole response (background or strict non-streamed). Returns
        the incidents that withhold a strict response: content findings (canary, leak index)
        and, for strict tenants, a latency anomaly (a long prompt answered impossibly fast is
        most likely someone else's KV)."""
        ex = job.exchange
        strict = ex.tenant.strict_verify
        CHECKS.labels(ex.upstream, "strict" if strict else "sampled").inc()
        self.stats["checked"] += 1
        content: list[Incident] = []
        try:
            if not self._store_up():
                raise _StoreSkipped
            content += self._canary_findings(ex, find_canaries(job.text))
            own = self._own_locked(ex)
            leak = self._leak_finding(ex, self.index.check_text(ex.tenant.id, job.text, own))
            if leak:
                content.append(leak)
        except _StoreSkipped:
            pass
        except Exception as e:  # the store is down: the other detectors still run
            self._store_error(e)
        tail = self._tail_findings(ex, job.usage, job.finish_reason, job.ttft_seconds)
        if strict:
            content += [i for i in tail if i.detector == "latency"]
            tail = [i for i in tail if i.detector != "latency"]
        self._record(content, withheld=strict)
        self._record(tail)
        return content

    def latency_precheck(self, exchange: Exchange, ttft_seconds: float) -> Incident | None:
        """A strict stream's first text arrived ``ttft_seconds`` after the request: an incident
        (not yet recorded) when that is below the calibrated bound; calibration is not touched.
        Takes the service lock: call it off the event loop (the strict guard does)."""
        with self._lock:
            if exchange.prompt_tokens < self.latency.min_prompt_tokens:
                return None
            bound = self.latency.bound(exchange.upstream, exchange.prompt_tokens, "stream")
        if bound is None or ttft_seconds >= bound:
            return None
        from verifier.latency import bucket_of

        return self._incident(
            "latency",
            exchange,
            {
                "ttft_ms": round(ttft_seconds * 1000, 3),
                "bound_ms": round(bound * 1000, 3),
                "length_bucket": bucket_of(exchange.prompt_tokens),
            },
        )

    # used by the strict guard, in the strict thread pool (these block: lock, store, hashing)
    def strict_check_body(self, job: _Check) -> list[Incident]:
        """A strict non-streamed body, checked whole after the queued ingests: the content
        incidents that withhold it (recorded). Blocking; run it via :meth:`run_strict`."""
        with self._lock:
            self._drain_ingests_locked()
            return self._check_whole(job)

    def strict_check_piece(self, guard: "_StrictGuard", canaries: list[str], ids: list[int]) -> list[Incident]:
        """Incremental stream check of a strict guard: new canaries and the token ids whose
        shingles are new. Returns content incidents (not yet recorded) once the evidence so far
        reaches the withhold threshold. Blocking; run it via :meth:`run_strict`."""
        exchange = guard.exchange
        with self._lock:
            self._drain_ingests_locked()
            if guard.own is None:
                guard.own = self._own_locked(exchange)
            found: list[Incident] = []
            try:
                if (canaries or ids) and not self._store_up():
                    raise _StoreSkipped
                if canaries:
                    found += self._canary_findings(exchange, canaries)
                if ids:
                    guard.verdict.merge(self.index.check_ids(exchange.tenant.id, ids, guard.own, guard.seen))
            except _StoreSkipped:
                pass
            except Exception as e:  # the store is down: fail open (counted), latency still applies
                self._store_error(e)
        leak = self._leak_finding(exchange, guard.verdict)
        if leak:
            found.append(leak)
        return found

    # ------------------------------------------------------------------ periodic probe
    async def _probe_loop(self) -> None:
        from verifier.probe import run_probe_targets, targets_from_settings

        interval = float(self.cfg.probe_interval_seconds or 0)
        tenant_id = self.cfg.probe_tenant or "kvgate-probe"
        while True:
            await asyncio.sleep(interval)
            try:
                targets = self.probe_targets or targets_from_settings(self.settings)
                results = await run_probe_targets(targets, register=lambda cans: self._register_probe(tenant_id, cans))
            except Exception as e:
                log.warning("verifier probe failed to run: %s", e)
                continue
            for target, result in results:
                self.stats["probes"] += 1
                if result.outcome == "leak":
                    ex = Exchange(
                        f"probe-{int(time.time())}",
                        TenantConfig(id=tenant_id, honeypot=True),
                        target.upstream,
                        target.model,
                        "/v1/completions",
                        "",
                        result.limit or 0,
                        False,
                        time.monotonic(),
                    )
                    inc = self._incident(
                        "probe",
                        ex,
                        {"surfaced_canaries": result.surfaced, "limit_tokens": result.limit or 0},
                        confirmed=True,
                    )
                    self._record([inc])

    def _register_probe(self, tenant_id: str, canaries: list[str]) -> None:
        with self._lock:
            self.canaries.register(tenant_id, canaries)


class _BackgroundGuard:
    """Sampled, non-strict: passes everything at once; the check runs in the background. Its
    coroutines never suspend (no thread hop per event): they only append to a list or queue."""

    def __init__(self, service: VerifierService, exchange: Exchange) -> None:
        self.service = service
        self.exchange = exchange
        self._parts: list[str] = []
        self._chars = 0

    async def feed(self, delta_text: str, raw_event: bytes) -> list[bytes]:
        if delta_text and self._chars < MAX_CHECK_CHARS:
            self._parts.append(delta_text)
            self._chars += len(delta_text)
        return [raw_event]

    async def finish_stream(
        self, *, usage: dict[str, Any] | None, finish_reason: str | None, ttft_seconds: float | None
    ) -> list[bytes]:
        self.service._enqueue(_Check(self.exchange, "".join(self._parts), usage, finish_reason, ttft_seconds))
        return []

    async def check_body(
        self, text: str, *, usage: dict[str, Any] | None, finish_reason: str | None, ttft_seconds: float | None
    ) -> None:
        self.service._enqueue(_Check(self.exchange, text[:MAX_CHECK_CHARS], usage, finish_reason, ttft_seconds))


class _StrictGuard:
    """Strict tenant: nothing detected leaves. Streams are held back by
    ``strict_holdback_tokens`` tokens and checked as shingles and canaries complete.

    Each call's blocking part runs in the service's strict thread pool
    (:meth:`VerifierService.run_strict`) and the call returns only when it is done; calls are
    awaited one at a time, so the guard's state is touched by one thread at a time. An event
    without text needs no check and is handled on the loop."""

    def __init__(self, service: VerifierService, exchange: Exchange) -> None:
        self.service = service
        self.exchange = exchange
        self.holdback = service.cfg.strict_holdback_tokens
        self._held: collections.deque[tuple[bytes, int]] = collections.deque()
        self._held_tokens = 0
        self.own: set[int] | None = None
        self.seen: set[int] = set()
        self.verdict = LeakVerdict()
        self._shingler = IncrementalShingler(service.hasher, max_pending_chars=256)
        self._scanner = CanaryScanner()
        self._cut: ResponseWithheld | None = None
        self._first_text_seen = False

    def _withhold(self, found: list[Incident]) -> None:
        self.service._record(found, withheld=True)
        self.service.stats["withheld"] += 1
        self._held.clear()
        self._held_tokens = 0
        self._cut = ResponseWithheld(found[0].id, found[0].detector)
        raise self._cut

    def _release(self) -> list[bytes]:
        """The held events that have at least ``holdback`` tokens behind them, in order."""
        out = []
        while self._held and self._held_tokens - self._held[0][1] >= self.holdback:
            raw, n = self._held.popleft()
            self._held_tokens -= n
            out.append(raw)
        return out

    async def feed(self, delta_text: str, raw_event: bytes) -> list[bytes]:
        if self._cut is not None:
            raise self._cut
        if not delta_text:  # no tokens, nothing to check: no thread hop
            self._held.append((raw_event, 0))
            return self._release()
        # the first text's arrival time is taken here, not after the hop
        return await self.service.run_strict(self._feed_text, delta_text, raw_event, time.monotonic())

    def _feed_text(self, delta_text: str, raw_event: bytes, now: float) -> list[bytes]:
        """:meth:`feed`'s blocking part (strict pool thread): count, pre-check, check, release."""
        tokens = len(encode(delta_text))
        self._held.append((raw_event, tokens))
        self._held_tokens += tokens
        if not self._first_text_seen:
            self._first_text_seen = True
            inc = self.service.latency_precheck(self.exchange, now - self.exchange.started_monotonic)
            if inc is not None:
                self._withhold([inc])
        cans = self._scanner.push(delta_text)
        ids = self._shingler.push(delta_text)
        if cans or ids:
            found = self.service.strict_check_piece(self, cans, ids)
            if found:
                self._withhold(found)
        return self._release()

    async def finish_stream(
        self, *, usage: dict[str, Any] | None, finish_reason: str | None, ttft_seconds: float | None
    ) -> list[bytes]:
        if self._cut is not None:
            raise self._cut
        return await self.service.run_strict(self._finish_stream, usage, finish_reason, ttft_seconds)

    def _finish_stream(
        self, usage: dict[str, Any] | None, finish_reason: str | None, ttft_seconds: float | None
    ) -> list[bytes]:
        """:meth:`finish_stream`'s blocking part (strict pool thread)."""
        svc = self.service
        found = svc.strict_check_piece(self, [], self._shingler.flush())
        CHECKS.labels(self.exchange.upstream, "strict").inc()
        svc.stats["checked"] += 1
        if found:
            self._withhold(found)
        with svc._lock:
            tail = svc._tail_findings(self.exchange, usage, finish_reason, ttft_seconds)
        svc._record(tail)
        out = [raw for raw, _ in self._held]
        self._held.clear()
        self._held_tokens = 0
        return out

    async def check_body(
        self, text: str, *, usage: dict[str, Any] | None, finish_reason: str | None, ttft_seconds: float | None
    ) -> None:
        found = await self.service.run_strict(
            self.service.strict_check_body,
            _Check(self.exchange, text[:MAX_CHECK_CHARS], usage, finish_reason, ttft_seconds),
        )
        if found:
            self.service.stats["withheld"] += 1
            raise ResponseWithheld(found[0].id, found[0].detector)
