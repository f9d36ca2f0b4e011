"""The pool watcher against a vLLM engine whose ``/metrics`` is broken or large (the third round of
hostile pool reads). The gate's pool is vLLM's ``/v1/models`` ``max_model_len``; the KV capacity of
``vllm:cache_config_info`` on ``/metrics`` is read only for the runbook's signal 1, reported and
never gated on (docs/gateway.md, "Live pool limit"). So a ``/metrics`` body that prometheus_client's
parser chokes on (0.26 ``parser.py`` ``_unquote_unescape`` raises ``IndexError``, not ``ValueError``,
on an empty label name after a comma) leaves the gate's pool known with signal 1 ``unknown``, and
the pure-Python parse of a 1 MiB body (about 2 s of short lines on a 2-core machine) runs in a
worker thread, never on the event loop that admits requests."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from config.engine_pool import VLLMCapacity, vllm_capacity_from_metrics
from config.models import PoolSettings, UpstreamConfig
from gateway.ops.pool_watcher import MAX_POOL_BODY_BYTES, PoolWatcher
from tests.engine_pool_fixtures import vllm_cache_config_metrics, vllm_models

pytestmark = pytest.mark.timeout(60)

MODELS_URL = "http://vllm:8000/v1/models"
#: floor(4096 / 1.25)
LIMIT = 3276
SIGNAL_1_UNKNOWN = {"status": "unknown", "capacity_tokens": None, "capacity_source": None, "required_tokens": None}


def _watcher(metrics: str, settings: PoolSettings | None = None) -> PoolWatcher:
    """A vLLM upstream's watcher whose engine answers ``/v1/models`` (``max_model_len`` 4,096), 404
    on ``/v1/server/kv-cache`` (vLLM before it) and ``metrics`` on ``/metrics``."""

    def handler(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/v1/models":
            body = json.dumps(vllm_models(4096)).encode()
        elif path == "/metrics":
            body = metrics.encode()
        else:
            return httpx.Response(404, stream=httpx.ByteStream(b'{"detail":"Not Found"}'))
        return httpx.Response(200, stream=httpx.ByteStream(body))

    up = UpstreamConfig(
        name="v", api_url="http://vllm:8000/v1", pool_source="vllm", pool_urls=[MODELS_URL], models=["m"]
    )
    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    return PoolWatcher(up, settings or PoolSettings(), client, 8192)


async def test_a_metrics_line_that_breaks_the_parser_leaves_the_gate_pool_known() -> None:
    # a cache_config_info series with an empty label name after a comma: prometheus_client raises
    # IndexError. Before: it escaped the poll, the watcher's loop caught it ("poll failed:
    # IndexError") and the whole upstream was unknown (503 pool_size_unknown on every request),
    # though max_model_len, the gate's pool, had been read.
    good = vllm_cache_config_metrics([{"num_gpu_blocks": "256", "block_size": "16"}])
    broken = good.replace('block_size="16"', 'block_size="16", ="x"')
    assert broken != good
    w = _watcher(broken, PoolSettings(poll_interval_seconds=0.05))
    w.start()
    try:
        for _ in range(200):
            if w.last_error != "not polled yet":
                break
            await asyncio.sleep(0.01)
        status = w.status()
    finally:
        await w.stop()
    assert (status["known"], status["limit_tokens"], status["pool_tokens"], status["error"]) == (
        True,
        LIMIT,
        4096,
        None,
    )
    assert status["signal_1"] == SIGNAL_1_UNKNOWN
    # the same series well formed is read: 256 blocks x 16 tokens, below max_model_len x 1.25
    w = _watcher(good)
    assert await w.poll_once() == LIMIT
    assert w.signal_1() == {
        "status": "too_small",
        "capacity_tokens": 4096,
        "capacity_source": "num_gpu_blocks x block_size",
        "required_tokens": 5120,
    }


async def test_a_1_mib_metrics_body_is_parsed_off_the_event_loop() -> None:
    # 1 MiB (the bound) of the shortest valid lines: prometheus_client parses it in pure Python,
    # about 2 s here. Before, that ran on the event loop at every poll: the gateway answered
    # nothing for 2 s or more of every poll interval.
    metrics = "a 1\n" * (MAX_POOL_BODY_BYTES // 4)
    assert len(metrics) == MAX_POOL_BODY_BYTES
    w = _watcher(metrics)
    gaps: list[float] = []
    done = False

    async def ticker() -> None:  # how late the loop runs a 10 ms timer, up to the poll's end
        last = time.monotonic()
        while True:
            await asyncio.sleep(0.01)
            now = time.monotonic()
            gaps.append(now - last)
            last = now
            if done:
                return

    tick = asyncio.create_task(ticker())
    await asyncio.sleep(0.05)
    t0 = time.monotonic()
    try:
        assert await w.poll_once() == LIMIT
    finally:
        done = True
        await tick
    took = time.monotonic() - t0
    assert w.signal_1() == SIGNAL_1_UNKNOWN  # no cache_config_info series: capacity unknown
    # in a thread it still holds the GIL between switches: the loop's timer runs late by up to
    # about 0.15 s here, not by the whole parse (2.7 s before)
    assert max(gaps) < 0.6, (max(gaps), took)


def test_the_capacity_is_read_from_its_own_lines_whatever_else_the_page_holds() -> None:
    """``vllm_capacity_from_metrics`` is what ``kvgate deploy-gate`` calls too: a line of another
    series that the parser fails on (``IndexError``) crashed it with a traceback instead of its
    exit 2 ("could not tell"). Only the gauge's own lines are parsed now: another series' bad line
    cannot hide the capacity, and a bad gauge line is capacity unknown."""
    good = vllm_cache_config_metrics([{"num_gpu_blocks": "256", "block_size": "16"}])
    other = 'vllm:num_requests_running{engine="0", ="x"} 1\n' + "a 1\n" * 1000
    assert vllm_capacity_from_metrics(other + good) == VLLMCapacity(4096, "num_gpu_blocks x block_size")
    assert vllm_capacity_from_metrics(good.replace('block_size="16"', 'block_size="16", ="x"')) is None
