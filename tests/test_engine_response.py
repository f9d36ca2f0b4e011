"""verifier/engine_response.py: the one reader of an engine's answer (per-choice texts, finish
reason, usage, error objects), on whole bodies and on stream chunks, honest and hostile."""

from __future__ import annotations

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
    assert out == EngineOutput({0: "Hello", 1: ""}, "stop", {"prompt_tokens": 11, "completion_tokens": 2}, False)
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
    "obj",
    [
        None,
        [],
        "text",
        {"choices": "nope"},
        {"choices": [1, None, "x", []]},
        {"choices": [{"message": "not an object", "text": 5}]},
        {"choices": [{"delta": {"content": 7}, "finish_reason": 3}], "usage": [1]},
        {"choices": [{"index": True, "message": {"content": None}}]},
    ],
)
def test_hostile_shapes_read_as_nothing(obj):
    assert parse_body(obj) == EngineOutput()
    assert parse_chunk(obj) == EngineOutput()


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
