"""A sweep of vLLM's and SGLang's own request validation (vLLM 0.34.0: the chat, completions and
Responses request models and their serving paths; SGLang 0.5.23: ``protocol.py``, ``serving_chat.py``
``_validate_request``, ``serving_responses.py``, ``SamplingParams.verify``) for what they refuse
after kvgate had admitted, reserved and charged the request, through the whole gateway (the app and
API mock engine and the per-policy gateways of tests/test_engine_refusals_everywhere.py). Each
refused body is an exact OpenAI-shaped 400 naming its field that reaches no engine and changes no
quota counter but the request's own RPM entry; its neighbours the engines take are still forwarded
as sent.

The findings this file holds fixed (gateway/admission/engine_refusals.py cites each engine line):

- chat ``tool_choice``: without ``tools`` on vLLM (any value but ``none``), ``required`` with no
  tool on SGLang, a named function missing from ``tools`` (both; an empty name on vLLM), an object of
  type ``custom`` or ``allowed_tools`` (both: their request models take type ``function`` only);
- chat ``tools``: a ``type`` other than ``function`` (vLLM), ``function.description`` not a string
  and ``function.parameters`` not an object (both; SGLang takes a boolean schema);
- chat ``response_format`` ``json_schema`` without its ``schema`` (both), a non-boolean ``strict``
  (SGLang), a JSON format beside ``regex``/``ebnf``, and ``tool_choice`` ``required`` or named beside
  any output constraint (SGLang);
- ``stop`` with more than 4 strings on vLLM (``VLLM_MAX_STOP_STRINGS``), on every route;
- Responses ``tool_choice`` ``required`` or named without ``tools`` (both; an empty name on vLLM),
  a function tool's ``description``/``parameters`` of the wrong type (both) or empty ``name``
  (SGLang), ``stream`` with ``include`` ``message.output_text.logprobs`` and ``text.format`` JSON
  with a forced tool call (SGLang);
- a chat ``response_format`` / Responses ``text.format`` JSON Schema nested 64 levels on vLLM
  (``MAX_STRUCTURED_OUTPUT_JSON_NESTING``).
"""

from __future__ import annotations

from typing import Any

import pytest

from config.errors import OpenAIError
from gateway.admission.engine_refusals import VLLM_MAX_SCHEMA_NESTING, VLLM_MAX_STOP_STRINGS, check_engine_refusals
from tests import test_engine_refusals_everywhere as everywhere
from tests.test_hostile_routes import _invalid

pytestmark = [pytest.mark.timeout(120), pytest.mark.engine("api")]

#: the per-policy gateways (sglang, vllm, kvgate, openai, kvgate+vllm) on the module's mock engine
gws = everywhere.gws
CHAT, RESPONSES, _ids = everywhere.CHAT, everywhere.RESPONSES, everywhere._ids

COMPLETIONS = {"prompt": "hi", "max_tokens": 3}
ROUTES: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": ("/v1/chat/completions", CHAT),
    "completions": ("/v1/completions", COMPLETIONS),
    "responses": ("/v1/responses", RESPONSES),
}

#: a chat function tool ``f`` and a Responses one
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
RTOOLS = [{"type": "function", "name": "f", "parameters": {"type": "object"}}]
NAMED_F = {"type": "function", "function": {"name": "f"}}
JSON_OBJECT = {"type": "json_object"}
FIVE_STOPS = ["a", "b", "c", "d", "e"]


def _tool_param(param: str, problem: str) -> dict:
    return _invalid(f"'{param}' {problem}", param)


NO_TOOLS_VLLM = _invalid(
    "'tool_choice' is set but 'tools' is not: the engines serving this model (vLLM) take a 'tool_choice' other "
    "than 'none' only with 'tools'; leave it out.",
    "tool_choice",
)
REQUIRED_EMPTY = _invalid("'tool_choice' is 'required', but 'tools' is empty: there is no tool to call.", "tool_choice")
REQUIRED_NO_TOOLS = _invalid(
    "'tool_choice' is 'required', but no 'tools' are given: there is no tool to call.", "tool_choice"
)


def _not_in_tools(kind: str, name: str) -> dict:
    return _invalid(f"'tool_choice' names the {kind} tool {name!r}, which is not in 'tools'.", "tool_choice")


def _choice_type(kind: str) -> dict:
    return _invalid(
        f"'tool_choice' of type {kind!r} is not supported by the engines serving this model; send none, auto, "
        'required or {"type": "function", "function": {"name": ...}}.',
        "tool_choice",
    )


STOP = _invalid(
    "Invalid value for 'stop': must be a string or an array of at most 4 strings for the engines serving this "
    "model (vLLM)",
    "stop",
)
NO_SCHEMA = _invalid(
    "'response_format.json_schema.schema' is missing: the engines serving this model need the JSON Schema to "
    "constrain the answer (send it, or use type 'json_object').",
    "response_format.json_schema.schema",
)


def _two_constraints(first: str, second: str) -> dict:
    return _invalid(
        f"'{first}' and '{second}' cannot both be set: the engines serving this model (SGLang) apply one output "
        "constraint per request.",
        second,
    )


def _forced_call(constraint: str) -> dict:
    return _invalid(
        "'tool_choice' forces a tool call, which the engines serving this model (SGLang) cannot combine with "
        f"'{constraint}'; send 'auto', or leave '{constraint}' out.",
        "tool_choice",
    )


NOT_A_SCHEMA = "must be an object (a JSON Schema)."


def _deep(levels: int) -> dict:
    """A JSON Schema whose innermost object sits ``levels`` levels below it."""
    schema: dict = {}
    for _ in range(levels):
        schema = {"x": schema}
    return schema


def _too_deep(param: str) -> dict:
    return _invalid(
        f"'{param}' is nested too deeply: the engines serving this model (vLLM) take a JSON Schema whose objects "
        f"and arrays nest at most {VLLM_MAX_SCHEMA_NESTING} levels, the schema itself the first.",
        param,
    )


STREAM_LOGPROBS = _invalid(
    "'include' asks for 'message.output_text.logprobs', which the engines serving this model (SGLang) do not "
    "return on a stream; leave it out or set 'stream' to false.",
    "include",
)

REFUSED_BODIES: list[tuple[str, str, dict[str, Any], dict[str, Any]]] = [
    # chat tool_choice against tools
    ("chat", "vllm", {"tool_choice": "required"}, NO_TOOLS_VLLM),
    ("chat", "vllm", {"tool_choice": "auto"}, NO_TOOLS_VLLM),
    ("chat", "vllm", {"tool_choice": NAMED_F, "tools": None}, NO_TOOLS_VLLM),
    ("chat", "kvgate+vllm", {"tool_choice": "auto"}, NO_TOOLS_VLLM),
    ("chat", "sglang", {"tool_choice": "required"}, REQUIRED_EMPTY),
    ("chat", "sglang", {"tool_choice": "required", "tools": []}, REQUIRED_EMPTY),
    ("chat", "sglang", {"tool_choice": NAMED_F}, _not_in_tools("function", "f")),
    ("chat", "vllm", {"tool_choice": NAMED_F, "tools": []}, _not_in_tools("function", "f")),
    (
        "chat",
        "sglang",
        {"tool_choice": {"type": "function", "function": {"name": "g"}}, "tools": TOOLS},
        _not_in_tools("function", "g"),
    ),
    (
        "chat",
        "vllm",
        {"tool_choice": {"type": "function", "function": {"name": "g"}}, "tools": TOOLS},
        _not_in_tools("function", "g"),
    ),
    (
        "chat",
        "vllm",
        {
            "tool_choice": {"type": "function", "function": {"name": ""}},
            "tools": [{"type": "function", "function": {"name": ""}}],
        },
        _invalid(
            "'tool_choice.function.name' must not be empty for the engines serving this model (vLLM).",
            "tool_choice.function.name",
        ),
    ),
    (
        "chat",
        "vllm",
        {"tool_choice": {"type": "custom", "custom": {"name": "f"}}, "tools": TOOLS},
        _choice_type("custom"),
    ),
    (
        "chat",
        "sglang",
        {"tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": []}}, "tools": TOOLS},
        _choice_type("allowed_tools"),
    ),
    # chat tool definitions
    (
        "chat",
        "vllm",
        {"tools": [{"type": "funky", "function": {"name": "f"}}]},
        _invalid("'tools[0].type' must be 'function' for the engines serving this model.", "tools[0].type"),
    ),
    (
        "chat",
        "sglang",
        {"tools": [*TOOLS, {"type": "function", "function": {"name": "g", "parameters": "x"}}]},
        _tool_param("tools[1].function.parameters", NOT_A_SCHEMA),
    ),
    (
        "chat",
        "vllm",
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]},
        _tool_param("tools[0].function.parameters", NOT_A_SCHEMA),
    ),
    (
        "chat",
        "vllm",
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": True}}]},
        _tool_param("tools[0].function.parameters", NOT_A_SCHEMA),
    ),
    (
        "chat",
        "sglang",
        {"tools": [{"type": "function", "function": {"name": "f", "description": 5}}]},
        _tool_param("tools[0].function.description", "must be a string."),
    ),
    # chat output constraints
    ("chat", "vllm", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, NO_SCHEMA),
    (
        "chat",
        "sglang",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": None}}},
        NO_SCHEMA,
    ),
    (
        "chat",
        "sglang",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "strict": "yes"}}},
        _tool_param("response_format.json_schema.strict", "must be a boolean."),
    ),
    ("chat", "sglang", {"response_format": JSON_OBJECT, "regex": "a+"}, _two_constraints("response_format", "regex")),
    (
        "chat",
        "sglang",
        {
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}},
            "ebnf": 'root ::= "a"',
        },
        _two_constraints("response_format", "ebnf"),
    ),
    (
        "chat",
        "sglang",
        {"tool_choice": "required", "tools": TOOLS, "response_format": JSON_OBJECT},
        _forced_call("response_format"),
    ),
    ("chat", "sglang", {"tool_choice": NAMED_F, "tools": TOOLS, "regex": "a+"}, _forced_call("regex")),
    # vLLM: a structured-output schema nested 64 levels (MAX_STRUCTURED_OUTPUT_JSON_NESTING)
    (
        "chat",
        "vllm",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": _deep(64)}}},
        _too_deep("response_format.json_schema.schema"),
    ),
    (
        "responses",
        "vllm",
        {"text": {"format": {"type": "json_schema", "name": "x", "schema": _deep(64)}}},
        _too_deep("text.format.schema"),
    ),
    # stop: vLLM's default VLLM_MAX_STOP_STRINGS, on every route
    ("chat", "vllm", {"stop": FIVE_STOPS}, STOP),
    ("chat", "kvgate+vllm", {"stop": FIVE_STOPS}, STOP),
    ("completions", "vllm", {"stop": FIVE_STOPS}, STOP),
    ("responses", "vllm", {"stop": FIVE_STOPS}, STOP),
    # Responses tool_choice and tools
    ("responses", "vllm", {"tool_choice": "required"}, REQUIRED_NO_TOOLS),
    ("responses", "sglang", {"tool_choice": "required", "tools": []}, REQUIRED_NO_TOOLS),
    ("responses", "vllm", {"tool_choice": {"type": "function", "name": "f"}}, _not_in_tools("function", "f")),
    (
        "responses",
        "sglang",
        {"tool_choice": {"type": "function", "name": "f"}, "tools": []},
        _not_in_tools("function", "f"),
    ),
    (
        "responses",
        "vllm",
        {"tool_choice": {"type": "function", "name": ""}, "tools": [{"type": "function", "name": ""}]},
        _invalid("'tool_choice.name' must not be empty for the engines serving this model (vLLM).", "tool_choice.name"),
    ),
    (
        "responses",
        "sglang",
        {"tools": [{"type": "function", "name": ""}]},
        _tool_param("tools[0].name", "must not be empty."),
    ),
    (
        "responses",
        "vllm",
        {"tools": [{"type": "function", "name": "f", "parameters": "x"}]},
        _tool_param("tools[0].parameters", NOT_A_SCHEMA),
    ),
    (
        "responses",
        "sglang",
        {"tools": [{"type": "function", "name": "f", "parameters": True}]},
        _tool_param("tools[0].parameters", NOT_A_SCHEMA),
    ),
    (
        "responses",
        "vllm",
        {"tools": [{"type": "function", "name": "f", "description": ["x"]}]},
        _tool_param("tools[0].description", "must be a string."),
    ),
    # Responses on SGLang: no logprobs on a stream, no forced call beside text.format
    ("responses", "sglang", {"stream": True, "include": ["message.output_text.logprobs"]}, STREAM_LOGPROBS),
    (
        "responses",
        "sglang",
        {"text": {"format": JSON_OBJECT}, "tool_choice": "required", "tools": RTOOLS},
        _forced_call("text.format"),
    ),
]


@pytest.mark.parametrize(("route", "policy", "body", "error"), REFUSED_BODIES, ids=_ids(REFUSED_BODIES))
def test_a_request_the_engine_would_refuse_is_refused_before_the_charge(gws, module_engine, route, policy, body, error):
    """Before: 200 here (the mock takes anything) and the body forwarded as sent; the real engine
    answers 400 after the gateway reserved and then settled the prompt against TPM."""
    everywhere.assert_refused_before_the_charge(gws, module_engine, ROUTES[route], policy, body, error)


ADMITTED: list[tuple[str, str, dict[str, Any]]] = [
    # SGLang takes tool_choice auto without tools; vLLM reads tools [] with required as none (OpenAI's rule)
    ("chat", "sglang", {"tool_choice": "auto"}),
    ("chat", "vllm", {"tools": [], "tool_choice": "required"}),
    ("chat", "vllm", {"tool_choice": "none"}),
    ("chat", "vllm", {"tool_choice": NAMED_F, "tools": TOOLS}),
    ("chat", "sglang", {"tool_choice": NAMED_F, "tools": TOOLS}),
    # SGLang's Tool.type is any string, and its chat takes a boolean JSON Schema
    ("chat", "sglang", {"tools": [{"type": "funky", "function": {"name": "f", "parameters": True}}]}),
    # vLLM: at most 4 stop strings; SGLang up to 32 (kvgate's own bound: 16)
    ("chat", "vllm", {"stop": FIVE_STOPS[:VLLM_MAX_STOP_STRINGS]}),
    ("chat", "sglang", {"stop": [str(i) for i in range(16)]}),
    ("completions", "sglang", {"stop": FIVE_STOPS}),
    ("responses", "sglang", {"stop": FIVE_STOPS}),
    # an empty schema is a schema; vLLM's strict is a lax boolean; a text format is no constraint, and
    # SGLang's chat only warns when tool_choice auto meets an output constraint (protocol.py:1263-1273)
    ("chat", "sglang", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}}),
    (
        "chat",
        "vllm",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "strict": "yes"}}},
    ),
    ("chat", "sglang", {"response_format": {"type": "text"}, "regex": "a+", "tool_choice": "auto", "tools": TOOLS}),
    ("chat", "sglang", {"response_format": JSON_OBJECT, "tool_choice": "auto", "tools": TOOLS}),
    # one level less on vLLM; SGLang has no such bound
    ("chat", "vllm", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": _deep(63)}}}),
    ("responses", "sglang", {"text": {"format": {"type": "json_schema", "name": "x", "schema": _deep(64)}}}),
    # OpenAI: its own rules
    ("chat", "openai", {"tool_choice": "required", "stop": FIVE_STOPS}),
    # Responses: auto without tools is none on both; SGLang logprobs without a stream; vLLM on a stream
    ("responses", "vllm", {"tool_choice": "auto"}),
    ("responses", "sglang", {"tool_choice": "auto"}),
    ("responses", "sglang", {"include": ["message.output_text.logprobs"], "top_logprobs": 2}),
    ("responses", "vllm", {"stream": True, "include": ["message.output_text.logprobs"]}),
    ("responses", "vllm", {"tools": RTOOLS, "tool_choice": {"type": "function", "name": "f"}}),
]


@pytest.mark.parametrize(("route", "policy", "body"), ADMITTED, ids=_ids(ADMITTED))
def test_what_the_engine_takes_is_still_forwarded_as_sent(gws, module_engine, route, policy, body):
    everywhere.assert_forwarded_as_sent(gws, module_engine, ROUTES[route], policy, body)


def test_a_model_served_only_by_openai_or_the_bundled_backend_gets_none_of_these_refusals():
    """OpenAI applies its own rules; the bundled backend refuses tool calls and structured output
    itself (gateway.admission.fields.check_output_constraints) and reads no tool's schema."""
    body = {
        "tool_choice": {"type": "custom", "custom": {"name": "f"}},
        "stop": FIVE_STOPS,
        "tools": [{"type": "funky", "function": {"name": "f", "parameters": "x"}}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "x"}},
    }
    check_engine_refusals(dict(body), frozenset({"openai"}), "chat")
    check_engine_refusals({"tools": body["tools"]}, frozenset({"kvgate"}), "chat")
    with pytest.raises(OpenAIError) as ei:
        check_engine_refusals(dict(body), frozenset({"openai", "sglang"}), "chat")
    assert (ei.value.status, ei.value.param) == (400, "tools[0].function.parameters")
