"""Exact token counting split across threads at pre-token boundaries.

tiktoken's BPE runs only inside one pre-token (a match of the encoding's regex) and its Rust core
releases the GIL while it encodes. A text cut where the regex would cut anyway therefore counts
the same in pieces, and the pieces can be encoded on several cores at once.

The cl100k_base regex (tiktoken, ``cl100k_base``)::

    '(?i:[sdmt]|ll|ve|re) | [^\\r\\n\\p{L}\\p{N}]?+\\p{L}++ | \\p{N}{1,3}+ | ?[^\\s\\p{L}\\p{N}]++[\\r\\n]*+
    | \\s++$ | \\s*[\\r\\n] | \\s+(?!\\S) | \\s

Safe cuts. A cut at ``i`` is safe when the match holding ``text[i-1]`` ends exactly at ``i``: the
regex then starts its next match at ``i``, and since it has no look-behind and its ``$`` and
``(?!\\S)`` only look at characters after a match, matching a piece ``text[i:j]`` gives the same
pre-tokens as matching the whole text (the last match of the piece holds ``text[j-1]``, which again
ends at ``j``, and no alternative scans past a letter, digit or punctuation mark it does not take).
Two rules give such cuts:

1. ``text[i] == " "`` and ``text[i-1]`` is not whitespace. The match holding ``text[i-1]`` is a
   contraction or letter run (ends before a non-letter), a 1-3 digit run (ends before a non-digit),
   or a punctuation run ``[^\\s\\p{L}\\p{N}]++[\\r\\n]*+`` (stops at the space). Whitespace is
   taken in both senses (Python's ``str.isspace`` and Unicode ``White_Space``, which the regex's
   ``\\s`` uses), so a disagreement between the two can only forbid a cut, never allow a bad one.
2. ``text[i]`` is a punctuation mark from :data:`CUT_PUNCTUATION` (ASCII and CJK marks that are
   neither letters, digits nor whitespace in any Unicode version) and ``text[i-1]`` is a letter or
   digit: its letter or digit run stops at the mark. Rule 2 lets text without spaces (Chinese,
   Japanese) be split too.

``tests/test_tokenizer_parallel.py`` checks the equality on the seed texts and on random text
(hypothesis) that mixes letters, digits, punctuation, whitespace, apostrophes and CJK.
"""

from __future__ import annotations

import itertools
import os
import re
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

#: Texts shorter than this (characters) are counted on the calling thread.
PARALLEL_MIN_CHARS = 200_000
#: Long texts are cut into pieces of about this many characters: many pieces balance the threads'
#: load, and counting them one after another costs the same CPU as one whole encode (measured by
#: bench/tokenize.py's "1 thread" and CPU columns).
PIECE_CHARS = 128 * 1024

#: Punctuation after which (rule 2) a letter or digit run certainly ends: ASCII and CJK marks.
CUT_PUNCTUATION = ',.;:!?()[]{}"，。、；：！？（）「」『』《》【】'
#: Unicode White_Space (the regex's ``\\s``) beyond what ``str.isspace`` already covers in Python's
#: ``re``; listed so that the look-behind below rejects them whatever the Unicode tables say.
_WHITE_SPACE = "\t\n\x0b\x0c\r \x1c\x1d\x1e\x1f\x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
SAFE_CUT = re.compile(
    rf"(?<![\s{_WHITE_SPACE}]) "  # rule 1: a space after a non-space (a look-behind at i-1)
    rf"|(?<=[^\W_])[{re.escape(CUT_PUNCTUATION)}]"  # rule 2: a mark after a letter or digit
)

_SAFE_CUT = SAFE_CUT  # the name tests/test_tokenizer_parallel.py reads

_POOL: ThreadPoolExecutor | None = None


def _forget_pool() -> None:
    """After ``fork`` the parent's worker threads do not exist in the child: start afresh."""
    global _POOL
    _POOL = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def usable_cores() -> int:
    """CPU cores this process may run on (``sched_getaffinity`` where the OS has it)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def _pool() -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=max(2, usable_cores()), thread_name_prefix="kvgate-count")
    return _POOL


def safe_cuts(text: str, pieces: int) -> list[int]:
    """Up to ``pieces - 1`` increasing cut positions near equal spacing, each a safe pre-token
    boundary (see the module docstring). Positions are character offsets in ``(0, len(text))``."""
    n = len(text)
    cuts: list[int] = []
    for k in range(1, pieces):
        target = max(n * k // pieces, cuts[-1] + 1 if cuts else 1)
        if target >= n:
            break
        m = SAFE_CUT.search(text, target)
        if m is None:
            break
        cuts.append(m.start())
    return cuts


def split_for_count(text: str, pieces: int) -> list[str]:
    """``text`` cut at :func:`safe_cuts`; ``"".join(result) == text`` and no piece is empty."""
    cuts = safe_cuts(text, pieces)
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds) if b > a]


def parallel_count(
    text: str,
    count: Callable[[str], int],
    pieces: int | None = None,
    min_chars: int = PARALLEL_MIN_CHARS,
    workers: int | None = None,
) -> int:
    """Exact count of ``text`` with ``count`` (the length of a cl100k-family ``encode_ordinary``),
    spread over threads when ``text`` has at least ``min_chars`` characters.

    Returns the same number as ``count(text)``. The text is cut at :func:`safe_cuts` into
    ``pieces`` (default: one per :data:`PIECE_CHARS`, at least one per worker); ``workers``
    threads (default: the usable cores; the calling thread is one of them) take pieces in turn
    until none is left.
    """
    if len(text) < min_chars:
        return count(text)
    workers = workers or usable_cores()
    if pieces is None:
        pieces = max(workers, -(-len(text) // PIECE_CHARS))
    if pieces < 2:
        return count(text)
    parts = split_for_count(text, pieces)
    if len(parts) == 1:
        return count(text)
    lock = threading.Lock()
    queue = iter(parts)

    def drain() -> int:
        total = 0
        while True:
            with lock:
                piece = next(queue, None)
            if piece is None:
                return total
            total += count(piece)

    helpers = [_pool().submit(drain) for _ in range(min(workers, len(parts)) - 1)]
    mine = drain()
    return mine + sum(f.result() for f in helpers)
