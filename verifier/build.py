"""Assembles the gateway's verifier (:class:`verifier.service.VerifierService`) from settings.

:func:`build_verifier` picks the stores (Redis when there is a client or a ``redis_url``,
otherwise process memory and the quarantine state file), builds the detectors and the
collaborators, and hands them, with the one state lock they share, to the service.
"""

from __future__ import annotations

import collections
import functools
import random
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from config.models import Settings, TenantConfig, VerifierSettings
from config.redis_client import redis_client
from verifier.canary import CanaryRegistry
from verifier.caps import TenantCaps
from verifier.findings import Evidence, Findings, StoreHealth, kvgate_planted
from verifier.incidents import IncidentSink
from verifier.jobs import IngestBudget, JobQueue
from verifier.latency import LatencyKeeper, LatencyModel, RedisLatencyStore
from verifier.leak_index import LeakIndex, LeakStore, MemoryLeakStore, RedisLeakStore, RedisSpreadStore
from verifier.prober import PeriodicProbe
from verifier.quarantine import FileQuarantineBackend, Quarantine, RedisQuarantineBackend
from verifier.service import VerifierService
from verifier.shingles import ShingleHasher
from verifier.strict import StrictChecks


@dataclass(frozen=True)
class Stores:
    """Where the verifier keeps its state: the leak index's fingerprints, the canaries, the
    public-text spread counts, the quarantine view and (Redis only) the latency samples."""

    leak: LeakStore
    canary: LeakStore
    spread: LeakStore
    quarantine: RedisQuarantineBackend | FileQuarantineBackend
    latency: RedisLatencyStore | None


def stores_for(settings: Settings, redis: Any, aredis: Any, key_prefix: str) -> Stores:
    """Redis stores over the synchronous client ``redis`` (``aredis``, its asyncio twin or
    ``None``, serves small prompts' admission writes) under ``key_prefix``; with ``redis``
    ``None``, process memory and the quarantine file in ``settings.state_dir``."""
    cfg = settings.verifier
    if redis is None:
        return Stores(
            MemoryLeakStore(cfg.leak_index_ttl_seconds),
            MemoryLeakStore(cfg.leak_index_ttl_seconds),
            MemoryLeakStore(cfg.public_text_window_seconds),
            FileQuarantineBackend(settings.state_dir),
            None,
        )
    ttl = cfg.leak_index_ttl_seconds
    return Stores(
        RedisLeakStore(redis, ttl, key_prefix + "leak:", aclient=aredis),
        RedisLeakStore(redis, ttl, key_prefix + "canary:", aclient=aredis),
        RedisSpreadStore(
            redis, cfg.public_text_window_seconds, key_prefix + "spread:", cap=cfg.public_text_tenants + 1
        ),
        RedisQuarantineBackend(redis, key_prefix),
        RedisLatencyStore(redis, key_prefix),
    )


def latency_model(cfg: VerifierSettings) -> LatencyModel:
    """The TTFT lower-bound model ``cfg`` configures."""
    return LatencyModel(
        quantile=cfg.latency_quantile,
        margin=cfg.latency_margin,
        min_samples=cfg.latency_min_samples,
        min_prompt_tokens=cfg.latency_min_prompt_tokens,
        tenant_share=cfg.latency_tenant_share,
        min_tenants=cfg.latency_min_tenants,
    )


class Shared:
    """What the verifier's collaborators share: the counters (``stats``), the state ``lock``
    (the in-memory stores, the own-shingle cache and the latency model), the keyed ``hasher``
    (``key``: the ``leak_index_key`` secret), the leak index, canary registry and quarantine
    over ``stores``, the latency model, the incident sink (``incident_path``, default
    ``verifier.incident_log`` or ``state_dir/incidents.jsonl``), the store's back-off
    (``health``), the per-tenant caps and the detectors (``findings``, with ``planted``:
    whether a canary's owner is a tenant kvgate runs itself)."""

    def __init__(
        self,
        settings: Settings,
        stores: Stores,
        key: bytes,
        incident_path: str | None,
        planted: Callable[[str], bool],
    ) -> None:
        cfg = settings.verifier
        self.stats: collections.Counter = collections.Counter()
        self.lock = threading.Lock()
        self.hasher = ShingleHasher(key, cfg.shingle_k)
        self.index = LeakIndex(stores.leak, self.hasher, cfg.winnow_w, stores.spread, cfg.public_text_tenants)
        self.canaries = CanaryRegistry(stores.canary, key)
        self.quarantine = Quarantine(stores.quarantine)
        self.latency = latency_model(cfg)
        path = incident_path or cfg.incident_log or str(Path(settings.state_dir) / "incidents.jsonl")
        self.incidents = IncidentSink(path)
        self.health = StoreHealth(self.stats)
        self.evidence = Evidence(cfg, self.quarantine, self.incidents, self.stats)
        #: own-prompt shingle sets of exchanges that skipped admission (worker -> checks)
        self.own_cache: dict[str, set[int]] = {}
        self.caps = TenantCaps(cfg)
        self.findings = Findings(
            cfg, self.index, self.canaries, self.latency, self.health, self.evidence, self.own_cache, planted
        )


def build_verifier(
    settings: Settings,
    redis: Any = None,
    *,
    tenants: Iterable[TenantConfig] = (),
    secrets: dict[str, bytes] | None = None,
    key_prefix: str = "kvgate:",
    rng: random.Random | None = None,
    incident_path: str | None = None,
    probe_targets: list | None = None,
    tenant_source: Callable[[str], TenantConfig | None] | None = None,
) -> VerifierService:
    """The verifier for ``settings`` (``verifier`` section, ``redis_url``, ``state_dir``).

    - ``redis``: a synchronous redis-py client for the stores; default: made from
      ``settings.redis_url`` by :func:`config.redis_client.redis_client` (any mode, every call
      bounded by ``quotas.redis_timeout_seconds``), with its asyncio twin for small prompts'
      admission writes; ``None`` and no URL: in-process stores and the quarantine state file.
    - ``tenants``: the tenants known at start; ``secrets``: ``{"leak_index_key": bytes, ...}``
      (``config.secrets.load_secrets``), loaded from ``state_dir`` when ``None``;
      ``key_prefix``: Redis key prefix; ``rng``: sampling (tests seed it); ``incident_path``:
      see :class:`Shared`.
    - ``probe_targets``: the periodic probe's (``verifier.probe_interval_seconds``) list of
      :class:`verifier.probe.ProbeTarget`; default: every upstream, straight at the engine.
    - ``tenant_source``: ``tenant id -> TenantConfig | None`` (the gateway's tenant table),
      asked first whether a canary's owner is a honeypot: with several gateway workers, the
      honeypot's own request may have been served by another process.

    Raises ``ValueError`` for a malformed ``redis_url``, ``KeyError`` when the secrets lack
    ``leak_index_key``."""
    cfg = settings.verifier
    if secrets is None:
        from config.secrets import load_secrets

        secrets = load_secrets(settings.state_dir)
    aredis = None
    if redis is None and settings.redis_url:
        # strict checks call the store on the request path: the quotas' bound on every call
        timeout = settings.quotas.redis_timeout_seconds
        redis, aredis = redis_client(settings.redis_url, timeout, sync=True), redis_client(settings.redis_url, timeout)
    stores = stores_for(settings, redis, aredis, key_prefix)
    known = {t.id: t for t in tenants}
    probe_tenant = cfg.probe_tenant or "kvgate-probe"
    planted = functools.partial(kvgate_planted, tenant_source=tenant_source, tenants=known, probe_tenant=probe_tenant)
    sh = Shared(settings, stores, secrets["leak_index_key"], incident_path, planted)
    jobs = JobQueue(cfg, sh.findings, sh.lock, sh.own_cache, sh.stats, sh.caps)
    prober = None
    if cfg.probe_interval_seconds:
        prober = PeriodicProbe(settings, probe_targets, sh.canaries, sh.evidence, sh.lock, sh.stats, planted)
    return VerifierService(
        settings,
        ingest=IngestBudget(cfg, sh.hasher, sh.index, sh.canaries, sh.health, sh.lock, sh.stats, sh.caps),
        jobs=jobs,
        strict=StrictChecks(cfg, sh.findings, sh.evidence, jobs, sh.lock, sh.stats),
        latency_keeper=LatencyKeeper(sh.latency, stores.latency, sh.lock, sh.stats),
        tenants=known,
        rng=rng or random.Random(),
        prober=prober,
        aredis=aredis,
    )
