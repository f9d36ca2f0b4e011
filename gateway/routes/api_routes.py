"""What is particular to ``/v1/responses``, ``/v1/embeddings`` and ``/tokenize`` /
``/detokenize`` on the request path (docs/design.md, "Routes"): their request schemas, which models
serve them (model ``task``), their counts and their gates. The request path itself (auth,
quotas, forwarding, settle, verification) is the one every route shares.

- ``/v1/responses``: ``input``/``instructions``/``tools`` are counted as the chat vLLM builds from
  them (:mod:`tokenizer.responses`); ``max_output_tokens`` is the one completion bound (absent:
  ``min(default_max_tokens, limit - prompt_tokens)``, sent upstream); the gate is chat's,
  ``prompt_tokens + max(1, max_output_tokens) <= limit``. Engine-side state
  (``previous_response_id``, ``conversation``, ``background: true``, ``store: true``) is refused
  (400) unless every upstream serving the model has ``pass_stateful_responses``; otherwise
  ``store: false`` is sent upstream, so the engine keeps nothing kvgate did not gate.
- ``/v1/embeddings``: each input (:mod:`tokenizer.embeddings`) must be ``<= limit`` (no
  completion) and all of them together ``<= pool limit``; at most the tenant's
  ``max_embedding_inputs`` inputs; TPM reserves their total.
- ``/tokenize``, ``/detokenize``: vLLM's request shapes (:mod:`gateway.routes.tokenize_handlers`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import orjson

from config.errors import ErrorCode, OpenAIError
from config.models import ImagePolicy, TenantConfig
from gateway.admission.body import (
    EXTENSION_FIELDS,
    INT64_MAX,
    INT64_MIN,
    MAX_GRAMMAR_BYTES,
    int_in,
    metadata_problem,
    num_in,
)
from gateway.admission.body import stop_problem as _stop
from gateway.admission.fields import check_bounded, check_output_constraints, check_tool_definitions, filter_extensions
from gateway.admission.gate import Admission, CompletionBound, ModelEntry, effective_limit
from gateway.admission.gate import PromptCount as AdmittedPrompt
from gateway.admission.grammar_bounds import schema_problem
from tokenizer import PromptCount, TokenizerError
from tokenizer.chat import string_chars
from tokenizer.embeddings import acount_embedding_input
from tokenizer.responses import ResponsesPrompt, acount_responses, responses_text, responses_to_chat

Check = Callable[[Any], str | None]

#: route -> the model tasks that serve it (``/tokenize`` and ``/detokenize`` serve every task)
ROUTE_TASKS: dict[str, tuple[str, ...]] = {
    "chat": ("chat",),
    "completions": ("chat",),
    "responses": ("chat",),
    "embeddings": ("embedding",),
    "tokenize": ("chat", "embedding"),
    "detokenize": ("chat", "embedding"),
}
#: model task -> the public paths it serves (for the 400's message)
TASK_PATHS: dict[str, tuple[str, ...]] = {
    "chat": ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/tokenize", "/detokenize"),
    "embedding": ("/v1/embeddings", "/tokenize", "/detokenize"),
}
ROUTE_PATHS = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "responses": "/v1/responses",
    "embeddings": "/v1/embeddings",
    "tokenize": "/tokenize",
    "detokenize": "/detokenize",
}


def check_task(entry: ModelEntry, route: str) -> None:
    """Raise 400 ``invalid_request_error`` (``param`` ``model``) when ``entry``'s task does not
    serve ``route``; the message says which routes it serves."""
    task = entry.config.task
    if task in ROUTE_TASKS.get(route, ()):
        return
    raise OpenAIError(
        400,
        f"The model `{entry.id}` is a{'n' if task[0] in 'aeiou' else ''} {task} model and does not serve "
        f"{ROUTE_PATHS.get(route, route)}; it serves {', '.join(TASK_PATHS[task])}.",
        code=ErrorCode.INVALID_REQUEST,
        param="model",
    )


# ------------------------------------------------------------------ schemas
def _bool(v: Any) -> str | None:
    return None if isinstance(v, bool) else "must be a boolean"


def _str(v: Any) -> str | None:
    return None if isinstance(v, str) else "must be a string"


def _obj(v: Any) -> str | None:
    return None if isinstance(v, dict) else "must be an object"


def _list(v: Any) -> str | None:
    return None if isinstance(v, list) else "must be an array"


def _str_or_obj(v: Any) -> str | None:
    return None if isinstance(v, (str, dict)) else "must be a string or an object"


def _any(v: Any) -> str | None:
    return None


def _one_of(*values: str) -> Check:
    def check(v: Any) -> str | None:
        return None if v in values else "must be one of " + ", ".join(repr(x) for x in values)

    return check


def _str_list(v: Any) -> str | None:
    return None if isinstance(v, list) and all(isinstance(s, str) for s in v) else "must be an array of strings"


def _response_stream_options(v: Any) -> str | None:
    if not isinstance(v, dict):
        return "must be an object"
    for k, b in v.items():
        if k != "include_obfuscation":
            return f"unknown option '{k}'"
        if not isinstance(b, bool):
            return f"'{k}' must be a boolean"
    return None


#: ``reasoning.effort`` (OpenAI ``ReasoningEffort``) and ``reasoning.summary`` values
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
_REASONING_SUMMARIES = ("auto", "concise", "detailed")
#: ``include`` values (OpenAI ``ResponseIncludable``)
INCLUDABLE = (
    "code_interpreter_call.outputs",
    "computer_call_output.output.image_url",
    "file_search_call.results",
    "message.input_image.image_url",
    "message.output_text.logprobs",
    "reasoning.encrypted_content",
    "web_search_call.action.sources",
    "web_search_call.results",
)
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
    if len(orjson.dumps(v)) > MAX_GRAMMAR_BYTES:
        return f"must be at most {MAX_GRAMMAR_BYTES} bytes as JSON"
    return None


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
    if len(orjson.dumps(fmt)) > MAX_GRAMMAR_BYTES:  # the engine compiles the schema into a grammar
        return f"'format' must be at most {MAX_GRAMMAR_BYTES} bytes as JSON"
    problem = schema_problem(fmt["schema"])
    return None if problem is None else f"'format.schema' {problem}"


#: ``POST /v1/responses`` (OpenAI ``ResponseCreateParams``; vLLM ``ResponsesRequest``): the OpenAI
#: fields, then the engine sampling fields that some engine's Responses model reads (which reach
#: which engine: :data:`gateway.admission.fields.ENGINE_EXTENSIONS`). Not here, so refused: ``prompt`` (a
#: stored prompt template), vLLM's ``previous_input_messages`` (they change the prompt in ways
#: kvgate cannot count).
RESPONSES_OPENAI_FIELDS: dict[str, Check] = {
    "model": _str,
    "input": _any,  # shape: validated while counting (tokenizer.responses)
    "instructions": _str,
    "tools": _list,
    "tool_choice": _tool_choice,
    "parallel_tool_calls": _bool,
    "max_output_tokens": int_in(1),
    "max_tool_calls": int_in(1),
    "temperature": num_in(0, 2),
    "top_p": num_in(0, 1),
    "top_logprobs": int_in(0, 20),
    "stream": _bool,
    "stream_options": _response_stream_options,
    "store": _bool,
    "background": _bool,
    "previous_response_id": _str,
    "conversation": _str_or_obj,
    "metadata": metadata_problem,
    "user": _str,
    "service_tier": _str,
    "truncation": _one_of("auto", "disabled"),
    "text": _text,
    "reasoning": _reasoning,
    "include": _include,
    "prompt_cache_key": _str,
    "safety_identifier": _str,
    "cache_salt": _str,  # replaced by the tenant's own
}
RESPONSES_FIELDS: dict[str, Check] = {
    **RESPONSES_OPENAI_FIELDS,
    "stop": _stop,
    "seed": int_in(INT64_MIN, INT64_MAX),
    "frequency_penalty": num_in(-2, 2),
    "presence_penalty": num_in(-2, 2),
    **{k: EXTENSION_FIELDS[k] for k in ("top_k", "min_p", "repetition_penalty", "min_tokens")},
    **{k: EXTENSION_FIELDS[k] for k in ("ignore_eos", "skip_special_tokens", "stop_token_ids")},
}

#: ``POST /v1/embeddings`` (OpenAI ``EmbeddingCreateParams``). vLLM's prompt-changing extensions
#: (``truncate_prompt_tokens``, ``add_special_tokens``) are refused.
EMBEDDINGS_FIELDS: dict[str, Check] = {
    "model": _str,
    "input": _any,  # shape: validated while counting (tokenizer.embeddings)
    "encoding_format": _one_of("float", "base64"),
    "dimensions": int_in(1),
    "user": _str,
}

#: ``POST /tokenize`` (vLLM ``TokenizeCompletionRequest`` / ``TokenizeChatRequest``): the chat
#: switches the gate counts (``add_generation_prompt``, ``continue_final_message``,
#: ``chat_template_kwargs``, as :class:`~tokenizer.chat.ChatOptions`); a custom ``chat_template``
#: is refused.
TOKENIZE_FIELDS: dict[str, Check] = {
    "model": _str,
    "prompt": _str,
    "messages": _list,
    "tools": _list,
    "add_special_tokens": _bool,
    "add_generation_prompt": _bool,
    "continue_final_message": _bool,
    "chat_template_kwargs": _obj,
    "return_token_strs": _bool,
}

#: ``POST /detokenize`` (vLLM ``DetokenizeRequest``)
DETOKENIZE_FIELDS: dict[str, Check] = {"model": _str, "tokens": _list}

FIELDS = {
    "responses": RESPONSES_FIELDS,
    "embeddings": EMBEDDINGS_FIELDS,
    "tokenize": TOKENIZE_FIELDS,
    "detokenize": DETOKENIZE_FIELDS,
}
REQUIRED = {"responses": ("input",), "embeddings": ("input",), "tokenize": (), "detokenize": ("tokens",)}


def _bad(param: str, problem: str) -> OpenAIError:
    return OpenAIError(400, f"Invalid value for '{param}': {problem}", code=ErrorCode.INVALID_REQUEST, param=param)


def validate(body: dict[str, Any], route: str) -> None:
    """Check every top-level field of a ``route`` body (``responses``, ``embeddings``,
    ``tokenize``, ``detokenize``): required fields present, known fields of the right type and
    range (``null`` accepted for optional fields), unknown fields refused. Raises
    :class:`OpenAIError` 400 with ``param`` the field."""
    fields = FIELDS[route]
    for name in REQUIRED[route]:
        if body.get(name) is None:
            raise OpenAIError(400, f"Missing required parameter: '{name}'.", code=ErrorCode.INVALID_REQUEST, param=name)
    for key, value in body.items():
        check = fields.get(key)
        if check is None:
            raise OpenAIError(
                400, f"Unrecognized request argument supplied: {key}", code=ErrorCode.INVALID_REQUEST, param=key
            )
        if value is None:
            continue
        problem = check(value)
        if problem is not None:
            raise _bad(key, problem)
    if route == "responses" and body.get("stream_options") is not None and not body.get("stream"):
        raise OpenAIError(
            400,
            "'stream_options' is only allowed when 'stream' is true.",
            code=ErrorCode.INVALID_REQUEST,
            param="stream_options",
        )
    if route == "tokenize":
        has_prompt, has_messages = body.get("prompt") is not None, body.get("messages") is not None
        if has_prompt == has_messages:
            raise OpenAIError(
                400,
                "Send exactly one of 'prompt' (a string) or 'messages'.",
                code=ErrorCode.INVALID_REQUEST,
                param="prompt" if has_prompt else "messages",
            )
        if has_prompt:
            for key in ("tools", "add_generation_prompt", "continue_final_message", "chat_template_kwargs"):
                if body.get(key) is not None:
                    raise _bad(key, "is only allowed with 'messages'")
        if body.get("add_generation_prompt") and body.get("continue_final_message"):
            raise _bad("continue_final_message", "cannot be true together with 'add_generation_prompt'")
        if has_messages and body.get("add_special_tokens"):
            raise _bad("add_special_tokens", "must be false with 'messages' (the template adds what the model needs)")


# ------------------------------------------------------------------ /v1/responses
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


async def count_responses(entry: ModelEntry, body: dict[str, Any]) -> tuple[ResponsesPrompt, int]:
    """``(the prompt as chat, its prompt tokens)``, after the engines' field policy
    (:func:`gateway.admission.fields.filter_extensions`). Raises :class:`OpenAIError` 400 naming the
    field (an extension field no engine of the model reads, ``input[2].content[0].type``,
    ``tools[0].type``; ``tools[0].name`` holding one of the model's special tokens:
    :func:`gateway.admission.fields.check_tool_definitions`) or 502 for an engine tokenizer."""
    filter_extensions(body, "responses", entry.engines, frozenset(RESPONSES_OPENAI_FIELDS))
    check_output_constraints(body, entry.engines)
    check_image_urls(body, entry.config.images)
    args = (body.get("input"), body.get("instructions"), body.get("tools"))

    def convert() -> ResponsesPrompt:
        check_tool_definitions(body.get("tools"), entry.counter.special_token_texts, entry.engines)
        return responses_to_chat(*args)

    try:
        if string_chars(args, entry.counter.offload_chars) > entry.counter.offload_chars:
            prompt = await asyncio.to_thread(convert)  # a long input: check and convert off the loop
        else:
            prompt = convert()
        return prompt, await acount_responses(entry.counter, prompt)
    except TokenizerError as e:
        raise e.to_openai() from None


def responses_length_message(limit: int, prompt_tokens: int, max_output_tokens: int) -> str:
    """Chat's ``context_length_exceeded`` wording (its first sentences kept: clients parse them),
    in the Responses API's terms: ``input`` and ``max_output_tokens``."""
    return (
        f"This model's maximum context length is {limit} tokens. However, you requested "
        f"{prompt_tokens + max_output_tokens} tokens ({prompt_tokens} in the input, {max_output_tokens} in "
        "max_output_tokens). Please reduce the length of the input or max_output_tokens."
    )


def decide_responses(
    entry: ModelEntry,
    tenant: TenantConfig,
    body: dict[str, Any],
    prompt: ResponsesPrompt,
    prompt_tokens: int,
    pool_limit: int,
) -> Admission:
    """The context gate of a Responses request with ``max_output_tokens`` as the completion
    bound (chat's rule). Raises :class:`OpenAIError` 400 (``max_output_tokens`` over the cap,
    ``context_length_exceeded`` with ``param`` ``input``)."""
    limit = effective_limit(entry, tenant, pool_limit)
    requested = body.get("max_output_tokens")
    cap = tenant.max_tokens_cap
    if requested is not None:
        if cap is not None and requested > cap:
            raise OpenAIError(
                400,
                f"'max_output_tokens' is {requested}, above this key's cap of {cap} tokens.",
                code=ErrorCode.INVALID_REQUEST,
                param="max_output_tokens",
            )
        max_tokens, defaulted = requested, False
    else:
        max_tokens = min(tenant.default_max_tokens, limit - prompt_tokens)
        if cap is not None:
            max_tokens = min(max_tokens, cap)
        max_tokens, defaulted = max(max_tokens, 1), True  # below 1 nothing fits: the gate says so
    if prompt_tokens + max_tokens > limit:  # one sequence: the KV demand is this same sum (limit <= pool)
        raise OpenAIError(
            400,
            responses_length_message(limit, prompt_tokens, max_tokens),
            code=ErrorCode.CONTEXT_LENGTH_EXCEEDED,
            param="input",
            prompt_tokens=prompt_tokens,
        )
    check_bounded(body, max_tokens, entry.counter.vocab_size)
    return Admission(
        entry,
        AdmittedPrompt(prompt_tokens, prompt_tokens, 1, responses_text(prompt)),
        CompletionBound(max_tokens, defaulted, "max_output_tokens"),
        limit,
        1,
        1,
        prompt_tokens + max_tokens,
    )


# ------------------------------------------------------------------ /v1/embeddings
def embedding_length_message(limit: int, tokens: int) -> str:
    """vLLM's wording for an embedding input above the model's length (``serving_engine.py``)."""
    return (
        f"This model's maximum context length is {limit} tokens. However, you requested {tokens} tokens in the "
        "input for embedding generation. Please reduce the length of the input."
    )


def batch_over_pool(tokens: int, inputs: int, pool_limit: int, *, at_least: bool = False) -> OpenAIError:
    """The 400 (``param`` ``input``) for an embeddings batch of ``inputs`` inputs holding
    ``tokens`` tokens in all (``at_least``: a lower bound, before counting) over ``pool_limit``."""
    return OpenAIError(
        400,
        f"This request needs {'at least ' if at_least else ''}{tokens} tokens of KV cache ({inputs} inputs); "
        f"the engines serving this model hold at most {pool_limit} for one request. Send fewer or shorter inputs.",
        code=ErrorCode.INVALID_REQUEST,
        param="input",
    )


def _batch_lower_bound(entry: ModelEntry, value: list[Any]) -> int:
    """A lower bound of a batch's tokens without counting: each token-id list's length, each
    string's characters over the counter's ``max_token_chars``."""
    per = entry.counter.max_token_chars
    return sum(len(p) if isinstance(p, list) else len(p) // per if isinstance(p, str) and per else 0 for p in value)


async def count_embeddings(
    entry: ModelEntry, tenant: TenantConfig, body: dict[str, Any], pool_limit: int | None = None
) -> PromptCount:
    """Tokens of each input. Raises :class:`OpenAIError` 400: more inputs than the tenant's
    ``max_embedding_inputs`` (``param`` ``input``; checked before anything is counted), a batch
    certainly over ``pool_limit`` (the live pool limit, when known: :func:`batch_over_pool`, before
    any id is checked or text counted), a bad shape or token id (``input`` / ``input[i]``)."""
    value = body.get("input")
    cap = tenant.max_embedding_inputs
    if isinstance(value, list) and value and not isinstance(value[0], int):  # a batch
        if len(value) > cap:
            raise OpenAIError(
                400,
                f"'input' holds {len(value)} inputs, above this key's cap of {cap} inputs per request.",
                code=ErrorCode.INVALID_REQUEST,
                param="input",
            )
        if pool_limit is not None and (lower := _batch_lower_bound(entry, value)) > pool_limit:
            raise batch_over_pool(lower, len(value), pool_limit, at_least=True)
    try:
        return await acount_embedding_input(entry.counter, value)
    except TokenizerError as e:
        raise e.to_openai() from None


def embeddings_text(body: dict[str, Any]) -> str:
    """The string inputs joined by newlines (the verifier's view of the request's own text)."""
    v = body.get("input")
    if isinstance(v, str):
        return v
    return "\n".join(x for x in v if isinstance(x, str)) if isinstance(v, list) else ""


def decide_embeddings(
    entry: ModelEntry, tenant: TenantConfig, body: dict[str, Any], counts: PromptCount, pool_limit: int
) -> Admission:
    """Each input ``<= limit`` (the first one above it is named: ``input`` or ``input[i]``: 400
    ``context_length_exceeded``) and the inputs' total ``<= pool_limit`` (400 naming ``input``);
    the reservation is the total, with no completion. Raises :class:`OpenAIError`."""
    limit = effective_limit(entry, tenant, pool_limit)
    value = body.get("input")
    single = len(counts.per_prompt) == 1 and not (
        isinstance(value, list) and value and isinstance(value[0], (str, list))
    )
    for i, c in enumerate(counts.per_prompt):
        if c > limit:
            raise OpenAIError(
                400,
                embedding_length_message(limit, c),
                code=ErrorCode.CONTEXT_LENGTH_EXCEEDED,
                param="input" if single else f"input[{i}]",
                prompt_tokens=counts.total,
            )
    n = len(counts.per_prompt)
    if counts.total > pool_limit:  # the engine holds the whole batch's KV at once, as a completion's
        raise batch_over_pool(counts.total, n, pool_limit)
    prompt = AdmittedPrompt(counts.largest, counts.total, n, embeddings_text(body))
    return Admission(entry, prompt, CompletionBound(0, False, "max_tokens"), limit, 1, n, counts.total)


# ------------------------------------------------------------------ what goes upstream
def stateful_passthrough(upstreams: list[Any]) -> bool:
    """Whether stateful Responses features pass: every upstream serving the model (``upstreams``:
    :class:`gateway.relay.upstreams.Upstream`) has ``pass_stateful_responses``, and there is one."""
    return bool(upstreams) and all(u.config.pass_stateful_responses for u in upstreams)


def upstream_body(body: dict[str, Any], route: str, adm: Admission, cache_salt: str, passthrough: bool) -> bytes:
    """The body to forward for ``responses`` / ``embeddings``, as JSON bytes (``body`` changed
    in place): ``model`` becomes the ``upstream_model`` and any client ``cache_salt`` is dropped;
    Responses also get the tenant's ``cache_salt``, ``max_output_tokens`` (the gated bound,
    always explicit) and, unless stateful features pass, ``store: false``. Nothing else changes:
    no ``stream_options`` is added (usage comes in ``response.completed``)."""
    body["model"] = adm.model.upstream_model
    body.pop("cache_salt", None)
    if route == "responses":
        body["cache_salt"] = cache_salt
        body["max_output_tokens"] = adm.max_tokens
        if not passthrough:
            body["store"] = False
    return orjson.dumps(body)
