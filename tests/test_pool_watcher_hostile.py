"""The pool watcher against an engine whose pool endpoints misbehave, through the real gateway: an
answer later than ``pool.request_timeout_seconds``, a body trickled a byte at a time, a body of
8 MiB (valid JSON), a chunked body that never ends, JSON nested deeper than the parser's stack, on
``/server_info`` and on ``/v1/loads``; numbers no engine reports (fifty million data-parallel ranks
for one rank's pool, a pool of 10**30 tokens). Each time the poll ends within the timeout, having read at
most 1 MiB; the pool is unknown with the error named in ``/readyz``; a chat is refused 503
``pool_size_unknown`` (fail closed); the event loop keeps answering; and the pool is known again
at the first normal answer (docs/gateway.md, "Live pool limit")."""

from __future__ import annotations

import contextlib
import json
import logging
import socketserver
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from gateway.ops.pool_watcher import MAX_POOL_BODY_BYTES
from tests.engine_pool_fixtures import sglang_server_info, vllm_models
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
    except the path ``hostile_path``, which answers as ``mode`` says (``ok`` until set; the other
    arguments: the attributes of the same names). ``sent`` records the body bytes each hostile
    answer got out before the client went away (or it ended)."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, mode: str = "ok", delay_seconds: float = 0.0, flap_pools: list[int] | None = None) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        self.mode = mode
        self.hostile_path = "/server_info"
        self.sent: list[int] = []
        #: mode ``raw``: the whole HTTP answer; ``late``: the delay before a good one; ``flap``: the
        #: pools answered in turn (``answers`` counts them)
        self.raw = b""
        self.delay_seconds = delay_seconds
        self.flap_pools: list[int] = flap_pools or []
        self.answers = 0
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
            elif path == "/v1/models":
                self.request.sendall(_ok(vllm_models(POOL[0])))
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

    def _raw(self) -> None:  # the test's own bytes
        self._count(self.server.raw)

    def _stall(self) -> None:  # 200 and half a good body, then nothing for 4 x the timeout
        data = json.dumps(sglang_server_info(POOL)).encode()
        self._count(_head("200 OK", f"content-length: {len(data)}\r\n") + data[: len(data) // 2])
        time.sleep(4 * TIMEOUT)

    def _late(self) -> None:  # a good answer after delay_seconds
        time.sleep(self.server.delay_seconds)
        self._count(_ok(sglang_server_info(POOL)))

    def _flap(self) -> None:  # each answer the next of flap_pools: engines of unequal pools behind one address
        pool = self.server.flap_pools[self.server.answers % len(self.server.flap_pools)]
        self.server.answers += 1
        self._count(_ok(sglang_server_info([pool])))


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


@contextlib.contextmanager
def _watched(
    source: str = "sglang", hostile: HostileEngine | None = None, **pool: float
) -> Iterator[tuple[HostileEngine, httpx.Client]]:
    """The gateway on a mock engine (upstream ``u1``) whose pool is read from ``hostile`` (a new
    :class:`HostileEngine` by default; started here) at ``/server_info`` (``source`` ``sglang``) or
    ``/v1/models`` (``vllm``), every 0.2 s with a ``TIMEOUT`` timeout (``pool``: other pool
    settings, or these). Yields the pool engine (its ``hostile_path`` that URL's path) and a client
    of the gateway; stops the gateway and both engines on the way out."""
    engine = MockEngine().start()
    with hostile or HostileEngine() as served:
        path = "/v1/models" if source == "vllm" else "/server_info"
        served.hostile_path = path
        up = upstream("u1", engine, pool_urls=[served.url + path], pool_source=source)
        g = Gateway(settings_for([up], pool={"request_timeout_seconds": TIMEOUT, "poll_interval_seconds": 0.2, **pool}))
        g.start()
        try:
            with g.client() as c:
                yield served, c
        finally:
            g.stop()
            engine.stop()


@pytest.mark.parametrize(
    ("path", "mode"),
    [("/server_info", m) for m in CASES] + [("/v1/loads", "endless"), ("/v1/loads", "slow")],
)
def test_a_hostile_pool_endpoint_is_bounded_fails_closed_and_recovers(path: str, mode: str) -> None:
    with _watched() as (hostile, c):
        hostile.hostile_path = path
        info = hostile.url + "/server_info"
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


# ---------------------------------------------------------------- what the engine reports
#
# The attacks below are the engine's answer itself (docs/gateway.md, "Live pool limit"): values no
# engine reports, shapes the parser never foresaw, answers slower than the staleness bound, a pool
# that differs from one poll to the next, a restart with a smaller pool, a redirect, a name that
# does not resolve. Each through the real gateway with the mock engine serving the API.

#: a prompt of 3 tokens ("Say hello.") and 1,000 to generate: fits a pool of 4,096 (limit 3,276),
#: not one of 1,024 (limit floor(1024 / 1.25) = 819)
COMPLETION = {"model": "kvgate-tiny", "prompt": "Say hello.", "max_tokens": 1000}
OVER_819 = {
    "message": "This model's maximum context length is 819 tokens. However, you requested 1003 tokens "
    "(3 in the prompt, 1000 in the completion). Please reduce the length of the prompt or completion.",
    "type": "invalid_request_error",
    "param": "prompt",
    "code": "context_length_exceeded",
}
NO_POOL = ": server_info has no max_total_num_tokens (a positive integer up to 2**40)"


def _answer(status: str, body: bytes, content_type: str = "application/json", extra: str = "") -> bytes:
    head = f"HTTP/1.1 {status}\r\ncontent-type: {content_type}\r\ncontent-length: {len(body)}\r\n"
    return (head + f"connection: close\r\n{extra}\r\n").encode() + body


def _gauges(c: httpx.Client) -> tuple[str, str]:
    lines = c.get("/metrics").text.splitlines()
    pool = next(x for x in lines if x.startswith('kvgate_pool_tokens{upstream="u1"}'))
    limit = next(x for x in lines if x.startswith('kvgate_effective_limit_tokens{upstream="u1"}'))
    return pool.split()[-1], limit.split()[-1]


#: (source, what the pool URL answers (a whole HTTP answer; None: mode ``stall``), the error after the URL)
VALUES: dict[str, tuple[str, bytes | None, str]] = {
    "negative": ("sglang", _answer("200 OK", b'{"max_total_num_tokens": -4096}'), NO_POOL),
    "zero": ("sglang", _answer("200 OK", b'{"max_total_num_tokens": 0}'), NO_POOL),
    "2**63": ("sglang", _answer("200 OK", b'{"max_total_num_tokens": 9223372036854775808}'), NO_POOL),
    "1e308": ("sglang", _answer("200 OK", b'{"max_total_num_tokens": 1e308}'), NO_POOL),
    "a fraction": ("sglang", _answer("200 OK", b'{"max_total_num_tokens": 4096.5}'), NO_POOL),
    "true": ("sglang", _answer("200 OK", b'{"max_total_num_tokens": true}'), NO_POOL),
    "NaN": ("sglang", _answer("200 OK", b'{"max_total_num_tokens": NaN}'), NO_POOL),
    "missing": ("sglang", _answer("200 OK", b'{"context_length": 8192, "status": "ready"}'), NO_POOL),
    "dp_size 0": (
        "sglang",
        _answer("200 OK", b'{"max_total_num_tokens": 4096, "dp_size": 0}'),
        ": server_info has no usable dp_size (a positive integer up to 2**40)",
    ),
    "an array": ("sglang", _answer("200 OK", b"[4096]"), ": server_info is not a JSON object"),
    "HTML with 200": ("sglang", _answer("200 OK", b"<html><body>ok</body></html>", "text/html"), " answered non-JSON"),
    "a 200 that stops mid-body": ("sglang", None, f" answered nothing whole within {TIMEOUT:g} s"),
    # vLLM's /v1/models: the error names the node's URL, as SGLang's does (before: only the path)
    "vllm negative": (
        "vllm",
        _answer("200 OK", b'{"data": [{"id": "m", "max_model_len": -1}]}'),
        ": /v1/models reports no max_model_len",
    ),
    "vllm 2**63": (
        "vllm",
        _answer("200 OK", b'{"data": [{"id": "m", "max_model_len": 9223372036854775808}]}'),
        ": /v1/models reports no max_model_len",
    ),
}


@pytest.mark.parametrize("case", list(VALUES))
def test_a_pool_no_engine_reports_fails_closed_and_recovers(case: str) -> None:
    source, raw, error = VALUES[case]
    with _watched(source) as (hostile, c):
        assert wait_for(lambda: _status(c)["known"], 5.0)
        url = hostile.url + hostile.hostile_path
        hostile.raw, hostile.mode = raw or b"", "stall" if raw is None else "raw"
        assert wait_for(lambda: _status(c)["error"] == url + error, 5.0), _status(c)
        r = c.post("/v1/chat/completions", json=chat(max_tokens=5))
        assert (r.status_code, r.json()) == (503, {"error": POOL_UNKNOWN})
        assert _gauges(c) == ("-1.0", "-1.0")
        hostile.mode = "ok"
        assert wait_for(lambda: _status(c)["known"], 5.0), _status(c)
        assert (_status(c)["limit_tokens"], _gauges(c)) == (LIMIT, ("4096.0", "3276.0"))


@pytest.mark.parametrize("source", ["sglang", "vllm"])
def test_a_report_the_parser_trips_on_is_a_failed_read_of_its_url(source: str, monkeypatch) -> None:
    # a parser that raises what nobody foresaw (a number where it iterated a list raised TypeError
    # before config/engine_pool.py checked the type). Before: it escaped the poll, the watcher's
    # loop caught it ("poll failed: TypeError", no URL) and never told the gauges, so /metrics
    # kept the last pool (4096) while the gate refused every request
    import gateway.ops.pool_watcher as pool_watcher

    with _watched(source) as (hostile, c):
        assert wait_for(lambda: _status(c)["known"], 5.0)

        def trips(*args: object) -> None:
            raise TypeError("'int' object is not iterable")

        monkeypatch.setattr(pool_watcher, "sglang_pool" if source == "sglang" else "vllm_max_model_len", trips)
        want = f"{hostile.url}{hostile.hostile_path}: unreadable pool report (TypeError)"
        assert wait_for(lambda: _status(c)["error"] is not None, 5.0)
        assert _status(c)["error"] == want
        assert _gauges(c) == ("-1.0", "-1.0")
        r = c.post("/v1/chat/completions", json=chat(max_tokens=5))
        assert (r.status_code, r.json()) == (503, {"error": POOL_UNKNOWN})


@pytest.mark.parametrize(
    ("source", "body", "error"),
    [
        # dp_size 1: the top-level pool is rank 0's and the whole node's; the stray field is ignored
        ("sglang", b'{"max_total_num_tokens": 4096, "internal_states": 5}', None),
        ("vllm", b'{"object": "list", "data": 5}', "/v1/models reports no max_model_len"),
    ],
)
def test_a_list_field_of_another_type_is_read_as_absent(source: str, body: bytes, error: str | None) -> None:
    with _watched(source) as (hostile, c):
        assert wait_for(lambda: _status(c)["known"], 5.0)
        hostile.raw, hostile.mode = _answer("200 OK", body), "raw"
        if error is None:
            time.sleep(0.6)  # polls of the stray field's report
            assert (_status(c)["known"], _status(c)["limit_tokens"]) == (True, LIMIT)
            return
        assert wait_for(lambda: _status(c)["error"] is not None, 5.0)
        assert _status(c)["error"] == f"{hostile.url}{hostile.hostile_path}: {error}"
        assert _gauges(c) == ("-1.0", "-1.0")


def test_a_reading_is_as_old_as_its_slowest_answer() -> None:
    # the pool answers 0.5 s after it is asked (within the 2 s timeout). The reading's age counts
    # from the poll's start, so a reading is never younger than what it holds. Before: from the
    # poll's end, and /readyz showed ages near 0 right after each poll
    late = HostileEngine(mode="late", delay_seconds=0.5)
    with _watched(hostile=late, request_timeout_seconds=2.0) as (_, c):
        assert wait_for(lambda: _status(c)["known"], 5.0)
        ages: list[float] = []
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            ages.append(_status(c)["age_seconds"])
            time.sleep(0.02)
        assert min(ages) >= 0.5, ages
        assert _status(c)["limit_tokens"] == LIMIT


def test_an_answer_slower_than_the_staleness_bound_is_never_trusted() -> None:
    # the pool answers 1.2 s after it is asked: within the 3 s timeout, past the 1 s staleness
    # bound. Before: each late reading counted as fresh when it arrived and was admitted against
    # for the next second (known about two thirds of the time, with no error)
    late = HostileEngine(mode="late", delay_seconds=1.2)
    with _watched(hostile=late, max_staleness_seconds=1.0, request_timeout_seconds=3.0) as (hostile, c):
        want = "reading the pool took longer than pool.max_staleness_seconds (1 s)"
        assert wait_for(lambda: _status(c)["error"] == want, 6.0), _status(c)
        seen = []
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            seen.append((_status(c)["known"], c.post("/v1/chat/completions", json=chat(max_tokens=5)).status_code))
            time.sleep(0.05)
        assert set(seen) == {(False, 503)}, seen
        assert _gauges(c) == ("-1.0", "-1.0")
        hostile.delay_seconds = 0.0
        assert wait_for(lambda: _status(c)["known"], 5.0), _status(c)
        assert _status(c)["limit_tokens"] == LIMIT


def test_a_pool_that_flaps_is_gated_on_its_smallest_recent_reading(caplog: pytest.LogCaptureFixture) -> None:
    # two engines behind one pool address (a load balancer) answer the polls in turn: 4,096 and
    # 1,024 tokens. A request may land on either, so the gate holds the smallest reading of the
    # last max_staleness_seconds. Before: the newest reading, and a request of 1,003 tokens was
    # admitted after each 4,096 answer (to be forwarded, perhaps, to the 1,024 engine)
    caplog.set_level(logging.WARNING, logger="kvgate.pool")
    flap = HostileEngine(mode="flap", flap_pools=[4096, 1024])
    with _watched(hostile=flap, max_staleness_seconds=2.0) as (hostile, c):
        assert wait_for(lambda: hostile.answers >= 3, 5.0)
        seen = []
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            r = c.post("/v1/completions", json=COMPLETION)
            seen.append((_status(c)["limit_tokens"], r.status_code, r.json()))
            time.sleep(0.05)
        assert {(lim, code) for lim, code, _ in seen} == {(819, 400)}, seen
        assert all(body == {"error": OVER_819} for _, _, body in seen)
        assert _gauges(c) == ("1024.0", "819.0")
        logged = {r.getMessage() for r in caplog.records}
        hold = "; the gate holds the smallest reading of the last 2 s: 1024 tokens, limit 819"
        assert "pool of upstream u1 read 1024 tokens (last read: 4096)" + hold in logged, logged
        assert "pool of upstream u1 read 4096 tokens (last read: 1024)" + hold in logged, logged
        # the flapping stops at 4,096: the last 1,024 reading is held until it is 2 s old
        hostile.flap_pools = [4096]
        switched = time.monotonic()
        while time.monotonic() < switched + 1.2:
            assert _status(c)["limit_tokens"] == 819
            time.sleep(0.05)
        assert wait_for(lambda: _status(c)["limit_tokens"] == LIMIT, 3.0), _status(c)
        assert c.post("/v1/completions", json=COMPLETION).status_code == 200


def test_the_incident_a_restart_with_a_smaller_pool(caplog: pytest.LogCaptureFixture) -> None:
    # the engine goes away (its pool endpoint closes every connection unanswered) and comes back
    # with a quarter of its pool: unknown meanwhile (503), the new limit at the first answer (no
    # reading from before the restart is held), and the change logged against the old pool.
    # Before: the same gate, but the new pool was not logged (the failures had dropped the old one)
    caplog.set_level(logging.WARNING, logger="kvgate.pool")
    with _watched() as (hostile, c):
        assert wait_for(lambda: _status(c)["known"], 5.0)
        assert c.post("/v1/completions", json=COMPLETION).status_code == 200
        hostile.raw, hostile.mode = b"", "raw"
        want = f"{hostile.url}/server_info unreachable (RemoteProtocolError)"
        assert wait_for(lambda: _status(c)["error"] == want, 5.0), _status(c)
        r = c.post("/v1/completions", json=COMPLETION)
        assert (r.status_code, r.json()) == (503, {"error": POOL_UNKNOWN})
        hostile.mode, hostile.flap_pools = "flap", [1024]
        assert wait_for(lambda: _status(c)["known"], 5.0), _status(c)
        assert _status(c)["limit_tokens"] == 819
        r = c.post("/v1/completions", json=COMPLETION)
        assert (r.status_code, r.json()) == (400, {"error": OVER_819})
        logged = {r.getMessage() for r in caplog.records}
        want_log = (
            "pool of upstream u1 read 1024 tokens (last read: 4096); the gate holds the smallest reading "
            "of the last 5 s: 1024 tokens, limit 819"
        )
        assert want_log in logged, logged


def test_a_redirect_is_not_followed() -> None:
    # the pool URL answers 302 to another host that serves a good pool: a pool read elsewhere is
    # not this engine's, so the answer is a failed read and the other host is never asked
    elsewhere = MockEngine().start()
    try:
        with _watched() as (hostile, c):
            assert wait_for(lambda: _status(c)["known"], 5.0)
            location = f"location: {elsewhere.info_url}\r\n"
            hostile.raw, hostile.mode = _answer("302 Found", b"", extra=location), "raw"
            want = f"{hostile.url}/server_info answered 302"
            assert wait_for(lambda: _status(c)["error"] == want, 5.0), _status(c)
            r = c.post("/v1/chat/completions", json=chat(max_tokens=5))
            assert (r.status_code, r.json()) == (503, {"error": POOL_UNKNOWN})
            assert elsewhere.state.info_hits == 0
    finally:
        elsewhere.stop()


def test_a_pool_host_that_does_not_resolve_fails_closed() -> None:
    # .invalid never resolves (RFC 6761)
    engine = MockEngine().start()
    url = "http://kvgate-pool.invalid/server_info"
    g = Gateway(settings_for([upstream("u1", engine, pool_urls=[url])], pool={"request_timeout_seconds": 2.0}))
    g.start()
    try:
        with g.client() as c:
            assert _status(c)["error"] == f"{url} unreachable (ConnectError)"
            r = c.post("/v1/chat/completions", json=chat(max_tokens=5))
            assert (r.status_code, r.json()) == (503, {"error": POOL_UNKNOWN})
            assert c.get("/readyz").status_code == 503
    finally:
        g.stop()
        engine.stop()
