"""What an engine's answer says: choices, each choice's text, ``finish_reason``, ``usage``, and
whether it is an error (docs/design.md, "Error bodies"; "Strict mode reads every text-bearing field").

The one place kvgate reads an OpenAI-compatible engine response. The gateway (relay, quota
settle) and the verifier read it; it lives in ``verifier/`` because dependencies point
``gateway -> verifier``.

- :func:`parse_body`: a whole (non-streamed) ``chat.completion`` / ``text_completion`` object.
- :func:`parse_chunk`: the JSON ``data`` of one SSE chunk (``chat.completion.chunk``).
- :func:`parse_response_event` / :func:`parse_response_body`: ``/v1/responses`` stream events and
  whole ``response`` objects (a section of their own, at the end).
- :class:`StreamEvent`: one stream event of either protocol, as the relay reads it
  (:func:`parse_chunk_event` for chat/completions, :func:`parse_response_event`).
- :func:`is_error_payload` / :func:`engine_error`: an engine error object (SGLang flat
  ``{"object":"error",...,"code":400}``, vLLM/OpenAI nested ``{"error":{...}}``, ``/generate``'s
  ``{"error":{"message"}}``, FastAPI's ``{"detail":...}``) as an :class:`~config.errors.OpenAIError`.

Text-bearing fields, each read per choice as its own text stream (the strict guard, the canary
scan, the leak index and the quota's completion count read them; docs/design.md, "Strict mode reads
every text-bearing field"). The key of a stream is ``"<choice index>:<field>"``:

- ``content`` (``message``/``delta``; a list of content parts gives its ``text`` parts here and
  its ``refusal`` parts under ``refusal``), ``reasoning_content`` (DeepSeek, vLLM and SGLang
  reasoning parsers), ``reasoning`` (vLLM's newer name, OpenRouter), ``refusal`` (OpenAI),
  ``audio`` (``audio.transcript``);
- ``tool:<j>:name`` / ``tool:<j>:arguments`` for ``tool_calls[]`` (``j``: the call's ``index``,
  which streamed fragments carry, else its position), ``function_call:name`` /
  ``function_call:arguments`` (the legacy field);
- ``text`` (``/v1/completions``);
- ``logprobs``: the token strings of the sampled tokens (chat ``logprobs.content[].token`` and
  ``logprobs.refusal[].token``, completions ``logprobs.tokens``), read for checking only: they
  repeat the text, so they are not counted as completion text. Alternatives in
  ``top_logprobs`` are not read (they are single tokens at each position, not a text);
- ``logprobs_bytes``: the chat logprobs' ``bytes`` (each token's UTF-8 bytes, what a client
  rebuilds a token's text from) decoded as one text, when any of them is not its token's UTF-8
  (an honest engine's are, but for tokens that end inside a character); checked only;
- ``other``: every string anywhere else in the choice (``"<choice>:other"``) or the object
  (``"-:other"``), outside the known metadata (:data:`META_KEYS`: ids, object, model, role,
  type, finish reason, ...), joined by spaces: an engine that puts text in a field kvgate does
  not know still has it checked. Not counted as completion text.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeGuard

import orjson

from config.errors import ErrorCode, OpenAIError, error_type_for_status
from tokenizer.prompt_text import string_values

#: OpenAI ``error.type`` values passed through from an engine; any other becomes the status's type
OPENAI_ERROR_TYPES = frozenset(
    {
        "invalid_request_error",
        "authentication_error",
        "permission_error",
        "not_found_error",
        "rate_limit_error",
        "server_error",
        "api_error",
    }
)
#: an engine's message is cut to this many characters in the OpenAI error it becomes
MAX_ENGINE_MESSAGE_CHARS = 4000


@dataclass(slots=True)
class EngineOutput:
    """What one body or one chunk carries.

    ``texts``: choice index -> the completion text it holds (whole body) or adds (chunk): every
    countable text-bearing field of the choice joined (``content``, reasoning, ``refusal``, tool
    call names and arguments, ``function_call``, ``text``; not logprobs), in choice order; choices
    without text are absent. ``fields``: the same per text stream, ``"<choice>:<field>"`` -> text
    (module doc), logprob token strings included: what the verifier checks, each on its own.
    ``finish_reason``: the first non-null one among the choices; ``finished``: the indices of the
    choices that carry one. ``usage``: the ``usage`` object
    when it is an object. ``usage_only``: ``choices`` is an empty list and usage is set (the
    ``stream_options.include_usage`` chunk)."""

    texts: dict[int, str] = field(default_factory=dict)
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    usage_only: bool = False
    fields: dict[str, str] = field(default_factory=dict)
    finished: tuple[int, ...] = ()

    @property
    def text(self) -> str:
        """Every choice's (or output's) text joined, in order."""
        return "".join(self.texts.values())


class _NoSnapshots(Mapping[str, str]):
    """The empty, read-only (and so shareable) ``snapshots`` of an event that repeats no text."""

    __slots__ = ()
    __hash__ = object.__hash__

    def __getitem__(self, key: str) -> str:
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        return iter(())

    def __len__(self) -> int:
        return 0


_NO_SNAPSHOTS: Mapping[str, str] = _NoSnapshots()


@dataclass(slots=True)
class StreamEvent(EngineOutput):
    """One SSE event of either stream protocol (chat/completions chunks, Responses events), or a
    whole Responses answer: what :class:`EngineOutput` says, and ``kind``:

    - ``chunk`` (a chat/completions chunk), ``text`` (a Responses text delta), ``terminal``
      (``response.completed`` / ``incomplete``; a whole answer), ``snapshot`` (an event that
      repeats text), ``other`` (no data, not JSON, nothing known), ``lenient`` (JSON that orjson
      refuses and a client's laxer reader takes: the relay ends the stream there);
    - ``done``: chat's ``data: [DONE]``;
    - ``error``: an engine error (an error object in chat; an ``error`` event, ``response.failed``
      or an error body in Responses); ``error`` holds its fields (``message``, ``code``,
      ``param``, ``type``), which ``engine_error(200, {"error": error})`` maps.

    ``sequence_number``: a Responses event's number, when it has one. ``snapshots``: the whole
    text so far that a Responses event repeats (``*.done``, ``*.added``, the ``response`` of
    ``response.created`` / ``response.completed`` ...), keyed as ``fields``: an honest engine
    repeats exactly its deltas, so the relay checks a snapshot only where it differs from them (a
    hostile engine could put text there alone). Empty (and read-only) for chat. A Responses
    text stream's key is ``"<output index>:<part index>:<name>"`` (names: ``output_text``,
    ``refusal``, ``reasoning``, ``reasoning_summary``, ``arguments``, ...); its ``usage`` is given
    in chat names."""

    kind: str = "other"
    error: dict[str, Any] | None = None
    sequence_number: int | None = None
    snapshots: Mapping[str, str] = _NO_SNAPSHOTS

    @property
    def starts(self) -> bool:
        """The event starts the client's response: it carries text or ends the answer (a
        finish reason, a terminal Responses event)."""
        return bool(self.texts or self.finish_reason) or self.kind == "terminal"


#: reasoning and refusal fields of a ``message`` / ``delta``, read as they are named
_PLAIN_FIELDS = ("reasoning_content", "reasoning", "refusal")
#: keys whose string values are metadata, not text (OpenAI's chat/completions objects, vLLM's
#: and SGLang's additions); any other string is read as ``other`` text
META_KEYS = frozenset(
    {
        "id",
        "object",
        "created",
        "model",
        "system_fingerprint",
        "service_tier",
        "role",
        "type",
        "finish_reason",
        "stop_reason",
        "index",
        "expires_at",
        "data",  # audio.data: base64 audio, not text
        "bytes",
    }
)
#: keys of a choice / message / delta read as named fields (not ``other``)
_CHOICE_KNOWN = frozenset({"message", "delta", "text", "logprobs", "index", "finish_reason", "stop_reason"})
_MESSAGE_KNOWN = frozenset(
    {"content", "reasoning_content", "reasoning", "refusal", "audio", "tool_calls", "function_call", "role"}
)
#: keys not read as ``other`` text: of a choice, of a message / delta, of the object
_CHOICE_SKIP = _CHOICE_KNOWN | META_KEYS
_MESSAGE_SKIP = _MESSAGE_KNOWN | META_KEYS
_TOP_SKIP = META_KEYS | {"choices", "usage"}


def _strings(obj: Any, out: list[str]) -> None:
    """Every string value in ``obj`` outside :data:`META_KEYS`, at any depth."""
    string_values(obj, out, META_KEYS)


def _unknown_strings(choice: dict[str, Any], holder: str) -> list[str]:
    """Strings of a choice outside the fields :func:`_choice_fields` reads and the metadata."""
    out: list[str] = []
    for k, v in choice.items():
        if k not in _CHOICE_SKIP:
            _strings(v, out)
    inner = choice.get(holder)
    if isinstance(inner, dict):
        _message_unknown_strings(inner, out)
    return out


def _message_unknown_strings(inner: dict[str, Any], out: list[str]) -> None:
    """The strings of a ``message`` / ``delta`` outside its named fields: unknown keys, content
    parts' other keys, tool calls' other keys (their ``function``'s too)."""
    for k, v in inner.items():
        if k not in _MESSAGE_SKIP:
            _strings(v, out)
    content = inner.get("content")
    if isinstance(content, list):  # parts other than text / refusal (their other strings)
        for p in content:
            if isinstance(p, dict):
                _strings({k: v for k, v in p.items() if k not in ("text", "refusal")}, out)
    calls = inner.get("tool_calls")
    for tc in calls if isinstance(calls, list) else ():
        if isinstance(tc, dict):
            _strings({k: v for k, v in tc.items() if k != "function"}, out)
            fn = tc.get("function")
            if isinstance(fn, dict):
                _strings({k: v for k, v in fn.items() if k not in ("name", "arguments")}, out)


def _is_index(v: Any) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


#: one text stream of a choice: ``(field, text, counted as completion text)``
_Field = tuple[str, str, bool]


def _choice_fields(choice: dict[str, Any], holder: str) -> list[_Field]:
    """``(field, text, counted)`` of one choice, in a fixed order; only string values (an empty
    string included). ``holder``: ``message`` (whole) or ``delta`` (chunk)."""
    out: list[_Field] = []
    inner = choice.get(holder)
    if isinstance(inner, dict):
        _message_fields(inner, out)
    elif isinstance(choice.get("text"), str):
        out.append(("text", choice["text"], True))
    lp = choice.get("logprobs")
    if isinstance(lp, dict):
        _logprob_fields(lp, out)
    return out


def _message_fields(inner: dict[str, Any], out: list[_Field]) -> None:
    """A ``message`` / ``delta``'s text streams: content (and its parts), reasoning, refusal,
    the audio transcript, tool calls, the legacy ``function_call``."""
    content = inner.get("content")
    if isinstance(content, str):
        out.append(("content", content, True))
    elif isinstance(content, list):
        _content_part_fields(content, out)
    for name in _PLAIN_FIELDS:
        v = inner.get(name)
        if isinstance(v, str):
            out.append((name, v, True))
    audio = inner.get("audio")
    if isinstance(audio, dict) and isinstance(audio.get("transcript"), str):
        out.append(("audio", audio["transcript"], True))
    calls = inner.get("tool_calls")
    if isinstance(calls, list):
        _tool_call_fields(calls, out)
    fc = inner.get("function_call")
    if isinstance(fc, dict):
        _function_fields(fc, "function_call", out)


def _content_part_fields(content: list[Any], out: list[_Field]) -> None:
    """A list of content parts: its ``text`` parts as ``content``, its ``refusal`` parts as ``refusal``."""
    texts = [p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)]
    refusals = [p["refusal"] for p in content if isinstance(p, dict) and isinstance(p.get("refusal"), str)]
    if texts:
        out.append(("content", "".join(texts), True))
    if refusals:
        out.append(("refusal", "".join(refusals), True))


def _tool_call_fields(calls: list[Any], out: list[_Field]) -> None:
    """``tool:<j>:name`` / ``tool:<j>:arguments`` of each tool call (``j``: its ``index``, else its position)."""
    for pos, tc in enumerate(calls):
        if not isinstance(tc, dict):
            continue
        fn = tc.get("function")
        if isinstance(fn, dict):
            j = tc.get("index") if _is_index(tc.get("index")) else pos
            _function_fields(fn, f"tool:{j}", out)


def _function_fields(fn: dict[str, Any], prefix: str, out: list[_Field]) -> None:
    for part in ("name", "arguments"):
        if isinstance(fn.get(part), str):
            out.append((f"{prefix}:{part}", fn[part], True))


def _logprob_fields(lp: dict[str, Any], out: list[_Field]) -> None:
    """The sampled tokens' strings of a choice's ``logprobs`` (chat ``content`` / ``refusal``
    entries, completions ``tokens``), as one ``logprobs`` stream, not counted."""
    tokens: list[str] = []
    raw: list[bytes] = []
    differs = False
    for key in ("content", "refusal"):  # chat: [{"token", "logprob", "bytes", "top_logprobs"}]
        items = lp.get(key)
        if isinstance(items, list):
            for t in items:
                if not isinstance(t, dict):
                    continue
                tok = t.get("token")
                if isinstance(tok, str):
                    tokens.append(tok)
                b = _token_bytes(t.get("bytes"))
                if b is not None:
                    raw.append(b)
                    differs = differs or not isinstance(tok, str) or b != tok.encode("utf-8", "replace")
    items = lp.get("tokens")  # completions: ["tok", ...]
    if isinstance(items, list):
        tokens += [t for t in items if isinstance(t, str)]
    if tokens:
        out.append(("logprobs", "".join(tokens), False))
    if differs:
        out.append(("logprobs_bytes", b"".join(raw).decode("utf-8", "replace"), False))


def _token_bytes(v: Any) -> bytes | None:
    """A chat logprob's ``bytes`` (the token's UTF-8 bytes, a list of ints 0-255) as bytes, or
    ``None`` when it is not such a list."""
    if not isinstance(v, list) or not all(_is_index(x) and 0 <= x <= 255 for x in v):
        return None
    return bytes(v)


def _parse(obj: Any, holder: str, keep_empty: bool, out: EngineOutput) -> EngineOutput:
    """Fill ``out`` from a body or chunk ``obj`` (``holder``: ``message`` or ``delta``;
    ``keep_empty``: empty strings are read as texts too)."""
    if not isinstance(obj, dict):
        return out
    choices = obj.get("choices")
    if isinstance(choices, list):
        position = 0
        for c in choices:
            if isinstance(c, dict):
                i = c.get("index")
                _add_choice(out, c, i if _is_index(i) else position, holder, keep_empty)
                position += 1
    top: list[str] = []
    for k, v in obj.items():
        if k not in _TOP_SKIP:
            _strings(v, top)
    if top:
        out.fields["-:other"] = " ".join(top)
    usage = obj.get("usage")
    if isinstance(usage, dict):
        out.usage = usage
        out.usage_only = isinstance(choices, list) and not choices
    return out


def _add_choice(out: EngineOutput, c: dict[str, Any], key: int, holder: str, keep_empty: bool) -> None:
    """One choice's texts, fields and finish reason into ``out`` (a repeated index adds to its streams)."""
    for name, t, counted in _choice_fields(c, holder):
        if not t and not keep_empty:
            continue
        fk = f"{key}:{name}"
        out.fields[fk] = out.fields.get(fk, "") + t
        if counted:
            out.texts[key] = out.texts.get(key, "") + t
    other = _unknown_strings(c, holder)
    if other:
        fk = f"{key}:other"
        out.fields[fk] = out.fields.get(fk, "") + " ".join(other)
    reason = c.get("finish_reason")
    if isinstance(reason, str):
        out.finished += (key,)
        if out.finish_reason is None:
            out.finish_reason = reason


def parse_body(obj: Any) -> EngineOutput:
    """A whole response object (already JSON-decoded) as :class:`EngineOutput`; never raises on
    odd shapes (a non-object, choices that are not objects, non-string texts read as absent).
    A choice's index is its ``index`` field when it is an int, else its position."""
    return _parse(obj, "message", True, EngineOutput())


def parse_chunk(obj: Any) -> EngineOutput:
    """One SSE chunk's ``data`` object (already JSON-decoded) as :class:`EngineOutput`: the text
    each choice adds, per field (the ``delta``'s fields or ``text``; empty strings left out; a
    streamed tool call's ``arguments`` fragments add to the same ``tool:<j>:arguments``
    stream). Never raises."""
    return _parse(obj, "delta", False, EngineOutput())


def parse_chunk_event(obj: Any) -> StreamEvent:
    """One chat/completions SSE event's ``data`` (already JSON-decoded) as a :class:`StreamEvent`:
    ``error`` (with the error's fields) for an engine error object (:func:`is_error_payload`),
    ``other`` for a JSON value that is not an object, else ``chunk`` (:func:`parse_chunk`'s
    reading). Never raises."""
    if not isinstance(obj, dict):
        return StreamEvent()
    if is_error_payload(obj):
        return StreamEvent(kind="error", error=_error_fields(obj))
    out = StreamEvent(kind="chunk")
    _parse(obj, "delta", False, out)
    return out


def is_error_payload(obj: Any) -> bool:
    """An engine error object: OpenAI/vLLM ``{"error": ...}`` (without ``choices``) or SGLang
    ``{"object": "error"}``."""
    return isinstance(obj, dict) and ("error" in obj and "choices" not in obj or obj.get("object") == "error")


def _error_fields(data: Any) -> dict[str, Any]:
    if not isinstance(data, dict):
        return {}
    err = data.get("error")
    if isinstance(err, dict):
        return err
    if isinstance(err, str):
        return {"message": err}
    if data.get("object") == "error" or "message" in data:
        return data
    if "detail" in data:
        return {"message": str(data["detail"])}
    return {}


def _relayed_status(status: int) -> bool:
    return 400 <= status <= 599 and status != 499


def engine_error(status: int, body: bytes | Any) -> OpenAIError:
    """An engine's error answer as an :class:`OpenAIError`.

    ``status``: the engine's HTTP status, kept when it is 4xx or 5xx but 499 (the gateway's own
    for a client that went away); below 400 (an error event inside a 200 stream, or an error
    object in a 200 body) the error's numeric ``code`` when it is such a status; else 502 (an
    engine's 600 or 999 was a 500 of the server layer, which knows no such status line).
    ``body``: the raw bytes or an already parsed object. The engine's ``message`` (cut to
    :data:`MAX_ENGINE_MESSAGE_CHARS`), string ``code`` and ``param`` are kept; an OpenAI ``type``
    is kept, any other is replaced by the status's. A message naming "maximum context length"
    without a code gets ``context_length_exceeded``."""
    data = body
    if isinstance(body, (bytes, bytearray)):
        try:
            data = orjson.loads(body)
        except orjson.JSONDecodeError:
            data = _first_event_data(body)
    e = _error_fields(data)
    message = e.get("message")
    if not isinstance(message, str) or not message:
        text = bytes(body[:500]).decode("utf-8", "replace") if isinstance(body, (bytes, bytearray)) else ""
        message = f"The upstream engine answered {status}" + (f": {text}" if text.strip() else ".")
    raw_code = e.get("code")
    if not _relayed_status(status):
        status = raw_code if status < 400 and isinstance(raw_code, int) and _relayed_status(raw_code) else 502
    code = raw_code if isinstance(raw_code, str) and raw_code else None
    if code is None and "maximum context length" in message:
        code = ErrorCode.CONTEXT_LENGTH_EXCEEDED
    etype = e.get("type")
    if etype not in OPENAI_ERROR_TYPES:
        etype = error_type_for_status(status)
    param = e.get("param") if isinstance(e.get("param"), str) else None
    return OpenAIError(status, message[:MAX_ENGINE_MESSAGE_CHARS], code=code, param=param, type=etype, from_engine=True)


def _first_event_data(body: bytes | bytearray) -> Any:
    """The JSON ``data`` of the first event when ``body`` is an event stream (an engine answering
    a stream request's error as ``data: {"error": ...}`` under a 4xx/5xx status, whose message
    was the raw ``data:`` line); else ``None``. Lines end at CRLF, LF or CR (WHATWG)."""
    lines: list[bytes] = []
    for line in re.split(rb"\r\n|\n|\r", bytes(body[: MAX_ENGINE_MESSAGE_CHARS * 4])):
        if not line:
            if lines:
                break
        elif line.startswith(b"data:"):
            lines.append(line[6:] if line.startswith(b"data: ") else line[5:])
    try:
        return orjson.loads(b"\n".join(lines)) if lines else None
    except orjson.JSONDecodeError:
        return None


_CODE = re.compile(r"[a-z0-9_]{1,64}")


def strict_view(err: OpenAIError) -> OpenAIError:
    """What a tenant with strict verification is told of an engine's error ``err``: its status
    and type, its code when it is a plain identifier (``context_length_exceeded``), and a message
    of the gateway's own. The engine's message and param are text no verifier checked, and an
    engine that mixed up requests can put another tenant's prompt there as well as in an answer."""
    code = err.code if err.code is not None and _CODE.fullmatch(err.code) else None
    message = (
        f"The upstream engine answered an error ({err.status}); its message is not shown under strict verification."
    )
    return OpenAIError(err.status, message, code=code, type=err.type or error_type_for_status(err.status))


# ------------------------------------------------------------------ /v1/responses
# The Responses API (OpenAI; vLLM ``serving_responses``), kept apart from the chat parsers above.
# Text read (strict mode and the leak index read it all): output text
# (``response.output_text.delta``; ``output_text`` parts), refusals (``response.refusal.delta``),
# reasoning (``response.reasoning_text.delta``, ``response.reasoning_summary_text.delta``;
# reasoning items' ``content`` and ``summary``) and function-call arguments
# (``response.function_call_arguments.delta``; ``function_call`` items' ``arguments``), keyed by
# ``output_index`` (a body's item position). Usage (``input_tokens`` / ``output_tokens``) is given
# back in the chat names (``prompt_tokens`` / ``completion_tokens`` / ``total_tokens``) that quotas
# and the verifier read. How it ended: ``response.completed`` / status ``completed`` ->
# ``finish_reason`` ``stop``, ``response.incomplete`` -> ``length`` (or the
# ``incomplete_details.reason`` when it is another), ``response.failed`` and ``error`` events -> an
# error.

#: stream event types whose ``delta`` is text the response carries -> the text stream's name
TEXT_DELTA_EVENTS = {
    "response.output_text.delta": "output_text",
    "response.refusal.delta": "refusal",
    "response.reasoning_text.delta": "reasoning",
    "response.reasoning_summary_text.delta": "reasoning_summary",
    "response.function_call_arguments.delta": "arguments",
    "response.custom_tool_call_input.delta": "input",
    "response.mcp_call_arguments.delta": "arguments",
    "response.code_interpreter_call_code.delta": "code",
    "response.audio.transcript.delta": "transcript",
}
#: terminal events -> the finish reason they mean (``None``: failed)
TERMINAL_EVENTS = {"response.completed": "stop", "response.incomplete": "length", "response.failed": None}
#: string values that are protocol metadata in Responses items and events (ids, enums), besides
#: :data:`META_KEYS`; every other string is read as text (a function's ``name`` is text)
RESPONSE_META_KEYS = META_KEYS | {
    "call_id",
    "item_id",
    "status",
    "encrypted_content",
    "previous_response_id",
    "truncation",
    "created_at",
    "obfuscation",  # random padding OpenAI adds to stream deltas
}
#: text streams that are completion text (counted as the response's output); the others
#: (``logprobs``, ``annotations``, ``other``) are checked only, as chat's logprobs and ``other``
COUNTED_STREAMS = frozenset(
    {"output_text", "refusal", "reasoning", "reasoning_summary", "arguments", "name", "input", "code", "transcript"}
)


def _rstrings(obj: Any) -> str:
    """Every string in ``obj`` outside :data:`RESPONSE_META_KEYS`, joined by spaces."""
    out: list[str] = []
    if isinstance(obj, dict):
        obj = {k: v for k, v in obj.items() if k not in RESPONSE_META_KEYS}
    string_values(obj, out, RESPONSE_META_KEYS)
    return " ".join(out)


def _logprob_tokens(lp: Any) -> str:
    """The sampled tokens' strings of a Responses ``logprobs`` list (``[{"token", "logprob",
    "top_logprobs"}]``); alternatives are not read (as chat)."""
    if not isinstance(lp, list):
        return ""
    return "".join(t["token"] for t in lp if isinstance(t, dict) and isinstance(t.get("token"), str))


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _sequence_number(v: Any) -> int | None:
    """A Responses event's ``sequence_number`` when it is an int from 0 to ``2**63 - 2``, else
    ``None`` (read as absent): the gateway numbers an event of its own after the last one
    (:func:`gateway.relay.stream_protocol.response_error_event`) and must be able to write that
    number as a JSON int (orjson writes 64 bits). After an engine's ``2**64 - 1`` it could not:
    the error event that ends a cut stream raised instead."""
    n = _int(v)
    return n if n is not None and 0 <= n < 2**63 - 1 else None


def response_usage(usage: Any) -> dict[str, Any] | None:
    """A Responses ``usage`` (``input_tokens``, ``output_tokens``) in chat names; ``None`` unless
    both are non-negative ints."""
    if not isinstance(usage, dict):
        return None
    it, ot = _int(usage.get("input_tokens")), _int(usage.get("output_tokens"))
    if it is None or ot is None or it < 0 or ot < 0:
        return None
    return {"prompt_tokens": it, "completion_tokens": ot, "total_tokens": it + ot}


def _put(out: dict[str, str], key: str, text: str) -> None:
    if text:
        out[key] = out[key] + " " + text if key in out else text


#: a content part's keys read by name (the rest of its strings are its ``other`` text)
_PART_KEYS = frozenset({"text", "refusal", "annotations", "logprobs"})
#: item types whose named string fields are streams of their own -> those fields
_ITEM_STRINGS = {
    "function_call": ("arguments", "name"),
    "custom_tool_call": ("input", "name"),
    "mcp_call": ("arguments", "name", "output"),
    "code_interpreter_call": ("code",),
}


def _part_fields(part: dict[str, Any], index: int, j: int, name: str, out: dict[str, str]) -> None:
    """One content part's text streams: its text (or refusal) under ``name``, the strings of
    its ``annotations`` (titles, URLs), its ``logprobs`` tokens, and every other string."""
    refusal = part.get("type") == "refusal"
    t = part.get("refusal") if refusal else part.get("text")
    if isinstance(t, str) and t:
        out[f"{index}:{j}:{'refusal' if refusal and name == 'output_text' else name}"] = t
    _put(out, f"{index}:{j}:annotations", _rstrings(part.get("annotations")))
    _put(out, f"{index}:{j}:logprobs", _logprob_tokens(part.get("logprobs")))
    _put(out, f"{index}:{j}:other", _rstrings({k: v for k, v in part.items() if k not in _PART_KEYS}))


def _item_fields(item: Any, index: int) -> dict[str, str]:
    """The text streams of one output item (see :attr:`StreamEvent.fields`): the named
    fields of its type, its content parts, and every other string (``"<index>:other"``): an
    item type kvgate does not know is read whole."""
    out: dict[str, str] = {}
    if isinstance(item, str):
        _put(out, f"{index}:other", item)
        return out
    if not isinstance(item, dict):
        return out
    itype = item.get("type")
    named = _ITEM_STRINGS.get(str(itype), ())
    for key in named:
        v = item.get(key)
        if isinstance(v, str) and v:
            out[f"{index}:0:{key}"] = v
    keys = (("content", "reasoning"), ("summary", "reasoning_summary")) if itype == "reasoning" else (("content", ""),)
    read = set(named)
    for key, name in keys:
        parts = item.get(key)
        if not isinstance(parts, list):
            continue
        read.add(key)
        for j, p in enumerate(parts):
            if isinstance(p, dict):
                _part_fields(p, index, j, name or "output_text", out)
            else:
                _put(out, f"{index}:other", _rstrings(p))
    _put(out, f"{index}:other", _rstrings({k: v for k, v in item.items() if k not in read}))
    return out


def _counted(fields: dict[str, str]) -> str:
    """The completion text of some text streams (:data:`COUNTED_STREAMS`), in their order."""
    return "".join(t for k, t in fields.items() if k.rsplit(":", 1)[-1] in COUNTED_STREAMS)


def _finish_of(resp: dict[str, Any]) -> str | None:
    status = resp.get("status")
    if status == "completed":
        return "stop"
    if status == "incomplete":
        details = resp.get("incomplete_details")
        reason = details.get("reason") if isinstance(details, dict) else None
        return "length" if reason in (None, "max_output_tokens") else str(reason)
    return None


def is_response_error(obj: Any) -> bool:
    """A whole answer that is an error: an ``error`` object (or string) while no ``output`` list
    is present, or ``status: "failed"``, or SGLang's flat ``{"object": "error"}``. (A successful
    ``response`` object carries ``"error": null``.)"""
    if not isinstance(obj, dict):
        return False
    if obj.get("object") == "error" or obj.get("status") == "failed":
        return True
    return obj.get("error") is not None and not isinstance(obj.get("output"), list)


def parse_response_body(obj: Any) -> StreamEvent:
    """A whole ``response`` object: each output item's text, usage, finish reason; ``kind``
    ``error`` (with ``error``) for :func:`is_response_error` bodies. Never raises."""
    out = StreamEvent(kind="terminal")
    if not isinstance(obj, dict):
        return StreamEvent()
    if is_response_error(obj):
        err = obj.get("error")
        return StreamEvent(kind="error", error=err if isinstance(err, dict) else {"message": err} if err else obj)
    items = obj.get("output")
    for i, item in enumerate(items if isinstance(items, list) else ()):
        f = _item_fields(item, i)
        out.fields.update(f)
        if text := _counted(f):
            out.texts[i] = text
    _put(out.fields, "-:other", _rstrings({k: v for k, v in obj.items() if k not in ("output", "usage", "error")}))
    out.usage = response_usage(obj.get("usage"))
    out.finish_reason = _finish_of(obj)
    return out


def parse_response_event(obj: Any) -> StreamEvent:
    """One stream event's ``data`` (already JSON-decoded). Every string it carries outside the
    metadata is read: the text delta events' ``delta`` (and ``logprobs`` tokens) as new text;
    what an event repeats (``*.done``, ``*.added``, the ``response`` object) as snapshots; any
    other string (an annotation, a field or an event type kvgate does not know) as new text of
    the stream ``"<output index>:other"`` (``"<output index>:<part>:annotations"`` for
    ``response.output_text.annotation.added``). Never raises on odd shapes."""
    if not isinstance(obj, dict):
        return StreamEvent()
    etype = obj.get("type")
    if etype is not None and not isinstance(etype, str):
        etype = ""  # an array or object as the type (unhashable in the tables below): a type no engine sends
    seq = _sequence_number(obj.get("sequence_number"))
    if etype == "error" or (etype is None and obj.get("error") is not None):
        err = obj.get("error") if isinstance(obj.get("error"), dict) else obj
        return StreamEvent(kind="error", error=err, sequence_number=seq)
    i = _int(obj.get("output_index"))
    i = 0 if i is None else i
    j = _int(obj.get("content_index", obj.get("summary_index")))
    j = 0 if j is None else j
    if etype in TEXT_DELTA_EVENTS:
        return _delta_event(obj, str(etype), i, j, seq)
    snaps, read = _snapshots(obj, etype)
    fields: dict[str, str] = {}
    if etype == "response.output_text.annotation.added":
        read.add("annotation")
        _put(fields, f"{i}:{j}:annotations", _rstrings(obj.get("annotation")))
    _put(fields, f"{i}:other", _rstrings({k: v for k, v in obj.items() if k not in read}))
    if etype in TERMINAL_EVENTS:
        got = obj.get("response")
        resp = got if isinstance(got, dict) else {}
        if etype == "response.failed":
            err = resp.get("error")
            return StreamEvent(kind="error", error=err if isinstance(err, dict) else {}, sequence_number=seq)
        finish = _finish_of(resp) or TERMINAL_EVENTS[etype]
        usage = response_usage(resp.get("usage"))
        return StreamEvent(
            kind="terminal", finish_reason=finish, usage=usage, sequence_number=seq, snapshots=snaps, fields=fields
        )
    kind = "snapshot" if snaps else "other"
    return StreamEvent(kind=kind, sequence_number=seq, snapshots=snaps, fields=fields)


def _delta_event(obj: dict[str, Any], etype: str, i: int, j: int, seq: int | None) -> StreamEvent:
    """A text delta event: its ``delta`` (text, counted), its ``logprobs`` tokens and any other
    string it carries (checked only)."""
    fields: dict[str, str] = {}
    d = obj.get("delta")
    name = TEXT_DELTA_EVENTS[etype]
    texts: dict[int, str] = {}
    if isinstance(d, str) and d:
        fields[f"{i}:{j}:{name}"] = d
        texts[i] = d
    _put(fields, f"{i}:{j}:logprobs", _logprob_tokens(obj.get("logprobs")))
    _put(fields, f"{i}:other", _rstrings({k: v for k, v in obj.items() if k not in ("delta", "logprobs")}))
    return StreamEvent(texts, kind="text" if texts else "other", sequence_number=seq, fields=fields)


#: ``*.done`` events that repeat one text stream whole: event type -> (its text field, stream name)
_DONE_TEXT = {
    "response.output_text.done": ("text", "output_text"),
    "response.refusal.done": ("refusal", "refusal"),
    "response.reasoning_text.done": ("text", "reasoning"),
    "response.reasoning_summary_text.done": ("text", "reasoning_summary"),
    "response.function_call_arguments.done": ("arguments", "arguments"),
    "response.custom_tool_call_input.done": ("input", "input"),
    "response.mcp_call_arguments.done": ("arguments", "arguments"),
    "response.code_interpreter_call_code.done": ("code", "code"),
    "response.audio.transcript.done": ("transcript", "transcript"),
}
_PART_NAMES = {"output_text": "output_text", "refusal": "refusal", "reasoning_text": "reasoning"}


def _snapshots(obj: dict[str, Any], etype: Any) -> tuple[dict[str, str], set[str]]:
    """The texts an event repeats (see :attr:`StreamEvent.snapshots`) and the event keys
    read for them (with the metadata); never raises."""
    i = _int(obj.get("output_index"))
    i = 0 if i is None else i
    j = _int(obj.get("content_index", obj.get("summary_index")))
    j = 0 if j is None else j
    read = {"type"}
    out: dict[str, str] = {}
    if etype in _DONE_TEXT:
        key, name = _DONE_TEXT[etype]
        t = obj.get(key)
        read.add(key)
        if isinstance(t, str) and t:
            out[f"{i}:{j}:{name}"] = t
        if etype == "response.output_text.done":
            read.add("logprobs")
            _put(out, f"{i}:{j}:logprobs", _logprob_tokens(obj.get("logprobs")))
        return out, read
    part = obj.get("part")
    if isinstance(part, dict):  # content_part.* / reasoning_summary_part.*
        read.add("part")
        name = "reasoning_summary" if "summary_index" in obj else _PART_NAMES.get(str(part.get("type")), "output_text")
        _part_fields(part, i, j, name, out)
        return out, read
    item = obj.get("item")
    if "item" in obj:  # output_item.*
        read.add("item")
        return _item_fields(item, i), read
    resp = obj.get("response")
    if isinstance(resp, dict):  # response.created / in_progress / completed ...
        read.add("response")
        output = resp.get("output")
        for k, it in enumerate(output if isinstance(output, list) else ()):
            out.update(_item_fields(it, k))
        rest = {key: v for key, v in resp.items() if key not in ("output", "usage", "error", "incomplete_details")}
        _put(out, "-:response", _rstrings(rest))
    return out, read
