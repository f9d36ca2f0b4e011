"""What the quota stage costs per request in each store mode, measured in process (no HTTP
noise): one ``reserve`` + one ``settle`` (what every request of a limited tenant runs),
sequentially (latency) and 64 at a time on one event loop (requests per second), for

- ``null``: quotas off (:class:`gateway.quotas.stage.NullQuotas`), the floor;
- ``memory``: limits kept in this process (no Redis URL; also what ``local_fallback`` runs);
- ``standalone``, ``sentinel``, ``cluster``: the Lua scripts on a Redis deployment this bench
  starts on loopback (one redis-server; a master, a replica and 3 sentinels; 3 masters and 3
  replicas), one round trip each; standalone also with 1 000 requests already in the window.

Prints p50 / p99 in ms, the p50 added over ``null`` and the rps rows; the target is under 0.5 ms
at p50 for a local Redis. Run: ``.venv/bin/python bench/quotas.py [--requests 3000] [--modes ...]``.
(The end-to-end view, the gateway under load with quotas on and off, is ``bench/gateway.py
--only gateway,quotas-redis,quotas-local``.)
"""

from __future__ import annotations

import os
import sys

# bench/ holds a tokenize.py that would shadow the standard library's (asyncio imports it): run
# with the repository root on the path instead of this folder.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

sys.path.insert(1, os.path.join(os.path.dirname(_HERE), "tests"))  # the loopback Redis servers of the tests

import argparse  # noqa: E402
import asyncio  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from config.errors import OpenAIError  # noqa: E402
from config.models import QuotaSettings, TenantConfig  # noqa: E402
from config.redis_client import redis_client  # noqa: E402
from gateway.quotas.stage import NullQuotas  # noqa: E402
from gateway.quotas.stores import LocalQuotaStore, RedisQuotaStore  # noqa: E402
from gateway.quotas.tenant_quotas import TenantQuotas  # noqa: E402

LIMITS = {"rpm": 10**9, "tpm": 10**12, "max_concurrent": 10**6}


async def measure(stage, tenant: TenantConfig, n: int) -> tuple[list[float], list[float]]:
    """``n`` sequential reserve + settle pairs; returns the seconds of each reserve (what a
    request waits for before it is forwarded) and of each reserve + settle (the settle runs after
    the response has been sent)."""
    reserve, both = [], []
    for i in range(n):
        t0 = time.perf_counter()
        lease = await stage.reserve(tenant, 300, f"r{i}")
        t1 = time.perf_counter()
        await stage.settle(lease, 250)
        reserve.append(t1 - t0)
        both.append(time.perf_counter() - t0)
    return reserve, both


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] * 1000


async def throughput(stage, tenants: list[TenantConfig], n: int, concurrency: int) -> tuple[float, int]:
    """Requests per second of ``n`` reserve + settle pairs, ``concurrency`` at a time on one event
    loop (one gateway worker's view), spread over ``tenants`` (on a cluster: over its slots), and
    how many were refused (a 503: the store did not answer within the deadline)."""
    todo = iter(range(n))
    refused = 0

    async def worker() -> None:
        nonlocal refused
        for i in todo:
            try:
                lease = await stage.reserve(tenants[i % len(tenants)], 300, f"t{i}")
            except OpenAIError:
                refused += 1
                continue
            await stage.settle(lease, 250)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return (n - refused) / (time.perf_counter() - t0), refused


async def redis_rows(name: str, url: str, args: argparse.Namespace) -> list[tuple[str, Any]]:
    """The sequential rows and the throughput of one Redis deployment at ``url``."""
    settings = QuotaSettings(redis_timeout_seconds=args.redis_timeout)
    prefix = f"kvgate-bench-q-{uuid.uuid4().hex[:8]}"
    client = redis_client(url, settings.redis_timeout_seconds)
    stage = TenantQuotas(settings, RedisQuotaStore(client, prefix=prefix))
    tenant = TenantConfig(id=f"bench-{uuid.uuid4().hex[:8]}", **LIMITS)
    tenants = [TenantConfig(id=f"bench-{i}-{uuid.uuid4().hex[:6]}", **LIMITS) for i in range(64)]
    try:
        await measure(stage, tenant, 200)  # warm-up: connections, script cache, slot map
        rows: list[tuple[str, Any]] = [(name, await measure(stage, tenant, args.requests))]
        if name == "standalone":
            await measure(stage, tenant, 1000)  # 1 000 requests in the tenant's window already
            rows.append((f"{name}, 1k in window", await measure(stage, tenant, args.requests)))
        rows.append((f"{name} rps", await throughput(stage, tenants, args.requests * 2, args.concurrency)))
        return rows
    finally:
        await stage.aclose()


def deployments(modes: list[str], workdir: Path, out: list[tuple[str, str, Any]]) -> None:
    """Append ``(mode, redis_url, server)`` to ``out`` for each Redis mode asked for, each
    started here on loopback (tests/redis_servers.py); the caller closes the servers in ``out``,
    also when one failed to start (this raises its error)."""
    import quota_fixtures
    import redis_servers

    kinds = {
        "standalone": quota_fixtures.SpareRedis,
        "sentinel": redis_servers.SentinelGroup,
        "cluster": redis_servers.LocalCluster,
    }
    for mode in modes:
        d = workdir / mode
        d.mkdir()
        server = kinds[mode](d)
        out.append((mode, server.url, server))
        server.start()


async def main_async(args: argparse.Namespace) -> int:
    settings = QuotaSettings()
    modes = [m for m in args.modes.split(",") if m]
    rows: list[tuple[str, Any]] = []
    tenant = TenantConfig(id=f"bench-{uuid.uuid4().hex[:8]}", **LIMITS)
    tenants = [TenantConfig(id=f"bench-{i}", **LIMITS) for i in range(64)]
    rows.append(("null", await measure(NullQuotas(), tenant, args.requests)))
    rows.append(("null rps", await throughput(NullQuotas(), tenants, args.requests * 2, args.concurrency)))
    local = LocalQuotaStore()
    memory = TenantQuotas(settings, local, fallback=local)
    rows.append(("memory", await measure(memory, tenant, args.requests)))
    rows.append(("memory rps", await throughput(memory, tenants, args.requests * 2, args.concurrency)))
    with tempfile.TemporaryDirectory(prefix="kvgate-bench-redis-") as tmp:
        servers: list[tuple[str, str, Any]] = []
        try:
            deployments([m for m in modes if m != "memory"], Path(tmp), servers)
            for mode, url, _ in servers:
                rows += await redis_rows(mode, url, args)
        finally:
            for _, _, server in servers:
                server.close()
    report(rows, args)
    return 0


def report(rows: list[tuple[str, Any]], args: argparse.Namespace) -> None:
    base_r = pct(rows[0][1][0], 0.5)
    print(
        f"{args.requests} sequential requests per row, ms (the reserve is on the request's path, the settle "
        f"runs after the response was sent); 'rps': {args.requests * 2} reserve + settle pairs, "
        f"{args.concurrency} at a time on one event loop, over 64 tenants"
    )
    head = (
        f"{'stage':<22} {'reserve p50':>11} {'reserve p99':>11} {'+p50 vs null':>12} "
        f"{'res+settle p50':>14} {'res+settle p99':>14}"
    )
    print(head)
    print("-" * len(head))
    for name, xs in rows:
        if isinstance(xs[0], float):
            rps, refused = xs
            note = f" ({refused} refused: no answer in time)" if refused else ""
            print(f"{name:<22} {rps:11.0f} requests/s{note}")
            continue
        r, b = xs
        print(
            f"{name:<22} {pct(r, 0.5):11.3f} {pct(r, 0.99):11.3f} {pct(r, 0.5) - base_r:12.3f} "
            f"{pct(b, 0.5):14.3f} {pct(b, 0.99):14.3f}"
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=3000, help="reserve + settle pairs per row (default 3000)")
    ap.add_argument(
        "--modes",
        default="memory,standalone,sentinel,cluster",
        help="store modes, comma-separated (default: all; each Redis deployment is started here on loopback)",
    )
    ap.add_argument("--concurrency", type=int, default=64, help="requests in flight for the rps rows (default 64)")
    ap.add_argument(
        "--redis-timeout",
        type=float,
        default=0.4,
        help="quotas.redis_timeout_seconds for the Redis rows (default 0.4: a loaded machine stalls the servers)",
    )
    return asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
