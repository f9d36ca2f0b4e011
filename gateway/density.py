"""How many JSON values a request body holds, found before it is parsed.

orjson builds one Python object per value and holds the GIL while it parses, so a worker thread
does not keep it off the event loop: ``[""] * 2_000_000`` (6 MB) holds the loop for about 100 ms
whatever thread parses it. Text is cheap to parse (a string is one copy), values are not. So a
body holding more values than ``gateway.max_body_values`` is refused (413) before it is parsed:
:func:`values_over` counts the commas outside strings (one per value after the first in each
array or object), in slices of :data:`SLICE_BYTES`, each C-level step short enough that the
event loop's thread gets the GIL between them when this runs in a worker thread.
"""

from __future__ import annotations

#: bytes scanned per C-level step
SLICE_BYTES = 256 * 1024
_KEEP = b'",'
_DELETE = bytes(b for b in range(256) if b not in _KEEP)


def values_over(raw: bytes, limit: int) -> int | None:
    """The number of commas outside JSON strings in ``raw`` (a lower bound of its values minus
    one per container) when it is above ``limit``, else ``None``. Exact for valid JSON; for
    invalid JSON any answer is fine (the parser refuses it anyway). Cost: a few passes over
    ``raw`` at memory speed, in slices."""
    if raw.count(b",") <= limit:
        return None  # not even counting commas inside strings is it over
    # escapes first: an escaped backslash, then an escaped quote, is never a string boundary
    parts = []
    for i in range(0, len(raw), SLICE_BYTES):
        part = raw[i : i + SLICE_BYTES]
        parts.append(part.translate(None, _DELETE) if b"\\" not in part else part)
    compact = b"".join(parts)
    if b"\\" in compact:
        compact = compact.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _DELETE)
    outside = 0
    start = 0
    n = len(compact)
    while start < n:
        end = min(n, start + SLICE_BYTES)
        if compact.count(b'"', start, end) % 2:  # do not cut a string: end after its closing quote
            close = compact.find(b'"', end)
            end = n if close < 0 else close + 1
        # only quotes and commas are left: split at the quotes, and the even pieces are outside
        # strings, made of nothing but commas
        outside += sum(map(len, compact[start:end].split(b'"')[0::2]))
        start = end
    return outside if outside > limit else None
