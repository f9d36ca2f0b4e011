"""Indexes below the choice that clients group apart from the verifier, against a hostile engine
(gateway/relay/stream.py): what the relay refuses to relay, and why.

- **a streamed tool call's ``index``** (``choices[].delta.tool_calls[].index``): the openai SDK's
  stream helper accumulates tool-call fragments in a list indexed by it (openai 3.60,
  ``src/openai/lib/streaming/_deltas.py``, ``accumulate_delta``), after its loose reading made
  ``true`` 1, ``false`` 0 and ``"1"`` 1 (``construct_type`` validates ``Optional`` fields, in
  pydantic's lax mode), and ``-1`` is the last call there; the verifier read a non-number at the
  call's position and ``-1`` as a call of its own. Its JavaScript helper indexes an array with it
  (``"1"`` and ``1`` alike). A call's arguments sent under ``1`` and ``true`` by turns were one
  call to a client and two texts to the verifier, each with every other fragment: a strict
  tenant got another tenant's passage with 200. Now such a chunk ends the stream with the relay's
  502 for an answer outside the protocol (an error event once started), as a choice's index does.
- **a Responses text event's ``output_index`` / ``content_index`` / ``summary_index``**: the
  SDK's Responses accumulator keys output items by ``output_index`` in a dict (``1``, ``1.0`` and
  ``true`` are one key) and content parts by ``content_index`` in a list (``true`` is part 1,
  ``-1`` the last), after the same loose reading (``"1"`` is 1); the verifier read anything but
  an int (``1.0``, ``true``, ``"1"``) as 0, and a member the event's type does not have (a
  ``content_index`` on an arguments delta, which clients do not read) as part of the key. Now such
  an event ends the stream with the Responses ``error`` event (a 502 before anything started). An
  index absent or ``null`` is still relayed: no client groups it with a number, and the verifier
  reads it with index 0 (it joins more there than a client, never less).

A whole answer has no index a client groups by: a Responses body's items and parts are lists,
and a chat body's tool calls each arrive whole (vLLM and OpenAI send them without ``index``).

Engines, events and request bodies: tests/relay_harness.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from openai._models import construct_type
from openai._types import omit
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.chat import ChatCompletionChunk
from openai.types.responses import ResponseStreamEvent

from tests import test_verifier_hostile_engine
from tests.gateway_harness import chat
from tests.relay_harness import (
    COMPLETED,
    CONTROL,
    CREATED,
    DONE,
    HEL_TOKENS,
    HELLO,
    HELLO_TOKENS,
    MARK,
    RESPONSES_BODY,
    SAID,
    STREAM_BODY,
    VICTIM,
    _event,
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
from verifier.engine_response import TEXT_DELTA_EVENTS, parse_chunk_event, parse_response_event

pytestmark = pytest.mark.timeout(60)
#: the scripted engine behind the real gateway and verifier (module-scoped: this module's own)
stack = test_verifier_hostile_engine.stack

#: a member left out
ABSENT = object()

#: the 502 that ends a chat stream holding a tool call whose index clients group apart
ODD_TOOL = {
    "message": (
        "The upstream engine sent a tool call whose index is not a whole number from 0 to 2**53 - 1, "
        "which the gateway does not relay."
    ),
    "type": "server_error",
    "param": None,
    "code": "upstream_unavailable",
}
#: the 502 that ends a Responses stream holding a text event whose indexes clients group apart
ODD_OUTPUT = {
    "message": (
        "The upstream engine sent a Responses text event with an output_index, content_index or "
        "summary_index that is not an integer from 0 to 2**53 - 1, or one its type does not have, "
        "which the gateway does not relay."
    ),
    "type": "server_error",
    "param": None,
    "code": "upstream_unavailable",
}


def data_events(raw: bytes) -> list[dict]:
    """The JSON objects of a relayed stream's ``data:`` lines, as a client's reader reads them."""
    out = []
    for line in raw.split(b"\n"):
        if line.startswith(b"data: {"):
            out.append(json.loads(line[6:]))
    return out


# ------------------------------------------------------------------ 1. a streamed tool call's index
CHUNK = {"id": "x1", "object": "chat.completion.chunk", "model": "m"}


def tool_chunk(index: Any, arguments: str, **call: Any) -> dict:
    tc: dict[str, Any] = {"index": index, **call, "function": {"arguments": arguments, **call.pop("function", {})}}
    if index is ABSENT:
        del tc["index"]
    return {**CHUNK, "choices": [{"index": 0, "delta": {"tool_calls": [tc]}, "finish_reason": None}]}


def opened(index: int) -> dict:
    """The chunk that opens tool call ``index`` (its id, type and name; no arguments yet)."""
    return tool_chunk(index, "", id=f"call_{index}", type="function", function={"name": "note"})


def sdk_tool_calls(chunks: list[dict]) -> list[str] | str:
    """What the openai SDK's stream helper makes of ``chunks``: each tool call's arguments, in the
    order of its list, or the exception it raises."""
    state = ChatCompletionStreamState()
    try:
        for c in chunks:
            state.handle_chunk(construct_type(type_=ChatCompletionChunk, value={"created": 0, **c}))
    except Exception as e:
        return type(e).__name__
    calls = state.current_completion_snapshot.choices[0].message.tool_calls or []
    return [tc.function.arguments for tc in calls]


def verifier_keys(chunk: dict) -> list[str]:
    """The text streams the verifier reads ``chunk``'s tool-call arguments into."""
    return [k for k in parse_chunk_event(chunk).fields if k.endswith(":arguments")]


#: call 1's fragment ``D`` under another index: -> (what the SDK makes of the calls, the verifier's key for D)
TOOL_SPLITS: dict[str, tuple[Any, list[str] | str, str]] = {
    "true": (True, ["AC", "BDE"], "0:tool:0:arguments"),  # SDK: call 1; verifier: its position, 0
    "string": ("1", ["AC", "BDE"], "0:tool:0:arguments"),  # the same (JavaScript's array: call 1 as well)
    "negative": (-1, ["AC", "BDE"], "0:tool:-1:arguments"),  # SDK: the last call; verifier: a call of its own
    "false": (False, ["ACD", "BE"], "0:tool:0:arguments"),  # SDK: call 0; the verifier: its position (0 here too)
    "null": (None, "TypeError", "0:tool:0:arguments"),
    "absent": (ABSENT, "RuntimeError", "0:tool:0:arguments"),
    "fraction": (1.5, "TypeError", "0:tool:0:arguments"),
    "past-the-calls": (5, "IndexError", "0:tool:5:arguments"),
    "integral-float": (1.0, ["AC", "BDE"], "0:tool:1:arguments"),  # one number to everyone: relayed
}


@pytest.mark.filterwarnings("ignore:Pydantic serializer warnings:UserWarning")  # the SDK's, on 1.5
@pytest.mark.parametrize("form", list(TOOL_SPLITS), ids=list(TOOL_SPLITS))
def test_the_openai_sdk_groups_tool_call_fragments_by_a_value_the_verifier_read_apart(form):
    """Why the relay refuses them: two calls, fragments A, C of call 0 and B, E of call 1, and D
    of call 1 sent under another index. The SDK's helper joins D into call 1 under ``true``,
    ``"1"``, ``-1`` (and ``1.0``), while the verifier read ``true`` and ``"1"`` at the call's
    position, 0, and ``-1`` apart; ``null``, absent, a fraction or an index past the calls makes
    the helper raise (its user gets no answer)."""
    odd, sdk, key = TOOL_SPLITS[form]
    chunks = [opened(0), opened(1)]
    chunks += [tool_chunk(i, t) for i, t in ((0, "A"), (1, "B"), (0, "C"), (odd, "D"), (1, "E"))]
    assert sdk_tool_calls(chunks) == sdk
    assert verifier_keys(chunks[5]) == [key]


#: ``tool_calls[0].index`` as a hostile engine sends it
ODD_TOOL_INDEXES: dict[str, Any] = {
    "true": True,
    "false": False,
    "string": "0",
    "null": None,
    "absent": ABSENT,
    "fraction": 0.5,
    "negative": -1,
    "negative-float": -1.0,
    "past-2**53": 2**53,  # JavaScript reads 2**53 and 2**53 + 1 as one number
    "huge-float": 1e300,
}


def tool_event(index: Any, arguments: str = '{"note": "the secret"}') -> bytes:
    return b"data: " + json.dumps(tool_chunk(index, arguments)).encode() + b"\n\n"


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "not-strict"])
@pytest.mark.parametrize("form", list(ODD_TOOL_INDEXES), ids=list(ODD_TOOL_INDEXES))
def test_a_stream_chunk_with_an_odd_tool_call_index_ends_the_stream(form, strict):
    """A tool call's arguments ("the secret") under an index clients group apart: relayed before.
    Now the stream ends there, for every tenant: an error event once the response started (the
    settle counts the prompt and the text relayed), a 502 before."""
    odd = tool_event(ODD_TOOL_INDEXES[form])
    started, first = chat_stream_ended_by(odd, strict=strict, rest=tool_event(0, ""))
    assert started == (200, HELLO + error_event(ODD_TOOL) + DONE, {"r4": [11 + HELLO_TOKENS]}, [0])
    assert first == (502, ODD_TOOL, {"r4": [11]}, [0])


def test_tool_calls_as_vllm_and_sglang_stream_them_are_relayed_as_sent():
    """The control: two calls numbered 0 and 1 (vLLM ``DeltaToolCall.index: int``, SGLang's
    ``ToolCallItem.tool_index``), an integral ``1.0`` (the number 1 to every reader and to the
    verifier), and a chunk naming both calls: relayed byte for byte to a strict tenant."""
    both = {**CHUNK, "choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0}, {"index": 1}]}}]}
    events = [opened(0), tool_chunk(0, '{"a": 1}'), opened(1), tool_chunk(1.0, '{"b": '), tool_chunk(1, "2}"), both]
    events.append({**CHUNK, "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]})
    stream = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + DONE
    r, _, _ = through_gateway_as([stream], STREAM_BODY, strict=True)
    assert (r.status_code, r.content) == (200, stream)


def test_a_whole_answers_tool_calls_are_relayed_with_or_without_an_index():
    """A whole answer's tool calls arrive whole (each its own string to a client, read each by
    the verifier): vLLM and OpenAI send them without ``index``, SGLang with one; neither is
    refused, nor an odd one (no client groups a whole answer's calls by it)."""
    for index in (ABSENT, 0, True, "x"):
        call: dict[str, Any] = {"id": "call_0", "type": "function", "function": {"name": "note", "arguments": "{}"}}
        if index is not ABSENT:
            call["index"] = index
        message = {"role": "assistant", "content": None, "tool_calls": [call]}
        body = {"id": "c1", "object": "chat.completion", "choices": [{"index": 0, "message": message}]}
        body["choices"][0]["finish_reason"] = "tool_calls"
        answer = json.dumps({**body, "usage": {"prompt_tokens": 11, "completion_tokens": 3}}).encode()
        r, q, _ = through_gateway_as([answer], chat(max_tokens=5), strict=False, ctype="application/json")
        assert (r.status_code, r.content, q.settled) == (200, answer, {"r4": [14]}), index


def two_tool_events(leak: list[str], index_of: Callable[[int], Any]) -> list[dict]:
    """One choice calling two tools: call 0's arguments say ``SAID``, call 1's say ``leak``, its
    ``k``-th fragment's index ``index_of(k)``."""
    events = [opened(0), opened(1)]
    for k, (s, x) in enumerate(zip(SAID, leak, strict=False)):
        events += [tool_chunk(0, s), tool_chunk(index_of(k), x)]
    return [*events, {**CHUNK, "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}]


def test_a_passage_split_between_tool_call_index_1_and_1_0_is_withheld(stack):
    """The control through the real verifier: ``1`` and ``1.0`` by turns are one call to the SDK
    and to the verifier; the clean text is relayed (one call to the SDK), the passage withheld."""
    sc, svc, client = stack
    sc.events, sc.done = two_tool_events(CONTROL, lambda k: 1 if k % 2 else 1.0), True
    status, raw = send(client, "s", "chat", True)
    assert (status, sdk_tool_calls(data_events(raw))) == (200, ["".join(SAID), "".join(CONTROL)])
    sc.events = two_tool_events(pieces(VICTIM), lambda k: 1 if k % 2 else 1.0)
    before, n = svc.stats["withheld"], len(svc.incidents.recent)
    status, raw = send(client, "s", "chat", True)
    assert MARK.encode() not in raw
    _withheld(svc, before, status, raw, True)
    _leak_named(svc, n)


@pytest.mark.parametrize("odd", [True, "1", -1], ids=["true", "string", "negative"])
def test_a_passage_split_between_tool_call_index_1_and_another_form_is_refused(stack, odd):
    """Through the real verifier, a strict tenant: call 1's fragments say ``1`` and ``odd`` by
    turns. The verifier read ``true`` and ``"1"`` at the call's position (0, call 0's stream) and
    ``-1`` as a call of its own, so no stream held the passage contiguously and it was released
    with 200, while the openai SDK joins every fragment into call 1. Now the stream ends at the
    first odd index: nothing of the passage reaches the client."""
    sc, svc, client = stack
    events = two_tool_events(pieces(VICTIM), lambda k: 1 if k % 2 else odd)
    assert sdk_tool_calls(events) == ["".join(SAID), "".join(pieces(VICTIM))]
    sc.events, sc.done = events, True
    status, raw = send(client, "s", "chat", True)
    assert (status, raw) == (200, error_event(ODD_TOOL) + DONE)
    assert MARK.encode() not in raw


# ------------------------------------------------------------------ 2. Responses indexes
USAGE = {"input_tokens": 9, "output_tokens": 2, "total_tokens": 11}


def message_item(item_id: str, parts: int, status: str = "in_progress") -> dict:
    part = {"type": "output_text", "text": "", "annotations": []}
    content = [part] * parts if status == "completed" else []
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def text_delta(output_index: Any, content_index: Any, delta: str, item_id: str = "msg_0") -> dict:
    where = {"item_id": item_id, "output_index": output_index, "content_index": content_index}
    return {"type": "response.output_text.delta", **where, "delta": delta, "logprobs": []}


def split_response(said: list[str], leak: list[str], field: str, index_of: Callable[[int], Any]) -> list[dict]:
    """A Responses stream of two texts streamed by turns: the first (item 0, part 0) says
    ``said``; the second (item 1, or part 1 of item 0: the ``field`` that tells them apart) says
    ``leak``, its ``k``-th delta's ``field`` ``index_of(k)``. The items' closing snapshots hold no
    text (an engine need not repeat it)."""
    items, parts = (2, 1) if field == "output_index" else (1, 2)
    evs: list[dict] = [
        {"type": "response.created", "response": {"id": "resp_1", "status": "in_progress", "output": []}}
    ]
    part = {"type": "output_text", "text": "", "annotations": []}
    for i in range(items):
        evs.append({"type": "response.output_item.added", "output_index": i, "item": message_item(f"msg_{i}", 0)})
        for j in range(parts):
            where = {"item_id": f"msg_{i}", "output_index": i, "content_index": j}
            evs.append({"type": "response.content_part.added", **where, "part": part})
    for k in range(max(len(said), len(leak))):
        if k < len(said):
            evs.append(text_delta(0, 0, said[k]))
        if k < len(leak):
            second = (index_of(k), 0, leak[k], "msg_1") if field == "output_index" else (0, index_of(k), leak[k])
            evs.append(text_delta(*second))
    done = [message_item(f"msg_{i}", parts, "completed") for i in range(items)]
    evs += [{"type": "response.output_item.done", "output_index": i, "item": done[i]} for i in range(items)]
    response = {"id": "resp_1", "object": "response", "status": "completed", "model": "m", "output": done}
    evs.append({"type": "response.completed", "response": {**response, "usage": USAGE}})
    for n, e in enumerate(evs):
        e["sequence_number"] = n
    return evs


def sdk_response_texts(events: list[dict]) -> dict[tuple[int, int], str] | str:
    """What the openai SDK's Responses stream helper has made of each text once it read
    ``events`` (the items its text delta events' ``snapshot`` comes from): (output index, content
    index) -> the part's text; or the exception it raised."""
    state = ResponseStreamState(input_tools=omit, text_format=omit)
    try:
        for e in events:
            state.handle_event(construct_type(type_=ResponseStreamEvent, value=e))
    except Exception as e:
        return type(e).__name__
    items = state._output_items  # output index -> the item its deltas are added to
    return {(i, j): part.text for i, item in items.items() for j, part in enumerate(item.content)}


def verifier_key(event: dict) -> list[str]:
    """The text stream the verifier reads a text delta event's text into."""
    return [k for k in parse_response_event(event).fields if k.endswith(":output_text")]


#: the second text's delta D under another form of its index: (field, form) -> what the SDK
#: shows of each text, the verifier's key for D
RESPONSE_SPLITS: dict[str, tuple[str, Any, Any, list[str]]] = {
    # 1.0: the verifier now reads it as 1, as the SDK does (it read it as 0)
    "output-1.0": ("output_index", 1.0, {(0, 0): "AC", (1, 0): "BDE"}, ["1:0:output_text"]),
    "output-true": ("output_index", True, {(0, 0): "AC", (1, 0): "BDE"}, ["0:0:output_text"]),
    "output-string": ("output_index", "1", {(0, 0): "AC", (1, 0): "BDE"}, ["0:0:output_text"]),
    "content-true": ("content_index", True, {(0, 0): "AC", (0, 1): "BDE"}, ["0:0:output_text"]),
    "content-string": ("content_index", "1", {(0, 0): "AC", (0, 1): "BDE"}, ["0:0:output_text"]),
    "content-1.0": ("content_index", 1.0, {(0, 0): "AC", (0, 1): "BDE"}, ["0:1:output_text"]),
    "content-negative": ("content_index", -1, {(0, 0): "AC", (0, 1): "BDE"}, ["0:-1:output_text"]),
    "content-false": ("content_index", False, {(0, 0): "ACD", (0, 1): "BE"}, ["0:0:output_text"]),
    # absent or null: no client groups it with a number (the verifier joins it with 0: more, not less)
    "output-absent": ("output_index", ABSENT, "RuntimeError", ["0:0:output_text"]),
    "content-null": ("content_index", None, "TypeError", ["0:0:output_text"]),
}


@pytest.mark.parametrize("form", list(RESPONSE_SPLITS), ids=list(RESPONSE_SPLITS))
def test_the_openai_sdk_groups_responses_text_by_a_value_the_verifier_read_apart(form):
    """Why the relay refuses them: texts A, C (item 0, part 0) and B, E (the second text), and D
    of the second text under another form of its index: the SDK's helper shows D inside the
    second text, while the verifier reads ``true`` and ``"1"`` as 0 (the first text's stream)
    and ``-1`` apart (``1.0`` it read as 0 too; now as 1, with the SDK). Absent or ``null``,
    the helper cannot place D (nor groups it with a number), and the verifier reads it with the
    first text: relayed."""
    field, odd, sdk, key = RESPONSE_SPLITS[form]
    evs = split_response(["A", "C"], ["B", "D", "E"], field, lambda k: odd if k == 1 else 1)
    (d,) = [e for e in evs if e.get("delta") == "D"]
    if odd is ABSENT:
        del d[field]
    assert sdk_response_texts(evs) == sdk
    assert verifier_key(d) == key


#: the index members a Responses text event has, by the openai SDK's own event types
INDEX_MEMBERS = ("output_index", "content_index", "summary_index")


def test_the_relay_knows_every_text_event_and_the_indexes_its_type_has():
    """The relay's table (gateway/relay/stream.py) names every text delta event the verifier
    reads (verifier/engine_response.py ``TEXT_DELTA_EVENTS``) with the index members the openai
    SDK's type of that event has, and the members the verifier keys its text by (``output_index``;
    ``content_index``, else ``summary_index``) that the type does not have."""
    from gateway.relay import stream  # the table is new: imported here, the rest of the module runs before it

    table = stream.RESPONSE_DELTA_INDEXES
    assert set(table) == set(TEXT_DELTA_EVENTS)
    for etype, (has, has_not) in table.items():
        fields = type(construct_type(type_=ResponseStreamEvent, value={"type": etype})).model_fields
        assert set(has) == {m for m in INDEX_MEMBERS if m in fields}, etype
        keyed_by = {"output_index"} | (set() if "content_index" in has else {"content_index", "summary_index"})
        assert set(has_not) == keyed_by - set(has), etype


def _without(data: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in data.items() if v is not ABSENT}


def _text_event(seq: int, output_index: Any, content_index: Any, delta: str) -> bytes:
    where = _without({"output_index": output_index, "content_index": content_index})
    return _event("response.output_text.delta", seq, item_id="msg_0", **where, delta=delta, logprobs=[])


#: a text event as a hostile engine sends it (its text "the secret"): -> (type, its members)
ODD_RESPONSE_EVENTS: dict[str, tuple[str, dict[str, Any]]] = {
    **{
        f"output-{name}": ("response.output_text.delta", {"output_index": v, "content_index": 0})
        for name, v in {
            "integral-float": 0.0,
            "true": True,
            "false": False,
            "string": "0",
            "negative": -1,
            "past-2**53": 2**53,
        }.items()
    },
    **{
        f"content-{name}": ("response.output_text.delta", {"output_index": 0, "content_index": v})
        for name, v in {
            "integral-float": 0.0,
            "true": True,
            "string": "0",
            "negative": -1,
        }.items()
    },
    "summary-true": ("response.reasoning_summary_text.delta", {"output_index": 0, "summary_index": True}),
    # members the type does not have, which no client reads and the verifier did (part of its key)
    "content-index-on-arguments": ("response.function_call_arguments.delta", {"output_index": 0, "content_index": 1}),
    "summary-index-on-arguments": ("response.function_call_arguments.delta", {"output_index": 0, "summary_index": 1}),
    "content-index-on-a-summary": (
        "response.reasoning_summary_text.delta",
        {"output_index": 0, "summary_index": 0, "content_index": 1},
    ),
    "output-index-on-a-transcript": ("response.audio.transcript.delta", {"output_index": 1}),
}


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "not-strict"])
@pytest.mark.parametrize("form", list(ODD_RESPONSE_EVENTS), ids=list(ODD_RESPONSE_EVENTS))
def test_a_responses_text_event_with_an_odd_index_ends_the_stream(form, strict):
    """A text event ("the secret") whose indexes clients group apart from the verifier: relayed
    before. Now the stream ends there with the Responses ``error`` event numbered after the last
    event (the settle counts the prompt and the text relayed); before anything started, a 502."""
    etype, members = ODD_RESPONSE_EVENTS[form]
    hidden = _event(etype, 2, item_id="x_0", **_without(members), delta="the secret")
    delta = _text_event(1, 0, 0, "Hel")
    path = "/v1/responses"
    r, q, in_flight = through_gateway_as([CREATED, delta, hidden, COMPLETED], RESPONSES_BODY, strict=strict, path=path)
    assert (r.status_code, r.content) == (200, CREATED + delta + _responses_error_event(ODD_OUTPUT, 2))
    assert (q.settled, in_flight) == ({"r4": [q.reserved["r4"] - 5 + HEL_TOKENS]}, [0])
    r, q, in_flight = through_gateway_as([CREATED, hidden, COMPLETED], RESPONSES_BODY, strict=strict, path=path)
    assert (r.status_code, error_of(r), in_flight) == (502, ODD_OUTPUT, [0])


def test_responses_text_events_as_vllm_and_sglang_stream_them_are_relayed_as_sent():
    """The control: each text event with the int indexes its type has (vLLM's
    ``streaming_events.py`` and SGLang's ``serving_responses.py`` build them from the openai
    types), a reasoning summary under ``summary_index``, arguments under ``output_index`` alone,
    an index absent or ``null``, and the events that are not text deltas, whatever indexes they
    carry: relayed byte for byte."""
    events = [
        CREATED,
        _event("response.reasoning_summary_text.delta", 1, item_id="rs_0", output_index=0, summary_index=0, delta="Th"),
        _event("response.reasoning_text.delta", 2, item_id="rs_0", output_index=0, content_index=0, delta="ink"),
        _event("response.content_part.added", 3, item_id="msg_1", output_index=1.0, content_index=True, part={}),
        _text_event(4, 1, 0, "Hel"),
        _text_event(5, 1, 1, "lo"),
        _event("response.refusal.delta", 6, item_id="msg_1", output_index=1, content_index=2, delta="no"),
        _event("response.function_call_arguments.delta", 7, item_id="fc_2", output_index=2, delta="{}"),
        _event("response.custom_tool_call_input.delta", 8, item_id="ct_3", output_index=3, delta="x"),
        _event("response.audio.transcript.delta", 9, delta="hi"),
        _text_event(10, 1, ABSENT, "!"),  # absent or null: read as 0, grouped with no number by a client
        _text_event(11, None, None, "?"),
        _event("response.completed", 12, response={"id": "r1", "status": "completed", "output": []}),
    ]
    stream = b"".join(events)
    r, _, _ = through_gateway_as([stream], RESPONSES_BODY, strict=True, path="/v1/responses")
    assert (r.status_code, r.content) == (200, stream)


def sdk_texts_of(raw: bytes) -> dict[tuple[int, int], str] | str:
    return sdk_response_texts(data_events(raw))


def test_a_responses_text_split_under_honest_indexes_is_withheld(stack):
    """The control through the real verifier: the clean text as the second part, under ``1``
    throughout, reaches the client (the SDK shows it whole); the passage so is withheld."""
    sc, svc, client = stack
    sc.events, sc.done = split_response(SAID, CONTROL, "content_index", lambda k: 1), False
    status, raw = send(client, "s", "responses", True)
    assert (status, sdk_texts_of(raw)) == (200, {(0, 0): "".join(SAID), (0, 1): "".join(CONTROL)})
    sc.events = split_response(SAID, pieces(VICTIM), "content_index", lambda k: 1)
    before, n = svc.stats["withheld"], len(svc.incidents.recent)
    status, raw = send(client, "s", "responses", True)
    assert MARK.encode() not in raw
    _withheld(svc, before, status, raw, True)
    _leak_named(svc, n)


@pytest.mark.parametrize(
    ("field", "odd"),
    [("output_index", 1.0), ("output_index", True), ("content_index", True), ("content_index", -1)],
    ids=["output-1.0", "output-true", "content-true", "content-negative"],
)
def test_a_responses_passage_split_between_an_index_and_another_form_is_refused(stack, field, odd):
    """Through the real verifier, a strict tenant: the second text's deltas say ``1`` and ``odd``
    by turns. The verifier read ``1.0`` and ``true`` as 0 (the first text's stream) and ``-1``
    apart, so no stream held the passage contiguously and it was released with 200, while the
    openai SDK shows it whole in the second text. Now the stream ends at the first odd index with
    the Responses ``error`` event: nothing of the passage reaches the client."""
    sc, svc, client = stack
    events = split_response(SAID, pieces(VICTIM), field, lambda k: 1 if k % 2 else odd)
    second = (1, 0) if field == "output_index" else (0, 1)
    assert sdk_response_texts(events)[second] == "".join(pieces(VICTIM))  # type: ignore[index]
    sc.events, sc.done = events, False
    status, raw = send(client, "s", "responses", True)
    first_odd = next(e for e in events if e.get(field) is odd)
    assert (status, raw) == (200, _responses_error_event(ODD_OUTPUT, first_odd["sequence_number"]))
    assert MARK.encode() not in raw
