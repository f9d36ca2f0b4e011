"""tokenizer/json_values.py, exactly: what :class:`JsonStrings` decodes from a JSON text (whole
and in pieces of any size), compared with the values Python's own JSON parser reads from the same
text; its lenient answers (a lone surrogate, a bad escape, a text cut off, a nesting deeper than
:data:`MAX_DEPTH`); and :func:`unescaped_values` up to :data:`UNESCAPE_LEVELS` levels."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest

from tokenizer.json_values import MAX_DEPTH, UNESCAPE_LEVELS, JsonStrings, json_strings, unescaped_values


class _Obj(list):
    """An object's ``(key, value)`` pairs, in order (duplicate keys kept)."""


def _reference(text: str) -> str:
    """Every string value of ``text`` (not the keys, empty ones too) in document order, each
    followed by a line break, as Python's ``json`` module reads them."""
    out: list[str] = []
    stack = [json.loads(text, object_pairs_hook=_Obj)]
    while stack:
        x = stack.pop()
        if isinstance(x, str):
            out.append(x + "\n")
        elif isinstance(x, _Obj):
            stack.extend(reversed([v for _, v in x]))
        elif isinstance(x, list):
            stack.extend(reversed(x))
    return "".join(out)


def _pieces(text: str, step: int) -> str:
    d = JsonStrings()
    return "".join(d.push(text[i : i + step]) for i in range(0, len(text), step))


_VALID = [
    '{"a": "x", "b": ["y", {"c": "z"}, "w"], "d": {"e": "v"}, "f": "u"}',
    '[{"k": "v1"}, "v2", [], {}, {"k2": ["v3"]}, "v4", [{"k3": "v5"}, "v6"]]',
    '{"q\\"k": "\\"\\\\\\/\\b\\f\\n\\r\\t", "k\\u00e9": "\\u00e9\\u00E9\\ud83d\\ude00\\uD83D\\uDE00"}',
    '{"empty": "", "s": "{not: [structure], \\"k\\": 1}", "n": [1, 2.5e3, true, false, null]}',
    '"top level \\u0041\\u4e2d"',
    '{"\\ud83d\\ude00": "after a surrogate-pair key", "x\\ty": "y"}',
    '{"a":{"b":{"c":"d"},"e":"f"},"g":["h",{"i":"j"}],"k":"l"}',
    '{"x": "\\u0000\\u001f\\u007f\\uffff\\u10ffff"}',
]


@pytest.mark.parametrize("text", _VALID)
def test_values_of_valid_json_are_what_json_loads_reads_whole_and_in_pieces(text: str) -> None:
    expected = _reference(text)
    assert json_strings(text) == expected
    for step in range(1, 9):
        assert _pieces(text, step) == expected, step
    for cut in range(1, len(text)):
        d = JsonStrings()
        assert d.push(text[:cut]) + d.push(text[cut:]) == expected, cut


def test_reference_values_of_a_mixed_document_are_exact() -> None:
    # the reference itself, on a text whose values are known by hand
    assert _reference(_VALID[0]) == "x\ny\nz\nw\nv\nu\n"
    assert json_strings(_VALID[0]) == "x\ny\nz\nw\nv\nu\n"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('"a\\ud83db"', "a\ufffdb\n"),  # a high surrogate without its low half, then text
        ('"a\\ud83d"', "a\ufffd\n"),  # ... then the string's end
        ('"\\ude00"', "\ufffd\n"),  # a lone low surrogate
        ('"\\udfff\\udc00"', "\ufffd\ufffd\n"),  # both ends of the low range
        ('"\\ud800\\ud83d\\ude00"', "\ufffd\U0001f600\n"),  # a high one, then a pair
        ('"\\udbff\\udfff"', "\U0010ffff\n"),  # the last pair
        ('"\\ud83d\\ue000"', "\ufffd\ue000\n"),  # past the low range: no pair
        ('"\\udc00\\udc00"', "\ufffd\ufffd\n"),  # a low one is not a high one
        ('"\\ud800\\udc00"', "\U00010000\n"),  # the first pair
        ('"\\ud83d\\n"', "\ufffd\n\n"),  # a high one, then a one-character escape
        ('"\\ud83d\\u0041"', "\ufffdA\n"),
        ('"a\\qb"', "a\\qb\n"),  # a bad escape is kept as written
        ('"\\u12G4x"', "\\u12G4x\n"),  # a bad \\u escape too
        ('"\\u00X1\\u004g\\uZ000"', "\\u00X1\\u004g\\uZ000\n"),
        ('{"\\ud83dk": "v"}', "v\n"),  # a key's lone surrogate is not written
        ('{"k\\ud83d": "v"}', "v\n"),
        ('{"k\\ud83d\\ude00": "v", "\\ude00": "w"}', "v\nw\n"),
        ('{"a": "one two', "one two"),  # cut off inside a value
        ('{"a": "x\\', "x"),  # ... inside an escape
        ('{"a": "x\\u00', "x"),
        ('{"a": "x\\ud83d', "x"),  # ... with a high surrogate waiting
        ('{"a', ""),  # ... inside a key
        ('garbage {"a": tru, "b": "c"} trailing "d', "c\nd"),  # text outside strings skipped
        ('{"a": "b" "c": "d"}', "b\nc\nd\n"),  # no comma: the next string is a value
        ('{"a": ["b"], "c": "d"}', "b\nd\n"),
        ('[{"a": "b"} "c"]', "b\nc\n"),  # no comma after a container: a value too
        ('{"a": ["b"] "c"}', "b\nc\n"),
    ],
)
def test_lenient_answers_are_exact_whole_and_in_pieces(text: str, expected: str) -> None:
    assert json_strings(text) == expected
    for step in range(1, 8):
        assert _pieces(text, step) == expected, step


def test_containers_up_to_max_depth_are_told_apart_and_deeper_ones_are_not() -> None:
    assert MAX_DEPTH == 1024
    inner = '{"k": "v", "k2": "w"}'
    at_limit = "[" * (MAX_DEPTH - 1) + inner + "]" * (MAX_DEPTH - 1)
    x = orjson.loads(at_limit)  # the deepest nesting orjson reads
    for _ in range(MAX_DEPTH - 1):
        x = x[0]
    assert x == {"k": "v", "k2": "w"}
    assert json_strings(at_limit) == "".join(v + "\n" for v in x.values()) == "v\nw\n"
    # one level deeper the object is not on the stack: after its comma "k2" counts as a value
    beyond = "[" * MAX_DEPTH + inner + "]" * MAX_DEPTH
    assert json_strings(beyond) == "v\nk2\nw\n"


def _nest(levels: int, leaf: str) -> list[str]:
    """``leaf`` written as JSON inside an object ``levels`` times; the texts, outermost first."""
    texts = [leaf]
    for _ in range(levels):
        texts.append(json.dumps({"k": texts[-1]}))
    return texts[::-1]


def test_unescaped_values_decodes_up_to_three_levels_of_escaped_json() -> None:
    assert UNESCAPE_LEVELS == 3
    leaf = "deep\nline \u00e9"
    t = _nest(4, leaf)  # t[0] holds t[1] escaped, ... t[3] holds leaf
    assert [json.loads(x)["k"] for x in t[:4]] == t[1:]
    assert unescaped_values(t[3]) == [leaf]
    assert unescaped_values(t[2]) == [t[3], leaf]
    assert unescaped_values(t[1]) == [t[2], t[3], leaf]
    assert unescaped_values(t[0]) == [t[1], t[2], t[3]]  # a fourth level is not decoded


def test_unescaped_values_answers_exactly() -> None:
    assert unescaped_values('{"a": "no escape"}') == []
    assert unescaped_values('x {"a": "b\\nc"}') == []  # not JSON at its start
    assert unescaped_values(' \n\t{"a": "b\\nc"}') == ["b\nc"]  # leading white space
    assert unescaped_values('["b\\nc"]') == ["b\nc"]
    assert unescaped_values('"b\\nc"') == ["b\nc"]
    # values in document order, empty ones left out; numbers, bools and keys carry none
    doc = '{"k\\n": "", "a": ["x\\ty", 1, true, null, {"b": "z"}], "c": "w"}'
    assert unescaped_values(doc) == ["x\ty", "z", "w"]
    # invalid JSON: decoded leniently, one text; none when it holds no string value
    assert unescaped_values('{"a": "one\\ntwo", "b": "thr') == ["one\ntwo\nthr"]
    assert unescaped_values('{"a\\n": 1,') == []
    assert unescaped_values('["\\\\"') == ["\\\n"]


def _tojson(x: Any) -> str:
    """transformers' ``tojson`` filter with its defaults (chat_template_utils: ``json.dumps`` with
    ``ensure_ascii=False``, no indent, default separators, keys unsorted)."""
    return json.dumps(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)


_TOOL = {
    "type": "function",
    "function": {
        "name": "f",
        "description": "d\u00e9crit \u4e2d",
        "parameters": {"type": "object", "properties": {"x": {"type": "number", "default": 1e15}}},
    },
}
_CHAT: list[Any] = [
    {"role": "system", "content": "sys"},
    {
        "role": "user",
        "name": "bob",
        "content": [
            {"type": "text", "text": "t1"},
            {"type": "image_url", "image_url": {"url": "http://i"}},
            {"type": "refusal", "refusal": "r1"},
            {"type": "output_text", "text": "t2"},
            {"type": "refusal", "text": "t3", "refusal": "not this"},
            {"type": "other", "refusal": "nor this"},
            "a bare string part",
            {"type": "input_text", "text": ""},
        ],
    },
    {
        "role": "assistant",
        "reasoning": "same",
        "reasoning_content": "same",
        "content": None,
        "refusal": "no",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": "a\\nb"}'}},
            {"id": "c2", "type": "function", "function": {"name": "h", "arguments": {"y": 1e15, "z": "\u00e9"}}},
            "junk",
            {"id": "c3", "function": "not an object"},
        ],
    },
    {
        "role": "assistant",
        "reasoning": "r",
        "reasoning_content": "rc",
        "function_call": {"name": "g", "arguments": ["l", 2]},
    },
    {"role": "tool", "tool_call_id": "c1", "content": "result"},
    "not a message",
]


def test_chat_text_is_every_rendered_string_in_order_with_parsed_values_as_tojson_writes_them() -> None:
    from tokenizer.prompt_text import chat_text

    legacy = {"name": "g", "parameters": {}}
    expected = [
        _tojson(_TOOL),
        _tojson(legacy),
        "sys",
        "bob", "t1", "r1", "t2", "t3",
        "same", "no", "f", '{"x": "a\\nb"}', "a\nb", "h", _tojson({"y": 1e15, "z": "\u00e9"}),
        "r", "rc", "g", _tojson(["l", 2]),
        "result",
    ]  # fmt: skip
    got = chat_text(_CHAT, tools=[_TOOL, "not a tool"], functions=[legacy])
    assert got == "\n".join(expected)
    # a float the template writes in full: a shorter text than the engine's would undercount
    assert '"default": 1000000000000000.0' in got and '"y": 1000000000000000.0, "z": "\u00e9"' in got
    assert chat_text(_CHAT[:1], tools=None, functions=[legacy]) == _tojson(legacy) + "\nsys"
    assert chat_text("not a list", tools=[_TOOL]) == _tojson(_TOOL)


def test_content_texts_are_the_text_and_refusal_parts_in_order() -> None:
    from tokenizer.prompt_text import content_texts

    assert content_texts(_CHAT[1]["content"]) == ["t1", "r1", "t2", "t3", ""]
    assert content_texts("s") == ["s"]
    assert content_texts(None) == [] and content_texts({"text": "x"}) == []


def test_a_value_json_cannot_write_gives_its_strings() -> None:
    from tokenizer.prompt_text import _dumps

    assert _dumps({"a": "x\u00e9", "n": 1e15}) == _tojson({"a": "x\u00e9", "n": 1e15})
    assert _dumps({"a": "x", "b": {"y"}, "c": ["z", b"w"]}) == "x\nz"  # a set: TypeError; its strings are not walked
