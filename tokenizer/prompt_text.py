"""A prompt's text as the verifier sees it: every string an engine renders into the prompt of a
chat (tool definitions, names, reasoning, text and refusal parts, tool calls' names and
arguments), joined by newlines. The verifier indexes it in the leak index and treats it as the
sender's own text, so a string the engine renders but this leaves out is neither protected nor
own (docs/verifier.md, the leak index)."""

from __future__ import annotations

from typing import Any

from tokenizer.chat import template_json
from tokenizer.json_values import string_values, unescaped_values


def _dumps(obj: Any) -> str:
    """JSON as kvgate's ChatML template writes tool definitions (:func:`tokenizer.chat.template_json`);
    a value that cannot be written (a hostile nesting depth) gives its strings instead."""
    try:
        return template_json(obj)
    except (RecursionError, TypeError, ValueError):
        out: list[str] = []
        string_values(obj, out)
        return "\n".join(out)


def _arguments_texts(args: Any, out: list[str]) -> None:
    """A tool call's ``arguments``: the string as sent; when it holds a JSON escape (a newline,
    a quote, ``\\uXXXX`` for non-ASCII), also its decoded string values, the text a model that
    quotes them writes (a file's lines), decoded as the response side decodes a leak of them
    (:func:`tokenizer.json_values.unescaped_values`: a document escaped inside a value and a
    string literal too, up to 3 levels, and arguments cut off mid-JSON leniently). A parsed value
    (not a string) is written as JSON."""
    if isinstance(args, str):
        out.append(args)
        out.extend(unescaped_values(args))
    elif isinstance(args, (dict, list)):
        out.append(_dumps(args))


def _call_texts(fn: Any, out: list[str]) -> None:
    """A ``function`` (of a tool call, or a legacy ``function_call``): its name and arguments."""
    if isinstance(fn, dict):
        if isinstance(fn.get("name"), str):
            out.append(fn["name"])
        _arguments_texts(fn.get("arguments"), out)


def _content_texts_into(content: Any, out: list[str]) -> None:
    """A message's ``content``: a string, or its text parts (``text``, ``input_text``,
    ``output_text``) and ``refusal`` parts; images and other parts carry no text."""
    if isinstance(content, str):
        out.append(content)
    elif isinstance(content, list):
        for p in content:
            if isinstance(p, dict):
                t = p.get("text")
                if not isinstance(t, str) and p.get("type") == "refusal":
                    t = p.get("refusal")
                if isinstance(t, str):
                    out.append(t)


def chat_text(messages: Any, tools: Any = None, functions: Any = None) -> str:
    """Every string of a chat that an engine renders into the prompt, joined by newlines: the
    prompt's own text for the verifier (indexed in the leak index, and its sender's own text;
    never logged). First each tool definition (``tools``, then legacy ``functions``) as the
    template writes it (one JSON object each, :func:`_dumps`); then per message its ``name``, its
    ``reasoning`` / ``reasoning_content`` (once when equal), its content's text and refusal parts,
    a message ``refusal``, and each tool call's (and a legacy ``function_call``'s) function name and
    arguments (:func:`_arguments_texts`). Ids (``tool_call_id``, a call's ``id``) and images carry
    no text. Empty strings are left out. At most the request's own strings, plus a tool call's
    escaped arguments decoded up to 3 levels (each level at most its text): about four times the
    body at worst, gathered in one pass."""
    out: list[str] = []
    for defs in (tools, functions):
        if isinstance(defs, list):
            out.extend(_dumps(t) for t in defs if isinstance(t, dict))
    for m in messages if isinstance(messages, list) else ():
        if isinstance(m, dict):
            _message_texts(m, out)
    return "\n".join(t for t in out if t)


def _message_texts(m: dict[str, Any], out: list[str]) -> None:
    """One message's strings, in :func:`chat_text`'s order."""
    if isinstance(m.get("name"), str):
        out.append(m["name"])
    reasoning = m.get("reasoning")
    if isinstance(reasoning, str):
        out.append(reasoning)
    rc = m.get("reasoning_content")
    if isinstance(rc, str) and rc != reasoning:
        out.append(rc)
    _content_texts_into(m.get("content"), out)
    if isinstance(m.get("refusal"), str):
        out.append(m["refusal"])
    calls = m.get("tool_calls")
    if isinstance(calls, list):
        for call in calls:
            if isinstance(call, dict):
                _call_texts(call.get("function"), out)
    _call_texts(m.get("function_call"), out)


def content_texts(content: Any) -> list[str]:
    """The text of one message's ``content``: a string, or its text and refusal parts, in order."""
    out: list[str] = []
    _content_texts_into(content, out)
    return out
