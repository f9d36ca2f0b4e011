"""Exact values of :mod:`gateway.relay.stream`, the relay's per-event loop, driven without a
socket (the engine's reads played by the upstream client's :class:`MockResponse`): the
``(body, more_body)`` items :func:`relay_stream` yields, what it raises, and what it counts.

Expected values follow the stream formats the module relays. A chat/completions stream is
``data: <chunk>`` events ended by one ``data: [DONE]`` (OpenAI API reference, "Create chat
completion", ``stream``: "terminated by a ``data: [DONE]`` message"); each of the ``n`` choices
ends with a ``finish_reason`` of its own (vLLM ``serving_chat.py``,
``chat_completion_stream_generator``: one chunk per choice with ``finish_reason`` set). A
``/v1/responses`` stream has no ``[DONE]``: it ends with a terminal event, and an ``error`` event
is ``{"type": "error", "code", "message", "param", "sequence_number"}`` (OpenAI API reference,
Responses streaming events, ``error``).
"""

from __future__ import annotations

import asyncio
import itertools
import json
from typing import Any

import pytest

from config.errors import OpenAIError
from gateway.edge.body_budget import FREE_BODY_BYTES
from gateway.relay import stream as stream_module
from gateway.relay.sse import SSEEventTooLarge, SSESplitter
from gateway.relay.stream import (
    EVENTS_PER_TURN,
    HoldBack,
    StreamOptions,
    Tally,
    _Events,
    _split,
    merge_usage,
    odd_choice_index,
    odd_chunk_index,
    odd_output_index,
    odd_tool_call_index,
    relay_stream,
    unreadable_stream,
)
from gateway.relay.stream_protocol import CHAT_SSE, RESPONSES_SSE, StreamProtocol
from gateway.relay.upstream_client import MockResponse, RemoteProtocolError
from verifier.engine_response import StreamEvent

pytestmark = pytest.mark.timeout(30)

DONE = b"data: [DONE]\n\n"
CUT = "RemoteProtocolError: the engine ended its event stream before its end"


def chunk(content: str | None, index: int = 0, finish: str | None = None) -> bytes:
    """A chat chunk as OpenAI writes one (compact JSON): one choice, its ``delta`` and ``finish_reason``."""
    delta = {} if content is None else {"content": content}
    obj = {
        "id": "c1",
        "object": "chat.completion.chunk",
        "choices": [{"index": index, "delta": delta, "finish_reason": finish}],
    }
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def event(etype: str, seq: int, **data: Any) -> bytes:
    """A ``/v1/responses`` event as vLLM writes it: ``event: <type>``, its data of that ``type``."""
    body = json.dumps({"type": etype, "sequence_number": seq, **data}, separators=(",", ":"))
    return f"event: {etype}\ndata: {body}\n\n".encode()


HELLO = chunk("Hello ")
STOP = chunk("", finish="stop")
CREATED = event("response.created", 0, response={"id": "r1", "status": "in_progress", "output": []})
HEL = event("response.output_text.delta", 1, item_id="m1", output_index=0, content_index=0, delta="Hel")
COMPLETED = event("response.completed", 3, response={"id": "r1", "status": "completed", "output": []})


class PassGuard:
    """A guard that passes every event on as sent and records what it was handed to check."""

    def __init__(self) -> None:
        self.pieces: list[list[tuple[str, str]]] = []
        self.finished: dict[str, Any] | None = None

    async def feed(self, delta_text: str, raw_event: bytes, pieces=None) -> list[bytes]:
        self.pieces.append(list(pieces or ()))
        return [raw_event]

    async def finish_stream(self, *, usage, finish_reason, ttft_seconds) -> list[bytes]:
        self.finished = {"usage": usage, "finish_reason": finish_reason}
        return []


def options(**kw: Any) -> StreamOptions:
    base: dict[str, Any] = {
        "max_event_bytes": 1 << 20,
        "strip_usage": False,
        "budget": None,
        "tenant_id": "t",
        "request_id": "rid",
    }
    return StreamOptions(**{**base, **kw})


def relay(
    reads: list[bytes], protocol: StreamProtocol = CHAT_SSE, guard: Any = None, **kw: Any
) -> tuple[list[tuple[bytes, bool]], Tally, BaseException | None]:
    """The items :func:`relay_stream` yields for an engine answering ``reads`` (one read each),
    the tally it wrote, and what it raised (``None``: it ended)."""
    tally = Tally(0.0)
    got: list[tuple[bytes, bool]] = []

    async def run() -> BaseException | None:
        try:
            async for item in relay_stream(MockResponse(200, {}, reads), protocol, guard, tally, options(**kw)):
                got.append(item)
        except (OpenAIError, RemoteProtocolError, SSEEventTooLarge) as e:
            return e
        return None

    return got, tally, asyncio.run(run())


def error_body(e: BaseException | None) -> tuple[int, dict[str, Any]]:
    assert isinstance(e, OpenAIError)
    return e.status, json.loads(e.body_bytes())["error"]


# ---------------------------------------------------------------- where a stream ends


@pytest.mark.parametrize("guarded", [False, True], ids=["no-guard", "guard"])
def test_done_ends_the_stream_and_events_after_it_in_the_same_read_are_dropped(guarded):
    """``[DONE]`` is the last event of a chat stream: what follows it is not relayed, and the
    gateway's ``[DONE]`` is sent once, with ``more_body`` false."""
    got, _, err = relay([HELLO + STOP + DONE + chunk("after")], guard=PassGuard() if guarded else None)
    assert err is None
    assert got == [(b"", True), (HELLO + STOP, True), (DONE, False)]
    got, _, err = relay([HELLO, STOP + DONE, chunk("after"), DONE], guard=PassGuard() if guarded else None)
    assert err is None
    assert got == [(b"", True), (HELLO, True), (STOP, True), (DONE, False)]


def test_a_chat_stream_closed_after_text_without_a_finish_reason_was_cut():
    """No ``[DONE]``, no finish reason: the engine's answer was cut, not ended (the events read
    are relayed first)."""
    got, _, err = relay([HELLO])
    assert got == [(b"", True), (HELLO, True)]
    assert isinstance(err, RemoteProtocolError) and str(err) == CUT


def test_an_empty_body_was_cut_before_anything():
    got, _, err = relay([])
    assert got == [] and isinstance(err, RemoteProtocolError) and str(err) == CUT


def test_a_finish_reason_without_done_ends_the_stream_with_the_gateways_done():
    got, tally, err = relay([HELLO, STOP])
    assert err is None
    assert got == [(b"", True), (HELLO, True), (STOP, True), (DONE, False)]
    assert tally.result().finish_reason == "stop"


@pytest.mark.parametrize(
    ("finishes", "cut"),
    [((0, 1), False), ((1, 0), False), ((0,), True), ((1,), True), ((0, 0), True)],
    ids=["both", "both-reversed", "only-0", "only-1", "0-twice"],
)
def test_with_n_2_every_choice_must_finish(finishes, cut):
    """With ``n`` = 2 each choice ends with its own finish reason; a body that closes (no
    ``[DONE]``) before both did was cut."""
    reads = [chunk("a", 0), chunk("b", 1)] + [chunk("", i, "stop") for i in finishes]
    got, _, err = relay(reads, choices=2)
    if cut:
        assert isinstance(err, RemoteProtocolError) and got[-1][1] is True
    else:
        assert err is None and got[-1] == (DONE, False)


def test_an_engine_error_after_text_ends_the_stream_once():
    """An engine's error event after the response started (vLLM: ``data: {"error": ...}``, then
    ``[DONE]``, which this engine never sent): the gateway's OpenAI error event in its place,
    then one ``[DONE]``; not a second error event for a cut stream."""
    failed = b'data: {"error":{"message":"engine died","type":"InternalServerError","param":null,"code":500}}\n\n'
    got, tally, err = relay([HELLO, failed])
    assert err is None
    gateway_event = b'data: {"error":{"message":"engine died","type":"server_error","param":null,"code":null}}\n\n'
    assert got == [(b"", True), (HELLO, True), (gateway_event, True), (DONE, False)]
    assert tally.result().error_code is None


def test_a_strict_tenant_gets_the_gateways_error_event_without_the_engines_text():
    failed = b'data: {"error":{"message":"the secret","code":"engine_overloaded"}}\n\n'
    got, tally, err = relay([HELLO, failed, DONE], strict=True)
    assert err is None
    message = "The upstream engine answered an error (502); its message is not shown under strict verification."
    gateway_event = (
        b'data: {"error":{"message":"' + message.encode() + b'","type":"server_error","param":null,'
        b'"code":"engine_overloaded"}}\n\n'
    )
    assert got == [(b"", True), (HELLO, True), (gateway_event, True), (DONE, False)]
    assert tally.result().error_code == "engine_overloaded"


def test_an_engine_error_before_text_is_raised_with_its_status():
    failed = b'data: {"error":{"message":"too long","type":"BadRequestError","param":null,"code":400}}\n\n'
    got, _, err = relay([chunk(None), failed, DONE])
    assert got == []
    assert error_body(err) == (
        400,
        {"message": "too long", "type": "invalid_request_error", "param": None, "code": None},
    )


# ---------------------------------------------------------------- /v1/responses


def test_a_responses_stream_starts_at_its_first_text_and_has_no_done():
    got, tally, err = relay([CREATED, HEL, COMPLETED], RESPONSES_SSE)
    assert err is None
    assert got == [(b"", True), (CREATED + HEL, True), (COMPLETED, True), (b"", False)]
    p = tally.result()
    # response.completed is read as chat's "stop" (Produced.finish_reason is in chat names)
    assert (p.texts, p.pieces, p.finish_reason, p.sequence_number) == ({0: "Hel"}, {0: 1}, "stop", 3)


ENGINE_ERROR = event("error", 2, code="server_error", message="the secret", param=None)


def test_a_responses_error_event_is_relayed_as_sent():
    got, tally, err = relay([CREATED, HEL, ENGINE_ERROR], RESPONSES_SSE)
    assert err is None
    assert got == [(b"", True), (CREATED + HEL, True), (ENGINE_ERROR, True), (b"", False)]
    assert (tally.result().error_code, tally.result().sequence_number) == ("server_error", 2)


def test_a_strict_responses_stream_gets_the_gateways_error_event_numbered_as_the_engines():
    got, _, err = relay([CREATED, HEL, ENGINE_ERROR], RESPONSES_SSE, strict=True)
    assert err is None
    message = "The upstream engine answered an error (502); its message is not shown under strict verification."
    replaced = (
        b'event: error\ndata: {"type":"error","code":"server_error","message":"' + message.encode() + b'",'
        b'"param":null,"sequence_number":2}\n\n'
    )
    assert got == [(b"", True), (CREATED + HEL, True), (replaced, True), (b"", False)]


def test_a_snapshot_that_differs_from_the_deltas_is_handed_to_the_guard():
    """``response.output_text.done`` repeats the part's text: where it is not the deltas joined,
    the guard checks it as a text of its own."""
    p = event("response.output_text.delta", 2, item_id="m1", output_index=0, content_index=0, delta="p")
    for text, want in (("Help", []), ("Hello", [("0:0:output_text:snapshot", "Hello")])):
        done = event("response.output_text.done", 3, item_id="m1", output_index=0, content_index=0, text=text)
        guard = PassGuard()
        got, _, err = relay([CREATED, HEL, p, done, COMPLETED], RESPONSES_SSE, guard=guard)
        assert err is None and got[-1] == (b"", False)
        snapshots = [[p for p in pieces if p[0].startswith("0:0:output_text:")] for pieces in guard.pieces]
        assert snapshots == [[], [], [], want, []]


# ---------------------------------------------------------------- a stream no event of which could be read


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        # vLLM's ErrorResponse before 0.10: {"object": "error", "message", "type", "param", "code"}
        (b'{"object":"error","message":"busy","type":"ServiceUnavailableError","param":null,"code":503}', 503, "busy"),
        # OpenAI's error body (and vLLM's since): {"error": {...}}
        (b'{"error":{"message":"slow down","type":"requests","param":null,"code":429}}', 429, "slow down"),
        (b'{"id":"c1","choices":[]}', 502, "The upstream engine's event stream ended before any event could be read."),
        (b"Internal Server Error", 502, "The upstream engine's event stream ended before any event could be read."),
    ],
    ids=["vllm-object-error", "openai-error", "other-object", "plain-text"],
)
def test_a_stream_of_one_unframed_body_is_its_error_or_a_502(body, status, message):
    got, _, err = relay([body])
    assert got == []
    assert isinstance(err, OpenAIError) and (err.status, err.message) == (status, message)
    assert (unreadable_stream(body).status, unreadable_stream(body).message) == (status, message)


def test_an_unfinished_event_after_the_response_started_is_dropped():
    got, _, err = relay([HELLO, STOP + b'data: {"choi'])
    assert err is None
    assert got == [(b"", True), (HELLO, True), (STOP, True), (DONE, False)]


# ---------------------------------------------------------------- hold-back


def test_hold_back_holds_up_to_its_limit_then_starts_the_response():
    h = HoldBack(10)
    assert h.offer([]) == []
    assert h.offer([b"12345"]) == []
    assert h.offer([b"67890"]) == []  # 10 bytes held: the limit
    assert h.started is False
    assert h.offer([b"x"]) == [(b"", True), (b"1234567890x", True)]
    assert (h.started, h.held) == (True, [])
    assert h.offer([b"a", b"b"]) == [(b"ab", True)]
    assert h.offer([]) == []


def test_events_without_content_past_the_event_bound_start_the_response():
    """Held back are at most ``max_event_bytes`` (100 here): the eleventh 10-byte event passes
    the bound and the response starts with all eleven."""
    empty = b"data: {}\n\n"
    stop = b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n'
    got, _, err = relay([empty] * 11 + [stop], max_event_bytes=100)
    assert err is None
    assert got == [(b"", True), (empty * 11, True), (stop, True), (DONE, False)]
    got, _, err = relay([empty] * 10 + [stop], max_event_bytes=100)
    assert got == [(b"", True), (empty * 10 + stop, True), (DONE, False)]


# ---------------------------------------------------------------- an event over the bound


def test_an_event_over_the_bound_ends_the_stream_after_the_events_before_it():
    read = HELLO + b"data: " + b"x" * len(HELLO)  # unfinished, and already past the bound
    got, _, err = relay([read], max_event_bytes=len(HELLO))
    assert got == [(b"", True), (HELLO, True)]
    assert isinstance(err, SSEEventTooLarge) and err.limit == len(HELLO)


# ---------------------------------------------------------------- the large-body budget


class Budget:
    def __init__(self) -> None:
        self.taken: list[tuple[str, int]] = []

    async def take(self, tenant_id: str, n: int) -> None:
        self.taken.append((tenant_id, n))


def test_bytes_of_an_unfinished_event_past_the_free_bytes_are_spent_from_the_budget():
    budget = Budget()
    opts = options(budget=budget, tenant_id="tenant-a")
    step = _Events(CHAT_SSE, None, Tally(0.0), opts)
    splitter = SSESplitter(opts.max_event_bytes)

    def feed(data: bytes) -> list[bytes]:
        return asyncio.run(_split(opts, splitter, step, data))

    assert feed(b"data: " + b"x" * (FREE_BODY_BYTES - 6)) == []  # exactly the free bytes: nothing spent
    assert budget.taken == []
    feed(b"x")
    feed(b"x" * 5000)
    assert budget.taken == [("tenant-a", 1), ("tenant-a", 5000)]
    big = b"data: " + b"x" * (FREE_BODY_BYTES + 994)  # 1000 past the free bytes
    splitter2 = SSESplitter(opts.max_event_bytes)
    assert asyncio.run(_split(opts, splitter2, step, big)) == []
    assert budget.taken[-1] == ("tenant-a", 1000)
    assert feed(b"\n\n") == [b"data: " + b"x" * (FREE_BODY_BYTES + 5000 - 5) + b"\n\n"]
    assert len(budget.taken) == 3


# ---------------------------------------------------------------- counting


def test_merge_usage_keeps_each_counts_largest_and_returns_the_later_report_when_nothing_shrank():
    old = {"prompt_tokens": 11, "completion_tokens": 5}
    new = {"prompt_tokens": 11, "completion_tokens": 6, "total_tokens": 17}
    assert merge_usage(old, new) is new
    assert merge_usage(new, {"prompt_tokens": 11, "completion_tokens": 1}) == {
        "prompt_tokens": 11,
        "completion_tokens": 6,
        "total_tokens": 17,
    }
    assert merge_usage({"completion_tokens": 5}, {"completion_tokens": None}) == {"completion_tokens": 5}
    assert merge_usage({"completion_tokens": True}, {"completion_tokens": 0}) == {"completion_tokens": 0}
    # a field that is not a count is the later report's, even where a count shrank
    assert merge_usage({"completion_tokens": 6, "x": "old"}, {"completion_tokens": 1, "x": "new"}) == {
        "completion_tokens": 6,
        "x": "new",
    }


def test_the_tally_counts_texts_pieces_and_the_first_texts_time(monkeypatch):
    monkeypatch.setattr(stream_module.time, "perf_counter", itertools.count(1000.0, 5.0).__next__)
    t = Tally(990.0)
    t.add(StreamEvent({0: "Hel"}, kind="chunk"))
    ttft = t.ttft_seconds
    assert ttft == 10.0
    t.add(StreamEvent({0: "lo", 1: "x"}, kind="chunk"))
    t.add(StreamEvent(kind="chunk", finish_reason="length", finished=(1,)))
    p = t.result()
    assert (p.texts, p.pieces, p.finish_reason, p.ttft_seconds) == ({0: "Hello", 1: "x"}, {0: 2, 1: 1}, "length", ttft)
    assert t.finished == {1}


def test_the_tally_keeps_the_last_sequence_number_and_finish_reason_an_event_carried():
    """An event without them (a comment, the usage chunk OpenAI streams after the finish chunk
    with ``stream_options.include_usage``) changes neither; an event without text sets no TTFT."""
    t = Tally(0.0)
    t.add(StreamEvent(kind="other", sequence_number=4))
    t.add(StreamEvent(kind="chunk", finish_reason="stop", finished=(0,)))
    t.add(StreamEvent(kind="chunk", usage={"prompt_tokens": 11, "completion_tokens": 2}, usage_only=True))
    t.add(StreamEvent(kind="other"))
    p = t.result()
    assert (p.sequence_number, p.finish_reason, p.ttft_seconds, p.texts, p.pieces) == (4, "stop", None, {}, {})
    assert t.finished == {0}


#: the ``stream_options.include_usage`` chunk: ``choices`` empty, after the finish chunk
USAGE = (
    b'data: {"id":"c1","object":"chat.completion.chunk","choices":[],'
    b'"usage":{"prompt_tokens":11,"completion_tokens":1}}\n\n'
)


def test_the_usage_chunk_after_the_finish_chunk_does_not_make_the_stream_cut():
    got, tally, err = relay([HELLO, STOP, USAGE])
    assert err is None
    assert got == [(b"", True), (HELLO, True), (STOP, True), (USAGE, True), (DONE, False)]
    assert tally.result().usage == {"prompt_tokens": 11, "completion_tokens": 1}


def test_a_responses_stream_cut_after_a_comment_keeps_the_last_events_number():
    """The gateway's error event for a cut ``/v1/responses`` stream is numbered after the last
    numbered event (a comment has none)."""
    got, tally, err = relay([CREATED, HEL, b":\n\n"], RESPONSES_SSE)
    assert got == [(b"", True), (CREATED + HEL, True), (b":\n\n", True)]
    assert isinstance(err, RemoteProtocolError) and str(err) == CUT
    assert tally.result().sequence_number == 1


def test_an_unfinished_event_is_logged_once_and_only_when_there_is_one(caplog):
    caplog.set_level("WARNING", logger="kvgate.proxy")
    relay([HELLO, STOP])
    relay([HELLO, STOP, DONE])
    assert [r.getMessage() for r in caplog.records] == []
    relay([HELLO, STOP + b"data: {"])
    assert [(r.name, r.getMessage(), r.fields) for r in caplog.records] == [
        ("kvgate.proxy", "upstream stream ended inside an event", {"request_id": "rid"})
    ]


# ---------------------------------------------------------------- indexes clients group apart


def test_odd_choice_index_reads_only_a_list_of_choices():
    assert odd_choice_index([{"index": 0}], 1) is False
    assert odd_choice_index([{"index": 1}], 1) is True
    assert odd_choice_index([{"index": 0}, {"index": 1}], 1) is True  # one odd choice is enough
    assert odd_choice_index([], 1) is False
    assert odd_choice_index([{"index": -1}], 1) is True  # the openai SDK's stream reads -1 as the last choice
    assert odd_choice_index([{"index": -1.0}], 1) is True
    assert odd_choice_index([{"index": 0.0}], 1) is False
    for not_a_list in (None, 5, "ab", {"index": 7}):
        assert odd_choice_index(not_a_list, 1) is False
    assert odd_chunk_index(None, 1) is None


def test_odd_tool_call_index_is_false_for_calls_every_client_indexes_alike():
    assert odd_tool_call_index([]) is False
    assert odd_tool_call_index([{"index": 0}, {"index": 2**53 - 1}, {"index": 3.0}, "x"]) is False
    assert odd_tool_call_index([{"index": 0.0}]) is False
    assert odd_tool_call_index([{"index": 2**53}]) is True
    assert odd_tool_call_index([{"index": float(2**53)}]) is True  # a double rounds 2**53 + 1 to it


def test_odd_output_index_refuses_a_member_the_events_type_does_not_have():
    """``ResponseFunctionCallArgumentsDeltaEvent`` has ``output_index`` and no ``content_index``
    (openai SDK ``types/responses/response_function_call_arguments_delta_event.py``)."""
    args = {"type": "response.function_call_arguments.delta", "item_id": "fc1", "output_index": 0, "delta": "{"}
    assert odd_output_index(args) is False
    assert odd_output_index({**args, "content_index": 0}) is True
    assert odd_output_index({**args, "summary_index": 0}) is True
    text = {"type": "response.output_text.delta", "output_index": 0, "content_index": 0, "delta": "x"}
    assert odd_output_index(text) is False
    for etype in (None, ["response.output_text.delta"], {"t": 1}, 7):
        assert odd_output_index({**text, "type": etype}) is False


ODD_EVENT_TYPE = (
    502,
    {
        "message": "The upstream engine sent a stream event whose event field is not the type of its data, "
        "which the gateway does not relay.",
        "type": "server_error",
        "param": None,
        "code": "upstream_unavailable",
    },
)


def test_an_event_field_that_is_not_the_datas_type_ends_the_stream():
    """A client dispatches an event by its ``event:`` field (WHATWG HTML, "dispatch the event":
    the event type buffer), the verifier reads the data: the two must name one type, and a
    chat chunk's data has none. An event whose data is not an object has no type either, even
    when the event before had the same ``event:`` field."""
    named_wrong = HEL.replace(b"event: response.output_text.delta", b"event: response.completed")
    got, _, err = relay([CREATED, named_wrong, COMPLETED], RESPONSES_SSE)
    assert got == [] and error_body(err) == ODD_EVENT_TYPE
    not_an_object = b"event: response.output_text.delta\ndata: [1]\n\n"
    got, _, err = relay([CREATED, HEL, not_an_object, COMPLETED], RESPONSES_SSE)
    assert got == [(b"", True), (CREATED + HEL, True)] and error_body(err) == ODD_EVENT_TYPE
    got, _, err = relay([b"event: message\n" + HELLO, STOP, DONE])
    assert got == [] and error_body(err) == ODD_EVENT_TYPE
    # of two event fields the last names the event (WHATWG HTML, "event stream interpretation")
    renamed = b"event: response.output_text.delta\nevent: response.completed\n" + HEL.split(b"\n", 1)[1]
    got, _, err = relay([CREATED, renamed, COMPLETED], RESPONSES_SSE)
    assert got == [] and error_body(err) == ODD_EVENT_TYPE


def test_events_after_done_in_later_slices_of_the_same_read_are_dropped():
    """A read of more events than one loop turn relays (``EVENTS_PER_TURN``) that holds
    ``[DONE]`` in its first slice: nothing after ``[DONE]`` is relayed, whatever slice it is in."""
    after = chunk("after") * (2 * EVENTS_PER_TURN)
    got, _, err = relay([HELLO + STOP + DONE + after])
    assert err is None
    assert got == [(b"", True), (HELLO + STOP, True), (DONE, False)]


def test_a_chunks_id_that_changes_is_handed_to_the_guard_as_text():
    """Every chunk of a stream has the same ``id`` (OpenAI API reference, the chat completion
    chunk object: "Each chunk has the same ID"): a changed one is text for the guard, the first
    value joined to the change, and from then on every value of it (the verifier's
    :class:`~verifier.engine_response.StreamMeta`)."""
    guard = PassGuard()
    changed = chunk("x").replace(b'"id":"c1"', b'"id":"c2"')
    got, _, err = relay([HELLO, changed, STOP, DONE], guard=guard)
    assert err is None and got[-1] == (DONE, False)
    assert [[p for p in pieces if p[0] == "-:id"] for pieces in guard.pieces] == [
        [],
        [("-:id", "c1c2")],
        [("-:id", "c1")],
    ]


def test_odd_chunk_index_skips_what_is_not_a_choice_object():
    assert odd_chunk_index(["x", 1, None, [0]], 1) is None
    assert odd_chunk_index(["x", {"index": 1}], 1) == "odd_index"
    assert odd_chunk_index([{"index": 1.0}, {"index": 0}], 2) is None  # 1.0 is 1 to every JSON reader
    assert odd_chunk_index([{"index": 1.5}], 2) == "odd_index"
    assert odd_chunk_index([{"index": -1}], 1) == "odd_index"


@pytest.mark.parametrize("guarded", [False, True], ids=["no-guard", "guard"])
def test_a_stripped_usage_chunk_drops_only_itself(guarded):
    """With ``forward.strip_usage`` the usage chunk the gateway asked for is not relayed; the
    events after it in the same read are."""
    got, tally, err = relay([HELLO + USAGE + STOP + DONE], guard=PassGuard() if guarded else None, strip_usage=True)
    assert err is None
    assert got == [(b"", True), (HELLO + STOP, True), (DONE, False)]
    assert tally.result().usage == {"prompt_tokens": 11, "completion_tokens": 1}


@pytest.mark.parametrize(
    ("engine", "text"),
    [(e, [("-:key_names", "z ")]) for e in ("vllm", "sglang", "kvgate")] + [("openai", [])],
)
def test_a_first_chunks_unknown_key_name_is_text_for_engines_that_send_only_protocol_fields(engine, text):
    """vLLM's chunk (``ChatCompletionStreamResponse``) names only fields of the protocol: a key
    name of no field is text from its first chunk on; an OpenAI-compatible server may name
    fields of its own in its first chunk (metadata)."""
    first = HELLO.replace(b'"object":', b'"z":1,"object":')
    guard = PassGuard()
    got, _, err = relay([first, STOP, DONE], guard=guard, engine=engine)
    assert err is None and got[-1] == (DONE, False)
    assert [[p for p in pieces if p[0] == "-:key_names"] for pieces in guard.pieces] == [text, []]


def test_a_read_of_more_events_than_one_turn_is_relayed_whole():
    comments = b":\n\n" * (2 * EVENTS_PER_TURN + 88)
    got, _, err = relay([comments + HELLO + STOP + DONE])
    assert err is None
    assert got == [(b"", True), (comments + HELLO + STOP, True), (DONE, False)]


def test_a_blank_line_made_with_a_bare_cr_ends_the_stream():
    """WHATWG HTML, "event stream interpretation": a bare CR ends a line, so ``\\r\\r`` is a
    blank line and a client reads two events where the splitter found one."""
    got, _, err = relay([b"data: {}\r\rdata: {}\n\n", STOP, DONE])
    assert got == []
    assert error_body(err) == (
        502,
        {
            "message": "The upstream engine sent an event stream with bare CR line endings, which the gateway "
            "does not relay.",
            "type": "server_error",
            "param": None,
            "code": "upstream_unavailable",
        },
    )


REFUSED = {
    "lenient": (
        b'data: {"choices":[{"index":0,"delta":{"content":"x"}}],"n":NaN}\n\n',
        "The upstream engine sent a stream event whose JSON the gateway does not read (a lone surrogate, NaN or "
        "Infinity, a number out of range, invalid UTF-8 or nesting too deep), which it does not relay.",
    ),
    "not_json": (
        b"data: Hello\n\n",
        "The upstream engine sent a stream event whose data is not JSON (plain text, a cut object or an object "
        "followed by text), which the gateway does not relay.",
    ),
    "odd_index": (
        chunk("x", index=1),
        "The upstream engine sent a choice whose index is not one of the choices asked for (not an integer, "
        "absent, negative or too large), which the gateway does not relay.",
    ),
    "odd_tool_index": (
        b'data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":true,"function":{"arguments":"x"}}]}}]}\n\n',
        "The upstream engine sent a tool call whose index is not a whole number from 0 to 2**53 - 1, which the "
        "gateway does not relay.",
    ),
}


@pytest.mark.parametrize("kind", list(REFUSED))
def test_an_event_outside_the_protocol_is_a_502(kind):
    sent, message = REFUSED[kind]
    got, _, err = relay([sent, STOP, DONE])
    assert got == []
    want = {"message": message, "type": "server_error", "param": None, "code": "upstream_unavailable"}
    assert error_body(err) == (502, want)


#: the Responses text delta events -> the index members of their type (openai SDK ``types/responses``:
#: ``ResponseTextDeltaEvent``, ``ResponseRefusalDeltaEvent``, ``ResponseReasoningTextDeltaEvent``,
#: ``ResponseReasoningSummaryTextDeltaEvent``, the arguments / input / code deltas,
#: ``ResponseAudioTranscriptDeltaEvent``)
DELTA_MEMBERS = {
    "response.output_text.delta": ("output_index", "content_index"),
    "response.refusal.delta": ("output_index", "content_index"),
    "response.reasoning_text.delta": ("output_index", "content_index"),
    "response.reasoning_summary_text.delta": ("output_index", "summary_index"),
    "response.function_call_arguments.delta": ("output_index",),
    "response.custom_tool_call_input.delta": ("output_index",),
    "response.mcp_call_arguments.delta": ("output_index",),
    "response.code_interpreter_call_code.delta": ("output_index",),
    "response.audio.transcript.delta": (),
}


@pytest.mark.parametrize("etype", list(DELTA_MEMBERS))
def test_odd_output_index_per_delta_type(etype):
    has = DELTA_MEMBERS[etype]
    honest = {"type": etype, "sequence_number": 1, "delta": "x", **dict.fromkeys(has, 0)}
    assert odd_output_index(honest) is False
    for m in has:
        assert odd_output_index({**honest, m: -1}) is True
        assert odd_output_index({**honest, m: 1.0}) is True
    # a member the type lacks that the verifier keys the text by (output_index; content_index, else
    # summary_index): no client reads it, so it may not split what the verifier joins. Beside a
    # content_index, a summary_index is read by neither.
    keyed = {"output_index", "content_index", "summary_index"} - (
        {"summary_index"} if "content_index" in has else set()
    )
    for m in keyed - set(has):
        assert odd_output_index({**honest, m: 0}) is True
    JSON_SAFE_INDEXES = 2**53
    for m in has:
        assert odd_output_index({**honest, m: JSON_SAFE_INDEXES - 1}) is False
        assert odd_output_index({**honest, m: JSON_SAFE_INDEXES}) is True


def test_a_responses_text_event_with_an_index_clients_group_apart_is_a_502():
    odd = event("response.output_text.delta", 1, item_id="m1", output_index=0, content_index=True, delta="Hel")
    got, _, err = relay([CREATED, odd, COMPLETED], RESPONSES_SSE)
    assert got == []
    message = (
        "The upstream engine sent a Responses text event with an output_index, content_index or summary_index "
        "that is not an integer from 0 to 2**53 - 1, or one its type does not have, which the gateway does not relay."
    )
    assert error_body(err) == (
        502,
        {"message": message, "type": "server_error", "param": None, "code": "upstream_unavailable"},
    )
