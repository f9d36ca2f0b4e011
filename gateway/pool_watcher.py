"""Live pool limit per upstream (DESIGN.md, "Live pool limit").

A :class:`PoolWatcher` polls where its upstream's pool is read (``pool_source``):

- ``sglang`` / ``kvgate``: ``GET`` every URL of ``pool_urls`` (SGLang ``/server_info``; on 404
  the ``/get_server_info`` twin, as older SGLang serves it). Fields: ``max_total_num_tokens``
  (required), ``max_req_input_len`` and ``context_length`` (used when present; SGLang also nests
  them in ``internal_states[0]``). The limit is the minimum over the nodes.
- ``vllm``: ``GET`` the ``/v1/models`` URL; ``pool`` = the smallest ``data[].max_model_len``.
- ``static``: ``static_pool_tokens`` from config; always known, reported as not live.

Every poll carries the upstream's ``api_key`` (``Authorization: Bearer``) when it has one.
Each node's limit is :func:`config.pool.effective_pool_limit`. Any failed poll (unreachable
node, non-200, missing field) makes the pool *unknown* at once; a value older than
``max_staleness_seconds`` is unknown too. Unknown means the gateway fails closed (503
``pool_size_unknown``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from config.models import PoolSettings, UpstreamConfig
from config.pool import effective_pool_limit

log = logging.getLogger("kvgate.pool")

#: context length used when neither the engine nor config bounds it (the model's own is applied
#: at admission)
_UNBOUNDED = 1 << 62


class PoolReadError(Exception):
    """A pool could not be read: unreachable, bad status, or a required field missing."""


@dataclass
class PoolReading:
    """One successful poll. ``pool_tokens``: the smallest node pool; ``limit``: the smallest node
    limit (tokens); ``fetched_at``: ``time.monotonic()``; ``per_node``: url -> limit."""

    pool_tokens: int
    limit: int
    fetched_at: float
    per_node: dict[str, int]


def _int_field(info: dict[str, Any], name: str) -> int | None:
    v = info.get(name)
    if (v is None or isinstance(v, bool)) and isinstance(info.get("internal_states"), list):
        states = info["internal_states"]
        if states and isinstance(states[0], dict):
            v = states[0].get(name)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return int(v)


def limit_from_server_info(info: Any, headroom: float, context_length: int | None = None) -> tuple[int, int]:
    """``(pool_tokens, limit)`` from an SGLang-shaped server_info dict. Raises
    :class:`PoolReadError` when ``max_total_num_tokens`` is missing or not a positive number."""
    if not isinstance(info, dict):
        raise PoolReadError("server_info is not a JSON object")
    pool = _int_field(info, "max_total_num_tokens")
    if pool is None or pool <= 0:
        raise PoolReadError("server_info has no max_total_num_tokens")
    ctx = _int_field(info, "context_length") or context_length or _UNBOUNDED
    if context_length:
        ctx = min(ctx, context_length)
    return pool, effective_pool_limit(ctx, pool, _int_field(info, "max_req_input_len"), headroom)


def limit_from_vllm_models(data: Any, headroom: float, context_length: int | None = None) -> tuple[int, int]:
    """``(pool_tokens, limit)`` from a vLLM ``/v1/models`` body: pool = smallest ``max_model_len``
    (DESIGN.md: "vLLM: max_model_len"). Raises :class:`PoolReadError` when no entry reports it."""
    entries = data.get("data") if isinstance(data, dict) else None
    lens = [
        int(e["max_model_len"])
        for e in entries or []
        if isinstance(e, dict)
        and isinstance(e.get("max_model_len"), int)
        and not isinstance(e.get("max_model_len"), bool)
    ]
    if not lens:
        raise PoolReadError("/v1/models reports no max_model_len")
    pool = min(lens)
    return pool, effective_pool_limit(context_length or _UNBOUNDED, pool, None, headroom)


def _fallback_url(url: str) -> str | None:
    if url.endswith("/get_server_info"):
        return url[: -len("/get_server_info")] + "/server_info"
    if url.endswith("/server_info"):
        return url[: -len("/server_info")] + "/get_server_info"
    return None


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
        self.reading: PoolReading | None = None
        self.last_error: str | None = "not polled yet"
        self.live = upstream.pool_source != "static"
        self._task: asyncio.Task[None] | None = None
        key = upstream.api_key.get_secret_value() if upstream.api_key is not None else ""
        #: the upstream's ``api_key`` as a bearer token on every poll (vLLM and SGLang started with
        #: ``--api-key`` answer 401 without it, and the pool would be unknown)
        self._headers = {"authorization": f"Bearer {key}"} if key else None
        if upstream.pool_source == "static":
            pool = int(upstream.static_pool_tokens or 0)
            lim = effective_pool_limit(context_length or _UNBOUNDED, pool, None, settings.headroom)
            self.reading = PoolReading(pool, lim, float("inf"), {"static": lim})
            self.last_error = None

    # ------------------------------------------------------------ reading
    def limit_now(self) -> int | None:
        """The limit in tokens, or ``None`` when unknown or older than ``max_staleness_seconds``."""
        r = self.reading
        if r is None:
            return None
        if self.live and self.clock() - r.fetched_at > self.settings.max_staleness_seconds:
            return None
        return r.limit

    def status(self) -> dict[str, Any]:
        """A JSON-able report: name, source, live, known, pool_tokens, limit, age_seconds, error."""
        r = self.reading
        lim = self.limit_now()
        return {
            "upstream": self.upstream.name,
            "pool_source": self.upstream.pool_source,
            "live": self.live,
            "known": lim is not None,
            "pool_tokens": r.pool_tokens if r else None,
            "limit_tokens": lim,
            "age_seconds": (round(self.clock() - r.fetched_at, 3) if r and self.live else None),
            "error": self.last_error if lim is None else None,
        }

    # ------------------------------------------------------------ polling
    async def _get_json(self, url: str) -> Any:
        timeout = self.settings.request_timeout_seconds
        headers = self._headers
        r = await self.client.get(url, timeout=timeout, headers=headers)
        if r.status_code == 404 and self.upstream.pool_source in ("sglang", "kvgate"):
            alt = _fallback_url(url)
            if alt:
                r = await self.client.get(alt, timeout=timeout, headers=headers)
        if r.status_code != 200:
            raise PoolReadError(f"{url} answered {r.status_code}")
        try:
            return r.json()
        except ValueError:
            raise PoolReadError(f"{url} answered non-JSON") from None

    async def poll_once(self) -> int | None:
        """Read every node now; returns the new limit, or ``None`` (pool unknown) on any failure."""
        if not self.live:
            return self.limit_now()
        per_node: dict[str, int] = {}
        pools: list[int] = []
        try:
            headroom = self.settings.headroom
            for url in self.upstream.pool_urls:
                try:
                    data = await self._get_json(url)
                except httpx.HTTPError as e:
                    raise PoolReadError(f"{url} unreachable ({type(e).__name__})") from None
                if self.upstream.pool_source == "vllm":
                    pool, lim = limit_from_vllm_models(data, headroom, self.context_length)
                else:
                    pool, lim = limit_from_server_info(data, headroom, self.context_length)
                per_node[url] = lim
                pools.append(pool)
        except PoolReadError as e:
            if self.reading is not None or self.last_error != str(e):
                log.warning("pool of upstream %s unknown: %s", self.upstream.name, e)
            self.reading = None
            self.last_error = str(e)
            self._notify(None, None)
            return None
        self.reading = PoolReading(min(pools), min(per_node.values()), self.clock(), per_node)
        self.last_error = None
        self._notify(self.reading.pool_tokens, self.reading.limit)
        return self.reading.limit

    def _notify(self, pool: int | None, limit: int | None) -> None:
        if self.on_update is not None:
            try:
                self.on_update(pool, limit)
            except Exception:  # metrics must never break polling
                log.exception("pool metrics update failed")

    async def run(self) -> None:
        """Poll every ``poll_interval_seconds`` until cancelled."""
        while True:
            try:
                await self.poll_once()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # never let the watcher die
                self.reading = None
                self.last_error = f"poll failed: {type(e).__name__}"
                log.exception("pool poll of %s failed", self.upstream.name)
            await asyncio.sleep(self.settings.poll_interval_seconds)

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
            except (asyncio.CancelledError, Exception):
                pass
            self._task = None
