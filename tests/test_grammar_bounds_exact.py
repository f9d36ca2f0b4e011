"""The grammar bounds at their edges (gateway/admission/grammar_bounds.py): counted repetition
admitted up to 1,000 and refused one above, anywhere in a pattern (alternatives, lookarounds,
lower bounds of open counts) and as the product of nested counts; the first characters that
alternatives under a quantifier can begin with (literals, ranges, the ``\\d`` ``\\s`` ``\\w``
categories, negated sets, parts that may match nothing); the EBNF heuristic's edges; every JSON
Schema count keyword, the path the problem names, ``pattern`` and ``patternProperties``; and a
refused grammar as the exact OpenAI-shaped 400 naming its field."""

from __future__ import annotations

from typing import Any

import pytest

from config.errors import OpenAIError
from gateway.admission.checks import CHAT_FIELDS, check_fields
from gateway.admission.grammar_bounds import ebnf_problem, regex_problem, schema_problem

COUNTED = "has counted repetition above 1,000"
PRODUCT = "has nested counted repetition above 1,000 in all"
NESTED = "has nested quantifiers (a repeated group that is itself a repetition)"
OVERLAP = "has overlapping alternatives under a quantifier (they can begin alike)"
EMPTY = "has an alternative that may match nothing under a quantifier"
UNREADABLE = "must be a regular expression kvgate can read"


@pytest.mark.parametrize(
    ("pattern", "problem"),
    [
        # a count anywhere: inside an alternative, a lookahead, a lookbehind, a group
        ("x(a|b{1001})", COUNTED),
        ("x(a|b{1000})", None),
        ("(?=a{1001})b", COUNTED),
        ("(?!a{1001})b", COUNTED),
        ("(?=a{1000})b", None),
        ("(?:a{1001})", COUNTED),
        # an open count's lower bound is a count too
        ("a{1001,}", COUNTED),
        ("a{1000,}", None),
        ("a{0,1000}", None),
        ("a*?b{1001}?", COUNTED),
        # the product of nested fixed counts; an open count counts its lower bound (at least 1)
        ("(a{2}){500}", None),
        ("(a{2}){501}", PRODUCT),
        ("((a{10}){10}){10}", None),
        ("((a{10}){10}){11}", PRODUCT),
        ("(a{1000})*", None),
        ("(a{1000})+", None),
        ("(a{500}){2,}", None),
        ("(a{500}){3,}", PRODUCT),
        ("(?=(a{2}){501})b", PRODUCT),
        ("x(a|(b{2}){501})", PRODUCT),
        # possessive and atomic counts are counts too
        ("a{1001}+", COUNTED),
        ("(?>a{1001})", COUNTED),
        # an unbounded repeat holds at least one copy of its body, an optional one at most one
        ("((a{2}){501})*", PRODUCT),
        ("(a{501})*", None),
        ("(a{600})?", None),
        ("x(a{600}){0,1}", None),
        ("a{99999999999999999999}", UNREADABLE),
    ],
)
def test_counted_repetition(pattern: str, problem: str | None) -> None:
    assert regex_problem(pattern) == problem


@pytest.mark.parametrize(
    ("pattern", "problem"),
    [
        # a repetition exposed beside parts that may match nothing, or inside an alternative
        ("(a?b*)*", NESTED),
        ("(^a+)*", NESTED),
        ("((?:xa)+|yb)*", NESTED),
        ("(?=a)(a+)*", NESTED),
        ("((a+))+", NESTED),
        ("(a{2,3})*", NESTED),
        ("(a{3})*", None),  # a fixed count is one way to match
        ("(a+b)*", None),
        ("(ab+)*", None),
        ("(a+)", None),  # not repeated
        ("(a+){1}", None),  # repeated once
        ("(a+)?", None),
        ("(a+){2}", NESTED),
        ("(a{1,2})*", NESTED),  # a run of a's splits into ones and twos many ways
        ("(a?)*", None),  # each pass takes at most one character: a run splits one way
        ("((?:a+){2})*", NESTED),
        ("((?:a+){1})*", NESTED),
        # parts that may match nothing: an alternative that may, a group, a lookaround, a
        # backreference to a group that may be empty, a conditional with empty branches, a count
        # of something that may match nothing
        ("((?:x|y?)a+)*", NESTED),
        ("((b?)a+)*", NESTED),
        ("((b)a+)*", None),
        ("((?=a)b+)*", NESTED),
        ("((?!a)b+)*", NESTED),
        ("(a?)(\\1b+)*", NESTED),
        ("(a)?((?(1)|)b+)*", NESTED),
        ("((?:a?){2}b+)*", NESTED),
        ("()*", None),
    ],
)
def test_nested_quantifiers(pattern: str, problem: str | None) -> None:
    assert regex_problem(pattern) == problem


@pytest.mark.parametrize(
    ("pattern", "problem"),
    [
        # categories: \d is 0-9, \s is \t-\r and space, \w is 0-9 A-Z _ a-z and non-ASCII
        (r"(\dx|1y)*", OVERLAP),
        (r"(\dx|ay)*", None),
        (r"(\sx|\ty)*", OVERLAP),
        (r"(\sx| y)*", OVERLAP),
        (r"(\sx|ay)*", None),
        (r"(\wx|_y)*", OVERLAP),
        (r"(\wx|Zy)*", OVERLAP),
        (r"(\wx|-y)*", None),
        (r"(\wx|\u00e9y)*", OVERLAP),
        # each range's ends, and one past them
        (r"(\dx|0y)*", OVERLAP),
        (r"(\dx|9y)*", OVERLAP),
        (r"(\dx|/y)*", None),
        (r"(\dx|:y)*", None),
        (r"(\sx|\ry)*", OVERLAP),
        (r"(\sx|\x08y)*", None),
        (r"(\sx|\x0ey)*", None),
        (r"(\sx|!y)*", None),
        (r"(\wx|0y)*", OVERLAP),
        (r"(\wx|5y)*", OVERLAP),
        (r"(\wx|9y)*", OVERLAP),
        (r"(\wx|/y)*", None),
        (r"(\wx|:y)*", None),
        (r"(\wx|Ay)*", OVERLAP),
        (r"(\wx|@y)*", None),
        (r"(\wx|\[y)*", None),
        (r"(\wx|\^y)*", None),
        (r"(\wx|`y)*", None),
        (r"(\wx|ay)*", OVERLAP),
        (r"(\wx|my)*", OVERLAP),
        (r"(\wx|zy)*", OVERLAP),
        (r"(\wx|\{y)*", None),
        (r"(\wx|\x7fy)*", None),
        (r"(\wx|\x80y)*", OVERLAP),
        (r"(\wx|\U0010ffffy)*", OVERLAP),
        ("(.x|\x00y)*", OVERLAP),
        ("(.x|\U0010ffffy)*", OVERLAP),
        ("([^ab]x|cy)*", OVERLAP),
        ("([ab]x|by)*", OVERLAP),
        # negated categories and sets, and the dot, can begin with anything
        (r"(\Wx|-y)*", OVERLAP),
        (r"(\Dx|ay)*", OVERLAP),
        ("([^a]x|by)*", OVERLAP),
        (".x|.y", None),  # not repeated
        ("(.x|ay)*", OVERLAP),
        # ranges overlap at both ends, not one past
        ("([b-d]x|by)*", OVERLAP),
        ("([b-d]x|dy)*", OVERLAP),
        ("([b-d]x|ay)*", None),
        ("([b-d]x|ey)*", None),
        ("([b-d]x|[e-g]y)*", None),
        ("([b-d]x|[a-b]y)*", OVERLAP),
        # parts that may match nothing let the next part begin the alternative too
        ("(a?bx|by)*", OVERLAP),
        ("(a?bx|cy)*", None),
        ("(abx|by)*", None),
        ("(a*x|ay)*", OVERLAP),
        ("(a+x|ay)*", OVERLAP),
        ("((a)x|ay)*", OVERLAP),
        ("((?>a)x|ay)*", OVERLAP),
        ("(^ax|ay)*", OVERLAP),
        ("(\\bax|by)*", None),
        # the third alternative against the first and the second
        ("(ax|by|cz)*", None),
        ("(ax|by|bz1)*", OVERLAP),
        # through groups around the alternatives
        ("((xa|ya|xb))*", OVERLAP),
        ("(((ax|by)))*", None),
        # alternatives that may match nothing
        ("(ab|c?)*", EMPTY),
        ("(a?|b?)*", OVERLAP),
        ("(ab|c)*d", None),
        ("(ab|cd){1}", None),
        ("(ab|ad|e)", None),
    ],
)
def test_alternatives_under_a_quantifier(pattern: str, problem: str | None) -> None:
    assert regex_problem(pattern) == problem


@pytest.mark.parametrize("pattern", ["(", "a{2,1}", "[z-a]", "(?P<x>a)(?P<x>b)", "a**"])
def test_unreadable_patterns(pattern: str) -> None:
    assert regex_problem(pattern) == UNREADABLE


def test_deep_nesting_is_refused_not_raised() -> None:
    # too deep for the parser itself; readable, but too deep to check under a quantifier
    assert regex_problem("(" * 500 + "a" + ")" * 500) == UNREADABLE
    assert regex_problem("(" * 400 + "a" + ")" * 400 + "*") == "is nested too deeply"


@pytest.mark.parametrize(
    ("grammar", "problem"),
    [
        ('root ::= "a"{2,1001}', COUNTED),
        ('root ::= "a"{1001,}', COUNTED),
        ('root ::= "a"{ 1001 }', COUNTED),
        ('root ::= "a"{1000,}', None),
        ('root ::= "a"{1000,1000}', None),
        ('root ::= "a"{0,}', None),
        # a quantified group whose body is one quantified element; "?" does not repeat
        ('root ::= ("a"*)*', NESTED),
        ('root ::= ("a"+){2}', NESTED),
        ('root ::= ("a"+)?', None),
        ('root ::= ("a"+)? "b"', None),
        ('root ::= ("a"+)', None),
        ('root ::= ("a"+ "b")*', None),
        ('root ::= ("a" "b"+)*', None),
        ('root ::= (" "+)*', NESTED),
        ('root ::= ("a"+)+ "b"', NESTED),
        ("root ::= ()*", None),
        ('root ::= "a" )', None),
        # alternatives compared by their first two characters (a literal's first character)
        ('root ::= ("ab" | "ac")+', OVERLAP),
        ('root ::= ("a" | "b" | "a")*', OVERLAP),
        ('root ::= ("a" | "b" | "c")*', None),
        ('root ::= (" a" | " b")*', OVERLAP),
        ('root ::= ("a"b | "a"c)*', OVERLAP),
        ("root ::= (x | y)*", None),
        ('root ::= ("a" | )*', EMPTY),
        ('root ::= ("x" | "x")', None),
        ('root ::= (("a" | "a")+)', OVERLAP),
        # parentheses and braces inside literals are text
        ('root ::= "(" ("a" | "b")* ")"', None),
        ('root ::= "((a|a)*" "b"', None),
        ("root ::= '{2000}' \"a\"", None),
        ('root ::= "\\"{2000}"', None),
    ],
)
def test_ebnf_problem_edges(grammar: str, problem: str | None) -> None:
    assert ebnf_problem(grammar) == problem


COUNT_KEYWORDS = [
    "minItems",
    "maxItems",
    "minLength",
    "maxLength",
    "minProperties",
    "maxProperties",
    "minContains",
    "maxContains",
]


@pytest.mark.parametrize("keyword", COUNT_KEYWORDS)
def test_every_schema_count_keyword(keyword: str) -> None:
    assert schema_problem({keyword: 1000}) is None
    assert schema_problem({keyword: 1001}) == f"has '{keyword}' 1001, above 1,000"
    assert schema_problem({keyword: 1000.5}) == f"has '{keyword}' 1000.5, above 1,000"
    assert schema_problem({"items": {keyword: 5000}}) == f"has 'items.{keyword}' 5000, above 1,000"


def test_schema_paths_patterns_and_what_is_not_a_count() -> None:
    assert schema_problem({"anyOf": [{}, {"maxItems": 1001}]}) == "has 'anyOf[1].maxItems' 1001, above 1,000"
    assert schema_problem([{"minLength": 1001}]) == "has '[0].minLength' 1001, above 1,000"
    assert schema_problem({"properties": {"s": {"pattern": "(a+)+"}}}) == f"has 'properties.s.pattern' that {NESTED}"
    assert schema_problem({"pattern": "a{1001}"}) == f"has 'pattern' that {COUNTED}"
    assert schema_problem({"pattern": "("}) == f"has 'pattern' that {UNREADABLE}"
    assert schema_problem({"pattern": "^[a-z]{1,1000}$"}) is None
    assert (
        schema_problem({"items": {"patternProperties": {"^ok$": {}, "(a|a)*": {}}}})
        == f"has a 'items.patternProperties' key that {OVERLAP}"
    )
    assert (
        schema_problem({"patternProperties": {"^x$": {"maxLength": 2000}}})
        == "has 'patternProperties.^x$.maxLength' 2000, above 1,000"
    )
    # names and values that are not counts or patterns
    assert schema_problem({"properties": {"pattern": {"type": "string"}, "maxItems": {}}}) is None
    assert schema_problem({"maxLength": "5000", "minItems": None, "maxItems": [5000], "pattern": 5}) is None
    assert schema_problem({"const": {"maxItems": 1000}, "enum": [{"minItems": 1000}]}) is None
    assert schema_problem(True) is None
    assert schema_problem({"default": "(a+)+"}) is None
    assert schema_problem({"maximum": 5000, "minimum": 2000, "multipleOf": 1001, "maxDecimal": 9999}) is None
    assert schema_problem({"properties": {"(a+)+": {}}}) is None  # property names are names, not patterns
    assert schema_problem({"patternProperties": "(a"}) is None


def test_a_refused_grammar_is_a_400_naming_its_field() -> None:
    body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "regex": "x(a|b{1001})"}
    with pytest.raises(OpenAIError) as err:
        check_fields(body, CHAT_FIELDS, ("messages",))
    assert err.value.status == 400
    assert err.value.body() == {
        "error": {
            "message": f"Invalid value for 'regex': {COUNTED}",
            "type": "invalid_request_error",
            "param": "regex",
            "code": "invalid_request",
        }
    }
