"""Helpers for the relay tests against a hostile engine (tests/test_relay_non_object_events.py,
test_relay_sse_fields.py, test_relay_tool_and_output_indexes.py): the stream events, request
bodies and engine helpers they share, and :func:`chat_stream_ended_by`.

Engines: the in-process engine of tests/test_hostile_engine_round4.py (:func:`through_gateway_as`:
exact bytes and the quota ledger) and the scripted engine of tests/test_verifier_hostile_engine.py
behind the real gateway and verifier, its victim passage indexed (:func:`send`; its module-scoped
``stack`` fixture, which each test module binds as its own). The names re-exported here stay
defined in those modules.
"""

from __future__ import annotations

from typing import Any

from tests.gateway_harness import MODEL
from tests.test_gateway_relay import _chunk, _event, error_of
from tests.test_hostile_engine_round4 import (
    DONE,
    HELLO,
    HELLO_TOKENS,
    NOT_JSON,
    STREAM_BODY,
    _responses_error_event,
    error_event,
    through_gateway_as,
)
from tests.test_verifier_hostile_engine import CONTROL, MARK, SAID, VICTIM, _leak_named, _withheld, pieces, send
from tokenizer import bundled_counter

__all__ = [
    "COMPLETED",
    "CONTROL",
    "CREATED",
    "DONE",
    "HEL",
    "HEL_TOKENS",
    "HELLO",
    "HELLO_TOKENS",
    "MARK",
    "NOT_JSON",
    "RESPONSES_BODY",
    "SAID",
    "STOP",
    "STREAM_BODY",
    "VICTIM",
    "_chunk",
    "_event",
    "_leak_named",
    "_responses_error_event",
    "_withheld",
    "chat_stream_ended_by",
    "error_event",
    "error_of",
    "pieces",
    "send",
    "through_gateway_as",
]

#: a chat stream's last chunk: no text, finish reason ``stop``
STOP = _chunk("", False, "stop")
#: a streamed ``/v1/responses`` request (11 prompt tokens, at most 5 output tokens reserved)
RESPONSES_BODY = {"model": MODEL, "input": "Say hello.", "stream": True, "max_output_tokens": 5}
#: a Responses stream: its first event, a text delta saying "Hel", and its terminal event
CREATED = _event("response.created", 0, response={"id": "r1", "status": "in_progress", "output": []})
HEL = _event("response.output_text.delta", 1, output_index=0, content_index=0, delta="Hel")
COMPLETED = _event("response.completed", 3, response={"id": "r1", "status": "completed", "output": []})
#: the tokens of "Hel": the settle of a Responses stream cut after :data:`HEL` is the prompt and these
HEL_TOKENS = bundled_counter().count_text("Hel")

#: what :func:`chat_stream_ended_by` saw of a stream: (status, the body's bytes or its error object,
#: the quota ledger's settles by request id, what each upstream has left in flight)
Seen = tuple[int, Any, dict[str, list[int]], list[int]]


def chat_stream_ended_by(event: bytes, *, strict: bool, rest: bytes = STOP) -> tuple[Seen, Seen]:
    """Tenant a's chat stream (:data:`STREAM_BODY`, with strict verification or without:
    :func:`through_gateway_as`) holding ``event``, twice: after the response started (the engine
    sends ``HELLO, event, rest, DONE``) and first (``event, DONE``). Returns what each came to:
    the body's bytes the first time, its error object (:func:`error_of`, which fails unless the
    body is one OpenAI error) the second. The callers assert them (an event that ends the stream:
    an error event after ``HELLO``, then a 502)."""
    r, q, in_flight = through_gateway_as([HELLO, event, rest, DONE], STREAM_BODY, strict=strict)
    started = (r.status_code, r.content, q.settled, in_flight)
    r, q, in_flight = through_gateway_as([event, DONE], STREAM_BODY, strict=strict)
    return started, (r.status_code, error_of(r), q.settled, in_flight)
