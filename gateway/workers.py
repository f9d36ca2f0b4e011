"""Several gateway worker processes on one port (DESIGN.md, Contracts: "Workers").

``kvgate serve --workers N`` (``gateway.workers``; default: the usable cores when ``redis_url`` is
set, else 1) runs a small supervisor, this module's :class:`Supervisor`, that starts N worker
processes, each a whole gateway (``kvgate serve --worker-index I``) on the same address:

- **One port.** The supervisor binds the address first (so ``--port 0`` and "address in use"
  are settled once) and keeps that socket without listening on it; every worker binds the same
  address with ``SO_REUSEPORT`` and starts listening only once its app has started (pool polled,
  stages up), so the kernel spreads new connections over the workers that are ready. Where the
  platform has no ``SO_REUSEPORT``, the workers share the supervisor's listening socket instead.
- **Shared state.** Quotas, the leak index, the canary registry and the quarantine view live in
  Redis (the quarantine view, without Redis, in the state directory's file), so N workers decide
  as one gateway; more than one worker without ``redis_url`` is refused while quotas or the
  verifier are on (:func:`workers_refusal`). ``quotas.replicas`` x ``workers`` is the process
  count ``local_fallback`` divides limits by. Only worker 0 runs the periodic canary probe.
- **Metrics.** The supervisor points ``PROMETHEUS_MULTIPROC_DIR`` at a fresh directory (or
  empties the operator's); each worker writes its values there and ``/metrics`` on any worker
  renders the sum (:mod:`gateway.metrics`). A worker that exits is marked dead for the live
  gauges; its counters stay in the sum.
- **Signals.** SIGTERM or SIGINT: every worker gets one SIGTERM and drains (requests in flight run
  to their end, new ones get 503), the supervisor exits 0 once all have; a second signal is
  passed on too (the workers stop at once). SIGHUP is passed on (each worker re-reads the tenants
  file; each also polls it). A worker that dies on its own (killed, or exiting later) is started
  again; one that exits with an error status within :data:`START_GRACE_SECONDS` of its start
  stops the whole gateway with that status (a bad config or a taken port fails fast rather than
  looping), and so do more than :data:`MAX_RESTARTS` restarts in :data:`RESTART_WINDOW_SECONDS`.
  Workers run in a process group of their own (a terminal's Ctrl-C reaches the supervisor only,
  so it is one drain, not two signals) and die with the supervisor if it is killed (``PR_SET_PDEATHSIG`` on Linux).
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("kvgate.workers")

#: a worker that exits with an error status sooner than this after its start stops the gateway (seconds)
START_GRACE_SECONDS = 10.0
#: more restarts than this within :data:`RESTART_WINDOW_SECONDS` stop the gateway
MAX_RESTARTS = 5
RESTART_WINDOW_SECONDS = 60.0
#: how often the supervisor looks at its workers (seconds)
POLL_SECONDS = 0.2
#: the supervisor's pid, as its workers see it (they exit when their parent is another)
SUPERVISOR_PID_ENV = "KVGATE_SUPERVISOR_PID"
#: the shared listening socket's descriptor, where there is no ``SO_REUSEPORT``
LISTEN_FD_ENV = "KVGATE_LISTEN_FD"
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

_PR_SET_PDEATHSIG = 1


def usable_cores() -> int:
    """CPUs this process may run on (``os.sched_getaffinity``; ``os.cpu_count()`` where the
    platform has no affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def resolve_workers(requested: int | None, settings: Any) -> int:
    """How many workers to run: ``requested`` (``--workers``), else ``gateway.workers``, else the
    usable cores when ``redis_url`` is set and 1 otherwise. Raises ``ValueError`` below 1."""
    n = requested if requested is not None else settings.gateway.workers
    if n is None:
        n = usable_cores() if settings.redis_url else 1
    if n < 1:
        raise ValueError(f"workers must be at least 1, not {n}")
    return n


def workers_refusal(n: int, settings: Any) -> str | None:
    """Why ``n`` workers cannot run with ``settings`` (``None`` when they can): more than one
    worker keeps quotas and the leak index apart per process unless ``redis_url`` is set, so it is
    refused while quotas or the verifier are on."""
    if n <= 1 or settings.redis_url:
        return None
    on = [
        name
        for name, enabled in (("quotas", settings.quotas.enabled), ("verifier", settings.verifier.enabled))
        if enabled
    ]
    if not on:
        return None
    return (
        f"{n} workers need redis_url: {' and '.join(on)} would otherwise be kept apart in each worker "
        "(quotas admitted N times, leaks between workers' tenants missed). Set redis_url, or run --workers 1."
    )


def bind_socket(host: str, port: int, *, reuse_port: bool = True) -> socket.socket:
    """A TCP socket bound to ``host:port`` (IPv4 or IPv6, as ``host`` resolves), not listening,
    with ``SO_REUSEADDR`` and (``reuse_port``, where the platform has it) ``SO_REUSEPORT``.
    Raises ``OSError`` (e.g. the address is in use by another program)."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port and hasattr(socket, "SO_REUSEPORT"):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if family == socket.AF_INET6:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(addr)
    except OSError:
        sock.close()
        raise
    return sock


def worker_socket(host: str, port: int) -> socket.socket:
    """The socket a worker serves on: the supervisor's shared listening socket when it passed one
    (``KVGATE_LISTEN_FD``), else its own ``SO_REUSEPORT`` socket on ``host:port``."""
    fd = os.environ.get(LISTEN_FD_ENV)
    if fd:
        return socket.socket(fileno=int(fd))
    return bind_socket(host, port)


def become_worker() -> None:
    """Called first thing in a worker: die with the supervisor (``PR_SET_PDEATHSIG`` = SIGKILL on
    Linux, as a killed gateway's workers must not keep serving or holding leases), and exit at
    once if the supervisor is already gone."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    expected = os.environ.get(SUPERVISOR_PID_ENV)
    if expected and os.getppid() != int(expected):
        os._exit(1)


@dataclass
class _Worker:
    index: int
    proc: subprocess.Popen[bytes]
    started: float
    reaped: bool = False


class Supervisor:
    """Runs ``count`` workers on ``host:port`` until a signal has drained them all.

    ``command(index, port)``: a worker's argv (``kvgate serve ... --worker-index I``; ``port`` is
    the one the supervisor bound, so ``0`` becomes a real port). ``env``: the workers' environment
    (default ``os.environ``); ``PROMETHEUS_MULTIPROC_DIR``, ``KVGATE_SUPERVISOR_PID`` and, without
    ``SO_REUSEPORT``, ``KVGATE_LISTEN_FD`` are added. :meth:`run` returns the exit status: 0 after
    a drain, else the status of a worker that failed within its start grace (1 if it was killed
    by a signal)."""

    def __init__(
        self,
        count: int,
        host: str,
        port: int,
        command: Callable[[int, int], list[str]],
        *,
        env: dict[str, str] | None = None,
    ) -> None:
        if count < 1:
            raise ValueError("count must be at least 1")
        self.count = count
        self.host = host
        self.port = port
        self.command = command
        self.env = dict(os.environ if env is None else env)
        self.workers: list[_Worker] = []
        self.metrics_dir: str | None = None
        self._own_metrics_dir = False
        self._stopping = 0  # signals received
        self._wake = threading.Event()
        self._status = 0
        self._restarts: list[float] = []  # monotonic times
        self._listen: socket.socket | None = None

    # ------------------------------------------------------------------ set-up
    def _prepare_metrics_dir(self) -> str:
        given = self.env.get(MULTIPROC_ENV)
        if given:
            os.makedirs(given, exist_ok=True)
            for f in glob.glob(os.path.join(given, "*.db")):  # a previous run's values must not count
                with contextlib.suppress(OSError):
                    os.remove(f)
            return given
        self._own_metrics_dir = True
        return tempfile.mkdtemp(prefix="kvgate-metrics-")

    def _spawn(self, index: int) -> _Worker:
        env = {**self.env, MULTIPROC_ENV: self.metrics_dir or "", SUPERVISOR_PID_ENV: str(os.getpid())}
        pass_fds: tuple[int, ...] = ()
        if self._listen is not None:
            env[LISTEN_FD_ENV] = str(self._listen.fileno())
            pass_fds = (self._listen.fileno(),)
        proc = subprocess.Popen(
            self.command(index, self.port), env=env, stdin=subprocess.DEVNULL, pass_fds=pass_fds, process_group=0
        )
        w = _Worker(index, proc, time.monotonic())
        log.info("worker %d started (pid %d)", index, proc.pid)
        return w

    # ------------------------------------------------------------------ signals
    def _on_stop(self, sig: int, _frame: Any) -> None:
        self._stopping += 1
        log.info("%s: draining %d worker(s)", signal.Signals(sig).name, self.count)
        self._signal_all(signal.SIGTERM)
        self._wake.set()

    def _on_hup(self, _sig: int, _frame: Any) -> None:
        self._signal_all(signal.SIGHUP)

    def _signal_all(self, sig: int) -> None:
        for w in self.workers:
            if w.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    w.proc.send_signal(sig)

    # ------------------------------------------------------------------ the loop
    def _reap(self, w: _Worker) -> bool:
        """Handle a worker that exited; True when the gateway must stop."""
        w.reaped = True
        rc = w.proc.returncode
        if self.metrics_dir:
            from prometheus_client import multiprocess

            with contextlib.suppress(Exception):
                multiprocess.mark_process_dead(w.proc.pid, self.metrics_dir)
        if self._stopping:
            return False
        now = time.monotonic()
        lived = now - w.started
        if rc is not None and rc > 0 and lived < START_GRACE_SECONDS:
            log.error("worker %d exited %s within %.1f s of its start: stopping the gateway", w.index, rc, lived)
            self._status = rc
            return True
        self._restarts = [t for t in self._restarts if now - t < RESTART_WINDOW_SECONDS] + [now]
        if len(self._restarts) > MAX_RESTARTS:
            log.error(
                "workers restarted %d times in %.0f s: stopping the gateway", MAX_RESTARTS, RESTART_WINDOW_SECONDS
            )
            self._status = 1
            return True
        log.error("worker %d (pid %d) exited %s after %.0f s: starting it again", w.index, w.proc.pid, rc, lived)
        self.workers[self.workers.index(w)] = self._spawn(w.index)
        return False

    def run(self) -> int:
        """Bind, start the workers, supervise them until every one has exited; the exit status."""
        reuse_port = hasattr(socket, "SO_REUSEPORT")
        reserve = bind_socket(self.host, self.port, reuse_port=reuse_port)
        self.port = reserve.getsockname()[1]
        if not reuse_port:  # one listening socket, shared by every worker
            reserve.listen(2048)
            reserve.set_inheritable(True)
            self._listen = reserve
        self.metrics_dir = self._prepare_metrics_dir()
        self.env[MULTIPROC_ENV] = self.metrics_dir
        previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
        signal.signal(signal.SIGTERM, self._on_stop)
        signal.signal(signal.SIGINT, self._on_stop)
        signal.signal(signal.SIGHUP, self._on_hup)
        log.info("gateway on %s:%d with %d workers", self.host, self.port, self.count)
        try:
            self.workers = [self._spawn(i) for i in range(self.count)]
            failed = False
            while True:
                for w in list(self.workers):
                    if not w.reaped and w.proc.poll() is not None and self._reap(w):
                        failed = True
                if failed and not self._stopping:
                    self._stopping = 1
                    self._signal_all(signal.SIGTERM)
                if self._stopping and all(w.proc.poll() is not None for w in self.workers):
                    for w in self.workers:
                        if not w.reaped:
                            self._reap(w)
                    break
                self._wake.wait(POLL_SECONDS)
                self._wake.clear()
        finally:
            for s, h in previous.items():
                with contextlib.suppress(ValueError, TypeError):
                    signal.signal(s, h)
            for w in self.workers:  # never leave a worker behind
                if w.proc.poll() is None:
                    w.proc.kill()
                    w.proc.wait(5)
            reserve.close()
            if self._own_metrics_dir and self.metrics_dir:
                shutil.rmtree(self.metrics_dir, ignore_errors=True)
        log.info("all workers exited")
        return self._status
