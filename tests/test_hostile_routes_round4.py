"""A hostile client, fourth round, against ``/v1/completions`` through the whole gateway (the app
and API mock engine of tests/test_hostile_routes.py, quotas in process), once per engine policy
(the upstream's ``engine``: ``sglang``, ``vllm``, the bundled backend ``kvgate``, ``openai``):
each body below is an exact OpenAI-shaped 400 naming its field that reaches no engine and changes
no quota counter but the request's own RPM entry; its neighbours that the engine takes are still
forwarded as sent.

The findings this file holds fixed: each body was admitted, charged and forwarded, and the engine
then refused it, so the client paid its prompt x sequences for an engine 400
(gateway/relay/finish.py settles an engine's error at the prompt as admitted):

- ``top_p: 0``: every engine refuses it (vLLM ``vllm/sampling_params.py``
  ``SamplingParams._verify_args`` "top_p must be in (0, 1]", before its greedy reset; SGLang
  ``python/sglang/srt/sampling/sampling_params.py`` ``SamplingParams.verify``; the bundled
  backend's ``gpu_backend/openai_api.py`` ``_sampling``);
- ``top_k: 0`` on SGLang (``SamplingParams.verify``: "top_k must be -1 (disable) or at least 1"),
  unless the temperature is greedy (SGLang sets ``top_k`` 1 first); vLLM reads 0 as off;
- ``n > 1`` with ``temperature: 0`` on vLLM (``SamplingParams._verify_greedy_sampling``: "n must
  be 1 when using greedy sampling");
- on the bundled backend: a batch of prompts ("Batched prompts are not supported by this
  backend"), ``n``, ``best_of``, ``echo``, ``logprobs``, ``logit_bias``, ``frequency_penalty``,
  ``presence_penalty`` at anything but their neutral values (``_UNSUPPORTED``,
  ``_check_unsupported``): the gateway passed every OpenAI field to every engine.
"""

from __future__ import annotations

from typing import Any

import pytest

from gateway.admission.engine_refusals import BUNDLED_NEUTRAL
from gateway.quotas.tenant_quotas import build_quota_stage
from tests.gateway_harness import MODEL, Gateway, tenants
from tests.test_gateway_api_routes import EMB, LIMIT, api_settings, error_of, forwarded
from tests.test_hostile_routes import REFUSED, Ledger, _invalid, _post

pytestmark = [pytest.mark.timeout(120), pytest.mark.engine("api")]

ENGINES = ("sglang", "vllm", "kvgate", "openai")


def _start(engine: Any, policy: str) -> Gateway:
    """tests/test_hostile_routes.py's gateway, its upstream declared served by ``policy`` (the
    bundled backend, which has no ``/v1/embeddings``, without the embedding model)."""
    up: dict[str, Any] = {"engine": policy, **({"models": [MODEL]} if policy == "kvgate" else {})}
    s = api_settings(engine, up=up, quotas=True)
    s.quotas.window_seconds = 3600
    limits = {"rpm": 10**6, "tpm": 10**9, "max_concurrent": 64, "max_embedding_inputs": 8}
    reg = tenants(max_context_tokens=LIMIT, allowed_models=[MODEL, EMB], **limits)
    return Gateway(s, reg, quotas=build_quota_stage(s)).start()


@pytest.fixture(scope="module")
def gws(module_engine):
    started = {policy: _start(module_engine, policy) for policy in ENGINES}
    yield started
    for g in started.values():
        g.stop()


def _unsupported(field: str) -> dict:
    return _invalid(f"'{field}' is not supported by the engines serving this model.", field)


TOP_P = _invalid("Invalid value for 'top_p': must be > 0 and <= 1 (the engines serving this model refuse 0)", "top_p")
TOP_K = _invalid(
    "Invalid value for 'top_k': must be -1 (off) or at least 1 for the engines serving this model (SGLang)", "top_k"
)
GREEDY_N = _invalid(
    "Invalid value for 'n': must be 1 when 'temperature' is 0 (greedy sampling) for the engines serving this model",
    "n",
)

REFUSED_BODIES: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    ("sglang", {"top_p": 0}, TOP_P),
    ("sglang", {"top_p": 0.0, "temperature": 0}, TOP_P),
    ("sglang", {"top_k": 0}, TOP_K),
    ("sglang", {"top_k": 0, "temperature": 0.5}, TOP_K),
    ("vllm", {"top_p": 0}, TOP_P),
    ("vllm", {"temperature": 0, "n": 2}, GREEDY_N),
    ("vllm", {"temperature": 0.0, "n": 3, "prompt": [[1, 2], [3]]}, GREEDY_N),
    ("kvgate", {"top_p": 0}, TOP_P),
    (
        "kvgate",
        {"prompt": ["a", "b"]},
        _invalid("'prompt' holds 2 prompts; the engines serving this model take one prompt per request.", "prompt"),
    ),
    (
        "kvgate",
        {"prompt": [[1], [2], [3]]},
        _invalid("'prompt' holds 3 prompts; the engines serving this model take one prompt per request.", "prompt"),
    ),
    ("kvgate", {"n": 2}, _unsupported("n")),
    ("kvgate", {"best_of": 2}, _unsupported("best_of")),
    ("kvgate", {"echo": True}, _unsupported("echo")),
    ("kvgate", {"logprobs": 1}, _unsupported("logprobs")),
    ("kvgate", {"logit_bias": {"5": 1}}, _unsupported("logit_bias")),
    ("kvgate", {"frequency_penalty": -0.5}, _unsupported("frequency_penalty")),
    ("kvgate", {"presence_penalty": 2}, _unsupported("presence_penalty")),
]


@pytest.mark.parametrize(
    ("policy", "body", "error"),
    REFUSED_BODIES,
    ids=[f"{p}-{'-'.join(f'{k}={v}' for k, v in b.items())}" for p, b, _ in REFUSED_BODIES],
)
def test_a_completion_the_engine_would_refuse_is_refused_at_the_edge_and_changes_nothing(
    gws, module_engine, policy, body, error
):
    """Before: 200 here (the mock takes anything) and the body forwarded as sent; the real engine
    answers 400 after the gateway reserved and then settled the prompt against TPM."""
    g = gws[policy]
    ledger = Ledger(g, module_engine)
    r = _post(g, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 3, **body})
    assert (r.status_code, error_of(r)) == (400, error)
    assert ledger.delta() == REFUSED


ADMITTED: list[tuple[str, dict[str, Any]]] = [
    # SGLang greedy: top_k is set to 1 before verify, so 0 passes there
    ("sglang", {"top_k": 0, "temperature": 0}),
    ("sglang", {"top_k": -1, "top_p": 1e-9, "n": 2, "temperature": 0}),
    # vLLM reads top_k 0 as off; a temperature above 0 is no greedy sampling, n 1 is
    ("vllm", {"top_k": 0}),
    ("vllm", {"temperature": 0.001, "n": 2}),
    ("vllm", {"temperature": 0, "n": 1, "best_of": 1}),
    # the bundled backend's neutral values, and a one-prompt list
    ("kvgate", {"prompt": ["hi"]}),
    ("kvgate", {"prompt": [[1, 2]]}),
    ("kvgate", {k: v[0] for k, v in BUNDLED_NEUTRAL["completions"].items()}),
    # OpenAI itself: none of the engines' refusals apply
    ("openai", {"top_p": 0, "temperature": 0, "n": 2, "echo": True, "prompt": ["a", "b"]}),
]


@pytest.mark.parametrize(
    ("policy", "body"), ADMITTED, ids=[f"{p}-{'-'.join(f'{k}={v}' for k, v in b.items())}" for p, b in ADMITTED]
)
def test_what_the_engine_takes_is_still_forwarded_as_sent(gws, module_engine, policy, body):
    g = gws[policy]
    sent = {"model": MODEL, "prompt": "hi", "max_tokens": 3, **body}
    ledger = Ledger(g, module_engine)
    r = _post(g, "/v1/completions", sent)
    assert r.status_code == 200, r.text
    got = forwarded(module_engine, "/v1/completions")[-1]
    assert {k: got[k] for k in sent if k != "model"} == {k: v for k, v in sent.items() if k != "model"}
    change = ledger.delta()
    assert (change["engine"], change["rpm"], change["leases"]) == (1, 1, 0)


def test_the_bundled_backend_refuses_each_value_the_gateway_now_refuses_for_it():
    """The table the gateway refuses for ``engine: kvgate`` is the bundled backend's own: each
    refused value is its 400, each neutral value it takes (``gpu_backend/openai_api.py``
    ``parse_completion``)."""
    from gpu_backend.openai_api import OpenAIError, parse_completion
    from tests.test_backend_unapplied_params import KW, Ids

    def parse(**extra: Any) -> Any:
        return parse_completion({"model": "m", "prompt": [1, 2, 3], "max_tokens": 4, **extra}, Ids(), **KW)

    for policy, body, error in REFUSED_BODIES:
        if policy != "kvgate":
            continue
        with pytest.raises(OpenAIError) as e:
            parse(**body)
        assert (e.value.status, e.value.param) == (400, error["param"]), body
    for key, neutral in BUNDLED_NEUTRAL["completions"].items():
        for value in neutral:
            parse(**{key: value})
