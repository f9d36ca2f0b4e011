"""Redis Cluster (3 masters, 3 replicas, real ``redis-server --cluster-enabled yes`` on loopback)
behind 3 gateway replicas x 2 workers (``kvgate serve --workers 2``), ``redis_url:
redis+cluster://...``, policy ``fail_closed``: the limits stay exact, the leak index finds a
cross-tenant leak with its fingerprints spread over the slots, and killing the master that owns
a tenant's slot costs that tenant 503s (each decided within 1 s) until a replica is promoted,
tenants on other masters nothing, and no lease outlives its TTL.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis_modes as rm
from redis_servers import LocalCluster

from config.redis_client import key_slot

pytestmark = pytest.mark.timeout(180)


#: the slot ranges ``redis-cli --cluster create`` gives its three masters
RANGES = ((0, 5460), (5461, 10922), (10923, 16383))


def _range_of(tenant_id: str) -> int:
    slot = key_slot("{" + tenant_id + "}")
    return next(i for i, (lo, hi) in enumerate(RANGES) if lo <= slot <= hi)


#: the failover tenant and one whose keys (hash tag ``{id}``) live on another master
FAILOVER = "failover"
CALM = next(f"calm{i}" for i in range(100) if _range_of(f"calm{i}") != _range_of(FAILOVER))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[LocalCluster]:
    """Six nodes launched; the gateways' fixture forms the cluster while they start."""
    c = LocalCluster(tmp_path_factory.mktemp("cluster"))
    try:
        c.launch()
        yield c
    finally:
        c.close()


@pytest.fixture(scope="module")
def dep(cluster: LocalCluster, tmp_path_factory) -> Iterator[rm.Deployment]:
    extra = {FAILOVER: {"rpm": 10**6, "max_concurrent": 2}, CALM: {"rpm": 10**6}}
    yield from rm.deploy(
        tmp_path_factory.mktemp("cluster-gw"), cluster.url, extra, cluster.form, redis_failure_policy="fail_closed"
    )


class Fake:  # only register_script is called by the stores' constructors
    def register_script(self, text: str) -> object:
        return type("S", (), {"sha": "0" * 40, "script": text})()


def test_quota_keys_of_a_tenant_share_one_slot_and_leak_keys_spread() -> None:
    from gateway.quotas.stores import RedisQuotaStore
    from verifier.leak_index import RedisLeakStore, RedisSpreadStore

    qkeys = RedisQuotaStore(Fake()).keys("acme")
    assert {key_slot(k) for k in qkeys} == {key_slot("{acme}")}
    store = RedisLeakStore(Fake(), 60)
    assert store._key(0xABCDEF0123456789) == "kvgate:leak:{2a}:fp:abcdef0123456789"
    assert len({key_slot(store._key(b << 58)) for b in range(64)}) == 64
    spread = RedisSpreadStore(Fake(), 60)
    assert spread._key(0xABCDEF0123456789) == "kvgate:spread:{2a}:fp:abcdef0123456789"


def test_rpm_is_exact_across_replicas(dep: rm.Deployment) -> None:
    rm.check_rpm(dep)


def test_tpm_is_exact_across_replicas(dep: rm.Deployment) -> None:
    rm.check_tpm(dep)


def test_concurrency_is_exact_across_replicas(dep: rm.Deployment) -> None:
    rm.check_concurrency(dep)


def test_a_cross_tenant_leak_is_found_across_slots(dep: rm.Deployment, cluster: LocalCluster) -> None:
    rm.check_leak(dep, dep.workdir / "kvgate.yaml")
    # the index really is spread: its 64 slot tags map onto every master, and the keys this leak
    # wrote sit on more than one (how many land on each depends on the prompts' fingerprints)
    from verifier.leak_index import RedisLeakStore

    store = RedisLeakStore(Fake(), 60)
    with cluster.client() as c:
        owners = {c.nodes_manager.get_node_from_slot(key_slot(store._key(b << 58))).name for b in range(64)}
        per_node = [c.execute_command("DBSIZE", target_nodes=n) for n in c.get_primaries()]
    assert len(owners) == 3
    assert len(per_node) == 3 and sum(n > 0 for n in per_node) >= 2, per_node


def test_leak_owners_awaited_on_the_cluster_are_the_sync_lookup_s(dep: rm.Deployment, cluster: LocalCluster) -> None:
    """The worker's awaited lookup (``aowners``, the asyncio cluster client's ``MGET`` split by
    slot) answers what the synchronous one does, for fingerprints on all three masters: an
    owner, the public marker, and none."""
    import asyncio
    import uuid

    from config.redis_client import redis_client
    from verifier.leak_index import PUBLIC, RedisLeakStore

    aclient = redis_client(cluster.url, 1.0)
    store = RedisLeakStore(
        redis_client(cluster.url, 1.0, sync=True), 60, f"kvgate-test-{uuid.uuid4().hex[:8]}:", aclient=aclient
    )
    fps = [(b << 58) | i for b in range(64) for i in (1, 2, 3)]
    store.add("x", fps[0::3] + fps[1::3])
    store.add("y", fps[1::3])  # a second tenant: public
    sync = store.owners(fps)
    assert sync == [{"x"}, {PUBLIC, PUBLIC * 2}, set()] * 64

    async def awaited() -> list[set[str]]:
        try:
            return await store.aowners(fps)
        finally:
            await aclient.aclose()

    assert asyncio.run(awaited()) == sync


def test_killing_the_tenants_master_fails_closed_then_recovers(dep: rm.Deployment, cluster: LocalCluster) -> None:
    failover, calm = FAILOVER, CALM
    assert cluster.master_of("{" + failover + "}") != cluster.master_of("{" + calm + "}")
    key = dep.keys[failover]
    rm.reset(dep.engine)
    assert all(rm.post(g, key).status_code == 200 for g in dep.gateways)
    pool, held = rm.hold_two(dep, key, 2.0)  # two leases in the master that dies
    victim = cluster.master_of("{" + failover + "}")
    t0 = time.monotonic()
    cluster.kill(victim)
    probes, recovered, calm_probes = rm.probe_until_recovered(
        dep, key, t0, lambda p: p.status == 200, side_key=dep.keys[calm]
    )
    pool.shutdown(wait=True)
    down = [p for p in probes if p.status != 200]
    print(f"\ncluster failover: {len(down)} of {len(probes)} answers 503, recovered {recovered:.2f}s after the kill")
    assert down, "the outage was never seen"
    assert {(p.status, p.code) for p in down} == {(503, "quota_backend_unavailable")}, down
    assert max(p.seconds for p in probes) < 1.0, max(probes, key=lambda p: p.seconds)
    assert {p.status for p in calm_probes} == {200}, calm_probes  # another master's tenants never noticed
    assert [f.result().status_code for f in held] == [200, 200]  # admitted before: they ran
    freed, tries = rm.check_no_lease_stranded(dep, key, recovered, t0)
    print(f"cluster failover: both concurrency slots free {freed:.2f}s after the kill ({tries} tries)")
    assert cluster.master_of("{" + failover + "}") != victim


def test_the_upstream_cli_reads_the_cluster(dep: rm.Deployment) -> None:
    from gateway.cli import main as cli_main

    assert cli_main(["upstream", "--config", str(Path(dep.workdir) / "kvgate.yaml"), "list"]) == 0
