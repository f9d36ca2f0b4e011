"""The official ``openai`` SDK against a running embedded stack (bundled backend + gateway).

One stack per module (started once; its own tenants file and state in a temporary folder).
Prompts are real text cut to exact token counts with the bundled tokenizer; the limit is what
the gateway's ``/v1/models`` reports as ``max_model_len``.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from config.errors import context_length_message
from config.loader import DEFAULT_TENANTS
from gateway.stack.demo_corpus import fit_chat, fit_prompt, project_source, prose
from gateway.stack.embedded import EmbeddedStack, StackOptions
from tokenizer import bundled_counter

BACKEND_MISSING = importlib.util.find_spec("gpu_backend.__main__") is None
pytestmark = [
    pytest.mark.skipif(
        BACKEND_MISSING,
        reason="the bundled backend (python -m gpu_backend) is not in this "
        "checkout: gpu_backend/__main__.py is missing",
    ),
    pytest.mark.timeout(240),
]

MAX_TOKENS = 8
COUNTER = bundled_counter()


def demo_stack(d: Path) -> EmbeddedStack:
    """The embedded stack (bundled backend + ``kvgate serve``, the demo tenants, free ports)
    under ``d``, not yet started (a context manager)."""
    tenants = d / "tenants.yaml"
    shutil.copy(DEFAULT_TENANTS, tenants)
    opts = StackOptions(
        tenants=tenants,
        gateway_port=0,
        backend_port=0,
        run_dir=d,
        startup_timeout_seconds=150,
        extra_env={"KVGATE_STATE_DIR": str(d / "state")},
    )
    return EmbeddedStack(opts)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedStack]:
    with demo_stack(tmp_path_factory.mktemp("sdk-stack")) as s:
        yield s


def _client(stack: EmbeddedStack, key: str = "sk-demo-a") -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.gateway_url + "/v1", api_key=key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def limit(stack: EmbeddedStack) -> int:
    models = _client(stack).models.list().data
    assert [m.id for m in models] == [stack.model]
    value = (models[0].model_extra or {})["max_model_len"]
    # the embedded stack: prefill pool 4096 tokens / headroom 1.25 = 3276 < context length 8192
    pool = stack.server_info["max_total_num_tokens"]
    assert value == min(stack.server_info["context_length"], int(pool / 1.25))
    return int(value)


SOURCE = prose() + "\n\n" + project_source()[:60_000]


def test_chat_at_the_limit_is_served_and_one_over_is_context_length_exceeded(stack, limit) -> None:
    client = _client(stack)
    at = fit_chat(SOURCE, limit - MAX_TOKENS, COUNTER, instruction="Explain:\n\n")
    r = client.chat.completions.create(model=stack.model, messages=at, max_tokens=MAX_TOKENS, temperature=0)
    assert r.usage is not None and r.usage.prompt_tokens == limit - MAX_TOKENS
    assert r.usage.completion_tokens <= MAX_TOKENS and r.choices[0].finish_reason in ("length", "stop")

    over = fit_chat(SOURCE, limit - MAX_TOKENS + 1, COUNTER, instruction="Explain:\n\n")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=stack.model, messages=over, max_tokens=MAX_TOKENS, temperature=0)
    assert e.value.status_code == 400
    assert e.value.code == "context_length_exceeded"
    assert e.value.param == "messages"
    assert e.value.type == "invalid_request_error"
    assert e.value.body["message"] == context_length_message(limit, limit - MAX_TOKENS + 1, MAX_TOKENS, messages=True)


def test_completion_at_the_limit_is_served_and_one_over_is_context_length_exceeded(stack, limit) -> None:
    client = _client(stack)
    at = fit_prompt(SOURCE, limit - MAX_TOKENS, COUNTER)
    r = client.completions.create(model=stack.model, prompt=at, max_tokens=MAX_TOKENS, temperature=0)
    assert r.usage is not None and r.usage.prompt_tokens == limit - MAX_TOKENS
    assert r.choices[0].finish_reason in ("length", "stop")

    over = fit_prompt(SOURCE, limit - MAX_TOKENS + 1, COUNTER)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=stack.model, prompt=over, max_tokens=MAX_TOKENS, temperature=0)
    assert (e.value.status_code, e.value.code, e.value.param) == (400, "context_length_exceeded", "prompt")
    assert e.value.body["message"] == context_length_message(limit, limit - MAX_TOKENS + 1, MAX_TOKENS, messages=False)


def test_streamed_request_at_the_limit_is_served_and_one_over_fails_before_streaming(stack, limit) -> None:
    client = _client(stack)
    at = fit_chat(SOURCE, limit - MAX_TOKENS, COUNTER)
    chunks = list(
        client.chat.completions.create(
            model=stack.model,
            messages=at,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    usage = [c.usage for c in chunks if c.usage is not None]
    assert len(usage) == 1 and usage[0].prompt_tokens == limit - MAX_TOKENS
    over = fit_chat(SOURCE, limit - MAX_TOKENS + 1, COUNTER)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=stack.model, messages=over, max_tokens=MAX_TOKENS, temperature=0, stream=True
        )
    assert e.value.code == "context_length_exceeded"


def test_prompt_larger_than_the_prefill_pool_is_refused_at_the_edge(stack, limit) -> None:
    pool = stack.server_info["max_total_num_tokens"]
    prompt = fit_prompt(SOURCE, pool + 1, COUNTER)
    with pytest.raises(openai.BadRequestError) as e:
        _client(stack).completions.create(model=stack.model, prompt=prompt, max_tokens=MAX_TOKENS)
    assert e.value.code == "context_length_exceeded"
    assert e.value.body["message"] == context_length_message(limit, pool + 1, MAX_TOKENS, messages=False)


def test_wrong_key_is_authentication_error(stack) -> None:
    client = _client(stack, key="sk-not-a-kvgate-key")
    with pytest.raises(openai.AuthenticationError) as e:
        client.chat.completions.create(model=stack.model, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert (e.value.status_code, e.value.code, e.value.type) == (401, "invalid_api_key", "authentication_error")
    assert "sk-not-a-kvgate-key" not in e.value.message
    with pytest.raises(openai.AuthenticationError):
        client.models.list()


def test_greedy_stream_equals_non_stream_chat(stack) -> None:
    client = _client(stack)
    messages = [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "Summarise:\n\n" + prose()[:1200]},
    ]
    whole = client.chat.completions.create(model=stack.model, messages=messages, max_tokens=16, temperature=0)
    parts = list(
        client.chat.completions.create(model=stack.model, messages=messages, max_tokens=16, temperature=0, stream=True)
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in parts if c.choices)
    assert whole.choices[0].message.content  # the engine produced text
    assert streamed == whole.choices[0].message.content
    finish = [c.choices[0].finish_reason for c in parts if c.choices and c.choices[0].finish_reason]
    assert finish == [whole.choices[0].finish_reason]


def test_greedy_stream_equals_non_stream_completion(stack) -> None:
    client = _client(stack)
    prompt = "Litwo! Ojczyzno moja! ty jesteś jak zdrowie: 床前明月光，疑是地上霜。"
    whole = client.completions.create(model=stack.model, prompt=prompt, max_tokens=16, temperature=0)
    parts = list(client.completions.create(model=stack.model, prompt=prompt, max_tokens=16, temperature=0, stream=True))
    assert whole.choices[0].text
    assert "".join(c.choices[0].text for c in parts if c.choices) == whole.choices[0].text


def test_request_without_model_uses_the_tenants_only_model(stack) -> None:
    client = _client(stack)
    r = client.chat.completions.create(
        model=openai.NOT_GIVEN, messages=[{"role": "user", "content": "Hello!"}], max_tokens=4, temperature=0
    )
    assert r.model == stack.model
    c = client.completions.create(model=openai.NOT_GIVEN, prompt="Call me Ishmael.", max_tokens=4, temperature=0)
    assert c.model == stack.model
    assert c.usage is not None and c.usage.prompt_tokens == COUNTER.count_text("Call me Ishmael.")


def test_tenant_add_then_reload_makes_the_new_key_work(stack) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "gateway.cli",
            "tenant",
            "add",
            "sdk-new",
            "--tenants",
            str(stack.tenants_path),
            "--model",
            stack.model,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    key = out.stdout.strip()
    assert key.startswith("sk-kvg-") and key not in Path(stack.tenants_path).read_text()
    stack.reload_tenants()
    client = _client(stack, key=key)
    deadline = time.monotonic() + 15
    while True:
        try:
            r = client.chat.completions.create(
                model=stack.model, messages=[{"role": "user", "content": "hi"}], max_tokens=2, temperature=0
            )
            break
        except openai.AuthenticationError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    assert r.choices[0].finish_reason in ("length", "stop")
    assert _client(stack).models.list().data[0].id == stack.model  # the old tenants still work
