"""``POST /v1/responses`` as a route value (:data:`RESPONSES`): ``input``/``instructions``/
``tools`` are counted as the chat vLLM builds from them (:mod:`tokenizer.responses`);
``max_output_tokens`` is the one completion bound, under the gate's rule for chat
(:func:`gateway.admission.gate.decide`; absent: ``min(default_max_tokens, limit -
prompt_tokens)``, sent upstream). Engine-side state (``previous_response_id``, ``conversation``,
``background: true``, ``store: true``) is refused (400) unless every upstream serving the model
has ``pass_stateful_responses``; otherwise ``store: false`` is sent upstream, so the engine keeps
nothing kvgate did not gate. Usage comes in ``response.completed``: no ``stream_options`` is added.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import orjson

from config.errors import ErrorCode, OpenAIError
from config.models import ImagePolicy, TenantConfig
from gateway.admission.checks import (
    EXTENSION_FIELDS,
    INT64_MAX,
    INT64_MIN,
    check_fields,
    check_stream_options,
    drop_nulls,
    json_size_problem,
    metadata_problem,
    stop_problem,
)
from gateway.admission.engine_refusals import check_engine_refusals, check_image_parts
from gateway.admission.fields import (
    check_output_constraints,
    check_tool_definitions,
    filter_extensions,
    responses_chat_options,
)
from gateway.admission.gate import Admission, CountedPrompt, decide
from gateway.admission.grammar_bounds import schema_problem
from gateway.admission.registry import ModelEntry
from gateway.admission.value_checks import (
    Check,
    anything,
    array,
    boolean,
    enum,
    int_in,
    num_in,
    one_of,
    str_or_obj,
    string,
)
from gateway.relay.stream_protocol import RESPONSES_SSE, StreamProtocol
from gateway.relay.whole_answer import read_response_answer
from tokenizer import TokenizerError
from tokenizer.base import off_loop
from tokenizer.chat import string_chars
from tokenizer.responses import ResponsesPrompt, acount_responses, responses_text, responses_to_chat
from verifier.engine_response import EngineOutput


def _response_stream_options(v: Any) -> str | None:
    if not isinstance(v, dict):
        return "must be an object"
    for k, b in v.items():
        if k != "include_obfuscation":
            return f"unknown option '{k}'"
        if not isinstance(b, bool):
            return f"'{k}' must be a boolean"
    return None


#: ``reasoning.effort`` (OpenAI ``ReasoningEffort``, the type vLLM's ``Reasoning`` takes; SGLang's
#: ``ReasoningEffortTier``, ``protocol.py@004c82e0``) and ``reasoning.summary`` values
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
_REASONING_SUMMARIES = ("auto", "concise", "detailed")
#: ``include`` values: OpenAI's ``ResponseIncludable`` that the engines' ``ResponsesRequest`` take
#: (vLLM ``responses/protocol.py``: a ``Literal`` of these six). The two ``web_search_call.*`` ones
#: were the engine's 400 after the prompt was charged (and web search, a built-in tool, is refused).
INCLUDABLE = (
    "code_interpreter_call.outputs",
    "computer_call_output.output.image_url",
    "file_search_call.results",
    "message.input_image.image_url",
    "message.output_text.logprobs",
    "reasoning.encrypted_content",
)
#: ``service_tier`` values vLLM's ``ResponsesRequest`` takes (a ``Literal``; OpenAI's SDK adds
#: ``fast`` and ``ultrafast``): any other string was the engine's 400 after the prompt was charged
SERVICE_TIERS = ("auto", "default", "flex", "scale", "priority")
#: the keys of a message item (OpenAI ``EasyInputMessage``, ``Message``, ``ResponseOutputMessage``)
MESSAGE_ITEM_KEYS = frozenset(("type", "role", "content", "status", "id", "phase"))
#: ``tool_choice`` object types (OpenAI ``ToolChoice``) -> the string keys each needs
_TOOL_CHOICE_TYPES: dict[str, tuple[str, ...]] = {
    "function": ("name",),
    "custom": ("name",),
    "allowed_tools": ("mode",),
    "mcp": ("server_label",),
    "file_search": (),
    "web_search_preview": (),
    "web_search_preview_2025_03_11": (),
    "computer_use_preview": (),
    "code_interpreter": (),
    "image_generation": (),
}


def _reasoning(v: Any) -> str | None:
    problem = (
        f"must be an object with 'effort' ({', '.join(REASONING_EFFORTS)}) and 'summary' "
        f"({', '.join(_REASONING_SUMMARIES)})"
    )
    if not isinstance(v, dict):
        return problem
    for k, x in v.items():
        values = REASONING_EFFORTS if k == "effort" else _REASONING_SUMMARIES
        if k not in ("effort", "summary", "generate_summary") or (x is not None and x not in values):
            return problem
    return None


def _include(v: Any) -> str | None:
    if isinstance(v, list) and len(v) <= len(INCLUDABLE) and all(isinstance(x, str) and x in INCLUDABLE for x in v):
        return None
    return "must be an array of " + ", ".join(INCLUDABLE)


def _tool_choice(v: Any) -> str | None:
    if isinstance(v, str):
        return None if v in ("none", "auto", "required") else "must be none, auto, required or an object"
    kind = v.get("type") if isinstance(v, dict) else None
    if not isinstance(kind, str) or kind not in _TOOL_CHOICE_TYPES:
        return "must be none, auto, required or an object whose 'type' is " + ", ".join(_TOOL_CHOICE_TYPES)
    for key in _TOOL_CHOICE_TYPES[kind]:
        if not isinstance(v.get(key), str):
            return f"'{key}' must be a string for type '{kind}'"
    if kind == "allowed_tools" and (v["mode"] not in ("auto", "required") or not isinstance(v.get("tools"), list)):
        return "allowed_tools needs 'mode' (auto or required) and 'tools' (an array)"
    return json_size_problem(v)


def _text(v: Any) -> str | None:
    """``text``: ``format`` (``text`` | ``json_object`` | ``json_schema`` with ``name`` and an
    object ``schema`` of at most :data:`MAX_GRAMMAR_BYTES` as JSON, free of the constructs of
    :func:`gateway.admission.grammar_bounds.schema_problem`) and ``verbosity``."""
    if not isinstance(v, dict) or any(k not in ("format", "verbosity") for k in v):
        return "must be an object with 'format' and 'verbosity'"
    if v.get("verbosity") not in (None, "low", "medium", "high"):
        return "'verbosity' must be low, medium or high"
    fmt = v.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind not in ("text", "json_object", "json_schema"):
        return "'format' must be an object whose 'type' is text, json_object or json_schema"
    if kind != "json_schema":
        return None
    if not isinstance(fmt.get("name"), str) or not isinstance(fmt.get("schema"), dict):
        return "'format' of type json_schema needs 'name' (a string) and 'schema' (an object)"
    if problem := json_size_problem(fmt):  # the engine compiles the schema into a grammar
        return f"'format' {problem}"
    problem = schema_problem(fmt["schema"])
    return None if problem is None else f"'format.schema' {problem}"


#: ``POST /v1/responses`` (OpenAI ``ResponseCreateParams``; vLLM ``ResponsesRequest``): the OpenAI
#: fields, then the engine sampling fields that some engine's Responses model reads (which reach
#: which engine: :data:`gateway.admission.fields.ENGINE_EXTENSIONS`). Not here, so refused: ``prompt`` (a
#: stored prompt template), vLLM's ``previous_input_messages`` (they change the prompt in ways
#: kvgate cannot count).
RESPONSES_OPENAI_FIELDS: dict[str, Check] = {
    "model": string,
    "input": anything,  # shape: validated while counting (tokenizer.responses)
    "instructions": string,
    "tools": array,
    "tool_choice": _tool_choice,
    "parallel_tool_calls": boolean,
    "max_output_tokens": int_in(1, INT64_MAX),
    "max_tool_calls": int_in(1, INT64_MAX),
    "temperature": num_in(0, 2),
    "top_p": num_in(0, 1),
    "top_logprobs": int_in(0, 20),
    "stream": boolean,
    "stream_options": _response_stream_options,
    "store": boolean,
    "background": boolean,
    "previous_response_id": string,
    "conversation": str_or_obj,
    "metadata": metadata_problem,
    "user": string,
    "service_tier": enum(*SERVICE_TIERS),
    "truncation": one_of("auto", "disabled"),
    "text": _text,
    "reasoning": _reasoning,
    "include": _include,
    "prompt_cache_key": string,
    "safety_identifier": string,
    "cache_salt": string,  # replaced by the tenant's own
}
RESPONSES_FIELDS: dict[str, Check] = {
    **RESPONSES_OPENAI_FIELDS,
    "stop": stop_problem,
    "seed": int_in(INT64_MIN, INT64_MAX),
    "frequency_penalty": num_in(-2, 2),
    "presence_penalty": num_in(-2, 2),
    **{k: EXTENSION_FIELDS[k] for k in ("top_k", "min_p", "repetition_penalty", "min_tokens")},
    **{k: EXTENSION_FIELDS[k] for k in ("ignore_eos", "skip_special_tokens", "stop_token_ids")},
}

#: the stateful features of the Responses API: field -> whether its value asks for engine state
STATEFUL_FIELDS: dict[str, Callable[[Any], bool]] = {
    "previous_response_id": lambda v: v is not None,
    "conversation": lambda v: v is not None,
    "background": lambda v: v is True,
    "store": lambda v: v is True,
}


def stateful_field(body: dict[str, Any]) -> str | None:
    """The first field of ``body`` that asks the engine to keep or use stored state, else ``None``."""
    for key, asks in STATEFUL_FIELDS.items():
        if asks(body.get(key)):
            return key
    return None


def refuse_stateful(body: dict[str, Any], passthrough: bool) -> None:
    """400 ``invalid_request_error`` naming the stateful field, unless ``passthrough`` (every
    upstream of the model has ``pass_stateful_responses``)."""
    key = stateful_field(body)
    if key is None or passthrough:
        return
    raise OpenAIError(
        400,
        f"'{key}' asks the engine to keep or reuse conversation state, which kvgate cannot count or "
        "gate; send the whole conversation in 'input' instead (and leave 'store' unset or false).",
        code=ErrorCode.INVALID_REQUEST,
        param=key,
    )


def stateful_passthrough(upstreams: list[Any]) -> bool:
    """Whether stateful Responses features pass: every upstream serving the model (``upstreams``:
    :class:`gateway.relay.upstreams.Upstream`) has ``pass_stateful_responses``, and there is one."""
    return bool(upstreams) and all(u.config.pass_stateful_responses for u in upstreams)


def check_image_urls(body: dict[str, Any], policy: ImagePolicy) -> None:
    """Every ``input_image`` URL of ``input`` (messages and function-call outputs) must be a
    ``data:`` URL, or an ``http(s)`` URL on one of ``policy.allowed_url_hosts`` (chat's rule: the
    engine would fetch any other URL itself). Raises :class:`OpenAIError` 400 naming
    ``input[i].content[j].image_url``."""
    items = body.get("input")
    if not isinstance(items, list):
        return
    allowed = {h.lower() for h in policy.allowed_url_hosts}
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            continue
        for key in ("content", "output"):
            parts = item.get(key)
            for j, part in enumerate(parts if isinstance(parts, list) else ()):
                if not isinstance(part, dict) or part.get("type") != "input_image":
                    continue
                url = part.get("image_url")
                if not isinstance(url, str) or url[:5].lower() == "data:":
                    continue  # a missing URL is the counter's 400
                try:
                    split = urlsplit(url)
                    ok = split.scheme.lower() in ("http", "https") and (split.hostname or "").lower() in allowed
                except ValueError:
                    ok = False
                if not ok:
                    param = f"input[{i}].{key}[{j}].image_url"
                    raise OpenAIError(
                        400,
                        f"'{param}' must be a data: URL"
                        + (f" or an http(s) URL on {', '.join(sorted(allowed))}" if allowed else "")
                        + "; the engine would fetch any other URL itself.",
                        code=ErrorCode.INVALID_REQUEST,
                        param=param,
                    )


def check_input_items(body: dict[str, Any]) -> None:
    """Refuse what an ``input`` item carries into the engine's prompt that kvgate does not count:
    a message item's key beyond :data:`MESSAGE_ITEM_KEYS` (vLLM hands a user, system or developer
    message item to its chat parser as sent, which keeps ``name`` for the template; an older vLLM
    and SGLang do the same with an assistant one, keeping ``tool_calls`` and
    ``reasoning_content``; OpenAI refuses the key) and a ``function_call``'s ``namespace`` (vLLM
    renders the call's name as ``<namespace>__<name>``). Raises :class:`OpenAIError` 400 naming
    ``input[i].<key>``; other shapes are the counter's to refuse."""
    items = body.get("input")
    if not isinstance(items, list):
        return
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            continue
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            extra = next((k for k in item if k not in MESSAGE_ITEM_KEYS), None)
            if extra is not None:
                param = f"input[{i}].{extra[:64]}"
                raise OpenAIError(
                    400,
                    f"Unknown parameter: '{param}'. A message item holds only "
                    + ", ".join(sorted(MESSAGE_ITEM_KEYS))
                    + "; the engine would pass other keys on to the chat template, a prompt kvgate did not count.",
                    code=ErrorCode.INVALID_REQUEST,
                    param=param,
                )
        elif kind == "function_call" and item.get("namespace") is not None:
            param = f"input[{i}].namespace"
            raise OpenAIError(
                400,
                f"'{param}' is not supported: kvgate serves 'function' tools only, and the engine would render "
                "the call's name with its namespace, a prompt kvgate did not count.",
                code=ErrorCode.INVALID_REQUEST,
                param=param,
            )


def check_tool_choice_target(body: dict[str, Any]) -> None:
    """A ``tool_choice`` of type ``function`` or ``custom`` must name one of ``tools`` (when
    ``tools`` are given): vLLM refuses any other name ("Tool '...' has not been passed in
    ``tools``"), after kvgate had admitted the request and charged its prompt; OpenAI refuses it
    too. Raises :class:`OpenAIError` 400 naming ``tool_choice``."""
    choice, tools = body.get("tool_choice"), body.get("tools")
    if not isinstance(choice, dict) or choice.get("type") not in ("function", "custom") or not tools:
        return
    kind, name = choice["type"], choice.get("name")
    if isinstance(tools, list) and any(
        isinstance(t, dict) and t.get("type") == kind and t.get("name") == name for t in tools
    ):
        return
    raise OpenAIError(
        400,
        f"'tool_choice' names the {kind} tool {str(name)[:64]!r}, which is not in 'tools'.",
        code=ErrorCode.INVALID_REQUEST,
        param="tool_choice",
    )


#: OpenAI ``FunctionTool``'s fields, in its declaration order. vLLM hands the chat template each
#: function tool as ``FunctionTool.model_dump()`` (every field, ``None`` when unset) less ``type``,
#: through its ``FunctionDefinition`` (``responses/utils.py`` ``construct_tool_dicts``; extra keys
#: kept): ``"strict": null`` and the rest are in the prompt. The newest SDK's fields; an engine on
#: an older SDK renders fewer (counted a little high, never low).
FUNCTION_TOOL_FIELDS = (
    "name",
    "parameters",
    "strict",
    "type",
    "allowed_callers",
    "async_",
    "defer_loading",
    "description",
    "output_schema",
)


def vllm_function_tools(tools: Any) -> Any:
    """``tools`` with every ``function`` tool holding all of :data:`FUNCTION_TOOL_FIELDS` (unset ones
    ``None``), as vLLM's Responses path dumps them for the template; anything else as sent."""
    if not isinstance(tools, list):
        return tools
    return [
        {**dict.fromkeys(FUNCTION_TOOL_FIELDS), **t} if isinstance(t, dict) and t.get("type") == "function" else t
        for t in tools
    ]


def responses_length_message(limit: int, prompt_tokens: int, max_output_tokens: int) -> str:
    """Chat's ``context_length_exceeded`` wording (its first sentences kept: clients parse them),
    in the Responses API's terms: ``input`` and ``max_output_tokens``."""
    return (
        f"This model's maximum context length is {limit} tokens. However, you requested "
        f"{prompt_tokens + max_output_tokens} tokens ({prompt_tokens} in the input, {max_output_tokens} in "
        "max_output_tokens). Please reduce the length of the input or max_output_tokens."
    )


async def count_responses(entry: ModelEntry, body: dict[str, Any]) -> CountedPrompt:
    """The prompt's tokens (and its text, for the verifier) as the chat vLLM builds from
    ``input``, after the engines' field policy (:func:`gateway.admission.fields.filter_extensions`)
    and the values they would refuse after admission
    (:func:`gateway.admission.engine_refusals.check_engine_refusals`; an image part where an
    engine takes no images: :func:`gateway.admission.engine_refusals.check_image_parts`). Raises
    :class:`OpenAIError` 400 naming the field (an extension field no engine of the model reads,
    ``top_p`` 0, ``input[0].content[1]`` (an image, for the bundled backend),
    ``input[2].content[0].type``, ``tools[0].type``; ``tools[0].name`` holding one of the model's
    special tokens: :func:`gateway.admission.fields.check_tool_definitions`) or 502 for an engine
    tokenizer."""
    filter_extensions(body, "responses", entry.engines, frozenset(RESPONSES_OPENAI_FIELDS))
    check_output_constraints(body, entry.engines)
    check_engine_refusals(body, entry.engines, "responses")
    check_image_parts(body, entry.engines, "responses")  # before the URL policy: no URL makes it acceptable
    check_image_urls(body, entry.config.images)
    check_input_items(body)
    options = responses_chat_options(body, entry.engines)
    tools = body.get("tools")
    args = (
        body.get("input"),
        body.get("instructions"),
        vllm_function_tools(tools) if "vllm" in entry.engines else tools,
    )

    def convert() -> tuple[ResponsesPrompt, str]:
        check_tool_definitions(body.get("tools"), entry.counter.special_token_texts, entry.engines)
        prompt = responses_to_chat(*args)
        return prompt, responses_text(prompt)

    try:
        limit = entry.counter.offload_chars  # a long input is checked, converted and gathered off the loop
        prompt, text = await off_loop(string_chars(args, limit), limit, convert)
        tokens = await acount_responses(entry.counter, prompt, options)
    except TokenizerError as e:
        raise e.to_openai() from None
    return CountedPrompt(tokens, tokens, 1, text)


class ResponsesRoute:
    """The Responses API (OpenAI ``ResponseCreateParams``)."""

    name = "responses"
    path = "/v1/responses"
    upstream_path = "/responses"
    tasks: tuple[str, ...] = ("chat",)
    id_fields: tuple[str, ...] = ("prompt", "input")
    stream_protocol: StreamProtocol = RESPONSES_SSE
    streams = True
    adds_usage = False
    verified = True
    fields = RESPONSES_FIELDS
    bound_fields: tuple[str, ...] = ("max_output_tokens",)
    prompt_param = "input"

    def validate(self, body: dict[str, Any]) -> None:
        check_fields(body, self.fields, ("input",))
        check_stream_options(body)
        check_tool_choice_target(body)

    def forwarded_bound(self, engines: frozenset[str]) -> str:
        return "max_output_tokens"

    def length_message(self, limit: int, largest: int, max_tokens: int) -> str:
        return responses_length_message(limit, largest, max_tokens)

    async def count(
        self, entry: ModelEntry, tenant: TenantConfig, body: dict[str, Any], served: list[Any], live: int | None
    ) -> CountedPrompt:
        refuse_stateful(body, stateful_passthrough(served))
        return await count_responses(entry, body)

    def decide(
        self, entry: ModelEntry, tenant: TenantConfig, body: dict[str, Any], prompt: CountedPrompt, pool_limit: int
    ) -> Admission:
        return decide(entry, tenant, body, self, prompt, pool_limit)

    def forward_body(self, body: dict[str, Any], adm: Admission, cache_salt: str, served: list[Any]) -> bytes:
        """``model`` becomes the ``upstream_model``, a field sent as ``null`` is left out
        (:func:`~gateway.admission.checks.drop_nulls`), the tenant's ``cache_salt`` replaces any client one,
        ``max_output_tokens`` is the gated bound (always explicit) and, unless stateful features
        pass, ``store: false``."""
        drop_nulls(body)
        body["model"] = adm.model.upstream_model
        body.pop("cache_salt", None)
        body["cache_salt"] = cache_salt
        body["max_output_tokens"] = adm.max_tokens
        if not stateful_passthrough(served):
            body["store"] = False
        return orjson.dumps(body)

    def verifier_prompts(self, body: dict[str, Any]) -> tuple[list[list[int]], list[str]]:
        return [], []

    def prompt_text(self, body: dict[str, Any]) -> str:
        return ""  # counted with its text (count_responses)

    def whole_answer(self, data: Any) -> EngineOutput:
        return read_response_answer(data)


RESPONSES = ResponsesRoute()
