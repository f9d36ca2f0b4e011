"""The gateway app factory (docs/design.md, "A request's way through the gateway").

``create_app(settings, tenants, *, quotas=None, verifier=None, secrets=None) -> Starlette``. The
app's lifespan owns one pooled :class:`~gateway.relay.upstream_client.UpstreamClient` (every
forwarded request), one pooled ``httpx.AsyncClient`` (pool polls) and one
:class:`~gateway.ops.pool_watcher.PoolWatcher` task per upstream. The stages are
the contracts of :mod:`gateway.quotas.stage` / :mod:`verifier.stage`; ``None`` means switched off
(:class:`NullQuotas` / :class:`NullVerifier`), and a stage with ``aclose`` is closed at shutdown.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``POST /v1/responses``,
``POST /v1/embeddings``, ``POST /tokenize`` and ``/detokenize`` (also under ``/v1/``), ``GET /v1/models``,
``GET /v1/models/{id}``, ``GET /health`` (the same as ``/livez`` and ``/healthz``), ``GET /readyz``,
``GET /metrics``. Every error is OpenAI-shaped (:mod:`gateway.ops.errors`). ``app.state.gateway`` is the
:class:`Gateway`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import hmac
import logging
import time
from collections.abc import AsyncIterator
from functools import partial
from typing import Any, cast

import httpx
import orjson
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from config.background import one_round, stopping
from config.errors import ErrorCode, openai_error_bytes
from config.models import GatewaySettings, Settings
from gateway.admission.registry import ModelIndex
from gateway.edge import offload
from gateway.edge.body_budget import BodyBudget
from gateway.edge.workers import usable_cores
from gateway.ops import errors
from gateway.ops.metrics import GatewayMetrics
from gateway.ops.pool_watcher import PoolWatcher
from gateway.ops.tenants import TenantRegistry
from gateway.quotas.stage import NullQuotas, QuotaStage
from gateway.relay.response import SHUTDOWN_CUT
from gateway.relay.upstream_client import UpstreamClient
from gateway.relay.upstreams import UpstreamSet, make_upstream
from gateway.routes import API_ROUTES, TOKEN_ROUTES
from gateway.routes.handlers import handle_completion, handle_model, handle_models
from gateway.routes.tokenize_handlers import handle_tokenize
from verifier.stage import NullVerifier, VerifierStage

log = logging.getLogger("kvgate.app")

#: paths that keep answering while the gateway drains
_ALWAYS = frozenset({"/health", "/livez", "/healthz", "/readyz", "/metrics"})


@dataclasses.dataclass(frozen=True)
class _StartStep:
    """A step of :meth:`Gateway.start` run beside the others: what it is, what follows when it
    raises (the log line's end), and the ``/readyz`` check it fails until it is mended (``None``:
    none; the step's own later rounds mend it)."""

    what: str
    after: str
    check: str | None = None


#: a first pool poll that raised: fail closed, as after any failed poll
_POOL_UNKNOWN = "its pool is unknown until its watcher reads it"
#: a stage's ``async start()`` that raised: as on any failed store call
_STAGE_DEGRADED = "requests meet its failure policy until its store answers"
_WARM_UP = _StartStep(
    "warm-up",
    "a model's counter or the verifier's shingle encoder is not built; /readyz fails until a later try succeeds",
    check="warm_up",
)
#: a warm-up that failed is tried again after this, doubling up to :data:`WARM_UP_RETRY_MAX_SECONDS`
#: (seconds): a fault that passes (a panic under memory pressure, a volume mounted late) must not
#: leave the replica unready until someone restarts it, while its liveness probe passes
WARM_UP_RETRY_FIRST_SECONDS = 5.0
WARM_UP_RETRY_MAX_SECONDS = 60.0


def _poll_client(g: GatewaySettings) -> httpx.AsyncClient:
    """The client the pool watchers poll with (``g``: the gateway settings' timeouts and
    connection limit); the forward path has its own (:class:`UpstreamClient`)."""
    return httpx.AsyncClient(
        timeout=httpx.Timeout(
            connect=g.connect_timeout_seconds,
            read=g.read_timeout_seconds,
            write=g.read_timeout_seconds,
            pool=g.connect_timeout_seconds,
        ),
        limits=httpx.Limits(max_connections=g.max_connections, max_keepalive_connections=g.max_connections),
        trust_env=False,
    )


def _upstreams(settings: Settings, client: httpx.AsyncClient, metrics: GatewayMetrics) -> UpstreamSet:
    """Each configured upstream with its pool watcher (polling through ``client``, reporting to
    ``metrics``), bounded by the longest context length of the models it serves."""
    ups = []
    for u in settings.upstreams:
        ctx = max((m.context_length for n in u.models if (m := settings.model_by_name(n))), default=None)
        w = PoolWatcher(u, settings.pool, client, ctx, metrics.pool_updater(u.name))
        ups.append(make_upstream(u, w))
    return UpstreamSet(settings, ups)


class Gateway:
    """Everything one gateway app shares across requests: settings, tenants, models, upstreams
    with their pool watchers, the pooled HTTP client, metrics, the stages, the secrets, and the
    drain state (``draining``; ``in_flight`` HTTP requests, each with its task and ASGI scope,
    which :meth:`cut_in_flight` ends when the drain times out)."""

    def __init__(
        self,
        settings: Settings,
        tenants: TenantRegistry,
        quotas: QuotaStage | None,
        verifier: VerifierStage | None,
        secrets: dict[str, bytes] | None,
    ) -> None:
        self.settings = settings
        self.tenants = tenants
        self.quotas: QuotaStage = quotas if quotas is not None else NullQuotas()
        self.verifier: VerifierStage = verifier if verifier is not None else NullVerifier()
        if secrets is None:
            from config.secrets import load_secrets

            secrets = load_secrets(settings.state_dir)
        if not secrets.get("cache_salt_key"):
            raise ValueError("secrets must hold 'cache_salt_key'")
        self._salt_key = secrets["cache_salt_key"]
        self._salts: dict[str, str] = {}
        self.metrics = GatewayMetrics()
        watch = getattr(self.quotas, "watch_store", None)  # a shared store's state, as a gauge
        if callable(watch):
            watch(lambda up: self.metrics.quota_store_up.set(1 if up else 0))
        self.models = ModelIndex(settings, settings.gateway.offload_count_chars)
        g = settings.gateway
        self.client = _poll_client(g)
        #: the forward path's client (gateway.relay.upstream_client); ``client`` polls pools
        self.forwarder = UpstreamClient(
            connect_timeout=g.connect_timeout_seconds,
            read_timeout=g.read_timeout_seconds,
            max_connections=g.max_connections,
            exchange_timeout=g.exchange_timeout_seconds,
            kind=g.upstream_client,
        )
        self.upstreams = _upstreams(settings, self.client, self.metrics)
        rate = g.large_body_bytes_per_second
        #: what bodies past their first 64 KiB may take of this process (``None``: unpaced)
        self.body_budget: BodyBudget | None = BodyBudget(rate) if rate else None
        self.started_at = int(time.time())
        self.draining = False
        #: this process's index among the workers of one ``kvgate serve`` (``None``: the only one)
        self.worker: int | None = None
        self._idle = asyncio.Event()
        #: the HTTP requests in flight: each one's task and its ASGI scope (:class:`DrainMiddleware`)
        self.requests: dict[asyncio.Task[Any], dict[str, Any]] = {}
        #: named checks :meth:`start` failed (``/readyz`` 503 until a later try works): ``warm_up``
        self.start_faults: dict[str, str] = {}
        self._rewarm: asyncio.Task[None] | None = None

    def cache_salt(self, tenant_id: str) -> str:
        """The tenant's ``cache_salt``: hex HMAC-SHA256 of its id under the ``cache_salt_key`` secret."""
        s = self._salts.get(tenant_id)
        if s is None:
            s = hmac.new(self._salt_key, tenant_id.encode(), hashlib.sha256).hexdigest()
            self._salts[tenant_id] = s
        return s

    async def start(self) -> None:
        """Install the offload executor (:mod:`gateway.edge.offload`: per-tenant shares), poll every live
        pool once (so a healthy gateway is ready at once) while a stage's ``async start()`` runs (the
        quota store's connections) and the counters warm up (:meth:`_warm_up`), then start the
        watchers and a stage's background tasks (a plain ``start()``: the verifier's worker and
        periodic probe).

        A step of the concurrent part that raises does not stop the others, and is never dropped
        (:meth:`_start_fault`): each is logged with its traceback and treated as that step's later
        faults are. A pool poll (its own ``PoolReadError`` it handles) leaves the pool unknown:
        ``/readyz`` 503 and ``pool_size_unknown`` until its watcher reads it (fail closed, as a
        failed poll). A stage's ``async start()`` (the quota stage logs its store's failures
        itself; what escapes it is a ``BaseException`` such as a native panic) leaves its store
        unconnected, and requests meet its failure policy as on any failed store call (degrade,
        logged). The warm-up (each model's counter logs its own failure: that model's requests
        meet it) failing, the verifier's shingle encoder not built, means its checks would fault
        on every sampled response, as with a stopped worker: ``/readyz`` 503 with ``"checks":
        {"warm_up": false}`` until a later try works (:meth:`_warm_up_again`). A stop
        (:func:`config.background.stopping`) is raised."""
        g = self.settings.gateway
        offload.install(asyncio.get_running_loop(), g.offload_threads, g.offload_tenant_share, usable_cores())
        steps: list[tuple[_StartStep, Any]] = [
            (_StartStep(f"pool poll of upstream {u.name}", _POOL_UNKNOWN), u.watcher.poll_once())
            for u in self.upstreams.all
        ]
        for what, stage in (("quota stage", self.quotas), ("verifier stage", self.verifier)):
            start = getattr(stage, "start", None)
            if asyncio.iscoroutinefunction(start):
                steps.append((_StartStep(what, _STAGE_DEGRADED), start()))
        steps.append((_WARM_UP, asyncio.to_thread(self._warm_up)))
        results = await asyncio.gather(*(run for _, run in steps), return_exceptions=True)
        for (step, _), result in zip(steps, results, strict=True):
            if isinstance(result, BaseException):
                self._start_fault(step, result)
        if "warm_up" in self.start_faults:
            self._rewarm = asyncio.create_task(self._warm_up_again())
        for u in self.upstreams.all:
            u.watcher.start()
        for stage in (self.quotas, self.verifier):
            start = getattr(stage, "start", None)
            if callable(start) and not asyncio.iscoroutinefunction(start):
                start()
        log.info(
            "forwarding to %s with upstream_client %s",
            ", ".join(f"{u.name} ({u.base_url})" for u in self.upstreams.all),
            g.upstream_client,
        )

    def _start_fault(self, step: _StartStep, e: BaseException) -> None:
        """``step`` of :meth:`start` raised ``e`` (see there): logged with its traceback and what
        follows from it; a step with a ``check`` also fails ``/readyz`` (:attr:`start_faults`). A
        stop is raised."""
        if stopping(e):
            raise e
        if step.check is not None:
            self.start_faults[step.check] = type(e).__name__
        log.error(
            "%s failed at start (%s); %s",
            step.what,
            type(e).__name__,
            step.after,
            exc_info=(type(e), e, e.__traceback__),
        )

    def _warm_up(self) -> None:
        """Build, before the first request, what counting and fingerprinting build on first use:
        each model's counter (:meth:`ModelIndex.warm_up`) and a stage's ``warm_up()`` (the
        verifier's shingle encoder). Without it the first request of each worker held the event
        loop about 90 ms (docs/performance.md, tenth pass). Blocking: runs in a worker thread."""
        self.models.warm_up()
        warm = getattr(self.verifier, "warm_up", None)
        if callable(warm):
            warm()

    async def _warm_up_again(self) -> None:
        """Try a warm-up that failed at start again (:data:`WARM_UP_RETRY_FIRST_SECONDS`, doubling
        up to :data:`WARM_UP_RETRY_MAX_SECONDS`) until one succeeds; then ``/readyz`` passes again
        (its other checks allowing) and it is logged. A try that fails is logged at warning, its
        traceback only when the fault is not the one before."""
        delay = WARM_UP_RETRY_FIRST_SECONDS
        while "warm_up" in self.start_faults:
            await asyncio.sleep(delay)
            delay = min(delay * 2, WARM_UP_RETRY_MAX_SECONDS)
            with one_round(partial(self._warm_up_failed_again, next_s=delay)):
                await asyncio.to_thread(self._warm_up)
                fault = self.start_faults.pop("warm_up", None)
                log.warning("warm-up succeeded on a later try (it failed with %s); /readyz passes again", fault)

    def _warm_up_failed_again(self, e: BaseException, *, next_s: float) -> None:
        """A later try of the warm-up raised ``e``: ``/readyz`` keeps failing, naming it; the next
        try comes in ``next_s`` seconds."""
        same = self.start_faults.get("warm_up") == type(e).__name__
        self.start_faults["warm_up"] = type(e).__name__
        log.warning(
            "warm-up failed again (%s); /readyz keeps failing, next try in %g s",
            type(e).__name__,
            next_s,
            exc_info=None if same else (type(e), e, e.__traceback__),
        )

    async def stop(self) -> None:
        """Stop the warm-up's tries and the watchers, close the stages and the HTTP client."""
        if self._rewarm is not None:
            self._rewarm.cancel()
            await asyncio.gather(self._rewarm, return_exceptions=True)
        for u in self.upstreams.all:
            await u.watcher.stop()
        for stage in (self.quotas, self.verifier):
            close = getattr(stage, "aclose", None)
            if close is not None:
                with contextlib.suppress(Exception):
                    await close()
        await self.forwarder.aclose()
        await self.client.aclose()

    def ready(self) -> tuple[bool, dict[str, Any]]:
        """``(ready, report)``: ready when not draining, every upstream's limit is known and fresh,
        every named check of the verifier stage (``report["checks"]``) passes, and no step of
        :meth:`start` failed that fails them (``"warm_up": false``)."""
        ups = [u.watcher.status() for u in self.upstreams.all]
        health = getattr(self.verifier, "health", None)  # a stage's named checks (the verifier's worker)
        checks: dict[str, bool] = {**(health() if callable(health) else {}), **dict.fromkeys(self.start_faults, False)}
        ok = not self.draining and bool(ups) and all(s["known"] for s in ups) and all(checks.values())
        report: dict[str, Any] = {"status": "ready" if ok else "not_ready", "draining": self.draining, "upstreams": ups}
        if checks:
            report["checks"] = checks
        return ok, report

    @property
    def in_flight(self) -> int:
        """How many HTTP requests are in flight (probes and scrapes included)."""
        return len(self.requests)

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no request is in flight (or ``timeout`` seconds); True when idle."""
        if self.in_flight == 0:
            return True
        self._idle.clear()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return self.in_flight == 0

    def cut_in_flight(self) -> int:
        """End every request in flight (the drain timed out): mark its scope
        (:data:`gateway.relay.response.SHUTDOWN_CUT`) and cancel its task. A relay then ends its
        stream with a ``server_shutting_down`` error event (or answers 503 when nothing was sent)
        and settles as usual; any other request answers 503 (:class:`DrainMiddleware`). Returns
        how many were cut. A relay already finishing (its scope holds the key) is left to settle."""
        cut = [(task, scope) for task, scope in self.requests.items() if SHUTDOWN_CUT not in scope]
        for task, scope in cut:
            scope[SHUTDOWN_CUT] = True
            task.cancel()
        return len(cut)


async def _refuse_draining(send: Any) -> None:
    """Answer 503 ``server_shutting_down`` (the connection then closes)."""
    body = openai_error_bytes(
        "The gateway is shutting down; retry on another replica.",
        status=503,
        code=ErrorCode.SERVER_SHUTTING_DOWN,
    )
    await send(
        {
            "type": "http.response.start",
            "status": 503,
            "headers": [
                (b"content-type", b"application/json"),
                (b"connection", b"close"),
                (b"retry-after", b"1"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


class DrainMiddleware:
    """Pure ASGI middleware: counts HTTP requests in flight (until their response is fully sent,
    streams included) and, once the gateway drains, answers new API requests 503
    ``server_shutting_down`` (health, readiness and metrics keep answering)."""

    def __init__(self, app: Any, gw: Gateway | None = None) -> None:
        self.app = app
        self.gw = gw

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        gw = self.gw
        if scope["type"] != "http" or gw is None:
            await self.app(scope, receive, send)
            return
        if gw.draining and scope["path"] not in _ALWAYS:
            await _refuse_draining(send)
            gw.metrics.rejections.labels(ErrorCode.SERVER_SHUTTING_DOWN).inc()
            return
        counted = scope["path"] not in _ALWAYS  # the gauge: requests served, not probes or scrapes
        if counted:
            gw.metrics.in_flight.inc()
        task = cast("asyncio.Task[Any]", asyncio.current_task())  # a request always runs in a task
        gw.requests[task] = scope
        try:
            await self.app(scope, receive, send)
        except asyncio.CancelledError:
            if not scope.get(SHUTDOWN_CUT):
                raise
            task.uncancel()  # cut by the drain's end before anything answered it (a relay answers itself)
            gw.metrics.rejections.labels(ErrorCode.SERVER_SHUTTING_DOWN).inc()  # as a draining refusal
            with contextlib.suppress(Exception):  # a response already started: the connection closes
                await _refuse_draining(send)
        finally:
            del gw.requests[task]
            if counted:
                gw.metrics.in_flight.dec()
            if not gw.requests:
                gw._idle.set()


def ops_token_check(token: Any) -> Any:
    """``allowed(authorization_header) -> bool`` for ``/metrics`` and ``/readyz``'s details:
    always true when ``token`` (``gateway.metrics_token``, a ``SecretStr``) is unset; else true
    only for ``Bearer <token>`` (the scheme in any case, as API keys take it), compared in
    constant time (SHA-256 of both sides)."""
    if token is None:
        return lambda header: True
    want = hashlib.sha256(token.get_secret_value().encode()).digest()

    def allowed(header: str | None) -> bool:
        scheme, _, presented = (header or "").partition(" ")
        got = hashlib.sha256(presented.encode("utf-8", "surrogatepass")).digest()
        return hmac.compare_digest(got, want) and scheme.lower() == "bearer"

    return allowed


async def healthz(gw: Gateway, request: Request) -> Response:
    """``GET /health``, ``/livez``, ``/healthz``: liveness (names the worker when there are several)."""
    headers = {"x-kvgate-worker": str(gw.worker)} if gw.worker is not None else None
    return Response(b'{"status":"ok"}', media_type="application/json", headers=headers)


async def readyz(gw: Gateway, ops_allowed: Any, request: Request) -> Response:
    """``GET /readyz``: 200 or 503; the details only with the metrics token (:func:`ops_token_check`)."""
    ok, report = gw.ready()
    if not ops_allowed(request.headers.get("authorization")):
        report = {"status": report["status"]}  # the status code stays; the details need the token
    return Response(orjson.dumps(report), status_code=200 if ok else 503, media_type="application/json")


async def metrics(gw: Gateway, ops_allowed: Any, request: Request) -> Response:
    """``GET /metrics`` (Prometheus text), behind the metrics token (401 without it)."""
    if not ops_allowed(request.headers.get("authorization")):
        return Response(
            openai_error_bytes(
                "/metrics needs the metrics token (gateway.metrics_token) as 'Authorization: Bearer <token>'.",
                status=401,
                code=ErrorCode.INVALID_API_KEY,
            ),
            status_code=401,
            media_type="application/json",
            headers={"www-authenticate": "Bearer"},
        )
    m = gw.metrics
    if m.multiprocess_dir is None:
        body = m.render()
    else:  # the workers' files, read in a thread on the ops share: a flood of scrapes waits there
        offload.set_tenant(offload.OPS_SHARE)
        body = await asyncio.to_thread(m.render)
    return Response(body, media_type=m.content_type)


async def model_by_id(gw: Gateway, request: Request) -> Response:
    """``GET /v1/models/{model_id}`` (:func:`gateway.routes.handlers.handle_model`)."""
    return await handle_model(gw, request, request.path_params["model_id"])


def gateway_routes(gw: Gateway) -> list[Route]:
    """The app's routes, each a plain Starlette route (no dependency solving or response
    serialization per request): every API route value (:data:`gateway.routes.API_ROUTES`,
    :data:`gateway.routes.TOKEN_ROUTES`, the latter also under ``/v1``) at its path, the model
    list, liveness (``/health`` is the path vLLM and SGLang serve), readiness and metrics."""
    ops_allowed = ops_token_check(gw.settings.gateway.metrics_token)
    routes = [Route(r.path, partial(handle_completion, gw, route=r), methods=["POST"]) for r in API_ROUTES]
    for prefix in ("", "/v1"):
        routes += [
            Route(prefix + r.path, partial(handle_tokenize, gw, route=r), methods=["POST"]) for r in TOKEN_ROUTES
        ]
    routes += [
        Route("/v1/models", partial(handle_models, gw), methods=["GET"]),
        Route("/v1/models/{model_id:path}", partial(model_by_id, gw), methods=["GET"]),
        *(Route(path, partial(healthz, gw), methods=["GET"]) for path in ("/health", "/livez", "/healthz")),
        Route("/readyz", partial(readyz, gw, ops_allowed), methods=["GET"]),
        Route("/metrics", partial(metrics, gw, ops_allowed), methods=["GET"]),
    ]
    return routes


def create_app(
    settings: Settings,
    tenants: TenantRegistry,
    *,
    quotas: QuotaStage | None = None,
    verifier: VerifierStage | None = None,
    secrets: dict[str, bytes] | None = None,
) -> Starlette:
    """Build the gateway app: a plain Starlette app (FastAPI's layers, its OpenTelemetry and
    body-size middleware and its exit stack, ran on every request and served nothing here;
    docs/performance.md, tenth pass). ``secrets``: ``{"cache_salt_key": bytes, ...}`` (default:
    ``config.secrets.load_secrets(settings.state_dir)``). The :class:`Gateway` is built at once
    (``app.state.gateway``); its HTTP client and watchers start with the app's lifespan."""
    gw = Gateway(settings, tenants, quotas, verifier, secrets)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await gw.start()
        try:
            yield
        finally:
            await gw.stop()

    app = Starlette(
        routes=gateway_routes(gw),
        middleware=[Middleware(DrainMiddleware, gw=gw)],
        exception_handlers=errors.handlers(),
        lifespan=lifespan,
    )
    # a path with a trailing slash is a 404 like any unknown path: Starlette's redirect to the
    # path without it was built from the client's Host header, before any authentication
    app.router.redirect_slashes = False
    app.state.gateway = gw
    return app
