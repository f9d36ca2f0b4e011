"""Authenticate from the headers before the body is read (docs/design.md step 1): a request without
a valid key is answered 401 without the gateway reading (or parsing) a byte of its body, however
large it claims to be or however slowly it arrives; with a valid key the body is read as before."""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Any

import orjson
import pytest

from gateway.app import create_app
from tests.gateway_harness import KEY_A, SECRETS, Gateway, chat, closed_port_url, settings_for, tenants, upstream
from tests.mock_engine import MockEngine

pytestmark = pytest.mark.timeout(60)

MISSING = (
    "You didn't provide an API key. You need to provide your API key in an Authorization "
    "header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
)


def _scope(headers: list[tuple[bytes, bytes]], path: str = "/v1/chat/completions") -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": headers,
        "client": ("127.0.0.1", 5555),
        "server": ("127.0.0.1", 8080),
    }


async def _call(app: Any, headers: list[tuple[bytes, bytes]], body: bytes | None) -> tuple[int, dict, list[str]]:
    """Run one request through the ASGI app. ``body`` None: a client that never sends its body
    (receive blocks). Returns ``(status, json body, the receive calls made)``."""
    calls: list[str] = []
    never = asyncio.Event()

    async def receive() -> dict[str, Any]:
        calls.append("receive")
        if body is None:
            await never.wait()
        return {"type": "http.request", "body": body or b"", "more_body": False}

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await asyncio.wait_for(app(_scope(headers), receive, send), 5)
    start = next(m for m in sent if m["type"] == "http.response.start")
    data = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], orjson.loads(data), calls


@pytest.fixture
def app():
    # the upstream is never reached: every request here is refused before forwarding
    return create_app(
        settings_for(
            [upstream("u1", api_url=closed_port_url() + "/v1", pool_urls=[closed_port_url() + "/server_info"])]
        ),
        tenants(),
        secrets=SECRETS,
    )


@pytest.mark.parametrize(
    "auth,message",
    [
        (None, MISSING),
        (b"Basic dXNlcjpwYXNz", MISSING),
        (b"Bearer", MISSING),
        (b"Bearer sk-wrong-secret", "Incorrect API key provided."),
    ],
)
def test_unauthenticated_huge_body_is_401_without_reading_it(app, auth, message):
    headers = [(b"content-type", b"application/json"), (b"content-length", b"8000000")]
    if auth is not None:
        headers.append((b"authorization", auth))
    status, body, calls = asyncio.run(_call(app, headers, None))
    assert status == 401
    assert body == {
        "error": {"message": message, "type": "authentication_error", "param": None, "code": "invalid_api_key"}
    }
    assert calls == []  # the app never asked for the body
    # a Content-Length above the limit is not even looked at before authentication (no 413)
    status, _, calls = asyncio.run(_call(app, headers[:1] + [(b"content-length", b"999999999999")], None))
    assert (status, calls) == (401, [])


def test_malformed_body_without_a_key_is_401_not_400(app):
    status, body, calls = asyncio.run(_call(app, [(b"content-length", b"1")], b"{"))
    assert (status, body["error"]["code"], calls) == (401, "invalid_api_key", [])


def test_authenticated_body_is_read_and_parsed(app):
    """Control: with a valid key the same malformed body is read (once) and refused as a 400,
    and a Content-Length above the limit is a 413 before any read."""
    auth = (b"authorization", f"Bearer {KEY_A}".encode())
    status, body, calls = asyncio.run(_call(app, [auth, (b"content-length", b"1")], b"{"))
    assert (status, body["error"]["code"], body["error"]["param"], calls) == (400, "invalid_request", None, ["receive"])
    status, body, calls = asyncio.run(_call(app, [auth, (b"content-length", b"999999999999")], None))
    assert (status, body["error"]["code"], calls) == (413, "request_too_large", [])


def _raw_request(port: int, head: bytes, body_prefix: bytes, timeout: float) -> bytes:
    """Send ``head`` and the first bytes of a body that is never finished; return what the server
    answered within ``timeout`` seconds (empty when nothing)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(head + body_prefix)
        s.settimeout(timeout)
        try:
            return s.recv(65536)
        except TimeoutError:
            return b""


def test_slow_body_over_http_gets_401_at_once_and_a_keyed_one_keeps_waiting():
    engine = MockEngine().start()
    g = Gateway(settings_for([upstream("u1", engine)])).start()
    try:
        port = int(g.url.rsplit(":", 1)[1])
        head = (
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: 8000000\r\n"
        )
        t0 = time.perf_counter()
        answer = _raw_request(port, head + b"\r\n", b'{"messages": [', timeout=5)
        assert answer.startswith(b"HTTP/1.1 401 "), answer[:200]
        assert time.perf_counter() - t0 < 5
        assert b'"code":"invalid_api_key"' in answer
        # control: a slow body with a valid key is being read, so no answer yet
        # (a Content-Length under the harness's 4096-byte limit, so it is not refused from the header)
        keyed = head.replace(b"8000000", b"4000") + f"authorization: Bearer {KEY_A}\r\n\r\n".encode()
        assert _raw_request(port, keyed, b'{"messages": [', timeout=1.0) == b""
        with g.client() as c:  # and the gateway still serves
            assert c.post("/v1/chat/completions", json=chat(max_tokens=3)).status_code == 200
        assert len(engine.state.requests) == 1
    finally:
        g.stop()
        engine.stop()


def test_a_401_waits_the_refusal_delay_and_a_valid_key_never_does():
    """``gateway.refusal_delay_seconds`` (0.6 here): every route's 401 is answered no sooner
    than that, with its exact body, and its ``x-kvgate-overhead-ms`` does not count the wait; a
    request with a valid key is answered well within it; 0 answers a 401 at once."""
    engine = MockEngine().start()
    slow = Gateway(settings_for([upstream("u1", engine)], gateway={"refusal_delay_seconds": 0.6})).start()
    fast = Gateway(settings_for([upstream("u1", engine)], gateway={"refusal_delay_seconds": 0})).start()
    try:
        wrong = {"error": {"message": "Incorrect API key provided.", "type": "authentication_error"}}
        with slow.client("sk-wrong") as bad, slow.client() as good:
            for method, path, body in (
                ("POST", "/v1/chat/completions", chat(max_tokens=3)),
                ("GET", "/v1/models", None),
                ("POST", "/tokenize", {"model": "kvgate-tiny", "prompt": "hi"}),
            ):
                t0 = time.perf_counter()
                r = bad.request(method, path, json=body)
                took = time.perf_counter() - t0
                assert r.status_code == 401 and took >= 0.6, (path, r.status_code, took)
                assert float(r.headers["x-kvgate-overhead-ms"]) < 300  # the gateway's work, not the wait
                e = r.json()["error"]
                assert {k: e[k] for k in ("message", "type")} == wrong["error"]
            t0 = time.perf_counter()
            assert good.post("/v1/chat/completions", json=chat(max_tokens=3)).status_code == 200
            assert time.perf_counter() - t0 < 0.5
        with fast.client("sk-wrong") as bad:
            t0 = time.perf_counter()
            assert bad.get("/v1/models").status_code == 401
            assert time.perf_counter() - t0 < 0.5
    finally:
        slow.stop()
        fast.stop()
        engine.stop()
