"""gateway/stack/embedded.py's supervision, with a stand-in engine (a stdlib HTTP server serving the bundled
backend's /health, /server_info and /v1/models) and the real gateway: the generated config, start-up
failures with the engine's own words, child death while serving, and cleanup of whole process
groups, also when the supervisor itself is SIGKILLed."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest
import yaml

from config.loader import DEFAULT_TENANTS
from gateway.stack.embedded import EmbeddedStack, StackError, StackOptions, serve_until_interrupted

pytestmark = pytest.mark.timeout(90)

FAKE_ENGINE = textwrap.dedent(r"""
    import json, subprocess, sys
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    port, mode = int(sys.argv[1]), sys.argv[2]
    if mode == "grandchild":  # an engine worker in the same process group
        g = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        open(sys.argv[3], "w").write(str(g.pid))
    INFO = {"max_total_num_tokens": 4096, "max_req_input_len": 4090, "context_length": 8192, "page_size": 16,
            "disaggregation_mode": "prefill", "status": "ready", "version": "fake"}
    if mode == "nofield":
        del INFO["max_total_num_tokens"]
    class H(BaseHTTPRequestHandler):
        def do_GET(self):
            body = {"/health": b"", "/server_info": json.dumps(INFO).encode(),
                    "/v1/models": json.dumps({"object": "list", "data": [{"id": "kvgate-tiny", "object": "model",
                                              "max_model_len": 8192}]}).encode()}.get(self.path)
            self.send_response(200 if body is not None else 404)
            self.send_header("content-length", str(len(body or b"")))
            self.end_headers()
            self.wfile.write(body or b"")
        def log_message(self, *a):
            pass
    print("fake engine listening", flush=True)
    ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
""")


def _opts(tmp: Path, mode: str = "ok", *extra: str, timeout: float = 60) -> StackOptions:
    return StackOptions(
        tenants=DEFAULT_TENANTS,
        gateway_port=0,
        backend_port=0,
        run_dir=tmp,
        backend_cmd=[sys.executable, "-c", FAKE_ENGINE, "{port}", mode, *extra],
        startup_timeout_seconds=timeout,
        extra_env={"KVGATE_STATE_DIR": str(tmp / "state")},
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped) is not alive
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def _listening(url: str) -> bool:
    host, port = url.removeprefix("http://").split(":")
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex((host, int(port))) == 0


def _wait_gone(pid: int, seconds: float = 15) -> bool:
    deadline = time.monotonic() + seconds
    while _alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_generated_config_points_the_gateway_at_the_backend(tmp_path: Path, monkeypatch) -> None:
    # an environment override naming another upstream must not leak into the gateway's process
    monkeypatch.setenv(
        "KVGATE_UPSTREAMS",
        '[{"name": "elsewhere", "api_url": "http://127.0.0.1:9/v1", '
        '"pool_source": "kvgate", "pool_urls": ["http://127.0.0.1:9/server_info"], '
        '"models": ["kvgate-tiny"]}]',
    )
    pid_file = tmp_path / "grandchild.pid"
    stack = EmbeddedStack(_opts(tmp_path, "grandchild", str(pid_file)))
    with stack:
        cfg = yaml.safe_load(stack.config_path.read_text())
        assert cfg["upstreams"] == [
            {
                "name": "embedded",
                "api_url": f"{stack.backend_url}/v1",
                "pool_source": "kvgate",
                "engine": "kvgate",  # the bundled engine's field policy, written out
                "pool_urls": [f"{stack.backend_url}/server_info"],
                "static_pool_tokens": None,
                "models": ["kvgate-tiny"],
                "api_key": None,
                "weight": 1,
                "pass_stateful_responses": False,
            }
        ]
        assert cfg["redis_url"] is None
        assert cfg["state_dir"] == str(tmp_path / "state")
        assert stack.server_info["max_total_num_tokens"] == 4096
        r = httpx.get(stack.gateway_url + "/v1/models", headers={"Authorization": "Bearer sk-demo-a"})
        assert r.status_code == 200
        assert [(m["id"], m["max_model_len"]) for m in r.json()["data"]] == [("kvgate-tiny", 3276)]  # 4096 / 1.25
        assert httpx.get(stack.gateway_url + "/readyz").status_code == 200
        grandchild = int(pid_file.read_text())
        assert _alive(grandchild)
        gateway_pid, backend_pid = stack.gateway.proc.pid, stack.backend.proc.pid  # type: ignore[union-attr]
    assert not _listening(stack.gateway_url) and not _listening(stack.backend_url)
    assert not _alive(gateway_pid) and not _alive(backend_pid)
    assert _wait_gone(grandchild, 5), "the engine's worker survived stop()"
    assert (tmp_path / "gateway.log").exists()  # a given run_dir is kept


def test_backend_exiting_during_start_up_is_reported_with_its_words(tmp_path: Path) -> None:
    opts = _opts(tmp_path)
    opts.backend_cmd = [sys.executable, "-c", "print('engine says: no such model'); raise SystemExit(3)"]
    stack = EmbeddedStack(opts)
    with pytest.raises(StackError) as e:
        stack.start()
    assert str(e.value).startswith(f"backend exited with status 3 during start-up (log: {tmp_path}/backend.log)\n")
    assert "    engine says: no such model" in str(e.value)
    assert stack.gateway is None


def test_backend_without_pool_field_times_out_and_is_stopped(tmp_path: Path) -> None:
    stack = EmbeddedStack(_opts(tmp_path, "nofield", timeout=2))
    with pytest.raises(StackError) as e:
        stack.start()
    assert str(e.value).startswith(
        f"backend: /server_info (max_total_num_tokens) not ready after 2 s ({stack.backend.url}/server_info: HTTP 200: "
    )  # type: ignore[union-attr]
    assert "fake engine listening" in str(e.value)
    assert not _alive(stack.backend.proc.pid)  # type: ignore[union-attr]
    assert stack.gateway is None


def test_a_child_dying_while_serving_ends_the_supervisor(tmp_path: Path, capsys) -> None:
    with EmbeddedStack(_opts(tmp_path)) as stack:
        os.kill(stack.backend.proc.pid, signal.SIGKILL)  # type: ignore[union-attr]
        assert serve_until_interrupted(stack, poll_seconds=0.05) == 1
    err = capsys.readouterr().err
    assert err.startswith("kvgate: backend exited with status -9 while serving (log: ")


def test_children_die_with_a_killed_supervisor(tmp_path: Path) -> None:
    engine = tmp_path / "fake_engine.py"
    engine.write_text(FAKE_ENGINE)
    script = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from gateway.stack.embedded import EmbeddedStack, StackOptions
        tmp = Path({str(tmp_path)!r})
        s = EmbeddedStack(StackOptions(tenants={str(DEFAULT_TENANTS)!r}, gateway_port=0, backend_port=0, run_dir=tmp,
                                       backend_cmd=[sys.executable, {str(engine)!r}, "{{port}}", "ok"],
                                       extra_env={{"KVGATE_STATE_DIR": str(tmp / "state")}})).start()
        print(s.gateway.proc.pid, s.backend.proc.pid, flush=True)
        time.sleep(600)
    """)
    sup = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        line = sup.stdout.readline()  # type: ignore[union-attr]
        gateway_pid, backend_pid = map(int, line.split())
        assert _alive(gateway_pid) and _alive(backend_pid)
        sup.kill()
        sup.wait(10)
        assert _wait_gone(gateway_pid) and _wait_gone(backend_pid)
    finally:
        if sup.poll() is None:
            sup.kill()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_sigint_and_sigterm_interrupt_a_supervisor_even_if_sigint_was_ignored(sig: int) -> None:
    script = textwrap.dedent("""
        import time
        from gateway.stack.embedded import terminate_as_interrupt
        with terminate_as_interrupt():
            try:
                print("ready", flush=True)
                time.sleep(60)
            except KeyboardInterrupt:
                print("interrupted", flush=True)
    """)
    # a background job of a non-interactive shell starts with SIGINT ignored
    p = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    try:
        assert p.stdout.readline() == "ready\n"  # type: ignore[union-attr]
        p.send_signal(sig)
        out, _ = p.communicate(timeout=20)
        assert (p.returncode, out) == (0, "interrupted\n")
    finally:
        if p.poll() is None:
            p.kill()


def test_a_backend_without_torch_gets_an_install_hint(tmp_path: Path) -> None:
    opts = _opts(tmp_path)
    opts.backend_cmd = [sys.executable, "-c", "raise ModuleNotFoundError(\"No module named 'torch'\")"]
    with pytest.raises(StackError) as e:
        EmbeddedStack(opts).start()
    assert str(e.value).endswith(
        "\nThe bundled backend needs PyTorch: pip install 'kvgate[backend]' (or run scripts/bootstrap.sh)."
    )


def test_a_stack_with_redis_runs_the_gateway_workers_and_stops_them_all(tmp_path: Path) -> None:
    import dataclasses

    opts = dataclasses.replace(_opts(tmp_path), redis_url="redis://127.0.0.1:6379/0", workers=2)
    stack = EmbeddedStack(opts)
    with stack:
        cfg = yaml.safe_load(stack.config_path.read_text())
        assert cfg["redis_url"] == "redis://127.0.0.1:6379/0"
        supervisor = stack.gateway.proc.pid  # type: ignore[union-attr]
        workers = [int(p) for p in Path(f"/proc/{supervisor}/task/{supervisor}/children").read_text().split()]
        assert len(workers) == 2
        seen: set[str] = set()
        deadline = time.monotonic() + 30
        while seen != {"0", "1"} and time.monotonic() < deadline:  # new connections reach both workers
            with httpx.Client() as c:
                r = c.get(stack.gateway_url + "/healthz")
                seen.add(r.headers["x-kvgate-worker"])
            time.sleep(0.05)
        assert seen == {"0", "1"}
        r = httpx.get(stack.gateway_url + "/v1/models", headers={"Authorization": "Bearer sk-demo-a"})
        assert r.status_code == 200
    assert not _listening(stack.gateway_url)
    assert all(_wait_gone(p, 10) for p in [supervisor, *workers])
