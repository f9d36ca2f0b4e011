"""A developer message reaches vLLM's template with a ``tools`` key (``None``), and a template that
tests for the key renders it; SGLang passes the message as sent, ``None`` values dropped.

vLLM ``vllm/entrypoints/chat_utils.py@001eadcf`` ``_parse_chat_message_content``: ``if role ==
"developer": result_msg["tools"] = message.get("tools", None)``. SGLang
``python/sglang/srt/parser/jinja_template_utils.py@0b9c3848``
``process_content_for_template_format``: keys as sent, ``None`` values dropped.

Whether the template sees the ``None`` depends on the engine's ``transformers``: 5.x's
``apply_chat_template`` drops a message's ``None``-valued keys first
(``tokenization_utils_base.py`` -> ``chat_template_utils._normalize_chat_messages``), 4.x passes
them as they are, and vLLM's ``requirements/common.txt`` (``transformers >= 4.56.0, < 5``) runs
4.x. kvgate counts the rendering with the key, the larger here. Both expected counts come from
``transformers`` (5.25): ``apply_chat_template``, and ``render_jinja_template`` (its renderer,
called after that normalisation) for the 4.x rendering; never from kvgate's counter.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.gate_env import make_bpe_folder, mock_pair_env
from tests.gate_oracle import _hf, hf_chat_tokens, vllm_conversation
from tests.render_env import render_settings

#: ChatML that writes ``tools: <value>`` in any message that has the key (as templates that let a
#: developer message carry its own tools do)
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.tools is defined %}tools: {{ m.tools }}\n{% endif %}"
    "{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MESSAGES = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}]


def _folder(folder: Path) -> Path:
    return make_bpe_folder(folder, TEMPLATE, "developer user assistant tools: None Be brief. hi", 300)


@pytest.fixture(scope="module")
def env():
    with mock_pair_env(_folder, render_settings) as e:
        yield e


def keys_kept_tokens(folder: Path, messages: list[dict]) -> int:
    """Prompt tokens of vLLM's conversation with its ``None`` keys kept (transformers 4.x)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    tok = _hf(folder)
    prompts, _ = render_jinja_template(
        conversations=[vllm_conversation(messages)], chat_template=tok.chat_template, add_generation_prompt=True
    )
    return len(tok.encode(prompts[0], add_special_tokens=False))


def test_the_two_transformers_renderings(env):
    """``tools: None\\n`` is 5 tokens of this tokenizer: in vLLM's conversation on transformers 4.x
    only; 5.x drops the key, which SGLang never passes."""
    folder = env[4]
    body = {"messages": MESSAGES}
    assert vllm_conversation(MESSAGES)[0] == {"role": "developer", "content": "Be brief.", "tools": None}
    assert hf_chat_tokens(folder, body, engine="vllm") == hf_chat_tokens(folder, body, engine="sglang") == 19
    assert keys_kept_tokens(folder, MESSAGES) == 24


@pytest.mark.parametrize(("model", "engine", "prompt_tokens"), [("tv", "vllm", 24), ("ts", "sglang", 19)])
def test_a_developer_message_is_counted_as_the_engine_renders_it(env, model, engine, prompt_tokens):
    client, sg, vl, quotas, folder = env
    r = client.post("/v1/chat/completions", json={"model": model, "messages": MESSAGES, "max_tokens": 16})
    assert r.status_code == 200, r.text
    received = (vl if engine == "vllm" else sg).state.requests[-1]["body"]
    assert received["messages"] == MESSAGES
    expected = (
        keys_kept_tokens(folder, MESSAGES) if engine == "vllm" else hf_chat_tokens(folder, received, engine=engine)
    )
    assert quotas.reserved[-1] == expected + 16 == prompt_tokens + 16


def test_a_model_on_both_engines_reserves_the_larger_rendering(env):
    client, sg, vl, quotas, folder = env
    r = client.post("/v1/chat/completions", json={"model": "tmix", "messages": MESSAGES, "max_tokens": 16})
    assert r.status_code == 200, r.text
    assert quotas.reserved[-1] == keys_kept_tokens(folder, MESSAGES) + 16
