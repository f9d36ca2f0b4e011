"""Exact values of :mod:`gateway.relay.sse`: the events :class:`SSESplitter` returns read by read,
the byte order mark at a stream's start, the bound of one event, and what :func:`data_of`,
:func:`is_one_event`, :func:`relayed_fields`, :func:`inspect` and :func:`strip_usage_null` give.

Expected values follow the WHATWG HTML "Event stream interpretation" grammar the module cites: a
line ends at CRLF, LF or a bare CR; an empty line dispatches the event; one U+FEFF (UTF-8
``EF BB BF``) at the very start of the stream is ignored; a line starting with a colon is a
comment; a field's name runs to the line's first colon (or is the whole line) and one space after
the colon is dropped from its value; ``data`` values are joined with LF. The splitter ends an event
at ``\\n\\n`` or ``\\r\\n\\r\\n`` (the blank lines engines send), whichever starts first; other blank
lines (with a bare CR) are found by :func:`is_one_event`.
"""

from __future__ import annotations

from itertools import islice

import pytest

from config.models import GatewaySettings
from gateway.relay import sse
from gateway.relay.sse import (
    BOM,
    DEFAULT_MAX_EVENT_BYTES,
    SeveralEvents,
    SSEEventTooLarge,
    SSESplitter,
    data_of,
    inspect,
    is_one_event,
    relayed_fields,
    strip_usage_null,
)

NEXT = b"data: b\n\n"


# ---------------------------------------------------------------- where events end


def test_terminator_ends_in_one_read_are_found_where_each_blank_line_ends():
    """Ends (exclusive) of the events of one read: a read may start with a blank line (the
    previous event ended with the read before), and a ``\\n\\n`` may follow a ``\\r\\n\\r\\n``."""

    def ends(buf: bytes) -> list[int]:
        return list(islice(sse._event_ends(buf), 8))  # a wrong index repeats forever: cut it short

    assert ends(b"\n\ndata: a\n\n") == [2, 11]
    assert ends(b"\r\n\r\ndata: a\r\n\r\n") == [4, 15]
    assert ends(b"\n\ndata: a\r\n\r\n") == [2, 13]
    assert ends(b"a\r\n\r\n\n\n") == [5, 7]  # "a" CRLF, blank CRLF | blank LF, blank LF
    assert ends(b"a\n\n\r\n\r\n") == [3, 7]
    assert ends(b"a\r\n\nb\n\n") == [4, 7]  # "a" CRLF, blank LF | "b" LF, blank LF
    assert ends(b"data: a\n\r\n") == []  # a blank line with a CR: is_one_event's to find
    assert sse._first_end(b"\n\nx") == 2
    assert sse._first_end(b"\n\n\r\n\r\n") == 2
    assert sse._first_end(b"\r\n\r\n\n\n") == 4
    assert sse._first_end(b"x\r\n\r") == -1


class _Scanned(bytes):
    """bytes that add up how far each ``find`` looked (to the match's end, or to the end)"""

    scanned = 0

    def find(self, sub, start=0, *rest):  # type: ignore[override]
        i = super().find(sub, start, *rest)
        _Scanned.scanned += (len(self) if i < 0 else i + len(sub)) - start
        return i


@pytest.mark.parametrize("sep", [b"\n\n", b"\r\n\r\n"], ids=["lf", "crlf"])
def test_a_read_of_many_events_is_scanned_about_twice(sep):
    """Each terminator kind is searched for once over the read, whichever kind the stream uses.
    The read is fed past the stream's start: the first read is copied (the mark is looked for),
    so a measuring ``bytes`` would measure nothing there."""
    event = b"data: x" + sep
    read = _Scanned(event * 2000)
    sp = SSESplitter(1 << 20)
    assert sp.feed(b": start\n\n") == [b": start\n\n"]
    _Scanned.scanned = 0
    assert sp.feed(read) == [event] * 2000
    assert 0 < _Scanned.scanned <= 2 * len(read)


@pytest.mark.parametrize(
    "event",
    [b"data: a\n\n", b"data: a\r\n\r\n", b"data: a\r\n\n", b"\n\n", b"\r\n\r\n", b"data: a\ndata: b\n\n"],
    ids=["lf", "crlf", "crlf-lf", "blank-lf", "blank-crlf", "two-lines"],
)
def test_an_event_cut_at_every_point_comes_out_whole_with_its_last_byte(event):
    """Cut once anywhere (inside its terminator too), after a complete event in the same read or
    alone, and cut into single bytes: no read returns the event before its last byte arrives, and
    that read returns it whole, the next event's first bytes kept as the tail."""
    for k in range(1, len(event)):
        sp = SSESplitter()
        assert sp.feed(event[:k]) == []
        assert (sp.tail(), sp.pending_bytes) == (event[:k], k)
        assert sp.feed(event[k:] + NEXT[:3]) == [event]
        assert (sp.tail(), sp.pending_bytes) == (NEXT[:3], 3)
        sp = SSESplitter()
        assert sp.feed(NEXT + event[:k]) == [NEXT]
        assert sp.feed(event[k:]) == [event]
        assert (sp.tail(), sp.pending_bytes) == (b"", 0)
    sp = SSESplitter()
    got = [sp.feed(event[k : k + 1]) for k in range(len(event))]
    assert got == [[]] * (len(event) - 1) + [[event]]
    assert (sp.tail(), sp.pending_bytes) == (b"", 0)


def test_an_event_in_one_byte_reads_keeps_only_its_last_3_bytes_to_look_back_at():
    """A terminator straddling reads needs the 3 bytes before the read: the splitter keeps no
    more (joining a longer look-back to every read would cost time quadratic in the event)."""
    sp = SSESplitter()
    event = b"data: " + b"x" * 50 + b"\r\n\r\n"
    for k in range(len(event) - 1):
        assert sp.feed(event[k : k + 1]) == []
        assert sp._last3 == event[max(0, k - 2) : k + 1]
    assert sp.feed(event[-1:]) == [event]
    sp = SSESplitter()
    assert sp.feed(b"data: 0\n\ndata: xyz") == [b"data: 0\n\n"]
    assert sp._last3 == b"xyz"


def test_the_blank_line_that_starts_first_ends_the_event():
    sp = SSESplitter()
    assert sp.feed(b"data: a\r\n\r\n\n\ndata: b\r\n\ndata: c\n") == [b"data: a\r\n\r\n", b"\n\n", b"data: b\r\n\n"]
    assert sp.feed(b"\r\n\r\n") == [b"data: c\n\r\n\r\n"]  # "c" LF, blank CRLF | blank CRLF
    sp = SSESplitter()
    assert sp.feed(b"\n\ndata: a\n\n") == [b"\n\n", b"data: a\n\n"]
    assert sp.feed(b"\r\n\r\ndata: a\r\n\r\n") == [b"\r\n\r\n", b"data: a\r\n\r\n"]
    # the read before ended in the first LF of a blank line; this one holds it and a CRLF one
    sp = SSESplitter()
    assert sp.feed(b"data: a\n\n\n") == [b"data: a\n\n"]
    assert sp.feed(b"\ndata: b\r\n\r\n") == [b"\n\n", b"data: b\r\n\r\n"]
    assert (sp.tail(), sp.pending_bytes) == (b"", 0)
    sp = SSESplitter()
    assert sp.feed(b"data: a\r\n\r") == []
    assert sp.feed(b"\n\n\n") == [b"data: a\r\n\r\n", b"\n\n"]


def test_a_blank_line_made_with_a_bare_cr_does_not_end_an_event_for_the_splitter():
    """WHATWG ends a line at a bare CR too: ``\\r\\r``, ``\\n\\r\\n`` and ``\\r\\n\\r`` hold a blank
    line the splitter does not end an event at; :func:`is_one_event` tells a client reads two."""
    for blank in (b"\r\r", b"\n\r\n", b"\r\n\r"):
        stream = b"data: a" + blank + b"data: b\n\n"
        sp = SSESplitter()
        assert sp.feed(stream) == [stream]
        assert is_one_event(stream) is False
        with pytest.raises(SeveralEvents):
            relayed_fields(stream)


# ---------------------------------------------------------------- the byte order mark


def test_one_bom_is_dropped_at_the_start_of_the_stream_only():
    stream = BOM + b"data: a\n\n"
    for k in range(len(stream) + 1):
        sp = SSESplitter()
        assert sp.feed(stream[:k]) + sp.feed(stream[k:]) == [b"data: a\n\n"], k
        assert (sp.tail(), sp.pending_bytes) == (b"", 0)
    sp = SSESplitter()
    assert (sp.feed(b""), sp.feed(BOM[:1]), sp.feed(b""), sp.feed(BOM[1:2])) == ([], [], [], [])
    assert (sp.tail(), sp.pending_bytes) == (BOM[:2], 2)
    assert sp.feed(BOM[2:]) == []
    assert (sp.tail(), sp.pending_bytes) == (b"", 0)  # the mark is gone, nothing is pending
    assert sp.feed(BOM + b"\n\n") == [BOM + b"\n\n"]  # a second mark is the first line's bytes
    # a mark starting a later read is inside the stream: kept
    sp = SSESplitter()
    assert sp.feed(b"data: a\n\n") == [b"data: a\n\n"]
    assert sp.feed(BOM + b"data: b\n\n") == [BOM + b"data: b\n\n"]
    assert sp.feed(BOM[:1]) == []
    assert sp.feed(BOM[1:] + b"\n\n") == [BOM + b"\n\n"]
    # a start that cannot be a mark is not held
    sp = SSESplitter()
    assert sp.feed(b"\n\n") == [b"\n\n"]
    sp = SSESplitter()
    assert sp.feed(BOM[:2] + b"\n\n") == [BOM[:2] + b"\n\n"]


# ---------------------------------------------------------------- the bound of one event


def test_an_event_completed_in_one_read_is_bounded_at_exactly_the_limit():
    ev = b"data: 0\n\n"  # 9 bytes
    assert SSESplitter(9).feed(ev + ev) == [ev, ev]
    with pytest.raises(SSEEventTooLarge) as ei:
        SSESplitter(8).feed(ev)
    assert (ei.value.size, ei.value.limit, ei.value.before) == (9, 8, [])
    sp = SSESplitter(9)
    with pytest.raises(SSEEventTooLarge) as ei:
        sp.feed(ev + b"data: 10\n\n" + ev)
    assert (ei.value.size, ei.value.limit, ei.value.before) == (10, 9, [ev])
    assert (sp.tail(), sp.pending_bytes) == (b"", 0)


def test_an_unfinished_tail_is_bounded_at_exactly_the_limit():
    sp = SSESplitter(10)
    assert sp.feed(b"data: 0\n\n" + b"x" * 10) == [b"data: 0\n\n"]
    assert (sp.tail(), sp.pending_bytes) == (b"x" * 10, 10)
    sp = SSESplitter(10)
    with pytest.raises(SSEEventTooLarge) as ei:
        sp.feed(b"data: 0\n\n" + b"x" * 11)
    assert (ei.value.size, ei.value.limit, ei.value.before) == (11, 10, [b"data: 0\n\n"])
    assert (sp.tail(), sp.pending_bytes) == (b"", 0)
    # grown over several reads
    sp = SSESplitter(10)
    assert (sp.feed(b"data: "), sp.feed(b"1234")) == ([], [])
    assert sp.pending_bytes == 10
    with pytest.raises(SSEEventTooLarge) as ei:
        sp.feed(b"5")
    assert (ei.value.size, ei.value.limit, ei.value.before) == (11, 10, [])
    assert (sp.tail(), sp.pending_bytes) == (b"", 0)


def test_an_event_completed_across_reads_is_bounded_at_exactly_the_limit():
    sp = SSESplitter(12)
    assert sp.feed(b"data: 1234") == []
    assert sp.feed(b"\n\n") == [b"data: 1234\n\n"]  # 12 bytes
    assert (sp.tail(), sp.pending_bytes) == (b"", 0)
    assert sp.feed(b"data: 5") == []
    assert sp.pending_bytes == 7
    sp = SSESplitter(11)
    assert sp.feed(b"data: 1234") == []
    with pytest.raises(SSEEventTooLarge) as ei:
        sp.feed(b"\n\ndata: 0\n\n")
    assert (ei.value.size, ei.value.limit, ei.value.before) == (12, 11, [])
    assert (sp.tail(), sp.pending_bytes) == (b"", 0)
    # the event completed first is handed over with the error of the next one
    sp = SSESplitter(9)
    assert sp.feed(b"data: 1") == []
    with pytest.raises(SSEEventTooLarge) as ei:
        sp.feed(b"\n\ndata: 10\n\n")
    assert (ei.value.size, ei.value.limit, ei.value.before) == (10, 9, [b"data: 1\n\n"])


def test_the_default_bound_is_the_settings_default():
    assert DEFAULT_MAX_EVENT_BYTES == 1 << 20 == GatewaySettings.model_fields["max_sse_event_bytes"].default


# ---------------------------------------------------------------- reading an event's lines


@pytest.mark.parametrize(
    ("event", "data"),
    [
        (b"data: a\n\n", b"a"),
        (b"data: x\n\n", b"x"),
        (b"data:a\n\n", b"a"),
        (b"id: 1\ndata:a\n\n", b"a"),
        (b"data: a\nb\n\n", b"a"),  # "b" is a field of its own
        (b"data:  a\n\n", b" a"),  # one space dropped
        (b"data: a\ndata: b\n\n", b"a\nb"),
        (b"data: a\rx\ndata: b\n\n", b"a\nb"),  # "x" is a field of its own
        (b"event: t\ndata: x\n\n", b"x"),
        (b"event: t\ndata:  x\n\n", b" x"),
        (b"event: t\ndata:x\n\n", b"x"),
        (b"event: t\ndata: a\ndata: b\n\n", b"a\nb"),
        (b"event: t\ndata: a\rdata: b\n\n", b"a\nb"),
        (b"event: t\rdata: a\ndata: b\n\n", b"a\nb"),
        (b"event: t\ndata: a\nid: 1\n\n", b"a"),
        (b"id: 1\ndata: a\n\n", b"a"),
        (b"data: a\r\n\r\n", b"a"),
        (b": c\n\n", None),
        (b"event: t\n\n", None),
        (b"event: t\nid: 1\n\n", None),
        (b"event: t\nretry: 1000\n\n", None),
        (b"event: t\nxdata: a\n\n", None),  # the field "xdata"
        (b"event: t\ndatafoo: x\n\n", None),
        (b"id: 1\ndatafoo: x\n\n", None),
    ],
)
def test_data_of_joins_the_data_lines_as_a_client_reads_them(event, data):
    assert data_of(event) == data


@pytest.mark.parametrize(
    ("event", "one"),
    [
        (b"data: x\n\n", True),
        (b"\r\n\r\n", True),
        (b"\r\rdata: x\n\n", True),  # blank lines before any content dispatch nothing
        (b"data: x\r\r\n\n", True),
        (b"\rdata: a\r\rdata: b\n\n", False),
        (b"data: a\r\n\rdata: b\r\n\r\n", False),
        (b"data: a\n\r\ndata: c\n\n", False),
    ],
)
def test_is_one_event_and_relayed_fields_agree_with_a_client(event, one):
    assert is_one_event(event) is one
    if one:
        assert relayed_fields(event)[0] == event
    else:
        with pytest.raises(SeveralEvents):
            relayed_fields(event)


@pytest.mark.parametrize(
    ("event", "relayed", "names"),
    [
        (b": keep-alive\n\n", b": keep-alive\n\n", ()),
        (b": keep-alive\r\n\r\n", b": keep-alive\r\n\r\n", ()),
        (b": keep-alive\ndata: x\n\n", b": keep-alive\ndata: x\n\n", ()),
        (b": keep-alivex\n\n", b":\n\n", ()),
        (b":\n\n", b":\n\n", ()),
        (b":x\n\n", b":\n\n", ()),
        (b"data\n\n", b"data\n\n", ()),
        (b"datafoo: x\n\n", b":\n\n", ()),  # the field "datafoo"
        (b"event\n\n", b"event\n\n", (b"",)),
        (b"event: t\nid: 1\n\n", b"event: t\n:\n\n", (b"t",)),
        (b"event: t\ndata: a\nid: 1\n\n", b"event: t\ndata: a\n:\n\n", (b"t",)),
        (b"event: t\ndatafoo: x\n\n", b"event: t\n:\n\n", (b"t",)),
        (b"event: t\nxdata: a\n\n", b"event: t\n:\n\n", (b"t",)),
        (b"eventfoo\ndata: x\n\n", b":\ndata: x\n\n", ()),  # the field "eventfoo"
        (b"eventfoo: x\n\n", b":\n\n", ()),
        (b"event:t\ndata: x\n\n", b"event:t\ndata: x\n\n", (b"t",)),
        (b"event: t\ndata: x\n\n", b"event: t\ndata: x\n\n", (b"t",)),
        (b"event:t\r\ndata: x\r\n\r\n", b"event:t\r\ndata: x\r\n\r\n", (b"t",)),
        (b"id: 1\r\ndata: x\r: c\n\n", b":\r\ndata: x\r:\n\n", ()),
    ],
)
def test_relayed_fields_keeps_data_event_and_keep_alive_lines_only(event, relayed, names):
    assert relayed_fields(event) == (relayed, names)


# ---------------------------------------------------------------- what an event carries


def test_inspect_reads_each_kind_of_data():
    assert inspect(b"data: hello\n\n").kind == "not_json"
    assert inspect(b'data: {"a":1} x\n\n').kind == "not_json"
    assert inspect(b"data: NaN\n\n").kind == "lenient"
    assert inspect(b'data: {"a": "\\ud800"}\n\n').kind == "lenient"
    assert inspect(b"data:  \n\n").kind == "other"
    assert inspect(b": c\n\n").kind == "other"
    assert inspect(b"data: [DONE]\n\n").kind == "done"
    assert inspect(b"data: [1]\n\n").kind == "other"
    assert inspect(b'data: {"a":1}\n\n').kind == "chunk"


def test_inspect_asks_odd_about_objects_only_and_takes_its_kind():
    asked: list[object] = []

    def odd(obj):
        asked.append(obj)
        return "odd" if "x" in obj else None

    assert inspect(b'data: {"x":1}\n\n', odd).kind == "odd"
    assert inspect(b'data: {"a":1}\n\n', odd).kind == "chunk"
    assert inspect(b'data: ["x"]\n\n', odd).kind == "other"
    assert asked == [{"x": 1}, {"a": 1}]


def test_strip_usage_null_removes_the_member_wherever_it_stands():
    assert strip_usage_null(b'data: {"usage":null}\n\n') == b"data: {}\n\n"
    assert strip_usage_null(b'data: {"a":1, "usage" : null}\n\n') == b'data: {"a":1}\n\n'
    assert strip_usage_null(b'data: {"usage": null, "a":1}\n\n') == b'data: { "a":1}\n\n'
    assert strip_usage_null(b'data: {"usage":{"total_tokens":1}}\n\n') == b'data: {"usage":{"total_tokens":1}}\n\n'
    # one member: the first (any other byte is left as it was)
    assert strip_usage_null(b'data: {"usage":null,"x":{"usage":null}}\n\n') == b'data: {"x":{"usage":null}}\n\n'
