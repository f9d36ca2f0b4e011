"""A hostile client against ``/v1/responses``, ``/v1/embeddings`` and ``/tokenize`` through the
whole gateway (real app on a free port, the API mock engine of tests/mock_api_engine.py, quotas in
process): every refusal is an exact OpenAI-shaped 4xx that reaches no engine and changes no quota
counter but the request's own RPM entry; what is admitted is counted as the engine counts it
(tests/gate_oracle.py, tiktoken directly) and charged exactly that.

The findings this file holds fixed: ``/tokenize`` answered a count for chats that chat refuses
(template kwargs, message keys, tool definitions with special tokens; for an ``engine`` tokenizer
they reached the engine); ``null`` fields were forwarded to engines whose request models refuse
them; a Responses tool-call argument error quoted a ``messages[...]`` path the client never sent;
integer fields beyond 64 bits got "must be an integer"."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.quotas.tenant_quotas import build_quota_stage
from tests.gate_oracle import completion_prompt_tokens, valid_id
from tests.gateway_harness import MODEL, Gateway, tenants, wait_for
from tests.test_gateway_api_routes import EMB, LIMIT, api_settings, error_of, forwarded

pytestmark = [pytest.mark.timeout(120), pytest.mark.engine("api")]

#: tenant-a's ``max_embedding_inputs`` here
CAP = 8
INT64_MAX = (1 << 63) - 1


def _start(engine: Any) -> Gateway:
    """The gateway of tests/test_gateway_api_routes.py with quotas kept in process (a window of an
    hour, so no entry ages out during the module) and limits no test reaches."""
    s = api_settings(engine, quotas=True)
    s.quotas.window_seconds = 3600
    limits = {"rpm": 10**6, "tpm": 10**9, "max_concurrent": 64, "max_embedding_inputs": CAP}
    reg = tenants(max_context_tokens=LIMIT, allowed_models=[MODEL, EMB], **limits)
    return Gateway(s, reg, quotas=build_quota_stage(s)).start()


@pytest.fixture(scope="module")
def gw(module_engine):
    g = _start(module_engine)
    yield g
    g.stop()


class Ledger:
    """What one request changed: engine requests, RPM entries, TPM sum, held leases, and the
    gateway's admitted prompt tokens (``kvgate_prompt_tokens_total``)."""

    def __init__(self, g: Gateway, engine: Any) -> None:
        self.g, self.engine = g, engine
        self.before = self.now()

    def now(self) -> tuple[int, int, int, int, float]:
        assert wait_for(lambda: self._leases() == 0)  # a finished request's lease is settled
        log = self.g.gw.quotas.store._tenants.get("tenant-a")
        rpm, tpm = (len(log.rpm), log.tpm_sum) if log is not None else (0, 0)
        counted = self.g.gw.metrics.registry.get_sample_value("kvgate_prompt_tokens_total", {"tenant": "tenant-a"})
        return len(self.engine.state.requests), rpm, tpm, self._leases(), counted or 0.0

    def _leases(self) -> int:
        log = self.g.gw.quotas.store._tenants.get("tenant-a")
        return 0 if log is None else len(log.leases)

    def delta(self) -> dict[str, float]:
        after = self.now()
        names = ("engine", "rpm", "tpm", "leases", "counted")
        return {name: a - b for name, a, b in zip(names, after, self.before, strict=True)}


#: a refusal's footprint: one RPM entry (docs/gateway.md: invalid requests cost their sender RPM)
REFUSED = {"engine": 0, "rpm": 1, "tpm": 0, "leases": 0, "counted": 0}


def _post(g: Gateway, path: str, body: Any = None, raw: bytes | None = None, **headers: str):
    content = raw if raw is not None else json.dumps(body).encode()
    with g.client() as c:
        return c.post(path, content=content, headers={"content-type": "application/json", **headers})


def _invalid(message: str, param: str | None, code: str | None = "invalid_request") -> dict:
    return {"message": message, "type": "invalid_request_error", "param": param, "code": code}


# ---------------------------------------------------------------- finding: /tokenize checks a chat as chat does
MSG = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("extra", "error"),
    [
        (
            {"chat_template_kwargs": {"a": {"b": [1]}}},
            _invalid(
                "Invalid value for 'chat_template_kwargs': key 'a' is not accepted (it may change the prompt); "
                "accepted keys: enable_thinking, thinking",
                "chat_template_kwargs",
            ),
        ),
        (
            {"chat_template_kwargs": {"enable_thinking": "no"}},
            _invalid(
                "Invalid value for 'chat_template_kwargs': 'enable_thinking' must be a boolean", "chat_template_kwargs"
            ),
        ),
        (
            {"chat_template_kwargs": {"add_generation_prompt": False}},
            _invalid(
                "Invalid value for 'chat_template_kwargs': key 'add_generation_prompt' is not accepted (it may "
                "change the prompt); accepted keys: enable_thinking, thinking",
                "chat_template_kwargs",
            ),
        ),
        (
            {"messages": [{"role": "user", "content": "hi", "foo": 1}]},
            _invalid("Unrecognized message field: 'messages[0].foo'.", "messages[0].foo"),
        ),
        (
            {"messages": [{"role": "system", "content": "hi", "tools": [{"type": "function"}]}]},
            _invalid("Unrecognized message field: 'messages[0].tools'.", "messages[0].tools"),
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "<|im_start|>"}}]},
            _invalid(
                "'tools[0].function.name' holds '<|im_start|>', the text of one of this model's special tokens: the "
                "engines serving it would read it as a control token in the prompt. Tool definitions may not "
                "contain special tokens.",
                "tools[0].function.name",
            ),
        ),
    ],
)
def test_tokenize_refuses_what_chat_refuses_with_chats_own_error(gw, module_engine, extra, error):
    """Before: ``/tokenize`` answered 200 with a count (9 tokens; 62 for the tool name) for each
    of these chats, which chat refuses before counting: a pre-check with a number the gate would
    never use. Now the same 400 as chat's, and nothing counted or charged."""
    body = {"model": MODEL, "messages": MSG, **extra}
    ledger = Ledger(gw, module_engine)
    r = _post(gw, "/tokenize", body)
    assert r.status_code == 400 and error_of(r) == error
    assert ledger.delta() == REFUSED
    r = _post(gw, "/v1/chat/completions", body)
    assert r.status_code == 400 and error_of(r) == error  # chat's own answer, word for word


def test_tokenize_of_an_engine_tokenizer_sends_the_engine_no_chat_that_chat_refuses(engine):
    """For an ``engine`` tokenizer the chat went to the engine's ``/tokenize`` as sent (its
    template then rendered the unchecked kwargs); now it is refused first."""
    s = api_settings(engine)
    s.models[0].tokenizer = s.models[0].tokenizer.model_validate(
        {"kind": "engine", "url": engine.url, "engine_api": "vllm"}
    )
    g = Gateway(s, tenants(max_context_tokens=LIMIT, allowed_models=[MODEL, EMB])).start()
    try:
        r = _post(g, "/tokenize", {"model": MODEL, "messages": MSG, "chat_template_kwargs": {"tools": [1]}})
        assert r.status_code == 400 and error_of(r)["param"] == "chat_template_kwargs"
        r = _post(g, "/tokenize", {"model": MODEL, "messages": [{"role": "user", "content": "hi", "x": 1}]})
        assert r.status_code == 400 and error_of(r)["param"] == "messages[0].x"
        assert engine.state.requests == []
        r = _post(g, "/tokenize", {"model": MODEL, "messages": MSG, "chat_template_kwargs": {"enable_thinking": True}})
        assert r.status_code == 200 and r.json()["count"] == 9  # what chat passes still reaches the engine
        assert [q["body"]["chat_template_kwargs"] for q in engine.state.requests] == [{"enable_thinking": True}]
    finally:
        g.stop()


# ---------------------------------------------------------------- finding: null fields are not forwarded
def test_null_fields_are_left_out_of_what_the_engine_receives(gw, module_engine):
    """``null`` passes validation as "absent", but vLLM's ``ResponsesRequest`` takes ``tools``
    (a list), ``tool_choice`` and ``service_tier`` only as values, and its
    ``EmbeddingCompletionRequest`` ``encoding_format`` only as a value: the engine's 400 came after
    the gateway admitted the request and charged its prompt (TPM +2 for "hello world", +10 for the
    Responses one). Now the engine gets the body without them."""
    body = {"model": MODEL, "input": "Say hello.", "max_output_tokens": 5}
    nulls = dict.fromkeys(("tools", "tool_choice", "service_tier", "text", "reasoning", "instructions", "user"))
    ledger = Ledger(gw, module_engine)
    r = _post(gw, "/v1/responses", {**body, **nulls})
    assert r.status_code == 200
    sent = forwarded(module_engine, "/v1/responses")[-1]
    assert sent == {**body, "cache_salt": gw.gw.cache_salt("tenant-a"), "store": False}
    assert ledger.delta() == {"engine": 1, "rpm": 1, "tpm": 11 + 4, "leases": 0, "counted": 11}

    ledger = Ledger(gw, module_engine)
    r = _post(gw, "/v1/embeddings", {"model": EMB, "input": "hello world", "encoding_format": None, "dimensions": None})
    assert r.status_code == 200 and r.json()["usage"] == {"prompt_tokens": 2, "total_tokens": 2}
    assert forwarded(module_engine, "/v1/embeddings")[-1] == {"model": EMB, "input": "hello world"}
    assert ledger.delta() == {"engine": 1, "rpm": 1, "tpm": 2, "leases": 0, "counted": 2}


# ---------------------------------------------------------------- finding: an argument error names the input field
def test_a_tool_call_argument_error_names_the_input_item_in_its_message_too(gw, module_engine):
    """The chat path of the converted prompt (``messages[2]``: instructions are ``messages[0]``)
    was quoted in the message while ``param`` named ``input[1].arguments``."""
    items = [
        {"role": "user", "content": "x"},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{not json"},
        {"type": "function_call_output", "call_id": "c", "output": "o"},
    ]
    ledger = Ledger(gw, module_engine)
    r = _post(gw, "/v1/responses", {"model": MODEL, "instructions": "Be brief.", "input": items})
    assert r.status_code == 400
    assert error_of(r) == _invalid(
        "'input[1].arguments' must be valid JSON: the engine parses a tool call's arguments and refuses them "
        "otherwise.",
        "input[1].arguments",
    )
    assert ledger.delta() == REFUSED


# ---------------------------------------------------------------- finding: integers beyond 64 bits
@pytest.mark.parametrize(
    ("path", "field", "value", "problem"),
    [
        ("/v1/responses", "max_output_tokens", 10**30, f"must be an integer from 1 to {INT64_MAX}"),
        ("/v1/responses", "max_output_tokens", 1 << 63, f"must be <= {INT64_MAX}"),
        ("/v1/responses", "max_tool_calls", (1 << 64) - 1, f"must be <= {INT64_MAX}"),
        ("/v1/embeddings", "dimensions", 10**30, f"must be an integer from 1 to {INT64_MAX}"),
        ("/v1/embeddings", "dimensions", 1 << 63, f"must be <= {INT64_MAX}"),
    ],
)
def test_integer_fields_beyond_int64_name_their_range(gw, module_engine, path, field, value, problem):
    """10**30 (read as a float past 64 bits) was "must be an integer", a wrong reason for an
    integer; 2**63..2**64-1 passed (``dimensions`` on to the engine). Now chat's range message."""
    model = MODEL if path == "/v1/responses" else EMB
    ledger = Ledger(gw, module_engine)
    r = _post(gw, path, {"model": model, "input": "x", field: value})
    assert r.status_code == 400 and error_of(r) == _invalid(f"Invalid value for '{field}': {problem}", field)
    assert ledger.delta() == REFUSED


# ---------------------------------------------------------------- attacks handled before this review
_NOT_A_MIX = "'input' must be a string, a list of strings, a list of token ids or a list of token-id lists"
HANDLED: list[tuple[str, str, Any, int, dict]] = [
    (
        "invalid JSON",
        "/v1/embeddings",
        b"{",
        400,
        _invalid(
            "We could not parse the JSON body of your request (unexpected end of data: line 1 column 2 (char 1)).", None
        ),
    ),
    ("array body", "/v1/responses", b"[1,2]", 400, _invalid("The request body must be a JSON object.", None)),
    (
        "whitespace body",
        "/tokenize",
        b" \n\t ",
        400,
        _invalid(
            "We could not parse the JSON body of your request (input data is empty: line 1 column 1 (char 0)).", None
        ),
    ),
    (
        "non-UTF-8",
        "/v1/embeddings",
        b'{"model":"embed-tiny","input":"\xff\xfe"}',
        400,
        _invalid("The request body is not valid UTF-8 JSON.", None),
    ),
    (
        "lone surrogate",
        "/v1/responses",
        b'{"model":"kvgate-tiny","input":"\\ud800"}',
        400,
        _invalid("The request body is not valid UTF-8 JSON.", None),
    ),
    (
        "deep nesting",
        "/v1/embeddings",
        b'{"model":"embed-tiny","input":' + b"[" * 10_000 + b"]" * 10_000 + b"}",
        400,
        _invalid(
            "We could not parse the JSON body of your request (depth limit exceeded: line 1 column 1055 (char 1054)).",
            None,
        ),
    ),
    (
        "NaN id",
        "/v1/embeddings",
        b'{"model":"embed-tiny","input":NaN}',
        400,
        _invalid(
            "Invalid value for 'input': must be a finite number (NaN, Infinity and numbers beyond a double are "
            "not JSON)",
            "input",
        ),
    ),
    (
        "duplicate model key: the last wins",
        "/v1/embeddings",
        b'{"model":"embed-tiny","model":"nope","input":"x"}',
        404,
        _invalid("The model `nope` does not exist or you do not have access to it.", "model", "model_not_found"),
    ),
    ("empty input list", "/v1/embeddings", {"input": []}, 400, _invalid(f"{_NOT_A_MIX}.", "input")),
    (
        "empty id list",
        "/v1/embeddings",
        {"input": [[1], []]},
        400,
        _invalid("'input[1]' must be a non-empty list of integer token ids.", "input[1]"),
    ),
    ("bool ids", "/v1/embeddings", {"input": [True, False]}, 400, _invalid(f"{_NOT_A_MIX} (not a mix).", "input")),
    (
        "float ids",
        "/v1/embeddings",
        {"input": [[1, 2.0]]},
        400,
        _invalid("'input[0]' must be a non-empty list of integer token ids.", "input[0]"),
    ),
    (
        "negative id",
        "/v1/embeddings",
        {"input": [1, -1]},
        400,
        _invalid(
            "Invalid token id -1 in 'input': ids must be integers in [0, 100277) that the model's tokenizer defines.",
            "input",
        ),
    ),
    (
        "id in a vocabulary hole",
        "/v1/embeddings",
        {"input": [[5], [100256]]},
        400,
        _invalid(
            "Invalid token id 100256 in 'input[1]': ids must be integers in [0, 100277) that the model's tokenizer "
            "defines.",
            "input[1]",
        ),
    ),
    (
        "id of 2**63",
        "/v1/embeddings",
        {"input": [1 << 63]},
        400,
        _invalid(
            "Invalid token id 9223372036854775808 in 'input': ids must be integers in [0, 100277) that the model's "
            "tokenizer defines.",
            "input",
        ),
    ),
    (
        "strings mixed with ids",
        "/v1/embeddings",
        {"input": ["a", [1]]},
        400,
        _invalid(f"{_NOT_A_MIX} (not a mix).", "input"),
    ),
    (
        "more inputs than the cap",
        "/v1/embeddings",
        {"input": ["a"] * (CAP + 1)},
        400,
        _invalid(f"'input' holds {CAP + 1} inputs, above this key's cap of {CAP} inputs per request.", "input"),
    ),
    (
        "one input over the limit",
        "/v1/embeddings",
        {"input": [[7] * 3, [7] * (LIMIT + 1)]},
        400,
        _invalid(
            f"This model's maximum context length is {LIMIT} tokens. However, you requested {LIMIT + 1} tokens in the "
            "input for embedding generation. Please reduce the length of the input.",
            "input[1]",
            "context_length_exceeded",
        ),
    ),
    (
        "encoding_format int",
        "/v1/embeddings",
        {"input": "x", "encoding_format": 1},
        400,
        _invalid("Invalid value for 'encoding_format': must be one of 'float', 'base64'", "encoding_format"),
    ),
    (
        "dimensions bool",
        "/v1/embeddings",
        {"input": "x", "dimensions": True},
        400,
        _invalid("Invalid value for 'dimensions': must be an integer", "dimensions"),
    ),
    (
        "user int",
        "/v1/embeddings",
        {"input": "x", "user": 5},
        400,
        _invalid("Invalid value for 'user': must be a string", "user"),
    ),
    (
        "prompt-changing extension",
        "/v1/embeddings",
        {"input": "x", "add_special_tokens": False},
        400,
        _invalid("Unrecognized request argument supplied: add_special_tokens", "add_special_tokens"),
    ),
    (
        "responses: empty item list",
        "/v1/responses",
        {"input": []},
        400,
        _invalid("'input' must not be empty.", "input"),
    ),
    (
        "responses: token ids",
        "/v1/responses",
        {"input": [1, 2]},
        400,
        _invalid("'input[0]' must be an object (a message or an item with a 'type').", "input[0]"),
    ),
    (
        "responses: unknown item",
        "/v1/responses",
        {"input": [{"type": "item_reference", "id": "x"}]},
        400,
        _invalid(
            "Unsupported input item type 'item_reference' at 'input[0].type'; expected one of 'message', "
            "'function_call', 'function_call_output', 'reasoning'.",
            "input[0].type",
        ),
    ),
    (
        "responses: unknown part",
        "/v1/responses",
        {"input": [{"role": "user", "content": [{"type": "weird"}]}]},
        400,
        _invalid(
            "Unsupported content part type 'weird' at 'input[0].content[0].type'; expected one of 'input_text', "
            "'output_text', 'input_image'.",
            "input[0].content[0].type",
        ),
    ),
    (
        "responses: role tool",
        "/v1/responses",
        {"input": [{"role": "tool", "content": "x"}]},
        400,
        _invalid("'input[0].role' must be one of user, system, developer, assistant; got 'tool'.", "input[0].role"),
    ),
    (
        "responses: call without arguments",
        "/v1/responses",
        {"input": [{"type": "function_call", "call_id": "c", "name": "f"}]},
        400,
        _invalid("'input[0].arguments' must be a string.", "input[0].arguments"),
    ),
    (
        "responses: output not text",
        "/v1/responses",
        {"input": [{"type": "function_call_output", "call_id": "c", "output": 5}]},
        400,
        _invalid("'input[0].output' must be a string or a list of content parts.", "input[0].output"),
    ),
    (
        "responses: encrypted reasoning",
        "/v1/responses",
        {"input": [{"type": "reasoning", "encrypted_content": "e", "summary": []}]},
        400,
        _invalid("Encrypted reasoning content is not supported.", "input[0].encrypted_content"),
    ),
    (
        "responses: assistant to continue",
        "/v1/responses",
        {"input": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y", "status": "in_progress"}]},
        400,
        _invalid(
            "'input[1].status' 'in_progress' asks the engine to continue that message, which kvgate cannot "
            "count; send it as a completed message.",
            "input[1].status",
        ),
    ),
    (
        "responses: instructions list",
        "/v1/responses",
        {"input": "x", "instructions": [{"type": "input_text"}]},
        400,
        _invalid("Invalid value for 'instructions': must be a string", "instructions"),
    ),
    (
        "responses: previous_response_id ''",
        "/v1/responses",
        {"input": "x", "previous_response_id": ""},
        400,
        _invalid(
            "'previous_response_id' asks the engine to keep or reuse conversation state, which kvgate cannot "
            "count or gate; send the whole conversation in 'input' instead (and leave 'store' unset or false).",
            "previous_response_id",
        ),
    ),
    (
        "responses: max_output_tokens true",
        "/v1/responses",
        {"input": "x", "max_output_tokens": True},
        400,
        _invalid("Invalid value for 'max_output_tokens': must be an integer", "max_output_tokens"),
    ),
    (
        "responses: max_output_tokens -1",
        "/v1/responses",
        {"input": "x", "max_output_tokens": -1},
        400,
        _invalid("Invalid value for 'max_output_tokens': must be >= 1", "max_output_tokens"),
    ),
    (
        "responses: over the cap",
        "/v1/responses",
        {"input": "x", "max_output_tokens": 4097},
        400,
        _invalid("'max_output_tokens' is 4097, above this key's cap of 4096 tokens.", "max_output_tokens"),
    ),
    (
        "responses: schema without name",
        "/v1/responses",
        {"input": "x", "text": {"format": {"type": "json_schema", "schema": {"type": "object"}}}},
        400,
        _invalid(
            "Invalid value for 'text': 'format' of type json_schema needs 'name' (a string) and 'schema' (an object)",
            "text",
        ),
    ),
    (
        "responses: built-in tool",
        "/v1/responses",
        {"input": "x", "tools": [{"type": "web_search"}]},
        400,
        _invalid(
            "Tool type 'web_search' at 'tools[0].type' is not supported: kvgate serves 'function' tools only (built-in "
            "tools make the engine add to the prompt what kvgate cannot count).",
            "tools[0].type",
        ),
    ),
    (
        "tokenize: ids as prompt",
        "/tokenize",
        {"prompt": [1, 2]},
        400,
        _invalid("Invalid value for 'prompt': must be a string", "prompt"),
    ),
    (
        "tokenize: prompt and messages",
        "/tokenize",
        {"prompt": "", "messages": MSG},
        400,
        _invalid("Send exactly one of 'prompt' (a string) or 'messages'.", "prompt"),
    ),
    (
        "tokenize: empty messages",
        "/tokenize",
        {"messages": []},
        400,
        _invalid("'messages' must be a non-empty list of message objects.", "messages"),
    ),
    (
        "detokenize: bool ids",
        "/detokenize",
        {"tokens": [True]},
        400,
        _invalid("Invalid value for 'tokens': must be an array of integers", "tokens"),
    ),
    (
        "detokenize: more ids than the limit",
        "/detokenize",
        {"tokens": [1] * (LIMIT + 1)},
        400,
        _invalid(
            f"This model's maximum context length is {LIMIT} tokens. However, you requested at least {LIMIT + 1} "
            "tokens in the tokens alone (counting stopped there). Please reduce the length of the tokens.",
            "tokens",
            "context_length_exceeded",
        ),
    ),
]


@pytest.mark.parametrize(("name", "path", "body", "status", "error"), HANDLED, ids=[h[0] for h in HANDLED])
def test_a_hostile_body_is_an_exact_refusal_that_changes_nothing(gw, module_engine, name, path, body, status, error):
    model = EMB if path == "/v1/embeddings" else MODEL
    ledger = Ledger(gw, module_engine)
    r = _post(gw, path, raw=body) if isinstance(body, bytes) else _post(gw, path, {"model": model, **body})
    assert (r.status_code, error_of(r)) == (status, error)
    assert ledger.delta() == REFUSED


def test_bodies_at_and_over_the_size_limit(gw, module_engine):
    """At ``max_body_bytes`` the body is read and counted (here: too long, 400); one byte over is
    413 before it is parsed. Neither reaches the engine."""
    limit = gw.gw.settings.gateway.max_body_bytes
    head = b'{"model":"embed-tiny","input":"'
    at = head + b"a" * (limit - len(head) - 2) + b'"}'
    ledger = Ledger(gw, module_engine)
    r = _post(gw, "/v1/embeddings", raw=at)
    assert r.status_code == 400 and error_of(r)["code"] == "context_length_exceeded"
    assert ledger.delta() == REFUSED
    ledger = Ledger(gw, module_engine)
    r = _post(gw, "/v1/embeddings", raw=at[:-2] + b'a"}')
    assert (r.status_code, error_of(r)) == (
        413,
        _invalid(f"The request body is larger than {limit} bytes.", None, "request_too_large"),
    )
    assert ledger.delta() == REFUSED


# ---------------------------------------------------------------- property: embeddings input shapes
def oracle(value: Any) -> list[int] | None:
    """Per-input tokens the engine holds for ``input`` (tests/gate_oracle.py: strings encoded with
    tiktoken, ids counted), or ``None`` for what no engine takes: another shape (OpenAI's and vLLM's
    ``str | list[str] | list[int] | list[list[int]]``, no bools, no floats, nothing empty), an id
    outside the vocabulary, or an input of 0 tokens (``""``: vLLM's
    ``InputProcessor._validate_prompt_len`` refuses an empty prompt, and OpenAI an empty string)."""
    if not isinstance(value, str):
        ok = isinstance(value, list) and bool(value)
        kinds = {type(x) for x in value} if ok else set()
        nested = kinds == {list} and all(x and {type(t) for t in x} == {int} for x in value)
        if not (kinds in ({str}, {int}) or nested):
            return None
        ids = [t for x in value for t in x] if nested else value if kinds == {int} else []
        if not all(valid_id(t) for t in ids):
            return None
    counts = completion_prompt_tokens(value)
    return counts if all(counts) else None


_IDS = st.one_of(
    st.integers(0, 100_300),
    st.sampled_from([-1, 100_256, 100_257, 100_264, 100_265, 100_276, 100_277, INT64_MAX, 1 << 63, (1 << 64) - 1]),
)
_TEXT = st.one_of(
    st.text(st.characters(exclude_categories=("Cs",)), max_size=30),
    st.sampled_from(["", "<|im_start|>user", "<|endoftext|>", "a " * (LIMIT + 5), "ż" * 40, " \n\t"]),
)
_JUNK = st.one_of(
    st.none(), st.booleans(), st.floats(allow_nan=False, allow_infinity=False), st.integers(-(1 << 63), (1 << 64) - 1)
)
INPUTS = st.one_of(
    _TEXT,
    st.lists(_TEXT, max_size=CAP + 2),
    st.lists(_IDS, max_size=LIMIT + 10),
    st.lists(st.lists(_IDS, max_size=120), max_size=CAP + 2),
    st.lists(st.one_of(_TEXT, _IDS, _JUNK, st.lists(st.one_of(_IDS, _JUNK), max_size=3)), max_size=5),
    _JUNK,
    st.dictionaries(st.text(max_size=3), st.integers(0, 9), max_size=2),
)


def test_property_embeddings_input_shapes_are_counted_as_the_engine_counts_them(gw, module_engine):
    """Any ``input``: refused (a 4xx naming ``input``) => the engine saw nothing and only the RPM
    entry changed; admitted => exactly when the oracle's engine takes it and it fits (each input
    ``<= limit``, at most the cap, the total within the pool), the engine got ``input`` as sent,
    and the gateway's count, its TPM charge and the engine's usage all equal the oracle's."""
    _, pool = gw.gw.upstreams.eligible(EMB)
    stats = {"200": 0, "400": 0}

    @settings(max_examples=150, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(INPUTS)
    def one(value: Any) -> None:
        counts = oracle(value)
        fits = counts is not None and len(counts) <= CAP and max(counts) <= LIMIT and sum(counts) <= pool
        ledger = Ledger(gw, module_engine)
        r = _post(gw, "/v1/embeddings", {"model": EMB, "input": value})
        change = ledger.delta()
        if r.status_code != 200:
            stats["400"] += 1
            assert r.status_code == 400 and error_of(r)["param"].startswith("input"), r.text
            assert not fits, (value, r.text)
            assert change == REFUSED
            return
        stats["200"] += 1
        assert fits, (value, counts)
        total = sum(counts)
        assert forwarded(module_engine, "/v1/embeddings")[-1] == {"model": EMB, "input": value}
        assert r.json()["usage"] == {"prompt_tokens": total, "total_tokens": total}
        assert change == {"engine": 1, "rpm": 1, "tpm": total, "leases": 0, "counted": total}

    one()
    print(f"\nembeddings input property: {stats}")
    assert stats["200"] >= 20 and stats["400"] >= 20, stats
