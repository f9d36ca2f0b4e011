"""Values nested a thousand levels deep, through the real gateway app. orjson reads JSON nested up to
1,024 levels and Python recurses about 1,000 frames deep, so a recursive walk over a parsed value
(or ``str()`` of one) is a ``RecursionError`` such a value can raise.

- **client side**: every route (chat, completions, Responses, embeddings, ``/tokenize``,
  ``/detokenize``) with a list or an object nested 1,000 levels in each place a client puts a
  value (message contents and parts, names, tool definitions and parameters, tool call
  arguments, tool results, ``tool_choice``, ``response_format``, ``metadata``, an unknown
  extension field, Responses input items, ...), verifier sampling on, a strict tenant, quotas on
  Redis: an OpenAI-shaped 400 naming the place, nothing forwarded, no token charged (the RPM
  entry is spent, as for every answered request: docs/quotas.md), nothing logged at error level.
  Nested 1,025 levels (past orjson): the parse error, a clean 400.
- **engine side**: a hostile engine answering chat, completions and ``/v1/responses``, whole and
  streamed, and its error answers (an error object under 4xx or 200, SGLang's flat error,
  FastAPI's ``detail``, error events, ``response.failed`` / ``response.incomplete``), with a list
  or an object nested 1,000 levels in place of each field in turn (and of a field added to each
  object), to a strict tenant and a sampled one: the gateway answers as for the same value nested
  2 levels (relayed, refused as a malformed answer, the engine's error), a victim tenant's passage
  at the bottom of the value is withheld from the strict tenant as the shallow one is, and the
  strict tenant never receives a word of it (nor from a stream event that is an array or a
  string, or a Responses event whose ``type`` is not an event type). Never a 500, nothing logged
  at error level, no verifier job fault.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import orjson
import pytest
from test_verifier_fields import MARK, key_of, tenant_file, victim_passage

from gateway.quotas.tenant_quotas import build_quota_stage
from tests.fixtures.leak_stack import leak_stack
from tests.fixtures.redis_keys import REDIS_URL, delete_prefix, new_prefix
from tests.gateway_harness import MODEL, SECRETS, Gateway, settings_for, tenants, upstream
from tests.quota_fixtures import quota_state
from tests.test_verifier_hostile_engine import Script, build_engine, send
from verifier.build import build_verifier
from verifier.engine_response import parse_response_body, parse_response_event
from verifier.service import VerifierService

pytestmark = [pytest.mark.timeout(60), pytest.mark.engine("api")]

#: nesting of the hostile values: what orjson reads with room for the place they sit in, and one
#: level past what it reads at all
DEEP, PAST_ORJSON = 1000, 1025
#: the placeholder a place's value is spliced in for (bodies are built as text: Python's json
#: module recurses too)
HOLE = "__deep_value__"


def nested(kind: str, depth: int, inner: str = '"x"') -> str:
    """``inner`` (JSON text) inside ``depth`` lists (``kind`` ``list``) or objects (``{"k": ...}``)."""
    if kind == "list":
        return "[" * depth + inner + "]" * depth
    return '{"k":' * depth + inner + "}" * depth


def splice(template: Any, value: str) -> str:
    """``template`` as JSON text with its one :data:`HOLE` string replaced by the JSON text ``value``."""
    text = json.dumps(template)
    assert text.count(json.dumps(HOLE)) == 1
    return text.replace(json.dumps(HOLE), value)


def errors_logged(records: list[logging.LogRecord]) -> list[str]:
    """Records at error level or above, or carrying a ``RecursionError``, as their messages."""
    return [
        r.getMessage()
        for r in records
        if r.levelno >= logging.ERROR
        or "RecursionError" in r.getMessage()
        or (r.exc_info is not None and r.exc_info[0] is RecursionError)
    ]


# ====================================================================== client side
EMB = "embed-tiny"
U = {"role": "user", "content": "Say hello."}
FN = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
RFN = {"type": "function", "name": "f", "parameters": {"type": "object"}}


def _called(arguments: Any, result: Any = "r") -> list[dict]:
    """A user turn, an assistant tool call with ``arguments``, the tool's ``result``."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return [
        U,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": result},
    ]


def _rcalled(arguments: Any, output: Any = "r") -> list[dict]:
    return [
        {"role": "user", "content": "x"},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": arguments},
        {"type": "function_call_output", "call_id": "c1", "output": output},
    ]


#: the ``param`` of a place whose deep value passes validation: the body is refused when it is
#: written for the engine (orjson writes 254 levels), "nested too deeply to forward", ``param`` null
FORWARD = None
#: route -> place -> (the body's fields around the place's HOLE, the 400's ``param`` for nested
#: lists, for nested objects)
PLACES: dict[str, dict[str, tuple[dict, str | None, str | None]]] = {
    "/v1/chat/completions": {
        "content": ({"messages": [{"role": "user", "content": HOLE}]}, "messages[0].content[0]", "messages[0].content"),
        "content_part_text": (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": HOLE}]}]},
            "messages[0].content[0].text",
            "messages[0].content[0].text",
        ),
        "content_part_extra_key": (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "extra": HOLE}]}]},
            FORWARD,
            FORWARD,
        ),
        "message_name": (
            {"messages": [{"role": "user", "content": "x", "name": HOLE}]},
            "messages[0].name",
            "messages[0].name",
        ),
        "message_extra_key": (
            {"messages": [{"role": "user", "content": "x", "extra": HOLE}]},
            "messages[0].extra",
            "messages[0].extra",
        ),
        "message": ({"messages": [HOLE]}, "messages[0]", "messages[0].k"),
        "tool_call_arguments": (
            {"messages": _called(HOLE)},
            "messages[1].tool_calls[0].function",
            "messages[1].tool_calls[0].function",
        ),
        "tool_call_function": (
            {
                "messages": [
                    U,
                    {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": HOLE}]},
                ]
            },
            "messages[1].tool_calls[0]",
            "messages[1].tool_calls[0].function",
        ),
        "tool_result": ({"messages": _called("{}", HOLE)}, "messages[2].content[0]", "messages[2].content"),
        "tool_parameters": (
            {"messages": [U], "tools": [{"type": "function", "function": {"name": "f", "parameters": HOLE}}]},
            "tools[0].function.parameters",
            "tools[0]",
        ),
        "tool_extra_key": ({"messages": [U], "tools": [{**FN, "extra": HOLE}]}, "tools[0]", "tools[0]"),
        "functions": ({"messages": [U], "functions": [{"name": "f", "parameters": HOLE}]}, FORWARD, FORWARD),
        "tool_choice": (
            {"messages": [U], "tools": [FN], "tool_choice": {"type": "function", "function": {"name": "f", "x": HOLE}}},
            "tool_choice",
            "tool_choice",
        ),
        "response_format_schema": (
            {"messages": [U], "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": HOLE}}},
            "response_format",
            "response_format",
        ),
        "metadata": ({"messages": [U], "metadata": {"k": HOLE}}, "metadata", "metadata"),
        "unknown_field": ({"messages": [U], "my_extension": HOLE}, "my_extension", "my_extension"),
        "stop": ({"messages": [U], "stop": HOLE}, "stop", "stop"),
        "logit_bias": ({"messages": [U], "logit_bias": HOLE}, "logit_bias", "logit_bias"),
        "prediction": ({"messages": [U], "prediction": HOLE}, "prediction", FORWARD),
        "chat_template_kwargs": (
            {"messages": [U], "chat_template_kwargs": {"enable_thinking": HOLE}},
            "chat_template_kwargs",
            "chat_template_kwargs",
        ),
        "stream_options": (
            {"messages": [U], "stream": True, "stream_options": HOLE},
            "stream_options",
            "stream_options",
        ),
    },
    "/v1/completions": {
        "prompt": ({"prompt": HOLE}, "prompt[0]", "prompt"),
        "response_format_schema": (
            {"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": HOLE}}},
            "response_format",
            "response_format",
        ),
        "json_schema": ({"prompt": "x", "json_schema": HOLE}, "json_schema", "json_schema"),
        "metadata": ({"prompt": "x", "metadata": HOLE}, "metadata", "metadata"),
        "unknown_field": ({"prompt": "x", "my_extension": HOLE}, "my_extension", "my_extension"),
        "stop": ({"prompt": "x", "stop": HOLE}, "stop", "stop"),
        "suffix": ({"prompt": "x", "suffix": HOLE}, "suffix", "suffix"),
    },
    "/v1/responses": {
        "input": ({"input": HOLE}, "input[0]", "input"),
        "input_content": ({"input": [{"role": "user", "content": HOLE}]}, "input[0].content[0]", "input[0].content"),
        "input_part_text": (
            {"input": [{"role": "user", "content": [{"type": "input_text", "text": HOLE}]}]},
            "input[0].content[0].text",
            "input[0].content[0].text",
        ),
        "input_part_extra_key": (
            {"input": [{"role": "user", "content": [{"type": "input_text", "text": "x", "extra": HOLE}]}]},
            FORWARD,
            FORWARD,
        ),
        "input_item_extra_key": (
            {"input": [{"role": "user", "content": "x", "extra": HOLE}]},
            "input[0].extra",
            "input[0].extra",
        ),
        "function_call_arguments": ({"input": _rcalled(HOLE)}, "input[1].arguments", "input[1].arguments"),
        "function_call_output": ({"input": _rcalled("{}", HOLE)}, "input[2].output[0]", "input[2].output"),
        "instructions": ({"input": "x", "instructions": HOLE}, "instructions", "instructions"),
        "tool_parameters": (
            {"input": "x", "tools": [{"type": "function", "name": "f", "parameters": HOLE}]},
            "tools[0].parameters",
            "tools[0]",
        ),
        "tool_extra_key": ({"input": "x", "tools": [{**RFN, "extra": HOLE}]}, "tools[0]", "tools[0]"),
        "tool_choice": ({"input": "x", "tools": [RFN], "tool_choice": HOLE}, "tool_choice", "tool_choice"),
        "text_format_schema": (
            {"input": "x", "text": {"format": {"type": "json_schema", "name": "n", "schema": HOLE}}},
            "text",
            "text",
        ),
        "reasoning": ({"input": "x", "reasoning": HOLE}, "reasoning", "reasoning"),
        "metadata": ({"input": "x", "metadata": HOLE}, "metadata", "metadata"),
        "unknown_field": ({"input": "x", "my_extension": HOLE}, "my_extension", "my_extension"),
    },
    "/v1/embeddings": {
        "input": ({"input": HOLE}, "input[0]", "input"),
        "input_item": ({"input": [HOLE]}, "input[0]", "input"),
        "unknown_field": ({"input": "x", "my_extension": HOLE}, "my_extension", "my_extension"),
        "dimensions": ({"input": "x", "dimensions": HOLE}, "dimensions", "dimensions"),
    },
    "/tokenize": {
        "prompt": ({"prompt": HOLE}, "prompt", "prompt"),
        "messages_content": (
            {"messages": [{"role": "user", "content": HOLE}]},
            "messages[0].content[0]",
            "messages[0].content",
        ),
        "tool_parameters": (
            {"messages": [U], "tools": [{"type": "function", "function": {"name": "f", "parameters": HOLE}}]},
            "tools[0].function.parameters",
            "tools[0]",
        ),
        "unknown_field": ({"prompt": "x", "my_extension": HOLE}, "my_extension", "my_extension"),
    },
    "/detokenize": {
        "tokens": ({"tokens": HOLE}, "tokens", "tokens"),
        "unknown_field": ({"tokens": [1], "my_extension": HOLE}, "my_extension", "my_extension"),
    },
}
#: each route's fields around its places
ROUTE_BASE = {
    "/v1/chat/completions": {"model": MODEL, "max_tokens": 5},
    "/v1/completions": {"model": MODEL, "max_tokens": 5},
    "/v1/responses": {"model": MODEL, "max_output_tokens": 5},
    "/v1/embeddings": {"model": EMB},
    "/tokenize": {"model": MODEL},
    "/detokenize": {"model": MODEL},
}


def past_limit_message(text: str) -> str:
    """orjson's words for ``text`` nesting past 1,024 levels: it stops one character past the
    1,025th ``[`` or ``{`` outside strings."""
    depth, in_string, escaped = 0, False, False
    for i, ch in enumerate(text):
        if in_string:
            escaped, in_string = (False, in_string) if escaped else (ch == "\\", ch != '"')
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth == 1025:
                return f"depth limit exceeded: line 1 column {i + 2} (char {i + 1})"
        elif ch in "]}":
            depth -= 1
    raise AssertionError("not nested past 1,024 levels")


@pytest.fixture(scope="module")
def client_gw(module_engine) -> Iterator[tuple[Gateway, Any]]:
    """A gateway on the api mock engine (SGLang; ``MODEL`` and the embedding model ``EMB``), the
    verifier on, tenant-a strict and sampled at 1.0, quotas on the shared Redis under a key
    prefix of its own; and its quota store."""
    prefix = new_prefix("deep_nesting")
    s = settings_for(
        [{**upstream("u1", module_engine), "models": [MODEL, EMB]}],
        gateway={"max_body_bytes": 1 << 16},
        models=[{"id": EMB, "context_length": 8192, "task": "embedding"}],
        verifier={"enabled": True, "strict_holdback_tokens": 16},
        quotas={"enabled": True, "window_seconds": 60},
    )
    s.redis_url = REDIS_URL
    stage = build_quota_stage(s, key_prefix=prefix)
    registry = tenants(
        allowed_models=[MODEL, EMB],
        max_context_tokens=None,
        strict_verify=True,
        verify_sample_rate=1.0,
        rpm=100_000,
        tpm=1_000_000,
    )
    g = Gateway(s, registry, verifier=build_verifier(s, secrets=SECRETS), quotas=stage).start()
    try:
        yield g, stage.store
    finally:
        g.stop()
        delete_prefix(prefix)


@pytest.mark.parametrize("kind", ["list", "obj"])
@pytest.mark.parametrize("route", list(PLACES))
def test_a_client_value_nested_1000_or_1025_levels_is_a_clean_400(client_gw, module_engine, caplog, route, kind):
    """Each place of ``route`` holding a value nested :data:`DEEP` levels: the 400 naming it
    (``param``; a value that passes validation is refused when the body cannot be written back
    for the engine), then :data:`PAST_ORJSON` levels: orjson's parse error, ``param`` null. Nothing
    forwarded, the tenant's TPM untouched and no lease left, one RPM entry per request; nothing
    logged at error level."""
    g, store = client_gw
    redis_server = SimpleNamespace(port=int(REDIS_URL.rsplit(":", 1)[1].split("/")[0]))
    before = quota_state(redis_server, store, "tenant-a")
    forwarded = len(module_engine.state.requests)
    caplog.set_level(logging.INFO)
    wrong: list[Any] = []
    sent = 0
    with g.client() as c:
        for place, (fields, param_list, param_obj) in PLACES[route].items():
            template = {**ROUTE_BASE[route], **fields}
            param = param_list if kind == "list" else param_obj
            for depth in (DEEP, PAST_ORJSON):
                text = splice(template, nested(kind, depth))
                r = c.post(route, content=text, headers={"content-type": "application/json"})
                sent += 1
                err = r.json().get("error") if r.headers.get("content-type") == "application/json" else None
                if depth == DEEP and param is FORWARD:
                    expected = {"message": "The request body is nested too deeply to forward.", "param": None}
                elif depth == DEEP:
                    expected = {"param": param}
                else:
                    message = f"We could not parse the JSON body of your request ({past_limit_message(text)})."
                    expected = {"message": message, "param": None}
                got = (
                    {k: err.get(k) for k in expected}
                    if isinstance(err, dict) and set(err) == {"message", "type", "param", "code"}
                    else None
                )
                shape = err and (err.get("type"), err.get("code"))
                if (r.status_code, got, shape) != (400, expected, ("invalid_request_error", "invalid_request")):
                    wrong.append((place, depth, r.status_code, r.text[:300]))
                elif depth == DEEP and param is not None and param not in err["message"]:
                    wrong.append((place, depth, "message does not name the param", err["message"]))
    assert wrong == []
    assert len(module_engine.state.requests) == forwarded
    assert quota_state(redis_server, store, "tenant-a") == {**before, "rpm": before["rpm"] + sent}
    assert (before["tpm"], before["debits"], before["leases"]) == (0, [], 0)
    assert errors_logged(caplog.records) == []


# ====================================================================== engine side
@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """``(script, verifier, client)``: the scripted engine behind a gateway with its verifier; the
    victim's passage indexed (tenants of :func:`test_verifier_fields.tenant_file`: ``s`` strict,
    ``a`` sampled)."""
    sc = Script()
    sc.body = b'{"id":"v","object":"text_completion","choices":[{"index":0,"text":"ok","finish_reason":"stop"}]}'
    sc.done = False  # the raw events carry their own end
    passage, _ = victim_passage()
    victim = (key_of("victim"), "Please keep this: " + passage)
    verifier = {"strict_holdback_tokens": 64, "quarantine_min_prompt_tokens": 1024}
    tmp = tmp_path_factory.mktemp("deep_nesting")
    with leak_stack(tmp, build_engine(sc), tenant_file(), SECRETS, victim, **verifier) as (svc, client):
        yield sc, svc, client


#: the victim's words that carry the marker (the canary left out): what the leak cases plant
LEAK = " ".join(w for w in victim_passage()[1] if w.startswith(MARK))
#: an error code a strict tenant is shown (:func:`verifier.engine_response.strict_view`)
_PLAIN_CODE = re.compile(r"[a-z0-9_]{1,64}")


def outcome(status: int, raw: bytes) -> tuple:
    """How an answer ended, as a client sees it: the status and the error's code (``None`` for a
    200 body); for a 200 stream, the code of each error it carries (an ``error`` event, a chat
    ``{"error": ...}`` event, a ``response.failed`` event's ``response.error``). A code is kept
    when it is a plain identifier, else ``None`` (what a strict tenant is shown of it)."""
    if status != 200:
        return status, orjson.loads(raw)["error"]["code"]
    if not raw.startswith((b"data:", b"event:")):
        return status, None
    codes = []
    for line in raw.split(b"\n"):
        if not line.startswith(b"data: {"):
            continue
        ev = orjson.loads(line[6:])
        if ev.get("type") == "response.failed":
            resp = ev.get("response")
            err = resp.get("error") if isinstance(resp, dict) else None
            err = err if isinstance(err, dict) else {}
        elif ev.get("type") == "error":
            err = ev
        elif isinstance(ev.get("error"), dict):
            err = ev["error"]
        else:
            continue
        code = err.get("code")
        codes.append(code if isinstance(code, str) and _PLAIN_CODE.fullmatch(code) else None)
    return status, tuple(codes)


def paths(x: Any, at: tuple = ()) -> list[tuple]:
    """The path of every value below ``x`` (object keys, list indices), and of a key ``x_extra``
    added to each object."""
    out: list[tuple] = []
    if isinstance(x, dict):
        for k, v in x.items():
            out += [(*at, k), *paths(v, (*at, k))]
        out.append((*at, "x_extra"))
    elif isinstance(x, list):
        for i, v in enumerate(x):
            out += [(*at, i), *paths(v, (*at, i))]
    return out


def holed(x: Any, path: tuple) -> Any:
    """A copy of ``x`` with :data:`HOLE` at ``path`` (``()``: ``x`` itself is the hole)."""
    if not path:
        return HOLE
    out = json.loads(json.dumps(x))
    cur = out
    for p in path[:-1]:
        cur = cur[p]
    cur[path[-1]] = HOLE
    return out


def sse(route: str, event: str, etype: str) -> bytes:
    """One stream event: chat and completions ``data:`` lines, Responses ``event:`` + ``data:``."""
    head = f"event: {etype}\n".encode() if route == "responses" else b""
    return head + b"data: " + event.encode() + b"\n\n"


# ------------------------------------------------ the answers whose every field is replaced
CHAT_LOGPROBS = {
    "content": [
        {"token": "Sunny", "logprob": -0.1, "bytes": [83], "top_logprobs": [{"token": "Sunny", "logprob": -0.1}]}
    ]
}
CHAT_MESSAGE = {
    "role": "assistant",
    "content": "Sunny today.",
    "reasoning_content": "hm",
    "refusal": None,
    "tool_calls": [{"id": "t1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
}
USAGE = {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11, "prompt_tokens_details": {"cached_tokens": 0}}
CHAT_WHOLE = {
    "id": "c1",
    "object": "chat.completion",
    "created": 1,
    "model": "m",
    "choices": [
        {"index": 0, "message": CHAT_MESSAGE, "logprobs": CHAT_LOGPROBS, "finish_reason": "stop", "stop_reason": None}
    ],
    "usage": USAGE,
}
CHAT_CHUNK = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
CHAT_EVENTS = [
    {
        **CHAT_CHUNK,
        "choices": [
            {
                "index": 0,
                "delta": {**CHAT_MESSAGE, "tool_calls": [{"index": 0, **CHAT_MESSAGE["tool_calls"][0]}]},
                "logprobs": CHAT_LOGPROBS,
                "finish_reason": None,
            }
        ],
    },
    {**CHAT_CHUNK, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
    {**CHAT_CHUNK, "choices": [], "usage": USAGE},
]
TEXT_LOGPROBS = {"tokens": ["Sunny"], "token_logprobs": [-0.1], "top_logprobs": [{"Sunny": -0.1}], "text_offset": [0]}
COMPLETION_WHOLE = {
    "id": "c1",
    "object": "text_completion",
    "created": 1,
    "model": "m",
    "choices": [{"index": 0, "text": "Sunny today.", "logprobs": TEXT_LOGPROBS, "finish_reason": "stop"}],
    "usage": USAGE,
}
TEXT_CHUNK = {"id": "c1", "object": "text_completion", "created": 1, "model": "m"}
COMPLETION_EVENTS = [
    {**TEXT_CHUNK, "choices": [{"index": 0, "text": "Sunny", "logprobs": TEXT_LOGPROBS, "finish_reason": None}]},
    {**TEXT_CHUNK, "choices": [{"index": 0, "text": " today.", "finish_reason": "stop"}]},
    {**TEXT_CHUNK, "choices": [], "usage": USAGE},
]
R_LOGPROBS = [{"token": "Sunny", "logprob": -0.1, "top_logprobs": [{"token": "Sunny", "logprob": -0.1}]}]
R_PART = {
    "type": "output_text",
    "text": "Sunny today.",
    "annotations": [{"type": "url_citation", "title": "t", "url": "u"}],
    "logprobs": R_LOGPROBS,
}
R_MESSAGE = {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant", "content": [R_PART]}
R_PLAIN = {**R_MESSAGE, "content": [{"type": "output_text", "text": "Sunny today.", "annotations": []}]}
R_CALL = {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "f", "arguments": "{}", "status": "completed"}
R_REASONING = {
    "type": "reasoning",
    "id": "rs_1",
    "summary": [{"type": "summary_text", "text": "hm"}],
    "content": [{"type": "reasoning_text", "text": "hm"}],
}
R_USAGE = {"input_tokens": 9, "output_tokens": 2, "total_tokens": 11, "input_tokens_details": {"cached_tokens": 0}}
R_RESPONSE = {"id": "resp_1", "object": "response", "created_at": 1, "status": "completed", "model": "m", "error": None}
RESPONSE_WHOLE = {
    **R_RESPONSE,
    "output": [R_REASONING, R_MESSAGE, R_CALL],
    "usage": R_USAGE,
    "incomplete_details": None,
}
R_DELTA = {
    "type": "response.output_text.delta",
    "output_index": 0,
    "content_index": 0,
    "item_id": "msg_1",
    "delta": "Sunny",
}
_R_EVENTS = [
    {"type": "response.created", "response": {**R_RESPONSE, "status": "in_progress", "output": []}},
    {
        "type": "response.output_item.added",
        "output_index": 0,
        "item": {**R_MESSAGE, "status": "in_progress", "content": []},
    },
    {
        "type": "response.content_part.added",
        "output_index": 0,
        "content_index": 0,
        "item_id": "msg_1",
        "part": {"type": "output_text", "text": ""},
    },
    {**R_DELTA, "logprobs": R_LOGPROBS},
    {
        "type": "response.output_text.annotation.added",
        "output_index": 0,
        "content_index": 0,
        "annotation": {"type": "url_citation", "title": "t"},
    },
    {"type": "response.output_text.done", "output_index": 0, "content_index": 0, "item_id": "msg_1", "text": "Sunny"},
    {
        "type": "response.reasoning_summary_text.delta",
        "output_index": 1,
        "summary_index": 0,
        "item_id": "rs_1",
        "delta": "hm",
    },
    {"type": "response.output_item.done", "output_index": 0, "item": R_PLAIN},
    {"type": "response.completed", "response": {**R_RESPONSE, "output": [R_PLAIN], "usage": R_USAGE}},
]
RESPONSE_EVENTS = [{**e, "sequence_number": n} for n, e in enumerate(_R_EVENTS)]

# ------------------------------------------------ error answers
ERROR = {"error": {"message": "bad request", "type": "invalid_request_error", "param": "p", "code": "bad"}}
SGLANG_ERROR = {"object": "error", "message": "bad request", "type": "BadRequestError", "param": None, "code": 400}
FASTAPI_ERROR = {"detail": "bad request"}
R_INCOMPLETE = {**R_RESPONSE, "status": "incomplete", "incomplete_details": {"reason": "content_filter"}, "output": []}
R_FAILED = {
    "status": "failed",
    "error": {"code": "server_error", "message": "boom", "type": "server_error"},
    "output": [],
}
CHAT_ERROR_EVENT = {"error": {"message": "boom", "type": "server_error", "code": 500}}
R_ERROR_EVENT = {"type": "error", "code": "server_error", "message": "boom", "param": None}


@dataclass(frozen=True)
class Case:
    """``route``'s answer ``answer`` (a whole body, or a stream's events) under HTTP ``status``;
    ``varied``: the stream events whose fields are replaced (``None``: every event)."""

    route: str
    stream: bool
    status: int
    answer: Any
    varied: tuple[int, ...] | None = None

    def places(self) -> list[tuple[int, tuple]]:
        """``(event, path)`` of each value replaced in turn: the answer (or event) itself, every
        value below it, and a key ``x_extra`` added to each object."""
        if not self.stream:
            return [(0, p) for p in [(), *paths(self.answer)]]
        events = range(len(self.answer)) if self.varied is None else self.varied
        return [(i, p) for i in events for p in [(), *paths(self.answer[i])]]


def _ended(route: str, events: list[dict]) -> Case:
    """A stream of ``events`` whose last one alone is varied (the others are :data:`CASES`' own)."""
    return Case(
        route,
        True,
        200,
        [{**e, "sequence_number": n} if route == "responses" else e for n, e in enumerate(events)],
        (len(events) - 1,),
    )


CASES: dict[str, Case] = {
    "chat-whole": Case("chat", False, 200, CHAT_WHOLE),
    "chat-stream": Case("chat", True, 200, CHAT_EVENTS),
    "completions-whole": Case("completions", False, 200, COMPLETION_WHOLE),
    "completions-stream": Case("completions", True, 200, COMPLETION_EVENTS),
    "responses-whole": Case("responses", False, 200, RESPONSE_WHOLE),
    "responses-stream": Case("responses", True, 200, RESPONSE_EVENTS),
    "responses-whole-incomplete": Case("responses", False, 200, R_INCOMPLETE),
    "responses-whole-failed": Case("responses", False, 200, R_FAILED),
    "responses-stream-incomplete": _ended(
        "responses", [_R_EVENTS[0], R_DELTA, {"type": "response.incomplete", "response": R_INCOMPLETE}]
    ),
    "responses-stream-failed": _ended(
        "responses", [_R_EVENTS[0], R_DELTA, {"type": "response.failed", "response": R_FAILED}]
    ),
    "responses-stream-error": _ended("responses", [_R_EVENTS[0], R_DELTA, R_ERROR_EVENT]),
    "responses-stream-error-first": _ended("responses", [R_ERROR_EVENT]),
    "chat-stream-error": _ended("chat", [CHAT_EVENTS[1], CHAT_ERROR_EVENT]),
    "chat-stream-error-first": _ended("chat", [CHAT_ERROR_EVENT]),
    "completions-stream-error": _ended("completions", [COMPLETION_EVENTS[1], CHAT_ERROR_EVENT]),
    **{
        f"{route}-{name}-{status}": Case(route, False, status, body)
        for route in ("chat", "completions", "responses")
        for name, body, status in (
            ("error", ERROR, 400),
            ("error", ERROR, 200),
            ("sglang-error", SGLANG_ERROR, 400),
            ("fastapi-detail", FASTAPI_ERROR, 422),
        )
    },
}


def script(sc: Script, case: Case, event: int, path: tuple, value: str) -> None:
    """The engine's next answer: ``case``'s, with ``value`` (JSON text) at ``path`` (of stream
    event ``event``)."""
    sc.status = case.status
    if not case.stream:
        sc.body = splice(holed(case.answer, path), value).encode()
        return
    texts = [json.dumps(e) for e in case.answer]
    texts[event] = splice(holed(case.answer[event], path), value)
    sc.events = [sse(case.route, t, e.get("type", "")) for t, e in zip(texts, case.answer, strict=True)]
    if case.route != "responses":
        sc.events.append(b"data: [DONE]\n\n")


def wait_idle(svc: VerifierService) -> None:
    deadline = time.monotonic() + 20
    while svc.queued_jobs or svc.stats["in_flight"]:
        assert time.monotonic() < deadline
        time.sleep(0.01)


@pytest.mark.parametrize("name", list(CASES))
def test_an_engine_value_nested_1000_levels_is_answered_as_a_shallow_one(stack, caplog, name):
    """Each place of case ``name`` (:meth:`Case.places`) holding a list or an object nested 2 or
    :data:`DEEP` levels around a clean word or the victim's passage. Deep, the strict tenant's
    answer ends as it does 2 levels deep (relayed, refused as malformed, the engine's error; the
    passage withheld where the verifier reads it), and the sampled tenant's, the passage in it,
    as the strict tenant's clean one (a sampled answer is checked after it is sent). The strict
    tenant never receives a word of the passage; no 500 of the gateway's own, nothing logged at
    error level, no verifier job fault."""
    sc, svc, client = stack
    case = CASES[name]
    faults, withheld = svc.stats["job_faults"], 0
    caplog.set_level(logging.INFO)
    wrong: list[Any] = []
    for event, path in case.places():
        for kind in ("list", "obj"):
            got = {}
            for run, tid, depth, inner in (
                ("clean", "s", 2, '"Sunny"'),
                ("deep", "s", DEEP, '"Sunny"'),
                ("leak", "s", 2, json.dumps(LEAK)),
                ("deep_leak", "s", DEEP, json.dumps(LEAK)),
                ("sampled_deep_leak", "a", DEEP, json.dumps(LEAK)),
            ):
                script(sc, case, event, path, nested(kind, depth, inner))
                status, raw = send(client, tid, case.route, case.stream)
                got[run] = outcome(status, raw)
                if tid == "s" and MARK.encode() in raw:  # the victim's words reached the strict tenant
                    got[run] += ("leaked",)
            withheld += "response_withheld" in str(got["deep_leak"])
            want = {"deep": got["clean"], "deep_leak": got["leak"], "sampled_deep_leak": got["clean"]}
            if any(got[k] != v for k, v in want.items()) or any(
                "internal_error" in o or "leaked" in o for o in map(str, got.values())
            ):
                wrong.append((event, ".".join(map(str, path)) or "<root>", kind, got))
    wait_idle(svc)
    assert wrong == []
    assert svc.stats["job_faults"] == faults
    assert errors_logged(caplog.records) == []
    if case.status == 200 and name.count("-") == 1:  # an answer: the passage is withheld where it is text
        assert withheld > 0


# ------------------------------------------------ what the fixed readers make of a deep value
def test_a_responses_type_or_reason_nested_1000_levels_names_nothing_and_its_strings_are_read():
    """An output item's or content part's ``type``, and ``incomplete_details.reason``, that are
    lists nested :data:`DEEP` levels (``str()`` of one raised ``RecursionError``): they name no
    type and no reason (a ``response.incomplete`` is ``length``), and the strings inside are read
    as their object's other text (``<item>:other``, ``<item>:<part>:other``, ``-:other``)."""
    deep = orjson.loads(nested("list", DEEP, '"Sunny"'))
    part = {"type": deep, "text": "Hi."}
    item = {"type": deep, "id": "x1", "content": [part]}
    body = parse_response_body({"status": "incomplete", "incomplete_details": {"reason": deep}, "output": [item]})
    fields = {"0:0:output_text": "Hi.", "0:0:other": "Sunny", "0:other": "Sunny"}
    assert (body.finish_reason, body.fields, body.texts) == ("length", {**fields, "-:other": "Sunny"}, {0: "Hi."})
    added = parse_response_event({"type": "response.content_part.added", "output_index": 0, "part": part})
    assert (added.kind, added.snapshots) == ("snapshot", {"0:0:output_text": "Hi.", "0:0:other": "Sunny"})
    done = parse_response_event({"type": "response.output_item.done", "output_index": 0, "item": item})
    assert (done.kind, done.snapshots) == ("snapshot", fields)
    ended = {
        "type": "response.incomplete",
        "response": {"status": "incomplete", "incomplete_details": {"reason": deep}},
    }
    assert parse_response_event(ended).finish_reason == "length"


#: an engine's error type as a list or an object, 1 and :data:`DEEP` levels
ODD_TYPES = {f"{kind}-{depth}": nested(kind, depth) for kind in ("list", "obj") for depth in (1, DEEP)}


@pytest.mark.parametrize("odd", sorted(ODD_TYPES))
@pytest.mark.parametrize("route", ["chat", "responses"])
def test_an_engine_error_whose_type_is_a_list_or_object_is_relayed_with_the_statuss_type(stack, route, odd):
    """An engine's 400 whose ``error.type`` is a list or an object (unhashable: the type table's
    lookup raised ``TypeError``, a 500 of the gateway's own, at any depth): relayed as the engine's
    400 with its message, param and code, the type the status's."""
    sc, _, client = stack
    sc.status = 400
    sc.body = splice(
        {"error": {"message": "bad request", "type": HOLE, "param": "p", "code": "bad"}}, ODD_TYPES[odd]
    ).encode()
    status, raw = send(client, "c", route, False)
    expected = {"message": "bad request", "type": "invalid_request_error", "param": "p", "code": "bad"}
    assert (status, orjson.loads(raw)) == (400, {"error": expected})


@pytest.mark.parametrize("route", ["chat", "responses"])
def test_an_engine_detail_that_is_not_a_string_is_relayed_as_its_json_text(stack, route):
    """FastAPI's ``{"detail": [...]}`` (its validation errors): the message is the detail's JSON
    text (it was Python's repr, whose ``str()`` recursed: a 500 of the gateway's own at
    :data:`DEEP` levels); nested past what orjson writes, the engine's status and the start of its
    body."""
    sc, _, client = stack
    sc.status = 422
    sc.body = b'{"detail": [{"loc": ["body", "n"], "msg": "bad", "type": "int_parsing"}]}'
    status, raw = send(client, "c", route, False)
    expected = {"message": '[{"loc":["body","n"],"msg":"bad","type":"int_parsing"}]', "type": "invalid_request_error"}
    assert (status, orjson.loads(raw)) == (422, {"error": {**expected, "param": None, "code": None}})
    sc.body = splice({"detail": HOLE}, nested("list", DEEP)).encode()
    status, raw = send(client, "c", route, False)
    message = "The upstream engine answered 422: " + sc.body[:500].decode()
    assert (status, orjson.loads(raw)) == (
        422,
        {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": None}},
    )


#: stream events that are no object of the protocol but whose strings a client still receives:
#: case -> (route, the event as JSON text with ``%s`` where the words go)
ODD_EVENTS = {
    "chat-array": ("chat", '["%s"]'),
    "chat-string": ("chat", '"%s"'),
    "completions-array": ("completions", '[{"text": "%s"}]'),
    "responses-array": ("responses", '[{"type": "response.output_text.delta", "delta": "%s"}]'),
    "responses-type-list": ("responses", '{"type": ["%s"], "sequence_number": 2}'),
    "responses-type-long-string": ("responses", '{"type": "%s", "sequence_number": 2}'),
}


@pytest.mark.parametrize("odd", sorted(ODD_EVENTS))
def test_the_strings_of_an_event_that_is_no_object_or_has_no_string_type_are_read(stack, odd):
    """A stream event that is an array or a string (no chunk or event of the protocol), or a
    Responses event whose ``type`` is a list or a string longer than metadata: the strict tenant
    received the victim's words in it (the reader returned nothing for a non-object and skipped
    ``type`` whatever it held), nested 2 levels deep as at 1,000. Now its strings are read as
    other text: the stream, started by a clean event, is cut with the ``response_withheld``
    error event, the victim named; the same event with clean words is relayed whole."""
    sc, svc, client = stack
    route, event = ODD_EVENTS[odd]
    head = {"id": "c1", "object": "chat.completion.chunk" if route == "chat" else "text_completion", "model": "m"}
    if route == "chat":
        first, last = {**head, "choices": [{"index": 0, "delta": {"content": "Sunny."}}]}, None
    elif route == "completions":
        first, last = {**head, "choices": [{"index": 0, "text": "Sunny."}]}, None
    else:
        first = {**R_DELTA, "delta": "Sunny.", "sequence_number": 1}
        last = {"type": "response.completed", "response": {**R_RESPONSE, "output": [R_PLAIN]}, "sequence_number": 3}
    created = {"type": "response.created", "response": {**R_RESPONSE, "status": "in_progress"}, "sequence_number": 0}

    def events(words: str) -> list[bytes]:
        texts = [json.dumps(first), event % words]
        if route == "responses":
            return [  # each named by its type; the odd event by none (a name other than its type is refused)
                sse(route, json.dumps(created), "response.created"),
                sse(route, texts[0], first["type"]),
                sse(route, texts[1], ""),
                sse(route, json.dumps(last), "response.completed"),
            ]
        return [*(sse(route, t, "") for t in texts), b"data: [DONE]\n\n"]

    clean = " ".join(["fine"] * 150)  # longer than metadata, as the passage is
    sc.status, sc.events = 200, events(clean)
    status, raw = send(client, "s", route, True)
    assert (status, raw.count(clean.encode()), b"response_withheld" in raw) == (200, 1, False)
    before, seen = svc.stats["withheld"], {i.id for i in svc.incidents.recent}  # a bounded window
    sc.events = events(LEAK)
    status, raw = send(client, "s", route, True)
    assert (status, MARK.encode() in raw, b'"code":"response_withheld"' in raw) == (200, False, True)
    assert svc.stats["withheld"] == before + 1
    (inc,) = [i for i in svc.incidents.recent if i.withheld and i.id not in seen]
    assert (inc.detector, inc.tenant, inc.evidence["source_tenant"]) == ("leak_index", "s", "victim")
