"""The gate's numbers at their edges (gateway/admission/gate.py): the effective limit, the context
gate and the whole request's KV demand admit exactly up to their bound and refuse one token above
it with the exact OpenAI-shaped 400; the defaulted completion bound is the least of the default,
the cap and what the limit and the KV demand leave; the sequences cap; the empty-prompt refusal;
a prompt refused by its length before it is counted; where a prompt is counted (on the event
loop, charged to its payer, or in a worker thread); the forwarded body; and the request body read
up to its byte limit and parsed, each fault in its own words (gateway/admission/body.py)."""

from __future__ import annotations

import functools
from time import perf_counter
from typing import Any

import httpx
import orjson
import pytest

from config.errors import OpenAIError
from config.models import ModelConfig, TenantConfig
from gateway.admission.body import ClientGone, body_declared, parse_json_body, read_body
from gateway.admission.gate import (
    CountedPrompt,
    client_wants_usage,
    count_prompt,
    decide,
    effective_limit,
    sequences_of,
    too_long_to_count,
    upstream_body,
)
from gateway.admission.registry import ModelEntry
from gateway.edge.body_budget import FREE_BODY_BYTES
from gateway.routes import CHAT, COMPLETIONS
from tests.gate_oracle import text_tokens
from tokenizer import bundled_counter
from tokenizer.base import LOOP_ACCOUNT, LoopAccount
from tokenizer.engine_counter import EngineCounter

BIG = 10**6
SAY_HI = [{"role": "user", "content": "hi"}]


@functools.cache
def _counter():
    return bundled_counter()


def entry(context_length: int = 8192, engines: frozenset[str] = frozenset({"sglang"})) -> ModelEntry:
    """Model ``m`` on the bundled ChatML counter (cl100k_base, at most 128 characters a token)."""
    return ModelEntry(ModelConfig(id="m", upstream_model="up-m", context_length=context_length), _counter(), engines)


def tenant(**kw: Any) -> TenantConfig:
    return TenantConfig.model_validate({"id": "t", **kw})


def refusal(fn, *args) -> OpenAIError:
    with pytest.raises(OpenAIError) as err:
        fn(*args)
    return err.value


def chat(**kw: Any) -> dict[str, Any]:
    return {"messages": SAY_HI, **kw}


# ---------------------------------------------------------------- the effective limit
@pytest.mark.parametrize(
    "context_length,pool,tenant_max,limit",
    [
        (8192, 3000, None, 3000),  # the live pool
        (2048, 3000, None, 2048),  # the model
        (8192, 3000, 1000, 1000),  # the tenant
        (1000, 3000, 2000, 1000),
        (8192, 500, 1000, 500),
    ],
)
def test_effective_limit_is_the_least_of_model_pool_and_tenant(context_length, pool, tenant_max, limit):
    t, e = tenant(max_context_tokens=tenant_max), entry(context_length)
    assert effective_limit(e, t, pool) == limit
    assert decide(e, t, chat(max_tokens=1), CHAT, CountedPrompt(10, 10, 1, "hi"), pool).limit == limit


# ---------------------------------------------------------------- the context gate
@pytest.mark.parametrize("route,body", [(CHAT, chat()), (COMPLETIONS, {"prompt": ["a", "b"]})])
def test_context_gate_admits_up_to_the_limit_and_refuses_one_token_above(route, body):
    t, e = tenant(max_context_tokens=1000, max_tokens_cap=None), entry()
    prompt = CountedPrompt(900, 1500, 2, "x") if route is COMPLETIONS else CountedPrompt(900, 900, 1, "x")
    a = decide(e, t, {**body, "max_tokens": 100}, route, prompt, BIG)
    assert (a.limit, a.max_tokens, a.defaulted, a.reserve_tokens) == (
        1000,
        100,
        False,
        prompt.total + prompt.num_prompts * 100,
    )
    err = refusal(decide, e, t, {**body, "max_tokens": 101}, route, prompt, BIG)
    where = route.prompt_param
    assert (err.status, err.code, err.param, err.prompt_tokens) == (400, "context_length_exceeded", where, prompt.total)
    assert err.message == (
        f"This model's maximum context length is 1000 tokens. However, you requested 1001 tokens "
        f"(900 in the {where}, 101 in the completion). Please reduce the length of the {where} or completion."
    )


def test_requested_bound_is_never_shrunk_to_fit():
    """A bound the client sent is gated as sent: above what the limit leaves it is a 400, not a
    smaller bound."""
    e = entry()
    err = refusal(
        decide, e, tenant(max_context_tokens=160), chat(max_tokens=151), CHAT, CountedPrompt(10, 10, 1, "x"), BIG
    )
    assert (err.code, err.param) == ("context_length_exceeded", "messages")
    assert "160 tokens. However, you requested 161 tokens (10 in the messages, 151 in the completion)" in err.message


# ---------------------------------------------------------------- the whole request's KV demand
@pytest.mark.parametrize(
    "extra,seqs,param",
    [({"n": 2}, 2, "n"), ({"best_of": 2}, 2, "best_of"), ({"n": 2, "best_of": 2}, 2, "n"), ({}, 1, "prompt")],
)
def test_kv_demand_admits_up_to_the_pool_and_refuses_one_token_above(extra, seqs, param):
    t, e = tenant(), entry()
    prompt = CountedPrompt(60, 100, 2, "x")  # 2 prompts, 100 tokens in all
    pool = seqs * (100 + 2 * 50)
    a = decide(e, t, {"prompt": ["a", "b"], "max_tokens": 50, **extra}, COMPLETIONS, prompt, pool)
    assert (a.max_tokens, a.reserve_tokens, a.sequences, a.n, a.limit) == (50, pool, 2 * seqs, extra.get("n", 1), pool)
    err = refusal(decide, e, t, {"prompt": ["a", "b"], "max_tokens": 51, **extra}, COMPLETIONS, prompt, pool)
    demand = seqs * (100 + 2 * 51)
    assert (err.status, err.code, err.param) == (400, "invalid_request", param)
    assert err.message == (
        f"This request needs {demand} tokens of KV cache ({seqs} sequence(s) x (100 prompt tokens + 2 x 51 "
        f"completion tokens)); the engines serving this model hold at most {pool} for one request. "
        "Reduce 'n', the batch or the completion."
    )


# ---------------------------------------------------------------- the defaulted bound
@pytest.mark.parametrize(
    "tenant_kw,body,prompt,pool,max_tokens",
    [
        ({"default_max_tokens": 64}, {}, (50, 50, 1), BIG, 64),  # the default
        ({"default_max_tokens": 64, "max_tokens_cap": 20}, {}, (50, 50, 1), BIG, 20),  # the cap
        ({"default_max_tokens": 64, "max_context_tokens": 100}, {}, (50, 50, 1), BIG, 50),  # the limit leaves 50
        ({"default_max_tokens": 64, "max_context_tokens": 100}, {}, (99, 99, 1), BIG, 1),  # exactly one left
        # the KV demand: 1001 // 2 = 500 per sequence, (500 - 30) // 3 = 156 per completion
        ({"default_max_tokens": 256}, {"n": 2}, (10, 30, 3), 1001, 156),
        ({"default_max_tokens": 256}, {"best_of": 2}, (10, 30, 3), 1001, 156),
        ({"default_max_tokens": 100, "max_tokens_cap": 200}, {"n": 2}, (10, 30, 3), 1001, 100),
    ],
)
def test_defaulted_bound_is_the_least_of_default_cap_and_room(tenant_kw, body, prompt, pool, max_tokens):
    t, e = tenant(**tenant_kw), entry()
    largest, total, num = prompt
    seqs = sequences_of(body)
    a = decide(e, t, {"prompt": ["a"] * num, **body}, COMPLETIONS, CountedPrompt(largest, total, num, "x"), pool)
    assert (a.max_tokens, a.defaulted, a.bound_field) == (max_tokens, True, "max_tokens")
    assert a.reserve_tokens == seqs * (total + num * max_tokens) <= pool


def test_no_room_left_is_refused_quoting_one_completion_token():
    t, e = tenant(default_max_tokens=64, max_context_tokens=100), entry()
    err = refusal(decide, e, t, chat(), CHAT, CountedPrompt(100, 100, 1, "x"), BIG)
    assert (err.code, err.param) == ("context_length_exceeded", "messages")
    assert "requested 101 tokens (100 in the messages, 1 in the completion)" in err.message
    # the KV demand leaves nothing: 100 // 4 - 30 < 1, refused naming n with the bound of 1
    err = refusal(decide, e, tenant(), {"prompt": "x", "n": 4}, COMPLETIONS, CountedPrompt(30, 30, 1, "x"), 100)
    assert (err.code, err.param) == ("invalid_request", "n")
    assert err.message.startswith(
        "This request needs 124 tokens of KV cache (4 sequence(s) x (30 prompt tokens + 1 x 1"
    )


# ---------------------------------------------------------------- the requested bound and the cap
@pytest.mark.parametrize(
    "body,field",
    [(chat(max_tokens=5, max_completion_tokens=100), "max_completion_tokens"), (chat(max_tokens=100), "max_tokens")],
)
def test_requested_bound_up_to_the_cap_and_refused_above_naming_its_field(body, field):
    t, e = tenant(max_tokens_cap=100), entry()
    a = decide(e, t, body, CHAT, CountedPrompt(10, 10, 1, "x"), BIG)
    assert (a.max_tokens, a.defaulted, a.bound_field) == (100, False, "max_tokens")
    err = refusal(decide, e, t, {**body, field: 101}, CHAT, CountedPrompt(10, 10, 1, "x"), BIG)
    assert (err.status, err.code, err.param) == (400, "invalid_request", field)
    assert err.message == f"'{field}' is 101, above this key's cap of 100 tokens."
    # no cap: the bound is the client's, the gates alone limit it
    assert decide(e, tenant(), {**body, field: 5000}, CHAT, CountedPrompt(10, 10, 1, "x"), BIG).max_tokens == 5000


# ---------------------------------------------------------------- sequences
@pytest.mark.parametrize(
    "num,body,param",
    [
        (2, {"n": 3}, "n"),  # 6 > 4
        (1, {"n": 5}, "n"),
        (2, {"n": 2, "best_of": 3}, "best_of"),
        (2, {"n": 3, "best_of": 3}, "n"),
        (5, {}, "prompt"),  # more prompts than the cap
    ],
)
def test_sequences_over_the_cap_refused_naming_the_field(num, body, param):
    t, e = tenant(max_sequences_per_request=4), entry()
    seqs = sequences_of(body)
    err = refusal(decide, e, t, {"prompt": ["a"] * num, **body}, COMPLETIONS, CountedPrompt(1, num, num, "x"), BIG)
    assert (err.status, err.code, err.param) == (400, "invalid_request", param)
    assert err.message == (
        f"This request asks for {num} prompt(s) x {seqs} sequence(s) each = {num * seqs} sequences; "
        "this key allows at most 4 per request."
    )


@pytest.mark.parametrize("num,body", [(2, {"n": 2}), (1, {"best_of": 4}), (4, {}), (2, {"n": 1, "best_of": 2})])
def test_sequences_at_the_cap_admitted(num, body):
    a = decide(entry(), tenant(max_sequences_per_request=4), {"prompt": ["a"] * num, **body}, COMPLETIONS,
               CountedPrompt(1, num, num, "x"), BIG)  # fmt: skip
    assert (a.sequences, a.n) == (4, body.get("n", 1))


@pytest.mark.parametrize(
    "body,seqs", [({}, 1), ({"n": None, "best_of": None}, 1), ({"n": 3, "best_of": 2}, 3), ({"best_of": 5}, 5)]
)
def test_sequences_of_is_max_of_n_and_best_of(body, seqs):
    assert sequences_of(body) == seqs


# ---------------------------------------------------------------- empty prompts
@pytest.mark.parametrize(
    "prompt,per_prompt,where",
    [("", (0,), "prompt"), ([""], (0,), "prompt[0]"), (["a", ""], (1, 0), "prompt[1]")],
)
def test_empty_prompt_refused_naming_it(prompt, per_prompt, where):
    counted = CountedPrompt(1, sum(per_prompt), len(per_prompt), "", per_prompt)
    for engines in (frozenset({"sglang"}), frozenset({"openai", "vllm"}), frozenset()):
        err = refusal(decide, entry(engines=engines), tenant(), {"prompt": prompt}, COMPLETIONS, counted, BIG)
        assert (err.status, err.code, err.param) == (400, "invalid_request", where)
        assert err.message == (
            f"Invalid value for '{where}': the prompt is empty (0 tokens); engines refuse an empty prompt."
        )
    # OpenAI completes an empty prompt: only an all-openai model takes it
    a = decide(entry(engines=frozenset({"openai"})), tenant(), {"prompt": prompt}, COMPLETIONS, counted, BIG)
    assert a.prompt_tokens_total == sum(per_prompt)


def test_prompts_of_one_token_admitted():
    a = decide(entry(), tenant(), {"prompt": ["a", "b"]}, COMPLETIONS, CountedPrompt(1, 2, 2, "", (1, 1)), BIG)
    assert (a.prompt_tokens, a.prompt_tokens_total, a.num_prompts) == (1, 2, 2)


# ---------------------------------------------------------------- what the admission carries
def test_admission_gathers_the_prompt_text_and_names_the_forwarded_field():
    t = tenant(default_max_tokens=7)
    body = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    a = decide(entry(engines=frozenset({"vllm", "openai"})), t, body, CHAT, CountedPrompt(9, 9, 1), BIG)
    assert (a.prompt_text, a.bound_field, a.max_tokens, a.n, a.sequences) == (
        "hi\nyo",
        "max_completion_tokens",
        7,
        1,
        1,
    )
    a = decide(entry(), t, body, CHAT, CountedPrompt(9, 9, 1, "kept"), BIG)
    assert (a.prompt_text, a.bound_field) == ("kept", "max_tokens")


# ---------------------------------------------------------------- refused before counting
@pytest.mark.parametrize("limit,refused_at", [(100, None), (99, 99)])
def test_prompt_longer_than_the_limit_in_characters_refused_before_counting(limit, refused_at):
    """No token is longer than 128 characters here: 128 x 100 + 127 characters are at least 100 tokens."""
    body = {"prompt": "a" * (128 * 100 + 127)}
    if refused_at is None:
        assert too_long_to_count(entry(), body, COMPLETIONS, limit) is None
        return
    err = refusal(too_long_to_count, entry(), body, COMPLETIONS, limit)
    assert (err.status, err.code, err.param, err.prompt_tokens) == (400, "context_length_exceeded", "prompt", 100)
    assert err.message == (
        "This model's maximum context length is 99 tokens. However, you requested at least 100 tokens in the "
        "prompt alone (counting stopped there). Please reduce the length of the prompt."
    )


def test_too_long_to_count_defaults_to_the_model_context_length():
    body = chat()
    body["messages"] = [{"role": "user", "content": "a" * (128 * 51)}]
    assert too_long_to_count(entry(51), body, CHAT) is None
    err = refusal(too_long_to_count, entry(50), body, CHAT)
    assert (err.param, err.prompt_tokens) == ("messages", 51)
    assert err.message.startswith(
        "This model's maximum context length is 50 tokens. However, you requested at least 51"
    )


def test_a_counter_without_a_longest_token_refuses_nothing_by_length():
    counter = EngineCounter("http://engine", "m", api="vllm", client=httpx.AsyncClient())
    assert counter.max_token_chars is None
    e = ModelEntry(ModelConfig(id="m", context_length=8192), counter, frozenset({"vllm"}))
    assert too_long_to_count(e, {"prompt": "a" * 100000}, COMPLETIONS, 2) is None


# ---------------------------------------------------------------- counting
HEAVY = "hello world " * 2000  # 24,000 characters: over the counter's 16,384, counted in a worker thread


async def test_heavy_prompt_counted_in_a_thread_with_its_text_and_refused_past_the_limit():
    e = entry()
    got = await count_prompt(e, {"prompt": [HEAVY, "hi"]}, COMPLETIONS, max_sequences=2, limit=8192)
    assert got == CountedPrompt(text_tokens(HEAVY), text_tokens(HEAVY) + 1, 2, HEAVY + "\nhi", (text_tokens(HEAVY), 1))
    with pytest.raises(OpenAIError) as err:  # 24,000 // 128 = 187 tokens at least
        await count_prompt(e, {"prompt": HEAVY}, COMPLETIONS, limit=186)
    assert (err.value.code, err.value.prompt_tokens) == ("context_length_exceeded", 187)
    assert (await count_prompt(e, {"prompt": HEAVY}, COMPLETIONS, limit=187)).largest == text_tokens(HEAVY)


async def test_count_prompt_refuses_the_batch_only_when_given_the_cap():
    body = {"prompt": ["a", "b", "c"], "n": 2}
    with pytest.raises(OpenAIError) as err:
        await count_prompt(entry(), body, COMPLETIONS, max_sequences=5)
    assert (err.value.param, err.value.message) == (
        "n",
        "This request asks for 3 prompt(s) x 2 sequence(s) each = 6 sequences; this key allows at most 5 per request.",
    )
    got = await count_prompt(entry(), body, COMPLETIONS)
    assert (got.largest, got.total, got.num_prompts, got.per_prompt) == (1, 3, 3, (1, 1, 1))


async def test_light_prompt_counted_on_the_loop_and_charged_to_the_payer():
    """A prompt under the counter's 16,384 characters is counted on the event loop and charged to
    the payer's share of it; a heavy one, or one whose payer has spent its share, in a worker
    thread (nothing charged)."""
    light = {"prompt": "hello world"}
    for body, due_after, full in ((light, True, False), ({"prompt": HEAVY}, False, False), (light, False, True)):
        account = LoopAccount(rate=1.0, burst=1.0)
        account.due = perf_counter() + 3600 if full else 0.0
        before = account.due
        token = LOOP_ACCOUNT.set(account)
        try:
            got = await count_prompt(entry(), body, COMPLETIONS, max_sequences=16, limit=8192)
        finally:
            LOOP_ACCOUNT.reset(token)
        assert got.largest == text_tokens(body["prompt"])
        assert (account.due > before) is due_after, (body["prompt"][:20], full)


async def test_engine_counted_prompt_and_the_engines_failure_as_a_502():
    """A counter that counts only by asking the engine (its ``/tokenize``), light or heavy prompt,
    with the payer's loop account set; the engine's failure is a 502, not a 400."""
    asked: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        text = orjson.loads(request.content)["prompt"]
        asked.append(text)
        return httpx.Response(500) if text == "fail" else httpx.Response(200, json={"count": len(text) // 4})

    counter = EngineCounter(
        "http://engine", "m", api="vllm", client=httpx.AsyncClient(transport=httpx.MockTransport(handler))
    )
    e = ModelEntry(ModelConfig(id="m", context_length=8192), counter, frozenset({"vllm"}))
    token = LOOP_ACCOUNT.set(LoopAccount(rate=1.0, burst=1.0))
    try:
        for prompt in ("hello world!", HEAVY):
            got = await count_prompt(e, {"prompt": prompt}, COMPLETIONS, max_sequences=16, limit=8192)
            assert (got.largest, got.total, got.num_prompts) == (len(prompt) // 4, len(prompt) // 4, 1)
        with pytest.raises(OpenAIError) as err:
            await count_prompt(e, {"prompt": "fail"}, COMPLETIONS, max_sequences=16, limit=8192)
    finally:
        LOOP_ACCOUNT.reset(token)
        await counter.aclose()
    assert (err.value.status, err.value.code) == (502, "upstream_unavailable")
    assert asked == ["hello world!", HEAVY, "fail"]


@pytest.mark.parametrize("ids", [[5, -1], [5] * 20000 + [-1]])  # on the event loop; in a worker thread
async def test_invalid_token_id_is_a_400_naming_it_either_way(ids):
    with pytest.raises(OpenAIError) as err:
        await count_prompt(entry(), {"prompt": [[5], ids]}, COMPLETIONS)
    assert (err.value.status, err.value.code, err.value.param) == (400, "invalid_request", "prompt[1]")
    assert err.value.message == (
        "Invalid token id -1 in 'prompt[1]': ids must be integers in [0, 100277) that the model's tokenizer defines."
    )


# ---------------------------------------------------------------- the forwarded body
def _forwarded(body: dict[str, Any], engines: frozenset[str] = frozenset({"sglang"})) -> dict[str, Any]:
    adm = decide(entry(engines=engines), tenant(default_max_tokens=12), body, CHAT, CountedPrompt(5, 5, 1, "x"), BIG)
    return orjson.loads(upstream_body(body, adm, "salt-t"))


@pytest.mark.parametrize(
    "extra,sent",
    [
        ({}, {}),
        ({"stream": False, "stream_options": None}, {"stream": False}),
        ({"stream": True}, {"stream": True, "stream_options": {"include_usage": True}}),
        ({"stream": True, "stream_options": None}, {"stream": True, "stream_options": {"include_usage": True}}),
        (
            {"stream": True, "stream_options": {"include_usage": False, "continuous_usage_stats": True}},
            {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
        ),
        (
            {"stream": True, "stream_options": {"include_usage": True}},
            {"stream": True, "stream_options": {"include_usage": True}},
        ),
    ],
)
def test_forwarded_body_asks_a_stream_for_its_usage(extra, sent):
    got = _forwarded(chat(model="m", cache_salt="client", **extra))
    assert got == {"messages": SAY_HI, "model": "up-m", "cache_salt": "salt-t", "max_tokens": 12, **sent}


def test_forwarded_body_drops_nulls_but_tool_choice_and_carries_one_bound():
    body = chat(model="m", tool_choice=None, temperature=None, max_tokens=None, max_completion_tokens=9)
    got = _forwarded(body, frozenset({"openai"}))
    assert got == {
        "messages": SAY_HI,
        "model": "up-m",
        "tool_choice": None,
        "cache_salt": "salt-t",
        "max_completion_tokens": 9,
    }


@pytest.mark.parametrize(
    "body,wants",
    [
        ({"stream": True, "stream_options": {"include_usage": True}}, True),
        ({"stream": True, "stream_options": {"include_usage": False}}, False),
        ({"stream": True, "stream_options": None}, False),
        ({"stream": True}, False),
        ({"stream": False, "stream_options": {"include_usage": True}}, False),
        ({"stream_options": {"include_usage": True}}, False),
    ],
)
def test_client_wants_usage_only_for_a_stream_that_asked(body, wants):
    assert client_wants_usage(body) is wants


# ---------------------------------------------------------------- reading and parsing the body
def test_parse_json_body_answers_each_fault_in_its_words():
    assert parse_json_body(b'{"a": [1, {"b": null}]}') == {"a": [1, {"b": None}]}
    cases = [
        (b"", None, "The request body is empty; expected a JSON object."),
        (b"[1]", None, "The request body must be a JSON object."),
        (b'{"a": "\xff"}', None, "The request body is not valid UTF-8 JSON."),
        (b'{"a": "\\ud800"}', None, "The request body is not valid UTF-8 JSON."),
        (b'{"n": 1, "top_p": -Infinity}', "top_p", FINITE.format("top_p")),
        (b'{"t": nan}', "t", FINITE.format("t")),
        (b'{"t": 1e999, "n": 1}', "t", FINITE.format("t")),
    ]
    for raw, param, message in cases:
        err = refusal(parse_json_body, raw)
        assert (err.status, err.code, err.param, err.message) == (400, "invalid_request", param, message), raw
    for raw in (b'{"a": [NaN]}', b'{"a": 1,}', b"{"):  # nested, or another syntax error: not named
        err = refusal(parse_json_body, raw)
        assert (err.param, err.message.startswith("We could not parse the JSON body of your request (")) == (None, True)


FINITE = "Invalid value for '{}': must be a finite number (NaN, Infinity and numbers beyond a double are not JSON)"


@pytest.mark.parametrize(
    "headers,declared",
    [
        ({}, False),
        ({"content-length": "0"}, False),
        ({"content-length": " "}, False),
        ({"content-length": "1"}, True),
        ({"transfer-encoding": "chunked"}, True),
        ({"content-length": "0", "transfer-encoding": "chunked"}, True),
    ],
)
def test_body_declared_by_length_or_transfer_encoding(headers, declared):
    assert body_declared(headers) is declared


def receiver(*chunks: bytes, disconnect: bool = False):
    """An ASGI ``receive`` giving ``chunks`` (then a disconnect, when asked)."""
    messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]
    if disconnect:
        messages[-1]["more_body"] = True
        messages.append({"type": "http.disconnect"})
    it = iter(messages)

    async def receive():
        return next(it)

    return receive


async def test_read_body_takes_up_to_the_limit_and_refuses_one_byte_more_closing():
    assert await read_body(receiver(b"ab", b"", b"cd"), None, 4) == b"abcd"
    assert await read_body(receiver(b"abcd"), "4", 4) == b"abcd"
    for length, chunks in ((None, (b"ab", b"cde")), ("5", (b"abcde",))):  # while reading; from the header
        with pytest.raises(OpenAIError) as err:
            await read_body(receiver(*chunks), length, 4)
        e = err.value
        assert (e.status, e.code, e.message, e.headers) == (
            413,
            "request_too_large",
            "The request body is larger than 4 bytes.",
            {"connection": "close"},
        )

    async def unread():
        raise AssertionError("a Content-Length above the limit is refused before any read")

    for length in ("5", "four"):
        with pytest.raises(OpenAIError) as err:
            await read_body(unread, length, 4)
        assert err.value.status == (413 if length == "5" else 400)
    with pytest.raises(OpenAIError) as err:
        await read_body(receiver(b"ab"), "four", 4)
    assert (err.value.status, err.value.message, err.value.headers) == (
        400,
        "Invalid Content-Length header.",
        {"connection": "close"},
    )
    with pytest.raises(ClientGone):
        await read_body(receiver(b"ab", disconnect=True), None, 4)

    async def one_message():  # ASGI: no ``more_body`` is the last message
        return {"type": "http.request", "body": b"xy"}

    assert await read_body(one_message, None, 4) == b"xy"


async def test_read_body_checks_each_read_and_paces_past_the_free_bytes():
    checked: list[bytes] = []
    paced: list[int] = []

    async def pace(n: int) -> None:
        paced.append(n)

    first, second = b"a" * (FREE_BODY_BYTES - 10), b"b" * 30
    got = await read_body(receiver(first, second, b"c"), None, 10**6, checked.append, pace)
    assert got == first + second + b"c"
    assert (checked, paced) == ([first, second, b"c"], [20, 1])
    paced.clear()  # a read that ends exactly at the free bytes is not paced
    assert (
        await read_body(receiver(b"a" * FREE_BODY_BYTES, b"b"), None, 10**6, None, pace)
        == b"a" * FREE_BODY_BYTES + b"b"
    )
    assert paced == [1]

    def check(chunk: bytes) -> None:
        if b"!" in chunk:
            raise OpenAIError(400, "bang", code="invalid_request")

    with pytest.raises(OpenAIError) as err:
        await read_body(receiver(b"ok", b"!"), None, 100, check)
    assert (err.value.message, err.value.headers) == ("bang", {"connection": "close"})
