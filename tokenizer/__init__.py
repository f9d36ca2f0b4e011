"""Exact prompt-token counting for OpenAI requests (docs/design.md, step 4).

``make_counter(TokenizerConfig)`` gives a :class:`PromptCounter`; ``count_prompt`` /
``count_chat`` (and their async twins) return exact counts or raise the typed errors of
:mod:`tokenizer.errors`. Imports neither torch nor the gateway.
"""

from __future__ import annotations

from config.models import TokenizerConfig
from tokenizer.base import PromptCount, PromptCounter, prompt_param, split_completion_prompt
from tokenizer.chat import DEFAULT_CHAT, ChatOptions, RenderedChat, render_chatml
from tokenizer.encodings import IM_END_ID, IM_START_ID, bundled_encoding, get_encoding
from tokenizer.errors import (
    EngineTokenizeError,
    ImagesNotSupportedError,
    InvalidPromptError,
    InvalidTokenIdError,
    TokenizerError,
    UnknownContentPartError,
)
from tokenizer.tiktoken_counter import TiktokenCounter, bundled_counter


def make_counter(cfg: TokenizerConfig, model: str = "", api_key: str | None = None) -> PromptCounter:
    """Build the counter a model's :class:`~config.models.TokenizerConfig` describes.

    ``api_key``: the bearer key of the engine's tokenize endpoint (``kind: engine`` only), used when
    ``cfg.api_key`` is not set.

    Raises ``ValueError`` for an encoding not available offline, ``FileNotFoundError`` for a
    missing HF folder, ``ImportError`` when the ``hf`` extra is not installed.
    """
    if cfg.kind == "bundled":
        return bundled_counter(cfg.image_tokens)
    if cfg.kind == "tiktoken":
        return TiktokenCounter(cfg.name, image_tokens=cfg.image_tokens)
    if cfg.kind == "hf":
        from tokenizer.hf_counter import HFCounter

        return HFCounter(cfg.path or "", image_tokens=cfg.image_tokens)
    from tokenizer.engine_counter import EngineCounter

    key = cfg.api_key.get_secret_value() if cfg.api_key is not None else api_key
    return EngineCounter(cfg.url or "", model, api=cfg.engine_api, image_tokens=cfg.image_tokens, api_key=key)


__all__ = [
    "ChatOptions",
    "DEFAULT_CHAT",
    "EngineTokenizeError",
    "IM_END_ID",
    "IM_START_ID",
    "ImagesNotSupportedError",
    "InvalidPromptError",
    "InvalidTokenIdError",
    "PromptCount",
    "PromptCounter",
    "RenderedChat",
    "TiktokenCounter",
    "TokenizerError",
    "UnknownContentPartError",
    "bundled_counter",
    "bundled_encoding",
    "get_encoding",
    "make_counter",
    "prompt_param",
    "render_chatml",
    "split_completion_prompt",
]
