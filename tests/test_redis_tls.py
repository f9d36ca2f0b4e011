"""``rediss://`` against a real ``redis-server --tls-port`` whose certificate (for 127.0.0.1) is
signed by a CA made with ``openssl`` in the test's temp dir. The CA reaches the client through
the URL's ``ssl_ca_certs`` query parameter, for the quota store and the verifier's stores alike;
without it the server's certificate is not trusted, the connection fails, and the quota stage
fails closed."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from redis_servers import TlsRedis, started_tls

from config.errors import OpenAIError
from config.models import QuotaSettings, TenantConfig
from config.redis_client import redis_client
from gateway.quotas.stores import RedisQuotaStore
from gateway.quotas.tenant_quotas import TenantQuotas
from verifier.leak_index import RedisLeakStore

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def tls(tmp_path_factory) -> Iterator[TlsRedis]:
    yield from started_tls(lambda: TlsRedis(tmp_path_factory.mktemp("tls")))


def _tenant() -> TenantConfig:
    return TenantConfig(id="tls-tenant", api_key_sha256=["0" * 64], rpm=2)


def test_rediss_with_the_ca_in_the_url_shares_quotas_and_the_leak_index(tls: TlsRedis) -> None:
    url = f"rediss://127.0.0.1:{tls.port}/0?ssl_ca_certs={tls.ca}"

    async def quotas() -> list[str]:
        q = TenantQuotas(QuotaSettings(), RedisQuotaStore(redis_client(url, 0.5)))
        try:
            first = await q.reserve(_tenant(), 10, "r1")
            second = await q.reserve(_tenant(), 10, "r2")
            with pytest.raises(OpenAIError) as e:
                await q.reserve(_tenant(), 10, "r3")
            assert e.value.status == 429
            return [first.headers["x-ratelimit-remaining-requests"], second.headers["x-ratelimit-remaining-requests"]]
        finally:
            await q.aclose()

    assert asyncio.run(quotas()) == ["1", "0"]
    store = RedisLeakStore(redis_client(url, 0.5, sync=True), 60)
    store.add("tls-tenant", [1, 2, 3 << 60])
    assert store.owners([1, 3 << 60, 4]) == [{"tls-tenant"}, {"tls-tenant"}, set()]
    store.client.close()


def test_rediss_without_the_ca_fails_closed(tls: TlsRedis) -> None:
    async def refused() -> OpenAIError:
        q = TenantQuotas(QuotaSettings(), RedisQuotaStore(redis_client(f"rediss://127.0.0.1:{tls.port}/0", 0.5)))
        try:
            with pytest.raises(OpenAIError) as e:
                await q.reserve(_tenant(), 10, "r1")
            return e.value
        finally:
            await q.aclose()

    err = asyncio.run(refused())
    assert (err.status, err.code) == (503, "quota_backend_unavailable")
