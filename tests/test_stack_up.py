"""`kvgate up` and `kvgate demo --once` as a user runs them: real processes (the bundled backend and
the gateway under the command's supervision), their printed output, and a clean stop."""

from __future__ import annotations

import importlib.util
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import orjson
import pytest

from config.loader import DEFAULT_TENANTS

BACKEND_MISSING = importlib.util.find_spec("gpu_backend.__main__") is None
pytestmark = pytest.mark.skipif(
    BACKEND_MISSING,
    reason="the bundled backend (python -m gpu_backend) is not in this checkout: gpu_backend/__main__.py is missing",
)
ROOT = Path(__file__).resolve().parent.parent


def _env(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}
    env.update(KVGATE_STATE_DIR=str(tmp / "state"), PYTHONUNBUFFERED="1")
    return env


def _tenants(tmp: Path) -> Path:
    p = tmp / "tenants.yaml"
    shutil.copy(DEFAULT_TENANTS, p)
    return p


def _listening(url: str) -> bool:
    host, port = url.removeprefix("http://").split("/")[0].split(":")
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex((host, int(port))) == 0


def _processes_mentioning(text: str) -> list[int]:
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                if text in (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    pids.append(int(d.name))
            except OSError:
                pass
    return pids


@pytest.mark.timeout(240)
def test_up_prints_url_and_keys_answers_and_stops_cleanly(tmp_path: Path) -> None:
    err_path = tmp_path / "up.stderr"
    with open(err_path, "wb") as err:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gateway.cli",
                "up",
                "--model",
                "tiny-random",
                "--port",
                "0",
                "--backend-port",
                "0",
                "--tenants",
                str(_tenants(tmp_path)),
            ],
            cwd=tmp_path,
            env=_env(tmp_path),
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
    lines: queue.Queue[str | None] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout] + [lines.put(None)], daemon=True).start()
    out: list[str] = []
    try:
        deadline = time.monotonic() + 180
        while not any("Press Ctrl-C to stop" in x for x in out):
            try:
                line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"kvgate up printed no banner in 180 s:\n{''.join(out)}\n{err_path.read_text()}")
            if line is None:
                pytest.fail(f"kvgate up exited ({proc.wait()}):\n{''.join(out)}\n{err_path.read_text()}")
            out.append(line)
        text = "".join(out)
        base = re.search(r"OpenAI base URL:\s+(http://127\.0\.0\.1:\d+/v1)\n", text).group(1)  # type: ignore[union-attr]
        gateway = base.removesuffix("/v1")
        assert "API keys:         demo-a: sk-demo-a   demo-b: sk-demo-b" in text
        assert "model:            kvgate-tiny (effective context limit now: 3276 tokens)" in text
        assert f"metrics:          {gateway}/metrics" in text
        backend = re.search(r"backend (http://127\.0\.0\.1:\d+) ", err_path.read_text()).group(1)  # type: ignore[union-attr]

        # the printed curl example works as printed
        curl = text[text.index("curl ") : text.index("Press Ctrl-C")].strip()
        r = subprocess.run(["bash", "-c", curl + " -sS"], capture_output=True, timeout=60)
        body = orjson.loads(r.stdout)
        assert body["object"] == "chat.completion" and body["model"] == "kvgate-tiny", body
        assert body["usage"]["completion_tokens"] <= 16

        client = openai.OpenAI(base_url=base, api_key="sk-demo-b", max_retries=0, timeout=60)
        c = client.completions.create(model="kvgate-tiny", prompt="Call me Ishmael.", max_tokens=4, temperature=0)
        assert c.usage is not None and c.usage.prompt_tokens == 6  # Call| me| Ish|ma|el|.
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base, api_key="sk-demo-c", max_retries=0).models.list()

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        stderr = err_path.read_text()
        assert "kvgate up: stopped (gateway drained, backend exited)" in stderr
        assert not _listening(gateway) and not _listening(backend)
        assert _processes_mentioning(str(tmp_path)) == []  # the gateway (its --config is in tmp) is gone
        assert _processes_mentioning(f"--port {backend.rsplit(':', 1)[1]}") == []  # and the backend
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


@pytest.mark.timeout(240)
def test_up_refuses_a_taken_gateway_port(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "gateway.cli",
                "up",
                "--model",
                "tiny-random",
                "--port",
                str(port),
                "--backend-port",
                "0",
                "--tenants",
                str(_tenants(tmp_path)),
            ],
            cwd=tmp_path,
            env=_env(tmp_path),
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert r.returncode == 1
    # refused before anything says the stack is starting
    assert r.stderr == (
        f"kvgate up: gateway port {port} on 127.0.0.1 is in use (pick another with --port, or --port 0 for a free one)\n"
    )
    assert _processes_mentioning(str(tmp_path)) == []


@pytest.mark.timeout(240)
def test_demo_once_sends_real_text_and_prints_the_table(tmp_path: Path) -> None:
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "gateway.cli",
            "demo",
            "--model",
            "tiny-random",
            "--once",
            "--port",
            "0",
            "--backend-port",
            "0",
            "--tenants",
            str(_tenants(tmp_path)),
        ],
        cwd=tmp_path,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [line for line in r.stdout.splitlines() if re.match(r"^(chat|completion) ", line)]
    got = []
    for line in rows:  # the label is the first 34 characters: route, whole|streamed, size
        route, mode, size = line[:10].strip(), line[11:19].strip(), line[20:34].strip()
        tokens, limit, status, latency = line[34:].split()[:4]
        assert float(latency) > 0
        got.append((route, mode, size, int(tokens), int(limit), int(status)))
    assert len(got) == 16, r.stdout
    expected_tokens = {"at limit": 3260, "limit + 1": 3261, "> prefill pool": 4097}
    for route, mode, size, tokens, limit, status in got:
        assert limit == 3276
        assert status == (200 if size in ("short", "at limit") else 400), (route, mode, size)
        if size in expected_tokens:
            assert tokens == expected_tokens[size]
    assert [(g[0], g[1]) for g in got][::4] == [
        ("chat", "whole"),
        ("chat", "streamed"),
        ("completion", "whole"),
        ("completion", "streamed"),
    ]
    assert [x.endswith("  context_length_exceeded") for x in rows].count(True) == 8
    assert (
        "400 context_length_exceeded: This model's maximum context length is 3276 tokens. However, you "
        "requested 3277 tokens (3261 in the messages, 16 in the completion). Please reduce the length of the "
        "messages or completion."
    ) in r.stdout
    assert "kvgate demo: OK: all 16 requests got the expected answer" in r.stdout
    assert "kvgate demo: stack stopped." in r.stderr
    assert _processes_mentioning(str(tmp_path)) == []


def _sha(key: str) -> str:
    import hashlib

    return hashlib.sha256(key.encode()).hexdigest()


def _tenant(name: str, key: str, models: str) -> str:
    return f"  - id: {name}\n    api_key_sha256: [{_sha(key)}]\n    allowed_models: [{models}]\n"


@pytest.mark.timeout(300)
def test_up_leaves_out_a_tenant_tied_to_another_model_and_keeps_reloading(tmp_path: Path) -> None:
    tenants = _tenants(tmp_path)
    with open(tenants, "a") as f:
        f.write(_tenant("acme", "sk-acme", "smollm2-135m-instruct"))
        f.write(_tenant("both", "sk-both", "smollm2-135m-instruct, tiny-random"))
    # kvgate serve alone still refuses the file: a typo in allowed_models must not start silently
    r = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "serve", "--port", "0", "--tenants", str(tenants), "--demo"],
        cwd=tmp_path,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode != 0
    assert "tenants[2].allowed_models[0]: unknown model 'smollm2-135m-instruct'" in r.stderr
    err_path = tmp_path / "up.stderr"
    cmd = ["up", "--model", "tiny-random", "--port", "0", "--backend-port", "0", "--tenants", str(tenants)]
    with open(err_path, "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", *cmd],
            cwd=tmp_path,
            env=_env(tmp_path),
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
    lines: queue.Queue[str | None] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout] + [lines.put(None)], daemon=True).start()
    out: list[str] = []
    try:
        while not any("Press Ctrl-C to stop" in x for x in out):
            try:
                line = lines.get(timeout=180)
            except queue.Empty:
                pytest.fail(f"kvgate up printed no banner in 180 s:\n{''.join(out)}\n{err_path.read_text()}")
            if line is None:
                pytest.fail(f"kvgate up exited ({proc.wait()}):\n{''.join(out)}\n{err_path.read_text()}")
            out.append(line)
        base = re.search(r"OpenAI base URL:\s+(http://127\.0\.0\.1:\d+/v1)\n", "".join(out)).group(1)  # type: ignore[union-attr]
        stderr = err_path.read_text()
        assert (
            f"kvgate: {tenants}: tenant acme: allowed only smollm2-135m-instruct, not served by this stack; left out"
        ) in stderr
        assert f"kvgate: {tenants}: tenant both: allowed smollm2-135m-instruct not served by this stack" in stderr

        def complete(key: str) -> int:
            client = openai.OpenAI(base_url=base, api_key=key, max_retries=0, timeout=60)
            c = client.completions.create(model="kvgate-tiny", prompt="Call me", max_tokens=2, temperature=0)
            assert c.usage is not None
            return c.usage.prompt_tokens

        with pytest.raises(openai.AuthenticationError):
            complete("sk-acme")  # left out, never widened to every model
        assert complete("sk-both") > 0 and complete("sk-demo-a") > 0
        with open(tenants, "a") as f:  # a reload filters the same way (a strict one would keep the old table)
            f.write(_tenant("late", "sk-late", "kvgate-tiny"))
        deadline = time.monotonic() + 60
        while True:
            try:
                assert complete("sk-late") > 0
                break
            except openai.AuthenticationError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        with pytest.raises(openai.AuthenticationError):
            complete("sk-acme")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_the_banner_names_its_log_and_tenant_files_by_absolute_path(tmp_path, monkeypatch) -> None:
    """Started with relative paths (``--run-dir .kvgate/run``, ``--tenants my.yaml``), the banner
    still names the logs and the tenants file in full: it is read from another terminal, whose
    working directory may be anywhere (before: ``logs: .kvgate/run/backend.log``)."""
    from types import SimpleNamespace

    from gateway.commands.up import banner

    monkeypatch.chdir(tmp_path)
    stack = SimpleNamespace(
        gateway_url="http://127.0.0.1:8080",
        model="kvgate-tiny",
        options=SimpleNamespace(echo_logs=False),
        run_dir=Path(".kvgate/run"),
        tenants_path=Path("my.yaml"),
    )
    text = banner(stack, 3276)  # type: ignore[arg-type]
    assert f"  logs:             {tmp_path}/.kvgate/run/backend.log, gateway.log\n" in text
    assert f"SIGHUP reloads the tenants file ({tmp_path}/my.yaml).\n" in text


def test_up_with_a_tenants_file_of_its_own_lists_the_keys_it_accepts(tmp_path, monkeypatch) -> None:
    """``kvgate up --tenants`` a file made by ``kvgate tenant add`` (no demo tenant): the banner's
    limit was read with ``sk-demo-a``, whose 401 ended ``kvgate up`` (exit 1) once the stack was
    up. The banner now lists the demo keys the gateway accepts, and none when it accepts none."""
    from types import SimpleNamespace

    import httpx

    from gateway.commands import up

    stack = SimpleNamespace(
        gateway_url="http://127.0.0.1:8080",
        model="kvgate-tiny",
        options=SimpleNamespace(echo_logs=True),
        run_dir=tmp_path,
        tenants_path=tmp_path / "mine.yaml",
    )
    models = {"data": [{"id": "kvgate-tiny", "max_model_len": 3276}]}
    accepted: set[str] = set()

    def answer(_stack, key):
        request = httpx.Request("GET", "http://127.0.0.1:8080/v1/models")
        return (
            httpx.Response(200, json=models, request=request)
            if key in accepted
            else httpx.Response(401, request=request)
        )

    monkeypatch.setattr(up, "_models", answer)
    assert up.demo_access(stack) == ({}, None)  # type: ignore[arg-type]
    text = up.banner(stack, None, {})  # type: ignore[arg-type]
    assert f"  API keys:         those of your tenants ({tmp_path}/mine.yaml; the demo keys are not in it)\n" in text
    assert '-H "Authorization: Bearer $YOUR_KEY"' in text and "model:            kvgate-tiny\n" in text
    accepted.add("sk-demo-b")
    assert up.demo_access(stack) == ({"demo-b": "sk-demo-b"}, 3276)  # type: ignore[arg-type]
    text = up.banner(stack, 3276, {"demo-b": "sk-demo-b"})  # type: ignore[arg-type]
    assert "  API keys:         demo-b: sk-demo-b\n" in text and '-H "Authorization: Bearer sk-demo-b"' in text
