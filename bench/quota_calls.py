"""CPU per request of the quota stage's Redis calls, in one process: what one admitted request of
a limited tenant runs (``begin``, ``reserve_tokens``, a raw index write riding the store's round
trip via ``send_writes``, ``settle``), ``--concurrency`` requests at a time on one uvloop event
loop, against ``--redis-url`` (keys under ``kvgate-bench-cpu:``). Prints one JSON line:
``cpu_us`` (``time.process_time`` per request), ``wall_us``, ``rt_per_call`` (round trips per
script call: coalescing). Compare two checkouts by running it with ``PYTHONPATH`` set to each,
interleaved, and taking medians (docs/performance.md, "Gateway: the hot path outside the verifier").

Run: ``PYTHONPATH=. .venv/bin/python bench/quota_calls.py [--requests 3200] [--concurrency 32]``.
"""

from __future__ import annotations

import os
import sys

if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)

import argparse
import asyncio
import json
import time
import uuid
from typing import Any

from config.models import QuotaSettings, TenantConfig
from gateway.quotas.stores import RedisQuotaStore
from gateway.quotas.tenant_quotas import TenantQuotas, redis_client_from_url

PREFIX = "kvgate-bench-cpu"


class Write:
    """A stand-in for the verifier's pending index write: one raw Lua call."""

    def __init__(self, sha: str, key: str) -> None:
        self.calls: list[tuple[str, list[str], list[Any]]] = [(sha, [key], ["x"])]

    def guarded(self, key: str, field: str) -> list[tuple[str, list[str], list[Any]]]:
        return self.calls  # the stand-in writes unguarded: the round trip's shape is what is measured

    def sent(self, outcome: Any) -> None:
        return None

    def discard(self) -> None:
        return None

    async def finish(self) -> None:
        return None


async def run(url: str, requests: int, concurrency: int, one_step: bool = False) -> dict[str, float]:
    client = redis_client_from_url(url, 0.5)
    store = RedisQuotaStore(client, prefix=f"{PREFIX}:q")
    quotas = TenantQuotas(QuotaSettings(), store, processes=2)
    await quotas.start()
    sha = await client.script_load("redis.call('SET', KEYS[1], ARGV[1], 'PX', 5000) return 1")
    big = 10**9
    tenant = TenantConfig(
        id="b-" + uuid.uuid4().hex[:6], api_key_sha256=["0" * 64], rpm=big, tpm=big * 1000, max_concurrent=big
    )

    async def one(i: int) -> None:
        if one_step:  # a small body already in: begin, tokens and the guarded write in one round trip
            lease = await quotas.begin_reserve(tenant, "r", 216, also=Write(sha, f"{PREFIX}:w:{i % 50}"))
        else:
            lease = await quotas.begin(tenant, "r")
            await quotas.reserve_tokens(tenant, lease, 216)
            await quotas.send_writes(Write(sha, f"{PREFIX}:w:{i % 50}"))
        await asyncio.sleep(0)  # the relay in between
        # the response has gone before its settle, as in the gateway (gateway.relay.response): the
        # next request does not wait for it
        settles.add(task := asyncio.ensure_future(quotas.settle(lease, 232)))
        task.add_done_callback(settles.discard)

    settles: set[asyncio.Future[None]] = set()

    async def worker(k: int, count: int) -> None:
        for i in range(count):
            await one(k * 100_000 + i)
        while settles:
            await asyncio.gather(*settles)

    await asyncio.gather(*(worker(k, 50) for k in range(concurrency)))  # warm: connections, scripts
    store.calls = store.round_trips = 0
    per = requests // concurrency
    c0, w0 = time.process_time(), time.perf_counter()
    await asyncio.gather(*(worker(k, per) for k in range(concurrency)))
    c1, w1 = time.process_time(), time.perf_counter()
    await quotas.aclose()
    n = per * concurrency
    return {
        "cpu_us": (c1 - c0) / n * 1e6,
        "wall_us": (w1 - w0) / n * 1e6,
        "rt_per_call": store.round_trips / max(1, store.calls),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--redis-url", default=os.environ.get("KVGATE_BENCH_REDIS_URL", "redis://127.0.0.1:6379/0"))
    ap.add_argument("--requests", type=int, default=3200)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--one-step", action="store_true", help="begin_reserve (the path of a small body already in)")
    args = ap.parse_args()
    import uvloop

    print(json.dumps(uvloop.run(run(args.redis_url, args.requests, args.concurrency, args.one_step))))


if __name__ == "__main__":
    main()
