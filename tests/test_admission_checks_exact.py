"""The field tables of /v1/chat/completions and /v1/completions and their value checks
(gateway/admission/checks.py, gateway/admission/value_checks.py) at their documented edges:
accepted at each bound, refused one past it with the exact 400 ``invalid_request_error`` naming
the field. The limits are the OpenAI API reference's (temperature 0..2, top_p 0..1, penalties
-2..2, n 1..128, top_logprobs 0..20, completions logprobs 0..5, seed an int64, logit_bias values
-100..100 and at most 300 entries, metadata 16 keys of <= 64 characters and values of <= 512)
or the engines' and the module's own, as cited there (stop strings, stop_token_ids, grammar
sizes, top_k an int32, min_p 0..1, repetition_penalty in (0, 2])."""

from __future__ import annotations

from typing import Any

import pytest

from config.errors import OpenAIError
from gateway.admission.checks import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    EXTENSION_FIELDS,
    OPENAI_FIELDS,
    check_fields,
    check_stream_options,
    drop_nulls,
    json_size_problem,
    metadata_problem,
    stop_problem,
)
from gateway.admission.value_checks import (
    anything,
    array,
    boolean,
    enum,
    int_in,
    is_int,
    is_num,
    num_in,
    obj,
    one_of,
    str_or_obj,
    string,
)

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
INT32_MAX = 2**31 - 1
SAY_HI = [{"role": "user", "content": "hi"}]


def chat_ok(**kw: Any) -> None:
    check_fields({"model": "m", "messages": SAY_HI, **kw}, CHAT_FIELDS, ("messages",))


def comp_ok(**kw: Any) -> None:
    check_fields({"model": "m", "prompt": "hi", **kw}, COMPLETION_FIELDS, ("prompt",))


def refusal(fields: dict, body: dict[str, Any], required: tuple[str, ...]) -> dict[str, Any]:
    with pytest.raises(OpenAIError) as err:
        check_fields(body, fields, required)
    assert err.value.status == 400
    return err.value.body()["error"]


def chat_refused(field: str, value: Any) -> str:
    """The 400's message for a chat body with ``field: value``; asserts type, param and code."""
    e = refusal(CHAT_FIELDS, {"model": "m", "messages": SAY_HI, field: value}, ("messages",))
    assert (e["type"], e["param"], e["code"]) == ("invalid_request_error", field, "invalid_request")
    return e["message"]


def comp_refused(field: str, value: Any) -> str:
    e = refusal(COMPLETION_FIELDS, {"model": "m", "prompt": "hi", field: value}, ("prompt",))
    assert (e["type"], e["param"], e["code"]) == ("invalid_request_error", field, "invalid_request")
    return e["message"]


def bad(field: str, problem: str) -> str:
    return f"Invalid value for '{field}': {problem}"


# ---------------------------------------------------------------- numeric ranges (both routes)
#: field, lowest accepted, highest accepted, one past below, one past above, the problems
RANGES = [
    ("temperature", 0, 2, -1e-9, 2 + 1e-9, "must be >= 0", "must be <= 2"),
    ("top_p", 0, 1, -1e-9, 1 + 1e-9, "must be >= 0", "must be <= 1"),
    ("presence_penalty", -2, 2, -2 - 1e-9, 2 + 1e-9, "must be >= -2", "must be <= 2"),
    ("frequency_penalty", -2.0, 2.0, -2.000001, 2.000001, "must be >= -2", "must be <= 2"),
    ("n", 1, 128, 0, 129, "must be >= 1", "must be <= 128"),
    ("max_tokens", 1, INT64_MAX, 0, INT64_MAX + 1, "must be >= 1", f"must be <= {INT64_MAX}"),
    ("seed", INT64_MIN, INT64_MAX, INT64_MIN - 1, INT64_MAX + 1, f"must be >= {INT64_MIN}", f"must be <= {INT64_MAX}"),
    ("top_k", -1, INT32_MAX, -2, INT32_MAX + 1, "must be >= -1", f"must be <= {INT32_MAX}"),
    ("min_p", 0, 1, -1e-9, 1 + 1e-9, "must be >= 0", "must be <= 1"),
    ("min_tokens", 0, INT64_MAX, -1, INT64_MAX + 1, "must be >= 0", f"must be <= {INT64_MAX}"),
]
CHAT_ONLY_RANGES = [
    ("max_completion_tokens", 1, INT64_MAX, 0, INT64_MAX + 1, "must be >= 1", f"must be <= {INT64_MAX}"),
    ("top_logprobs", 0, 20, -1, 21, "must be >= 0", "must be <= 20"),
]
COMP_ONLY_RANGES = [
    ("logprobs", 0, 5, -1, 6, "must be >= 0", "must be <= 5"),
    ("best_of", 1, 128, 0, 129, "must be >= 1", "must be <= 128"),
]


@pytest.mark.parametrize("field,lo,hi,below,above,p_lo,p_hi", RANGES + CHAT_ONLY_RANGES)
def test_chat_range_accepted_at_both_bounds_and_refused_one_past(field, lo, hi, below, above, p_lo, p_hi):
    chat_ok(**{field: lo})
    chat_ok(**{field: hi})
    assert chat_refused(field, below) == bad(field, p_lo)
    assert chat_refused(field, above) == bad(field, p_hi)


@pytest.mark.parametrize("field,lo,hi,below,above,p_lo,p_hi", RANGES + COMP_ONLY_RANGES)
def test_completions_range_accepted_at_both_bounds_and_refused_one_past(field, lo, hi, below, above, p_lo, p_hi):
    comp_ok(**{field: lo})
    comp_ok(**{field: hi})
    assert comp_refused(field, below) == bad(field, p_lo)
    assert comp_refused(field, above) == bad(field, p_hi)


@pytest.mark.parametrize("field", ["temperature", "top_p", "presence_penalty", "frequency_penalty", "min_p"])
def test_a_number_field_takes_ints_and_floats_but_not_bools_or_strings(field):
    chat_ok(**{field: 0.5})
    chat_ok(**{field: 1})
    assert chat_refused(field, True) == bad(field, "must be a number")
    assert chat_refused(field, "1") == bad(field, "must be a number")


@pytest.mark.parametrize("field", ["n", "max_tokens", "seed", "top_k", "min_tokens", "top_logprobs"])
def test_an_integer_field_refuses_floats_and_bools(field):
    assert chat_refused(field, 1.5) == bad(field, "must be an integer")
    assert chat_refused(field, 2.0) == bad(field, "must be an integer")
    assert chat_refused(field, False) == bad(field, "must be an integer")


@pytest.mark.parametrize(
    "field,value,problem",
    [
        ("n", 1e20, "must be an integer from 1 to 128"),
        ("seed", 1e19, f"must be an integer from {INT64_MIN} to {INT64_MAX}"),
        ("seed", -1e19, f"must be an integer from {INT64_MIN} to {INT64_MAX}"),
        ("n", 129.5, "must be an integer"),  # out of range but not integral
        ("n", 0.0, "must be an integer from 1 to 128"),
        ("n", 1.0, "must be an integer"),  # in range: only not an integer
        ("n", 128.0, "must be an integer"),
        ("n", 129.0, "must be an integer from 1 to 128"),
    ],
)
def test_an_integer_beyond_64_bits_read_as_a_float_is_refused_quoting_the_range(field, value, problem):
    assert chat_refused(field, value) == bad(field, problem)


def test_repetition_penalty_is_above_zero_and_at_most_two():
    """vLLM's ``SamplingParams._verify_args``: in (0, 2]."""
    for ok in (1e-9, 1, 2, 2.0):
        chat_ok(repetition_penalty=ok)
        comp_ok(repetition_penalty=ok)
    for out in (0, -1, 2 + 1e-9, 3):
        assert chat_refused("repetition_penalty", out) == bad("repetition_penalty", "must be > 0 and <= 2")
    assert chat_refused("repetition_penalty", True) == bad("repetition_penalty", "must be a number")
    assert comp_refused("repetition_penalty", "1") == bad("repetition_penalty", "must be a number")


# ---------------------------------------------------------------- value_checks directly
def test_value_checks_kinds():
    assert (is_int(3), is_int(True), is_int(3.0), is_int("3")) == (True, False, False, False)
    assert (is_num(3), is_num(3.5), is_num(False), is_num("3"), is_num(None)) == (True, True, False, False, False)
    assert (boolean(False), boolean(0)) == (None, "must be a boolean")
    assert (string(""), string(1)) == (None, "must be a string")
    assert (obj({}), obj([])) == (None, "must be an object")
    assert (array([]), array({})) == (None, "must be an array")
    assert (str_or_obj("a"), str_or_obj({}), str_or_obj([])) == (None, None, "must be a string or an object")
    assert (anything(None), anything([1])) == (None, None)


def test_open_ranges_check_only_the_bound_given():
    assert (int_in()(10**30), int_in()(-(10**30)), int_in()(1e30)) == (None, None, "must be an integer")
    assert (int_in(lo=0)(10**30), int_in(lo=0)(-1), int_in(lo=0)(1e30)) == (None, "must be >= 0", "must be an integer")
    assert (int_in(hi=0)(-(10**30)), int_in(hi=0)(1), int_in(hi=0)(-1e30)) == (
        None,
        "must be <= 0",
        "must be an integer",
    )
    assert (num_in()(-1e300), num_in(lo=1)(0.5), num_in(hi=1)(1.5)) == (None, "must be >= 1", "must be <= 1")
    assert num_in(0, 1)(0.5) is None


def test_enum_and_one_of_problems_quote_the_values():
    assert enum("a", "b")("a") is None
    assert enum("a", "b")("c") == "must be one of a, b"
    assert enum("a", "b")(["a"]) == "must be one of a, b"
    assert one_of("x", "y")("y") is None
    assert one_of("x", "y")("z") == "must be one of 'x', 'y'"


# ---------------------------------------------------------------- types of the other fields
@pytest.mark.parametrize(
    "field,value",
    [
        ("stream", True),
        ("logprobs", False),
        ("parallel_tool_calls", True),
        ("store", False),
        ("ignore_eos", True),
        ("skip_special_tokens", False),
        ("spaces_between_special_tokens", True),
        ("no_stop_trim", True),
        ("separate_reasoning", False),
        ("stream_reasoning", True),
        ("continue_final_message", False),
        ("add_generation_prompt", True),
    ],
)
def test_chat_booleans_take_a_boolean_only(field, value):
    chat_ok(**{field: value})
    assert chat_refused(field, 1) == bad(field, "must be a boolean")


@pytest.mark.parametrize("field", ["model", "user", "cache_salt", "prompt_cache_key", "safety_identifier"])
def test_chat_strings_take_a_string_only(field):
    chat_ok(**{field: "x"})
    assert chat_refused(field, 1) == bad(field, "must be a string")


@pytest.mark.parametrize("field", ["prediction", "audio", "web_search_options", "moderation"])
def test_chat_objects_take_an_object_only(field):
    chat_ok(**{field: {}})
    assert chat_refused(field, []) == bad(field, "must be an object")


@pytest.mark.parametrize("field", ["tools", "functions"])
def test_chat_arrays_take_an_array_only(field):
    chat_ok(**{field: []})
    assert chat_refused(field, {}) == bad(field, "must be an array")


def test_chat_messages_must_be_an_array_and_function_call_a_string_or_object():
    assert chat_refused("messages", "hi") == bad("messages", "must be an array")
    chat_ok(function_call="auto")
    chat_ok(function_call={"name": "f"})
    assert chat_refused("function_call", 1) == bad("function_call", "must be a string or an object")


@pytest.mark.parametrize("field,value", [("echo", True), ("ignore_eos", False), ("no_stop_trim", True)])
def test_completions_booleans_take_a_boolean_only(field, value):
    comp_ok(**{field: value})
    assert comp_refused(field, "true") == bad(field, "must be a boolean")


def test_completions_suffix_is_a_string_and_prompt_any_shape_for_the_tokenizer():
    comp_ok(suffix="")
    assert comp_refused("suffix", 1) == bad("suffix", "must be a string")
    comp_ok(prompt=[[1, 2], [3]])


@pytest.mark.parametrize(
    "field,values,problem",
    [
        (
            "reasoning_effort",
            ["none", "minimal", "low", "medium", "high", "xhigh", "max"],
            "must be one of none, minimal, low, medium, high, xhigh, max",
        ),
        ("verbosity", ["low", "medium", "high"], "must be one of low, medium, high"),
        (
            "service_tier",
            ["auto", "default", "flex", "scale", "priority", "fast"],
            "must be one of auto, default, flex, scale, priority, fast",
        ),
        ("prompt_cache_retention", ["in_memory", "24h"], "must be one of in_memory, 24h"),
    ],
)
def test_chat_enums_take_each_documented_value_and_refuse_others(field, values, problem):
    for v in values:
        chat_ok(**{field: v})
    assert chat_refused(field, "other") == bad(field, problem)
    assert chat_refused(field, 1) == bad(field, problem)


def test_modalities_is_an_array_of_text_and_audio():
    for ok in ([], ["text"], ["audio"], ["text", "audio"]):
        chat_ok(modalities=ok)
    problem = bad("modalities", "must be an array of text, audio")
    for out in (["video"], ["text", "audio", "text"], "text", "", {"text": 1}, [1]):
        assert chat_refused("modalities", out) == problem


# ---------------------------------------------------------------- metadata and logit_bias
METADATA_PROBLEM = "must be an object of at most 16 string keys (<= 64 characters) and string values (<= 512)"


def test_metadata_at_the_openai_limits_and_one_past():
    assert metadata_problem({f"k{i}": "v" for i in range(16)}) is None
    assert metadata_problem({"k" * 64: "v" * 512}) is None
    for out in ({f"k{i}": "v" for i in range(17)}, {"k" * 65: "v"}, {"k": "v" * 513}, {"k": 1}, ["k"]):
        assert metadata_problem(out) == METADATA_PROBLEM
    chat_ok(metadata={"k": "v"})
    assert chat_refused("metadata", {"k": 1}) == bad("metadata", METADATA_PROBLEM)


LOGIT_BIAS_PROBLEM = "must be an object of at most 300 token ids (as strings) mapping to numbers in [-100, 100]"


def test_logit_bias_at_the_openai_limits_and_one_past():
    chat_ok(logit_bias={str(i): 1 for i in range(300)})
    chat_ok(logit_bias={"5": -100, "6": 100, "7": 0.5, "1234567890": 1})
    comp_ok(logit_bias={"5": -100.0})
    for out in (
        {str(i): 1 for i in range(301)},
        {"5": 100.001},
        {"5": -100.001},
        {"5": True},
        {"5": "1"},
        {"²": 1},
        {"-1": 1},
        {"12345678901": 1},
        {"": 1},
        [],
    ):
        assert chat_refused("logit_bias", out) == bad("logit_bias", LOGIT_BIAS_PROBLEM)


# ---------------------------------------------------------------- stop
STOP_SHAPE = "must be a string or an array of at most 16 strings"


def test_stop_counts_and_sizes_at_their_bounds():
    assert stop_problem("x") is None
    assert stop_problem(["s"] * 16) is None
    assert stop_problem(["s"] * 17) == STOP_SHAPE
    assert stop_problem(["a", 1]) == STOP_SHAPE
    assert stop_problem({"a": 1}) == STOP_SHAPE
    assert stop_problem([]) is None
    assert stop_problem("") == "must not contain an empty string"
    assert stop_problem(["a", ""]) == "must not contain an empty string"
    # each string: 1024 UTF-8 bytes (characters or multi-byte)
    assert stop_problem("a" * 1024) is None
    assert stop_problem("é" * 512) is None
    assert stop_problem("a" * 1025) == "each stop string must be at most 1024 bytes (UTF-8)"
    assert stop_problem("é" * 512 + "a") == "each stop string must be at most 1024 bytes (UTF-8)"
    assert stop_problem("é" * 1024) == "each stop string must be at most 1024 bytes (UTF-8)"
    assert stop_problem("é" * 1025) == "each stop string must be at most 1024 bytes (UTF-8)"
    # all together: 4096 bytes
    assert stop_problem(["a" * 1024] * 4) is None
    assert stop_problem(["é" * 512] * 4) is None
    assert stop_problem(["a" * 1024] * 4 + ["b"]) == "the stop strings must be at most 4096 bytes (UTF-8) in all"
    assert stop_problem(["é" * 512] * 3 + ["é" * 511, "ab"]) is None
    assert stop_problem(["é" * 512] * 3 + ["é" * 511, "abc"]) == (
        "the stop strings must be at most 4096 bytes (UTF-8) in all"
    )
    assert chat_refused("stop", "") == bad("stop", "must not contain an empty string")
    assert comp_refused("stop", ["s"] * 17) == bad("stop", STOP_SHAPE)


def test_size_checks_count_a_lone_surrogate_as_three_bytes_and_never_raise():
    """The body parser (orjson) refuses lone surrogates before any check runs, so this is the
    checks' own contract: called directly on one, they count it as the 3 bytes its code point
    takes in UTF-8's scheme (``surrogatepass``) instead of raising ``UnicodeEncodeError``."""
    assert stop_problem("\ud800" * 341) is None  # 1,023 bytes
    assert stop_problem("\ud800" * 342) == "each stop string must be at most 1024 bytes (UTF-8)"
    grammar = EXTENSION_FIELDS["regex"]
    assert grammar("\udfff" * 10922) is None  # 32,766 bytes
    assert grammar("\udfff" * 10923) == "must be at most 32768 bytes"


# ---------------------------------------------------------------- stream_options
def test_stream_options_keys_and_values():
    for key in ("include_usage", "continuous_usage_stats", "include_obfuscation"):
        chat_ok(stream=True, stream_options={key: True})
        chat_ok(stream=True, stream_options={key: None})
        assert chat_refused("stream_options", {key: 1}) == bad("stream_options", f"'{key}' must be a boolean")
    chat_ok(stream=True, stream_options={"include_usage": False, "include_obfuscation": True})
    assert chat_refused("stream_options", {"include_usage": True, "x": True}) == bad(
        "stream_options", "unknown option 'x'"
    )
    assert comp_refused("stream_options", []) == bad("stream_options", "must be an object")


def test_check_stream_options_without_a_stream():
    body: dict[str, Any] = {"stream_options": {"include_usage": True}}
    with pytest.raises(OpenAIError) as err:
        check_stream_options(body)
    assert err.value.body() == {
        "error": {
            "message": "'stream_options' is only allowed when 'stream' is true.",
            "type": "invalid_request_error",
            "param": "stream_options",
            "code": "invalid_request",
        }
    }
    body = {"stream_options": {"include_usage": True}, "stream": False}
    with pytest.raises(OpenAIError):
        check_stream_options(body)
    for empty in ({}, {"include_usage": None}):
        body = {"stream_options": empty}
        check_stream_options(body)
        assert body == {}
    body = {"stream": True, "stream_options": {"include_usage": None, "continuous_usage_stats": True}}
    check_stream_options(body)
    assert body == {"stream": True, "stream_options": {"continuous_usage_stats": True}}
    body = {"stream": True, "stream_options": {}}
    check_stream_options(body)
    assert body == {"stream": True, "stream_options": {}}
    body = {"stream": True, "stream_options": {"include_usage": True}}
    check_stream_options(body)
    assert body == {"stream": True, "stream_options": {"include_usage": True}}
    body = {"stream": False}
    check_stream_options(body)
    assert body == {"stream": False}


# ---------------------------------------------------------------- prompt cache and tool_choice
def test_prompt_cache_options():
    chat_ok(prompt_cache_options={"mode": "implicit", "ttl": "30m"})
    chat_ok(prompt_cache_options={"mode": "explicit", "ttl": "x" * 16})
    f = "prompt_cache_options"
    assert chat_refused(f, {"mode": "other"}) == bad(f, "'mode' must be implicit or explicit")
    assert chat_refused(f, {"ttl": "x" * 17}) == bad(f, "'ttl' must be a string such as '30m'")
    assert chat_refused(f, {"ttl": 30}) == bad(f, "'ttl' must be a string such as '30m'")
    assert chat_refused(f, {"mode": "implicit", "other": 1}) == bad(f, "unknown option 'other'")
    assert chat_refused(f, "implicit") == bad(f, "must be an object")


TOOL_CHOICE_PROBLEM = "must be none, auto, required or an object whose 'type' is function, custom, allowed_tools"


def test_chat_tool_choice():
    for ok in (
        "none",
        "auto",
        "required",
        {"type": "function", "function": {"name": "f"}},
        {"type": "custom", "custom": {"name": "c"}},
        {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": []}},
    ):
        chat_ok(tool_choice=ok)
    for out in ("any", {"type": "other"}, {"type": 1}, {"type": ["function"]}, {}, 1, ["auto"]):
        assert chat_refused("tool_choice", out) == bad("tool_choice", TOOL_CHOICE_PROBLEM)
    assert chat_refused("tool_choice", {"type": "function"}) == bad(
        "tool_choice", "'function.name' must be a string for type 'function'"
    )
    assert chat_refused("tool_choice", {"type": "function", "function": {"name": 1}}) == bad(
        "tool_choice", "'function.name' must be a string for type 'function'"
    )
    assert chat_refused("tool_choice", {"type": "custom", "function": {"name": "f"}}) == bad(
        "tool_choice", "'custom.name' must be a string for type 'custom'"
    )
    big = {"type": "function", "function": {"name": "f", "pad": "x" * 32 * 1024}}
    assert chat_refused("tool_choice", big) == bad("tool_choice", "must be at most 32768 bytes as JSON")


# ---------------------------------------------------------------- engine extension fields
def test_stop_token_ids_count_and_range():
    chat_ok(stop_token_ids=[0] * 64)
    comp_ok(stop_token_ids=[INT32_MAX])
    problem = bad("stop_token_ids", "must be an array of at most 64 token ids (integers >= 0)")
    for out in ([0] * 65, [-1], [INT32_MAX + 1], [True], [1.0], 5):
        assert chat_refused("stop_token_ids", out) == problem


def test_chat_template_kwargs_only_the_thinking_switches():
    chat_ok(chat_template_kwargs={"enable_thinking": False, "thinking": True})
    f = "chat_template_kwargs"
    assert chat_refused(f, {"tools": []}) == bad(
        f, "key 'tools' is not accepted (it may change the prompt); accepted keys: enable_thinking, thinking"
    )
    assert chat_refused(f, {"thinking": "yes"}) == bad(f, "'thinking' must be a boolean")
    assert chat_refused(f, []) == bad(f, "must be an object")


@pytest.mark.parametrize("field", ["regex", "ebnf"])
def test_grammar_strings_up_to_32768_utf8_bytes(field):
    grammar = 'root ::= "a"' if field == "ebnf" else "a"
    pad = 32 * 1024 - len(grammar)
    ok = grammar + (" " * pad if field == "ebnf" else "b" * pad)
    chat_ok(**{field: ok})
    assert chat_refused(field, ok + "c") == bad(field, "must be at most 32768 bytes")
    assert chat_refused(field, ok[:-1] + "é") == bad(field, "must be at most 32768 bytes")
    assert comp_refused(field, 1) == bad(field, "must be a string")


@pytest.mark.parametrize(
    "field,grammar,problem",
    [
        ("regex", "a{1001}", "has counted repetition above 1,000"),
        ("regex", "(a+)+", "has nested quantifiers (a repeated group that is itself a repetition)"),
        ("ebnf", 'root ::= "a"{1001}', "has counted repetition above 1,000"),
        ("ebnf", 'root ::= ("a"+)+', "has nested quantifiers (a repeated group that is itself a repetition)"),
    ],
)
def test_grammar_strings_go_through_the_grammar_bounds(field, grammar, problem):
    chat_ok(**{field: grammar.replace("1001", "1000").replace("+)+", ")+")})
    assert chat_refused(field, grammar) == bad(field, problem)
    assert comp_refused(field, grammar) == bad(field, problem)


def test_json_schema_string_completions_only():
    comp_ok(json_schema='{"type": "object"}')
    comp_ok(json_schema="true")
    assert comp_refused("json_schema", "[]") == bad(
        "json_schema", "must be a JSON schema (an object) encoded as a string"
    )
    assert comp_refused("json_schema", "{") == bad("json_schema", "must be a JSON schema encoded as a string")
    comp_ok(json_schema='{"maxLength": 1000}')
    assert comp_refused("json_schema", '{"maxLength": 1001}') == bad("json_schema", "has 'maxLength' 1001, above 1,000")
    assert comp_refused("json_schema", {}) == bad("json_schema", "must be a string")
    assert comp_refused("json_schema", '"' + "x" * 32767 + '"') == bad("json_schema", "must be at most 32768 bytes")


RF_TYPE = "must be an object whose 'type' is text, json_object, json_schema or structural_tag"
RF_SCHEMA = "of type json_schema needs 'json_schema': an object with 'name' (a string) and 'schema' (an object)"


def test_response_format_on_both_routes():
    for ok in (
        {"type": "text"},
        {"type": "json_object"},
        {"type": "json_schema", "json_schema": {"name": "n"}},
        {"type": "json_schema", "json_schema": {"name": "n", "schema": None}},
        {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}}},
        {"type": "text", "json_schema": 5},
    ):
        chat_ok(response_format=ok)
        comp_ok(response_format=ok)
    for out in ({"type": "xml"}, {}, "json_object"):
        assert chat_refused("response_format", out) == bad("response_format", RF_TYPE)
    for out in (
        {"type": "json_schema"},
        {"type": "json_schema", "json_schema": {"schema": {}}},
        {"type": "json_schema", "json_schema": {"name": "n", "schema": []}},
    ):
        assert comp_refused("response_format", out) == bad("response_format", RF_SCHEMA)
    deep = {"type": "json_schema", "json_schema": {"name": "n", "schema": {"maxLength": 1001}}}
    msg = chat_refused("response_format", deep)
    assert msg.startswith("Invalid value for 'response_format': 'json_schema.schema' ")
    big = {"type": "text", "pad": "x" * 32 * 1024}
    assert chat_refused("response_format", big) == bad("response_format", "must be at most 32768 bytes as JSON")


def test_json_size_problem_at_the_limit():
    assert json_size_problem("x" * 8, limit=10) is None  # '"xxxxxxxx"' is 10 bytes
    assert json_size_problem("x" * 9, limit=10) == "must be at most 10 bytes as JSON"
    deep: Any = []
    for _ in range(300):
        deep = [deep]
    assert json_size_problem(deep) == "is nested too deeply (more than 254 levels)"


# ---------------------------------------------------------------- tables and check_fields
#: OpenAI's documented request fields of each route (chat: CreateChatCompletionRequest with the
#: deprecated functions/function_call; completions: CreateCompletionRequest) that kvgate accepts
OPENAI_CHAT = {
    "model", "messages", "max_tokens", "max_completion_tokens", "n", "stream", "stream_options",
    "temperature", "top_p", "stop", "seed", "presence_penalty", "frequency_penalty", "logit_bias",
    "user", "cache_salt", "logprobs", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls",
    "response_format", "functions", "function_call", "reasoning_effort", "modalities", "verbosity",
    "prediction", "audio", "web_search_options", "metadata", "store", "service_tier",
    "prompt_cache_key", "prompt_cache_retention", "prompt_cache_options", "safety_identifier", "moderation",
}  # fmt: skip
OPENAI_COMPLETIONS = {
    "model", "prompt", "max_tokens", "n", "stream", "stream_options", "temperature", "top_p", "stop",
    "seed", "presence_penalty", "frequency_penalty", "logit_bias", "user", "cache_salt", "echo",
    "logprobs", "best_of", "suffix",
}  # fmt: skip
SAMPLING_EXTENSIONS = {
    "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "skip_special_tokens",
    "spaces_between_special_tokens", "stop_token_ids", "no_stop_trim", "regex", "ebnf",
}  # fmt: skip
CHAT_EXTENSIONS = SAMPLING_EXTENSIONS | {
    "separate_reasoning", "stream_reasoning", "chat_template_kwargs", "continue_final_message", "add_generation_prompt",
}  # fmt: skip
COMPLETION_EXTENSIONS = SAMPLING_EXTENSIONS | {"json_schema", "response_format"}


def test_each_route_accepts_its_openai_fields_and_its_engine_extensions_only():
    assert set(CHAT_FIELDS) == OPENAI_CHAT | CHAT_EXTENSIONS
    assert set(COMPLETION_FIELDS) == OPENAI_COMPLETIONS | COMPLETION_EXTENSIONS
    assert OPENAI_FIELDS == {"chat": frozenset(OPENAI_CHAT), "completions": frozenset(OPENAI_COMPLETIONS)}
    assert set(EXTENSION_FIELDS) == CHAT_EXTENSIONS | COMPLETION_EXTENSIONS
    for k in CHAT_EXTENSIONS & COMPLETION_EXTENSIONS:
        assert CHAT_FIELDS[k] is COMPLETION_FIELDS[k] is EXTENSION_FIELDS[k]


@pytest.mark.parametrize("field", ["prompt", "echo", "best_of", "suffix", "json_schema"])
def test_chat_refuses_a_completions_field_as_unrecognized(field):
    e = refusal(CHAT_FIELDS, {"messages": SAY_HI, field: "x"}, ("messages",))
    assert e == {
        "message": f"Unrecognized request argument supplied: {field}",
        "type": "invalid_request_error",
        "param": field,
        "code": "invalid_request",
    }


@pytest.mark.parametrize("field", ["messages", "tools", "separate_reasoning", "chat_template_kwargs", "top_logprobs"])
def test_completions_refuses_a_chat_field_as_unrecognized(field):
    e = refusal(COMPLETION_FIELDS, {"prompt": "hi", field: None}, ("prompt",))
    assert (e["message"], e["param"]) == (f"Unrecognized request argument supplied: {field}", field)


def test_a_missing_or_null_required_field_is_named():
    for body in ({}, {"messages": None}, {"model": "m"}):
        assert refusal(CHAT_FIELDS, body, ("messages",)) == {
            "message": "Missing required parameter: 'messages'.",
            "type": "invalid_request_error",
            "param": "messages",
            "code": "invalid_request",
        }
    e = refusal(COMPLETION_FIELDS, {"prompt": "hi"}, ("prompt", "model"))
    assert (e["message"], e["param"]) == ("Missing required parameter: 'model'.", "model")


def test_null_optional_fields_are_absent_and_the_first_bad_field_is_named():
    chat_ok(temperature=None, n=None, stop=None, tool_choice=None, metadata=None)
    e = refusal(CHAT_FIELDS, {"messages": SAY_HI, "temperature": None, "n": 0, "top_p": 2}, ("messages",))
    assert e == {
        "message": "Invalid value for 'n': must be >= 1",
        "type": "invalid_request_error",
        "param": "n",
        "code": "invalid_request",
    }


def test_drop_nulls_keeps_only_the_named_nulls():
    body: dict[str, Any] = {"a": None, "b": 0, "c": None, "d": False}
    drop_nulls(body, frozenset({"c"}))
    assert body == {"b": 0, "c": None, "d": False}
    body = {"a": None}
    drop_nulls(body)
    assert body == {}
