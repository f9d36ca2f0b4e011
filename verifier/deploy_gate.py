"""``kvgate deploy-gate``: the runbook's signal 1, read from the running engines.

For every ``--server-info-url`` (each prefill node), the gate reads the KV pool and passes when it
is at least ``context_length x headroom``. ``--pool-source sglang`` / ``kvgate``: ``/server_info``
(falling back to ``/get_server_info``) and ``/v1/loads`` where served; the pool is the smallest
data-parallel rank's. ``--pool-source vllm``: each URL is the engine's base URL; the pool is the KV
capacity (``/v1/server/kv-cache``, else ``vllm:cache_config_info`` on ``/metrics``), the context
``max_model_len``. Parsing is :mod:`config.engine_pool`'s, shared with the gateway.

Exit status: 0 every pool covers the window, 1 at least one is smaller, 2 a node is unreachable,
answers garbage, or reports no pool or context length (fail closed). ``--json`` prints one object.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx

from config.engine_pool import (
    SGLANG_LOADS_QUERY,
    EnginePoolError,
    server_info_base,
    sglang_pool,
    vllm_capacity_from_endpoint,
    vllm_capacity_from_metrics,
    vllm_max_model_len,
)
from config.pool import effective_pool_limit, signal_1_required_tokens

#: server_info fields that carry the pool, in order of preference (runbook, signal 1)
POOL_FIELDS = ("max_total_num_tokens", "kv_pool_tokens", "max_total_tokens")

EXIT_OK, EXIT_FAIL, EXIT_UNKNOWN = 0, 1, 2


@dataclass
class NodeResult:
    """One node's verdict. ``status``: ``ok``, ``too_small``, ``unreachable``, ``no_pool_field``,
    ``no_context_length`` or ``bad_response``. Token counts are ``None`` when unknown;
    ``read_from``: the endpoint the pool came from; ``rank_pools_tokens``: each data-parallel
    rank's pool (SGLang)."""

    url: str
    status: str
    pool_tokens: int | None = None
    pool_field: str | None = None
    context_length: int | None = None
    required_tokens: int | None = None
    effective_limit_tokens: int | None = None
    max_req_input_len: int | None = None
    error: str | None = None
    read_from: str | None = None
    rank_pools_tokens: list[int] | None = None


def pool_tokens_of(info: dict[str, Any]) -> tuple[int, str] | None:
    """The pool size and the field it came from, or ``None`` when no known field holds a
    positive integer (SGLang server_info names; the runbook's ``kv_pool_tokens`` function)."""
    for key in POOL_FIELDS:
        v = info.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v, key
    return None


def _fallback_url(url: str) -> str | None:
    """The renamed twin of a server-info URL (SGLang PR #13273: ``/get_server_info`` became
    ``/server_info``; either name is tried when the other answers 404)."""
    parts = urlsplit(url)
    path = parts.path.rstrip("/")
    for name, twin in (("/get_server_info", "/server_info"), ("/server_info", "/get_server_info")):
        if path.endswith(name):
            return urlunsplit(parts._replace(path=path[: -len(name)] + twin))
    return None


def fetch_server_info(client: httpx.Client, url: str) -> dict[str, Any]:
    """GET ``url`` (then its renamed twin when it answers 404), JSON object expected.
    A URL without a ``server_info`` path gets ``/server_info`` appended. Raises
    ``httpx.HTTPError`` (unreachable, non-2xx) or ``ValueError`` (not a JSON object)."""
    parts = urlsplit(url)
    if not parts.path.rstrip("/").endswith("server_info"):
        url = urlunsplit(parts._replace(path=parts.path.rstrip("/") + "/server_info"))
    r = client.get(url)
    if r.status_code == 404:
        fb = _fallback_url(url)
        if fb:
            r = client.get(fb)
    r.raise_for_status()
    data = r.json()
    if not isinstance(data, dict):
        raise ValueError("server info is not a JSON object")
    return data


def fetch_loads(client: httpx.Client, server_info_url: str) -> Any | None:
    """SGLang's ``GET /v1/loads`` body for the node of ``server_info_url``, ``None`` when the node
    does not serve it (404/405: SGLang before PR #16976) or the URL names no node base. Raises
    ``httpx.HTTPError`` for other failures."""
    base = server_info_base(server_info_url)
    if base is None:
        return None
    r = client.get(f"{base}/v1/loads?{SGLANG_LOADS_QUERY}")
    if r.status_code in (404, 405):
        return None
    r.raise_for_status()
    return r.json()


def _verdict(url: str, pool: int, field_name: str, ctx: int, headroom: float, **extra: Any) -> NodeResult:
    required = signal_1_required_tokens(ctx, headroom)
    status = "ok" if pool >= required else "too_small"
    limit = extra.pop("limit", None)
    if limit is None:
        limit = effective_pool_limit(ctx, pool, extra.get("max_req_input_len"), headroom)
    return NodeResult(url, status, pool, field_name, ctx, required, limit, **extra)


def _sglang_pool_of(info: dict[str, Any], loads: Any | None) -> tuple[int, str, str, list[int]] | str:
    """``(pool, field, read_from, rank pools)``, or why no pool is known for every rank."""
    try:
        node = sglang_pool(info, loads)
        return node.pool_tokens, "max_total_num_tokens", node.source, list(node.rank_pools_tokens)
    except EnginePoolError as e:
        found = pool_tokens_of(info) if (info.get("dp_size") in (None, 1) and loads is None) else None
        if found is not None:  # the runbook's alternative field names, one rank
            return found[0], found[1], "server_info", [found[0]]
        if info.get("dp_size") in (None, 1) and loads is None:
            return f"none of {', '.join(POOL_FIELDS)} in server info - fail closed"
        return f"{e} - fail closed"


def check_sglang_node(client: httpx.Client, url: str, context_length: int | None, headroom: float) -> NodeResult:
    """Read one SGLang (or bundled backend) node and judge its smallest rank's pool."""
    try:
        info = fetch_server_info(client, url)
        loads = fetch_loads(client, url)
    except httpx.HTTPError as e:
        return NodeResult(url, "unreachable", error=f"{type(e).__name__}: {e}"[:300])
    except ValueError as e:
        return NodeResult(url, "bad_response", error=str(e)[:300])
    found = _sglang_pool_of(info, loads)
    c = info.get("context_length")
    ctx = context_length or (c if isinstance(c, int) and not isinstance(c, bool) and c > 0 else None)
    mril = info.get("max_req_input_len")
    mril = mril if isinstance(mril, int) and not isinstance(mril, bool) and mril > 0 else None
    if isinstance(found, str):
        return NodeResult(url, "no_pool_field", context_length=ctx, max_req_input_len=mril, error=found)
    pool, field_name, read_from, ranks = found
    if ctx is None:
        error = "no --context-length given and the engine reports none - fail closed"
        return NodeResult(url, "no_context_length", pool, field_name, max_req_input_len=mril, error=error)
    return _verdict(
        url, pool, field_name, ctx, headroom, max_req_input_len=mril, read_from=read_from, rank_pools_tokens=ranks
    )


def check_vllm_node(client: httpx.Client, url: str, context_length: int | None, headroom: float) -> NodeResult:
    """Read one vLLM engine (``url``: its base URL) and judge its KV capacity against its context
    (``--context-length``, else ``max_model_len``)."""
    base = url.rstrip("/")
    try:
        r = client.get(base + "/v1/models")
        r.raise_for_status()
        max_model_len = vllm_max_model_len(r.json())
        kv = client.get(base + "/v1/server/kv-cache")
        cap = vllm_capacity_from_endpoint(kv.json()) if kv.status_code == 200 else None
        if cap is None:
            m = client.get(base + "/metrics")
            cap = vllm_capacity_from_metrics(m.text) if m.status_code == 200 else None
    except httpx.HTTPError as e:
        return NodeResult(url, "unreachable", error=f"{type(e).__name__}: {e}"[:300])
    except ValueError as e:  # EnginePoolError included: no max_model_len
        return NodeResult(url, "bad_response", error=str(e)[:300])
    ctx = context_length or max_model_len
    if cap is None:
        error = "no KV capacity (/v1/server/kv-cache, vllm:cache_config_info) - fail closed"
        return NodeResult(url, "no_pool_field", context_length=ctx, error=error)
    limit = effective_pool_limit(ctx, max_model_len, None, headroom)  # the gateway gates on max_model_len
    return _verdict(url, cap.kv_capacity_tokens, cap.source, ctx, headroom, limit=limit, read_from=cap.source)


def check_node(
    client: httpx.Client, url: str, context_length: int | None, headroom: float, pool_source: str = "sglang"
) -> NodeResult:
    """Read one node and judge its pool against ``context_length x headroom``."""
    check = check_vllm_node if pool_source == "vllm" else check_sglang_node
    return check(client, url, context_length, headroom)


def run_gate(
    urls: list[str],
    context_length: int | None,
    headroom: float,
    timeout_seconds: float = 10.0,
    pool_source: str = "sglang",
) -> tuple[int, list[NodeResult]]:
    """Check every node; returns ``(exit_status, results)`` (2 wins over 1 over 0)."""
    with httpx.Client(timeout=timeout_seconds) as client:
        results = [check_node(client, u, context_length, headroom, pool_source) for u in urls]
    if any(r.status not in ("ok", "too_small") for r in results):
        return EXIT_UNKNOWN, results
    if any(r.status == "too_small" for r in results):
        return EXIT_FAIL, results
    return EXIT_OK, results


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """CLI flags of ``kvgate deploy-gate``."""
    parser.add_argument(
        "--server-info-url",
        nargs="+",
        required=True,
        metavar="URL",
        help="server info URL of every prefill node (SGLang /server_info or /get_server_info); "
        "with --pool-source vllm, each engine's base URL",
    )
    parser.add_argument(
        "--pool-source",
        choices=("sglang", "vllm", "kvgate"),
        default="sglang",
        help="how the engine reports its pool (default sglang; kvgate: the bundled backend, SGLang's shape)",
    )
    parser.add_argument(
        "--context-length",
        type=int,
        default=None,
        help="the model's advertised context window (default: the engine's context_length)",
    )
    parser.add_argument(
        "--headroom",
        type=float,
        default=1.25,
        help="the pool must be at least context length x headroom (default 1.25)",
    )
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds per request (default 10)")
    parser.add_argument("--json", action="store_true", help="print one JSON object (for CI)")


def _human(r: NodeResult) -> str:
    if r.status in ("ok", "too_small"):
        verdict = (
            "OK: pool covers the context window"
            if r.status == "ok"
            else "FAIL: pool smaller than context window x headroom; over-length prompts reach the rejection path"
        )
        return (
            f"{r.url}: kv_pool={r.pool_tokens} ({r.pool_field}) context={r.context_length} "
            f"required={r.required_tokens} effective_limit={r.effective_limit_tokens}  {verdict}"
        )
    return f"{r.url}: UNKNOWN ({r.status}): {r.error}"


def run(args: argparse.Namespace) -> int:
    """Entry point; returns the exit status (0/1/2)."""
    if not 1.0 <= args.headroom <= 100.0:  # also nan, which compares false (a traceback before)
        print("kvgate deploy-gate: --headroom must be from 1.0 to 100 (pool.headroom's bounds)", file=sys.stderr)
        return EXIT_UNKNOWN
    if args.context_length is not None and args.context_length < 1:
        print("kvgate deploy-gate: --context-length must be >= 1", file=sys.stderr)
        return EXIT_UNKNOWN
    code, results = run_gate(args.server_info_url, args.context_length, args.headroom, args.timeout, args.pool_source)
    if args.json:
        print(
            json.dumps(
                {
                    "ok": code == EXIT_OK,
                    "exit_code": code,
                    "headroom": args.headroom,
                    "nodes": [asdict(r) for r in results],
                }
            )
        )
    else:
        for r in results:
            print(_human(r))
        print(
            {
                EXIT_OK: "deploy gate: PASS",
                EXIT_FAIL: "deploy gate: FAIL (block the deploy)",
                EXIT_UNKNOWN: "deploy gate: UNKNOWN (fail closed: block the deploy)",
            }[code]
        )
    return code


def main(argv: list[str] | None = None) -> int:
    """``python -m verifier.deploy_gate``."""
    p = argparse.ArgumentParser(prog="kvgate deploy-gate", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
