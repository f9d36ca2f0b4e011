"""The least a Python relay on asyncio can add: a bench floor, not a gateway.

Each client connection gets its own keep-alive connection to the upstream; request and response
are framed by ``Content-Length`` alone (no chunked bodies, no header parsing beyond it, no
validation) and their bytes are copied through unchanged, on uvloop, in ``--workers`` processes
sharing the port with ``SO_REUSEPORT`` as kvgate's workers do. ``bench/gateway.py``'s
``python-floor`` scenario runs it: on a given machine, no Python gateway that reads a request
before forwarding it can add less at c=1.

    python bench/floor_relay.py --port 8090 --upstream 127.0.0.1:8081 --workers 2
"""

from __future__ import annotations

import os
import sys

# bench/ holds a tokenize.py: keep it from shadowing the standard library's (multiprocessing needs it)
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]

import argparse  # noqa: E402
import asyncio  # noqa: E402
import multiprocessing  # noqa: E402
import socket  # noqa: E402

import uvloop  # noqa: E402


def _framed(buf: bytearray) -> int:
    """Bytes of the first whole HTTP/1.1 message in ``buf`` (head + Content-Length body), or 0."""
    end = buf.find(b"\r\n\r\n")
    if end < 0:
        return 0
    length = 0
    for line in bytes(buf[:end]).split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
            break
    total = end + 4 + length
    return total if len(buf) >= total else 0


class Upstream(asyncio.Protocol):
    def __init__(self, client: Client) -> None:
        self.client = client
        self.buf = bytearray()

    def data_received(self, data: bytes) -> None:
        self.buf += data
        n = _framed(self.buf)
        if n:
            self.client.transport.write(bytes(self.buf[:n]))
            del self.buf[:n]

    def connection_lost(self, exc: Exception | None) -> None:
        self.client.transport.close()


class Client(asyncio.Protocol):
    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream_addr = upstream
        self.buf = bytearray()
        self.up: asyncio.Transport | None = None
        self.pending: list[bytes] = []

    def connection_made(self, transport) -> None:  # type: ignore[no-untyped-def]
        self.transport = transport
        loop = asyncio.get_running_loop()
        loop.create_task(self._connect(loop))

    async def _connect(self, loop: asyncio.AbstractEventLoop) -> None:
        tr, _ = await loop.create_connection(lambda: Upstream(self), *self.upstream_addr)
        tr.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.up = tr
        for msg in self.pending:
            tr.write(msg)
        self.pending.clear()

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while n := _framed(self.buf):
            msg = bytes(self.buf[:n])
            del self.buf[:n]
            if self.up is None:
                self.pending.append(msg)
            else:
                self.up.write(msg)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.up is not None:
            self.up.close()


def serve(port: int, upstream: tuple[str, int]) -> None:
    async def main() -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(("127.0.0.1", port))
        server = await asyncio.get_running_loop().create_server(lambda: Client(upstream), sock=sock, backlog=1024)
        await server.serve_forever()

    uvloop.run(main())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--upstream", required=True, help="HOST:PORT")
    ap.add_argument("--workers", type=int, default=2)
    a = ap.parse_args()
    host, _, p = a.upstream.rpartition(":")
    procs = [multiprocessing.Process(target=serve, args=(a.port, (host, int(p)))) for _ in range(a.workers)]
    for pr in procs:
        pr.start()
    for pr in procs:
        pr.join()


if __name__ == "__main__":
    main()
