"""Image content parts for a model the bundled backend (an upstream with ``engine: kvgate``) may
serve, through the whole gateway (the app and API mock engine of tests/test_hostile_routes.py,
quotas in process, the :class:`~tests.test_hostile_routes.Ledger` of
tests/test_engine_refusals_everywhere.py).

The finding this file holds fixed: a chat ``image_url`` (or ``input_image``) part and a Responses
``input_image`` part (in a message or a ``function_call_output``) were admitted, counted at the
model's image cost, reserved and forwarded to a model served by the bundled backend, alone or
beside another engine; the bundled backend encodes its prompt as text only and answers 400 ("This
model does not accept image content parts.", ``tokenizer/chat.py`` ``chatml_token_ids``:
``ImagesNotSupportedError``), settled after the charge. Each is now the gateway's 400 naming the
part, before anything is counted, reserved or forwarded; the same parts for a model served by
vLLM alone are still forwarded as sent. At load, a model with a non-default ``images`` policy
served by a ``kvgate`` upstream is a config error naming both.
"""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from config.errors import OpenAIError
from config.loader import ConfigError, validate_yaml_text
from config.models import ImagePolicy, ModelConfig, Settings, UpstreamConfig
from gateway.quotas.tenant_quotas import build_quota_stage
from tests.gate_oracle import png
from tests.gateway_harness import MODEL, Gateway, settings_for, tenants, upstream
from tests.test_gateway_api_routes import error_of, forwarded
from tests.test_hostile_routes import REFUSED, Ledger, _invalid, _post

pytestmark = [pytest.mark.timeout(120), pytest.mark.engine("api")]

#: a vision model served by vLLM alone, with an image policy of its own
VISION = "vision-m"
IMAGE = png(64, 64)
#: the tenant's context cap: room for an image (765 tokens at the default policy) and its text
CONTEXT = 4096


def _start(engine: Any, engines: tuple[str, ...]) -> Gateway:
    """One upstream per engine policy in ``engines``, all on the one mock ``engine``, serving
    :data:`MODEL` (default image policy); the vLLM upstream also serves :data:`VISION`."""
    ups = [
        {**upstream(f"u-{policy}", engine), "engine": policy, "models": [MODEL, *([VISION] * (policy == "vllm"))]}
        for policy in engines
    ]
    models = [{"id": VISION, "context_length": 8192, "images": {"cost": "openai_tiles"}}]
    s = settings_for(ups, gateway={"max_body_bytes": 1 << 16}, models=models, quotas={"enabled": True})
    s.quotas.window_seconds = 3600
    limits = {"rpm": 10**6, "tpm": 10**9, "max_concurrent": 64}
    reg = tenants(max_context_tokens=CONTEXT, allowed_models=[MODEL, VISION], **limits)
    return Gateway(s, reg, quotas=build_quota_stage(s)).start()


@pytest.fixture(scope="module")
def gws(module_engine):
    started = {name: _start(module_engine, engines) for name, engines in POLICIES.items()}
    yield started
    for g in started.values():
        g.stop()


POLICIES = {"kvgate": ("kvgate",), "kvgate+vllm": ("kvgate", "vllm"), "vllm": ("vllm",)}


def _no_images(param: str) -> dict:
    return _invalid(
        f"'{param}' is an image, but the engines serving this model take no images (they read text only); "
        "send text parts only.",
        param,
    )


def _text(t: str) -> dict:
    return {"type": "text", "text": t}


def _chat(*content: dict, before: list[dict] | None = None) -> dict:
    return {"messages": [*(before or []), {"role": "user", "content": list(content)}], "max_tokens": 3}


LOOK = {"name": "look", "arguments": "{}"}
IMAGE_PART = {"type": "image_url", "image_url": {"url": IMAGE}}
CHAT_IMAGE = _chat(_text("What is this?"), IMAGE_PART)
RESP_IMAGE = {
    "input": [
        {
            "role": "user",
            "content": [{"type": "input_text", "text": "What is this?"}, {"type": "input_image", "image_url": IMAGE}],
        }
    ],
    "max_output_tokens": 3,
}
RESP_TOOL_IMAGE = {
    "input": [
        {"type": "function_call", "call_id": "c1", "name": "look", "arguments": "{}"},
        {
            "type": "function_call_output",
            "call_id": "c1",
            "output": [{"type": "input_text", "text": "a photo"}, {"type": "input_image", "image_url": IMAGE}],
        },
    ],
    "tools": [{"type": "function", "name": "look", "parameters": {"type": "object"}}],
    "max_output_tokens": 3,
}

#: (route path, engines, body, the part named)
REFUSED_IMAGES: list[tuple[str, str, dict[str, Any], str]] = [
    ("/v1/chat/completions", "kvgate", CHAT_IMAGE, "messages[0].content[1]"),
    ("/v1/chat/completions", "kvgate+vllm", CHAT_IMAGE, "messages[0].content[1]"),
    # chat's input_image part (vLLM's shape, counted as an image) in a later message
    (
        "/v1/chat/completions",
        "kvgate",
        _chat({"type": "input_image", "image_url": IMAGE}, before=[{"role": "system", "content": "Be brief."}]),
        "messages[1].content[0]",
    ),
    # an image in a tool message: still an image part of the prompt
    (
        "/v1/chat/completions",
        "kvgate+vllm",
        {
            "messages": [
                {"role": "user", "content": "look"},
                {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": LOOK}]},
                {"role": "tool", "tool_call_id": "c1", "content": [_text("a photo"), IMAGE_PART]},
            ],
            "max_tokens": 3,
        },
        "messages[2].content[1]",
    ),
    # an http URL: no image is taken at all, so no URL policy is offered as the way out
    (
        "/v1/chat/completions",
        "kvgate",
        _chat({"type": "image_url", "image_url": {"url": "https://images.example/cat.png"}}),
        "messages[0].content[0]",
    ),
    ("/v1/responses", "kvgate", RESP_IMAGE, "input[0].content[1]"),
    ("/v1/responses", "kvgate+vllm", RESP_IMAGE, "input[0].content[1]"),
    ("/v1/responses", "kvgate", RESP_TOOL_IMAGE, "input[1].output[1]"),
    (
        "/v1/responses",
        "kvgate+vllm",
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://h.example/x.png"}]}]},
        "input[0].content[0]",
    ),
]


@pytest.mark.parametrize(
    ("path", "policy", "body", "param"),
    REFUSED_IMAGES,
    ids=[f"{p.split('/')[2]}-{e}-{param}" for p, e, _, param in REFUSED_IMAGES],
)
def test_an_image_part_for_a_model_the_bundled_backend_serves_is_refused_and_changes_nothing(
    gws, module_engine, path, policy, body, param
):
    """Before: 200 here (the mock takes anything), the image counted, reserved and forwarded; the
    bundled backend then answers 400 after the charge."""
    g = gws[policy]
    ledger = Ledger(g, module_engine)
    r = _post(g, path, {"model": MODEL, **body})
    assert (r.status_code, error_of(r)) == (400, _no_images(param))
    assert ledger.delta() == REFUSED


def _tiles(content: list[dict]) -> dict:
    return _chat(*content)


ADMITTED: list[tuple[str, str, str, dict[str, Any]]] = [
    # a vision model on vLLM alone, with its own image policy: the image is forwarded as sent
    ("/v1/chat/completions", "vllm", VISION, CHAT_IMAGE),
    ("/v1/chat/completions", "kvgate+vllm", VISION, CHAT_IMAGE),  # VISION is on the vLLM upstream only
    ("/v1/responses", "vllm", VISION, RESP_IMAGE),
    ("/v1/responses", "vllm", VISION, RESP_TOOL_IMAGE),
    # text parts for the bundled backend: taken
    ("/v1/chat/completions", "kvgate", MODEL, _chat(_text("What is"), _text("this?"))),
    (
        "/v1/responses",
        "kvgate+vllm",
        MODEL,
        {"input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}], "max_output_tokens": 3},
    ),
]


@pytest.mark.parametrize(
    ("path", "policy", "model", "body"),
    ADMITTED,
    ids=[f"{p.split('/')[2]}-{e}-{m}-{i}" for i, (p, e, m, _) in enumerate(ADMITTED)],
)
def test_images_for_a_model_only_vllm_serves_are_still_forwarded_as_sent(gws, module_engine, path, policy, model, body):
    g = gws[policy]
    ledger = Ledger(g, module_engine)
    r = _post(g, path, {"model": model, **body})
    assert r.status_code == 200, r.text
    got = forwarded(module_engine, path)[-1]
    key = "messages" if path.endswith("completions") else "input"
    assert got[key] == body[key] and got["model"] == model
    change = ledger.delta()
    assert (change["engine"], change["rpm"], change["leases"]) == (1, 1, 0)


def test_the_bundled_backend_itself_refuses_each_refused_body():
    """The refusal is the bundled backend's own: its chat and Responses parsers (with its bundled
    encoder) answer 400 for each body refused above."""
    from config.models import TokenizerConfig
    from gpu_backend.openai_api import parse_chat
    from gpu_backend.responses_api import parse_responses
    from tokenizer import make_counter

    counter = make_counter(TokenizerConfig(kind="bundled"))
    kw = {"context_length": 8192, "model_names": [MODEL], "served_model_name": MODEL}
    for path, _, body, _ in REFUSED_IMAGES:
        parse = parse_chat if path.endswith("completions") else parse_responses
        with pytest.raises(OpenAIError) as e:
            parse({"model": MODEL, **body}, counter, **kw)
        assert (e.value.status, e.value.message) == (400, "This model does not accept image content parts."), body


# ---------------------------------------------------------------- config
YAML = """\
models:
  - id: vis
    aliases: [vis-alias]
    context_length: 8192
    images:
      cost: qwen2_vl
  - id: text-m
    context_length: 8192
upstreams:
  - name: big
    api_url: http://127.0.0.1:30000/v1
    engine: vllm
    pool_source: vllm
    pool_urls: [http://127.0.0.1:30000/v1/models]
    models: [vis, text-m]
  - name: local
    api_url: http://127.0.0.1:30001/v1
    pool_urls: [http://127.0.0.1:30001/server_info]
    models: [text-m, vis-alias]
"""

NO_IMAGES = (
    "upstreams[1].models[1]: model 'vis' has an 'images' policy, but upstream 'local' has engine 'kvgate' "
    "(the bundled backend takes no images); remove the policy or serve the model elsewhere"
)


@pytest.mark.parametrize(
    "images",
    [
        "      cost: qwen2_vl\n",
        "      allowed_url_hosts: [images.example]\n",
        "      cost: openai_tiles\n      base_tokens: 85\n",
        "      max_pixels: 1003520\n",
    ],
)
def test_an_image_policy_on_a_model_the_bundled_backend_serves_is_a_config_error(images):
    """``local`` has no ``engine``: ``pool_source`` (default ``kvgate``) makes it the bundled
    backend, which takes no images; any key of the policy set away from its default says the
    model is meant to take images."""
    text = YAML.replace("      cost: qwen2_vl\n", images)
    with pytest.raises(ConfigError) as ei:
        validate_yaml_text(text, Settings, "kvgate.yaml")
    line = text.splitlines().index("    models: [text-m, vis-alias]") + 1
    assert str(ei.value) == f"kvgate.yaml: line {line}: {NO_IMAGES}"


def test_a_model_without_an_image_policy_or_served_by_vllm_alone_loads():
    # the model with the policy on the vLLM upstream only
    s = validate_yaml_text(YAML.replace("models: [text-m, vis-alias]", "models: [text-m]"), Settings, "k.yaml")
    assert s.models[0].images.cost == "qwen2_vl"
    # the default policy (every model has one) written out, as `kvgate up` writes its run config
    dumped = ModelConfig(id="m", context_length=8).model_dump(mode="json")
    assert dumped["images"] == ImagePolicy().model_dump(mode="json")
    up = UpstreamConfig(name="local", api_url="http://h/v1", pool_urls=["http://h/server_info"], models=["m"])
    Settings.model_validate({"models": [dumped], "upstreams": [up.model_dump(mode="json")]})
    s = validate_yaml_text(
        YAML.replace("    images:\n      cost: qwen2_vl\n", "    images: {cost: fixed}\n"), Settings, "k.yaml"
    )
    assert s.models[0].images == ImagePolicy()


def test_the_shipped_config_loads():
    with open("config/kvgate.yaml", encoding="utf-8") as f:
        Settings.model_validate(yaml.safe_load(f))
