"""Run the gateway app under uvicorn with a draining shutdown (docs/design.md, Contracts: "SIGTERM
drains in-flight requests before exit").

On the first SIGTERM or SIGINT the gateway starts draining: requests in flight run to their end
(streams included), new API requests get 503 ``server_shutting_down`` (``/readyz`` turns 503 so a
load balancer stops sending), and once nothing is in flight, or after ``drain_timeout_seconds``,
uvicorn stops. A request still in flight then is ended by the gateway
(:meth:`gateway.app.Gateway.cut_in_flight`: a stream gets a ``server_shutting_down`` error event
and its end, a request nothing was sent for a 503), settled and logged, within
:data:`CUT_GRACE_SECONDS`; uvicorn then waits at most :data:`GRACEFUL_SHUTDOWN_SECONDS` more. So
the process exits about ``drain_timeout_seconds`` + 1.5 s after the signal at the most (plus the
app's own shutdown). A second signal stops at once.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import resource
from typing import TYPE_CHECKING, Any

import uvicorn

if TYPE_CHECKING:
    from config.models import Settings

log = logging.getLogger("kvgate.server")

#: seconds the requests cut at the drain's end have to write their last bytes, settle and log
CUT_GRACE_SECONDS = 0.5
#: uvicorn's own wait for connections and tasks once it stops (the drain already waited)
GRACEFUL_SHUTDOWN_SECONDS = 1.0


class DrainingServer(uvicorn.Server):
    """``uvicorn.Server`` whose exit signal first drains the :class:`gateway.app.Gateway`."""

    def __init__(self, config: uvicorn.Config, gateway: Any, drain_timeout_seconds: float) -> None:
        super().__init__(config)
        self.gateway = gateway
        self.drain_timeout_seconds = drain_timeout_seconds
        self._draining = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[None] | None = None

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self._draining or self._loop is None:
            self.force_exit = self._draining
            super().handle_exit(sig, frame)
            return
        self._draining = True
        self.gateway.draining = True
        log.info("draining: %d request(s) in flight", self.gateway.in_flight)
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        if await self.gateway.wait_idle(self.drain_timeout_seconds):
            log.info("drained")
        else:
            n = self.gateway.cut_in_flight()
            log.warning("drain timed out; ending %d request(s) in flight with server_shutting_down", n)
            if not await self.gateway.wait_idle(CUT_GRACE_SECONDS):
                log.warning("%d request(s) still in flight; stopping", self.gateway.in_flight)
        self.should_exit = True


#: file descriptors a serving process needs besides its client and upstream connections (Redis,
#: the listening socket, logs, tokenizer and model files, the event loop's own, threads' pipes)
FD_HEADROOM = 256


class FdLimitError(RuntimeError):
    """The hard ``RLIMIT_NOFILE`` is below what the connection limits need."""


def upstream_origins(settings: Settings) -> int:
    """The distinct origins (scheme, host, port: :func:`gateway.relay.h1_transport.url_origin`)
    of the upstreams' ``api_url``: each has a pool of its own in either transport. A URL whose
    origin cannot be read (a port out of range) counts as one of its own."""
    from gateway.relay.h1_transport import url_origin
    from gateway.relay.upstream_base import ConnectError

    origins: set[object] = set()
    for u in settings.upstreams:
        try:
            origins.add(url_origin(u.api_url))
        except (ConnectError, ValueError):
            origins.add(u.api_url)
    return len(origins)


def fds_needed(settings: Settings) -> int:
    """File descriptors one gateway process may hold under ``settings``: every client connection
    (``gateway.max_inbound_connections``, lingering ones included), every upstream connection
    (``gateway.max_connections`` per upstream origin, busy and idle: :func:`upstream_origins`
    times it), and :data:`FD_HEADROOM`."""
    g = settings.gateway
    return int(g.max_inbound_connections) + upstream_origins(settings) * int(g.max_connections) + FD_HEADROOM


def raise_fd_limit(settings: Settings) -> int:
    """Raise this process's soft ``RLIMIT_NOFILE`` to :func:`fds_needed` (never lowers it, never
    above the hard limit); returns the soft limit now. Raises :class:`FdLimitError` when the hard
    limit is lower than needed (the message says the sum, the limits and how to fix it): without
    it, the process runs out of descriptors before ``max_inbound_connections`` and every accept
    fails."""
    need = fds_needed(settings)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return int(soft)
    if hard != resource.RLIM_INFINITY and hard < need:
        g, n = settings.gateway, upstream_origins(settings)
        raise FdLimitError(
            f"the open-file limit (RLIMIT_NOFILE) is {soft} (hard {hard}), below the {need} descriptors "
            f"gateway.max_inbound_connections ({g.max_inbound_connections}) + {n} upstream "
            f"origin{'' if n == 1 else 's'} x gateway.max_connections ({g.max_connections}) + {FD_HEADROOM} need. "
            "Raise the hard limit (ulimit -Hn, systemd LimitNOFILE=, docker --ulimit nofile=) or lower "
            "gateway.max_inbound_connections or gateway.max_connections."
        )
    resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    log.info("raised the open-file limit from %d to %d", soft, need)
    return need


#: net container allocations between young-generation collections in a serving process (Python's
#: default: 700)
GC_GEN0_THRESHOLD = 7000


def freeze_startup_objects() -> None:
    """Move every object alive now (modules, settings, tokenizers, the app) into the cyclic
    garbage collector's permanent generation (``gc.freeze``, Python 3.7+), after one full
    collection: a later full collection then scans only what serving created. Measured under
    ``bench/hostile.py``'s attack, one full collection over the startup objects held the event
    loop 66 ms. Then a young-generation collection comes every :data:`GC_GEN0_THRESHOLD`
    allocations instead of Python's 700, most of a request's objects gone by then (docs/performance.md,
    twelfth pass)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_GEN0_THRESHOLD, *gc.get_threshold()[1:])


def run_server(
    app: Any,
    host: str,
    port: int,
    *,
    drain_timeout_seconds: float = 30.0,
    log_level: str = "info",
    limits: Any = None,
    sock: Any = None,
) -> int:
    """Serve ``app`` (built by :func:`gateway.app.create_app`) on ``host:port`` until a signal
    has drained it. ``limits``: the client-side :class:`gateway.edge.protocol.EdgeLimits` (default: built
    from the app's ``gateway`` settings). ``sock``: a bound, not yet listening socket to serve on
    instead (a worker's ``SO_REUSEPORT`` socket, :mod:`gateway.edge.workers`); it starts listening once
    the app has started, so no connection reaches a worker before it is ready. Returns the exit
    status (0)."""
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=False,
        log_config=None,
        # the drain (DrainingServer) waited for the requests in flight and ended the rest; uvicorn
        # annotates int but only hands it to asyncio.timeout, which takes float seconds
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS,  # type: ignore[arg-type]
        lifespan="on",
        server_header=False,
        # nothing reads the client's address from the scope, so uvicorn's X-Forwarded-For
        # rewriting of it (a middleware layer on every request) serves nothing
        proxy_headers=False,
    )
    from gateway.edge.protocol import EdgeLimits, configure

    configure(config, limits or EdgeLimits.from_settings(app.state.gateway.settings.gateway))
    server = DrainingServer(config, app.state.gateway, drain_timeout_seconds)
    freeze_startup_objects()
    server.run(sockets=[sock] if sock is not None else None)
    return 0
