"""``rediss+cluster://`` against a real TLS Redis Cluster: three ``redis-server --port 0
--tls-port P --tls-cluster yes --tls-replication yes --cluster-enabled yes`` masters on loopback
(the cluster bus and replication over TLS too), joined by ``redis-cli --tls --cluster create``,
with a certificate for 127.0.0.1 signed by a CA made in the test with ``openssl``. The quota stage
reserves, refuses and settles through the client :func:`config.redis_client.redis_client` makes
from the URL (docs/configuration.md, ``redis_url``); a client that trusts another CA is refused
with ``certificate verify failed`` and the stage fails closed (docs/quotas.md, "Store modes")."""

from __future__ import annotations

import asyncio
import logging
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from redis.cluster import ClusterNode, RedisCluster
from redis_servers import (
    REDIS_CLI,
    NoTls,
    TlsRedis,
    _kill,
    _server,
    free_ports,
    no_tls_reason,
    other_ca,
    started_tls,
    wait_until,
)

from config.errors import OpenAIError
from config.models import QuotaSettings, TenantConfig
from config.redis_client import redis_client
from gateway.quotas.stores import RedisQuotaStore
from gateway.quotas.tenant_quotas import TenantQuotas

pytestmark = pytest.mark.timeout(90)


class TlsCluster(TlsRedis):
    """Three TLS-only cluster masters sharing one certificate (``IP:127.0.0.1``)."""

    def __init__(self, workdir: Path) -> None:
        super().__init__(workdir)
        ports = free_ports(6)
        self.ports, self.bus_ports = ports[:3], ports[3:]
        self.procs: list = []

    @property
    def url(self) -> str:
        return "rediss+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports) + f"?ssl_ca_certs={self.ca}"

    def _tls_args(self) -> list[str]:
        d = self.workdir
        return ["--tls-cert-file", str(d / "server.pem"), "--tls-key-file", str(d / "server.key")] + [
            "--tls-ca-cert-file",
            str(self.ca),
            "--tls-auth-clients",
            "no",
        ]

    def start(self) -> None:
        self._certs()
        for p, bus in zip(self.ports, self.bus_ports, strict=True):
            d = self.workdir / f"node-{p}"
            d.mkdir()
            args = ["--port", "0", "--tls-port", str(p), "--cluster-port", str(bus), "--bind", "127.0.0.1"]
            args += ["--tls-cluster", "yes", "--tls-replication", "yes", "--dir", str(d), "--save", ""]
            args += ["--appendonly", "no", "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
            self.procs.append(_server(args + ["--cluster-node-timeout", "1000", *self._tls_args()], d / "redis.log"))
        for p, proc in zip(self.ports, self.procs, strict=True):
            log = self.workdir / f"node-{p}" / "redis.log"
            up = wait_until(lambda p=p, proc=proc: self._ping(p) or proc.poll() is not None, 15, 0.1)
            why = no_tls_reason(log)
            if why:
                raise NoTls(why)
            assert up and proc.poll() is None, f"TLS node {p} did not answer: {log.read_text()[-2000:]}"
        subprocess.run(
            [REDIS_CLI, "--tls", "--cacert", str(self.ca), "--cluster", "create"]
            + [f"127.0.0.1:{p}" for p in self.ports]
            + ["--cluster-replicas", "0", "--cluster-yes"],
            check=True,
            capture_output=True,
            timeout=60,
        )
        assert wait_until(self._ok, 30, 0.1), "TLS cluster not ok in 30 s"
        # every node agrees on the slot map only a moment after each says ok: a client's first
        # write before that is answered CLUSTERDOWN or moved in circles
        assert wait_until(self._writable, 30, 0.2), "TLS cluster not writable in 30 s"

    def _writable(self) -> bool:
        nodes = [ClusterNode("127.0.0.1", p) for p in self.ports]
        try:
            with RedisCluster(startup_nodes=nodes, ssl=True, ssl_ca_certs=str(self.ca), socket_timeout=2) as rc:
                return all(rc.set(f"ready:{{{i}}}", 1) for i in range(16))
        except (redis.RedisError, OSError):
            return False

    def _node(self, port: int) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=port, ssl=True, ssl_ca_certs=str(self.ca), socket_timeout=1)

    def _ping(self, port: int) -> bool:
        try:
            with self._node(port) as r:
                return bool(r.ping())
        except (redis.RedisError, OSError):
            return False

    def _ok(self) -> bool:
        try:
            return all(self._node(p).cluster("info")["cluster_state"] == "ok" for p in self.ports)
        except (redis.RedisError, OSError, KeyError):
            return False

    def close(self) -> None:
        for proc in self.procs:
            _kill(proc)


@pytest.fixture(scope="module")
def tls_cluster(tmp_path_factory) -> Iterator[TlsCluster]:
    yield from started_tls(lambda: TlsCluster(tmp_path_factory.mktemp("tls-cluster")))


#: a fresh cluster client's first call reads the slot map and makes a TLS connection to the node
#: of the tenant's slot (RSA handshakes) before its script: on 2 loaded cores that took longer than
#: the default 0.25 s bound, so the first reserve failed closed. The gateway's start connects first
#: (TenantQuotas.start, as the round below does); the longer bound covers a node still settling
COLD_START = QuotaSettings(redis_timeout_seconds=2.0)
TENANT = TenantConfig(id="tls-cluster-tenant", api_key_sha256=["0" * 64], rpm=3, tpm=100, max_concurrent=1)


def test_the_quota_stage_reserves_refuses_and_settles_on_a_tls_cluster(tls_cluster: TlsCluster) -> None:
    async def round_trip() -> list[object]:
        q = TenantQuotas(COLD_START, RedisQuotaStore(redis_client(tls_cluster.url, 3.0)))
        try:
            await q.start()
            first = await q.reserve(TENANT, 40, "r1")
            with pytest.raises(OpenAIError) as busy:  # the one concurrent slot is held
                await q.reserve(TENANT, 10, "r2")
            await q.settle(first, 5)  # the debit drops from 40 to 5 and the slot is free
            second = await q.reserve(TENANT, 90, "r3")  # 5 + 90 <= 100: only after the settle
            await q.settle(second, 90)
            h1, h2 = first.headers, second.headers
            return [busy.value.status, h1["x-ratelimit-remaining-tokens"], h2["x-ratelimit-remaining-tokens"]] + [
                h2["x-ratelimit-remaining-requests"]
            ]
        finally:
            await q.aclose()

    # r2's refusal spent no RPM: 3 - r1 - r3 leaves 1
    assert asyncio.run(round_trip()) == [429, "60", "5", "1"]
    # the tenant's keys are on the cluster, on the master that owns its hash slot
    nodes = [ClusterNode("127.0.0.1", p) for p in tls_cluster.ports]
    with RedisCluster(startup_nodes=nodes, ssl=True, ssl_ca_certs=str(tls_cluster.ca)) as rc:
        keys = rc.keys(target_nodes=RedisCluster.ALL_NODES)
    assert any(b"{" + TENANT.id.encode() + b"}" in k for k in keys), keys


def test_a_certificate_from_another_ca_is_refused_and_the_stage_fails_closed(
    tls_cluster: TlsCluster, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    url = tls_cluster.url.split("?")[0] + f"?ssl_ca_certs={other_ca(tmp_path)}"
    client = redis_client(url, 1.0, sync=True)
    with pytest.raises(redis.ConnectionError, match="certificate verify failed"):
        client.ping()
    client.close()

    async def refused() -> OpenAIError:
        q = TenantQuotas(QuotaSettings(), RedisQuotaStore(redis_client(url, 1.0)))
        try:
            with pytest.raises(OpenAIError) as e:
                await q.reserve(TENANT, 10, "r1")
            return e.value
        finally:
            await q.aclose()

    with caplog.at_level(logging.WARNING, logger="kvgate"):
        err = asyncio.run(refused())
    assert (err.status, err.code) == (503, "quota_backend_unavailable")
    assert "certificate verify failed" in caplog.text, caplog.text


def _cluster_counts(monitors: list[redis.Redis]) -> tuple[int, int]:
    """``(connections accepted, CLUSTER subcommands run)`` over the nodes, read through ``monitors``
    (connected already, so reading makes no connection and runs no CLUSTER command)."""
    conns = sum(int(m.info("stats")["total_connections_received"]) for m in monitors)
    stats = [m.info("commandstats") for m in monitors]
    return conns, sum(int(v["calls"]) for s in stats for k, v in s.items() if k.startswith("cmdstat_cluster"))


def test_after_start_the_first_decision_needs_no_connection_and_no_slot_map_read(tls_cluster: TlsCluster) -> None:
    """The start (``TenantQuotas.start``) reads the slot map and makes the TLS connections, within
    its own bound; the first reserve then runs under the default 0.25 s bound on those connections."""
    monitors = [tls_cluster._node(p) for p in tls_cluster.ports]
    tenant = TenantConfig(id="tls-cluster-warm", api_key_sha256=["0" * 64], rpm=3)

    async def first_decision() -> tuple[int, int]:
        settings = QuotaSettings()
        q = TenantQuotas(settings, RedisQuotaStore(redis_client(tls_cluster.url, settings.redis_timeout_seconds)))
        try:
            await q.start()
            before = _cluster_counts(monitors)
            await q.settle(await q.reserve(tenant, 1, "w1"), 1)
            after = _cluster_counts(monitors)
            return after[0] - before[0], after[1] - before[1]
        finally:
            await q.aclose()

    try:
        for m in monitors:
            m.ping()
        assert asyncio.run(first_decision()) == (0, 0)
    finally:
        for m in monitors:
            m.close()
