"""The one Redis client factory (``config.redis_client``): which client each ``redis_url`` scheme
makes, with which bounds, and the store back-off quotas and the verifier share. No server needed."""

from __future__ import annotations

import pytest
import redis
import redis.asyncio
import redis.asyncio.cluster
import redis.cluster

from config.redis_client import LazyCluster, StoreBackoff, by_slot, key_slot, parse_redis_url, redis_client


def test_each_scheme_makes_its_client_sync_and_asyncio() -> None:
    cases = {
        "redis://127.0.0.1:6379/2": (redis.Redis, redis.asyncio.Redis),
        "rediss://127.0.0.1:6380/0?ssl_ca_certs=/ca.pem": (redis.Redis, redis.asyncio.Redis),
        "unix:///run/redis.sock?db=1": (redis.Redis, redis.asyncio.Redis),
        "redis+sentinel://127.0.0.1:26379/mymaster": (redis.Redis, redis.asyncio.Redis),
        "redis+cluster://127.0.0.1:7000,127.0.0.1:7001": (LazyCluster, redis.asyncio.cluster.RedisCluster),
    }
    for url, (sync_cls, async_cls) in cases.items():
        assert type(redis_client(url, 0.25, sync=True)) is sync_cls, url
        assert type(redis_client(url, 0.25)) is async_cls, url


def test_every_connection_is_bounded_and_only_the_cluster_retries_once() -> None:
    r = redis_client("rediss://127.0.0.1:6380/0?ssl_ca_certs=/ca.pem", 0.25)
    kw = r.connection_pool.connection_kwargs
    assert (kw["socket_timeout"], kw["socket_connect_timeout"], kw["ssl_ca_certs"]) == (0.25, 0.25, "/ca.pem")
    assert r.get_retry().get_retries() == 0
    c = redis_client("rediss+cluster://u:p%40ss@10.0.0.1:7000,10.0.0.2?ssl_ca_certs=/ca.pem", 0.3)
    assert [(n.host, n.port) for n in c.nodes_manager.startup_nodes.values()] == [
        ("10.0.0.1", 7000),
        ("10.0.0.2", 6379),
    ]
    kw = c.nodes_manager.connection_kwargs
    assert (kw["socket_timeout"], kw["ssl_ca_certs"], kw["password"], kw["username"]) == (0.3, "/ca.pem", "p@ss", "u")
    assert c.retry.get_retries() == 1


def test_a_sync_cluster_client_is_made_on_first_use_and_fails_as_a_connection_error() -> None:
    from quota_fixtures import free_port

    from config.redis_client import is_cluster

    lazy = redis_client(f"redis+cluster://127.0.0.1:{free_port()}", 0.25, sync=True)
    assert is_cluster(lazy)
    script = lazy.register_script("return 1")  # no connection needed
    assert script.sha == "e0e1f9fabfc9d4800c877a703b823ac0578ff8db"
    with pytest.raises(redis.ConnectionError, match="Redis Cluster cannot be connected"):
        lazy.mget_nonatomic(["a"])


def test_sentinel_url_parts() -> None:
    t = parse_redis_url("rediss+sentinel://:pw@s1:26380,[::1],s3/svc/4?sentinel_password=sp&ssl_ca_certs=/ca.pem")
    assert (t.mode, t.tls, t.service, t.db, t.password) == ("sentinel", True, "svc", 4, "pw")
    assert t.hosts == (("s1", 26380), ("::1", 26379), ("s3", 26379))
    assert t.options == {"sentinel_password": "sp", "ssl_ca_certs": "/ca.pem"}


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("redis+sentinel://127.0.0.1:26379", "needs hosts and a service name"),
        ("redis+sentinel://127.0.0.1:x/m", "bad port in '127.0.0.1:x'"),
        ("redis+cluster:///", "cluster URL needs at least one node"),
        ("redis+cluster://127.0.0.1:7000/3", "Redis Cluster has only database 0"),
        ("memcached://127.0.0.1", "unknown scheme 'memcached://'"),
        # redis-py reads a path that is no number as database 0: a typo shared another deployment's
        ("redis://127.0.0.1:6379/abc", "'/abc' is not a database number"),
        ("redis://127.0.0.1:6379/1O", "'/1O' is not a database number"),
        ("redis://127.0.0.1:6379/10/x", "'/10/x' is not a database number"),
        ("redis+sentinel://127.0.0.1:26379/svc/x", "'/x' is not a database number"),
        # a traceback from redis-py at the first connection, after the settings had loaded
        ("redis://127.0.0.1:99999/0", "the port is not a number from 1 to 65535"),
        ("rediss://127.0.0.1:0/0", "the port is not a number from 1 to 65535"),
    ],
)
def test_malformed_urls_are_refused(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        redis_client(url, 0.25)


@pytest.mark.parametrize("url", ["redis://127.0.0.1:6379/3", "redis://127.0.0.1", "redis://h/", "unix:///r.sock?db=2"])
def test_well_formed_standalone_urls_pass(url: str) -> None:
    assert parse_redis_url(url).mode == "standalone"


def test_by_slot_groups_keys_of_one_tag() -> None:
    keys = ["k:{a}:1", "k:{b}:1", "k:{a}:2", "plain"]
    assert by_slot(keys) == [["k:{a}:1", "k:{a}:2"], ["k:{b}:1"], ["plain"]]
    assert key_slot("x:{a}:y") == key_slot("{a}") == 15495


def test_store_backoff_per_scope() -> None:
    now = [100.0]
    b = StoreBackoff(0.5, clock=lambda: now[0])
    assert b.usable(7) and not b.down
    assert b.failed(7) is True  # the first outage: logged
    assert b.failed(9) is False  # another slot while one is down: not logged again
    assert (b.usable(7), b.usable(9), b.usable(8)) == (False, False, True)  # other slots keep going
    now[0] += 0.5
    assert b.usable(7)  # retried after the interval
    assert b.succeeded(7) is False and b.down  # slot 9 is still down
    assert b.succeeded(9) is True and not b.down  # the last one back: logged
    b.failed()  # the whole store
    assert not b.usable(8)
    assert b.succeeded() is True and b.usable(8)


def test_a_malformed_redis_url_is_a_config_error() -> None:
    from pydantic import ValidationError

    from config.models import Settings

    assert Settings(redis_url="redis+cluster://10.0.0.1:7000,10.0.0.2:7000").redis_url
    with pytest.raises(ValidationError, match="unknown scheme 'redis-cluster://'"):
        Settings(redis_url="redis-cluster://10.0.0.1:7000")


def test_a_cluster_no_node_of_which_answers_fails_closed_within_1s() -> None:
    import asyncio
    import time

    from quota_fixtures import free_port

    from config.errors import OpenAIError
    from config.models import QuotaSettings, TenantConfig
    from gateway.quotas.stores import RedisQuotaStore
    from gateway.quotas.tenant_quotas import TenantQuotas

    url = f"redis+cluster://127.0.0.1:{free_port()},127.0.0.1:{free_port()}"

    async def run() -> tuple[int, str | None, float]:
        q = TenantQuotas(QuotaSettings(), RedisQuotaStore(redis_client(url, 0.25)))
        t0 = time.monotonic()
        try:
            await q.reserve(TenantConfig(id="t", rpm=5), 1, "r1")
        except OpenAIError as e:
            return e.status, e.code, time.monotonic() - t0
        finally:
            await q.aclose()
        raise AssertionError("admitted without a store")

    status, code, seconds = asyncio.run(run())
    assert (status, code) == (503, "quota_backend_unavailable")
    assert seconds < 1.0


def test_a_failed_slot_costs_only_its_tenants_and_never_delays_another() -> None:
    """A store whose part holding tenant ``down`` fails (reserve refused, cancel hangs), as a
    Cluster master does: tenant ``up`` is decided by the store at once, without waiting on the
    undoing of ``down``'s uncertain reservation, and ``down`` follows the policy."""
    import asyncio
    import time

    from config.errors import OpenAIError
    from config.models import QuotaSettings, TenantConfig
    from gateway.quotas.stores import QuotaDecision, QuotaStoreUnavailable
    from gateway.quotas.tenant_quotas import TenantQuotas

    class SlottedStore:
        name = "redis"

        def __init__(self) -> None:
            self.reserved: list[str] = []

        def scope(self, tenant_id: str) -> str:
            return tenant_id

        async def reserve(self, tenant_id: str, *args, **kwargs) -> QuotaDecision:
            if tenant_id == "down":
                raise QuotaStoreUnavailable("redis: ConnectionError: refused")
            self.reserved.append(tenant_id)
            return QuotaDecision(True, (), 0, 4, -1)

        async def settle(self, *args) -> None:
            return None

        async def renew(self, tenant_id: str, lease_ids: list[str], ttl_ms: int) -> int:
            return len(lease_ids)

        async def cancel(self, tenant_id: str, lease_ids: list[str], *, keep_rpm: bool = False) -> int:
            await asyncio.sleep(10 if tenant_id == "down" else 0)
            return 0

        async def aclose(self) -> None:
            return None

    async def run() -> tuple[float, int, list[str]]:
        store = SlottedStore()
        q = TenantQuotas(QuotaSettings(redis_timeout_seconds=0.25), store)  # type: ignore[arg-type]
        with pytest.raises(OpenAIError) as down:
            await q.reserve(TenantConfig(id="down", rpm=5), 1, "r1")
        t0 = time.monotonic()
        await q.reserve(TenantConfig(id="up", rpm=5), 1, "r2")
        up_seconds = time.monotonic() - t0
        await q.aclose()
        return up_seconds, down.value.status, store.reserved

    up_seconds, down_status, reserved = asyncio.run(run())
    assert (down_status, reserved) == (503, ["up"])
    assert up_seconds < 0.2, up_seconds  # the deadline (0.55 s) never ran out on up's path
