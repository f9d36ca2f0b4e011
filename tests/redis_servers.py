"""Real Redis deployments on loopback for the store-mode tests: a 3-master, 3-replica Redis
Cluster, a Sentinel group (1 master, 1 replica, 3 sentinels) and a TLS server with a self-signed
CA, each in a temp dir on free ports, plus a fleet of ``kvgate serve --workers N`` replicas in
front of the mock engine.

Failure detection is tuned for tests: cluster nodes time out after 1 s (``cluster-node-timeout``;
the default is 15 s) and sentinels call a master down after 0.5 s; ``cluster-require-full-coverage
no`` keeps the slots of live masters serving while one master fails over (docs/quotas.md).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import redis
import yaml
from quota_fixtures import _wait_ping, free_port

from tests.conftest import ROOT
from tests.fixtures.replicas import wait_until

REDIS_SERVER = shutil.which("redis-server") or "redis-server"
REDIS_CLI = shutil.which("redis-cli") or "redis-cli"
CLUSTER_NODE_TIMEOUT_MS = 1000
SENTINEL_DOWN_AFTER_MS = 500


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports on 127.0.0.1 that were free a moment ago (all held open while they
    are picked: ``free_port`` called n times may return one twice)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _server(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen([REDIS_SERVER, *args], stdout=out, stderr=subprocess.STDOUT)


def _kill(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is not None and proc.poll() is None:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
        proc.wait(10)


class LocalCluster:
    """Six ``redis-server --cluster-enabled yes`` nodes joined by ``redis-cli --cluster create
    --cluster-replicas 1``: three masters, each with one replica."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        ports = free_ports(12)
        self.ports = ports[:6]
        self.bus_ports = ports[6:]  # else port + 10000, which may be taken or > 65535
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports[:3])

    def start(self) -> None:
        self.launch()
        self.form()

    def launch(self) -> None:
        """Start the six nodes (not yet a cluster)."""
        for p, bus in zip(self.ports, self.bus_ports, strict=True):
            d = self.workdir / f"node-{p}"
            d.mkdir()
            self.procs[p] = _server(
                [
                    "--port",
                    str(p),
                    "--cluster-port",
                    str(bus),
                    "--bind",
                    "127.0.0.1",
                    "--dir",
                    str(d),
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                ]
                + ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
                + ["--cluster-node-timeout", str(CLUSTER_NODE_TIMEOUT_MS), "--cluster-require-full-coverage", "no"],
                d / "redis.log",
            )

    def form(self) -> None:
        """Join the launched nodes into a cluster and wait until it is healthy."""
        for p in self.ports:
            _wait_ping(p)
        subprocess.run(
            [REDIS_CLI, "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports)]
            + ["--cluster-replicas", "1", "--cluster-yes"],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            timeout=60,
        )
        if not wait_until(self.healthy, 30, 0.1):
            raise RuntimeError("cluster not healthy in 30 s")

    def _node(self, port: int) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=port, socket_timeout=1)

    def healthy(self) -> bool:
        """Every live node says ``cluster_state:ok`` and every master has an online replica."""
        try:
            for p in self.live_ports():
                with self._node(p) as r:
                    if r.cluster("info").get("cluster_state") != "ok":
                        return False
                    info = r.info("replication")
                    if info["role"] == "master" and not any(
                        isinstance(v, dict) and v.get("state") == "online"
                        for k, v in info.items()
                        if k.startswith("slave")
                    ):
                        return False
            return True
        except (redis.RedisError, OSError):
            return False

    def live_ports(self) -> list[int]:
        return [p for p, proc in self.procs.items() if proc.poll() is None]

    def master_of(self, key: str) -> int:
        """The port of the live master that owns ``key``'s slot now."""
        from config.redis_client import key_slot

        slot = key_slot(key)
        for p in self.live_ports():
            try:
                with self._node(p) as r:
                    for start, end, master, *_ in r.execute_command("CLUSTER", "SLOTS"):
                        if start <= slot <= end:
                            port = int(master[1])
                            if port in self.live_ports():
                                return port
            except (redis.RedisError, OSError):
                continue
        raise LookupError(f"no live master owns slot {slot}")

    def kill(self, port: int) -> None:
        _kill(self.procs[port])

    def client(self) -> redis.RedisCluster:
        return redis.RedisCluster(host="127.0.0.1", port=self.live_ports()[0], socket_timeout=2)

    def close(self) -> None:
        for proc in self.procs.values():
            _kill(proc)


class SentinelGroup:
    """A master, one replica of it and three sentinels (quorum 2) watching ``service``."""

    service = "kvgate"

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.master_port, self.replica_port, *self.sentinel_ports = free_ports(5)
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    @property
    def url(self) -> str:
        return "redis+sentinel://" + ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports) + f"/{self.service}/0"

    def start(self) -> None:
        base = ["--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(self.workdir)]
        self.procs[self.master_port] = _server(["--port", str(self.master_port), *base], self.workdir / "master.log")
        _wait_ping(self.master_port)
        self.procs[self.replica_port] = _server(
            ["--port", str(self.replica_port), "--replicaof", "127.0.0.1", str(self.master_port), *base],
            self.workdir / "replica.log",
        )
        _wait_ping(self.replica_port)
        for p in self.sentinel_ports:
            conf = self.workdir / f"sentinel-{p}.conf"
            conf.write_text(
                f"port {p}\nbind 127.0.0.1\ndir {self.workdir}\n"
                f"sentinel monitor {self.service} 127.0.0.1 {self.master_port} 2\n"
                f"sentinel down-after-milliseconds {self.service} {SENTINEL_DOWN_AFTER_MS}\n"
                f"sentinel failover-timeout {self.service} 5000\n"
            )
            self.procs[p] = _server([str(conf), "--sentinel"], self.workdir / f"sentinel-{p}.log")
            _wait_ping(p)
        if not wait_until(self.healthy, 30, 0.1):
            raise RuntimeError("sentinel group not healthy in 30 s")

    def healthy(self) -> bool:
        """The replica is in sync and every sentinel knows the replica and the other sentinels."""
        try:
            with redis.Redis(port=self.master_port, socket_timeout=1) as r:
                if r.info("replication").get("slave0", {}).get("state") != "online":
                    return False
            for p in self.sentinel_ports:
                with redis.Redis(port=p, socket_timeout=1) as s:
                    m = s.sentinel_master(self.service)
                    if int(m["num-slaves"]) < 1 or int(m["num-other-sentinels"]) < 2:
                        return False
            return True
        except (redis.RedisError, OSError, KeyError):
            return False

    def master(self) -> int:
        """The master's port as the first sentinel names it."""
        with redis.Redis(port=self.sentinel_ports[0], socket_timeout=1) as s:
            return int(s.sentinel_get_master_addr_by_name(self.service)[1])

    def kill(self, port: int) -> None:
        _kill(self.procs[port])

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.master(), socket_timeout=2)

    def close(self) -> None:
        for proc in self.procs.values():
            _kill(proc)


class NoTls(Exception):
    """This redis-server was built without TLS (``BUILD_TLS=no``)."""


def no_tls_reason(log: Path) -> str | None:
    """Why a redis-server that was given TLS options exited, read from its ``log``, when it was
    built without TLS: it stops at the first ``tls-*`` option with "Bad directive or wrong number
    of arguments", the directive on the line above. ``None`` for any other log."""
    text = log.read_text(errors="replace") if log.exists() else ""
    if "bad directive" not in text.lower():
        return None
    named = [ln.strip() for ln in text.splitlines() if "tls" in ln.lower()]
    return f"{REDIS_SERVER} lacks TLS support: {named[0]}: Bad directive" if named else None


def started_tls(make: Callable[[], Any]) -> Any:
    """A module fixture's body for servers with TLS: ``make()`` builds them (an object with
    ``start`` and ``close``), started and yielded, closed afterwards even when starting failed;
    skipped, saying why, without ``openssl`` or when this redis-server knows no TLS (:class:`NoTls`)."""
    import pytest

    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed (the test's certificates are made with it)")
    servers = make()
    try:
        try:
            servers.start()
        except NoTls as e:
            pytest.skip(str(e))
        yield servers
    finally:
        servers.close()


def other_ca(d: Path) -> Path:
    """A self-signed CA (``d/other.pem``) that signed nothing a test server serves."""
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=another CA"]
        + ["-keyout", str(d / "other.key"), "-out", str(d / "other.pem")],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return d / "other.pem"


class TlsRedis:
    """A ``redis-server --tls-port`` (plain port off) with a certificate for 127.0.0.1 signed by
    a self-signed CA made here with ``openssl``; ``ca`` is the CA's PEM file."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.ca = workdir / "ca.pem"
        self.proc: subprocess.Popen[bytes] | None = None

    def _certs(self) -> None:
        d = self.workdir
        ssl = shutil.which("openssl") or "openssl"

        def run(*args: str) -> None:
            subprocess.run([ssl, *args], check=True, cwd=d, capture_output=True, timeout=60)

        run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=kvgate test CA",
            "-keyout", "ca.key", "-out", "ca.pem")  # fmt: skip
        (d / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
        run("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1", "-keyout", "server.key",
            "-out", "server.csr")  # fmt: skip
        run("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-days", "2", "-extfile", "ext.cnf", "-out", "server.pem")  # fmt: skip

    def start(self) -> None:
        self._certs()
        d = self.workdir
        self.proc = _server(
            ["--port", "0", "--tls-port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
            + ["--dir", str(d), "--tls-cert-file", str(d / "server.pem"), "--tls-key-file", str(d / "server.key")]
            + ["--tls-ca-cert-file", str(d / "ca.pem"), "--tls-auth-clients", "no"],
            d / "redis.log",
        )

        def up() -> bool:
            try:
                with redis.Redis(
                    host="127.0.0.1", port=self.port, ssl=True, ssl_ca_certs=str(self.ca), socket_timeout=1
                ) as r:
                    return bool(r.ping())
            except (redis.RedisError, OSError):
                return False

        if not wait_until(lambda: up() or self.proc.poll() is not None, 15, 0.1) or self.proc.poll() is not None:
            why = no_tls_reason(d / "redis.log")
            if why:
                raise NoTls(why)
            raise RuntimeError("TLS redis did not answer in 15 s")

    def close(self) -> None:
        _kill(self.proc)


# ---------------------------------------------------------------------- gateway replicas
class Gateway:
    """One ``kvgate serve --workers N`` process on a free port."""

    def __init__(self, config: Path, tenants: Path, log_path: Path, workers: int) -> None:
        self.workers = workers
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        env = {k: v for k, v in os.environ.items() if not k.startswith(("KVGATE_", "PROMETHEUS_"))}
        env["PYTHONPATH"] = str(ROOT)
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "gateway.cli", "serve", "--config", str(config), "--tenants", str(tenants)]
                + ["--port", str(self.port), "--workers", str(workers), "--log-level", "warning"],
                cwd=ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    def wait_ready(self, timeout: float = 90.0) -> None:
        """Until every worker has answered ``/readyz`` 200."""
        deadline = time.monotonic() + timeout
        seen: set[str] = set()
        while len(seen) < self.workers:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvgate serve exited {self.proc.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"workers {seen} of {self.workers} ready after {timeout}s:\n{self.log()}")
            try:
                with httpx.Client(base_url=self.url, timeout=2) as c:
                    r = c.get("/readyz")
                    if r.status_code == 200:  # the same keep-alive connection: the same worker
                        seen.add(c.get("/healthz").headers["x-kvgate-worker"])
            except httpx.HTTPError:
                time.sleep(0.1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def tenant_entry(tenant_id: str, key: str, model: str, **limits: Any) -> dict[str, Any]:
    return {
        "id": tenant_id,
        "api_key_sha256": [hashlib.sha256(key.encode()).hexdigest()],
        "allowed_models": [model],
        "max_tokens_cap": 512,
        "default_max_tokens": 4,
        **limits,
    }


def gateway_settings(
    engine: Any, state_dir: Path, redis_url: str, model: str, upstream: str, **quotas: Any
) -> dict[str, Any]:
    """A gateway config: quotas and the verifier in ``redis_url``, one mock upstream."""
    return {
        "gateway": {"host": "127.0.0.1", "read_timeout_seconds": 30, "drain_timeout_seconds": 2},
        "pool": {"poll_interval_seconds": 1, "max_staleness_seconds": 30},
        "quotas": {"enabled": True, "window_seconds": 60, **quotas},
        "redis_url": redis_url,
        "verifier": {"enabled": True, "usage_drift_tolerance_tokens": 100_000, "quarantine_min_prompt_tokens": 16},
        "state_dir": str(state_dir),
        "models": [{"id": model, "context_length": 8192, "tokenizer": {"kind": "bundled"}}],
        "upstreams": [
            {
                "name": upstream,
                "api_url": engine.api_url,
                "pool_source": "sglang",
                "pool_urls": [engine.info_url],
                "models": [model],
            }
        ],
    }


def start_gateways(
    workdir: Path,
    settings: dict[str, Any],
    tenants: list[dict[str, Any]],
    replicas: int = 3,
    workers: int = 2,
    while_starting: Callable[[], None] | None = None,
) -> list[Gateway]:
    """``replicas`` gateways sharing one config, tenants file and state dir (so one leak-index
    key: the secrets are made before any starts). ``while_starting``: called once they are
    spawned, before waiting for them (a Redis deployment that forms meanwhile: they start
    without one). Raises ``RuntimeError`` if one does not start."""
    from config.secrets import load_secrets

    config, tenants_path = workdir / "kvgate.yaml", workdir / "tenants.yaml"
    config.write_text(yaml.safe_dump(settings))
    tenants_path.write_text(yaml.safe_dump({"tenants": tenants}))
    load_secrets(settings["state_dir"])
    gws = [Gateway(config, tenants_path, workdir / f"gateway-{i}.log", workers) for i in range(replicas)]
    try:
        if while_starting is not None:
            while_starting()
        for g in gws:
            g.wait_ready()
    except BaseException:
        for g in gws:
            g.stop()
        raise
    return gws
