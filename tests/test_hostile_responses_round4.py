"""A hostile client against ``/v1/responses``, fourth round, through the whole gateway (real app on
a free port, the API mock engine of tests/mock_api_engine.py, quotas in process): each finding is
an exact 400 that reaches no engine and changes no quota counter but the request's own RPM entry,
or a count that is no longer below what the engine renders.

The findings this file holds fixed (the engine's behaviour read from vLLM's
``vllm/entrypoints/openai/responses/utils.py`` and ``responses/protocol.py`` and OpenAI's SDK
types, as the comments of gateway/routes/responses.py cite them):

- a message item's key beyond OpenAI's (``name``, ``reasoning_content``, ``tool_calls``) was
  admitted and dropped from the count, while vLLM hands a user/system/developer message item to
  its chat parser as sent (it keeps ``name`` for the template) and SGLang / older vLLM do so with
  an assistant one too: a prompt larger than the gate counted;
- a ``function_call``'s ``namespace`` was admitted and not counted, while vLLM renders the call's
  name as ``<namespace>__<name>``;
- function ``tools`` were counted without the ``null`` fields of OpenAI's ``FunctionTool``
  (``strict``, ``defer_loading``, ...) that vLLM's Responses path hands the template;
- ``service_tier`` (any string), ``include`` (``web_search_call.*``) and a ``tool_choice`` naming
  a tool not in ``tools`` passed the gate and were vLLM's 400 after the prompt was charged.
"""

from __future__ import annotations

from typing import Any

import pytest

from gateway.quotas.tenant_quotas import build_quota_stage
from tests.gateway_harness import MODEL, Gateway, tenants
from tests.test_gateway_api_routes import EMB, LIMIT, api_settings, error_of, forwarded
from tests.test_hostile_routes import REFUSED, Ledger, _invalid, _post
from tokenizer import bundled_counter

pytestmark = [pytest.mark.timeout(120), pytest.mark.engine("api")]

LIMITS = {"rpm": 10**6, "tpm": 10**9, "max_concurrent": 64}


def _start(engine: Any, engine_kind: str | None = None) -> Gateway:
    """The gateway of tests/test_hostile_routes.py (quotas in process, an hour's window), its one
    upstream declared as ``engine_kind`` (default: the mock's pool source, ``sglang``)."""
    s = api_settings(engine, up={"engine": engine_kind} if engine_kind else None, quotas=True)
    s.quotas.window_seconds = 3600
    reg = tenants(max_context_tokens=LIMIT, allowed_models=[MODEL, EMB], **LIMITS)
    return Gateway(s, reg, quotas=build_quota_stage(s)).start()


@pytest.fixture(scope="module")
def gw(module_engine):
    g = _start(module_engine)
    yield g
    g.stop()


def _unknown(i: int, key: str) -> dict:
    param = f"input[{i}].{key}"
    return _invalid(
        f"Unknown parameter: '{param}'. A message item holds only content, id, phase, role, status, type; the "
        "engine would pass other keys on to the chat template, a prompt kvgate did not count.",
        param,
    )


USER = {"role": "user", "content": "hi"}
TOOL = {"type": "function", "name": "add", "parameters": {"type": "object"}}
FOUND: list[tuple[str, dict, dict]] = [
    ("user message with name", {"input": [{**USER, "name": "bob" * 20}]}, _unknown(0, "name")),
    (
        "typed system message with name",
        {"input": [{"type": "message", "role": "system", "content": "s", "name": "n"}, USER]},
        _unknown(0, "name"),
    ),
    (
        "assistant message with reasoning_content",
        {"input": [USER, {"role": "assistant", "content": "a", "reasoning_content": "long " * 40}, USER]},
        _unknown(1, "reasoning_content"),
    ),
    (
        "user message with tool_calls",
        {"input": [{**USER, "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f"}}]}]},
        _unknown(0, "tool_calls"),
    ),
    (
        "function_call with a namespace",
        {
            "input": [
                USER,
                {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}", "namespace": "x" * 50},
            ]
        },
        _invalid(
            "'input[1].namespace' is not supported: kvgate serves 'function' tools only, and the engine would render "
            "the call's name with its namespace, a prompt kvgate did not count.",
            "input[1].namespace",
        ),
    ),
    (
        "service_tier outside vLLM's",
        {"input": "x", "service_tier": "ultra"},
        _invalid(
            "Invalid value for 'service_tier': must be one of auto, default, flex, scale, priority", "service_tier"
        ),
    ),
    (
        "service_tier the SDK knows, vLLM not",
        {"input": "x", "service_tier": "fast"},
        _invalid(
            "Invalid value for 'service_tier': must be one of auto, default, flex, scale, priority", "service_tier"
        ),
    ),
    (
        "include web search results",
        {"input": "x", "include": ["web_search_call.results"]},
        _invalid(
            "Invalid value for 'include': must be an array of code_interpreter_call.outputs, "
            "computer_call_output.output.image_url, file_search_call.results, message.input_image.image_url, "
            "message.output_text.logprobs, reasoning.encrypted_content",
            "include",
        ),
    ),
    (
        "tool_choice names a tool not in tools",
        {"input": "x", "tools": [TOOL], "tool_choice": {"type": "function", "name": "sub"}},
        _invalid("'tool_choice' names the function tool 'sub', which is not in 'tools'.", "tool_choice"),
    ),
    (
        "tool_choice custom, only function tools",
        {"input": "x", "tools": [TOOL], "tool_choice": {"type": "custom", "name": "add"}},
        _invalid("'tool_choice' names the custom tool 'add', which is not in 'tools'.", "tool_choice"),
    ),
]


@pytest.mark.parametrize(("name", "body", "error"), FOUND, ids=[f[0] for f in FOUND])
def test_a_hostile_responses_body_is_an_exact_refusal_that_changes_nothing(gw, module_engine, name, body, error):
    """Before: each of these was 200 (forwarded; charged). Now a 400 naming the field."""
    ledger = Ledger(gw, module_engine)
    r = _post(gw, "/v1/responses", {"model": MODEL, **body})
    assert (r.status_code, error_of(r)) == (400, error)
    assert ledger.delta() == REFUSED


ADMITTED: list[tuple[str, dict]] = [
    (
        "an output message replayed with its id, status and annotations",
        {
            "input": [
                USER,
                {
                    "type": "message",
                    "id": "msg_1",
                    "role": "assistant",
                    "status": "completed",
                    "phase": "final_answer",
                    "content": [{"type": "output_text", "text": "A", "annotations": []}],
                },
                {"type": "message", "role": "user", "status": "completed", "content": "more"},
            ]
        },
    ),
    (
        "a function call replayed with id and status, namespace null",
        {
            "input": [
                USER,
                {"type": "function_call", "id": "fc_1", "status": "completed", "call_id": "c", "name": "add"}
                | {"arguments": "{}", "namespace": None},
                {"type": "function_call_output", "call_id": "c", "output": "3"},
            ],
            "tools": [TOOL],
        },
    ),
    (
        "tool_choice naming a tool in tools",
        {"input": "x", "tools": [TOOL], "tool_choice": {"type": "function", "name": "add"}},
    ),
    (
        "service_tier priority, include logprobs",
        {"input": "x", "service_tier": "priority", "include": ["message.output_text.logprobs"]},
    ),
]


@pytest.mark.parametrize(("name", "body"), ADMITTED, ids=[a[0] for a in ADMITTED])
def test_what_openai_and_the_engines_take_is_still_admitted(gw, module_engine, name, body):
    r = _post(gw, "/v1/responses", {"model": MODEL, "max_output_tokens": 4, **body})
    assert r.status_code == 200, r.text
    assert forwarded(module_engine, "/v1/responses")[-1]["input"] == body["input"]


def _vllm_tool_dicts(tools: list[dict]) -> list[dict]:
    """What vLLM's Responses path hands the chat template for ``tools`` (``construct_tool_dicts``):
    each ``FunctionTool.model_dump()`` less ``type``, as a ``FunctionDefinition`` (declared fields,
    then the others in order) inside ``{"type": "function", "function": ...}``; from OpenAI's SDK."""
    from openai.types.responses import FunctionTool

    out = []
    for t in tools:
        dumped = FunctionTool.model_validate(t).model_dump()
        fn = {"name": dumped["name"], "description": dumped["description"], "parameters": dumped["parameters"]}
        fn.update((k, v) for k, v in dumped.items() if k not in fn and k != "type")
        out.append({"type": "function", "function": fn})
    return out


def test_function_tools_are_counted_as_vllm_hands_them_to_the_template(engine):
    """A ``vllm`` upstream: the gate counted ``{"name", "description", "parameters"}`` per tool,
    vLLM's template gets ``"strict": null`` and the other unset ``FunctionTool`` fields too (with
    kvgate's ChatML, one tool: 53 counted, 57 rendered with ``strict`` alone, 82 with the newest
    SDK's fields; these two tools: 85 counted, 139 rendered). Now the gate's count is the
    rendering of vLLM's tool dicts."""
    tools = [TOOL, {"type": "function", "name": "log", "description": "Log it.", "strict": True}]
    g = _start(engine, "vllm")
    try:
        vllm = bundled_counter()
        vllm.engines = frozenset({"vllm"})
        rendered = vllm.count_chat([{"role": "user", "content": "x"}], _vllm_tool_dicts(tools))
        ledger = Ledger(g, engine)
        r = _post(g, "/v1/responses", {"model": MODEL, "input": "x", "tools": tools, "max_output_tokens": 4})
        assert r.status_code == 200, r.text
        counted = ledger.delta()["counted"]
        assert counted == rendered
        assert forwarded(engine, "/v1/responses")[-1]["tools"] == tools  # the body itself is sent as it came
    finally:
        g.stop()


def test_other_engines_count_function_tools_as_before(gw, module_engine):
    """The ``null`` fields are a vLLM rendering: an ``sglang`` upstream's count is unchanged (its
    own dump, :func:`tokenizer.engine_render.sglang_tool`)."""
    from tokenizer.responses import count_responses, responses_to_chat

    sglang = bundled_counter()
    sglang.engines = frozenset({"sglang"})
    expected = count_responses(sglang, responses_to_chat("x", tools=[TOOL]))
    ledger = Ledger(gw, module_engine)
    r = _post(gw, "/v1/responses", {"model": MODEL, "input": "x", "tools": [TOOL], "max_output_tokens": 4})
    assert r.status_code == 200 and ledger.delta()["counted"] == expected
