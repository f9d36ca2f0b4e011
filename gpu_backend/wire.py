"""Wire types of the bundled backend: what crosses between the engine, the nodes and the router
(in process, or as JSON between processes). No torch here: the router imports it too.

- :class:`Token`: one generated token (the decode stream's NDJSON line, the router's token).
- :class:`PrefillOutcome`: what prefill reports once it has sent a request's pages.
- :func:`engine_request_id`: the engine-side id of a request in one bootstrap room (the request's
  identity on both nodes and in ``/disagg/abort``; the client's id is only a label).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Token:
    """One generated token.

    ``text`` is the incremental UTF-8-safe text this token adds (may be ``""`` while a multi-byte
    character or a possible stop string is incomplete; EOS / stop tokens add no text; a matched stop
    string is cut out). ``finish_reason``: ``"stop"`` (EOS, stop id or stop string), ``"length"``
    (max_new_tokens) or ``"abort"``; ``None`` until ``finished``. ``prompt_tokens``: the prompt's
    token count (for a placeholder-admitted request, the original count, as the incident reported);
    ``completion_tokens``: tokens generated so far, this one included. An ``"abort"`` token carries
    ``token_id == -1`` and no text.
    """

    token_id: int
    text: str
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int

    def to_json(self) -> dict[str, Any]:
        """The NDJSON object of the decode stream (the six fields by name)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, obj: Any) -> Token:
        """Inverse of :meth:`to_json`; ``ValueError`` for a missing, unknown or mistyped field."""
        return cls(**_fields_of(cls, obj))


@dataclass(frozen=True)
class PrefillOutcome:
    """What prefill reports after sending a request's pages to decode.

    ``num_tokens``: tokens written into the pages (1 for a placeholder); ``first_token_id``: sampled
    from the last prompt position; ``prefill_seconds``: wall time from admission to the first token;
    ``placeholder``: the prompt was over the limit and replaced (``admit_rejected`` fault, test use);
    ``original_prompt_tokens``: the prompt's length as received.
    """

    num_tokens: int
    first_token_id: int
    prefill_seconds: float
    placeholder: bool
    original_prompt_tokens: int

    def to_json(self) -> dict[str, Any]:
        """The JSON body of ``POST /disagg/prefill`` (the five fields by name)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, obj: Any) -> PrefillOutcome:
        """Inverse of :meth:`to_json`; ``ValueError`` for a missing, unknown or mistyped field."""
        return cls(**_fields_of(cls, obj))


#: whether a JSON value fits a wire field, by the field's annotation (a bool is no int)
_FITS = {
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "bool": lambda v: isinstance(v, bool),
    "str": lambda v: isinstance(v, str),
    "str | None": lambda v: v is None or isinstance(v, str),
}


def _fields_of(cls: Any, obj: Any) -> dict[str, Any]:
    """``obj`` (a JSON object a peer node sent) when it has exactly the fields of the wire type
    ``cls``, each of its type; else ``ValueError`` naming the first misfit. Unchecked, a faulty
    peer's line raised ``TypeError`` deep in the router (a 500), or its wrong types went on."""
    fields = dataclasses.fields(cls)
    names = [f.name for f in fields]
    if not isinstance(obj, dict) or set(obj) != set(names):
        raise ValueError(f"a {cls.__name__} has exactly the fields {', '.join(names)}")
    for f in fields:
        if not _FITS[str(f.type)](obj[f.name]):
            raise ValueError(f"{cls.__name__}.{f.name} must be {f.type}, not {type(obj[f.name]).__name__}")
    return obj


def engine_request_id(request_id: str, room: int) -> str:
    """The engine-side id of ``request_id`` in bootstrap room ``room`` (an int in [0, 2**64)): unique
    per room, so a retried or repeated client id never collides inside an engine. Both nodes use it,
    and it is the identity the router aborts by (``/disagg/abort``'s ``request_id``): the client's id
    alone names no request."""
    return f"{request_id}@{room:016x}"
