"""Start the bundled backend (``python -m gpu_backend``) as real processes on free loopback ports:
``--role all`` (one process) or three processes (decode, prefill, router). Test helper."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    """A loopback port that was free a moment ago."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class Backend:
    """Backend processes; ``url`` is the router (API) base, ``node_urls`` maps ``prefill`` /
    ``decode`` to the base URLs serving their ``/debug/pool`` (the router itself for role all)."""

    def __init__(
        self,
        *,
        three: bool,
        model: str = "copy-probe",
        faults: str = "",
        extra: list[str] | None = None,
        pools: tuple[int, int] | None = None,
        env: dict[str, str] | None = None,
        startup_timeout: float = 60.0,
    ) -> None:
        self.three = three
        self.procs: list[subprocess.Popen] = []
        self.logs: list[tuple[str, object]] = []
        base_env = {**os.environ, **(env or {}), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        base_env.pop("KVGATE_FAULTS", None)
        if faults:
            base_env["KVGATE_FAULTS"] = faults
        common = ["--model", model, "--device", "cpu", "--enable-debug-endpoints", *(extra or [])]
        try:
            if not three:
                port = free_port()
                sizes = (
                    ["--prefill-max-total-tokens", str(pools[0]), "--decode-max-total-tokens", str(pools[1])]
                    if pools
                    else []
                )
                self._spawn("all", ["--role", "all", "--port", str(port), *common, *sizes], base_env)
                self.url = f"http://127.0.0.1:{port}"
                self.node_urls = {"prefill": self.url, "decode": self.url}
            else:
                pp, dp, rp = free_port(), free_port(), free_port()
                purl, durl = f"http://127.0.0.1:{pp}", f"http://127.0.0.1:{dp}"
                psize = ["--max-total-tokens", str(pools[0])] if pools else []
                dsize = ["--max-total-tokens", str(pools[1])] if pools else []
                self._spawn("decode", ["--role", "decode", "--port", str(dp), *common, *dsize], base_env)
                self._spawn(
                    "prefill", ["--role", "prefill", "--port", str(pp), "--decode-url", durl, *common, *psize], base_env
                )
                self._spawn(
                    "router",
                    ["--role", "router", "--port", str(rp), "--prefill-url", purl, "--decode-url", durl, *common],
                    base_env,
                )
                self.url = f"http://127.0.0.1:{rp}"
                self.node_urls = {"prefill": purl, "decode": durl}
            self._wait_healthy(startup_timeout)
        except BaseException:
            self.stop()
            raise

    def _spawn(self, name: str, args: list[str], env: dict[str, str]) -> None:
        log = tempfile.TemporaryFile(mode="w+")
        self.logs.append((name, log))
        self.procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "gpu_backend", *args], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
            )
        )

    def _wait_healthy(self, timeout: float) -> None:
        urls = {self.url, *self.node_urls.values()}
        deadline = time.monotonic() + timeout
        for u in urls:
            while True:
                for p in self.procs:
                    if p.poll() is not None:
                        raise RuntimeError(f"backend process exited ({p.returncode}):\n{self.output()}")
                try:
                    if httpx.get(u + "/health", timeout=1.0).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"backend at {u} never became healthy:\n{self.output()}")
                time.sleep(0.2)

    def output(self) -> str:
        """Everything the processes printed (for failure messages)."""
        out = []
        for name, f in self.logs:
            f.seek(0)
            out.append(f"--- {name} ---\n{f.read()[-4000:]}")
        return "\n".join(out)

    def pools(self) -> dict[str, dict]:
        """``/debug/pool`` of each node: ``{"prefill": {...}, "decode": {...}}``."""
        out: dict[str, dict] = {}
        for side, u in self.node_urls.items():
            out[side] = httpx.get(u + "/debug/pool", timeout=10.0).json()[side]
        return out

    def wait_idle(self, timeout: float = 20.0, *, zeroed: bool = True) -> dict[str, dict]:
        """Poll until every page on both nodes is free and zeroed (or ``timeout``); returns the last view.
        ``zeroed=False``: until every page is free (``no_scrub`` backends: their pages are never zeroed,
        and a scrubbing pool zeroes a page before it is free again, so waiting longer shows nothing new)."""
        deadline = time.monotonic() + timeout
        while True:
            pools = self.pools()
            idle = all(p["all_free"] and (p["all_zero"] or not zeroed) for p in pools.values())
            if idle or time.monotonic() > deadline:
                return pools
            time.sleep(0.2)

    def stop(self) -> None:
        """Terminate every process (SIGTERM, then SIGKILL after 10 s)."""
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for _, f in self.logs:
            f.close()
        self.procs = []

    def __enter__(self) -> "Backend":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
