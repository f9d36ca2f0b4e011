"""OpenAI chat messages: validation and the ChatML template of the bundled backend.

The template is defined here once and used by both the gateway (to count) and the bundled
backend (to build the prompt), so for that backend the two counts are equal by construction::

    <|im_start|>{role}[ name={name}]\n{content}[\n{tool calls}]<|im_end|>\n   (per message)
    <|im_start|>assistant\n                                              (generation prompt)

- ``content``: a string, ``null`` or parts; ``text``/``refusal`` parts are concatenated as they
  are, image parts (``image_url``, ``input_image``) cost a configured number of tokens instead.
  This is what the bundled backend renders (the messages as sent); behind vLLM or SGLang the
  counter renders each engine's view instead (:func:`tokenizer.engine_render.chatml_views`: text
  parts joined with ``\n`` or a space before the template runs).
- tool calls: ``<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>`` per call, joined by
  ``\n``, after the content (``\n`` between when the content is not empty).
- ``tools``: ``# Tools\n\n<tools>\n`` + one JSON object per line + ``\n</tools>``, appended after
  ``\n\n`` to the first message when it is a system/developer message, else a system message of
  its own placed first. JSON uses ``", "``/``": "`` separators, keys as given, non-ASCII kept.

Special tokens are produced only here, never from user text (user text is encoded "ordinary").
docs/tokenizer.md describes the template for users.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tokenizer.engine_render import DroppedImage, ParsedArguments
from tokenizer.errors import ImagesNotSupportedError, InvalidPromptError, UnknownContentPartError

TEXT_PART_TYPES = ("text", "refusal")
IMAGE_PART_TYPES = ("image_url", "input_image")
ROLES = ("system", "developer", "user", "assistant", "tool", "function")


def template_json(obj: Any) -> str:
    """Deterministic JSON for tool definitions and tool calls (key order as given), as the
    template writes them."""
    return json.dumps(obj, ensure_ascii=False, separators=(", ", ": "))


@dataclass(frozen=True)
class ChatOptions:
    """How a chat is turned into a prompt, beside ``messages`` and ``tools`` (the request fields
    of the same names; vLLM chat_completion/protocol.py ``build_chat_params``).

    ``add_generation_prompt``: append the assistant header (default true).
    ``continue_final_message``: leave the final message open, as ``transformers``'
    ``apply_chat_template`` does (the rendered text cut after the final message's stripped
    text); only template-string counters (HF, engine) support it. ``template_kwargs``: extra
    variables for a Jinja template (``enable_thinking`` ...), as ``(name, value)`` pairs; the
    ChatML template reads none of them."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: tuple[tuple[str, Any], ...] = ()

    @property
    def is_default(self) -> bool:
        """Whether these options change nothing (the plain chat prompt)."""
        return self.add_generation_prompt and not self.continue_final_message and not self.template_kwargs


#: The options of a plain chat request.
DEFAULT_CHAT = ChatOptions()


@dataclass
class RenderedChat:
    """A chat rendered as ChatML pieces.

    ``pieces``: a list where a ``str`` is ordinary text to encode and an ``int`` a special token id
    placeholder: ``0`` = ``<|im_start|>``, ``1`` = ``<|im_end|>``. ``images``: number of image parts;
    ``image_parts``: the parts themselves (dicts), in order, for per-image costs.
    """

    pieces: list[str | int] = field(default_factory=list)
    images: int = 0
    image_parts: list[dict] = field(default_factory=list)


IM_START_PIECE = 0
IM_END_PIECE = 1


def _part(part: Any, pparam: str) -> str | dict | DroppedImage:
    """A content part (at ``pparam``) validated: its text, or the part itself for an image (an
    engine view's :class:`~tokenizer.engine_render.DroppedImage` as it is)."""
    if isinstance(part, DroppedImage):
        return part
    if not isinstance(part, dict):
        raise InvalidPromptError(f"'{pparam}' must be an object with a 'type'.", pparam)
    ptype = part.get("type")
    if ptype in TEXT_PART_TYPES:
        text = part.get(ptype)
        if not isinstance(text, str):
            raise InvalidPromptError(f"'{pparam}.{ptype}' must be a string.", f"{pparam}.{ptype}")
        return text
    if ptype in IMAGE_PART_TYPES:
        return part
    raise UnknownContentPartError(ptype, f"{pparam}.type")


def _text_of_content(content: Any, param: str, image_parts: list[dict] | None = None) -> tuple[list[str], int]:
    """Texts (split around images) and the image count of one message's ``content``; image parts
    are appended to ``image_parts`` when given. A :class:`~tokenizer.engine_render.DroppedImage`
    (an image the engine leaves out of the text) is counted as an image without a split."""
    if content is None:
        return [""], 0
    if isinstance(content, str):
        return [content], 0
    if not isinstance(content, list):
        raise InvalidPromptError(f"'{param}' must be a string, a list of content parts or null.", param)
    texts: list[str] = [""]
    images = 0
    for j, part in enumerate(content):
        p = _part(part, f"{param}[{j}]")
        if isinstance(p, str):
            texts[-1] += p
            continue
        images += 1
        if image_parts is not None:
            image_parts.append(p.part if isinstance(p, DroppedImage) else p)
        if not isinstance(p, DroppedImage):
            texts.append("")
    return texts, images


def _tool_calls_text(tool_calls: Any, param: str) -> str:
    if tool_calls is None:
        return ""
    if not isinstance(tool_calls, list):
        raise InvalidPromptError(f"'{param}' must be a list.", param)
    out = []
    for j, call in enumerate(tool_calls):
        if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
            raise InvalidPromptError(f"'{param}[{j}]' must be an object with a 'function'.", f"{param}[{j}]")
        fn = call["function"]
        name, args = fn.get("name"), fn.get("arguments", "")
        if isinstance(name, str) and isinstance(args, ParsedArguments):  # parsed as the engine parses it
            text = _json_value({"name": name, "arguments": args.value}, f"{param}[{j}].function.arguments")
            out.append(f"<tool_call>\n{text}\n</tool_call>")
            continue
        if not isinstance(name, str) or not isinstance(args, str):
            raise InvalidPromptError(
                f"'{param}[{j}].function' needs a string 'name' and string 'arguments'.", f"{param}[{j}].function"
            )
        out.append(f"<tool_call>\n{template_json({'name': name, 'arguments': args})}\n</tool_call>")
    return "\n".join(out)


def _json_value(obj: Any, param: str) -> str:
    """:func:`template_json` of a parsed value; a nesting too deep to write is refused naming ``param``."""
    try:
        return template_json(obj)
    except RecursionError:
        raise InvalidPromptError(f"'{param}' is nested too deeply.", param) from None


def _tools_block(tools: Any) -> str:
    if tools is None:
        return ""
    if not isinstance(tools, list):
        raise InvalidPromptError("'tools' must be a list.", "tools")
    for j, t in enumerate(tools):
        if not isinstance(t, dict):
            raise InvalidPromptError(f"'tools[{j}]' must be an object.", f"tools[{j}]")
    if not tools:
        return ""
    lines = []
    for j, t in enumerate(tools):
        try:
            lines.append(template_json(t))
        except RecursionError:  # a hostile nesting depth: the engine could not serialise it either
            raise InvalidPromptError(f"'tools[{j}]' is nested too deeply.", f"tools[{j}]") from None
    return "# Tools\n\n<tools>\n" + "\n".join(lines) + "\n</tools>"


def render_chatml(messages: Any, tools: Any = None, options: ChatOptions = DEFAULT_CHAT) -> RenderedChat:
    """Validate OpenAI ``messages`` (and ``tools``) and render them with the ChatML template;
    the generation prompt only when ``options.add_generation_prompt`` (``template_kwargs`` have
    no effect on ChatML).

    Raises :class:`InvalidPromptError` for a wrong shape or type, or for
    ``options.continue_final_message`` (not defined for this template: ``param``
    ``continue_final_message``), and :class:`UnknownContentPartError` for a content part of
    unknown ``type``; ``param`` names the field (``messages[1].content[0].type``).
    """
    if not isinstance(messages, list) or not messages:
        raise InvalidPromptError("'messages' must be a non-empty list of message objects.", "messages")
    out = RenderedChat()
    tools_text = _tools_block(tools)
    first_system = next(
        (i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") in ("system", "developer")), None
    )
    if tools_text and first_system != 0:
        out.pieces += [IM_START_PIECE, "system\n" + tools_text, IM_END_PIECE, "\n"]
    for i, m in enumerate(messages):
        _render_message(out, m, f"messages[{i}]", tools_text if i == first_system == 0 else "")
    if options.continue_final_message:
        raise InvalidPromptError(
            "'continue_final_message' is not supported with this model's chat template.", "continue_final_message"
        )
    if options.add_generation_prompt:
        out.pieces += [IM_START_PIECE, "assistant\n"]
    return out


def _header(m: Any, param: str) -> str:
    """A message's header line (``role[ name=NAME]\\n``); raises for a message that is not an
    object, an unknown role or a name that is not a string."""
    if not isinstance(m, dict):
        raise InvalidPromptError(f"'{param}' must be an object.", param)
    role = m.get("role")
    if role not in ROLES:
        raise InvalidPromptError(f"'{param}.role' must be one of {', '.join(ROLES)}; got {role!r}.", f"{param}.role")
    name = m.get("name")
    if name is not None and not isinstance(name, str):
        raise InvalidPromptError(f"'{param}.name' must be a string.", f"{param}.name")
    return role + (f" name={name}" if name else "") + "\n"


def _render_message(out: RenderedChat, m: Any, param: str, tools_text: str) -> None:
    """Append message ``m`` (at ``param``) to ``out``: header, content, tool calls, then
    ``tools_text`` (the tools block, for a first system message; else empty)."""
    header = _header(m, param)
    texts, images = _text_of_content(m.get("content"), f"{param}.content", out.image_parts)
    calls = _tool_calls_text(m.get("tool_calls"), f"{param}.tool_calls")
    if calls:
        texts[-1] += ("\n" if texts[-1] else "") + calls
    if tools_text:
        texts[-1] += ("\n\n" if any(texts) else "") + tools_text
    texts[0] = header + texts[0]
    out.pieces.append(IM_START_PIECE)
    out.pieces.extend(t for t in texts if t)
    out.pieces += [IM_END_PIECE, "\n"]
    out.images += images


def chatml_token_ids(
    rendered: RenderedChat, encode_ordinary: Callable[[str], list[int]], im_start_id: int, im_end_id: int
) -> list[int]:
    """Token ids of a rendered chat for a text-only engine. Raises
    :class:`ImagesNotSupportedError` when the chat holds an image part."""
    if rendered.images:
        raise ImagesNotSupportedError("This model does not accept image content parts.", "messages")
    ids: list[int] = []
    for piece in rendered.pieces:
        if isinstance(piece, str):
            ids.extend(encode_ordinary(piece))
        else:  # IM_START_PIECE or IM_END_PIECE
            ids.append(im_start_id if piece == IM_START_PIECE else im_end_id)
    return ids


def chatml_token_count(
    rendered: RenderedChat, count_ordinary: Callable[[str], int], image_tokens: int | Callable[[list[dict]], int]
) -> int:
    """Token count of a rendered chat: specials count 1, images ``image_tokens`` each (or, when
    ``image_tokens`` is a function, what it returns for ``rendered.image_parts``)."""
    total = image_tokens(rendered.image_parts) if callable(image_tokens) else rendered.images * image_tokens
    for piece in rendered.pieces:
        total += 1 if isinstance(piece, int) else count_ordinary(piece)
    return total


def string_chars(obj: Any, limit: int | None = None) -> int:
    """Total length of every string (keys included) inside ``obj`` (dicts, lists, strings);
    stops early once ``limit`` is passed. Iterative, so deep nesting cannot overflow the stack."""
    n = 0
    stack = [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, str):
            n += len(x)
        elif isinstance(x, dict):
            stack.extend(x.keys())
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)
        else:
            n += 1
        if limit is not None and n > limit:
            break
    return n


#: What each JSON element of a chat (a message, a part, a key, a value) costs besides its text,
#: in characters: rendering and counting a one-character message costs about as much as
#: encoding 80 characters (measured with the bundled tokenizer); a message is about 5 elements.
CHAT_ELEMENT_CHARS = 16


def chat_cost(messages: Any, tools: Any = None, limit: int | None = None) -> int:
    """What rendering and counting a chat costs, in characters: every string's length plus
    :data:`CHAT_ELEMENT_CHARS` per element (dict, list, key, value). Stops early once ``limit``
    is passed; a list of messages longer than ``limit / CHAT_ELEMENT_CHARS`` is over it at once."""
    if isinstance(messages, list):
        floor = len(messages) * CHAT_ELEMENT_CHARS
        if limit is not None and floor > limit:
            return floor
    n = 0
    stack = [messages, tools]
    while stack:
        x = stack.pop()
        n += CHAT_ELEMENT_CHARS
        if isinstance(x, str):
            n += len(x)
        elif isinstance(x, dict):
            if limit is not None and n + len(x) * CHAT_ELEMENT_CHARS > limit:
                return n + len(x) * CHAT_ELEMENT_CHARS
            stack.extend(x.keys())
            stack.extend(x.values())
        elif isinstance(x, list):
            if limit is not None and n + len(x) * CHAT_ELEMENT_CHARS > limit:
                return n + len(x) * CHAT_ELEMENT_CHARS
            stack.extend(x)
        if limit is not None and n > limit:
            break
    return n


def chat_text_length(messages: Any, tools: Any = None, limit: int | None = 1 << 20) -> int:
    """Character length of a chat's strings (contents, names, tool calls, tool definitions), to
    decide whether to count off the event loop; stops counting above ``limit``."""
    return string_chars([messages, tools], limit)
