"""Helpers for the quota tests: a spare redis-server the fault tests may kill, pause (SIGSTOP)
and restart, a sentinel in front of it, and a TCP server that accepts and never answers."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ping(port: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return
        except OSError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"redis on port {port} did not answer PING within {timeout}s")


class SpareRedis:
    """A redis-server of the test's own on a free port (no persistence), to stop and pause."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.sentinels: list[subprocess.Popen[bytes]] = []

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        """Start (or restart, on the same port) and wait until it answers."""
        self.proc = subprocess.Popen(
            [
                shutil.which("redis-server") or "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.workdir),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        _wait_ping(self.port)

    def kill(self) -> None:
        """SIGKILL: connections are refused from now on."""
        if self.proc is not None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(10)
            self.proc = None

    def pause(self) -> None:
        """SIGSTOP: the kernel still accepts connections; nothing answers."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def start_sentinel(self, tmp: Path, service: str) -> int:
        """A redis sentinel monitoring this server as ``service``; returns its port."""
        port = free_port()
        conf = tmp / f"sentinel-{port}.conf"
        conf.write_text(f"port {port}\nbind 127.0.0.1\nsentinel monitor {service} 127.0.0.1 {self.port} 1\ndir {tmp}\n")
        self.sentinels.append(
            subprocess.Popen(
                [shutil.which("redis-server") or "redis-server", str(conf), "--sentinel"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        _wait_ping(port)
        return port

    def close(self) -> None:
        for p in self.sentinels:
            p.kill()
            p.wait(10)
        self.sentinels.clear()
        self.kill()


@pytest.fixture()
def spare_redis(tmp_path: Path) -> Iterator[SpareRedis]:
    """A started :class:`SpareRedis`, killed after the test."""
    r = SpareRedis(tmp_path)
    r.start()
    try:
        yield r
    finally:
        r.close()


class BlackHole:
    """A TCP server on 127.0.0.1 that accepts every connection and never sends a byte."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(128)
        self.port = self.sock.getsockname()[1]
        self.conns: list[socket.socket] = []
        self._stop = False
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        self.sock.settimeout(0.1)
        while not self._stop:
            try:
                c, _ = self.sock.accept()
                self.conns.append(c)
            except OSError:
                continue

    def close(self) -> None:
        self._stop = True
        self.thread.join(5)
        for c in self.conns:
            c.close()
        self.sock.close()


@pytest.fixture()
def black_hole() -> Iterator[BlackHole]:
    b = BlackHole()
    try:
        yield b
    finally:
        b.close()


assert os.name == "posix"  # SIGSTOP / SIGCONT
