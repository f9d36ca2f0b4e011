"""Render as the engine renders (the gate's invariant for chat history): hypothesis bodies with
tool-call history (arguments with large floats, nesting, unicode, invalid or non-object JSON),
reasoning fields, trailing assistant turns, tool schemas with type aliases SGLang rewrites
(``normalize_json_schema_types``) and the prompt-changing fields, for every engine
policy and for a template that prints arguments with ``tojson``, through the real app.

The oracle (tests/gate_oracle.py) applies the engines' own pre-template steps, copied from their
source, to the body the engine RECEIVED and renders with ``transformers`` (tojson template) or
the ChatML specification; it never calls kvgate's counter. For every 200 the reservation equals
max(n) x (the largest engine-visible prompt + bound); where the oracle's engine would refuse the
body, the gateway answers 400 (naming the arguments' path when nothing else is wrong); every
other answer is an OpenAI-shaped 400 that forwarded and reserved nothing. Never a 500. A fixed
list of bodies, each with its outcome, covers every refusal and feature whatever the draws reach.
"""

from __future__ import annotations

import json
import os
import re
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.gate_oracle import EngineRefusal, engine_chat_tokens, hf_chat_tokens
from tests.render_env import ENGINES, HF_MODELS, LIMIT, render_env
from tokenizer.engine_render import sglang_schema

EXAMPLES = int(os.environ.get("RENDER_EXAMPLES", "2000"))

ALPHABET = st.sampled_from(list('ab xé日🙂"\\/\n\t{}[]:,0123456789.eE-+'))
small_text = st.text(ALPHABET, max_size=10)
word = st.sampled_from(["a", "b c", "Hello", " world", "é", "日本語", "🙂", "x\ny", ""])
text = st.lists(word, max_size=6).map("".join)
LARGE_FLOATS = [1e15, 1e16, 1e21, 1.5e300, 123456789.125, -0.0, 1e-7, 5e-324, 0.1]
leaf = st.one_of(
    st.sampled_from(LARGE_FLOATS),
    st.floats(allow_nan=False, allow_infinity=False),
    st.integers(-(2**63), 2**63 - 1),
    st.booleans(),
    st.none(),
    small_text,
)
json_value = st.recursive(
    leaf, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(small_text, inner, max_size=4), max_leaves=10
)
#: more than 4,300 digits: json raises ValueError
BIG_INTEGER_ARGUMENTS = '{"big": 1' + "0" * 5000 + "}"
#: argument strings the engines parse differently from how they were sent, or refuse
ODD_ARGUMENTS = [
    '{"v": [1e15, 1e15, 1e15]}',
    '{"v":1E+15,"w":-0.0}',
    '{"v": 100000000000000000000000}',  # beyond 64 bits: orjson refuses, json parses
    '{"a": NaN}',  # json parses, orjson refuses
    '{"a": 1e400}',
    "[1, 2]",
    "42",
    '"s"',
    "",
    "{not json",
    '{"a": 1} trailing',
    '{"deep": ' + "[" * 5 + "]" * 5 + "}",
    BIG_INTEGER_ARGUMENTS,
]


def _args_text(value: object, compact: bool) -> str:
    return json.dumps({"v": value}, separators=(",", ":") if compact else None, ensure_ascii=compact)


large_floats = st.lists(st.sampled_from(LARGE_FLOATS), min_size=1, max_size=6)
arguments = st.one_of(
    st.builds(_args_text, json_value, st.booleans()),
    st.builds(_args_text, large_floats, st.booleans()),
    st.sampled_from(ODD_ARGUMENTS),
)
tool_call = st.builds(
    lambda i, name, args: {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": args}},
    st.integers(0, 9),
    st.sampled_from(["get", "lookup_weather", "f"]),
    arguments,
)
content = st.one_of(
    text, st.none(), st.lists(st.builds(lambda t: {"type": "text", "text": t}, text), min_size=1, max_size=3)
)


def _assistant(c, calls, reasoning, reasoning_content, name):
    m = {"role": "assistant", "content": c}
    if calls is not None:
        m["tool_calls"] = calls
    if reasoning is not None:
        m["reasoning"] = reasoning
    if reasoning_content is not None:
        m["reasoning_content"] = reasoning_content
    if name:
        m["name"] = name
    return m


assistant = st.builds(
    _assistant,
    content,
    st.one_of(st.none(), st.lists(tool_call, max_size=3)),
    st.one_of(st.none(), text),
    st.one_of(st.none(), text),
    st.sampled_from([None, None, "bob"]),
)
message = st.one_of(
    st.builds(lambda c: {"role": "user", "content": c}, content),
    st.builds(lambda c: {"role": "system", "content": c}, text),
    st.builds(lambda c: {"role": "developer", "content": c}, text),
    assistant,
    assistant,
    st.builds(lambda c: {"role": "tool", "tool_call_id": "call_1", "content": c}, content),
)
#: type names SGLang rewrites (normalize_json_schema_types), leaves alone, or deduplicates
TYPE_NAMES = ["int", "integer", "INT32", "varchar(255)", "bool", "float64", "list[str]", "dict[str, int]", "internal"]
type_value = st.one_of(st.sampled_from(TYPE_NAMES), st.lists(st.sampled_from(TYPE_NAMES), max_size=3), st.just(5))
schema = st.recursive(
    st.builds(lambda t: {"type": t}, type_value),
    lambda inner: st.one_of(
        st.builds(
            lambda t, k, props: {"type": t, k: props},
            type_value,
            st.sampled_from(["properties", "$defs", "x-meta"]),
            st.dictionaries(st.sampled_from(["a", "b"]), inner, max_size=2),
        ),
        st.builds(lambda k, xs: {k: xs}, st.sampled_from(["anyOf", "prefixItems"]), st.lists(inner, max_size=2)),
        st.builds(lambda t, k, x: {"type": t, k: x}, type_value, st.sampled_from(["items", "not", "default"]), inner),
    ),
    max_leaves=5,
)
tool = st.one_of(
    st.builds(
        lambda n, default: {
            "type": "function",
            "function": {"name": n, "parameters": {"type": "object", "properties": {"v": {"default": default}}}},
        },
        st.sampled_from(["get", "lookup_weather"]),
        json_value,
    ),
    st.builds(
        lambda n, p: {"type": "function", "function": {"name": n, "parameters": p}},
        st.sampled_from(["get", "lookup_weather"]),
        schema,
    ),
    st.builds(
        lambda n, p: {"type": "function", "function": {"name": n, "parameters": {"type": "object", "properties": p}}},
        st.sampled_from(["get", "lookup_weather"]),
        st.dictionaries(st.sampled_from(["a", "b", "c"]), schema, min_size=1, max_size=3),
    ),
)
OPTIONAL: dict[str, st.SearchStrategy] = {
    "tools": st.lists(tool, min_size=1, max_size=2),
    "reasoning_effort": st.sampled_from(["low", "high", "none"]),
    "chat_template_kwargs": st.sampled_from([{"x": 1}, {"reasoning_effort": "max"}, {}]),
    "add_generation_prompt": st.booleans(),
    "continue_final_message": st.booleans(),
    "max_tokens": st.integers(1, 64),
    "n": st.integers(1, 3),
}


@st.composite
def body(draw):
    model = draw(st.sampled_from(sorted(ENGINES)))
    b = {"model": model, "messages": draw(st.lists(message, min_size=1, max_size=6))}
    for name in draw(st.lists(st.sampled_from(sorted(OPTIONAL)), max_size=3, unique=True)):
        b[name] = draw(OPTIONAL[name])
    return b


def _cost(part: dict) -> int:
    return 765


def oracle_count(model: str, got: dict, folder) -> int:
    """The largest prompt the model's engines hold for the received body (EngineRefusal if one
    of them would answer 400); SGLang as at the cited commit and as before its schema rewrite."""
    forms = [(e, rewrite) for e in ENGINES[model] for rewrite in ((True, False) if e == "sglang" else (True,))]
    if model in HF_MODELS:
        return max(hf_chat_tokens(folder, got, engine=e, rewrite_schema=r) for e, r in forms)
    agp = got.get("add_generation_prompt", True)
    return max(engine_chat_tokens(e, got, _cost, agp, rewrite_schema=r) for e, r in forms)


def refused_by_engines(model: str, sent: dict) -> str | None:
    """The path an engine of ``model`` would refuse in the SENT body (its arguments), else None."""
    for e in ENGINES[model]:
        try:
            if e in ("vllm", "sglang"):
                from tests.gate_oracle import engine_messages

                engine_messages(e, sent["messages"], chatml=True)
        except EngineRefusal as r:
            return r.param
    return None


def _schema_rewritten(b: dict) -> bool:
    """Whether SGLang serves ``b``'s model and rewrites one of its tool schemas."""
    tools = b.get("tools") or ()
    return "sglang" in ENGINES[b["model"]] and any(
        sglang_schema(t["function"].get("parameters")) != t["function"].get("parameters") for t in tools
    )


CONTEXT = re.compile(r"maximum context length is (\d+) tokens\. However, you requested (\d+) tokens \((\d+) in the")


@pytest.fixture(scope="module")
def env():
    with render_env() as e:
        yield e


def n1_history(floats_per_call: int = 40, calls: int = 6) -> list[dict]:
    """The N1 history: ``calls`` assistant tool calls whose arguments are ``{"v":[1e15,...]}``
    (2.5 KB in all), each answered by a tool message."""
    args = '{"v":[' + ",".join(["1e15"] * floats_per_call) + "]}"
    messages: list[dict] = [{"role": "user", "content": "hi"}]
    for i in range(calls):
        call = {"id": f"c{i}", "type": "function", "function": {"name": "get", "arguments": args}}
        messages += [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"c{i}", "content": "ok"},
        ]
    return [*messages, {"role": "user", "content": "go on"}]


@pytest.mark.parametrize("model", ["tv", "ts"])
def test_n1_float_arguments_are_counted_as_the_template_prints_them(env, model):
    """vLLM and SGLang parse the arguments and the template prints ``1e15`` as
    ``1000000000000000.0``: the history counts 1,638 tokens as sent (main admitted it against
    3,276) and 5,196 as rendered (the independent oracle). Refused with the rendered count."""
    client, sg, vl, quotas, folder = env
    body = {"model": model, "messages": n1_history(), "max_tokens": 16}
    assert len(json.dumps(body["messages"])) == 2485
    rendered = hf_chat_tokens(folder, body, engine=ENGINES[model][0])
    assert rendered == 5196
    before = (len(sg.state.requests), len(vl.state.requests), len(quotas.reserved))
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"] == {
        "message": f"This model's maximum context length is {LIMIT} tokens. However, you requested "
        f"{rendered + 16} tokens ({rendered} in the messages, 16 in the completion). "
        "Please reduce the length of the messages or completion.",
        "type": "invalid_request_error",
        "param": "messages",
        "code": "context_length_exceeded",
    }
    assert (len(sg.state.requests), len(vl.state.requests), len(quotas.reserved)) == before


def test_n1_history_as_sent_is_what_the_bundled_backend_renders(env):
    """The bundled backend (``kvgate``) and an OpenAI upstream take the arguments as sent:
    the same history is admitted at its as-sent size, 1,638 tokens."""
    client, sg, vl, quotas, folder = env
    for model in ("tk", "to"):
        body = {"model": model, "messages": n1_history(), "max_tokens": 16}
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        assert quotas.reserved[-1] == hf_chat_tokens(folder, body, engine=ENGINES[model][0]) + 16 == 1638 + 16


@pytest.mark.parametrize(
    ("model", "arguments"),
    [("ts", "{not json"), ("ts", "[1, 2]"), ("ts", '{"a": NaN}'), ("tv", BIG_INTEGER_ARGUMENTS)],
)
def test_arguments_the_engine_refuses_are_refused_naming_their_path(env, model, arguments):
    """SGLang refuses arguments that are not a JSON object (orjson: no NaN); vLLM an integer of
    more than 4,300 digits (json's ValueError): a 400 naming the arguments, nothing forwarded."""
    client, sg, vl, quotas, folder = env
    call = {"id": "c", "type": "function", "function": {"name": "get", "arguments": arguments}}
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]}]
    before = (len(sg.state.requests), len(vl.state.requests))
    r = client.post(
        "/v1/chat/completions", json={"model": model, "messages": [*messages, {"role": "user", "content": "x"}]}
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages[1].tool_calls[0].function.arguments" and err["type"] == "invalid_request_error"
    assert (len(sg.state.requests), len(vl.state.requests)) == before


def check_body(env, b: dict, stats: dict[str, int], covered: dict[str, int]) -> str:
    """The property for one body ``b``: admitted and counted as the oracle renders what the engine
    received (``"200"``), refused where an engine would refuse it (``"engine_refusal"``), or another
    400 that forwarded and reserved nothing (``"400"``). Tallies ``stats`` and ``covered``."""
    client, sg, vl, quotas, folder = env
    stats["examples"] += 1
    before = (len(sg.state.requests), len(vl.state.requests), len(quotas.reserved))
    refusal = refused_by_engines(b["model"], b)
    r = client.post("/v1/chat/completions", json=b)
    received = sg.state.requests[before[0] :] + vl.state.requests[before[1] :]
    if r.status_code == 200:
        stats["200"] += 1
        assert refusal is None, (refusal, b)
        assert len(received) == 1 and len(quotas.reserved) == before[2] + 1
        got = received[0]["body"]
        bound = got.get("max_tokens") or got.get("max_completion_tokens")
        seqs = got.get("n") or 1
        expected = seqs * (oracle_count(b["model"], got, folder) + bound)
        assert quotas.reserved[-1] == expected, (quotas.reserved[-1], expected, b)
        for m in b["messages"]:
            for c in m.get("tool_calls") or ():
                covered["tool_call"] = covered.get("tool_call", 0) + 1
                if "e15" in c["function"]["arguments"] or "1000000000000000" in c["function"]["arguments"]:
                    covered["large_float"] = covered.get("large_float", 0) + 1
        if _schema_rewritten(b):
            covered["schema_rewritten"] = covered.get("schema_rewritten", 0) + 1
        covered[b["model"]] = covered.get(b["model"], 0) + 1
        if b["messages"][-1]["role"] == "assistant":
            covered["trailing_assistant"] = covered.get("trailing_assistant", 0) + 1
        return "200"
    stats["400"] += 1
    assert r.status_code == 400, (r.status_code, r.text)
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and isinstance(err["param"], str) and err["param"], err
    assert received == [] and len(quotas.reserved) == before[2]
    if err.get("code") == "context_length_exceeded" and (m := CONTEXT.search(err["message"])):
        stats["over_context"] += 1
        assert int(m.group(1)) == LIMIT
    if refusal is None:
        return "400"
    stats["engine_refusals"] += 1
    if set(b) == {"model", "messages"} and err["param"].endswith(".arguments"):
        assert err["param"] == refusal, (err, refusal)
    return "engine_refusal"


def _new_stats() -> dict[str, int]:
    return {"examples": 0, "200": 0, "400": 0, "engine_refusals": 0, "over_context": 0}


#: the ODD_ARGUMENTS each engine refuses: SGLang what orjson does not parse to an object,
#: vLLM an integer of more than 4,300 digits (json's ValueError)
REFUSED_ARGUMENTS = {
    "sglang": {'{"a": NaN}', '{"a": 1e400}', "[1, 2]", "42", '"s"', "", "{not json", '{"a": 1} trailing'}
    | {BIG_INTEGER_ARGUMENTS},
    "vllm": {BIG_INTEGER_ARGUMENTS},
}
SCHEMA_SGLANG_REWRITES = {"type": "object", "properties": {"a": {"type": "int"}, "b": {"type": "varchar(255)"}}}


def fixed_bodies() -> list[tuple[dict, str]]:
    """Bodies the draws may or may not reach, with the outcome each must have: every odd argument
    string on every model (a 400 naming it where one of the model's engines refuses it, over the
    context where the model's template is the tiny BPE's and nothing refuses 5,001 digits), and per
    model a large-float tool-call history ending in an assistant turn with a tool schema SGLang
    rewrites (admitted)."""
    out = []
    for model in sorted(ENGINES):
        for args in ODD_ARGUMENTS:
            call = {"id": "c", "type": "function", "function": {"name": "get", "arguments": args}}
            messages = [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "user", "content": "x"},
            ]
            if any(args in REFUSED_ARGUMENTS.get(e, ()) for e in ENGINES[model]):
                outcome = "engine_refusal"
            else:  # the 5,001 digits as sent are over the context in the tiny BPE's tokens
                outcome = "400" if args == BIG_INTEGER_ARGUMENTS and model in HF_MODELS else "200"
            out.append(({"model": model, "messages": messages}, outcome))
        call = {"id": "c", "type": "function", "function": {"name": "get", "arguments": ODD_ARGUMENTS[0]}}
        body = {
            "model": model,
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c", "content": "ok"},
                {"role": "assistant", "content": "done"},
            ],
            "tools": [{"type": "function", "function": {"name": "get", "parameters": SCHEMA_SGLANG_REWRITES}}],
            "max_tokens": 16,
        }
        out.append((body, "200"))
    return out


@pytest.mark.timeout(240)
def test_chat_history_is_counted_as_each_engine_renders_it(env):
    """The property over :func:`fixed_bodies`, each with its outcome (so the refusals and every
    feature are covered whatever the draws are), then over ``EXAMPLES`` hypothesis bodies. The
    draws mix in constants Hypothesis collects from the modules imported so far, so what they
    reach changes with the tests run before; their floors only ask that they reach every case."""
    t0 = time.monotonic()
    fixed, fixed_covered = _new_stats(), {}
    for b, outcome in fixed_bodies():
        assert check_body(env, b, fixed, fixed_covered) == outcome, (outcome, b)
    assert fixed == {"examples": 126, "200": 95, "400": 31, "engine_refusals": 29, "over_context": 2}, fixed
    # admitted per model: 13 argument strings + the feature body, less the ones refused or over the context
    per_model = {"ts": 5, "tmix": 5, "cs": 5, "tv": 13, "cv": 13, "tk": 13, "to": 13, "ck": 14, "co": 14}
    assert fixed_covered == {
        "tool_call": 95,
        "large_float": 29,
        "trailing_assistant": 9,
        "schema_rewritten": 3,
        **per_model,
    }, fixed_covered

    stats, covered = _new_stats(), {}

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(body())
    def one(b):
        check_body(env, b, stats, covered)

    one()
    print(
        f"\ngate render property ({round(time.monotonic() - t0, 1)} s): fixed {fixed}; drawn {stats}; "
        f"drawn and admitted with: {dict(sorted(covered.items()))}"
    )
    assert stats["examples"] >= EXAMPLES and stats["200"] >= 400 and stats["engine_refusals"] >= 1
    for feature in ("tool_call", "large_float", "trailing_assistant", "schema_rewritten", *ENGINES):
        assert covered.get(feature, 0) >= 1, (feature, covered)


def test_tokenize_counts_the_history_as_the_engine_renders_it(env):
    """``/tokenize`` with messages answers the gate's count: the rendered one (5,196 + the
    generation prompt is in it), for vLLM and SGLang models alike; the bundled backend's as sent."""
    client, sg, vl, quotas, folder = env
    for model, expected in (("tv", 5196), ("ts", 5196), ("tk", 1638)):
        r = client.post("/tokenize", json={"model": model, "messages": n1_history()})
        assert r.status_code == 200, r.text
        assert r.json()["count"] == expected == len(r.json()["tokens"])


def test_responses_function_call_arguments_are_parsed_as_the_engine_parses_them(env):
    """``/v1/responses`` ``function_call`` items become tool calls: arguments SGLang refuses are
    a 400 naming the item's ``arguments``; the N1 floats are counted as rendered."""
    client, sg, vl, quotas, folder = env
    items = [
        {"role": "user", "content": "hi"},
        {"type": "function_call", "call_id": "c1", "name": "get", "arguments": "[1, 2]"},
        {"type": "function_call_output", "call_id": "c1", "output": "ok"},
    ]
    r = client.post("/v1/responses", json={"model": "ts", "input": items})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "input[1].arguments"
    args = '{"v":[' + ",".join(["1e15"] * 40) + "]}"
    items = [{"role": "user", "content": "hi"}]
    for i in range(6):
        items += [
            {"type": "function_call", "call_id": f"c{i}", "name": "get", "arguments": args},
            {"type": "function_call_output", "call_id": f"c{i}", "output": "ok"},
        ]
    r = client.post("/v1/responses", json={"model": "tv", "input": items, "max_output_tokens": 16})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "context_length_exceeded"
