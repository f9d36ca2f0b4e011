"""verifier/engine_response.py: the one reader of an engine's answer (per-choice texts, finish
reason, usage, error objects), on whole bodies and on stream chunks, honest and hostile."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gateway.relay.stream_protocol import read_response_event
from tests.mock_api_engine import ApiMockState, response_stream
from verifier.engine_response import (
    EngineOutput,
    StreamMeta,
    is_error_payload,
    parse_body,
    parse_chunk,
    parse_chunk_event,
    parse_response_body,
    parse_response_event,
)


def test_whole_chat_body_per_choice_texts_usage_finish():
    body = {
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "Hello"}, "finish_reason": "stop"},
            {"index": 1, "message": {"role": "assistant", "content": ""}, "finish_reason": "length"},
        ],
        "usage": {"prompt_tokens": 11, "completion_tokens": 2},
    }
    out = parse_body(body)
    usage = {"prompt_tokens": 11, "completion_tokens": 2}
    fields = {"0:content": "Hello", "1:content": ""}
    assert out == EngineOutput({0: "Hello", 1: ""}, "stop", usage, False, fields, finished=(0, 1))
    assert out.text == "Hello"


def test_whole_completions_body_and_missing_indexes():
    out = parse_body({"choices": [{"text": "a"}, {"text": "b", "finish_reason": None}, {"text": "c"}]})
    assert (out.texts, out.finish_reason, out.usage, out.text) == ({0: "a", 1: "b", 2: "c"}, None, None, "abc")


def test_chunk_texts_leave_out_empty_deltas_and_read_usage_only_chunk():
    out = parse_chunk({"choices": [{"index": 1, "delta": {"content": "x"}}, {"index": 0, "delta": {"content": ""}}]})
    assert (out.texts, out.usage_only) == ({1: "x"}, False)
    u = parse_chunk({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}})
    assert (u.texts, u.usage, u.usage_only) == ({}, {"prompt_tokens": 3, "completion_tokens": 2}, True)
    role_only = parse_chunk({"choices": [{"index": 0, "delta": {"role": "assistant"}}], "usage": None})
    assert role_only == EngineOutput()


@pytest.mark.parametrize(
    ("obj", "fields"),
    [
        (None, {}),
        ([], {}),
        ("text", {}),
        ({"choices": "nope"}, {"-:other": "nope"}),
        ({"choices": [1, None, "x", []]}, {"-:other": "x"}),
        ({"choices": [{"message": "not an object", "text": 5}]}, {"0:other": "not an object"}),
        ({"choices": [{"delta": {"content": 7}, "finish_reason": 3}], "usage": [1]}, {}),
        ({"choices": [{"index": True, "message": {"content": None}}]}, {}),
    ],
)
def test_hostile_shapes_read_as_no_choice_text(obj, fields):
    """No choice's text; a string where the protocol puts none is still read, as ``other`` text
    the leak check sees (a hostile engine's leak in a wrong-typed field is not released unread)."""
    assert parse_body(obj) == replace(EngineOutput(), fields=fields)
    assert parse_chunk(obj) == replace(EngineOutput(), fields=fields)


def test_repeated_and_bool_indexes():
    # a repeated index adds to the same choice; a bool is not an index (its position is used)
    out = parse_chunk({"choices": [{"index": 0, "text": "a"}, {"index": 0, "text": "b"}, {"index": True, "text": "c"}]})
    assert out.texts == {0: "ab", 2: "c"}


def test_error_payloads():
    assert is_error_payload({"error": {"message": "x"}})
    assert is_error_payload({"object": "error", "message": "x", "code": 400})
    assert not is_error_payload({"error": None, "choices": []})  # a chunk that carries an error field
    assert not is_error_payload({"choices": []})
    assert not is_error_payload(["error"])


# ------------------------------------------------------------------ every text-bearing field
def test_every_text_bearing_field_of_a_whole_chat_body():
    body = {
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": None,
                    "reasoning_content": "think A",
                    "reasoning": "think B",
                    "refusal": "no C",
                    "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"q": "D"}'}},
                        {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "E"}},
                    ],
                    "function_call": {"name": "h", "arguments": "F"},
                    "audio": {"id": "a", "transcript": "G"},
                },
                "logprobs": {"content": [{"token": "x", "logprob": -1.0}, {"token": "y"}], "refusal": None},
                "finish_reason": "tool_calls",
            },
            {"index": 1, "message": {"content": [{"type": "text", "text": "p1"}, {"type": "refusal", "refusal": "r"}]}},
        ]
    }
    out = parse_body(body)
    assert out.fields == {
        "0:reasoning_content": "think A",
        "0:reasoning": "think B",
        "0:refusal": "no C",
        "0:audio": "G",
        "0:tool:0:name": "f",
        "0:tool:0:arguments": '{"q": "D"}',
        "0:tool:1:name": "g",
        "0:tool:1:arguments": "E",
        "0:function_call:name": "h",
        "0:function_call:arguments": "F",
        "0:logprobs": "xy",
        "1:content": "p1",
        "1:refusal": "r",
    }
    # the completion text of each choice: every field but the logprobs (they repeat the text)
    assert out.texts == {0: 'think Athink Bno CGf{"q": "D"}gEhF', 1: "p1r"}
    assert out.finish_reason == "tool_calls"


def test_streamed_tool_call_fragments_and_interleaved_choices():
    chunks = [
        {
            "choices": [
                {
                    "index": 0,
                    "delta": {
                        "role": "assistant",
                        "tool_calls": [
                            {
                                "index": 0,
                                "id": "c1",
                                "type": "function",
                                "function": {"name": "lookup", "arguments": ""},
                            }
                        ],
                    },
                }
            ]
        },
        {"choices": [{"index": 1, "delta": {"reasoning_content": "hm"}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"q": '}}]}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '"x"}'}}]}}]},
        {"choices": [{"index": 1, "delta": {"function_call": {"arguments": "zz"}}, "finish_reason": "stop"}]},
    ]
    outs = [parse_chunk(c) for c in chunks]
    assert [o.fields for o in outs] == [
        {"0:tool:0:name": "lookup"},
        {"1:reasoning_content": "hm"},
        {"0:tool:0:arguments": '{"q": '},
        {"0:tool:0:arguments": '"x"}'},
        {"1:function_call:arguments": "zz"},
    ]
    assert [o.texts for o in outs] == [{0: "lookup"}, {1: "hm"}, {0: '{"q": '}, {0: '"x"}'}, {1: "zz"}]
    assert outs[-1].finish_reason == "stop"


def test_completions_text_and_logprob_tokens():
    out = parse_body(
        {"choices": [{"index": 0, "text": "ab", "logprobs": {"tokens": ["a", "b", 3], "top_logprobs": [{"zz": -1}]}}]}
    )
    assert (out.fields, out.texts) == ({"0:text": "ab", "0:logprobs": "ab", "0:logprobs_top:0": "zz"}, {0: "ab"})
    only_lp = parse_chunk({"choices": [{"index": 0, "text": "", "logprobs": {"tokens": ["q"]}}]})
    assert (only_lp.fields, only_lp.texts, only_lp.text) == ({"0:logprobs": "q"}, {}, "")


@pytest.mark.parametrize(
    ("message", "fields"),
    [
        ({"tool_calls": "nope"}, {"0:other": "nope"}),
        ({"tool_calls": [None, 1, {"function": "x"}, {"function": {"name": 5, "arguments": None}}]}, {"0:other": "x"}),
        ({"function_call": ["a"]}, {"0:other": "a"}),
        ({"reasoning_content": 7, "refusal": None, "audio": {"transcript": 1}}, {}),
        ({"content": [None, {"type": "text", "text": 1}]}, {}),
    ],
)
def test_hostile_field_shapes_read_as_no_choice_text(message, fields):
    out = parse_body({"choices": [{"message": message, "logprobs": {"content": [None, {"token": 1}]}}]})
    assert out == replace(EngineOutput(), fields=fields)


def test_strings_in_fields_kvgate_does_not_know_are_read_as_other_text():
    body = {
        "id": "x",
        "object": "chat.completion",
        "model": "m",
        "x_debug": {"trace": ["leaked A"]},
        "choices": [
            {
                "index": 0,
                "finish_reason": "stop",
                "matched_stop": "\n\n",
                "message": {
                    "role": "assistant",
                    "content": "hi",
                    "x_note": "leaked B",
                    "audio": {"id": "a1", "data": "QUJD", "transcript": "t", "expires_at": 1},
                    "tool_calls": [
                        {"id": "c", "type": "function", "x": "leaked C", "function": {"name": "f", "y": "D"}}
                    ],
                },
            }
        ],
        "usage": {"prompt_tokens": 1},
    }
    out = parse_body(body)
    assert out.fields["0:other"] == "\n\n leaked B leaked C D"
    assert out.fields["-:other"] == "leaked A"
    # the key names that name no field, apart from the values (engine_response._key_names)
    assert out.fields["-:key_names"] == "x_debug trace x_note x y"
    assert out.texts == {0: "hitf"}  # other text is checked, not counted
    # an ordinary chunk has none
    plain = parse_chunk(
        {
            "id": "x",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": "m",
            "system_fingerprint": "fp",
            "choices": [
                {"index": 0, "delta": {"role": "assistant", "content": "a"}, "logprobs": None, "finish_reason": None}
            ],
            "usage": None,
        }
    )
    assert plain.fields == {"0:content": "a"}


# ------------------------------------------------------------------ metadata: canaries and changes
C = "KVGATE-CANARY-0123456789abcdef"
WHOLE = {"id": "c1", "object": "chat.completion", "model": "m", "choices": []}


def _with(choice: dict | None = None, message: dict | None = None) -> dict:
    """A whole chat answer whose one choice has ``choice``'s members and ``message``'s."""
    msg = {"role": "assistant", "content": "hi", **(message or {})}
    return {**WHOLE, "choices": [{"index": 0, "message": msg, "finish_reason": "stop", **(choice or {})}]}


TOOL = {"id": "t", "type": "function", "function": {"name": "f"}}


@pytest.mark.parametrize(
    ("body", "fields"),
    [
        ({**WHOLE, "id": C}, {"-:other": C}),
        ({**WHOLE, "model": C}, {"-:other": C}),
        ({**WHOLE, "system_fingerprint": C}, {"-:other": C}),
        ({**WHOLE, "service_tier": C}, {"-:other": C}),
        ({**WHOLE, C: 1}, {"-:other": C}),
        (_with({"finish_reason": C}), {"0:other": C}),
        (_with({"stop_reason": C}), {"0:other": C}),
        (_with(message={"role": C}), {"0:other": C}),
        (_with(message={C: True}), {"0:other": C}),
        (_with(message={"tool_calls": [{**TOOL, "id": C}]}), {"0:other": C}),
        (_with(message={"tool_calls": [{**TOOL, "type": C}]}), {"0:other": C}),
        (_with(message={"audio": {"id": "a", "data": "QUJD" + C, "transcript": "t"}}), {"0:other": "QUJD" + C}),
        ({**WHOLE, "model": "\u200b".join(C)}, {"-:other": "\u200b".join(C)}),  # the canary scan folds it
    ],
    ids=[
        "id", "model", "system_fingerprint", "service_tier", "top-key", "finish_reason", "stop_reason", "role",
        "message-key", "tool-id", "tool-type", "audio-data", "zero-width",
    ],
)  # fmt: skip
def test_a_canary_in_metadata_or_an_identifier_key_is_read_whatever_its_length(body, fields):
    """Metadata (ids, names, a role, a finish reason, a tool call's type), opaque data (base64
    audio) and key names that are identifiers are not text, but a canary in any of them reaches
    the client: it is read as ``other`` text. Before, each of these was skipped (at most 256
    characters, or any length for the audio)."""
    out = parse_body(body)
    assert {k: v for k, v in out.fields.items() if k.endswith(":other")} == fields


def _chunk(content: str = "a", *, fingerprint: str | None = None, vllm: bool = False, **top) -> dict:
    """A chat stream's chunk saying ``content``, with ``system_fingerprint`` when ``fingerprint``
    is given, ``token_ids`` in its choice when ``vllm`` (a vLLM chunk), and ``top`` at its top."""
    choice = {"index": 0, "delta": {"content": content}, "logprobs": None, "finish_reason": None}
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        **({} if fingerprint is None else {"system_fingerprint": fingerprint}),
        "choices": [{**choice, "token_ids": [5]} if vllm else choice],
        **top,
    }


def _pieces(meta: StreamMeta, obj: dict, parse=parse_chunk_event) -> list[tuple[str, str]]:
    """What the relay hands the guard of one chunk (gateway/relay/stream.py, ``_Events._pieces``);
    ``parse``: the event's reader (:func:`_rpieces`: a Responses event's)."""
    ev = parse(obj)
    pieces = list(ev.fields.items())
    if ev.meta:
        meta.check(ev.meta, pieces)
    return pieces


def test_a_streams_metadata_is_skipped_only_while_it_repeats_its_first_value():
    """An honest stream repeats ``id``, ``model`` and ``system_fingerprint``: the guard is shown
    its text alone, chunk after chunk. A ``system_fingerprint`` that changes is text from its
    first change on (joined after the first value, as a client joins them), every value of it
    after, the first one again too; a first value not spelled as an id (``"the sec"``) is text
    from the start. Before, each value up to 256 characters was skipped, and then the first."""
    ev = parse_chunk_event({**_chunk(fingerprint="fp"), "choices": [{"index": 0, "delta": {"role": "assistant"}}]})
    assert list(ev.meta) == [
        ("-:message.role", "assistant"),
        ("-:id", "chatcmpl-1"),
        ("-:object", "chat.completion.chunk"),
        ("-:model", "m"),
        ("-:system_fingerprint", "fp"),
    ]
    honest = StreamMeta()
    assert [_pieces(honest, _chunk(t, fingerprint="fp")) for t in ("a", "b", "c")] == [
        [("0:content", "a")],
        [("0:content", "b")],
        [("0:content", "c")],
    ]
    hostile = StreamMeta()
    got = [_pieces(hostile, _chunk("", fingerprint=fp)) for fp in ("the sec", "ret prompt", " of b", "the sec")]
    assert got == [
        [("-:system_fingerprint", "the sec")],
        [("-:system_fingerprint", "the secret prompt")],
        [("-:system_fingerprint", " of b")],
        [("-:system_fingerprint", "the sec")],
    ]


def test_a_streams_first_metadata_value_is_read_for_canaries():
    """A canary in a stream's first ``id`` is shown to the guard once; the same ``id`` after it
    costs a comparison. A canary in a Responses event's metadata is read where it is."""
    meta = StreamMeta()
    assert _pieces(meta, _chunk(fingerprint="fp", id=C)) == [("0:content", "a"), ("-:id", C)]
    assert _pieces(meta, _chunk(fingerprint="fp", id=C)) == [("0:content", "a")]
    event = {"type": "response.output_text.delta", "item_id": C, "output_index": 0, "content_index": 0, "delta": "hi"}
    assert parse_response_event(event).fields == {"0:0:output_text": "hi", "0:other": C}


# ------------------------------------------------------------------ key names that name no field
def test_a_whole_answers_key_names_that_name_no_field_are_text_apart_from_its_values():
    """A whole answer's identifier key names outside the protocol's fields (OpenAI's, vLLM's,
    SGLang's: ``KEY_NAMES``) are its ``-:key_names`` text, each once, apart from the values (one
    before each value, they would break up the text the leak index looks for). Before, they were
    read only for canaries. Honest vLLM and SGLang answers, their own fields included, have none;
    nor are a completions alternative's tokens (read as the alternatives) key names."""
    secret = parse_body(_with({"the_secret_of_tenant_b": 1}, {"iban_de89": {"x_note": "zqa"}}))
    assert (secret.fields["-:key_names"], secret.fields["0:other"]) == (
        "the_secret_of_tenant_b iban_de89 x_note",
        "zqa",
    )
    vllm = {
        **_with({"stop_reason": None, "token_ids": [1, 2]}, {"reasoning": "r", "annotations": None}),
        "prompt_logprobs": [None, {"9906": {"logprob": -1.0, "rank": 1, "decoded_token": "Hi"}}],
        "prompt_token_ids": [1],
        "kv_transfer_params": None,
        "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3, "prompt_tokens_details": None},
    }
    sglang = {
        **_with({"matched_stop": 2, "hidden_states": [0.5], "meta_info": {"id": "r"}}),
        "metadata": None,
        "sglext": {"routed_experts": "e", "cached_tokens_details": {"device": 1, "host": 0}},
        "usage": {"prompt_tokens": 1, "reasoning_tokens": 0, "prompt_tokens_details": {"cached_tokens": 0}},
    }
    assert parse_body(vllm).fields == {"0:content": "hi", "0:reasoning": "r", "-:other": "Hi"}
    assert parse_body(sglang).fields == {"0:content": "hi", "0:other": "r", "-:other": "e"}
    completions = parse_body({"choices": [{"text": "a", "logprobs": {"tokens": ["a"], "top_logprobs": [{"zz": -1}]}}]})
    assert "-:key_names" not in completions.fields


def test_a_streams_new_key_names_are_text_once_after_its_first_chunk():
    """In a stream, the key names of the first chunk that name no field are metadata (up to 256
    characters of them), and so are they when repeated; a name first sent in a later chunk is
    text, once, of ``-:key_names`` (each its own piece: the name and a space), wherever it sits
    (inside ``usage`` too). Before, every identifier key name was read only for canaries: a new
    one per chunk spelled another tenant's text unread. An honest vLLM chunk holds no key name
    for the relay to compare: its metadata is what it was."""
    assert not [m for m in parse_chunk_event(_chunk("a", vllm=True)).meta if m[0] == "-:key_names"]
    meta = StreamMeta()
    got = [
        _pieces(meta, _chunk("a", vllm=True, x_engine_step=1)),
        _pieces(meta, _chunk("b", vllm=True, x_engine_step=2)),
        _pieces(meta, _chunk("", vllm=True, x_engine_step=3, the_secret_of_tenant_b=1)),
        _pieces(meta, _chunk("", vllm=True, x_engine_step=4, the_secret_of_tenant_b=1, iban_de89=1)),
        _pieces(meta, {**_chunk("", vllm=True), "choices": [], "usage": {"prompt_tokens": 1, "x_note": 1}}),
        _pieces(meta, _chunk("", vllm=True, **{C: 1})),
    ]
    assert got == [
        [("0:content", "a")],
        [("0:content", "b")],
        [("-:key_names", "the_secret_of_tenant_b ")],
        [("-:key_names", "iban_de89 ")],
        [("-:key_names", "x_note ")],
        [("-:other", C)],  # a canary is read where it is, as before
    ]
    crowded = StreamMeta()  # past 256 characters, a first chunk's names are text too
    names = {f"k{n:03d}_{'x' * 55}": 1 for n in range(5)}  # 60 characters each
    assert _pieces(crowded, _chunk("a", vllm=True, **names)) == [
        ("0:content", "a"),
        ("-:key_names", list(names)[4] + " "),
    ]


def _rpieces(meta: StreamMeta, obj: dict) -> list[tuple[str, str]]:
    """What the relay hands the guard of one Responses event, its snapshots left out."""
    return _pieces(meta, obj, parse_response_event)


def test_a_responses_events_metadata_is_a_word_of_its_vocabulary_or_an_id_the_stream_introduced():
    """A Responses value of a fixed vocabulary (``type``, ``status``, ``role``, ...) is metadata
    only while it is one of its words; ``obfuscation`` (OpenAI's padding; vLLM and SGLang send
    none) is text; an ``item_id`` is metadata only when it names an item the stream introduced
    (an item's ``id`` in ``response.output_item.added``, or in a ``response``'s output), a
    ``response``'s ``id`` and ``model`` only while they repeat the first. Before, each was skipped
    up to 256 characters. The mock vLLM stream shows the guard nothing of its metadata."""
    honest = StreamMeta()
    for raw in response_stream(ApiMockState(text="hello there"), {"input": "hi"}):
        ev = read_response_event(raw)
        pieces = list(ev.fields.items())
        honest.check(ev.meta, pieces)
        assert [p for p in pieces if p[0] in ("-:item_ids", "-:response.id", "-:response.model")] == []
    delta = {"type": "response.output_text.delta", "item_id": "msg_1", "output_index": 0, "content_index": 0}
    added = {"type": "response.output_item.added", "output_index": 0, "item": {"type": "message", "id": "msg_1"}}
    resp = {"type": "response.in_progress", "response": {"id": "resp_1", "model": "m", "status": "in_progress"}}
    meta = StreamMeta()
    got = [
        _rpieces(meta, {**delta, "delta": "a"}),
        _rpieces(meta, added),
        _rpieces(meta, {**delta, "delta": "b"}),
        _rpieces(meta, {**delta, "delta": "", "obfuscation": "the secret"}),
        _rpieces(meta, {**delta, "delta": "", "status": "of tenant b"}),
        _rpieces(meta, {**delta, "delta": "", "status": "in_progress", "role": "assistant"}),
        _rpieces(meta, resp),
        _rpieces(meta, {**resp, "response": {**resp["response"], "model": "n"}}),
    ]
    assert got == [
        [("0:0:output_text", "a"), ("-:item_ids", "msg_1 ")],  # no item was added yet
        [],
        [("0:0:output_text", "b")],
        [("0:other", "the secret")],
        [("0:other", "of tenant b")],
        [],
        [],
        [("-:response.model", "mn")],
    ]
    odd = parse_response_event({**added, "item": {"type": "a note", "id": "msg_1", "role": "reader"}})
    assert odd.snapshots == {"0:other": "a note reader"}  # an item's strings are what the event repeats
    whole = parse_response_body({"output": [{"type": "message", "id": "m", "status": "the secret", "content": []}]})
    assert whole.fields == {"0:other": "the secret"}


def test_a_responses_stream_introduces_item_ids_up_to_a_bound():
    """A stream's items introduce their ids up to ``ITEM_IDS_MAX_CHARS`` characters in all: an
    engine that adds an item an event cannot send 256 characters of text in each one's id. Past
    the bound an added item's id is text, once: an ``item_id`` naming it afterwards is not."""
    from verifier.engine_response import ITEM_IDS_MAX_CHARS

    meta = StreamMeta()
    ids = [f"msg_{n:03d}_{'x' * 200}" for n in range(ITEM_IDS_MAX_CHARS // 208 + 1)]  # 208 characters each
    got = [
        _rpieces(meta, {"type": "response.output_item.added", "output_index": k, "item": {"type": "message", "id": i}})
        for k, i in enumerate(ids)
    ]
    assert got == [[]] * (len(ids) - 1) + [[("-:item_ids", ids[-1] + " ")]]
    delta = {"type": "response.output_text.delta", "item_id": ids[-1], "output_index": len(ids) - 1, "delta": "a"}
    assert _rpieces(meta, delta) == [(f"{len(ids) - 1}:0:output_text", "a")]
