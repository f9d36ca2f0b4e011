"""The render-as-the-engine test setup (tests/test_gate_render.py): a gateway in front of a
recording SGLang-shaped and a vLLM-shaped mock engine, with one model per engine policy for two
templates: kvgate's ChatML (bundled tokenizer) and a Qwen2.5/Hermes-style Jinja template that
prints tool-call arguments with ``tojson`` (a tiny BPE tokenizer folder trained here).

Pool 4096 tokens, headroom 1.25 -> live limit 3,276 tokens; tenant ``max_tokens_cap`` 256.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path

from config.models import Settings
from tests.gate_env import make_bpe_folder, mock_pair_env
from tests.mock_engine import MockEngine

LIMIT = 3276
#: a Qwen2.5 / Hermes-style template: tools and tool-call arguments through ``tojson``, the
#: assistant's ``reasoning_content`` in ``<think>``, tool results as user turns, and
#: ``reasoning_effort`` read in the generation prompt
TOJSON_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "# Tools\n\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools><|im_end|>\n"
    "{%- elif messages[0]['role'] == 'system' %}<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role in ('system', 'developer') and not loop.first) %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{%- elif message.role == 'assistant' %}<|im_start|>assistant\n"
    "{%- if message.reasoning_content is string and message.reasoning_content %}"
    "<think>{{ message.reasoning_content }}</think>{% endif %}"
    "{{ message.content }}"
    "{%- for tc in message.tool_calls or [] %}\n<tool_call>\n"
    '{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}\n</tool_call>'
    "{%- endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n"
    "</tool_response><|im_end|>\n"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if reasoning_effort is defined and reasoning_effort %}effort: {{ reasoning_effort }}\n{% endif %}"
    "{%- endif %}"
)
#: model -> the engines that serve it; ``t*`` use :data:`TOJSON_TEMPLATE`, ``c*`` kvgate's ChatML
ENGINES = {
    "ts": ("sglang",),
    "tv": ("vllm",),
    "tk": ("kvgate",),
    "to": ("openai",),
    "tmix": ("sglang", "vllm"),
    "cs": ("sglang",),
    "cv": ("vllm",),
    "ck": ("kvgate",),
    "co": ("openai",),
}
HF_MODELS = frozenset(m for m in ENGINES if m.startswith("t"))


def make_tojson_folder(folder: Path) -> Path:
    """:func:`tests.gate_env.make_bpe_folder` with :data:`TOJSON_TEMPLATE`."""
    corpus = '{"name": "get", "arguments": {"v": [2.5, "é"]}} user assistant <tool_call> 日本'
    return make_bpe_folder(folder, TOJSON_TEMPLATE, corpus, 600)


def _upstream(name: str, engine: str, url: str, models: list[str], sg: MockEngine, vl: MockEngine) -> dict:
    if engine == "sglang":
        return {
            "name": name,
            "api_url": sg.api_url,
            "pool_source": "sglang",
            "pool_urls": [sg.info_url],
            "models": models,
        }
    if engine == "vllm":
        return {
            "name": name,
            "api_url": vl.api_url,
            "pool_source": "vllm",
            "pool_urls": [vl.url + "/v1/models"],
            "models": models,
        }
    return {
        "name": name,
        "api_url": url,
        "pool_source": "static",
        "static_pool_tokens": 4096,
        "engine": engine,
        "models": models,
    }


def render_settings(sg: MockEngine, vl: MockEngine, folder: Path) -> Settings:
    """Settings serving every model of :data:`ENGINES` (static upstreams, ``kvgate`` and
    ``openai``, forward to the SGLang mock)."""
    models = []
    for m in ENGINES:
        entry: dict = {"id": m, "context_length": 8192}
        if m in HF_MODELS:
            entry["tokenizer"] = {"kind": "hf", "path": str(folder)}
        models.append(entry)
    by_engine: dict[str, list[str]] = {}
    for m, engines in ENGINES.items():
        for e in engines:
            by_engine.setdefault(e, []).append(m)
    upstreams = [_upstream(f"u-{e}", e, sg.api_url, ms, sg, vl) for e, ms in sorted(by_engine.items())]
    return Settings.model_validate(
        {
            "gateway": {"max_body_bytes": 8 * 1024 * 1024, "connect_timeout_seconds": 1, "read_timeout_seconds": 5},
            "pool": {"poll_interval_seconds": 0.2, "max_staleness_seconds": 5, "request_timeout_seconds": 2.0},
            "models": models,
            "upstreams": upstreams,
            "verifier": {"enabled": False},
            "quotas": {"enabled": False},
        }
    )


def render_env(engine: Callable[[], MockEngine] = MockEngine) -> contextlib.AbstractContextManager[tuple]:
    """``(client, sglang mock, vllm mock, quotas, tojson tokenizer folder)`` with the gateway
    ready, the mocks made by ``engine``."""
    return mock_pair_env(make_tojson_folder, render_settings, engine)
