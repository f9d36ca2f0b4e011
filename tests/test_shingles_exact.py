"""Exact values of :mod:`verifier.shingles` at the edges the broader verifier tests pass over.

The leak check trusts three small pieces: which window minima winnowing keeps (the reference
:func:`winnow` and the vectorised :meth:`ShingleHasher.select`), where a stream may be cut
before encoding (:func:`is_cut_point`, :func:`last_cut_point`), and which non-ASCII pairs fold
apart; and the hashes themselves (the stored BLAKE2b and the selection hash, on each of its
paths), which an index written by one release must read the same in the next. Each test pins the
exact set, positions, verdict or hash for a small input whose answer changes when one condition,
bound or constant in those functions does.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from verifier.shingles import (
    IncrementalShingler,
    ShingleHasher,
    _windows,
    encode,
    fold,
    is_cut_point,
    last_cut_point,
    winnow,
)


# ---------------------------------------------------------------- winnowing
def test_winnow_keeps_the_first_windows_minimum_even_when_no_later_window_has_it():
    # windows of 3: [1,5,6] -> 1, [5,6,7] -> 5
    assert winnow([1, 5, 6, 7], 3) == {1, 5}


def test_winnow_takes_no_minimum_of_a_partial_first_window():
    # windows of 3: [3,4,1] -> 1, [4,1,5] -> 1; the first two hashes alone are no window
    assert winnow([3, 4, 1, 5], 3) == {1}


def test_select_positions_for_the_same_edges():
    h = ShingleHasher(b"exact", 16)
    assert h.select([], 3, fast=np.array([1, 5, 6, 7], dtype=np.uint64)) == [0, 1]
    assert h.select([], 3, fast=np.array([3, 4, 1, 5], dtype=np.uint64)) == [2]


# ---------------------------------------------------------------- folding
@pytest.mark.parametrize(
    "text,folded",
    [
        ("a\nb", "a b"),  # a line feed alone
        ("a\rb", "a b"),  # a carriage return alone
        ("a\r\n\r\nb", "a b"),
        ("a\u00adb  c", "ab c"),
    ],
)
def test_fold_makes_each_kind_of_line_break_one_space(text, folded):
    assert fold(text) == folded


# ---------------------------------------------------------------- cut points
@pytest.mark.parametrize(
    "text,p,cut",
    [
        ("a,b", 1, True),  # the smallest cut: first index with a letter before and after
        (",ab", 0, False),  # nothing before index 0 (not the text's last character)
        ("ab,", 2, False),  # nothing after the last index
        ("ab", 5, False),  # past the end
        ("ab1cd", 2, False),  # a digit is no cut
        ("ab²cd", 2, False),  # nor any numeric character
        ("café,x", 4, True),  # a non-ASCII letter before punctuation folds apart
        ("é,x", 1, True),
    ],
)
def test_is_cut_point_at_the_bounds_and_for_digits(text, p, cut):
    assert is_cut_point(text, p) is cut


@pytest.mark.parametrize(
    "c,why",
    [
        ("\u0f73", "NFKC starts with a combining mark although the sign itself has class 0"),
        ("\u2116", "NFKC makes it letters: No"),
        ("\u32c0", "NFKC makes it start with a digit: 1月"),
        ("\u33c2", "NFKC makes it start with a letter (a.m.) though it ends in punctuation"),
    ],
)
def test_a_character_that_folds_into_a_letter_digit_or_mark_is_no_cut(c, why):
    assert is_cut_point("a" + c + "b", 1) is False, why


def test_a_letter_that_folds_to_end_in_a_non_letter_is_no_cut():
    # U+0140 (l with middle dot) folds to "l·": the text before the cut ends in punctuation
    assert is_cut_point("\u0140,b", 1) is False
    assert is_cut_point("l,b", 1) is True


@pytest.mark.parametrize(
    "text,start,p",
    [
        ("a,b", 0, 1),  # the default start still allows index 1
        ("a,bc", 0, 1),  # every index from the end is tried, not every second one
        ("a,b,c", 0, 3),  # the largest
        ("a,b,c", 2, 3),
        ("a,b,c", 3, -1),  # strictly after start
        ("abc", 0, -1),
        ("", 0, -1),
    ],
)
def test_last_cut_point_is_the_largest_after_start_or_minus_one(text, start, p):
    assert last_cut_point(text, start) == p


def test_last_cut_point_default_start_is_zero():
    assert last_cut_point("a,b") == 1


# ---------------------------------------------------------------- the stream's pending tail
def test_a_tail_over_the_bound_without_a_cut_is_encoded_whole():
    inc = IncrementalShingler(ShingleHasher(b"exact", 1), max_pending_chars=4)
    assert inc.push("abcdefgh") == [57847]  # cl100k: "abcdefgh" is one token
    assert (inc.pending_chars, inc.tokens_seen) == (0, 1)


def test_a_tail_of_exactly_the_bound_waits_for_one_more_character():
    inc = IncrementalShingler(ShingleHasher(b"exact", 1), max_pending_chars=4)
    assert inc.push("abcd") == []
    assert (inc.pending_chars, inc.tokens_seen) == (4, 0)
    assert inc.push("e") == [13997, 451]  # "abcde": "abc", "de"
    assert (inc.pending_chars, inc.tokens_seen) == (0, 2)


@pytest.mark.parametrize(
    "k,first,rest",
    [
        (1, [606], [14287, 1146]),  # k = 1 carries nothing over
        (2, [], [606, 14287, 1146]),  # k = 2 carries the one last id, so the shingle across the cut is new
    ],
)
def test_each_push_returns_the_last_k_minus_1_ids_seen_then_the_new_ones(k, first, rest):
    inc = IncrementalShingler(ShingleHasher(b"exact", k), max_pending_chars=64)
    assert inc.push("one,two") == first  # cut before "," ("one" is [606]; ",two" is [14287, 1146])
    assert inc.pending_chars == 4
    assert inc.flush() == rest
    assert (inc.pending_chars, inc.tokens_seen, inc.flush()) == (0, 3, [])


# ---------------------------------------------------------------- hashing: keys, k, pinned values
def test_k_below_one_is_refused_and_k_of_one_is_not():
    with pytest.raises(ValueError, match="k must be >= 1"):
        ShingleHasher(b"exact", 0)
    assert ShingleHasher(b"exact", 1).k == 1


def test_a_key_over_64_bytes_is_first_hashed_to_64_and_a_64_byte_key_is_not():
    long_key = b"x" * 65
    digest = hashlib.blake2b(long_key).digest()  # 64 bytes
    assert ShingleHasher(long_key, 1).hash_ids([7]) == ShingleHasher(digest, 1).hash_ids([7]) == 9603302129266802163
    assert ShingleHasher(b"x" * 64, 1).hash_ids([7]) == 1789151785535727914


def test_stored_and_selection_hashes_are_pinned():
    """The stored (BLAKE2b) and selection (polynomial) hashes of one key and k are fixed values:
    an index written by one release is read by the next."""
    h = ShingleHasher(b"exact", 3)
    assert h.hash_ids([1, 2, 3]) == 14006063425949885594
    assert h.hashes([1, 2, 3, 4]) == [14006063425949885594, 13839932152386090692]
    assert h.hashes_at([1, 2, 3, 4, 5], [2, 0]) == [3949009967008188582, 14006063425949885594]
    assert h.fast([1, 2, 3, 4]).tolist() == [10779229278603197799, 12827126622088289457]  # Python-int path
    # the matrix path (8 shingles) and the doubling path (1998 shingles) give the same values
    assert h.fast(list(range(10))).tolist()[:3] == [3963769682590037304, 10779229278603197799, 12827126622088289457]
    long = h.fast(list(range(2000))).tolist()
    assert (len(long), long[1], long[-1], sum(long) % 2**64) == (1998, 10779229278603197799, 9950101658931204189, 13981966776736613017)


def test_windows_is_a_read_only_view():
    a = np.arange(5, dtype=np.uint64)
    v = _windows(a, 3)
    assert v.tolist() == [[0, 1, 2], [1, 2, 3], [2, 3, 4]]
    with pytest.raises(ValueError, match="read-only"):
        v[0, 0] = 9
    assert a.tolist() == [0, 1, 2, 3, 4]


def test_encode_squeezes_long_runs_unless_told_it_was_done():
    assert encode(" " * 1000 + "x") == encode(" " * 64 + "x") == [15628, 865]
    assert len(encode(" " * 1000 + "x", squeezed=True)) == 10
