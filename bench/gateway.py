"""What the gateway costs: added latency and maximum requests/s against a fast mock engine, next to
the relays a user would compare it with, in one run on this machine.

The mock engine is nginx answering one fixed chat completion (``usage.prompt_tokens`` = kvgate's
exact count of the bench body, so the verifier's drift check stays quiet) and the SGLang
``/server_info`` the gateway reads its live pool from; without nginx, ``bench/mock_engine.py``
(raw asyncio, ``--count``). Started with ``stream`` (``bench/cpu_pairs.py --stream``), the mock
answers the same completion as an event stream (16 token chunks, a finish chunk, a usage chunk,
``[DONE]``: :func:`fixed_stream`) and the load's chat body asks ``"stream": true``. The load is
``wrk`` in its own process (a Python load process when ``wrk`` is absent) with a ~200-token chat
body. Scenarios (``--only`` picks; the default set first):

- ``direct``: straight to the mock engine (the baseline every "added" column subtracts);
- ``nginx``: through nginx (1 worker, upstream keep-alive); skipped without nginx;
- ``naive-relay``: the frozen featureless FastAPI + httpx relay ``../shared/bench/naive_relay.py``
  (beside the checkout; ``--naive-relay`` names another copy) under ``uvicorn --workers 2``;
- ``python-floor``: ``bench/floor_relay.py``, bytes copied between sockets on uvloop with
  ``Content-Length`` framing, 2 processes: the least any Python relay on asyncio adds here;
- ``litellm``: LiteLLM's proxy with 2 workers, from its own virtualenv so it cannot change
  kvgate's dependencies (``--litellm-venv``, default ``.venv-litellm`` in the checkout: ``python -m
  venv .venv-litellm && .venv-litellm/bin/pip install 'litellm[proxy]'``); skipped without it;
- ``kvgate-full``: ``kvgate serve`` with every feature on: auth, the exact tiktoken + ChatML
  count, the live pool from the mock's ``/server_info``, quotas in Redis
  (``$KVGATE_BENCH_REDIS_URL``, default ``redis://127.0.0.1:6379/0``; limits never reached),
  metrics, the verifier sampling 5%; the default workers (the usable cores, Redis being set);
- ``kvgate-full-fresh``: ``kvgate-full`` with a new prompt in every request (a 9-digit number in
  the user message, written by wrk's Lua script; the same exact count): what a prompt costs the
  first time it is seen, with no count- or fingerprint-cache hit (the fixed body of the other
  scenarios hits both after its first request); needs wrk;
- ``kvgate-responses``: ``kvgate-full`` on ``/v1/responses``, the same turn as ``instructions`` +
  ``input`` (the mock answers a fixed ``response`` object with the same exact count);
- ``kvgate-bare``: the same without quotas and verifier (and so without Redis), same workers;
- ``kvgate-verify-100``: ``kvgate-full`` with the verifier sampling every response;
- extras: ``kvgate-full-1w`` (one worker), ``kvgate-logged`` (the JSON access log on, to a file),
  ``kvgate-strict`` (a strict tenant: checked before release), ``quotas-local`` (no Redis, one
  worker), ``gateway`` (kvgate-bare in one worker, on its own bounded httptools protocol,
  :mod:`gateway.edge.protocol`: header bytes and count, head and body deadlines) and ``edge-httptools`` /
  ``edge-h11``: the same app on uvicorn's stock httptools protocol (no header bound) or on h11
  (header bytes bounded by ``h11_max_incomplete_event_size``): what the bounds cost, and what h11
  would.

Per scenario: p50/p99 at 1 connection and requests/s and p99 at ``--connections`` (64). Every
scenario is started once and measured in ``--rounds`` (3) interleaved rounds, every other round
in reverse order, so a noisy neighbour on a shared machine hits every column alike and no
scenario always runs first. Each row is the median over rounds with its min-max spread; the
ratios to the naive relay and LiteLLM are taken within each round (the median and min-max of
those); ``busiest w`` is the busiest kvgate worker's share of the N-connection requests, read
from the workers' metric files (an uneven split of the keep-alive connections leaves one worker
saturated). The goal checks of the throughput issue follow (kvgate-full: >= 2x the relay's and
>= 10x LiteLLM's requests/s, added p50 <= 0.5 ms, p99 at 64 <= 0.5x the relay's, verification
at 100% costing <= 10% of requests/s; the floor: >= 1x the relay).

``--base DIR`` adds ``kvgate-full@base``: kvgate-full served from another checkout (e.g. the
commit before a change), with kvgate-full / kvgate-full@base as within-round ratios.
``--profile DIR`` replaces the rounds: each kvgate scenario gets one c=1 and one c=N run with
``py-spy`` sampling every worker; the top frames (inclusive and self shares of the samples) are
printed and written to ``DIR/profile.md``, the raw stacks beside it.

``--transports`` instead compares the HTTP clients the gateway could forward with (httpx's default
transport, httpx over aiohttp via ``httpx-aiohttp``, aiohttp itself, and the gateway's own
``UpstreamClient`` over each of its transports, ``kvgate-aiohttp`` and ``kvgate-h1``): each in its
own process, the same POST to the mock at 1 and at 64 requests in flight.

Adding a scenario is one function: decorate ``f(env) -> ContextManager[Target]`` with
``@scenario("name", "what it measures")``; :func:`gateway_target` starts ``kvgate serve`` with
settings overrides (e.g. quotas on Redis, verification sampled at 100%).

Run: ``.venv/bin/python bench/gateway.py [--duration 5] [--rounds 3] [--only kvgate-full,naive-relay]
[--litellm-venv DIR] [--base DIR] [--profile DIR]``.
"""

import os
import sys

# Run as a script, this folder is sys.path[0]; a bench named like a stdlib module (bench/tokenize.py)
# would shadow it. Benches import nothing from their own folder, so drop it.
if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)

import argparse
import contextlib
import dataclasses
import hashlib
import itertools
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
#: ~200 prompt tokens (kvgate's count, ChatML included), as a typical short chat turn
USER_TEXT = (
    "Call me Ishmael. Some years ago, never mind how long precisely, having little or no money in my purse, "
    "and nothing particular to interest me on shore, I thought I would sail about a little and see the "
    "watery part of the world. It is a way I have of driving off the spleen and regulating the circulation. "
    "Whenever I find myself growing grim about the mouth; whenever it is a damp, drizzly November in my soul; "
    "whenever I find myself involuntarily pausing before coffin warehouses, and bringing up the rear of every "
    "funeral I meet; and especially whenever my hypos get such an upper hand of me, that it requires a strong "
    "moral principle to prevent me from deliberately stepping into the street, and methodically knocking "
    "people's hats off, then, I account it high time to get to sea as soon as I can. Summarise that in a line."
)
BODY = {
    "model": MODEL,
    "messages": [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": USER_TEXT},
    ],
    "max_tokens": 16,
    "temperature": 0,
}
#: :data:`BODY` with a 9-digit number in place of its last words: the same exact count (200)
#: whatever the number, so the mock's fixed usage stays exact; ``kvgate-full-fresh`` sends a new
#: number with every request of a run, and each run starts :data:`FRESH_RUN_STRIDE` further on,
#: so no prompt is seen twice in a bench (no count or fingerprint cache hit)
FRESH_MARK = "100000000"
FRESH_RUN_STRIDE = 10_000_000
FRESH_BODY = {
    **BODY,
    "messages": [
        BODY["messages"][0],
        {"role": "user", "content": USER_TEXT.replace("Summarise that in a line.", f"Summarise #{FRESH_MARK}.")},
    ],
}
_fresh_runs = itertools.count()
#: the mock's 16 completion tokens, one per streamed chunk; :data:`REPLY_TEXT` is them joined
REPLY_PIECES = [" tok"] * 16
REPLY_TEXT = "".join(REPLY_PIECES)
#: the same turn as a Responses API request (``/v1/responses``: instructions + input)
RESPONSES_BODY = {
    "model": MODEL,
    "instructions": BODY["messages"][0]["content"],
    "input": USER_TEXT,
    "max_output_tokens": 16,
    "temperature": 0,
}


def body_for(url: str, fresh: bool = False, stream: bool = False) -> dict[str, Any]:
    """The load's body for a target URL: :data:`RESPONSES_BODY` for ``/v1/responses``, else
    :data:`BODY` (``fresh``: :data:`FRESH_BODY`, its number replaced per request by the load;
    ``stream``: with ``"stream": true``, chat completions only)."""
    if url.endswith("/v1/responses"):
        return RESPONSES_BODY
    body = FRESH_BODY if fresh else BODY
    return {**body, "stream": True} if stream else body


def fixed_response(prompt_tokens: int) -> bytes:
    """The mock's one ``/v1/responses`` answer (16 tokens, usage with the exact input count)."""
    item = {"id": "msg_mock", "type": "message", "role": "assistant", "status": "completed"}
    item["content"] = [{"type": "output_text", "text": REPLY_TEXT, "annotations": []}]
    usage = {"input_tokens": prompt_tokens, "output_tokens": 16, "total_tokens": prompt_tokens + 16}
    obj = {"id": "resp_mock", "object": "response", "created_at": 1, "model": MODEL, "status": "completed"}
    return json.dumps({**obj, "error": None, "output": [item], "usage": usage}, separators=(",", ":")).encode()


def prompt_tokens_of_body() -> int:
    """kvgate's exact count of :data:`BODY` (tiktoken cl100k_base + ChatML), for the mock's usage."""
    from config.models import TokenizerConfig
    from tokenizer import make_counter

    counter = make_counter(TokenizerConfig(kind="tiktoken", name="cl100k_base"))
    count = int(counter.count_chat(BODY["messages"]))
    fresh = FRESH_BODY["messages"]
    assert json.dumps(FRESH_BODY).count(FRESH_MARK) == 1
    for n in ("100000000", "999999999", "504713086"):  # any 9-digit number: the same count as BODY
        again = [fresh[0], {**fresh[1], "content": fresh[1]["content"].replace(FRESH_MARK, n)}]
        assert counter.count_chat(again) == count, "FRESH_BODY must count as BODY does"
    return count


def fixed_reply(prompt_tokens: int) -> bytes:
    """The mock's one chat completion (16 tokens, usage with the exact prompt count)."""
    return json.dumps(
        {
            "id": "chatcmpl-mock",
            "object": "chat.completion",
            "created": 1,
            "model": MODEL,
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": REPLY_TEXT}, "finish_reason": "length"}
            ],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 16, "total_tokens": prompt_tokens + 16},
        },
        separators=(",", ":"),
    ).encode()


def fixed_stream(prompt_tokens: int) -> bytes:
    """The mock's one chat completion as a Server-Sent-Events stream, as vLLM and SGLang stream it:
    ``data: {json}`` events, each ended by a blank line: one ``chat.completion.chunk`` per token of
    :data:`REPLY_PIECES` (16; the first also carries the role), a chunk with ``finish_reason``
    ``length``, a usage chunk (``choices`` empty; the exact prompt count, 16 completion tokens) and
    ``data: [DONE]``."""
    head = {"id": "chatcmpl-mock", "object": "chat.completion.chunk", "created": 1, "model": MODEL}

    def event(choices: list[dict[str, Any]], **extra: Any) -> bytes:
        return b"data: " + json.dumps({**head, "choices": choices, **extra}, separators=(",", ":")).encode() + b"\n\n"

    def choice(delta: dict[str, str], finish: str | None = None) -> dict[str, Any]:
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}

    events = [
        event([choice({"role": "assistant", "content": t} if i == 0 else {"content": t})])
        for i, t in enumerate(REPLY_PIECES)
    ]
    events.append(event([choice({"content": ""}, "length")]))
    n = len(REPLY_PIECES)
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}
    events.append(event([], usage=usage))
    return b"".join(events) + b"data: [DONE]\n\n"


SERVER_INFO = {
    "max_total_num_tokens": 65536,
    "max_req_input_len": 8186,
    "context_length": 8192,
    "page_size": 16,
    "disaggregation_mode": "null",
    "status": "ready",
    "version": "mock-nginx",
}


# ---------------------------------------------------------------- processes
def free_port() -> int:
    """A loopback TCP port that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Env:
    """What a scenario gets: the mock's base URL, a scratch directory, :meth:`spawn` for processes
    that are stopped when the scenario ends, and the paths of the comparison programs."""

    mock_url: str
    tmp: Path
    naive_relay: Path | None = None
    litellm_venv: Path | None = None
    #: another checkout of kvgate (``--base``): ``kvgate-full@base`` serves from it, for a change's
    #: effect as a ratio within one run
    base: Path | None = None
    #: folders put before the checkout on the served gateway's ``PYTHONPATH`` (bench/timeline.py's marks)
    site: list[Path] = field(default_factory=list)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def spawn(
        self, name: str, cmd: list[str], env: dict[str, str] | None = None, cwd: Path | None = None
    ) -> subprocess.Popen[bytes]:
        """Start ``cmd`` (output to ``<tmp>/<name>.log``) in its own process group."""
        log = open(self.tmp / f"{name}.log", "wb")  # noqa: SIM115 - handed to the child
        p = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
            cwd=cwd,
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


def find_nginx() -> str | None:
    """The nginx binary, or ``None``."""
    return shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.access(p, os.X_OK)), None
    )


def usable_cores() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


NGINX_HEAD = """
worker_processes 1;
{user}
error_log {tmp}/{name}-error.log warn;
pid {tmp}/{name}.pid;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  keepalive_requests 1000000;
  client_body_temp_path {tmp}/{name}-body; proxy_temp_path {tmp}/{name}-proxy;
  fastcgi_temp_path {tmp}/{name}-fcgi; uwsgi_temp_path {tmp}/{name}-uwsgi; scgi_temp_path {tmp}/{name}-scgi;
"""

NGINX_MOCK = """
  server {{
    listen 127.0.0.1:{port};
    default_type application/json;
    location = /health {{ return 200 ''; }}
    location = /server_info {{ return 200 '{info}'; }}
    location = /get_server_info {{ return 200 '{info}'; }}
    location = /v1/chat/completions {{ default_type {reply_type}; return 200 '{reply}'; }}
    location = /v1/responses {{ return 200 '{responses_reply}'; }}
  }}
}}
"""

NGINX_PROXY = """
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


def start_nginx(env: Env, name: str, server_block: str) -> subprocess.Popen[bytes]:
    """nginx (one worker) with ``server_block`` (an ``http`` block's tail), foreground."""
    nginx = find_nginx()
    assert nginx is not None
    conf = env.tmp / f"{name}.conf"
    conf.write_text(
        NGINX_HEAD.format(tmp=env.tmp, name=name, user="user root;" if os.geteuid() == 0 else "") + server_block
    )
    return env.spawn(name, [nginx, "-p", str(env.tmp), "-c", str(conf), "-g", "daemon off;"])


def nginx_literal(text: str) -> str:
    """``text`` as the inside of a single-quoted nginx ``return`` string, unchanged: raises
    ``ValueError`` for a character nginx would read otherwise (a quote, a backslash escape, a
    ``$`` variable). Newlines stay real newline characters, which a quoted string may hold."""
    odd = sorted({c for c in text if c in "'\\$"})
    if odd:
        raise ValueError(f"the mock's reply holds {odd!r}, which nginx's return string would not keep")
    return text


def start_mock(
    env: Env, port: int, prefer_nginx: bool = True, stream: bool = False
) -> tuple[subprocess.Popen[bytes], str]:
    """The mock engine on ``port``: nginx with a fixed reply when installed, else the Python mock.
    ``stream``: nginx answers ``/v1/chat/completions`` with :func:`fixed_stream` (``text/event-stream``,
    whatever the request asks; the Python mock streams when a request asks). Returns the process
    and a one-line description."""
    if prefer_nginx and find_nginx():
        count = prompt_tokens_of_body()
        reply = (fixed_stream(count) if stream else fixed_reply(count)).decode()
        responses_reply = fixed_response(count).decode()  # the same turn: the same count
        info = json.dumps(SERVER_INFO, separators=(",", ":"))
        mock = NGINX_MOCK.format(
            port=port,
            info=nginx_literal(info),
            reply=nginx_literal(reply),
            reply_type="text/event-stream" if stream else "application/json",
            responses_reply=nginx_literal(responses_reply),
        )
        p = start_nginx(env, "mock", mock)
        if stream:
            return p, f"nginx, one fixed chat completion stream ({len(REPLY_PIECES)} token chunks, exact usage)"
        return p, "nginx, one fixed chat completion (exact usage)"
    p = env.spawn(
        "mock", [sys.executable, str(HERE / "mock_engine.py"), "--port", str(port), "--model", MODEL, "--count"]
    )
    return p, "bench/mock_engine.py (raw asyncio, --count" + (", streams when asked)" if stream else ")")


# ---------------------------------------------------------------- scenarios
@dataclass
class Target:
    """Where a scenario's load goes: ``url`` of the POST, ``headers`` to send, ``note`` for the table."""

    url: str
    headers: dict[str, str] = field(default_factory=dict)
    note: str = ""
    #: the kvgate process (the supervisor when it runs workers), for profiles and per-worker counts
    server: subprocess.Popen[bytes] | None = None
    #: its workers' ``PROMETHEUS_MULTIPROC_DIR`` (per-worker request counts), when it has workers
    metrics_dir: Path | None = None
    #: every request a new prompt (:data:`FRESH_BODY`, a new ticket number each; wrk only)
    fresh: bool = False
    #: chat completions streamed (``"stream": true``; the mock started with ``stream``): see :func:`probe`
    stream: bool = False


def probe(name: str, target: Target) -> None:
    """One request through ``target`` (httpx, the load's body) before it is measured; raises
    ``RuntimeError`` unless it answers 200 and, for a streamed target, an event stream that ends
    with ``data: [DONE]``, carries text, and holds no error event (the gateway ends a stream it
    refused with an error event and ``[DONE]`` under the 200 a load generator counts)."""
    body = body_for(target.url, stream=target.stream)
    if target.stream and not body.get("stream"):
        raise RuntimeError(f"{name}: streams are measured on chat completions only, not {target.url}")
    r = httpx.post(target.url, json=body, headers=target.headers, timeout=10, trust_env=False)
    if r.status_code != 200:
        raise RuntimeError(f"{name}: probe request answered {r.status_code}: {r.text[:300]}")
    if target.stream:
        problem = stream_problem(r.headers.get("content-type", ""), r.content)
        if problem:
            raise RuntimeError(f"{name}: the streamed probe answered {problem}")


def stream_problem(content_type: str, content: bytes) -> str | None:
    """What is wrong with a streamed chat completion's answer (``None``: nothing): not
    ``text/event-stream``, no ``data: [DONE]`` at its end, an event whose data is not a JSON
    object or is an error (the gateway's or an engine's), or no text in any chunk."""
    if not content_type.startswith("text/event-stream"):
        return f"{content_type!r}, not an event stream: {content[:300]!r}"
    if not content.endswith(b"data: [DONE]\n\n"):
        return f"a stream that does not end with data: [DONE]: ...{content[-300:]!r}"
    text = ""
    for event in content.replace(b"\r\n", b"\n").split(b"\n\n"):
        data = b"\n".join(ln[5:].lstrip(b" ") for ln in event.split(b"\n") if ln.startswith(b"data:"))
        if not data or data == b"[DONE]":
            continue
        try:
            obj = json.loads(data)
        except ValueError:
            obj = None
        if not isinstance(obj, dict) or "error" in obj or obj.get("object") == "error":
            return f"an error or unreadable event: {data[:300]!r}"
        text += "".join((c.get("delta") or {}).get("content") or "" for c in obj.get("choices") or [])
    return None if text else f"no text: {content[:300]!r}"


class Skip(Exception):
    """A scenario cannot run here (e.g. nginx not installed); the message says why."""


Scenario = Callable[[Env], ContextManager[Target]]
SCENARIOS: dict[str, tuple[Scenario, str]] = {}
#: the scenarios a run without ``--only`` measures, in table order
DEFAULT = [
    "direct",
    "nginx",
    "naive-relay",
    "litellm",
    "kvgate-full",
    "kvgate-full-fresh",
    "kvgate-responses",
    "kvgate-bare",
    "kvgate-verify-100",
]


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


@scenario("nginx", "through nginx (1 worker, upstream keep-alive)")
def _nginx(env: Env) -> Iterator[Target]:
    if find_nginx() is None:
        raise Skip("nginx is not installed (apt-get install -y nginx)")
    port = free_port()
    p = start_nginx(env, "nginx", NGINX_PROXY.format(port=port, upstream=env.mock_url.removeprefix("http://")))
    wait_http(f"http://127.0.0.1:{port}/health", p)
    yield Target(f"http://127.0.0.1:{port}/v1/chat/completions")


@scenario("naive-relay", "the frozen FastAPI + httpx relay, uvicorn --workers 2, no features")
def _naive_relay(env: Env) -> Iterator[Target]:
    relay = env.naive_relay
    if relay is None or not relay.is_file():
        raise Skip(f"the frozen relay is not at {relay} (--naive-relay PATH)")
    port = free_port()
    p = env.spawn(
        "naive-relay",
        [sys.executable, "-m", "uvicorn", "naive_relay:app", "--host", "127.0.0.1", "--port", str(port)]
        + ["--workers", "2", "--no-access-log", "--log-level", "warning", "--app-dir", str(relay.parent)],
        env={"UPSTREAM": env.mock_url},
    )
    wait_http(f"http://127.0.0.1:{port}/v1/models", p)  # relayed: the mock's 404 is not 200
    yield Target(f"http://127.0.0.1:{port}/v1/chat/completions", note=f"{relay.name}, 2 uvicorn workers")


@scenario("python-floor", "the least a Python relay on asyncio adds: bench/floor_relay.py, 2 workers")
def _python_floor(env: Env) -> Iterator[Target]:
    port = free_port()
    upstream = env.mock_url.removeprefix("http://")
    p = env.spawn(
        "python-floor",
        [sys.executable, str(ROOT / "bench" / "floor_relay.py"), "--port", str(port), "--upstream", upstream],
    )
    wait_http(f"http://127.0.0.1:{port}/server_info", p)
    yield Target(f"http://127.0.0.1:{port}/v1/chat/completions", note="uvloop, Content-Length framing, bytes copied")


@scenario("litellm", "LiteLLM's proxy, 2 workers, its own virtualenv")
def _litellm(env: Env) -> Iterator[Target]:
    venv = env.litellm_venv
    exe = venv / "bin" / "litellm" if venv else None
    if exe is None or not os.access(exe, os.X_OK):
        raise Skip(
            f"no LiteLLM at {exe} (python -m venv .venv-litellm && .venv-litellm/bin/pip install 'litellm[proxy]')"
        )
    port = free_port()
    master_key = "sk-bench-" + secrets.token_hex(16)
    cfg = env.tmp / "litellm.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "model_list": [
                    {
                        "model_name": MODEL,
                        "litellm_params": {
                            "model": f"openai/{MODEL}",
                            "api_base": env.mock_url + "/v1",
                            "api_key": "x",
                        },
                    }
                ],
                "litellm_settings": {"drop_params": True, "telemetry": False},
            }
        )
    )
    p = env.spawn(
        "litellm",
        [str(exe), "--config", str(cfg), "--host", "127.0.0.1", "--port", str(port), "--num_workers", "2"]
        # uvicorn kills a worker that does not answer its 5 s health check: on a busy machine a
        # worker still importing LiteLLM did not, and was restarted for ever
        + ["--timeout_worker_healthcheck", "120"],
        env={
            "LITELLM_LOG": "ERROR",
            "LITELLM_TELEMETRY": "False",
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # its packaged cost map: no fetch (and retries) at startup
            "LITELLM_MASTER_KEY": master_key,  # it refuses to start without one (and checks it on each request)
            "PYTHONPATH": "",
            "DISABLE_SCHEMA_UPDATE": "true",
        },
        cwd=env.tmp,
    )
    try:
        wait_http(f"http://127.0.0.1:{port}/health/liveliness", p, timeout=420)
    except RuntimeError as e:
        raise Skip(f"LiteLLM did not start: {e}\n{env.log_tail('litellm')}") from None
    version = ""
    with contextlib.suppress(Exception):
        out = subprocess.run([str(venv / "bin" / "pip"), "show", "litellm"], capture_output=True, text=True, timeout=30)
        version = next((ln.split(":", 1)[1].strip() for ln in out.stdout.splitlines() if ln.startswith("Version")), "")
    yield Target(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        {"Authorization": f"Bearer {master_key}"},
        note=f"litellm {version}, 2 workers, master key".strip(),
    )


def redis_url_or_skip() -> str:
    """The bench's Redis (``$KVGATE_BENCH_REDIS_URL``), or :class:`Skip` when it does not answer."""
    import redis

    url = os.environ.get("KVGATE_BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")
    try:
        redis.Redis.from_url(url, socket_timeout=1, socket_connect_timeout=1).ping()
    except redis.RedisError as e:
        raise Skip(f"Redis at {url} does not answer ({type(e).__name__})") from None
    return url


@contextlib.contextmanager
def gateway_target(
    env: Env,
    *,
    name: str = "gateway",
    log_level: str = "warning",
    tenant: dict[str, Any] | None = None,
    workers: int | None = None,
    note: str = "",
    protocol: str | None = None,
    root: Path = ROOT,
    **overrides: Any,
) -> Iterator[Target]:
    """Run ``kvgate serve`` in front of the mock with settings ``overrides`` (top-level keys of
    ``kvgate.yaml``, sections merged: e.g. ``quotas={"enabled": True}``, ``redis_url=...``)
    and one bench tenant with a fresh key (``tenant``: fields added to its entry, e.g. limits);
    ``workers``: ``--workers`` (``None``: kvgate's default). Yields its :class:`Target`.
    ``protocol`` (``httptools``, ``h11``): the same app served by this file's ``--serve-gateway``
    under that uvicorn protocol (one process) instead of ``kvgate serve``'s own
    (:mod:`gateway.edge.protocol`'s bounded httptools). ``root``: the checkout whose code serves
    (default this one)."""
    port = free_port()
    key = "sk-bench-" + secrets.token_hex(16)
    settings: dict[str, Any] = {
        "gateway": {"host": "127.0.0.1", "port": port, "log_level": log_level},
        "quotas": {"enabled": False},
        "verifier": {"enabled": False},
        "redis_url": None,
        "state_dir": str(env.tmp / f"{name}-state"),
        "models": [{"id": MODEL, "context_length": 8192, "tokenizer": {"kind": "tiktoken", "name": "cl100k_base"}}],
        "upstreams": [
            {
                "name": "mock",
                "api_url": env.mock_url + "/v1",
                "pool_source": "sglang",
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
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("KVGATE_", "PROMETHEUS_"))}
    files = ["--config", str(env.tmp / f"{name}.yaml"), "--tenants", str(env.tmp / f"{name}-tenants.yaml")]
    if protocol is None:
        cmd = [sys.executable, "-m", "gateway.cli", "serve", *files]
        if workers is not None:
            cmd += ["--workers", str(workers)]
    else:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--serve-gateway", protocol, *files]
        workers = 1
    n = workers if workers is not None else (usable_cores() if settings.get("redis_url") else 1)
    extra = {"PYTHONPATH": os.pathsep.join([*map(str, env.site), str(root)])}
    metrics_dir = env.tmp / f"{name}-metrics" if n > 1 else None  # the workers' files: requests per worker
    if metrics_dir is not None:
        extra["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dir)
    p = env.spawn(name, cmd, env={**clean, **extra}, cwd=root)  # ``-m`` puts the cwd first on sys.path
    try:
        wait_http(f"http://127.0.0.1:{port}/readyz", p)
        time.sleep(2.0)  # every worker up (the first ready one answers /readyz)
    except RuntimeError as e:
        raise RuntimeError(f"{e}\n{env.log_tail(name)}") from None
    yield Target(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        {"Authorization": f"Bearer {key}"},
        note=f"{n} worker{'s' if n > 1 else ''}" + (f", {note}" if note else ""),
        server=p,
        metrics_dir=metrics_dir,
    )


#: limits that the bench load never reaches, so every request runs the whole quota stage
BENCH_LIMITS = {"rpm": 10**9, "tpm": 10**12, "max_concurrent": 10**6}


def full_features(env: Env, name: str, sample_rate: float, **kw: Any) -> ContextManager[Target]:
    """kvgate with every feature on: quotas in Redis, verifier sampling ``sample_rate``."""
    url = redis_url_or_skip()
    tenant = {"id": f"bench-{secrets.token_hex(4)}", "verify_sample_rate": sample_rate, **BENCH_LIMITS}
    return gateway_target(
        env,
        name=name,
        tenant={**tenant, **kw.pop("tenant", {})},
        redis_url=url,
        quotas=kw.pop("quotas", {"enabled": True}),
        verifier=kw.pop("verifier", {"enabled": True}),
        note=kw.pop("note", f"auth, tiktoken count, live pool, Redis quotas, metrics, verify {sample_rate:.0%}"),
        **kw,
    )


@scenario("kvgate-full", "kvgate, every feature on, verifier sampling 5%")
def _kvgate_full(env: Env) -> Iterator[Target]:
    with full_features(env, "kvgate-full", 0.05) as t:
        yield t


@scenario("kvgate-full-fresh", "kvgate-full with a new prompt in every request: no count or fingerprint cached")
def _kvgate_full_fresh(env: Env) -> Iterator[Target]:
    if shutil.which("wrk") is None:
        raise Skip("needs wrk (its Lua script writes each request's new prompt)")
    note = "as kvgate-full, every prompt new (a ticket number per request)"
    with full_features(env, "kvgate-full-fresh", 0.05, note=note) as t:
        yield dataclasses.replace(t, fresh=True)


@scenario("kvgate-full@base", "kvgate-full served from the --base checkout (a change's effect, within one run)")
def _kvgate_full_base(env: Env) -> Iterator[Target]:
    if env.base is None:
        raise Skip("no --base checkout given")
    with full_features(env, "kvgate-full-base", 0.05, root=env.base) as t:
        yield dataclasses.replace(t, note=t.note + f", from {env.base.name}")


@scenario("kvgate-responses", "kvgate-full on /v1/responses (the same turn as instructions + input)")
def _kvgate_responses(env: Env) -> Iterator[Target]:
    with full_features(env, "kvgate-responses", 0.05) as t:
        yield dataclasses.replace(t, url=t.url.replace("/v1/chat/completions", "/v1/responses"))


@scenario("kvgate-bare", "kvgate: auth, count, live pool, metrics; no quotas, no verifier")
def _kvgate_bare(env: Env) -> Iterator[Target]:
    with gateway_target(env, name="kvgate-bare", workers=usable_cores(), note="no quotas, no verifier") as t:
        yield t


@scenario("kvgate-verify-100", "kvgate-full with the verifier checking every response")
def _kvgate_verify_100(env: Env) -> Iterator[Target]:
    with full_features(env, "kvgate-verify-100", 1.0) as t:
        yield t


@scenario("kvgate-quotas", "kvgate-bare plus the Redis quotas (no verifier): what the quota stage adds")
def _kvgate_quotas(env: Env) -> Iterator[Target]:
    with full_features(env, "kvgate-quotas", 0.05, verifier={"enabled": False}, note="Redis quotas, no verifier") as t:
        yield t


@scenario("kvgate-verifier", "kvgate-bare plus the verifier at 5% (no quotas): what the verifier adds")
def _kvgate_verifier(env: Env) -> Iterator[Target]:
    with full_features(env, "kvgate-verifier", 0.05, quotas={"enabled": False}, note="verifier 5%, no quotas") as t:
        yield t


@scenario("kvgate-full-1w", "kvgate-full in one worker process")
def _kvgate_full_1w(env: Env) -> Iterator[Target]:
    with full_features(env, "kvgate-full-1w", 0.05, workers=1) as t:
        yield t


@scenario("kvgate-logged", "kvgate-full with its JSON access log on (log level info, to a file)")
def _kvgate_logged(env: Env) -> Iterator[Target]:
    with full_features(env, "kvgate-logged", 0.05, log_level="info", note="access log on") as t:
        yield t


@scenario("kvgate-strict", "kvgate-full with a strict tenant (checked before release)")
def _kvgate_strict(env: Env) -> Iterator[Target]:
    with full_features(env, "kvgate-strict", 0.0, tenant={"strict_verify": True}, note="strict tenant") as t:
        yield t


@scenario("gateway", "kvgate-bare in one worker, on kvgate serve's bounded httptools protocol")
def _gateway(env: Env) -> Iterator[Target]:
    with gateway_target(env, name="gateway", workers=1, note="bounded httptools (gateway.edge.protocol)") as t:
        yield t


@scenario("edge-httptools", "the gateway app on uvicorn's stock httptools protocol: no bound on header bytes or count")
def _edge_httptools(env: Env) -> Iterator[Target]:
    with gateway_target(env, name="edge-httptools", protocol="httptools", note="stock httptools") as t:
        yield t


@scenario("edge-h11", "the gateway app on uvicorn's h11 protocol (bounds header bytes, not their count)")
def _edge_h11(env: Env) -> Iterator[Target]:
    with gateway_target(env, name="edge-h11", protocol="h11", note="h11") as t:
        yield t


def serve_gateway(protocol: str, config: str, tenants: str) -> None:
    """``kvgate serve``'s app (same settings, stages and secrets) under uvicorn's ``protocol``
    (``httptools`` stock, or ``h11`` with ``h11_max_incomplete_event_size`` = the header limit),
    without :mod:`gateway.edge.protocol`: the alternatives the ``edge-*`` scenarios measure."""
    import uvicorn

    from config.loader import load_settings
    from config.secrets import load_secrets
    from gateway.app import create_app
    from gateway.commands.serve import build_stages
    from gateway.ops.tenants import TenantRegistry

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


@scenario("quotas-local", "kvgate, quotas in process (no Redis URL, one worker)")
def _quotas_local(env: Env) -> Iterator[Target]:
    with gateway_target(env, name="quotas-local", tenant=BENCH_LIMITS, quotas={"enabled": True}) as t:
        yield t


# ---------------------------------------------------------------- load
@dataclass
class Load:
    """One load run's result: requests/s, latency percentiles in ms, failed requests (``errors``:
    non-2xx answers and socket errors; ``non2xx``: the answers alone, where the load tells them apart)."""

    rps: float
    p50_ms: float
    p99_ms: float
    errors: int
    requests: int
    non2xx: int = 0


WRK_LUA = """
wrk.method = "POST"
wrk.body = {body}
wrk.headers["Content-Type"] = "application/json"
{headers}
"""
#: :data:`WRK_LUA` plus a request function that puts a new 9-digit number in place of
#: :data:`FRESH_MARK` in every request (thread ``t`` of ``n``: ``start + t``, ``start + t + n``, ...:
#: no number twice in a run of fewer than :data:`FRESH_RUN_STRIDE` requests)
WRK_FRESH_LUA = (
    WRK_LUA
    + """
local threads = 0
function setup(thread)
  thread:set("tid", threads)
  threads = threads + 1
  thread:set("nthreads", 2)
end
local sent = 0
function request()
  local n = 100000000 + ({start} + sent * nthreads + tid) % 900000000
  sent = sent + 1
  return wrk.format(nil, nil, nil, (string.gsub(wrk.body, "{mark}", tostring(n), 1)))
end
"""
)
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
    threads = max(1, min(2, connections // 32))
    body = json.dumps(json.dumps(body_for(target.url, target.fresh, target.stream)))
    if target.fresh:
        script = WRK_FRESH_LUA.replace('thread:set("nthreads", 2)', f'thread:set("nthreads", {threads})')
        start = next(_fresh_runs) * FRESH_RUN_STRIDE
        lua.write_text(script.format(body=body, headers=headers, mark=FRESH_MARK, start=start))
    else:
        lua.write_text(WRK_LUA.format(body=body, headers=headers))
    out = subprocess.run(
        ["wrk", "-t", str(threads), "-c", str(connections), "-d", f"{duration:.0f}s", "--latency"]
        + ["--timeout", "10s", "-s", str(lua), target.url],
        capture_output=True,
        check=False,
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
    bad = int(non2xx.group(1)) if non2xx else 0
    errors = bad + (sum(map(int, sock.groups())) if sock else 0)
    return Load(rps, _ms(pct["50"]), _ms(pct["99"]), errors, total, bad)


def run_py_load(target: Target, connections: int, duration: float, tmp: Path) -> Load:
    """The same load from a separate Python process (this file, ``--load``) when wrk is absent."""
    out = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--load", "--url", target.url]
        + ["--connections", str(connections), "--duration", str(duration), "--headers", json.dumps(target.headers)]
        + (["--stream-body"] if target.stream else []),
        capture_output=True,
        check=False,
        text=True,
        timeout=duration + 60,
    )
    if out.returncode != 0:
        raise RuntimeError(f"load process failed: {out.stderr[-2000:]}")
    return Load(**json.loads(out.stdout.strip().splitlines()[-1]))


async def _py_load(
    url: str, connections: int, duration: float, headers: dict[str, str], stream: bool = False
) -> dict[str, Any]:
    import asyncio

    u = httpx.URL(url)
    body = json.dumps(body_for(url, stream=stream)).encode()
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
    q = lambda f: lat[min(len(lat) - 1, int(f * len(lat)))] * 1000
    return {
        "rps": len(lat) / elapsed,
        "p50_ms": q(0.5),
        "p99_ms": q(0.99),
        "errors": errors,
        "requests": len(lat),
        "non2xx": errors,
    }


# ---------------------------------------------------------------- per worker: requests and profiles
def worker_pids(target: Target) -> list[int]:
    """The processes serving ``target``: its supervisor's children (Linux ``/proc``), else the
    process itself; empty for a scenario that is not kvgate."""
    p = target.server
    if p is None or p.poll() is not None:
        return []
    try:
        kids = [int(x) for x in Path(f"/proc/{p.pid}/task/{p.pid}/children").read_text().split()]
    except OSError:
        kids = []
    return kids or [p.pid]


def requests_per_worker(target: Target) -> dict[int, float]:
    """``kvgate_requests_total`` so far per worker pid, read from the workers' prometheus-client
    files (``counter_<pid>.db`` in ``target.metrics_dir``); empty without workers."""
    if target.metrics_dir is None:
        return {}
    from prometheus_client.mmap_dict import MmapedDict

    out: dict[int, float] = {}
    for f in target.metrics_dir.glob("counter_*.db"):
        with contextlib.suppress(OSError, ValueError):
            values = MmapedDict.read_all_values_from_file(str(f))
            out[int(f.stem.split("_")[1])] = sum(v[1] for v in values if json.loads(v[0])[0] == "kvgate_requests")
    return out


def split_of(before: dict[int, float], after: dict[int, float]) -> tuple[float, ...]:
    """Each worker's share of the requests between two :func:`requests_per_worker` readings,
    largest first (``()`` without workers)."""
    delta = [after[k] - before.get(k, 0.0) for k in after]
    total = sum(delta)
    return tuple(sorted((d / total for d in delta), reverse=True)) if total > 0 else ()


def py_spy() -> str | None:
    """The ``py-spy`` binary (beside this Python, else on the PATH), or ``None``."""
    local = Path(sys.executable).parent / "py-spy"
    return str(local) if os.access(local, os.X_OK) else shutil.which("py-spy")


def profiled_load(
    load: Callable[..., Load], target: Target, connections: int, duration: float, tmp: Path, out: Path
) -> tuple[Load, list[Path]]:
    """One load run with ``py-spy record`` sampling every worker of ``target`` meanwhile (raw
    collapsed stacks, 200 Hz, no line numbers, ``<out>-w<pid>.txt``)."""
    spy = py_spy()
    if spy is None:
        raise RuntimeError("py-spy is not installed (pip install py-spy)")
    files, spies = [], []
    for pid in worker_pids(target):
        f = out.with_name(f"{out.name}-w{pid}.txt")
        cmd = [spy, "record", "--pid", str(pid), "--format", "raw", "--nolineno", "--rate", "200"]
        cmd += ["--duration", f"{duration:.0f}", "--output", str(f), "--nonblocking"]
        spies.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        files.append(f)
    time.sleep(0.5)  # py-spy attached
    result = load(target, connections, duration, tmp)
    for sp in spies:
        sp.wait(duration + 30)
    return result, [f for f in files if f.exists()]


def read_stacks(files: list[Path]) -> dict[tuple[str, ...], int]:
    """py-spy raw output (``frame;frame;... count`` lines, root first) summed over ``files``."""
    stacks: dict[tuple[str, ...], int] = {}
    for f in files:
        for line in f.read_text(errors="replace").splitlines():
            frames, _, count = line.rpartition(" ")
            if frames and count.isdigit():
                key = tuple(frames.split(";"))
                stacks[key] = stacks.get(key, 0) + int(count)
    return stacks


def _short(frame: str) -> str:
    """``func (path/to/mod.py)`` -> ``mod.py:func`` (package folder kept for the project's own)."""
    m = re.fullmatch(r"(.*) \((.*)\)", frame)
    if not m:
        return frame
    func, path = m.groups()
    parts = Path(path).parts
    keep = 2 if len(parts) > 1 and parts[-2] in {"admission", "edge", "ops", "quotas", "relay", "routes"} else 1
    return f"{'/'.join(parts[-keep:])}:{func}"


def top_frames(
    stacks: dict[tuple[str, ...], int], n: int
) -> tuple[int, list[tuple[str, float]], list[tuple[str, float]]]:
    """(samples, the ``n`` frames with the largest inclusive share, the ``n`` largest self shares)."""
    total = sum(stacks.values())
    incl: dict[str, int] = {}
    own: dict[str, int] = {}
    for frames, count in stacks.items():
        names = [_short(f) for f in frames]
        for name in set(names):
            incl[name] = incl.get(name, 0) + count
        own[names[-1]] = own.get(names[-1], 0) + count
    rank = lambda d: [(k, v / max(1, total)) for k, v in sorted(d.items(), key=lambda kv: -kv[1])[:n]]
    return total, rank(incl), rank(own)


def profile_table(name: str, c: int, load: Load, split: tuple[float, ...], stacks: dict[tuple[str, ...], int]) -> str:
    """A markdown section: one profile's top frames, inclusive and self, with shares of samples."""
    total, incl, own = top_frames(stacks, 25)
    shares = "/".join(f"{x:.0%}" for x in split) or "one process"
    lines = [
        f"### {name}, c={c}: {load.rps:.0f} req/s, p50 {load.p50_ms:.2f} ms; {total} samples; requests per worker {shares}",
        "",
        "| inclusive | frame | | self | frame |",
        "|---:|---|---|---:|---|",
    ]
    for i in range(max(len(incl), len(own))):
        a = incl[i] if i < len(incl) else ("", 0.0)
        b = own[i] if i < len(own) else ("", 0.0)
        lines.append(f"| {a[1]:.1%} | `{a[0]}` | | {b[1]:.1%} | `{b[0]}` |")
    return "\n".join(lines)


def run_profiles(
    targets: dict[str, tuple[Target, str]],
    load: Callable[..., Load],
    connections: int,
    duration: float,
    tmp: Path,
    out: Path,
) -> None:
    """For every kvgate scenario: one c=1 and one c=``connections`` run under py-spy, every worker
    sampled; the top frames printed (markdown) and written to ``out/profile.md`` with the raw stacks."""
    out.mkdir(parents=True, exist_ok=True)
    sections = []
    for name, (target, _) in targets.items():
        if target.server is None:
            continue
        for c in (1, connections):
            before = requests_per_worker(target)
            result, files = profiled_load(load, target, c, duration, tmp, out / f"{name}-c{c}")
            split = split_of(before, requests_per_worker(target))
            sections.append(profile_table(name, c, result, split, read_stacks(files)))
            print(sections[-1] + "\n", flush=True)
    (out / "profile.md").write_text("\n\n".join(sections) + "\n")


# ---------------------------------------------------------------- upstream clients (--transports)
TRANSPORTS = {
    "httpx": "httpx.AsyncClient, its default transport (httpcore)",
    "httpx-aiohttp": "httpx.AsyncClient over aiohttp (httpx_aiohttp.AiohttpTransport)",
    "aiohttp": "aiohttp.ClientSession itself",
    "kvgate-aiohttp": "the gateway's UpstreamClient, upstream_client: aiohttp",
    "kvgate-h1": "the gateway's UpstreamClient, upstream_client: h1 (its own transport on httptools)",
}


async def _read_whole(r: Any) -> int:
    """Read a streamed response (httpx's or the gateway's ``UpstreamClient``'s) whole, close it,
    and return its status code."""
    try:
        await r.aread()
    finally:
        await r.aclose()
    return int(r.status_code)


async def _client_load(kind: str, url: str, concurrency: int, duration: float) -> dict[str, Any]:
    """``concurrency`` tasks POSTing :data:`BODY` to ``url`` with one pooled client of ``kind`` for
    ``duration`` seconds, reading each body whole (what the gateway's forward does)."""
    import asyncio

    body = json.dumps(BODY).encode()
    headers = {"content-type": "application/json", "accept-encoding": "identity"}
    lat: list[float] = []
    errors = 0
    end = time.perf_counter() + duration
    if kind.startswith("kvgate-"):
        from gateway.relay.upstream_client import UpstreamClient

        upstream = UpstreamClient(
            connect_timeout=10, read_timeout=30, max_connections=512, kind=kind.removeprefix("kvgate-")
        )

        async def one() -> int:
            return await _read_whole(await upstream.send("POST", url, body, headers))

        close = upstream.aclose
    elif kind == "aiohttp":
        import aiohttp

        session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=512), timeout=aiohttp.ClientTimeout(total=30)
        )

        async def one() -> int:
            async with session.post(url, data=body, headers=headers) as r:
                await r.read()
                return r.status

        close = session.close
    else:
        limits = httpx.Limits(max_connections=512, max_keepalive_connections=512)
        if kind == "httpx-aiohttp":
            from httpx_aiohttp import AiohttpTransport

            client = httpx.AsyncClient(transport=AiohttpTransport(limits=limits, trust_env=False), timeout=30)
        else:
            client = httpx.AsyncClient(limits=limits, timeout=30, trust_env=False)

        async def one() -> int:
            req = client.build_request("POST", url, content=body, headers=headers)
            return await _read_whole(await client.send(req, stream=True))

        close = client.aclose

    async def worker() -> None:
        nonlocal errors
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            if await one() != 200:
                errors += 1
            lat.append(time.perf_counter() - t0)

    await asyncio.gather(*(worker() for _ in range(min(concurrency, 4))))  # warm the pool
    lat.clear()
    end = time.perf_counter() + duration
    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - t0
    await close()
    lat.sort()
    q = lambda f: lat[min(len(lat) - 1, int(f * len(lat)))] * 1000
    return {"rps": len(lat) / elapsed, "p50_ms": q(0.5), "p99_ms": q(0.99), "errors": errors, "requests": len(lat)}


def run_transports(env: Env, connections: int, duration: float, rounds: int) -> None:
    """Compare :data:`TRANSPORTS` against the mock, interleaved rounds, and print a table."""
    runs: dict[str, list[tuple[Load, Load]]] = {}
    skipped: dict[str, str] = {}
    for kind in TRANSPORTS:
        mod = {"httpx": "httpx", "httpx-aiohttp": "httpx_aiohttp"}.get(kind, "aiohttp")
        probe = subprocess.run([sys.executable, "-c", f"import {mod}"], capture_output=True, check=False)
        if probe.returncode != 0:
            skipped[kind] = f"{mod} is not installed"
    for rnd in range(1, rounds + 1):
        for kind in TRANSPORTS:
            if kind in skipped:
                continue
            pair = []
            for c in (1, connections):
                out = subprocess.run(
                    [sys.executable, str(Path(__file__).resolve()), "--client-load", kind, "--url"]
                    + [env.mock_url + "/v1/chat/completions", "--connections", str(c), "--duration", str(duration)],
                    capture_output=True,
                    check=False,
                    text=True,
                    timeout=duration * 2 + 60,
                )
                if out.returncode != 0:
                    raise RuntimeError(f"{kind} load failed: {out.stderr[-2000:]}")
                pair.append(Load(**json.loads(out.stdout.strip().splitlines()[-1])))
            runs.setdefault(kind, []).append((pair[0], pair[1]))
            print(
                f"  round {rnd} {kind}: c=1 p50 {pair[0].p50_ms:.3f} ms; c={connections} {pair[1].rps:.0f} req/s, "
                f"p99 {pair[1].p99_ms:.2f} ms",
                flush=True,
            )
    import statistics

    head = f"{'client':<14} {'c=1 p50 ms':>10} {'c=1 rps':>8} {f'c={connections} rps':>10} {f'c={connections} p99':>9}  what"
    print()
    print(head)
    print("-" * len(head))
    for kind, what in TRANSPORTS.items():
        if kind in skipped:
            print(f"{kind:<14} skipped: {skipped[kind]}")
            continue
        r = runs[kind]
        print(
            f"{kind:<14} {statistics.median(o.p50_ms for o, _ in r):10.3f} {statistics.median(o.rps for o, _ in r):8.0f} "
            f"{statistics.median(m.rps for _, m in r):10.0f} {statistics.median(m.p99_ms for _, m in r):9.2f}  {what}"
        )


# ---------------------------------------------------------------- the table
@dataclass
class Round:
    """One round of a scenario: the 1-connection run, the N-connection run, and the N run's
    requests per worker as shares, largest first (``()`` when not kvgate's workers)."""

    one: Load
    many: Load
    split: tuple[float, ...] = ()

    def describe(self) -> str:
        """The round as one progress line."""
        shares = "/".join(f"{x:.0%}" for x in self.split)
        return (
            f"c=1 p50 {self.one.p50_ms:.3f} ms, p99 {self.one.p99_ms:.3f} ms; c=N {self.many.rps:.0f} req/s, "
            f"p99 {self.many.p99_ms:.2f} ms" + (f"; requests per worker {shares}" if shares else "")
        )


@dataclass
class Row:
    """A scenario's medians over rounds: at 1 connection (p50/p99) and at N (rps, p99), with
    every round kept for the spread and the within-round ratios."""

    one: Load
    many: Load
    note: str
    rounds: list[Round] = field(default_factory=list)

    def span(self, pick: Callable[[Round], float], fmt: str = "{:.0f}") -> str:
        """``min-max`` of ``pick`` over the rounds."""
        vals = [pick(r) for r in self.rounds]
        return f"{fmt.format(min(vals))}-{fmt.format(max(vals))}" if vals else ""

    def worker_split(self) -> str:
        """The busiest worker's share of the N-connection requests, min-max over rounds (``-``
        without workers): 50% is an even split over two."""
        tops = [r.split[0] for r in self.rounds if len(r.split) > 1]
        return f"{min(tops):.0%}-{max(tops):.0%}" if tops else "-"


def measure_round(load: Callable[..., Load], target: Target, connections: int, duration: float, tmp: Path) -> Round:
    """One round of one scenario: a 1-connection run, then a ``connections`` run whose requests
    are counted per worker."""
    one = load(target, 1, duration, tmp)
    before = requests_per_worker(target)
    many = load(target, connections, duration, tmp)
    return Round(one, many, split_of(before, requests_per_worker(target)))


def median_row(runs: list[Round], note: str) -> Row:
    """Medians over rounds of (1-connection run, N-connection run); errors and requests summed."""
    import statistics

    def med(loads: list[Load]) -> Load:
        return Load(
            statistics.median(x.rps for x in loads),
            statistics.median(x.p50_ms for x in loads),
            statistics.median(x.p99_ms for x in loads),
            sum(x.errors for x in loads),
            sum(x.requests for x in loads),
        )

    return Row(med([r.one for r in runs]), med([r.many for r in runs]), note, list(runs))


def round_ratios(row: Row, ref: Row, pick: Callable[[Round], float]) -> list[float]:
    """``pick(row's round i) / pick(ref's round i)`` for each round both ran: ratios taken
    within one round, where a noisy neighbour hit both alike."""
    return [pick(a) / pick(b) for a, b in zip(row.rounds, ref.rounds, strict=False) if pick(b) > 0]


def ratio_cell(row: Row, ref: Row | None, pick: Callable[[Round], float], width: int) -> str:
    """The median within-round ratio and its min-max, e.g. ``1.31 (1.20-1.40)``."""
    import statistics

    if ref is None:
        return f"{'':>{width}}"
    xs = round_ratios(row, ref, pick)
    if not xs:
        return f"{'':>{width}}"
    return f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})".rjust(width)


def _rps(r: Round) -> float:
    return r.many.rps


def _p99(r: Round) -> float:
    return r.many.p99_ms


def fmt_row(name: str, r: Row, base: Row | None, relay: Row | None, lite: Row | None) -> str:
    """One line of :func:`fmt_table`."""
    add50 = f"{r.one.p50_ms - base.one.p50_ms:7.3f}" if base else f"{'':>7}"
    add99 = f"{r.one.p99_ms - base.one.p99_ms:7.3f}" if base else f"{'':>7}"
    return (
        f"{name:<18} {r.one.p50_ms:8.3f} {r.span(lambda x: x.one.p50_ms, '{:.2f}'):>11} {r.one.p99_ms:8.3f} "
        f"{add50} {add99} {r.many.rps:7.0f} {r.span(_rps):>11} {r.many.p99_ms:8.2f} "
        f"{ratio_cell(r, relay, _rps, 17)} {ratio_cell(r, lite, _rps, 17)} {ratio_cell(r, relay, _p99, 17)} "
        f"{r.worker_split():>9} {r.one.errors + r.many.errors:6d}  {r.note}"
    )


def fmt_table(rows: list[tuple[str, Row | str]], connections: int) -> str:
    """The side-by-side table (medians over rounds, min-max spread, within-round ratios, the
    busiest worker's share) and the goal checks of the throughput issue."""
    got = {n: r for n, r in rows if isinstance(r, Row)}
    base, relay, lite = got.get("direct"), got.get("naive-relay"), got.get("litellm")
    c = connections
    head = (
        f"{'scenario':<18} {'c=1 p50':>8} {'(min-max)':>11} {'c=1 p99':>8} {'+p50':>7} {'+p99':>7} {f'c={c} rps':>7} "
        f"{'(min-max)':>11} {f'c={c} p99':>8} {'x relay (rounds)':>17} {'x litellm':>17} {'p99/relay':>17} "
        f"{'busiest w':>9} {'errors':>6}  note"
    )
    lines = [head, "-" * len(head)]
    for name, r in rows:
        lines.append(f"{name:<18} skipped: {r}" if not isinstance(r, Row) else fmt_row(name, r, base, relay, lite))
    lines.append("")
    lines.append(
        "medians over rounds; (min-max): the spread over rounds; x relay / x litellm / p99/relay: the median "
        "(min-max) of the ratios taken within each round; busiest w: the busiest worker's share of the "
        f"c={c} requests (50% = an even split over 2), min-max over rounds"
    )
    full = got.get("kvgate-full")
    base_full = got.get("kvgate-full@base")
    if full and base_full:
        lines.append(
            f"kvgate-full / kvgate-full@base, c={c} rps: {ratio_cell(full, base_full, _rps, 0).strip()}; p99: {ratio_cell(full, base_full, _p99, 0).strip()}; c=1 p50: {ratio_cell(full, base_full, lambda x: x.one.p50_ms, 0).strip()} (within-round ratios)"
        )
    if full:
        lines += goal_lines(full, base, relay, lite, got.get("kvgate-verify-100"))
    return "\n".join(lines)


def goal_lines(full: Row, base: Row | None, relay: Row | None, lite: Row | None, v100: Row | None) -> list[str]:
    """The throughput issue's goals for kvgate-full, each ``met`` / ``MISS`` on the within-round
    median ratio (its min-max alongside)."""
    import statistics

    lines = ["", "goals (kvgate-full):"]

    def goal(text: str, ok: bool, value: str) -> None:
        lines.append(f"  [{'met ' if ok else 'MISS'}] {text}: {value}")

    def med(xs: list[float]) -> tuple[float, str]:
        return statistics.median(xs), f"{statistics.median(xs):.2f}x ({min(xs):.2f}-{max(xs):.2f})"

    if relay and round_ratios(full, relay, _rps):
        x, shown = med(round_ratios(full, relay, _rps))
        goal("floor: c=64 rps >= 1x the naive relay", x >= 1, shown)
        goal("c=64 rps >= 2x the naive relay", x >= 2, shown)
        p, shown = med(round_ratios(full, relay, _p99))
        goal("c=64 p99 <= 0.5x the naive relay's", p <= 0.5, shown)
    if lite and round_ratios(full, lite, _rps):
        x, shown = med(round_ratios(full, lite, _rps))
        goal("c=64 rps >= 10x LiteLLM", x >= 10, shown)
    if base:
        add = full.one.p50_ms - base.one.p50_ms
        goal("c=1 added p50 <= 0.5 ms", add <= 0.5, f"{add:.3f} ms")
    if v100 and round_ratios(v100, full, _rps):
        x, _ = med(round_ratios(v100, full, _rps))
        goal("verification at 100% costs <= 10% of rps", 1 - x <= 0.10, f"{1 - x:.1%}")
    return lines


# ---------------------------------------------------------------- main
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=5.0, help="seconds per load run (default 5)")
    ap.add_argument("--connections", type=int, default=64, help="connections for the requests/s run (default 64)")
    ap.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="interleaved rounds over all scenarios; the table shows medians and min-max (default 3)",
    )
    ap.add_argument(
        "--profile",
        type=Path,
        default=None,
        metavar="DIR",
        help="instead of the rounds: one c=1 and one c=N run per kvgate scenario under py-spy (every "
        "worker sampled); top frames printed and written to DIR/profile.md, raw stacks beside it",
    )
    ap.add_argument(
        "--only",
        default="",
        help=f"comma-separated scenarios (default: {','.join(DEFAULT)}); all: {', '.join(SCENARIOS)}",
    )
    ap.add_argument(
        "--naive-relay",
        type=Path,
        default=ROOT.parent / "shared" / "bench" / "naive_relay.py",
        help="the frozen relay (default: ../shared/bench/naive_relay.py beside the checkout)",
    )
    ap.add_argument(
        "--base",
        type=Path,
        default=None,
        help="another kvgate checkout: adds kvgate-full@base (kvgate-full served from it) to the run",
    )
    ap.add_argument("--litellm-venv", type=Path, default=ROOT / ".venv-litellm", help="virtualenv with litellm[proxy]")
    ap.add_argument("--python-mock", action="store_true", help="use bench/mock_engine.py even when nginx is installed")
    ap.add_argument("--transports", action="store_true", help="compare upstream HTTP clients instead (see above)")
    ap.add_argument("--load", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--client-load", help=argparse.SUPPRESS)
    ap.add_argument("--url", help=argparse.SUPPRESS)
    ap.add_argument("--headers", default="{}", help=argparse.SUPPRESS)
    ap.add_argument("--stream-body", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--serve-gateway", choices=["httptools", "h11"], help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    ap.add_argument("--tenants", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_gateway:
        serve_gateway(args.serve_gateway, args.config, args.tenants)
        return 0

    if args.load or args.client_load:  # a separate load process
        import asyncio

        with contextlib.suppress(ImportError):
            import uvloop

            uvloop.install()
        if args.client_load:
            out = asyncio.run(_client_load(args.client_load, args.url, args.connections, args.duration))
        else:
            out = asyncio.run(
                _py_load(args.url, args.connections, args.duration, json.loads(args.headers), args.stream_body)
            )
        print(json.dumps(out))
        return 0

    names = [n for n in (args.only.split(",") if args.only else DEFAULT) if n]
    if args.base and "kvgate-full@base" not in names:
        names.insert(names.index("kvgate-full") + 1 if "kvgate-full" in names else len(names), "kvgate-full@base")
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        ap.error(f"unknown scenario(s) {', '.join(unknown)}; known: {', '.join(SCENARIOS)}")
    load = run_wrk if shutil.which("wrk") else run_py_load
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stopped run still stops what it started
    tmp = Path(tempfile.mkdtemp(prefix="kvgate-bench-"))
    os.chmod(tmp, 0o755)
    mock_port = free_port()
    env = Env(
        f"http://127.0.0.1:{mock_port}",
        tmp,
        naive_relay=args.naive_relay.resolve() if args.naive_relay else None,
        litellm_venv=args.litellm_venv.resolve() if args.litellm_venv else None,
        base=args.base.resolve() if args.base else None,
    )
    mock, mock_note = start_mock(env, mock_port, prefer_nginx=not args.python_mock)
    try:
        load_avg = os.getloadavg()[0]
    except OSError:
        load_avg = float("nan")
    print(
        f"load generator: {'wrk (Lua POST script)' if load is run_wrk else 'Python load process (wrk not installed)'}; "
        f"mock engine: {mock_note}; {args.duration:.0f} s per run; c=1 and c={args.connections}; "
        f"{args.rounds} interleaved round(s), medians; {usable_cores()} usable CPUs, load average {load_avg:.1f} "
        "(other work on this machine makes every number noisy)",
        flush=True,
    )
    rows: list[tuple[str, Row | str]] = []
    runs: dict[str, list[Round]] = {}
    try:
        wait_http(env.mock_url + "/health", mock)
        if args.transports:
            run_transports(env, args.connections, args.duration, args.rounds)
            return 0
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
                probe(name, target)
                load(target, args.connections, 1.0, tmp)  # warm-up (every worker, every pool)
                targets[name] = (target, target.note or help_)
            if args.profile is not None:
                run_profiles(targets, load, args.connections, args.duration, tmp, args.profile)
                return 0
            order = list(targets)
            for rnd in range(1, args.rounds + 1):  # interleaved rounds: a noisy neighbour hits all alike
                for name in order if rnd % 2 else reversed(order):  # no scenario always goes first
                    target = targets[name][0]
                    runs.setdefault(name, []).append(measure_round(load, target, args.connections, args.duration, tmp))
                    print(f"  round {rnd} {name}: {runs[name][-1].describe()}", flush=True)
            for name in names:
                if name in skipped:
                    rows.append((name, skipped[name]))
                elif name in runs:
                    rows.append((name, median_row(runs[name], targets[name][1])))
    finally:
        for p in reversed(env.procs):
            stop(p)
        shutil.rmtree(tmp, ignore_errors=True)
    print()
    print(fmt_table(rows, args.connections))
    return 0


if __name__ == "__main__":
    sys.exit(main())
