"""tokenizer/engine_render.py, exact values: the messages each engine hands to a "string"-format
chat template (kvgate's ChatML), and the counts that follow from them.

Every expected value below is written from the engine rule the module cites, not from kvgate's
output:

- vLLM ``vllm/entrypoints/chat_utils.py@001eadcf``: ``_parse_chat_message_content`` (``None`` is no
  parts, a string one text part; the message rebuilt from ``role``/``content``, an assistant's
  ``tool_calls`` when not ``None`` and ``reasoning`` also as ``reasoning_content``, a tool
  message's ``tool_call_id``, a string ``name``); ``_parse_chat_message_content_parts`` (``if
  parse_res``: an empty text is dropped, as an image is without ``--interleave-mm-strings``;
  ``"\\n".join(texts)``); ``_get_full_multimodal_text_prompt`` (the placeholders in front, joined
  with ``"\\n"``; ``if text_prompt`` else the placeholders alone); ``_get_interleaved_text_prompt``
  (each placeholder where its image was, ``"\\n".join``); ``_postprocess_messages`` (an empty
  ``tool_calls`` popped; a string ``arguments`` ``json.loads``-ed, ``{}`` when invalid; neither a
  string, dict nor list: ``{}``).
- SGLang ``serving_chat.py@002897c2`` ``_apply_jinja_template`` (``None`` content becomes ``""``;
  ``normalize_assistant_tool_call_arguments``: ``orjson.loads``, refused unless an object;
  ``_handle_last_assistant_message``: a final assistant turn with string content becomes
  ``{"role": "user", "content": ...}``) and ``jinja_template_utils.py@0b9c3848``
  ``process_content_for_template_format`` ("string": ``text``/``input_text`` parts joined with a
  space, ``"" if no text part``, images dropped, ``None`` values dropped); ``ToolCall`` dumped as
  ``{id, index, type, function: {name, arguments}}`` (``protocol.py@004c82e0``).
"""

from __future__ import annotations

from typing import Any

import pytest

from tokenizer.engine_render import (
    DroppedImage,
    ParsedArguments,
    chatml_view,
    chatml_views,
    sglang_arguments,
    sglang_call,
    sglang_chatml_content,
    sglang_messages,
    sglang_text,
    views_of,
    vllm_arguments,
    vllm_messages,
    vllm_string_content,
    vllm_string_messages,
    wrap_parsed,
)
from tokenizer.errors import InvalidPromptError
from tokenizer.tiktoken_counter import bundled_counter

IMG = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
IMG2 = {"type": "image_url", "image_url": {"url": "data:image/png;base64,BBBB"}}
INPUT_IMG = {"type": "input_image", "image_url": "data:image/png;base64,CCCC"}
NL = {"type": "text", "text": "\n"}


def _t(text: str) -> dict[str, str]:
    return {"type": "text", "text": text}


# ---- vLLM: content as a "string"-format template gets it -----------------------------------------
@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (None, ""),  # no parts: "\n".join([])
        ("plain", "plain"),  # one text part
        ([_t("a"), _t("b")], "a\nb"),
        ([_t(""), _t("x"), _t("")], "x"),  # ``if parse_res``: "" is not kept
        ([{"type": "refusal", "refusal": "no"}], "no"),  # a refusal part is its string
        ([_t("a"), {"type": "refusal", "refusal": "b"}, _t("c")], "a\nb\nc"),
        ([], ""),
    ],
)
def test_vllm_text_only_content_is_its_texts_joined_by_a_line_break(content: Any, expected: str) -> None:
    assert vllm_string_content(content) == expected
    assert vllm_string_content(content, interleave=True) == expected  # no image: the same text


def test_vllm_images_go_in_front_each_followed_by_a_line_break() -> None:
    """``"\\n".join(missing_placeholders + [text_prompt])``: every image first, in order, then the
    texts joined by ``"\\n"``; each separator is its own text part."""
    content = [_t("a"), IMG, _t("b"), IMG2, _t("c")]
    assert vllm_string_content(content) == [IMG, NL, IMG2, NL, _t("a\nb\nc")]
    assert vllm_string_content(content, False) == vllm_string_content(content)


def test_vllm_images_without_text_are_the_placeholders_alone() -> None:
    """``if text_prompt`` else ``"\\n".join(missing_placeholders)``: no trailing line break; an
    empty text part leaves no text."""
    assert vllm_string_content([IMG]) == [IMG]
    assert vllm_string_content([_t(""), IMG, IMG2]) == [IMG, NL, IMG2]


def test_vllm_input_image_is_an_image_too() -> None:
    assert vllm_string_content([_t("x"), INPUT_IMG]) == [INPUT_IMG, NL, _t("x")]
    assert vllm_string_content([_t("x"), INPUT_IMG], interleave=True) == [_t("x"), NL, INPUT_IMG]


def test_vllm_interleaved_images_stay_where_they_were() -> None:
    """``--interleave-mm-strings``: the placeholder is a part of its own, joined with the texts by
    ``"\\n"``; an empty text is still dropped."""
    content = [_t("a"), IMG, _t(""), _t("b"), IMG2]
    assert vllm_string_content(content, interleave=True) == [_t("a"), NL, IMG, NL, _t("b"), NL, IMG2]


def test_vllm_string_messages_default_to_images_in_front() -> None:
    messages = [{"role": "user", "content": [_t("a"), IMG, _t("b")]}]
    front = [{"role": "user", "content": [IMG, NL, _t("a\nb")]}]
    assert vllm_string_messages(messages) == front
    assert vllm_string_messages(messages, interleave=True) == [
        {"role": "user", "content": [_t("a"), NL, IMG, NL, _t("b")]}
    ]


# ---- vLLM: the rebuilt message -------------------------------------------------------------------
def test_vllm_rebuilds_each_message_from_its_known_keys() -> None:
    messages = [
        {"role": "system", "content": "s", "name": "boss", "extra": 1, "tool_call_id": "t"},
        {"role": "user", "content": [_t("u")], "name": 7, "reasoning": "r"},
        {
            "role": "assistant",
            "content": None,
            "reasoning": "why",
            "reasoning_content": "ignored",
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get", "arguments": '{"x": 1e15}'}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "ok", "name": "get"},
        {"role": "assistant", "content": "done", "reasoning_content": "alone", "tool_calls": []},
    ]
    assert vllm_messages(messages) == [
        {"role": "system", "content": "s", "name": "boss"},
        {"role": "user", "content": [_t("u")]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get", "arguments": {"x": 1e15}}}],
            "reasoning": "why",
            "reasoning_content": "why",
        },
        {"role": "tool", "content": "ok", "tool_call_id": "c1", "name": "get"},
        {"role": "assistant", "content": "done"},
    ]
    assert messages[2]["tool_calls"][0]["function"]["arguments"] == '{"x": 1e15}'  # the input is not modified


def test_vllm_assistant_without_tool_calls_or_reasoning_gets_neither_key() -> None:
    assert vllm_messages([{"role": "assistant", "content": "a", "tool_calls": None, "reasoning": None}]) == [
        {"role": "assistant", "content": "a"}
    ]


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        ('{"a": [1, 2.5]}', {"a": [1, 2.5]}),
        ("[1, 2]", [1, 2]),  # any JSON value json.loads returns
        ('"s"', "s"),
        ("{not json", {}),  # JSONDecodeError: {}
        ("", {}),
        (None, {}),  # neither a string, dict nor list: {}
        (5, {}),
        ({"k": "v"}, {"k": "v"}),
        ([3], [3]),
    ],
)
def test_vllm_arguments_are_parsed_as_postprocess_messages_does(arguments: Any, expected: Any) -> None:
    assert vllm_arguments(arguments, "p") == expected
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}
    out = vllm_messages([{"role": "assistant", "content": "", "tool_calls": [call]}])
    assert out[0]["tool_calls"] == [{"id": "c", "type": "function", "function": {"name": "f", "arguments": expected}}]


def test_vllm_arguments_json_cannot_read_are_refused_naming_them() -> None:
    with pytest.raises(InvalidPromptError) as e:
        vllm_arguments("1" * 5000, "messages[2].tool_calls[1].function.arguments")
    assert e.value.param == "messages[2].tool_calls[1].function.arguments"
    call = {"function": {"name": "f", "arguments": "[" * 100_000}}
    with pytest.raises(InvalidPromptError) as e:
        vllm_messages([{"role": "user", "content": "u"}, {"role": "assistant", "content": "", "tool_calls": [call]}])
    assert e.value.param == "messages[1].tool_calls[0].function.arguments"


# ---- SGLang: content as a "string"-format template gets it ---------------------------------------
@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (None, ""),  # ``if msg_dict.get("content") is None: msg_dict["content"] = ""``
        ("plain", "plain"),
        ([_t("a"), _t("b")], "a b"),
        ([_t("a"), _t(""), {"type": "input_text", "text": "b"}], "a  b"),  # an empty text part is kept
        ([{"type": "refusal", "refusal": "r"}, _t("a")], "a"),  # not a text part
        ([IMG, _t("a"), INPUT_IMG], "a"),  # images dropped
        ([IMG], ""),  # ``" ".join(text_parts) if text_parts else ""``
        ([], ""),
    ],
)
def test_sglang_content_is_its_texts_joined_by_a_space(content: Any, expected: str) -> None:
    assert sglang_text(content) == expected


def test_sglang_chatml_content_keeps_each_dropped_image_after_the_text() -> None:
    assert sglang_chatml_content([_t("a"), IMG, _t("b"), INPUT_IMG]) == [
        _t("a b"),
        DroppedImage(IMG),
        DroppedImage(INPUT_IMG),
    ]
    assert sglang_chatml_content([IMG]) == [_t(""), DroppedImage(IMG)]
    assert sglang_chatml_content([_t("a"), _t("b")]) == "a b"  # no image: a string
    assert sglang_chatml_content("s") == "s"
    assert sglang_chatml_content(None) == ""


# ---- SGLang: the rebuilt conversation ------------------------------------------------------------
def test_sglang_dumps_tool_calls_and_rewrites_the_final_assistant_turn() -> None:
    messages = [
        {"role": "system", "content": None, "name": None},
        {"role": "user", "content": [_t("q1"), _t("q2")], "name": "ann"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get", "arguments": '{"x": 1}'}, "extra": 1},
                {"function": {"arguments": {"y": 2}}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": [_t("r1"), _t("r2")]},
        {"role": "assistant", "content": [_t("fin"), _t("al")], "name": "bot", "tool_calls": []},
    ]
    assert sglang_messages(messages) == [
        {"role": "system", "content": ""},
        {"role": "user", "content": "q1 q2", "name": "ann"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c1", "index": None, "type": "function", "function": {"name": "get", "arguments": {"x": 1}}},
                {"id": None, "index": None, "type": "function", "function": {"name": None, "arguments": {"y": 2}}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "r1 r2"},
        {"role": "user", "content": "fin al"},
    ]


def test_sglang_only_the_last_turn_is_rewritten_and_only_an_assistant_one() -> None:
    assert sglang_messages([{"role": "assistant", "content": "a"}, {"role": "user", "content": "u"}]) == [
        {"role": "assistant", "content": "a"},
        {"role": "user", "content": "u"},
    ]
    assert sglang_messages([{"role": "assistant", "content": "only"}]) == [{"role": "user", "content": "only"}]
    assert sglang_messages([{"role": "user", "content": "a"}, {"role": "tool", "content": "t"}]) == [
        {"role": "user", "content": "a"},
        {"role": "tool", "content": "t"},
    ]


def test_sglang_call_is_the_tool_call_dump() -> None:
    call = {"id": "i", "index": 3, "type": "function", "function": {"name": "n", "arguments": '{"k": [1]}', "z": 0}}
    assert sglang_call(call, 0, 0) == {
        "id": "i",
        "index": 3,
        "type": "function",
        "function": {"name": "n", "arguments": {"k": [1]}},
    }
    assert sglang_call({"function": {"name": "n"}}, 0, 0) == {
        "id": None,
        "index": None,
        "type": "function",
        "function": {"name": "n", "arguments": None},
    }


@pytest.mark.parametrize("arguments", ["[1, 2]", '"s"', "1", "{bad", '{"a": NaN}'])
def test_sglang_refuses_arguments_that_are_not_a_json_object(arguments: str) -> None:
    with pytest.raises(InvalidPromptError) as e:
        sglang_arguments(arguments, "p")
    assert e.value.param == "p"
    call = {"function": {"name": "f", "arguments": arguments}}
    with pytest.raises(InvalidPromptError) as e:
        sglang_messages([{"role": "user", "content": "u"}, {"role": "assistant", "content": "", "tool_calls": [call]}])
    assert e.value.param == "messages[1].tool_calls[0].function.arguments"


def test_sglang_arguments_not_a_string_are_kept_as_sent() -> None:
    assert sglang_arguments({"a": 1}, "p") == {"a": 1}
    assert sglang_arguments([1], "p") == [1]
    assert sglang_arguments('{"a": 1}', "p") == {"a": 1}


# ---- the views the ChatML counter renders --------------------------------------------------------
@pytest.mark.parametrize(
    ("engines", "expected"),
    [
        (frozenset(), [None]),
        (frozenset({"kvgate"}), [None]),
        (frozenset({"openai"}), [None]),
        (frozenset({"vllm"}), ["vllm"]),
        (frozenset({"sglang"}), ["sglang"]),
        (frozenset({"vllm", "sglang"}), ["sglang", "vllm"]),
        (frozenset({"vllm", "kvgate"}), [None, "vllm"]),
        (frozenset({"sglang", "openai", "vllm"}), [None, "sglang", "vllm"]),
    ],
)
def test_views_of_engines(engines: frozenset[str], expected: list[str | None]) -> None:
    assert views_of(engines) == expected


CALL = {"id": "c", "type": "function", "function": {"name": "get", "arguments": '{"v": 1e15}'}}
CHAT = [
    {"role": "user", "content": [_t("a"), IMG, _t("b")]},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "c", "content": "ok"},
    {"role": "assistant", "content": [_t("x"), _t("y")]},
]
PARSED_CALL = {"id": "c", "type": "function", "function": {"name": "get", "arguments": ParsedArguments({"v": 1e15})}}


def test_chatml_views_vllm_are_both_image_layouts() -> None:
    assert chatml_views(CHAT, "vllm") == [
        [
            {"role": "user", "content": [IMG, NL, _t("a\nb")]},
            {"role": "assistant", "content": "", "tool_calls": [PARSED_CALL]},
            {"role": "tool", "content": "ok", "tool_call_id": "c"},
            {"role": "assistant", "content": "x\ny"},
        ],
        [
            {"role": "user", "content": [_t("a"), NL, IMG, NL, _t("b")]},
            {"role": "assistant", "content": "", "tool_calls": [PARSED_CALL]},
            {"role": "tool", "content": "ok", "tool_call_id": "c"},
            {"role": "assistant", "content": "x\ny"},
        ],
    ]
    assert chatml_view(CHAT, "vllm") == chatml_views(CHAT, "vllm")[0]


def test_chatml_views_vllm_without_an_image_is_one_view() -> None:
    chat = [{"role": "user", "content": [_t("a"), _t("b")]}, {"role": "assistant", "content": "z"}]
    assert chatml_views(chat, "vllm") == [[{"role": "user", "content": "a\nb"}, {"role": "assistant", "content": "z"}]]


def test_chatml_views_sglang_is_one_view_with_the_last_turn_rewritten() -> None:
    assert chatml_views(CHAT, "sglang") == [
        [
            {"role": "user", "content": [_t("a b"), DroppedImage(IMG)]},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": "c",
                        "index": None,
                        "type": "function",
                        "function": {"name": "get", "arguments": ParsedArguments({"v": 1e15})},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c", "content": "ok"},
            {"role": "user", "content": "x y"},
        ]
    ]


@pytest.mark.parametrize("engine", [None, "kvgate", "openai"])
def test_chatml_views_of_other_engines_are_the_messages_as_sent(engine: str | None) -> None:
    views = chatml_views(CHAT, engine)
    assert views == [CHAT]
    assert views[0] is CHAT


def test_wrap_parsed_wraps_each_call_s_arguments_only() -> None:
    no_args = {"id": "n", "function": {"name": "f"}}
    messages = [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "a", "function": {"name": "f", "arguments": [1]}}, no_args],
        },
        {"role": "assistant", "content": "", "tool_calls": []},
        {"role": "user", "content": "u"},
    ]
    assert wrap_parsed(messages) == [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "a", "function": {"name": "f", "arguments": ParsedArguments([1])}}, no_args],
        },
        {"role": "assistant", "content": "", "tool_calls": []},
        {"role": "user", "content": "u"},
    ]


# ---- counts: each engine's rendering, exactly -----------------------------------------------------
@pytest.fixture(scope="module")
def counter():
    return bundled_counter()


def _count(counter, messages, engines) -> int:
    counter.engines = frozenset(engines)
    try:
        return counter.count_chat(messages)
    finally:
        counter.engines = frozenset()


def _chatml(counter, *turns: str) -> int:
    """Tokens of ChatML turns written out by hand (each ``role\\ncontent`` between the two
    specials, ``\\n`` after each, then the generation prompt)."""
    return (
        sum(2 + counter.count_text(t) + counter.count_text("\n") for t in turns) + 1 + counter.count_text("assistant\n")
    )


def test_counts_are_of_the_text_each_engine_joins(counter) -> None:
    """Parts ``"x"``, ``"y"``: kvgate's own template concatenates them, vLLM joins them with
    ``\\n``, SGLang with a space; a trailing assistant turn is a user turn for SGLang."""
    chat = [{"role": "user", "content": [_t("x"), _t("y")]}, {"role": "assistant", "content": "ok then"}]
    as_sent = _chatml(counter, "user\nxy", "assistant\nok then")
    vllm = _chatml(counter, "user\nx\ny", "assistant\nok then")
    sglang = _chatml(counter, "user\nx y", "user\nok then")
    assert (as_sent, vllm, sglang) == (16, 18, 17)
    assert _count(counter, chat, {"kvgate"}) == as_sent
    assert _count(counter, chat, {"vllm"}) == vllm
    assert _count(counter, chat, {"sglang"}) == sglang
    assert _count(counter, chat, {"sglang", "vllm", "kvgate"}) == max(as_sent, vllm, sglang) == 18


def test_vllm_count_of_an_empty_text_part_is_no_separator(counter) -> None:
    """``if parse_res``: ``["", "x", ""]`` is ``"x"`` for vLLM (no ``\\n`` around it); SGLang keeps
    the empty parts: ``" x "``."""
    chat = [{"role": "user", "content": [_t(""), _t("x"), _t("")]}]
    assert _count(counter, chat, {"vllm"}) == _chatml(counter, "user\nx") == 9
    assert _count(counter, chat, {"sglang"}) == _chatml(counter, "user\n x ") == 10


def test_vllm_count_of_the_image_layouts_is_the_larger(counter) -> None:
    """Texts ``x.``, ``y.`` then an image: in front, ``<image>\\nx.\\ny.``; in place,
    ``x.\\ny.\\n<image>``. The image costs ``image_tokens`` and the text is cut around it (the
    engine's placeholder is a special token): pieces ``user\\n`` + ``\\nx.\\ny.`` (one token
    more) or ``user\\nx.\\ny.\\n``; the count is the larger."""
    chat = [{"role": "user", "content": [_t("x."), _t("y."), IMG]}]
    c = counter.count_text
    tail = c("\n") + 1 + c("assistant\n")
    front = 2 + c("user\n") + c("\nx.\ny.") + tail
    inplace = 2 + c("user\nx.\ny.\n") + tail
    assert (front, inplace) == (13, 12)
    assert _count(counter, chat, {"vllm"}) == front + 765 == 778
    assert _count(counter, chat, {"kvgate"}) == 2 + c("user\nx.y.") + tail + 765


def test_vllm_developer_message_carries_a_tools_key() -> None:
    """vLLM chat_utils.py@001eadcf ``_parse_chat_message_content``: ``if role == "developer":
    result_msg["tools"] = message.get("tools", None)``; a template that tests ``message.tools is
    defined`` renders it."""
    assert vllm_messages([{"role": "developer", "content": "d"}]) == [
        {"role": "developer", "content": "d", "tools": None}
    ]
