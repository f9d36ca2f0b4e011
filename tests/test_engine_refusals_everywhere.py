"""What an engine refuses only after the charge, on every route (tests/test_hostile_routes_round4.py
holds ``/v1/completions``): chat, the Responses API and embeddings, through the whole gateway (the
app and API mock engine of tests/test_hostile_routes.py, quotas in process), once per engine policy
(the upstream's ``engine``). Each refused body is an exact OpenAI-shaped 400 naming its field that
reaches no engine and changes no quota counter but the request's own RPM entry; its neighbours
that the engine takes are still forwarded as sent.

The findings this file holds fixed (each body was admitted, charged and forwarded, and the engine
then answered 400, settled at the prompt as admitted by gateway/relay/finish.py):

- chat and Responses ``top_p: 0`` (vLLM ``SamplingParams._verify_args``, SGLang
  ``SamplingParams.verify``, the bundled backend's ``_sampling``), ``top_k: 0`` on SGLang unless
  greedy, chat ``n > 1`` with ``temperature: 0`` on vLLM (``_verify_greedy_sampling``), chat
  ``top_logprobs`` without ``logprobs: true`` on vLLM (``ChatCompletionRequest.check_logprobs``);
- on the bundled backend, chat ``n``, ``logprobs``, ``top_logprobs``, ``logit_bias``,
  ``frequency_penalty``, ``presence_penalty`` and Responses ``top_logprobs`` at anything but their
  neutral values (``gpu_backend/openai_api.py`` ``_UNSUPPORTED``, ``_check_unsupported``); and,
  for a model served by the bundled backend beside another engine, chat ``response_format`` /
  ``tool_choice`` that ask for what it does not apply (refused before only where every upstream
  was the bundled backend);
- embeddings ``dimensions`` for a model that is not Matryoshka (vLLM
  ``PoolingParams._set_default_parameters``: "does not support matryoshka representation") or
  outside the model's listed dimensions;
- config: an embedding model served by an upstream whose engine is the bundled backend, which has
  no ``/v1/embeddings`` (every such request was admitted, charged and answered 404).
"""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from config.errors import ErrorCode, OpenAIError
from config.loader import ConfigError, validate_yaml_text
from config.models import Settings
from gateway.admission.engine_refusals import BUNDLED_NEUTRAL
from gateway.quotas.tenant_quotas import build_quota_stage
from tests.gateway_harness import MODEL, Gateway, settings_for, tenants, upstream
from tests.test_gateway_api_routes import EMB, LIMIT, error_of, forwarded
from tests.test_hostile_routes import REFUSED, Ledger, _invalid, _post
from tests.test_hostile_routes_round4 import GREEDY_N, TOP_K, TOP_P, _unsupported

pytestmark = [pytest.mark.timeout(120), pytest.mark.engine("api")]

ENGINES = ("sglang", "vllm", "kvgate", "openai")
#: embedding models beside :data:`EMB` (not Matryoshka): any ``dimensions``, and a listed few
EMB_ANY, EMB_LISTED = "emb-any", "emb-listed"
EMB_MODELS = [
    {"id": EMB, "context_length": 8192, "task": "embedding"},
    {"id": EMB_ANY, "context_length": 8192, "task": "embedding", "matryoshka": True},
    {"id": EMB_LISTED, "context_length": 8192, "task": "embedding", "matryoshka": [256, 512]},
]


def _start(engine: Any, engines: tuple[str, ...]) -> Gateway:
    """One upstream per engine policy in ``engines``, all on the one mock ``engine``, serving
    :data:`MODEL` and (unless the policy is the bundled backend, which has no embeddings) the
    embedding models."""
    ups = [
        {
            **upstream(f"u-{policy}", engine),
            "engine": policy,
            "models": [MODEL] if policy == "kvgate" else [MODEL, *(m["id"] for m in EMB_MODELS)],
        }
        for policy in engines
    ]
    s = settings_for(ups, gateway={"max_body_bytes": 1 << 16}, models=EMB_MODELS, quotas={"enabled": True})
    s.quotas.window_seconds = 3600
    limits = {"rpm": 10**6, "tpm": 10**9, "max_concurrent": 64, "max_embedding_inputs": 8}
    reg = tenants(max_context_tokens=LIMIT, allowed_models=[MODEL, *(m["id"] for m in EMB_MODELS)], **limits)
    return Gateway(s, reg, quotas=build_quota_stage(s)).start()


@pytest.fixture(scope="module")
def gws(module_engine):
    started = {policy: _start(module_engine, (policy,)) for policy in ENGINES}
    started["kvgate+vllm"] = _start(module_engine, ("kvgate", "vllm"))
    yield started
    for g in started.values():
        g.stop()


TOP_LOGPROBS = _invalid(
    "Invalid value for 'top_logprobs': must be 0 unless 'logprobs' is true, for the engines serving this model",
    "top_logprobs",
)
STRUCTURED = _invalid(
    "'response_format' asks for structured output, but the engines serving this model apply none "
    '(they answer with free text); send {"type": "text"} or leave it out.',
    "response_format",
)
TOOL_CALL = _invalid(
    "'tool_choice' asks for a tool call, but the engines serving this model parse no tool calls "
    "(they answer with text); send 'auto' or 'none', or leave it out.",
    "tool_choice",
)

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
RESPONSES = {"input": "hi", "max_output_tokens": 3}

ROUTES: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": ("/v1/chat/completions", CHAT),
    "responses": ("/v1/responses", RESPONSES),
}

REFUSED_BODIES: list[tuple[str, str, dict[str, Any], dict[str, Any]]] = [
    ("chat", "sglang", {"top_p": 0}, TOP_P),
    ("chat", "sglang", {"top_p": 0.0, "temperature": 0}, TOP_P),
    ("chat", "sglang", {"top_k": 0}, TOP_K),
    ("chat", "sglang", {"top_k": 0, "temperature": 0.5}, TOP_K),
    ("chat", "vllm", {"top_p": 0}, TOP_P),
    ("chat", "vllm", {"temperature": 0, "n": 2}, GREEDY_N),
    ("chat", "vllm", {"top_logprobs": 2}, TOP_LOGPROBS),
    ("chat", "vllm", {"top_logprobs": 1, "logprobs": False}, TOP_LOGPROBS),
    ("chat", "kvgate", {"top_p": 0}, TOP_P),
    ("chat", "kvgate", {"n": 2}, _unsupported("n")),
    ("chat", "kvgate", {"logprobs": True}, _unsupported("logprobs")),
    ("chat", "kvgate", {"top_logprobs": 1}, _unsupported("top_logprobs")),
    ("chat", "kvgate", {"logit_bias": {"5": 1}}, _unsupported("logit_bias")),
    ("chat", "kvgate", {"frequency_penalty": -0.5}, _unsupported("frequency_penalty")),
    ("chat", "kvgate", {"presence_penalty": 2}, _unsupported("presence_penalty")),
    # a model served by the bundled backend and vLLM: either may get the request
    ("chat", "kvgate+vllm", {"temperature": 0, "n": 2}, GREEDY_N),
    ("chat", "kvgate+vllm", {"n": 2}, _unsupported("n")),
    ("chat", "kvgate+vllm", {"response_format": {"type": "json_object"}}, STRUCTURED),
    (
        "chat",
        "kvgate+vllm",
        {"tool_choice": "required", "tools": [{"type": "function", "function": {"name": "f"}}]},
        TOOL_CALL,
    ),
    ("responses", "sglang", {"top_p": 0}, TOP_P),
    ("responses", "sglang", {"top_k": 0}, TOP_K),
    ("responses", "sglang", {"top_k": 0, "temperature": 0.5}, TOP_K),
    ("responses", "vllm", {"top_p": 0.0}, TOP_P),
    ("responses", "kvgate", {"top_p": 0}, TOP_P),
    ("responses", "kvgate", {"top_logprobs": 2}, _unsupported("top_logprobs")),
    ("responses", "kvgate+vllm", {"top_logprobs": 2}, _unsupported("top_logprobs")),
]


def _ids(rows: list[tuple]) -> list[str]:
    return [f"{r[0]}-{r[1]}-{'-'.join(f'{k}={v}' for k, v in r[2].items())}" for r in rows]


@pytest.mark.parametrize(("route", "policy", "body", "error"), REFUSED_BODIES, ids=_ids(REFUSED_BODIES))
def test_a_request_the_engine_would_refuse_is_refused_at_the_edge_and_changes_nothing(
    gws, module_engine, route, policy, body, error
):
    """Before: 200 here (the mock takes anything) and the body forwarded as sent; the real engine
    answers 400 after the gateway reserved and then settled the prompt against TPM."""
    assert_refused_before_the_charge(gws, module_engine, ROUTES[route], policy, body, error)


ADMITTED: list[tuple[str, str, dict[str, Any]]] = [
    # SGLang greedy: top_k is set to 1 before verify, so 0 passes there; it ignores top_logprobs alone
    ("chat", "sglang", {"top_k": 0, "temperature": 0}),
    ("chat", "sglang", {"top_k": -1, "top_p": 1e-9, "n": 2, "temperature": 0}),
    ("chat", "sglang", {"top_logprobs": 2}),
    # vLLM reads top_k 0 as off; a temperature above 0 is no greedy sampling, n 1 is
    ("chat", "vllm", {"top_k": 0}),
    ("chat", "vllm", {"temperature": 0.001, "n": 2}),
    ("chat", "vllm", {"temperature": 0, "n": 1}),
    ("chat", "vllm", {"logprobs": True, "top_logprobs": 2}),
    ("chat", "vllm", {"top_logprobs": 0}),
    # the bundled backend's neutral values
    ("chat", "kvgate", {k: v[0] for k, v in BUNDLED_NEUTRAL["chat"].items()}),
    ("chat", "kvgate", {"response_format": {"type": "text"}, "tool_choice": "auto"}),
    ("chat", "kvgate+vllm", {"temperature": 0.5, "n": 1, "logprobs": False, "top_p": 0.5}),
    # OpenAI itself: none of the engines' refusals apply
    ("chat", "openai", {"top_p": 0, "temperature": 0, "n": 2, "top_logprobs": 2}),
    ("responses", "sglang", {"top_k": 0, "temperature": 0}),
    ("responses", "sglang", {"top_k": -1, "top_p": 1e-9}),
    ("responses", "vllm", {"top_k": 0, "top_logprobs": 2}),
    ("responses", "kvgate", {"top_logprobs": 0, "top_p": 1}),
    ("responses", "openai", {"top_p": 0, "top_logprobs": 2}),
]


def assert_refused_before_the_charge(
    gws, module_engine, route: tuple[str, dict], policy: str, body: dict, error: dict
) -> None:
    """``body`` on ``route`` (its path and base body) to the gateway of engine set ``policy``: the
    400 ``error``, and nothing charged beyond the request's own RPM entry."""
    g = gws[policy]
    path, base = route
    ledger = Ledger(g, module_engine)
    r = _post(g, path, {"model": MODEL, **base, **body})
    assert (r.status_code, error_of(r)) == (400, error)
    assert ledger.delta() == REFUSED


def assert_forwarded_as_sent(gws, module_engine, route: tuple[str, dict], policy: str, body: dict) -> None:
    """``body`` on ``route`` (its path and base body) to the gateway of engine set ``policy``: 200,
    its fields reach the engine as sent, one RPM entry taken and no lease left."""
    g = gws[policy]
    path, base = route
    ledger = Ledger(g, module_engine)
    r = _post(g, path, {"model": MODEL, **base, **body})
    assert r.status_code == 200, r.text
    got = forwarded(module_engine, path)[-1]
    assert {k: got.get(k) for k in body} == body
    change = ledger.delta()
    assert (change["engine"], change["rpm"], change["leases"]) == (1, 1, 0)


@pytest.mark.parametrize(("route", "policy", "body"), ADMITTED, ids=_ids(ADMITTED))
def test_what_the_engine_takes_is_still_forwarded_as_sent(gws, module_engine, route, policy, body):
    assert_forwarded_as_sent(gws, module_engine, ROUTES[route], policy, body)


def test_the_bundled_backend_refuses_each_chat_value_the_gateway_now_refuses_for_it():
    """The chat table the gateway refuses for ``engine: kvgate`` is the bundled backend's own:
    each refused value is its 400 naming the field, each neutral value it takes
    (``gpu_backend/openai_api.py`` ``parse_chat``; ``gpu_backend/responses_api.py``
    ``parse_responses`` for ``top_logprobs``)."""
    from gpu_backend.openai_api import parse_chat
    from gpu_backend.responses_api import parse_responses
    from tests.test_backend_unapplied_params import KW, Ids

    def chat(**extra: Any) -> Any:
        return parse_chat({"model": "m", **CHAT, **extra}, Ids(), **KW)

    def responses(**extra: Any) -> Any:
        return parse_responses({"model": "m", **RESPONSES, **extra}, Ids(), **KW)

    parse = {"chat": chat, "responses": responses}
    for route, policy, body, error in REFUSED_BODIES:
        if policy != "kvgate":
            continue
        with pytest.raises(OpenAIError) as e:
            parse[route](**body)
        assert (e.value.status, e.value.param) == (400, error["param"]), body
    for route in ("chat", "responses"):
        for key, neutral in BUNDLED_NEUTRAL[route].items():
            for value in neutral:
                parse[route](**{key: value})


# ---------------------------------------------------------------- embeddings: dimensions
DIMENSIONS: list[tuple[str, str, int, dict[str, Any] | None]] = [
    # not configured as Matryoshka: vLLM's 400 after the charge
    ("sglang", EMB, 3, _unsupported("dimensions")),
    ("vllm", EMB, 3, _unsupported("dimensions")),
    ("vllm", EMB, 1, _unsupported("dimensions")),
    # listed dimensions only
    (
        "vllm",
        EMB_LISTED,
        300,
        _invalid("Invalid value for 'dimensions': must be one of 256, 512 for this model", "dimensions"),
    ),
    (
        "sglang",
        EMB_LISTED,
        1024,
        _invalid("Invalid value for 'dimensions': must be one of 256, 512 for this model", "dimensions"),
    ),
    # admitted: any on a Matryoshka model, a listed one, anything on OpenAI
    ("vllm", EMB_ANY, 3, None),
    ("sglang", EMB_ANY, 100000, None),
    ("vllm", EMB_LISTED, 512, None),
    ("openai", EMB, 3, None),
]


@pytest.mark.parametrize(
    ("policy", "model", "dims", "error"), DIMENSIONS, ids=[f"{p}-{m}-{d}" for p, m, d, _ in DIMENSIONS]
)
def test_embedding_dimensions_follow_the_models_matryoshka_setting(gws, module_engine, policy, model, dims, error):
    g = gws[policy]
    sent = {"model": model, "input": [[1, 2, 3]], "dimensions": dims}
    ledger = Ledger(g, module_engine)
    r = _post(g, "/v1/embeddings", sent)
    if error is not None:
        assert (r.status_code, error_of(r)) == (400, error)
        assert ledger.delta() == REFUSED
        return
    assert r.status_code == 200, r.text
    assert forwarded(module_engine, "/v1/embeddings")[-1]["dimensions"] == dims
    change = ledger.delta()
    assert (change["engine"], change["rpm"], change["leases"]) == (1, 1, 0)


def test_embeddings_without_dimensions_are_untouched(gws, module_engine):
    g = gws["vllm"]
    r = _post(g, "/v1/embeddings", {"model": EMB, "input": "hello", "dimensions": None})
    assert r.status_code == 200, r.text
    assert "dimensions" not in forwarded(module_engine, "/v1/embeddings")[-1]


# ---------------------------------------------------------------- config
YAML = """\
models:
  - id: chat-m
    context_length: 8192
  - id: emb-m
    context_length: 8192
    task: embedding
upstreams:
  - name: big
    api_url: http://127.0.0.1:30000/v1
    engine: vllm
    pool_source: vllm
    pool_urls: [http://127.0.0.1:30000/v1/models]
    models: [chat-m, emb-m]
  - name: local
    api_url: http://127.0.0.1:30001/v1
    pool_urls: [http://127.0.0.1:30001/server_info]
    models: [chat-m, emb-m]
"""


def test_an_embedding_model_on_the_bundled_backend_is_a_config_error():
    """``local`` has no ``engine``: ``pool_source`` (default ``kvgate``) makes it the bundled
    backend, which serves no ``/v1/embeddings``."""
    with pytest.raises(ConfigError) as ei:
        validate_yaml_text(YAML, Settings, "kvgate.yaml")
    assert str(ei.value) == (
        "kvgate.yaml: line 17: upstreams[1].models[1]: model 'emb-m' has task 'embedding', but upstream 'local' "
        "has engine 'kvgate' (the bundled backend serves no /v1/embeddings)"
    )
    with pytest.raises(ConfigError):
        validate_yaml_text(
            YAML.replace("  - name: local\n", "  - name: local\n    engine: kvgate\n"), Settings, "k.yaml"
        )
    # the embedding model served by the vLLM upstream only: loads
    at = YAML.rindex("models: [chat-m, emb-m]")
    fine = YAML[:at] + "models: [chat-m]" + YAML[at + len("models: [chat-m, emb-m]") :]
    s = validate_yaml_text(fine, Settings, "k.yaml")
    assert [u.models for u in s.upstreams] == [["chat-m", "emb-m"], ["chat-m"]]


@pytest.mark.parametrize(
    ("model", "problem"),
    [
        (
            {"id": "c", "context_length": 8, "matryoshka": True},
            "'matryoshka' is for embedding models (task: embedding)",
        ),
        ({"id": "e", "context_length": 8, "task": "embedding", "matryoshka": []}, "List should have at least 1 item"),
        ({"id": "e", "context_length": 8, "task": "embedding", "matryoshka": [0]}, "greater than or equal to 1"),
        ({"id": "e", "context_length": 8, "task": "embedding", "matryoshka": 1}, "valid boolean"),
    ],
)
def test_the_matryoshka_key_is_checked(model, problem):
    with pytest.raises(ValidationError) as ei:
        Settings.model_validate({"models": [model]})
    assert problem in str(ei.value)


def test_matryoshka_defaults_to_false():
    s = Settings.model_validate({"models": [{"id": "e", "context_length": 8, "task": "embedding"}]})
    assert s.models[0].matryoshka is False


def test_refusals_are_openai_shaped_errors():
    from gateway.admission.engine_refusals import check_embedding_dimensions, check_engine_refusals

    with pytest.raises(OpenAIError) as ei:
        check_engine_refusals({"top_p": 0}, frozenset({"vllm", "openai"}), "responses")
    assert (ei.value.status, ei.value.code, ei.value.param) == (400, ErrorCode.INVALID_REQUEST, "top_p")
    check_engine_refusals({"top_p": 0}, frozenset({"openai"}), "chat")
    check_embedding_dimensions({"dimensions": 5}, frozenset({"openai"}), False)
    with pytest.raises(OpenAIError):
        check_embedding_dimensions({"dimensions": 5}, frozenset({"openai", "sglang"}), False)
