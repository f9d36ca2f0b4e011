"""What each engine does to chat messages before its chat template runs, so that a chat is counted
as the engine will render it (docs/tokenizer.md, "Pre-template steps").

Engine policies (an upstream's ``engine``): ``kvgate`` (the bundled backend renders the messages
as sent, by construction) and ``openai`` (counts on its side) take the messages as they are.
``vllm`` and ``sglang`` rebuild them first; each step below copies the engine's source, cited
as ``file@commit`` and function:

- vLLM ``vllm/entrypoints/chat_utils.py@001eadcf`` ``_parse_chat_message_content`` (the message
  rebuilt from its known keys) and ``_postprocess_messages`` (tool-call arguments parsed).
- SGLang ``python/sglang/srt/entrypoints/openai/serving_chat.py@002897c2``
  ``_apply_jinja_template``: ``normalize_assistant_tool_call_arguments`` (arguments parsed
  with orjson, refused unless a JSON object), ``process_content_for_template_format``
  (``python/sglang/srt/parser/jinja_template_utils.py@0b9c3848``: text parts joined with a space,
  ``None`` values dropped) and ``_handle_last_assistant_message`` (a trailing assistant turn
  becomes a user turn of its text).

Chat templates then print parsed arguments with ``tojson`` (transformers' own filter,
``json.dumps``): ``1e15`` is printed ``1000000000000000.0``, which is why the text as sent is not
what is counted.
"""

from __future__ import annotations

import json
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


def _calls(message: dict[str, Any], i: int, parse: Any, keep_missing: bool = False) -> list[dict[str, Any]]:
    """Copies of ``message``'s tool calls with ``function.arguments`` replaced by ``parse``'s
    result (validated shapes: a list of objects with a ``function`` object). ``keep_missing``:
    a call without ``arguments`` keeps none (SGLang parses only a present string)."""
    out = []
    for j, call in enumerate(message.get("tool_calls") or ()):
        fn = call["function"]
        if keep_missing and "arguments" not in fn:
            out.append({**call, "function": dict(fn)})
            continue
        out.append({**call, "function": {**fn, "arguments": parse(fn.get("arguments"), _args_param(i, j))}})
    return out


def vllm_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation vLLM templates (chat_utils.py@001eadcf ``_parse_chat_message_content``
    then ``_postprocess_messages``): ``role`` and ``content``; an assistant's ``tool_calls``
    (arguments parsed, an empty list dropped) and ``reasoning`` (also as ``reasoning_content``;
    a ``reasoning_content`` sent alone is not kept); a tool message's ``tool_call_id``; a string
    ``name``. Every other key is dropped. Content stays as sent (the counter flattens it)."""
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
        out.append(conv)
    return out


def sglang_text(content: Any) -> Any:
    """SGLang ``process_content_for_template_format`` for string-format templates
    (jinja_template_utils.py@0b9c3848): a parts list becomes its ``text`` parts joined by a
    space (other parts dropped); ``None`` becomes ``""`` (serving_chat.py ``_apply_jinja_template``)."""
    if content is None:
        return ""
    if isinstance(content, list):
        return " ".join(p["text"] for p in content if isinstance(p, dict) and p.get("type") in ("text", "input_text"))
    return content


def sglang_messages(messages: list[dict[str, Any]], flatten: bool = True) -> list[dict[str, Any]]:
    """The messages SGLang templates (serving_chat.py@002897c2 ``_apply_jinja_template``):
    tool-call arguments parsed (``normalize_assistant_tool_call_arguments``; refused unless a
    JSON object), content flattened (``flatten``; :func:`sglang_text`) and ``None`` values
    dropped, then ``_handle_last_assistant_message``: a final assistant message whose content is
    a string becomes ``{"role": "user", "content": <that string>}`` (its tool calls, name and
    reasoning are gone). ``flatten=False`` keeps content as sent (kvgate's ChatML renders parts
    itself); a final assistant message is then rewritten whatever its content."""
    out = []
    for i, m in enumerate(messages):
        msg = dict(m)
        if m.get("role") == "assistant" and isinstance(m.get("tool_calls"), list):
            msg["tool_calls"] = _calls(m, i, sglang_arguments, keep_missing=True)
        if flatten:
            msg["content"] = sglang_text(msg.get("content"))
        out.append({k: v for k, v in msg.items() if v is not None})
    if out and out[-1].get("role") == "assistant" and (isinstance(out[-1].get("content"), str) or not flatten):
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
    """:func:`sglang_messages` for an "openai"-format template: arguments parsed, content as
    :func:`sglang_parts`, ``None`` values dropped, then a final assistant turn rewritten only when
    its content is a string (``_handle_last_assistant_message``)."""
    out = []
    for i, m in enumerate(messages):
        msg = dict(m)
        if m.get("role") == "assistant" and isinstance(m.get("tool_calls"), list):
            msg["tool_calls"] = _calls(m, i, sglang_arguments, keep_missing=True)
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


def sglang_tool(tool: Any) -> Any:
    """SGLang's ``tool.model_dump()`` (``protocol.py``, pydantic's default ``extra="ignore"``:
    unknown keys dropped): ``Tool(type, function, defer_loading=None)``,
    ``Function(description=None, name, parameters=None, strict=False, defer_loading)`` (the
    function's ``defer_loading`` popped when ``None``; the wrapper's copied into it)."""
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
        "parameters": fn.get("parameters"),
        "strict": fn.get("strict", False),
    }
    if defer is not None:
        dumped_fn["defer_loading"] = defer
    return {"type": t.get("type", "function"), "function": dumped_fn, "defer_loading": t.get("defer_loading")}


def engine_tools(tools: Any, engine: str | None) -> Any:
    """``tools`` as ``engine`` hands them to the chat template: each one's pydantic
    ``model_dump()`` (:func:`vllm_tool`, :func:`sglang_tool`); as sent for any other engine."""
    if engine not in REBUILDING_ENGINES or not isinstance(tools, list):
        return tools
    dump = vllm_tool if engine == "vllm" else sglang_tool
    return [dump(t) for t in tools]


def _wrapped(call: dict[str, Any]) -> dict[str, Any]:
    fn = call["function"]
    if "arguments" not in fn:  # SGLang parses only arguments that are there
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


def chatml_view(messages: list[dict[str, Any]], engine: str | None) -> list[dict[str, Any]]:
    """Validated ``messages`` as ``engine`` hands them to a ChatML template (kvgate's, which
    renders role, name, content and tool calls only): arguments parsed; for SGLang, the final
    assistant turn rewritten. ``None``: as sent."""
    if engine == "vllm":
        return wrap_parsed(vllm_messages(messages))
    if engine == "sglang":
        return wrap_parsed(sglang_messages(messages, flatten=False))
    return messages
