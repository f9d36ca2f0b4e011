"""tokenizer/json_values.py ``string_values``: the one walk over a parsed JSON value's strings, for
the prompt side (values only) and the verifier (values and key names that are not identifiers,
``keys=``): what each collects, in which order, and at a depth no recursive walk survives."""

from __future__ import annotations

from typing import Any

import orjson

from tokenizer.json_values import string_values, unescaped_values
from tokenizer.prompt_text import _dumps
from verifier.engine_response import parse_body, parse_chunk, parse_response_event

#: deeper than Python's recursion limit (1,000) and orjson's nesting limit (1,024)
_DEEP = 10_000

_MIXED = {
    "a": "x",
    "two words": "y",
    "": "z",
    "n": [1, 2.5, True, False, None, "", {"é": "q", "ok_1": 7}],
    "tail": "w",
}


def _walk(obj: Any, **kw: Any) -> list[str]:
    out: list[str] = []
    string_values(obj, out, **kw)
    return out


def _deep(leaf: Any) -> Any:
    """``leaf`` inside ``_DEEP`` containers, lists and objects by turns, an object's key a text."""
    x = leaf
    for i in range(_DEEP):
        x = [x] if i % 2 else {"key with spaces": x}
    return x


def test_values_only_in_document_order_without_numbers_bools_or_empty_strings():
    assert _walk(_MIXED) == ["x", "y", "z", "q", "w"]
    assert _walk(_MIXED, skip=frozenset({"n"})) == ["x", "y", "z", "w"]
    assert _walk([1, 0.5, True, None, "", "s"]) == ["s"]
    assert _walk("s") == ["s"] and _walk(3) == [] and _walk(None) == []


def test_keys_predicate_adds_the_key_names_it_takes_just_before_their_values():
    def is_text(k: str) -> bool:
        return not k.isidentifier()

    # "" is taken and, empty, left out like an empty value; "é" is a Python identifier
    assert _walk(_MIXED, keys=is_text) == ["x", "two words", "y", "z", "q", "w"]
    assert _walk(_MIXED, keys=is_text, skip=frozenset({"two words"})) == ["x", "z", "q", "w"]
    assert _walk({"a b": 1, "c d": None}, keys=is_text) == ["a b", "c d"]  # a key whose value holds no text


def test_verifier_reads_values_and_non_identifier_keys_of_unknown_fields_in_order():
    delta = {"content": "hi", "extra": _MIXED}
    out = parse_chunk({"choices": [{"index": 0, "delta": delta}]})
    assert out.fields == {"0:content": "hi", "0:other": "x two words y z é q w"}
    assert out.texts == {0: "hi"}


def test_a_10000_deep_value_is_read_whole_by_both_walks():
    deep = _deep("deep leak")
    assert _walk(deep) == ["deep leak"]
    assert _walk(deep, keys=lambda k: " " in k) == ["key with spaces"] * (_DEEP // 2) + ["deep leak"]
    out = parse_body({"choices": [{"index": 0, "message": {"content": "ok", "x": deep}}]})
    assert out.fields["0:other"] == " ".join(["key with spaces"] * (_DEEP // 2) + ["deep leak"])
    assert _dumps(deep) == "deep leak"  # the prompt side: too deep to write as JSON, read as strings


def test_the_deepest_value_orjson_reads_is_read_by_both_walks():
    doc = b"[" * 1024 + b'"x\\ny"' + b"]" * 1024
    assert _walk(orjson.loads(doc)) == ["x\ny"]
    assert unescaped_values(doc.decode()) == ["x\ny"]
    event = {"type": "response.custom.event", "payload": orjson.loads(doc)}
    # a type outside the Responses vocabulary is text too (a hostile engine's channel)
    assert parse_response_event(event).fields == {"0:other": "response.custom.event x\ny"}
