"""Server-sent events on bytes (docs/design.md step 7): split an upstream stream into events without
decoding it, so a multi-byte UTF-8 character cut across network reads, or U+2028 inside a JSON
string, arrives exactly as the engine sent it. The gateway forwards each event's original bytes.

An event ends at a blank line (``\\n\\n`` or ``\\r\\n\\r\\n``, the WHATWG SSE grammar's line
endings as engines send them). One UTF-8 byte order mark (``EF BB BF``) at the very start of a
stream is dropped, as the WHATWG SSE algorithm drops it ("Event stream interpretation": one
leading U+FEFF is ignored): relayed, it made the first line's field name ``\\ufeffdata``, so the
gateway read no data in the first event (its text unguarded and uncounted) and the openai SDK,
whose UTF-8 decoding keeps the mark, lost the event, while a browser read it. :func:`inspect`
reads an event's ``data:`` payload as JSON to learn what it carries (text, finish reason, usage,
an error; read by :mod:`verifier.engine_response`) without changing its bytes. An event's lines
are read as a client reads them (WHATWG: a line ends at CRLF, LF or a bare CR), and
:func:`is_one_event` tells when a client would read more than one event in what the splitter found
(a blank line made with a bare CR, or ``\\n\\r\\n``): the relay ends such a stream, since the
events it cannot see would reach the client unread. For the same reason an event whose JSON orjson
refuses but a client's laxer reader takes (:func:`lenient_reads`: a lone surrogate escape, ``NaN``)
is read as ``lenient``, and data no JSON reader takes but a client still receives (plain text, a
cut object) as ``not_json`` (:func:`unparsed`): the relay ends the stream at either. The other
lines of an event (comments, ``id:``, ``retry:``, ``event:``) hold text a client receives and the
verifier does not read: :func:`relayed_fields` drops it, and names the event types to compare.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from typing import Any

import orjson

from verifier.engine_response import StreamEvent, parse_chunk_event

DONE_EVENT = b"data: [DONE]\n\n"

#: the UTF-8 byte order mark one of which a stream may start with (WHATWG: ignored)
BOM = b"\xef\xbb\xbf"

#: a line's end, as the WHATWG SSE grammar (and clients: the openai SDK, browsers) reads one
_LINE_END = re.compile(rb"\r\n|\r|\n")

_USAGE_NULL = re.compile(rb',\s*"usage"\s*:\s*null|"usage"\s*:\s*null\s*,?')


class SSEEventTooLarge(Exception):
    """An upstream event (or an unfinished one) grew past ``limit`` bytes: ``size`` bytes so far.
    ``before``: the complete events of the same read that came before it (still to be relayed)."""

    def __init__(self, size: int, limit: int, before: list[bytes] | None = None) -> None:
        super().__init__(f"stream event of {size} bytes or more, above the limit of {limit}")
        self.size = size
        self.limit = limit
        self.before = before or []


#: default bound of one event (bytes, terminator included): ``gateway.max_sse_event_bytes``
DEFAULT_MAX_EVENT_BYTES = 1 << 20


def _first_end(buf: bytes, pos: int = 0) -> int:
    """End (exclusive) of the first event terminator at or after ``pos``, or -1: the earlier of
    ``\n\n`` and ``\r\n\r\n`` by where it starts."""
    i = buf.find(b"\n\n", pos)
    j = buf.find(b"\r\n\r\n", pos)
    if j >= 0 and (i < 0 or j < i):
        return j + 4
    return i + 2 if i >= 0 else -1


def _event_ends(buf: bytes) -> Iterator[int]:
    """Ends (exclusive) of ``buf``'s event terminators, in order, as :func:`_first_end` would find
    them one after another, in time linear in ``len(buf)``: each kind's next occurrence is searched
    for once and kept until an event ends past it (asking :func:`_first_end` again after every
    event would scan to the end of the read for the kind the stream does not use, once per event)."""
    i = buf.find(b"\n\n")
    j = buf.find(b"\r\n\r\n")
    while i >= 0 or j >= 0:
        end = j + 4 if j >= 0 and (i < 0 or j < i) else i + 2
        yield end
        if 0 <= i < end:
            i = buf.find(b"\n\n", end)
        if 0 <= j < end:
            j = buf.find(b"\r\n\r\n", end)


class SSESplitter:
    """Feeds bytes, yields complete events (each ``bytes`` including its terminating blank line).

    Incremental: each :meth:`feed` scans only the bytes it has not scanned before (plus the 3
    before them, where a terminator may straddle two reads), and an unfinished event is kept as
    the list of reads that hold it (joined once, when it ends), so an event arriving in many small
    reads costs time linear in its size and never grows one buffer read by read.
    ``max_event_bytes`` bounds one event, terminator included, and the unfinished tail kept between
    reads: past it, :meth:`feed` raises :class:`SSEEventTooLarge` and drops the tail (``None``:
    unbounded). One :data:`BOM` at the start of the stream is dropped (module docstring), however
    the reads cut it; a second one, or one later in the stream, is not (a client does not drop it
    either: the line's field name then starts with U+FEFF, and the line is read as no field)."""

    __slots__ = ("_parts", "_size", "_last3", "_start", "max_event_bytes")

    def __init__(self, max_event_bytes: int | None = None) -> None:
        self._parts: list[bytes] = []  # the unfinished event, read by read
        self._size = 0
        self._last3 = b""  # its last 3 bytes
        #: the stream's first bytes while they may still be a BOM (``None``: past the start)
        self._start: bytes | None = b""
        self.max_event_bytes = max_event_bytes

    def feed(self, chunk: bytes) -> list[bytes]:
        """Complete events in ``chunk`` (with what was buffered before); keeps the incomplete tail.
        Raises :class:`SSEEventTooLarge` when an event or the tail exceeds ``max_event_bytes``."""
        if self._start is not None:  # the stream's start: drop one BOM, even cut across reads
            rest = self._after_bom(chunk)
            if rest is None:
                return []
            chunk = rest
        return self._events(chunk)

    def _events(self, chunk: bytes) -> list[bytes]:
        """:meth:`feed` past the stream's start."""
        limit = self.max_event_bytes
        out: list[bytes] = []
        if self._parts:
            # every terminator ends in "\n": a read without one ends nothing (a memchr, no copy)
            e = _first_end(self._last3 + chunk) if b"\n" in chunk else -1
            if e < 0:  # still unfinished
                self._parts.append(chunk)
                self._size += len(chunk)
                self._last3 = (self._last3 + chunk[-3:])[-3:]
                if limit is not None and self._size > limit:
                    size = self._size
                    self._drop()
                    raise SSEEventTooLarge(size, limit)
                return out
            k = e - len(self._last3)  # where the event ends in chunk (>= 1: the tail held no terminator)
            size = self._size + k
            if limit is not None and size > limit:
                self._drop()
                raise SSEEventTooLarge(size, limit)
            self._parts.append(chunk[:k])
            out.append(b"".join(self._parts))
            self._drop()
            chunk = chunk[k:]
        start = 0
        n = len(chunk)
        for e in _event_ends(chunk):
            if limit is not None and e - start > limit:
                raise SSEEventTooLarge(e - start, limit, out)
            out.append(chunk[start:e])
            start = e
        if start < n:
            tail = n - start
            if limit is not None and tail > limit:
                raise SSEEventTooLarge(tail, limit, out)
            rest = chunk[start:] if start else chunk
            self._parts = [rest]
            self._size = tail
            self._last3 = rest[-3:]
        return out

    def _after_bom(self, chunk: bytes) -> bytes | None:
        """The stream's first bytes (``chunk`` after those held) without a leading :data:`BOM`, or
        ``None`` (held) while they are too few to tell whether they start with one."""
        head = (self._start or b"") + chunk
        if len(head) < len(BOM) and BOM.startswith(head):
            self._start = head
            return None
        self._start = None
        return head[len(BOM) :] if head.startswith(BOM) else head

    def _drop(self) -> None:
        self._parts = []
        self._size = 0
        self._last3 = b""

    @property
    def pending_bytes(self) -> int:
        """Bytes of the unfinished event held so far (0 when the last read ended an event)."""
        return self._size + len(self._start or b"")

    def tail(self) -> bytes:
        """Bytes after the last complete event (an event the upstream never finished; the start
        of a BOM, when the stream ended inside one)."""
        return (self._start or b"") + b"".join(self._parts)


def data_of(event: bytes) -> bytes | None:
    """The ``data`` field of an event (``data:`` lines joined by ``\\n``, one leading space
    dropped per line), or ``None`` when the event has no data line (a comment, a retry)."""
    if event.startswith(b"data: ") and event.count(b"\n") <= 2 and event.find(b"\r") < 0:
        return event[6:].rstrip(b"\n")  # the common single-line case (``find`` costs half what ``in`` does)
    if event.startswith(b"event:") and event.find(b"\r") < 0:  # a /v1/responses event: one event line, one data line
        i = event.find(b"\n") + 1
        end = len(event) - 2
        if event.startswith(b"data:", i) and event.find(b"\n", i) == end:
            v = event[i + 5 : end]
            return v[1:] if v.startswith(b" ") else v
    parts = []
    for line in _LINE_END.split(event):
        if line.startswith(b"data:"):
            v = line[5:]
            parts.append(v[1:] if v.startswith(b" ") else v)
    if not parts:
        return None
    return b"\n".join(parts)


def is_one_event(event: bytes) -> bool:
    """Whether a client reading ``event`` (an event as :class:`SSESplitter` returns it) finds one
    event in it, not several: no line with content follows a blank line, lines ending at CRLF,
    LF or a bare CR. Without a CR the splitter's first ``\\n\\n`` is the first blank line, so
    only events holding a CR are read line by line."""
    if b"\r" not in event:
        return True
    content = blank = False
    for line in _LINE_END.split(event):
        if line:
            if blank:
                return False
            content = True
        elif content:
            blank = True
    return True


#: the comment vLLM sends while a chat/completions stream is idle (``--sse-keep-alive-interval``,
#: ``vllm/entrypoints/serve/utils/sse_keep_alive.py``: ``SSE_KEEP_ALIVE_COMMENT``), relayed as sent
KEEP_ALIVE = b": keep-alive"

#: one line of an event with its end (CRLF, LF or a bare CR: an event always ends with one)
_LINE = re.compile(rb"[^\r\n]*(?:\r\n|\r|\n)")

_NO_NAMES: tuple[bytes, ...] = ()


class SeveralEvents(ValueError):
    """What :func:`relayed_fields` raises for bytes a client reads as several events."""


def relayed_fields(event: bytes) -> tuple[bytes, tuple[bytes, ...]]:
    """``event`` (as :class:`SSESplitter` returns it) as the relay sends it, and the values of its
    ``event:`` lines (the event's type to a client; one leading space dropped), which the relay
    compares with its data's ``type``. Raises :class:`SeveralEvents` when a client finds more than
    one event in it (:func:`is_one_event`). Every line but ``data:`` and ``event:`` lines holds
    text the verifier does not read and a client receives (a raw reader prints it; a browser's
    ``EventSource`` exposes ``id:`` as ``lastEventId`` and sends it back, the openai SDK keeps
    ``id`` and ``retry``), so such a line becomes a bare comment (``:``, which clients skip, and an
    idle stream still sends bytes): a comment with text (but vLLM's :data:`KEEP_ALIVE`), an
    ``id:``, ``retry:`` or any other field's line (also one a client reads as no field, such as
    one starting with a byte order mark). No honest engine sends those lines (vLLM and SGLang
    write ``data:`` lines, ``event:`` before them in ``/v1/responses``, and vLLM's keep-alive
    comment), so its events come back as they are, and cheaply: an event of one ``data:`` line,
    or of one ``event:`` line and one ``data:`` line, without a CR, is not read line by line (one
    ``data:`` line, most of a stream, costs a ``find``, a ``startswith`` and a ``find``)."""
    if event.find(b"\r") >= 0:  # (``find`` costs half what ``in`` does)
        if not is_one_event(event):
            raise SeveralEvents
        return screened_fields(event)
    end = len(event) - 2
    if event.startswith(b"data:"):
        if event.find(b"\n") == end:
            return event, _NO_NAMES
    elif event.startswith(b"event:"):
        i = event.find(b"\n")
        if event.startswith(b"data:", i + 1) and event.find(b"\n", i + 1) == end:
            name = event[6:i]
            return event, (name[1:] if name.startswith(b" ") else name,)
    elif event == b": keep-alive\n\n":
        return event, _NO_NAMES
    return screened_fields(event)


def screened_fields(event: bytes) -> tuple[bytes, tuple[bytes, ...]]:
    """:func:`relayed_fields`, line by line (WHATWG: a line starting with a colon is a comment; a
    field's name runs to the line's first colon, or is the whole line). A line not relayed becomes
    a bare ``:`` with its own line end, so the event keeps its lines and its blank line."""
    names: list[bytes] = []
    kept: list[bytes] = []
    changed = False
    for m in _LINE.finditer(event):
        line = m.group()
        body = line.rstrip(b"\r\n")
        if not body or body.startswith(b"data:") or body == b"data" or body == b":" or body == KEEP_ALIVE:
            kept.append(line)
        elif body.startswith(b"event:") or body == b"event":
            value = body[6:]
            names.append(value[1:] if value.startswith(b" ") else value)
            kept.append(line)
        else:  # a comment's text, id, retry, any other field
            kept.append(b":" + line[len(body) :])
            changed = True
    return (b"".join(kept) if changed else event), tuple(names)


def lenient_reads(payload: bytes) -> bool:
    """Whether a client's JSON reader takes ``payload``, which orjson refused (call it only then:
    it is the slow path). orjson reads JSON as an honest engine writes it (vLLM and SGLang
    serialise with pydantic or orjson): valid UTF-8, no lone surrogate escape, no ``NaN`` or
    ``Infinity``, numbers a double holds, at most 1024 levels deep. Clients are laxer: Python's
    ``json`` (the openai SDK) takes a lone surrogate escape, ``NaN``, ``Infinity``, ``1e999``; a
    browser's ``JSON.parse``, after its UTF-8 decoding replaced an invalid byte, takes that byte,
    the lone surrogate, ``1e999``, an integer of any length and any depth. Read here as
    Python's ``json`` reads the payload decoded as a browser decodes it; an integer past its
    digit limit, or nesting past its recursion limit, counts as read (a browser reads both). A
    payload no reader takes (plain text, a cut object) is not read by a client either."""
    try:
        json.loads(payload.decode("utf-8", "replace"))
    except json.JSONDecodeError:
        return False
    except (ValueError, RecursionError):  # an integer past Python's digit limit, nesting past its depth
        return True
    return True


def unparsed(payload: bytes) -> StreamEvent:
    """An event whose ``data`` (``payload``) orjson refused: ``lenient`` when a client's JSON
    reader takes it (:func:`lenient_reads`), ``not_json`` when it holds text no JSON reader takes
    (plain text, a cut object, an object followed by text), ``other`` when it is empty or blank.
    A client still receives such text (a browser's ``EventSource`` hands it to the page; the
    openai SDK raises ``json.JSONDecodeError`` holding it as its ``doc``) and the verifier reads
    nothing in it, so the relay ends the stream there, as for ``lenient``; no honest engine sends
    it (vLLM and SGLang write each event's data as JSON, or ``[DONE]``)."""
    if lenient_reads(payload):
        return StreamEvent(kind="lenient")
    return StreamEvent(kind="not_json") if payload.strip() else StreamEvent()


def inspect(event: bytes, odd: Callable[[dict[str, Any]], str | None] | None = None) -> StreamEvent:
    """A chat/completions event as a :class:`~verifier.engine_response.StreamEvent`: ``done``
    (``[DONE]``), ``error`` (an engine error object), ``chunk`` (a JSON completion chunk:
    per-choice texts, finish reason, usage), ``lenient`` (JSON that orjson refuses and a client
    reads: :func:`lenient_reads`), ``not_json`` (text no JSON reader takes: :func:`unparsed`; the
    relay ends the stream at either), ``other`` (no data, blank data, a JSON value that is not an
    object: its strings are checked as ``"-:other"`` text). With ``odd`` (the relay passes a check
    built on :func:`gateway.relay.stream.odd_chunk_index`), an event object for which it returns a
    kind is read as that kind: the JSON is decoded once for both. Never raises on odd input
    (``odd`` aside)."""
    payload = data_of(event)
    if payload is None:
        return StreamEvent()
    if payload.strip() == b"[DONE]":
        return StreamEvent(kind="done")
    try:
        obj = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return unparsed(payload)
    if odd is not None and type(obj) is dict:
        kind = odd(obj)
        if kind is not None:
            return StreamEvent(kind=kind)
    return parse_chunk_event(obj)


def strip_usage_null(event: bytes) -> bytes:
    """Remove a ``"usage": null`` member (the marker engines add to every chunk while
    ``include_usage`` is on) from an event's JSON, leaving every other byte as it was. A quoted
    ``"usage"`` can only be a key here: inside a JSON string its quotes would be escaped."""
    if b'"usage"' not in event:
        return event
    return _USAGE_NULL.sub(b"", event, count=1)
