"""Key names, item ids and metadata strings as channels for another tenant's text, through the real
gateway app against the scripted hostile engine of ``test_verifier_hostile_engine`` (its victim,
whose passage of about 330 tokens, every word marked ``zq`` and a canary inside, is indexed at its
admission; a strict tenant ``s``), and what the readers show the guard of honest answers
(docs/verifier.md, "Sampling and strict mode").

Each channel, before this change a strict tenant received the victim's text with 200:

- a ``/v1/responses`` event's key names (a new one per event, a word of the passage each; in a
  whole answer too): read only for canaries. Now a name that names no field of the Responses
  objects is text as a chat chunk's is, but inside a free-form value (a tool's JSON schema,
  ``metadata``, ...), whose names are the client's own;
- a canary split across two key names of one chunk or answer (``"KVGATE-CANARY-0f1e2d3c": 1,
  "4b5a6978": 1``), the first chunk's included (its names are metadata up to 256 characters):
  found in neither name alone. Now the names of one event are joined for the canary scan;
- a Responses stream's item ids, 200 characters of the passage each (2,048 characters of ids
  were metadata), and in a whole answer every item's id, every tool call's ``id`` and every
  content part's ``type`` (each up to 256 characters, as many as the answer has items): now an
  id (or a whole answer's metadata string) spelled with a space, another script or other
  punctuation than an engine's ids have is text;
- a stream's first value of each metadata field (``id``, ``model``, ``system_fingerprint``, ...,
  up to 256 characters each, in the first chunk or first sent later): read only for canaries.
  Now a first value is text unless it is spelled as an id, as a whole answer's metadata string
  is. An honest engine's values are spelled as ids, so no honest stream has text there for the
  strict guard to hold back (a value that never grows never has the hold-back behind it, and
  would hold the stream to its end);
- a chat stream's first chunk's unknown key names, metadata up to 256 characters: now text
  behind an upstream whose ``engine`` is vLLM, SGLang or the bundled backend (their chunks name
  only fields of ``KEY_NAMES``, the first included; vLLM's ``prompt_text`` needs
  ``return_prompt_text``, which the gateway does not forward).

One channel stays open (strict ``xfail``: it shows what a strict tenant receives today, and
fails the day it is closed): behind ``engine: openai`` the first chunk may still send 256
characters of unknown key names as metadata. An OpenAI-compatible server may name fields of its
own there (the ``x_engine_step`` of ``test_verifier_hostile_engine``'s honest stream, Azure's
``prompt_filter_results``), and as held text they would hold every such honest strict stream to
its end.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_verifier_fields import MARK, key_of, tenant_file, victim_passage
from test_verifier_hostile_engine import (
    _CHUNK,
    CANARY,
    SAID,
    SECRETS,
    VICTIM,
    Script,
    _message_item,
    _part,
    _response_events,
    _sse,
    _victims_incident,
    _withheld_tail,
    build_engine,
    response_body,
    send,
    usage,
)

from config.models import TenantConfig
from gateway.relay.stream import NAMES_ONLY_PROTOCOL_FIELDS
from gpu_backend.openai_api import GenRequest, chunk, usage_chunk
from gpu_backend.responses_api import ResponseEvents
from tests.fixtures.leak_stack import leak_stack
from tests.fixtures.settings import verifier_settings
from verifier.build import build_verifier
from verifier.engine_response import (
    META_MAX_CHARS,
    StreamMeta,
    parse_body,
    parse_chunk_event,
    parse_response_body,
    parse_response_event,
)
from verifier.guards import StrictGuard
from verifier.service import VerifierService
from verifier.stage import Exchange, ExchangeRequest

#: the victim's canary cut in two: neither half is a canary
HEAD, TAIL = CANARY[:22], CANARY[22:]
#: the victim's passage (without its canary) in pieces of 200 characters, each under the 256 of metadata
PLANTED = [" ".join(VICTIM)[i : i + 200] for i in range(0, len(" ".join(VICTIM)), 200)]
#: a client's function tool as the ``response`` object echoes it: the names of its JSON schema are
#: the client's own (a tool of an agent framework, 30 fields: more than 256 characters of names)
TOOL = {
    "type": "function",
    "name": "file_claim",
    "description": "File an insurance claim.",
    "strict": True,
    "parameters": {
        "type": "object",
        "properties": {f"claim_field_number_{n:02d}": {"type": "string"} for n in range(30)},
        "required": ["claim_field_number_00"],
        "additionalProperties": False,
    },
}
#: what else the ``response`` object echoes of a request: metadata, a JSON schema text format
ECHOED = {
    "tools": [TOOL],
    "metadata": {"client_team": "claims", "client_ticket_ref": "t-1"},
    "text": {"format": {"type": "json_schema", "name": "claim", "schema": TOOL["parameters"], "strict": True}},
    "tool_choice": "auto",
    "parallel_tool_calls": True,
    "reasoning": {"effort": None, "summary": None},
    "truncation": "disabled",
    "service_tier": "auto",
    "store": False,
}


@contextmanager
def _key_stack(tmp: Path, engine: str | None = None) -> Iterator[tuple[Script, VerifierService, httpx.Client]]:
    """``(script, verifier service, client)``: ``test_verifier_hostile_engine``'s stack, of its
    own, its upstream's ``engine`` as given (left out: ``openai``)."""
    sc = Script()
    sc.body = {"id": "v", "object": "text_completion", "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}]}
    passage, _ = victim_passage()
    victim = (key_of("victim"), "Please keep this: " + passage)
    verifier = {"strict_holdback_tokens": 64, "quarantine_min_prompt_tokens": 1024}
    with leak_stack(tmp, build_engine(sc), tenant_file(), SECRETS, victim, engine=engine, **verifier) as (svc, client):
        yield sc, svc, client


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with _key_stack(tmp_path_factory.mktemp("key_channels")) as stack:
        yield stack


def _responses_withheld(inc_id: str) -> bytes:
    """What a strict ``/v1/responses`` stream withheld before it released anything receives (its
    events unnumbered: the error event has no ``sequence_number``)."""
    error = {
        "type": "error",
        "code": "response_withheld",
        "message": f"The response was withheld by verification (incident {inc_id}).",
        "param": None,
    }
    return b"event: error\ndata: " + json.dumps(error, separators=(",", ":")).encode() + b"\n\n"


def _whole_withheld(inc_id: str) -> dict:
    message = f"The response was withheld by verification (incident {inc_id})."
    return {"error": {"message": message, "type": "server_error", "param": None, "code": "response_withheld"}}


def _stream(client: httpx.Client, svc: VerifierService, route: str, detector: str, withheld: Any) -> None:
    """A strict stream of the scripted events: nothing of the victim's reaches the client, the
    stream is exactly what ``withheld(incident id)`` says, and one response was withheld, by
    ``detector``'s incident naming the victim."""
    before, n = svc.stats["withheld"], len(svc.incidents.recent)
    status, raw = send(client, "s", route, True)
    assert MARK.encode() not in raw and HEAD.encode() not in raw
    inc = _victims_incident(svc, n, detector)
    assert (status, raw) == (200, withheld(inc.id))
    assert svc.stats["withheld"] == before + 1


def _whole(client: httpx.Client, svc: VerifierService, route: str, detector: str, stream: bool = False) -> None:
    """A strict whole answer (or a stream withheld before it started): 502 ``response_withheld``,
    by ``detector``'s incident naming the victim."""
    before, n = svc.stats["withheld"], len(svc.incidents.recent)
    status, raw = send(client, "s", route, stream)
    assert MARK.encode() not in raw and HEAD.encode() not in raw
    inc = _victims_incident(svc, n, detector)
    assert (status, json.loads(raw)) == (502, _whole_withheld(inc.id))
    assert svc.stats["withheld"] == before + 1


def _relayed(sc: Script, client: httpx.Client, route: str, events: list[dict], done: bool) -> None:
    """An honest stream reaches the strict tenant byte for byte."""
    sc.events, sc.done = events, done
    tail = b"data: [DONE]\n\n" if done else b""
    assert send(client, "s", route, True) == (200, b"".join(map(_sse, events)) + tail)


# ------------------------------------------------------------------ Responses key names
def _responses_with(extra: list[dict], **echoed: Any) -> list[dict]:
    """A vLLM-like ``/v1/responses`` stream (``_response_events``, unnumbered) saying ``ok``, its
    ``response`` echoing ``echoed``, with one empty text delta more for each of ``extra`` (its
    members added to the delta's), before the ``*.done`` events."""
    evs = _response_events(["ok"], numbered=False)
    for e in (evs[0], evs[-1]):
        e["response"] = {**e["response"], **echoed}
    where = {"item_id": "msg_1", "output_index": 0, "content_index": 0}
    more = [{"type": "response.output_text.delta", **where, "delta": "", "logprobs": [], **x} for x in extra]
    return evs[:4] + more + evs[4:]


@pytest.mark.timeout(60)
def test_a_responses_streams_key_names_are_text(stack):
    """A ``/v1/responses`` event's key name that names no field: the victim's words one a text
    delta (a client that prints the JSON reads them; the openai SDK keeps them in
    ``model_extra``), or the victim's canary cut across two names of one delta. Identifier key
    names were read only for canaries (and each half alone is none), so a strict tenant got the
    stream whole with 200. Now they are text as a chat chunk's are: the leak index finds the
    passage, the canary scan the joined canary, and the stream ends with the Responses error
    event, nothing of it released. An honest stream whose ``response`` echoes the client's tool
    (30 schema fields), metadata and JSON schema text format is relayed byte for byte."""
    sc, svc, client = stack
    _relayed(sc, client, "responses", _responses_with([], **ECHOED), done=False)
    for extra, detector in (([{w: 1} for w in VICTIM], "leak_index"), ([{HEAD: 1, TAIL: 1}], "canary")):
        sc.events, sc.done = _responses_with(extra, **ECHOED), False
        _stream(client, svc, "responses", detector, _responses_withheld)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("route", ["responses", "chat"])
def test_a_whole_answers_key_names_are_text_and_joined_for_canaries(stack, route):
    """A whole answer: a Responses item holding the victim's words as key names (chat's were
    already its ``-:key_names`` text), and, in either protocol, the canary cut across two key
    names. Before, the first was read only for canaries, and the second was found in neither
    name (and, read as text, a space came between the halves): 200 with the answer. Now 502
    ``response_withheld``, by the leak index and by the canary scan. An honest answer echoing the
    client's tool, metadata and text format is relayed as it was sent."""
    sc, svc, client = stack
    u = {"input_tokens": 9, "output_tokens": 2, "total_tokens": 11}
    msg = {"index": 0, "message": {"role": "assistant", "content": "Sunny today."}, "finish_reason": "stop"}
    chat = {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m", "usage": usage()}
    if route == "responses":
        sc.body = {**response_body(u), **ECHOED}
        assert send(client, "s", route, False) == (200, json.dumps(sc.body).encode())
        sc.body = {**response_body(u, [_message_item(_part(SAID), **dict.fromkeys(VICTIM, 1))]), **ECHOED}
        _whole(client, svc, route, "leak_index")
        sc.body = {**response_body(u), HEAD: 1, TAIL: 1}
    else:
        sc.body = {**chat, "choices": [msg], HEAD: 1, TAIL: 1}
    _whole(client, svc, route, "canary")


def _chunk(content: str, role: bool = False, **more: Any) -> dict:
    delta = {"role": "assistant", "content": content} if role else {"content": content}
    return {**_CHUNK, "choices": [{"index": 0, "delta": delta, "finish_reason": None}], **more}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["first_chunk", "later_chunk"])
def test_a_canary_split_across_a_chat_chunks_key_names_is_withheld(stack, where):
    """The victim's canary cut across two key names of one chat chunk: the first chunk's (its
    unknown names are metadata up to 256 characters) or a later one's (text, each name its own
    piece with a space after it). Found in neither name alone, so a strict tenant got the stream
    whole with 200. Now the names of one chunk are joined for the canary scan: a ``canary``
    incident; the first chunk's is found before the response starts (502 ``response_withheld``),
    a later one's ends the stream as any withheld stream ends, nothing of it released."""
    sc, svc, client = stack
    split = {HEAD: 1, TAIL: 1}
    events = [_chunk("ok", role=True, **(split if where == "first_chunk" else {}))]
    events += [_chunk(s) for s in SAID[1:4]]
    events += [_chunk("", **split)] if where == "later_chunk" else []
    events.append({**_CHUNK, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    sc.events, sc.done = events, True
    if where == "first_chunk":
        _whole(client, svc, "chat", "canary", stream=True)
    else:
        _stream(client, svc, "chat", "canary", _withheld_tail)


# ------------------------------------------------------------------ item ids and whole answers' metadata
def _items_added(ids: list[str]) -> list[dict]:
    """A vLLM-like Responses stream saying ``ok`` that adds, after its text, one message item
    more for each of ``ids`` (the item's ``id``)."""
    evs = _response_events(["ok"], numbered=False)
    added = [
        {
            "type": "response.output_item.added",
            "output_index": k,
            "item": {"type": "message", "id": i, "status": "in_progress", "role": "assistant", "content": []},
        }
        for k, i in enumerate(ids, start=1)
    ]
    return evs[:4] + added + evs[4:]


@pytest.mark.timeout(60)
def test_another_tenants_text_in_a_responses_streams_item_ids_is_withheld(stack):
    """Items added with the victim's passage as their ids, 200 characters each: a stream's items
    introduced 2,048 characters of ids as metadata, so a strict tenant got them with 200. Now an
    id spelled with a space is no id but text: the leak index finds the passage and the stream
    ends with the Responses error event. Items whose ids are an engine's (vLLM's ``msg_``,
    ``rs_`` and ``fc_`` and 32 hex digits, Kimi's call id) are relayed byte for byte."""
    sc, svc, client = stack
    honest = [f"{p}_8f2a6c1e4b7d4e0f9a3b5c7d9e1f2a3{n}" for n, p in enumerate(("msg", "rs", "fc"))]
    _relayed(sc, client, "responses", _items_added([*honest, "functions.file_claim:0"]), done=False)
    sc.events, sc.done = _items_added(PLANTED), False
    _stream(client, svc, "responses", "leak_index", _responses_withheld)


#: where a whole answer carries the victim's passage in a metadata string, a piece each
WHOLE_METADATA = ["responses_item_ids", "chat_tool_call_ids", "chat_content_part_types"]


def _whole_answer(place: str, pieces: list[str]) -> dict:
    """A whole answer saying ``SAID`` whose metadata at ``place`` holds ``pieces``, one each."""
    if place == "responses_item_ids":
        items = [
            {"type": "message", "id": p, "status": "completed", "role": "assistant", "content": []} for p in pieces
        ]
        u = {"input_tokens": 9, "output_tokens": 2, "total_tokens": 11}
        return response_body(u, [_message_item(_part(SAID)), *items])
    message: dict[str, Any] = {"role": "assistant"}
    if place == "chat_tool_call_ids":
        fn = {"name": "file_claim", "arguments": "{}"}
        message["tool_calls"] = [{"id": p, "type": "function", "function": fn} for p in pieces]
        message["content"] = "".join(SAID)
    else:
        message["content"] = [{"type": "text", "text": "".join(SAID)}, *({"type": p, "text": ""} for p in pieces)]
    choice = {"index": 0, "message": message, "finish_reason": "stop"}
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m", "choices": [choice]}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("place", WHOLE_METADATA)
def test_another_tenants_text_in_a_whole_answers_metadata_strings_is_withheld(stack, place):
    """A whole answer has no first value to hold its metadata against: each item's id, each
    tool call's ``id``, each content part's ``type`` was skipped up to 256 characters, as many
    as the answer has items, so the victim's passage 200 characters a piece reached a strict
    tenant with 200. Now a whole answer's metadata string spelled with a space (or another
    script, or other punctuation than ids have) is text: 502 ``response_withheld`` by the leak
    index. The same answer with an engine's ids (vLLM's ``chatcmpl-tool-`` and ``fc_``, Kimi's
    ``functions.file_claim:0``) and part types is relayed as sent."""
    sc, svc, client = stack
    honest = {
        "responses_item_ids": ["fc_8f2a6c1e4b7d4e0f9a3b5c7d9e1f2a3b", "functions.file_claim:0"],
        "chat_tool_call_ids": ["chatcmpl-tool-8f2a6c1e4b7d4e0f9a3b5c7d9e1f2a3b", "functions.file_claim:0"],
        "chat_content_part_types": ["text", "text"],
    }[place]
    sc.body = _whole_answer(place, honest)
    assert send(client, "s", "responses" if place.startswith("responses") else "chat", False) == (
        200,
        json.dumps(sc.body).encode(),
    )
    sc.body = _whole_answer(place, PLANTED)
    _whole(client, svc, "responses" if place.startswith("responses") else "chat", "leak_index")


# ------------------------------------------------------------------ what honest answers show the guard
def _shown(events: list[dict], parse: Any, first_key_chars: int = META_MAX_CHARS) -> list[tuple[str, str]]:
    """What the relay hands the guard of ``events`` (gateway/relay/stream.py ``_Events._pieces``,
    snapshots left out): each event's text streams and :class:`StreamMeta`'s pieces."""
    meta, shown = StreamMeta("", first_key_chars), []
    for e in events:
        ev = parse(e)
        pieces = list(ev.fields.items())
        if ev.meta:
            meta.check(ev.meta, pieces)
        shown += pieces
    return shown


def test_honest_responses_key_names_show_the_guard_nothing():
    """An honest Responses stream (vLLM's ``ResponsesResponse``, its ``input_messages`` /
    ``output_messages`` and per-turn usage, SGLang's ``store``) names only fields of the protocol
    (:data:`RESPONSE_KEY_NAMES`), and the ``response`` echoes the client's tool schema, metadata,
    text format and prompt variables, whose names are the client's own: nothing of their names is
    shown to the guard, in any event, nor is any in a whole answer. A name that names no field,
    anywhere but in those, is: in a stream after its first event (as a chat chunk's), in a whole
    answer as its ``-:key_names`` text."""
    echoed = {**ECHOED, "prompt": {"id": "pmpt_1", "variables": {"customer_first_name": "x"}, "version": "2"}}
    details = {"cached_tokens": 0, "input_tokens_per_turn": [9], "cached_tokens_per_turn": [0]}
    out_details = {"reasoning_tokens": 0, "tool_output_tokens": 0, "output_tokens_per_turn": [2]}
    u = {"input_tokens": 9, "input_tokens_details": details, "output_tokens": 2, "output_tokens_details": out_details}
    raw = [{"type": "raw_message_tokens", "message": "hi", "tokens": [1, 2]}]
    events = _responses_with([], **echoed)
    events[-1]["response"].update(usage={**u, "total_tokens": 11}, input_messages=raw, output_messages=raw)
    assert [p for p in _shown(events, parse_response_event, first_key_chars=0) if "key_names" in p[0]] == []
    whole = {**events[-1]["response"], "store": False}
    assert "-:key_names" not in parse_response_body(whole).fields
    hostile = _responses_with([{"x_trace": {"the_secret": 1, "parameters": {"own": 1}}}], **echoed)
    assert [p for p in _shown(hostile, parse_response_event) if "key_names" in p[0]] == [
        ("-:key_names", "x_trace "),
        ("-:key_names", "the_secret "),
    ]
    body = parse_response_body({**whole, "x_trace": {"the_secret": 1, "metadata": {"own": 1}}})
    assert body.fields["-:key_names"] == "x_trace the_secret"
    lp = [
        {"token": "a", "logprob": -0.1, "bytes": [97], "top_logprobs": [{"token": "b", "logprob": -2.0, "bytes": [98]}]}
    ]
    item = _message_item({**_part(["a"]), "logprobs": lp})
    assert "-:key_names" not in parse_response_body(response_body(u, [item])).fields
    lp[0]["top_logprobs"][0]["the_secret"] = 1  # an alternative's own names too
    assert parse_response_body(response_body(u, [item])).fields["-:key_names"] == "the_secret"
    from verifier.engine_response import RESPONSE_KEY_NAMES

    assert {"parameters", "schema", "metadata", "variables"} <= RESPONSE_KEY_NAMES


def test_an_events_key_names_are_joined_for_canaries_and_its_ids_must_be_spelled_as_ids():
    """The names of one chunk (here beside the engine's own ``x_engine_step``) are joined for the
    canary scan (one piece, after each name's own when they are text); a whole answer's names
    too. An item id an engine could send (vLLM's, OpenAI's, Kimi's) is introduced as metadata;
    one with a space is text, once. A whole chat answer's metadata string with a space is its
    ``other`` text; an honest one is not."""
    first = {**_chunk("a", role=True), HEAD: 1, TAIL: 1}
    joined = "x_engine_step" + CANARY
    assert _shown([first], parse_chunk_event) == [("0:content", "a"), ("-:key_names", joined + " ")]
    later = [_chunk("a", role=True), {**_chunk(""), "x_a": 1, HEAD: 1, TAIL: 1}]
    assert _shown(later, parse_chunk_event) == [
        ("0:content", "a"),
        ("-:key_names", "x_a "),
        ("-:key_names", HEAD + " "),
        ("-:key_names", TAIL + " "),
        ("-:key_names", "x_engine_stepx_a" + CANARY + " "),
    ]
    assert parse_body({"choices": [], HEAD: 1, TAIL: 1}).fields == {"-:key_names": f"{HEAD} {TAIL} {CANARY}"}
    ids = ["msg_8f2a6c1e4b7d4e0f9a3b5c7d9e1f2a3b", "call_Xy12Ab34", "functions.file_claim:0", "msg 1 of tenant b"]
    added = [{"type": "response.output_item.added", "output_index": k, "item": {"id": i}} for k, i in enumerate(ids)]
    assert _shown(added, parse_response_event) == [("-:item_ids", "msg 1 of tenant b ")]
    spaced = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "a"}}], "model": "my model"}
    assert parse_body(spaced).fields == {"0:content": "a", "-:other": "my model"}
    honest = {**spaced, "model": "meta-llama/Llama-3.1-8B-Instruct", "system_fingerprint": "fp_44709d6fcb"}
    assert parse_body(honest).fields == {"0:content": "a"}


# ------------------------------------------------------------------ a stream's first metadata values
#: an honest engine's metadata, the same in every chunk: vLLM's ``chatcmpl-`` id, a Hugging Face
#: model name, an OpenAI-style ``fp_`` fingerprint
HONEST_META = {
    "id": "chatcmpl-8f2a6c1e",
    "model": "meta-llama/Llama-3.1-8B-Instruct",
    "system_fingerprint": "fp_44709d6fcb",
}


def _meta_chunks(meta: dict[str, Any], later: dict[str, Any] | None = None, n: int = 4) -> list[dict]:
    """A chat stream saying ``ok`` and ``SAID[1:n]``, one piece a chunk, then a finish chunk: every
    chunk carries ``meta``, every chunk after the first ``later`` too (as an engine repeats them)."""
    base = {"object": "chat.completion.chunk", "created": 1}

    def chunk(delta: dict, finish: str | None, more: dict[str, Any]) -> dict:
        return {**base, **meta, **more, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

    events = [chunk({"role": "assistant", "content": "ok"}, None, {})]
    events += [chunk({"content": s}, None, later or {}) for s in SAID[1:n]]
    return [*events, chunk({}, "stop", later or {})]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["first_chunk", "later_chunk"])
def test_another_tenants_text_in_a_streams_first_metadata_values_is_withheld(stack, where):
    """The victim's passage 200 characters a field as a stream's first values: the first chunk's
    ``id``, ``model`` and ``system_fingerprint``, or a ``system_fingerprint`` and a
    ``service_tier`` first sent in a later chunk (each the same in every chunk after, as an
    honest engine repeats them). A field's first value was read only for canaries, so a strict
    tenant received them with 200. Now a first value spelled with a space (another script, other
    punctuation than an engine's ids) is text, as a whole answer's metadata string is: the leak
    index finds the passage, in the first chunk before the response starts (502
    ``response_withheld``), in a later one after it (the stream ends as any withheld stream does,
    nothing of it released)."""
    sc, svc, client = stack
    if where == "first_chunk":
        meta = {"id": PLANTED[0], "model": PLANTED[1], "system_fingerprint": PLANTED[2]}
        sc.events, sc.done = _meta_chunks(meta), True
        _whole(client, svc, "chat", "leak_index", stream=True)
    else:
        later = {"system_fingerprint": PLANTED[0], "service_tier": PLANTED[1]}
        sc.events, sc.done = _meta_chunks({"id": "chatcmpl-8f2a6c1e", "model": "m"}, later), True
        _stream(client, svc, "chat", "leak_index", _withheld_tail)


@pytest.mark.timeout(60)
def test_an_honest_streams_id_like_first_metadata_reaches_a_strict_tenant_as_sent(stack):
    """An honest stream's first values are spelled as ids (``chatcmpl-8f2a6c1e``,
    ``meta-llama/Llama-3.1-8B-Instruct``, ``fp_44709d6fcb``, repeated in every chunk): metadata,
    nothing of them shown to the guard (only the text is), and a strict tenant receives the stream
    byte for byte."""
    sc, svc, client = stack
    events = _meta_chunks(HONEST_META)
    assert _shown(events, parse_chunk_event) == [("0:content", t) for t in ("ok", *SAID[1:4])]
    _relayed(sc, client, "chat", events, done=True)


@pytest.mark.timeout(60)
async def test_a_strict_guard_releases_an_honest_streams_first_chunk_before_its_end(tmp_path):
    """Through the strict guard (a hold-back of 4 tokens) as the relay feeds it (each chunk's text
    and :class:`StreamMeta`'s pieces), a stream of 13 chunks: with honest metadata, spelled as ids,
    7 of them leave before the stream ends, each once 4 checked tokens follow it. With its first
    ``model`` spelled with a space, the first chunk adds text to ``-:model``, which never grows:
    the hold-back never has 4 tokens behind it, so none leaves before the end (all 13 at the end:
    they hold no leak). That is the delay an honest stream is spared by spelling its metadata as
    ids, or by echoing the model name the gateway forwarded (``sent_model``: an operator may
    serve ``"meta llama"``; the relay passes ``upstream_model``): 7 again."""
    svc = build_verifier(verifier_settings(tmp_path, strict_holdback_tokens=4), secrets=SECRETS)
    strict = TenantConfig(id="s", verify_sample_rate=1.0, strict_verify=True)
    try:
        cases = (("meta-llama/Llama-3.1-8B-Instruct", "", 7), ("meta llama", "", 0), ("meta llama", "meta llama", 7))
        for i, (model, sent_model, early) in enumerate(cases):
            events = _meta_chunks({**HONEST_META, "model": model}, n=12)
            request = ExchangeRequest(f"req-{i}", strict, "up", "m", 7, True, time.monotonic())
            guard = svc.begin(Exchange(request, "Tell me about the weather."))
            assert isinstance(guard, StrictGuard)
            meta, sent = StreamMeta(sent_model), []
            for e in events:
                ev = parse_chunk_event(e)
                pieces = list(ev.fields.items())
                meta.check(ev.meta, pieces)
                sent += await guard.feed(ev.text, _sse(e), pieces)
            released = len(sent)
            sent += await guard.finish_stream(usage=None, finish_reason="stop", ttft_seconds=None)
            assert (released, sent) == (early, [_sse(e) for e in events])
        await svc.drain()
        assert (svc.stats["withheld"], list(svc.incidents.recent)) == (0, [])
    finally:
        await svc.aclose()


# ------------------------------------------------------------------ the first chunk's key names
def _first_chunk_names() -> list[str]:
    """The victim's first words, 256 characters of them (about 90 tokens): as many as a first
    chunk may name as metadata behind an OpenAI-compatible server."""
    room, words = META_MAX_CHARS, []
    for w in VICTIM:
        if room < len(w):
            break
        words.append(w)
        room -= len(w)
    return words


def _named_first_chunk_stream() -> list[dict]:
    """A chat stream whose first chunk names the victim's first words as key names of its own."""
    events = [_chunk("ok", role=True, **dict.fromkeys(_first_chunk_names(), 1))] + [_chunk(s) for s in SAID[1:4]]
    return [*events, {**_CHUNK, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}]


@pytest.fixture(scope="module", params=sorted(NAMES_ONLY_PROTOCOL_FIELDS))
def engine_stack(request, tmp_path_factory):
    """``stack`` with the upstream's ``engine`` one whose streams name only the protocol's fields."""
    with _key_stack(tmp_path_factory.mktemp(f"key_channels_{request.param}"), request.param) as stack:
        yield stack


@pytest.mark.timeout(60)
def test_a_first_chunks_key_names_are_text_behind_an_engine_that_names_only_protocol_fields(engine_stack):
    """The victim's first 256 characters of words as key names of a chat stream's first chunk,
    from an upstream whose ``engine`` is vLLM, SGLang or the bundled backend (whose chunks name
    only fields of the protocol, the first included). The first chunk's names were metadata up
    to 256 characters whatever the engine, so a strict tenant received them with 200 (a strict
    ``xfail``). Now they are text there, as a later chunk's are: the leak index finds them before
    the response starts (502 ``response_withheld``)."""
    sc, svc, client = engine_stack
    sc.events, sc.done = _named_first_chunk_stream(), True
    _whole(client, svc, "chat", "leak_index", stream=True)


@pytest.mark.timeout(60)
def test_honest_first_chunks_of_engines_that_name_only_protocol_fields_show_the_guard_only_text():
    """What the relay shows the guard of honest streams when the first chunk may name nothing
    unknown (``first_key_chars=0``): only their text. The bundled backend's own chat chunks
    (``gpu_backend.openai_api.chunk``, ``usage_chunk``) and Responses events
    (``gpu_backend.responses_api.ResponseEvents``), and vLLM's first chunk as its stream
    generator builds it with continuous usage stats (``chat_completion/serving.py``, the
    ``if first_iteration:`` block: ``model_dump_json(exclude_unset=True)`` of
    ``ChatCompletionStreamResponse``)."""
    req = GenRequest("chat", "m", [1, 2], {}, stream=True, include_usage=True)
    bundled = [chunk(req, "chatcmpl-1", role=True), chunk(req, "chatcmpl-1", text="ok")]
    bundled += [chunk(req, "chatcmpl-1", finish_reason="stop"), usage_chunk(req, "chatcmpl-1", 2, 1)]
    events = [json.loads(raw.removeprefix(b"data: ")) for raw in bundled]
    assert _shown(events, parse_chunk_event, first_key_chars=0) == [("0:content", "ok")]
    details = {"reasoning_tokens": 0}
    usage_0 = {"prompt_tokens": 7, "completion_tokens": 0, "total_tokens": 7, "completion_tokens_details": details}
    delta = {"role": "assistant", "content": ""}
    first = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}
    vllm = {"id": "chatcmpl-9", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [first]}
    later = {**vllm, "choices": [{"index": 0, "delta": {"content": "ok"}, "token_ids": [5]}]}
    assert _shown([{**vllm, "usage": usage_0}, later], parse_chunk_event, first_key_chars=0) == [("0:content", "ok")]
    responses = ResponseEvents(GenRequest("responses", "m", [1, 2], {}, stream=True), "resp_abc123")
    raw = responses.start() + responses.delta("ok") + responses.finish("ok", "stop", 2, 1)
    events = [json.loads(e.split(b"data: ", 1)[1]) for e in raw.split(b"\n\n") if e]
    assert _shown(events, parse_response_event, first_key_chars=0) == [("0:0:output_text", "ok")]


# ------------------------------------------------------------------ open: what a strict tenant still receives
@pytest.mark.timeout(60)
@pytest.mark.xfail(
    strict=True,
    reason="open: behind engine 'openai', a chat stream's first chunk sends 256 characters of key names as metadata",
)
def test_open_a_first_chunks_key_names_up_to_256_characters(stack):
    """The same first chunk from an upstream whose ``engine`` is ``openai`` (an OpenAI-compatible
    server, which may name fields of its own there: Azure's ``prompt_filter_results``): metadata,
    so a strict tenant receives them with 200."""
    sc, svc, client = stack
    sc.events, sc.done = _named_first_chunk_stream(), True
    _whole(client, svc, "chat", "leak_index", stream=True)
