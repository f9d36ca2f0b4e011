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
  A stream's first value of a field, and in a whole answer (which has no first value to hold
  one against) every metadata string, is metadata only while it is spelled as an engine's ids,
  names and types are (:func:`_is_id_like`: one word of letters, digits and ``_ . : / @ -``);
  else it is text.
- ``key_names`` (``"-:key_names"``): the key names that are identifiers but name no field of
  the protocol (:data:`KEY_NAMES`, :func:`_is_text_name`; Responses: :data:`RESPONSE_KEY_NAMES`,
  but inside the client's own free-form values, :data:`_FREE_FORM`), each once, apart from the
  values (:func:`_key_names`), and their join when a canary is split across them
  (:func:`_split_canary`). In a stream a name the stream's first event sent is metadata, and
  one first sent later is text, once (:class:`StreamMeta`), the names of one event joined for
  canaries. Before, they were read only for canaries: an engine sent another tenant's text one
  word a new key name in each chunk (in each Responses event until this change), which the
  openai SDK keeps (``model_extra``) and a client that prints the JSON shows.
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
    in chat names. ``meta``: the event's metadata strings not read as text, as ``(name,
    value)``, which the relay holds against the stream's (:class:`StreamMeta`): a chat chunk's
    ids, ``model``, ``system_fingerprint``, a role, a finish reason, ... of at most
    :data:`META_MAX_CHARS`, and its key names that name no field of the protocol; a Responses
    event's ids (:data:`_EVENT_IDS`, :data:`_ITEM_IDS`, :data:`_RESPONSE_IDS`) and its key names
    that name no field (:data:`RESPONSE_KEY_NAMES`)."""

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


#: the key names of the chat/completions (and embeddings) objects engines send, wherever they sit:
#: OpenAI's (the openai SDK's ``ChatCompletion``, ``ChatCompletionChunk``, ``Completion``,
#: ``CompletionUsage``, ``ChatCompletionTokenLogprob``), vLLM's additions
#: (``vllm/entrypoints/openai/chat_completion/protocol.py``: ``prompt_logprobs``,
#: ``prompt_token_ids``, ``kv_transfer_params``, a choice's ``stop_reason`` and ``token_ids``,
#: ``DeltaMessage.reasoning``; a prompt logprob's ``rank`` and ``decoded_token``) and SGLang's
#: (``python/sglang/srt/entrypoints/openai/protocol.py``: ``metadata``, ``sglext`` with its
#: ``routed_experts`` and ``cached_tokens_details``, a choice's ``matched_stop``,
#: ``hidden_states`` and ``meta_info``, ``UsageInfo.reasoning_tokens``). Any other key name is
#: text a client receives (:func:`_is_text_name`)
KEY_NAMES = frozenset(
    """
    id object created model choices usage system_fingerprint service_tier obfuscation data embedding
    metadata prompt_logprobs prompt_token_ids kv_transfer_params sglext routed_experts cached_tokens_details
    device host storage storage_backend rank decoded_token
    index message delta text logprobs finish_reason stop_reason token_ids matched_stop hidden_states meta_info
    role content refusal reasoning reasoning_content tool_calls function_call audio annotations
    type url_citation start_index end_index url title function name arguments expires_at transcript
    token logprob bytes top_logprobs text_offset token_logprobs tokens
    prompt_tokens completion_tokens total_tokens prompt_tokens_details completion_tokens_details cached_tokens
    audio_tokens reasoning_tokens accepted_prediction_tokens rejected_prediction_tokens text_tokens image_tokens
    video_tokens cache_write_tokens
    """.split()
)


@functools.lru_cache(maxsize=1024)
def _is_text_name(key: str) -> bool:
    """Whether a chat/completions key name is text a client receives: a text key
    (:func:`_is_text_key`), or an identifier that names no field of the protocol
    (:data:`KEY_NAMES`; a name of digits, vLLM's token ids in ``prompt_logprobs``, spells no word
    and is not text either). A client that prints the JSON, or the openai SDK (which keeps
    unknown fields in ``model_extra``), receives it: an engine put another tenant's text one word
    a key name in each chunk, read before for canaries only. Identifiers are read apart from the
    values (:func:`_key_names`; a stream's are held by :class:`StreamMeta`)."""
    return _is_text_key(key) or not (key in KEY_NAMES or key.isdigit())


def has_canary(text: str) -> bool:
    """Whether ``text`` holds a whole canary, read as the canary scan reads text
    (:func:`verifier.canary.canary_text`: a zero-width character between its letters, or a
    full-width digit, is the same canary). What the readers show the guard of a string they do
    not read as text (metadata, opaque data, identifier key names): a canary is evidence wherever
    a client receives it, whatever the string's length."""
    if text.isascii():
        return CANARY_PREFIX in text and CANARY_RE.search(text) is not None
    return CANARY_RE.search(canary_text(text)) is not None


def _texts(value: Any, out: list[str], skipped: Skipped | None = None) -> None:
    """Every string of ``value`` into ``out`` as the verifier reads an engine's answer: its
    values and the key names an engine put text in (:func:`_is_text_key`), in document order, at
    any depth (:func:`tokenizer.json_values.string_values`). In a chat stream (``skipped``
    given) a key name that is an identifier naming no field goes to ``skipped``
    (:func:`_held_name`); a whole answer's are read apart (:func:`_key_names`): between the
    values, one before each, they broke up the text the leak index looks for."""
    string_values(value, out, keys=_is_text_key if skipped is None else functools.partial(_held_name, skipped))


def _held_name(skipped: Skipped, key: str) -> bool:
    """:func:`_texts`' key reader in a chat stream: whether ``key`` is read with the values
    (:func:`_is_text_key`); an identifier naming no field of the protocol (:func:`_is_text_name`)
    goes to ``skipped`` as ``(KEY_NAMES_STREAM, key)``, for :class:`StreamMeta`."""
    if not _is_text_name(key):
        return False
    if _is_text_key(key):
        return True
    skipped.append((KEY_NAMES_STREAM, key))
    return False


#: the types of JSON values without a string inside (what orjson reads a number or a bool as)
_NUMBERS = (int, float, bool)


#: a stream's metadata strings as a chunk carries them: ``(name, value)`` (:class:`StreamMeta`)
Skipped = list[tuple[str, str]]

#: the name in :attr:`StreamEvent.meta` of a chat chunk's key name that is no field of the
#: protocol (:func:`_is_text_name`), and the text stream it is checked as when it is text
KEY_NAMES_STREAM = "-:key_names"
#: the name in :attr:`StreamEvent.meta` of a Responses event's ``item_id``, and the text stream an
#: item id (or call id) is checked as when it is text (:meth:`StreamMeta.check`)
ITEM_IDS_STREAM = "-:item_ids"
#: the name in :attr:`StreamEvent.meta` of an item's ``id`` or ``call_id`` (an ``item`` of a
#: ``response.output_item.*`` event, an item of a ``response`` object's ``output``): the ids it
#: introduces
NEW_ITEM_IDS = "-:new_item_ids"
_HELD_APART = frozenset({KEY_NAMES_STREAM, ITEM_IDS_STREAM, NEW_ITEM_IDS})
#: the most characters of item ids (and call ids) a Responses stream introduces as metadata: an
#: honest one's are a few (vLLM: ``msg_``, ``rs_``, ``fc_`` or ``call_`` and 32 hex digits each);
#: past it an introduced id is text
ITEM_IDS_MAX_CHARS = 8 * META_MAX_CHARS


#: what an engine spells a metadata string (a whole answer's, a stream's first value) or an item
#: id with: one word of letters, digits and ``_ . : / @ -`` (vLLM's ``msg_``, ``rs_``, ``fc_``,
#: ``call_`` and ``chatcmpl-tool-`` ids and 32 hex digits, SGLang's and OpenAI's prefixed hex or
#: base62 ids, Kimi's ``functions.get_weather:0``, ``fp_`` fingerprints, a model such as
#: ``meta-llama/Llama-3.1-8B-Instruct``, a role, a type, a finish reason). A string with a space,
#: another script or other punctuation is no id: the words the leak index matches are apart
#: (:func:`verifier.shingles.fold`), and one such word holds no run of them
_ID_LIKE = re.compile(r"[A-Za-z0-9_.:/@-]+")


def _is_id_like(v: str) -> bool:
    """Whether ``v`` is spelled as an engine's metadata is (:data:`_ID_LIKE`)."""
    return _ID_LIKE.fullmatch(v) is not None


def _meta(v: Any, out: list[str], skipped: Skipped | None = None) -> None:
    """A metadata field's value: nothing when it is what metadata holds (a number, a bool,
    ``null``, a string of at most :data:`META_MAX_CHARS` without a canary, and, in a whole answer,
    spelled as metadata is: :func:`_is_id_like`); otherwise its strings are text (:func:`_texts`).
    (A stream's short strings never come here: :class:`StreamMeta` holds them.) Before, a whole
    answer's every metadata string up to 256 characters was skipped, one per content part or tool
    call: 256 characters of another tenant's text in each part's ``type`` or each call's ``id``."""
    if isinstance(v, str):
        if len(v) > META_MAX_CHARS or has_canary(v) or not _is_id_like(v):
            out.append(v)
    elif isinstance(v, (dict, list)):
        _texts(v, out, skipped)


class StreamMeta:
    """A stream's metadata as first sent, kept by the relay for the stream
    (:mod:`gateway.relay.stream`), which holds each event's :attr:`StreamEvent.meta` against it
    (:meth:`check`). An honest engine sends ``id``, ``object``, ``model`` and
    ``system_fingerprint`` unchanged in every chunk (OpenAI's chunk format: every chunk has the
    same ``id``; vLLM ``vllm/entrypoints/openai/serving_chat.py``,
    ``chat_completion_stream_generator``, builds each chunk with ``id=request_id`` and
    ``model=model_name``; SGLang ``python/sglang/srt/entrypoints/openai/serving_chat.py``, with
    ``id=content["meta_info"]["id"]`` and ``model=request.model``), and a role, a tool call's
    ``type`` and a finish reason alike. So a value is metadata only while it equals the first
    value of its name in the stream: the first is read for canaries only (:func:`has_canary`)
    while it is spelled as an engine's ids, names and types are (:func:`_is_id_like`; else it is
    text of its name, once, as a whole answer's is), an equal one costs a comparison, and from the
    first change on every value of that name is text, checked as the text stream of its name (the
    first value joined to its first change: what a client that joins the field rebuilds). Before,
    each value was skipped while at most :data:`META_MAX_CHARS`, chunk by chunk: an engine sent
    another tenant's prompt 40 characters a chunk in ``system_fingerprint``, and a strict tenant
    rebuilt it whole, none of it checked; and a first value was read for canaries only, whatever
    its spelling: 200 characters of another tenant's text in each of a stream's first ``id``,
    ``model`` and ``system_fingerprint``. An honest first value is spelled as an id (vLLM's
    ``chatcmpl-`` ids, ``meta-llama/Llama-3.1-8B-Instruct``, ``fp_44709d6fcb``): no text for the
    strict guard to hold back.

    Held apart from the first values (:data:`_HELD_APART`):

    - an event's key names that name no field of the protocol (:data:`KEY_NAMES_STREAM`; a
      chat chunk's, a Responses event's): metadata when the stream's first event with metadata
      sent them (at most ``first_key_chars`` characters of them), or when they repeat a name
      already read; a name first sent later is text, once, of :data:`KEY_NAMES_STREAM` (each its
      own piece). ``first_key_chars`` is :data:`META_MAX_CHARS` for an OpenAI-compatible server,
      which may name fields of its own from its first event on (as text they would hold an honest
      strict stream to its end), and 0 for an engine whose events name only the protocol's
      fields (vLLM, SGLang, the bundled backend; the relay knows which an upstream is), whose
      first event's unknown names are then text as any later event's are. The names of one
      event, joined without a break, are read for a canary split across them
      (:func:`_split_canary`). Honest chunks repeat the keys of their fields (vLLM's
      ``ChatCompletionStreamResponse`` and SGLang's, by field name in :data:`KEY_NAMES`; their
      Responses objects', :data:`RESPONSE_KEY_NAMES`), which never come here;
    - a Responses stream's item ids: an item's ``id`` and ``call_id`` introduce it
      (:data:`NEW_ITEM_IDS`; while spelled as an id, :func:`_is_id_like`, and up to
      :data:`ITEM_IDS_MAX_CHARS` characters in all; else text, once),
      and an event's ``item_id`` (:data:`ITEM_IDS_STREAM`) is metadata only when it names an item
      introduced before (vLLM sends every event of an item with the ``id`` its
      ``response.output_item.added`` gave it: ``streaming_events.py``,
      ``state.current_item_id``); else it is text of :data:`ITEM_IDS_STREAM`, every time. Before,
      each was skipped while at most :data:`META_MAX_CHARS`: 256 characters of another tenant's
      text in each event's ``item_id``."""

    __slots__ = ("_first", "_id_room", "_key_room", "_names", "_opening", "_same", "_sent_model")

    def __init__(self, sent_model: str = "", first_key_chars: int = META_MAX_CHARS) -> None:
        #: the model name the gateway forwarded (an engine echoes it in ``model``): metadata as a
        #: first value whatever its spelling (an operator may serve ``"Llama 3 8B"``)
        self._sent_model = sent_model
        #: name -> the stream's first value of it; ``None`` once a value differed
        self._first: dict[str, str | None] = {}
        #: the last event's metadata when each of its values was metadata: an honest chunk's
        #: equals it, checked in one comparison of the two lists
        self._same: Sequence[tuple[str, str]] = ()
        #: the key names and item ids read so far (as metadata or as text)
        self._names: set[str] = set()
        #: no event's metadata has been held yet
        self._opening = True
        #: characters of unknown key names the first event may still send as metadata
        self._key_room = first_key_chars
        #: characters of item ids the stream may still introduce as metadata
        self._id_room = ITEM_IDS_MAX_CHARS

    def check(self, meta: Sequence[tuple[str, str]], pieces: list[tuple[str, str]]) -> None:
        """Hold one event's metadata strings ``meta`` (:attr:`StreamEvent.meta`) against the
        stream's first values, and append what the guard must check to ``pieces`` (``(name,
        text)``, as :attr:`EngineOutput.fields` items): a first value holding a canary, or not
        spelled as an id (:func:`_is_id_like`) nor the model name forwarded; a changed value (at
        its first change, joined after the first value); a key name or an item id that is text."""
        if meta == self._same:
            return
        first = self._first
        same = True
        names: list[str] = []
        for name, v in meta:
            if name in _HELD_APART:
                if name == KEY_NAMES_STREAM:
                    names.append(v)
                same = self._held_apart(name, v, pieces) and same
                continue
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
                if has_canary(v) or (v and v != self._sent_model and not _is_id_like(v)):
                    pieces.append((name, v))
        if len(names) > 1 and _split_canary(names, pieces):
            same = False
        self._opening = False
        self._same = meta if same else ()

    def _held_apart(self, name: str, v: str, pieces: list[tuple[str, str]]) -> bool:
        """A key name or an item id (:data:`_HELD_APART`): whether it is metadata; when it is
        text, its piece (the name and a space, as a client's words) is appended to ``pieces``."""
        names = self._names
        if v in names:
            return True
        if name == KEY_NAMES_STREAM:
            names.add(v)  # text once: a client that receives it again reads no new text
            if self._opening and len(v) <= self._key_room:
                self._key_room -= len(v)
                return True
        elif name == NEW_ITEM_IDS:
            names.add(v)
            if len(v) <= self._id_room and _is_id_like(v):
                self._id_room -= len(v)
                return True
        pieces.append((KEY_NAMES_STREAM if name == KEY_NAMES_STREAM else ITEM_IDS_STREAM, v + " "))
        return False


def _split_canary(names: Sequence[str], pieces: list[tuple[str, str]]) -> bool:
    """Whether the key names of one event (or one answer), joined in order without a break, hold
    a canary (:func:`has_canary`) split across them; if so the join is a piece of
    :data:`KEY_NAMES_STREAM` (a name that holds a whole one is text already: :func:`_is_text_key`).
    A client that prints the JSON shows ``"KVGATE-CANARY-0f1e":1,"2d3c4b5a6978":1``: read one
    name at a time, the canary was found in neither (and, as text, a space came between them)."""
    joined = "".join(names)
    if not has_canary(joined):
        return False
    pieces.append((KEY_NAMES_STREAM, joined + " "))
    return True


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
    whatever its type and depth, is text, and so is its key name unless it names a field of the
    protocol (:func:`_is_text_name`): with the value when it is no identifier, else apart
    (:func:`_text_name`). In a stream (``skipped`` given) a metadata string of at most
    :data:`META_MAX_CHARS` goes to ``skipped`` unread, as ``(its name in meta, value)``, and so
    does such an identifier, as ``(KEY_NAMES_STREAM, name)``: the relay holds them against the
    stream's first ones (:class:`StreamMeta`), which alone are read for canaries."""
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
                _meta(v, out, skipped)
            continue
        elif _is_text_name(k):
            _text_name(k, out, skipped)
        if v is not None and type(v) not in _NUMBERS:
            _texts(v, out, skipped)


def _text_name(k: str, out: list[str], skipped: Skipped | None) -> None:
    """A key name that is text (:func:`_is_text_name`): into ``out`` when it is no identifier
    (:func:`_is_text_key`); else, in a stream (``skipped`` given), into ``skipped`` as
    ``(KEY_NAMES_STREAM, k)`` for :class:`StreamMeta` (a whole answer's: :func:`_key_names`)."""
    if _is_text_key(k):
        out.append(k)
    elif skipped is not None:
        skipped.append((KEY_NAMES_STREAM, k))


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
        _logprob_fields(lp, out, other, skipped)
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
        _function_fields(fc, "function_call", out, other, skipped)


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
            _texts(p, other, skipped)
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
            _texts(tc, other, skipped)
            continue
        _rest(tc, _TOOL_READ, _TOOL_META, other, skipped)
        fn = tc.get("function")
        if isinstance(fn, dict):
            _function_fields(fn, f"tool:{_index(tc.get('index'), pos)}", out, other, skipped)


def _function_fields(
    fn: dict[str, Any], prefix: str, out: list[_Field], other: list[str], skipped: Skipped | None
) -> None:
    for part in ("name", "arguments"):
        if isinstance(fn.get(part), str):
            out.append((f"{prefix}:{part}", fn[part], True))
    _rest(fn, _FUNCTION_READ, _NO_META, other, skipped)


class _TokenTexts:
    """The token strings of one choice's (or one Responses part's) logprobs, read in one pass:
    the sampled tokens (``tokens``), their UTF-8 ``bytes`` (``raw``; ``differs``: one of them is
    not its token's UTF-8) and, per rank, the alternatives (``alts[r]``: the ``r``-th entry of
    each position's ``top_logprobs``, a :class:`_TokenTexts` of its own). ``skipped``: a chat
    stream's metadata sink (:func:`_rest`)."""

    __slots__ = ("alts", "differs", "raw", "skipped", "tokens")

    def __init__(self, skipped: Skipped | None = None) -> None:
        self.tokens: list[str] = []
        self.raw: list[bytes] = []
        self.differs = False
        self.alts: list[_TokenTexts] = []
        self.skipped = skipped

    def entry(self, t: Any, other: list[str], read: Mapping[str, type | tuple[type, ...]] = _ENTRY_READ) -> None:
        """One logprob entry ``{"token", "logprob", "bytes", "top_logprobs"}`` (an alternative:
        ``read`` is :data:`_ALTERNATIVE_READ`, its own ``top_logprobs`` are ``other``); anything
        else it carries into ``other``."""
        if not isinstance(t, dict):
            _texts(t, other, self.skipped)
            return
        tok = t.get("token")
        if isinstance(tok, str):
            self.tokens.append(tok)
        self._bytes(tok, t.get("bytes"), other)
        tops = t.get("top_logprobs")
        if read is _ENTRY_READ and isinstance(tops, list):
            for r, alt in enumerate(tops):
                self._rank(r).entry(alt, other, _ALTERNATIVE_READ)
        _rest(t, read, _NO_META, other, self.skipped)

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
            _texts(v, other, self.skipped)
            return
        self.raw.append(b)
        self.differs = True

    def keyed(self, position: Any, other: list[str]) -> None:
        """One position of completions' ``top_logprobs``: ``{token: logprob}``, the tokens by rank."""
        if not isinstance(position, dict):
            _texts(position, other, self.skipped)
            return
        for r, (tok, logprob) in enumerate(position.items()):
            self._rank(r).tokens.append(tok)
            _texts(logprob, other, self.skipped)

    def _rank(self, r: int) -> _TokenTexts:
        while len(self.alts) <= r:
            self.alts.append(_TokenTexts(self.skipped))
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


def _logprob_fields(lp: dict[str, Any], out: list[_Field], other: list[str], skipped: Skipped | None) -> None:
    """The token strings of a choice's ``logprobs`` (chat ``content`` / ``refusal`` entries and
    their ``top_logprobs``, completions ``tokens`` and ``top_logprobs``), as the streams of
    :meth:`_TokenTexts.streams`, not counted: they repeat the text, or are alternatives to it. A
    client receives the alternatives too (the second most likely token at each position can
    spell a text the sampled ones do not), so each rank is a text stream of its own. Anything else
    the logprobs carry into ``other``."""
    acc = _TokenTexts(skipped)
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
                _texts(t, other, skipped)
    tops = lp.get("top_logprobs")  # completions: [{"tok": logprob, ...}, ...]
    if isinstance(tops, list):
        for position in tops:
            acc.keyed(position, other)
    _rest(lp, _LOGPROBS_READ, _NO_META, other, skipped)
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
                _texts(c, top, skipped)
    data = obj.get("data")
    if isinstance(data, list):  # embeddings: the vectors are not text, the rest is
        for item in data:
            if isinstance(item, dict):
                _rest(item, _EMBEDDING_READ, _EMBEDDING_META, top, skipped)
            else:
                _texts(item, top, skipped)
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


#: the key a completions ``top_logprobs`` list is walked under by :func:`_key_names`: its
#: positions' keys are tokens, read as the alternatives' text (:meth:`_TokenTexts.keyed`)
_TOKEN_KEYS = "logprobs.top_logprobs"


#: the types of JSON values that hold others, as orjson reads them (an exact type is one set lookup:
#: half an ``isinstance`` of a tuple)
_CONTAINERS = frozenset({dict, list})


def _key_names(obj: Any, vocabulary: frozenset[str] = KEY_NAMES, free: frozenset[str] = frozenset()) -> str:
    """The key names in ``obj``, at any depth, that are identifiers naming no field of the
    protocol (``vocabulary``: :data:`KEY_NAMES`, or :data:`RESPONSE_KEY_NAMES`; a name that is no
    identifier is read with its value, a completions alternative's token with the alternatives;
    nor are the names inside the value of a key of ``free``, the client's own:
    :data:`_FREE_FORM`), each once, an object's before those of the objects inside it, joined by
    spaces: a whole answer's ``"-:key_names"`` text, apart from the values (one before each, they
    broke up the text the leak index looks for), and their join when it holds a canary split
    across them (:func:`_split_canary`). Walked without recursion (depth first, in document
    order)."""
    names: dict[str, None] = {}
    stack: list[tuple[str, Any]] = [("", obj)]
    while stack:
        key, x = stack.pop()
        if isinstance(x, list):
            stack += reversed([(key, v) for v in x if type(v) in _CONTAINERS])
        elif isinstance(x, dict):
            if key != _TOKEN_KEYS and not x.keys() <= vocabulary:
                names.update(
                    dict.fromkeys(k for k in x if k not in vocabulary and not k.isdigit() and not _is_text_key(k))
                )
            stack += reversed(_inner(key, x, free))
    found: list[tuple[str, str]] = []
    if len(names) > 1:
        _split_canary(list(names), found)
    return " ".join([*names, *(t.rstrip() for _, t in found)])


def _inner(key: str, x: dict[str, Any], free: frozenset[str]) -> list[tuple[str, Any]]:
    """The members :func:`_key_names` walks into in the object ``x`` under ``key``, in order: its
    objects and lists, but those of ``free``; a completions ``logprobs``' ``top_logprobs`` under
    :data:`_TOKEN_KEYS` (not a logprob entry's, with its ``token``: a Responses ``logprobs``
    list's entries come here under ``logprobs`` too, and their alternatives' names are key names)."""
    if key == "logprobs" and "top_logprobs" in x and "token" not in x:
        return [(_TOKEN_KEYS if k == "top_logprobs" else k, v) for k, v in x.items() if type(v) in _CONTAINERS]
    return [(k, v) for k, v in x.items() if type(v) in _CONTAINERS and k not in free]


def parse_body(obj: Any) -> EngineOutput:
    """A whole response object (already JSON-decoded) as :class:`EngineOutput`; never raises on
    odd shapes (a non-object, choices that are not objects, non-string texts read as absent).
    A choice's index is its ``index`` field when it is an int, else its position. Its key names
    that name no field of the protocol are the text ``"-:key_names"`` (:func:`_key_names`)."""
    out = _parse(obj, "message", True, EngineOutput())
    _put(out.fields, "-:key_names", _key_names(obj))
    return out


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
    ``"-:other"`` text, checked as any other, and its key names that name no chat/completions
    field its ``"-:key_names"`` (:func:`_key_names`)."""
    out = StreamEvent()
    strings: list[str] = []
    _texts(obj, strings)
    _put(out.fields, "-:other", " ".join(strings))
    _put(out.fields, "-:key_names", _key_names(obj))
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
# level, and only a value of its vocabulary or a short id, which a stream holds against its own:
# :class:`StreamMeta`). Usage (``input_tokens`` / ``output_tokens`` / ``input_tokens_details``)
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
#: Responses stream event types (the openai SDK's ``ResponseStreamEvent``), less ``response.``;
#: vLLM's ``reasoning_part.added`` / ``.done`` too (``vllm/entrypoints/openai/responses/protocol.py``)
_EVENT_TYPES = """
    audio.delta audio.done audio.transcript.delta audio.transcript.done code_interpreter_call.completed
    code_interpreter_call.in_progress code_interpreter_call.interpreting code_interpreter_call_code.delta
    code_interpreter_call_code.done compaction.compacting completed content_part.added content_part.done created
    custom_tool_call_input.delta custom_tool_call_input.done failed file_search_call.completed
    file_search_call.in_progress file_search_call.searching function_call_arguments.delta
    function_call_arguments.done image_generation_call.completed image_generation_call.generating
    image_generation_call.in_progress image_generation_call.partial_image in_progress incomplete
    mcp_call.completed mcp_call.failed mcp_call.in_progress mcp_call_arguments.delta mcp_call_arguments.done
    mcp_list_tools.completed mcp_list_tools.failed mcp_list_tools.in_progress output_item.added output_item.done
    output_text.annotation.added output_text.delta output_text.done queued reasoning_part.added
    reasoning_part.done reasoning_summary_part.added reasoning_summary_part.done reasoning_summary_text.delta
    reasoning_summary_text.done reasoning_text.delta reasoning_text.done refusal.delta refusal.done
    shell_call_command.added shell_call_command.delta shell_call_command.done shell_call_output_content.delta
    shell_call_output_content.done web_search_call.completed web_search_call.in_progress
    web_search_call.searching
"""
#: the ``type`` of an output item (``ResponseOutputItem``), a content or summary part, an annotation
_OBJECT_TYPES = """
    additional_tools apply_patch_call apply_patch_call_output code_interpreter_call compaction computer_call
    computer_call_output container_file_citation custom_tool_call custom_tool_call_output file_citation
    file_path file_search_call function_call function_call_output image_generation_call local_shell_call
    local_shell_call_output mcp_approval_request mcp_approval_response mcp_call mcp_list_tools message
    output_text program program_output reasoning reasoning_text refusal shell_call shell_call_output
    summary_text tool_search_call tool_search_output url_citation web_search_call
"""
#: Responses metadata of a fixed vocabulary, by key -> its values (the openai SDK's types, 3.60:
#: event, item, part and annotation types, ``ResponseStatus`` and an item's ``status``, a message's
#: ``role``, ``service_tier``, ``truncation``): a value is metadata only while it is one of them
#: (at the top of an item, a part, an event, an annotation or the ``response``), any other is text.
#: Before, any value up to :data:`META_MAX_CHARS` was skipped: 256 characters of another tenant's
#: text in each event's ``type`` or ``status``
RESPONSE_VOCABULARY: dict[str, frozenset[str]] = {
    "type": frozenset(["error", *("response." + t for t in _EVENT_TYPES.split()), *_OBJECT_TYPES.split()]),
    "status": frozenset(
        "in_progress completed incomplete failed cancelled queued searching generating interpreting calling".split()
    ),
    "role": frozenset("assistant user system developer tool critic discriminator unknown".split()),
    "object": frozenset({"response"}),
    "service_tier": frozenset("auto default flex scale priority fast ultrafast".split()),
    "truncation": frozenset({"auto", "disabled"}),
}
#: Responses metadata without a vocabulary (ids, a model name), by where it sits -> the name a
#: stream holds it under (:class:`StreamMeta`): an event's ``item_id``; an item's ``id`` and
#: ``call_id``; a ``response`` object's ``id``, ``model`` and ``previous_response_id``. Metadata up to
#: :data:`META_MAX_CHARS` without a canary (a stream's, only as :class:`StreamMeta` says); any other
#: key (``obfuscation``: OpenAI's random padding, which vLLM and SGLang do not send; a chat name
#: such as ``system_fingerprint``) is text
_EVENT_IDS = {"item_id": ITEM_IDS_STREAM}
_ITEM_IDS = {"id": NEW_ITEM_IDS, "call_id": NEW_ITEM_IDS}
_RESPONSE_IDS = _named("response.", "id", "model", "previous_response_id")
#: the key names of the Responses objects engines send, wherever they sit: the openai SDK's (3.60:
#: every field of ``Response`` and of the ``ResponseStreamEvent`` types, at any depth: items,
#: parts, annotations, tools, usage), vLLM's additions (``vllm/entrypoints/openai/responses/
#: protocol.py``: ``ResponsesResponse.input_messages`` / ``output_messages`` and the harmony
#: messages in them, ``InputTokensDetails`` / ``OutputTokensDetails`` per turn), SGLang's
#: (``python/sglang/srt/entrypoints/openai/protocol.py``, ``ResponsesResponse.store``), and
#: ``output_text``, ``created`` (other servers'); and the hints of an MCP tool's ``annotations``.
#: Any other identifier key name is text a client receives (:func:`_rother`, :func:`_rtexts`),
#: but inside the value of a key of :data:`_FREE_FORM`
RESPONSE_KEY_NAMES = frozenset(
    """
    access_programs acknowledged_safety_checks action actions allowed_callers allowed_domains allowed_tools always
    annotation annotation_index annotations approval_request_id approve arguments async attributes authorization
    background button bytes cache_missed_tokens cache_write_tokens cache_write_tokens_details cached_image_tokens
    cached_text_tokens cached_tokens cached_tokens_details call_id caller caller_id categories
    category_applied_input_types category_scores city code command command_index commands comparison_response_id
    comparison_reusable_tokens completed_at complexity connector_id container container_id content content_index
    context context_compression conversation country created_at created_by cyber data defer_loading definition delta
    description detail detailed_explanation diff display_height display_width domain domain_secrets effort
    embedding_weight encrypted_content end_index env environment error error_type execution exit_code
    external_web_access file_data file_id file_ids file_url filename filters fingerprint flagged format frame_count
    frame_duration_ms generate_summary headers hybrid_search id image image_gen image_tokens image_url
    incomplete_details index input input_fidelity input_image_mask input_schema input_tokens input_tokens_details
    input_transformations instructions item item_id key keys logprob logprobs logs max_num_results max_output_length
    max_output_tokens max_tool_calls media_type memory_limit message metadata misalignment mode model moderation
    moderation_details moderation_stage name namespace network_policy never num_requests obfuscation object
    operation outcome output output_compression output_format output_index output_schema output_tokens
    output_tokens_details outputs parallel_tool_calls param parameters part partial_image_b64 partial_image_index
    partial_images path pattern pending_safety_checks phase previous_response_id prompt prompt_cache_breakpoint
    prompt_cache_diagnostics prompt_cache_key prompt_cache_options prompt_cache_retention quality queries query
    ranker ranking_options read_only reason reasoning reasoning_tokens refusal region require_approval response
    result results review_target revised_prompt role safety_identifier schema score score_threshold scroll_x
    scroll_y search_content_types search_context_size sequence_number server_description server_label server_url
    service_tier size skill_id skills source sources start_index status stderr stdout steer strict summary
    summary_index svg svg_usage syntax temperature text text_tokens text_weight timeout_ms timezone title token
    tool_choice tool_names tool_usage tools top_logprobs top_p total_tokens truncation ttl ttl_12h_tokens
    ttl_30m_tokens tunnel_id type url usage user user_location value variables vector_store_ids verbosity version
    web_search working_directory x y
    input_messages output_messages input_tokens_per_turn cached_tokens_per_turn tool_output_tokens
    output_tokens_per_turn tool_output_tokens_per_turn tokens author channel recipient content_type
    store output_text created frequency_penalty presence_penalty top_k
    readOnlyHint destructiveHint idempotentHint openWorldHint
    """.split()
)
#: keys of a Responses object whose value is a free-form map, its key names not the protocol's
#: (the openai SDK types them ``Dict`` or ``object``): a function tool's JSON schema
#: (``parameters``, ``output_schema``), ``text.format``'s ``schema``, an MCP tool's
#: ``input_schema`` and ``headers``, ``metadata``, a prompt's ``variables``, a file search result's
#: ``attributes``, a moderation's categories. What is in them is the client's own (the
#: ``response`` echoes the request's tools, text format, metadata and prompt: vLLM
#: ``ResponsesResponse.from_request``, SGLang's alike), or its tools' servers': their key names are
#: not read (the strings are, as any)
_FREE_FORM = frozenset(
    """
    parameters output_schema schema input_schema headers metadata variables attributes
    categories category_scores category_applied_input_types
    """.split()
)
#: text streams that are completion text (counted as the response's output); the others
#: (``logprobs``, ``annotations``, ``other``) are checked only, as chat's logprobs and ``other``
COUNTED_STREAMS = frozenset(
    {"output_text", "refusal", "reasoning", "reasoning_summary", "arguments", "name", "input", "code", "transcript"}
)


#: the end of a list :func:`_rstrings` walks
_END = object()

#: Responses fields that are opaque whatever their length (a reasoning item's encrypted state)
_OPAQUE: dict[str, type | tuple[type, ...]] = {"encrypted_content": _OPAQUE_STR}


def _rread(*keys: str) -> dict[str, type | tuple[type, ...]]:
    """The read map (:func:`_rest`) of a Responses object whose ``keys`` are read by name as strings."""
    return {**_OPAQUE, **dict.fromkeys(keys, str)}


def _rother(
    obj: dict[str, Any],
    read: Mapping[str, type | tuple[type, ...]] = _OPAQUE,
    ids: Mapping[str, str] = _NO_META,
    meta: Skipped | None = None,
) -> str:
    """The strings of a Responses object (an item, a part, an event, an annotation, the
    ``response``) outside ``read`` and its metadata, joined by spaces: at its top level a value of
    :data:`RESPONSE_VOCABULARY` and a key of ``ids`` (:data:`_EVENT_IDS`, :data:`_ITEM_IDS`,
    :data:`_RESPONSE_IDS`) are metadata as :func:`_response_meta` says, and every other string,
    in whatever field and at whatever depth, is text (before, the metadata keys were skipped at
    any depth: an unknown field's ``{"status": ...}`` entries hid a text). A key name that names
    no field (:data:`RESPONSE_KEY_NAMES`) is text: with its value when it is no identifier, else,
    in a stream, apart (:func:`_response_name`; a whole answer's: :func:`_key_names`). In a
    stream (``meta`` given) the ids and those names go to ``meta`` for the relay
    (:class:`StreamMeta`)."""
    out: list[str] = []
    for k, v in obj.items():
        t = read.get(k)
        if t is not None and (v is None or isinstance(v, t)):
            if t is _OPAQUE_STR and type(v) is str and has_canary(v):
                out.append(v)
            continue
        if type(v) is str and _response_meta(k, v, ids, meta):
            continue
        if k not in RESPONSE_KEY_NAMES:
            _response_name(k, out, meta)
        if v is not None and type(v) not in _NUMBERS:
            _rtexts(v, out, None if k in _FREE_FORM else meta)
    return " ".join(out)


def _response_name(k: str, out: list[Any], meta: Skipped | None) -> None:
    """A Responses key name that names no field (:data:`RESPONSE_KEY_NAMES`): into ``out`` when
    it is read with its value (no identifier, or one holding a canary: :func:`_is_text_key`);
    else, in a stream (``meta`` given), into ``meta`` as ``(KEY_NAMES_STREAM, k)``, which
    :class:`StreamMeta` holds as it does a chat chunk's (a name of digits spells no word). Before,
    an identifier was read only for canaries: a new one in each event spelled another tenant's
    text, which a client that prints the JSON reads (the openai SDK keeps it in ``model_extra``)."""
    if _is_text_key(k):
        out.append(k)
    elif meta is not None and not k.isdigit():
        meta.append((KEY_NAMES_STREAM, k))


class _Free:
    """A value of a key of :data:`_FREE_FORM` on :func:`_rtexts`' stack: its strings are read,
    its key names are not (:func:`_texts`)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


def _rtexts(value: Any, out: list[str], meta: Skipped | None) -> None:
    """:func:`_texts` of a value inside a Responses object: its strings and the key names read
    with them (:func:`_is_text_key`), in document order; in a stream (``meta`` given) the key
    names that name no field go to ``meta`` too (:func:`_response_name`), but inside the value
    of a key of :data:`_FREE_FORM`. Iterative, as :func:`tokenizer.json_values.string_values`."""
    if meta is None or not isinstance(value, (dict, list)):
        _texts(value, out)
        return
    stack: list[Any] = [value]
    while stack:
        x = stack.pop()
        if isinstance(x, str):
            if x:
                out.append(x)
        elif isinstance(x, dict):
            stack.extend(reversed(_rmembers(x, meta)))
        elif isinstance(x, list):
            stack.extend(reversed(x))
        elif isinstance(x, _Free):
            _texts(x.value, out)


def _rmembers(x: dict[str, Any], meta: Skipped) -> list[Any]:
    """What :func:`_rtexts` reads of the object ``x``, in order: each value, after its name when
    that is read with it; a free-form one wrapped (:class:`_Free`); names naming no field into
    ``meta`` (:func:`_response_name`)."""
    items: list[Any] = []
    for k, v in x.items():
        if k not in RESPONSE_KEY_NAMES:
            _response_name(k, items, meta)
        elif k in _FREE_FORM and isinstance(v, (dict, list)):
            items.append(_Free(v))
            continue
        items.append(v)
    return items


def _response_meta(k: str, v: str, ids: Mapping[str, str], meta: Skipped | None) -> bool:
    """Whether the string ``v`` of a Responses object's key ``k`` is metadata: a value of its
    key's vocabulary (:data:`RESPONSE_VOCABULARY`), or an id of ``ids`` of at most
    :data:`META_MAX_CHARS` without a canary, which in a stream is appended to ``meta`` under its
    name there (:class:`StreamMeta` holds it against the stream's) and in a whole answer must be
    spelled as an id is (:func:`_is_id_like`): each of its items' ids held 256 characters of
    another tenant's text unread before."""
    vocabulary = RESPONSE_VOCABULARY.get(k)
    if vocabulary is not None:
        return v in vocabulary
    name = ids.get(k)
    if name is None or len(v) > META_MAX_CHARS or has_canary(v):
        return False
    if meta is not None:
        meta.append((name, v))
        return True
    return _is_id_like(v)


def _rstrings(obj: Any, meta: Skipped | None = None) -> str:
    """Every string of ``obj`` (:func:`_rother` of an object, each object of a list and of the
    lists inside it, any other value's strings), joined by spaces, in document order. Lists are
    walked without recursion: a hostile engine's annotation nested 1,000 lists deep (orjson reads
    1,024) is read, not a ``RecursionError``. ``meta``: a stream's (:func:`_rother`)."""
    if isinstance(obj, dict):
        return _rother(obj, meta=meta)
    out: list[str] = []
    if not isinstance(obj, list):
        _rtexts(obj, out, meta)
        return " ".join(out)
    stack: list[Iterator[Any]] = [iter(obj)]
    while stack:
        x = next(stack[-1], _END)
        if x is _END:
            stack.pop()
        elif isinstance(x, list):
            stack.append(iter(x))
        elif s := _rstrings(x, meta):
            out.append(s)
    return " ".join(out)


def _put_logprobs(out: dict[str, str], prefix: str, lp: Any, other: list[str], meta: Skipped | None = None) -> None:
    """A Responses ``logprobs`` list (``[{"token", "logprob", "bytes", "top_logprobs"}]``, chat's
    entries) as the streams ``<prefix>:logprobs``, ``<prefix>:logprobs_bytes``,
    ``<prefix>:logprobs_top:<r>`` ... (:meth:`_TokenTexts.streams`); any other string into
    ``other`` (``meta``: a stream's, :func:`_rother`)."""
    if lp is None:
        return
    if not isinstance(lp, list):
        _rtexts(lp, other, meta)
        return
    acc = _TokenTexts(meta)
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


def _part_fields(
    part: dict[str, Any], index: int, j: int, name: str, out: dict[str, str], meta: Skipped | None = None
) -> None:
    """One content part's text streams: its text (or refusal) under ``name``, the strings of
    its ``annotations`` (titles, URLs), its ``logprobs`` tokens (and their alternatives), and
    every other string (a text that is not a string, a refusal part's ``text``, ...). ``meta``: a
    stream's (:func:`_rother`)."""
    refusal = part.get("type") == "refusal"
    key = "refusal" if refusal else "text"
    t = part.get(key)
    if isinstance(t, str) and t:
        out[f"{index}:{j}:{'refusal' if refusal and name == 'output_text' else name}"] = t
    _put(out, f"{index}:{j}:annotations", _rstrings(part.get("annotations"), meta))
    other: list[str] = []
    _put_logprobs(out, f"{index}:{j}", part.get("logprobs"), other, meta)
    _put(out, f"{index}:{j}:other", " ".join(other))
    rest = {k: v for k, v in part.items() if k not in _PART_APART}
    _put(out, f"{index}:{j}:other", _rother(rest, _rread(key), _NO_META, meta))


def _item_fields(item: Any, index: int, meta: Skipped | None = None) -> dict[str, str]:
    """The text streams of one output item (see :attr:`StreamEvent.fields`): the named
    fields of its type, its content parts, and every other string (``"<index>:other"``): an
    item type kvgate does not know is read whole. Its ``id`` and ``call_id`` are ids
    (:data:`_ITEM_IDS`; a stream's into ``meta``)."""
    out: dict[str, str] = {}
    if not isinstance(item, dict):
        _put(out, f"{index}:other", _rstrings(item, meta))
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
                _part_fields(p, index, j, name or "output_text", out, meta)
            else:
                _put(out, f"{index}:other", _rstrings(p, meta))
    _put(out, f"{index}:other", _rother(item, read, _ITEM_IDS, meta))
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
    _put(out.fields, "-:other", _rother(obj, {**_OPAQUE, "output": list}, _RESPONSE_IDS))
    _put(out.fields, "-:key_names", _key_names(obj, RESPONSE_KEY_NAMES, _FREE_FORM))
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
    meta: Skipped = []
    if etype in TEXT_DELTA_EVENTS:
        return _delta_event(obj, str(etype), i, j, seq, meta)
    snaps, read = _snapshots(obj, etype, meta)
    fields: dict[str, str] = {}
    if etype == "response.output_text.annotation.added":
        read.add("annotation")
        _put(fields, f"{i}:{j}:annotations", _rstrings(obj.get("annotation"), meta))
    _put(fields, f"{i}:other", _rother({k: v for k, v in obj.items() if k not in read}, _OPAQUE, _EVENT_IDS, meta))
    if etype in TERMINAL_EVENTS:
        got = obj.get("response")
        resp = got if isinstance(got, dict) else {}
        if etype == "response.failed":
            err = resp.get("error")
            return StreamEvent(kind="error", error=err if isinstance(err, dict) else {}, sequence_number=seq)
        finish = _finish_of(resp) or TERMINAL_EVENTS[etype]
        usage = reported_usage(resp.get("usage"))
        return StreamEvent(
            kind="terminal",
            finish_reason=finish,
            usage=usage,
            sequence_number=seq,
            snapshots=snaps,
            fields=fields,
            meta=meta,
        )
    kind = "snapshot" if snaps else "other"
    return StreamEvent(kind=kind, sequence_number=seq, snapshots=snaps, fields=fields, meta=meta)


def _delta_event(obj: dict[str, Any], etype: str, i: int, j: int, seq: int | None, meta: Skipped) -> StreamEvent:
    """A text delta event: its ``delta`` (text, counted), its ``logprobs`` tokens and any other
    string it carries (checked only); its ``item_id`` into ``meta``."""
    fields: dict[str, str] = {}
    d = obj.get("delta")
    name = TEXT_DELTA_EVENTS[etype]
    texts: dict[int, str] = {}
    if isinstance(d, str) and d:
        fields[f"{i}:{j}:{name}"] = d
        texts[i] = d
    other: list[str] = []
    _put_logprobs(fields, f"{i}:{j}", obj.get("logprobs"), other, meta)
    _put(fields, f"{i}:other", " ".join(other))
    rest = {k: v for k, v in obj.items() if k != "logprobs"}
    _put(fields, f"{i}:other", _rother(rest, _rread("delta"), _EVENT_IDS, meta))
    return StreamEvent(texts, kind="text" if texts else "other", sequence_number=seq, fields=fields, meta=meta)


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


def _snapshots(obj: dict[str, Any], etype: Any, meta: Skipped) -> tuple[dict[str, str], set[str]]:
    """The texts an event repeats (see :attr:`StreamEvent.snapshots`) and the event keys
    read for them (its metadata, ``type`` included, is :func:`_rother`'s; the ids of its items
    and its ``response`` go to ``meta``); never raises."""
    i = _index(obj.get("output_index"), 0)
    j = _index(obj.get("content_index", obj.get("summary_index")), 0)
    read: set[str] = set()  # ``type`` is left to :func:`_rother`: metadata while in its vocabulary, else text
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
            _put_logprobs(out, f"{i}:{j}", obj.get("logprobs"), other, meta)
            _put(out, f"{i}:{j}:other", " ".join(other))
        return out, read
    part = obj.get("part")
    if isinstance(part, dict):  # content_part.* / reasoning_summary_part.*
        read.add("part")
        ptype = part.get("type")
        named = _PART_NAMES.get(ptype, "output_text") if isinstance(ptype, str) else "output_text"
        name = "reasoning_summary" if "summary_index" in obj else named
        _part_fields(part, i, j, name, out, meta)
        return out, read
    item = obj.get("item")
    if "item" in obj:  # output_item.*
        read.add("item")
        return _item_fields(item, i, meta), read
    resp = obj.get("response")
    if isinstance(resp, dict):  # response.created / in_progress / completed ...
        read.add("response")
        output = resp.get("output")
        for k, it in enumerate(output if isinstance(output, list) else ()):
            out.update(_item_fields(it, k, meta))
        _put(out, "-:response", _rother(resp, {**_OPAQUE, "output": list}, _RESPONSE_IDS, meta))
    return out, read
