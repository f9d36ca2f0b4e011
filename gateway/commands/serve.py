"""``kvgate serve``: run the gateway (default 127.0.0.1:8080, from ``gateway.host``/``port``).

Refuses to start while ``tenants.yaml`` accepts one of the documented demo keys (``sk-demo-a``,
``sk-demo-b``) unless started with ``--demo`` (DESIGN.md, Contracts).
"""

from __future__ import annotations

import argparse
import sys

DEMO_KEYS = ("sk-demo-a", "sk-demo-b")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, help="kvgate.yaml (default: KVGATE_CONFIG or the embedded stack's)")
    parser.add_argument(
        "--tenants", default=None, help="tenants.yaml (default: KVGATE_TENANTS or the embedded stack's)"
    )
    parser.add_argument("--host", default=None, help="bind address (default: gateway.host)")
    parser.add_argument("--port", type=int, default=None, help="port (default: gateway.port, 8080)")
    parser.add_argument("--demo", action="store_true", help="allow the documented demo keys sk-demo-a/sk-demo-b")
    parser.add_argument("--log-level", default=None, choices=["debug", "info", "warning", "error"])


def demo_tenants(registry) -> list[str]:
    """Ids of tenants that accept a documented demo key."""
    out = []
    for key in DEMO_KEYS:
        t = registry.lookup(key)
        if t is not None and t.id not in out:
            out.append(t.id)
    return out


def build_stages(settings, secrets):
    """The quota and verifier stages ``settings`` ask for: ``gateway.quotas.build_quota_stage``
    (``NullQuotas`` when ``quotas.enabled`` is false) and ``verifier.from_settings`` (``None``,
    i.e. ``NullVerifier``, when ``verifier.enabled`` is false)."""
    from gateway.quotas import build_quota_stage

    quotas = build_quota_stage(settings)
    verifier = None
    if settings.verifier.enabled:
        import verifier as vmod

        verifier = vmod.from_settings(settings, secrets)
    return quotas, verifier


def run(args: argparse.Namespace) -> int:
    from config.loader import ConfigError, load_settings
    from config.secrets import load_secrets
    from gateway.logging import setup_logging
    from gateway.tenants import TenantRegistry

    try:
        settings = load_settings(args.config)
        registry = TenantRegistry.from_path(args.tenants, settings)
    except ConfigError as e:
        print(f"kvgate serve: {e}", file=sys.stderr)
        return 2
    demo = demo_tenants(registry)
    if demo and not args.demo:
        print(
            f"kvgate serve: tenant(s) {', '.join(demo)} accept a documented demo key (sk-demo-a/sk-demo-b); "
            "anyone could use them. Rotate the keys (kvgate tenant ...) or start with --demo for a "
            "local demo.",
            file=sys.stderr,
        )
        return 2
    setup_logging(args.log_level or settings.gateway.log_level)
    secrets = load_secrets(settings.state_dir)
    quotas, verifier = build_stages(settings, secrets)
    from gateway.app import create_app
    from gateway.server import run_server

    app = create_app(settings, registry, quotas=quotas, verifier=verifier, secrets=secrets)
    from gateway.tenant_reload import TenantFileWatcher

    watcher = TenantFileWatcher(registry).start()  # tenant edits apply without a restart
    watcher.install_sighup()
    host = args.host or settings.gateway.host
    port = args.port if args.port is not None else settings.gateway.port
    return run_server(
        app,
        host,
        port,
        drain_timeout_seconds=settings.gateway.drain_timeout_seconds,
        log_level=args.log_level or settings.gateway.log_level,
    )
