"""Steps 1 and 3: read and parse the body strictly, then validate it against the OpenAI request
schemas of ``/v1/completions`` and ``/v1/chat/completions`` (docs/design.md).

Validation is by hand (a table of field checks), not by building pydantic models per request: it
is on the hot path. Every failure is a 400 ``invalid_request_error`` whose ``param`` names the
field; a body above the limit is a 413. Message and prompt *contents* are validated by the
tokenizer while counting (it raises typed errors naming ``messages[i].content[j].type`` etc.).
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from config.errors import ErrorCode, OpenAIError
from gateway.admission.grammar_bounds import ebnf_problem, regex_problem, schema_problem
from gateway.edge.body_budget import FREE_BODY_BYTES

Check = Callable[[Any], str | None]  # returns a problem ("must be ...") or None


def _bad(param: str, problem: str) -> OpenAIError:
    return OpenAIError(400, f"Invalid value for '{param}': {problem}", code=ErrorCode.INVALID_REQUEST, param=param)


def parse_json_body(body: bytes) -> dict[str, Any]:
    """Decode a request body as one strict JSON object.

    orjson rejects ``NaN``/``Infinity``, invalid UTF-8 and lone surrogates. Raises
    :class:`OpenAIError` 400 (``param`` ``None``) for an empty body, malformed JSON or a
    non-object top level.
    """
    if not body:
        raise OpenAIError(400, "The request body is empty; expected a JSON object.", code=ErrorCode.INVALID_REQUEST)
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        msg = str(e)
        if "utf-8" in msg.lower() or "surrogate" in msg.lower():
            text = "The request body is not valid UTF-8 JSON."
        elif (name := non_finite_member(e)) is not None:
            raise _bad(
                name, "must be a finite number (NaN, Infinity and numbers beyond a double are not JSON)"
            ) from None
        else:
            text = f"We could not parse the JSON body of your request ({msg})."
        raise OpenAIError(400, text, code=ErrorCode.INVALID_REQUEST) from None
    if not isinstance(data, dict):
        raise OpenAIError(400, "The request body must be a JSON object.", code=ErrorCode.INVALID_REQUEST)
    return data


_NON_FINITE = re.compile(r"-?(?:nan|inf(?:inity)?)", re.IGNORECASE)
_NON_FINITE_NUMBER = re.compile(r"-?[0-9][0-9.eE+-]*")
_MARK = "\x00kvgate:non-finite"


def non_finite_member(e: orjson.JSONDecodeError) -> str | None:
    """The top-level field whose value made orjson stop at ``e.pos``, when that value is a
    non-finite number (``NaN``, ``Infinity``, ``-Infinity`` in any case, or a number beyond a
    double such as ``1e999``); else ``None`` (nested, or another syntax error). The body is parsed
    once more with that value replaced by a marker string, so this costs one more parse, on
    the error path only."""
    doc, pos = e.doc, e.pos
    if not isinstance(doc, str) or not 0 <= pos < len(doc):
        return None
    start = pos - 1 if pos > 0 and doc[pos - 1] == "-" else pos
    m = _NON_FINITE.match(doc, start)
    if m is None and "infinity" in str(e).lower():
        m = _NON_FINITE_NUMBER.match(doc, start)
    if m is None:
        return None
    try:
        data = orjson.loads(doc[:start] + orjson.dumps(_MARK).decode() + doc[m.end() :])
    except orjson.JSONDecodeError:
        return None
    if isinstance(data, dict):
        for k, v in data.items():
            if v == _MARK:
                return k
    return None


def closing(e: OpenAIError) -> OpenAIError:
    """``e`` answered with ``connection: close``: for a refusal while the request's body is unread
    or still arriving (the server layer then lingers, reading and dropping what the client still
    sends for a moment, so that the client gets the answer rather than a reset:
    :class:`gateway.edge.protocol._LingeringTransport`), instead of reading the rest of a refused body to
    keep the connection."""
    e.headers = {**(e.headers or {}), "connection": "close"}
    return e


def body_declared(headers: Any) -> bool:
    """Whether the request's headers announce a body (``Content-Length`` above 0, or
    ``Transfer-Encoding``)."""
    length = headers.get("content-length")
    return headers.get("transfer-encoding") is not None or (length is not None and length.strip() not in ("", "0"))


def too_large(limit: int) -> OpenAIError:
    """The 413 for a body above ``limit`` bytes."""
    return OpenAIError(413, f"The request body is larger than {limit} bytes.", code=ErrorCode.REQUEST_TOO_LARGE)


async def read_body(
    receive: Any,
    headers_content_length: str | None,
    limit: int,
    check: Callable[[bytes], None] | None = None,
    pace: Callable[[int], Awaitable[object]] | None = None,
) -> bytes:
    """Read the ASGI request body, refusing more than ``limit`` bytes (413) before reading it all
    when ``Content-Length`` says so, and while reading when it does not. ``check``: called with
    each read as it arrives; what it raises (e.g. an :class:`OpenAIError`) ends the read.
    ``pace``: awaited with the bytes of each read past the body's first
    :data:`gateway.edge.body_budget.FREE_BODY_BYTES` (:meth:`gateway.edge.body_budget.BodyBudget.pacer`)
    before the next read is taken. Every refusal (413, 400, what ``check`` raises) is raised
    with ``connection: close`` (:func:`closing`)."""
    try:
        return await _read(receive, headers_content_length, limit, check, pace)
    except OpenAIError as e:  # refused before the body was all read: the connection is not kept for it
        raise closing(e) from None


async def _read(
    receive: Any,
    headers_content_length: str | None,
    limit: int,
    check: Callable[[bytes], None] | None,
    pace: Callable[[int], Awaitable[object]] | None,
) -> bytes:
    if headers_content_length is not None:
        try:
            if int(headers_content_length) > limit:
                raise too_large(limit)
        except ValueError:
            raise OpenAIError(400, "Invalid Content-Length header.", code=ErrorCode.INVALID_REQUEST) from None
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone()
        chunk = message.get("body", b"")
        if chunk:
            size += len(chunk)
            if size > limit:
                raise too_large(limit)
            if check is not None:
                check(chunk)
            chunks.append(chunk)
            if pace is not None and size > FREE_BODY_BYTES:
                await pace(min(len(chunk), size - FREE_BODY_BYTES))
        if not message.get("more_body", False):
            break
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


class ClientGone(Exception):
    """The client disconnected before its request body arrived."""


# ------------------------------------------------------------------ field checks
def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return (isinstance(v, (int, float))) and not isinstance(v, bool)


def _in_range(is_kind: Callable[[Any], bool], kind: str, lo: float | None, hi: float | None) -> Check:
    def check(v: Any) -> str | None:
        if not is_kind(v):
            out = isinstance(v, float) and lo is not None and hi is not None and not lo <= v <= hi
            if is_kind is _is_int and out and v.is_integer():
                # orjson reads an integer beyond 64 bits as a float: say so, with the range
                return f"must be an integer from {lo} to {hi}"
            return f"must be {kind}"
        if lo is not None and v < lo:
            return f"must be >= {lo}"
        if hi is not None and v > hi:
            return f"must be <= {hi}"
        return None

    return check


def int_in(lo: int | None = None, hi: int | None = None) -> Check:
    """A check: an integer (not a bool) in ``[lo, hi]``."""
    return _in_range(_is_int, "an integer", lo, hi)


def num_in(lo: float | None = None, hi: float | None = None) -> Check:
    """A check: a number (int or float, not a bool) in ``[lo, hi]``."""
    return _in_range(_is_num, "a number", lo, hi)


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


#: most ``stop`` strings (the OpenAI schema's 4; vLLM and SGLang take any number)
MAX_STOPS = 16
#: longest ``stop`` string, in UTF-8 bytes: every decode step scans the new text against each
#: string, and vLLM holds back that many characters of a stream until it can rule a match out
MAX_STOP_BYTES = 1024
#: all ``stop`` strings of a request together, in UTF-8 bytes
MAX_STOP_TOTAL_BYTES = 4096


def stop_problem(v: Any) -> str | None:
    """``stop``: a string or at most :data:`MAX_STOPS` strings, each at most
    :data:`MAX_STOP_BYTES` and all together at most :data:`MAX_STOP_TOTAL_BYTES` (UTF-8)."""
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or len(stops) > MAX_STOPS or not all(isinstance(s, str) for s in stops):
        return f"must be a string or an array of at most {MAX_STOPS} strings"
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
            if not isinstance(b, bool):
                return f"'{k}' must be a boolean"
        else:
            return f"unknown option '{k}'"
    return None


INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
#: largest grammar string (``regex``, ``ebnf``, ``json_schema``) forwarded, in UTF-8 bytes
MAX_GRAMMAR_BYTES = 32 * 1024
#: most ``stop_token_ids`` entries
MAX_STOP_TOKEN_IDS = 64
#: ``chat_template_kwargs`` keys passed through: booleans that Jinja templates read to switch
#: reasoning on or off (Qwen3/GLM ``enable_thinking``, DeepSeek-V3.1/Kimi ``thinking``). They are
#: given to the counting template as well, so their prompt effect is counted. Any other key
#: (``tools``, ``documents``, ``add_generation_prompt`` merged into the template by vLLM, ...) is refused.
TEMPLATE_KWARGS_ALLOWED = ("enable_thinking", "thinking")


def _enum(*values: str) -> Check:
    def check(v: Any) -> str | None:
        return None if isinstance(v, str) and v in values else f"must be one of {', '.join(values)}"

    return check


def _logit_bias(v: Any) -> str | None:
    problem = "must be an object of at most 300 token ids (as strings) mapping to numbers in [-100, 100]"
    if not isinstance(v, dict) or len(v) > 300:
        return problem
    for k, b in v.items():
        if not (k.isdigit() and len(k) <= 10) or not _is_num(b) or not -100 <= b <= 100:
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


def _str_list_of(*values: str) -> Check:
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


def _response_format(v: Any) -> str | None:
    if not isinstance(v, dict) or v.get("type") not in ("text", "json_object", "json_schema"):
        return "must be an object whose 'type' is text, json_object or json_schema"
    if len(orjson.dumps(v)) > MAX_GRAMMAR_BYTES:  # the engine compiles the schema into a grammar
        return f"must be at most {MAX_GRAMMAR_BYTES} bytes as JSON"
    spec = v.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    problem = schema_problem(schema) if schema is not None else None
    return None if problem is None else f"'json_schema.schema' {problem}"


def _stop_token_ids(v: Any) -> str | None:
    if isinstance(v, list) and len(v) <= MAX_STOP_TOKEN_IDS and all(_is_int(t) and 0 <= t < (1 << 31) for t in v):
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
        if not _is_num(v):
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
    "ignore_eos": _bool,
    "skip_special_tokens": _bool,
    "spaces_between_special_tokens": _bool,
    "stop_token_ids": _stop_token_ids,  # and < the vocabulary size (gateway.admission.fields)
    "no_stop_trim": _bool,
    "regex": _regex,
    "ebnf": _ebnf,
    "json_schema": _json_schema_str,
    "separate_reasoning": _bool,
    "stream_reasoning": _bool,
    "chat_template_kwargs": _template_kwargs,
    "continue_final_message": _bool,
    "add_generation_prompt": _bool,
}

#: OpenAI fields common to both routes (the official SDK's completion_create_params).
_COMMON: dict[str, Check] = {
    "model": _str,
    "max_tokens": int_in(1, INT64_MAX),  # 0 is refused: engines disagree on what it means
    "n": int_in(1, 128),
    "stream": _bool,
    "stream_options": _stream_options,
    "temperature": num_in(0, 2),
    "top_p": num_in(0, 1),
    "stop": stop_problem,
    "seed": int_in(INT64_MIN, INT64_MAX),
    "presence_penalty": num_in(-2, 2),
    "frequency_penalty": num_in(-2, 2),
    "logit_bias": _logit_bias,  # and ids < the vocabulary size (gateway.admission.fields)
    "user": _str,
    "cache_salt": _str,  # dropped: the gateway sets the tenant's own
}

_CHAT_EXTENSIONS = (
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
    "separate_reasoning",
    "stream_reasoning",
    "chat_template_kwargs",
    "continue_final_message",
    "add_generation_prompt",
)
_COMPLETION_EXTENSIONS = (
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
    "json_schema",
)

CHAT_FIELDS: dict[str, Check] = {
    **_COMMON,
    "messages": _list,  # contents: validated by the tokenizer
    "max_completion_tokens": int_in(1, INT64_MAX),
    "logprobs": _bool,
    "top_logprobs": int_in(0, 20),
    "tools": _list,
    "tool_choice": _str_or_obj,
    "parallel_tool_calls": _bool,
    "response_format": _response_format,
    "functions": _list,
    "function_call": _str_or_obj,
    "reasoning_effort": _enum("none", "minimal", "low", "medium", "high", "xhigh"),
    "modalities": _str_list_of("text", "audio"),
    "verbosity": _enum("low", "medium", "high"),
    "prediction": _obj,
    "audio": _obj,
    "web_search_options": _obj,
    "metadata": metadata_problem,
    "store": _bool,
    "service_tier": _enum("auto", "default", "flex", "scale", "priority", "fast"),
    "prompt_cache_key": _str,
    "prompt_cache_retention": _enum("in_memory", "24h"),
    "prompt_cache_options": _prompt_cache_options,
    "safety_identifier": _str,
    "moderation": _obj,
    **{k: EXTENSION_FIELDS[k] for k in _CHAT_EXTENSIONS},
}

COMPLETION_FIELDS: dict[str, Check] = {
    **_COMMON,
    "prompt": _any,  # shape: validated by the tokenizer (string, strings, ids, id lists)
    "echo": _bool,
    "logprobs": int_in(0, 5),
    "best_of": int_in(1, 128),
    "suffix": _str,
    **{k: EXTENSION_FIELDS[k] for k in _COMPLETION_EXTENSIONS},
}

#: The OpenAI fields of each route (everything else a route accepts is an engine extension).
OPENAI_FIELDS: dict[str, frozenset[str]] = {
    "chat": frozenset(CHAT_FIELDS) - frozenset(_CHAT_EXTENSIONS),
    "completions": frozenset(COMPLETION_FIELDS) - frozenset(_COMPLETION_EXTENSIONS),
}

REQUIRED = {"chat": ("messages",), "completions": ("prompt",)}


def validate(body: dict[str, Any], route: str) -> None:
    """Check every top-level field of an OpenAI request body for ``route`` (``chat`` or
    ``completions``): required fields present, known fields of the right type and range (``null``
    is accepted for optional fields), unknown fields refused. Raises :class:`OpenAIError` 400 with
    ``param`` the field name."""
    fields = CHAT_FIELDS if route == "chat" else COMPLETION_FIELDS
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
    if body.get("best_of") is not None and body.get("n") is not None and body["best_of"] < body["n"]:
        raise _bad("best_of", "must be >= 'n'")
    if body.get("stream_options") is not None and not body.get("stream"):
        raise OpenAIError(
            400,
            "'stream_options' is only allowed when 'stream' is true.",
            code=ErrorCode.INVALID_REQUEST,
            param="stream_options",
        )
