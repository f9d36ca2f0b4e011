"""Counting with the engine's own tokenize endpoint (exact by definition; costs a round trip).

Shapes (request -> response):
- SGLang ``POST {base}/v1/tokenize`` ``{"model", "prompt"}`` -> ``{"tokens": [...], "count": n}``
- vLLM ``POST {base}/tokenize`` ``{"model", "prompt"}`` or ``{"model", "messages",
  "add_generation_prompt": true}`` -> ``{"count": n, "tokens": [...], "max_model_len": m}``
The bundled backend serves the SGLang path and accepts ``messages`` too.
"""
from __future__ import annotations

from typing import Any

import httpx

from tokenizer.base import PromptCount, PromptCounter, split_completion_prompt
from tokenizer.chat import render_chatml
from tokenizer.errors import EngineTokenizeError


class EngineCounter(PromptCounter):
    """Asks the engine. Only the async API is available (it is network I/O); the sync methods
    raise ``NotImplementedError``. ``vocab_size`` bounds token-id validation."""

    def __init__(self, base_url: str, model: str, api: str = "sglang", vocab_size: int = 1 << 31,
                 image_tokens: int = 765, timeout_seconds: float = 5.0,
                 client: httpx.AsyncClient | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.api = api
        self.vocab_size = vocab_size
        self.image_tokens = image_tokens
        self._client = client or httpx.AsyncClient(timeout=timeout_seconds)
        self.url = f"{self.base_url}/v1/tokenize" if api == "sglang" else f"{self.base_url}/tokenize"

    def count_text(self, text: str) -> int:
        raise NotImplementedError("EngineCounter counts only through its async API")

    def count_chat(self, messages: Any, tools: Any = None) -> int:
        raise NotImplementedError("EngineCounter counts only through its async API")

    def is_valid_id(self, token_id: int) -> bool:
        return 0 <= token_id < self.vocab_size

    async def _ask(self, payload: dict[str, Any]) -> int:
        try:
            r = await self._client.post(self.url, json={"model": self.model, **payload})
        except httpx.HTTPError as e:
            raise EngineTokenizeError(f"engine tokenize failed: {type(e).__name__}") from e
        if r.status_code != 200:
            raise EngineTokenizeError(f"engine tokenize answered {r.status_code}")
        data = r.json()
        if isinstance(data.get("count"), int):
            return data["count"]
        if isinstance(data.get("tokens"), list):
            return len(data["tokens"])
        raise EngineTokenizeError("engine tokenize answered without 'count' or 'tokens'")

    async def acount_prompt(self, prompt: Any) -> PromptCount:
        counts = []
        prompts = split_completion_prompt(prompt)
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                counts.append(await self._ask({"prompt": p}))
            else:
                self.check_ids(p, f"prompt[{i}]" if len(prompts) > 1 else "prompt")
                counts.append(len(p))
        return PromptCount(tuple(counts))

    async def acount_chat(self, messages: Any, tools: Any = None) -> int:
        rendered = render_chatml(messages, tools)  # validates shapes and part types first
        payload: dict[str, Any] = {"messages": messages, "add_generation_prompt": True}
        if tools:
            payload["tools"] = tools
        return await self._ask(payload) + rendered.images * self.image_tokens

    async def aclose(self) -> None:
        await self._client.aclose()
