"""Helpers for the gateway tests: settings for mock engines, and a gateway app served by uvicorn
in a thread on a free loopback port."""

from __future__ import annotations

import socket
import time
from typing import Any

import httpx

from config.models import Settings, TenantsFile
from gateway.app import create_app
from gateway.edge.protocol import EdgeLimits, configure
from gateway.ops.tenants import TenantRegistry, hash_key
from tests.mock_engine import MockEngine, ServerThread

KEY_A = "sk-test-tenant-a"
KEY_B = "sk-test-tenant-b"
SECRETS = {"cache_salt_key": b"test-cache-salt-key", "leak_index_key": b"l", "admin_key": b"a"}
MODEL = "kvgate-tiny"


#: bound, never-listening sockets kept for the life of the test process: a connect to their port
#: is refused, and no other process can take the port meanwhile (a port closed before the connect
#: can be, and then it may accept and answer nothing: CI once saw a read timeout there)
_REFUSING: list[socket.socket] = []


def refused_port() -> int:
    """A loopback port where every connection is refused for as long as the tests run."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    _REFUSING.append(s)
    return int(s.getsockname()[1])


def closed_port_url() -> str:
    """A loopback URL where nothing listens (connection refused)."""
    return f"http://127.0.0.1:{refused_port()}"


def upstream(
    name: str,
    engine: MockEngine | None = None,
    *,
    api_url: str | None = None,
    pool_urls: list[str] | None = None,
    **kw: Any,
) -> dict[str, Any]:
    """An upstream entry for ``engine`` (its API and server_info), overridable."""
    return {
        "name": name,
        "api_url": api_url or engine.api_url,
        "pool_source": kw.pop("pool_source", "sglang"),
        "pool_urls": pool_urls if pool_urls is not None else [engine.info_url],
        "models": [MODEL],
        **kw,
    }


def settings_for(
    upstreams: list[dict[str, Any]],
    *,
    gateway: dict | None = None,
    pool: dict | None = None,
    context_length: int = 8192,
    aliases: list[str] | None = None,
    models: list[dict[str, Any]] | None = None,
    verifier: dict | None = None,
    quotas: dict | None = None,
) -> Settings:
    """Settings with model :data:`MODEL` (bundled tokenizer) and ``models`` after it, and the given
    upstream entries; ``gateway``, ``pool``, ``verifier``, ``quotas``: those sections' fields
    (the verifier and quotas are off unless named)."""
    return Settings.model_validate(
        {
            "gateway": {
                "max_body_bytes": 4096,
                "connect_timeout_seconds": 1,
                "read_timeout_seconds": 5,
                **(gateway or {}),
            },
            "pool": {
                "poll_interval_seconds": 0.2,
                "max_staleness_seconds": 5,
                "request_timeout_seconds": 0.5,
                **(pool or {}),
            },
            "models": [
                {"id": MODEL, "aliases": aliases or ["tiny-alias"], "context_length": context_length},
                *(models or []),
            ],
            "upstreams": upstreams,
            "verifier": verifier or {"enabled": False},
            "quotas": quotas or {"enabled": False},
        }
    )


def tenants(**a_overrides: Any) -> TenantRegistry:
    """Tenant ``a`` (key :data:`KEY_A`, overridable limits) and tenant ``b`` (key :data:`KEY_B`,
    no models allowed but an unknown one)."""
    return TenantRegistry(
        TenantsFile.model_validate(
            {
                "tenants": [
                    {
                        "id": "tenant-a",
                        "api_key_sha256": [hash_key(KEY_A)],
                        "default_max_tokens": 16,
                        "max_tokens_cap": 4096,
                        "allowed_models": [MODEL],
                        **a_overrides,
                    },
                    {"id": "tenant-b", "api_key_sha256": [hash_key(KEY_B)], "allowed_models": ["other-model"]},
                ]
            }
        )
    )


class Gateway(ServerThread):
    """A gateway app on a free port; ``client(key)`` gives an ``httpx.Client`` for it. ``edge``:
    served by ``kvgate serve``'s own server layer (:mod:`gateway.edge.protocol`, its limits from
    ``settings.gateway``) instead of uvicorn's stock protocol."""

    def __init__(
        self, settings: Settings, registry: TenantRegistry | None = None, *, edge: bool = False, **kw: Any
    ) -> None:
        self.app = create_app(settings, registry or tenants(), secrets=SECRETS, **kw)
        self.gw = self.app.state.gateway
        limits = EdgeLimits.from_settings(settings.gateway)
        super().__init__(self.app, (lambda config: configure(config, limits)) if edge else None)

    def client(self, key: str | None = KEY_A, **kw: Any) -> httpx.Client:
        headers = {"authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=kw.pop("timeout", 10), **kw)


def wait_for(pred, timeout: float = 5.0, interval: float = 0.02) -> bool:
    """Poll ``pred()`` until true or ``timeout`` seconds; returns its last value."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v or time.monotonic() > deadline:
            return v
        time.sleep(interval)


def chat(content: str = "Say hello.", **kw: Any) -> dict[str, Any]:
    """A chat request body (11 prompt tokens for the default content with the bundled tokenizer)."""
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **kw}
