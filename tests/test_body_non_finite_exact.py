"""Exact answers of :func:`gateway.admission.body.parse_json_body` for bodies that are not strict
JSON because of a non-finite number (``NaN``, ``Infinity``, a number beyond a double), and for
the look-alikes that must not be named as one.

A top-level field holding such a value is named in a 400 ``Invalid value for '<field>'`` (its
``param``); anything else (nested, another syntax error, a top level that is no object) is the
generic parse error with ``param`` ``None``. Each case pins the whole OpenAI error body, so a
change to which field is named, or to the words, shows.
"""

from __future__ import annotations

import pytest

from config.errors import OpenAIError
from gateway.admission.body import parse_json_body
from tests.test_gate_bounds_exact import FINITE

NOT_UTF8 = "The request body is not valid UTF-8 JSON."


def error_body(raw: bytes) -> tuple[int, dict]:
    with pytest.raises(OpenAIError) as err:
        parse_json_body(raw)
    return err.value.status, err.value.body()


def named(field: str) -> tuple[int, dict]:
    return 400, {
        "error": {"message": FINITE.format(field), "type": "invalid_request_error", "param": field, "code": "invalid_request"}
    }


def generic(orjson_message: str) -> tuple[int, dict]:
    text = f"We could not parse the JSON body of your request ({orjson_message})."
    return 400, {"error": {"message": text, "type": "invalid_request_error", "param": None, "code": "invalid_request"}}


@pytest.mark.parametrize(
    "raw,field",
    [
        (b'{"t": -1e999}', "t"),  # orjson stops at the sign itself
        (b'{"t": 1E+999, "n": 1}', "t"),  # an exponent with its plus sign
        (b'{"t": 1' + b"0" * 400 + b'e-5}', "t"),  # beyond a double although the exponent is negative
        (b'{"t": inf}', "t"),  # the short form, as the pattern takes it
        (b'{"n": 1, "t": -INF}', "t"),
        (b'{"a": "", "t": NaN}', "t"),  # an empty string is no marker
        (b'{"a": "kvgate:non-finite", "t": NaN}', "t"),  # nor the marker's words
    ],
)
def test_a_top_level_non_finite_number_is_named_in_every_spelling(raw, field):
    assert error_body(raw) == named(field)


@pytest.mark.parametrize(
    "raw,orjson_message",
    [
        (b'{"a": 01}', "number with leading zero is not allowed: line 1 column 7 (char 6)"),
        (b'{"a": --Infinity}', "no digit after sign: line 1 column 8 (char 7)"),
        (b'{"a": tNaN}', "invalid literal, expected 'true': line 1 column 7 (char 6)"),
        (b'{"a": NaN,}', "unexpected character, expected a JSON value: line 1 column 7 (char 6)"),
        (b"NaN", "unexpected character, expected a JSON value: line 1 column 1 (char 0)"),
        (b"[NaN]", "unexpected character, expected a JSON value: line 1 column 2 (char 1)"),
    ],
)
def test_a_syntax_error_that_only_looks_non_finite_is_the_generic_parse_error(raw, orjson_message):
    """A malformed number, a literal that does not start where orjson stopped, a body still
    broken once the value is replaced, a top level that is no object: no field is named."""
    assert error_body(raw) == generic(orjson_message)


def test_a_byte_order_mark_is_answered_as_not_utf8():
    """orjson's BOM message names UTF-8 but no surrogate: it is still the UTF-8 answer."""
    assert error_body(b'\xef\xbb\xbf{"a": 1}') == (
        400,
        {"error": {"message": NOT_UTF8, "type": "invalid_request_error", "param": None, "code": "invalid_request"}},
    )


def test_a_string_equal_to_the_internal_marker_is_not_named_for_another_fields_nan():
    """A client's own string that spells the marker the value is replaced with must not be taken
    for it: the field holding the NaN is ``t``, not ``a``. The marker was a fixed string (this
    one), and ``a`` was named; it is now drawn for each call, so no client can send it."""
    assert error_body(b'{"a": "\\u0000kvgate:non-finite", "t": NaN}') == named("t")
