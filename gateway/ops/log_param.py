"""The access log's ``param``: the refused field's JSON path, with client-chosen names hashed.

An error's ``param`` names the field as the client sent it (``messages[2].my_secret_key``), so a
name the gateway does not know is client text. :func:`loggable_param` keeps indices and known
field names and replaces every other name with ``#`` + 12 hex digits of its SHA-256: repeats of
one unknown name still correlate in the log, the name itself is not written.
"""

from __future__ import annotations

import hashlib
import re
from functools import cache

from gateway.admission import checks, fields
from gateway.routes import API_ROUTES, TOKEN_ROUTES

_SEGMENT = re.compile(r"\[(\d+)\]|\[([^\]]*)\]|([^.\[\]]+)")

#: names inside the known top-level fields (messages, content parts, tools, response formats,
#: Responses items) that a refusal's path may name
_NESTED = (
    "content text type image_url url detail input_text input_image input_file output_text function "
    "arguments name description parameters strict tool_calls tool_call_id call_id id output json_schema "
    "schema format effort summary include_usage role refusal reasoning reasoning_content audio file"
).split()


@cache
def known_names() -> frozenset[str]:
    """Every field name of every route's table, message keys, extensions and :data:`_NESTED`."""
    names = set(checks.EXTENSION_FIELDS)
    for api in (*API_ROUTES, *TOKEN_ROUTES):
        names |= set(api.fields)
    return frozenset(names | fields.MESSAGE_KEYS | set(_NESTED))


def _hashed(name: str) -> str:
    return "#" + hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:12]


def loggable_param(param: str | None) -> str | None:
    """``param`` with every segment that is not an index or a known field name hashed:
    ``"messages[2].secret"`` -> ``"messages[2].#2bb80d537b1d"``; ``None`` stays ``None``."""
    if not param:
        return param
    known = known_names()
    out: list[str] = []
    for m in _SEGMENT.finditer(param):
        index, other, name = m.groups()
        if index is not None:
            out.append(f"[{index}]")
        elif other is not None:
            out.append(f"[{_hashed(other)}]")
        else:
            out.append(("." if out else "") + (name if name in known else _hashed(name)))
    return "".join(out)
