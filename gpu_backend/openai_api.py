"""OpenAI / SGLang request parsing and response shaping for the router (no torch, no engine).

Parsing turns a JSON body into a :class:`GenRequest` (prompt token ids + sampling dict) or raises
:class:`config.errors.OpenAIError` (400, ``param`` naming the field). Shaping builds the response
bodies of ``/v1/completions``, ``/v1/chat/completions`` (OpenAI API reference shapes) and SGLang's
native ``/generate``, and their SSE streams (``data: <json>\\n\\n`` ... ``data: [DONE]\\n\\n``; with
``stream_options.include_usage`` every chunk carries ``"usage": null`` and a last chunk with empty
``choices`` carries the usage, as the OpenAI API does).

Token counts: prompts are built with the served model's counter, the one the gateway counts with
(``TiktokenCounter``: the ChatML template of ``tokenizer/chat.py``; ``HFCounter``: the folder's
tokenizer and Jinja template): ``encode_chat`` for chats and ``encode_prompt_text`` (the
tokenizer's BOS included, as engines encode a completions prompt) for strings, user text always
without special-token parsing, so ``usage.prompt_tokens`` equals the gateway's count exactly.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import orjson

from config.errors import ErrorCode, OpenAIError, context_length_message
from tokenizer import TiktokenCounter, split_completion_prompt
from tokenizer.errors import TokenizerError
from tokenizer.hf_counter import HFCounter

#: OpenAI's default ``max_tokens`` for /v1/completions.
DEFAULT_COMPLETION_MAX_TOKENS = 16
#: Default ``max_tokens`` for chat (capped by what the context window leaves).
DEFAULT_CHAT_MAX_TOKENS = 256
#: Default SGLang ``max_new_tokens`` for /generate.
DEFAULT_GENERATE_MAX_NEW_TOKENS = 128
#: vLLM's and SGLang's extension samplers, under the same names on both APIs, with their neutral
#: values (both read top_k -1 and 0 as off, min_p 0, repetition_penalty 1): refused otherwise
_EXTENSION_SAMPLERS: dict[str, tuple[Any, ...]] = {
    "top_k": (None, -1, 0),
    "min_p": (None, 0),
    "repetition_penalty": (None, 1),
}
#: Parameters we refuse rather than silently ignore (they change the response's meaning).
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "logit_bias": (None, {}),
    "frequency_penalty": (None, 0, 0.0),
    "presence_penalty": (None, 0, 0.0),
    "response_format": (None, {"type": "text"}),
    **_EXTENSION_SAMPLERS,
    "min_tokens": (None, 0),
    # vLLM's structured output, token filters, prompt truncation and beam search: nothing here applies them
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "structured_outputs": (None,),
    "bad_words": (None, []),
    "allowed_token_ids": (None,),
    "truncate_prompt_tokens": (None,),
    "use_beam_search": (None, False),
    "prompt_logprobs": (None,),
    # no tool call is ever forced: the engine returns text
    "tool_choice": (None, "auto", "none"),
}
#: ``/generate``'s ``sampling_params`` refused unless neutral (SGLang's names,
#: ``sglang/srt/sampling/sampling_params.py``; structured output included)
_UNSUPPORTED_GENERATE: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (None, 0),
    "presence_penalty": (None, 0),
    **_EXTENSION_SAMPLERS,
    "min_new_tokens": (None, 0),
    "json_schema": (None,),
    "regex": (None,),
    "ebnf": (None,),
    "structural_tag": (None,),
    "logit_bias": (None, {}),
    "stop_regex": (None, "", []),
    "sampling_seed": (None,),  # the engine reads ``seed``
}
#: ``/generate``'s top-level fields refused unless neutral
_UNSUPPORTED_GENERATE_TOP: dict[str, tuple[Any, ...]] = {"return_logprob": (None, False)}


def bad_request(message: str, param: str | None = None, *, code: str = ErrorCode.INVALID_REQUEST) -> OpenAIError:
    """A 400 ``invalid_request_error`` in the OpenAI shape."""
    return OpenAIError(status=400, message=message, code=code, param=param)


@dataclass
class GenRequest:
    """A parsed generation request.

    ``kind``: ``completion`` | ``chat`` | ``generate``. ``prompt_ids``: the engine's prompt.
    ``params``: sampling as a plain dict with SGLang ``SamplingParams`` names (``max_new_tokens``,
    ``temperature``, ``top_p``, ``seed``, ``stop``, ``stop_token_ids``, ``ignore_eos``).
    ``include_usage``: ``stream_options.include_usage``. ``rid``: client request id (``/generate``).
    """

    kind: str
    model: str
    prompt_ids: list[int]
    params: dict[str, Any]
    stream: bool = False
    include_usage: bool = False
    rid: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def is_chat(self) -> bool:
        return self.kind == "chat"


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object (400 when it is not JSON or not an object)."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise bad_request(f"Request body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise bad_request("Request body must be a JSON object.")
    return body


def _int(body: dict[str, Any], key: str, *, minimum: int | None = None, default: Any = None) -> Any:
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, int) or isinstance(v, bool):
        raise bad_request(f"'{key}' must be an integer.", key)
    if minimum is not None and v < minimum:
        raise bad_request(f"'{key}' must be >= {minimum}; got {v}.", key)
    return v


def _num(body: dict[str, Any], key: str, default: float, lo: float, hi: float, *, lo_open: bool = False) -> float:
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        raise bad_request(f"'{key}' must be a number.", key)
    if (v <= lo if lo_open else v < lo) or v > hi:
        raise bad_request(f"'{key}' must be in {'(' if lo_open else '['}{lo}, {hi}]; got {v}.", key)
    return float(v)


def _stop(body: dict[str, Any], key: str = "stop") -> list[str]:
    v = body.get(key)
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) and s for s in v):
        raise bad_request(f"'{key}' must be a non-empty string or a list of non-empty strings.", key)
    return list(v)


def _bool(body: dict[str, Any], key: str, default: bool = False) -> bool:
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad_request(f"'{key}' must be a boolean.", key)
    return v


def _check_unsupported(body: dict[str, Any], table: dict[str, tuple[Any, ...]] = _UNSUPPORTED) -> None:
    """400 naming the first field of ``table`` that ``body`` sets to a value the engine would not
    honour: anything but the field's neutral values (a boolean only where the table lists it)."""
    for k, allowed in table.items():
        if k in body and not _neutral(body[k], allowed):
            raise bad_request(f"'{k}' is not supported by this backend.", k)
    n = body.get("n", 1)
    if n not in (None, 1) or isinstance(n, bool):
        raise bad_request("Only 'n' = 1 is supported by this backend.", "n")


def _neutral(value: Any, allowed: tuple[Any, ...]) -> bool:
    if isinstance(value, bool):
        return any(a is value for a in allowed)
    return value in allowed


def _stream_flags(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = _bool(body, "stream")
    opts = body.get("stream_options")
    if opts is None:
        return stream, False
    if not stream:
        raise bad_request("'stream_options' is only allowed when 'stream' is true.", "stream_options")
    if not isinstance(opts, dict):
        raise bad_request("'stream_options' must be an object.", "stream_options")
    return stream, _bool(opts, "include_usage")


def _check_model(body: dict[str, Any], model_names: Iterable[str], default: str) -> str:
    model = body.get("model")
    if model is None:
        return default
    if not isinstance(model, str):
        raise bad_request("'model' must be a string.", "model")
    if model not in set(model_names):
        raise OpenAIError(
            status=404, message=f"The model '{model}' does not exist.", code=ErrorCode.MODEL_NOT_FOUND, param="model"
        )
    return model


def check_context(prompt_tokens: int, max_tokens: int, context_length: int, *, chat: bool) -> None:
    """400 ``context_length_exceeded`` (OpenAI wording) when prompt + max_tokens > context length."""
    if prompt_tokens + max_tokens > context_length:
        raise OpenAIError(
            status=400,
            code=ErrorCode.CONTEXT_LENGTH_EXCEEDED,
            param="messages" if chat else "prompt",
            message=context_length_message(context_length, prompt_tokens, max_tokens, messages=chat),
        )


def _sampling(body: dict[str, Any], max_new_tokens: int, *, stop_key: str = "stop") -> dict[str, Any]:
    ids = body.get("stop_token_ids")
    if ids is not None and (
        not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)
    ):
        raise bad_request("'stop_token_ids' must be a list of non-negative integers.", "stop_token_ids")
    return {
        "max_new_tokens": max_new_tokens,
        "temperature": _num(body, "temperature", 1.0, 0.0, 2.0),
        "top_p": _num(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        "seed": _int(body, "seed"),
        "stop": _stop(body, stop_key),
        "stop_token_ids": list(ids or []),
        "ignore_eos": _bool(body, "ignore_eos"),
    }


#: The counters the router API encodes with (duck-typed: ``encode_prompt_text``, ``encode_chat``,
#: ``check_ids``, ``decode``).
PromptEncoder = TiktokenCounter | HFCounter


def _prompt_ids(prompt: Any, counter: PromptEncoder, param: str = "prompt") -> list[int]:
    try:
        prompts = split_completion_prompt(prompt)
    except TokenizerError as e:
        raise bad_request(e.message, e.param or param) from e
    if len(prompts) != 1:
        raise bad_request("Batched prompts are not supported by this backend; send one prompt per request.", param)
    p = prompts[0]
    if isinstance(p, str):
        ids = counter.encode_prompt_text(p)
    else:
        try:
            counter.check_ids(p, param)
        except TokenizerError as e:
            raise bad_request(e.message, e.param or param) from e
        ids = list(p)
    if not ids:
        raise bad_request(f"'{param}' must not be empty.", param)
    return ids


def parse_completion(
    body: dict[str, Any],
    counter: PromptEncoder,
    *,
    context_length: int,
    model_names: Iterable[str],
    served_model_name: str,
) -> GenRequest:
    """Parse ``/v1/completions`` (one prompt: string or token ids). Raises :class:`OpenAIError`."""
    _check_unsupported(body)
    model = _check_model(body, model_names, served_model_name)
    if "prompt" not in body:
        raise bad_request("'prompt' is required.", "prompt")
    ids = _prompt_ids(body["prompt"], counter)
    max_tokens = _int(body, "max_tokens", minimum=1, default=DEFAULT_COMPLETION_MAX_TOKENS)
    check_context(len(ids), max_tokens, context_length, chat=False)
    stream, usage = _stream_flags(body)
    return GenRequest("completion", model, ids, _sampling(body, max_tokens), stream, usage)


def encode_chat(body: dict[str, Any], counter: PromptEncoder) -> list[int]:
    """Prompt ids of a chat body (``messages`` + optional ``tools``) with the ChatML template.
    Image parts and malformed messages: 400 naming the field."""
    if "messages" not in body:
        raise bad_request("'messages' is required.", "messages")
    try:
        return counter.encode_chat(body["messages"], body.get("tools"))
    except TokenizerError as e:
        raise bad_request(e.message, e.param or "messages") from e


def parse_chat(
    body: dict[str, Any],
    counter: PromptEncoder,
    *,
    context_length: int,
    model_names: Iterable[str],
    served_model_name: str,
) -> GenRequest:
    """Parse ``/v1/chat/completions``. ``max_completion_tokens`` wins over ``max_tokens``; absent,
    ``min(DEFAULT_CHAT_MAX_TOKENS, context_length - prompt_tokens)``. Raises :class:`OpenAIError`."""
    _check_unsupported(body)
    model = _check_model(body, model_names, served_model_name)
    ids = encode_chat(body, counter)
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _int(body, key, minimum=1)
    if max_tokens is None:
        max_tokens = max(1, min(DEFAULT_CHAT_MAX_TOKENS, context_length - len(ids)))
    check_context(len(ids), max_tokens, context_length, chat=True)
    stream, usage = _stream_flags(body)
    return GenRequest("chat", model, ids, _sampling(body, max_tokens), stream, usage)


def parse_generate(
    body: dict[str, Any], counter: PromptEncoder, *, context_length: int, served_model_name: str
) -> GenRequest:
    """Parse SGLang's native ``/generate``: ``text`` or ``input_ids``, ``sampling_params``
    (``max_new_tokens`` default 128, ``temperature`` default 1.0, ``top_p``, ``stop``,
    ``stop_token_ids``, ``ignore_eos``, ``seed``), ``stream``, ``rid``."""
    has_text, has_ids = body.get("text") is not None, body.get("input_ids") is not None
    if has_text == has_ids:
        raise bad_request("Exactly one of 'text' and 'input_ids' is required.", "text")
    if has_text:
        if not isinstance(body["text"], str):
            raise bad_request("'text' must be a string (batches are not supported).", "text")
        ids = _prompt_ids(body["text"], counter, "text")
    else:
        if not isinstance(body["input_ids"], list) or (body["input_ids"] and isinstance(body["input_ids"][0], list)):
            raise bad_request("'input_ids' must be a list of token ids (batches are not supported).", "input_ids")
        ids = _prompt_ids(body["input_ids"], counter, "input_ids")
    sp = body.get("sampling_params") or {}
    if not isinstance(sp, dict):
        raise bad_request("'sampling_params' must be an object.", "sampling_params")
    _check_unsupported(body, _UNSUPPORTED_GENERATE_TOP)
    _check_unsupported(sp, _UNSUPPORTED_GENERATE)
    max_new = _int(sp, "max_new_tokens", minimum=1, default=DEFAULT_GENERATE_MAX_NEW_TOKENS)
    check_context(len(ids), max_new, context_length, chat=False)
    rid = body.get("rid")
    if rid is not None and (not isinstance(rid, str) or not rid or len(rid) > 128):
        raise bad_request("'rid' must be a non-empty string of at most 128 characters.", "rid")
    return GenRequest("generate", served_model_name, ids, _sampling(sp, max_new), _bool(body, "stream"), False, rid)


def new_id(kind: str) -> str:
    """A response id: ``cmpl-``, ``chatcmpl-`` or a bare hex id for /generate."""
    prefix = {"completion": "cmpl-", "chat": "chatcmpl-"}.get(kind, "")
    return prefix + uuid.uuid4().hex


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """OpenAI ``usage``, with ``prompt_tokens_details.cached_tokens`` (OpenAI's field): always 0,
    this engine has no prefix cache. The gateway's latency check needs it to tell a prefix-cache
    hit from a prefill that did not happen."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def completion_body(
    req: GenRequest, rid: str, text: str, finish_reason: str | None, prompt_tokens: int, completion_tokens: int
) -> dict[str, Any]:
    """Non-streamed response body of /v1/completions or /v1/chat/completions."""
    if req.is_chat:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": finish_reason,
        }
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    return {
        "id": rid,
        "object": obj,
        "created": req.created,
        "model": req.model,
        "choices": [choice],
        "usage": usage(prompt_tokens, completion_tokens),
    }


def sse(obj: Any) -> bytes:
    """One SSE event: ``data: <compact json>\\n\\n``."""
    return b"data: " + orjson.dumps(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def chunk(
    req: GenRequest, rid: str, *, text: str | None = None, finish_reason: str | None = None, role: bool = False
) -> bytes:
    """One streamed chunk (OpenAI ``text_completion`` / ``chat.completion.chunk``) as SSE bytes."""
    if req.is_chat:
        delta: dict[str, Any] = {}
        if role:
            delta = {"role": "assistant", "content": ""}
        elif text is not None:
            delta = {"content": text}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    out = {"id": rid, "object": obj, "created": req.created, "model": req.model, "choices": [choice]}
    if req.include_usage:
        out["usage"] = None
    return sse(out)


def usage_chunk(req: GenRequest, rid: str, prompt_tokens: int, completion_tokens: int) -> bytes:
    """The last chunk under ``include_usage``: empty ``choices`` and the usage."""
    obj = "chat.completion.chunk" if req.is_chat else "text_completion"
    return sse(
        {
            "id": rid,
            "object": obj,
            "created": req.created,
            "model": req.model,
            "choices": [],
            "usage": usage(prompt_tokens, completion_tokens),
        }
    )


def generate_finish(reason: str | None, completion_tokens: int, last_token_id: int) -> dict[str, Any] | None:
    """SGLang ``meta_info.finish_reason``: ``{"type": "length", "length": n}``,
    ``{"type": "stop", "matched": token_id}`` or ``{"type": "abort", "message": ...}``."""
    if reason is None:
        return None
    if reason == "length":
        return {"type": "length", "length": completion_tokens}
    if reason == "stop":
        return {"type": "stop", "matched": last_token_id}
    return {"type": reason, "message": "request aborted"}


def generate_body(
    rid: str,
    text: str,
    output_ids: list[int],
    finish_reason: str | None,
    prompt_tokens: int,
    completion_tokens: int,
    e2e_latency: float,
    last_token_id: int = -1,
) -> dict[str, Any]:
    """SGLang ``/generate`` body: ``text``, ``output_ids``, ``meta_info`` (``id``,
    ``finish_reason``, ``prompt_tokens``, ``completion_tokens``, ``cached_tokens``, ``e2e_latency``)."""
    return {
        "text": text,
        "output_ids": output_ids,
        "meta_info": {
            "id": rid,
            "finish_reason": generate_finish(finish_reason, completion_tokens, last_token_id),
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "cached_tokens": 0,
            "e2e_latency": round(e2e_latency, 6),
        },
    }


def error_event(err: OpenAIError) -> bytes:
    """An error inside a 200 SSE stream (SGLang's shape: ``data: {"error": {...}}``)."""
    return sse(err.body())


def models_body(model_names: list[str], context_length: int, created: int) -> dict[str, Any]:
    """``/v1/models``: one entry per served name, each with ``max_model_len`` (vLLM's field)."""
    return {
        "object": "list",
        "data": [
            {
                "id": n,
                "object": "model",
                "created": created,
                "owned_by": "kvgate",
                "root": model_names[0],
                "parent": None,
                "max_model_len": context_length,
            }
            for n in model_names
        ],
    }


def tokenize_body(body: dict[str, Any], counter: PromptEncoder, context_length: int) -> dict[str, Any]:
    """``/v1/tokenize`` in SGLang's shape ``{"tokens", "count", "max_model_len"}``; accepts
    ``prompt`` (string or ids) or ``messages`` (+ ``tools``; ChatML as the chat endpoint)."""
    if body.get("messages") is not None:
        ids = encode_chat(body, counter)
    elif "prompt" in body:
        p = body["prompt"]
        if isinstance(p, str):
            ids = counter.encode_prompt_text(p)
        else:
            ids = _prompt_ids(p, counter)
    else:
        raise bad_request("One of 'prompt' and 'messages' is required.", "prompt")
    return {"tokens": ids, "count": len(ids), "max_model_len": context_length}


def detokenize_body(body: dict[str, Any], counter: PromptEncoder) -> dict[str, Any]:
    """``/v1/detokenize``: ``{"tokens": [ids]}`` -> ``{"text": ...}`` (ids checked)."""
    ids = body.get("tokens")
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise bad_request("'tokens' must be a list of token ids.", "tokens")
    try:
        counter.check_ids(ids, "tokens")
    except TokenizerError as e:
        raise bad_request(e.message, e.param or "tokens") from e
    return {"text": counter.decode(ids)}
