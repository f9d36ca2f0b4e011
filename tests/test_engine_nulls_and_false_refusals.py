"""Chat and completions bodies that vLLM 0.34.0 and SGLang 0.5.23 take but kvgate mishandled,
through the whole gateway: the recording mock engines of tests/gate_env.py (each admitted
request's reservation recorded; prompt counts from tests/gate_oracle.py) and the per-engine-policy
gateways of tests/test_engine_refusals_everywhere.py (sglang, vllm, kvgate, openai, kvgate+vllm).

The findings this file holds fixed:

- a top-level ``null`` was forwarded as sent on chat and completions (the Responses route already
  drops them): SGLang's request models refuse ``null`` for every field that is no ``Optional``
  (``n``, ``stream``, ``echo``, chat ``logprobs``, ``ignore_eos``, ...), vLLM's for completions
  ``n``, ``ignore_eos`` and ``min_tokens``, so the tenant was charged and the engine answered 400.
  Now every top-level ``null`` but ``tool_choice`` (vLLM reads that one differently from an absent
  one: gateway/admission/gate.py ``KEPT_NULLS``) is left out, and the gate reserves a ``null``
  ``n`` / ``max_tokens`` as the default;
- false refusals, each taken by every engine that serves the model: ``stream_options: {}``
  without ``stream`` (now dropped; vLLM refuses only a non-empty one); completions
  ``response_format`` on vLLM and SGLang (refused as unknown; it constrains the output only, so
  the count is the prompt's alone, and chat's refusals of it apply); completions ``best_of`` below
  ``n`` on vLLM and SGLang (neither reads ``best_of``; OpenAI still refuses it); chat
  ``reasoning_effort: "max"`` on every engine (OpenAI's ``ReasoningEffort`` lists it too: the
  ``openai`` package's ``types/shared/reasoning_effort.py``, 3.60).

Kept, and held here: ``continue_final_message`` stays refused where SGLang serves the model
(SGLang 0.5.23 renders the messages before a final assistant one with the generation prompt, then
appends that message's text encoded alone, behind an answer opener when the server runs a
reasoning parser kvgate cannot see: ``python/sglang/srt/entrypoints/openai/serving_chat.py``
``:513-549``, ``:551-575``, ``:2154-2160``, ``:2196-2205``, ``:2229-2235``; the count could not be
exact).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests import test_engine_refusals_everywhere as everywhere
from tests import test_gate_invariant as invariant
from tests.gate_oracle import text_tokens
from tests.gateway_harness import MODEL
from tests.test_engine_refusals_sweep import NO_SCHEMA, _deep, _too_deep, _two_constraints
from tests.test_gate_invariant import chatml, post, refused, user
from tests.test_gateway_api_routes import error_of, forwarded
from tests.test_hostile_routes import REFUSED, Ledger, _invalid, _post
from tests.test_hostile_routes_round4 import _unsupported

pytestmark = [pytest.mark.timeout(120), pytest.mark.engine("api")]

#: the gateway of tests/gate_env.py (models m: SGLang, mv: vLLM, mo: OpenAI, mix: both), and the
#: per-policy gateways on the module's API mock engine
env, gws = invariant.env, everywhere.gws

SAY = "Say hello."
#: default_max_tokens of the tenant of tests/gate_env.py: the bound of a request that sets none
DEFAULT_BOUND = 16


def _sent(got: dict[str, Any]) -> dict[str, Any]:
    """The forwarded body without the tenant's ``cache_salt`` (checked to be a string)."""
    assert isinstance(got.pop("cache_salt"), str)
    return got


# ---------------------------------------------------------------- nulls: left out, gated as defaults
#: the sampling fields chat and completions share
SAMPLING = ("temperature", "top_p", "frequency_penalty", "presence_penalty", "stop", "seed")
CHAT_NULLS = {
    k: None
    for k in (
        "n",
        "max_tokens",
        "max_completion_tokens",
        "stream",
        "stream_options",
        "logprobs",
        "top_logprobs",
        *SAMPLING,
        "logit_bias",
        "tools",
        "response_format",
        "parallel_tool_calls",
        "reasoning_effort",
        "user",
        "top_k",
        "min_p",
        "min_tokens",
        "ignore_eos",
        "skip_special_tokens",
        "chat_template_kwargs",
        "add_generation_prompt",
        "continue_final_message",
    )
}
COMPLETION_NULLS = {
    k: None
    for k in (
        "n",
        "best_of",
        "max_tokens",
        "stream",
        "stream_options",
        "echo",
        "logprobs",
        "suffix",
        *SAMPLING,
        "user",
        "top_k",
        "min_tokens",
        "ignore_eos",
        "skip_special_tokens",
        "response_format",
    )
}


@pytest.mark.parametrize("model", ["m", "mv"])
def test_chat_nulls_are_left_out_and_gated_as_defaults(env, model):
    """Before: 200 here, the body forwarded with every ``null`` (SGLang answers 400 for ``n``,
    ``stream``, ``logprobs``, the penalties, ``parallel_tool_calls``, ``ignore_eos``, ...; vLLM for
    ``ignore_eos``, ``min_tokens``, ``add_generation_prompt``, ``continue_final_message``) after the
    reservation below was charged. A ``null`` ``add_generation_prompt`` is counted as its default
    (the generation prompt is in the 11 tokens)."""
    q = env[3]
    status, _, got = post(env, "chat", user(SAY, model=model, **CHAT_NULLS))
    assert status == 200
    assert _sent(got) == {"model": model, "messages": [{"role": "user", "content": SAY}], "max_tokens": DEFAULT_BOUND}
    assert q.reserved[-1] == chatml(got) + DEFAULT_BOUND == 11 + DEFAULT_BOUND


@pytest.mark.parametrize("model", ["m", "mv"])
def test_completion_nulls_are_left_out_and_gated_as_defaults(env, model):
    """Before: forwarded with every ``null``: SGLang refuses ``n``, ``echo``, ``stream``,
    ``temperature``, ``top_p``, the penalties, ``top_k``, ``min_tokens``, ...; vLLM ``n``,
    ``ignore_eos``, ``min_tokens``."""
    q = env[3]
    status, _, got = post(env, "completions", {"model": model, "prompt": SAY, **COMPLETION_NULLS})
    assert status == 200
    assert _sent(got) == {"model": model, "prompt": SAY, "max_tokens": DEFAULT_BOUND}
    assert q.reserved[-1] == text_tokens(SAY) + DEFAULT_BOUND == 3 + DEFAULT_BOUND


def test_a_null_alias_does_not_hide_the_other_bound_and_a_null_n_is_one(env):
    q = env[3]
    status, _, got = post(env, "chat", user(SAY, model="m", max_completion_tokens=None, max_tokens=7, n=None))
    assert status == 200
    assert _sent(got) == {"model": "m", "messages": [{"role": "user", "content": SAY}], "max_tokens": 7}
    assert q.reserved[-1] == 11 + 7
    status, _, got = post(env, "completions", {"model": "m", "prompt": SAY, "n": 2, "best_of": None})
    assert status == 200 and _sent(got) == {"model": "m", "prompt": SAY, "n": 2, "max_tokens": DEFAULT_BOUND}
    assert q.reserved[-1] == 2 * (3 + DEFAULT_BOUND)


def test_a_null_tool_choice_is_forwarded_as_sent(env):
    """vLLM reads ``tool_choice: null`` beside ``tools`` as "no tool call parsed" and takes it on a
    server without a tool parser; left out, it becomes ``auto``, which such a server refuses. The
    other ``null`` of the same body is left out (before: forwarded)."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    for model in ("mv", "m"):
        status, _, got = post(env, "chat", user(SAY, model=model, tools=tools, tool_choice=None, n=None))
        assert status == 200
        assert "tool_choice" in got and got["tool_choice"] is None and "n" not in got


# ---------------------------------------------------------------- stream_options: {} without stream
POLICIES = ("sglang", "vllm", "kvgate", "openai", "kvgate+vllm")
ROUTES = {
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}),
    "completions": ("/v1/completions", {"prompt": "hi", "max_tokens": 3}),
}
STREAM_OPTIONS = _invalid("'stream_options' is only allowed when 'stream' is true.", "stream_options")


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("extra", [{}, {"stream": False}], ids=["no-stream", "stream-false"])
@pytest.mark.parametrize(
    "options", [{}, {"include_usage": None, "continuous_usage_stats": None}], ids=["empty", "nulls"]
)
def test_empty_stream_options_without_stream_is_dropped_not_refused(gws, module_engine, policy, route, extra, options):
    """Before: 400 ``stream_options`` on every engine. vLLM refuses only a non-empty one
    (``data.get("stream_options") and not data.get("stream")``), SGLang none; the bundled backend
    refuses any, so it is left out of the forwarded body. Options set to ``null`` are left out as
    a top-level ``null`` is (they were refused: "'include_usage' must be a boolean")."""
    path, base = ROUTES[route]
    g = gws[policy]
    ledger = Ledger(g, module_engine)
    r = _post(g, path, {"model": MODEL, **base, **extra, "stream_options": options})
    assert r.status_code == 200, r.text
    got = forwarded(module_engine, path)[-1]
    assert "stream_options" not in got and got.get("stream") == extra.get("stream")
    change = ledger.delta()
    assert (change["engine"], change["rpm"], change["leases"]) == (1, 1, 0)


@pytest.mark.parametrize("route", ROUTES)
def test_a_null_stream_option_on_a_stream_reads_as_absent(gws, module_engine, route):
    """``include_usage: null`` asks for no usage chunk (its default): the gateway asks the engine
    for it (the settle needs it) and strips it; ``continuous_usage_stats: null`` is left out."""
    path, base = ROUTES[route]
    ledger = Ledger(gws["vllm"], module_engine)
    options = {"include_usage": None, "continuous_usage_stats": None}
    r = _post(gws["vllm"], path, {"model": MODEL, **base, "stream": True, "stream_options": options})
    assert r.status_code == 200, r.text
    assert forwarded(module_engine, path)[-1]["stream_options"] == {"include_usage": True}
    assert b'"usage"' not in r.content.split(b"data: [DONE]")[0].split(b"\n\n")[-2]
    assert ledger.delta()["engine"] == 1


@pytest.mark.parametrize("route", ROUTES)
def test_stream_options_that_ask_for_something_still_need_stream(gws, module_engine, route):
    path, base = ROUTES[route]
    for options in ({"include_usage": True}, {"include_usage": False}):
        ledger = Ledger(gws["sglang"], module_engine)
        r = _post(gws["sglang"], path, {"model": MODEL, **base, "stream_options": options})
        assert (r.status_code, error_of(r)) == (400, STREAM_OPTIONS)
        assert ledger.delta() == REFUSED


# ---------------------------------------------------------------- completions response_format
JSON_OBJECT = {"type": "json_object"}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
NOT_HERE = _invalid(
    "Unrecognized request argument supplied: response_format (the engines serving this model do not accept it).",
    "response_format",
)


@pytest.mark.parametrize("model", ["m", "mv"])
@pytest.mark.parametrize("fmt", [JSON_OBJECT, JSON_SCHEMA, {"type": "text"}], ids=["object", "schema", "text"])
def test_completions_response_format_passes_to_vllm_and_sglang_and_counts_the_prompt_alone(env, model, fmt):
    """Before: 400 "Unrecognized request argument supplied: response_format", though vLLM's and
    SGLang's ``CompletionRequest`` take it. It constrains the completion only: the reservation is
    the prompt's and the bound's."""
    q = env[3]
    status, _, got = post(env, "completions", {"model": model, "prompt": SAY, "response_format": fmt})
    assert status == 200
    assert _sent(got) == {"model": model, "prompt": SAY, "response_format": fmt, "max_tokens": DEFAULT_BOUND}
    assert q.reserved[-1] == 3 + DEFAULT_BOUND


def test_completions_response_format_is_refused_where_an_engine_does_not_take_it(env, gws, module_engine):
    """OpenAI's legacy completions and the bundled backend take no ``response_format``; a text one
    asks for nothing and is left out (before: refused as unknown)."""
    assert refused(env, "completions", {"model": "mo", "prompt": SAY, "response_format": JSON_OBJECT}) == (
        "response_format"
    )
    path, base = ROUTES["completions"]
    for policy in ("kvgate", "openai", "kvgate+vllm"):
        ledger = Ledger(gws[policy], module_engine)
        r = _post(gws[policy], path, {"model": MODEL, **base, "response_format": JSON_OBJECT})
        assert (r.status_code, error_of(r)) == (400, NOT_HERE)
        assert ledger.delta() == REFUSED
        r = _post(gws[policy], path, {"model": MODEL, **base, "response_format": {"type": "text"}})
        assert r.status_code == 200, r.text
        assert "response_format" not in forwarded(module_engine, path)[-1]


STRICT = _invalid("'response_format.json_schema.strict' must be a boolean.", "response_format.json_schema.strict")
WITH_JSON_SCHEMA = _invalid(
    "'response_format' and 'json_schema' cannot both be set: the engines serving this model apply one output "
    "constraint per request.",
    "json_schema",
)
COMPLETION_FORMAT_REFUSALS: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    ("vllm", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, NO_SCHEMA),
    ("sglang", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, NO_SCHEMA),
    (
        "sglang",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "strict": 1}}},
        STRICT,
    ),
    ("sglang", {"response_format": JSON_OBJECT, "regex": "a+"}, _two_constraints("response_format", "regex")),
    ("sglang", {"response_format": JSON_SCHEMA, "json_schema": '{"type": "object"}'}, WITH_JSON_SCHEMA),
    (
        "vllm",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": _deep(64)}}},
        _too_deep("response_format.json_schema.schema"),
    ),
]


@pytest.mark.parametrize(
    ("policy", "body", "error"),
    COMPLETION_FORMAT_REFUSALS,
    ids=[f"{p}-{e['param']}" for p, _, e in COMPLETION_FORMAT_REFUSALS],
)
def test_completions_response_format_gets_the_refusals_chat_gives_it(gws, module_engine, policy, body, error):
    """The engines read a completions ``response_format`` as a chat one, and refuse the same
    values after admission; the gateway refuses them first, in chat's words."""
    path, base = ROUTES["completions"]
    ledger = Ledger(gws[policy], module_engine)
    r = _post(gws[policy], path, {"model": MODEL, **base, **body})
    assert (r.status_code, error_of(r)) == (400, error)
    assert ledger.delta() == REFUSED


# ---------------------------------------------------------------- completions best_of below n
def test_best_of_below_n_is_served_by_vllm_and_sglang_and_reserves_n(env):
    """Before: 400 "Invalid value for 'best_of': must be >= 'n'" on every engine; vLLM 0.34.0 has no
    ``best_of`` and SGLang reads it nowhere: both generate ``n``."""
    q = env[3]
    for model in ("m", "mv"):
        status, _, got = post(env, "completions", {"model": model, "prompt": SAY, "n": 3, "best_of": 2})
        assert status == 200
        assert _sent(got) == {"model": model, "prompt": SAY, "n": 3, "best_of": 2, "max_tokens": DEFAULT_BOUND}
        assert q.reserved[-1] == 3 * (3 + DEFAULT_BOUND)


def test_best_of_below_n_is_still_refused_for_openai_and_the_bundled_backend(env, gws, module_engine):
    assert refused(env, "completions", {"model": "mo", "prompt": SAY, "n": 3, "best_of": 2}) == "best_of"
    path, base = ROUTES["completions"]
    below = {"model": MODEL, **base, "n": 2, "best_of": 1}
    for policy, error in (
        ("openai", _invalid("Invalid value for 'best_of': must be >= 'n'", "best_of")),
        ("kvgate", _unsupported("n")),
    ):
        ledger = Ledger(gws[policy], module_engine)
        r = _post(gws[policy], path, below)
        assert (r.status_code, error_of(r)) == (400, error)
        assert ledger.delta() == REFUSED


def test_best_of_above_openais_bound_is_refused_before_the_engine(gws, module_engine):
    """OpenAI's API reference bounds ``best_of`` at 20: 21 on an ``openai`` upstream is kvgate's
    400, not OpenAI's after admission; nothing reaches the engine, nothing is charged."""
    path, base = ROUTES["completions"]
    ledger = Ledger(gws["openai"], module_engine)
    r = _post(gws["openai"], path, {"model": MODEL, **base, "best_of": 21})
    assert (r.status_code, error_of(r)) == (
        400,
        _invalid("Invalid value for 'best_of': must be <= 20 (the engines serving this model refuse more)", "best_of"),
    )
    assert ledger.delta() == REFUSED


# ---------------------------------------------------------------- reasoning_effort "max"
@pytest.mark.parametrize("policy", ["sglang", "vllm", "kvgate", "openai"])
def test_reasoning_effort_max_is_served_where_every_engine_takes_it(gws, module_engine, policy):
    """Before: 400 "Invalid value for 'reasoning_effort': must be one of none, ..., xhigh"; vLLM's
    ``ReasoningEffort`` and SGLang's ``ReasoningEffortTier`` take ``max``, the bundled backend
    ignores the field; OpenAI's ``ReasoningEffort`` lists it (a 400 here before, for ``openai``)."""
    path, base = ROUTES["chat"]
    ledger = Ledger(gws[policy], module_engine)
    r = _post(gws[policy], path, {"model": MODEL, **base, "reasoning_effort": "max"})
    assert r.status_code == 200, r.text
    assert forwarded(module_engine, path)[-1]["reasoning_effort"] == "max"
    change = ledger.delta()
    assert (change["engine"], change["rpm"], change["leases"]) == (1, 1, 0)


def test_reasoning_effort_max_is_counted_as_the_engines_render_it(env):
    """SGLang (``m``) and vLLM (``mv``) pass ``max`` to the template as they pass ``high``: the
    count is the one ``high`` gets (ChatML ignores both), as it is for OpenAI (``mo``); SGLang and
    vLLM together (``mix``) apply it differently, as every other effort."""
    q = env[3]
    for model in ("m", "mv", "mo"):
        reserved = []
        for effort in ("high", "max"):
            status, _, got = post(env, "chat", user(SAY, model=model, reasoning_effort=effort))
            assert status == 200 and got["reasoning_effort"] == effort
            reserved.append(q.reserved[-1])
        assert reserved == [11 + DEFAULT_BOUND] * 2
    assert refused(env, "chat", user(SAY, model="mix", reasoning_effort="max")) == "reasoning_effort"


# ---------------------------------------------------------------- kept: continue_final_message on SGLang
def test_continue_final_message_stays_refused_where_sglang_serves_the_model(gws, module_engine):
    """SGLang's rendering of it depends on the server's reasoning parser (see the module
    docstring): refused before the charge, as before; ``false`` (its default) is left out."""
    path, _ = ROUTES["chat"]
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]
    ledger = Ledger(gws["sglang"], module_engine)
    r = _post(gws["sglang"], path, {"model": MODEL, "messages": msgs, "continue_final_message": True})
    assert (r.status_code, error_of(r)) == (
        400,
        _invalid(
            "Unrecognized request argument supplied: continue_final_message (the engines serving this model do not "
            "accept it).",
            "continue_final_message",
        ),
    )
    assert ledger.delta() == REFUSED
