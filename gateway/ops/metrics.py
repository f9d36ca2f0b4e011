"""Prometheus metrics of one gateway app (its own ``CollectorRegistry``, so several apps in one
process, as in tests, never clash). Labels carry tenant ids, routes, status codes, reasons and
upstream names only: never keys or prompt text.

With several workers (:mod:`gateway.edge.workers`) every worker process writes its values to files in
``PROMETHEUS_MULTIPROC_DIR`` (prometheus-client's multiprocess mode, chosen when that variable is
set before ``prometheus_client`` is first imported), and ``/metrics`` on any worker renders the
sum over all of them (:class:`prometheus_client.multiprocess.MultiProcessCollector`): counters and
histograms add up, ``kvgate_in_flight_requests`` sums the live workers, the pool gauges show the
smallest value a live worker holds (-1, unknown, when any worker does not know its pool).
"""

from __future__ import annotations

import contextlib
import glob
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import Metric

disable_created_metrics()  # the *_created series double every family and say nothing here

_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class WrittenFilesCollector:
    """prometheus-client's multiprocess merge over the workers' files in ``path``, skipping files
    of 0 bytes. A worker creates its file and only then sizes it, so a file is empty for a moment
    when a worker starts, for good when it was killed in that moment, and reading one raises
    inside :class:`~prometheus_client.multiprocess.MultiProcessCollector`, failing every
    family of the scrape (prometheus/client_python issue 1199): here such a file has recorded
    nothing yet and is left out. A file removed meanwhile is left out too (the merge itself
    skips those)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def collect(self) -> Iterable[Metric]:
        from prometheus_client.multiprocess import MultiProcessCollector

        files = []
        for f in glob.glob(os.path.join(self.path, "*.db")):
            with contextlib.suppress(FileNotFoundError):
                if os.path.getsize(f) > 0:
                    files.append(f)
        return MultiProcessCollector.merge(files, accumulate=True)


@dataclass(frozen=True)
class MetricFamily:
    """One metric family of :class:`GatewayMetrics`: the attribute it is held in, its kind,
    Prometheus name (counters without ``_total``, which the client adds), help text, label names,
    histogram bucket upper bounds (seconds; histograms only) and, for gauges, how multiprocess mode
    merges the workers' values (prometheus-client's ``multiprocess_mode``; ``all``, its default)."""

    attr: str
    kind: type[Counter] | type[Gauge] | type[Histogram]
    name: str
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = Histogram.DEFAULT_BUCKETS
    multiprocess_mode: Literal["all", "livemin", "livesum"] = "all"

    def build(self, registry: CollectorRegistry) -> Counter | Gauge | Histogram:
        """The family, registered in ``registry``."""
        labels = list(self.labels)
        if self.kind is Histogram:
            return Histogram(self.name, self.help, labels, registry=registry, buckets=self.buckets)
        if self.kind is Gauge:
            return Gauge(self.name, self.help, labels, registry=registry, multiprocess_mode=self.multiprocess_mode)
        return Counter(self.name, self.help, labels, registry=registry)


#: every family of the gateway's metrics, in exposition order
FAMILIES: tuple[MetricFamily, ...] = (
    MetricFamily(
        "requests",
        Counter,
        "kvgate_requests",
        "Requests answered, by tenant, route and HTTP status.",
        ("tenant", "route", "status"),
    ),
    MetricFamily(
        "rejections",
        Counter,
        "kvgate_rejections",
        "Requests refused by the gateway, by reason (error code).",
        ("reason",),
    ),
    MetricFamily(
        "prompt_tokens", Counter, "kvgate_prompt_tokens", "Prompt tokens admitted (gateway count).", ("tenant",)
    ),
    MetricFamily(
        "completion_tokens", Counter, "kvgate_completion_tokens", "Completion tokens the engines reported.", ("tenant",)
    ),
    MetricFamily(
        "overhead",
        Histogram,
        "kvgate_gateway_overhead_seconds",
        "Time spent in the gateway itself (excluding the upstream).",
        ("route",),
        buckets=_LATENCY_BUCKETS,
    ),
    MetricFamily(
        "ttft",
        Histogram,
        "kvgate_upstream_ttft_seconds",
        "Upstream time to first token (streams).",
        ("upstream",),
        buckets=_TTFT_BUCKETS,
    ),
    MetricFamily(
        "upstream_errors",
        Counter,
        "kvgate_upstream_errors",
        "Upstream failures, by upstream and kind.",
        ("upstream", "kind"),
    ),
    MetricFamily(
        "aborts",
        Counter,
        "kvgate_finish_reason_abort",
        "Responses with finish_reason 'abort' under HTTP 200.",
        ("upstream",),
    ),
    MetricFamily(
        "client_disconnects", Counter, "kvgate_client_disconnects", "Requests the client abandoned.", ("route",)
    ),
    MetricFamily(
        "pool_tokens",
        Gauge,
        "kvgate_pool_tokens",
        "Live KV pool size per upstream (smallest prefill node); -1 when unknown.",
        ("upstream",),
        multiprocess_mode="livemin",
    ),
    MetricFamily(
        "effective_limit",
        Gauge,
        "kvgate_effective_limit_tokens",
        "Pool limit per upstream after headroom; -1 when unknown.",
        ("upstream",),
        multiprocess_mode="livemin",
    ),
    MetricFamily(
        "in_flight", Gauge, "kvgate_in_flight_requests", "Requests being served now.", multiprocess_mode="livesum"
    ),
    MetricFamily(
        "quota_store_up",
        Gauge,
        "kvgate_quota_store_up",
        "1 while the shared quota store (Redis) answers; 0 from a failed call or start until a call succeeds "
        "(limited tenants meet redis_failure_policy meanwhile). Always 1 with quotas kept in the process.",
        multiprocess_mode="livemin",
    ),
    MetricFamily(
        "tenant_reload_failures",
        Counter,
        "kvgate_tenants_reload_failures",
        "Reads of the changed tenants file that failed (invalid or unreadable); the previous tenants stay.",
    ),
    MetricFamily(
        "tenants_file_valid",
        Gauge,
        "kvgate_tenants_file_valid",
        "1 while the tenants in force are the file's; 0 once a read of it failed (the previous tenants, "
        "revoked keys included, stay in force until it is fixed).",
        multiprocess_mode="livemin",
    ),
)


class GatewayMetrics:
    """The gateway's metric families (:data:`FAMILIES`, all prefixed ``kvgate_``), each an attribute."""

    content_type = CONTENT_TYPE_LATEST

    requests: Counter
    rejections: Counter
    prompt_tokens: Counter
    completion_tokens: Counter
    overhead: Histogram
    ttft: Histogram
    upstream_errors: Counter
    aborts: Counter
    client_disconnects: Counter
    pool_tokens: Gauge
    effective_limit: Gauge
    in_flight: Gauge
    quota_store_up: Gauge
    tenant_reload_failures: Counter
    tenants_file_valid: Gauge

    def __init__(self) -> None:
        #: multiprocess mode: the directory every worker's metric files live in (else ``None``)
        self.multiprocess_dir: str | None = os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None
        self.registry = CollectorRegistry(auto_describe=True)
        for family in FAMILIES:
            setattr(self, family.attr, family.build(self.registry))
        self.tenants_file_valid.set(1)
        self.quota_store_up.set(1)

    def tenant_reloaded(self, ok: bool) -> None:
        """A read of the changed tenants file succeeded (``ok``) or failed: the reload metrics."""
        self.tenants_file_valid.set(1 if ok else 0)
        if not ok:
            self.tenant_reload_failures.inc()

    def pool_updater(self, upstream: str):
        """A callback ``(pool_tokens | None, limit | None)`` setting the pool gauges of ``upstream``."""
        pool_g = self.pool_tokens.labels(upstream)
        lim_g = self.effective_limit.labels(upstream)

        def update(pool: int | None, limit: int | None) -> None:
            pool_g.set(-1 if pool is None else pool)
            lim_g.set(-1 if limit is None else limit)

        update(None, None)
        return update

    def render(self) -> bytes:
        """The text exposition format (the gateway's metrics, then the verifier's process-wide
        counters, ``kvgate_verifier_*``). In multiprocess mode: every family of every worker
        (dead ones included for counters and histograms, so nothing counted is lost), summed;
        this reads one file per worker process, so the caller runs it off the event loop."""
        if self.multiprocess_dir is not None:
            registry = CollectorRegistry()
            registry.register(WrittenFilesCollector(self.multiprocess_dir))
            return generate_latest(registry)
        from verifier.incidents import REGISTRY as VERIFIER_REGISTRY

        return generate_latest(self.registry) + generate_latest(VERIFIER_REGISTRY)
