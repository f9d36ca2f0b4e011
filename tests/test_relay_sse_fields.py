"""The lines of a stream event besides its ``data:`` lines, against a hostile engine
(gateway/relay/sse.py ``relayed_fields``, gateway/relay/stream.py): comments (``: text``) and the
``id:``, ``retry:`` and ``event:`` fields. Each reaches the client (curl and any raw reader print
it; a browser's ``EventSource`` exposes ``id:`` as ``lastEventId`` and sends it back as
``Last-Event-ID``, and dispatches the event under its ``event:`` name; the openai SDK's
``SSEDecoder`` keeps ``event``, ``id`` and ``retry``), while the verifier reads only the data.
Relayed byte for byte before, a strict tenant got another tenant's passage in them with 200.

What honest engines send (vLLM 0.34, SGLang 0.5.23): ``data:`` lines; vLLM's keep-alive comment
``: keep-alive`` while a chat/completions stream is idle
(``vllm/entrypoints/serve/utils/sse_keep_alive.py``, ``SSE_KEEP_ALIVE_COMMENT``); in
``/v1/responses``, ``event: <type>`` before data whose ``type`` is the same
(``vllm/entrypoints/openai/responses/api_router.py``, ``_convert_stream_to_sse_events``;
``python/sglang/srt/entrypoints/openai/serving_responses.py``, ``_send_event``), as OpenAI's
Responses streams do. No ``id:`` or ``retry:`` anywhere, and no ``event:`` in chat (SGLang's
``event: sglext_ids`` only answers a request carrying ``x-sglext-ids-framed: 1``, a header the
gateway never sends upstream). So:

- a comment's text is not relayed: the line becomes a bare ``:`` (idle streams still send bytes),
  except vLLM's ``: keep-alive``, relayed as sent; ``id:``, ``retry:`` and any other field's line
  (one starting with a byte order mark too) becomes a bare ``:`` as well;
- an ``event:`` field that is not empty and not the data's ``type`` (any in chat) ends the stream
  with 502 ``upstream_unavailable``, like the other refused events: an error event once the
  response started (the Responses ``error`` event in ``/v1/responses``), a 502 before;
- every event an honest engine sends is relayed byte for byte.

Engines, events and request bodies: tests/relay_harness.py.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from openai._streaming import SSEDecoder

from gateway.relay import sse
from tests import test_verifier_hostile_engine
from tests.relay_harness import (
    COMPLETED,
    CREATED,
    DONE,
    HEL,
    HEL_TOKENS,
    HELLO,
    HELLO_TOKENS,
    MARK,
    RESPONSES_BODY,
    SAID,
    STOP,
    STREAM_BODY,
    VICTIM,
    _event,
    _responses_error_event,
    error_event,
    error_of,
    pieces,
    send,
    through_gateway_as,
)

pytestmark = pytest.mark.timeout(60)
#: the scripted engine behind the real gateway and verifier (module-scoped: this module's own)
stack = test_verifier_hostile_engine.stack

ODD_TYPE = {
    "message": (
        "The upstream engine sent a stream event whose event field is not the type of its data, "
        "which the gateway does not relay."
    ),
    "type": "server_error",
    "param": None,
    "code": "upstream_unavailable",
}
#: a chat chunk without choices or text (an honest shape: the usage chunk's, without usage)
EMPTY = b'data: {"id": "c1", "choices": []}\n\n'

# ------------------------------------------------------------------ comments, id, retry: rewritten

#: what the engine sends -> what the client receives, each form holding "the secret" (once in
#: the engine's bytes, never in the client's)
REWRITTEN = {
    "comment": (b": the secret\n\n", b":\n\n"),
    "comment-no-space": (b":the secret\n\n", b":\n\n"),
    "comment-crlf": (b": the secret\r\n\r\n", b":\r\n\r\n"),
    "comment-then-data": (b": the secret\n" + EMPTY, b":\n" + EMPTY),
    "data-then-comment": (EMPTY[:-1] + b": the secret\n\n", EMPTY[:-1] + b":\n\n"),
    "id": (b"id: the secret\n\n", b":\n\n"),
    "id-then-data": (b"id: the secret\n" + EMPTY, b":\n" + EMPTY),
    "id-after-bare-cr": (EMPTY[:-2] + b"\rid: the secret\n\n", EMPTY[:-2] + b"\r:\n\n"),
    "retry": (b"retry: 100\n\n", b":\n\n"),
    "retry-crlf-then-data": (b"retry: 100\r\n" + EMPTY[:-2] + b"\r\n\r\n", b":\r\n" + EMPTY[:-2] + b"\r\n\r\n"),
    "unknown-field": (b"the: secret\n\n", b":\n\n"),
    "field-without-colon": (b"the secret\n\n", b":\n\n"),
    "data-then-bom-field": (EMPTY[:-1] + sse.BOM + b'data: "the secret"\n\n', EMPTY[:-1] + b":\n\n"),
}


@pytest.mark.parametrize("form", list(REWRITTEN), ids=list(REWRITTEN))
def test_relayed_fields_turns_each_line_but_data_and_event_into_a_bare_comment(form):
    """The event's other lines keep their place and line end, as bare comments, so its lines and
    blank line stay where they were (a line ended by a bare CR stays so); no ``event:`` named."""
    sent, relayed = REWRITTEN[form]
    assert sse.relayed_fields(sent) == (relayed, ())
    assert b"secret" not in relayed


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "not-strict"])
@pytest.mark.parametrize("form", list(REWRITTEN), ids=list(REWRITTEN))
def test_a_chat_stream_relays_comments_id_and_retry_without_their_text(form, strict):
    """Relayed byte for byte before (the secret reached every client, a strict tenant's too, with
    200). Now each reaches the client as a bare comment, before and after the response started, the
    rest of the stream byte for byte; the settle counts the prompt and the text."""
    sent, relayed = REWRITTEN[form]
    r, q, in_flight = through_gateway_as([sent, HELLO, sent, STOP, DONE], STREAM_BODY, strict=strict)
    assert (r.status_code, r.content) == (200, relayed + HELLO + relayed + STOP + DONE)
    assert (q.settled, in_flight) == ({"r4": [11 + HELLO_TOKENS]}, [0])


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "not-strict"])
@pytest.mark.parametrize("form", list(REWRITTEN), ids=list(REWRITTEN))
def test_a_responses_stream_relays_comments_id_and_retry_without_their_text(form, strict):
    """The same in ``/v1/responses``."""
    sent, relayed = REWRITTEN[form]
    reads = [CREATED, sent, HEL, sent, COMPLETED]
    r, _, in_flight = through_gateway_as(reads, RESPONSES_BODY, strict=strict, path="/v1/responses")
    assert (r.status_code, r.content, in_flight) == (200, CREATED + relayed + HEL + relayed + COMPLETED, [0])


def test_the_openai_sdk_reads_no_id_retry_or_comment_in_what_is_relayed():
    """What the openai SDK's decoder made of the stream the engine sent (``id`` and ``retry``
    kept; ``id`` on every later event too: it is never reset) and of the one relayed now."""
    sent = b"id: the secret\nretry: 100\n" + HELLO + b": the secret\n" + STOP + DONE
    events = list(SSEDecoder().iter_bytes(iter([sent])))
    assert [(e.id, e.retry) for e in events] == [("the secret", 100), ("the secret", None), ("the secret", None)]
    r, _, _ = through_gateway_as([sent], STREAM_BODY, strict=True)
    assert r.content == b":\n:\n" + HELLO + b":\n" + STOP + DONE
    events = list(SSEDecoder().iter_bytes(iter([r.content])))
    assert [(e.event, e.id, e.retry) for e in events] == [(None, None, None)] * 3
    assert [e.data for e in events] == [HELLO[6:-2].decode(), STOP[6:-2].decode(), "[DONE]"]


# ------------------------------------------------------------------ what honest engines send: byte for byte

#: vLLM's keep-alive comment (``SSE_KEEP_ALIVE_COMMENT``)
KEEP_ALIVE = b": keep-alive\n\n"


def _typed(etype: str, seq: int, **data: Any) -> bytes:
    """A Responses event as vLLM writes it: ``event: <type>``, then the event model's JSON, its
    ``type`` and ``sequence_number`` last (pydantic's field order in the openai types)."""
    body = json.dumps({**data, "sequence_number": seq, "type": etype}, separators=(",", ":"))
    return f"event: {etype}\ndata: {body}\n\n".encode()


def test_relayed_fields_hands_an_honest_event_back_as_it_is():
    """The events vLLM and SGLang send come back as the same object (no copy), their ``event:``
    name read without reading the event line by line."""
    for event in (HELLO, STOP, DONE, EMPTY, KEEP_ALIVE, b"data:\n\n"):
        got, names = sse.relayed_fields(event)
        assert (got is event, names) == (True, ())
    for event in (CREATED, HEL, COMPLETED, _typed("response.output_text.delta", 4, delta="x")):
        got, names = sse.relayed_fields(event)
        etype = json.loads(event.split(b"\ndata: ", 1)[1])["type"].encode()
        assert (got is event, names) == (True, (etype,))
    got, names = sse.relayed_fields(b":\n\n")
    assert (got, names) == (b":\n\n", ())


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "not-strict"])
def test_vllm_keep_alive_comments_are_relayed_byte_for_byte(strict):
    """vLLM with ``--sse-keep-alive-interval``: keep-alives before the first chunk (queued,
    prefill), between chunks and before ``[DONE]``, in one read and read by read."""
    stream = [KEEP_ALIVE, KEEP_ALIVE, HELLO, KEEP_ALIVE, STOP, KEEP_ALIVE, DONE]
    for reads in (stream, [b"".join(stream)]):
        r, q, in_flight = through_gateway_as(reads, STREAM_BODY, strict=strict)
        assert (r.status_code, r.content) == (200, b"".join(stream))
        assert (q.settled, in_flight) == ({"r4": [11 + HELLO_TOKENS]}, [0])


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "not-strict"])
def test_responses_events_named_by_their_type_are_relayed_byte_for_byte(strict):
    """vLLM's and SGLang's ``/v1/responses`` events (``event: <type>`` then data of that ``type``,
    where the member sits first or last), and the same event with CRLF line ends (read line by
    line): relayed as sent."""
    created = _typed("response.created", 0, response={"id": "r1", "status": "in_progress", "output": []})
    delta = _typed("response.output_text.delta", 1, content_index=0, delta="Hel", item_id="m1", output_index=0)
    crlf = HEL.replace(b"\n", b"\r\n").replace(b'"sequence_number": 1', b'"sequence_number": 2')
    done = _typed("response.completed", 3, response={"id": "r1", "status": "completed", "output": []})
    stream = created + delta + crlf + done
    r, _, in_flight = through_gateway_as([stream], RESPONSES_BODY, strict=strict, path="/v1/responses")
    assert (r.status_code, r.content, in_flight) == (200, stream, [0])


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "not-strict"])
def test_an_empty_event_field_is_relayed(strict):
    """``event:`` with no value names no type (a browser reads the event as a ``message``, the
    openai SDK as no event): no text, relayed as sent, in chat and Responses alike."""
    for empty in (b"event:\n", b"event: \n", b"event\n"):
        r, _, _ = through_gateway_as([empty + HELLO, empty + STOP, DONE], STREAM_BODY, strict=strict)
        assert (r.status_code, r.content) == (200, empty + HELLO + empty + STOP + DONE)
        hel = empty + HEL.split(b"\n", 1)[1]
        path = "/v1/responses"
        r, _, _ = through_gateway_as([CREATED, hel, COMPLETED], RESPONSES_BODY, strict=strict, path=path)
        assert (r.status_code, r.content) == (200, CREATED + hel + COMPLETED)


# ------------------------------------------------------------------ event: other than the data's type: refused

#: chat events carrying an ``event:`` field (each naming "the secret", or a name clients read apart)
CHAT_NAMED = {
    "alone": b"event: the secret\n\n",
    "before-data": b"event: the secret\n" + EMPTY,
    "after-data": EMPTY[:-1] + b"event: the secret\n\n",
    "error": b"event: error\n" + EMPTY,
    "thread": b"event: thread.the.secret\n" + EMPTY,
    "crlf": b"event: the secret\r\n" + EMPTY[:-2] + b"\r\n\r\n",
}


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "not-strict"])
@pytest.mark.parametrize("form", list(CHAT_NAMED), ids=list(CHAT_NAMED))
def test_a_chat_event_with_an_event_field_ends_the_stream(form, strict):
    """A chat/completions event names no type (its data has none; the openai SDK reads an event
    named ``thread.*`` or ``error`` apart, a browser dispatches it to that name's listeners only).
    Relayed before with its name; now the stream ends there: an error event after the response
    started, a 502 before; the settle counts the prompt and the text relayed."""
    named = CHAT_NAMED[form]
    r, q, in_flight = through_gateway_as([HELLO, named, STOP, DONE], STREAM_BODY, strict=strict)
    assert (r.status_code, r.content) == (200, HELLO + error_event(ODD_TYPE) + DONE)
    assert (q.settled, in_flight) == ({"r4": [11 + HELLO_TOKENS]}, [0])
    r, q, in_flight = through_gateway_as([named, HELLO, STOP, DONE], STREAM_BODY, strict=strict)
    assert (r.status_code, error_of(r)) == (502, ODD_TYPE)
    assert (q.settled, in_flight) == ({"r4": [11]}, [0])


def _hel_named(*names: bytes, data: bytes | None = None) -> bytes:
    """HEL's data under ``names`` (one ``event:`` line each), or ``data`` so named."""
    payload = HEL.split(b"\n", 1)[1] if data is None else data
    return b"".join(b"event: " + n + b"\n" for n in names) + payload


#: Responses events whose ``event:`` field is not their data's ``type``
RESPONSES_NAMED = {
    "other-name": _hel_named(b"the secret"),
    "other-type": _hel_named(b"response.completed"),
    "last-of-two": _hel_named(b"response.output_text.delta", b"the secret"),
    "first-of-two": _hel_named(b"the secret", b"response.output_text.delta"),
    "extra-space": _hel_named(b" response.output_text.delta"),
    "no-data": b"event: the secret\n\n",
    "done-data": _hel_named(b"the secret", data=DONE),
    "array-data": _hel_named(b"the secret", data=b'data: ["x"]\n\n'),
    "untyped-data": _hel_named(b"response.output_text.delta", data=b'data: {"delta": "x"}\n\n'),
    "crlf": _hel_named(b"the secret").replace(b"\n", b"\r\n"),
}


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "not-strict"])
@pytest.mark.parametrize("form", list(RESPONSES_NAMED), ids=list(RESPONSES_NAMED))
def test_a_responses_event_named_other_than_its_type_ends_the_stream(form, strict):
    """In ``/v1/responses`` the ``event:`` field must be the data's ``type`` (or empty): a browser
    dispatches the event under the field's name, the last one when there are several. Otherwise
    the stream ends with the Responses ``error`` event numbered after the last event; before
    anything started, a 502."""
    named, path = RESPONSES_NAMED[form], "/v1/responses"
    r, q, in_flight = through_gateway_as([CREATED, HEL, named, COMPLETED], RESPONSES_BODY, strict=strict, path=path)
    assert (r.status_code, r.content) == (200, CREATED + HEL + _responses_error_event(ODD_TYPE, 2))
    assert (q.settled, in_flight) == ({"r4": [q.reserved["r4"] - 5 + HEL_TOKENS]}, [0])
    r, q, in_flight = through_gateway_as([CREATED, named, COMPLETED], RESPONSES_BODY, strict=strict, path=path)
    assert (r.status_code, error_of(r), in_flight) == (502, ODD_TYPE, [0])


# ------------------------------------------------------------------ through the real verifier

STOP_CHUNK = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}

#: a word in a line the verifier does not read: (chat event, Responses event) holding it
HIDING = {
    "comment": (lambda w: b": " + w + b"\n\n", lambda w: b": " + w + b"\n\n"),
    "id": (lambda w: b"id: " + w + b"\n" + EMPTY, lambda w: b"id: " + w + b"\n" + HEL),
    "retry": (lambda w: b"retry: " + w + b"\n\n", lambda w: b"retry: " + w + b"\n\n"),
    "event": (lambda w: b"event: " + w + b"\n" + EMPTY, lambda w: _hel_named(w)),
}


@pytest.mark.parametrize("route", ["chat", "responses"])
@pytest.mark.parametrize("where", list(HIDING), ids=list(HIDING))
def test_a_passage_in_comments_or_fields_does_not_reach_a_strict_tenant(stack, where, route):
    """A strict tenant, through the real verifier: the victim's passage, a word per event in a
    comment, an ``id:``, a ``retry:`` or an ``event:`` line, after text that started the
    response. Relayed before with 200 (the verifier read none of it: no incident). Now none of
    its words reaches the client: comments, ``id:`` and ``retry:`` arrive as bare comments and
    the stream ends as the engine ended it; the first ``event:`` ends the stream with the
    ``upstream_unavailable`` error event."""
    sc, svc, client = stack
    chat_form, responses_form = HIDING[where]
    words = [w.encode() for w in pieces(VICTIM)]
    if route == "chat":
        said: list[Any] = [{"choices": [{"index": 0, "delta": {"content": w}}]} for w in SAID]
        sc.events, sc.done = [*said, *(chat_form(w) for w in words), STOP_CHUNK], True
    else:
        said = [
            _event("response.output_text.delta", 1 + k, output_index=0, content_index=0, delta=w)
            for k, w in enumerate(SAID)
        ]
        sc.events, sc.done = [CREATED, *said, *(responses_form(w) for w in words), COMPLETED], False
    before = svc.stats["withheld"]
    status, raw = send(client, "s", route, True)
    assert status == 200 and MARK.encode() not in raw
    assert svc.stats["withheld"] == before
    if where == "event":
        assert b'"code":"upstream_unavailable"' in raw
    else:
        assert b'"code":' not in raw
        assert raw.count(b":\n") >= len(words)
