"""Helpers for the quota tests: a spare redis-server the fault tests may kill, pause (SIGSTOP)
and restart, a sentinel in front of it, and a TCP server that accepts and never answers."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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


class TcpForwarder:
    """A TCP forwarder on loopback to the Redis on ``port``, one thread each way per connection:
    a subclass says what each way does (``_up(client, server, event)``, ``_down(server, client,
    event)``; ``event`` is one :class:`threading.Event` per connection that both share)."""

    def __init__(self, port: int) -> None:
        self.target = port
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(128)
        self.port = self.sock.getsockname()[1]
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _accept(self) -> None:
        self.sock.settimeout(0.1)
        while not self._stop:
            try:
                c, _ = self.sock.accept()
            except OSError:
                continue
            try:
                u = socket.create_connection(("127.0.0.1", self.target), timeout=2)
            except OSError:
                c.close()
                continue
            event = threading.Event()
            threading.Thread(target=self._down, args=(u, c, event), daemon=True).start()
            threading.Thread(target=self._up, args=(c, u, event), daemon=True).start()

    def _up(self, c: socket.socket, u: socket.socket, event: threading.Event) -> None:
        raise NotImplementedError

    def _down(self, u: socket.socket, c: socket.socket, event: threading.Event) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self._stop = True
        self.sock.close()


class StaleProxy(TcpForwarder):
    """A TCP forwarder to ``port`` that hides a server restart from its clients, as a NAT box, a
    load balancer or a lost FIN does: when the server side of a connection closes, the client side
    stays open and silent, and the client's next command on it gets a reset. New connections are
    forwarded to the (restarted) server as usual."""

    def __init__(self, port: int) -> None:
        self.resets = 0
        super().__init__(port)

    def _down(self, u: socket.socket, c: socket.socket, dead: threading.Event) -> None:
        u.settimeout(None)
        try:
            while data := u.recv(65536):
                c.sendall(data)
        except OSError:
            pass
        dead.set()  # the server went away: tell the client nothing

    def _up(self, c: socket.socket, u: socket.socket, dead: threading.Event) -> None:
        stale = False
        try:
            while data := c.recv(65536):
                if dead.is_set():
                    stale = True  # a command on a connection whose server is gone
                    break
                u.sendall(data)
        except OSError:
            pass
        if stale:
            self.resets += 1
            c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        c.close()
        u.close()


assert os.name == "posix"  # SIGSTOP / SIGCONT


def quota_state(server: SpareRedis, store: Any, tenant_id: str) -> dict[str, Any]:
    """A tenant's quota keys as Redis holds them, read on a connection of their own: RPM entries,
    TPM entries, debits (sorted), TPM sum (``None`` when absent), leases. ``store``: the
    :class:`~gateway.quotas.stores.RedisQuotaStore` whose keys they are."""
    import redis

    rpm, tpm, debits, total, leases = store.keys(tenant_id)
    with redis.Redis(port=server.port) as r:
        value: Any = r.get(total)
        return {
            "rpm": r.zcard(rpm),
            "tpm": r.zcard(tpm),
            "debits": sorted(int(v) for v in r.hvals(debits)),
            "sum": None if value is None else int(value),
            "leases": r.zcard(leases),
        }


async def load_scripts(store: Any) -> None:
    """Every Lua script of ``store`` (a :class:`~gateway.quotas.stores.RedisQuotaStore`) loaded in
    its Redis, so that a test's first call of each meets no ``NOSCRIPT``."""
    from gateway.quotas.stores import load_script

    for name in ("begin", "tokens", "reserve", "settle", "renew", "cancel"):
        await store.client.script_load(load_script(name))


async def recovered(stage: Any, budget: float = 5.0) -> None:
    """Wait until the stage's background round has undone every failed call and sent every
    settle left over (its task ends then)."""
    deadline = time.monotonic() + budget

    def done() -> bool:
        task = stage._recoverer
        return not stage._uncertain and not stage._unsettled and (task is None or task.done())

    while not done():
        assert time.monotonic() < deadline, f"the background undo did not finish within {budget}s"
        await asyncio.sleep(0.02)
