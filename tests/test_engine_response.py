"""verifier/engine_response.py: the one reader of an engine's answer (per-choice texts, finish
reason, usage, error objects), on whole bodies and on stream chunks, honest and hostile."""

from __future__ import annotations

from dataclasses import replace

import pytest

from verifier.engine_response import (
    EngineOutput,
    StreamMeta,
    is_error_payload,
    parse_body,
    parse_chunk,
    parse_chunk_event,
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


def _chunk_obj(fingerprint: str, content: str = "a", **top) -> dict:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "system_fingerprint": fingerprint,
        "choices": [{"index": 0, "delta": {"content": content}, "logprobs": None, "finish_reason": None}],
        **top,
    }


def _pieces(meta: StreamMeta, obj: dict) -> list[tuple[str, str]]:
    """What the relay hands the guard of one chunk (gateway/relay/stream.py, ``_Events._pieces``)."""
    ev = parse_chunk_event(obj)
    pieces = list(ev.fields.items())
    if ev.meta:
        meta.check(ev.meta, pieces)
    return pieces


def test_a_streams_metadata_is_skipped_only_while_it_repeats_its_first_value():
    """An honest stream repeats ``id``, ``model`` and ``system_fingerprint``: the guard is shown
    its text alone, chunk after chunk. A ``system_fingerprint`` that changes is text from its
    first change on (joined after the first value, as a client joins them), every value of it
    after, the first one again too. Before, each value up to 256 characters was skipped."""
    ev = parse_chunk_event({**_chunk_obj("fp"), "choices": [{"index": 0, "delta": {"role": "assistant"}}]})
    assert list(ev.meta) == [
        ("-:message.role", "assistant"),
        ("-:id", "chatcmpl-1"),
        ("-:object", "chat.completion.chunk"),
        ("-:model", "m"),
        ("-:system_fingerprint", "fp"),
    ]
    honest = StreamMeta()
    assert [_pieces(honest, _chunk_obj("fp", t)) for t in ("a", "b", "c")] == [
        [("0:content", "a")],
        [("0:content", "b")],
        [("0:content", "c")],
    ]
    hostile = StreamMeta()
    got = [_pieces(hostile, _chunk_obj(fp, "")) for fp in ("the sec", "ret prompt", " of b", "the sec")]
    assert got == [
        [],
        [("-:system_fingerprint", "the secret prompt")],
        [("-:system_fingerprint", " of b")],
        [("-:system_fingerprint", "the sec")],
    ]


def test_a_streams_first_metadata_value_is_read_for_canaries():
    """A canary in a stream's first ``id`` is shown to the guard once; the same ``id`` after it
    costs a comparison. A canary in a Responses event's metadata is read where it is."""
    meta = StreamMeta()
    assert _pieces(meta, _chunk_obj("fp", id=C)) == [("0:content", "a"), ("-:id", C)]
    assert _pieces(meta, _chunk_obj("fp", id=C)) == [("0:content", "a")]
    event = {"type": "response.output_text.delta", "item_id": C, "output_index": 0, "content_index": 0, "delta": "hi"}
    assert parse_response_event(event).fields == {"0:0:output_text": "hi", "0:other": C}
