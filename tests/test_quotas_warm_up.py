"""The quota stage connects at the gateway's start (``TenantQuotas.start``: the store's warm-up),
so the first decision finds a connected client; a Redis that is down or silent at start only logs
a warning, within the start-up bound, and requests then meet the failure policy as before."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import pytest
import redis
from gateway_harness import SECRETS, settings_for, tenants
from quota_fixtures import black_hole  # noqa: F401 (fixture)
from redis_servers import free_ports

from config.errors import OpenAIError
from config.models import QuotaSettings, Settings, TenantConfig
from gateway.app import Gateway
from gateway.quotas import tenant_quotas
from gateway.quotas.stores import load_script
from gateway.quotas.tenant_quotas import TenantQuotas, build_quota_stage
from tests.fixtures.redis_keys import REDIS_URL

pytestmark = pytest.mark.timeout(60)

TENANT = TenantConfig(id="warm-up-tenant", api_key_sha256=["0" * 64], rpm=100)


def _stage(url: str) -> TenantQuotas:
    settings = Settings(redis_url=url, quotas=QuotaSettings(window_seconds=60))
    stage = build_quota_stage(settings, key_prefix=f"kvgate-test-w-{uuid.uuid4().hex[:8]}")
    assert isinstance(stage, TenantQuotas)
    return stage


def _connections_named(monitor: redis.Redis, name: str) -> int:
    """The connections Redis has open now under the client name ``name`` (other tests' clients,
    or a server another test left running, may connect to the shared Redis meanwhile)."""
    return sum(c.get("name") == name for c in monitor.client_list())


def test_after_start_the_first_decision_makes_no_connection():
    monitor = redis.Redis.from_url(REDIS_URL)
    for script in ("reserve", "settle"):  # a Redis without them (another test flushed its scripts)
        monitor.script_load(load_script(script))  # would cost a connection to load them again

    async def first_decision(warm: bool) -> int:
        name = f"kvgate-warm-up-{uuid.uuid4().hex[:8]}"
        stage = _stage(f"{REDIS_URL}?client_name={name}")
        try:
            if warm:
                await stage.start()
            before = _connections_named(monitor, name)
            await stage.settle(await stage.reserve(TENANT, 1, "r1"), 1)
            return _connections_named(monitor, name) - before
        finally:
            await stage.aclose()

    try:
        assert asyncio.run(first_decision(warm=False)) == 1  # control: a cold client connects on the request path
        assert asyncio.run(first_decision(warm=True)) == 0
    finally:
        monitor.close()


def test_the_warm_up_leaves_the_clients_own_timeouts():
    async def timeouts() -> set[tuple[object, object]]:
        stage = _stage(REDIS_URL)
        try:
            await stage.start()
            pool = stage.store.client.connection_pool
            conns = [*pool._available_connections, *pool._in_use_connections]
            assert conns
            return {(c.socket_timeout, c.socket_connect_timeout) for c in conns} | {
                (pool.connection_kwargs["socket_timeout"], pool.connection_kwargs["socket_connect_timeout"])
            }
        finally:
            await stage.aclose()

    assert asyncio.run(timeouts()) == {(0.25, 0.25)}


def test_a_redis_down_at_start_only_logs_and_requests_fail_closed(caplog, black_hole, monkeypatch):  # noqa: F811
    monkeypatch.setattr(tenant_quotas, "WARM_UP_SECONDS", 0.5)
    refused = f"redis://127.0.0.1:{free_ports(1)[0]}/0"

    async def start_then_reserve(url: str) -> tuple[float, object]:
        stage = _stage(url)
        try:
            t0 = time.monotonic()
            await stage.start()
            took = time.monotonic() - t0
            with pytest.raises(OpenAIError) as e:
                await stage.reserve(TENANT, 1, "r1")
            return took, e.value.status
        finally:
            await stage.aclose()

    for url in (refused, f"redis://127.0.0.1:{black_hole.port}/0"):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="kvgate"):
            took, status = asyncio.run(start_then_reserve(url))
        assert took < 2.0 and status == 503
        assert "did not answer at start" in caplog.text, caplog.text


def test_the_gateway_starts_with_its_quota_store_down(monkeypatch):
    monkeypatch.setattr(tenant_quotas, "WARM_UP_SECONDS", 0.5)
    url = f"redis://127.0.0.1:{free_ports(1)[0]}/0"
    settings = settings_for([], quotas={"enabled": True}).model_copy(update={"redis_url": url})
    stage = build_quota_stage(settings)

    async def start_stop() -> None:
        gw = Gateway(settings, tenants(), stage, None, SECRETS)
        await gw.start()
        await gw.stop()

    asyncio.run(start_stop())
