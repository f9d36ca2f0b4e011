"""The values an engine serving the model refuses only after kvgate admitted the request
(:func:`check_engine_refusals`, for ``/v1/completions``, ``/v1/chat/completions`` and
``/v1/responses``; :func:`check_image_parts` for image content parts on chat and Responses;
:func:`check_embedding_dimensions` for ``/v1/embeddings``).

An engine's 400 came after the prompt had been counted, reserved and charged
(``gateway/relay/finish.py``: an engine's error is settled at the prompt x its sequences), so these
are the gateway's own 400 naming the field, before anything is counted. Every engine in
``engines`` may get the request, so each one's refusals apply; ``openai`` upstreams are left to
OpenAI, but for completions ``best_of`` below ``n`` (:func:`_check_openai_best_of`). Checked after
the field policy (:mod:`gateway.admission.fields`), so a field it already refuses keeps that error.

Sources: vLLM ``vllm/sampling_params.py@00388f65`` (``SamplingParams._verify_args``,
``_verify_greedy_sampling``, ``__post_init__``), ``vllm/entrypoints/openai/chat_completion/
protocol.py@002032ee`` (``ChatCompletionRequest.check_logprobs``), ``vllm/pooling_params.py@0235532e``
(``PoolingParams._set_default_parameters``); SGLang ``python/sglang/srt/sampling/
sampling_params.py@00c17caf`` (``SamplingParams.__post_init__``, ``verify``); the bundled backend's
``gpu_backend/openai_api.py`` (``_UNSUPPORTED``, ``_check_unsupported``, ``_sampling``,
``_prompt_ids``) and ``gpu_backend/responses_api.py`` (``parse_responses``). The tool, stop and
output-constraint rules (:func:`_check_vllm_stop`, :func:`_check_chat_tools`,
:func:`_check_json_schema_format`, :func:`_check_structural_tag`, :func:`_check_responses_tools`,
:func:`_check_sglang_constraints`, :func:`_check_vllm_schema_nesting`, :func:`_check_completion_format`)
and :func:`_check_openai_best_of`
cite vLLM 0.34.0 and SGLang 0.5.23 by file and line (``vllm/...`` and ``python/sglang/srt/...``).
"""

from __future__ import annotations

from typing import Any

from config.errors import ErrorCode, OpenAIError
from gateway.admission.checks import bad_value
from gateway.admission.structural_tag import structural_tag_formats
from tokenizer.chat import IMAGE_PART_TYPES
from tokenizer.responses import IMAGE_PARTS as RESPONSES_IMAGE_PARTS

#: SGLang reads a temperature in [0, this) as greedy and sets ``top_k`` to 1 before ``verify``
#: (``_SAMPLING_EPS``, ``SamplingParams.__post_init__``)
SGLANG_GREEDY_BELOW = 1e-6

#: vLLM's default ``VLLM_MAX_STOP_STRINGS`` (``vllm/envs.py:116``, read at ``:1219``): its
#: ``StopParam`` (``vllm/entrypoints/generate/base/protocol.py:26``, the ``stop`` of chat, completions
#: and Responses) takes a string or a list of at most this many strings; a longer list is its
#: pydantic 400. kvgate's own bound (:data:`gateway.admission.checks.MAX_STOPS`) is larger.
VLLM_MAX_STOP_STRINGS = 4

#: vLLM's ``MAX_STRUCTURED_OUTPUT_JSON_NESTING`` (``vllm/sampling_params.py:39``): a structured-output
#: JSON Schema whose objects and arrays nest this deep or deeper below its root is its 400
#: (``check_json_nesting``, ``:242-260``, from ``_validate_structured_outputs``, ``:1294``). kvgate's own
#: bound is orjson's 254 levels (:func:`gateway.admission.checks.json_size_problem`).
VLLM_MAX_SCHEMA_NESTING = 64

#: vLLM's bound on a structural tag: ``MAX_STRUCTURED_OUTPUT_JSON_NESTING`` plus
#: ``STRUCTURAL_TAG_WRAPPER_NESTING`` (``vllm/sampling_params.py:39-47``), over the whole
#: ``response_format`` (``check_json_nesting(..., structural_tag=True)``, ``:242-260``, from
#: ``vllm/entrypoints/generate/base/protocol.py:259-261``): objects and arrays this deep or deeper
#: below it are its 400.
VLLM_MAX_STRUCTURAL_TAG_NESTING = 80

#: The bundled backend (``kvgate``), per route: an OpenAI field of that route -> the values it
#: takes; any other is its 400 ("'<field>' is not supported by this backend."; ``n``: "Only 'n' =
#: 1 is supported"). ``_check_unsupported`` reads the same ``_UNSUPPORTED`` table on every route;
#: only the fields each route's table validates are listed (chat ``logprobs`` is a boolean,
#: completions' a count). Its other entries are refused by the field policy already: the engine
#: extension fields (``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens`` but 0) are
#: outside its table (:data:`gateway.admission.fields.ENGINE_EXTENSIONS`), ``response_format``,
#: ``text.format`` and ``tool_choice`` are :func:`gateway.admission.fields.check_output_constraints`.
BUNDLED_NEUTRAL: dict[str, dict[str, tuple[Any, ...]]] = {
    "completions": {
        "n": (1,),
        "best_of": (1,),
        "echo": (False,),
        "logprobs": (0,),
        "logit_bias": ({},),
        "frequency_penalty": (0,),
        "presence_penalty": (0,),
    },
    "chat": {
        "n": (1,),
        "logprobs": (False,),
        "top_logprobs": (0,),
        "logit_bias": ({},),
        "frequency_penalty": (0,),
        "presence_penalty": (0,),
    },
    "responses": {"top_logprobs": (0,)},
}


def _refused(param: str, message: str) -> OpenAIError:
    return OpenAIError(400, message, code=ErrorCode.INVALID_REQUEST, param=param)


def _unsupported(key: str) -> OpenAIError:
    return _refused(key, f"'{key}' is not supported by the engines serving this model.")


def _check_sampling(body: dict[str, Any], engines: frozenset[str]) -> None:
    """Every route's sampling fields:

    - ``top_p`` 0: vLLM ``_verify_args`` ("top_p must be in (0, 1]", checked before the greedy
      reset), SGLang ``verify`` (the same words), the bundled backend's ``_sampling``
      (``_num(..., lo_open=True)``);
    - ``top_k`` 0 on SGLang (``verify``: "top_k must be -1 (disable) or at least 1"), unless the
      temperature is below :data:`SGLANG_GREEDY_BELOW` (SGLang then sets ``top_k`` 1 first;
      absent, the engine's default is not greedy); vLLM reads 0 as off;
    - ``n`` > 1 with ``temperature`` 0 on vLLM (``_verify_greedy_sampling``: "n must be 1 when
      using greedy sampling"; a temperature in (0, 0.01) is raised to 0.01 first, so only 0 is
      greedy). The Responses API has no ``n``."""
    top_p = body.get("top_p")
    if top_p is not None and top_p <= 0:
        raise bad_value("top_p", "must be > 0 and <= 1 (the engines serving this model refuse 0)")
    temperature = body.get("temperature")
    if "sglang" in engines and body.get("top_k") == 0:
        if temperature is None or temperature >= SGLANG_GREEDY_BELOW:
            raise bad_value("top_k", "must be -1 (off) or at least 1 for the engines serving this model (SGLang)")
    if "vllm" in engines and temperature == 0 and (body.get("n") or 1) > 1:
        raise bad_value("n", "must be 1 when 'temperature' is 0 (greedy sampling) for the engines serving this model")


def _check_vllm_chat(body: dict[str, Any], engines: frozenset[str]) -> None:
    """vLLM's chat request model: ``top_logprobs`` above 0 without ``logprobs: true``
    (``ChatCompletionRequest.check_logprobs``: "when using `top_logprobs`, `logprobs` must be set
    to true"). SGLang ignores ``top_logprobs`` there."""
    top = body.get("top_logprobs")
    if "vllm" in engines and top is not None and top > 0 and body.get("logprobs") is not True:
        raise bad_value("top_logprobs", "must be 0 unless 'logprobs' is true, for the engines serving this model")


def _check_vllm_stop(body: dict[str, Any], engines: frozenset[str]) -> None:
    """vLLM, every route: ``stop`` as a list of more than :data:`VLLM_MAX_STOP_STRINGS` strings
    (``StopParam``'s ``max_length``; SGLang takes up to 32, ``sampling_params.py:44``)."""
    stop = body.get("stop")
    if "vllm" in engines and isinstance(stop, list) and len(stop) > VLLM_MAX_STOP_STRINGS:
        raise bad_value(
            "stop",
            f"must be a string or an array of at most {VLLM_MAX_STOP_STRINGS} strings for the engines serving "
            "this model (vLLM)",
        )


def _not_in_tools(kind: str, name: Any) -> OpenAIError:
    return _refused("tool_choice", f"'tool_choice' names the {kind} tool {str(name)[:64]!r}, which is not in 'tools'.")


def _check_chat_tool_choice(body: dict[str, Any], engines: frozenset[str]) -> None:
    """Chat ``tool_choice`` (validated: none, auto, required, or an object of type function,
    custom or allowed_tools; ``function.name`` a string) against ``tools``:

    - an object whose type is not ``function``: vLLM ``chat_completion/protocol.py:1026-1034``
      (``check_tool_usage``: "Invalid value for `function`") and SGLang ``entrypoints/openai/
      protocol.py:869-873`` (``ToolChoice.type: Literal["function"]``);
    - any value but ``none`` without ``tools`` (absent or ``null``) on vLLM (``:1000-1006``: "When
      using `tool_choice`, `tools` must be set."; ``tools: []`` with auto/required is read as
      ``none`` there, ``:985-988``);
    - ``required`` with no tool on SGLang (``serving_chat.py:1139-1144``: "Tools cannot be empty if
      tool choice is set to required.");
    - a named function that is not in ``tools``: vLLM ``:1048-1057``, SGLang ``serving_chat.py:
      1146-1154``; an empty name on vLLM (``:1041-1047``)."""
    choice = body.get("tool_choice")
    if choice is None or choice == "none":
        return
    tools = body.get("tools")
    if isinstance(choice, dict) and choice.get("type") != "function":
        raise _refused(
            "tool_choice",
            f"'tool_choice' of type {str(choice.get('type'))[:64]!r} is not supported by the engines serving this "
            'model; send none, auto, required or {"type": "function", "function": {"name": ...}}.',
        )
    if "vllm" in engines and tools is None:
        raise _refused(
            "tool_choice",
            "'tool_choice' is set but 'tools' is not: the engines serving this model (vLLM) take a 'tool_choice' "
            "other than 'none' only with 'tools'; leave it out.",
        )
    if "sglang" in engines and choice == "required" and not tools:
        raise _refused("tool_choice", "'tool_choice' is 'required', but 'tools' is empty: there is no tool to call.")
    if not isinstance(choice, dict):
        return
    name = choice["function"]["name"]
    if name == "" and "vllm" in engines:
        raise _refused(
            "tool_choice.function.name",
            "'tool_choice.function.name' must not be empty for the engines serving this model (vLLM).",
        )
    if not any(isinstance(t, dict) and (t.get("function") or {}).get("name") == name for t in tools or ()):
        raise _not_in_tools("function", name)


def _tool_definition_problem(tool: dict[str, Any], prefix: str, engines: frozenset[str]) -> tuple[str, str] | None:
    """``(param, message)`` for the ``description`` or ``parameters`` of one function tool
    (``prefix``: where they sit, ``tools[i].function`` or ``tools[i]``) that vLLM or SGLang
    refuses, else ``None``. Both read ``description`` as ``Optional[str]`` and ``parameters`` as an
    object; SGLang's chat takes a boolean JSON Schema too (it checks ``parameters`` with
    ``Draft202012Validator.check_schema``), vLLM's chat and both engines' Responses tools do not."""
    desc = tool.get("description")
    if desc is not None and not isinstance(desc, str):
        return f"{prefix}.description", f"'{prefix}.description' must be a string."
    params = tool.get("parameters")
    bool_ok = prefix.endswith(".function") and "vllm" not in engines
    if params is not None and not isinstance(params, dict) and not (bool_ok and isinstance(params, bool)):
        return f"{prefix}.parameters", f"'{prefix}.parameters' must be an object (a JSON Schema)."
    return None


def _check_chat_tools(body: dict[str, Any], engines: frozenset[str]) -> None:
    """Chat ``tools`` (each entry validated as an object whose ``function`` holds a string name, up
    to the first one that is not an object) as vLLM and SGLang read them: ``type`` other than
    ``function`` on vLLM (``chat_completion/protocol.py:208-210``, ``ChatCompletionToolsParam.type:
    Literal["function"]``; SGLang's ``Tool.type`` is any string, ``protocol.py:844-847``),
    ``function.description`` not a string and ``function.parameters`` not an object (vLLM
    ``generate/base/protocol.py:298-301`` ``FunctionDefinition``; SGLang ``protocol.py:813-815``
    and ``serving_chat.py:1161-1173``), then :func:`_check_chat_tool_choice`."""
    tools = body.get("tools")
    for i, tool in enumerate(tools if isinstance(tools, list) else ()):
        if not isinstance(tool, dict):
            break  # the counter's 400 names it
        if "vllm" in engines and tool.get("type", "function") != "function":
            raise _refused(
                f"tools[{i}].type", f"'tools[{i}].type' must be 'function' for the engines serving this model."
            )
        found = _tool_definition_problem(tool["function"], f"tools[{i}].function", engines)
        if found is not None:
            raise _refused(*found)
    _check_chat_tool_choice(body, engines)


def _check_json_schema_format(body: dict[str, Any], engines: frozenset[str]) -> None:
    """Chat ``response_format`` of type ``json_schema`` (validated: ``json_schema`` an object with
    a string ``name``; ``schema`` an object when given) without its ``schema``: SGLang
    ``serving_chat.py:1192-1195`` ("schema_ is required for json_schema response format
    request."); vLLM turns it into ``StructuredOutputsParams(json=None)`` (``generate/base/
    protocol.py:193-195``), which holds no constraint (``sampling_params.py:138-142``: "You must use
    one kind of structured outputs constraint"). And on SGLang a ``strict`` that is not a boolean
    (``protocol.py:245``, ``StrictBool``)."""
    fmt = body.get("response_format")
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        return
    spec = fmt["json_schema"]
    if spec.get("schema") is None:
        raise _refused(
            "response_format.json_schema.schema",
            "'response_format.json_schema.schema' is missing: the engines serving this model need the JSON "
            "Schema to constrain the answer (send it, or use type 'json_object').",
        )
    strict = spec.get("strict")
    if "sglang" in engines and strict is not None and not isinstance(strict, bool):
        raise _refused("response_format.json_schema.strict", "'response_format.json_schema.strict' must be a boolean.")


def _nests_at_least(spec: Any, depth: int) -> bool:
    """Whether ``spec`` holds an object or array ``depth`` levels below its root (vLLM's
    ``_exceeds_json_nesting``, ``vllm/sampling_params.py:217-239``: one level per pass)."""
    level = [spec]
    for _ in range(depth):
        level = [
            kid
            for node in level
            for kid in (node.values() if isinstance(node, dict) else node)
            if isinstance(kid, (dict, list))
        ]
        if not level:
            return False
    return True


def _json_schema_of(body: dict[str, Any], route: str) -> tuple[str, Any]:
    """``(param, schema)``: the JSON Schema a chat ``response_format`` or a Responses ``text.format``
    of type ``json_schema`` asks the engine to constrain the answer to, else ``("", None)``."""
    if route == "chat":
        fmt = body.get("response_format")
        spec = fmt.get("json_schema") if isinstance(fmt, dict) and fmt.get("type") == "json_schema" else None
        return "response_format.json_schema.schema", spec.get("schema") if isinstance(spec, dict) else None
    text = body.get("text")
    fmt = text.get("format") if isinstance(text, dict) else None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        return "text.format.schema", fmt.get("schema")
    return "", None


def _check_vllm_schema_nesting(body: dict[str, Any], engines: frozenset[str], route: str) -> None:
    """vLLM: a structured-output schema (chat ``response_format``, Responses ``text.format``)
    nested :data:`VLLM_MAX_SCHEMA_NESTING` levels or more ("The JSON schema is nested too deeply")."""
    param, schema = _json_schema_of(body, route)
    if "vllm" in engines and schema and _nests_at_least(schema, VLLM_MAX_SCHEMA_NESTING):
        raise _refused(
            param,
            f"'{param}' is nested too deeply: the engines serving this model (vLLM) take a JSON Schema whose "
            f"objects and arrays nest at most {VLLM_MAX_SCHEMA_NESTING} levels, the schema itself the first.",
        )


#: structural tag format type -> its fields that hold a token or an array of tokens (xgrammar
#: ``TokenFormat``, ``ExcludeTokenFormat``, ``AnyTokensFormat``, ``TokenTriggeredTagsFormat``,
#: ``TokenDispatchFormat``; the last one's ``rules`` begin with a token too)
_TOKEN_FIELDS: dict[str, tuple[str, ...]] = {
    "token": ("token",),
    "exclude_token": ("exclude_tokens",),
    "any_tokens": ("exclude_tokens",),
    "token_triggered_tags": ("trigger_tokens", "exclude_tokens"),
    "token_dispatch": ("exclude_tokens",),
}


def _token_string(path: str, kind: str, node: dict[str, Any]) -> str | None:
    """The path of the first token given as a string in one format of a structural tag, else ``None``."""
    for name in _TOKEN_FIELDS.get(kind, ()):
        value = node.get(name)
        tokens = value if isinstance(value, list) else [value]
        found = next((i for i, t in enumerate(tokens) if isinstance(t, str)), None)
        if found is not None:
            return f"{path}.{name}[{found}]" if isinstance(value, list) else f"{path}.{name}"
    rules = node["rules"] if kind == "token_dispatch" else ()
    return next((f"{path}.rules[{i}][0]" for i, rule in enumerate(rules) if isinstance(rule[0], str)), None)


def _check_vllm_structural_tag(fmt: dict[str, Any]) -> None:
    """vLLM validates a structural tag before admission
    (``vllm/entrypoints/generate/base/protocol.py:245-272``): objects and arrays nested
    :data:`VLLM_MAX_STRUCTURAL_TAG_NESTING` levels or more below ``response_format``; then xgrammar
    without a tokenizer (``vllm/v1/structured_output/backend_xgrammar.py:561-580``), which refuses a
    token given as a string ("Token string resolution requires tokenizer_info") and a legacy
    structure without its ``schema`` (``json.dumps(None)`` becomes ``JSONSchemaFormat(json_schema=
    None)``, a validation error)."""
    if _nests_at_least(fmt, VLLM_MAX_STRUCTURAL_TAG_NESTING):
        raise _refused(
            "response_format",
            "'response_format' is nested too deeply: the engines serving this model (vLLM) take a structural tag "
            f"whose objects and arrays nest at most {VLLM_MAX_STRUCTURAL_TAG_NESTING} levels, response_format "
            "itself the first.",
        )
    if "structures" in fmt:
        missing = next((i for i, s in enumerate(fmt["structures"]) if s.get("schema") is None), None)
        if missing is not None:
            param = f"response_format.structures[{missing}].schema"
            raise _refused(
                param,
                f"'{param}' is missing: the engines serving this model (vLLM) need a JSON Schema for each "
                "structure (send {} for any JSON).",
            )
        return
    found = next((p for at, kind, node in structural_tag_formats(fmt) if (p := _token_string(at, kind, node))), None)
    if found is not None:
        param = f"response_format.{found}"
        raise _refused(
            param,
            f"'{param}' is a token string: the engines serving this model (vLLM) take token ids (integers) only.",
        )


#: structural tag format type -> the fields vLLM's xgrammar (0.2.8) applies and SGLang's (0.2.7)
#: request model drops (its ``JSONSchemaFormat`` has no ``excludes``, its ``QwenXMLParameterFormat``
#: only ``json_schema``: ``python/xgrammar/structural_tag.py:27-68``, ``:428-458``)
_SGLANG_DROPS: dict[str, tuple[str, ...]] = {
    "json_schema": ("excludes",),
    "qwen_xml_parameter": ("any_order", "max_whitespace_cnt", "excludes"),
}


def _check_structural_tag(body: dict[str, Any], engines: frozenset[str]) -> None:
    """A ``response_format`` of type ``structural_tag`` (validated:
    :func:`gateway.admission.structural_tag.structural_tag_problem`, what both engines refuse) as one of
    them alone refuses it: vLLM (:func:`_check_vllm_structural_tag`; SGLang reads a legacy
    structure's missing ``schema`` as ``{}``, ``constrained/xgrammar_backend.py:361-365``, and
    resolves token strings with the model's tokenizer), and SGLang: a field of
    :data:`_SGLANG_DROPS` set, which its request model (``entrypoints/openai/protocol.py:267-269``:
    xgrammar's models, whose extra fields pydantic ignores) drops, so the answer would not be held
    to it."""
    fmt = body.get("response_format")
    if not isinstance(fmt, dict) or fmt.get("type") != "structural_tag":
        return
    if "vllm" in engines:
        _check_vllm_structural_tag(fmt)
    if "sglang" not in engines or "structures" in fmt:
        return
    for path, kind, node in structural_tag_formats(fmt):
        dropped = next((k for k in _SGLANG_DROPS.get(kind, ()) if node.get(k)), None)
        if dropped is not None:
            param = f"response_format.{path}.{dropped}"
            raise _refused(param, f"'{param}' is not applied by the engines serving this model (SGLang); leave it out.")


def _check_responses_tools(body: dict[str, Any], engines: frozenset[str]) -> None:
    """Responses ``tools`` and ``tool_choice`` (validated: ``tool_choice`` a known string or object
    with its string keys; a named one that is absent from non-empty ``tools`` is
    :func:`gateway.routes.responses.check_tool_choice_target`'s 400):

    - ``required`` without tools: vLLM ``responses/protocol.py:881-885``, SGLang
      ``serving_responses.py:356-362``;
    - a named ``function``/``custom`` tool without tools: vLLM ``:886-890``, SGLang
      ``serving_responses.py:364-372``; an empty name on vLLM (``:891-897``);
    - a function tool's ``description`` not a string or ``parameters`` not an object (vLLM reads
      OpenAI's ``FunctionTool``, ``responses/protocol.py:50,298``; SGLang ``protocol.py:1876-1877``),
      an empty ``name`` on SGLang (``protocol.py:1886-1890``: "Function tools must include a name.")."""
    tools = body.get("tools") or []
    for i, tool in enumerate(tools if isinstance(tools, list) else ()):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            continue  # other shapes and types: the counter's 400
        found = _tool_definition_problem(tool, f"tools[{i}]", engines)
        if found is None and "sglang" in engines and tool.get("name") == "":
            found = f"tools[{i}].name", f"'tools[{i}].name' must not be empty."
        if found is not None:
            raise _refused(*found)
    choice = body.get("tool_choice")
    if choice == "required" and not tools:
        raise _refused(
            "tool_choice", "'tool_choice' is 'required', but no 'tools' are given: there is no tool to call."
        )
    if not isinstance(choice, dict) or choice.get("type") not in ("function", "custom"):
        return
    if choice.get("name") == "" and "vllm" in engines:
        raise _refused(
            "tool_choice.name", "'tool_choice.name' must not be empty for the engines serving this model (vLLM)."
        )
    if not tools:
        raise _not_in_tools(choice["type"], choice.get("name"))


#: structured-output formats: chat ``response_format`` / Responses ``text.format`` types that
#: SGLang turns into a ``json_schema`` constraint
_JSON_FORMATS = ("json_object", "json_schema")
#: chat and completions ``response_format`` types that SGLang turns into an output constraint: the
#: JSON formats and ``structural_tag`` (its ``structural_tag`` sampling parameter,
#: ``entrypoints/openai/protocol.py:1250-1253``, ``serving_completions.py:188-193``)
_CONSTRAINT_FORMATS = _JSON_FORMATS + ("structural_tag",)


def _check_sglang_constraints(body: dict[str, Any], engines: frozenset[str], route: str) -> None:
    """SGLang applies one output constraint per request: a JSON format or a structural tag (chat
    ``response_format``; Responses ``text.format``, which has no structural tag) with ``regex`` or
    ``ebnf`` (``sampling/sampling_params.py:320-329``:
    "Only one of json_schema, regex, ebnf, or structural_tag can be set."), and ``tool_choice``
    ``required`` or a named tool (itself a constraint on the call) with any of them (chat
    ``entrypoints/openai/protocol.py:1263-1272``, Responses ``protocol.py:2197-2215``; SGLang takes
    the pair only with the GLM-4.7 tool parser, ``function_call/function_call_parser.py:358-384``,
    which kvgate cannot see)."""
    # completions: a response_format pair is _check_completion_format's (which calls this as chat), a
    # regex / ebnf / json_schema one the field policy's (gateway.admission.fields)
    if "sglang" not in engines or route == "completions":
        return
    if route == "chat":
        fmt_param, fmt = "response_format", body.get("response_format")
    else:
        text = body.get("text")
        fmt_param, fmt = "text.format", text.get("format") if isinstance(text, dict) else None
    used = [fmt_param] if isinstance(fmt, dict) and fmt.get("type") in _CONSTRAINT_FORMATS else []
    used += [k for k in ("regex", "ebnf") if body.get(k) is not None]
    if len(used) > 1:
        raise _refused(
            used[1],
            f"'{used[0]}' and '{used[1]}' cannot both be set: the engines serving this model (SGLang) apply one "
            "output constraint per request.",
        )
    choice = body.get("tool_choice")
    if used and (choice == "required" or isinstance(choice, dict)):
        raise _refused(
            "tool_choice",
            f"'tool_choice' forces a tool call, which the engines serving this model (SGLang) cannot combine with "
            f"'{used[0]}'; send 'auto', or leave '{used[0]}' out.",
        )


def _check_sglang_stream_logprobs(body: dict[str, Any], engines: frozenset[str]) -> None:
    """SGLang's Responses API returns no logprobs on a stream: ``stream: true`` with ``include``
    holding ``message.output_text.logprobs`` is its 400 (``serving_responses.py:380-384``: "logprobs
    are not supported in streaming mode")."""
    include = body.get("include") or ()
    if "sglang" in engines and body.get("stream") is True and "message.output_text.logprobs" in include:
        raise _refused(
            "include",
            "'include' asks for 'message.output_text.logprobs', which the engines serving this model (SGLang) do "
            "not return on a stream; leave it out or set 'stream' to false.",
        )


def _check_bundled(body: dict[str, Any], route: str) -> None:
    """The bundled backend: on completions more than one prompt ("Batched prompts are not
    supported by this backend", ``_prompt_ids``), and on every route the fields of
    :data:`BUNDLED_NEUTRAL` at any other value."""
    prompt = body.get("prompt") if route == "completions" else None
    if isinstance(prompt, list) and len(prompt) > 1 and isinstance(prompt[0], (str, list)):  # a batch
        raise _refused(
            "prompt",
            f"'prompt' holds {len(prompt)} prompts; the engines serving this model take one prompt per request.",
        )
    for key, neutral in BUNDLED_NEUTRAL[route].items():
        value = body.get(key)
        if value is not None and value not in neutral:  # validated: no bool poses as a number here
            raise _unsupported(key)


#: engines that take no image content parts: the bundled backend encodes its prompt as text only
#: (``tokenizer/chat.py`` ``chatml_token_ids``, ``tokenizer/hf_counter.py`` ``encode_chat``:
#: ``ImagesNotSupportedError``, its 400 "This model does not accept image content parts.")
NO_IMAGES = frozenset({"kvgate"})

#: per route, where a validated body holds content parts: chat ``messages[i].content`` (any role;
#: ``image_url`` and vLLM's ``input_image``, as the counters read them), Responses ``input[i].content``
#: and a ``function_call_output``'s ``input[i].output``
_IMAGE_PARTS: dict[str, tuple[str, tuple[str, ...], frozenset[str]]] = {
    "chat": ("messages", ("content",), frozenset(IMAGE_PART_TYPES)),
    "responses": ("input", ("content", "output"), frozenset(RESPONSES_IMAGE_PARTS)),
}


def check_image_parts(body: dict[str, Any], engines: frozenset[str], route: str) -> None:
    """Refuse an image content part where an engine in ``engines`` takes no images
    (:data:`NO_IMAGES`: the bundled backend, alone or beside other engines: any of them may get the
    request), on ``route`` (``chat`` or ``responses``): 400 naming the part
    (``messages[0].content[1]``, ``input[0].content[1]``, ``input[1].output[0]``), where the
    engine's 400 came after the image had been counted, reserved and charged. Called before the
    model's image URL policy (:func:`gateway.admission.fields.check_chat_request`,
    :func:`gateway.routes.responses.count_responses`): no URL makes such an image acceptable."""
    if not engines & NO_IMAGES or route not in _IMAGE_PARTS:
        return
    key, holders, types = _IMAGE_PARTS[route]
    items = body.get(key)
    for i, item in enumerate(items if isinstance(items, list) else ()):
        if not isinstance(item, dict):
            continue
        for holder in holders:
            parts = item.get(holder)
            for j, part in enumerate(parts if isinstance(parts, list) else ()):
                if isinstance(part, dict) and part.get("type") in types:
                    param = f"{key}[{i}].{holder}[{j}]"
                    raise _refused(
                        param,
                        f"'{param}' is an image, but the engines serving this model take no images "
                        "(they read text only); send text parts only.",
                    )


#: engines whose request models (pydantic, in their ``protocol.py``) and request validation read
#: ``tools``, ``tool_choice`` and the output constraints as :func:`_check_chat_tools`,
#: :func:`_check_json_schema_format` and :func:`_check_responses_tools` say; the bundled backend
#: refuses tool calls and structured output outright
#: (:func:`gateway.admission.fields.check_output_constraints`)
PYDANTIC_ENGINES = frozenset({"vllm", "sglang"})


def _no_check(body: dict[str, Any], engines: frozenset[str]) -> None:
    return None


def _check_chat_request_model(body: dict[str, Any], engines: frozenset[str]) -> None:
    _check_chat_tools(body, engines)
    _check_json_schema_format(body, engines)
    _check_structural_tag(body, engines)


def _check_responses_request_model(body: dict[str, Any], engines: frozenset[str]) -> None:
    _check_responses_tools(body, engines)
    _check_sglang_stream_logprobs(body, engines)


#: route -> the checks of :data:`PYDANTIC_ENGINES`' request models on it (completions: none beyond
#: :func:`_check_sampling` and :func:`_check_vllm_stop` here; its ``response_format`` is
#: :func:`_check_completion_format`'s)
_PYDANTIC_CHECKS = {"chat": _check_chat_request_model, "responses": _check_responses_request_model}


#: most completions ``best_of`` OpenAI takes (its API reference, ``CreateCompletionRequest``:
#: ``best_of`` maximum 20); the field's own bound is 128 (:mod:`gateway.admission.checks`)
OPENAI_MAX_BEST_OF = 20


def _check_openai_best_of(body: dict[str, Any], engines: frozenset[str]) -> None:
    """Completions ``best_of`` below ``n``, or above :data:`OPENAI_MAX_BEST_OF`: 400 naming
    ``best_of`` where an ``openai`` upstream serves the model (OpenAI: "best_of must be greater
    than n"; maximum 20). vLLM 0.34.0's ``CompletionRequest`` has no ``best_of``
    (``vllm/entrypoints/openai/completion/protocol.py:49-75``: an extra field, ignored) and
    SGLang 0.5.23 reads it nowhere (``protocol.py:373``, its only mention): both generate ``n``;
    the bundled backend takes ``best_of`` 1 only (:data:`BUNDLED_NEUTRAL`). The gate reserves
    ``max(n, best_of)`` sequences either way."""
    best_of, n = body.get("best_of"), body.get("n")
    if "openai" not in engines or best_of is None:
        return
    if n is not None and best_of < n:
        raise bad_value("best_of", "must be >= 'n'")
    if best_of > OPENAI_MAX_BEST_OF:
        raise bad_value("best_of", f"must be <= {OPENAI_MAX_BEST_OF} (the engines serving this model refuse more)")


#: what chat's ``response_format`` checks read of a completions body (:func:`_check_completion_format`)
_FORMAT_FIELDS = ("response_format", "regex", "ebnf")


def _check_completion_format(body: dict[str, Any], engines: frozenset[str]) -> None:
    """Completions ``response_format`` (an engine extension here: vLLM 0.34.0's and SGLang 0.5.23's
    ``CompletionRequest`` take it, the field policy passes it only where every engine of the model
    does) is read as on chat: vLLM turns it into the same structured output
    (``vllm/entrypoints/openai/completion/protocol.py:352-357,427``, ``generate/base/protocol.py:181-211``),
    SGLang into the same ``json_schema`` sampling parameter (``serving_completions.py:177-187``, as
    ``serving_chat.py`` does; a structural tag into its ``structural_tag`` parameter,
    ``serving_completions.py:188-193``). It constrains the completion only; the prompt is unchanged.
    So a JSON format or a structural tag beside the ``json_schema`` extension is refused, whatever
    the engines (SGLang would take the format's schema and drop the other without a word, or refuse
    two constraints after admission), then, where vLLM or SGLang serves the model, chat's refusals of
    it, on the fields they read (:data:`_FORMAT_FIELDS`): a ``json_schema`` without its ``schema``
    and a ``strict`` that is no boolean on SGLang (:func:`_check_json_schema_format`), a structural
    tag one engine refuses (:func:`_check_structural_tag`), a JSON format or structural tag beside
    ``regex`` / ``ebnf`` on SGLang (:func:`_check_sglang_constraints`), a schema nested too deep for
    vLLM (:func:`_check_vllm_schema_nesting`), each in chat's words."""
    fmt = body.get("response_format")
    if not isinstance(fmt, dict):
        return
    if fmt.get("type") in _CONSTRAINT_FORMATS and body.get("json_schema") is not None:
        raise _refused(
            "json_schema",
            "'response_format' and 'json_schema' cannot both be set: the engines serving this model apply one "
            "output constraint per request.",
        )
    if engines & PYDANTIC_ENGINES:
        read = {k: body[k] for k in _FORMAT_FIELDS if k in body}
        _check_json_schema_format(read, engines)
        _check_structural_tag(read, engines)
        _check_sglang_constraints(read, engines, "chat")
        _check_vllm_schema_nesting(read, engines, "chat")


def check_engine_refusals(body: dict[str, Any], engines: frozenset[str], route: str) -> None:
    """Refuse (400 naming the field) what an engine in ``engines`` refuses only after admission, on
    ``route`` (``completions``, ``chat`` or ``responses``, whose validated ``body`` this is):
    :func:`_check_sampling` and :func:`_check_vllm_stop` on every route, :func:`_check_vllm_chat` on
    chat; where vLLM or SGLang serves the model (:data:`PYDANTIC_ENGINES`), on chat
    :func:`_check_chat_tools`, :func:`_check_json_schema_format` and :func:`_check_structural_tag`,
    on Responses :func:`_check_responses_tools` and :func:`_check_sglang_stream_logprobs`, and on both
    :func:`_check_sglang_constraints` and :func:`_check_vllm_schema_nesting`; the bundled backend's
    :func:`_check_bundled`; then on completions :func:`_check_openai_best_of` and
    :func:`_check_completion_format`, in this order. Raises :class:`OpenAIError` 400. Nothing for a
    model served only by ``openai`` upstreams but those two completions checks."""
    if engines and not engines <= {"openai"}:
        _check_sampling(body, engines)
        _check_vllm_stop(body, engines)
        if route == "chat":
            _check_vllm_chat(body, engines)
        if engines & PYDANTIC_ENGINES:
            _PYDANTIC_CHECKS.get(route, _no_check)(body, engines)
            _check_sglang_constraints(body, engines, route)
            _check_vllm_schema_nesting(body, engines, route)
        if "kvgate" in engines:
            _check_bundled(body, route)
    if route == "completions":
        _check_openai_best_of(body, engines)
        _check_completion_format(body, engines)


def check_embedding_dimensions(body: dict[str, Any], engines: frozenset[str], matryoshka: bool | list[int]) -> None:
    """``/v1/embeddings`` ``dimensions`` (validated: an integer >= 1) for a model with the
    ``matryoshka`` setting of its config (:class:`config.models.ModelConfig`). vLLM refuses it
    for a model that is not a Matryoshka model ("does not support matryoshka representation") and,
    for one whose config lists ``matryoshka_dimensions``, any value outside the list
    (``PoolingParams._set_default_parameters``; any other value >= 1 it takes: it keeps that many
    leading values of the vector). kvgate cannot read the engine's model config, so the model's
    ``matryoshka`` says it: ``false`` (the default): refused; ``true``: any; a list: those.
    Nothing for a model served only by ``openai`` upstreams (OpenAI's own rule applies)."""
    dims = body.get("dimensions")
    if dims is None or not engines or engines <= {"openai"} or matryoshka is True:
        return
    if matryoshka is False:
        raise _unsupported("dimensions")
    if dims not in matryoshka:
        raise bad_value("dimensions", f"must be one of {', '.join(map(str, matryoshka))} for this model")
