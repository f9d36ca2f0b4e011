"""The string values of a JSON text, decoded the one way both sides of the verifier decode a tool
call's ``arguments``: the prompt side indexes them (:mod:`tokenizer.prompt_text`), the response side
checks them (``verifier.findings``, and a strict stream's decoded twin in ``verifier.guards``).
Another tenant's text that an engine wrote JSON-escaped (``\\n``
for a line break, ``\\uXXXX`` for non-ASCII) shares no shingle with the escaped string across each
escape, so both sides must decode alike or a leak's shingles never meet the index's.

:func:`unescaped_values` parses a whole text (strictly, then leniently, up to
:data:`UNESCAPE_LEVELS` levels of a document escaped inside a value). :class:`JsonStrings` is its
lenient part, incremental: it never raises and never validates: text outside strings that is not
JSON structure is skipped, a text cut off inside a string gives what it holds so far (an answer cut
at ``max_tokens``), a bad escape is kept as written, a lone surrogate is U+FFFD. Keys are left out;
each value ends with a line break (as :func:`unescaped_values` lists them and the prompt side joins
them). State is a few fields and a stack of at most :data:`MAX_DEPTH` containers; nothing of the
text is kept but an unfinished escape. :func:`string_values` walks a parsed value's strings, for
both sides too: the prompt side's values, and the verifier's reading of an engine's answer (values
and the key names that are not identifiers).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import orjson

#: the one-character escapes of JSON
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
#: a run of a string's characters without a quote or backslash
_RUN = re.compile(r'[^"\\]+')
#: JSON structure outside strings
_STRUCTURE = re.compile(r'[{}\[\]:,"]')
#: containers deeper than this are not told apart (a string there counts as a value)
MAX_DEPTH = 1024


class JsonStrings:
    """Incremental, lenient JSON string-value decoder (module doc): :meth:`push` a piece, get the
    decoded text of the values it completes or continues."""

    __slots__ = ("_esc", "_high", "_in", "_is_key", "_key_next", "_stack")

    def __init__(self) -> None:
        self._stack: list[str] = []  # "{" or "[" of the open containers (up to MAX_DEPTH)
        self._key_next = False  # a string starting now is an object's key
        self._in = False  # inside a string
        self._is_key = False  # the string being read is a key
        self._esc = ""  # an escape not yet complete: "\\", "\\u00"
        self._high = ""  # a decoded high surrogate waiting for its low half

    def push(self, piece: str) -> str:
        """Add ``piece``; returns the decoded value text it adds (maybe ``""``)."""
        out: list[str] = []
        i, n = 0, len(piece)
        while i < n:
            if not self._in:
                m = _STRUCTURE.search(piece, i)
                if m is None:
                    break
                i = m.end()
                self._structure(m.group())
            elif self._esc:
                need = 6 if self._esc[1:2] == "u" else 2
                take = need - len(self._esc) if len(self._esc) > 1 else 1
                self._esc += piece[i : i + take]
                i += take
                if len(self._esc) >= 2 and (self._esc[1] != "u" or len(self._esc) >= 6):
                    self._escape(out)
            else:
                m = _RUN.match(piece, i)
                if m is not None:
                    self._emit(out, m.group())
                    i = m.end()
                    continue
                c = piece[i]
                i += 1
                if c == "\\":
                    self._esc = c
                else:  # the closing quote
                    self._emit(out, "")
                    if not self._is_key:
                        out.append("\n")
                    self._in = False
        return "".join(out)

    def _structure(self, c: str) -> None:
        stack = self._stack
        if c == '"':
            self._in, self._is_key = True, self._key_next
        elif c in "{[":
            if len(stack) < MAX_DEPTH:
                stack.append(c)
            self._key_next = c == "{"
        elif c in "}]":
            if stack:
                stack.pop()
            self._key_next = False
        elif c == ":":
            self._key_next = False
        else:  # ","
            self._key_next = bool(stack) and stack[-1] == "{"

    def _emit(self, out: list[str], text: str) -> None:
        """A decoded character run (``""``: the string ends) after any waiting high surrogate."""
        if self._high:
            self._high = ""
            if not self._is_key:
                out.append("\ufffd")
        if text and not self._is_key:
            out.append(text)

    def _escape(self, out: list[str]) -> None:
        esc, self._esc = self._esc, ""
        if esc[1] != "u":
            self._emit(out, _ESCAPES.get(esc[1], esc))
            return
        cp = int(esc[2:], 16) if all(ch in "0123456789abcdefABCDEF" for ch in esc[2:]) else -1
        if cp < 0:
            self._emit(out, esc)
        elif 0xDC00 <= cp <= 0xDFFF and self._high:
            high, self._high = self._high, ""
            if not self._is_key:
                out.append(chr(0x10000 + ((ord(high) - 0xD800) << 10) + (cp - 0xDC00)))
        elif 0xD800 <= cp <= 0xDBFF:
            self._emit(out, "")
            self._high = chr(cp)
        else:
            self._emit(out, "\ufffd" if 0xDC00 <= cp <= 0xDFFF else chr(cp))


def json_strings(text: str) -> str:
    """:class:`JsonStrings` of a whole ``text``."""
    return JsonStrings().push(text)


def string_values(
    obj: Any,
    out: list[str],
    skip: frozenset[str] = frozenset(),
    keys: Callable[[str], bool] | None = None,
) -> None:
    """Append every non-empty string inside ``obj`` (dicts, lists, strings; numbers, bools and
    ``None`` hold none), in document order. Keys are left out, and the values of keys in ``skip``
    at any depth; with ``keys``, a key name for which ``keys(name)`` is true is appended too, just
    before its value (the verifier's key names that are not identifiers: an engine can put text in
    a key). Iterative, so any nesting depth (orjson reads up to 1,024 levels; a value built in
    Python, deeper) is read whole and cannot overflow the stack."""
    stack = [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, str):
            if x:
                out.append(x)
        elif isinstance(x, dict):
            if keys is None:
                stack.extend(reversed([v for k, v in x.items() if k not in skip]))
                continue
            items: list[Any] = []
            for k, v in x.items():
                if k in skip:
                    continue
                if keys(k):
                    items.append(k)
                items.append(v)
            stack.extend(reversed(items))
        elif isinstance(x, list):
            stack.extend(reversed(x))


#: how many times over :func:`unescaped_values` decodes a JSON text escaped inside another
UNESCAPE_LEVELS = 3


def unescaped_values(text: str, _level: int = 1) -> list[str]:
    """The string values of ``text`` when it is JSON (an object, an array or a string literal)
    holding an escape (a tool call's ``arguments``: a line break as ``\\n``, ``é`` as ``\\u00e9``),
    else ``[]``: what a client's JSON parser shows, and what a model quoting them writes (a file's
    lines). A text that is not valid JSON (arguments cut off at ``max_tokens``) is decoded
    leniently (:func:`json_strings`: what it holds so far), and a value that is itself escaped
    JSON (a document inside a string) is decoded again, up to :data:`UNESCAPE_LEVELS` levels: each
    level's values are at most its text, so at worst the text three times more."""
    if "\\" not in text or text.lstrip()[:1] not in ("{", "[", '"'):
        return []
    out: list[str] = []
    try:
        string_values(orjson.loads(text), out)
    except orjson.JSONDecodeError:
        decoded = json_strings(text)
        out = [decoded] if decoded else []
    if _level < UNESCAPE_LEVELS:
        out += [v for x in out for v in unescaped_values(x, _level + 1)]
    return out
