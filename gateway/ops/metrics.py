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

import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

disable_created_metrics()  # the *_created series double every family and say nothing here

_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class GatewayMetrics:
    """The gateway's metric families (names below, all prefixed ``kvgate_``)."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        #: multiprocess mode: the directory every worker's metric files live in (else ``None``)
        self.multiprocess_dir: str | None = os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "kvgate_requests",
            "Requests answered, by tenant, route and HTTP status.",
            ["tenant", "route", "status"],
            registry=r,
        )
        self.rejections = Counter(
            "kvgate_rejections", "Requests refused by the gateway, by reason (error code).", ["reason"], registry=r
        )
        self.prompt_tokens = Counter(
            "kvgate_prompt_tokens", "Prompt tokens admitted (gateway count).", ["tenant"], registry=r
        )
        self.completion_tokens = Counter(
            "kvgate_completion_tokens", "Completion tokens the engines reported.", ["tenant"], registry=r
        )
        self.overhead = Histogram(
            "kvgate_gateway_overhead_seconds",
            "Time spent in the gateway itself (excluding the upstream).",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "kvgate_upstream_ttft_seconds",
            "Upstream time to first token (streams).",
            ["upstream"],
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.upstream_errors = Counter(
            "kvgate_upstream_errors", "Upstream failures, by upstream and kind.", ["upstream", "kind"], registry=r
        )
        self.aborts = Counter(
            "kvgate_finish_reason_abort",
            "Responses with finish_reason 'abort' under HTTP 200.",
            ["upstream"],
            registry=r,
        )
        self.client_disconnects = Counter(
            "kvgate_client_disconnects", "Requests the client abandoned.", ["route"], registry=r
        )
        self.pool_tokens = Gauge(
            "kvgate_pool_tokens",
            "Live KV pool size per upstream (smallest prefill node); -1 when unknown.",
            ["upstream"],
            registry=r,
            multiprocess_mode="livemin",
        )
        self.effective_limit = Gauge(
            "kvgate_effective_limit_tokens",
            "Pool limit per upstream after headroom; -1 when unknown.",
            ["upstream"],
            registry=r,
            multiprocess_mode="livemin",
        )
        self.in_flight = Gauge(
            "kvgate_in_flight_requests", "Requests being served now.", registry=r, multiprocess_mode="livesum"
        )

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
            from prometheus_client.multiprocess import MultiProcessCollector

            registry = CollectorRegistry()
            MultiProcessCollector(registry, path=self.multiprocess_dir)
            return generate_latest(registry)
        from verifier.incidents import REGISTRY as VERIFIER_REGISTRY

        return generate_latest(self.registry) + generate_latest(VERIFIER_REGISTRY)
