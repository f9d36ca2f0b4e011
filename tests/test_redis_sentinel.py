"""A Sentinel group (1 master, 1 replica, 3 sentinels: real ``redis-server`` processes on
loopback) behind 3 gateway replicas x 2 workers, ``redis_url: redis+sentinel://...``, policy
``local_fallback`` (``quotas.replicas: 3``): the limits stay exact, the verifier finds a
cross-tenant leak, and killing the master costs no request: while the sentinels promote the
replica every process decides by its own share (``limit // 6``, visible in the rate-limit
header) within 1 s, then Redis decides again by itself, and no lease outlives its TTL.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import redis_modes as rm
from redis_servers import SentinelGroup

pytestmark = pytest.mark.timeout(180)

FAILOVER = {"failover": {"rpm": 600}}  # no max_concurrent: 2 // 6 processes would be 0 while local


@pytest.fixture(scope="module")
def group(tmp_path_factory) -> Iterator[SentinelGroup]:
    """The group's ports; the gateways' fixture starts it while they start."""
    g = SentinelGroup(tmp_path_factory.mktemp("sentinel"))
    try:
        yield g
    finally:
        g.close()


@pytest.fixture(scope="module")
def dep(group: SentinelGroup, tmp_path_factory) -> Iterator[rm.Deployment]:
    yield from rm.deploy(
        tmp_path_factory.mktemp("sentinel-gw"),
        group.url,
        FAILOVER,
        group.start,
        redis_failure_policy="local_fallback",
        replicas=3,
    )


def test_rpm_is_exact_across_replicas(dep: rm.Deployment) -> None:
    rm.check_rpm(dep)


def test_tpm_is_exact_across_replicas(dep: rm.Deployment) -> None:
    rm.check_tpm(dep)


def test_concurrency_is_exact_across_replicas(dep: rm.Deployment) -> None:
    rm.check_concurrency(dep)


def test_a_cross_tenant_leak_is_found(dep: rm.Deployment) -> None:
    rm.check_leak(dep, dep.workdir / "kvgate.yaml")


def test_killing_the_master_falls_back_locally_then_recovers(dep: rm.Deployment, group: SentinelGroup) -> None:
    key = dep.keys["failover"]
    rm.reset(dep.engine)
    assert {rm.post(g, key).headers["x-ratelimit-limit-requests"] for g in dep.gateways} == {"600"}
    pool, held = rm.hold_two(dep, dep.keys["conc2"], 2.0)  # two leases in the master that dies
    victim = group.master()
    t0 = time.monotonic()
    group.kill(victim)
    probes, recovered, _ = rm.probe_until_recovered(dep, key, t0, lambda p: p.limit == "600")
    pool.shutdown(wait=True)
    local = [p for p in probes if p.limit != "600"]
    print(f"\nsentinel failover: {len(local)} of {len(probes)} answers by local shares, recovered {recovered:.2f}s")
    assert local, "the outage was never seen"
    assert {(p.status, p.limit) for p in local} == {(200, "100")}, local  # 600 // (3 replicas x 2 workers)
    assert {p.status for p in probes} == {200}  # local_fallback: no request refused for the outage
    assert max(p.seconds for p in probes) < 1.0, max(probes, key=lambda p: p.seconds)
    assert [f.result().status_code for f in held] == [200, 200]
    freed, tries = rm.check_no_lease_stranded(dep, dep.keys["conc2"], recovered, t0)
    print(f"sentinel failover: both concurrency slots free {freed:.2f}s after the kill ({tries} tries)")
    assert group.master() != victim
