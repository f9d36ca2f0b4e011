"""Upstreams (docs/design.md, "Upstream entry"): several may serve one model; the gateway balances
them (least requests in flight, ties broken round-robin) and, on a connect failure, retries on
another before any byte is sent (see :mod:`gateway.relay.proxy`).

Only upstreams whose pool limit is known and fresh are eligible; the limit a request of a model
is gated against is the smallest limit among them, so a retry on any of them still fits. An
upstream the verifier has quarantined for prompts of this length is skipped.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Protocol

from config.models import Settings, UpstreamConfig
from gateway.ops.pool_watcher import PoolWatcher


class Routed(Protocol):
    """What an upstream URL is built from: a route value's ``upstream_path`` (``/chat/completions``,
    ``/completions``, ``/responses``, ``/embeddings``; :mod:`gateway.routes`)."""

    upstream_path: str


@dataclass(eq=False)
class Upstream:
    """One engine deployment: its config, pool watcher, ``base_url`` (``api_url`` without its
    trailing ``/``) and bearer header (fixed at start), and its in-flight count (live: the
    balancer's only mutable state)."""

    config: UpstreamConfig
    watcher: PoolWatcher
    base_url: str
    auth_header: str | None = None
    in_flight: int = 0

    @property
    def name(self) -> str:
        return self.config.name

    def url_for(self, route: Routed) -> str:
        """The upstream URL of ``route``: ``base_url`` + the route's ``upstream_path``."""
        return self.base_url + route.upstream_path


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
        """Candidates in the order to try them: fewest in flight first, ties round-robin."""
        if len(candidates) <= 1:
            return list(candidates)
        start = next(self._rr)
        n = len(candidates)
        rotated = [candidates[(start + i) % n] for i in range(n)]
        return sorted(rotated, key=lambda u: u.in_flight)  # stable: rotation breaks ties
