"""The request pipeline's bookkeeping however a request ends (gateway/admission/admit.py -> proxy.py ->
finish.py, carried by response.py): the quota lease is settled exactly once with the exact
tokens, the upstream's in-flight count returns to 0, and the access log and metrics say what the
client got. Ends covered: answered (whole and streamed), engine error, connect failure, the
client leaving before the engine answered, and mid-stream."""

from __future__ import annotations

import hashlib
import json
import logging
import socket
import struct
import threading

import httpx
import pytest

from config.errors import ErrorCode, OpenAIError
from gateway.quotas.stage import QuotaLease
from tests.gate_oracle import text_tokens
from tests.gateway_harness import (
    KEY_A,
    MODEL,
    Gateway,
    chat,
    closed_port_url,
    settings_for,
    tenants,
    upstream,
    wait_for,
)
from tests.mock_engine import gateway_id

pytestmark = pytest.mark.timeout(60)


class LedgerQuotas:
    """A QuotaStage keeping every reserve and settle, per request id."""

    def __init__(self) -> None:
        self.reserved: dict[str, int] = {}
        self.settled: dict[str, list[int]] = {}

    async def begin(self, tenant, request_id):
        return QuotaLease(tenant.id, request_id, 0)

    def combines(self, tenant):
        return False  # the two steps: begin, then reserve_tokens

    async def reserve_tokens(self, tenant, lease, tokens, *, also=None):
        if lease.request_id in self.reserved:
            raise OpenAIError(500, "reserved twice", code=ErrorCode.INTERNAL_ERROR)
        self.reserved[lease.request_id] = tokens
        lease.reserved_tokens = tokens

    async def settle(self, lease, used_tokens):
        self.settled.setdefault(lease.request_id, []).append(used_tokens)

    async def aclose(self):
        return None


@pytest.fixture
def access(caplog):
    caplog.set_level(logging.INFO, logger="kvgate.access")

    def lines(rid: str) -> list[dict]:
        return [r.fields for r in caplog.records if r.name == "kvgate.access" and r.fields["request_id"] == rid]

    return lines


def _in_flight(g: Gateway) -> list[int]:
    return [u.in_flight for u in g.gw.upstreams.all]


def test_answered_whole_and_streamed_settle_once_to_the_engines_usage(engine, access):
    q = LedgerQuotas()
    g = Gateway(settings_for([upstream("u1", engine)]), tenants(), quotas=q).start()
    try:
        with g.client() as c:
            assert (
                c.post("/v1/chat/completions", json=chat(max_tokens=5), headers={"x-request-id": "w1"}).status_code
                == 200
            )
            r = c.post("/v1/chat/completions", json=chat(max_tokens=5, stream=True), headers={"x-request-id": "s1"})
            assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n") and r.text.count("[DONE]") == 1
        assert wait_for(lambda: len(access("s1")) == 1)
    finally:
        g.stop()
    assert q.reserved == {"w1": 11 + 5, "s1": 11 + 5}
    # the mock reports 7 prompt tokens (fewer than the 11 admitted, which is the floor) and 4 words
    assert q.settled == {"w1": [11 + 4], "s1": [11 + 4]}
    assert _in_flight(g) == [0]
    w, s = access("w1")[0], access("s1")[0]
    assert (w["status"], w["upstream"], w["stream"], w["completion_tokens"], w["finish_reason"]) == (
        200,
        "u1",
        False,
        4,
        "stop",
    )
    assert (s["status"], s["upstream"], s["stream"], s["completion_tokens"], s["finish_reason"]) == (
        200,
        "u1",
        True,
        4,
        "stop",
    )
    assert "client_disconnected" not in s and "error_code" not in s


def test_engine_error_and_connect_failure_settle_once(engine, access):
    q = LedgerQuotas()
    ups = [upstream("dead", engine, api_url=closed_port_url() + "/v1"), upstream("u1", engine)]
    g = Gateway(settings_for(ups), tenants(), quotas=q).start()
    try:
        engine.state.mode = "error"
        engine.state.error_status = 400
        engine.state.error_body = b'{"object":"error","message":"bad temp","type":"BadRequestError","code":400}'
        with g.client() as c:
            for i in range(2):  # balance order alternates, so the dead upstream is tried first once
                r = c.post("/v1/chat/completions", json=chat(max_tokens=5), headers={"x-request-id": f"e{i}"})
                assert r.status_code == 400 and r.json()["error"]["message"] == "bad temp"
        assert wait_for(lambda: len(access("e1")) == 1)
    finally:
        g.stop()
    # the engine answered, without usage, and produced nothing: the prompt as counted
    assert q.settled == {"e0": [11], "e1": [11]}
    assert _in_flight(g) == [0, 0]
    assert [access(f"e{i}")[0]["status"] for i in range(2)] == [400, 400]


def test_client_leaving_before_the_engine_answers(engine, access):
    """Cancelled while waiting for the engine's headers: the upstream's in-flight count still
    returns to 0 and the lease is settled once, to the prompt as admitted (the engine had it)."""
    engine.state.mode = "hang"
    q = LedgerQuotas()
    g = Gateway(settings_for([upstream("u1", engine)]), tenants(), quotas=q).start()
    try:
        with httpx.Client(base_url=g.url, headers={"authorization": f"Bearer {KEY_A}"}, timeout=0.5) as c:
            with pytest.raises(httpx.ReadTimeout):
                c.post("/v1/chat/completions", json=chat(max_tokens=5), headers={"x-request-id": "gone"})
        assert wait_for(lambda: len(access("gone")) == 1, 3)
        assert wait_for(lambda: _in_flight(g) == [0], 2)
    finally:
        g.stop()
    assert q.settled == {"gone": [11]}
    line = access("gone")[0]
    sent = gateway_id(line["upstream_request_id"], "gone")  # the engine's id for it, not the client's
    assert engine.state.request_ids() == [sent]
    assert engine.state.cancelled_ids() == [sent]  # the engine had it, and saw it go
    assert (line["status"], line["client_disconnected"]) == (499, True)


def test_client_leaving_mid_stream_settles_to_what_was_produced(engine, access):
    engine.state.chunk_interval_seconds = 0.3  # one word every 0.3 s, usage only at the end
    q = LedgerQuotas()
    g = Gateway(settings_for([upstream("u1", engine)]), tenants(), quotas=q).start()
    try:
        with httpx.Client(base_url=g.url, headers={"authorization": f"Bearer {KEY_A}"}, timeout=5) as c:
            body = chat(max_tokens=5, stream=True)
            with c.stream("POST", "/v1/chat/completions", json=body, headers={"x-request-id": "cut"}) as r:
                first = next(r.iter_bytes())
                assert first.startswith(b"data: ")
        assert wait_for(lambda: len(access("cut")) == 1, 3)
        assert wait_for(lambda: _in_flight(g) == [0], 2)
    finally:
        g.stop()
    (used,) = q.settled["cut"]
    assert 11 < used < 11 + 5  # the prompt plus the words relayed before the cut, counted by the gateway
    line = access("cut")[0]
    # the access line carries the completion tokens streamed before the cut, counted as settled
    assert (line["status"], line["client_disconnected"], line["completion_tokens"]) == (499, True, used - 11)
    assert line["completion_tokens_counted"] is True


def test_context_length_refusal_is_logged_with_its_prompt_tokens(engine, access):
    g = Gateway(settings_for([upstream("u1", engine)]), tenants(), quotas=LedgerQuotas()).start()
    try:
        with g.client() as c:
            r = c.post("/v1/chat/completions", json=chat(max_tokens=4096), headers={"x-request-id": "long"})
        assert wait_for(lambda: len(access("long")) == 1, 3)
    finally:
        g.stop()
    assert (r.status_code, r.json()["error"]["code"]) == (400, "context_length_exceeded")
    line = access("long")[0]
    assert (line["status"], line["error_code"], line["param"], line["prompt_tokens"]) == (
        400,
        "context_length_exceeded",
        "messages",
        11,
    )


# ---------------------------------------------------------------- what a request that reached an engine is charged
# A tenant must not get prefill for free by leaving, or by making the engine time out or break,
# after the prompt was sent: at least the admitted prompt (every prompt x its sequences) is
# charged, plus what was produced. A request that never reached an engine is charged 0.


def _leave(g: Gateway, path: str, body: dict, rid: str, after: float = 0.5) -> None:
    """Send ``body`` and give up (disconnect) after ``after`` seconds without an answer."""
    with httpx.Client(base_url=g.url, headers={"authorization": f"Bearer {KEY_A}"}, timeout=after) as c:
        with pytest.raises(httpx.ReadTimeout):
            c.post(path, json=body, headers={"x-request-id": rid})


def test_client_leaving_a_batch_with_n_is_charged_every_prompt_times_its_sequences(engine, access):
    engine.state.mode = "hang"
    q = LedgerQuotas()
    g = Gateway(settings_for([upstream("u1", engine)]), tenants(), quotas=q).start()
    body = {"model": MODEL, "prompt": [[1] * 10, [2] * 10], "n": 3, "max_tokens": 5}
    try:
        _leave(g, "/v1/completions", body, "batch")
        assert wait_for(lambda: len(access("batch")) == 1, 3)
        engine.state.mode = "ok"  # answered with usage: 7 prompt tokens (below the floor), 4 completion tokens
        with g.client() as c:
            assert c.post("/v1/completions", json=body, headers={"x-request-id": "ok"}).status_code == 200
        assert wait_for(lambda: len(access("ok")) == 1, 3)
    finally:
        g.stop()
    assert q.reserved == {"batch": 3 * (20 + 2 * 5), "ok": 3 * (20 + 2 * 5)}
    assert q.settled == {"batch": [3 * 20], "ok": [3 * 20 + 4]}


def test_engine_read_timeout_is_charged_the_prompt(engine, access):
    engine.state.mode = "hang"
    q = LedgerQuotas()
    g = Gateway(settings_for([upstream("u1", engine)], gateway={"read_timeout_seconds": 0.3}), tenants(), quotas=q)
    g.start()
    try:
        with g.client() as c:
            r = c.post("/v1/chat/completions", json=chat(max_tokens=5), headers={"x-request-id": "slow"})
        assert (r.status_code, r.json()["error"]["code"]) == (504, "upstream_timeout")
        assert wait_for(lambda: len(access("slow")) == 1, 3)
    finally:
        g.stop()
    assert q.settled == {"slow": [11]}
    assert _in_flight(g) == [0]


class ResettingEngine:
    """An engine API that reads each request whole, then resets the connection (RST) without
    answering: the engine broke after it had the prompt."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.received = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            head, _, body = data.partition(b"\r\n\r\n")
            length = int(next(h.split(b":")[1] for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")))
            while len(body) < length:
                body += conn.recv(65536)
            self.received += 1
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()

    def stop(self) -> None:
        self.sock.close()


def test_engine_resetting_before_and_during_the_answer_is_charged_what_it_had(engine, access):
    broken = ResettingEngine()
    q = LedgerQuotas()
    ups = [upstream("rst", engine, api_url=broken.url + "/v1")]
    g = Gateway(settings_for(ups), tenants(), quotas=q).start()
    try:
        with g.client() as c:
            r = c.post("/v1/chat/completions", json=chat(max_tokens=5), headers={"x-request-id": "rst"})
        assert (r.status_code, r.json()["error"]["code"]) == (502, "upstream_unavailable")
        assert wait_for(lambda: len(access("rst")) == 1, 3)
    finally:
        g.stop()
        broken.stop()
    assert broken.received == 1
    assert q.settled == {"rst": [11]}

    # mid-stream: two words relayed, then the connection breaks (no usage chunk ever comes)
    engine.state.mode = "reset"
    engine.state.stream_chunks = [
        b'data: {"choices": [{"index": 0, "delta": {"content": "Hello"}, "finish_reason": null}]}\n\n',
        b'data: {"choices": [{"index": 0, "delta": {"content": " world"}, "finish_reason": null}]}\n\n',
    ]
    q = LedgerQuotas()
    g = Gateway(settings_for([upstream("u1", engine)]), tenants(), quotas=q).start()
    try:
        with g.client() as c:
            r = c.post("/v1/chat/completions", json=chat(max_tokens=5, stream=True), headers={"x-request-id": "cut"})
        assert r.status_code == 200 and '"code": "upstream_unavailable"' in r.text.replace('":"', '": "')
        assert r.text.endswith("data: [DONE]\n\n")
        assert wait_for(lambda: len(access("cut")) == 1, 3)
    finally:
        g.stop()
    assert q.settled == {"cut": [11 + text_tokens("Hello world")]} and text_tokens("Hello world") == 2


def test_never_reaching_an_engine_is_charged_nothing(engine, access):
    """Every upstream refuses the connection; or the one connection is busy and the request
    waits for it in vain (a connect timeout), or its client leaves while it waits: 0."""
    q = LedgerQuotas()
    ups = [upstream(f"dead{i}", engine, api_url=closed_port_url() + "/v1") for i in range(2)]
    g = Gateway(settings_for(ups), tenants(), quotas=q).start()
    try:
        with g.client() as c:
            r = c.post("/v1/chat/completions", json=chat(max_tokens=5), headers={"x-request-id": "dead"})
        assert (r.status_code, r.json()["error"]["code"]) == (503, "upstream_unavailable")
        assert wait_for(lambda: len(access("dead")) == 1, 3)
    finally:
        g.stop()
    assert q.settled == {"dead": [0]}

    engine.state.mode = "hang"
    q = LedgerQuotas()
    settings = settings_for([upstream("u1", engine)], gateway={"max_connections": 1, "connect_timeout_seconds": 1.5})
    g = Gateway(settings, tenants(), quotas=q).start()
    try:
        holder = threading.Thread(target=_leave, args=(g, "/v1/chat/completions", chat(max_tokens=5), "holder", 3.0))
        holder.start()
        assert wait_for(lambda: len(engine.state.requests) == 1, 3)  # it holds the only connection
        _leave(g, "/v1/chat/completions", chat(max_tokens=5), "queued", 0.5)  # leaves while waiting for it
        with g.client() as c:
            r = c.post("/v1/chat/completions", json=chat(max_tokens=5), headers={"x-request-id": "waited"})
        assert (r.status_code, r.json()["error"]["code"]) == (504, "upstream_timeout")
        holder.join()
        assert wait_for(lambda: all(len(access(rid)) == 1 for rid in ("holder", "queued", "waited")), 3)
    finally:
        g.stop()
    assert len(engine.state.requests) == 1
    assert q.settled == {"holder": [11], "queued": [0], "waited": [0]}


def _hello_stream_with_usage(usage: bytes) -> list[bytes]:
    """A stream of "Hello world" (2 tokens), then a usage chunk carrying ``usage`` (JSON), then [DONE]."""
    return [
        b'data: {"choices": [{"index": 0, "delta": {"content": "Hello world"}, "finish_reason": "stop"}]}\n\n',
        b'data: {"choices": [], "usage": ' + usage + b"}\n\n",
        b"data: [DONE]\n\n",
    ]


def test_hostile_usage_numbers_never_lower_the_charge(engine, access):
    """An engine reporting negative or boolean usage: the admitted prompt and the counted text are
    charged, and the metrics do not break (a negative counter increment would raise)."""
    engine.state.stream_chunks = _hello_stream_with_usage(b'{"prompt_tokens": -1000, "completion_tokens": -1000}')
    q = LedgerQuotas()
    g = Gateway(settings_for([upstream("u1", engine)]), tenants(), quotas=q).start()
    try:
        with g.client() as c:
            r = c.post("/v1/chat/completions", json=chat(max_tokens=5, stream=True), headers={"x-request-id": "neg"})
            assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
            engine.state.stream_chunks = _hello_stream_with_usage(b'{"prompt_tokens": true, "completion_tokens": true}')
            r = c.post("/v1/chat/completions", json=chat(max_tokens=5, stream=True), headers={"x-request-id": "bool"})
            assert r.status_code == 200
        assert wait_for(lambda: len(access("bool")) == 1, 3)
        with g.client() as c:
            metrics = c.get("/metrics").text
    finally:
        g.stop()
    assert q.settled == {"neg": [11 + 2], "bool": [11 + 2]}
    # no usable usage: the access line carries the gateway's own count of the text, marked as counted
    assert [
        (access(r)[0]["status"], access(r)[0]["completion_tokens"], access(r)[0]["completion_tokens_counted"])
        for r in ("neg", "bool")
    ] == [(200, 2, True)] * 2
    assert 'kvgate_prompt_tokens_total{tenant="tenant-a"} 22.0' in metrics
    assert 'kvgate_completion_tokens_total{tenant="tenant-a"}' not in metrics  # nothing usable was reported


@pytest.mark.parametrize(
    ("usage", "settled", "completion"),
    [
        ({"prompt_tokens": 10**12, "completion_tokens": 2**62}, 11 + 2, 2),  # both ignored: text counted
        ({"prompt_tokens": 8192, "completion_tokens": 5}, 8192 + 5, 5),  # the ceilings themselves
        ({"prompt_tokens": 8193, "completion_tokens": 6}, 11 + 2, 2),  # one token above each
        ({"prompt_tokens": 11, "completion_tokens": 8192}, 11 + 2, 2),  # the context, not max_tokens 5
        ({"prompt_tokens": 20, "completion_tokens": 3}, 20 + 3, 3),  # more than the gateway counted: trusted
    ],
)
def test_usage_no_engine_could_report_is_ignored(engine, access, usage, settled, completion):
    """An engine's usage above what the request could use (prompt: its one sequence at the
    model's context length, 8,192; completion: the max_tokens of 5 it was sent) is no count: the
    settle charges the admitted prompt and the text relayed, as for no report. Before, 2**62
    completion tokens reached the quota scripts, which failed half-applied (INCRBY of a float)
    and answered 503 to every tenant; 10**12 prompt tokens locked the tenant out for the window;
    8,192 completion tokens for max_tokens 5 were charged as reported."""
    engine.state.stream_chunks = _hello_stream_with_usage(json.dumps(usage).encode())
    q = LedgerQuotas()
    g = Gateway(settings_for([upstream("u1", engine)]), tenants(), quotas=q).start()
    try:
        with g.client() as c:
            r = c.post("/v1/chat/completions", json=chat(max_tokens=5, stream=True), headers={"x-request-id": "u"})
            assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
        assert wait_for(lambda: len(access("u")) == 1, 3)
    finally:
        g.stop()
    assert q.settled == {"u": [settled]}
    assert access("u")[0]["completion_tokens"] == completion


def test_the_access_log_names_a_refused_field_by_path_never_by_client_text(engine, access):
    """The client sees its own field name in the 400; the access log keeps the path and known
    names and writes a hash for the name it chose (it may be anything: a key, a customer's name)."""
    g = Gateway(settings_for([upstream("u1", engine)]), tenants()).start()
    secret = "sk_live_customer_4242"
    try:
        with g.client() as c:
            r = c.post("/v1/chat/completions", json=chat(**{secret: 1}), headers={"x-request-id": "p1"})
            assert (r.status_code, r.json()["error"]["param"]) == (400, secret)
            body = chat()
            body["messages"][0][secret] = "x"
            r = c.post("/v1/chat/completions", json=body, headers={"x-request-id": "p2"})
            assert (r.status_code, r.json()["error"]["param"]) == (400, f"messages[0].{secret}")
            r = c.post("/v1/chat/completions", json=chat(temperature="hot"), headers={"x-request-id": "p3"})
            assert (r.status_code, r.json()["error"]["param"]) == (400, "temperature")
        assert wait_for(lambda: len(access("p3")) == 1)
    finally:
        g.stop()
    hashed = "#" + hashlib.sha256(secret.encode()).hexdigest()[:12]
    assert [access(rid)[0]["param"] for rid in ("p1", "p2", "p3")] == [hashed, f"messages[0].{hashed}", "temperature"]
    assert all(secret not in repr(access(rid)) for rid in ("p1", "p2", "p3"))
