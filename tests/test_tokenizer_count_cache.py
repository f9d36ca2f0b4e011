"""The tiktoken counter's count cache (tokenizer/tiktoken_counter.py CountCache): a remembered count
is the exact count, only texts of 32..16,384 characters are remembered, only digests are kept,
and the cache stays bounded."""

from __future__ import annotations

import pytest

from tokenizer import TiktokenCounter
from tokenizer.tiktoken_counter import COUNT_CACHE_MAX_CHARS, COUNT_CACHE_MIN_CHARS, CountCache


@pytest.fixture()
def counter() -> TiktokenCounter:
    return TiktokenCounter("cl100k_base")


def exact(c: TiktokenCounter, text: str) -> int:
    return len(c.encoding.encode_ordinary(text))


TEXTS = [
    "x" * (COUNT_CACHE_MIN_CHARS - 1),
    "x" * COUNT_CACHE_MIN_CHARS,
    "Call me Ishmael. Some years ago, never mind how long precisely.",
    "日本語のテキストも数えます。" * 5,
    "emoji 🧪🧪🧪 and <|endoftext|> typed by a user " * 3,
    "a b " * (COUNT_CACHE_MAX_CHARS // 4),
    "a b " * (COUNT_CACHE_MAX_CHARS // 4) + "c",
]


def test_remembered_counts_are_exact_and_only_for_the_cached_lengths(counter: TiktokenCounter) -> None:
    for text in TEXTS:
        first = counter.count_text(text)
        assert first == exact(counter, text)
        assert counter.count_text(text) == first  # second time from the cache (when cached)
    cached = [t for t in TEXTS if COUNT_CACHE_MIN_CHARS <= len(t) <= COUNT_CACHE_MAX_CHARS]
    assert len(counter.count_cache) == len(cached) == 5
    for text in TEXTS:
        assert (counter.count_cache.get(CountCache.key(text)) is not None) == (text in cached)


def test_a_hit_does_not_encode_again_and_keeps_no_text(counter: TiktokenCounter, monkeypatch) -> None:
    text = "a prompt long enough to be remembered by its digest"
    n = counter.count_text(text)
    monkeypatch.setattr(counter, "_count_one", lambda t: pytest.fail("encoded again"))
    assert counter.count_text(text) == n
    keys = [k for k, _ in counter.count_cache.items()]
    assert keys == [CountCache.key(text)] and len(keys[0]) == 16
    assert all(isinstance(v, int) for _, v in counter.count_cache.items())
    # a different text of the same length is counted, not taken from the other's entry
    other = text[::-1]
    assert len(other) == len(text)
    with pytest.raises(pytest.fail.Exception):
        counter.count_text(other)


def test_the_cache_is_bounded_oldest_out_first() -> None:
    cache = CountCache(entries=3)
    keys = [CountCache.key(f"text number {i:040d}") for i in range(5)]
    for i, k in enumerate(keys):
        cache.put(k, i)
    assert len(cache) == 3
    assert [cache.get(k) for k in keys] == [None, None, 2, 3, 4]
    cache.put(keys[2], 7)  # updating an entry evicts nothing
    assert len(cache) == 3 and cache.get(keys[2]) == 7 and cache.get(keys[3]) == 3


def test_chat_counts_are_unchanged_by_the_cache(counter: TiktokenCounter) -> None:
    messages = [
        {"role": "system", "content": "You are a concise assistant who answers in one line."},
        {"role": "user", "content": "What does the gateway count, and why must it never undercount?"},
    ]
    fresh = TiktokenCounter("cl100k_base")
    assert counter.count_chat(messages) == fresh.count_chat(messages)
    assert counter.count_chat(messages) == fresh.count_chat(messages)  # now from the cache
    assert len(counter.count_cache) == 2
