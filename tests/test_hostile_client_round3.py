"""A hostile client, third round, against chat, completions, Responses and ``/tokenize`` through the
whole gateway (the app and mock engine of tests/test_hostile_routes.py, quotas in process): each
body below is an exact OpenAI-shaped 400 naming its field that reaches no engine and changes no
quota counter but the request's own RPM entry.

The findings this file holds fixed:

- a ``logit_bias`` key of non-ASCII digits (``"²"``: ``str.isdigit()`` is true, ``int()`` refuses
  it) was a 500 on chat and completions; ``"١"`` passed and was forwarded;
- an empty ``stop`` string, a chat ``tool_choice`` the engines do not take (``"bogus"``, an object
  of another type, a function without a name), a ``json_schema`` ``response_format`` without its
  ``json_schema`` object (or with a ``schema`` that is not an object), and a chat tool definition
  without a ``function`` holding a string ``name`` were admitted, charged and forwarded: the
  engines' own request models refuse each (vLLM ``SamplingParams._verify_args`` "stop cannot contain
  an empty string", the bundled backend's ``_stop``; vLLM's and SGLang's ``protocol.py``
  ``ChatCompletionNamedToolChoiceParam`` / ``ToolChoice``, ``JsonSchemaResponseFormat(name: str)``,
  ``FunctionDefinition(name: str)`` / ``Function(name: str)``), so the client got the engine's 400
  after its prompt had been charged against TPM (gateway/relay/finish.py: an engine's error is
  settled at the prompt as admitted);
- a completions ``prompt`` or an embeddings ``input`` of 0 tokens (``""``) was forwarded: vLLM
  refuses an empty prompt for generation and pooling alike
  (``vllm/v1/engine/input_processor.py``, ``InputProcessor._validate_prompt_len``), as does the
  bundled engine, and OpenAI's embeddings ``input`` "cannot be an empty string".
"""

from __future__ import annotations

from typing import Any

import openai
import pytest

from tests.gateway_harness import MODEL
from tests.test_gateway_api_routes import EMB, error_of, forwarded, sdk
from tests.test_hostile_routes import REFUSED, Ledger, _invalid, _post, _start

pytestmark = [pytest.mark.timeout(120), pytest.mark.engine("api")]

MSG = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
LOGIT_BIAS = (
    "Invalid value for 'logit_bias': must be an object of at most 300 token ids (as strings) mapping to numbers in "
    "[-100, 100]"
)
STOP = "Invalid value for 'stop': must not contain an empty string"
TOOL_CHOICE = (
    "Invalid value for 'tool_choice': must be none, auto, required or an object whose 'type' is function, custom, "
    "allowed_tools"
)


def _empty(param: str) -> str:
    return f"Invalid value for '{param}': the prompt is empty (0 tokens); engines refuse an empty prompt."


RESPONSE_FORMAT = (
    "Invalid value for 'response_format': of type json_schema needs 'json_schema': an object with 'name' (a string) "
    "and 'schema' (an object)"
)


@pytest.fixture(scope="module")
def gw(module_engine):
    g = _start(module_engine)
    yield g
    g.stop()


REFUSED_BODIES: list[tuple[str, str, dict[str, Any], dict[str, Any]]] = [
    # was a 500 (ValueError from int('²') in the vocabulary check)
    (
        "chat logit_bias superscript key",
        "/v1/chat/completions",
        {"messages": MSG, "logit_bias": {"²": 1}},
        _invalid(LOGIT_BIAS, "logit_bias"),
    ),
    (
        "completions logit_bias superscript key",
        "/v1/completions",
        {"prompt": "x", "logit_bias": {"5": 1, "²": 1}},
        _invalid(LOGIT_BIAS, "logit_bias"),
    ),
    # was forwarded with the key as sent
    (
        "chat logit_bias arabic-indic key",
        "/v1/chat/completions",
        {"messages": MSG, "logit_bias": {"١": 1}},
        _invalid(LOGIT_BIAS, "logit_bias"),
    ),
    ("chat stop ''", "/v1/chat/completions", {"messages": MSG, "stop": ""}, _invalid(STOP, "stop")),
    ("completions stop with ''", "/v1/completions", {"prompt": "x", "stop": ["a", ""]}, _invalid(STOP, "stop")),
    ("responses stop ['']", "/v1/responses", {"input": "x", "stop": [""]}, _invalid(STOP, "stop")),
    (
        "chat tool_choice unknown string",
        "/v1/chat/completions",
        {"messages": MSG, "tools": TOOLS, "tool_choice": "bogus"},
        _invalid(TOOL_CHOICE, "tool_choice"),
    ),
    (
        "chat tool_choice unknown type",
        "/v1/chat/completions",
        {"messages": MSG, "tools": TOOLS, "tool_choice": {"type": "x"}},
        _invalid(TOOL_CHOICE, "tool_choice"),
    ),
    (
        "chat tool_choice function without a name",
        "/v1/chat/completions",
        {"messages": MSG, "tools": TOOLS, "tool_choice": {"type": "function", "name": "f"}},
        _invalid(
            "Invalid value for 'tool_choice': 'function.name' must be a string for type 'function'", "tool_choice"
        ),
    ),
    (
        "chat response_format json_schema without json_schema",
        "/v1/chat/completions",
        {"messages": MSG, "response_format": {"type": "json_schema"}},
        _invalid(RESPONSE_FORMAT, "response_format"),
    ),
    (
        "chat response_format json_schema without a name",
        "/v1/chat/completions",
        {"messages": MSG, "response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
        _invalid(RESPONSE_FORMAT, "response_format"),
    ),
    (
        "chat response_format schema a string",
        "/v1/chat/completions",
        {"messages": MSG, "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": "s"}}},
        _invalid(RESPONSE_FORMAT, "response_format"),
    ),
    (
        "chat tool without function",
        "/v1/chat/completions",
        {"messages": MSG, "tools": [{"type": "function"}]},
        _invalid("'tools[0].function' must be an object with the function's 'name'.", "tools[0].function"),
    ),
    (
        "chat tool function without a name",
        "/v1/chat/completions",
        {"messages": MSG, "tools": [*TOOLS, {"type": "function", "function": {"name": 5}}]},
        _invalid("'tools[1].function.name' must be a string.", "tools[1].function.name"),
    ),
    (
        "tokenize tool without function",
        "/tokenize",
        {"messages": MSG, "tools": [{}]},
        _invalid("'tools[0].function' must be an object with the function's 'name'.", "tools[0].function"),
    ),
    # a prompt of 0 tokens (cl100k adds no BOS): vLLM's InputProcessor._validate_prompt_len refuses it
    ("completions prompt ''", "/v1/completions", {"prompt": ""}, _invalid(_empty("prompt"), "prompt")),
    (
        "completions prompt ['a', '']",
        "/v1/completions",
        {"prompt": ["a", ""]},
        _invalid(_empty("prompt[1]"), "prompt[1]"),
    ),
    ("embeddings input ''", "/v1/embeddings", {"model": EMB, "input": ""}, _invalid(_empty("input"), "input")),
    (
        "embeddings input ['']",
        "/v1/embeddings",
        {"model": EMB, "input": [""]},
        _invalid(_empty("input[0]"), "input[0]"),
    ),
    (
        "embeddings input ['a', '']",
        "/v1/embeddings",
        {"model": EMB, "input": ["a", ""]},
        _invalid(_empty("input[1]"), "input[1]"),
    ),
]


@pytest.mark.parametrize(("name", "path", "body", "error"), REFUSED_BODIES, ids=[c[0] for c in REFUSED_BODIES])
def test_a_body_the_engines_refuse_is_refused_at_the_edge_and_changes_nothing(
    gw, module_engine, name, path, body, error
):
    ledger = Ledger(gw, module_engine)
    r = _post(gw, path, {"model": MODEL, **body})
    assert (r.status_code, error_of(r)) == (400, error)
    assert ledger.delta() == REFUSED


def test_the_shapes_the_engines_take_still_pass_as_sent(gw, module_engine):
    """The neighbours of the refused bodies: a named tool choice, an ASCII token id, a non-empty
    stop: forwarded as sent. (A ``json_schema`` without its schema, and a forced tool call beside
    a ``response_format``, are refused: tests/test_engine_refusals_sweep.py.)"""
    body = {
        "model": MODEL,
        "messages": MSG,
        "max_tokens": 2,
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "f"}},
        "logit_bias": {"5": 1},
        "stop": ["a"],
    }
    r = _post(gw, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    sent = forwarded(module_engine, "/v1/chat/completions")[-1]
    assert {k: sent[k] for k in ("tools", "tool_choice", "logit_bias", "stop")} == {
        k: body[k] for k in ("tools", "tool_choice", "logit_bias", "stop")
    }


def test_the_openai_sdk_gets_a_bad_request_for_a_superscript_logit_bias_key(gw, module_engine):
    """Before: ``openai.InternalServerError`` (500 ``internal_error``) from the gateway itself."""
    ledger = Ledger(gw, module_engine)
    with pytest.raises(openai.BadRequestError) as e:
        sdk(gw).chat.completions.create(model=MODEL, messages=MSG, logit_bias={"²": 1})
    assert (e.value.status_code, e.value.code, e.value.param) == (400, "invalid_request", "logit_bias")
    assert ledger.delta() == REFUSED
