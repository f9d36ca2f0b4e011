"""The bundled engine's ``POST /v1/responses`` (OpenAI Responses API), non-stateful: parsing and
response shaping beside :mod:`gpu_backend.openai_api` (no torch, no engine).

- The prompt is built from ``input``/``instructions``/``tools`` with :mod:`tokenizer.responses`
  (vLLM's item-to-chat mapping, the same code the gateway counts with) and the served model's
  chat template, so ``usage.input_tokens`` equals the gateway's count exactly.
- Stateful features are refused (400 naming the field): ``previous_response_id``,
  ``conversation``, ``background: true``, ``store: true`` (nothing is ever stored here).
- ``max_output_tokens`` bounds the completion (absent: as chat's default).
- A whole answer is a ``response`` object; a stream is the Responses event stream
  (``event: <type>`` + ``data: <json>``): ``response.created``, ``response.in_progress``,
  ``response.output_item.added``, ``response.content_part.added``, ``response.output_text.delta``
  per piece of text, ``response.output_text.done``, ``response.content_part.done``,
  ``response.output_item.done``, then ``response.completed`` (or ``response.incomplete`` with
  ``incomplete_details.reason`` ``max_output_tokens`` when the bound was hit), with ``usage``
  ``{input_tokens, output_tokens, total_tokens}``; an error after the start is an ``error`` event.
  No ``[DONE]`` (the protocol has none). Shapes: the OpenAI API reference, vLLM
  ``serving_responses``.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from typing import Any

import orjson

from config.errors import OpenAIError
from gpu_backend.openai_api import (
    DEFAULT_CHAT_MAX_TOKENS,
    GenRequest,
    _check_model,
    _check_unsupported,
    _int,
    _sampling,
    bad_request,
    check_context,
    encode_chat,
)
from tokenizer.errors import TokenizerError
from tokenizer.responses import responses_to_chat

#: request fields that ask for stored state -> whether the value asks for it
STATEFUL = {
    "previous_response_id": lambda v: v is not None,
    "conversation": lambda v: v is not None,
    "background": lambda v: v is True,
    "store": lambda v: v is True,
}


def _check_text_format(text: Any) -> None:
    """``text.format`` other than plain text (``json_object``, ``json_schema``) asks for structured
    output, which this engine does not apply: a 400 naming it, never free text with a 200."""
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is not None and fmt != {"type": "text"}:
        raise bad_request('\'text.format\' is not supported by this backend; only {"type": "text"}.', "text.format")


def parse_responses(
    body: dict[str, Any], counter: Any, *, context_length: int, model_names: Iterable[str], served_model_name: str
) -> GenRequest:
    """Parse ``/v1/responses`` into a :class:`GenRequest` (``kind`` ``responses``). Raises
    :class:`OpenAIError` 400 naming the field (stateful features, bad input, context)."""
    _check_unsupported(body)
    _check_text_format(body.get("text"))
    model = _check_model(body, model_names, served_model_name)
    for key, asks in STATEFUL.items():
        if asks(body.get(key)):
            raise bad_request(f"'{key}' needs stored state, which this engine does not keep.", key)
    try:
        prompt = responses_to_chat(body.get("input"), body.get("instructions"), body.get("tools"))
    except TokenizerError as e:
        raise bad_request(e.message, e.param or "input") from e
    ids = encode_chat({"messages": prompt.messages, "tools": prompt.tools}, counter)
    max_tokens = _int(body, "max_output_tokens", minimum=1)
    if max_tokens is None:
        max_tokens = max(1, min(DEFAULT_CHAT_MAX_TOKENS, context_length - len(ids)))
    check_context(len(ids), max_tokens, context_length, chat=True)
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise bad_request("'stream' must be a boolean.", "stream")
    return GenRequest("responses", model, ids, _sampling(body, max_tokens), bool(stream), False)


def new_response_id() -> str:
    """``resp_`` + 32 hex digits."""
    return "resp_" + uuid.uuid4().hex


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _message(rid: str, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": []}] if status != "in_progress" else []
    return {"id": "msg_" + rid[5:], "type": "message", "role": "assistant", "status": status, "content": content}


def response_object(
    req: GenRequest,
    rid: str,
    text: str | None,
    finish_reason: str | None,
    prompt_tokens: int,
    completion_tokens: int,
) -> dict[str, Any]:
    """A ``response`` object: ``text`` ``None`` means in progress (no output yet, no usage)."""
    if text is None:
        status, output, usage = "in_progress", [], None
    else:
        status = "incomplete" if finish_reason == "length" else "completed"
        output, usage = [_message(rid, text, "completed")], _usage(prompt_tokens, completion_tokens)
    return {
        "id": rid,
        "object": "response",
        "created_at": req.created,
        "model": req.model,
        "status": status,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "error": None,
        "output": output,
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "store": False,
        "usage": usage,
    }


class ResponseEvents:
    """The events of one streamed response, numbered from 0 (``sequence_number``)."""

    def __init__(self, req: GenRequest, rid: str) -> None:
        self.req, self.rid, self.seq = req, rid, 0
        self.item_id = "msg_" + rid[5:]

    def _event(self, etype: str, **fields: Any) -> bytes:
        data = {"type": etype, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {etype}\ndata: ".encode() + orjson.dumps(data) + b"\n\n"

    def start(self) -> bytes:
        """``response.created`` .. ``response.content_part.added``."""
        resp = response_object(self.req, self.rid, None, None, 0, 0)
        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        return b"".join(
            (
                self._event("response.created", response=resp),
                self._event("response.in_progress", response=resp),
                self._event("response.output_item.added", output_index=0, item=_message(self.rid, "", "in_progress")),
                self._event(
                    "response.content_part.added", **where, part={"type": "output_text", "text": "", "annotations": []}
                ),
            )
        )

    def delta(self, text: str) -> bytes:
        """One ``response.output_text.delta``."""
        return self._event(
            "response.output_text.delta", item_id=self.item_id, output_index=0, content_index=0, delta=text, logprobs=[]
        )

    def finish(self, text: str, finish_reason: str | None, prompt_tokens: int, completion_tokens: int) -> bytes:
        """``response.output_text.done`` .. ``response.completed`` (or ``response.incomplete``)."""
        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        part = {"type": "output_text", "text": text, "annotations": []}
        resp = response_object(self.req, self.rid, text, finish_reason, prompt_tokens, completion_tokens)
        return b"".join(
            (
                self._event("response.output_text.done", **where, text=text, logprobs=[]),
                self._event("response.content_part.done", **where, part=part),
                self._event("response.output_item.done", output_index=0, item=resp["output"][0]),
                self._event(f"response.{resp['status']}", response=resp),
            )
        )

    def error(self, err: OpenAIError) -> bytes:
        """The Responses ``error`` event."""
        e = err.body()["error"]
        return self._event("error", code=e.get("code"), message=e.get("message"), param=e.get("param"))
