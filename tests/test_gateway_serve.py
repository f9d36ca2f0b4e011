"""``kvgate serve`` as a real process: it refuses the documented demo keys without ``--demo``,
SIGHUP re-reads the tenants file, and SIGTERM drains (requests in flight finish, new ones get 503, then it exits 0)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
import yaml

from gateway.cli import main
from tests.backend_procs import free_port
from tests.conftest import ROOT
from tests.gateway_harness import KEY_A, MODEL, chat, wait_for
from tests.mock_engine import MockEngine

DEFAULT_TENANTS = ROOT / "config" / "tenants.yaml"


def test_serve_refuses_demo_keys_without_demo(capsys):
    assert main(["serve", "--tenants", str(DEFAULT_TENANTS), "--port", "1"]) == 2
    err = capsys.readouterr().err
    assert "demo-a, demo-b accept a documented demo key" in err
    assert "sk-demo-a" in err  # the documented key's name, never a secret


@pytest.mark.timeout(60)
def test_sigterm_drains_in_flight_and_refuses_new(tmp_path):
    engine = MockEngine().start()
    chunks = [b'data: {"choices":[{"index":0,"delta":{"content":"w%d "}}]}\n\n' % i for i in range(4)]
    engine.state.stream_chunks = chunks + [b"data: [DONE]\n\n"]
    engine.state.chunk_interval_seconds = 0.4
    from gateway.ops.tenants import hash_key

    cfg = tmp_path / "kvgate.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "gateway": {"drain_timeout_seconds": 10},
                "pool": {"poll_interval_seconds": 1},
                "quotas": {"enabled": False},
                "verifier": {"enabled": False},
                "state_dir": str(tmp_path / "state"),
                "models": [{"id": MODEL, "context_length": 8192}],
                "upstreams": [
                    {
                        "name": "u1",
                        "api_url": engine.api_url,
                        "pool_source": "sglang",
                        "pool_urls": [engine.info_url],
                        "models": [MODEL],
                    }
                ],
            }
        )
    )
    ten = tmp_path / "tenants.yaml"
    ten.write_text(yaml.safe_dump({"tenants": [{"id": "t1", "api_key_sha256": [hash_key(KEY_A)]}]}))
    port = str(free_port())  # for the gateway to bind
    url = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}
    env["KVGATE_SECRET_CACHE_SALT_KEY"] = "k" * 16
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve", "--config", str(cfg), "--tenants", str(ten), "--port", port],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    result: dict = {}
    try:
        client = httpx.Client(base_url=url, headers={"authorization": f"Bearer {KEY_A}"}, timeout=10)

        def ready() -> bool:
            try:
                return client.get("/readyz").status_code == 200
            except httpx.HTTPError:
                return proc.poll() is not None

        assert wait_for(ready, 30, 0.1) and proc.poll() is None
        # a key added to the tenants file works without a restart (SIGHUP asks for the reload now)
        new = {"authorization": "Bearer sk-added-later"}
        assert client.get("/v1/models", headers=new).status_code == 401
        ten.write_text(
            yaml.safe_dump(
                {
                    "tenants": [
                        {"id": "t1", "api_key_sha256": [hash_key(KEY_A)]},
                        {"id": "t2", "api_key_sha256": [hash_key("sk-added-later")]},
                    ]
                }
            )
        )
        proc.send_signal(signal.SIGHUP)
        assert wait_for(lambda: client.get("/v1/models", headers=new).status_code == 200, 5)
        started = threading.Event()

        def in_flight() -> None:
            with httpx.Client(base_url=url, headers={"authorization": f"Bearer {KEY_A}"}, timeout=10) as c2:
                with c2.stream("POST", "/v1/chat/completions", json=chat(max_tokens=8, stream=True)) as r:
                    result["status"] = r.status_code
                    body = b""
                    for piece in r.iter_raw():
                        body += piece
                        started.set()
                    result["body"] = body

        t = threading.Thread(target=in_flight)
        t.start()
        assert started.wait(10)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        r = client.post("/v1/chat/completions", json=chat(max_tokens=8))
        assert r.status_code == 503
        assert r.json()["error"]["code"] == "server_shutting_down"
        assert client.get("/readyz").status_code == 503
        t.join(15)
        assert result["status"] == 200
        assert result["body"] == b"".join(chunks) + b"data: [DONE]\n\n"
        assert proc.wait(15) == 0
        client.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
        engine.stop()
    logs = proc.stdout.read().decode()
    assert '"msg":"request"' in logs and KEY_A not in logs
