"""``kvgate serve`` as a real process: it refuses the documented demo keys without ``--demo``,
SIGHUP re-reads the tenants file, and SIGTERM drains (requests in flight finish, new ones get 503, then it exits 0;
a stream that outlives ``drain_timeout_seconds`` is ended by the gateway with a ``server_shutting_down`` event).
The drain's cut in-process too (``Gateway.cut_in_flight``): a Responses stream and a request still
waiting for its engine."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import orjson
import pytest
import yaml

from gateway.cli import main
from gateway.ops.tenants import hash_key
from gateway.relay.upstream_client import MockResponse
from tests.backend_procs import free_port
from tests.conftest import ROOT
from tests.gateway_harness import KEY_A, MODEL, chat, wait_for
from tests.mock_engine import MockEngine
from tests.test_gateway_relay import SSE, InProcess, _event

DEFAULT_TENANTS = ROOT / "config" / "tenants.yaml"


def test_serve_refuses_demo_keys_without_demo(capsys):
    assert main(["serve", "--tenants", str(DEFAULT_TENANTS), "--port", "1"]) == 2
    err = capsys.readouterr().err
    assert "demo-a, demo-b accept a documented demo key" in err
    assert "sk-demo-a" in err  # the documented key's name, never a secret


def _serve(tmp_path, engine: MockEngine, *, drain_timeout_seconds: float) -> tuple[subprocess.Popen, str, object]:
    """``kvgate serve`` as a process in front of ``engine`` (tenant t1 with ``KEY_A``; quotas and
    the verifier off), its stdout and stderr piped together: ``(process, base url, tenants path)``."""
    cfg = tmp_path / "kvgate.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "gateway": {"drain_timeout_seconds": drain_timeout_seconds},
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
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}
    env["KVGATE_SECRET_CACHE_SALT_KEY"] = "k" * 16
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve", "--config", str(cfg), "--tenants", str(ten), "--port", port],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    return proc, f"http://127.0.0.1:{port}", ten


def _ready_client(proc: subprocess.Popen, url: str) -> httpx.Client:
    """A client of the served gateway, once its ``/readyz`` answers 200 (the process still runs)."""
    client = httpx.Client(base_url=url, headers={"authorization": f"Bearer {KEY_A}"}, timeout=10)

    def ready() -> bool:
        try:
            return client.get("/readyz").status_code == 200
        except httpx.HTTPError:
            return proc.poll() is not None

    assert wait_for(ready, 30, 0.1) and proc.poll() is None
    return client


def _stream_in_background(url: str, result: dict) -> threading.Thread:
    """A streamed chat sent from a thread, returned once its first bytes came: the thread puts the
    answer's ``status`` and raw ``body`` in ``result`` when the stream ends."""
    started = threading.Event()

    def in_flight() -> None:
        with httpx.Client(base_url=url, headers={"authorization": f"Bearer {KEY_A}"}, timeout=10) as c:
            with c.stream("POST", "/v1/chat/completions", json=chat(max_tokens=8, stream=True)) as r:
                result["status"] = r.status_code
                body = b""
                for piece in r.iter_raw():
                    body += piece
                    started.set()
                result["body"] = body

    t = threading.Thread(target=in_flight)
    t.start()
    assert started.wait(10)
    return t


@pytest.mark.timeout(60)
def test_sigterm_drains_in_flight_and_refuses_new(tmp_path):
    engine = MockEngine().start()
    chunks = [b'data: {"choices":[{"index":0,"delta":{"content":"w%d "}}]}\n\n' % i for i in range(4)]
    engine.state.stream_chunks = chunks + [b"data: [DONE]\n\n"]
    engine.state.chunk_interval_seconds = 0.4
    proc, url, ten = _serve(tmp_path, engine, drain_timeout_seconds=10)
    result: dict = {}
    try:
        client = _ready_client(proc, url)
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
        t = _stream_in_background(url, result)
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


#: what ends a chat stream the drain's end cut: the error event, then ``[DONE]``
SHUTDOWN_TAIL = (
    b'data: {"error":{"message":"The gateway is shutting down; the request was ended. Retry on another replica.",'
    b'"type":"server_error","param":null,"code":"server_shutting_down"}}\n\ndata: [DONE]\n\n'
)


@pytest.mark.timeout(60)
def test_sigterm_ends_a_stream_that_outlives_the_drain(tmp_path):
    """The drain ends at ``drain_timeout_seconds``: the stream still running is ended by the
    gateway (an error event ``server_shutting_down`` and ``[DONE]``; the upstream request
    cancelled; settled and access-logged) and the process exits 0 soon after, uvicorn logging no
    error (it used to wait the drain time again, then cancel the stream mid-body)."""
    engine = MockEngine().start()
    chunks = [b'data: {"choices":[{"index":0,"delta":{"content":"w%d "}}]}\n\n' % i for i in range(100)]
    engine.state.stream_chunks = chunks + [b"data: [DONE]\n\n"]
    engine.state.chunk_interval_seconds = 0.2  # 20 s of stream
    drain = 2.0
    proc, url, _ = _serve(tmp_path, engine, drain_timeout_seconds=drain)
    result: dict = {}
    try:
        client = _ready_client(proc, url)
        client.close()
        t = _stream_in_background(url, result)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
        took = time.monotonic() - t0
        t.join(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
        engine.stop()
    assert took < drain + 1.5, took  # it took twice the drain time
    assert result["status"] == 200
    body = result["body"]
    assert body.endswith(SHUTDOWN_TAIL), body[-300:]
    assert body.startswith(chunks[0]) and body.count(b"data: [DONE]") == 1
    assert engine.state.cancelled  # the upstream request was closed
    logs = [orjson.loads(line) for line in proc.stdout.read().decode().splitlines() if line.startswith("{")]
    access = [e for e in logs if e.get("msg") == "request"]
    assert len(access) == 1, access
    assert access[0]["status"] == 200 and access[0]["error_code"] == "server_shutting_down"
    assert not [e for e in logs if e["level"] in ("error", "critical")], logs


class _Hanging(MockResponse):
    """An engine's answer that sends its chunks, then nothing more (until closed)."""

    async def aiter_raw(self):
        for c in self.chunks:
            yield c
        await asyncio.Event().wait()


async def _cut_while_in_flight(gw: InProcess, path: str, body: dict) -> tuple[httpx.Response, int]:
    """``gw.post`` with the drain's end (``cut_in_flight``) 0.3 s into it: (answer, requests cut)."""
    cut: list[int] = []

    async def later() -> None:
        await asyncio.sleep(0.3)
        cut.append(gw.gw.cut_in_flight())

    r, _ = await asyncio.gather(gw.post(path, body), later())
    return r, cut[0]


@pytest.mark.timeout(30)
def test_the_drains_end_ends_a_responses_stream_with_its_error_event():
    events = [
        _event("response.created", 0, response={"id": "r1", "status": "in_progress", "output": []}),
        _event("response.output_text.delta", 1, output_index=0, content_index=0, delta="Hel"),
    ]
    answer = _Hanging(200, SSE, events)
    gw = InProcess(lambda request: answer)
    body = {"model": MODEL, "input": "Say hello.", "stream": True, "max_output_tokens": 5}
    r, cut = asyncio.run(_cut_while_in_flight(gw, "/v1/responses", body))
    assert cut == 1 and r.status_code == 200
    assert r.content == b"".join(events) + (
        b'event: error\ndata: {"type":"error","code":"server_shutting_down","message":"The gateway is shutting down; '
        b'the request was ended. Retry on another replica.","param":null,"sequence_number":2}\n\n'
    )
    assert answer.closed and gw.gw.in_flight == 0 and not gw.gw.requests
    assert 'status="200"' in gw.metrics()


@pytest.mark.timeout(30)
def test_the_drains_end_answers_503_to_a_request_still_waiting_for_its_engine():
    async def never(request):
        await asyncio.Event().wait()

    gw = InProcess(never)
    r, cut = asyncio.run(_cut_while_in_flight(gw, "/v1/chat/completions", chat(max_tokens=8)))
    assert cut == 1 and r.status_code == 503
    assert r.json()["error"]["code"] == "server_shutting_down"
    assert gw.gw.in_flight == 0 and not gw.gw.requests
