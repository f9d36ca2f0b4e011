"""``kvgate deploy-gate``: the runbook's signal 1, read from the running engines.

For every ``--server-info-url`` (each prefill node), read the live KV pool (SGLang ``GET
/server_info``, falling back to ``/get_server_info``; field ``max_total_num_tokens``, or the
runbook's alternatives ``kv_pool_tokens`` / ``max_total_tokens``) and the context length
(``--context-length``, else the engine's ``context_length``). The gate passes when every pool
is at least ``context_length x headroom`` (headroom 1.25 as in the runbook).

Exit status (DESIGN.md, Contracts): 0 every pool covers the window, 1 at least one pool is
smaller, 2 a node is unreachable, answers garbage, or reports no pool size or context length
(fail closed). ``--json`` prints one JSON object for CI; the default is one line per node.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from decimal import Decimal
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx

from config.pool import effective_pool_limit

#: server_info fields that carry the pool, in order of preference (runbook, signal 1)
POOL_FIELDS = ("max_total_num_tokens", "kv_pool_tokens", "max_total_tokens")

EXIT_OK, EXIT_FAIL, EXIT_UNKNOWN = 0, 1, 2


@dataclass
class NodeResult:
    """One node's verdict. ``status``: ``ok``, ``too_small``, ``unreachable``, ``no_pool_field``,
    ``no_context_length`` or ``bad_response``. Token counts are ``None`` when unknown."""

    url: str
    status: str
    pool_tokens: int | None = None
    pool_field: str | None = None
    context_length: int | None = None
    required_tokens: int | None = None
    effective_limit_tokens: int | None = None
    max_req_input_len: int | None = None
    error: str | None = None


def pool_tokens_of(info: dict[str, Any]) -> tuple[int, str] | None:
    """The pool size and the field it came from, or ``None`` when no known field holds a
    positive integer (SGLang server_info names; the runbook's ``kv_pool_tokens`` function)."""
    for key in POOL_FIELDS:
        v = info.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v, key
    return None


def _fallback_url(url: str) -> str | None:
    parts = urlsplit(url)
    path = parts.path.rstrip("/")
    if path.endswith("/get_server_info"):
        return None
    base = path[: -len("/server_info")] if path.endswith("/server_info") else path
    return urlunsplit(parts._replace(path=base + "/get_server_info"))


def fetch_server_info(client: httpx.Client, url: str) -> dict[str, Any]:
    """GET ``url`` (then ``.../get_server_info`` when it answers 404), JSON object expected.
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


def check_node(client: httpx.Client, url: str, context_length: int | None, headroom: float) -> NodeResult:
    """Read one node and judge its pool against ``context_length x headroom``."""
    try:
        info = fetch_server_info(client, url)
    except httpx.HTTPError as e:
        return NodeResult(url, "unreachable", error=f"{type(e).__name__}: {e}"[:300])
    except ValueError as e:
        return NodeResult(url, "bad_response", error=str(e)[:300])
    found = pool_tokens_of(info)
    ctx = context_length
    if ctx is None:
        c = info.get("context_length")
        ctx = c if isinstance(c, int) and not isinstance(c, bool) and c > 0 else None
    mril = info.get("max_req_input_len")
    mril = mril if isinstance(mril, int) and not isinstance(mril, bool) and mril > 0 else None
    if found is None:
        return NodeResult(
            url,
            "no_pool_field",
            context_length=ctx,
            max_req_input_len=mril,
            error=f"none of {', '.join(POOL_FIELDS)} in server info - fail closed",
        )
    pool, field_name = found
    if ctx is None:
        return NodeResult(
            url,
            "no_context_length",
            pool,
            field_name,
            max_req_input_len=mril,
            error="no --context-length given and the engine reports none - fail closed",
        )
    required = Decimal(ctx) * Decimal(repr(float(headroom)))
    required_tokens = int(required) if required == int(required) else int(required) + 1
    limit = effective_pool_limit(ctx, pool, mril, headroom)
    status = "ok" if Decimal(pool) >= required else "too_small"
    return NodeResult(url, status, pool, field_name, ctx, required_tokens, limit, mril)


def run_gate(
    urls: list[str], context_length: int | None, headroom: float, timeout_seconds: float = 10.0
) -> tuple[int, list[NodeResult]]:
    """Check every node; returns ``(exit_status, results)`` (2 wins over 1 over 0)."""
    with httpx.Client(timeout=timeout_seconds) as client:
        results = [check_node(client, u, context_length, headroom) for u in urls]
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
        help="server info URL of every prefill node (SGLang /server_info or /get_server_info)",
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
    if args.headroom < 1.0:
        print("kvgate deploy-gate: --headroom must be >= 1.0", file=sys.stderr)
        return EXIT_UNKNOWN
    if args.context_length is not None and args.context_length < 1:
        print("kvgate deploy-gate: --context-length must be >= 1", file=sys.stderr)
        return EXIT_UNKNOWN
    code, results = run_gate(args.server_info_url, args.context_length, args.headroom, args.timeout)
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
