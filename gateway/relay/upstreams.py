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

from config.models import Settings, UpstreamConfig
from gateway.ops.pool_watcher import PoolWatcher


@dataclass(frozen=True)
class UpstreamRoutes:
    """An upstream's request URLs (``api_url`` + the route's path) and bearer header, fixed at start."""

    chat_url: str
    completions_url: str
    responses_url: str
    embeddings_url: str
    auth_header: str | None = None


@dataclass(eq=False)
class Upstream:
    """One engine deployment: its config, pool watcher and request URLs (fixed), and its in-flight
    count (live: the balancer's only mutable state)."""

    config: UpstreamConfig
    watcher: PoolWatcher
    routes: UpstreamRoutes
    in_flight: int = 0

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def auth_header(self) -> str | None:
        """``"Bearer <api_key>"``, or ``None`` when the upstream has no key."""
        return self.routes.auth_header

    def url_for(self, route: str) -> str:
        """The upstream URL of ``route`` (``chat``, ``completions``, ``responses``, ``embeddings``)."""
        if route == "chat":
            return self.routes.chat_url
        if route == "responses":
            return self.routes.responses_url
        if route == "embeddings":
            return self.routes.embeddings_url
        return self.routes.completions_url


def make_upstream(cfg: UpstreamConfig, watcher: PoolWatcher) -> Upstream:
    """An :class:`Upstream` with its URLs (``api_url`` + ``/chat/completions``, ``/completions``,
    ``/responses``, ``/embeddings``)
    and bearer header (from ``api_key``) precomputed."""
    base = cfg.api_url.rstrip("/")
    key = cfg.api_key.get_secret_value() if cfg.api_key is not None else None
    routes = UpstreamRoutes(
        chat_url=base + "/chat/completions",
        completions_url=base + "/completions",
        responses_url=base + "/responses",
        embeddings_url=base + "/embeddings",
        auth_header=f"Bearer {key}" if key else None,
    )
    return Upstream(cfg, watcher, routes)


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
