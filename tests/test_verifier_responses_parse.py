"""Reading /v1/responses answers (verifier/engine_response.py, its Responses section): every text-bearing event and
output item, usage in chat names, how a response ended, errors; hostile shapes never raise."""

from __future__ import annotations

import pytest

from verifier.engine_response import is_response_error, parse_response_body, parse_response_event, response_usage


@pytest.mark.parametrize(
    "etype",
    [
        "response.output_text.delta",
        "response.refusal.delta",
        "response.reasoning_text.delta",
        "response.reasoning_summary_text.delta",
        "response.function_call_arguments.delta",
    ],
)
def test_every_text_delta_is_text(etype):
    out = parse_response_event({"type": etype, "sequence_number": 7, "output_index": 2, "delta": "abc"})
    assert (out.kind, out.texts, out.text, out.sequence_number) == ("text", {2: "abc"}, "abc", 7)
    assert list(out.fields.values()) == ["abc"] and list(out.fields)[0].startswith("2:0:")


def test_other_events_carry_no_text():
    for ev in (
        {"type": "response.output_text.done", "text": "whole text again"},
        {"type": "response.created", "response": {"id": "r"}},
        {"type": "response.output_text.delta", "delta": ""},
        {"type": "response.output_text.delta", "delta": 5},
    ):
        out = parse_response_event(ev)
        assert out.text == "" and out.fields == {}
        assert out.kind == ("snapshot" if ev["type"].endswith(".done") else "other")


def test_completed_gives_usage_in_chat_names_and_stop():
    out = parse_response_event(
        {
            "type": "response.completed",
            "response": {"status": "completed", "usage": {"input_tokens": 11, "output_tokens": 4}},
        }
    )
    assert out.kind == "terminal" and out.finish_reason == "stop"
    assert out.usage == {"prompt_tokens": 11, "completion_tokens": 4, "total_tokens": 15}
    inc = parse_response_event(
        {
            "type": "response.incomplete",
            "response": {"status": "incomplete", "incomplete_details": {"reason": "max_output_tokens"}},
        }
    )
    assert (inc.finish_reason, inc.usage) == ("length", None)


@pytest.mark.parametrize(
    "usage", [None, {}, {"input_tokens": -1, "output_tokens": 1}, {"input_tokens": True, "output_tokens": 1}, [1, 2]]
)
def test_bad_usage_is_none(usage):
    assert response_usage(usage) is None


def test_error_event_and_failed_response_are_errors():
    e = parse_response_event({"type": "error", "code": "x", "message": "boom", "param": None, "sequence_number": 3})
    assert (e.kind, e.error["message"], e.sequence_number) == ("error", "boom", 3)
    f = parse_response_event({"type": "response.failed", "response": {"status": "failed", "error": {"message": "m"}}})
    assert (f.kind, f.error) == ("error", {"message": "m"})


def test_whole_body_reads_text_reasoning_refusals_and_arguments():
    body = {
        "object": "response",
        "status": "completed",
        "error": None,
        "output": [
            {
                "type": "reasoning",
                "content": [{"type": "reasoning_text", "text": "think "}],
                "summary": [{"text": "sum"}],
            },
            {
                "type": "message",
                "content": [{"type": "output_text", "text": "Hi"}, {"type": "refusal", "refusal": "no"}],
            },
            {"type": "function_call", "arguments": '{"a":1}'},
            "junk",
            {"type": "message", "content": "not a list"},
        ],
        "usage": {"input_tokens": 3, "output_tokens": 2},
    }
    out = parse_response_body(body)
    assert out.texts == {0: "think sum", 1: "Hino", 2: '{"a":1}'}
    assert out.fields == {
        "0:0:reasoning": "think ",
        "0:0:reasoning_summary": "sum",
        "1:0:output_text": "Hi",
        "1:1:refusal": "no",
        "2:0:arguments": '{"a":1}',
        "3:other": "junk",  # every string is read, whatever its shape
        "4:other": "not a list",
    }
    assert (out.kind, out.finish_reason, out.usage["completion_tokens"]) == ("terminal", "stop", 2)
    assert not is_response_error(body)


@pytest.mark.parametrize(
    "body",
    [
        {"error": {"message": "x"}},
        {"object": "error", "message": "x", "code": 400},
        {"status": "failed", "output": [], "error": {"message": "x"}},
    ],
)
def test_error_bodies(body):
    assert is_response_error(body) and parse_response_body(body).kind == "error"


@pytest.mark.parametrize("obj", [None, 1, "x", [], {"type": 5}, {"output": "x"}, {"output": [None, 1]}])
def test_hostile_shapes_never_raise(obj):
    parse_response_event(obj)
    parse_response_body(obj)


def test_events_that_repeat_text_carry_it_as_snapshots_under_the_delta_keys():
    delta = parse_response_event(
        {"type": "response.output_text.delta", "output_index": 1, "content_index": 0, "delta": "Hi"}
    )
    done = parse_response_event(
        {"type": "response.output_text.done", "output_index": 1, "content_index": 0, "text": "Hi"}
    )
    assert list(delta.fields) == list(done.snapshots) == ["1:0:output_text"] and done.text == ""
    item = {"type": "function_call", "arguments": '{"a":1}'}
    assert parse_response_event({"type": "response.output_item.done", "output_index": 2, "item": item}).snapshots == {
        "2:0:arguments": '{"a":1}'
    }
    completed = parse_response_event(
        {
            "type": "response.completed",
            "response": {
                "status": "completed",
                "output": [{"type": "message", "content": [{"type": "output_text", "text": "x"}]}],
            },
        }
    )
    assert (completed.kind, completed.snapshots) == ("terminal", {"0:0:output_text": "x"})
    part = parse_response_event(
        {
            "type": "response.content_part.done",
            "output_index": 0,
            "content_index": 1,
            "part": {"type": "refusal", "refusal": "no"},
        }
    )
    assert part.snapshots == {"0:1:refusal": "no"}


def test_every_string_of_an_item_is_a_text_stream():
    item_fc = {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "lookup", "arguments": "{}"}
    item_ctc = {"type": "custom_tool_call", "call_id": "c", "name": "run", "input": "ls -la"}
    part = {
        "type": "output_text",
        "text": "Hi",
        "annotations": [{"type": "url_citation", "title": "A page", "url": "https://e.x/", "start_index": 0}],
        "logprobs": [{"token": "H", "logprob": -1.0, "top_logprobs": [{"token": "alt"}]}, {"token": "i"}],
    }
    msg = {"type": "message", "id": "m", "status": "completed", "role": "assistant", "content": [part]}
    unknown = {"type": "web_search_call", "id": "ws", "status": "completed", "action": {"query": "weather"}}
    out = parse_response_body({"status": "completed", "output": [item_fc, item_ctc, msg, unknown], "model": "m"})
    assert out.fields == {
        "0:0:arguments": "{}",
        "0:0:name": "lookup",
        "1:0:input": "ls -la",
        "1:0:name": "run",
        "2:0:output_text": "Hi",
        "2:0:annotations": "A page https://e.x/",
        "2:0:logprobs": "Hi",
        "2:0:logprobs_top:0": "alt",
        "3:other": "weather",
    }
    # completion text: names, inputs and outputs; annotations, logprobs and unknown strings are checked only
    assert out.texts == {0: "{}lookup", 1: "ls -larun", 2: "Hi"}


def test_every_string_of_an_event_is_read():
    ann = parse_response_event(
        {
            "type": "response.output_text.annotation.added",
            "output_index": 1,
            "content_index": 0,
            "annotation_index": 0,
            "item_id": "m",
            "annotation": {"type": "url_citation", "title": "T", "url": "https://e.x/"},
        }
    )
    assert (ann.kind, ann.text, ann.fields) == ("other", "", {"1:0:annotations": "T https://e.x/"})
    delta = parse_response_event({"type": "response.custom_tool_call_input.delta", "output_index": 2, "delta": "ls"})
    assert (delta.kind, delta.texts, delta.fields) == ("text", {2: "ls"}, {"2:0:input": "ls"})
    lp = parse_response_event(
        {"type": "response.output_text.delta", "delta": "", "logprobs": [{"token": "x", "logprob": 0}]}
    )
    assert (lp.kind, lp.text, lp.fields) == ("other", "", {"0:0:logprobs": "x"})
    added = parse_response_event(
        {"type": "response.output_item.added", "output_index": 3, "item": {"type": "function_call", "name": "f"}}
    )
    assert added.snapshots == {"3:0:name": "f"} and added.fields == {}
    odd = parse_response_event({"type": "response.something_new", "output_index": 4, "note": {"say": "hello"}})
    # a type outside the protocol's vocabulary is text too (engine_response.RESPONSE_VOCABULARY)
    assert (odd.kind, odd.fields) == ("other", {"4:other": "response.something_new hello"})
    extra = parse_response_event({"type": "response.output_text.delta", "delta": "a", "x_note": "b", "item_id": "m"})
    assert extra.fields == {"0:0:output_text": "a", "0:other": "b"}


def test_an_integral_float_index_keys_the_same_text_as_the_int():
    """JSON's ``1.0`` is 1 to every client (the openai SDK keys output items by it in a dict, where
    ``1.0 == 1``); it was read as 0 here, so a part sent under ``output_index`` 1 and 1.0 by turns
    was two texts to the verifier and one to a client (the relay now refuses such a stream too)."""
    one = parse_response_event(
        {"type": "response.output_text.delta", "output_index": 1, "content_index": 2, "delta": "ab"}
    )
    other = parse_response_event(
        {"type": "response.output_text.delta", "output_index": 1.0, "content_index": 2.0, "delta": "cd"}
    )
    assert (one.fields, other.fields) == ({"1:2:output_text": "ab"}, {"1:2:output_text": "cd"})
    done = parse_response_event(
        {"type": "response.output_text.done", "output_index": 1.0, "content_index": 2.0, "text": "abcd"}
    )
    assert done.snapshots == {"1:2:output_text": "abcd"}
