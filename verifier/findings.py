"""Detector results as incidents, and what an incident does (docs/design.md step 8).

Collaborators of :class:`verifier.service.VerifierService`, one job each:

- :class:`StoreHealth`: whether the leak-index/canary store may be called now (after an error
  it is skipped for :attr:`StoreHealth.BACKOFF_SECONDS`, so a down Redis does not cost every
  request a timeout).
- :class:`Findings`: runs the detectors (canary scan, leak index, usage drift, ``finish_reason``,
  TTFT bound, strict size cap) on an exchange's texts and builds :class:`Incident` records.
- :class:`Evidence`: records incidents, quarantines on evidence kvgate planted, alerts on the rest.

The methods whose names end in ``_locked`` expect the caller to hold the service lock (the store
and the own-shingle cache are shared with the background worker).
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from config.models import TenantConfig, VerifierSettings
from config.redis_client import StoreBackoff, store_errors
from tokenizer.json_values import UNESCAPE_LEVELS as UNESCAPE_LEVELS  # re-exported: the response side's depth
from tokenizer.json_values import unescaped_values
from verifier.canary import CanaryRegistry, find_canaries
from verifier.drift import check_finish, check_usage
from verifier.incidents import ALERTS, CHECKS, DROPPED, QUARANTINES, Incident, IncidentSink
from verifier.latency import LatencyModel, cached_tokens_of
from verifier.leak_index import LeakIndex, LeakVerdict
from verifier.quarantine import Quarantine
from verifier.shingles import encode, fold
from verifier.stage import Exchange

log = logging.getLogger("kvgate.verifier")

#: what a failing leak-index or canary store raises; anything else is the check's own fault
STORE_ERRORS = store_errors()
#: the most text streams (choice x field: ``"0:content"``, ``"0:tool:7:arguments"`` ...) one
#: response is checked in: an engine can open one per character (a new tool-call index each),
#: each costing a tokenizer call and, in a strict stream, some 2.6 KB of state. Past it a strict
#: response is withheld (``oversize``); a sampled one has the rest checked as one more text.
MAX_TEXT_STREAMS = 1024


@dataclass
class CheckJob:
    """A whole response to check: its texts (one per text stream) and the engine's tail."""

    exchange: Exchange
    texts: list[str]
    usage: dict[str, Any] | None
    finish_reason: str | None
    ttft_seconds: float | None


@dataclass
class Prepared:
    """A check job's leak-index lookups computed ahead (:meth:`Findings.prefetch_locked`):
    ``parts``, per text, :meth:`LeakIndex.prepare_ids`'s verdict so far and fingerprints to look
    up; ``owners``: the store's owners of those fingerprints, looked up for a whole batch of
    jobs in one call (``None``: not looked up, the check looks them up itself)."""

    parts: list[tuple[LeakVerdict, list[int]]]
    owners: dict[int, set[str]] | None = None


class StoreSkipped(Exception):
    """The store is in its back-off after an error."""


class StoreHealth:
    """Back-off of the leak-index and canary store after an error (the store back-off quotas
    use too, :class:`config.redis_client.StoreBackoff`). ``stats``: the service's counters
    (``store_errors``, ``store_skipped``)."""

    #: seconds the store is skipped after an error
    BACKOFF_SECONDS = 5.0

    def __init__(self, stats: collections.Counter) -> None:
        self.stats = stats
        self.backoff = StoreBackoff(self.BACKOFF_SECONDS)

    def error(self, e: Exception) -> None:
        """A leak-index or canary-registry call failed (Redis down): counted, logged, and the
        store is skipped for :attr:`BACKOFF_SECONDS`."""
        DROPPED.labels("store_error").inc()
        self.stats["store_errors"] += 1
        self.backoff.failed()
        log.warning("verifier: leak-index store error, checks skip the store for %.0f s: %s", self.BACKOFF_SECONDS, e)

    def up(self) -> bool:
        """Whether the store may be called now (a skip is counted: ``store_down``)."""
        if not self.backoff.usable():
            DROPPED.labels("store_down").inc()
            self.stats["store_skipped"] += 1
            return False
        return True


class Evidence:
    """Records incidents (:class:`IncidentSink`), quarantines their upstream only on evidence
    kvgate planted itself (a probe's or a honeypot's canary; docs/design.md step 8), and raises a
    high-severity alert (``kvgate_verifier_alerts_total``) when confirmed evidence of a second
    distinct source tenant reaches an upstream within ``quarantine_window_seconds``: tenants can
    plant that (two keys of one actor), so it never quarantines; an operator decides."""

    def __init__(
        self, cfg: VerifierSettings, quarantine: Quarantine, incidents: IncidentSink, stats: collections.Counter
    ) -> None:
        self.cfg = cfg
        self.quarantine = quarantine
        self.incidents = incidents
        self.stats = stats

    @staticmethod
    def basis(inc: Incident) -> str | None:
        """Why ``inc`` quarantines its upstream, or ``None``: ``probe`` or ``kvgate_canary`` (a
        canary the periodic probe or a honeypot tenant planted, found in another response)."""
        if not inc.confirmed:
            return None
        if inc.detector == "probe":
            return "probe"
        if inc.detector == "canary" and inc.evidence.get("honeypot"):
            return "kvgate_canary"
        return None

    def sources_in_window(self, inc: Incident, exchange: Exchange | None) -> int:
        """Distinct source tenants of confirmed tenant-planted evidence (a regular tenant's canary,
        leak-index shingles) against ``inc``'s upstream within ``quarantine_window_seconds``,
        this incident's counted; 0 when it is no such evidence. Evidence from an echo or from an
        exchange whose own text is not fully known is not counted."""
        if not inc.confirmed or inc.detector not in ("canary", "leak_index"):
            return 0
        if exchange is not None and (exchange.echo or not exchange.state.own_text_complete):
            return 0
        if inc.detector == "canary":
            sources = list(inc.evidence.get("source_tenants") or ())
        else:
            src = inc.evidence.get("source_tenant")
            sources = [src] if src else []
        n = 0
        for src in sources:
            try:
                n = self.quarantine.add_evidence(inc.upstream, src, self.cfg.quarantine_window_seconds)
            except Exception as e:
                log.error("verifier: could not record evidence against %s: %s", inc.upstream, e)
                return 0
        return n

    def record(self, incidents: list[Incident], withheld: bool = False, exchange: Exchange | None = None) -> None:
        """Emit each incident (``withheld`` set on it), counted per detector; quarantine its
        upstream when :meth:`basis` says so; alert on evidence of two source tenants."""
        for inc in incidents:
            inc.withheld = withheld
            basis = self.basis(inc)
            if inc.confirmed:
                inc.evidence["quarantine"] = basis
            if basis is None and (n := self.sources_in_window(inc, exchange)) >= 2:
                self._alert(inc, n)
            self.incidents.emit(inc)
            self.stats[f"incident_{inc.detector}"] += 1
            if basis is not None:
                self._quarantine(inc, basis)

    def _alert(self, inc: Incident, sources: int) -> None:
        inc.evidence.update({"severity": "high", "alert": "two_sources", "sources_in_window": sources})
        ALERTS.labels(inc.upstream, "two_sources").inc()
        self.stats["alerts"] += 1
        log.error(
            "verifier ALERT: upstream %s answered text of %d distinct source tenants within %.0f s (incident %s); "
            "not quarantined (tenants can plant this): check it and run 'kvgate upstream quarantine %s' if it leaks",
            inc.upstream,
            sources,
            self.cfg.quarantine_window_seconds,
            inc.id,
            inc.upstream,
        )

    def _quarantine(self, inc: Incident, basis: str) -> None:
        if inc.upstream in self.quarantine.records():
            return
        try:
            self.quarantine.put(inc.upstream, inc.id, inc.detector, self.cfg.quarantine_min_prompt_tokens)
        except Exception as e:
            log.error("verifier: could not store quarantine of %s: %s", inc.upstream, e)
            return
        QUARANTINES.labels(inc.upstream).inc()
        log.error(
            "verifier: upstream %s quarantined for prompts above %d tokens (incident %s, %s)",
            inc.upstream,
            self.cfg.quarantine_min_prompt_tokens,
            inc.id,
            basis,
        )


#: the most characters of a request id the evidence repeats (evidence strings are at most 80; a
#: client's ``x-request-id`` may have 128, and the incident's own ``request_id`` keeps it whole)
EVIDENCE_ID_CHARS = 80


def incident(detector: str, exchange: Exchange, evidence: dict, confirmed: bool = False) -> Incident:
    """An :class:`Incident` of ``detector`` for ``exchange``: ``evidence`` plus the request id (its
    first :data:`EVIDENCE_ID_CHARS` characters), the prompt's token count and, when they apply,
    ``echo: true`` and ``own_text_complete: false``."""
    rid = exchange.request.request_id[:EVIDENCE_ID_CHARS]
    ev = {"request_id": rid, "prompt_tokens": exchange.request.prompt_tokens, **evidence}
    if exchange.echo:
        ev["echo"] = True
    if not exchange.state.own_text_complete:
        ev["own_text_complete"] = False
    return Incident(
        detector, exchange.request.tenant.id, exchange.request.upstream, exchange.request.request_id, ev, confirmed
    )


class Findings:
    """The detectors, as incidents. ``own_cache``: own-prompt shingle sets computed by the
    background ingest, keyed by :attr:`Exchange.internal_id` (shared with
    :class:`verifier.jobs.JobQueue`); ``planted``: ``tenant id -> bool``, whether that tenant's
    canaries were planted by kvgate itself."""

    def __init__(
        self,
        cfg: VerifierSettings,
        index: LeakIndex,
        canaries: CanaryRegistry,
        latency: LatencyModel,
        store: StoreHealth,
        evidence: Evidence,
        own_cache: dict[str, set[int]],
        planted: Callable[[str], bool],
    ) -> None:
        self.cfg = cfg
        self.index = index
        self.canaries = canaries
        self.latency = latency
        self.store = store
        self.evidence = evidence
        self.own_cache = own_cache
        self.planted = planted

    def own_locked(self, exchange: Exchange) -> set[int] | frozenset[int]:
        """The own-prompt shingle set of a checked exchange (computed at admission or ingest;
        else now, on this exchange's own time). Caller holds the lock."""
        if exchange.state.own_shingles is not None:
            return exchange.state.own_shingles
        own = self.own_cache.pop(exchange.internal_id, None)
        if own is None:
            own = self.index.own_shingles(exchange.prompt_text)
        exchange.state.own_shingles = own
        return own

    def canary(self, exchange: Exchange, canaries: list[str]) -> list[Incident]:
        """Incidents for canaries found in a response that its own prompt does not hold (one
        call to the canary registry). The prompt is scanned once per exchange: a strict stream
        calls this for every piece that completes a canary."""
        own = exchange.state.own_canaries
        if own is None:
            own = exchange.state.own_canaries = frozenset(find_canaries(exchange.prompt_text))
        cans = [c for c in canaries if c not in own]
        if not cans:
            return []
        matches = self.canaries.lookup(cans)
        foreign = [m for m in matches if m.owners and exchange.request.tenant.id not in m.owners and len(m.owners) == 1]
        unknown = [m for m in matches if not m.owners]
        if not foreign and not unknown:
            return []
        sources = sorted({o for m in foreign for o in m.owners})
        honeypot = any(self.planted(s) for s in sources)
        ev = {
            "canaries": len(foreign) + len(unknown),
            "known_origin": len(foreign),
            "source_tenants": sources[:8],
            "honeypot": honeypot,
            "canary_hashes": [m.fingerprint for m in (foreign + unknown)[:8]],
        }
        return [incident("canary", exchange, ev, confirmed=bool(foreign))]

    def leak(self, exchange: Exchange, verdict: LeakVerdict) -> Incident | None:
        """A leak-index incident when ``verdict`` has at least ``leak_min_shingles`` foreign
        shingles (confirmed from ``leak_confirm_shingles``)."""
        if verdict.foreign < self.cfg.leak_min_shingles:
            return None
        ev = {
            "shingles_checked": verdict.checked,
            "shingles_own": verdict.own,
            "shingles_public": verdict.public,
            "shingles_public_text": verdict.public_answers,
            "shingles_foreign": verdict.foreign,
            "source_tenant": verdict.source_tenant,
            "evidence_hashes": verdict.evidence_hashes,
        }
        return incident("leak_index", exchange, ev, confirmed=verdict.foreign >= self.cfg.leak_confirm_shingles)

    def oversize(self, exchange: Exchange, text_bytes: int, text_streams: int = 0, held_bytes: int = 0) -> Incident:
        """A strict response's text (``text_bytes``) exceeds ``strict_max_text_bytes``, its text
        streams (``text_streams``) number more than :data:`MAX_TEXT_STREAMS`, or a strict stream
        holds back more than ``strict_max_held_bytes`` of events (``held_bytes``)."""
        ev = {
            "text_bytes": text_bytes,
            "max_text_bytes": self.cfg.strict_max_text_bytes,
            "text_streams": text_streams,
            "max_text_streams": MAX_TEXT_STREAMS,
            "held_bytes": held_bytes,
            "max_held_bytes": self.cfg.strict_max_held_bytes,
        }
        return incident("oversize", exchange, ev)

    def latency_incident(self, exchange: Exchange, ttft_seconds: float, lv, cached: int | None) -> Incident:
        """A TTFT below the calibrated bound ``lv`` (a :class:`verifier.latency` verdict)."""
        return incident(
            "latency",
            exchange,
            {
                "ttft_ms": round(ttft_seconds * 1000, 3),
                "bound_ms": round(lv.bound_seconds * 1000, 3),
                "length_bucket": lv.bucket,
                "cached_tokens": cached,
                "prefilled_tokens": LatencyModel.prefilled_tokens(exchange.request.prompt_tokens, cached),
            },
        )

    def tail(
        self, exchange: Exchange, usage, finish_reason, ttft_seconds, strict: bool = False
    ) -> tuple[list[Incident], list[Incident]]:
        """``(withholding, reported)``: drift and abort findings are reported; a latency anomaly
        withholds a strict response only when the engine said how many prompt tokens it served
        from its prefix cache (otherwise a cache hit cannot be told from a leak: reported)."""
        out = []
        req = exchange.request
        # an engine reports a batch's prompts together (vLLM serving_completion.py sums the
        # prompts' counts; SGLang's UsageProcessor likewise, each prompt once whatever n)
        expected = req.prompt_tokens if req.prompt_tokens_total is None else req.prompt_tokens_total
        d = check_usage(expected, usage, self.cfg.usage_drift_tolerance_tokens)
        if d:
            out.append(incident(d.detector, exchange, d.evidence))
        f = check_finish(finish_reason)
        if f:
            out.append(incident(f.detector, exchange, f.evidence))
        cached = cached_tokens_of(usage)
        lv = self.latency.observe(
            exchange.request.upstream,
            exchange.request.prompt_tokens,
            ttft_seconds,
            "stream" if exchange.request.stream else "whole",
            model=exchange.request.model,
            tenant=exchange.request.tenant.id,
            cached_tokens=cached,
        )
        withhold: list[Incident] = []
        if lv.anomaly:
            inc = self.latency_incident(exchange, ttft_seconds, lv, cached)
            (withhold if strict and lv.cached_known else out).append(inc)
        return withhold, out

    def _prepare_locked(self, ex: Exchange, texts: Sequence[str]) -> Prepared:
        """The CPU part of :meth:`content_locked`'s leak-index check (no store call), on each text
        and on the string values of each one that is escaped JSON (:func:`unescaped_values`, the
        decoder the prompt side indexes tool-call arguments with, so the two meet)."""
        own, seen = self.own_locked(ex), set[int]()
        texts = [strip_echo(t, ex.echo_prompts) if ex.echo else t for t in texts]
        texts += [v for t in texts for v in unescaped_values(t)]
        return Prepared([self.index.prepare_ids(encode(fold(t)), own, seen) for t in texts])

    def prefetch_locked(self, jobs: Sequence[CheckJob]) -> list[Prepared | None]:
        """For a batch of queued checks, run in this order with no prompt ingest between them:
        each one's leak-index fingerprints (:meth:`_prepare_locked`) and their owners, in one
        store call for the whole batch instead of one per job. Reads only; a job that could not
        be prepared (``None``), or a failed lookup (``owners`` left ``None``), leaves that check
        to do its own, so every check's result and every error's count is as if run alone.
        Caller holds the lock."""
        if len(jobs) < 2 or not self.store.backoff.usable():
            return [None] * len(jobs)
        out, hashes = self.prepare_batch_locked(jobs)
        if hashes:
            try:
                attach_owners(out, hashes, self.index.store.owners(hashes))
            except Exception:
                return out  # each check looks up its own, and the first counts the error
        return out

    def prepare_batch_locked(self, jobs: Sequence[CheckJob]) -> tuple[list[Prepared | None], list[int]]:
        """:meth:`prefetch_locked` up to its store call (CPU only): each job's :class:`Prepared`
        (``None``: strict, or it raised; the check then does its own) and the distinct
        fingerprints of all of them, to look up. Caller holds the lock."""
        out: list[Prepared | None] = []
        for job in jobs:
            try:
                strict = job.exchange.request.tenant.strict_verify
                out.append(None if strict else self._prepare_locked(job.exchange, job.texts))
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException:  # e.g. a tokenizer panic: the check runs it again and counts it
                out.append(None)
        return out, list(dict.fromkeys(h for p in out if p is not None for _, hs in p.parts for h in hs))

    def content_locked(self, ex: Exchange, texts: Sequence[str], prepared: Prepared | None = None) -> list[Incident]:
        """Canary and leak-index incidents for whole texts (each checked on its own; the echoed
        prompt at the start of each is skipped); ``prepared``: the leak-index part computed
        ahead (:meth:`prefetch_locked`). Caller holds the lock."""
        found: list[Incident] = []
        try:
            if not self.store.up():
                raise StoreSkipped
            stripped = [strip_echo(t, ex.echo_prompts) if ex.echo else t for t in texts]
            cans = list(dict.fromkeys(c for t in stripped for c in find_canaries(t)))
            found += self.canary(ex, cans)
            p = prepared if prepared is not None else self._prepare_locked(ex, texts)
            verdict, tenant, spread = LeakVerdict(), ex.request.tenant.id, trusted(ex)
            for v, hashes in p.parts:
                if hashes:
                    owners = [p.owners[h] for h in hashes] if p.owners is not None else None
                    self.index.classify(v, tenant, hashes, spread, owners)
                verdict.merge(v)
            leak = self.leak(ex, verdict)
            if leak:
                found.append(leak)
        except StoreSkipped:
            pass
        except STORE_ERRORS as e:  # the store is down: the other detectors still run
            self.store.error(e)
        return found

    def check_whole_locked(
        self, job: CheckJob, stats: collections.Counter[Any], prepared: Prepared | None = None
    ) -> list[Incident]:
        """Run every detector on a whole response (background or strict non-streamed) and record
        the incidents. Returns those that withhold a strict response: content findings (canary,
        leak index), an oversize text, and a latency anomaly whose cached-token count is known.
        ``prepared``: its leak-index lookups done ahead (:meth:`prefetch_locked`). Caller holds
        the lock."""
        ex = job.exchange
        strict = ex.request.tenant.strict_verify
        CHECKS.labels(ex.request.upstream, "strict" if strict else "sampled").inc()
        stats["checked"] += 1
        if strict:
            nbytes = sum(len(t.encode("utf-8", "replace")) for t in job.texts)
            if nbytes > self.cfg.strict_max_text_bytes or len(job.texts) > MAX_TEXT_STREAMS:
                inc = self.oversize(ex, nbytes, len(job.texts))
                self.evidence.record([inc], withheld=True, exchange=ex)
                return [inc]
        content = self.content_locked(ex, job.texts, prepared)
        withhold, tail = self.tail(ex, job.usage, job.finish_reason, job.ttft_seconds, strict)
        content += withhold
        self.evidence.record(content, withheld=strict, exchange=ex)
        self.evidence.record(tail, exchange=ex)
        return content


def attach_owners(prepared: Sequence[Prepared | None], hashes: list[int], owners: list[set[str]]) -> None:
    """Give every prepared check the owners the store gave for ``hashes`` (same order)."""
    table = dict(zip(hashes, owners, strict=True))
    for p in prepared:
        if p is not None:
            p.owners = table


def trusted(exchange: Exchange) -> bool:
    """Whether the exchange's own text is fully known (no echo, every token-id prompt decoded):
    only then does its answer count towards the public-text rule."""
    return not exchange.echo and exchange.state.own_text_complete


def strip_echo(text: str, prompts: Sequence[str]) -> str:
    """``text`` without the echoed prompt it starts with (``echo: true``): the longest of
    ``prompts`` that ``text`` starts with is cut off. A prompt decoded from token ids that end
    inside a UTF-8 character ends in U+FFFD, while the engine's echo shows the whole character
    (completed by the first generated token): the trailing U+FFFD run matches any one character."""
    best = 0
    for p in prompts:
        core = p.rstrip("\ufffd")
        if core and text.startswith(core):
            end = len(core) + (1 if len(core) < len(p) else 0)
            best = max(best, min(end, len(text)))
    return text[best:]


def kvgate_planted(
    tenant_id: str,
    tenant_source: Callable[[str], TenantConfig | None] | None,
    tenants: dict[str, TenantConfig],
    probe_tenant: str,
) -> bool:
    """Canaries of this tenant were planted by kvgate itself: a honeypot (asked of
    ``tenant_source`` first, then of the tenants seen in exchanges) or the probe tenant."""
    t = tenant_source(tenant_id) if tenant_source is not None else None
    if t is None:
        t = tenants.get(tenant_id)
    return (t is not None and t.honeypot) or tenant_id == probe_tenant
