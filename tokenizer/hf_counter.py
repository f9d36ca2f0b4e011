"""Counting with a Hugging Face ``tokenizer.json`` and the Jinja chat template of
``tokenizer_config.json`` (extra ``hf``: tokenizers, jinja2). Loads only from a local folder.

The chat is rendered as ``transformers``' ``apply_chat_template`` does (``add_generation_prompt``
true, ``tokenize`` with ``add_special_tokens=False``). A special-token look-alike in user text is
counted as ordinary text (its text encoding), so the count never falls below the engine's.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizer.base import PromptCounter
from tokenizer.chat import _text_of_content, render_chatml
from tokenizer.errors import InvalidPromptError


class HFCounter(PromptCounter):
    """A Hugging Face tokenizer folder. Raises ``FileNotFoundError`` when ``tokenizer.json`` is
    missing and ``ImportError`` without the ``hf`` extra."""

    def __init__(self, path: str | Path, image_tokens: int = 765) -> None:
        from tokenizers import Tokenizer  # extra "hf"

        folder = Path(path)
        self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        cfg_path = folder / "tokenizer_config.json"
        self.config: dict[str, Any] = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        self.image_tokens = image_tokens
        self.special_tokens = [t.content for t in self.tokenizer.get_added_tokens_decoder().values() if t.special]
        template = self.config.get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        self._template = None
        if template:
            import jinja2
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
            env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)

            def raise_exception(msg: str) -> None:
                raise jinja2.exceptions.TemplateError(msg)

            env.globals["raise_exception"] = raise_exception
            self._template = env.from_string(template)

    def _tok(self, name: str) -> str:
        v = self.config.get(name)
        return v.get("content", "") if isinstance(v, dict) else (v or "")

    def count_text(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False).ids) + self._special_surcharge(text)

    def _special_surcharge(self, text: str) -> int:
        """Extra tokens so special look-alikes in user text count as text, not as one token."""
        extra = 0
        for s in self.special_tokens:
            n = text.count(s)
            if n:
                as_text = len(self.tokenizer.encode(s, add_special_tokens=False).ids)
                # encode() of the literal gives the special id (1 token); as text it is longer
                chars = sum(len(self.tokenizer.encode(ch, add_special_tokens=False).ids) for ch in s)
                extra += n * max(0, max(as_text, chars) - 1)
        return extra

    def is_valid_id(self, token_id: int) -> bool:
        return 0 <= token_id < self.vocab_size and self.tokenizer.id_to_token(token_id) is not None

    def count_chat(self, messages: Any, tools: Any = None) -> int:
        rendered = render_chatml(messages, tools)  # validation (shapes, part types) only
        if self._template is None:
            raise InvalidPromptError("This model's tokenizer has no chat template.", "messages")
        plain = []
        user_text = ""
        for i, m in enumerate(messages):
            texts, _ = _text_of_content(m.get("content"), f"messages[{i}].content")
            text = "".join(texts)
            user_text += text
            plain.append({**m, "content": text})
        prompt = self._template.render(messages=plain, tools=tools, add_generation_prompt=True,
                                       bos_token=self._tok("bos_token"), eos_token=self._tok("eos_token"))
        ids = self.tokenizer.encode(prompt, add_special_tokens=False).ids
        return len(ids) + self._special_surcharge(user_text) + rendered.images * self.image_tokens
