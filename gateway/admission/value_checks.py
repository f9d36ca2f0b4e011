"""The value checks a field table is built from (:mod:`gateway.admission.checks`): each returns
a problem (``"must be ..."``) or ``None``, the wording of the 400 that names the field."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Check = Callable[[Any], str | None]  # returns a problem ("must be ...") or None


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_num(v: Any) -> bool:
    return (isinstance(v, (int, float))) and not isinstance(v, bool)


def _in_range(is_kind: Callable[[Any], bool], kind: str, lo: float | None, hi: float | None) -> Check:
    def check(v: Any) -> str | None:
        if not is_kind(v):
            out = isinstance(v, float) and lo is not None and hi is not None and not lo <= v <= hi
            if is_kind is is_int and out and v.is_integer():
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
    return _in_range(is_int, "an integer", lo, hi)


def num_in(lo: float | None = None, hi: float | None = None) -> Check:
    """A check: a number (int or float, not a bool) in ``[lo, hi]``."""
    return _in_range(is_num, "a number", lo, hi)


def boolean(v: Any) -> str | None:
    return None if isinstance(v, bool) else "must be a boolean"


def string(v: Any) -> str | None:
    return None if isinstance(v, str) else "must be a string"


def obj(v: Any) -> str | None:
    return None if isinstance(v, dict) else "must be an object"


def array(v: Any) -> str | None:
    return None if isinstance(v, list) else "must be an array"


def str_or_obj(v: Any) -> str | None:
    return None if isinstance(v, (str, dict)) else "must be a string or an object"


def anything(v: Any) -> str | None:
    return None


def one_of(*values: str) -> Check:
    """A check: one of ``values`` (any JSON value compared; the problem quotes them)."""

    def check(v: Any) -> str | None:
        return None if v in values else "must be one of " + ", ".join(repr(x) for x in values)

    return check


def enum(*values: str) -> Check:
    """A check: a string among ``values``."""

    def check(v: Any) -> str | None:
        return None if isinstance(v, str) and v in values else f"must be one of {', '.join(values)}"

    return check
