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
- ``text`` (``/v1/completions``; read beside a ``message`` / ``delta`` too);
- ``logprobs``: the token strings of the sampled tokens (chat ``logprobs.content[].token`` and
  ``logprobs.refusal[].token``, completions ``logprobs.tokens``), read for checking only: they
  repeat the text, so they are not counted as completion text;
- ``logprobs_bytes``: the chat logprobs' ``bytes`` (each token's UTF-8 bytes, what a client
  rebuilds a token's text from) decoded as one text, when any of them is not its token's UTF-8
  (an honest engine's are, but for tokens that end inside a character); checked only;
- ``logprobs_top:<r>`` (and ``logprobs_top_bytes:<r>``): the rank-``r`` alternatives of
  ``top_logprobs`` at each position (chat entries, completions' ``{token: logprob}`` keys),
  joined; checked only. A client receives them as it does the sampled tokens, and the second
  most likely token at each position spelled another tenant's prompt unread before
  (OpenAI's ``ChatCompletionTokenLogprob.top_logprobs``; vLLM
  ``vllm/entrypoints/openai/protocol.py``, ``ChatCompletionLogProbsContent.top_logprobs``);
- ``other``: every other string of the choice (``"<choice>:other"``) or the object
  (``"-:other"``), joined by spaces: a field kvgate does not know, at any depth; a known field
  holding another type than the protocol's (a ``message`` that is a string, a ``content`` that
  is an object, ``arguments`` that are an object: a client still receives them); a choice that
  is not an object; ``usage``'s strings; a chunk's ``message`` (a body's ``delta``); and key
  names that are not identifiers (:data:`_IDENTIFIER`). Not counted as completion text. Only
  the protocol's metadata, where it sits (ids, ``object``, ``model``, ``created``, ``role``,
  a tool call's ``type``, ``index``, ``finish_reason``, ``stop_reason``, a content part's
  ``type``, the audio's ``id`` / ``data``), is not text, and only while it is as short as
  metadata (:data:`META_MAX_CHARS`): before, those keys were skipped at any depth and any
  length, so an unknown field's ``{"id": ...}`` entries or a ``model`` holding a prompt went
  unread. In a chat stream a metadata value is metadata only while it repeats the stream's
  first value of its field (:class:`StreamMeta`, which the relay keeps): a changed value is
  text, of the stream ``"-:<field>"`` (``"-:system_fingerprint"``, ``"-:choices.finish_reason"``).
- canaries: a string read as none of the above (a metadata value, the audio's base64 ``data``,
  a Responses ``encrypted_content``, a key name that is an identifier) is ``other`` text when it
  holds a canary (:func:`has_canary`), whatever its length: a client receives it.

A choice's index is its ``index`` when it is an integer (JSON's ``1.0`` included: the same number
to every client), else its position.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeGuard

import orjson

from config.errors import ErrorCode, OpenAIError, error_type_for_status
from tokenizer.json_values import string_values
from verifier.canary import CANARY_PREFIX, CANARY_RE, canary_text

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
      repeats text), ``other`` (no data, blank data, nothing known), ``lenient`` (JSON that orjson
      refuses and a client's laxer reader takes), ``not_json`` (text no JSON reader takes: the
      relay ends the stream at either);
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
    in chat names. ``meta``: a chat chunk's metadata strings not read as text (ids, ``model``,
    ``system_fingerprint``, a role, a finish reason, ... of at most :data:`META_MAX_CHARS`), as
    ``(name, value)``, which the relay holds against the stream's first values
    (:class:`StreamMeta`); empty otherwise (a Responses event's are read for canaries where they
    are)."""

    kind: str = "other"
    error: dict[str, Any] | None = None
    sequence_number: int | None = None
    snapshots: Mapping[str, str] = _NO_SNAPSHOTS
    meta: Sequence[tuple[str, str]] = ()

    @property
    def starts(self) -> bool:
        """The event starts the client's response: it carries text or ends the answer (a
        finish reason, a terminal Responses event)."""
        return bool(self.texts or self.finish_reason) or self.kind == "terminal"


#: reasoning and refusal fields of a ``message`` / ``delta``, read as they are named
_PLAIN_FIELDS = ("reasoning_content", "reasoning", "refusal")
#: keys whose string values are metadata, not text, in the ``/v1/responses`` objects (at the top
#: of an item, a part or an event: :func:`_rstrings`); chat's metadata is read by where it sits
#: (the ``_*_META`` sets below)
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
#: a metadata value (an id, a model name, a role, a type, a finish reason) longer than this is
#: read as text: no honest id or name is that long, and a client receives whatever an engine
#: puts there (a ``model`` of 1,100 characters holding another tenant's prompt was skipped)
META_MAX_CHARS = 256


def _named(where: str, *keys: str) -> dict[str, str]:
    """Metadata keys of one place of a chat object -> the name a stream remembers each value
    under, which is also the text stream a changed value is checked as (:class:`StreamMeta`)."""
    return {k: f"-:{where}{k}" for k in keys}


#: metadata of a chat/completions object, by where it sits (OpenAI's objects; vLLM's and
#: SGLang's additions are read as text): every other string, at any depth, is text. Each key maps
#: to the name :class:`StreamMeta` remembers a stream's value under.
_TOP_META = _named("", "id", "object", "created", "model", "system_fingerprint", "service_tier")
_CHOICE_META = _named("choices.", "index", "finish_reason", "stop_reason")
_MESSAGE_META = _named("message.", "role")
_TOOL_META = _named("tool_calls.", "id", "type", "index")
_PART_META = _named("content.", "type")
_AUDIO_META = _named("audio.", "id", "expires_at")
_NO_META: dict[str, str] = {}
#: the read type (:func:`_rest`) of a string that is opaque data, not text (base64 audio,
#: encrypted state), whatever its length: read only for canaries
_OPAQUE_STR: tuple[type, ...] = (str,)
#: keys read by name, with the type the named reader reads (a value of another type is read as
#: ``other`` text: an engine whose ``content`` is an object, or whose ``arguments`` are, still has
#: it checked); a key absent here is text or metadata
_CHOICE_READ: dict[str, dict[str, type | tuple[type, ...]]] = {
    holder: {holder: dict, "text": str, "logprobs": dict} for holder in ("message", "delta")
}
_MESSAGE_READ: dict[str, type | tuple[type, ...]] = {
    "content": (str, list),
    "reasoning_content": str,
    "reasoning": str,
    "refusal": str,
    "audio": dict,
    "tool_calls": list,
    "function_call": dict,
}
_PART_READ: dict[str, type | tuple[type, ...]] = {"text": str, "refusal": str}
#: ``data`` is the base64 audio (not text, whatever its length)
_AUDIO_READ: dict[str, type | tuple[type, ...]] = {"transcript": str, "data": _OPAQUE_STR}
_TOOL_READ: dict[str, type | tuple[type, ...]] = {"function": dict}
_FUNCTION_READ: dict[str, type | tuple[type, ...]] = {"name": str, "arguments": str}
_LOGPROBS_READ: dict[str, type | tuple[type, ...]] = {
    "content": list,
    "refusal": list,
    "tokens": list,
    "top_logprobs": list,
}
#: a logprob entry (chat, Responses): its ``bytes`` are read apart (:meth:`_TokenTexts._bytes`)
_ENTRY_READ: dict[str, type | tuple[type, ...]] = {"token": str, "top_logprobs": list, "bytes": list}
_ALTERNATIVE_READ: dict[str, type | tuple[type, ...]] = {"token": str, "bytes": list}
#: an embeddings answer's ``data`` items (vectors or base64, not text)
_EMBEDDING_READ: dict[str, type | tuple[type, ...]] = {"embedding": (list, str)}
_EMBEDDING_META = _named("data.", "object", "index")
_TOP_READ: dict[str, type | tuple[type, ...]] = {"choices": list, "data": list}


#: a key name an engine's own fields have (``matched_stop``, ``token_ids``, a token id): any other
#: key name (words with spaces, another script, more than 64 characters) is text a client receives
_IDENTIFIER = re.compile(r"[A-Za-z0-9_$@][A-Za-z0-9_.:$@/-]{0,63}")


@functools.lru_cache(maxsize=1024)
def _is_text_key(key: str) -> bool:
    """Whether a key name is text a client receives: not an identifier (:data:`_IDENTIFIER`), or
    one holding a canary (:func:`has_canary`: ``KVGATE-CANARY-`` and its hex digits are an
    identifier's characters); :func:`_texts` reads such keys with the values. Remembered, as an
    engine's field names repeat in every event."""
    return _IDENTIFIER.fullmatch(key) is None or has_canary(key)


def has_canary(text: str) -> bool:
    """Whether ``text`` holds a whole canary, read as the canary scan reads text
    (:func:`verifier.canary.canary_text`: a zero-width character between its letters, or a
    full-width digit, is the same canary). What the readers show the guard of a string they do
    not read as text (metadata, opaque data, identifier key names): a canary is evidence wherever
    a client receives it, whatever the string's length."""
    if text.isascii():
        return CANARY_PREFIX in text and CANARY_RE.search(text) is not None
    return CANARY_RE.search(canary_text(text)) is not None


def _texts(value: Any, out: list[str]) -> None:
    """Every string of ``value`` into ``out`` as the verifier reads an engine's answer: its
    values and the key names an engine put text in (:func:`_is_text_key`), in document order, at
    any depth (:func:`tokenizer.json_values.string_values`)."""
    string_values(value, out, keys=_is_text_key)


#: the types of JSON values without a string inside (what orjson reads a number or a bool as)
_NUMBERS = (int, float, bool)


#: a stream's metadata strings as a chunk carries them: ``(name, value)`` (:class:`StreamMeta`)
Skipped = list[tuple[str, str]]


def _meta(v: Any, out: list[str]) -> None:
    """A metadata field's value: nothing when it is what metadata holds (a number, a bool,
    ``null``, a string of at most :data:`META_MAX_CHARS` without a canary); otherwise its strings
    are text."""
    if isinstance(v, str):
        if len(v) > META_MAX_CHARS or has_canary(v):
            out.append(v)
    elif isinstance(v, (dict, list)):
        _texts(v, out)


class StreamMeta:
    """A chat/completions stream's metadata as first sent, kept by the relay for the stream
    (:mod:`gateway.relay.stream`), which holds each chunk's :attr:`StreamEvent.meta` against it
    (:meth:`check`). An honest engine sends ``id``, ``object``, ``model`` and
    ``system_fingerprint`` unchanged in every chunk (OpenAI's chunk format: every chunk has the
    same ``id``; vLLM ``vllm/entrypoints/openai/serving_chat.py``,
    ``chat_completion_stream_generator``, builds each chunk with ``id=request_id`` and
    ``model=model_name``; SGLang ``python/sglang/srt/entrypoints/openai/serving_chat.py``, with
    ``id=content["meta_info"]["id"]`` and ``model=request.model``), and a role, a tool call's
    ``type`` and a finish reason alike. So a value is metadata only while it equals the first
    value of its name in the stream: the first is read for canaries only (:func:`has_canary`), an
    equal one costs a comparison, and from the first change on every value of that name is text,
    checked as the text stream of its name (the first value joined to its first change: what a
    client that joins the field rebuilds). Before, each value was skipped while at most
    :data:`META_MAX_CHARS`, chunk by chunk: an engine sent another tenant's prompt 40 characters
    a chunk in ``system_fingerprint``, and a strict tenant rebuilt it whole, none of it checked."""

    __slots__ = ("_first", "_same")

    def __init__(self) -> None:
        #: name -> the stream's first value of it; ``None`` once a value differed
        self._first: dict[str, str | None] = {}
        #: the last chunk's metadata when each of its values was its name's first: an honest
        #: chunk's equals it, checked in one comparison of the two lists
        self._same: Sequence[tuple[str, str]] = ()

    def check(self, meta: Sequence[tuple[str, str]], pieces: list[tuple[str, str]]) -> None:
        """Hold one chunk's metadata strings ``meta`` (:attr:`StreamEvent.meta`) against the
        stream's first values, and append what the guard must check to ``pieces`` (``(name,
        text)``, as :attr:`EngineOutput.fields` items): a first value holding a canary, a changed
        value (at its first change, joined after the first value)."""
        if meta == self._same:
            return
        first = self._first
        same = True
        for name, v in meta:
            f = first.get(name)
            if f == v:
                continue
            if f is not None:  # the first change: the first value and this one, as a client joins them
                first[name] = None
                pieces.append((name, f + v))
                same = False
            elif name in first:  # changed before: every value is text
                pieces.append((name, v))
                same = False
            else:
                first[name] = v
                if has_canary(v):
                    pieces.append((name, v))
        self._same = meta if same else ()


def _rest(
    obj: dict[str, Any],
    read: Mapping[str, type | tuple[type, ...]],
    meta: Mapping[str, str],
    out: list[str],
    skipped: Skipped | None = None,
) -> None:
    """The strings of ``obj`` no named reader takes, into ``out``: a key of ``read`` whose value
    has the type given there is read by name (skipped here; an opaque string, :data:`_OPAQUE_STR`,
    only for canaries), a key of ``meta`` is metadata (:func:`_meta`), and every other value,
    whatever its type and depth, is text. In a stream (``skipped`` given) a metadata string of at
    most :data:`META_MAX_CHARS` goes to ``skipped`` unread, as ``(its name in meta, value)``: the
    relay holds it against the stream's first value (:class:`StreamMeta`), which alone is read for
    canaries."""
    for k, v in obj.items():
        t = read.get(k)
        if t is not None:
            if v is None or isinstance(v, t):
                if t is _OPAQUE_STR and type(v) is str and has_canary(v):
                    out.append(v)
                continue
        elif (name := meta.get(k)) is not None:
            if skipped is not None and type(v) is str and len(v) <= META_MAX_CHARS:
                skipped.append((name, v))
            elif v is not None:
                _meta(v, out)
            continue
        elif _is_text_key(k):
            out.append(k)
        if v is not None and type(v) not in _NUMBERS:
            _texts(v, out)


def _index(v: Any, position: int) -> int:
    """A choice's (or a tool call's, or a Responses event's output or content) key: its ``index``
    when that is an integer, an integral
    number included (JSON's ``1.0`` is the number 1 to every client: ``JSON.parse`` and Python's
    ``1.0 == 1`` alike, so a choice sent as ``1`` and ``1.0`` by turns is one choice there, and
    read apart it was two streams here, each with every other piece of the text); else
    ``position``."""
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return position


def _is_index(v: Any) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


#: one text stream of a choice: ``(field, text, counted as completion text)``
_Field = tuple[str, str, bool]


def _choice_fields(choice: dict[str, Any], holder: str, skipped: Skipped | None) -> tuple[list[_Field], list[str]]:
    """``(field, text, counted)`` of one choice, in a fixed order (only string values, an empty
    string included), and the choice's ``other`` strings: every string no field reads that is
    not metadata where it sits (a stream's metadata into ``skipped``: :func:`_meta`). ``holder``:
    ``message`` (whole) or ``delta`` (chunk); a chunk's ``message`` (or a body's ``delta``) is
    read as ``other``."""
    out: list[_Field] = []
    other: list[str] = []
    _rest(choice, _CHOICE_READ[holder], _CHOICE_META, other, skipped)
    inner = choice.get(holder)
    if isinstance(inner, dict):
        _message_fields(inner, out, other, skipped)
    text = choice.get("text")
    if isinstance(text, str):
        out.append(("text", text, True))
    lp = choice.get("logprobs")
    if isinstance(lp, dict):
        _logprob_fields(lp, out, other)
    return out, other


def _message_fields(inner: dict[str, Any], out: list[_Field], other: list[str], skipped: Skipped | None) -> None:
    """A ``message`` / ``delta``'s text streams: content (and its parts), reasoning, refusal,
    the audio transcript, tool calls, the legacy ``function_call``; the rest into ``other``."""
    _rest(inner, _MESSAGE_READ, _MESSAGE_META, other, skipped)
    content = inner.get("content")
    if isinstance(content, str):
        out.append(("content", content, True))
    elif isinstance(content, list):
        _content_part_fields(content, out, other, skipped)
    for name in _PLAIN_FIELDS:
        v = inner.get(name)
        if isinstance(v, str):
            out.append((name, v, True))
    audio = inner.get("audio")
    if isinstance(audio, dict):
        _audio_fields(audio, out, other, skipped)
    calls = inner.get("tool_calls")
    if isinstance(calls, list):
        _tool_call_fields(calls, out, other, skipped)
    fc = inner.get("function_call")
    if isinstance(fc, dict):
        _function_fields(fc, "function_call", out, other)


def _audio_fields(audio: dict[str, Any], out: list[_Field], other: list[str], skipped: Skipped | None) -> None:
    if isinstance(audio.get("transcript"), str):
        out.append(("audio", audio["transcript"], True))
    _rest(audio, _AUDIO_READ, _AUDIO_META, other, skipped)


def _content_part_fields(content: list[Any], out: list[_Field], other: list[str], skipped: Skipped | None) -> None:
    """A list of content parts: its ``text`` parts as ``content``, its ``refusal`` parts as
    ``refusal``; a part that is not an object, and a part's other strings, into ``other``."""
    texts: list[str] = []
    refusals: list[str] = []
    for p in content:
        if not isinstance(p, dict):
            _texts(p, other)
            continue
        if isinstance(p.get("text"), str):
            texts.append(p["text"])
        if isinstance(p.get("refusal"), str):
            refusals.append(p["refusal"])
        _rest(p, _PART_READ, _PART_META, other, skipped)
    if texts:
        out.append(("content", "".join(texts), True))
    if refusals:
        out.append(("refusal", "".join(refusals), True))


def _tool_call_fields(calls: list[Any], out: list[_Field], other: list[str], skipped: Skipped | None) -> None:
    """``tool:<j>:name`` / ``tool:<j>:arguments`` of each tool call (``j``: its ``index``, else
    its position); a call that is not an object, and a call's other strings, into ``other``."""
    for pos, tc in enumerate(calls):
        if not isinstance(tc, dict):
            _texts(tc, other)
            continue
        _rest(tc, _TOOL_READ, _TOOL_META, other, skipped)
        fn = tc.get("function")
        if isinstance(fn, dict):
            _function_fields(fn, f"tool:{_index(tc.get('index'), pos)}", out, other)


def _function_fields(fn: dict[str, Any], prefix: str, out: list[_Field], other: list[str]) -> None:
    for part in ("name", "arguments"):
        if isinstance(fn.get(part), str):
            out.append((f"{prefix}:{part}", fn[part], True))
    _rest(fn, _FUNCTION_READ, _NO_META, other)


class _TokenTexts:
    """The token strings of one choice's (or one Responses part's) logprobs, read in one pass:
    the sampled tokens (``tokens``), their UTF-8 ``bytes`` (``raw``; ``differs``: one of them is
    not its token's UTF-8) and, per rank, the alternatives (``alts[r]``: the ``r``-th entry of
    each position's ``top_logprobs``, a :class:`_TokenTexts` of its own)."""

    __slots__ = ("alts", "differs", "raw", "tokens")

    def __init__(self) -> None:
        self.tokens: list[str] = []
        self.raw: list[bytes] = []
        self.differs = False
        self.alts: list[_TokenTexts] = []

    def entry(self, t: Any, other: list[str], read: Mapping[str, type | tuple[type, ...]] = _ENTRY_READ) -> None:
        """One logprob entry ``{"token", "logprob", "bytes", "top_logprobs"}`` (an alternative:
        ``read`` is :data:`_ALTERNATIVE_READ`, its own ``top_logprobs`` are ``other``); anything
        else it carries into ``other``."""
        if not isinstance(t, dict):
            _texts(t, other)
            return
        tok = t.get("token")
        if isinstance(tok, str):
            self.tokens.append(tok)
        self._bytes(tok, t.get("bytes"), other)
        tops = t.get("top_logprobs")
        if read is _ENTRY_READ and isinstance(tops, list):
            for r, alt in enumerate(tops):
                self._rank(r).entry(alt, other, _ALTERNATIVE_READ)
        _rest(t, read, _NO_META, other)

    def _bytes(self, tok: Any, v: Any, other: list[str]) -> None:
        """An entry's ``bytes``: kept (and ``differs`` set when they are not its token's UTF-8),
        or, when they are not a list of byte values, read as ``other`` text."""
        if type(v) is not list:  # absent; anything else is ``other`` text (:func:`_rest`)
            return
        if isinstance(tok, str):
            own = tok.encode("utf-8", "replace")
            if len(v) == len(own) and v == list(own):  # the honest case, compared in C
                self.raw.append(own)
                return
        b = _token_bytes(v)
        if b is None:
            _texts(v, other)
            return
        self.raw.append(b)
        self.differs = True

    def keyed(self, position: Any, other: list[str]) -> None:
        """One position of completions' ``top_logprobs``: ``{token: logprob}``, the tokens by rank."""
        if not isinstance(position, dict):
            _texts(position, other)
            return
        for r, (tok, logprob) in enumerate(position.items()):
            self._rank(r).tokens.append(tok)
            _texts(logprob, other)

    def _rank(self, r: int) -> _TokenTexts:
        while len(self.alts) <= r:
            self.alts.append(_TokenTexts())
        return self.alts[r]

    def streams(self) -> list[tuple[str, str]]:
        """``(name, text)``: ``logprobs`` (the sampled tokens), ``logprobs_bytes`` (their bytes,
        when one differs from its token), ``logprobs_top:<r>`` and ``logprobs_top_bytes:<r>``
        (the rank-``r`` alternatives)."""
        out = self._own("logprobs", "logprobs_bytes")
        for r, alt in enumerate(self.alts):
            out += alt._own(f"logprobs_top:{r}", f"logprobs_top_bytes:{r}")
        return out

    def _own(self, name: str, bytes_name: str) -> list[tuple[str, str]]:
        out = [(name, "".join(self.tokens))] if self.tokens else []
        if self.differs:
            out.append((bytes_name, b"".join(self.raw).decode("utf-8", "replace")))
        return out


def _logprob_fields(lp: dict[str, Any], out: list[_Field], other: list[str]) -> None:
    """The token strings of a choice's ``logprobs`` (chat ``content`` / ``refusal`` entries and
    their ``top_logprobs``, completions ``tokens`` and ``top_logprobs``), as the streams of
    :meth:`_TokenTexts.streams`, not counted: they repeat the text, or are alternatives to it. A
    client receives the alternatives too (the second most likely token at each position can
    spell a text the sampled ones do not), so each rank is a text stream of its own. Anything else
    the logprobs carry into ``other``."""
    acc = _TokenTexts()
    for key in ("content", "refusal"):  # chat: [{"token", "logprob", "bytes", "top_logprobs"}]
        items = lp.get(key)
        if isinstance(items, list):
            for t in items:
                acc.entry(t, other)
    items = lp.get("tokens")  # completions: ["tok", ...]
    if isinstance(items, list):
        for t in items:
            if isinstance(t, str):
                acc.tokens.append(t)
            else:
                _texts(t, other)
    tops = lp.get("top_logprobs")  # completions: [{"tok": logprob, ...}, ...]
    if isinstance(tops, list):
        for position in tops:
            acc.keyed(position, other)
    _rest(lp, _LOGPROBS_READ, _NO_META, other)
    out += [(name, text, False) for name, text in acc.streams()]


def _token_bytes(v: Any) -> bytes | None:
    """A chat logprob's ``bytes`` (the token's UTF-8 bytes, a list of ints 0-255) as bytes, or
    ``None`` when it is not such a list."""
    if not isinstance(v, list) or not all(_is_index(x) and 0 <= x <= 255 for x in v):
        return None
    return bytes(v)


def _parse(obj: Any, holder: str, keep_empty: bool, out: EngineOutput, skipped: Skipped | None = None) -> EngineOutput:
    """Fill ``out`` from a body or chunk ``obj`` (``holder``: ``message`` or ``delta``;
    ``keep_empty``: empty strings are read as texts too; ``skipped``: a stream's metadata strings,
    :func:`_meta`). Strings outside the choices and the metadata (a choice that is not an object,
    ``usage``'s, unknown keys') are ``"-:other"``."""
    if not isinstance(obj, dict):
        return out
    top: list[str] = []
    choices = obj.get("choices")
    if isinstance(choices, list):
        position = 0
        for c in choices:
            if isinstance(c, dict):
                i = c.get("index")
                _add_choice(out, c, i if type(i) is int else _index(i, position), holder, keep_empty, skipped)
                position += 1
            else:
                _texts(c, top)
    data = obj.get("data")
    if isinstance(data, list):  # embeddings: the vectors are not text, the rest is
        for item in data:
            if isinstance(item, dict):
                _rest(item, _EMBEDDING_READ, _EMBEDDING_META, top, skipped)
            else:
                _texts(item, top)
    _rest(obj, _TOP_READ, _TOP_META, top, skipped)
    if top:
        out.fields["-:other"] = " ".join(top)
    usage = obj.get("usage")
    if isinstance(usage, dict):
        out.usage = usage
        out.usage_only = isinstance(choices, list) and not choices
    return out


def _add_choice(
    out: EngineOutput, c: dict[str, Any], key: int, holder: str, keep_empty: bool, skipped: Skipped | None
) -> None:
    """One choice's texts, fields and finish reason into ``out`` (a repeated index adds to its streams)."""
    fields, other = _choice_fields(c, holder, skipped)
    for name, t, counted in fields:
        if not t and not keep_empty:
            continue
        fk = f"{key}:{name}"
        out.fields[fk] = out.fields.get(fk, "") + t
        if counted:
            out.texts[key] = out.texts.get(key, "") + t
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
    ``other`` for a JSON value that is not an object (its strings ``"-:other"`` text), else
    ``chunk`` (:func:`parse_chunk`'s reading, its short metadata strings in ``meta`` unread, for
    the relay's :class:`StreamMeta`). Never raises."""
    if not isinstance(obj, dict):
        return _not_an_object(obj)
    if is_error_payload(obj):
        return StreamEvent(kind="error", error=_error_fields(obj))
    meta: Skipped = []
    out = StreamEvent(kind="chunk", meta=meta)
    _parse(obj, "delta", False, out, meta)
    return out


def _not_an_object(obj: Any) -> StreamEvent:
    """An event whose data is JSON but not an object (an array, a string): ``other``, no event of
    either protocol, but a client that reads the event still receives its strings: they are its
    ``"-:other"`` text, checked as any other."""
    out = StreamEvent()
    strings: list[str] = []
    _texts(obj, strings)
    _put(out.fields, "-:other", " ".join(strings))
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
    if "detail" in data:  # FastAPI's error body: a string, or its validation errors (a list)
        detail = data["detail"]
        if isinstance(detail, str):
            return {"message": detail}
        try:  # the JSON text the engine sent (Python's repr of it recurses once per level)
            return {"message": orjson.dumps(detail).decode()}
        except orjson.JSONEncodeError:  # nested past the 254 levels orjson writes: no message of its own
            return {}
    return {}


def _relayed_status(status: int) -> bool:
    return 400 <= status <= 599 and status != 499


#: an engine's statuses that refuse the gateway's own credentials (its upstream ``api_key``, wrong
#: or rotated): the client's key was accepted before the request went upstream, so they are not
#: the client's to hear (the openai SDK raises ``AuthenticationError`` for a 401, and LiteLLM
#: treats one as permanent); 404 is relayed (vLLM answers it for an unknown
#: ``previous_response_id``, which the client sent)
CREDENTIAL_STATUSES = frozenset({401, 403, 407})


@dataclass
class CredentialsRefused(OpenAIError):
    """The 502 ``upstream_unavailable`` an engine's refusal of the gateway's credentials becomes
    (:data:`CREDENTIAL_STATUSES`); ``engine_status``: the engine's status (or error code)."""

    engine_status: int = 0


def credentials_refused(status: int, message: str) -> CredentialsRefused:
    """The error a client gets for an engine that refused the gateway's credentials with
    ``status`` and ``message`` (the engine's, kept after the gateway's own words)."""
    return CredentialsRefused(
        502,
        f"The upstream engine refused the gateway's own credentials ({status}); "
        f"the client's key was accepted. The engine said: {message}",
        code=ErrorCode.UPSTREAM_UNAVAILABLE,
        from_engine=True,
        engine_status=status,
    )


def engine_error(status: int, body: bytes | Any) -> OpenAIError:
    """An engine's error answer as an :class:`OpenAIError`.

    ``status``: the engine's HTTP status, kept when it is 4xx or 5xx but 499 (the gateway's own
    for a client that went away); below 400 (an error event inside a 200 stream, or an error
    object in a 200 body) the error's numeric ``code`` when it is such a status; else 502 (an
    engine's 600 or 999 was a 500 of the server layer, which knows no such status line).
    ``body``: the raw bytes or an already parsed object. The engine's ``message`` (cut to
    :data:`MAX_ENGINE_MESSAGE_CHARS`; FastAPI's ``detail`` when there is none: a string, or the
    JSON text of another value), string ``code`` and ``param`` are kept; an OpenAI ``type`` is
    kept, any other (a list or object too) is replaced by the status's. A message naming "maximum
    context length" without a code gets ``context_length_exceeded``. A status (or code) of
    :data:`CREDENTIAL_STATUSES` is :func:`credentials_refused` (502 ``upstream_unavailable``): the
    gateway's upstream credentials were refused, not the client's."""
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
    if status in CREDENTIAL_STATUSES:
        return credentials_refused(status, message[:MAX_ENGINE_MESSAGE_CHARS])
    code = raw_code if isinstance(raw_code, str) and raw_code else None
    if code is None and "maximum context length" in message:
        code = ErrorCode.CONTEXT_LENGTH_EXCEEDED
    etype = e.get("type")
    if not isinstance(etype, str) or etype not in OPENAI_ERROR_TYPES:  # a list or object is unhashable
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
    engine that mixed up requests can put another tenant's prompt there as well as in an answer.
    Its headers (the gateway's own: a ``Retry-After`` it checked) are kept."""
    code = err.code if err.code is not None and _CODE.fullmatch(err.code) else None
    message = (
        f"The upstream engine answered an error ({err.status}); its message is not shown under strict verification."
    )
    return OpenAIError(
        err.status, message, code=code, type=err.type or error_type_for_status(err.status), headers=err.headers
    )


# ------------------------------------------------------------------ /v1/responses
# The Responses API (OpenAI; vLLM ``serving_responses``), kept apart from the chat parsers above.
# Text read (strict mode and the leak index read it all): output text
# (``response.output_text.delta``; ``output_text`` parts), refusals (``response.refusal.delta``),
# reasoning (``response.reasoning_text.delta``, ``response.reasoning_summary_text.delta``;
# reasoning items' ``content`` and ``summary``) and function-call arguments
# (``response.function_call_arguments.delta``; ``function_call`` items' ``arguments``), keyed by
# ``output_index`` (a body's item position); logprobs as chat's (tokens, bytes, alternatives by
# rank); every other string as ``other`` (:func:`_rother`: metadata only at an object's own top
# level and while short). Usage (``input_tokens`` / ``output_tokens`` / ``input_tokens_details``)
# is given back as reported, in the chat names (``prompt_tokens`` / ``completion_tokens`` /
# ``total_tokens`` / ``prompt_tokens_details``) that quotas and the verifier read
# (:func:`reported_usage`). How it ended: ``response.completed`` / status ``completed`` ->
# ``finish_reason`` ``stop``, ``response.incomplete`` -> ``length`` (or the
# ``incomplete_details.reason`` when it is another string), ``response.failed`` and ``error`` events -> an
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


#: the end of a list :func:`_rstrings` walks
_END = object()

#: Responses fields that are opaque whatever their length (a reasoning item's encrypted state)
_OPAQUE: dict[str, type | tuple[type, ...]] = {"encrypted_content": _OPAQUE_STR}
#: :data:`RESPONSE_META_KEYS` as :func:`_rest` reads metadata (a Responses stream's values are
#: not remembered: each is read for canaries where it is, :func:`_meta`)
_RESPONSE_META = dict.fromkeys(RESPONSE_META_KEYS, "")


def _rread(*keys: str) -> dict[str, type | tuple[type, ...]]:
    """The read map (:func:`_rest`) of a Responses object whose ``keys`` are read by name as strings."""
    return {**_OPAQUE, **dict.fromkeys(keys, str)}


def _rother(obj: dict[str, Any], read: Mapping[str, type | tuple[type, ...]] = _OPAQUE) -> str:
    """The strings of a Responses object (an item, a part, an event, an annotation) outside
    ``read`` and its metadata, joined by spaces: a key of :data:`RESPONSE_META_KEYS` at its top
    level is metadata (:func:`_meta`: text only past :data:`META_MAX_CHARS`), and every string
    below it, in whatever field, is text (before, those keys were skipped at any depth: an
    unknown field's ``{"status": ...}`` entries hid a text)."""
    out: list[str] = []
    _rest(obj, read, _RESPONSE_META, out)
    return " ".join(out)


def _rstrings(obj: Any) -> str:
    """Every string of ``obj`` (:func:`_rother` of an object, each object of a list and of the
    lists inside it, any other value's strings), joined by spaces, in document order. Lists are
    walked without recursion: a hostile engine's annotation nested 1,000 lists deep (orjson reads
    1,024) is read, not a ``RecursionError``."""
    if isinstance(obj, dict):
        return _rother(obj)
    out: list[str] = []
    if not isinstance(obj, list):
        _texts(obj, out)
        return " ".join(out)
    stack: list[Iterator[Any]] = [iter(obj)]
    while stack:
        x = next(stack[-1], _END)
        if x is _END:
            stack.pop()
        elif isinstance(x, list):
            stack.append(iter(x))
        elif s := _rstrings(x):
            out.append(s)
    return " ".join(out)


def _put_logprobs(out: dict[str, str], prefix: str, lp: Any, other: list[str]) -> None:
    """A Responses ``logprobs`` list (``[{"token", "logprob", "bytes", "top_logprobs"}]``, chat's
    entries) as the streams ``<prefix>:logprobs``, ``<prefix>:logprobs_bytes``,
    ``<prefix>:logprobs_top:<r>`` ... (:meth:`_TokenTexts.streams`); any other string into ``other``."""
    if lp is None:
        return
    if not isinstance(lp, list):
        _texts(lp, other)
        return
    acc = _TokenTexts()
    for t in lp:
        acc.entry(t, other)
    for name, text in acc.streams():
        _put(out, f"{prefix}:{name}", text)


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


def reported_usage(usage: Any) -> dict[str, Any] | None:
    """A Responses ``usage`` as the engine reported it, in chat names (what the parsers give as
    ``usage``): ``input_tokens`` as ``prompt_tokens`` and ``output_tokens`` as
    ``completion_tokens``, each when present, whatever it holds (the quota settle takes only a
    plausible int, :func:`gateway.relay.finish._usage_count`; the verifier names anything else as
    drift, :func:`verifier.drift.check_usage`), ``total_tokens`` when both are counts
    (:func:`response_usage`), and ``input_tokens_details`` as ``prompt_tokens_details``: its
    ``cached_tokens`` is the prefix-cache hit (OpenAI's ``ResponseUsage``, vLLM's
    ``serving_responses`` the same), which the latency detector reads. ``None`` without a usage
    object. Before, a usage whose counts were not both non-negative ints was dropped whole (no
    drift compared) and the cached count always (a strict answer too fast was never withheld)."""
    if not isinstance(usage, dict):
        return None
    out: dict[str, Any] = {}
    for theirs, ours in (("input_tokens", "prompt_tokens"), ("output_tokens", "completion_tokens")):
        if theirs in usage:
            out[ours] = usage[theirs]
    valid = response_usage(usage)
    if valid is not None:
        out["total_tokens"] = valid["total_tokens"]
    if "input_tokens_details" in usage:
        out["prompt_tokens_details"] = usage["input_tokens_details"]
    return out


def _put(out: dict[str, str], key: str, text: str) -> None:
    if text:
        out[key] = out[key] + " " + text if key in out else text


#: a content part's keys read apart from its text (the rest of its strings are its ``other`` text)
_PART_APART = frozenset({"annotations", "logprobs"})
#: item types whose named string fields are streams of their own -> those fields
_ITEM_STRINGS = {
    "function_call": ("arguments", "name"),
    "custom_tool_call": ("input", "name"),
    "mcp_call": ("arguments", "name", "output"),
    "code_interpreter_call": ("code",),
}


def _part_fields(part: dict[str, Any], index: int, j: int, name: str, out: dict[str, str]) -> None:
    """One content part's text streams: its text (or refusal) under ``name``, the strings of
    its ``annotations`` (titles, URLs), its ``logprobs`` tokens (and their alternatives), and
    every other string (a text that is not a string, a refusal part's ``text``, ...)."""
    refusal = part.get("type") == "refusal"
    key = "refusal" if refusal else "text"
    t = part.get(key)
    if isinstance(t, str) and t:
        out[f"{index}:{j}:{'refusal' if refusal and name == 'output_text' else name}"] = t
    _put(out, f"{index}:{j}:annotations", _rstrings(part.get("annotations")))
    other: list[str] = []
    _put_logprobs(out, f"{index}:{j}", part.get("logprobs"), other)
    _put(out, f"{index}:{j}:other", " ".join(other))
    _put(out, f"{index}:{j}:other", _rother({k: v for k, v in part.items() if k not in _PART_APART}, _rread(key)))


def _item_fields(item: Any, index: int) -> dict[str, str]:
    """The text streams of one output item (see :attr:`StreamEvent.fields`): the named
    fields of its type, its content parts, and every other string (``"<index>:other"``): an
    item type kvgate does not know is read whole."""
    out: dict[str, str] = {}
    if not isinstance(item, dict):
        _put(out, f"{index}:other", _rstrings(item))
        return out
    itype = item.get("type")
    read: dict[str, type | tuple[type, ...]] = dict(_OPAQUE)
    # a type that is not a string names no type; its strings are read with the item's other ones
    for key in _ITEM_STRINGS.get(itype, ()) if isinstance(itype, str) else ():
        v = item.get(key)
        if isinstance(v, str):  # another type (``arguments`` as an object) is ``other`` text
            read[key] = str
            if v:
                out[f"{index}:0:{key}"] = v
    keys = (("content", "reasoning"), ("summary", "reasoning_summary")) if itype == "reasoning" else (("content", ""),)
    for key, name in keys:
        parts = item.get(key)
        if not isinstance(parts, list):
            continue
        read[key] = list
        for j, p in enumerate(parts):
            if isinstance(p, dict):
                _part_fields(p, index, j, name or "output_text", out)
            else:
                _put(out, f"{index}:other", _rstrings(p))
    _put(out, f"{index}:other", _rother(item, read))
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
        # a reason that is not a string is read as absent, as chat reads a choice's finish_reason
        return reason if isinstance(reason, str) and reason != "max_output_tokens" else "length"
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
    _put(out.fields, "-:other", _rother(obj, {**_OPAQUE, "output": list}))
    out.usage = reported_usage(obj.get("usage"))
    out.finish_reason = _finish_of(obj)
    return out


def parse_response_event(obj: Any) -> StreamEvent:
    """One stream event's ``data`` (already JSON-decoded). Every string it carries outside the
    metadata is read: the text delta events' ``delta`` (and ``logprobs`` tokens) as new text;
    what an event repeats (``*.done``, ``*.added``, the ``response`` object) as snapshots; any
    other string (an annotation, a field or an event type kvgate does not know) as new text of
    the stream ``"<output index>:other"`` (``"<output index>:<part>:annotations"`` for
    ``response.output_text.annotation.added``); a JSON value that is not an object, as
    ``"-:other"``. Never raises on odd shapes."""
    if not isinstance(obj, dict):
        return _not_an_object(obj)
    etype = obj.get("type")
    if etype is not None and not isinstance(etype, str):
        etype = ""  # an array or object as the type (unhashable in the tables below): a type no engine sends
    seq = _sequence_number(obj.get("sequence_number"))
    if etype == "error" or (etype is None and obj.get("error") is not None):
        err = obj.get("error") if isinstance(obj.get("error"), dict) else obj
        return StreamEvent(kind="error", error=err, sequence_number=seq)
    i = _index(obj.get("output_index"), 0)
    j = _index(obj.get("content_index", obj.get("summary_index")), 0)
    if etype in TEXT_DELTA_EVENTS:
        return _delta_event(obj, str(etype), i, j, seq)
    snaps, read = _snapshots(obj, etype)
    fields: dict[str, str] = {}
    if etype == "response.output_text.annotation.added":
        read.add("annotation")
        _put(fields, f"{i}:{j}:annotations", _rstrings(obj.get("annotation")))
    _put(fields, f"{i}:other", _rother({k: v for k, v in obj.items() if k not in read}))
    if etype in TERMINAL_EVENTS:
        got = obj.get("response")
        resp = got if isinstance(got, dict) else {}
        if etype == "response.failed":
            err = resp.get("error")
            return StreamEvent(kind="error", error=err if isinstance(err, dict) else {}, sequence_number=seq)
        finish = _finish_of(resp) or TERMINAL_EVENTS[etype]
        usage = reported_usage(resp.get("usage"))
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
    other: list[str] = []
    _put_logprobs(fields, f"{i}:{j}", obj.get("logprobs"), other)
    _put(fields, f"{i}:other", " ".join(other))
    _put(fields, f"{i}:other", _rother({k: v for k, v in obj.items() if k != "logprobs"}, _rread("delta")))
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
    read for them (its metadata, ``type`` included, is :func:`_rother`'s); never raises."""
    i = _index(obj.get("output_index"), 0)
    j = _index(obj.get("content_index", obj.get("summary_index")), 0)
    read: set[str] = set()  # ``type`` is left to :func:`_rother`: metadata while a short string, else text
    out: dict[str, str] = {}
    if etype in _DONE_TEXT:
        key, name = _DONE_TEXT[etype]
        t = obj.get(key)
        if isinstance(t, str):  # another type is read as the event's other text
            read.add(key)
            if t:
                out[f"{i}:{j}:{name}"] = t
        if etype == "response.output_text.done" and isinstance(obj.get("logprobs"), list):
            read.add("logprobs")
            other: list[str] = []
            _put_logprobs(out, f"{i}:{j}", obj.get("logprobs"), other)
            _put(out, f"{i}:{j}:other", " ".join(other))
        return out, read
    part = obj.get("part")
    if isinstance(part, dict):  # content_part.* / reasoning_summary_part.*
        read.add("part")
        ptype = part.get("type")
        named = _PART_NAMES.get(ptype, "output_text") if isinstance(ptype, str) else "output_text"
        name = "reasoning_summary" if "summary_index" in obj else named
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
        _put(out, "-:response", _rother(resp, {**_OPAQUE, "output": list}))
    return out, read
