"""Step 2: read a request body (size limit, paced, checked as it arrives) and parse it as one
strict JSON object (docs/design.md). A body above the limit is a 413; one that is not strict JSON
a 400 ``invalid_request_error``. Validation against a route's field table is
:mod:`gateway.admission.checks`.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from config.errors import ErrorCode, OpenAIError
from gateway.admission.checks import bad_value
from gateway.edge.body_budget import FREE_BODY_BYTES


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
            raise bad_value(
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


def non_finite_member(e: orjson.JSONDecodeError) -> str | None:
    """The top-level field whose value made orjson stop at ``e.pos``, when that value is a
    non-finite number (``NaN``, ``Infinity``, ``-Infinity`` in any case, or a number beyond a
    double such as ``1e999``); else ``None`` (nested, or another syntax error). The body is parsed
    once more with that value replaced by a marker string, so this costs one more parse, on
    the error path only. The marker is drawn for each call: a fixed one, which a client can
    send as another field's value, got that field named instead."""
    doc, pos = e.doc, e.pos
    if not isinstance(doc, str) or not 0 <= pos < len(doc):
        return None
    start = pos - 1 if pos > 0 and doc[pos - 1] == "-" else pos
    m = _NON_FINITE.match(doc, start)
    if m is None and "infinity" in str(e).lower():
        m = _NON_FINITE_NUMBER.match(doc, start)
    if m is None:
        return None
    mark = f"\x00kvgate:non-finite:{secrets.token_hex(16)}"
    try:
        data = orjson.loads(doc[:start] + orjson.dumps(mark).decode() + doc[m.end() :])
    except orjson.JSONDecodeError:
        return None
    if isinstance(data, dict):
        for k, v in data.items():
            if v == mark:
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
    with ``connection: close`` (:func:`closing`); a disconnect before the body's end raises
    :class:`ClientGone` (its tenant ``"-"``: the caller knows it)."""
    try:
        return await _read(receive, headers_content_length, limit, check, pace)
    except OpenAIError as e:  # refused before the body was all read: the connection is not kept for it
        raise closing(e) from None


def _check_declared(headers_content_length: str | None, limit: int) -> None:
    """413 for a ``Content-Length`` above ``limit``, 400 for one that is not a number."""
    if headers_content_length is None:
        return
    try:
        declared = int(headers_content_length)
    except ValueError:
        raise OpenAIError(400, "Invalid Content-Length header.", code=ErrorCode.INVALID_REQUEST) from None
    if declared > limit:
        raise too_large(limit)


async def _read(
    receive: Any,
    headers_content_length: str | None,
    limit: int,
    check: Callable[[bytes], None] | None,
    pace: Callable[[int], Awaitable[object]] | None,
) -> bytes:
    _check_declared(headers_content_length, limit)
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
    """The client disconnected before its request body arrived: ``tenant_id``, the tenant whose
    body it was (``"-"`` when the reader did not say); ``refused``, ``(status, code)`` when the
    server layer had answered the request itself and closed the connection (a body too slow: 408;
    :func:`gateway.edge.extensions.refusal_of`), so that the client got that answer rather than
    leaving."""

    def __init__(self, tenant_id: str = "-", refused: tuple[int, str] | None = None) -> None:
        super().__init__(tenant_id, refused)
        self.tenant_id = tenant_id
        self.refused = refused
