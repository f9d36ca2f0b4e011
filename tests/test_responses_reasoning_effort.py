"""``/v1/responses`` ``reasoning.effort`` is a template variable on vLLM and SGLang, and is
counted as one (tests/render_env.py: the ``t*`` models' template prints ``effort: <value>`` in
the generation prompt when ``reasoning_effort`` is set, as reasoning models' templates do).

- vLLM ``responses/protocol.py@010a69ce`` ``ResponsesRequest.build_chat_params``:
  ``reasoning_effort=reasoning.effort``, left out when ``None``.
- SGLang ``serving_responses.py`` ``_make_request``: ``ChatCompletionRequest(...,
  reasoning_effort=request.reasoning.effort)``, templated as a chat; ``ResponseReasoningParam``
  (``protocol.py@004c82e0``) defaults ``effort`` to ``"medium"``.
- ``max``: OpenAI's ``ReasoningEffort`` (the ``openai`` package's
  ``types/shared/reasoning_effort.py``, which vLLM's ``Reasoning`` type is) and SGLang's tiers.

The expected counts come from ``transformers``' ``apply_chat_template`` with the variables the
engine passes (tests/gate_oracle.py), never from kvgate's counter.
"""

from __future__ import annotations

import pytest

from tests.gate_oracle import hf_chat_tokens
from tests.mock_api_engine import ApiMockEngine
from tests.render_env import render_env

#: ``"hi"`` as one user turn with the generation prompt, no effort: the template's own text
PLAIN = 9


@pytest.fixture(scope="module")
def env():
    with render_env(ApiMockEngine) as e:
        yield e


def oracle(folder, engine: str, effort: str | None) -> int:
    """The oracle's count of the chat ``engine`` templates for ``input: "hi"`` with ``effort``."""
    body: dict = {"messages": [{"role": "user", "content": "hi"}]}
    if effort is not None:
        body["reasoning_effort"] = effort
    return hf_chat_tokens(folder, body, engine=engine)


def post(env, model: str, **extra):
    client, sg, vl, quotas, folder = env
    before = (len(sg.state.requests), len(vl.state.requests), len(quotas.reserved))
    r = client.post("/v1/responses", json={"model": model, "input": "hi", "max_output_tokens": 16, **extra})
    after = (len(sg.state.requests), len(vl.state.requests), len(quotas.reserved))
    return r, [a - b for a, b in zip(after, before, strict=True)]


def test_the_template_prints_the_effort(env):
    """The oracle's counts themselves: the line ``effort: high\\n`` is 13 tokens of this small
    tokenizer (about one a character), and ``none`` is printed too (a non-empty string)."""
    folder = env[4]
    assert oracle(folder, "vllm", None) == PLAIN
    extra = {e: oracle(folder, "vllm", e) - PLAIN for e in ("high", "max", "none", "minimal", "medium")}
    assert extra == {"high": 13, "max": 12, "none": 13, "minimal": 15, "medium": 14}
    assert oracle(folder, "sglang", "high") == oracle(folder, "vllm", "high")


@pytest.mark.parametrize("effort", ["none", "minimal", "low", "medium", "high", "xhigh", "max"])
def test_vllm_counts_the_effort_it_passes_to_the_template(env, effort):
    """Each effort is admitted (``max`` too), forwarded as sent, and reserved at the rendered count."""
    _, sg, vl, quotas, folder = env
    r, delta = post(env, "tv", reasoning={"effort": effort})
    assert r.status_code == 200, r.text
    assert delta == [0, 1, 1]
    assert vl.state.requests[-1]["body"]["reasoning"] == {"effort": effort}
    assert quotas.reserved[-1] == oracle(folder, "vllm", effort) + 16
    assert quotas.reserved[-1] > PLAIN + 16


@pytest.mark.parametrize("reasoning", [None, {"effort": None}, {"summary": "auto"}, {}])
def test_vllm_passes_no_effort_without_one(env, reasoning):
    """OpenAI's ``Reasoning`` has no default effort: nothing reaches vLLM's template."""
    extra = {} if reasoning is None else {"reasoning": reasoning}
    r, delta = post(env, "tv", **extra)
    assert r.status_code == 200, r.text
    assert delta == [0, 1, 1]
    assert env[3].reserved[-1] == PLAIN + 16


@pytest.mark.parametrize(
    ("reasoning", "effort"),
    [
        ({"effort": "high"}, "high"),
        ({"effort": "none"}, "none"),
        ({"summary": "auto"}, "medium"),  # ResponseReasoningParam's default
        ({}, "medium"),
        ({"effort": None}, None),  # an explicit null stays None
    ],
)
def test_sglang_counts_the_effort_its_chat_path_templates(env, reasoning, effort):
    r, delta = post(env, "ts", reasoning=reasoning)
    assert r.status_code == 200, r.text
    assert delta == [1, 0, 1]
    assert env[1].state.requests[-1]["body"]["reasoning"] == reasoning
    assert env[3].reserved[-1] == oracle(env[4], "sglang", effort) + 16


def test_no_reasoning_is_the_plain_prompt_on_sglang(env):
    r, delta = post(env, "ts")
    assert r.status_code == 200, r.text
    assert env[3].reserved[-1] == PLAIN + 16


@pytest.mark.parametrize("model", ["tk", "to"])
def test_the_bundled_backend_and_openai_pass_no_effort(env, model):
    """The bundled backend's Responses path and an OpenAI upstream template nothing from it."""
    r, delta = post(env, model, reasoning={"effort": "high"})
    assert r.status_code == 200, r.text
    assert env[3].reserved[-1] == PLAIN + 16


@pytest.mark.parametrize("reasoning", [{"effort": "high"}, {"effort": "none"}, {"summary": "auto"}])
def test_an_effort_the_engines_render_differently_is_refused(env, reasoning):
    """``tmix`` is served by SGLang and vLLM: SGLang adds ``thinking``/``enable_thinking`` (and
    reads a missing effort as ``medium``), so no one count holds for both. Refused before
    anything is forwarded or reserved."""
    r, delta = post(env, "tmix", reasoning=reasoning)
    assert r.status_code == 400, r.text
    assert r.json() == {
        "error": {
            "message": "'reasoning.effort' changes the prompt differently on the engines serving this model; "
            "leave it out.",
            "type": "invalid_request_error",
            "param": "reasoning.effort",
            "code": "invalid_request",
        }
    }
    assert delta == [0, 0, 0]


@pytest.mark.parametrize("reasoning", [None, {"effort": None}])
def test_no_effort_is_admitted_where_both_engines_serve(env, reasoning):
    extra = {} if reasoning is None else {"reasoning": reasoning}
    r, delta = post(env, "tmix", **extra)
    assert r.status_code == 200, r.text
    assert env[3].reserved[-1] == PLAIN + 16
