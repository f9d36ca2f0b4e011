"""Counting the Responses API's input (tokenizer/responses.py), embeddings inputs
(tokenizer/embeddings.py) and the ids behind /tokenize (tokenizer/tokenize_api.py), with the
bundled tokenizer (cl100k_base + ChatML): exact counts, the mapping item by item, and every
refusal naming its field."""

from __future__ import annotations

import asyncio

import pytest

from tokenizer import InvalidPromptError, InvalidTokenIdError, bundled_counter
from tokenizer.embeddings import acount_embedding_input, split_embedding_input
from tokenizer.responses import acount_responses, count_responses, responses_text, responses_to_chat
from tokenizer.tokenize_api import tokenize_chat, tokenize_prompt

C = bundled_counter()


def n(text: str) -> int:
    return len(C.encode_text(text))


def chatml(*turns: tuple[str, str]) -> int:
    """Tokens of ChatML turns written out: 2 specials + text per turn, then the generation prompt."""
    return sum(2 + n(f"{role}\n{body}") + n("\n") for role, body in turns) + 1 + n("assistant\n")


def test_string_input_counts_as_one_user_message() -> None:
    p = responses_to_chat("Say hello.")
    assert p.messages == [{"role": "user", "content": "Say hello."}] and p.tools is None
    assert count_responses(C, p) == 11 == chatml(("user", "Say hello."))


def test_instructions_become_a_first_system_message_and_empty_instructions_are_dropped() -> None:
    p = responses_to_chat("Hi", instructions="Be brief.")
    assert p.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert count_responses(C, p) == chatml(("system", "Be brief."), ("user", "Hi"))
    assert responses_to_chat("Hi", instructions="").messages == [{"role": "user", "content": "Hi"}]


def test_input_items_map_to_chat_as_vllm_does() -> None:
    items = [
        {"role": "developer", "content": "Rules."},
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "What is "}, {"type": "input_text", "text": "2+2?"}],
        },
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Add."}]},
        {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a":2,"b":2}'},
        {"type": "function_call", "call_id": "c2", "name": "log", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "4"},
        {
            "role": "assistant",
            "content": [{"type": "output_text", "text": "It is 4."}, {"type": "output_text", "text": "dropped"}],
        },
    ]
    p = responses_to_chat(items)
    assert p.messages == [
        {"role": "developer", "content": "Rules."},
        {"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "2+2?"}]},
        {
            "role": "assistant",
            "reasoning": "Add.",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a":2,"b":2}'}},
                {"id": "c2", "type": "function", "function": {"name": "log", "arguments": "{}"}},
            ],
        },
        {"role": "tool", "content": "4", "tool_call_id": "c1"},
        {"role": "assistant", "content": "It is 4."},
    ]
    calls = '<tool_call>\n{"name": "add", "arguments": "{\\"a\\":2,\\"b\\":2}"}\n</tool_call>\n<tool_call>\n{"name": "log", "arguments": "{}"}\n</tool_call>'
    assert count_responses(C, p) == chatml(
        ("developer", "Rules."),
        ("user", "What is 2+2?"),
        ("assistant", calls),
        ("tool", "4"),
        ("assistant", "It is 4."),
    )
    # the verifier's text: every rendered string, the calls' names and arguments included
    assert responses_text(p) == 'Rules.\nWhat is \n2+2?\nAdd.\nadd\n{"a":2,"b":2}\nlog\n{}\n4\nIt is 4.'


def test_assistant_message_after_a_function_call_fills_its_content() -> None:
    p = responses_to_chat(
        [
            {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
            {"role": "assistant", "content": "done"},
        ]
    )
    assert p.messages == [
        {
            "role": "assistant",
            "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
            "content": "done",
        }
    ]


def test_images_cost_image_tokens_and_tool_outputs_may_be_parts() -> None:
    p = responses_to_chat(
        [
            {
                "role": "user",
                "content": [{"type": "input_image", "image_url": "data:x"}, {"type": "input_text", "text": "this?"}],
            },
            {"type": "function_call_output", "call_id": "c", "output": [{"type": "input_text", "text": "out"}]},
        ]
    )
    assert count_responses(C, p) == C.image_tokens + chatml(("user", "this?"), ("tool", "out"))


def test_function_tools_are_reshaped_into_chat_tools() -> None:
    tools = [{"type": "function", "name": "add", "parameters": {"type": "object"}, "strict": True}]
    p = responses_to_chat("x", tools=tools)
    assert p.tools == [
        {
            "type": "function",
            "function": {"name": "add", "description": None, "parameters": {"type": "object"}, "strict": True},
        }
    ]
    assert count_responses(C, p) == C.count_chat([{"role": "user", "content": "x"}], p.tools)
    assert responses_to_chat("x", tools=[]).tools is None


@pytest.mark.parametrize(
    ("input", "kw", "param"),
    [
        (None, {}, "input"),
        (42, {}, "input"),
        ([], {}, "input"),
        (["text"], {}, "input[0]"),
        ([{"content": "x"}], {}, "input[0].type"),
        ([{"type": "item_reference", "id": "msg_1"}], {}, "input[0].type"),
        ([{"type": "web_search_call"}], {}, "input[0].type"),
        ([{"role": "tool", "content": "x"}], {}, "input[0].role"),
        ([{"role": "user", "content": 3}], {}, "input[0].content"),
        ([{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}], {}, "input[0].content[0].type"),
        ([{"role": "user", "content": [{"type": "input_text"}]}], {}, "input[0].content[0].text"),
        ([{"role": "user", "content": ["x"]}], {}, "input[0].content[0]"),
        ([{"type": "function_call", "call_id": "c", "name": "f"}], {}, "input[0].arguments"),
        ([{"type": "function_call_output", "call_id": "c", "output": 1}], {}, "input[0].output"),
        ([{"type": "reasoning", "summary": [], "encrypted_content": "gAAA"}], {}, "input[0].encrypted_content"),
        ([{"role": "assistant", "content": "par", "status": "incomplete"}], {}, "input[0].status"),
        ("x", {"instructions": ["no"]}, "instructions"),
        ("x", {"tools": {"type": "function"}}, "tools"),
        ("x", {"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ("x", {"tools": [{"type": "function"}]}, "tools[0].name"),
    ],
)
def test_bad_input_is_refused_naming_the_field(input, kw, param) -> None:
    with pytest.raises(InvalidPromptError) as e:
        responses_to_chat(input, **kw)
    assert e.value.param == param and e.value.status == 400


def test_a_completed_assistant_message_last_is_counted_not_refused() -> None:
    p = responses_to_chat(
        [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "status": "completed"}]
    )
    assert asyncio.run(acount_responses(C, p)) == chatml(("user", "a"), ("assistant", "b"))


# ------------------------------------------------------------------ embeddings
def test_embedding_inputs_of_every_shape_are_counted_exactly() -> None:
    assert asyncio.run(acount_embedding_input(C, "hello world")).per_prompt == (2,)
    assert asyncio.run(acount_embedding_input(C, ["hello world", "", "a"])).per_prompt == (2, 0, 1)
    assert asyncio.run(acount_embedding_input(C, [1, 2, 3])).per_prompt == (3,)
    assert asyncio.run(acount_embedding_input(C, [[1, 2], [3]])).per_prompt == (2, 1)


@pytest.mark.parametrize(
    ("value", "error", "param"),
    [
        ([], InvalidPromptError, "input"),
        ([1, "a"], InvalidPromptError, "input"),
        ([True], InvalidPromptError, "input"),
        ([[1], []], InvalidPromptError, "input[1]"),
        ([-1], InvalidTokenIdError, "input"),
        ([[1], [100256]], InvalidTokenIdError, "input[1]"),
        ({"text": "x"}, InvalidPromptError, "input"),
    ],
)
def test_bad_embedding_input_names_input(value, error, param) -> None:
    with pytest.raises(error) as e:
        asyncio.run(acount_embedding_input(C, value))
    assert e.value.param == param
    assert "'prompt" not in e.value.message


def test_split_keeps_order() -> None:
    assert split_embedding_input(["b", "a"]) == ["b", "a"]


# ------------------------------------------------------------------ /tokenize ids
def test_tokenize_prompt_and_chat_give_the_gates_count_and_the_ids() -> None:
    t = asyncio.run(tokenize_prompt(C, "Call me Ishmael.", return_token_strs=True))
    assert t.count == len(t.tokens) == C.count_text("Call me Ishmael.")
    assert "".join(t.token_strs) == "Call me Ishmael."
    messages = [{"role": "user", "content": "Say hello."}]
    t = asyncio.run(tokenize_chat(C, messages))
    assert (t.count, t.tokens, t.token_strs) == (11, C.encode_chat(messages), None)
    assert C.decode(t.tokens) == "<|im_start|>user\nSay hello.<|im_end|>\n<|im_start|>assistant\n"


# ------------------------------------------------------------------ Hugging Face ids
@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    pytest.importorskip("tokenizers")
    pytest.importorskip("jinja2")
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    from tokenizer.hf_counter import HFCounter

    folder = tmp_path_factory.mktemp("hf-ids")
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<unk>", "<s>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["hello world, say hello to the world"] * 20, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    tok.save(str(folder / "tokenizer.json"))
    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "bos_token": "<s>"}))
    return HFCounter(folder)


def test_hf_ids_match_the_gates_count(hf):
    t = asyncio.run(tokenize_prompt(hf, "hello world"))
    assert t.tokens[0] == hf.tokenizer.token_to_id("<s>") and t.count == len(t.tokens) == hf.count_prompt_text(
        "hello world"
    )
    assert asyncio.run(tokenize_prompt(hf, "hello world", add_special_tokens=False)).tokens == t.tokens[1:]
    messages = [{"role": "user", "content": "say hello"}]
    c = asyncio.run(tokenize_chat(hf, messages, return_token_strs=True))
    assert c.count == len(c.tokens) == hf.count_chat(messages)
    assert c.token_strs[0] == "<|im_start|>" and len(c.token_strs) == len(c.tokens)
    # a look-alike typed as text: counted as text (more), while the ids are the engine tokenizer's
    odd = [{"role": "user", "content": "<|im_end|>"}]
    o = asyncio.run(tokenize_chat(hf, odd))
    assert o.count > len(o.tokens)
    p = responses_to_chat("say hello")
    assert count_responses(hf, p) == hf.count_chat(messages)
