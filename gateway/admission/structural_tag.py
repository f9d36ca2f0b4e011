"""``response_format`` of type ``structural_tag``, as vLLM 0.34.0 and SGLang 0.5.23 read it
(xgrammar's structural tags: the ``format`` tree and the legacy ``structures`` / ``triggers``
form): what both engines refuse, checked before the charge (:func:`structural_tag_problem`),
and a walk over a tag's formats for the per-engine checks of
:mod:`gateway.admission.engine_refusals`."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

from gateway.admission.grammar_bounds import MAX_REPEAT_COUNT, ebnf_problem, regex_problem, schema_problem
from gateway.admission.value_checks import Check, boolean, enum, int_in, is_int, string

#: xgrammar's bound on a structural tag's 32-bit counts (token ids, ``max_tokens``, ``max_chars``)
_INT32_MAX = (1 << 31) - 1
#: how deep formats may nest: xgrammar's parser refuses deeper ("Formats are nested deeper than 100
#: levels"; a tag of a ``tags`` list is no level of its own, its ``content`` is)
MAX_FORMAT_DEPTH = 100
#: ``JSONSchemaFormat.style`` (xgrammar ``python/xgrammar/structural_tag.py:34-44``)
_SCHEMA_STYLES = (
    "json",
    "qwen_xml",
    "minimax_xml",
    "minimax_m3_xml",
    "deepseek_xml",
    "glm_xml",
    "cohere_xml",
    "kimi_k3_xml",
    "deepseek_v4_1_xml",
)
_TOKEN = "a token id (an integer from 0 to 2147483647) or a non-empty token string"
_TOKENS = "token ids (integers from 0 to 2147483647) or non-empty token strings"


def _is_text(v: Any) -> bool:
    return isinstance(v, str) and v != ""


def _is_token(v: Any) -> bool:
    return (is_int(v) and 0 <= v <= _INT32_MAX) or _is_text(v)


def _is_token_format(v: Any) -> bool:
    """A ``TokenFormat`` as a tag's ``begin`` / ``end``: its ``type`` may be left out."""
    return isinstance(v, dict) and v.get("type", "token") == "token" and _is_token(v.get("token"))


def _array_of(is_item: Callable[[Any], bool], problem: str, non_empty: bool = False) -> Check:
    def check(v: Any) -> str | None:
        ok = isinstance(v, list) and (bool(v) or not non_empty) and all(is_item(x) for x in v)
        return None if ok else problem

    return check


def _nullable_count(lo: int) -> Check:
    def check(v: Any) -> str | None:
        ok = v is None or (is_int(v) and lo <= v <= _INT32_MAX)
        return None if ok else f"must be null or an integer from {lo} to {_INT32_MAX}"

    return check


def _bounded_text(what: str, bound: Callable[[str], str | None]) -> Check:
    def check(v: Any) -> str | None:
        return bound(v) if _is_text(v) else f"must be a non-empty string ({what})"

    return check


def _format_schema(v: Any) -> str | None:
    return schema_problem(v) if isinstance(v, (dict, bool)) else "must be a JSON Schema (an object or a boolean)"


def _repeat_max(v: Any) -> str | None:
    ok = is_int(v) and (v == -1 or 0 <= v <= MAX_REPEAT_COUNT)
    return None if ok else f"must be -1 (unbounded) or an integer from 0 to {MAX_REPEAT_COUNT}"


def _tag_end(v: Any) -> str | None:
    ok = isinstance(v, str) or _is_token_format(v) or (isinstance(v, list) and v and all(isinstance(x, str) for x in v))
    return None if ok else "must be a string, a non-empty array of strings or a token format"


def _pairs(is_key: Callable[[Any], bool], what: str) -> Check:
    def is_pair(x: Any) -> bool:
        return isinstance(x, list) and len(x) == 2 and is_key(x[0]) and isinstance(x[1], dict)

    return _array_of(is_pair, f"must be a non-empty array of [{what}, format] pairs", non_empty=True)


#: a structural tag field's kind -> its check (``Format`` fields: objects here, each format then
#: checked on its own by :func:`_format_tree_problem`)
_FIELD_KINDS: dict[str, Check] = {
    "str": string,
    "bool": boolean,
    "strs": _array_of(lambda x: isinstance(x, str), "must be an array of strings"),
    "texts": _array_of(_is_text, "must be an array of non-empty strings"),
    "triggers": _array_of(_is_text, "must be a non-empty array of non-empty strings", non_empty=True),
    "token": lambda v: None if _is_token(v) else f"must be {_TOKEN}",
    "tokens": _array_of(_is_token, f"must be an array of {_TOKENS}"),
    "trigger_tokens": _array_of(_is_token, f"must be a non-empty array of {_TOKENS}", non_empty=True),
    "budget": _nullable_count(0),
    "whitespace": _nullable_count(1),
    "style": enum(*_SCHEMA_STYLES),
    "schema": _format_schema,
    "grammar": _bounded_text("an EBNF grammar", ebnf_problem),
    "regex": _bounded_text("a regular expression", regex_problem),
    "min": int_in(0, MAX_REPEAT_COUNT),
    "max": _repeat_max,
    "format": lambda v: None if isinstance(v, dict) else "must be an object (a structural tag format)",
    "formats": _array_of(lambda x: isinstance(x, dict), "must be a non-empty array of formats (objects)", True),
    "tags": _array_of(lambda x: isinstance(x, dict), "must be a non-empty array of tags (objects)", True),
    "rules": _pairs(lambda x: isinstance(x, str), "pattern"),
    "token_rules": _pairs(_is_token, "token"),
    "begin": lambda v: None if isinstance(v, str) or _is_token_format(v) else "must be a string or a token format",
    "end": _tag_end,
    "structures": _array_of(
        lambda x: isinstance(x, dict),
        "must be a non-empty array of objects with a string 'begin', an object 'schema' and a string 'end'",
        non_empty=True,
    ),
}

#: xgrammar's structural tag formats (``python/xgrammar/structural_tag.py:18-505``, the ``Format``
#: union; 0.2.8 under vLLM 0.34.0, 0.2.7 under SGLang 0.5.23, which has no ``JSONSchemaFormat.excludes``):
#: ``type`` -> field -> kind (:data:`_FIELD_KINDS`; ``!``: required). Both engines refuse a missing or
#: mistyped field: SGLang by this pydantic model, vLLM by xgrammar's parser
#: (``Grammar.from_structural_tag``), which takes JSON booleans and integers only.
_FORMATS: dict[str, dict[str, str]] = {
    "const_string": {"value": "str!"},
    "json_schema": {
        "json_schema": "schema!",
        "style": "style",
        "any_order": "bool",
        "max_whitespace_cnt": "whitespace",
        "excludes": "texts",
    },
    "qwen_xml_parameter": {
        "json_schema": "schema!",
        "any_order": "bool",
        "max_whitespace_cnt": "whitespace",
        "excludes": "texts",
    },
    "any_text": {"excludes": "strs", "max_tokens": "budget", "max_chars": "budget"},
    "token": {"token": "token!"},
    "exclude_token": {"exclude_tokens": "tokens"},
    "any_tokens": {"exclude_tokens": "tokens", "max_tokens": "budget"},
    "grammar": {"grammar": "grammar!"},
    "regex": {"pattern": "regex!"},
    "sequence": {"elements": "formats!"},
    "or": {"elements": "formats!"},
    "tag": {"begin": "begin!", "content": "format!", "end": "end!"},
    "triggered_tags": {
        "triggers": "triggers!",
        "tags": "tags!",
        "at_least_one": "bool",
        "stop_after_first": "bool",
        "excludes": "texts",
    },
    "token_triggered_tags": {
        "trigger_tokens": "trigger_tokens!",
        "tags": "tags!",
        "exclude_tokens": "tokens",
        "at_least_one": "bool",
        "stop_after_first": "bool",
    },
    "tags_with_separator": {"tags": "tags!", "separator": "str!", "at_least_one": "bool", "stop_after_first": "bool"},
    "optional": {"content": "format!"},
    "plus": {"content": "format!"},
    "star": {"content": "format!"},
    "repeat": {"min": "min!", "max": "max!", "content": "format!"},
    "dispatch": {"rules": "rules!", "loop": "bool", "excludes": "texts"},
    "token_dispatch": {"rules": "token_rules!", "loop": "bool", "exclude_tokens": "tokens"},
}
#: the legacy form (vLLM ``LegacyStructuralTagResponseFormat``, ``vllm/entrypoints/generate/base/
#: protocol.py:146-157``; SGLang's, ``protocol.py:252-265``, which adds ``at_least_one``)
_LEGACY_FIELDS = {"structures": "structures!", "triggers": "triggers!", "at_least_one": "bool"}
#: formats that may run on without an end of their own -> the field whose non-empty value ends
#: them after all (an excluded string or token; ``None``: nothing does). A tag holding one
#: (directly, or through ``sequence``, ``or``, ``optional``, a bounded ``repeat``) needs a non-empty
#: ``end``.
_ENDLESS: dict[str, str | None] = {
    "any_text": "excludes",
    "any_tokens": "exclude_tokens",
    "triggered_tags": "excludes",
    "token_triggered_tags": "exclude_tokens",
    "dispatch": "excludes",
    "token_dispatch": "exclude_tokens",
    "tags_with_separator": None,
    "star": None,
    "plus": None,
}


def _at(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _fields_problem(node: dict[str, Any], fields: dict[str, str], path: str, kind: str) -> str | None:
    """The first field of ``node`` (a format of type ``kind`` at ``path``, or the legacy form at
    ``""``) that is missing though required, or fails its kind's check."""
    for name, field in fields.items():
        if name not in node:
            if field.endswith("!"):
                where = f"'{path}' " if path else ""
                return f"{where}of type {kind} needs '{name}'"
            continue
        problem = _FIELD_KINDS[field.rstrip("!")](node[name])
        if problem is not None:
            return f"'{_at(path, name)}' {problem}"
    return None


def _endless(fmt: Any) -> bool:
    """Whether a format may run on without an end of its own (xgrammar's parser: "When the content
    is unlimited, at least one end string must be non-empty"). Recurses at most as deep as the JSON
    nests (:func:`json_size_problem`: 254 levels)."""
    if not isinstance(fmt, dict):
        return False
    kind = fmt.get("type")
    if isinstance(kind, str) and kind in _ENDLESS:
        bound = _ENDLESS[kind]
        return bound is None or not fmt.get(bound)
    if kind == "repeat" and fmt.get("max") == -1:
        return True
    if kind in ("sequence", "or"):
        kids = fmt.get("elements")
    elif kind in ("optional", "repeat"):
        kids = [fmt.get("content")]
    else:
        return False
    return isinstance(kids, list) and any(_endless(k) for k in kids)


def _trigger_problem(triggers: list[Any], begins: list[tuple[str, Any]], where: str, prefix: bool) -> str | None:
    """Each tag's begin (``(path, begin)``) must begin with exactly one of ``triggers`` (``prefix``: a
    trigger string is a prefix of the begin string; else the begin token is the trigger token), and
    each trigger must begin a tag (xgrammar: "One tag does not match any trigger", "One tag matches
    multiple triggers"; an unused trigger fails its grammar build)."""
    counts = Counter(triggers)
    lengths = sorted({len(t) for t in counts}) if prefix else []
    used: set[Any] = set()
    for path, begin in begins:
        hits = {begin[:n] for n in lengths if n <= len(begin)} if prefix else {begin}
        hits &= counts.keys()
        found = sum(counts[h] for h in hits)
        if found != 1:
            if prefix:
                return f"'{path}' must begin with exactly one of '{where}' (it begins with {found})"
            return f"'{path}' must be exactly one of '{where}' (it is {found})"
        used |= hits
    unused = next((i for i, t in enumerate(triggers) if t not in used), None)
    return None if unused is None else f"'{where}[{unused}]' begins none of the tags"


def _tag_rule(fmt: dict[str, Any], path: str) -> str | None:
    ends = fmt["end"] if isinstance(fmt["end"], list) else [fmt["end"]]
    if all(e == "" for e in ends) and _endless(fmt["content"]):
        return f"'{path}.end' must hold a non-empty string: '{path}.content' has no end of its own"
    return None


def _triggered_rule(fmt: dict[str, Any], path: str) -> str | None:
    """``triggered_tags``: each tag's string ``begin`` against ``triggers``; ``token_triggered_tags``:
    each tag's token-format ``begin`` against ``trigger_tokens`` (xgrammar: "Tags in triggered_tags
    must have a string begin", "... in token_triggered_tags must have a token format begin")."""
    by_string = fmt["type"] == "triggered_tags"
    where = f"{path}.triggers" if by_string else f"{path}.trigger_tokens"
    begins = []
    for i, tag in enumerate(fmt["tags"]):
        begin, at = tag.get("begin"), f"{path}.tags[{i}].begin"
        if isinstance(begin, str) if by_string else _is_token_format(begin):
            begins.append((at, begin) if by_string else (f"{at}.token", begin["token"]))
        elif by_string and _is_token_format(begin):
            return f"'{at}' must be a string (triggered tags begin with one of '{where}')"
        elif isinstance(begin, str):
            return f"'{at}' must be a token format (token-triggered tags begin with one of '{where}')"
        else:
            return None  # the tag's own check names its begin
    return _trigger_problem(fmt["triggers" if by_string else "trigger_tokens"], begins, where, prefix=by_string)


def _repeat_rule(fmt: dict[str, Any], path: str) -> str | None:
    if fmt["max"] != -1 and fmt["min"] > fmt["max"]:
        return f"'{path}.min' must be <= '{path}.max'"
    return None


#: checks across a format's fields, after each field passed its own
_FORMAT_RULES: dict[str, Callable[[dict[str, Any], str], str | None]] = {
    "tag": _tag_rule,
    "triggered_tags": _triggered_rule,
    "token_triggered_tags": _triggered_rule,
    "repeat": _repeat_rule,
}


def _format_problem(fmt: Any, path: str, tag_item: bool) -> str | None:
    """What is wrong with one format (``tag_item``: a tag of a ``tags`` list, whose ``type`` may be
    left out), its nested formats aside."""
    if not isinstance(fmt, dict):
        return f"'{path}' must be an object (a structural tag format)"
    kind = fmt.get("type", "tag") if tag_item else fmt.get("type")
    if tag_item and kind != "tag":
        return f"'{path}.type' must be 'tag'"
    if not isinstance(kind, str) or kind not in _FORMATS:
        return f"'{path}.type' must be one of {', '.join(_FORMATS)}"
    problem = _fields_problem(fmt, _FORMATS[kind], path, kind)
    rule = _FORMAT_RULES.get(kind)
    return problem if problem is not None or rule is None else rule(fmt, path)


def _format_kids(fmt: dict[str, Any], path: str, tag_item: bool) -> list[tuple[Any, str, bool]]:
    """The formats nested in a checked format: ``(format, path, is a tag of a tags list)``."""
    kids: list[tuple[Any, str, bool]] = []
    for name, field in _FORMATS["tag" if tag_item else fmt["type"]].items():
        at = f"{path}.{name}"  # the fields below are required: there, and checked
        if field == "format!":
            kids.append((fmt[name], at, False))
        elif field in ("formats!", "tags!"):
            kids += [(x, f"{at}[{i}]", field == "tags!") for i, x in enumerate(fmt[name])]
        elif field in ("rules!", "token_rules!"):
            kids += [(x[1], f"{at}[{i}][1]", False) for i, x in enumerate(fmt[name])]
    return kids


#: formats that xgrammar (0.2.7 and 0.2.8) cannot hold anywhere inside a ``repeat`` -> what it does
_NOT_IN_REPEAT = {
    "token_dispatch": "the engines' grammar library crashes on it (the engine process dies)",
    "token_triggered_tags": "the engines' grammar library then matches none of its tags",
}


def _repeat_problem(fmt: dict[str, Any], path: str, inside: str | None, product: int) -> str | None:
    """A format of :data:`_NOT_IN_REPEAT` inside the ``repeat`` at ``inside``; a ``repeat`` whose
    count times the counts of the repeats around it (``product``) is above :data:`MAX_REPEAT_COUNT`
    (each count is copies the engine's grammar unrolls; a ``max`` of -1 repeats ``min`` copies and
    then any)."""
    kind = fmt["type"]
    if inside is not None and kind in _NOT_IN_REPEAT:
        return f"'{path}' ({kind}) must not be inside a repeat ('{inside}'): {_NOT_IN_REPEAT[kind]}"
    if kind == "repeat" and product * max(fmt["min"], fmt["max"], 1) > MAX_REPEAT_COUNT:
        return f"'{path}' nests repeat counts whose product is above {MAX_REPEAT_COUNT:,}"
    return None


def _format_tree_problem(root: Any) -> str | None:
    """Check a structural tag's ``format`` and every format nested in it, in document order
    (iteratively): :func:`_format_problem`, at most :data:`MAX_FORMAT_DEPTH` formats deep,
    :func:`_repeat_problem`."""
    stack: list[tuple[Any, str, bool, int, int, str | None]] = [(root, "format", False, 1, 1, None)]
    while stack:
        fmt, path, tag_item, depth, product, inside = stack.pop()
        if depth > MAX_FORMAT_DEPTH:
            return f"'{path}' nests formats more than {MAX_FORMAT_DEPTH} deep"
        problem = _format_problem(fmt, path, tag_item) or (
            None if tag_item else _repeat_problem(fmt, path, inside, product)
        )
        if problem is not None:
            return problem
        if not tag_item and fmt["type"] == "repeat":
            product, inside = product * max(fmt["min"], fmt["max"], 1), path
        kids = _format_kids(fmt, path, tag_item)
        stack += [(kid, at, is_tag, depth + (not is_tag), product, inside) for kid, at, is_tag in reversed(kids)]
    return None


def structural_tag_formats(fmt: dict[str, Any]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """``(path, type, format)`` for every format of a checked structural tag's ``format`` form
    (``fmt`` the ``response_format``; paths from ``format``), tags of ``tags`` lists as type
    ``tag`` and a tag's token-format ``begin`` / ``end`` as type ``token``, in document order."""
    stack: list[tuple[Any, str, bool]] = [(fmt["format"], "format", False)]
    while stack:
        node, path, tag_item = stack.pop()
        kind = "tag" if tag_item else node["type"]
        yield path, kind, node
        if kind == "tag":
            yield from ((f"{path}.{k}", "token", node[k]) for k in ("begin", "end") if isinstance(node[k], dict))
        stack += reversed(_format_kids(node, path, tag_item))


def _legacy_problem(v: dict[str, Any]) -> str | None:
    """The legacy form: ``structures`` of a string ``begin`` and ``end`` and an object ``schema``
    (null or left out: SGLang reads ``{}``, vLLM refuses it; :mod:`gateway.admission.engine_refusals`),
    ``triggers``, each structure's ``begin`` beginning with exactly one of them (xgrammar turns the
    form into a ``triggered_tags`` format: ``StructuralTag.from_legacy_structural_tag``)."""
    problem = _fields_problem(v, _LEGACY_FIELDS, "", "structural_tag")
    if problem is not None:
        return problem
    for i, s in enumerate(v["structures"]):
        for key in ("begin", "end"):
            if not isinstance(s.get(key), str):
                return f"'structures[{i}].{key}' must be a string"
        schema = s.get("schema")
        if schema is not None and not isinstance(schema, dict):
            return f"'structures[{i}].schema' must be an object (a JSON Schema)"
        if schema is not None and (problem := schema_problem(schema)) is not None:
            return f"'structures[{i}].schema' {problem}"
    begins = [(f"structures[{i}].begin", s["begin"]) for i, s in enumerate(v["structures"])]
    return _trigger_problem(v["triggers"], begins, "triggers", prefix=True)


def _holds_nul(v: Any) -> bool:
    """Whether a NUL character is in any string (key or value) of ``v``: SGLang refuses such a
    grammar after admission (``constrained/base_grammar_backend.py:161-186``, ``:284-288``), xgrammar's
    regex converter in vLLM too."""
    stack = [v]
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            if "\x00" in node:
                return True
        elif isinstance(node, dict):
            stack += [*node.keys(), *node.values()]
        elif isinstance(node, list):
            stack += node
    return False


def structural_tag_problem(v: dict[str, Any]) -> str | None:
    """``response_format`` of type ``structural_tag``, as both engines read it: vLLM 0.34.0
    (``vllm/entrypoints/generate/base/protocol.py:146-168``, the ``format`` form and the legacy
    ``structures`` / ``triggers`` form; ``:214-272``, validated before the request is admitted by
    xgrammar's parser, ``vllm/v1/structured_output/backend_xgrammar.py:561-580``), SGLang 0.5.23
    (``python/sglang/srt/entrypoints/openai/protocol.py:252-272``: the legacy form or xgrammar's
    ``StructuralTag``; compiled after admission, ``constrained/xgrammar_backend.py:426-453``). Both
    take the legacy form when ``structures`` is there (a ``format`` beside it is ignored; refused
    here), else the ``format`` form (:func:`_format_tree_problem`); no NUL anywhere. Stricter than
    the engines: a format needs its ``type`` (vLLM guesses an absent one from the keys), booleans and
    integers must be JSON ones (SGLang's pydantic coerces ``"true"`` and ``1.0``), and the grammar
    bounds apply to the schemas, patterns, grammars and ``repeat`` counts inside."""
    if _holds_nul(v):
        return "must not hold a NUL character (\\u0000)"
    if "structures" not in v:
        if "format" not in v:
            return "of type structural_tag needs 'format' (or the legacy 'structures' and 'triggers')"
        return _format_tree_problem(v["format"])
    if v.get("format") is not None:
        return "of type structural_tag takes 'format' or the legacy 'structures' and 'triggers', not both"
    return _legacy_problem(v)
