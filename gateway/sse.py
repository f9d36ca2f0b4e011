"""Server-sent events on bytes (DESIGN.md step 7): split an upstream stream into events without
decoding it, so a multi-byte UTF-8 character cut across network reads, or U+2028 inside a JSON
string, arrives exactly as the engine sent it. The gateway forwards each event's original bytes.

An event ends at a blank line (``\\n\\n`` or ``\\r\\n\\r\\n``, the WHATWG SSE grammar's line
endings as engines send them). :func:`inspect` reads an event's ``data:`` payload as JSON to learn
what it carries (text, finish reason, usage, an error) without changing its bytes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import orjson

DONE_EVENT = b"data: [DONE]\n\n"

_USAGE_NULL = re.compile(rb',\s*"usage"\s*:\s*null|"usage"\s*:\s*null\s*,?')


class SSESplitter:
    """Feeds bytes, yields complete events (each ``bytes`` including its terminating blank line)."""

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        """Complete events in ``chunk`` (with what was buffered before); keeps the incomplete tail."""
        buf = self._buf + chunk if self._buf else chunk
        out: list[bytes] = []
        start = 0
        while True:
            i = buf.find(b"\n\n", start)
            j = buf.find(b"\r\n\r\n", start)
            if i < 0 and j < 0:
                break
            if j >= 0 and (i < 0 or j < i):
                end = j + 4
            else:
                end = i + 2
            out.append(buf[start:end])
            start = end
        self._buf = buf[start:]
        return out

    def tail(self) -> bytes:
        """Bytes after the last complete event (an event the upstream never finished)."""
        return self._buf


def data_of(event: bytes) -> bytes | None:
    """The ``data`` field of an event (``data:`` lines joined by ``\\n``, one leading space
    dropped per line), or ``None`` when the event has no data line (a comment, a retry)."""
    if event.startswith(b"data: ") and event.count(b"\n") <= 2 and b"\r" not in event:
        return event[6:].rstrip(b"\n")  # the common single-line case
    parts = []
    for line in event.replace(b"\r\n", b"\n").split(b"\n"):
        if line.startswith(b"data:"):
            v = line[5:]
            parts.append(v[1:] if v.startswith(b" ") else v)
    if not parts:
        return None
    return b"\n".join(parts)


@dataclass
class EventInfo:
    """What one event carries. ``kind``: ``done`` (``[DONE]``), ``error``, ``chunk`` (a JSON
    completion chunk), ``other`` (no data or not JSON). ``text``: the text it adds (every
    choice's ``delta.content``/``text`` joined); ``finish_reason``: the first non-null one;
    ``usage``: the ``usage`` object when non-null; ``usage_only``: ``choices`` is empty and usage
    is set (the ``stream_options.include_usage`` chunk)."""

    kind: str
    data: Any = None
    text: str = ""
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    usage_only: bool = False


def is_error_payload(obj: Any) -> bool:
    """An engine error object: OpenAI/vLLM ``{"error": ...}`` or SGLang ``{"object": "error"}``."""
    return isinstance(obj, dict) and ("error" in obj and "choices" not in obj or obj.get("object") == "error")


def inspect(event: bytes) -> EventInfo:
    """Classify an event (see :class:`EventInfo`); never raises on odd input."""
    payload = data_of(event)
    if payload is None:
        return EventInfo("other")
    if payload.strip() == b"[DONE]":
        return EventInfo("done")
    try:
        obj = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return EventInfo("other")
    if not isinstance(obj, dict):
        return EventInfo("other", obj)
    if is_error_payload(obj):
        return EventInfo("error", obj)
    info = EventInfo("chunk", obj)
    choices = obj.get("choices")
    if isinstance(choices, list):
        texts = []
        for c in choices:
            if not isinstance(c, dict):
                continue
            d = c.get("delta")
            t = d.get("content") if isinstance(d, dict) else c.get("text")
            if isinstance(t, str) and t:
                texts.append(t)
            if info.finish_reason is None and isinstance(c.get("finish_reason"), str):
                info.finish_reason = c["finish_reason"]
        info.text = "".join(texts)
    usage = obj.get("usage")
    if isinstance(usage, dict):
        info.usage = usage
        info.usage_only = isinstance(choices, list) and not choices
    return info


def strip_usage_null(event: bytes) -> bytes:
    """Remove a ``"usage": null`` member (the marker engines add to every chunk while
    ``include_usage`` is on) from an event's JSON, leaving every other byte as it was. A quoted
    ``"usage"`` can only be a key here: inside a JSON string its quotes would be escaped."""
    if b'"usage"' not in event:
        return event
    return _USAGE_NULL.sub(b"", event, count=1)
