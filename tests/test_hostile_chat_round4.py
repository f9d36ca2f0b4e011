"""A hostile chat client, fourth round: ``/v1/chat/completions`` bodies read against the engines'
own request models and pre-template steps, through the real app (the render-as-the-engine setup
of tests/render_env.py: a recording SGLang-shaped and vLLM-shaped mock engine, quotas in
process). Each refused body is an exact OpenAI-shaped 400 naming its field that reaches no engine
and reserves nothing.

The findings this file holds fixed:

- vLLM reads a content part that carries a ``uuid`` by its keys, not its ``type``
  (``vllm/entrypoints/chat_utils.py@001eadcf`` ``_parse_chat_message_content_mm_part``: the
  ``type`` is used only when ``uuid`` is ``None``): ``{"type": "text", "text": "hi", "uuid": "u",
  "image_url": {"url": ...}}`` is an image there (its URL fetched by the engine, its tokens an
  image's), while kvgate counted 2 tokens of text and never vetted the URL; a text part with a
  ``uuid`` and no media key is vLLM's 400 ("Missing 'type' field in multimodal part.") after the
  prompt was charged;
- SGLang's request model (``python/sglang/srt/entrypoints/openai/protocol.py@004c82e0``) refuses,
  after kvgate had admitted and charged the prompt: a user message without ``content`` or with
  ``content: null`` (``ChatCompletionMessageUserParam.content`` is required); a content part of
  type ``refusal`` or ``input_image`` (not in ``ChatCompletionMessageContentPart``); an
  ``image_url`` that is not an object with a string ``url`` or whose ``detail`` is not
  auto/low/high (``ChatCompletionMessageContentImageURL``); a non-string ``tool_call_id`` or
  ``reasoning_content`` (``ChatCompletionMessageGenericParam``); a tool call whose ``id`` is not a
  string or whose ``type`` is not ``function`` (``ToolCall``).

Each is refused only where an engine of the model refuses it (or, for the ``uuid``, misreads
it): the same bodies behind vLLM alone (or SGLang alone, for the ``uuid``) are admitted and
counted as before.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.render_env import render_env

pytestmark = [pytest.mark.timeout(120)]

IMAGE = "data:image/png;base64,iVBORw0KGgo="
USER = {"role": "user", "content": "q"}


@pytest.fixture(scope="module")
def env():
    with render_env() as e:
        yield e


def _post(env, body: dict[str, Any]) -> tuple[Any, tuple[int, int, int]]:
    """The response and what it changed: (SGLang requests, vLLM requests, reservations)."""
    client, sg, vl, quotas, folder = env
    before = (len(sg.state.requests), len(vl.state.requests), len(quotas.reserved))
    r = client.post("/v1/chat/completions", json=body)
    after = (len(sg.state.requests), len(vl.state.requests), len(quotas.reserved))
    return r, tuple(a - b for a, b in zip(after, before, strict=True))  # type: ignore[return-value]


def _refused(env, body: dict[str, Any], param: str, message: str) -> None:
    r, changed = _post(env, body)
    assert (r.status_code, changed) == (400, (0, 0, 0)), (r.status_code, changed, r.text)
    assert r.json() == {
        "error": {"message": message, "type": "invalid_request_error", "param": param, "code": "invalid_request"}
    }


def _admitted(env, body: dict[str, Any]) -> int:
    """The reservation of an admitted body (it reached exactly one engine)."""
    client, sg, vl, quotas, folder = env
    r, changed = _post(env, body)
    assert r.status_code == 200, r.text
    assert sum(changed[:2]) == 1 and changed[2] == 1, changed
    return quotas.reserved[-1]


# ------------------------------------------------------------------------- vLLM: a part's uuid
UUID_TEXT = (
    "'{p}' is set on a text part: the engines serving this model then read the part by its other keys "
    "(as an image, audio or video) or refuse it. Send 'uuid' on media parts only."
)


@pytest.mark.parametrize("model", ["tv", "cv", "tmix"])
@pytest.mark.parametrize(
    "part",
    [
        {"type": "text", "text": "hi", "uuid": "u1", "image_url": {"url": "http://169.254.169.254/latest/x.png"}},
        {"type": "text", "text": "hi", "uuid": "u1"},
        {"type": "refusal", "refusal": "no", "uuid": 7},
    ],
)
def test_vllm_reads_a_text_part_with_a_uuid_as_media_so_it_is_refused(env, model, part):
    """Before: admitted with the text's count (``tv``: 10 = 9 + 1) and forwarded, the metadata
    address inside reaching vLLM unvetted (the image policy checks image parts only)."""
    body = {"model": model, "messages": [{"role": "user", "content": [part]}], "max_tokens": 1}
    p = "messages[0].content[0].uuid"
    _refused(env, body, p, UUID_TEXT.format(p=p))


def test_a_uuid_on_an_image_part_or_behind_sglang_is_admitted(env):
    """vLLM takes an image part with a ``uuid`` as the image it is (its ``image_url`` key comes
    first); SGLang ignores a part's ``uuid``: both admitted, counted as before."""
    image = {"type": "image_url", "image_url": {"url": IMAGE}, "uuid": "u1"}
    assert _admitted(env, {"model": "tv", "messages": [{"role": "user", "content": [image]}], "max_tokens": 1}) == 773
    text = {"type": "text", "text": "hi", "uuid": "u1"}
    assert _admitted(env, {"model": "ts", "messages": [{"role": "user", "content": [text]}], "max_tokens": 1}) == 10


# --------------------------------------------------------------- SGLang: what its request model refuses
def _assistant_call(**call: Any) -> dict[str, Any]:
    fn = {"name": "get", "arguments": "{}"}
    return {"role": "assistant", "content": None, "tool_calls": [{"function": fn, **call}]}


NO_USER_CONTENT = (
    "'messages[0].content' is missing or null: the engines serving this model require a user message's "
    "content (a string or content parts)."
)
PART_TYPE = "'{p}' is '{t}': the engines serving this model take content parts of type 'text' and 'image_url' only."
IMAGE_URL = "'{p}' must be an object with the image's 'url' (a string)."
DETAIL = "'{p}' must be one of auto, low, high."
STRING = "'{p}' must be a string."
CALL_TYPE = "'{p}' must be 'function'."

#: (messages, param, message) SGLang's request model refuses
SGLANG_REFUSES = [
    ([{"role": "user", "content": None}], "messages[0].content", NO_USER_CONTENT),
    ([{"role": "user"}], "messages[0].content", NO_USER_CONTENT),
    (
        [USER, {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]}, USER],
        "messages[1].content[0].type",
        PART_TYPE.format(p="messages[1].content[0].type", t="refusal"),
    ),
    (
        [{"role": "user", "content": [{"type": "input_image", "image_url": IMAGE}]}],
        "messages[0].content[0].type",
        PART_TYPE.format(p="messages[0].content[0].type", t="input_image"),
    ),
    (
        [{"role": "user", "content": [{"type": "image_url", "image_url": IMAGE}]}],
        "messages[0].content[0].image_url",
        IMAGE_URL.format(p="messages[0].content[0].image_url"),
    ),
    (
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": IMAGE, "detail": "original"}}]}],
        "messages[0].content[0].image_url.detail",
        DETAIL.format(p="messages[0].content[0].image_url.detail"),
    ),
    (
        [USER, {"role": "tool", "tool_call_id": 5, "content": "x"}],
        "messages[1].tool_call_id",
        STRING.format(p="messages[1].tool_call_id"),
    ),
    (
        [USER, {"role": "assistant", "content": "a", "reasoning_content": ["r"]}, USER],
        "messages[1].reasoning_content",
        STRING.format(p="messages[1].reasoning_content"),
    ),
    (
        [USER, _assistant_call(id=5), USER],
        "messages[1].tool_calls[0].id",
        STRING.format(p="messages[1].tool_calls[0].id"),
    ),
    (
        [USER, _assistant_call(type="custom"), USER],
        "messages[1].tool_calls[0].type",
        CALL_TYPE.format(p="messages[1].tool_calls[0].type"),
    ),
]


@pytest.mark.parametrize("model", ["ts", "cs", "tmix"])
@pytest.mark.parametrize(("messages", "param", "message"), SGLANG_REFUSES)
def test_what_sglang_refuses_after_the_charge_is_refused_up_front(env, model, messages, param, message):
    """Before: each admitted, charged and forwarded (``ts``, a null user content: 8 tokens
    reserved), for SGLang to answer 400."""
    _refused(env, {"model": model, "messages": messages, "max_tokens": 1}, param, message)


@pytest.mark.parametrize("index", [0, 1, 2, 3])
def test_what_vllm_takes_is_still_admitted_behind_vllm_alone(env, index):
    """A null user content, a refusal part and an ``input_image`` part are vLLM's own shapes
    (content ``None`` is no parts; ``refusal`` is text; ``input_image`` an image): admitted on a
    vLLM-only model, counted as vLLM renders them."""
    body = {"model": "tv", "messages": SGLANG_REFUSES[index][0], "max_tokens": 1}
    assert _admitted(env, body) == {0: 8, 1: 8, 2: 20, 3: 773}[index]
