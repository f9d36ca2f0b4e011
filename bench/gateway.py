"""What the gateway costs: added latency and maximum requests/s against a fast mock upstream.

Side by side, in one run on this machine, with the load from a separate process (``wrk`` with a
Lua script for the POST body; a Python load process when ``wrk`` is absent):

- ``direct``: straight to the mock engine (``bench/mock_engine.py``, raw asyncio);
- ``nginx``: through nginx (one worker, upstream keep-alive) -- skipped with a message when nginx
  is not installed;
- ``relay``: through a featureless FastAPI + httpx relay (this file, ``--relay``): the floor of
  this stack (same framework, server and client as the gateway, nothing else);
- ``gateway``: ``kvgate serve`` with auth, exact counting, the context gate on the live pool and
  metrics on (quotas and verification off: those are scenarios of their own), on its own bounded
  httptools protocol (:mod:`gateway.edge`: header bytes and count, head and body deadlines);
- ``edge-httptools`` / ``edge-h11``: the same app on uvicorn's stock httptools protocol (no header
  bound) or on h11 (header bytes bounded by ``h11_max_incomplete_event_size``): what the bounds
  cost, and what h11 would;
- ``quotas-redis`` / ``quotas-local``: the same gateway with quotas on (RPM, TPM and concurrency
  limits high enough never to refuse) kept in Redis (``$KVGATE_BENCH_REDIS_URL``, default
  ``redis://127.0.0.1:6379/0``; skipped when it does not answer) or in process. The ``+p50-gw``
  column is what the quota stage adds at p50 over ``gateway`` (target: under 0.5 ms).

Per scenario: p50 and p99 latency at 1 connection, requests/s at ``--connections`` (64), and the
added p50/p99 over ``direct``; every scenario is started once and measured in ``--rounds``
interleaved rounds (the table shows medians), so a noisy neighbour on a shared machine hits every
column alike. Target: gateway rps >= relay rps, and gateway p50 added within
0.5 ms of the relay's.

Adding a scenario is one function: decorate ``f(env) -> ContextManager[Target]`` with
``@scenario("name", "what it measures")``; :func:`gateway_target` starts ``kvgate serve`` with
settings overrides (e.g. quotas on Redis, verification sampled at 100%).

Run: ``.venv/bin/python bench/gateway.py [--duration 5] [--connections 64] [--only gateway,relay]``.
"""

import os
import sys

# Run as a script, this folder is sys.path[0]; a bench named like a stdlib module (bench/tokenize.py)
# would shadow it. Benches import nothing from their own folder, so drop it.
if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)

import argparse
import contextlib
import hashlib
import json
import re
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterator

import httpx
import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MODEL = "kvgate-tiny"
BODY = {
    "model": MODEL,
    "messages": [
        {"role": "system", "content": "You are a concise assistant."},
        {
            "role": "user",
            "content": "Call me Ishmael. Some years ago, never mind how long precisely, I thought I would sail about.",
        },
    ],
    "max_tokens": 16,
    "temperature": 0,
}


# ---------------------------------------------------------------- processes
def free_port() -> int:
    """A loopback TCP port that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Env:
    """What a scenario gets: the mock's base URL, a scratch directory, and :meth:`spawn` for
    processes that are stopped when the scenario ends."""

    mock_url: str
    tmp: Path
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def spawn(self, name: str, cmd: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        """Start ``cmd`` (output to ``<tmp>/<name>.log``) in its own process group."""
        log = open(self.tmp / f"{name}.log", "wb")  # noqa: SIM115 - handed to the child
        p = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
        log.close()
        self.procs.append(p)
        return p

    def log_tail(self, name: str) -> str:
        """The last lines of a spawned process's log."""
        try:
            return "\n".join((self.tmp / f"{name}.log").read_text(errors="replace").splitlines()[-15:])
        except OSError:
            return ""


def stop(p: subprocess.Popen[bytes]) -> None:
    """SIGTERM the process group, SIGKILL after 10 s."""
    if p.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(5)


def wait_http(
    url: str, proc: subprocess.Popen[bytes] | None = None, timeout: float = 60.0, headers: dict[str, str] | None = None
) -> None:
    """Poll ``url`` until it answers 200; raise ``RuntimeError`` if ``proc`` exits or on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited ({proc.returncode}) before {url} answered")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2, headers=headers, trust_env=False).status_code == 200:
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not answer 200 within {timeout:.0f} s")
        time.sleep(0.1)


# ---------------------------------------------------------------- scenarios
@dataclass
class Target:
    """Where a scenario's load goes: ``url`` of the POST, ``headers`` to send, ``note`` for the table."""

    url: str
    headers: dict[str, str] = field(default_factory=dict)
    note: str = ""


class Skip(Exception):
    """A scenario cannot run here (e.g. nginx not installed); the message says why."""


Scenario = Callable[[Env], ContextManager[Target]]
SCENARIOS: dict[str, tuple[Scenario, str]] = {}


def scenario(name: str, help_: str) -> Callable[[Callable[[Env], Iterator[Target]]], Scenario]:
    """Register a scenario: a generator function ``f(env)`` that starts what it needs, yields a
    :class:`Target`, and stops it afterwards (raise :class:`Skip` to leave the column out)."""

    def register(fn: Callable[[Env], Iterator[Target]]) -> Scenario:
        cm = contextlib.contextmanager(fn)
        SCENARIOS[name] = (cm, help_)
        return cm

    return register


@scenario("direct", "load straight to the mock engine (the baseline)")
def _direct(env: Env) -> Iterator[Target]:
    yield Target(env.mock_url + "/v1/chat/completions")


NGINX_CONF = """
worker_processes 1;
{user}
error_log {tmp}/nginx-error.log warn;
pid {tmp}/nginx.pid;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  client_body_temp_path {tmp}/nginx-body; proxy_temp_path {tmp}/nginx-proxy;
  fastcgi_temp_path {tmp}/nginx-fcgi; uwsgi_temp_path {tmp}/nginx-uwsgi; scgi_temp_path {tmp}/nginx-scgi;
  upstream mock {{ server {upstream}; keepalive 128; }}
  server {{
    listen 127.0.0.1:{port};
    location / {{
      proxy_pass http://mock;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
    }}
  }}
}}
"""


@scenario("nginx", "through nginx (1 worker, upstream keep-alive)")
def _nginx(env: Env) -> Iterator[Target]:
    nginx = shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.access(p, os.X_OK)), None
    )
    if nginx is None:
        raise Skip("nginx is not installed (apt-get install -y nginx)")
    port = free_port()
    conf = env.tmp / "nginx.conf"
    conf.write_text(
        NGINX_CONF.format(
            tmp=env.tmp,
            port=port,
            upstream=env.mock_url.removeprefix("http://"),
            user="user root;" if os.geteuid() == 0 else "",
        )
    )
    p = env.spawn("nginx", [nginx, "-p", str(env.tmp), "-c", str(conf), "-g", "daemon off;"])
    wait_http(f"http://127.0.0.1:{port}/health", p)
    yield Target(f"http://127.0.0.1:{port}/v1/chat/completions")


@scenario("relay", "featureless FastAPI + httpx relay (the floor of this stack)")
def _relay(env: Env) -> Iterator[Target]:
    port = free_port()
    p = env.spawn(
        "relay",
        [sys.executable, str(Path(__file__).resolve()), "--relay", "--port", str(port), "--upstream", env.mock_url],
    )
    wait_http(f"http://127.0.0.1:{port}/health", p)
    yield Target(f"http://127.0.0.1:{port}/v1/chat/completions")


@contextlib.contextmanager
def gateway_target(
    env: Env,
    *,
    name: str = "gateway",
    log_level: str = "warning",
    tenant: dict[str, Any] | None = None,
    protocol: str | None = None,
    **overrides: Any,
) -> Iterator[Target]:
    """Run ``kvgate serve`` in front of the mock with settings ``overrides`` (top-level keys of
    ``kvgate.yaml``, sections merged: e.g. ``quotas={"enabled": True}``, ``redis_url=...``)
    and one bench tenant with a fresh key (``tenant``: fields added to its entry, e.g. limits);
    yield its :class:`Target`. ``protocol`` (``httptools``, ``h11``): the same app served by this
    file's ``--serve-gateway`` under that uvicorn protocol instead of ``kvgate serve``'s own
    (:mod:`gateway.edge`'s bounded httptools)."""
    port = free_port()
    key = "sk-bench-" + secrets.token_hex(16)
    settings: dict[str, Any] = {
        "gateway": {"host": "127.0.0.1", "port": port, "log_level": log_level},
        "quotas": {"enabled": False},
        "verifier": {"enabled": False},
        "redis_url": None,
        "state_dir": str(env.tmp / f"{name}-state"),
        "models": [{"id": MODEL, "context_length": 8192, "tokenizer": {"kind": "bundled"}}],
        "upstreams": [
            {
                "name": "mock",
                "api_url": env.mock_url + "/v1",
                "pool_source": "kvgate",
                "pool_urls": [env.mock_url + "/server_info"],
                "models": [MODEL],
            }
        ],
    }
    for k, v in overrides.items():
        settings[k] = {**settings[k], **v} if isinstance(v, dict) and isinstance(settings.get(k), dict) else v
    tenants = {
        "tenants": [
            {
                "id": "bench",
                "api_key_sha256": [hashlib.sha256(key.encode()).hexdigest()],
                "default_max_tokens": 16,
                "allowed_models": [MODEL],
                **(tenant or {}),
            }
        ]
    }
    (env.tmp / f"{name}.yaml").write_text(yaml.safe_dump(settings, sort_keys=False))
    (env.tmp / f"{name}-tenants.yaml").write_text(yaml.safe_dump(tenants, sort_keys=False))
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}
    files = ["--config", str(env.tmp / f"{name}.yaml"), "--tenants", str(env.tmp / f"{name}-tenants.yaml")]
    if protocol is None:
        cmd = [sys.executable, "-m", "gateway.cli", "serve", *files]
    else:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--serve-gateway", protocol, *files]
    p = env.spawn(name, cmd, env={**clean, "PYTHONPATH": str(ROOT)})
    try:
        wait_http(f"http://127.0.0.1:{port}/readyz", p)
    except RuntimeError as e:
        raise RuntimeError(f"{e}\n{env.log_tail(name)}") from None
    yield Target(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        {"Authorization": f"Bearer {key}"},
        note=f"log level {log_level}",
    )


@scenario("gateway", "kvgate serve: auth, exact counting, context gate, metrics (quotas, verifier off)")
def _gateway(env: Env) -> Iterator[Target]:
    with gateway_target(env) as t:
        yield t


@scenario("edge-httptools", "the gateway app on uvicorn's stock httptools protocol: no bound on header bytes or count")
def _edge_httptools(env: Env) -> Iterator[Target]:
    with gateway_target(env, name="edge-httptools", protocol="httptools") as t:
        yield t


@scenario("edge-h11", "the gateway app on uvicorn's h11 protocol (bounds header bytes, not their count)")
def _edge_h11(env: Env) -> Iterator[Target]:
    with gateway_target(env, name="edge-h11", protocol="h11") as t:
        yield t


def serve_gateway(protocol: str, config: str, tenants: str) -> None:
    """``kvgate serve``'s app (same settings, stages and secrets) under uvicorn's ``protocol``
    (``httptools`` stock, or ``h11`` with ``h11_max_incomplete_event_size`` = the header limit),
    without :mod:`gateway.edge`: the alternatives the ``edge-*`` scenarios measure."""
    import uvicorn

    from config.loader import load_settings
    from config.secrets import load_secrets
    from gateway.app import create_app
    from gateway.commands.serve import build_stages
    from gateway.tenants import TenantRegistry

    settings = load_settings(config)
    registry = TenantRegistry.from_path(tenants, settings)
    secrets_ = load_secrets(settings.state_dir)
    quotas, verifier = build_stages(settings, secrets_)
    app = create_app(settings, registry, quotas=quotas, verifier=verifier, secrets=secrets_)
    g = settings.gateway
    uvicorn.Server(
        uvicorn.Config(
            app,
            host=g.host,
            port=g.port,
            http=protocol,
            h11_max_incomplete_event_size=g.max_header_bytes,
            timeout_keep_alive=g.keepalive_timeout_seconds,
            log_level="warning",
            access_log=False,
            log_config=None,
            lifespan="on",
            server_header=False,
        )
    ).run()


@scenario("gateway-logged", "the gateway scenario with its JSON access log on (log level info, to a file)")
def _gateway_logged(env: Env) -> Iterator[Target]:
    with gateway_target(env, name="gateway-logged", log_level="info") as t:
        yield t


#: limits that the bench load never reaches, so every request runs the whole quota stage
BENCH_LIMITS = {"rpm": 10**9, "tpm": 10**12, "max_concurrent": 10**6}


@scenario("quotas-redis", "gateway + quotas in Redis (reserve + settle scripts per request)")
def _quotas_redis(env: Env) -> Iterator[Target]:
    import redis

    url = os.environ.get("KVGATE_BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")
    try:
        redis.Redis.from_url(url, socket_timeout=1, socket_connect_timeout=1).ping()
    except redis.RedisError as e:
        raise Skip(f"Redis at {url} does not answer ({type(e).__name__})") from None
    tenant = {"id": f"bench-{secrets.token_hex(4)}", **BENCH_LIMITS}  # own keys; they expire after the window
    with gateway_target(env, name="quotas-redis", tenant=tenant, redis_url=url, quotas={"enabled": True}) as t:
        yield t


@scenario("quotas-local", "gateway + quotas in process (no Redis URL)")
def _quotas_local(env: Env) -> Iterator[Target]:
    with gateway_target(env, name="quotas-local", tenant=BENCH_LIMITS, quotas={"enabled": True}) as t:
        yield t


@scenario("verify-0", "gateway + verifier on, sampling 0% (every prompt still goes into the leak index)")
def _verify_0(env: Env) -> Iterator[Target]:
    with gateway_target(env, name="verify-0", tenant={"verify_sample_rate": 0.0}, verifier={"enabled": True}) as t:
        yield t


@scenario("verify-100", "gateway + verifier on, sampling 100% (every response checked in the background)")
def _verify_100(env: Env) -> Iterator[Target]:
    with gateway_target(env, name="verify-100", tenant={"verify_sample_rate": 1.0}, verifier={"enabled": True}) as t:
        yield t


@scenario("verify-strict", "gateway + verifier on, strict tenant (checked before release)")
def _verify_strict(env: Env) -> Iterator[Target]:
    with gateway_target(env, name="verify-strict", tenant={"strict_verify": True}, verifier={"enabled": True}) as t:
        yield t


# ---------------------------------------------------------------- load
@dataclass
class Load:
    """One load run's result: requests/s, latency percentiles in ms, failed requests."""

    rps: float
    p50_ms: float
    p99_ms: float
    errors: int
    requests: int


WRK_LUA = """
wrk.method = "POST"
wrk.body = {body}
wrk.headers["Content-Type"] = "application/json"
{headers}
"""
_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3}


def _ms(text: str) -> float:
    m = re.fullmatch(r"([\d.]+)(us|ms|s)", text.strip())
    if not m:
        raise ValueError(f"cannot parse wrk latency {text!r}")
    return float(m.group(1)) * _UNITS[m.group(2)]


def run_wrk(target: Target, connections: int, duration: float, tmp: Path) -> Load:
    """``wrk --latency`` with a Lua script for the POST (threads: 1 per 32 connections, at most 2)."""
    lua = tmp / "post.lua"
    headers = "\n".join(f"wrk.headers[{json.dumps(k)}] = {json.dumps(v)}" for k, v in target.headers.items())
    lua.write_text(WRK_LUA.format(body=json.dumps(json.dumps(BODY)), headers=headers))
    threads = max(1, min(2, connections // 32))
    out = subprocess.run(
        [
            "wrk",
            "-t",
            str(threads),
            "-c",
            str(connections),
            "-d",
            f"{duration:.0f}s",
            "--latency",
            "--timeout",
            "10s",
            "-s",
            str(lua),
            target.url,
        ],
        capture_output=True,
        text=True,
        timeout=duration + 60,
    )
    text = out.stdout
    if out.returncode != 0 or "Requests/sec" not in text:
        raise RuntimeError(f"wrk failed: {out.stderr or text}")
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", text).group(1))  # type: ignore[union-attr]
    dist = text.split("Latency Distribution", 1)[-1]
    pct = dict(re.findall(r"(\d+)%\s+([\d.]+(?:us|ms|s))", dist))
    if "50" not in pct or "99" not in pct:
        raise RuntimeError(f"cannot read wrk's latency distribution:\n{text}")
    total = int(re.search(r"(\d+) requests in", text).group(1))  # type: ignore[union-attr]
    non2xx = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", text)
    sock = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", text)
    errors = (int(non2xx.group(1)) if non2xx else 0) + (sum(map(int, sock.groups())) if sock else 0)
    return Load(rps, _ms(pct["50"]), _ms(pct["99"]), errors, total)


def run_py_load(target: Target, connections: int, duration: float, tmp: Path) -> Load:
    """The same load from a separate Python process (this file, ``--load``) when wrk is absent."""
    out = subprocess.run(
        [
            sys.executable,
            str(Path(__file__).resolve()),
            "--load",
            "--url",
            target.url,
            "--connections",
            str(connections),
            "--duration",
            str(duration),
            "--headers",
            json.dumps(target.headers),
        ],
        capture_output=True,
        text=True,
        timeout=duration + 60,
    )
    if out.returncode != 0:
        raise RuntimeError(f"load process failed: {out.stderr[-2000:]}")
    return Load(**json.loads(out.stdout.strip().splitlines()[-1]))


async def _py_load(url: str, connections: int, duration: float, headers: dict[str, str]) -> dict[str, Any]:
    import asyncio

    u = httpx.URL(url)
    body = json.dumps(BODY).encode()
    head = (
        f"POST {u.raw_path.decode()} HTTP/1.1\r\nHost: {u.host}:{u.port}\r\nContent-Type: application/json\r\n"
        + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        + f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    lat: list[float] = []
    errors = 0
    end = time.perf_counter() + duration

    async def conn() -> None:
        nonlocal errors
        reader, writer = await asyncio.open_connection(u.host, u.port)
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            writer.write(head)
            status_line = await reader.readline()
            length, chunked = 0, False
            while (line := await reader.readline()) not in (b"\r\n", b""):
                k, _, v = line.decode().partition(":")
                if k.lower() == "content-length":
                    length = int(v)
                elif k.lower() == "transfer-encoding" and "chunked" in v.lower():
                    chunked = True
            if chunked:
                while (size := int((await reader.readline()).strip() or b"0", 16)) > 0:
                    await reader.readexactly(size + 2)
                await reader.readline()
            else:
                await reader.readexactly(length)
            lat.append(time.perf_counter() - t0)
            if b" 200 " not in status_line:
                errors += 1
        writer.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(conn() for _ in range(connections)))
    elapsed = time.perf_counter() - t0
    lat.sort()
    q = lambda f: lat[min(len(lat) - 1, int(f * len(lat)))] * 1000  # noqa: E731
    return {"rps": len(lat) / elapsed, "p50_ms": q(0.5), "p99_ms": q(0.99), "errors": errors, "requests": len(lat)}


# ---------------------------------------------------------------- the relay (featureless floor)
def relay_app(upstream: str) -> Any:
    """FastAPI app that forwards every POST body to ``upstream`` with one pooled httpx client and
    returns the answer: no auth, no parsing, no counting, no metrics."""
    from fastapi import FastAPI, Request, Response

    client = httpx.AsyncClient(
        base_url=upstream,
        timeout=30,
        limits=httpx.Limits(max_connections=512, max_keepalive_connections=512),
        trust_env=False,
    )
    app = FastAPI()

    @app.get("/health")
    async def health() -> Response:
        return Response(b"", 200)

    @app.post("/v1/{path:path}")
    async def forward(path: str, request: Request) -> Response:
        r = await client.post(
            "/v1/" + path,
            content=await request.body(),
            headers={"content-type": request.headers.get("content-type", "application/json")},
        )
        return Response(r.content, r.status_code, media_type=r.headers.get("content-type"))

    return app


# ---------------------------------------------------------------- main
def median_load(runs: list[tuple[Load, Load]]) -> Load:
    """Medians over rounds of (1-connection run, N-connection run): p50/p99 from the former,
    requests/s from the latter; errors and requests summed."""
    import statistics

    return Load(
        statistics.median(m.rps for _, m in runs),
        statistics.median(o.p50_ms for o, _ in runs),
        statistics.median(o.p99_ms for o, _ in runs),
        sum(o.errors + m.errors for o, m in runs),
        sum(o.requests + m.requests for o, m in runs),
    )


def fmt_table(rows: list[tuple[str, Load | str, str]]) -> str:
    """The side-by-side table: latency at 1 connection, rps at N, added over direct, ratio to relay."""
    base = next((r for n, r, _ in rows if n == "direct" and isinstance(r, Load)), None)
    relay = next((r for n, r, _ in rows if n == "relay" and isinstance(r, Load)), None)
    gw = next((r for n, r, _ in rows if n == "gateway" and isinstance(r, Load)), None)
    head = (
        f"{'scenario':<16} {'p50 ms':>8} {'p99 ms':>8} {'+p50 ms':>8} {'+p99 ms':>8} {'rps':>9} "
        f"{'rps/relay':>9} {'+p50-relay':>10} {'+p50-gw':>8} {'rps/gw':>6} {'errors':>6}  note"
    )
    lines = [head, "-" * len(head)]
    for name, r, note in rows:
        if not isinstance(r, Load):
            lines.append(f"{name:<16} {'skipped: ' + r}")
            continue
        lat1 = r
        add50 = f"{lat1.p50_ms - base.p50_ms:8.3f}" if base else f"{'':>8}"
        add99 = f"{lat1.p99_ms - base.p99_ms:8.3f}" if base else f"{'':>8}"
        ratio = f"{r.rps / relay.rps:9.2f}" if relay else f"{'':>9}"
        vs_relay = f"{lat1.p50_ms - relay.p50_ms:10.3f}" if relay else f"{'':>10}"
        vs_gw = f"{lat1.p50_ms - gw.p50_ms:8.3f}" if gw else f"{'':>8}"
        rps_gw = f"{r.rps / gw.rps:6.2f}" if gw else f"{'':>6}"
        lines.append(
            f"{name:<16} {lat1.p50_ms:8.3f} {lat1.p99_ms:8.3f} {add50} {add99} {r.rps:9.0f} {ratio} "
            f"{vs_relay} {vs_gw} {rps_gw} {r.errors:6d}  {note}"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=5.0, help="seconds per load run (default 5)")
    ap.add_argument("--connections", type=int, default=64, help="connections for the requests/s run (default 64)")
    ap.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="interleaved rounds over all scenarios; the table shows medians (default 3)",
    )
    ap.add_argument("--only", default="", help="comma-separated scenarios (default: all): " + ", ".join(SCENARIOS))
    ap.add_argument("--load", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--relay", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--url", help=argparse.SUPPRESS)
    ap.add_argument("--headers", default="{}", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--upstream", help=argparse.SUPPRESS)
    ap.add_argument("--serve-gateway", choices=["httptools", "h11"], help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    ap.add_argument("--tenants", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_gateway:
        serve_gateway(args.serve_gateway, args.config, args.tenants)
        return 0

    if args.load:  # the separate load process
        import asyncio

        print(json.dumps(asyncio.run(_py_load(args.url, args.connections, args.duration, json.loads(args.headers)))))
        return 0
    if args.relay:
        import uvicorn

        uvicorn.run(
            relay_app(args.upstream),
            host="127.0.0.1",
            port=args.port,
            log_level="warning",
            access_log=False,
            server_header=False,
        )
        return 0

    names = [n for n in (args.only.split(",") if args.only else SCENARIOS) if n]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        ap.error(f"unknown scenario(s) {', '.join(unknown)}; known: {', '.join(SCENARIOS)}")
    load = run_wrk if shutil.which("wrk") else run_py_load
    print(
        f"load generator: {'wrk (Lua POST script)' if load is run_wrk else 'Python load process (wrk not installed)'}; "
        f"{args.duration:.0f} s per run; latency at 1 connection, requests/s at {args.connections}; "
        f"{args.rounds} interleaved round(s), medians; {os.cpu_count()} CPUs",
        flush=True,
    )
    tmp = Path(tempfile.mkdtemp(prefix="kvgate-bench-"))
    os.chmod(tmp, 0o755)
    mock_port = free_port()
    env = Env(f"http://127.0.0.1:{mock_port}", tmp)
    mock = env.spawn("mock", [sys.executable, str(HERE / "mock_engine.py"), "--port", str(mock_port), "--model", MODEL])
    rows: list[tuple[str, Load | str, str]] = []
    runs: dict[str, list[tuple[Load, Load]]] = {}
    try:
        wait_http(env.mock_url + "/health", mock)
        with contextlib.ExitStack() as running:
            targets: dict[str, tuple[Target, str]] = {}
            skipped: dict[str, str] = {}
            for name in names:  # start every scenario's processes; they idle while others are measured
                fn, help_ = SCENARIOS[name]
                try:
                    target = running.enter_context(fn(env))
                except Skip as e:
                    skipped[name] = str(e)
                    print(f"  {name}: skipped ({e})", flush=True)
                    continue
                probe = httpx.post(target.url, json=BODY, headers=target.headers, timeout=10, trust_env=False)
                if probe.status_code != 200:
                    raise RuntimeError(f"{name}: probe request answered {probe.status_code}: {probe.text[:300]}")
                load(target, 1, 1.0, tmp)  # warm-up
                targets[name] = (target, target.note or help_)
            for rnd in range(1, args.rounds + 1):  # interleaved rounds: a noisy neighbour hits all alike
                for name, (target, _) in targets.items():
                    one = load(target, 1, args.duration, tmp)
                    many = load(target, args.connections, args.duration, tmp)
                    runs.setdefault(name, []).append((one, many))
                    print(
                        f"  round {rnd} {name}: p50 {one.p50_ms:.3f} ms, p99 {one.p99_ms:.3f} ms, {many.rps:.0f} req/s",
                        flush=True,
                    )
            for name in names:
                if name in skipped:
                    rows.append((name, skipped[name], ""))
                elif name in runs:
                    rows.append((name, median_load(runs[name]), targets[name][1]))
    finally:
        for p in env.procs:
            stop(p)
        shutil.rmtree(tmp, ignore_errors=True)
    print()
    print(fmt_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
