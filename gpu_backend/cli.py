"""``python -m gpu_backend`` (also ``kvgate backend``): flags, role wiring, uvicorn.

Flags (docs/design.md, "Backend flags"): ``--role all|prefill|decode|router``, ``--host``, ``--port``,
``--prefill-url``, ``--decode-url``, ``--model``, ``--served-model-name``, ``--device``,
``--context-length``, ``--page-size``, ``--max-total-tokens``, ``--mem-budget-bytes``; plus
``--prefill-max-total-tokens`` / ``--decode-max-total-tokens`` (the two pools of ``--role all``),
timeouts, ``--seed``, ``--dtype`` and ``--enable-debug-endpoints`` (test use). Defaults come from
``config.models.BackendSettings`` as loaded from ``kvgate.yaml`` + ``KVGATE_BACKEND__*``
(``--config`` picks the file): context 8,192, prefill pool 4,096 tokens, decode pool 16,384.

Roles:
- ``all``: one process; a prefill engine and a decode engine in process, transfer in process,
  one port (default 30000) serving the router API and ``/server_info`` of the **prefill** pool.
- ``prefill`` (default port 30001) / ``decode`` (30002): one engine each; prefill sends pages to
  ``--decode-url`` over HTTP.
- ``router`` (30000): no model, no torch; talks to ``--prefill-url`` and ``--decode-url``.

Faults: ``KVGATE_FAULTS`` (see :mod:`gpu_backend.faults`), test use only.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from config.models import BackendSettings
from gpu_backend.faults import Faults, UnknownFaultError, faults_from_env

if TYPE_CHECKING:  # the router role imports neither torch nor the engine
    import httpx
    import torch
    from fastapi import FastAPI

    from gpu_backend.engine import Engine
    from gpu_backend.router import Router
    from gpu_backend.servers import RouterConfig

    Lifespan = Callable[[Any], contextlib.AbstractAsyncContextManager[None]]

ROLE_PORTS = {"all": 30000, "router": 30000, "prefill": 30001, "decode": 30002}
log = logging.getLogger("gpu_backend")


def load_backend_settings(path: str | None) -> BackendSettings:
    """The ``backend`` section of ``kvgate.yaml`` (+ env overrides). Raises ``ConfigError``."""
    from config.loader import load_settings

    return load_settings(path).backend


def _pool_arg(value: str) -> int:
    n = int(value)
    if n < 0:
        raise argparse.ArgumentTypeError("must be >= 0 (0: derive the pool from memory)")
    return n


def build_parser(d: BackendSettings) -> argparse.ArgumentParser:
    """The argument parser, defaults from ``d``."""
    p = argparse.ArgumentParser(prog="kvgate backend", description=__doc__.split("\n")[0].replace("``", ""))
    p.add_argument("--config", default=None, help="kvgate.yaml to read the backend defaults from")
    p.add_argument("--role", choices=["all", "prefill", "decode", "router"], default=d.role)
    p.add_argument("--host", default=d.host)
    p.add_argument(
        "--port", type=int, default=None, help="default: 30000 (all, router), 30001 (prefill), 30002 (decode)"
    )
    p.add_argument("--prefill-url", default=d.prefill_url, help="router: the prefill node")
    p.add_argument("--decode-url", default=d.decode_url, help="router and prefill: the decode node")
    p.add_argument("--model", default=d.model, help="tiny-random, copy-probe or a local HF Llama folder")
    p.add_argument(
        "--served-model-name",
        default=None,
        help=f"the model id clients send (default: a folder's own name, else {d.served_model_name})",
    )
    p.add_argument("--device", default=d.device, help="auto, cpu, cuda, cuda:N")
    p.add_argument("--context-length", type=int, default=d.context_length)
    p.add_argument("--page-size", type=int, default=d.page_size)
    p.add_argument(
        "--max-total-tokens",
        type=_pool_arg,
        default=d.max_total_tokens,
        help="this node's KV pool cap in tokens (role all: the prefill pool); 0: from memory. "
        "Default: 4,096 for prefill, 16,384 for decode",
    )
    p.add_argument("--prefill-max-total-tokens", type=_pool_arg, default=d.prefill_max_total_tokens)
    p.add_argument("--decode-max-total-tokens", type=_pool_arg, default=d.decode_max_total_tokens)
    p.add_argument(
        "--mem-budget-bytes",
        type=int,
        default=d.mem_budget_bytes,
        help="on CPU: stands in for free device memory when sizing the pool",
    )
    p.add_argument("--mem-fraction-static", type=float, default=d.mem_fraction_static)
    p.add_argument("--pool-wait-timeout-seconds", type=float, default=d.pool_wait_timeout_seconds)
    p.add_argument("--transfer-timeout-seconds", type=float, default=d.transfer_timeout_seconds)
    p.add_argument(
        "--request-timeout-seconds",
        type=float,
        default=None,
        help="router: arrival to first token (default: 2 x pool wait + transfer timeout + 30)",
    )
    p.add_argument("--max-running-requests", type=int, default=256)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument(
        "--no-packed-weights",
        dest="packed_weights",
        action="store_false",
        help="CPU: no MKL-packed copies of the weights (half the weights' memory, slower batched decode)",
    )
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    p.add_argument(
        "--enable-debug-endpoints",
        action="store_true",
        help="serve /debug/pool (pool free/used pages and a zero check); test use only",
    )
    return p


@dataclass
class Options:
    """Resolved flags (see :func:`build_parser`)."""

    ns: argparse.Namespace
    faults: Faults

    def __getattr__(self, name: str) -> Any:
        return getattr(self.ns, name)

    @property
    def port_resolved(self) -> int:
        return self.ns.port if self.ns.port is not None else ROLE_PORTS[self.ns.role]

    @property
    def open_timeout(self) -> float:
        t = self.ns.request_timeout_seconds
        return t if t else 2 * self.ns.pool_wait_timeout_seconds + self.ns.transfer_timeout_seconds + 30.0

    def pool_tokens(self, side: str) -> int | None:
        """The pool cap of ``side`` (``prefill``/``decode``) for this role: ``--max-total-tokens``
        when given (role ``all``: for the prefill pool), else the side's own default; ``0`` and
        ``None`` mean "size the pool from memory" (SGLang's rule)."""
        own = self.ns.prefill_max_total_tokens if side == "prefill" else self.ns.decode_max_total_tokens
        if self.ns.max_total_tokens is not None and (self.ns.role == side or side == "prefill"):
            own = self.ns.max_total_tokens
        return own or None


def parse_args(argv: list[str] | None = None) -> Options:
    """Parse flags (defaults from ``--config``/``KVGATE_CONFIG``'s backend section and env).
    Raises ``SystemExit`` on bad flags, ``ConfigError``/``UnknownFaultError`` on bad config."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    known, _ = pre.parse_known_args(argv)
    settings = load_backend_settings(known.config)
    ns = build_parser(settings).parse_args(argv)
    ns.model, ns.served_model_name = resolve_model_flags(ns.model, ns.served_model_name, known.config, settings)
    ns.context_length = folder_context_length(ns.model, ns.context_length)
    return Options(ns, faults_from_env())


def folder_context_length(model: str, context_length: int) -> int:
    """The context length (tokens) a role serves ``model`` with: for a checkpoint folder,
    ``min(context_length, config.json's max_position_embeddings)`` (the rule ``kvgate up`` applies to
    the gateway's model entry, so every role of a split deployment and the gateway agree and no
    position past the model's own limit is admitted); ``context_length`` for the built-in models or
    a folder whose config names no positive integer. Raises nothing."""
    import json
    from pathlib import Path

    if model in ("tiny-random", "copy-probe"):
        return context_length
    try:
        ctx = json.loads((Path(model) / "config.json").read_text()).get("max_position_embeddings")
    except (OSError, ValueError, AttributeError):
        return context_length
    return (
        min(context_length, ctx) if isinstance(ctx, int) and not isinstance(ctx, bool) and ctx > 0 else context_length
    )


def resolve_model_flags(model: str, served: str | None, config: str | None, d: BackendSettings) -> tuple[str, str]:
    """``(--model, --served-model-name)`` as the engine reads them: a pulled model's name becomes
    its folder ``<state_dir>/models/NAME`` (:func:`gpu_backend.model_store.resolve_model`); the
    served name, when not given, is a folder's pull name (``kvgate-model.json``) or the folder's
    own name, and for the built-in models the settings' ``served_model_name``."""
    from pathlib import Path

    from config.loader import load_settings
    from gpu_backend.model_store import MANIFEST, read_manifest, resolve_model

    if model not in ("tiny-random", "copy-probe") and not Path(model).is_dir():
        name, model = model, resolve_model(model, load_settings(config).state_dir)
        if model != name and not Path(model).is_dir():
            raise SystemExit(f"gpu_backend: model '{name}' is not pulled yet; run: kvgate model pull {name}")
    if Path(model).is_dir():  # a pulled folder must be as pulled (every file's SHA-256)
        from config.model_manifest import ModelFolderError, verify_folder

        try:
            verify_folder(model)
        except ModelFolderError as e:
            raise SystemExit(f"gpu_backend: {e}") from None
    if served:
        return model, served
    folder = Path(model)
    if not folder.is_dir():
        return model, d.served_model_name
    man = read_manifest(folder) if (folder / MANIFEST).is_file() else None
    pulled = man.get("served_model_name") if man else None
    return model, pulled if isinstance(pulled, str) and pulled else folder.resolve().name


def make_engine(opts: Options, side: str, model: torch.nn.Module | None = None) -> Engine:
    """An :class:`~gpu_backend.engine.Engine` for ``side`` with the model's tokenizer (imports torch).
    ``model``: another engine's model to share (role ``all``), else the engine loads its own."""
    from gpu_backend.engine import Engine, EngineConfig
    from gpu_backend.vocab import vocab_for

    cfg = EngineConfig(
        model=opts.model,
        device=opts.device,
        context_length=opts.context_length,
        page_size=opts.page_size,
        max_total_tokens=opts.pool_tokens(side),
        mem_budget_bytes=opts.mem_budget_bytes,
        mem_fraction_static=opts.mem_fraction_static,
        pool_wait_timeout_seconds=opts.pool_wait_timeout_seconds,
        max_running_requests=opts.max_running_requests,
        seed=opts.seed,
        dtype=opts.dtype,
        packed_weights=opts.packed_weights,
        faults=opts.faults,
    )
    engine = Engine(cfg, vocab_for(opts.model), model)
    print(f"gpu_backend: {side} {engine.pool_explanation}", file=sys.stderr, flush=True)
    return engine


def _router_config(opts: Options) -> RouterConfig:
    from gpu_backend.servers import RouterConfig
    from gpu_backend.vocab import vocab_for

    return RouterConfig(
        counter=vocab_for(opts.model).counter,
        context_length=opts.context_length,
        served_model_name=opts.served_model_name,
        # a folder is accepted by its served name only (its path is not for clients to see)
        model_names=[opts.model] if opts.model in ("tiny-random", "copy-probe") else [],
    )


def _http_client(opts: Options) -> httpx.AsyncClient:
    """The internal client (built before the loop runs; it binds to the loop on first use)."""
    import httpx

    # keep-alive expiry well below the servers' timeout_keep_alive (60 s), so a pooled connection is
    # never reused just as the server closes it
    return httpx.AsyncClient(
        limits=httpx.Limits(max_connections=2048, max_keepalive_connections=512, keepalive_expiry=20.0),
        timeout=httpx.Timeout(opts.open_timeout, connect=10.0),
    )


def freeze_startup_heap() -> int:
    """One full collection, then every object alive (modules, weights' wrappers, vocabularies, the
    app) into the collector's permanent generation (``gc.freeze``); returns how many were frozen.
    vLLM's ``freeze_gc_heap`` (``vllm/utils/gc_utils.py``), called once startup is done: a later
    full collection scans only what serving created. Unfrozen, one full collection on an engine's
    worker thread took 91-107 ms on 2 CPU cores and landed inside a one-token prefill
    (docs/performance.md, "GC pauses in the bundled engine"). Serving processes only (:func:`main`):
    a process that builds and drops backends (tests) would keep their reference cycles forever."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def _lifespan(*engines: Engine, router: Router | None = None, client: httpx.AsyncClient | None = None) -> Lifespan:
    """Start the engines; on shutdown wait for the router's detached calls, stop the engines, close
    the client."""

    @contextlib.asynccontextmanager
    async def lifespan(_app: Any) -> AsyncIterator[None]:
        for e in engines:
            await e.start()
        try:
            yield
        finally:
            if router is not None:
                await router.drain()
            for e in engines:
                await e.stop()
            if client is not None:
                await client.aclose()

    return lifespan


def build_all(opts: Options) -> FastAPI:
    """``--role all``: a prefill and a decode engine in process, transfer in process, the router API
    plus the prefill pool's ``/server_info``."""
    from gpu_backend import servers
    from gpu_backend.decode_node import DecodeNode
    from gpu_backend.prefill_node import LocalSink, PrefillNode
    from gpu_backend.router import LocalDecodeClient, LocalPrefillClient, Router

    # one copy of the read-only weights for both engines; each keeps its own KV pool (docs/design.md, invariants)
    pe = make_engine(opts, "prefill")
    de = make_engine(opts, "decode", model=pe.model)
    dnode = DecodeNode(de, faults=opts.faults, transfer_timeout_seconds=opts.transfer_timeout_seconds)
    pnode = PrefillNode(pe, LocalSink(dnode), transfer_timeout_seconds=opts.transfer_timeout_seconds)
    router = Router(LocalPrefillClient(pnode), LocalDecodeClient(dnode), open_timeout=opts.open_timeout)

    async def info() -> dict[str, Any]:
        return pnode.server_info()

    pools = {"prefill": pe, "decode": de}
    debug = (lambda: {k: servers.pool_report(e) for k, e in pools.items()}) if opts.enable_debug_endpoints else None
    app = servers.build_router_app(
        router, _router_config(opts), server_info=info, debug_pools=debug, lifespan=_lifespan(pe, de, router=router)
    )
    app.state.engines, app.state.nodes = pools, {"prefill": pnode, "decode": dnode}
    return app


def build_router(opts: Options) -> FastAPI:
    """``--role router``: no model, no torch; reaches ``--prefill-url`` and ``--decode-url`` over HTTP."""
    from gpu_backend import servers
    from gpu_backend.node_errors import remote_error
    from gpu_backend.router import HttpDecodeClient, HttpPrefillClient, Router

    client = _http_client(opts)
    router = Router(
        HttpPrefillClient(opts.prefill_url, client, opts.open_timeout),
        HttpDecodeClient(opts.decode_url, client, opts.open_timeout),
        open_timeout=opts.open_timeout,
    )

    async def info() -> dict[str, Any]:
        r = await client.get(opts.prefill_url.rstrip("/") + "/server_info", timeout=5.0)
        if r.status_code != 200:
            raise remote_error(r.status_code, r.json() if r.content else None)
        return r.json()

    lifespan = _lifespan(router=router, client=client)
    return servers.build_router_app(router, _router_config(opts), server_info=info, lifespan=lifespan)


def build_prefill(opts: Options) -> FastAPI:
    """``--role prefill``: one engine; pages go to ``--decode-url`` over HTTP."""
    from gpu_backend import servers
    from gpu_backend.prefill_node import HttpSink, PrefillNode

    engine, client = make_engine(opts, "prefill"), _http_client(opts)
    sink = HttpSink(opts.decode_url, client, opts.transfer_timeout_seconds)
    pnode = PrefillNode(engine, sink, transfer_timeout_seconds=opts.transfer_timeout_seconds)
    debug = (lambda: {"prefill": servers.pool_report(engine)}) if opts.enable_debug_endpoints else None
    app = servers.build_prefill_app(pnode, debug_pools=debug, lifespan=_lifespan(engine, client=client))
    app.state.engines, app.state.nodes = {"prefill": engine}, {"prefill": pnode}
    return app


def build_decode(opts: Options) -> FastAPI:
    """``--role decode``: one engine; reservations, transfers and the token streams."""
    from gpu_backend import servers
    from gpu_backend.decode_node import DecodeNode

    engine = make_engine(opts, "decode")
    dnode = DecodeNode(engine, faults=opts.faults, transfer_timeout_seconds=opts.transfer_timeout_seconds)
    debug = (lambda: {"decode": servers.pool_report(engine)}) if opts.enable_debug_endpoints else None
    app = servers.build_decode_app(dnode, debug_pools=debug, lifespan=_lifespan(engine))
    app.state.engines, app.state.nodes = {"decode": engine}, {"decode": dnode}
    return app


#: One builder per role.
BUILDERS: dict[str, Callable[[Options], FastAPI]] = {
    "all": build_all,
    "router": build_router,
    "prefill": build_prefill,
    "decode": build_decode,
}


def build_app(opts: Options) -> FastAPI:
    """The FastAPI app of ``opts.role`` (:data:`BUILDERS`), with a lifespan that starts/stops its
    engines and clients."""
    return BUILDERS[opts.role](opts)


def main(argv: list[str] | None = None) -> int:
    """Parse flags, build the role's app, serve it with uvicorn until SIGINT/SIGTERM."""
    from config.loader import ConfigError

    try:
        opts = parse_args(argv)
    except (ConfigError, UnknownFaultError) as e:
        print(f"gpu_backend: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=opts.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per internal call otherwise
    try:
        app = build_app(opts)
    except (ValueError, FileNotFoundError) as e:
        print(f"gpu_backend: cannot start the {opts.role} role: {e}", file=sys.stderr)
        return 2
    import uvicorn

    log.info("froze %d startup objects out of the garbage collector's scans", freeze_startup_heap())
    uvicorn.run(
        app,
        host=opts.host,
        port=opts.port_resolved,
        log_level=opts.log_level,
        access_log=False,
        timeout_keep_alive=60,
        timeout_graceful_shutdown=10,
    )
    return 0
