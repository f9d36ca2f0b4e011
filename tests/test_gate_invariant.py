"""The gate holds against a hostile client (issue "The gate holds"): one named test per way the
gate was walked around, each through the real app to a recording mock engine. The expected
prompt counts come from tests/gate_oracle.py (tiktoken on the body the engine received), never
from the gateway's own counter.

Setup: pool 4096 tokens, headroom 1.25 -> live limit 3,276 tokens; tenant cap 256, default 16,
at most 16 sequences per request.
"""

from __future__ import annotations

import pytest

from tests.gate_env import KEY_A, gate_env
from tests.gate_oracle import (
    chat_tokens,
    engine_chat_tokens,
    hf_chat_tokens,
    hf_prompt_tokens,
    hf_vocab,
    openai_tile_cost,
    png,
    text_tokens,
)


@pytest.fixture(scope="module")
def env():
    with gate_env() as e:
        yield e


def post(env, route: str, body: dict):
    """POST ``body``; returns ``(status, json, body the engine received or None)``."""
    c, sg, vl, q, _ = env
    before = (len(sg.state.requests), len(vl.state.requests))
    r = c.post("/v1/chat/completions" if route == "chat" else "/v1/completions", json=body)
    received = [x["body"] for x in sg.state.requests[before[0] :] + vl.state.requests[before[1] :]]
    return r.status_code, r.json(), (received[-1] if received else None)


def refused(env, route: str, body: dict) -> str:
    """The ``param`` of the 400 ``body`` must get; asserts nothing reached an engine."""
    status, data, received = post(env, route, body)
    assert status == 400, (status, data)
    assert received is None
    assert data["error"]["type"] == "invalid_request_error"
    return data["error"]["param"]


def user(text: str = "Say hello.", **kw) -> dict:
    return {"messages": [{"role": "user", "content": text}], **kw}


def chatml(body: dict, agp: bool = True) -> int:
    return chat_tokens(body, lambda part: 765, agp)


# ---------------------------------------------------------------- one completion bound
def test_max_completion_tokens_zero_with_max_tokens_100000(env):
    q = env[3]
    assert refused(env, "chat", user(model="m", max_completion_tokens=0, max_tokens=100000)) == "max_completion_tokens"
    assert refused(env, "chat", user(model="m", max_completion_tokens=0)) == "max_completion_tokens"
    assert refused(env, "completions", {"model": "m", "prompt": "x", "max_tokens": 0}) == "max_tokens"
    assert refused(env, "chat", user(model="m", max_tokens=100000)) == "max_tokens"  # above the cap of 256
    # both aliases: max_completion_tokens is the one gated, and the only one forwarded
    status, _, got = post(env, "chat", user(model="m", max_completion_tokens=7, max_tokens=500))
    assert status == 200 and got["max_tokens"] == 7 and "max_completion_tokens" not in got
    assert q.reserved[-1] == chatml(got) + 7
    # absent: an explicit bound (the tenant's default) is forwarded
    status, _, got = post(env, "chat", user(model="m"))
    assert status == 200 and got["max_tokens"] == 16 and "max_completion_tokens" not in got
    # an OpenAI upstream reads max_completion_tokens: the bound goes there, max_tokens is dropped
    status, _, got = post(env, "chat", user(model="mo", max_tokens=9))
    assert status == 200 and got["max_completion_tokens"] == 9 and "max_tokens" not in got
    status, _, got = post(env, "completions", {"model": "mo", "prompt": "x"})
    assert status == 200 and got["max_tokens"] == 16


# ---------------------------------------------------------------- whole-request KV demand
def test_n_times_batch_is_gated_as_a_whole(env):
    q = env[3]
    # the request: 300 prompts of 3,800 ids, n = 128 (38,400 sequences): 1.14 M token ids,
    # parsed in slices (gateway/admission/density.py) and refused for its sequences before counting
    assert refused(env, "completions", {"model": "m", "prompt": [[1] * 3800] * 300, "n": 128}) == "prompt"
    # the same shape small enough to parse: refused for its 38,400 sequences, before counting
    assert refused(env, "completions", {"model": "m", "prompt": [[1] * 38] * 300, "n": 128}) == "prompt"
    assert refused(env, "completions", {"model": "m", "prompt": [[1] * 10] * 4, "n": 8}) == "n"  # 32 > 16
    assert refused(env, "completions", {"model": "m", "prompt": [[1] * 10] * 2, "n": 2, "best_of": 9}) == "best_of"
    assert refused(env, "chat", user(model="m", n=17)) == "n"
    # 16 sequences fit the cap, but 8 x (200 prompt + 2 x 200 completion) = 4,800 > 3,276 KV tokens
    assert refused(env, "completions", {"model": "m", "prompt": [[1] * 100] * 2, "n": 8, "max_tokens": 200}) == "n"
    # 8 x (200 + 2 x 100) = 3,200 fits; the quotas reserve exactly that
    status, _, got = post(env, "completions", {"model": "m", "prompt": [[1] * 100] * 2, "n": 8, "max_tokens": 100})
    assert status == 200 and got["n"] == 8 and got["max_tokens"] == 100
    assert q.reserved[-1] == 3200


def test_defaulted_bound_shrinks_to_fit_the_kv_demand(env):
    c, sg, vl, q, _ = env
    # default_max_tokens 16 fits 16 sequences of 11 + 16 tokens (432 <= 3,276)
    status, _, got = post(env, "chat", user(model="m", n=16))
    assert status == 200 and got["max_tokens"] == 16 and q.reserved[-1] == 16 * (11 + 16)
    # with a 1,000-token prompt, 16 sequences leave floor(3276 / 16) - 1002 < 1: refused, naming n
    long = "word " * 1000
    p = text_tokens(long)
    assert refused(env, "completions", {"model": "m", "prompt": long, "n": 16}) == "n"
    # n = 3: floor(3276 / 3) - p tokens each, capped by the default of 16
    status, _, got = post(env, "completions", {"model": "m", "prompt": long, "n": 3})
    assert status == 200 and got["max_tokens"] == min(16, 3276 // 3 - p)
    assert q.reserved[-1] == 3 * (p + got["max_tokens"])


# ---------------------------------------------------------------- prompt-changing fields
def test_chat_template_kwargs_with_tools_or_documents_refused(env):
    q = env[3]
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    for kwargs in (
        {"tools": [tool]},
        {"documents": [{"title": "t", "text": "x" * 5000}]},
        {"add_generation_prompt": 0},
    ):
        assert refused(env, "chat", user(model="mv", chat_template_kwargs=kwargs)) == "chat_template_kwargs"
    assert refused(env, "chat", user(model="mv", chat_template_kwargs={"enable_thinking": "yes"})) == (
        "chat_template_kwargs"
    )
    assert refused(env, "chat", user(model="mv", documents=[{"text": "x"}])) == "documents"  # vLLM's RAG field
    assert refused(env, "chat", user(model="mv", chat_template="{{ 'x' * 100000 }}")) == "chat_template"
    assert refused(env, "chat", user(model="m", input_ids=[1, 2])) == "input_ids"  # SGLang: bypasses the template
    # the allow-listed key passes, unchanged, and (ChatML) changes nothing in the count
    status, _, got = post(env, "chat", user(model="mv", chat_template_kwargs={"enable_thinking": False}))
    assert status == 200 and got["chat_template_kwargs"] == {"enable_thinking": False}
    assert q.reserved[-1] == chatml(got) + 16
    # the bundled backend has no template kwargs: refused there
    assert refused(env, "chat", user(model="mo", chat_template_kwargs={"enable_thinking": False})) == (
        "chat_template_kwargs"
    )
    # top-level tools are counted, as SGLang (serving "m") hands them to the template: each tool's
    # model_dump() (tests/engine_tool_models.py), with its defaults filled in
    status, _, got = post(env, "chat", user(model="m", tools=[tool]))
    assert status == 200 and got["tools"] == [tool]
    sglang = engine_chat_tokens("sglang", got, lambda part: 765)
    assert q.reserved[-1] == sglang + 16 and sglang > chatml(got) > chatml(user())


def test_generation_prompt_fields_counted_or_refused(env):
    q = env[3]
    # vLLM reads add_generation_prompt: false drops the assistant header, and the count follows
    status, _, got = post(env, "chat", user(model="mv", add_generation_prompt=False))
    assert status == 200 and got["add_generation_prompt"] is False
    assert q.reserved[-1] == chatml(got, agp=False) + 16 == chatml(got) - 3 + 16
    # SGLang and the bundled backend ignore it: refused (it would be counted wrong), the default dropped
    assert refused(env, "chat", user(model="m", add_generation_prompt=False)) == "add_generation_prompt"
    status, _, got = post(env, "chat", user(model="m", add_generation_prompt=True, continue_final_message=False))
    assert status == 200 and "add_generation_prompt" not in got and "continue_final_message" not in got
    # continue_final_message: not defined for the ChatML counter; never with add_generation_prompt
    body = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]}
    assert refused(env, "chat", {**body, "model": "mv", "continue_final_message": True}) == "continue_final_message"
    assert refused(env, "chat", {**body, "model": "m", "continue_final_message": True}) == "continue_final_message"
    assert (
        refused(env, "chat", {**body, "model": "mv", "continue_final_message": True, "add_generation_prompt": True})
        == "continue_final_message"
    )
    # a model served by SGLang and vLLM takes only what both accept
    assert refused(env, "chat", user(model="mix", add_generation_prompt=False)) == "add_generation_prompt"
    assert refused(env, "chat", user(model="mix", regex="a+")) == "regex"  # SGLang only
    assert refused(env, "chat", user(model="mix", spaces_between_special_tokens=False)) == (
        "spaces_between_special_tokens"
    )  # vLLM only
    status, _, got = post(env, "chat", user(model="mix", top_k=5, min_p=0.1))
    assert status == 200 and got["top_k"] == 5
    # reasoning_effort becomes template kwargs that differ between SGLang and vLLM: refused for mix
    assert refused(env, "chat", user(model="mix", reasoning_effort="low")) == "reasoning_effort"
    status, _, got = post(env, "chat", user(model="m", reasoning_effort="none"))
    assert status == 200 and got["reasoning_effort"] == "none"


def test_suffix_refused_where_the_engine_inserts_it(env):
    q = env[3]
    assert refused(env, "completions", {"model": "m", "prompt": "def f(", "suffix": "return x"}) == "suffix"
    assert refused(env, "completions", {"model": "mv", "prompt": "def f(", "suffix": "return x"}) == "suffix"
    # an OpenAI upstream: accepted, and the suffix is counted as prompt text
    status, _, got = post(env, "completions", {"model": "mo", "prompt": "def f(", "suffix": "return x"})
    assert status == 200 and got["suffix"] == "return x"
    assert q.reserved[-1] == text_tokens("def f(") + text_tokens("return x") + 16


def test_echo_with_logprobs_refused(env):
    assert refused(env, "completions", {"model": "m", "prompt": "x", "echo": True, "logprobs": 0}) == "echo"
    assert refused(env, "completions", {"model": "mv", "prompt": "x", "echo": True, "logprobs": 5}) == "echo"
    status, _, got = post(env, "completions", {"model": "m", "prompt": "x", "echo": True})
    assert status == 200 and got["echo"] is True


# ---------------------------------------------------------------- images
def _image_chat(model: str, url: str, detail: str | None = None) -> dict:
    image = {"url": url, **({"detail": detail} if detail else {})}
    content = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": image}]
    return {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 5}


def test_image_urls_are_data_only_by_default(env):
    q = env[3]
    for url in (
        "http://169.254.169.254/latest/meta-data/",
        "https://images.example/cat.png",  # allowed for mimg only
        "file:///etc/passwd",
        "http://images.example@evil.example/x.png",
        "gopher://images.example/x",
    ):
        assert refused(env, "chat", _image_chat("m", url)) == "messages[0].content[1].image_url"
    assert refused(env, "chat", _image_chat("mimg", "http://evil.example/x.png")) == "messages[0].content[1].image_url"
    assert refused(env, "chat", _image_chat("mimg", "http://images.example@evil.example/x")) == (
        "messages[0].content[1].image_url"
    )
    # data: URL, fixed cost (765 by default)
    status, _, got = post(env, "chat", _image_chat("m", png(64, 64)))
    assert status == 200 and q.reserved[-1] == chat_tokens(got, lambda p: 765) + 5
    # OpenAI tiles: 1024 x 1024 -> 768 x 768 -> 4 tiles = 765; 4000 x 500 -> 2048 x 256 -> 4 tiles; low = 85
    for (w, h), cost in (((1024, 1024), 765), ((4000, 500), 85 + 170 * 4), ((100, 100), 255)):
        assert openai_tile_cost(w, h) == cost
        status, _, got = post(env, "chat", _image_chat("mimg", png(w, h)))
        assert status == 200 and q.reserved[-1] == chat_tokens(got, lambda p, c=cost: c) + 5
    status, _, got = post(env, "chat", _image_chat("mimg", png(4000, 4000), detail="low"))
    assert status == 200 and q.reserved[-1] == chat_tokens(got, lambda p: 85) + 5
    # an allow-listed URL: its size is unknown, so it costs the formula's maximum (8 tiles)
    status, _, got = post(env, "chat", _image_chat("mimg", "https://images.example/cat.png"))
    assert status == 200 and q.reserved[-1] == chat_tokens(got, lambda p: 85 + 170 * 8) + 5
    # Qwen2-VL: 1024 x 1024 -> 1036 x 1036 (37 x 37 patches of 28) + 2 vision tokens
    status, _, got = post(env, "chat", _image_chat("mq", png(1024, 1024)))
    assert status == 200 and q.reserved[-1] == chat_tokens(got, lambda p: 37 * 37 + 2) + 5
    # an image too large for the pool at this cost: the gate says so
    big = {"model": "mq", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": png(5000, 5000)}}
    ]}], "max_tokens": 5}  # fmt: skip
    status, data, got = post(env, "chat", big)
    assert status == 400 and data["error"]["code"] == "context_length_exceeded" and got is None


# ---------------------------------------------------------------- engine extension fields
def test_grammar_strings_bounded_in_bytes(env):
    huge = "a" * (32 * 1024 + 1)
    assert refused(env, "chat", user(model="m", regex=huge)) == "regex"
    assert refused(env, "chat", user(model="m", ebnf="root ::= " + "é" * (16 * 1024))) == "ebnf"  # 2 bytes each
    assert refused(env, "completions", {"model": "m", "prompt": "x", "json_schema": '{"a": "' + huge + '"}'}) == (
        "json_schema"
    )
    assert refused(env, "completions", {"model": "m", "prompt": "x", "json_schema": "{not json"}) == "json_schema"
    assert refused(env, "completions", {"model": "m", "prompt": "x", "regex": "a", "ebnf": "b"}) == "ebnf"
    assert refused(env, "chat", user(model="m", json_schema="{}")) == "json_schema"  # a completions field
    assert refused(env, "chat", user(model="mv", regex="a+")) == "regex"  # vLLM has no 'regex'
    status, _, got = post(env, "chat", user(model="m", regex="a" * (32 * 1024)))
    assert status == 200 and len(got["regex"]) == 32 * 1024


def test_stop_token_ids_garbage_refused(env):
    for ids in ([{"x": 1}, "s", -5], [-5], ["1"], [True], [1.5], 5, [100277], [2**31], list(range(65))):
        assert refused(env, "chat", user(model="m", stop_token_ids=ids)) == "stop_token_ids"
    status, _, got = post(env, "chat", user(model="m", stop_token_ids=[100265, 0]))
    assert status == 200 and got["stop_token_ids"] == [100265, 0]
    assert refused(env, "chat", user(model="m", logit_bias={"100277": 1})) == "logit_bias"
    assert refused(env, "chat", user(model="m", logit_bias={"-1": 1})) == "logit_bias"
    assert refused(env, "chat", user(model="m", logit_bias={"5": 101})) == "logit_bias"


def test_min_tokens_above_the_bound_refused(env):
    assert refused(env, "chat", user(model="m", min_tokens=10**18)) == "min_tokens"
    assert refused(env, "chat", user(model="m", min_tokens=2**64)) == "min_tokens"
    assert refused(env, "chat", user(model="m", min_tokens=5, max_tokens=4)) == "min_tokens"
    assert refused(env, "chat", user(model="m", min_tokens=17)) == "min_tokens"  # above the defaulted 16
    assert refused(env, "chat", user(model="m", min_tokens=-1)) == "min_tokens"
    assert refused(env, "chat", user(model="mo", min_tokens=1)) == "min_tokens"  # not an OpenAI field
    status, _, got = post(env, "chat", user(model="m", min_tokens=4, max_tokens=4))
    assert status == 200 and got["min_tokens"] == 4 and got["max_tokens"] == 4


def test_seed_outside_64_bits_refused(env):
    assert refused(env, "chat", user(model="m", seed=2**64 - 1)) == "seed"
    assert refused(env, "chat", user(model="m", seed=2**63)) == "seed"
    assert refused(env, "completions", {"model": "m", "prompt": "x", "seed": -(2**63) - 1}) == "seed"
    for seed in (2**63 - 1, -(2**63), 0):
        status, _, got = post(env, "chat", user(model="m", seed=seed))
        assert status == 200 and got["seed"] == seed
    assert refused(env, "chat", user(model="m", top_k=2**31)) == "top_k"
    assert refused(env, "chat", user(model="m", repetition_penalty=0)) == "repetition_penalty"
    assert refused(env, "chat", user(model="m", n=2**64)) == "n"
    assert refused(env, "chat", user(model="m", max_tokens=2**64)) == "max_tokens"
    # beyond 64 bits a JSON integer is read as a float: the message names the range, not "an integer"
    status, data, _ = post(env, "chat", user(model="m", seed=2**70))
    assert (status, data["error"]["param"], data["error"]["message"]) == (
        400,
        "seed",
        "Invalid value for 'seed': must be an integer from -9223372036854775808 to 9223372036854775807",
    )


def test_sdk_newer_fields_accepted(env):
    """The official SDK's current chat parameters reach a 200; an unknown one is still a 400."""
    import openai

    c, sg, vl, q, _ = env
    client = openai.OpenAI(base_url=str(c.base_url) + "/v1", api_key=KEY_A, max_retries=0)
    r = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "Say hello."}],
        max_completion_tokens=8,
        prompt_cache_key="k1",
        prompt_cache_retention="24h",
        prompt_cache_options={"mode": "implicit", "ttl": "30m"},
        safety_identifier="user-1",
        moderation={"model": "omni-moderation-latest"},
        verbosity="low",
        service_tier="auto",
        store=False,
        metadata={"a": "b"},
        modalities=["text"],
        parallel_tool_calls=False,
        reasoning_effort="low",
        web_search_options={},
    )
    assert r.choices[0].message.content == "Hello from the mock."
    got = sg.state.requests[-1]["body"]
    assert got["max_tokens"] == 8 and "max_completion_tokens" not in got
    assert got["prompt_cache_retention"] == "24h" and got["moderation"] == {"model": "omni-moderation-latest"}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}], extra_body={"definitely_not_a_field": 1}
        )
    assert e.value.body["param"] == "definitely_not_a_field"
    for field, value in (("prompt_cache_retention", "7d"), ("verbosity", "loud"), ("service_tier", "free")):
        assert refused(env, "chat", user(model="m", **{field: value})) == field
    assert refused(env, "chat", user(model="m", return_hidden_states=True)) == "return_hidden_states"


def test_response_format_bounded(env):
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(2000)}}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    assert refused(env, "chat", user(model="m", response_format=fmt)) == "response_format"
    assert refused(env, "chat", user(model="m", response_format={"type": "grammar"})) == "response_format"
    status, _, got = post(env, "chat", user(model="m", response_format={"type": "json_object"}))
    assert status == 200 and got["response_format"] == {"type": "json_object"}


def test_hf_template_fields_counted_as_the_engine_renders_them(env):
    """``mh``: a Hugging Face model on vLLM whose template reads ``enable_thinking``. The oracle
    is transformers' own apply_chat_template on the body the engine received."""
    q, folder = env[3], env[4]
    base = user("Hello world", model="mh")
    status, _, got = post(env, "chat", base)
    plain = hf_chat_tokens(folder, got)
    assert status == 200 and q.reserved[-1] == plain + 16
    status, _, got = post(env, "chat", {**base, "chat_template_kwargs": {"enable_thinking": False}})
    assert status == 200 and got["chat_template_kwargs"] == {"enable_thinking": False}
    assert q.reserved[-1] == hf_chat_tokens(folder, got) + 16 > plain + 16  # the empty think block counted
    status, _, got = post(env, "chat", {**base, "add_generation_prompt": False})
    assert status == 200 and q.reserved[-1] == hf_chat_tokens(folder, got) + 16 < plain + 16
    prefill = {
        "model": "mh",
        "messages": [{"role": "user", "content": "a b c"}, {"role": "assistant", "content": "Hello"}],
    }
    status, _, got = post(env, "chat", {**prefill, "continue_final_message": True})
    assert status == 200 and got["continue_final_message"] is True and got["add_generation_prompt"] is False
    assert q.reserved[-1] == hf_chat_tokens(folder, got) + 16
    prefill["messages"][1]["content"] = "Hello "  # transformers versions disagree on trailing whitespace
    assert refused(env, "chat", {**prefill, "continue_final_message": True}) == "continue_final_message"
    assert refused(env, "chat", {**base, "stop_token_ids": [hf_vocab(folder)]}) == "stop_token_ids"
    status, _, got = post(env, "completions", {"model": "mh", "prompt": ["Hello world", "a b"], "max_tokens": 3})
    assert status == 200 and q.reserved[-1] == sum(hf_prompt_tokens(folder, got["prompt"])) + 2 * 3


def test_message_fields_outside_the_openai_shape_refused(env):
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    body = {
        "model": "m",
        "messages": [{"role": "system", "content": "s", "tools": [tool]}, {"role": "user", "content": "x"}],
    }
    assert refused(env, "chat", body) == "messages[0].tools"  # SGLang merges these into the prompt
    body = {"model": "mv", "messages": [{"role": "user", "content": "x", "chat_template": "{{ 'y' }}"}]}
    assert refused(env, "chat", body) == "messages[0].chat_template"
    ok = {"role": "assistant", "content": "a", "reasoning_content": "r", "refusal": None}
    status, _, got = post(env, "chat", {"model": "m", "messages": [{"role": "user", "content": "x"}, ok]})
    assert status == 200 and got["messages"][1] == ok


# ---------------------------------------------------------------- stop strings and numeric fields
def refusal(env, route: str, body: dict | bytes) -> tuple[int, str | None, str]:
    """``(status, param, message)`` of the answer to ``body`` (a dict, or raw JSON bytes); asserts
    nothing reached an engine."""
    c, sg, vl, _, _ = env
    before = len(sg.state.requests) + len(vl.state.requests)
    url = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    if isinstance(body, bytes):
        r = c.post(url, content=body, headers={"content-type": "application/json"})
    else:
        r = c.post(url, json=body)
    assert len(sg.state.requests) + len(vl.state.requests) == before
    e = r.json()["error"]
    assert e["type"] == "invalid_request_error" and e["code"] == "invalid_request"
    return r.status_code, e["param"], e["message"]


def test_stop_strings_bounded_in_bytes(env):
    each = "Invalid value for 'stop': each stop string must be at most 1024 bytes (UTF-8)"
    in_all = "Invalid value for 'stop': the stop strings must be at most 4096 bytes (UTF-8) in all"
    shape = "Invalid value for 'stop': must be a string or an array of at most 16 strings"
    assert refusal(env, "chat", user(model="m", stop="a" * 1025)) == (400, "stop", each)
    assert refusal(env, "chat", user(model="m", stop=["x", "é" * 513])) == (400, "stop", each)  # 513 chars, 1,026 bytes
    assert refusal(env, "completions", {"model": "mv", "prompt": "x", "stop": ["日" * 342]}) == (400, "stop", each)
    assert refusal(env, "chat", user(model="m", stop=["a" * 1024] * 4 + ["b"])) == (400, "stop", in_all)
    assert refusal(env, "chat", user(model="m", stop=["ab"] * 17)) == (400, "stop", shape)
    assert refusal(env, "chat", user(model="m", stop=["a", None])) == (400, "stop", shape)
    assert refusal(env, "chat", user(model="m", stop={"a": 1})) == (400, "stop", shape)
    # at the bounds: forwarded unchanged
    status, _, got = post(env, "chat", user(model="m", stop=["a" * 1024] * 4))
    assert status == 200 and got["stop"] == ["a" * 1024] * 4
    status, _, got = post(env, "completions", {"model": "mv", "prompt": "x", "stop": "é" * 512})
    assert status == 200 and got["stop"] == "é" * 512


def test_numeric_fields_of_the_wrong_kind_refused(env):
    def msg(field: str, problem: str) -> tuple[int, str, str]:
        return 400, field, f"Invalid value for '{field}': {problem}"

    integer, boolean = "must be an integer", "must be a boolean"
    chat_cases = [
        (user(model="m", max_tokens=16.0), msg("max_tokens", integer)),
        (user(model="m", max_tokens=True), msg("max_tokens", integer)),
        # orjson reads an integer beyond 64 bits as a float: the message gives the range
        (user(model="m", max_tokens=10**30), msg("max_tokens", "must be an integer from 1 to 9223372036854775807")),
        (user(model="m", max_completion_tokens=16.0), msg("max_completion_tokens", integer)),
        (user(model="m", max_completion_tokens=False), msg("max_completion_tokens", integer)),
        (user(model="m", max_completion_tokens=-1), msg("max_completion_tokens", "must be >= 1")),
        (user(model="m", n=0), msg("n", "must be >= 1")),
        (user(model="m", n=-1), msg("n", "must be >= 1")),
        (user(model="m", n=2.0), msg("n", integer)),
        (user(model="m", n=129), msg("n", "must be <= 128")),
        (user(model="m", logprobs=1), msg("logprobs", boolean)),
        (user(model="m", top_logprobs=21), msg("top_logprobs", "must be <= 20")),
        (user(model="m", top_logprobs=-1), msg("top_logprobs", "must be >= 0")),
        (user(model="m", top_logprobs=True), msg("top_logprobs", integer)),
        (user(model="m", temperature=2.0001), msg("temperature", "must be <= 2")),
        (user(model="m", temperature=-0.1), msg("temperature", "must be >= 0")),
        (user(model="m", temperature="NaN"), msg("temperature", "must be a number")),
        (user(model="m", temperature=True), msg("temperature", "must be a number")),
        (user(model="m", top_p=1.5), msg("top_p", "must be <= 1")),
        (user(model="m", top_p=-1), msg("top_p", "must be >= 0")),
        (user(model="m", top_p="nan"), msg("top_p", "must be a number")),
    ]
    for body, want in chat_cases:
        assert refusal(env, "chat", body) == want, body
    completion_cases = [
        ({"max_tokens": 16.5}, msg("max_tokens", integer)),
        ({"best_of": 0}, msg("best_of", "must be >= 1")),
        ({"logprobs": 6}, msg("logprobs", "must be <= 5")),
        ({"logprobs": -1}, msg("logprobs", "must be >= 0")),
        ({"logprobs": True}, msg("logprobs", integer)),
    ]
    for extra, want in completion_cases:
        assert refusal(env, "completions", {"model": "m", "prompt": "x", **extra}) == want, extra
    # best_of below n: neither vLLM nor SGLang reads best_of (served there); OpenAI refuses it
    assert refusal(env, "completions", {"model": "mo", "prompt": "x", "n": 3, "best_of": 2}) == msg(
        "best_of", "must be >= 'n'"
    )
    # NaN, Infinity and numbers beyond a double are not JSON: a top-level one is still named
    finite = "must be a finite number (NaN, Infinity and numbers beyond a double are not JSON)"
    head = b'{"model": "m", "messages": [{"role": "user", "content": "x"}], '
    for raw, field in (
        (b'"temperature": NaN}', "temperature"),
        (b'"temperature": -Infinity}', "temperature"),
        (b'"top_p": 1e999}', "top_p"),
        (b'"top_p": nan, "n": 1}', "top_p"),
        (b'"max_tokens": Infinity}', "max_tokens"),
    ):
        assert refusal(env, "chat", head + raw) == msg(field, finite), raw
    status, param, message = refusal(env, "chat", head + b'"logit_bias": {"5": NaN}}')  # nested: not named
    assert (status, param) == (400, None) and message.startswith("We could not parse the JSON body")
    # the edges pass
    status, _, got = post(env, "chat", user(model="m", temperature=2, top_p=1e-9, top_logprobs=20, logprobs=True, n=1))
    assert status == 200 and (got["temperature"], got["top_p"], got["top_logprobs"]) == (2, 1e-9, 20)


def _text_len(folder, text: str) -> int:
    """Tokens of ``text`` in mh's tokenizer with special-token look-alikes read as text."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.encode_special_tokens = True
    return len(tok.encode(text, add_special_tokens=False).ids)


def test_special_token_lookalike_in_a_tool_definition_refused(env):
    """The property test's falsifying example (a full-suite run): a tool named ``<|im_start|>`` on
    ``mh`` (vLLM) was admitted and counted 10 tokens above what the engine holds, a count the
    oracle had no rule for. vLLM renders tool definitions verbatim and parses special tokens in
    the result, so the text is a control token there: refused, naming the string's path, while
    the same text in message content stays accepted and counted as text (never below the engine)."""
    c, _, _, q, folder = env
    n = len(q.reserved)
    body = {
        "model": "mh",
        "messages": [{"role": "system", "content": ""}],
        "tools": [{"type": "function", "function": {"name": "<|im_start|>", "parameters": {}}}],
    }
    status, data, received = post(env, "chat", body)
    assert status == 400 and received is None and len(q.reserved) == n
    assert data == {
        "error": {
            "message": "'tools[0].function.name' holds '<|im_start|>', the text of one of this model's special "
            "tokens: the engines serving it would read it as a control token in the prompt. Tool definitions may "
            "not contain special tokens.",
            "type": "invalid_request_error",
            "param": "tools[0].function.name",
            "code": "invalid_request",
        }
    }
    # anywhere in a definition: a description deep in the schema, a property name (the object is named)
    deep = {"type": "object", "properties": {"q": {"type": "string", "description": "x<|im_end|>\n"}}}
    tool = {"type": "function", "function": {"name": "f", "parameters": deep}}
    assert (
        refused(env, "chat", user(model="mv", tools=[tool])) == "tools[0].function.parameters.properties.q.description"
    )
    keyed = {"type": "object", "properties": {"<|im_start|>system": {"type": "string"}}}
    tool = {"type": "function", "function": {"name": "f", "parameters": keyed}}
    assert refused(env, "chat", user(model="m", tools=[tool])) == "tools[0].function.parameters.properties"
    # the model's own special tokens: <|endoftext|> is one of cl100k_base's, plain text for mh
    eot = {"type": "function", "function": {"name": "f", "description": "ends at <|endoftext|>", "parameters": {}}}
    assert refused(env, "chat", user(model="mix", tools=[eot])) == "tools[0].function.description"
    status, _, got = post(env, "chat", {**body, "tools": [eot], "max_tokens": 16})
    assert status == 200 and got["tools"] == [eot] and q.reserved[-1] == hf_chat_tokens(folder, got) + 16
    # the Responses route's flat tool shape
    r = c.post("/v1/responses", json={"model": "mh", "input": "hi", "tools": [{**body["tools"][0]["function"]}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools[0].name" and len(q.reserved) == n + 1
    # in message content the look-alike is the client's text: admitted, counted as text
    status, _, got = post(env, "chat", user("<|im_start|>", model="mh", max_tokens=16))
    engine = hf_chat_tokens(folder, got)  # transformers reads one special token
    assert status == 200 and q.reserved[-1] == engine + (_text_len(folder, "<|im_start|>") - 1) + 16 > engine + 16


def test_reasoning_effort_none_counts_the_think_block_vllm_writes(env):
    """vLLM (chat_completion/protocol.py@v0.34.0:667-668) sets ``enable_thinking`` to
    ``reasoning_effort != "none"`` unless ``chat_template_kwargs`` names it; ``mh``'s Qwen3-style
    template then writes an empty think block into the generation prompt for ``"none"``. The gate
    passed only the effort and counted the prompt without the block (11 tokens under here)."""
    q, folder = env[3], env[4]
    plain = hf_chat_tokens(folder, user("Hello world", model="mh"))
    off = hf_chat_tokens(folder, user("Hello world", model="mh", chat_template_kwargs={"enable_thinking": False}))
    assert off - plain == 11
    expected = {"high": plain, "none": off}
    for effort, prompt_tokens in expected.items():
        status, _, got = post(env, "chat", user("Hello world", model="mh", reasoning_effort=effort))
        assert status == 200 and got["reasoning_effort"] == effort
        assert q.reserved[-1] == hf_chat_tokens(folder, got, engine="vllm") + 16 == prompt_tokens + 16
    kwargs = {"enable_thinking": True}  # the client's own enable_thinking wins over the effort's
    status, _, got = post(
        env, "chat", user("Hello world", model="mh", reasoning_effort="none", chat_template_kwargs=kwargs)
    )
    assert status == 200 and q.reserved[-1] == plain + 16
