"""Per-tenant quotas (docs/design.md step 6): the :class:`~gateway.quotas.stage.QuotaStage` the request path
calls, built from settings by :func:`build_quota_stage`.

- RPM, TPM (prompt + completion) and concurrent requests per tenant, in one atomic reservation
  (``gateway/quotas/lua/reserve.lua``): all three or none. ``settle`` corrects TPM to the real usage and
  releases the concurrency lease (``settle.lua``). Window algorithm: sliding-window log,
  ``QuotaSettings.window_seconds`` long (``docs/quotas.md``).
- Leases have a TTL (``lease_ttl_seconds``); this process renews its live leases every TTL / 3,
  so a replica that dies frees its slots within one TTL.
- Over quota: :class:`~config.errors.OpenAIError` 429 ``rate_limit_exceeded`` with ``Retry-After``
  (whole seconds until the window admits the request, rounded up; a request above the whole TPM,
  which no wait admits, has ``x-should-retry: false`` instead) and the OpenAI rate-limit
  headers; the same headers (``x-ratelimit-limit-requests``, ``x-ratelimit-remaining-requests``,
  ``x-ratelimit-limit-tokens``, ``x-ratelimit-remaining-tokens``) are in
  :attr:`QuotaLease.headers` of every admitted request, one pair per limited dimension (header
  names as in the OpenAI API reference, "Rate limits").
- Redis refused or hanging: every Redis call is bounded by socket timeouts and an overall
  deadline under 1 s. ``fail_closed``: 503 ``quota_backend_unavailable`` with ``Retry-After``.
  ``local_fallback``: this process enforces ``limit // processes`` in its own memory, where
  ``processes`` = ``quotas.replicas`` x ``gateway.workers`` (every gateway process of the fleet).
  After a failure Redis is tried again within :data:`PROBE_INTERVAL_SECONDS`, so limits resume by
  themselves. No Redis URL: limits kept in process memory (a warning says they are per process).
- What a failed call leaves for later (reservations to undo, settles to send again) waits in a
  :class:`_Backlog` of per-tenant shares, sent in the background in slices sized by their time
  (:class:`_Slices`), every tenant's first entries first; never on a request's path.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import time
import uuid
from collections import Counter, defaultdict, deque
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from config.background import FaultLog, one_round
from config.errors import ErrorCode, OpenAIError
from config.models import QuotaSettings, Settings, TenantConfig
from config.redis_client import StoreBackoff, redis_client
from gateway.quotas.packing import pack_with_hiredis
from gateway.quotas.stage import NullQuotas, QuotaLease, QuotaStage
from gateway.quotas.stores import (
    MAX_COUNT,
    LocalQuotaStore,
    QuotaDecision,
    QuotaLimits,
    QuotaStore,
    QuotaStoreUnavailable,
    RedisQuotaStore,
)
from verifier.stage import PendingWrite

log = logging.getLogger("kvgate.quotas")

#: After a failed Redis call, requests are decided by the failure policy without asking Redis
#: for this long (seconds); the first request after it tries Redis again.
PROBE_INTERVAL_SECONDS = 0.5
#: While reservations whose call failed are waiting to be undone, the store is retried this often
#: in the background (seconds).
RECOVER_INTERVAL_SECONDS = 0.1
#: No Redis decision waits longer than this (seconds), whatever the socket timeouts.
MAX_DECISION_SECONDS = 0.9
#: At most this many failed reservations are remembered for undoing after an outage, and as many
#: settles for sending again: each a :class:`_Backlog` of per-tenant shares.
UNCERTAIN_MAX = 10_000
#: A backlog goes to the store in slices (lease ids to undo, or settles) of at most this many
#: entries: a request's call that shares a slice's round trip waits for that slice, not for the
#: whole backlog (one round trip of 10,000 settles took 236 ms, of 10,000 undos of 10,000 tenants
#: 430 ms, near the 0.55 s bound that fails every call a round trip carries).
BACKLOG_SLICE = 500
#: Each slice is sized by time, not count (:class:`_Slices`): to take at most this share of the
#: store's round-trip bound (:attr:`TenantQuotas.deadline_seconds`) at the time per entry its
#: predecessor took. 500 entries took 22 ms on 2 idle cores, and more than the 0.55 s bound on 2
#: loaded ones (the store then backed off, failing requests closed).
BACKLOG_SLICE_SHARE = 0.1
#: A drain's first slice, and the fewest entries any slice holds (a backlog always moves): within
#: the share up to 2.75 ms an entry, 2.5 times the slowest seen.
BACKLOG_SLICE_MIN = 20
#: A slice holds at most this many times the entries of the one before it.
BACKLOG_SLICE_GROWTH = 2
#: At close the backlog is sent for at most this long (seconds), slice after slice while the
#: store answers (a failed call ends it for its part of the store): one pipeline of 10,000 undos of 10,000
#: tenants and 10,000 settles, bounded by the decision deadline, took 1.5 to 3.6 s on 2 loaded
#: cores and still lost 5,587 to 11,742 leases. Within the 10 s a Kubernetes pod is given after
#: its drain (the chart's ``terminationGracePeriodSeconds``).
CLOSE_DRAIN_SECONDS = 3.0
#: Redis remembers a lease id it undid (``cancel.lua``: a reservation of it run later is a no-op)
#: or charged above its reservation (``settle.lua``: a settle of it sent again charges nothing
#: more) for this many times the longer of the window and the lease TTL.
ENDED_SPANS = 2
#: The gateway's start connects to the store within this bound (seconds; connects, TLS handshakes
#: and a cluster's slot-map read included), longer than a request's ``redis_timeout_seconds``.
WARM_UP_SECONDS = 5.0
#: :meth:`TenantQuotas._cancel_uncertain`'s "every scope"
_ALL = object()
#: what a store call decides (:meth:`TenantQuotas._decide`)
_D = TypeVar("_D")
#: an entry of a :class:`_Backlog`
_E = TypeVar("_E")
#: what a backlog slice's round trips give (:meth:`_Slices.timed`)
_R = TypeVar("_R")


class _Backlog(Generic[_E]):
    """Entries waiting for the store (reservations to undo, settles to send again): a FIFO share
    per tenant (``tenant_of(entry)``), at most ``cap`` entries in all. Full, it drops the oldest
    entry of the tenant holding the most (among equals, of the one adding), so a tenant flooding it
    (thousands of calls timed out in an outage, or of requests ended in one) loses its own
    entries, never those of a tenant holding fewer: the one queue of ``cap`` it replaces dropped
    the oldest entries whoever's, and another tenant's undos dropped so left its leases held until
    their TTL. :meth:`take` hands entries out one tenant after the other. :attr:`dropped` counts
    the dropped entries per tenant; :meth:`take_dropped` those not reported yet."""

    def __init__(self, cap: int, tenant_of: Callable[[_E], str]) -> None:
        self.cap = cap
        self._tenant_of = tenant_of
        self._shares: dict[str, deque[_E]] = {}
        self._sizes: dict[int, dict[str, None]] = {}  # share size -> the tenants whose share has it
        self._top = 0  # the largest share's size
        self._len = 0
        self.dropped: Counter[str] = Counter()
        self._unreported: Counter[str] = Counter()

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[_E]:
        return iter([e for share in self._shares.values() for e in share])

    def append(self, entry: _E) -> None:
        tenant = self._tenant_of(entry)
        share = self._shares.setdefault(tenant, deque())
        share.append(entry)
        self._len += 1
        self._resized(tenant, len(share) - 1, len(share))
        if self._len > self.cap:
            top = self._sizes[self._top]
            loser = tenant if tenant in top else next(iter(top))
            self._pop(loser)
            self.dropped[loser] += 1
            self._unreported[loser] += 1

    def extend(self, entries: Iterable[_E]) -> None:
        for e in entries:
            self.append(e)

    def take(self, most: int, wanted: Callable[[str], bool]) -> list[_E]:
        """Up to ``most`` entries of the tenants ``wanted`` says, removed: one of each tenant in
        turn, each tenant's oldest first; a tenant left with entries goes behind the others, so the
        next call starts with those this one did not reach."""
        taken: list[_E] = []
        tenants = [t for t in self._shares if wanted(t)]
        while tenants and len(taken) < most:
            left = []
            for tenant in tenants:
                taken.append(self._pop(tenant))
                if tenant in self._shares:
                    self._shares[tenant] = self._shares.pop(tenant)
                    left.append(tenant)
                if len(taken) == most:
                    break
            tenants = left
        return taken

    def take_dropped(self) -> dict[str, int]:
        """The entries dropped per tenant since the last call."""
        out, self._unreported = dict(self._unreported), Counter()
        return out

    def _pop(self, tenant: str) -> _E:
        share = self._shares[tenant]
        entry = share.popleft()
        self._len -= 1
        if not share:
            del self._shares[tenant]
        self._resized(tenant, len(share) + 1, len(share))
        return entry

    def _resized(self, tenant: str, old: int, new: int) -> None:
        """``tenant``'s share went from ``old`` entries to ``new``: its size bucket follows."""
        if old:
            bucket = self._sizes[old]
            del bucket[tenant]
            if not bucket:
                del self._sizes[old]
        if new:
            self._sizes.setdefault(new, {})[tenant] = None
        if new > self._top:
            self._top = new
        elif old == self._top and old not in self._sizes:
            self._top = max(self._sizes, default=0)


class _Slices:
    """How many entries the next slice of one drain of a backlog takes (:attr:`size`): the first
    :data:`BACKLOG_SLICE_MIN`; then as many as fit in ``target_seconds`` at the time per entry the
    last slice took (:meth:`timed`), at most :data:`BACKLOG_SLICE_GROWTH` times its entries, and
    between :data:`BACKLOG_SLICE_MIN` and :data:`BACKLOG_SLICE`. ``clock``: seconds, monotonic."""

    def __init__(self, target_seconds: float, clock: Callable[[], float]) -> None:
        self.target_seconds = target_seconds
        self.clock = clock
        self.size = BACKLOG_SLICE_MIN

    async def timed(self, entries: int, slice_sent: Awaitable[_R]) -> _R:
        """``await slice_sent`` (the round trips of a slice of ``entries`` entries); its time sizes
        the next slice. Raising (cancelled), it sizes nothing."""
        started = self.clock()
        out = await slice_sent
        seconds = self.clock() - started
        most = min(BACKLOG_SLICE, BACKLOG_SLICE_GROWTH * entries)
        fits = most if seconds <= 0 else int(self.target_seconds * entries / seconds)
        self.size = max(BACKLOG_SLICE_MIN, min(most, fits))
        return out


@dataclass
class _Held:
    """``QuotaLease.state``: which store holds the lease and what to settle."""

    store: QuotaStore
    tenant_id: str
    limits: QuotaLimits
    lease_id: str
    window_ms: int
    settled: bool = False


def rate_limit_headers(limits: QuotaLimits, decision: QuotaDecision) -> dict[str, str]:
    """``x-ratelimit-limit-*`` / ``x-ratelimit-remaining-*`` for each limited dimension
    (requests: RPM, tokens: TPM); values are decimal integers, remaining never negative."""
    h: dict[str, str] = {}
    if limits.rpm is not None:
        h["x-ratelimit-limit-requests"] = str(limits.rpm)
        h["x-ratelimit-remaining-requests"] = str(max(0, decision.remaining_requests))
    if limits.tpm is not None:
        h["x-ratelimit-limit-tokens"] = str(limits.tpm)
        h["x-ratelimit-remaining-tokens"] = str(max(0, decision.remaining_tokens))
    return h


def _fmt_seconds(s: float) -> str:
    return f"{s:g}s"


def never_fits(tenant: TenantConfig, decision: QuotaDecision, tokens: int) -> bool:
    """Whether ``decision`` refused ``tokens`` that no wait admits: more than the tenant's whole
    TPM. A store's ``too_large`` against a smaller share (the ``local_fallback``'s ``tpm //
    processes`` while Redis is down) is not: the request fits once Redis answers again."""
    tpm = tenant.tpm
    return decision.too_large and tpm is not None and tokens > tpm


def _used(limit: int | None, remaining: int, used: int) -> int:
    """What a refusal's window holds: the store's count (``used`` >= 0; above ``limit`` where a
    reload lowered it), else ``limit - remaining``."""
    return used if used >= 0 else (limit or 0) - max(0, remaining)


def refusal_error(
    tenant: TenantConfig, limits: QuotaLimits, decision: QuotaDecision, tokens: int, window_seconds: float
) -> OpenAIError:
    """The 429 ``rate_limit_exceeded`` for a refused reservation, worded like the OpenAI API's
    ("Rate limit reached for ... Limit L, Used U, Requested R. Please try again in Ns."); for a
    request above the tenant's whole TPM (:func:`never_fits`) "Request too large ...", without
    ``Retry-After`` and with ``x-should-retry: false``."""
    retry_s = max(1, math.ceil(decision.retry_after_ms / 1000))
    too_large = never_fits(tenant, decision, tokens)
    window = _fmt_seconds(window_seconds)
    parts = []
    if "rpm" in decision.refused:
        used = _used(limits.rpm, decision.remaining_requests, decision.used_requests)
        parts.append(f"requests per {window} window (RPM): Limit {limits.rpm}, Used {used}, Requested 1")
    if "tpm" in decision.refused:
        used = _used(limits.tpm, decision.remaining_tokens, decision.used_tokens)
        parts.append(f"tokens per {window} window (TPM): Limit {limits.tpm}, Used {used}, Requested {tokens}")
    if "concurrency" in decision.refused:
        parts.append(f"concurrent requests: Limit {limits.max_concurrent}")
    if too_large:
        msg = (
            f"Request too large for tenant '{tenant.id}' on tokens per {window} window (TPM): "
            f"Limit {tenant.tpm}, Requested {tokens} (prompt + max_tokens). "
            "Reduce the prompt or max_tokens."
        )
    else:
        msg = (
            f"Rate limit reached for tenant '{tenant.id}' on " + "; ".join(parts) + f". Please try again in {retry_s}s."
        )
    # a request above the whole TPM limit never fits: no Retry-After, and the header the openai
    # SDKs read before retrying (openai-python ``BaseClient._should_retry``) says not to
    wait = {"x-should-retry": "false"} if too_large else {"Retry-After": str(retry_s)}
    headers = {**wait, **rate_limit_headers(limits, decision)}
    return OpenAIError(429, msg, code=ErrorCode.RATE_LIMIT_EXCEEDED, headers=headers)


class TenantQuotas:
    """The quota stage (implements :class:`~gateway.quotas.stage.QuotaStage`).

    ``store``: where limits are kept (:class:`RedisQuotaStore` shared by replicas, or
    :class:`LocalQuotaStore`). ``fallback``: the store used under ``local_fallback`` while
    ``store`` is unavailable (``None`` = fail closed). Tenants without any limit skip the
    store. ``settings``: windows, lease TTL, Redis timeout and failure policy. ``processes``:
    how many gateway processes share the limits (``replicas`` x workers; default
    ``settings.replicas``): under ``local_fallback`` each enforces ``limit // processes``.
    """

    def __init__(
        self,
        settings: QuotaSettings,
        store: QuotaStore,
        *,
        fallback: LocalQuotaStore | None = None,
        processes: int | None = None,
    ) -> None:
        self.settings = settings
        self.processes = max(1, processes if processes is not None else settings.replicas)
        self.store = store
        self.fallback = fallback
        self.window_ms = max(1, round(settings.window_seconds * 1000))
        self.lease_ttl_ms = max(1, round(settings.lease_ttl_seconds * 1000))
        #: the background rounds' fault handlers (a fault that persists: one line a minute)
        self._undo_faults = FaultLog(log, "undoing uncertain quota reservations")
        self._renew_faults = FaultLog(log, "quota lease renewal")
        self.deadline_seconds = min(MAX_DECISION_SECONDS, 2 * settings.redis_timeout_seconds + 0.05)
        #: the shared store bounds its own round trips by the deadline (one timer per round trip)
        self._store_bounded = isinstance(store, RedisQuotaStore)
        if isinstance(store, RedisQuotaStore):
            store.bound_round_trips(self.deadline_seconds)
            store.remember_ended_for(ENDED_SPANS * max(self.window_ms, self.lease_ttl_ms))
        self._backoff = StoreBackoff(PROBE_INTERVAL_SECONDS)
        self._live: dict[str, _Held] = {}
        #: reservations whose call failed but may have run (tenant id, lease id, keep its RPM
        #: entry: a begun request's token step the fallback went on with): undone when the store
        #: answers again
        self._uncertain: _Backlog[tuple[str, str, bool]] = _Backlog(UNCERTAIN_MAX, lambda u: u[0])
        #: settles the store could not take (its back-off, or the call failed): sent again when it answers
        self._unsettled: _Backlog[tuple[_Held, int, int]] = _Backlog(UNCERTAIN_MAX, lambda u: u[0].tenant_id)
        self._renewer: asyncio.Task[None] | None = None
        self._recoverer: asyncio.Task[None] | None = None
        #: tenant id -> ``time.monotonic()`` until which this process takes the tenant's requests
        #: through :meth:`begin` before their bodies are read: one was refused for RPM or
        #: concurrency, and that refusal's Retry-After has not passed (:meth:`combines`)
        self._refused_until: dict[str, float] = {}
        #: told ``False`` when the shared store stops answering (a call or the start), ``True``
        #: when it answers again (:meth:`watch_store`: the gateway's ``kvgate_quota_store_up``)
        self._store_state: Callable[[bool], None] = lambda up: None
        #: :meth:`aclose` has begun: no background round is started again
        self._closing = False
        #: the clock timing the backlogs' slices (:class:`_Slices`)
        self._slice_clock: Callable[[], float] = time.monotonic

    def watch_store(self, callback: Callable[[bool], None]) -> None:
        """Tell ``callback`` each change of the shared store's state (``True``: it answers)."""
        self._store_state = callback

    # ------------------------------------------------------------------ store health
    def _store_usable(self, tenant_id: str) -> bool:
        """Whether ``tenant_id``'s part of the store may be called: the back-off is per
        :meth:`QuotaStore.scope` (a Cluster's hash slot; the whole store otherwise)."""
        return self.store is self.fallback or self._backoff.usable(self.store.scope(tenant_id))

    def _mark_down(self, err: Exception, tenant_id: str) -> None:
        if self._backoff.failed(self.store.scope(tenant_id)):
            self._store_state(False)
            action = (
                f"per-process local limits (limit // {self.processes})"
                if self.fallback is not None
                else "refusing requests with 503 (fail closed)"
            )
            log.warning("quota store %s unavailable (%s): %s until it answers again", self.store.name, err, action)
        self._ensure_recoverer()

    def _ensure_recoverer(self) -> None:
        """Undo the uncertain reservations and send the settles left over in the background
        (:meth:`_recover_loop`), if any."""
        if self._closing:  # aclose sends what is left once itself
            return
        if (self._uncertain or self._unsettled) and (self._recoverer is None or self._recoverer.done()):
            with contextlib.suppress(RuntimeError):  # no running loop: the next request undoes them
                self._recoverer = asyncio.get_running_loop().create_task(self._recover_loop())

    def _undo_later(self, tenant_id: str, lease_id: str) -> None:
        """A reservation whose caller was cancelled while its call was out (or right after it was
        answered): Redis may have made it, and nobody will settle it, so it is undone as one
        whose call failed (``cancel.lua``, in the background)."""
        self._uncertain.append((tenant_id, lease_id, False))
        self._ensure_recoverer()

    async def _recover_loop(self) -> None:
        """Undo this process's uncertain reservations as soon as the store answers again, without
        waiting for this process's next request: with several workers, a worker that gets no
        traffic for a while must not leave reservations that Redis ran late in the shared window.
        Settles the store could not take are sent again in the same rounds, so a lease held during
        a short outage is released when it ends, not by its TTL."""
        while self._uncertain or self._unsettled:
            await asyncio.sleep(RECOVER_INTERVAL_SECONDS)
            with one_round(self._undo_faults):  # the next round tries again
                await self._cancel_uncertain()
                await self._settle_left_over()
            self._report_dropped()

    def _report_dropped(self) -> None:
        """Log the backlogs' entries dropped since the last report (:class:`_Backlog`: a full one
        drops from the tenant holding the most): those reservations stay counted, those leases
        held, until their window or TTL ends."""
        for backlog, what in ((self._uncertain, "undo(s)"), (self._unsettled, "settle(s)")):
            for tenant_id, n in backlog.take_dropped().items():
                log.warning(
                    "quota store %s: backlog full: dropped %s %s of tenant %s, the tenant holding the most "
                    "(its reservations stay counted until their window or lease TTL ends)",
                    self.store.name,
                    f"{n:,}",
                    what,
                    tenant_id,
                )

    def _slices(self) -> _Slices:
        """A drain's slice sizes: each slice's round trips within :data:`BACKLOG_SLICE_SHARE` of the
        bound (:class:`_Slices`)."""
        return _Slices(BACKLOG_SLICE_SHARE * self.deadline_seconds, self._slice_clock)

    def _in_scope(self, tenant_id: str, scope: Any) -> bool:
        """Whether ``tenant_id``'s state lives in ``scope`` (:meth:`QuotaStore.scope`; ``_ALL``: yes)."""
        return scope is _ALL or self.store.scope(tenant_id) == scope

    async def _settle_left_over(self, scope: Any = _ALL, *, backing_off: bool = False) -> None:
        """Send again the settles the store could not take (``scope``: as :meth:`_cancel_uncertain`);
        ``settle.lua`` run late releases a lease that may have expired (nothing) and corrects the
        debit as it would have then. They go in slices sized by their time (:meth:`_slices`), one
        tenant's after the other's (:meth:`_Backlog.take`), each slice's together, riding one round trip
        (after a long outage thousands wait: one round trip each took seconds, one for them all
        236 ms for 10,000, which every call sharing it waited for). A settle that fails waits for
        the next round, and so, in this one, do those of its part of the store (:meth:`_failing`).
        ``backing_off``: send those of a part of the store that is backing off too
        (:meth:`aclose`'s last try)."""
        failing: set[Any] = set()
        slices = self._slices()

        def wanted(tenant_id: str) -> bool:
            usable = backing_off or self._store_usable(tenant_id)
            return usable and self._in_scope(tenant_id, scope) and self.store.scope(tenant_id) not in failing

        while batch := self._unsettled.take(slices.size, wanted):
            calls = [
                functools.partial(h.store.settle, h.tenant_id, h.limits, h.lease_id, used, reserved, h.window_ms)
                for h, used, reserved in batch
            ]
            try:
                sent = self._together(calls, [h.tenant_id for h, _, _ in batch], "settling again")
                results = await slices.timed(len(batch), sent)
            except BaseException:  # cancelled: all are sent again (settle.lua run twice changes nothing more)
                self._unsettled.extend(batch)
                raise
            failed = [u for u, r in zip(batch, results, strict=True) if isinstance(r, BaseException)]
            self._unsettled.extend(failed)
            failing |= self._failing(u[0].tenant_id for u in failed)

    async def _together(
        self, calls: Sequence[Callable[[], Awaitable[Any]]], tenant_ids: list[str], what: str
    ) -> list[Any]:
        """Make ``calls`` (store calls not yet made, one per tenant of ``tenant_ids``) together,
        each within :meth:`_bounded`, riding the store's round trips; returns each one's result or
        exception. A :class:`QuotaStoreUnavailable` marks that tenant's part of the store down; any
        other exception is logged. Cancelled, it raises (the caller queues the calls again). Each
        call's coroutine is made in its own task once that task runs: one cancelled before its
        first step leaves no coroutine never awaited (Python's ``RuntimeWarning``)."""

        async def one(call: Callable[[], Awaitable[Any]]) -> Any:
            return await self._bounded(call())

        results = await asyncio.gather(*(one(c) for c in calls), return_exceptions=True)
        for tenant_id, r in zip(tenant_ids, results, strict=True):
            if isinstance(r, QuotaStoreUnavailable):
                self._mark_down(r, tenant_id)
            elif isinstance(r, BaseException):
                log.error("quota store %s: %s for tenant %s failed: %r", self.store.name, what, tenant_id, r)
        return results

    def _mark_up(self, tenant_id: str) -> None:
        """A call of ``tenant_id``'s was answered: its part of the store is up again (logged once per
        outage). What waits to be undone or settled is left to the background round
        (:meth:`_recover_loop`): a request that succeeds never waits for that backlog (one tenant's
        clients leaving while their calls were out kept it filled, and every other tenant's
        request then waited for an extra round trip; after an outage, for thousands of calls)."""
        if self._backoff.succeeded(self.store.scope(tenant_id)):
            log.warning("quota store %s answers again: limits are shared across replicas again", self.store.name)
            self._store_state(True)

    async def _cancel_uncertain(self, scope: Any = _ALL, *, backing_off: bool = False) -> None:
        """Undo the reservations whose call failed during the outage (Redis may have run them,
        or may run them later: ``cancel.lua`` leaves a tombstone that makes them no-ops); they were
        refused or handled locally, so they must not count in Redis (but for the RPM entry of a
        begun request whose token step the fallback took: it goes on, so it stays). ``scope``:
        only those of tenants in that part of the store; default: all. In slices of lease ids sized
        by their time (:meth:`_slices`), one tenant's after the other's (:meth:`_Backlog.take`),
        each slice's calls together (the first goes out at once, the rest in the next round
        trip: :meth:`RedisQuotaStore._submit`); an undo that fails waits for the next round, and so, in this
        one, do those of its part of the store (:meth:`_failing`). A part of the store that is
        backing off is left alone (``backing_off``: not at :meth:`aclose`'s last try): the round
        neither extends its back-off nor takes a slice out of the backlog while an outage's failed
        calls are still joining it (the slice out, the cap let in more than it holds)."""
        undone = 0
        failing: set[Any] = set()
        slices = self._slices()

        def wanted(tenant_id: str) -> bool:
            usable = backing_off or self._store_usable(tenant_id)
            return usable and self._in_scope(tenant_id, scope) and self.store.scope(tenant_id) not in failing

        try:
            while batch := self._uncertain.take(slices.size, wanted):
                done, failed = await slices.timed(len(batch), self._undo(batch))
                undone += done
                failing |= self._failing(failed)
        finally:
            if undone:
                log.warning(
                    "quota store %s: undid %d reservation(s) it ran after their call had timed out",
                    self.store.name,
                    undone,
                )

    def _failing(self, tenant_ids: Iterable[str]) -> set[Any]:
        """The parts of the store (:meth:`QuotaStore.scope`) of ``tenant_ids``, whose calls failed:
        a round sends nothing more there (one server: the whole store; a Cluster: those slots, the
        others' entries still go)."""
        return {self.store.scope(t) for t in tenant_ids}

    async def _undo(self, batch: list[tuple[str, str, bool]]) -> tuple[int, list[str]]:
        """``cancel.lua`` for ``batch`` (a slice of :attr:`_uncertain`), one call per tenant (and
        ``keep_rpm``), together. Returns ``(how many were undone, the tenants whose call failed)``;
        what failed, or is not known undone when cancelled, is queued again."""
        groups: dict[tuple[str, bool], list[str]] = defaultdict(list)
        for tenant_id, lease_id, keep_rpm in batch:
            groups[(tenant_id, keep_rpm)].append(lease_id)
        todo = list(groups.items())
        try:
            calls = [functools.partial(self.store.cancel, t, ids, keep_rpm=k) for (t, k), ids in todo]
            results = await self._together(calls, [t for (t, _), _ in todo], "undoing reservations")
        except BaseException:  # cancelled part-way: what is not known undone waits for the next round
            self._uncertain.extend(batch)
            self._ensure_recoverer()
            raise
        undone, failed = 0, []
        for ((tenant_id, keep_rpm), ids), r in zip(todo, results, strict=True):
            if isinstance(r, BaseException):  # a tenant whose store part is down waits for the next round
                self._uncertain.extend((tenant_id, i, keep_rpm) for i in ids)
                failed.append(tenant_id)
            else:
                undone += r
        return undone, failed

    async def _bounded(self, coro: Any) -> Any:
        """``await coro`` (a call on the shared store, or on the fallback, which never waits)
        within :attr:`deadline_seconds`: the store's own bound when it has one, else a timer
        here. Raises :class:`QuotaStoreUnavailable` past it."""
        if self._store_bounded:
            return await coro
        try:
            async with asyncio.timeout(self.deadline_seconds):
                return await coro
        except TimeoutError as e:
            raise QuotaStoreUnavailable(f"no answer within {self.deadline_seconds:g}s") from e

    # ------------------------------------------------------------------ the stage
    async def start(self) -> None:
        """Connect the shared store before the first request (its ``warm_up``: a ``PING``, on a
        cluster the slot map and every primary), within :data:`WARM_UP_SECONDS`, so the first
        decision finds a connected client. A failure is logged and counts as a failed call: the
        store backs off, and requests then meet the failure policy as they would have."""
        warm_up = getattr(self.store, "warm_up", None)
        if warm_up is None or self.store is self.fallback:
            return
        try:
            async with asyncio.timeout(WARM_UP_SECONDS):
                await warm_up(WARM_UP_SECONDS)
        except Exception as e:
            log.warning(
                "quota store %s did not answer at start (%s): requests meet the %s policy until it does",
                self.store.name,
                str(e) or type(e).__name__,
                self.settings.redis_failure_policy,
            )
            if self._backoff.failed():  # the whole store, as a failed call
                self._store_state(False)

    async def _decide(
        self,
        store: QuotaStore,
        tenant_id: str,
        limits: QuotaLimits,
        lease_id: str,
        call: Callable[[QuotaStore, QuotaLimits], Awaitable[_D]],
        *,
        undo_on_cancel: bool = True,
        token_step: bool = False,
    ) -> tuple[QuotaStore, QuotaLimits, _D]:
        """``(store, limits, decision)``: ``call(store, limits)`` (a coroutine giving a
        :class:`QuotaDecision`, or ``begin_tokens``' pair of them) on ``store``, under the
        failure policy when it is the shared store: a call that fails is remembered for undoing,
        and the fallback decides with ``limits // processes``. Raises :class:`OpenAIError` 503 when failing closed.
        ``undo_on_cancel``: a caller cancelled before it has the decision (the request is gone,
        and what Redis made for it has no lease to settle) has the call undone as a failed one;
        ``False`` for a call whose caller settles the lease it already holds. ``token_step``: the
        call is the token step of a request Redis began; when it fails, or the store is backing
        off, and the fallback goes on with the request (which may then reach an engine), Redis's
        lease of it is undone once the store answers, keeping the RPM entry ``begin.lua`` made,
        as for any begun request; failing closed (a 503) after a failed call it is refunded."""
        if isinstance(store, LocalQuotaStore):
            return store, limits, await call(store, limits)
        if self._store_usable(tenant_id):
            try:
                decision = await self._bounded(call(store, limits))
                if self._backoff.down:
                    self._mark_up(tenant_id)
                self._ensure_recoverer()  # the backlog, if any: never on this request's path
            except QuotaStoreUnavailable as e:
                self._uncertain.append((tenant_id, lease_id, token_step and self.fallback is not None))
                self._mark_down(e, tenant_id)
            except asyncio.CancelledError:
                if undo_on_cancel:
                    self._undo_later(tenant_id, lease_id)
                raise
            else:
                return store, limits, decision
        elif token_step and self.fallback is not None:  # the fallback decides without a call
            self._uncertain.append((tenant_id, lease_id, True))  # begin.lua's lease is undone, as above
            self._ensure_recoverer()
        if self.fallback is None:
            raise OpenAIError(
                503,
                "The quota store is unavailable, so the request cannot be admitted. Please try again shortly.",
                code=ErrorCode.QUOTA_BACKEND_UNAVAILABLE,
                headers={"Retry-After": str(self.settings.retry_after_on_failure_seconds)},
            )
        limits = limits.divided(self.processes)
        return self.fallback, limits, await call(self.fallback, limits)

    def _hold(self, store: QuotaStore, tenant_id: str, limits: QuotaLimits, lease_id: str) -> _Held:
        held = _Held(store, tenant_id, limits, lease_id, self.window_ms)
        if limits.max_concurrent is not None:
            self._live[lease_id] = held
            self._ensure_renewer()
        return held

    async def reserve(
        self, tenant: TenantConfig, reserve_tokens: int, request_id: str, *, also: PendingWrite | None = None
    ) -> QuotaLease:
        """Reserve one request, ``reserve_tokens`` tokens (prompt + n x max_tokens) and a lease, at
        once (``reserve.lua``; the request path takes them in two steps, :meth:`begin` and
        :meth:`reserve_tokens`).

        Returns a :class:`QuotaLease` whose ``headers`` carry the rate-limit headers. Raises
        :class:`OpenAIError` 429 ``rate_limit_exceeded`` (``Retry-After``, rate-limit headers) or,
        when Redis is unavailable and the policy is ``fail_closed``, 503
        ``quota_backend_unavailable`` (``Retry-After``: ``retry_after_on_failure_seconds``).
        ``also``: sent with the reservation's Redis round trip when it makes one (see
        :meth:`gateway.quotas.stage.QuotaStage.reserve`), made whatever the reservation's answer
        (unguarded: the request path uses :meth:`reserve_tokens`, whose writes depend on it); an
        unlimited tenant, the in-process store and the fallback make none."""
        limits = QuotaLimits.of(tenant)
        tokens = max(0, int(reserve_tokens))
        if limits.unlimited:
            return QuotaLease(tenant.id, request_id, tokens)
        lease_id = uuid.uuid4().hex
        w, ttl = self.window_ms, self.lease_ttl_ms

        def call(s: QuotaStore, lim: QuotaLimits) -> Any:
            return s.reserve(tenant.id, lim, lease_id, tokens, w, ttl, also=also if s is self.store else None)

        store, limits, decision = await self._decide(self.store, tenant.id, limits, lease_id, call)
        if not decision.admitted:
            raise refusal_error(tenant, limits, decision, tokens, self.settings.window_seconds)
        held = self._hold(store, tenant.id, limits, lease_id)
        return QuotaLease(tenant.id, request_id, tokens, rate_limit_headers(limits, decision), held)

    async def begin(self, tenant: TenantConfig, request_id: str) -> QuotaLease:
        """Admit one request against RPM and take its concurrency lease (``begin.lua``), right
        after authentication: no tokens yet (:meth:`reserve_tokens` adds them once counted). The
        RPM entry stays spent whatever happens to the request; the lease ends with
        :meth:`settle`. Returns the :class:`QuotaLease` (``headers``: the requests pair). Raises
        :class:`OpenAIError` 429 (RPM or concurrency) or 503 as :meth:`reserve` does."""
        limits = QuotaLimits.of(tenant)
        if limits.unlimited:
            return QuotaLease(tenant.id, request_id, 0)
        lease_id = uuid.uuid4().hex
        w, ttl = self.window_ms, self.lease_ttl_ms

        def call(s: QuotaStore, lim: QuotaLimits) -> Any:
            return s.begin(tenant.id, lim, lease_id, w, ttl)

        store, limits, decision = await self._decide(self.store, tenant.id, limits, lease_id, call)
        requests = QuotaLimits(limits.rpm, None, limits.max_concurrent)  # what this step decided
        if not decision.admitted:
            self._note_refusal(tenant.id, decision)
            raise refusal_error(tenant, requests, decision, 0, self.settings.window_seconds)
        held = self._hold(store, tenant.id, limits, lease_id)
        return QuotaLease(tenant.id, request_id, 0, rate_limit_headers(requests, decision), held)

    def _note_refusal(self, tenant_id: str, decision: QuotaDecision) -> None:
        """Remember an RPM or concurrency refusal until its Retry-After (:meth:`combines`)."""
        self._refused_until[tenant_id] = time.monotonic() + max(1.0, decision.retry_after_ms / 1000)

    def combines(self, tenant: TenantConfig) -> bool:
        """Whether a request of ``tenant`` whose body has arrived may be decided in one step after
        it is counted (:meth:`begin_reserve`) rather than begun before its body is read: the
        tenant has limits, its part of the store answers (else :meth:`begin` refuses or falls
        back at once), and no request of it was refused for RPM or concurrency in this process
        within that refusal's Retry-After (a tenant over those limits costs no parse or count)."""
        if QuotaLimits.of(tenant).unlimited or not self._store_usable(tenant.id):
            return False
        until = self._refused_until.get(tenant.id)
        if until is None:
            return True
        if time.monotonic() < until:
            return False
        del self._refused_until[tenant.id]
        return True

    async def begin_reserve(
        self, tenant: TenantConfig, request_id: str, tokens: int, *, also: PendingWrite | None = None
    ) -> QuotaLease:
        """:meth:`begin` and :meth:`reserve_tokens` as one step, for a request already counted: on
        the shared store one round trip (``begin.lua``, then ``tokens.lua`` only if it began,
        then ``also`` only if the tokens were debited: :meth:`RedisQuotaStore.begin_tokens`),
        leaving what the two calls would leave. Returns the :class:`QuotaLease` (both pairs of
        headers). Raises :class:`OpenAIError` 429 as :meth:`begin` would (RPM or concurrency:
        nothing taken) or as :meth:`reserve_tokens` would (TPM: the RPM entry stays spent, the
        lease is released here), or 503 as they do. ``also``: as :meth:`reserve_tokens`."""
        limits = QuotaLimits.of(tenant)
        tokens = max(0, int(tokens))
        if limits.unlimited:
            if also is not None:
                await self.send_writes(also)
            return QuotaLease(tenant.id, request_id, tokens)
        lease_id = uuid.uuid4().hex
        w, ttl = self.window_ms, self.lease_ttl_ms

        def call(s: QuotaStore, lim: QuotaLimits) -> Any:
            return s.begin_tokens(tenant.id, lim, lease_id, tokens, w, ttl, also=also if s is self.store else None)

        store, limits, (begun, took) = await self._decide(self.store, tenant.id, limits, lease_id, call)
        requests = QuotaLimits(limits.rpm, None, limits.max_concurrent)
        if not begun.admitted:
            self._note_refusal(tenant.id, begun)
            raise refusal_error(tenant, requests, begun, 0, self.settings.window_seconds)
        held = self._hold(store, tenant.id, limits, lease_id)
        lease = QuotaLease(tenant.id, request_id, tokens, rate_limit_headers(requests, begun), held)
        try:
            return await self._took(tenant, lease, limits, took, tokens, also)
        except asyncio.CancelledError:  # the caller is gone and will never settle the lease it holds
            await self.settle(lease, 0)
            raise

    async def _took(
        self,
        tenant: TenantConfig,
        lease: QuotaLease,
        limits: QuotaLimits,
        took: QuotaDecision | None,
        tokens: int,
        also: PendingWrite | None,
    ) -> QuotaLease:
        """:meth:`begin_reserve` once begun: ``lease`` after the tokens' decision ``took`` (sending
        ``also`` where no debit carried it), or its 429 with the lease released."""
        if took is None:  # no TPM limit: nothing debited, nothing to guard the writes by
            if also is not None:
                await self.send_writes(also)
            return lease
        only_tpm = QuotaLimits(None, limits.tpm, None)
        if not took.admitted:
            lease.reserved_tokens = 0
            await self.settle(lease, 0)
            raise refusal_error(tenant, only_tpm, took, tokens, self.settings.window_seconds)
        lease.headers.update(rate_limit_headers(only_tpm, took))
        return lease

    async def send_writes(self, writes: PendingWrite) -> None:
        """``writes.calls`` in the store's next coalesced round trip
        (:meth:`RedisQuotaStore.send_calls`), within the decision deadline; the outcome to
        ``writes.sent`` (a failed or late round trip: its :class:`QuotaStoreUnavailable`). Left
        unsent (to ``writes.finish()``) when the store does not coalesce or is backing off."""
        store = self.store
        if not isinstance(store, RedisQuotaStore) or not store.coalesce or not writes.calls or self._backoff.down:
            return
        try:
            outcome: list[Any] | BaseException = await self._bounded(store.send_calls(writes.calls))
        except QuotaStoreUnavailable as e:
            outcome = e
        writes.sent(outcome)

    async def reserve_tokens(
        self, tenant: TenantConfig, lease: QuotaLease, tokens: int, *, also: PendingWrite | None = None
    ) -> None:
        """Reserve ``tokens`` (the request's KV demand, counted) against TPM for a request
        :meth:`begin` admitted (``tokens.lua``); sets ``lease.reserved_tokens`` and the tokens pair
        of ``lease.headers``. Raises :class:`OpenAIError` 429 (TPM; the lease is still held: the
        caller settles it) or 503 as :meth:`reserve` does. ``also`` (the verifier's index
        write): on the shared store, sent in the reservation's own round trip, each call made
        only if the reservation was (:meth:`RedisQuotaStore.take_tokens`); a tenant without TPM
        makes no reservation, so it goes in the next coalesced round trip (:meth:`send_writes`);
        otherwise left unsent (the fallback decided: the caller's ``also.finish()`` sends it)."""
        tokens = max(0, int(tokens))
        held = lease.state
        if not isinstance(held, _Held) or held.limits.tpm is None:
            lease.reserved_tokens = tokens
            if also is not None:
                await self.send_writes(also)
            return

        began_in = held.store

        def taken_over(s: QuotaStore) -> bool:
            return s is self.fallback and began_in is not self.fallback

        def call(s: QuotaStore, lim: QuotaLimits) -> Any:
            if taken_over(s):
                # the fallback goes on with a request Redis began (whose lease there is undone):
                # it takes the request's lease with its tokens, so its concurrency still counts
                with_lease = QuotaLimits(None, lim.tpm, lim.max_concurrent)
                return s.reserve(held.tenant_id, with_lease, held.lease_id, tokens, held.window_ms, self.lease_ttl_ms)
            carried = also if s is self.store else None
            return s.take_tokens(held.tenant_id, lim, held.lease_id, tokens, held.window_ms, also=carried)

        held.store, held.limits, decision = await self._decide(
            held.store, held.tenant_id, held.limits, held.lease_id, call, undo_on_cancel=False, token_step=True
        )
        # what this step decided: TPM, and the fallback's lease when it took one
        decided = QuotaLimits(None, held.limits.tpm, held.limits.max_concurrent if taken_over(held.store) else None)
        if not decision.admitted:
            raise refusal_error(tenant, decided, decision, tokens, self.settings.window_seconds)
        lease.reserved_tokens = tokens
        lease.headers.update(rate_limit_headers(decided, decision))

    async def settle(self, lease: QuotaLease, used_tokens: int) -> None:
        """Release the lease and set the request's TPM debit to ``used_tokens``. Never raises;
        a second call for the same lease does nothing. If the store is unavailable the settle is
        sent again in the background as soon as it answers (:meth:`_recover_loop`); until then
        the lease stays held (at most its TTL) and the debit stays at the reservation (an
        overcharge, never an undercharge, as reservations are upper bounds)."""
        held = lease.state
        if not isinstance(held, _Held) or held.settled:
            return
        held.settled = True
        self._live.pop(held.lease_id, None)
        try:
            used = min(max(0, int(used_tokens)), MAX_COUNT)  # an engine's lie past any count: capped
        except (TypeError, ValueError, OverflowError):  # no count: the reservation stands (never an undercharge)
            log.error("quota settle for tenant %s got no token count (%r)", held.tenant_id, used_tokens)
            used = lease.reserved_tokens
        shared = held.store is self.store and held.store is not self.fallback
        if shared and not self._store_usable(held.tenant_id):
            self._unsettled.append((held, used, lease.reserved_tokens))
            self._ensure_recoverer()
            return
        try:
            await self._bounded(
                held.store.settle(
                    held.tenant_id, held.limits, held.lease_id, used, lease.reserved_tokens, held.window_ms
                )
            )
        except QuotaStoreUnavailable as e:
            if shared:
                self._unsettled.append((held, used, lease.reserved_tokens))
                self._mark_down(e, held.tenant_id)
        except asyncio.CancelledError:
            # the store still sends it, but nobody learns if that fails: sent again in the
            # background as a failed one is (settle.lua run twice changes nothing more)
            if shared:
                self._unsettled.append((held, used, lease.reserved_tokens))
                self._ensure_recoverer()
            raise
        except Exception:  # settle never raises into the request path
            log.exception("quota settle failed for tenant %s", held.tenant_id)

    # ------------------------------------------------------------------ lease heartbeats
    def _ensure_renewer(self) -> None:
        if self._renewer is None or self._renewer.done():
            self._renewer = asyncio.get_running_loop().create_task(self._renew_loop())

    async def renew_now(self) -> int:
        """Extend every live lease of this process to now + TTL; returns how many were renewed.
        Called every TTL / 3 by a background task; leases a store no longer has stay gone."""
        groups: dict[tuple[int, str], list[_Held]] = defaultdict(list)
        for h in list(self._live.values()):
            groups[(id(h.store), h.tenant_id)].append(h)
        renewed = 0
        for held in groups.values():
            store = held[0].store
            if store is self.store and not self._store_usable(held[0].tenant_id):
                continue
            try:
                renewed += await self._bounded(
                    store.renew(held[0].tenant_id, [h.lease_id for h in held], self.lease_ttl_ms)
                )
            except QuotaStoreUnavailable as e:
                if store is self.store:
                    self._mark_down(e, held[0].tenant_id)
        return renewed

    async def _renew_loop(self) -> None:
        interval = max(0.05, self.settings.lease_ttl_seconds / 3)
        while self._live:
            await asyncio.sleep(interval)
            with one_round(self._renew_faults):  # a heartbeat must never kill the loop
                await self.renew_now()

    async def aclose(self) -> None:
        """Stop lease renewal (and the undoing of uncertain reservations), send what is left
        (:meth:`_send_left_over`) and close the store's connections (the store sends the calls it
        has queued first)."""
        self._closing = True
        for task in (self._renewer, self._recoverer):
            if task is not None:
                task.cancel()
                try:
                    await task
                except BaseException:
                    pass
        self._renewer = self._recoverer = None
        await self._send_left_over()
        await self.store.aclose()

    async def _send_left_over(self) -> None:
        """At close, one last try to undo the uncertain reservations and send the settles left over
        (those of requests cancelled at a shutdown's end, or handed over while the store backed
        off: its back-off is not waited out), so their debits are corrected now rather than staying
        at their reservations. Both backlogs go as in the background rounds, in slices sized by their
        time (:meth:`_slices`), every tenant's first entries first (a tenant's flood delays no other
        tenant's few), for at most :data:`CLOSE_DRAIN_SECONDS`; a call that fails ends the round for
        its part of the store (a store that does not answer costs one decision deadline). What is left
        is lost, logged with its count: those reservations stay counted, those leases held, until
        their window or TTL ends."""
        if self.store is not self.fallback and (self._uncertain or self._unsettled):
            with contextlib.suppress(Exception):  # TimeoutError included: closing goes on
                async with asyncio.timeout(CLOSE_DRAIN_SECONDS):
                    await asyncio.gather(
                        self._cancel_uncertain(backing_off=True),
                        self._settle_left_over(backing_off=True),
                        return_exceptions=True,
                    )
        self._report_dropped()
        if self._uncertain or self._unsettled:
            log.warning(
                "quota store %s: %d reservation undo(s) and %d settle(s) of %d tenant(s) not sent at close: "
                "their leases expire by TTL",
                self.store.name,
                len(self._uncertain),
                len(self._unsettled),
                len({u[0] for u in self._uncertain} | {u[0].tenant_id for u in self._unsettled}),
            )


# ---------------------------------------------------------------------- construction
def redis_client_from_url(url: str, timeout_seconds: float) -> Any:
    """The quota store's ``redis.asyncio`` client for ``url`` (any ``redis_url`` scheme; see
    :func:`config.redis_client.redis_client`): every connect and read bounded by
    ``timeout_seconds``, so the failure policy decides within 1 s; its commands packed by
    hiredis (:mod:`gateway.quotas.packing`). Raises ``ValueError`` for a malformed URL."""
    return pack_with_hiredis(redis_client(url, timeout_seconds))


def build_quota_stage(settings: Settings, *, key_prefix: str = "kvgate:q") -> QuotaStage:
    """The quota stage ``settings`` ask for: :class:`NullQuotas` when ``quotas.enabled`` is
    false; :class:`TenantQuotas` over Redis when ``redis_url`` is set (with a local fallback
    store under ``local_fallback``, dividing by ``quotas.replicas`` x ``gateway.workers``);
    otherwise over process memory, logging a warning that the limits are per process.
    ``key_prefix``: the Redis key prefix (``kvgate:q``)."""
    q = settings.quotas
    if not q.enabled:
        return NullQuotas()
    if not settings.redis_url:
        log.warning(
            "quotas: no redis_url is configured, so limits are kept in this process: "
            "each gateway process admits a tenant's full limits on its own"
        )
        local = LocalQuotaStore()
        return TenantQuotas(q, local, fallback=local)
    client = redis_client_from_url(settings.redis_url, q.redis_timeout_seconds)
    fallback = LocalQuotaStore() if q.redis_failure_policy == "local_fallback" else None
    processes = q.replicas * (settings.gateway.workers or 1)
    return TenantQuotas(q, RedisQuotaStore(client, prefix=key_prefix), fallback=fallback, processes=processes)
