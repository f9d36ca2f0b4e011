"""Several gateway worker processes on one port (docs/design.md, Contracts: "Workers").

``kvgate serve --workers N`` (``gateway.workers``; default: the usable cores when ``redis_url`` is
set, else 1) runs a small supervisor, this module's :class:`Supervisor`, that starts N worker
processes, each a whole gateway (``kvgate serve --worker-index I``) on the same address:

- **One port.** The supervisor binds and listens on the address (so ``--port 0`` and "address
  in use" are settled once) and every worker inherits that one listening socket
  (``KVGATE_LISTEN_FD``): a worker accepts only once its app has started (pool polled, stages up);
  until then, connections wait in the socket's backlog. The socket carries no ``SO_REUSEPORT``,
  so no other process can bind the port beside it. ``gateway.reuse_port`` (``--reuse-port``)
  asks for ``SO_REUSEPORT`` sockets instead, one per worker (the kernel spreads connections
  evenly), at a cost: any process of the same user that binds the port with ``SO_REUSEPORT`` then
  joins the group and receives a share of the connections, their ``Authorization`` headers
  included.
- **Shared state.** Quotas, the leak index, the canary registry and the quarantine view live in
  Redis (the quarantine view, without Redis, in the state directory's file), so N workers decide
  as one gateway; more than one worker without ``redis_url`` is refused while quotas or the
  verifier are on (:func:`workers_refusal`). ``quotas.replicas`` x ``workers`` is the process
  count ``local_fallback`` divides limits by. Only worker 0 runs the periodic canary probe.
- **Metrics.** The supervisor points ``PROMETHEUS_MULTIPROC_DIR`` at a private directory it creates
  (0700), or at the operator's, which must be empty or hold only prometheus-client's own files
  (:func:`metrics_dir_refusal`; kvgate refuses to start otherwise and deletes nothing); each
  worker writes its values there and ``/metrics`` on any worker renders the sum
  (:mod:`gateway.ops.metrics`). A worker that exits is marked dead for the live gauges; its counters
  stay in the sum.
- **Signals.** SIGTERM or SIGINT: every worker gets one SIGTERM and drains (requests in flight run
  to their end, new ones get 503), the supervisor exits 0 once all have; a second signal is
  passed on too (the workers stop at once). SIGHUP is passed on (each worker re-reads the tenants
  file; each also polls it). A worker that dies on its own (killed, or exiting later) is started
  again; one that exits with an error status within :data:`START_GRACE_SECONDS` of its start
  stops the whole gateway with that status (a bad config or a taken port fails fast rather than
  looping), and so do more than :data:`MAX_RESTARTS` restarts in :data:`RESTART_WINDOW_SECONDS`.
  A restart whose fork or exec fails (``EAGAIN``, ``ENOMEM``) is logged and tried again after a
  back-off (:data:`RESTART_BACKOFF_SECONDS`, doubling), each try counted in that budget, while the
  other workers keep serving; a stop cancels it. A worker whose first start fails stops the
  gateway, the workers started before it drained (SIGTERM) first.
  Workers run in a process group of their own (a terminal's Ctrl-C reaches the supervisor only,
  so it is one drain, not two signals) and die with the supervisor if it is killed (``PR_SET_PDEATHSIG`` on Linux).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import os
import re
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
#: a restart whose fork or exec failed is tried again after this, doubling after each failed try
#: up to :data:`RESTART_BACKOFF_MAX_SECONDS` (seconds); every try counts in :data:`MAX_RESTARTS`.
#: A cap under ``RESTART_WINDOW_SECONDS / MAX_RESTARTS`` makes a restart that keeps failing spend
#: the budget (with these values, five failed tries: the gateway stops about 25 s after the death)
RESTART_BACKOFF_SECONDS = 1.0
RESTART_BACKOFF_MAX_SECONDS = 10.0
#: a worker whose first start failed: how long the workers started before it may drain before
#: they are killed (seconds)
START_DRAIN_SECONDS = 30.0
#: the supervisor's pid, as its workers see it (they exit when their parent is another)
SUPERVISOR_PID_ENV = "KVGATE_SUPERVISOR_PID"
#: the supervisor's listening socket's descriptor, inherited by every worker (unless ``reuse_port``)
LISTEN_FD_ENV = "KVGATE_LISTEN_FD"
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

_PR_SET_PDEATHSIG = 1


def _read_ints(path: str) -> list[str] | None:
    try:
        with open(path, encoding="ascii") as f:
            return f.read().split()
    except (OSError, UnicodeDecodeError):
        return None


def _quota_of(fields: list[str] | None, period: list[str] | None = None) -> float | None:
    """CPUs allowed by a quota: ``fields`` is cgroup v2's ``cpu.max`` ("QUOTA PERIOD", QUOTA
    ``max`` = none), or v1's ``cpu.cfs_quota_us`` ("-1" = none) with ``period`` its
    ``cpu.cfs_period_us``; ``None`` when there is no (readable) quota."""
    if not fields:
        return None
    if period is None:  # v2
        if len(fields) != 2 or fields[0] == "max":
            return None
        quota_s, period_s = fields
    else:
        if not period:
            return None
        quota_s, period_s = fields[0], period[0]
    try:
        quota, per = int(quota_s), int(period_s)
    except ValueError:
        return None
    return quota / per if quota > 0 and per > 0 else None


def cgroup_cpu_limit(root: str = "/sys/fs/cgroup") -> float | None:
    """CPUs the cgroup CPU quota under ``root`` allows (v2 ``cpu.max``, else v1
    ``cpu/cpu.cfs_quota_us`` over ``cpu.cfs_period_us``, also under ``cpu,cpuacct/``), e.g. 1.5;
    ``None`` without a quota. Inside a container ``root`` is the container's own cgroup."""
    v2 = _quota_of(_read_ints(os.path.join(root, "cpu.max")))
    if v2 is not None:
        return v2
    for sub in ("cpu", "cpu,cpuacct", "cpuacct,cpu", ""):
        base = os.path.join(root, sub) if sub else root
        quota = _read_ints(os.path.join(base, "cpu.cfs_quota_us"))
        if quota is not None:
            return _quota_of(quota, _read_ints(os.path.join(base, "cpu.cfs_period_us")))
    return None


def usable_cores(cgroup_root: str = "/sys/fs/cgroup") -> int:
    """CPUs this process may use, at least 1: ``os.sched_getaffinity`` (``os.cpu_count()`` where
    the platform has no affinity), capped by the cgroup CPU quota rounded up
    (:func:`cgroup_cpu_limit`): a container limited to 2.5 CPUs on a 96-core node gets 3, not 96."""
    try:
        cores = max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        cores = max(1, os.cpu_count() or 1)
    quota = cgroup_cpu_limit(cgroup_root)
    if quota is not None:
        cores = min(cores, max(1, math.ceil(quota)))
    return cores


#: the most worker processes (``gateway.workers`` has the same bound)
MAX_WORKERS = 256


def resolve_workers(requested: int | None, settings: Any) -> int:
    """How many workers to run: ``requested`` (``--workers``), else ``gateway.workers``, else the
    usable cores when ``redis_url`` is set and 1 otherwise. Raises ``ValueError`` below 1 or
    above :data:`MAX_WORKERS` (``gateway.workers``' own bound)."""
    n = requested if requested is not None else settings.gateway.workers
    if n is None:
        n = usable_cores() if settings.redis_url else 1
    if not 1 <= n <= MAX_WORKERS:
        raise ValueError(f"workers must be from 1 to {MAX_WORKERS}, not {n}")
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


def bind_socket(host: str, port: int, *, reuse_port: bool = False) -> socket.socket:
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
    """The socket a worker serves on: the supervisor's listening socket when it passed one
    (``KVGATE_LISTEN_FD``), else (``reuse_port``) its own ``SO_REUSEPORT`` socket on ``host:port``."""
    fd = os.environ.get(LISTEN_FD_ENV)
    if fd:
        return socket.socket(fileno=int(fd))
    return bind_socket(host, port, reuse_port=True)


#: the files prometheus-client's multiprocess mode writes: ``{type}_{pid}.db``, a gauge's type
#: with its mode (prometheus_client/values.py, ``MmapedValue.__reset``: ``'{}_{}.db'.format(
#: file_prefix, pid)``; the modes: metrics.py, ``Gauge._MULTIPROC_MODES``)
PROMETHEUS_FILE = re.compile(
    r"(?:counter|histogram|summary"
    r"|gauge_(?:all|liveall|min|livemin|max|livemax|sum|livesum|mostrecent|livemostrecent))_\d+\.db"
)


class MetricsDirError(ValueError):
    """The operator's ``PROMETHEUS_MULTIPROC_DIR`` holds files that are not prometheus-client's."""


class WorkerStartError(RuntimeError):
    """A worker's process could not be started, at the gateway's start or restarting a dead one:
    the ``OSError`` of its fork or exec (``EAGAIN``, ``ENOMEM``: a process or memory limit), the
    message naming the worker. Not an ``OSError``, so it is never reported as the address's."""


def metrics_dir_refusal(path: str) -> str | None:
    """Why ``path`` (an operator's ``PROMETHEUS_MULTIPROC_DIR``) cannot be the metrics folder, or
    ``None``: a folder that does not exist yet, is empty or holds only prometheus-client's files
    (:data:`PROMETHEUS_FILE`, a previous run's, removed at start) is fine; anything else (another
    application's files, folders) is refused, and nothing is deleted."""
    try:
        entries = sorted(os.listdir(path))
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"{MULTIPROC_ENV}={path} cannot be read: {e}"
    foreign = [e for e in entries if not (PROMETHEUS_FILE.fullmatch(e) and os.path.isfile(os.path.join(path, e)))]
    if not foreign:
        return None
    shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
    return (
        f"{MULTIPROC_ENV}={path} holds files that are not prometheus-client's ({shown}); kvgate "
        "empties that folder at every start, so it must be empty or kvgate's own. Unset "
        f"{MULTIPROC_ENV} (kvgate then makes a private folder) or point it at an empty folder."
    )


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


@dataclass
class _PendingRestart:
    """A dead worker's restart whose last try failed: tried again at ``due`` (monotonic seconds)."""

    due: float
    delay: float  # the back-off after the next failed try (seconds)
    error: WorkerStartError  # the last try's


class Supervisor:
    """Runs ``count`` workers on ``host:port`` until a signal has drained them all.

    ``command(index, port)``: a worker's argv (``kvgate serve ... --worker-index I``; ``port`` is
    the one the supervisor bound, so ``0`` becomes a real port). ``env``: the workers' environment
    (default ``os.environ``); ``PROMETHEUS_MULTIPROC_DIR``, ``KVGATE_SUPERVISOR_PID`` and, unless
    ``reuse_port``, ``KVGATE_LISTEN_FD`` are added. ``reuse_port``: each worker binds its own
    ``SO_REUSEPORT`` socket (see the module docstring for the risk). :meth:`run` returns the exit
    status: 0 after a drain, else the status of a worker that failed within its start grace (1 if
    it was killed by a signal, or after too many restarts); it raises ``OSError`` (the address) and
    :class:`MetricsDirError` before any worker starts, and :class:`WorkerStartError` when a
    worker's process cannot be started: at the start (those already started get SIGTERM and
    :data:`START_DRAIN_SECONDS` to drain), or restarting one that died when its tries (back-off
    :data:`RESTART_BACKOFF_SECONDS`, doubling) spent the restart budget, raised once the others
    have drained. Until then a failed restart is logged and the other workers keep serving."""

    def __init__(
        self,
        count: int,
        host: str,
        port: int,
        command: Callable[[int, int], list[str]],
        *,
        env: dict[str, str] | None = None,
        reuse_port: bool = False,
    ) -> None:
        if count < 1:
            raise ValueError("count must be at least 1")
        self.count = count
        self.host = host
        self.port = port
        self.command = command
        self.reuse_port = reuse_port and hasattr(socket, "SO_REUSEPORT")
        self.env = dict(os.environ if env is None else env)
        self.workers: list[_Worker] = []
        self.metrics_dir: str | None = None
        self._own_metrics_dir = False
        self._stopping = 0  # signals received
        self._wake = threading.Event()
        self._status = 0
        self._restarts: list[float] = []  # monotonic times
        self._pending: dict[int, _PendingRestart] = {}  # by worker index
        self._gave_up: WorkerStartError | None = None  # a restart that spent the budget
        self._listen: socket.socket | None = None

    # ------------------------------------------------------------------ set-up
    def _prepare_metrics_dir(self) -> str:
        """The metrics folder: the operator's (checked, a previous run's files removed) or a private
        new one (0700). Raises :class:`MetricsDirError`."""
        given = self.env.get(MULTIPROC_ENV)
        if given:
            why = metrics_dir_refusal(given)
            if why:
                raise MetricsDirError(why)
            os.makedirs(given, mode=0o700, exist_ok=True)
            for f in os.listdir(given):  # a previous run's values must not count
                if PROMETHEUS_FILE.fullmatch(f):
                    with contextlib.suppress(OSError):
                        os.remove(os.path.join(given, f))
            return given
        self._own_metrics_dir = True
        return tempfile.mkdtemp(prefix="kvgate-metrics-")

    def _spawn(self, index: int, *, restart: bool = False) -> _Worker:
        """Start worker ``index``'s process. Raises :class:`WorkerStartError` when its fork or exec
        fails (an ``OSError``)."""
        env = {**self.env, MULTIPROC_ENV: self.metrics_dir or "", SUPERVISOR_PID_ENV: str(os.getpid())}
        pass_fds: tuple[int, ...] = ()
        if self._listen is not None:
            env[LISTEN_FD_ENV] = str(self._listen.fileno())
            pass_fds = (self._listen.fileno(),)
        try:
            proc = subprocess.Popen(
                self.command(index, self.port), env=env, stdin=subprocess.DEVNULL, pass_fds=pass_fds, process_group=0
            )
        except OSError as e:
            what = "restart" if restart else "start"
            raise WorkerStartError(f"cannot {what} worker {index}: starting its process (fork/exec) failed: {e}") from e
        w = _Worker(index, proc, time.monotonic())
        log.info("worker %d started (pid %d)", index, proc.pid)
        return w

    def _adopt(self, w: _Worker) -> None:
        """Put a started worker in its place (``self.workers[w.index]``). A stop that came while it
        was being started may have missed it: it gets a SIGTERM (had it got one already, the second
        stops it at once, and it serves nothing yet)."""
        if w.index < len(self.workers):
            self.workers[w.index] = w
        else:
            self.workers.append(w)
        if self._stopping:
            with contextlib.suppress(ProcessLookupError):
                w.proc.send_signal(signal.SIGTERM)

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
        lived = time.monotonic() - w.started
        if rc is not None and rc > 0 and lived < START_GRACE_SECONDS:
            log.error("worker %d exited %s within %.1f s of its start: stopping the gateway", w.index, rc, lived)
            self._status = rc
            return True
        if self._budget_spent():
            log.error(
                "workers restarted %d times in %.0f s: stopping the gateway", MAX_RESTARTS, RESTART_WINDOW_SECONDS
            )
            return True
        log.error("worker %d (pid %d) exited %s after %.0f s: starting it again", w.index, w.proc.pid, rc, lived)
        self._try_restart(w.index, RESTART_BACKOFF_SECONDS)
        return False

    def _budget_spent(self) -> bool:
        """Count a restart (or a try of one) in the restart budget; True (status 1) when that makes
        more than :data:`MAX_RESTARTS` within :data:`RESTART_WINDOW_SECONDS`."""
        now = time.monotonic()
        self._restarts = [t for t in self._restarts if now - t < RESTART_WINDOW_SECONDS] + [now]
        if len(self._restarts) <= MAX_RESTARTS:
            return False
        self._status = 1
        return True

    def _try_restart(self, index: int, delay: float) -> None:
        """Start dead worker ``index`` again. When its fork or exec fails, log it and try again
        after ``delay`` seconds (:meth:`_retry_due`), the back-off doubling up to the cap."""
        try:
            w = self._spawn(index, restart=True)
        except WorkerStartError as e:
            log.error("%s; trying again in %g s", e, delay)
            nxt = min(delay * 2, RESTART_BACKOFF_MAX_SECONDS)
            self._pending[index] = _PendingRestart(time.monotonic() + delay, nxt, e)
            return
        self._pending.pop(index, None)
        self._adopt(w)

    def _retry_due(self) -> bool:
        """Try again each pending restart whose back-off has passed, none after a stop; True when a
        try finds the restart budget spent (the gateway stops; :meth:`run` then raises its error)."""
        now = time.monotonic()
        for index, pending in list(self._pending.items()):
            if self._stopping:
                return False
            if pending.due > now:
                continue
            if self._budget_spent():
                log.error(
                    "worker %d cannot be restarted and more than %d restarts or tries came in %.0f s: "
                    "stopping the gateway",
                    index,
                    MAX_RESTARTS,
                    RESTART_WINDOW_SECONDS,
                )
                self._gave_up = pending.error
                self._pending.clear()
                return True
            self._try_restart(index, pending.delay)
        return False

    def run(self) -> int:
        """Bind, start the workers, supervise them until every one has exited; the exit status.
        Raises what the class docstring names."""
        reserve = self._bind()
        previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
        signal.signal(signal.SIGTERM, self._on_stop)
        signal.signal(signal.SIGINT, self._on_stop)
        signal.signal(signal.SIGHUP, self._on_hup)
        log.info("gateway on %s:%d with %d workers", self.host, self.port, self.count)
        try:
            self._start_all()
            self._supervise()
        finally:
            for s, h in previous.items():
                with contextlib.suppress(ValueError, TypeError):
                    signal.signal(s, h)
            for w in self.workers:  # never leave a worker behind
                if w.proc.poll() is None:
                    w.proc.kill()
                    w.proc.wait(5)
            reserve.close()
            self._remove_own_metrics_dir()
        log.info("all workers exited")
        if self._gave_up is not None:
            raise self._gave_up
        return self._status

    def _start_all(self) -> None:
        """Start the workers (none more after a stop). When one's process cannot be started, those
        already started get SIGTERM and up to :data:`START_DRAIN_SECONDS` to drain, then its
        :class:`WorkerStartError` is raised."""
        for index in range(self.count):
            if self._stopping:
                return
            try:
                self._adopt(self._spawn(index))
            except WorkerStartError as e:
                if self.workers:
                    log.error("%s: stopping the %d worker(s) already started", e, len(self.workers))
                    self._drain_started()
                raise

    def _drain_started(self) -> None:
        """SIGTERM the workers (unless a stop already sent it) and wait up to
        :data:`START_DRAIN_SECONDS` for them; :meth:`run` kills any still running after that."""
        if not self._stopping:
            self._stopping = 1
            self._signal_all(signal.SIGTERM)
        deadline = time.monotonic() + START_DRAIN_SECONDS
        for w in self.workers:
            with contextlib.suppress(subprocess.TimeoutExpired):
                w.proc.wait(max(0.0, deadline - time.monotonic()))

    def _bind(self) -> socket.socket:
        """The metrics folder, then the address: the bound socket (listening and inheritable unless
        ``reuse_port``); ``self.port`` becomes the real port. Raises what the two raise."""
        self.metrics_dir = self._prepare_metrics_dir()
        try:
            reserve = bind_socket(self.host, self.port, reuse_port=self.reuse_port)
        except OSError:
            self._remove_own_metrics_dir()
            raise
        self.port = reserve.getsockname()[1]
        if not self.reuse_port:  # one listening socket, inherited by every worker
            reserve.listen(2048)
            reserve.set_inheritable(True)
            self._listen = reserve
        self.env[MULTIPROC_ENV] = self.metrics_dir
        return reserve

    def _supervise(self) -> None:
        """Poll the workers (woken early by a signal) until every one has exited after a stop; a
        worker whose exit must stop the gateway starts the drain of the others."""
        failed = False
        while True:
            failed = self._reap_exited() or failed
            if not self._stopping:
                failed = self._retry_due() or failed
            if failed and not self._stopping:
                self._stopping = 1
                self._signal_all(signal.SIGTERM)
            if self._stopping and all(w.proc.poll() is not None for w in self.workers):
                for w in self.workers:
                    if not w.reaped:
                        self._reap(w)
                return
            self._wake.wait(POLL_SECONDS)
            self._wake.clear()

    def _reap_exited(self) -> bool:
        """Reap every worker that has exited since the last poll; True when one must stop the gateway."""
        failed = False
        for w in list(self.workers):
            if not w.reaped and w.proc.poll() is not None and self._reap(w):
                failed = True
        return failed

    def _remove_own_metrics_dir(self) -> None:
        if self._own_metrics_dir and self.metrics_dir:
            shutil.rmtree(self.metrics_dir, ignore_errors=True)
