"""Bounds on guided-decoding grammars (``regex``, ``ebnf``, ``json_schema``, ``response_format``
and Responses ``text.format`` schemas) before an engine compiles them into a finite-state machine.

Refused, each as a problem string for a 400 naming the field (:mod:`gateway.admission.checks`):

- counted repetition above :data:`MAX_REPEAT_COUNT` (``a{1001}``, ``a{2,1001}``), also as the
  product of nested counts (``(a{40}){40}``), and JSON-schema ``minItems``/``maxItems``/
  ``minLength``/``maxLength``/``minProperties``/``maxProperties``/``minContains``/``maxContains``
  above it: each count is states the compiler must unroll;
- nested quantifiers: a repeated group whose body is, apart from parts that may match nothing,
  itself a repetition (``(a+)+``, ``(a*b?)*``, ``((ab)*)+``);
- overlapping alternatives under a quantifier: a repeated group with two alternatives that can
  begin with the same character (``(a|a)*``, ``(xa|ya|xb)+``), or one that may match nothing
  (``(a|)*``).

Regular expressions are read as Python's own parser (``re._parser``) reads them: it folds
``(ab|ac)`` into ``a[bc]`` and ``(a|b)`` into ``[ab]``, which are unambiguous and pass. One it
cannot read is refused, since it cannot be checked. The limits are documented in docs/gateway.md.
"""

from __future__ import annotations

import importlib
import re
from typing import Any

_sre: Any = importlib.import_module("re._parser")
_c: Any = importlib.import_module("re._constants")

#: largest repetition count (and product of nested counts) a grammar may ask for
MAX_REPEAT_COUNT = 1000
_UNBOUNDED = _c.MAXREPEAT
_REPEATS = {_c.MAX_REPEAT, _c.MIN_REPEAT, getattr(_c, "POSSESSIVE_REPEAT", _c.MAX_REPEAT)}
_ZERO_WIDTH = {_c.AT, _c.ASSERT, _c.ASSERT_NOT, _c.GROUPREF, getattr(_c, "GROUPREF_EXISTS", _c.GROUPREF)}
_EVERY = [(0, 0x10FFFF)]
_CATEGORIES = {
    _c.CATEGORY_DIGIT: [(48, 57)],
    _c.CATEGORY_SPACE: [(9, 13), (32, 32)],
    _c.CATEGORY_WORD: [(48, 57), (65, 90), (95, 95), (97, 122), (128, 0x10FFFF)],
}
#: JSON-schema keywords whose value is a count
SCHEMA_COUNTS = (
    "minItems",
    "maxItems",
    "minLength",
    "maxLength",
    "minProperties",
    "maxProperties",
    "minContains",
    "maxContains",
)


class _Refused(Exception):
    pass


_OVERLAP = "has overlapping alternatives under a quantifier (they can begin alike)"


def _items(node: Any) -> list:
    return list(node.data) if hasattr(node, "data") else list(node)


def _children(op: Any, av: Any) -> list[Any]:
    """The sub-sequences of one parsed item."""
    if op in _REPEATS:
        return [av[2]]
    if op is _c.SUBPATTERN:
        return [av[3]]
    if op is _c.BRANCH:
        return list(av[1])
    if op in (_c.ASSERT, _c.ASSERT_NOT):
        return [av[1]]
    if op is getattr(_c, "ATOMIC_GROUP", None):
        return [av]
    return []


def _nullable(seq: Any) -> bool:
    return all(_nullable_item(op, av) for op, av in _items(seq))


def _nullable_item(op: Any, av: Any) -> bool:
    if op in _ZERO_WIDTH:
        return True
    if op in _REPEATS:
        return av[0] == 0 or _nullable(av[2])
    if op is _c.BRANCH:
        return any(_nullable(alt) for alt in av[1])
    kids = _children(op, av)
    return bool(kids) and all(_nullable(k) for k in kids)


def _exposes_repeat(seq: Any) -> bool:
    """Whether ``seq`` is, apart from items that may match nothing, one repetition."""
    items = _items(seq)
    for i, (op, av) in enumerate(items):
        if _exposing_item(op, av) and all(_nullable_item(o, a) for j, (o, a) in enumerate(items) if j != i):
            return True
    return False


def _exposing_item(op: Any, av: Any) -> bool:
    if op in _REPEATS:  # a variable count (a+, a*, a{1,5}); a fixed one (a{10}) is one way to match
        return (av[1] == _UNBOUNDED or av[1] > max(av[0], 1)) or _exposes_repeat(av[2])
    if op is _c.BRANCH:
        return any(_exposes_repeat(alt) for alt in av[1])
    return any(_exposes_repeat(k) for k in _children(op, av))


def _first_item(op: Any, av: Any) -> list[tuple[int, int]]:
    if op is _c.LITERAL:
        return [(av, av)]
    if op is _c.IN:
        out: list[tuple[int, int]] = []
        for o, a in av:
            if o is _c.NEGATE:
                return _EVERY
            if o is _c.LITERAL:
                out.append((a, a))
            elif o is _c.RANGE:
                out.append(a)
            else:  # a category: \d, \s, \w, or a negated one (everything)
                out.extend(_CATEGORIES.get(a, _EVERY))
        return out
    if op in (_c.ANY, _c.NOT_LITERAL):
        return _EVERY
    return [r for kid in _children(op, av) for r in _first(kid)] if op not in _ZERO_WIDTH else []


def _first(seq: Any) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for op, av in _items(seq):
        out.extend(_first_item(op, av))
        if not _nullable_item(op, av):
            break
    return out


def _overlap(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> bool:
    return any(lo1 <= hi2 and lo2 <= hi1 for lo1, hi1 in a for lo2, hi2 in b)


def _check_alternatives(seq: Any) -> None:
    items = _items(seq)
    while len(items) == 1 and items[0][0] is _c.SUBPATTERN:
        items = _items(items[0][1][3])
    for op, av in items:
        if op is not _c.BRANCH:
            continue
        alts = av[1]
        empty = sum(_nullable(alt) for alt in alts)
        if empty == 1:
            raise _Refused("has an alternative that may match nothing under a quantifier")
        if empty > 1:  # (a|a) reads as a(|): two alternatives that match alike
            raise _Refused(_OVERLAP)
        firsts = [_first(alt) for alt in alts]
        for i in range(len(firsts)):
            for j in range(i + 1, len(firsts)):
                if _overlap(firsts[i], firsts[j]):
                    raise _Refused(_OVERLAP)


def _walk(seq: Any, multiplier: int) -> None:
    for op, av in _items(seq):
        if op in _REPEATS:
            lo, hi, body = av
            if lo > MAX_REPEAT_COUNT or (hi != _UNBOUNDED and hi > MAX_REPEAT_COUNT):
                raise _Refused(f"has counted repetition above {MAX_REPEAT_COUNT:,}")
            count = max(lo, 1) if hi == _UNBOUNDED else max(hi, 1)
            if multiplier * count > MAX_REPEAT_COUNT:
                raise _Refused(f"has nested counted repetition above {MAX_REPEAT_COUNT:,} in all")
            if hi == _UNBOUNDED or hi > 1:
                if _exposes_repeat(body):
                    raise _Refused("has nested quantifiers (a repeated group that is itself a repetition)")
                _check_alternatives(body)
            _walk(body, multiplier * count)
        else:
            for kid in _children(op, av):
                _walk(kid, multiplier)


def regex_problem(pattern: str) -> str | None:
    """What makes ``pattern`` unsafe to compile (module docstring), or ``None``."""
    try:
        parsed = _sre.parse(pattern)
    except (re.error, OverflowError, RecursionError):
        return "must be a regular expression kvgate can read"
    try:
        _walk(parsed, 1)
    except _Refused as e:
        return str(e)
    except RecursionError:
        return "is nested too deeply"
    return None


_EBNF_LITERAL = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|\[(?:[^\]\\]|\\.)*\]')
_EBNF_COUNT = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")
_QUANTIFIER = "*+?{"


def _ebnf_group_problem(body: str, quantified: bool) -> str | None:
    if not quantified:
        return None
    stripped = body.strip()
    if stripped and stripped[-1] in "*+}" and "|" not in stripped and " " not in stripped.rstrip("*+}"):
        return "has nested quantifiers (a repeated group that is itself a repetition)"
    alts = [a.strip() for a in stripped.split("|")] if "|" in stripped else []
    heads = [a[:2] for a in alts]
    if any(not a for a in alts):
        return "has an alternative that may match nothing under a quantifier"
    if len(set(heads)) < len(heads):
        return "has overlapping alternatives under a quantifier (they can begin alike)"
    return None


def ebnf_problem(grammar: str) -> str | None:
    """What makes an EBNF ``grammar`` unsafe to compile (module docstring), or ``None``: counted
    repetition ``{n,m}`` above :data:`MAX_REPEAT_COUNT`; a quantified group ``( ... )*`` whose
    body is one quantified element, or whose alternatives begin alike (string literals and
    character classes are compared by their first character)."""
    for m in _EBNF_COUNT.finditer(_EBNF_LITERAL.sub("x", grammar)):
        if any(g and int(g) > MAX_REPEAT_COUNT for g in m.groups()):
            return f"has counted repetition above {MAX_REPEAT_COUNT:,}"
    text = _EBNF_LITERAL.sub(lambda m: "L" + m.group()[1:2].replace(" ", "_"), grammar)
    stack: list[int] = []
    for i, ch in enumerate(text):
        if ch == "(":
            stack.append(i)
        elif ch == ")" and stack:
            start = stack.pop()
            quantified = text[i + 1 : i + 2] in tuple(_QUANTIFIER) and text[i + 1 : i + 2] != "?"
            problem = _ebnf_group_problem(text[start + 1 : i], quantified)
            if problem is not None:
                return problem
    return None


def schema_problem(schema: Any) -> str | None:
    """What makes a JSON ``schema`` (parsed) unsafe to compile, or ``None``: a count keyword
    (:data:`SCHEMA_COUNTS`) above :data:`MAX_REPEAT_COUNT`, or a ``pattern`` /
    ``patternProperties`` key refused by :func:`regex_problem`. The problem names the keyword's
    path (``properties.tags.maxItems``). Walks iteratively, so any depth is safe."""
    stack: list[tuple[Any, str]] = [(schema, "")]
    while stack:
        node, path = stack.pop()
        if isinstance(node, list):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(node))
            continue
        if not isinstance(node, dict):
            continue
        for key, value in node.items():
            where = f"{path}.{key}" if path else str(key)
            if key in SCHEMA_COUNTS and isinstance(value, (int, float)) and value > MAX_REPEAT_COUNT:
                return f"has '{where}' {value}, above {MAX_REPEAT_COUNT:,}"
            if key == "pattern" and isinstance(value, str) and (problem := regex_problem(value)) is not None:
                return f"has '{where}' that {problem}"
            if key == "patternProperties" and isinstance(value, dict):
                for pat in value:
                    if (problem := regex_problem(pat)) is not None:
                        return f"has a '{where}' key that {problem}"
            stack.append((value, where))
    return None
