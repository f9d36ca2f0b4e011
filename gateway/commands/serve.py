"""``kvgate serve``: run the gateway (default 127.0.0.1:8080, from ``gateway.host``/``port``).

Refuses to start while ``tenants.yaml`` accepts one of the documented demo keys (``sk-demo-a``,
``sk-demo-b``) unless started with ``--demo`` (docs/design.md, Contracts), and while the secrets file or
its state directory is open to other users (group or world bits; the message says the ``chmod``
to run) unless started with ``--allow-open-secrets``, which logs a warning instead.
``--init-tenant NAME`` creates a missing tenants file with one tenant and a generated key (the
docker-compose stack starts this way, so it never ships a documented key). A secret from
the environment shorter than 16 bytes is refused too (exit status 2 for all of these).

``--workers N`` (``gateway.workers``; default: the usable cores when ``redis_url`` is set, else 1):
with N > 1 this process supervises N worker processes on the one port (:mod:`gateway.edge.workers`);
each worker is this command again with ``--worker-index I``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import dataclass

from gateway.commands import port

DEMO_KEYS = ("sk-demo-a", "sk-demo-b")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        default=None,
        help="kvgate.yaml (default: KVGATE_CONFIG, else the checkout's config/kvgate.yaml: model kvgate-tiny on "
        "one bundled backend at 127.0.0.1:30000; kvgate up writes its own for the model it serves)",
    )
    parser.add_argument(
        "--tenants",
        default=None,
        help="tenants.yaml (default: KVGATE_TENANTS, else the checkout's config/tenants.yaml)",
    )
    parser.add_argument("--host", default=None, help="bind address (default: gateway.host)")
    parser.add_argument("--port", type=port, default=None, help="port (default: gateway.port, 8080)")
    parser.add_argument("--demo", action="store_true", help="allow the documented demo keys sk-demo-a/sk-demo-b")
    parser.add_argument("--log-level", default=None, choices=["debug", "info", "warning", "error"])
    parser.add_argument(
        "--init-tenant",
        metavar="NAME",
        default=None,
        help="when the tenants file does not exist yet: create it with tenant NAME and a fresh API key, "
        "written once to <state_dir>/NAME.key (mode 0600)",
    )
    parser.add_argument(
        "--allow-open-secrets",
        action="store_true",
        help="start even when secrets.json or its state directory is group/world accessible (warns instead)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=None,
        help="worker processes on the one port (default: gateway.workers, else the usable cores when "
        "redis_url is set, else 1)",
    )
    parser.add_argument(
        "--reuse-port",
        action="store_true",
        help="with --workers N > 1: each worker binds its own SO_REUSEPORT socket (gateway.reuse_port); any "
        "process of the same user may then bind the port too and receive connections",
    )
    parser.add_argument(
        "--tenants-for-served-models",
        action="store_true",
        help="serve the tenants whose allowed_models name a configured model and leave out (with a warning "
        "per tenant, on every load and reload) those that name none, instead of refusing the tenants file; "
        "what kvgate up / kvgate demo pass, since one tenants file serves every --model there",
    )
    parser.add_argument("--worker-index", type=int, default=None, help=argparse.SUPPRESS)


def demo_tenants(registry) -> list[str]:
    """Ids of tenants that accept a documented demo key."""
    out = []
    for key in DEMO_KEYS:
        t = registry.lookup(key)
        if t is not None and t.id not in out:
            out.append(t.id)
    return out


class _CreatedMeanwhile(Exception):
    """Another process created the tenants file first (:func:`init_tenant`)."""


def init_tenant(tenants_path: str | None, name: str, state_dir: str) -> bool:
    """``--init-tenant NAME``: when the tenants file (``tenants_path``, else ``$KVGATE_TENANTS``,
    else config/tenants.yaml) does not exist, create it holding tenant ``name`` with a fresh key
    (:func:`gateway.commands.tenant.new_api_key`; only its SHA-256 is stored) and write the key to
    ``<state_dir>/<name>.key`` (0600 whatever a leftover file's mode, folder 0700). Returns
    whether it created the file; a file that exists is left alone, so restarts keep the key,
    and so is one another process (a replica started beside this one) created while this one
    waited for the tenants file's lock: the key file stays that process's, whose hash the file
    holds. Raises ``ConfigError``."""
    from pathlib import Path

    from pydantic import ValidationError

    from config.loader import ConfigError
    from config.models import TenantConfig
    from config.secrets import private_dir
    from gateway.commands.tenant import TenantFileError, default_tenants_path, edit_tenants, key_sha256, new_api_key

    path = Path(tenants_path) if tenants_path else default_tenants_path()
    if path.exists():
        return False
    key = new_api_key()
    try:  # the name is checked before it names a file: '../x' wrote its key outside state_dir
        TenantConfig(id=name, api_key_sha256=[key_sha256(key)])
    except ValidationError as e:
        raise ConfigError(str(path), [f"--init-tenant {name!r}: {e.errors()[0]['msg']}"]) from None
    key_file = private_dir(state_dir) / f"{name}.key"
    try:
        private_dir(path.parent)
        with edit_tenants(path) as seq:  # locked: replicas starting together create it once
            if path.exists():  # another process created it while this one waited for the lock
                raise _CreatedMeanwhile
            seq.append({"id": name, "api_key_sha256": [key_sha256(key)]})
            fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.fchmod(fd, 0o600)  # a leftover key file keeps its mode through O_CREAT
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(key + "\n")
    except _CreatedMeanwhile:  # its key file is that process's; nothing here is written
        return False
    except (OSError, TenantFileError) as e:
        raise ConfigError(str(path), [f"cannot create the first tenant: {e}"]) from None
    logging.getLogger("kvgate.serve").warning(
        "created %s with tenant '%s'; its API key is in %s (mode 0600)", path, name, key_file
    )
    return True


def model_folder_problem(settings) -> str | None:
    """Why a pulled model folder a counter loads (tokenizer ``kind: hf``) is not as pulled (a
    file changed since, by its SHA-256: :func:`config.model_manifest.verify_folder`), else ``None``."""
    from config.model_manifest import ModelFolderError, verify_folder

    for m in settings.models:
        if m.tokenizer.kind == "hf" and m.tokenizer.path:
            try:
                verify_folder(m.tokenizer.path, weights=False)  # a counter reads no weights
            except ModelFolderError as e:
                return f"model {m.id}: {e}"
    return None


def tokenizer_problem(settings) -> str | None:
    """Why a model's counter cannot be made (an HF folder without ``tokenizer.json``, a tiktoken
    encoding not available offline), else ``None``: checked before the app is built, where it
    was a traceback."""
    from pathlib import Path

    from tokenizer.encodings import get_encoding

    for i, m in enumerate(settings.models):
        t = m.tokenizer
        if t.kind == "hf" and not (Path(t.path or "") / "tokenizer.json").is_file():
            return f"models[{i}] ({m.id}): tokenizer path '{t.path}' holds no tokenizer.json"
        if t.kind == "tiktoken":
            try:
                get_encoding(t.name)
            except ValueError as e:
                return f"models[{i}] ({m.id}): {e}"
    return None


def fd_limit_problem(settings) -> str | None:
    """Raise the open-file limit to what the connection limits need
    (:func:`gateway.edge.server.raise_fd_limit`; the workers inherit it); why it cannot be, else ``None``."""
    from gateway.edge.server import FdLimitError, raise_fd_limit

    try:
        raise_fd_limit(settings)
    except FdLimitError as e:
        return str(e)
    return None


def build_stages(settings, secrets, registry=None):
    """The quota and verifier stages ``settings`` ask for: ``gateway.quotas.tenant_quotas.build_quota_stage``
    (``NullQuotas`` when ``quotas.enabled`` is false) and ``verifier.from_settings`` (``None``,
    i.e. ``NullVerifier``, when ``verifier.enabled`` is false). ``registry``: the
    :class:`~gateway.ops.tenants.TenantRegistry`, whose current table tells the verifier which
    tenants are honeypots (whichever worker served their requests)."""
    from gateway.quotas.tenant_quotas import build_quota_stage

    quotas = build_quota_stage(settings)
    verifier = None
    if settings.verifier.enabled:
        import verifier as vmod

        kw = {"tenant_source": registry.get} if registry is not None else {}
        verifier = vmod.from_settings(settings, secrets, **kw)
    return quotas, verifier


class _Refused(Exception):
    """A start-up check failed: ``kvgate serve: <message>`` goes to stderr and ``status`` is the exit status."""

    def __init__(self, message: str, status: int = 2) -> None:
        super().__init__(message)
        self.status = status


def run(args: argparse.Namespace) -> int:
    """``kvgate serve``: the start-up checks in order, then the server (or the worker supervisor).
    Returns the exit status: 2 for a refused start, 1 when the port cannot be bound."""
    try:
        return _start(args)
    except _Refused as e:
        print(f"kvgate serve: {e}", file=sys.stderr)
        return e.status


def _start(args: argparse.Namespace) -> int:
    from gateway.ops.access_log import setup_logging

    settings, registry = _load_config(args)
    _check_files(settings)
    _check_demo_keys(registry, allow_demo=args.demo)
    if not args.demo:  # a reload must not let them in either
        from gateway.ops.tenants import hash_key

        registry.refused_key_hashes = frozenset(hash_key(k) for k in DEMO_KEYS)
    n = _worker_count(args.workers, settings)
    settings.gateway.workers = n  # the quota stage divides local_fallback limits by replicas x workers
    listen = _Listen.of(args, settings)
    setup_logging(listen.log_level)
    _check_secrets_private(settings.state_dir, allow_open=args.allow_open_secrets)
    secrets = _load_secrets(settings.state_dir)
    if n > 1 and args.worker_index is None:  # the secrets exist now: the workers only read them
        reuse_port = bool(args.reuse_port or settings.gateway.reuse_port)
        return _supervise(args, n, listen.host, listen.port, listen.log_level, reuse_port)
    sock = _worker_socket(args.worker_index, settings, listen.host, listen.port)
    return _serve(args, settings, registry, secrets, listen, sock)


@dataclass(frozen=True)
class _Listen:
    """Where and how loudly the gateway serves: the options, else the settings' ``gateway`` values."""

    host: str
    port: int
    log_level: str

    @classmethod
    def of(cls, args: argparse.Namespace, settings) -> _Listen:
        port = args.port if args.port is not None else settings.gateway.port
        return cls(args.host or settings.gateway.host, port, args.log_level or settings.gateway.log_level)


def _load_config(args: argparse.Namespace):
    """The settings and the tenant registry (``--init-tenant`` first creates a missing tenants file)."""
    from config.loader import ConfigError, load_settings
    from gateway.ops.tenants import TenantRegistry

    try:
        settings = load_settings(args.config)
        if args.init_tenant:
            init_tenant(args.tenants, args.init_tenant, settings.state_dir)
        return settings, TenantRegistry.from_path(args.tenants, settings, served_only=args.tenants_for_served_models)
    except ConfigError as e:
        raise _Refused(str(e)) from None


def _check_files(settings) -> None:
    """The pulled model folders are as pulled and the open-file limit is high enough."""
    problem = tokenizer_problem(settings) or model_folder_problem(settings) or fd_limit_problem(settings)
    if problem:
        raise _Refused(problem)


def _check_demo_keys(registry, *, allow_demo: bool) -> None:
    """No tenant accepts a documented demo key, unless ``--demo``."""
    demo = demo_tenants(registry)
    if demo and not allow_demo:
        raise _Refused(
            f"tenant(s) {', '.join(demo)} accept a documented demo key (sk-demo-a/sk-demo-b); "
            "anyone could use them. Rotate the keys (kvgate tenant ...) or start with --demo for a "
            "local demo."
        )


def _worker_count(asked: int | None, settings) -> int:
    """The number of worker processes (``--workers``, else the settings' default), when allowed."""
    from gateway.edge import workers as wk

    try:
        n = wk.resolve_workers(asked, settings)
    except ValueError as e:
        raise _Refused(str(e)) from None
    refusal = wk.workers_refusal(n, settings)
    if refusal:
        raise _Refused(refusal)
    return n


def _check_secrets_private(state_dir, *, allow_open: bool) -> None:
    """The secrets are closed to other users; with ``--allow-open-secrets`` each opening is logged instead."""
    from config.secrets import permission_problems, private_dir

    try:
        private_dir(state_dir)
    except OSError as e:  # /proc/kv, a file, no permission: a FileNotFoundError traceback before
        raise _Refused(f"state_dir {state_dir}: cannot be created or used: {e.strerror or e}") from None
    problems = permission_problems(state_dir)
    if problems and not allow_open:
        raise _Refused(
            "the secrets are open to other users:\n  "
            + "\n  ".join(problems)
            + "\n(or start with --allow-open-secrets to only warn)"
        )
    for p in problems:
        logging.getLogger("kvgate.serve").warning("secrets open to other users (--allow-open-secrets): %s", p)


def _load_secrets(state_dir):
    from config.secrets import SecretsError, load_secrets

    try:
        return load_secrets(state_dir)
    except SecretsError as e:
        raise _Refused(str(e)) from None


def _worker_socket(worker_index: int | None, settings, host: str, port: int):
    """As worker ``worker_index``: this process's socket on ``host:port`` (only worker 0 keeps the
    periodic probe); as the only process: ``None`` (the server binds)."""
    if worker_index is None:
        return None
    from gateway.edge import workers as wk

    wk.become_worker()
    if worker_index > 0:  # one periodic probe per gateway, not one per worker
        settings.verifier.probe_interval_seconds = None
    try:
        return wk.worker_socket(host, port)
    except OSError as e:
        raise _Refused(f"cannot bind {host}:{port}: {e}", status=1) from None


def _serve(args: argparse.Namespace, settings, registry, secrets, listen: _Listen, sock) -> int:
    """Build the stages and the app, watch the tenants file, and serve until stopped."""
    quotas, verifier = build_stages(settings, secrets, registry)
    from gateway.app import create_app
    from gateway.edge.server import run_server

    app = create_app(settings, registry, quotas=quotas, verifier=verifier, secrets=secrets)
    app.state.gateway.worker = args.worker_index
    from gateway.ops.tenant_reload import TenantFileWatcher

    # tenant edits apply without a restart; a file that fails to read is counted in /metrics
    watcher = TenantFileWatcher(registry, on_result=app.state.gateway.metrics.tenant_reloaded).start()
    watcher.install_sighup()
    return run_server(
        app,
        listen.host,
        listen.port,
        drain_timeout_seconds=settings.gateway.drain_timeout_seconds,
        log_level=listen.log_level,
        sock=sock,
    )


def _supervise(args: argparse.Namespace, n: int, host: str, port: int, log_level: str, reuse_port: bool) -> int:
    """Run ``n`` workers of this command on ``host:port`` (:class:`gateway.edge.workers.Supervisor`),
    sharing one listening socket unless ``reuse_port``."""
    from gateway.edge.workers import MetricsDirError, Supervisor, WorkerStartError

    def command(index: int, bound_port: int) -> list[str]:
        cmd = [sys.executable, "-m", "gateway.cli", "serve", "--host", host, "--port", str(bound_port)]
        if args.config:
            cmd += ["--config", str(args.config)]
        if args.tenants:
            cmd += ["--tenants", str(args.tenants)]
        if args.demo:
            cmd.append("--demo")
        if args.tenants_for_served_models:
            cmd.append("--tenants-for-served-models")
        if args.allow_open_secrets:
            cmd.append("--allow-open-secrets")
        return cmd + ["--log-level", log_level, "--workers", str(n), "--worker-index", str(index)]

    try:
        return Supervisor(n, host, port, command, reuse_port=reuse_port).run()
    except MetricsDirError as e:
        print(f"kvgate serve: {e}", file=sys.stderr)
        return 2
    except WorkerStartError as e:  # a fork or exec, not the address: never "cannot bind"
        print(f"kvgate serve: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"kvgate serve: cannot bind {host}:{port}: {e}", file=sys.stderr)
        return 1
