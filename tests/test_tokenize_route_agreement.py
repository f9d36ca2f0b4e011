"""``/tokenize`` agrees with the route it sizes a request for: a chat body sent to ``/tokenize`` is
refused with ``/v1/chat/completions``' own error body, word for word, wherever chat refuses it
before its gate, and otherwise counted to exactly the prompt tokens chat reserves for the same body
(render-as-the-engine setup of tests/render_env.py: ChatML and a Jinja template that reads
``reasoning_effort``, each behind SGLang, vLLM, the bundled backend, OpenAI, and SGLang + vLLM).

The findings this file holds fixed: ``/tokenize`` checked a chat with a copy of part of chat's
checks (message keys, tool shapes) and its own table, so it answered a count for chats chat refuses
(``add_generation_prompt: false`` or ``chat_template_kwargs`` where no engine of the model reads
them, message shapes SGLang's request model refuses, a ``uuid`` on a text part behind vLLM, a chat
for an embedding model), refused with other words what chat refuses (image URLs, image parts for
the bundled backend, both generation switches, ``stream_options``, ``top_p: 0``), and refused as
unknown the chat fields chat counts (``reasoning_effort``, which changes the prompt) or accepts
(``max_tokens``, ``tool_choice``, sampling). Image parts chat counts stay refused here: their ids
are not known (docs/gateway.md)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.gate_oracle import hf_chat_tokens
from tests.gateway_harness import MODEL, Gateway, tenants
from tests.render_env import ENGINES, LIMIT, render_env
from tests.test_gateway_api_routes import EMB, api_settings, error_of

pytestmark = [pytest.mark.timeout(240), pytest.mark.engine("api")]

HI = [{"role": "user", "content": "hi"}]
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
#: ``/tokenize``'s own refusal of an image part chat counts
NO_IMAGE_IDS = {
    "message": "/tokenize does not take image content parts (they have no token ids here).",
    "type": "invalid_request_error",
    "param": "messages",
    "code": "invalid_request",
}


@pytest.fixture(scope="module")
def env():
    with render_env() as e:
        yield e


def _invalid(message: str, param: str) -> dict:
    return {"message": message, "type": "invalid_request_error", "param": param, "code": "invalid_request"}


def _unrecognized(field: str) -> dict:
    return _invalid(
        f"Unrecognized request argument supplied: {field} (the engines serving this model do not accept it).", field
    )


def chat_prompt_tokens(env, body: dict) -> tuple[int, Any]:
    """``(status, prompt tokens or error)`` of ``body`` on ``/v1/chat/completions``: the prompt
    tokens chat reserved (its reservation over the sequences, less the completion bound it
    forwarded), or its error object."""
    client, sg, vl, quotas, folder = env
    before = (len(sg.state.requests), len(vl.state.requests), len(quotas.reserved))
    r = client.post("/v1/chat/completions", json=body)
    if r.status_code != 200:
        assert (len(sg.state.requests), len(vl.state.requests), len(quotas.reserved)) == before
        return r.status_code, error_of(r)
    [got] = [q["body"] for q in sg.state.requests[before[0] :] + vl.state.requests[before[1] :]]
    bound = got.get("max_tokens") or got["max_completion_tokens"]
    seqs = max(body.get("n") or 1, 1)
    assert quotas.reserved[-1] % seqs == 0
    return 200, quotas.reserved[-1] // seqs - bound


def tokenize(env, body: dict) -> tuple[int, Any]:
    """``(status, count or error)`` of ``body`` on ``/tokenize``; nothing reaches an engine."""
    client, sg, vl, quotas, folder = env
    before = (len(sg.state.requests), len(vl.state.requests), len(quotas.reserved))
    r = client.post("/tokenize", json=body)
    assert (len(sg.state.requests), len(vl.state.requests), len(quotas.reserved)) == before
    if r.status_code != 200:
        return r.status_code, error_of(r)
    answer = r.json()
    assert answer["max_model_len"] == LIMIT and answer["count"] >= len(answer["tokens"])
    return 200, answer["count"]


# ---------------------------------------------------------------- chat refuses: /tokenize refuses, in chat's words
SGLANG_PARTS = "the engines serving this model take content parts of type 'text' and 'image_url' only."
REFUSED = [
    ("agp false, SGLang", "cs", {"add_generation_prompt": False}, _unrecognized("add_generation_prompt")),
    ("agp false, bundled", "ck", {"add_generation_prompt": False}, _unrecognized("add_generation_prompt")),
    (
        "template kwargs, bundled",
        "ck",
        {"chat_template_kwargs": {"enable_thinking": True}},
        _unrecognized("chat_template_kwargs"),
    ),
    ("empty template kwargs, bundled", "tk", {"chat_template_kwargs": {}}, _unrecognized("chat_template_kwargs")),
    (
        "refusal part, SGLang",
        "cs",
        {"messages": [{"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]}, *HI]},
        _invalid(f"'messages[0].content[0].type' is 'refusal': {SGLANG_PARTS}", "messages[0].content[0].type"),
    ),
    (
        "user content null, SGLang",
        "ts",
        {"messages": [{"role": "user", "content": None}]},
        _invalid(
            "'messages[0].content' is missing or null: the engines serving this model require a user message's "
            "content (a string or content parts).",
            "messages[0].content",
        ),
    ),
    (
        "tool_call_id a number, SGLang",
        "tmix",
        {"messages": [*HI, {"role": "tool", "content": "4", "tool_call_id": 5}]},
        _invalid("'messages[1].tool_call_id' must be a string.", "messages[1].tool_call_id"),
    ),
    (
        "tool call id a number, SGLang",
        "cs",
        {
            "messages": [
                *HI,
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"id": 1, "type": "function", "function": {"name": "f", "arguments": "{}"}}],
                },
            ]
        },
        _invalid("'messages[1].tool_calls[0].id' must be a string.", "messages[1].tool_calls[0].id"),
    ),
    (
        "uuid on a text part, vLLM",
        "cv",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "uuid": "u1"}]}]},
        _invalid(
            "'messages[0].content[0].uuid' is set on a text part: the engines serving this model then read the part "
            "by its other keys (as an image, audio or video) or refuse it. Send 'uuid' on media parts only.",
            "messages[0].content[0].uuid",
        ),
    ),
    (
        "both switches",
        "tv",
        {"add_generation_prompt": True, "continue_final_message": True},
        _invalid("'continue_final_message' and 'add_generation_prompt' cannot both be true.", "continue_final_message"),
    ),
    (
        "image URL off the policy",
        "cv",
        {
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x.test/a.png"}}]}
            ]
        },
        _invalid(
            "'messages[0].content[0].image_url' must be a data: URL; the engine would fetch any other URL itself.",
            "messages[0].content[0].image_url",
        ),
    ),
    (
        "image, bundled",
        "ck",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, IMAGE]}]},
        _invalid(
            "'messages[0].content[1]' is an image, but the engines serving this model take no images (they read "
            "text only); send text parts only.",
            "messages[0].content[1]",
        ),
    ),
    (
        "input_image part, SGLang",
        "cs",
        {"messages": [{"role": "user", "content": [{"type": "input_image", "image_url": IMAGE["image_url"]["url"]}]}]},
        _invalid(f"'messages[0].content[0].type' is 'input_image': {SGLANG_PARTS}", "messages[0].content[0].type"),
    ),
    (
        "stream_options without stream",
        "cv",
        {"stream_options": {"include_usage": True}},
        _invalid("'stream_options' is only allowed when 'stream' is true.", "stream_options"),
    ),
    (
        "top_p 0",
        "tv",
        {"top_p": 0},
        _invalid("Invalid value for 'top_p': must be > 0 and <= 1 (the engines serving this model refuse 0)", "top_p"),
    ),
    ("n 2, bundled", "ck", {"n": 2}, _invalid("'n' is not supported by the engines serving this model.", "n")),
    (
        "tool_choice required, bundled",
        "tk",
        {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"},
        _invalid(
            "'tool_choice' asks for a tool call, but the engines serving this model parse no tool calls (they "
            "answer with text); send 'auto' or 'none', or leave it out.",
            "tool_choice",
        ),
    ),
    (
        "reasoning_effort, SGLang and vLLM",
        "tmix",
        {"reasoning_effort": "low"},
        _invalid(
            "'reasoning_effort' changes the prompt differently on the engines serving this model; leave it out.",
            "reasoning_effort",
        ),
    ),
]


@pytest.mark.parametrize(("name", "model", "extra", "error"), REFUSED, ids=[c[0] for c in REFUSED])
def test_tokenize_refuses_what_chat_refuses_with_chats_own_error(env, name, model, extra, error):
    """Before: ``/tokenize`` answered 200 with a count for the first nine (chat refuses each
    before counting) and refused the others in words of its own ("Unrecognized request argument
    supplied: top_p", "/tokenize does not take image content parts ...")."""
    body = {"model": model, "messages": HI, **extra}
    assert chat_prompt_tokens(env, body) == (400, error)
    assert tokenize(env, body) == (400, error)


# ---------------------------------------------------------------- chat counts: /tokenize counts the same
def test_tokenize_counts_reasoning_effort_as_chat_and_the_engine_do(env):
    """``reasoning_effort`` is a template variable behind vLLM (the Jinja template here prints
    ``effort: low`` after the generation prompt): chat counts it, 12 tokens more than without in
    the tiny BPE's tokens (``transformers``' own render, tests/gate_oracle.py, agrees).
    Before: ``/tokenize`` refused the field as unknown, so such a chat could not be sized."""
    client, sg, vl, quotas, folder = env
    body = {"model": "tv", "messages": HI, "reasoning_effort": "low"}
    oracle = hf_chat_tokens(folder, body, engine="vllm")
    plain = hf_chat_tokens(folder, {"model": "tv", "messages": HI}, engine="vllm")
    assert (oracle, plain) == (21, 9)
    assert chat_prompt_tokens(env, body) == (200, oracle)
    assert tokenize(env, body) == (200, oracle)
    assert tokenize(env, {"model": "tv", "messages": HI}) == (200, plain)


@pytest.mark.parametrize(
    ("model", "extra", "count"),
    [
        ("cv", {"max_tokens": 16, "temperature": 0.5, "top_p": 0.9, "seed": 7, "stop": ["x"]}, 9),
        ("cs", {"n": 2, "top_k": 5, "user": "u", "stream": True, "stream_options": {"include_usage": True}}, 9),
        ("tv", {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"}, 99),
        ("ck", {"max_completion_tokens": 5, "logprobs": False, "ignore_eos": True}, 9),
    ],
)
def test_tokenize_takes_the_chat_body_chat_takes(env, model, extra, count):
    """The same chat body on both routes, with the fields that do not change the prompt: chat
    admits it, ``/tokenize`` counts exactly what chat reserved. Before: each was a 400
    "Unrecognized request argument supplied: max_tokens" (``n``, ``tools``' ``tool_choice``,
    ``max_completion_tokens``)."""
    body = {"model": model, "messages": HI, **extra}
    client, sg, vl, quotas, folder = env
    oracle = hf_chat_tokens(folder, body, engine="vllm") if model == "tv" else 9  # ChatML: 6 specials, 3 words
    assert oracle == count
    if body.get("stream"):
        assert tokenize(env, body) == (200, count)
        body = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    assert chat_prompt_tokens(env, body) == (200, count)
    assert tokenize(env, body) == (200, count)


def test_image_parts_chat_counts_stay_refused_here(env):
    """The one place the routes differ on purpose: chat counts a data: image at the model's cost,
    ``/tokenize`` has no ids for it (the counters know none) and refuses it in its own words."""
    body = {"model": "cv", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, IMAGE]}]}
    assert chat_prompt_tokens(env, body) == (200, 9 + 765 + 1)  # vLLM writes the image's "\n" too
    assert tokenize(env, body) == (400, NO_IMAGE_IDS)


@pytest.mark.parametrize("model", ["ck", "cv", "tv", "to"])
def test_a_prompt_is_counted_as_completions_counts_it(env, model):
    """A string ``prompt`` (vLLM ``TokenizeCompletionRequest``) against ``/v1/completions`` with
    the same string: the count is the prompt tokens completions reserved (a guard: these agreed
    before, and the chat changes above leave the prompt path as it was)."""
    client, sg, vl, quotas, folder = env
    for text in ("hi", "Say hello.", "<|im_start|>system x", "日本 é 1e15"):
        before = (len(sg.state.requests), len(vl.state.requests))
        r = client.post("/v1/completions", json={"model": model, "prompt": text, "max_tokens": 3})
        assert r.status_code == 200, r.text
        [got] = [q["body"] for q in sg.state.requests[before[0] :] + vl.state.requests[before[1] :]]
        assert got["max_tokens"] == 3
        assert tokenize(env, {"model": model, "prompt": text}) == (200, quotas.reserved[-1] - 3)


# ---------------------------------------------------------------- the model's task and an engine tokenizer
def test_a_chat_for_an_embedding_model_is_refused_as_chat_refuses_it(engine):
    """Before: ``/tokenize`` counted a chat for an embedding model (9 tokens), which no route of
    kvgate takes. Now chat's own 400: the model does not serve chat."""
    g = Gateway(api_settings(engine), tenants(max_context_tokens=200, allowed_models=[MODEL, EMB])).start()
    try:
        with g.client() as c:
            body = {"model": EMB, "messages": HI}
            chat, tok = c.post("/v1/chat/completions", json=body), c.post("/tokenize", json=body)
            prompt = c.post("/tokenize", json={"model": EMB, "prompt": "hello world"})
    finally:
        g.stop()
    message = (
        f"The model `{EMB}` is an embedding model and does not serve /v1/chat/completions; it serves "
        "/v1/embeddings, /tokenize, /detokenize."
    )
    assert chat.status_code == tok.status_code == 400
    assert error_of(chat) == error_of(tok) == _invalid(message, "model")
    assert prompt.json()["count"] == 2  # a prompt is what an embedding model's route counts
    assert engine.state.requests == []


def test_an_engine_tokenizer_is_asked_only_for_what_chat_admits(engine):
    """For an ``engine`` tokenizer the chat went to the engine's ``/tokenize`` with
    ``add_generation_prompt: false`` although SGLang (the model's engine) takes no such field and
    chat refuses it; now chat's 400 first, and ``reasoning_effort`` (SGLang: template variables)
    reaches the engine as chat's own count sends it."""
    s = api_settings(engine)
    s.models[0].tokenizer = s.models[0].tokenizer.model_validate(
        {"kind": "engine", "url": engine.url, "engine_api": "vllm"}
    )
    g = Gateway(s, tenants(max_context_tokens=200, allowed_models=[MODEL, EMB])).start()
    try:
        with g.client() as c:
            r = c.post("/tokenize", json={"model": MODEL, "messages": HI, "add_generation_prompt": False})
            assert r.status_code == 400 and error_of(r) == _unrecognized("add_generation_prompt")
            assert engine.state.requests == []
            body = {"model": MODEL, "messages": HI, "reasoning_effort": "none"}
            r = c.post("/tokenize", json=body)
            assert r.status_code == 200 and r.json()["count"] == 9
            assert c.post("/v1/chat/completions", json=body).status_code == 200
    finally:
        g.stop()
    asked, counted = [q["body"] for q in engine.state.requests if q["path"] == "/tokenize"]
    kwargs = {"reasoning_effort": "none", "thinking": False, "enable_thinking": False}
    assert (
        asked
        == counted
        == {"model": MODEL, "messages": HI, "add_generation_prompt": True, "chat_template_kwargs": kwargs}
    )


# ---------------------------------------------------------------- the property
TEXT = st.sampled_from(["hi", "", "Say hello.", "<|im_start|>system", "日本 é", "1e15"])


@st.composite
def part(draw) -> dict:
    kind = draw(st.sampled_from(["text", "text", "refusal", "image", "input_image", "uuid", "odd"]))
    if kind == "text":
        return {"type": "text", "text": draw(TEXT)}
    if kind == "refusal":
        return {"type": "refusal", "refusal": draw(TEXT)}
    if kind == "image":
        return IMAGE
    if kind == "input_image":
        return {"type": "input_image", "image_url": IMAGE["image_url"]["url"]}
    if kind == "uuid":
        return {"type": "text", "text": draw(TEXT), "uuid": "u"}
    return {"type": "audio_url", "audio_url": {"url": "data:x"}}


@st.composite
def message(draw) -> dict:
    role = draw(st.sampled_from(["user", "user", "system", "developer", "assistant", "tool", "wizard"]))
    content = draw(st.one_of(TEXT, st.none(), st.lists(part(), min_size=1, max_size=2)))
    m: dict[str, Any] = {"role": role}
    if draw(st.integers(0, 9)):
        m["content"] = content
    if role == "assistant" and draw(st.booleans()):
        call_id = draw(st.sampled_from(["c1", 1]))
        m["tool_calls"] = [{"id": call_id, "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]
    if role == "tool":
        m["tool_call_id"] = draw(st.sampled_from(["c1", 5]))
    if draw(st.integers(0, 5)) == 0:
        m[draw(st.sampled_from(["name", "reasoning_content", "foo"]))] = draw(st.sampled_from(["bob", 3]))
    return m


TOOLS = st.sampled_from(
    [
        None,
        [],
        [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        [{"type": "function"}],
        [{"type": "function", "function": {"name": "<|im_end|>"}}],
    ]
)
#: optional fields: a value drawn from each list (``None``: the field is left out)
OPTIONS: dict[str, list[Any]] = {
    "add_generation_prompt": [None, True, False],
    "continue_final_message": [None, False, True],
    "chat_template_kwargs": [None, {}, {"enable_thinking": False}, {"tools": [1]}],
    "reasoning_effort": [None, "low", "none"],
    "max_tokens": [None, 1, 16],
    "temperature": [None, 0, 0.7],
    "top_p": [None, 0, 0.5],
    "top_k": [None, 0, 5],
    "n": [None, 2],
    "logprobs": [None, True],
    "tool_choice": [None, "auto", "required"],
    "stream_options": [None, {"include_usage": True}],
    "chat_template": [None, "{{ 1 }}"],
}


@st.composite
def chat_body(draw) -> dict:
    body: dict[str, Any] = {"model": draw(st.sampled_from(sorted(ENGINES)))}
    body["messages"] = draw(st.lists(message(), min_size=1, max_size=3))
    tools = draw(TOOLS)
    if tools is not None:
        body["tools"] = tools
    for key, values in OPTIONS.items():
        if draw(st.integers(0, 3)) == 0:
            value = draw(st.sampled_from(values))
            if value is not None:
                body[key] = value
    return body


def _has_image(body: dict) -> bool:
    return any(
        isinstance(p, dict) and p.get("type") in ("image_url", "input_image")
        for m in body["messages"]
        for p in (m.get("content") if isinstance(m.get("content"), list) else ())
    )


def check_agreement(env, body: dict, seen: dict[str, int], params: set[str]) -> None:
    """The property for one body: chat admits it and ``/tokenize`` counts exactly the prompt
    tokens chat reserved (or refuses an image part chat counted); or both refuse with the same
    status and error body (``seen`` tallies the outcomes, ``params`` the top-level field each
    refusal names)."""
    chat = chat_prompt_tokens(env, body)
    tok = tokenize(env, body)
    if chat[0] == 200 and tok == (400, NO_IMAGE_IDS):
        assert _has_image(body), body
        seen["image"] += 1
        return
    assert tok == chat, (body, tok, chat)
    seen["counted" if chat[0] == 200 else "refused"] += 1
    if chat[0] != 200:
        params.add(str(chat[1]["param"]).split("[")[0].split(".")[0])


@pytest.mark.timeout(600)
def test_tokenize_and_chat_agree_on_every_generated_chat(env):
    """For every drawn chat body (a model of every engine set, messages of every role and part
    type, tools good and bad, the generation switches, template kwargs, ``reasoning_effort`` and
    chat's other fields), sent as it is to both routes: the same count or the same refusal. Before:
    the draws shrank to ``top_k: 0`` for the bundled backend, which chat refuses as the engines'
    extension table does ("... (the engines serving this model do not accept it).") and
    ``/tokenize`` as a field of no table of its own."""
    seen: dict[str, int] = {"counted": 0, "refused": 0, "image": 0}
    params: set[str] = set()

    @settings(
        max_examples=1000,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(chat_body())
    def one(body):
        check_agreement(env, body, seen, params)

    one()
    print("\ntokenize/chat agreement:", json.dumps(seen, sort_keys=True), sorted(params))
    assert seen["counted"] >= 120 and seen["refused"] >= 500 and seen["image"] >= 3, seen
    assert len(params) >= 10, params


def test_a_chat_too_deeply_nested_to_forward_is_refused_by_both(env):
    """Tool parameters nested 260 objects deep: counted, but more than the 254 levels orjson
    writes back, so the chat route refuses the body it cannot forward. Before, ``/tokenize``
    answered 200 with a count for it."""
    params: dict = {"type": "string"}
    for _ in range(260):
        params = {"p": params}
    body = {
        "model": "cs",
        "messages": HI,
        "tools": [{"type": "function", "function": {"name": "f", "parameters": params}}],
    }
    error = {
        "message": "The request body is nested too deeply to forward.",
        "type": "invalid_request_error",
        "param": None,
        "code": "invalid_request",
    }
    assert chat_prompt_tokens(env, body) == (400, error)
    assert tokenize(env, body) == (400, error)
