"""A client that leaves before its request is sent upstream is counted and logged, and charged
nothing: one that leaves while its body arrives (admission's ``ClientGone``, chat and
``/tokenize``) gets status 499 in ``kvgate_requests_total``, a client disconnect and one
``kvgate.access`` line with ``client_disconnected``; one that leaves while admission waits on
the quota store is not forwarded, even when a pooled upstream connection is idle (docs/quotas.md:
"the client left while the gateway was still connecting" is charged 0). Served by the gateway's
own server layer, as ``kvgate serve`` serves. A body too slow, which that server layer answers
408 and closes, is recorded as that 408, not as a client that left. One that leaves after its
request reached the engine has the upstream named in its access line."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import pytest

import gateway.admission.admit as admit_module
from tests.gateway_harness import KEY_A, Gateway, chat, settings_for, tenants, upstream, wait_for
from tests.mock_engine import gateway_id
from tests.test_gateway_pipeline import LedgerQuotas, access  # noqa: F401  (the access fixture)

pytestmark = pytest.mark.timeout(60)


class SlowReserveQuotas(LedgerQuotas):
    """:class:`LedgerQuotas` whose token reservation (admission's second quota round trip, after
    the body is read) takes ``delay`` seconds for the request ids in ``slow``."""

    def __init__(self, slow: set[str], delay: float = 0.5) -> None:
        super().__init__()
        self.slow, self.delay = slow, delay

    async def reserve_tokens(self, tenant, lease, tokens, *, also=None):
        if lease.request_id in self.slow:
            await asyncio.sleep(self.delay)
        await super().reserve_tokens(tenant, lease, tokens, also=also)


def _head(host: str, path: str, rid: str, declared: int) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nhost: {host}\r\nauthorization: Bearer {KEY_A}\r\n"
        f"content-type: application/json\r\nx-request-id: {rid}\r\ncontent-length: {declared}\r\n\r\n"
    ).encode()


def _send_and_leave(g: Gateway, path: str, rid: str, body: bytes, declared: int, linger: float) -> None:
    """Write a request whose ``Content-Length`` is ``declared`` and ``body`` (all or part of it),
    wait ``linger`` seconds, then close the connection without reading an answer."""
    host, port = g.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as s:
        s.sendall(_head(host, path, rid, declared) + body)
        time.sleep(linger)


def _count_authentications(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Each tenant id admission authenticates a request as (``authenticate``, from the headers)."""
    real, seen = admit_module.authenticate, []

    def counted(authorization, registry):
        tenant = real(authorization, registry)
        seen.append(tenant.id)
        return tenant

    monkeypatch.setattr(admit_module, "authenticate", counted)
    return seen


def _metric(g: Gateway, line_start: str) -> list[str]:
    with g.client() as c:
        text = c.get("/metrics").text
    return [line for line in text.splitlines() if line.startswith(line_start)]


def _gone_line(rid: str, route: str) -> dict:
    return {"request_id": rid, "tenant": "tenant-a", "route": route, "status": 499, "client_disconnected": True}


@pytest.mark.parametrize("edge", [True, False], ids=["edge", "uvicorn"])
@pytest.mark.parametrize(("path", "route"), [("/v1/chat/completions", "chat"), ("/tokenize", "tokenize")])
def test_client_leaving_during_the_body_is_counted_and_logged(engine, access, monkeypatch, path, route, edge):  # noqa: F811
    """Before the fix the handler answered a bare 499: the lease was settled 0, but no status
    499, no client disconnect, no access line. The tenant is the one admission authenticated,
    carried by ``ClientGone``: the key is checked once (a chat request's was checked again when
    its client left, so twice). Under stock uvicorn too."""
    authenticated = _count_authentications(monkeypatch)
    q = LedgerQuotas()
    g = Gateway(settings_for([upstream("u1", engine)]), tenants(), quotas=q, edge=edge).start()
    try:
        body = json.dumps(chat(max_tokens=5)).encode()
        _send_and_leave(g, path, "half", body[:10], len(body), 0.1)
        assert wait_for(lambda: len(access("half")) == 1, 3)
        requests = _metric(g, "kvgate_requests_total{")
        disconnects = _metric(g, "kvgate_client_disconnects_total{")
    finally:
        g.stop()
    assert authenticated == ["tenant-a"]
    assert q.settled == {"half": [0]}  # the RPM entry is spent (begun), no token charged
    assert q.reserved == {}
    assert engine.state.requests == []
    assert requests == [f'kvgate_requests_total{{route="{route}",status="499",tenant="tenant-a"}} 1.0']
    assert disconnects == [f'kvgate_client_disconnects_total{{route="{route}"}} 1.0']
    line = access("half")[0]
    assert line.pop("overhead_ms") >= 0
    assert line == _gone_line("half", route)


def _chunked(host: str, path: str, rid: str, body: bytes, chunk_bytes: int) -> tuple[bytes, bytes]:
    """The head of a request whose ``body`` goes in chunks of ``chunk_bytes``, and its chunks
    (unfinished: no last chunk)."""
    head = (
        f"POST {path} HTTP/1.1\r\nhost: {host}\r\nauthorization: Bearer {KEY_A}\r\n"
        f"content-type: application/json\r\nx-request-id: {rid}\r\ntransfer-encoding: chunked\r\n\r\n"
    ).encode()
    pieces = [body[i : i + chunk_bytes] for i in range(0, len(body), chunk_bytes)]
    return head, b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces)


#: the server layer's own refusals of a body the app is reading: the gateway settings, what is sent
#: (``slow``: a tenth of the body, then nothing; ``framing``: 1,000 bytes in 100-byte chunks, 1,060
#: bytes with their framing), and what the client reads
SERVER_REFUSALS = {
    "slow": (
        {"body_timeout_seconds": 0.5},
        408,
        b"HTTP/1.1 408 Request Timeout",
        "request_timeout",
        "The request body did not arrive within 0.5 seconds.",
    ),
    "framing": (
        {"max_body_bytes": 1024},
        413,
        b"HTTP/1.1 413 Content Too Large",
        "request_too_large",
        "The request body is larger than 1024 bytes (chunk framing included).",
    ),
}


@pytest.mark.parametrize("kind", list(SERVER_REFUSALS))
@pytest.mark.parametrize(("path", "route"), [("/v1/chat/completions", "chat"), ("/tokenize", "tokenize")])
def test_a_body_the_server_layer_refused_is_recorded_as_the_answer_the_client_got(engine, access, path, route, kind):  # noqa: F811
    """The gateway's server layer answers a body not complete within ``body_timeout_seconds``
    (408), or a chunked one past ``max_body_bytes`` with its framing (413), and closes the
    connection, so admission's read sees a disconnect. Before the fix that was recorded as a
    client that left: status 499, a client disconnect, ``client_disconnected`` in the access line,
    though the client had read the 408 or 413. Now as that answer, under its tenant."""
    gateway, status, status_line, code, message = SERVER_REFUSALS[kind]
    q = LedgerQuotas()
    g = Gateway(settings_for([upstream("u1", engine)], gateway=gateway), tenants(), quotas=q, edge=True).start()
    host, port = g.url.removeprefix("http://").split(":")
    body = json.dumps(chat(max_tokens=5, content="x" * 1000)).encode()
    if kind == "slow":
        parts = (_head(host, path, kind, len(body)), body[:100])
    else:  # the chunks in a read of their own: the edge counts a read's framing with the head's apart
        parts = _chunked(host, path, kind, body[:1000], 100)
    try:
        with socket.create_connection((host, int(port)), timeout=10) as s:
            for part in parts:
                s.sendall(part)
                time.sleep(0.05)
            answer = b""
            while chunk := s.recv(65536):
                answer += chunk
        assert wait_for(lambda: len(access(kind)) == 1, 3)
        requests = _metric(g, "kvgate_requests_total{")
        disconnects = _metric(g, "kvgate_client_disconnects_total{")
        rejections = _metric(g, "kvgate_rejections_total{")
    finally:
        g.stop()
    head, _, error = answer.partition(b"\r\n\r\n")
    assert head.split(b"\r\n")[0] == status_line
    error_type = "invalid_request_error"
    assert json.loads(error) == {"error": {"message": message, "type": error_type, "param": None, "code": code}}
    assert q.settled == {kind: [0]}  # the RPM entry is spent (begun), no token charged
    assert q.reserved == {}
    assert engine.state.requests == []
    assert requests == [f'kvgate_requests_total{{route="{route}",status="{status}",tenant="tenant-a"}} 1.0']
    assert disconnects == []
    assert rejections == [f'kvgate_rejections_total{{reason="{code}"}} 1.0']
    line = access(kind)[0]
    assert line.pop("overhead_ms") >= 0
    assert line == {"request_id": kind, "tenant": "tenant-a", "route": route, "status": status, "error_code": code}


@pytest.mark.parametrize("edge", [True, False], ids=["edge", "uvicorn"])
def test_client_leaving_during_admission_is_not_forwarded_on_a_warm_pool(engine, access, edge):  # noqa: F811
    """The client sends its whole request, then leaves while admission waits 0.5 s on the quota
    store. Before the fix the relay took an idle pooled connection without a loop turn, sent the
    request (the engine got it: prefill for nobody) and the settle charged the prompt (11); on a
    cold pool the same request was settled 0. Now it is never sent, whatever the pool holds
    (served by the gateway's server layer, and by uvicorn's own protocol)."""
    q = SlowReserveQuotas({"left"})
    g = Gateway(settings_for([upstream("u1", engine)]), tenants(), quotas=q, edge=edge).start()
    try:
        with g.client() as c:  # warm the pool: one connection to the engine stays idle in it
            r = c.post("/v1/chat/completions", json=chat(max_tokens=5), headers={"x-request-id": "warm"})
            assert r.status_code == 200
        assert wait_for(lambda: len(access("warm")) == 1, 3)
        body = json.dumps(chat(max_tokens=5)).encode()
        _send_and_leave(g, "/v1/chat/completions", "left", body, len(body), 0.1)
        assert wait_for(lambda: len(access("left")) == 1, 3)
        time.sleep(0.2)  # anything sent late would reach the engine by now
        requests = _metric(g, "kvgate_requests_total{")
        disconnects = _metric(g, "kvgate_client_disconnects_total{")
        in_flight = [u.in_flight for u in g.gw.upstreams.all]
    finally:
        g.stop()
    warm = gateway_id(access("warm")[0]["upstream_request_id"], "warm")
    assert engine.state.request_ids() == [warm]  # "left" never sent
    assert q.settled == {"warm": [11 + 4], "left": [0]}  # the engine reports 4 completion tokens
    assert q.reserved == {"warm": 11 + 5, "left": 11 + 5}
    assert in_flight == [0]
    assert sorted(requests) == [
        'kvgate_requests_total{route="chat",status="200",tenant="tenant-a"} 1.0',
        'kvgate_requests_total{route="chat",status="499",tenant="tenant-a"} 1.0',
    ]
    assert disconnects == ['kvgate_client_disconnects_total{route="chat"} 1.0']
    line = access("left")[0]
    assert line.pop("overhead_ms") >= 0 and line.pop("total_ms") >= 0 and line.pop("limit_tokens") > 0
    assert line == {
        **_gone_line("left", "chat"),
        "model": "kvgate-tiny",
        "upstream": None,
        "upstream_request_id": None,
        "stream": False,
        "prompt_tokens": 11,
        "max_tokens": 5,
        "completion_tokens": None,
        "finish_reason": None,
        "ttft_ms": None,
    }


def test_client_leaving_after_the_engine_got_its_request_names_the_upstream(engine, access):  # noqa: F811
    """The engine takes 2 s before its answer's headers; the client leaves 0.3 s after sending.
    The request reached the engine (charged its prompt), so its access line names the upstream it
    was written to beside the ``upstream_request_id`` the engine got. Before, the line said
    ``"upstream": null`` with that id set: an operator could not tell which engine had it."""
    engine.state.mode, engine.state.delay_seconds = "delay", 2.0
    g = Gateway(settings_for([upstream("u1", engine)]), tenants(), quotas=LedgerQuotas()).start()
    try:
        body = json.dumps(chat(max_tokens=5)).encode()
        _send_and_leave(g, "/v1/chat/completions", "gone", body, len(body), 0.3)
        assert wait_for(lambda: len(access("gone")) == 1, 5)
        in_flight = [u.in_flight for u in g.gw.upstreams.all]
    finally:
        g.stop()
    line = access("gone")[0]
    assert engine.state.request_ids() == [gateway_id(line["upstream_request_id"], "gone")]
    assert in_flight == [0]
    assert line.pop("overhead_ms") >= 0 and line.pop("total_ms") >= 0 and line.pop("limit_tokens") > 0
    assert line.pop("upstream_request_id") is not None
    assert line == {
        **_gone_line("gone", "chat"),
        "model": "kvgate-tiny",
        "upstream": "u1",
        "stream": False,
        "prompt_tokens": 11,
        "max_tokens": 5,
        "completion_tokens": None,
        "finish_reason": None,
        "ttft_ms": None,
    }
