"""Where quota state lives: Redis (shared by every gateway replica) or this process's memory.

Both stores implement the same sliding-window log (see ``docs/quotas.md``): an admission is
logged with its time and counts against RPM / TPM while ``now - admitted_at < window``; a
concurrency lease counts until it is settled or its TTL runs out. ``reserve`` admits the
request, its tokens and a lease together or changes nothing (a TPM refusal spends no RPM slot).

Times are milliseconds: Redis's own clock (``TIME``) in the Lua scripts, so replicas' clocks do
not matter; ``time.monotonic()`` in :class:`LocalQuotaStore`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import time
from collections import deque
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, Protocol

from config.models import TenantConfig
from config.redis_client import is_cluster, key_slot, store_errors
from verifier.stage import PendingWrite

log = logging.getLogger("kvgate.quotas")

UNLIMITED = -1
#: while requests arrive back to back (a request's call within :data:`BUSY_SECONDS`), a round
#: trip of settles alone waits up to this long (seconds) for the next request's call to share it
SETTLE_WAIT_SECONDS = 0.001
BUSY_SECONDS = 0.002
#: lease ids per ``cancel.lua`` call (:meth:`RedisQuotaStore.cancel`)
CANCEL_CHUNK = 500
#: how long (ms) ``cancel.lua``'s tombstones and ``settle.lua``'s marks of a charged overage live
#: unless the stage says (:meth:`RedisQuotaStore.remember_ended_for`): twice the default lease TTL
DEFAULT_ENDED_MS = 240_000
#: a refused TPM call walks at most this many of the tenant's oldest debits for its Retry-After,
#: past them answering the last one's expiry (a lower bound): ``tokens.lua``'s ``WALK_MAX``, so
#: that the in-process store, which decides on the event loop every tenant shares, answers as
#: Redis does at a bounded cost
TPM_WALK_MAX = 1024
#: the largest token count a settle charges: 2^53 - 1, what the scripts count exactly (Lua numbers
#: are doubles: a larger one was written back as text such as ``1e+17`` and added rounded)
MAX_COUNT = 2**53 - 1


@dataclass(frozen=True)
class QuotaLimits:
    """A tenant's limits per window; ``None`` = unlimited. ``rpm``: requests, ``tpm``: prompt +
    completion tokens, ``max_concurrent``: requests in flight."""

    rpm: int | None
    tpm: int | None
    max_concurrent: int | None

    @classmethod
    def of(cls, tenant: TenantConfig) -> QuotaLimits:
        """The limits of a tenant entry (``rpm``, ``tpm``, ``max_concurrent``)."""
        return cls(tenant.rpm, tenant.tpm, tenant.max_concurrent)

    @property
    def unlimited(self) -> bool:
        """True when no dimension is limited (the stage then skips the store)."""
        return self.rpm is None and self.tpm is None and self.max_concurrent is None

    def divided(self, divisor: int) -> QuotaLimits:
        """Each limit floor-divided by ``divisor`` (per-replica share while Redis is down;
        floor, so that ``replicas`` replicas together never exceed the configured limit)."""
        d = max(1, divisor)

        def f(v: int | None) -> int | None:
            return None if v is None else v // d

        return QuotaLimits(f(self.rpm), f(self.tpm), f(self.max_concurrent))


@dataclass(frozen=True)
class QuotaDecision:
    """A store's answer to ``reserve``.

    ``refused``: the refused dimensions, a subset of ``("rpm", "tpm", "concurrency")`` (empty
    when admitted). ``retry_after_ms``: when every refused dimension admits the request again
    (RPM/TPM: exact, from the log; concurrency: 1000, as a lease ends with its request).
    ``remaining_*``: what is left in the window after this decision (``-1`` = unlimited; never
    negative). ``too_large``: the request alone reserves more tokens than the whole TPM.
    ``used_*`` (a refusal's; ``-1`` = not told): the requests / tokens the window holds, which
    is more than the limit where a reload lowered it (the 429 says so; ``remaining_*`` is 0).
    """

    admitted: bool
    refused: tuple[str, ...]
    retry_after_ms: int
    remaining_requests: int
    remaining_tokens: int
    too_large: bool = False
    used_requests: int = -1
    used_tokens: int = -1


class QuotaStoreUnavailable(Exception):
    """The store did not answer (refused, reset, timed out). The stage applies the configured
    ``redis_failure_policy``."""


class QuotaStore(Protocol):
    """Quota state for every tenant. ``lease_id`` is unique per request (the stage makes it)."""

    name: str

    async def reserve(
        self,
        tenant_id: str,
        limits: QuotaLimits,
        lease_id: str,
        tokens: int,
        window_ms: int,
        lease_ttl_ms: int,
        *,
        also: PendingWrite | None = None,
    ) -> QuotaDecision:
        """Admit one request + ``tokens`` + a lease of ``lease_ttl_ms``, or nothing. ``also``:
        calls to send in the same round trip, if the store makes one (their outcome to
        ``also.sent``). Raises :class:`QuotaStoreUnavailable`."""
        ...

    async def begin(
        self, tenant_id: str, limits: QuotaLimits, lease_id: str, window_ms: int, lease_ttl_ms: int
    ) -> QuotaDecision:
        """Admit one request (RPM) and a lease of ``lease_ttl_ms``, or nothing; its tokens follow
        with :meth:`take_tokens`. Raises :class:`QuotaStoreUnavailable`."""
        ...

    async def take_tokens(
        self,
        tenant_id: str,
        limits: QuotaLimits,
        lease_id: str,
        tokens: int,
        window_ms: int,
        *,
        also: PendingWrite | None = None,
    ) -> QuotaDecision:
        """Debit ``tokens`` against TPM for the request ``lease_id`` (begun), or nothing.
        ``also``: calls to send in the same round trip, if the store makes one, each made only
        if the debit was (``also.guarded``; their outcome to ``also.sent``). Raises
        :class:`QuotaStoreUnavailable`."""
        ...

    async def begin_tokens(
        self,
        tenant_id: str,
        limits: QuotaLimits,
        lease_id: str,
        tokens: int,
        window_ms: int,
        lease_ttl_ms: int,
        *,
        also: PendingWrite | None = None,
    ) -> tuple[QuotaDecision, QuotaDecision | None]:
        """:meth:`begin`, then :meth:`take_tokens` (when ``limits.tpm`` is set) if it admitted, in
        one round trip when the store makes one: ``(begin's decision, the tokens' decision, or
        None without TPM or after a refused begin)``; ``also`` as in :meth:`take_tokens`. Raises
        :class:`QuotaStoreUnavailable`."""
        ...

    async def settle(
        self, tenant_id: str, limits: QuotaLimits, lease_id: str, used_tokens: int, reserved_tokens: int, window_ms: int
    ) -> None:
        """Release the lease; correct the TPM debit to ``used_tokens``.
        Raises :class:`QuotaStoreUnavailable`."""
        ...

    async def renew(self, tenant_id: str, lease_ids: list[str], lease_ttl_ms: int) -> int:
        """Extend live leases to now + ``lease_ttl_ms``; returns how many were still live.
        Raises :class:`QuotaStoreUnavailable`."""
        ...

    async def cancel(self, tenant_id: str, lease_ids: list[str], *, keep_rpm: bool = False) -> int:
        """Undo these reservations if they were made (a reserve that timed out may have run), and
        make them no-ops if they run later; ``keep_rpm``: undo only what a begun request's token
        step took and its lease, keeping its RPM entry (the fallback went on with the request).
        Returns how many were undone. Raises :class:`QuotaStoreUnavailable`."""
        ...

    def scope(self, tenant_id: str) -> int | None:
        """The part of the store that holds ``tenant_id``'s state and fails with it: its hash
        slot on a Redis Cluster, else ``None`` (the whole store). The stage backs off per scope."""
        ...

    async def aclose(self) -> None:
        """Release connections."""
        ...


def _arg(v: int | None) -> int:
    return UNLIMITED if v is None else int(v)


def _begin_args(limits: QuotaLimits, lease_id: str, window_ms: int, lease_ttl_ms: int) -> list[Any]:
    """``begin.lua``'s ARGV."""
    return [lease_id, _arg(limits.rpm), _arg(limits.max_concurrent), int(window_ms), int(lease_ttl_ms)]


def _tokens_args(limits: QuotaLimits, lease_id: str, tokens: int, window_ms: int) -> list[Any]:
    """``tokens.lua``'s ARGV (without the optional begun key)."""
    return [lease_id, _arg(limits.tpm), int(tokens), int(window_ms)]


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, (bytes, bytearray)) else str(v)


def _decision(r: Any) -> QuotaDecision:
    """A script's reply ``{admitted, refused, retry_ms, remaining_requests, remaining_tokens,
    too_large[, used_requests, used_tokens]}`` (a refusal's has the last two)."""
    refused = tuple(x for x in _text(r[1]).split(",") if x)
    used = (int(r[6]), int(r[7])) if len(r) >= 8 else (-1, -1)
    return QuotaDecision(bool(int(r[0])), refused, int(r[2]), int(r[3]), int(r[4]), bool(int(r[5])), *used)


#: scripts that start with a shared part (a script runs alone in Redis, without imports)
_PRELUDES = {"reserve": "tpm_window", "tokens": "tpm_window", "cancel": "ended", "settle": "ended"}


def load_script(name: str) -> str:
    """The text of ``gateway/quotas/lua/<name>.lua`` (package data), after its shared part."""
    lua = resources.files("gateway.quotas").joinpath("lua")
    text = lua.joinpath(f"{name}.lua").read_text(encoding="utf-8")
    prelude = _PRELUDES.get(name)
    return text if prelude is None else lua.joinpath(f"{prelude}.lua").read_text(encoding="utf-8") + text


def _unavailable(e: BaseException) -> QuotaStoreUnavailable:
    return e if isinstance(e, QuotaStoreUnavailable) else QuotaStoreUnavailable(f"redis: {type(e).__name__}: {e}")


def _retrieve_all(queued: list[_Queued]) -> None:
    """Mark the replies of ``queued`` retrieved (now, or when they are answered): a caller that
    stopped at its first failed reply of a round trip leaves the others unread, and asyncio logs
    each such exception ("Future exception was never retrieved") when the reply is collected."""
    for q in queued:
        q.reply.add_done_callback(lambda f: f.cancelled() or f.exception())


def _answer(q: _Queued, result: Any) -> None:
    """Hand a coalesced call's ``result`` to its caller (unless it gave up): a value, or an
    exception, which becomes a :class:`QuotaStoreUnavailable` of its own (a ``raw`` call's
    caller gets the exception itself as its result: :meth:`RedisQuotaStore.send_calls`)."""
    if q.reply.done():
        return
    if isinstance(result, BaseException) and not q.raw:
        err = QuotaStoreUnavailable(
            str(result) if isinstance(result, QuotaStoreUnavailable) else f"redis: {type(result).__name__}: {result}"
        )
        err.__cause__ = result
        q.reply.set_exception(err)
    else:
        q.reply.set_result(result)


@dataclass
class _Queued:
    """A Lua call waiting for this turn's round trip (:meth:`RedisQuotaStore._call`): one of this
    store's scripts, or (``raw``, ``script`` ``None``) another part's call by its SHA-1 alone."""

    sha: str
    keys: list[str]
    args: list[Any]
    reply: asyncio.Future[Any]
    script: Any = None
    raw: bool = False
    lazy: bool = False  # a settle (its response has gone): sent in its turn's round trip, answered last


#: the connection options a start-up warm-up lengthens (redis-py's names)
_TIMEOUTS = ("socket_timeout", "socket_connect_timeout")


def _client_settings(client: Any) -> list[dict[str, Any]]:
    """The option dicts ``client`` (a ``redis.asyncio`` ``Redis`` or ``RedisCluster``) makes new
    connections from: its pool's, or the cluster's and each known node's."""
    pool = getattr(client, "connection_pool", None)
    if pool is not None:
        return [pool.connection_kwargs]
    manager = getattr(client, "nodes_manager", None)
    if manager is None:
        return []
    nodes = {**manager.startup_nodes, **manager.nodes_cache}.values()
    return [manager.connection_kwargs, *(n.connection_kwargs for n in nodes)]


def _client_connections(client: Any) -> list[Any]:
    """The connections ``client`` holds now (idle or in use)."""
    pool = getattr(client, "connection_pool", None)
    if pool is not None:
        return [*getattr(pool, "_available_connections", ()), *getattr(pool, "_in_use_connections", ())]
    manager = getattr(client, "nodes_manager", None)
    if manager is None:
        return []
    nodes = {**manager.startup_nodes, **manager.nodes_cache}.values()
    return [c for n in nodes for c in getattr(n, "_connections", ())]


@contextlib.contextmanager
def _longer_timeouts(client: Any, seconds: float) -> Any:
    """Within the block, connections ``client`` makes have every connect and read bounded by
    ``seconds``; after it, they (and later ones) have the client's own bounds again."""
    settings = _client_settings(client)
    own = {k: settings[0].get(k) for k in _TIMEOUTS} if settings else {}
    for d in settings:
        d.update(dict.fromkeys(own, seconds))
    try:
        yield
    finally:
        for d in _client_settings(client):  # nodes found inside the block copied the long bounds
            d.update(own)
        for conn in _client_connections(client):
            for k, v in own.items():
                setattr(conn, k, v)
                if hasattr(conn, f"orig_{k}"):  # redis-py restores these after a maintenance event
                    setattr(conn, f"orig_{k}", v)


class RedisQuotaStore:
    """Quota state in Redis, shared by all replicas; Lua scripts: ``begin.lua`` (RPM and lease,
    at arrival) then ``tokens.lua`` (TPM, once counted), or ``reserve.lua`` (all three at once);
    ``settle.lua``, ``renew.lua`` for lease heartbeats and ``cancel.lua`` to undo reservations
    whose call timed out.

    Keys (``prefix`` default ``kvgate:q``), all with the ``{tenant}`` hash tag (Redis Cluster
    safe): ``kvgate:q:{t}:rpm``, ``:tpm``, ``:tpm:debits``, ``:tpm:sum``, ``:leases``, and
    ``:ended`` (:meth:`ended_key`: lease ids cancelled, or settled above their reservation, which
    the scripts must not count again; written only then). Every key expires one window (leases:
    one TTL; ``:ended``: :attr:`ended_ms`) after its last write, so idle tenants cost nothing.

    ``client``: a ``redis.asyncio`` client whose socket timeouts bound each call (the stage
    adds an overall deadline): ``Redis`` (standalone or a Sentinel's master) or ``RedisCluster``
    (each script runs on the tenant's slot). Every Redis or socket error becomes
    :class:`QuotaStoreUnavailable`. On a cluster a reservation carries no ``also`` writes (their
    keys live on other slots, mostly other nodes): those are left to ``also.finish``.

    ``coalesce`` (default on, never on a cluster): while a round trip is under way, the script
    calls that requests make in one turn of the event loop go to Redis as one pipeline, one
    round trip and one connection for all of them (each call stands alone, as it would on its
    own: no transaction); under load that is most calls, and a call with nothing to share a
    round trip with goes at once, except a settle, which goes in its turn's round trip or, while
    requests arrive back to back, rides the next request's (:meth:`_submit`). Each caller still
    gets its own reply or error. :attr:`round_trips` and :attr:`calls` count what was sent.
    """

    name = "redis"

    def __init__(self, client: Any, *, prefix: str = "kvgate:q", coalesce: bool = True) -> None:
        self.client = client
        self.prefix = prefix
        self.cluster = is_cluster(client)
        self.coalesce = coalesce and not self.cluster
        self._queued: list[_Queued] = []
        self._soon = False  # a flush of the queue is scheduled (for this turn, or after a settle's wait)
        self._settle_wait: asyncio.TimerHandle | None = None  # the flush of settles waiting for a request
        self._request_call_at = -math.inf  # loop time of the last request's (not a settle's) call
        self._sending: set[asyncio.Task[None]] = set()
        self._inflight = 0  # round trips under way
        #: connections taken from the client's pool and kept between round trips (standalone and
        #: Sentinel): a round trip takes one without the pool's lock and bookkeeping
        self._held: list[Any] = []
        #: each round trip's bound, seconds (:meth:`bound_round_trips`); ``None``: the caller bounds its calls
        self.round_trip_seconds: float | None = None
        #: how long (ms) a cancelled or overage-settled lease id is remembered (:meth:`remember_ended_for`)
        self.ended_ms = DEFAULT_ENDED_MS
        #: script calls made, and the round trips that carried them (coalesced: fewer)
        self.calls = 0
        self.round_trips = 0
        self._reserve = client.register_script(load_script("reserve"))
        self._settle = client.register_script(load_script("settle"))
        self._renew = client.register_script(load_script("renew"))
        self._cancel = client.register_script(load_script("cancel"))
        self._begin = client.register_script(load_script("begin"))
        self._tokens = client.register_script(load_script("tokens"))

    def bound_round_trips(self, seconds: float) -> None:
        """From now on, bound every round trip (both tries of :meth:`_retrying`, a ``NOSCRIPT``
        reload included) by ``seconds``: each call it carried then fails with a
        :class:`QuotaStoreUnavailable`, so a caller needs no deadline of its own (one timer a
        round trip, not one a call: under load a round trip carries several calls)."""
        self.round_trip_seconds = seconds

    def remember_ended_for(self, ms: int) -> None:
        """From now on, a lease id ``cancel.lua`` undid (a reservation of it that reaches Redis
        later is a no-op) or ``settle.lua`` charged above its reservation (a settle of it sent
        again charges nothing more) is remembered ``ms`` milliseconds (at least 1)."""
        self.ended_ms = max(1, int(ms))

    def keys(self, tenant_id: str) -> list[str]:
        """The five keys of a tenant: rpm log, tpm log, tpm debits, tpm sum, leases."""
        base = f"{self.prefix}:{{{tenant_id}}}"
        return [f"{base}:rpm", f"{base}:tpm", f"{base}:tpm:debits", f"{base}:tpm:sum", f"{base}:leases"]

    def ended_key(self, tenant_id: str) -> str:
        """The tenant's ended set (``ended.lua``): a sorted set, lease id -> when it is forgotten
        (ms, Redis's clock), on the same hash slot as :meth:`keys`."""
        return f"{self.prefix}:{{{tenant_id}}}:ended"

    def _script_keys(self, tenant_id: str) -> list[str]:
        """The KEYS of the tenant's scripts but ``renew.lua``: :meth:`keys`, then :meth:`ended_key`."""
        return [*self.keys(tenant_id), self.ended_key(tenant_id)]

    def scope(self, tenant_id: str) -> int | None:
        return key_slot(self.keys(tenant_id)[0]) if self.cluster else None

    async def _call(self, script: Any, keys: list[str], args: list[Any], *, lazy: bool = False) -> Any:
        """Run ``script`` (:meth:`_retrying`), with the other calls of this turn of the event loop
        when coalescing (``lazy``: see :meth:`_submit`). Raises :class:`QuotaStoreUnavailable`."""
        self.calls += 1
        queued = _Queued(script.sha, keys, args, asyncio.get_running_loop().create_future(), script, lazy=lazy)
        try:
            await self._submit([queued])
            return await queued.reply  # a caller that gives up (its deadline) cancels only its own reply
        except asyncio.CancelledError:
            if lazy:  # a settle must reach Redis though its caller is gone
                self._detach(queued)
            raise

    def _detach(self, q: _Queued) -> None:
        """``q`` (a settle) lost its caller: it still goes to Redis. Queued or in a round trip under
        way (its reply cancelled), it is sent as it is (:meth:`_flush` keeps a settle whose caller
        left); cut short in its caller's own round trip, it is sent again in a round trip of its own
        (``settle.lua`` run twice for one lease changes nothing the first run did not)."""
        if q.reply.cancelled():
            return
        if q.reply.done():
            q.reply.exception()  # its round trip's end (the cancellation), retrieved
        again = _Queued(q.sha, q.keys, q.args, asyncio.get_running_loop().create_future(), q.script, lazy=True)
        again.reply.add_done_callback(lambda f: f.cancelled() or f.exception())  # nobody awaits it
        self._start([again])

    def _calls_of(self, scripts: list[tuple[Any, list[str], list[Any]]]) -> list[_Queued]:
        """``scripts`` (``(script, keys, args)``) as calls waiting for a round trip, counted."""
        loop = asyncio.get_running_loop()
        self.calls += len(scripts)
        return [_Queued(script.sha, keys, args, loop.create_future(), script) for script, keys, args in scripts]

    def _raw_calls_of(self, calls: list[tuple[str, list[str], list[Any]]]) -> list[_Queued]:
        """Other parts' ``calls`` (``(sha1, keys, args)``: no script to reload) as calls waiting
        for a round trip, counted."""
        loop = asyncio.get_running_loop()
        self.calls += len(calls)
        return [_Queued(sha, keys, args, loop.create_future(), raw=True) for sha, keys, args in calls]

    async def _call_all(self, scripts: list[tuple[Any, list[str], list[Any]]]) -> list[Any]:
        """:meth:`_call` for each of ``scripts`` (``(script, keys, args)``), all in one round trip,
        in order. Returns their replies. Raises the first failed one's
        :class:`QuotaStoreUnavailable`."""
        queued = self._calls_of(scripts)
        await self._submit(queued)
        try:
            return [await q.reply for q in queued]
        except BaseException:
            _retrieve_all(queued)
            raise

    async def send_calls(self, calls: list[tuple[str, list[str], list[Any]]]) -> list[Any]:
        """Other parts' Lua calls (``(sha1, keys, args)``, e.g. the leak index's write,
        :class:`verifier.stage.PendingWrite`) in this turn's round trip, coalescing or not. Returns
        their replies in order, a failed call's exception in its place (``NOSCRIPT`` included:
        the caller loads its own script); a round trip that failed: a :class:`QuotaStoreUnavailable`
        in every place. Raises only ``asyncio.CancelledError``."""
        queued = self._raw_calls_of(calls)
        await self._submit(queued)
        return list(await asyncio.gather(*(q.reply for q in queued)))

    async def _submit(self, queued: list[_Queued]) -> None:
        """Send ``queued`` now, from the caller, when no round trip is under way and nothing
        waits (no loop turn and no task in between: one request alone costs what it did
        uncoalesced), or only settles that wait for a request (they go first, in the round trip
        of this request's calls, from its task); else queue them for this turn's round trip
        (:meth:`_flush`). A ``lazy`` call (a settle, whose response has gone) always waits for a
        round trip of its turn: the finished request's reply and the rest of its ending then run
        after the requests still being admitted (:meth:`_send` answers those first). While requests arrive back to back
        (a request's call within :data:`BUSY_SECONDS`), settles with no request's call in their
        turn wait up to :data:`SETTLE_WAIT_SECONDS` for the next one, whose round trip carries
        them before it: a single client's next request arrives after its answer has gone, later
        than the settle's turn, and two round trips per request became one (docs/performance.md,
        "fourteenth pass"). The next request then sees the slot its predecessor held free, in
        the same pipeline; elsewhere the slot stays held up to that much longer, never shorter."""
        lazy = queued[0].lazy
        loop = asyncio.get_running_loop()
        if not lazy:
            self._request_call_at = loop.time()
        if not self.coalesce or (self._inflight == 0 and not self._queued and not lazy):
            self.round_trips += 1
            self._inflight += 1
            await self._send(queued)
            return
        if not lazy and self._inflight == 0 and self._settle_wait is not None:
            # the settles queued (only they) waited for this request: they go first in its round
            # trip, sent now from its own task, with no loop turn or task in between
            self._settle_wait.cancel()
            self._settle_wait = None
            self._soon = False
            batch, self._queued = [*self._queued, *queued], []
            self.round_trips += 1
            self._inflight += 1
            await self._send(batch, carried=True)
            return
        if not self._soon:
            self._soon = True
            if lazy and loop.time() - self._request_call_at < BUSY_SECONDS:
                self._settle_wait = loop.call_later(SETTLE_WAIT_SECONDS, self._flush)
            else:
                loop.call_soon(self._flush)
        elif not lazy and self._settle_wait is not None:  # the request the settles waited for: go this turn
            self._settle_wait.cancel()
            self._settle_wait = None
            loop.call_soon(self._flush)
        self._queued.extend(queued)

    def _flush(self) -> None:
        """Send what this turn queued, as one round trip, in a task of its own (callers wait on
        their replies only)."""
        self._soon = False
        if self._settle_wait is not None:
            self._settle_wait.cancel()
            self._settle_wait = None
        batch = [q for q in self._queued if q.lazy or not q.reply.done()]  # a settle goes though its caller left
        self._queued = []
        if batch:
            self._start(batch)

    def _start(self, batch: list[_Queued]) -> None:
        """``batch``'s round trip in a task of its own, under way from now: a call made before
        the task's first step queues behind it, so it reaches Redis after ``batch``."""
        self.round_trips += 1
        self._inflight += 1
        task = asyncio.ensure_future(self._send(batch))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _send(self, batch: list[_Queued], *, carried: bool = False) -> None:
        """One round trip for ``batch`` (a lone call as it is, more as a pipeline); each reply
        gets its result or a :class:`QuotaStoreUnavailable` of its own. The caller counted it in
        :attr:`_inflight`; it is uncounted when done. ``carried``: sent from a request's task,
        whose cancellation (the client gone) sends the settles in ``batch`` again in a round trip
        of their own instead of failing them (``settle.lua`` run twice changes nothing more)."""
        results: list[Any]
        cancelled = False
        try:
            async with asyncio.timeout(self.round_trip_seconds):
                if len(batch) == 1 and batch[0].script is not None and self.cluster:
                    one = batch[0]
                    results = [await self._retrying(lambda: one.script(keys=one.keys, args=one.args))]
                else:
                    results = await self._retrying(lambda: self._pipeline(batch))
        except TimeoutError:  # the round trip's bound (the client's own timeouts raise redis' TimeoutError)
            results = [QuotaStoreUnavailable(f"no answer within {self.round_trip_seconds:g}s")] * len(batch)
        except Exception as e:  # QuotaStoreUnavailable: the round trip failed, for every call in it
            results = [_unavailable(e)] * len(batch)
        except BaseException as e:  # cancelled (shutdown, the client gone): all but carried settles learn it
            results = [_unavailable(e)] * len(batch)
            cancelled = True
            raise
        finally:
            self._inflight -= 1
            # requests still waiting resume first; settles (their responses gone) after
            for q, r in sorted(zip(batch, results, strict=True), key=lambda qr: qr[0].lazy):
                if cancelled and carried and q.lazy and not q.reply.done():
                    self._start([q])
                else:
                    _answer(q, r)
            if cancelled:  # a cancelled request's own calls: nobody awaits their replies now
                _retrieve_all([q for q in batch if not q.lazy])

    async def _pipeline(self, batch: list[_Queued]) -> list[Any]:
        """``batch`` as one pipeline of ``EVALSHA`` calls; the replies in order (a failed call's
        error in its place). Calls answered ``NOSCRIPT`` (Redis restarted and lost its scripts)
        have their scripts loaded and are sent once more, with every call of this store's after the
        first of them: a later call may depend on an earlier one (``tokens.lua`` on the entry
        ``begin.lua`` leaves), and a script another replica had loaded again ran without it.
        Each of these scripts run twice answers as it did once."""
        from redis.exceptions import NoScriptError

        async def once(calls: list[_Queued]) -> list[Any]:
            return await self._execute([("EVALSHA", q.sha, len(q.keys), *q.keys, *q.args) for q in calls])

        results = await once(batch)
        own = [i for i, q in enumerate(batch) if q.script is not None]
        first = next((i for i in own if isinstance(results[i], NoScriptError)), None)
        if first is not None:
            again = [i for i in own if i >= first]
            missing = [batch[i].script for i in again if isinstance(results[i], NoScriptError)]
            for script in {s.sha: s for s in missing}.values():
                await self.client.script_load(script.script)
            for i, r in zip(again, await once([batch[i] for i in again]), strict=True):
                results[i] = r
        return results

    async def _execute(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        """``commands`` in one round trip, unless a transaction (a pipeline without ``MULTI``);
        the replies in order, an error reply's ``ResponseError`` in its place (``NOSCRIPT``:
        ``NoScriptError``). Standalone and Sentinel clients: written on one connection and read
        back by this store itself, without redis-py's ``Pipeline`` (whose layers were most of a
        coalesced round trip's CPU; the client retries nothing either way, see
        ``config.redis_client``); the connection is one the store took from the client's pool
        and keeps between round trips (a pool checkout, its lock and its observability records,
        cost a round trip about 13 us of CPU); with the store's own bound, reads take no timer of
        their own and the write no ``wait_for`` task; a connection that fails or is cancelled
        mid-way is disconnected and given back, never kept with replies pending. A cluster:
        redis-py's pipeline. Raises what the client raises for a failed connection or a
        timeout, and a connection error when a reply is ``READONLY``."""
        from redis.exceptions import ConnectionError as RedisConnectionError
        from redis.exceptions import ReadOnlyError, ResponseError

        pool = None if self.cluster else getattr(self.client, "connection_pool", None)
        if pool is None:
            pipe = self.client.pipeline(transaction=False)
            for c in commands:
                pipe.execute_command(*c)
            return list(await pipe.execute(raise_on_error=False))
        conn = self._held.pop() if self._held else await pool.get_connection()
        read_timeout = math.inf if self.round_trip_seconds is not None else None
        try:
            if not conn.is_connected:
                await conn.connect()
            packed = conn.pack_commands(commands)
            if read_timeout is None:  # no bound of the store's own: the client's socket timeout bounds the write
                await conn.send_packed_command(packed, check_health=False)
            else:  # the same write without redis-py's wait_for, which on Python 3.11 runs it in a task of its own
                await conn._send_packed_command(packed)
            replies: list[Any] = []
            for _ in commands:
                try:
                    replies.append(await conn.read_response(timeout=read_timeout))
                except ResponseError as e:
                    replies.append(e)
        except BaseException:
            await conn.disconnect(nowait=True)
            await pool.release(conn)
            raise
        if any(
            isinstance(r, ReadOnlyError) or (isinstance(r, ResponseError) and "-READONLY" in str(r)) for r in replies
        ):
            # the address leads to a replica now (a failover behind one DNS name or proxy): this
            # connection is the old primary's, and a fresh one may reach the new (Sentinel's
            # client does the same; a cluster's follows MOVED itself). Redis 7 answers a script's
            # refused write READONLY; Redis 6 wraps it: "ERR Error running script ... -READONLY ..."
            await conn.disconnect(nowait=True)
            await pool.release(conn)
            raise RedisConnectionError("READONLY: the server is a replica now")
        self._held.append(conn)
        return replies

    async def _release_held(self) -> None:
        """Hand the connections this store keeps between round trips back to the client's pool,
        disconnected (a connection error: they may all be stale)."""
        pool = self.client.connection_pool
        held, self._held = self._held, []
        for conn in held:
            with contextlib.suppress(Exception):
                await conn.disconnect(nowait=True)
            await pool.release(conn)

    async def _retrying(self, send: Any) -> Any:
        """Await ``send()``. A connection error (a pooled connection that Redis, restarted or
        failed over, no longer knows, or one to a primary demoted to a replica) drops every idle
        pooled connection and tries once more on a fresh one, so a Redis that answers again costs
        no 503; a timeout is never retried, and the stage's deadline bounds both tries. Raises
        :class:`QuotaStoreUnavailable`."""
        from redis.exceptions import ConnectionError as RedisConnectionError

        try:
            try:
                return await send()
            except (RedisConnectionError, ConnectionResetError, BrokenPipeError) as first:
                log.info("redis connection lost (%s); reconnecting once", type(first).__name__)
                with contextlib.suppress(Exception):
                    await self._release_held()
                    await self.client.connection_pool.disconnect(inuse_connections=False)
                return await send()
        except store_errors() as e:  # also a cluster with no node answering
            raise QuotaStoreUnavailable(f"redis: {type(e).__name__}: {e}") from e

    async def reserve(
        self,
        tenant_id: str,
        limits: QuotaLimits,
        lease_id: str,
        tokens: int,
        window_ms: int,
        lease_ttl_ms: int,
        *,
        also: PendingWrite | None = None,
    ) -> QuotaDecision:
        args = [
            lease_id,
            _arg(limits.rpm),
            _arg(limits.tpm),
            _arg(limits.max_concurrent),
            int(tokens),
            int(window_ms),
            int(lease_ttl_ms),
        ]
        if also is not None and also.calls and not self.cluster:
            (r,) = await self._call_with([(self._reserve, self._script_keys(tenant_id), args)], also, also.calls)
        else:
            r = await self._call(self._reserve, self._script_keys(tenant_id), args)
        return _decision(r)

    async def _call_with(
        self,
        scripts: list[tuple[Any, list[str], list[Any]]],
        also: PendingWrite,
        calls: list[tuple[str, list[str], list[Any]]],
    ) -> list[Any]:
        """:meth:`_call` for each of ``scripts`` (``(script, keys, args)``, in order) with
        ``calls`` (``also``'s, or its guarded form) right behind them in the same round trip and
        the same pipeline (coalesced with this turn's other calls; no transaction: each call
        stands alone, in order), their results (an exception in place of a failed one,
        ``NOSCRIPT`` included: ``also.finish`` sends those itself) or the exception that ended
        the round trip handed to ``also.sent``. Returns the scripts' replies in order. Raises
        :class:`QuotaStoreUnavailable` as :meth:`_call` does (the first failed script's)."""
        firsts, rest = self._calls_of(scripts), self._raw_calls_of(calls)
        await self._submit([*firsts, *rest])
        try:
            replies = [await q.reply for q in firsts]
        except asyncio.CancelledError:  # the request is gone: its caller discards ``also``
            _retrieve_all([*firsts, *rest])
            raise
        except BaseException as e:  # unavailable: fate unknown
            _retrieve_all([*firsts, *rest])
            also.sent(e)
            raise
        also.sent([await q.reply for q in rest])  # answered by the same round trip as ``firsts``
        return replies

    async def begin(
        self, tenant_id: str, limits: QuotaLimits, lease_id: str, window_ms: int, lease_ttl_ms: int
    ) -> QuotaDecision:
        args = _begin_args(limits, lease_id, window_ms, lease_ttl_ms)
        return _decision(await self._call(self._begin, self._script_keys(tenant_id), args))

    async def take_tokens(
        self,
        tenant_id: str,
        limits: QuotaLimits,
        lease_id: str,
        tokens: int,
        window_ms: int,
        *,
        also: PendingWrite | None = None,
    ) -> QuotaDecision:
        """``tokens.lua``; ``also`` (not on a cluster) rides its round trip guarded by the debit
        the script sets when it admits (the ``:tpm:debits`` hash's field ``lease_id``), so a
        refused request's writes are never made."""
        keys, args = self._script_keys(tenant_id), _tokens_args(limits, lease_id, tokens, window_ms)
        calls = also.guarded(keys[2], lease_id) if also is not None and not self.cluster else []
        if also is not None and calls:
            (r,) = await self._call_with([(self._tokens, keys, args)], also, calls)
            return _decision(r)
        return _decision(await self._call(self._tokens, keys, args))

    async def begin_tokens(
        self,
        tenant_id: str,
        limits: QuotaLimits,
        lease_id: str,
        tokens: int,
        window_ms: int,
        lease_ttl_ms: int,
        *,
        also: PendingWrite | None = None,
    ) -> tuple[QuotaDecision, QuotaDecision | None]:
        """:meth:`begin` then :meth:`take_tokens` (when ``limits.tpm`` is set) in one round trip:
        ``begin.lua``, then ``tokens.lua`` guarded by the entry ``begin.lua`` leaves (it debits
        nothing when the request was not begun), then ``also`` guarded by the debit (not on a
        cluster). The same scripts as the two calls, in the same order. Returns ``(begin's
        decision, the tokens' decision, or None without TPM or after a refused begin)``. Raises
        :class:`QuotaStoreUnavailable`."""
        keys = self._script_keys(tenant_id)
        begin = _begin_args(limits, lease_id, window_ms, lease_ttl_ms)
        scripts: list[tuple[Any, list[str], list[Any]]] = [(self._begin, keys, begin)]
        if limits.tpm is not None:
            take = _tokens_args(limits, lease_id, tokens, window_ms)
            begun_key = "1" if limits.rpm is not None else "5" if limits.max_concurrent is not None else None
            scripts.append((self._tokens, keys, take if begun_key is None else [*take, begun_key]))
        rides = also is not None and limits.tpm is not None and not self.cluster
        calls = also.guarded(keys[2], lease_id) if also is not None and rides else []
        if also is not None and calls:
            replies = await self._call_with(scripts, also, calls)
        else:
            replies = await self._call_all(scripts)
        begun = _decision(replies[0])
        return begun, _decision(replies[1]) if begun.admitted and len(replies) > 1 else None

    async def settle(
        self, tenant_id: str, limits: QuotaLimits, lease_id: str, used_tokens: int, reserved_tokens: int, window_ms: int
    ) -> None:
        track = "1" if limits.tpm is not None else "0"
        used, reserved = min(int(used_tokens), MAX_COUNT), min(int(reserved_tokens), MAX_COUNT)
        args = [lease_id, used, reserved, int(window_ms), track, self.ended_ms]
        await self._call(self._settle, self._script_keys(tenant_id), args, lazy=True)

    async def renew(self, tenant_id: str, lease_ids: list[str], lease_ttl_ms: int) -> int:
        if not lease_ids:
            return 0
        n = await self._call(self._renew, [self.keys(tenant_id)[4]], [int(lease_ttl_ms), *lease_ids])
        return int(n)

    async def cancel(self, tenant_id: str, lease_ids: list[str], *, keep_rpm: bool = False) -> int:
        """``cancel.lua``: each lease's entries removed (with ``keep_rpm``, all but its RPM
        entry) and a tombstone left for :attr:`ended_ms`, so a reservation of it that Redis runs
        later (a paused server, a connection's bytes delivered late) changes nothing. At most
        :data:`CANCEL_CHUNK` ids a script, the chunks in one round trip: a script holds Redis
        for every tenant while it runs (10,000 ids took 28.7 ms in one)."""
        if not lease_ids:
            return 0
        keys, flag = self._script_keys(tenant_id), "1" if keep_rpm else "0"
        chunks = [lease_ids[i : i + CANCEL_CHUNK] for i in range(0, len(lease_ids), CANCEL_CHUNK)]
        done = await self._call_all([(self._cancel, keys, [self.ended_ms, flag, *c]) for c in chunks])
        return sum(int(n) for n in done)

    async def warm_up(self, timeout_seconds: float) -> None:
        """Connect before the first request (the gateway's start): one ``PING``, on a cluster one
        to every primary (after the slot-map read), every connect and read of it bounded by
        ``timeout_seconds`` instead of the client's timeouts; the connections it makes stay in the
        client's pool with the client's own bounds. Raises what the client raises."""
        with _longer_timeouts(self.client, timeout_seconds):
            if self.cluster:
                await self.client.ping(target_nodes=self.client.PRIMARIES)
            else:
                await self.client.ping()

    async def aclose(self) -> None:
        if self._queued:  # calls waiting for this turn's round trip go now
            self._flush()
        if self._sending:  # round trips under way finish first: their callers get their replies
            await asyncio.gather(*self._sending, return_exceptions=True)
        try:
            if not self.cluster:
                await self._release_held()
            await self.client.aclose()
        except Exception:  # closing a broken connection must not fail shutdown
            pass


@dataclass
class _TenantLog:
    rpm: deque[tuple[float, str]] = field(default_factory=deque)
    tpm: deque[tuple[float, str]] = field(default_factory=deque)
    debits: dict[str, list[float]] = field(default_factory=dict)  # lease id -> [admitted at, tokens]
    tpm_sum: int = 0
    leases: dict[str, float] = field(default_factory=dict)


class LocalQuotaStore:
    """Quota state in this process's memory: the same sliding-window log as ``reserve.lua``,
    for a gateway without Redis (limits are then per process) and for ``local_fallback`` while
    Redis is down. ``clock``: a function returning milliseconds (tests may pass their own)."""

    name = "local"

    def __init__(self, clock: Any = None) -> None:
        self._clock = clock or (lambda: time.monotonic() * 1000.0)
        self._tenants: dict[str, _TenantLog] = {}

    def _log(self, tenant_id: str) -> _TenantLog:
        log = self._tenants.get(tenant_id)
        if log is None:
            log = self._tenants[tenant_id] = _TenantLog()
        return log

    @staticmethod
    def _trim(log: _TenantLog, now: float, window_ms: int) -> None:
        cutoff = now - window_ms
        while log.rpm and log.rpm[0][0] <= cutoff:
            log.rpm.popleft()
        while log.tpm and log.tpm[0][0] <= cutoff:
            _, lid = log.tpm.popleft()
            log.tpm_sum -= int(log.debits.pop(lid, (0, 0))[1])
        for lid in [k for k, exp in log.leases.items() if exp <= now]:
            del log.leases[lid]

    async def reserve(
        self,
        tenant_id: str,
        limits: QuotaLimits,
        lease_id: str,
        tokens: int,
        window_ms: int,
        lease_ttl_ms: int,
        *,
        also: PendingWrite | None = None,
    ) -> QuotaDecision:
        return self.reserve_now(tenant_id, limits, lease_id, tokens, window_ms, lease_ttl_ms)

    def reserve_now(
        self, tenant_id: str, limits: QuotaLimits, lease_id: str, tokens: int, window_ms: int, lease_ttl_ms: int
    ) -> QuotaDecision:
        """Synchronous :meth:`reserve` (no I/O)."""
        now = self._clock()
        log = self._log(tenant_id)
        self._trim(log, now, window_ms)
        count, used, inflight = len(log.rpm), log.tpm_sum, len(log.leases)
        refused: list[str] = []
        retry = 0.0
        too_large = False
        if limits.rpm is not None and count + 1 > limits.rpm:
            refused.append("rpm")
            retry = max(retry, window_ms if limits.rpm == 0 else log.rpm[count - limits.rpm][0] + window_ms - now)
        if limits.tpm is not None and used + tokens > limits.tpm:
            refused.append("tpm")
            if tokens > limits.tpm:
                too_large = True
                retry = max(retry, window_ms)
            else:
                retry = max(retry, self._tokens_freed_at(log, used + tokens - limits.tpm, now) + window_ms - now)
        if limits.max_concurrent is not None and inflight + 1 > limits.max_concurrent:
            refused.append("concurrency")
            retry = max(retry, 1000)
        rr = UNLIMITED if limits.rpm is None else max(0, limits.rpm - count)
        rt = UNLIMITED if limits.tpm is None else max(0, limits.tpm - used)
        if refused:
            ur = UNLIMITED if limits.rpm is None else count
            ut = UNLIMITED if limits.tpm is None else used
            return QuotaDecision(False, tuple(refused), max(1, math.floor(retry)), rr, rt, too_large, ur, ut)
        self._admit(log, limits, lease_id, tokens, now, lease_ttl_ms)
        if limits.rpm is not None:
            rr -= 1
        if limits.tpm is not None:
            rt = limits.tpm - used - int(tokens)
        return QuotaDecision(True, (), 0, rr, rt)

    @staticmethod
    def _tokens_freed_at(log: _TenantLog, need: int, now: float) -> float:
        """When (ms, the admission time of a window debit) the window's oldest debits add up to
        ``need`` tokens, so that many are free one window later; ``now`` when they never do.
        Walks at most :data:`TPM_WALK_MAX` debits and answers the last one walked past them,
        as ``tokens.lua`` does (a tenant's thousands of small debits walked for each refusal
        held the event loop: 100,000 took about 30 ms)."""
        freed = 0
        ts = now
        for ts, lid in itertools.islice(log.tpm, TPM_WALK_MAX):
            freed += int(log.debits[lid][1]) if lid in log.debits else 0
            if freed >= need:
                return ts
        return ts if len(log.tpm) >= TPM_WALK_MAX else now

    @staticmethod
    def _admit(log: _TenantLog, limits: QuotaLimits, lease_id: str, tokens: int, now: float, lease_ttl_ms: int) -> None:
        """Record an admitted request in the limits it counts against: its RPM entry, its TPM
        debit of ``tokens``, its lease (expiring ``lease_ttl_ms`` after ``now``)."""
        if limits.rpm is not None:
            log.rpm.append((now, lease_id))
        if limits.tpm is not None:
            log.tpm.append((now, lease_id))
            log.debits[lease_id] = [now, int(tokens)]
            log.tpm_sum += int(tokens)
        if limits.max_concurrent is not None:
            log.leases[lease_id] = now + lease_ttl_ms

    async def begin(
        self, tenant_id: str, limits: QuotaLimits, lease_id: str, window_ms: int, lease_ttl_ms: int
    ) -> QuotaDecision:
        return self.begin_now(tenant_id, limits, lease_id, window_ms, lease_ttl_ms)

    def begin_now(
        self, tenant_id: str, limits: QuotaLimits, lease_id: str, window_ms: int, lease_ttl_ms: int
    ) -> QuotaDecision:
        """Synchronous :meth:`begin`: :meth:`reserve_now` without TPM (``begin.lua``)."""
        lease_only = QuotaLimits(limits.rpm, None, limits.max_concurrent)
        return self.reserve_now(tenant_id, lease_only, lease_id, 0, window_ms, lease_ttl_ms)

    async def take_tokens(
        self,
        tenant_id: str,
        limits: QuotaLimits,
        lease_id: str,
        tokens: int,
        window_ms: int,
        *,
        also: PendingWrite | None = None,
    ) -> QuotaDecision:
        return self.take_tokens_now(tenant_id, limits, lease_id, tokens, window_ms)

    async def begin_tokens(
        self,
        tenant_id: str,
        limits: QuotaLimits,
        lease_id: str,
        tokens: int,
        window_ms: int,
        lease_ttl_ms: int,
        *,
        also: PendingWrite | None = None,
    ) -> tuple[QuotaDecision, QuotaDecision | None]:
        begun = self.begin_now(tenant_id, limits, lease_id, window_ms, lease_ttl_ms)
        if not begun.admitted or limits.tpm is None:
            return begun, None
        return begun, self.take_tokens_now(tenant_id, limits, lease_id, tokens, window_ms)

    def take_tokens_now(
        self, tenant_id: str, limits: QuotaLimits, lease_id: str, tokens: int, window_ms: int
    ) -> QuotaDecision:
        """Synchronous :meth:`take_tokens`: :meth:`reserve_now` with TPM only (``tokens.lua``)."""
        return self.reserve_now(tenant_id, QuotaLimits(None, limits.tpm, None), lease_id, tokens, window_ms, 0)

    async def settle(
        self, tenant_id: str, limits: QuotaLimits, lease_id: str, used_tokens: int, reserved_tokens: int, window_ms: int
    ) -> None:
        log = self._log(tenant_id)
        log.leases.pop(lease_id, None)
        if limits.tpm is None:
            return
        now = self._clock()
        entry = log.debits.get(lease_id)
        if entry is not None and entry[0] > now - window_ms:
            log.tpm_sum += int(used_tokens) - int(entry[1])
            entry[1] = int(used_tokens)
        elif used_tokens > reserved_tokens:
            xid = lease_id + ":x"
            extra = int(used_tokens) - int(reserved_tokens)
            log.tpm.append((now, xid))
            log.debits[xid] = [now, extra]
            log.tpm_sum += extra

    async def renew(self, tenant_id: str, lease_ids: list[str], lease_ttl_ms: int) -> int:
        now = self._clock()
        log = self._log(tenant_id)
        n = 0
        for lid in lease_ids:
            if log.leases.get(lid, -1.0) > now:
                log.leases[lid] = now + lease_ttl_ms
                n += 1
        return n

    async def cancel(self, tenant_id: str, lease_ids: list[str], *, keep_rpm: bool = False) -> int:
        return 0  # in-process calls never time out half-way

    def scope(self, tenant_id: str) -> int | None:
        return None

    async def aclose(self) -> None:
        return None
