"""The OpenAI Responses API's ``input``, ``instructions`` and ``tools`` as chat messages, so that
they are rendered with the model's chat template and counted exactly like a chat.

The mapping is vLLM's (``vllm/entrypoints/openai/responses/utils.py``:
``construct_input_messages``, ``construct_chat_messages_with_tool_call``,
``convert_tool_responses_to_completions_format``; content parts as ``chat_utils.py``'s
``MM_PARSER_MAP`` reads them), and the bundled backend builds its prompt with this same module, so
for it the count is exact by construction:

- ``instructions`` (a non-empty string) -> a first ``{"role": "system", "content": ...}``;
- ``input`` as a string -> one ``{"role": "user", "content": input}``;
- ``input`` as a list of items, in order:

  - a message (``{"role", "content"}``, ``type`` absent or ``"message"``; roles ``user``,
    ``system``, ``developer``, ``assistant``): ``content`` a string or parts. Parts
    ``input_text`` / ``output_text`` become chat ``text`` parts, ``refusal`` stays ``refusal``,
    ``input_image`` (with an ``image_url``; a ``file_id`` is refused) is an image part, costed
    like a chat image. An ``assistant``
    message keeps only its first part's ``text`` (vLLM does the same), and fills the previous
    assistant message's content when that message has none (one produced by a function call);
  - ``function_call`` (``call_id``, ``name``, ``arguments``): a tool call
    ``{"id": call_id, "type": "function", "function": {"name", "arguments"}}`` appended to the
    previous assistant message, or a new assistant message holding it;
  - ``function_call_output`` (``call_id``, ``output``: a string or parts):
    ``{"role": "tool", "content": output, "tool_call_id": call_id}``;
  - ``reasoning`` (``content[0].text``, else ``summary[0].text``): the ``reasoning`` of the
    previous assistant message (when it has none) or of a new one. Templates that render
    ``reasoning`` count it; kvgate's ChatML template does not render it (nor does the bundled
    backend). ``encrypted_content`` is refused, as vLLM refuses it;

- ``tools``: each ``{"type": "function", "name", "description", "parameters", ...}`` becomes
  ``{"type": "function", "function": {"name", "description", "parameters", ...the rest}}``
  (``description``/``parameters`` ``null`` when absent: vLLM's ``FunctionDefinition`` dump).

Refused with a 400 naming the field (kvgate cannot know what the engine would add to the prompt):
built-in tools (``web_search``, ``file_search``, ``mcp``, ...), items other than the four above
(``item_reference`` points at engine-side state), parts other than the ones above
(``input_file``, ``input_audio``), and a last assistant or reasoning item with ``status``
``in_progress``/``incomplete`` (vLLM then continues that message instead of starting a new one,
a different prompt).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenizer.base import PromptCounter
from tokenizer.chat import DEFAULT_CHAT, ChatOptions
from tokenizer.errors import InvalidPromptError, TokenizerError
from tokenizer.prompt_text import chat_text

MESSAGE_ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text")
IMAGE_PARTS = ("input_image",)
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
#: a last item with one of these statuses makes vLLM continue it (``should_continue_final_message``)
PARTIAL_STATUSES = ("in_progress", "incomplete")


@dataclass
class ResponsesPrompt:
    """A Responses request's prompt as chat: ``messages`` (OpenAI chat messages) and ``tools``
    (chat-shaped tool definitions, or ``None``). ``params``: a converted field's chat path
    (``messages[1].tool_calls[0].function.arguments``) -> the input field it came from
    (``input[2].arguments``), for errors."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    params: dict[str, str] = field(default_factory=dict)


def _bad(message: str, param: str) -> InvalidPromptError:
    return InvalidPromptError(message, param)


def _parts(content: Any, param: str, allowed: tuple[str, ...]) -> list[dict[str, Any]]:
    """Responses content parts -> chat content parts; raises for a wrong shape or type."""
    out: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        pparam = f"{param}[{j}]"
        if not isinstance(part, dict):
            raise _bad(f"'{pparam}' must be an object with a 'type'.", pparam)
        ptype = part.get("type")
        if ptype in TEXT_PARTS and ptype in allowed:
            text = part.get("text")
            if not isinstance(text, str):
                raise _bad(f"'{pparam}.text' must be a string.", f"{pparam}.text")
            out.append({"type": "text", "text": text})
        elif ptype == "refusal" and ptype in allowed:
            text = part.get("refusal")
            if not isinstance(text, str):
                raise _bad(f"'{pparam}.refusal' must be a string.", f"{pparam}.refusal")
            out.append({"type": "refusal", "refusal": text})
        elif ptype in IMAGE_PARTS and ptype in allowed:
            url = part.get("image_url")
            if not isinstance(url, str):
                # a file_id points at the engine's file store: an image kvgate cannot see or cost
                raise _bad(f"'{pparam}.image_url' must be the image's URL (a data: URL).", f"{pparam}.image_url")
            image = {"type": "input_image", "image_url": url}
            if isinstance(part.get("detail"), str):
                image["detail"] = part["detail"]
            out.append(image)
        else:
            raise _bad(
                f"Unsupported content part type {str(ptype)[:40]!r} at '{pparam}.type'; expected one of "
                + ", ".join(repr(a) for a in allowed)
                + ".",
                f"{pparam}.type",
            )
    return out


def _str_field(item: dict[str, Any], key: str, param: str) -> str:
    v = item.get(key)
    if not isinstance(v, str):
        raise _bad(f"'{param}.{key}' must be a string.", f"{param}.{key}")
    return v


def _prev_assistant(messages: list[dict[str, Any]]) -> dict[str, Any] | None:
    return messages[-1] if messages and messages[-1].get("role") == "assistant" else None


def _message(item: dict[str, Any], param: str, messages: list[dict[str, Any]]) -> None:
    role = item.get("role")
    if role not in MESSAGE_ROLES:
        raise _bad(
            f"'{param}.role' must be one of {', '.join(MESSAGE_ROLES)}; got {str(role)[:40]!r}.", f"{param}.role"
        )
    content = item.get("content")
    cparam = f"{param}.content"
    if role == "assistant":
        if isinstance(content, str):
            text = content
        elif isinstance(content, list):
            parts = _parts(content, cparam, ("output_text", "input_text", "refusal"))
            text = parts[0].get("text", "") if parts else ""  # vLLM keeps the first part's "text"
        else:
            raise _bad(f"'{cparam}' must be a string or a list of content parts.", cparam)
        prev = _prev_assistant(messages)
        if prev is not None and prev.get("content") is None:
            prev["content"] = text
        else:
            messages.append({"role": "assistant", "content": text})
        return
    if isinstance(content, str):
        messages.append({"role": role, "content": content})
    elif isinstance(content, list):
        messages.append(
            {"role": role, "content": _parts(content, cparam, ("input_text", "output_text", "input_image"))}
        )
    else:
        raise _bad(f"'{cparam}' must be a string or a list of content parts.", cparam)


def _function_call(item: dict[str, Any], param: str, messages: list[dict[str, Any]]) -> None:
    call = {
        "id": _str_field(item, "call_id", param),
        "type": "function",
        "function": {"name": _str_field(item, "name", param), "arguments": _str_field(item, "arguments", param)},
    }
    prev = _prev_assistant(messages)
    if prev is not None:
        prev.setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "tool_calls": [call]})


def _function_call_output(item: dict[str, Any], param: str, messages: list[dict[str, Any]]) -> None:
    call_id = _str_field(item, "call_id", param)
    output = item.get("output")
    if isinstance(output, list):
        output = _parts(output, f"{param}.output", ("input_text", "input_image"))
    elif not isinstance(output, str):
        raise _bad(f"'{param}.output' must be a string or a list of content parts.", f"{param}.output")
    messages.append({"role": "tool", "content": output, "tool_call_id": call_id})


def _first_text(value: Any, param: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise _bad(f"'{param}' must be a list.", param)
    if not value:
        return None
    first = value[0]
    if not isinstance(first, dict) or not isinstance(first.get("text"), str):
        raise _bad(f"'{param}[0].text' must be a string.", f"{param}[0].text")
    return first["text"]


def _reasoning(item: dict[str, Any], param: str, messages: list[dict[str, Any]]) -> None:
    if item.get("encrypted_content") is not None:
        raise _bad("Encrypted reasoning content is not supported.", f"{param}.encrypted_content")
    text = _first_text(item.get("content"), f"{param}.content")
    if text is None:
        text = _first_text(item.get("summary"), f"{param}.summary")
    text = text or ""
    prev = _prev_assistant(messages)
    if prev is not None and prev.get("reasoning") is None:
        prev["reasoning"] = text
    else:
        messages.append({"role": "assistant", "reasoning": text})


_ITEMS = {
    "message": _message,
    "function_call": _function_call,
    "function_call_output": _function_call_output,
    "reasoning": _reasoning,
}


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise _bad("'tools' must be a list.", "tools")
    out = []
    for j, t in enumerate(tools):
        param = f"tools[{j}]"
        if not isinstance(t, dict):
            raise _bad(f"'{param}' must be an object.", param)
        if t.get("type") != "function":
            raise _bad(
                f"Tool type {str(t.get('type'))[:40]!r} at '{param}.type' is not supported: kvgate serves "
                "'function' tools only (built-in tools make the engine add to the prompt what kvgate cannot count).",
                f"{param}.type",
            )
        name = _str_field(t, "name", param)
        fn = {"name": name, "description": t.get("description"), "parameters": t.get("parameters")}
        fn.update((k, v) for k, v in t.items() if k not in ("type", "name", "description", "parameters"))
        out.append({"type": "function", "function": fn})
    return out or None


def responses_to_chat(input: Any, instructions: Any = None, tools: Any = None) -> ResponsesPrompt:
    """A Responses request's ``input``, ``instructions`` and ``tools`` as chat (the module's
    mapping). Raises :class:`~tokenizer.errors.InvalidPromptError` with ``param`` naming the
    field (``input``, ``input[2].content[0].type``, ``instructions``, ``tools[1].type``)."""
    messages: list[dict[str, Any]] = []
    params: dict[str, str] = {}
    if instructions is not None and not isinstance(instructions, str):
        raise _bad("'instructions' must be a string.", "instructions")
    if instructions:
        messages.append({"role": "system", "content": instructions})
    if isinstance(input, str):
        messages.append({"role": "user", "content": input})
    elif isinstance(input, list):
        for i, item in enumerate(input):
            _input_item(item, f"input[{i}]", i == len(input) - 1, messages, params)
    else:
        raise _bad("'input' must be a string or a list of input items.", "input")
    if not messages:
        raise _bad("'input' must not be empty.", "input")
    return ResponsesPrompt(messages, _tools(tools), params)


def _input_item(item: Any, param: str, last: bool, messages: list[dict[str, Any]], params: dict[str, str]) -> None:
    """Append one ``input`` item (at ``param``; ``last``: the final one) to ``messages``; a
    function call's arguments are recorded in ``params`` (chat path -> input field)."""
    if not isinstance(item, dict):
        raise _bad(f"'{param}' must be an object (a message or an item with a 'type').", param)
    itype = item.get("type", "message" if "role" in item else None)
    handler = _ITEMS.get(itype) if isinstance(itype, str) else None
    if handler is None:
        raise _bad(
            f"Unsupported input item type {str(itype)[:40]!r} at '{param}.type'; expected one of "
            + ", ".join(repr(t) for t in ITEM_TYPES)
            + ".",
            f"{param}.type",
        )
    if last and _continues(item, itype):
        raise _bad(
            f"'{param}.status' {item['status']!r} asks the engine to continue that message, which "
            "kvgate cannot count; send it as a completed message.",
            f"{param}.status",
        )
    handler(item, param, messages)
    if itype == "function_call":  # appended to the last (assistant) message
        calls = len(messages[-1]["tool_calls"]) - 1
        params[f"messages[{len(messages) - 1}].tool_calls[{calls}].function.arguments"] = f"{param}.arguments"


def _continues(item: dict[str, Any], itype: object) -> bool:
    """Whether ``item``, as the last one, makes vLLM continue it: an assistant message or a
    reasoning item whose ``status`` is partial."""
    if itype not in ("message", "reasoning") or item.get("status") not in PARTIAL_STATUSES:
        return False
    return itype == "reasoning" or item.get("role") == "assistant"


def _retarget(e: TokenizerError, prompt: ResponsesPrompt) -> TokenizerError:
    """A counting error raised on the converted messages names the input field it came from
    (:attr:`ResponsesPrompt.params`), else ``input`` instead of ``messages``, in its ``param``
    and in its message (a Responses request has no ``messages``: the chat path quoted there,
    ``'messages[2].tool_calls[0].function.arguments'``, named a field the client never sent)."""
    if e.param is not None and e.param.startswith("messages"):
        chat_path = e.param
        e.param = prompt.params.get(chat_path, "input")
        e.message = e.message.replace(f"'{chat_path}'", f"'{e.param}'")
    return e


def count_responses(counter: PromptCounter, prompt: ResponsesPrompt, options: ChatOptions = DEFAULT_CHAT) -> int:
    """Prompt tokens of a converted Responses request (generation prompt included), as
    :meth:`PromptCounter.count_chat` counts a chat with ``options`` (the template variables the
    engine sets). Raises the typed errors of :mod:`tokenizer.errors` (``param`` ``input`` for
    what the template rejects)."""
    try:
        return counter.count_chat(prompt.messages, prompt.tools, options)
    except TokenizerError as e:
        raise _retarget(e, prompt) from None


async def acount_responses(counter: PromptCounter, prompt: ResponsesPrompt, options: ChatOptions = DEFAULT_CHAT) -> int:
    """:func:`count_responses` through the counter's async API (a worker thread for long input;
    the engine's tokenize endpoint for ``engine`` tokenizers)."""
    try:
        return await counter.acount_chat(prompt.messages, prompt.tools, options)
    except TokenizerError as e:
        raise _retarget(e, prompt) from None


def responses_text(prompt: ResponsesPrompt) -> str:
    """The converted request's prompt text for the verifier (:func:`chat_text` of its messages and
    tools): instructions, message texts, ``function_call`` names and arguments,
    ``function_call_output`` outputs, reasoning and the function tools' definitions."""
    return chat_text(prompt.messages, prompt.tools)
