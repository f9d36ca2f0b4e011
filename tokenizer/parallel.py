"""Exact token counting split across threads at pre-token boundaries.

tiktoken's BPE runs only inside one pre-token (a match of the encoding's regex), and its Rust
core releases the GIL, so a text cut where the regex would cut anyway counts the same in pieces,
and the pieces can be encoded on several cores at once.

Safe cut (cl100k_base family): position ``i`` with ``text[i-1]`` a letter (``\\p{L}``, which is
``str.isalpha``) and ``text[i] == ' '``. Proof sketch: every alternative of the cl100k regex that
can match a letter either ends in a letter run (``[^\\r\\n\\p{L}\\p{N}]?+\\p{L}++``, the
contractions) or cannot hold one; a letter run stops at the space, so the match holding
``text[i-1]`` ends exactly at ``i``. The regex has no look-behind and ``$`` only matches at the very
end (a piece never ends in whitespace), so matching from ``i`` on the whole text equals matching
a piece that starts at ``i``. tests/test_tokenizer.py checks the equality on real and random text.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

PARALLEL_MIN_CHARS = 200_000
_POOL: ThreadPoolExecutor | None = None


def _pool() -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2), thread_name_prefix="kvgate-count")
    return _POOL


def safe_cuts(text: str, pieces: int) -> list[int]:
    """Up to ``pieces - 1`` cut positions near equal spacing, each a safe pre-token boundary."""
    n = len(text)
    cuts: list[int] = []
    for k in range(1, pieces):
        target = n * k // pieces
        lo = cuts[-1] + 1 if cuts else 1
        i = text.find(" ", max(target, lo))
        while i != -1 and i < n and not text[i - 1].isalpha():
            i = text.find(" ", i + 1)
        if i == -1 or i >= n:
            break
        cuts.append(i)
    return cuts


def split_for_count(text: str, pieces: int) -> list[str]:
    """``text`` cut at :func:`safe_cuts`; ``"".join(result) == text``."""
    cuts = safe_cuts(text, pieces)
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]


def parallel_count(text: str, count: Callable[[str], int], pieces: int | None = None) -> int:
    """Exact count of ``text`` with ``count`` (an ordinary cl100k-family encode length), spread over
    a thread pool when the text is long. Same result as ``count(text)``."""
    if len(text) < PARALLEL_MIN_CHARS:
        return count(text)
    pieces = pieces or 4 * max(2, os.cpu_count() or 2)
    parts = split_for_count(text, pieces)
    if len(parts) == 1:
        return count(text)
    return sum(_pool().map(count, parts))
