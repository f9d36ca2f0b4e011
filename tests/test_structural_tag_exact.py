"""Structural tags at their edges (gateway/admission/structural_tag.py): which contents need a
tag's ``end`` (xgrammar's analyzer, ``cpp/structural_tag.cc`` ``IsUnlimited`` / ``IsExcluded``:
``any_text``, ``triggered_tags``, ``tags_with_separator``, ``star`` and ``plus`` run on; a
``repeat`` whose ``max`` is -1 runs on; ``sequence``, ``or`` and ``optional`` as their parts; a
non-empty ``excludes`` ends the content; a token-format ``end`` is never empty: "When the content
is unlimited, at least one end string must be non-empty"), repeat counts at the bound of 1,000,
the trigger rules, and the refusal as the exact OpenAI-shaped 400."""

from __future__ import annotations

from typing import Any

import pytest

from config.errors import OpenAIError
from gateway.admission.checks import CHAT_FIELDS, check_fields
from gateway.admission.structural_tag import structural_tag_formats, structural_tag_problem

CONST = {"type": "const_string", "value": "x"}
ANY = {"type": "any_text"}
TRIGGERED = {"type": "triggered_tags", "triggers": ["<b"], "tags": [{"begin": "<b>", "content": CONST, "end": "</b>"}]}
TOKEN_TRIGGERED = {
    "type": "token_triggered_tags",
    "trigger_tokens": [5],
    "tags": [{"begin": {"type": "token", "token": 5}, "content": CONST, "end": "</b>"}],
}
NO_END = "'format.end' must hold a non-empty string: 'format.content' has no end of its own"


def _tag(content: dict[str, Any], end: Any = "") -> dict[str, Any]:
    return {"type": "structural_tag", "format": {"type": "tag", "begin": "<a>", "content": content, "end": end}}


def _repeat(lo: int, hi: int, content: dict[str, Any]) -> dict[str, Any]:
    return {"type": "repeat", "min": lo, "max": hi, "content": content}


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (ANY, NO_END),
        ({"type": "any_text", "excludes": ["</a>"]}, None),
        ({"type": "any_text", "excludes": []}, NO_END),
        ({"type": "star", "content": CONST}, NO_END),
        ({"type": "plus", "content": CONST}, NO_END),
        ({"type": "optional", "content": CONST}, None),
        ({"type": "optional", "content": ANY}, NO_END),
        (_repeat(0, -1, CONST), NO_END),
        (_repeat(2, -1, CONST), NO_END),
        (_repeat(0, 3, CONST), None),
        (_repeat(0, 3, ANY), NO_END),
        ({"type": "sequence", "elements": [CONST, CONST]}, None),
        ({"type": "sequence", "elements": [CONST, _repeat(1, -1, CONST)]}, NO_END),
        ({"type": "or", "elements": [CONST, {"type": "star", "content": CONST}]}, NO_END),
        (
            {
                "type": "tags_with_separator",
                "tags": [{"begin": "<b>", "content": CONST, "end": "</b>"}],
                "separator": ",",
            },
            NO_END,
        ),
        (CONST, None),
        ({"type": "regex", "pattern": "[a-z]+"}, None),
        ({"type": "any_tokens"}, NO_END),
        ({"type": "any_tokens", "exclude_tokens": [9]}, None),
        ({"type": "exclude_token", "exclude_tokens": [9]}, None),
        (TRIGGERED, NO_END),
        ({**TRIGGERED, "excludes": ["</a>"]}, None),
        (TOKEN_TRIGGERED, NO_END),
        ({**TOKEN_TRIGGERED, "exclude_tokens": [9]}, None),
        ({"type": "dispatch", "rules": [["<b>", CONST]]}, NO_END),
        ({"type": "dispatch", "rules": [["<b>", CONST]], "excludes": ["</a>"]}, None),
        ({"type": "token_dispatch", "rules": [[5, CONST]]}, NO_END),
        ({"type": "token_dispatch", "rules": [[5, CONST]], "exclude_tokens": [9]}, None),
    ],
)
def test_contents_that_need_an_end(content: dict[str, Any], problem: str | None) -> None:
    assert structural_tag_problem(_tag(content)) == problem
    assert structural_tag_problem(_tag(content, end=["", ""])) == problem
    # a non-empty end, or a token end, ends any content
    assert structural_tag_problem(_tag(content, end="</a>")) is None
    assert structural_tag_problem(_tag(content, end=["", "</a>"])) is None
    assert structural_tag_problem(_tag(content, end={"type": "token", "token": 7})) is None


@pytest.mark.parametrize(
    ("fmt", "problem"),
    [
        (_repeat(0, 1000, CONST), None),
        (_repeat(1000, -1, CONST), None),
        (_repeat(1000, 1000, CONST), None),
        (_repeat(0, 1001, CONST), "'format.max' must be -1 (unbounded) or an integer from 0 to 1000"),
        (_repeat(1001, -1, CONST), "'format.min' must be <= 1000"),
        (_repeat(5, 5, CONST), None),
        (_repeat(6, 5, CONST), "'format.min' must be <= 'format.max'"),
        (_repeat(0, 10, _repeat(0, 100, CONST)), None),
        (_repeat(0, 10, _repeat(0, 101, CONST)), "'format.content' nests repeat counts whose product is above 1,000"),
        # a max of -1 counts its min copies (at least one)
        (_repeat(10, -1, _repeat(0, 100, CONST)), None),
        (_repeat(11, -1, _repeat(0, 100, CONST)), "'format.content' nests repeat counts whose product is above 1,000"),
        (_repeat(0, -1, _repeat(0, 1000, CONST)), None),
        (_repeat(0, 0, _repeat(0, 1000, CONST)), None),
        (
            {
                "type": "sequence",
                "elements": [CONST, _repeat(0, 2, {"type": "optional", "content": _repeat(0, 501, CONST)})],
            },
            "'format.elements[1].content.content' nests repeat counts whose product is above 1,000",
        ),
    ],
)
def test_repeat_counts(fmt: dict[str, Any], problem: str | None) -> None:
    assert structural_tag_problem({"type": "structural_tag", "format": fmt}) == problem


def _triggered(triggers: list[str], begins: list[str]) -> dict[str, Any]:
    tags = [{"begin": b, "content": CONST, "end": "</f>"} for b in begins]
    return {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": triggers, "tags": tags}}


@pytest.mark.parametrize(
    ("triggers", "begins", "problem"),
    [
        (["<f"], ["<f=a>", "<f=b>"], None),
        (["<f=a>"], ["<f=a>"], None),  # a trigger may be the whole begin
        (["<f", "<g"], ["<f=a>", "<g=b>"], None),
        (
            ["<f=a>x"],
            ["<f=a>"],
            "'format.tags[0].begin' must begin with exactly one of 'format.triggers' (it begins with 0)",
        ),
        (
            ["<f", "<f="],
            ["<f=a>"],
            "'format.tags[0].begin' must begin with exactly one of 'format.triggers' (it begins with 2)",
        ),
        (
            ["<f", "<f"],
            ["<f=a>"],
            "'format.tags[0].begin' must begin with exactly one of 'format.triggers' (it begins with 2)",
        ),
        (["<f", "<g"], ["<f=a>", "<f=b>"], "'format.triggers[1]' begins none of the tags"),
        (["<g", "<f"], ["<f=a>"], "'format.triggers[0]' begins none of the tags"),
    ],
)
def test_triggers_and_begins(triggers: list[str], begins: list[str], problem: str | None) -> None:
    assert structural_tag_problem(_triggered(triggers, begins)) == problem


def test_legacy_triggers_and_schemas() -> None:
    legacy = {
        "type": "structural_tag",
        "structures": [{"begin": "<f=a>", "schema": {"type": "object"}, "end": "</f>"}],
        "triggers": ["<f"],
    }
    assert structural_tag_problem(legacy) is None
    assert structural_tag_problem({**legacy, "format": None}) is None
    assert structural_tag_problem({**legacy, "triggers": ["<f", "<g"]}) == "'triggers[1]' begins none of the tags"
    no_schema = {"begin": "<f=a>", "end": "</f>"}
    assert structural_tag_problem({**legacy, "structures": [no_schema]}) is None
    assert (
        structural_tag_problem({**legacy, "structures": [{**no_schema, "end": 1}]})
        == "'structures[0].end' must be a string"
    )
    assert (
        structural_tag_problem({**legacy, "structures": [{**no_schema, "schema": {"pattern": "(a+)+"}}]})
        == "'structures[0].schema' has 'pattern' that has nested quantifiers (a repeated group that is itself a "
        "repetition)"
    )
    assert structural_tag_problem({"type": "structural_tag"}) == (
        "of type structural_tag needs 'format' (or the legacy 'structures' and 'triggers')"
    )
    assert structural_tag_problem({**legacy, "triggers": ["<f\x00"]}) == "must not hold a NUL character (\\u0000)"
    assert structural_tag_problem({**legacy, "x\x00": 1}) == "must not hold a NUL character (\\u0000)"


def test_a_refused_structural_tag_is_a_400_naming_response_format() -> None:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "response_format": _tag(_repeat(0, -1, CONST)),
    }
    with pytest.raises(OpenAIError) as err:
        check_fields(body, CHAT_FIELDS, ("messages",))
    assert err.value.status == 400
    assert err.value.body() == {
        "error": {
            "message": f"Invalid value for 'response_format': {NO_END}",
            "type": "invalid_request_error",
            "param": "response_format",
            "code": "invalid_request",
        }
    }


TOKENS = "must be an array of token ids (integers from 0 to 2147483647) or non-empty token strings"
TAG = {"begin": "<b>", "content": CONST, "end": "</b>"}
TT = {"trigger_tokens": [5], "tags": [{"begin": {"type": "token", "token": 5}, "content": CONST, "end": "</b>"}]}


@pytest.mark.parametrize(
    ("fmt", "problem"),
    [
        # token ids from 0 to 2**31 - 1, or non-empty token strings
        ({"type": "token", "token": 0}, None),
        ({"type": "token", "token": 2147483647}, None),
        ({"type": "token", "token": "<eos>"}, None),
        (
            {"type": "token", "token": 2147483648},
            "'format.token' must be a token id (an integer from 0 to 2147483647) or a non-empty token string",
        ),
        # budgets: null or 0 to 2**31 - 1; whitespace counts: null or 1 to 2**31 - 1
        ({"type": "any_text", "max_tokens": 0, "max_chars": 2147483647}, None),
        ({"type": "any_text", "max_tokens": None, "max_chars": None}, None),
        (
            {"type": "any_text", "max_chars": -1},
            "'format.max_chars' must be null or an integer from 0 to 2147483647",
        ),
        (
            {"type": "any_text", "max_tokens": 2147483648},
            "'format.max_tokens' must be null or an integer from 0 to 2147483647",
        ),
        ({"type": "json_schema", "json_schema": {}, "max_whitespace_cnt": 1}, None),
        ({"type": "json_schema", "json_schema": {}, "max_whitespace_cnt": None}, None),
        ({"type": "any_tokens", "exclude_tokens": [-1]}, f"'format.exclude_tokens' {TOKENS}"),
        (
            {"type": "any_tokens", "max_tokens": -1},
            "'format.max_tokens' must be null or an integer from 0 to 2147483647",
        ),
        # each optional field of each format is checked
        ({"type": "qwen_xml_parameter"}, "'format' of type qwen_xml_parameter needs 'json_schema'"),
        ({"type": "qwen_xml_parameter", "json_schema": {}, "any_order": "yes"}, "'format.any_order' must be a boolean"),
        (
            {"type": "qwen_xml_parameter", "json_schema": {}, "excludes": [""]},
            "'format.excludes' must be an array of non-empty strings",
        ),
        (
            {"type": "triggered_tags", "triggers": ["<b"], "tags": [TAG], "stop_after_first": 1},
            "'format.stop_after_first' must be a boolean",
        ),
        (
            {"type": "triggered_tags", "triggers": ["<b"], "tags": [TAG], "excludes": [""]},
            "'format.excludes' must be an array of non-empty strings",
        ),
        ({"type": "token_triggered_tags", "trigger_tokens": [5]}, "'format' of type token_triggered_tags needs 'tags'"),
        ({"type": "token_triggered_tags", **TT, "exclude_tokens": [-1]}, f"'format.exclude_tokens' {TOKENS}"),
        ({"type": "token_triggered_tags", **TT, "at_least_one": 1}, "'format.at_least_one' must be a boolean"),
        ({"type": "token_triggered_tags", **TT, "stop_after_first": 0}, "'format.stop_after_first' must be a boolean"),
        ({"type": "tags_with_separator", "separator": ","}, "'format' of type tags_with_separator needs 'tags'"),
        (
            {"type": "tags_with_separator", "tags": [TAG], "separator": ",", "at_least_one": "no"},
            "'format.at_least_one' must be a boolean",
        ),
        (
            {"type": "tags_with_separator", "tags": [TAG], "separator": ",", "stop_after_first": None},
            "'format.stop_after_first' must be a boolean",
        ),
        ({"type": "plus"}, "'format' of type plus needs 'content'"),
        ({"type": "dispatch", "rules": [["<b>", CONST]], "loop": "x"}, "'format.loop' must be a boolean"),
        ({"type": "token_dispatch", "rules": [[5, CONST]], "loop": 1}, "'format.loop' must be a boolean"),
        (
            {"type": "token_dispatch", "rules": [[5, CONST]], "exclude_tokens": [""]},
            f"'format.exclude_tokens' {TOKENS}",
        ),
        # the formats inside a token_dispatch's rules are checked too
        (
            {"type": "token_dispatch", "rules": [[5, {"type": "regex", "pattern": "(a+)+"}]]},
            "'format.rules[0][1].pattern' has nested quantifiers (a repeated group that is itself a repetition)",
        ),
        # rules are [key, format] pairs
        (
            {"type": "dispatch", "rules": [["<b>", "x"]]},
            "'format.rules' must be a non-empty array of [pattern, format] pairs",
        ),
        (
            {"type": "dispatch", "rules": [{"a": "<b>", "b": CONST}]},
            "'format.rules' must be a non-empty array of [pattern, format] pairs",
        ),
        # triggers: a non-empty array
        (
            {"type": "triggered_tags", "triggers": [], "tags": [TAG]},
            "'format.triggers' must be a non-empty array of non-empty strings",
        ),
        # a tag's begin and end
        (
            {"type": "triggered_tags", "triggers": ["<b"], "tags": [{**TAG, "begin": 5}]},
            "'format.tags[0].begin' must be a string or a token format",
        ),
        (
            {"type": "tag", **TAG, "begin": {"type": "x", "token": 5}},
            "'format.begin' must be a string or a token format",
        ),
        (
            {"type": "tag", **TAG, "begin": {"type": "token", "token": -1}},
            "'format.begin' must be a string or a token format",
        ),
        ({"type": "tag", **TAG, "begin": {"token": "<b>"}}, None),
        (
            {"type": "tag", **TAG, "end": {"value": "</b>"}},
            "'format.end' must be a string, a non-empty array of strings or a token format",
        ),
        (
            {"type": "tag", **TAG, "end": ["</b>", 1]},
            "'format.end' must be a string, a non-empty array of strings or a token format",
        ),
        ({"type": "tag", **TAG, "end": ["</b>", "</c>"]}, None),
        # repeat: a max of true is no count; an optional copy is one copy
        (
            {"type": "repeat", "min": 0, "max": True, "content": CONST},
            "'format.max' must be -1 (unbounded) or an integer from 0 to 1000",
        ),
        (_repeat(0, 1, _repeat(0, 1000, CONST)), None),
        (_repeat(0, 1000, _repeat(0, 1, CONST)), None),
        (
            {"type": "any_text", "max_tokens": True},
            "'format.max_tokens' must be null or an integer from 0 to 2147483647",
        ),
    ],
)
def test_field_edges(fmt: dict[str, Any], problem: str | None) -> None:
    assert structural_tag_problem({"type": "structural_tag", "format": fmt}) == problem


def test_structural_tag_formats_walks_in_document_order() -> None:
    token = {"type": "token", "token": 5}
    end = {"type": "token", "token": 6}
    tag = {"type": "tag", "begin": token, "content": ANY, "end": end}
    rf = {"type": "structural_tag", "format": {"type": "sequence", "elements": [CONST, tag]}}
    assert structural_tag_problem(rf) is None
    assert [(p, k) for p, k, _ in structural_tag_formats(rf)] == [
        ("format", "sequence"),
        ("format.elements[0]", "const_string"),
        ("format.elements[1]", "tag"),
        ("format.elements[1].begin", "token"),
        ("format.elements[1].end", "token"),
        ("format.elements[1].content", "any_text"),
    ]
    nodes = [n for _, _, n in structural_tag_formats(rf)]
    assert nodes[3] is token and nodes[4] is end and nodes[5] is ANY
