"""SGLang's rewrites of tools and tool calls before its chat template, counted through the app
against the independent oracle (tests/gate_oracle.py, copied from SGLang's source):

- ``OpenAIServingChat._validate_request`` (serving_chat.py@002897c2) runs
  ``normalize_json_schema_types`` (function_call/utils.py@00ca197b) on every tool's
  ``parameters`` before ``_process_messages`` dumps the tools: ``"int"`` reaches the model as
  ``"integer"``, ``"varchar(255)"`` as ``"string"``, a type list deduplicated after mapping.
- ``_apply_jinja_template`` starts from ``msg.model_dump()``: an assistant tool call is printed
  ``{"id", "index", "type", "function": {"name", "arguments"}}`` with ``None`` for what was left
  out (protocol.py ``ToolCall``).

SGLang releases from before the rewrite render the schemas as sent, and the rewrite can shorten a
schema without bound (``"varchar(<any text>)"`` becomes ``"string"``): where it changes a schema
the gate counts both forms and keeps the larger (``tokenizer.engine_render.schema_forms``).

Models (tests/render_env.py): ``cs``/``ck``/``cv`` kvgate's ChatML (cl100k) behind SGLang, the
bundled backend (as sent) and vLLM (no rewrite); ``ts``/``tk`` the tojson template.
"""

from __future__ import annotations

import copy
import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.engine_tool_models import sglang_tools
from tests.gate_env import make_bpe_folder
from tests.gate_oracle import EngineRefusal, engine_chat_tokens, hf_chat_tokens, normalize_json_schema_types
from tests.render_env import ENGINES, render_env
from tokenizer.engine_render import sglang_schema

pytest.importorskip("transformers")

HI = [{"role": "user", "content": "hi"}]
CONTEXT = re.compile(r"However, you requested (\d+) tokens \((\d+) in the messages")


def _cost(part: dict) -> int:
    return 765


@pytest.fixture(scope="module")
def env():
    with render_env() as e:
        yield e


def _tool(parameters: object) -> dict:
    return {"type": "function", "function": {"name": "get", "parameters": parameters}}


def gate_count(env, model: str, tools: list, messages: list | None = None) -> int:
    """The gate's prompt count for a chat with ``tools``: the reservation less the 16 completion
    tokens, or the count a context-length 400 reports."""
    client, sg, vl, quotas, folder = env
    body = {"model": model, "messages": messages or HI, "tools": tools, "max_tokens": 16}
    r = client.post("/v1/chat/completions", json=body)
    if r.status_code == 200:
        return quotas.reserved[-1] - 16
    assert r.status_code == 400, r.text
    m = CONTEXT.search(r.json()["error"]["message"])
    assert m, r.text
    return int(m.group(2))


def oracle(env, model: str, tools: list, messages: list | None = None, rewrite_schema: bool = True) -> int:
    """The oracle's count for ``model``'s engine (SGLang: at the cited commit, or with
    ``rewrite_schema`` false a release from before the rewrite)."""
    folder = env[4]
    body = {"model": model, "messages": messages or HI, "tools": tools}
    (engine,) = ENGINES[model]
    if model.startswith("t"):
        return hf_chat_tokens(folder, body, engine=engine, rewrite_schema=rewrite_schema)
    return engine_chat_tokens(engine, body, _cost, rewrite_schema=rewrite_schema)


def unrewritten(env, model: str, tools: list) -> int:
    """The oracle's count for an SGLang ``model`` from before the rewrite: the tools dumped, their
    schemas as sent (also what kvgate counted before it modelled the rewrite)."""
    as_dumped = oracle(env, model, tools, rewrite_schema=False)
    folder = env[4]
    body = {"model": model, "messages": HI, "tools": sglang_tools(tools)}
    kvgate = hf_chat_tokens(folder, body, engine="kvgate") if model.startswith("t") else None
    assert kvgate in (None, as_dumped)
    return as_dumped


# ---- the rewrite itself: kvgate's copy against SGLang's, line for line ------------------------
TYPE_NAMES = [
    "int",
    "integer",
    "INT32",
    "int64",
    "uint8",
    "varchar(255)",
    "VARCHAR ( 10 )",
    "decimal(10,2)",
    "bool",
    "Boolean",
    "float64",
    "num",
    "list[str]",
    "dict[str, int]",
    "map",
    "enum",
    " text ",
    "internal",
    "list_price",
    "dictionary",
    "foo",
    "null",
    "",
]
type_value = st.one_of(
    st.sampled_from(TYPE_NAMES),
    st.lists(st.sampled_from(TYPE_NAMES), max_size=4),
    st.sampled_from([5, None, True, {"type": "int"}]),
)
MAP_KEYS = ["properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "x-meta"]
LIST_KEYS = ["anyOf", "oneOf", "allOf", "prefixItems", "enum"]
ONE_KEYS = ["items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames", "default"]
schema = st.recursive(
    st.one_of(st.builds(lambda t: {"type": t}, type_value), st.just({}), st.just(True)),
    lambda inner: st.one_of(
        st.builds(
            lambda t, k, m: {"type": t, k: m},
            type_value,
            st.sampled_from(MAP_KEYS),
            st.dictionaries(st.sampled_from(["a", "b", "c"]), inner, max_size=3),
        ),
        st.builds(lambda k, xs: {k: xs}, st.sampled_from(LIST_KEYS), st.lists(inner, max_size=3)),
        st.builds(lambda t, k, x: {"type": t, k: x}, type_value, st.sampled_from(ONE_KEYS), inner),
        st.lists(inner, max_size=2),
    ),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None, database=None, derandomize=True)
@given(st.one_of(schema, st.none(), st.sampled_from(["int", 3, []])))
def test_rewrite_equals_sglangs(parameters):
    """kvgate's iterative copy rewrites exactly what SGLang's in-place recursion does (types
    mapped, lists deduplicated, unknown types and unvisited keywords untouched) and leaves the
    request as it was."""
    sent = copy.deepcopy(parameters)
    expected = copy.deepcopy(parameters)
    normalize_json_schema_types(expected)
    assert sglang_schema(parameters) == expected
    assert parameters == sent


def test_rewrite_examples():
    s = {
        "type": "object",
        "properties": {
            "a": {"type": "int"},
            "b": {"type": ["int", "integer", "INT32", "null"]},
            "c": {"type": "varchar(255)"},
            "d": {"type": "list[str]", "items": {"type": "bool"}},
            "e": {"type": "internal"},
            "f": {"anyOf": [{"type": "float64"}, {"type": "list_price"}]},
        },
        "x-meta": {"type": "int"},
    }
    assert sglang_schema(s) == {
        "type": "object",
        "properties": {
            "a": {"type": "integer"},
            "b": {"type": ["integer", "null"]},
            "c": {"type": "string"},
            "d": {"type": "array", "items": {"type": "boolean"}},
            "e": {"type": "internal"},
            "f": {"anyOf": [{"type": "number"}, {"type": "list_price"}]},
        },
        "x-meta": {"type": "int"},  # not a keyword SGLang descends into
    }
    assert sglang_schema([{"type": "int"}, "int", 3]) == [{"type": "integer"}, "int", 3]
    assert sglang_schema("int") == "int" and sglang_schema(True) is True and sglang_schema(None) is None


def test_deep_nesting_is_rewritten_without_recursion():
    """SGLang answers a schema deeper than its recursion limit with a 400; kvgate's walk is
    iterative, so it never fails on depth (a count for a body SGLang refuses, never a 500)."""
    deep: dict = {"type": "int"}
    for _ in range(1500):
        deep = {"type": "object", "properties": {"a": deep}}
    out = sglang_schema(deep)
    for _ in range(1500):
        out = out["properties"]["a"]
    assert out == {"type": "integer"}
    with pytest.raises(EngineRefusal):
        from tests.gate_oracle import sglang_templated_tools

        sglang_templated_tools([_tool(deep)])


# ---- counted through the app ------------------------------------------------------------------
def int_schema(n: int = 200, type_name: str = "int") -> dict:
    return {"type": "object", "properties": {f"p{i}": {"type": type_name} for i in range(n)}}


def test_int_aliases_are_counted_as_sglang_rewrites_them(env):
    """200 ``{"type": "int"}`` properties with the tojson template: 3,644 tokens with the schema
    as sent (what kvgate counted before, and an SGLang from before the rewrite), 4,244 as SGLang
    renders ``"integer"`` (the oracle's count and the gate's: the larger). In cl100k ``int`` and
    ``integer`` are one token each: kvgate's ChatML behind SGLang counts 2,067 either way (vLLM
    does not rewrite: 2,057; as sent: 2,052)."""
    tools = [_tool(int_schema())]
    assert gate_count(env, "ts", tools) == oracle(env, "ts", tools) == 4244
    assert unrewritten(env, "ts", tools) == 3644
    assert gate_count(env, "cs", tools) == oracle(env, "cs", tools) == unrewritten(env, "cs", tools) == 2067
    assert gate_count(env, "cv", tools) == oracle(env, "cv", tools) == 2057
    assert gate_count(env, "ck", tools) == oracle(env, "ck", tools) == 2052


#: parameters -> {model: (the oracle's count as SGLang rewrites, as an SGLang from before the
#: rewrite renders it)}; the gate's count is the larger
CASES = {
    "varchar": (int_schema(60, "varchar(255)"), {"cs": (667, 847), "ts": (1404, 1644)}),
    "dedup": (
        {"type": "object", "properties": {f"p{i}": {"type": ["int", "integer", "null"]} for i in range(40)}},
        {"cs": (627, 747), "ts": (1223, 1383)},
    ),
    "bool": (int_schema(60, "bool"), {"cs": (667, 667), "ts": (1344, 1164)}),
    "float64": (int_schema(60, "float64"), {"cs": (667, 727), "ts": (1344, 1464)}),
    "list_dict": (
        {"type": "array", "items": {"anyOf": [{"type": "list[str]"}, {"type": "dict[str, int]"}]}},
        {"cs": (84, 90), "ts": (187, 198)},
    ),
    "unknown": (int_schema(60, "internal"), {"cs": (667, 667), "ts": (1344, 1344)}),
    "prefix_boundary": (int_schema(60, "list_price"), {"cs": (727, 727), "ts": (1584, 1584)}),
    "bool_schema": (True, {"cs": (59, 59), "ts": (134, 134)}),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("model", ["cs", "ts"])
def test_rewritten_schemas_are_counted_exactly(env, case, model):
    """Aliases mapped (varchar(255) -> string, bool -> boolean, float64 -> number, list[str] ->
    array), a type list deduplicated after mapping, unknown types (``internal``, ``list_price``:
    no prefix boundary) untouched, a list's items rewritten, a non-schema untouched: the gate
    counts the larger of SGLang's two renderings."""
    parameters, expected = CASES[case]
    tools = [_tool(parameters)]
    assert (oracle(env, model, tools), unrewritten(env, model, tools)) == expected[model]
    assert gate_count(env, model, tools) == max(expected[model])


@pytest.mark.parametrize("parameters", [[{"type": "int"}, {"type": "bool"}], "int"])
def test_parameters_that_are_no_schema_are_refused_before_counting(env, parameters):
    """A list or a string as ``parameters``: SGLang's ``_validate_request`` checks each tool's
    ``parameters`` as a JSON Schema and answers 400 (gateway/admission/engine_refusals.py cites
    it), so the gate refuses it before counting or charging it; these were counted as sent."""
    client, sg, vl, quotas, folder = env
    before = len(sg.state.requests)
    body = {"model": "cs", "messages": HI, "tools": [_tool(parameters)], "max_tokens": 16}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"] == {
        "message": "'tools[0].function.parameters' must be an object (a JSON Schema).",
        "type": "invalid_request_error",
        "param": "tools[0].function.parameters",
        "code": "invalid_request",
    }
    assert len(sg.state.requests) == before


def test_a_type_shortened_without_bound_is_counted_as_sent(env):
    """``"varchar(<4,000 words>)"`` is ``"string"`` to SGLang at the cited commit (76 tokens), but
    an SGLang from before the rewrite renders every word (11,077): counting only the rewritten
    form undercounted by the whole text; the gate keeps the larger."""
    words = " ".join(f"w{i}" for i in range(4000))
    tools = [_tool({"type": "object", "properties": {"a": {"type": f"varchar({words})"}}})]
    rewritten, as_sent = oracle(env, "cs", tools), unrewritten(env, "cs", tools)
    assert (rewritten, as_sent) == (76, 11077)
    assert gate_count(env, "cs", tools) == 11077


def test_sent_body_is_forwarded_unrewritten(env):
    """The engine gets the tools as sent (it rewrites them itself)."""
    client, sg, vl, quotas, folder = env
    tools = [_tool(int_schema(3))]
    r = client.post("/v1/chat/completions", json={"model": "cs", "messages": HI, "tools": tools, "max_tokens": 4})
    assert r.status_code == 200, r.text
    assert sg.state.requests[-1]["body"]["tools"] == tools


def test_a_schema_nested_past_the_comparison_is_a_400_not_a_500(env):
    """About 1,000 levels of ``properties`` (orjson reads up to 1,024): comparing the rewritten
    schema with the one sent recursed past the interpreter's limit before the template's own
    check, an internal error behind the tojson template; it is the usual 400 naming the tool."""
    client = env[0]
    deep = '{"properties": {"a": ' * 500 + '{"type": "object"}' + "}}" * 500
    body = (
        '{"model": "ts", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], '
        '"tools": [{"type": "function", "function": {"name": "get", "parameters": ' + deep + "}}]}"
    )
    r = client.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "tools[0]"


def test_deep_schema_through_the_app_is_never_a_500(env):
    client = env[0]
    deep: dict = {"type": "int"}
    for _ in range(300):
        deep = {"type": "object", "properties": {"a": deep}}
    r = client.post(
        "/v1/chat/completions", json={"model": "cs", "messages": HI, "tools": [_tool(deep)], "max_tokens": 4}
    )
    assert r.status_code in (200, 400), r.text


# ---- the tool-call dump ------------------------------------------------------------------------
#: a template that prints each tool call whole (``tool_call | tojson``)
DUMP_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "{% for tc in message.tool_calls or [] %}\n<tool_call>{{ tc | tojson }}</tool_call>{% endfor %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def dump_folder(tmp_path_factory):
    corpus = '{"id": "c1", "index": null, "type": "function", "function": {"name": "get", "arguments": {}}} user'
    return make_bpe_folder(tmp_path_factory.mktemp("dump"), DUMP_TEMPLATE, corpus, 600)


def test_tool_calls_are_counted_as_sglangs_dump(dump_folder):
    """SGLang prints a tool call as its pydantic dump: ``"index": null`` (and ``"id": null``,
    ``"type": "function"`` where left out) added, unknown keys dropped, arguments parsed."""
    from tokenizer.hf_counter import HFCounter

    calls = [
        {"id": "c1", "type": "function", "function": {"name": "get", "arguments": '{"v": 1}'}},
        {"function": {"name": "get", "arguments": "{}"}, "x_extra": "é"},
    ]
    messages = [*HI, {"role": "assistant", "content": None, "tool_calls": calls}, {"role": "user", "content": "ok"}]
    body = {"messages": messages}
    counts = {}
    for engine in ("sglang", "kvgate"):
        c = HFCounter(dump_folder)
        c.engines = frozenset({engine})
        counts[engine] = c.count_chat(messages)
        assert counts[engine] == hf_chat_tokens(dump_folder, body, engine=engine)
    bare = [
        *HI,
        {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "get", "arguments": "{}"}}]},
        {"role": "user", "content": "ok"},
    ]
    for engine in ("sglang", "kvgate"):
        c = HFCounter(dump_folder)
        c.engines = frozenset({engine})
        counts[engine] = c.count_chat(bare)
        assert counts[engine] == hf_chat_tokens(dump_folder, {"messages": bare}, engine=engine)
    assert counts["sglang"] > counts["kvgate"]  # id, index and type printed
    from tests.gate_oracle import sglang_messages

    assert json.dumps(sglang_messages(messages)[1]["tool_calls"]) == json.dumps(
        [
            {"id": "c1", "index": None, "type": "function", "function": {"name": "get", "arguments": {"v": 1}}},
            {"id": None, "index": None, "type": "function", "function": {"name": "get", "arguments": {}}},
        ]
    )
