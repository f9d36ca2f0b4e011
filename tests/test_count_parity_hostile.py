"""Hostile count parity: chats whose rendering by the engine (vLLM, SGLang) differs from the
messages as sent in ways kvgate's pre-template steps must copy, or the gate undercounts.

The expected counts come from ``transformers``' own ``apply_chat_template`` on the messages and
tools AS THE ENGINE HANDS THEM TO IT, built here from the engines' source, never from kvgate's
counter:

- tools: both engines validate ``tools`` into pydantic models and give the template
  ``[tool.model_dump() for tool in request.tools]`` (vLLM ``chat_completion/serving.py``; SGLang
  ``serving_chat.py`` ``_process_messages``). vLLM (``engine/protocol.py``): ``OpenAIBaseModel``
  has ``extra="allow"``, ``FunctionDefinition(name, description=None, parameters=None)``,
  ``ChatCompletionToolsParam(type="function", function)``; declared fields first, then extras
  in the order sent. SGLang (``protocol.py``, pydantic's default ``extra="ignore"``):
  ``Function(description=None, name, parameters=None, strict=False, defer_loading=None, popped
  when None)``, ``Tool(type="function", function, defer_loading=None)``.
- content format: a template that loops over ``message['content']`` gets content as a list of
  parts (vLLM ``_detect_content_format`` -> "openai": a string becomes one text part, ``None``
  no parts; SGLang ``detect_jinja_template_content_format``: also any template mentioning
  image/audio/video/vision; a list's text parts kept as ``{"type": "text", "text": ...}``).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.engine_tool_models import sglang_tools, vllm_tools
from tests.gate_env import make_bpe_folder
from tests.render_env import TOJSON_TEMPLATE

pytest.importorskip("transformers")

CORPUS = '{"name": "get", "arguments": {"v": [2.5, "é"]}} user assistant <tool_call> 日本 description null'


# ---- fixtures ----------------------------------------------------------------------------------
def _folder(tmp_path_factory, name: str, template: str):
    return make_bpe_folder(tmp_path_factory.mktemp(name), template, CORPUS, 600)


@pytest.fixture(scope="module")
def tojson_folder(tmp_path_factory):
    return _folder(tmp_path_factory, "tojson", TOJSON_TEMPLATE)


#: a template that reads content only as a list of parts (no string branch), as several
#: multimodal templates do for user turns
PARTS_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] == 'image' %}<image>{% endif %}{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def parts_folder(tmp_path_factory):
    return _folder(tmp_path_factory, "parts", PARTS_TEMPLATE)


def _counter(folder, engine: str):
    from tokenizer.hf_counter import HFCounter

    c = HFCounter(folder)
    c.engines = frozenset({engine})
    return c


def _hf_len(folder, messages, tools=None) -> int:
    import transformers

    tok = transformers.PreTrainedTokenizerFast.from_pretrained(str(folder))
    return len(
        tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False)
    )


HI = [{"role": "user", "content": "hi"}]
BARE_TOOL = {"type": "function", "function": {"name": "get"}}
EXTRA_TOOL = {
    "type": "function",
    "function": {"name": "get", "parameters": {"type": "object"}, "strict": True, "x_note": "é"},
}


# ---- tools: the engines' model_dump ------------------------------------------------------------
@pytest.mark.parametrize("tool", [BARE_TOOL, EXTRA_TOOL], ids=["bare", "extra_keys"])
def test_vllm_tools_are_counted_as_model_dump_renders_them(tojson_folder, tool):
    """vLLM hands the template ``tool.model_dump()``: a tool sent without ``description`` /
    ``parameters`` is printed with ``"description": null, "parameters": null``."""
    expected = _hf_len(tojson_folder, HI, vllm_tools([tool]))
    assert expected > _hf_len(tojson_folder, HI, [tool])  # the dump is longer than the tool as sent
    assert _counter(tojson_folder, "vllm").count_chat(HI, [tool]) == expected


@pytest.mark.parametrize("tool", [BARE_TOOL, EXTRA_TOOL], ids=["bare", "extra_keys"])
def test_sglang_tools_are_counted_as_model_dump_renders_them(tojson_folder, tool):
    """SGLang hands the template ``tool.model_dump()``: ``description``, ``parameters``,
    ``strict`` and the wrapper's ``defer_loading`` always printed; unknown keys dropped."""
    expected = _hf_len(tojson_folder, HI, sglang_tools([tool]))
    assert _counter(tojson_folder, "sglang").count_chat(HI, [tool]) == expected


def test_bare_tool_undercount_size(tojson_folder):
    """The size of the gap for one bare tool with this tokenizer: 63 tokens as sent (what kvgate
    counted), 79 as vLLM renders it (+16), 110 as SGLang does (+47)."""
    assert _hf_len(tojson_folder, HI, [BARE_TOOL]) == 63
    assert (
        _hf_len(tojson_folder, HI, vllm_tools([BARE_TOOL]))
        == _counter(tojson_folder, "vllm").count_chat(HI, [BARE_TOOL])
        == 79
    )
    assert (
        _hf_len(tojson_folder, HI, sglang_tools([BARE_TOOL]))
        == _counter(tojson_folder, "sglang").count_chat(HI, [BARE_TOOL])
        == 110
    )


def test_bundled_chatml_behind_engines_counts_dumped_tools():
    """kvgate's ChatML (bundled tokenizer) behind vLLM: the tools block is written from the
    tools the engine's template receives, the model_dump with its nulls."""
    from tests.gate_oracle import ENC
    from tokenizer import bundled_counter

    c = bundled_counter()
    c.engines = frozenset({"vllm"})
    dumped = vllm_tools([BARE_TOOL])[0]
    import json

    block = "# Tools\n\n<tools>\n" + json.dumps(dumped, ensure_ascii=False, separators=(", ", ": ")) + "\n</tools>"
    expected = (
        1
        + len(ENC.encode_ordinary("system\n" + block))
        + 1
        + 1  # <|im_start|>system..<|im_end|>\n
        + 1
        + len(ENC.encode_ordinary("user\nhi"))
        + 1
        + 1
        + 1
        + len(ENC.encode_ordinary("assistant\n"))
    )
    assert c.count_chat(HI, [BARE_TOOL]) == expected


# ---- content format: templates that loop over the content parts ------------------------------
def _parts(content: Any) -> list[dict]:
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return [{"type": "text", "text": p["text"]} if p["type"] == "text" else {"type": "image"} for p in content]


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_list_content_is_counted_for_a_parts_template(parts_folder, engine):
    """A template that iterates ``message['content']``: both engines pass text parts as parts;
    kvgate's string join makes the loop iterate characters and print nothing."""
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "hello world "}, {"type": "text", "text": "日本"}]}
    ]
    expected = _hf_len(parts_folder, [{"role": "user", "content": _parts(messages[0]["content"])}])
    assert _counter(parts_folder, engine).count_chat(messages) == expected


def test_string_content_is_counted_for_a_parts_template_on_vllm(parts_folder):
    """vLLM's "openai" content format turns a string content into one text part as well."""
    messages = [{"role": "system", "content": "be brief " * 20}, {"role": "user", "content": "hello world " * 30}]
    expected = _hf_len(parts_folder, [{"role": m["role"], "content": _parts(m["content"])} for m in messages])
    assert _counter(parts_folder, "vllm").count_chat(messages) == expected
