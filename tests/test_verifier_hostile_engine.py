"""A hostile or broken engine against the verifier, through the real gateway app: answers that put
another tenant's text, a canary or a wrong token count where a client still receives it but a
detector did not look (docs/verifier.md).

A scripted engine answers each request with the body or the events a test gives it. A victim
tenant's passage (about 330 tokens, every word marked ``zq``, a canary inside; the helpers of
``test_verifier_fields``) is indexed at its admission before the tests run. Then:

- **usage drift**: ``usage.prompt_tokens`` as a float (``12.0``, or an integer past 64 bits, which
  orjson reads as a float), a string, a bool, ``null``, a list or absent, and
  ``prompt_tokens_details.cached_tokens`` above ``prompt_tokens`` or not a count: a broken
  engine's report, compared with nothing before (no incident), now a ``usage_drift`` incident
  naming what was wrong; in ``/v1/responses`` too, whose malformed usage was dropped whole and
  whose cached count was never read;
- **every field a client receives**: the passage in the ``top_logprobs`` alternatives (chat,
  completions, Responses), in a known field holding another type than the protocol's (a message
  that is a string, a content that is an object, arguments that are an object, ...), beside the
  message (a choice's ``text``, a stream chunk's ``message``), under a metadata key inside an
  unknown field, in a metadata field itself (``model``), in ``usage``, in a choice that is a
  string, in a key name, in a Responses refusal part's ``text``. Each is released before (the
  clean control arrives whole either way) and withheld after;
- **streams**: a choice index sent as ``1`` and ``1.0`` by turns (one choice to every client's
  JSON reader, two streams to the verifier before), text after a ``finish_reason``, text cut at
  odd points;
- **canaries** with zero-width characters between their letters or in full-width forms (what
  the leak index already folds away, :func:`verifier.shingles.fold`), whole and split across events.
"""

from __future__ import annotations

import json
import random
import time
import unicodedata
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from test_verifier_fields import COUNTER, MARK, key_of, tenant_file, victim_passage

from tests.fixtures.leak_stack import leak_stack
from verifier.probe import filler_words
from verifier.service import VerifierService

SECRETS = {"leak_index_key": b"hostile-engine-key", "cache_salt_key": b"hostile-salt", "admin_key": b"hostile-admin"}
PROMPT = "Tell me about the weather."
#: the gateway's count of PROMPT on /v1/completions (model m: cl100k, no template)
PROMPT_TOKENS = len(COUNTER.encode_text(PROMPT))
#: the canary inside the victim's passage (registered to the victim at its admission)
CANARY = "KVGATE-CANARY-0f1e2d3c4b5a6978"
#: the victim's words without its canary: what the leak tests send, so that the leak index alone finds them
VICTIM = [w for w in victim_passage()[1] if w.startswith(MARK)]


class Script:
    """What the engine answers next: ``status`` and ``body`` (a whole answer: an object, or bytes
    sent as they are) or ``events`` (a stream: each a JSON object sent as one ``data:`` event, or
    bytes sent as they are), ended with ``[DONE]`` when ``done``."""

    def __init__(self) -> None:
        self.status = 200
        self.body: Any = None
        self.events: list[Any] = []
        self.done = True
        self.requests: list[dict] = []


def build_engine(sc: Script) -> Starlette:
    async def answer(request: Request) -> Response:
        body = await request.json()
        sc.requests.append(body)
        if not body.get("stream"):
            whole = sc.body if isinstance(sc.body, bytes) else json.dumps(sc.body).encode()
            return Response(whole, status_code=sc.status, media_type="application/json")
        events = list(sc.events)

        async def gen():
            for e in events:
                yield e if isinstance(e, bytes) else b"data: " + json.dumps(e).encode() + b"\n\n"
            if sc.done:
                yield b"data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

    async def server_info(request: Request) -> Response:
        return Response(b'{"max_total_num_tokens": 16384, "context_length": 8192}', media_type="application/json")

    return Starlette(
        routes=[
            Route("/server_info", server_info),
            *(Route(p, answer, methods=["POST"]) for p in ("/v1/chat/completions", "/v1/completions", "/v1/responses")),
        ]
    )


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hostile_engine")
    sc = Script()
    sc.body = {"id": "v", "object": "text_completion", "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}]}
    passage, _ = victim_passage()
    victim = (key_of("victim"), "Please keep this: " + passage)
    verifier = {"strict_holdback_tokens": 64, "quarantine_min_prompt_tokens": 1024}
    with leak_stack(tmp, build_engine(sc), tenant_file(), SECRETS, victim, **verifier) as (svc, client):
        yield sc, svc, client


# ------------------------------------------------------------------ helpers
def filler(seed: int, n: int = 160) -> list[str]:
    rng = random.Random(seed)
    return [rng.choice(filler_words()) for _ in range(n)]


def pieces(words: list[str]) -> list[str]:
    return [w if i == 0 else " " + w for i, w in enumerate(words)]


#: what a strict answer says besides the leak, and the control's clean stand-in for the leak
SAID, CONTROL = pieces(filler(99)), pieces(filler(98))
ROUTES = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "responses": "/v1/responses"}


def send(client: httpx.Client, tid: str, route: str, stream: bool, **extra: Any) -> tuple[int, bytes]:
    """Status and the exact bytes the client received."""
    body: dict[str, Any] = {"model": "m", "stream": stream, **extra}
    if route == "chat":
        body.update(messages=[{"role": "user", "content": PROMPT}], max_tokens=400)
    elif route == "completions":
        body.update(prompt=PROMPT, max_tokens=400)
    else:
        body.update(input=PROMPT, max_output_tokens=400)
    h = {"authorization": f"Bearer {key_of(tid)}"}
    if stream:
        with client.stream("POST", ROUTES[route], json=body, headers=h) as r:
            return r.status_code, b"".join(r.iter_raw())
    r = client.post(ROUTES[route], json=body, headers=h)
    return r.status_code, r.content


def wait_idle(svc: VerifierService) -> None:
    deadline = time.monotonic() + 20
    while svc.queued_jobs or svc.stats["in_flight"]:
        assert time.monotonic() < deadline
        time.sleep(0.01)


#: a usage field left out
ABSENT = object()


def usage(prompt_tokens: Any = PROMPT_TOKENS, **more: Any) -> dict:
    u = {"prompt_tokens": prompt_tokens, "completion_tokens": 2, "total_tokens": PROMPT_TOKENS + 2, **more}
    if prompt_tokens is ABSENT:
        del u["prompt_tokens"]
    return u


def _withheld(svc: VerifierService, before: int, status: int, raw: bytes, stream: bool) -> None:
    """The answer was withheld or its stream cut, and counted once."""
    if stream and status == 200:  # cut after the response started: the gateway's error event ends it
        assert b'"code":"response_withheld"' in raw
    else:
        assert status == 502 and json.loads(raw)["error"]["code"] == "response_withheld"
    assert svc.stats["withheld"] == before + 1


def _leak_named(svc: VerifierService, since: int) -> None:
    """The one withheld incident since ``since`` is the leak index's, naming the victim."""
    (inc,) = [i for i in svc.incidents.recent[since:] if i.withheld]
    assert (inc.detector, inc.tenant, inc.evidence["source_tenant"]) == ("leak_index", "s", "victim")


# ------------------------------------------------------------------ 1. usage drift
def completion_script(sc: Script, stream: bool, u: dict, *, usage_events: list[dict] | None = None) -> None:
    """A completions answer of 2 words whose usage is ``u`` (streams: in the usage chunk)."""
    if not stream:
        sc.body = {
            "id": "c1",
            "object": "text_completion",
            "choices": [{"index": 0, "text": "Sunny today.", "finish_reason": "stop"}],
            "usage": u,
        }
        return
    chunk = {"id": "c1", "object": "text_completion", "model": "m"}
    sc.events = [
        {**chunk, "choices": [{"index": 0, "text": "Sunny", "finish_reason": None}]},
        {**chunk, "choices": [{"index": 0, "text": " today.", "finish_reason": "stop"}]},
        *(usage_events if usage_events is not None else [{**chunk, "choices": [], "usage": u}]),
    ]


#: usage.prompt_tokens as a broken engine reports it -> what the incident names
MALFORMED = {
    "float": (float(PROMPT_TOKENS), "prompt_tokens:float"),
    "past_64_bits": (2**70, "prompt_tokens:float"),  # orjson reads it as 1.18e21
    "string": (str(PROMPT_TOKENS), "prompt_tokens:str"),
    "bool": (True, "prompt_tokens:bool"),
    "null": (None, "prompt_tokens:null"),
    "list": ([PROMPT_TOKENS], "prompt_tokens:list"),
    "absent": (ABSENT, "prompt_tokens:missing"),
}


def _drift_incidents(svc: VerifierService, since: int) -> list:
    return [i for i in svc.incidents.recent[since:] if i.detector == "usage_drift"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("form", sorted(MALFORMED))
def test_malformed_prompt_tokens_is_a_drift_incident(stack, form, stream):
    """Before, ``check_usage`` compared only an int ``prompt_tokens`` and returned nothing for
    anything else: an engine reporting ``12.0``, ``"12"``, ``true``, ``null``, nothing, or a count
    past 64 bits (a float once read) was never flagged. Now a ``usage_drift`` incident names it;
    the strict tenant still gets its answer (drift is never withheld)."""
    sc, svc, client = stack
    value, code = MALFORMED[form]
    completion_script(sc, stream, usage(value))
    n = len(svc.incidents.recent)
    status, raw = send(client, "s", "completions", stream)
    assert status == 200 and b"Sunny" in raw and b"response_withheld" not in raw
    (inc,) = _drift_incidents(svc, n)
    ev = {k: v for k, v in inc.evidence.items() if k != "request_id"}
    assert (inc.tenant, inc.withheld) == ("s", False)
    assert ev == {
        "prompt_tokens": PROMPT_TOKENS,
        "gateway_prompt_tokens": PROMPT_TOKENS,
        "engine_prompt_tokens": None,
        "difference_tokens": None,
        "tolerance_tokens": 0,
        "malformed_usage": [code],
    }


@pytest.mark.timeout(60)
def test_malformed_prompt_tokens_of_a_sampled_answer_is_a_drift_incident(stack):
    """The same through the background check of a sampled (not strict) tenant."""
    sc, svc, client = stack
    completion_script(sc, False, usage(str(PROMPT_TOKENS)))
    n = len(svc.incidents.recent)
    assert send(client, "a", "completions", False)[0] == 200
    wait_idle(svc)
    (inc,) = _drift_incidents(svc, n)
    assert (inc.tenant, inc.evidence["malformed_usage"], inc.evidence["engine_prompt_tokens"]) == (
        "a",
        ["prompt_tokens:str"],
        None,
    )


#: ``prompt_tokens_details.cached_tokens`` -> what the incident names (prompt_tokens itself right)
CACHED = {
    "above_prompt": (PROMPT_TOKENS + 5, "cached_tokens>prompt_tokens"),
    "negative": (-1, "cached_tokens<0"),
    "string": ("3", "cached_tokens:str"),
    "float": (3.0, "cached_tokens:float"),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("form", sorted(CACHED))
def test_impossible_cached_tokens_is_a_drift_incident(stack, form, stream):
    """A prompt-cache hit larger than the prompt, negative, or not a count: the latency detector
    reads it as "not said" (so a strict answer too fast is only an alert, not withheld), and
    before nothing else looked: no trace. Now a ``usage_drift`` incident names it."""
    sc, svc, client = stack
    value, code = CACHED[form]
    completion_script(sc, stream, usage(prompt_tokens_details={"cached_tokens": value}))
    n = len(svc.incidents.recent)
    assert send(client, "s", "completions", stream)[0] == 200
    (inc,) = _drift_incidents(svc, n)
    ev = inc.evidence
    assert (ev["engine_prompt_tokens"], ev["difference_tokens"], ev["malformed_usage"]) == (PROMPT_TOKENS, 0, [code])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_an_honest_usage_is_no_incident(stack, stream):
    """The control: the right count, a cache hit inside the prompt or ``null`` details."""
    sc, svc, client = stack
    for details in ({"cached_tokens": 3}, {"cached_tokens": None}, None):
        completion_script(sc, stream, usage(prompt_tokens_details=details))
        n = len(svc.incidents.recent)
        assert send(client, "s", "completions", stream)[0] == 200
        assert _drift_incidents(svc, n) == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("value", [-1, 2**64 - 1], ids=["negative", "uint64_max"])
def test_an_int_prompt_tokens_out_of_range_was_already_an_incident(stack, value):
    """Held before: ``-1`` and ``2**64 - 1`` (an int to orjson) are compared and clamped."""
    sc, svc, client = stack
    completion_script(sc, False, usage(value))
    n = len(svc.incidents.recent)
    assert send(client, "s", "completions", False)[0] == 200
    (inc,) = _drift_incidents(svc, n)
    assert (inc.evidence["engine_prompt_tokens"], "malformed_usage" in inc.evidence) == (min(value, 2**63 - 1), False)


@pytest.mark.timeout(60)
def test_usage_in_a_chunk_before_the_last_is_still_compared(stack):
    """Held before: a usage of 1 prompt token carried by the first text chunk only (no usage chunk
    at the end) is what the stream reported, and it is compared."""
    sc, svc, client = stack
    first = {"id": "c1", "choices": [{"index": 0, "text": "Sunny", "finish_reason": None}], "usage": usage(1)}
    last = {"id": "c1", "choices": [{"index": 0, "text": " today.", "finish_reason": "stop"}]}
    completion_script(sc, True, usage(), usage_events=[])
    sc.events = [first, last]
    n = len(svc.incidents.recent)
    assert send(client, "s", "completions", True)[0] == 200
    (inc,) = _drift_incidents(svc, n)
    assert (inc.evidence["engine_prompt_tokens"], inc.evidence["difference_tokens"]) == (1, 1 - PROMPT_TOKENS)


@pytest.mark.timeout(60)
def test_usage_reports_that_disagree_within_a_stream_are_an_incident(stack):
    """A stream reporting 1 prompt token in one chunk and the right count in its last: an
    engine's prompt count does not change within one answer, so the two reports disagreeing is
    the drift; the verifier only sees the merged report (the right count)."""
    sc, svc, client = stack
    first = {"id": "c1", "choices": [{"index": 0, "text": "Sunny", "finish_reason": None}], "usage": usage(1)}
    completion_script(sc, True, usage())
    sc.events.insert(0, first)
    n = len(svc.incidents.recent)
    assert send(client, "s", "completions", True)[0] == 200
    assert len(_drift_incidents(svc, n)) == 1


def response_body(u: dict, output: list | None = None) -> dict:
    out = output or [
        {
            "type": "message",
            "id": "msg_1",
            "status": "completed",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Sunny today.", "annotations": []}],
        }
    ]
    return {"id": "resp_1", "object": "response", "status": "completed", "model": "m", "output": out, "usage": u}


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "u,code",
    [
        ({"input_tokens": "9", "output_tokens": 2, "total_tokens": 11}, "prompt_tokens:str"),
        ({"input_tokens": 9.0, "output_tokens": 2, "total_tokens": 11}, "prompt_tokens:float"),
        ({"output_tokens": 2, "total_tokens": 2}, "prompt_tokens:missing"),
    ],
    ids=["string", "float", "absent"],
)
def test_malformed_responses_usage_is_a_drift_incident(stack, u, code):
    """``/v1/responses``: before, a usage whose ``input_tokens`` was not an int was dropped whole
    (``response_usage`` returned ``None``), so nothing was compared; now it is the same
    ``usage_drift`` incident as chat's."""
    sc, svc, client = stack
    sc.body = response_body(u)
    n = len(svc.incidents.recent)
    status, raw = send(client, "s", "responses", False)
    assert status == 200 and b"Sunny today." in raw
    (inc,) = _drift_incidents(svc, n)
    ev = inc.evidence
    assert ev["gateway_prompt_tokens"] == ev["prompt_tokens"] > 0
    assert (ev["engine_prompt_tokens"], ev["malformed_usage"]) == (None, [code])


@pytest.mark.timeout(60)
def test_responses_cached_tokens_are_read(stack):
    """``/v1/responses`` names the cache hit ``usage.input_tokens_details.cached_tokens``; before it
    was dropped (so the latency detector never knew a Responses answer's cached count, and a strict
    one too fast was never withheld). Now it is read as chat's: one above the prompt is named."""
    sc, svc, client = stack
    sc.body = response_body({"input_tokens": 1, "output_tokens": 2, "total_tokens": 3})
    n = len(svc.incidents.recent)
    assert send(client, "s", "responses", False)[0] == 200
    (honest_count,) = _drift_incidents(svc, n)  # 1 against the gateway's count: the count we need
    count = honest_count.evidence["gateway_prompt_tokens"]
    details = {"cached_tokens": count + 1}
    sc.body = response_body({"input_tokens": count, "input_tokens_details": details, "output_tokens": 2})
    n = len(svc.incidents.recent)
    assert send(client, "s", "responses", False)[0] == 200
    (inc,) = _drift_incidents(svc, n)
    assert (inc.evidence["engine_prompt_tokens"], inc.evidence["malformed_usage"]) == (
        count,
        ["cached_tokens>prompt_tokens"],
    )


# ------------------------------------------------------------------ 2. every field a client receives
#: a leak placement: (holder "message"/"delta", what the choice says, the leak's pieces) -> (the
#: answer's choices, its other top-level fields)
Placement = Callable[[str, list[str], list[str]], tuple[list[Any], dict[str, Any]]]


def _msg(holder: str, said: list[str], **fields: Any) -> dict:
    return {"index": 0, holder: {"role": "assistant", "content": "".join(said), **fields}}


def _top_logprobs(holder: str, said: list[str], leak: list[str]) -> tuple[list, dict]:
    """The sampled tokens say ``said``; the second most likely token at each position spells the leak."""
    items = [
        {"token": s, "logprob": -0.1, "top_logprobs": [{"token": s, "logprob": -0.1}, {"token": x, "logprob": -2.5}]}
        for s, x in zip(said, leak, strict=False)
    ]
    return [{**_msg(holder, said), "logprobs": {"content": items}}], {}


CHAT: dict[str, Placement] = {
    "top_logprobs": _top_logprobs,
    "message_is_a_string": lambda h, s, x: ([{"index": 0, h: "".join(x)}], {}),
    "content_is_an_object": lambda h, s, x: ([{"index": 0, h: {"content": {"text": "".join(x)}}}], {}),
    "content_parts_are_strings": lambda h, s, x: ([{"index": 0, h: {"content": ["".join(x)]}}], {}),
    "reasoning_is_a_list": lambda h, s, x: ([_msg(h, s, reasoning_content=["".join(x)])], {}),
    "arguments_are_an_object": lambda h, s, x: (
        [
            _msg(
                h,
                s,
                tool_calls=[
                    {
                        "index": 0,
                        "id": "call_0",
                        "type": "function",
                        "function": {"name": "save", "arguments": {"note": "".join(x)}},
                    }
                ],
            )
        ],
        {},
    ),
    "text_beside_the_message": lambda h, s, x: ([{**_msg(h, s), "text": "".join(x)}], {}),
    "ids_inside_an_unknown_field": lambda h, s, x: ([_msg(h, s, x_refs=[{"id": p} for p in x])], {}),
    "usage_note": lambda h, s, x: ([_msg(h, s)], {"usage": {**usage(), "note": "".join(x)}}),
    "a_choice_that_is_a_string": lambda h, s, x: ([_msg(h, s), "".join(x)], {}),
    "a_key_holding_the_text": lambda h, s, x: ([_msg(h, s, **{"".join(x): True})], {}),
}


def chat_answer(place: str, stream: bool, leak: list[str]) -> Any:
    """Script the chat answer with ``leak`` placed by ``CHAT[place]`` (a stream: one piece per chunk)."""
    chunk = {"id": "x1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    if not stream:
        choices, top = CHAT[place]("message", SAID, leak)
        return {
            "id": "x1",
            "object": "chat.completion",
            "created": 1,
            "model": "m",
            "choices": choices,
            "usage": usage(),
            **top,
        }
    events = []
    for s, x in zip(SAID, leak, strict=False):
        choices, top = CHAT[place]("delta", [s], [x])
        events.append({**chunk, "choices": choices, **top})
    events.append({**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    return events


COMPLETIONS: dict[str, Placement] = {
    "top_logprobs_keys": lambda h, s, x: (
        [
            {
                "index": 0,
                "text": "".join(s),
                "logprobs": {
                    "tokens": s,
                    "token_logprobs": [-0.1] * len(s),
                    "top_logprobs": [{a: -0.1, b: -2.5} for a, b in zip(s, x, strict=False)],
                },
            }
        ],
        {},
    ),
    "text_is_a_list": lambda h, s, x: ([{"index": 0, "text": ["".join(x)]}], {}),
}


def completions_answer(place: str, stream: bool, leak: list[str]) -> Any:
    if not stream:
        choices, top = COMPLETIONS[place]("", SAID, leak)
        return {"id": "c1", "object": "text_completion", "model": "m", "choices": choices, "usage": usage(), **top}
    events = []
    for s, x in zip(SAID, leak, strict=False):
        choices, top = COMPLETIONS[place]("", [s], [x])
        events.append({"id": "c1", "object": "text_completion", "model": "m", "choices": choices, **top})
    events.append({"id": "c1", "choices": [{"index": 0, "text": "", "finish_reason": "stop"}]})
    return events


def _part(said: list[str], leak: list[str] | None = None, text: Any = None) -> dict:
    part: dict = {"type": "output_text", "text": "".join(said) if text is None else text, "annotations": []}
    if leak is not None:
        part["logprobs"] = [
            {
                "token": s,
                "logprob": -0.1,
                "top_logprobs": [{"token": s, "logprob": -0.1}, {"token": x, "logprob": -2.5}],
            }
            for s, x in zip(said, leak, strict=False)
        ]
    return part


def _message_item(*parts: dict, **more: Any) -> dict:
    return {
        "type": "message",
        "id": "msg_1",
        "status": "completed",
        "role": "assistant",
        "content": list(parts),
        **more,
    }


RESPONSES: dict[str, Callable[[list[str], list[str]], list[dict]]] = {
    "top_logprobs": lambda s, x: [_message_item(_part(s, x))],
    "arguments_are_an_object": lambda s, x: [
        _message_item(_part(s)),
        {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "save", "arguments": {"note": "".join(x)}},
    ],
    "text_is_a_list": lambda s, x: [_message_item(_part(s, text=["".join(x)]))],
    "statuses_inside_an_unknown_field": lambda s, x: [_message_item(_part(s), x_steps=[{"status": p} for p in x])],
    "text_of_a_refusal_part": lambda s, x: [
        _message_item({"type": "refusal", "refusal": "".join(s), "text": "".join(x)}),
    ],
}


def responses_answer(place: str, stream: bool, leak: list[str]) -> Any:
    u = {"input_tokens": 9, "output_tokens": 2, "total_tokens": 11}
    if not stream:
        return response_body(u, RESPONSES[place](SAID, leak))
    assert place == "top_logprobs"
    msg = _message_item(_part(SAID))
    evs: list[dict] = [
        {"type": "response.created", "response": {"id": "resp_1", "status": "in_progress", "output": []}},
        {"type": "response.output_item.added", "output_index": 0, "item": {**msg, "content": []}},
    ]
    for s, x in zip(SAID, leak, strict=False):
        lp = [
            {
                "token": s,
                "logprob": -0.1,
                "top_logprobs": [{"token": s, "logprob": -0.1}, {"token": x, "logprob": -2.5}],
            }
        ]
        evs.append(
            {"type": "response.output_text.delta", "output_index": 0, "content_index": 0, "delta": s, "logprobs": lp}
        )
    evs.append({"type": "response.output_item.done", "output_index": 0, "item": msg})
    evs.append({"type": "response.completed", "response": response_body(u, [msg])})
    for n, e in enumerate(evs):
        e["sequence_number"] = n
    return evs


ANSWERS = {
    "chat": (CHAT, chat_answer),
    "completions": (COMPLETIONS, completions_answer),
    "responses": (RESPONSES, responses_answer),
}
FIELD_CASES = [
    *[("chat", p, s) for p in CHAT for s in (False, True)],
    *[("completions", p, s) for p in COMPLETIONS for s in (False, True)],
    *[("responses", p, False) for p in RESPONSES],
    ("responses", "top_logprobs", True),
]


def script_answer(sc: Script, route: str, place: str, stream: bool, leak: list[str]) -> None:
    answer = ANSWERS[route][1](place, stream, leak)
    if stream:
        sc.events, sc.done, sc.body = answer, route != "responses", None
    else:
        sc.body, sc.events = answer, []


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "route,place,stream", FIELD_CASES, ids=[f"{r}-{p}-{'stream' if s else 'whole'}" for r, p, s in FIELD_CASES]
)
def test_another_tenants_text_in_any_field_a_client_receives_is_withheld(stack, route, place, stream):
    """The victim's passage where a client receives it but the verifier did not read it: the
    clean control arrives whole (every word of it in the bytes), the leak leaves not one victim
    byte and is counted as withheld. Before, each of these was released whole."""
    sc, svc, client = stack
    words = VICTIM
    script_answer(sc, route, place, stream, CONTROL)
    status, raw = send(client, "s", route, stream)
    assert status == 200 and b"response_withheld" not in raw
    assert all(p.strip().encode() in raw for p in CONTROL)
    script_answer(sc, route, place, stream, pieces(words))
    before, n = svc.stats["withheld"], len(svc.incidents.recent)
    status, raw = send(client, "s", route, stream)
    assert MARK.encode() not in raw
    _withheld(svc, before, status, raw, stream)
    _leak_named(svc, n)
    assert not svc.quarantine.records()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_another_tenants_text_in_a_long_model_name_is_withheld(stack, stream):
    """A metadata field (``model``) holding the passage: ids and names are metadata only while
    they are as short as one (at most 256 characters); before, any length was skipped."""
    sc, svc, client = stack
    words = VICTIM

    def script(model: str) -> None:
        msg = {"role": "assistant", "content": "".join(SAID)}
        if stream:
            first = {"id": "x1", "model": model, "choices": [{"index": 0, "delta": msg}]}
            sc.events = [
                first,
                {"id": "x1", "model": "m", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
            ]
            sc.done = True
        else:
            sc.body = {
                "id": "x1",
                "object": "chat.completion",
                "model": model,
                "choices": [{"index": 0, "message": msg}],
            }

    script(" ".join(filler(98)))
    status, raw = send(client, "s", "chat", stream)
    assert status == 200 and " ".join(filler(98)).encode() in raw
    script(" ".join(words))
    before, n = svc.stats["withheld"], len(svc.incidents.recent)
    status, raw = send(client, "s", "chat", stream)
    assert MARK.encode() not in raw
    _withheld(svc, before, status, raw, stream)
    _leak_named(svc, n)


def _sse(obj: Any) -> bytes:
    """An event as the scripted engine writes it (``json.dumps``' separators)."""
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _withheld_tail(inc_id: str) -> bytes:
    """What ends a strict stream withheld after it started: the error event and ``[DONE]``."""
    withheld = {
        "message": f"The response was withheld by verification (incident {inc_id}).",
        "type": "server_error",
        "param": None,
        "code": "response_withheld",
    }
    return b"data: " + json.dumps({"error": withheld}, separators=(",", ":")).encode() + b"\n\ndata: [DONE]\n\n"


def _fingerprint_events(fingerprints: list[str]) -> list[dict]:
    """A chat stream whose first chunk says ``ok`` and whose every chunk carries the next of
    ``fingerprints`` as its ``system_fingerprint`` (``id`` and ``model`` the same throughout)."""
    chunk = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    events = [
        {**chunk, "system_fingerprint": fp, "choices": [{"index": 0, "delta": {"content": "ok" if k == 0 else ""}}]}
        for k, fp in enumerate(fingerprints)
    ]
    fin = {"index": 0, "delta": {}, "finish_reason": "stop"}
    return [*events, {**chunk, "system_fingerprint": fingerprints[-1], "choices": [fin]}]


@pytest.mark.timeout(60)
def test_another_tenants_text_spread_over_a_streams_system_fingerprint_is_withheld(stack):
    """A metadata field that changes from chunk to chunk: each chunk's ``system_fingerprint`` the
    next 40 characters of the victim's passage, which a client joins (the openai SDK hands every
    chunk's ``system_fingerprint`` on). Each was at most 256 characters, so each was skipped as
    metadata, and a strict tenant got the whole passage with 200. Now a value is metadata only
    while it equals the stream's first (:class:`verifier.engine_response.StreamMeta`): the leak
    index finds the passage and the stream ends as any withheld stream does, nothing of it
    released. An honest stream, the same fingerprint in every chunk, is relayed byte for byte."""
    sc, svc, client = stack
    honest = _fingerprint_events(["fp_0a1b2c3d"] * 12)
    sc.events, sc.done = honest, True
    status, raw = send(client, "s", "chat", True)
    assert (status, raw) == (200, b"".join(map(_sse, honest)) + b"data: [DONE]\n\n")
    leak = " ".join(VICTIM)
    sc.events = _fingerprint_events([leak[i : i + 40] for i in range(0, len(leak), 40)])
    before, n = svc.stats["withheld"], len(svc.incidents.recent)
    status, raw = send(client, "s", "chat", True)
    _leak_named(svc, n)
    (inc,) = [i for i in svc.incidents.recent[n:] if i.withheld]
    assert (status, raw) == (200, _withheld_tail(inc.id))
    assert svc.stats["withheld"] == before + 1


# ------------------------------------------------------------------ key names and Responses ids
def _victims_incident(svc: VerifierService, since: int, detector: str) -> Any:
    """The one withheld incident since ``since``: ``detector``'s (``leak_index`` or ``canary``), of
    the strict tenant, naming the victim."""
    (inc,) = [i for i in svc.incidents.recent[since:] if i.withheld]
    if detector == "leak_index":
        assert (inc.detector, inc.tenant, inc.evidence["source_tenant"]) == (detector, "s", "victim")
    else:
        assert (inc.detector, inc.tenant, inc.evidence["source_tenants"]) == (detector, "s", ["victim"])
    return inc


_CHUNK = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m", "x_engine_step": 0}


def _keyed_chunks(said: list[str], names: list[str]) -> list[dict]:
    """A vLLM-like chat stream (``token_ids`` and ``stop_reason`` in its choices; an engine field
    of its own, ``x_engine_step``, in every chunk) saying ``said``, one piece a chunk, then one
    chunk for each of ``names`` carrying it as a key name of its own (value 1)."""

    def choice(delta: dict, **more: Any) -> dict:
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None, "token_ids": [7], **more}

    events = [{**_CHUNK, "choices": [choice({"role": "assistant", "content": said[0]})]}]
    events += [{**_CHUNK, "choices": [choice({"content": s})]} for s in said[1:]]
    events += [{**_CHUNK, "choices": [choice({"content": ""})], name: 1} for name in names]
    fin = choice({}, finish_reason="stop", stop_reason=None)
    return [*events, {**_CHUNK, "choices": [fin]}]


@pytest.mark.timeout(60)
def test_another_tenants_text_spread_over_a_streams_key_names_is_withheld(stack):
    """A key name that names no field, a new one in each chunk: the victim's words one a chunk
    (a client that prints the JSON reads them; the openai SDK keeps them in ``model_extra``).
    Identifier key names were read only for canaries, so a strict tenant got the passage with
    200. Now a key name no earlier chunk sent is text (:class:`verifier.engine_response.StreamMeta`):
    the leak index finds the passage and the stream ends as any withheld stream does, nothing of
    it released; a canary as a key name is a canary incident (as before). The same names in a
    whole answer are its ``-:key_names`` text: 502 ``response_withheld``. An honest stream, the
    engine's own ``x_engine_step`` in every chunk, is relayed byte for byte."""
    sc, svc, client = stack
    honest = _keyed_chunks(SAID[:12], [])
    sc.events, sc.done = honest, True
    assert send(client, "s", "chat", True) == (200, b"".join(map(_sse, honest)) + b"data: [DONE]\n\n")
    for names, detector in ((VICTIM, "leak_index"), (["x_trace", CANARY], "canary")):
        sc.events = _keyed_chunks(["ok"], names)
        before, n = svc.stats["withheld"], len(svc.incidents.recent)
        status, raw = send(client, "s", "chat", True)
        assert MARK.encode() not in raw and CANARY.encode() not in raw
        inc = _victims_incident(svc, n, detector)
        assert (status, raw) == (200, _withheld_tail(inc.id))
        assert svc.stats["withheld"] == before + 1
    choice = {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}
    sc.body = {"id": "x1", "object": "chat.completion", "model": "m", "choices": [choice], **dict.fromkeys(VICTIM, 1)}
    before, n = svc.stats["withheld"], len(svc.incidents.recent)
    status, raw = send(client, "s", "chat", False)
    assert MARK.encode() not in raw
    inc = _victims_incident(svc, n, "leak_index")
    message = f"The response was withheld by verification (incident {inc.id})."
    error = {"message": message, "type": "server_error", "param": None, "code": "response_withheld"}
    assert (status, json.loads(raw)) == (502, {"error": error})
    assert svc.stats["withheld"] == before + 1


def _response_events(
    said: list[str], place: str = "", leak: list[str] | None = None, numbered: bool = True
) -> list[dict]:
    """A vLLM-like ``/v1/responses`` stream (``response.created``, the message item added, its
    part, one text delta a piece of ``said``, the ``*.done`` events, ``response.completed``),
    numbered when ``numbered``. With ``place``, one delta more for each piece of ``leak``, which
    it carries as that delta's ``item_id`` or as an ``obfuscation`` or ``status`` member."""
    resp = {"id": "resp_1", "object": "response", "created_at": 1, "model": "m", "status": "in_progress", "output": []}
    where = {"item_id": "msg_1", "output_index": 0, "content_index": 0}
    part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
    evs: list[dict] = [
        {"type": "response.created", "response": resp},
        {"type": "response.output_item.added", "output_index": 0, "item": _message_item(status="in_progress")},
        {"type": "response.content_part.added", **where, "part": part},
    ]
    evs += [{"type": "response.output_text.delta", **where, "delta": s, "logprobs": []} for s in said]
    evs += [{"type": "response.output_text.delta", **where, "delta": "", "logprobs": [], place: x} for x in leak or ()]
    text = "".join(said)
    msg = _message_item(_part([text]))
    evs += [
        {"type": "response.output_text.done", **where, "text": text, "logprobs": []},
        {"type": "response.content_part.done", **where, "part": msg["content"][0]},
        {"type": "response.output_item.done", "output_index": 0, "item": msg},
        {"type": "response.completed", "response": {**resp, "status": "completed", "output": [msg], "usage": None}},
    ]
    for k, e in enumerate(evs if numbered else ()):
        e["sequence_number"] = k
    return evs


@pytest.mark.timeout(60)
@pytest.mark.parametrize("place", ["item_id", "obfuscation", "status"])
def test_another_tenants_text_in_a_responses_streams_item_ids_or_metadata_is_withheld(stack, place):
    """``/v1/responses``: each event's metadata was skipped up to 256 characters (a canary read):
    the victim's passage 40 characters an event in ``item_id`` (no item of that id was added),
    ``obfuscation`` (OpenAI's random padding, which vLLM and SGLang do not send) or ``status`` (a
    word of a fixed vocabulary) reached a strict tenant whole with 200. Now an ``item_id`` is
    metadata only when it names an item the stream added, a ``status`` only when it is a status,
    and ``obfuscation`` is text: the stream ends with the Responses error event (the events carry
    no ``sequence_number``, so it has none), nothing of it released; a canary there is a canary
    incident (as before). An honest vLLM stream is relayed byte for byte."""
    sc, svc, client = stack
    honest = _response_events(SAID[:12])
    sc.events, sc.done = honest, False
    assert send(client, "s", "responses", True) == (200, b"".join(map(_sse, honest)))
    leak = " ".join(VICTIM)
    planted = [leak[i : i + 40] for i in range(0, len(leak), 40)]
    for pieces_, detector in ((planted, "leak_index"), ([CANARY], "canary")):
        sc.events = _response_events(["ok"], place, pieces_, numbered=False)
        before, n = svc.stats["withheld"], len(svc.incidents.recent)
        status, raw = send(client, "s", "responses", True)
        assert MARK.encode() not in raw and CANARY.encode() not in raw
        inc = _victims_incident(svc, n, detector)
        error = {
            "type": "error",
            "code": "response_withheld",
            "message": f"The response was withheld by verification (incident {inc.id}).",
            "param": None,
        }
        assert (status, raw) == (
            200,
            b"event: error\ndata: " + json.dumps(error, separators=(",", ":")).encode() + b"\n\n",
        )
        assert svc.stats["withheld"] == before + 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("field", ["id", "model"])
def test_a_canary_in_an_answers_id_or_model_is_withheld(stack, field, stream):
    """The victim's canary as the answer's ``id`` or ``model`` (in every chunk of a stream, the
    same: the stream's first value): 30 characters, metadata's length, so it was never shown to
    the guard. Every metadata string is now read for canaries whatever its length: a ``canary``
    incident naming the victim, withheld."""
    sc, svc, client = stack
    meta = {"id": "chatcmpl-1", "model": "m", field: CANARY}
    if stream:
        chunk = {**meta, "object": "chat.completion.chunk"}
        sc.events = [{**chunk, "choices": [{"index": 0, "delta": {"content": s}}]} for s in SAID]
        sc.events.append({**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
        sc.done = True
    else:
        choice = {"index": 0, "message": {"role": "assistant", "content": "".join(SAID)}, "finish_reason": "stop"}
        sc.body = {**meta, "object": "chat.completion", "choices": [choice]}
    before, n = svc.stats["withheld"], len(svc.incidents.recent)
    status, raw = send(client, "s", "chat", stream)
    assert CANARY.encode() not in raw
    _withheld(svc, before, status, raw, stream)
    (inc,) = [i for i in svc.incidents.recent[n:] if i.detector == "canary"]
    assert (inc.tenant, inc.confirmed, inc.withheld, inc.evidence["source_tenants"]) == ("s", True, True, ["victim"])


@pytest.mark.timeout(60)
def test_a_stream_chunk_carrying_a_message_instead_of_a_delta_is_withheld(stack):
    """A chunk whose choice holds a ``message`` (a whole answer's key): read as the chunk's text
    (checked), where before only ``delta`` was read and ``message`` was skipped as known."""
    sc, svc, client = stack
    words = VICTIM
    chunk = {"id": "x1", "object": "chat.completion.chunk", "model": "m"}

    def script(leak: list[str]) -> None:
        sc.events = [
            {**chunk, "choices": [{"index": 0, "delta": {"content": s}, "message": {"content": x}}]}
            for s, x in zip(SAID, leak, strict=False)
        ] + [{**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}]
        sc.done = True

    script(CONTROL)
    status, raw = send(client, "s", "chat", True)
    assert status == 200 and b"response_withheld" not in raw
    script(pieces(words))
    before, n = svc.stats["withheld"], len(svc.incidents.recent)
    status, raw = send(client, "s", "chat", True)
    assert MARK.encode() not in raw
    _withheld(svc, before, status, raw, True)
    _leak_named(svc, n)


# ------------------------------------------------------------------ 3. streams
def _two_choice_events(leak: list[str], index_of: Callable[[int], Any]) -> list[dict]:
    """Choice 0 says ``SAID``; choice 1 says ``leak``, its ``k``-th chunk's index ``index_of(k)``."""
    chunk = {"id": "x1", "object": "chat.completion.chunk", "model": "m"}
    events = []
    for k, (s, x) in enumerate(zip(SAID, leak, strict=False)):
        events.append({**chunk, "choices": [{"index": 0, "delta": {"content": s}}]})
        events.append({**chunk, "choices": [{"index": index_of(k), "delta": {"content": x}}]})
    fin = [{"index": i, "delta": {}, "finish_reason": "stop"} for i in (0, 1)]
    return [*events, {**chunk, "choices": fin}]


def _choice_text(raw: bytes, index: int) -> str:
    """What a client's JSON reader makes of choice ``index``: JSON's ``1.0`` is the number 1
    (``json.loads`` gives ``1.0 == 1``; ``JSON.parse`` the same number)."""
    out = []
    for line in raw.split(b"\n"):
        if line.startswith(b"data: {"):
            for c in json.loads(line[6:]).get("choices") or ():
                if c.get("index") == index and isinstance((c.get("delta") or {}).get("content"), str):
                    out.append(c["delta"]["content"])
    return "".join(out)


@pytest.mark.timeout(60)
def test_a_choice_index_sent_as_1_and_1_0_by_turns_is_one_choice(stack):
    """Choice 1's chunks say index ``1`` and ``1.0`` by turns: one choice to every client (1.0 is
    the number 1 in JSON), and before, two to the verifier (``1.0`` is not an int, so it was read
    at its position, 0, into choice 0's stream): no stream held the passage contiguously, and it
    was released whole. Now an integral number is the index it names."""
    sc, svc, client = stack
    words = VICTIM
    sc.events, sc.done = _two_choice_events(CONTROL, lambda k: 1 if k % 2 else 1.0), True
    status, raw = send(client, "s", "chat", True, n=2)
    assert status == 200 and _choice_text(raw, 1) == "".join(CONTROL)
    sc.events = _two_choice_events(pieces(words), lambda k: 1 if k % 2 else 1.0)
    before, n = svc.stats["withheld"], len(svc.incidents.recent)
    status, raw = send(client, "s", "chat", True, n=2)
    assert MARK.encode() not in raw
    _withheld(svc, before, status, raw, True)
    _leak_named(svc, n)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shape", ["after_finish_reason", "three_characters_per_event"])
def test_stream_shapes_that_were_already_checked(stack, shape):
    """Held before: the passage sent after choice 0's ``finish_reason`` (before ``[DONE]``), or
    cut every three characters (mid-word, mid-canary): withheld, not one victim byte."""
    sc, svc, client = stack
    passage, _ = victim_passage()
    chunk = {"id": "x1", "object": "chat.completion.chunk", "model": "m"}
    if shape == "after_finish_reason":
        texts = ["Sunny.", *pieces(passage.split(" "))]
    else:
        texts = ["Sunny. ", *(passage[i : i + 3] for i in range(0, len(passage), 3))]
    events = [{**chunk, "choices": [{"index": 0, "delta": {"content": t}}]} for t in texts]
    stop = {**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
    if shape == "after_finish_reason":
        events.insert(1, stop)
    else:
        events.append(stop)
    sc.events, sc.done = events, True
    before, n = svc.stats["withheld"], len(svc.incidents.recent)
    status, raw = send(client, "s", "chat", True)
    assert MARK.encode() not in raw
    _withheld(svc, before, status, raw, True)
    _leak_named(svc, n)


# ------------------------------------------------------------------ 4. canaries
def received_text(raw: bytes) -> str:
    """Every string of every JSON object the client received, as it reads them: NFKC, without
    the zero-width and soft-hyphen marks (plain JSON walking, not the parser under test)."""
    out: list[str] = []

    def walk(x: Any) -> None:
        if isinstance(x, str):
            out.append(x)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    for line in raw.split(b"\n") if raw.startswith(b"data:") else [raw]:
        body = line[6:] if line.startswith(b"data: ") else line
        if body.startswith(b"{"):
            walk(json.loads(body))
    text = unicodedata.normalize("NFKC", "".join(out))
    return "".join(c for c in text if c not in "\u200b\u200c\u2060\u00ad")


def zero_width(text: str, mark: str) -> str:
    return mark.join(text)


def full_width(text: str) -> str:
    """The full-width forms of printable ASCII (U+FF01-FF5E): NFKC gives the ASCII back."""
    return "".join(chr(ord(c) + 0xFEE0) if "!" <= c <= "~" else c for c in text)


CANARY_FORMS = {
    "zero_width_space": zero_width(CANARY, "\u200b"),
    "word_joiner": zero_width(CANARY, "\u2060"),
    "soft_hyphen": zero_width(CANARY, "\u00ad"),
    "full_width": full_width(CANARY),
    "math_bold_and_zero_width": zero_width(CANARY[:6], "\u200c")
    + CANARY[6:14]
    + "".join(chr(0x1D7CE + int(c)) if c.isdigit() else c for c in CANARY[14:]),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("form", sorted(CANARY_FORMS))
def test_a_canary_in_another_unicode_form_is_withheld(stack, form, stream):
    """The victim's canary with zero-width characters between its letters, or in full-width or
    mathematical forms: a client shows (and copies) the same canary, and the leak index folds
    these away (:func:`verifier.shingles.fold`), but the canary scan read raw code points and
    released it. Now the scan reads the text folded alike: a ``canary`` incident naming the
    victim, withheld (streams: split every 5 characters)."""
    sc, svc, client = stack
    text = "Your code is " + CANARY_FORMS[form] + ", keep it."
    chunk = {"id": "x1", "object": "chat.completion.chunk", "model": "m"}
    if stream:
        sc.events = [
            {**chunk, "choices": [{"index": 0, "delta": {"content": text[i : i + 5]}}]} for i in range(0, len(text), 5)
        ]
        sc.events.append({**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
        sc.done = True
    else:
        msg = {"role": "assistant", "content": text}
        sc.body = {
            "id": "x1",
            "object": "chat.completion",
            "model": "m",
            "choices": [{"index": 0, "message": msg, "finish_reason": "stop"}],
        }
    before, n = svc.stats["withheld"], len(svc.incidents.recent)
    status, raw = send(client, "s", "chat", stream)
    assert CANARY not in received_text(raw)
    _withheld(svc, before, status, raw, stream)
    (inc,) = [i for i in svc.incidents.recent[n:] if i.detector == "canary"]
    assert (inc.tenant, inc.confirmed, inc.withheld, inc.evidence["source_tenants"]) == ("s", True, True, ["victim"])


@pytest.mark.timeout(60)
def test_a_canary_split_across_events_was_already_withheld(stack):
    """Held before: the plain canary cut every 4 characters across events."""
    sc, svc, client = stack
    text = "Your code is " + CANARY + ", keep it."
    chunk = {"id": "x1", "object": "chat.completion.chunk", "model": "m"}
    sc.events = [
        {**chunk, "choices": [{"index": 0, "delta": {"content": text[i : i + 4]}}]} for i in range(0, len(text), 4)
    ]
    sc.events.append({**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    sc.done = True
    before = svc.stats["withheld"]
    status, raw = send(client, "s", "chat", True)
    _withheld(svc, before, status, raw, True)


@pytest.mark.timeout(60)
def test_another_tenants_text_in_an_annotation_nested_600_lists_deep_is_withheld(stack):
    """A Responses stream whose ``response.output_text.annotation.added`` event carries the
    victim's passage inside 600 nested lists (orjson reads up to 1,024): the stream is read and
    the leak withheld. Before, the annotation reader recursed once per list and raised
    ``RecursionError`` from 498 levels on."""
    sc, svc, client = stack
    msg = _message_item(_part(SAID))

    def events(words: list[str]) -> list[dict]:
        annotation: Any = {"type": "url_citation", "title": " ".join(words), "url": "https://example.com/"}
        for _ in range(600):
            annotation = [annotation]
        evs: list[dict] = [
            {"type": "response.created", "response": {"id": "resp_1", "status": "in_progress", "output": []}},
            {"type": "response.output_item.added", "output_index": 0, "item": {**msg, "content": []}},
            *[{"type": "response.output_text.delta", "output_index": 0, "content_index": 0, "delta": s} for s in SAID],
            {
                "type": "response.output_text.annotation.added",
                "output_index": 0,
                "content_index": 0,
                "annotation_index": 0,
                "annotation": annotation,
            },
            {"type": "response.output_item.done", "output_index": 0, "item": msg},
            {"type": "response.completed", "response": response_body({"input_tokens": 9, "output_tokens": 2}, [msg])},
        ]
        return [{**e, "sequence_number": n} for n, e in enumerate(evs)]

    sc.events, sc.done, sc.body = events(CONTROL), False, None
    status, raw = send(client, "s", "responses", True)
    assert status == 200 and b"response_withheld" not in raw
    assert all(p.strip().encode() in raw for p in CONTROL)
    sc.events = events(pieces(VICTIM))
    before, n = svc.stats["withheld"], len(svc.incidents.recent)
    status, raw = send(client, "s", "responses", True)
    assert MARK.encode() not in raw
    _withheld(svc, before, status, raw, True)
    _leak_named(svc, n)
