"""verifier/engine_response.py: the one reader of an engine's answer (per-choice texts, finish
reason, usage, error objects), on whole bodies and on stream chunks, honest and hostile."""

from __future__ import annotations

from dataclasses import replace

import pytest

from verifier.engine_response import EngineOutput, is_error_payload, parse_body, parse_chunk


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
