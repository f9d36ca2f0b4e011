"""``kvgate serve --workers N``: N real worker processes on one port behave as one gateway.

The fleet is a real ``kvgate serve --workers 2`` (a supervisor and two workers) with quotas in the
real Redis on 127.0.0.1:6379, the verifier on (leak index, canary registry and quarantine in
Redis) and metrics in prometheus-client's multiprocess mode, in front of the mock engine that this
test process runs. A test reaches a given worker through a keep-alive connection whose
``/healthz`` answered that worker's ``x-kvgate-worker``. Tenant ids and the upstream's name carry
a random suffix, so this run's Redis keys are its own.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from quota_fixtures import free_port

from config.models import Settings
from gateway.cli import main as cli_main
from gateway.edge import workers as wk
from gateway.quotas.tenant_quotas import TenantQuotas, build_quota_stage
from tests.conftest import ROOT
from tests.fixtures.engines import reset_state
from tests.fixtures.replicas import incidents, wait_until
from tests.mock_engine import MockEngine, MockState
from tokenizer import bundled_counter

pytestmark = pytest.mark.timeout(120)

MODEL = "kvgate-tiny"
REDIS_URL = "redis://127.0.0.1:6379/0"
RUN = uuid.uuid4().hex[:8]
UPSTREAM = f"wk-{RUN}"
COUNTER = bundled_counter()
KEYS = {name: f"sk-test-{name}-{uuid.uuid4().hex}" for name in ("a", "b", "hp", "late")}
CANARY = "KVGATE-CANARY-" + uuid.uuid4().hex[:16]
#: a text long enough for shingles (well over 50 tokens); unique to this run
SECRET_TEXT = (
    f"run {RUN}: the quarterly forecast for the northern warehouse lists seventeen pallets of copper "
    "wire, nine crates of ceramic insulators, and a standing order of four hundred brass fittings "
    "to be shipped every second Tuesday, invoiced to the harbour office under contract number "
    f"{uuid.uuid4().hex} with a penalty clause of two percent per day of delay beyond the agreed date."
)


def tid(name: str) -> str:
    return f"{name}-{RUN}"


def _tenant(name: str, **kw: Any) -> dict[str, Any]:
    return {
        "id": tid(name),
        "api_key_sha256": [hashlib.sha256(KEYS[name].encode()).hexdigest()],
        "allowed_models": [MODEL],
        "default_max_tokens": 4,
        **kw,
    }


def _settings(engine: MockEngine, state_dir: Path, **over: Any) -> dict[str, Any]:
    s: dict[str, Any] = {
        "gateway": {"host": "127.0.0.1", "read_timeout_seconds": 30, "drain_timeout_seconds": 10},
        "pool": {"poll_interval_seconds": 1, "max_staleness_seconds": 30},
        "quotas": {"enabled": True, "window_seconds": 60},
        "redis_url": REDIS_URL,
        "verifier": {
            "enabled": True,
            "usage_drift_tolerance_tokens": 100_000,  # the mock reports a fixed prompt_tokens
            "quarantine_min_prompt_tokens": 16,
        },
        "state_dir": str(state_dir),
        "models": [{"id": MODEL, "context_length": 8192, "tokenizer": {"kind": "bundled"}}],
        "upstreams": [
            {
                "name": UPSTREAM,
                "api_url": engine.api_url,
                "pool_source": "sglang",
                "pool_urls": [engine.info_url],
                "models": [MODEL],
            }
        ],
    }
    s.update(over)
    return s


def _children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


class Fleet:
    """A ``kvgate serve --workers N`` process on a free port, with clients pinned to workers."""

    def __init__(
        self,
        workdir: Path,
        settings: dict[str, Any],
        tenants: list[dict[str, Any]],
        workers: int = 2,
        extra: tuple[str, ...] = (),
    ):
        self.workdir = workdir
        self.workers = workers
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config = workdir / "kvgate.yaml"
        self.config.write_text(yaml.safe_dump(settings))
        self.tenants_path = workdir / "tenants.yaml"
        self.tenants_path.write_text(yaml.safe_dump({"tenants": tenants}))
        self.log_path = workdir / "serve.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("KVGATE_", "PROMETHEUS_"))}
        env["PYTHONPATH"] = str(ROOT)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "gateway.cli", "serve", "--config", str(self.config)]
                + ["--tenants", str(self.tenants_path), "--port", str(self.port), "--workers", str(workers)]
                + ["--log-level", "warning", *extra],
                cwd=ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self._pinned: dict[int, httpx.Client] = {}

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Until every worker answers /readyz 200."""
        deadline = time.monotonic() + timeout
        seen: set[int] = set()
        while len(seen) < self.workers:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvgate serve exited {self.proc.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"workers {seen} of {self.workers} ready after {timeout}s:\n{self.log()}")
            try:
                with httpx.Client(base_url=self.url, timeout=2) as c:
                    r = c.get("/readyz")
                    if r.status_code == 200:
                        seen.add(int(c.get("/healthz").headers["x-kvgate-worker"]))
            except httpx.HTTPError:
                time.sleep(0.1)

    def on(self, worker: int) -> httpx.Client:
        """A client whose one keep-alive connection is served by ``worker`` (checked just now)."""
        c = self._pinned.get(worker)
        if c is not None:
            try:
                if c.get("/healthz").headers.get("x-kvgate-worker") == str(worker):
                    return c
            except httpx.HTTPError:
                pass
            c.close()
        for _ in range(200):
            c = httpx.Client(
                base_url=self.url, timeout=15, limits=httpx.Limits(max_connections=1, max_keepalive_connections=1)
            )
            try:
                if c.get("/healthz").headers.get("x-kvgate-worker") == str(worker):
                    self._pinned[worker] = c
                    return c
            except httpx.HTTPError:
                time.sleep(0.05)
            c.close()
        raise AssertionError(f"no connection reached worker {worker}")

    def post(self, worker: int, key: str, content: str = "Say hello.", **body: Any) -> httpx.Response:
        return self.on(worker).post(
            "/v1/chat/completions",
            headers={"authorization": f"Bearer {key}"},
            json={"model": MODEL, "messages": [{"role": "user", "content": content}], **body},
        )

    def metrics(self, worker: int) -> dict[tuple[str, tuple], float]:
        """``/metrics`` of ``worker`` as {(sample name, sorted labels): value}."""
        text = self.on(worker).get("/metrics").text
        out: dict[tuple[str, tuple], float] = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return out

    def stop(self) -> None:
        for c in self._pinned.values():
            c.close()
        self._pinned.clear()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def value(m: dict, name: str, **labels: str) -> float:
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture()
def mock(module_engine: MockEngine) -> MockState:
    return reset_state(module_engine)


@pytest.fixture(scope="module")
def fleet(module_engine: MockEngine, tmp_path_factory) -> Iterator[Fleet]:
    work = tmp_path_factory.mktemp("workers")
    tenants = [
        _tenant("a", rpm=10**6, verify_sample_rate=1.0),
        _tenant("b", rpm=10**6, verify_sample_rate=1.0),
        _tenant("hp", honeypot=True),
    ]
    f = Fleet(work, _settings(module_engine, work / "state"), tenants)
    try:
        f.wait_ready()
        yield f
    finally:
        f.stop()
        import redis

        r = redis.Redis.from_url(REDIS_URL)
        r.hdel("kvgate:quarantine", UPSTREAM)
        for name in KEYS:
            keys = r.keys(f"kvgate:q:{{{tid(name)}}}:*")
            if keys:
                r.delete(*keys)
        r.close()


# ---------------------------------------------------------------- one gateway, several processes
def test_a_neighbour_cannot_bind_the_workers_port_with_reuseport(fleet: Fleet) -> None:
    """The workers share the supervisor's one listening socket, which has no SO_REUSEPORT: a
    second process of the same user binding the port with SO_REUSEPORT gets EADDRINUSE (it used
    to join the workers' group and receive a share of the connections, keys included)."""
    import errno
    import socket

    fleet.wait_ready()
    code = (
        "import socket, sys\n"
        "s = socket.socket()\n"
        "s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
        "s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)\n"
        "try:\n"
        f"    s.bind(('127.0.0.1', {fleet.port})); s.listen(16)\n"
        "except OSError as e:\n"
        "    print(e.errno); sys.exit(0)\n"
        "print('bound')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert out.stdout.strip() == str(errno.EADDRINUSE)
    with socket.create_connection(("127.0.0.1", fleet.port), timeout=5):  # the gateway still serves
        pass
    assert fleet.on(0).get("/healthz").status_code == 200
    assert fleet.on(1).get("/healthz").status_code == 200


def test_counters_add_up_exactly_across_workers(fleet: Fleet, mock: MockState) -> None:
    before = fleet.metrics(0)
    content = "Count me once, wherever I land."
    prompt = COUNTER.count_chat([{"role": "user", "content": content}])
    for i in range(12):  # 7 on worker 0, 5 on worker 1
        r = fleet.post(0 if i < 7 else 1, KEYS["a"], content)
        assert r.status_code == 200, r.text
    for w in (0, 0, 1):
        r = fleet.post(w, "sk-not-a-key")
        assert (r.status_code, r.json()["error"]["code"]) == (401, "invalid_api_key")
    assert len(mock.requests) == 12
    words = len(mock.text.split(" "))

    def delta(m: dict, name: str, **labels: str) -> float:
        return value(m, name, **labels) - value(before, name, **labels)

    a = tid("a")
    # the verifier checks every response of tenant a in the background: wait for the 12th
    assert wait_until(
        lambda: delta(fleet.metrics(1), "kvgate_verifier_checks_total", upstream=UPSTREAM, mode="sampled") >= 12, 15
    ), fleet.log()
    time.sleep(0.3)
    for w in (0, 1):  # every worker's /metrics shows the sum of all of them, nothing twice
        m = fleet.metrics(w)
        assert delta(m, "kvgate_requests_total", tenant=a, route="chat", status="200") == 12
        assert delta(m, "kvgate_requests_total", tenant="-", route="chat", status="401") == 3
        assert delta(m, "kvgate_rejections_total", reason="invalid_api_key") == 3
        assert delta(m, "kvgate_prompt_tokens_total", tenant=a) == 12 * prompt
        assert delta(m, "kvgate_completion_tokens_total", tenant=a) == 12 * words
        assert delta(m, "kvgate_gateway_overhead_seconds_count", route="chat") == 15
        assert delta(m, "kvgate_verifier_checks_total", upstream=UPSTREAM, mode="sampled") == 12
        assert value(m, "kvgate_in_flight_requests") == 0  # idle: the /metrics request is not counted
        assert value(m, "kvgate_pool_tokens", upstream=UPSTREAM) == 4096
        assert [k for k in m if k[0] == "kvgate_requests_created"] == []


def test_a_leak_between_two_workers_tenants_is_caught(fleet: Fleet, mock: MockState) -> None:
    state_dir = fleet.workdir / "state"
    checks = value(fleet.metrics(0), "kvgate_verifier_checks_total", upstream=UPSTREAM, mode="sampled")
    assert fleet.post(0, KEYS["a"], SECRET_TEXT).status_code == 200  # a's prompt enters the index on worker 0
    assert wait_until(
        lambda: value(fleet.metrics(0), "kvgate_verifier_checks_total", upstream=UPSTREAM, mode="sampled") > checks, 10
    )
    mock.text = "Sure. " + SECRET_TEXT  # the engine hands a's text to b, whose request lands on worker 1
    r = fleet.post(1, KEYS["b"], "What is on the schedule today?")
    assert r.status_code == 200  # not strict: the response passes; the incident is recorded
    assert wait_until(lambda: any(i["detector"] == "leak_index" for i in incidents(state_dir)), 10), fleet.log()
    (inc,) = [i for i in incidents(state_dir) if i["detector"] == "leak_index"]
    assert (inc["tenant"], inc["upstream"]) == (tid("b"), UPSTREAM)
    assert inc["evidence"]["source_tenant"] == tid("a")
    assert SECRET_TEXT[:40] not in json.dumps(inc)
    for w in (0, 1):
        assert value(fleet.metrics(w), "kvgate_verifier_incidents_total", detector="leak_index", upstream=UPSTREAM) == 1
    # whether single-source leak-index evidence quarantines is the verifier's policy, not this test's:
    # lift any quarantine so that the next test starts from a clean view
    assert cli_main(["upstream", "--config", str(fleet.config), "clear", UPSTREAM]) in (0, 1)
    long_prompt = "Please summarise: " + "the river runs past the old mill and on to the sea. " * 4
    for w in (0, 1):
        assert wait_until(lambda w=w: fleet.post(w, KEYS["a"], long_prompt).status_code == 200, 5)


def test_a_canary_planted_on_one_worker_quarantines_the_upstream_on_every_worker(fleet: Fleet, mock: MockState) -> None:
    long_prompt = "Please summarise: " + "the river runs past the old mill and on to the sea. " * 4
    assert COUNTER.count_chat([{"role": "user", "content": long_prompt}]) > 16
    for w in (0, 1):
        assert fleet.post(w, KEYS["a"], long_prompt).status_code == 200
    # the honeypot tenant's prompt (with kvgate's canary) is registered by worker 0 ...
    assert fleet.post(0, KEYS["hp"], f"Remember the code {CANARY} for later.").status_code == 200
    time.sleep(0.5)
    # ... and turns up in a response served by worker 1: a confirmed leak, the upstream is quarantined
    mock.text = f"The code is {CANARY}."
    assert fleet.post(1, KEYS["b"], "Any codes for me?").status_code == 200
    state_dir = fleet.workdir / "state"
    assert wait_until(lambda: any(i["detector"] == "canary" for i in incidents(state_dir)), 10), fleet.log()
    (inc,) = [i for i in incidents(state_dir) if i["detector"] == "canary"]
    assert (inc["tenant"], inc["confirmed"], inc["evidence"]["source_tenants"]) == (tid("b"), True, [tid("hp")])
    mock.text = "Hello from the mock."

    def refused(w: int) -> bool:
        r = fleet.post(w, KEYS["a"], long_prompt)
        return r.status_code == 503 and r.json()["error"]["code"] == "upstream_unavailable"

    for w in (0, 1):  # the quarantine view is shared: both workers refuse long prompts ...
        assert wait_until(lambda w=w: refused(w), 5), fleet.log()
        assert fleet.post(w, KEYS["a"], "short").status_code == 200  # ... and still serve short ones
    assert value(fleet.metrics(0), "kvgate_verifier_quarantines_total", upstream=UPSTREAM) == 1
    # an operator's clear reaches every worker too
    assert cli_main(["upstream", "--config", str(fleet.config), "clear", UPSTREAM]) == 0
    for w in (0, 1):
        assert wait_until(lambda w=w: fleet.post(w, KEYS["a"], long_prompt).status_code == 200, 5)


def test_tenant_edits_and_sighup_reach_every_worker(fleet: Fleet, mock: MockState) -> None:
    for w in (0, 1):
        assert fleet.post(w, KEYS["late"]).status_code == 401
    data = yaml.safe_load(fleet.tenants_path.read_text())
    data["tenants"].append(_tenant("late", rpm=2))
    fleet.tenants_path.write_text(yaml.safe_dump(data))
    fleet.proc.send_signal(signal.SIGHUP)  # passed on to each worker; the supervisor stays up
    for w in (0, 1):
        assert wait_until(lambda w=w: fleet.post(w, KEYS["late"]).status_code != 401, 5)
    assert fleet.proc.poll() is None
    # rpm 2 for the whole gateway: the two workers share one Redis window (2 were admitted above)
    r = fleet.post(0, KEYS["late"])
    assert (r.status_code, r.json()["error"]["code"]) == (429, "rate_limit_exceeded")
    r = fleet.post(1, KEYS["late"])
    assert (r.status_code, r.headers["x-ratelimit-limit-requests"]) == (429, "2")


def test_a_dead_worker_is_replaced_and_its_counts_stay(fleet: Fleet, mock: MockState) -> None:
    before = value(fleet.metrics(0), "kvgate_requests_total", tenant=tid("a"), route="chat", status="200")
    for _ in range(3):
        assert fleet.post(1, KEYS["a"]).status_code == 200

    def served() -> float:
        return value(fleet.metrics(0), "kvgate_requests_total", tenant=tid("a"), route="chat", status="200")

    # a request is counted once its quota settle is done, just after its last byte: wait for that
    assert wait_until(lambda: served() == before + 3, 5)
    workers = _children(fleet.proc.pid)
    assert len(workers) == 2
    fleet._pinned.pop(1).close()
    victim = None
    for pid in workers:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if cmd[cmd.index(b"--worker-index") + 1] == b"1":
            victim = pid
    assert victim is not None
    os.kill(victim, signal.SIGKILL)
    assert wait_until(lambda: victim not in _children(fleet.proc.pid) and len(_children(fleet.proc.pid)) == 2, 15)
    fleet.wait_ready()
    for w in (0, 1):  # the killed worker's 3 requests are still counted; the new worker adds to them
        assert value(fleet.metrics(w), "kvgate_requests_total", tenant=tid("a"), route="chat", status="200") == (
            before + 3
        )
    assert fleet.post(1, KEYS["a"]).status_code == 200
    assert wait_until(lambda: served() == before + 4, 5)
    time.sleep(0.2)
    assert served() == before + 4
    assert "worker 1" in fleet.log() and "starting it again" in fleet.log()


def test_sigterm_drains_every_worker(fleet: Fleet, mock: MockState) -> None:
    """Last in this module: it stops the fleet."""
    chunks = [b'data: {"choices":[{"index":0,"delta":{"content":"w%d "}}]}\n\n' % i for i in range(4)]
    mock.stream_chunks = chunks + [b"data: [DONE]\n\n"]
    mock.chunk_interval_seconds = 0.4
    results: dict[int, dict[str, Any]] = {0: {}, 1: {}}
    started = {0: threading.Event(), 1: threading.Event()}
    clients = {w: fleet.on(w) for w in (0, 1)}
    others = {w: httpx.Client(base_url=fleet.url, timeout=10) for w in (0, 1)}
    for w in (0, 1):  # a second connection per worker, for the requests sent while draining
        fleet._pinned.pop(w)
        others[w] = fleet.on(w)
        fleet._pinned[w] = clients[w]

    def stream(w: int) -> None:
        with clients[w].stream(
            "POST",
            "/v1/chat/completions",
            headers={"authorization": f"Bearer {KEYS['a']}"},
            json={"model": MODEL, "messages": [{"role": "user", "content": "stream"}], "stream": True},
        ) as r:
            results[w]["status"] = r.status_code
            body = b""
            for piece in r.iter_raw():
                body += piece
                started[w].set()
            results[w]["body"] = body

    threads = [threading.Thread(target=stream, args=(w,)) for w in (0, 1)]
    for t in threads:
        t.start()
    assert started[0].wait(10) and started[1].wait(10)
    pids = _children(fleet.proc.pid)
    fleet.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    for w in (0, 1):  # each worker drains: new requests get 503 server_shutting_down
        r = others[w].post(
            "/v1/chat/completions",
            headers={"authorization": f"Bearer {KEYS['a']}"},
            json={"model": MODEL, "messages": [{"role": "user", "content": "late"}]},
        )
        assert (r.status_code, r.json()["error"]["code"]) == (503, "server_shutting_down")
    for t in threads:
        t.join(15)
    for w in (0, 1):  # ... while the streams in flight run to their end, byte for byte
        assert results[w] == {"status": 200, "body": b"".join(chunks) + b"data: [DONE]\n\n"}
    assert fleet.proc.wait(20) == 0
    assert not any(_alive(p) for p in pids)
    for c in others.values():
        c.close()


# ---------------------------------------------------------------- the supervisor
def test_workers_die_with_a_killed_supervisor(module_engine: MockEngine, tmp_path: Path) -> None:
    # no Redis needed: quotas and the verifier are off, so nothing must be shared
    s = _settings(module_engine, tmp_path / "state", redis_url=None)
    s["quotas"]["enabled"] = False
    s["verifier"]["enabled"] = False
    f = Fleet(tmp_path, s, [_tenant("a")])
    try:
        f.wait_ready()
        pids = _children(f.proc.pid)
        assert len(pids) == 2
        f.proc.kill()
        f.proc.wait(5)
        assert wait_until(lambda: not any(_alive(p) for p in pids), 10)

        def refused() -> bool:
            # a worker whose main thread has exited can hold the socket until its last thread
            # ends: a connection then is accepted and reset, so poll until connecting is refused
            try:
                httpx.get(f.url + "/healthz", timeout=2)
            except httpx.ConnectError:
                return True
            except httpx.HTTPError:
                return False
            return False

        assert wait_until(refused, 10, interval=0.2)
    finally:
        f.stop()


def test_a_worker_that_cannot_start_stops_the_gateway(module_engine: MockEngine, tmp_path: Path) -> None:
    s = _settings(module_engine, tmp_path / "state", redis_url=None)
    s["quotas"]["enabled"] = False
    s["verifier"]["enabled"] = False
    # valid settings, and a tokenizer.json (so the start's own check passes) that is no tokenizer:
    # each worker fails while building its app
    broken = tmp_path / "broken-tokenizer"
    broken.mkdir()
    (broken / "tokenizer.json").write_text("not a tokenizer")
    s["models"][0]["tokenizer"] = {"kind": "hf", "path": str(broken)}
    f = Fleet(tmp_path, s, [_tenant("a")])
    try:
        rc = f.proc.wait(60)
    finally:
        f.stop()
    assert rc == 1
    assert "within" in f.log() and "stopping the gateway" in f.log()
    assert not _children(f.proc.pid)


def test_more_than_one_worker_without_redis_is_refused(module_engine: MockEngine, tmp_path: Path, capsys) -> None:
    cfg = tmp_path / "kvgate.yaml"
    cfg.write_text(yaml.safe_dump(_settings(module_engine, tmp_path / "state", redis_url=None)))
    ten = tmp_path / "tenants.yaml"
    ten.write_text(yaml.safe_dump({"tenants": [_tenant("a")]}))
    args = ["serve", "--config", str(cfg), "--tenants", str(ten), "--port", str(free_port())]
    assert cli_main(args + ["--workers", "2"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "kvgate serve: 2 workers need redis_url: quotas and verifier would otherwise be kept apart in each "
        "worker (quotas admitted N times, leaks between workers' tenants missed). Set redis_url, or run "
        "--workers 1.\n"
    )
    assert cli_main(args + ["--workers", "0"]) == 2
    assert capsys.readouterr().err == "kvgate serve: workers must be from 1 to 256, not 0\n"
    # above gateway.workers' own bound: a pydantic traceback before
    assert cli_main(args + ["--workers", "100000"]) == 2
    assert capsys.readouterr().err == "kvgate serve: workers must be from 1 to 256, not 100000\n"


@pytest.mark.parametrize(
    ("port", "why"),
    [("99999", "99999 is not a port (0 to 65535; 0 picks a free one)"), ("x", "'x' is not a port number")],
)
def test_a_port_no_socket_can_have_is_refused(port: str, why: str, capsys) -> None:
    """--port 99999 was bound as 34463 by kvgate serve (the kernel takes it modulo 65536) while
    the log said 99999, and was a bind() traceback in kvgate up."""
    for command, flag in (("serve", "--port"), ("up", "--port"), ("up", "--backend-port")):
        with pytest.raises(SystemExit) as e:
            cli_main([command, flag, port])
        assert e.value.code == 2
        assert capsys.readouterr().err.splitlines()[-1] == f"kvgate {command}: error: argument {flag}: {why}"


# ---------------------------------------------------------------- defaults and the quota divisor
def test_default_workers_are_the_usable_cores_with_redis_else_one(monkeypatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 3, 5}, raising=False)
    monkeypatch.setattr(wk, "cgroup_cpu_limit", lambda root="": None)  # whatever this machine's cgroup says
    assert wk.usable_cores() == 3
    assert wk.resolve_workers(None, Settings(redis_url=REDIS_URL)) == 3
    assert wk.resolve_workers(None, Settings()) == 1
    assert wk.resolve_workers(None, Settings(redis_url=REDIS_URL, gateway={"workers": 2})) == 2
    assert wk.resolve_workers(5, Settings(gateway={"workers": 2})) == 5
    assert wk.workers_refusal(1, Settings()) is None
    assert wk.workers_refusal(4, Settings(redis_url=REDIS_URL)) is None
    assert wk.workers_refusal(2, Settings(quotas={"enabled": False}, verifier={"enabled": False})) is None
    assert "quotas and verifier" in wk.workers_refusal(2, Settings())
    assert "verifier would" in wk.workers_refusal(2, Settings(quotas={"enabled": False}))
    for bad in (0, -1, 257):
        with pytest.raises(ValueError):
            Settings(gateway={"workers": bad})


def test_default_workers_honour_the_cgroup_cpu_quota(monkeypatch, tmp_path: Path) -> None:
    """min(affinity, ceil(quota / period)) from fake cgroup files: v2 ``cpu.max``, v1
    ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` (under ``cpu/`` or ``cpu,cpuacct/``); no
    quota (``max``, ``-1``, no files, garbage) leaves the affinity count."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(96)), raising=False)
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cpu.max").write_text("250000 100000\n")
    assert wk.cgroup_cpu_limit(str(v2)) == 2.5
    assert wk.usable_cores(str(v2)) == 3
    (v2 / "cpu.max").write_text("max 100000\n")
    assert wk.usable_cores(str(v2)) == 96
    (v2 / "cpu.max").write_text("50000 100000\n")  # half a CPU: still one worker
    assert wk.usable_cores(str(v2)) == 1
    (v2 / "cpu.max").write_text("lots\n")
    assert wk.usable_cores(str(v2)) == 96
    for sub in ("cpu", "cpu,cpuacct"):
        v1 = tmp_path / f"v1-{sub}" / sub
        v1.mkdir(parents=True)
        (v1 / "cpu.cfs_quota_us").write_text("400000\n")
        (v1 / "cpu.cfs_period_us").write_text("100000\n")
        assert wk.usable_cores(str(v1.parent)) == 4
        (v1 / "cpu.cfs_quota_us").write_text("-1\n")
        assert wk.usable_cores(str(v1.parent)) == 96
    assert wk.usable_cores(str(tmp_path / "none")) == 96
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    (v2 / "cpu.max").write_text("800000 100000\n")  # the quota is above the affinity mask
    assert wk.usable_cores(str(v2)) == 2


def test_reuse_port_is_the_operators_choice_and_its_risk_is_real(module_engine: MockEngine, tmp_path: Path) -> None:
    """``--reuse-port``: each worker binds its own SO_REUSEPORT socket; both serve, and a
    neighbour of the same user can then bind the port too (the documented risk)."""
    code = (
        "import socket\n"
        "s = socket.socket()\n"
        "s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)\n"
        "s.bind(('127.0.0.1', {port})); print('bound')\n"
    )
    f = Fleet(tmp_path, _settings(module_engine, tmp_path / "state"), [_tenant("a")], extra=("--reuse-port",))
    try:
        f.wait_ready()
        assert f.on(0).get("/healthz").status_code == 200 and f.on(1).get("/healthz").status_code == 200
        out = subprocess.run([sys.executable, "-c", code.format(port=f.port)], capture_output=True, text=True)
        assert out.stdout == "bound\n", out.stderr
    finally:
        f.stop()


def test_an_operators_metrics_folder_with_foreign_files_is_refused(module_engine: MockEngine, tmp_path: Path) -> None:
    """``PROMETHEUS_MULTIPROC_DIR`` holding another application's ``important-app.db``: ``kvgate
    serve --workers 2`` refuses to start (exit 2, the message names the file) and deletes nothing;
    a folder of prometheus-client's own files only is emptied and used."""
    metrics = tmp_path / "metrics"
    metrics.mkdir()
    (metrics / "important-app.db").write_bytes(b"precious")
    (metrics / "counter_123.db").write_bytes(b"old")
    cfg = tmp_path / "kvgate.yaml"
    cfg.write_text(yaml.safe_dump(_settings(module_engine, tmp_path / "state")))
    ten = tmp_path / "tenants.yaml"
    ten.write_text(yaml.safe_dump({"tenants": [_tenant("a")]}))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVGATE_", "PROMETHEUS_"))}
    env.update(PYTHONPATH=str(ROOT), PROMETHEUS_MULTIPROC_DIR=str(metrics))
    cmd = [sys.executable, "-m", "gateway.cli", "serve", "--config", str(cfg), "--tenants", str(ten)]
    out = subprocess.run(
        cmd + ["--port", str(free_port()), "--workers", "2"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.endswith(
        f"kvgate serve: PROMETHEUS_MULTIPROC_DIR={metrics} holds files that are not prometheus-client's "
        "(important-app.db); kvgate empties that folder at every start, so it must be empty or kvgate's own. "
        "Unset PROMETHEUS_MULTIPROC_DIR (kvgate then makes a private folder) or point it at an empty folder.\n"
    )
    assert (metrics / "important-app.db").read_bytes() == b"precious"
    assert (metrics / "counter_123.db").read_bytes() == b"old"
    assert wk.metrics_dir_refusal(str(tmp_path / "absent")) is None
    (metrics / "important-app.db").unlink()
    (metrics / "gauge_livesum_77.db").write_bytes(b"")
    assert wk.metrics_dir_refusal(str(metrics)) is None
    (metrics / "gauge_bogus_77.db").write_bytes(b"")  # not a mode prometheus-client writes
    assert "gauge_bogus_77.db" in (wk.metrics_dir_refusal(str(metrics)) or "")


async def test_local_fallback_divides_limits_by_replicas_times_workers() -> None:
    from tests.gateway_harness import refused_port

    down = f"redis://127.0.0.1:{refused_port()}/0"  # a port where nothing listens: Redis refused
    settings = Settings(
        redis_url=down,
        gateway={"workers": 2},
        quotas={"replicas": 3, "redis_failure_policy": "local_fallback"},
    )
    stage = build_quota_stage(settings, key_prefix=f"kvgate-test-w-{RUN}")
    assert isinstance(stage, TenantQuotas) and stage.processes == 6
    from config.errors import OpenAIError
    from config.models import TenantConfig

    t = TenantConfig(id=f"t-{RUN}", rpm=13)
    leases = [await stage.reserve(t, 1, f"r{i}") for i in range(2)]  # 13 // 6 = 2 in this process
    assert leases[1].headers == {"x-ratelimit-limit-requests": "2", "x-ratelimit-remaining-requests": "0"}
    with pytest.raises(OpenAIError) as e:
        await stage.reserve(t, 1, "r3")
    assert e.value.status == 429 and "Limit 2, Used 2" in e.value.message
    await stage.aclose()


def test_a_workers_empty_metrics_file_does_not_fail_the_scrape(tmp_path: Path) -> None:
    """A worker's metrics file exists at 0 bytes for a moment after the worker creates it (for
    good when it was killed then): prometheus-client's own collector raises on it, failing the
    whole scrape (a 500 on ``/metrics``); the gateway's renders every other worker's values."""
    code = """
import sys
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
from gateway.ops.metrics import GatewayMetrics
m = GatewayMetrics()
m.requests.labels("a", "chat", "200").inc(3)
open(sys.argv[1] + "/counter_4194304.db", "wb").close()  # a pid's file, created, not yet sized
stock = CollectorRegistry()
MultiProcessCollector(stock, path=sys.argv[1])
try:
    generate_latest(stock)
    print("stock: ok")
except Exception as e:
    print("stock:", type(e).__module__, type(e).__name__)
sys.stdout.write(m.render().decode())
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    first, rendered = out.stdout.split("\n", 1)
    assert first == "stock: struct error"  # unpack_from on the empty file
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(rendered)
        for s in fam.samples
    }
    assert samples[("kvgate_requests_total", (("route", "chat"), ("status", "200"), ("tenant", "a")))] == 3.0
