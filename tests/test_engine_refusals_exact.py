"""gateway/admission/engine_refusals.py called directly, at the engines' own edges: each refusal's
exact 400 body (message, type, param, code) one step past the edge, and no refusal on the edge.

The edges are the engines': vLLM ``SamplingParams`` (``top_p`` in (0, 1]; ``n`` 1 when greedy,
where a temperature in (0, 0.01) is raised to 0.01 first, so only 0 is greedy), vLLM's default
``VLLM_MAX_STOP_STRINGS`` 4 (a list of 5 stop strings is its pydantic 400), vLLM chat
``check_logprobs`` (``top_logprobs`` > 0 needs ``logprobs``), SGLang ``SamplingParams``
(a temperature in [0, 1e-6) sets ``top_k`` 1 before ``verify`` refuses ``top_k`` 0), OpenAI's
completions ``best_of`` (>= ``n``, at most 20) and the bundled backend's ``_UNSUPPORTED`` table."""

from __future__ import annotations

from typing import Any

import pytest

from config.errors import OpenAIError
from gateway.admission.engine_refusals import check_engine_refusals

SAY_HI = [{"role": "user", "content": "hi"}]


def _error(body: dict[str, Any], engines: str, route: str) -> dict[str, Any] | None:
    """The error body ``check_engine_refusals`` raises for ``body`` on ``engines`` (``+``-joined)
    and ``route``, else ``None``."""
    try:
        check_engine_refusals(body, frozenset(engines.split("+")), route)
    except OpenAIError as e:
        assert e.status == 400
        return e.body()["error"]
    return None


def _invalid(message: str, param: str) -> dict[str, Any]:
    return {"message": message, "type": "invalid_request_error", "param": param, "code": "invalid_request"}


def _body(route: str, **kw: Any) -> dict[str, Any]:
    if route == "chat":
        return {"model": "m", "messages": SAY_HI, **kw}
    if route == "completions":
        return {"model": "m", "prompt": "hi", **kw}
    return {"model": "m", "input": "hi", **kw}


TOP_P = _invalid("Invalid value for 'top_p': must be > 0 and <= 1 (the engines serving this model refuse 0)", "top_p")
TOP_K = _invalid(
    "Invalid value for 'top_k': must be -1 (off) or at least 1 for the engines serving this model (SGLang)", "top_k"
)
GREEDY_N = _invalid(
    "Invalid value for 'n': must be 1 when 'temperature' is 0 (greedy sampling) for the engines serving this model",
    "n",
)
STOP = _invalid(
    "Invalid value for 'stop': must be a string or an array of at most 4 strings for the engines serving this "
    "model (vLLM)",
    "stop",
)
TOP_LOGPROBS = _invalid(
    "Invalid value for 'top_logprobs': must be 0 unless 'logprobs' is true, for the engines serving this model",
    "top_logprobs",
)
BEST_OF = _invalid("Invalid value for 'best_of': must be >= 'n'", "best_of")
BEST_OF_21 = _invalid(
    "Invalid value for 'best_of': must be <= 20 (the engines serving this model refuse more)", "best_of"
)


def _unsupported(key: str) -> dict[str, Any]:
    return _invalid(f"'{key}' is not supported by the engines serving this model.", key)


FIVE_STOPS = ["a", "b", "c", "d", "e"]
CONST = {"type": "const_string", "value": "x"}


def _token_string(param: str) -> dict[str, Any]:
    return _invalid(
        f"'{param}' is a token string: the engines serving this model (vLLM) take token ids (integers) only.", param
    )


def _structural_tag(fmt: dict[str, Any]) -> dict[str, Any]:
    return {"type": "structural_tag", "format": fmt}


#: xgrammar's TokenTriggeredTagsFormat and TokenDispatchFormat take token ids or strings; vLLM
#: resolves no string without a tokenizer
TRIGGER_STRING = _structural_tag(
    {
        "type": "token_triggered_tags",
        "trigger_tokens": ["<a>"],
        "tags": [{"begin": {"type": "token", "token": 5}, "content": CONST, "end": "</a>"}],
    }
)
TRIGGER_IDS = _structural_tag(
    {
        "type": "token_triggered_tags",
        "trigger_tokens": [5],
        "tags": [{"begin": {"type": "token", "token": 5}, "content": CONST, "end": "</a>"}],
        "exclude_tokens": [6],
    }
)
DISPATCH_RULE_STRING = _structural_tag({"type": "token_dispatch", "rules": [[5, CONST], ["<b>", CONST]]})
DISPATCH_EXCLUDE_STRING = _structural_tag({"type": "token_dispatch", "rules": [[5, CONST]], "exclude_tokens": [5, "x"]})

REFUSED: list[tuple[str, str, dict[str, Any], dict[str, Any]]] = [
    # top_p 0: vLLM and SGLang ("top_p must be in (0, 1]"), on every route
    ("chat", "vllm", {"top_p": 0}, TOP_P),
    ("completions", "sglang", {"top_p": 0}, TOP_P),
    ("responses", "vllm+sglang", {"top_p": 0.0}, TOP_P),
    # SGLang top_k 0: refused unless the temperature is below its _SAMPLING_EPS 1e-6
    ("chat", "sglang", {"top_k": 0}, TOP_K),
    ("chat", "sglang", {"top_k": 0, "temperature": 1e-6}, TOP_K),
    ("completions", "sglang+vllm", {"top_k": 0, "temperature": 0.5}, TOP_K),
    # vLLM: n > 1 with temperature 0 (greedy)
    ("chat", "vllm", {"temperature": 0, "n": 2}, GREEDY_N),
    ("completions", "vllm+kvgate", {"temperature": 0.0, "n": 2}, GREEDY_N),
    # vLLM: at most 4 stop strings
    ("chat", "vllm", {"stop": FIVE_STOPS}, STOP),
    ("completions", "vllm", {"stop": FIVE_STOPS}, STOP),
    ("responses", "vllm+sglang", {"stop": FIVE_STOPS}, STOP),
    # vLLM chat: top_logprobs > 0 without logprobs true
    ("chat", "vllm", {"top_logprobs": 1}, TOP_LOGPROBS),
    ("chat", "vllm", {"top_logprobs": 1, "logprobs": False}, TOP_LOGPROBS),
    # vLLM: a token given as a string in a structural tag
    ("chat", "vllm", {"response_format": TRIGGER_STRING}, _token_string("response_format.format.trigger_tokens[0]")),
    (
        "chat",
        "vllm+sglang",
        {"response_format": DISPATCH_EXCLUDE_STRING},
        _token_string("response_format.format.exclude_tokens[1]"),
    ),
    ("chat", "vllm", {"response_format": DISPATCH_RULE_STRING}, _token_string("response_format.format.rules[1][0]")),
    # OpenAI completions best_of: >= n and <= 20
    ("completions", "openai", {"n": 3, "best_of": 2}, BEST_OF),
    ("completions", "openai+vllm", {"n": 2, "best_of": 1}, BEST_OF),
    ("completions", "openai", {"best_of": 21}, BEST_OF_21),
    # the bundled backend: its _UNSUPPORTED table, field by field
    ("completions", "kvgate", {"n": 2}, _unsupported("n")),
    ("completions", "kvgate", {"best_of": 2}, _unsupported("best_of")),
    ("completions", "kvgate", {"echo": True}, _unsupported("echo")),
    ("completions", "kvgate", {"logprobs": 1}, _unsupported("logprobs")),
    ("completions", "kvgate", {"logit_bias": {"1": 1}}, _unsupported("logit_bias")),
    ("completions", "kvgate", {"frequency_penalty": 0.5}, _unsupported("frequency_penalty")),
    ("completions", "kvgate", {"presence_penalty": -0.5}, _unsupported("presence_penalty")),
    ("chat", "kvgate", {"n": 2}, _unsupported("n")),
    ("chat", "kvgate", {"logprobs": True}, _unsupported("logprobs")),
    ("chat", "kvgate", {"top_logprobs": 1, "logprobs": True}, _unsupported("logprobs")),
    ("chat", "kvgate", {"top_logprobs": 2}, _unsupported("top_logprobs")),
    ("chat", "kvgate", {"logit_bias": {"1": -1}}, _unsupported("logit_bias")),
    ("chat", "kvgate", {"frequency_penalty": 1}, _unsupported("frequency_penalty")),
    ("chat", "kvgate", {"presence_penalty": 2}, _unsupported("presence_penalty")),
    ("responses", "kvgate", {"top_logprobs": 1}, _unsupported("top_logprobs")),
]

ACCEPTED: list[tuple[str, str, dict[str, Any]]] = [
    # top_p just above 0, and 1
    ("chat", "vllm+sglang", {"top_p": 1e-9}),
    ("completions", "vllm+sglang", {"top_p": 1}),
    # SGLang greedy: a temperature below 1e-6 sets top_k 1 first; vLLM reads top_k 0 as off
    ("chat", "sglang", {"top_k": 0, "temperature": 0}),
    ("chat", "sglang", {"top_k": 0, "temperature": 9.99e-7}),
    ("chat", "vllm", {"top_k": 0}),
    ("chat", "sglang", {"top_k": 1}),
    # vLLM: a temperature in (0, 0.01) is raised to 0.01, not greedy; n 1 is greedy's only n
    ("chat", "vllm", {"temperature": 1e-9, "n": 2}),
    ("chat", "vllm", {"temperature": 0, "n": 1}),
    ("chat", "vllm", {"temperature": 0}),
    ("chat", "sglang", {"temperature": 0, "n": 2}),
    # vLLM: 4 stop strings; SGLang takes more
    ("chat", "vllm", {"stop": FIVE_STOPS[:4]}),
    ("completions", "vllm", {"stop": "abcde"}),
    ("chat", "sglang", {"stop": FIVE_STOPS}),
    # vLLM chat top_logprobs
    ("chat", "vllm", {"top_logprobs": 0}),
    ("chat", "vllm", {"top_logprobs": 5, "logprobs": True}),
    ("chat", "sglang", {"top_logprobs": 5}),
    # SGLang resolves token strings with the model's tokenizer
    ("chat", "sglang", {"response_format": TRIGGER_STRING}),
    ("chat", "sglang", {"response_format": DISPATCH_EXCLUDE_STRING}),
    ("chat", "sglang", {"response_format": DISPATCH_RULE_STRING}),
    ("chat", "vllm+sglang", {"response_format": TRIGGER_IDS}),
    # OpenAI best_of: equal to n, and 20
    ("completions", "openai", {"n": 3, "best_of": 3}),
    ("completions", "openai", {"best_of": 20}),
    ("completions", "vllm", {"n": 3, "best_of": 2}),
    # the bundled backend's neutral values
    (
        "completions",
        "kvgate",
        {
            "n": 1,
            "best_of": 1,
            "echo": False,
            "logprobs": 0,
            "logit_bias": {},
            "frequency_penalty": 0,
            "presence_penalty": 0.0,
        },
    ),
    (
        "chat",
        "kvgate",
        {"n": 1, "logprobs": False, "top_logprobs": 0, "logit_bias": {}, "frequency_penalty": 0, "presence_penalty": 0},
    ),
    ("responses", "kvgate", {"top_logprobs": 0}),
    # an openai-only model: nothing but the completions best_of checks
    ("chat", "openai", {"top_p": 0, "stop": FIVE_STOPS, "top_k": 0, "temperature": 0, "n": 2}),
]


@pytest.mark.parametrize(("route", "engines", "fields", "expected"), REFUSED)
def test_refused_with_the_exact_error(route: str, engines: str, fields: dict, expected: dict) -> None:
    assert _error(_body(route, **fields), engines, route) == expected


@pytest.mark.parametrize(("route", "engines", "fields"), ACCEPTED)
def test_accepted_on_the_edge(route: str, engines: str, fields: dict) -> None:
    assert _error(_body(route, **fields), engines, route) is None
