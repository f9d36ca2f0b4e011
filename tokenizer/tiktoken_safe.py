"""tiktoken's ``encode_ordinary`` without its panic (docs/tokenizer.md, "Tokenizer faults").

tiktoken's Rust regex gives up on a run of 999,999 or more whitespace characters (no line break)
followed by another character: ``encode_ordinary(" " * 999_999 + "x")`` raises
``pyo3_runtime.PanicException`` (a ``BaseException``); 999,998 encode (tiktoken 0.14, measured in
the main thread and in worker threads alike; a run at the very end of the text, or of line
breaks, does not panic). :func:`encode_ordinary` finds runs of :data:`LONG_WHITESPACE_CHARS` or
more and encodes the stretch of text around each one itself: the same regex (the ``regex``
module, which backtracks without recursion) cuts it into pre-tokens, and each pre-token goes
through tiktoken's own BPE (``_encode_single_piece``), exactly as ``encode_ordinary`` does with
every match. The stretch starts and ends at cuts :mod:`tokenizer.parallel` proves safe, so the
ids are those of the unsplit text (``tests/test_tokenizer_guard.py`` checks the equality on runs
below the panic size).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import regex  # type: ignore[import-untyped]  # a tiktoken dependency; no stubs installed
import tiktoken

from tokenizer.parallel import SAFE_CUT

#: whitespace runs at least this long (characters) are encoded here, far below the panic's 999,999
LONG_WHITESPACE_CHARS = 65_536
#: the shortest run (characters) measured to panic tiktoken 0.14 when another character follows
PANIC_WHITESPACE_CHARS = 999_999


@lru_cache(maxsize=8)
def _pattern(pat_str: str) -> Any:
    return regex.compile(pat_str)


@lru_cache(maxsize=8)
def _long_run(chars: int) -> Any:
    """Runs of at least ``chars`` whitespace characters (``\\s``: Unicode White_Space, as the
    encoding's regex reads it)."""
    return regex.compile(r"\s{" + str(chars) + ",}")


def _pieces(encoding: tiktoken.Encoding, text: str) -> list[int]:
    """``encoding.encode_ordinary(text)`` computed match by match (no Rust regex involved)."""
    ids: list[int] = []
    for m in _pattern(encoding._pat_str).finditer(text):
        ids += encoding._encode_single_piece(m.group().encode("utf-8"))
    return ids


def _stretch(text: str, start: int, end: int, floor: int) -> tuple[int, int]:
    """The safe cuts around ``text[start:end]``: the last at or before ``start`` (not before
    ``floor``; else ``floor``) and the first at or after ``end`` (else the text's end)."""
    a = floor
    for m in SAFE_CUT.finditer(text, floor, start + 1):
        a = m.start()
    after = SAFE_CUT.search(text, end)
    return a, after.start() if after is not None else len(text)


def encode_ordinary(encoding: tiktoken.Encoding, text: str, long_run: int = LONG_WHITESPACE_CHARS) -> list[int]:
    """``encoding.encode_ordinary(text)``, the same ids, for a cl100k-family ``encoding``
    (:mod:`tokenizer.parallel`'s cut rules assume its regex); whitespace runs of ``long_run``
    characters or more never reach tiktoken's regex (tests lower ``long_run``)."""
    runs = _long_run(long_run)
    if len(text) < long_run or runs.search(text) is None:
        return encoding.encode_ordinary(text)
    ids: list[int] = []
    pos = 0
    for m in runs.finditer(text):
        if m.start() < pos:
            continue
        a, b = _stretch(text, m.start(), m.end(), pos)
        ids += encoding.encode_ordinary(text[pos:a])
        ids += _pieces(encoding, text[a:b])
        pos = b
    ids += encoding.encode_ordinary(text[pos:])
    return ids
