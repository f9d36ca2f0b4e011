"""What each engine does to chat messages before its chat template runs, so that a chat is counted
as the engine will render it (docs/tokenizer.md, "Pre-template steps").

Engine policies (an upstream's ``engine``): ``kvgate`` (the bundled backend renders the messages
as sent, by construction) and ``openai`` (counts on its side) take the messages as they are.
``vllm`` and ``sglang`` rebuild them first; each step below copies the engine's source, cited
as ``file@commit`` and function:

- vLLM ``vllm/entrypoints/chat_utils.py@001eadcf`` ``_parse_chat_message_content`` (the message
  rebuilt from its known keys; for a "string"-format template, such as kvgate's ChatML, a
  message's text parts joined with ``\n`` and its images' placeholders put in front:
  :func:`vllm_string_content`) and ``_postprocess_messages`` (tool-call arguments parsed).
- SGLang ``python/sglang/srt/entrypoints/openai/serving_chat.py@002897c2``
  ``_apply_jinja_template``: ``normalize_assistant_tool_call_arguments`` (arguments parsed
  with orjson, refused unless a JSON object), ``process_content_for_template_format``
  (``python/sglang/srt/parser/jinja_template_utils.py@0b9c3848``: text parts joined with a space,
  images dropped, ``None`` values dropped: :func:`sglang_text`, :func:`sglang_chatml_content`)
  and ``_handle_last_assistant_message`` (a trailing assistant turn becomes a user turn of its
  text); each assistant tool call as its pydantic ``ToolCall`` dump
  (``protocol.py@004c82e0``: ``{id, index, type, function: {name, arguments}}``, unset ones
  ``None``). ``_validate_request`` rewrites type aliases in every tool's ``parameters``
  (``normalize_json_schema_types``, ``python/sglang/srt/function_call/utils.py@00ca197b``)
  before ``_process_messages`` dumps the tools.

Chat templates then print parsed arguments with ``tojson`` (transformers' own filter,
``json.dumps``): ``1e15`` is printed ``1000000000000000.0``, which is why the text as sent is not
what is counted.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from tokenizer.errors import InvalidPromptError

#: engine policies whose messages are rebuilt before templating
REBUILDING_ENGINES = ("sglang", "vllm")


@dataclass(frozen=True)
class ParsedArguments:
    """A tool call's ``arguments`` after the engine parsed them (any JSON value), as kvgate's
    ChatML template receives it: written as that value's JSON, not as the string sent."""

    value: Any


@dataclass(frozen=True)
class DroppedImage:
    """An image part the engine leaves out of the message's text (SGLang's "string" content
    format drops it: :func:`sglang_chatml_content`). kvgate's ChatML still charges it its cost
    (``tokenizer.chat``: counted as an image, the text not cut around it), in case the engine's
    template is a multimodal one after all; that is an overcount of the text-only prompt, never
    an undercount."""

    part: dict[str, Any]


#: content part types kvgate's counters take (``tokenizer.chat.TEXT_PART_TYPES`` /
#: ``IMAGE_PART_TYPES``; repeated here, as ``tokenizer.chat`` imports this module)
_TEXT_PARTS = ("text", "refusal")
_IMAGE_PARTS = ("image_url", "input_image")


def views_of(engines: frozenset[str] | tuple[str, ...]) -> list[str | None]:
    """The distinct renderings a model's engines produce: one per rebuilding engine, ``None``
    for the messages as sent (``kvgate``, ``openai``, or no engine known). Sorted, so a count
    over them is deterministic."""
    views: list[str | None] = [e for e in sorted(set(engines)) if e in REBUILDING_ENGINES]
    if not views or any(e not in REBUILDING_ENGINES for e in engines):
        views.insert(0, None)
    return views


def _args_param(i: int, j: int) -> str:
    return f"messages[{i}].tool_calls[{j}].function.arguments"


def vllm_arguments(arguments: Any, param: str) -> Any:
    """vLLM ``_postprocess_messages`` (chat_utils.py@001eadcf): a string is ``json.loads``-ed,
    an invalid one becomes ``{}``; anything but a string, dict or list becomes ``{}``. What
    ``json.loads`` raises besides ``JSONDecodeError`` (an integer of more than 4,300 digits, a
    nesting deeper than the interpreter's stack) reaches vLLM's handler as a 400: refused here
    the same way, with ``param`` naming the arguments."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return {}
        except (ValueError, RecursionError) as e:
            raise InvalidPromptError(f"'{param}' cannot be parsed as the engine parses it: {e}", param) from None
    if not isinstance(arguments, (dict, list)):
        return {}
    return arguments


def sglang_arguments(arguments: Any, param: str) -> Any:
    """SGLang ``parse_tool_call_arguments`` (serving_chat.py@002897c2): a string is
    ``orjson.loads``-ed; invalid JSON or a value that is not an object is a ``ValueError``, which
    SGLang answers with a 400. Refused here with ``param`` naming the arguments. orjson also
    refuses ``NaN``/``Infinity``, integers beyond 64 bits and nesting deeper than 1,024."""
    if not isinstance(arguments, str):
        return arguments
    try:
        parsed = orjson.loads(arguments)
    except orjson.JSONDecodeError:
        raise InvalidPromptError(
            f"'{param}' must be valid JSON: the engine parses a tool call's arguments and refuses them otherwise.",
            param,
        ) from None
    if not isinstance(parsed, dict):
        raise InvalidPromptError(f"'{param}' must be a JSON object: the engine refuses any other value.", param)
    return parsed


def sglang_call(call: dict[str, Any], i: int, j: int) -> dict[str, Any]:
    """An assistant tool call as SGLang hands it to the template (serving_chat.py@002897c2
    ``_apply_jinja_template``: ``msg.model_dump()``, then ``normalize_assistant_tool_call_arguments``):
    ``ToolCall(id=None, index=None, type="function", function=FunctionResponse(name=None,
    arguments=None))`` dumped (protocol.py@004c82e0; unknown keys dropped), a string ``arguments``
    parsed (:func:`sglang_arguments`)."""
    fn = call["function"]
    args = fn.get("arguments")
    if isinstance(args, str):
        args = sglang_arguments(args, _args_param(i, j))
    return {
        "id": call.get("id"),
        "index": call.get("index"),
        "type": call.get("type", "function"),
        "function": {"name": fn.get("name"), "arguments": args},
    }


def _sglang_calls(message: dict[str, Any], i: int) -> list[dict[str, Any]]:
    return [sglang_call(c, i, j) for j, c in enumerate(message["tool_calls"])]


def _calls(message: dict[str, Any], i: int, parse: Any) -> list[dict[str, Any]]:
    """Copies of ``message``'s tool calls with ``function.arguments`` replaced by ``parse``'s
    result (validated shapes: a list of objects with a ``function`` object)."""
    out = []
    for j, call in enumerate(message.get("tool_calls") or ()):
        fn = call["function"]
        out.append({**call, "function": {**fn, "arguments": parse(fn.get("arguments"), _args_param(i, j))}})
    return out


def vllm_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation vLLM templates (chat_utils.py@001eadcf ``_parse_chat_message_content``
    then ``_postprocess_messages``): ``role`` and ``content``; an assistant's ``tool_calls``
    (arguments parsed, an empty list dropped) and ``reasoning`` (also as ``reasoning_content``;
    a ``reasoning_content`` sent alone is not kept); a tool message's ``tool_call_id``; a string
    ``name``; a developer message's ``tools`` (``None``: a template may test it). Every other key
    is dropped. Content stays as sent (the counter flattens it:
    :func:`vllm_string_content` for a "string"-format template)."""
    out = []
    for i, m in enumerate(messages):
        role = m.get("role")
        conv: dict[str, Any] = {"role": role, "content": m.get("content")}
        if role == "assistant":
            if m.get("tool_calls") is not None:
                conv["tool_calls"] = _calls(m, i, vllm_arguments)
                if not conv["tool_calls"]:
                    del conv["tool_calls"]  # _postprocess_messages drops an empty list
            if m.get("reasoning") is not None:
                conv["reasoning"] = conv["reasoning_content"] = m["reasoning"]
        elif role == "tool" and "tool_call_id" in m:
            conv["tool_call_id"] = m["tool_call_id"]
        if isinstance(m.get("name"), str):
            conv["name"] = m["name"]
        if role == "developer":  # ``result_msg["tools"] = message.get("tools", None)``
            conv["tools"] = m.get("tools")  # always None: admission refuses a message's tools
        out.append(conv)
    return out


def _vllm_kept(content: Any) -> list[Any]:
    """The parts vLLM keeps of a message's content, in order: each non-empty text's string, each
    image part (see :func:`vllm_string_content`)."""
    if content is None:
        content = []
    elif isinstance(content, str):
        content = [{"type": "text", "text": content}]
    items: list[Any] = []
    for p in content:
        ptype = p.get("type")
        if ptype in _TEXT_PARTS:
            if p.get(ptype):  # ``if parse_res``: "" is not kept
                items.append(p[ptype])
        elif ptype in _IMAGE_PARTS:
            items.append(p)
    return items


def vllm_string_content(content: Any, interleave: bool = False) -> Any:
    """A message's content as vLLM hands it to a "string"-format template (kvgate's ChatML: it
    never loops over ``message['content']``, so ``_detect_content_format`` in
    ``vllm/renderers/hf.py`` finds no ``_iter_nodes_assign_content_item`` and resolves "string").
    ``vllm/entrypoints/chat_utils.py@001eadcf``, for ``wrap_dicts=False``:

    - ``_parse_chat_message_content``: ``None`` is no parts, a string one text part
      (``content = [ChatCompletionContentPartTextParam(type="text", text=content)]``);
    - ``_parse_chat_message_content_part``: a ``text`` or ``refusal`` part is its string
      (``if part_type in ("text", "input_text", "output_text", "refusal", "thinking")``); an image
      part goes to the multimodal parser, which records the model's placeholder, and yields
      ``None`` (``MODALITY_PLACEHOLDERS_MAP[modality] if interleave_strings else None``);
    - ``_parse_chat_message_content_parts``: ``if parse_res: content.append(parse_res)``, so an
      empty text part is dropped as the images are; then ``text_prompt = "\n".join(texts)``
      without images, else ``_get_full_multimodal_text_prompt``: the placeholders go in front
      (``multimodal_content_part_separator.join(missing_placeholders + [text_prompt])``, the
      separator ``"\n"``; the placeholders alone when no text is left), or, under
      ``--interleave-mm-strings`` (``interleave``), each where its image was
      (``_get_interleaved_text_prompt``: ``"\n".join(texts)``).

    A plain string is returned where no image is left; else a list of parts in which each image
    part stands for its placeholder (costed as an image, the text cut around it) and the ``\n``
    separators are text parts. Validated content only (parts are objects of known types)."""
    items = _vllm_kept(content)
    texts = [x for x in items if isinstance(x, str)]
    if len(texts) == len(items):
        return "\n".join(texts)
    if interleave:
        seq = items
    else:
        joined = "\n".join(texts)
        seq = [x for x in items if not isinstance(x, str)] + ([joined] if joined else [])
    parts: list[dict[str, Any]] = []
    for k, x in enumerate(seq):
        if k:
            parts.append({"type": "text", "text": "\n"})
        parts.append({"type": "text", "text": x} if isinstance(x, str) else x)
    return parts


def vllm_string_messages(messages: list[dict[str, Any]], interleave: bool = False) -> list[dict[str, Any]]:
    """:func:`vllm_messages` with each content as :func:`vllm_string_content` makes it."""
    return [{**m, "content": vllm_string_content(m.get("content"), interleave)} for m in vllm_messages(messages)]


def sglang_text(content: Any) -> Any:
    """SGLang ``process_content_for_template_format`` for string-format templates
    (jinja_template_utils.py@0b9c3848, ``elif content_format == "string":``): a parts list becomes
    its ``text``/``input_text`` parts joined by a space (``" ".join(text_parts) if text_parts
    else ""``: an empty text part is kept, a ``refusal`` part, which SGLang's request model
    refuses, and every image dropped); ``None`` becomes ``""`` (serving_chat.py@002897c2
    ``_apply_jinja_template``: ``if msg_dict.get("content") is None: msg_dict["content"] = ""``)."""
    if content is None:
        return ""
    if isinstance(content, list):
        return " ".join(p["text"] for p in content if isinstance(p, dict) and p.get("type") in ("text", "input_text"))
    return content


def sglang_chatml_content(content: Any) -> Any:
    """:func:`sglang_text`, for kvgate's ChatML: the text as SGLang joins it, each image part it
    drops kept as a :class:`DroppedImage` after it (charged, the text not cut). A string where
    there is no image."""
    text = sglang_text(content)
    if not isinstance(content, list):
        return text
    images = [DroppedImage(p) for p in content if isinstance(p, dict) and p.get("type") in _IMAGE_PARTS]
    return [{"type": "text", "text": text}, *images] if images else text


def sglang_messages(
    messages: list[dict[str, Any]], flatten: Callable[[Any], Any] = sglang_text
) -> list[dict[str, Any]]:
    """The messages SGLang templates (serving_chat.py@002897c2 ``_apply_jinja_template``):
    tool calls dumped and their arguments parsed (:func:`sglang_call`; refused unless a JSON
    object), content flattened by ``flatten`` (:func:`sglang_text`; for kvgate's ChatML
    :func:`sglang_chatml_content`) and ``None`` values dropped, then
    ``_handle_last_assistant_message``: a final assistant message whose content is a string
    becomes ``{"role": "user", "content": <that string>}`` (its tool calls, name and reasoning are
    gone). Flattened content is always a string on SGLang's side (the images a
    :class:`DroppedImage` list carries are not in it), so the final assistant turn is always
    rewritten."""
    out = []
    for i, m in enumerate(messages):
        msg = dict(m)
        if m.get("role") == "assistant" and isinstance(m.get("tool_calls"), list):
            msg["tool_calls"] = _sglang_calls(m, i)
        msg["content"] = flatten(msg.get("content"))
        out.append({k: v for k, v in msg.items() if v is not None})
    if out and out[-1].get("role") == "assistant":
        out[-1] = {"role": "user", "content": out[-1].get("content")}
    return out


def sglang_parts(content: Any, role: Any) -> Any:
    """SGLang ``process_content_for_template_format`` for "openai"-format templates (those that
    loop over ``message['content']``, or mention image/audio/video/vision): a parts list keeps its
    ``text``/``input_text`` parts as ``{"type": "text", "text": ...}`` and each image as
    ``{"type": "image"}`` (other parts dropped); a string stays a string, ``None`` becomes ``""``;
    then ``normalize_tool_content`` (serving_chat.py): a tool message of text parts only is their
    texts joined by a space."""
    if content is None:
        return ""
    if not isinstance(content, list):
        return content
    parts: list[dict[str, Any]] = []
    for p in content:
        if isinstance(p, dict) and p.get("type") in ("text", "input_text"):
            parts.append({"type": "text", "text": p["text"]})
        elif isinstance(p, dict) and p.get("type") in ("image_url", "input_image"):
            parts.append({"type": "image"})
    if role == "tool" and all(p["type"] == "text" for p in parts):
        return " ".join(p["text"] for p in parts)
    return parts


def vllm_parts(content: Any, role: Any) -> Any:
    """vLLM ``_parse_chat_message_content`` for "openai"-format templates (``wrap_dicts``):
    ``None`` is no parts, a string one text part, ``text``/``refusal`` parts
    ``{"type": "text", "text": ...}``, images ``{"type": "image"}``; a tool message whose parts
    are all text becomes their texts joined by ``\n``."""
    if content is None:
        content = []
    elif isinstance(content, str):
        content = [{"type": "text", "text": content}]
    parts: list[dict[str, Any]] = []
    for p in content:
        if not isinstance(p, dict):
            continue
        ptype = p.get("type")
        if ptype in ("text", "refusal"):
            parts.append({"type": "text", "text": p.get(ptype)})
        elif ptype in ("image_url", "input_image"):
            parts.append({"type": "image"})
    if role == "tool" and all(p["type"] == "text" for p in parts):
        return "\n".join(p["text"] for p in parts) if parts else ""
    return parts


def sglang_parts_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """:func:`sglang_messages` for an "openai"-format template: tool calls dumped, content as
    :func:`sglang_parts`, ``None`` values dropped, then a final assistant turn rewritten only when
    its content is a string (``_handle_last_assistant_message``)."""
    out = []
    for i, m in enumerate(messages):
        msg = dict(m)
        if m.get("role") == "assistant" and isinstance(m.get("tool_calls"), list):
            msg["tool_calls"] = _sglang_calls(m, i)
        msg["content"] = sglang_parts(msg.get("content"), msg.get("role"))
        out.append({k: v for k, v in msg.items() if v is not None})
    if out and out[-1].get("role") == "assistant" and isinstance(out[-1].get("content"), str):
        out[-1] = {"role": "user", "content": out[-1]["content"]}
    return out


def _tool_parts(tool: Any) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """``(tool, function)`` of a tool definition the engines' pydantic models accept (an object
    whose ``function`` is an object with a string ``name``), else ``None`` (the engine refuses it)."""
    if not isinstance(tool, dict) or not isinstance(tool.get("function"), dict):
        return None
    fn = tool["function"]
    return (tool, fn) if isinstance(fn.get("name"), str) else None


def vllm_tool(tool: Any) -> Any:
    """vLLM's ``tool.model_dump()`` (``engine/protocol.py``: ``OpenAIBaseModel`` with
    ``extra="allow"``; ``ChatCompletionToolsParam(type, function)``,
    ``FunctionDefinition(name, description=None, parameters=None)``): declared fields first,
    unset ones as ``None``, then the extra keys in the order sent."""
    found = _tool_parts(tool)
    if found is None:
        return tool
    t, fn = found
    dumped_fn = {"name": fn["name"], "description": fn.get("description"), "parameters": fn.get("parameters")}
    dumped_fn.update({k: v for k, v in fn.items() if k not in dumped_fn})
    out = {"type": t.get("type", "function"), "function": dumped_fn}
    out.update({k: v for k, v in t.items() if k not in out})
    return out


# SGLang python/sglang/srt/function_call/utils.py@00ca197b, ``normalize_json_schema_types``
_SGL_STANDARD_TYPES = frozenset(("null", "boolean", "object", "array", "number", "string", "integer"))
_SGL_TYPE_ALIASES = {
    **dict.fromkeys(
        ("str", "text", "varchar", "char", "enum", "uuid", "date", "datetime", "time", "timestamp", "binary")
        + ("blob", "bytea", "bytes", "varbinary"),
        "string",
    ),
    "bool": "boolean",
    **dict.fromkeys(("bigint", "smallint", "tinyint"), "integer"),
    **dict.fromkeys(("double", "decimal", "real", "numeric"), "number"),
    **dict.fromkeys(("arr", "tuple", "set"), "array"),
    "map": "object",
}
_SGL_PREFIX_BOUNDARY = frozenset("0123456789[<( \t")
_SGL_PREFIX_RULES = (
    (("int", "uint", "long", "short", "unsigned"), "integer"),
    (("num", "float"), "number"),
    (("list",), "array"),
    (("dict",), "object"),
)
#: keywords whose value is a map of schemas, a list of schemas, one schema (or a list of them)
_SGL_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SGL_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SGL_SCHEMA_ONE = (
    "items",
    "additionalProperties",
    "not",
    "if",
    "then",
    "else",
    "contains",
    "propertyNames",
    "unevaluatedItems",
    "unevaluatedProperties",
)


def sglang_schema_type(raw: Any) -> Any:
    """SGLang ``_normalize_single_type`` (utils.py@00ca197b): a standard JSON Schema type stays;
    otherwise the text before any ``(``, stripped and lower-cased, is a standard type, an alias
    (``varchar`` -> ``string``, ``bool`` -> ``boolean``...) or a prefix (``int32`` -> ``integer``,
    ``list[str]`` -> ``array``: the prefix alone or followed by a digit, ``[<(``, space or tab);
    anything else (and a non-string) stays as sent."""
    if not isinstance(raw, str) or raw in _SGL_STANDARD_TYPES:
        return raw
    base = raw.split("(", 1)[0].strip().lower()
    if base in _SGL_STANDARD_TYPES:
        return base
    if base in _SGL_TYPE_ALIASES:
        return _SGL_TYPE_ALIASES[base]
    for prefixes, target in _SGL_PREFIX_RULES:
        for p in prefixes:
            if base == p or (len(base) > len(p) and base.startswith(p) and base[len(p)] in _SGL_PREFIX_BOUNDARY):
                return target
    return raw


def _sgl_fresh(x: Any, stack: list[Any]) -> Any:
    """A shallow copy of a dict or list, queued to be rewritten; anything else as it is."""
    if isinstance(x, (dict, list)):
        x = dict(x) if isinstance(x, dict) else list(x)
        stack.append(x)
    return x


def _sgl_type(t: Any) -> Any:
    """A ``type`` value: a string through :func:`sglang_schema_type`; a list likewise, then
    deduplicated (``_normalize_type_list``: first kept, ``==``); anything else as it is."""
    if isinstance(t, str):
        return sglang_schema_type(t)
    if not isinstance(t, list):
        return t
    types: list[Any] = []
    for item in map(sglang_schema_type, t):
        if item not in types:
            types.append(item)
    return types


def _sgl_rewrite(node: dict[str, Any], stack: list[Any]) -> None:
    """One schema object of :func:`sglang_schema`: its ``type`` rewritten, its subschemas copied
    and queued."""
    if "type" in node:
        node["type"] = _sgl_type(node["type"])
    for key in _SGL_SCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            node[key] = {k: _sgl_fresh(v, stack) for k, v in node[key].items()}
    for key in _SGL_SCHEMA_LISTS:
        if isinstance(node.get(key), list):
            node[key] = [_sgl_fresh(v, stack) for v in node[key]]
    for key in _SGL_SCHEMA_ONE:
        if key in node:
            node[key] = _sgl_fresh(node[key], stack)


def sglang_schema(schema: Any) -> Any:
    """A copy of a tool's ``parameters`` as SGLang rewrites them in place
    (``normalize_json_schema_types``, utils.py@00ca197b, called by serving_chat.py@002897c2
    ``OpenAIServingChat._validate_request`` on every tool whose ``parameters`` is not ``None``,
    before ``_process_messages`` dumps the tools, whatever the template or ``tool_choice``): each
    ``type`` string through :func:`sglang_schema_type`, a ``type`` list likewise and then
    deduplicated (first kept, ``==``); a list is each of its items; recursion into the schemas
    under :data:`_SGL_SCHEMA_MAPS` (values), :data:`_SGL_SCHEMA_LISTS` and :data:`_SGL_SCHEMA_ONE`,
    nowhere else. Iterative, so any depth is rewritten (SGLang refuses a schema deeper than its
    recursion limit); the input is not modified."""
    stack: list[Any] = []
    root = _sgl_fresh(schema, stack)
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            for k, item in enumerate(node):
                node[k] = _sgl_fresh(item, stack)
        else:
            _sgl_rewrite(node, stack)
    return root


def sglang_tool(tool: Any, rewrite_schema: bool = True) -> Any:
    """SGLang's ``tool.model_dump()`` (``protocol.py``, pydantic's default ``extra="ignore"``:
    unknown keys dropped): ``Tool(type, function, defer_loading=None)``,
    ``Function(description=None, name, parameters=None, strict=False, defer_loading)`` (the
    function's ``defer_loading`` popped when ``None``; the wrapper's copied into it), with
    ``parameters`` as :func:`sglang_schema` rewrites them (``rewrite_schema``; else as sent)."""
    found = _tool_parts(tool)
    if found is None:
        return tool
    t, fn = found
    defer = fn.get("defer_loading")
    if defer is None:
        defer = t.get("defer_loading")
    dumped_fn = {
        "description": fn.get("description"),
        "name": fn["name"],
        "parameters": sglang_schema(fn.get("parameters")) if rewrite_schema else fn.get("parameters"),
        "strict": fn.get("strict", False),
    }
    if defer is not None:
        dumped_fn["defer_loading"] = defer
    return {"type": t.get("type", "function"), "function": dumped_fn, "defer_loading": t.get("defer_loading")}


def engine_tools(tools: Any, engine: str | None, rewrite_schema: bool = True) -> Any:
    """``tools`` as ``engine`` hands them to the chat template: each one's pydantic
    ``model_dump()`` (:func:`vllm_tool`, :func:`sglang_tool`, its schemas rewritten unless
    ``rewrite_schema`` is false); as sent for any other engine."""
    if engine not in REBUILDING_ENGINES or not isinstance(tools, list):
        return tools
    if engine == "vllm":
        return [vllm_tool(t) for t in tools]
    return [sglang_tool(t, rewrite_schema) for t in tools]


def schema_forms(tools: Any, engine: str | None) -> tuple[bool, ...]:
    """The ``rewrite_schema`` values :func:`engine_tools` is rendered with for ``engine``: both
    (the larger count kept) where SGLang's schema rewrite changes a tool, else the rewritten form
    alone. SGLang releases before ``normalize_json_schema_types`` render the schemas as sent, and
    the rewrite can shorten one without bound (``"varchar(<any text>)"`` becomes ``"string"``):
    counting only the rewritten form would undercount behind such an SGLang."""
    if engine != "sglang" or not isinstance(tools, list):
        return (True,)
    for t in tools:
        found = _tool_parts(t)
        try:
            if found is not None and sglang_schema(found[1].get("parameters")) != found[1].get("parameters"):
                return (True, False)
        except RecursionError:  # nested past the comparison's reach: the rendering refuses it (a 400)
            return (True, False)
    return (True,)


def _wrapped(call: dict[str, Any]) -> dict[str, Any]:
    fn = call["function"]
    if "arguments" not in fn:  # none to wrap (a ChatML view of the messages as sent)
        return call
    return {**call, "function": {**fn, "arguments": ParsedArguments(fn["arguments"])}}


def wrap_parsed(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with every parsed tool-call argument wrapped in :class:`ParsedArguments`
    (kvgate's ChatML writes it as JSON; a raw non-string ``arguments`` stays refused)."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if isinstance(calls, list) and calls:
            m = {**m, "tool_calls": [_wrapped(c) for c in calls]}
        out.append(m)
    return out


def chatml_views(messages: list[dict[str, Any]], engine: str | None) -> list[list[dict[str, Any]]]:
    """Validated ``messages`` as ``engine`` hands them to a ChatML template (kvgate's, which
    renders role, name, content and tool calls only, and never loops over a message's content:
    the "string" content format for both engines), one list per layout the engine may use:
    arguments parsed; content flattened (vLLM: :func:`vllm_string_content`, text parts joined
    with ``\n``, both image layouts when an image is sent, as kvgate cannot know whether
    ``--interleave-mm-strings`` is set; SGLang: :func:`sglang_chatml_content`, joined with a
    space); for SGLang, the final assistant turn rewritten. ``None``: as sent."""
    if engine == "vllm":
        with_image = any(
            isinstance(p, dict) and p.get("type") in _IMAGE_PARTS
            for m in messages
            if isinstance(m.get("content"), list)
            for p in m["content"]
        )
        return [wrap_parsed(vllm_string_messages(messages, il)) for il in ((False, True) if with_image else (False,))]
    if engine == "sglang":
        return [wrap_parsed(sglang_messages(messages, sglang_chatml_content))]
    return [messages]


def chatml_view(messages: list[dict[str, Any]], engine: str | None) -> list[dict[str, Any]]:
    """The first of :func:`chatml_views` (vLLM: the placeholders in front, its default)."""
    return chatml_views(messages, engine)[0]
