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
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Protocol

from config.models import Settings, UpstreamConfig
from gateway.ops.pool_watcher import PoolWatcher

#: seconds an upstream stays at the back of the order after its first connect failure in a row
BACKOFF_FIRST_SECONDS = 1.0
#: the longest back-off (seconds): each further failure in a row doubles it up to this
BACKOFF_MAX_SECONDS = 30.0


class Routed(Protocol):
    """What an upstream URL is built from: a route value's ``upstream_path`` (``/chat/completions``,
    ``/completions``, ``/responses``, ``/embeddings``; :mod:`gateway.routes`)."""

    upstream_path: str


@dataclass(eq=False)
class Upstream:
    """One engine deployment: its config, pool watcher, ``base_url`` (``api_url`` without its
    trailing ``/``) and bearer header (fixed at start); live, the balancer's state: its in-flight
    count, its connect failures in a row and the ``time.monotonic()`` until which it backs off."""

    config: UpstreamConfig
    watcher: PoolWatcher
    base_url: str
    auth_header: str | None = None
    in_flight: int = 0
    connect_failures: int = 0
    backoff_until: float = 0.0

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


class UpstreamSet:
    """Model id -> the upstreams serving it (``models`` in an upstream entry may name aliases)."""

    def __init__(self, settings: Settings, upstreams: list[Upstream]) -> None:
        self.all = upstreams
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

    def order(self, candidates: list[Upstream]) -> list[Upstream]:
        """Candidates in the order to try them: those not backing off first, fewest in flight
        first, ties round-robin; then those backing off, the one whose back-off ends first first.
        The caller records each try's connect (:meth:`Upstream.connect_failed`,
        :meth:`Upstream.connected`; :func:`gateway.relay.proxy.open_upstream`)."""
        if len(candidates) <= 1:
            return list(candidates)
        start = next(self._rr)
        n = len(candidates)
        rotated = [candidates[(start + i) % n] for i in range(n)]
        now = time.monotonic()
        # stable: rotation breaks ties
        return sorted(rotated, key=lambda u: (1, u.backoff_until) if u.backing_off(now) else (0, u.in_flight))
