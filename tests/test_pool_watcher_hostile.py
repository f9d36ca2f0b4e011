"""The pool watcher against an engine whose pool endpoints misbehave, through the real gateway: an
answer later than ``pool.request_timeout_seconds``, a body trickled a byte at a time, a body of
8 MiB (valid JSON), a chunked body that never ends, JSON nested deeper than the parser's stack, on
``/server_info`` and on ``/v1/loads``; numbers no engine reports (fifty million data-parallel ranks
for one rank's pool, a pool of 10**30 tokens). Each time the poll ends within the timeout, having read at
most 1 MiB; the pool is unknown with the error named in ``/readyz``; a chat is refused 503
``pool_size_unknown`` (fail closed); the event loop keeps answering; and the pool is known again
at the first normal answer (docs/gateway.md, "Live pool limit")."""

from __future__ import annotations

import json
import socketserver
import threading
import time
from typing import Any

import httpx
import pytest

from gateway.ops.pool_watcher import MAX_POOL_BODY_BYTES
from tests.engine_pool_fixtures import sglang_server_info
from tests.gateway_harness import Gateway, chat, settings_for, upstream, wait_for
from tests.mock_engine import MockEngine

pytestmark = pytest.mark.timeout(60)

POOL = [4096]
#: floor(4096 / 1.25)
LIMIT = 3276
TIMEOUT = 0.5
LOADS = "/v1/loads?include=core,memory"
POOL_UNKNOWN = {
    "message": "The live KV pool size of the engines serving 'kvgate-tiny' is unknown or stale; refusing "
    "rather than risking a silent rejection. Retry shortly.",
    "type": "server_error",
    "param": None,
    "code": "pool_size_unknown",
}


class HostileEngine(socketserver.ThreadingTCPServer):
    """Raw HTTP/1.1 on loopback: ``/server_info`` answers SGLang's report, ``/v1/loads`` 404,
    except the path ``hostile_path``, which answers as ``mode`` says. ``sent`` records the body
    bytes each hostile answer got out before the client went away (or it ended)."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        self.mode = "ok"
        self.hostile_path = "/server_info"
        self.sent: list[int] = []
        self.thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def __enter__(self) -> HostileEngine:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.mode = "ok"
        self.shutdown()
        self.server_close()


def _head(status: str, extra: str = "") -> bytes:
    return f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\nconnection: close\r\n{extra}\r\n".encode()


def _ok(body: dict[str, Any]) -> bytes:
    data = json.dumps(body).encode()
    return _head("200 OK", f"content-length: {len(data)}\r\n") + data


class _Handler(socketserver.BaseRequestHandler):
    server: HostileEngine

    def handle(self) -> None:
        head = b""
        while b"\r\n\r\n" not in head:
            got = self.request.recv(4096)
            if not got:
                return
            head += got
        path = head.split(b" ", 2)[1].decode().split("?")[0]
        mode = self.server.mode if path == self.server.hostile_path else "ok"
        if mode == "ok":
            if path == "/server_info":
                self.request.sendall(_ok(sglang_server_info(POOL)))
            else:
                self.request.sendall(_head("404 Not Found", "content-length: 2\r\n") + b"{}")
            return
        self.server.sent.append(0)
        try:
            getattr(self, "_" + mode)()
        except OSError:  # the poll gave up and closed the connection
            pass

    def _count(self, data: bytes) -> None:
        self.request.sendall(data)
        self.server.sent[-1] += len(data)

    def _slow(self) -> None:  # nothing for 4 x the timeout, then a good answer
        time.sleep(4 * TIMEOUT)
        self._count(_ok(sglang_server_info(POOL)))

    def _trickle(self) -> None:  # a good answer, one byte per 50 ms: each wait is within the timeout
        data = json.dumps(sglang_server_info(POOL)).encode()
        self.request.sendall(_head("200 OK", f"content-length: {len(data)}\r\n"))
        for i in range(len(data)):
            self._count(data[i : i + 1])
            time.sleep(0.05)

    def _huge(self) -> None:  # 8 MiB of valid JSON that holds a good report
        pad = "x" * (8 << 20)
        data = json.dumps({**sglang_server_info(POOL), "pad": pad, "loads": []}).encode()
        self.request.sendall(_head("200 OK", f"content-length: {len(data)}\r\n"))
        self._count(data)

    def _endless(self) -> None:  # chunked, 64 KiB chunks of one JSON string, never terminated
        self.request.sendall(_head("200 OK", "transfer-encoding: chunked\r\n"))
        chunk = b"10000\r\n" + b"x" * 0x10000 + b"\r\n"
        self._count(b'6\r\n{"a":"\r\n')
        while self.server.sent[-1] < (256 << 20):
            self._count(chunk)

    def _nested(self) -> None:  # 200 KB: arrays nested 100,000 deep
        data = b"[" * 100_000 + b"]" * 100_000
        self._count(_head("200 OK", f"content-length: {len(data)}\r\n") + data)

    def _many_ranks(self) -> None:  # one rank's pool, and fifty million data-parallel ranks claimed
        self._count(_ok({**sglang_server_info(POOL), "dp_size": 50_000_000}))

    def _pool_1e30(self) -> None:  # a pool no engine has: 10**30 tokens, top level and rank alike
        info = sglang_server_info([10**30])
        self._count(_ok({**info, "max_total_num_tokens": 10**30}))


CASES = {
    "slow": f" answered nothing whole within {TIMEOUT:g} s",
    "trickle": f" answered nothing whole within {TIMEOUT:g} s",
    "huge": f" answered more than {MAX_POOL_BODY_BYTES} bytes",
    "endless": f" answered more than {MAX_POOL_BODY_BYTES} bytes",
    "nested": " answered non-JSON",
    # before the bound, the first built a list of every claimed rank on the event loop (10**9 ranks
    # took the gateway's memory until the kernel killed it) and the second admitted against 10**30
    # tokens while /readyz answered 500 (orjson refuses ints above 64 bits)
    "many_ranks": ": no max_total_num_tokens for data-parallel rank 1 of 50000000 (internal_states)",
    "pool_1e30": ": server_info has no max_total_num_tokens (a positive integer up to 2**40)",
}


def _status(c: httpx.Client) -> dict[str, Any]:
    return c.get("/readyz").json()["upstreams"][0]


@pytest.mark.parametrize(
    ("path", "mode"),
    [("/server_info", m) for m in CASES] + [("/v1/loads", "endless"), ("/v1/loads", "slow")],
)
def test_a_hostile_pool_endpoint_is_bounded_fails_closed_and_recovers(path: str, mode: str) -> None:
    engine = MockEngine().start()
    with HostileEngine() as hostile:
        hostile.hostile_path = path
        info = hostile.url + "/server_info"
        up = upstream("u1", engine, pool_urls=[info])
        g = Gateway(settings_for([up], pool={"request_timeout_seconds": TIMEOUT, "poll_interval_seconds": 0.2}))
        g.start()
        try:
            with g.client() as c:
                assert wait_for(lambda: _status(c)["known"], 5.0)  # a normal engine first
                hostile.mode = mode
                url = info if path == "/server_info" else hostile.url + LOADS
                want = f"{url}{CASES[mode]}"
                t0 = time.monotonic()
                assert wait_for(lambda: _status(c)["error"] == want, 10.0), _status(c)
                # the first hostile poll started at most one interval after the switch and ended within the timeout
                assert time.monotonic() - t0 < 0.2 + TIMEOUT + 2.0
                r = c.post("/v1/chat/completions", json=chat(max_tokens=5))
                assert (r.status_code, r.json(), r.headers["retry-after"]) == (503, {"error": POOL_UNKNOWN}, "1")
                ready = c.get("/readyz")
                assert ready.status_code == 503 and ready.json()["upstreams"][0]["limit_tokens"] is None
                # the loop keeps answering while the watcher keeps meeting the hostile engine
                latencies = []
                for _ in range(5):
                    t = time.monotonic()
                    assert c.get("/healthz").status_code == 200
                    latencies.append(time.monotonic() - t)
                    time.sleep(0.1)
                assert max(latencies) < 1.0, latencies
                # the bound, plus what loopback's socket buffers took in (autotuned: up to about 16 MiB
                # here) before the poll's close reached the engine; unbounded, the poll read all 256 MiB
                assert hostile.sent and max(hostile.sent) < 32 << 20, hostile.sent
                hostile.mode = "ok"
                assert wait_for(lambda: _status(c)["known"], 5.0), _status(c)
                assert _status(c)["limit_tokens"] == LIMIT and _status(c)["error"] is None
                assert c.post("/v1/chat/completions", json=chat(max_tokens=5)).status_code == 200
        finally:
            g.stop()
            engine.stop()
