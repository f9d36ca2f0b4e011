"""The request pipeline's bookkeeping however a request ends (gateway/admit.py -> proxy.py ->
finish.py, carried by response.py): the quota lease is settled exactly once with the exact
tokens, the upstream's in-flight count returns to 0, and the access log and metrics say what the
client got. Ends covered: answered (whole and streamed), engine error, connect failure, the
client leaving before the engine answered, and mid-stream."""

from __future__ import annotations

import logging

import httpx
import pytest

from config.errors import ErrorCode, OpenAIError
from gateway.stages import QuotaLease
from tests.gateway_harness import KEY_A, Gateway, chat, closed_port_url, settings_for, tenants, upstream, wait_for
from tests.mock_engine import MockEngine

pytestmark = pytest.mark.timeout(60)


class LedgerQuotas:
    """A QuotaStage keeping every reserve and settle, per request id."""

    def __init__(self) -> None:
        self.reserved: dict[str, int] = {}
        self.settled: dict[str, list[int]] = {}

    async def reserve(self, tenant, reserve_tokens, request_id):
        if request_id in self.reserved:
            raise OpenAIError(500, "reserved twice", code=ErrorCode.INTERNAL_ERROR)
        self.reserved[request_id] = reserve_tokens
        return QuotaLease(tenant.id, request_id, reserve_tokens)

    async def settle(self, lease, used_tokens):
        self.settled.setdefault(lease.request_id, []).append(used_tokens)

    async def aclose(self):
        return None


@pytest.fixture
def engine():
    e = MockEngine().start()
    yield e
    e.stop()


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
    assert q.settled == {"w1": [7 + 4], "s1": [7 + 4]}  # the mock reports 7 prompt tokens, 4 words
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
    returns to 0 and the lease is settled once (to 0: no upstream answered)."""
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
    assert q.settled == {"gone": [0]}
    line = access("gone")[0]
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
    assert (line["status"], line["client_disconnected"], line["completion_tokens"]) == (499, True, None)
