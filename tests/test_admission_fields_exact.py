"""The per-engine message and field policy of gateway/admission/fields.py, one exact 400 body or
return value per rule, each rule taken from the engine source the module cites:

- message keys: OpenAI's message params (``openai`` 3.60 ``types/chat``: ``role``, ``content``,
  ``name``, ``tool_calls``, ``tool_call_id``, ``refusal``, ``function_call``, ``audio``), plus the
  reasoning text the engines read back: vLLM ``vllm/entrypoints/chat_utils.py``
  ``CustomChatCompletionMessageParam`` (``reasoning``) and ``ConversationMessage``
  (``reasoning_content``), SGLang ``python/sglang/srt/entrypoints/openai/protocol.py@004c82e0``
  ``ChatCompletionMessageGenericParam`` (``reasoning_content``);
- SGLang's request model (``protocol.py@004c82e0``): ``ChatCompletionMessageUserParam.content``
  is required (``Union[str, List[...]]``, no ``None``); ``ChatCompletionMessageGenericParam``:
  ``tool_call_id`` and ``reasoning_content`` ``Optional[str]``, ``tool_calls:
  Optional[List[ToolCall]]`` with ``ToolCall.id: Optional[str]`` and ``type:
  Literal["function"]``; ``ChatCompletionMessageContentPart`` has no ``refusal`` and no
  ``input_image`` part; ``ChatCompletionMessageContentImageURL``: ``url: str``, ``detail:
  Optional[Literal["auto", "low", "high"]]``;
- vLLM ``chat_utils.py@001eadcf`` ``_parse_chat_message_content_mm_part``: a part's ``type`` is
  read only when its ``uuid`` is ``None``;
- SGLang ``ChatCompletionRequest`` / ``CompletionRequest`` fields (``protocol.py@004c82e0``) for
  the extension tables; vLLM ``vllm/entrypoints/openai/chat_completion/protocol.py`` and
  ``completion/protocol.py`` (``ChatCompletionRequest``/``CompletionRequest`` sampling extras,
  ``add_generation_prompt``, ``continue_final_message``, ``chat_template_kwargs``); the bundled
  backend's ``gpu_backend/openai_api.py`` ``_sampling`` (``stop_token_ids``, ``ignore_eos``);
  OpenAI's ``ReasoningEffort`` (``openai`` 3.60 ``types/shared/reasoning_effort.py``: ``none`` ..
  ``xhigh``, ``max``) and ``response_format`` types (no ``structural_tag``); the engines'
  defaults (``ignore_eos`` false, ``skip_special_tokens`` true, ``min_tokens`` 0) for the no-op values dropped."""

from __future__ import annotations

from typing import Any

import pytest

from config.errors import OpenAIError
from config.models import ImagePolicy
from gateway.admission import fields
from gateway.admission.fields import (
    _check_common,
    _check_images,
    check_message_keys,
    check_output_constraints,
    check_part_uuids,
    check_sglang_messages,
    filter_extensions,
)

ALL = frozenset({"sglang", "vllm", "kvgate", "openai"})


def _refusal(fn: Any, *args: Any) -> dict[str, Any]:
    with pytest.raises(OpenAIError) as info:
        fn(*args)
    assert info.value.status == 400
    return info.value.body()


def _body(param: str, message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": "invalid_request"}}


# -- message keys ---------------------------------------------------------------------------------

MESSAGE_PARAMS = (
    "role",
    "content",
    "name",
    "tool_calls",
    "tool_call_id",
    "refusal",
    "function_call",
    "audio",
    "reasoning_content",
    "reasoning",
)


@pytest.mark.parametrize("key", MESSAGE_PARAMS)
def test_every_message_param_is_accepted(key: str) -> None:
    body = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", key: None}]}
    assert check_message_keys(body) is None


def test_a_message_key_outside_the_params_names_the_message_and_key() -> None:
    body = {"messages": ["not an object", {"role": "user", "content": "a"}, {"role": "system", "tools": []}]}
    assert _refusal(check_message_keys, body) == _body(
        "messages[2].tools", "Unrecognized message field: 'messages[2].tools'."
    )


# -- part uuids (vLLM) ----------------------------------------------------------------------------


@pytest.mark.parametrize("ptype", ["text", "refusal"])
def test_a_uuid_on_a_text_part_is_refused_for_vllm(ptype: str) -> None:
    body = {
        "messages": [
            {"role": "user", "content": "plain"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": ptype, ptype: "b", "uuid": "u"}]},
        ]
    }
    param = "messages[1].content[1].uuid"
    assert _refusal(check_part_uuids, body, frozenset({"sglang", "vllm"})) == _body(
        param,
        f"'{param}' is set on a text part: the engines serving this model then read the part by its other keys "
        "(as an image, audio or video) or refuse it. Send 'uuid' on media parts only.",
    )


def test_part_uuids_left_alone_where_vllm_reads_them_as_sent() -> None:
    text_uuid = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a", "uuid": "u"}]}]}
    assert check_part_uuids(text_uuid, frozenset({"sglang", "kvgate", "openai"})) is None
    fine = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "a", "uuid": None}]},
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}, "uuid": "u"}]},
        ]
    }
    assert check_part_uuids(fine, frozenset({"vllm"})) is None


# -- SGLang's request model -----------------------------------------------------------------------

SG = frozenset({"sglang"})


@pytest.mark.parametrize("user", [{"role": "user"}, {"role": "user", "content": None}])
def test_sglang_user_message_without_content(user: dict[str, Any]) -> None:
    body = {"messages": [{"role": "system", "content": None}, user]}
    assert _refusal(check_sglang_messages, body, SG) == _body(
        "messages[1].content",
        "'messages[1].content' is missing or null: the engines serving this model require a user message's "
        "content (a string or content parts).",
    )
    assert check_sglang_messages(body, frozenset({"vllm", "openai", "kvgate"})) is None


@pytest.mark.parametrize("key", ["tool_call_id", "reasoning_content"])
def test_sglang_generic_string_fields(key: str) -> None:
    ok = {"messages": [{"role": "tool", "content": "r", key: "s"}, {"role": "assistant", key: None}]}
    assert check_sglang_messages(ok, SG) is None
    bad = {"messages": [{"role": "user", "content": "q"}, {"role": "tool", "content": "r", key: 7}]}
    assert _refusal(check_sglang_messages, bad, SG) == _body(
        f"messages[1].{key}", f"'messages[1].{key}' must be a string."
    )


def _call(**kw: Any) -> dict[str, Any]:
    return {"function": {"name": "f", "arguments": "{}"}, **kw}


def test_sglang_tool_call_id_and_type() -> None:
    ok = {"messages": [{"role": "assistant", "tool_calls": ["x", _call(id=None), _call(id="c", type="function")]}]}
    assert check_sglang_messages(ok, SG) is None
    bad_id = {"messages": [{"role": "assistant", "tool_calls": ["x", _call(id="a"), _call(id=3)]}]}
    assert _refusal(check_sglang_messages, bad_id, SG) == _body(
        "messages[0].tool_calls[2].id", "'messages[0].tool_calls[2].id' must be a string."
    )
    bad_type = {"messages": [{"role": "assistant", "tool_calls": [_call(), _call(type="custom")]}]}
    assert _refusal(check_sglang_messages, bad_type, SG) == _body(
        "messages[0].tool_calls[1].type", "'messages[0].tool_calls[1].type' must be 'function'."
    )


@pytest.mark.parametrize("ptype", ["refusal", "input_image"])
def test_sglang_part_types_it_lacks(ptype: str) -> None:
    body = {"messages": [{"role": "assistant", "content": [{"type": "text", "text": "a"}, {"type": ptype}]}]}
    p = "messages[0].content[1].type"
    assert _refusal(check_sglang_messages, body, SG) == _body(
        p, f"'{p}' is '{ptype}': the engines serving this model take content parts of type 'text' and 'image_url' only."
    )


@pytest.mark.parametrize("image", ["data:,", {"detail": "auto"}, {"url": 5}, None])
def test_sglang_image_url_must_be_an_object_with_a_string_url(image: Any) -> None:
    body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": image}]}]}
    p = "messages[0].content[0].image_url"
    assert _refusal(check_sglang_messages, body, SG) == _body(
        p, f"'{p}' must be an object with the image's 'url' (a string)."
    )


@pytest.mark.parametrize("detail", ["auto", "low", "high", None])
def test_sglang_image_details_it_takes(detail: Any) -> None:
    body = {
        "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u", "detail": detail}}]}]
    }
    assert check_sglang_messages(body, SG) is None


@pytest.mark.parametrize("detail", ["medium", "AUTO", ""])
def test_sglang_image_details_it_refuses(detail: str) -> None:
    good = {"type": "image_url", "image_url": {"url": "u"}}
    bad = {"type": "image_url", "image_url": {"url": "u", "detail": detail}}
    body = {"messages": [{"role": "user", "content": [good, bad]}]}
    p = "messages[0].content[1].image_url.detail"
    assert _refusal(check_sglang_messages, body, SG) == _body(p, f"'{p}' must be one of auto, low, high.")


# -- image URLs -----------------------------------------------------------------------------------


def _image_body(url: Any) -> dict[str, Any]:
    return {
        "messages": [
            {"role": "user", "content": "a"},
            {"role": "user", "content": ["x", {"type": "image_url", "image_url": {"url": url}}]},
        ]
    }


P_IMG = "messages[1].content[1].image_url"


@pytest.mark.parametrize("url", ["data:image/png;base64,AA", "DATA:image/png;base64,AA"])
def test_data_urls_pass_any_policy(url: str) -> None:
    assert _check_images(_image_body(url), ImagePolicy()) is None


def test_image_without_a_url() -> None:
    assert _refusal(_check_images, _image_body(None), ImagePolicy()) == _body(
        P_IMG, f"'{P_IMG}' must hold the image's URL (a data: URL)."
    )


@pytest.mark.parametrize("url", ["https://img.example/a.png", "HTTP://IMG.Example/a.png"])
def test_http_urls_on_a_listed_host(url: str) -> None:
    assert _check_images(_image_body(url), ImagePolicy(allowed_url_hosts=["Img.Example"])) is None


@pytest.mark.parametrize("url", ["https://other.example/a.png", "ftp://img.example/a.png", "http://[::1/x"])
def test_other_urls_are_refused(url: str) -> None:
    policy = ImagePolicy(allowed_url_hosts=["img.example", "b.example"])
    assert _refusal(_check_images, _image_body(url), policy) == _body(
        P_IMG,
        f"'{P_IMG}' must be a data: URL or an http(s) URL on b.example, img.example; the engine would fetch "
        "any other URL itself.",
    )
    assert _refusal(_check_images, _image_body(url), ImagePolicy()) == _body(
        P_IMG, f"'{P_IMG}' must be a data: URL; the engine would fetch any other URL itself."
    )


# -- output constraints (the bundled backend parses no tool calls) --------------------------------


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "f"}}])
def test_tool_choice_asking_for_a_call(choice: Any) -> None:
    body = {"tool_choice": choice}
    assert _refusal(check_output_constraints, body, frozenset({"vllm", "kvgate"})) == _body(
        "tool_choice",
        "'tool_choice' asks for a tool call, but the engines serving this model parse no tool calls (they answer "
        "with text); send 'auto' or 'none', or leave it out.",
    )
    assert check_output_constraints(body, frozenset({"vllm", "sglang", "openai"})) is None


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tool_choice": "auto", "response_format": {"type": "json_object"}}, "response_format"),
        ({"tool_choice": "none", "text": {"format": {"type": "json_schema"}}}, "text.format"),
    ],
)
def test_structured_output_where_the_bundled_backend_serves(body: dict[str, Any], param: str) -> None:
    assert _refusal(check_output_constraints, body, frozenset({"kvgate"})) == _body(
        param,
        f"'{param}' asks for structured output, but the engines serving this model apply none (they answer "
        'with free text); send {"type": "text"} or leave it out.',
    )


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"tool_choice": None, "response_format": {"type": "text"}, "text": {"format": {"type": "text"}}},
        {"response_format": {}, "text": {"format": {}}},
        {"text": "plain"},
    ],
)
def test_unconstrained_output_passes_the_bundled_backend(body: dict[str, Any]) -> None:
    assert check_output_constraints(body, frozenset({"kvgate"})) is None


# -- extension fields -----------------------------------------------------------------------------

#: SGLang ``ChatCompletionRequest`` / ``CompletionRequest`` extension fields kvgate counts
SGLANG_CHAT = (
    "top_k",
    "min_p",
    "repetition_penalty",
    "min_tokens",
    "ignore_eos",
    "skip_special_tokens",
    "stop_token_ids",
    "no_stop_trim",
    "regex",
    "ebnf",
    "separate_reasoning",
    "stream_reasoning",
    "chat_template_kwargs",
)
SGLANG_COMPLETIONS = SGLANG_CHAT[:10] + ("json_schema", "response_format")


@pytest.mark.parametrize(
    ("route", "field"), [("chat", f) for f in SGLANG_CHAT] + [("completions", f) for f in SGLANG_COMPLETIONS]
)
def test_sglang_extension_fields_pass(route: str, field: str) -> None:
    body = {field: "sent"}
    filter_extensions(body, route, frozenset({"sglang"}), frozenset())
    assert body == {field: "sent"}


@pytest.mark.parametrize(
    ("field", "default"), [("ignore_eos", False), ("skip_special_tokens", True), ("min_tokens", 0)]
)
def test_engine_defaults_are_dropped_and_other_values_refused(field: str, default: Any) -> None:
    engines = frozenset({"sglang", "openai"})
    body = {"model": "m", field: default, "top_k": None}
    filter_extensions(body, "chat", engines, frozenset({"model"}))
    assert body == {"model": "m"}
    other = {"model": "m", field: "x"}
    assert _refusal(filter_extensions, other, "chat", engines, frozenset({"model"})) == _body(
        field,
        f"Unrecognized request argument supplied: {field} (the engines serving this model do not accept it).",
    )


@pytest.mark.parametrize(
    ("name", "args"),
    [
        ("check_message_keys", ()),
        ("check_part_uuids", (ALL,)),
        ("check_sglang_messages", (ALL,)),
        ("_check_images", (ImagePolicy(),)),
    ],
)
def test_a_body_without_messages_has_nothing_to_refuse(name: str, args: tuple[Any, ...]) -> None:
    assert getattr(fields, name)({"model": "m"}, *args) is None


def test_shapes_left_to_the_counter_are_passed_over() -> None:
    """Messages or parts that are no object, and content that is no list: the counter's 400, not
    these checks' (nor a 500)."""
    body = {
        "messages": [
            {"role": "assistant", "content": None},
            {"role": "user", "content": "s"},
            {"role": "user", "content": ["s", {"type": "text", "text": "t"}]},
            "not an object",
            {"role": "user", "content": None},
        ]
    }
    assert check_part_uuids(body, ALL) is None
    assert check_sglang_messages(body, SG) is None
    assert _check_images(body, ImagePolicy()) is None


@pytest.mark.parametrize("ptype", ["video_url", "audio_url", "thinking", "tool_reference", "input_text"])
def test_sglang_part_types_outside_the_counted_ones_are_not_its_refusal(ptype: str) -> None:
    body = {"messages": [{"role": "assistant", "content": [{"type": ptype}]}]}
    assert check_sglang_messages(body, SG) is None


def test_a_text_part_beside_an_image_is_not_an_image() -> None:
    body = _image_body("data:,")
    body["messages"][1]["content"].append({"type": "text", "text": "t"})
    assert _check_images(body, ImagePolicy()) is None


@pytest.mark.parametrize("url", ["https:///a.png", "http:x"])
def test_an_http_url_without_a_host_is_refused(url: str) -> None:
    assert _refusal(_check_images, _image_body(url), ImagePolicy(allowed_url_hosts=["img.example"])) == _body(
        P_IMG,
        f"'{P_IMG}' must be a data: URL or an http(s) URL on img.example; the engine would fetch any other URL itself.",
    )


def test_a_field_no_engine_reads_is_refused() -> None:
    body = {"model": "m", "frobnicate": 1}
    assert _refusal(filter_extensions, body, "chat", ALL, frozenset({"model"})) == _body(
        "frobnicate",
        "Unrecognized request argument supplied: frobnicate (the engines serving this model do not accept it).",
    )


@pytest.mark.parametrize(
    ("route", "field", "default"),
    [
        ("chat", "add_generation_prompt", True),
        ("chat", "continue_final_message", False),
        ("completions", "response_format", {"type": "text"}),
    ],
)
def test_other_engine_defaults_are_dropped(route: str, field: str, default: Any) -> None:
    body = {"model": "m", field: default}
    filter_extensions(body, route, frozenset({"kvgate"}), frozenset({"model"}))
    assert body == {"model": "m"}


VLLM_SAMPLING = (
    "top_k",
    "min_p",
    "repetition_penalty",
    "min_tokens",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "stop_token_ids",
)
VLLM_CHAT = VLLM_SAMPLING + ("chat_template_kwargs", "add_generation_prompt", "continue_final_message")
VLLM_COMPLETIONS = VLLM_SAMPLING + ("response_format",)
KVGATE = ("stop_token_ids", "ignore_eos")


@pytest.mark.parametrize(
    ("engine", "route", "field"),
    [("vllm", "chat", f) for f in VLLM_CHAT]
    + [("vllm", "completions", f) for f in VLLM_COMPLETIONS]
    + [("kvgate", r, f) for r in ("chat", "completions") for f in KVGATE],
)
def test_vllm_and_bundled_backend_extension_fields_pass(engine: str, route: str, field: str) -> None:
    body = {field: "sent"}
    filter_extensions(body, route, frozenset({engine}), frozenset())
    assert body == {field: "sent"}


def test_suffix_only_for_openai() -> None:
    assert _check_common({"suffix": "s"}, "completions", frozenset({"openai"})) is None
    assert _refusal(_check_common, {"suffix": "s"}, "completions", frozenset({"openai", "vllm"})) == _body(
        "suffix", "'suffix' is not supported by the engines serving this model."
    )


def test_reasoning_effort_max_passes_the_engines_that_take_it() -> None:
    assert _check_common({"reasoning_effort": "max"}, "chat", frozenset({"sglang", "vllm", "kvgate"})) is None


def test_reasoning_effort_max_passes_an_openai_upstream() -> None:
    """OpenAI's own ``ReasoningEffort`` (the ``openai`` package this project installs, 3.60
    ``types/shared/reasoning_effort.py``) lists ``max``: an ``openai`` upstream takes it."""
    assert _check_common({"reasoning_effort": "max"}, "chat", frozenset({"openai"})) is None


@pytest.mark.parametrize("engine", ["kvgate", "openai"])
def test_structural_tag_refused_where_no_engine_takes_it(engine: str) -> None:
    body = {"response_format": {"type": "structural_tag", "format": {}}}
    assert _refusal(_check_common, body, "chat", frozenset({"sglang", engine})) == _body(
        "response_format",
        "'response_format' of type 'structural_tag' is not supported by the engines serving this model.",
    )
    assert _check_common(body, "chat", frozenset({"sglang", "vllm"})) is None


#: ``/v1/responses``: SGLang ``protocol.py@004c82e0`` ``ResponsesRequest`` ("SGLang sampling
#: extras", read by ``to_sampling_params``); vLLM ``responses/protocol.py@010a69ce``
#: ``ResponsesRequest`` (``top_k``, ``skip_special_tokens``, ``repetition_penalty``, ``seed``,
#: ``stop``, ``ignore_eos``: passed to ``SamplingParams.from_optional``); the bundled backend's
#: ``_sampling`` (``seed``, ``stop``, ``stop_token_ids``, ``ignore_eos``)
RESPONSES = {
    "sglang": ("stop", "top_k", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty"),
    "vllm": ("stop", "top_k", "repetition_penalty", "seed", "ignore_eos", "skip_special_tokens"),
    "kvgate": ("stop", "seed", "stop_token_ids", "ignore_eos"),
}


@pytest.mark.parametrize(("engine", "field"), [(e, f) for e, fs in RESPONSES.items() for f in fs])
def test_responses_sampling_fields_pass(engine: str, field: str) -> None:
    body = {field: "sent"}
    filter_extensions(body, "responses", frozenset({engine}), frozenset())
    assert body == {field: "sent"}


@pytest.mark.parametrize("field", ["min_p", "min_tokens", "frequency_penalty"])
def test_responses_fields_vllm_does_not_read_are_refused(field: str) -> None:
    """vLLM's ``ResponsesRequest`` declares none of these (its ``OpenAIBaseModel`` ignores an
    unknown field with a warning): refused rather than dropped unread."""
    assert _refusal(filter_extensions, {field: 1}, "responses", frozenset({"vllm"}), frozenset()) == _body(
        field,
        f"Unrecognized request argument supplied: {field} (the engines serving this model do not accept it).",
    )


def test_responses_fields_sglang_does_not_read_are_refused() -> None:
    body = {"ignore_eos": True}
    assert _refusal(filter_extensions, body, "responses", frozenset({"sglang"}), frozenset()) == _body(
        "ignore_eos",
        "Unrecognized request argument supplied: ignore_eos (the engines serving this model do not accept it).",
    )
