"""Fault behaviour of the gateway against the mock engine: upstreams down, hanging, resetting;
pools unreachable, without the field, stale, shrinking; clients that disconnect."""

from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest

from tests.gateway_harness import KEY_A, MODEL, Gateway, chat, closed_port_url, settings_for, upstream, wait_for
from tests.mock_engine import gateway_id
from tests.test_gateway_pipeline import access  # noqa: F401  (the access fixture)

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def engine2(engines):
    return engines()


def err(r: httpx.Response) -> tuple[int, str | None]:
    return r.status_code, r.json()["error"]["code"]


def sent_id(lines, rid: str) -> str:
    """The ``x-request-id`` the gateway sent the engine for the one request of client id ``rid``
    (its access line's ``upstream_request_id``, waited for; ``lines``: the ``access`` fixture),
    asserted to be the gateway's own."""
    assert wait_for(lambda: len(lines(rid)) == 1, 2.0)
    return gateway_id(lines(rid)[0]["upstream_request_id"], rid)


# ---------------------------------------------------------------- upstreams
def test_upstream_down_is_503(engine):
    g = Gateway(settings_for([upstream("u1", engine, api_url=closed_port_url() + "/v1")])).start()
    try:
        with g.client() as c:
            r = c.post("/v1/chat/completions", json=chat(max_tokens=5))
            assert err(r) == (503, "upstream_unavailable")
            r = c.post("/v1/chat/completions", json=chat(max_tokens=5, stream=True))
            assert err(r) == (503, "upstream_unavailable")
            assert 'kvgate_upstream_errors_total{kind="connect",upstream="u1"} 2.0' in c.get("/metrics").text
    finally:
        g.stop()


def test_connect_failure_retried_on_another_upstream(engine, engine2):
    s = settings_for([upstream("dead", engine2, api_url=closed_port_url() + "/v1"), upstream("live", engine)])
    g = Gateway(s).start()
    try:
        with g.client() as c:
            for _ in range(4):
                assert c.post("/v1/chat/completions", json=chat(max_tokens=5)).status_code == 200
    finally:
        g.stop()
    assert len(engine.state.requests) == 4
    assert engine2.state.requests == []


def test_two_live_upstreams_share_the_load(engine, engine2):
    g = Gateway(settings_for([upstream("a", engine), upstream("b", engine2)])).start()
    try:
        with g.client() as c:
            for _ in range(6):
                assert c.post("/v1/chat/completions", json=chat(max_tokens=5)).status_code == 200
    finally:
        g.stop()
    assert (len(engine.state.requests), len(engine2.state.requests)) == (3, 3)


def test_hanging_upstream_is_504_and_cancelled(engine, access):  # noqa: F811
    engine.state.mode = "hang"
    g = Gateway(settings_for([upstream("u1", engine)], gateway={"read_timeout_seconds": 0.5})).start()
    try:
        with g.client() as c:
            r = c.post("/v1/chat/completions", json=chat(max_tokens=5), headers={"x-request-id": "hang-1"})
            assert err(r) == (504, "upstream_timeout")
        assert wait_for(lambda: engine.state.cancelled, 2.0)
        sent = sent_id(access, "hang-1")
        assert (engine.state.request_ids(), engine.state.cancelled_ids()) == ([sent], [sent])
    finally:
        g.stop()


def test_an_engine_trickling_its_answer_is_cut_off_at_the_exchange_timeout(engine, access):  # noqa: F811
    """An engine that keeps sending, a little at a time, never trips the read timeout (1 s):
    ``gateway.exchange_timeout_seconds`` (0.6 s) cuts it off. A whole answer not ended by then is
    504 ``upstream_timeout``; a stream gets its error event and one ``[DONE]`` after what it
    relayed. The engine sees both requests abandoned."""
    engine.state.mode = "trickle"
    engine.state.chunk_interval_seconds = 0.05
    first = b'data: {"choices":[{"index":0,"delta":{"content":"a"},"finish_reason":null}]}\n\n'
    engine.state.stream_chunks = [first] * 100  # 5 s of content, a chunk every 50 ms
    gateway = {"read_timeout_seconds": 1.0, "exchange_timeout_seconds": 0.6}
    g = Gateway(settings_for([upstream("u1", engine)], gateway=gateway)).start()
    try:
        with g.client() as c:
            t0 = time.monotonic()
            r = c.post("/v1/chat/completions", json=chat(max_tokens=5), headers={"x-request-id": "trickle-1"})
            assert err(r) == (504, "upstream_timeout")
            assert 0.5 <= time.monotonic() - t0 < 1.5
            t0 = time.monotonic()
            r = c.post(
                "/v1/chat/completions", json=chat(max_tokens=5, stream=True), headers={"x-request-id": "trickle-2"}
            )
            assert 0.5 <= time.monotonic() - t0 < 1.5
        assert r.status_code == 200 and r.content.startswith(first)
        tail = r.content.rstrip(b"\n").rsplit(b"\n\n", 2)[-2:]
        error = json.loads(tail[0].removeprefix(b"data: "))["error"]
        assert (error["code"], error["message"]) == ("upstream_timeout", "The upstream engine did not answer in time.")
        assert tail[1] == b"data: [DONE]" and r.content.count(b"[DONE]") == 1
        assert wait_for(lambda: len(engine.state.cancelled) == 2, 2.0)
        sent = [sent_id(access, "trickle-1"), sent_id(access, "trickle-2")]
        assert sent[0] != sent[1]
        assert (engine.state.request_ids(), engine.state.cancelled_ids()) == (sent, sent)
    finally:
        g.stop()


def test_reset_mid_stream_ends_with_error_event_and_one_done(engine):
    first = b'data: {"choices":[{"index":0,"delta":{"content":"Hel"},"finish_reason":null}]}\n\n'
    engine.state.stream_chunks = [first]
    engine.state.mode = "reset"
    g = Gateway(settings_for([upstream("u1", engine)])).start()
    try:
        with g.client() as c:
            r = c.post("/v1/chat/completions", json=chat(max_tokens=5, stream=True))
    finally:
        g.stop()
    assert r.status_code == 200
    assert r.content.startswith(first)
    rest = r.content[len(first) :]
    assert rest.startswith(b'data: {"error":{"message":"The upstream engine broke the connection (')
    assert b'"code":"upstream_unavailable"}}\n\n' in rest
    assert rest.endswith(b"data: [DONE]\n\n") and rest.count(b"[DONE]") == 1


def test_reset_before_any_content_is_502(engine):
    engine.state.stream_chunks = [b'data: {"choices":[{"index":0,"delta":{"role":"assistant"}}]}\n\n']
    engine.state.mode = "reset"
    g = Gateway(settings_for([upstream("u1", engine)])).start()
    try:
        with g.client() as c:
            assert err(c.post("/v1/chat/completions", json=chat(max_tokens=5, stream=True))) == (
                502,
                "upstream_unavailable",
            )
    finally:
        g.stop()


# ---------------------------------------------------------------- pools
def _limit(c: httpx.Client) -> int | None:
    return c.get("/v1/models").json()["data"][0]["max_model_len"]


def test_pool_unreachable_fails_closed(engine):
    g = Gateway(settings_for([upstream("u1", engine, pool_urls=[closed_port_url() + "/server_info"])])).start()
    try:
        with g.client() as c:
            r = c.post("/v1/chat/completions", json=chat(max_tokens=5))
            assert err(r) == (503, "pool_size_unknown") and r.headers["retry-after"] == "1"
            ready = c.get("/readyz")
            assert ready.status_code == 503
            assert ready.json()["upstreams"][0]["known"] is False
            assert "unreachable" in ready.json()["upstreams"][0]["error"]
            assert _limit(c) is None
            assert 'kvgate_pool_tokens{upstream="u1"} -1.0' in c.get("/metrics").text
    finally:
        g.stop()
    assert engine.state.requests == []


def test_pool_without_the_field_fails_closed(engine):
    engine.state.info_mode = "missing"
    g = Gateway(settings_for([upstream("u1", engine)])).start()
    try:
        with g.client() as c:
            assert err(c.post("/v1/chat/completions", json=chat(max_tokens=5))) == (503, "pool_size_unknown")
            error = c.get("/readyz").json()["upstreams"][0]["error"]
            assert (
                error == f"{engine.info_url}: server_info has no max_total_num_tokens (a positive integer up to 2**40)"
            )
            engine.state.info_mode = "ok"  # the field comes back: the next poll recovers
            assert wait_for(lambda: c.get("/readyz").status_code == 200, 3.0)
            assert c.post("/v1/chat/completions", json=chat(max_tokens=5)).status_code == 200
    finally:
        g.stop()


def test_stale_pool_fails_closed(engine):
    """A poll in flight longer than ``max_staleness_seconds`` (the engine's pool endpoint hangs;
    its timeout, 10 s, is far off): the last good reading ages past 0.5 s and is not trusted."""
    g = Gateway(
        settings_for(
            [upstream("u1", engine)],
            pool={"poll_interval_seconds": 0.1, "max_staleness_seconds": 0.5, "request_timeout_seconds": 10},
        )
    ).start()
    try:
        with g.client() as c:
            assert c.post("/v1/chat/completions", json=chat(max_tokens=5)).status_code == 200
            engine.state.info_mode = "hang"  # the next poll waits on /server_info
            assert wait_for(lambda: c.get("/readyz").status_code == 503, 3.0)
            assert err(c.post("/v1/chat/completions", json=chat(max_tokens=5))) == (503, "pool_size_unknown")
            ready = c.get("/readyz")
            assert ready.status_code == 503
            pool = ready.json()["upstreams"][0]
            # stale, not failed: the reading is kept (its pool, no error) and older than 0.5 s
            assert (pool["known"], pool["pool_tokens"], pool["error"]) == (False, 4096, None)
            assert pool["age_seconds"] > 0.5
    finally:
        g.stop()


def test_shrinking_pool_lowers_the_limit_at_the_next_poll(engine):
    g = Gateway(settings_for([upstream("u1", engine)])).start()
    try:
        with g.client() as c:
            assert _limit(c) == 3276
            body = {"model": MODEL, "prompt": "Say hello.", "max_tokens": 2000}
            assert c.post("/v1/completions", json=body).status_code == 200
            engine.state.pool_tokens = 2000  # the engine restarted with a smaller pool
            assert wait_for(lambda: _limit(c) == 1600, 3.0)
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 400
            assert r.json()["error"]["message"].startswith(
                "This model's maximum context length is 1600 tokens. However, you requested 2003 tokens"
            )
    finally:
        g.stop()


def test_every_prefill_node_is_read_and_the_minimum_taken(engine, engine2):
    engine2.state.pool_tokens = 1000  # a second prefill node with a smaller pool
    g = Gateway(settings_for([upstream("u1", engine, pool_urls=[engine.info_url, engine2.info_url])])).start()
    try:
        with g.client() as c:
            assert _limit(c) == 800
            engine2.state.info_mode = "500"  # one node unreadable: the whole upstream is unknown
            assert wait_for(lambda: _limit(c) is None, 3.0)
    finally:
        g.stop()


def test_get_server_info_fallback_vllm_and_static(engine, engine2):
    engine.state.info_mode = "404"  # only /get_server_info answers (older SGLang)
    engine.state.max_req_input_len = 3000
    engine2.state.vllm_max_model_len = 2500
    ups = [
        upstream("sg", engine),
        upstream("vl", engine2, pool_source="vllm", pool_urls=[engine2.url + "/v1/models"]),
        upstream("st", engine2, pool_source="static", pool_urls=[], static_pool_tokens=10_000),
    ]
    g = Gateway(settings_for(ups)).start()
    try:
        with g.client() as c:
            rows = {u["upstream"]: u for u in c.get("/readyz").json()["upstreams"]}
    finally:
        g.stop()
    assert (rows["sg"]["limit_tokens"], rows["vl"]["limit_tokens"], rows["st"]["limit_tokens"]) == (3000, 2000, 8000)
    assert (rows["sg"]["live"], rows["st"]["live"]) == (True, False)


# ---------------------------------------------------------------- client disconnects
def test_client_disconnect_mid_stream_cancels_upstream_within_1s(engine, access):  # noqa: F811
    engine.state.stream_chunks = [
        b'data: {"choices":[{"index":0,"delta":{"content":"one"}}]}\n\n',
        b'data: {"choices":[{"index":0,"delta":{"content":" two"}}]}\n\n',
    ]
    engine.state.chunk_interval_seconds = 3  # one chunk, then a long wait (read timeout is 5 s)
    g = Gateway(settings_for([upstream("u1", engine)])).start()
    try:
        with httpx.Client(base_url=g.url, headers={"authorization": "Bearer sk-test-tenant-a"}, timeout=10) as c:
            with c.stream(
                "POST",
                "/v1/chat/completions",
                json=chat(max_tokens=20, stream=True),
                headers={"x-request-id": "gone-1"},
            ) as r:
                assert r.status_code == 200
                first = next(r.iter_raw())
                assert first == b'data: {"choices":[{"index":0,"delta":{"content":"one"}}]}\n\n'
                time.sleep(0.1)
            closed_at = time.monotonic()
        assert wait_for(lambda: engine.state.cancelled, 2.0)
        at = engine.state.cancelled[0][1]
        sent = sent_id(access, "gone-1")
        assert (engine.state.request_ids(), engine.state.cancelled_ids()) == ([sent], [sent])
        assert at - closed_at < 1.0
        with g.client() as c2:
            assert wait_for(lambda: 'kvgate_client_disconnects_total{route="chat"} 1.0' in c2.get("/metrics").text, 2)
    finally:
        g.stop()


def test_client_disconnect_while_waiting_for_a_whole_answer(engine, access):  # noqa: F811
    engine.state.mode = "hang"
    g = Gateway(settings_for([upstream("u1", engine)])).start()
    try:
        with httpx.Client(base_url=g.url, headers={"authorization": "Bearer sk-test-tenant-a"}, timeout=0.5) as c:
            with pytest.raises(httpx.ReadTimeout):
                c.post("/v1/chat/completions", json=chat(max_tokens=5), headers={"x-request-id": "gone-2"})
            closed_at = time.monotonic()
        assert wait_for(lambda: engine.state.cancelled, 2.0)
        sent = sent_id(access, "gone-2")
        assert (engine.state.request_ids(), engine.state.cancelled_ids()) == ([sent], [sent])
        assert engine.state.cancelled[0][1] - closed_at < 1.0
    finally:
        g.stop()


def _pipelined(g: Gateway, body: dict, n: int, rid: str) -> socket.socket:
    """``n`` copies of one chat request written at once on a new connection, as a pipelining
    client sends them."""
    data = json.dumps(body).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\nauthorization: Bearer {KEY_A}\r\n"
        f"content-type: application/json\r\nx-request-id: {rid}\r\ncontent-length: {len(data)}\r\n\r\n"
    ).encode()
    url = urlsplit(g.url)
    s = socket.create_connection((url.hostname, url.port), timeout=5)
    s.sendall((head + data) * n)
    return s


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_with_pipelined_requests_waiting_cancels_the_one_answered(engine, stream, caplog, access):  # noqa: F811
    """Two pipelined chats, then the client closes while the engine still works on the first
    (a whole answer it never sends, or a stream's first chunk then a 3 s wait). The engine sees
    the first cancelled within 1 s, as with one request, and nothing is logged as an error.
    Before, uvicorn stopped reading while the second waited, so the close went unseen until
    the read timeout (the lease and the engine's sequence held meanwhile), and it marked only
    the waiting request disconnected: the stream's next write met the closed socket (an
    unhandled RuntimeError, logged as a 200 with internal_error)."""
    if stream:
        engine.state.stream_chunks = [
            b'data: {"choices":[{"index":0,"delta":{"content":"one"}}]}\n\n',
            b'data: {"choices":[{"index":0,"delta":{"content":" two"}}]}\n\n',
        ]
        engine.state.chunk_interval_seconds = 3
    else:
        engine.state.mode = "hang"
    g = Gateway(settings_for([upstream("u1", engine)]), edge=True).start()
    try:
        s = _pipelined(g, chat(max_tokens=5, stream=stream), 2, "piped-1")
        if stream:
            assert s.recv(65536).startswith(b"HTTP/1.1 200 OK\r\n")
        else:
            assert wait_for(lambda: engine.state.requests, 2.0)
        s.close()
        closed_at = time.monotonic()
        assert wait_for(lambda: engine.state.cancelled, 2.0)
        assert engine.state.cancelled[0][1] - closed_at < 1.0
        sent = sent_id(access, "piped-1")  # one access line: the waiting request was never forwarded
        assert (engine.state.request_ids(), engine.state.cancelled_ids()) == ([sent], [sent])
        with g.client() as c:
            assert wait_for(lambda: 'kvgate_client_disconnects_total{route="chat"} 1.0' in c.get("/metrics").text, 2)
    finally:
        g.stop()
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == []
