"""``POST /v1/chat/completions`` as a route value (:data:`CHAT`): its field table, how its
messages are counted (as the engines render them: :mod:`tokenizer.chat`), its completion bound
(``max_completion_tokens`` over ``max_tokens``) and what the verifier reads of it."""

from __future__ import annotations

from typing import Any

from config.errors import context_length_message
from gateway.admission import fields
from gateway.admission.checks import CHAT_FIELDS, check_fields, check_stream_options
from gateway.admission.engine_refusals import check_engine_refusals
from gateway.admission.gate import CountedPrompt
from gateway.admission.registry import ModelEntry
from gateway.routes.base import PromptApiRoute
from tokenizer import PromptCounter
from tokenizer.chat import ChatOptions, chat_cost
from tokenizer.prompt_text import chat_text, content_texts


class ChatRoute(PromptApiRoute):
    """Chat completions: ``messages`` (contents validated while counting), ``tools``."""

    name = "chat"
    path = "/v1/chat/completions"
    upstream_path = "/chat/completions"
    fields = CHAT_FIELDS
    bound_fields: tuple[str, ...] = ("max_completion_tokens", "max_tokens")
    prompt_param = "messages"

    def validate(self, body: dict[str, Any]) -> None:
        check_fields(body, self.fields, ("messages",))
        check_stream_options(body)

    def forwarded_bound(self, engines: frozenset[str]) -> str:
        """``max_tokens``, except when an ``openai`` upstream serves the model (OpenAI refuses
        ``max_tokens`` for its reasoning models; SGLang, vLLM and the bundled backend read
        ``max_completion_tokens or max_tokens``)."""
        return "max_completion_tokens" if "openai" in engines else "max_tokens"

    def length_message(self, limit: int, largest: int, max_tokens: int) -> str:
        return context_length_message(limit, largest, max_tokens, messages=True)

    def check_batch(self, body: dict[str, Any], max_sequences: int) -> None:
        return None  # one prompt: its sequences are the gate's

    def cost(self, body: dict[str, Any], limit: int) -> int:
        return chat_cost(body.get("messages"), body.get("tools"), limit)

    def longest_text_chars(self, body: dict[str, Any]) -> int:
        n = 0
        for m in body.get("messages") or ():
            if isinstance(m, dict):
                n += sum(map(len, content_texts(m.get("content"))))
        return n

    def check_fields(self, body: dict[str, Any], entry: ModelEntry) -> ChatOptions:
        """The engines' field policy (:func:`gateway.admission.fields.check_chat_request`), then
        the values they would refuse after admission
        (:func:`gateway.admission.engine_refusals.check_engine_refusals`)."""
        specials = entry.counter.special_token_texts
        options = fields.check_chat_request(body, entry.engines, entry.config.images, specials)
        check_engine_refusals(body, entry.engines, self.name)
        return options

    def count_now(self, counter: PromptCounter, body: dict[str, Any], options: ChatOptions) -> CountedPrompt:
        c = counter.count_chat(body["messages"], body.get("tools"), options)
        return CountedPrompt(c, c, 1)

    async def acount(self, counter: PromptCounter, body: dict[str, Any], options: ChatOptions) -> CountedPrompt:
        c = await counter.acount_chat(body["messages"], body.get("tools"), options)
        return CountedPrompt(c, c, 1)

    def prompt_text(self, body: dict[str, Any]) -> str:
        """Every string the engine renders: tool definitions, and per message its name,
        reasoning, text parts, refusal and tool calls' names and arguments
        (:func:`tokenizer.prompt_text.chat_text`), joined by newlines."""
        return chat_text(body.get("messages"), body.get("tools"), body.get("functions"))

    def verifier_prompts(self, body: dict[str, Any]) -> tuple[list[list[int]], list[str]]:
        """No token-id prompts; the last message's text (what an echo would repeat)."""
        msgs = body.get("messages") or ()
        last = msgs[-1].get("content") if msgs and isinstance(msgs[-1], dict) else None
        if isinstance(last, str):
            return [], [last]
        if isinstance(last, list):
            return [], ["".join(content_texts(last))]
        return [], []


CHAT = ChatRoute()
