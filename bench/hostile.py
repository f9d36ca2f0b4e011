"""Hostile load, side by side in one run: normal traffic at a fixed rate alone, then the same
traffic while attackers hit the same gateway (all on loopback, bounded in count and time).

One ``kvgate serve``-equivalent gateway process (this file, ``--serve``: the same app, stages,
secrets and server layer as ``kvgate serve``, plus a ``/__bench/lag`` route that reports the
event loop's lag, sampled every 5 ms, and the process's RSS) in front of two upstreams:
``bench/mock_engine.py`` for the normal traffic and an engine of this file (``--evil-engine``)
whose streams send one 8 MiB event in 16 KiB writes.

Phases (``--seconds`` each):

1. ``idle``: normal traffic alone: ``--rate`` chat requests/s (open loop, each on time whatever
   the others do), p50/p99 latency;
2. ``attack``: the same traffic while these run against the same gateway:
   - slowloris: ``--slowloris`` sockets (half with a valid key) that send ``Content-Length:
     8000000`` and trickle the body one byte a second, reconnecting when closed; plus 50 sockets
     that trickle a request head;
   - giant prompt lists (an attacker tenant, one at a time): ``prompt: [""] * 2_000_000``,
     ``prompt: [1] * 2_000_000`` (two million token ids), 200,000 messages (7 MB);
   - an 8 MiB SSE event from the evil engine, one stream at a time;
   - oversized headers: an 8 MiB header (sent in 64 KiB pieces until refused) and 20,000 headers;
   - chunked trickle: 8 sockets sending a 1 MiB body in 1-byte chunks, half without a key;
   - connection hog: 400 idle sockets from one address (:data:`HOG_ADDR`), each reopened when closed;
   - pipelined 401s: 20 sockets writing 40 pipelined ``GET /v1/models`` without a key at once;
   (before it, a column of its own: a tenant held to ``rpm: 1, max_concurrent: 1`` floods heavy
   chats of 270 KB, :data:`FLOOD_SENDERS` at a time: goal, normal p50 within 1.5x idle; and
   another, ``loop-flood``: the attacker tenant floods chats just under
   ``gateway.offload_count_chars``, each counted on the event loop while its share of the loop
   lasts, :data:`LOOP_FLOOD_SENDERS` at a time: goal, normal p50 within 1.5x idle);
3. ``rate``: the same traffic and attackers, but each attack starts ``--attack-rate`` tries a
   second (20) whatever the answers, at most its closed-loop count in flight;
4. ``after``: 10 s after the attack stops, the gateway's RSS again.

In the ``attack`` column every attacker is closed loop (its next request as soon as the last is
answered), so the faster the gateway refuses, the more it is sent; the ``rate`` column holds the
attack's rate fixed instead. The attackers connect from 127.0.0.2-10 (other machines to the
gateway's per-address share), the normal traffic from 127.0.0.1. With two or more CPUs (``--pin``, the default) the
gateway runs alone on the first and everything else (this process, the engines, the attackers,
the control loop) on the others: they stand in for other machines and take no CPU time from the
gateway's core; ``--no-pin`` shares every CPU. The attackers and the evil engine run at the
scheduler's idle priority (``SCHED_IDLE``): on CPU time nothing else wants, so that they do not
delay the load generator and the mock engine (whose wake-ups are the normal traffic's latency);
with ``--pin`` the load generator, the mock engine and the control loop run at a real-time
priority (``SCHED_RR``, where allowed), in both columns alike.

Reported: normal traffic's p50/p99 and the event loop's lag p99/max in both columns, the same lag
of a control process that runs nothing but its own idle loop (what the machine's scheduler alone
costs a loop: on a shared machine, lag the gateway's code did not cause), the gateway process's CPU
use (percent of one core, every thread), its garbage collections (count and longest, per
generation), the attackers' answers (status counts), the RSS before
the attack, its peak and its growth 10 s after it. Goals (issue "Hold up under hostile load"): p99
under attack within 2x idle p99, loop lag p99 <= 10 ms, RSS growth <= 50 MB.

Run: ``.venv/bin/python bench/hostile.py [--seconds 15] [--rate 40] [--slowloris 200]``.
"""

import os
import sys

# Run as a script, this folder is sys.path[0]; a bench named like a stdlib module (bench/tokenize.py)
# would shadow it. Benches import nothing from their own folder, so drop it.
if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)

import argparse
import asyncio
import contextlib
import hashlib
import itertools
import json
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MODEL = "kvgate-tiny"
EVIL = "evil-stream"
#: the mock model's context (its pool holds 1.5x): room for the rate-limited tenant's heavy chat
CONTEXT = 131_072
CHAT = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Call me Ishmael. Some years ago I thought I would sail about."}],
    "max_tokens": 8,
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


# ---------------------------------------------------------------- the gateway process (--serve)
def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


class LagProbe:
    """ASGI wrapper: ``GET /__bench/lag`` returns (and with ``?reset=1`` restarts) the loop-lag
    samples (ms) and RSS (bytes: now and the peak since the reset); everything else goes to the app."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.state = app.state
        self.lags: list[float] = []
        self.gcs: list[tuple[int, float]] = []  # (generation, ms) of each collection
        self._gc_t = 0.0
        import gc

        gc.callbacks.append(self._gc)
        self.rss_peak = 0
        self.cpu0 = time.process_time()  # this process's CPU seconds (every thread) at the reset
        self.wall0 = time.perf_counter()
        self.task: asyncio.Task[None] | None = None

    def _gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_t = time.perf_counter()
        else:
            self.gcs.append((info["generation"], (time.perf_counter() - self._gc_t) * 1000))

    async def _sample(self) -> None:
        n = 0
        while True:
            t = time.perf_counter()
            await asyncio.sleep(0.005)
            self.lags.append((time.perf_counter() - t - 0.005) * 1000)
            n += 1
            if n % 20 == 0:
                self.rss_peak = max(self.rss_peak, rss_bytes())

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        import gc

        if scope["type"] != "http" or scope["path"] != "/__bench/lag":
            await self.app(scope, receive, send)
            return
        if self.task is None:
            self.task = asyncio.ensure_future(self._sample())
        lags, now = self.lags, rss_bytes()
        out = {
            "n": len(lags),
            "p50": pct(lags, 0.5),
            "p99": pct(lags, 0.99),
            "max": max(lags, default=float("nan")),
            "rss": now,
            "rss_peak": max(self.rss_peak, now),
            "gc": {
                g: [sum(1 for k, _ in self.gcs if k == g), max((ms for k, ms in self.gcs if k == g), default=0.0)]
                for g in (0, 1, 2)
            },
            "objects": len(gc.get_objects()),
            "top_types": Counter(type(o).__name__ for o in gc.get_objects()).most_common(12)
            if b"types=1" in scope.get("query_string", b"")
            else [],
            "cpu_pct": 100 * (time.process_time() - self.cpu0) / max(time.perf_counter() - self.wall0, 1e-9),
        }
        if b"reset=1" in scope.get("query_string", b""):
            self.lags, self.rss_peak, self.gcs = [], now, []
            self.cpu0, self.wall0 = time.process_time(), time.perf_counter()
        body = json.dumps(out).encode()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})


def serve(config: str, tenants: str) -> int:
    """``kvgate serve``'s app under its own server layer (:func:`gateway.edge.server.run_server`),
    wrapped in :class:`LagProbe`."""
    from config.loader import load_settings
    from config.secrets import load_secrets
    from gateway.app import create_app
    from gateway.commands.serve import build_stages
    from gateway.edge.server import raise_fd_limit, run_server
    from gateway.ops.access_log import setup_logging
    from gateway.ops.tenants import TenantRegistry

    settings = load_settings(config)
    raise_fd_limit(settings)
    registry = TenantRegistry.from_path(tenants, settings)
    setup_logging("warning")
    secrets_ = load_secrets(settings.state_dir)
    quotas, verifier = build_stages(settings, secrets_)
    app = create_app(settings, registry, quotas=quotas, verifier=verifier, secrets=secrets_)
    return run_server(LagProbe(app), settings.gateway.host, settings.gateway.port, log_level="warning")


# ---------------------------------------------------------------- the evil engine (--evil-engine)
async def evil_engine(port: int) -> None:
    """server_info for the pool; every completion is a stream whose second event is 8 MiB."""
    info = json.dumps({"max_total_num_tokens": 1 << 20, "context_length": 8192, "page_size": 16}).encode()
    first = b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'

    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await r.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                if length:
                    await r.readexactly(length)
                if head.startswith(b"GET") and not head.startswith(b"GET /server_info"):
                    w.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")  # /v1/loads: none
                    await w.drain()
                    continue
                if head.startswith(b"GET"):
                    w.write(
                        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(info)
                    )
                    w.write(info)
                    await w.drain()
                    continue
                w.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n" + first)
                piece = b"x" * 16384
                w.write(b"data: ")
                for _ in range(512):  # 8 MiB, never terminated
                    w.write(piece)
                    await w.drain()
                break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            w.close()

    server = await asyncio.start_server(handle, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


# ---------------------------------------------------------------- the bench
class Run:
    """The processes of one run and the keys of its two tenants."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[subprocess.Popen[bytes]] = []
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.normal_key = "sk-normal-" + secrets.token_hex(16)
        self.attack_key = "sk-attack-" + secrets.token_hex(16)
        self.gateway_cpus: set[int] | None = None  # --pin: the gateway's own CPU

    def spawn(
        self, name: str, argv: list[str], cpus: set[int] | None = None, idle: bool = False, rr: bool = False
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` (its output in ``name``.log), on ``cpus`` when given (else this
        process's own), at idle priority when ``idle`` (:func:`attacker_priority`), at the load
        generator's when ``rr`` (:func:`generator_priority`)."""
        log = open(self.tmp / f"{name}.log", "wb")  # noqa: SIM115 - handed to the child
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}
        env["PYTHONPATH"] = str(ROOT)

        def setup() -> None:
            if cpus:
                os.sched_setaffinity(0, cpus)
            if idle:
                attacker_priority()
            if rr:
                generator_priority()

        p = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True, preexec_fn=setup
        )
        self.procs.append(p)
        return p

    def start(self) -> None:
        import yaml

        mock, evil = free_port(), free_port()
        self.spawn(
            "mock",
            [sys.executable, str(HERE / "mock_engine.py"), "--port", str(mock), "--model", MODEL]
            + ["--context-length", str(CONTEXT), "--pool-tokens", str(CONTEXT * 3 // 2)],  # the heavy chat fits
            rr=self.gateway_cpus is not None,
        )
        self.spawn("evil", [sys.executable, str(Path(__file__).resolve()), "--evil-engine", str(evil)], idle=True)
        settings = {
            "gateway": {"host": "127.0.0.1", "port": self.port, "log_level": "warning"},
            "quotas": {"enabled": True},  # in process memory (no redis_url): the rate-limited tenant's
            "verifier": {"enabled": False},
            "redis_url": None,
            "state_dir": str(self.tmp / "state"),
            "models": [{"id": MODEL, "context_length": CONTEXT}, {"id": EVIL, "context_length": 8192}],
            "upstreams": [
                {
                    "name": "mock",
                    "api_url": f"http://127.0.0.1:{mock}/v1",
                    "pool_urls": [f"http://127.0.0.1:{mock}/server_info"],
                    "models": [MODEL],
                },
                {
                    "name": "evil",
                    "api_url": f"http://127.0.0.1:{evil}/v1",
                    "pool_urls": [f"http://127.0.0.1:{evil}/server_info"],
                    "models": [EVIL],
                },
            ],
        }
        tenants = {
            "tenants": [
                {"id": "normal", "api_key_sha256": [hashlib.sha256(self.normal_key.encode()).hexdigest()]},
                {"id": "attacker", "api_key_sha256": [hashlib.sha256(self.attack_key.encode()).hexdigest()]},
                {
                    "id": "limited",
                    "api_key_sha256": [hashlib.sha256(limited_key(self.attack_key).encode()).hexdigest()],
                    "rpm": 1,
                    "max_concurrent": 1,
                },
            ]
        }
        (self.tmp / "kvgate.yaml").write_text(yaml.safe_dump(settings))
        (self.tmp / "tenants.yaml").write_text(yaml.safe_dump(tenants))
        argv = [sys.executable, str(Path(__file__).resolve()), "--serve"]
        self.gateway = self.spawn(
            "gateway", argv + [str(self.tmp / "kvgate.yaml"), str(self.tmp / "tenants.yaml")], self.gateway_cpus
        )
        import httpx

        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(self.url + "/readyz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.gateway.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("gateway did not start:\n" + (self.tmp / "gateway.log").read_text()[-3000:])
            time.sleep(0.2)

    def stop(self) -> None:
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)


async def probe(run: Run, reset: bool, types: bool = False) -> dict[str, Any]:
    import httpx

    query = "&".join(q for q, on in (("reset=1", reset), ("types=1", types)) if on)
    async with httpx.AsyncClient(timeout=10) as c:
        r = await c.get(run.url + "/__bench/lag" + ("?" + query if query else ""))
        return r.json()


async def normal_traffic(run: Run, rate: float, seconds: float) -> tuple[list[float], Counter[str], list[float]]:
    """Open loop: request i starts at t0 + i / rate whatever the others do. Returns the latencies
    of the 200s (ms), the answers' status counts, and the gateway's own time of each 200 before
    it forwarded the request (its ``x-kvgate-overhead-ms``)."""
    import httpx

    lat: list[float] = []
    overhead: list[float] = []  # the gateway's own time before forwarding (x-kvgate-overhead-ms)
    statuses: Counter[str] = Counter()
    headers = {"authorization": f"Bearer {run.normal_key}"}
    async with httpx.AsyncClient(
        base_url=run.url, headers=headers, timeout=30, limits=httpx.Limits(max_connections=256)
    ) as c:

        async def one() -> None:
            t = time.perf_counter()
            try:
                r = await c.post("/v1/chat/completions", json=CHAT)
                statuses[str(r.status_code)] += 1
                if r.status_code == 200:
                    lat.append((time.perf_counter() - t) * 1000)
                    overhead.append(float(r.headers.get("x-kvgate-overhead-ms", "nan")))
            except httpx.HTTPError as e:
                statuses[type(e).__name__] += 1

        t0 = time.perf_counter()
        tasks = []
        for i in range(int(rate * seconds)):
            delay = t0 + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(one()))
        await asyncio.gather(*tasks)
    return lat, statuses, overhead


#: the attackers' source addresses (every 127/8 address is the loopback): the attackers stand for
#: other machines, so the gateway's per-address connection share applies to them, not to the
#: normal traffic's 127.0.0.1; the connection hog has one address of its own
ATTACKER_ADDRS = tuple(f"127.0.0.{i}" for i in range(2, 10))
HOG_ADDR = "127.0.0.10"


def attacker_addr(i: int) -> str:
    return ATTACKER_ADDRS[i % len(ATTACKER_ADDRS)]


async def connect(port: int, src: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port, local_addr=(src, 0))


async def raw_send(port: int, data: bytes, *, piece: int = 65536, src: str = ATTACKER_ADDRS[0]) -> bytes:
    """Send ``data`` in pieces while reading; return what the server answered until it closed
    (a server that refuses early answers before the whole request is sent)."""
    try:
        r, w = await connect(port, src)
    except OSError:
        return b""
    got = bytearray()

    async def read() -> None:
        with contextlib.suppress(ConnectionError, OSError):
            while chunk := await r.read(65536):
                got.extend(chunk)

    reader = asyncio.ensure_future(read())
    try:
        for i in range(0, len(data), piece):
            if reader.done():
                break
            w.write(data[i : i + piece])
            await w.drain()
    except (ConnectionError, OSError):
        pass
    try:
        await asyncio.wait_for(reader, 60)
    except TimeoutError:
        reader.cancel()
    w.close()
    return bytes(got)


def status_of(answer: bytes) -> str:
    return answer[9:12].decode() if answer.startswith(b"HTTP/1.1 ") else "closed"


async def trickle(r: asyncio.StreamReader, w: asyncio.StreamWriter, first: bytes, byte: bytes) -> bytes:
    """Send ``first``, then one ``byte`` a second until the server answers or closes (at most
    60 s: the attack column may end first; the connection is held until the server lets go)."""
    answer = b""
    t0 = time.monotonic()
    try:
        w.write(first)
        await w.drain()
        while time.monotonic() - t0 < 60:
            try:
                answer = await asyncio.wait_for(r.read(4096), 1.0)
                break  # the server answered or closed
            except TimeoutError:
                w.write(byte)
                await w.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        w.close()
    return answer


async def slowloris(run: Run, idx: int, results: Counter[str], held: list[float]) -> None:
    """One slow body: a head with ``Content-Length: 8000000``, then a byte a second."""
    auth = f"authorization: Bearer {run.attack_key}\r\n" if idx % 2 == 0 else ""
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n{auth}content-type: application/json\r\n"
        "content-length: 8000000\r\n\r\n"
    ).encode()
    t = time.perf_counter()
    try:
        r, w = await connect(run.port, attacker_addr(idx))
    except OSError:
        results["connect-failed"] += 1
        await asyncio.sleep(0.5)
        return
    answer = await trickle(r, w, head + b"{", b" ")
    results[f"slowloris {status_of(answer)}"] += 1
    held.append(time.perf_counter() - t)
    await asyncio.sleep(0.2)  # then a new socket


async def slow_head(run: Run, idx: int, results: Counter[str], held: list[float]) -> None:
    t = time.perf_counter()
    try:
        r, w = await connect(run.port, attacker_addr(idx))
    except OSError:
        await asyncio.sleep(0.5)
        return
    answer = await trickle(r, w, b"POST /v1/chat/completions HTTP/1.1\r\n", b"x")
    results[f"slow-head {status_of(answer)}"] += 1
    held.append(time.perf_counter() - t)


def http_post(path: str, body: bytes, key: str) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {key}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    ).encode() + body


def giant_bodies_of(run: Run) -> dict[str, bytes]:
    """The giant requests, built once before any column (so building them costs no column time)."""
    return {
        'prompt [""] x 2M': http_post(
            "/v1/completions", json.dumps({"model": MODEL, "prompt": [""] * 2_000_000}).encode(), run.attack_key
        ),
        "prompt 2M ids": http_post(
            "/v1/completions", json.dumps({"model": MODEL, "prompt": [1] * 2_000_000}).encode(), run.attack_key
        ),
        "200k messages": http_post(
            "/v1/chat/completions",
            json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "a"}] * 200_000}).encode(),
            run.attack_key,
        ),
    }


def chunked_trickle_of(run: Run) -> dict[bool, bytes]:
    """A 1 MiB body in 1-byte chunks, with a key (True) and without one (False)."""
    body = b"".join(b"1\r\n%c\r\n" % c for c in b'{"model": "' + b"a" * ((1 << 20) - 13) + b'"}') + b"0\r\n\r\n"
    out = {}
    for keyed in (True, False):
        auth = f"authorization: Bearer {run.attack_key}\r\n" if keyed else ""
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n{auth}content-type: application/json\r\n"
            "transfer-encoding: chunked\r\n\r\n"
        ).encode()
        out[keyed] = head + body
    return out


def limited_key(attack_key: str) -> str:
    """The key of the ``limited`` tenant (``rpm: 1``, ``max_concurrent: 1``)."""
    return attack_key + "-limited"


#: concurrent senders of the rate-limited flood
FLOOD_SENDERS = 8


def heavy_chat() -> bytes:
    """A chat of 270 KB of distinct words (119,608 tokens, within :data:`CONTEXT`): about 0.2 s
    of counting on an idle core, were it counted."""
    text = " ".join(f"w{i * 7919 % 100_003}" for i in range(40_000))
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 1}).encode()


#: concurrent senders of the flood of chats just under ``offload_count_chars``
LOOP_FLOOD_SENDERS = 4


def under_offload_chat(key: str) -> Any:
    """``i -> raw request``: the ``loop-flood`` attacker's chats, random printable text whose
    counting cost is just under the default ``gateway.offload_count_chars`` (so small enough to be
    counted on the event loop), different in each try (so the counter's cache knows none of them),
    with ``max_tokens`` the whole context: a 400 once counted, never forwarded."""
    import random
    import string

    from config.models import GatewaySettings
    from tokenizer.chat import chat_cost

    n = GatewaySettings().offload_count_chars - chat_cost([{"role": "user", "content": ""}])
    rng = random.Random(1)
    text = "".join(rng.choice(string.ascii_letters + string.digits + string.punctuation + " ") for _ in range(n + 4096))

    def make(i: int) -> bytes:
        content = f"{i:09d}" + text[i % 4096 : i % 4096 + n - 9]
        body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": CONTEXT}
        return http_post("/v1/chat/completions", json.dumps(body).encode(), key)

    return make


#: 40 requests without a key in one write (one connection)
PIPELINED_401 = b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n" * 40


async def hog(run: Run, results: Counter[str]) -> None:
    """One idle connection from :data:`HOG_ADDR`, held until the server answers or closes it."""
    try:
        r, w = await connect(run.port, HOG_ADDR)
    except OSError:
        results["hog connect-failed"] += 1
        await asyncio.sleep(0.5)
        return
    try:
        answer = await asyncio.wait_for(r.read(4096), 60)
    except (TimeoutError, ConnectionError, OSError):
        answer = b""
    w.close()
    results[f"hog {status_of(answer)}"] += 1
    await asyncio.sleep(0.5)  # then a new socket


class Attackers:
    """Every attack's one try (a coroutine factory of the try's index) and how many run at once
    in the closed loop (each starts its next try when its last one ended); at a fixed rate, tries
    start ``rate`` a second per attack, whatever the answers, at most that many at once."""

    def __init__(self, run: Run, only: set[str], slowloris_n: int, hog_n: int) -> None:
        self.run = run
        self.results: Counter[str] = Counter()
        self.held_body: list[float] = []
        self.held_head: list[float] = []
        res = self.results
        kinds: dict[str, tuple[int, Any]] = {}
        if "slowloris" in only:
            kinds["slowloris"] = (slowloris_n, lambda i: slowloris(run, i, res, self.held_body))
            kinds["slow-head"] = (50, lambda i: slow_head(run, i, res, self.held_head))
        if "bodies" in only:
            giant = list(giant_bodies_of(run).items())
            kinds["bodies"] = (1, lambda i: self._send(giant[i % len(giant)][0], giant[i % len(giant)][1], i))
        if "sse" in only:
            kinds["sse"] = (1, lambda i: big_event(run, res, i))
        if "headers" in only:
            huge = b"GET /healthz HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * (8 << 20) + b"\r\n\r\n"
            many = b"GET /healthz HTTP/1.1\r\nhost: x\r\n" + b"".join(b"x-h%d: 1\r\n" % i for i in range(20_000))
            heads = [("8 MiB header", huge), ("20k headers", many + b"\r\n")]
            kinds["headers"] = (1, lambda i: self._send(*heads[i % 2], i))
        if "chunked" in only:
            trickles = chunked_trickle_of(run)
            kinds["chunked"] = (
                8,
                lambda i: self._send(f"chunked 1-byte {'keyed' if i % 2 == 0 else 'no key'}", trickles[i % 2 == 0], i),
            )
        if "hog" in only:
            kinds["hog"] = (hog_n, lambda i: hog(run, res))
        if "flood" in only:  # the rate-limited tenant's heavy chats, closed loop
            flood = http_post("/v1/chat/completions", heavy_chat(), limited_key(run.attack_key))
            kinds["flood"] = (FLOOD_SENDERS, lambda i: self._send("rate-limited heavy chat", flood, i))
        if "loop-flood" in only:  # chats just under offload_count_chars, closed loop, each text new
            under, tries = under_offload_chat(run.attack_key), itertools.count()
            kinds["loop-flood"] = (
                LOOP_FLOOD_SENDERS,
                lambda i: self._send("chat just under offload_count_chars", under(next(tries)), i),
            )
        if "pipelined-401" in only:
            kinds["pipelined-401"] = (20, lambda i: self._send("pipelined 40 x 401", PIPELINED_401, i))
        self.kinds = kinds

    async def _send(self, name: str, raw: bytes, i: int) -> None:
        answer = await raw_send(self.run.port, raw, src=attacker_addr(i))
        self.results[f"{name} {status_of(answer)}"] += 1

    async def closed_loop(self, stop: asyncio.Event) -> list[asyncio.Future[None]]:
        async def loop(make: Any, i: int) -> None:
            n = i
            while not stop.is_set():
                await make(n)
                n += 1

        return [asyncio.ensure_future(loop(make, i)) for count, make in self.kinds.values() for i in range(count)]

    async def fixed_rate(self, stop: asyncio.Event, rate: float) -> list[asyncio.Future[None]]:
        async def pace(count: int, make: Any) -> None:
            live: set[asyncio.Future[None]] = set()
            t0, i = time.perf_counter(), 0
            while not stop.is_set():
                if len(live) < count:
                    f = asyncio.ensure_future(make(i))
                    live.add(f)
                    f.add_done_callback(live.discard)
                else:
                    self.results["rate: skipped (all in flight)"] += 1
                i += 1
                await asyncio.sleep(max(0.0, t0 + i / rate - time.perf_counter()))
            await asyncio.wait(live, timeout=70) if live else None

        return [asyncio.ensure_future(pace(count, make)) for count, make in self.kinds.values()]


async def big_event(run: Run, results: Counter[str], i: int) -> None:
    body = json.dumps({"model": EVIL, "messages": [{"role": "user", "content": "hi"}], "stream": True}).encode()
    raw = http_post("/v1/chat/completions", body, run.attack_key)
    answer = await raw_send(run.port, raw, src=attacker_addr(i))
    ended = b"larger than 1048576 bytes" in answer and b"data: [DONE]" in answer
    results[f"8 MiB SSE event {status_of(answer)}{' error-event' if ended else ''}"] += 1


ATTACKS = ("slowloris", "bodies", "sse", "headers", "chunked", "hog", "pipelined-401")


async def attack(port: int, key: str, only: set[str], slowloris_n: int, rate: float) -> dict[str, Any]:
    """The attackers (this file, ``--attack``, its own process at idle priority so that building
    and sending the attack takes no CPU time the load generator wants): closed loop (``rate`` 0)
    or ``rate`` tries a second per attack, until SIGTERM; then let held connections end and print
    the results as one JSON line."""
    run = Run.__new__(Run)
    run.port, run.attack_key = port, key
    atk = Attackers(run, only, slowloris_n, hog_n=400)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    attackers = await (atk.fixed_rate(stop, rate) if rate > 0 else atk.closed_loop(stop))
    print("ready", flush=True)
    await stop.wait()
    await asyncio.wait(attackers, timeout=70)  # held connections end when the server lets go
    for a in attackers:
        a.cancel()
    return {"results": dict(atk.results), "held_body": atk.held_body, "held_head": atk.held_head}


async def canary(seconds: float) -> dict[str, float]:
    """A loop that does nothing but sample its own lag (this file, ``--canary``): what the
    machine's scheduler alone costs a loop in a process of its own, the control column."""
    lags = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t = time.perf_counter()
        await asyncio.sleep(0.005)
        lags.append((time.perf_counter() - t - 0.005) * 1000)
    return {"p99": pct(lags, 0.99), "max": max(lags)}


def start_canary(seconds: float) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), "--canary", str(seconds)],
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def canary_result(p: subprocess.Popen[bytes]) -> dict[str, float]:
    out, _ = p.communicate(timeout=120)
    return json.loads(out.strip().splitlines()[-1])


def generator_priority() -> None:
    """This process (the load generator, or the mock engine) at a real-time priority
    (``SCHED_RR`` 10) when allowed, else unchanged: what measures the normal traffic is woken at
    once, before anything else on its CPUs, so that its latency is the gateway's, not the
    scheduler's. Used with ``--pin`` only (the gateway has a CPU of its own)."""
    with contextlib.suppress(AttributeError, OSError):
        os.sched_setscheduler(0, os.SCHED_RR, os.sched_param(10))


def attacker_priority() -> None:
    """This process at the scheduler's idle priority (``SCHED_IDLE``: it runs only on CPU time
    nothing else wants, and yields at once when another process wakes), else at nice 19: the
    attackers and the evil engine stand in for other machines, so they must not delay the load
    generator or the mock engine that share their CPU (their wake-ups are the normal traffic's
    latency too)."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        os.nice(19)


def start_attacker(run: Run, only: str, slowloris_n: int, rate: float = 0.0) -> subprocess.Popen[bytes]:
    """The attackers' process (``--attack``), at idle priority (:func:`attacker_priority`):
    closed loop, or (``rate`` > 0) ``rate`` tries a second per attack."""
    argv = [sys.executable, str(Path(__file__).resolve()), "--attack", str(run.port), run.attack_key, only]
    return subprocess.Popen(
        [*argv, str(slowloris_n), str(rate)],
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        preexec_fn=attacker_priority,
    )


async def attack_column(run: Run, args: argparse.Namespace, rate: float, only: str = "") -> dict[str, Any]:
    """Normal traffic while the attackers run (closed loop, or ``rate`` tries a second per attack):
    ``only`` (comma-separated), else ``--only``, else every one of :data:`ATTACKS`."""
    attacker = start_attacker(run, only or args.only or ",".join(ATTACKS), args.slowloris, rate)
    assert attacker.stdout is not None
    line = await asyncio.get_running_loop().run_in_executor(None, attacker.stdout.readline)
    assert line.strip() == b"ready", line
    await asyncio.sleep(1.0)  # let the attack build up
    await probe(run, reset=True)
    c_atk = start_canary(args.seconds)
    lat, status, over = await normal_traffic(run, args.rate, args.seconds)
    attacked = await probe(run, reset=True)
    attacked["canary"] = canary_result(c_atk)
    attacker.send_signal(signal.SIGTERM)
    out_line = await asyncio.get_running_loop().run_in_executor(None, attacker.stdout.read)
    attacker.wait(10)
    res = json.loads(out_line.strip().splitlines()[-1])
    return {"col": (lat, status, attacked, over), "results": Counter(res["results"]), "held": res}


async def bench(run: Run, args: argparse.Namespace) -> dict[str, Any]:
    await probe(run, reset=True)  # starts the sampler
    await normal_traffic(run, args.rate, 2)  # warm-up
    await probe(run, reset=True)
    c_idle = start_canary(args.seconds)
    idle_lat, idle_status, idle_over = await normal_traffic(run, args.rate, args.seconds)
    idle = await probe(run, reset=True)
    idle["canary"] = canary_result(c_idle)
    flood = await attack_column(run, args, 0.0, only="flood")  # the rate-limited flood, alone
    loop_flood = await attack_column(run, args, 0.0, only="loop-flood")  # chats under the offload size, alone
    closed = await attack_column(run, args, 0.0)
    await asyncio.sleep(5)  # held connections of the closed loop end
    await probe(run, reset=True)
    fixed = await attack_column(run, args, args.attack_rate)
    await asyncio.sleep(10)
    after = await probe(run, reset=False, types=True)
    return {
        "idle": (idle_lat, idle_status, idle, idle_over),
        "flood": flood["col"],
        "loop_flood": loop_flood["col"],
        "attack": closed["col"],
        "rate": fixed["col"],
        "after": after,
        "results": closed["results"] + flood["results"] + loop_flood["results"],
        "rate_results": fixed["results"],
        "held_body": closed["held"]["held_body"],
        "held_head": closed["held"]["held_head"],
    }


def report(out: dict[str, Any], args: argparse.Namespace) -> None:
    print(f"\nnormal traffic: {args.rate:g} chat requests/s for {args.seconds:g} s per column; {os.cpu_count()} CPUs")
    print(
        "attackers stand for other machines: "
        + (
            "the gateway pinned alone on one CPU, the attackers at idle priority"
            if args.pin
            else "not pinned (--no-pin): every process shares every CPU"
        )
        + f", from 127.0.0.2-10 (normal traffic from 127.0.0.1); 1-minute load average {args.load_start:.2f} at "
        f"the start, {os.getloadavg()[0]:.2f} at the end\n"
    )
    print(
        f"{'':26}{'idle':>14}{'r-l flood':>16}{'loop flood':>16}{'closed loop':>16}{f'{args.attack_rate:g}/s each':>16}"
    )
    cols = [out["idle"], out["flood"], out["loop_flood"], out["attack"], out["rate"]]
    rows = [
        ("normal p50 ms", [pct(c[0], 0.5) for c in cols]),
        ("normal p99 ms", [pct(c[0], 0.99) for c in cols]),
        ("gateway overhead p50 ms", [pct(c[3], 0.5) for c in cols]),
        ("gateway overhead p99 ms", [pct(c[3], 0.99) for c in cols]),
        ("normal answers", [", ".join(f"{k}: {v}" for k, v in sorted(c[1].items())) for c in cols]),
        ("event-loop lag p50 ms", [c[2]["p50"] for c in cols]),
        ("event-loop lag p99 ms", [c[2]["p99"] for c in cols]),
        ("event-loop lag max ms", [c[2]["max"] for c in cols]),
        ("control loop lag p99 ms", [c[2]["canary"]["p99"] for c in cols]),
        ("control loop lag max ms", [c[2]["canary"]["max"] for c in cols]),
        ("gateway CPU % (a core)", [c[2]["cpu_pct"] for c in cols]),
        ("GC gen2 count / max ms", [f"{c[2]['gc']['2'][0]} / {c[2]['gc']['2'][1]:.1f}" for c in cols]),
        ("GC gen1 count / max ms", [f"{c[2]['gc']['1'][0]} / {c[2]['gc']['1'][1]:.1f}" for c in cols]),
        ("GC gen0 count / max ms", [f"{c[2]['gc']['0'][0]} / {c[2]['gc']['0'][1]:.1f}" for c in cols]),
        ("RSS MB (end of column)", [c[2]["rss"] / 1e6 for c in cols]),
        ("RSS peak MB", [c[2]["rss_peak"] / 1e6 for c in cols]),
    ]
    for name, vals in rows:
        print(f"{name:26}" + "".join(f"{v:>14.2f}  " if isinstance(v, float) else f"{v:>14}  " for v in vals))
    base = out["idle"][2]["rss"]
    growth = (out["after"]["rss"] - base) / 1e6
    print(
        f"\nRSS: {base / 1e6:.1f} MB before the attack, peak {out['attack'][2]['rss_peak'] / 1e6:.1f} MB, "
        f"{out['after']['rss'] / 1e6:.1f} MB 10 s after it: growth {growth:+.1f} MB"
    )
    print(
        f"objects tracked by the GC: {out['idle'][2]['objects']:,} after the idle column, "
        f"{out['after']['objects']:,} 10 s after the attack; most common then: "
        + ", ".join(f"{k} {v:,}" for k, v in out["after"]["top_types"][:8])
    )
    hb, hh = out["held_body"], out["held_head"]
    if hb:
        print(f"slowloris body connections: {len(hb)} closed, held p50 {pct(hb, 0.5):.1f} s, max {max(hb):.1f} s")
    if hh:
        print(f"slow-head connections: {len(hh)} closed, held p50 {pct(hh, 0.5):.1f} s, max {max(hh):.1f} s")
    for title, key in (("closed loop", "results"), (f"{args.attack_rate:g}/s per attack", "rate_results")):
        print(f"attackers' answers ({title}):")
        for k, v in sorted(out[key].items()):
            print(f"  {k}: {v}")
    p99_idle = pct(out["idle"][0], 0.99)
    p50_idle, p50_flood = pct(out["idle"][0], 0.5), pct(out["flood"][0], 0.5)
    print("\ngoals:")
    print(
        f"  normal p50 under a rate-limited tenant's flood of heavy chats <= 1.5x idle p50: "
        f"{p50_flood:.1f} <= {1.5 * p50_idle:.1f} ms: {p50_flood <= 1.5 * p50_idle}"
    )
    p50_loop = pct(out["loop_flood"][0], 0.5)
    print(
        f"  normal p50 under another tenant's flood of chats just under offload_count_chars <= 1.5x idle p50: "
        f"{p50_loop:.1f} <= {1.5 * p50_idle:.1f} ms: {p50_loop <= 1.5 * p50_idle}"
    )
    for title, key in (("closed loop", "attack"), ("fixed rate", "rate")):
        p99_atk, lag = pct(out[key][0], 0.99), out[key][2]["p99"]
        print(
            f"  {title}: normal p99 <= 2x idle p99: {p99_atk:.1f} <= {2 * p99_idle:.1f} ms: {p99_atk <= 2 * p99_idle}; "
            f"event-loop lag p99 <= 10 ms: {lag:.2f} ms: {lag <= 10}"
        )
    print(f"  RSS growth 10 s after <= 50 MB: {growth:+.1f} MB: {growth <= 50}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=15.0, help="seconds per column (default 15)")
    ap.add_argument("--rate", type=float, default=40.0, help="normal chat requests per second (default 40)")
    ap.add_argument("--slowloris", type=int, default=200, help="slow-body sockets (default 200)")
    ap.add_argument(
        "--pin",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the gateway alone on one CPU and the rest on the others (default: on, with 2+ CPUs)",
    )
    ap.add_argument(
        "--attack-rate",
        type=float,
        default=20.0,
        help="tries a second per attack in the fixed-rate column (default 20)",
    )
    ap.add_argument("--only", default="", help="comma-separated attacks (default: all): " + ", ".join(ATTACKS))
    ap.add_argument("--serve", nargs=2, metavar=("CONFIG", "TENANTS"), help=argparse.SUPPRESS)
    ap.add_argument("--evil-engine", type=int, metavar="PORT", help=argparse.SUPPRESS)
    ap.add_argument("--attack", nargs=5, help=argparse.SUPPRESS)
    ap.add_argument("--canary", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        return serve(*args.serve)
    if args.evil_engine:
        asyncio.run(evil_engine(args.evil_engine))
        return 0
    if args.canary:
        print(json.dumps(asyncio.run(canary(args.canary))), flush=True)
        return 0
    if args.attack:
        port, key, only, n, rate = args.attack
        print(json.dumps(asyncio.run(attack(int(port), key, set(only.split(",")), int(n), float(rate)))), flush=True)
        return 0
    args.load_start = os.getloadavg()[0]  # a shared machine: what else ran, reported with the table
    tmp = Path(tempfile.mkdtemp(prefix="kvgate-hostile-"))
    run = Run(tmp)
    cpus = sorted(os.sched_getaffinity(0))
    if args.pin and len(cpus) >= 2:
        # the gateway alone on the first CPU, everything else (this process, the engines, the
        # attackers and the control loop, which inherit it) on the others: the attackers and
        # the load generator stand in for other machines, and share no core with the gateway
        run.gateway_cpus = {cpus[0]}
        os.sched_setaffinity(0, set(cpus[1:]))
        generator_priority()  # this process, and the control loop it starts
    try:
        run.start()
        out = asyncio.run(bench(run, args))
    finally:
        run.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    report(out, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
