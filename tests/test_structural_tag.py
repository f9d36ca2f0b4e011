"""``response_format`` of type ``structural_tag`` (xgrammar's structural tags), through the whole
gateway: the recording mock engines of tests/gate_env.py (each admitted request's reservation
recorded; prompt counts from tests/gate_oracle.py) and the per-engine-policy gateways of
tests/test_engine_refusals_everywhere.py (sglang, vllm, kvgate, openai, kvgate+vllm, quotas in
process).

The finding this file holds fixed: a false refusal. vLLM 0.34.0 (``vllm/entrypoints/openai/
chat_completion/protocol.py:855-856``, ``completion/protocol.py:487-488``, the models in
``generate/base/protocol.py:146-168``) and SGLang 0.5.23 (``python/sglang/srt/entrypoints/openai/
protocol.py:252-269``, ``:1250-1253``; ``serving_completions.py:188-193``) take a structural tag on
chat and completions, in its ``format`` form and its legacy ``structures`` / ``triggers`` form;
kvgate answered 400 "must be an object whose 'type' is text, json_object or json_schema". Now it is
forwarded as sent where every engine of the model takes it, counted as the prompt alone (it
constrains the output only), checked as the engines check it (a body they refuse is kvgate's 400,
before the charge), its schemas, patterns and grammars under the grammar bounds; refused where the
bundled backend or an ``openai`` upstream serves the model.
"""

from __future__ import annotations

from typing import Any

import pytest

from config.errors import OpenAIError
from gateway.admission.checks import CHAT_FIELDS
from gateway.admission.engine_refusals import check_engine_refusals
from tests import test_engine_refusals_everywhere as everywhere
from tests import test_gate_invariant as invariant
from tests.gateway_harness import MODEL
from tests.test_engine_refusals_sweep import _forced_call, _two_constraints
from tests.test_gate_invariant import chatml, post, user
from tests.test_gateway_api_routes import error_of, forwarded
from tests.test_hostile_routes import REFUSED, Ledger, _invalid, _post

pytestmark = [pytest.mark.timeout(120), pytest.mark.engine("api")]

env, gws = invariant.env, everywhere.gws

SAY = "Say hello."
#: default_max_tokens of the tenant of tests/gate_env.py: the bound of a request that sets none
DEFAULT_BOUND = 16

#: the ``format`` form: free text, then a tool call in a tag holding JSON
CALL_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
FORMAT = {
    "type": "structural_tag",
    "format": {
        "type": "triggered_tags",
        "triggers": ["<function="],
        "tags": [
            {
                "type": "tag",
                "begin": "<function=get_weather>",
                "content": {"type": "json_schema", "json_schema": CALL_SCHEMA},
                "end": "</function>",
            }
        ],
        "at_least_one": False,
        "stop_after_first": False,
    },
}
#: the legacy form (vLLM's ``LegacyStructuralTagResponseFormat``, SGLang's of the same name)
LEGACY = {
    "type": "structural_tag",
    "structures": [{"begin": "<function=get_weather>", "schema": CALL_SCHEMA, "end": "</function>"}],
    "triggers": ["<function="],
}

ROUTES = {
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}),
    "completions": ("/v1/completions", {"prompt": "hi", "max_tokens": 3}),
}


def _sent(got: dict[str, Any]) -> dict[str, Any]:
    """The forwarded body without the tenant's ``cache_salt`` (checked to be a string)."""
    assert isinstance(got.pop("cache_salt"), str)
    return got


def _problem(fmt: Any) -> str | None:
    """The problem chat's field check finds in a ``response_format``."""
    return CHAT_FIELDS["response_format"](fmt)


def _engine_error(body: dict[str, Any], engines: str, route: str = "chat") -> dict[str, Any] | None:
    """The error body ``check_engine_refusals`` raises for ``body`` on ``engines`` (``+``-joined)."""
    try:
        check_engine_refusals(body, frozenset(engines.split("+")), route)
    except OpenAIError as e:
        assert e.status == 400
        return e.body()["error"]
    return None


def _format(fmt: dict[str, Any]) -> dict[str, Any]:
    return {"type": "structural_tag", "format": fmt}


def _bad(problem: str) -> dict[str, Any]:
    return _invalid(f"Invalid value for 'response_format': {problem}", "response_format")


# ---------------------------------------------------------------- taken where vLLM and SGLang serve the model
@pytest.mark.parametrize("fmt", [FORMAT, LEGACY], ids=["format", "legacy"])
@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("policy", ["sglang", "vllm"])
def test_a_structural_tag_is_forwarded_as_sent(gws, module_engine, policy, route, fmt):
    """Before: 400 "Invalid value for 'response_format': must be an object whose 'type' is text,
    json_object or json_schema", though both engines take it on both routes."""
    path, base = ROUTES[route]
    ledger = Ledger(gws[policy], module_engine)
    r = _post(gws[policy], path, {"model": MODEL, **base, "response_format": fmt})
    assert r.status_code == 200, r.text
    assert forwarded(module_engine, path)[-1]["response_format"] == fmt
    change = ledger.delta()
    assert (change["engine"], change["rpm"], change["leases"]) == (1, 1, 0)


@pytest.mark.parametrize("fmt", [FORMAT, LEGACY], ids=["format", "legacy"])
@pytest.mark.parametrize("model", ["m", "mv", "mix"])
def test_a_structural_tag_counts_the_prompt_alone(env, model, fmt):
    """It constrains the output only: the reservation is the prompt's and the bound's, as without
    it (11 ChatML tokens for the chat, 3 for the completions prompt), and the body reaches the
    engine as sent."""
    q = env[3]
    status, _, got = post(env, "chat", user(SAY, model=model, response_format=fmt))
    assert status == 200
    assert _sent(got) == {
        "model": model,
        "messages": [{"role": "user", "content": SAY}],
        "response_format": fmt,
        "max_tokens": DEFAULT_BOUND,
    }
    assert q.reserved[-1] == chatml(got) + DEFAULT_BOUND == 11 + DEFAULT_BOUND
    status, _, got = post(env, "completions", {"model": model, "prompt": SAY, "response_format": fmt})
    assert status == 200
    assert _sent(got) == {"model": model, "prompt": SAY, "response_format": fmt, "max_tokens": DEFAULT_BOUND}
    assert q.reserved[-1] == 3 + DEFAULT_BOUND


# ---------------------------------------------------------------- refused where an engine does not take it
NOT_SUPPORTED = _invalid(
    "'response_format' of type 'structural_tag' is not supported by the engines serving this model.",
    "response_format",
)
NOT_HERE = _invalid(
    "Unrecognized request argument supplied: response_format (the engines serving this model do not accept it).",
    "response_format",
)


@pytest.mark.parametrize("policy", ["kvgate", "openai", "kvgate+vllm"])
def test_a_structural_tag_is_refused_where_the_bundled_backend_or_openai_serves_the_model(gws, module_engine, policy):
    """The bundled backend applies no structured output; OpenAI's ``response_format`` has no
    ``structural_tag``. Chat names it; completions take no ``response_format`` there at all."""
    for route, error in (("chat", NOT_SUPPORTED), ("completions", NOT_HERE)):
        path, base = ROUTES[route]
        ledger = Ledger(gws[policy], module_engine)
        r = _post(gws[policy], path, {"model": MODEL, **base, "response_format": FORMAT})
        assert (r.status_code, error_of(r)) == (400, error)
        assert ledger.delta() == REFUSED


def test_a_structural_tag_is_refused_for_an_openai_model_without_reaching_an_engine(env):
    status, data, received = post(env, "chat", user(SAY, model="mo", response_format=FORMAT))
    assert (status, data["error"], received) == (400, NOT_SUPPORTED, None)


# ---------------------------------------------------------------- what the engines refuse: kvgate's 400 first
TRIGGERED = FORMAT["format"]
TOKEN_DISPATCH = {"type": "token_dispatch", "rules": [[5, {"type": "const_string", "value": "x"}]]}
STRING_TOKEN = _format({"type": "token", "token": "<|call|>"})


def _nested_optional(levels: int) -> dict[str, Any]:
    """A ``format`` of ``levels`` optional formats around a constant string."""
    fmt: dict[str, Any] = {"type": "const_string", "value": "x"}
    for _ in range(levels):
        fmt = {"type": "optional", "content": fmt}
    return fmt


REFUSED_BODIES: list[tuple[str, str, dict[str, Any], dict[str, Any]]] = [
    # both engines: the shape of the models (SGLang's pydantic, vLLM's xgrammar parse)
    (
        "sglang",
        "chat",
        {"response_format": {"type": "structural_tag"}},
        _bad("of type structural_tag needs 'format' (or the legacy 'structures' and 'triggers')"),
    ),
    (
        "vllm",
        "chat",
        {"response_format": _format({"type": "const_string", "value": 5})},
        _bad("'format.value' must be a string"),
    ),
    (
        "vllm",
        "completions",
        {"response_format": _format({**TRIGGERED, "triggers": ["<tool="]})},
        _bad("'format.tags[0].begin' must begin with exactly one of 'format.triggers' (it begins with 0)"),
    ),
    (
        "sglang",
        "chat",
        {"response_format": {**LEGACY, "triggers": []}},
        _bad("'triggers' must be a non-empty array of non-empty strings"),
    ),
    # vLLM only
    (
        "vllm",
        "chat",
        {"response_format": {**LEGACY, "structures": [{"begin": "<function=f>", "end": "</function>"}]}},
        _invalid(
            "'response_format.structures[0].schema' is missing: the engines serving this model (vLLM) need a JSON "
            "Schema for each structure (send {} for any JSON).",
            "response_format.structures[0].schema",
        ),
    ),
    (
        "vllm",
        "chat",
        {"response_format": STRING_TOKEN},
        _invalid(
            "'response_format.format.token' is a token string: the engines serving this model (vLLM) take token ids "
            "(integers) only.",
            "response_format.format.token",
        ),
    ),
    (
        "vllm",
        "completions",
        {"response_format": _format(_nested_optional(79))},
        _invalid(
            "'response_format' is nested too deeply: the engines serving this model (vLLM) take a structural tag whose "
            "objects and arrays nest at most 80 levels, response_format itself the first.",
            "response_format",
        ),
    ),
    # SGLang only: one output constraint per request
    ("sglang", "chat", {"response_format": FORMAT, "regex": "a+"}, _two_constraints("response_format", "regex")),
    (
        "sglang",
        "completions",
        {"response_format": LEGACY, "ebnf": "root ::= 'a'"},
        _two_constraints("response_format", "ebnf"),
    ),
    (
        "sglang",
        "chat",
        {
            "response_format": FORMAT,
            "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": CALL_SCHEMA}}],
            "tool_choice": "required",
        },
        _forced_call("response_format"),
    ),
    (
        "sglang",
        "completions",
        {"response_format": FORMAT, "json_schema": '{"type": "object"}'},
        _invalid(
            "'response_format' and 'json_schema' cannot both be set: the engines serving this model apply one output "
            "constraint per request.",
            "json_schema",
        ),
    ),
    (
        "sglang",
        "chat",
        {"response_format": _format({"type": "json_schema", "json_schema": {}, "excludes": ["x"]})},
        _invalid(
            "'response_format.format.excludes' is not applied by the engines serving this model (SGLang); leave it "
            "out.",
            "response_format.format.excludes",
        ),
    ),
    # both engines' grammar library (xgrammar) crashes: vLLM's API server while validating the request
    (
        "vllm",
        "chat",
        {"response_format": _format({"type": "repeat", "min": 1, "max": 2, "content": TOKEN_DISPATCH})},
        _bad(
            "'format.content' (token_dispatch) must not be inside a repeat ('format'): the engines' grammar library "
            "crashes on it (the engine process dies)"
        ),
    ),
    # kvgate's grammar bounds, for every engine
    (
        "vllm",
        "chat",
        {"response_format": _format({"type": "json_schema", "json_schema": {"maxItems": 1001}})},
        _bad("'format.json_schema' has 'maxItems' 1001, above 1,000"),
    ),
    (
        "sglang",
        "chat",
        {"response_format": _format({"type": "regex", "pattern": "(a+)+"})},
        _bad("'format.pattern' has nested quantifiers (a repeated group that is itself a repetition)"),
    ),
]


@pytest.mark.parametrize(
    ("policy", "route", "body", "error"),
    REFUSED_BODIES,
    ids=[f"{p}-{r}-{e['param']}-{i}" for i, (p, r, _, e) in enumerate(REFUSED_BODIES)],
)
def test_a_structural_tag_the_engines_refuse_is_refused_before_the_charge(
    gws, module_engine, policy, route, body, error
):
    """Each was admitted, charged and forwarded (or, before, refused for its type), and the engine
    then answered 400: now the gateway's 400, naming the field, with nothing charged."""
    path, base = ROUTES[route]
    ledger = Ledger(gws[policy], module_engine)
    r = _post(gws[policy], path, {"model": MODEL, **base, **body})
    assert (r.status_code, error_of(r)) == (400, error)
    assert ledger.delta() == REFUSED


def test_the_neighbours_of_the_engine_only_refusals_pass_on_the_other_engine(gws, module_engine):
    """What only one engine refuses passes where the other serves the model alone: vLLM applies a
    ``json_schema`` format's ``excludes``; SGLang reads a legacy structure without a schema as
    ``{}``, resolves a token string with the model's tokenizer, and takes formats nested deeper than
    vLLM's 80 levels."""
    sent = [
        ("vllm", _format({"type": "json_schema", "json_schema": {}, "excludes": ["x"]})),
        ("sglang", {**LEGACY, "structures": [{"begin": "<function=f>", "end": "</function>"}]}),
        ("sglang", STRING_TOKEN),
        ("sglang", _format(_nested_optional(79))),
    ]
    path, base = ROUTES["chat"]
    for policy, fmt in sent:
        ledger = Ledger(gws[policy], module_engine)
        r = _post(gws[policy], path, {"model": MODEL, **base, "response_format": fmt})
        assert r.status_code == 200, (policy, r.text)
        assert forwarded(module_engine, path)[-1]["response_format"] == fmt
        change = ledger.delta()
        assert (change["engine"], change["rpm"], change["leases"]) == (1, 1, 0)


# ---------------------------------------------------------------- the field check, value by value
ANY = {"type": "any_text"}
CONST = {"type": "const_string", "value": "x"}


def _tag(begin: Any = "<a>", content: Any = None, end: Any = "</a>") -> dict[str, Any]:
    return {"begin": begin, "content": content or ANY, "end": end}


#: formats both engines take (each checked against vLLM 0.34.0's validation with xgrammar 0.2.8 and
#: SGLang 0.5.23's request model with xgrammar 0.2.7)
TAKEN: list[Any] = [
    CONST,
    {"type": "const_string", "value": ""},
    {"type": "const_string", "value": "x", "note": "unknown keys are ignored"},
    ANY,
    {"type": "any_text", "excludes": ["", "a"], "max_tokens": 5, "max_chars": None},
    {"type": "json_schema", "json_schema": True},
    {"type": "json_schema", "json_schema": {"type": "object"}, "style": "qwen_xml", "any_order": True},
    {"type": "json_schema", "json_schema": {}, "max_whitespace_cnt": 2},
    {"type": "qwen_xml_parameter", "json_schema": {"type": "object"}},
    {"type": "grammar", "grammar": 'root ::= "a"'},
    {"type": "regex", "pattern": "[a-z]+"},
    {"type": "sequence", "elements": [ANY, CONST]},
    {"type": "or", "elements": [CONST, ANY]},
    {"type": "tag", **_tag(end=["</a>", "</b>"])},
    {"type": "tag", **_tag(begin={"type": "token", "token": 5}, end={"token": 6})},
    {"type": "tag", **_tag(content=CONST, end="")},
    {"type": "tag", **_tag(content={"type": "tag", **_tag()}, end="")},
    {"type": "triggered_tags", "triggers": ["<a", "<b"], "tags": [_tag(), _tag("<b>")], "excludes": ["x"]},
    {"type": "tags_with_separator", "tags": [_tag(begin={"type": "token", "token": 3})], "separator": ""},
    {"type": "optional", "content": ANY},
    {"type": "plus", "content": {"type": "plus", "content": CONST}},
    {"type": "star", "content": ANY},
    {"type": "repeat", "min": 0, "max": -1, "content": CONST},
    {"type": "repeat", "min": 10, "max": 100, "content": CONST},
    {"type": "token", "token": 7},
    {"type": "exclude_token", "exclude_tokens": [1, 2]},
    {"type": "any_tokens", "exclude_tokens": [1], "max_tokens": 5},
    {
        "type": "token_triggered_tags",
        "trigger_tokens": [5],
        "tags": [_tag(begin={"type": "token", "token": 5})],
        "exclude_tokens": [5],
    },
    {"type": "dispatch", "rules": [["", CONST], ["<a>", CONST]], "loop": False},
    {"type": "token_dispatch", "rules": [[5, CONST]], "exclude_tokens": [5]},
    {"type": "star", "content": {"type": "token_dispatch", "rules": [[5, CONST]]}},
    {"type": "tag", **_tag(content={"type": "any_tokens", "exclude_tokens": [1]}, end="")},
    {"type": "tag", **_tag(content={"type": "dispatch", "rules": [["<b>", CONST]], "excludes": ["zz"]}, end="")},
    {"type": "repeat", "min": 1, "max": 2, "content": {"type": "tag", **_tag(begin={"type": "token", "token": 5})}},
    _nested_optional(78),
]


@pytest.mark.parametrize("fmt", TAKEN, ids=[f"{f['type']}-{i}" for i, f in enumerate(TAKEN)])
def test_formats_the_engines_take_pass_the_field_check(fmt):
    assert _problem(_format(fmt)) is None
    assert _engine_error({"response_format": _format(fmt)}, "sglang+vllm") is None


def test_formats_nest_100_deep_on_sglang_and_80_levels_on_vllm():
    """xgrammar's parser takes formats 100 deep (SGLang); vLLM's ``check_json_nesting`` takes a
    structural tag whose objects and arrays nest 80 levels (``vllm/sampling_params.py:39-47``)."""
    deep = _format(_nested_optional(99))
    assert _problem(deep) is None
    assert _engine_error({"response_format": deep}, "sglang") is None
    assert _engine_error({"response_format": deep}, "vllm")["param"] == "response_format"


def test_legacy_forms_the_engines_take_pass():
    for fmt in (
        LEGACY,
        {**LEGACY, "at_least_one": True},
        {**LEGACY, "format": None},
        {**LEGACY, "structures": [{"begin": "<function=f>", "schema": {}, "end": ""}]},
    ):
        assert _problem(fmt) is None
        assert _engine_error({"response_format": fmt}, "sglang+vllm") is None


TYPES = (
    "const_string, json_schema, qwen_xml_parameter, any_text, token, exclude_token, any_tokens, grammar, regex, "
    "sequence, or, tag, triggered_tags, token_triggered_tags, tags_with_separator, optional, plus, star, repeat, "
    "dispatch, token_dispatch"
)
TOKENS = "must be an array of token ids (integers from 0 to 2147483647) or non-empty token strings"
#: (response_format, the problem): each refused by vLLM, by SGLang or by both, but the bounds
REFUSED_FORMATS: list[tuple[dict[str, Any], str]] = [
    (
        {"type": "structural_tag", "format": CONST, "structures": []},
        "of type structural_tag takes 'format' or the legacy 'structures' and 'triggers', not both",
    ),
    (_format(None), "'format' must be an object (a structural tag format)"),
    (_format({"value": "x"}), f"'format.type' must be one of {TYPES}"),
    (_format({"type": "nope"}), f"'format.type' must be one of {TYPES}"),
    (_format({"type": ["tag"]}), f"'format.type' must be one of {TYPES}"),
    (_format({"type": "const_string"}), "'format' of type const_string needs 'value'"),
    (_format({"type": "const_string", "value": "a\x00b"}), "must not hold a NUL character (\\u0000)"),
    (
        _format({"type": "json_schema", "json_schema": "{}"}),
        "'format.json_schema' must be a JSON Schema (an object or a boolean)",
    ),
    (
        _format({"type": "json_schema", "json_schema": {}, "style": "xml"}),
        "'format.style' must be one of json, qwen_xml, minimax_xml, minimax_m3_xml, deepseek_xml, glm_xml, cohere_xml, "
        "kimi_k3_xml, deepseek_v4_1_xml",
    ),
    (
        _format({"type": "json_schema", "json_schema": {}, "max_whitespace_cnt": 0}),
        "'format.max_whitespace_cnt' must be null or an integer from 1 to 2147483647",
    ),
    (
        _format({"type": "json_schema", "json_schema": {}, "excludes": [""]}),
        "'format.excludes' must be an array of non-empty strings",
    ),
    (_format({"type": "json_schema", "json_schema": {}, "any_order": "yes"}), "'format.any_order' must be a boolean"),
    (
        _format({"type": "any_text", "max_tokens": -1}),
        "'format.max_tokens' must be null or an integer from 0 to 2147483647",
    ),
    (_format({"type": "any_text", "excludes": "a"}), "'format.excludes' must be an array of strings"),
    (_format({"type": "grammar", "grammar": ""}), "'format.grammar' must be a non-empty string (an EBNF grammar)"),
    (_format({"type": "regex", "pattern": ""}), "'format.pattern' must be a non-empty string (a regular expression)"),
    (_format({"type": "sequence", "elements": []}), "'format.elements' must be a non-empty array of formats (objects)"),
    (_format({"type": "or", "elements": [CONST, {"value": "y"}]}), f"'format.elements[1].type' must be one of {TYPES}"),
    (_format({"type": "tag", "begin": "<a>", "end": "</a>"}), "'format' of type tag needs 'content'"),
    (_format({"type": "tag", **_tag(begin=5)}), "'format.begin' must be a string or a token format"),
    (
        _format({"type": "tag", **_tag(begin={"type": "const_string", "value": "x"})}),
        "'format.begin' must be a string or a token format",
    ),
    (
        _format({"type": "tag", **_tag(end=[])}),
        "'format.end' must be a string, a non-empty array of strings or a token format",
    ),
    (
        _format({"type": "tag", **_tag(end="")}),
        "'format.end' must hold a non-empty string: 'format.content' has no end of its own",
    ),
    (
        _format({"type": "tag", **_tag(content={"type": "sequence", "elements": [CONST, ANY]}, end=["", ""])}),
        "'format.end' must hold a non-empty string: 'format.content' has no end of its own",
    ),
    (
        _format({"type": "tag", **_tag(content={"type": "repeat", "min": 0, "max": 3, "content": ANY}, end="")}),
        "'format.end' must hold a non-empty string: 'format.content' has no end of its own",
    ),
    (
        _format({"type": "triggered_tags", "triggers": [""], "tags": [_tag()]}),
        "'format.triggers' must be a non-empty array of non-empty strings",
    ),
    (
        _format({"type": "triggered_tags", "triggers": ["<a"], "tags": []}),
        "'format.tags' must be a non-empty array of tags (objects)",
    ),
    (
        _format({"type": "triggered_tags", "triggers": ["<a", "<"], "tags": [_tag()]}),
        "'format.tags[0].begin' must begin with exactly one of 'format.triggers' (it begins with 2)",
    ),
    (
        _format({"type": "triggered_tags", "triggers": ["<a", "<b"], "tags": [_tag()]}),
        "'format.triggers[1]' begins none of the tags",
    ),
    (
        _format({"type": "triggered_tags", "triggers": ["<a"], "tags": [_tag(begin={"type": "token", "token": 3})]}),
        "'format.tags[0].begin' must be a string (triggered tags begin with one of 'format.triggers')",
    ),
    (
        _format({"type": "triggered_tags", "triggers": ["<a"], "tags": [{"type": "x", **_tag()}]}),
        "'format.tags[0].type' must be 'tag'",
    ),
    (
        _format({"type": "triggered_tags", "triggers": ["<a"], "tags": [_tag()], "at_least_one": 1}),
        "'format.at_least_one' must be a boolean",
    ),
    (
        _format({"type": "tags_with_separator", "tags": [_tag()]}),
        "'format' of type tags_with_separator needs 'separator'",
    ),
    (_format({"type": "optional"}), "'format' of type optional needs 'content'"),
    (_format({"type": "repeat", "min": -1, "max": 3, "content": CONST}), "'format.min' must be >= 0"),
    (_format({"type": "repeat", "min": 3, "max": 1, "content": CONST}), "'format.min' must be <= 'format.max'"),
    (
        _format({"type": "repeat", "min": 0, "max": -2, "content": CONST}),
        "'format.max' must be -1 (unbounded) or an integer from 0 to 1000",
    ),
    (
        _format({"type": "token", "token": -1}),
        "'format.token' must be a token id (an integer from 0 to 2147483647) or a non-empty token string",
    ),
    (
        _format({"type": "token", "token": ""}),
        "'format.token' must be a token id (an integer from 0 to 2147483647) or a non-empty token string",
    ),
    (_format({"type": "exclude_token", "exclude_tokens": [-1]}), f"'format.exclude_tokens' {TOKENS}"),
    (
        _format({"type": "token_triggered_tags", "trigger_tokens": [], "tags": [_tag(begin={"token": 5})]}),
        "'format.trigger_tokens' must be a non-empty array of token ids (integers from 0 to 2147483647) or non-empty "
        "token strings",
    ),
    (
        _format({"type": "token_triggered_tags", "trigger_tokens": [5], "tags": [_tag()]}),
        "'format.tags[0].begin' must be a token format (token-triggered tags begin with one of "
        "'format.trigger_tokens')",
    ),
    (
        _format({"type": "token_triggered_tags", "trigger_tokens": [5, 5], "tags": [_tag(begin={"token": 5})]}),
        "'format.tags[0].begin.token' must be exactly one of 'format.trigger_tokens' (it is 2)",
    ),
    (
        _format({"type": "token_triggered_tags", "trigger_tokens": [5, 6], "tags": [_tag(begin={"token": 5})]}),
        "'format.trigger_tokens[1]' begins none of the tags",
    ),
    (_format({"type": "dispatch", "rules": []}), "'format.rules' must be a non-empty array of [pattern, format] pairs"),
    (
        _format({"type": "dispatch", "rules": [["<a>"]]}),
        "'format.rules' must be a non-empty array of [pattern, format] pairs",
    ),
    (
        _format({"type": "dispatch", "rules": [["<a>", CONST]], "excludes": [""]}),
        "'format.excludes' must be an array of non-empty strings",
    ),
    (
        _format({"type": "token_dispatch", "rules": [[1.5, CONST]]}),
        "'format.rules' must be a non-empty array of [token, format] pairs",
    ),
    (
        _format({"type": "dispatch", "rules": [["<a>", {"type": "nope"}]]}),
        f"'format.rules[0][1].type' must be one of {TYPES}",
    ),
    (_format(_nested_optional(100)), "'format" + ".content" * 100 + "' nests formats more than 100 deep"),
    (
        _format({"type": "tag", **_tag(content={"type": "any_tokens", "exclude_tokens": []}, end="")}),
        "'format.end' must hold a non-empty string: 'format.content' has no end of its own",
    ),
    (
        _format({"type": "repeat", "min": 0, "max": 0, "content": {"type": "star", "content": TOKEN_DISPATCH}}),
        "'format.content.content' (token_dispatch) must not be inside a repeat ('format'): the engines' grammar "
        "library crashes on it (the engine process dies)",
    ),
    (
        _format(
            {
                "type": "repeat",
                "min": 1,
                "max": 2,
                "content": {
                    "type": "token_triggered_tags",
                    "trigger_tokens": [5],
                    "tags": [_tag(begin={"type": "token", "token": 5})],
                },
            }
        ),
        "'format.content' (token_triggered_tags) must not be inside a repeat ('format'): the engines' grammar "
        "library then matches none of its tags",
    ),
    (
        _format({"type": "qwen_xml_parameter", "json_schema": {}, "max_whitespace_cnt": 0}),
        "'format.max_whitespace_cnt' must be null or an integer from 1 to 2147483647",
    ),
    # legacy
    (
        {"type": "structural_tag", "structures": [{"begin": "<a>", "schema": {}, "end": "</a>"}]},
        "of type structural_tag needs 'triggers'",
    ),
    (
        {**LEGACY, "structures": []},
        "'structures' must be a non-empty array of objects with a string 'begin', an object 'schema' and a string "
        "'end'",
    ),
    ({**LEGACY, "structures": [{"begin": 5, "schema": {}, "end": "</a>"}]}, "'structures[0].begin' must be a string"),
    (
        {**LEGACY, "structures": [{"begin": "<function=f>", "schema": True, "end": "</a>"}]},
        "'structures[0].schema' must be an object (a JSON Schema)",
    ),
    (
        {
            **LEGACY,
            "triggers": ["<f"],
            "structures": [*LEGACY["structures"], {"begin": "<tool>", "schema": {}, "end": ""}],
        },
        "'structures[1].begin' must begin with exactly one of 'triggers' (it begins with 0)",
    ),
    ({**LEGACY, "at_least_one": None}, "'at_least_one' must be a boolean"),
    # kvgate's bounds
    (_format({"type": "repeat", "min": 1001, "max": -1, "content": CONST}), "'format.min' must be <= 1000"),
    (
        _format(
            {
                "type": "repeat",
                "min": 0,
                "max": 40,
                "content": {"type": "repeat", "min": 0, "max": 40, "content": CONST},
            }
        ),
        "'format.content' nests repeat counts whose product is above 1,000",
    ),
    (
        _format({"type": "grammar", "grammar": 'root ::= "a"{1001}'}),
        "'format.grammar' has counted repetition above 1,000",
    ),
    (
        {**LEGACY, "structures": [{"begin": "<function=f>", "schema": {"maxLength": 5000}, "end": "</f>"}]},
        "'structures[0].schema' has 'maxLength' 5000, above 1,000",
    ),
    (_format({"type": "const_string", "value": "x" * 40000}), "must be at most 32768 bytes as JSON"),
]


@pytest.mark.parametrize(
    ("fmt", "problem"), REFUSED_FORMATS, ids=[f"{i}-{p[:40]}" for i, (_, p) in enumerate(REFUSED_FORMATS)]
)
def test_formats_the_engines_refuse_get_the_field_checks_problem(fmt, problem):
    assert _problem(fmt) == problem


def test_the_type_problem_names_structural_tag():
    assert _problem({"type": "grammar"}) == (
        "must be an object whose 'type' is text, json_object, json_schema or structural_tag"
    )


def test_what_sglang_drops_from_a_format_is_refused_where_it_serves_the_model():
    """SGLang's xgrammar (0.2.7) has no ``JSONSchemaFormat.excludes`` and a ``qwen_xml_parameter``
    of ``json_schema`` alone: its request model drops the rest, which vLLM applies."""
    for node, field in (
        ({"type": "json_schema", "json_schema": {}, "excludes": ["x"]}, "excludes"),
        ({"type": "qwen_xml_parameter", "json_schema": {}, "any_order": True}, "any_order"),
        ({"type": "qwen_xml_parameter", "json_schema": {}, "max_whitespace_cnt": 2}, "max_whitespace_cnt"),
        ({"type": "tag", **_tag(content={"type": "qwen_xml_parameter", "json_schema": {}, "excludes": ["x"]})}, None),
    ):
        body = {"response_format": _format(node)}
        assert _problem(body["response_format"]) is None
        assert _engine_error(body, "vllm") is None
        param = f"response_format.format.{field}" if field else "response_format.format.content.excludes"
        assert _engine_error(body, "sglang") == _invalid(
            f"'{param}' is not applied by the engines serving this model (SGLang); leave it out.", param
        )
    for unset in ({"excludes": []}, {"any_order": False}, {"max_whitespace_cnt": None}):
        body = {"response_format": _format({"type": "qwen_xml_parameter", "json_schema": {}, **unset})}
        assert _engine_error(body, "sglang") is None
