"""The bounded executor that runs the gateway's offloaded work (large-body parsing, counting,
tokenizing, decoding), with a per-tenant share: one tenant's heavy requests wait for its own
threads, never for everyone's (docs/gateway.md, "Refuse before working").

:class:`TenantExecutor` is installed as the event loop's default executor (:func:`install`),
so every ``asyncio.to_thread`` on the request path takes it, the tokenizers' own included. The
tenant is a context variable the request's task sets after authentication (:func:`set_tenant`);
work submitted without one (the loop's own, e.g. name resolution) is not limited per tenant.

Short counts run on the event loop, which every tenant shares, so each tenant also has a share
of the loop's time for them: :func:`set_tenant` makes the tenant's :class:`~tokenizer.base.LoopAccount`
(:func:`loop_account`) the task's ``tokenizer.base.LOOP_ACCOUNT``, and once a tenant has counted
for more than :data:`LOOP_SHARE` of the loop's time (beyond a burst of :data:`LOOP_BURST_SECONDS`)
its counts of any size go to its threads here (:func:`tokenizer.base.on_loop`).
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from tokenizer.base import LOOP_ACCOUNT, LoopAccount

#: the tenant on whose behalf the current task offloads work (``None``: none yet)
_TENANT: contextvars.ContextVar[str | None] = contextvars.ContextVar("kvgate_offload_tenant", default=None)


#: the share the gateway's own endpoints offload on (``/metrics``' multiprocess render): not a
#: tenant id (those start with a letter or digit), so anyone who can reach them holds at most one
#: tenant's share of the threads, never the threads the tenants' counting needs
OPS_SHARE = "-ops"


#: the fraction of the event loop's time one tenant's counts may take on it, on average
LOOP_SHARE = 0.1
#: the loop time (seconds) one tenant may count for beyond :data:`LOOP_SHARE` at once, after idling
LOOP_BURST_SECONDS = 0.05

#: each tenant's account of counting on the event loop, for this process (whose loop it is)
_LOOP_ACCOUNTS: dict[str, LoopAccount] = {}


def loop_account(tenant_id: str) -> LoopAccount:
    """``tenant_id``'s share of this process's event loop for counting (made on first use, with
    :data:`LOOP_SHARE` and :data:`LOOP_BURST_SECONDS`)."""
    account = _LOOP_ACCOUNTS.get(tenant_id)
    if account is None:
        account = _LOOP_ACCOUNTS[tenant_id] = LoopAccount(LOOP_SHARE, LOOP_BURST_SECONDS)
    return account


def set_tenant(tenant_id: str) -> None:
    """Offload the current task's work (and its children's) on ``tenant_id``'s share, and charge
    its counting on the event loop to ``tenant_id``'s :func:`loop_account`."""
    _TENANT.set(tenant_id)
    LOOP_ACCOUNT.set(loop_account(tenant_id))


def default_threads(cores: int) -> int:
    """Threads of the shared pool for ``cores`` usable cores: ``min(32, cores + 4)``, asyncio's
    own default."""
    return min(32, max(1, cores) + 4)


def default_share(threads: int) -> int:
    """The most threads one tenant may hold at once: a quarter of the pool, at least one."""
    return max(1, threads // 4)


_Job = tuple[Future, Callable[..., Any], tuple[Any, ...], dict[str, Any]]


class TenantExecutor(ThreadPoolExecutor):
    """A thread pool of ``max_workers`` where one tenant runs at most ``share`` jobs at once; its
    other jobs wait in its own queue (first in, first out) and start as its running ones end, so
    a tenant's flood delays only that tenant. ``submit`` never blocks."""

    def __init__(self, max_workers: int, share: int) -> None:
        super().__init__(max_workers=max_workers, thread_name_prefix="kvgate-offload")
        self.share = max(1, share)
        self._lock = threading.Lock()
        self._running: dict[str, int] = {}
        self._waiting: dict[str, deque[_Job]] = {}

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        tenant = _TENANT.get()
        if tenant is None:
            return super().submit(fn, *args, **kwargs)
        outer: Future = Future()
        job: _Job = (outer, fn, args, kwargs)
        with self._lock:
            running = self._running.get(tenant, 0)
            if running >= self.share:
                self._waiting.setdefault(tenant, deque()).append(job)
                return outer
            self._running[tenant] = running + 1
        self._start(tenant, job)
        return outer

    def running(self, tenant: str) -> int:
        """Jobs of ``tenant`` running now."""
        with self._lock:
            return self._running.get(tenant, 0)

    def waiting(self, tenant: str) -> int:
        """Jobs of ``tenant`` waiting for its share."""
        with self._lock:
            return len(self._waiting.get(tenant, ()))

    def _start(self, tenant: str, job: _Job) -> None:
        try:
            super().submit(self._run, tenant, job)
        except RuntimeError as e:  # shut down: the job fails, its slot is handed on
            job[0].set_exception(e)
            self._next(tenant)

    def _run(self, tenant: str, job: _Job) -> None:
        """Run ``job`` in this worker thread; its slot is handed on before its awaiter wakes."""
        outer, fn, args, kwargs = job
        if not outer.set_running_or_notify_cancel():  # cancelled while it waited
            self._next(tenant)
            return
        try:
            result = fn(*args, **kwargs)
        except BaseException as e:  # handed to the awaiting task, as ThreadPoolExecutor does
            self._next(tenant)
            outer.set_exception(e)
            return
        self._next(tenant)
        outer.set_result(result)

    def _next(self, tenant: str) -> None:
        """One of ``tenant``'s jobs ended: start its next waiting one, or free the slot."""
        with self._lock:
            queue = self._waiting.get(tenant)
            if queue:
                job = queue.popleft()
                if not queue:
                    del self._waiting[tenant]
            else:
                job = None
                left = self._running.get(tenant, 1) - 1
                if left > 0:
                    self._running[tenant] = left
                else:
                    self._running.pop(tenant, None)
        if job is not None:
            self._start(tenant, job)


_INSTALLED: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, TenantExecutor] = weakref.WeakKeyDictionary()


def install(loop: asyncio.AbstractEventLoop, threads: int | None, share: int | None, cores: int) -> TenantExecutor:
    """Make a :class:`TenantExecutor` the default executor of ``loop``: ``threads`` threads
    (``None``: :func:`default_threads` of ``cores``), ``share`` per tenant (``None``:
    :func:`default_share`). A loop that has one keeps it. Returns the loop's executor."""
    current = _INSTALLED.get(loop)
    if current is not None:
        return current
    n = threads or default_threads(cores)
    executor = TenantExecutor(n, share or default_share(n))
    loop.set_default_executor(executor)
    _INSTALLED[loop] = executor
    return executor
