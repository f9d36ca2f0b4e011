"""The gate's invariant, property-based: hostile request bodies over every field the gate rules
touch, sent through the real app (uvicorn, real HTTP) to recording mock engines.

For every 200 the oracle (tests/gate_oracle.py: tiktoken on the body the ENGINE received, not the
gateway's counter) asserts:

- exactly one completion bound was forwarded, >= 1 and <= the tenant cap, and it is the value
  the gate reserved for;
- prompts x max(n, best_of) <= ``max_sequences_per_request``;
- the quota reservation equals max(n, best_of) x (engine-visible prompt tokens + prompts x bound)
  (so the admitted count IS the engine-visible count) and fits the live pool limit;
- min_tokens <= bound, stop_token_ids in the vocabulary, image URLs data: or allow-listed.

For every other answer: a 400 in the OpenAI shape with ``param`` naming a field, and nothing
reached an engine. Never a 500.
"""

from __future__ import annotations

import json
import time
from urllib.parse import urlsplit

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from config.errors import context_length_message
from tests.gate_env import CAP, ENGINES, LIMIT, MAX_SEQUENCES, gate_env
from tests.gate_oracle import (
    VOCAB,
    completion_prompt_tokens,
    engine_chat_tokens,
    hf_chat_tokens,
    hf_prompt_tokens,
    hf_vocab,
    openai_tile_cost,
    png,
    png_size,
    qwen2_vl_cost,
    text_tokens,
)

EXAMPLES = 2000


def mostly(valid: st.SearchStrategy, invalid: st.SearchStrategy) -> st.SearchStrategy:
    """``valid`` two times in three, else ``invalid``."""
    return st.one_of(valid, valid, invalid)


PIECES = ["a", "b c", " ", "\n", "Hello", " world", "é", "日本語", "🙂", "<|im_start|>", "<|im_end|>", "<|endoftext|>"]
text = st.lists(st.sampled_from(PIECES), max_size=12).map("".join)
token_id = st.integers(0, 100_300)
IMAGE_URLS = [
    "http://169.254.169.254/latest/meta-data/",
    "https://images.example/cat.png",
    "http://images.example@evil.example/x",
    "file:///etc/passwd",
    "data:image/png;base64,AAAA",
]
image_url = mostly(st.builds(png, st.integers(1, 5000), st.integers(1, 5000)), st.sampled_from(IMAGE_URLS))
part = st.one_of(
    st.builds(lambda t: {"type": "text", "text": t}, text),
    st.builds(
        lambda u, d: {"type": "image_url", "image_url": {"url": u, **({"detail": d} if d else {})}},
        image_url,
        st.sampled_from([None, "low", "high", "auto"]),
    ),
)
message = st.builds(
    lambda role, content, name: {"role": role, "content": content, **({"name": name} if name else {})},
    st.sampled_from(["system", "user", "assistant", "developer"]),
    st.one_of(text, st.lists(part, min_size=1, max_size=3)),
    st.sampled_from([None, None, None, "bob"]),
)
#: a message with text content only (the HF-template bodies below aim at the template's switches,
#: which a refused image part would never let through to be checked)
text_message = st.builds(
    lambda role, content: {"role": role, "content": content},
    st.sampled_from(["system", "user", "assistant"]),
    text,
)
tool = st.builds(lambda n: {"type": "function", "function": {"name": n or "f", "parameters": {}}}, text)
prompt = st.one_of(
    text,
    st.lists(text, min_size=1, max_size=20),
    st.lists(token_id, min_size=1, max_size=40),
    st.lists(st.lists(token_id, min_size=1, max_size=40), min_size=1, max_size=20),
)
huge = "a" * (32 * 1024 + 1)
#: a falsifying example a full-suite run found (hypothesis drew it only sometimes): a special-token
#: look-alike as the name of a tool that mh's template does not even render
#: fields the generated bodies get admitted with rarely (a refused part elsewhere in the body hides
#: them; only the HF template ``mh`` can continue a final message): run every time, admitted, and
#: checked against the oracle like any generated body. The generated share of them varied between
#: processes (2 to 22 admitted continue_final_message in 2,001 derandomized examples), so the
#: coverage floors below no longer rest on it alone.
TEMPLATE_SWITCHES = [
    ("chat", {"model": "mh", "messages": [*system, {"role": "user", "content": "Name a colour."},
     {"role": "assistant", "content": "Blue, and"}], "continue_final_message": True, **bound})
    for system, bound in (([], {"max_tokens": 4}), ([{"role": "system", "content": "Be brief."}], {}),
                          ([], {"max_completion_tokens": 2}))
] + [
    ("chat", {"model": m, "messages": [{"role": "user", "content": "Hi"}], "chat_template_kwargs": kw})
    for m, kw in (("mh", {"enable_thinking": False}), ("mv", {"enable_thinking": True}), ("mh", {"thinking": True}))
] + [
    # vLLM sets enable_thinking to reasoning_effort != "none" unless the kwargs name it: mh's
    # template then writes an empty think block (uncounted before: the gate passed only the effort)
    ("chat", {"model": "mh", "messages": [{"role": "user", "content": "Hi"}], "reasoning_effort": e, **kw})
    for e, kw in (("none", {}), ("high", {}), ("none", {"chat_template_kwargs": {"enable_thinking": True}}))
] + [
    ("completions", {"model": m, "prompt": "Count:", "stop_token_ids": [3], "min_tokens": 1, "max_tokens": 4})
    for m in ("mv", "mq", "mix")
]  # fmt: skip
LOOKALIKE_TOOL_NAME = (
    "chat",
    {
        "model": "mh",
        "messages": [{"role": "system", "content": ""}],
        "tools": [{"type": "function", "function": {"name": "<|im_start|>", "parameters": {}}}],
    },
)


bound = mostly(st.integers(1, CAP), st.sampled_from([0, 257, 3000, 100_000, 2**63, 2**64]))

#: field -> values (drawn only sometimes); both routes unless the name says otherwise
FIELDS: dict[str, st.SearchStrategy] = {
    "max_tokens": bound,
    "n": mostly(st.integers(1, 16), st.sampled_from([17, 128, 0, 2**64])),
    "stream": st.booleans(),
    "seed": mostly(st.integers(-(2**63), 2**63 - 1), st.sampled_from([2**63, 2**64 - 1, -(2**63) - 1])),
    "temperature": mostly(st.sampled_from([0, 0.7, 2]), st.just(2.5)),
    "top_k": mostly(st.integers(-1, 100), st.sampled_from([-2, 2**31])),
    "min_p": mostly(st.sampled_from([0, 0.5, 1]), st.just(1.5)),
    "repetition_penalty": mostly(st.sampled_from([0.5, 1.1, 2]), st.sampled_from([0, 3])),
    "min_tokens": mostly(st.integers(0, 16), st.sampled_from([17, 300, 10**18, -1, 2**64])),
    "ignore_eos": st.booleans(),
    "stop_token_ids": mostly(
        st.lists(st.integers(0, VOCAB - 1), max_size=4),
        st.sampled_from([[{"x": 1}, "s", -5], "1", [VOCAB], [-1], list(range(65))]),
    ),
    "regex": mostly(st.just("a+"), st.just(huge)),
    "ebnf": mostly(st.just('root ::= "a"'), st.just(huge)),
    "logit_bias": mostly(st.just({"5": 1}), st.sampled_from([{"100277": 1}, {"5": 101}, {"-1": 1}])),
    "stop": mostly(st.sampled_from(["x", ["a", "b"]]), st.just([1])),
    "user": st.just("u"),
    "cache_salt": st.just("client-salt"),
    "bogus_field": st.just(1),
    "spaces_between_special_tokens": st.booleans(),
    "no_stop_trim": st.booleans(),
}
CHAT_FIELDS: dict[str, st.SearchStrategy] = {
    "max_completion_tokens": bound,
    "tools": st.lists(tool, min_size=1, max_size=2),
    "chat_template_kwargs": mostly(
        st.sampled_from([{"enable_thinking": True}, {"thinking": False}]),
        st.sampled_from([{"tools": []}, {"documents": [{"text": "x"}]}, {"x": 1}, {"enable_thinking": "no"}]),
    ),
    "add_generation_prompt": st.booleans(),
    "continue_final_message": st.booleans(),
    "reasoning_effort": mostly(st.sampled_from(["none", "low", "high"]), st.just("max")),
    "documents": st.just([{"text": "x"}]),
    "logprobs": st.booleans(),
    "top_logprobs": mostly(st.integers(0, 20), st.just(21)),
    "prompt_cache_key": st.just("k"),
    "prompt_cache_retention": mostly(st.sampled_from(["in_memory", "24h"]), st.just("7d")),
    "prompt_cache_options": mostly(st.sampled_from([{"mode": "implicit"}, {"ttl": "30m"}]), st.just({"bogus": 1})),
    "safety_identifier": st.just("s"),
    "moderation": st.just({"model": "omni-moderation-latest"}),
    "verbosity": mostly(st.just("low"), st.just("loud")),
    "service_tier": mostly(st.sampled_from(["auto", "flex"]), st.just("free")),
    "store": st.booleans(),
    "metadata": mostly(st.just({"a": "b"}), st.just({"a": 1})),
    "modalities": mostly(st.just(["text"]), st.just(["video"])),
    "parallel_tool_calls": st.booleans(),
    "json_schema": st.just("{}"),
}
COMPLETION_FIELDS: dict[str, st.SearchStrategy] = {
    "best_of": mostly(st.integers(1, 16), st.just(17)),
    "suffix": text,
    "echo": st.booleans(),
    "logprobs": mostly(st.integers(0, 5), st.just(6)),
    "json_schema": mostly(st.sampled_from(["{}", '{"type": "object"}']), st.sampled_from(["{nope", '"' + huge + '"'])),
}


FIRST = ("max_tokens", "max_completion_tokens", "n", "best_of", "tools", "add_generation_prompt", "suffix")


@st.composite
def request(draw):
    route = draw(st.sampled_from(["chat", "completions"]))
    body: dict = {"model": draw(st.sampled_from(sorted(ENGINES)))}
    if route == "chat":
        body["messages"] = draw(st.lists(message, min_size=1, max_size=3))
    else:
        body["prompt"] = draw(prompt)
    table = {**FIELDS, **(CHAT_FIELDS if route == "chat" else COMPLETION_FIELDS)}
    # the gate's own fields first: hypothesis draws early entries of a sampled list more often
    names = [k for k in FIRST if k in table] + sorted(k for k in table if k not in FIRST)
    for name in draw(st.lists(st.sampled_from(names), min_size=1, max_size=4, unique=True)):
        body[name] = draw(table[name])
    if body.get("stream") and draw(st.booleans()):
        body["stream_options"] = {"include_usage": draw(st.booleans())}
    return route, body


small_bound = st.integers(1, 64)


@st.composite
def focused(draw):
    """Bodies aimed at what the gate rules count (so every rule is admitted often enough to be
    checked): vLLM without the generation prompt, an OpenAI upstream's suffix, batches x n,
    images, tools."""
    kind = draw(st.sampled_from(["no_generation_prompt", "suffix", "batch_n", "images_tools", "hf"]))
    if kind == "no_generation_prompt":
        body = {
            "model": draw(st.sampled_from(["mv", "mh"])),
            "messages": draw(st.lists(message, min_size=1, max_size=3)),
        }
        body["add_generation_prompt"] = False
    elif kind == "hf":  # the HF template: thinking switch, continued final message
        body = {"model": "mh", "messages": draw(st.lists(text_message, min_size=1, max_size=3))}
        extra = draw(st.sampled_from(["enable_thinking", "continue", "effort"]))
        if extra == "enable_thinking":
            body["chat_template_kwargs"] = {"enable_thinking": draw(st.booleans())}
        elif extra == "continue":
            body["continue_final_message"] = True
        else:
            body["reasoning_effort"] = draw(st.sampled_from(["low", "high"]))
    elif kind == "suffix":
        body = {"model": "mo", "prompt": draw(prompt), "suffix": draw(text)}
    elif kind == "batch_n":
        body = {"model": draw(st.sampled_from(["m", "mv", "mo"])), "prompt": draw(prompt)}
        body["n"] = draw(st.integers(1, 6))
    else:
        body = {"model": draw(st.sampled_from(sorted(ENGINES))), "messages": draw(st.lists(message, min_size=1))}
        body["tools"] = draw(st.lists(tool, min_size=1, max_size=2))
    if draw(st.booleans()):
        body["max_tokens"] = draw(small_bound)
    return ("chat" if "messages" in body else "completions"), body


def image_cost(model: str):
    def cost(p: dict) -> int:
        url = p["image_url"]["url"]
        detail = p["image_url"].get("detail")
        size = png_size(url)
        if model == "mimg":
            if detail == "low":
                return 85
            return openai_tile_cost(*size) if size else 85 + 170 * 8
        if model == "mq":
            return qwen2_vl_cost(*size) if size else 16384 + 2
        return 765

    return cost


#: each model's special tokens among the generated look-alikes (mh's tokenizer is trained with the
#: ChatML two; the others are cl100k_base with ChatML, where <|endoftext|> is special too)
SPECIALS = {"mh": ("<|im_start|>", "<|im_end|>")}
CL100K_SPECIALS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")
#: the forwarded fields the engine's template or tokenizer renders into the prompt
RENDERED = ("messages", "prompt", "tools", "chat_template_kwargs", "suffix")


def _has_lookalike(obj, specials=("<|im_start|>", "<|im_end|>")) -> bool:
    text = json.dumps(obj, ensure_ascii=False)
    return any(s in text for s in specials)


def check_forwarded(route: str, sent: dict, got: dict, reserved: int, hf_folder) -> None:
    """The oracle's assertions on one admitted request (``got``: the body the engine received).
    ``mh`` (a Hugging Face model) is counted with transformers / tokenizers; a special-token
    look-alike in any field the template renders is counted as text by kvgate (the engine reads
    one special token), so there the admitted count may exceed the engine's, never fall below it.
    No forwarded tool definition holds one of the model's special tokens (every engine here
    parses them in the rendered prompt)."""
    model = sent["model"]
    hf = model == "mh"
    aliases = [k for k in ("max_tokens", "max_completion_tokens") if k in got]
    assert len(aliases) == 1, aliases
    bound_value = got[aliases[0]]
    assert isinstance(bound_value, int) and 1 <= bound_value <= CAP
    if "openai" in ENGINES[model] and route == "chat":
        assert aliases == ["max_completion_tokens"]
    seqs = max(got.get("n") or 1, got.get("best_of") or 1)
    if route == "chat" and hf:
        counts = [max(hf_chat_tokens(hf_folder, got, engine=e) for e in ENGINES[model])]
    elif route == "chat":
        agp = got.get("add_generation_prompt", True)
        assert got.get("continue_final_message") is not True
        # every engine serving the model must hold no more than was reserved: the largest counts
        counts = [max(engine_chat_tokens(e, got, image_cost(model), agp) for e in ENGINES[model])]
        for m in got["messages"]:
            for p in m["content"] if isinstance(m["content"], list) else ():
                if p["type"] == "image_url":
                    u = p["image_url"]["url"]
                    assert u.startswith("data:") or (model == "mimg" and urlsplit(u).hostname == "images.example")
    elif hf:
        counts = hf_prompt_tokens(hf_folder, got["prompt"])
    else:
        counts = completion_prompt_tokens(got["prompt"])
        if got.get("suffix"):
            counts = [c + text_tokens(got["suffix"]) for c in counts]
    num = len(counts)
    assert num * seqs <= MAX_SEQUENCES
    assert max(counts) + bound_value <= LIMIT
    expected = seqs * (sum(counts) + num * bound_value)
    assert not _has_lookalike(got.get("tools"), SPECIALS.get(model, CL100K_SPECIALS)), got["tools"]
    if hf and _has_lookalike([got.get(k) for k in RENDERED]):
        assert expected <= reserved <= LIMIT, (reserved, expected)
    else:
        assert reserved == expected, (reserved, expected, counts, bound_value, seqs)
    assert expected <= LIMIT
    if got.get("min_tokens") is not None:
        assert got["min_tokens"] <= bound_value
    vocab = hf_vocab(hf_folder) if hf else VOCAB
    assert all(0 <= t < vocab for t in got.get("stop_token_ids") or [])
    assert got.get("cache_salt") != "client-salt"
    extra = set(got) - set(sent) - {"model", "cache_salt", "stream_options", aliases[0]}
    if got.get("continue_final_message"):  # the gateway makes vLLM's default explicit
        assert got["add_generation_prompt"] is False
        extra.discard("add_generation_prompt")
    assert not extra, extra


def features(route: str, body: dict) -> list[str]:
    """What an admitted body exercised (the test asserts each was admitted at least a few times)."""
    out = [route, body["model"]]
    if body.get("continue_final_message"):
        out.append("continue_final_message")
    if body.get("chat_template_kwargs"):
        out.append("chat_template_kwargs")
    out += [k for k in ("max_tokens", "max_completion_tokens", "min_tokens", "stop_token_ids", "suffix") if k in body]
    if body.get("tools"):
        out.append("tools")
    if (body.get("n") or 1) > 1 or (body.get("best_of") or 1) > 1:
        out.append("n>1")
    if route == "completions" and isinstance(body["prompt"], list) and isinstance(body["prompt"][0], (str, list)):
        out.append("batch")
    if body.get("add_generation_prompt") is False:
        out.append("no_generation_prompt")
    if any(isinstance(m["content"], list) and any(p["type"] == "image_url" for p in m["content"])
           for m in body.get("messages", ())):  # fmt: skip
        out.append("image")
    return out


@pytest.mark.timeout(240)
def test_hostile_bodies_never_walk_around_the_gate():
    stats = {"examples": 0, "200": 0, "400": 0}
    covered: dict[str, int] = {}
    refusals: dict[str, int] = {}
    t0 = time.monotonic()
    with gate_env() as (client, sg, vl, quotas, hf_folder):

        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            database=None,
            derandomize=True,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
        )
        @given(st.one_of(request(), request(), focused()))
        def one(case):
            route, body = case
            stats["examples"] += 1
            before = (len(sg.state.requests), len(vl.state.requests), len(quotas.reserved))
            path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
            r = client.post(path, json=body)
            received = sg.state.requests[before[0] :] + vl.state.requests[before[1] :]
            if r.status_code == 200:
                stats["200"] += 1
                assert len(received) == 1 and len(quotas.reserved) == before[2] + 1
                check_forwarded(route, body, received[0]["body"], quotas.reserved[-1], hf_folder)
                for feature in features(route, body):
                    covered[feature] = covered.get(feature, 0) + 1
            else:
                stats["400"] += 1
                assert r.status_code == 400, (r.status_code, r.text)
                err = r.json()["error"]
                assert err["type"] == "invalid_request_error"
                assert isinstance(err["param"], str) and err["param"], err
                assert received == [] and len(quotas.reserved) == before[2]
                refusals[err["param"]] = refusals.get(err["param"], 0) + 1

        # run first, every time; applied here rather than as a decorator line because the source
        # digest that seeds ``derandomize`` keeps a nested function's decorators (a new line would
        # reshuffle all 2,000 generated bodies)
        one = example(LOOKALIKE_TOOL_NAME)(one)
        for case in TEMPLATE_SWITCHES:
            one = example(case)(one)
        one()
    stats["seconds"] = round(time.monotonic() - t0, 1)
    print(f"\ngate property: {stats} violations: 0; admitted with: {dict(sorted(covered.items()))}")
    print(f"refused naming: {dict(sorted(refusals.items(), key=lambda kv: -kv[1]))}")
    assert stats["examples"] >= EXAMPLES and stats["200"] >= EXAMPLES // 10 and stats["400"] >= EXAMPLES // 10
    # the bodies still exercise what the gate rules touch (each admitted, and so checked, often)
    for feature in ("tools", "image", "batch", "n>1", "max_tokens", "no_generation_prompt", "suffix", "mo", "mix"):
        assert covered.get(feature, 0) >= 20, (feature, covered)
    for feature in ("max_completion_tokens", "min_tokens", "stop_token_ids", "mv", "mq", "mimg", "mh"):
        assert covered.get(feature, 0) >= 3, (feature, covered)
    for feature in ("continue_final_message", "chat_template_kwargs"):
        assert covered.get(feature, 0) >= 3, (feature, covered)


#: the tenant's ``max_context_tokens`` in :func:`test_the_gate_admits_exactly_what_fits`: below
#: the live pool's limit (:data:`LIMIT`), within reach of the drawn prompts plus a bound
TENANT_CONTEXT = 300
#: one model per engine table the gate's count follows (SGLang, vLLM, OpenAI; cl100k_base ChatML)
EXACT_MODELS = ("m", "mv", "mo")


@st.composite
def sized_request(draw):
    """A chat or completions body with an explicit bound of 1..:data:`TENANT_CONTEXT` (the
    tenant's cap here) and ``n`` of 1..3,
    whose prompt (text messages, or one non-empty prompt) plus bound lands on either side of
    :data:`TENANT_CONTEXT`; the KV demand (at most 3 x (prompt + 300)) stays inside the pool."""
    body: dict = {"model": draw(st.sampled_from(EXACT_MODELS)), "n": draw(st.integers(1, 3))}
    if draw(st.booleans()):
        body["messages"] = draw(st.lists(text_message, min_size=1, max_size=4))
        field = draw(st.sampled_from(["max_tokens", "max_completion_tokens"]))
    else:
        body["prompt"] = draw(st.lists(st.sampled_from(PIECES), min_size=1, max_size=40).map("".join))
        field = "max_tokens"
    # hypothesis favours small integers: a third of the bounds are drawn down from the limit, a
    # third leave the prompt one token short of it, exactly at it, or one over
    bound = st.integers(1, TENANT_CONTEXT)
    edge = TENANT_CONTEXT - sent_prompt_tokens(body) + draw(st.sampled_from([-1, 0, 1]))
    body[field] = draw(st.one_of(bound, bound.map(lambda b: TENANT_CONTEXT + 1 - b), st.just(max(1, edge))))
    return body


def sent_prompt_tokens(body: dict) -> int:
    """The prompt tokens every engine serving ``body``'s model renders from the body as sent (the
    oracle's, as :func:`check_forwarded` counts what an engine received)."""
    if "messages" in body:
        return max(engine_chat_tokens(e, body, image_cost(body["model"])) for e in ENGINES[body["model"]])
    (count,) = completion_prompt_tokens(body["prompt"])
    return count


@pytest.mark.timeout(240)
def test_the_gate_admits_exactly_what_fits():
    """The gate's invariant as an equivalence, through the real app: a body whose prompt (counted
    by the oracle from the body as sent) plus its bound fits the tenant's context
    (``max_context_tokens`` :data:`TENANT_CONTEXT`, below the pool's limit) is admitted and
    reserved exactly ``n x (prompt + bound)``; one that does not is refused with OpenAI's
    ``context_length_exceeded`` 400, its message quoting the exact counts, and nothing reaches an
    engine. A gate that ignored the tenant's limit, or refused at the limit itself, passed the
    hostile-bodies property above (it checks only what was admitted, against the pool)."""
    seen = {"admitted": 0, "refused": 0, "at_limit": 0}
    with gate_env(max_context_tokens=TENANT_CONTEXT, max_tokens_cap=TENANT_CONTEXT) as (client, sg, vl, quotas, _):

        @settings(max_examples=400, deadline=None, database=None, derandomize=True)
        @given(sized_request())
        def one(body):
            before = (len(sg.state.requests), len(vl.state.requests), len(quotas.reserved))
            chat = "messages" in body
            r = client.post("/v1/chat/completions" if chat else "/v1/completions", json=body)
            received = sg.state.requests[before[0] :] + vl.state.requests[before[1] :]
            prompt_tokens = sent_prompt_tokens(body)
            bound = body.get("max_tokens") or body["max_completion_tokens"]
            if prompt_tokens + bound <= TENANT_CONTEXT:
                seen["admitted"] += 1
                seen["at_limit"] += prompt_tokens + bound == TENANT_CONTEXT
                assert (r.status_code, len(received)) == (200, 1), r.text
                assert quotas.reserved[before[2] :] == [body["n"] * (prompt_tokens + bound)]
                return
            seen["refused"] += 1
            where = "messages" if chat else "prompt"
            message = context_length_message(TENANT_CONTEXT, prompt_tokens, bound, messages=chat)
            error = {"message": message, "type": "invalid_request_error", "param": where}
            assert (r.status_code, r.json()["error"]) == (400, {**error, "code": "context_length_exceeded"})
            assert (received, quotas.reserved[before[2] :]) == ([], [])

        one = example({"model": "m", "prompt": "a" * 8, "max_tokens": TENANT_CONTEXT - 1, "n": 1})(one)
        one = example({"model": "mo", "prompt": "a" * 8, "max_tokens": TENANT_CONTEXT, "n": 2})(one)
        one()
    print(f"\ngate equivalence: {seen}")
    assert seen["admitted"] >= 100 and seen["refused"] >= 100 and seen["at_limit"] >= 50, seen
