"""The string values of a JSON text, decoded as it arrives in pieces (a tool call's streamed
``arguments``), leniently: what a client's JSON parser shows of another tenant's text that an
engine wrote JSON-escaped (``\\n`` for a line break, ``\\uXXXX`` for non-ASCII), which shares no
shingle with the escaped string across each escape.

:class:`JsonStrings` never raises and never validates: text outside strings that is not JSON
structure is skipped, a text cut off inside a string gives what it holds so far (an answer cut at
``max_tokens``), a bad escape is kept as written, a lone surrogate is U+FFFD. Keys are left out;
each value ends with a line break (as :func:`verifier.findings.unescaped_values` lists them and
the prompt side joins them, ``tokenizer.prompt_text``). State is a few fields and a stack of at
most :data:`MAX_DEPTH` containers; nothing of the text is kept but an unfinished escape.
"""

from __future__ import annotations

import re

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
