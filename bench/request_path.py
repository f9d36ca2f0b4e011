"""Which gateway modules one chat request passes through: an architecture measure, not a timing.

Starts ``bench/mock_engine.py`` and ``kvgate serve --workers 1`` with every feature on (auth, exact
count, live pool, quotas in Redis, verifier sampling every response), sends one warm-up chat and
then one traced chat (streamed or not), and prints the ``gateway.*`` modules whose Python functions
ran for it, in first-call order, with the number of times the call moved from one gateway module to
another. The trace is ``sys.setprofile`` on the gateway process's event-loop thread (and
``threading.setprofile`` for threads started meanwhile), switched on and off by SIGUSR1 / SIGUSR2 around the traced request, so start-up and the warm-up are not
counted.

Run: ``.venv/bin/python bench/request_path.py [--stream] [--redis-url redis://127.0.0.1:6379/0]``.
"""

from __future__ import annotations

import os
import sys

if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)

import argparse
import hashlib
import json
import signal
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MODEL = "kvgate-tiny"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(url: str, timeout_seconds: float = 60.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout_seconds
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1.0).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise SystemExit(f"request_path: {url} did not answer in {timeout_seconds:.0f} s")


class Tracer:
    """Records the ``gateway.*`` module of every Python call while on (in every thread)."""

    def __init__(self) -> None:
        self.on = False
        self.modules: list[str] = []
        self._last: str | None = None
        self.moves = 0

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if not self.on or event != "call":
            return
        name = frame.f_globals.get("__name__", "")
        if not name.startswith("gateway."):
            return
        if name not in self.modules:
            self.modules.append(name)
        if self._last is not None and name != self._last:
            self.moves += 1
        self._last = name


def child(argv: list[str], out: Path) -> None:
    """Run ``kvgate serve`` in this process under the tracer; write the trace to ``out`` on SIGUSR2."""
    tracer = Tracer()

    def start(*_: Any) -> None:
        tracer.on = True
        threading.setprofile(tracer)
        sys.setprofile(tracer)

    def stop(*_: Any) -> None:
        tracer.on = False
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
        out.write_text(json.dumps({"modules": tracer.modules, "moves": tracer.moves}))

    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, stop)
    from gateway.cli import main

    sys.exit(main(argv))


def _config(tmp: Path, mock_url: str, port: int, redis_url: str) -> tuple[Path, Path, str]:
    import yaml

    key = "sk-path-" + os.urandom(8).hex()
    settings = {
        "gateway": {"host": "127.0.0.1", "port": port, "log_level": "warning"},
        "quotas": {"enabled": True},
        "verifier": {"enabled": True},
        "redis_url": redis_url,
        "state_dir": str(tmp / "state"),
        "models": [{"id": MODEL, "context_length": 8192, "tokenizer": {"kind": "tiktoken", "name": "cl100k_base"}}],
        "upstreams": [
            {
                "name": "mock",
                "api_url": mock_url + "/v1",
                "pool_source": "sglang",
                "pool_urls": [mock_url + "/server_info"],
                "models": [MODEL],
            }
        ],
    }
    tenant = {
        "id": f"path-{os.urandom(4).hex()}",
        "api_key_sha256": [hashlib.sha256(key.encode()).hexdigest()],
        "default_max_tokens": 16,
        "allowed_models": [MODEL],
        "verify_sample_rate": 1.0,
    }
    (tmp / "kvgate.yaml").write_text(yaml.safe_dump(settings, sort_keys=False))
    (tmp / "tenants.yaml").write_text(yaml.safe_dump({"tenants": [tenant]}, sort_keys=False))
    return tmp / "kvgate.yaml", tmp / "tenants.yaml", key


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stream", action="store_true", help="trace a streamed chat")
    ap.add_argument("--redis-url", default=os.environ.get("KVGATE_BENCH_REDIS_URL", "redis://127.0.0.1:6379/0"))
    ap.add_argument("--child", nargs=2, metavar=("OUT", "ARGV_JSON"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(json.loads(args.child[1]), Path(args.child[0]))
        return
    import httpx

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        mock_port, port = _free_port(), _free_port()
        mock_url = f"http://127.0.0.1:{mock_port}"
        mock = [sys.executable, str(HERE / "mock_engine.py"), "--port", str(mock_port), "--model", MODEL, "--count"]
        cfg, tenants, key = _config(tmp, mock_url, port, args.redis_url)
        serve = ["serve", "--config", str(cfg), "--tenants", str(tenants), "--workers", "1"]
        out = tmp / "trace.json"
        gw_cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(out), json.dumps(serve)]
        procs = [subprocess.Popen(mock, cwd=ROOT)]
        try:
            _wait(mock_url + "/health")
            procs.append(subprocess.Popen(gw_cmd, cwd=ROOT))
            _wait(f"http://127.0.0.1:{port}/readyz")
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": "Say hello to the gateway."}],
                "max_tokens": 8,
                "stream": args.stream,
            }
            headers = {"Authorization": f"Bearer {key}"}
            url = f"http://127.0.0.1:{port}/v1/chat/completions"
            with httpx.Client(timeout=30.0) as client:
                assert client.post(url, json=body, headers=headers).status_code == 200
                time.sleep(0.5)  # the warm-up's verification and settle finish
                procs[1].send_signal(signal.SIGUSR1)
                time.sleep(0.2)
                status = client.post(url, json=body, headers=headers).status_code
                time.sleep(0.5)
                procs[1].send_signal(signal.SIGUSR2)
            for _ in range(50):
                if out.exists():
                    break
                time.sleep(0.1)
            trace = json.loads(out.read_text())
        finally:
            for p in reversed(procs):
                p.terminate()
                p.wait(10)
    kind = "streamed" if args.stream else "non-streamed"
    print(f"one {kind} chat (HTTP {status}): {len(trace['modules'])} gateway modules, {trace['moves']} moves")
    for m in trace["modules"]:
        print("  " + m)


if __name__ == "__main__":
    main()
