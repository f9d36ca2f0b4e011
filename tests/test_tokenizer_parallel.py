"""Multi-core counting (tokenizer/parallel.py) gives exactly the single-thread count."""

from __future__ import annotations

import threading

import pytest
from conftest import SEEDS
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenizer import bundled_counter, get_encoding
from tokenizer.parallel import (
    _SAFE_CUT,
    PARALLEL_MIN_CHARS,
    PIECE_CHARS,
    parallel_count,
    safe_cuts,
    split_for_count,
    usable_cores,
)

ENC = get_encoding("cl100k_base")


def count(text: str) -> int:
    return len(ENC.encode_ordinary(text))


def seed_texts() -> list[str]:
    texts = [p.read_text(encoding="utf-8") for p in sorted(SEEDS.glob("0*.txt"))]
    assert len(texts) == 2 and all(len(t) > 5000 for t in texts)
    return texts


def all_cuts(text: str) -> list[int]:
    return [m.start() for m in _SAFE_CUT.finditer(text) if m.start() > 0]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("index", [0, 1])
def test_every_safe_cut_in_the_seeds_keeps_the_count(index):
    text = seed_texts()[index]
    total = count(text)
    cuts = all_cuts(text)
    assert len(cuts) > 500  # Chinese (no spaces between words) and Polish both offer many cuts
    # check each cut against the whole text, on a window around the cut (same pre-tokens:
    # the window's own ends are safe cuts too, so window counts add up as the text's)
    bounds = [0, *cuts[::25], len(text)]
    assert sum(count(text[a:b]) for a, b in zip(bounds, bounds[1:])) == total
    for k, c in enumerate(cuts):
        a = cuts[k - 3] if k >= 3 else 0
        b = cuts[k + 3] if k + 3 < len(cuts) else len(text)
        assert count(text[a:c]) + count(text[c:b]) == count(text[a:b]), (c, text[c - 10 : c + 10])


@pytest.mark.parametrize("pieces", [2, 3, 8, 64, 1000])
def test_parallel_count_equals_single_thread_on_seeds(pieces):
    for text in seed_texts():
        parts = split_for_count(text, pieces)
        assert "".join(parts) == text
        assert 2 <= len(parts) <= pieces
        assert parallel_count(text, count, pieces=pieces, min_chars=0) == count(text)


def test_counter_uses_parallel_path_on_long_text():
    text = "\n\n".join(seed_texts() * 12)  # ~270k characters: above PARALLEL_MIN_CHARS
    assert len(text) > PARALLEL_MIN_CHARS
    pieces: list[str] = []

    def recording(piece: str) -> int:
        pieces.append(piece)
        return count(piece)

    assert parallel_count(text, recording) == count(text)
    assert len(pieces) == max(usable_cores(), -(-len(text) // PIECE_CHARS))  # cut, not counted whole
    assert sorted(pieces) == sorted(split_for_count(text, len(pieces)))
    assert bundled_counter().count_text(text) == count(text)


@pytest.mark.timeout(60)
def test_pieces_are_counted_on_two_threads_at_once():
    """The first piece each thread takes waits at a barrier for a second thread: with one thread
    only, the barrier would time out and the count raise."""
    text = "\n\n".join(seed_texts() * 12)
    barrier = threading.Barrier(2, timeout=20)
    lock = threading.Lock()
    threads: set[int] = set()

    def counting(piece: str) -> int:
        with lock:
            new = threading.get_ident() not in threads and len(threads) < 2
            threads.add(threading.get_ident())
        if new:
            barrier.wait()
        return count(piece)

    assert parallel_count(text, counting, workers=2) == count(text)
    assert len(threads) == 2


def test_cut_rules_by_example():
    text = "Hello, world. 你好，世界。 12 ab'  x\n y"
    cuts = all_cuts(text)
    chars = [(text[c - 1], text[c]) for c in cuts]
    assert ("o", ",") in chars  # rule 2: letter then ASCII mark
    assert (",", " ") in chars  # rule 1: non-space then space
    assert ("好", "，") in chars  # rule 2: CJK letter then CJK mark
    assert ("2", " ") in chars  # rule 1 after a digit
    assert ("'", " ") in chars
    assert (" ", " ") not in chars  # never inside a whitespace run
    assert ("\n", " ") not in chars
    assert ("。", " ") in chars
    assert safe_cuts("aaaaaaaaaaaa", 4) == []  # one letter run: nowhere to cut


# Fragments chosen to stress the regex: contractions, letter runs in several scripts, digit runs
# longer than 3, punctuation runs, every kind of whitespace (ASCII, NBSP, ideographic space,
# the separators Python and Unicode disagree on), newlines, combining marks, emoji, CJK marks.
FRAGMENTS = [
    "a",
    "Z",
    "ł",
    "ż",
    "é",
    "ß",
    "Ω",
    "д",
    "中",
    "文",
    "字",
    "か",
    "한",
    "ا",
    "\u0301",
    "🙂",
    "_",
    "'s",
    "'S",
    "'ll",
    "'ve",
    "'re",
    "'d",
    "'m",
    "'t",
    "'",
    '"',
    "’",
    "0",
    "7",
    "12",
    "2026",
    "٣",
    "½",
    "Ⅻ",
    ",",
    ".",
    ";",
    ":",
    "!",
    "?",
    "(",
    ")",
    "[",
    "]",
    "{",
    "}",
    "-",
    "--",
    "...",
    "/",
    "#",
    "@",
    "，",
    "。",
    "、",
    "；",
    "：",
    "！",
    "？",
    "（",
    "）",
    "「",
    "」",
    "《",
    "》",
    "【",
    "】",
    " ",
    " ",
    " ",
    "  ",
    "\t",
    "\n",
    "\n\n",
    "\r\n",
    "\r",
    "\x0b",
    "\x0c",
    "\xa0",
    "\u3000",
    "\u2028",
    "\x1c",
    "\x85",
    "\u200b",
    "\u202f",
    "hello",
    " world",
    "Kraków",
    "incident",
    "KV",
    "<|endoftext|>",
]


@settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from(FRAGMENTS), min_size=1, max_size=80))
def test_random_text_every_safe_cut_keeps_the_count(fragments):
    text = "".join(fragments)
    total = count(text)
    for c in all_cuts(text):
        assert count(text[:c]) + count(text[c:]) == total, (repr(text), c)
    assert parallel_count(text, count, pieces=max(2, len(text) // 3), min_chars=0) == total


@settings(max_examples=100, deadline=None, database=None)
@given(st.text(min_size=1, max_size=200))
def test_arbitrary_unicode_parallel_count_is_exact(text):
    total = count(text)
    for c in all_cuts(text):
        assert count(text[:c]) + count(text[c:]) == total, (repr(text), c)
    assert parallel_count(text, count, pieces=16, min_chars=0) == total
