"""Strict mode reads every string of a ``/v1/responses`` answer, item fields and stream events
alike, through the real gateway app against an engine that leaks (docs/verifier.md, "Sampling
and strict mode").

A victim tenant's passage (about 330 tokens, every word marked ``zq``) is indexed at its
admission; the engine then puts it into one place of a strict tenant's Responses answer that
only the named text fields would miss: a function call's ``name``, an annotation's ``title``, a
``custom_tool_call``'s ``input``, the ``logprobs`` tokens, an item of a type kvgate does not
know in ``response.output_item.added``, ``response.custom_tool_call_input.delta`` events, and a
``response.output_text.annotation.added`` event. The same answer with a clean passage arrives
whole (released before), the leaking one never carries a victim byte (withheld after).
"""

from __future__ import annotations

import hashlib
import json
import random

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from config.models import TenantConfig, TenantsFile
from tests.fixtures.leak_stack import leak_stack
from verifier.probe import filler_words

SECRETS = {
    "leak_index_key": b"resp-strict-leak-key",
    "cache_salt_key": b"resp-strict-salt-key",
    "admin_key": b"resp-strict-admin-key",
}
MARK = "zq"


def key_of(tid: str) -> str:
    return f"sk-respstrict-{tid}"


def victim_words() -> list[str]:
    rng = random.Random(7)
    return [MARK + rng.choice(filler_words()) for _ in range(160)]


def clean_words() -> list[str]:
    rng = random.Random(8)
    return [rng.choice(filler_words()) for _ in range(160)]


def pieces(words: list[str]) -> list[str]:
    return [w if i == 0 else " " + w for i, w in enumerate(words)]


class State:
    def __init__(self) -> None:
        self.place = "fn_name"
        self.words: list[str] = ["ok"]


HELLO = "Hello."


def _message(place: str, text: str, words: list[str]) -> dict:
    part: dict = {"type": "output_text", "text": HELLO, "annotations": []}
    if place == "annotation_title":
        part["annotations"] = [
            {"type": "url_citation", "title": text, "url": "https://example.com/", "start_index": 0, "end_index": 5}
        ]
    if place == "logprobs":
        part["logprobs"] = [{"token": p, "logprob": -0.1, "top_logprobs": []} for p in pieces(words)]
    return {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant", "content": [part]}


def _second_item(place: str, text: str) -> dict | None:
    if place == "fn_name":
        return {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": text, "arguments": "{}"}
    if place in ("custom_tool_input", "custom_tool_input_delta"):
        return {"type": "custom_tool_call", "id": "ctc_1", "call_id": "call_1", "name": "run", "input": text}
    if place == "output_item_added":  # an item type kvgate does not know by name
        return {"type": "web_search_call", "id": "ws_1", "status": "completed", "action": {"query": text}}
    return None


def output_items(place: str, words: list[str]) -> list[dict]:
    text = " ".join(words)
    items = [_message(place, text, words)]
    second = _second_item(place, text)
    if second is not None:
        items.append(second)
    return items


def _ev(obj: dict) -> bytes:
    return f"event: {obj['type']}\ndata: {json.dumps(obj)}\n\n".encode()


def stream_events(place: str, words: list[str]) -> list[dict]:
    """An OpenAI-shaped event stream with ``words`` in ``place``."""
    text = " ".join(words)
    msg = _message(place if place != "annotation_added" else "", text, words)
    evs: list[dict] = [
        {"type": "response.created", "response": {"id": "resp_1", "status": "in_progress", "output": []}},
        {"type": "response.output_item.added", "output_index": 0, "item": {**msg, "content": []}},
        {"type": "response.output_text.delta", "output_index": 0, "content_index": 0, "delta": HELLO},
    ]
    if place == "logprobs":  # the tokens say what the text does not
        for p in pieces(words):
            evs.append(
                {
                    "type": "response.output_text.delta",
                    "output_index": 0,
                    "content_index": 0,
                    "delta": "",
                    "logprobs": [{"token": p, "logprob": -0.1, "top_logprobs": []}],
                }
            )
    if place == "annotation_added":
        annotation = {"type": "url_citation", "title": text, "url": "https://example.com/", "start_index": 0}
        evs.append(
            {
                "type": "response.output_text.annotation.added",
                "output_index": 0,
                "content_index": 0,
                "annotation_index": 0,
                "annotation": annotation,
            }
        )
    if place == "error_event":  # the engine's own error event, its message the victim's text
        evs.append({"type": "error", "code": "server_error", "message": text, "param": None})
    evs.append({"type": "response.output_item.done", "output_index": 0, "item": msg})
    second = _second_item(place, text)
    if second is not None:
        if place == "custom_tool_input_delta":
            evs.append({"type": "response.output_item.added", "output_index": 1, "item": {**second, "input": ""}})
            for p in pieces(words):
                evs.append({"type": "response.custom_tool_call_input.delta", "output_index": 1, "delta": p})
        else:
            evs.append({"type": "response.output_item.added", "output_index": 1, "item": second})
        evs.append({"type": "response.output_item.done", "output_index": 1, "item": second})
    items = [msg] + ([second] if second is not None else [])
    usage = {"input_tokens": 12, "output_tokens": 5, "total_tokens": 17}
    done = {"id": "resp_1", "status": "completed", "output": items, "usage": usage}
    evs.append({"type": "response.completed", "response": done})
    for n, e in enumerate(evs):
        e["sequence_number"] = n
    return evs


def build_engine(st: State) -> Starlette:
    async def responses(request: Request) -> Response:
        body = await request.json()
        if body.get("stream"):
            evs = stream_events(st.place, st.words)

            async def gen():
                for e in evs:
                    yield _ev(e)

            return StreamingResponse(gen(), media_type="text/event-stream")
        usage = {"input_tokens": 12, "output_tokens": 5, "total_tokens": 17}
        obj = {"id": "resp_1", "object": "response", "status": "completed", "model": "m", "error": None}
        return JSONResponse({**obj, "output": output_items(st.place, st.words), "usage": usage})

    async def completions(request: Request) -> Response:
        return JSONResponse(
            {
                "id": "c1",
                "object": "text_completion",
                "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            }
        )

    async def server_info(request: Request) -> Response:
        return JSONResponse({"max_total_num_tokens": 16384, "context_length": 8192})

    return Starlette(
        routes=[
            Route("/server_info", server_info),
            Route("/v1/responses", responses, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
        ]
    )


def tenants() -> TenantsFile:
    rows = []
    for tid, strict in (("victim", False), ("s", True)):
        sha = hashlib.sha256(key_of(tid).encode()).hexdigest()
        rows.append(TenantConfig(id=tid, api_key_sha256=[sha], strict_verify=strict, max_tokens_cap=512))
    return TenantsFile(tenants=rows)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("respstrict")
    st = State()
    victim = (key_of("victim"), "Please keep this: " + " ".join(victim_words()))
    with leak_stack(tmp, build_engine(st), tenants(), SECRETS, victim, strict_holdback_tokens=64) as (svc, client):
        yield st, svc, client


def _send(client: httpx.Client, stream: bool) -> tuple[int, bytes]:
    body = {"model": "m", "input": "Tell me about the weather.", "max_output_tokens": 400, "stream": stream}
    h = {"authorization": f"Bearer {key_of('s')}"}
    if stream:
        with client.stream("POST", "/v1/responses", json=body, headers=h) as r:
            return r.status_code, b"".join(r.iter_raw())
    r = client.post("/v1/responses", json=body, headers=h)
    return r.status_code, r.content


#: (place, stream): the 7 places the named text fields missed; whole bodies where the place exists there
CASES = [
    ("fn_name", False),
    ("fn_name", True),
    ("annotation_title", False),
    ("annotation_title", True),
    ("custom_tool_input", False),
    ("custom_tool_input", True),
    ("logprobs", False),
    ("logprobs", True),
    ("output_item_added", True),
    ("custom_tool_input_delta", True),
    ("annotation_added", True),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("place,stream", CASES, ids=[f"{p}-{'stream' if s else 'whole'}" for p, s in CASES])
def test_strict_responses_withhold_another_tenants_text_in_every_place(stack, place, stream):
    st, svc, client = stack
    st.place = place
    # released before: the same shape with a clean passage arrives, every word of it
    st.words = clean_words()
    status, raw = _send(client, stream)
    assert status == 200
    assert all(w.encode() in raw for w in clean_words())
    assert b"response_withheld" not in raw
    # withheld after: not one victim byte, the incident named
    st.words = victim_words()
    before = svc.stats["withheld"]
    n_incidents = len(svc.incidents.recent)
    status, raw = _send(client, stream)
    assert MARK.encode() not in raw
    if stream and status == 200:  # cut after the response started: the gateway's error event ends it
        assert b'"code":"response_withheld"' in raw and b"event: error" in raw
    else:
        assert status == 502 and json.loads(raw)["error"]["code"] == "response_withheld"
    assert svc.stats["withheld"] == before + 1
    (inc,) = [i for i in svc.incidents.recent[n_incidents:] if i.detector == "leak_index"]
    assert (inc.tenant, inc.withheld, inc.evidence["source_tenant"]) == ("s", True, "victim")
    assert inc.evidence.get("quarantine") is None and not svc.quarantine.records()


@pytest.mark.timeout(60)
def test_a_strict_tenants_responses_stream_carries_the_gateways_error_event_not_the_engines(stack):
    """The engine's ``error`` event, mid-stream, carries the victim's passage as its message: the
    strict tenant gets the gateway's own message in an ``error`` event with the engine's
    ``sequence_number`` (the Responses protocol relays error events as sent otherwise), after the
    text before it, and 0 victim bytes."""
    st, _svc, client = stack
    st.place, st.words = "error_event", victim_words()
    try:
        status, raw = _send(client, True)
    finally:
        st.place, st.words = "", ["ok"]
    assert status == 200 and MARK.encode() not in raw
    events = [json.loads(line[6:]) for line in raw.split(b"\n") if line.startswith(b"data: ")]
    errors = [e for e in events if e["type"] == "error"]
    assert errors == [
        {
            "type": "error",
            "code": "server_error",
            "message": "The upstream engine answered an error (502); its message is not shown under strict verification.",
            "param": None,
            "sequence_number": 3,
        }
    ]
    assert [e["type"] for e in events[:3]] == [
        "response.created",
        "response.output_item.added",
        "response.output_text.delta",
    ]
