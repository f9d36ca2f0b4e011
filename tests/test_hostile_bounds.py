"""What a hostile client or engine sends is bounded: echoed names and values in error bodies and
logs are cut with a marker, no log line exceeds 16 KiB, and an upstream stream event over
``gateway.max_sse_event_bytes`` ends the stream with an OpenAI-shaped error event."""

from __future__ import annotations

import io
import json
import logging
import sys

import pytest

from config.errors import MAX_MESSAGE_CHARS, MAX_PARAM_CHARS, OpenAIError, bounded, openai_error
from gateway.ops.access_log import MAX_FIELD_CHARS, MAX_LINE_BYTES, JsonFormatter
from tests.gateway_harness import Gateway, chat, settings_for, tenants, upstream, wait_for

pytestmark = pytest.mark.timeout(60)


def test_bounded_keeps_short_text_and_marks_the_cut():
    assert bounded("abc", 3) == "abc"
    assert bounded("abcd", 3) == "abc...[1 more characters]"
    assert bounded("x" * 4_000_000, 128) == "x" * 128 + "...[3999872 more characters]"


def test_openai_error_cuts_echoed_param_and_message():
    name = "p" * 4_000_000
    e = OpenAIError(400, f"Unrecognized request argument supplied: {name}", code="invalid_request", param=name)
    assert e.param == "p" * MAX_PARAM_CHARS + f"...[{4_000_000 - MAX_PARAM_CHARS} more characters]"
    assert e.message == (
        "Unrecognized request argument supplied: "
        + "p" * (MAX_MESSAGE_CHARS - 40)
        + f"...[{4_000_040 - MAX_MESSAGE_CHARS} more characters]"
    )
    assert len(e.body_bytes()) < 1400
    assert openai_error("m" * 5000, param="q" * 500)["error"]["param"] == "q" * 128 + "...[372 more characters]"


def _line(record_msg: str, fields: dict | None = None, exc: bool = False) -> str:
    rec = logging.LogRecord("kvgate.access", logging.INFO, __file__, 1, record_msg, None, None)
    if fields is not None:
        rec.fields = fields
    if exc:
        try:
            raise ValueError("v" * 100_000)
        except ValueError:
            rec.exc_info = sys.exc_info()
    return JsonFormatter().format(rec)


def test_log_lines_are_bounded():
    big = "n" * 4_000_000
    line = _line("request", {"param": big, "request_id": "r1", "usage": {"prompt_tokens": 3}, "status": 400})
    obj = json.loads(line)
    assert obj["param"] == "n" * MAX_FIELD_CHARS + f"...[{4_000_000 - MAX_FIELD_CHARS} more characters]"
    assert (obj["request_id"], obj["usage"], obj["status"]) == ("r1", {"prompt_tokens": 3}, 400)
    assert len(line.encode()) < 2048
    # many large fields: the line would pass 16 KiB, so only the head is kept
    many = _line("m" * 50_000, {f"f{i}": "v" * 5000 for i in range(40)})
    obj = json.loads(many)
    assert len(many.encode()) <= MAX_LINE_BYTES
    assert set(obj) == {"ts", "level", "logger", "msg", "truncated"}
    assert obj["msg"] == "m" * 512 + "...[49488 more characters]" and obj["truncated"] is True
    assert len(_line("boom", exc=True).encode()) <= MAX_LINE_BYTES
    huge_list = json.loads(_line("x", {"ids": list(range(100_000))}))["ids"]
    assert isinstance(huge_list, str) and huge_list.endswith(" more characters]") and len(huge_list) < 1100


def test_unknown_field_named_with_4mb_of_text_gets_a_small_400_and_a_small_log_line(engine):
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    access = logging.getLogger("kvgate.access")
    access.addHandler(handler)
    old_level = access.level
    access.setLevel(logging.INFO)
    name = "Tell me the secret plan. " * 166_667  # 4,000,008 characters of prompt-like text
    g = Gateway(settings_for([upstream("u1", engine)], gateway={"max_body_bytes": 8 << 20}), tenants()).start()
    try:
        with g.client() as c:
            r = c.post("/v1/chat/completions", json={**chat(), name: 1})
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["param"] == name[:128] + f"...[{len(name) - 128} more characters]"
        assert err["message"] == bounded(f"Unrecognized request argument supplied: {name}", 1024)
        assert len(r.content) < 1500
        assert engine.state.requests == []
    finally:
        g.stop()
        access.removeHandler(handler)
        access.setLevel(old_level)
    lines = [ln for ln in stream.getvalue().splitlines() if ln]
    assert lines and all(len(ln.encode()) <= MAX_LINE_BYTES for ln in lines)
    assert all(name[:2000] not in ln for ln in lines)


def test_metrics_token_guards_metrics_and_readyz_details(engine):
    token = "m" * 32
    g = Gateway(settings_for([upstream("u1", engine)], gateway={"metrics_token": token}), tenants()).start()
    try:
        with g.client(key=None) as c:
            assert wait_for(lambda: c.get("/readyz").status_code == 200)
            r = c.get("/metrics")
            assert (r.status_code, r.headers["www-authenticate"], r.json()) == (
                401,
                "Bearer",
                {
                    "error": {
                        "message": "/metrics needs the metrics token (gateway.metrics_token) as "
                        "'Authorization: Bearer <token>'.",
                        "type": "authentication_error",
                        "param": None,
                        "code": "invalid_api_key",
                    }
                },
            )
            assert c.get("/metrics", headers={"authorization": "Bearer " + "m" * 31}).status_code == 401
            assert c.get("/metrics", headers={"authorization": "Basic " + token}).status_code == 401
            assert c.get("/metrics", headers={"authorization": token}).status_code == 401
            # the scheme in any case, as API keys take it (lowercase was a 401)
            assert c.get("/metrics", headers={"authorization": "bearer " + token}).status_code == 200
            assert c.get("/readyz").json() == {"status": "ready"}  # no upstream URLs, no pool details
            auth = {"authorization": f"Bearer {token}"}
            ok = c.get("/metrics", headers=auth)
            assert ok.status_code == 200 and b"kvgate_requests_total" in ok.content
            details = c.get("/readyz", headers=auth).json()
            assert details["status"] == "ready" and details["upstreams"][0]["upstream"] == "u1"
    finally:
        g.stop()
    open_gw = Gateway(settings_for([upstream("u1", engine)]), tenants()).start()  # off by default
    try:
        with open_gw.client(key=None) as c:
            assert wait_for(lambda: c.get("/readyz").status_code == 200)
            assert "upstreams" in c.get("/readyz").json() and c.get("/metrics").status_code == 200
    finally:
        open_gw.stop()


def _event(content: str) -> bytes:
    obj = {"id": "c1", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": content}}]}
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


TOO_BIG_EVENT = {
    "error": {
        "message": "The upstream engine sent a stream event larger than 1048576 bytes "
        "(gateway.max_sse_event_bytes); the stream was ended.",
        "type": "server_error",
        "param": None,
        "code": "upstream_unavailable",
    }
}


def test_an_8_mib_stream_event_ends_the_stream_with_an_error_event(engine):
    g = Gateway(settings_for([upstream("u1", engine)]), tenants()).start()
    try:
        first = [_event("caf\u00e9 "), _event("\u2028 line")]
        huge = b"data: " + b"x" * (8 << 20)  # never finished: 8 MiB arriving in 16 KiB reads
        stream = b"".join(first) + huge
        engine.state.stream_chunks = [stream[i : i + 16384] for i in range(0, len(stream), 16384)]
        with g.client() as c:
            r = c.post(
                "/v1/chat/completions", json=chat(max_tokens=5, stream=True, stream_options={"include_usage": True})
            )
        assert r.status_code == 200
        assert r.content == b"".join(first) + b"data: " + json.dumps(TOO_BIG_EVENT, separators=(",", ":")).encode() + (
            b"\n\ndata: [DONE]\n\n"
        )
        # before any content: the answer itself is the 502
        engine.state.stream_chunks = [huge[i : i + 16384] for i in range(0, len(huge), 16384)]
        with g.client() as c:
            r = c.post("/v1/chat/completions", json=chat(max_tokens=5, stream=True))
        assert (r.status_code, r.json()) == (502, TOO_BIG_EVENT)
        # exactly at the limit passes byte-exact
        edge_event = b'data: "' + b"y" * ((1 << 20) - 10) + b'"\n\n'  # JSON: data that is not is refused
        ok = [_event("a"), edge_event, b"data: [DONE]\n\n"]
        engine.state.stream_chunks = [b"".join(ok)]
        with g.client() as c:
            r = c.post(
                "/v1/chat/completions", json=chat(max_tokens=5, stream=True, stream_options={"include_usage": True})
            )
        assert r.status_code == 200 and r.content == b"".join(ok)
    finally:
        g.stop()


def test_events_without_content_are_held_back_only_up_to_the_event_limit(engine):
    g = Gateway(settings_for([upstream("u1", engine)]), tenants()).start()
    try:
        # 1.2 MB of events that start nothing (blank data: relayed as sent; a comment's text is not)
        comments = [b"data:" + b" " * 1000 + b"\n\n"] * 1200
        stream = b"".join(comments) + _event("late") + b"data: [DONE]\n\n"
        engine.state.stream_chunks = [stream[i : i + 65536] for i in range(0, len(stream), 65536)]
        with g.client() as c:
            with c.stream(
                "POST",
                "/v1/chat/completions",
                json=chat(max_tokens=5, stream=True, stream_options={"include_usage": True}),
            ) as r:
                assert r.status_code == 200
                body = r.read()
        assert body == stream  # relayed byte-exact; the response started once 1 MiB was held
    finally:
        g.stop()


def test_an_empty_metrics_token_and_a_limit_above_2_53_are_refused_at_load():
    """metrics_token: "" left /metrics and /readyz's details open without a word; a limit of
    2**63 was taken, and every x-ratelimit-remaining header then said 0 while requests were
    admitted (the quota scripts count in doubles)."""
    from pydantic import ValidationError

    from config.models import GatewaySettings, TenantConfig

    with pytest.raises(ValidationError, match="metrics_token"):
        GatewaySettings(metrics_token="")
    for field in ("rpm", "tpm", "max_concurrent"):
        with pytest.raises(ValidationError, match="less than or equal to 9007199254740991"):
            TenantConfig(id="t", **{field: 1 << 63})
        assert getattr(TenantConfig(id="t", **{field: (1 << 53) - 1}), field) == (1 << 53) - 1
