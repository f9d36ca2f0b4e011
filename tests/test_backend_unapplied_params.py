"""The bundled engine refuses a sampling field it would not apply, unless the field holds its
neutral value: a client asking for top_k=5 must not get an unfiltered sample with HTTP 200."""

from __future__ import annotations

from typing import Any

import pytest

from gpu_backend.openai_api import OpenAIError, parse_chat, parse_completion, parse_generate
from gpu_backend.responses_api import parse_responses


class Ids:
    """The smallest prompt encoder the parsers need: token-id prompts only, 8 per chat."""

    vocab_size = 1000

    def check_ids(self, ids: list[int], param: str) -> None:
        return None

    def encode_chat(self, messages: Any, tools: Any = None) -> list[int]:
        return [1] * 8

    def encode_prompt_text(self, text: str) -> list[int]:
        return [1] * max(1, len(text.split()))


KW = {"context_length": 4096, "model_names": ["m"], "served_model_name": "m"}


def completion(**extra: Any):
    return parse_completion({"model": "m", "prompt": [1, 2, 3], "max_tokens": 4, **extra}, Ids(), **KW)


def chat(**extra: Any):
    return parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}, Ids(), **KW)


def responses(**extra: Any):
    return parse_responses({"model": "m", "input": "hi", **extra}, Ids(), **KW)


def generate(**sp: Any):
    return parse_generate(
        {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4, **sp}},
        Ids(),
        context_length=4096,
        served_model_name="m",
    )


REFUSED = [
    ("top_k", 5),
    ("top_k", True),
    ("min_p", 0.1),
    ("repetition_penalty", 1.1),
    ("min_tokens", 2),
    ("frequency_penalty", 0.5),
    ("logit_bias", {"5": 1}),
    ("echo", True),
    ("guided_json", {"type": "object"}),
    ("guided_regex", "[a-z]+"),
    ("structured_outputs", {"json": {"type": "object"}}),
    ("bad_words", ["x"]),
    ("allowed_token_ids", [1, 2]),
    ("truncate_prompt_tokens", 5),
    ("use_beam_search", True),
    ("prompt_logprobs", 1),
    ("tool_choice", "required"),
    ("tool_choice", {"type": "function", "function": {"name": "f"}}),
]


@pytest.mark.parametrize("parse", [completion, chat, responses])
@pytest.mark.parametrize(("field", "value"), REFUSED)
def test_a_sampler_the_engine_does_not_apply_is_refused(parse, field, value):
    with pytest.raises(OpenAIError) as e:
        parse(**{field: value})
    assert (e.value.status, e.value.param) == (400, field)
    assert e.value.message == f"'{field}' is not supported by this backend."


@pytest.mark.parametrize("parse", [completion, chat, responses])
@pytest.mark.parametrize(
    ("field", "value"),
    [("top_k", -1), ("top_k", 0), ("top_k", None), ("min_p", 0.0), ("repetition_penalty", 1.0), ("min_tokens", 0)]
    + [("logprobs", False), ("echo", False), ("frequency_penalty", 0.0)]
    + [("tool_choice", "auto"), ("tool_choice", "none"), ("use_beam_search", False), ("bad_words", [])],
)
def test_neutral_values_pass(parse, field, value):
    assert parse(**{field: value}).params["max_new_tokens"] > 0


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("top_k", 20),
        ("min_p", 0.05),
        ("repetition_penalty", 1.2),
        ("min_new_tokens", 3),
        ("frequency_penalty", 1.0),
        ("presence_penalty", -0.5),
        ("json_schema", '{"type": "object"}'),
        ("regex", "[a-z]+"),
        ("ebnf", 'root ::= "a"'),
        ("logit_bias", {"1": -100}),
        ("stop_regex", "\\d+"),
        ("sampling_seed", 7),
    ],
)
def test_generate_refuses_sampling_params_it_would_not_apply(field, value):
    with pytest.raises(OpenAIError) as e:
        generate(**{field: value})
    assert (e.value.status, e.value.param, e.value.message) == (
        400,
        field,
        f"'{field}' is not supported by this backend.",
    )


def test_generate_refuses_n_above_1():
    with pytest.raises(OpenAIError) as e:
        generate(n=2)
    assert (e.value.status, e.value.param, e.value.message) == (400, "n", "Only 'n' = 1 is supported by this backend.")


def test_generate_takes_neutral_and_applied_params():
    req = generate(top_k=-1, min_p=0, repetition_penalty=1.0, n=1, temperature=0, top_p=0.9, seed=3)
    assert (req.params["max_new_tokens"], req.params["temperature"], req.params["top_p"]) == (4, 0.0, 0.9)


def test_generate_refuses_logprobs_it_would_not_return():
    with pytest.raises(OpenAIError) as e:
        parse_generate({"input_ids": [1, 2], "return_logprob": True}, Ids(), context_length=4096, served_model_name="m")
    assert (e.value.status, e.value.param, e.value.message) == (
        400,
        "return_logprob",
        "'return_logprob' is not supported by this backend.",
    )


@pytest.mark.parametrize(
    "fmt", [{"type": "json_object"}, {"type": "json_schema", "name": "x", "schema": {"type": "object"}}]
)
def test_responses_refuses_structured_text_format(fmt):
    with pytest.raises(OpenAIError) as e:
        responses(text={"format": fmt})
    assert (e.value.status, e.value.param, e.value.message) == (
        400,
        "text.format",
        """'text.format' is not supported by this backend; only {"type": "text"}.""",
    )


def test_responses_takes_a_plain_text_format():
    assert responses(text={"format": {"type": "text"}}).kind == "responses"
    assert responses(text={}).kind == "responses"
