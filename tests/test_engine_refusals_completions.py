"""``check_engine_refusals(body, engines, "completions")`` holds every refusal of a completions body
that kvgate makes for the engines (gateway/admission/engine_refusals.py), as it does for chat and
Responses: ``best_of`` below ``n`` for an ``openai`` upstream and the ``response_format`` checks (a
JSON format beside the ``json_schema`` extension, then chat's refusals of it) now sit there beside
the sampling, ``stop`` and bundled-backend ones, in the order the route applied them. The exact
error bodies; through the whole gateway: tests/test_engine_nulls_and_false_refusals.py."""

from __future__ import annotations

from typing import Any

import pytest

from config.errors import OpenAIError
from gateway.admission.engine_refusals import check_engine_refusals
from tests.test_engine_refusals_sweep import NO_SCHEMA, _deep, _too_deep, _two_constraints
from tests.test_hostile_routes import _invalid
from tests.test_hostile_routes_round4 import _unsupported

JSON_OBJECT = {"type": "json_object"}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
NO_SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "x"}}
STRICT_ONE = {"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "strict": 1}}

BEST_OF = _invalid("Invalid value for 'best_of': must be >= 'n'", "best_of")
BEST_OF_21 = _invalid(
    "Invalid value for 'best_of': must be <= 20 (the engines serving this model refuse more)", "best_of"
)
STRICT = _invalid("'response_format.json_schema.strict' must be a boolean.", "response_format.json_schema.strict")
WITH_JSON_SCHEMA = _invalid(
    "'response_format' and 'json_schema' cannot both be set: the engines serving this model apply one output "
    "constraint per request.",
    "json_schema",
)
TOP_P = _invalid("Invalid value for 'top_p': must be > 0 and <= 1 (the engines serving this model refuse 0)", "top_p")


def _error(body: dict[str, Any], engines: str) -> dict[str, Any] | None:
    """The error body ``check_engine_refusals`` raises for a completions ``body`` on ``engines``
    (``+``-joined), else ``None``."""
    try:
        check_engine_refusals(body, frozenset(engines.split("+")), "completions")
    except OpenAIError as e:
        assert e.status == 400
        return e.body()["error"]
    return None


REFUSED: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    ("openai", {"n": 3, "best_of": 2}, BEST_OF),
    ("openai+vllm", {"n": 3, "best_of": 2}, BEST_OF),
    # OpenAI's API reference: best_of at most 20; 21 is its 400 after admission otherwise
    ("openai", {"best_of": 21}, BEST_OF_21),
    ("openai+sglang", {"n": 2, "best_of": 21}, BEST_OF_21),
    ("sglang", {"response_format": JSON_SCHEMA, "json_schema": '{"type": "object"}'}, WITH_JSON_SCHEMA),
    ("sglang", {"response_format": JSON_OBJECT, "json_schema": '{"type": "object"}'}, WITH_JSON_SCHEMA),
    ("vllm", {"response_format": NO_SCHEMA_FORMAT}, NO_SCHEMA),
    ("sglang", {"response_format": NO_SCHEMA_FORMAT}, NO_SCHEMA),
    ("sglang", {"response_format": STRICT_ONE}, STRICT),
    ("sglang", {"response_format": JSON_OBJECT, "regex": "a+"}, _two_constraints("response_format", "regex")),
    ("sglang", {"response_format": JSON_SCHEMA, "ebnf": "root ::= 'a'"}, _two_constraints("response_format", "ebnf")),
    (
        "vllm",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": _deep(64)}}},
        _too_deep("response_format.json_schema.schema"),
    ),
]


@pytest.mark.parametrize(
    ("engines", "body", "error"), REFUSED, ids=[f"{e}-{err['param']}-{i}" for i, (e, _, err) in enumerate(REFUSED)]
)
def test_completions_refusals_are_check_engine_refusals(engines, body, error):
    assert _error(body, engines) == error


ORDER: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    # the bundled backend's own refusals come before OpenAI's best_of rule
    ("openai+kvgate", {"n": 3, "best_of": 2}, _unsupported("n")),
    # the sampling checks before the response_format ones
    ("sglang", {"top_p": 0, "response_format": NO_SCHEMA_FORMAT}, TOP_P),
    # the json_schema pair before chat's refusals of the format
    ("sglang", {"response_format": NO_SCHEMA_FORMAT, "json_schema": '{"type": "object"}'}, WITH_JSON_SCHEMA),
    # chat's order: the format's own shape before a second constraint
    ("sglang", {"response_format": STRICT_ONE, "regex": "a+"}, STRICT),
]


@pytest.mark.parametrize(
    ("engines", "body", "error"), ORDER, ids=[f"{e}-{err['param']}-{i}" for i, (e, _, err) in enumerate(ORDER)]
)
def test_completions_refusals_keep_the_route_order(engines, body, error):
    assert _error(body, engines) == error


TAKEN: list[tuple[str, dict[str, Any]]] = [
    # neither vLLM nor SGLang reads best_of: both generate n
    ("vllm", {"n": 3, "best_of": 2}),
    ("sglang", {"n": 3, "best_of": 2}),
    ("openai", {"n": 2, "best_of": 2}),
    ("openai", {"best_of": 20}),
    ("vllm+sglang", {"best_of": 128}),
    ("sglang", {"response_format": JSON_OBJECT}),
    ("vllm+sglang", {"response_format": JSON_SCHEMA}),
    ("sglang", {"response_format": {"type": "text"}, "regex": "a+"}),
    ("vllm", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": _deep(63)}}}),
    # what the format checks read of a completions body: response_format, regex, ebnf (no tool_choice)
    ("sglang", {"response_format": JSON_OBJECT, "tool_choice": "required"}),
]


@pytest.mark.parametrize(("engines", "body"), TAKEN, ids=[f"{e}-{i}" for i, (e, _) in enumerate(TAKEN)])
def test_completions_bodies_the_engines_take_pass(engines, body):
    assert _error(body, engines) is None


def test_the_completions_checks_stay_on_completions():
    """``best_of`` and the ``json_schema`` pair are completions fields: chat and Responses bodies
    that hold them are not refused for them."""
    for route in ("chat", "responses"):
        check_engine_refusals({"n": 3, "best_of": 2}, frozenset({"openai", "vllm"}), route)
        check_engine_refusals(
            {"response_format": JSON_OBJECT, "json_schema": '{"type": "object"}'}, frozenset({"sglang"}), route
        )
