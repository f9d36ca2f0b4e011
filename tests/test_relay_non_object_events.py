"""Stream events whose ``data`` is neither a JSON object nor ``[DONE]``, against a hostile engine
(gateway/relay/sse.py, gateway/relay/stream_protocol.py, gateway/relay/stream.py): what a client
makes of each, whether the verifier reads what the client receives, and what the relay does.

- **JSON that is not an object** (``"the secret"``, ``["the secret"]``, ``42``, ``true``,
  ``null``, an array of chunk objects): the openai SDK yields the value as it is
  (``openai/_streaming.py``, ``Stream.__stream__``: ``data = sse.json()``, then
  ``process_data``, whose ``construct_type`` returns a value that is not an object unchanged and
  an array's objects as chunks). The verifier reads its strings as the event's ``"-:other"``
  text (:func:`verifier.engine_response.parse_chunk_event`), checked as any other, so such an
  event is relayed: a passage in it is withheld like one in a chunk.
- **data no JSON reader takes** (plain text, a cut object, an object followed by text): the
  openai SDK raises ``json.JSONDecodeError`` (its ``doc`` the engine's text), its JavaScript
  counterpart logs the data before it raises ("Could not parse message into JSON:"), and a
  browser's ``EventSource`` hands it to the page as a message's ``data``: the client receives the
  text, while the verifier read nothing in it (no JSON). Relayed before, a strict tenant got
  another tenant's passage in such events with 200. No honest engine sends it (vLLM and SGLang
  write each event's data with pydantic or orjson, or ``[DONE]``), so the stream now ends there
  with 502 ``upstream_unavailable``, as for JSON only a lax reader reads: an error event once the
  response started (the Responses ``error`` event in ``/v1/responses``), a 502 before.
- **events without text**: vLLM's keep-alive comment (``: keep-alive``), a bare ``:``, empty or
  blank ``data``, and ``[DONE]`` in a ``/v1/responses`` stream are relayed as before (comments
  with other text, ``event:``, ``id:`` and ``retry:`` lines: tests/test_relay_sse_fields.py).

Engines, events and request bodies: tests/relay_harness.py.
"""

from __future__ import annotations

import json
from typing import Any

import httpx2
import openai
import pytest

from tests import test_verifier_hostile_engine
from tests.relay_harness import (
    COMPLETED,
    CONTROL,
    CREATED,
    DONE,
    HEL,
    HEL_TOKENS,
    HELLO,
    HELLO_TOKENS,
    MARK,
    NOT_JSON,
    RESPONSES_BODY,
    SAID,
    STOP,
    STREAM_BODY,
    VICTIM,
    _chunk,
    _leak_named,
    _responses_error_event,
    _withheld,
    chat_stream_ended_by,
    error_event,
    error_of,
    pieces,
    send,
    through_gateway_as,
)

pytestmark = pytest.mark.timeout(60)
#: the scripted engine behind the real gateway and verifier (module-scoped: this module's own)
stack = test_verifier_hostile_engine.stack

SECRET_CHUNK = json.loads(_chunk("the secret", False)[len(b"data: ") :])


def sdk_stream(stream: bytes, route: str = "chat") -> list[Any]:
    """What the openai SDK's ``Stream`` yields for ``stream`` answering a streamed request
    (``route``: ``chat`` or ``responses``), the exception it raises last."""

    def answer(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(200, headers={"content-type": "text/event-stream"}, content=stream)

    http = httpx2.Client(transport=httpx2.MockTransport(answer))
    client = openai.OpenAI(api_key="k", base_url="http://engine.test/v1", max_retries=0, http_client=http)
    out: list[Any] = []
    try:
        if route == "chat":
            messages: Any = [{"role": "user", "content": "hi"}]
            items = client.chat.completions.create(model="m", messages=messages, stream=True)
        else:
            items = client.responses.create(model="m", input="hi", stream=True)
        out.extend(items)
    except Exception as e:
        out.append(e)
    finally:
        http.close()
    return out


# ------------------------------------------------------------------ what a client makes of them


@pytest.mark.parametrize("route", ["chat", "responses"])
@pytest.mark.parametrize(
    ("data", "value"),
    [
        (b'"the secret"', "the secret"),
        (b'["the secret"]', ["the secret"]),
        (b"42", 42),
        (b"true", True),
        (b"null", None),
    ],
    ids=["string", "array", "number", "bool", "null"],
)
def test_the_openai_sdk_yields_json_that_is_not_an_object_as_it_is(route, data, value):
    """``openai/_streaming.py``: ``data = sse.json()`` (``json.loads``), then ``process_data``,
    which hands a value that is not an object back unchanged (``None`` as ``None``): the
    application receives it as a stream item, in either protocol."""
    got = sdk_stream(b"data: " + data + b"\n\n" + DONE, route)
    assert got == [value]


def test_the_openai_sdk_yields_an_array_of_chunk_objects_as_chunks():
    """An array of chunk objects is a list of ``ChatCompletionChunk`` to the SDK
    (``construct_type`` builds each object of a list): the text reaches the application."""
    (item,) = sdk_stream(b"data: " + json.dumps([SECRET_CHUNK]).encode() + b"\n\n" + DONE)
    assert [type(c).__name__ for c in item] == ["ChatCompletionChunk"]
    assert item[0].choices[0].delta.content == "the secret"


@pytest.mark.parametrize("route", ["chat", "responses"])
def test_the_openai_sdk_raises_on_data_that_is_not_json_and_holds_its_text(route):
    """Plain text: ``sse.json()`` raises ``json.JSONDecodeError``, which carries the engine's
    text as its ``doc``; an event without data (``event:``, ``id:`` or ``retry:`` alone) is read
    as data ``""`` and raises too; a comment is skipped."""
    (e,) = sdk_stream(b"data: the secret\n\n" + DONE, route)
    assert (type(e), e.doc) == (json.JSONDecodeError, "the secret")
    for event in (b"event: ping\n\n", b"id: 7\n\n", b"retry: 100\n\n"):
        (e,) = sdk_stream(event + DONE, route)
        assert (type(e), e.doc) == (json.JSONDecodeError, "")
    assert sdk_stream(b": keep-alive\n\n" + DONE, route) == []


# ------------------------------------------------------------------ data no JSON reader takes: refused

#: data no JSON reader takes, each holding "the secret"
NOT_JSON_DATA = {
    "plain-text": b"data: the secret\n\n",
    "cut-object": b'data: {"choices": [{"index": 0, "delta": {"content": "the secret"\n\n',
    "object-then-text": b'data: {"a": 1} the secret\n\n',
    "two-lines": b"data: the\ndata: secret\n\n",
    "done-then-text": b"data: [DONE] the secret\n\n",
    "no-space": b"data:the secret\n\n",
    "crlf": b"data: the secret\r\n\r\n",
}


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "not-strict"])
@pytest.mark.parametrize("form", list(NOT_JSON_DATA), ids=list(NOT_JSON_DATA))
def test_a_chat_event_whose_data_is_not_json_ends_the_stream(form, strict):
    """Relayed before: its text reached the client unread by the verifier and uncounted. Now the
    stream ends there, for every tenant, as for JSON only a lax reader reads: an error event after
    the response started, a 502 before; the settle counts the prompt and the text relayed, and
    nothing is left in flight."""
    started, first = chat_stream_ended_by(NOT_JSON_DATA[form], strict=strict)
    assert started == (200, HELLO + error_event(NOT_JSON) + DONE, {"r4": [11 + HELLO_TOKENS]}, [0])
    assert first == (502, NOT_JSON, {"r4": [11]}, [0])


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "not-strict"])
@pytest.mark.parametrize("form", ["plain-text", "cut-object", "done-then-text"])
def test_a_responses_event_whose_data_is_not_json_ends_the_stream(form, strict):
    """The same in ``/v1/responses`` (its own event reader), the event typed as a text delta: the
    stream ends with the Responses ``error`` event numbered after the last event; before anything
    started, a 502."""
    hidden = b"event: response.output_text.delta\n" + NOT_JSON_DATA[form]
    path = "/v1/responses"
    r, q, in_flight = through_gateway_as([CREATED, HEL, hidden, COMPLETED], RESPONSES_BODY, strict=strict, path=path)
    assert (r.status_code, r.content) == (200, CREATED + HEL + _responses_error_event(NOT_JSON, 2))
    assert (q.settled, in_flight) == ({"r4": [q.reserved["r4"] - 5 + HEL_TOKENS]}, [0])
    r, q, in_flight = through_gateway_as([CREATED, hidden, COMPLETED], RESPONSES_BODY, strict=strict, path=path)
    assert (r.status_code, error_of(r), in_flight) == (502, NOT_JSON, [0])


# ------------------------------------------------------------------ relayed as before

#: events without text: vLLM's keep-alive comment, a bare comment, empty or blank data (comments
#: with other text and fields without data: tests/test_relay_sse_fields.py)
NO_TEXT = [
    b": keep-alive\n\n",
    b":\n\n",
    b"data:\n\n",
    b"data: \n\n",
    b"data:   \t\n\n",
    b"data:\ndata:\n\n",
]
#: JSON that is not an object (its strings are the verifier's "-:other" text)
NOT_OBJECTS = [b'data: "hi"\n\n', b'data: ["hi", 1]\n\n', b"data: 42\n\n", b"data: true\n\n", b"data: null\n\n"]


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "not-strict"])
def test_events_without_text_and_json_that_is_not_an_object_are_relayed_as_sent(strict):
    """vLLM's keep-alive and bare comments, empty or blank data, and JSON values that are not
    objects: relayed byte for byte in a chat stream, in order, before and after the response
    started; the settle counts the prompt and the chunks' text."""
    odd = b"".join(NO_TEXT + NOT_OBJECTS)
    stream = odd + HELLO + odd + STOP + DONE
    r, q, in_flight = through_gateway_as([stream], STREAM_BODY, strict=strict)
    assert (r.status_code, r.content) == (200, stream)
    assert (q.settled, in_flight) == ({"r4": [11 + HELLO_TOKENS]}, [0])


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "not-strict"])
def test_responses_events_without_text_and_a_done_marker_are_relayed_as_sent(strict):
    """The same in ``/v1/responses``, and ``data: [DONE]`` after the terminal event (the chat end
    marker, at which the openai SDK stops in either protocol): relayed as sent."""
    odd = b"".join(NO_TEXT + NOT_OBJECTS)
    stream = CREATED + odd + HEL + odd + COMPLETED + DONE
    r, _, in_flight = through_gateway_as([stream], RESPONSES_BODY, strict=strict, path="/v1/responses")
    assert (r.status_code, r.content, in_flight) == (200, stream, [0])


# ------------------------------------------------------------------ through the real verifier


def _chat_events(words: list[str], wrap) -> list[Any]:
    """A chat stream that says SAID in chunks, then ``words`` each in an event ``wrap`` makes,
    then a finish reason."""
    said = [{"choices": [{"index": 0, "delta": {"content": w}}]} for w in SAID]
    return [*said, *(wrap(w) for w in words), {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}]


#: JSON values that are not objects, each holding a word
NOT_OBJECT_FORMS = {
    "string": lambda w: b"data: " + json.dumps(w).encode() + b"\n\n",
    "array": lambda w: b"data: " + json.dumps([w]).encode() + b"\n\n",
    "array-of-chunks": lambda w: (
        b"data: " + json.dumps([{"choices": [{"index": 0, "delta": {"content": w}}]}]).encode() + b"\n\n"
    ),
}


@pytest.mark.parametrize("form", list(NOT_OBJECT_FORMS), ids=list(NOT_OBJECT_FORMS))
def test_a_passage_in_json_that_is_not_an_object_is_withheld(stack, form):
    """A strict tenant, through the real verifier: the clean control in JSON values that are
    not objects is relayed (the client receives those values); the victim's passage so is
    withheld, the leak index naming the victim: their strings are checked as the event's
    ``"-:other"`` text."""
    sc, svc, client = stack
    sc.events, sc.done = _chat_events(CONTROL, NOT_OBJECT_FORMS[form]), True
    status, raw = send(client, "s", "chat", True)
    assert status == 200 and all(json.dumps(w).encode() in raw for w in CONTROL)
    sc.events = _chat_events(pieces(VICTIM), NOT_OBJECT_FORMS[form])
    before, n = svc.stats["withheld"], len(svc.incidents.recent)
    status, raw = send(client, "s", "chat", True)
    assert MARK.encode() not in raw
    _withheld(svc, before, status, raw, True)
    _leak_named(svc, n)


@pytest.mark.parametrize("route", ["chat", "responses"])
def test_a_passage_in_plain_text_events_is_refused(stack, route):
    """A strict tenant, through the real verifier: the victim's passage, a word per event as
    plain text data, was relayed with 200 (the verifier read no JSON in it; a browser's
    ``EventSource`` shows each word). Now the first such event ends the stream: a 502 before
    anything started, and nothing of the passage reaches the client."""
    sc, _, client = stack
    plain = [b"data: " + w.encode() + b"\n\n" for w in pieces(VICTIM)]
    if route == "chat":
        sc.events, sc.done = [*plain, {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}], True
    else:
        sc.events, sc.done = [CREATED, *(b"event: response.output_text.delta\n" + p for p in plain), COMPLETED], False
    status, raw = send(client, "s", route, True)
    assert (status, json.loads(raw)) == (502, {"error": NOT_JSON})
    assert MARK.encode() not in raw
