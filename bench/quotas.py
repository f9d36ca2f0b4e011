"""What the quota stage costs per request, measured in process (no HTTP noise): one
``reserve`` + one ``settle`` (what every request of a limited tenant runs), sequentially, for

- ``null``: quotas off (:class:`gateway.stages.NullQuotas`), the floor;
- ``local``: limits kept in this process (no Redis URL);
- ``redis``: the Lua scripts on Redis (``--redis-url``, default ``redis://127.0.0.1:6379/0``),
  one round trip each, and the same with 1 000 other requests already in the tenant's window.

Prints p50 / p99 in ms and the p50 added over ``null``; the target is under 0.5 ms at p50 for
``redis`` on a local Redis. Run: ``.venv/bin/python bench/quotas.py [--requests 3000]``.
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

import argparse  # noqa: E402
import asyncio  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402

from config.models import QuotaSettings, TenantConfig  # noqa: E402
from gateway.quota_stores import LocalQuotaStore, RedisQuotaStore  # noqa: E402
from gateway.quotas import TenantQuotas, redis_client_from_url  # noqa: E402
from gateway.stages import NullQuotas  # noqa: E402

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


async def main_async(args: argparse.Namespace) -> int:
    settings = QuotaSettings()
    rows: list[tuple[str, tuple[list[float], list[float]] | str]] = []
    tenant = TenantConfig(id=f"bench-{uuid.uuid4().hex[:8]}", **LIMITS)
    rows.append(("null", await measure(NullQuotas(), tenant, args.requests)))
    local = LocalQuotaStore()
    rows.append(("local", await measure(TenantQuotas(settings, local, fallback=local), tenant, args.requests)))
    prefix = f"kvgate-bench-q-{uuid.uuid4().hex[:8]}"
    client = redis_client_from_url(args.redis_url, settings.redis_timeout_seconds)
    stage = TenantQuotas(settings, RedisQuotaStore(client, prefix=prefix))
    try:
        await client.ping()
    except Exception as e:  # noqa: BLE001 - any failure means "no Redis here"
        rows.append(("redis", f"skipped: {args.redis_url} does not answer ({type(e).__name__})"))
    else:
        await measure(stage, tenant, 200)  # warm-up: connection, script cache
        fresh = TenantConfig(id=f"bench-{uuid.uuid4().hex[:8]}", **LIMITS)
        rows.append(("redis", await measure(stage, fresh, args.requests)))
        await measure(stage, tenant, 1000)  # 1 000 requests in tenant's window already
        rows.append(("redis, 1k in window", await measure(stage, tenant, args.requests)))
        keys = [k async for k in client.scan_iter(match=f"{prefix}:*")]
        if keys:
            await client.delete(*keys)
    await stage.aclose()
    base_r, base_b = (pct(xs, 0.5) for xs in rows[0][1])  # type: ignore[union-attr]
    print(
        f"{args.requests} sequential requests per row, ms; the reserve is on the request's path, "
        "the settle runs after the response was sent"
    )
    head = (
        f"{'stage':<22} {'reserve p50':>11} {'reserve p99':>11} {'+p50 vs null':>12} "
        f"{'res+settle p50':>14} {'res+settle p99':>14}"
    )
    print(head)
    print("-" * len(head))
    for name, xs in rows:
        if isinstance(xs, str):
            print(f"{name:<22} {xs}")
            continue
        r, b = xs
        print(
            f"{name:<22} {pct(r, 0.5):11.3f} {pct(r, 0.99):11.3f} {pct(r, 0.5) - base_r:12.3f} "
            f"{pct(b, 0.5):14.3f} {pct(b, 0.99):14.3f}"
        )
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=3000, help="reserve + settle pairs per row (default 3000)")
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    return asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
