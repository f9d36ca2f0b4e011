"""``kvgate up``: the embedded stack in one command (the bundled backend ``--role all`` plus the
gateway, demo tenants ``demo-a``/``demo-b`` with keys ``sk-demo-a``/``sk-demo-b``, no Redis unless
``--redis-url``; with it the gateway runs one worker per usable core, or ``--workers N``).

Prints the OpenAI base URL, the keys and a curl example, then serves until Ctrl-C or SIGTERM,
which stop the gateway (draining) and then the backend. SIGHUP reloads the tenants file (after
``kvgate tenant add``). Exit status: 0 after an interrupt, 1 when the stack fails to start or a
part of it exits on its own, 130 when interrupted during start-up.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from config.loader import ConfigError, load_settings
from gateway.commands import port
from gateway.stack.embedded import (
    DEMO_KEYS,
    EmbeddedStack,
    StackError,
    StackOptions,
    serve_until_interrupted,
    terminate_as_interrupt,
)

#: What ``kvgate up`` / ``kvgate demo`` serve unless ``--model`` says otherwise (docs/design.md, Models).
DEFAULT_MODEL = "smollm2-135m-instruct"


def add_stack_arguments(parser: argparse.ArgumentParser) -> None:
    """The options shared by ``kvgate up`` and ``kvgate demo`` (fields of :class:`StackOptions`)."""
    parser.add_argument(
        "--config",
        type=Path,
        default=None,
        metavar="PATH",
        help="settings file (default: $KVGATE_CONFIG or config/kvgate.yaml)",
    )
    parser.add_argument(
        "--tenants",
        type=Path,
        default=None,
        metavar="PATH",
        help="tenants file (default: $KVGATE_TENANTS or config/tenants.yaml)",
    )
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"what the backend serves: a model name pulled on first use (default {DEFAULT_MODEL}), "
        "a Hugging Face folder, or tiny-random / copy-probe (random weights, fast; tests use them)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address both parts bind (default 127.0.0.1)")
    parser.add_argument(
        "--port",
        type=port,
        default=None,
        help="gateway port (default: gateway.port of the settings, 8080; 0 = a free port)",
    )
    parser.add_argument(
        "--backend-port",
        type=port,
        default=None,
        help="backend port (default: backend.port, 30000, or a free port if it is taken)",
    )
    parser.add_argument(
        "--backend-arg",
        dest="backend_args",
        action="append",
        default=[],
        metavar="FLAG",
        help="extra flag for python -m gpu_backend (repeat; e.g. --backend-arg=--device=cpu)",
    )
    parser.add_argument(
        "--startup-timeout",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="how long each part may take to become ready (default 300)",
    )
    parser.add_argument(
        "--verbose", action="store_true", help="show the backend's and gateway's logs here instead of in log files"
    )
    parser.add_argument(
        "--redis-url",
        default=None,
        metavar="URL",
        help="keep quotas, leak index and canaries in this Redis (default: none, in the gateway's process)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=None,
        metavar="N",
        help="gateway worker processes (default: kvgate serve's: the usable cores with --redis-url, else 1; "
        "more than 1 needs --redis-url)",
    )


def stack_options(args: argparse.Namespace) -> StackOptions:
    """:class:`StackOptions` from the parsed options of :func:`add_stack_arguments`. Logs go to
    ``<state_dir>/run/`` (kept after exit)."""
    settings = load_settings(args.config)
    return StackOptions(
        config=args.config,
        tenants=args.tenants,
        host=args.host,
        gateway_port=args.port,
        backend_port=args.backend_port,
        backend_args=list(args.backend_args),
        run_dir=Path(settings.state_dir) / "run",
        startup_timeout_seconds=args.startup_timeout,
        echo_logs=args.verbose,
        model=args.model,
        redis_url=args.redis_url,
        workers=args.workers,
    )


def start_stack(options: StackOptions, prog: str) -> EmbeddedStack:
    """Start the stack, printing progress to stderr; raises :class:`StackError` / ``KeyboardInterrupt``."""
    stack = EmbeddedStack(options)
    t0 = time.monotonic()

    def announce() -> None:
        print(
            f"{prog}: starting the bundled backend (python -m gpu_backend --role all) and the gateway; "
            "the first start loads PyTorch and may take a while ...",
            file=sys.stderr,
            flush=True,
        )

    try:
        stack.start(announce)
    except BaseException:
        stack.stop()
        raise
    info = stack.server_info
    print(
        f"{prog}: ready in {time.monotonic() - t0:.1f} s: backend {stack.backend_url} "
        f"(context {info.get('context_length')} tokens, prefill pool {info.get('max_total_num_tokens')} tokens), "
        f"gateway {stack.gateway_url}",
        file=sys.stderr,
        flush=True,
    )
    return stack


def _models(stack: EmbeddedStack, key: str) -> httpx.Response:
    """The gateway's ``GET /v1/models`` as the tenant of ``key`` sees it."""
    return httpx.get(
        stack.gateway_url + "/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=10, trust_env=False
    )


def _limit_in(stack: EmbeddedStack, models: Any) -> int | None:
    """``max_model_len`` of the served model in a ``/v1/models`` answer (``None`` if it says none)."""
    for m in models.get("data", []) if isinstance(models, dict) else []:
        if m.get("id") == stack.model and isinstance(m.get("max_model_len"), int):
            return int(m["max_model_len"])
    return None


def effective_limit(stack: EmbeddedStack, key: str) -> int | None:
    """The tenant's effective limit now: ``max_model_len`` of the served model in the gateway's
    ``GET /v1/models`` (``None`` if the gateway does not say). Raises ``httpx.HTTPStatusError``
    when the gateway refuses ``key``."""
    r = _models(stack, key)
    r.raise_for_status()
    return _limit_in(stack, r.json())


def demo_access(stack: EmbeddedStack) -> tuple[dict[str, str], int | None]:
    """``(tenant -> key, limit)``: the demo tenants (:data:`DEMO_KEYS`) whose key the running
    gateway accepts, and the effective limit the first of them sees. A tenants file of the
    operator's own may hold none of them: then ``({}, None)``, and the banner says so."""
    keys: dict[str, str] = {}
    limit = None
    for tenant, key in DEMO_KEYS.items():
        r = _models(stack, key)
        if r.status_code == 401:
            continue
        r.raise_for_status()
        keys[tenant] = key
        limit = _limit_in(stack, r.json()) if limit is None else limit
    return keys, limit


def banner(stack: EmbeddedStack, limit: int | None, keys: dict[str, str] = DEMO_KEYS) -> str:
    """What ``kvgate up`` prints once the stack is ready: URL, ``keys`` (the demo tenants' the
    gateway accepts), a curl example, how to stop."""
    url = stack.gateway_url
    tenants_path = stack.tenants_path.resolve()
    listed = "   ".join(f"{tenant}: {key}" for tenant, key in keys.items())
    listed = listed or f"those of your tenants ({tenants_path}; the demo keys are not in it)"
    example_key = next(iter(keys.values()), "$YOUR_KEY")
    limit_text = f" (effective context limit now: {limit} tokens)" if limit else ""
    run_dir = stack.run_dir.resolve()  # read from another terminal, whose directory may be anywhere
    logs = "" if stack.options.echo_logs else f"\n  logs:             {run_dir}/backend.log, gateway.log"
    return f"""
  kvgate is up.
  OpenAI base URL:  {url}/v1
  model:            {stack.model}{limit_text}
  API keys:         {listed}
  metrics:          {url}/metrics{logs}

  curl {url}/v1/chat/completions \\
    -H "Authorization: Bearer {example_key}" -H "Content-Type: application/json" \\
    -d '{{"model": "{stack.model}", "max_tokens": 16, "temperature": 0,
         "messages": [{{"role": "user", "content": "What is the capital of France?"}}]}}'

  Press Ctrl-C to stop (or send SIGTERM). SIGHUP reloads the tenants file ({tenants_path}).
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``kvgate up``: see :func:`add_stack_arguments`."""
    add_stack_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Start the stack, print the banner, serve until interrupted; returns the exit status."""
    with terminate_as_interrupt():
        stack: EmbeddedStack | None = None
        try:
            stack = start_stack(stack_options(args), "kvgate up")
            keys, limit = demo_access(stack)
            print(banner(stack, limit, keys), flush=True)
            status = serve_until_interrupted(stack)
            print("kvgate up: stopping ...", file=sys.stderr, flush=True)
            return status
        except KeyboardInterrupt:
            print("kvgate up: interrupted during start-up", file=sys.stderr)
            return 130
        except (StackError, ConfigError, httpx.HTTPError) as e:
            print(f"kvgate up: {e}", file=sys.stderr)
            return 1
        finally:
            if stack is not None:
                stack.stop()
                print("kvgate up: stopped (gateway drained, backend exited)", file=sys.stderr, flush=True)
