"""``/tokenize`` and ``/detokenize`` as route values (:data:`TOKENIZE`, :data:`DETOKENIZE`),
shaped like vLLM's (``vllm/entrypoints/serve/tokenize/``): their field tables and the answer from
the model's own counter, so that ``count`` is exactly the number the context gate uses
(:mod:`tokenizer.tokenize_api`); for ``engine`` tokenizers, the engine's ``/tokenize`` answers. A
prompt certainly longer than the effective limit is refused before it is tokenized (400
``context_length_exceeded``), as are more ids than it to ``/detokenize``; a count above
:data:`TOKENIZE_FREE_TOKENS` is charged against TPM. The handler that runs them through
admission's prologue is :mod:`gateway.routes.tokenize_handlers`.

- ``{"prompt": str, "add_special_tokens": true, "return_token_strs": false}`` or
  ``{"messages": [...], "tools": [...], "add_generation_prompt": true, "continue_final_message":
  false, "chat_template_kwargs": {...}}`` ->
  ``{"count", "max_model_len", "tokens", "token_strs"}``; image parts are refused (400), and so
  is what chat refuses before counting (:func:`check_chat_content`: unknown message keys, tool
  definitions without a function name or holding the model's special tokens,
  ``chat_template_kwargs`` other than chat's), so a count is never answered for a chat the gate
  would not count.
- ``{"tokens": [ids]}`` -> ``{"prompt": text}``; ids are validated against the vocabulary (400
  naming ``tokens``).
"""

from __future__ import annotations

import asyncio
from typing import Any

from config.errors import ErrorCode, OpenAIError
from gateway.admission.checks import CHAT_FIELDS, Check, array, bad_value, boolean, check_fields, string
from gateway.admission.fields import check_message_keys, check_tool_definitions, check_tool_shapes
from gateway.admission.gate import over_context_error, too_long_to_count
from gateway.admission.registry import ModelEntry
from gateway.routes.chat import CHAT
from gateway.routes.completions import COMPLETIONS
from tokenizer import render_chatml
from tokenizer.base import TOKEN_ID_CHARS
from tokenizer.chat import ChatOptions, chat_text_length
from tokenizer.engine_counter import EngineCounter
from tokenizer.tokenize_api import Tokenized, tokenize_chat, tokenize_prompt

#: A ``/tokenize`` whose count is above this many tokens charges them against TPM: counting a
#: prompt longer than a typical message is work the tenant pays for, as the chat it prepares
#: would (a short pre-check stays free).
TOKENIZE_FREE_TOKENS = 2048


#: ``POST /tokenize`` (vLLM ``TokenizeCompletionRequest`` / ``TokenizeChatRequest``): the chat
#: switches the gate counts (``add_generation_prompt``, ``continue_final_message``,
#: ``chat_template_kwargs``, as :class:`~tokenizer.chat.ChatOptions`; ``chat_template_kwargs``
#: under chat's own check: only the keys chat passes, booleans); a custom ``chat_template`` is
#: refused.
TOKENIZE_FIELDS: dict[str, Check] = {
    "model": string,
    "prompt": string,
    "messages": array,
    "tools": array,
    "add_special_tokens": boolean,
    "add_generation_prompt": boolean,
    "continue_final_message": boolean,
    "chat_template_kwargs": CHAT_FIELDS["chat_template_kwargs"],
    "return_token_strs": boolean,
}

#: ``POST /detokenize`` (vLLM ``DetokenizeRequest``)
DETOKENIZE_FIELDS: dict[str, Check] = {"model": string, "tokens": array}


def chat_options(body: dict[str, Any]) -> ChatOptions:
    """The :class:`~tokenizer.chat.ChatOptions` of a ``/tokenize`` chat body (vLLM
    ``TokenizeChatRequest``: ``add_generation_prompt`` default true, ``continue_final_message``,
    ``chat_template_kwargs``), as the chat route counts them."""
    cfm = bool(body.get("continue_final_message"))
    return ChatOptions(
        add_generation_prompt=body.get("add_generation_prompt") is not False and not cfm,
        continue_final_message=cfm,
        template_kwargs=tuple(sorted((body.get("chat_template_kwargs") or {}).items())),
    )


def check_chat_content(entry: ModelEntry, body: dict[str, Any]) -> None:
    """What chat refuses in a chat before counting it (``gateway.admission.fields.check_chat_request``,
    without the engines' extension table, which vLLM's ``/tokenize`` does not apply), for a
    ``/tokenize`` body with ``messages``: a message key outside
    :data:`~gateway.admission.fields.MESSAGE_KEYS` (400 naming ``messages[i].key``, chat's
    wording), a tool definition without a function name
    (:func:`~gateway.admission.fields.check_tool_shapes`) and one holding one of the model's special
    tokens (:func:`~gateway.admission.fields.check_tool_definitions`). Raises :class:`OpenAIError`."""
    check_message_keys(body)
    check_tool_shapes(body.get("tools"), entry.engines)
    check_tool_definitions(body.get("tools"), entry.counter.special_token_texts, entry.engines)


async def _tokenize(counter: Any, body: dict[str, Any]) -> Tokenized:
    strs = bool(body.get("return_token_strs"))
    messages = body.get("messages")
    if messages is not None:
        options = chat_options(body)
        tools = body.get("tools")

        def images() -> int:
            return render_chatml(messages, tools, ChatOptions(options.add_generation_prompt)).images

        long = chat_text_length(messages, tools, limit=counter.offload_chars) > counter.offload_chars
        if await asyncio.to_thread(images) if long else images():
            raise OpenAIError(
                400,
                "/tokenize does not take image content parts (they have no token ids here).",
                code=ErrorCode.INVALID_REQUEST,
                param="messages",
            )
        if isinstance(counter, EngineCounter):
            payload: dict[str, Any] = {"messages": messages, "add_generation_prompt": options.add_generation_prompt}
            if options.continue_final_message:
                payload["continue_final_message"] = True
            if options.template_kwargs:
                payload["chat_template_kwargs"] = dict(options.template_kwargs)
            if body.get("tools"):
                payload["tools"] = body["tools"]
            count, ids = await counter.atokenize_ids(payload)
            return Tokenized(count, ids)
        return await tokenize_chat(counter, messages, body.get("tools"), strs, options)
    add = body.get("add_special_tokens")
    add = True if add is None else add
    if isinstance(counter, EngineCounter):
        count, ids = await counter.atokenize_ids({"prompt": body["prompt"], "add_special_tokens": add})
        return Tokenized(count, ids)
    return await tokenize_prompt(counter, body["prompt"], add, strs)


def _check_token_ids(counter: Any, ids: list[Any]) -> None:
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise OpenAIError(
            400,
            "Invalid value for 'tokens': must be an array of integers",
            code=ErrorCode.INVALID_REQUEST,
            param="tokens",
        )
    counter.check_ids(ids, "tokens")


async def _detokenize(counter: Any, body: dict[str, Any], limit: int) -> str:
    """The text of ``body["tokens"]``; more ids than ``limit`` (the effective limit) are refused
    (400 ``context_length_exceeded``, ``param`` ``tokens``) before they are checked or decoded,
    and a long list is checked and decoded in a worker thread."""
    ids = body["tokens"]
    if len(ids) > limit:
        raise over_context_error(limit, len(ids), "tokens")
    heavy = len(ids) * TOKEN_ID_CHARS > counter.offload_chars
    if heavy:
        await asyncio.to_thread(_check_token_ids, counter, ids)
    else:
        _check_token_ids(counter, ids)
    adecode = getattr(counter, "adecode", None)
    if adecode is not None:
        return await adecode(ids)
    return await asyncio.to_thread(counter.decode, ids) if heavy else counter.decode(ids)


class TokenizeRoute:
    """``POST /tokenize`` (and ``/v1/tokenize``): a prompt or a chat -> its ids and their count."""

    name = "tokenize"
    path = "/tokenize"
    tasks: tuple[str, ...] = ("chat", "embedding")
    id_fields: tuple[str, ...] = ("prompt",)
    fields = TOKENIZE_FIELDS

    def validate(self, body: dict[str, Any]) -> None:
        """The field table, then exactly one of ``prompt`` and ``messages``, the chat switches
        only with ``messages``, and ``add_special_tokens`` only with ``prompt``."""
        check_fields(body, self.fields, ())
        has_prompt, has_messages = body.get("prompt") is not None, body.get("messages") is not None
        if has_prompt == has_messages:
            raise OpenAIError(
                400,
                "Send exactly one of 'prompt' (a string) or 'messages'.",
                code=ErrorCode.INVALID_REQUEST,
                param="prompt" if has_prompt else "messages",
            )
        if has_prompt:
            for key in ("tools", "add_generation_prompt", "continue_final_message", "chat_template_kwargs"):
                if body.get(key) is not None:
                    raise bad_value(key, "is only allowed with 'messages'")
        if body.get("add_generation_prompt") and body.get("continue_final_message"):
            raise bad_value("continue_final_message", "cannot be true together with 'add_generation_prompt'")
        if has_messages and body.get("add_special_tokens"):
            raise bad_value(
                "add_special_tokens", "must be false with 'messages' (the template adds what the model needs)"
            )

    async def answer(
        self, entry: ModelEntry, body: dict[str, Any], limit: int, max_model_len: int | None
    ) -> tuple[dict[str, Any], int]:
        """``(answer, tokens to charge)``: a chat is checked as chat checks it
        (:func:`check_chat_content`) and a prompt certainly longer than ``limit`` is refused,
        both before anything is tokenized; a count above :data:`TOKENIZE_FREE_TOKENS` is charged."""
        chat = body.get("messages") is not None
        if chat:
            check_chat_content(entry, body)
        too_long_to_count(entry, body, CHAT if chat else COMPLETIONS, limit)
        t = await _tokenize(entry.counter, body)
        charge = t.count if t.count > TOKENIZE_FREE_TOKENS else 0
        return {
            "count": t.count,
            "max_model_len": max_model_len,
            "tokens": t.tokens,
            "token_strs": t.token_strs,
        }, charge


class DetokenizeRoute:
    """``POST /detokenize`` (and ``/v1/detokenize``): ids -> their text."""

    name = "detokenize"
    path = "/detokenize"
    tasks: tuple[str, ...] = ("chat", "embedding")
    id_fields: tuple[str, ...] = ("tokens",)
    fields = DETOKENIZE_FIELDS

    def validate(self, body: dict[str, Any]) -> None:
        check_fields(body, self.fields, ("tokens",))

    async def answer(
        self, entry: ModelEntry, body: dict[str, Any], limit: int, max_model_len: int | None
    ) -> tuple[dict[str, Any], int]:
        """``({"prompt": text}, 0)``; more ids than ``limit`` refused before they are checked."""
        return {"prompt": await _detokenize(entry.counter, body, limit)}, 0


TOKENIZE = TokenizeRoute()
DETOKENIZE = DetokenizeRoute()
