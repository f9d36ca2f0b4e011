"""How many JSON values a request body holds, found before it is parsed.

orjson builds one Python object per value and holds the GIL while it parses, so a worker thread
does not keep it off the event loop: ``[""] * 2_000_000`` (6 MB) holds the loop for about 100 ms
whatever thread parses it. Text is cheap to parse (a string is one copy), values are not. So a
body holding more values than ``gateway.max_body_values`` is refused (413) before it is parsed:
:func:`values_over` counts the commas outside strings (one per value after the first in each
array or object), in slices of :data:`SLICE_BYTES`, each C-level step short enough that the
event loop's thread gets the GIL between them when this runs in a worker thread.

Token ids are the exception: a long-context model's prompt may hold a million of them, and no
fixed value limit both admits that and bounds the parse. So an array of at least
:data:`MIN_ID_ARRAY` integers (outside strings) is cut out of the body before it is parsed
(:func:`split_ids`), is not counted as values, and is parsed in slices of
:data:`ID_SLICE_BYTES` (:func:`parse_ids`), each one short orjson call, so the event loop's
thread gets the GIL between them. Measured on the team machine (orjson 3.13, one
``orjson.loads``, best of 5): 1M token ids of 6-7 digits 145 ms, 300k 33 ms, 131k 11 ms, 1M
empty strings 56 ms, 1M ``"a"`` 227 ms, 1M ``[]`` 1,040 ms, 500k small messages (1M values)
1,220 ms; one slice of 64 KiB of ids (about 10,000) 0.3 ms.
"""

from __future__ import annotations

import re
import secrets

import numpy as np
import orjson

#: bytes scanned per C-level step
SLICE_BYTES = 256 * 1024


def _count(raw: bytes, byte: int, start: int = 0, stop: int | None = None) -> int:
    """How many times ``byte`` occurs in ``raw[start:stop]``, counted :data:`SLICE_BYTES` at a time
    as numpy vectors (no copy; about 8 us per 64 KiB, where ``bytes.count`` of one byte takes
    about 40; numpy's comparison releases the GIL)."""
    a = np.frombuffer(raw, dtype=np.uint8)[start:stop]
    return sum(int(np.count_nonzero(a[i : i + SLICE_BYTES] == byte)) for i in range(0, len(a), SLICE_BYTES))


def _commas(raw: bytes) -> int:
    """Every comma of ``raw``, strings included (:func:`_count`)."""
    return _count(raw, 0x2C)


def _escape_safe_slices(raw: bytes):
    """``raw`` in steps of about :data:`SLICE_BYTES` that never split an escape (a step ends
    after a byte that is not a backslash), each with its escaped backslashes and escaped quotes
    blanked (same length), so that every ``"`` left is a string boundary."""
    i, n = 0, len(raw)
    while i < n:
        j = min(n, i + SLICE_BYTES)
        while j < n and raw[j - 1] == 0x5C:
            j += 1
        part = raw[i:j]
        yield part.replace(b"\\\\", b"\0\0").replace(b'\\"', b"\0\0") if b"\\" in part else part
        i = j


def values_over(raw: bytes, limit: int) -> int | None:
    """The number of commas outside JSON strings in ``raw`` (a lower bound of its values minus
    one per container) when it is above ``limit``, else ``None``. Counted slice by slice (a
    slice's quotes and commas as a numpy array: the parity of the quotes before each comma says
    whether it is inside a string, carried from slice to slice) and returned at the first slice
    that takes the count above ``limit``: a lower bound of the whole count, so a 2M-element list
    is refused after a few slices. Exact for valid JSON below the limit; for invalid JSON any
    answer is fine (the parser refuses it anyway). Cost: a sliced count of the commas (a body
    with at most ``limit`` of them, strings included, returns at once), then a few vector passes
    per slice, each a bounded C call."""
    if _commas(raw) <= limit:
        return None  # not even counting commas inside strings is it over
    outside = 0
    inside = 0  # 1 when the slice starts inside a string
    for part in _escape_safe_slices(raw):
        a = np.frombuffer(part, dtype=np.uint8)
        quotes = a == 0x22
        parity = np.cumsum(quotes, dtype=np.int32)  # quotes up to each byte (a comma is none)
        parity &= 1
        outside += int(np.count_nonzero((a == 0x2C) & (parity == inside)))
        inside ^= int(parity[-1])
        if outside > limit:  # enough to refuse: the rest would only raise the count
            return outside
    return None


class StringDensity:
    """A lower bound of a body's values, from its strings, kept while the body arrives (the event
    loop's share of :func:`values_over`: a dense body is refused before the rest is read or
    parsed). Every JSON string (key or value) sits in an object or array, and a container with
    ``m`` members holds at most ``2 m`` strings and ``m - 1`` commas, so a body of ``S`` strings
    and ``C`` containers has at least ``(S - 1) / 2 - C`` commas outside strings: what
    :func:`values_over` counts. ``S`` is bounded below by the quotes, less the ``\\"`` pairs and
    one per read (an escape cut between two reads), halved; ``C`` above by every ``[`` and ``{``.
    Token-id arrays hold no strings, so they never count. :meth:`feed` returns the bound once it
    is above ``limit``, else ``None``.

    Cost, on the event loop (numpy vector counts; ``bytes.count`` of one byte is a plain loop, 4-5
    times slower): one count of the quotes per read (about 8 us per 64 KiB) while the quotes
    alone (no escape, no container) could not take the bound above ``limit`` (a body of text, or
    of token ids); at the first read that could, the escapes and brackets of every read so far
    (kept by reference, not copied), and from then on of each read (about 32 us per 64 KiB).
    Measured on the team machine: four ``bytes.count`` per read were about 160 us per 64 KiB,
    40% of the event loop's busy time under ``bench/hostile.py``'s attack."""

    __slots__ = ("_held", "brackets", "escaped", "limit", "quotes", "reads")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.quotes = self.escaped = self.brackets = self.reads = 0
        self._held: list[bytes] | None = []  # reads not yet counted in full (None: all are)

    def _count_rest(self, chunk: bytes) -> None:
        a = np.frombuffer(chunk, dtype=np.uint8)
        self.escaped += int(np.count_nonzero((a[1:] == 0x22) & (a[:-1] == 0x5C)))
        self.brackets += int(np.count_nonzero((a == 0x5B) | (a == 0x7B)))

    def feed(self, chunk: bytes) -> int | None:
        """Count one read of the body; the lower bound when it is above ``limit``."""
        self.quotes += int(np.count_nonzero(np.frombuffer(chunk, dtype=np.uint8) == 0x22))
        self.reads += 1
        strings_most = (self.quotes - (self.reads - 1)) // 2
        held = self._held
        if held is not None:
            if (strings_most - 1) // 2 <= self.limit:  # not over even with no escape and no container
                held.append(chunk)
                return None
            self._held = None
            for c in held:
                self._count_rest(c)
        self._count_rest(chunk)
        strings = (self.quotes - self.escaped - (self.reads - 1)) // 2
        over = (strings - 1) // 2 - self.brackets
        return over if over > self.limit else None


#: an array of at least this many integers is a token-id array: cut out before the body is parsed
#: (:func:`split_ids`), parsed in slices (:func:`parse_ids`), and not counted as values
MIN_ID_ARRAY = 1024
#: bytes of token ids parsed per orjson call (about 10,000 ids of 6-7 digits: 0.3 ms measured)
ID_SLICE_BYTES = 64 * 1024
#: how far past its window a token-id array's first MIN_ID_ARRAY ids may reach and still be found
_MARGIN = 64 * 1024
_WS = rb"[ \t\r\n]*"
#: ``[`` then MIN_ID_ARRAY integers: the start of a token-id array
_ID_START = re.compile(rb"\[" + _WS + rb"-?[0-9]+(?:" + _WS + rb"," + _WS + rb"-?[0-9]+){%d}" % (MIN_ID_ARRAY - 1))


class BadIds(ValueError):
    """A cut-out token-id array is not valid JSON (``str``: orjson's message, or what is wrong)."""


def _unescaped(raw: bytes) -> bytes:
    """``raw`` with every escaped backslash and escaped quote blanked (same length), so that each
    ``"`` left is a string boundary (:func:`_escape_safe_slices`, joined)."""
    if b"\\" not in raw:
        return raw
    return b"".join(_escape_safe_slices(raw))


#: what may follow inside a token-id array, up to its ``]``: digits, ``,``, ``-``, JSON whitespace
_ID_BYTES = b"0123456789,- \t\r\n"


def _id_array_end(clean: bytes, pos: int) -> int | None:
    """The index of the ``]`` that ends the token-id array whose ids continue at ``pos``, or
    ``None`` when something other than ids, commas and whitespace comes first (then the array is
    not a token-id array and is parsed as usual). Scans in windows of :data:`SLICE_BYTES`: each
    window with the id bytes deleted (``bytes.translate``, about 0.15 ms per 256 KiB; a regex
    character class took 0.6 ms, holding the GIL the event loop's thread waits for); the first
    byte left is the first that is not an id byte, and its first occurrence in the window is
    where it stands."""
    n = len(clean)
    while pos < n:
        stop = min(n, pos + SLICE_BYTES)
        other = clean[pos:stop].translate(None, _ID_BYTES)
        if other:
            pos = clean.find(other[:1], pos, stop)
            break
        pos = stop
    return pos if clean[pos : pos + 1] == b"]" else None


def split_ids(raw: bytes) -> tuple[bytes, dict[int, bytes]]:
    """Cut every token-id array (``[`` then at least :data:`MIN_ID_ARRAY` integers and nothing
    else up to its ``]``, outside JSON strings) out of the JSON body ``raw``. Returns the body
    with each replaced by a marker integer, and ``{marker: the bytes between its brackets}``
    (empty, and ``raw`` itself, when there is none). The markers share a random 14-digit prefix
    that does not occur in ``raw``, so no integer a client wrote is taken for one.

    Exact for valid JSON; for invalid JSON the parse of what is left, or :func:`parse_ids`,
    refuses it. Cost: regex searches and counts over windows of :data:`SLICE_BYTES` (each a
    bounded C call) and byte copies; no Python object per id."""
    if len(raw) < 2 * MIN_ID_ARRAY:
        return raw, {}
    clean = _unescaped(raw)
    n = len(clean)
    spans: list[tuple[int, int]] = []
    pos = 0
    odd = 0  # parity of the quotes before pos: 1 = pos is inside a string
    while pos < n:
        wend = min(n, pos + SLICE_BYTES)
        m = _ID_START.search(clean, pos, min(n, wend + _MARGIN))
        if m is None or m.start() >= wend:
            odd ^= _count(clean, 0x22, pos, wend) & 1
            pos = wend
            continue
        odd ^= _count(clean, 0x22, pos, m.start()) & 1
        end = None if odd else _id_array_end(clean, m.end())
        if end is None:  # inside a string, or not only ids: look again one byte on
            pos = m.start() + 1
            continue
        spans.append((m.start(), end))
        pos = end + 1  # no quote inside the array: the parity is unchanged
    if not spans:
        return raw, {}
    while True:
        base = (10**13 + secrets.randbelow(8 * 10**13)) * 10**5
        if b"%d" % (base // 10**5) not in raw:
            break
    pieces: list[bytes] = []
    arrays: dict[int, bytes] = {}
    prev = 0
    for k, (start, end) in enumerate(spans):
        marker = base + k
        pieces += (raw[prev:start], b"%d" % marker)
        arrays[marker] = raw[start + 1 : end]
        prev = end + 1
    pieces.append(raw[prev:])
    return b"".join(pieces), arrays


def count_ids(content: bytes) -> int:
    """How many ids one token-id array's ``content`` (from :func:`split_ids`) holds: its commas
    plus one, counted in :data:`SLICE_BYTES` steps (each a short C call). Exact for a valid
    array; :func:`parse_ids` refuses an invalid one."""
    return 1 + _commas(content)


def parse_ids(content: bytes) -> list[int]:
    """The integers of one token-id array's ``content`` (the bytes between its brackets), parsed
    in slices of about :data:`ID_SLICE_BYTES` cut at commas, one ``orjson.loads`` each, so that
    no single call holds the GIL for long. Raises :class:`BadIds` for what ``orjson.loads`` of
    the whole array would refuse (a missing or doubled comma, a leading zero, an integer beyond
    64 bits, ...)."""
    out: list[int] = []
    i, n = 0, len(content)
    while True:
        j = content.find(b",", i + ID_SLICE_BYTES) if i + ID_SLICE_BYTES < n else -1
        piece = content[i : n if j < 0 else j]
        try:
            vals = orjson.loads(b"[" + piece + b"]")
        except orjson.JSONDecodeError as e:
            raise BadIds(str(e)) from None
        if not vals:
            raise BadIds("a comma without a value in a token-id array")
        out += vals
        if j < 0:
            return out
        i = j + 1


def restore_ids(body: dict, arrays: dict[int, bytes]) -> None:
    """Put each token-id array of ``arrays`` (from :func:`split_ids`), parsed by
    :func:`parse_ids`, back in place of its marker in the parsed ``body`` (in place). Walks the
    parsed skeleton, which holds at most ``gateway.max_body_values`` values. Raises
    :class:`BadIds` (see :func:`parse_ids`)."""
    left = dict(arrays)
    stack: list = [body]
    while stack and left:
        node = stack.pop()
        for key, value in node.items() if isinstance(node, dict) else enumerate(node):
            if type(value) is int and value in left:
                node[key] = parse_ids(left.pop(value))
            elif isinstance(value, (dict, list)):
                stack.append(value)
