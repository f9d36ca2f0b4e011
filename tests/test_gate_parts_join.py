"""A message's text parts are joined before the chat template runs, as each engine joins them:
vLLM with ``\\n`` (empty parts dropped, image placeholders in front or, with
``--interleave-mm-strings``, in place), SGLang with a space (empty parts kept, images dropped
from the text), the bundled backend not at all (it renders the parts as sent). kvgate's ChatML
counter (the ``bundled`` tokenizer) once concatenated the parts for every engine: 50 parts
``"x"`` counted 15 tokens where vLLM holds 107 and SGLang 58, so a prompt split into many parts
got about twice past the gate.

Through the real app (tests/render_env.py: ``cv`` behind vLLM, ``cs`` behind SGLang, ``ck``
behind the bundled backend, all ChatML on the bundled tokenizer; live limit 3,276 tokens). Every
count is checked twice: against a literal, and against the oracle (tests/gate_oracle.py, the
engines' steps copied from their source) applied to the body the engine received.
"""

from __future__ import annotations

import pytest

from tests.gate_oracle import engine_chat_tokens, png
from tests.render_env import ENGINES, LIMIT, render_env

#: model -> its engine (tests/render_env.py)
ENGINE = {m: ENGINES[m][0] for m in ("cv", "cs", "ck")}


@pytest.fixture(scope="module")
def env():
    with render_env() as e:
        yield e


def text(t: str) -> dict:
    return {"type": "text", "text": t}


IMAGE = {"type": "image_url", "image_url": {"url": png(64, 64)}}


def _cost(part: dict) -> int:
    return 765  # the default image policy: tokenizer.image_tokens per image


def admitted(env, model: str, messages: list[dict], max_tokens: int = 16) -> int:
    """POST the chat; asserts a 200, one forwarded request, and a reservation of the oracle's
    count of what the engine received plus ``max_tokens``; returns that count."""
    client, sg, vl, quotas, _ = env
    before = (len(sg.state.requests), len(vl.state.requests), len(quotas.reserved))
    r = client.post("/v1/chat/completions", json={"model": model, "messages": messages, "max_tokens": max_tokens})
    assert r.status_code == 200, r.text
    received = sg.state.requests[before[0] :] + vl.state.requests[before[1] :]
    assert len(received) == 1 and len(quotas.reserved) == before[2] + 1
    got = received[0]["body"]
    count = engine_chat_tokens(ENGINE[model], got, _cost)
    assert quotas.reserved[-1] == count + max_tokens, (quotas.reserved[-1], count, max_tokens)
    return count


@pytest.mark.parametrize(("model", "expected"), [("cv", 107), ("cs", 58), ("ck", 15)])
def test_fifty_parts_are_counted_as_the_engine_joins_them(env, model, expected):
    """50 parts ``"x"``: vLLM holds ``x\\nx\\n...x`` (99 tokens + 8), SGLang ``x x ... x``
    (50 + 8), the bundled backend ``xx...x`` (7 + 8)."""
    assert admitted(env, model, [{"role": "user", "content": [text("x")] * 50}]) == expected


@pytest.mark.parametrize(("model", "expected"), [("cv", 11), ("cs", 12), ("ck", 10)])
def test_empty_parts(env, model, expected):
    """``["Hello", "", "", "world", ""]``: vLLM drops the empty parts (``Hello\\nworld``), SGLang
    keeps them (``Hello   world `` with four spaces), the bundled backend ``Helloworld``."""
    content = [text("Hello"), text(""), text(""), text("world"), text("")]
    assert admitted(env, model, [{"role": "user", "content": content}]) == expected


@pytest.mark.parametrize(("model", "expected"), [("cv", 8), ("cs", 9), ("ck", 8)])
def test_only_empty_parts(env, model, expected):
    """Two empty parts: nothing for vLLM and the bundled backend, one space for SGLang."""
    assert admitted(env, model, [{"role": "user", "content": [text(""), text("")]}]) == expected


@pytest.mark.parametrize(("model", "expected"), [("cv", 17), ("cs", 16)])
def test_trailing_assistant_parts(env, model, expected):
    """A trailing assistant turn of parts ``a``, ``b``: ``a\\nb`` for vLLM, ``a b`` as a user
    turn for SGLang (``_handle_last_assistant_message``: the joined content is a string)."""
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [text("a"), text("b")]}]
    assert admitted(env, model, messages) == expected


@pytest.mark.parametrize(("model", "expected"), [("cv", 1548), ("cs", 1544)])
def test_text_and_images_interleaved(env, model, expected):
    """``"Look at", image, "this", image, "and that."`` (765 per image): vLLM's placeholders go in
    front of ``Look at\\nthis\\nand that.``, each followed by ``\\n`` (or in place with
    ``--interleave-mm-strings``; the larger is kept); SGLang drops the images from
    ``Look at this and that.``, and kvgate charges them all the same."""
    content = [text("Look at"), IMAGE, text("this"), IMAGE, text("and that.")]
    assert admitted(env, model, [{"role": "user", "content": content}]) == expected


@pytest.mark.parametrize(("model", "expected"), [("cv", 1539), ("cs", 1538)])
def test_images_with_an_empty_part(env, model, expected):
    """``image, "", image``: vLLM's two placeholders joined by ``\\n`` (the empty part dropped,
    no text left); SGLang an empty content (``" ".join([""])``), the images charged."""
    content = [IMAGE, text(""), IMAGE]
    assert admitted(env, model, [{"role": "user", "content": content}]) == expected


#: model -> (part text, parts, prompt tokens): multi-part prompts just under the live limit
AT_LIMIT = {"cv": ("x", 1626, 3259), "cs": ("x", 3251, 3259), "ck": ("ab ", 3251, 3260)}


@pytest.mark.parametrize("model", sorted(AT_LIMIT))
def test_a_multi_part_prompt_at_the_limit(env, model):
    """A prompt of many parts with ``max_tokens`` filling the live limit exactly is admitted
    (reserved 3,276); one more completion token is the 400 naming the joined count."""
    client, sg, vl, quotas, _ = env
    part, n, prompt = AT_LIMIT[model]
    messages = [{"role": "user", "content": [text(part)] * n}]
    assert admitted(env, model, messages, LIMIT - prompt) == prompt
    assert quotas.reserved[-1] == LIMIT
    before = (len(sg.state.requests), len(vl.state.requests), len(quotas.reserved))
    over = LIMIT - prompt + 1
    r = client.post("/v1/chat/completions", json={"model": model, "messages": messages, "max_tokens": over})
    assert r.status_code == 400, r.text
    assert r.json() == {
        "error": {
            "message": f"This model's maximum context length is {LIMIT} tokens. However, you requested "
            f"{LIMIT + 1} tokens ({prompt} in the messages, {over} in the completion). "
            "Please reduce the length of the messages or completion.",
            "type": "invalid_request_error",
            "param": "messages",
            "code": "context_length_exceeded",
        }
    }
    assert (len(sg.state.requests), len(vl.state.requests), len(quotas.reserved)) == before
