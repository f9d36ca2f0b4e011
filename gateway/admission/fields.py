"""Field policy per engine (docs/design.md, Contracts: "The gate's invariant", upstream ``engine``).

Validation (:mod:`gateway.admission.checks`) knows every field's type and range. This module decides,
for the engines that serve a model, which engine extension fields reach them and what the
prompt-changing fields do to the count:

- :data:`ENGINE_EXTENSIONS`: per engine and route, the extension fields passed through. For a
  model served by several upstreams, only the fields every one of them accepts pass
  (:func:`allowed_extensions`). An extension field outside the table is a 400 naming it, unless
  it is ``null`` or the engine's own default (``add_generation_prompt: true``,
  ``continue_final_message: false``): then it is dropped before forwarding.
- prompt-changing fields: ``tools`` (counted by every counter), ``add_generation_prompt``,
  ``continue_final_message`` and ``chat_template_kwargs`` (counted through
  :class:`tokenizer.chat.ChatOptions`; refused where the engine does not read them),
  ``reasoning_effort`` (SGLang turns it into ``thinking``/``enable_thinking`` template kwargs,
  vLLM passes it to the template: counted as such; ``/v1/responses`` ``reasoning.effort`` the
  same way: :func:`responses_chat_options`), ``suffix`` (SGLang inserts it as
  fill-in-the-middle text, vLLM refuses it: accepted only for ``openai``), ``echo`` with
  ``logprobs`` (prompt logprobs: a vocabulary-sized row per prompt token on the engine;
  accepted only for ``openai``), image URLs (``data:`` only unless the model's
  ``images.allowed_url_hosts`` lists the host; no image at all where the bundled backend serves
  the model: :func:`gateway.admission.engine_refusals.check_image_parts`).
- tool definitions without a ``function`` holding a string ``name`` are refused, as the engines'
  request models refuse them (:func:`check_tool_shapes`); those holding the text of one of the
  model's special tokens are refused for engines that parse special tokens in the rendered prompt
  (:func:`check_tool_definitions`);
- bound-dependent checks (:func:`check_bounded`): ``min_tokens`` <= the completion bound,
  ``stop_token_ids`` and ``logit_bias`` ids inside the model's vocabulary.

Sources: SGLang ``python/sglang/srt/entrypoints/openai/protocol.py`` (``ChatCompletionRequest``,
``CompletionRequest``: extra fields are ignored by pydantic, so a field outside its table would be
silently dropped), vLLM ``vllm/entrypoints/openai/chat_completion/protocol.py`` and
``completion/protocol.py``, the bundled backend ``gpu_backend/openai_api.py`` (``_sampling``).
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any
from urllib.parse import urlsplit

from config.errors import ErrorCode, OpenAIError
from config.models import ImagePolicy
from gateway.admission.checks import OPENAI_FIELDS
from gateway.admission.engine_refusals import check_image_parts
from tokenizer.chat import DEFAULT_CHAT, IMAGE_PART_TYPES, TEXT_PART_TYPES, ChatOptions
from tokenizer.images import image_url_of

_SGLANG_SAMPLING = ("top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "skip_special_tokens")
_VLLM_SAMPLING = _SGLANG_SAMPLING + ("spaces_between_special_tokens",)

#: engine -> route -> extension fields passed through (beyond the OpenAI fields).
ENGINE_EXTENSIONS: dict[str, dict[str, frozenset[str]]] = {
    "sglang": {
        "chat": frozenset(
            _SGLANG_SAMPLING
            + ("stop_token_ids", "no_stop_trim", "regex", "ebnf", "separate_reasoning", "stream_reasoning")
            + ("chat_template_kwargs",)
        ),
        "completions": frozenset(
            _SGLANG_SAMPLING + ("stop_token_ids", "no_stop_trim", "regex", "ebnf", "json_schema", "response_format")
        ),
    },
    "vllm": {
        "chat": frozenset(
            _VLLM_SAMPLING
            + ("stop_token_ids", "chat_template_kwargs", "add_generation_prompt", "continue_final_message")
        ),
        "completions": frozenset(_VLLM_SAMPLING + ("stop_token_ids", "response_format")),
    },
    "kvgate": {
        "chat": frozenset(("stop_token_ids", "ignore_eos")),
        "completions": frozenset(("stop_token_ids", "ignore_eos")),
    },
    "openai": {"chat": frozenset(), "completions": frozenset()},
}
#: ``/v1/responses``: the sampling fields each engine's Responses request model reads (beyond
#: OpenAI's ``ResponseCreateParams``). SGLang 0.5.23 ``protocol.py`` ``ResponsesRequest`` ("SGLang
#: sampling extras", read by ``to_sampling_params``; pydantic drops any other field silently: no
#: ``ignore_eos``, ``min_tokens`` or ``skip_special_tokens`` there). vLLM
#: ``vllm/entrypoints/openai/responses/protocol.py`` ``ResponsesRequest`` (``top_k``,
#: ``skip_special_tokens``, ``repetition_penalty``, ``seed``, ``stop``, ``ignore_eos``, passed to
#: ``SamplingParams.from_optional``; no ``min_tokens``, no ``min_p``). The bundled backend:
#: ``gpu_backend/responses_api.py`` reads ``openai_api._sampling`` as chat does.
ENGINE_EXTENSIONS["sglang"]["responses"] = frozenset(
    ("stop", "top_k", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty")
)
ENGINE_EXTENSIONS["vllm"]["responses"] = frozenset(
    ("stop", "top_k", "repetition_penalty", "seed", "ignore_eos", "skip_special_tokens")
)
ENGINE_EXTENSIONS["kvgate"]["responses"] = frozenset(("stop", "seed", "stop_token_ids", "ignore_eos"))
ENGINE_EXTENSIONS["openai"]["responses"] = frozenset()

#: extension fields whose value, when it is the engines' own default, means "absent": dropped
#: for an engine that does not read the field (vLLM's ``SamplingParams`` and SGLang's
#: ``SamplingParams`` defaults: ``ignore_eos`` false, ``skip_special_tokens`` true,
#: ``min_tokens`` 0; completions ``response_format`` text, no constraint), so a benchmark client
#: that always sends them works on every engine
_NO_OP_DEFAULTS: dict[str, Any] = {
    "add_generation_prompt": True,
    "continue_final_message": False,
    "ignore_eos": False,
    "skip_special_tokens": True,
    "min_tokens": 0,
    "response_format": {"type": "text"},
}

#: OpenAI fields only some engines honour: field -> engines that accept it (others: 400)
_OPENAI_ONLY_ON = {"suffix": frozenset({"openai"})}
#: ``type`` values of OpenAI object fields that only the engines' own extensions take: (field,
#: type) -> engines that refuse it. ``response_format`` ``structural_tag``: vLLM
#: (``vllm/entrypoints/generate/base/protocol.py:146-178``, chat and completions) and SGLang
#: (``protocol.py:252-272``, ``:412``, ``:940``) take it; the bundled backend applies no structured
#: output (``gpu_backend/openai_api.py`` ``_UNSUPPORTED``: ``response_format`` text only), OpenAI's
#: ``response_format`` has no such type. Its checks: :mod:`gateway.admission.checks`,
#: :mod:`gateway.admission.engine_refusals`.
_TYPE_NOT_ON: dict[tuple[str, str], frozenset[str]] = {
    ("response_format", "structural_tag"): frozenset({"kvgate", "openai"}),
}


def allowed_extensions(engines: frozenset[str], route: str) -> frozenset[str]:
    """The extension fields every engine in ``engines`` accepts on ``route`` (none when
    ``engines`` is empty)."""
    tables = [ENGINE_EXTENSIONS[e][route] for e in engines]
    if not tables:
        return frozenset()
    out = tables[0]
    for t in tables[1:]:
        out &= t
    return out


def _refuse(param: str, message: str) -> OpenAIError:
    return OpenAIError(400, message, code=ErrorCode.INVALID_REQUEST, param=param)


def _template_kwargs_for(engine: str, body: dict[str, Any]) -> dict[str, Any]:
    kwargs = dict(body.get("chat_template_kwargs") or {})
    effort = body.get("reasoning_effort")
    if engine == "sglang":
        # serving_chat.py@002897c2: _convert_to_internal_request moves chat_template_kwargs'
        # reasoning_effort onto the request (it wins over the field); _apply_jinja_template passes
        # request.reasoning_effort to the template as a variable of that name
        effort = kwargs.get("reasoning_effort", effort)
        if effort is not None:
            kwargs["reasoning_effort"] = effort
    if effort is not None:
        if engine == "sglang":  # protocol.py normalize_reasoning_inputs
            kwargs.setdefault("thinking", effort != "none")
            kwargs.setdefault("enable_thinking", effort != "none")
        elif engine == "vllm":
            # chat_completion/protocol.py@v0.34.0:645-678 build_chat_params: reasoning_effort is a
            # template variable, and enable_thinking is set to effort != "none" unless the client's
            # chat_template_kwargs name it (a Qwen3-style template then writes an empty think block
            # for "none"); merge_kwargs lets neither override with None. The server's
            # --reasoning-effort-map is not visible here.
            kwargs["reasoning_effort"] = effort
            kwargs.setdefault("enable_thinking", effort != "none")
    return kwargs


def _same_on_every_engine(per_engine: list[dict[str, Any]], param: str) -> dict[str, Any]:
    """The template variables every engine of a model sets (``per_engine``: one dict per
    engine, at least one). Raises :class:`OpenAIError` 400 naming ``param`` where they differ:
    no one count would hold for all of them."""
    kwargs = per_engine[0]
    if any(k != kwargs for k in per_engine[1:]):
        raise _refuse(
            param, f"'{param}' changes the prompt differently on the engines serving this model; leave it out."
        )
    return kwargs


def _responses_template_kwargs_for(engine: str, reasoning: Any) -> dict[str, Any]:
    """The template variables ``engine`` sets from a Responses request's ``reasoning`` object.

    vLLM ``responses/protocol.py@010a69ce`` ``ResponsesRequest.build_chat_params``:
    ``reasoning_effort=reasoning.effort`` (OpenAI's ``Reasoning``: no default), dropped when
    ``None`` by ``merge_kwargs``. SGLang ``serving_responses.py`` ``_make_request`` builds a
    ``ChatCompletionRequest`` with ``reasoning_effort=request.reasoning.effort``, which its chat
    path turns into template variables as for chat (:func:`_template_kwargs_for`); its
    ``ResponseReasoningParam`` (``protocol.py@004c82e0``) defaults ``effort`` to ``"medium"``,
    so a ``reasoning`` object without ``effort`` reaches the template as ``"medium"`` there
    (its ``normalize_reasoning_to_thinking`` sets for ``"none"`` what the chat path sets too).
    The bundled backend and an OpenAI upstream pass none."""
    if not isinstance(reasoning, dict):
        return {}
    if engine == "vllm" and reasoning.get("effort") is not None:
        return {"reasoning_effort": reasoning["effort"]}
    if engine == "sglang":
        return _template_kwargs_for("sglang", {"reasoning_effort": reasoning.get("effort", "medium")})
    return {}


def responses_chat_options(body: dict[str, Any], engines: frozenset[str]) -> ChatOptions:
    """How the engines serving a model render a Responses request's chat: its generation prompt,
    with the template variables its ``reasoning`` object sets
    (:func:`_responses_template_kwargs_for`). Raises :class:`OpenAIError` 400 naming
    ``reasoning.effort`` where those variables differ between the engines."""
    per_engine = [_responses_template_kwargs_for(e, body.get("reasoning")) for e in sorted(engines)] or [{}]
    return ChatOptions(template_kwargs=tuple(sorted(_same_on_every_engine(per_engine, "reasoning.effort").items())))


#: keys a chat message may carry (the OpenAI message params, plus the reasoning text that vLLM and
#: SGLang return and clients send back; a template that reads it is counted with it). Anything
#: else could reach an engine's template uncounted: SGLang, for one, merges a system message's
#: ``tools`` into the prompt.
MESSAGE_KEYS = frozenset(
    ("role", "content", "name", "tool_calls", "tool_call_id", "refusal", "function_call", "audio")
    + ("reasoning_content", "reasoning")
)


def check_message_keys(body: dict[str, Any]) -> None:
    """400 naming ``messages[i].key`` for a message key outside :data:`MESSAGE_KEYS`."""
    for i, m in enumerate(body.get("messages") or ()):
        if isinstance(m, dict):
            for k in m:
                if k not in MESSAGE_KEYS:
                    raise _refuse(f"messages[{i}].{k}", f"Unrecognized message field: 'messages[{i}].{k}'.")


def check_part_uuids(body: dict[str, Any], engines: frozenset[str]) -> None:
    """For vLLM, 400 naming ``messages[i].content[j].uuid`` for a ``text`` or ``refusal`` part
    whose ``uuid`` is not ``null``. vLLM reads a part's ``type`` only when its ``uuid`` is
    ``None`` (``vllm/entrypoints/chat_utils.py@001eadcf`` ``_parse_chat_message_content_mm_part``);
    otherwise the part is what its first media key says (``image_url``, ``audio_url``,
    ``input_audio``, ``video_url``, ...) or, with none, its 400 ("Missing 'type' field in
    multimodal part."). Such a text part was counted as its text and its URL never vetted
    (:func:`_check_images` reads image parts), while vLLM fetched the URL and held an image's
    tokens. An image part's ``uuid`` is left alone: vLLM finds its ``image_url`` first."""
    if "vllm" not in engines:
        return
    for i, m in enumerate(body.get("messages") or ()):
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") in TEXT_PART_TYPES and part.get("uuid") is not None:
                param = f"messages[{i}].content[{j}].uuid"
                raise _refuse(
                    param,
                    f"'{param}' is set on a text part: the engines serving this model then read the part by its "
                    "other keys (as an image, audio or video) or refuse it. Send 'uuid' on media parts only.",
                )


#: SGLang's content parts among those kvgate counts (``protocol.py@004c82e0``
#: ``ChatCompletionMessageContentPart``: text, thinking, image_url, video_url, audio_url,
#: tool_reference; no ``refusal``, no ``input_image``)
SGLANG_PART_TYPES = ("text", "image_url")
#: ``ChatCompletionMessageContentImageURL.detail`` (``Optional[Literal["auto", "low", "high"]]``)
SGLANG_IMAGE_DETAILS = ("auto", "low", "high")


def _sglang_part_problem(part: Any, param: str) -> tuple[str, str] | None:
    """``(param, message)`` for a content part SGLang's request model refuses, else ``None``
    (parts that are no object, or of a type kvgate does not count, are the counter's 400)."""
    if not isinstance(part, dict):
        return None
    ptype = part.get("type")
    if ptype in TEXT_PART_TYPES + IMAGE_PART_TYPES and ptype not in SGLANG_PART_TYPES:
        p = f"{param}.type"
        return (
            p,
            f"'{p}' is '{ptype}': the engines serving this model take content parts of type 'text' and "
            "'image_url' only.",
        )
    if ptype != "image_url":
        return None
    image = part.get("image_url")
    if not isinstance(image, dict) or not isinstance(image.get("url"), str):
        p = f"{param}.image_url"
        return p, f"'{p}' must be an object with the image's 'url' (a string)."
    detail = image.get("detail")
    if detail is not None and detail not in SGLANG_IMAGE_DETAILS:
        p = f"{param}.image_url.detail"
        return p, f"'{p}' must be one of {', '.join(SGLANG_IMAGE_DETAILS)}."
    return None


def _sglang_calls_problem(calls: Any, param: str) -> tuple[str, str] | None:
    """``(param, message)`` for an assistant's tool call SGLang's ``ToolCall`` refuses (``id:
    Optional[str]``, ``type: Literal["function"] = "function"``), else ``None`` (a call that is
    not an object: the counter's 400)."""
    for j, call in enumerate(calls if isinstance(calls, list) else ()):
        if not isinstance(call, dict):
            continue
        if call.get("id") is not None and not isinstance(call["id"], str):
            p = f"{param}[{j}].id"
            return p, f"'{p}' must be a string."
        if "type" in call and call["type"] != "function":
            p = f"{param}[{j}].type"
            return p, f"'{p}' must be 'function'."
    return None


def _sglang_message_problem(m: dict[str, Any], param: str) -> tuple[str, str] | None:
    """``(param, message)`` for a message SGLang's request model refuses, else ``None``."""
    if m.get("role") == "user":
        # ChatCompletionMessageUserParam: content: Union[str, List[...]] (required, not Optional);
        # the user's other keys are ignored (pydantic's default)
        if m.get("content") is None:
            p = f"{param}.content"
            return p, (
                f"'{p}' is missing or null: the engines serving this model require a user message's content "
                "(a string or content parts)."
            )
    else:
        # ChatCompletionMessageGenericParam: tool_call_id, name, reasoning_content: Optional[str]
        # (pydantic does not coerce a number to a string); name: the counter's 400
        for key in ("tool_call_id", "reasoning_content"):
            if m.get(key) is not None and not isinstance(m[key], str):
                p = f"{param}.{key}"
                return p, f"'{p}' must be a string."
        found = _sglang_calls_problem(m.get("tool_calls"), f"{param}.tool_calls")
        if found is not None:
            return found
    content = m.get("content")
    for j, part in enumerate(content if isinstance(content, list) else ()):
        found = _sglang_part_problem(part, f"{param}.content[{j}]")
        if found is not None:
            return found
    return None


def check_sglang_messages(body: dict[str, Any], engines: frozenset[str]) -> None:
    """For SGLang, 400 naming the field for a message its request model refuses
    (``python/sglang/srt/entrypoints/openai/protocol.py@004c82e0``): a user message whose
    ``content`` is missing or ``null``; a ``refusal`` or ``input_image`` part; an ``image_url``
    that is not an object with a string ``url``, or whose ``detail`` is not auto/low/high; a
    ``tool_call_id`` or ``reasoning_content`` that is not a string; a tool call whose ``id`` is
    not a string or whose ``type`` is not ``function``. SGLang answered each with its 400 after
    kvgate had admitted the request and charged its prompt. Shapes the counter refuses (a message
    that is not an object, an unknown part type) are left to its 400."""
    if "sglang" not in engines:
        return
    for i, m in enumerate(body.get("messages") or ()):
        if not isinstance(m, dict):
            return
        found = _sglang_message_problem(m, f"messages[{i}]")
        if found is not None:
            raise _refuse(*found)


#: engines known to encode request text without special-token parsing (special tokens come only
#: from their template): the bundled backend (docs/design.md, Models). vLLM and SGLang render the chat
#: template and encode the result with special tokens parsed; an ``openai`` upstream may be either.
TEXT_ONLY_ENGINES = frozenset({"kvgate"})


@lru_cache(maxsize=64)
def _specials_re(specials: frozenset[str]) -> re.Pattern[str]:
    return re.compile("|".join(re.escape(t) for t in sorted(specials, key=len, reverse=True) if t))


def check_tool_definitions(tools: Any, specials: frozenset[str], engines: frozenset[str], param: str = "tools") -> None:
    """Refuse a tool definition holding the text of one of the model's ``specials`` (its special
    tokens, :attr:`tokenizer.base.PromptCounter.special_token_texts`) in any key or value: the
    template writes definitions verbatim (``tools | tojson``) into the prompt, and an engine that
    parses special tokens there (every engine but :data:`TEXT_ONLY_ENGINES`) would read the text as a
    control token (a forged ``<|im_end|>\\n<|im_start|>system``). Nothing is checked when every
    engine in ``engines`` is text-only or ``specials`` is empty. ``tools``: the request's list
    (chat ``tools``: ``param`` names ``tools[0].function.name``; Responses ``tools``:
    ``tools[0].name``). Message text is not checked here (it is counted as text, never below the
    engine's count). Walks iteratively, so any nesting depth is safe. Raises :class:`OpenAIError`
    400 naming the string's path (a key: the object holding it)."""
    if not any(specials) or not isinstance(tools, list) or (engines and engines <= TEXT_ONLY_ENGINES):
        return
    pattern = _specials_re(specials)
    # (value, its path as a linked (parent, key) chain): a path string is built only for a hit, so
    # a deep and wide definition costs O(size), never O(size x depth)
    stack: list[tuple[Any, tuple]] = [(t, (None, i)) for i, t in reversed(list(enumerate(tools)))]
    while stack:
        x, node = stack.pop()
        if isinstance(x, str):
            found = pattern.search(x)
        elif isinstance(x, dict):
            found = next((m for k in x if isinstance(k, str) and (m := pattern.search(k))), None)
            stack.extend((v, (node, k)) for k, v in reversed(list(x.items())))
        elif isinstance(x, list):
            found = None
            stack.extend((v, (node, j)) for j, v in reversed(list(enumerate(x))))
        else:
            found = None
        if found is not None:
            keys = []
            while node is not None:
                node, key = node
                keys.append(f"[{key}]" if isinstance(key, int) else f".{key}")
            path = param + "".join(reversed(keys))
            raise _refuse(
                path,
                f"'{path}' holds {found.group()!r}, the text of one of this model's special tokens: the engines "
                "serving it would read it as a control token in the prompt. Tool definitions may not contain "
                "special tokens.",
            )


def check_tool_shapes(tools: Any, engines: frozenset[str]) -> None:
    """Refuse a chat tool definition whose ``function`` is not an object holding a string
    ``name``: the request models of vLLM (``ChatCompletionToolsParam``, ``FunctionDefinition(name:
    str)``) and SGLang (``Tool``, ``Function(name: str)``) in their ``protocol.py`` refuse it, so it
    was their 400 after kvgate had admitted the request and charged its prompt (the counters
    render such a tool as sent: :func:`tokenizer.engine_render._tool_parts`). Not checked when
    every engine is ``openai`` (its ``custom`` tools have no ``function``). Checked up to the first
    entry that is not an object (the counter's 400 names it). Raises :class:`OpenAIError` 400 naming
    ``tools[i].function`` or ``tools[i].function.name``."""
    if not isinstance(tools, list) or (engines and engines <= {"openai"}):
        return
    for i, t in enumerate(tools):
        if not isinstance(t, dict):
            return  # the counter's 400 names it first
        fn = t.get("function")
        if not isinstance(fn, dict):
            param = f"tools[{i}].function"
            raise _refuse(param, f"'{param}' must be an object with the function's 'name'.")
        if not isinstance(fn.get("name"), str):
            param = f"tools[{i}].function.name"
            raise _refuse(param, f"'{param}' must be a string.")


def _check_images(body: dict[str, Any], policy: ImagePolicy) -> None:
    allowed = {h.lower() for h in policy.allowed_url_hosts}
    for i, m in enumerate(body.get("messages") or ()):
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in IMAGE_PART_TYPES:
                continue
            param = f"messages[{i}].content[{j}].image_url"
            url = image_url_of(part)
            if url is None:
                raise _refuse(param, f"'{param}' must hold the image's URL (a data: URL).")
            if url[:5].lower() == "data:":
                continue
            try:
                parts = urlsplit(url)
                host = (parts.hostname or "").lower()
            except ValueError:
                parts, host = None, ""
            if parts is None or parts.scheme.lower() not in ("http", "https") or host not in allowed:
                raise _refuse(
                    param,
                    f"'{param}' must be a data: URL"
                    + (f" or an http(s) URL on {', '.join(sorted(allowed))}" if allowed else "")
                    + "; the engine would fetch any other URL itself.",
                )


#: engines that parse no tool calls out of an answer (the bundled backend answers with text)
NO_TOOL_PARSER = frozenset({"kvgate"})


def check_output_constraints(body: dict[str, Any], engines: frozenset[str]) -> None:
    """Refuse what asks the engines to constrain the answer when they cannot (docs/gateway.md,
    "Tools, response_format and the rule between them"), where an engine that parses no tool
    calls and applies no structured output (the bundled backend) serves the model, beside others
    or alone (any of them may get the request): ``tool_choice`` other than ``auto`` / ``none``
    (``tools`` alone change only the prompt: counted and passed), chat's ``response_format`` or
    the Responses API's ``text.format`` other than text. Before the engine is asked, so the
    refusal charges no prompt. Raises :class:`OpenAIError` 400 naming the field."""
    if not engines & NO_TOOL_PARSER:
        return
    if body.get("tool_choice") not in (None, "auto", "none"):
        raise _refuse(
            "tool_choice",
            "'tool_choice' asks for a tool call, but the engines serving this model parse no tool calls "
            "(they answer with text); send 'auto' or 'none', or leave it out.",
        )
    text = body.get("text")
    for param, fmt in (("response_format", body.get("response_format")), ("text.format", _format_of(text))):
        if isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
            raise _refuse(
                param,
                f"'{param}' asks for structured output, but the engines serving this model apply none "
                '(they answer with free text); send {"type": "text"} or leave it out.',
            )


def _format_of(text: Any) -> Any:
    return text.get("format") if isinstance(text, dict) else None


def filter_extensions(body: dict[str, Any], route: str, engines: frozenset[str], openai_fields: frozenset[str]) -> None:
    """Keep in ``body`` the OpenAI fields of ``route`` and the extension fields every engine in
    ``engines`` reads there (:func:`allowed_extensions`); drop (in place) any other field that is
    ``null`` or the engines' own default (:data:`_NO_OP_DEFAULTS`). Raises :class:`OpenAIError`
    400 naming the first other field."""
    allowed = allowed_extensions(engines, route)
    for key in [k for k in body if k not in openai_fields]:
        if key in allowed:
            continue
        value = body[key]
        if value is None or (key in _NO_OP_DEFAULTS and value == _NO_OP_DEFAULTS[key]):
            del body[key]
            continue
        raise _refuse(
            key,
            f"Unrecognized request argument supplied: {key} (the engines serving this model do not accept it).",
        )


def _check_common(body: dict[str, Any], route: str, engines: frozenset[str]) -> None:
    """The policy chat and completions share: extension fields filtered for ``route``'s table
    (:func:`filter_extensions`), OpenAI fields (and object types, :data:`_TYPE_NOT_ON`) only some
    engines honour, at most one grammar."""
    filter_extensions(body, route, engines, OPENAI_FIELDS[route])
    for key, ok in _OPENAI_ONLY_ON.items():
        if body.get(key) is not None and not engines <= ok:
            raise _refuse(key, f"'{key}' is not supported by the engines serving this model.")
    for (key, kind), refusing in _TYPE_NOT_ON.items():
        value = body.get(key)
        if isinstance(value, dict) and value.get("type") == kind and engines & refusing:
            raise _refuse(key, f"'{key}' of type {kind!r} is not supported by the engines serving this model.")
    grammars = [k for k in ("regex", "ebnf", "json_schema") if body.get(k) is not None]
    if len(grammars) > 1:
        raise _refuse(grammars[1], f"Only one of 'regex', 'ebnf' and 'json_schema' may be set; got {grammars}.")


def check_completion_request(body: dict[str, Any], engines: frozenset[str]) -> ChatOptions:
    """Apply the engines' field policy to a validated completions ``body`` before counting
    (:func:`_check_common`; ``echo`` with ``logprobs`` only for ``openai``). Returns the default
    :class:`~tokenizer.chat.ChatOptions`. Raises :class:`OpenAIError` 400 naming the field."""
    _check_common(body, "completions", engines)
    if body.get("echo") and body.get("logprobs") is not None and not engines <= {"openai"}:
        raise _refuse(
            "echo",
            "'echo' with 'logprobs' (prompt logprobs) is not supported by the engines serving this model.",
        )
    return DEFAULT_CHAT


def check_chat_request(
    body: dict[str, Any],
    engines: frozenset[str],
    images: ImagePolicy,
    specials: frozenset[str] = frozenset(),
) -> ChatOptions:
    """Apply the engines' field policy to a validated chat ``body`` before counting. Returns the
    :class:`~tokenizer.chat.ChatOptions` the prompt must be counted with. Drops (in place)
    extension fields that are ``null`` or the engines' own default and not in their table;
    refuses ``tools`` holding one of the model's ``specials`` (:func:`check_tool_definitions`), an
    image part where an engine takes no images
    (:func:`gateway.admission.engine_refusals.check_image_parts`), then image URLs outside the
    model's ``images`` policy. Raises :class:`OpenAIError` 400 naming the field."""
    _check_common(body, "chat", engines)
    check_message_keys(body)
    check_part_uuids(body, engines)
    check_sglang_messages(body, engines)
    check_output_constraints(body, engines)
    check_tool_shapes(body.get("tools"), engines)
    check_tool_definitions(body.get("tools"), specials, engines)
    check_image_parts(body, engines, "chat")  # before the URL policy: no URL makes it acceptable
    _check_images(body, images)
    agp = body.get("add_generation_prompt")
    cfm = body.get("continue_final_message")
    if agp and cfm:
        raise _refuse(
            "continue_final_message", "'continue_final_message' and 'add_generation_prompt' cannot both be true."
        )
    if cfm:
        body["add_generation_prompt"] = False  # vLLM's default is true, and both true is its 400
    per_engine = [_template_kwargs_for(e, body) for e in sorted(engines)] or [
        dict(body.get("chat_template_kwargs") or {})
    ]
    kwargs = _same_on_every_engine(per_engine, "reasoning_effort")
    return ChatOptions(
        add_generation_prompt=bool(cfm is not True and agp is not False),
        continue_final_message=bool(cfm),
        template_kwargs=tuple(sorted(kwargs.items())),
    )


def check_bounded(body: dict[str, Any], bound: int, vocab_size: int) -> None:
    """Checks that need the completion ``bound`` and the model's ``vocab_size``:
    ``min_tokens <= bound``; every ``stop_token_ids`` entry and ``logit_bias`` key
    ``< vocab_size``. Raises :class:`OpenAIError` 400 naming the field."""
    mt = body.get("min_tokens")
    if mt is not None and mt > bound:
        raise _refuse("min_tokens", f"'min_tokens' is {mt}, above this request's completion bound of {bound} tokens.")
    ids = body.get("stop_token_ids")
    if ids:
        bad = next((t for t in ids if t >= vocab_size), None)
        if bad is not None:
            raise _refuse(
                "stop_token_ids", f"'stop_token_ids' holds {bad}, outside the vocabulary (size {vocab_size})."
            )
    bias = body.get("logit_bias")
    if bias:
        bad_key = next((k for k in bias if int(k) >= vocab_size), None)
        if bad_key is not None:
            raise _refuse(
                "logit_bias", f"'logit_bias' names token {bad_key}, outside the vocabulary (size {vocab_size})."
            )


def set_bound(body: dict[str, Any], name: str, bound: int) -> None:
    """Put the completion ``bound`` in ``body`` under ``name`` (the route's ``forwarded_bound``) and remove
    every other alias, so the engine reads exactly the gated value."""
    for alias in ("max_tokens", "max_completion_tokens"):
        body.pop(alias, None)
    body[name] = bound
