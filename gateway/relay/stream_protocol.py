"""A route's stream protocol: what the one relay loop (:func:`gateway.relay.stream.relay_stream`)
needs to know about an event stream besides its bytes. Two protocols, one instance each, which the
route values (:mod:`gateway.routes`) carry as ``stream_protocol``:

- :data:`CHAT_SSE` (``/v1/chat/completions``, ``/v1/completions``): chunks read by
  :func:`gateway.relay.sse.inspect`; the stream ends with ``data: [DONE]`` (the engine's is
  dropped, the gateway sends one exactly once); an engine error event after the response
  started becomes the gateway's OpenAI error event; the usage chunk and ``"usage": null``
  members the gateway asked for are stripped; a cut stream ends with an error event and
  ``[DONE]``.
- :data:`RESPONSES_SSE` (``/v1/responses``): events read by
  :func:`verifier.engine_response.parse_response_event`; nothing appended or stripped; an
  ``error`` event is relayed as sent; text an event repeats (a snapshot) is checked where it
  differs from the deltas streamed; a cut stream ends with the Responses ``error`` event,
  numbered after the last event.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from config.errors import OpenAIError
from gateway.relay.sse import DONE_EVENT, data_of, inspect, unparsed
from verifier.engine_response import StreamEvent, parse_response_event


def error_event(err: OpenAIError) -> bytes:
    """An OpenAI error body as one SSE event."""
    return b"data: " + err.body_bytes() + b"\n\n"


def response_error_event(err: OpenAIError, after: int | None) -> bytes:
    """The Responses API's own ``error`` event for ``err``
    (``{"type": "error", "code", "message", "param", "sequence_number"}``), numbered after the
    stream's last event ``after``: how the gateway ends a ``/v1/responses`` stream it must cut
    (that protocol has no ``[DONE]``)."""
    e = orjson.loads(err.body_bytes())["error"]
    data: dict[str, Any] = {
        "type": "error",
        "code": e.get("code"),
        "message": e.get("message"),
        "param": e.get("param"),
    }
    if after is not None:
        data["sequence_number"] = after + 1
    return b"event: error\ndata: " + orjson.dumps(data) + b"\n\n"


def chat_error_tail(err: OpenAIError, after: int | None) -> bytes:
    """The bytes that end a started chat/completions stream with ``err``: an error event and
    ``[DONE]`` (``after`` is not read: chunks are not numbered)."""
    return error_event(err) + DONE_EVENT


def read_response_event(event: bytes, odd: Callable[[dict[str, Any]], str | None] | None = None) -> StreamEvent:
    """A ``/v1/responses`` stream event's ``data`` as a :class:`StreamEvent` (``other`` when it
    has no data, blank data or ``[DONE]``, the chat end marker, at which the openai SDK stops in
    either protocol: relayed as sent; ``lenient`` for JSON that orjson refuses and a client reads,
    ``not_json`` for other text no JSON reader takes: :func:`gateway.relay.sse.unparsed`). With
    ``odd``, as :func:`gateway.relay.sse.inspect` takes it (the relay passes a check built on
    :func:`gateway.relay.stream.odd_output_index`), an event object for which it returns a kind is
    read as that kind: the JSON is decoded once for both. Never raises (``odd`` aside)."""
    payload = data_of(event)
    if payload is None:
        return StreamEvent()
    try:
        obj = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return StreamEvent() if payload.strip() == b"[DONE]" else unparsed(payload)
    if odd is not None and type(obj) is dict:
        kind = odd(obj)
        if kind is not None:
            return StreamEvent(kind=kind)
    return parse_response_event(obj)


@dataclass(frozen=True, slots=True)
class StreamProtocol:
    """How one kind of event stream is relayed (module docstring).

    ``name``: for logs and reprs. ``read(event bytes) -> StreamEvent``: what an event carries.
    ``end_marker``: bytes the gateway sends after the last event (``b""``: none).
    ``error_tail(err, last sequence number) -> bytes``: what ends a stream the gateway cuts.
    ``replaces_error_events``: an engine error event after the response started is replaced by
    ``error_in_place(err, the engine event's sequence number)``; otherwise it is relayed as sent.
    ``strips_usage``: when the request's ``forward.strip_usage`` is set, the usage-only event is
    dropped and ``"usage": null`` members are removed. ``checks_snapshots``: text an event repeats
    is checked by the guard where it differs from the deltas streamed under its key.
    ``finishes_per_choice``: each choice ends with a finish reason of its own, so a stream that
    ends (without its end marker) before every requested choice did was cut."""

    name: str
    read: Callable[[bytes], StreamEvent]
    end_marker: bytes
    error_tail: Callable[[OpenAIError, int | None], bytes]
    error_in_place: Callable[[OpenAIError, int | None], bytes]
    replaces_error_events: bool
    strips_usage: bool
    checks_snapshots: bool
    finishes_per_choice: bool


#: ``/v1/chat/completions`` and ``/v1/completions`` streams
CHAT_SSE = StreamProtocol(
    name="chat-completions-sse",
    read=inspect,
    end_marker=DONE_EVENT,
    error_tail=chat_error_tail,
    error_in_place=lambda err, _seq: error_event(err),
    replaces_error_events=True,
    strips_usage=True,
    checks_snapshots=False,
    finishes_per_choice=True,
)

#: ``/v1/responses`` streams
RESPONSES_SSE = StreamProtocol(
    name="responses-sse",
    read=read_response_event,
    end_marker=b"",
    error_tail=response_error_event,
    error_in_place=lambda err, seq: response_error_event(err, None if seq is None else seq - 1),
    replaces_error_events=False,
    strips_usage=False,
    checks_snapshots=True,
    finishes_per_choice=False,
)
