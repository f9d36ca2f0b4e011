"""kvgate demo's inputs: shipped real text, prompts cut to exact token counts, the 16 cases, and
how a result is judged. No processes: the tokenizer only."""

from __future__ import annotations

import pytest

from gateway.commands.demo import CHAT, COMPLETION, Case, Result, build_cases, table
from gateway.stack.demo_corpus import FitError, fit_chat, fit_prompt, generated_log, project_source, prose
from tokenizer import bundled_counter

C = bundled_counter()


def test_shipped_texts_are_real_and_multilingual() -> None:
    text = prose()
    assert text.count("Call me Ishmael.") == 1
    assert "Litwo! Ojczyzno moja!" in text and "床前明月光" in text and "学而时习之" in text
    src = project_source()
    assert "# file: gateway/stack/demo_corpus.py\n" in src and "# file: tokenizer/chat.py\n" in src
    assert "gpu_backend" not in [line.split("/")[0][8:] for line in src.splitlines() if line.startswith("# file: ")]
    assert generated_log(50) == generated_log(50)  # seeded: the same text every run
    assert len(generated_log(50).splitlines()) == 50


@pytest.mark.parametrize("target", [25, 26, 100, 311, 1000, 3260, 3261, 4097])
@pytest.mark.parametrize("offset", [0, 2500, 2600])
def test_fit_hits_the_exact_count(target: int, offset: int) -> None:
    # offset 2500 starts in the Chinese passage: cuts land inside two-token characters
    source = (prose() + "\n\n" + project_source())[offset:]
    prompt = fit_prompt(source, target, C)
    assert C.count_text(prompt) == target
    assert "\ufffd" not in prompt
    messages = fit_chat(source, target, C, system="You review Python code.", instruction="Explain:\n\n")
    assert C.count_chat(messages) == target
    assert [m["role"] for m in messages] == ["system", "user"]
    assert messages[1]["content"].startswith("Explain:\n\n")


def test_fit_refuses_what_cannot_be_done() -> None:
    with pytest.raises(FitError, match="source has 3 tokens, 10 needed"):
        fit_prompt("one two three", 10, C)
    with pytest.raises(FitError, match="the prompt's frame alone is"):
        fit_chat("text", 5, C, system="a long system message")


def test_the_sixteen_cases() -> None:
    cases = build_cases(limit=3276, pool_tokens=4096, max_tokens=16)
    assert len(cases) == 16
    assert [(c.endpoint.name, c.stream) for c in cases[::4]] == [
        ("chat", False),
        ("chat", True),
        ("completion", False),
        ("completion", True),
    ]
    for c in cases:
        counted = C.count_chat(c.body["messages"]) if c.endpoint.chat else C.count_text(c.body["prompt"])
        assert counted == c.prompt_tokens
        assert c.body["max_tokens"] == 16 and c.body["temperature"] == 0
    sizes = {(c.size, c.prompt_tokens, c.expect_status, c.expect_code) for c in cases if c.size != "short"}
    assert sizes == {
        ("at limit", 3260, 200, None),
        ("limit + 1", 3261, 400, "context_length_exceeded"),
        ("> prefill pool", 4097, 400, "context_length_exceeded"),
    }
    assert all(c.expect_status == 200 and 0 < c.prompt_tokens < 400 for c in cases if c.size == "short")
    with pytest.raises(ValueError):
        build_cases(limit=40, pool_tokens=4096, max_tokens=16)


def test_a_result_is_ok_only_when_status_code_and_usage_match() -> None:
    case = Case(CHAT, "at limit", False, {}, 3260, 200)
    assert Result(case, 200, 5.0, usage={"prompt_tokens": 3260}).ok
    assert not Result(case, 200, 5.0, usage={"prompt_tokens": 3259}).ok  # the engine counted otherwise
    assert not Result(case, 503, 5.0, code="pool_size_unknown").ok
    over = Case(COMPLETION, "limit + 1", True, {}, 3261, 400, "context_length_exceeded")
    assert Result(over, 400, 1.0, code="context_length_exceeded").ok
    assert not Result(over, 400, 1.0, code="invalid_request").ok
    text = table([Result(over, 400, 1.0, code="invalid_request")], 3276)
    assert text.splitlines()[2] == (
        f"{'completion streamed limit + 1':<34} {3261:>13} {3276:>6} {400:>6} {1.0:>10.1f}  "
        "invalid_request   <-- expected 400 context_length_exceeded"
    )


def test_a_cut_inside_a_two_token_character_is_filled_not_broken() -> None:
    # 311 tokens of this chat would end inside 愠 (two tokens): no prefix counts exactly 311, so the
    # prefix one token short gets a one-token filler instead of a broken character
    source = (prose() + "\n\n" + project_source())[2500:]
    messages = fit_chat(source, 311, C, instruction="Explain:\n\n")
    assert C.count_chat(messages) == 311
    assert messages[0]["content"].endswith("人不知而不.")
