"""The gateway's count equals the bundled engine's ``usage.prompt_tokens`` exactly (issue 2).

The ChatML template lives once in ``tokenizer/chat.py`` and both sides use it, so this holds by
construction; the property test checks it end to end over random chats (roles, names, content
parts, tool calls, tool definitions, special-token look-alikes, CJK, emoji, U+2028) and random
completion prompts (text, token ids), against a real ``--role all`` backend process.
"""

from __future__ import annotations

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.backend_procs import Backend
from tokenizer import bundled_counter

COUNTER = bundled_counter()
MODEL = "kvgate-tiny"

_alphabet = st.sampled_from(
    list("abc xyz ABC 0123 .,;!?\n\t'\"{}[]")
    + list("日本語中文ąęłż")
    + ["\u2028", "😀", "é", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "  "]
)
TEXT = st.lists(_alphabet, max_size=40).map("".join)
NAME = st.one_of(st.none(), st.from_regex(r"[a-z][a-z0-9_]{0,7}", fullmatch=True))
PARTS = st.lists(st.builds(lambda t: {"type": "text", "text": t}, TEXT), min_size=1, max_size=3)
CONTENT = st.one_of(TEXT, PARTS)
TOOL_CALL = st.builds(
    lambda n, a, i: {"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": a}},
    st.from_regex(r"[a-z_]{1,10}", fullmatch=True),
    TEXT,
    st.integers(0, 99),
)


@st.composite
def message(draw) -> dict:
    role = draw(st.sampled_from(["system", "user", "assistant", "tool"]))
    m: dict = {"role": role, "content": draw(CONTENT)}
    name = draw(NAME)
    if name and role in ("system", "user", "assistant"):
        m["name"] = name
    if role == "assistant" and draw(st.booleans()):
        m["tool_calls"] = draw(st.lists(TOOL_CALL, min_size=1, max_size=2))
    if role == "tool":
        m["tool_call_id"] = "call_1"
    return m


TOOLS = st.one_of(
    st.none(),
    st.lists(
        st.builds(
            lambda n, d: {
                "type": "function",
                "function": {"name": n, "description": d, "parameters": {"type": "object", "properties": {}}},
            },
            st.from_regex(r"[a-z_]{1,10}", fullmatch=True),
            TEXT,
        ),
        min_size=1,
        max_size=2,
    ),
)


@pytest.fixture(scope="module")
def engine():
    with Backend(three=False, model="tiny-random") as b:
        with httpx.Client(base_url=b.url, timeout=60) as c:
            yield c


PROPERTY = settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.mark.timeout(240)
@PROPERTY
@given(messages=st.lists(message(), min_size=1, max_size=5), tools=TOOLS)
def test_chat_count_equals_engine_usage(engine: httpx.Client, messages: list, tools: list | None) -> None:
    body = {"model": MODEL, "messages": messages, "max_tokens": 1, "temperature": 0}
    if tools:
        body["tools"] = tools
    r = engine.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == COUNTER.count_chat(messages, tools)


@pytest.mark.timeout(240)
@PROPERTY
@given(prompt=st.one_of(TEXT.filter(bool), st.lists(st.integers(0, 100255), min_size=1, max_size=50)))
def test_completion_count_equals_engine_usage(engine: httpx.Client, prompt) -> None:
    r = engine.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == COUNTER.count_prompt(prompt).total
