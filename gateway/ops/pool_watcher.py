"""Live pool limit per upstream: one :class:`PoolWatcher` polls where its upstream's pool is read.

- ``sglang`` / ``kvgate``: every ``pool_urls`` entry (``/server_info``, on 404 ``/get_server_info``)
  and that node's ``/v1/loads`` when served; the pool is the smallest data-parallel rank's.
- ``vllm``: the ``/v1/models`` URL (``max_model_len``, the gate's pool), and the KV capacity for
  signal 1 from ``/v1/server/kv-cache`` or ``/metrics``.
- ``static``: ``static_pool_tokens``; always known, reported as not live.

Parsing lives in :mod:`config.engine_pool`, the limit formula in :mod:`config.pool`. Any failed
read, a missing rank or a reading older than ``max_staleness_seconds`` (counted from the poll's
start) makes the pool unknown, and unknown fails closed (503 ``pool_size_unknown``). The gate
holds the smallest reading of the last ``max_staleness_seconds``: engines of unequal pools behind
one address answer the polls in turn, and a request may land on any of them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx

from config.background import one_round, stopping
from config.engine_pool import (
    SGLANG_LOADS_QUERY,
    EnginePoolError,
    SGLangPool,
    VLLMCapacity,
    server_info_base,
    sglang_pool,
    vllm_capacity_from_endpoint,
    vllm_capacity_from_metrics,
    vllm_max_model_len,
)
from config.models import PoolSettings, UpstreamConfig
from config.pool import effective_pool_limit, signal_1_required_tokens

log = logging.getLogger("kvgate.pool")

_T = TypeVar("_T")

#: context length used when neither the engine nor config bounds it (the model's own is applied
#: at admission)
_UNBOUNDED = 1 << 62

#: the most bytes one pool answer may have; a longer one is a failed read. Real reports are tens
#: of KiB (SGLang's ``/server_info`` carries every server argument, vLLM's ``/metrics`` every
#: series); 1 MiB bounds the memory and the JSON parse (on the event loop) a broken engine costs
MAX_POOL_BODY_BYTES = 1 << 20


#: the delay before the first retry of a failed poll, doubled on each further failure up to
#: ``pool.poll_interval_seconds``: one transient failure (a non-200, a late answer) makes the pool
#: unknown (503 ``pool_size_unknown``) for about this long, not for the whole interval. Not
#: jittered: each watcher polls only its own upstream's few nodes, and one small GET per gateway
#: replica at the same instant is no herd; a fixed schedule keeps the retry window predictable
RETRY_FIRST_DELAY_SECONDS = 0.25


class PoolReadError(Exception):
    """A pool could not be read: unreachable, bad status, or a required field missing."""


@dataclass
class PoolReading:
    """One successful poll. ``pool_tokens``: the smallest pool over nodes and data-parallel ranks;
    ``limit``: the smallest node limit (tokens); ``fetched_at``: ``time.monotonic()`` when the poll
    began (its first answer may be that old when the last one arrives);
    ``per_node``: url -> limit; ``rank_pools``: url -> each rank's pool (tokens); ``read_from``:
    url -> the endpoint the pool came from; ``kv_capacity``: vLLM's KV capacity (signal 1), else
    ``None``."""

    pool_tokens: int
    limit: int
    fetched_at: float
    per_node: dict[str, int]
    rank_pools: dict[str, tuple[int, ...]]
    read_from: dict[str, str]
    kv_capacity: VLLMCapacity | None = None


@dataclass(frozen=True)
class _Answer:
    """One pool endpoint's answer, read whole within the byte and time bounds."""

    status_code: int
    body: bytes

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")


@dataclass(frozen=True)
class _NodeReading:
    pool_tokens: int
    limit: int
    rank_pools: tuple[int, ...]
    read_from: str


def limit_from_server_info(
    info: Any, headroom: float, context_length: int | None = None, loads: Any | None = None
) -> tuple[int, int]:
    """``(pool_tokens, limit)`` from an SGLang-shaped ``/server_info`` body and, when the node serves
    it, its ``/v1/loads`` body: the pool is the smallest data-parallel rank's
    (:func:`config.engine_pool.sglang_pool`). Raises :class:`PoolReadError` when a rank's pool is
    missing."""
    try:
        node = sglang_pool(info, loads)
    except EnginePoolError as e:
        raise PoolReadError(str(e)) from None
    return node.pool_tokens, _node_limit(node, headroom, context_length)


def _node_limit(node: SGLangPool, headroom: float, context_length: int | None) -> int:
    ctx = min(c for c in (node.context_length, context_length, _UNBOUNDED) if c)
    return effective_pool_limit(ctx, node.pool_tokens, node.max_req_input_len, headroom)


def limit_from_vllm_models(data: Any, headroom: float, context_length: int | None = None) -> tuple[int, int]:
    """``(pool_tokens, limit)`` from a vLLM ``/v1/models`` body: the gate's pool is the smallest
    ``max_model_len`` (vLLM refuses to start when one request of that length cannot fit its KV
    cache). Raises :class:`PoolReadError` when no entry reports it."""
    try:
        pool = vllm_max_model_len(data)
    except EnginePoolError as e:
        raise PoolReadError(str(e)) from None
    return pool, effective_pool_limit(context_length or _UNBOUNDED, pool, None, headroom)


def _parsed(url: str, parse: Callable[..., _T], *args: Any) -> _T:
    """``parse(*args)`` on what ``url`` answered. A report the parser cannot use is a failed read of
    that URL (:class:`PoolReadError` naming it), whatever the parser raised: an engine's answer of a
    shape it never foresaw (a number where ``internal_states`` or ``data`` holds a list) fails the
    poll closed with the URL and the exception's type, never escapes it as an error of the watcher."""
    try:
        return parse(*args)
    except (EnginePoolError, PoolReadError) as e:
        raise PoolReadError(f"{url}: {e}") from None
    except Exception as e:  # the parser met a shape it did not foresee
        raise PoolReadError(f"{url}: unreadable pool report ({type(e).__name__})") from None


def _fallback_url(url: str) -> str | None:
    if url.endswith("/get_server_info"):
        return url[: -len("/get_server_info")] + "/server_info"
    if url.endswith("/server_info"):
        return url[: -len("/server_info")] + "/get_server_info"
    return None


def _vllm_base(url: str) -> str:
    """The engine's root for its ``/v1/models`` URL (``http://e:8000/v1/models`` -> ``http://e:8000``)."""
    for suffix in ("/v1/models", "/models"):
        if url.rstrip("/").endswith(suffix):
            return url.rstrip("/")[: -len(suffix)]
    return url.rstrip("/")


class PoolWatcher:
    """Keeps one upstream's live pool limit.

    ``context_length``: the largest context of the models it serves (the model's own is applied
    again at admission). ``client``: the app's pooled ``httpx.AsyncClient``. ``on_update`` is
    called with ``(pool_tokens | None, limit | None)`` after every poll (metrics).
    """

    def __init__(
        self,
        upstream: UpstreamConfig,
        settings: PoolSettings,
        client: httpx.AsyncClient,
        context_length: int | None = None,
        on_update: Callable[[int | None, int | None], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.upstream = upstream
        self.settings = settings
        self.client = client
        self.context_length = context_length
        self.on_update = on_update
        self.clock = clock
        #: the newest reading (``None``: unknown); the gate holds :meth:`_floor`'s
        self.reading: PoolReading | None = None
        #: the readings of the last ``max_staleness_seconds`` that may still be the smallest, oldest
        #: first, each of smaller limit than every one after it (a sliding-window minimum): its front
        #: is the one the gate holds, and it holds at most one reading per poll of that window
        self._recent: deque[PoolReading] = deque()
        #: the last pool read, kept across failures: a restart's new pool is logged against the old
        self._last_pool_tokens: int | None = None
        self.last_error: str | None = "not polled yet"
        self.live = upstream.pool_source != "static"
        self._task: asyncio.Task[None] | None = None
        key = upstream.api_key.get_secret_value() if upstream.api_key is not None else ""
        #: the upstream's ``api_key`` as a bearer token on every poll (vLLM and SGLang started with
        #: ``--api-key`` answer 401 without it, and the pool would be unknown); ``identity``: the
        #: byte bound of :meth:`_get` counts the bytes as sent, so they must be the body itself
        self._headers = {"accept-encoding": "identity", **({"authorization": f"Bearer {key}"} if key else {})}
        if upstream.pool_source == "static":
            pool = int(upstream.static_pool_tokens or 0)
            lim = effective_pool_limit(context_length or _UNBOUNDED, pool, None, settings.headroom)
            self.reading = PoolReading(
                pool, lim, float("inf"), {"static": lim}, {"static": (pool,)}, {"static": "config"}
            )
            self.last_error = None

    # ------------------------------------------------------------ reading
    def limit_now(self) -> int | None:
        """The limit in tokens: the smallest of the readings of the last ``max_staleness_seconds``;
        ``None`` when the newest reading is missing or older than that."""
        floor = self._floor()
        return floor.limit if floor is not None else None

    def _floor(self) -> PoolReading | None:
        """The reading the gate holds: of the readings no older than ``max_staleness_seconds``, the
        one of smallest limit. A pool that differs from one poll to the next (engines of unequal
        pools behind one address, answering in turn) is held at its smallest value; a larger one
        counts once the smaller has aged out. ``None`` when the newest reading is missing or stale."""
        r = self.reading
        if r is None or not self.live:
            return r
        now = self.clock()
        stale = self.settings.max_staleness_seconds
        if now - r.fetched_at > stale:
            return None
        # the newest reading is the deque's last and fresh: the loop stops at it at the latest
        while now - self._recent[0].fetched_at > stale:
            self._recent.popleft()
        return self._recent[0]

    def status(self) -> dict[str, Any]:
        """A JSON-able report: name, source, live, known, pool_tokens, limit, age_seconds, error,
        each node's rank pools and endpoint, and the runbook's signal 1 (:meth:`signal_1`)."""
        r = self.reading
        floor = self._floor()
        lim = floor.limit if floor is not None else None
        return {
            "upstream": self.upstream.name,
            "pool_source": self.upstream.pool_source,
            "live": self.live,
            "known": lim is not None,
            "pool_tokens": (floor or r).pool_tokens if r else None,
            "limit_tokens": lim,
            "age_seconds": (round(self.clock() - r.fetched_at, 3) if r and self.live else None),
            "error": self.last_error if lim is None else None,
            "nodes": [
                {"url": u, "rank_pools_tokens": list(p), "read_from": r.read_from[u]} for u, p in r.rank_pools.items()
            ]
            if r
            else [],
            "signal_1": self.signal_1(),
        }

    def signal_1(self) -> dict[str, Any]:
        """The runbook's signal 1 on the last reading: ``{"status": "ok" | "too_small" | "unknown",
        "capacity_tokens", "capacity_source", "required_tokens"}``. The capacity is the smallest
        rank's pool (SGLang, bundled backend, static) or vLLM's KV capacity; the requirement is the
        context window (vLLM: at most ``max_model_len``) x ``pool.headroom``. Reported, never
        gated on: a small pool already lowers the limit."""
        r = self.reading if self.limit_now() is not None else None
        vllm = self.upstream.pool_source == "vllm"
        cap = (r.kv_capacity if vllm else VLLMCapacity(r.pool_tokens, "pool")) if r else None
        window = min(c for c in (self.context_length, r.pool_tokens if (r and vllm) else None, _UNBOUNDED) if c)
        if cap is None or window == _UNBOUNDED:
            return {"status": "unknown", "capacity_tokens": None, "capacity_source": None, "required_tokens": None}
        required = signal_1_required_tokens(window, self.settings.headroom)
        return {
            "status": "ok" if cap.kv_capacity_tokens >= required else "too_small",
            "capacity_tokens": cap.kv_capacity_tokens,
            "capacity_source": cap.source,
            "required_tokens": required,
        }

    # ------------------------------------------------------------ polling
    async def _get(self, url: str) -> _Answer:
        """``GET url`` read whole: at most :data:`MAX_POOL_BODY_BYTES` and
        ``request_timeout_seconds`` from the connect to the body's last byte (httpx's timeout
        bounds each wait, so an engine that trickles or never ends its body would hold the poll
        forever). Raises :class:`PoolReadError`."""
        timeout = self.settings.request_timeout_seconds
        try:
            async with asyncio.timeout(timeout):
                return await self._read_bounded(url, timeout)
        except TimeoutError:
            raise PoolReadError(f"{url} answered nothing whole within {timeout:g} s") from None
        except httpx.HTTPError as e:
            raise PoolReadError(f"{url} unreachable ({type(e).__name__})") from None

    async def _read_bounded(self, url: str, timeout: float) -> _Answer:
        async with self.client.stream("GET", url, timeout=timeout, headers=self._headers) as r:
            body = bytearray()
            async for chunk in r.aiter_raw():
                body += chunk
                if len(body) > MAX_POOL_BODY_BYTES:
                    raise PoolReadError(f"{url} answered more than {MAX_POOL_BODY_BYTES} bytes")
            return _Answer(r.status_code, bytes(body))

    async def _get_json(self, url: str, *, optional: bool = False) -> Any:
        """The JSON body of ``GET url``; with ``optional``, ``None`` when the engine does not serve
        the route (404/405). SGLang's server-info URL falls back to its renamed twin on 404."""
        r = await self._get(url)
        if r.status_code == 404 and self.upstream.pool_source in ("sglang", "kvgate"):
            alt = _fallback_url(url)
            if alt:
                r = await self._get(alt)
        if optional and r.status_code in (404, 405):
            return None
        if r.status_code != 200:
            raise PoolReadError(f"{url} answered {r.status_code}")
        try:
            return json.loads(r.body)
        except (ValueError, RecursionError):  # RecursionError: nesting deeper than the parser's stack
            raise PoolReadError(f"{url} answered non-JSON") from None

    async def _read_sglang_node(self, url: str) -> _NodeReading:
        info = await self._get_json(url)
        base = server_info_base(url)
        loads = await self._get_json(f"{base}/v1/loads?{SGLANG_LOADS_QUERY}", optional=True) if base else None
        node = _parsed(url, sglang_pool, info, loads)
        lim = _node_limit(node, self.settings.headroom, self.context_length)
        return _NodeReading(node.pool_tokens, lim, node.rank_pools_tokens, node.source)

    async def _read_vllm_node(self, url: str) -> _NodeReading:
        data = await self._get_json(url)
        pool, lim = _parsed(url, limit_from_vllm_models, data, self.settings.headroom, self.context_length)
        return _NodeReading(pool, lim, (pool,), "/v1/models")

    async def _read_vllm_capacity(self) -> VLLMCapacity | None:
        """The smallest KV capacity over the upstream's vLLM nodes, or ``None`` when any node's is
        unknown: ``/v1/server/kv-cache``, else ``/metrics``' ``vllm:cache_config_info``."""
        found: list[VLLMCapacity] = []
        for url in self.upstream.pool_urls:
            base = _vllm_base(url)
            try:
                cap = vllm_capacity_from_endpoint(await self._get_json(base + "/v1/server/kv-cache", optional=True))
                if cap is None:
                    r = await self._get(base + "/metrics")
                    # a line scan and a parse of the gauge's lines: a megabyte of page, off the loop
                    cap = await asyncio.to_thread(vllm_capacity_from_metrics, r.text) if r.status_code == 200 else None
            except PoolReadError:
                cap = None
            if cap is None:
                return None
            found.append(cap)
        return min(found, key=lambda c: c.kv_capacity_tokens) if found else None

    async def _read_all(self) -> PoolReading:
        """Every node's pool, then vLLM's capacity. Its ``fetched_at`` is the poll's start: the first
        node's answer is as old as the whole poll when the last arrives, so a reading's age is never
        less than its oldest part's. Raises :class:`PoolReadError`, also when the poll took longer
        than ``max_staleness_seconds`` (the reading would be stale on arrival)."""
        started = self.clock()
        vllm = self.upstream.pool_source == "vllm"
        nodes = {
            u: await (self._read_vllm_node(u) if vllm else self._read_sglang_node(u)) for u in self.upstream.pool_urls
        }
        reading = PoolReading(
            min(n.pool_tokens for n in nodes.values()),
            min(n.limit for n in nodes.values()),
            started,
            {u: n.limit for u, n in nodes.items()},
            {u: n.rank_pools for u, n in nodes.items()},
            {u: n.read_from for u, n in nodes.items()},
            await self._read_vllm_capacity() if vllm else None,
        )
        stale = self.settings.max_staleness_seconds
        if self.clock() - started > stale:
            raise PoolReadError(f"reading the pool took longer than pool.max_staleness_seconds ({stale:g} s)")
        return reading

    async def poll_once(self) -> int | None:
        """Read every node now; returns the limit the gate now holds (:meth:`limit_now`), or
        ``None`` (pool unknown) on any failure."""
        if not self.live:
            return self.limit_now()
        try:
            reading = await self._read_all()
        except PoolReadError as e:
            if self._fail(str(e)):
                log.warning("pool of upstream %s unknown: %s", self.upstream.name, e)
            return None
        held = self._hold(reading)
        self._notify(held.pool_tokens, held.limit)
        return held.limit

    def _hold(self, reading: PoolReading) -> PoolReading:
        """Make ``reading`` the newest and return the one the gate now holds (:meth:`_floor`). A
        pool unlike the last one read (a restart, engines of unequal pools behind one address) is
        logged, with the pool the gate holds."""
        while self._recent and self._recent[-1].limit >= reading.limit:
            self._recent.pop()  # older and no smaller: never the smallest again
        self._recent.append(reading)
        self.reading = reading
        self.last_error = None
        held = self._recent[0]
        last, self._last_pool_tokens = self._last_pool_tokens, reading.pool_tokens
        if last is not None and last != reading.pool_tokens:
            log.warning(
                "pool of upstream %s read %d tokens (last read: %d); the gate holds the smallest reading of the "
                "last %g s: %d tokens, limit %d",
                self.upstream.name,
                reading.pool_tokens,
                last,
                self.settings.max_staleness_seconds,
                held.pool_tokens,
                held.limit,
            )
        return held

    def _fail(self, error: str) -> bool:
        """Drop every reading (unknown fails closed), keep ``error``, set the gauges to unknown.
        True when this is news (a known pool lost, or another error): the caller logs it then."""
        news = self.reading is not None or self.last_error != error
        self.reading = None
        self._recent.clear()
        self.last_error = error
        self._notify(None, None)
        return news

    def _notify(self, pool: int | None, limit: int | None) -> None:
        if self.on_update is not None:
            try:
                self.on_update(pool, limit)
            except Exception:  # metrics must never break polling
                log.exception("pool metrics update failed")

    async def run(self) -> None:
        """Poll every ``poll_interval_seconds`` until cancelled. After a failed poll the next comes
        sooner: :data:`RETRY_FIRST_DELAY_SECONDS`, doubled on each further failure, never more than
        the interval (after a few retries a dead engine is polled once per interval, never in a
        tight loop); a success returns to the interval. The pool stays unknown meanwhile (fail
        closed); a failure is logged only when it changes, not on every retry. A poll that raises
        anything but a stop (:func:`config.background.stopping`), a ``BaseException`` such as a native library's
        panic included, is a failed poll, logged with its traceback; should the task end anyway,
        the pool is unknown from then on (:meth:`_stopped`), never held at its last reading."""
        interval = self.settings.poll_interval_seconds
        retry = RETRY_FIRST_DELAY_SECONDS
        try:
            while True:
                ok = False
                with one_round(self._poll_fault):  # never let the watcher die of one poll
                    ok = await self.poll_once() is not None
                if ok:
                    retry = RETRY_FIRST_DELAY_SECONDS
                    await asyncio.sleep(interval)
                else:
                    await asyncio.sleep(min(retry, interval))
                    retry = min(retry * 2, interval)
        except BaseException as e:
            if not stopping(e):
                self._stopped(e)
            raise

    def _poll_fault(self, e: BaseException) -> None:
        """A poll raised ``e`` past its own ``PoolReadError`` handling: a failed poll, logged with
        its traceback when the failure changes (:meth:`_fail`)."""
        if self._fail(f"poll failed: {type(e).__name__}"):
            log.error("pool poll of %s failed", self.upstream.name, exc_info=(type(e), e, e.__traceback__))

    def _stopped(self, e: BaseException) -> None:
        """The polling task ends other than at a stop (``e``; e.g. the failure's own log line
        raised): the pool is unknown from now on, ``/readyz`` says why, the gauges read -1, and it
        is logged. State first: a report that raises again leaves the gate closed."""
        self.reading = None
        self._recent.clear()
        self.last_error = f"pool watcher stopped: {type(e).__name__}"
        try:
            log.error(
                "pool watcher of upstream %s stopped (%s): its pool is unknown, and requests for it are refused "
                "(503 pool_size_unknown), until the gateway restarts",
                self.upstream.name,
                type(e).__name__,
                exc_info=(type(e), e, e.__traceback__),
            )
        finally:
            self._notify(None, None)

    def start(self) -> None:
        """Start :meth:`run` as a task (live sources only)."""
        if self.live and self._task is None:
            self._task = asyncio.create_task(self.run(), name=f"pool-watcher-{self.upstream.name}")

    async def stop(self) -> None:
        """Cancel the polling task."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except BaseException:  # cancelled, or it had stopped of a fault (logged by _stopped)
                pass
            self._task = None
