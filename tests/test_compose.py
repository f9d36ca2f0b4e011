"""docker-compose.yml proven without a Docker engine (none runs here).

1. The file validates against the Compose schema (`docker-compose config`, Debian's package, which
   scripts/test.sh installs when missing).
2. Every service of the default (CPU) profile is started from the file itself: its image's ENTRYPOINT
   (read from its Dockerfile) + its `command`, with its `environment`, as local processes on loopback
   (service host names and 0.0.0.0 mapped to 127.0.0.1, ports as in the file, Redis the real server);
   each health check (its own CMD, run here) must pass; then a chat request through the gateway gets a
   200 below the limit and a 400 `context_length_exceeded` one token over it.
3. Because (2) maps every host to one loopback, where a node's 127.0.0.1 default happens to reach its
   peer, every URL a service dials is also checked by name: it must be given, and name a compose
   service (or network alias) and the port that service listens on. scripts/compose-e2e.sh runs the
   stack under a real Docker engine.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from config.models import BackendSettings
from gpu_backend.cli import build_parser
from tests.conftest import ROOT

COMPOSE = ROOT / "docker-compose.yml"
VENV_BIN = Path(sys.executable).parent
DEMO_KEY = "sk-demo-a"
#: The URL flags each backend role dials (gpu_backend/cli.py): the router reaches prefill and decode,
#: a prefill node sends its pages to decode; a decode node dials no one.
ROLE_URL_FLAGS = {"router": ("--prefill-url", "--decode-url"), "prefill": ("--decode-url",), "decode": ()}
URL = re.compile(r"\b([a-z][a-z0-9+.-]*)://([^/:\"'\s,\]]+)(?::(\d+))?")
TEST_REDIS_DB = 11


def _compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def _entrypoint(service: dict) -> list[str]:
    dockerfile = ROOT / service["build"]["dockerfile"]
    m = re.search(r"^ENTRYPOINT\s+(\[.*\])\s*$", dockerfile.read_text(), re.M)
    assert m, f"{dockerfile} has no exec-form ENTRYPOINT"
    return yaml.safe_load(m.group(1))


def _active(services: dict, profile: str) -> list[str]:
    return [n for n, s in services.items() if not s.get("profiles") or profile in s["profiles"]]


def _map_hosts(value: str, names: list[str]) -> str:
    value = value.replace("0.0.0.0", "127.0.0.1")
    for n in names:
        value = re.sub(rf"(?<=//){re.escape(n)}(?=[:/])", "127.0.0.1", value)
    value = value.replace("/app/config/", f"{ROOT / 'config'}/")
    value = value.replace("redis://127.0.0.1:6379/0", f"redis://127.0.0.1:6379/{TEST_REDIS_DB}")
    return value


def _order(services: dict, active: list[str]) -> list[str]:
    done: list[str] = []
    while len(done) < len(active):
        for n in active:
            deps = [d for d in services[n].get("depends_on", {}) if d in active]
            if n not in done and all(d in done for d in deps):
                done.append(n)
    return done


def _health_ok(test: list[str], names: list[str]) -> bool:
    assert test[0] == "CMD", "health checks use the exec form"
    argv = [_map_hosts(a, names) for a in test[1:]]
    if argv[0] == "python":
        argv[0] = sys.executable
    return subprocess.run(argv, capture_output=True, timeout=10).returncode == 0


def _merged(files: tuple[str, ...]) -> dict:
    exe = shutil.which("docker-compose")
    assert exe, "docker-compose (Debian's package) is missing: scripts/test.sh installs it"
    args = [a for f in files for a in ("-f", f)]
    out = subprocess.run([exe, *args, "config"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    return yaml.safe_load(out.stdout)["services"]


def _listen_port(service: dict) -> int | None:
    cmd = [str(a) for a in service.get("command") or []]
    if "--port" in cmd:
        return int(cmd[cmd.index("--port") + 1])
    return None


def _dialed_urls(service: dict) -> list[str]:
    """Every URL in a service's command and environment, plus the backend URL flags its role dials
    that it leaves to their defaults (health checks are left out: they dial the container itself)."""
    cmd = [str(a) for a in service.get("command") or []]
    env = [str(v) for v in (service.get("environment") or {}).values()]
    urls = [m.group(0) for text in cmd + env for m in URL.finditer(text)]
    if "--role" in cmd:
        defaults = vars(build_parser(BackendSettings()).parse_args([]))
        for flag in ROLE_URL_FLAGS[cmd[cmd.index("--role") + 1]]:
            if flag not in cmd:
                urls.append(str(defaults[flag[2:].replace("-", "_")]))
    return urls


@pytest.mark.parametrize("files", [("docker-compose.yml",), ("docker-compose.yml", "docker-compose.smollm2.yml")])
def test_every_dialed_url_names_a_compose_service(files: tuple[str, ...]) -> None:
    services = _merged(files)
    hosts: dict[str, str] = {n: n for n in services}
    for n, s in services.items():
        for net in (s.get("networks") or {}).values():
            hosts.update({alias: n for alias in (net or {}).get("aliases", [])})
    dialed = {n: _dialed_urls(s) for n, s in services.items()}
    assert dialed["prefill"] == ["http://decode:30002"]
    assert dialed["router"] == ["http://prefill:30001", "http://decode:30002"]
    for name, urls in dialed.items():
        for url in urls:
            m = URL.match(url)
            assert m, (name, url)
            scheme, host, port = m.groups()
            assert host in hosts, f"{name} dials {url}: not a compose service (inside a container it is itself)"
            want = 6379 if scheme == "redis" else _listen_port(services[hosts[host]])
            assert port is not None and int(port) == want, f"{name} dials {url}; {hosts[host]} listens on {want}"


def test_compose_file_validates() -> None:
    exe = shutil.which("docker-compose")
    assert exe, "docker-compose (Debian's package) is missing: scripts/test.sh installs it"
    out = subprocess.run([exe, "-f", str(COMPOSE), "config", "-q"], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    services = _compose()["services"]
    assert set(services) >= {"redis", "prefill", "decode", "router", "gateway"}
    published = {n for n, s in services.items() if s.get("ports")}
    assert published == {"gateway", "gateway-demo"}
    # the host side is loopback unless KVGATE_PUBLISH_HOST says otherwise
    assert services["gateway"]["ports"] == ["${KVGATE_PUBLISH_HOST:-127.0.0.1}:${KVGATE_PUBLISH_PORT:-8080}:8080"]
    assert services["gateway-demo"]["ports"] == ["${KVGATE_PUBLISH_HOST:-127.0.0.1}:8081:8080"]
    resolved = subprocess.run([exe, "-f", str(COMPOSE), "config"], capture_output=True, text=True, cwd=ROOT)
    assert resolved.returncode == 0, resolved.stderr
    ports = yaml.safe_load(resolved.stdout)["services"]["gateway"]["ports"]
    assert all(
        str(p.get("host_ip", "")) == "127.0.0.1" if isinstance(p, dict) else p.startswith("127.0.0.1:") for p in ports
    ), ports
    # only the demo profile's gateway accepts the documented demo keys
    assert "--demo" not in services["gateway"]["command"] and "--init-tenant" in services["gateway"]["command"]
    assert "--demo" in services["gateway-demo"]["command"] and services["gateway-demo"]["profiles"] == ["demo"]
    for n in ("prefill-gpu", "decode-gpu"):
        devices = services[n]["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["capabilities"] == ["gpu"] and services[n]["profiles"] == ["gpu"]
    for n, s in services.items():
        assert "healthcheck" in s, f"service {n} has no health check"


@pytest.mark.timeout(300)
def test_compose_services_run_as_local_processes(tmp_path: Path) -> None:
    compose = _compose()
    services = compose["services"]
    profile = dict(line.split("=", 1) for line in (ROOT / ".env").read_text().split())["COMPOSE_PROFILES"]
    active = _active(services, profile)
    names = list(services)
    procs: list[subprocess.Popen] = []
    try:
        for name in _order(services, active):
            svc = services[name]
            if name == "redis":  # the real server scripts/test.sh keeps on 127.0.0.1:6379
                assert _health_ok(["CMD", "redis-cli", "-p", "6379", "ping"], names)
                continue
            argv = [_map_hosts(a, names) for a in _entrypoint(svc) + list(svc.get("command", []))]
            argv[0] = str(VENV_BIN / argv[0])
            env = {**os.environ, **{k: _map_hosts(str(v), names) for k, v in (svc.get("environment") or {}).items()}}
            if "KVGATE_STATE_DIR" in env:
                state = env["KVGATE_STATE_DIR"]
                env["KVGATE_STATE_DIR"] = str(tmp_path / f"{name}-state")
                for k, v in list(env.items()):  # paths inside the state volume, e.g. KVGATE_TENANTS
                    if k != "KVGATE_STATE_DIR" and v.startswith(state + "/"):
                        env[k] = env["KVGATE_STATE_DIR"] + v[len(state) :]
            log = open(tmp_path / f"{name}.log", "wb")
            procs.append(
                subprocess.Popen(
                    argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path, start_new_session=True
                )
            )
            hc = svc["healthcheck"]
            deadline = time.monotonic() + 180
            while not _health_ok(hc["test"], names):
                assert procs[-1].poll() is None, (name, (tmp_path / f"{name}.log").read_text()[-3000:])
                assert time.monotonic() < deadline, f"{name} never became healthy"
                time.sleep(0.5)

        base = "http://127.0.0.1:8080/v1"
        # the gateway generated its first tenant's key into its state volume (no documented key works)
        key_file = tmp_path / "gateway-state" / "default.key"
        assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
        key = key_file.read_text().strip()
        assert key.startswith("sk-kvg-") and len(key) == 7 + 43
        assert key not in (tmp_path / "gateway-state" / "tenants.yaml").read_text()  # only its hash is stored
        assert httpx.get(base + "/models", headers={"Authorization": f"Bearer {DEMO_KEY}"}).status_code == 401
        headers = {"Authorization": f"Bearer {key}"}
        with httpx.Client(base_url=base, headers=headers, timeout=120) as c:
            models = c.get("/models").json()["data"]
            model = models[0]["id"]
            limit = models[0]["max_model_len"]
            ok = c.post(
                "/chat/completions",
                json={"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "Say hello."}]},
            )
            assert ok.status_code == 200, ok.text
            prompt_tokens = ok.json()["usage"]["prompt_tokens"]
            # one token over: a prompt of `prompt_tokens` asking for exactly the rest + 1
            over = c.post(
                "/chat/completions",
                json={
                    "model": model,
                    "max_tokens": limit - prompt_tokens + 1,
                    "messages": [{"role": "user", "content": "Say hello."}],
                },
            )
            assert over.status_code == 400, over.text
            err = over.json()["error"]
            assert err["code"] == "context_length_exceeded"
            assert err["message"] == (
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{limit + 1} tokens ({prompt_tokens} in the messages, {limit - prompt_tokens + 1} in the "
                f"completion). Please reduce the length of the messages or completion."
            )
    finally:
        for p in reversed(procs):
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for p in procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
