"""Upstreams (docs/design.md, "Upstream entry"): several may serve one model; the gateway balances
them (least requests in flight, ties broken round-robin) and, on a connect failure, retries on
another before any byte is sent (see :mod:`gateway.relay.proxy`). An upstream that failed to
connect goes to the back of the order for a back-off (:data:`BACKOFF_FIRST_SECONDS`, doubling to
:data:`BACKOFF_MAX_SECONDS`; a connect that works ends it), so an engine that drops connects
costs one ``connect_timeout`` per back-off, not one per request it would have been given; it is
still tried when every other candidate failed or is backing off too.

Only upstreams whose pool limit is known and fresh are eligible; the limit a request of a model
is gated against is the smallest limit among them, so a retry on any of them still fits. An
upstream the verifier has quarantined for prompts of this length is skipped.

A tenant holds at most its share of an upstream origin's ``gateway.max_connections`` at once in
one process (:class:`TenantShare`, ``gateway.upstream_tenant_share``): a tenant's slow streams
otherwise held the whole pool, and every other tenant's request waited ``connect_timeout`` for a
connection and got 504. Upstreams at one origin share one pool in the transport, so they share
one :class:`TenantShare` too, which hands each connection given back to the waiting tenant that
holds fewest (tenants that together hold the whole pool cannot keep it).
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from dataclasses import dataclass
from fractions import Fraction
from typing import Protocol

from config.models import GatewaySettings, Settings, UpstreamConfig, url_origin
from gateway.ops.pool_watcher import PoolWatcher
from gateway.relay.upstream_base import PoolTimeout

#: seconds an upstream stays at the back of the order after its first connect failure in a row
BACKOFF_FIRST_SECONDS = 1.0
#: the longest back-off (seconds): each further failure in a row doubles it up to this
BACKOFF_MAX_SECONDS = 30.0


def tenant_cap_connections(g: GatewaySettings) -> int | None:
    """The connections one tenant may hold to one upstream origin at once in one process:
    ``max(1, floor(upstream_tenant_share x max_connections))``, the share taken as the decimal
    written (0.29 of 100 is 29, not the 28 of its binary float). ``None`` (no cap) when that is
    the whole pool: a share of 1, or a pool too small to share (one connection)."""
    share = g.upstream_tenant_share
    cap = max(1, math.floor(Fraction(repr(share)) * g.max_connections))
    return cap if cap < g.max_connections else None


class TenantShareTimeout(PoolTimeout):
    """A tenant held its whole share of an origin's connections (:class:`TenantShare`) for all of
    ``connect_timeout``: the client gets what a pool wait in vain gets (504 ``upstream_timeout``)
    and, the engine being healthy, the upstream no back-off; counted ``kind="tenant_share"``."""


class TenantShare:
    """The connections each tenant holds to one upstream origin in this process: at most
    ``cap_connections`` each (:func:`tenant_cap_connections`) and ``pool_connections`` in all
    (``gateway.max_connections``, the transport's pool for the origin). ``held_connections``:
    tenant id -> how many it holds (only tenants holding one). Taken (:meth:`try_take`,
    :meth:`take_any`) before the relay asks the transport for a connection, given back
    (:meth:`release`) once the relay is done with it, whatever the end.

    A request that finds its tenant at its cap, or every connection held, waits. One given back
    passes straight to a waiter (a later request cannot take it first): of the tenants waiting
    below their cap, the one holding fewest, ties to the earliest waiter (max-min fair). So
    tenants that together hold the whole pool (two at a cap of 0.75 each) pass the next
    connection given back to a third tenant waiting with none, not to their own next request."""

    def __init__(self, cap_connections: int, pool_connections: int) -> None:
        self.cap_connections = cap_connections
        self.pool_connections = pool_connections
        self.held_connections: dict[str, int] = {}
        self.total_held = 0
        #: tenant id -> its requests waiting (future -> arrival number), in arrival order (a
        #: waiter on several origins is in each of their queues; the first handed one is its result)
        self._waiters: dict[str, dict[asyncio.Future[TenantShare], int]] = {}
        self._arrivals = itertools.count()

    def try_take(self, tenant_id: str) -> bool:
        """Take one for ``tenant_id`` when it holds fewer than its cap and the origin has one not
        held; whether it did."""
        if self.held_connections.get(tenant_id, 0) >= self.cap_connections:
            return False
        if self.total_held >= self.pool_connections:
            return False
        self._count(tenant_id, 1)
        return True

    def at_cap(self, tenant_id: str) -> bool:
        """Whether ``tenant_id`` holds its whole cap (else a wait is for the origin's pool)."""
        return self.held_connections.get(tenant_id, 0) >= self.cap_connections

    def release(self, tenant_id: str) -> None:
        """Give one of ``tenant_id``'s back: handed to the fairest waiter (the class docstring),
        else off the counts."""
        self._count(tenant_id, -1)
        picked = self._fairest_waiter()
        if picked is not None:
            waiter_tenant, waiter = picked
            self._forget(waiter_tenant, waiter)
            self._count(waiter_tenant, 1)
            waiter.set_result(self)

    def _count(self, tenant_id: str, delta: int) -> None:
        """Add ``delta`` to ``tenant_id``'s connections and the origin's. Raises ``RuntimeError``
        for a release the tenant holds none for (a double release would let the share admit more
        than the pool holds)."""
        n = self.held_connections.get(tenant_id, 0) + delta
        if n < 0:
            raise RuntimeError(f"tenant {tenant_id} gave back a connection it does not hold")
        if n:
            self.held_connections[tenant_id] = n
        else:
            del self.held_connections[tenant_id]
        self.total_held += delta

    def _fairest_waiter(self) -> tuple[str, asyncio.Future[TenantShare]] | None:
        """``(tenant id, its first waiter still waiting)`` of the tenant below its cap holding
        fewest, ties to the earliest waiter; ``None`` when there is none. A tenant at its cap is
        passed over unread; one whose waiters are all done (gave up, or handed one by another
        origin: :meth:`take_any` forgets them) has none. Costs one step per waiting tenant."""
        best: tuple[int, int] | None = None
        picked = None
        for tenant_id, queue in self._waiters.items():
            held = self.held_connections.get(tenant_id, 0)
            if held >= self.cap_connections:
                continue
            first = next((w for w in queue if not w.done()), None)
            if first is None:
                continue
            key = (held, queue[first])
            if best is None or key < best:
                best, picked = key, (tenant_id, first)
        return picked

    @staticmethod
    async def take_any(shares: list[TenantShare], tenant_id: str, deadline: float) -> TenantShare:
        """One of ``shares`` taken for ``tenant_id``: the first with room, else the first to hand
        the tenant one given back before ``deadline`` (the loop's ``time()``). Raises
        ``TimeoutError`` (or the cancellation) holding none."""
        for share in shares:
            if share.try_take(tenant_id):
                return share
        waiter: asyncio.Future[TenantShare] = asyncio.get_running_loop().create_future()
        unique = list(dict.fromkeys(shares))  # upstreams of one origin share one
        for share in unique:
            share._waiters.setdefault(tenant_id, {})[waiter] = next(share._arrivals)
        try:
            async with asyncio.timeout_at(deadline):
                return await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                waiter.result().release(tenant_id)  # handed one in the turn it gave up: it passes on
            raise
        finally:
            for share in unique:
                share._forget(tenant_id, waiter)

    def _forget(self, tenant_id: str, waiter: asyncio.Future[TenantShare]) -> None:
        queue = self._waiters.get(tenant_id)
        if queue is None:
            return
        queue.pop(waiter, None)
        if not queue:
            del self._waiters[tenant_id]


class Routed(Protocol):
    """What an upstream URL is built from: a route value's ``upstream_path`` (``/chat/completions``,
    ``/completions``, ``/responses``, ``/embeddings``; :mod:`gateway.routes`)."""

    upstream_path: str


@dataclass(eq=False)
class Upstream:
    """One engine deployment: its config, pool watcher, ``base_url`` (``api_url`` without its
    trailing ``/``) and bearer header (fixed at start); live, the balancer's state: its in-flight
    count, its connect failures in a row and the ``time.monotonic()`` until which it backs off.
    ``share``: the tenants' connections to its origin (:class:`TenantShare`, shared by the
    upstreams of one origin; ``None``: no per-tenant cap)."""

    config: UpstreamConfig
    watcher: PoolWatcher
    base_url: str
    auth_header: str | None = None
    in_flight: int = 0
    connect_failures: int = 0
    backoff_until: float = 0.0
    share: TenantShare | None = None

    @property
    def name(self) -> str:
        return self.config.name

    def url_for(self, route: Routed) -> str:
        """The upstream URL of ``route``: ``base_url`` + the route's ``upstream_path``."""
        return self.base_url + route.upstream_path

    def connect_failed(self, now: float | None = None) -> None:
        """A connect to it failed (refused, timed out, no free connection): it backs off
        :data:`BACKOFF_FIRST_SECONDS` doubled per back-off in a row before this one, at most
        :data:`BACKOFF_MAX_SECONDS`, from ``now`` (``time.monotonic()`` seconds; default: now).
        Failures within a back-off (requests that were connecting together) count once, and a
        failure long after the last back-off ended starts again at the first."""
        if now is None:
            now = time.monotonic()
        if now < self.backoff_until:
            return
        if now - self.backoff_until > BACKOFF_MAX_SECONDS:
            self.connect_failures = 0
        backoff = min(BACKOFF_FIRST_SECONDS * 2.0 ** min(self.connect_failures, 16), BACKOFF_MAX_SECONDS)
        self.connect_failures += 1
        self.backoff_until = now + backoff

    def connected(self) -> None:
        """A connect to it worked (or a request ended without a connect failure): no back-off."""
        self.connect_failures = 0
        self.backoff_until = 0.0

    def backing_off(self, now: float) -> bool:
        """Whether it is in a back-off at ``now`` (``time.monotonic()`` seconds)."""
        return now < self.backoff_until


def make_upstream(cfg: UpstreamConfig, watcher: PoolWatcher) -> Upstream:
    """An :class:`Upstream` with its base URL (``api_url`` without a trailing ``/``) and bearer
    header (``"Bearer <api_key>"``, ``None`` when the upstream has no key) precomputed."""
    key = cfg.api_key.get_secret_value() if cfg.api_key is not None else None
    return Upstream(cfg, watcher, cfg.api_url.rstrip("/"), f"Bearer {key}" if key else None)


def share_origins(upstreams: list[Upstream], cap_connections: int | None, pool_connections: int) -> None:
    """Give each upstream its origin's :class:`TenantShare` of ``cap_connections`` a tenant and
    ``pool_connections`` in all (one for all the upstreams of an origin; ``cap_connections``
    ``None``: no cap, none)."""
    shares: dict[tuple[str, str, int | None], TenantShare] = {}
    for u in upstreams:
        if cap_connections is None:
            u.share = None
            continue
        origin = url_origin(u.base_url)
        share = shares.get(origin)
        if share is None:
            share = shares[origin] = TenantShare(cap_connections, pool_connections)
        u.share = share


class UpstreamSet:
    """Model id -> the upstreams serving it (``models`` in an upstream entry may name aliases).
    Each upstream is given its origin's :class:`TenantShare` (one per origin: the transport's
    pool is per origin), unless ``gateway.upstream_tenant_share`` leaves the pool uncapped."""

    def __init__(self, settings: Settings, upstreams: list[Upstream]) -> None:
        self.all = upstreams
        share_origins(upstreams, tenant_cap_connections(settings.gateway), settings.gateway.max_connections)
        self.by_model: dict[str, list[Upstream]] = {}
        for u in upstreams:
            for name in u.config.models:
                m = settings.model_by_name(name)
                if m is None:
                    continue
                lst = self.by_model.setdefault(m.id, [])
                if u not in lst:
                    lst.append(u)
        self._rr = itertools.count()

    def eligible(self, model_id: str) -> tuple[list[Upstream], int | None]:
        """``(upstreams with a known, fresh pool limit, the smallest such limit)``; the limit is
        ``None`` when there are none (fail closed)."""
        out: list[Upstream] = []
        limit: int | None = None
        for u in self.by_model.get(model_id, ()):
            lim = u.watcher.limit_now()
            if lim is None:
                continue
            out.append(u)
            limit = lim if limit is None else min(limit, lim)
        return out, limit

    def order(self, candidates: list[Upstream], now: float | None = None) -> tuple[list[Upstream], list[Upstream]]:
        """``(ready, backing)``: the candidates in the order to try them, split once at ``now``
        (``time.monotonic()`` seconds; default: now). ``ready``: those not backing off, fewest in
        flight first, ties round-robin; ``backing``: those backing off
        (:meth:`Upstream.backing_off`), the one whose back-off ends first first. Each candidate is
        in exactly one of them. The caller records each try's connect
        (:meth:`Upstream.connect_failed`, :meth:`Upstream.connected`;
        :func:`gateway.relay.proxy.open_upstream`)."""
        if now is None:
            now = time.monotonic()
        if len(candidates) <= 1:
            rotated = list(candidates)
        else:
            start = next(self._rr)
            n = len(candidates)
            rotated = [candidates[(start + i) % n] for i in range(n)]
        ready: list[Upstream] = []
        backing: list[Upstream] = []
        for u in rotated:
            (backing if u.backing_off(now) else ready).append(u)
        # stable: rotation breaks ties
        ready.sort(key=lambda u: u.in_flight)
        backing.sort(key=lambda u: u.backoff_until)
        return ready, backing
