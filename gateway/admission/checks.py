"""The validator kit (step 3): a route's field table maps each top-level field to a check that
returns a problem (``"must be ..."``) or ``None``; :func:`check_fields` applies a table. Here are
the checks of the fields shared by routes and of the engine extension fields (built from
:mod:`gateway.admission.value_checks`; a structural tag's are :mod:`gateway.admission.structural_tag`'s),
and the tables of ``/v1/chat/completions`` and ``/v1/completions`` (the other routes build theirs
in :mod:`gateway.routes`).

Validation is by hand (a table of field checks), not by building pydantic models per request: it
is on the hot path. Every failure is a 400 ``invalid_request_error`` whose ``param`` names the
field. Message and prompt *contents* are validated by the tokenizer while counting (it raises
typed errors naming ``messages[i].content[j].type`` etc.).
"""

from __future__ import annotations

from typing import Any

import orjson

from config.errors import ErrorCode, OpenAIError
from gateway.admission.grammar_bounds import ebnf_problem, regex_problem, schema_problem
from gateway.admission.structural_tag import structural_tag_problem
from gateway.admission.value_checks import (
    Check,
    anything,
    array,
    boolean,
    enum,
    int_in,
    is_int,
    is_num,
    num_in,
    obj,
    str_or_obj,
    string,
)


def bad_value(param: str, problem: str) -> OpenAIError:
    """The 400 ``Invalid value for 'param': problem`` (``param`` the field)."""
    return OpenAIError(400, f"Invalid value for '{param}': {problem}", code=ErrorCode.INVALID_REQUEST, param=param)


#: most ``stop`` strings (the OpenAI schema's 4; vLLM and SGLang take any number)
MAX_STOPS = 16
#: longest ``stop`` string, in UTF-8 bytes: every decode step scans the new text against each
#: string, and vLLM holds back that many characters of a stream until it can rule a match out
MAX_STOP_BYTES = 1024
#: all ``stop`` strings of a request together, in UTF-8 bytes
MAX_STOP_TOTAL_BYTES = 4096


def stop_problem(v: Any) -> str | None:
    """``stop``: a string or at most :data:`MAX_STOPS` strings, none empty, each at most
    :data:`MAX_STOP_BYTES` and all together at most :data:`MAX_STOP_TOTAL_BYTES` (UTF-8). An
    empty string is the engines' own 400 (vLLM ``SamplingParams._verify_args``: "stop cannot
    contain an empty string"; the bundled backend's ``gpu_backend/openai_api.py`` ``_stop``), which
    came after the request was admitted and its prompt charged."""
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or len(stops) > MAX_STOPS or not all(isinstance(s, str) for s in stops):
        return f"must be a string or an array of at most {MAX_STOPS} strings"
    if not all(stops):
        return "must not contain an empty string"
    total = 0
    for s in stops:
        size = len(s) if len(s) > MAX_STOP_BYTES else len(s.encode("utf-8", "surrogatepass"))  # bytes >= chars
        if size > MAX_STOP_BYTES:
            return f"each stop string must be at most {MAX_STOP_BYTES} bytes (UTF-8)"
        total += size
    if total > MAX_STOP_TOTAL_BYTES:
        return f"the stop strings must be at most {MAX_STOP_TOTAL_BYTES} bytes (UTF-8) in all"
    return None


def _stream_options(v: Any) -> str | None:
    if not isinstance(v, dict):
        return "must be an object"
    for k, b in v.items():
        if k in ("include_usage", "continuous_usage_stats", "include_obfuscation"):
            if not isinstance(b, bool) and b is not None:  # null: absent (:func:`check_stream_options`)
                return f"'{k}' must be a boolean"
        else:
            return f"unknown option '{k}'"
    return None


INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
#: largest grammar string (``regex``, ``ebnf``, ``json_schema``) forwarded, in UTF-8 bytes
MAX_GRAMMAR_BYTES = 32 * 1024
#: most ``stop_token_ids`` entries
MAX_STOP_TOKEN_IDS = 64


def json_size_problem(v: Any, limit: int = MAX_GRAMMAR_BYTES) -> str | None:
    """Why ``v`` (a parsed JSON value) cannot be forwarded as at most ``limit`` bytes of JSON:
    too large, or nested deeper than orjson writes (254 levels; it reads 1,024), else ``None``."""
    try:
        size = len(orjson.dumps(v))
    except orjson.JSONEncodeError:
        return "is nested too deeply (more than 254 levels)"
    return f"must be at most {limit} bytes as JSON" if size > limit else None


#: ``chat_template_kwargs`` keys passed through: booleans that Jinja templates read to switch
#: reasoning on or off (Qwen3/GLM ``enable_thinking``, DeepSeek-V3.1/Kimi ``thinking``). They are
#: given to the counting template as well, so their prompt effect is counted. Any other key
#: (``tools``, ``documents``, ``add_generation_prompt`` merged into the template by vLLM, ...) is refused.
TEMPLATE_KWARGS_ALLOWED = ("enable_thinking", "thinking")


def _logit_bias(v: Any) -> str | None:
    problem = "must be an object of at most 300 token ids (as strings) mapping to numbers in [-100, 100]"
    if not isinstance(v, dict) or len(v) > 300:
        return problem
    for k, b in v.items():
        # ASCII digits only: str.isdigit() is also true for '²' or '١', which int() refuses or reads
        # as another number than the engines parsing the key as a JSON token id
        if not (k.isascii() and k.isdigit() and len(k) <= 10) or not is_num(b) or not -100 <= b <= 100:
            return problem
    return None


def metadata_problem(v: Any) -> str | None:
    """``metadata``: at most 16 string keys of at most 64 characters, string values of at most 512
    (OpenAI's documented limits)."""
    problem = "must be an object of at most 16 string keys (<= 64 characters) and string values (<= 512)"
    if not isinstance(v, dict) or len(v) > 16:
        return problem
    for k, x in v.items():
        if len(k) > 64 or not isinstance(x, str) or len(x) > 512:
            return problem
    return None


def str_list_of(*values: str) -> Check:
    """A check: an array of at most ``len(values)`` strings, each among ``values``."""

    def check(v: Any) -> str | None:
        if isinstance(v, list) and len(v) <= len(values) and all(isinstance(x, str) and x in values for x in v):
            return None
        return f"must be an array of {', '.join(values)}"

    return check


def _prompt_cache_options(v: Any) -> str | None:
    if not isinstance(v, dict):
        return "must be an object"
    for k, x in v.items():
        if k == "mode":
            if x not in ("implicit", "explicit"):
                return "'mode' must be implicit or explicit"
        elif k == "ttl":
            if not isinstance(x, str) or len(x) > 16:
                return "'ttl' must be a string such as '30m'"
        else:
            return f"unknown option '{k}'"
    return None


def _grammar(v: Any) -> str | None:
    if not isinstance(v, str):
        return "must be a string"
    if len(v) > MAX_GRAMMAR_BYTES or len(v.encode("utf-8", "surrogatepass")) > MAX_GRAMMAR_BYTES:
        return f"must be at most {MAX_GRAMMAR_BYTES} bytes"
    return None


def _regex(v: Any) -> str | None:
    return _grammar(v) or regex_problem(v)


def _ebnf(v: Any) -> str | None:
    return _grammar(v) or ebnf_problem(v)


def _json_schema_str(v: Any) -> str | None:
    problem = _grammar(v)
    if problem is not None:
        return problem
    try:
        parsed = orjson.loads(v)
    except orjson.JSONDecodeError:
        return "must be a JSON schema encoded as a string"
    if not isinstance(parsed, (dict, bool)):
        return "must be a JSON schema (an object) encoded as a string"
    return schema_problem(parsed)


#: ``response_format`` types: OpenAI's, and vLLM's and SGLang's ``structural_tag`` (refused where
#: another engine serves the model: :mod:`gateway.admission.fields`)
RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema", "structural_tag")


def _response_format(v: Any) -> str | None:
    """``response_format``: ``type`` one of :data:`RESPONSE_FORMAT_TYPES`, at most
    :data:`MAX_GRAMMAR_BYTES` as JSON; for json_schema, a ``json_schema`` object with a string
    ``name`` and, when given, an object ``schema`` (OpenAI's ``ResponseFormatJSONSchema``; vLLM's and
    SGLang's ``JsonSchemaResponseFormat`` in their ``protocol.py``: ``name: str``, ``schema`` an
    optional dict; a missing ``json_schema`` fails their ``to_sampling_params`` /
    ``serving_chat.py``), within the grammar bounds; for structural_tag,
    :func:`gateway.admission.structural_tag.structural_tag_problem`."""
    if not isinstance(v, dict) or v.get("type") not in RESPONSE_FORMAT_TYPES:
        return "must be an object whose 'type' is text, json_object, json_schema or structural_tag"
    if problem := json_size_problem(v):  # the engine compiles the schema into a grammar
        return problem
    if v["type"] == "structural_tag":
        return structural_tag_problem(v)
    spec = v.get("json_schema")
    if v["type"] == "json_schema" and not (
        isinstance(spec, dict)
        and isinstance(spec.get("name"), str)
        and (spec.get("schema") is None or isinstance(spec["schema"], dict))
    ):
        return "of type json_schema needs 'json_schema': an object with 'name' (a string) and 'schema' (an object)"
    schema = spec.get("schema") if isinstance(spec, dict) else None
    problem = schema_problem(schema) if schema is not None else None
    return None if problem is None else f"'json_schema.schema' {problem}"


#: chat ``tool_choice`` object types (OpenAI ``ChatCompletionToolChoiceOptionParam``) -> the key
#: holding the object with the tool's string ``name`` (``None``: no name needed)
_CHAT_TOOL_CHOICE_TYPES: dict[str, str | None] = {"function": "function", "custom": "custom", "allowed_tools": None}


def _chat_tool_choice(v: Any) -> str | None:
    """Chat ``tool_choice``: ``none``, ``auto``, ``required`` or an object of a type in
    :data:`_CHAT_TOOL_CHOICE_TYPES` (``function``: ``{"type": "function", "function": {"name":
    ...}}``, the only object vLLM's ``ChatCompletionNamedToolChoiceParam`` and SGLang's
    ``ToolChoice`` take, so any other value was the engine's 400 after the prompt was charged)."""
    problem = "must be none, auto, required or an object whose 'type' is " + ", ".join(_CHAT_TOOL_CHOICE_TYPES)
    if isinstance(v, str):
        return None if v in ("none", "auto", "required") else problem
    kind = v.get("type") if isinstance(v, dict) else None
    if not isinstance(kind, str) or kind not in _CHAT_TOOL_CHOICE_TYPES:
        return problem
    key = _CHAT_TOOL_CHOICE_TYPES[kind]
    named = v.get(key) if key is not None else None
    if key is not None and not (isinstance(named, dict) and isinstance(named.get("name"), str)):
        return f"'{key}.name' must be a string for type '{kind}'"
    return json_size_problem(v)


def _stop_token_ids(v: Any) -> str | None:
    if isinstance(v, list) and len(v) <= MAX_STOP_TOKEN_IDS and all(is_int(t) and 0 <= t < (1 << 31) for t in v):
        return None
    return f"must be an array of at most {MAX_STOP_TOKEN_IDS} token ids (integers >= 0)"


def _template_kwargs(v: Any) -> str | None:
    if not isinstance(v, dict):
        return "must be an object"
    for k, x in v.items():
        if k not in TEMPLATE_KWARGS_ALLOWED:
            return (
                f"key '{k}' is not accepted (it may change the prompt); accepted keys: "
                f"{', '.join(TEMPLATE_KWARGS_ALLOWED)}"
            )
        if not isinstance(x, bool):
            return f"'{k}' must be a boolean"
    return None


def _positive_at_most(hi: float) -> Check:
    def check(v: Any) -> str | None:
        if not is_num(v):
            return "must be a number"
        return None if 0 < v <= hi else f"must be > 0 and <= {hi}"

    return check


#: Engine extension fields: their type and range checks. Which of them reach an engine is the
#: engine's table in :mod:`gateway.admission.fields` (a field no engine of the model accepts: 400).
EXTENSION_FIELDS: dict[str, Check] = {
    "top_k": int_in(-1, (1 << 31) - 1),
    "min_p": num_in(0, 1),
    "repetition_penalty": _positive_at_most(2),
    "min_tokens": int_in(0, INT64_MAX),  # and <= the completion bound (gateway.admission.fields)
    "ignore_eos": boolean,
    "skip_special_tokens": boolean,
    "spaces_between_special_tokens": boolean,
    "stop_token_ids": _stop_token_ids,  # and < the vocabulary size (gateway.admission.fields)
    "no_stop_trim": boolean,
    "regex": _regex,
    "ebnf": _ebnf,
    "json_schema": _json_schema_str,
    "separate_reasoning": boolean,
    "stream_reasoning": boolean,
    "chat_template_kwargs": _template_kwargs,
    "continue_final_message": boolean,
    "add_generation_prompt": boolean,
    # completions only (an OpenAI field of chat): vLLM's and SGLang's CompletionRequest take it
    "response_format": _response_format,
}

#: OpenAI fields common to both routes (the official SDK's completion_create_params).
_COMMON: dict[str, Check] = {
    "model": string,
    "max_tokens": int_in(1, INT64_MAX),  # 0 is refused: engines disagree on what it means
    "n": int_in(1, 128),
    "stream": boolean,
    "stream_options": _stream_options,
    "temperature": num_in(0, 2),
    "top_p": num_in(0, 1),
    "stop": stop_problem,
    "seed": int_in(INT64_MIN, INT64_MAX),
    "presence_penalty": num_in(-2, 2),
    "frequency_penalty": num_in(-2, 2),
    "logit_bias": _logit_bias,  # and ids < the vocabulary size (gateway.admission.fields)
    "user": string,
    "cache_salt": string,  # dropped: the gateway sets the tenant's own
}

#: the engines' sampling and decoding extensions both completion routes accept
_SAMPLING_EXTENSIONS = (
    "top_k",
    "min_p",
    "repetition_penalty",
    "min_tokens",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "stop_token_ids",
    "no_stop_trim",
    "regex",
    "ebnf",
)
_CHAT_EXTENSIONS = _SAMPLING_EXTENSIONS + (
    "separate_reasoning",
    "stream_reasoning",
    "chat_template_kwargs",
    "continue_final_message",
    "add_generation_prompt",
)
_COMPLETION_EXTENSIONS = _SAMPLING_EXTENSIONS + ("json_schema", "response_format")

CHAT_FIELDS: dict[str, Check] = {
    **_COMMON,
    "messages": array,  # contents: validated by the tokenizer
    "max_completion_tokens": int_in(1, INT64_MAX),
    "logprobs": boolean,
    "top_logprobs": int_in(0, 20),
    "tools": array,
    "tool_choice": _chat_tool_choice,
    "parallel_tool_calls": boolean,
    "response_format": _response_format,
    "functions": array,
    "function_call": str_or_obj,
    # "max": vLLM's and SGLang's extension (vllm/renderers/params.py:27, SGLang protocol.py:879-881),
    # refused for an ``openai`` upstream (gateway.admission.fields)
    "reasoning_effort": enum("none", "minimal", "low", "medium", "high", "xhigh", "max"),
    "modalities": str_list_of("text", "audio"),
    "verbosity": enum("low", "medium", "high"),
    "prediction": obj,
    "audio": obj,
    "web_search_options": obj,
    "metadata": metadata_problem,
    "store": boolean,
    "service_tier": enum("auto", "default", "flex", "scale", "priority", "fast"),
    "prompt_cache_key": string,
    "prompt_cache_retention": enum("in_memory", "24h"),
    "prompt_cache_options": _prompt_cache_options,
    "safety_identifier": string,
    "moderation": obj,
    **{k: EXTENSION_FIELDS[k] for k in _CHAT_EXTENSIONS},
}

COMPLETION_FIELDS: dict[str, Check] = {
    **_COMMON,
    "prompt": anything,  # shape: validated by the tokenizer (string, strings, ids, id lists)
    "echo": boolean,
    "logprobs": int_in(0, 5),
    "best_of": int_in(1, 128),
    "suffix": string,
    **{k: EXTENSION_FIELDS[k] for k in _COMPLETION_EXTENSIONS},
}

#: The OpenAI fields of each route (everything else a route accepts is an engine extension).
OPENAI_FIELDS: dict[str, frozenset[str]] = {
    "chat": frozenset(CHAT_FIELDS) - frozenset(_CHAT_EXTENSIONS),
    "completions": frozenset(COMPLETION_FIELDS) - frozenset(_COMPLETION_EXTENSIONS),
}


def drop_nulls(body: dict[str, Any], keep: frozenset[str] = frozenset()) -> None:
    """Remove (in place) the top-level fields of ``body`` that are ``null``, but those named in
    ``keep``: validation reads ``null`` as "absent" (:func:`check_fields`), and so must the engine.
    vLLM's request models take some fields only as values (``ResponsesRequest``: ``tools: list``,
    ``tool_choice``, ``service_tier``; ``EmbeddingCompletionRequest``: ``encoding_format``), so a
    forwarded ``null`` there was the engine's 400 after kvgate had admitted the request and
    charged its prompt (chat and completions: :func:`gateway.admission.gate.upstream_body`)."""
    for key in [k for k, v in body.items() if v is None and k not in keep]:
        del body[key]


def check_fields(body: dict[str, Any], fields: dict[str, Check], required: tuple[str, ...]) -> None:
    """Check every top-level field of a request body against a route's table: ``required``
    fields present, known ``fields`` of the right type and range (``null`` is accepted for
    optional fields), unknown fields refused. Raises :class:`OpenAIError` 400 with ``param`` the
    field name."""
    for name in required:
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
            raise bad_value(key, problem)


def check_stream_options(body: dict[str, Any]) -> None:
    """400 (``param`` ``stream_options``) for ``stream_options`` that sets an option without
    ``stream: true``, as vLLM refuses it (``vllm/entrypoints/openai/chat_completion/protocol.py:865``,
    ``completion/protocol.py:604``: ``data.get("stream_options") and not data.get("stream")``) and
    the bundled backend (``gpu_backend/openai_api.py`` ``_stream_flags``); SGLang never checks. An
    option set to ``null`` is left out, as a top-level ``null`` is (vLLM's ``StreamOptions``
    declares each ``bool | None``; clients that write unset fields as ``null`` send it). An
    empty ``stream_options`` asks for nothing (every option's default is off): vLLM takes it without
    a stream, so it is removed from ``body`` here (the bundled backend would refuse it)."""
    options = body.get("stream_options")
    if isinstance(options, dict) and None in options.values():
        body["stream_options"] = {k: v for k, v in options.items() if v is not None}
    if body.get("stream_options") == {} and not body.get("stream"):
        del body["stream_options"]
    if body.get("stream_options") is not None and not body.get("stream"):
        raise OpenAIError(
            400,
            "'stream_options' is only allowed when 'stream' is true.",
            code=ErrorCode.INVALID_REQUEST,
            param="stream_options",
        )
